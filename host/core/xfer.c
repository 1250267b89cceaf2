/* Transfer contexts: a geometry bound to a CUDA device or to the host
 * backend. A call checks the request, builds its launch blob (kernels/plan.h)
 * and either launches the kernel on the caller's stream or copies on CPU
 * threads. */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <kvferry/transfer.h>

#include "common/error.h"
#include "common/versioned.h"
#include "geometry/geometry_internal.h"
#include "host/core/cudawrap.h"
#include "host/core/log.h"
#include "host/core/param.h"
#include "host/core/xfer_internal.h"
#include "kernels/plan.h"

#ifdef KVF_WITH_CUDA
#include <cuda_runtime_api.h>

#include "kernels/launch.h"

/* Calls in flight at once before a call waits for the oldest one's tables. */
#define KVF_STAGING_SLOTS 8

/* Tables of one call: built in pinned memory, copied to the device in
 * stream order, read by the kernel. Reused once `done` has fired. */
typedef struct staging {
  void *pinned;
  void *device;
  size_t cap;
  cudaEvent_t done;
  int in_use;
} staging;

/* Buffers that must outlive the context's calls: outgrown staging, and the
 * tables of calls captured into graphs (replayed later). Freed at destroy. */
typedef struct retired {
  void *pinned;
  void *device;
  struct retired *next;
} retired;
#endif

struct kvf_xfer {
  const kvf_geometry *geometry;
  int device;
  uint32_t max_sms;
  uint32_t host_threads;
  kvf_plan plan[2];
  pthread_mutex_t lock; /* guards everything below */
  kvf_xfer_stats last;
  void *host_blob;
  size_t host_blob_cap;
#ifdef KVF_WITH_CUDA
  int cuda_ready; /* the device was valid and set: destroy has CUDA work to undo */
  int sm_count;
  cudaStream_t private_stream; /* orders the device allocations of staging */
  staging slots[KVF_STAGING_SLOTS];
  uint32_t next_slot;
  retired *retired;
  /* The copy-engine path between the GPU and host memory: objects are
   * gathered into (scattered from) device staging buffers by the kernel, and
   * the PCIe leg is a DMA on ce_stream, which costs no SM. */
  cudaStream_t ce_stream;
  void *stage[2];
  size_t stage_cap;
  cudaEvent_t stage_free[2];  /* the buffer's last reader is done */
  cudaEvent_t stage_ready[2]; /* the buffer holds what the next leg reads */
  cudaEvent_t fork, join;
  uint32_t next_stage;
#endif
};

/* ---- test hooks (host/core/xfer_internal.h) -------------------------------- */

/* The batch whose kernel launch staged calls refuse; -1: none. */
static int64_t test_fail_at_batch = -1;

void kvf_xfer_test_fail_at_batch(int64_t batch) {
  __atomic_store_n(&test_fail_at_batch, batch < 0 ? -1 : batch, __ATOMIC_RELAXED);
}

size_t kvf_xfer_test_stage_bytes(const kvf_xfer *x) {
#ifdef KVF_WITH_CUDA
  return x ? x->stage_cap : 0;
#else
  (void)x;
  return 0;
#endif
}

kvf_stream kvf_xfer_test_ce_stream(const kvf_xfer *x) {
#ifdef KVF_WITH_CUDA
  return x ? (kvf_stream)x->ce_stream : NULL;
#else
  (void)x;
  return NULL;
#endif
}

const char *kvf_xfer_route_name(kvf_xfer_route route) {
  switch (route) {
  case KVF_ROUTE_HOST: return "host";
  case KVF_ROUTE_D2D: return "d2d";
  case KVF_ROUTE_D2H: return "d2h";
  case KVF_ROUTE_H2D: return "h2d";
  case KVF_ROUTE_PEER: return "peer";
  case KVF_ROUTE_HOST_TO_HOST: return "h2h";
  }
  return "unknown";
}

/* ---- the host backend ------------------------------------------------------ */

typedef struct cpu_work {
  const void *blob;
  uint64_t first, end;
} cpu_work;

static void *cpu_worker(void *arg) {
  cpu_work *w = arg;
  kvf_blob_run_cpu(w->blob, w->first, w->end);
  return NULL;
}

/* Threads pay off only for large copies: one thread per 4 MiB, capped. */
static void run_on_cpu(const kvf_xfer *x, const void *blob) {
  const kvf_blob_header *h = blob;
  uint64_t cap = x->host_threads ? x->host_threads : (uint64_t)kvf_param_xfer_host_threads();
  uint64_t n = h->payload_bytes / (4u << 20) + 1;
  if (n > cap) n = cap;
  if (n > 64) n = 64;
  if (n > h->total_tasks) n = h->total_tasks;
  if (n <= 1) {
    kvf_blob_run_cpu(blob, 0, h->total_tasks);
    return;
  }
  pthread_t tid[64];
  cpu_work work[64];
  int joined[64] = {0};
  for (uint64_t i = 0; i < n; i++) {
    work[i] = (cpu_work){blob, h->total_tasks * i / n, h->total_tasks * (i + 1) / n};
    /* The calling thread takes share 0; a share whose thread cannot start
     * is done here too. */
    if (i > 0 && pthread_create(&tid[i], NULL, cpu_worker, &work[i]) == 0) joined[i] = 1;
  }
  for (uint64_t i = 0; i < n; i++)
    if (!joined[i]) kvf_blob_run_cpu(blob, work[i].first, work[i].end);
  for (uint64_t i = 1; i < n; i++)
    if (joined[i]) pthread_join(tid[i], NULL);
}

