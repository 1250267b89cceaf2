// The gather/scatter kernel: one launch moves a whole request. Two walks of
// the same blobs: the warp walk (kernels/walk.h, the default) and the
// original grid-stride walk below, one task per step (KVF_XFER_KERNEL=1),
// kept to measure one against the other.
//
// Work is a flat list of tasks (entry, block, slice), described by the launch
// blob (kernels/plan.h), read from device memory (kvf_xfer_kernel) or, for
// blobs of at most KVF_KERNEL_PARAM_MAX bytes, from the kernel's own
// parameters (kvf_xfer_kernel_p<N>: no upload before the launch, and a graph
// node keeps its copy). Both read the blob through generic loads, so one
// body serves both. Each warp takes tasks in a grid-stride loop; a task is
// at most the entry's slice_units of one block of one segment (layer x
// plane, or layer x state). Lanes copy consecutive units of
// `vec` bytes (16 where the run, strides and pointers allow, narrower for
// rows like 132 or 561 bytes), several loads in flight before the stores, so
// a few SMs keep a PCIe or NVLink link busy. The same formulas as the CPU
// path in plan.c; the CPU reference in geometry/copy.c is the oracle.
#include <cuda_runtime.h>
#include <stdint.h>

#include "kernels/launch.h"
#include "kernels/plan.h"
#include "kernels/walk.h"

