/*
 * kvferry/client.h - the client an engine worker links to share its KV cache
 * with a kvferryd server on the same machine.
 *
 * A client connects to the server's socket directory (kvf_client_connect),
 * registers its geometry and the exported allocations that back each region
 * (kvf_client_register: the descriptors travel over the socket), sends
 * heartbeats at the period the server asked for (kvf_client_heartbeat; the
 * reply's boot token changes when the server restarts: register again), and
 * unregisters on a clean exit. A crashed client is reaped by the server.
 *
 * Errors the server reports come back as its status, with kvf_last_error()
 * reading "field: message" as the server wrote it.
 *
 * STORE and RETRIEVE move blocks of the registered cache to and from the
 * server's L1 object store (kvf_client_store, kvf_client_retrieve), or
 * several at once (kvf_client_submit, then kvf_client_wait for each).
 * LOOKUP (kvf_client_lookup) says how much of a prefix L1 holds, moving
 * nothing, and may pin it for the RETRIEVE that follows (kvf_client_unpin).
 * A request answered before its work was proven done (timed out,
 * cancelled) is followed by a RETIRED notice (kvf_client_wait_retired).
 *
 * Threading: every call may be made from any thread, concurrently; replies
 * are matched to their requests by id. With heartbeat_period_ms set, the
 * client runs a heartbeat thread of its own.
 */
#ifndef KVFERRY_CLIENT_H
#define KVFERRY_CLIENT_H

#include <stddef.h>
#include <stdint.h>

#include <kvferry/copy.h>
#include <kvferry/memory.h>
#include <kvferry/status.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KVF_CLIENT_VERSION 2u

/* A chunk key: 32 bytes naming one chunk of tokens and, through the chain,
 * the whole prefix that ends with it (kvf_chunk_keys). All zero is not a key.
 * An engine that already names its prefix blocks with a 256-bit
 * collision-resistant hash (vLLM's SHA-256 block hashes) may pass those
 * 32 bytes directly as keys, one per chunk. An array element: a fixed
 * layout (kvferry/kvferry.h), never extended. */
#define KVF_CHUNK_KEY_BYTES 32
typedef struct kvf_chunk_key {
  uint8_t bytes[KVF_CHUNK_KEY_BYTES];
} kvf_chunk_key;

typedef struct kvf_client kvf_client;

typedef struct kvf_client_options {
  uint32_t struct_size;
  uint32_t version;
  const char *socket_dir; /* the server's socket directory; required */
  const char *name;       /* for the server's logs and STAT: UTF-8, at most 63 bytes; NULL: "" */
  uint32_t timeout_ms;    /* the longest one request waits for its reply; 0: 10000 */
  int heartbeat_thread;   /* 1: a thread sends heartbeats at heartbeat_period_ms (0: the server's
                             period) until disconnect; 0: the caller sends them */
  uint32_t heartbeat_period_ms; /* must be shorter than the server's heartbeat timeout (connect
                                   refuses it otherwise, naming the field) */
} kvf_client_options;
#define KVF_CLIENT_OPTIONS_INIT {sizeof(kvf_client_options), KVF_CLIENT_VERSION, NULL, NULL, 0, 0, 0}

/* What the server said at connect. Fill from KVF_CLIENT_INFO_INIT. */
typedef struct kvf_client_info {
  uint32_t struct_size;
  uint32_t version;
  uint64_t client_id;  /* the server's name for this connection */
  uint64_t boot_token; /* the server's boot token */
  uint32_t server_pid;
  uint32_t heartbeat_period_ms;  /* send a heartbeat at least this often */
  uint32_t heartbeat_timeout_ms; /* silent longer than this: reaped */
  uint16_t protocol_version;
} kvf_client_info;
#define KVF_CLIENT_INFO_INIT {sizeof(kvf_client_info), KVF_CLIENT_VERSION, 0, 0, 0, 0, 0, 0}

/* One region of the geometry: bytes [offset, offset + length) of `alloc`
 * (created by kvf_mem_alloc_create or found by kvf_mem_alloc_find). Several
 * regions may share one allocation: it is exported once. An array element:
 * a fixed layout (kvferry/kvferry.h), never extended. */
typedef struct kvf_client_region {
  kvf_mem_alloc *alloc;
  uint64_t offset;
  uint64_t length;
} kvf_client_region;

