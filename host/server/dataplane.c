/* The server's data path: admission, lanes, retirement (host/dataplane.h). */
#define _GNU_SOURCE /* pthread_setaffinity_np */
#include "host/server/dataplane.h"

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <kvferry/copy.h>
#include <kvferry/memory.h>
#include <kvferry/transfer.h>

#include "common/clock.h"
#include "common/error.h"
#include "host/core/log.h"
#include "host/core/param.h"
#include "host/core/xfer_internal.h"
#include "host/server/server_cuda.h"

#define DP_MAX_LANES 65u

typedef struct dp_lane dp_lane;

/* Ready events a registration keeps open (DP_READY_EVENTS per binding).
 * kvferryd opened the engine's interprocess event for every STORE and
 * destroyed it after the wait (cudaIpcOpenEventHandle and cudaEventDestroy
 * per request). Noticed while chasing the first-STORE cost of issue 15 (on
 * an H200 the first STORE after a registration took 1.251 ms against 0.807
 * for the four after it, a 256-token chunk: perf/results/2026-12-01-h200/
 * served.md; kvf_served_bench sends no ready event, so that figure holds no
 * open): the open is work the driver need do once per event, and an engine
 * re-records one event for every step (python/kvferry/vllm/connector.py).
 * So an event is opened at the first STORE that names its handle and kept,
 * keyed by the handle's bytes, until the registration's binding goes;
 * every wait on it waits for the engine's latest record. A few per
 * registration (an engine may alternate events); beyond that the least
 * recently used is closed. */
#define DP_READY_EVENTS 8

typedef struct dp_ready_event {
  uint8_t handle[KVF_PROTO_READY_HANDLE_BYTES];
  kvf_scuda_ipc_event *event; /* NULL: a free entry */
  uint64_t used;              /* the binding's ready_tick at its last use */
} dp_ready_event;

struct kvf_dp_binding {
  int refs; /* atomic */
  kvf_dataplane *dp;
  dp_lane *lane;
  kvf_geometry *geometry;
  kvf_xfer *xfer;
  uint64_t registration_id;
  uint32_t num_groups, num_object_groups, chunk_tokens;
  kvf_l1_key scope; /* the fingerprint and shard every L1 key of this registration carries (chunk zero) */
  /* Opened ready events. Only the lane's worker touches them (every request
   * of the binding runs there), and the last unbind closes them, once no
   * request holds the binding: no lock. */
  dp_ready_event ready[DP_READY_EVENTS];
  uint64_t ready_tick;
};

typedef struct dp_job {
  struct dp_job *next;      /* in a lane queue */
  struct dp_job *all_next;  /* in the data plane's in-flight list */
  struct dp_job *all_prev;
  kvf_dp_binding *b;
  uint16_t type; /* KVF_PROTO_STORE or KVF_PROTO_RETRIEVE */
  uint64_t client_id, request_id;
  kvf_registry_reg *lease;
  kvf_l1_reservation *reservation;
  kvf_l1_pin *pin;
  /* The copy request and what it points to (owned). */
  kvf_copy_request req;
  void **region_bases;
  kvf_group_blocks *groups;
  uint32_t **ids;
  void **objects;
  uint32_t ready_kind;
  uint8_t ready_handle[KVF_PROTO_READY_HANDLE_BYTES];
  /* STORE: objects L1 said it holds (committed, or reserved by another
   * request that may still fail), and whether each counts for the prefix. */
  kvf_l1_query *present;
  uint64_t *present_chunk_begin; /* UINT64_MAX: not a full-attention object group */
  uint32_t num_present;
  /* Progress. */
  kvf_scuda_event *event;
  int queued;           /* work may have been enqueued on the lane's stream */
  int answered;         /* the outcome was reported (a timeout answers early) */
  uint32_t answered_kind; /* the outcome reported */
  uint64_t deadline_ns;
  /* Where its time went (KVF_DEBUG=TRACE, KVF_DEBUG_SUBSYS=SERVER: one line
   * at retirement), to tell a first request's setup from its copy: admitted,
   * taken by the worker, enqueued, proven. */
  uint64_t admitted_ns, started_ns, enqueued_ns, proven_ns;
  double xfer_us;       /* host time of the transfer call (kvf_xfer_last_path) */
  kvf_xfer_path xfer_path;
  uint32_t inject_step; /* tests: kvf_dp_fail_step for this request */
  kvf_status status;
  char message[KVF_PROTO_MESSAGE_MAX];
  /* The reply. */
  uint64_t prefix_tokens, objects_done, objects_present, bytes_done;
  uint64_t group_blocks[KVF_MAX_GROUPS];
  uint64_t og_prefix[KVF_MAX_GROUPS];
} dp_job;

typedef struct dp_queue {
  dp_job *head, *tail;
  uint32_t length;
  uint32_t pushes; /* atomic: bumped by every push, watched by a spinning waiter */
} dp_queue;

struct dp_lane {
  kvf_dataplane *dp;
  int device; /* -1: the host lane */
  int numa_node, worker_cpu, completion_cpu;
  int pin_device; /* the device its pool was pinned through, or -1 */
  void *stream;
  void *pool;
  int pool_given;    /* pool came from options.pool_alloc: pool_free(pool_handle) takes it back */
  void *pool_handle;
  uint64_t pool_bytes;
  pthread_t worker, completer;
  int worker_started, completer_started;
  dp_queue todo;    /* admitted, waiting for the worker */
  dp_queue flight;  /* enqueued, waiting for proof */
  pthread_cond_t todo_cv, flight_cv;
};

struct kvf_dataplane {
  kvf_dataplane_options opt;
  kvf_registry *registry;
  kvf_l1 *l1;
  dp_lane lanes[DP_MAX_LANES];
  uint32_t num_lanes;
  pthread_mutex_t mu; /* lane queues, the in-flight list, counters */
  int mu_init, cv_init;
  int stopping;
  int first_device; /* the first CUDA device served, or -1 */
  dp_job *all; /* admitted and not retired */
  kvf_dataplane_stats counters;
};


/* ---- bindings ------------------------------------------------------------- */

static dp_lane *lane_for(kvf_dataplane *dp, int device) {
  for (uint32_t i = 0; i < dp->num_lanes; i++)
    if (dp->lanes[i].device == device) return &dp->lanes[i];
  return NULL;
}

kvf_status kvf_dataplane_bind(kvf_dataplane *dp, kvf_geometry *g, int device, uint64_t registration_id,
                              uint32_t shard_index, uint32_t shard_count, kvf_dp_binding **out) {
  *out = NULL;
  dp_lane *lane = lane_for(dp, device);
  if (!lane) {
    kvf_geometry_destroy(g);
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "payload.device: %d is not served by this server (see --devices)",
                    device);
  }
  kvf_dp_binding *b = calloc(1, sizeof(*b));
  if (!b) {
    kvf_geometry_destroy(g);
    return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "register: out of memory");
  }
  kvf_xfer_options xo = KVF_XFER_OPTIONS_INIT;
  xo.device = device < 0 ? KVF_DEVICE_HOST : device;
  kvf_status st = kvf_xfer_create(g, &xo, &b->xfer);
  if (st != KVF_SUCCESS) {
    kvf_geometry_destroy(g);
    free(b);
    return st;
  }
  kvf_object_policy pol = KVF_OBJECT_POLICY_INIT;
  (void)kvf_geometry_policy(g, &pol);
  b->refs = 1;
  b->dp = dp;
  b->lane = lane;
  b->geometry = g;
  b->registration_id = registration_id;
  b->num_groups = kvf_geometry_num_groups(g);
  b->num_object_groups = kvf_geometry_num_object_groups(g);
  b->chunk_tokens = pol.chunk_tokens;
  b->scope.fingerprint = kvf_geometry_fingerprint(g, KVF_FORMAT_CANONICAL);
  b->scope.shard_index = shard_index;
  b->scope.shard_count = shard_count;
  *out = b;
  return KVF_SUCCESS;
}

/* The L1 key of a chunk key sent on binding b: objects are found only by
 * registrations of the same canonical geometry and shard. */
static kvf_l1_key l1_key(const kvf_dp_binding *b, const kvf_chunk_key *chunk) {
  kvf_l1_key k = b->scope;
  k.chunk = *chunk;
  return k;
}

static kvf_dp_binding *binding_ref(kvf_dp_binding *b) {
  __atomic_add_fetch(&b->refs, 1, __ATOMIC_ACQ_REL);
  return b;
}

void kvf_dataplane_unbind(kvf_dp_binding *b) {
  if (!b || __atomic_sub_fetch(&b->refs, 1, __ATOMIC_ACQ_REL) != 0) return;
  /* Every request using them has retired: their waits have completed. */
  for (uint32_t i = 0; i < DP_READY_EVENTS; i++) kvf_scuda_ipc_event_close(b->ready[i].event);
  kvf_xfer_destroy(b->xfer); /* every request using it has retired: nothing to wait for */
  kvf_geometry_destroy(b->geometry);
  free(b);
}

void kvf_dataplane_prepare(kvf_dp_binding *b, uint64_t client_id) {
  if (!b || b->lane->device < 0) return;
  kvf_registry_reg *lease = NULL;
  if (kvf_registry_lease_acquire(b->dp->registry, client_id, &lease) != KVF_SUCCESS) return;
  const kvf_import_reg *ir = kvf_registry_reg_import(lease);
  uint32_t nreg = kvf_geometry_num_regions(b->geometry);
  void **bases = calloc(nreg ? nreg : 1, sizeof(*bases));
  int ok = bases && kvf_registry_reg_id(lease) == b->registration_id && kvf_import_reg_num_views(ir) == nreg;
  for (uint32_t r = 0; ok && r < nreg; r++) {
    kvf_import_view_info vi;
    if (kvf_import_reg_view(ir, r, &vi) != KVF_SUCCESS) ok = 0;
    else bases[r] = vi.ptr;
  }
  /* The lease keeps the mappings until the queries are done. */
  if (ok) (void)kvf_xfer_prepare_regions(b->xfer, bases);
  free(bases);
  if (kvf_registry_lease_release(b->dp->registry, lease) != KVF_SUCCESS)
    KVF_WARN(SERVER, "lease release: %s (the unmap is retried later)", kvf_last_error());
}

const kvf_geometry *kvf_dp_binding_geometry(const kvf_dp_binding *b) { return b ? b->geometry : NULL; }
uint64_t kvf_dp_binding_registration(const kvf_dp_binding *b) { return b ? b->registration_id : 0; }

/* ---- jobs ------------------------------------------------------------------ */

static void queue_push(dp_queue *q, dp_job *j) {
  j->next = NULL;
  if (q->tail)
    q->tail->next = j;
  else
    q->head = j;
  q->tail = j;
  q->length++;
  __atomic_add_fetch(&q->pushes, 1, __ATOMIC_RELEASE);
}

