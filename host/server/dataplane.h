/*
 * Internal: the server's data path (DESIGN.md §2, §8): STORE and RETRIEVE
 * between registered KV caches and the L1 object store (host/l1.h).
 *
 * A data plane has one *lane* per CUDA device it serves plus one for the
 * host backend. A lane owns an L1 pool (pinned host memory on the GPU's NUMA
 * node; plain memory for the host lane), a stream, a worker thread and a
 * completion thread, both pinned to cores local to the GPU (kvferry/
 * topology.h).
 *
 * A request goes through four steps:
 *   1. admission (kvf_dataplane_submit, on the caller's thread: the server's
 *      event loop): every field checked against the registered geometry,
 *      a lease taken on the registration, L1 objects reserved (STORE) or
 *      looked up and pinned (RETRIEVE), the copy request built. A refusal
 *      here releases everything at once and returns the status: the caller
 *      answers with an ERROR naming the field;
 *   2. the lane's worker makes its stream wait for the engine's ready event
 *      (STORE on a GPU), enqueues the gather or scatter (host lane: runs it)
 *      and records a completion event;
 *   3. the lane's completion thread waits for that event. If the request's
 *      timeout passes first, the outcome "timed out" is reported at once, but
 *      nothing is released;
 *   4. retirement, only once the event has completed (or the stream was
 *      synchronized when no event could be recorded): a STORE's reservation is
 *      committed (done) or aborted (failed, timed out), a RETRIEVE's pins
 *      dropped, the lease released, the outcome recorded in the registry's
 *      completion table and the reply handed to the reply callback (unless the
 *      timeout already answered: then a RETIRED notice is handed to it
 *      instead, once everything is released).
 * A request refused before anything was queued releases at once; one whose
 * work may have been queued waits for proof. Retried request ids are answered
 * from the completion table; a retry of a request still in flight is
 * ignored (its reply answers both).
 *
 * Threading: submit is called from one thread (the server's loop); bind
 * and unbind from any thread (bind reads only the lanes fixed at create and
 * builds a context of its own; bindings are reference counted, and the last
 * unbind may come from a completion thread); the reply callback runs on
 * completion threads and on the submitting thread; stats from any thread.
 */
#ifndef KVF_HOST_DATAPLANE_H
#define KVF_HOST_DATAPLANE_H

#include <stdint.h>

#include <kvferry/geometry.h>
#include <kvferry/status.h>
#include <kvferry/topology.h>

#include "host/server/l1.h"
#include "host/ipc/protocol.h"
#include "host/server/registry.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvf_dataplane kvf_dataplane;
/* A registration's geometry and transfer context on its lane; shared by the
 * connection and the requests in flight (reference counted). */
typedef struct kvf_dp_binding kvf_dp_binding;

/* Deliver `reply` (a STORE_REPLY, RETRIEVE_REPLY or RETIRED notice,
 * borrowed for the call) to client_id. Called from completion threads and
 * from submit, sometimes with the data plane's lock held: it must not call
 * back into the data plane. */
typedef void (*kvf_dp_reply_fn)(void *ctx, uint64_t client_id, const kvf_proto_msg *reply);

typedef struct kvf_dataplane_options {
  kvf_registry *registry;    /* leases and completions; required */
  const int *devices;        /* CUDA devices to serve (lanes); NULL/0: none (host lane only) */
  uint32_t num_devices;
  uint64_t l1_bytes;         /* L1 pool per GPU lane (and the host lane without GPUs); 0: 1 GiB */
  uint64_t host_l1_bytes;    /* the host lane's pool when GPUs are served (it is pinned then);
                                0: 256 MiB */
  uint32_t job_timeout_ms;   /* report "timed out" after this; 0: 60000 */
  const kvf_topology *topology; /* placement of GPU lanes; NULL: unpinned threads, any NUMA node */
  kvf_dp_reply_fn reply;     /* required */
  void *reply_ctx;
  /* Where the lanes' L1 pools come from (kvferryd with KVF_PEER_SHM=1: the
   * peer transport, whose own memory a peer on this host can map). NULL:
   * anonymous memory. pool_alloc gives a page-aligned, untouched region of
   * `bytes` for lane `device` (-1: the host lane) and a handle; the data
   * plane places, pins and prefaults it as it does its own, and hands the
   * handle to pool_free at destroy (after unpinning; also when create fails
   * later). A lane whose pool_alloc fails, or whose memory does not pin,
   * warns and takes anonymous memory. Both are called on the thread that
   * calls create and destroy. */
  kvf_status (*pool_alloc)(void *ctx, int device, uint64_t bytes, void **base, void **handle);
  void (*pool_free)(void *ctx, void *handle);
  void *pool_ctx;
  /* Tests only: fail every request at one step (kvf_dp_fail_step), and hold
   * each completion back this long before it is proven (a slow GPU). */
  uint32_t test_fail_step;
  uint16_t test_fail_type; /* only requests of this type fail (KVF_PROTO_STORE / RETRIEVE); 0: both */
  uint32_t test_completion_delay_ms;
} kvf_dataplane_options;

