/* perf/kvf_bulk_probe.cu - whether Hopper's bulk copies beat warps of
 * 16-byte loads and stores for device-to-device copies, per call.
 *
 * kvferry's walk (kernels/walk.h) copies a linear block with each lane
 * loading 8 units of 16 bytes and then storing them: 4 KiB a warp in flight.
 * At 4096 tokens its device-to-device rows reach 90.5-91.4% of a
 * cudaMemcpyAsync of the same bytes on four presets (the target is 92%),
 * and a plain copy kernel of that form, with no table, reached 89-92% on
 * one-chunk sizes (perf/results/2026-12-02-h200-d2d-start). This asks
 * whether another instruction form gets closer to memcpy on the same
 * contiguous bytes: the same loads with cache hints, deeper loads, and
 * sm_90's bulk copies (cp.async.bulk: one lane asks the SM's copy unit to
 * bring a range into shared memory, completing on an mbarrier, then to write
 * it out), in tasks a warp and in a persistent ring. Each call between two
 * events, back to back behind a spin kernel (probe_gpu_us), over buffer sets
 * rotated so that L2 holds none of a call's bytes; medians of 200 calls;
 * one line of text per figure, one JSON object per figure with --json FILE.
 * Every variant's output is compared with its source once per size. */
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <vector>

#include "probe_util.cuh"

namespace {

// ---- warps of 16-byte loads and stores (the walk's linear form) ----

enum class Hint { kNone, kStreaming, kNoL1 };

template <Hint H> __device__ __forceinline__ uint4 load16(const uint4 *p) {
  if constexpr (H == Hint::kStreaming) return __ldcs(p);
  if constexpr (H == Hint::kNoL1) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
  }
  return *p;
}

template <Hint H> __device__ __forceinline__ void store16(uint4 *p, uint4 v) {
  if constexpr (H == Hint::kStreaming)
    __stcs(p, v);
  else
    *p = v;
}

// Warp w copies units [w*task, (w+1)*task) in rounds of D units a lane,
// every load of a round before its first store.
template <int D, Hint H>
__global__ void task_copy(const uint4 *__restrict__ src, uint4 *__restrict__ dst, size_t units, size_t task) {
  const size_t lane = threadIdx.x & 31;
  const size_t begin = ((size_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32) * task;
  if (begin >= units) return;
  const size_t end = begin + task < units ? begin + task : units;
  for (size_t base = begin; base < end; base += 32 * D) {
    uint4 v[D];
#pragma unroll
    for (int i = 0; i < D; i++) {
      size_t u = base + i * 32 + lane;
      if (u < end) v[i] = load16<H>(src + u);
    }
#pragma unroll
    for (int i = 0; i < D; i++) {
      size_t u = base + i * 32 + lane;
      if (u < end) store16<H>(dst + u, v[i]);
    }
  }
}

// ---- bulk copies through shared memory (sm_90) ----

__device__ __forceinline__ uint32_t smem_addr(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void bar_init(uint64_t *bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(bar)) : "memory");
}

// The barriers' initialisation made visible to the copy unit (the async proxy).
__device__ __forceinline__ void bar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }

// One arrival expecting `bytes` of transfer, then the load that brings them.
__device__ __forceinline__ void bulk_load(void *smem, const void *src, uint32_t bytes, uint64_t *bar) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_addr(smem)),
               "l"(src), "r"(bytes), "r"(smem_addr(bar))
               : "memory");
}

