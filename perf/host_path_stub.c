/* perf/host_path_stub.c - a CUDA runtime that does the work on the CPU at
 * once, for perf/kvf_host_path: kvferry's own host time per call, and the
 * bytes its GPU routes move, on a machine without a GPU.
 *
 * Linked in place of libcudart and of kernels/xfer_kernel.cu (their symbols
 * are defined here, so the linker never pulls those from libkvferry.a).
 * "Device" memory is host memory in a registry that cudaPointerGetAttributes
 * answers from; pinned memory is registered as host. Work runs when it is
 * enqueued, in the order the calls come: kernel launches copy their blob's
 * tasks with the CPU path (kvf_blob_run_cpu), copies are memcpy, each
 * checked to lie inside one allocation the stub made (allocations have their
 * exact sizes, so ASan sees an overrun past one). Running work in the order
 * it is enqueued is one schedule CUDA allows, so a plan that moves the
 * wrong bytes fails here as on a GPU. The converse does not hold: a missing
 * wait between streams (a staging buffer reused too early, the straight
 * part against the kernels) still moves the right bytes here. Events
 * complete at once and time the host between their records; streams are
 * idle, so the branches for a busy stream are not taken, unless the harness
 * makes a stream answer "not ready" to its next few queries
 * (kvf_host_stub_stream_busy: the event a caller records just before a
 * call, which a GPU completes a few us later). What this
 * does not model either: the driver's own time, concurrency, and any route
 * choice that follows measured device time (each call reports its path).
 *
 * Stream memory operations (cuStreamWriteValue64, cuStreamWaitValue64) act
 * on the word at once too; a wait whose value is not there when it is
 * enqueued is counted as early and fails: in this schedule, as on a GPU
 * whose streams share a hardware queue, it waits for work behind it and
 * never ends (kvferry's deferred calls must never enqueue one).
 *
 * kvf_host_stub_execute(0) makes the work a no-op, so that a timing loop
 * measures only kvferry's planning and the calls it makes. Calls from
 * several threads must be ordered (one happens before the next), as the
 * harness's deferred calls are: a call, then a join that waits for the
 * context's thread to have enqueued it. */
#define _GNU_SOURCE /* clock_gettime (common/clock.h) */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda.h>
#include <cuda_runtime_api.h>

#include "common/clock.h"
#include "kernels/launch.h"
#include "kernels/plan.h"
#include "perf/host_path_stub.h"

/* ---- memory registry ---------------------------------------------------- */

typedef struct stub_range {
  char *base;
  size_t size;
  int device; /* 1: answers as device memory, 0: as pinned host memory */
} stub_range;

static stub_range *g_ranges;
static size_t g_num_ranges, g_cap_ranges;
static int g_execute = 1;
static kvf_host_stub_counts g_counts;

static void *stub_alloc(size_t size, int device) {
  if (g_num_ranges == g_cap_ranges) {
    size_t cap = g_cap_ranges ? g_cap_ranges * 2 : 64;
    stub_range *p = realloc(g_ranges, cap * sizeof *p);
    if (!p) return NULL;
    g_ranges = p;
    g_cap_ranges = cap;
  }
  /* 256-byte aligned like cudaMalloc, of exactly the size asked (at least
   * one byte, so that every allocation has its own address). */
  void *b = NULL;
  if (posix_memalign(&b, 256, size ? size : 1)) return NULL;
  g_ranges[g_num_ranges++] = (stub_range){b, size ? size : 1, device};
  return b;
}

/* The allocation holding [p, p + n) whole, or NULL. */
static stub_range *stub_find_span(const void *p, size_t n) {
  const uintptr_t at = (uintptr_t)p;
  for (size_t i = 0; i < g_num_ranges; i++) {
    const uintptr_t lo = (uintptr_t)g_ranges[i].base;
    if (at >= lo && at - lo < g_ranges[i].size) return g_ranges[i].size - (at - lo) >= n ? &g_ranges[i] : NULL;
  }
  return NULL;
}

