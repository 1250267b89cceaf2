/* Launch planning: segments from a geometry, blobs from a request, and the
 * CPU copy of a blob's tasks. See plan.h for the formulas. */
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "geometry/geometry_internal.h"
#include "kernels/plan.h"

/* Largest power of two <= 16 dividing x (16 for 0). */
static uint32_t align_of(uint64_t x) {
  uint32_t a = 16;
  while (a > 1 && x % a) a >>= 1;
  return a;
}

static uint32_t min_u32(uint32_t a, uint32_t b) { return a < b ? a : b; }

/* Native format: where run (p, t, h) lands inside a block's payload, which
 * holds the block's runs in address order. Validation guarantees the
 * dimensions nest (sorted by stride, each steps over the smaller ones), so
 * address order is lexicographic in the dimensions by descending stride and
 * the offset is affine per plane: plane_off[p] + t*tok[p] + h*head[p]. */
typedef struct native_dim {
  int which; /* 0 plane, 1 token, 2 head */
  uint64_t count, stride;
} native_dim;

static void native_strides(const kvf_geometry *g, const kvf_view *v, uint64_t plane_off[2], uint64_t tok[2],
                           uint64_t head[2]) {
  const kvf_view_desc *d = &v->desc;
  native_dim dims[3] = {{0, d->planes, d->plane_stride},
                        {1, g->groups[v->group].desc.block_size, d->token_stride},
                        {2, d->heads, d->head_stride}};
  /* Ascending by stride; count-1 dimensions do not matter. */
  for (int i = 1; i < 3; i++)
    for (int j = i; j > 0 && dims[j - 1].stride > dims[j].stride; j--) {
      native_dim x = dims[j];
      dims[j] = dims[j - 1];
      dims[j - 1] = x;
    }
  uint64_t size[2] = {d->head_bytes[0], d->head_bytes[1]}, combined = 0;
  int above_planes = 0;
  plane_off[0] = plane_off[1] = 0;
  tok[0] = tok[1] = head[0] = head[1] = 0;
  for (int i = 0; i < 3; i++) {
    if (dims[i].count <= 1) continue;
    if (dims[i].which == 0) {
      plane_off[1] = size[0];
      combined = size[0] + size[1];
      above_planes = 1;
      continue;
    }
    uint64_t *out = dims[i].which == 1 ? tok : head;
    if (above_planes) {
      out[0] = out[1] = combined;
      combined *= dims[i].count;
    } else {
      out[0] = size[0];
      out[1] = size[1];
      size[0] *= dims[i].count;
      size[1] *= dims[i].count;
    }
  }
}

kvf_status kvf_plan_build(const kvf_geometry *g, kvf_object_format format, kvf_plan *out) {
  memset(out, 0, sizeof *out);
  uint32_t n = 0;
  for (uint32_t i = 0; i < g->num_views; i++)
    n += g->views[i].is_recurrent ? g->views[i].desc.num_states : g->views[i].desc.planes;
  out->segments = calloc(n ? n : 1, sizeof *out->segments);
  out->group_first = calloc(g->num_groups + 1, sizeof *out->group_first);
  if (!out->segments || !out->group_first) {
    kvf_plan_free(out);
    return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "transfer plan: out of memory");
  }
  out->num_groups = g->num_groups;
  uint32_t at = 0;
  for (uint32_t gi = 0; gi < g->num_groups; gi++) {
    const kvf_group *gr = &g->groups[gi];
    const kvf_object_group *og = &g->object_groups[gr->object_group];
    out->group_first[gi] = at;
    for (uint32_t l = 0; l < gr->num_views; l++) {
      const kvf_view *v = &g->views[gr->views[l]];
      const kvf_view_desc *d = &v->desc;
      if (v->is_recurrent) {
        uint64_t before = 0;
        for (uint32_t s = 0; s < d->num_states; s++) {
          kvf_segment *seg = &out->segments[at++];
          *seg = (kvf_segment){.src_offset = d->offset + d->states[s].offset,
                               .src_block = d->block_stride,
                               .dst_per_token = og->bytes_per_token,
                               .dst_const = v->recurrent_prefix + before,
                               .run = (uint32_t)d->states[s].bytes,
                               .heads = 1,
                               .tokens = 1,
                               .region = d->region,
                               .group = gi,
                               .object_group = gr->object_group,
                               .recurrent = 1,
                               .view = gr->views[l]};
          before += d->states[s].bytes;
        }
        continue;
      }
      uint64_t plane_off[2], ntok[2], nhead[2];
      if (format == KVF_FORMAT_NATIVE) native_strides(g, v, plane_off, ntok, nhead);
      for (uint32_t p = 0; p < d->planes; p++) {
        kvf_segment *seg = &out->segments[at++];
        uint64_t hb = d->head_bytes[p];
        *seg = (kvf_segment){.src_offset = d->offset + p * d->plane_stride,
                             .src_block = d->block_stride,
                             .src_token = d->token_stride,
                             .src_head = d->head_stride,
                             .run = (uint32_t)hb,
                             .heads = d->heads,
                             .tokens = gr->desc.block_size,
                             .region = d->region,
                             .group = gi,
                             .object_group = gr->object_group,
                             .view = gr->views[l]};
        if (format == KVF_FORMAT_CANONICAL) {
          uint64_t before = 0;
          for (uint32_t q = 0; q < p; q++) before += og->plane_bytes_per_token[q];
          seg->dst_per_token = before + v->canonical_prefix[p];
          seg->dst_block = (uint64_t)gr->desc.block_size * d->heads * hb;
          seg->dst_token = (uint64_t)d->heads * hb;
          seg->dst_head = hb;
        } else {
          seg->dst_per_token = v->native_prefix;
          seg->dst_const = plane_off[p];
          seg->dst_block = v->block_payload;
          seg->dst_token = ntok[p];
          seg->dst_head = nhead[p];
        }
        /* Heads contiguous on both sides: one run per token. */
        if (seg->heads > 1 && seg->src_head == hb && seg->dst_head == hb && hb * seg->heads < (1u << 31)) {
          seg->run = (uint32_t)(hb * seg->heads);
          seg->heads = 1;
          seg->src_head = seg->dst_head = 0;
        }
      }
    }
  }
  out->group_first[g->num_groups] = at;
  out->num_segments = at;
  if (at > 65535) { /* a blob's task -> entry table holds 16-bit entry indices */
    kvf_plan_free(out);
    return kvf_fail(KVF_ERR_UNSUPPORTED, "the geometry has %u segments (layers x planes, states): at most 65535", at);
  }
  for (uint32_t i = 0; i < at; i++) {
    /* The kernel indexes a block's units in 32 bits, with room for a lane's
     * last step past the end. */
    const kvf_segment *s = &out->segments[i];
    /* The message before the free: s points into the plan. */
    if ((uint64_t)s->run * s->heads * s->tokens > (UINT32_MAX >> 1)) {
      kvf_status st = kvf_fail(KVF_ERR_UNSUPPORTED, "group %u: one block of one layer holds 2 GiB or more", s->group);
      kvf_plan_free(out);
      return st;
    }
    /* A blob entry keeps a segment's place in an object in 32 bits
     * (kvf_blob_entry): the object's bytes per token before it, or its
     * offset among a block's planes or the object's states. */
    if (s->dst_per_token > UINT32_MAX || s->dst_const > UINT32_MAX) {
      const kvf_group *gr = &g->groups[s->group];
      uint32_t layer = 0;
      while (layer + 1 < gr->num_views && gr->views[layer] != s->view) layer++;
      int per_token = s->dst_per_token > UINT32_MAX;
      kvf_status st =
          kvf_fail(KVF_ERR_UNSUPPORTED,
                   "groups[%u].layers[%u] ('%s'): its place in an object needs 4 GiB or more: %llu bytes %s (at most "
                   "2^32 - 1)",
                   s->group, layer, g->views[s->view].name,
                   (unsigned long long)(per_token ? s->dst_per_token : s->dst_const),
                   per_token ? "of each token before it" : "of the object's states (or a block's planes) before it");
      kvf_plan_free(out);
      return st;
    }
  }
  for (uint32_t i = 0; i < at; i++) {
    const kvf_segment *s = &out->segments[i];
    uint64_t t = s->tokens ? s->tokens - 1 : 0, h = s->heads ? s->heads - 1 : 0;
    uint64_t src = t * s->src_token + h * s->src_head + s->run, dst = t * s->dst_token + h * s->dst_head + s->run;
    if (src > UINT32_MAX || dst > UINT32_MAX || s->src_token > UINT32_MAX || s->src_head > UINT32_MAX ||
        s->dst_token > UINT32_MAX || s->dst_head > UINT32_MAX)
      out->wide++;
  }
  for (uint32_t i = 0; i < at; i++) {
    kvf_segment *s = &out->segments[i];
    uint64_t bits = s->run | s->src_offset | s->src_block | s->dst_per_token | s->dst_const | s->dst_block;
    if (s->tokens > 1) bits |= s->src_token | s->dst_token;
    if (s->heads > 1) bits |= s->src_head | s->dst_head;
    s->align = align_of(bits);
  }
  return KVF_SUCCESS;
}

