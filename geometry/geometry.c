/* Geometry: building, validation, object groups and layouts, window math and
 * fingerprints. Pure C, no CUDA. The rules enforced here are listed in
 * docs/geometry.md; each failure names the group, the layer and the field. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "common/versioned.h"
#include "geometry/geometry_internal.h"

/* ---- small helpers ------------------------------------------------------ */

static void copy_name(char *dst, const char *src) {
  if (!src) {
    dst[0] = '\0';
    return;
  }
  snprintf(dst, KVF_NAME_MAX, "%s", src);
}

static int grow(void **array, uint32_t *cap, uint32_t need, size_t elem) {
  if (need <= *cap) return 1;
  uint32_t new_cap = *cap ? *cap * 2 : 8;
  while (new_cap < need) new_cap *= 2;
  void *p = realloc(*array, (size_t)new_cap * elem);
  if (!p) return 0;
  memset((char *)p + (size_t)*cap * elem, 0, (size_t)(new_cap - *cap) * elem);
  *array = p;
  *cap = new_cap;
  return 1;
}

static int is_pow2(uint64_t x) { return x && !(x & (x - 1)); }

/* Describe group/layer for messages: "group 'swa' (1), layer 3 ('layer[3]')". */
static void where(const kvf_geometry *g, int32_t group, int32_t layer, char *buf, size_t len) {
  if (group < 0) {
    snprintf(buf, len, "geometry");
    return;
  }
  const kvf_group *gr = &g->groups[group];
  int n = gr->name[0] ? snprintf(buf, len, "group '%s' (%d)", gr->name, group)
                      : snprintf(buf, len, "group %d", group);
  if (layer >= 0 && n > 0 && (size_t)n < len) {
    const kvf_view *v = &g->views[gr->views[layer]];
    if (v->name[0])
      snprintf(buf + n, len - (size_t)n, ", layer %d ('%s')", layer, v->name);
    else
      snprintf(buf + n, len - (size_t)n, ", layer %d", layer);
  }
}

/* Record a validation failure: fills *err and the thread's last error. */
KVF_PRINTF(6, 7)
static kvf_status invalid(const kvf_geometry *g, kvf_geometry_error *err, kvf_status status, int32_t group,
                          int32_t layer, const char *fmt, ...) {
  char head[160], body[256], field[32] = "";
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(body, sizeof body, fmt, ap);
  va_end(ap);
  /* The field is the first word of the body, by convention ("token_stride 64 ..."). */
  size_t n = strcspn(body, " :");
  if (n >= sizeof field) n = sizeof field - 1;
  memcpy(field, body, n);
  field[n] = '\0';
  where(g, group, layer, head, sizeof head);
  kvf_fail(status, "%s: %s", head, body);
  if (err) {
    err->status = status;
    err->group = group;
    err->layer = layer;
    snprintf(err->field, sizeof err->field, "%s", field);
    snprintf(err->message, sizeof err->message, "%s", kvf_last_error());
  }
  return status;
}

/* ---- building ------------------------------------------------------------ */

kvf_status kvf_geometry_create(kvf_geometry **out) {
  if (!out) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_geometry_create: out is NULL");
  kvf_geometry *g = calloc(1, sizeof *g);
  if (!g) return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "kvf_geometry_create: out of memory");
  kvf_object_policy policy = KVF_OBJECT_POLICY_INIT;
  g->policy = policy;
  g->dcp_world = 1;
  g->dcp_rank = 0;
  *out = g;
  return KVF_SUCCESS;
}

void kvf_geometry_destroy(kvf_geometry *g) {
  if (!g) return;
  for (uint32_t i = 0; i < g->num_groups; i++) free(g->groups[i].views);
  free(g->groups);
  free(g->regions);
  free(g->views);
  free(g->object_groups);
  free(g->description);
  free(g);
}

/* The checks every building call makes before it reads its descriptor. */
static kvf_status check_building(const kvf_geometry *g, const void *desc, const char *fn) {
  if (!g || !desc) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "%s: geometry or descriptor is NULL", fn);
  if (g->finalized) return kvf_fail(KVF_ERR_STATE, "%s: the geometry is finalized and read-only", fn);
  return KVF_SUCCESS;
}

kvf_status kvf_geometry_add_region(kvf_geometry *g, const kvf_region_desc *caller, uint32_t *out_index) {
  kvf_region_desc local = KVF_REGION_DESC_INIT;
  const kvf_region_desc *desc = &local;
  kvf_status st = check_building(g, caller, "kvf_geometry_add_region");
  if (!st) st = KVF_VERSIONED_IN(kvf_region_desc, &local, caller);
  if (st) return st;
  if (g->num_regions >= KVF_MAX_REGIONS)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_geometry_add_region: more than %u regions", KVF_MAX_REGIONS);
  if (!grow((void **)&g->regions, &g->cap_regions, g->num_regions + 1, sizeof *g->regions))
    return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "kvf_geometry_add_region: out of memory");
  kvf_region *r = &g->regions[g->num_regions];
  memset(r, 0, sizeof *r);
  copy_name(r->name, desc->name);
  r->size = desc->size;
  r->align = desc->align;
  if (out_index) *out_index = g->num_regions;
  g->num_regions++;
  return KVF_SUCCESS;
}

kvf_status kvf_geometry_add_group(kvf_geometry *g, const kvf_group_desc *caller, uint32_t *out_index) {
  kvf_group_desc local = KVF_GROUP_DESC_INIT;
  const kvf_group_desc *desc = &local;
  kvf_status st = check_building(g, caller, "kvf_geometry_add_group");
  if (!st) st = KVF_VERSIONED_IN(kvf_group_desc, &local, caller);
  if (st) return st;
  if (g->num_groups >= KVF_MAX_GROUPS)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_geometry_add_group: more than %u groups", KVF_MAX_GROUPS);
  if (!grow((void **)&g->groups, &g->cap_groups, g->num_groups + 1, sizeof *g->groups))
    return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "kvf_geometry_add_group: out of memory");
  kvf_group *gr = &g->groups[g->num_groups];
  memset(gr, 0, sizeof *gr);
  gr->desc = *desc;
  copy_name(gr->name, desc->name);
  gr->desc.name = NULL; /* the array moves as it grows: names are read from name[] */
  if (out_index) *out_index = g->num_groups;
  g->num_groups++;
  return KVF_SUCCESS;
}

kvf_status kvf_geometry_add_view(kvf_geometry *g, uint32_t group, const kvf_view_desc *caller,
                                  uint32_t *out_layer) {
  kvf_view_desc local = KVF_VIEW_DESC_INIT;
  const kvf_view_desc *desc = &local;
  kvf_status st = check_building(g, caller, "kvf_geometry_add_view");
  if (!st) st = KVF_VERSIONED_IN(kvf_view_desc, &local, caller);
  if (st) return st;
  if (group >= g->num_groups)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_geometry_add_view: group %u does not exist (%u groups)", group,
                    g->num_groups);
  kvf_group *gr = &g->groups[group];
  if (gr->num_views >= KVF_MAX_LAYERS_PER_GROUP)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_geometry_add_view: more than %u layers in group %u",
                    KVF_MAX_LAYERS_PER_GROUP, group);
  if (!grow((void **)&g->views, &g->cap_views, g->num_views + 1, sizeof *g->views) ||
      !grow((void **)&gr->views, &gr->cap_views, gr->num_views + 1, sizeof *gr->views))
    return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "kvf_geometry_add_view: out of memory");
  kvf_view *v = &g->views[g->num_views];
  memset(v, 0, sizeof *v);
  v->desc = *desc;
  copy_name(v->name, desc->name);
  v->desc.name = NULL; /* the array moves as it grows: names are read from name[] */
  v->group = group;
  v->layer = gr->num_views;
  gr->views[gr->num_views++] = g->num_views;
  if (out_layer) *out_layer = v->layer;
  g->num_views++;
  return KVF_SUCCESS;
}

kvf_status kvf_geometry_set_policy(kvf_geometry *g, const kvf_object_policy *policy) {
  kvf_object_policy local = KVF_OBJECT_POLICY_INIT;
  kvf_status st = check_building(g, policy, "kvf_geometry_set_policy");
  if (!st) st = KVF_VERSIONED_IN(kvf_object_policy, &local, policy);
  if (st) return st;
  g->policy = local;
  return KVF_SUCCESS;
}

