/* Internal: the launch plan shared by the CUDA kernel and the host backend.
 *
 * A geometry is flattened once per object format into "segments": one per
 * (attention layer, plane) or (recurrent layer, state). A segment says where
 * its runs are in a cache block and where they go in an object:
 *
 *   cache  = base[region] + src_offset + id*src_block + t*src_token + h*src_head
 *   object = objects[k] + n_k*dst_per_token + dst_const + bi*dst_block
 *                       + t*dst_token + h*dst_head
 *
 * with run bytes per (token, head), n_k the object's local token count and
 * bi the block's index inside the object. Heads contiguous on both sides are
 * fused into one run at plan time.
 *
 * A request becomes a "launch blob": a header, one entry per moving segment
 * (its block 0's address, its offsets in the object, its group's block
 * range and its first task), the block ids, the object pointers, the shapes
 * the entries share (strides, run, vector width: one or a few per blob), and
 * a task -> entry table where the header's multiplier does not serve. A task is (entry, block,
 * slice of at most the blob's slice bytes, KVF_SLICE_BYTES unless the build
 * asks for smaller ones); one warp (GPU) or one loop (CPU) copies a task. The
 * blob is plain data: the host builds it, the kernel reads it from device
 * memory or from its own parameters (small blobs), the CPU path from host
 * memory. A build may take only some segments (a staged call's pieces).
 *
 * Nothing here includes a CUDA header: plan.c is C, xfer_kernel.cu includes
 * this file too. */
#ifndef KVF_KERNELS_PLAN_H
#define KVF_KERNELS_PLAN_H

#include <stdint.h>

#include <kvferry/copy.h>
#include "common/memo.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Bytes one task moves at most by default: small enough to spread a
 * one-chunk request over every SM, large enough that a task's setup is a
 * small share. A build may ask for smaller slices (kvf_blob_opts). */
#define KVF_SLICE_BYTES 8192u
/* The smallest slice a build takes: one 16-byte unit per lane of a warp. */
#define KVF_SLICE_MIN_BYTES 512u

typedef struct kvf_segment {
  uint64_t src_offset;    /* from the region base, block 0 */
  uint64_t src_block;     /* block (slot) stride */
  uint64_t src_token;
  uint64_t src_head;
  uint64_t dst_per_token; /* object position = n_k*dst_per_token + dst_const */
  uint64_t dst_const;
  uint64_t dst_block;     /* per block inside the object */
  uint64_t dst_token;
  uint64_t dst_head;
  uint32_t run;           /* contiguous bytes per (token, head) */
  uint32_t heads;         /* runs per token after fusion (1 for states) */
  uint32_t tokens;        /* block_size (1 for states) */
  uint32_t region;
  uint32_t group;
  uint32_t object_group;
  uint32_t recurrent;
  uint32_t align;         /* largest power of two <= 16 dividing run, offsets and strides */
  uint32_t view;          /* the geometry's view (layer) it belongs to: a view's segments are consecutive */
  uint32_t pad_;
} kvf_segment;

/* Segments of a geometry for one format, in group, layer, plane/state order. */
typedef struct kvf_plan {
  kvf_segment *segments;
  uint32_t num_segments;
  uint32_t *group_first;  /* [num_groups + 1]: segments of group g are [group_first[g], group_first[g+1]) */
  uint32_t num_groups;
  uint32_t wide;          /* segments whose byte offsets inside one block need more than 32 bits (the warp
                             walk's addressing, kernels/walk.h, does not take them) */
} kvf_plan;

kvf_status kvf_plan_build(const kvf_geometry *geometry, kvf_object_format format, kvf_plan *out);
void kvf_plan_free(kvf_plan *plan);

/* ---- the launch blob ---------------------------------------------------- */