static stub_range *stub_find(const void *p) { return stub_find_span(p, 1); }

/* A copy's two sides lie inside the stub's allocations (kvferry copies
 * only between device and pinned memory). Checked only where the work runs:
 * a linear search a side, which a timing loop must not count as kvferry's. */
static int copy_in_bounds(void *dst, const void *src, size_t n) {
  return !g_execute || n == 0 || (stub_find_span(dst, n) && stub_find_span(src, n));
}

static void stub_free(void *p) {
  for (size_t i = 0; i < g_num_ranges; i++)
    if (g_ranges[i].base == p) {
      free(p);
      g_ranges[i] = g_ranges[--g_num_ranges];
      return;
    }
}

void *kvf_host_stub_device_alloc(size_t size) { return stub_alloc(size, 1); }
void *kvf_host_stub_pinned_alloc(size_t size) { return stub_alloc(size, 0); }
void kvf_host_stub_free(void *p) { stub_free(p); }
void kvf_host_stub_execute(int on) { g_execute = on; }
void kvf_host_stub_counts_get(kvf_host_stub_counts *out) { *out = g_counts; }
static int g_mem_ops = 1;
void kvf_host_stub_mem_ops(int on) { g_mem_ops = on; }

/* ---- streams and events -------------------------------------------------- */

struct CUstream_st {
  unsigned long long id;
  unsigned busy_queries; /* cudaStreamQuery answers not ready this many more times */
};
struct CUevent_st {
  uint64_t recorded_ns;
};

static unsigned long long g_next_stream_id = 100;

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned int flags) {
  (void)flags;
  struct CUstream_st *p = calloc(1, sizeof *p);
  if (!p) return cudaErrorMemoryAllocation;
  p->id = g_next_stream_id++;
  *s = p;
  return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t s) {
  free(s);
  return cudaSuccess;
}
cudaError_t cudaStreamGetId(cudaStream_t s, unsigned long long *id) {
  /* The legacy and per-thread streams are small handles. */
  *id = (uintptr_t)s < 4096 ? (unsigned long long)(uintptr_t)s : s->id;
  return cudaSuccess;
}
cudaError_t cudaStreamIsCapturing(cudaStream_t s, enum cudaStreamCaptureStatus *status) {
  (void)s;
  *status = cudaStreamCaptureStatusNone;
  return cudaSuccess;
}
cudaError_t cudaStreamQuery(cudaStream_t s) {
  if ((uintptr_t)s >= 4096 && s->busy_queries > 0) {
    s->busy_queries--;
    return cudaErrorNotReady;
  }
  return cudaSuccess;
}

void kvf_host_stub_stream_busy(cudaStream_t s, unsigned queries) {
  if ((uintptr_t)s >= 4096) s->busy_queries = queries;
}
cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  (void)s;
  return cudaSuccess;
}
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned int flags) {
  (void)s, (void)e, (void)flags;
  g_counts.waits++;
  return cudaSuccess;
}
cudaError_t cudaThreadExchangeStreamCaptureMode(enum cudaStreamCaptureMode *mode) {
  (void)mode;
  return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned int flags) {
  (void)flags;
  struct CUevent_st *p = calloc(1, sizeof *p);
  if (!p) return cudaErrorMemoryAllocation;
  *e = p;
  return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t e) {
  free(e);
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
  (void)s;
  e->recorded_ns = kvf_now_ns();
  g_counts.records++;
  return cudaSuccess;
}
cudaError_t cudaEventQuery(cudaEvent_t e) {
  (void)e;
  return cudaSuccess;
}
cudaError_t cudaEventSynchronize(cudaEvent_t e) {
  (void)e;
  return cudaSuccess;
}
cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end) {
  *ms = end->recorded_ns > start->recorded_ns ? (float)(end->recorded_ns - start->recorded_ns) / 1e6f : 0.0f;
  return cudaSuccess;
}