kvf_status kvf_geometry_set_dcp(kvf_geometry *g, uint32_t world, uint32_t rank) {
  if (!g) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_geometry_set_dcp: geometry is NULL");
  if (g->finalized) return kvf_fail(KVF_ERR_STATE, "kvf_geometry_set_dcp: the geometry is finalized");
  if (world == 0 || world > KVF_MAX_DCP_WORLD)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "dcp world %u: must be 1..%u", world, KVF_MAX_DCP_WORLD);
  if (rank >= world) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "dcp rank %u: must be below world %u", rank, world);
  g->dcp_world = world;
  g->dcp_rank = rank;
  return KVF_SUCCESS;
}

kvf_status kvf_geometry_set_name(kvf_geometry *g, const char *name, const char *description) {
  if (!g) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_geometry_set_name: geometry is NULL");
  copy_name(g->name, name);
  char *d = NULL;
  if (description) {
    size_t len = strlen(description) + 1;
    d = malloc(len);
    if (d) memcpy(d, description, len);
    if (!d) return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "kvf_geometry_set_name: out of memory");
  }
  free(g->description);
  g->description = d;
  return KVF_SUCCESS;
}

/* ---- per-view shape -------------------------------------------------------- */

/* One dimension of a view's run grid, for the non-overlap and extent rules. */
typedef struct dim {
  const char *field;
  uint64_t count;
  uint64_t stride;
} dim;

static int attention_dims(const kvf_geometry *g, const kvf_view *v, dim out[4]) {
  const kvf_group *gr = &g->groups[v->group];
  int n = 0;
  out[n++] = (dim){"block_stride", gr->desc.num_blocks, v->desc.block_stride};
  out[n++] = (dim){"plane_stride", v->desc.planes, v->desc.plane_stride};
  out[n++] = (dim){"token_stride", gr->desc.block_size, v->desc.token_stride};
  out[n++] = (dim){"head_stride", v->desc.heads, v->desc.head_stride};
  return n;
}

static uint64_t max_head_bytes(const kvf_view *v) {
  uint64_t m = v->desc.head_bytes[0];
  if (v->desc.planes > 1 && v->desc.head_bytes[1] > m) m = v->desc.head_bytes[1];
  return m;
}

/* Sort dims by stride ascending (insertion sort: at most four). */
static void sort_dims(dim *d, int n) {
  for (int i = 1; i < n; i++) {
    dim x = d[i];
    int j = i - 1;
    while (j >= 0 && d[j].stride > x.stride) {
      d[j + 1] = d[j];
      j--;
    }
    d[j + 1] = x;
  }
}

/* ---- validation: fields of one region, group, view ---------------------- */

static kvf_status check_region(const kvf_geometry *g, uint32_t i, kvf_geometry_error *err) {
  const kvf_region *r = &g->regions[i];
  const char *nm = r->name[0] ? r->name : "(unnamed)";
  if (!is_pow2(r->align))
    return invalid(g, err, KVF_ERR_INVALID_GEOMETRY, -1, -1, "align %llu of region %u '%s': must be a power of two",
                   (unsigned long long)r->align, i, nm);
  if (r->size > (1ull << 62))
    return invalid(g, err, KVF_ERR_INVALID_GEOMETRY, -1, -1, "size %llu of region %u '%s': larger than 2^62 bytes",
                   (unsigned long long)r->size, i, nm);
  for (uint32_t j = 0; j < i; j++)
    if (r->name[0] && !strcmp(r->name, g->regions[j].name))
      return invalid(g, err, KVF_ERR_INVALID_GEOMETRY, -1, -1, "name '%s': regions %u and %u share it", r->name, j, i);
  return KVF_SUCCESS;
}

static kvf_status check_group(const kvf_geometry *g, uint32_t gi, kvf_geometry_error *err) {
  const kvf_group *gr = &g->groups[gi];
  const kvf_group_desc *d = &gr->desc;
  int32_t G = (int32_t)gi;
  if ((unsigned)d->kind > KVF_GROUP_RECURRENT)
    return invalid(g, err, KVF_ERR_INVALID_GEOMETRY, G, -1, "kind %d: not a group kind", (int)d->kind);
  for (uint32_t j = 0; j < gi; j++)
    if (gr->name[0] && !strcmp(gr->name, g->groups[j].name))
      return invalid(g, err, KVF_ERR_INVALID_GEOMETRY, G, -1, "name '%s': groups %u and %u share it", gr->name, j,
                     gi);
  if (d->num_blocks == 0 || d->num_blocks > KVF_MAX_BLOCKS)
    return invalid(g, err, KVF_ERR_INVALID_GEOMETRY, G, -1, "num_blocks %u: must be 1..%u", d->num_blocks,
                   KVF_MAX_BLOCKS);
  if (d->kind != KVF_GROUP_RECURRENT && (d->block_size == 0 || d->block_size > KVF_MAX_BLOCK_SIZE))
    return invalid(g, err, KVF_ERR_INVALID_GEOMETRY, G, -1, "block_size %u: must be 1..%u tokens", d->block_size,
                   KVF_MAX_BLOCK_SIZE);
  if (d->kind == KVF_GROUP_SLIDING_WINDOW) {
    if (d->window == 0 || d->window > KVF_MAX_CHUNK_TOKENS)
      return invalid(g, err, KVF_ERR_INVALID_GEOMETRY, G, -1, "window %u: a sliding_window group needs 1..%u tokens",
                     d->window, KVF_MAX_CHUNK_TOKENS);
  } else if (d->window != 0) {
    return invalid(g, err, KVF_ERR_INVALID_GEOMETRY, G, -1, "window %u: only sliding_window groups have a window",
                   d->window);
  }
  if (d->kind == KVF_GROUP_CHUNKED_LOCAL) {
    if (d->chunk == 0 || d->chunk > KVF_MAX_CHUNK_TOKENS)
      return invalid(g, err, KVF_ERR_INVALID_GEOMETRY, G, -1, "chunk %u: a chunked_local group needs 1..%u tokens",
                     d->chunk, KVF_MAX_CHUNK_TOKENS);
  } else if (d->chunk != 0) {
    return invalid(g, err, KVF_ERR_INVALID_GEOMETRY, G, -1, "chunk %u: only chunked_local groups have a chunk",
                   d->chunk);
  }
  if (gr->num_views == 0)
    return invalid(g, err, KVF_ERR_INVALID_GEOMETRY, G, -1, "layers: the group has no layer views");
  if (d->kind != KVF_GROUP_RECURRENT) {
    uint64_t unit;
    if (!kvf_mul_u64(d->block_size, g->dcp_world, &unit) || g->policy.chunk_tokens % unit != 0)
      return invalid(g, err, KVF_ERR_INVALID_GEOMETRY, G, -1,
                     "chunk_tokens %u: must be a multiple of block_size %u x dcp world %u so objects hold whole blocks",
                     g->policy.chunk_tokens, d->block_size, g->dcp_world);
  }
  return KVF_SUCCESS;
}

#define FIELD_MULTIPLE(field, value)                                                                        \
  do {                                                                                                      \
    if ((value) % d->elem_bytes != 0)                                                                       \
      return invalid(g, err, KVF_ERR_INVALID_GEOMETRY, G, L, field " %llu: not a multiple of elem_bytes %u", \
                     (unsigned long long)(value), d->elem_bytes);                                           \
  } while (0)

