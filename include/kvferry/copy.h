/*
 * kvferry/copy.h - a copy request (which blocks of which groups move between
 * a KV cache and which cache objects) and the CPU reference gather/scatter.
 *
 * A request covers the global tokens [token_begin, token_end) of one
 * sequence; token_begin is a multiple of the policy's chunk_tokens, and chunk
 * k of the request (global tokens [token_begin + k*C, ...)) lives in one
 * object per object group. For each group the caller gives the block table:
 * block_ids[i] is the engine's block holding this rank's local block
 * (first_block + i), where local block j holds local tokens [j*BS, (j+1)*BS).
 * A table may cover more blocks than the range needs (the engine's whole
 * table, say) or fewer (a retained window): only blocks inside both move.
 * KVF_BLOCK_SKIP entries move nothing. For a recurrent group, local block k
 * is the state at the end of chunk k (global token (k+1)*C); its id is the
 * slot, and only chunks that end inside the request carry state.
 *
 * Bytes that no moved block covers are never written: padding, blocks not
 * selected, and the parts of objects whose blocks are skipped.
 *
 * Aliasing: objects must not overlap each other or any region. Views that
 * the geometry declares as aliases may share bytes; block ids must then be
 * disjoint across the aliasing groups, as the engine guarantees.
 *
 * Threading: the reference functions run on the calling thread; concurrent
 * calls are safe when their destinations do not overlap.
 */
#ifndef KVFERRY_COPY_H
#define KVFERRY_COPY_H

#include <kvferry/geometry.h>

#ifdef __cplusplus
extern "C" {
#endif

/* One group's block table. An array element: a fixed layout
 * (kvferry/kvferry.h), never extended. */
typedef struct kvf_group_blocks {
  const uint32_t *block_ids; /* count entries; NULL or count 0: the group does not move */
  uint64_t first_block;      /* local block index of block_ids[0] */
  uint32_t count;
} kvf_group_blocks;

typedef struct kvf_copy_request {
  uint32_t struct_size;
  uint32_t version;
  void *const *region_bases;   /* [num_regions]; NULL for regions no moving view lives in */
  uint64_t token_begin;        /* global; a multiple of chunk_tokens */
  uint64_t token_end;          /* global; > token_begin */
  kvf_object_format format;
  const kvf_group_blocks *groups; /* [num_groups]; their counts sum to at most 2^32 - 1 */
  void *const *objects;        /* [num_chunks * num_object_groups], index chunk*num_object_groups + og;
                                  NULL where that object group does not move */
} kvf_copy_request;
#define KVF_COPY_REQUEST_INIT \
  {sizeof(kvf_copy_request), KVF_DESC_VERSION, NULL, 0, 0, KVF_FORMAT_CANONICAL, NULL, NULL}

/* Number of chunks (objects per object group) the request spans; 0 for NULL
 * pointers or a request that breaks the versioned-struct rule
 * (kvferry/kvferry.h). */
KVF_API uint64_t kvf_copy_request_chunks(const kvf_geometry *geometry, const kvf_copy_request *request);

/* Check a request against a finalized geometry without moving anything:
 * its header (the versioned-struct rule of kvferry/kvferry.h), token range,
 * format, block ids (< num_blocks), region bases (present and
 * aligned where a moving view lives), objects (present where a moving group
 * needs one), and for the native format whole blocks per chunk.
 * KVF_ERR_INVALID_ARGUMENT with a message naming the field
 * ("groups[1].block_ids[7]") on the first violation. */
KVF_API kvf_status kvf_copy_request_check(const kvf_geometry *geometry, const kvf_copy_request *request);

/* Gather (cache -> objects) on the CPU, straight from the view formula.
 * The oracle for every kernel. Checks the request first (as above). */
KVF_API kvf_status kvf_reference_gather(const kvf_geometry *geometry, const kvf_copy_request *request);

/* Scatter (objects -> cache) on the CPU. Same rules as the gather. */
KVF_API kvf_status kvf_reference_scatter(const kvf_geometry *geometry, const kvf_copy_request *request);

#ifdef __cplusplus
}
#endif

#endif /* KVFERRY_COPY_H */