void kvf_plan_free(kvf_plan *plan) {
  free(plan->segments);
  free(plan->group_first);
  memset(plan, 0, sizeof *plan);
}

/* ---- blobs --------------------------------------------------------------- */

void kvf_blob_group_window(const kvf_geometry *g, const kvf_copy_request *r, uint32_t gi, uint64_t *b0, uint64_t *b1) {
  const kvf_group *gr = &g->groups[gi];
  const kvf_group_blocks *t = &r->groups[gi];
  *b0 = *b1 = 0;
  if (!t->block_ids || t->count == 0) return;
  uint64_t c = g->policy.chunk_tokens, lo, hi;
  if (gr->desc.kind == KVF_GROUP_RECURRENT) {
    lo = r->token_begin / c;
    hi = r->token_end / c; /* chunks that end inside the request */
  } else {
    uint64_t bs = gr->desc.block_size;
    lo = kvf_local_token(g, r->token_begin) / bs;
    hi = (kvf_local_token(g, r->token_end) + bs - 1) / bs;
  }
  if (t->first_block > lo) lo = t->first_block;
  if (t->first_block + t->count < hi) hi = t->first_block + t->count;
  if (lo < hi) {
    *b0 = lo;
    *b1 = hi;
  }
}

/* Entries keep an object group and a shape in 16 bits: shapes are at most
 * one per entry, entries one per segment, and kvf_plan_build takes at most
 * 65535 segments. */
_Static_assert(KVF_MAX_GROUPS <= 65536, "kvf_blob_entry's 16-bit object group");
/* The sizes kernels/plan.h's comments and the parameter sizes were set by;
 * no implicit padding (a build zeroes what it does not fill). */
_Static_assert(sizeof(kvf_blob_entry) == 48, "kvf_blob_entry is 48 bytes");
_Static_assert(sizeof(kvf_blob_header) % 16 == 0, "kvf_blob_header keeps the arrays after it 16-byte aligned");

static uint64_t round16(uint64_t x) { return (x + 15) & ~(uint64_t)15; }

static void blob_buckets(kvf_blob_header *h);

static int seg_in(const kvf_blob_opts *opts, uint32_t s) { return !opts || !opts->segments || opts->segments[s]; }

/* Bytes one block of a segment moves (a recurrent state: its run). */
static uint64_t seg_block_bytes(const kvf_segment *s) { return (uint64_t)s->run * s->heads * s->tokens; }

/* Slice bytes as the build takes them: a multiple of 16, at least the minimum. */
static uint32_t slice_of(uint32_t slice_bytes) {
  if (slice_bytes == 0) return KVF_SLICE_BYTES;
  slice_bytes &= ~15u;
  return slice_bytes < KVF_SLICE_MIN_BYTES ? KVF_SLICE_MIN_BYTES : slice_bytes;
}

uint32_t kvf_blob_slice_for(const kvf_blob_opts *opts, uint64_t payload) {
  uint32_t slice = opts && opts->slice_bytes ? opts->slice_bytes : KVF_SLICE_BYTES;
  if (opts && opts->task_slots) {
    uint64_t want = payload / opts->task_slots;
    while (slice / 2 >= KVF_SLICE_MIN_BYTES && slice / 2 >= want) slice /= 2;
  }
  return slice_of(slice);
}