/* ---- creation ------------------------------------------------------------ */

kvf_status kvf_xfer_create(const kvf_geometry *g, const kvf_xfer_options *options, kvf_xfer **out) {
  kvf_xfer_options local = KVF_XFER_OPTIONS_INIT;
  const kvf_xfer_options *opt = &local;
  if (!g || !out) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_xfer_create: geometry or out is NULL");
  if (!g->finalized) return kvf_fail(KVF_ERR_STATE, "kvf_xfer_create: the geometry is not finalized");
  if (options) {
    kvf_status vs = KVF_VERSIONED_IN(kvf_xfer_options, &local, options);
    if (vs != KVF_SUCCESS) return vs;
  }
  if (opt->device < KVF_DEVICE_HOST)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "device %d: a CUDA device ordinal or KVF_DEVICE_HOST (-1)",
                    opt->device);
  if (opt->host_threads > 64)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "host_threads %u: at most 64", opt->host_threads);
  kvf_xfer *x = calloc(1, sizeof *x);
  if (!x) return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "kvf_xfer_create: out of memory");
  x->geometry = g;
  x->device = opt->device;
  x->max_sms = opt->max_sms;
  x->host_threads = opt->host_threads;
  pthread_mutex_init(&x->lock, NULL);
  kvf_xfer_stats stats = KVF_XFER_STATS_INIT;
  x->last = stats;
  kvf_status st;
  if ((st = kvf_plan_build(g, KVF_FORMAT_CANONICAL, &x->plan[0])) ||
      (st = kvf_plan_build(g, KVF_FORMAT_NATIVE, &x->plan[1])))
    goto fail;
  if (x->device == KVF_DEVICE_HOST) {
    *out = x;
    return KVF_SUCCESS;
  }
#ifdef KVF_WITH_CUDA
  if ((st = kvf_cuda_load())) goto fail;
  int count = 0, prev = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || opt->device >= count) {
    cudaGetLastError();
    st = kvf_fail(KVF_ERR_INVALID_ARGUMENT, "device %d: no such CUDA device (%d visible)", opt->device, count);
    goto fail;
  }
  cudaGetDevice(&prev);
  cudaError_t e = cudaSetDevice(x->device);
  x->cuda_ready = e == cudaSuccess;
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&x->sm_count, cudaDevAttrMultiProcessorCount, x->device);
  if (e == cudaSuccess) e = cudaStreamCreateWithFlags(&x->private_stream, cudaStreamNonBlocking);
  for (int i = 0; e == cudaSuccess && i < KVF_STAGING_SLOTS; i++)
    e = cudaEventCreateWithFlags(&x->slots[i].done, cudaEventDisableTiming);
  if (e == cudaSuccess) e = cudaStreamCreateWithFlags(&x->ce_stream, cudaStreamNonBlocking);
  for (int i = 0; e == cudaSuccess && i < 2; i++) {
    e = cudaEventCreateWithFlags(&x->stage_free[i], cudaEventDisableTiming);
    if (e == cudaSuccess) e = cudaEventCreateWithFlags(&x->stage_ready[i], cudaEventDisableTiming);
  }
  if (e == cudaSuccess) e = cudaEventCreateWithFlags(&x->fork, cudaEventDisableTiming);
  if (e == cudaSuccess) e = cudaEventCreateWithFlags(&x->join, cudaEventDisableTiming);
  cudaSetDevice(prev);
  if (e != cudaSuccess) {
    st = kvf_fail(KVF_ERR_CUDA, "kvf_xfer_create: device %d: %s", x->device, cudaGetErrorString(e));
    cudaGetLastError();
    goto fail;
  }
  KVF_INFO(XFER, "transfer context on device %d: %d SMs, %u + %u segments", x->device, x->sm_count,
           x->plan[0].num_segments, x->plan[1].num_segments);
  *out = x;
  return KVF_SUCCESS;
#else
  st = kvf_fail(KVF_ERR_NO_DRIVER, "device %d: this build of kvferry has no CUDA (use KVF_DEVICE_HOST)", opt->device);
#endif
fail:
  kvf_xfer_destroy(x);
  return st;
}

