/* perf/bench_peers.cu - the peers' designs as baselines (bench_peers.h says
 * what each is and where the facts come from). Our own code throughout. */
#include "bench_peers.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <stdexcept>


namespace kvfb {

namespace {

void ck(cudaError_t e, const char *what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string("peer: ") + what + ": " + cudaGetErrorString(e));
}

using DevEntry = PeerEntry;
using DevItem = PeerItem;
using DevTok = PeerTok;

} // namespace

struct PeerTables : PeerHostTables {
  bool host = false;
  DevEntry *d_entries = nullptr;
  DevItem *d_items = nullptr, *d_items_temp = nullptr;
  DevTok *d_toks = nullptr;
  char *temp = nullptr; /* staged design: device copies of the objects */
  std::vector<std::pair<char *, uint64_t>> objects; /* host object, bytes (staged design) */
  std::vector<uint64_t> object_temp;                 /* offset in temp */
  /* A gather leaves bytes of some host object unwritten (skipped blocks of
   * a sliding window, a partial chunk's padding): the staged design copies
   * whole objects back and would overwrite them with the temporaries'. */
  bool objects_in_part = false;
  ~PeerTables() {
    cudaFree(d_entries);
    cudaFree(d_items);
    cudaFree(d_items_temp);
    cudaFree(d_toks);
    cudaFree(temp);
  }
};

void PeerTablesDeleter::operator()(PeerTables *t) const { delete t; }

std::vector<Peer> peers_from_list(const std::string &list, int sm_count) {
  std::vector<Peer> out;
  size_t a = 0;
  while (a <= list.size()) {
    size_t b = list.find(',', a);
    if (b == std::string::npos) b = list.size();
    std::string n = list.substr(a, b - a);
    a = b + 1;
    if (n.empty()) continue;
    if (n == "all") {
      for (const char *x : {"lmcache-mp", "lmcache-mp-staged", "lmcache-legacy", "sglang-q2", "sglang-qsm"})
        for (Peer &p : peers_from_list(x, sm_count)) out.push_back(p);
    } else if (n == "lmcache-mp") {
      out.push_back({n, PeerDesign::LmcacheMp, 0});
    } else if (n == "lmcache-mp-staged") {
      out.push_back({n, PeerDesign::LmcacheMpStaged, 0});
    } else if (n == "lmcache-legacy") {
      out.push_back({n, PeerDesign::LmcacheLegacy, 0});
    } else if (n.rfind("sglang-q", 0) == 0) {
      std::string q = n.substr(8);
      int quota = q == "sm" ? sm_count : atoi(q.c_str());
      if (quota < 1) throw std::runtime_error("peers: '" + n + "' (sglang-q<N> or sglang-qsm)");
      out.push_back({"sglang-q" + std::to_string(quota), PeerDesign::Sglang, quota});
    } else if (n != "none") {
      throw std::runtime_error("peers: unknown '" + n +
                               "' (lmcache-mp, lmcache-mp-staged, lmcache-legacy, sglang-q<N>, sglang-qsm, all, none)");
    }
  }
  return out;
}