static dp_job *queue_pop(dp_queue *q) {
  dp_job *j = q->head;
  if (!j) return NULL;
  q->head = j->next;
  if (!q->head) q->tail = NULL;
  q->length--;
  j->next = NULL;
  return j;
}

static void job_free(dp_job *j) {
  if (!j) return;
  if (j->ids)
    for (uint32_t g = 0; g < (j->b ? j->b->num_groups : 0); g++) free(j->ids[g]);
  free(j->ids);
  free(j->groups);
  free(j->region_bases);
  free(j->objects);
  free(j->present);
  free(j->present_chunk_begin);
  kvf_scuda_event_destroy(j->event);
  if (j->b) kvf_dataplane_unbind(j->b);
  free(j);
}

static void job_fail(dp_job *j, kvf_status st, const char *message) {
  if (j->status == KVF_SUCCESS) {
    j->status = st;
    snprintf(j->message, sizeof(j->message), "%s", message ? message : "");
  }
}

/* Send j's outcome (kind) to its client, record it in the completion table. */
static void job_answer(kvf_dataplane *dp, dp_job *j, uint32_t kind) {
  if (j->answered) return;
  j->answered = 1;
  j->answered_kind = kind;
  if (kind != KVF_OUTCOME_DONE) {
    /* Not done: nothing of it counts (a store is aborted, a retrieve may have
     * written any part of any block). */
    j->prefix_tokens = j->req.token_begin;
    j->objects_done = j->objects_present = j->bytes_done = 0;
    memset(j->group_blocks, 0, sizeof(j->group_blocks));
  }
  kvf_registry_outcome oc = {kind, j->status, j->prefix_tokens};
  (void)kvf_registry_completion_record(dp->registry, j->client_id, j->request_id, &oc, NULL);
  kvf_proto_msg r;
  memset(&r, 0, sizeof(r));
  r.type = (uint16_t)(j->type | KVF_PROTO_REPLY);
  r.request_id = j->request_id;
  kvf_proto_xfer_reply *x = &r.u.xfer_reply;
  x->status = (uint32_t)j->status;
  x->outcome = kind;
  x->prefix_tokens = j->prefix_tokens;
  x->objects_done = j->objects_done;
  x->objects_present = j->objects_present;
  x->bytes_done = j->bytes_done;
  x->group_blocks = j->group_blocks;
  x->num_groups = j->b->num_groups;
  if (j->type == KVF_PROTO_RETRIEVE) {
    x->og_prefix_tokens = j->og_prefix;
    x->num_object_groups = j->b->num_object_groups;
  }
  snprintf(x->message, sizeof(x->message), "%s", j->message);
  pthread_mutex_lock(&dp->mu);
  switch (kind) {
    case KVF_OUTCOME_DONE: dp->counters.done_total++; break;
    case KVF_OUTCOME_FAILED: dp->counters.failed_total++; break;
    case KVF_OUTCOME_CANCELLED: dp->counters.cancelled_total++; break;
    default: dp->counters.timed_out_total++; break;
  }
  pthread_mutex_unlock(&dp->mu);
  dp->opt.reply(dp->opt.reply_ctx, j->client_id, &r);
}

/* A done store: the objects it found present must be committed now (one
 * reserved by another request that failed is gone); the held prefix ends at
 * the first chunk that lacks one. */
static void job_check_present(kvf_dataplane *dp, dp_job *j) {
  kvf_l1_found *found = calloc(j->num_present, sizeof(*found));
  kvf_l1_pin *pin = NULL;
  if (!found || kvf_l1_lookup_pin(dp->l1, j->present, j->num_present, found, &pin) != KVF_SUCCESS) {
    free(found);
    j->prefix_tokens = j->req.token_begin; /* cannot tell: claim nothing */
    j->objects_present = 0;
    return;
  }
  for (uint32_t i = 0; i < j->num_present; i++) {
    if (found[i].found) continue;
    j->objects_present--;
    if (j->present_chunk_begin[i] != UINT64_MAX && j->present_chunk_begin[i] < j->prefix_tokens)
      j->prefix_tokens = j->present_chunk_begin[i];
  }
  kvf_l1_unpin(dp->l1, pin);
  free(found);
}

/* Release what j holds. Only once nothing can still touch its memory. */
/* The RETIRED notice for request_id of client_id (outcome: what its reply
 * said). */
static void post_retired(kvf_dataplane *dp, uint64_t client_id, uint64_t request_id, uint32_t outcome) {
  kvf_proto_msg r;
  memset(&r, 0, sizeof(r));
  r.type = KVF_PROTO_RETIRED;
  r.request_id = request_id;
  r.u.retired.outcome = outcome;
  dp->opt.reply(dp->opt.reply_ctx, client_id, &r);
}

/* The TRACE line of j's timings (microseconds between its steps). */
static void job_trace(const dp_job *j) {
  if (!kvf_log_enabled(KVF_LOG_TRACE, KVF_LOG_SERVER)) return;
  uint64_t now = kvf_now_ns();
  uint64_t started = j->started_ns ? j->started_ns : j->admitted_ns;
  uint64_t enqueued = j->enqueued_ns ? j->enqueued_ns : started;
  uint64_t proven = j->proven_ns ? j->proven_ns : enqueued;
  KVF_TRACE(SERVER,
            "lane %d: client %llu %s %llu: waited %.1f us for the worker, enqueued in %.1f us (%s route, %.1f us "
            "in the transfer call), proven %.1f us later, retiring %.1f us after that; %.1f us in all",
            j->b->lane->device, (unsigned long long)j->client_id, j->type == KVF_PROTO_STORE ? "STORE" : "RETRIEVE",
            (unsigned long long)j->request_id, (double)(started - j->admitted_ns) / 1e3,
            (double)(enqueued - started) / 1e3, kvf_xfer_path_name(j->xfer_path), j->xfer_us,
            (double)(proven - enqueued) / 1e3, (double)(now - proven) / 1e3, (double)(now - j->admitted_ns) / 1e3);
}

static void job_retire(kvf_dataplane *dp, dp_job *j) {
  job_trace(j);
  int done = j->status == KVF_SUCCESS && !j->answered;
  /* Answered before its work was proven done (timed out, cancelled): the
   * client learns of the proof from a RETIRED notice, sent below once
   * everything it held is released. */
  int early = j->answered;
  if (j->reservation) {
    if (done)
      kvf_l1_commit(dp->l1, j->reservation);
    else
      kvf_l1_abort(dp->l1, j->reservation);
    j->reservation = NULL;
  }
  if (done && j->num_present) job_check_present(dp, j);
  kvf_l1_unpin(dp->l1, j->pin);
  j->pin = NULL;
  if (j->lease) {
    kvf_status st = kvf_registry_lease_release(dp->registry, j->lease);
    if (st != KVF_SUCCESS) KVF_WARN(SERVER, "lease release: %s (the unmap is retried later)", kvf_last_error());
    j->lease = NULL;
  }
  job_answer(dp, j, done ? KVF_OUTCOME_DONE : KVF_OUTCOME_FAILED);
  pthread_mutex_lock(&dp->mu);
  if (j->all_prev)
    j->all_prev->all_next = j->all_next;
  else
    dp->all = j->all_next;
  if (j->all_next) j->all_next->all_prev = j->all_prev;
  dp->counters.in_flight--;
  /* Under mu, with the removal: a retry answered from the completion table
   * on the loop sees either this job in flight (this notice follows its
   * reply) or neither (it sends its own notice). */
  if (early) post_retired(dp, j->client_id, j->request_id, j->answered_kind);
  pthread_mutex_unlock(&dp->mu);
  job_free(j);
}

/* ---- admission ---------------------------------------------------------------- */

/* Local block range of chunk k (global chunk index gk) of group gi: [lb, le). */
static void chunk_blocks(const kvf_geometry *g, const kvf_group_info *gi, uint64_t cb, uint64_t ce, uint64_t *lb,
                         uint64_t *le) {
  uint64_t ltb = kvf_geometry_local_tokens(g, cb), lte = kvf_geometry_local_tokens(g, ce);
  *lb = ltb / gi->block_size;
  *le = kvf_div_up_u64(lte, gi->block_size);
}

/* [lb, le) clipped to the blocks t holds, [first_block, first_block +
 * count) (checked not to overflow at admission): loops over a chunk's
 * blocks walk only these, so their cost is bounded by what the client sent
 * and never by chunk_tokens / block_size (up to 2^24 blocks a chunk). */
static void table_span(const kvf_group_blocks *t, uint64_t lb, uint64_t le, uint64_t *from, uint64_t *to) {
  *from = lb > t->first_block ? lb : t->first_block;
  *to = le < t->first_block + t->count ? le : t->first_block + t->count;
  if (!t->block_ids || *to < *from) *to = *from;
}

static uint32_t table_id(const kvf_group_blocks *t, uint64_t block) {
  if (!t->block_ids || block < t->first_block || block - t->first_block >= t->count) return KVF_BLOCK_SKIP;
  return t->block_ids[block - t->first_block];
}

/* Mark every block of group gi inside chunk range [cb, ce) as skipped in j's table. */
static void skip_chunk(dp_job *j, const kvf_group_info *gi, uint32_t group, uint64_t cb, uint64_t ce) {
  kvf_group_blocks *t = &j->groups[group];
  if (!t->block_ids) return;
  if (gi->kind == KVF_GROUP_RECURRENT) {
    uint64_t slot_block = cb / j->b->chunk_tokens;
    if (slot_block >= t->first_block && slot_block - t->first_block < t->count)
      j->ids[group][slot_block - t->first_block] = KVF_BLOCK_SKIP;
    return;
  }
  uint64_t lb, le, from, to;
  chunk_blocks(j->b->geometry, gi, cb, ce, &lb, &le);
  table_span(t, lb, le, &from, &to);
  for (uint64_t blk = from; blk < to; blk++) j->ids[group][blk - t->first_block] = KVF_BLOCK_SKIP;
}

/* Does group `group`'s table hold every block of chunk [cb, ce)? For a
 * recurrent group: the state at the chunk's end (full chunks only). */
static int chunk_complete(const dp_job *j, const kvf_group_info *gi, uint32_t group, uint64_t cb, uint64_t ce) {
  const kvf_group_blocks *t = &j->groups[group];
  if (gi->kind == KVF_GROUP_RECURRENT)
    return ce - cb == j->b->chunk_tokens && table_id(t, cb / j->b->chunk_tokens) != KVF_BLOCK_SKIP;
  uint64_t lb, le, from, to;
  chunk_blocks(j->b->geometry, gi, cb, ce, &lb, &le);
  table_span(t, lb, le, &from, &to);
  if (to - from != (le > lb ? le - lb : 0)) return 0; /* the table lacks a block of the chunk */
  for (uint64_t blk = from; blk < to; blk++)
    if (t->block_ids[blk - t->first_block] == KVF_BLOCK_SKIP) return 0;
  return 1;
}

