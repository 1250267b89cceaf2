/* perf/kvf_ce_probe.cu - do two copy engines hide the batch API's per-call cost?
 *
 * kvferry moves a chunk of large runs (the 61-layer MLA cache's 244 runs of
 * 72 or 41 KiB) between the GPU and pinned host memory with
 * cudaMemcpyBatchAsync calls of growing size on the caller's stream (the
 * copy-batch route, host/core/xfer.c: ramped_batch_copy). Its latency stays
 * 5-10% over a memcpy of the same bytes: traces show each call costing the
 * copy engine about 2 us more than its bytes at the link and about 1 us
 * between calls. This asks whether calls alternated between two streams
 * (forked from the first by an event, joined back by another), which the
 * driver may give to two copy engines, overlap those costs with the other
 * stream's copies.
 *
 * For each shape and direction: a memcpy of the payload (contiguous), the
 * runs in one batch call, and ramps of calls on one stream or alternated on
 * two. Each figure: the wall time of one call alone, from before its first
 * API call to the return of cudaStreamSynchronize (median of 200, back to
 * back), the host time to its last API call's return, and the GPU time
 * between events with the host's enqueue hidden behind a spin kernel.
 * Buffer sets rotate so that L2 holds none of a call's bytes. One line of
 * text per figure and one JSON object per figure with --json FILE. */
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <random>
#include <vector>

#include "probe_util.cuh"

namespace {

constexpr int kSets = 8;
constexpr int kReps = 200;

struct Shape {
  const char *name;
  size_t run_bytes;
  int runs;
};

struct Variant {
  const char *name;
  std::vector<int> calls;  // runs per call, in host order
  int streams;             // call k goes on stream k % streams
};

double now_us() {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

cudaError_t batch(void **dst, const void **src, size_t *size, size_t n, cudaStream_t s) {
  cudaMemcpyAttributes attr = {};
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  size_t idx = 0;
  return cudaMemcpyBatchAsync(dst, src, size, n, &attr, &idx, 1, s);
}

struct Runs {
  std::vector<void *> dst;
  std::vector<const void *> src;
  std::vector<size_t> size;
};

}  // namespace

int main(int argc, char **argv) {
  FILE *json = nullptr;
  if (int rc = probe_args(argc, argv, "kvf_ce_probe", &json)) return rc;
  const Shape shapes[] = {{"mla-bf16", 73728, 244}, {"mla-fp8-656", 41984, 244}};
  const Variant variants[] = {
      {"batch, one call", {244}, 1},
      {"ramp 8x1.5, one stream", {8, 12, 18, 27, 41, 62, 76}, 1},
      {"ramp 8x1.5, two streams", {8, 12, 18, 27, 41, 62, 76}, 2},
      {"ramp 8,8,16,16,.., two streams", {8, 8, 16, 16, 32, 32, 64, 68}, 2},
      {"ramp 4,4,8,8,.., two streams", {4, 4, 8, 8, 16, 16, 32, 32, 64, 60}, 2},
      {"halves, two streams", {122, 122}, 2},
      {"8 then halves, two streams", {8, 118, 118}, 2},
  };
  cudaStream_t st[2];
  for (auto &s : st) CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaEvent_t fork, join;
  CK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
  CK(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));
  std::vector<cudaEvent_t> timing(2 * kReps);
  for (auto &e : timing) CK(cudaEventCreate(&e));
  int engines = 0;
  CK(cudaDeviceGetAttribute(&engines, cudaDevAttrAsyncEngineCount, 0));
  printf("kvf_ce_probe: async engine count %d\n", engines);

