/* libkvferry_torch_alloc.so: the exportable allocator torch loads through
 * torch.cuda.CUDAPluggableAllocator (kvferry_torch_alloc.h says what each
 * entry point does and why).
 *
 * It is a leaf over libkvferry's public API: segments are kvf_mem_alloc
 * objects of the cumem provider, so libkvferry's own table of live
 * allocations is what kvf_mem_alloc_find consults for any interior pointer.
 * This library keeps a second, small table (base -> allocation) only to
 * know what torch may free. The one internal source it shares is kvferry's
 * logging (host/core/log.c, compiled in), so its lines read and filter like
 * libkvferry's (KVF_DEBUG, KVF_DEBUG_SUBSYS, KVF_DEBUG_FILE). The CUDA
 * runtime (linked statically, as in libkvferry and the CLI) is used for one
 * call: synchronizing the stream before a segment is unmapped. */
#define _GNU_SOURCE
#include "python/torch_alloc/kvferry_torch_alloc.h"

#include <dlfcn.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include <kvferry/status.h>

#include "host/core/log.h"

#ifdef KVF_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

/* One live segment. */
typedef struct kvf_ta_segment {
  void *base;            /* what kvf_torch_alloc returned */
  kvf_mem_alloc *alloc;  /* this library's reference */
  uint64_t size;         /* bytes after rounding */
  uint64_t requested;    /* bytes torch asked for */
  int device;
  struct kvf_ta_segment *next;
} kvf_ta_segment;

#define KVF_TA_BUCKETS 256u

/* Guards kvf_ta_table (every chain and every segment in it) and the two
 * counters. Held only for table updates, never across a driver call. */
static pthread_mutex_t kvf_ta_lock = PTHREAD_MUTEX_INITIALIZER;
static kvf_ta_segment *kvf_ta_table[KVF_TA_BUCKETS];
static uint64_t kvf_ta_segments;
static uint64_t kvf_ta_bytes;

/* Segment bases are granularity-aligned (2 MiB on H200): hash the bits above
 * a page, multiplicatively, so nearby segments spread over the buckets. */
static unsigned kvf_ta_bucket(const void *base) {
  uint64_t v = (uint64_t)(uintptr_t)base >> 12;
  return (unsigned)((v * UINT64_C(0x9E3779B97F4A7C15)) >> 56) % KVF_TA_BUCKETS;
}

void *kvf_torch_alloc(ssize_t size, int device, struct CUstream_st *stream) {
  (void)stream; /* cuMem allocation is not stream-ordered: usable on every stream at once */
  if (size <= 0) {
    KVF_WARN(MEM, "kvf_torch_alloc: size %zd on device %d: nothing to allocate (returning NULL)", size, device);
    return NULL;
  }
  kvf_mem_alloc_options options = KVF_MEM_ALLOC_OPTIONS_INIT;
  options.provider = KVF_MEM_PROVIDER_CUMEM;
  options.device = device;
  options.size = (uint64_t)size;
  kvf_mem_alloc *alloc = NULL;
  kvf_status st = kvf_mem_alloc_create(&options, &alloc);
  if (st != KVF_SUCCESS) {
    /* kvf_last_error() keeps the message for the caller's thread too. */
    KVF_WARN(MEM, "kvf_torch_alloc: %zd bytes of exportable memory on device %d: %s: %s (returning NULL: torch "
             "reports it as out of memory)",
             size, device, kvf_status_string(st), kvf_last_error());
    return NULL;
  }
  kvf_ta_segment *seg = calloc(1, sizeof *seg);
  if (seg == NULL) {
    kvf_mem_alloc_destroy(alloc);
    KVF_WARN(MEM, "kvf_torch_alloc: no host memory for the segment record (returning NULL)");
    return NULL;
  }
  seg->base = kvf_mem_alloc_ptr(alloc);
  seg->alloc = alloc;
  seg->size = kvf_mem_alloc_size(alloc);
  seg->requested = (uint64_t)size;
  seg->device = device;
  unsigned b = kvf_ta_bucket(seg->base);
  pthread_mutex_lock(&kvf_ta_lock);
  seg->next = kvf_ta_table[b];
  kvf_ta_table[b] = seg;
  kvf_ta_segments++;
  kvf_ta_bytes += seg->size;
  pthread_mutex_unlock(&kvf_ta_lock);
  KVF_INFO(MEM, "kvf_torch_alloc: %zd bytes on device %d: segment %p of %" PRIu64 " bytes", size, device, seg->base,
           seg->size);
  return seg->base;
}