/* ---- memory -------------------------------------------------------------- */

cudaError_t cudaMallocAsync(void **p, size_t size, cudaStream_t s) {
  (void)s;
  *p = stub_alloc(size, 1);
  return *p ? cudaSuccess : cudaErrorMemoryAllocation;
}
cudaError_t cudaFreeAsync(void *p, cudaStream_t s) {
  (void)s;
  stub_free(p);
  return cudaSuccess;
}
cudaError_t cudaHostAlloc(void **p, size_t size, unsigned int flags) {
  (void)flags;
  *p = stub_alloc(size, 0);
  return *p ? cudaSuccess : cudaErrorMemoryAllocation;
}
cudaError_t cudaFreeHost(void *p) {
  stub_free(p);
  return cudaSuccess;
}
cudaError_t cudaHostGetDevicePointer(void **dev, void *host, unsigned int flags) {
  (void)flags;
  *dev = host;
  return cudaSuccess;
}
cudaError_t cudaPointerGetAttributes(struct cudaPointerAttributes *a, const void *p) {
  memset(a, 0, sizeof *a);
  const stub_range *r = stub_find(p);
  a->type = !r ? cudaMemoryTypeUnregistered : r->device ? cudaMemoryTypeDevice : cudaMemoryTypeHost;
  a->device = r ? 0 : -2;
  a->devicePointer = r ? (void *)p : NULL;
  a->hostPointer = r && !r->device ? (void *)p : NULL;
  g_counts.pointer_queries++;
  return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t n, enum cudaMemcpyKind kind, cudaStream_t s) {
  (void)kind, (void)s;
  if (!copy_in_bounds(dst, src, n)) return cudaErrorInvalidValue;
  if (g_execute) memcpy(dst, src, n);
  g_counts.copies++;
  return cudaSuccess;
}
cudaError_t cudaMemcpyBatchAsync(void *const *dsts, const void *const *srcs, const size_t *sizes, size_t count,
                                 struct cudaMemcpyAttributes *attrs, size_t *attrs_idxs, size_t num_attrs,
                                 cudaStream_t s) {
  (void)attrs, (void)attrs_idxs, (void)num_attrs, (void)s;
  if (count == 0) return cudaErrorInvalidValue;
  for (size_t i = 0; i < count; i++)
    if (sizes[i] == 0 || !copy_in_bounds(dsts[i], srcs[i], sizes[i])) return cudaErrorInvalidValue;
  if (g_execute)
    for (size_t i = 0; i < count; i++) memcpy(dsts[i], srcs[i], sizes[i]);
  g_counts.batch_copies++;
  g_counts.batch_runs += count;
  return cudaSuccess;
}

/* ---- devices, errors, the driver ------------------------------------------ */

cudaError_t cudaGetDeviceCount(int *n) {
  *n = 1;
  return cudaSuccess;
}
cudaError_t cudaGetDevice(int *d) {
  *d = 0;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int d) { return d == 0 ? cudaSuccess : cudaErrorInvalidDevice; }