__device__ __forceinline__ void bar_wait(uint64_t *bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra.uni WAIT;\n"
      "}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}

__device__ __forceinline__ void bulk_store(void *dst, const void *smem, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(smem_addr(smem)),
               "r"(bytes)
               : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

// Until at most N of this thread's store groups still read shared memory.
template <int N> __device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

// Chunks c0, c0 + step, ... below n_chunks of `chunk` bytes (the last may
// be short) through S buffers of shared memory, by the calling thread
// alone: S loads in flight, each chunk stored as soon as it is in, its
// buffer refilled once the store has read it.
template <int S>
__device__ __forceinline__ void bulk_chunks(const char *src, char *dst, size_t bytes, uint32_t chunk, size_t c0,
                                            size_t step, size_t n_chunks, char *buf, uint64_t *bar) {
  for (int i = 0; i < S; i++) bar_init(&bar[i]);
  bar_init_fence();
  auto len_of = [&](size_t c) { return (uint32_t)(bytes - c * chunk < chunk ? bytes - c * chunk : chunk); };
  size_t issued = c0;
  for (int i = 0; i < S && issued < n_chunks; i++, issued += step)
    bulk_load(buf + (size_t)i * chunk, src + issued * chunk, len_of(issued), &bar[i]);
  uint32_t k = 0;
  for (size_t c = c0; c < n_chunks; c += step, k++) {
    const uint32_t s = k % S;
    bar_wait(&bar[s], (k / S) & 1);
    bulk_store(dst + c * chunk, buf + (size_t)s * chunk, len_of(c));
    if (issued < n_chunks) {
      bulk_wait_read<0>();
      bulk_load(buf + (size_t)s * chunk, src + issued * chunk, len_of(issued), &bar[s]);
      issued += step;
    }
  }
  bulk_wait_all();
}

// Lane 0 of each warp: a task of `task_chunks` consecutive chunks
// (tasks = warps), or (persistent) chunks w, w + W, ... of the whole copy.
template <int S>
__global__ void bulk_copy(const char *__restrict__ src, char *__restrict__ dst, size_t bytes, uint32_t chunk,
                          size_t task_chunks, int persistent) {
  extern __shared__ __align__(128) char smem[];
  __shared__ __align__(8) uint64_t bars[32][S];
  const uint32_t warp = threadIdx.x / 32, warps_per_cta = blockDim.x / 32;
  if ((threadIdx.x & 31) != 0) return;
  const size_t n_chunks = (bytes + chunk - 1) / chunk;
  const size_t w = (size_t)blockIdx.x * warps_per_cta + warp;
  char *buf = smem + (size_t)warp * S * chunk;
  if (persistent) {
    bulk_chunks<S>(src, dst, bytes, chunk, w, (size_t)gridDim.x * warps_per_cta, n_chunks, buf, bars[warp]);
  } else {
    const size_t c0 = w * task_chunks, c1 = c0 + task_chunks < n_chunks ? c0 + task_chunks : n_chunks;
    if (c0 < c1) bulk_chunks<S>(src, dst, bytes, chunk, c0, 1, c1, buf, bars[warp]);
  }
}

FILE *g_json;

void report(const char *what, size_t bytes, double us, double memcpy_us) {
  printf("%-52s %10zu B  %8.2f us  %6.1f%% of memcpy\n", what, bytes, us, 100.0 * memcpy_us / us);
  fflush(stdout);
  if (g_json)
    fprintf(g_json, "{\"what\": \"%s\", \"bytes\": %zu, \"median_us\": %.3f, \"memcpy_us\": %.3f}\n", what, bytes, us,
            memcpy_us);
}

}  // namespace

int main(int argc, char **argv) {
  if (int rc = probe_args(argc, argv, "kvf_bulk_probe", &g_json)) return rc;
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  /* 8 sets of 100 MiB each way: 1.6 GB, far more than L2. */
  constexpr int kSets = 8;
  constexpr size_t kSetBytes = 100u << 20;
  std::vector<char *> src(kSets), dst(kSets);
  for (int i = 0; i < kSets; i++) {
    CK(cudaMalloc(&src[i], kSetBytes));
    CK(cudaMalloc(&dst[i], kSetBytes));
    std::vector<uint32_t> pattern(kSetBytes / 4);
    for (size_t k = 0; k < pattern.size(); k++) pattern[k] = (uint32_t)(k * 2654435761u + i);
    CK(cudaMemcpy(src[i], pattern.data(), kSetBytes, cudaMemcpyHostToDevice));
  }
  std::vector<char> want(kSetBytes), got(kSetBytes);
  std::vector<cudaEvent_t> ev(400);
  for (auto &e : ev) CK(cudaEventCreate(&e));
  int failures = 0;
  /* Whether set 0's destination now holds its source's first `bytes`. */
  auto check = [&](const char *what, size_t bytes) {
    CK(cudaStreamSynchronize(s));
    CK(cudaMemcpy(want.data(), src[0], bytes, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(got.data(), dst[0], bytes, cudaMemcpyDeviceToHost));
    if (memcmp(want.data(), got.data(), bytes) != 0) {
      printf("MISMATCH: %s, %zu bytes\n", what, bytes);
      failures++;
    }
    CK(cudaMemset(dst[0], 0, kSetBytes));
  };
  /* One chunk of the MLA DCP rank, the MLA cache and Llama 8B; 4096-token
   * requests of 60-99 MiB (the qwen3-like, glm-like, gpt-oss-like rows). */
  const size_t sizes[] = {4498944, 17989632, 33554432, 67108864, 103809024};
  for (size_t bytes : sizes) {
    const size_t units = bytes / 16;
    double mc = probe_gpu_us(s, ev, [&](int i) {
      CK(cudaMemcpyAsync(dst[i % kSets], src[i % kSets], bytes, cudaMemcpyDeviceToDevice, s));
    });
    report("cudaMemcpyAsync D2D", bytes, mc, mc);
    auto run_task = [&](const char *name, auto kernel, size_t task_bytes) {
      const size_t task = task_bytes / 16, warps = (units + task - 1) / task;
      const unsigned grid = (unsigned)((warps + 3) / 4);
      double us = probe_gpu_us(s, ev, [&](int i) {
        kernel<<<grid, 128, 0, s>>>(reinterpret_cast<const uint4 *>(src[i % kSets]),
                                    reinterpret_cast<uint4 *>(dst[i % kSets]), units, task);
      });
      report(name, bytes, us, mc);
      kernel<<<grid, 128, 0, s>>>(reinterpret_cast<const uint4 *>(src[0]), reinterpret_cast<uint4 *>(dst[0]), units,
                                  task);
      check(name, bytes);
    };
    run_task("ldst 8 KiB tasks, depth 8 (the walk's form)", task_copy<8, Hint::kNone>, 8192);
    run_task("ldst 16 KiB tasks, depth 8", task_copy<8, Hint::kNone>, 16384);
    run_task("ldst 16 KiB tasks, depth 16", task_copy<16, Hint::kNone>, 16384);
    run_task("ldst 8 KiB tasks, depth 8, .cs loads and stores", task_copy<8, Hint::kStreaming>, 8192);
    run_task("ldst 8 KiB tasks, depth 8, nc no-L1 loads", task_copy<8, Hint::kNoL1>, 8192);
    struct Bulk {
      const char *name;
      int stages, warps_per_cta;
      uint32_t chunk;
      size_t task_chunks;  // 0: persistent, ctas_per_sm CTAs an SM
      int ctas_per_sm;
    };
    const Bulk bulks[] = {
        {"bulk 8 KiB tasks, 2 x 4 KiB, 4 warps a CTA", 2, 4, 4096, 2, 0},
        {"bulk 8 KiB tasks, 1 x 8 KiB, 4 warps a CTA", 1, 4, 8192, 1, 0},
        {"bulk 16 KiB tasks, 2 x 8 KiB, 4 warps a CTA", 2, 4, 8192, 2, 0},
        {"bulk 32 KiB tasks, 4 x 8 KiB, 1 warp a CTA", 4, 1, 8192, 4, 0},
        {"bulk 64 KiB tasks, 4 x 16 KiB, 1 warp a CTA", 4, 1, 16384, 4, 0},
        {"bulk persistent, 3 x 8 KiB, 4 warps, 2 CTAs an SM", 3, 4, 8192, 0, 2},
        {"bulk persistent, 4 x 16 KiB, 1 warp, 3 CTAs an SM", 4, 1, 16384, 0, 3},
        {"bulk persistent, 2 x 16 KiB, 4 warps, 1 CTA an SM", 2, 4, 16384, 0, 1},
    };
    for (const Bulk &b : bulks) {
      const size_t smem = (size_t)b.stages * b.warps_per_cta * b.chunk;
      void (*kernel)(const char *, char *, size_t, uint32_t, size_t, int) =
          b.stages == 1 ? bulk_copy<1> : b.stages == 2 ? bulk_copy<2> : b.stages == 3 ? bulk_copy<3> : bulk_copy<4>;
      CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
      const size_t n_chunks = (bytes + b.chunk - 1) / b.chunk;
      unsigned grid;
      if (b.task_chunks) {
        const size_t warps = (n_chunks + b.task_chunks - 1) / b.task_chunks;
        grid = (unsigned)((warps + b.warps_per_cta - 1) / b.warps_per_cta);
      } else {
        grid = (unsigned)(sms * b.ctas_per_sm);
      }
      const int persistent = b.task_chunks == 0;
      double us = probe_gpu_us(s, ev, [&](int i) {
        kernel<<<grid, 32 * b.warps_per_cta, smem, s>>>(src[i % kSets], dst[i % kSets], bytes, b.chunk, b.task_chunks,
                                                        persistent);
      });
      report(b.name, bytes, us, mc);
      kernel<<<grid, 32 * b.warps_per_cta, smem, s>>>(src[0], dst[0], bytes, b.chunk, b.task_chunks, persistent);
      check(b.name, bytes);
    }
  }
  CK(cudaDeviceSynchronize());
  if (g_json) fclose(g_json);
  printf("%s\n", failures ? "FAILED: a copy did not match its source" : "every copy matched its source");
  return failures ? 1 : 0;
}
