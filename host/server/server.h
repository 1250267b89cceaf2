/*
 * Internal: the kvferryd server object (DESIGN.md §8-9, docs/protocol.md).
 *
 * One server listens on a socket directory (host/endpoint.h) and serves
 * every connection from a single event-loop thread: poll() over a stop pipe,
 * the listener and the connections. Per connection it answers HELLO,
 * REGISTER (geometry JSON + regions + descriptors, registered all or nothing
 * through the registry over the server's import table), UNREGISTER,
 * HEARTBEAT (carrying the boot token, a random 64-bit value drawn at create)
 * and STAT. Every field a client sends is checked before use: a frame that
 * does not decode gets an ERROR naming the field and the connection is
 * closed; a REGISTER that decodes but does not fit its geometry gets an
 * ERROR naming the field and the connection stays. Other clients are never
 * disturbed. A disconnect closes the client in the registry (drain, unmap);
 * each loop turn a client silent past the heartbeat timeout is reaped.
 *
 * Fairness: each turn of the loop (one poll) gives every readable
 * connection a bounded share, at most 8 frames and 256 KiB, and accepts up
 * to 32 new connections, so a client that keeps its socket full delays the
 * others by a few requests' work per turn. A client is alive as of the last
 * poll that found bytes from it waiting, read then or later: one whose
 * heartbeats sat unread behind the loop's backlog is never reaped for it.
 *
 * Slots: max_clients connections at once. A connection must say HELLO
 * within hello_timeout_ms of connecting or it is dropped, and while every
 * slot is taken a new connection takes the slot of the oldest one that has
 * not said HELLO (which gets an ERROR and is closed), so idle connections
 * can never lock a new engine out; only when every slot holds a client that
 * said HELLO is a new connection refused (ERROR, KVF_ERR_BUSY).
 *
 * Frame memory: before HELLO a connection may send nothing larger than a
 * HELLO (4 KiB of payload); after it, frames up to max_frame_bytes. A frame
 * of at most 64 KiB of payload is always read (max_clients x 64 KiB bounds
 * them); a larger one is held after its header until the server-wide pool
 * of max_buffered_bytes has room for its payload, first come first served,
 * and its connection is not read meanwhile, so other clients' heartbeats,
 * STATs and small requests go on. A frame must be whole within
 * frame_timeout_ms of its first byte (or of its grant), counting only time
 * the sender was behind: a slow sender gets an ERROR naming the frame and
 * is closed, and its memory returns to the pool.
 *
 * Quotas: at most max_requests_in_flight STORE/RETRIEVE of one client
 * admitted and not answered (one more gets an ERROR naming
 * quota.requests_in_flight; the connection stays), and at most
 * max_reply_queue_bytes of its replies unread: the loop stops reading a
 * client whose unread replies reach half of it (it is not blamed for the
 * silence meanwhile), and one that makes no progress reading for
 * write_timeout_ms is dropped.
 *
 * REGISTER is checked and mapped off the loop, on the registration worker
 * (host/server/register.h): the loop hands it the frame and its descriptors
 * and stops reading that connection until the reply is queued, so a
 * geometry that is expensive to validate, or an import that is slow to map,
 * delays only its sender.
 *
 * STORE and RETRIEVE are admitted on the loop (host/dataplane.h: checks,
 * lease, L1 reservation or pins) and run on the lane of the registration's
 * device: a worker and a completion thread per GPU, plus the host lane.
 * Their replies come back through an outbox the loop writes, woken by the
 * same self-pipe as stop.
 *
 * LOOKUP is answered on the loop (host/dataplane.h: bounded by the keys it
 * sends, moving nothing). Its pins belong to the connection: at most
 * max_client_pins of them and max_client_pinned_chunks chunks at once, each
 * released on UNPIN, at its deadline (checked every loop turn; the poll
 * wakes for the next one) or when the connection closes.
 *
 * Threading: kvf_server_run() is the loop and runs on one thread;
 * kvf_server_stop() may be called from any thread or a signal handler;
 * kvf_server_stats() from any thread; create/destroy must not race the loop.
 */
#ifndef KVF_HOST_SERVER_H
#define KVF_HOST_SERVER_H

#include <stdint.h>

#include <kvferry/status.h>

#include "host/server/dataplane.h"
#include "host/server/registry.h"