/* Where the blob's arrays go: counts its entries and ids first. */
static void blob_layout(const kvf_geometry *g, const kvf_plan *plan, const kvf_copy_request *r,
                        const kvf_blob_opts *opts, kvf_blob_header *h) {
  uint64_t entries = 0, ids = 0;
  for (uint32_t gi = 0; gi < g->num_groups; gi++) {
    uint64_t b0, b1, n = 0;
    kvf_blob_group_window(g, r, gi, &b0, &b1);
    if (b0 == b1) continue;
    for (uint32_t s = plan->group_first[gi]; s < plan->group_first[gi + 1]; s++) n += seg_in(opts, s);
    if (!n) continue;
    entries += n;
    ids += b1 - b0;
  }
  uint64_t objects = kvf_copy_request_chunks(g, r) * g->num_object_groups;
  h->off_entries = round16(sizeof *h);
  h->off_ids = h->off_entries + round16(entries * sizeof(kvf_blob_entry));
  h->off_objects = h->off_ids + round16(ids * sizeof(uint32_t));
  h->off_shapes = h->off_objects + round16(objects * sizeof(uint64_t));
  /* At most a shape per entry, then the task -> entry table. */
  h->off_buckets = round16(h->off_shapes + entries * sizeof(kvf_blob_shape));
  h->size = h->off_buckets + KVF_BLOB_BUCKETS * sizeof(uint16_t);
}

uint64_t kvf_blob_size(const kvf_geometry *g, const kvf_plan *plan, const kvf_copy_request *r,
                       const kvf_blob_opts *opts) {
  kvf_blob_header h;
  blob_layout(g, plan, r, opts, &h);
  return h.size;
}

/* The shape of segment seg moved `vec` bytes at a time in tasks of at most
 * `slice` bytes, in the blob of header h (its first block and chunk's
 * blocks: attention segments only). */
static void shape_of(const kvf_blob_header *h, const kvf_segment *seg, uint32_t vec, uint32_t slice,
                     kvf_blob_shape *sh) {
  memset(sh, 0, sizeof *sh); /* compared whole: no stale bytes */
  sh->src_block = seg->src_block;
  sh->src_token = seg->src_token;
  sh->src_head = seg->src_head;
  sh->dst_block = seg->dst_block;
  sh->dst_token = seg->dst_token;
  sh->dst_head = seg->dst_head;
  sh->run = seg->run;
  sh->heads = seg->heads;
  sh->tokens = seg->tokens;
  sh->object_group = seg->object_group;
  sh->recurrent = seg->recurrent;
  sh->vec = vec;
  sh->units_per_run = seg->run / vec;
  sh->units_per_token = (uint64_t)sh->units_per_run * seg->heads;
  sh->slice_units = slice / vec;
  if (!seg->recurrent) {
    sh->first_block = h->lt_begin / seg->tokens;
    sh->blocks_per_chunk = h->chunk_local / seg->tokens;
  }
}

/* The walk divides t by d as t * m >> 32 with m = ceil(2^32 / d)
 * (kernels/walk.h, mul_div). That is exact for every t < 2^32 / d, since
 * m * d exceeds 2^32 by less than d: for every t < count when
 * count * d <= 2^32. Dividing by 1 needs no multiplier. */
static int multiplier_exact(uint64_t d, uint64_t count) {
  uint64_t bound;
  return d > 1 && kvf_mul_u64(count, d, &bound) && bound <= ((uint64_t)1 << 32);
}

/* m for a d that multiplier_exact took: one 32-bit division. */
static uint32_t multiplier_of(uint64_t d) { return UINT32_MAX / (uint32_t)d + 1; }

/* An entry's slices per block and its multiplier for them over its blocks x
 * slices tasks (kvf_blob_entry.slices_magic, 0 where not exact). `like`: an
 * entry whose multiplier may serve (a recent one of the same shape), or
 * NULL: this runs per entry on the caller's thread, and the multiplier's
 * division is most of its cost. */
static void set_slices(kvf_blob_entry *x, uint32_t slices, uint64_t blocks, const kvf_blob_entry *like) {
  uint64_t tasks;
  x->slices = slices;
  x->slices_magic = 0;
  if (!kvf_mul_u64(blocks, slices, &tasks) || !multiplier_exact(slices, tasks)) return;
  x->slices_magic = like && like->slices == slices && like->slices_magic ? like->slices_magic : multiplier_of(slices);
}

/* Tasks per block of a shape. */
static uint32_t shape_slices(const kvf_blob_shape *sh) {
  uint64_t block_units = (uint64_t)sh->run * sh->heads * sh->tokens / sh->vec;
  return (uint32_t)((block_units + sh->slice_units - 1) / sh->slice_units);
}

/* Whether segments a and b give the same shape at one vector width and
 * slice (shape_of's fields). */
static int same_shape(const kvf_segment *a, const kvf_segment *b) {
  return a->src_block == b->src_block && a->src_token == b->src_token && a->src_head == b->src_head &&
         a->dst_block == b->dst_block && a->dst_token == b->dst_token && a->dst_head == b->dst_head &&
         a->run == b->run && a->heads == b->heads && a->tokens == b->tokens && a->object_group == b->object_group &&
         a->recurrent == b->recurrent;
}

/* Index of shape `sh` among the blob's *n shapes, appended when it is new.
 * Neighbouring entries (a layer's planes, consecutive layers) mostly share
 * one, so only the 16 latest are compared: a blob of many different shapes
 * may then hold one twice, which costs bytes, never correctness. */
static uint32_t shape_index(kvf_blob_shape *shapes, uint32_t *n, const kvf_blob_shape *sh) {
  uint32_t stop = *n > 16 ? *n - 16 : 0;
  for (uint32_t i = *n; i-- > stop;)
    if (memcmp(&shapes[i], sh, sizeof *sh) == 0) return i;
  shapes[*n] = *sh;
  return (*n)++;
}

/* Bytes one block of group gi moves in a blob of opts' segments. */
static uint64_t group_block_bytes(const kvf_plan *plan, const kvf_blob_opts *opts, uint32_t gi) {
  uint64_t bytes = 0;
  for (uint32_t s = plan->group_first[gi]; s < plan->group_first[gi + 1]; s++)
    if (seg_in(opts, s)) bytes += seg_block_bytes(&plan->segments[s]);
  return bytes;
}

/* Bytes group gi's blocks [b0, b1) move at per_block bytes a block: moving
 * blocks x per_block, less the missing tokens of a partial last block. */