/* Attention view: fields, the non-overlap of its own runs, and its extent. */
static kvf_status check_attention_view(const kvf_geometry *g, kvf_view *v, kvf_geometry_error *err) {
  const kvf_view_desc *d = &v->desc;
  const kvf_group *gr = &g->groups[v->group];
  int32_t G = (int32_t)v->group, L = (int32_t)v->layer;
  if (d->planes == 0 || d->planes > KVF_MAX_PLANES)
    return invalid(g, err, KVF_ERR_INVALID_GEOMETRY, G, L, "planes %u: must be 1 or 2", d->planes);
  if (d->heads == 0 || d->heads > KVF_MAX_HEADS)
    return invalid(g, err, KVF_ERR_INVALID_GEOMETRY, G, L, "heads %u: must be 1..%u", d->heads, KVF_MAX_HEADS);
  for (uint32_t p = 0; p < KVF_MAX_PLANES; p++) {
    if (p < d->planes && (d->head_bytes[p] == 0 || d->head_bytes[p] > KVF_MAX_HEAD_BYTES))
      return invalid(g, err, KVF_ERR_INVALID_GEOMETRY, G, L, "head_bytes[%u] %u: must be 1..%u", p, d->head_bytes[p],
                     KVF_MAX_HEAD_BYTES);
    if (p >= d->planes && d->head_bytes[p] != 0)
      return invalid(g, err, KVF_ERR_INVALID_GEOMETRY, G, L, "head_bytes[%u] %u: the view has only %u plane(s)", p,
                     d->head_bytes[p], d->planes);
    if (p < d->planes) FIELD_MULTIPLE("head_bytes", (uint64_t)d->head_bytes[p]);
  }
  if ((uint64_t)d->planes * gr->desc.block_size * d->heads > (1u << 22))
    return invalid(g, err, KVF_ERR_INVALID_GEOMETRY, G, L,
                   "heads %u: planes x block_size x heads is more than 4M runs per block", d->heads);
  if (d->num_states != 0)
    return invalid(g, err, KVF_ERR_INVALID_GEOMETRY, G, L, "num_states %u: only recurrent groups have states",
                   d->num_states);
  FIELD_MULTIPLE("plane_stride", d->plane_stride);
  FIELD_MULTIPLE("token_stride", d->token_stride);
  FIELD_MULTIPLE("head_stride", d->head_stride);

  /* Runs of one view must be pairwise disjoint. Sorted by stride, each
   * dimension must step over everything the smaller ones span. */
  dim dims[4];
  int n = attention_dims(g, v, dims);
  sort_dims(dims, n);
  uint64_t extent = max_head_bytes(v);
  const char *inner = "one head's bytes";
  int blocks_inside = 0; /* the block dimension is among the smaller ones */
  for (int i = 0; i < n; i++) {
    if (dims[i].count <= 1) continue;
    if (dims[i].stride < extent) {
      /* A stride that is a whole number k of blocks (K and V a pool of k
       * blocks apart) that would hold k blocks describes a k-block pool:
       * the group's num_blocks is what does not match it, not the stride. */
      uint64_t nb = gr->desc.num_blocks, bs = d->block_stride, k = bs ? dims[i].stride / bs : 0;
      if (blocks_inside && k >= 1 && k < nb && dims[i].stride % bs == 0 && extent - (nb - k) * bs <= dims[i].stride)
        return invalid(g, err, KVF_ERR_INVALID_GEOMETRY, G, L,
                       "num_blocks %u: %s %llu leaves room for %llu blocks of block_stride %llu; blocks %llu and up "
                       "would run into the next %s",
                       gr->desc.num_blocks, dims[i].field, (unsigned long long)dims[i].stride, (unsigned long long)k,
                       (unsigned long long)bs, (unsigned long long)k,
                       !strcmp(dims[i].field, "plane_stride")   ? "plane"
                       : !strcmp(dims[i].field, "token_stride") ? "token"
                                                                : "head");
      return invalid(g, err, KVF_ERR_INVALID_GEOMETRY, G, L,
                     "%s %llu: smaller than the %llu bytes spanned by %s (runs would overlap)", dims[i].field,
                     (unsigned long long)dims[i].stride, (unsigned long long)extent, inner);
    }
    if (!strcmp(dims[i].field, "block_stride")) blocks_inside = 1;
    uint64_t span;
    if (!kvf_mul_u64(dims[i].count - 1, dims[i].stride, &span) || !kvf_add_u64(span, extent, &extent))
      return invalid(g, err, KVF_ERR_OVERFLOW, G, L, "%s %llu: %llu x stride overflows 64 bits", dims[i].field,
                     (unsigned long long)dims[i].stride, (unsigned long long)(dims[i].count - 1));
    inner = !strcmp(dims[i].field, "block_stride")   ? "the smaller dimensions and the blocks"
            : !strcmp(dims[i].field, "plane_stride") ? "the smaller dimensions and the planes"
            : !strcmp(dims[i].field, "token_stride") ? "the smaller dimensions and the tokens"
                                                     : "the smaller dimensions and the heads";
  }
  if (!kvf_add_u64(d->offset, extent, &v->end_offset))
    return invalid(g, err, KVF_ERR_OVERFLOW, G, L, "offset %llu: offset + extent overflows 64 bits",
                   (unsigned long long)d->offset);
  uint64_t per_token = 0, t;
  for (uint32_t p = 0; p < d->planes; p++) {
    if (!kvf_mul_u64(d->heads, d->head_bytes[p], &t) || !kvf_add_u64(per_token, t, &per_token))
      return invalid(g, err, KVF_ERR_OVERFLOW, G, L, "heads %u: heads x head_bytes overflows", d->heads);
  }
  v->bytes_per_token = per_token;
  if (!kvf_mul_u64(per_token, gr->desc.block_size, &v->block_payload))
    return invalid(g, err, KVF_ERR_OVERFLOW, G, L, "heads %u: block payload overflows", d->heads);
  return KVF_SUCCESS;
}

static kvf_status check_recurrent_view(const kvf_geometry *g, kvf_view *v, kvf_geometry_error *err) {
  const kvf_view_desc *d = &v->desc;
  const kvf_group *gr = &g->groups[v->group];
  int32_t G = (int32_t)v->group, L = (int32_t)v->layer;
  if (d->planes || d->heads || d->plane_stride || d->token_stride || d->head_stride || d->head_bytes[0] ||
      d->head_bytes[1])
    return invalid(g, err, KVF_ERR_INVALID_GEOMETRY, G, L,
                   "planes: recurrent views have states, not planes, heads or token/head strides");
  if (d->num_states == 0 || d->num_states > KVF_MAX_STATES)
    return invalid(g, err, KVF_ERR_INVALID_GEOMETRY, G, L, "num_states %u: must be 1..%u", d->num_states,
                   KVF_MAX_STATES);
  uint64_t total = 0;
  for (uint32_t s = 0; s < d->num_states; s++) {
    const kvf_state_desc *st = &d->states[s];
    uint64_t end;
    if (st->bytes == 0)
      return invalid(g, err, KVF_ERR_INVALID_GEOMETRY, G, L, "states[%u].bytes 0: a state tensor needs bytes", s);
    FIELD_MULTIPLE("states.offset", st->offset);
    FIELD_MULTIPLE("states.bytes", st->bytes);
    if (!kvf_add_u64(st->offset, st->bytes, &end) || end > d->block_stride)
      return invalid(g, err, KVF_ERR_INVALID_GEOMETRY, G, L,
                     "states[%u] offset %llu + bytes %llu: runs past the slot (block_stride %llu)", s,
                     (unsigned long long)st->offset, (unsigned long long)st->bytes,
                     (unsigned long long)d->block_stride);
    for (uint32_t o = 0; o < s; o++) {
      const kvf_state_desc *q = &d->states[o];
      if (st->offset < q->offset + q->bytes && q->offset < end)
        return invalid(g, err, KVF_ERR_INVALID_GEOMETRY, G, L, "states[%u] offset %llu: overlaps states[%u]", s,
                       (unsigned long long)st->offset, o);
    }
    total += st->bytes; /* bounded by block_stride per state, 8 states: no overflow */
  }
  v->bytes_per_token = 0;
  v->block_payload = total;
  uint64_t span, last_end = 0;
  for (uint32_t s = 0; s < d->num_states; s++)
    if (d->states[s].offset + d->states[s].bytes > last_end) last_end = d->states[s].offset + d->states[s].bytes;
  if (!kvf_mul_u64(gr->desc.num_blocks - 1, d->block_stride, &span) || !kvf_add_u64(span, last_end, &span) ||
      !kvf_add_u64(d->offset, span, &v->end_offset))
    return invalid(g, err, KVF_ERR_OVERFLOW, G, L, "block_stride %llu: num_blocks x block_stride overflows",
                   (unsigned long long)d->block_stride);
  return KVF_SUCCESS;
}

