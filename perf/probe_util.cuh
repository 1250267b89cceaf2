/* perf/probe_util.cuh - what the standalone probes (kvf_param_probe,
 * kvf_hop_probe, kvf_copy_probe, kvf_handoff_probe) share: a CUDA call
 * checked with the failing expression named, a kernel that holds a stream
 * for a while so the reps queued behind it run back to back with their host
 * enqueue hidden, and their one option, --json FILE. */
#ifndef KVF_PERF_PROBE_UTIL_CUH
#define KVF_PERF_PROBE_UTIL_CUH

#include <cuda_runtime.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#define CK(x)                                                                              \
  do {                                                                                     \
    cudaError_t e_ = (x);                                                                  \
    if (e_ != cudaSuccess) {                                                               \
      fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      exit(1);                                                                             \
    }                                                                                      \
  } while (0)

/* The probe's arguments: nothing, or --json FILE (opened for writing into
 * *json). Returns 0, or the exit status after saying what was wrong. */
static inline int probe_args(int argc, char **argv, const char *name, FILE **json) {
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--json") != 0 || i + 1 >= argc) {
      fprintf(stderr, "usage: %s [--json FILE]\n", name);
      return 2;
    }
    if (!(*json = fopen(argv[++i], "w"))) {
      fprintf(stderr, "%s: %s: %s\n", name, argv[i], strerror(errno));
      return 1;
    }
  }
  return 0;
}

/* Spins one thread for ns nanoseconds of the GPU's global timer. */
static __global__ void spin_kernel(unsigned long long ns) {
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); while (t - t0 < ns);
}

/* The middle of v (a median for odd sizes, the upper middle for even). */
static inline double probe_median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

/* Median GPU time (us) of call(i), i < 200, each between two of ev's events
 * (at least 400), queued behind a 20 ms spin kernel so the calls run back to
 * back with their host enqueue hidden; 10 calls first to warm up. */
template <class F> double probe_gpu_us(cudaStream_t s, std::vector<cudaEvent_t> &ev, F call) {
  for (int i = 0; i < 10; i++) call(i);
  CK(cudaStreamSynchronize(s));
  spin_kernel<<<1, 1, 0, s>>>(20000000ull); /* longer than queueing 200 calls */
  for (int i = 0; i < 200; i++) {
    CK(cudaEventRecord(ev[2 * i], s));
    call(i);
    CK(cudaEventRecord(ev[2 * i + 1], s));
  }
  CK(cudaStreamSynchronize(s));
  CK(cudaGetLastError());
  std::vector<double> us;
  for (int i = 0; i < 200; i++) {
    float ms;
    CK(cudaEventElapsedTime(&ms, ev[2 * i], ev[2 * i + 1]));
    us.push_back(ms * 1e3);
  }
  return probe_median(us);
}

#endif
