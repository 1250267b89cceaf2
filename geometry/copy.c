/* Copy requests and the CPU reference gather/scatter.
 *
 * The reference is the oracle for every kernel, so it is written straight
 * from the formulas, one run (plane, token, head) at a time:
 *   cache address  = base + offset + b*block_stride + p*plane_stride + t*token_stride + h*head_stride
 *   canonical      = object + segment(p, layer) + (i*heads + h) * head_bytes[p]
 *   native         = object + segment(layer) + (i / block_size) * block_payload + rank of the run
 *                    among the block's runs in address order
 * where i is the token's index inside the object. Speed is not a goal here. */
#include <stdlib.h>
#include <string.h>

#include <kvferry/copy.h>

#include "common/error.h"
#include "common/versioned.h"
#include "geometry/geometry_internal.h"

/* The library's copy of a caller's request (common/versioned.h): fields an
 * older caller does not know take their KVF_COPY_REQUEST_INIT values. */
static kvf_status request_in(const kvf_copy_request *caller, kvf_copy_request *local) {
  kvf_copy_request d = KVF_COPY_REQUEST_INIT;
  kvf_status st = KVF_VERSIONED_IN(kvf_copy_request, &d, caller);
  if (st == KVF_SUCCESS) *local = d;
  return st;
}

static uint64_t request_chunks(const kvf_geometry *g, const kvf_copy_request *r) {
  if (r->token_end <= r->token_begin) return 0;
  return kvf_div_up_u64(r->token_end - r->token_begin, g->policy.chunk_tokens);
}

uint64_t kvf_copy_request_chunks(const kvf_geometry *g, const kvf_copy_request *caller) {
  kvf_copy_request r;
  if (!g || !caller || request_in(caller, &r) != KVF_SUCCESS) return 0;
  return request_chunks(g, &r);
}

/* Global token range of chunk k of the request. */
static void chunk_range(const kvf_geometry *g, const kvf_copy_request *r, uint64_t k, uint64_t *begin,
                        uint64_t *end) {
  uint64_t c = g->policy.chunk_tokens;
  *begin = r->token_begin + k * c;
  *end = r->token_end - *begin > c ? *begin + c : r->token_end;
}

static int group_moves(const kvf_copy_request *r, uint32_t gi) {
  return r->groups[gi].block_ids && r->groups[gi].count > 0;
}

/* Block id for local block `lblock` of group gi, or KVF_BLOCK_SKIP. */
static uint32_t block_for(const kvf_copy_request *r, uint32_t gi, uint64_t lblock) {
  const kvf_group_blocks *b = &r->groups[gi];
  if (!group_moves(r, gi) || lblock < b->first_block || lblock - b->first_block >= b->count) return KVF_BLOCK_SKIP;
  return b->block_ids[lblock - b->first_block];
}

/* Does chunk k move any block of group gi? */
static int chunk_moves_group(const kvf_geometry *g, const kvf_copy_request *r, uint32_t gi, uint64_t k) {
  const kvf_group *gr = &g->groups[gi];
  uint64_t cb, ce;
  chunk_range(g, r, k, &cb, &ce);
  if (gr->desc.kind == KVF_GROUP_RECURRENT) {
    uint64_t c = g->policy.chunk_tokens;
    return ce - cb == c && block_for(r, gi, cb / c) != KVF_BLOCK_SKIP;
  }
  /* Only blocks of the table can move: walk the chunk's blocks inside
   * [first_block, first_block + count) (no overflow: checked first), so the
   * cost is bounded by the table the caller sent, never by chunk_tokens /
   * block_size (up to 2^24 per chunk). */
  const kvf_group_blocks *b = &r->groups[gi];
  uint64_t lb = kvf_local_token(g, cb), le = kvf_local_token(g, ce), bs = gr->desc.block_size;
  uint64_t from = lb / bs, to = kvf_div_up_u64(le, bs);
  if (!group_moves(r, gi)) return 0;
  if (from < b->first_block) from = b->first_block;
  if (to > b->first_block + b->count) to = b->first_block + b->count;
  for (uint64_t blk = from; blk < to; blk++)
    if (b->block_ids[blk - b->first_block] != KVF_BLOCK_SKIP) return 1;
  return 0;
}