/* What a registration got. Fill from KVF_CLIENT_REGISTRATION_INIT. */
typedef struct kvf_client_registration {
  uint32_t struct_size;
  uint32_t version;
  uint64_t registration_id;
  uint64_t fingerprint; /* the server's canonical fingerprint of the geometry */
  uint32_t imports;     /* mappings the server holds for this client */
  uint32_t aliases;     /* views of this client's active registration */
} kvf_client_registration;
#define KVF_CLIENT_REGISTRATION_INIT {sizeof(kvf_client_registration), KVF_CLIENT_VERSION, 0, 0, 0, 0}

/* Server-wide counters (STAT). Fill from KVF_CLIENT_STATS_INIT. */
typedef struct kvf_client_stats {
  uint32_t struct_size;
  uint32_t version;
  uint64_t boot_token;
  uint32_t registering, active, draining; /* registrations by state now */
  uint32_t closed_total, failed_total;    /* since the server started */
  uint64_t imports, aliases, leases;
  uint64_t l1_objects, l1_bytes;  /* objects committed in the server's L1, their payload */
  uint64_t l1_pool_bytes;         /* L1 memory over every lane */
  uint64_t l1_evicted_total;      /* chunks evicted since the server started */
  uint64_t stores_total, retrieves_total, in_flight;
  uint32_t lanes;                 /* one per GPU served, plus the host lane */
} kvf_client_stats;
#define KVF_CLIENT_STATS_INIT \
  {sizeof(kvf_client_stats), KVF_CLIENT_VERSION, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}

/* Connect to the server of options->socket_dir and say HELLO. Returns
 * KVF_SUCCESS and *out (info, may be NULL, filled: fill it from
 * KVF_CLIENT_INFO_INIT first); KVF_ERR_NOT_FOUND (no
 * server runs there); KVF_ERR_PERMISSION; KVF_ERR_PROTOCOL (the server speaks
 * another protocol version: the message names both); KVF_ERR_TIMEOUT;
 * KVF_ERR_DISCONNECTED; KVF_ERR_INVALID_ARGUMENT; KVF_ERR_OUT_OF_MEMORY;
 * KVF_ERR_SYSTEM. */
KVF_API kvf_status kvf_client_connect(const kvf_client_options *options, kvf_client **out, kvf_client_info *info);

/* What a registration sends. Fill from KVF_CLIENT_REGISTER_DESC_INIT. A
 * struct tag only, no typedef: the function that takes it has its name (as
 * POSIX's struct stat and stat()), so write struct kvf_client_register_desc. */
struct kvf_client_register_desc {
  uint32_t struct_size;
  uint32_t version;
  const char *geometry_json; /* the geometry file's text, geometry_len bytes; required */
  size_t geometry_len;
  int device;                       /* the GPU the engine runs on; -1: host */
  const kvf_client_region *regions; /* [num_regions]: one per geometry region, in order */
  uint32_t num_regions;
  uint32_t shard_index; /* this worker's shard: its tensor-parallel (x DCP) rank; < shard_count */
  uint32_t shard_count; /* 0 or 1: unsharded; at most KVF_CLIENT_MAX_SHARDS */
};
#define KVF_CLIENT_REGISTER_DESC_INIT \
  {sizeof(struct kvf_client_register_desc), KVF_CLIENT_VERSION, NULL, 0, -1, NULL, 0, 0, 1}
#define KVF_CLIENT_MAX_SHARDS 65536u /* the most shards one model may be split into */

/* Register desc->geometry_json with one region per geometry region, in
 * order, as shard desc->shard_index of desc->shard_count. The server files
 * the objects a registration stores under (chunk key, object group, the
 * geometry's canonical fingerprint, shard_index, shard_count): a
 * registration with another geometry or another shard never finds them,
 * whatever keys it sends. All or nothing on the server: on failure the
 * previous registration, if any, keeps serving. Returns KVF_SUCCESS and
 * *out (may be NULL; fill it from KVF_CLIENT_REGISTRATION_INIT first); the
 * server's status (KVF_ERR_INVALID_ARGUMENT, KVF_ERR_PARSE,
 * KVF_ERR_INVALID_GEOMETRY, KVF_ERR_PROTOCOL...: the message names the
 * field; KVF_ERR_BUSY for a quota, or while another process's REGISTER of
 * the same generation is still being checked: try again); KVF_ERR_TIMEOUT
 * (no reply in time: the request is dropped, a late reply is discarded,
 * the connection stays usable); KVF_ERR_DISCONNECTED
 * (final: connect a new client); KVF_ERR_INVALID_ARGUMENT (NULL pointers,
 * more than 253 distinct allocations, shard_index not below shard_count,
 * shard_count over KVF_CLIENT_MAX_SHARDS: the message names the field). */
