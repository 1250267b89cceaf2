/* Transfer contexts: a geometry bound to a CUDA device or to the host
 * backend. A call checks the request, builds its launch blob (kernels/plan.h)
 * and either launches the kernel on the caller's stream or copies on CPU
 * threads. */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <kvferry/transfer.h>

#include "common/error.h"
#include "common/versioned.h"
#include "geometry/geometry_internal.h"
#include "common/clock.h"
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

/* Deferred calls posted and not yet enqueued by the context's thread, at
 * most (posting waits for one to be enqueued beyond that). */
#define KVF_DEFER_DEPTH 32

/* Failures of deferred calls kept until a join, query or flush reports
 * them (include/kvferry/transfer.h); later ones are only logged. */
#define KVF_DEFER_FAILURES 16

typedef struct defer_failure {
  uint64_t seq; /* the call's number on the word */
  kvf_status status;
  char message[512];
} defer_failure;

/* A deferred call: the request with its own copy of the caller's arrays
 * (the caller may reuse them once the call returns), which follow the
 * struct in the same allocation. */
typedef struct deferred {
  struct deferred *next;
  kvf_copy_request r;
  int gather;
  uint64_t seq;
  cudaEvent_t start; /* recorded on the caller's stream when the call was made */
} deferred;
#endif

struct kvf_xfer {
  const kvf_geometry *geometry;
  int device;
  uint32_t max_sms;
  uint32_t host_threads;
  kvf_plan plan[2];
  pthread_mutex_t lock; /* guards everything below */
  kvf_xfer_tuning tune;
  kvf_xfer_stats last;
  kvf_xfer_path_info path; /* how the last successful call moved its bytes */
  uint64_t planned_ns;     /* when the call in progress made its first enqueue (0: not yet) */
  uint64_t call_start_ns;  /* when the call in progress took the context (launch_cuda) */
  uint64_t batch_end_ns;   /* when the last batch-API call that succeeded returned (0: none yet) */
  uint64_t batch_host_ns;  /* its host time, from taking the context to its return */
  uint64_t batch_runs;     /* its runs */
  uint64_t batch_host_ns_before, batch_runs_before; /* the same of the batch call before it (runs 0: none) */
  uint32_t host_bound_staged; /* host-bound calls staged in a row since the last batch call (KVF_XFER_BATCH_HOST_BOUND) */
  /* The last request whose batch-API runs were listed (launch_copy_batch):
   * its shape, runs and copy time, which a request of the same shape takes
   * as its own to ask the host-bound rule before listing (0 runs: none). */
  struct batch_shape {
    int gather;
    kvf_object_format format;
    uint64_t tokens, moving; /* token count; what moves (batch_shape_of) */
    uint64_t runs, engine_ns;
  } listed;
  void *host_blob;         /* tables built on the host: the host backend's, and those launched in kernel parameters */
  size_t host_blob_cap;
#ifdef KVF_WITH_CUDA
  uint64_t call_end_ns;    /* when the CUDA backend's last successful call returned (0: none yet) */
  unsigned long long call_end_stream_id; /* its stream's id (cudaStreamGetId), when call_end_has_id */
  int call_end_has_id;
  unsigned long long call_stream_id; /* the call in progress's stream's id (call_stream_id) */
  int call_stream_id_asked, call_stream_id_ok;
  int call_listed;         /* the call in progress built its batch-API runs (launch_copy_batch) */
  int call_captured;       /* the call in progress is on a capturing stream (or not known yet) */
  uint64_t idle_wait_ns;   /* host time the call in progress spent waiting for its stream (stream_idle_soon) */
  int cuda_ready; /* the device was valid and set: destroy has CUDA work to undo */
  int sm_count;
  int can_overlap; /* the device (compute capability 9.0) and the kernels' build take overlapped launches */
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
  /* Recorded on the stream before a host-bound call's first enqueue and
   * after its last (KVF_XFER_BATCH_HOST_BOUND): a busy stream that has
   * reached the first and not the second works on that call, and on
   * nothing else unless the caller queued work behind it, which no query
   * shows (hence the window of host_bound_goes_staged). Only the context's
   * next launch_cuda call asks them (call_mark_call: the call that
   * recorded both, 0: none; call_mark_started: the call that recorded the
   * first; call_mark_end_ns: when that call returned), and only on the
   * same stream (by its id: a destroyed stream's handle can come back for
   * another). */
  cudaEvent_t call_mark, call_end_mark;
  unsigned long long call_mark_stream_id;
  uint64_t call_mark_call, call_mark_started, call_mark_end_ns;
  /* The staged route's cost as measured (KVF_XFER_BATCH_STAGED_COST 0): the
   * span on its stream of a staged host-bound call that came while the
   * stream worked on the call before it, span_start (before its first
   * enqueue) to span_end (after its last), read by a later call once both
   * have completed (read_staged_span); one span in flight at a time. span_armed: the
   * launch_cuda call that recorded span_start (0: none); span_engine_ns:
   * its copies' time at the link rate. */
  cudaEvent_t span_start, span_end;
  uint64_t span_armed, span_engine_ns;
  int span_pending;
  uint64_t staged_cost[KVF_STAGED_COST_SAMPLES]; /* ring of measures (kvf_staged_cost_sample) */
  uint64_t staged_cost_measures;                 /* measures taken; the next goes at this % the ring's size */
  uint32_t staged_kept_batched; /* host-bound calls back to back the measures kept batched since one was
                                   measured (KVF_STAGED_COST_REMEASURE) */
  uint32_t rule_back_to_back;   /* the call in progress was weighed back to back (path info back_to_back) */
  uint64_t cuda_calls; /* launch_cuda calls so far */
  /* The region bases seen last and where they live (route_of): a base
   * that is device memory (this GPU's or a peer's) keeps that kind while
   * it is allocated, and CUDA never hands a device address out as host
   * memory, so a call with the same base skips its pointer query. Host
   * bases are queried every call (host memory can be unregistered). */
  const void **region_seen; /* [num_regions] */
  unsigned char *region_kind;
  kvf_memo runs_cache; /* staged pieces' copy-engine runs, by blob (kvf_stage_blob_runs_cached; under lock) */
  kvf_memo plan_memo;  /* staged calls' piece splits and straight picks (under lock) */
  kvf_memo blob_memo;  /* the routes' blobs, by shape (kvf_blob_build_memo; under lock) */
  /* Deferred calls (kvf_xfer_gather_deferred): the caller's thread checks
   * and copies the request and records `start` on its stream; the
   * context's thread plans and enqueues the call on defer_stream after
   * `start`, then writes the call's number to *done there. A join waits on
   * the host until the thread has enqueued the call, then makes its stream
   * wait until *done reaches the number: every wait is for work enqueued
   * before it. defer_mu guards the fields below; the thread holds `lock`
   * while it plans and enqueues, as a synchronous call does. Posting
   * threads go one at a time (defer_post_mu) and make their CUDA call
   * without defer_mu, which the thread needs to take its next call. */
  pthread_mutex_t defer_post_mu;
  pthread_mutex_t defer_mu;
  pthread_cond_t defer_wake; /* a call was posted, or the thread must stop */
  pthread_cond_t defer_room; /* a call was enqueued (its event came back), a post ended, or a hold ended */
  int defer_state;           /* 0 not started (or could not start: the next post tries again), 1 running */
  int defer_stop;
  int defer_posting;         /* a post has its number and is recording its event on the caller's stream */
  uint32_t defer_holds;      /* synchronous calls waiting or running: posting waits for them */
  pthread_t defer_thread;
  struct deferred *defer_head, *defer_tail;
  cudaEvent_t defer_events[KVF_DEFER_DEPTH];
  uint32_t defer_free;       /* defer_events[0, defer_free) are in no posted call */
  uint64_t defer_seq;        /* the number of the last call posted */
  uint64_t defer_finished;   /* the number of the last call the thread enqueued (or failed) */
  uint64_t defer_base;       /* the word's value when the thread started: call k is number base + k */
  struct done_word *defer_word; /* holds defer_done */
  uint64_t *defer_done;      /* mapped pinned word, the number of the last call whose work completed */
  CUdeviceptr defer_done_dev;
  cudaStream_t defer_stream;
  defer_failure defer_failures[KVF_DEFER_FAILURES]; /* in call order, until reported */
  uint32_t defer_failure_count;
  uint64_t defer_failures_dropped; /* failures met while every slot was taken */
#endif
  uint64_t host_tickets; /* the host backend's deferred calls, which run at once (atomic) */
};

#ifdef KVF_WITH_CUDA
static void forget_staged_cost(kvf_xfer *x);
static uint64_t staged_cost_back_to_back(const kvf_xfer *x);

/* Wait (under defer_mu) until the thread has enqueued every call posted
 * before this one began (a post under way counts as posted). Calls posted
 * meanwhile are not waited for, so steady posting cannot starve it. */
static void defer_wait_posted(kvf_xfer *x) {
  while (x->defer_posting) pthread_cond_wait(&x->defer_room, &x->defer_mu);
  uint64_t target = x->defer_seq;
  while (x->defer_finished < target) pthread_cond_wait(&x->defer_room, &x->defer_mu);
}
#endif

/* Let the context's thread enqueue every deferred call posted so far (what
 * reads or changes what calls left behind waits for this first). */
static void defer_drain(const kvf_xfer *cx) {
#ifdef KVF_WITH_CUDA
  kvf_xfer *x = (kvf_xfer *)cx;
  if (x->device == KVF_DEVICE_HOST) return;
  pthread_mutex_lock(&x->defer_mu);
  if (x->defer_state == 1) defer_wait_posted(x);
  pthread_mutex_unlock(&x->defer_mu);
#else
  (void)cx;
#endif
}

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

/* ---- tuning (host/core/xfer_internal.h) ------------------------------------ */

/* Declared in xfer_internal.h. Both bounds fit 64 bits shifted (their
 * ranges stop at 2^30 KiB). */
int kvf_spread_is_deep(const kvf_xfer_tuning *t, uint64_t payload) {
  if (t->spread_deep_kb <= 0 || payload < ((uint64_t)t->spread_deep_kb << 10)) return 0;
  return t->spread_deep_max_mb <= 0 || payload < ((uint64_t)t->spread_deep_max_mb << 20);
}

void kvf_xfer_tuning_from_params(kvf_xfer_tuning *t) {
  *t = (kvf_xfer_tuning){.pcie_sms = kvf_param_xfer_pcie_sms(),
                         .staging_mb = kvf_param_xfer_staging_mb(),
                         .stage_sms = kvf_param_xfer_stage_sms(),
                         .stage_pieces = kvf_param_xfer_stage_pieces(),
                         .stage_growth = kvf_param_xfer_stage_growth(),
                         .stage_edge_mb = kvf_param_xfer_stage_edge_mb(),
                         .stage_multi_pieces = kvf_param_xfer_stage_multi_pieces(),
                         .stage_straight_kb = kvf_param_xfer_stage_straight_kb(),
                         .stage_straight_min_run = kvf_param_xfer_stage_straight_min_run(),
                         .stage_straight_alone = kvf_param_xfer_stage_straight_alone(),
                         .stage_dma_batch = kvf_param_xfer_stage_dma_batch(),
                         .param_bytes = kvf_param_xfer_param_table_bytes(),
                         .task_bytes = kvf_param_xfer_task_bytes(),
                         .task_waves = kvf_param_xfer_task_waves(),
                         .device_task_waves = kvf_param_xfer_device_task_waves(),
                         .batch_min_run = kvf_param_xfer_batch_min_run(),
                         .batch_max_runs = kvf_param_xfer_batch_max_runs(),
                         .batch_first_runs = kvf_param_xfer_batch_first_runs(),
                         .batch_link_gbps = kvf_param_xfer_batch_link_gbps(),
                         .batch_back_to_back_us = kvf_param_xfer_batch_back_to_back_us(),
                         .batch_host_bound = kvf_param_xfer_batch_host_bound(),
                         .batch_staged_cost = kvf_param_xfer_batch_staged_cost(),
                         .kernel = kvf_param_xfer_kernel(),
                         .spread_kb = kvf_param_xfer_spread_kb(),
                         .spread_deep_kb = kvf_param_xfer_spread_deep_kb(),
                         .spread_deep_max_mb = kvf_param_xfer_spread_deep_max_mb(),
                         .cache_order = kvf_param_xfer_cache_order(),
                         .overlap = kvf_param_xfer_overlap(),
                         .small_stage_mb = kvf_param_xfer_small_stage_mb(),
                         .small_stage_growth = kvf_param_xfer_small_stage_growth(),
                         .small_stage_one_piece = kvf_param_xfer_small_stage_one_piece()};
  /* Out-of-range values from the environment fall back to the defaults'
   * behaviour rather than failing every call. */
  if (t->task_bytes < 16 || t->task_bytes > 65536 || t->task_bytes % 16) t->task_bytes = KVF_SLICE_BYTES;
  if (t->stage_pieces < 1) t->stage_pieces = 1;
  if (t->stage_pieces > KVF_STAGE_MAX_PIECES) t->stage_pieces = KVF_STAGE_MAX_PIECES;
  if (t->stage_growth < 1 || t->stage_growth > 16) t->stage_growth = 2;
  if (t->small_stage_growth < 1 || t->small_stage_growth > 16) t->small_stage_growth = 4;
  if (t->small_stage_one_piece < 0 || t->small_stage_one_piece > 1) t->small_stage_one_piece = 1;
  if (t->staging_mb > KVF_STAGE_MAX_MB) t->staging_mb = 64;
  if (t->stage_edge_mb < 0 || t->stage_edge_mb > KVF_STAGE_MAX_MB) t->stage_edge_mb = 16;
  if (t->stage_multi_pieces < 0 || t->stage_multi_pieces > KVF_STAGE_MAX_PIECES) t->stage_multi_pieces = 2;
  if (t->stage_straight_kb < 0 || t->stage_straight_kb > (int64_t)KVF_STAGE_MAX_MB << 10) t->stage_straight_kb = 1024;
  if (t->stage_straight_min_run < 0 || t->stage_straight_min_run > (int64_t)KVF_STAGE_MAX_MB << 20)
    t->stage_straight_min_run = 16384;
  if (t->stage_straight_alone < 0 || t->stage_straight_alone > 1) t->stage_straight_alone = 0;
  if (t->spread_kb < 0 || t->spread_kb > KVF_SPREAD_MAX_KB) t->spread_kb = 4096;
  if (t->spread_deep_kb < 0 || t->spread_deep_kb > KVF_SPREAD_MAX_KB) t->spread_deep_kb = 8192;
  if (t->spread_deep_max_mb < 0 || t->spread_deep_max_mb > KVF_SPREAD_MAX_KB >> 10) t->spread_deep_max_mb = 12;
  if (t->cache_order < 0 || t->cache_order > 1) t->cache_order = 1;
  if (t->overlap < 0 || t->overlap > 1) t->overlap = 1;
  if (t->batch_first_runs < 0) t->batch_first_runs = 8;
  if (t->batch_link_gbps < 0 || t->batch_link_gbps > KVF_BATCH_MAX_LINK_GBPS) t->batch_link_gbps = 55;
  if (t->batch_back_to_back_us < 0 || t->batch_back_to_back_us > KVF_BATCH_MAX_BACK_TO_BACK_US)
    t->batch_back_to_back_us = 20;
  if (t->batch_host_bound < 0 || t->batch_host_bound > 1) t->batch_host_bound = 1;
  if (t->batch_staged_cost < 0 || (uint64_t)t->batch_staged_cost > KVF_BATCH_MAX_STAGED_COST) t->batch_staged_cost = 0;
}

/* Each tunable's accepted range (kvf_xfer_set_tuning names the first one
 * outside it). */
static const struct {
  const char *field;
  size_t offset;
  int64_t lo, hi;
} tuning_ranges[] = {
#define KVF_TUNING_RANGE(f, lo, hi) {#f, offsetof(kvf_xfer_tuning, f), (lo), (hi)}
    KVF_TUNING_RANGE(pcie_sms, 0, INT64_MAX),
    KVF_TUNING_RANGE(staging_mb, 0, KVF_STAGE_MAX_MB),
    KVF_TUNING_RANGE(stage_sms, 0, INT64_MAX),
    KVF_TUNING_RANGE(stage_pieces, 1, KVF_STAGE_MAX_PIECES),
    KVF_TUNING_RANGE(stage_growth, 1, 16),
    KVF_TUNING_RANGE(stage_edge_mb, 0, KVF_STAGE_MAX_MB),
    KVF_TUNING_RANGE(stage_multi_pieces, 0, KVF_STAGE_MAX_PIECES),
    KVF_TUNING_RANGE(stage_straight_kb, 0, (int64_t)KVF_STAGE_MAX_MB << 10),
    KVF_TUNING_RANGE(stage_straight_min_run, 0, (int64_t)KVF_STAGE_MAX_MB << 20),
    KVF_TUNING_RANGE(stage_straight_alone, 0, 1),
    KVF_TUNING_RANGE(stage_dma_batch, 0, INT64_MAX),
    KVF_TUNING_RANGE(param_bytes, 0, INT64_MAX),
    KVF_TUNING_RANGE(task_bytes, 16, 65536),
    KVF_TUNING_RANGE(task_waves, 0, INT64_MAX),
    KVF_TUNING_RANGE(device_task_waves, 0, INT64_MAX),
    KVF_TUNING_RANGE(batch_min_run, 0, INT64_MAX),
    KVF_TUNING_RANGE(batch_max_runs, 0, INT64_MAX),
    KVF_TUNING_RANGE(batch_first_runs, 0, INT64_MAX),
    KVF_TUNING_RANGE(batch_link_gbps, 0, KVF_BATCH_MAX_LINK_GBPS),
    KVF_TUNING_RANGE(batch_back_to_back_us, 0, KVF_BATCH_MAX_BACK_TO_BACK_US),
    KVF_TUNING_RANGE(batch_host_bound, 0, 1),
    KVF_TUNING_RANGE(batch_staged_cost, 0, (int64_t)KVF_BATCH_MAX_STAGED_COST),
    KVF_TUNING_RANGE(kernel, 0, 2),
    KVF_TUNING_RANGE(spread_kb, 0, KVF_SPREAD_MAX_KB),
    KVF_TUNING_RANGE(spread_deep_kb, 0, KVF_SPREAD_MAX_KB),
    KVF_TUNING_RANGE(spread_deep_max_mb, 0, KVF_SPREAD_MAX_KB >> 10),
    KVF_TUNING_RANGE(cache_order, 0, 1),
    KVF_TUNING_RANGE(overlap, 0, 1),
    KVF_TUNING_RANGE(small_stage_mb, 0, INT64_MAX),
    KVF_TUNING_RANGE(small_stage_growth, 1, 16),
    KVF_TUNING_RANGE(small_stage_one_piece, 0, 1),
#undef KVF_TUNING_RANGE
};
/* Every field has a range: the struct is all int64_t. */
_Static_assert(sizeof tuning_ranges / sizeof tuning_ranges[0] == sizeof(kvf_xfer_tuning) / sizeof(int64_t),
               "a kvf_xfer_tuning field without a range");