PeerTablesPtr peer_prepare(const kvf_geometry *g, const kvf_copy_request &r, bool gather, bool objects_in_host,
                           char *arena, const ObjectLayout &layout, std::string *why) {
  PeerTablesPtr t(new PeerTables);
  if (!peer_tables(g, r, gather, t.get(), why)) return nullptr;
  t->host = objects_in_host;
  ck(cudaMalloc(&t->d_entries, sizeof(DevEntry) * std::max<size_t>(t->entries.size(), 1)), "cudaMalloc");
  ck(cudaMalloc(&t->d_items, sizeof(DevItem) * std::max<size_t>(t->items.size(), 1)), "cudaMalloc");
  ck(cudaMalloc(&t->d_toks, sizeof(DevTok) * std::max<size_t>(t->toks.size(), 1)), "cudaMalloc");
  ck(cudaMemcpy(t->d_entries, t->entries.data(), sizeof(DevEntry) * t->entries.size(), cudaMemcpyHostToDevice), "copy");
  ck(cudaMemcpy(t->d_items, t->items.data(), sizeof(DevItem) * t->items.size(), cudaMemcpyHostToDevice), "copy");
  ck(cudaMemcpy(t->d_toks, t->toks.data(), sizeof(DevTok) * t->toks.size(), cudaMemcpyHostToDevice), "copy");
  if (objects_in_host) {
    /* The MP server's device temporaries: the objects' layout, rebased. */
    ck(cudaMalloc(&t->temp, std::max<uint64_t>(layout.span, 256)), "cudaMalloc temp");
    for (size_t i = 0; i < layout.offset.size(); i++)
      if (layout.offset[i] != UINT64_MAX && r.objects[i]) {
        t->objects.push_back({arena + layout.offset[i], layout.size[i]});
        t->object_temp.push_back(layout.offset[i]);
      }
    /* Bytes each object's items write, against the object's size. */
    std::vector<std::pair<uint64_t, size_t>> by_offset;
    for (size_t i = 0; i < layout.offset.size(); i++)
      if (layout.offset[i] != UINT64_MAX && r.objects[i]) by_offset.push_back({layout.offset[i], i});
    std::sort(by_offset.begin(), by_offset.end());
    std::vector<uint64_t> written(layout.offset.size(), 0);
    for (const DevItem &it : t->items) {
      uint64_t off = (uint64_t)(it.object - arena);
      auto at = std::upper_bound(by_offset.begin(), by_offset.end(), std::make_pair(off, SIZE_MAX));
      if (at == by_offset.begin()) continue;
      const DevEntry &e = t->entries[it.entry];
      written[std::prev(at)->second] += (uint64_t)it.valid * e.heads * e.head_bytes;
    }
    for (const auto &[off, i] : by_offset)
      if (written[i] < layout.size[i]) t->objects_in_part = true;
    std::vector<DevItem> rebased = t->items;
    for (DevItem &it : rebased) it.object = t->temp + (it.object - arena);
    ck(cudaMalloc(&t->d_items_temp, sizeof(DevItem) * std::max<size_t>(rebased.size(), 1)), "cudaMalloc");
    ck(cudaMemcpy(t->d_items_temp, rebased.data(), sizeof(DevItem) * rebased.size(), cudaMemcpyHostToDevice), "copy");
  }
  return t;
}

/* ---- kernels ----------------------------------------------------------------- */