void kvf_xfer_destroy(kvf_xfer *x) {
  if (!x) return;
#ifdef KVF_WITH_CUDA
  if (x->device != KVF_DEVICE_HOST && x->cuda_ready) {
    int prev = 0;
    cudaGetDevice(&prev);
    cudaSetDevice(x->device);
    /* Wait for this context's own calls only, then free what they read. */
    for (int i = 0; i < KVF_STAGING_SLOTS; i++) {
      staging *s = &x->slots[i];
      if (s->in_use && s->done) cudaEventSynchronize(s->done);
      if (s->device) cudaFreeAsync(s->device, x->private_stream);
      if (s->pinned) cudaFreeHost(s->pinned);
      if (s->done) cudaEventDestroy(s->done);
    }
    while (x->retired) {
      retired *r = x->retired;
      x->retired = r->next;
      if (r->device) cudaFreeAsync(r->device, x->private_stream);
      if (r->pinned) cudaFreeHost(r->pinned);
      free(r);
    }
    for (int i = 0; i < 2; i++) {
      /* Recorded events only: an event never recorded is complete. */
      if (x->stage_free[i]) cudaEventSynchronize(x->stage_free[i]);
      if (x->stage_ready[i]) cudaEventSynchronize(x->stage_ready[i]);
      if (x->stage[i]) cudaFreeAsync(x->stage[i], x->private_stream);
      if (x->stage_free[i]) cudaEventDestroy(x->stage_free[i]);
      if (x->stage_ready[i]) cudaEventDestroy(x->stage_ready[i]);
    }
    if (x->join) cudaEventSynchronize(x->join);
    if (x->fork) cudaEventDestroy(x->fork);
    if (x->join) cudaEventDestroy(x->join);
    if (x->ce_stream) cudaStreamDestroy(x->ce_stream);
    if (x->private_stream) {
      cudaStreamSynchronize(x->private_stream);
      cudaStreamDestroy(x->private_stream);
    }
    cudaGetLastError();
    cudaSetDevice(prev);
  }
#endif
  kvf_plan_free(&x->plan[0]);
  kvf_plan_free(&x->plan[1]);
  free(x->host_blob);
  pthread_mutex_destroy(&x->lock);
  free(x);
}

kvf_status kvf_xfer_last_stats(const kvf_xfer *x, kvf_xfer_stats *out) {
  if (!x || !out) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_xfer_last_stats: NULL argument");
  pthread_mutex_lock((pthread_mutex_t *)&x->lock);
  kvf_xfer_stats last = x->last;
  pthread_mutex_unlock((pthread_mutex_t *)&x->lock);
  return KVF_VERSIONED_OUT(kvf_xfer_stats, out, &last);
}

/* ---- the CUDA backend -------------------------------------------------------- */

#ifdef KVF_WITH_CUDA
typedef enum mem_kind { MEM_LOCAL, MEM_HOST, MEM_PEER } mem_kind;

/* Where a pointer lives, as the kernel will reach it. Pageable memory and
 * GPUs without peer access are refused, naming the field. */
static kvf_status classify(kvf_xfer *x, const void *ptr, const char *field, uint64_t index, mem_kind *kind) {
  struct cudaPointerAttributes a;
  cudaError_t e = cudaPointerGetAttributes(&a, ptr);
  if (e != cudaSuccess) {
    cudaGetLastError();
    a.type = cudaMemoryTypeUnregistered;
  }
  switch (a.type) {
  case cudaMemoryTypeHost:
    *kind = MEM_HOST;
    return KVF_SUCCESS;
  case cudaMemoryTypeManaged:
  case cudaMemoryTypeDevice:
    if (a.device == x->device) {
      *kind = MEM_LOCAL;
      return KVF_SUCCESS;
    }
    {
      int can = 0;
      cudaDeviceCanAccessPeer(&can, x->device, a.device);
      if (!can)
        return kvf_fail(KVF_ERR_INVALID_ARGUMENT,
                        "%s[%llu] %p: memory of device %d, which device %d cannot reach (no peer access)", field,
                        (unsigned long long)index, ptr, a.device, x->device);
      e = cudaDeviceEnablePeerAccess(a.device, 0);
      if (e != cudaSuccess && e != cudaErrorPeerAccessAlreadyEnabled) {
        cudaGetLastError();
        return kvf_fail(KVF_ERR_CUDA, "%s[%llu]: enabling peer access from device %d to %d: %s", field,
                        (unsigned long long)index, x->device, a.device, cudaGetErrorString(e));
      }
      cudaGetLastError();
      *kind = MEM_PEER;
      return KVF_SUCCESS;
    }
  default:
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT,
                    "%s[%llu] %p: pageable host memory, which a kernel cannot reach; allocate it with "
                    "cudaHostAlloc/cudaMallocHost or register it with cudaHostRegister",
                    field, (unsigned long long)index, ptr);
  }
}

