/* The staged route's plan (host/core/xfer_internal.h): which objects of a
 * host<->device request cross PCIe through the device staging buffers, which
 * of their bytes, and the batches of whole chunks the call moves. Pure C: the
 * CUDA side (host/core/xfer.c) allocates and enqueues from this plan. */
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "geometry/geometry_internal.h"
#include "host/core/xfer_internal.h"
#include "kernels/plan.h"

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

static uint64_t chunk_stage_bytes(const kvf_stage_plan *p, uint64_t nog, uint64_t k) {
  uint64_t bytes = 0;
  for (uint64_t og = 0; og < nog; og++) bytes += p->size[k * nog + og];
  return bytes;
}

void kvf_stage_plan_batches(kvf_stage_plan *p, uint64_t cap, uint64_t edge_cap, int gather) {
  uint64_t chunks = p->num_chunks, nog = chunks ? p->num_objects / chunks : 0, nb = 0;
  if (edge_cap == 0 || edge_cap > cap) edge_cap = cap;
  /* A scatter's last batch: the trailing chunks that fit edge_cap (at least
   * one); the chunks before it are batched at cap. */
  uint64_t tail = chunks;
  if (!gather && edge_cap < cap && chunks > 0) {
    uint64_t used = 0;
    for (tail = chunks; tail > 0; tail--) {
      uint64_t bytes = chunk_stage_bytes(p, nog, tail - 1);
      if (tail < chunks && used + bytes > edge_cap) break;
      used += bytes;
    }
  }
  for (uint64_t k = 0; k < chunks;) {
    kvf_stage_batch *b = &p->batches[nb++];
    uint64_t used = 0, limit = gather && nb == 1 ? edge_cap : cap, end = k < tail ? tail : chunks;
    b->k0 = k;
    while (k < end) {
      uint64_t bytes = chunk_stage_bytes(p, nog, k);
      if (k > b->k0 && used + bytes > limit) break;
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

/* ---- pieces ---------------------------------------------------------------- */

/* The blocks of group gi the request names (chunks for a recurrent group):
 * how many at most it moves (skipped ids counted). */
static uint64_t group_blocks(const kvf_geometry *g, const kvf_copy_request *r, uint32_t gi) {
  uint64_t lo, hi;
  kvf_blob_group_window(g, r, gi, &lo, &hi);
  return hi - lo;
}

/* group_blocks of the last group asked for (a group moves when it is not
 * 0, the blob's own test): a plan's segments come group by group, so a walk
 * over them computes each group's count (its divisions) once rather than
 * two or three times per segment. */
typedef struct group_memo {
  uint32_t gi;
  uint64_t blocks;
} group_memo;
#define GROUP_MEMO_INIT {UINT32_MAX, 0}

static uint64_t memo_blocks(group_memo *m, const kvf_geometry *g, const kvf_copy_request *r, uint32_t gi) {
  if (m->gi != gi) {
    m->gi = gi;
    m->blocks = group_blocks(g, r, gi);
  }
  return m->blocks;
}

/* Whether the copy engine can move a segment's blocks as they are: each
 * block one run on both sides (as the batch route asks) of at least min_run
 * bytes. */
static int segment_straight(const kvf_segment *s, uint64_t min_run) {
  return kvf_segment_linear(s) && (uint64_t)s->run * s->tokens >= min_run;
}

uint64_t kvf_stage_straight_pick(const kvf_geometry *g, const kvf_plan *plan, const kvf_copy_request *r, int from_end,
                                 uint64_t min_run, uint64_t target, uint64_t limit, uint64_t max_runs,
                                 unsigned char *pick) {
  uint32_t ns = plan->num_segments;
  memset(pick, 0, ns);
  uint64_t picked = 0, picked_runs = 0;
  /* Whole views, walked from the first (a gather's head) or from the last
   * (a scatter's tail). */
  for (uint32_t v = 0; v < ns && picked < target;) {
    uint32_t a = from_end ? ns - 1 - v : v, lo = a, hi = a;
    uint32_t view = plan->segments[a].view;
    while (lo > 0 && plan->segments[lo - 1].view == view) lo--;
    while (hi + 1 < ns && plan->segments[hi + 1].view == view) hi++;
    v += hi - lo + 1;
    uint64_t bytes = 0, runs = 0;
    int ok = 1;
    for (uint32_t s = lo; s <= hi && ok; s++) {
      const kvf_segment *seg = &plan->segments[s];
      uint64_t blocks = group_blocks(g, r, seg->group);
      ok = blocks > 0 && segment_straight(seg, min_run);
      bytes += blocks * seg->run * seg->tokens;
      runs += blocks; /* a linear block is one run (at most: neighbours may merge) */
    }
    if (!ok) continue;
    /* picked <= limit and picked_runs <= max_runs throughout */
    if (bytes > limit - picked || runs > max_runs - picked_runs) break;
    memset(pick + lo, 1, hi - lo + 1);
    picked += bytes;
    picked_runs += runs;
  }
  return picked;
}

/* A segment's weight in the piece split: the bytes it moves per token of
 * the request. An attention segment moves run * heads bytes for each of
 * its tokens; a recurrent one moves whole states (one a chunk), so its
 * states' bytes are spread over the request's tokens. Counting a state as
 * bytes per token (as before) weighed a state against the attention views
 * at the chunk's tokens (256) times its bytes: on glm-like a 38 KiB state
 * outweighed a 512 KiB layer 19 to 1, and a scatter's last pieces were one
 * state each (perf/results/2026-12-03-h200-cap4-straight).
 * Windowed attention keeps its per-token weight: weighing it by the blocks
 * it moves measured worse on gpt-oss-like (perf/results/
 * 2026-12-03-h200-pieces). */
static double segment_weight(const kvf_copy_request *r, const kvf_segment *seg, uint64_t group_blocks) {
  if (!seg->recurrent) return (double)seg->run * (double)seg->heads;
  uint64_t tokens = r->token_end > r->token_begin ? r->token_end - r->token_begin : 1;
  return (double)group_blocks * (double)seg->run * (double)seg->heads * (double)seg->tokens / (double)tokens;
}

uint32_t kvf_stage_piece_masks(const kvf_geometry *g, const kvf_plan *plan, const kvf_copy_request *r, int gather,
                               uint32_t pieces, unsigned char *masks) {
  return kvf_stage_piece_masks_growth(g, plan, r, gather, pieces, 2, masks);
}

uint32_t kvf_stage_piece_masks_growth(const kvf_geometry *g, const kvf_plan *plan, const kvf_copy_request *r,
                                      int gather, uint32_t pieces, uint32_t growth, unsigned char *masks) {
  if (growth < 1) growth = 1;
  uint32_t ns = plan->num_segments;
  if (pieces < 1) pieces = 1;
  if (pieces > KVF_STAGE_MAX_PIECES) pieces = KVF_STAGE_MAX_PIECES;
  memset(masks, 0, (size_t)pieces * ns);
  /* Moving views and their weights (segment_weight). */
  double total = 0;
  uint32_t views = 0;
  group_memo memo = GROUP_MEMO_INIT;
  for (uint32_t s = 0; s < ns; s++) {
    const kvf_segment *seg = &plan->segments[s];
    uint64_t blocks = memo_blocks(&memo, g, r, seg->group);
    if (!blocks) continue;
    total += segment_weight(r, seg, blocks);
    /* A view's segments are of one group: the previous segment moves when it is of the same view. */
    if (s == 0 || plan->segments[s - 1].view != seg->view) views++;
  }
  if (views == 0) return 1;
  if (pieces > views) pieces = views;
  /* Shares 1, g, g^2, ... (a scatter: the reverse); boundary p ends at the
   * cumulative share of pieces 0..p. */
  double weight[KVF_STAGE_MAX_PIECES], sum = 0;
  for (uint32_t p = 0; p < pieces; p++) {
    uint32_t e = gather ? p : pieces - 1 - p;
    weight[p] = 1;
    for (uint32_t k = 0; k < e; k++) weight[p] *= (double)growth;
    sum += weight[p];
  }
  double acc = 0, bound = total * weight[0] / sum;
  uint32_t p = 0, seen = 0;
  memo = (group_memo)GROUP_MEMO_INIT;
  for (uint32_t s = 0; s < ns; s++) {
    const kvf_segment *seg = &plan->segments[s];
    uint64_t blocks = memo_blocks(&memo, g, r, seg->group);
    if (!blocks) continue;
    int first_of_view = s == 0 || plan->segments[s - 1].view != seg->view;
    if (first_of_view) {
      /* Close the piece once it holds its share, keeping one view for each
       * piece still to come. */
      if (seen > 0 && p + 1 < pieces && (acc >= bound || views - seen == pieces - 1 - p)) {
        p++;
        bound += total * weight[p] / sum;
      }
      seen++;
    }
    masks[(size_t)p * ns + s] = 1;
    acc += segment_weight(r, seg, blocks);
  }
  return p + 1;
}

/* ---- the memo of the piece split and the straight pick ------------------- */

/* Words of a memo key: a tag, the plan, its sizes, up to 6 parameters, the
 * request's tokens and each group's block count. */
#define MEMO_KEY_WORDS (10 + KVF_MAX_GROUPS)

enum { MEMO_PIECE_MASKS = 1, MEMO_STRAIGHT_PICK = 2 };

/* Completes a key begun with its tag and parameters: what the two steps
 * read of the request (group_blocks of each group, and its tokens for a
 * recurrent state's weight). Returns the key's words. */
static size_t memo_key_request(uint64_t *key, size_t n, const kvf_geometry *g, const kvf_plan *plan,
                               const kvf_copy_request *r) {
  key[n++] = (uint64_t)(uintptr_t)plan;
  key[n++] = plan->num_segments;
  key[n++] = r->token_end > r->token_begin ? r->token_end - r->token_begin : 0;
  key[n++] = g->num_groups;
  for (uint32_t gi = 0; gi < g->num_groups; gi++) key[n++] = group_blocks(g, r, gi);
  return n;
}

uint32_t kvf_stage_piece_masks_memo(kvf_memo *m, const kvf_geometry *g, const kvf_plan *plan,
                                    const kvf_copy_request *r, int gather, uint32_t pieces, uint32_t growth,
                                    unsigned char *masks) {
  if (g->num_groups > KVF_MAX_GROUPS) return kvf_stage_piece_masks_growth(g, plan, r, gather, pieces, growth, masks);
  /* The bytes kvf_stage_piece_masks_growth writes: its pieces as it clamps them. */
  const uint32_t clamped = pieces < 1 ? 1 : pieces > KVF_STAGE_MAX_PIECES ? KVF_STAGE_MAX_PIECES : pieces;
  const size_t size = (size_t)clamped * plan->num_segments;
  uint64_t key[MEMO_KEY_WORDS];
  size_t n = 0;
  key[n++] = MEMO_PIECE_MASKS;
  key[n++] = gather != 0;
  key[n++] = pieces;
  key[n++] = growth;
  n = memo_key_request(key, n, g, plan, r);
  const kvf_memo_slot *s = kvf_memo_find(m, key, n * sizeof *key);
  if (s) {
    memcpy(masks, s->value, size); /* the key holds the pieces and the segments: size bytes */
    return (uint32_t)s->result[0];
  }
  uint32_t made = kvf_stage_piece_masks_growth(g, plan, r, gather, pieces, growth, masks);
  kvf_memo_keep(m, key, n * sizeof *key, masks, size, made, 0);
  return made;
}

uint64_t kvf_stage_straight_pick_memo(kvf_memo *m, const kvf_geometry *g, const kvf_plan *plan,
                                      const kvf_copy_request *r, int from_end, uint64_t min_run, uint64_t target,
                                      uint64_t limit, uint64_t max_runs, unsigned char *pick) {
  if (g->num_groups > KVF_MAX_GROUPS)
    return kvf_stage_straight_pick(g, plan, r, from_end, min_run, target, limit, max_runs, pick);
  const size_t size = plan->num_segments;
  uint64_t key[MEMO_KEY_WORDS];
  size_t n = 0;
  key[n++] = MEMO_STRAIGHT_PICK;
  key[n++] = from_end != 0;
  key[n++] = min_run;
  key[n++] = target;
  key[n++] = limit;
  key[n++] = max_runs;
  n = memo_key_request(key, n, g, plan, r);
  const kvf_memo_slot *s = kvf_memo_find(m, key, n * sizeof *key);
  if (s) {
    memcpy(pick, s->value, size); /* the key holds the segments: size bytes */
    return s->result[0];
  }
  uint64_t bytes = kvf_stage_straight_pick(g, plan, r, from_end, min_run, target, limit, max_runs, pick);
  kvf_memo_keep(m, key, n * sizeof *key, pick, size, bytes, 0);
  return bytes;
}

typedef struct extent {
  uint64_t object, lo, hi, touched;
} extent;

static int extent_before(const extent *x, const extent *y) {
  return x->object != y->object ? x->object < y->object : x->lo < y->lo;
}

/* ex[0, m) sorted by (object, lo) through tmp (room for m): a bottom-up
 * merge sort with its comparison inline. The extents of a layer's planes
 * interleave in an object whose planes are outermost (K of every layer,
 * then V: the 80-layer tp4 slice, Llama HND), and qsort's call per
 * comparison then took half of kvf_stage_blob_runs' time (the slice's 160
 * extents). Returns the array that holds the result (ex or tmp). */
static extent *sort_extents(extent *ex, extent *tmp, uint64_t m) {
  for (uint64_t w = 1; w < m; w *= 2) {
    for (uint64_t lo = 0; lo < m; lo += 2 * w) {
      uint64_t mid = lo + w < m ? lo + w : m, hi = lo + 2 * w < m ? lo + 2 * w : m, a = lo, b = mid, o = lo;
      while (a < mid && b < hi) tmp[o++] = extent_before(&ex[b], &ex[a]) ? ex[b++] : ex[a++];
      while (a < mid) tmp[o++] = ex[a++];
      while (b < hi) tmp[o++] = ex[b++];
    }
    extent *t = ex;
    ex = tmp;
    tmp = t;
  }
  return ex;
}

/* kvf_stage_blob_runs' fold of a blob's stretches of blocks into extents. */
typedef struct extent_fold {
  extent *ex;
  uint64_t m;
  const uint64_t *object_base;
  const kvf_blob_shape *shape; /* the last stretch's shape: its whole block's extent, and whether */
  uint64_t whole_bytes;        /* a stretch of such blocks is one extent (the extent is dst_block) */
  int whole_abut;
} extent_fold;

static void fold_extent(extent_fold *f, uint64_t object, uint64_t lo, uint64_t hi, uint64_t touched) {
  extent *last = f->m > 0 ? &f->ex[f->m - 1] : NULL;
  if (last && last->object == object && last->hi == lo) {
    last->hi = hi;
    last->touched += touched;
    return;
  }
  f->ex[f->m++] = (extent){object, lo, hi, touched};
}

/* One extent per stretch of blocks that follow each other in the object
 * (an entry's consecutive blocks: a layer's plane of a chunk is one or a
 * few such stretches), so the sort sees tens of extents rather than one per
 * block: 1024 blocks a Llama chunk took 52 us to sort per call on the
 * development VM's CPU, the 80-layer slice 192 us (x4 pieces' worth). */
static void fold_stretch(void *ctx, const kvf_blob_entry *e, const kvf_blob_shape *sh, const kvf_blob_stretch *st) {
  (void)e;
  extent_fold *f = ctx;
  const uint64_t full = (uint64_t)sh->tokens * sh->units_per_token, whole = sh->recurrent ? sh->units_per_run : full;
  if (sh != f->shape) {
    f->shape = sh;
    f->whole_bytes = kvf_blob_object_extent(sh, whole);
    f->whole_abut = !sh->recurrent && f->whole_bytes == sh->dst_block;
  }
  uint64_t lo = (uint64_t)(uintptr_t)st->object - f->object_base[st->object_index];
  uint64_t last_bytes = st->units_last == whole ? f->whole_bytes : kvf_blob_object_extent(sh, st->units_last);
  if (sh->recurrent || f->whole_abut) {
    /* Whole blocks end where the next begins: the stretch is one range. */
    uint64_t before = (st->count - 1) * sh->dst_block;
    fold_extent(f, st->object_index, lo, lo + before + last_bytes,
                ((st->count - 1) * full + st->units_last) * sh->vec);
    return;
  }
  for (uint64_t q = 0; q < st->count; q++) {
    uint64_t at = lo + q * sh->dst_block, last = q + 1 == st->count;
    fold_extent(f, st->object_index, at, at + (last ? last_bytes : f->whole_bytes),
                (last ? st->units_last : full) * sh->vec);
  }
}

kvf_status kvf_stage_blob_runs(const void *blob, const uint64_t *object_base, kvf_stage_run **runs, uint64_t *count,
                               int *holes) {
  const kvf_blob_header *h = blob;
  const kvf_blob_entry *entries = (const kvf_blob_entry *)((const char *)blob + h->off_entries);
  /* Room for an extent per (entry, block) pair, skipped ones included. The
   * blocks are folded a stretch at a time as they are decoded, never listed
   * (kvf_blob_blocks), and sorted without qsort: a whole one-chunk blob's
   * runs took 12.9 -> 2.9 us for Llama HND, 35.7 -> 7.3 us for the 80-layer
   * tp4 slice, 12.7 -> 2.8 us for Llama NHD (the development VM's CPU, best
   * of 50 rounds of 100 calls, the two builds one after the other). */
  uint64_t n = 0;
  for (uint32_t i = 0; i < h->num_entries; i++) {
    uint64_t end = i + 1 < h->num_entries ? entries[i + 1].first_task : h->total_tasks;
    n += (end - entries[i].first_task) / entries[i].slices;
  }
  /* n extents and as many for the sort's merges */
  extent_fold f = {malloc(sizeof *f.ex * 2 * (n ? n : 1)), 0, object_base, NULL, 0, 0};
  *runs = NULL;
  *count = 0;
  *holes = 0;
  if (!f.ex) return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "transfer: out of memory");
  kvf_blob_visit_stretches(blob, fold_stretch, &f);
  uint64_t m = f.m;
  /* Extents in object order (NHD Llama's, whose segments follow the
   * object's layout) skip the sort. */
  int sorted = 1;
  for (uint64_t i = 1; i < m && sorted; i++) sorted = !extent_before(&f.ex[i], &f.ex[i - 1]);
  const extent *ex = sorted ? f.ex : sort_extents(f.ex, f.ex + n, m);
  *runs = malloc(sizeof **runs * (m ? m : 1));
  if (!*runs) {
    free(f.ex);
    return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "transfer: out of memory");
  }
  uint64_t out = 0;
  for (uint64_t i = 0; i < m;) {
    extent cur = ex[i++];
    while (i < m && ex[i].object == cur.object && ex[i].lo <= cur.hi) {
      if (ex[i].hi > cur.hi) cur.hi = ex[i].hi;
      cur.touched += ex[i].touched;
      i++;
    }
    if (cur.touched < cur.hi - cur.lo) *holes = 1;
    (*runs)[out++] = (kvf_stage_run){cur.object, cur.lo, cur.hi - cur.lo};
  }
  free(f.ex);
  *count = out;
  return KVF_SUCCESS;
}

/* Room for the key of a blob (kvf_stage_blob_runs_cached): n ids' flags
 * and the sizes of the arrays before them; 0 when it would not fit a
 * size_t (nothing a built blob reaches). */
static size_t runs_key_size(const kvf_blob_header *h, uint64_t ids, uint64_t objects) {
  uint64_t size = sizeof *h, part;
  if (!kvf_mul_u64(h->num_entries, sizeof(kvf_blob_entry), &part) || !kvf_add_u64(size, part, &size)) return 0;
  if (!kvf_mul_u64(h->num_shapes, sizeof(kvf_blob_shape), &part) || !kvf_add_u64(size, part, &size)) return 0;
  if (!kvf_mul_u64(objects, 2 * sizeof(uint64_t), &part) || !kvf_add_u64(size, part, &size)) return 0;
  if (!kvf_add_u64(size, ids, &size) || size > SIZE_MAX) return 0;
  return (size_t)size;
}

/* A miss: list the blob and keep its runs under `key` (NULL: under none,
 * which nothing finds, until the slot is reused). */
static kvf_status list_into_slot(kvf_memo *cache, const void *blob, const uint64_t *object_base,
                                 const unsigned char *key, size_t key_size, const kvf_stage_run **runs,
                                 uint64_t *count, int *holes) {
  kvf_stage_run *fresh = NULL;
  uint64_t n = 0;
  int hole = 0;
  kvf_status st = kvf_stage_blob_runs(blob, object_base, &fresh, &n, &hole);
  if (st) return st;
  /* Taken, not copied: a miss costs the listing alone, and a listing that
   * succeeded is never lost for want of a slot's memory. */
  const kvf_memo_slot *slot =
      kvf_memo_keep_taking(cache, key, key_size, fresh, n * sizeof *fresh, (uint64_t)hole, 0);
  *runs = (const kvf_stage_run *)slot->value;
  *count = n;
  *holes = hole;
  return KVF_SUCCESS;
}

kvf_status kvf_stage_blob_runs_cached(kvf_memo *cache, const void *blob, const uint64_t *object_base,
                                      const kvf_stage_run **runs, uint64_t *count, int *holes) {
  const kvf_blob_header *h = blob;
  const kvf_blob_entry *entries = kvf_blob_entries(blob);
  const uint32_t *ids = (const uint32_t *)((const char *)blob + h->off_ids);
  const uint64_t objects = (uint64_t)h->num_chunks * h->num_object_groups;
  *runs = NULL;
  *count = 0;
  *holes = 0;
  /* The ids the entries read: each group's entries share theirs. */
  uint64_t num_ids = 0;
  for (uint32_t i = 0; i < h->num_entries; i++) {
    uint64_t end = i + 1 < h->num_entries ? entries[i + 1].first_task : h->total_tasks;
    uint64_t last = entries[i].ids_offset + (end - entries[i].first_task) / entries[i].slices;
    if (last > num_ids) num_ids = last;
  }
  /* Without room for a key the blob is listed as if uncached: the
   * cache is a shortcut, never a reason to fail. */
  size_t size = runs_key_size(h, num_ids, objects);
  unsigned char *key = size ? kvf_memo_scratch(cache, size) : NULL;
  if (!key) return list_into_slot(cache, blob, object_base, NULL, 0, runs, count, holes);
  /* The key: what kvf_stage_blob_runs reads, as it reads it, so that the
   * same shape elsewhere is the same key:
   * - an object as whether it is there and where it lies from its base (a
   *   call's pieces in either staging buffer);
   * - the request's place only relative to its start: every chunk of a
   *   sequence stored in turn (the listing reads lt_begin, chunk_begin and
   *   a shape's first_block only as differences, and a request begins on a
   *   chunk, which holds whole blocks);
   * - an id as whether it moves.
   * The parts that tell a context's keys apart come first, so that a
   * comparison with another key ends early: objects, header (pieces,
   * directions), shapes, entries, ids. */
  unsigned char *k = key;
  const uint64_t *blob_objects = (const uint64_t *)((const char *)blob + h->off_objects);
  for (uint64_t i = 0; i < objects; i++) {
    uint64_t where[2] = {blob_objects[i] != 0, blob_objects[i] ? blob_objects[i] - object_base[i] : 0};
    memcpy(k, where, sizeof where);
    k += sizeof where;
  }
  kvf_blob_header hk = *h;
  hk.lt_end = h->lt_end - h->lt_begin;
  hk.lt_begin = 0;
  hk.chunk_begin = 0;
  memcpy(k, &hk, sizeof hk);
  k += sizeof hk;
  for (uint32_t i = 0; i < h->num_shapes; i++) {
    kvf_blob_shape sk = kvf_blob_shapes(blob)[i];
    /* 0 when the request begins on a block, as it does (on a chunk) */
    sk.first_block = sk.recurrent ? 0 : sk.first_block * sk.tokens - h->lt_begin;
    memcpy(k, &sk, sizeof sk);
    k += sizeof sk;
  }
  memcpy(k, entries, h->num_entries * sizeof *entries);
  k += h->num_entries * sizeof *entries;
  for (uint64_t i = 0; i < num_ids; i++) k[i] = ids[i] < h->num_blocks_max;
  const kvf_memo_slot *slot = kvf_memo_find(cache, key, size);
  if (!slot) return list_into_slot(cache, blob, object_base, key, size, runs, count, holes);
  *runs = (const kvf_stage_run *)slot->value;
  *count = slot->value_size / sizeof **runs;
  *holes = (int)slot->result[0];
  return KVF_SUCCESS;
}

/* ---- runs for the copy engine's batch API -------------------------------- */

/* Free the three run arrays and leave them NULL (callers free them again on
 * their own error paths). */
static void free_runs(void ***dst, const void ***src, size_t **size) {
  free(*dst);
  free((void *)*src);
  free(*size);
  *dst = NULL;
  *src = NULL;
  *size = NULL;
}

int kvf_stage_batch_runs(const void *blob, int gather, uint64_t min_run, uint64_t max_runs, void ***dst,
                         const void ***src, size_t **size, size_t *count) {
  const kvf_blob_header *h = blob;
  *dst = NULL;
  *src = NULL;
  *size = NULL;
  const kvf_blob_entry *entries = kvf_blob_entries(blob);
  for (uint32_t i = 0; i < h->num_shapes; i++)
    if (!kvf_blob_shape_linear(&kvf_blob_shapes(blob)[i])) return 0;
  if (max_runs == 0) return 0;
  /* Requests of more than four times max_runs blocks are refused (merging
   * seldom brings that many under it), so one decode into room for that
   * many tells the count and gives the blocks: no counting pass first. The
   * bound is computed without a product a large max_runs would wrap. */
  uint64_t room = max_runs > (UINT64_MAX - 1) / 4 ? UINT64_MAX : 4 * max_runs + 1;
  uint64_t cap = h->total_tasks < room ? h->total_tasks : room; /* a block holds one task at least */
  if (cap == 0) return 0;
  kvf_blob_block *b = malloc(sizeof *b * cap);
  if (!b) return -1;
  uint64_t n = kvf_blob_blocks(blob, b, cap);
  if (n == 0 || n > room - 1) {
    free(b);
    return 0;
  }
  uint64_t runs_room = max_runs < n ? max_runs + 1 : n;
  *dst = malloc(sizeof **dst * runs_room);
  *src = malloc(sizeof **src * runs_room);
  *size = malloc(sizeof **size * runs_room);
  if (!*dst || !*src || !*size) {
    free(b);
    free_runs(dst, src, size);
    return -1;
  }
  size_t m = 0;
  /* Merge runs that continue each other on both sides; stop as soon as
   * there are more than max_runs (a 32-layer Llama chunk's 1024 blocks
   * are refused at the 257th run instead of after all of them). */
  for (uint64_t i = 0; i < n; i++) {
    size_t bytes = (size_t)(b[i].units * kvf_blob_shape_of(blob, &entries[b[i].entry])->vec);
    char *from = gather ? b[i].cache : b[i].object, *to = gather ? b[i].object : b[i].cache;
    if (m > 0 && (const char *)(*src)[m - 1] + (*size)[m - 1] == from && (char *)(*dst)[m - 1] + (*size)[m - 1] == to) {
      (*size)[m - 1] += bytes;
      continue;
    }
    if (m == runs_room) break; /* more than max_runs */
    (*src)[m] = from;
    (*dst)[m] = to;
    (*size)[m] = bytes;
    m++;
  }
  free(b);
  if (m > max_runs) {
    free_runs(dst, src, size);
    return 0;
  }
  /* A partial last block's run is short by nature: judge the runs by the
   * second shortest when there is more than one. */
  uint64_t shortest = UINT64_MAX, second = UINT64_MAX;
  for (size_t i = 0; i < m; i++) {
    uint64_t r = (*size)[i];
    if (r < shortest) {
      second = shortest;
      shortest = r;
    } else if (r < second) {
      second = r;
    }
  }
  if ((m > 1 ? second : shortest) < min_run) {
    free_runs(dst, src, size);
    return 0;
  }
  *count = m;
  return 1;
}

uint64_t kvf_stage_batch_runs_floor(const kvf_geometry *g, const kvf_plan *plan, const kvf_copy_request *r) {
  /* A missing object takes its blocks out of the listing: no floor then. */
  const uint64_t objects = kvf_copy_request_chunks(g, r) * g->num_object_groups;
  for (uint64_t i = 0; i < objects; i++)
    if (!r->objects[i]) return 0;
  uint64_t items = 0, merges = 0, entries = 0;
  for (uint32_t gi = 0; gi < g->num_groups; gi++) {
    const kvf_group_blocks *t = &r->groups[gi];
    uint64_t lo, hi, present = 0, follow = 0;
    kvf_blob_group_window(g, r, gi, &lo, &hi); /* the window the blob lists */
    for (uint64_t b = lo; b < hi; b++) {
      uint32_t id = t->block_ids[b - t->first_block];
      if (id == KVF_BLOCK_SKIP) continue;
      present++;
      /* Only a block whose id follows the block before's can continue that
       * block's run: a skipped block between leaves a gap in the object. */
      uint32_t prev = b > lo ? t->block_ids[b - 1 - t->first_block] : KVF_BLOCK_SKIP;
      follow += prev != KVF_BLOCK_SKIP && id == prev + 1;
    }
    if (present == 0) continue;
    /* The listing goes segment by segment (an entry each), each over the
     * group's window (kvf_blob_visit_stretches). */
    uint64_t segments = plan->group_first[gi + 1] - plan->group_first[gi];
    items += segments * present;
    merges += segments * follow;
    entries += segments;
  }
  /* And at most one merge where an entry's last run meets the next one's
   * first. */
  if (entries > 1) merges += entries - 1;
  return items > merges ? items - merges : (items ? 1 : 0);
}

uint64_t kvf_batch_ramp_next(uint64_t prev, uint64_t left, uint64_t prev_host_ns, uint64_t prev_engine_ns) {
  if (left == 0) return 0;
  if (prev == 0) prev = 1;
  /* Runs the host enqueues while the copy engine works through the previous
   * call: prev * engine / host, in double (the product may not fit 64 bits;
   * a run count far past 2^53 is past every limit anyway). */
  double fit = prev_host_ns ? (double)prev * (double)prev_engine_ns / (double)prev_host_ns : (double)UINT64_MAX;
  if (fit >= (double)left) return left;
  /* A host that took longer for the previous call than the copy engine
   * needs for it cannot keep the engine busy whatever the steps: fewer
   * calls then cost the host less (back to back, one chunk's fp8 MLA cache
   * lost 10% of its rate to 7 paced calls). */
  if (fit < (double)prev) return kvf_batch_ramp_runs(1, prev, left);
  uint64_t half = prev / 2 + (prev & 1);
  uint64_t lo = prev > UINT64_MAX - half ? UINT64_MAX : prev + half, hi = prev > UINT64_MAX / 2 ? UINT64_MAX : 2 * prev;
  uint64_t want = fit <= (double)lo ? lo : fit >= (double)hi ? hi : (uint64_t)fit;
  return want >= left || left - want <= want / 4 ? left : want;
}

uint64_t kvf_batch_ramp_runs(uint64_t done, uint64_t first, uint64_t left) {
  if (first == 0 || done >= 63 || first > (UINT64_MAX >> done)) return left;
  uint64_t want = first << done;
  /* The doubling after this call would reach what is left: take it all. */
  return want >= left || left - want <= want ? left : want;
}

int kvf_batch_back_to_back(uint64_t prev_host_ns, uint64_t prev_runs, uint64_t prev_end_ns, uint64_t start_ns,
                           uint64_t window_ns, uint64_t runs, uint64_t engine_ns) {
  if (!kvf_came_back_to_back(prev_end_ns, start_ns, window_ns)) return 0;
  return kvf_batch_host_bound(prev_host_ns, prev_runs, runs, engine_ns);
}

int kvf_came_back_to_back(uint64_t prev_end_ns, uint64_t start_ns, uint64_t window_ns) {
  return window_ns != 0 && prev_end_ns != 0 && start_ns >= prev_end_ns && start_ns - prev_end_ns < window_ns;
}

/* A time computed in double, in whole ns: UINT64_MAX past 64 bits. */
static uint64_t ns_of(double ns) { return ns >= 18446744073709551615.0 ? UINT64_MAX : (uint64_t)ns; }

/* The host time a call of `runs` runs takes at the rate of a previous batch
 * call (prev_host_ns for prev_runs), or -1 when that call says nothing:
 * either count 0, or not comparable (half to twice the runs: a call's fixed
 * cost says nothing of another size's). In double: the product could pass
 * 64 bits for absurd tunings. */
static double host_ns_for(uint64_t prev_host_ns, uint64_t prev_runs, uint64_t runs) {
  if (prev_runs == 0 || runs == 0) return -1;
  if (prev_runs > runs * 2 || runs > prev_runs * 2) return -1;
  return (double)prev_host_ns * (double)runs / (double)prev_runs;
}

int kvf_batch_host_bound(uint64_t prev_host_ns, uint64_t prev_runs, uint64_t runs, uint64_t engine_ns) {
  double host_ns = host_ns_for(prev_host_ns, prev_runs, runs);
  return host_ns >= 0 && host_ns > (double)engine_ns;
}

uint64_t kvf_batch_alone_latency(uint64_t runs, uint64_t first, uint64_t host_ns, uint64_t engine_ns) {
  if (runs == 0) return 0;
  /* In double: per-run times, and sums that may pass 64 bits (saturated
   * below); the steps grow at least 1.5 times a call (kvf_batch_ramp_next),
   * so the loop is short. */
  const double host_per_run = (double)host_ns / (double)runs, engine_per_run = (double)engine_ns / (double)runs;
  double host_done = 0, engine_done = 0;
  uint64_t left = runs, m = 0;
  for (uint64_t k = 0; left > 0; k++) {
    if (k == 0) {
      m = kvf_batch_ramp_runs(0, first, left);
    } else {
      double h = host_per_run * (double)m, e = engine_per_run * (double)m;
      m = kvf_batch_ramp_next(m, left, ns_of(h), ns_of(e));
    }
    host_done += host_per_run * (double)m;
    engine_done =
        (engine_done > host_done ? engine_done : host_done) + engine_per_run * (double)m + KVF_BATCH_ALONE_CALL_NS;
    left -= m;
  }
  return ns_of(engine_done);
}

int kvf_batch_alone_outlasts_staged(uint64_t last_host_ns, uint64_t last_runs, uint64_t before_host_ns,
                                    uint64_t before_runs, uint64_t runs, uint64_t first, uint64_t engine_ns,
                                    int gather) {
  double staged = (double)engine_ns * KVF_BATCH_STAGED_ALONE_RATE / 1000.0 +
                  (double)(gather ? KVF_BATCH_STAGED_ALONE_GATHER_NS : KVF_BATCH_STAGED_ALONE_SCATTER_NS);
  const uint64_t host[2] = {last_host_ns, before_host_ns}, host_runs[2] = {last_runs, before_runs};
  for (int i = 0; i < 2; i++) {
    double host_ns = host_ns_for(host[i], host_runs[i], runs);
    /* Both calls, as kvf_batch_host_outlasts_staged. */
    if (host_ns < 0 || (double)kvf_batch_alone_latency(runs, first, ns_of(host_ns), engine_ns) <= staged) return 0;
  }
  return 1;
}

int kvf_batch_host_outlasts_staged(uint64_t last_host_ns, uint64_t last_runs, uint64_t before_host_ns,
                                   uint64_t before_runs, uint64_t runs, uint64_t engine_ns, uint64_t staged_cost) {
  /* Past the staged route's own cost: near the break-even the batch route's
   * copy engine waits a little, where the staged route's calls run longer
   * than the copies (the fp8 MLA chunk d2h back to back, the host at
   * 115-220 us for a 188 us copy: 191 us a call batched, 198-203 staged;
   * perf/results/2026-12-03-h200-hostbound; 213 on a later lease). In
   * double: a cost measured against an absurd link rate is huge. */
  uint64_t staged_ns = ns_of((double)engine_ns * (double)staged_cost / 1000.0);
  /* Both calls: one slow call (the thread descheduled, a bf16 MLA chunk's
   * host time once past its 327 us copy) says little, and sent calls the
   * batch route moves faster staged. */
  return kvf_batch_host_bound(last_host_ns, last_runs, runs, staged_ns) &&
         kvf_batch_host_bound(before_host_ns, before_runs, runs, staged_ns);
}

uint64_t kvf_staged_cost_sample(uint64_t span_ns, uint64_t engine_ns) {
  if (engine_ns == 0 || span_ns == 0) return 0;
  double cost = (double)span_ns * 1000.0 / (double)engine_ns;
  return cost >= (double)KVF_BATCH_MAX_STAGED_COST ? KVF_BATCH_MAX_STAGED_COST : cost < 1.0 ? 1 : (uint64_t)cost;
}

static int compare_u64(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return (x > y) - (x < y);
}

uint64_t kvf_staged_cost_of(const uint64_t *samples, size_t n, int64_t fixed) {
  if (fixed > 0) return (uint64_t)fixed;
  if (n < KVF_STAGED_COST_SAMPLES) return KVF_BATCH_STAGED_COST_UNMEASURED;
  uint64_t v[KVF_STAGED_COST_SAMPLES];
  memcpy(v, samples, sizeof v);
  qsort(v, KVF_STAGED_COST_SAMPLES, sizeof v[0], compare_u64);
  const size_t mid = KVF_STAGED_COST_SAMPLES / 2;
  return v[mid - 1] / 2 + v[mid] / 2 + (v[mid - 1] % 2 + v[mid] % 2) / 2; /* no overflow */
}