static int group_requested(const dp_job *j, uint32_t group) {
  return j->groups[group].block_ids != NULL && j->groups[group].count > 0;
}

/* Whole blocks of group `group` the (final) request moves. */
static uint64_t blocks_moved(const dp_job *j, const kvf_group_info *gi, uint32_t group) {
  const kvf_group_blocks *t = &j->groups[group];
  if (!t->block_ids) return 0;
  uint64_t n = 0;
  if (gi->kind == KVF_GROUP_RECURRENT) {
    for (uint32_t i = 0; i < t->count; i++) {
      uint64_t blk = t->first_block + i, end_token; /* first_block + count was checked */
      if (!kvf_mul_u64(blk + 1, j->b->chunk_tokens, &end_token)) break; /* past 2^64: past the range */
      if (t->block_ids[i] != KVF_BLOCK_SKIP && end_token > j->req.token_begin && end_token <= j->req.token_end) n++;
    }
    return n;
  }
  uint64_t lb = kvf_geometry_local_tokens(j->b->geometry, j->req.token_begin) / gi->block_size;
  uint64_t le = kvf_geometry_local_tokens(j->b->geometry, j->req.token_end) / gi->block_size; /* whole blocks */
  for (uint32_t i = 0; i < t->count; i++) {
    uint64_t blk = t->first_block + i;
    if (t->block_ids[i] != KVF_BLOCK_SKIP && blk >= lb && blk < le) n++;
  }
  return n;
}

/* Copy the wire's block tables and the registration's region bases into j. */
static kvf_status job_build_tables(dp_job *j, const kvf_proto_xfer *x) {
  const kvf_geometry *g = j->b->geometry;
  uint32_t ng = j->b->num_groups, nreg = kvf_geometry_num_regions(g);
  if (x->num_groups != ng)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "payload.num_groups: %u groups sent, the geometry has %u",
                    (unsigned)x->num_groups, (unsigned)ng);
  j->groups = calloc(ng ? ng : 1, sizeof(*j->groups));
  j->ids = calloc(ng ? ng : 1, sizeof(*j->ids));
  j->region_bases = calloc(nreg ? nreg : 1, sizeof(*j->region_bases));
  if (!j->groups || !j->ids || !j->region_bases) return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "request: out of memory");
  for (uint32_t g2 = 0; g2 < ng; g2++) {
    const kvf_proto_group *pg = &x->groups[g2];
    if (pg->count == 0) continue;
    j->ids[g2] = malloc((size_t)pg->count * sizeof(uint32_t));
    if (!j->ids[g2]) return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "request: out of memory");
    memcpy(j->ids[g2], pg->block_ids, (size_t)pg->count * sizeof(uint32_t));
    j->groups[g2].block_ids = j->ids[g2];
    j->groups[g2].first_block = pg->first_block;
    j->groups[g2].count = pg->count;
  }
  const kvf_import_reg *ir = kvf_registry_reg_import(j->lease);
  if (kvf_import_reg_num_views(ir) != nreg)
    return kvf_fail(KVF_ERR_STATE, "payload.registration_id: the registration has %u views, the geometry %u regions",
                    (unsigned)kvf_import_reg_num_views(ir), (unsigned)nreg);
  for (uint32_t r = 0; r < nreg; r++) {
    kvf_import_view_info vi;
    kvf_status st = kvf_import_reg_view(ir, r, &vi);
    if (st != KVF_SUCCESS) return st;
    j->region_bases[r] = vi.ptr;
  }
  j->req = (kvf_copy_request)KVF_COPY_REQUEST_INIT;
  j->req.region_bases = j->region_bases;
  j->req.token_begin = x->token_begin;
  j->req.token_end = x->token_end;
  j->req.format = (kvf_object_format)x->format;
  j->req.groups = j->groups;
  return KVF_SUCCESS;
}

/* The request is shaped: count the whole blocks it moves per group and
 * check it as the transfer will. */
static kvf_status job_finish_request(dp_job *j) {
  const kvf_geometry *g = j->b->geometry;
  j->req.objects = j->objects;
  for (uint32_t gidx = 0; gidx < j->b->num_groups; gidx++) {
    kvf_group_info gi = KVF_GROUP_INFO_INIT;
    (void)kvf_geometry_group(g, gidx, &gi);
    j->group_blocks[gidx] = blocks_moved(j, &gi, gidx);
  }
  kvf_status st = kvf_copy_request_check(g, &j->req);
  if (st != KVF_SUCCESS) {
    /* The engine's request passed job_precheck: this is the server's own shaping. */
    KVF_WARN(SERVER, "request shaping produced a request the transfer refuses: %s", kvf_last_error());
    st = kvf_fail(KVF_ERR_INTERNAL, "payload: the server shaped an invalid request (a bug; see its log)");
  }
  return st;
}

/* Check j's request as the engine sent it, every object present, so a bad
 * table is refused (naming the field) before L1 is touched. */
static kvf_status job_precheck(dp_job *j, uint64_t num_objects) {
  for (uint64_t i = 0; i < num_objects; i++) j->objects[i] = (void *)(uintptr_t)KVF_L1_ALIGN; /* never read */
  j->req.objects = j->objects;
  kvf_status st = kvf_copy_request_check(j->b->geometry, &j->req);
  memset(j->objects, 0, num_objects * sizeof(void *));
  j->req.objects = NULL;
  if (st != KVF_SUCCESS) kvf_error_prefix("payload: ");
  return st;
}

/* STORE admission: reserve an object for every (chunk, object group) whose
 * blocks the request holds completely; blocks of the others are skipped. */
static kvf_status admit_store(kvf_dataplane *dp, dp_job *j, const kvf_proto_xfer *x) {
  const kvf_geometry *g = j->b->geometry;
  uint32_t nog = j->b->num_object_groups, C = j->b->chunk_tokens;
  uint64_t nchunks = x->num_chunk_keys;
  kvf_status st = KVF_SUCCESS;
  kvf_l1_object_spec *specs = calloc((size_t)nchunks * nog, sizeof(*specs));
  kvf_l1_slot *slots = calloc((size_t)nchunks * nog, sizeof(*slots));
  uint32_t *spec_index = malloc((size_t)nchunks * nog * sizeof(uint32_t)); /* (k, og) -> spec or UINT32_MAX */
  j->objects = calloc((size_t)nchunks * nog, sizeof(void *));
  if (!specs || !slots || !spec_index || !j->objects) {
    st = kvf_fail(KVF_ERR_OUT_OF_MEMORY, "store: out of memory");
    goto out;
  }
  /* The request as the engine sent it must be one the transfer accepts
   * before anything is reserved (a reservation may evict). */
  st = job_precheck(j, nchunks * nog);
  if (st != KVF_SUCCESS) goto out;
  uint32_t n = 0;
  for (uint64_t k = 0; k < nchunks; k++) {
    uint64_t cb = x->token_begin + k * C, ce = x->token_end - cb > C ? cb + C : x->token_end;
    for (uint32_t og = 0; og < nog; og++) {
      spec_index[k * nog + og] = UINT32_MAX;
      kvf_object_group_info oi = KVF_OBJECT_GROUP_INFO_INIT;
      (void)kvf_geometry_object_group(g, og, &oi);
      /* An object is written whole or not at all: every group of its object
       * group must be in the request with every block of the chunk. */
      int requested = 0, complete = 1;
      for (uint32_t i = 0; i < oi.num_groups; i++) {
        uint32_t gidx = oi.groups[i];
        if (!group_requested(j, gidx)) {
          complete = 0;
          continue;
        }
        requested = 1;
        kvf_group_info gi = KVF_GROUP_INFO_INIT;
        (void)kvf_geometry_group(g, gidx, &gi);
        if (!chunk_complete(j, &gi, gidx, cb, ce)) complete = 0;
      }
      uint64_t bytes = 0;
      if (requested && complete)
        (void)kvf_geometry_object_size(g, og, cb / C, x->token_end, &bytes);
      if (!requested || !complete || bytes == 0) continue;
      kvf_l1_object_spec *s = &specs[n];
      s->key = l1_key(j->b, &x->chunk_keys[k]);
      s->object_group = og;
      st = kvf_object_header_init(g, (kvf_object_format)x->format, og, cb / C, x->token_end, &s->header);
      if (st != KVF_SUCCESS) goto out;
      spec_index[k * nog + og] = n++;
    }
  }
  if (n > 0) {
    uint32_t bad = UINT32_MAX;
    st = kvf_l1_reserve(dp->l1, j->b->lane->device, specs, n, slots, &j->reservation, &bad);
    if (st != KVF_SUCCESS) {
      if (bad < n) {
        /* L1 names specs[bad]: name the chunk key and object group instead,
         * and keep what L1 says after its "specs[bad]" (l1.h). */
        char why[KVF_PROTO_MESSAGE_MAX], spec[32];
        snprintf(why, sizeof(why), "%s", kvf_last_error());
        const char *rest = why;
        size_t len = (size_t)snprintf(spec, sizeof(spec), "specs[%u]", bad);
        if (strncmp(why, spec, len) == 0) rest = why + len + (why[len] == '.' ? 1 : why[len] == ':' ? 2 : 0);
        uint64_t k = 0;
        while (k < nchunks && spec_index[k * nog + specs[bad].object_group] != bad) k++;
        st = kvf_fail(st, "payload.chunk_keys[%llu]: object group %u: %s", (unsigned long long)k,
                      (unsigned)specs[bad].object_group, rest);
      } else {
        kvf_error_prefix("payload.chunk_keys: ");
      }
      goto out;
    }
  }
  /* Objects for reserved slots; every block of a chunk that is not written
   * this time (present, incomplete, no object) is skipped. */
  uint64_t held_prefix_end = x->token_begin;
  int prefix_open = 1;
  j->present = calloc(n ? n : 1, sizeof(*j->present));
  j->present_chunk_begin = calloc(n ? n : 1, sizeof(*j->present_chunk_begin));
  if (!j->present || !j->present_chunk_begin) {
    st = kvf_fail(KVF_ERR_OUT_OF_MEMORY, "store: out of memory");
    goto out;
  }
  for (uint64_t k = 0; k < nchunks; k++) {
    uint64_t cb = x->token_begin + k * C, ce = x->token_end - cb > C ? cb + C : x->token_end;
    int chunk_held = 1;
    for (uint32_t og = 0; og < nog; og++) {
      uint32_t si = spec_index[k * nog + og];
      int write = si != UINT32_MAX && slots[si].state == KVF_L1_SLOT_RESERVED;
      if (si != UINT32_MAX) {
        if (write) {
          j->objects[k * nog + og] = slots[si].data;
          j->objects_done++;
          j->bytes_done += specs[si].header.payload_bytes;
        }
      }
      kvf_object_group_info oi = KVF_OBJECT_GROUP_INFO_INIT;
      (void)kvf_geometry_object_group(g, og, &oi);
      /* The held prefix counts full-attention object groups: windowed ones
       * legitimately lack early chunks, recurrent ones all but the last. */
      int has_full = 0;
      for (uint32_t i = 0; i < oi.num_groups; i++) {
        kvf_group_info gi = KVF_GROUP_INFO_INIT;
        (void)kvf_geometry_group(g, oi.groups[i], &gi);
        has_full |= gi.kind == KVF_GROUP_FULL && group_requested(j, oi.groups[i]);
      }
      if (si != UINT32_MAX && !write) {
        j->objects_present++;
        j->present[j->num_present] = (kvf_l1_query){specs[si].key, og};
        j->present_chunk_begin[j->num_present] = has_full ? cb : UINT64_MAX;
        j->num_present++;
      }
      if (has_full && si == UINT32_MAX) chunk_held = 0;
      if (!write)
        for (uint32_t i = 0; i < oi.num_groups; i++) {
          kvf_group_info gi = KVF_GROUP_INFO_INIT;
          (void)kvf_geometry_group(g, oi.groups[i], &gi);
          skip_chunk(j, &gi, oi.groups[i], cb, ce);
        }
    }
    if (prefix_open && chunk_held)
      held_prefix_end = ce;
    else
      prefix_open = 0;
  }
  j->prefix_tokens = held_prefix_end;
  st = job_finish_request(j);
out:
  free(specs);
  free(slots);
  free(spec_index);
  return st;
}

