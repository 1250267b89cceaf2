/*
 * Internal: the L1 object store of a cache server (DESIGN.md §2, §8).
 *
 * L1 holds cache objects in memory pools the caller provides (pinned host
 * memory on a GPU's NUMA node for kvferryd; plain host memory on the host
 * backend), one pool per device. The store never allocates or frees pool
 * memory itself: it carves objects out of the pools with its own allocator
 * (256-byte aligned extents, coalesced when freed).
 *
 * Objects are keyed by (L1 key, object group). An L1 key is a chunk key (the
 * chained SHA-256 prefix hash of one chunk of tokens, kvf_chunk_keys, or an
 * engine's own 32-byte block hash) in a scope: the canonical geometry
 * fingerprint and the shard of the registration that sent it, so that
 * another model's geometry or another tensor-parallel rank never finds
 * objects under the same chunk key. The objects of one L1 key form an
 * *entry*. Each object carries the header
 * kvf_object_header_init() wrote (fingerprint, format, token range, payload
 * bytes), so a retrieve through another geometry is refused clearly.
 *
 * Life of an object:
 *   reserve  -> reserved: space taken, invisible to lookups, never evicted;
 *               the store's kernel writes it;
 *   commit   -> committed: visible, evictable unless pinned;
 *   abort    -> freed (the reservation's space returns to its pool).
 * Lookups pin the committed objects they return; a pinned object (and its
 * whole entry) is never evicted until unpinned.
 *
 * Eviction: when a reservation does not fit its pool, whole entries (every
 * object of one key, in every pool: never part of a chunk) that hold
 * an object in that pool are evicted in least-recently-used order, skipping
 * entries that hold a reserved or pinned object. An entry becomes most
 * recently used when an object of it is committed or looked up.
 *
 * Threading: every function is safe from any thread (one mutex, held for
 * bookkeeping only: never while bytes are copied). create/destroy must not
 * race other calls.
 */
#ifndef KVF_HOST_L1_H
#define KVF_HOST_L1_H

#include <stdint.h>

#include <kvferry/client.h>
#include <kvferry/geometry.h>
#include <kvferry/status.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvf_l1 kvf_l1;
typedef struct kvf_l1_reservation kvf_l1_reservation;
typedef struct kvf_l1_pin kvf_l1_pin;

#define KVF_L1_ALIGN 256u

/* One pool: size bytes at base (owned by the caller, outliving the store).
 * The store uses size rounded down to KVF_L1_ALIGN. */
typedef struct kvf_l1_pool_desc {
  int device;    /* the pool's name: a CUDA device ordinal, or -1 for the host backend; unique */
  void *base;    /* KVF_L1_ALIGN-aligned; pools must not overlap */
  uint64_t size; /* bytes; at least KVF_L1_ALIGN */
} kvf_l1_pool_desc;

/* Create a store over num_pools pools (1 .. 64). Returns KVF_SUCCESS and
 * *out; KVF_ERR_INVALID_ARGUMENT naming the field (pools[1].base: not
 * aligned; pools[2].device: repeated); KVF_ERR_OUT_OF_MEMORY. */
kvf_status kvf_l1_create(const kvf_l1_pool_desc *pools, uint32_t num_pools, kvf_l1 **out);

/* Free the store's bookkeeping (not the pools). Reservations and pins still
 * held are logged. NULL is a no-op. */
void kvf_l1_destroy(kvf_l1 *l1);

/* What L1 files an entry under; equal only when every field is equal. */
typedef struct kvf_l1_key {
  kvf_chunk_key chunk;  /* not all zero */
  uint64_t fingerprint; /* kvf_geometry_fingerprint(geometry, canonical) of the registration */
  uint32_t shard_index; /* the registration's shard (0 of 1: unsharded) */
  uint32_t shard_count;
} kvf_l1_key;

/* ---- storing -------------------------------------------------------------- */

/* One object a store wants to write. */
typedef struct kvf_l1_object_spec {
  kvf_l1_key key;           /* key.chunk not all zero */
  uint32_t object_group;    /* < KVF_MAX_GROUPS */
  kvf_object_header header; /* kvf_object_header_init's; header.payload_bytes > 0 */
} kvf_l1_object_spec;

/* What a reservation did with each spec. */
typedef enum kvf_l1_slot_state {
  KVF_L1_SLOT_RESERVED = 1, /* space reserved at data: write it, then commit */
  KVF_L1_SLOT_PRESENT = 2,  /* an identical object (same header) is committed or reserved by another
                               request: nothing to write */
} kvf_l1_slot_state;

typedef struct kvf_l1_slot {
  kvf_l1_slot_state state;
  void *data; /* RESERVED: header.payload_bytes writable bytes; PRESENT: NULL */
} kvf_l1_slot;

