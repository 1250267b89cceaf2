/*
 * Internal: kvferryd peers (DESIGN.md §14, docs/peers.md). Other kvferryd
 * instances, reached through the peer transport (host/server/peer_transport.h,
 * UCX), lend their L1 objects: a RETRIEVE that misses locally asks the peers
 * which of the missing objects they hold, pulls them with one-sided gets
 * into a local L1 reservation and commits only whole, checked objects.
 *
 * Trust: every connection starts with a challenge-response over a shared
 * secret (HMAC-SHA-256, both ways, the secret never on the wire); until both
 * sides proved it, nothing else is accepted or sent. Only L1 pools are
 * registered with the transport, so the only memory a peer can read is L1.
 * Every count, offset and length a peer sends is checked; a bad, oversized
 * or truncated message gets an ERROR and a disconnect. Each side's boot
 * token travels in its HELLO: a peer that restarted is logged and its stale
 * keys were dropped with its old connection.
 *
 * Threading: one peer thread owns the transport and runs everything here;
 * kvf_peers_fetch, kvf_peers_ready and kvf_peers_info may be called from any
 * thread (the server's loop, STAT). A fetch's done callback runs on the
 * peer thread (or in destroy).
 */
#ifndef KVF_HOST_PEERS_H
#define KVF_HOST_PEERS_H

#include <stdint.h>

#include <kvferry/status.h>

#include "host/server/l1.h"
#include "host/server/peer_transport.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvf_peers kvf_peers;

#define KVF_PEERS_MAX 32u          /* --peer addresses, and incoming peers at once */
#define KVF_PEERS_MAX_OBJECTS 8192u /* objects one HAS may name (it and its reply fit KVF_PT_MAX_MESSAGE) */

typedef struct kvf_peers_options {
  const char *listen;             /* "ADDR:PORT" to accept peers on; NULL: none */
  const char *const *peers;       /* "ADDR:PORT" of peers to connect to (and reconnect) */
  uint32_t num_peers;
  const char *secret_file;        /* required: a regular file of this user, no group/other bits, 16..4096 bytes */
  uint64_t boot_token;            /* the server's */
  kvf_l1 *l1;                     /* the store fetched objects are committed into and served from */
  const kvf_l1_pool_desc *pools;  /* the L1 pools, registered with the transport for peers' gets */
  uint32_t num_pools;
  uint32_t fetch_timeout_ms;      /* a peer's answer, or a pull's next completed get; 0: 5000 */
  uint32_t handshake_timeout_ms;  /* a connection not authenticated by then is closed; 0: 5000 */
  kvf_pt_context *transport_context; /* the transport's context (borrowed: it outlives the peers); pools
                                        allocated from it are read by peers on this host through shared
                                        memory. NULL: one of its own */
} kvf_peers_options;

/* Read the secret, create the transport, register the pools, listen, start
 * the peer thread (connections to options->peers are made from it).
 * Returns KVF_SUCCESS and *out; KVF_ERR_PERMISSION naming the secret file
 * (group or other may access it, or another user owns it);
 * KVF_ERR_INVALID_ARGUMENT (no secret file, too short or long, bad
 * address); KVF_ERR_SYSTEM (the transport). Nothing is left on failure. */
kvf_status kvf_peers_create(const kvf_peers_options *options, kvf_peers **out);

/* Stop the thread, fail the fetches in flight (their reservations aborted,
 * their done callbacks called), close connections, deregister. NULL: no-op. */
void kvf_peers_destroy(kvf_peers *p);

/* The port the listener bound (0 without --listen). */
uint16_t kvf_peers_port(const kvf_peers *p);

/* Peers authenticated both ways with their keys received. */
uint32_t kvf_peers_ready(kvf_peers *p);

/* done runs once the fetch is over: `objects` were committed into L1 (0
 * when no peer had them, or the pulls failed). status is KVF_SUCCESS, or
 * KVF_ERR_GEOMETRY_MISMATCH when a peer holds one of the keys as an object
 * of another geometry or format (message, borrowed for the call, names the
 * header field; spec is the index of that object in specs), which a RETRIEVE refuses as it refuses such an object
 * in its own L1. */
typedef void (*kvf_peers_fetch_done)(void *arg, uint64_t objects, uint32_t spec, kvf_status status,
                                     const char *message);