/* Where test_fail_step makes a request fail. */
typedef enum kvf_dp_fail_step {
  KVF_DP_FAIL_NONE = 0,
  KVF_DP_FAIL_LEASED = 1,   /* admission, after the lease was taken */
  KVF_DP_FAIL_RESERVED = 2, /* admission, after L1 was reserved or pinned */
  KVF_DP_FAIL_COPY = 3,     /* the lane's worker: the copy fails */
  KVF_DP_FAIL_PROOF = 4,    /* the completion thread: the proof reports an error */
} kvf_dp_fail_step;

/* Create the lanes (pools, streams, threads). Returns KVF_SUCCESS;
 * KVF_ERR_INVALID_ARGUMENT (options.devices[i] repeated or not a device);
 * KVF_ERR_OUT_OF_MEMORY; KVF_ERR_CUDA; KVF_ERR_SYSTEM. Nothing is left
 * behind on failure. */
kvf_status kvf_dataplane_create(const kvf_dataplane_options *options, kvf_dataplane **out);

/* Stop: requests not started are cancelled (released at once, answered
 * "cancelled"), requests in flight are waited for (their events), then the
 * threads, streams and pools go. Bindings still held by the caller must be
 * unbound first. NULL is a no-op. */
void kvf_dataplane_destroy(kvf_dataplane *dp);

/* Bind a registration: `geometry` (ownership moves to the binding, also on
 * failure) registered with registration_id for an engine on `device` (-1:
 * host), as shard shard_index of shard_count (checked by the decoder). Its
 * requests file and find L1 objects under (chunk key, object group, the
 * geometry's canonical fingerprint, shard_index, shard_count). Returns KVF_SUCCESS and *out; KVF_ERR_INVALID_ARGUMENT naming
 * payload.device when no lane serves it; kvf_xfer_create's statuses. */
kvf_status kvf_dataplane_bind(kvf_dataplane *dp, kvf_geometry *geometry, int device, uint64_t registration_id,
                              uint32_t shard_index, uint32_t shard_count, kvf_dp_binding **out);

/* Get a binding ready for its first request once its registration is
 * active (its memory mapped): the engine's region bases are classified now
 * (kvf_xfer_prepare_regions) rather than by the first STORE. Takes a lease
 * on client_id's live registration for the while, and does nothing when
 * that is not binding's (closed or replaced meanwhile) or binding is on the
 * host lane. Registration worker thread, before the binding is handed to
 * the loop; never fails (what it could not prepare, the first request
 * does, or refuses naming the field). */
void kvf_dataplane_prepare(kvf_dp_binding *binding, uint64_t client_id);

/* Drop the caller's reference (requests in flight keep theirs). NULL is a
 * no-op. */
void kvf_dataplane_unbind(kvf_dp_binding *binding);

/* The binding's geometry and registration id. */
const kvf_geometry *kvf_dp_binding_geometry(const kvf_dp_binding *binding);
uint64_t kvf_dp_binding_registration(const kvf_dp_binding *binding);

/* Admit a STORE or RETRIEVE (msg->type) of client_id on `binding` (NULL:
 * the client has no registration). Returns KVF_SUCCESS when the request was
 * queued or answered (the reply callback answers it); otherwise the request
 * was refused, nothing was written anywhere and nothing is held, and
 * kvf_last_error() names the field: the caller answers with an ERROR. */
kvf_status kvf_dataplane_submit(kvf_dataplane *dp, kvf_dp_binding *binding, uint64_t client_id,
                                const kvf_proto_msg *msg);