/* The route of a request: where its source and destination live. */
static kvf_status route_of(kvf_xfer *x, const kvf_copy_request *r, int gather, kvf_xfer_route *route,
                           int *stageable) {
  const kvf_geometry *g = x->geometry;
  int cache_seen[3] = {0, 0, 0}, obj_seen[3] = {0, 0, 0};
  kvf_status st;
  mem_kind k = MEM_LOCAL;
  for (uint32_t gi = 0; gi < g->num_groups; gi++) {
    if (!r->groups[gi].block_ids || !r->groups[gi].count) continue;
    const kvf_group *gr = &g->groups[gi];
    for (uint32_t l = 0; l < gr->num_views; l++) {
      uint32_t reg = g->views[gr->views[l]].desc.region;
      if ((st = classify(x, r->region_bases[reg], "region_bases", reg, &k))) return st;
      cache_seen[k] = 1;
    }
  }
  /* objects may be NULL when nothing moves (every block skipped). */
  uint64_t n = r->objects ? kvf_copy_request_chunks(g, r) * g->num_object_groups : 0;
  for (uint64_t i = 0; i < n; i++) {
    if (!r->objects[i]) continue;
    /* One attribute query per object: a single pageable one would fault. */
    if ((st = classify(x, r->objects[i], "objects", i, &k))) return st;
    obj_seen[k] = 1;
  }
  int src_host = gather ? cache_seen[MEM_HOST] : obj_seen[MEM_HOST];
  int dst_host = gather ? obj_seen[MEM_HOST] : cache_seen[MEM_HOST];
  if (cache_seen[MEM_PEER] || obj_seen[MEM_PEER])
    *route = KVF_ROUTE_PEER;
  else if (src_host && dst_host)
    *route = KVF_ROUTE_HOST_TO_HOST;
  else if (dst_host)
    *route = KVF_ROUTE_D2H;
  else if (src_host)
    *route = KVF_ROUTE_H2D;
  else
    *route = KVF_ROUTE_D2D;
  /* Cache on this GPU, objects in host memory: the copy engine can do the
   * PCIe leg from a staging buffer. */
  *stageable = cache_seen[MEM_LOCAL] && !cache_seen[MEM_HOST] && !cache_seen[MEM_PEER] && obj_seen[MEM_HOST] &&
               !obj_seen[MEM_LOCAL] && !obj_seen[MEM_PEER];
  return KVF_SUCCESS;
}

/* ---- the copy-engine path ------------------------------------------------ */

static kvf_status grow_staging(kvf_xfer *x, staging *s, size_t size);

static uint64_t round256(uint64_t x) { return (x + 255) & ~(uint64_t)255; }

/* Make both staging buffers at least `need` bytes (at least the configured
 * size). Growing waits for the buffers' last users: it is rare. */
static kvf_status grow_stage(kvf_xfer *x, size_t need) {
  size_t want = (size_t)kvf_param_xfer_staging_mb() << 20;
  if (want < need) want = need;
  if (x->stage_cap >= want) return KVF_SUCCESS;
  cudaError_t e = cudaSuccess;
  for (int i = 0; i < 2 && e == cudaSuccess; i++) {
    if (x->stage[i]) {
      cudaEventSynchronize(x->stage_free[i]);
      cudaEventSynchronize(x->stage_ready[i]);
      cudaFreeAsync(x->stage[i], x->private_stream);
      x->stage[i] = NULL;
    }
    e = cudaMallocAsync(&x->stage[i], want, x->private_stream);
  }
  if (e == cudaSuccess) e = cudaStreamSynchronize(x->private_stream);
  if (e != cudaSuccess) {
    cudaGetLastError();
    x->stage_cap = 0;
    return kvf_fail(KVF_ERR_CUDA, "staging buffers of %zu bytes: %s", want, cudaGetErrorString(e));
  }
  x->stage_cap = want;
  return KVF_SUCCESS;
}

/* A batch's CUDA side; its chunks and bytes are the plan's kvf_stage_batch. */
typedef struct batch {
  uint64_t blob_off;  /* where its blob sits in the call's tables */
  uint64_t tasks;
  uint32_t buf;       /* staging buffer */
} batch;

/* The token range of a batch's chunks inside request r. */
static void batch_tokens(const kvf_copy_request *r, const kvf_stage_batch *b, uint64_t c, kvf_copy_request *part) {
  part->token_begin = r->token_begin + b->k0 * c;
  uint64_t span = (b->k1 - b->k0) * c;
  part->token_end = r->token_end - part->token_begin > span ? part->token_begin + span : r->token_end;
}

/* The kernel of batch bi (the test hook may refuse it, see xfer_internal.h). */
static cudaError_t launch_batch(uint64_t bi, const batch *b, const staging *slot, uint32_t stage_sms,
                                uint32_t *used_sms, cudaStream_t stream) {
  if ((int64_t)bi == __atomic_load_n(&test_fail_at_batch, __ATOMIC_RELAXED)) return cudaErrorLaunchOutOfResources;
  if (!b->tasks) return cudaSuccess;
  uint32_t ctas = stage_sms;
  cudaError_t e = kvf_kernel_launch((char *)slot->device + b->blob_off, b->tasks, &ctas, stream);
  if (e == cudaSuccess && ctas > *used_sms) *used_sms = ctas;
  return e;
}

/* Enqueue batch bi of a staged call. Stops at the first enqueue the runtime
 * refuses and returns its error; what was enqueued before it stays. */