static uint64_t group_payload_of(const kvf_geometry *g, const kvf_copy_request *r, uint32_t gi, uint64_t b0,
                                 uint64_t b1, uint64_t lt_end, uint64_t per_block) {
  uint64_t moving = 0;
  const kvf_group_blocks *t = &r->groups[gi];
  const uint32_t *ids = t->block_ids + (b0 - t->first_block);
  for (uint64_t b = 0; b < b1 - b0; b++) moving += ids[b] != KVF_BLOCK_SKIP;
  uint64_t bytes = moving * per_block;
  const kvf_group *gr = &g->groups[gi];
  if (gr->desc.kind != KVF_GROUP_RECURRENT && ids[b1 - 1 - b0] != KVF_BLOCK_SKIP) {
    uint64_t end_tokens = b1 * gr->desc.block_size;
    if (end_tokens > lt_end) bytes -= (end_tokens - lt_end) * (per_block / gr->desc.block_size);
  }
  return bytes;
}

/* kvf_blob_build, also saying which groups' ids it copied (bit gi of
 * *moving_groups). */
static uint64_t blob_build(const kvf_geometry *g, const kvf_plan *plan, const kvf_copy_request *r, int gather,
                           const kvf_blob_opts *opts, void *out, uint64_t *moving_groups) {
  kvf_blob_header *h = out;
  memset(h, 0, sizeof *h);
  uint64_t c = g->policy.chunk_tokens;
  h->lt_begin = kvf_local_token(g, r->token_begin);
  h->lt_end = kvf_local_token(g, r->token_end);
  h->chunk_local = c / g->dcp_world;
  h->chunk_begin = r->token_begin / c;
  h->num_chunks = (uint32_t)kvf_copy_request_chunks(g, r);
  h->full_chunks = r->token_end / c - r->token_begin / c;
  h->num_object_groups = g->num_object_groups;
  h->gather = gather ? 1 : 0;
  for (uint32_t gi = 0; gi < g->num_groups; gi++)
    if (g->groups[gi].desc.num_blocks > h->num_blocks_max) h->num_blocks_max = g->groups[gi].desc.num_blocks;
  blob_layout(g, plan, r, opts, h);

  char *base = out;
  kvf_blob_entry *e = (kvf_blob_entry *)(base + h->off_entries);
  uint32_t *id_out = (uint32_t *)(base + h->off_ids);
  uint64_t *objects = (uint64_t *)(base + h->off_objects);
  uint64_t nobj = (uint64_t)h->num_chunks * g->num_object_groups;
  /* Pointer alignment per object group lowers vector widths where needed. */
  uint64_t og_bits[KVF_MAX_GROUPS] = {0};
  for (uint64_t i = 0; i < nobj; i++) {
    objects[i] = r->objects ? (uint64_t)(uintptr_t)r->objects[i] : 0; /* NULL: no group moves (checked) */
    og_bits[i % g->num_object_groups] |= objects[i];
  }

  /* The payload first: the slice may depend on it (opts->task_slots).
   * moving[gi]: group gi has blocks to move and segments in this blob. */
  uint64_t b0s[KVF_MAX_GROUPS], b1s[KVF_MAX_GROUPS];
  int moving[KVF_MAX_GROUPS] = {0};
  for (uint32_t gi = 0; gi < g->num_groups; gi++) {
    uint64_t per_block;
    kvf_blob_group_window(g, r, gi, &b0s[gi], &b1s[gi]);
    if (b0s[gi] == b1s[gi] || !(per_block = group_block_bytes(plan, opts, gi))) continue;
    moving[gi] = 1;
    *moving_groups |= (uint64_t)1 << gi; /* num_groups < KVF_MAX_GROUPS (64): geometry.c checks */
    h->payload_bytes += group_payload_of(g, r, gi, b0s[gi], b1s[gi], h->lt_end, per_block);
  }
  const uint32_t slice = kvf_blob_slice_for(opts, h->payload_bytes);
  h->slice_bytes = slice;

  kvf_blob_shape *shapes = (kvf_blob_shape *)(base + h->off_shapes);
  uint32_t og_align[KVF_MAX_GROUPS];
  for (uint32_t og = 0; og < g->num_object_groups; og++) og_align[og] = align_of(og_bits[og]);
  uint64_t tasks = 0, at_ids = 0;
  uint32_t ne = 0, ns = 0;
  uint32_t recent[4] = {0}; /* the segments of the last four entries */
  for (uint32_t gi = 0; gi < g->num_groups; gi++) {
    if (!moving[gi]) continue;
    const uint64_t b0 = b0s[gi], b1 = b1s[gi];
    const kvf_group_blocks *t = &r->groups[gi];
    memcpy(id_out + at_ids, t->block_ids + (b0 - t->first_block), (b1 - b0) * sizeof(uint32_t));
    for (uint32_t s = plan->group_first[gi]; s < plan->group_first[gi + 1]; s++) {
      if (!seg_in(opts, s)) continue;
      const kvf_segment *seg = &plan->segments[s];
      const uint64_t region_base = r->region_bases ? (uint64_t)(uintptr_t)r->region_bases[seg->region] : 0;
      const uint32_t vec = min_u32(seg->align, min_u32(align_of(region_base), og_align[seg->object_group]));
      kvf_blob_entry *x = &e[ne];
      x->cache_base = region_base + seg->src_offset;
      x->first_task = tasks;
      x->lb_rel = b0 - (seg->recurrent ? h->chunk_begin : h->lt_begin / seg->tokens);
      /* Below 2^32: kvf_plan_build checks a segment's offsets inside an
       * object, kvf_copy_request_check the request's blocks. */
      x->dst_per_token = (uint32_t)seg->dst_per_token;
      x->dst_const = (uint32_t)seg->dst_const;
      x->ids_offset = (uint32_t)at_ids;
      /* A layer's planes or states and the layers after it mostly repeat
       * the shape of one of the last four entries, which is then taken as
       * is rather than built and compared (a call builds this on the
       * engine's thread: 1.5-3.4 us for one chunk before). */
      const kvf_blob_entry *known = NULL;
      for (uint32_t back = 1; back <= 4 && back <= ne && !known; back++) {
        const kvf_blob_entry *y = &e[ne - back];
        if (shapes[y->shape].vec == vec && same_shape(seg, &plan->segments[recent[(ne - back) % 4]])) known = y;
      }
      if (known) {
        set_slices(x, known->slices, b1 - b0, known);
        x->shape = known->shape;
      } else {
        kvf_blob_shape sh;
        shape_of(h, seg, vec, slice, &sh);
        set_slices(x, shape_slices(&sh), b1 - b0, NULL);
        x->shape = shape_index(shapes, &ns, &sh);
      }
      x->object_group = (uint16_t)seg->object_group;
      recent[ne % 4] = s;
      tasks += (b1 - b0) * x->slices;
      ne++;
    }
    at_ids += b1 - b0;
  }
  h->num_entries = ne;
  h->num_shapes = ns;
  h->off_buckets = round16(h->off_shapes + ns * sizeof(kvf_blob_shape));
  h->total_tasks = tasks;
  blob_buckets(h);
  return tasks;
}