/* One moving segment of a blob: where its blocks are and its tasks. What
 * segments share (strides, run shape, vector width, slice) is in the blob's
 * shape table, so that a one-chunk blob fits a few KiB of kernel
 * parameters: 48 bytes an entry where the whole segment took 160. The
 * launch copies all of a parameter blob's bytes on every call (0.3-0.5 us
 * from 2 to 12 KiB on an H200, xfer_kernel.cu's kParamSizes), so fields are
 * as narrow as the plan allows: offsets inside an object in 32 bits
 * (kvf_plan_build refuses wider), the region's base added in, and no
 * segment index (kvf_blob_entry_segments gives it to host tools). */
typedef struct kvf_blob_entry {
  uint64_t cache_base;    /* the segment's block 0: its region's base + its src_offset */
  uint64_t first_task;    /* tasks of this entry: [first_task, next entry's first_task) */
  uint64_t lb_rel;        /* ids[ids_offset]'s block from the request's first (attention: local block
                             lb_rel + the shape's first_block; recurrent: chunk lb_rel + chunk_begin) */
  uint32_t dst_per_token; /* the segment's: object position = n_k*dst_per_token + dst_const + ... */
  uint32_t dst_const;     /* the segment's */
  uint32_t ids_offset;    /* into the blob's ids (a request's block tables hold fewer than 2^32 blocks in all:
                             kvf_copy_request_check) */
  uint32_t slices_magic;  /* 0, or ceil(2^32 / slices): the block of the entry's local task t is
                             t * slices_magic >> 32, with no division (exact for every task of the entry,
                             which the build checks; 0 where it is not, and where slices is 1) */
  uint32_t slices;        /* tasks per block */
  uint16_t shape;         /* index into the blob's shapes (at most a shape per entry) */
  uint16_t object_group;  /* its shape's, here too so that the walk finds the object of the request's first chunk
                             with the entry, not after the shape */
} kvf_blob_entry;

/* What a blob's entries share: a segment less its region, offsets, group
 * and view, with the vector width and the slice the build chose (the
 * layers of a group and their planes mostly share one). */
typedef struct kvf_blob_shape {
  uint64_t src_block;     /* block (slot) stride */
  uint64_t src_token;
  uint64_t src_head;
  uint64_t dst_block;
  uint64_t dst_token;
  uint64_t dst_head;
  uint64_t units_per_token; /* run*heads / vec */
  uint32_t run;           /* contiguous bytes per (token, head) */
  uint32_t heads;         /* runs per token after fusion (1 for states) */
  uint32_t tokens;        /* block_size (1 for states) */
  uint32_t object_group;
  uint32_t recurrent;
  uint32_t units_per_run; /* run / vec */
  uint32_t vec;           /* bytes per access: 16, 8, 4, 2 or 1 */
  uint32_t slice_units;   /* units one task moves at most (the blob's slice bytes / vec) */
  uint64_t first_block;   /* the request's first local block (lt_begin / tokens): an entry's lb_rel counts
                             from it (kvf_blob_entry_lb); block lb_rel + j of the request is block
                             (lb_rel + j) mod blocks_per_chunk of its object, with no division in the
                             request's first chunk */
  uint64_t blocks_per_chunk; /* chunk_local / tokens (a whole number: geometry.c checks) */
} kvf_blob_shape;