namespace {

template <int U> struct U_;
template <> struct U_<16> { using T = uint4; };
template <> struct U_<8> { using T = uint2; };
template <> struct U_<4> { using T = uint32_t; };
template <> struct U_<2> { using T = uint16_t; };
template <> struct U_<1> { using T = uint8_t; };

/* LMCache's MP block kernel streams with .cs hints on 16-byte units. */
template <int U> __device__ __forceinline__ void copy_cs(void *dst, const void *src) {
  using T = typename U_<U>::T;
  if constexpr (U == 16) {
    uint4 v;
    asm volatile("ld.global.cs.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(src));
    asm volatile("st.global.cs.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(dst), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w));
  } else {
    *static_cast<T *>(dst) = *static_cast<const T *>(src);
  }
}

/* SGLang: ld.global.nc + st.global.cg on 8-byte units. */
template <int U> __device__ __forceinline__ void copy_nc_cg(void *dst, const void *src) {
  using T = typename U_<U>::T;
  if constexpr (U == 8) {
    uint64_t v;
    asm volatile("ld.global.nc.b64 %0, [%1];" : "=l"(v) : "l"(src) : "memory");
    asm volatile("st.global.cg.b64 [%0], %1;" ::"l"(dst), "l"(v) : "memory");
  } else {
    *static_cast<T *>(dst) = *static_cast<const T *>(src);
  }
}

/* One CTA per (plane, block, layer) item: x strides a head's units, y is
 * the head, z strides the block's tokens. */
template <int U, bool G>
__global__ void k_lmcache_mp(const DevEntry *E, const DevItem *I) {
  const DevItem it = I[blockIdx.x];
  const DevEntry e = E[it.entry];
  const uint32_t units = e.head_bytes / U, h = threadIdx.y;
  for (uint32_t t = threadIdx.z; t < it.valid; t += blockDim.z) {
    char *c = it.cache + t * e.src_token + h * e.src_head;
    char *o = it.object + t * e.dst_token + h * e.dst_head;
    for (uint32_t i = threadIdx.x; i < units; i += blockDim.x) {
      if (G)
        copy_cs<U>(o + i * U, c + i * U);
      else
        copy_cs<U>(c + i * U, o + i * U);
    }
  }
}

/* One CTA per (token, layer, plane): the token's row (every head) strided
 * by the CTA's threads. */
template <int U, bool G>
__global__ void k_lmcache_legacy(const DevEntry *E, const DevItem *I, uint32_t tokens) {
  const DevItem it = I[blockIdx.x / tokens];
  const uint32_t t = blockIdx.x % tokens;
  if (t >= it.valid) return;
  const DevEntry e = E[it.entry];
  const uint32_t uph = e.head_bytes / U, n = e.heads * uph;
  for (uint32_t i = threadIdx.x; i < n; i += blockDim.x) {
    uint32_t h = i / uph, k = i - h * uph;
    char *c = it.cache + t * e.src_token + h * e.src_head + k * U;
    char *o = it.object + t * e.dst_token + h * e.dst_head + k * U;
    using T = typename U_<U>::T;
    if (G)
      *reinterpret_cast<T *>(o) = *reinterpret_cast<const T *>(c);
    else
      *reinterpret_cast<T *>(c) = *reinterpret_cast<const T *>(o);
  }
}

/* One warp per token item, every layer and plane of its group in turn. */
template <int U, bool G>
__global__ void k_sglang(const DevEntry *E, const DevItem *I, const DevTok *K, uint32_t items, uint32_t per_warp) {
  const uint32_t tid = blockIdx.x * blockDim.x + threadIdx.x, lane = tid % 32, warp = tid / 32;
  const uint32_t warps = gridDim.x * blockDim.x / 32;
  for (uint32_t i = 0; i < per_warp; i++) {
    uint32_t item = i * warps + warp;
    if (item >= items) break;
    const DevTok k = K[item];
    for (uint32_t x = k.e0; x < k.e1; x++) {
      const DevEntry e = E[x];
      const DevItem it = I[e.first_item + k.j];
      const uint32_t uph = e.head_bytes / U;
      for (uint32_t h = 0; h < e.heads; h++) {
        char *c = it.cache + k.t * e.src_token + h * e.src_head;
        char *o = it.object + k.t * e.dst_token + h * e.dst_head;
        for (uint32_t u = lane; u < uph; u += 32) {
          if (G)
            copy_nc_cg<U>(o + u * U, c + u * U);
          else
            copy_nc_cg<U>(c + u * U, o + u * U);
        }
      }
    }
  }
}

template <bool G>
void launch_mp(const PeerTables &t, const DevItem *items, int unit, cudaStream_t s) {
  /* Contiguous runs of items with one block shape (K and V may differ). */
  for (size_t a = 0; a < t.items.size();) {
    const DevEntry &e0 = t.entries[t.items[a].entry];
    size_t b = a;
    while (b < t.items.size() && t.entries[t.items[b].entry].head_bytes == e0.head_bytes &&
           t.entries[t.items[b].entry].heads == e0.heads && t.entries[t.items[b].entry].tokens == e0.tokens)
      b++;
    uint32_t uph = e0.head_bytes / unit, x = std::min<uint32_t>(uph, 32), y = e0.heads;
    uint32_t z = std::min<uint32_t>(std::min<uint32_t>(e0.tokens, 1024 / (x * y)), 64);
    dim3 block(x, y, std::max<uint32_t>(z, 1));
    uint32_t n = (uint32_t)(b - a);
    switch (unit) {
      case 16: k_lmcache_mp<16, G><<<n, block, 0, s>>>(t.d_entries, items + a); break;
      case 4: k_lmcache_mp<4, G><<<n, block, 0, s>>>(t.d_entries, items + a); break;
      default: k_lmcache_mp<2, G><<<n, block, 0, s>>>(t.d_entries, items + a); break;
    }
    ck(cudaGetLastError(), "lmcache-mp launch");
    a = b;
  }
}

template <bool G>
void launch_legacy(const PeerTables &t, int unit, cudaStream_t s) {
  for (size_t a = 0; a < t.items.size();) {
    const DevEntry &e0 = t.entries[t.items[a].entry];
    size_t b = a;
    while (b < t.items.size() && t.entries[t.items[b].entry].tokens == e0.tokens &&
           t.entries[t.items[b].entry].heads * t.entries[t.items[b].entry].head_bytes == e0.heads * e0.head_bytes)
      b++;
    uint32_t words = e0.heads * e0.head_bytes / unit, threads = std::min<uint32_t>(words, 128);
    uint32_t n = (uint32_t)(b - a) * e0.tokens;
    switch (unit) {
      case 8: k_lmcache_legacy<8, G><<<n, threads, 0, s>>>(t.d_entries, t.d_items + a, e0.tokens); break;
      case 4: k_lmcache_legacy<4, G><<<n, threads, 0, s>>>(t.d_entries, t.d_items + a, e0.tokens); break;
      case 2: k_lmcache_legacy<2, G><<<n, threads, 0, s>>>(t.d_entries, t.d_items + a, e0.tokens); break;
      default: k_lmcache_legacy<1, G><<<n, threads, 0, s>>>(t.d_entries, t.d_items + a, e0.tokens); break;
    }
    ck(cudaGetLastError(), "lmcache-legacy launch");
    a = b;
  }
}

void sglang_shape(const PeerTables &t, int quota, uint32_t *ctas, uint32_t *per_warp) {
  const uint64_t n = t.toks.size(), warps_per_block = 32;
  uint64_t pw = (n + quota * warps_per_block - 1) / (quota * warps_per_block);
  if (pw == 0) pw = 1;
  *per_warp = (uint32_t)pw;
  *ctas = (uint32_t)std::max<uint64_t>(1, (n + pw * warps_per_block - 1) / (pw * warps_per_block));
}

template <bool G>
void launch_sglang(const PeerTables &t, int quota, int unit, cudaStream_t s) {
  uint32_t ctas, pw;
  sglang_shape(t, quota, &ctas, &pw);
  uint32_t n = (uint32_t)t.toks.size();
  switch (unit) {
    case 8: k_sglang<8, G><<<ctas, 1024, 0, s>>>(t.d_entries, t.d_items, t.d_toks, n, pw); break;
    case 4: k_sglang<4, G><<<ctas, 1024, 0, s>>>(t.d_entries, t.d_items, t.d_toks, n, pw); break;
    case 2: k_sglang<2, G><<<ctas, 1024, 0, s>>>(t.d_entries, t.d_items, t.d_toks, n, pw); break;
    default: k_sglang<1, G><<<ctas, 1024, 0, s>>>(t.d_entries, t.d_items, t.d_toks, n, pw); break;
  }
  ck(cudaGetLastError(), "sglang launch");
}

int mp_unit(const PeerTables &t) { return peer_mp_unit(t); }
int word_unit(const PeerTables &t) { return peer_word_unit(t); }

} // namespace

std::string peer_launch(const Peer &p, const PeerTables &t, cudaStream_t s) {
  if (t.items.empty()) return "";
  switch (p.design) {
    case PeerDesign::LmcacheMp:
    case PeerDesign::LmcacheMpStaged: {
      int unit = mp_unit(t);
      if (!unit) return "head rows not a multiple of 2 bytes";
      if (t.max_heads > 32) return "more than 32 heads";
      bool staged = p.design == PeerDesign::LmcacheMpStaged;
      if (staged && !t.host) return "objects in device memory: the staged design is for host objects";
      if (staged && t.gather && t.objects_in_part)
        return "objects written in part (skipped blocks): the staged design copies whole objects back";
      if (staged && !t.gather)
        for (size_t i = 0; i < t.objects.size(); i++)
          ck(cudaMemcpyAsync(t.temp + t.object_temp[i], t.objects[i].first, t.objects[i].second,
                             cudaMemcpyHostToDevice, s),
             "staged fill");
      const DevItem *items = staged ? t.d_items_temp : t.d_items;
      if (t.gather)
        launch_mp<true>(t, items, unit, s);
      else
        launch_mp<false>(t, items, unit, s);
      if (staged && t.gather)
        for (size_t i = 0; i < t.objects.size(); i++)
          ck(cudaMemcpyAsync(t.objects[i].first, t.temp + t.object_temp[i], t.objects[i].second,
                             cudaMemcpyDeviceToHost, s),
             "staged drain");
      return "";
    }
    case PeerDesign::LmcacheLegacy:
      if (t.gather)
        launch_legacy<true>(t, word_unit(t), s);
      else
        launch_legacy<false>(t, word_unit(t), s);
      return "";
    case PeerDesign::Sglang:
      if (t.gather)
        launch_sglang<true>(t, p.quota, word_unit(t), s);
      else
        launch_sglang<false>(t, p.quota, word_unit(t), s);
      return "";
  }
  return "unknown design";
}

std::string peer_shape(const Peer &p, const PeerTables &t) {
  char b[256];
  switch (p.design) {
    case PeerDesign::LmcacheMp:
    case PeerDesign::LmcacheMpStaged:
      snprintf(b, sizeof b, "%zu CTAs (one per layer, plane, block), %d-byte units%s", t.items.size(), mp_unit(t),
               p.design == PeerDesign::LmcacheMpStaged ? ", device temporaries + one memcpy per object" : "");
      return b;
    case PeerDesign::LmcacheLegacy: {
      uint64_t ctas = 0;
      for (const DevItem &it : t.items) ctas += t.entries[it.entry].tokens;
      snprintf(b, sizeof b, "%llu CTAs (one per token, layer, plane), %d-byte units", (unsigned long long)ctas,
               word_unit(t));
      return b;
    }
    case PeerDesign::Sglang: {
      uint32_t ctas, pw;
      sglang_shape(t, p.quota, &ctas, &pw);
      snprintf(b, sizeof b, "%u CTAs x 1024 threads, one warp per token (%zu items, %u per warp), %d-byte units", ctas,
               t.toks.size(), pw, word_unit(t));
      return b;
    }
  }
  return "";
}

} // namespace kvfb