uint64_t kvf_blob_build(const kvf_geometry *g, const kvf_plan *plan, const kvf_copy_request *r, int gather,
                        const kvf_blob_opts *opts, void *out) {
  uint64_t moving_groups = 0;
  return blob_build(g, plan, r, gather, opts, out, &moving_groups);
}

/* ---- the memo of built blobs ------------------------------------------------ */

/* Room for a memo key (kvf_blob_build_memo): its words, then the mask. */
static size_t memo_key_size(const kvf_geometry *g, const kvf_plan *plan, const kvf_blob_opts *opts) {
  size_t words = 13 + 4 * (size_t)g->num_groups + g->num_object_groups + g->num_regions;
  return words * sizeof(uint64_t) + (opts && opts->segments ? plan->num_segments : 0);
}

uint64_t kvf_blob_build_memo(kvf_memo *m, const kvf_geometry *g, const kvf_plan *plan,
                             const kvf_copy_request *r, int gather, const kvf_blob_opts *opts, void *out) {
  const size_t size = memo_key_size(g, plan, opts);
  unsigned char *key = kvf_memo_scratch(m, size);
  if (!key) return kvf_blob_build(g, plan, r, gather, opts, out); /* a shortcut, never a reason to fail */
  /* What kvf_blob_build reads, with the request's place in its sequence
   * made relative: two requests of one key lie a whole number of chunks
   * apart (their first tokens agree modulo the chunk; a checked request
   * begins on one), so their local tokens, chunks and blocks differ by one
   * constant each, which only the header's lt_begin, lt_end and chunk_begin
   * and the shapes' first_block carry (entries count from them). Nothing
   * divides by the chunk's local tokens: a geometry of recurrent groups
   * only may have none (a chunk shorter than its DCP world). */
  const uint64_t c = g->policy.chunk_tokens;
  const uint64_t lt_begin = kvf_local_token(g, r->token_begin), lt_end = kvf_local_token(g, r->token_end);
  const uint64_t chunk_begin = r->token_begin / c, num_chunks = kvf_copy_request_chunks(g, r);
  const uint64_t nobj = num_chunks * g->num_object_groups;
  uint64_t *w = (uint64_t *)key;
  size_t n = 0;
  w[n++] = (uint64_t)(uintptr_t)g;
  w[n++] = (uint64_t)(uintptr_t)plan;
  w[n++] = gather ? 1 : 0;
  w[n++] = opts ? opts->slice_bytes : 0;
  w[n++] = opts ? opts->task_slots : 0;
  w[n++] = opts && opts->segments ? 1 : 0;
  w[n++] = r->token_begin % c;
  w[n++] = r->token_end - r->token_begin;
  w[n++] = lt_end - lt_begin;
  w[n++] = num_chunks;
  w[n++] = r->token_end / c - chunk_begin;
  w[n++] = r->region_bases ? 1 : 0;
  w[n++] = r->objects ? 1 : 0;
  uint64_t b0s[KVF_MAX_GROUPS], b1s[KVF_MAX_GROUPS];
  for (uint32_t gi = 0; gi < g->num_groups; gi++) {
    kvf_blob_group_window(g, r, gi, &b0s[gi], &b1s[gi]);
    const uint64_t b0 = b0s[gi], b1 = b1s[gi];
    if (b0 == b1) {
      memset(w + n, 0, 4 * sizeof *w);
      n += 4;
      continue;
    }
    const kvf_group *gr = &g->groups[gi];
    const int recurrent = gr->desc.kind == KVF_GROUP_RECURRENT;
    const kvf_group_blocks *t = &r->groups[gi];
    const uint32_t *ids = t->block_ids + (b0 - t->first_block);
    uint64_t skipped = 0;
    for (uint64_t b = 0; b < b1 - b0; b++) skipped += ids[b] == KVF_BLOCK_SKIP;
    w[n++] = b0 - (recurrent ? chunk_begin : lt_begin / gr->desc.block_size);
    w[n++] = b1 - b0;
    w[n++] = skipped;
    w[n++] = ids[b1 - 1 - b0] == KVF_BLOCK_SKIP;
  }
  uint64_t og_bits[KVF_MAX_GROUPS] = {0};
  if (r->objects)
    for (uint64_t i = 0; i < nobj; i++) og_bits[i % g->num_object_groups] |= (uint64_t)(uintptr_t)r->objects[i];
  for (uint32_t og = 0; og < g->num_object_groups; og++) w[n++] = align_of(og_bits[og]);
  for (uint32_t i = 0; i < g->num_regions; i++) w[n++] = r->region_bases ? (uint64_t)(uintptr_t)r->region_bases[i] : 0;
  if (opts && opts->segments) memcpy(w + n, opts->segments, plan->num_segments);
  const kvf_memo_slot *s = kvf_memo_find(m, key, size);
  if (!s) {
    /* A miss: build, and keep the blob under its key when small enough. */
    uint64_t moving_groups = 0;
    const uint64_t tasks = blob_build(g, plan, r, gather, opts, out, &moving_groups);
    const uint64_t built = ((const kvf_blob_header *)out)->size;
    if (built <= KVF_BLOB_MEMO_MAX_BYTES) kvf_memo_keep(m, key, size, out, (size_t)built, tasks, moving_groups);
    return tasks;
  }
  /* A hit: the kept blob (result[0] its tasks, result[1] the groups whose
   * ids the build copied), with what changes from call to call written in. */
  memcpy(out, s->value, s->value_size);
  kvf_blob_header *h = out;
  h->lt_begin = lt_begin;
  h->lt_end = lt_end;
  h->chunk_begin = chunk_begin;
  kvf_blob_shape *shapes = (kvf_blob_shape *)((char *)out + h->off_shapes);
  for (uint32_t i = 0; i < h->num_shapes; i++)
    if (!shapes[i].recurrent) shapes[i].first_block = lt_begin / shapes[i].tokens;
  uint32_t *id_out = (uint32_t *)((char *)out + h->off_ids);
  for (uint32_t gi = 0, at = 0; gi < g->num_groups; gi++) {
    if (!(s->result[1] >> gi & 1)) continue;
    const kvf_group_blocks *t = &r->groups[gi];
    memcpy(id_out + at, t->block_ids + (b0s[gi] - t->first_block), (b1s[gi] - b0s[gi]) * sizeof(uint32_t));
    at += (uint32_t)(b1s[gi] - b0s[gi]);
  }
  uint64_t *objects = (uint64_t *)((char *)out + h->off_objects);
  for (uint64_t i = 0; i < nobj; i++) objects[i] = r->objects ? (uint64_t)(uintptr_t)r->objects[i] : 0;
  return s->result[0];
}

