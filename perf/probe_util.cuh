/* perf/probe_util.cuh - what the standalone probes (kvf_param_probe,
 * kvf_hop_probe) share: a CUDA call checked with the failing expression
 * named, and a kernel that holds a stream for a while so the reps queued
 * behind it run back to back with their host enqueue hidden. */
#ifndef KVF_PERF_PROBE_UTIL_CUH
#define KVF_PERF_PROBE_UTIL_CUH

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#define CK(x)                                                                              \
  do {                                                                                     \
    cudaError_t e_ = (x);                                                                  \
    if (e_ != cudaSuccess) {                                                               \
      fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      exit(1);                                                                             \
    }                                                                                      \
  } while (0)

/* Spins one thread for ns nanoseconds of the GPU's global timer. */
static __global__ void spin_kernel(unsigned long long ns) {
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); while (t - t0 < ns);
}

#endif