static cudaError_t enqueue_batch(kvf_xfer *x, const kvf_copy_request *r, const kvf_stage_plan *sp, uint64_t bi,
                                 const batch *b, int gather, const staging *slot, uint32_t stage_sms,
                                 uint32_t *used_sms, cudaStream_t stream) {
  const kvf_stage_batch *pb = &sp->batches[bi];
  uint64_t nog = sp->num_objects / sp->num_chunks;
  char *buf = x->stage[b->buf];
  cudaError_t e;
  if (gather) {
    /* kernel: cache -> buffer, after the buffer's previous copy-out */
    e = cudaStreamWaitEvent(stream, x->stage_free[b->buf], 0);
    if (e == cudaSuccess) e = launch_batch(bi, b, slot, stage_sms, used_sms, stream);
    if (e == cudaSuccess) e = cudaEventRecord(x->stage_ready[b->buf], stream);
    if (e == cudaSuccess) e = cudaStreamWaitEvent(x->ce_stream, x->stage_ready[b->buf], 0);
    for (uint64_t i = pb->k0 * nog; i < pb->k1 * nog && e == cudaSuccess; i++) {
      uint64_t lo = sp->span[2 * i], hi = sp->span[2 * i + 1];
      if (!sp->staged[i] || hi == lo) continue;
      e = cudaMemcpyAsync((char *)r->objects[i] + lo, buf + sp->offset[i] + lo, hi - lo, cudaMemcpyDeviceToHost,
                          x->ce_stream);
    }
    if (e == cudaSuccess) e = cudaEventRecord(x->stage_free[b->buf], x->ce_stream);
  } else {
    /* copy engine: objects -> buffer, after the buffer's previous reader */
    e = cudaStreamWaitEvent(x->ce_stream, x->stage_free[b->buf], 0);
    for (uint64_t i = pb->k0 * nog; i < pb->k1 * nog && e == cudaSuccess; i++) {
      uint64_t lo = sp->span[2 * i], hi = sp->span[2 * i + 1];
      if (!sp->staged[i] || hi == lo) continue;
      e = cudaMemcpyAsync(buf + sp->offset[i] + lo, (char *)r->objects[i] + lo, hi - lo, cudaMemcpyHostToDevice,
                          x->ce_stream);
    }
    if (e == cudaSuccess) e = cudaEventRecord(x->stage_ready[b->buf], x->ce_stream);
    if (e == cudaSuccess) e = cudaStreamWaitEvent(stream, x->stage_ready[b->buf], 0);
    if (e == cudaSuccess) e = launch_batch(bi, b, slot, stage_sms, used_sms, stream);
    if (e == cudaSuccess) e = cudaEventRecord(x->stage_free[b->buf], stream);
  }
  return e;
}

/* End a staged call in stream order, after its last enqueue or after one the
 * runtime refused (what was enqueued then stays and will run): the
 * copy-engine stream joins the caller's stream, and the tables' slot becomes
 * free only once everything the call enqueued has run. After a refusal both
 * staging buffers' free events move there too: the refused batch may have
 * left work on a buffer that its event does not cover. Every step is tried
 * and the first error returned. On a healthy context none of these fails
 * (the handles are the context's own, the stream just took work); a failure
 * means a broken context (a sticky error), and then the internal stream is
 * waited for, so none of the call's work is left running unjoined. */
static cudaError_t finish_staged(kvf_xfer *x, cudaStream_t stream, staging *slot, int forked, int refused) {
  cudaError_t first = cudaSuccess, e;
  if (forked) {
    e = cudaEventRecord(x->join, x->ce_stream);
    if (e == cudaSuccess) e = cudaStreamWaitEvent(stream, x->join, 0);
    if (e != cudaSuccess) {
      first = e;
      cudaStreamSynchronize(x->ce_stream);
    }
  }
  for (int i = 0; refused && i < 2; i++)
    if ((e = cudaEventRecord(x->stage_free[i], stream)) != cudaSuccess && first == cudaSuccess) first = e;
  if ((e = cudaEventRecord(slot->done, stream)) != cudaSuccess && first == cudaSuccess) first = e;
  slot->in_use = 1;
  x->next_slot = (x->next_slot + 1) % KVF_STAGING_SLOTS;
  cudaGetLastError();
  return first;
}

/* Host<->device through the staging buffers: batches of whole chunks,
 * alternating between the two buffers so the kernel fills one while the
 * copy engine drains the other (or the reverse for a scatter). Objects a
 * gather would write only in part go straight to host memory with the
 * direct kernel, after the batches. The plan is host/core/xfer_stage.c's.
 *
 * Everything the call needs is checked and reserved before its first
 * enqueue: the plan, the host arrays, both staging buffers, the tables' slot
 * (waited for) and the tables themselves; pointers were classified by
 * route_of. A failure up to there leaves nothing enqueued. After it, only an
 * enqueue the CUDA runtime refuses can fail: batches before the refused one
 * stay enqueued whole, nothing after it is enqueued, and finish_staged joins
 * the internal stream back (include/kvferry/transfer.h states this). */
