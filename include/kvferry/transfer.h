/*
 * kvferry/transfer.h - gather (cache -> objects) and scatter (objects ->
 * cache) of a copy request (kvferry/copy.h), on a GPU or on the host.
 *
 * A transfer context binds a finalized geometry to a backend:
 *   - a CUDA device: one kernel launch per call (per batch of chunks on the
 *     staged route below) moves every layer, plane and group of the request.
 *     Caches and objects may be device memory of that GPU, a peer GPU's
 *     memory (peer access enabled by the caller), pinned host memory
 *     (cudaHostAlloc / cudaHostRegister; reached through UVA), or memory
 *     imported from another process and mapped on this device. Pageable
 *     host memory is refused with a clear error. A context remembers the
 *     region bases it found in device memory (this GPU's or a peer's) and
 *     does not query them again while the same pointers come back (a cache
 *     freed and allocated again at the same address on another GPU needs a
 *     new context); host memory is queried on every call.
 *   - the host backend: the same request copied by CPU threads.
 *
 * Stream rules (CUDA backend): work is enqueued on the caller's stream, which
 * is the last argument; nothing synchronizes the device or the stream. The
 * call reads the request's host arrays (block ids, object pointers) before it
 * returns: the caller may reuse them at once. Block ids are validated on the
 * host before anything is enqueued, so a bad id is a clear error and never an
 * out-of-bounds access. Calls may be captured into a CUDA graph; a captured
 * call keeps its own copy of the request's tables until the context is
 * destroyed. The legacy default stream (NULL) is accepted. On compute
 * capability 9.0 and later a device-to-device or peer call's kernel that
 * may use every SM is a programmatic dependent launch (KVF_XFER_OVERLAP,
 * docs/design.md): it may start while the stream's previous kernel drains,
 * and touches no memory until that kernel has completed. It also lets the
 * stream's next kernel start early when that one was itself launched as a
 * programmatic dependent: such a kernel must wait as CUDA requires
 * (cudaGridDependencySynchronize or griddepcontrol.wait) before it reads what
 * the call writes. Kernels launched without that attribute, events, copies
 * and graph nodes after the call start after all of its work, as with every
 * other route. KVF_XFER_OVERLAP=0 turns both sides off.
 *
 * Routes (CUDA backend): device<->device and peer calls, host-to-host calls
 * and captured calls are one kernel launch (its tables in the kernel's
 * parameters when they fit, else uploaded first). Between a cache on the GPU
 * and objects in pinned host memory the copy engine moves the PCIe leg:
 * with its batch API (cudaMemcpyBatchAsync on the caller's stream, no
 * kernel) when the request is a few long contiguous runs, else staged: the
 * kernel gathers into (scatters from) two device staging buffers in batches
 * of whole chunks, each batch in pieces of whole layers, and the copy engine
 * drains (fills) them on an internal stream forked from the caller's stream
 * and joined back into it (KVF_XFER_STAGING_MB=0: one direct launch
 * instead). Where a gather's first layers (a scatter's last) are long runs
 * of whole blocks, the copy engine moves those itself, straight between the
 * cache and the objects (KVF_XFER_STAGE_STRAIGHT_KB), on the caller's
 * stream, and the kernels run on the internal one. The legacy default
 * stream and captured calls never take the batch API.
 *
 * Failures (CUDA backend): a call checks and reserves everything it needs
 * before its first enqueue: the request, the memory kind of every pointer,
 * its tables (a slot of the context's ring, waited for while an earlier call
 * still reads it) and the staging buffers. A failure there (any status but
 * KVF_ERR_CUDA, or KVF_ERR_CUDA from a query, an allocation or that wait)
 * enqueues nothing but, at most, an event of the context's own that
 * neither copies nor waits (KVF_XFER_BATCH_HOST_BOUND's mark). After the
 * first enqueue, the only failure is the CUDA runtime refusing an enqueue
 * (a launch, a copy, an event record or wait), which cannot be checked
 * ahead. The call then returns KVF_ERR_CUDA, kvf_last_error() says how far
 * it got, and what was enqueued stays and will run:
 *   - one-launch routes: with tables in kernel parameters, nothing; with
 *     uploaded tables, the upload, which writes nothing of the caller's;
 *     the kernel too only when the launch was accepted and recording the
 *     call's event after it was refused.
 *   - the copy engine's batch route: its copies may have been enqueued in
 *     part; the request's objects (gather) or blocks (scatter) are
 *     unspecified until the stream's work completes, and nothing else was
 *     enqueued.
 *   - staged calls: when batch k of n is refused (the message names it and
 *     its chunks; a refused upload of the call's tables is said so and
 *     counts as k = 0; a batch's pieces count as the batch, and so does a
 *     gather's straight part with its first batch, a scatter's with its
 *     last), batches 0..k-1 were enqueued whole and will complete,
 *     writing their objects (gather) or blocks (scatter) exactly as a
 *     successful call does; batch k's objects or blocks are unspecified;
 *     nothing after batch k was enqueued, so later chunks' objects or blocks
 *     keep their bytes, as do a gather's objects written only in part
 *     (those move in one direct launch after the last batch; when that
 *     launch is the one refused, every batch completes and they keep their
 *     bytes).
 * Either way a staged call's internal stream is joined back into the
 * caller's stream before the call returns (a successful gather with a
 * straight part and no direct launch needs no join: the caller's stream
 * already waits for the internal stream's last work), and the context's tables and
 * staging buffers are released in stream order: work enqueued on the stream
 * after the call runs after all of the call's work (an event recorded there
 * covers it), and the context stays usable. As after a success, sources and
 * destinations must stay valid until that work completes. (Should even the
 * join be refused, which only a broken CUDA context does, the call waits for
 * its internal stream instead.)
 *
 * Aliasing: objects must not overlap each other, or the cache views the
 * request moves. Destinations must not be read or written by other work until
 * the call's stream work completes.
 *
 * Threading: one context may be used from several threads at once; calls are
 * serialized on an internal lock (which covers the staging of tables, not the
 * GPU work). kvf_xfer_destroy must not race other calls on the context.
 */