/* Reserve space in pool `device` for the objects of specs[0 .. n), all or
 * nothing: slots[i] (caller's array of n) says what happened to specs[i].
 * A spec whose (key, object group) is committed or reserved (in any
 * pool) with an equal header is PRESENT; with a different header it is refused
 * (KVF_ERR_GEOMETRY_MISMATCH naming "specs[i].header.fingerprint", or the
 * field that differs: format, token_begin, token_end, payload_bytes, dcp_rank).
 * Space is made by evicting unpinned, unreserved entries of that pool in LRU
 * order (never an entry whose key one of these specs names).
 * RESERVED slots are allocated in spec order. Returns KVF_SUCCESS and *out (a handle even when every slot is
 * PRESENT: commit or abort it); KVF_ERR_OUT_OF_MEMORY (does not fit even
 * after evicting everything evictable: the message gives the bytes needed,
 * free and evictable; nothing was evicted); KVF_ERR_INVALID_ARGUMENT (NULL,
 * n 0, unknown pool, an all-zero chunk key, object group out of range, a spec repeated
 * in specs); KVF_ERR_GEOMETRY_MISMATCH. Nothing is reserved on failure.
 * *failed_spec (failed_spec may be NULL) is set on every return: the index
 * of the spec at fault when the failure is about one spec (a field of it, a
 * header that differs from the stored object's, a repeat of an earlier
 * spec), whose message then starts with "specs[<index>]" followed by
 * ".<field>: " or ": "; UINT32_MAX otherwise (success included). Callers
 * that name the object their own way use the index, not the message. */
kvf_status kvf_l1_reserve(kvf_l1 *l1, int device, const kvf_l1_object_spec *specs, uint32_t n,
                          kvf_l1_slot *slots, kvf_l1_reservation **out, uint32_t *failed_spec);

/* Make the reservation's objects visible (committed, most recently used)
 * and free the handle. Only call once the bytes are proven written. */
void kvf_l1_commit(kvf_l1 *l1, kvf_l1_reservation *reservation);

/* Free the reservation's space and the handle; its objects never become
 * visible. Only call once nothing can still write into them. */
void kvf_l1_abort(kvf_l1 *l1, kvf_l1_reservation *reservation);

/* ---- retrieving ----------------------------------------------------------- */

typedef struct kvf_l1_query {
  kvf_l1_key key;
  uint32_t object_group;
} kvf_l1_query;

typedef struct kvf_l1_found {
  int found;                /* 1: committed and now pinned */
  const void *data;         /* header.payload_bytes readable bytes */
  kvf_object_header header;
} kvf_l1_found;

/* Look up queries[0 .. n) among committed objects and pin every one found
 * (found[i], caller's array of n). *out receives one pin handle for all of
 * them (also when none was found): release it with kvf_l1_unpin once the
 * bytes have been read. A query repeated in queries pins its object twice
 * (one handle still releases both). Found entries become most recently used.
 * n may be 0 (queries and found may then be NULL): an empty handle.
 * Returns KVF_SUCCESS; KVF_ERR_INVALID_ARGUMENT (NULL, an all-zero chunk key, an object
 * group out of range: the message names queries[i]); KVF_ERR_OUT_OF_MEMORY. */
kvf_status kvf_l1_lookup_pin(kvf_l1 *l1, const kvf_l1_query *queries, uint32_t n, kvf_l1_found *found,
                             kvf_l1_pin **out);

/* Release a pin handle from kvf_l1_lookup_pin. NULL is a no-op. */
void kvf_l1_unpin(kvf_l1 *l1, kvf_l1_pin *pin);

/* 1 when the chunk key of `key` has a committed object of object_group
 * filed under another canonical fingerprint (another model; any shard),
 * with that scope in *other and its header in *header (either may be
 * NULL); 0 otherwise. Only the first KVF_L1_MAX_SCOPES scopes (fingerprint,
 * shard) are searched: a peer refuses a request for another model's
 * objects by name instead of answering a miss (docs/peers.md). Pins
 * nothing. */
#define KVF_L1_MAX_SCOPES 64u
int kvf_l1_other_scope(kvf_l1 *l1, const kvf_l1_key *key, uint32_t object_group, kvf_l1_key *other,
                       kvf_object_header *header);

/* ---- counters ------------------------------------------------------------- */

typedef struct kvf_l1_stats {
  uint64_t entries;           /* keys with at least one object (committed or reserved) */
  uint64_t objects;           /* committed objects */
  uint64_t bytes_committed;   /* payload of committed objects */
  uint64_t objects_reserved;
  uint64_t bytes_reserved;
  uint64_t objects_pinned;    /* committed objects with at least one pin */
  uint64_t pool_bytes;        /* sum of the pools' usable sizes (or the one pool's) */
  uint64_t bytes_free;        /* not allocated to any object (extents incl. alignment) */
  uint64_t evicted_entries_total; /* one pool: entries evicted that held an object in it */
  uint64_t evicted_bytes_total;   /* payload bytes of the evicted objects */
  uint64_t committed_total;   /* objects committed since create */
  uint64_t aborted_total;     /* objects whose reservation was aborted */
} kvf_l1_stats;

/* Counters for every pool (device = KVF_L1_ALL_POOLS) or one pool.
 * KVF_ERR_INVALID_ARGUMENT for NULL or an unknown pool. */
#define KVF_L1_ALL_POOLS (-2)
kvf_status kvf_l1_stats_get(kvf_l1 *l1, int device, kvf_l1_stats *out);

#ifdef __cplusplus
}
#endif

#endif /* KVF_HOST_L1_H */