static kvf_status check_view(kvf_geometry *g, kvf_view *v, kvf_geometry_error *err) {
  const kvf_view_desc *d = &v->desc;
  int32_t G = (int32_t)v->group, L = (int32_t)v->layer;
  if (d->region >= g->num_regions)
    return invalid(g, err, KVF_ERR_INVALID_GEOMETRY, G, L, "region %u: no such region (%u regions)", d->region,
                   g->num_regions);
  if (d->elem_bytes == 0 || d->elem_bytes > 16 || !is_pow2(d->elem_bytes))
    return invalid(g, err, KVF_ERR_INVALID_GEOMETRY, G, L, "elem_bytes %u: must be 1, 2, 4, 8 or 16", d->elem_bytes);
  FIELD_MULTIPLE("offset", d->offset);
  FIELD_MULTIPLE("block_stride", d->block_stride);
  if (d->block_stride == 0 && g->groups[v->group].desc.num_blocks > 1)
    return invalid(g, err, KVF_ERR_INVALID_GEOMETRY, G, L, "block_stride 0: blocks would overlap");
  v->is_recurrent = g->groups[v->group].desc.kind == KVF_GROUP_RECURRENT;
  kvf_status st = v->is_recurrent ? check_recurrent_view(g, v, err) : check_attention_view(g, v, err);
  if (st) return st;
  /* Aliases: declared against an earlier view of the same region. */
  v->alias_root = (uint32_t)(v - g->views);
  if (d->alias_group >= 0) {
    if ((uint32_t)d->alias_group >= g->num_groups ||
        d->alias_layer < 0 || (uint32_t)d->alias_layer >= g->groups[d->alias_group].num_views)
      return invalid(g, err, KVF_ERR_INVALID_GEOMETRY, G, L, "alias_of group %d layer %d: no such view",
                     d->alias_group, d->alias_layer);
    uint32_t target = g->groups[d->alias_group].views[d->alias_layer];
    if ((uint32_t)d->alias_group > v->group || ((uint32_t)d->alias_group == v->group && (uint32_t)d->alias_layer >= v->layer))
      return invalid(g, err, KVF_ERR_INVALID_GEOMETRY, G, L,
                     "alias_of group %d layer %d: must name an earlier view (an earlier group, or an earlier layer)",
                     d->alias_group, d->alias_layer);
    if (g->views[target].desc.region != d->region)
      return invalid(g, err, KVF_ERR_INVALID_GEOMETRY, G, L,
                     "alias_of group %d layer %d: lives in region %u, this view in region %u", d->alias_group,
                     d->alias_layer, g->views[target].desc.region, d->region);
    v->alias_root = g->views[target].alias_root; /* the target was checked first: its root is final */
    g->num_aliases++;
  }
  return KVF_SUCCESS;
}

/* ---- validation: overlap between views of one region ------------------- */

typedef struct interval {
  uint64_t lo, hi; /* [lo, hi) relative to the view's offset, block 0 */
} interval;

#define MAX_FOOTPRINT 4096u

static int cmp_interval(const void *a, const void *b) {
  const interval *x = a, *y = b;
  return x->lo < y->lo ? -1 : x->lo > y->lo;
}

/* The bytes one block of a view touches, as sorted merged intervals. Returns
 * the count, or 0 when it would exceed `cap` (the caller then falls back to a
 * conservative extent check). *work grows by the steps spent (the intervals
 * made, and a sort's n log n when they did not come out sorted). */
static uint32_t block_footprint(const kvf_geometry *g, const kvf_view *v, interval *out, uint32_t cap,
                                uint64_t *work) {
  uint32_t n = 0;
  const kvf_view_desc *d = &v->desc;
  if (v->is_recurrent) {
    for (uint32_t s = 0; s < d->num_states; s++) out[n++] = (interval){d->states[s].offset, d->states[s].offset + d->states[s].bytes};
  } else {
    uint64_t bs = g->groups[v->group].desc.block_size;
    for (uint32_t p = 0; p < d->planes; p++) {
      /* Fuse token and head dimensions that are contiguous with the run, in
       * stride order, so common layouts give one interval per plane. */
      dim td[2] = {{"token_stride", bs, d->token_stride}, {"head_stride", d->heads, d->head_stride}};
      sort_dims(td, 2);
      uint64_t len = d->head_bytes[p];
      int fused = 0;
      while (fused < 2 && (td[fused].count == 1 || td[fused].stride == len)) {
        len *= td[fused].count;
        fused++;
      }
      uint64_t c0 = fused < 1 ? td[0].count : 1, c1 = fused < 2 ? td[1].count : 1;
      if (n + c0 * c1 > cap) return 0;
      for (uint64_t i = 0; i < c1; i++)
        for (uint64_t j = 0; j < c0; j++) {
          uint64_t lo = p * d->plane_stride + (fused < 2 ? i * td[1].stride : 0) + (fused < 1 ? j * td[0].stride : 0);
          out[n++] = (interval){lo, lo + len};
        }
    }
  }
  *work += n;
  /* Within a plane the runs come out in address order (each stride steps
   * over everything the smaller ones span); planes may interleave. */
  int sorted = 1;
  for (uint32_t i = 1; i < n && sorted; i++) sorted = out[i - 1].lo <= out[i].lo;
  if (!sorted) {
    qsort(out, n, sizeof *out, cmp_interval);
    uint64_t lg = 1;
    while ((1ull << lg) < n) lg++;
    *work += (uint64_t)n * lg;
  }
  uint32_t m = 0;
  for (uint32_t i = 0; i < n; i++) {
    if (m && out[i].lo <= out[m - 1].hi) {
      if (out[i].hi > out[m - 1].hi) out[m - 1].hi = out[i].hi;
    } else {
      out[m++] = out[i];
    }
  }
  return m;
}

__extension__ typedef __int128 i128; /* offsets and products of 64-bit values, signed */

static i128 floor_div128(i128 a, i128 b) {
  i128 q = a / b;
  if ((a % b != 0) && ((a < 0) != (b < 0))) q--;
  return q;
}

/* Views a and b of one region with the same block_stride S: block b1 of a
 * meets block b2 of b iff their per-block footprints (sorted, merged) meet
 * at d = b1 - b2, d in [dmin, dmax]. Two ways to find out:
 *   - per pair of runs, the one d that could make them meet (na x nb steps);
 *   - per d whose spans meet, one merge of the two sorted lists
 *     (nd x (na + nb) steps), nd being small unless a view's block
 *     footprint spans many block strides.
 * pair_cost() says what the cheaper one costs, overlap_same_stride() runs it. */
typedef struct pair_plan {
  int by_merge;      /* 1: merge per d in [dlo, dhi]; 0: per pair of runs */
  int64_t dlo, dhi;  /* merge: the d whose spans meet, clamped to [dmin, dmax] */
  uint64_t cost;     /* steps (saturated) */
} pair_plan;

static pair_plan plan_pair(const kvf_geometry *g, const kvf_view *a, const interval *fa, uint32_t na,
                           const kvf_view *b, const interval *fb, uint32_t nb) {
  pair_plan p = {0, 0, -1, 0};
  i128 S = (i128)a->desc.block_stride;
  i128 dmin = -(i128)(g->groups[b->group].desc.num_blocks - 1);
  i128 dmax = (i128)(g->groups[a->group].desc.num_blocks - 1);
  i128 base = (i128)b->desc.offset - (i128)a->desc.offset; /* b's frame minus a's */
  i128 dlo = 0, dhi = 0;
  if (S != 0) {
    /* Spans meet iff  base + fb_lo - fa_hi < d*S < base + fb_hi - fa_lo. */
    i128 L = base + (i128)fb[0].lo - (i128)fa[na - 1].hi;
    i128 U = base + (i128)fb[nb - 1].hi - (i128)fa[0].lo;
    dlo = floor_div128(L, S) + 1;
    dhi = -floor_div128(-U, S) - 1; /* ceil(U / S) - 1 */
    if (dlo < dmin) dlo = dmin;
    if (dhi > dmax) dhi = dmax;
  }
  i128 nd = dhi >= dlo ? dhi - dlo + 1 : 0;
  i128 merge = nd * ((i128)na + nb), pairs = (i128)na * nb;
  i128 cost = merge <= pairs ? merge : pairs;
  p.by_merge = merge <= pairs;
  p.dlo = (int64_t)dlo; /* both within [dmin, dmax]: below 2^31 in magnitude */
  p.dhi = (int64_t)dhi;
  p.cost = cost > (i128)UINT64_MAX ? UINT64_MAX : (uint64_t)cost;
  return p;
}

static int overlap_same_stride(const kvf_geometry *g, const pair_plan *p, const kvf_view *a, const interval *fa,
                               uint32_t na, const kvf_view *b, const interval *fb, uint32_t nb) {
  i128 S = (i128)a->desc.block_stride;
  i128 oa = (i128)a->desc.offset, ob = (i128)b->desc.offset;
  if (p->by_merge) {
    for (int64_t d = p->dlo; d <= p->dhi; d++) {
      i128 shift = oa + (i128)d * S - ob; /* a's run r sits at [r.lo + shift, r.hi + shift) in b's frame */
      uint32_t i = 0, j = 0;
      while (i < na && j < nb) {
        i128 alo = (i128)fa[i].lo + shift, ahi = (i128)fa[i].hi + shift;
        if (ahi <= (i128)fb[j].lo)
          i++;
        else if ((i128)fb[j].hi <= alo)
          j++;
        else
          return 1;
      }
    }
    return 0;
  }
  i128 dmin = -(i128)(g->groups[b->group].desc.num_blocks - 1);
  i128 dmax = (i128)(g->groups[a->group].desc.num_blocks - 1);
  for (uint32_t i = 0; i < na; i++) {
    for (uint32_t j = 0; j < nb; j++) {
      /* Need lo < d*S < hi. */
      i128 lo = ob + (i128)fb[j].lo - oa - (i128)fa[i].hi;
      i128 hi = ob + (i128)fb[j].hi - oa - (i128)fa[i].lo;
      if (S == 0) {
        if (lo < 0 && 0 < hi) return 1;
        continue;
      }
      i128 d = floor_div128(lo, S) + 1;
      if (d < dmin) d = dmin;
      if (d <= dmax && d * S < hi && d * S > lo) return 1;
    }
  }
  return 0;
}