#ifndef KVFERRY_TRANSFER_H
#define KVFERRY_TRANSFER_H

#include <kvferry/copy.h>

#ifdef __cplusplus
extern "C" {
#endif

/* cudaStream_t without including CUDA headers (the same type). */
typedef struct CUstream_st *kvf_stream;

typedef struct kvf_xfer kvf_xfer;

/* Run transfers on the CPU (device field of kvf_xfer_options). */
#define KVF_DEVICE_HOST (-1)

typedef struct kvf_xfer_options {
  uint32_t struct_size;
  uint32_t version;
  int device;            /* CUDA device ordinal, or KVF_DEVICE_HOST */
  uint32_t max_sms;      /* cap on the SMs a launch uses; 0: the planner's default for the direction
                            (the fewest SMs that reach the link's limit for host<->device, all for
                            device<->device and peer) */
  uint32_t host_threads; /* host backend threads; 0: up to 8, fewer for small requests */
} kvf_xfer_options;
#define KVF_XFER_OPTIONS_INIT {sizeof(kvf_xfer_options), KVF_DESC_VERSION, KVF_DEVICE_HOST, 0, 0}

/* Where a transfer's bytes travel, as the planner classified them. */
typedef enum kvf_xfer_route {
  KVF_ROUTE_HOST = 0,        /* host backend: CPU copies */
  KVF_ROUTE_D2D = 1,         /* cache and objects in this GPU's memory */
  KVF_ROUTE_D2H = 2,         /* gather from this GPU into host memory */
  KVF_ROUTE_H2D = 3,         /* scatter from host memory into this GPU */
  KVF_ROUTE_PEER = 4,        /* one side in a peer GPU's memory */
  KVF_ROUTE_HOST_TO_HOST = 5 /* both sides in (pinned) host memory, copied by the GPU */
} kvf_xfer_route;

/* What the last call on this context did (for benchmarks and logs). */
typedef struct kvf_xfer_stats {
  uint32_t struct_size;
  uint32_t version;
  kvf_xfer_route route;
  uint32_t sms;          /* CTAs launched (one per SM at most) */
  uint32_t tasks;        /* (layer, plane, block, slice) work items */
  uint64_t payload_bytes;/* bytes moved (padding excluded) */
} kvf_xfer_stats;
#define KVF_XFER_STATS_INIT {sizeof(kvf_xfer_stats), KVF_DESC_VERSION, KVF_ROUTE_HOST, 0, 0, 0}

/* Create a transfer context for a finalized geometry. For a CUDA device this
 * loads the kernels and allocates the two staging buffers of the host<->device
 * route (KVF_XFER_STAGING_MB each, 64 MiB by default, at least one chunk's
 * objects: 128 MiB of the device's memory per context), so that a
 * first call costs what later ones do (the current device is restored
 * before returning). options may be NULL (host backend).
 * Returns KVF_ERR_INVALID_ARGUMENT (NULL pointers, unknown device, bad
 * options, unfinalized geometry: KVF_ERR_STATE), KVF_ERR_NO_DRIVER /
 * KVF_ERR_NO_DEVICE / KVF_ERR_UNSUPPORTED (a CUDA device asked for where there
 * is none or the build has no CUDA), KVF_ERR_CUDA, KVF_ERR_OUT_OF_MEMORY.
 * The geometry must outlive the context. */
KVF_API kvf_status kvf_xfer_create(const kvf_geometry *geometry, const kvf_xfer_options *options,
                                   kvf_xfer **out);

/* Destroy a context. Waits for the GPU work of calls made on it to finish
 * (those calls' events only, never a device synchronize) before freeing the
 * tables they read. NULL is a no-op. */
KVF_API void kvf_xfer_destroy(kvf_xfer *xfer);

/* Gather: copy the request's blocks from the cache into the objects.
 * stream is a cudaStream_t of the context's device (ignored, and may be
 * NULL, on the host backend, where the call returns when the copy is done).
 * Returns what kvf_copy_request_check returns for a bad request (naming the
 * field), KVF_ERR_INVALID_ARGUMENT for memory a kernel cannot reach
 * (pageable host memory, another device without peer access), KVF_ERR_CUDA
 * when a CUDA call fails (a query, an allocation, the wait for an earlier
 * call's tables) or the runtime refuses an enqueue, KVF_ERR_OUT_OF_MEMORY.
 * On failure nothing is enqueued (but, at most, an event of the context's
 * own that neither copies nor waits), except after a refused enqueue
 * (KVF_ERR_CUDA), which leaves what "Failures" above states. */
KVF_API kvf_status kvf_xfer_gather(kvf_xfer *xfer, const kvf_copy_request *request, kvf_stream stream);

/* Scatter: copy the request's objects into the cache blocks. Same rules. */
KVF_API kvf_status kvf_xfer_scatter(kvf_xfer *xfer, const kvf_copy_request *request, kvf_stream stream);

/* Deferred calls: the caller's thread hands the call to a thread of the
 * context and returns: a few microseconds (a median of 2.5-12.4 over one
 * chunk of 14 layouts on an H200 machine, 5-11 on a 2-core virtual
 * machine, most of it waking that thread), against tens to hundreds for
 * planning and enqueueing a call on the calling thread. A call alone
 * finishes later deferred than made directly (13-44 us later on the H200):
 * deferral pays where the caller has other work before the join.
 *
 * kvf_xfer_gather_deferred and kvf_xfer_scatter_deferred check the request
 * as kvf_xfer_gather does (those errors come back from the call, naming
 * the field, and nothing is enqueued), copy it (the caller may reuse its
 * arrays once the call returns), record an event on `after` and return the
 * call's ticket in *ticket: the context's deferred calls count from 1. The
 * context's thread plans and enqueues the calls in the order they were
 * made, each on an internal stream after the work enqueued on `after`
 * before the call. Work enqueued anywhere after the call, `after`
 * included, is NOT ordered after the call's work: kvf_xfer_join orders a
 * stream after it, and kvf_xfer_query tells the host when it is done. Until
 * then the call's blocks and objects must be left alone, as for any copy
 * in flight. The thread enqueues a context's deferred calls one after
 * another on its internal stream, so they run in the order they were
 * made, whatever streams they came from. A synchronous call on the context
 * first waits until the thread has enqueued every deferred call made
 * before it, so the context's tables and staging buffers are taken in call
 * order; its GPU work is still not ordered after theirs without a join.
 *
 * Errors the thread meets (memory a kernel cannot reach, an enqueue the
 * runtime refuses: "Failures" above says what is left enqueued) are kept
 * and returned once, by the first kvf_xfer_join or kvf_xfer_query whose
 * ticket covers the call, or by kvf_xfer_flush, with kvf_last_error()
 * naming the call ("deferred gather (call 12): ..."). A failed call still
 * completes in order, so no join or query waits for it forever. Up to 16
 * failures are kept; later ones are only logged (as warnings), and the
 * report of the last kept one counts them.
 *
 * The calls also return KVF_ERR_INVALID_ARGUMENT for a NULL ticket and for
 * `after` being captured into a graph (a graph cannot hold work another
 * thread enqueues later: capture kvf_xfer_gather), KVF_ERR_UNSUPPORTED
 * where the device cannot write or wait on 64-bit values from a stream
 * (the calls count their completion in mapped memory), KVF_ERR_SYSTEM when
 * the thread cannot start, KVF_ERR_CUDA and KVF_ERR_OUT_OF_MEMORY. On
 * failure no ticket is taken and nothing is enqueued. On the host backend
 * the call runs at once, as kvf_xfer_gather does there, and its ticket is
 * done when the call returns.
 *
 * Why this cannot hang: every wait it enqueues is for work enqueued
 * before it (the internal stream waits for an event the caller recorded;
 * a join waits for work the thread has already enqueued), so the device's
 * hardware queues, which run streams that share one in enqueue order,
 * never hold a wait ahead of what it waits for. The former transparent
 * mode (KVF_XFER_DEFER, removed on 2026-12-05) made the caller's stream
 * wait for work not yet enqueued and could hang the GPU (docs/design.md).
 * Nothing on the GPU waits for the host either, so a device-wide
 * synchronization (cudaFree) from any thread is safe at any time. */
KVF_API kvf_status kvf_xfer_gather_deferred(kvf_xfer *xfer, const kvf_copy_request *request, kvf_stream after,
                                            uint64_t *ticket);

/* Deferred scatter: copy the request's objects into the cache blocks. Same
 * rules as kvf_xfer_gather_deferred. */
KVF_API kvf_status kvf_xfer_scatter_deferred(kvf_xfer *xfer, const kvf_copy_request *request, kvf_stream after,
                                             uint64_t *ticket);

/* Order `stream` after the GPU work of the deferred calls up to `ticket`:
 * waits on the host until the context's thread has enqueued them (their
 * planning, which like a synchronous call's may wait for earlier calls'
 * GPU work to free the context's tables or staging buffers; not their own
 * GPU work), then enqueues on `stream` a wait that ends once their work is
 * done. Work enqueued on `stream` after the join runs after all of it.
 * Returns the first kept failure of a call up to `ticket` (see above; it
 * is then forgotten; the wait is enqueued all the same), else
 * KVF_SUCCESS. KVF_ERR_INVALID_ARGUMENT for a NULL context and for a
 * ticket that is 0 or past the context's last deferred call (naming
 * "ticket"); KVF_ERR_CUDA when the wait is refused (nothing enqueued, and
 * a kept failure stays for the next join, query or flush). On the host
 * backend there is nothing to wait for. */
KVF_API kvf_status kvf_xfer_join(kvf_xfer *xfer, uint64_t ticket, kvf_stream stream);

/* Whether the GPU work of the deferred calls up to `ticket` is done, into
 * *done (1 done, 0 not yet), without waiting: once it is, what they
 * gathered into host memory is visible to the host and what they read may
 * be reused. Returns the first kept failure of a call up to `ticket` that
 * the thread has met so far (it is then forgotten; *done is still set),
 * else KVF_SUCCESS. KVF_ERR_INVALID_ARGUMENT for a NULL context, a NULL
 * done (naming "done") and a ticket that is 0 or past the context's last
 * deferred call (naming "ticket"). On the host backend every ticket is
 * done. */
KVF_API kvf_status kvf_xfer_query(kvf_xfer *xfer, uint64_t ticket, int *done);

/* Wait until the context's thread has enqueued every deferred call made
 * before this one (not for their GPU work), and return the first kept
 * failure of any of them (see above; it is then forgotten). KVF_SUCCESS
 * when none failed, when no call was deferred, and on the host backend.
 * KVF_ERR_INVALID_ARGUMENT for a NULL context. */
KVF_API kvf_status kvf_xfer_flush(kvf_xfer *xfer);

/* What the most recent successful call on this context did, into *out
 * (filled from KVF_XFER_STATS_INIT). KVF_ERR_INVALID_ARGUMENT for NULL
 * pointers or an out that breaks the versioned-struct rule
 * (kvferry/kvferry.h; *out is then untouched). */
KVF_API kvf_status kvf_xfer_last_stats(const kvf_xfer *xfer, kvf_xfer_stats *out);

/* Human-readable name of a route ("d2h"). */
KVF_API const char *kvf_xfer_route_name(kvf_xfer_route route);

#ifdef __cplusplus
}
#endif

#endif /* KVFERRY_TRANSFER_H */