namespace {

constexpr int kThreads = 512;  // one CTA per SM (its registers fill one): the SM cap is the CTA count
constexpr int kWarps = kThreads / 32;
constexpr int kUnroll = 8;      // loads in flight per lane before its stores: 64 KiB per SM

template <int V> struct Unit;
template <> struct Unit<16> { using T = uint4; };
template <> struct Unit<8> { using T = uint2; };
template <> struct Unit<4> { using T = uint32_t; };
template <> struct Unit<2> { using T = uint16_t; };
template <> struct Unit<1> { using T = uint8_t; };

struct Task {
  const kvf_blob_shape *sh;
  char *cache;   // run (t=0, h=0) of the block
  char *object;  // its place in the object
  uint64_t unit_begin, unit_end;
};

__device__ __forceinline__ uint32_t find_entry(const kvf_blob_entry *entries, uint32_t n, uint64_t task) {
  uint32_t lo = 0, hi = n;
  while (hi - lo > 1) {
    uint32_t mid = (lo + hi) / 2;
    if (entries[mid].first_task <= task)
      lo = mid;
    else
      hi = mid;
  }
  return lo;
}

// Decode a task; false when it moves nothing (skipped block, empty slice).
__device__ __forceinline__ bool decode(const kvf_blob_header *h, const char *blob, uint64_t task, Task *t) {
  const kvf_blob_entry *entries = reinterpret_cast<const kvf_blob_entry *>(blob + h->off_entries);
  const kvf_blob_entry *e = &entries[find_entry(entries, h->num_entries, task)];
  const kvf_blob_shape &s = reinterpret_cast<const kvf_blob_shape *>(blob + h->off_shapes)[e->shape];
  const uint32_t *ids = reinterpret_cast<const uint32_t *>(blob + h->off_ids);
  const uint64_t *objects = reinterpret_cast<const uint64_t *>(blob + h->off_objects);
  uint64_t local = task - e->first_task, j = local / e->slices, slice = local - j * e->slices;
  uint32_t id = ids[e->ids_offset + j];
  // The host checked every id; this bound keeps a corrupted table harmless.
  if (id == KVF_BLOCK_SKIP || id >= h->num_blocks_max) return false;
  uint64_t k, units, obj_off;
  if (s.recurrent) {
    k = e->lb_rel + j;
    units = s.units_per_run;
    obj_off = h->chunk_local * e->dst_per_token + e->dst_const;
  } else {
    uint64_t rel = (e->lb_rel + j) * s.tokens;  // tokens from the request's first, which starts a block
    k = rel / h->chunk_local;
    uint64_t chunk_start = h->lt_begin + k * h->chunk_local;
    uint64_t n = min(h->lt_end - chunk_start, h->chunk_local);
    uint64_t valid = min(h->lt_end - (h->lt_begin + rel), (uint64_t)s.tokens);
    units = valid * s.units_per_token;
    obj_off = n * e->dst_per_token + e->dst_const + ((rel - k * h->chunk_local) / s.tokens) * s.dst_block;
  }
  uint64_t slice_units = s.slice_units;
  t->unit_begin = slice * slice_units;
  t->unit_end = min(t->unit_begin + slice_units, units);
  if (t->unit_begin >= t->unit_end) return false;
  // An object left out of this blob (another leg of the call moves it).
  uint64_t object = objects[k * h->num_object_groups + s.object_group];
  if (object == 0) return false;
  t->sh = &s;
  t->cache = reinterpret_cast<char *>(e->cache_base) + (uint64_t)id * s.src_block;
  t->object = reinterpret_cast<char *>(object) + obj_off;
  return true;
}

// Byte offsets of unit u on the cache side (*co) and the object side (*oo).
// Unit indices inside one block fit in 32 bits (the planner checks), and
// 32-bit division is several times cheaper than 64-bit on the GPU.
__device__ __forceinline__ void unit_offsets(const Task &t, bool linear, uint32_t u, uint32_t v, uint64_t *co,
                                             uint64_t *oo) {
  if (linear) {
    *co = *oo = (uint64_t)u * v;
    return;
  }
  const kvf_blob_shape &s = *t.sh;
  const uint32_t upt = (uint32_t)s.units_per_token, upr = s.units_per_run;
  uint32_t tok = u / upt, r = u - tok * upt, hd = r / upr, c = r - hd * upr;
  *co = tok * s.src_token + hd * s.src_head + (uint64_t)c * v;
  *oo = tok * s.dst_token + hd * s.dst_head + (uint64_t)c * v;
}

// Each lane loads kUnroll units (32 apart, so the warp's accesses stay
// coalesced) before storing them. Store addresses are computed again rather
// than kept: registers, not arithmetic, limit how many loads a lane keeps in flight.
template <int V>
__device__ __forceinline__ void copy_task(const Task &t, bool gather, int lane) {
  using T = typename Unit<V>::T;
  // Runs contiguous across tokens on both sides: unit u is at u*V on both.
  const bool linear = kvf_walk::linear_of(t.sh);
  const char *src = gather ? t.cache : t.object;
  char *dst = gather ? t.object : t.cache;
  const uint32_t end = (uint32_t)t.unit_end;
  for (uint32_t base = (uint32_t)t.unit_begin + lane; base < end; base += 32 * kUnroll) {
    T v[kUnroll];
#pragma unroll
    for (int i = 0; i < kUnroll; i++) {
      uint32_t u = base + i * 32;
      uint64_t co, oo;
      if (u >= end) break;
      unit_offsets(t, linear, u, V, &co, &oo);
      v[i] = *reinterpret_cast<const T *>(src + (gather ? co : oo));
    }
#pragma unroll
    for (int i = 0; i < kUnroll; i++) {
      uint32_t u = base + i * 32;
      uint64_t co, oo;
      if (u >= end) break;
      unit_offsets(t, linear, u, V, &co, &oo);
      *reinterpret_cast<T *>(dst + (gather ? oo : co)) = v[i];
    }
  }
}

// The body of every variant: blob is generic (device memory or parameters).
__device__ __forceinline__ void run_blob(const char *blob) {
  const kvf_blob_header *h = reinterpret_cast<const kvf_blob_header *>(blob);
  const int lane = threadIdx.x & 31;
  const uint64_t warp = (uint64_t)blockIdx.x * kWarps + (threadIdx.x >> 5);
  const uint64_t stride = (uint64_t)gridDim.x * kWarps;
  const uint64_t total = h->total_tasks;
  const bool gather = h->gather != 0;
  for (uint64_t task = warp; task < total; task += stride) {
    Task t;
    if (!decode(h, blob, task, &t)) continue;  // uniform across the warp
    switch (t.sh->vec) {
      case 16: copy_task<16>(t, gather, lane); break;
      case 8: copy_task<8>(t, gather, lane); break;
      case 4: copy_task<4>(t, gather, lane); break;
      case 2: copy_task<2>(t, gather, lane); break;
      default: copy_task<1>(t, gather, lane); break;
    }
  }
}

__global__ void __launch_bounds__(kThreads, 1) kvf_xfer_kernel(const char *blob) { run_blob(blob); }

// A blob carried in the kernel's parameters: N bytes of them (the launch
// copies all N, so a few sizes keep small blobs cheap). Measured on an H200
// by perf/kvf_param_probe (perf/results/2026-12-01-h200-run4/params.log; a
// copy kernel back to back, 132 CTAs): over 2 KiB, each call's GPU time
// grows by +0.1 us at 4 KiB, +0.5 at 12 KiB, +1.1-1.3 at 16 KiB and +2.3 at
// 32752 bytes, and a launch alone takes 5.1 us (2 KiB), 5.6 (12 KiB), 6.2
// (16 KiB), 8.2 (32752 bytes).
template <int N> struct alignas(16) ParamBlob {
  char bytes[N];
};

template <int N>
__global__ void __launch_bounds__(kThreads, 1) kvf_xfer_kernel_p(const __grid_constant__ ParamBlob<N> p) {
  run_blob(p.bytes);
}

// The warp walk (kernels/walk.h): contiguous task ranges per warp, one
// decode per block, stepped addressing. Same blobs, same bytes moved.
//
// Two shapes. Most launches run one CTA of kThreads per SM, so an SM cap
// is the CTA count. A *spread* launch (device to device or peers, every SM,
// enough bytes: host/core/xfer.c decides) runs CTAs of kSpreadThreads, at
// least 3 or 4 resident per SM (WalkShape), one task per warp until
// the tasks run out (a one-chunk request: 2-4 rounds of the SMs' slots) and
// at most kSpreadWaves rounds: the hardware hands a finished CTA's slot to
// the next, so fast warps end up moving more than slow ones where a static
// split waits for the slowest warp. Measured on an H200 (perf/results/2026-12-01-h200-d2d, d2d
// of memcpy): 4096 tokens MLA 89.5 -> 93.2%, Llama NHD 93.1 -> 96.0%, the
// tp4 slice 85.0 -> 89.7%; one chunk +0.6 to +3 points where the request is
// at least 8 MiB and -2.2 points below (the MLA DCP rank's 4.3 MiB, whose
// warps have less than a round of loads each), hence KVF_XFER_SPREAD_KB, 8
// MiB then. With the decode's one round of table reads and 48-byte entries
// the DCP rank's chunk gained from spreading instead: 83.0 -> 84.9% (three
// runs each, perf/results/2026-12-02-h200-entry48/probes), so the
// threshold is 4 MiB; smaller requests were not measured.
//
// A deep spread lane keeps twice the loads in flight (16 of 16 bytes, so a
// warp moves its 8 KiB task in one round, not two), which takes 166-167
// registers a thread and leaves 3 CTAs an SM where the shallow shape runs 5
// at 96 (4 at 108 with uploaded tables): fewer warps, more bytes in flight
// (96 KiB an SM against 80).
// Measured on an H100 (perf/results/2026-12-05-h100-spread-depth, d2d of
// memcpy per call, every preset, three runs of 2-3 rounds): from 8 to 387
// MiB deep was ahead in 63 of 67 run means (-0.24 to +1.86 points; back to
// back more, up to +8), at 4.3 MiB (the MLA DCP rank's chunk, one CTA an SM
// either way) behind by 0.9-1.2, and at 512 MiB and more behind in 17 of 28
// (-0.88 to +0.18; the Llama rows at 4096 tokens): hence
// KVF_XFER_SPREAD_DEEP_KB (8 MiB). More warps with fewer loads each lost
// (8 CTAs of 64 registers at half the loads: -1.9 at one chunk, -0.5 at
// 4096 tokens), and so did registers capped into spills.
// The H200 disagrees above about 10 MiB (perf/results/2026-12-05-h200-deep-
// window, one run of three rounds, every preset at one chunk and 4096
// tokens): deep was ahead at 8.3-9.8 MiB (+1.1 to +1.8 points) and at 16.5
// MiB on one preset (+1.4), behind on the other 17 rows from 15.8 to 320
// MiB (by 0.03 to 2.1; qwen3-like's 15.8 MiB chunk 2.0, the tp4 slice's 20
// MiB 1.4, the 32 MiB Llama chunks 0.7-2.1). A second H100 sweep of 8-192
// MiB had deep ahead or level on all 43 rows. The targets are the H200's,
// so deep stops at KVF_XFER_SPREAD_DEEP_MAX_MB, 12 MiB, in the H200's gap
// between 9.8 and 15.8 MiB; an H100 does better at 512. Three rounds on
// two later H200 leases with the bound in place (perf/results/2026-12-05-
// h200-window-check) agreed: the 512 MiB window behind by 0.80 points
// below 4096 tokens and 0.23 at 4096 (only the fp8-inline chunk ahead,
// +1.5), shallow everywhere behind by 1.0-1.3 on the 8.3-9.8 MiB chunks.
constexpr int kSpreadThreads = 128;
constexpr int kSpreadWaves = 16;

// Launch shapes by kernel (launch.h's KVF_KERNEL_WALK*): threads a CTA, the
// CTAs an SM must hold at once (the register bound), loads in flight a lane
// (walk.h's depth_of times deep).
template <int K> struct WalkShape {
  static_assert(K == KVF_KERNEL_WALK || K == KVF_KERNEL_WALK_SPREAD || K == KVF_KERNEL_WALK_SPREAD_SHALLOW,
                "a warp walk's kernel");
  static constexpr int threads = K == KVF_KERNEL_WALK ? kThreads : kSpreadThreads;
  static constexpr int per_sm = K == KVF_KERNEL_WALK_SPREAD ? 3 : kThreads / threads;
  static constexpr int deep = K == KVF_KERNEL_WALK_SPREAD ? 2 : 1;
};

// An overlapped launch (header overlap: a programmatic dependent launch,
// kernels/launch.h) lets the stream's next kernel launch as it starts, so
// that a next transfer launched the same way decodes while this grid's last
// CTAs drain; such a kernel waits for this grid (griddepcontrol.wait) before
// it touches memory, as CUDA requires of every programmatic dependent.
// Other launches never do: a kernel after them starts after them.
// Measured on an H200: see KVF_XFER_OVERLAP in host/core/xfer.c.
__device__ __forceinline__ void allow_next_launch(const kvf_blob_header *h) {
#if __CUDA_ARCH__ >= 900
  if (h->overlap) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

template <int Deep>
__device__ __forceinline__ void walk_blob(const char *blob) {
  allow_next_launch(reinterpret_cast<const kvf_blob_header *>(blob));
  const uint32_t warps = blockDim.x / 32;
  kvf_walk::run_warp<Deep>(blob, (uint64_t)blockIdx.x * warps + (threadIdx.x >> 5), (uint64_t)gridDim.x * warps,
                     threadIdx.x & 31);
  // A warp that moved nothing waits too: the grid then completes only after
  // the one it overlapped, as a grid that did not overlap it would (PTX does
  // not say that a next kernel is ordered after both otherwise).
  kvf_walk::wait_previous_grid();
}

template <int K>
__global__ void __launch_bounds__(WalkShape<K>::threads, WalkShape<K>::per_sm) kvf_walk_kernel(const char *blob) {
  // The blob is in device memory: nothing is read before the wait (a no-op
  // unless the launch overlaps, which only the parameter variants do).
  kvf_walk::wait_previous_grid();
  walk_blob<WalkShape<K>::deep>(blob);
}

template <int N, int K>
__global__ void __launch_bounds__(WalkShape<K>::threads, WalkShape<K>::per_sm)
    kvf_walk_kernel_p(const __grid_constant__ ParamBlob<N> p) {
  walk_blob<WalkShape<K>::deep>(p.bytes);
}

// 4, 6 and 8 KiB: a one-chunk blob of the 32- and 61-layer presets is
// 3.2-3.4 KB, of the hybrids 2.9-5.4 KB, of the 80-layer tp4 slice 8.0 KB
// (kernels/plan.h's entries and shapes).
constexpr int kParamSizes[] = {KVF_KERNEL_PARAM_SIZES};
static_assert(sizeof kParamSizes / sizeof kParamSizes[0] == 7, "the launch switch and the preload name every size");
constexpr bool ascending(int i = 1) {
  return i >= (int)(sizeof kParamSizes / sizeof kParamSizes[0]) || (kParamSizes[i - 1] < kParamSizes[i] && ascending(i + 1));
}
static_assert(ascending(), "kvf_kernel_param_room takes the first size that holds a blob: sizes ascend");
static_assert(KVF_KERNEL_PARAM_MAX % 16 == 0 && KVF_KERNEL_PARAM_MAX <= 32764, "kernel parameters hold at most 32764 bytes");

uint32_t lower_ctas(uint64_t total_tasks, uint32_t ctas) {
  uint64_t useful = (total_tasks + kWarps - 1) / kWarps;  // more CTAs than that would idle
  return useful < ctas ? (uint32_t)(useful ? useful : 1) : ctas;
}

// A spread launch's grid on `sms` SMs: kSpreadWaves rounds of every SM's
// slots, cut to one task per warp.
uint32_t spread_grid(uint64_t total_tasks, uint32_t sms, int kernel) {
  constexpr int warps = kSpreadThreads / 32;
  const int per_sm = kernel == KVF_KERNEL_WALK_SPREAD ? WalkShape<KVF_KERNEL_WALK_SPREAD>::per_sm
                                                      : WalkShape<KVF_KERNEL_WALK_SPREAD_SHALLOW>::per_sm;
  uint64_t want = (uint64_t)sms * per_sm * kSpreadWaves;
  uint64_t useful = (total_tasks + warps - 1) / warps;
  return (uint32_t)(useful < want ? (useful ? useful : 1) : want);
}

// The CTAs of a launch on at most *ctas SMs, and *ctas lowered to the SMs
// it can occupy.
uint32_t grid_of(uint64_t total_tasks, uint32_t *ctas, int kernel) {
  if (!kvf_kernel_is_spread(kernel)) return *ctas = lower_ctas(total_tasks, *ctas);
  uint32_t grid = spread_grid(total_tasks, *ctas, kernel);
  if (grid < *ctas) *ctas = grid;
  return grid;
}

cudaError_t finish_launch(cudaStream_t stream) {
  cudaError_t err = cudaGetLastError();
#ifdef KVF_DEBUG_SYNC
  if (err == cudaSuccess) err = cudaStreamSynchronize(stream);
#else
  (void)stream;
#endif
  return err;
}

// A warp walk over a parameter blob as a programmatic dependent of the
// stream's previous kernel (launch.h: overlap).
template <int N, int K>
cudaError_t launch_overlapped(const ParamBlob<N> &pb, uint32_t grid, cudaStream_t stream) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(WalkShape<K>::threads);
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, kvf_walk_kernel_p<N, K>, pb);
}

