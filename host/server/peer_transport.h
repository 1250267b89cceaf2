/*
 * Internal: the transport kvferryd peers talk through (DESIGN.md §14,
 * docs/peers.md). One small interface, so that a second engine (NIXL) can
 * follow the UCX one (peer_ucx.c) without touching the peering logic
 * (host/server/peers.h).
 *
 * What it gives: a listener and outgoing connections by "ADDR:PORT";
 * messages (copied at send, delivered whole, in order per connection);
 * memory registered once per region, its remote key packed into bytes the
 * other side unpacks on its connection; one-sided gets from a remote
 * registered region into local memory. A transport never interprets a
 * message: authentication, bounds and formats are the caller's.
 *
 * Memory the transport allocates itself (kvf_pt_mem_alloc) can be more than
 * memory the caller registers: UCX's shared-memory transports (posix, sysv)
 * map only memory UCX allocated into a peer on the same host, so gets from
 * it are a memcpy, where gets from registered memory fall back to active
 * messages. Such memory belongs to a context (kvf_pt_context, a UCP
 * context), which can be made before the transports that use it and
 * outlive them: kvferryd allocates its L1 pools from it before the data
 * plane starts and frees them after the peers are gone.
 *
 * Threading: every function of a transport except kvf_pt_signal() must be
 * called from one thread (the peer thread), which also runs every callback
 * (from inside kvf_pt_progress). kvf_pt_signal may be called from any
 * thread: it makes a kvf_pt_wait in progress return. A context and its
 * allocations (kvf_pt_context_*, kvf_pt_mem_alloc, kvf_pt_mem_free) are
 * used by one thread at a time, never while a transport made on it is
 * registering memory (kvferryd: the server's thread, before the peer thread
 * starts and after it stopped).
 */
#ifndef KVF_HOST_PEER_TRANSPORT_H
#define KVF_HOST_PEER_TRANSPORT_H

#include <stddef.h>
#include <stdint.h>

#include <kvferry/status.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvf_pt_context kvf_pt_context; /* what transports share: a UCP context and its memory */
typedef struct kvf_pt kvf_pt;           /* one transport instance (a UCP worker) */
typedef struct kvf_pt_conn kvf_pt_conn; /* one connection (a UCP endpoint) */
typedef struct kvf_pt_mem kvf_pt_mem;   /* a locally registered region */
typedef struct kvf_pt_rkey kvf_pt_rkey; /* a remote region's key, unpacked on one connection */

/* Largest message kvf_pt_send takes. */
#define KVF_PT_MAX_MESSAGE (1u << 20)

typedef struct kvf_pt_callbacks {
  void *ctx;
  /* A peer connected to the listener: c is new and owned by the caller
   * (kvf_pt_close it). */
  void (*on_accept)(void *ctx, kvf_pt_conn *c);
  /* A whole message from c (data borrowed for the call). */
  void (*on_message)(void *ctx, kvf_pt_conn *c, const void *data, size_t len);
  /* c failed (peer gone, transport error). No further message comes from
   * it; the caller still closes it. */
  void (*on_error)(void *ctx, kvf_pt_conn *c, kvf_status status, const char *why);
} kvf_pt_callbacks;

/* Create a context. Returns KVF_SUCCESS and *out; KVF_ERR_SYSTEM naming
 * the transport's call that failed (the UCX environment, UCX_TLS, is
 * honoured as UCX reads it); KVF_ERR_OUT_OF_MEMORY. */
kvf_status kvf_pt_context_create(kvf_pt_context **out);

/* Free a context: after every transport made on it was destroyed and every
 * region allocated from it freed. NULL is a no-op. */
void kvf_pt_context_destroy(kvf_pt_context *c);

/* Create a transport on ctx (borrowed: it must outlive the transport), or
 * on a context of its own (ctx NULL, freed with the transport). Returns
 * KVF_SUCCESS and *out; KVF_ERR_SYSTEM naming the transport's call that
 * failed (UCX_TLS as for kvf_pt_context_create); KVF_ERR_INVALID_ARGUMENT
 * (a callback missing). */
kvf_status kvf_pt_create(kvf_pt_context *ctx, const kvf_pt_callbacks *cb, kvf_pt **out);

/* Free the transport. Every connection, key and registered region must have
 * been closed, destroyed or deregistered (allocated regions belong to the
 * context and may stay). NULL is a no-op. */
void kvf_pt_destroy(kvf_pt *t);

/* Listen on "ADDR:PORT" (numeric IPv4; port 0 picks one). *port receives
 * the port bound (port may be NULL). KVF_ERR_INVALID_ARGUMENT for a bad
 * address; KVF_ERR_SYSTEM when the transport cannot listen. */
