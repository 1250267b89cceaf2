// Kernels for test_xfer's ordering checks: one that keeps a stream busy for
// a given time (kvf_xfer_gather/scatter must enqueue their work and return
// without waiting for the stream), and a pair that checks launches that
// overlap the stream's previous kernel (programmatic dependent launches).
#include <cuda_runtime.h>

#include "xfer_spin.h"

namespace {

__global__ void spin_kernel(long long cycles) {
  // clock64 counts SM cycles; one thread is enough to hold the stream.
  long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

// SM cycles of about `milliseconds` at the device's peak clock (longer if
// the SM runs slower).
cudaError_t spin_cycles(double milliseconds, long long *cycles) {
  int device = 0, khz = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, device);
  if (e != cudaSuccess) return e;
  if (khz <= 0) khz = 2000000;
  *cycles = (long long)(milliseconds * (double)khz);
  return cudaSuccess;
}

}  // namespace

// Enqueue a one-thread kernel on `stream` that spins for about `milliseconds`.
extern "C" cudaError_t kvf_test_spin(cudaStream_t stream, double milliseconds) {
  long long cycles = 0;
  cudaError_t e = spin_cycles(milliseconds, &cycles);
  if (e != cudaSuccess) return e;
  spin_kernel<<<1, 1, 0, stream>>>(cycles);
  return cudaGetLastError();
}

// ---- programmatic dependent launches (overlap) -----------------------------

namespace {

struct Copies {
  char *dst[KVF_TEST_MAX_COPIES];
  const char *src[KVF_TEST_MAX_COPIES];
  unsigned long long bytes[KVF_TEST_MAX_COPIES];
  int n;
};

Copies copies_of(int n, void *const *dst, const void *const *src, const size_t *bytes) {
  Copies c = {};
  c.n = n;
  for (int i = 0; i < n; i++) {
    c.dst[i] = static_cast<char *>(dst[i]);
    c.src[i] = static_cast<const char *>(src[i]);
    c.bytes[i] = bytes[i];
  }
  return c;
}

__device__ void copy_all(const Copies &c) {
  const unsigned long long t = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
  const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
  for (int i = 0; i < c.n; i++) {
    if (((reinterpret_cast<unsigned long long>(c.dst[i]) | reinterpret_cast<unsigned long long>(c.src[i]) |
          c.bytes[i]) & 15) == 0) {
      uint4 *d = reinterpret_cast<uint4 *>(c.dst[i]);
      const uint4 *s = reinterpret_cast<const uint4 *>(c.src[i]);
      for (unsigned long long u = t; u < c.bytes[i] / 16; u += stride) d[u] = s[u];
    } else {
      for (unsigned long long b = t; b < c.bytes[i]; b += stride) c.dst[i][b] = c.src[i][b];
    }
  }
}

// Lets the stream's next kernel launch at once (if it asked to overlap this
// one), then spins, then copies: a dependent that reads dst before waiting
// for this grid reads the bytes from before the copy.
__global__ void late_copy_kernel(const Copies c, long long cycles) {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
  if (threadIdx.x == 0) {
    long long start = clock64();
    while (clock64() - start < cycles) {
    }
  }
  __syncthreads();
  copy_all(c);
}

// Copies without waiting for the grid it overlaps.
__global__ void unwaiting_copy_kernel(const Copies c) { copy_all(c); }

// Load both kernels' module now: with lazy loading (the default) a kernel's
// first launch loads its module, which may wait for the work in flight and
// so keep the first dependent launch from overlapping anything.
cudaError_t load_copy_kernels() {
  cudaFuncAttributes a;
  cudaError_t e = cudaFuncGetAttributes(&a, late_copy_kernel);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&a, unwaiting_copy_kernel);
  return e;
}

}  // namespace

extern "C" cudaError_t kvf_test_late_copy(cudaStream_t stream, double milliseconds, int n, void *const *dst,
                                          const void *const *src, const size_t *bytes) {
  if (n < 0 || n > KVF_TEST_MAX_COPIES) return cudaErrorInvalidValue;
  long long cycles = 0;
  cudaError_t e = spin_cycles(milliseconds, &cycles);
  if (e == cudaSuccess) e = load_copy_kernels();
  if (e != cudaSuccess) return e;
  // A few SMs: the dependent's CTAs find room beside it.
  late_copy_kernel<<<8, 256, 0, stream>>>(copies_of(n, dst, src, bytes), cycles);
  return cudaGetLastError();
}

extern "C" cudaError_t kvf_test_unwaiting_copy(cudaStream_t stream, int n, void *const *dst, const void *const *src,
                                               const size_t *bytes) {
  if (n < 0 || n > KVF_TEST_MAX_COPIES) return cudaErrorInvalidValue;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(64);
  cfg.blockDim = dim3(256);
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, unwaiting_copy_kernel, copies_of(n, dst, src, bytes));
}
