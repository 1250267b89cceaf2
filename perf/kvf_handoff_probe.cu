/* perf/kvf_handoff_probe.cu - what a deferred call's hand-offs cost the GPU.
 *
 * A deferred call (kvf_xfer_gather_deferred, host/core/xfer.c) runs its
 * work on the context's internal stream: the caller's stream records an
 * event that the internal stream waits for, and the internal stream writes
 * a number that a joined stream waits for (cuStreamWaitValue64). Written
 * for the transparent mode it replaced (KVF_XFER_DEFER, where the caller's
 * stream waited at the call), whose hand-offs were the same two. This
 * measures, on the
 * GPU it runs on, the GPU time of one call of an empty kernel behind each
 * way of handing off between two streams, back to back behind a spin
 * kernel (the host's enqueue hidden), as the time between events on the
 * caller's stream:
 *   same stream          the kernel on the caller's stream (no hand-off)
 *   event, host word     the deferred call as built: an event there, a
 *                        mapped pinned word back
 *   event, device word   the word in device memory
 *   device words         words both ways, no event
 *   events               an event each way (a staged call's fork and join)
 * and the host time of the caller's part (the event record and the wait),
 * alone (the stream idle). Medians of 200 calls; one JSON object per
 * figure with --json FILE. */
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "probe_util.cuh"

namespace {

__global__ void empty_kernel(int *p) {
  if (p && threadIdx.x == 0 && blockIdx.x == 0xffff) p[0] = 1;
}

PFN_cuStreamWaitValue64_v11070 wait_value;
PFN_cuStreamWriteValue64_v11070 write_value;

void load_entry(const char *name, void **fn) {
  enum cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
  CK(cudaGetDriverEntryPointByVersion(name, fn, 12000, cudaEnableDefault, &q));
  if (q != cudaDriverEntryPointSuccess || !*fn) {
    fprintf(stderr, "kvf_handoff_probe: the driver has no %s\n", name);
    exit(1);
  }
}

void cu_check(CUresult r, const char *what) {
  if (r != CUDA_SUCCESS) {
    fprintf(stderr, "kvf_handoff_probe: %s failed (%d)\n", what, (int)r);
    exit(1);
  }
}

enum Way { kSame, kEventHostWord, kEventDeviceWord, kDeviceWords, kEvents };
const char *kNames[] = {"same stream", "event, host word", "event, device word", "device words", "events"};

}  // namespace

int main(int argc, char **argv) {
  FILE *json = nullptr;
  if (int rc = probe_args(argc, argv, "kvf_handoff_probe", &json)) return rc;
  load_entry("cuStreamWaitValue64", reinterpret_cast<void **>(&wait_value));
  load_entry("cuStreamWriteValue64", reinterpret_cast<void **>(&write_value));
  cudaStream_t caller, inner;
  CK(cudaStreamCreateWithFlags(&caller, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&inner, cudaStreamNonBlocking));
  uint64_t *host_word = nullptr, *device_words = nullptr;
  void *host_word_dev = nullptr;
  CK(cudaHostAlloc(&host_word, 64, cudaHostAllocMapped | cudaHostAllocPortable));
  *host_word = 0;
  CK(cudaHostGetDevicePointer(&host_word_dev, host_word, 0));
  CK(cudaMalloc(&device_words, 128));
  CK(cudaMemset(device_words, 0, 128));
  const CUdeviceptr back_host = (CUdeviceptr)(uintptr_t)host_word_dev, back_dev = (CUdeviceptr)(uintptr_t)device_words,
                    forth_dev = back_dev + 64;
  std::vector<cudaEvent_t> timing(400), forth(64), back(64);
  for (auto &e : timing) CK(cudaEventCreate(&e));
  for (auto &e : forth) CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  for (auto &e : back) CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  uint64_t seq = 0;
  for (int way = kSame; way <= kEvents; way++) {
    double us = probe_gpu_us(caller, timing, [&](int i) {
      if (way == kSame) {
        empty_kernel<<<1, 32, 0, caller>>>(nullptr);
        return;
      }
      ++seq;
      if (way == kDeviceWords) {
        cu_check(write_value((CUstream)caller, forth_dev, seq, CU_STREAM_WRITE_VALUE_DEFAULT), "write");
        cu_check(wait_value((CUstream)inner, forth_dev, seq, CU_STREAM_WAIT_VALUE_GEQ), "wait");
      } else {
        CK(cudaEventRecord(forth[i % 64], caller));
        CK(cudaStreamWaitEvent(inner, forth[i % 64], 0));
      }
      empty_kernel<<<1, 32, 0, inner>>>(nullptr);
      if (way == kEvents) {
        CK(cudaEventRecord(back[i % 64], inner));
        CK(cudaStreamWaitEvent(caller, back[i % 64], 0));
        return;
      }
      CUdeviceptr word = way == kEventHostWord ? back_host : back_dev;
      cu_check(write_value((CUstream)inner, word, seq, CU_STREAM_WRITE_VALUE_DEFAULT), "write");
      cu_check(wait_value((CUstream)caller, word, seq, CU_STREAM_WAIT_VALUE_GEQ), "wait");
    });
    printf("gpu   %-20s %8.2f us per call\n", kNames[way], us);
    if (json) fprintf(json, "{\"kind\": \"gpu\", \"what\": \"%s\", \"median_us\": %.3f}\n", kNames[way], us);
  }
  /* The caller's part alone: an event record and a wait on the host word,
   * which the internal stream then writes. */
  std::vector<double> alone;
  for (int i = 0; i < 300; i++) {
    CK(cudaStreamSynchronize(caller));
    ++seq;
    auto t0 = std::chrono::steady_clock::now();
    CK(cudaEventRecord(forth[i % 64], caller));
    cu_check(wait_value((CUstream)caller, back_host, seq, CU_STREAM_WAIT_VALUE_GEQ), "wait");
    auto t1 = std::chrono::steady_clock::now();
    alone.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
    CK(cudaStreamWaitEvent(inner, forth[i % 64], 0));
    cu_check(write_value((CUstream)inner, back_host, seq, CU_STREAM_WRITE_VALUE_DEFAULT), "write");
  }
  CK(cudaDeviceSynchronize());
  double host = probe_median(alone);
  printf("host  %-20s %8.2f us (alone)\n", "record + wait", host);
  if (json) {
    fprintf(json, "{\"kind\": \"host\", \"what\": \"record + wait\", \"alone_us\": %.3f}\n", host);
    fclose(json);
  }
  return 0;
}