/* kvf_copy_request_check on the library's copy of the request. */
static kvf_status check_request(const kvf_geometry *g, const kvf_copy_request *r) {
  uint64_t c = g->policy.chunk_tokens;
  if (r->token_begin % c != 0)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "token_begin %llu: must be a multiple of chunk_tokens %llu",
                    (unsigned long long)r->token_begin, (unsigned long long)c);
  if (r->token_end <= r->token_begin)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "token_end %llu: must be greater than token_begin %llu",
                    (unsigned long long)r->token_end, (unsigned long long)r->token_begin);
  /* Chunks and blocks are counted to the end of the chunk that holds the
   * last token: that end must be a 64-bit number, or the arithmetic wraps. */
  uint64_t chunk_end;
  if (!kvf_round_up_u64(r->token_end, c, &chunk_end))
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT,
                    "token_end %llu: the chunk of %llu tokens that holds it ends past 2^64 - 1 (at most %llu)",
                    (unsigned long long)r->token_end, (unsigned long long)c,
                    (unsigned long long)(UINT64_MAX / c * c));
  if ((unsigned)r->format > KVF_FORMAT_NATIVE)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "format %d: not an object format", (int)r->format);
  if (!r->groups) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "groups: NULL (one entry per group is required)");
  /* A launch table indexes the request's block ids in 32 bits (kernels/plan.h):
   * checked before any table is read. */
  uint64_t blocks = 0;
  for (uint32_t gi = 0; gi < g->num_groups; gi++) {
    if (!group_moves(r, gi)) continue;
    blocks += r->groups[gi].count;
    if (blocks > UINT32_MAX)
      return kvf_fail(KVF_ERR_INVALID_ARGUMENT,
                      "groups[%u].count %u: the request's block tables hold more than 2^32 - 1 blocks in all", gi,
                      r->groups[gi].count);
  }
  uint64_t chunks = request_chunks(g, r);
  for (uint32_t gi = 0; gi < g->num_groups; gi++) {
    const kvf_group *gr = &g->groups[gi];
    const kvf_group_blocks *b = &r->groups[gi];
    if (!group_moves(r, gi)) continue;
    uint64_t last;
    if (!kvf_add_u64(b->first_block, b->count, &last))
      return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "groups[%u].first_block %llu: first_block + count overflows", gi,
                      (unsigned long long)b->first_block);
    for (uint32_t i = 0; i < b->count; i++)
      if (b->block_ids[i] != KVF_BLOCK_SKIP && b->block_ids[i] >= gr->desc.num_blocks)
        return kvf_fail(KVF_ERR_INVALID_ARGUMENT,
                        "groups[%u].block_ids[%u] %u: out of range (group '%s' has %u blocks)", gi, i,
                        b->block_ids[i], gr->name, gr->desc.num_blocks);
    for (uint32_t l = 0; l < gr->num_views; l++) {
      const kvf_view *v = &g->views[gr->views[l]];
      uint32_t reg = v->desc.region;
      if (!r->region_bases || !r->region_bases[reg])
        return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "region_bases[%u]: NULL, but group %u layer %u lives there", reg,
                        gi, l);
      if ((uintptr_t)r->region_bases[reg] % g->regions[reg].align != 0)
        return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "region_bases[%u] %p: not aligned to the region's align %llu", reg,
                        r->region_bases[reg], (unsigned long long)g->regions[reg].align);
    }
    if (r->format == KVF_FORMAT_NATIVE && gr->desc.kind != KVF_GROUP_RECURRENT) {
      uint64_t lb = kvf_local_token(g, r->token_begin), le = kvf_local_token(g, r->token_end);
      if ((le - lb) % gr->desc.block_size != 0)
        return kvf_fail(KVF_ERR_INVALID_ARGUMENT,
                        "token_end %llu: native objects hold whole blocks, but group %u ('%s') would end mid-block "
                        "(block_size %u)",
                        (unsigned long long)r->token_end, gi, gr->name, gr->desc.block_size);
    }
    for (uint64_t k = 0; k < chunks; k++) {
      uint64_t idx = k * g->num_object_groups + gr->object_group;
      if (chunk_moves_group(g, r, gi, k) && (!r->objects || !r->objects[idx]))
        return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "objects[%llu]: NULL, but chunk %llu of object group %u moves blocks",
                        (unsigned long long)idx, (unsigned long long)k, gr->object_group);
    }
  }
  return KVF_SUCCESS;
}