uint32_t kvf_blob_entry_segments(const kvf_geometry *g, const kvf_plan *plan, const kvf_copy_request *r,
                                 const kvf_blob_opts *opts, uint32_t *out) {
  /* kvf_blob_build's order: the groups that move blocks in this blob, each
   * group's segments of the blob. */
  uint32_t n = 0;
  for (uint32_t gi = 0; gi < g->num_groups; gi++) {
    uint64_t b0, b1;
    kvf_blob_group_window(g, r, gi, &b0, &b1);
    if (b0 == b1 || !group_block_bytes(plan, opts, gi)) continue;
    for (uint32_t s = plan->group_first[gi]; s < plan->group_first[gi + 1]; s++)
      if (seg_in(opts, s)) out[n++] = s;
  }
  return n;
}

/* Fill the blob's task -> entry table from its entries' first tasks. */
static void blob_buckets(kvf_blob_header *h) {
  const kvf_blob_entry *e = (const kvf_blob_entry *)((const char *)h + h->off_entries);
  uint16_t *b = (uint16_t *)((char *)h + h->off_buckets);
  uint32_t shift = 0;
  while ((h->total_tasks >> shift) >= KVF_BLOB_BUCKETS) shift++;
  h->bucket_shift = shift;
  /* Entries of T tasks each (the layers of one shape, the usual blob) need
   * no table: t / T by a multiplier, where exact for every task. The blob
   * then ends before the table (a launch copies every byte of it). */
  h->entry_tasks_magic = 0;
  uint64_t per = h->num_entries ? h->total_tasks / h->num_entries : 0;
  int uniform = per * h->num_entries == h->total_tasks && multiplier_exact(per, h->total_tasks);
  for (uint32_t i = 0; uniform && i < h->num_entries; i++) uniform = e[i].first_task == i * per;
  if (uniform) h->entry_tasks_magic = multiplier_of(per);
  const uint32_t had = h->num_buckets;
  h->num_buckets = uniform ? 0 : (uint32_t)(h->total_tasks >> shift) + 1;
  h->size = h->off_buckets + h->num_buckets * sizeof(uint16_t);
  /* A re-cut blob keeps no slots of its earlier table past its end. */
  if (had > h->num_buckets) memset(b + h->num_buckets, 0, (had - h->num_buckets) * sizeof *b);
  uint32_t at = 0;
  for (uint32_t i = 0; i < h->num_buckets; i++) {
    uint64_t task = (uint64_t)i << shift;
    while (at + 1 < h->num_entries && e[at + 1].first_task <= task) at++;
    b[i] = (uint16_t)at;
  }
}

uint32_t kvf_blob_entry_of(const void *blob, uint64_t task) {
  const kvf_blob_header *h = blob;
  if (h->entry_tasks_magic) return (uint32_t)(((uint64_t)(uint32_t)task * h->entry_tasks_magic) >> 32);
  const kvf_blob_entry *e = (const kvf_blob_entry *)((const char *)blob + h->off_entries);
  const uint16_t *b = (const uint16_t *)((const char *)blob + h->off_buckets);
  uint32_t at = b[task >> h->bucket_shift];
  while (at + 1 < h->num_entries && e[at + 1].first_task <= task) at++;
  return at;
}

uint64_t kvf_blob_reslice(void *blob, uint32_t slice_bytes) {
  kvf_blob_header *h = blob;
  kvf_blob_entry *e = (kvf_blob_entry *)((char *)blob + h->off_entries);
  kvf_blob_shape *shapes = (kvf_blob_shape *)((char *)blob + h->off_shapes);
  uint32_t slice = slice_of(slice_bytes);
  uint64_t tasks = 0;
  h->slice_bytes = slice;
  for (uint32_t i = 0; i < h->num_shapes; i++) shapes[i].slice_units = slice / shapes[i].vec;
  for (uint32_t i = 0; i < h->num_entries; i++) {
    uint64_t end = i + 1 < h->num_entries ? e[i + 1].first_task : h->total_tasks;
    uint64_t blocks = (end - e[i].first_task) / e[i].slices; /* read before first_task is rewritten */
    e[i].first_task = tasks;
    set_slices(&e[i], shape_slices(&shapes[e[i].shape]), blocks, NULL);
    tasks += blocks * e[i].slices;
  }
  h->total_tasks = tasks;
  blob_buckets(h);
  return tasks;
}

/* ---- the CPU path -------------------------------------------------------- */

/* Everything a task needs, decoded from the blob: shared in spirit with the
 * kernel's decode in xfer_kernel.cu (same formulas). */
typedef struct task_view {
  const kvf_blob_shape *sh;
  char *cache;       /* run (t=0, h=0) of the block */
  char *object;      /* its place in the object */
  uint64_t unit_begin, unit_end;
} task_view;

/* a / b through 32 bits when both fit (several times cheaper per block). */
static uint64_t div_u64(uint64_t a, uint64_t b) {
  if (((a | b) >> 32) == 0) return (uint32_t)a / (uint32_t)b;
  return a / b;
}

/* Block j of entry e: its object index, object offset and units; 0 when it
 * moves nothing (a skipped block, a block past the request's end). The same
 * formulas as the kernel's decode (xfer_kernel.cu). */