static kvf_status launch_staged(kvf_xfer *x, const kvf_copy_request *r, int gather, cudaStream_t stream,
                                uint32_t stage_sms, uint32_t pcie_sms) {
  const kvf_geometry *g = x->geometry;
  const kvf_plan *plan = &x->plan[r->format];
  const char *dir = gather ? "gather" : "scatter";
  uint64_t nog = g->num_object_groups, c = g->policy.chunk_tokens;
  uint64_t n = 0, nb = 0, bi = 0, blob_bytes = 0, direct_off = 0, payload = 0, tasks = 0, direct_tasks = 0;
  kvf_stage_plan sp;
  kvf_copy_request part = *r;
  staging *slot = NULL;
  batch *batches = NULL;
  void **sub = NULL;
  uint32_t used_sms = 0;
  int forked = 0;
  cudaError_t e = cudaSuccess;
  kvf_status st = kvf_stage_plan_objects(g, r, gather, &sp);
  if (st) return st;
  n = sp.num_objects;
  sub = malloc(sizeof(void *) * (n ? n : 1));
  batches = malloc(sizeof(batch) * (sp.num_chunks ? sp.num_chunks : 1));
  if (!sub || !batches) {
    st = kvf_fail(KVF_ERR_OUT_OF_MEMORY, "transfer: out of memory");
    goto out;
  }
  if ((st = grow_stage(x, sp.max_chunk))) goto out;
  kvf_stage_plan_batches(&sp, x->stage_cap);
  nb = sp.num_batches;
  /* Every blob of the call in one staging slot: sizes first. */
  for (bi = 0; bi < nb; bi++) {
    batch_tokens(r, &sp.batches[bi], c, &part);
    part.objects = r->objects + sp.batches[bi].k0 * nog; /* sizes depend only on counts */
    batches[bi].blob_off = blob_bytes;
    batches[bi].buf = (x->next_stage + (uint32_t)bi) & 1;
    blob_bytes += round256(kvf_blob_size(g, plan, &part, NULL));
  }
  direct_off = blob_bytes;
  if (sp.any_direct) blob_bytes += round256(kvf_blob_size(g, plan, r, NULL));
  slot = &x->slots[x->next_slot];
  if (slot->in_use && cudaEventSynchronize(slot->done) != cudaSuccess) {
    e = cudaGetLastError();
    st = kvf_fail(KVF_ERR_CUDA, "waiting for an earlier transfer: %s", cudaGetErrorString(e));
    goto out;
  }
  slot->in_use = 0;
  if ((st = grow_staging(x, slot, blob_bytes))) goto out;
  for (bi = 0; bi < nb; bi++) {
    const kvf_stage_batch *pb = &sp.batches[bi];
    batch_tokens(r, pb, c, &part);
    for (uint64_t i = pb->k0 * nog; i < pb->k1 * nog; i++)
      sub[i] = sp.staged[i] ? (char *)x->stage[batches[bi].buf] + sp.offset[i] : NULL;
    part.objects = sub + pb->k0 * nog;
    batches[bi].tasks = kvf_blob_build(g, plan, &part, gather, NULL, (char *)slot->pinned + batches[bi].blob_off);
    payload += ((const kvf_blob_header *)((char *)slot->pinned + batches[bi].blob_off))->payload_bytes;
    tasks += batches[bi].tasks;
  }
  if (sp.any_direct) {
    for (uint64_t i = 0; i < n; i++) sub[i] = sp.staged[i] ? NULL : r->objects[i];
    part = *r;
    part.objects = sub;
    direct_tasks = kvf_blob_build(g, plan, &part, gather, NULL, (char *)slot->pinned + direct_off);
    tasks += direct_tasks;
  }

  /* Enqueue. The copy-engine stream forks from the caller's stream (it sees
   * everything enqueued before this call) and joins it at the end. bi ends
   * as the batch whose enqueue was refused, or nb. */
  e = cudaMemcpyAsync(slot->device, slot->pinned, blob_bytes, cudaMemcpyHostToDevice, stream);
  if (e == cudaSuccess) e = cudaEventRecord(x->fork, stream);
  if (e == cudaSuccess) e = cudaStreamWaitEvent(x->ce_stream, x->fork, 0);
  forked = e == cudaSuccess;
  for (bi = 0; e == cudaSuccess && bi < nb;) {
    e = enqueue_batch(x, r, &sp, bi, &batches[bi], gather, slot, stage_sms, &used_sms, stream);
    if (e == cudaSuccess) bi++;
  }
  if (e == cudaSuccess && direct_tasks) {
    uint32_t ctas = pcie_sms;
    e = kvf_kernel_launch((char *)slot->device + direct_off, direct_tasks, &ctas, stream);
    if (e == cudaSuccess && ctas > used_sms) used_sms = ctas;
  }
  if (e != cudaSuccess) {
    cudaGetLastError();
    cudaError_t ej = finish_staged(x, stream, slot, forked, 1);
    char done[96], joined[160] = "";
    if (bi == 0)
      snprintf(done, sizeof done, "no batch was enqueued");
    else
      snprintf(done, sizeof done, "batches 0..%llu were enqueued whole and will complete",
               (unsigned long long)bi - 1);
    if (ej != cudaSuccess)
      snprintf(joined, sizeof joined, "; joining the internal stream back failed too (%s): it was waited for",
               cudaGetErrorString(ej));
    if (!forked)
      st = kvf_fail(KVF_ERR_CUDA,
                    "staged %s: enqueueing the call's tables: %s; nothing that writes an object or a block was "
                    "enqueued%s",
                    dir, cudaGetErrorString(e), joined);
    else if (bi < nb)
      st = kvf_fail(KVF_ERR_CUDA,
                    "staged %s: enqueueing batch %llu of %llu (chunks %llu..%llu): %s; %s, batch %llu at most in "
                    "part, nothing after it%s",
                    dir, (unsigned long long)bi, (unsigned long long)nb, (unsigned long long)sp.batches[bi].k0,
                    (unsigned long long)sp.batches[bi].k1 - 1, cudaGetErrorString(e), done, (unsigned long long)bi,
                    joined);
    else
      st = kvf_fail(KVF_ERR_CUDA,
                    "staged %s: enqueueing the direct kernel (objects written in part) after the last batch: %s; %s, "
                    "the direct kernel's objects were not written%s",
                    dir, cudaGetErrorString(e), done, joined);
    goto out;
  }
  e = finish_staged(x, stream, slot, forked, 0);
  if (e != cudaSuccess) {
    st = kvf_fail(KVF_ERR_CUDA,
                  "staged %s: ending the call (joining the internal stream, recording its event): %s; all %llu "
                  "batches were enqueued and will complete",
                  dir, cudaGetErrorString(e), (unsigned long long)nb);
    goto out;
  }
  x->next_stage = (x->next_stage + (uint32_t)nb) & 1;
  x->last.route = gather ? KVF_ROUTE_D2H : KVF_ROUTE_H2D;
  x->last.sms = used_sms;
  x->last.tasks = (uint32_t)tasks;
  x->last.payload_bytes = payload;
out:
  kvf_stage_plan_free(&sp);
  free(sub);
  free(batches);
  return st;
}