kvf_status kvf_xfer_set_tuning(kvf_xfer *x, const kvf_xfer_tuning *t) {
  if (!x || !t) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_xfer_set_tuning: NULL argument");
  for (size_t i = 0; i < sizeof tuning_ranges / sizeof tuning_ranges[0]; i++) {
    int64_t v;
    memcpy(&v, (const char *)t + tuning_ranges[i].offset, sizeof v);
    if (v < tuning_ranges[i].lo || v > tuning_ranges[i].hi)
      return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_xfer_set_tuning: %s %lld: must be %lld..%lld",
                      tuning_ranges[i].field, (long long)v, (long long)tuning_ranges[i].lo,
                      (long long)tuning_ranges[i].hi);
  }
  if (t->task_bytes % 16)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_xfer_set_tuning: task_bytes %lld: must be a multiple of 16",
                    (long long)t->task_bytes);
  defer_drain(x);
  pthread_mutex_lock(&x->lock);
#ifdef KVF_WITH_CUDA
  if (t->batch_link_gbps != x->tune.batch_link_gbps || t->batch_staged_cost != x->tune.batch_staged_cost)
    forget_staged_cost(x);
#endif
  x->tune = *t;
  x->listed.runs = 0; /* the runs' limits or the link rate may have changed */
  pthread_mutex_unlock(&x->lock);
  return KVF_SUCCESS;
}

void kvf_xfer_get_tuning(const kvf_xfer *x, kvf_xfer_tuning *out) {
  pthread_mutex_lock((pthread_mutex_t *)&x->lock);
  *out = x->tune;
  pthread_mutex_unlock((pthread_mutex_t *)&x->lock);
}

const char *kvf_xfer_path_name(kvf_xfer_path path) {
  switch (path) {
  case KVF_PATH_NONE: return "none";
  case KVF_PATH_HOST: return "host";
  case KVF_PATH_KERNEL: return "kernel";
  case KVF_PATH_STAGED: return "staged";
  case KVF_PATH_COPY_BATCH: return "copy-batch";
  }
  return "unknown";
}

void kvf_xfer_last_path(const kvf_xfer *x, kvf_xfer_path_info *out) {
  defer_drain(x);
  pthread_mutex_lock((pthread_mutex_t *)&x->lock);
  *out = x->path;
#ifdef KVF_WITH_CUDA
  out->staged_cost = staged_cost_back_to_back(x); /* the context's now: no call since the last */
  out->staged_cost_measures = x->staged_cost_measures;
#endif
  pthread_mutex_unlock((pthread_mutex_t *)&x->lock);
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

/* The host time of a successful call, into the path info (under x->lock). */
static void note_host_time(kvf_xfer *x, uint64_t t0) {
  uint64_t t1 = kvf_now_ns();
  x->path.host_us = (double)(t1 - t0) / 1e3;
  x->path.plan_us = (double)((x->planned_ns ? x->planned_ns : t1) - t0) / 1e3;
}

/* ---- the host backend ------------------------------------------------------ */

typedef struct cpu_work {
  const void *blob;
  uint64_t first, end;
  int stream;
} cpu_work;

static void *cpu_worker(void *arg) {
  cpu_work *w = arg;
  kvf_blob_run_cpu_opt(w->blob, w->first, w->end, w->stream);
  return NULL;
}

/* CPUs this process may run on (at least 1), read once. */
static uint64_t online_cpus(void) {
  static long n = 0;
  long v = __atomic_load_n(&n, __ATOMIC_RELAXED);
  if (v <= 0) {
    v = sysconf(_SC_NPROCESSORS_ONLN);
    if (v <= 0) v = 1;
    __atomic_store_n(&n, v, __ATOMIC_RELAXED);
  }
  return (uint64_t)v;
}

/* Threads pay off only for large copies: one thread per 4 MiB, capped by
 * KVF_XFER_HOST_THREADS (or the context's host_threads) and, unless the
 * context asked for a count, by the CPUs: a memory copy gains nothing from
 * more threads than cores (8 threads on a 2-core VM ran no faster than 2).
 * Transfers of KVF_XFER_HOST_STREAM_MB or more write with streaming stores. */
static void run_on_cpu(const kvf_xfer *x, const void *blob) {
  const kvf_blob_header *h = blob;
  uint64_t cap = x->host_threads ? x->host_threads : (uint64_t)kvf_param_xfer_host_threads();
  if (!x->host_threads && cap > online_cpus()) cap = online_cpus();
  uint64_t n = h->payload_bytes / (4u << 20) + 1;
  int64_t stream_mb = kvf_param_xfer_host_stream_mb();
  int stream = stream_mb > 0 && h->payload_bytes >= ((uint64_t)stream_mb << 20);
  if (n > cap) n = cap;
  if (n > 64) n = 64;
  if (n > h->total_tasks) n = h->total_tasks;
  if (n <= 1) {
    kvf_blob_run_cpu_opt(blob, 0, h->total_tasks, stream);
    return;
  }
  pthread_t tid[64];
  cpu_work work[64];
  int joined[64] = {0};
  for (uint64_t i = 0; i < n; i++) {
    work[i] = (cpu_work){blob, h->total_tasks * i / n, h->total_tasks * (i + 1) / n, stream};
    /* The calling thread takes share 0; a share whose thread cannot start
     * is done here too. */
    if (i > 0 && pthread_create(&tid[i], NULL, cpu_worker, &work[i]) == 0) joined[i] = 1;
  }
  for (uint64_t i = 0; i < n; i++)
    if (!joined[i]) kvf_blob_run_cpu_opt(blob, work[i].first, work[i].end, stream);
  for (uint64_t i = 1; i < n; i++)
    if (joined[i]) pthread_join(tid[i], NULL);
}

/* ---- creation ------------------------------------------------------------ */

#ifdef KVF_WITH_CUDA
static kvf_status grow_stage(kvf_xfer *x, size_t need);
static kvf_status grow_host_blob(kvf_xfer *x, size_t size);
static void defer_stop(kvf_xfer *x);

static uint64_t round256(uint64_t x) { return (x + 255) & ~(uint64_t)255; }

/* Staging room of the largest chunk: every object group's full-chunk
 * object, each rounded as the staged plan rounds it. */
static size_t largest_chunk(const kvf_geometry *g) {
  uint64_t total = 0, c = g->policy.chunk_tokens;
  for (uint32_t og = 0; og < g->num_object_groups; og++) {
    uint64_t size = 0;
    if (kvf_geometry_object_size(g, og, 0, c, &size) == KVF_SUCCESS)
      total += (size + KVF_STAGE_ALIGN - 1) / KVF_STAGE_ALIGN * KVF_STAGE_ALIGN;
  }
  return (size_t)total;
}
#endif

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
  kvf_xfer_tuning_from_params(&x->tune);
  pthread_mutex_init(&x->lock, NULL);
#ifdef KVF_WITH_CUDA
  pthread_mutex_init(&x->defer_post_mu, NULL);
  pthread_mutex_init(&x->defer_mu, NULL);
  pthread_cond_init(&x->defer_wake, NULL);
  pthread_cond_init(&x->defer_room, NULL);
#endif
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
  if (e == cudaSuccess) e = cudaEventCreateWithFlags(&x->call_mark, cudaEventDisableTiming);
  if (e == cudaSuccess) e = cudaEventCreateWithFlags(&x->call_end_mark, cudaEventDisableTiming);
  if (e == cudaSuccess) e = cudaEventCreateWithFlags(&x->span_start, cudaEventDefault); /* timed */
  if (e == cudaSuccess) e = cudaEventCreateWithFlags(&x->span_end, cudaEventDefault);
  /* Ready before the first call: the kernels' modules (loaded lazily by
   * default) and the staging buffers, sized for the largest chunk, so a
   * first call is as fast as later ones (a served STORE right after a
   * registration measured 21 GB/s against 46 later, first-use setup). */
  if (e == cudaSuccess) e = kvf_kernel_preload();
  int cc_major = 0;
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&cc_major, cudaDevAttrComputeCapabilityMajor, x->device);
  if (e == cudaSuccess) x->can_overlap = cc_major >= 9 && kvf_kernel_can_overlap();
  if (e == cudaSuccess) {
    x->region_seen = calloc(g->num_regions ? g->num_regions : 1, sizeof *x->region_seen);
    x->region_kind = calloc(g->num_regions ? g->num_regions : 1, 1);
    if (!x->region_seen || !x->region_kind) {
      cudaSetDevice(prev);
      st = kvf_fail(KVF_ERR_OUT_OF_MEMORY, "kvf_xfer_create: out of memory");
      goto fail;
    }
  }
  if (e != cudaSuccess) {
    cudaSetDevice(prev);
    st = kvf_fail(KVF_ERR_CUDA, "kvf_xfer_create: device %d: %s", x->device, cudaGetErrorString(e));
    cudaGetLastError();
    goto fail;
  }
  if (x->tune.staging_mb > 0 && (st = grow_stage(x, largest_chunk(g)))) {
    cudaSetDevice(prev);
    goto fail;
  }
  /* The rest of what a first call would set up, done here too: kvferryd
   * makes its contexts when a registration completes, off its event loop,
   * and its first STORE after a registration still took 1.55x a later one
   * with the modules and staging buffers ready (H200, 256-token chunk:
   * 1.251 ms against 0.807, perf/results/2026-12-01-h200/served.md).
   * - The tables' host buffer, with room for a one-chunk staged call whose
   *   pieces and direct launch all go in kernel parameters (one parameter
   *   room each), written once so that its pages are faulted in now and
   *   not by the first call's table builds (a buffer this large is a fresh
   *   mapping).
   * - One event recorded on the copy-engine stream and waited for: the
   *   stream's first work, so whatever the driver defers to it is not in
   *   the first staged call. */
  size_t tables = (size_t)(x->tune.stage_pieces + 1) * (size_t)round256(KVF_KERNEL_PARAM_MAX);
  if ((st = grow_host_blob(x, tables))) {
    cudaSetDevice(prev);
    goto fail;
  }
  memset(x->host_blob, 0, x->host_blob_cap);
  e = cudaEventRecord(x->join, x->ce_stream);
  if (e == cudaSuccess) e = cudaEventSynchronize(x->join);
  if (e != cudaSuccess) {
    cudaSetDevice(prev);
    st = kvf_fail(KVF_ERR_CUDA, "kvf_xfer_create: device %d: the copy-engine stream: %s", x->device,
                  cudaGetErrorString(e));
    cudaGetLastError();
    goto fail;
  }
  cudaSetDevice(prev);
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
    /* Deferred calls are enqueued first, then waited for with the rest. */
    defer_stop(x);
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
    if (x->call_mark) cudaEventDestroy(x->call_mark);
    if (x->call_end_mark) cudaEventDestroy(x->call_end_mark);
    if (x->span_start) cudaEventDestroy(x->span_start);
    if (x->span_end) cudaEventDestroy(x->span_end);
    if (x->ce_stream) cudaStreamDestroy(x->ce_stream);
    if (x->private_stream) {
      cudaStreamSynchronize(x->private_stream);
      cudaStreamDestroy(x->private_stream);
    }
    cudaGetLastError();
    cudaSetDevice(prev);
  }
  free(x->region_seen);
  free(x->region_kind);
  kvf_memo_free(&x->runs_cache);
  kvf_memo_free(&x->plan_memo);
  kvf_memo_free(&x->blob_memo);
  pthread_mutex_destroy(&x->defer_post_mu);
  pthread_mutex_destroy(&x->defer_mu);
  pthread_cond_destroy(&x->defer_wake);
  pthread_cond_destroy(&x->defer_room);
#endif
  kvf_plan_free(&x->plan[0]);
  kvf_plan_free(&x->plan[1]);
  free(x->host_blob);
  pthread_mutex_destroy(&x->lock);
  free(x);
}

kvf_status kvf_xfer_last_stats(const kvf_xfer *x, kvf_xfer_stats *out) {
  if (!x || !out) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_xfer_last_stats: NULL argument");
  defer_drain(x);
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

/* The route of a request: where its source and destination live. Each
 * region the request reads or writes is queried once per call (a 61-layer
 * cache has 61 views of one region kind: one query per region, not per
 * view); every object is queried (a single pageable one would fault). */
static kvf_status route_of(kvf_xfer *x, const kvf_copy_request *r, int gather, kvf_xfer_route *route,
                           int *stageable) {
  const kvf_geometry *g = x->geometry;
  int cache_seen[3] = {0, 0, 0}, obj_seen[3] = {0, 0, 0};
  kvf_status st;
  mem_kind k = MEM_LOCAL;
  unsigned char small[256], *done = g->num_regions <= sizeof small ? small : calloc(g->num_regions, 1);
  if (!done) return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "transfer: out of memory");
  if (done == small) memset(small, 0, g->num_regions);
  for (uint32_t gi = 0; gi < g->num_groups; gi++) {
    if (!r->groups[gi].block_ids || !r->groups[gi].count) continue;
    const kvf_group *gr = &g->groups[gi];
    for (uint32_t l = 0; l < gr->num_views; l++) {
      uint32_t reg = g->views[gr->views[l]].desc.region;
      if (done[reg]) continue;
      done[reg] = 1;
      if (x->region_seen[reg] && x->region_seen[reg] == r->region_bases[reg]) {
        /* Device memory seen at this base before (the struct says why the
         * kind cannot have changed): one query per region per call cost
         * about 0.2-0.3 us each, 12-23 us of the 17-35 us a one-chunk call
         * took to enqueue on the 32- to 80-region presets (gpu-run1:
         * perf/results/2026-12-01-h200-run1/chunk-256.json, d2d
         * enqueue_alone_us, 1 region 11.1 us against 80 regions 35.0 us). */
        k = (mem_kind)x->region_kind[reg];
      } else {
        if ((st = classify(x, r->region_bases[reg], "region_bases", reg, &k))) {
          if (done != small) free(done);
          return st;
        }
        x->region_seen[reg] = k == MEM_HOST ? NULL : r->region_bases[reg];
        x->region_kind[reg] = (unsigned char)k;
      }
      cache_seen[k] = 1;
    }
  }
  if (done != small) free(done);
  /* objects may be NULL when nothing moves (every block skipped). */
  uint64_t n = r->objects ? kvf_copy_request_chunks(g, r) * g->num_object_groups : 0;
  for (uint64_t i = 0; i < n; i++) {
    if (!r->objects[i]) continue;
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
   * PCIe leg (from a staging buffer, or straight between them). */
  *stageable = cache_seen[MEM_LOCAL] && !cache_seen[MEM_HOST] && !cache_seen[MEM_PEER] && obj_seen[MEM_HOST] &&
               !obj_seen[MEM_LOCAL] && !obj_seen[MEM_PEER];
  return KVF_SUCCESS;
}

/* ---- tables: in kernel parameters, or uploaded through a slot ------------- */

static kvf_status grow_staging(kvf_xfer *x, staging *s, size_t size);

/* The host buffer tables are built in when they go in kernel parameters:
 * at least `size` bytes (readable past a blob up to its parameter room). */
static kvf_status grow_host_blob(kvf_xfer *x, size_t size) {
  if (size <= x->host_blob_cap) return KVF_SUCCESS;
  size_t cap = x->host_blob_cap ? x->host_blob_cap : 64 << 10;
  while (cap < size) cap *= 2;
  void *p = aligned_alloc(64, cap);
  if (!p) return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "transfer: out of memory for %zu bytes of tables", cap);
  free(x->host_blob);
  x->host_blob = p;
  x->host_blob_cap = cap;
  return KVF_SUCCESS;
}

/* A device-to-device or peer launch that may use every SM: the launches
 * that spread, overlap and take larger tasks. Launches that touch host
 * memory and the staging kernels keep to their SM cap, which is what leaves
 * the engine's SMs alone. */
static int uncapped_device(const kvf_xfer *x, kvf_xfer_route route, uint32_t ctas) {
  return (route == KVF_ROUTE_D2D || route == KVF_ROUTE_PEER) && ctas >= (uint32_t)x->sm_count;
}

/* Which kernel a launch of `route` on `ctas` SMs moving `payload` bytes
 * runs (kernels/launch.h): the grid-stride walk when KVF_XFER_KERNEL=1 or a
 * segment's in-block offsets need 64 bits; else the warp walk, spread over
 * small CTAs when the launch is device to device or between peers (where it
 * was measured), may use every SM and moves at least KVF_XFER_SPREAD_KB
 * (xfer_kernel.cu has the measurement), in the deep shape when
 * kvf_spread_is_deep. Launches that touch host memory
 * and the staging kernels keep one CTA per SM: their cap is what leaves the
 * engine's SMs alone. */
static int kernel_of(const kvf_xfer *x, kvf_xfer_route route, uint32_t ctas, uint64_t payload) {
  if (x->tune.kernel == 1 || x->plan[0].wide || x->plan[1].wide) return KVF_KERNEL_GRID_STRIDE;
  if (uncapped_device(x, route, ctas) && x->tune.spread_kb > 0 && payload >= ((uint64_t)x->tune.spread_kb << 10))
    return kvf_spread_is_deep(&x->tune, payload) ? KVF_KERNEL_WALK_SPREAD : KVF_KERNEL_WALK_SPREAD_SHALLOW;
  return KVF_KERNEL_WALK;
}

/* Whether a launch asks its warp walk for the cache's address order on
 * head-major blocks (kernels/walk.h, kvf_walk::cache_order_of): device-to-device
 * gathers by the warp walk, where it was measured (KVF_XFER_CACHE_ORDER). */
static uint32_t launch_cache_order(const kvf_xfer *x, kvf_xfer_route route, int gather, int kernel) {
  return x->tune.cache_order && gather && route == KVF_ROUTE_D2D && kernel != KVF_KERNEL_GRID_STRIDE;
}

