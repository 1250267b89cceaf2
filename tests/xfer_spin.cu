// A kernel that keeps a stream busy for a given time, for test_xfer's check
// that kvf_xfer_gather/scatter enqueue their work and return without waiting
// for the stream.
#include <cuda_runtime.h>

namespace {

__global__ void spin_kernel(long long cycles) {
  // clock64 counts SM cycles; one thread is enough to hold the stream.
  long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

}  // namespace

// Enqueue a one-thread kernel on `stream` that spins for about `milliseconds`
// (at the device's peak clock; longer if the SM runs slower).
extern "C" cudaError_t kvf_test_spin(cudaStream_t stream, double milliseconds) {
  int device = 0, khz = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) return e;
  e = cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, device);
  if (e != cudaSuccess) return e;
  if (khz <= 0) khz = 2000000;  // attribute unavailable: assume 2 GHz
  spin_kernel<<<1, 1, 0, stream>>>((long long)(milliseconds * (double)khz));
  return cudaGetLastError();
}