/* Wait for the work queued on `stream` (the legacy default stream of
 * `device` when NULL) before its memory is unmapped: cuMemUnmap, unlike
 * cudaFree, does not wait (torch's expandable segments synchronize for the
 * same reason). A failure is logged; the caller frees anyway. */
static void kvf_ta_wait(struct CUstream_st *stream, int device) {
#ifdef KVF_WITH_CUDA
  cudaStream_t s = (cudaStream_t)stream;
  int prev = -1;
  cudaError_t e = cudaSuccess;
  if (s == NULL) {
    /* The legacy stream is per device: make `device` current for the call. */
    e = cudaGetDevice(&prev);
    if (e == cudaSuccess && prev != device) e = cudaSetDevice(device);
  }
  enum cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (e == cudaSuccess) e = cudaStreamIsCapturing(s, &capture);
  if (e == cudaSuccess && capture != cudaStreamCaptureStatusNone) {
    KVF_WARN(MEM, "kvf_torch_free: stream %p is being captured into a CUDA graph: freeing without waiting for it",
             (void *)stream);
  } else if (e == cudaSuccess) {
    e = cudaStreamSynchronize(s);
  }
  if (e != cudaSuccess)
    KVF_WARN(MEM, "kvf_torch_free: waiting for stream %p on device %d: %s (%s); freeing anyway", (void *)stream,
             device, cudaGetErrorName(e), cudaGetErrorString(e));
  if (prev >= 0 && prev != device) (void)cudaSetDevice(prev);
#else
  (void)stream;
  (void)device;
#endif
}

void kvf_torch_free(void *ptr, ssize_t size, int device, struct CUstream_st *stream) {
  if (ptr == NULL) return;
  unsigned b = kvf_ta_bucket(ptr);
  kvf_ta_segment *seg = NULL;
  pthread_mutex_lock(&kvf_ta_lock);
  for (kvf_ta_segment **p = &kvf_ta_table[b]; *p != NULL; p = &(*p)->next)
    if ((*p)->base == ptr) {
      seg = *p;
      *p = seg->next;
      kvf_ta_segments--;
      kvf_ta_bytes -= seg->size;
      break;
    }
  pthread_mutex_unlock(&kvf_ta_lock);
  if (seg == NULL) {
    KVF_WARN(MEM, "kvf_torch_free: %p is not a segment kvf_torch_alloc returned (or it was freed already): ignored",
             ptr);
    return;
  }
  if (size != (ssize_t)seg->requested || device != seg->device)
    KVF_WARN(MEM, "kvf_torch_free: segment %p was allocated as %" PRIu64 " bytes on device %d, freed as %zd bytes "
             "on device %d; freeing it as allocated",
             ptr, seg->requested, seg->device, size, device);
  kvf_ta_wait(stream, seg->device);
  KVF_INFO(MEM, "kvf_torch_free: segment %p of %" PRIu64 " bytes on device %d", ptr, seg->size, seg->device);
  kvf_mem_alloc_destroy(seg->alloc);
  free(seg);
}

kvf_status kvf_torch_alloc_identity(const void *ptr, kvf_mem_identity *out) {
  if (out == NULL) return KVF_ERR_INVALID_ARGUMENT;
  uintptr_t p = (uintptr_t)ptr;
  kvf_status st = KVF_ERR_NOT_FOUND;
  pthread_mutex_lock(&kvf_ta_lock);
  for (unsigned b = 0; b < KVF_TA_BUCKETS && st != KVF_SUCCESS; b++)
    for (kvf_ta_segment *s = kvf_ta_table[b]; s != NULL; s = s->next)
      if (p >= (uintptr_t)s->base && p - (uintptr_t)s->base < s->size) {
        st = kvf_mem_alloc_identity(s->alloc, out);
        break;
      }
  pthread_mutex_unlock(&kvf_ta_lock);
  return st;
}

void kvf_torch_alloc_stats(uint64_t *segments, uint64_t *bytes) {
  pthread_mutex_lock(&kvf_ta_lock);
  if (segments) *segments = kvf_ta_segments;
  if (bytes) *bytes = kvf_ta_bytes;
  pthread_mutex_unlock(&kvf_ta_lock);
}

/* A string literal of libkvferry's, so an address inside its image. */
const void *kvf_torch_alloc_libkvferry_anchor(void) { return kvf_version_string(); }

const char *kvf_torch_alloc_libkvferry_path(void) {
  Dl_info info;
  memset(&info, 0, sizeof info);
  if (dladdr(kvf_version_string(), &info) == 0 || info.dli_fname == NULL) return "";
  return info.dli_fname;
}
