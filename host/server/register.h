/*
 * Internal: kvferryd's REGISTER path, off the event loop (DESIGN.md §8-9).
 *
 * A REGISTER costs what its sender makes it cost: the geometry JSON is
 * parsed and validated (kvf_geometry_finalize, bounded by its overlap
 * budget), every descriptor is looked at, every new allocation imported,
 * mapped and given access, and a transfer context is built for the lane
 * (kvf_dataplane_bind). None of that runs on the event-loop thread: the loop
 * hands the decoded frame and its descriptors to this worker
 * (kvf_register_submit) and stops reading that connection's frames (so its
 * requests stay in order) while it keeps serving everyone else. The worker
 * does the work, encodes the reply (REGISTER_REPLY, or an ERROR naming the
 * field) and hands the request back through `done`, which the server posts
 * to its outbox and wakes the loop with; the loop swaps the connection's
 * binding, queues the reply and reads the connection again.
 *
 * One worker thread at a time: registrations are serialized (the import
 * table holds its lock through a registration anyway), in the order they
 * were submitted, one per connection at a time. The thread is started when
 * a request arrives and there is none, and exits when the queue is empty:
 * an idle server holds no registration thread.
 *
 * Threading: submit from any thread (the loop); `done` runs on the worker;
 * create/destroy must not race other calls. Everything the worker calls is
 * safe off the loop: the registry and the import table lock internally,
 * kvf_dataplane_bind reads only what the data plane fixed at create, and
 * bindings are reference counted.
 */
#ifndef KVF_HOST_REGISTER_H
#define KVF_HOST_REGISTER_H

#include <stdint.h>
#include <sys/types.h>

#include <kvferry/status.h>

#include "host/ipc/protocol.h"
#include "host/server/dataplane.h"
#include "host/server/registry.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvf_register_worker kvf_register_worker;

/* One REGISTER on its way through the worker and back. */
typedef struct kvf_register_req {
  struct kvf_register_req *next;
  /* In: set by the loop. */
  uint64_t client_id;
  uint64_t request_id;
  pid_t peer_pid;                 /* SO_PEERCRED of the connection */
  kvf_proto_register reg;         /* owned: geometry_json and regions (kvf_proto_msg_clear's) */
  int fds[KVF_PROTO_MAX_FDS];     /* owned: closed by the worker or kvf_register_req_free */
  uint32_t num_fds;
  /* Out: set by the worker. */
  kvf_status status;              /* KVF_SUCCESS: registered */
  uint64_t registration_id;       /* on success */
  kvf_dp_binding *binding;        /* on success: the new registration's binding (owned) */
  uint8_t *frame;                 /* the encoded reply (owned); NULL if it could not be encoded */
  size_t frame_len;
} kvf_register_req;

typedef struct kvf_register_options {
  kvf_registry *registry;
  kvf_dataplane *dp;
  uint32_t max_client_registrations; /* live + draining per client, the new one included; 0: no limit */
  /* Called on the worker thread with each request it finished; ownership
   * moves to the callee. */
  void (*done)(void *ctx, kvf_register_req *req);
  void *done_ctx;
} kvf_register_options;

/* Create the worker (its thread starts with the first request). Returns
 * KVF_SUCCESS; KVF_ERR_INVALID_ARGUMENT; KVF_ERR_OUT_OF_MEMORY;
 * KVF_ERR_SYSTEM. */
kvf_status kvf_register_worker_create(const kvf_register_options *options, kvf_register_worker **out);

/* Queue `req` (ownership moves). Never blocks on the work (it may wait for
 * a finished thread to exit). If no thread can be started, `req` is
 * answered at once with an ERROR through `done`, on the caller's thread. */
void kvf_register_submit(kvf_register_worker *w, kvf_register_req *req);

/* Stop the worker: the request in progress finishes (and goes to `done`),
 * requests still queued are freed unanswered. NULL is a no-op. */
void kvf_register_worker_destroy(kvf_register_worker *w);

/* Free a request: its descriptors are closed, its binding unbound, its
 * frame and fields freed. NULL is a no-op. */
void kvf_register_req_free(kvf_register_req *req);

#ifdef __cplusplus
}
#endif

#endif /* KVF_HOST_REGISTER_H */
