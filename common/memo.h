/* Internal: a small memo of a pure step's answers, keyed by the bytes the
 * step reads (its key, which the caller builds), the oldest answer evicted
 * first. Keys and values are copied in (or a value the step allocated
 * taken, kvf_memo_keep_taking); a slot keeps its buffers and reuses them
 * while they are large enough, so a memo that misses on every call
 * allocates nothing once its slots have grown. Its users: the staged runs
 * cache and the staged plan's memo (host/core/xfer_stage.c) and the memo of
 * built blobs (kernels/plan.c).
 *
 * Threading: none of its own; the owner serializes calls. A memo is zeroed
 * before its first use and released with kvf_memo_free. */
#ifndef KVF_COMMON_MEMO_H
#define KVF_COMMON_MEMO_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KVF_MEMO_SLOTS 16

typedef struct kvf_memo_slot {
  unsigned char *key;
  size_t key_size; /* 0: matches nothing (empty, or kept without a key) */
  size_t key_cap;
  unsigned char *value;
  size_t value_size;
  size_t value_cap;
  uint64_t result[2]; /* what the step returned besides its bytes */
} kvf_memo_slot;

typedef struct kvf_memo {
  kvf_memo_slot slots[KVF_MEMO_SLOTS];
  uint32_t next;          /* the slot kvf_memo_keep fills next */
  unsigned char *scratch; /* room for the key being built (kvf_memo_scratch) */
  size_t scratch_cap;
  uint64_t hits, misses;
} kvf_memo;

/* Room for a key of `size` bytes, valid until the next call of this
 * function or kvf_memo_free; NULL without memory. */
unsigned char *kvf_memo_scratch(kvf_memo *memo, size_t size);

/* The slot holding `key` (size > 0 bytes), counted as a hit; NULL, counted
 * as a miss, when none does. */
const kvf_memo_slot *kvf_memo_find(kvf_memo *memo, const void *key, size_t size);

/* Copies an answer into the next slot, evicting its answer: the value's
 * bytes and two results, under a copy of the key (key_size 0, or no memory
 * for the key: kept without one, which nothing finds, until the slot is
 * reused). Returns the slot; NULL without memory for the value (the slot is
 * then empty). */
const kvf_memo_slot *kvf_memo_keep(kvf_memo *memo, const void *key, size_t key_size, const void *value,
                                   size_t value_size, uint64_t result0, uint64_t result1);

/* As kvf_memo_keep, but the slot takes `value` (from malloc; may be NULL
 * when value_size is 0) rather than a copy of it, freeing its own buffer:
 * for an answer the step allocated anyway. Never fails; the key as there. */
const kvf_memo_slot *kvf_memo_keep_taking(kvf_memo *memo, const void *key, size_t key_size, void *value,
                                          size_t value_size, uint64_t result0, uint64_t result1);

void kvf_memo_free(kvf_memo *memo);

#ifdef __cplusplus
}
#endif

#endif