static int block_of(const kvf_blob_header *h, const kvf_blob_entry *e, uint64_t j, uint32_t *id_out,
                    uint64_t *obj_index, uint64_t *obj_off, uint64_t *units) {
  const char *blob = (const char *)h;
  const uint32_t *ids = (const uint32_t *)(blob + h->off_ids);
  const kvf_blob_shape *s = kvf_blob_shape_of(h, e);
  uint32_t id = ids[e->ids_offset + j];
  if (id == KVF_BLOCK_SKIP || id >= h->num_blocks_max) return 0;
  uint64_t lb = kvf_blob_entry_lb(h, e) + j, k;
  if (s->recurrent) {
    k = lb - h->chunk_begin;
    *units = s->units_per_run;
    *obj_off = h->chunk_local * e->dst_per_token + e->dst_const;
  } else {
    uint64_t d = lb - s->first_block, chunk_start;
    k = div_u64(d, s->blocks_per_chunk);
    chunk_start = h->lt_begin + k * h->chunk_local;
    uint64_t n = h->lt_end - chunk_start < h->chunk_local ? h->lt_end - chunk_start : h->chunk_local;
    uint64_t valid = h->lt_end - lb * s->tokens;
    if (valid > s->tokens) valid = s->tokens;
    *units = valid * s->units_per_token;
    *obj_off = n * e->dst_per_token + e->dst_const + (d - k * s->blocks_per_chunk) * s->dst_block;
  }
  *id_out = id;
  *obj_index = k * h->num_object_groups + s->object_group;
  return *units > 0;
}

static int decode(const kvf_blob_header *h, uint64_t task, task_view *tv) {
  const char *blob = (const char *)h;
  const kvf_blob_entry *entries = (const kvf_blob_entry *)(blob + h->off_entries);
  const kvf_blob_entry *e = &entries[kvf_blob_entry_of(h, task)];
  const uint64_t *objects = (const uint64_t *)(blob + h->off_objects);
  const kvf_blob_shape *s = kvf_blob_shape_of(h, e);
  uint64_t local = task - e->first_task, j = local / e->slices, slice = local % e->slices;
  uint64_t oi, obj_off, units;
  uint32_t id;
  if (!block_of(h, e, j, &id, &oi, &obj_off, &units)) return 0;
  uint64_t slice_units = s->slice_units;
  tv->unit_begin = slice * slice_units;
  tv->unit_end = tv->unit_begin + slice_units < units ? tv->unit_begin + slice_units : units;
  if (tv->unit_begin >= tv->unit_end) return 0;
  /* An object left out of this blob (another leg of the call moves it). */
  uint64_t object = objects[oi];
  if (object == 0) return 0;
  tv->sh = s;
  tv->cache = (char *)(uintptr_t)e->cache_base + (uint64_t)id * s->src_block;
  tv->object = (char *)(uintptr_t)object + obj_off;
  return 1;
}

/* An entry's blocks one after another: block_of's formulas stepped from one
 * block to the next (a block is `tokens` further, one dst_block further in
 * its object, the next object at a chunk's end), so a run list costs no
 * division per block. A staged call's copies and the copy-engine route take
 * their runs from here on every call: with block_of per block (and a sort
 * of extents already in order) the run lists of a one-chunk call of 4
 * pieces took 23-25 us on Llama NHD and 67 us on the 80-layer slice, 10.5-12
 * and 29-39 us this way (the 2-core development VM, 10th percentiles of
 * 3000 calls). Consecutive moving blocks of one chunk are handed over as
 * one stretch: the per-block work is then a look at the id and the token
 * count, and a caller that folds blocks into object extents (a staged
 * call's copies) does so once per stretch. */
uint64_t kvf_blob_visit_stretches(const void *blob, kvf_blob_stretch_fn visit, void *ctx) {
  const kvf_blob_header *h = blob;
  const char *b = blob;
  const kvf_blob_entry *entries = (const kvf_blob_entry *)(b + h->off_entries);
  const uint64_t *objects = (const uint64_t *)(b + h->off_objects);
  const uint32_t *ids = (const uint32_t *)(b + h->off_ids);
  const uint64_t lt_end = h->lt_end, chunk_local = h->chunk_local;
  const uint32_t max_id = h->num_blocks_max; /* below KVF_BLOCK_SKIP */
  uint64_t n = 0;
  for (uint32_t i = 0; i < h->num_entries; i++) {
    const kvf_blob_entry *e = &entries[i];
    const kvf_blob_shape *s = kvf_blob_shape_of(blob, e);
    uint64_t end = i + 1 < h->num_entries ? entries[i + 1].first_task : h->total_tasks;
    uint64_t blocks = (end - e->first_task) / e->slices;
    if (blocks == 0) continue;
    const uint32_t *eid = ids + e->ids_offset;
    uint64_t lb = kvf_blob_entry_lb(blob, e);
    if (s->recurrent) {
      /* A state a chunk: each its own stretch. */
      uint64_t k = lb - h->chunk_begin, units = s->units_per_run;
      uint64_t obj_off = chunk_local * e->dst_per_token + e->dst_const;
      for (uint64_t j = 0; j < blocks; j++, k++) {
        uint64_t oi = k * h->num_object_groups + s->object_group;
        if (eid[j] >= max_id || units == 0 || objects[oi] == 0) continue;
        const kvf_blob_stretch st = {i, oi, eid + j, 1, (char *)(uintptr_t)objects[oi] + obj_off, units};
        visit(ctx, e, s, &st);
        n++;
      }
      continue;
    }
    /* Where block 0 of the entry is: its chunk k and its index bi there. */
    const uint64_t tokens = s->tokens, full = tokens * s->units_per_token;
    uint64_t start = lb * tokens, rel = start - h->lt_begin;
    uint64_t k = div_u64(rel, chunk_local), bi = div_u64(rel - k * chunk_local, tokens);
    for (uint64_t j = 0; j < blocks;) {
      /* This chunk's blocks from j: to the chunk's end (chunk_local is a
       * multiple of the block's tokens: geometry.c checks it). */
      uint64_t m = s->blocks_per_chunk - bi;
      if (m > blocks - j) m = blocks - j;
      uint64_t chunk_start = h->lt_begin + k * chunk_local;
      uint64_t nk = lt_end - chunk_start < chunk_local ? lt_end - chunk_start : chunk_local;
      uint64_t oi = k * h->num_object_groups + s->object_group;
      /* The block holding the request's end, where it is in this chunk
       * (its units: block_of's, the tokens before the end; none when the
       * end is where it starts); every other block moves whole. A built
       * blob has no block past that one (kvf_blob_build stops at the
       * request's last block). */
      uint64_t short_at = UINT64_MAX, short_units = 0;
      if (lt_end >= start && lt_end - start < m * tokens) {
        uint64_t q = (lt_end - start) / tokens;
        short_at = j + q;
        short_units = (lt_end - start - q * tokens) * s->units_per_token;
      }
      if (objects[oi] != 0) {
        char *first = (char *)(uintptr_t)objects[oi] + nk * e->dst_per_token + e->dst_const + bi * s->dst_block;
        for (uint64_t a = j; a < j + m;) {
          /* A stretch: moving blocks from a (an id below max_id is not
           * KVF_BLOCK_SKIP), the short block last. */
          uint64_t q = a, qe = short_at < j + m ? short_at : j + m, units_last = full;
          while (q < qe && eid[q] < max_id) q++;
          if (q == short_at && eid[q] < max_id && short_units > 0) {
            q++;
            units_last = short_units;
          }
          if (q > a) {
            const kvf_blob_stretch st = {i, oi, eid + a, q - a, first + (a - j) * s->dst_block, units_last};
            visit(ctx, e, s, &st);
            n += q - a;
            a = q;
          } else {
            a++; /* a block that moves nothing */
          }
        }
      }
      /* The next chunk from its first block (or the entry's end). */
      j += m;
      start += m * tokens;
      k++;
      bi = 0;
    }
  }
  return n;
}