/* Bit g of a group mask: group g takes part in the request (RETRIEVE: its
 * table names blocks; LOOKUP: every group). KVF_MAX_GROUPS is 64. */
_Static_assert(KVF_MAX_GROUPS <= 64, "a group mask is 64 bits");
static int in_mask(uint64_t groups, uint32_t g) { return (int)((groups >> g) & 1u); }

/* Does object group og take part (one of its groups is in the mask)? */
static int og_requested(const kvf_geometry *g, uint64_t groups, uint32_t og) {
  kvf_object_group_info oi = KVF_OBJECT_GROUP_INFO_INIT;
  (void)kvf_geometry_object_group(g, og, &oi);
  for (uint32_t i = 0; i < oi.num_groups; i++)
    if (in_mask(groups, oi.groups[i])) return 1;
  return 0;
}

/* Is object group og (with its found objects) restorable at prefix N?
 * found[k*nog+og] for chunk k; chunk k covers [tb + kC, ...). With `need`
 * (NULL: not wanted) and a yes, need[k*nog+og] is set for every object the
 * answer rests on: what a RETRIEVE to N reads of this object group. */
static int og_valid_at(const kvf_dp_binding *b, uint64_t tb, uint64_t groups, const kvf_l1_found *found, uint32_t og,
                       uint64_t N, uint8_t *need) {
  const kvf_geometry *g = b->geometry;
  uint32_t nog = b->num_object_groups, C = b->chunk_tokens;
  kvf_object_group_info oi = KVF_OBJECT_GROUP_INFO_INIT;
  (void)kvf_geometry_object_group(g, og, &oi);
  uint64_t need_from = N; /* the earliest token of [tb, N) this og needs */
  uint64_t state = UINT64_MAX; /* the chunk whose state object a recurrent group needs */
  for (uint32_t i = 0; i < oi.num_groups; i++) {
    uint32_t gidx = oi.groups[i];
    if (!in_mask(groups, gidx)) continue;
    kvf_group_info gi = KVF_GROUP_INFO_INIT;
    (void)kvf_geometry_group(g, gidx, &gi);
    if (gi.kind == KVF_GROUP_RECURRENT) {
      if (N % C != 0 || N <= tb) return 0;
      state = (N - tb) / C - 1;
      if (!found[state * nog + og].found) return 0;
      continue;
    }
    uint64_t rb = tb;
    if (kvf_geometry_retained_tokens(g, gidx, N, &rb) != KVF_SUCCESS) return 0;
    if (rb < tb) rb = tb;
    if (rb < need_from) need_from = rb;
  }
  for (uint64_t k = (need_from - tb) / C; tb + k * C < N; k++)
    if (!found[k * nog + og].found) return 0;
  if (need) {
    if (state != UINT64_MAX) need[state * nog + og] = 1;
    for (uint64_t k = (need_from - tb) / C; tb + k * C < N; k++) need[k * nog + og] = 1;
  }
  return 1;
}

/* What a prefix search looks for: the range, its keys and the groups that
 * take part. */
typedef struct dp_prefix_query {
  uint64_t token_begin, token_end;
  kvf_object_format format;
  const kvf_proto_chunk_key *chunk_keys;
  uint64_t num_chunks; /* chunks of the range, one key each */
  uint64_t groups;     /* group mask (in_mask) */
} dp_prefix_query;

/* The prefix rule RETRIEVE and LOOKUP share (one function, so they can never
 * disagree): look up and pin every object of the range's chunk keys (*pin,
 * set also on failure: the caller releases it), refuse objects of another
 * fingerprint or format naming the field, count objects of another token
 * range (a partial chunk then) as missing, and find the longest prefix P
 * valid for every object group that takes part: full groups need every
 * chunk up to P, windowed groups only the chunks of their retained window
 * at P, recurrent groups the state object at exactly P (a chunk boundary).
 * found[nchunks * nog] is the caller's. *prefix gets P (token_begin: a
 * miss), og_prefix[og] the longest prefix object group og alone reaches
 * (token_begin: a miss for it, or it takes no part). Cost: nchunks x nog
 * L1 lookups and, per candidate prefix, one walk over its chunks. */
static kvf_status prefix_find(kvf_dataplane *dp, const kvf_dp_binding *b, const dp_prefix_query *pq,
                              kvf_l1_found *found, kvf_l1_pin **pin, uint64_t *prefix, uint64_t *og_prefix) {
  const kvf_geometry *g = b->geometry;
  uint32_t nog = b->num_object_groups, C = b->chunk_tokens;
  uint64_t nchunks = pq->num_chunks, tb = pq->token_begin, te = pq->token_end;
  *pin = NULL;
  uint64_t nq = nchunks * nog;
  kvf_l1_query *q = calloc((size_t)(nq ? nq : 1), sizeof(*q));
  if (!q) return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "lookup: out of memory");
  for (uint64_t k = 0; k < nchunks; k++)
    for (uint32_t og = 0; og < nog; og++) q[k * nog + og] = (kvf_l1_query){l1_key(b, &pq->chunk_keys[k]), og};
  kvf_status st = kvf_l1_lookup_pin(dp->l1, q, (uint32_t)(nchunks * nog), found, pin);
  free(q);
  if (st != KVF_SUCCESS) return st;
  /* Objects made through another geometry or format are refused; objects
   * with another token range (a partial chunk then) do not count as found. */
  for (uint64_t k = 0; k < nchunks; k++)
    for (uint32_t og = 0; og < nog; og++) {
      kvf_l1_found *f = &found[k * nog + og];
      if (!f->found) continue;
      kvf_object_header want;
      uint64_t gk = tb / C + k;
      if (kvf_object_header_init(g, pq->format, og, gk, te, &want) != KVF_SUCCESS) {
        f->found = 0;
        continue;
      }
      if (f->header.format != want.format)
        return kvf_fail(KVF_ERR_GEOMETRY_MISMATCH,
                        "payload.format: chunk_keys[%llu] object group %u was stored as %s, the request asks for %s",
                        (unsigned long long)k, (unsigned)og,
                        kvf_object_format_name((kvf_object_format)f->header.format),
                        kvf_object_format_name((kvf_object_format)want.format));
      st = kvf_object_header_check(g, &f->header, og);
      if (st != KVF_SUCCESS) {
        kvf_error_prefix("payload.chunk_keys[%llu]: object group %u: ", (unsigned long long)k, (unsigned)og);
        return st;
      }
      if (f->header.token_begin != want.token_begin || f->header.token_end != want.token_end) f->found = 0;
    }
  /* Candidate prefixes: each chunk's end, longest first. */
  uint64_t P = tb;
  int any_requested = 0;
  for (uint32_t og = 0; og < nog; og++) og_prefix[og] = tb;
  for (uint64_t k = nchunks; k-- > 0;) {
    uint64_t N = te - (tb + k * C) > C ? tb + (k + 1) * C : te;
    int all = 1;
    for (uint32_t og = 0; og < nog; og++) {
      if (!og_requested(g, pq->groups, og)) continue;
      any_requested = 1;
      int ok = og_valid_at(b, tb, pq->groups, found, og, N, NULL);
      if (ok && og_prefix[og] == tb) og_prefix[og] = N;
      if (!ok) all = 0;
    }
    if (all && any_requested && P == tb) P = N;
  }
  *prefix = P;
  return KVF_SUCCESS;
}

/* RETRIEVE admission: find the longest prefix every requested object group
 * can restore, pin its objects, and shape the tables so that exactly the
 * retained blocks of that prefix are written. */
static kvf_status admit_retrieve(kvf_dataplane *dp, dp_job *j, const kvf_proto_xfer *x) {
  const kvf_geometry *g = j->b->geometry;
  uint32_t ng = j->b->num_groups, nog = j->b->num_object_groups, C = j->b->chunk_tokens;
  uint64_t nchunks = x->num_chunk_keys, tb = x->token_begin;
  kvf_status st = KVF_SUCCESS;
  kvf_l1_found *found = calloc((size_t)nchunks * nog, sizeof(*found));
  j->objects = calloc((size_t)nchunks * nog, sizeof(void *));
  if (!found || !j->objects) {
    st = kvf_fail(KVF_ERR_OUT_OF_MEMORY, "retrieve: out of memory");
    goto out;
  }
  st = job_precheck(j, nchunks * nog);
  if (st != KVF_SUCCESS) goto out;
  dp_prefix_query pq = {tb, x->token_end, (kvf_object_format)x->format, x->chunk_keys, nchunks, 0};
  for (uint32_t gidx = 0; gidx < ng; gidx++)
    if (group_requested(j, gidx)) pq.groups |= 1ull << gidx;
  uint64_t P = tb;
  st = prefix_find(dp, j->b, &pq, found, &j->pin, &P, j->og_prefix);
  if (st != KVF_SUCCESS) goto out;
  j->prefix_tokens = P;
  if (P == tb) {
    j->req.token_end = tb; /* nothing to restore */
    goto out;
  }
  /* Shape the request for [tb, P): objects each object group needs, and
   * the retained blocks of each group. */
  j->req.token_end = P;
  for (uint32_t gidx = 0; gidx < ng; gidx++) {
    if (!group_requested(j, gidx)) continue;
    kvf_group_info gi = KVF_GROUP_INFO_INIT;
    (void)kvf_geometry_group(g, gidx, &gi);
    kvf_group_blocks *t = &j->groups[gidx];
    if (gi.kind == KVF_GROUP_RECURRENT) {
      t->first_block = P / C - 1; /* the state at the prefix's end, into the engine's slot */
      t->count = 1;
      continue;
    }
    uint64_t fb = 0, eb = 0;
    (void)kvf_geometry_retained_blocks(g, gidx, P, &fb, &eb);
    for (uint32_t i = 0; i < t->count; i++) {
      uint64_t blk = t->first_block + i;
      if (blk < fb || blk >= eb) j->ids[gidx][i] = KVF_BLOCK_SKIP;
    }
  }
  for (uint64_t k = 0; tb + k * C < P; k++)
    for (uint32_t og = 0; og < nog; og++) {
      kvf_l1_found *f = &found[k * nog + og];
      if (!f->found) continue;
      /* Only objects whose chunk moves a block of this object group. */
      kvf_object_group_info oi = KVF_OBJECT_GROUP_INFO_INIT;
      (void)kvf_geometry_object_group(g, og, &oi);
      uint64_t cb = tb + k * C, ce = P - cb > C ? cb + C : P;
      int moves = 0;
      for (uint32_t i = 0; i < oi.num_groups && !moves; i++) {
        uint32_t gidx = oi.groups[i];
        if (!group_requested(j, gidx)) continue;
        kvf_group_info gi = KVF_GROUP_INFO_INIT;
        (void)kvf_geometry_group(g, gidx, &gi);
        const kvf_group_blocks *t = &j->groups[gidx];
        if (gi.kind == KVF_GROUP_RECURRENT) {
          moves = ce == P && ce - cb == C && table_id(t, cb / C) != KVF_BLOCK_SKIP;
          continue;
        }
        uint64_t lb, le, from, to;
        chunk_blocks(g, &gi, cb, ce, &lb, &le);
        table_span(t, lb, le, &from, &to);
        for (uint64_t blk = from; blk < to && !moves; blk++) moves = t->block_ids[blk - t->first_block] != KVF_BLOCK_SKIP;
      }
      if (!moves) continue;
      j->objects[k * nog + og] = (void *)f->data;
      j->objects_done++;
      j->bytes_done += f->header.payload_bytes;
    }
  st = job_finish_request(j);
out:
  free(found);
  return st;
}