/* What a LOOKUP found. */
typedef struct kvf_dp_lookup_result {
  uint64_t prefix_tokens;               /* what a RETRIEVE of the range restores in every object group */
  uint32_t num_object_groups;
  uint64_t og_prefix[KVF_MAX_GROUPS];   /* how far each object group alone reaches (token_begin: a miss) */
  uint32_t pinned_chunks;               /* chunks with an object pinned by *pin */
} kvf_dp_lookup_result;

/* LOOKUP on `binding` (NULL: the client has no registration): how far the
 * prefix that q's chunk keys name reaches in each object group, by the very
 * rule a RETRIEVE admission uses (every group of the geometry taking part),
 * moving nothing and taking no lease. With `pin` (NULL: no pin), the objects
 * a RETRIEVE of the same range would read for that prefix are pinned (never
 * evicted) through *pin, until kvf_dataplane_unpin; *pin is NULL when
 * nothing was found. Runs on the caller's thread (the loop), bounded by
 * q->num_chunk_keys x object groups L1 lookups. Returns KVF_SUCCESS;
 * otherwise nothing is held and kvf_last_error() names the field
 * (KVF_ERR_STATE, KVF_ERR_INVALID_ARGUMENT, KVF_ERR_GEOMETRY_MISMATCH,
 * KVF_ERR_OUT_OF_MEMORY). */
kvf_status kvf_dataplane_lookup(kvf_dataplane *dp, kvf_dp_binding *binding, const kvf_proto_lookup *q,
                                kvf_dp_lookup_result *out, kvf_l1_pin **pin);

/* Release a LOOKUP's pin. NULL is a no-op. Any thread. */
void kvf_dataplane_unpin(kvf_dataplane *dp, kvf_l1_pin *pin);

/* For peers (host/server/peers.h): the L1 store, and its pools (up to max
 * into out; returns how many there are). */
kvf_l1 *kvf_dataplane_l1(kvf_dataplane *dp);
uint32_t kvf_dataplane_pools(kvf_dataplane *dp, kvf_l1_pool_desc *out, uint32_t max);

/* The objects a RETRIEVE (msg) on `binding` would read that L1 does not hold
 * now (absent, or held with another token range), for every requested object
 * group: *specs (malloc'd, the caller frees; NULL when none) and *n, and
 * *device, the pool the binding's lane reserves in. Changes nothing (the pins
 * of the lookup are dropped at once). KVF_SUCCESS, also when nothing is
 * missing; otherwise the request is one kvf_dataplane_submit refuses. Loop
 * thread, as submit. */
kvf_status kvf_dataplane_retrieve_missing(kvf_dataplane *dp, kvf_dp_binding *binding, const kvf_proto_msg *msg,
                                          kvf_l1_object_spec **specs, uint32_t *n, int *device);

/* As kvf_dataplane_retrieve_missing, for a LOOKUP: every object group. */
kvf_status kvf_dataplane_lookup_missing(kvf_dataplane *dp, kvf_dp_binding *binding, const kvf_proto_lookup *q,
                                        kvf_l1_object_spec **specs, uint32_t *n, int *device);

/* The objects a PUSH names (every object group of every chunk of its range,
 * held here or not), with each one's chunk index in *chunk_of (malloc'd;
 * both NULL when the range has no object). KVF_SUCCESS; otherwise a
 * refusal naming the field (registration, range). Loop thread. */
kvf_status kvf_dataplane_push_specs(kvf_dataplane *dp, kvf_dp_binding *binding, const kvf_proto_push *q,
                                    kvf_l1_object_spec **specs, uint32_t **chunk_of, uint32_t *n);

/* Counters of the data plane. */
typedef struct kvf_dataplane_stats {
  kvf_l1_stats l1;
  uint64_t stores_total, retrieves_total; /* admitted */
  uint64_t done_total, failed_total, cancelled_total, timed_out_total;
  uint64_t in_flight; /* admitted, not retired */
  uint32_t lanes;     /* including the host lane */
} kvf_dataplane_stats;

kvf_status kvf_dataplane_stats_get(kvf_dataplane *dp, kvf_dataplane_stats *out);

#ifdef __cplusplus
}
#endif

#endif /* KVF_HOST_DATAPLANE_H */