/* Whether a parameter launch overlaps the stream's previous kernel
 * (kernels/launch.h; KVF_XFER_OVERLAP): device-to-device and peer launches
 * that may use every SM, by a warp walk, where the device and the kernels'
 * build take it (compute capability 9.0). Host-memory launches keep their
 * cap's SMs and nothing more: an overlapping launch's CTAs wait on SMs while
 * the previous kernel drains. Measured on an H200
 * (perf/results/2026-12-02-h200-overlap, ab.md run b), d2d calls back to
 * back from one thread (kvf_bench's sustained rate, host enqueue charged,
 * against memcpy's same rate), without -> with the overlap: one chunk of
 * Llama 84.1-86.2% -> 99.8-103.2%, MLA 80.0 -> 102.9%, the tp4 slice
 * 77.8 -> 98.0%, the hybrids and fp8 caches 63.4-79.7 -> 84.9-93.4%, the
 * MLA DCP rank 56.8 -> 67.3%; 4096 tokens 87.7-94.7 -> 92.3-99.4%. One call
 * bracketed by events (an event between calls ends the overlap) is
 * unchanged. */
static int launch_overlap(const kvf_xfer *x, kvf_xfer_route route, uint32_t ctas, int kernel) {
  return x->tune.overlap && x->can_overlap && uncapped_device(x, route, ctas) && kernel != KVF_KERNEL_GRID_STRIDE;
}

/* Tables of `size` bytes go in the kernel's parameters. */
static int fits_params(const kvf_xfer *x, size_t size) {
  return x->tune.param_bytes > 0 && size <= (size_t)x->tune.param_bytes && kvf_kernel_param_room(size) > 0;
}

/* Take the next slot of the ring for an upload of `size` bytes: waits for
 * the call eight uploads ago (its event), never for the device. */
static kvf_status take_slot(kvf_xfer *x, size_t size, staging **out) {
  staging *s = &x->slots[x->next_slot];
  if (s->in_use && cudaEventSynchronize(s->done) != cudaSuccess) {
    cudaError_t e = cudaGetLastError();
    return kvf_fail(KVF_ERR_CUDA, "waiting for an earlier transfer: %s", cudaGetErrorString(e));
  }
  s->in_use = 0;
  kvf_status st = grow_staging(x, s, size);
  if (st) return st;
  *out = s;
  return KVF_SUCCESS;
}

/* How a launch on `ctas` SMs builds its blob: tasks of task_bytes, or of
 * the largest halving of it that still gives every warp `waves` tasks
 * (KVF_XFER_TASK_WAVES; 0 keeps task_bytes). The build takes the slice
 * once it knows the payload, so no second pass re-cuts the tasks: a
 * one-chunk blob took 2.3-6.6 us to build and re-cut on the development VM,
 * 1.5-4.1 us this way (the 80-layer tp4 slice the most), 0.75-1.54 us once
 * entries took a recent entry's shape as is (kernels/plan.c). */
static kvf_blob_opts blob_opts(const kvf_xfer *x, uint32_t ctas, int64_t waves, const unsigned char *segments) {
  kvf_blob_opts o = {(uint32_t)x->tune.task_bytes, segments, 0};
  if (waves > 0 && ctas > 0) o.task_slots = (uint64_t)ctas * (uint64_t)(kvf_kernel_threads() / 32) * (uint64_t)waves;
  return o;
}

/* Tasks per warp a launch of `route` on `ctas` SMs aims at: a device-to-
 * device or peer launch that may use every SM takes larger tasks
 * (KVF_XFER_DEVICE_TASK_WAVES), since each of a warp's tasks starts with a
 * chain of dependent table loads. Measured on an H200 (perf/results/
 * 2026-12-02-h200-overlap, waves.md), one chunk d2d per call, 2 waves
 * against 4: the MLA DCP rank 66.6 -> 71.5% of memcpy, the fp8 and hybrid
 * caches +2.2 to +5.5 points, the tp4 slice +0.9, Llama and MLA within a
 * point; 4096 tokens unchanged (8 KiB tasks either way). Then 1 against 2
 * (perf/results/2026-12-02-h200-decode, ab.md, two runs of two rounds): the
 * DCP rank +4.3 to +5.7 points, the qwen3-like hybrid +3.2 to +3.4, the
 * glm-like hybrid and the MLA fp8 cache +0.4 to +1.5, the fp8-inline Llama
 * -0.7, the rest within half a point; 4096 tokens within 0.3. Capped and
 * staging launches keep KVF_XFER_TASK_WAVES. */
static int64_t waves_of(const kvf_xfer *x, kvf_xfer_route route, uint32_t ctas) {
  return uncapped_device(x, route, ctas) ? x->tune.device_task_waves : x->tune.task_waves;
}

/* ---- the copy-engine batch route ------------------------------------------ */

/* The legacy default stream (NULL, cudaStreamLegacy) and the per-thread one,
 * which cudaMemcpyBatchAsync refuses or may refuse. */
static int default_stream(cudaStream_t s) { return s == NULL || s == cudaStreamLegacy || s == cudaStreamPerThread; }

/* cudaEventQuery(event), or cudaStreamQuery(stream) when event is NULL, in
 * relaxed capture mode: in the default global mode a query while any thread
 * of the process captures a graph (on another stream) would be refused and
 * invalidate that capture. cudaErrorNotReady is not an error the runtime
 * keeps; another failure is cleared here and returned. */
static cudaError_t query_relaxed(cudaStream_t stream, cudaEvent_t event) {
  enum cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  cudaThreadExchangeStreamCaptureMode(&mode);
  cudaError_t q = event ? cudaEventQuery(event) : cudaStreamQuery(stream);
  cudaThreadExchangeStreamCaptureMode(&mode);
  if (q != cudaSuccess && q != cudaErrorNotReady) cudaGetLastError();
  return q;
}

/* The id of the call's stream (cudaStreamGetId: ids, unlike handles, are
 * never reused): asked once a call, in relaxed capture mode as
 * query_relaxed asks. None for a stream being captured (the runtime
 * refuses the ask there and invalidates the capture) or a default stream
 * (whose calls never compare ids). Returns whether there is one. */
static int call_stream_id(kvf_xfer *x, cudaStream_t stream, unsigned long long *id) {
  if (!x->call_stream_id_asked) {
    x->call_stream_id_asked = 1;
    x->call_stream_id = 0;
    x->call_stream_id_ok = 0;
    if (!x->call_captured && !default_stream(stream)) {
      enum cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
      cudaThreadExchangeStreamCaptureMode(&mode);
      x->call_stream_id_ok = cudaStreamGetId(stream, &x->call_stream_id) == cudaSuccess;
      if (!x->call_stream_id_ok) cudaGetLastError();
      cudaThreadExchangeStreamCaptureMode(&mode);
    }
  }
  *id = x->call_stream_id;
  return x->call_stream_id_ok;
}

/* Whether the stream is idle, or becomes idle within KVF_IDLE_WAIT_NS: an
 * event the caller recorded just before the call (as a latency measure
 * does, or an engine marking its stream) keeps it busy for a few us after
 * the record returns. On an H200 a call alone right behind such an event
 * found its stream busy after building its run list on about half the
 * calls, and then took the batch route where the rule said staged (the
 * bf16 and fp8 MLA chunks h2d alone at 1.08-1.12x a memcpy where the
 * staged route took 1.04-1.06x; perf/results/2026-12-04-h200-straight-
 * alone, d4). Asked only where idleness decides the route or its shape (a
 * call the host-bound rule could stage, a small gather's straight part,
 * the batch route's ramp: ramped_batch_copy), so a stream busy with
 * other work costs such a call at most this much host time
 * (KVF_IDLE_WAIT_NS), which x->idle_wait_ns keeps out of the batch calls'
 * host time. */
static int stream_idle_soon(kvf_xfer *x, cudaStream_t stream) {
  if (query_relaxed(stream, NULL) == cudaSuccess) return 1;
  /* A call that came within KVF_XFER_BATCH_BACK_TO_BACK_US of the
   * context's previous one on this stream finds that call's work there,
   * not an event: waiting would only add host time to calls back to back
   * (the MLA DCP rank's chunk, whose scatter the rule weighs staged alone,
   * ran back to back at 0.82x cudaMemcpyBatchAsync's rate with the wait on
   * every call). The stream by its id: a destroyed stream's handle can come
   * back for another, which holds none of that call's work. */
  unsigned long long id = 0;
  if (x->call_end_has_id &&
      kvf_came_back_to_back(x->call_end_ns, x->call_start_ns, (uint64_t)x->tune.batch_back_to_back_us * 1000ull) &&
      call_stream_id(x, stream, &id) && id == x->call_end_stream_id)
    return 0;
  const uint64_t t0 = kvf_now_ns();
  int idle = 0;
  while (!idle && kvf_now_ns() - t0 < KVF_IDLE_WAIT_NS) idle = query_relaxed(stream, NULL) == cudaSuccess;
  /* Not the batch API's host time, which the host-bound rule weighs. */
  x->idle_wait_ns += kvf_now_ns() - t0;
  return idle;
}

/* Reads the span of the staged call measured last (host_bound_goes_staged)
 * once both its marks have completed: one more measure of the staged
 * route's cost back to back. Only a call that came while the stream worked
 * on the call before it is measured: its span starts as that work ends, so
 * it is the staged route's period back to back, where the batch route's is
 * its host time. That period is not what a call alone costs: on the H200
 * the fp8 MLA chunk's staged calls ran at 1.02-1.12x the copy back to back,
 * and a span on an idle stream, which also holds the call's planning before
 * its first enqueue, measured 1.48-1.54x (where the call alone, host
 * included, took 1.26x a memcpy's wall time: the first call on a context is
 * not a typical one). A call on an idle stream weighs a model of both
 * routes' latency instead (alone_outlasts).
 * perf/results/2026-12-04-h200-hostbound-measured. */
static void read_staged_span(kvf_xfer *x) {
  if (!x->span_pending) return;
  cudaError_t q = query_relaxed(NULL, x->span_end);
  if (q == cudaErrorNotReady) return;
  x->span_pending = 0;
  float ms = 0;
  if (q != cudaSuccess || cudaEventElapsedTime(&ms, x->span_start, x->span_end) != cudaSuccess) {
    cudaGetLastError();
    return;
  }
  uint64_t cost = kvf_staged_cost_sample(ms > 0 ? (uint64_t)((double)ms * 1e6) : 0, x->span_engine_ns);
  if (cost) x->staged_cost[x->staged_cost_measures++ % KVF_STAGED_COST_SAMPLES] = cost;
}

/* Forget the measures (under x->lock): they are thousandths of the copy time
 * at the link rate they were taken at, and a span in flight carries its
 * call's copy time at that rate. */
static void forget_staged_cost(kvf_xfer *x) {
  memset(x->staged_cost, 0, sizeof x->staged_cost);
  x->staged_cost_measures = 0;
  x->staged_kept_batched = 0;
  x->span_pending = 0;
  x->span_armed = 0;
}

/* The staged route's cost back to back: measured (kvf_staged_cost_of; the
 * ring is full once KVF_STAGED_COST_SAMPLES measures are taken). */
static uint64_t staged_cost_back_to_back(const kvf_xfer *x) {
  size_t n = x->staged_cost_measures < KVF_STAGED_COST_SAMPLES ? (size_t)x->staged_cost_measures
                                                                : KVF_STAGED_COST_SAMPLES;
  return kvf_staged_cost_of(x->staged_cost, n, x->tune.batch_staged_cost);
}

/* Whether the context's last two batch calls, for `runs` runs, outlast the
 * staged route at `cost` (kvf_batch_host_outlasts_staged). */
static int host_outlasts(const kvf_xfer *x, uint64_t runs, uint64_t engine_ns, uint64_t cost) {
  return kvf_batch_host_outlasts_staged(x->batch_host_ns, x->batch_runs, x->batch_host_ns_before, x->batch_runs_before,
                                        runs, engine_ns, cost);
}

/* Whether a host-bound call alone, on an idle stream, goes staged: a span
 * there holds the call's planning and is not measured (read_staged_span
 * says why). With the cost fixed (KVF_XFER_BATCH_STAGED_COST), the
 * host time against it; else the batch route's latency alone at that host
 * time, ramp included, against the staged route's
 * (kvf_batch_alone_outlasts_staged): past the copy time the ramp's last
 * call, half the runs, is copied after all the host time, and the fixed
 * eighth kept such calls batched up to 1.125x (the fp8 MLA chunk d2h alone
 * at 1.56x a memcpy where the staged route took 1.29x). */
static int alone_outlasts(const kvf_xfer *x, uint64_t runs, uint64_t engine_ns, int gather) {
  if (x->tune.batch_staged_cost > 0) return host_outlasts(x, runs, engine_ns, (uint64_t)x->tune.batch_staged_cost);
  return kvf_batch_alone_outlasts_staged(x->batch_host_ns, x->batch_runs, x->batch_host_ns_before,
                                         x->batch_runs_before, runs, (uint64_t)x->tune.batch_first_runs, engine_ns,
                                         gather);
}

/* Whether a request the batch route fits, of `runs` runs whose copies take
 * engine_ns at KVF_XFER_BATCH_LINK_GBPS, goes staged instead
 * (KVF_XFER_BATCH_HOST_BOUND). The batch API's host time grows with the
 * runs (0.45-0.9 us each on the H200's KVM host, bimodal), the staged
 * route's does not: where the context's last two batch calls say the
 * batch route would take longer than the staged route (on an idle stream
 * their latencies alone, alone_outlasts; behind the previous call the host
 * time against the staged route's period back to back as measured on the
 * context, kvf_batch_host_outlasts_staged and read_staged_span; the fp8 MLA
 * chunk's 244 runs of 41 KiB on a slow host: 218-240 us for a 188 us copy),
 * the batch route keeps the copy engine waiting, back to back or alone, and the staged route (35-55
 * us of host time, GPU time 97.6-98.7% of the batch route's) does not. Not
 * when the stream is busy unless with the context's call right before this
 * one, which came back within KVF_XFER_BATCH_BACK_TO_BACK_US (between its
 * start and end marks): work queued ahead hides this call's host time, and
 * the batch route in one call is the faster copy. Every
 * KVF_BATCH_HOST_BOUND_RETRY + 1st host-bound call takes the batch route,
 * so a host that got faster is seen. Records the start mark the next call
 * asks about (end_call_mark records the end) and, for a staged call behind
 * the previous one, the timed start of its span (read_staged_span): events
 * of the context's own that neither copy nor wait; enqueues nothing else.
 * *stream_idle: whether the stream was idle (-1: not asked). */
static int host_bound_goes_staged(kvf_xfer *x, uint64_t runs, uint64_t engine_ns, int gather, cudaStream_t stream,
                                  int *stream_idle) {
  *stream_idle = -1;
  if (!x->tune.batch_host_bound || x->tune.staging_mb <= 0 || x->tune.batch_link_gbps <= 0) return 0;
  read_staged_span(x);
  const uint64_t back_to_back_cost = staged_cost_back_to_back(x);
  /* Unmeasured, or measured again (below): the cost a call back to back that
   * the measures keep batched would weigh without them. */
  const uint64_t explore =
      x->tune.batch_staged_cost > 0 ? (uint64_t)x->tune.batch_staged_cost : KVF_BATCH_STAGED_COST_UNMEASURED;
  const uint64_t lowest = explore < back_to_back_cost ? explore : back_to_back_cost;
  /* The stream is asked only when the call could go staged, alone or back
   * to back. */
  const int alone = alone_outlasts(x, runs, engine_ns, gather), behind = host_outlasts(x, runs, engine_ns, lowest);
  if (!alone && !behind) return 0;
  /* Asked before the mark goes on the stream, which would make it look
   * busy to the ramp (ramped_batch_copy) of a call that stays batched. A
   * busy stream is the previous call's alone (back to back behind a slow
   * host) only between that call's marks; no marks: the first host-bound
   * call, another route or stream in between, and behind a host that keeps
   * ahead work is queued. Work the caller queued behind that call leaves
   * its end mark reached once it is done, and while it is not, only time
   * tells: a call back to back (within the window) has had no time to
   * queue much. Asked as the ramp asks (stream_idle_soon) for a call weighed
   * back to back too: one ask behind an event the caller had just recorded
   * left such a call batched in one call, where the event completes within
   * the wait and the ramp pays; back to back on its stream it waits for
   * nothing there either. */
  int idle = stream_idle_soon(x, stream);
  *stream_idle = idle;
  /* Only a call alone could go staged (the latency model can send a call
   * staged whose host time is under its copy time): behind other work it
   * takes the batch route and leaves no marks, as a call that is not
   * host-bound. */
  if (!idle && !behind) return 0;
  unsigned long long stream_id = 0;
  const int have_id = call_stream_id(x, stream, &stream_id);
  int back_to_back =
      kvf_came_back_to_back(x->call_mark_end_ns, x->call_start_ns, (uint64_t)x->tune.batch_back_to_back_us * 1000ull);
  int reached = idle || (have_id && back_to_back && x->call_mark_call != 0 && x->call_mark_call + 1 == x->cuda_calls &&
                         x->call_mark_stream_id == stream_id &&
                         query_relaxed(NULL, x->call_mark) != cudaErrorNotReady &&
                         query_relaxed(NULL, x->call_end_mark) == cudaErrorNotReady);
  x->call_mark_call = 0;
  if (have_id) {
    if (cudaEventRecord(x->call_mark, stream) == cudaSuccess) {
      x->call_mark_started = x->cuda_calls;
      x->call_mark_stream_id = stream_id;
    } else {
      cudaGetLastError(); /* the call's own enqueues report a broken stream */
    }
  }
  if (!reached || x->host_bound_staged >= KVF_BATCH_HOST_BOUND_RETRY) return 0;
  x->rule_back_to_back = !idle;
  int staged = idle ? alone : host_outlasts(x, runs, engine_ns, back_to_back_cost);
  /* Kept batched by the measures alone: every KVF_STAGED_COST_REMEASURE-th
   * such call goes staged to be measured again. */
  if (!staged && !idle && x->tune.batch_staged_cost == 0 && !x->span_pending &&
      host_outlasts(x, runs, engine_ns, explore) && ++x->staged_kept_batched >= KVF_STAGED_COST_REMEASURE)
    staged = 1;
  if (staged) {
    if (!idle) x->staged_kept_batched = 0;
    x->host_bound_staged++;
    /* Measure this call's span when it follows the previous call's work
     * (read_staged_span), unless a span is still in flight (its events
     * would be recorded again before it was read). */
    if (x->tune.batch_staged_cost == 0 && !idle && !x->span_pending) {
      if (cudaEventRecord(x->span_start, stream) == cudaSuccess) {
        x->span_armed = x->cuda_calls;
        x->span_engine_ns = engine_ns;
      } else {
        cudaGetLastError(); /* no measure this time; the call's own enqueues report a broken stream */
      }
    }
    return 1;
  }
  return 0;
}