template <int N>
cudaError_t launch_p(const void *blob, uint32_t grid, int kernel, int overlap, cudaStream_t stream) {
  // The launch copies the parameters when it is called: blob may be reused
  // at once. Bytes past the blob are copied too and never read.
  const ParamBlob<N> *pb = static_cast<const ParamBlob<N> *>(blob);
  if (overlap && kernel != KVF_KERNEL_GRID_STRIDE) {
    cudaError_t e = kernel == KVF_KERNEL_WALK_SPREAD ? launch_overlapped<N, KVF_KERNEL_WALK_SPREAD>(*pb, grid, stream)
                    : kernel == KVF_KERNEL_WALK_SPREAD_SHALLOW
                        ? launch_overlapped<N, KVF_KERNEL_WALK_SPREAD_SHALLOW>(*pb, grid, stream)
                        : launch_overlapped<N, KVF_KERNEL_WALK>(*pb, grid, stream);
    if (e != cudaSuccess) return e;
    return finish_launch(stream);
  }
  if (kernel == KVF_KERNEL_WALK_SPREAD)
    kvf_walk_kernel_p<N, KVF_KERNEL_WALK_SPREAD><<<grid, kSpreadThreads, 0, stream>>>(*pb);
  else if (kernel == KVF_KERNEL_WALK_SPREAD_SHALLOW)
    kvf_walk_kernel_p<N, KVF_KERNEL_WALK_SPREAD_SHALLOW><<<grid, kSpreadThreads, 0, stream>>>(*pb);
  else if (kernel == KVF_KERNEL_WALK)
    kvf_walk_kernel_p<N, KVF_KERNEL_WALK><<<grid, kThreads, 0, stream>>>(*pb);
  else
    kvf_xfer_kernel_p<N><<<grid, kThreads, 0, stream>>>(*pb);
  return finish_launch(stream);
}

}  // namespace