#ifdef __cplusplus
extern "C" {
#endif

#define KVF_SERVER_VERSION 1u

typedef struct kvf_server kvf_server;

typedef struct kvf_server_options {
  uint32_t struct_size;
  uint32_t version;
  const char *socket_dir;        /* required: created 0700 when missing */
  uint32_t heartbeat_timeout_ms; /* a client silent longer is reaped; 0: 10000 */
  uint32_t heartbeat_period_ms;  /* the period clients are told to use; 0: timeout / 4 */
  uint32_t max_clients;          /* connections served at once; more are refused; 0: 256 */
  uint32_t write_timeout_ms;     /* a reply a client does not read within this drops it; 0: 2000 */
  const int *devices;            /* CUDA devices served (one lane each, plus the host lane); NULL: none */
  uint32_t num_devices;
  uint64_t l1_bytes;             /* L1 pool per GPU lane (the host lane's without GPUs); 0: 1 GiB */
  uint64_t host_l1_bytes;        /* the host lane's pool when GPUs are served; 0: 256 MiB */
  uint32_t request_timeout_ms;   /* a STORE/RETRIEVE not proven complete by then is reported timed out; 0: 60000 */
  uint32_t test_fail_step;       /* tests only: kvf_dataplane_options.test_fail_step */
  uint16_t test_fail_type;       /* tests only: kvf_dataplane_options.test_fail_type */
  uint32_t test_completion_delay_ms; /* tests only: kvf_dataplane_options.test_completion_delay_ms */
  /* Deadlines and quotas: what one client may hold of the server (0: the default). */
  uint32_t hello_timeout_ms;     /* a connection that has not said HELLO this long after connecting is
                                    dropped; 0: 5000 */
  uint32_t frame_timeout_ms;     /* a frame whose first byte arrived must be whole this long after (the
                                    time the server holds it back does not count); 0: 5000 */
  uint32_t max_frame_bytes;      /* per client: the largest payload, told in HELLO_REPLY.max_payload;
                                    4096 .. 16 MiB; 0: 16 MiB */
  uint64_t max_buffered_bytes;   /* server-wide: payload bytes of frames over 64 KiB being received at
                                    once; a frame that does not fit waits; >= max_frame_bytes; 0: 64 MiB */
  uint32_t max_requests_in_flight; /* per client: STORE/RETRIEVE admitted and not answered; one more
                                      gets an ERROR naming quota.requests_in_flight; 0: 1024 */
  uint64_t max_reply_queue_bytes;  /* per client: replies not yet read (with their bookkeeping); the
                                      loop stops reading a client at half of it; >= 1 MiB; 0: 16 MiB */
  /* Quotas on what REGISTER may claim (refused naming quota.*, the previous
   * registration stays). Mapped bytes are the address space of imported
   * allocations, counted at their identity's size from import to address
   * free. */
  uint64_t max_client_mapped_bytes;  /* per client process (SO_PEERCRED pid, all its connections);
                                        0: max(2 TiB, 2 x physical memory), at most max_mapped_bytes */
  uint64_t max_mapped_bytes;         /* the whole server; 0: 64 TiB (half of a 47-bit address space) */
  uint32_t max_client_registrations; /* live + draining registrations per connection; 0: 8 */
  /* LOOKUP pins (refused beyond these with KVF_ERR_BUSY naming quota.pins or
   * quota.pinned_chunks; the connection stays). */
  uint32_t max_client_pins;          /* pins held at once per connection; 0: 256 */
  uint32_t max_client_pinned_chunks; /* chunks pinned at once per connection; a LOOKUP counts as many
                                        as it sends keys until it is answered; 0: 65536 */
  /* Peers (host/server/peers.h, docs/peers.md): other kvferryd a RETRIEVE
   * that misses here fetches from. None of them: no peering at all. */
  const char *peer_listen;           /* "ADDR:PORT" to accept peers on; NULL: none */
  const char *const *peers;          /* "ADDR:PORT" of peers to connect to */
  uint32_t num_peers;
  const char *peer_secret_file;      /* required with peer_listen or peers (0600) */
  uint32_t peer_fetch_timeout_ms;    /* one step of a fetch from a peer; 0: 5000 */
} kvf_server_options;
#define KVF_SERVER_OPTIONS_INIT \
  {sizeof(kvf_server_options), KVF_SERVER_VERSION, NULL, 0, 0, 0, 0, NULL, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, \
   NULL, NULL, 0, NULL, 0}

/* Create a server: an import table (no extra access devices), a registry
 * over it, and the endpoint listening on options->socket_dir. Returns
 * KVF_SUCCESS and *out; KVF_ERR_BUSY (another server holds the directory:
 * the message names it); KVF_ERR_INVALID_ARGUMENT (NULL, no socket_dir,
 * bad options); KVF_ERR_PERMISSION; KVF_ERR_OUT_OF_MEMORY; KVF_ERR_SYSTEM.
 * Nothing is left behind on failure. */
kvf_status kvf_server_create(const kvf_server_options *options, kvf_server **out);

/* Serve until kvf_server_stop(): then close every connection (each client
 * drained and unmapped) and stop listening (the socket is removed). Returns
 * KVF_SUCCESS after a stop; KVF_ERR_SYSTEM when poll() fails;
 * KVF_ERR_STATE when called twice or concurrently. */
kvf_status kvf_server_run(kvf_server *s);

/* Ask the loop to stop. Async-signal-safe (an atomic flag and one write to a
 * self-pipe). NULL is a no-op. */
void kvf_server_stop(kvf_server *s);

/* The boot token drawn at create (nonzero). */
uint64_t kvf_server_boot_token(const kvf_server *s);

/* The socket's path. */
const char *kvf_server_socket_path(const kvf_server *s);

/* The registry's counters (kvf_registry_stats_get; fill out from
 * KVF_REGISTRY_STATS_INIT). Thread-safe. */
kvf_status kvf_server_stats(kvf_server *s, kvf_registry_stats *out);

/* The data plane's counters (L1, requests). Thread-safe. */
kvf_status kvf_server_data_stats(kvf_server *s, kvf_dataplane_stats *out);

/* The server's peers (NULL without peering): host/server/peers.h's
 * kvf_peers_info, kvf_peers_counters_get and kvf_peers_port are
 * thread-safe on it. */
struct kvf_peers *kvf_server_peers(kvf_server *s);

/* Free the server: connections, endpoint (if run did not already close
 * them), registry and import table. NULL is a no-op. Must not race run. */
void kvf_server_destroy(kvf_server *s);

#ifdef __cplusplus
}
#endif

#endif /* KVF_HOST_SERVER_H */