kvf_status kvf_pt_listen(kvf_pt *t, const char *addr_port, uint16_t *port);

/* Start connecting to "ADDR:PORT". The connection is usable at once
 * (messages queue until it is up); a failure arrives as on_error. */
kvf_status kvf_pt_connect(kvf_pt *t, const char *addr_port, kvf_pt_conn **out);

/* Close c at once (in-flight gets on it complete with an error first, their
 * callbacks run before this returns) and free it. NULL is a no-op. */
void kvf_pt_close(kvf_pt_conn *c);

void kvf_pt_conn_set_user(kvf_pt_conn *c, void *user);
void *kvf_pt_conn_user(const kvf_pt_conn *c);

/* Send len bytes (copied; 1 .. KVF_PT_MAX_MESSAGE). KVF_ERR_DISCONNECTED
 * when c has failed. */
kvf_status kvf_pt_send(kvf_pt_conn *c, const void *data, size_t len);

/* Allocate len bytes (page-aligned; contents unspecified) that the
 * context's transports can serve remote gets from, registered as
 * kvf_pt_mem_register registers. What UCX allocates is its choice
 * (UCX_ALLOC_PRIO: a System V or POSIX shared-memory segment, readable by
 * processes of this user, when those transports are in UCX_TLS; anonymous
 * memory otherwise). Returns KVF_SUCCESS and *out (kvf_pt_mem_base gives
 * the address); KVF_ERR_INVALID_ARGUMENT (len 0); KVF_ERR_OUT_OF_MEMORY;
 * KVF_ERR_SYSTEM naming UCX's call. */
kvf_status kvf_pt_mem_alloc(kvf_pt_context *c, size_t len, kvf_pt_mem **out);
/* Free what kvf_pt_mem_alloc gave, after every kvf_pt_mem_register inside
 * it was deregistered (and after the last use of its memory). NULL is a
 * no-op. */
void kvf_pt_mem_free(kvf_pt_mem *m);
/* The first byte of an allocated (or registered) region. */
void *kvf_pt_mem_base(const kvf_pt_mem *m);

/* Register [base, base + len) for remote gets, and pack its key. A range
 * inside a region kvf_pt_mem_alloc gave on t's context is registered
 * already: m then shares that region's key (the whole region's), so that a
 * peer on this host reads it through shared memory. */
kvf_status kvf_pt_mem_register(kvf_pt *t, void *base, size_t len, kvf_pt_mem **out);
/* The packed key (owned by m). */
void kvf_pt_mem_key(const kvf_pt_mem *m, const void **key, size_t *len);
void kvf_pt_mem_deregister(kvf_pt_mem *m);

/* Unpack a key the peer on c sent for its region [base, base + size).
 * Where the key maps that region into this process (shared memory with a
 * peer on this host), the mapping must hold all of it: a System V segment,
 * whose gets are then copies bounded by the region; other shared memory
 * makes the gets go over the network transports. KVF_ERR_PROTOCOL when the
 * key does not unpack, the region wraps, or the mapping does not hold it. */
kvf_status kvf_pt_rkey_unpack(kvf_pt_conn *c, const void *key, size_t len, uint64_t base, uint64_t size,
                              kvf_pt_rkey **out);
/* Destroy before closing the connection it was unpacked on. NULL is a no-op. */
void kvf_pt_rkey_destroy(kvf_pt_rkey *k);

/* Completion of a get: KVF_SUCCESS once len bytes are in local; otherwise
 * the get failed (or its connection closed) and local may hold any part of
 * them. Either way nothing writes local any more after the call. */
typedef void (*kvf_pt_get_done)(void *arg, kvf_status status);

/* Read len bytes at remote_addr of the region k names into local. done runs
 * once, later, from kvf_pt_progress or kvf_pt_close (never from inside this
 * call; a get from a region mapped here has copied before it returns).
 * Bounds are the caller's to check: the transport only refuses what the
 * key does not cover (KVF_ERR_INVALID_ARGUMENT outside a mapped region). */
kvf_status kvf_pt_get(kvf_pt_conn *c, kvf_pt_rkey *k, uint64_t remote_addr, void *local, size_t len,
                      kvf_pt_get_done done, void *arg);

/* Run callbacks that are due. Returns nonzero when something happened. */
int kvf_pt_progress(kvf_pt *t);

/* Sleep until the transport has work, kvf_pt_signal is called, or
 * timeout_ms passes. */
void kvf_pt_wait(kvf_pt *t, int timeout_ms);

/* Wake a kvf_pt_wait (any thread, async-signal-safe). */
void kvf_pt_signal(kvf_pt *t);

#ifdef __cplusplus
}
#endif

#endif /* KVF_HOST_PEER_TRANSPORT_H */