KVF_API kvf_status kvf_client_register_desc(kvf_client *client, const struct kvf_client_register_desc *desc,
                                            kvf_client_registration *out);

/* kvf_client_register_desc with the given fields, as shard 0 of 1. */
KVF_API kvf_status kvf_client_register(kvf_client *client, const char *geometry_json, size_t len, int device,
                                       const kvf_client_region *regions, uint32_t num_regions,
                                       kvf_client_registration *out);

/* Unregister registration_id (0: the live one). Idempotent: an id already
 * gone is KVF_SUCCESS. *state (may be NULL) gets 3 when it is unmapped, 2
 * when it drains (leases held: the unmap follows). Statuses as
 * kvf_client_register. */
KVF_API kvf_status kvf_client_unregister(kvf_client *client, uint64_t registration_id, uint32_t *state);

/* Send a heartbeat; *boot_token (may be NULL) gets the server's boot token:
 * when it differs from the one at connect, the server restarted. */
KVF_API kvf_status kvf_client_heartbeat(kvf_client *client, uint64_t *boot_token);

/* One connected client in STAT. An array element: a fixed layout
 * (kvferry/kvferry.h), never extended. */
typedef struct kvf_client_stat_record {
  uint64_t client_id;
  uint32_t pid;                           /* what its HELLO said */
  char name[64];
  uint32_t registering, active, draining; /* its registrations by state now */
  uint64_t imports, aliases, leases;
} kvf_client_stat_record;

/* The server's counters (*out filled from KVF_CLIENT_STATS_INIT first). */
KVF_API kvf_status kvf_client_stat(kvf_client *client, kvf_client_stats *out);

/* The server's counters (out may be NULL) and one record per connected
 * client: up to `capacity` into records[], *count gets how many the server
 * sent (at most 1024; more than capacity means some were left out). */
KVF_API kvf_status kvf_client_stat_clients(kvf_client *client, kvf_client_stats *out,
                                           kvf_client_stat_record *records, uint32_t capacity, uint32_t *count);

/* One kvferryd peer in STAT (docs/peers.md). An array element: a fixed
 * layout (kvferry/kvferry.h), never extended. */
typedef struct kvf_client_peer_record {
  char addr[64];           /* the --peer address, or "incoming" */
  uint32_t state;          /* 0 down, 1 handshake, 2 ready */
  uint32_t outgoing;       /* 1: a --peer the server connects to */
  uint64_t boot_token;     /* the peer's, from its last HELLO (0: never heard) */
  uint64_t connects;       /* handshakes completed */
  uint64_t objects_pulled, bytes_pulled; /* committed into this server from it */
  uint64_t objects_served; /* objects it was told where to read here */
  uint64_t failures;       /* refused handshakes, bad messages, failed pulls, bad headers */
  uint64_t objects_pushed, bytes_pushed; /* committed on it by this server's pushes (kvf_client_push) */
} kvf_client_peer_record;

/* The server's kvferryd peers: up to `capacity` into records[], *count gets
 * how many there are (at most 64; 0 for a server without peering). Statuses
 * as kvf_client_stat. */
KVF_API kvf_status kvf_client_stat_peers(kvf_client *client, kvf_client_peer_record *records, uint32_t capacity,
                                         uint32_t *count);

/* ---- STORE and RETRIEVE -------------------------------------------------- */

/* One STORE or RETRIEVE on the client's registration. The token range and
 * block tables follow kvf_copy_request (kvferry/copy.h): chunk k covers
 * global tokens [token_begin + k*C, ...) and is named chunk_keys[k]
 * (kvf_chunk_keys, or the engine's own 32-byte block hashes), so
 * num_chunk_keys is the number of chunks the range spans. For a recurrent group give its state slot: STORE: first_block is
 * the chunk whose end the state belongs to (token_end / C - 1); RETRIEVE:
 * block_ids[0] is the slot and first_block is ignored (the server restores
 * the state at the prefix it finds). */