typedef struct kvf_blob_header {
  uint64_t size;          /* bytes of the whole blob */
  uint64_t total_tasks;
  uint64_t lt_begin;      /* local tokens of token_begin and token_end */
  uint64_t lt_end;
  uint64_t chunk_local;   /* local tokens per full chunk (chunk_tokens / dcp world) */
  uint64_t chunk_begin;   /* global chunk index of token_begin */
  uint64_t full_chunks;   /* chunks of the request that are full (carry recurrent state) */
  uint32_t num_chunks;
  uint32_t num_object_groups;
  uint32_t num_entries;
  uint32_t pad1_;
  uint32_t gather;        /* 1: cache -> objects, 0: objects -> cache */
  uint32_t num_blocks_max;/* largest group block count: the kernel's own bound check */
  uint64_t payload_bytes; /* bytes the blob moves (padding and skipped blocks excluded) */
  uint32_t bucket_shift;  /* task t's entry is at or after buckets[t >> bucket_shift] */
  uint32_t num_buckets;   /* (total_tasks >> bucket_shift) + 1 at most KVF_BLOB_BUCKETS; 0 where
                             entry_tasks_magic finds every task's entry */
  uint32_t cache_order;   /* 1: the warp walk visits a gather's head-major blocks in the cache's
                             address order (kernels/walk.h); 0 (as built): in the object's */
  uint32_t slice_bytes;   /* most bytes a task moves (kvf_blob_opts) */
  uint32_t overlap;       /* 1: launched as a programmatic dependent (kernels/launch.h): the kernel lets
                             the stream's next kernel launch as it starts; 0 (as built): it does not */
  uint32_t entry_tasks_magic; /* 0, or ceil(2^32 / T) where every entry holds T > 1 tasks: task t's entry is
                                 t * entry_tasks_magic >> 32, with no table read (exact for every task:
                                 the build checks) */
  /* Byte offsets of the arrays inside the blob. */
  uint64_t off_entries;   /* kvf_blob_entry[num_entries] */
  uint64_t off_ids;       /* uint32_t[] */
  uint64_t off_objects;   /* uint64_t[num_chunks * num_object_groups] */
  uint64_t off_shapes;    /* kvf_blob_shape[num_shapes] */
  uint64_t off_buckets;   /* uint16_t[num_buckets], last: the entry holding task b << bucket_shift (after the
                             shapes, so that a blob whose entries the multiplier finds carries none) */
  uint32_t num_shapes;
  uint32_t pad2_;
} kvf_blob_header;

/* A blob's arrays. */
static inline const kvf_blob_entry *kvf_blob_entries(const void *blob) {
  return (const kvf_blob_entry *)((const char *)blob + ((const kvf_blob_header *)blob)->off_entries);
}
static inline const kvf_blob_shape *kvf_blob_shapes(const void *blob) {
  return (const kvf_blob_shape *)((const char *)blob + ((const kvf_blob_header *)blob)->off_shapes);
}
/* The shape of entry e of a blob. */
static inline const kvf_blob_shape *kvf_blob_shape_of(const void *blob, const kvf_blob_entry *e) {
  return &kvf_blob_shapes(blob)[e->shape];
}
/* The local block (a recurrent segment: the chunk) of entry e's first id. */
static inline uint64_t kvf_blob_entry_lb(const void *blob, const kvf_blob_entry *e) {
  const kvf_blob_shape *s = kvf_blob_shape_of(blob, e);
  return e->lb_rel + (s->recurrent ? ((const kvf_blob_header *)blob)->chunk_begin : s->first_block);
}

/* Entries of the task -> entry lookup table at the end of a blob: a walker
 * finds the entry of any task with one table read and a short forward scan
 * instead of a binary search over the entries (each probe a dependent load). */
#define KVF_BLOB_BUCKETS 128u

/* The entry holding task t of a blob (t < total_tasks): the last entry whose
 * first_task is at most t. */
uint32_t kvf_blob_entry_of(const void *blob, uint64_t task);

/* How one blob is built; NULL means every segment, KVF_SLICE_BYTES slices. */
typedef struct kvf_blob_opts {
  uint32_t slice_bytes;          /* most bytes a task moves: a multiple of 16 from KVF_SLICE_MIN_BYTES
                                    (smaller values are raised to it); 0: KVF_SLICE_BYTES */
  const unsigned char *segments; /* [plan->num_segments]: 1 = the segment moves in this blob; NULL: all */
  uint64_t task_slots;           /* 0: slice_bytes as given; else slice_bytes halved (down to
                                    KVF_SLICE_MIN_BYTES) while half still holds payload / task_slots
                                    bytes, so a small request still gives task_slots tasks (warps x
                                    tasks per warp); kvf_blob_slice_for says which */
} kvf_blob_opts;

/* The slice a build of opts takes for a blob moving `payload` bytes. */
uint32_t kvf_blob_slice_for(const kvf_blob_opts *opts, uint64_t payload);

/* The blocks of group gi a blob of the request moves: local blocks
 * (chunks for a recurrent group) [*b0, *b1), clipped to the group's table;
 * empty (*b0 == *b1 == 0) when the group does not move. */
