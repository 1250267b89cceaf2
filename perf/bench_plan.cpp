/* perf/bench_plan.cpp - block tables, object layout and run lists of a
 * benchmark request (see bench_plan.h). */
#include "bench_plan.h"

#include <algorithm>
#include <cstring>
#include <numeric>

namespace kvfb {

uint64_t splitmix64(uint64_t *s) {
  uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

std::vector<uint32_t> plan_pool(uint32_t n, uint64_t seed) {
  std::vector<uint32_t> pool(n);
  std::iota(pool.begin(), pool.end(), 0u);
  for (uint32_t i = n ? n - 1 : 0; i > 0; i--) {
    uint32_t j = (uint32_t)(splitmix64(&seed) % (i + 1));
    std::swap(pool[i], pool[j]);
  }
  return pool;
}

/* Local block range a store of `tokens` moves for group gi; false: none. */
static bool group_range(const kvf_geometry *g, uint32_t gi, uint64_t tokens, uint64_t *first, uint64_t *end) {
  kvf_group_info info = KVF_GROUP_INFO_INIT;
  if (kvf_geometry_group(g, gi, &info)) return false;
  if (info.kind == KVF_GROUP_RECURRENT) {
    uint64_t chunk;
    if (kvf_geometry_recurrent_state(g, tokens, &chunk)) return false; /* no state off a chunk boundary */
    *first = chunk;
    *end = chunk + 1;
    return true;
  }
  if (kvf_geometry_retained_blocks(g, gi, tokens, first, end)) return false;
  return *end > *first;
}

uint64_t plan_blocks_needed(const kvf_geometry *g, uint64_t tokens) {
  uint64_t n = 0;
  for (uint32_t gi = 0; gi < kvf_geometry_num_groups(g); gi++) {
    uint64_t first, end;
    if (group_range(g, gi, tokens, &first, &end)) n += end - first;
  }
  return n;
}

bool plan_tables(const kvf_geometry *g, uint64_t tokens, const std::vector<uint32_t> &pool, size_t *next,
                 Tables *out) {
  uint32_t ng = kvf_geometry_num_groups(g);
  out->ids.assign(ng, {});
  out->groups.assign(ng, kvf_group_blocks{nullptr, 0, 0});
  out->blocks = 0;
  for (uint32_t gi = 0; gi < ng; gi++) {
    uint64_t first, end;
    if (!group_range(g, gi, tokens, &first, &end)) continue;
    if (pool.size() - *next < end - first) return false;
    out->ids[gi].assign(pool.begin() + (ptrdiff_t)*next, pool.begin() + (ptrdiff_t)(*next + (end - first)));
    *next += end - first;
    out->blocks += end - first;
  }
  for (uint32_t gi = 0; gi < ng; gi++) {
    if (out->ids[gi].empty()) continue;
    uint64_t first, end;
    group_range(g, gi, tokens, &first, &end);
    out->groups[gi] = kvf_group_blocks{out->ids[gi].data(), first, (uint32_t)out->ids[gi].size()};
  }
  return true;
}

/* Block id of local block `lb` of group gi in the request, or KVF_BLOCK_SKIP. */
static uint32_t block_for(const kvf_copy_request *r, uint32_t gi, uint64_t lb) {
  const kvf_group_blocks &b = r->groups[gi];
  if (!b.block_ids || b.count == 0 || lb < b.first_block || lb - b.first_block >= b.count) return KVF_BLOCK_SKIP;
  return b.block_ids[lb - b.first_block];
}

static void chunk_range(uint64_t C, const kvf_copy_request *r, uint64_t k, uint64_t *cb, uint64_t *ce) {
  *cb = r->token_begin + k * C;
  *ce = r->token_end - *cb > C ? *cb + C : r->token_end;
}

/* The reference's rule: does chunk k move any block of group gi? */
static bool chunk_moves_group(const kvf_geometry *g, const kvf_copy_request *r, uint32_t gi, uint64_t k) {
  kvf_group_info info = KVF_GROUP_INFO_INIT;
  kvf_object_policy pol = KVF_OBJECT_POLICY_INIT;
  kvf_geometry_group(g, gi, &info);
  kvf_geometry_policy(g, &pol);
  const kvf_group_blocks &b = r->groups[gi];
  if (!b.block_ids || b.count == 0) return false;
  uint64_t cb, ce, C = pol.chunk_tokens;
  chunk_range(C, r, k, &cb, &ce);
  if (info.kind == KVF_GROUP_RECURRENT) return ce - cb == C && block_for(r, gi, cb / C) != KVF_BLOCK_SKIP;
  uint64_t lb = kvf_geometry_local_tokens(g, cb), le = kvf_geometry_local_tokens(g, ce), bs = info.block_size;
  for (uint64_t blk = lb / bs; blk * bs < le; blk++)
    if (block_for(r, gi, blk) != KVF_BLOCK_SKIP) return true;
  return false;
}

bool plan_objects(const kvf_geometry *g, uint64_t tokens, const Tables &t, uint64_t align, ObjectLayout *out) {
  kvf_object_policy pol = KVF_OBJECT_POLICY_INIT;
  kvf_geometry_policy(g, &pol);
  kvf_copy_request req = KVF_COPY_REQUEST_INIT;
  req.token_begin = 0;
  req.token_end = tokens;
  req.groups = t.groups.data();
  out->chunks = (tokens + pol.chunk_tokens - 1) / pol.chunk_tokens;
  out->num_object_groups = kvf_geometry_num_object_groups(g);
  out->offset.assign(out->chunks * out->num_object_groups, UINT64_MAX);
  out->size.assign(out->chunks * out->num_object_groups, 0);
  out->span = 0;
  out->objects = 0;
  uint32_t ng = kvf_geometry_num_groups(g);
  for (uint64_t k = 0; k < out->chunks; k++)
    for (uint32_t gi = 0; gi < ng; gi++) {
      kvf_group_info info = KVF_GROUP_INFO_INIT;
      kvf_geometry_group(g, gi, &info);
      size_t idx = k * out->num_object_groups + info.object_group;
      if (out->offset[idx] != UINT64_MAX || !chunk_moves_group(g, &req, gi, k)) continue;
      uint64_t bytes;
      if (kvf_geometry_object_size(g, info.object_group, k, tokens, &bytes)) return false;
      out->offset[idx] = out->span;
      out->size[idx] = bytes;
      out->span += (std::max<uint64_t>(bytes, 1) + align - 1) / align * align;
      out->objects++;
    }
  return true;
}

std::vector<void *> plan_object_pointers(const ObjectLayout &layout, char *arena) {
  std::vector<void *> p(layout.offset.size(), nullptr);
  for (size_t i = 0; i < p.size(); i++)
    if (layout.offset[i] != UINT64_MAX) p[i] = arena + layout.offset[i];
  return p;
}

namespace {

struct Emitter {
  Runs *out;
  bool gather;
  void add(char *cache, char *object, uint64_t len) {
    const void *s = gather ? cache : object;
    void *d = gather ? object : cache;
    out->raw_runs++;
    out->bytes += len;
    if (!out->size.empty()) {
      size_t i = out->size.size() - 1;
      if ((const char *)out->src[i] + out->size[i] == s && (char *)out->dst[i] + out->size[i] == d) {
        out->size[i] += len;
        return;
      }
    }
    out->src.push_back(s);
    out->dst.push_back(d);
    out->size.push_back(len);
  }
};

/* A run of a block in native order: its place among the block's runs sorted
 * by cache address. */
struct NativeRun {
  uint64_t addr;  /* from the block start */
  uint32_t plane, token, head;
  uint64_t len;
};

} // namespace

bool plan_runs(const kvf_geometry *g, const kvf_copy_request *r, bool gather, Runs *out, std::string *error) {
  *out = Runs{};
  kvf_object_policy pol = KVF_OBJECT_POLICY_INIT;
  kvf_geometry_policy(g, &pol);
  uint64_t C = pol.chunk_tokens;
  uint64_t chunks = kvf_copy_request_chunks(g, r);
  uint32_t nog = kvf_geometry_num_object_groups(g);
  Emitter em{out, gather};
  for (uint32_t gi = 0; gi < kvf_geometry_num_groups(g); gi++) {
    kvf_group_info info = KVF_GROUP_INFO_INIT;
    kvf_geometry_group(g, gi, &info);
    const kvf_group_blocks &gb = r->groups[gi];
    if (!gb.block_ids || gb.count == 0) continue;
    for (uint64_t k = 0; k < chunks; k++) {
      if (!chunk_moves_group(g, r, gi, k)) continue;
      char *object = (char *)r->objects[k * nog + info.object_group];
      if (!object) {
        *error = "objects[" + std::to_string(k * nog + info.object_group) + "] is NULL";
        return false;
      }
      uint64_t cb, ce;
      chunk_range(C, r, k, &cb, &ce);
      uint64_t lb = kvf_geometry_local_tokens(g, cb), le = kvf_geometry_local_tokens(g, ce), n = le - lb;
      for (uint32_t l = 0; l < info.num_layers; l++) {
        kvf_view_desc v = KVF_VIEW_DESC_INIT;
        kvf_geometry_view(g, gi, l, &v);
        char *base = (char *)r->region_bases[v.region];
        if (!base) {
          *error = "region_bases[" + std::to_string(v.region) + "] is NULL";
          return false;
        }
        if (info.kind == KVF_GROUP_RECURRENT) {
          if (ce - cb != C) continue;
          uint32_t id = block_for(r, gi, cb / C);
          if (id == KVF_BLOCK_SKIP) continue;
          uint64_t seg, at = 0;
          kvf_geometry_object_segment(g, r->format, gi, l, 0, n, &seg, nullptr);
          char *slot = base + v.offset + (uint64_t)id * v.block_stride;
          for (uint32_t s = 0; s < v.num_states; s++) {
            em.add(slot + v.states[s].offset, object + seg + at, v.states[s].bytes);
            at += v.states[s].bytes;
          }
          continue;
        }
        uint64_t bs = info.block_size;
        if (r->format == KVF_FORMAT_CANONICAL) {
          /* Object order: plane, token, head. */
          for (uint32_t p = 0; p < v.planes; p++) {
            uint64_t seg;
            kvf_geometry_object_segment(g, r->format, gi, l, p, n, &seg, nullptr);
            for (uint64_t lt = lb; lt < le; lt++) {
              uint32_t id = block_for(r, gi, lt / bs);
              if (id == KVF_BLOCK_SKIP) continue;
              uint64_t t = lt % bs, i = lt - lb;
              for (uint32_t h = 0; h < v.heads; h++)
                em.add(base + v.offset + (uint64_t)id * v.block_stride + p * v.plane_stride + t * v.token_stride +
                           h * v.head_stride,
                       object + seg + (i * v.heads + h) * v.head_bytes[p], v.head_bytes[p]);
            }
          }
        } else {
          /* Native: each block's runs in cache address order, blocks in token order. */
          std::vector<NativeRun> runs;
          runs.reserve((size_t)v.planes * bs * v.heads);
          uint64_t payload = 0;
          for (uint32_t p = 0; p < v.planes; p++)
            for (uint64_t t = 0; t < bs; t++)
              for (uint32_t h = 0; h < v.heads; h++) {
                runs.push_back(NativeRun{p * v.plane_stride + t * v.token_stride + h * v.head_stride, p, (uint32_t)t,
                                         h, v.head_bytes[p]});
                payload += v.head_bytes[p];
              }
          std::stable_sort(runs.begin(), runs.end(),
                           [](const NativeRun &a, const NativeRun &b) { return a.addr < b.addr; });
          uint64_t seg;
          kvf_geometry_object_segment(g, r->format, gi, l, 0, n, &seg, nullptr);
          for (uint64_t blk = lb / bs; blk * bs < le; blk++) {
            uint32_t id = block_for(r, gi, blk);
            if (id == KVF_BLOCK_SKIP) continue;
            uint64_t at = 0;
            for (const NativeRun &nr : runs) {
              uint64_t lt = blk * bs + nr.token;
              if (lt >= lb && lt < le) {
                uint64_t i = lt - lb;
                em.add(base + v.offset + (uint64_t)id * v.block_stride + nr.addr,
                       object + seg + (i / bs) * payload + at, nr.len);
              }
              at += nr.len;
            }
          }
        }
      }
    }
  }
  return true;
}

Runs plan_sample(const Runs &all, size_t max_runs, double *fraction) {
  if (all.count() <= max_runs || max_runs == 0) {
    *fraction = 1.0;
    return all;
  }
  Runs s;
  size_t stride = (all.count() + max_runs - 1) / max_runs;
  for (size_t i = 0; i < all.count(); i += stride) {
    s.src.push_back(all.src[i]);
    s.dst.push_back(all.dst[i]);
    s.size.push_back(all.size[i]);
    s.bytes += all.size[i];
  }
  s.raw_runs = s.count();
  *fraction = all.bytes ? (double)s.bytes / (double)all.bytes : 1.0;
  return s;
}

} // namespace kvfb