/* n copies in one cudaMemcpyBatchAsync on `stream`, each after the work
 * enqueued before it there. */
static cudaError_t batch_copy(void **dst, const void **src, size_t *size, size_t n, cudaStream_t stream) {
  struct cudaMemcpyAttributes attr;
  memset(&attr, 0, sizeof attr);
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  size_t attr_idx = 0;
  return cudaMemcpyBatchAsync(dst, src, size, n, &attr, &attr_idx, 1, stream);
}

/* n copies in cudaMemcpyBatchAsync calls of growing size (kvf_batch_ramp_runs)
 * on `stream`, or in one call when the stream has work queued; *calls
 * counts them. all_engine_ns: the n copies' time at
 * KVF_XFER_BATCH_LINK_GBPS. The batch API's host time grows with its runs,
 * about 0.45-0.9 us each, and its copies start only once the call returns:
 * on an idle stream a 244-run MLA chunk waited 104-219 us for its first
 * byte, 1.31-1.63x a memcpy's latency. A first call of a few runs starts
 * the copy engine, and each later call is enqueued while it works (a 73 KiB run takes 1.3 us at
 * 55 GB/s). Each call also costs the copy engine about 2 us, so behind queued
 * work, where the host is ahead anyway, one call is faster. Measured on an
 * H200 (perf/results/2026-12-02-h200-ramp/ramp.md): the MLA chunk's latency
 * d2h / h2d 1.63 / 1.40x of memcpy in one call, 1.05 / 1.03x from 8 runs
 * (1.19 / 1.21x from 4, 1.16 / 1.30x from 16; 1.05-1.12x in two later runs,
 * the host's enqueue varying 130-200 us); behind queued work, ramped,
 * 97.4 / 96.8% of memcpy against 100.0 / 100.0% in one call.
 * Doubling keeps the host ahead only while a run's host time is under half
 * its copy time: on a host at 0.8 us a run the copy engine idled between
 * the calls and the chunk's latency rose to 1.10x (perf/results/
 * 2026-12-02-h200-rows/NOTES.md). So after the first call each call takes
 * what the host can enqueue while the copy engine moves the previous
 * call's bytes at KVF_XFER_BATCH_LINK_GBPS, timed on the previous call
 * (kvf_batch_ramp_next). The calls stay on one stream: alternated with a
 * second stream, which the driver may give to another of the H200's three
 * async engines, every MLA row was slower (perf/results/
 * 2026-12-03-h200-batch-engines: GPU time of the ramp 340 -> 345-352 us). */
static cudaError_t ramped_batch_copy(kvf_xfer *x, void **dst, const void **src, size_t *size, size_t n,
                                     uint64_t all_engine_ns, cudaStream_t stream, int stream_idle, uint64_t *calls,
                                     size_t *enqueued) {
  uint64_t first = (uint64_t)x->tune.batch_first_runs;
  /* Calls back to back on a host slower than the copy engine: the ramp's
   * calls would only add host time (kvf_batch_back_to_back). */
  if (first > 0 && first < n && x->tune.batch_link_gbps > 0 && x->tune.batch_back_to_back_us > 0 &&
      kvf_batch_back_to_back(x->batch_host_ns, x->batch_runs, x->batch_end_ns, x->call_start_ns,
                             (uint64_t)x->tune.batch_back_to_back_us * 1000ull, n, all_engine_ns))
    first = 0;
  /* cudaErrorNotReady (work queued) is not an error the runtime keeps;
   * another answer leaves one call, which reports a broken stream.
   * stream_idle: the answer asked earlier in this call (-1: none). Asked as
   * the host-bound rule asks (stream_idle_soon): an event the caller
   * recorded just before the call keeps the stream busy for a few us, and
   * one ask then made one call, whose copies start only once the host has
   * enqueued them all. Measured on an H100 behind such an event (kvf_bench's
   * latency mode): the bf16 MLA chunk d2h alone took 397 us of GPU time
   * against 327 for a memcpy, its 72 us of enqueue plus the copy
   * (perf/results/2026-12-05-h100-ramp-behind-event). Asked only where the
   * first call would leave runs for a second (up to twice `first` it takes
   * them all), and the wait counts in the call's planning (planned_ns),
   * which ends at its first enqueue, as the rule's does. */
  const int can_ramp = first > 0 && kvf_batch_ramp_runs(0, first, n) < n;
  if (can_ramp && stream_idle < 0) {
    stream_idle = stream_idle_soon(x, stream);
    x->planned_ns = kvf_now_ns();
  }
  if (can_ramp && !stream_idle) first = 0;
  cudaError_t e = cudaSuccess;
  *enqueued = 0;
  size_t m = 0;
  uint64_t host_ns = 0, engine_ns = 0;
  for (size_t k = 0; *enqueued < n; k++) {
    size_t left = n - *enqueued;
    m = k > 0 && x->tune.batch_link_gbps > 0 ? (size_t)kvf_batch_ramp_next(m, left, host_ns, engine_ns)
                                              : (size_t)kvf_batch_ramp_runs(k, first, left);
    uint64_t t0 = kvf_now_ns();
    if ((e = batch_copy(dst + *enqueued, src + *enqueued, size + *enqueued, m, stream)) != cudaSuccess) break;
    if (x->tune.batch_link_gbps > 0 && *enqueued + m < n) { /* the next call is paced by this one */
      host_ns = kvf_now_ns() - t0;
      uint64_t bytes = 0;
      for (size_t i = 0; i < m; i++) bytes += size[*enqueued + i];
      engine_ns = bytes / (uint64_t)x->tune.batch_link_gbps; /* GB/s = bytes/ns */
    }
    *enqueued += m;
    (*calls)++;
  }
  return e;
}

/* What decides a request's batch-API runs but its block ids: its
 * direction, format and token count, and (hashed, FNV-1a) which groups
 * move and which objects are present. Not a group's count or first block,
 * which describe the table it passes (a chunk's slice of it, or all of
 * it) and move with every chunk of a sequence; nor skipped blocks or the
 * ids' contiguity, which the estimate leaves to the next listing. Equal
 * shapes list about the same runs. */
static struct batch_shape batch_shape_of(const kvf_geometry *g, const kvf_copy_request *r, int gather) {
  struct batch_shape s = {gather, r->format, r->token_end - r->token_begin, 14695981039346656037ull, 0, 0};
  const uint64_t prime = 1099511628211ull;
  for (uint32_t gi = 0; gi < g->num_groups; gi++) {
    const kvf_group_blocks *b = &r->groups[gi];
    s.moving = (s.moving ^ (uint64_t)(b->block_ids != NULL && b->count > 0)) * prime;
  }
  const uint64_t objects = kvf_copy_request_chunks(g, r) * g->num_object_groups;
  for (uint64_t i = 0; i < objects; i++) s.moving = (s.moving ^ (uint64_t)(r->objects[i] != NULL)) * prime;
  return s;
}

static int same_batch_shape(const struct batch_shape *a, const struct batch_shape *b) {
  return a->gather == b->gather && a->format == b->format && a->tokens == b->tokens && a->moving == b->moving;
}

/* The copy engine moves the request's runs straight between the cache and
 * the host objects, on the caller's stream: one call, no kernel, no SM
 * (measured on an H200, perf/results/2026-11-29-h200/curve.json: 55.1-55.3
 * GB/s, the memcpy limit, for runs of 32-72 KiB up to 16384 runs: one
 * 256-token Llama-3.1-8B chunk, 1024 runs of 32 KiB, 55.1 of 55.2 GB/s;
 * 38.5 GB/s at 65472 runs; 0.3-0.6 GB/s for 256-byte runs). The call's host
 * time grows with its runs (perf/results/2026-12-01-h200-run1/
 * chunk-256.json and chunk-4096.json, enqueue_alone_us d2h/h2d: 61 runs
 * 36/40 us, 84 runs 85/53, 244 runs 117/123, 1024 runs 453-868, 3904 runs
 * 3597/3019, 16384 runs 7437/7601), so KVF_XFER_BATCH_MAX_RUNS keeps it to
 * 256 runs (the MLA chunk's 244); a Llama chunk's 1024 go staged instead
 * (95.8% / 95.1% of memcpy d2h / h2d with 4 pieces there, cross.json).
 * Returns KVF_ERR_UNSUPPORTED (nothing enqueued) when the request does not
 * fit, or fits but goes staged for a host slower than its copies
 * (host_bound_goes_staged: *host_bound 1). */
static kvf_status launch_copy_batch(kvf_xfer *x, const kvf_copy_request *r, int gather, cudaStream_t stream,
                                    int *host_bound, int *stream_idle) {
  const kvf_plan *plan = &x->plan[r->format];
  /* Refused without listing when its ids cannot merge under the limit (a
   * Llama chunk's 1024 blocks of shuffled ids: listing them took about 15
   * us of a call alone on the H200, 1.089x a memcpy against 1.072x with
   * the route off). */
  if (kvf_stage_batch_runs_floor(x->geometry, plan, r) > (uint64_t)x->tune.batch_max_runs) return KVF_ERR_UNSUPPORTED;
  /* A request of the last listed one's shape asks the host-bound rule with
   * its runs before listing its own: a call that goes staged then spares
   * the listing (8-10 us for the fp8 and bf16 MLA chunks' 244 runs on the
   * H200, where the staged route alone took 1.04x a memcpy and the call
   * that listed first 1.07x; perf/results/2026-12-04-h200-straight-alone).
   * The block ids may merge into other runs: an estimate, as the host
   * time the rule scales by them is. (Asking again once listed would find
   * the call's marks already taken: a call back to back could not go
   * staged, and the ramp would ask a stream holding the mark.) */
  const struct batch_shape shape = batch_shape_of(x->geometry, r, gather);
  int asked = 0;
  if (x->listed.runs && same_batch_shape(&x->listed, &shape)) {
    asked = 1;
    if (host_bound_goes_staged(x, x->listed.runs, x->listed.engine_ns, gather, stream, stream_idle)) {
      *host_bound = 1;
      return KVF_ERR_UNSUPPORTED;
    }
  }
  size_t size = (size_t)kvf_blob_size(x->geometry, plan, r, NULL);
  kvf_status st = grow_host_blob(x, size);
  if (st) return st;
  kvf_blob_build_memo(&x->blob_memo, x->geometry, plan, r, gather, NULL, x->host_blob);
  x->call_listed = 1;
  void **dst = NULL;
  const void **src = NULL;
  size_t *sizes = NULL, count = 0;
  int fit = kvf_stage_batch_runs(x->host_blob, gather, (uint64_t)x->tune.batch_min_run,
                                 (uint64_t)x->tune.batch_max_runs, &dst, &src, &sizes, &count);
  if (fit < 0) return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "transfer: out of memory");
  if (fit == 0) return KVF_ERR_UNSUPPORTED;
  uint64_t bytes = 0;
  for (size_t i = 0; i < count; i++) bytes += sizes[i];
  uint64_t engine_ns = x->tune.batch_link_gbps > 0 ? bytes / (uint64_t)x->tune.batch_link_gbps : 0; /* GB/s = bytes/ns */
  x->listed = shape;
  x->listed.runs = count;
  x->listed.engine_ns = engine_ns;
  /* A request of a new shape lists its runs first: the rule needs their
   * count. */
  if (!asked && host_bound_goes_staged(x, count, engine_ns, gather, stream, stream_idle)) {
    free(dst);
    free(src);
    free(sizes);
    *host_bound = 1;
    return KVF_ERR_UNSUPPORTED;
  }
  uint64_t calls = 0;
  size_t enqueued = 0;
  x->planned_ns = kvf_now_ns();
  cudaError_t e = ramped_batch_copy(x, dst, src, sizes, count, engine_ns, stream, *stream_idle, &calls, &enqueued);
  if (e == cudaSuccess) { /* what the next call's kvf_batch_back_to_back and host_bound_goes_staged weigh */
    x->batch_host_ns_before = x->batch_host_ns;
    x->batch_runs_before = x->batch_runs;
    x->batch_end_ns = kvf_now_ns();
    uint64_t host_ns = x->batch_end_ns - x->call_start_ns;
    x->batch_host_ns = host_ns > x->idle_wait_ns ? host_ns - x->idle_wait_ns : 0;
    x->batch_runs = count;
    x->host_bound_staged = 0;
  }
  free(dst);
  free(src);
  free(sizes);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return kvf_fail(KVF_ERR_CUDA,
                    "copy-engine %s of %zu runs: cudaMemcpyBatchAsync (call %llu, after %zu runs enqueued whole): %s; "
                    "its own copies may have been enqueued in part: the request's %s are unspecified until the "
                    "stream's work completes",
                    gather ? "gather" : "scatter", count, (unsigned long long)calls + 1, enqueued,
                    cudaGetErrorString(e), gather ? "objects" : "blocks");
  }
  const kvf_blob_header *h = x->host_blob;
  x->last.route = gather ? KVF_ROUTE_D2H : KVF_ROUTE_H2D;
  x->last.sms = 0;
  x->last.tasks = (uint32_t)count;
  x->last.payload_bytes = h->payload_bytes;
  x->path = (kvf_xfer_path_info){.path = KVF_PATH_COPY_BATCH, .dma_ops = calls, .dma_runs = count};
  return KVF_SUCCESS;
}

/* ---- the staged route -------------------------------------------------- */

/* Make both staging buffers at least `need` bytes (at least the configured
 * size). Growing waits for the buffers' last users: it is rare (the context
 * sizes them for the largest chunk when it is created). */