static uint64_t first_byte(const kvf_view *v) {
  if (!v->is_recurrent) return v->desc.offset;
  uint64_t m = UINT64_MAX;
  for (uint32_t s = 0; s < v->desc.num_states; s++)
    if (v->desc.states[s].offset < m) m = v->desc.states[s].offset;
  return v->desc.offset + m;
}

/* Pairs of views whose extents meet that finalize will examine, at most:
 * real models have a few hundred views per region; a file with millions of
 * mutually overlapping views is refused rather than checked for minutes. */
#define MAX_OVERLAP_PAIRS (4u << 20)

typedef struct view_start {
  uint32_t region;
  uint32_t view;
  uint64_t first;
} view_start;

static int cmp_view_start(const void *a, const void *b) {
  const view_start *x = a, *y = b;
  if (x->region != y->region) return x->region < y->region ? -1 : 1;
  return x->first < y->first ? -1 : x->first > y->first;
}

/* Views sorted by (region, first byte): each view is compared only with the
 * later ones whose extent starts before its own ends. Every step (a run of
 * a footprint made, a pair of runs or a merge step compared) is charged to
 * KVF_GEOMETRY_OVERLAP_BUDGET, so the check costs a bounded time whatever
 * the geometry; one that needs more is refused, naming the pair. */
static kvf_status check_overlaps(kvf_geometry *g, kvf_geometry_error *err) {
  kvf_status st = KVF_SUCCESS;
  interval *fa = malloc(sizeof(interval) * MAX_FOOTPRINT);
  interval *fb = malloc(sizeof(interval) * MAX_FOOTPRINT);
  view_start *order = malloc(sizeof(view_start) * (g->num_views ? g->num_views : 1));
  uint64_t pairs = 0, work = 0;
  if (!fa || !fb || !order) {
    st = kvf_fail(KVF_ERR_OUT_OF_MEMORY, "geometry: out of memory checking view overlap");
    goto out;
  }
  for (uint32_t i = 0; i < g->num_views; i++)
    order[i] = (view_start){g->views[i].desc.region, i, first_byte(&g->views[i])};
  qsort(order, g->num_views, sizeof *order, cmp_view_start);
  for (uint32_t i = 0; i < g->num_views; i++) {
    const kvf_view *a = &g->views[order[i].view];
    uint32_t na = 0;
    int a_done = 0;
    for (uint32_t j = i + 1; j < g->num_views; j++) {
      const kvf_view *b = &g->views[order[j].view];
      if (b->desc.region != a->desc.region || first_byte(b) >= a->end_offset) break;
      if (++pairs > MAX_OVERLAP_PAIRS) {
        g->error_region = (int32_t)a->desc.region;
        st = invalid(g, err, KVF_ERR_INVALID_GEOMETRY, -1, -1,
                     "regions[%u]: more than %u pairs of views with overlapping extents to check", a->desc.region,
                     MAX_OVERLAP_PAIRS);
        goto out;
      }
      if (b->alias_root == a->alias_root) continue;
      work += 4; /* the pair itself: the scan, the plan */
      /* Report against the later-registered view, naming the earlier one. */
      const kvf_view *early = order[i].view < order[j].view ? a : b, *late = order[i].view < order[j].view ? b : a;
      if (!a_done) {
        na = block_footprint(g, a, fa, MAX_FOOTPRINT, &work);
        a_done = 1;
      }
      uint32_t nb = block_footprint(g, b, fb, MAX_FOOTPRINT, &work);
      int overlap = 1; /* different strides or huge footprints: extents meet, so be conservative */
      if (a->desc.block_stride == b->desc.block_stride && na && nb) {
        pair_plan plan = plan_pair(g, a, fa, na, b, fb, nb);
        if (plan.cost > KVF_GEOMETRY_OVERLAP_BUDGET - (work < KVF_GEOMETRY_OVERLAP_BUDGET ? work : KVF_GEOMETRY_OVERLAP_BUDGET)) {
          const kvf_group *ge = &g->groups[early->group];
          st = invalid(g, err, KVF_ERR_INVALID_GEOMETRY, (int32_t)late->group, (int32_t)late->layer,
                       "offset %llu: checking overlap with group %u ('%s') layer %u (%u and %u runs per block, "
                       "%llu steps) exceeds the validation budget of %llu steps; declare alias_of if the views share "
                       "memory on purpose, or give interleaved layers fewer, longer runs",
                       (unsigned long long)late->desc.offset, early->group, ge->name, early->layer,
                       early == a ? na : nb, early == a ? nb : na, (unsigned long long)plan.cost,
                       (unsigned long long)KVF_GEOMETRY_OVERLAP_BUDGET);
          goto out;
        }
        work += plan.cost;
        overlap = overlap_same_stride(g, &plan, a, fa, na, b, fb, nb);
      }
      if (overlap) {
        const kvf_group *ge = &g->groups[early->group];
        st = invalid(g, err, KVF_ERR_INVALID_GEOMETRY, (int32_t)late->group, (int32_t)late->layer,
                     "offset %llu: overlaps group %u ('%s') layer %u in region %u; declare alias_of if the engine "
                     "shares this memory on purpose",
                     (unsigned long long)late->desc.offset, early->group, ge->name, early->layer, early->desc.region);
        goto out;
      }
    }
  }
out:
  free(fa);
  free(fb);
  free(order);
  return st;
}

/* ---- object groups and layouts ------------------------------------------- */

static int is_windowed(kvf_group_kind k) { return k == KVF_GROUP_SLIDING_WINDOW || k == KVF_GROUP_CHUNKED_LOCAL; }

static kvf_status build_object_groups(kvf_geometry *g) {
  free(g->object_groups);
  g->object_groups = calloc(g->num_groups, sizeof *g->object_groups);
  if (!g->object_groups) return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "geometry: out of memory");
  g->num_object_groups = 0;
  /* The shared object group first, then the separate ones in group order. */
  kvf_object_group *shared = &g->object_groups[0];
  for (uint32_t i = 0; i < g->num_groups; i++) {
    kvf_group_kind k = g->groups[i].desc.kind;
    int separate = (is_windowed(k) && g->policy.separate_windowed) ||
                   (k == KVF_GROUP_RECURRENT && g->policy.separate_recurrent);
    if (!separate) shared->groups[shared->num_groups++] = i;
  }
  if (shared->num_groups) g->num_object_groups = 1;
  for (uint32_t i = 0; i < g->num_groups; i++) {
    kvf_group_kind k = g->groups[i].desc.kind;
    int separate = (is_windowed(k) && g->policy.separate_windowed) ||
                   (k == KVF_GROUP_RECURRENT && g->policy.separate_recurrent);
    if (separate) {
      kvf_object_group *og = &g->object_groups[g->num_object_groups++];
      og->groups[og->num_groups++] = i;
    }
  }
  for (uint32_t o = 0; o < g->num_object_groups; o++) {
    kvf_object_group *og = &g->object_groups[o];
    uint64_t native = 0, rec = 0;
    for (uint32_t k = 0; k < og->num_groups; k++) {
      kvf_group *gr = &g->groups[og->groups[k]];
      gr->object_group = o;
      for (uint32_t l = 0; l < gr->num_views; l++) {
        kvf_view *v = &g->views[gr->views[l]];
        if (v->is_recurrent) {
          og->has_recurrent = 1;
          v->recurrent_prefix = rec;
          if (!kvf_add_u64(rec, v->block_payload, &rec)) return kvf_fail(KVF_ERR_OVERFLOW, "object size overflows");
          continue;
        }
        og->has_attention = 1;
        v->native_prefix = native;
        if (!kvf_add_u64(native, v->bytes_per_token, &native))
          return kvf_fail(KVF_ERR_OVERFLOW, "object size overflows");
        for (uint32_t p = 0; p < KVF_MAX_PLANES; p++) {
          v->canonical_prefix[p] = og->plane_bytes_per_token[p];
          uint64_t add = p < v->desc.planes ? (uint64_t)v->desc.heads * v->desc.head_bytes[p] : 0;
          if (!kvf_add_u64(og->plane_bytes_per_token[p], add, &og->plane_bytes_per_token[p]))
            return kvf_fail(KVF_ERR_OVERFLOW, "object size overflows");
        }
      }
    }
    og->bytes_per_token = native;
    og->recurrent_bytes = rec;
  }
  return KVF_SUCCESS;
}