kvf_status kvf_copy_request_check_local(const kvf_geometry *g, const kvf_copy_request *caller,
                                        kvf_copy_request *local) {
  if (!g || !caller) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "copy request: geometry or request is NULL");
  if (!g->finalized) return kvf_fail(KVF_ERR_STATE, "copy request: the geometry is not finalized");
  kvf_copy_request r;
  kvf_status st = request_in(caller, &r);
  if (st == KVF_SUCCESS) st = check_request(g, &r);
  if (st == KVF_SUCCESS && local) *local = r;
  return st;
}

kvf_status kvf_copy_request_check(const kvf_geometry *g, const kvf_copy_request *request) {
  return kvf_copy_request_check_local(g, request, NULL);
}

/* For the native format: each run's byte offset inside its block's payload,
 * with the block's runs in address order. Indexed (p*block_size + t)*heads + h. */
typedef struct run_rank {
  uint64_t addr;
  uint32_t index;
  uint32_t len;
} run_rank;

static int cmp_run(const void *a, const void *b) {
  const run_rank *x = a, *y = b;
  return x->addr < y->addr ? -1 : x->addr > y->addr;
}

static kvf_status native_offsets(const kvf_geometry *g, const kvf_view *v, uint64_t **out) {
  const kvf_view_desc *d = &v->desc;
  uint64_t bs = g->groups[v->group].desc.block_size;
  size_t n = (size_t)d->planes * bs * d->heads;
  run_rank *runs = malloc(n * sizeof *runs);
  uint64_t *offs = malloc(n * sizeof *offs);
  if (!runs || !offs) {
    free(runs);
    free(offs);
    return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "reference copy: out of memory");
  }
  for (uint32_t p = 0; p < d->planes; p++)
    for (uint64_t t = 0; t < bs; t++)
      for (uint32_t h = 0; h < d->heads; h++) {
        size_t i = ((size_t)p * bs + t) * d->heads + h;
        runs[i] = (run_rank){p * d->plane_stride + t * d->token_stride + h * d->head_stride, (uint32_t)i,
                             d->head_bytes[p]};
      }
  qsort(runs, n, sizeof *runs, cmp_run);
  uint64_t at = 0;
  for (size_t i = 0; i < n; i++) {
    offs[runs[i].index] = at;
    at += runs[i].len;
  }
  free(runs);
  *out = offs;
  return KVF_SUCCESS;
}

typedef enum { GATHER, SCATTER } direction;

static void move(direction dir, char *cache, char *object, size_t len) {
  if (dir == GATHER)
    memcpy(object, cache, len);
  else
    memcpy(cache, object, len);
}