typedef struct block_store {
  kvf_blob_block *out;
  uint64_t cap, n;
} block_store;

static void store_blocks(void *ctx, const kvf_blob_entry *e, const kvf_blob_shape *s, const kvf_blob_stretch *st) {
  block_store *bs = ctx;
  const uint64_t full = (uint64_t)s->tokens * s->units_per_token;
  for (uint64_t q = 0; q < st->count; q++, bs->n++) {
    if (bs->n >= bs->cap) continue;
    kvf_blob_block *o = &bs->out[bs->n];
    o->entry = st->entry;
    o->object_index = st->object_index;
    o->cache = (char *)(uintptr_t)e->cache_base + (uint64_t)st->ids[q] * s->src_block;
    o->object = st->object + q * s->dst_block;
    o->units = q + 1 == st->count ? st->units_last : full;
  }
}

uint64_t kvf_blob_blocks(const void *blob, kvf_blob_block *out, uint64_t cap) {
  block_store bs = {out, cap, 0};
  return kvf_blob_visit_stretches(blob, store_blocks, &bs);
}

uint64_t kvf_blob_object_extent(const kvf_blob_shape *s, uint64_t units) {
  if (units == 0) return 0;
  if (kvf_blob_shape_linear(s)) return units * s->vec;
  /* Offsets are affine with nonnegative strides in (token, head, unit):
   * the last unit has each index at its largest. */
  uint64_t u = units - 1, t = u / s->units_per_token, r = u % s->units_per_token;
  uint64_t hh = r / s->units_per_run, c = r % s->units_per_run;
  uint64_t last = t * s->dst_token + hh * s->dst_head + c * s->vec + s->vec;
  return last;
}

/* Copies of a large transfer write memory nobody reads soon: streaming
 * (non-temporal) stores skip the read-for-ownership of each destination line
 * and the cache pollution. A big memcpy does the same (glibc streams above a
 * share of the last-level cache), but a transfer is many runs of 256 bytes to
 * a few hundred KiB, each below that threshold: the host backend copied at
 * about half a memcpy's rate on a 2-core EPYC VM (4.5 against 9 GB/s, one
 * 256-token Llama chunk, perf/results/2026-12-01-cpu-host). */
#if defined(__SSE2__)
#include <emmintrin.h>
#define KVF_HAVE_STREAM 1
static void copy_stream(char *dst, const char *src, uint64_t n) {
  uint64_t head = (16 - ((uintptr_t)dst & 15)) & 15;
  if (head > n) head = n;
  memcpy(dst, src, head);
  dst += head;
  src += head;
  n -= head;
  for (; n >= 64; n -= 64, dst += 64, src += 64) {
    __m128i a = _mm_loadu_si128((const __m128i *)src), b = _mm_loadu_si128((const __m128i *)(src + 16));
    __m128i c = _mm_loadu_si128((const __m128i *)(src + 32)), d = _mm_loadu_si128((const __m128i *)(src + 48));
    _mm_stream_si128((__m128i *)dst, a);
    _mm_stream_si128((__m128i *)(dst + 16), b);
    _mm_stream_si128((__m128i *)(dst + 32), c);
    _mm_stream_si128((__m128i *)(dst + 48), d);
  }
  for (; n >= 16; n -= 16, dst += 16, src += 16) _mm_stream_si128((__m128i *)dst, _mm_loadu_si128((const __m128i *)src));
  memcpy(dst, src, n);
}
#endif

void kvf_blob_run_cpu(const void *blob, uint64_t first, uint64_t end) {
  kvf_blob_run_cpu_opt(blob, first, end, 0);
}

void kvf_blob_run_cpu_opt(const void *blob, uint64_t first, uint64_t end, int stream) {
  const kvf_blob_header *h = blob;
#if !KVF_HAVE_STREAM
  stream = 0;
#endif
  for (uint64_t task = first; task < end; task++) {
    task_view tv;
    if (!decode(h, task, &tv)) continue;
    const kvf_blob_shape *s = tv.sh;
    uint64_t u = tv.unit_begin, vec = s->vec;
    /* One memcpy per piece of run inside the slice. */
    while (u < tv.unit_end) {
      uint64_t t = u / s->units_per_token, r = u % s->units_per_token;
      uint64_t hh = r / s->units_per_run, c = r % s->units_per_run;
      uint64_t len = s->units_per_run - c;
      if (len > tv.unit_end - u) len = tv.unit_end - u;
      char *cache = tv.cache + t * s->src_token + hh * s->src_head + c * vec;
      char *obj = tv.object + t * s->dst_token + hh * s->dst_head + c * vec;
      char *to = h->gather ? obj : cache;
      const char *from = h->gather ? cache : obj;
#if KVF_HAVE_STREAM
      if (stream)
        copy_stream(to, from, len * vec);
      else
#endif
        memcpy(to, from, len * vec);
      u += len;
    }
  }
#if KVF_HAVE_STREAM
  if (stream) _mm_sfence(); /* streaming stores are weakly ordered: visible before this returns */
#endif
}

uint64_t kvf_blob_payload(const void *blob) {
  const kvf_blob_header *h = blob;
  uint64_t bytes = 0;
  for (uint64_t task = 0; task < h->total_tasks; task++) {
    task_view tv;
    if (decode(h, task, &tv)) bytes += (tv.unit_end - tv.unit_begin) * tv.sh->vec;
  }
  return bytes;
}
