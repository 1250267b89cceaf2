/* perf/kvf_param_probe.cu - what a kernel's parameter size costs.
 *
 * kvferry passes a small request's launch tables in the kernel's parameters
 * (kernels/xfer_kernel.cu, ParamBlob<N>), in a few sizes N, since a launch
 * copies all N bytes. This measures, on the GPU it runs on, what N costs:
 *   host:  the host time of one launch of an empty kernel (132x512), alone
 *          (the stream idle) and back to back, for each N, next to the
 *          other CUDA calls a transfer makes (an event record, an 11 KB
 *          pinned upload);
 *   gpu:   the GPU time of each call of a copy kernel moving `bytes` device
 *          to device, with N bytes of parameters, back to back behind a spin
 *          kernel (so the host's launch rate is hidden), next to a
 *          cudaMemcpyAsync of the same bytes.
 * Medians of 300 (host) and 200 (gpu) calls. One line of text per figure,
 * and one JSON object per figure with --json FILE. */
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <vector>

#include "probe_util.cuh"

namespace {

template <int N> struct alignas(16) Params {
  const uint4 *src;
  uint4 *dst;
  size_t units;
  char pad[N - 24];
};

template <int N> __global__ void __launch_bounds__(512, 1) empty_kernel(const __grid_constant__ Params<N> p) {
  if (p.units == ~(size_t)0) p.dst[threadIdx.x] = p.src[p.pad[threadIdx.x % (N - 24)]];
}

template <int N> __global__ void __launch_bounds__(512, 1) copy_kernel(const __grid_constant__ Params<N> p) {
  size_t stride = (size_t)gridDim.x * blockDim.x;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < p.units; i += stride) p.dst[i] = p.src[i];
}

double now_us() {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}


FILE *g_json;

/* One figure: median_us (back to back for host figures), alone_us (host
 * figures only: each call with the stream idle). */
void report(const char *kind, const char *what, size_t bytes, double us, double alone) {
  printf("%-5s %-28s %9zu B  %8.2f us", kind, what, bytes, us);
  if (alone > 0) printf("  (alone %.2f us)", alone);
  printf("\n");
  if (!g_json) return;
  fprintf(g_json, "{\"kind\": \"%s\", \"what\": \"%s\", \"bytes\": %zu, \"median_us\": %.3f", kind, what, bytes, us);
  if (alone > 0) fprintf(g_json, ", \"alone_us\": %.3f", alone);
  fprintf(g_json, "}\n");
}

template <class F> void host_time(const char *what, size_t bytes, cudaStream_t s, F call) {
  std::vector<double> alone, b2b;
  for (int i = 0; i < 20; i++) call();
  CK(cudaStreamSynchronize(s));
  for (int i = 0; i < 300; i++) {
    double a = now_us();
    call();
    alone.push_back(now_us() - a);
    CK(cudaStreamSynchronize(s));
  }
  for (int i = 0; i < 300; i++) {
    double a = now_us();
    call();
    b2b.push_back(now_us() - a);
  }
  CK(cudaStreamSynchronize(s));
  report("host", what, bytes, probe_median(b2b), probe_median(alone));
}

template <class F> void gpu_time(const char *what, size_t bytes, cudaStream_t s, std::vector<cudaEvent_t> &ev, F call) {
  report("gpu", what, bytes, probe_gpu_us(s, ev, [&](int) { call(); }), 0);
}

template <int N> void both(const char *label, size_t bytes, const uint4 *a, uint4 *b, cudaStream_t s,
                           std::vector<cudaEvent_t> &ev, bool host) {
  static Params<N> p; /* static: 32 KiB is large for a stack */
  memset(&p, 0, sizeof p);
  p.src = a;
  p.dst = b;
  p.units = bytes / 16;
  char what[64];
  if (host) {
    snprintf(what, sizeof what, "launch, %s params", label);
    host_time(what, N, s, [&] { empty_kernel<N><<<132, 512, 0, s>>>(p); });
  } else {
    snprintf(what, sizeof what, "copy kernel, %s params", label);
    gpu_time(what, bytes, s, ev, [&] { copy_kernel<N><<<132, 512, 0, s>>>(p); });
  }
}

}  // namespace

int main(int argc, char **argv) {
  if (int rc = probe_args(argc, argv, "kvf_param_probe", &g_json)) return rc;
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  uint4 *a, *b;
  char *pinned;
  CK(cudaMalloc(&a, 64 << 20));
  CK(cudaMalloc(&b, 64 << 20));
  CK(cudaMallocHost(&pinned, 1 << 20));
  std::vector<cudaEvent_t> ev(400);
  for (auto &e : ev) CK(cudaEventCreate(&e));
  cudaEvent_t mark;
  CK(cudaEventCreateWithFlags(&mark, cudaEventDisableTiming));
  host_time("cudaEventRecord", 0, s, [&] { CK(cudaEventRecord(mark, s)); });
  host_time("cudaMemcpyAsync pinned H2D", 11000, s,
            [&] { CK(cudaMemcpyAsync(b, pinned, 11000, cudaMemcpyHostToDevice, s)); });
  const size_t copy_bytes[] = {4u << 20, 17u << 20, 32u << 20};
  for (int pass = 0; pass < 1 + 3; pass++) {
    bool host = pass == 0;
    size_t bytes = host ? 0 : copy_bytes[pass - 1];
    both<2048>("2 KiB", bytes, a, b, s, ev, host);
    both<4096>("4 KiB", bytes, a, b, s, ev, host);
    both<8192>("8 KiB", bytes, a, b, s, ev, host);
    both<12288>("12 KiB", bytes, a, b, s, ev, host);
    both<16384>("16 KiB", bytes, a, b, s, ev, host);
    both<32752>("32752 B", bytes, a, b, s, ev, host);
    if (!host)
      gpu_time("cudaMemcpyAsync D2D", bytes, s, ev,
               [&] { CK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, s)); });
  }
  CK(cudaDeviceSynchronize());
  if (g_json) fclose(g_json);
  return 0;
}