static kvf_status grow_stage(kvf_xfer *x, size_t need) {
  size_t want = (size_t)x->tune.staging_mb << 20;
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

/* One kernel launch of a staged call: a piece of a batch, or the direct
 * launch for objects written in part. */
typedef struct launch {
  uint64_t blob_off; /* in the call's tables (x->host_blob, and the slot when uploaded) */
  uint64_t blob_size;
  uint64_t tasks;
  uint32_t slice;
} launch;

/* A batch's CUDA side; its chunks and bytes are the plan's kvf_stage_batch. */
typedef struct batch {
  uint32_t buf;        /* staging buffer */
  uint32_t first;      /* its pieces: launches [first, first + pieces) */
} batch;

/* The token range of a batch's chunks inside request r. */
static void batch_tokens(const kvf_copy_request *r, const kvf_stage_batch *b, uint64_t c, kvf_copy_request *part) {
  part->token_begin = r->token_begin + b->k0 * c;
  uint64_t span = (b->k1 - b->k0) * c;
  part->token_end = r->token_end - part->token_begin > span ? part->token_begin + span : r->token_end;
}

/* Everything one staged call enqueues, built before its first enqueue. */
typedef struct staged_call {
  kvf_stage_plan sp;
  uint32_t pieces;          /* per batch (1: one launch and the objects' spans, as before pieces) */
  unsigned char *masks;     /* [pieces][segments] */
  launch *launches;         /* [batches * pieces (+ 1 direct)] */
  uint64_t num_launches;
  batch *batches;
  kvf_stage_run *runs;      /* pieces > 1: every piece's copies, host object offsets */
  uint64_t *run_first;      /* [batches * pieces + 1] into runs */
  uint64_t num_runs, runs_cap;
  uint32_t runs_cached; /* pieces whose runs came from the context's cache */
  int uploaded;             /* tables uploaded through a slot (some launch's are too large for parameters) */
  staging *slot;
  int any_direct;
  uint64_t direct;          /* index of the direct launch */
  uint64_t edge;            /* the edge batch: a gather's first, a scatter's last */
  /* The straight part (KVF_XFER_STAGE_STRAIGHT_KB): views of the edge batch
   * the copy engine moves between the cache and the host objects itself,
   * left out of the edge batch's pieces (edge_masks). */
  unsigned char *edge_masks; /* [pieces][segments] */
  unsigned char *straight_pick; /* [segments]: the views the straight part moves */
  void **straight_dst;
  const void **straight_src;
  size_t *straight_size;
  size_t straight_runs;     /* 0: no straight part */
  uint64_t straight_bytes;
} staged_call;

/* Whether the copy engine's legs follow run lists (pieces > 1, or a
 * straight part the edge batch's copies must leave out) rather than each
 * object's span. */
static int uses_runs(const staged_call *c) { return c->pieces > 1 || c->straight_runs > 0; }

/* Leave a planned straight part out (plan_staged), or free it (staged_call_free). */
static void drop_straight(staged_call *c) {
  free(c->straight_pick);
  free(c->straight_dst);
  free(c->straight_src);
  free(c->straight_size);
  c->straight_pick = NULL;
  c->straight_dst = NULL;
  c->straight_src = NULL;
  c->straight_size = NULL;
  c->straight_runs = 0;
  c->straight_bytes = 0;
}

static void staged_call_free(staged_call *c) {
  kvf_stage_plan_free(&c->sp);
  free(c->masks);
  free(c->launches);
  free(c->batches);
  free(c->runs);
  free(c->run_first);
  free(c->edge_masks);
  drop_straight(c);
}

/* The kernel of a staged call's launches: never spread (they touch device
 * staging buffers under the staging SM cap). */
static int staged_kernel(const kvf_xfer *x) { return kernel_of(x, KVF_ROUTE_D2H, 0, 0); }

/* Launch l of a staged call on `stream` (the test hook may refuse the
 * first launch of batch `hook_batch`, see xfer_internal.h). */
static cudaError_t staged_launch(kvf_xfer *x, const staged_call *c, const launch *l, uint32_t sms, int64_t hook_batch,
                                 uint32_t *used_sms, cudaStream_t stream) {
  if (hook_batch >= 0 && hook_batch == __atomic_load_n(&test_fail_at_batch, __ATOMIC_RELAXED))
    return cudaErrorLaunchOutOfResources;
  if (!l->tasks) return cudaSuccess;
  uint32_t ctas = sms;
  cudaError_t e;
  if (c->uploaded) {
    e = kvf_kernel_launch((char *)c->slot->device + l->blob_off, l->tasks, &ctas, staged_kernel(x), stream);
  } else {
    e = kvf_kernel_launch_params((char *)x->host_blob + l->blob_off, l->blob_size, l->tasks, &ctas,
                                 staged_kernel(x), 0, stream);
    if (e == cudaSuccess) x->path.param_launches++;
  }
  if (e == cudaSuccess) {
    x->path.launches++;
    x->path.slice_bytes = l->slice;
    if (ctas > *used_sms) *used_sms = ctas;
  }
  return e;
}

/* The copy-engine leg of piece p of batch bi on stream ds: the objects'
 * spans (one piece, no straight part) or the piece's runs. */
static cudaError_t staged_dma(kvf_xfer *x, const kvf_copy_request *r, const staged_call *c, uint64_t bi, uint32_t p,
                              int gather, cudaStream_t ds) {
  const kvf_stage_plan *sp = &c->sp;
  const kvf_stage_batch *pb = &sp->batches[bi];
  uint64_t nog = sp->num_objects / sp->num_chunks;
  char *buf = x->stage[c->batches[bi].buf];
  enum cudaMemcpyKind kind = gather ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice;
  cudaError_t e = cudaSuccess;
  if (!uses_runs(c)) {
    for (uint64_t i = pb->k0 * nog; i < pb->k1 * nog && e == cudaSuccess; i++) {
      uint64_t lo = sp->span[2 * i], hi = sp->span[2 * i + 1];
      if (!sp->staged[i] || hi == lo) continue;
      char *host = (char *)r->objects[i] + lo, *dev = buf + sp->offset[i] + lo;
      e = cudaMemcpyAsync(gather ? host : dev, gather ? dev : host, hi - lo, kind, ds);
      x->path.dma_ops++;
      x->path.dma_runs++;
    }
    return e;
  }
  uint64_t a = c->run_first[bi * c->pieces + p], b = c->run_first[bi * c->pieces + p + 1];
  if (a == b) return cudaSuccess;
  if (b - a == 1 || !x->tune.stage_dma_batch) {
    for (uint64_t i = a; i < b && e == cudaSuccess; i++) {
      const kvf_stage_run *run = &c->runs[i];
      char *host = (char *)r->objects[run->object] + run->offset, *dev = buf + sp->offset[run->object] + run->offset;
      e = cudaMemcpyAsync(gather ? host : dev, gather ? dev : host, run->bytes, kind, ds);
      x->path.dma_ops++;
    }
    x->path.dma_runs += b - a;
    return e;
  }
  void *dst[64];
  const void *src[64];
  size_t size[64];
  for (uint64_t i = a; i < b && e == cudaSuccess;) {
    size_t n = 0;
    for (; i < b && n < 64; i++, n++) {
      const kvf_stage_run *run = &c->runs[i];
      char *host = (char *)r->objects[run->object] + run->offset, *dev = buf + sp->offset[run->object] + run->offset;
      dst[n] = gather ? host : dev;
      src[n] = gather ? dev : host;
      size[n] = run->bytes;
    }
    e = batch_copy(dst, src, size, n, ds);
    x->path.dma_ops++;
    x->path.dma_runs += n;
  }
  return e;
}

/* The straight part of a staged call on stream ds: one cudaMemcpyBatchAsync
 * between the cache and the host objects. */
static cudaError_t straight_dma(kvf_xfer *x, const staged_call *c, cudaStream_t ds) {
  cudaError_t e = batch_copy(c->straight_dst, c->straight_src, c->straight_size, c->straight_runs, ds);
  x->path.dma_ops++;
  x->path.dma_runs += c->straight_runs;
  x->path.straight_runs = c->straight_runs;
  x->path.straight_bytes = c->straight_bytes;
  return e;
}

/* Enqueue batch bi of a staged call, kernels on ks and the copy engine's
 * legs on ds; a gather's straight part goes with its edge batch, after the
 * first kernel launch (so a refused first launch leaves nothing enqueued).
 * Stops at the first enqueue the runtime refuses and returns its error
 * (*straight_refused set when it was the straight part's); what was enqueued
 * before it stays. */
static cudaError_t enqueue_batch(kvf_xfer *x, const kvf_copy_request *r, const staged_call *c, uint64_t bi, int gather,
                                 uint32_t stage_sms, uint32_t *used_sms, cudaStream_t ks, cudaStream_t ds,
                                 int *straight_refused) {
  uint32_t buf = c->batches[bi].buf;
  cudaError_t e;
  if (gather) {
    /* kernels: cache -> buffer after the buffer's previous copy-out; each
     * piece's copy-out starts as soon as its kernel is done */
    e = cudaStreamWaitEvent(ks, x->stage_free[buf], 0);
    for (uint32_t p = 0; e == cudaSuccess && p < c->pieces; p++) {
      e = staged_launch(x, c, &c->launches[c->batches[bi].first + p], stage_sms, p == 0 ? (int64_t)bi : -1, used_sms,
                        ks);
      if (e == cudaSuccess && p == 0 && bi == c->edge && c->straight_runs &&
          (e = straight_dma(x, c, ds)) != cudaSuccess)
        *straight_refused = 1;
      if (e == cudaSuccess) e = cudaEventRecord(x->stage_ready[buf], ks);
      if (e == cudaSuccess) e = cudaStreamWaitEvent(ds, x->stage_ready[buf], 0);
      if (e == cudaSuccess) e = staged_dma(x, r, c, bi, p, 1, ds);
    }
    if (e == cudaSuccess) e = cudaEventRecord(x->stage_free[buf], ds);
  } else {
    /* copy engine: objects -> buffer after the buffer's previous reader;
     * each piece's kernel starts as soon as its fill is done */
    e = cudaStreamWaitEvent(ds, x->stage_free[buf], 0);
    for (uint32_t p = 0; e == cudaSuccess && p < c->pieces; p++) {
      e = staged_dma(x, r, c, bi, p, 0, ds);
      if (e == cudaSuccess) e = cudaEventRecord(x->stage_ready[buf], ds);
      if (e == cudaSuccess) e = cudaStreamWaitEvent(ks, x->stage_ready[buf], 0);
      if (e == cudaSuccess)
        e = staged_launch(x, c, &c->launches[c->batches[bi].first + p], stage_sms, p == 0 ? (int64_t)bi : -1,
                          used_sms, ks);
    }
    if (e == cudaSuccess) e = cudaEventRecord(x->stage_free[buf], ks);
  }
  return e;
}

/* End a staged call in stream order, after its last enqueue or after one the
 * runtime refused (what was enqueued then stays and will run): the
 * copy-engine stream joins the caller's stream, and the tables' slot (when
 * the call uploaded its tables) becomes free only once everything the call
 * enqueued has run. After a refusal both staging buffers' free events move
 * there too: the refused batch may have left work on a buffer that its event
 * does not cover. Every step is tried and the first error returned. On a
 * healthy context none of these fails (the handles are the context's own,
 * the stream just took work); a failure means a broken context (a sticky
 * error), and then the internal stream is waited for, so none of the call's
 * work is left running unjoined. */
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
  if (slot) {
    if ((e = cudaEventRecord(slot->done, stream)) != cudaSuccess && first == cudaSuccess) first = e;
    slot->in_use = 1;
    x->next_slot = (x->next_slot + 1) % KVF_STAGING_SLOTS;
  }
  cudaGetLastError();
  return first;
}

/* Add a piece blob's copies (host object offsets) to the call's runs; *bad
 * set when a gather's piece would copy bytes no task writes (then the call
 * is planned again with one piece per batch). `cached`: through the
 * context's cache (kvf_stage_blob_runs_cached), for calls of one batch (the
 * one-chunk calls it was measured on); calls of several batches, whose
 * planning overlaps earlier batches' copies, list as before. */
static kvf_status add_piece_runs(kvf_xfer *x, staged_call *c, const void *blob, const uint64_t *base, int gather,
                                 int cached, int *bad) {
  const kvf_stage_run *runs = NULL;
  kvf_stage_run *own = NULL;
  uint64_t n = 0;
  int holes = 0;
  const uint64_t hits = x->runs_cache.hits;
  kvf_status st = cached ? kvf_stage_blob_runs_cached(&x->runs_cache, blob, base, &runs, &n, &holes)
                         : kvf_stage_blob_runs(blob, base, &own, &n, &holes);
  if (st) return st;
  c->runs_cached += x->runs_cache.hits != hits;
  if (own) runs = own;
  if (holes && gather) *bad = 1;
  if (c->num_runs + n > c->runs_cap) {
    uint64_t cap = c->runs_cap ? c->runs_cap : 64;
    while (cap < c->num_runs + n) cap *= 2;
    kvf_stage_run *p = realloc(c->runs, sizeof *p * cap);
    if (!p) {
      free(own);
      return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "transfer: out of memory");
    }
    c->runs = p;
    c->runs_cap = cap;
  }
  if (n) memcpy(c->runs + c->num_runs, runs, sizeof *runs * n); /* c->runs is NULL before a first run */
  c->num_runs += n;
  free(own);
  return KVF_SUCCESS;
}

/* The segment mask of piece p of batch bi (NULL: every segment). */
static const unsigned char *piece_mask(const staged_call *c, uint64_t bi, uint32_t p, uint64_t ns) {
  if (c->edge_masks && bi == c->edge) return c->edge_masks + (size_t)p * ns;
  return c->pieces > 1 ? c->masks + (size_t)p * ns : NULL;
}

/* The straight part of a staged call (KVF_XFER_STAGE_STRAIGHT_KB): the copy
 * engine moves the first views of a gather's first batch (the last views of
 * a scatter's last batch) between the cache and the host objects itself, on
 * the caller's stream, while the kernels stage the rest on the other. A
 * gather's copy engine then starts at once instead of after a kernel and a
 * hand-off between streams, and a scatter's last kernel runs while the copy
 * engine still works. Measured on an H200 (perf/results/2026-12-01-h200-
 * straight): perf/kvf_hop_probe's 8.3 MiB copy at 64 SMs, d2h 92.7% of
 * memcpy staged in 2 pieces -> 99.0% with 1 MiB straight, h2d 91.9 ->
 * 99.4% (the fork and join between the streams alone cost 11 us); kvf_bench,
 * one chunk at the default cap, 1 MiB straight against none: glm-like
 * d2h/h2d 90.4/88.7 -> 97.7/95.7%, gpt-oss-like 90.1/90.5 -> 96.9/96.7%,
 * fp8-inline 94.7/93.9 -> 98.6/98.0%, Llama NHD 95.9/96.0 -> 98.5/98.2%;
 * 4096 tokens: every such preset 99.0-99.6%.
 * Leaves the plan without a straight part (nothing allocated) when no view
 * fits: runs too short or not one per block, or the first straight view
 * alone past KVF_STAGE_STRAIGHT_MAX_RUNS runs or half the batch (the pick
 * stops before either). Objects the direct kernel writes (a gather's
 * partial ones) are left to it. */
static kvf_status plan_straight(kvf_xfer *x, const kvf_copy_request *r, int gather, int one_piece, staged_call *c) {
  const kvf_geometry *g = x->geometry;
  const kvf_plan *plan = &x->plan[r->format];
  uint64_t nog = g->num_object_groups, ns = plan->num_segments;
  const kvf_stage_batch *eb = &c->sp.batches[c->edge];
  uint64_t first = eb->k0 * nog, count = (eb->k1 - eb->k0) * nog;
  uint64_t min_run = (uint64_t)x->tune.stage_straight_min_run, target = (uint64_t)x->tune.stage_straight_kb << 10;
  /* Slow kernels (the context's SM cap below 64) leave the first piece's
   * kernel and a scatter's last one longer to hide: three times the bytes.
   * Measured on an H200 at 4 SMs (perf/results/
   * 2026-12-03-h200-cap4-straight, two runs), 2 -> 3 MiB: glm-like h2d
   * 87.7/87.8 -> 93.6/93.0% of memcpy, gpt-oss-like h2d 96.1/95.9 ->
   * 98.5/98.2, d2h 97.8/97.4 -> 98.5/98.2, every other row within its
   * noise. 4 MiB read the same where it fit, but passed half of
   * gpt-oss-like's batch, which left it no straight part (88.2%): hence the
   * limits below, which end the pick before the view that would pass half
   * the batch or KVF_STAGE_STRAIGHT_MAX_RUNS, so the runs it yields stay
   * within both. At the default cap 2 MiB gained under a point and its
   * extra runs' host time (0.7 us each) outgrew a small chunk's copy
   * (glm-like: 220 us of enqueue for a 163 us copy; perf/results/
   * 2026-12-01-h200-straight). */
  if (x->max_sms && x->max_sms < KVF_SMALL_STAGE_SMS) target *= KVF_STAGE_STRAIGHT_CAPPED_FACTOR;
  /* A small request staged in one piece (KVF_XFER_SMALL_STAGE_ONE_PIECE)
   * hides all of its kernel behind the straight part, so the part takes a
   * tenth of the batch or more, as far as the pick's limits let it. The
   * 64-SM kernel moves about 20 times the link's rate; twice that share
   * covers its launch, its hand-off and slower kernels. Measured
   * on an H200 (perf/results/2026-12-03-h200-one-piece), fp8-inline's
   * 16.5 MiB chunk in one piece, 1 -> 2 MiB straight: d2h 98.4/99.3 ->
   * 99.3/99.4% of memcpy, h2d 97.6/97.6 -> 99.0/99.0 (two pieces: 98.1);
   * glm-like and gpt-oss-like within 0.3 points at 2 MiB. An eighth took
   * glm-like's 8.3 MiB chunk to 1.5 MiB (whole views), 96 runs whose host
   * time a slow host spent while its scatter's copy engine waited; a tenth
   * keeps it at 1 MiB. */
  if (one_piece && eb->bytes / KVF_SMALL_STAGE_STRAIGHT_SHARE > target)
    target = eb->bytes / KVF_SMALL_STAGE_STRAIGHT_SHARE;
  if (ns == 0 || count == 0) return KVF_SUCCESS;
  kvf_copy_request part = *r;
  batch_tokens(r, eb, g->policy.chunk_tokens, &part);
  unsigned char *pick = malloc(ns);
  void **objects = malloc(sizeof *objects * count), *blob = NULL, **dst = NULL;
  const void **src = NULL;
  size_t *sizes = NULL, runs = 0;
  kvf_status st = KVF_SUCCESS;
  if (!pick || !objects) goto oom;
  if (!kvf_stage_straight_pick_memo(&x->plan_memo, g, plan, &part, !gather, min_run, target, eb->bytes / 2,
                                    KVF_STAGE_STRAIGHT_MAX_RUNS, pick))
    goto out;
  for (uint64_t i = 0; i < count; i++) objects[i] = c->sp.staged[first + i] ? r->objects[first + i] : NULL;
  part.objects = objects;
  kvf_blob_opts o = {0, pick, 0};
  uint64_t size = round256(kvf_blob_size(g, plan, &part, &o));
  if (!(blob = aligned_alloc(256, size))) goto oom;
  kvf_blob_build_memo(&x->blob_memo, g, plan, &part, gather, &o, blob);
  int fit = kvf_stage_batch_runs(blob, gather, min_run, KVF_STAGE_STRAIGHT_MAX_RUNS, &dst, &src, &sizes, &runs);
  if (fit < 0) goto oom;
  if (fit == 0) goto out;
  c->straight_pick = pick;
  pick = NULL;
  c->straight_dst = dst;
  c->straight_src = src;
  c->straight_size = sizes;
  c->straight_runs = runs;
  dst = NULL;
  src = NULL;
  sizes = NULL;
  /* Counted like the batches' blobs count theirs (kernels/plan.h). */
  c->straight_bytes = ((const kvf_blob_header *)blob)->payload_bytes;
  goto out;
oom:
  st = kvf_fail(KVF_ERR_OUT_OF_MEMORY, "transfer: out of memory");
out:
  free(dst);
  free(src);
  free(sizes);
  free(pick);
  free(objects);
  free(blob);
  return st;
}

/* Whether a staged call may have a straight part (plan_staged): none on
 * the legacy and per-thread default streams, which may refuse its one
 * batch copy on the caller's stream; STRAIGHT_UNLESS_ALONE for a gather,
 * which leaves it out where it was measured to lose (a small request of
 * one batch, KVF_XFER_SMALL_STAGE_MB, uncapped: the one-piece rule) when
 * its stream is idle. A gather's copy engine starts on the part, after its
 * batch call's host time (0.7-1 us a run on the H200's KVM host), where it
 * would start after the first piece's kernel without it: behind other work
 * that wait is hidden and the part keeps the copy engine busy while the
 * kernel runs (one chunk back to back, 3-14 points of memcpy's rate with
 * it), but on an idle stream the call waits for it. Measured on an H200
 * (perf/results/2026-12-04-h200-straight-alone), one chunk d2h alone,
 * wall time over a memcpy's, with -> without: Llama NHD 1.11 -> 1.04,
 * fp8-inline 1.20 -> 1.07, glm-like 1.38-1.44 -> 1.16, gpt-oss-like
 * 1.37-1.43 -> 1.18, the MLA chunks within 0.02. Calls of several batches
 * and capped calls (whose part is three times larger for their slower
 * kernels) were not measured alone and keep it. A scatter's part goes
 * after its copy engine's leg, which hides its host time: kept. */
enum { STRAIGHT_NONE, STRAIGHT_KEEP, STRAIGHT_UNLESS_ALONE };

static int staged_straight(const kvf_xfer *x, int gather, cudaStream_t stream) {
  if (default_stream(stream)) return STRAIGHT_NONE;
  if (!gather || x->tune.stage_straight_alone) return STRAIGHT_KEEP;
  return STRAIGHT_UNLESS_ALONE;
}

/* Plan a staged call with `pieces` pieces per batch: the batches, each
 * piece's tables (built in x->host_blob; uploaded through a slot only when
 * one is too large for the kernel parameters) and copies, and the straight
 * part when `straight` allows one. *retry is set when pieces do not fit the
 * request (a gather with holes): plan again with one piece and no straight
 * part. */
