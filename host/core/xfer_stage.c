/* The staged route's plan (host/core/xfer_internal.h): which objects of a
 * host<->device request cross PCIe through the device staging buffers, which
 * of their bytes, and the batches of whole chunks the call moves. Pure C: the
 * CUDA side (host/core/xfer.c) allocates and enqueues from this plan. */
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "geometry/geometry_internal.h"
#include "host/core/xfer_internal.h"

/* How a request moves the blocks of one group in one chunk. */
typedef enum coverage { COVER_NONE, COVER_PARTIAL, COVER_FULL } coverage;

static coverage group_coverage(const kvf_geometry *g, const kvf_copy_request *r, uint32_t gi, uint64_t cb,
                               uint64_t ce) {
  const kvf_group *gr = &g->groups[gi];
  const kvf_group_blocks *t = &r->groups[gi];
  uint64_t c = g->policy.chunk_tokens, lo, hi;
  if (!t->block_ids || !t->count) return COVER_NONE;
  if (gr->desc.kind == KVF_GROUP_RECURRENT) {
    if (ce - cb != c) return COVER_NONE; /* a partial chunk carries no state */
    lo = cb / c;
    hi = lo + 1;
  } else {
    uint64_t bs = gr->desc.block_size;
    lo = kvf_local_token(g, cb) / bs;
    hi = (kvf_local_token(g, ce) + bs - 1) / bs;
  }
  uint64_t present = 0;
  for (uint64_t b = lo; b < hi; b++)
    present += b >= t->first_block && b - t->first_block < t->count &&
               t->block_ids[b - t->first_block] != KVF_BLOCK_SKIP;
  return present == 0 ? COVER_NONE : present == hi - lo ? COVER_FULL : COVER_PARTIAL;
}

/* The bytes of object (chunk k, object group og) that the copy engine moves
 * between host memory and staging: [*lo, *hi). An object holds its attention
 * part, then its recurrent part; a part is moved when the request touches
 * it. A gather may only copy back parts it writes whole: returns 0 when a
 * part is written in part (the object then goes the direct way). */
static int object_span(const kvf_geometry *g, const kvf_copy_request *r, uint64_t k, uint32_t og, int gather,
                       uint64_t *lo, uint64_t *hi) {
  const kvf_object_group *o = &g->object_groups[og];
  uint64_t c = g->policy.chunk_tokens, cb = r->token_begin + k * c;
  uint64_t ce = r->token_end - cb > c ? cb + c : r->token_end;
  int att[3] = {0, 0, 0}, rec[3] = {0, 0, 0};
  for (uint32_t i = 0; i < o->num_groups; i++) {
    uint32_t gi = o->groups[i];
    coverage cv = group_coverage(g, r, gi, cb, ce);
    (g->groups[gi].desc.kind == KVF_GROUP_RECURRENT ? rec : att)[cv] = 1;
  }
  /* A part is copied when something in it moves; for a gather, only when
   * every group of it is written whole. */
  int copy_att = att[COVER_FULL] || att[COVER_PARTIAL];
  int copy_rec = rec[COVER_FULL] || rec[COVER_PARTIAL];
  if (gather && ((copy_att && (att[COVER_PARTIAL] || att[COVER_NONE])) ||
                 (copy_rec && (rec[COVER_PARTIAL] || rec[COVER_NONE]))))
    return 0;
  uint64_t a = (kvf_local_token(g, ce) - kvf_local_token(g, cb)) * o->bytes_per_token;
  uint64_t rb = ce - cb == c ? o->recurrent_bytes : 0;
  *lo = copy_att ? 0 : a;
  *hi = copy_rec ? a + rb : a;
  return 1;
}

static uint64_t round_stage(uint64_t x) { return (x + KVF_STAGE_ALIGN - 1) & ~(uint64_t)(KVF_STAGE_ALIGN - 1); }

void kvf_stage_plan_free(kvf_stage_plan *p) {
  if (!p) return;
  free(p->staged);
  free(p->span);
  free(p->size);
  free(p->offset);
  free(p->batches);
  memset(p, 0, sizeof *p);
}

kvf_status kvf_stage_plan_objects(const kvf_geometry *g, const kvf_copy_request *r, int gather,
                                  kvf_stage_plan *p) {
  uint32_t nog = g->num_object_groups;
  uint64_t chunks = kvf_copy_request_chunks(g, r), n = chunks * nog, c = g->policy.chunk_tokens;
  memset(p, 0, sizeof *p);
  p->num_chunks = chunks;
  p->num_objects = n;
  p->staged = calloc(n ? n : 1, 1);
  p->span = calloc(2 * (n ? n : 1), sizeof(uint64_t));
  p->size = calloc(n ? n : 1, sizeof(uint64_t));
  p->offset = calloc(n ? n : 1, sizeof(uint64_t));
  p->batches = calloc(chunks ? chunks : 1, sizeof(kvf_stage_batch));
  if (!p->staged || !p->span || !p->size || !p->offset || !p->batches) {
    kvf_stage_plan_free(p);
    return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "transfer: out of memory");
  }
  for (uint64_t k = 0; k < chunks; k++) {
    uint64_t bytes = 0;
    for (uint32_t og = 0; og < nog; og++) {
      uint64_t i = k * nog + og, size = 0;
      int present = r->objects && r->objects[i];
      p->staged[i] = present && object_span(g, r, k, og, gather, &p->span[2 * i], &p->span[2 * i + 1]);
      p->any_direct |= present && !p->staged[i];
      if (!p->staged[i]) continue;
      kvf_geometry_object_size(g, og, r->token_begin / c + k, r->token_end, &size);
      p->size[i] = round_stage(size);
      bytes += p->size[i];
    }
    if (bytes > p->max_chunk) p->max_chunk = bytes;
  }
  return KVF_SUCCESS;
}

void kvf_stage_plan_batches(kvf_stage_plan *p, uint64_t cap) {
  uint64_t chunks = p->num_chunks, nog = chunks ? p->num_objects / chunks : 0, nb = 0;
  for (uint64_t k = 0; k < chunks;) {
    kvf_stage_batch *b = &p->batches[nb++];
    uint64_t used = 0;
    b->k0 = k;
    while (k < chunks) {
      uint64_t bytes = 0;
      for (uint64_t og = 0; og < nog; og++) bytes += p->size[k * nog + og];
      if (k > b->k0 && used + bytes > cap) break;
      for (uint64_t og = 0; og < nog; og++) {
        p->offset[k * nog + og] = used;
        used += p->size[k * nog + og];
      }
      k++;
    }
    b->k1 = k;
    b->bytes = used;
  }
  p->num_batches = nb;
}