typedef struct kvf_client_xfer {
  uint32_t struct_size;
  uint32_t version;
  uint64_t registration_id; /* 0: the live registration */
  uint64_t token_begin;     /* a multiple of chunk_tokens */
  uint64_t token_end;
  kvf_object_format format;
  const kvf_chunk_key *chunk_keys; /* [num_chunk_keys], none all zero */
  uint32_t num_chunk_keys;
  const kvf_group_blocks *groups; /* [num_groups]: every group of the geometry, in order */
  uint32_t num_groups;
  const void *ready_event; /* STORE on a GPU: the 64 bytes of a cudaIpcEventHandle_t of an event
                              (cudaEventInterprocess | cudaEventDisableTiming) recorded after the
                              blocks were written; the server's stream waits on it. The server
                              keeps the event open for the registration: reuse one event (record
                              it again) and keep it alive until the registration goes. NULL: the
                              blocks are ready when the call is made. RETRIEVE: NULL */
} kvf_client_xfer;
#define KVF_CLIENT_XFER_INIT \
  {sizeof(kvf_client_xfer), KVF_CLIENT_VERSION, 0, 0, 0, KVF_FORMAT_CANONICAL, NULL, 0, NULL, 0, NULL}

/* A request's outcome. */
typedef enum kvf_client_outcome {
  KVF_CLIENT_DONE = 1,
  KVF_CLIENT_FAILED = 2,
  KVF_CLIENT_CANCELLED = 3,
  KVF_CLIENT_TIMED_OUT = 4, /* the server stopped waiting; its memory is released only when the
                               work is proven complete. A timed-out RETRIEVE may still be writing
                               the blocks it named: reuse them only once kvf_client_wait_retired
                               returns KVF_SUCCESS for it (the server's RETIRED notice), after the
                               reply of a later request of this registration that was admitted (a
                               lane runs them in order), or after unregistering. A cancelled
                               request gets a RETIRED notice too */
} kvf_client_outcome;

typedef struct kvf_client_result {
  uint32_t struct_size;
  uint32_t version;
  kvf_status status;          /* KVF_SUCCESS when done */
  kvf_client_outcome outcome;
  uint64_t prefix_tokens;     /* STORE: tokens [token_begin, prefix_tokens) now held for every object
                                 group; RETRIEVE: tokens restored in every group (token_begin: none) */
  uint64_t objects_done;      /* STORE: objects committed; RETRIEVE: objects read */
  uint64_t objects_present;   /* STORE: objects already held, not written again */
  uint64_t bytes_done;        /* payload bytes moved */
  uint32_t num_groups;
  uint64_t group_blocks[KVF_MAX_GROUPS];        /* whole blocks moved per group */
  uint32_t num_object_groups;
  uint64_t object_group_prefix[KVF_MAX_GROUPS]; /* RETRIEVE: the longest prefix each object group
                                                   holds (token_begin: a miss) */
} kvf_client_result;
#define KVF_CLIENT_RESULT_INIT {sizeof(kvf_client_result), KVF_CLIENT_VERSION, KVF_SUCCESS, KVF_CLIENT_DONE, 0, 0, 0, 0, 0, {0}, 0, {0}}

typedef enum kvf_client_op {
  KVF_CLIENT_STORE = 1,
  KVF_CLIENT_RETRIEVE = 2,
} kvf_client_op;

/* The seed of a key chain: SHA-256 of the 15 bytes "kvferry-seed-v1"
 * followed by data[0 .. len). Fold into data everything that makes the KV
 * of the same tokens differ and that the geometry does not show: the model
 * and its weights' revision, the tokenizer, LoRA adapters, multimodal input
 * hashes. (The geometry and the shard need not go in: the server files
 * objects under the registration's canonical geometry fingerprint and shard
 * as well as the key.) data may be NULL when len is 0. Returns
 * KVF_SUCCESS; KVF_ERR_INVALID_ARGUMENT (NULL seed, NULL data with len >
 * 0); KVF_ERR_INTERNAL (libcrypto failed). Thread-safe. */
KVF_API kvf_status kvf_chunk_seed(const void *data, size_t len, kvf_chunk_key *seed);