static kvf_status grow_staging(kvf_xfer *x, staging *s, size_t size) {
  if (s->cap >= size) return KVF_SUCCESS;
  size_t cap = s->cap ? s->cap : 64 << 10;
  while (cap < size) cap *= 2;
  /* Outgrown buffers may still be read by a captured graph: retire them. */
  if (s->pinned || s->device) {
    retired *r = malloc(sizeof *r);
    if (!r) return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "transfer staging: out of memory");
    *r = (retired){s->pinned, s->device, x->retired};
    x->retired = r;
    s->pinned = s->device = NULL;
    s->cap = 0;
  }
  cudaError_t e = cudaHostAlloc(&s->pinned, cap, cudaHostAllocDefault);
  if (e == cudaSuccess) e = cudaMallocAsync(&s->device, cap, x->private_stream);
  if (e == cudaSuccess) e = cudaStreamSynchronize(x->private_stream); /* ready before another stream uses it */
  if (e != cudaSuccess) {
    cudaGetLastError();
    return kvf_fail(KVF_ERR_CUDA, "transfer staging of %zu bytes: %s", cap, cudaGetErrorString(e));
  }
  s->cap = cap;
  return KVF_SUCCESS;
}

/* Keep a captured call's tables until destroy on the node reserved for
 * them (freed instead when nothing was allocated). */
static void keep_captured(kvf_xfer *x, retired *node, const staging *captured) {
  if (!captured->pinned && !captured->device) {
    free(node);
    return;
  }
  *node = (retired){captured->pinned, captured->device, x->retired};
  x->retired = node;
}