void kvf_blob_group_window(const kvf_geometry *geometry, const kvf_copy_request *request, uint32_t gi, uint64_t *b0,
                           uint64_t *b1);

/* Bytes a blob of the request may take (the request is checked first by
 * the caller): room for a shape per entry, where a build takes as many as
 * its entries differ (its header's size says how many bytes it took). opts
 * as for kvf_blob_build (only its segment mask matters). */
uint64_t kvf_blob_size(const kvf_geometry *geometry, const kvf_plan *plan, const kvf_copy_request *request,
                       const kvf_blob_opts *opts);

/* Build the blob for a checked request into `out` (at least kvf_blob_size
 * bytes, 16-byte aligned). Vector widths follow the alignment of the region
 * bases and object pointers. A NULL object pointer in the request is kept as
 * 0 in the blob and its tasks move nothing: a call may split its objects
 * between blobs. Segments left out by opts->segments get no entry: a call
 * may split its segments between blobs too. payload_bytes counts every
 * moving block of the blob's segments as if its objects were present.
 * Returns the number of tasks, 0 when nothing moves. */
uint64_t kvf_blob_build(const kvf_geometry *geometry, const kvf_plan *plan, const kvf_copy_request *request,
                        int gather, const kvf_blob_opts *opts, void *out);

/* A memo of built blobs: kvf_blob_build's answer to a request of a shape
 * asked before, copied from the memo with the parts that change from call
 * to call written in (block ids, object pointers, the request's place in its
 * sequence). A blob's build walks every segment it moves (160 on the
 * 80-layer tp4 slice) on the engine's thread; a context asks it for the
 * same shape on every chunk of one size. The key is what the build reads:
 * the plan, gather, the options (the segment mask's bytes), the request's
 * place inside its chunk and its length, each group's blocks relative to
 * the request's first (and how many are KVF_BLOCK_SKIP, and whether the
 * last is, which the payload counts), the object pointers' alignment per
 * object group and the region bases. The plan must not change while the
 * memo holds blobs of it (a context's never do); the memo is zeroed before
 * its first use, and its owner serializes calls.
 * Measured on the development VM (perf/kvf_host_path, perf/results/
 * 2026-12-05-cpu-blob-memo): one-chunk calls alone took 0.47-0.66x of their
 * host time on the kernel route (the tp4 slice 2.72 -> 1.28 us) and
 * 0.65-0.87x on the staged and batch routes. */
/* Larger blobs (requests of many chunks, whose copies dwarf their build)
 * are built and not kept. */
#define KVF_BLOB_MEMO_MAX_BYTES (64u << 10)

/* kvf_blob_build through the memo (common/memo.h: its last KVF_MEMO_SLOTS
 * blobs; release it with kvf_memo_free): the same bytes written, the same
 * tasks returned. Without memory for a key or a slot the blob is built and
 * not kept. */
uint64_t kvf_blob_build_memo(kvf_memo *memo, const kvf_geometry *geometry, const kvf_plan *plan,
                             const kvf_copy_request *request, int gather, const kvf_blob_opts *opts, void *out);

/* The plan's segment of each of the entries a build of (request, opts)
 * gives, in entry order, into out[0 .. its entry count) (host tools: an
 * entry does not carry it). Returns the entry count. */
uint32_t kvf_blob_entry_segments(const kvf_geometry *geometry, const kvf_plan *plan,
                                 const kvf_copy_request *request, const kvf_blob_opts *opts, uint32_t *out);

/* Re-cut a built blob's tasks into slices of at most slice_bytes (as in
 * kvf_blob_opts): rewrites the shapes' slice_units, the entries' slices (and their magic) and
 * first_task, total_tasks, the header's slice_bytes and the task table (its size, shift and
 * multiplier, and so the blob's size, which may grow by the table's 256 bytes: the buffer must
 * hold kvf_blob_size's bytes), nothing else. Returns the new task count. (A
 * call's blobs take their slice at build time, kvf_blob_opts.task_slots;
 * this is the tests' oracle for that.) */