static kvf_status plan_staged(kvf_xfer *x, const kvf_copy_request *r, int gather, uint32_t pieces, uint32_t growth,
                              int straight, int stream_idle, cudaStream_t stream, int one_piece, uint32_t stage_sms,
                              uint32_t pcie_sms, staged_call *c, int *retry) {
  const kvf_geometry *g = x->geometry;
  const kvf_plan *plan = &x->plan[r->format];
  uint64_t nog = g->num_object_groups, cc = g->policy.chunk_tokens, ns = plan->num_segments;
  kvf_copy_request part = *r;
  void **sub = NULL;
  uint64_t *base = NULL;
  kvf_status st;
  *retry = 0;
  memset(c, 0, sizeof *c);
  if ((st = kvf_stage_plan_objects(g, r, gather, &c->sp))) return st;
  if ((st = grow_stage(x, c->sp.max_chunk))) return st;
  /* Batches of the configured size even when the buffers grew larger (a
   * larger chunk, an earlier tuning): the size is what was measured. */
  uint64_t cap = (uint64_t)x->tune.staging_mb << 20;
  if (cap < c->sp.max_chunk) cap = c->sp.max_chunk;
  if (cap > x->stage_cap) cap = x->stage_cap;
  kvf_stage_plan_batches(&c->sp, cap, (uint64_t)x->tune.stage_edge_mb << 20, gather);
  uint64_t nb = c->sp.num_batches, n = c->sp.num_objects;
  /* Past the first batch the pipeline overlaps a batch's kernels with the
   * previous batch's copies, so more pieces only add hand-offs between the
   * streams (about a microsecond each on an H200, where the copy engine
   * idles): KVF_XFER_STAGE_MULTI_PIECES bounds them (measured in
   * perf/results/2026-12-01-h200-large, with the batch sizes above). */
  if (nb > 1 && x->tune.stage_multi_pieces > 0 && pieces > (uint32_t)x->tune.stage_multi_pieces)
    pieces = (uint32_t)x->tune.stage_multi_pieces;
  c->any_direct = c->sp.any_direct;
  c->edge = gather || nb == 0 ? 0 : nb - 1;
  /* one_piece: a small request of one batch with a straight part is one
   * piece (measured on one chunk; a call of several batches overlaps its
   * later kernels with copies anyway and keeps its pieces). */
  one_piece = one_piece && nb == 1;
  /* A gather alone in the shape measured (staged_straight): its stream
   * asked already (stream_idle 1: no part to pick), else asked once a part
   * is found, allowing an event recorded just before the call the few us it
   * takes to complete (stream_idle_soon); a plan made again once planned
   * cost more (the bf16 MLA chunk's gather alone 1.09-1.13x a memcpy) than
   * that wait. */
  const int unless_alone = straight == STRAIGHT_UNLESS_ALONE && one_piece;
  if (unless_alone && stream_idle == 1) straight = STRAIGHT_NONE;
  if (straight != STRAIGHT_NONE && x->tune.stage_straight_kb > 0 && nb > 0 &&
      (st = plan_straight(x, r, gather, one_piece, c)))
    goto out;
  if (unless_alone && c->straight_runs && stream_idle < 0 && stream_idle_soon(x, stream)) drop_straight(c);
  if (c->straight_runs && one_piece) pieces = 1;
  c->masks = malloc((size_t)(ns ? ns : 1) * (pieces ? pieces : 1));
  if (!c->masks) {
    st = kvf_fail(KVF_ERR_OUT_OF_MEMORY, "transfer: out of memory");
    goto out;
  }
  c->pieces = pieces > 1 ? kvf_stage_piece_masks_memo(&x->plan_memo, g, plan, r, gather, pieces, growth, c->masks)
                         : 1;
  /* The pieces are cut over every view, then the straight part's views
   * leave the edge batch's (cut over what is left, the pieces lost 1-5
   * points at 4 SMs: perf/results/2026-12-03-h200-edge-pieces). */
  if (c->straight_runs) {
    if (!(c->edge_masks = malloc((size_t)c->pieces * ns))) {
      st = kvf_fail(KVF_ERR_OUT_OF_MEMORY, "transfer: out of memory");
      goto out;
    }
    for (uint32_t p = 0; p < c->pieces; p++)
      for (uint64_t sgi = 0; sgi < ns; sgi++)
        c->edge_masks[(size_t)p * ns + sgi] =
            (c->pieces == 1 || c->masks[(size_t)p * ns + sgi]) && !c->straight_pick[sgi];
  }
  c->num_launches = nb * c->pieces + (c->any_direct ? 1 : 0);
  c->launches = calloc(c->num_launches ? c->num_launches : 1, sizeof *c->launches);
  c->batches = calloc(nb ? nb : 1, sizeof *c->batches);
  c->run_first = calloc(nb * c->pieces + 1, sizeof *c->run_first);
  sub = malloc(sizeof *sub * (n ? n : 1));
  base = malloc(sizeof *base * (n ? n : 1));
  if (!c->launches || !c->batches || !c->run_first || !sub || !base) {
    st = kvf_fail(KVF_ERR_OUT_OF_MEMORY, "transfer: out of memory");
    goto out;
  }
  /* Sizes first: every blob of the call in one table buffer, each with room
   * for its parameter copy when they all go in kernel parameters. */
  uint64_t off = 0;
  int all_params = 1;
  for (uint64_t bi = 0, l = 0; bi < nb; bi++) {
    batch_tokens(r, &c->sp.batches[bi], cc, &part);
    part.objects = r->objects + c->sp.batches[bi].k0 * nog; /* sizes depend only on counts */
    c->batches[bi].buf = (x->next_stage + (uint32_t)bi) & 1;
    c->batches[bi].first = (uint32_t)l;
    for (uint32_t p = 0; p < c->pieces; p++, l++) {
      kvf_blob_opts o = blob_opts(x, stage_sms, x->tune.task_waves, piece_mask(c, bi, p, ns));
      c->launches[l].blob_size = kvf_blob_size(g, plan, &part, &o);
      all_params &= fits_params(x, c->launches[l].blob_size);
    }
  }
  if (c->any_direct) {
    c->direct = nb * c->pieces;
    c->launches[c->direct].blob_size = kvf_blob_size(g, plan, r, NULL);
    all_params &= fits_params(x, c->launches[c->direct].blob_size);
  }
  for (uint64_t l = 0; l < c->num_launches; l++) {
    c->launches[l].blob_off = off;
    off += round256(all_params ? kvf_kernel_param_room(c->launches[l].blob_size) : c->launches[l].blob_size);
  }
  if ((st = grow_host_blob(x, off))) goto out;
  c->uploaded = !all_params;
  /* Build. */
  for (uint64_t bi = 0; bi < nb; bi++) {
    const kvf_stage_batch *pb = &c->sp.batches[bi];
    batch_tokens(r, pb, cc, &part);
    for (uint64_t i = 0; i < n; i++) sub[i] = NULL;
    for (uint64_t i = pb->k0 * nog; i < pb->k1 * nog; i++) {
      sub[i] = c->sp.staged[i] ? (char *)x->stage[c->batches[bi].buf] + c->sp.offset[i] : NULL;
      base[i] = (uint64_t)(uintptr_t)sub[i];
    }
    part.objects = sub + pb->k0 * nog;
    for (uint32_t p = 0; p < c->pieces; p++) {
      launch *l = &c->launches[c->batches[bi].first + p];
      kvf_blob_opts o = blob_opts(x, stage_sms, x->tune.task_waves, piece_mask(c, bi, p, ns));
      void *blob = (char *)x->host_blob + l->blob_off;
      l->tasks = kvf_blob_build_memo(&x->blob_memo, g, plan, &part, gather, &o, blob);
      l->slice = ((const kvf_blob_header *)blob)->slice_bytes;
      l->blob_size = ((const kvf_blob_header *)blob)->size; /* its shapes: at most the room kept for them */
      if (uses_runs(c)) {
        int bad = 0;
        /* The piece's objects are indexed like the batch's request. */
        if ((st = add_piece_runs(x, c, blob, base + pb->k0 * nog, gather, nb == 1, &bad))) goto out;
        if (bad) {
          *retry = 1;
          goto out;
        }
        /* Run object indices are the batch's: make them the call's. */
        for (uint64_t i = c->run_first[bi * c->pieces + p]; i < c->num_runs; i++) c->runs[i].object += pb->k0 * nog;
        c->run_first[bi * c->pieces + p + 1] = c->num_runs;
      }
    }
  }
  if (c->any_direct) {
    for (uint64_t i = 0; i < n; i++) sub[i] = c->sp.staged[i] ? NULL : r->objects[i];
    part = *r;
    part.objects = sub;
    launch *l = &c->launches[c->direct];
    void *blob = (char *)x->host_blob + l->blob_off;
    kvf_blob_opts o = blob_opts(x, pcie_sms, x->tune.task_waves, NULL);
    l->tasks = kvf_blob_build_memo(&x->blob_memo, g, plan, &part, gather, &o, blob);
    l->slice = ((const kvf_blob_header *)blob)->slice_bytes;
    l->blob_size = ((const kvf_blob_header *)blob)->size;
  }
  /* Tables too large for parameters: one upload of them all, through a
   * slot of the ring (waited for, before anything is enqueued). */
  if (c->uploaded) {
    if ((st = take_slot(x, off, &c->slot))) goto out;
    memcpy(c->slot->pinned, x->host_blob, off);
  }
out:
  free(sub);
  free(base);
  return st;
}

/* Host<->device through the staging buffers: batches of whole chunks,
 * alternating between the two buffers so the kernel fills one while the
 * copy engine drains the other (or the reverse for a scatter), each batch
 * in pieces (KVF_XFER_STAGE_PIECES) so the copy engine starts after the
 * first piece's kernel rather than after the whole batch's (a scatter's
 * last kernel waits only for the last piece's fill). Measured on an H200
 * (perf/results/2026-11-29-h200/NOTES.md): with one launch per batch, the
 * first batch's gather did not overlap the copy engine: one 256-token
 * chunk reached 75-85% of memcpy at 16 SMs and 47-65% at 4. Objects a
 * gather would write only in part go straight to host memory with the
 * direct kernel, after the batches. The plan is host/core/xfer_stage.c's.
 *
 * Everything the call needs is checked and reserved before its first
 * enqueue: the plan, the host arrays, both staging buffers, the tables
 * (in kernel parameters, or a slot waited for and filled) ; pointers were
 * classified by route_of. A failure up to there leaves nothing enqueued.
 * After it, only an enqueue the CUDA runtime refuses can fail: batches
 * before the refused one stay enqueued whole, nothing after it is enqueued,
 * and finish_staged joins the internal stream back (include/kvferry/
 * transfer.h states this). */
static kvf_status launch_staged(kvf_xfer *x, const kvf_copy_request *r, int gather, cudaStream_t stream,
                                uint32_t stage_sms, uint32_t pcie_sms, uint32_t pieces, uint32_t growth,
                                int straight, int stream_idle, int one_piece) {
  const char *dir = gather ? "gather" : "scatter";
  uint64_t nb = 0, bi = 0, payload = 0, tasks = 0;
  uint32_t used_sms = 0;
  int forked = 0, retry = 0, straight_refused = 0;
  cudaError_t e = cudaSuccess;
  staged_call c;
  if (pieces < 1) pieces = 1;
  kvf_status st = plan_staged(x, r, gather, pieces, growth, straight, stream_idle, stream, one_piece, stage_sms,
                              pcie_sms, &c, &retry);
  if (!st && retry) {
    staged_call_free(&c);
    st = plan_staged(x, r, gather, 1, growth, STRAIGHT_NONE, stream_idle, stream, 0, stage_sms, pcie_sms, &c, &retry);
  }
  if (st) goto out;
  nb = c.sp.num_batches;
  /* A blob's payload counts its blocks as if all its objects were present
   * (kernels/plan.h), so the batches' blobs already count the bytes of the
   * objects the direct launch moves: the call's payload is theirs alone
   * (adding the direct blob's counted those objects twice). */
  for (uint64_t l = 0; l < c.num_launches; l++) {
    tasks += c.launches[l].tasks;
    if (!c.any_direct || l != c.direct)
      payload += ((const kvf_blob_header *)((char *)x->host_blob + c.launches[l].blob_off))->payload_bytes;
  }
  payload += c.straight_bytes;
  x->path = (kvf_xfer_path_info){
      .path = KVF_PATH_STAGED, .batches = (uint32_t)nb, .pieces = c.pieces, .runs_cached = c.runs_cached};
  /* With a straight part the copy engine's legs go on the caller's stream
   * (a gather's copy engine starts there at once, with no hand-off from
   * another stream) and the kernels on the internal one. */
  cudaStream_t ks = c.straight_runs ? x->ce_stream : stream, ds = c.straight_runs ? stream : x->ce_stream;

  /* Enqueue. The copy-engine stream forks from the caller's stream (it sees
   * everything enqueued before this call) and joins it at the end. bi ends
   * as the batch whose enqueue was refused, or nb. */
  x->planned_ns = kvf_now_ns();
  if (c.uploaded) {
    const launch *last = &c.launches[c.num_launches - 1];
    e = cudaMemcpyAsync(c.slot->device, c.slot->pinned, last->blob_off + last->blob_size, cudaMemcpyHostToDevice,
                        stream);
    x->path.uploads = 1;
  }
  if (e == cudaSuccess) e = cudaEventRecord(x->fork, stream);
  if (e == cudaSuccess) e = cudaStreamWaitEvent(x->ce_stream, x->fork, 0);
  forked = e == cudaSuccess;
  for (bi = 0; e == cudaSuccess && bi < nb;) {
    e = enqueue_batch(x, r, &c, bi, gather, stage_sms, &used_sms, ks, ds, &straight_refused);
    if (e == cudaSuccess) bi++;
  }
  if (e == cudaSuccess && c.straight_runs && !gather && (e = straight_dma(x, &c, ds)) != cudaSuccess)
    straight_refused = 1;
  /* The direct kernel on the kernels' stream, beside the copy engine's last
   * legs rather than after them. */
  if (e == cudaSuccess && c.any_direct) e = staged_launch(x, &c, &c.launches[c.direct], pcie_sms, -1, &used_sms, ks);
  if (e != cudaSuccess) {
    cudaGetLastError();
    cudaError_t ej = finish_staged(x, stream, c.slot, forked, 1);
    char done[96], joined[160] = "";
    if (bi == 0)
      snprintf(done, sizeof done, "no batch was enqueued");
    else
      snprintf(done, sizeof done, "batches 0..%llu were enqueued whole and will complete",
               (unsigned long long)bi - 1);
    if (ej != cudaSuccess)
      snprintf(joined, sizeof joined, "; joining the internal stream back failed too (%s): it was waited for",
               cudaGetErrorString(ej));
    if (straight_refused)
      st = kvf_fail(KVF_ERR_CUDA,
                    "staged %s: enqueueing the copy engine's straight part (%zu runs of the %s batch): %s; it may "
                    "have been enqueued in part (those %s are unspecified until the stream's work completes), "
                    "after %s%s",
                    dir, c.straight_runs, gather ? "first" : "last", cudaGetErrorString(e),
                    gather ? "objects" : "blocks", gather ? "the first batch's first kernel" : "every batch", joined);
    else if (!forked)
      st = kvf_fail(KVF_ERR_CUDA,
                    "staged %s: enqueueing the call's tables: %s; nothing that writes an object or a block was "
                    "enqueued%s",
                    dir, cudaGetErrorString(e), joined);
    else if (bi < nb)
      st = kvf_fail(KVF_ERR_CUDA,
                    "staged %s: enqueueing batch %llu of %llu (chunks %llu..%llu): %s; %s, batch %llu at most in "
                    "part, nothing after it%s",
                    dir, (unsigned long long)bi, (unsigned long long)nb, (unsigned long long)c.sp.batches[bi].k0,
                    (unsigned long long)c.sp.batches[bi].k1 - 1, cudaGetErrorString(e), done, (unsigned long long)bi,
                    joined);
    else
      st = kvf_fail(KVF_ERR_CUDA,
                    "staged %s: enqueueing the direct kernel (objects written in part) after the last batch: %s; %s, "
                    "the direct kernel's objects were not written%s",
                    dir, cudaGetErrorString(e), done, joined);
    goto out;
  }
  /* A gather with a straight part and no direct kernel needs no join: the
   * caller's stream waited for the last kernel's event, the internal
   * stream's last work. */
  e = finish_staged(x, stream, c.slot, forked && !(c.straight_runs && gather && !c.any_direct), 0);
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
  staged_call_free(&c);
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

/* Record a launched kernel's shape in the call's path info. */
static void note_launch_shape(kvf_xfer *x, int kernel) {
  x->path.spread_launches = kvf_kernel_is_spread(kernel);
  x->path.deep_launches = kernel == KVF_KERNEL_WALK_SPREAD;
}

/* One kernel launch moves the whole request. Tables that fit the kernel's
 * parameters (KVF_XFER_PARAM_TABLE_BYTES) ride with the launch: no upload
 * before it, no slot, and a captured launch keeps its own copy. Larger ones
 * are uploaded through a slot of the ring (a captured call's through
 * buffers of its own, kept until destroy). The blob is built on the host
 * first: its size depends on how many shapes its entries share and whether
 * it needs its task table, about a third of kvf_blob_size's bound for one
 * chunk. */
static kvf_status launch_one(kvf_xfer *x, const kvf_copy_request *r, int gather, cudaStream_t stream,
                             kvf_xfer_route route, uint32_t ctas, enum cudaStreamCaptureStatus capture) {
  const kvf_geometry *g = x->geometry;
  const kvf_plan *plan = &x->plan[r->format];
  size_t bound = (size_t)kvf_blob_size(g, plan, r, NULL);
  kvf_status st;
  cudaError_t e;
  x->path = (kvf_xfer_path_info){.path = KVF_PATH_KERNEL};
  if ((st = grow_host_blob(x, bound + KVF_KERNEL_PARAM_MAX))) return st;
  kvf_blob_opts o = blob_opts(x, ctas, waves_of(x, route, ctas), NULL);
  uint64_t tasks = kvf_blob_build_memo(&x->blob_memo, g, plan, r, gather, &o, x->host_blob);
  kvf_blob_header *h = x->host_blob;
  int kernel = kernel_of(x, route, ctas, h->payload_bytes);
  h->cache_order = launch_cache_order(x, route, gather, kernel);
  x->planned_ns = kvf_now_ns();
  const size_t size = (size_t)h->size;
  if (fits_params(x, size)) {
    int overlap = launch_overlap(x, route, ctas, kernel);
    h->overlap = (uint32_t)overlap;
    if (tasks) {
      e = kvf_kernel_launch_params(x->host_blob, h->size, tasks, &ctas, kernel, overlap, stream);
      if (e != cudaSuccess) {
        cudaGetLastError();
        return kvf_fail(KVF_ERR_CUDA, "enqueueing the %s transfer: %s; nothing was enqueued",
                        gather ? "gather" : "scatter", cudaGetErrorString(e));
      }
      x->path.launches = x->path.param_launches = 1;
      note_launch_shape(x, kernel);
      x->path.overlap_launches = (uint32_t)overlap;
    } else {
      ctas = 0;
    }
    x->path.slice_bytes = h->slice_bytes;
    x->path.cache_order = h->cache_order;
    x->last.route = route;
    x->last.sms = ctas;
    x->last.tasks = (uint32_t)tasks;
    x->last.payload_bytes = h->payload_bytes;
    return KVF_SUCCESS;
  }
  staging captured = {0}, *s = NULL; /* set on both paths below; gcc -O2 cannot tell */
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
    if ((st = take_slot(x, size, &s))) return st;
  }
  memcpy(s->pinned, x->host_blob, size); /* never overlapped: its header says overlap 0 */
  h = s->pinned;
  x->path.cache_order = h->cache_order;
  if (tasks) {
    e = cudaMemcpyAsync(s->device, s->pinned, h->size, cudaMemcpyHostToDevice, stream);
    int uploaded = e == cudaSuccess, launched = 0;
    if (e == cudaSuccess) launched = (e = kvf_kernel_launch(s->device, tasks, &ctas, kernel, stream)) == cudaSuccess;
    if (launched) note_launch_shape(x, kernel);
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
    x->path.launches = 1;
    x->path.uploads = 1;
  } else {
    ctas = 0;
  }
  if (keep) keep_captured(x, keep, &captured);
  x->path.slice_bytes = h->slice_bytes;
  x->last.route = route;
  x->last.sms = ctas;
  x->last.tasks = (uint32_t)tasks;
  x->last.payload_bytes = h->payload_bytes;
  return KVF_SUCCESS;
}