extern "C" int kvf_kernel_threads(void) { return kThreads; }

// Declared in kernels/launch.h. The walks wait only where they were
// compiled for compute capability 9.0 (griddepcontrol): a build for older
// GPUs run on a newer one through PTX must not overlap its launches.
extern "C" int kvf_kernel_can_overlap(void) {
  cudaFuncAttributes a;
  if (cudaFuncGetAttributes(&a, kvf_walk_kernel_p<kParamSizes[0], KVF_KERNEL_WALK_SPREAD>) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return a.ptxVersion >= 90;
}

// Declared in kernels/launch.h (which says what it does).
extern "C" cudaError_t kvf_kernel_launch(const void *device_blob, uint64_t total_tasks, uint32_t *ctas, int kernel,
                                         cudaStream_t stream) {
  const uint32_t grid = grid_of(total_tasks, ctas, kernel);
  const char *blob = static_cast<const char *>(device_blob);
  if (kernel == KVF_KERNEL_WALK_SPREAD)
    kvf_walk_kernel<KVF_KERNEL_WALK_SPREAD><<<grid, kSpreadThreads, 0, stream>>>(blob);
  else if (kernel == KVF_KERNEL_WALK_SPREAD_SHALLOW)
    kvf_walk_kernel<KVF_KERNEL_WALK_SPREAD_SHALLOW><<<grid, kSpreadThreads, 0, stream>>>(blob);
  else if (kernel == KVF_KERNEL_WALK)
    kvf_walk_kernel<KVF_KERNEL_WALK><<<grid, kThreads, 0, stream>>>(blob);
  else
    kvf_xfer_kernel<<<grid, kThreads, 0, stream>>>(blob);
  return finish_launch(stream);
}

extern "C" size_t kvf_kernel_param_room(size_t blob_bytes) {
  for (int n : kParamSizes)
    if (blob_bytes <= (size_t)n) return (size_t)n;
  return 0;
}

extern "C" cudaError_t kvf_kernel_launch_params(const void *host_blob, size_t blob_bytes, uint64_t total_tasks,
                                                uint32_t *ctas, int kernel, int overlap, cudaStream_t stream) {
  const size_t room = kvf_kernel_param_room(blob_bytes);
  if (!room) return cudaErrorInvalidValue;
  const uint32_t grid = grid_of(total_tasks, ctas, kernel);
  switch (room) {
    case kParamSizes[0]: return launch_p<kParamSizes[0]>(host_blob, grid, kernel, overlap, stream);
    case kParamSizes[1]: return launch_p<kParamSizes[1]>(host_blob, grid, kernel, overlap, stream);
    case kParamSizes[2]: return launch_p<kParamSizes[2]>(host_blob, grid, kernel, overlap, stream);
    case kParamSizes[3]: return launch_p<kParamSizes[3]>(host_blob, grid, kernel, overlap, stream);
    case kParamSizes[4]: return launch_p<kParamSizes[4]>(host_blob, grid, kernel, overlap, stream);
    case kParamSizes[5]: return launch_p<kParamSizes[5]>(host_blob, grid, kernel, overlap, stream);
    default: return launch_p<kParamSizes[6]>(host_blob, grid, kernel, overlap, stream);
  }
}

namespace {

template <int N> cudaError_t preload_size() {
  cudaFuncAttributes a;
  cudaError_t e = cudaFuncGetAttributes(&a, kvf_xfer_kernel_p<N>);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&a, kvf_walk_kernel_p<N, KVF_KERNEL_WALK>);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&a, kvf_walk_kernel_p<N, KVF_KERNEL_WALK_SPREAD>);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&a, kvf_walk_kernel_p<N, KVF_KERNEL_WALK_SPREAD_SHALLOW>);
  return e;
}

}  // namespace

extern "C" cudaError_t kvf_kernel_preload(void) {
  // Module loading is lazy by default (CUDA_MODULE_LOADING=LAZY): querying
  // each variant's attributes loads it now rather than at a first call.
  cudaFuncAttributes a;
  cudaError_t e = cudaFuncGetAttributes(&a, kvf_xfer_kernel);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&a, kvf_walk_kernel<KVF_KERNEL_WALK>);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&a, kvf_walk_kernel<KVF_KERNEL_WALK_SPREAD>);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&a, kvf_walk_kernel<KVF_KERNEL_WALK_SPREAD_SHALLOW>);
  if (e == cudaSuccess) e = preload_size<kParamSizes[0]>();
  if (e == cudaSuccess) e = preload_size<kParamSizes[1]>();
  if (e == cudaSuccess) e = preload_size<kParamSizes[2]>();
  if (e == cudaSuccess) e = preload_size<kParamSizes[3]>();
  if (e == cudaSuccess) e = preload_size<kParamSizes[4]>();
  if (e == cudaSuccess) e = preload_size<kParamSizes[5]>();
  if (e == cudaSuccess) e = preload_size<kParamSizes[6]>();
  return e;
}