/* The checks STORE, RETRIEVE and LOOKUP share: the registration, the
 * format, the range on chunk boundaries and one key per chunk. */
static kvf_status check_range(const kvf_dp_binding *b, uint64_t registration_id, uint32_t format, uint64_t tb,
                              uint64_t te, uint32_t num_chunk_keys) {
  uint32_t C = b->chunk_tokens;
  if (registration_id != 0 && registration_id != b->registration_id)
    return kvf_fail(KVF_ERR_STATE, "payload.registration_id: %llu is not the live registration (%llu)",
                    (unsigned long long)registration_id, (unsigned long long)b->registration_id);
  if (format > KVF_FORMAT_NATIVE)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "payload.format: %u is not an object format", (unsigned)format);
  if (tb % C != 0)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "payload.token_begin: %llu is not a multiple of chunk_tokens %u",
                    (unsigned long long)tb, (unsigned)C);
  if (te <= tb)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "payload.token_end: %llu must exceed token_begin %llu",
                    (unsigned long long)te, (unsigned long long)tb);
  /* Chunk and block arithmetic runs to the end of the chunk that holds the
   * last token: that end must be a 64-bit number (2^64 - 1 at most), or it
   * wraps (the block loops then spun forever, issue 12). */
  uint64_t chunk_end;
  if (!kvf_round_up_u64(te, C, &chunk_end))
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT,
                    "payload.token_end: %llu: the chunk of %u tokens that holds it ends past 2^64 - 1 (token_end "
                    "is at most %llu)",
                    (unsigned long long)te, (unsigned)C, (unsigned long long)(UINT64_MAX / C * C));
  uint64_t chunks = kvf_div_up_u64(te - tb, C);
  if (num_chunk_keys != chunks)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "payload.chunk_keys: %u keys sent, tokens [%llu, %llu) span %llu chunks",
                    (unsigned)num_chunk_keys, (unsigned long long)tb, (unsigned long long)te,
                    (unsigned long long)chunks);
  return KVF_SUCCESS;
}

/* Field checks that need the geometry but no lease. */
static kvf_status check_xfer(const kvf_dp_binding *b, const kvf_proto_msg *m) {
  const kvf_proto_xfer *x = &m->u.xfer;
  kvf_status st = check_range(b, x->registration_id, x->format, x->token_begin, x->token_end, x->num_chunk_keys);
  if (st != KVF_SUCCESS) return st;
  if (x->num_groups != b->num_groups)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "payload.num_groups: %u groups sent, the geometry has %u",
                    (unsigned)x->num_groups, (unsigned)b->num_groups);
  for (uint32_t g = 0; g < x->num_groups; g++) {
    kvf_group_info gi = KVF_GROUP_INFO_INIT;
    (void)kvf_geometry_group(b->geometry, g, &gi);
    const kvf_proto_group *pg = &x->groups[g];
    uint64_t table_end;
    if (!kvf_add_u64(pg->first_block, pg->count, &table_end))
      return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "payload.groups[%u].first_block: %llu + count %u passes 2^64 - 1",
                      (unsigned)g, (unsigned long long)pg->first_block, (unsigned)pg->count);
    for (uint32_t i = 0; i < pg->count; i++)
      if (pg->block_ids[i] != KVF_BLOCK_SKIP && pg->block_ids[i] >= gi.num_blocks)
        return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "payload.groups[%u].block_ids[%u]: %u is out of range (group '%s' has %u blocks)",
                        (unsigned)g, (unsigned)i, (unsigned)pg->block_ids[i], gi.name, (unsigned)gi.num_blocks);
    if (m->type == KVF_PROTO_RETRIEVE && gi.kind == KVF_GROUP_RECURRENT && pg->count > 1)
      return kvf_fail(KVF_ERR_INVALID_ARGUMENT,
                      "payload.groups[%u].count: a recurrent group's RETRIEVE names one slot, %u given", (unsigned)g,
                      (unsigned)pg->count);
  }
  if (m->type == KVF_PROTO_RETRIEVE && x->ready_kind != KVF_PROTO_READY_NONE)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "payload.ready_kind: a RETRIEVE carries no ready event");
  if (x->ready_kind == KVF_PROTO_READY_CUDA_EVENT && b->lane->device < 0)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "payload.ready_kind: a CUDA event for a host-backend registration");
  return KVF_SUCCESS;
}

kvf_status kvf_dataplane_submit(kvf_dataplane *dp, kvf_dp_binding *b, uint64_t client_id, const kvf_proto_msg *m) {
  if (!dp || !m || (m->type != KVF_PROTO_STORE && m->type != KVF_PROTO_RETRIEVE))
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_dataplane_submit: not a STORE or RETRIEVE");
  if (!b) return kvf_fail(KVF_ERR_STATE, "payload.registration_id: this client has no registration");
  /* A retried request: answer what was recorded, or let the one in flight answer. */
  kvf_registry_outcome oc;
  if (kvf_registry_completion_lookup(dp->registry, client_id, m->request_id, &oc) == KVF_SUCCESS) {
    kvf_proto_msg r;
    memset(&r, 0, sizeof(r));
    r.type = (uint16_t)(m->type | KVF_PROTO_REPLY);
    r.request_id = m->request_id;
    r.u.xfer_reply.status = (uint32_t)oc.status;
    r.u.xfer_reply.outcome = oc.kind;
    r.u.xfer_reply.prefix_tokens = oc.value;
    snprintf(r.u.xfer_reply.message, sizeof(r.u.xfer_reply.message), "a retry: the outcome recorded earlier");
    /* An outcome recorded before the proof (timed out, cancelled) is
     * followed by its RETIRED notice: the job's own while it is in flight,
     * else one sent here (RETIRED may then arrive twice: harmless). */
    int early = oc.kind == KVF_OUTCOME_TIMED_OUT || oc.kind == KVF_OUTCOME_CANCELLED;
    pthread_mutex_lock(&dp->mu);
    int in_flight = 0;
    for (dp_job *o = dp->all; o && early; o = o->all_next)
      if (o->client_id == client_id && o->request_id == m->request_id) in_flight = 1;
    dp->opt.reply(dp->opt.reply_ctx, client_id, &r);
    if (early && !in_flight) post_retired(dp, client_id, m->request_id, oc.kind);
    pthread_mutex_unlock(&dp->mu);
    return KVF_SUCCESS;
  }
  pthread_mutex_lock(&dp->mu);
  for (dp_job *o = dp->all; o; o = o->all_next)
    if (o->client_id == client_id && o->request_id == m->request_id) {
      pthread_mutex_unlock(&dp->mu);
      KVF_INFO(SERVER, "client %llu: request %llu retried while in flight: its reply answers both",
               (unsigned long long)client_id, (unsigned long long)m->request_id);
      return KVF_SUCCESS;
    }
  int stopping = dp->stopping;
  pthread_mutex_unlock(&dp->mu);
  if (stopping) return kvf_fail(KVF_ERR_STATE, "header.type: the server is stopping");
  kvf_status st = check_xfer(b, m);
  if (st != KVF_SUCCESS) return st;
  dp_job *j = calloc(1, sizeof(*j));
  if (!j) return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "request: out of memory");
  j->b = binding_ref(b);
  j->type = m->type;
  j->client_id = client_id;
  j->request_id = m->request_id;
  j->ready_kind = m->u.xfer.ready_kind;
  memcpy(j->ready_handle, m->u.xfer.ready_handle, sizeof(j->ready_handle));
  st = kvf_registry_lease_acquire(dp->registry, client_id, &j->lease);
  if (st != KVF_SUCCESS) {
    j->lease = NULL;
    kvf_error_prefix("payload.registration_id: no lease: ");
    goto refuse;
  }
  if (kvf_registry_reg_id(j->lease) != b->registration_id) {
    st = kvf_fail(KVF_ERR_STATE, "payload.registration_id: registration %llu is no longer the live one",
                  (unsigned long long)b->registration_id);
    goto refuse;
  }
  int inject = !dp->opt.test_fail_type || dp->opt.test_fail_type == m->type;
  j->inject_step = inject ? dp->opt.test_fail_step : KVF_DP_FAIL_NONE;
  if (j->inject_step == KVF_DP_FAIL_LEASED) {
    st = kvf_fail(KVF_ERR_SYSTEM, "payload: injected failure after the lease");
    goto refuse;
  }
  st = job_build_tables(j, &m->u.xfer);
  if (st != KVF_SUCCESS) goto refuse;
  st = m->type == KVF_PROTO_STORE ? admit_store(dp, j, &m->u.xfer) : admit_retrieve(dp, j, &m->u.xfer);
  if (st != KVF_SUCCESS) goto refuse;
  if (j->inject_step == KVF_DP_FAIL_RESERVED) {
    st = kvf_fail(KVF_ERR_SYSTEM, "payload: injected failure after the reservation");
    goto refuse;
  }
  j->admitted_ns = kvf_now_ns();
  j->deadline_ns = j->admitted_ns + (uint64_t)dp->opt.job_timeout_ms * 1000000ull;
  pthread_mutex_lock(&dp->mu);
  if (m->type == KVF_PROTO_STORE)
    dp->counters.stores_total++;
  else
    dp->counters.retrieves_total++;
  dp->counters.in_flight++;
  j->all_next = dp->all;
  if (dp->all) dp->all->all_prev = j;
  dp->all = j;
  queue_push(&b->lane->todo, j);
  pthread_cond_signal(&b->lane->todo_cv);
  pthread_mutex_unlock(&dp->mu);
  return KVF_SUCCESS;
