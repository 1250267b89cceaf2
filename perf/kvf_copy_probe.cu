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
 * bytes. Medians of 200 calls; one line of text per figure and one JSON
 * object per figure with --json FILE. */
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
  CK(cudaDeviceSynchronize());
  if (g_json) fclose(g_json);
  return 0;
}