/* FNV-1a, 64 bit: small, stable across platforms, good enough to tell
 * geometries apart (it is an identity check, not a security boundary). */
static void fnv(uint64_t *h, const void *data, size_t len) {
  const unsigned char *p = data;
  for (size_t i = 0; i < len; i++) {
    *h ^= p[i];
    *h *= 0x100000001b3ull;
  }
}
static void fnv_u64(uint64_t *h, uint64_t x) {
  unsigned char b[8];
  for (int i = 0; i < 8; i++) b[i] = (unsigned char)(x >> (8 * i));
  fnv(h, b, sizeof b);
}

static uint64_t compute_fingerprint(const kvf_geometry *g, kvf_object_format fmt) {
  uint64_t h = 0xcbf29ce484222325ull;
  fnv(&h, "kvferry-objects-v1", 18);
  fnv_u64(&h, (uint64_t)fmt);
  fnv_u64(&h, g->policy.chunk_tokens);
  fnv_u64(&h, g->dcp_world);
  fnv_u64(&h, g->num_object_groups);
  for (uint32_t o = 0; o < g->num_object_groups; o++) {
    const kvf_object_group *og = &g->object_groups[o];
    fnv_u64(&h, og->num_groups);
    for (uint32_t k = 0; k < og->num_groups; k++) {
      const kvf_group *gr = &g->groups[og->groups[k]];
      fnv_u64(&h, gr->desc.kind);
      fnv_u64(&h, gr->desc.window);
      fnv_u64(&h, gr->desc.chunk);
      fnv_u64(&h, gr->num_views);
      if (fmt == KVF_FORMAT_NATIVE) fnv_u64(&h, gr->desc.block_size);
      for (uint32_t l = 0; l < gr->num_views; l++) {
        const kvf_view *v = &g->views[gr->views[l]];
        const kvf_view_desc *d = &v->desc;
        fnv_u64(&h, d->planes);
        fnv_u64(&h, d->heads);
        fnv_u64(&h, d->head_bytes[0]);
        fnv_u64(&h, d->head_bytes[1]);
        fnv_u64(&h, d->num_states);
        for (uint32_t s = 0; s < d->num_states; s++) {
          fnv_u64(&h, d->states[s].bytes);
          if (fmt == KVF_FORMAT_NATIVE) fnv_u64(&h, d->states[s].offset);
        }
        if (fmt == KVF_FORMAT_NATIVE && !v->is_recurrent) {
          /* The native order of a block's runs follows the strides' order. */
          dim dims[4];
          int n = attention_dims(g, v, dims);
          sort_dims(dims, n);
          for (int i = 0; i < n; i++) {
            if (dims[i].count > 1) fnv(&h, dims[i].field, strlen(dims[i].field));
          }
        }
      }
    }
  }
  return h;
}

/* A view that runs past its region (of a given size) for the largest block
 * id. The extent grows by block_stride per block, so block 0 alone ends at
 * end_offset - (num_blocks - 1) * block_stride. Which field to blame:
 *   - the view's offset, when the view starts at or past the region's end;
 *   - the region's size, when block 0 alone does not fit (no block count
 *     would help: the region is too small for one block of this view);
 *   - otherwise the group's num_blocks: the region holds some blocks of the
 *     view, fewer than the group has. */
static kvf_status region_overrun(const kvf_geometry *g, const kvf_view *v, kvf_geometry_error *err) {
  const kvf_region *r = &g->regions[v->desc.region];
  uint32_t nb = g->groups[v->group].desc.num_blocks;
  uint64_t bs = v->desc.block_stride;
  uint64_t first_end = v->end_offset - (uint64_t)(nb - 1) * bs; /* no overflow: end_offset includes it */
  int32_t G = (int32_t)v->group, L = (int32_t)v->layer;
  if (v->desc.offset >= r->size)
    return invalid(g, err, KVF_ERR_INVALID_GEOMETRY, G, L,
                   "offset %llu: at or past the end of region %u '%s' (%llu bytes)", (unsigned long long)v->desc.offset,
                   v->desc.region, r->name, (unsigned long long)r->size);
  if (first_end > r->size)
    return invalid(g, err, KVF_ERR_INVALID_GEOMETRY, G, L,
                   "size %llu of region %u '%s': too small for one block of this view: block 0 ends at byte %llu "
                   "(num_blocks %u need %llu bytes)",
                   (unsigned long long)r->size, v->desc.region, r->name, (unsigned long long)first_end, nb,
                   (unsigned long long)v->end_offset);
  /* first_end <= size < end_offset: nb > 1, so bs > 0. */
  uint64_t fit = 1 + (r->size - first_end) / bs;
  return invalid(g, err, KVF_ERR_INVALID_GEOMETRY, G, L,
                 "num_blocks %u: block %u of the view ends at byte %llu, past the end of region %u '%s' (%llu "
                 "bytes), which holds %llu block%s of it",
                 nb, nb - 1, (unsigned long long)v->end_offset, v->desc.region, r->name, (unsigned long long)r->size,
                 (unsigned long long)fit, fit == 1 ? "" : "s");
}

kvf_status kvf_geometry_finalize(kvf_geometry *g, kvf_geometry_error *err) {
  if (err) memset(err, 0, sizeof *err), err->group = -1, err->layer = -1;
  if (!g) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_geometry_finalize: geometry is NULL");
  if (g->finalized) return kvf_fail(KVF_ERR_STATE, "kvf_geometry_finalize: already finalized");
  g->error_region = -1;
  kvf_status st;
  const kvf_object_policy *pol = &g->policy;
  if (g->num_regions == 0) return invalid(g, err, KVF_ERR_INVALID_GEOMETRY, -1, -1, "regions: none declared");
  if (g->num_groups == 0) return invalid(g, err, KVF_ERR_INVALID_GEOMETRY, -1, -1, "groups: none declared");
  if (pol->chunk_tokens == 0 || pol->chunk_tokens > KVF_MAX_CHUNK_TOKENS)
    return invalid(g, err, KVF_ERR_INVALID_GEOMETRY, -1, -1, "chunk_tokens %u: must be 1..%u", pol->chunk_tokens,
                   KVF_MAX_CHUNK_TOKENS);
  if ((unsigned)pol->format > KVF_FORMAT_NATIVE)
    return invalid(g, err, KVF_ERR_INVALID_GEOMETRY, -1, -1, "format %d: not an object format", (int)pol->format);
  if ((pol->separate_windowed != 0 && pol->separate_windowed != 1) ||
      (pol->separate_recurrent != 0 && pol->separate_recurrent != 1))
    return invalid(g, err, KVF_ERR_INVALID_GEOMETRY, -1, -1, "separate_windowed/separate_recurrent: must be 0 or 1");
  if (g->dcp_rank >= g->dcp_world)
    return invalid(g, err, KVF_ERR_INVALID_GEOMETRY, -1, -1, "dcp rank %u: must be below world %u", g->dcp_rank,
                   g->dcp_world);

  for (uint32_t i = 0; i < g->num_regions; i++)
    if ((st = check_region(g, i, err))) {
      g->error_region = (int32_t)i;
      return st;
    }
  for (uint32_t i = 0; i < g->num_groups; i++)
    if ((st = check_group(g, i, err))) return st;
  g->num_aliases = 0;
  /* Views in group then layer order, so an alias target is always checked first. */
  for (uint32_t gi = 0; gi < g->num_groups; gi++)
    for (uint32_t l = 0; l < g->groups[gi].num_views; l++)
      if ((st = check_view(g, &g->views[g->groups[gi].views[l]], err))) return st;

  /* Region sizes: computed where 0, otherwise every view must fit. */
  for (uint32_t r = 0; r < g->num_regions; r++) g->regions[r].num_views = 0;
  uint64_t *need = calloc(g->num_regions, sizeof *need);
  if (!need) return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "geometry: out of memory");
  for (uint32_t i = 0; i < g->num_views; i++) {
    const kvf_view *v = &g->views[i];
    kvf_region *r = &g->regions[v->desc.region];
    r->num_views++;
    if (v->end_offset > need[v->desc.region]) need[v->desc.region] = v->end_offset;
    if (r->size && v->end_offset > r->size) {
      free(need);
      g->error_region = (int32_t)v->desc.region;
      return region_overrun(g, v, err);
    }
  }
  for (uint32_t r = 0; r < g->num_regions; r++) {
    if (g->regions[r].num_views == 0) {
      free(need);
      g->error_region = (int32_t)r;
      return invalid(g, err, KVF_ERR_INVALID_GEOMETRY, -1, -1, "regions[%u] '%s': no view lives in it", r,
                     g->regions[r].name);
    }
  }
  if ((st = check_overlaps(g, err))) {
    free(need);
    return st;
  }
  if ((st = build_object_groups(g))) {
    free(need);
    return st;
  }
  /* Only now, with every rule passed, fill in computed sizes. */
  for (uint32_t r = 0; r < g->num_regions; r++)
    if (g->regions[r].size == 0) g->regions[r].size = need[r];
  free(need);
  g->fingerprint[KVF_FORMAT_CANONICAL] = compute_fingerprint(g, KVF_FORMAT_CANONICAL);
  g->fingerprint[KVF_FORMAT_NATIVE] = compute_fingerprint(g, KVF_FORMAT_NATIVE);
  g->finalized = 1;
  return KVF_SUCCESS;
}