uint64_t kvf_blob_reslice(void *blob, uint32_t slice_bytes);

/* One (entry, block) pair of a blob that moves something. */
typedef struct kvf_blob_block {
  uint32_t entry;        /* index into the blob's entries */
  uint64_t object_index; /* chunk * object groups + object group: the request's objects[] index */
  char *cache;           /* the block's first run (token 0, head 0) */
  char *object;          /* where that run goes in (comes from) the object */
  uint64_t units;        /* units of the entry's vec the block moves (valid tokens x heads x run) */
} kvf_blob_block;

/* The blob's (entry, block) pairs that move something, in task order
 * (skipped blocks and left-out objects are not listed). Writes at most cap
 * of them into out (which may be NULL with cap 0) and returns how many there
 * are. */
uint64_t kvf_blob_blocks(const void *blob, kvf_blob_block *out, uint64_t cap);

/* Consecutive pairs of one entry in one object that kvf_blob_blocks would
 * list one after another: block q of the stretch (q < count) has id ids[q],
 * lies q * dst_block after `object` in the object and moves tokens x
 * units_per_token units, the last one units_last. */
typedef struct kvf_blob_stretch {
  uint32_t entry;
  uint64_t object_index;
  const uint32_t *ids;
  uint64_t count;
  char *object;
  uint64_t units_last;
} kvf_blob_stretch;

/* The blob's moving pairs as stretches, in task order, each handed to
 * visit(ctx, its entry, the entry's shape, the stretch): for callers that
 * fold blocks into something smaller (kvf_stage_blob_runs' object
 * extents) without listing them. Returns how many pairs there were (what
 * kvf_blob_blocks returns). */
typedef void (*kvf_blob_stretch_fn)(void *ctx, const kvf_blob_entry *entry, const kvf_blob_shape *shape,
                                    const kvf_blob_stretch *stretch);
uint64_t kvf_blob_visit_stretches(const void *blob, kvf_blob_stretch_fn visit, void *ctx);

/* Inline helpers the kernels call too (kernels/walk.h, xfer_kernel.cu). */
#if defined(__CUDACC__)
#define KVF_PLAN_INLINE static inline __host__ __device__
#else
#define KVF_PLAN_INLINE static inline
#endif

/* Whether blocks of these dimensions are each one contiguous run on both
 * sides (one fused run per token, tokens back to back, or a recurrent
 * state): then a block moves units*vec bytes from cache to object as a
 * single copy. */
KVF_PLAN_INLINE int kvf_blocks_linear(uint32_t heads, uint32_t tokens, uint32_t run, uint64_t src_token,
                                      uint64_t dst_token) {
  return heads == 1 && (tokens == 1 || (src_token == run && dst_token == run));
}
/* The test for a blob's shape, and for a plan's segment. */
KVF_PLAN_INLINE int kvf_blob_shape_linear(const kvf_blob_shape *s) {
  return kvf_blocks_linear(s->heads, s->tokens, s->run, s->src_token, s->dst_token);
}
KVF_PLAN_INLINE int kvf_segment_linear(const kvf_segment *s) {
  return kvf_blocks_linear(s->heads, s->tokens, s->run, s->src_token, s->dst_token);
}

/* One past the largest object-side byte offset, from the block's object
 * pointer, that a block of `shape` moving `units` units writes (gather) or
 * reads (scatter). The bytes below it that the block does not touch are
 * holes: units*vec == extent means none. */
uint64_t kvf_blob_object_extent(const kvf_blob_shape *shape, uint64_t units);

/* Copy the tasks [first, end) of a blob on the CPU (the host backend). */
void kvf_blob_run_cpu(const void *blob, uint64_t first, uint64_t end);

/* The same; stream: write with streaming (non-temporal) stores where the
 * CPU has them, for transfers much larger than the caches. */
void kvf_blob_run_cpu_opt(const void *blob, uint64_t first, uint64_t end, int stream);

/* Payload bytes a blob moves (sum over its non-skipped tasks). */
uint64_t kvf_blob_payload(const void *blob);

#ifdef __cplusplus
}
#endif

#endif