static kvf_status launch_cuda(kvf_xfer *x, const kvf_copy_request *r, int gather, cudaStream_t stream) {
  const kvf_geometry *g = x->geometry;
  const kvf_plan *plan = &x->plan[r->format];
  kvf_xfer_route route;
  int stageable = 0;
  kvf_status st = route_of(x, r, gather, &route, &stageable);
  if (st) return st;
  size_t size = (size_t)kvf_blob_size(g, plan, r, NULL);
  enum cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  cudaError_t e = cudaStreamIsCapturing(stream, &capture);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return kvf_fail(KVF_ERR_CUDA, "stream: %s", cudaGetErrorString(e));
  }
  uint32_t pcie_sms = (uint32_t)x->sm_count;
  int64_t param = kvf_param_xfer_pcie_sms();
  if (param > 0 && (uint64_t)param < pcie_sms) pcie_sms = (uint32_t)param;
  if (x->max_sms && x->max_sms < pcie_sms) pcie_sms = x->max_sms;
  /* Host<->device moves through the copy engine unless staging is off or
   * the call is being captured (a graph gets the direct kernel). */
  if (stageable && capture == cudaStreamCaptureStatusNone && kvf_param_xfer_staging_mb() > 0) {
    uint32_t stage_sms = (uint32_t)x->sm_count;
    int64_t sp = kvf_param_xfer_stage_sms();
    if (sp > 0 && (uint64_t)sp < stage_sms) stage_sms = (uint32_t)sp;
    if (x->max_sms && x->max_sms < stage_sms) stage_sms = x->max_sms;
    return launch_staged(x, r, gather, stream, stage_sms, pcie_sms);
  }
  staging captured = {0}, *s;
  retired *keep = NULL; /* a captured call's tables, kept until destroy */
  if (capture == cudaStreamCaptureStatusActive) {
    /* A graph replays this call later: its tables must never be reused. The
     * allocation is not stream work; relaxed mode lets it happen while the
     * caller's thread captures in global mode. The list node comes first:
     * once anything is captured, the graph may read the tables. */
    enum cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    if (!(keep = malloc(sizeof *keep))) return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "transfer staging: out of memory");
    s = &captured;
    cudaThreadExchangeStreamCaptureMode(&mode);
    st = grow_staging(x, s, size);
    cudaThreadExchangeStreamCaptureMode(&mode);
    if (st) {
      keep_captured(x, keep, &captured); /* what a failed grow allocated */
      return st;
    }
  } else {
    s = &x->slots[x->next_slot];
    if (s->in_use && cudaEventSynchronize(s->done) != cudaSuccess) { /* the call 8 calls ago */
      e = cudaGetLastError();
      return kvf_fail(KVF_ERR_CUDA, "waiting for an earlier transfer: %s", cudaGetErrorString(e));
    }
    s->in_use = 0;
    if ((st = grow_staging(x, s, size))) return st;
  }
  uint64_t tasks = kvf_blob_build(g, plan, r, gather, NULL, s->pinned);
  const kvf_blob_header *h = s->pinned;
  uint32_t ctas = (uint32_t)x->sm_count;
  if (route == KVF_ROUTE_D2H || route == KVF_ROUTE_H2D || route == KVF_ROUTE_HOST_TO_HOST) ctas = pcie_sms;
  if (x->max_sms && x->max_sms < ctas) ctas = x->max_sms;
  if (tasks) {
    e = cudaMemcpyAsync(s->device, s->pinned, h->size, cudaMemcpyHostToDevice, stream);
    int uploaded = e == cudaSuccess, launched = 0;
    if (e == cudaSuccess) launched = (e = kvf_kernel_launch(s->device, tasks, &ctas, stream)) == cudaSuccess;
    if (uploaded && s != &captured) {
      /* Also after a refused launch: the upload is enqueued and reads the
       * slot's tables, so the slot is free only after it. */
      cudaError_t ed = cudaEventRecord(s->done, stream);
      if (e == cudaSuccess) e = ed;
      s->in_use = 1;
      x->next_slot = (x->next_slot + 1) % KVF_STAGING_SLOTS;
    }
    if (e != cudaSuccess) {
      cudaGetLastError();
      if (keep) keep_captured(x, keep, &captured);
      return kvf_fail(KVF_ERR_CUDA, "enqueueing the %s transfer: %s; %s", gather ? "gather" : "scatter",
                      cudaGetErrorString(e),
                      launched   ? "the kernel was enqueued and will run"
                      : uploaded ? "only the upload of the call's tables was enqueued"
                                 : "nothing was enqueued");
    }
  } else {
    ctas = 0;
  }
  if (keep) keep_captured(x, keep, &captured);
  x->last.route = route;
  x->last.sms = ctas;
  x->last.tasks = (uint32_t)tasks;
  x->last.payload_bytes = h->payload_bytes;
  return KVF_SUCCESS;
}
#endif

/* ---- calls ------------------------------------------------------------------- */

static kvf_status run_host(kvf_xfer *x, const kvf_copy_request *r, int gather) {
  const kvf_plan *plan = &x->plan[r->format];
  size_t size = (size_t)kvf_blob_size(x->geometry, plan, r, NULL);
  if (size > x->host_blob_cap) {
    void *p = aligned_alloc(64, (size + 63) & ~(size_t)63);
    if (!p) return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "host transfer: out of memory for %zu bytes of tables", size);
    free(x->host_blob);
    x->host_blob = p;
    x->host_blob_cap = size;
  }
  uint64_t tasks = kvf_blob_build(x->geometry, plan, r, gather, NULL, x->host_blob);
  run_on_cpu(x, x->host_blob);
  const kvf_blob_header *h = x->host_blob;
  x->last.route = KVF_ROUTE_HOST;
  x->last.sms = 0;
  x->last.tasks = (uint32_t)tasks;
  x->last.payload_bytes = h->payload_bytes;
  return KVF_SUCCESS;
}

static kvf_status transfer(kvf_xfer *x, const kvf_copy_request *request, kvf_stream stream, int gather) {
  if (!x) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "transfer context is NULL");
  kvf_copy_request local;
  const kvf_copy_request *r = &local;
  kvf_status st = kvf_copy_request_check_local(x->geometry, request, &local);
  if (st) return st;
  pthread_mutex_lock(&x->lock);
  if (x->device == KVF_DEVICE_HOST) {
    st = run_host(x, r, gather);
  } else {
#ifdef KVF_WITH_CUDA
    int prev = 0;
    cudaGetDevice(&prev);
    if (prev != x->device) cudaSetDevice(x->device);
    st = launch_cuda(x, r, gather, (cudaStream_t)stream);
    if (prev != x->device) cudaSetDevice(prev);
#else
    (void)stream;
    st = kvf_fail(KVF_ERR_NO_DRIVER, "this build of kvferry has no CUDA");
#endif
  }
  pthread_mutex_unlock(&x->lock);
  return st;
}

kvf_status kvf_xfer_gather(kvf_xfer *x, const kvf_copy_request *r, kvf_stream stream) {
  return transfer(x, r, stream, 1);
}

kvf_status kvf_xfer_scatter(kvf_xfer *x, const kvf_copy_request *r, kvf_stream stream) {
  return transfer(x, r, stream, 0);
}