/* One attention layer, one chunk. */
static kvf_status copy_attention_layer(const kvf_geometry *g, const kvf_copy_request *r, direction dir,
                                       const kvf_view *v, uint64_t k, char *object) {
  const kvf_view_desc *d = &v->desc;
  const kvf_group *gr = &g->groups[v->group];
  uint64_t bs = gr->desc.block_size, cb, ce;
  chunk_range(g, r, k, &cb, &ce);
  uint64_t lb = kvf_local_token(g, cb), le = kvf_local_token(g, ce), n = le - lb;
  uint64_t *native = NULL;
  if (r->format == KVF_FORMAT_NATIVE) {
    kvf_status st = native_offsets(g, v, &native);
    if (st) return st;
  }
  char *base = r->region_bases[d->region];
  for (uint64_t lt = lb; lt < le; lt++) {
    uint32_t id = block_for(r, v->group, lt / bs);
    if (id == KVF_BLOCK_SKIP) continue;
    uint64_t t = lt % bs, i = lt - lb;
    for (uint32_t p = 0; p < d->planes; p++) {
      uint64_t seg;
      kvf_geometry_object_segment(g, r->format, v->group, v->layer, p, n, &seg, NULL);
      for (uint32_t h = 0; h < d->heads; h++) {
        char *cache = base + d->offset + (uint64_t)id * d->block_stride + p * d->plane_stride + t * d->token_stride +
                      h * d->head_stride;
        uint64_t at;
        if (r->format == KVF_FORMAT_CANONICAL)
          at = seg + (i * d->heads + h) * d->head_bytes[p];
        else
          at = seg + (i / bs) * v->block_payload + native[((size_t)p * bs + t) * d->heads + h];
        move(dir, cache, object + at, d->head_bytes[p]);
      }
    }
  }
  free(native);
  return KVF_SUCCESS;
}

/* One recurrent layer, one chunk: its states back to back. */
static void copy_recurrent_layer(const kvf_geometry *g, const kvf_copy_request *r, direction dir, const kvf_view *v,
                                 uint64_t k, char *object) {
  uint64_t cb, ce, c = g->policy.chunk_tokens;
  chunk_range(g, r, k, &cb, &ce);
  if (ce - cb != c) return; /* state exists only at chunk boundaries */
  uint32_t id = block_for(r, v->group, cb / c);
  if (id == KVF_BLOCK_SKIP) return;
  const kvf_view_desc *d = &v->desc;
  uint64_t seg, at = 0;
  kvf_geometry_object_segment(g, r->format, v->group, v->layer, 0, kvf_local_token(g, ce) - kvf_local_token(g, cb),
                              &seg, NULL);
  char *slot = (char *)r->region_bases[d->region] + d->offset + (uint64_t)id * d->block_stride;
  for (uint32_t s = 0; s < d->num_states; s++) {
    move(dir, slot + d->states[s].offset, object + seg + at, d->states[s].bytes);
    at += d->states[s].bytes;
  }
}

static kvf_status reference_copy(const kvf_geometry *g, const kvf_copy_request *request, direction dir) {
  kvf_copy_request local;
  const kvf_copy_request *r = &local;
  kvf_status st = kvf_copy_request_check_local(g, request, &local);
  if (st) return st;
  uint64_t chunks = request_chunks(g, r);
  for (uint32_t gi = 0; gi < g->num_groups; gi++) {
    if (!group_moves(r, gi)) continue;
    const kvf_group *gr = &g->groups[gi];
    for (uint64_t k = 0; k < chunks; k++) {
      if (!chunk_moves_group(g, r, gi, k)) continue;
      char *object = r->objects[k * g->num_object_groups + gr->object_group];
      for (uint32_t l = 0; l < gr->num_views; l++) {
        const kvf_view *v = &g->views[gr->views[l]];
        if (v->is_recurrent)
          copy_recurrent_layer(g, r, dir, v, k, object);
        else if ((st = copy_attention_layer(g, r, dir, v, k, object)))
          return st;
      }
    }
  }
  return KVF_SUCCESS;
}

kvf_status kvf_reference_gather(const kvf_geometry *g, const kvf_copy_request *r) {
  return reference_copy(g, r, GATHER);
}

kvf_status kvf_reference_scatter(const kvf_geometry *g, const kvf_copy_request *r) {
  return reference_copy(g, r, SCATTER);
}