refuse:
  /* Nothing was queued: release at once. */
  {
    char why[KVF_PROTO_MESSAGE_MAX];
    snprintf(why, sizeof(why), "%s", kvf_last_error());
    if (j->reservation) kvf_l1_abort(dp->l1, j->reservation);
    kvf_l1_unpin(dp->l1, j->pin);
    if (j->lease) (void)kvf_registry_lease_release(dp->registry, j->lease);
    j->reservation = NULL;
    j->pin = NULL;
    j->lease = NULL;
    job_free(j);
    kvf_fail(st, "%s", why);
  }
  return st;
}

/* ---- LOOKUP ------------------------------------------------------------------ */

kvf_status kvf_dataplane_lookup(kvf_dataplane *dp, kvf_dp_binding *b, const kvf_proto_lookup *q,
                                kvf_dp_lookup_result *out, kvf_l1_pin **pin) {
  if (!dp || !q || !out) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_dataplane_lookup: NULL argument");
  memset(out, 0, sizeof(*out));
  if (pin) *pin = NULL;
  if (!b) return kvf_fail(KVF_ERR_STATE, "payload.registration_id: this client has no registration");
  kvf_status st = check_range(b, q->registration_id, q->format, q->token_begin, q->token_end, q->num_chunk_keys);
  if (st != KVF_SUCCESS) return st;
  uint32_t nog = b->num_object_groups;
  uint64_t n = (uint64_t)q->num_chunk_keys * nog, tb = q->token_begin;
  kvf_l1_found *found = calloc((size_t)(n ? n : 1), sizeof(*found));
  uint8_t *need = pin ? calloc((size_t)(n ? n : 1), 1) : NULL;
  kvf_l1_query *keep = pin ? calloc((size_t)(n ? n : 1), sizeof(*keep)) : NULL;
  kvf_l1_found *kept = pin ? calloc((size_t)(n ? n : 1), sizeof(*kept)) : NULL;
  kvf_l1_pin *all = NULL;
  if (!found || (pin && (!need || !keep || !kept))) {
    st = kvf_fail(KVF_ERR_OUT_OF_MEMORY, "lookup: out of memory");
    goto out;
  }
  /* Every group takes part: the prefix each object group holds. */
  dp_prefix_query pq = {tb, q->token_end, (kvf_object_format)q->format, q->chunk_keys, q->num_chunk_keys,
                        b->num_groups >= 64 ? ~0ull : (1ull << b->num_groups) - 1};
  uint64_t P = tb;
  st = prefix_find(dp, b, &pq, found, &all, &P, out->og_prefix);
  if (st != KVF_SUCCESS) goto out;
  out->prefix_tokens = P;
  out->num_object_groups = nog;
  if (pin && P > tb) {
    /* Pin what a RETRIEVE to P reads, while `all` still holds it. */
    for (uint32_t og = 0; og < nog; og++) (void)og_valid_at(b, tb, pq.groups, found, og, P, need);
    uint32_t nk = 0;
    for (uint64_t k = 0; k < q->num_chunk_keys; k++) {
      int any = 0;
      for (uint32_t og = 0; og < nog; og++)
        if (need[k * nog + og]) {
          keep[nk++] = (kvf_l1_query){l1_key(b, &q->chunk_keys[k]), og};
          any = 1;
        }
      out->pinned_chunks += (uint32_t)any;
    }
    st = kvf_l1_lookup_pin(dp->l1, keep, nk, kept, pin);
    if (st != KVF_SUCCESS) {
      *pin = NULL;
      out->pinned_chunks = 0;
      goto out;
    }
    if (out->pinned_chunks == 0) { /* cannot happen: P > tb rests on some object */
      kvf_l1_unpin(dp->l1, *pin);
      *pin = NULL;
    }
  }
out:
  kvf_l1_unpin(dp->l1, all);
  free(found);
  free(need);
  free(keep);
  free(kept);
  return st;
}

void kvf_dataplane_unpin(kvf_dataplane *dp, kvf_l1_pin *pin) {
  if (dp && pin) kvf_l1_unpin(dp->l1, pin);
}

/* ---- lanes ------------------------------------------------------------------ */

static void pin_thread(int cpu) {
  if (cpu < 0) return;
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  int rc = pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
  if (rc != 0) KVF_INFO(SERVER, "pinning a lane thread to cpu %d: %s", cpu, strerror(rc));
}

/* Make the lane's stream wait for j's ready event: the binding's opened
 * one for that handle, opened now if there is none (lane worker only). A
 * handle the driver refuses is not kept; an event whose wait failed is
 * closed, so the next request opens it afresh. */
static kvf_status wait_ready(dp_lane *lane, dp_job *j) {
  kvf_dp_binding *b = j->b;
  dp_ready_event *slot = NULL, *victim = NULL; /* victim: a free entry, else the least recently used */
  for (uint32_t i = 0; i < DP_READY_EVENTS && !slot; i++) {
    dp_ready_event *r = &b->ready[i];
    if (!r->event) {
      if (!victim || victim->event) victim = r;
    } else if (!memcmp(r->handle, j->ready_handle, sizeof(r->handle))) {
      slot = r;
    } else if (!victim || (victim->event && r->used < victim->used)) {
      victim = r;
    }
  }
  if (!slot) {
    kvf_scuda_ipc_event *ev = NULL;
    kvf_status st = kvf_scuda_ipc_event_open(lane->device, j->ready_handle, &ev);
    if (st != KVF_SUCCESS) return st;
    kvf_scuda_ipc_event_close(victim->event); /* its earlier waits are enqueued: they keep what they need */
    slot = victim;
    slot->event = ev;
    memcpy(slot->handle, j->ready_handle, sizeof(slot->handle));
  }
  slot->used = ++b->ready_tick;
  kvf_status st = kvf_scuda_ipc_event_wait(slot->event, lane->stream);
  if (st != KVF_SUCCESS) {
    kvf_scuda_ipc_event_close(slot->event);
    slot->event = NULL;
  }
  return st;
}

/* Run j's copy: enqueue (GPU) or perform (host) it, then record the proof. */
static void lane_run(dp_lane *lane, dp_job *j) {
  kvf_status st = KVF_SUCCESS;
  if (j->req.token_end > j->req.token_begin) {
    if (lane->device >= 0 && j->ready_kind == KVF_PROTO_READY_CUDA_EVENT) {
      st = wait_ready(lane, j);
      if (st == KVF_SUCCESS) j->queued = 1;
    }
    if (st == KVF_SUCCESS && j->inject_step == KVF_DP_FAIL_COPY) {
      /* As a launch that failed after part of the copy ran. */
      st = kvf_fail(KVF_ERR_CUDA, "injected copy failure");
      j->queued = 1;
    } else if (st == KVF_SUCCESS) {
      st = j->type == KVF_PROTO_STORE ? kvf_xfer_gather(j->b->xfer, &j->req, (kvf_stream)lane->stream)
                                       : kvf_xfer_scatter(j->b->xfer, &j->req, (kvf_stream)lane->stream);
      if (st == KVF_SUCCESS && kvf_log_enabled(KVF_LOG_TRACE, KVF_LOG_SERVER)) {
        kvf_xfer_path_info pi;
        kvf_xfer_last_path(j->b->xfer, &pi); /* this worker is the context's only caller */
        j->xfer_path = pi.path;
        j->xfer_us = pi.host_us;
      }
      /* A failed call enqueued nothing (kvf_xfer's contract), but a failed
       * launch may have: count it as queued. */
      if (st == KVF_SUCCESS || st == KVF_ERR_CUDA) j->queued = 1;
    }
    if (st != KVF_SUCCESS) job_fail(j, st, kvf_last_error());
  }
  if (lane->device >= 0 && j->queued) {
    kvf_status es = kvf_scuda_event_record(lane->device, lane->stream, &j->event);
    if (es != KVF_SUCCESS) {
      /* No event: prove completion by synchronizing this lane's stream. */
      KVF_WARN(SERVER, "%s; synchronizing lane %d's stream instead", kvf_last_error(), lane->device);
      (void)kvf_scuda_stream_sync(lane->device, lane->stream);
      j->event = NULL;
    }
  }
}

/* Wait for a push onto q (dp->mu held, released while waiting). A lane
 * thread pinned to a core of its own polls the queue for up to
 * KVF_SERVER_SPIN_US first: one request in flight hands off from the loop to
 * the worker and from the worker to the completion thread, and a futex wake
 * was tens of microseconds of the 0.16 ms a served 256-token request took
 * over the in-process call (perf/results/2026-11-29-h200x2-served/NOTES.md).
 * The condition variable after that, so an idle server sleeps. */
static void queue_wait(kvf_dataplane *dp, dp_queue *q, pthread_cond_t *cv, int pinned) {
  int64_t spin_us = pinned ? kvf_param_server_spin_us() : 0;
  if (spin_us > 0) {
    uint32_t seen = __atomic_load_n(&q->pushes, __ATOMIC_ACQUIRE);
    pthread_mutex_unlock(&dp->mu);
    uint64_t until = kvf_now_ns() + (uint64_t)spin_us * 1000ull;
    while (__atomic_load_n(&q->pushes, __ATOMIC_ACQUIRE) == seen && kvf_now_ns() < until) sched_yield();
    pthread_mutex_lock(&dp->mu);
    if (q->head || dp->stopping) return;
  }
  pthread_cond_wait(cv, &dp->mu);
}

/* A GPU lane's first request set up, on its way, the process's first
 * launches and copies, the lane stream's first work and its threads' CUDA
 * state: on an H200 the first STORE after a registration took 1.55x a
 * later one (1.251 ms against 0.807 for a 256-token chunk,
 * perf/results/2026-12-01-h200/served.md). The worker does that now, before
 * it serves (kvf_scuda_lane_warm; KVF_SERVER_WARMUP=0: not), off the loop:
 * requests admitted meanwhile wait in its queue. */
static void lane_warm(dp_lane *lane) {
  if (lane->device < 0) return;
  if (kvf_scuda_thread_bind(lane->device) != KVF_SUCCESS)
    KVF_INFO(SERVER, "lane %d: %s", lane->device, kvf_last_error());
  if (kvf_param_server_warmup() <= 0) return;
  uint64_t t0 = kvf_now_ns();
  kvf_status st = kvf_scuda_lane_warm(lane->device, lane->stream);
  if (st != KVF_SUCCESS)
    KVF_WARN(SERVER, "lane %d: warm-up failed (%s); its first request sets up what it needs", lane->device,
             kvf_last_error());
  else
    KVF_INFO(SERVER, "lane %d: warmed up in %.1f ms", lane->device, (double)(kvf_now_ns() - t0) / 1e6);
}