/* Whether the objects the request names hold at most `limit` payload bytes
 * (every object group of every chunk it spans; a cheap bound, stopping as
 * soon as it passes the limit). */
static int request_payload_at_most(const kvf_xfer *x, const kvf_copy_request *r, uint64_t limit) {
  const kvf_geometry *g = x->geometry;
  uint64_t c = g->policy.chunk_tokens, total = 0;
  if (c == 0 || r->token_end <= r->token_begin) return 0;
  for (uint64_t k = r->token_begin / c; k * c < r->token_end; k++)
    for (uint32_t og = 0; og < g->num_object_groups; og++) {
      uint64_t size = 0;
      if (kvf_geometry_object_size(g, og, k, r->token_end, &size) != KVF_SUCCESS) return 0;
      total += size;
      if (total > limit) return 0;
    }
  return 1;
}

static kvf_status launch_cuda_routes(kvf_xfer *x, const kvf_copy_request *r, int gather, cudaStream_t stream) {
  kvf_xfer_route route = KVF_ROUTE_D2D;
  int stageable = 0;
  kvf_status st = route_of(x, r, gather, &route, &stageable);
  if (st) return st;
  enum cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  cudaError_t e = cudaStreamIsCapturing(stream, &capture);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return kvf_fail(KVF_ERR_CUDA, "stream: %s", cudaGetErrorString(e));
  }
  x->call_captured = capture != cudaStreamCaptureStatusNone;
  uint32_t pcie_sms = (uint32_t)x->sm_count;
  if (x->tune.pcie_sms > 0 && (uint64_t)x->tune.pcie_sms < pcie_sms) pcie_sms = (uint32_t)x->tune.pcie_sms;
  if (x->max_sms && x->max_sms < pcie_sms) pcie_sms = x->max_sms;
  /* Host<->device: the copy engine's batch API when the request is a few
   * long runs (it cannot be captured and refuses the legacy stream), else
   * the staged route unless staging is off or the call is being captured
   * (a graph gets the direct kernel). */
  if (stageable && capture == cudaStreamCaptureStatusNone) {
    int host_bound = 0, stream_idle = -1;
    if (x->tune.batch_max_runs > 0 && !default_stream(stream)) {
      st = launch_copy_batch(x, r, gather, stream, &host_bound, &stream_idle);
      if (st != KVF_ERR_UNSUPPORTED) return st;
    }
    if (x->tune.staging_mb > 0) {
      uint32_t stage_sms = (uint32_t)x->sm_count;
      if (x->tune.stage_sms > 0 && (uint64_t)x->tune.stage_sms < stage_sms) stage_sms = (uint32_t)x->tune.stage_sms;
      uint32_t pieces = x->tune.stage_pieces > 1 ? (uint32_t)x->tune.stage_pieces : 1;
      uint32_t growth = (uint32_t)x->tune.stage_growth;
      /* A small request (one chunk: 8-32 MiB) spends a
       * large share of its time in the pipeline's fixed cost, each piece's
       * hand-off from the kernel to the copy engine and the first piece's
       * kernel: two pieces, with kernels on 64 SMs so the first is short.
       * Measured on an H200 (perf/results/2026-12-01-h200-tune): one chunk
       * d2h/h2d of memcpy, 4 pieces at 16 SMs -> 2 pieces at 64: glm-like
       * 86.4/82.6% -> 90.5/88.3%, gpt-oss-like 90.1/87.2 -> 90.5/90.1,
       * fp8-inline (16.5 MiB) 93.6/93.0 -> 94.6/94.3; the GEMM running
       * alongside was slowed no more than by the default (the kernels only
       * touch device memory). The 32 MiB Llama chunk lost 1.6 points with
       * 2 pieces at 16 SMs, so the rule stopped below it (24 MiB); at 64
       * SMs, and in one piece behind its straight part (below), it gains:
       * two rounds on an H200 (perf/results/2026-12-03-h200-one-piece),
       * 24 -> 40 MiB, Llama NHD d2h 98.5/98.5 -> 99.4/99.6% of memcpy, h2d
       * 98.1/97.9 -> 99.6/99.6, HND (2 pieces) d2h 95.8/95.7 -> 96.3/96.3,
       * h2d 96.1/95.9 -> 96.6/96.4. Hence 40 MiB (one chunk of every
       * preset). */
      /* Its pieces are 1:4 (KVF_XFER_SMALL_STAGE_GROWTH), a gather's first
       * the shorter, so the copy engine starts sooner: measured on an H200
       * in two runs (perf/results/2026-12-02-h200-ramp/ramp.md, ramp/run1),
       * 1:2 -> 1:4, the tp4 slice d2h 94.1-94.8 -> 95.7-95.8% of memcpy,
       * h2d 94.0-94.3 -> 94.8-95.4%; glm-like, gpt-oss-like and fp8-inline
       * within -0.2 to +1.6 points. */
      /* Under a cap below 64 SMs (the 4-SM case) the kernels stay slow and
       * 4 pieces overlap them better: gpt-oss-like d2h at 4 SMs fell from
       * 88.8% to 81.7% with 2 pieces, so the rule needs its 64 SMs. */
      /* With a straight part, such a request's kernels at 64 SMs (7 us for
       * glm-like's 7.6 MB) fit behind the straight copy (19-22 us for 1 MiB)
       * with their hand-off, so one piece (KVF_XFER_SMALL_STAGE_ONE_PIECE)
       * spares the copy engine a call (about 2 us each, and a small piece's
       * copy ran at 12 GB/s). */
      int one_piece = 0;
      if (x->tune.small_stage_mb > 0 && (!x->max_sms || x->max_sms >= KVF_SMALL_STAGE_SMS) &&
          (uint64_t)x->sm_count >= KVF_SMALL_STAGE_SMS &&
          request_payload_at_most(x, r, (uint64_t)x->tune.small_stage_mb << 20)) {
        if (stage_sms < KVF_SMALL_STAGE_SMS) stage_sms = KVF_SMALL_STAGE_SMS;
        if (pieces > KVF_SMALL_STAGE_PIECES) pieces = KVF_SMALL_STAGE_PIECES;
        growth = (uint32_t)x->tune.small_stage_growth;
        one_piece = x->tune.small_stage_one_piece == 1;
      }
      if (x->max_sms && x->max_sms < stage_sms) stage_sms = x->max_sms;
      st = launch_staged(x, r, gather, stream, stage_sms, pcie_sms, pieces, growth, staged_straight(x, gather, stream),
                         stream_idle, one_piece);
      if (st == KVF_SUCCESS) x->path.host_bound = (uint32_t)host_bound;
      return st;
    }
  }
  uint32_t ctas = (uint32_t)x->sm_count;
  if (route == KVF_ROUTE_D2H || route == KVF_ROUTE_H2D || route == KVF_ROUTE_HOST_TO_HOST) ctas = pcie_sms;
  if (x->max_sms && x->max_sms < ctas) ctas = x->max_sms;
  return launch_one(x, r, gather, stream, route, ctas, capture);
}

/* After a call that recorded a start mark (host_bound_goes_staged), its end
 * mark after its last enqueue: the next call asks both. A failed call, or
 * a refused record, leaves no marks to ask. */
static void end_call_mark(kvf_xfer *x, kvf_status st, cudaStream_t stream) {
  if (x->call_mark_started != x->cuda_calls) return;
  x->call_mark_started = 0;
  if (st != KVF_SUCCESS) return;
  if (cudaEventRecord(x->call_end_mark, stream) != cudaSuccess) {
    cudaGetLastError(); /* the call's work is enqueued; the next call just has no marks */
    return;
  }
  x->call_mark_call = x->cuda_calls;
  x->call_mark_end_ns = kvf_now_ns();
}

/* After a staged host-bound call that recorded its span's start
 * (host_bound_goes_staged), the span's end after its last enqueue, for a
 * later call to read. A failed call leaves no span. */
static void end_staged_span(kvf_xfer *x, kvf_status st, cudaStream_t stream) {
  if (x->span_armed != x->cuda_calls) return;
  x->span_armed = 0;
  if (st != KVF_SUCCESS || x->path.path != KVF_PATH_STAGED) return;
  if (cudaEventRecord(x->span_end, stream) != cudaSuccess) {
    cudaGetLastError(); /* the call's work is enqueued; no measure this time */
    return;
  }
  x->span_pending = 1;
}

static kvf_status launch_cuda(kvf_xfer *x, const kvf_copy_request *r, int gather, cudaStream_t stream) {
  x->cuda_calls++; /* the marks of the call before this one are asked by this one only */
  x->rule_back_to_back = 0;
  x->idle_wait_ns = 0;
  x->call_listed = 0;
  x->call_captured = 1; /* until launch_cuda_routes knows */
  x->call_stream_id_asked = 0;
  const uint64_t blob_hits = x->blob_memo.hits;
  kvf_status st = launch_cuda_routes(x, r, gather, stream);
  end_call_mark(x, st, stream);
  end_staged_span(x, st, stream);
  if (st == KVF_SUCCESS) {
    x->path.blobs_cached = (uint32_t)(x->blob_memo.hits - blob_hits);
    x->path.back_to_back = x->rule_back_to_back;
    x->path.batch_listed = (uint32_t)x->call_listed;
    x->path.idle_wait_us = (double)x->idle_wait_ns / 1e3;
    /* Without an id (call_stream_id) the next call waits as after another
     * stream's. */
    unsigned long long id = 0;
    x->call_end_has_id = call_stream_id(x, stream, &id);
    x->call_end_stream_id = id;
    x->call_end_ns = kvf_now_ns();
  }
  return st;
}

/* ---- deferred calls (kvf_xfer_gather_deferred) ------------------------------- */

/* The words deferred calls count in: 64-byte lines of mapped, portable
 * pinned memory that live as long as the process. A joined stream may
 * still be queued before its wait on a word when the context is destroyed;
 * the word must stay readable and never go back below a number it reached,
 * so a word is handed to a later context with its value, and that context
 * counts on from it. */
typedef struct done_word {
  uint64_t *host;
  struct done_word *next;
} done_word;

static pthread_mutex_t done_words_mu = PTHREAD_MUTEX_INITIALIZER;
static done_word *done_words_free;

static kvf_status take_done_word(done_word **out) {
  enum { kLine = 64, kPage = 4096 };
  pthread_mutex_lock(&done_words_mu);
  if (!done_words_free) {
    void *page = NULL;
    done_word *nodes = calloc(kPage / kLine, sizeof *nodes);
    cudaError_t e = nodes ? cudaHostAlloc(&page, kPage, cudaHostAllocMapped | cudaHostAllocPortable) : cudaSuccess;
    if (!nodes || e != cudaSuccess) {
      pthread_mutex_unlock(&done_words_mu);
      free(nodes);
      cudaGetLastError();
      return nodes ? kvf_fail(KVF_ERR_CUDA, "deferred calls: pinned memory for their counter: %s",
                              cudaGetErrorString(e))
                   : kvf_fail(KVF_ERR_OUT_OF_MEMORY, "deferred calls: out of memory");
    }
    memset(page, 0, kPage);
    for (int i = 0; i < kPage / kLine; i++) {
      nodes[i].host = (uint64_t *)((char *)page + i * kLine);
      nodes[i].next = done_words_free;
      done_words_free = &nodes[i];
    }
  }
  done_word *w = done_words_free;
  done_words_free = w->next;
  pthread_mutex_unlock(&done_words_mu);
  *out = w;
  return KVF_SUCCESS;
}

static void give_done_word(done_word *w) {
  pthread_mutex_lock(&done_words_mu);
  w->next = done_words_free;
  done_words_free = w;
  pthread_mutex_unlock(&done_words_mu);
}

/* Copy r and the arrays it points to into one allocation. The request was
 * checked: its group counts sum to at most 2^32 - 1, and its chunks times
 * the object groups are what the checks walked. */
static deferred *copy_deferred(const kvf_geometry *g, const kvf_copy_request *r, int gather) {
  uint64_t ngroups = g->num_groups, nregions = g->num_regions, ids = 0;
  uint64_t nobjects = kvf_copy_request_chunks(g, r) * g->num_object_groups;
  for (uint64_t i = 0; i < ngroups; i++)
    if (r->groups[i].block_ids) ids += r->groups[i].count;
  size_t size = sizeof(deferred) + ngroups * sizeof(kvf_group_blocks) + (nobjects + nregions) * sizeof(void *) +
                ids * sizeof(uint32_t);
  deferred *d = malloc(size);
  if (!d) return NULL;
  memset(d, 0, sizeof *d);
  d->r = *r;
  d->gather = gather;
  kvf_group_blocks *groups = (kvf_group_blocks *)(d + 1);
  void **objects = (void **)(groups + ngroups), **regions = objects + nobjects;
  uint32_t *id = (uint32_t *)(regions + nregions);
  for (uint64_t i = 0; i < ngroups; i++) {
    groups[i] = r->groups[i];
    if (!r->groups[i].block_ids) continue;
    memcpy(id, r->groups[i].block_ids, (size_t)r->groups[i].count * sizeof *id);
    groups[i].block_ids = id;
    id += r->groups[i].count;
  }
  d->r.groups = groups;
  if (r->objects) {
    memcpy(objects, r->objects, nobjects * sizeof *objects);
    d->r.objects = objects;
  }
  if (r->region_bases) {
    memcpy(regions, r->region_bases, nregions * sizeof *regions);
    d->r.region_bases = regions;
  }
  return d;
}

/* Keep a deferred call's failure for the join, query or flush that
 * reports it (under defer_mu). Past KVF_DEFER_FAILURES only count it, and
 * keep none until the count is reported with the last kept one: every
 * failure counted is then later than every one kept. */
static void keep_failure(kvf_xfer *x, uint64_t seq, kvf_status st, const char *message) {
  if (x->defer_failure_count == KVF_DEFER_FAILURES || x->defer_failures_dropped) {
    x->defer_failures_dropped++;
    return;
  }
  defer_failure *f = &x->defer_failures[x->defer_failure_count++];
  f->seq = seq;
  f->status = st;
  snprintf(f->message, sizeof f->message, "%s", message);
}

/* Report and forget the first kept failure of a call numbered up to `seq`
 * (under defer_mu; kvf_fail takes no lock). The last kept one's report
 * counts those only logged. */
static kvf_status report_failure(kvf_xfer *x, uint64_t seq) {
  if (x->defer_failure_count == 0 || x->defer_failures[0].seq > seq) return KVF_SUCCESS;
  defer_failure f = x->defer_failures[0];
  x->defer_failure_count--;
  memmove(&x->defer_failures[0], &x->defer_failures[1], x->defer_failure_count * sizeof f);
  if (x->defer_failure_count == 0 && x->defer_failures_dropped) {
    unsigned long long dropped = (unsigned long long)x->defer_failures_dropped;
    x->defer_failures_dropped = 0;
    return kvf_fail(f.status, "%s (and %llu later deferred call%s failed, only logged)", f.message, dropped,
                    dropped == 1 ? "" : "s");
  }
  return kvf_fail(f.status, "%s", f.message);
}

/* Plan and enqueue one deferred call on defer_stream, after the caller's
 * stream reached the call, then mark it done there. Joins and queries wait
 * for that mark, so it is written even when planning or an enqueue failed
 * (after whatever was enqueued, as a synchronous call leaves it). */
static void run_deferred(kvf_xfer *x, deferred *d) {
  const char *dir = d->gather ? "gather" : "scatter";
  pthread_mutex_lock(&x->lock);
  uint64_t t0 = kvf_now_ns();
  x->planned_ns = 0;
  x->call_start_ns = t0;
  kvf_status st;
  cudaError_t e = cudaStreamWaitEvent(x->defer_stream, d->start, 0);
  if (e != cudaSuccess) {
    cudaGetLastError();
    st = kvf_fail(KVF_ERR_CUDA, "waiting for the caller's stream: %s; nothing was enqueued", cudaGetErrorString(e));
  } else {
    st = launch_cuda(x, &d->r, d->gather, x->defer_stream);
  }
  char why[384] = "";
  if (st) snprintf(why, sizeof why, "%s", kvf_last_error());
  CUresult cr = KVF_CU(cuStreamWriteValue64)((CUstream)x->defer_stream, x->defer_done_dev, d->seq,
                                             CU_STREAM_WRITE_VALUE_DEFAULT);
  if (cr != CUDA_SUCCESS) {
    /* Mark it from here, once this stream's work (all of the call's) is
     * done. */
    cudaStreamSynchronize(x->defer_stream);
    cudaGetLastError();
    __atomic_store_n(x->defer_done, d->seq, __ATOMIC_RELEASE);
    if (!st) {
      char what[160];
      st = KVF_ERR_CUDA;
      snprintf(why, sizeof why,
               "marking the call done on the GPU: %s; its work was waited for and marked from the host",
               kvf_cu_describe(cr, what, sizeof what));
    }
  }
  if (st == KVF_SUCCESS) {
    note_host_time(x, t0);
    x->path.deferred = 1;
  }
  pthread_mutex_unlock(&x->lock);
  if (st) {
    char message[sizeof x->defer_failures[0].message];
    snprintf(message, sizeof message, "deferred %s (call %llu): %s", dir,
             (unsigned long long)(d->seq - x->defer_base), why);
    KVF_WARN(XFER, "%s", message);
    pthread_mutex_lock(&x->defer_mu);
    keep_failure(x, d->seq, st, message);
    pthread_mutex_unlock(&x->defer_mu);
  }
}