  for (const Shape &sh : shapes) {
    const size_t payload = sh.run_bytes * sh.runs;
    const size_t slots = (size_t)sh.runs * kSets * 2;  // a pool twice what the sets use
    char *pool = nullptr, *contiguous = nullptr, *host = nullptr;
    CK(cudaMalloc(&pool, slots * sh.run_bytes));
    CK(cudaMalloc(&contiguous, payload * kSets));
    CK(cudaHostAlloc(&host, payload * kSets, cudaHostAllocDefault));
    CK(cudaMemset(pool, 1, slots * sh.run_bytes));
    CK(cudaMemset(contiguous, 2, payload * kSets));
    memset(host, 3, payload * kSets);
    std::vector<size_t> order(slots);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), std::mt19937(42));
    for (int gather = 1; gather >= 0; gather--) {
      const char *dir = gather ? "d2h" : "h2d";
      Runs sets[kSets];
      for (int s = 0; s < kSets; s++)
        for (int r = 0; r < sh.runs; r++) {
          char *dev = pool + order[(size_t)s * sh.runs + r] * sh.run_bytes;
          char *obj = host + (size_t)s * payload + (size_t)r * sh.run_bytes;
          sets[s].dst.push_back(gather ? obj : dev);
          sets[s].src.push_back(gather ? dev : obj);
          sets[s].size.push_back(sh.run_bytes);
        }
      auto memcpy_call = [&](int i) {
        char *dev = contiguous + (size_t)(i % kSets) * payload, *obj = host + (size_t)(i % kSets) * payload;
        CK(cudaMemcpyAsync(gather ? obj : dev, gather ? dev : obj, payload,
                           gather ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice, st[0]));
      };
      auto variant_call = [&](const Variant &v, int i) {
        Runs &rs = sets[i % kSets];
        if (v.streams > 1) {
          CK(cudaEventRecord(fork, st[0]));
          CK(cudaStreamWaitEvent(st[1], fork, 0));
        }
        size_t at = 0;
        for (size_t k = 0; k < v.calls.size(); k++) {
          size_t n = (size_t)v.calls[k];
          CK(batch(rs.dst.data() + at, rs.src.data() + at, rs.size.data() + at, n, st[k % v.streams]));
          at += n;
        }
        if (v.streams > 1) {
          CK(cudaEventRecord(join, st[1]));
          CK(cudaStreamWaitEvent(st[0], join, 0));
        }
      };
      auto report = [&](const char *name, auto call) {
        for (int i = 0; i < 10; i++) call(i);
        CK(cudaDeviceSynchronize());
        std::vector<double> wall, host_us;
        for (int i = 0; i < kReps; i++) {
          double t0 = now_us();
          call(i);
          double t1 = now_us();
          CK(cudaStreamSynchronize(st[0]));
          double t2 = now_us();
          wall.push_back(t2 - t0);
          host_us.push_back(t1 - t0);
        }
        double gpu = probe_gpu_us(st[0], timing, call);
        double w = probe_median(wall), h = probe_median(host_us);
        printf("%-12s %s  %-34s wall %7.1f us  host %6.1f us  gpu %7.1f us (%.1f GB/s)\n", sh.name, dir, name, w, h,
               gpu, payload / gpu / 1e3);
        if (json)
          fprintf(json,
                  "{\"shape\":\"%s\",\"direction\":\"%s\",\"variant\":\"%s\",\"payload_bytes\":%zu,\"runs\":%d,"
                  "\"wall_us\":%.3f,\"host_us\":%.3f,\"gpu_us\":%.3f}\n",
                  sh.name, dir, name, payload, sh.runs, w, h, gpu);
        return w;
      };
      double base = report("memcpy", memcpy_call);
      for (const Variant &v : variants) {
        double w = report(v.name, [&](int i) { variant_call(v, i); });
        printf("%-12s %s  %-34s wall/memcpy %.3fx\n", sh.name, dir, v.name, w / base);
      }
      // Byte check of one two-stream variant (variants[3]), d2h: every run
      // of set 0 arrived.
      if (gather) {
        CK(cudaMemset(pool, 5, slots * sh.run_bytes));
        CK(cudaDeviceSynchronize()); /* the memset ran on the legacy stream, which st[] do not wait for */
        variant_call(variants[3], 0);
        CK(cudaStreamSynchronize(st[0]));
        for (size_t b = 0; b < payload; b += 4093)
          if (host[b] != 5) {
            fprintf(stderr, "kvf_ce_probe: %s %s: byte %zu of the object not copied\n", sh.name, dir, b);
            return 1;
          }
      }
    }
    CK(cudaFree(pool));
    CK(cudaFree(contiguous));
    CK(cudaFreeHost(host));
  }
  if (json) fclose(json);
  return 0;
}