/* Chained prefix keys: keys[k] = SHA-256(keys[k-1] (*seed for k = 0) ||
 * the token_bytes-byte tokens of chunk k, as they lie in memory), for the
 * ceil(num_tokens / chunk_tokens) chunks of tokens[0 .. num_tokens) (the
 * last chunk may be partial). Equal seeds and equal token prefixes give
 * equal keys; a token that differs changes the key of its chunk and of
 * every later one. docs/protocol.md has a test vector. Returns the number
 * of keys written; 0 for NULL pointers, an all-zero seed, token_bytes,
 * num_tokens or chunk_tokens 0, a token count whose bytes overflow, or a
 * libcrypto failure. keys must not overlap seed or tokens. Thread-safe. */
KVF_API uint64_t kvf_chunk_keys(const kvf_chunk_key *seed, const void *tokens, uint32_t token_bytes,
                                uint64_t num_tokens, uint32_t chunk_tokens, kvf_chunk_key *keys);

/* Send a STORE or RETRIEVE and return at once with its request id in
 * *request_id; collect the outcome with kvf_client_wait. Returns
 * KVF_SUCCESS; KVF_ERR_INVALID_ARGUMENT (NULL pointers, bad op, a field
 * over a protocol limit: the message names it); KVF_ERR_TIMEOUT /
 * KVF_ERR_DISCONNECTED. */
KVF_API kvf_status kvf_client_submit(kvf_client *client, kvf_client_op op, const kvf_client_xfer *xfer,
                                     uint64_t *request_id);

/* Wait for the outcome of a submitted request (timeout_ms 0: the client's
 * timeout). Returns KVF_SUCCESS with *result filled when the server
 * answered with an outcome (result->status says whether it was done); the
 * server's status when it refused the request (its message names the
 * field; nothing was moved); KVF_ERR_TIMEOUT (no answer yet: wait again);
 * KVF_ERR_NOT_FOUND (not a request id in flight); KVF_ERR_DISCONNECTED. */
KVF_API kvf_status kvf_client_wait(kvf_client *client, uint64_t request_id, uint32_t timeout_ms,
                                   kvf_client_result *result);

/* Submit and wait. Returns as kvf_client_wait, and KVF_SUCCESS only when
 * the request was done (result->status otherwise). result may be NULL. */
KVF_API kvf_status kvf_client_store(kvf_client *client, const kvf_client_xfer *xfer, kvf_client_result *result);
KVF_API kvf_status kvf_client_retrieve(kvf_client *client, const kvf_client_xfer *xfer,
                                       kvf_client_result *result);

/* ---- LOOKUP and pins ------------------------------------------------------ */

#define KVF_CLIENT_MAX_PIN_MS 60000u /* the longest pin a LOOKUP may ask for */

/* One LOOKUP: the range and chunk keys as for a RETRIEVE (kvf_client_xfer),
 * no block tables. Fill from KVF_CLIENT_LOOKUP_DESC_INIT. */
typedef struct kvf_client_lookup_desc {
  uint32_t struct_size;
  uint32_t version;
  uint64_t registration_id; /* 0: the live registration */
  uint64_t token_begin;     /* a multiple of chunk_tokens */
  uint64_t token_end;
  kvf_object_format format;
  const kvf_chunk_key *chunk_keys; /* [num_chunk_keys], none all zero: as kvf_client_xfer's */
  uint32_t num_chunk_keys;
  uint32_t pin_ms; /* 0: no pin; else pin what a RETRIEVE of the found prefix would read this long
                      (at most KVF_CLIENT_MAX_PIN_MS) */
} kvf_client_lookup_desc;
#define KVF_CLIENT_LOOKUP_DESC_INIT \
  {sizeof(kvf_client_lookup_desc), KVF_CLIENT_VERSION, 0, 0, 0, KVF_FORMAT_CANONICAL, NULL, 0, 0}

