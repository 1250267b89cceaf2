/* perf/kvf_hop_probe.cu - what the staged route's stream hand-offs cost.
 *
 * A staged one-chunk gather is: a kernel fills a device buffer, the copy
 * engine drains it to pinned host memory, in pieces, the copy engine on a
 * second stream that forks from and joins the caller's stream. Each hop
 * between the streams, each extra copy and each kernel boundary costs GPU
 * time that a plain cudaMemcpyAsync of the same bytes does not pay. This
 * times, on the GPU it runs on, the same bytes moved by:
 *   memcpy          one cudaMemcpyAsync on the caller's stream (the limit)
 *   fork_join       the same copy on a second stream, forked and joined
 *   serial          a gather kernel, then the copy, both on the caller's stream
 *   pieces2_ce      2 pieces, kernels on the caller's stream, copies on the
 *                   second (kvferry's layout today)
 *   pieces2_caller  2 pieces, piece 0's kernel and every copy on the caller's
 *                   stream, piece 1's kernel on the second (no join hop)
 *   pieces2_memop   as pieces2_ce, the hop by cuStreamWriteValue32 /
 *                   cuStreamWaitValue32 instead of an event
 *   parts6          the copy as 6 cudaMemcpyAsync (3 objects x 2 pieces)
 *   batch6          the copy as one cudaMemcpyBatchAsync of 6 entries
 * and the h2d mirror of memcpy, pieces2_ce and pieces2_caller. GPU time:
 * CUDA events on the caller's stream, reps queued behind a spin kernel, so
 * host enqueue is hidden; medians of `reps`. Usage:
 *   kvf_hop_probe [bytes] [gather_ctas] [reps] */
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "probe_util.cuh"

namespace {

__global__ void copy_kernel(const uint4 *src, uint4 *dst, size_t units) {
  size_t stride = (size_t)gridDim.x * blockDim.x;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < units; i += stride) dst[i] = src[i];
}

typedef CUresult (*wait_fn)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
typedef CUresult (*write_fn)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);

template <typename F> F entry(const char *name) {
  void *fn = nullptr;
  cudaDriverEntryPointQueryResult q;
  CK(cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &q));
  if (q != cudaDriverEntryPointSuccess || !fn) {
    fprintf(stderr, "no driver entry point %s\n", name);
    exit(1);
  }
  return reinterpret_cast<F>(fn);
}

struct Rig {
  size_t bytes;
  int ctas;
  cudaStream_t a, b;
  char *cache, *stage, *host;
  cudaEvent_t fork, join, ready[2], piece[4];
  CUdeviceptr flag;
  uint32_t seq = 0;
  wait_fn wait_value;
  write_fn write_value;

  void gather(size_t off, size_t n, cudaStream_t s) {
    copy_kernel<<<ctas, 512, 0, s>>>((const uint4 *)(cache + off), (uint4 *)(stage + off), n / 16);
  }
  void scatter(size_t off, size_t n, cudaStream_t s) {
    copy_kernel<<<ctas, 512, 0, s>>>((const uint4 *)(stage + off), (uint4 *)(cache + off), n / 16);
  }
  void d2h(size_t off, size_t n, cudaStream_t s) {
    CK(cudaMemcpyAsync(host + off, stage + off, n, cudaMemcpyDeviceToHost, s));
  }
  void h2d(size_t off, size_t n, cudaStream_t s) {
    CK(cudaMemcpyAsync(stage + off, host + off, n, cudaMemcpyHostToDevice, s));
  }
  /* [off, off + n) straight between the cache and host memory, as runs of
   * 32 KiB in one cudaMemcpyBatchAsync (the copy engine, no kernel). */
  void direct(size_t off, size_t n, int to_host, cudaStream_t s) {
    std::vector<void *> dst;
    std::vector<const void *> src;
    std::vector<size_t> size;
    for (size_t o = off; o < off + n; o += 32768) {
      size_t k = std::min((size_t)32768, off + n - o);
      dst.push_back(to_host ? (void *)(host + o) : (void *)(cache + o));
      src.push_back(to_host ? (const void *)(cache + o) : (const void *)(host + o));
      size.push_back(k);
    }
    cudaMemcpyAttributes attr = {};
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    size_t idx = 0;
    CK(cudaMemcpyBatchAsync(dst.data(), src.data(), size.data(), dst.size(), &attr, &idx, 1, s));
  }
  void hop(cudaEvent_t ev, cudaStream_t from, cudaStream_t to) {
    CK(cudaEventRecord(ev, from));
    CK(cudaStreamWaitEvent(to, ev, 0));
  }
};