/* ---- reading ------------------------------------------------------------- */

#define REQUIRE_FINAL(g, fn)                                                                        \
  do {                                                                                              \
    if (!(g)) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "%s: geometry is NULL", fn);               \
    if (!(g)->finalized) return kvf_fail(KVF_ERR_STATE, "%s: the geometry is not finalized", fn);  \
  } while (0)

uint32_t kvf_geometry_num_regions(const kvf_geometry *g) { return g ? g->num_regions : 0; }
uint32_t kvf_geometry_num_groups(const kvf_geometry *g) { return g ? g->num_groups : 0; }
uint32_t kvf_geometry_num_object_groups(const kvf_geometry *g) { return g && g->finalized ? g->num_object_groups : 0; }
uint32_t kvf_geometry_num_aliases(const kvf_geometry *g) { return g && g->finalized ? g->num_aliases : 0; }
const char *kvf_geometry_name(const kvf_geometry *g) { return g ? g->name : ""; }
const char *kvf_geometry_description(const kvf_geometry *g) { return g && g->description ? g->description : ""; }

kvf_status kvf_geometry_region(const kvf_geometry *g, uint32_t index, kvf_region_info *out) {
  REQUIRE_FINAL(g, "kvf_geometry_region");
  if (!out || index >= g->num_regions)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_geometry_region: index %u out of range (%u regions)", index,
                    g->num_regions);
  const kvf_region *r = &g->regions[index];
  kvf_region_info info = KVF_REGION_INFO_INIT;
  info.name = r->name;
  info.size = r->size;
  info.align = r->align;
  info.num_views = r->num_views;
  return KVF_VERSIONED_OUT(kvf_region_info, out, &info);
}

kvf_status kvf_geometry_group(const kvf_geometry *g, uint32_t index, kvf_group_info *out) {
  REQUIRE_FINAL(g, "kvf_geometry_group");
  if (!out || index >= g->num_groups)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_geometry_group: index %u out of range (%u groups)", index,
                    g->num_groups);
  const kvf_group *gr = &g->groups[index];
  kvf_group_info info = KVF_GROUP_INFO_INIT;
  info.name = gr->name;
  info.kind = gr->desc.kind;
  info.block_size = gr->desc.block_size;
  info.num_blocks = gr->desc.num_blocks;
  info.window = gr->desc.window;
  info.chunk = gr->desc.chunk;
  info.num_layers = gr->num_views;
  info.object_group = gr->object_group;
  for (uint32_t l = 0; l < gr->num_views; l++) {
    const kvf_view *v = &g->views[gr->views[l]];
    info.payload_per_block += v->block_payload;
    if (v->desc.block_stride > info.max_block_stride) info.max_block_stride = v->desc.block_stride;
  }
  return KVF_VERSIONED_OUT(kvf_group_info, out, &info);
}

kvf_status kvf_geometry_object_group(const kvf_geometry *g, uint32_t index, kvf_object_group_info *out) {
  REQUIRE_FINAL(g, "kvf_geometry_object_group");
  if (!out || index >= g->num_object_groups)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_geometry_object_group: index %u out of range (%u object groups)",
                    index, g->num_object_groups);
  const kvf_object_group *og = &g->object_groups[index];
  kvf_object_group_info info = KVF_OBJECT_GROUP_INFO_INIT;
  info.num_groups = og->num_groups;
  info.groups = og->groups;
  info.has_attention = og->has_attention;
  info.has_recurrent = og->has_recurrent;
  info.bytes_per_token = og->bytes_per_token;
  info.recurrent_bytes = og->recurrent_bytes;
  return KVF_VERSIONED_OUT(kvf_object_group_info, out, &info);
}

kvf_status kvf_geometry_view(const kvf_geometry *g, uint32_t group, uint32_t layer, kvf_view_desc *out) {
  if (!g || !out) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_geometry_view: NULL argument");
  if (group >= g->num_groups || layer >= g->groups[group].num_views)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_geometry_view: group %u layer %u does not exist", group, layer);
  const kvf_view *v = kvf_group_view(g, group, layer);
  kvf_view_desc d = v->desc;
  d.name = v->name;
  return KVF_VERSIONED_OUT(kvf_view_desc, out, &d);
}

kvf_status kvf_geometry_policy(const kvf_geometry *g, kvf_object_policy *out) {
  if (!g || !out) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_geometry_policy: NULL argument");
  return KVF_VERSIONED_OUT(kvf_object_policy, out, &g->policy);
}

kvf_status kvf_geometry_dcp(const kvf_geometry *g, uint32_t *world, uint32_t *rank) {
  if (!g) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_geometry_dcp: geometry is NULL");
  if (world) *world = g->dcp_world;
  if (rank) *rank = g->dcp_rank;
  return KVF_SUCCESS;
}

uint64_t kvf_geometry_fingerprint(const kvf_geometry *g, kvf_object_format format) {
  if (!g || !g->finalized || (unsigned)format > KVF_FORMAT_NATIVE) return 0;
  return g->fingerprint[format];
}

const char *kvf_group_kind_name(kvf_group_kind kind) {
  switch (kind) {
  case KVF_GROUP_FULL: return "full";
  case KVF_GROUP_SLIDING_WINDOW: return "sliding_window";
  case KVF_GROUP_CHUNKED_LOCAL: return "chunked_local";
  case KVF_GROUP_RECURRENT: return "recurrent";
  }
  return "unknown";
}

const char *kvf_object_format_name(kvf_object_format format) {
  switch (format) {
  case KVF_FORMAT_CANONICAL: return "canonical";
  case KVF_FORMAT_NATIVE: return "native";
  }
  return "unknown";
}

/* ---- tokens, blocks, windows -------------------------------------------- */

uint64_t kvf_geometry_local_tokens(const kvf_geometry *g, uint64_t global_tokens) {
  return g ? kvf_local_token(g, global_tokens) : 0;
}

static kvf_status attention_group(const kvf_geometry *g, uint32_t group, const char *fn) {
  REQUIRE_FINAL(g, fn);
  if (group >= g->num_groups) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "%s: group %u does not exist", fn, group);
  if (g->groups[group].desc.kind == KVF_GROUP_RECURRENT)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "%s: group %u ('%s') is recurrent: it has slots, not token blocks", fn,
                    group, g->groups[group].name);
  return KVF_SUCCESS;
}

kvf_status kvf_geometry_local_blocks(const kvf_geometry *g, uint32_t group, uint64_t token_begin, uint64_t token_end,
                                     uint64_t *first_block, uint64_t *end_block) {
  kvf_status st = attention_group(g, group, "kvf_geometry_local_blocks");
  if (st) return st;
  if (!first_block || !end_block || token_begin > token_end)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_geometry_local_blocks: token_begin %llu > token_end %llu",
                    (unsigned long long)token_begin, (unsigned long long)token_end);
  uint64_t bs = g->groups[group].desc.block_size;
  uint64_t lb = kvf_local_token(g, token_begin), le = kvf_local_token(g, token_end);
  *first_block = lb / bs;
  *end_block = le > lb ? le / bs + (le % bs != 0) : lb / bs; /* no wrap near 2^64 */
  return KVF_SUCCESS;
}