/* What a LOOKUP found. Fill from KVF_CLIENT_LOOKUP_RESULT_INIT. */
typedef struct kvf_client_lookup_result {
  uint32_t struct_size;
  uint32_t version;
  uint64_t prefix_tokens; /* what a RETRIEVE of the same range would restore in every group
                             (token_begin: a miss) */
  uint32_t num_object_groups;
  uint64_t object_group_prefix[KVF_MAX_GROUPS]; /* how far each object group alone reaches
                                                   (token_begin: a miss for it) */
  uint64_t pin_id;        /* 0: nothing pinned (no pin asked for, or a miss) */
  uint32_t pinned_chunks; /* chunks with an object pinned */
} kvf_client_lookup_result;
#define KVF_CLIENT_LOOKUP_RESULT_INIT \
  {sizeof(kvf_client_lookup_result), KVF_CLIENT_VERSION, 0, 0, {0}, 0, 0}

/* LOOKUP: how many tokens of the prefix that req->chunk_keys name each
 * object group of the registration holds in the server's L1, by the rule a
 * RETRIEVE uses (full groups need every chunk up to the prefix, windowed
 * groups only the chunks of their retained window there, recurrent groups
 * the state stored at exactly the prefix, a chunk boundary), moving no data
 * and taking no lease. A scheduler calls it to report hits; the RETRIEVE
 * that follows restores out->prefix_tokens unless objects were evicted
 * meanwhile.
 *
 * With req->pin_ms > 0 the objects a RETRIEVE of [token_begin,
 * prefix_tokens) would read are pinned: never evicted until pin_ms passes
 * (checked by the server's loop: a pin may outlive its time by a few ms),
 * kvf_client_unpin, or this connection closes. out->pin_id names the pin
 * (0 on a miss). A connection holds at most 256 pins and 65536 pinned
 * chunks by default (kvferryd --max-pins, --max-pinned-chunks; a LOOKUP
 * counts as many chunks as it sends keys): one more is refused with
 * KVF_ERR_BUSY naming quota.pins or quota.pinned_chunks.
 *
 * Returns KVF_SUCCESS and *out (filled from KVF_CLIENT_LOOKUP_RESULT_INIT
 * first); KVF_ERR_INVALID_ARGUMENT (NULL pointers, a field the protocol
 * refuses: lookup.pin_ms over the limit, lookup.chunk_keys[3] all zero, ...; or the
 * server's, naming payload.token_begin, payload.chunk_keys, ...);
 * KVF_ERR_STATE (no registration, or registration_id is not the live one);
 * KVF_ERR_GEOMETRY_MISMATCH (objects stored in another format or geometry);
 * KVF_ERR_BUSY (a pin quota); KVF_ERR_TIMEOUT; KVF_ERR_DISCONNECTED.
 * Thread-safe, as every call. */
KVF_API kvf_status kvf_client_lookup(kvf_client *client, const kvf_client_lookup_desc *req,
                                     kvf_client_lookup_result *out);

/* Release a LOOKUP's pin now. Idempotent: a pin that expired or was
 * released already is KVF_SUCCESS too. Returns KVF_SUCCESS;
 * KVF_ERR_INVALID_ARGUMENT (NULL, pin_id 0); KVF_ERR_NOT_FOUND (never a pin
 * of this connection); KVF_ERR_TIMEOUT; KVF_ERR_DISCONNECTED (the pins went
 * with the connection). */
KVF_API kvf_status kvf_client_unpin(kvf_client *client, uint64_t pin_id);

/* ---- PUSH: to a kvferryd peer -------------------------------------------- */

/* One PUSH: the objects this server holds for a range of chunk keys (as a
 * RETRIEVE names them) copied into the L1 of one of its kvferryd peers
 * (docs/peers.md): the prefill side sends what a decode host will
 * retrieve. Fill from KVF_CLIENT_PUSH_DESC_INIT. */
typedef struct kvf_client_push_desc {
  uint32_t struct_size;
  uint32_t version;
  uint64_t registration_id; /* 0: the live registration (its geometry and shard scope the keys) */
  uint64_t token_begin;     /* a multiple of chunk_tokens */
  uint64_t token_end;
  kvf_object_format format;
  const kvf_chunk_key *chunk_keys; /* [num_chunk_keys], none all zero: as kvf_client_xfer's */
  uint32_t num_chunk_keys;
  const char *peer; /* the peer: its --peer ADDR:PORT on this server, or its boot token as 16 hex digits
                       (kvferry stat); 1 .. 63 printable ASCII bytes */
} kvf_client_push_desc;
#define KVF_CLIENT_PUSH_DESC_INIT \
  {sizeof(kvf_client_push_desc), KVF_CLIENT_VERSION, 0, 0, 0, KVF_FORMAT_CANONICAL, NULL, 0, NULL}

