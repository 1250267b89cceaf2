/* perf/kvf_copy_probe.cu - how close a plain copy kernel gets to memcpy, per call.
 *
 * kvferry's device-to-device launch of one chunk runs at 72-87% of a
 * cudaMemcpyAsync of the same bytes when each call is timed alone (events
 * around it), though its kernel alone takes about memcpy's time. This asks
 * what any kernel pays: contiguous copies of the request sizes of the
 * presets' one-chunk rows, by kernels of the shapes kvferry uses and a few
 * others, none of them decoding a table, against memcpy, each call between
 * two events, back to back behind a spin kernel (kvf_bench's per-call
 * measure), and over buffer sets rotated so that L2 holds none of a call's
 * bytes. Last, the same tasks reading a request's blocks scattered over a
 * large cache through one table read (in device memory or in 2, 12 or 32
 * KiB of kernel parameters): what the scatter and the table cost any copy.
 * Medians of 200 calls; one line of text per figure and one JSON object per
 * figure with --json FILE. */
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdint>
#include <vector>

#include "probe_util.cuh"

namespace {

constexpr int kDepth = 8;  // 16-byte loads in flight per lane before its stores: 4 KiB a warp

// One round of a lane: units base + lane + 32*i (i < kDepth) below end,
// every load before the first store.
__device__ __forceinline__ void copy_round(const uint4 *__restrict__ src, uint4 *__restrict__ dst, size_t base,
                                           size_t end, size_t lane) {
  uint4 v[kDepth];
#pragma unroll
  for (int i = 0; i < kDepth; i++) {
    size_t u = base + i * 32 + lane;
    if (u < end) v[i] = src[u];
  }
#pragma unroll
  for (int i = 0; i < kDepth; i++) {
    size_t u = base + i * 32 + lane;
    if (u < end) dst[u] = v[i];
  }
}

// Warp w copies rounds w, w + W, ... of 4 KiB (the last may be short).
__global__ void persistent_copy(const uint4 *__restrict__ src, uint4 *__restrict__ dst, size_t units) {
  const size_t lane = threadIdx.x & 31, warps = (size_t)gridDim.x * (blockDim.x / 32);
  const size_t round = 32 * kDepth;
  for (size_t base = ((size_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32) * round; base < units;
       base += warps * round)
    copy_round(src, dst, base, units, lane);
}

// Warp w copies its own task of `task` units from unit `begin` + w * task,
// in 4 KiB rounds.
__device__ __forceinline__ void copy_task(const uint4 *__restrict__ src, uint4 *__restrict__ dst, size_t units,
                                          size_t task, size_t begin) {
  const size_t lane = threadIdx.x & 31;
  begin += ((size_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32) * task;
  const size_t end = begin + task < units ? begin + task : units;
  for (size_t base = begin; base < end; base += 32 * kDepth) copy_round(src, dst, base, end, lane);
}

// A task a warp: as many CTAs as tasks need, which the GPU hands out as SMs
// free up.
__global__ void task_copy(const uint4 *__restrict__ src, uint4 *__restrict__ dst, size_t units, size_t task) {
  copy_task(src, dst, units, task, 0);
}

// The same tasks after a chain of `hops` dependent 4-byte reads of a table,
// each index read from the last (kvferry's walk reads header, bucket,
// entry, id and shape, object before its first data load): from the
// kernel's parameters, as kvferry's one-chunk launches carry their tables,
// or from device memory.
constexpr int kChainWords = 1024;  // 4 KiB of table: a one-chunk blob is 4.7-11.5 KB
struct alignas(16) ChainParams {
  uint32_t next[kChainWords];
};

__device__ __forceinline__ uint32_t chase(const uint32_t *table, uint32_t at, int hops) {
  for (int h = 0; h < hops; h++) at = table[at];
  return at;
}

__global__ void chain_param_copy(const __grid_constant__ ChainParams p, const uint4 *__restrict__ src,
                                 uint4 *__restrict__ dst, size_t units, size_t task, int hops) {
  const uint32_t warp = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  // The chain's end is never kChainWords: the tasks are the plain ones, after the chain.
  copy_task(src, dst, units, task, chase(p.next, warp % kChainWords, hops) == kChainWords);
}

__global__ void chain_global_copy(const uint32_t *__restrict__ table, const uint4 *__restrict__ src,
                                  uint4 *__restrict__ dst, size_t units, size_t task, int hops) {
  const uint32_t warp = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  copy_task(src, dst, units, task, chase(table, warp % kChainWords, hops) == kChainWords);
}

// 8 KiB tasks whose source is a request's blocks, each `block` units long
// and placed where its table says inside a large cache (the cache side of
// kvferry's one-chunk copy: a few hundred blocks at the engine's block ids),
// the destination contiguous. One read of the table (device memory) before
// the first load; a task never crosses a block (task divides block).
__device__ __forceinline__ void copy_scattered(const uint64_t *block_at, const char *__restrict__ cache,
                                               uint4 *__restrict__ dst, size_t units, size_t task, size_t block) {
  const size_t lane = threadIdx.x & 31;
  const size_t begin = ((size_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32) * task;
  if (begin >= units) return;
  const size_t end = begin + task < units ? begin + task : units, b = begin / block;
  // src[u] is unit u - b*block of block b.
  const uint4 *src = reinterpret_cast<const uint4 *>(cache + block_at[b]) - b * block;
  for (size_t base = begin; base < end; base += 32 * kDepth) copy_round(src, dst, base, end, lane);
}

__global__ void scattered_copy(const uint64_t *__restrict__ block_at, const char *__restrict__ cache,
                               uint4 *__restrict__ dst, size_t units, size_t task, size_t block) {
  copy_scattered(block_at, cache, dst, units, task, block);
}

// The same with the block table in the kernel's parameters (N bytes of
// them, as kvferry's one-chunk launches carry their tables): what a large
// parameter block costs a call, against the table in device memory.
template <int N> struct alignas(16) ParamTable {
  uint64_t at[N / 8];
};

template <int N>
__global__ void scattered_copy_p(const __grid_constant__ ParamTable<N> t, const char *__restrict__ cache,
                                 uint4 *__restrict__ dst, size_t units, size_t task, size_t block) {
  copy_scattered(t.at, cache, dst, units, task, block);
}

FILE *g_json;

void report(const char *what, size_t bytes, double us, double memcpy_us) {
  printf("%-36s %9zu B  %8.2f us  %6.1f%% of memcpy\n", what, bytes, us, 100.0 * memcpy_us / us);
  if (g_json)
    fprintf(g_json, "{\"what\": \"%s\", \"bytes\": %zu, \"median_us\": %.3f, \"memcpy_us\": %.3f}\n", what, bytes, us,
            memcpy_us);
}

}  // namespace

int main(int argc, char **argv) {
  if (int rc = probe_args(argc, argv, "kvf_copy_probe", &g_json)) return rc;
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  /* 8 sets of 34 MiB each way: 544 MiB, ten times L2. */
  constexpr int kSets = 8;
  constexpr size_t kSetBytes = 34u << 20;
  std::vector<uint4 *> src(kSets), dst(kSets);
  for (int i = 0; i < kSets; i++) {
    CK(cudaMalloc(&src[i], kSetBytes));
    CK(cudaMalloc(&dst[i], kSetBytes));
    CK(cudaMemset(src[i], i + 1, kSetBytes));
  }
  static ChainParams chain;
  for (int i = 0; i < kChainWords; i++) chain.next[i] = (uint32_t)((i * 389u + 17u) % kChainWords);
  uint32_t *chain_dev;
  CK(cudaMalloc(&chain_dev, sizeof chain));
  CK(cudaMemcpy(chain_dev, &chain, sizeof chain, cudaMemcpyHostToDevice));
  std::vector<cudaEvent_t> ev(400);
  for (auto &e : ev) CK(cudaEventCreate(&e));
  /* One chunk of the presets: MLA DCP rank, MLA fp8, qwen3-like, MLA bf16, the tp4 slice, Llama 8B. */
  const size_t sizes[] = {4498944, 10240000, 16564224, 17989632, 20971520, 33554432};
  for (size_t bytes : sizes) {
    const size_t units = bytes / 16;
    double mc = probe_gpu_us(s, ev, [&](int i) {
      CK(cudaMemcpyAsync(dst[i % kSets], src[i % kSets], bytes, cudaMemcpyDeviceToDevice, s));
    });
    report("cudaMemcpyAsync D2D", bytes, mc, mc);
    struct Persistent {
      const char *name;
      int threads, per_sm;
    };
    for (Persistent p : {Persistent{"persistent 1x512 per SM", 512, 1}, Persistent{"persistent 4x128 per SM", 128, 4},
                         Persistent{"persistent 2x512 per SM", 512, 2}, Persistent{"persistent 8x128 per SM", 128, 8}}) {
      double us = probe_gpu_us(s, ev, [&](int i) {
        persistent_copy<<<sms * p.per_sm, p.threads, 0, s>>>(src[i % kSets], dst[i % kSets], units);
      });
      report(p.name, bytes, us, mc);
    }
    for (int hops : {0, 2, 4, 6}) {
      const size_t task = (8u << 10) / 16, warps = (units + task - 1) / task;
      const unsigned grid = (unsigned)((warps + 3) / 4);
      char name[64];
      snprintf(name, sizeof name, "8 KiB tasks after %d param hops", hops);
      double us = probe_gpu_us(s, ev, [&](int i) {
        chain_param_copy<<<grid, 128, 0, s>>>(chain, src[i % kSets], dst[i % kSets], units, task, hops);
      });
      report(name, bytes, us, mc);
      snprintf(name, sizeof name, "8 KiB tasks after %d global hops", hops);
      us = probe_gpu_us(s, ev, [&](int i) {
        chain_global_copy<<<grid, 128, 0, s>>>(chain_dev, src[i % kSets], dst[i % kSets], units, task, hops);
      });
      report(name, bytes, us, mc);
    }
    for (size_t task_kib : {4, 8, 16, 32}) {
      const size_t task = (task_kib << 10) / 16, warps = (units + task - 1) / task;
      char name[64];
      snprintf(name, sizeof name, "tasks of %zu KiB, 128-thread CTAs", task_kib);
      double us = probe_gpu_us(s, ev, [&](int i) {
        task_copy<<<(unsigned)((warps + 3) / 4), 128, 0, s>>>(src[i % kSets], dst[i % kSets], units, task);
      });
      report(name, bytes, us, mc);
    }
  }
  /* Scattered blocks: the MLA chunk (244 blocks of 72 KiB), the DCP rank's
   * (61) and Llama's (1024 of 32 KiB) read from blocks at random places of
   * a 4 GiB cache (a different draw per set), of a 512 MiB one, and back to
   * back in block order, against memcpy of as many contiguous bytes. What
   * the cache's scatter costs a plain copy, apart from any table walk. */
  constexpr size_t kCacheBytes = 4ull << 30, kSmallCache = 512ull << 20;
  char *cache;
  CK(cudaMalloc(&cache, kCacheBytes));
  CK(cudaMemset(cache, 7, kCacheBytes));
  struct Scatter {
    size_t bytes, block_bytes;
  };
  uint64_t rng = 0x9e3779b97f4a7c15ull;
  auto next = [&rng]() {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
  };
  for (Scatter sc : {Scatter{17989632, 73728}, Scatter{4498944, 73728}, Scatter{33554432, 32768}}) {
    const size_t units = sc.bytes / 16, block = sc.block_bytes / 16, nblocks = sc.bytes / sc.block_bytes;
    const size_t task = (8u << 10) / 16, warps = (units + task - 1) / task;
    const unsigned grid = (unsigned)((warps + 3) / 4);
    double mc = probe_gpu_us(s, ev, [&](int i) {
      CK(cudaMemcpyAsync(dst[i % kSets], src[i % kSets], sc.bytes, cudaMemcpyDeviceToDevice, s));
    });
    report("cudaMemcpyAsync D2D", sc.bytes, mc, mc);
    struct Placement {
      const char *name;
      size_t span;  // 0: back to back
    };
    for (Placement pl : {Placement{"back to back", 0}, Placement{"random in 512 MiB", kSmallCache},
                         Placement{"random in 4 GiB", kCacheBytes}}) {
      /* Per set, distinct slots (a block never read twice in one call). */
      std::vector<uint64_t *> tables(kSets);
      std::vector<std::vector<uint64_t>> host(kSets, std::vector<uint64_t>(nblocks));
      for (int k = 0; k < kSets; k++) {
        std::vector<uint64_t> &at = host[k];
        const size_t slots = pl.span ? pl.span / sc.block_bytes : nblocks;
        std::vector<size_t> pick;
        while (pick.size() < nblocks) {
          size_t slot = pl.span ? (size_t)(next() % slots) : pick.size();
          if (std::find(pick.begin(), pick.end(), slot) == pick.end()) pick.push_back(slot);
        }
        // Back to back: each set its own stretch of the cache.
        for (size_t b = 0; b < nblocks; b++)
          at[b] = (pl.span ? 0 : (uint64_t)k * sc.bytes) + (uint64_t)pick[b] * sc.block_bytes;
        CK(cudaMalloc(&tables[k], nblocks * sizeof(uint64_t)));
        CK(cudaMemcpy(tables[k], at.data(), nblocks * sizeof(uint64_t), cudaMemcpyHostToDevice));
      }
      char name[96];
      snprintf(name, sizeof name, "8 KiB tasks, %zu KiB blocks %s", sc.block_bytes >> 10, pl.name);
      double us = probe_gpu_us(s, ev, [&](int i) {
        scattered_copy<<<grid, 128, 0, s>>>(tables[i % kSets], cache, dst[i % kSets], units, task, block);
      });
      report(name, sc.bytes, us, mc);
      if (pl.span == kSmallCache) {
        /* The table in 2 KiB, 12 KiB and 32 KiB of parameters, where it fits. */
        auto in_params = [&](auto table, const char *kib) {
          constexpr size_t cap = sizeof table.at / sizeof table.at[0];
          if (nblocks > cap) return;
          snprintf(name, sizeof name, "8 KiB tasks, %zu KiB blocks %s, table in %s KiB params", sc.block_bytes >> 10,
                   pl.name, kib);
          double t_us = probe_gpu_us(s, ev, [&](int i) {
            std::copy(host[i % kSets].begin(), host[i % kSets].end(), table.at);
            scattered_copy_p<(int)sizeof table><<<grid, 128, 0, s>>>(table, cache, dst[i % kSets], units, task, block);
          });
          report(name, sc.bytes, t_us, mc);
        };
        in_params(ParamTable<2048>{}, "2");
        in_params(ParamTable<12288>{}, "12");
        in_params(ParamTable<32704>{}, "32");
      }
      for (uint64_t *t : tables) CK(cudaFree(t));
    }
  }
  CK(cudaFree(cache));
  CK(cudaDeviceSynchronize());
  if (g_json) fclose(g_json);
  return 0;
}