static void *lane_worker(void *arg) {
  dp_lane *lane = arg;
  kvf_dataplane *dp = lane->dp;
  pin_thread(lane->worker_cpu);
  lane_warm(lane);
  pthread_mutex_lock(&dp->mu);
  for (;;) {
    while (!lane->todo.head && !dp->stopping) queue_wait(dp, &lane->todo, &lane->todo_cv, lane->worker_cpu >= 0);
    dp_job *j = queue_pop(&lane->todo);
    if (!j) break; /* stopping and nothing left */
    int cancel = dp->stopping;
    pthread_mutex_unlock(&dp->mu);
    if (cancel) {
      /* Nothing of it was queued: release at once. */
      job_fail(j, KVF_ERR_STATE, "the server is stopping");
      job_answer(dp, j, KVF_OUTCOME_CANCELLED);
      job_retire(dp, j);
    } else {
      j->started_ns = kvf_now_ns();
      lane_run(lane, j);
      j->enqueued_ns = kvf_now_ns();
    }
    pthread_mutex_lock(&dp->mu);
    if (!cancel) {
      queue_push(&lane->flight, j);
      pthread_cond_signal(&lane->flight_cv);
    }
  }
  pthread_mutex_unlock(&dp->mu);
  return NULL;
}

static void sleep_us(long us) {
  struct timespec ts = {0, us * 1000L};
  nanosleep(&ts, NULL);
}

static void *lane_completer(void *arg) {
  dp_lane *lane = arg;
  kvf_dataplane *dp = lane->dp;
  pin_thread(lane->completion_cpu);
  /* Its short sleeps between event queries are the proof's latency: without
   * this, the default 50 us timer slack stretches each 20 us sleep to ~70. */
  (void)prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0);
  /* Its CUDA state set up now, not at the first event query. */
  if (lane->device >= 0 && kvf_scuda_thread_bind(lane->device) != KVF_SUCCESS)
    KVF_INFO(SERVER, "lane %d: %s", lane->device, kvf_last_error());
  pthread_mutex_lock(&dp->mu);
  for (;;) {
    while (!lane->flight.head && !(dp->stopping && !lane->worker_started))
      queue_wait(dp, &lane->flight, &lane->flight_cv, lane->completion_cpu >= 0);
    dp_job *j = queue_pop(&lane->flight);
    if (!j) break;
    pthread_mutex_unlock(&dp->mu);
    /* Jobs of one lane complete in stream order: wait for the head. */
    if (dp->opt.test_completion_delay_ms) {
      uint64_t until = kvf_now_ns() + (uint64_t)dp->opt.test_completion_delay_ms * 1000000ull;
      while (kvf_now_ns() < until) {
        if (!j->answered && kvf_now_ns() > j->deadline_ns) {
          job_fail(j, KVF_ERR_TIMEOUT, "the copy did not complete within the request timeout");
          job_answer(dp, j, KVF_OUTCOME_TIMED_OUT);
        }
        sleep_us(1000);
      }
    }
    if (j->inject_step == KVF_DP_FAIL_PROOF) job_fail(j, KVF_ERR_CUDA, "injected failure of the proof");
    if (j->event) {
      /* Poll without sleeping for the first 2 ms (a chunk's copy takes about
       * that long): the completion core is this lane's alone. */
      uint64_t spin_until = kvf_now_ns() + 2000000ull;
      for (;;) {
        kvf_status err;
        if (kvf_scuda_event_done(j->event, &err)) {
          if (err != KVF_SUCCESS) job_fail(j, err, kvf_last_error());
          j->proven_ns = kvf_now_ns();
          break;
        }
        if (!j->answered && kvf_now_ns() > j->deadline_ns) {
          /* Report, never release: the work may still touch the memory. */
          job_fail(j, KVF_ERR_TIMEOUT, "the copy did not complete within the request timeout");
          job_answer(dp, j, KVF_OUTCOME_TIMED_OUT);
        }
        if (kvf_now_ns() < spin_until)
          sched_yield();
        else
          sleep_us(20);
      }
    }
    job_retire(dp, j);
    pthread_mutex_lock(&dp->mu);
  }
  pthread_mutex_unlock(&dp->mu);
  return NULL;
}

/* A pool that is not pinned (the host lane without GPUs) is anonymous memory
 * the kernel maps on first touch: a STORE into fresh L1 then ran at the
 * page-fault rate (0.55-1.0 GB/s on a 2-core VM against 4-10 GB/s for a
 * memcpy of the same bytes, perf/results/2026-12-01-cpu-host), and the first
 * STOREs after a start were the slowest. Populating it here, before the first
 * request, costs about 0.36 s per GiB once (4 KiB pages: asking for huge
 * pages first made it 2.2 s, compaction) and holds the pool resident, as a
 * cache is once warm. KVF_SERVER_L1_PREFAULT_MB bounds it (0: never). */
static void prefault_pool(dp_lane *lane) {
  int64_t cap = kvf_param_server_l1_prefault_mb();
  if (cap <= 0) return;
  uint64_t bytes = lane->pool_bytes, max = (uint64_t)cap << 20;
  if (bytes > max) bytes = max;
#ifdef MADV_POPULATE_WRITE
  if (madvise(lane->pool, bytes, MADV_POPULATE_WRITE) == 0) return;
#endif
  for (uint64_t off = 0; off < bytes; off += 4096) ((volatile char *)lane->pool)[off] = 0;
}

/* The lane's pool from options.pool_alloc, placed and pinned; left NULL
 * (anonymous memory then) when a step fails. */
static void pool_take(kvf_dataplane *dp, dp_lane *lane) {
  void *base = NULL, *handle = NULL;
  kvf_status st = dp->opt.pool_alloc(dp->opt.pool_ctx, lane->device, lane->pool_bytes, &base, &handle);
  if (st == KVF_SUCCESS && ((uintptr_t)base & 4095u)) {
    dp->opt.pool_free(dp->opt.pool_ctx, handle);
    st = kvf_fail(KVF_ERR_SYSTEM, "the region is not page-aligned");
  } else if (st == KVF_SUCCESS) {
    st = kvf_scuda_pool_pin(lane->pin_device, lane->numa_node, base, lane->pool_bytes);
    if (st != KVF_SUCCESS) dp->opt.pool_free(dp->opt.pool_ctx, handle);
  }
  if (st != KVF_SUCCESS) {
    KVF_WARN(SERVER, "lane %d: L1 pool from options.pool_alloc: %s; anonymous memory instead", lane->device,
             kvf_last_error());
    return;
  }
  lane->pool = base;
  lane->pool_given = 1;
  lane->pool_handle = handle;
}

static kvf_status lane_start(kvf_dataplane *dp, dp_lane *lane, int device) {
  lane->dp = dp;
  lane->device = device;
  lane->numa_node = -1;
  lane->worker_cpu = lane->completion_cpu = -1;
  if (device >= 0 && dp->opt.topology) {
    kvf_gpu_placement p = KVF_GPU_PLACEMENT_INIT;
    if (kvf_topology_gpu(dp->opt.topology, (uint32_t)device, &p) == KVF_SUCCESS) {
      lane->numa_node = p.numa_node;
      lane->worker_cpu = p.worker_cpu;
      lane->completion_cpu = p.completion_cpu;
    }
  }
  kvf_status st;
  if (device >= 0) {
    st = kvf_scuda_stream_create(device, &lane->stream);
    if (st != KVF_SUCCESS) return st;
  }
  lane->pool_bytes = device < 0 && dp->opt.num_devices ? dp->opt.host_l1_bytes : dp->opt.l1_bytes;
  /* The host lane's pool is pinned too when GPUs are served: GPU lanes read
   * objects a host engine stored (lookups span every pool), and a kernel
   * cannot reach pageable memory. */
  lane->pin_device = device >= 0 ? device : (dp->opt.num_devices ? dp->first_device : -1);
  if (dp->opt.pool_alloc) pool_take(dp, lane);
  if (!lane->pool) {
    st = kvf_scuda_pool_alloc(lane->pin_device, lane->numa_node, lane->pool_bytes, &lane->pool);
    if (st != KVF_SUCCESS) return st;
  }
  if (lane->pin_device < 0) prefault_pool(lane);
  KVF_INFO(SERVER, "lane %d: %llu MiB of L1 on NUMA node %d, worker on cpu %d, completion on cpu %d", device,
           (unsigned long long)(lane->pool_bytes >> 20), lane->numa_node, lane->worker_cpu, lane->completion_cpu);
  return KVF_SUCCESS;
}

static kvf_status lane_threads(dp_lane *lane) {
  int rc = pthread_create(&lane->worker, NULL, lane_worker, lane);
  if (rc != 0) return kvf_fail(KVF_ERR_SYSTEM, "lane %d: worker thread: %s", lane->device, strerror(rc));
  lane->worker_started = 1;
  rc = pthread_create(&lane->completer, NULL, lane_completer, lane);
  if (rc != 0) return kvf_fail(KVF_ERR_SYSTEM, "lane %d: completion thread: %s", lane->device, strerror(rc));
  lane->completer_started = 1;
  return KVF_SUCCESS;
}