cudaError_t cudaDeviceGetAttribute(int *v, enum cudaDeviceAttr attr, int d) {
  (void)d;
  switch (attr) {
  case cudaDevAttrMultiProcessorCount: *v = 132; break; /* an H200 */
  case cudaDevAttrComputeCapabilityMajor: *v = 9; break;
  default: *v = 0;
  }
  return cudaSuccess;
}
cudaError_t cudaDeviceCanAccessPeer(int *can, int d, int peer) {
  (void)d, (void)peer;
  *can = 0;
  return cudaSuccess;
}
cudaError_t cudaDeviceEnablePeerAccess(int peer, unsigned int flags) {
  (void)peer, (void)flags;
  return cudaErrorInvalidDevice;
}
cudaError_t cudaGetLastError(void) { return cudaSuccess; }
const char *cudaGetErrorString(cudaError_t e) { return e == cudaSuccess ? "no error" : "stub error"; }
const char *cudaGetErrorName(cudaError_t e) { return e == cudaSuccess ? "cudaSuccess" : "cudaErrorStub"; }
cudaError_t cudaDriverGetVersion(int *v) {
  *v = CUDART_VERSION;
  return cudaSuccess;
}
cudaError_t cudaFuncGetAttributes(struct cudaFuncAttributes *a, const void *f) {
  (void)f;
  memset(a, 0, sizeof *a);
  return cudaErrorInvalidDeviceFunction;
}
cudaError_t cudaLaunchKernelExC(const cudaLaunchConfig_t *config, const void *func, void **args) {
  (void)config, (void)func, (void)args;
  return cudaErrorNotSupported; /* only the deferred mode's waits launch through it */
}

/* The driver's entry points (host/core/cudawrap.c loads them all): those
 * that loading, its error messages and deferred calls call, typed as the
 * driver's; the rest (cuMem*: the memory providers, which the transfer
 * routes never call) stop the process if called, rather than run through
 * a pointer of another type. */
static CUresult CUDAAPI stub_cu_init(unsigned int flags) {
  (void)flags;
  return CUDA_SUCCESS;
}
static CUresult CUDAAPI stub_cu_driver_version(int *v) {
  *v = CUDART_VERSION;
  return CUDA_SUCCESS;
}
static CUresult CUDAAPI stub_cu_device_count(int *n) {
  *n = 1;
  return CUDA_SUCCESS;
}
static CUresult CUDAAPI stub_cu_error_string(CUresult r, const char **s) {
  *s = r == CUDA_SUCCESS             ? "no error"
       : r == CUDA_ERROR_ILLEGAL_STATE ? "a wait enqueued ahead of the write it waits for (stub)"
                                       : "stub error";
  return CUDA_SUCCESS;
}
static CUresult CUDAAPI stub_cu_error_name(CUresult r, const char **s) {
  *s = r == CUDA_SUCCESS ? "CUDA_SUCCESS" : r == CUDA_ERROR_ILLEGAL_STATE ? "CUDA_ERROR_ILLEGAL_STATE" : "CUDA_ERROR_STUB";
  return CUDA_SUCCESS;
}
static CUresult CUDAAPI stub_cu_device_get(CUdevice *d, int ordinal) {
  if (ordinal != 0) return CUDA_ERROR_INVALID_DEVICE;
  *d = 0;
  return CUDA_SUCCESS;
}
static CUresult CUDAAPI stub_cu_device_get_attribute(int *v, CUdevice_attribute attr, CUdevice d) {
  (void)d;
  *v = attr == CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS && g_mem_ops;
  return CUDA_SUCCESS;
}
static CUresult CUDAAPI stub_cu_stream_write_value64(CUstream s, CUdeviceptr addr, cuuint64_t value,
                                                     unsigned int flags) {
  (void)s, (void)flags;
  if (!stub_find_span((const void *)(uintptr_t)addr, sizeof(uint64_t))) return CUDA_ERROR_INVALID_VALUE;
  __atomic_store_n((uint64_t *)(uintptr_t)addr, (uint64_t)value, __ATOMIC_RELEASE);
  g_counts.value_writes++;
  g_counts.last_value_written = (uint64_t)value;
  return CUDA_SUCCESS;
}
static CUresult CUDAAPI stub_cu_stream_wait_value64(CUstream s, CUdeviceptr addr, cuuint64_t value,
                                                    unsigned int flags) {
  (void)s;
  if (!stub_find_span((const void *)(uintptr_t)addr, sizeof(uint64_t)) || flags != CU_STREAM_WAIT_VALUE_GEQ)
    return CUDA_ERROR_INVALID_VALUE;
  g_counts.value_waits++;
  g_counts.last_value_waited = (uint64_t)value;
  if (__atomic_load_n((const uint64_t *)(uintptr_t)addr, __ATOMIC_ACQUIRE) >= (uint64_t)value) return CUDA_SUCCESS;
  g_counts.early_waits++;
  return CUDA_ERROR_ILLEGAL_STATE;
}
static void stub_cu_not_modelled(void) {
  fprintf(stderr, "host_path_stub: a CUDA driver entry point it does not model was called\n");
  abort();
}