/* Fetch the objects specs[0 .. n) describe (key, object group, the header
 * they must carry) into pool `device`. Copies specs. Returns KVF_SUCCESS
 * (done will run); KVF_ERR_INVALID_ARGUMENT (n 0 or over
 * KVF_PEERS_MAX_OBJECTS); KVF_ERR_STATE (stopping); KVF_ERR_OUT_OF_MEMORY. */
kvf_status kvf_peers_fetch(kvf_peers *p, int device, const kvf_l1_object_spec *specs, uint32_t n,
                           kvf_peers_fetch_done done, void *arg);

/* What a push did with each object it was given. */
enum {
  KVF_PEERS_PUSH_FAILED = 0,  /* offered; the peer refused it or its pull failed: not committed there */
  KVF_PEERS_PUSH_COPIED = 1,  /* copied, committed on the peer */
  KVF_PEERS_PUSH_PRESENT = 2, /* the peer held it already */
  KVF_PEERS_PUSH_MISSING = 3, /* not held here (with that header): not offered */
};

/* done runs once the push is over (on the peer thread, or in destroy):
 * result[i] (KVF_PEERS_PUSH_*, borrowed for the call) for specs[i];
 * bytes: payload committed on the peer. status: KVF_SUCCESS when the peer
 * answered (results say the rest); KVF_ERR_NOT_FOUND (no ready peer of that
 * name: message lists the peers); KVF_ERR_DISCONNECTED (the peer was lost
 * or did not answer in time: nothing offered counts as copied);
 * KVF_ERR_STATE (stopping). */
typedef void (*kvf_peers_push_done)(void *arg, const uint8_t *result, uint32_t n, uint64_t bytes, kvf_status status,
                                    const char *message);

/* Push the objects specs[0 .. n) describe (those this L1 holds with
 * exactly that header) to the ready peer `peer`: its --peer ADDR:PORT, or
 * its boot token as 16 hex digits (kvferry stat). They stay pinned here
 * until the peer answers; the peer pulls them and commits only whole,
 * checked objects. Copies specs. Returns KVF_SUCCESS (done will run);
 * KVF_ERR_INVALID_ARGUMENT (n 0 or over KVF_PEERS_MAX_OBJECTS, a name over
 * 63 bytes); KVF_ERR_STATE (stopping); KVF_ERR_OUT_OF_MEMORY. */
kvf_status kvf_peers_push(kvf_peers *p, const char *peer, const kvf_l1_object_spec *specs, uint32_t n,
                          kvf_peers_push_done done, void *arg);

typedef enum kvf_peer_state {
  KVF_PEER_DOWN = 0,      /* not connected (an outgoing peer retries every second) */
  KVF_PEER_HANDSHAKE = 1, /* connected, not authenticated both ways yet */
  KVF_PEER_READY = 2,     /* authenticated, keys received */
} kvf_peer_state;

typedef struct kvf_peer_info {
  char addr[64];          /* the --peer address, or "incoming" */
  uint32_t state;         /* kvf_peer_state */
  uint32_t outgoing;      /* 1: a --peer this server connects to */
  uint64_t boot_token;    /* the peer's, from its last HELLO (0: never heard) */
  uint64_t connects;      /* handshakes completed */
  uint64_t objects_pulled, bytes_pulled; /* committed here from it (its pushes included) */
  uint64_t objects_pushed, bytes_pushed; /* committed there by our pushes */
  uint64_t objects_served;               /* it was told where to read them here */
  uint64_t failures;      /* refused handshakes, bad messages, failed or timed-out pulls, bad headers */
} kvf_peer_info;

/* Copy up to max peers' info into out; returns how many peers there are. */
uint32_t kvf_peers_info(kvf_peers *p, kvf_peer_info *out, uint32_t max);

/* Totals for tests: fetches in flight and L1 pins held for peers' reads. */
typedef struct kvf_peers_counters {
  uint64_t fetches_in_flight;
  uint64_t serve_pins;
  uint64_t fetches_total;
  uint64_t objects_pulled;
  uint64_t failures;
  uint64_t pushes_in_flight; /* ours, waiting for the peer's answer */
  uint64_t offers_in_flight; /* peers' pushes being pulled here */
} kvf_peers_counters;
void kvf_peers_counters_get(kvf_peers *p, kvf_peers_counters *out);

#ifdef __cplusplus
}
#endif

#endif /* KVF_HOST_PEERS_H */