static void *defer_main(void *arg) {
  kvf_xfer *x = arg;
  cudaSetDevice(x->device);
  /* Another thread capturing in global mode must not make this thread's
   * calls (on its own streams) illegal. */
  enum cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  cudaThreadExchangeStreamCaptureMode(&mode);
  pthread_mutex_lock(&x->defer_mu);
  for (;;) {
    while (!x->defer_head && !x->defer_stop) pthread_cond_wait(&x->defer_wake, &x->defer_mu);
    deferred *d = x->defer_head;
    if (!d) break; /* stopping, and nothing left */
    x->defer_head = d->next;
    if (!x->defer_head) x->defer_tail = NULL;
    pthread_mutex_unlock(&x->defer_mu);
    run_deferred(x, d);
    pthread_mutex_lock(&x->defer_mu);
    /* Its wait on the event is enqueued: the event may be recorded again. */
    x->defer_events[x->defer_free++] = d->start;
    x->defer_finished = d->seq;
    free(d);
    pthread_cond_broadcast(&x->defer_room);
  }
  pthread_mutex_unlock(&x->defer_mu);
  return NULL;
}

/* Release what deferred calls use once nothing can use it any more (the
 * thread stopped or never started; the context's device current). */
static void defer_release_resources(kvf_xfer *x) {
  if (x->defer_stream) {
    /* Every number written: a joined stream's word is final. */
    cudaStreamSynchronize(x->defer_stream);
    cudaStreamDestroy(x->defer_stream);
    x->defer_stream = NULL;
  }
  for (uint32_t i = 0; i < KVF_DEFER_DEPTH; i++)
    if (x->defer_events[i]) {
      cudaEventDestroy(x->defer_events[i]);
      x->defer_events[i] = NULL;
    }
  x->defer_free = 0;
  if (x->defer_word) give_done_word(x->defer_word);
  x->defer_word = NULL;
  x->defer_done = NULL;
  x->defer_done_dev = 0;
}

/* Start the context's thread and what it needs (under defer_mu, the
 * context's device current). On failure everything is released again, and
 * the next deferred call tries anew. */
static kvf_status defer_start(kvf_xfer *x) {
  CUdevice dev = 0;
  int mem_ops = 0;
  kvf_status st = kvf_cuda_load();
  if (!st) {
    CUresult cr = KVF_CU(cuDeviceGet)(&dev, x->device);
    if (cr == CUDA_SUCCESS)
      cr = KVF_CU(cuDeviceGetAttribute)(&mem_ops, CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS, dev);
    if (cr != CUDA_SUCCESS) {
      char what[160];
      st = kvf_fail(KVF_ERR_CUDA, "device %d: %s", x->device, kvf_cu_describe(cr, what, sizeof what));
    } else if (!mem_ops) {
      st = kvf_fail(KVF_ERR_UNSUPPORTED, "device %d cannot write or wait on 64-bit values from a stream",
                    x->device);
    }
  }
  if (!st) st = take_done_word(&x->defer_word);
  if (st) return st;
  x->defer_done = x->defer_word->host;
  void *dev_ptr = NULL;
  cudaError_t e = cudaHostGetDevicePointer(&dev_ptr, x->defer_done, 0);
  if (e == cudaSuccess) e = cudaStreamCreateWithFlags(&x->defer_stream, cudaStreamNonBlocking);
  for (uint32_t i = 0; e == cudaSuccess && i < KVF_DEFER_DEPTH; i++) {
    e = cudaEventCreateWithFlags(&x->defer_events[i], cudaEventDisableTiming);
    if (e == cudaSuccess) x->defer_free = i + 1;
  }
  if (e != cudaSuccess) {
    cudaGetLastError();
    st = kvf_fail(KVF_ERR_CUDA, "device %d: %s", x->device, cudaGetErrorString(e));
    defer_release_resources(x);
    return st;
  }
  x->defer_done_dev = (CUdeviceptr)(uintptr_t)dev_ptr;
  /* Count on from the word's value (a word comes back with its last one). */
  x->defer_seq = x->defer_finished = x->defer_base = __atomic_load_n(x->defer_done, __ATOMIC_ACQUIRE);
  int rc = pthread_create(&x->defer_thread, NULL, defer_main, x);
  if (rc != 0) {
    st = kvf_fail(KVF_ERR_SYSTEM, "starting the context's thread: %s", strerror(rc));
    defer_release_resources(x);
    return st;
  }
  return KVF_SUCCESS;
}

/* A synchronous call on a context whose thread runs: every deferred call
 * posted before it is enqueued first, and none is posted until it ends, so
 * the context's streams and buffers see calls in the order they were made.
 * defer_hold returns whether the hold was taken (defer_release then). */
static int defer_hold(kvf_xfer *x) {
  pthread_mutex_lock(&x->defer_mu);
  int held = x->defer_state == 1;
  if (held) {
    x->defer_holds++; /* no post begins from here on */
    defer_wait_posted(x);
  }
  pthread_mutex_unlock(&x->defer_mu);
  return held;
}

static void defer_release(kvf_xfer *x) {
  pthread_mutex_lock(&x->defer_mu);
  x->defer_holds--;
  pthread_cond_broadcast(&x->defer_room);
  pthread_mutex_unlock(&x->defer_mu);
}

/* Post a checked request as a deferred call after the work on `after` (the
 * context's device current): its ticket into *ticket. */
static kvf_status post_deferred(kvf_xfer *x, const kvf_copy_request *r, cudaStream_t after, int gather,
                                uint64_t *ticket) {
  const char *dir = gather ? "gather" : "scatter";
  enum cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  cudaError_t e = cudaStreamIsCapturing(after, &capture);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return kvf_fail(KVF_ERR_CUDA, "after: %s", cudaGetErrorString(e));
  }
  if (capture != cudaStreamCaptureStatusNone)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT,
                    "after: the stream is being captured into a graph, which cannot hold work the context's thread "
                    "enqueues later (capture kvf_xfer_%s instead)",
                    dir);
  deferred *d = copy_deferred(x->geometry, r, gather);
  if (!d) return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "deferred %s: out of memory for the request's copy", dir);
  pthread_mutex_lock(&x->defer_post_mu);
  pthread_mutex_lock(&x->defer_mu);
  if (x->defer_state == 0) {
    kvf_status st = defer_start(x);
    if (st) {
      pthread_mutex_unlock(&x->defer_mu);
      pthread_mutex_unlock(&x->defer_post_mu);
      free(d);
      char why[sizeof x->defer_failures[0].message];
      snprintf(why, sizeof why, "%s", kvf_last_error()); /* kvf_fail writes where kvf_last_error reads */
      return kvf_fail(st, "deferred %s: starting the context's thread: %s; nothing was enqueued", dir, why);
    }
    x->defer_state = 1;
  }
  while (x->defer_holds || x->defer_free == 0) pthread_cond_wait(&x->defer_room, &x->defer_mu);
  cudaEvent_t ev = x->defer_events[--x->defer_free];
  uint64_t seq = x->defer_seq + 1;
  x->defer_posting = 1;
  pthread_mutex_unlock(&x->defer_mu);
  /* Without defer_mu: should the record block (the driver may hold
   * enqueues while another thread frees memory), the thread still takes
   * and enqueues the calls posted before. */
  e = cudaEventRecord(ev, after);
  pthread_mutex_lock(&x->defer_mu);
  x->defer_posting = 0;
  if (e != cudaSuccess) {
    x->defer_events[x->defer_free++] = ev;
    pthread_cond_broadcast(&x->defer_room);
    pthread_mutex_unlock(&x->defer_mu);
    pthread_mutex_unlock(&x->defer_post_mu);
    free(d);
    cudaGetLastError();
    return kvf_fail(KVF_ERR_CUDA, "after: recording deferred %s's event: %s; nothing was enqueued", dir,
                    cudaGetErrorString(e));
  }
  x->defer_seq = seq;
  d->seq = seq;
  d->start = ev;
  if (x->defer_tail)
    x->defer_tail->next = d;
  else
    x->defer_head = d;
  x->defer_tail = d;
  *ticket = seq - x->defer_base;
  pthread_cond_broadcast(&x->defer_room); /* waiters for the post to finish */
  pthread_mutex_unlock(&x->defer_mu);
  pthread_mutex_unlock(&x->defer_post_mu);
  /* Woken after the unlocks, so that it does not wake into a held mutex.
   * The context outlives this call (destroy must not race calls). */
  pthread_cond_signal(&x->defer_wake);
  return KVF_SUCCESS;
}

/* Stop the thread once it has enqueued every posted call, and release
 * what deferred calls used (destroy; the context's device current). */
static void defer_stop(kvf_xfer *x) {
  pthread_mutex_lock(&x->defer_mu);
  int running = x->defer_state == 1;
  x->defer_stop = 1;
  pthread_cond_broadcast(&x->defer_wake);
  pthread_mutex_unlock(&x->defer_mu);
  if (running) pthread_join(x->defer_thread, NULL);
  defer_release_resources(x);
}

#endif

/* Whether `ticket` names one of the `made` deferred calls of a context, or
 * a failure naming the ticket. */
static kvf_status check_ticket(const char *fn, uint64_t ticket, uint64_t made) {
  if (ticket == 0 || ticket > made)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "ticket %llu: %s: the context has made %llu deferred call%s%s",
                    (unsigned long long)ticket, fn, (unsigned long long)made, made == 1 ? "" : "s",
                    ticket == 0 ? " (tickets count from 1)" : "");
  return KVF_SUCCESS;
}

#ifdef KVF_WITH_CUDA
/* The number on the word of the context's deferred call `ticket` (under
 * defer_mu), or a failure naming the ticket. */
static kvf_status ticket_seq(const kvf_xfer *x, const char *fn, uint64_t ticket, uint64_t *seq) {
  kvf_status st = check_ticket(fn, ticket, x->defer_seq - x->defer_base);
  if (!st) *seq = x->defer_base + ticket;
  return st;
}
#endif

/* The host backend's check of a ticket (its calls ran when they were made). */
static kvf_status host_ticket(const kvf_xfer *x, const char *fn, uint64_t ticket) {
  return check_ticket(fn, ticket, __atomic_load_n(&x->host_tickets, __ATOMIC_RELAXED));
}

kvf_status kvf_xfer_join(kvf_xfer *x, uint64_t ticket, kvf_stream stream) {
  if (!x) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_xfer_join: the context is NULL");
  if (x->device == KVF_DEVICE_HOST) return host_ticket(x, "kvf_xfer_join", ticket);
#ifdef KVF_WITH_CUDA
  uint64_t seq = 0;
  pthread_mutex_lock(&x->defer_mu);
  kvf_status st = ticket_seq(x, "kvf_xfer_join", ticket, &seq);
  if (st) {
    pthread_mutex_unlock(&x->defer_mu);
    return st;
  }
  /* Enqueued first: the wait below then comes after the work it waits
   * for on any hardware queue the streams share. */
  while (x->defer_finished < seq) pthread_cond_wait(&x->defer_room, &x->defer_mu);
  const CUdeviceptr word = x->defer_done_dev;
  pthread_mutex_unlock(&x->defer_mu);
  int prev = 0;
  cudaGetDevice(&prev);
  if (prev != x->device) cudaSetDevice(x->device);
  CUresult cr = KVF_CU(cuStreamWaitValue64)((CUstream)stream, word, seq, CU_STREAM_WAIT_VALUE_GEQ);
  if (prev != x->device) cudaSetDevice(prev);
  if (cr != CUDA_SUCCESS) {
    /* A kept failure stays for the next join, query or flush. */
    char what[160];
    return kvf_fail(KVF_ERR_CUDA, "stream: the wait for deferred call %llu: %s; nothing was enqueued",
                    (unsigned long long)ticket, kvf_cu_describe(cr, what, sizeof what));
  }
  pthread_mutex_lock(&x->defer_mu);
  st = report_failure(x, seq);
  pthread_mutex_unlock(&x->defer_mu);
  return st;
#else
  (void)stream;
  return kvf_fail(KVF_ERR_NO_DRIVER, "this build of kvferry has no CUDA");
#endif
}

kvf_status kvf_xfer_query(kvf_xfer *x, uint64_t ticket, int *done) {
  if (!x) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_xfer_query: the context is NULL");
  if (!done) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "done: kvf_xfer_query: NULL");
  *done = 0;
  if (x->device == KVF_DEVICE_HOST) {
    kvf_status st = host_ticket(x, "kvf_xfer_query", ticket);
    if (!st) *done = 1;
    return st;
  }
#ifdef KVF_WITH_CUDA
  uint64_t seq = 0;
  pthread_mutex_lock(&x->defer_mu);
  kvf_status st = ticket_seq(x, "kvf_xfer_query", ticket, &seq);
  if (!st) {
    /* Done only once the thread is through with the call: its failure is
     * kept by then, so a query never answers done without it. */
    *done = x->defer_finished >= seq && __atomic_load_n(x->defer_done, __ATOMIC_ACQUIRE) >= seq;
    st = report_failure(x, seq);
  }
  pthread_mutex_unlock(&x->defer_mu);
  return st;
#else
  return kvf_fail(KVF_ERR_NO_DRIVER, "this build of kvferry has no CUDA");
#endif
}

kvf_status kvf_xfer_flush(kvf_xfer *x) {
  if (!x) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_xfer_flush: the context is NULL");
#ifdef KVF_WITH_CUDA
  if (x->device == KVF_DEVICE_HOST) return KVF_SUCCESS;
  pthread_mutex_lock(&x->defer_mu);
  if (x->defer_state == 1) defer_wait_posted(x);
  kvf_status st = report_failure(x, UINT64_MAX);
  pthread_mutex_unlock(&x->defer_mu);
  return st;
#else
  return KVF_SUCCESS;
#endif
}

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
  x->path = (kvf_xfer_path_info){.path = KVF_PATH_HOST};
  return KVF_SUCCESS;
}

static kvf_status transfer(kvf_xfer *x, const kvf_copy_request *request, kvf_stream stream, int gather) {
  if (!x) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "transfer context is NULL");
  uint64_t t0 = kvf_now_ns();
  kvf_copy_request local;
  const kvf_copy_request *r = &local;
  kvf_status st = kvf_copy_request_check_local(x->geometry, request, &local);
  if (st) return st;
  if (x->device == KVF_DEVICE_HOST) {
    pthread_mutex_lock(&x->lock);
    x->planned_ns = 0;
    st = run_host(x, r, gather);
    if (st == KVF_SUCCESS) note_host_time(x, t0);
    pthread_mutex_unlock(&x->lock);
    return st;
  }
#ifdef KVF_WITH_CUDA
  int prev = 0;
  cudaGetDevice(&prev);
  if (prev != x->device) cudaSetDevice(x->device);
  int held = defer_hold(x);
  pthread_mutex_lock(&x->lock);
  x->planned_ns = 0;
  x->call_start_ns = kvf_now_ns(); /* after any wait for the lock, as the deferred thread takes it */
  st = launch_cuda(x, r, gather, (cudaStream_t)stream);
  if (st == KVF_SUCCESS) note_host_time(x, t0);
  pthread_mutex_unlock(&x->lock);
  if (held) defer_release(x);
  if (prev != x->device) cudaSetDevice(prev);
  return st;
#else
  (void)stream;
  (void)gather;
  return kvf_fail(KVF_ERR_NO_DRIVER, "this build of kvferry has no CUDA");
#endif
}

kvf_status kvf_xfer_prepare_regions(kvf_xfer *x, void *const *region_bases) {
  if (!x || !region_bases) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_xfer_prepare_regions: NULL argument");
  if (x->device == KVF_DEVICE_HOST) return KVF_SUCCESS;
#ifdef KVF_WITH_CUDA
  const kvf_geometry *g = x->geometry;
  pthread_mutex_lock(&x->lock);
  int prev = 0;
  cudaGetDevice(&prev);
  if (prev != x->device) cudaSetDevice(x->device);
  for (uint32_t reg = 0; reg < g->num_regions; reg++) {
    mem_kind k = MEM_LOCAL;
    if (!region_bases[reg] || classify(x, region_bases[reg], "region_bases", reg, &k) != KVF_SUCCESS) continue;
    x->region_seen[reg] = k == MEM_HOST ? NULL : region_bases[reg];
    x->region_kind[reg] = (unsigned char)k;
  }
  cudaGetLastError();
  if (prev != x->device) cudaSetDevice(prev);
  pthread_mutex_unlock(&x->lock);
#endif
  return KVF_SUCCESS;
}

kvf_status kvf_xfer_gather(kvf_xfer *x, const kvf_copy_request *r, kvf_stream stream) {
  return transfer(x, r, stream, 1);
}

kvf_status kvf_xfer_scatter(kvf_xfer *x, const kvf_copy_request *r, kvf_stream stream) {
  return transfer(x, r, stream, 0);
}

static kvf_status transfer_deferred(kvf_xfer *x, const kvf_copy_request *request, kvf_stream after, int gather,
                                    uint64_t *ticket) {
  const char *fn = gather ? "kvf_xfer_gather_deferred" : "kvf_xfer_scatter_deferred";
  if (!x) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "%s: the context is NULL", fn);
  if (!ticket) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "ticket: %s: NULL", fn);
  if (x->device == KVF_DEVICE_HOST) {
    /* Runs at once, as the host backend's synchronous call does. */
    kvf_status st = transfer(x, request, after, gather);
    if (st) return st;
    *ticket = __atomic_add_fetch(&x->host_tickets, 1, __ATOMIC_RELAXED);
    return KVF_SUCCESS;
  }
#ifdef KVF_WITH_CUDA
  kvf_copy_request local;
  kvf_status st = kvf_copy_request_check_local(x->geometry, request, &local);
  if (st) return st;
  int prev = 0;
  cudaGetDevice(&prev);
  if (prev != x->device) cudaSetDevice(x->device);
  st = post_deferred(x, &local, (cudaStream_t)after, gather, ticket);
  if (prev != x->device) cudaSetDevice(prev);
  return st;
#else
  return kvf_fail(KVF_ERR_NO_DRIVER, "this build of kvferry has no CUDA");
#endif
}

kvf_status kvf_xfer_gather_deferred(kvf_xfer *x, const kvf_copy_request *r, kvf_stream after, uint64_t *ticket) {
  return transfer_deferred(x, r, after, 1, ticket);
}

kvf_status kvf_xfer_scatter_deferred(kvf_xfer *x, const kvf_copy_request *r, kvf_stream after, uint64_t *ticket) {
  return transfer_deferred(x, r, after, 0, ticket);
}