double median_us(Rig &r, int reps, const std::function<void()> &call) {
  std::vector<cudaEvent_t> e0(reps), e1(reps);
  for (int i = 0; i < reps; i++) {
    CK(cudaEventCreate(&e0[i]));
    CK(cudaEventCreate(&e1[i]));
  }
  for (int i = 0; i < 3; i++) call();
  CK(cudaStreamSynchronize(r.a));
  spin_kernel<<<1, 1, 0, r.a>>>((unsigned long long)reps * 60000ull + 50000ull);
  for (int i = 0; i < reps; i++) {
    CK(cudaEventRecord(e0[i], r.a));
    call();
    CK(cudaEventRecord(e1[i], r.a));
  }
  CK(cudaStreamSynchronize(r.a));
  CK(cudaDeviceSynchronize());
  std::vector<double> t(reps);
  for (int i = 0; i < reps; i++) {
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, e0[i], e1[i]));
    t[i] = ms * 1e3;
    CK(cudaEventDestroy(e0[i]));
    CK(cudaEventDestroy(e1[i]));
  }
  std::sort(t.begin(), t.end());
  return t[reps / 2];
}

}  // namespace

int main(int argc, char **argv) {
  Rig r;
  r.bytes = argc > 1 ? strtoull(argv[1], nullptr, 0) : 8699904;
  r.bytes &= ~(size_t)511;
  r.ctas = argc > 2 ? atoi(argv[2]) : 64;
  int reps = argc > 3 ? atoi(argv[3]) : 200;
  CK(cudaStreamCreateWithFlags(&r.a, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&r.b, cudaStreamNonBlocking));
  CK(cudaMalloc(&r.cache, r.bytes));
  CK(cudaMalloc(&r.stage, r.bytes));
  CK(cudaMallocHost(&r.host, r.bytes));
  CK(cudaMemset(r.cache, 1, r.bytes));
  CK(cudaEventCreateWithFlags(&r.fork, cudaEventDisableTiming));
  CK(cudaEventCreateWithFlags(&r.join, cudaEventDisableTiming));
  for (auto &e : r.piece) CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  for (auto &e : r.ready) CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  CK(cudaMalloc((void **)&r.flag, 64));
  CK(cudaMemset((void *)r.flag, 0, 64));
  r.wait_value = entry<wait_fn>("cuStreamWaitValue32");
  r.write_value = entry<write_fn>("cuStreamWriteValue32");
  const size_t n = r.bytes, h = (n / 2) & ~(size_t)511;

  struct Case {
    const char *name;
    std::function<void()> call;
  };
  std::vector<Case> cases = {
      {"d2h memcpy", [&] { r.d2h(0, n, r.a); }},
      {"d2h fork_join", [&] {
         r.hop(r.fork, r.a, r.b);
         r.d2h(0, n, r.b);
         r.hop(r.join, r.b, r.a);
       }},
      {"d2h serial", [&] {
         r.gather(0, n, r.a);
         r.d2h(0, n, r.a);
       }},
      {"d2h pieces2_ce", [&] {
         r.gather(0, h, r.a);
         r.hop(r.ready[0], r.a, r.b);
         r.d2h(0, h, r.b);
         r.gather(h, n - h, r.a);
         r.hop(r.ready[1], r.a, r.b);
         r.d2h(h, n - h, r.b);
         r.hop(r.join, r.b, r.a);
       }},
      {"d2h pieces2_caller", [&] {
         r.hop(r.fork, r.a, r.b);
         r.gather(h, n - h, r.b);
         CK(cudaEventRecord(r.ready[1], r.b));
         r.gather(0, h, r.a);
         r.d2h(0, h, r.a);
         CK(cudaStreamWaitEvent(r.a, r.ready[1], 0));
         r.d2h(h, n - h, r.a);
       }},
      {"d2h pieces2_memop", [&] {
         uint32_t s = ++r.seq;
         r.gather(0, h, r.a);
         r.write_value(r.a, r.flag, s, 0);
         r.wait_value(r.b, r.flag, s, CU_STREAM_WAIT_VALUE_EQ);
         r.d2h(0, h, r.b);
         r.gather(h, n - h, r.a);
         r.write_value(r.a, r.flag + 4, s, 0);
         r.wait_value(r.b, r.flag + 4, s, CU_STREAM_WAIT_VALUE_EQ);
         r.d2h(h, n - h, r.b);
         r.write_value(r.b, r.flag + 8, s, 0);
         r.wait_value(r.a, r.flag + 8, s, CU_STREAM_WAIT_VALUE_EQ);
       }},
      {"d2h parts6", [&] {
         size_t p = (n / 6) & ~(size_t)511;
         for (int i = 0; i < 6; i++) r.d2h(i * p, i == 5 ? n - 5 * p : p, r.a);
       }},
      {"d2h batch6", [&] {
         size_t p = (n / 6) & ~(size_t)511;
         void *dst[6];
         const void *src[6];
         size_t size[6];
         for (int i = 0; i < 6; i++) {
           dst[i] = r.host + i * p;
           src[i] = r.stage + i * p;
           size[i] = i == 5 ? n - 5 * p : p;
         }
         cudaMemcpyAttributes attr = {};
         attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
         size_t idx = 0;
         CK(cudaMemcpyBatchAsync(dst, src, size, 6, &attr, &idx, 1, r.a));
       }},
      {"d2h gather_only", [&] { r.gather(0, n, r.a); }},
      {"d2h gather_half", [&] { r.gather(0, h, r.a); }},
      {"h2d memcpy", [&] { r.h2d(0, n, r.a); }},
      {"h2d pieces2_ce", [&] {
         r.hop(r.fork, r.a, r.b);
         r.h2d(0, h, r.b);
         r.hop(r.ready[0], r.b, r.a);
         r.scatter(0, h, r.a);
         r.h2d(h, n - h, r.b);
         r.hop(r.ready[1], r.b, r.a);
         r.scatter(h, n - h, r.a);
         r.hop(r.join, r.b, r.a);
       }},
      {"h2d pieces2_caller", [&] {
         r.h2d(0, h, r.a);
         r.hop(r.ready[0], r.a, r.b);
         r.scatter(0, h, r.b);
         CK(cudaEventRecord(r.ready[1], r.b));
         r.h2d(h, n - h, r.a);
         r.scatter(h, n - h, r.a);
         CK(cudaStreamWaitEvent(r.a, r.ready[1], 0));
       }},
      {"h2d pieces2_memop", [&] {
         uint32_t s = ++r.seq;
         r.write_value(r.a, r.flag + 16, s, 0);
         r.wait_value(r.b, r.flag + 16, s, CU_STREAM_WAIT_VALUE_EQ);
         r.h2d(0, h, r.b);
         r.write_value(r.b, r.flag + 20, s, 0);
         r.wait_value(r.a, r.flag + 20, s, CU_STREAM_WAIT_VALUE_EQ);
         r.scatter(0, h, r.a);
         r.h2d(h, n - h, r.b);
         r.write_value(r.b, r.flag + 24, s, 0);
         r.wait_value(r.a, r.flag + 24, s, CU_STREAM_WAIT_VALUE_EQ);
         r.scatter(h, n - h, r.a);
       }},
  };
  /* The head (gather) or tail (scatter) of the chunk moved by the copy
   * engine straight from/to the cache, on the caller's stream, while the
   * kernels of the rest run on the second stream; the rest in `pieces`. */
  std::vector<std::string> names;
  names.reserve(64);
  for (size_t head : {(size_t)512 << 10, (size_t)1 << 20, (size_t)2 << 20})
    for (int pieces : {1, 2, 4}) {
      names.push_back("d2h head" + std::to_string(head >> 10) + "K_p" + std::to_string(pieces));
      cases.push_back({names.back().c_str(), [&r, n, head, pieces] {
                         size_t rest = n - head, p = (rest / pieces) & ~(size_t)511;
                         r.hop(r.fork, r.a, r.b);
                         r.direct(0, head, 1, r.a);
                         for (int i = 0; i < pieces; i++) {
                           size_t o = head + i * p, k = i == pieces - 1 ? n - o : p;
                           r.gather(o, k, r.b);
                           CK(cudaEventRecord(r.piece[i], r.b));
                           CK(cudaStreamWaitEvent(r.a, r.piece[i], 0));
                           r.d2h(o, k, r.a);
                         }
                       }});
    }
  for (size_t tail : {(size_t)512 << 10, (size_t)1 << 20, (size_t)2 << 20})
    for (int pieces : {1, 2, 4}) {
      names.push_back("h2d tail" + std::to_string(tail >> 10) + "K_p" + std::to_string(pieces));
      cases.push_back({names.back().c_str(), [&r, n, tail, pieces] {
                         size_t rest = n - tail, p = (rest / pieces) & ~(size_t)511;
                         for (int i = 0; i < pieces; i++) {
                           size_t o = i * p, k = i == pieces - 1 ? rest - o : p;
                           r.h2d(o, k, r.a);
                           CK(cudaEventRecord(r.piece[i], r.a));
                           CK(cudaStreamWaitEvent(r.b, r.piece[i], 0));
                           r.scatter(o, k, r.b);
                         }
                         CK(cudaEventRecord(r.join, r.b));
                         r.direct(rest, tail, 0, r.a);
                         CK(cudaStreamWaitEvent(r.a, r.join, 0));
                       }});
    }
  double limit[2] = {0, 0};
  printf("bytes %zu, gather ctas %d, reps %d\n", n, r.ctas, reps);
  for (auto &c : cases) {
    double us = median_us(r, reps, c.call);
    int dir = c.name[0] == 'h';
    if (c.name[4] == 'm') limit[dir] = 0; /* each "memcpy" row is its direction's limit */
    if (!limit[dir]) limit[dir] = us;
    printf("%-22s %9.2f us  %6.1f%% of memcpy  %+7.2f us\n", c.name, us, 100.0 * limit[dir] / us, us - limit[dir]);
  }
  return 0;
}