typedef struct kvf_client_push_result {
  uint32_t struct_size;
  uint32_t version;
  uint64_t objects_pushed;  /* copied to the peer and committed there */
  uint64_t objects_present; /* the peer held them already */
  uint64_t objects_missing; /* not held here: nothing to push */
  uint64_t objects_failed;  /* refused by the peer (a header it found wrong, another object under the key, no
                               room) or their copy failed: nothing of them is visible there */
  uint64_t bytes_pushed;    /* payload bytes of objects_pushed */
  uint64_t chunks_on_peer;  /* leading chunks of the range whose every object is on the peer now: what a
                               RETRIEVE there restores, chunk_tokens each */
} kvf_client_push_result;
#define KVF_CLIENT_PUSH_RESULT_INIT {sizeof(kvf_client_push_result), KVF_CLIENT_VERSION, 0, 0, 0, 0, 0, 0}

/* PUSH: the server pins the objects it holds for req's chunks (every object
 * group of the registration), offers them to the peer, which pulls them
 * with one-sided gets and commits only whole objects whose header checks
 * (the rules of a fetch on miss); the server answers once the peer has.
 * Returns KVF_SUCCESS with *out (objects the server does not hold are
 * counted in objects_missing, not an error); KVF_ERR_NOT_FOUND naming
 * push.peer / payload.peer (no ready peer of that name; the message lists
 * them); KVF_ERR_UNSUPPORTED (a server without peers); KVF_ERR_BUSY
 * (quota.pushes: 16 in flight per connection); KVF_ERR_INVALID_ARGUMENT
 * naming the field (range, keys, more than 8192 objects in one PUSH:
 * split it); KVF_ERR_DISCONNECTED (the peer was lost before it answered:
 * what it committed stays, whole); KVF_ERR_TIMEOUT (no reply within the
 * client's timeout: the push may still complete). */
KVF_API kvf_status kvf_client_push(kvf_client *client, const kvf_client_push_desc *req, kvf_client_push_result *out);

/* ---- retirement ------------------------------------------------------------ */

/* A STORE or RETRIEVE answered timed out or cancelled may still touch the
 * blocks it named (KVF_CLIENT_TIMED_OUT). The server sends a RETIRED notice
 * once its work is proven complete (its completion event fired and
 * everything it held is released); the client records it. This waits for
 * request_id (kvf_client_submit's, of this client) to be retired.
 *
 * Returns KVF_SUCCESS once it is retired: at once for a request whose reply
 * was done or failed, or that the server refused (those retire before their
 * reply is sent), and for any other request of this client (HEARTBEAT,
 * STAT, ...: they touch no blocks); a request still in flight is waited for
 * (its reply, then its notice if one follows). The reply itself stays for
 * kvf_client_wait. KVF_ERR_TIMEOUT (not yet, after timeout_ms; 0: the
 * client's timeout: wait again); KVF_ERR_NOT_FOUND (0, or an id this client
 * never sent); KVF_ERR_DISCONNECTED: the connection died before the notice
 * came. Nothing then says when the work ends: the server finishes it (a
 * lane never abandons a copy), then drains and unmaps the registration; the
 * engine must treat those blocks as written until the server has exited
 * (kvf_client_server_restarted turns 1) or it registers fresh memory in
 * their place. Thread-safe; several threads may wait for one id. */
KVF_API kvf_status kvf_client_wait_retired(kvf_client *client, uint64_t request_id, uint32_t timeout_ms);

/* 1 once a server answers on the socket directory with a boot token other
 * than the one at connect: the server restarted. The heartbeat thread
 * notices: while the connection is alive, from heartbeat replies; once it is
 * dead, by probing the directory each period (connect, HELLO, close). This
 * client stays disconnected: connect a new one and register again. 0 without
 * a heartbeat thread or for NULL. */
KVF_API int kvf_client_server_restarted(const kvf_client *client);

/* Close the connection (the server then drains what this client
 * registered). NULL is a no-op. */
KVF_API void kvf_client_disconnect(kvf_client *client);

#ifdef __cplusplus
}
#endif

#endif /* KVFERRY_CLIENT_H */
