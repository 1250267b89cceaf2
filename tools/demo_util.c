/* Helpers the kvferry CLI's demos share (tools/demo_util.h). */
#define _POSIX_C_SOURCE 200809L
#include "demo_util.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#ifdef KVF_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

void human(uint64_t bytes, char *buf, size_t len) {
  const char *unit[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = (double)bytes;
  int u = 0;
  while (v >= 1024 && u < 4) v /= 1024, u++;
  if (u == 0)
    snprintf(buf, len, "%" PRIu64 " B", bytes);
  else
    snprintf(buf, len, "%.2f %s", v, unit[u]);
}

double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

uint64_t splitmix(uint64_t *s) {
  uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}


void cache_free(demo_cache *c) {
  for (uint32_t r = 0; c->bases && r < c->num_regions; r++) free(c->bases[r]);
#ifdef KVF_WITH_CUDA
  for (uint32_t r = 0; c->device && r < c->num_regions; r++) cudaFree(c->device[r]);
#endif
  free(c->bases);
  free(c->device);
  free(c->sizes);
  memset(c, 0, sizeof *c);
}

int cache_alloc(const kvf_geometry *g, demo_cache *c, uint64_t *seed, int on_gpu) {
  c->num_regions = kvf_geometry_num_regions(g);
  c->bases = calloc(c->num_regions, sizeof *c->bases);
  c->sizes = calloc(c->num_regions, sizeof *c->sizes);
  c->device = on_gpu ? calloc(c->num_regions, sizeof *c->device) : NULL;
  if (!c->bases || !c->sizes || (on_gpu && !c->device)) return -1;
  for (uint32_t r = 0; r < c->num_regions; r++) {
    kvf_region_info ri = KVF_REGION_INFO_INIT;
    kvf_geometry_region(g, r, &ri);
    uint64_t align = ri.align < 64 ? 64 : ri.align;
    c->sizes[r] = ri.size;
    c->bases[r] = aligned_alloc(align, (ri.size + align - 1) / align * align);
    if (!c->bases[r]) return -1;
    uint64_t *p = c->bases[r];
    for (uint64_t i = 0; i < ri.size / 8; i++) p[i] = splitmix(seed);
    for (uint64_t i = ri.size / 8 * 8; i < ri.size; i++) ((uint8_t *)c->bases[r])[i] = (uint8_t)splitmix(seed);
#ifdef KVF_WITH_CUDA
    if (on_gpu && (cudaMalloc(&c->device[r], ri.size) != cudaSuccess ||
                   cudaMemcpy(c->device[r], c->bases[r], ri.size, cudaMemcpyHostToDevice) != cudaSuccess))
      return -1;
#endif
  }
  return 0;
}

/* Bring the device regions back into the host copies (GPU only). */
int cache_download(demo_cache *c) {
#ifdef KVF_WITH_CUDA
  for (uint32_t r = 0; c->device && r < c->num_regions; r++)
    if (cudaMemcpy(c->bases[r], c->device[r], c->sizes[r], cudaMemcpyDeviceToHost) != cudaSuccess) return -1;
#else
  (void)c;
#endif
  return 0;
}


void tables_free(demo_tables *t) {
  for (uint32_t i = 0; t->ids && i < t->num_groups; i++) free(t->ids[i]);
  free(t->ids);
  free(t->first);
  free(t->count);
  memset(t, 0, sizeof *t);
}

/* Blocks each group keeps after `tokens`: everything for full groups, the
 * retained window for windowed ones, the final state for recurrent ones. */
int tables_make(const kvf_geometry *g, uint64_t tokens, uint32_t *pool, uint32_t pool_size, demo_tables *t) {
  kvf_object_policy pol = KVF_OBJECT_POLICY_INIT;
  kvf_geometry_policy(g, &pol);
  t->num_groups = kvf_geometry_num_groups(g);
  t->ids = calloc(t->num_groups, sizeof *t->ids);
  t->first = calloc(t->num_groups, sizeof *t->first);
  t->count = calloc(t->num_groups, sizeof *t->count);
  if (!t->ids || !t->first || !t->count) return -1;
  uint32_t next = 0;
  for (uint32_t i = 0; i < t->num_groups; i++) {
    kvf_group_info gi = KVF_GROUP_INFO_INIT;
    kvf_geometry_group(g, i, &gi);
    uint64_t first, end;
    if (gi.kind == KVF_GROUP_RECURRENT) {
      if (kvf_geometry_recurrent_state(g, tokens, &first)) continue; /* no state off a boundary */
      end = first + 1;
    } else if (kvf_geometry_retained_blocks(g, i, tokens, &first, &end)) {
      return -1;
    }
    t->first[i] = first;
    t->count[i] = (uint32_t)(end - first);
    t->ids[i] = malloc(sizeof(uint32_t) * (t->count[i] ? t->count[i] : 1));
    if (!t->ids[i]) return -1;
    for (uint32_t k = 0; k < t->count[i]; k++) {
      if (next >= pool_size) return -1;
      t->ids[i][k] = pool[next++];
    }
  }
  return 0;
}

uint64_t tables_blocks(const demo_tables *t) {
  uint64_t n = 0;
  for (uint32_t i = 0; i < t->num_groups; i++) n += t->count[i];
  return n;
}

/* Verify: every run the retrieve selected holds, at its new block, the bytes
 * the engine had at the old block; every other byte kept its poison. */
int demo_verify(const kvf_geometry *g, uint64_t tokens, const demo_cache *src, const demo_tables *old,
                       const demo_cache *dst, const demo_cache *poison, const demo_tables *neu, uint64_t *checked,
                       uint64_t *untouched) {
  kvf_object_policy pol = KVF_OBJECT_POLICY_INIT;
  kvf_geometry_policy(g, &pol);
  uint8_t **mask = calloc(dst->num_regions, sizeof *mask);
  int bad = 0;
  if (!mask) return -1;
  for (uint32_t r = 0; r < dst->num_regions; r++)
    if (!(mask[r] = calloc(1, dst->sizes[r]))) bad = -1;
  *checked = *untouched = 0;
  for (uint32_t gi = 0; !bad && gi < kvf_geometry_num_groups(g); gi++) {
    kvf_group_info info = KVF_GROUP_INFO_INIT;
    kvf_geometry_group(g, gi, &info);
    for (uint32_t l = 0; l < info.num_layers && !bad; l++) {
      kvf_view_desc v = KVF_VIEW_DESC_INIT;
      kvf_geometry_view(g, gi, l, &v);
      for (uint32_t k = 0; k < neu->count[gi] && !bad; k++) {
        uint64_t lblock = neu->first[gi] + k;
        /* The same logical block in the old table. */
        if (lblock < old->first[gi] || lblock - old->first[gi] >= old->count[gi]) {
          bad = 1;
          break;
        }
        uint64_t from = (uint64_t)old->ids[gi][lblock - old->first[gi]] * v.block_stride + v.offset;
        uint64_t to = (uint64_t)neu->ids[gi][k] * v.block_stride + v.offset;
        const uint8_t *s = src->bases[v.region], *d = dst->bases[v.region];
        if (info.kind == KVF_GROUP_RECURRENT) {
          for (uint32_t st = 0; st < v.num_states; st++) {
            uint64_t o = v.states[st].offset, n = v.states[st].bytes;
            if (memcmp(s + from + o, d + to + o, n)) bad = 1;
            memset(mask[v.region] + to + o, 1, n);
            *checked += n;
          }
          continue;
        }
        /* Whole blocks of the window move, tokens before its start included. */
        uint64_t lt_end = kvf_geometry_local_tokens(g, tokens);
        for (uint64_t t = 0; t < info.block_size; t++) {
          if (lblock * info.block_size + t >= lt_end) break;
          for (uint32_t p = 0; p < v.planes; p++)
            for (uint32_t h = 0; h < v.heads; h++) {
              uint64_t o = p * v.plane_stride + t * v.token_stride + h * v.head_stride, n = v.head_bytes[p];
              if (memcmp(s + from + o, d + to + o, n)) bad = 1;
              memset(mask[v.region] + to + o, 1, n);
              *checked += n;
            }
        }
      }
    }
  }
  for (uint32_t r = 0; !bad && r < dst->num_regions; r++) {
    const uint8_t *d = dst->bases[r], *p = poison->bases[r];
    for (uint64_t i = 0; i < dst->sizes[r]; i++) {
      if (mask[r][i]) continue;
      if (d[i] != p[i]) {
        bad = 1;
        break;
      }
      (*untouched)++;
    }
  }
  for (uint32_t r = 0; r < dst->num_regions; r++) free(mask[r]);
  free(mask);
  return bad;
}

uint64_t moved_bytes(const kvf_geometry *g, const demo_tables *t, uint64_t tokens) {
  uint64_t n = 0;
  for (uint32_t gi = 0; gi < t->num_groups; gi++) {
    kvf_group_info info = KVF_GROUP_INFO_INIT;
    kvf_geometry_group(g, gi, &info);
    if (info.kind == KVF_GROUP_RECURRENT) {
      n += (uint64_t)t->count[gi] * info.payload_per_block;
      continue;
    }
    /* Tokens of the moved blocks that lie inside the prefix. */
    uint64_t lt_end = kvf_geometry_local_tokens(g, tokens), lt0 = t->first[gi] * info.block_size;
    uint64_t lt1 = (t->first[gi] + t->count[gi]) * info.block_size;
    if (lt1 > lt_end) lt1 = lt_end;
    n += (lt1 - lt0) * (info.payload_per_block / info.block_size);
  }
  return n;
}


int demo_geometry_load(const char *path, uint64_t tokens, kvf_geometry **out, uint32_t *num_blocks) {
  /* Load once to size the block pool, then with enough blocks for the prefix. */
  kvf_geometry *g = NULL;
  kvf_geometry_error err;
  kvf_geometry_load_options opt = KVF_GEOMETRY_LOAD_OPTIONS_INIT;
  opt.num_blocks_override = 4;
  *out = NULL;
  if (kvf_geometry_load_file(path, &opt, &g, &err)) {
    fprintf(stderr, "kvferry demo: %s: %s\n", path, kvf_last_error());
    return -1;
  }
  uint64_t need = 0;
  for (uint32_t i = 0; i < kvf_geometry_num_groups(g); i++) {
    kvf_group_info gi = KVF_GROUP_INFO_INIT;
    kvf_geometry_group(g, i, &gi);
    uint64_t first, end;
    if (gi.kind == KVF_GROUP_RECURRENT)
      need += 1;
    else if (!kvf_geometry_retained_blocks(g, i, tokens, &first, &end))
      need += end - first;
  }
  kvf_geometry_destroy(g);
  g = NULL;
  *num_blocks = (uint32_t)(need + need / 8 + 8);
  opt.num_blocks_override = *num_blocks;
  if (kvf_geometry_load_file(path, &opt, &g, &err)) {
    fprintf(stderr, "kvferry demo: %s with %u blocks: %s\n", path, *num_blocks, kvf_last_error());
    return -1;
  }
  *out = g;
  return 0;
}

uint32_t *demo_pool_make(uint32_t num_blocks, uint64_t seed) {
  uint32_t *pool = malloc(sizeof *pool * (num_blocks ? num_blocks : 1));
  if (!pool) return NULL;
  for (uint32_t i = 0; i < num_blocks; i++) pool[i] = i;
  uint64_t rng = seed;
  for (uint32_t i = num_blocks ? num_blocks - 1 : 0; i > 0; i--) {
    uint32_t j = (uint32_t)(splitmix(&rng) % (i + 1)), x = pool[i];
    pool[i] = pool[j];
    pool[j] = x;
  }
  return pool;
}