kvf_status kvf_geometry_retained_tokens(const kvf_geometry *g, uint32_t group, uint64_t prefix_tokens,
                                        uint64_t *token_begin) {
  REQUIRE_FINAL(g, "kvf_geometry_retained_tokens");
  if (group >= g->num_groups || !token_begin)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_geometry_retained_tokens: group %u does not exist", group);
  const kvf_group_desc *d = &g->groups[group].desc;
  uint64_t n = prefix_tokens;
  switch (d->kind) {
  case KVF_GROUP_FULL: *token_begin = 0; break;
  case KVF_GROUP_SLIDING_WINDOW: *token_begin = n >= d->window ? n - d->window + 1 : 0; break;
  case KVF_GROUP_CHUNKED_LOCAL: *token_begin = n / d->chunk * d->chunk; break;
  case KVF_GROUP_RECURRENT: *token_begin = n; break;
  }
  return KVF_SUCCESS;
}

kvf_status kvf_geometry_retained_blocks(const kvf_geometry *g, uint32_t group, uint64_t prefix_tokens,
                                        uint64_t *first_block, uint64_t *end_block) {
  kvf_status st = attention_group(g, group, "kvf_geometry_retained_blocks");
  if (st) return st;
  uint64_t begin;
  if ((st = kvf_geometry_retained_tokens(g, group, prefix_tokens, &begin))) return st;
  return kvf_geometry_local_blocks(g, group, begin, prefix_tokens, first_block, end_block);
}

kvf_status kvf_geometry_recurrent_state(const kvf_geometry *g, uint64_t prefix_tokens, uint64_t *chunk_index) {
  REQUIRE_FINAL(g, "kvf_geometry_recurrent_state");
  if (!chunk_index) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_geometry_recurrent_state: chunk_index is NULL");
  uint64_t c = g->policy.chunk_tokens;
  if (prefix_tokens == 0 || prefix_tokens % c != 0)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT,
                    "prefix_tokens %llu: recurrent state is kept only at chunk boundaries (multiples of %llu)",
                    (unsigned long long)prefix_tokens, (unsigned long long)c);
  *chunk_index = prefix_tokens / c - 1;
  return KVF_SUCCESS;
}

/* ---- object layout -------------------------------------------------------- */

kvf_status kvf_geometry_object_size(const kvf_geometry *g, uint32_t object_group, uint64_t chunk_index,
                                    uint64_t total_tokens, uint64_t *bytes) {
  REQUIRE_FINAL(g, "kvf_geometry_object_size");
  if (!bytes || object_group >= g->num_object_groups)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_geometry_object_size: object_group %u out of range (%u)",
                    object_group, g->num_object_groups);
  uint64_t c = g->policy.chunk_tokens, begin, end;
  if (!kvf_mul_u64(chunk_index, c, &begin) || begin >= total_tokens)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "chunk_index %llu: past the %llu-token sequence",
                    (unsigned long long)chunk_index, (unsigned long long)total_tokens);
  end = total_tokens - begin > c ? begin + c : total_tokens;
  const kvf_object_group *og = &g->object_groups[object_group];
  uint64_t n = kvf_local_token(g, end) - kvf_local_token(g, begin), size;
  /* Recurrent state exists only at chunk boundaries: a partial chunk has none. */
  uint64_t state = end - begin == c ? og->recurrent_bytes : 0;
  if (!kvf_mul_u64(n, og->bytes_per_token, &size) || !kvf_add_u64(size, state, &size))
    return kvf_fail(KVF_ERR_OVERFLOW, "object size overflows");
  *bytes = size;
  return KVF_SUCCESS;
}

kvf_status kvf_geometry_object_segment(const kvf_geometry *g, kvf_object_format format, uint32_t group,
                                       uint32_t layer, uint32_t plane, uint64_t local_tokens, uint64_t *offset,
                                       uint64_t *segment_bytes) {
  REQUIRE_FINAL(g, "kvf_geometry_object_segment");
  if (!offset || group >= g->num_groups || layer >= g->groups[group].num_views)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_geometry_object_segment: group %u layer %u does not exist", group,
                    layer);
  if ((unsigned)format > KVF_FORMAT_NATIVE)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "format %d: not an object format", (int)format);
  const kvf_view *v = kvf_group_view(g, group, layer);
  const kvf_object_group *og = &g->object_groups[g->groups[group].object_group];
  uint64_t n = local_tokens, off, len;
  if (v->is_recurrent) {
    off = n * og->bytes_per_token + v->recurrent_prefix;
    len = v->block_payload;
  } else if (format == KVF_FORMAT_NATIVE) {
    off = n * v->native_prefix;
    len = n * v->bytes_per_token;
  } else {
    if (plane >= v->desc.planes)
      return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "plane %u: the view has %u plane(s)", plane, v->desc.planes);
    uint64_t before = 0;
    for (uint32_t p = 0; p < plane; p++) before += og->plane_bytes_per_token[p];
    off = n * (before + v->canonical_prefix[plane]);
    len = n * v->desc.heads * v->desc.head_bytes[plane];
  }
  /* Object sizes were checked for overflow per token; n is bounded by the
   * chunk, so these products fit whenever the object size does. */
  *offset = off;
  if (segment_bytes) *segment_bytes = len;
  return KVF_SUCCESS;
}

kvf_status kvf_object_header_init(const kvf_geometry *g, kvf_object_format format, uint32_t object_group,
                                  uint64_t chunk_index, uint64_t total_tokens, kvf_object_header *h) {
  REQUIRE_FINAL(g, "kvf_object_header_init");
  if (!h || (unsigned)format > KVF_FORMAT_NATIVE)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_object_header_init: bad format or NULL header");
  uint64_t bytes;
  kvf_status st = kvf_geometry_object_size(g, object_group, chunk_index, total_tokens, &bytes);
  if (st) return st;
  uint64_t c = g->policy.chunk_tokens, begin = chunk_index * c;
  memset(h, 0, sizeof *h);
  h->magic = KVF_OBJECT_MAGIC;
  h->header_version = 1;
  h->format = (uint16_t)format;
  h->fingerprint = g->fingerprint[format];
  h->object_group = object_group;
  h->dcp_rank = g->dcp_rank;
  h->token_begin = begin;
  h->token_end = total_tokens - begin > c ? begin + c : total_tokens;
  h->payload_bytes = bytes;
  return KVF_SUCCESS;
}

kvf_status kvf_object_header_check(const kvf_geometry *g, const kvf_object_header *h, uint32_t object_group) {
  REQUIRE_FINAL(g, "kvf_object_header_check");
  if (!h) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_object_header_check: header is NULL");
  if (h->magic != KVF_OBJECT_MAGIC || h->header_version != 1)
    return kvf_fail(KVF_ERR_GEOMETRY_MISMATCH, "magic 0x%08x / header_version %u: not a kvferry object header",
                    h->magic, h->header_version);
  if (h->format > KVF_FORMAT_NATIVE)
    return kvf_fail(KVF_ERR_GEOMETRY_MISMATCH, "format %u: not an object format", h->format);
  if (h->fingerprint != g->fingerprint[h->format])
    return kvf_fail(KVF_ERR_GEOMETRY_MISMATCH,
                    "fingerprint %016llx: the object was made by a different geometry (this one is %016llx for %s "
                    "objects)",
                    (unsigned long long)h->fingerprint, (unsigned long long)g->fingerprint[h->format],
                    kvf_object_format_name((kvf_object_format)h->format));
  if (h->object_group != object_group)
    return kvf_fail(KVF_ERR_GEOMETRY_MISMATCH, "object_group %u: expected object group %u", h->object_group,
                    object_group);
  if (h->dcp_rank != g->dcp_rank)
    return kvf_fail(KVF_ERR_GEOMETRY_MISMATCH, "dcp_rank %u: the object holds another rank's tokens (this is rank %u)",
                    h->dcp_rank, g->dcp_rank);
  uint64_t c = g->policy.chunk_tokens, expect;
  if (h->token_begin % c != 0 || h->token_end <= h->token_begin || h->token_end - h->token_begin > c)
    return kvf_fail(KVF_ERR_GEOMETRY_MISMATCH, "token_begin %llu / token_end %llu: not one chunk of %llu tokens",
                    (unsigned long long)h->token_begin, (unsigned long long)h->token_end, (unsigned long long)c);
  kvf_status st = kvf_geometry_object_size(g, object_group, h->token_begin / c, h->token_end, &expect);
  if (st) return st;
  if (expect != h->payload_bytes)
    return kvf_fail(KVF_ERR_GEOMETRY_MISMATCH, "payload_bytes %llu: this geometry expects %llu",
                    (unsigned long long)h->payload_bytes, (unsigned long long)expect);
  return KVF_SUCCESS;
}