cudaError_t cudaGetDriverEntryPointByVersion(const char *symbol, void **fn, unsigned int version,
                                             unsigned long long flags,
                                             enum cudaDriverEntryPointQueryResult *status) {
  (void)version, (void)flags;
  static const struct {
    const char *symbol;
    void *fn;
  } typed[] = {{"cuInit", (void *)stub_cu_init},
               {"cuDriverGetVersion", (void *)stub_cu_driver_version},
               {"cuDeviceGetCount", (void *)stub_cu_device_count},
               {"cuGetErrorString", (void *)stub_cu_error_string},
               {"cuGetErrorName", (void *)stub_cu_error_name},
               {"cuDeviceGet", (void *)stub_cu_device_get},
               {"cuDeviceGetAttribute", (void *)stub_cu_device_get_attribute},
               {"cuStreamWriteValue64", (void *)stub_cu_stream_write_value64},
               {"cuStreamWaitValue64", (void *)stub_cu_stream_wait_value64}};
  *fn = (void *)stub_cu_not_modelled;
  for (size_t i = 0; i < sizeof typed / sizeof *typed; i++)
    if (!strcmp(symbol, typed[i].symbol)) *fn = typed[i].fn;
  if (status) *status = cudaDriverEntryPointSuccess;
  return cudaSuccess;
}

/* ---- the kernel's entry points (kernels/launch.h) ---------------------------- */

enum { kStubWarps = 16 }; /* kernels/xfer_kernel.cu: 512 threads a CTA */
static const size_t kStubParamSizes[] = {KVF_KERNEL_PARAM_SIZES};

int kvf_kernel_threads(void) { return kStubWarps * 32; }
int kvf_kernel_can_overlap(void) { return 1; }
cudaError_t kvf_kernel_preload(void) { return cudaSuccess; }
size_t kvf_kernel_param_room(size_t blob_bytes) {
  for (size_t i = 0; i < sizeof kStubParamSizes / sizeof *kStubParamSizes; i++)
    if (blob_bytes <= kStubParamSizes[i]) return kStubParamSizes[i];
  return 0;
}

static void stub_run(const void *blob, uint64_t total_tasks, uint32_t *ctas) {
  uint64_t useful = (total_tasks + kStubWarps - 1) / kStubWarps;
  if (useful < *ctas) *ctas = (uint32_t)(useful ? useful : 1);
  if (g_execute) kvf_blob_run_cpu(blob, 0, total_tasks);
  g_counts.launches++;
}

cudaError_t kvf_kernel_launch(const void *device_blob, uint64_t total_tasks, uint32_t *ctas, int kernel,
                              cudaStream_t stream) {
  (void)kernel, (void)stream;
  stub_run(device_blob, total_tasks, ctas);
  return cudaSuccess;
}

cudaError_t kvf_kernel_launch_params(const void *host_blob, size_t blob_bytes, uint64_t total_tasks, uint32_t *ctas,
                                     int kernel, int overlap, cudaStream_t stream) {
  (void)kernel, (void)overlap, (void)stream;
  size_t room = kvf_kernel_param_room(blob_bytes);
  if (!room) return cudaErrorInvalidValue;
  /* The launch copies the parameters: so does this, into an aligned block. */
  static _Alignas(256) unsigned char params[KVF_KERNEL_PARAM_MAX];
  memcpy(params, host_blob, room);
  stub_run(params, total_tasks, ctas);
  g_counts.param_launches++;
  return cudaSuccess;
}