kvf_status kvf_dataplane_create(const kvf_dataplane_options *opt, kvf_dataplane **out) {
  if (!opt || !out || !opt->registry || !opt->reply || (opt->pool_alloc && !opt->pool_free))
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_dataplane_create: NULL argument");
  *out = NULL;
  if (opt->num_devices + 1 > DP_MAX_LANES)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "options.devices: at most %u devices", DP_MAX_LANES - 1);
  int visible = opt->num_devices ? kvf_scuda_device_count() : 0;
  for (uint32_t i = 0; i < opt->num_devices; i++) {
    if (opt->devices[i] < 0 || opt->devices[i] >= visible)
      return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "options.devices[%u]: %d is not a visible CUDA device (%d visible)",
                      (unsigned)i, opt->devices[i], visible);
    for (uint32_t k = 0; k < i; k++)
      if (opt->devices[k] == opt->devices[i])
        return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "options.devices[%u]: %d is repeated", (unsigned)i, opt->devices[i]);
  }
  kvf_dataplane *dp = calloc(1, sizeof(*dp));
  if (!dp) return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "kvf_dataplane_create: out of memory");
  dp->opt = *opt;
  dp->first_device = opt->num_devices ? opt->devices[0] : -1;
  dp->opt.devices = NULL;
  dp->registry = opt->registry;
  if (!dp->opt.l1_bytes) dp->opt.l1_bytes = 1ull << 30;
  dp->opt.l1_bytes = (dp->opt.l1_bytes + 4095) & ~4095ull;
  if (!dp->opt.host_l1_bytes) dp->opt.host_l1_bytes = 256ull << 20;
  dp->opt.host_l1_bytes = (dp->opt.host_l1_bytes + 4095) & ~4095ull;
  if (!dp->opt.job_timeout_ms) dp->opt.job_timeout_ms = 60000;
  kvf_status st;
  if (pthread_mutex_init(&dp->mu, NULL) != 0) {
    free(dp);
    return kvf_fail(KVF_ERR_SYSTEM, "kvf_dataplane_create: mutex");
  }
  dp->mu_init = 1;
  dp->num_lanes = opt->num_devices + 1;
  for (uint32_t i = 0; i < dp->num_lanes; i++) {
    pthread_cond_init(&dp->lanes[i].todo_cv, NULL);
    pthread_cond_init(&dp->lanes[i].flight_cv, NULL);
  }
  dp->cv_init = 1;
  kvf_l1_pool_desc pools[DP_MAX_LANES];
  for (uint32_t i = 0; i < dp->num_lanes; i++) {
    int device = i == 0 ? -1 : opt->devices[i - 1];
    st = lane_start(dp, &dp->lanes[i], device);
    if (st != KVF_SUCCESS) goto fail;
    pools[i] = (kvf_l1_pool_desc){device, dp->lanes[i].pool, dp->lanes[i].pool_bytes};
  }
  st = kvf_l1_create(pools, dp->num_lanes, &dp->l1);
  if (st != KVF_SUCCESS) goto fail;
  for (uint32_t i = 0; i < dp->num_lanes; i++) {
    st = lane_threads(&dp->lanes[i]);
    if (st != KVF_SUCCESS) goto fail;
  }
  *out = dp;
  return KVF_SUCCESS;
fail:
  kvf_dataplane_destroy(dp);
  return st;
}

void kvf_dataplane_destroy(kvf_dataplane *dp) {
  if (!dp) return;
  pthread_mutex_lock(&dp->mu);
  dp->stopping = 1;
  for (uint32_t i = 0; i < dp->num_lanes; i++) pthread_cond_broadcast(&dp->lanes[i].todo_cv);
  pthread_mutex_unlock(&dp->mu);
  for (uint32_t i = 0; i < dp->num_lanes; i++) {
    dp_lane *lane = &dp->lanes[i];
    if (lane->worker_started) {
      pthread_join(lane->worker, NULL);
      pthread_mutex_lock(&dp->mu);
      lane->worker_started = 0; /* lets the completion thread leave once its queue is empty */
      pthread_cond_broadcast(&lane->flight_cv);
      pthread_mutex_unlock(&dp->mu);
    }
    if (lane->completer_started) pthread_join(lane->completer, NULL);
    lane->completer_started = 0;
  }
  if (dp->all) KVF_WARN(SERVER, "data plane: requests left unretired at destroy");
  kvf_l1_destroy(dp->l1);
  for (uint32_t i = 0; i < dp->num_lanes; i++) {
    dp_lane *lane = &dp->lanes[i];
    if (lane->pool_given) {
      kvf_scuda_pool_unpin(lane->pin_device, lane->pool);
      dp->opt.pool_free(dp->opt.pool_ctx, lane->pool_handle);
    } else {
      kvf_scuda_pool_free(lane->pin_device, lane->pool, lane->pool_bytes);
    }
    kvf_scuda_stream_destroy(lane->device, lane->stream);
    if (dp->cv_init) {
      pthread_cond_destroy(&lane->todo_cv);
      pthread_cond_destroy(&lane->flight_cv);
    }
  }
  if (dp->mu_init) pthread_mutex_destroy(&dp->mu);
  free(dp);
}

kvf_status kvf_dataplane_stats_get(kvf_dataplane *dp, kvf_dataplane_stats *out) {
  if (!dp || !out) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_dataplane_stats_get: NULL argument");
  pthread_mutex_lock(&dp->mu);
  *out = dp->counters;
  pthread_mutex_unlock(&dp->mu);
  out->lanes = dp->num_lanes;
  return kvf_l1_stats_get(dp->l1, KVF_L1_ALL_POOLS, &out->l1);
}

kvf_l1 *kvf_dataplane_l1(kvf_dataplane *dp) { return dp ? dp->l1 : NULL; }

uint32_t kvf_dataplane_pools(kvf_dataplane *dp, kvf_l1_pool_desc *out, uint32_t max) {
  for (uint32_t i = 0; i < dp->num_lanes && i < max; i++)
    out[i] = (kvf_l1_pool_desc){dp->lanes[i].device, dp->lanes[i].pool, dp->lanes[i].pool_bytes};
  return dp->num_lanes;
}

/* The objects of chunks [0 .. nchunks) of a checked range, for the object
 * groups og_requested marks: every one (only_missing 0) or those L1 does not
 * hold with that token range (1). chunk_of (may be NULL) gets each spec's
 * chunk index. */
static kvf_status object_specs(kvf_dataplane *dp, kvf_dp_binding *b, uint32_t format, uint64_t token_begin,
                               uint64_t token_end, const kvf_chunk_key *keys, uint64_t nchunks,
                               const int *og_requested, int only_missing, kvf_l1_object_spec **specs,
                               uint32_t **chunk_of, uint32_t *n, int *device) {
  const kvf_geometry *g = b->geometry;
  uint32_t nog = b->num_object_groups, C = b->chunk_tokens;
  uint64_t total = nchunks * nog;
  *device = b->lane->device;
  kvf_status st = KVF_SUCCESS;
  kvf_l1_query *q = calloc(total ? total : 1, sizeof(*q));
  kvf_l1_found *found = calloc(total ? total : 1, sizeof(*found));
  kvf_l1_object_spec *out = calloc(total ? total : 1, sizeof(*out));
  uint32_t *chunk = chunk_of ? calloc(total ? total : 1, sizeof(*chunk)) : NULL;
  kvf_l1_pin *pin = NULL;
  if (!q || !found || !out || (chunk_of && !chunk)) {
    st = kvf_fail(KVF_ERR_OUT_OF_MEMORY, "lookup: out of memory");
    goto done;
  }
  if (only_missing) {
    for (uint64_t k = 0; k < nchunks; k++)
      for (uint32_t og = 0; og < nog; og++) q[k * nog + og] = (kvf_l1_query){l1_key(b, &keys[k]), og};
    st = kvf_l1_lookup_pin(dp->l1, q, (uint32_t)total, found, &pin);
    if (st != KVF_SUCCESS) goto done;
  }
  uint32_t cnt = 0;
  for (uint64_t k = 0; k < nchunks; k++)
    for (uint32_t og = 0; og < nog; og++) {
      if (!og_requested[og]) continue;
      kvf_object_header want;
      if (kvf_object_header_init(g, (kvf_object_format)format, og, token_begin / C + k, token_end, &want) !=
          KVF_SUCCESS)
        continue;
      if (want.payload_bytes == 0) continue; /* no object for it */
      const kvf_l1_found *f = &found[k * nog + og];
      if (only_missing && f->found && f->header.token_begin == want.token_begin &&
          f->header.token_end == want.token_end)
        continue;
      if (chunk) chunk[cnt] = (uint32_t)k;
      out[cnt++] = (kvf_l1_object_spec){l1_key(b, &keys[k]), og, want};
    }
  if (cnt) {
    *specs = out;
    *n = cnt;
    out = NULL;
    if (chunk_of) {
      *chunk_of = chunk;
      chunk = NULL;
    }
  }
done:
  kvf_l1_unpin(dp->l1, pin);
  free(q);
  free(found);
  free(out);
  free(chunk);
  return st;
}

kvf_status kvf_dataplane_retrieve_missing(kvf_dataplane *dp, kvf_dp_binding *b, const kvf_proto_msg *m,
                                          kvf_l1_object_spec **specs, uint32_t *n, int *device) {
  *specs = NULL;
  *n = 0;
  *device = -1;
  if (!dp || !b || !m || m->type != KVF_PROTO_RETRIEVE)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_dataplane_retrieve_missing: not a RETRIEVE");
  kvf_status st = check_xfer(b, m);
  if (st != KVF_SUCCESS) return st;
  const kvf_proto_xfer *x = &m->u.xfer;
  /* Object groups with a group the request moves. */
  int og_requested[KVF_MAX_GROUPS] = {0};
  for (uint32_t og = 0; og < b->num_object_groups; og++) {
    kvf_object_group_info oi = KVF_OBJECT_GROUP_INFO_INIT;
    (void)kvf_geometry_object_group(b->geometry, og, &oi);
    for (uint32_t i = 0; i < oi.num_groups; i++) og_requested[og] |= x->groups[oi.groups[i]].count > 0;
  }
  return object_specs(dp, b, x->format, x->token_begin, x->token_end, x->chunk_keys, x->num_chunk_keys,
                      og_requested, 1, specs, NULL, n, device);
}

kvf_status kvf_dataplane_lookup_missing(kvf_dataplane *dp, kvf_dp_binding *b, const kvf_proto_lookup *q,
                                        kvf_l1_object_spec **specs, uint32_t *n, int *device) {
  *specs = NULL;
  *n = 0;
  *device = -1;
  if (!dp || !q) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_dataplane_lookup_missing: NULL argument");
  if (!b) return kvf_fail(KVF_ERR_STATE, "payload.registration_id: this client has no registration");
  kvf_status st = check_range(b, q->registration_id, q->format, q->token_begin, q->token_end, q->num_chunk_keys);
  if (st != KVF_SUCCESS) return st;
  int all[KVF_MAX_GROUPS];
  for (uint32_t og = 0; og < KVF_MAX_GROUPS; og++) all[og] = 1;
  return object_specs(dp, b, q->format, q->token_begin, q->token_end, q->chunk_keys, q->num_chunk_keys, all, 1,
                      specs, NULL, n, device);
}

kvf_status kvf_dataplane_push_specs(kvf_dataplane *dp, kvf_dp_binding *b, const kvf_proto_push *q,
                                    kvf_l1_object_spec **specs, uint32_t **chunk_of, uint32_t *n) {
  *specs = NULL;
  *chunk_of = NULL;
  *n = 0;
  if (!dp || !q) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_dataplane_push_specs: NULL argument");
  if (!b) return kvf_fail(KVF_ERR_STATE, "payload.registration_id: this client has no registration");
  kvf_status st = check_range(b, q->registration_id, q->format, q->token_begin, q->token_end, q->num_chunk_keys);
  if (st != KVF_SUCCESS) return st;
  int all[KVF_MAX_GROUPS];
  for (uint32_t og = 0; og < KVF_MAX_GROUPS; og++) all[og] = 1;
  int device;
  return object_specs(dp, b, q->format, q->token_begin, q->token_end, q->chunk_keys, q->num_chunk_keys, all, 0,
                      specs, chunk_of, n, &device);
}
