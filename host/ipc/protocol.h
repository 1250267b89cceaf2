/*
 * Internal: the kvferryd wire protocol (docs/protocol.md is the reference).
 *
 * Every message is one frame on a Unix stream socket: a fixed 24-byte header
 * (magic, protocol version, message type, request id, payload length, flags),
 * then the payload. Every integer is little-endian with an explicit width;
 * every string is a u32 byte length then that many bytes, bounded and free
 * of NUL bytes. Nothing is encoded by copying a C struct, so padding and the
 * host's byte order never reach the wire.
 *
 * Decoding checks every field before anything is used: the header, lengths
 * against the bytes that remain, counts against the limits below, enums
 * against their values, reserved fields against zero, and that the payload
 * holds nothing after the message. A failure returns KVF_ERR_PROTOCOL and
 * kvf_last_error() names the field ("payload.groups[2].block_ids: count 2000000
 * exceeds the 1048576 limit"). Checks against a registered geometry (block ids
 * below num_blocks, say) belong to the server; these are the checks that need
 * nothing but the frame.
 *
 * Ownership: a decoded message owns its arrays and strings; release them with
 * kvf_proto_msg_clear(). A message being encoded only borrows what it points
 * to.
 *
 * Threading: no shared state; a kvf_proto_reader is used by one thread at a
 * time. Nothing here touches a socket: the caller reads and writes bytes.
 */
#ifndef KVF_HOST_PROTOCOL_H
#define KVF_HOST_PROTOCOL_H

#include <stddef.h>
#include <stdint.h>

#include <kvferry/client.h>
#include <kvferry/status.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KVF_PROTO_MAGIC 0x5046564Bu /* "KVFP" in the byte order of the wire */
#define KVF_PROTO_VERSION 2u        /* the only version this build speaks (1: 8-byte chunk keys, no shard) */
#define KVF_PROTO_HEADER_SIZE 24u

/* Limits the decoder enforces (docs/protocol.md lists them too). */
#define KVF_PROTO_MAX_PAYLOAD (16u << 20)       /* bytes after the header */
#define KVF_PROTO_MAX_GEOMETRY_JSON (8u << 20)  /* REGISTER's geometry text */
#define KVF_PROTO_MAX_REGIONS 4096u             /* = KVF_MAX_REGIONS */
#define KVF_PROTO_MAX_FDS 253u                  /* SCM_MAX_FD: descriptors on one frame */
#define KVF_PROTO_MAX_GROUPS 64u                /* = KVF_MAX_GROUPS */
#define KVF_PROTO_MAX_BLOCKS_PER_GROUP (1u << 20) /* block ids per group in one STORE/RETRIEVE */
#define KVF_PROTO_MAX_CHUNKS 65536u             /* chunk keys in one STORE/RETRIEVE */
#define KVF_PROTO_MAX_SHARDS 65536u             /* = KVF_CLIENT_MAX_SHARDS: REGISTER's shard_count */
#define KVF_PROTO_KEY_BYTES 32u                 /* = KVF_CHUNK_KEY_BYTES: one chunk key on the wire */
#define KVF_PROTO_MAX_STAT_CLIENTS 1024u        /* client records in one STAT reply */
#define KVF_PROTO_MAX_STAT_PEERS 64u            /* peer records in one STAT reply */
#define KVF_PROTO_NAME_MAX 64u                  /* client names: at most 63 bytes */
#define KVF_PROTO_FIELD_MAX 128u                /* ERROR's field: at most 127 bytes */
#define KVF_PROTO_MESSAGE_MAX 512u              /* ERROR's message: at most 511 bytes */
#define KVF_PROTO_MAX_PIN_MS 60000u             /* LOOKUP: the longest pin */

/* Message types. Values are pinned: a reply is its request's type | 0x8000. */
typedef enum kvf_proto_type {
  KVF_PROTO_HELLO = 0x0001,
  KVF_PROTO_REGISTER = 0x0002,
  KVF_PROTO_UNREGISTER = 0x0003,
  KVF_PROTO_HEARTBEAT = 0x0004,
  KVF_PROTO_STAT = 0x0005,
  KVF_PROTO_STORE = 0x0006,
  KVF_PROTO_RETRIEVE = 0x0007,
  KVF_PROTO_LOOKUP = 0x0008,
  KVF_PROTO_UNPIN = 0x0009,
  KVF_PROTO_PUSH = 0x000A,
  KVF_PROTO_REPLY = 0x8000, /* bit set on every reply */
  KVF_PROTO_HELLO_REPLY = 0x8001,
  KVF_PROTO_REGISTER_REPLY = 0x8002,
  KVF_PROTO_UNREGISTER_REPLY = 0x8003,
  KVF_PROTO_HEARTBEAT_REPLY = 0x8004,
  KVF_PROTO_STAT_REPLY = 0x8005,
  KVF_PROTO_STORE_REPLY = 0x8006,
  KVF_PROTO_RETRIEVE_REPLY = 0x8007,
  KVF_PROTO_LOOKUP_REPLY = 0x8008,
  KVF_PROTO_UNPIN_REPLY = 0x8009,
  KVF_PROTO_PUSH_REPLY = 0x800A,
  KVF_PROTO_RETIRED = 0x8100, /* a notice (server -> client), not a reply: 0x81xx */
  KVF_PROTO_ERROR = 0x80FF, /* the reply to any request that failed */
} kvf_proto_type;

/* Registration states (DESIGN.md section 8). Pinned: they travel in replies. */
typedef enum kvf_proto_reg_state {
  KVF_PROTO_REG_REGISTERING = 0,
  KVF_PROTO_REG_ACTIVE = 1,
  KVF_PROTO_REG_DRAINING = 2,
  KVF_PROTO_REG_CLOSED = 3,
  KVF_PROTO_REG_FAILED = 4,
  KVF_PROTO_REG_NUM_STATES = 5,
} kvf_proto_reg_state;

/* STAT request flags. */
#define KVF_PROTO_STAT_PER_CLIENT 1u /* include one record per client */
#define KVF_PROTO_STAT_PEERS 2u      /* include one record per kvferryd peer (docs/peers.md) */

typedef struct kvf_proto_header {
  uint32_t magic;
  uint16_t version;
  uint16_t type;
  uint64_t request_id;
  uint32_t payload_len;
  uint32_t flags; /* zero in version 1 */
} kvf_proto_header;

typedef struct kvf_proto_hello {
  uint16_t min_version, max_version; /* protocol versions the client can speak */
  uint32_t pid;
  uint64_t instance_id; /* kvf_mem_instance of the client; nonzero */
  uint64_t generation;
  char name[KVF_PROTO_NAME_MAX]; /* for logs and STAT; may be empty */
} kvf_proto_hello;

typedef struct kvf_proto_hello_reply {
  uint16_t version; /* the version both sides will speak */
  uint32_t server_pid;
  uint64_t boot_token; /* changes when the server restarts: register again */
  uint64_t client_id;  /* the server's name for this connection */
  uint32_t heartbeat_period_ms, heartbeat_timeout_ms;
  uint32_t max_payload; /* the largest payload the server accepts */
} kvf_proto_hello_reply;

/* One geometry region backed by an exported allocation: the region is bytes
 * [offset, offset + length) of the allocation whose descriptor is the
 * fd_index-th one passed (SCM_RIGHTS) with the REGISTER frame. */
typedef struct kvf_proto_region {
  uint64_t instance_id, allocation_id, generation, size; /* kvf_mem_identity */
  uint8_t device_uuid[16];
  uint32_t provider; /* kvf_mem_provider: 1 host, 2 cumem */
  uint64_t offset, length;
  uint32_t fd_index; /* < num_fds */
} kvf_proto_region;

typedef struct kvf_proto_register {
  int32_t device;    /* the GPU the engine runs on; -1: host */
  uint32_t num_fds;  /* descriptors passed with this frame, <= KVF_PROTO_MAX_FDS */
  uint32_t shard_index; /* < shard_count: the worker's tensor-parallel (x DCP) rank */
  uint32_t shard_count; /* 1 .. KVF_PROTO_MAX_SHARDS; 1: unsharded */
  char *geometry_json; /* NUL-terminated; geometry_json_len bytes before the NUL */
  uint32_t geometry_json_len;
  kvf_proto_region *regions; /* [num_regions], region i of the geometry */
  uint32_t num_regions;
} kvf_proto_register;

typedef struct kvf_proto_register_reply {
  uint64_t registration_id;
  uint64_t fingerprint; /* kvf_geometry_fingerprint of the registered geometry (canonical) */
  uint32_t imports, aliases;
} kvf_proto_register_reply;

typedef struct kvf_proto_unregister {
  uint64_t registration_id; /* 0: this client's live registration */
} kvf_proto_unregister;

typedef struct kvf_proto_unregister_reply {
  uint64_t registration_id;
  uint32_t state; /* kvf_proto_reg_state after the call */
} kvf_proto_unregister_reply;

typedef struct kvf_proto_heartbeat {
  uint64_t sequence;
} kvf_proto_heartbeat;

typedef struct kvf_proto_heartbeat_reply {
  uint64_t sequence; /* echoed */
  uint64_t boot_token;
} kvf_proto_heartbeat_reply;

typedef struct kvf_proto_stat {
  uint32_t flags; /* KVF_PROTO_STAT_* */
} kvf_proto_stat;

typedef struct kvf_proto_counters {
  uint32_t registrations[KVF_PROTO_REG_NUM_STATES]; /* by kvf_proto_reg_state */
  uint64_t imports, aliases, leases;
} kvf_proto_counters;

typedef struct kvf_proto_stat_client {
  uint64_t client_id;
  uint32_t pid;
  char name[KVF_PROTO_NAME_MAX];
  kvf_proto_counters counters;
} kvf_proto_stat_client;

/* The data plane's counters in a STAT reply. */
typedef struct kvf_proto_data_counters {
  uint64_t l1_objects, l1_bytes;        /* committed objects and their payload */
  uint64_t l1_pool_bytes;               /* L1 memory over every lane */
  uint64_t l1_evicted_entries_total;
  uint64_t stores_total, retrieves_total; /* admitted */
  uint64_t in_flight;
  uint32_t lanes;                       /* including the host lane */
} kvf_proto_data_counters;

/* One kvferryd peer in a STAT reply (host/server/peers.h's kvf_peer_info). */
typedef struct kvf_proto_stat_peer {
  char addr[KVF_PROTO_NAME_MAX];
  uint32_t state;    /* 0 down, 1 handshake, 2 ready */
  uint32_t outgoing; /* 1: a --peer the server connects to */
  uint64_t boot_token, connects, objects_pulled, bytes_pulled, objects_served, failures;
  uint64_t objects_pushed, bytes_pushed; /* committed on it by this server's pushes */
} kvf_proto_stat_peer;

typedef struct kvf_proto_stat_reply {
  uint64_t boot_token;
  kvf_proto_counters total;
  kvf_proto_data_counters data;
  kvf_proto_stat_client *clients; /* [num_clients] */
  uint32_t num_clients;
  /* Present only when the STAT asked (KVF_PROTO_STAT_PEERS): */
  uint32_t has_peers;
  kvf_proto_stat_peer *peers; /* [num_peers] */
  uint32_t num_peers;
} kvf_proto_stat_reply;

/* One group's blocks in a STORE or RETRIEVE (kvf_group_blocks on the wire). */
typedef struct kvf_proto_group {
  uint64_t first_block;
  uint32_t *block_ids; /* [count]; KVF_BLOCK_SKIP allowed */
  uint32_t count;
} kvf_proto_group;

/* A chunk key on the wire (KVF_PROTO_KEY_BYTES bytes): what
 * kvf_proto_xfer.chunk_keys and kvf_proto_lookup.chunk_keys hold. */
typedef kvf_chunk_key kvf_proto_chunk_key;

/* How the server learns that the blocks a STORE reads are written. */
typedef enum kvf_proto_ready_kind {
  KVF_PROTO_READY_NONE = 0,       /* ready when the request is sent (host backend, or the engine synced) */
  KVF_PROTO_READY_CUDA_EVENT = 1, /* ready_handle holds a cudaIpcEventHandle_t the engine recorded
                                     after writing the blocks; the server's stream waits on it */
} kvf_proto_ready_kind;
#define KVF_PROTO_READY_HANDLE_BYTES 64u /* sizeof(cudaIpcEventHandle_t) */

/* STORE (cache -> L1 objects) and RETRIEVE (L1 objects -> cache) share it.
 * Chunk k of the request covers global tokens [token_begin + k*C,
 * min(token_begin + (k+1)*C, token_end)) and is named by chunk_keys[k] (a
 * chained SHA-256 prefix hash, kvf_chunk_keys, or the engine's own 32-byte
 * block hash), so num_chunk_keys is the number of chunks the token range
 * spans. */
typedef struct kvf_proto_xfer {
  uint64_t registration_id; /* 0: the client's live registration */
  uint64_t token_begin, token_end; /* token_end > token_begin */
  uint32_t format;                 /* kvf_object_format: 0 canonical, 1 native */
  uint32_t ready_kind;             /* kvf_proto_ready_kind; RETRIEVE: 0 */
  uint8_t ready_handle[KVF_PROTO_READY_HANDLE_BYTES]; /* all zero unless ready_kind is CUDA_EVENT */
  kvf_chunk_key *chunk_keys;       /* [num_chunk_keys], none all zero */
  uint32_t num_chunk_keys;         /* 1 .. KVF_PROTO_MAX_CHUNKS */
  kvf_proto_group *groups;         /* [num_groups] */
  uint32_t num_groups;
} kvf_proto_xfer;

/* STORE_REPLY and RETRIEVE_REPLY: the request's logical outcome. A request
 * refused before admission (a field that does not fit) gets an ERROR
 * instead. */
typedef struct kvf_proto_xfer_reply {
  uint32_t status;          /* kvf_status of the outcome (KVF_SUCCESS when done) */
  uint32_t outcome;         /* 1 done, 2 failed, 3 cancelled, 4 timed out */
  uint64_t prefix_tokens;   /* STORE: the request's tokens [token_begin, prefix_tokens) now held in L1
                               for every object group it stored; RETRIEVE: tokens restored in every
                               group (token_begin: nothing restored) */
  uint64_t objects_done;    /* STORE: objects committed by this request; RETRIEVE: objects read */
  uint64_t objects_present; /* STORE: objects already held (or being stored by another request), not
                               written again; RETRIEVE: 0 */
  uint64_t bytes_done;      /* payload bytes moved */
  uint64_t *group_blocks;   /* [num_groups]: whole blocks moved per group of the geometry */
  uint32_t num_groups;      /* <= KVF_PROTO_MAX_GROUPS */
  uint64_t *og_prefix_tokens; /* [num_object_groups] RETRIEVE: the longest prefix each object group
                                 holds in L1 (token_begin: a miss for that group); STORE: none */
  uint32_t num_object_groups; /* <= KVF_PROTO_MAX_GROUPS */
  char message[KVF_PROTO_MESSAGE_MAX]; /* why, when not done; "" otherwise */
} kvf_proto_xfer_reply;

/* LOOKUP: how far the prefix named by chunk_keys reaches in each object
 * group, by RETRIEVE's rule, moving nothing; optionally pinning what a
 * RETRIEVE of the same range would read for pin_ms. */
typedef struct kvf_proto_lookup {
  uint64_t registration_id;         /* 0: the client's live registration */
  uint64_t token_begin, token_end;  /* token_end > token_begin */
  uint32_t format;                  /* kvf_object_format: 0 canonical, 1 native */
  uint32_t pin_ms;                  /* 0: no pin; else at most KVF_PROTO_MAX_PIN_MS */
  kvf_proto_chunk_key *chunk_keys;  /* [num_chunk_keys], none all zero */
  uint32_t num_chunk_keys;          /* 1 .. KVF_PROTO_MAX_CHUNKS, <= token_end - token_begin */
} kvf_proto_lookup;

typedef struct kvf_proto_lookup_reply {
  uint64_t prefix_tokens;     /* what a RETRIEVE of the range would restore in every object group */
  uint64_t pin_id;            /* 0: nothing pinned */
  uint32_t pinned_chunks;     /* chunks with an object pinned; 0 exactly when pin_id is 0 */
  uint64_t *og_prefix_tokens; /* [num_object_groups]: how far each object group reaches */
  uint32_t num_object_groups; /* <= KVF_PROTO_MAX_GROUPS */
} kvf_proto_lookup_reply;

typedef struct kvf_proto_unpin {
  uint64_t pin_id; /* nonzero: a LOOKUP_REPLY's */
} kvf_proto_unpin;

typedef struct kvf_proto_unpin_reply {
  uint64_t pin_id;
  uint32_t released; /* 1: this UNPIN released it; 0: it was gone already (expired or unpinned) */
} kvf_proto_unpin_reply;

/* PUSH: copy the objects this server holds for chunk_keys (every object
 * group of the registration, the range read as a RETRIEVE's) into the L1
 * of the kvferryd peer named `peer` (docs/peers.md): the peer pulls them
 * and commits only whole, checked objects. */
typedef struct kvf_proto_push {
  uint64_t registration_id;        /* 0: the client's live registration */
  uint64_t token_begin, token_end; /* token_end > token_begin */
  uint32_t format;                 /* kvf_object_format: 0 canonical, 1 native */
  char peer[KVF_PROTO_NAME_MAX];   /* its --peer ADDR:PORT, or its boot token as 16 hex digits; not empty */
  kvf_proto_chunk_key *chunk_keys; /* [num_chunk_keys], none all zero */
  uint32_t num_chunk_keys;         /* 1 .. KVF_PROTO_MAX_CHUNKS, <= token_end - token_begin */
} kvf_proto_push;

typedef struct kvf_proto_push_reply {
  uint64_t objects_pushed;  /* copied to the peer and committed there */
  uint64_t objects_present; /* the peer held them already */
  uint64_t objects_missing; /* not held here: nothing to push */
  uint64_t objects_failed;  /* refused by the peer, or the copy failed: not committed there */
  uint64_t bytes_pushed;    /* payload bytes of objects_pushed */
  uint64_t chunks_on_peer;  /* leading chunks of the range whose every object is on the peer now */
} kvf_proto_push_reply;

/* RETIRED (header.request_id: the STORE or RETRIEVE): the work of a request
 * answered before it was proven complete (timed out, cancelled) is now
 * proven done: nothing of it can touch the engine's blocks any more. */
typedef struct kvf_proto_retired {
  uint32_t outcome; /* the outcome its reply carried: 3 cancelled or 4 timed out */
} kvf_proto_retired;

typedef struct kvf_proto_error {
  uint32_t status;  /* kvf_status, never KVF_SUCCESS */
  uint16_t version; /* the protocol version of the side that replied */
  char field[KVF_PROTO_FIELD_MAX];     /* the field at fault, "" if none */
  char message[KVF_PROTO_MESSAGE_MAX]; /* one line for people */
} kvf_proto_error;

/* A message: its type picks the union member (STORE and RETRIEVE use xfer,
 * their replies xfer_reply). */
typedef struct kvf_proto_msg {
  uint16_t type;
  uint64_t request_id;
  union {
    kvf_proto_hello hello;
    kvf_proto_hello_reply hello_reply;
    kvf_proto_register reg;
    kvf_proto_register_reply register_reply;
    kvf_proto_unregister unregister;
    kvf_proto_unregister_reply unregister_reply;
    kvf_proto_heartbeat heartbeat;
    kvf_proto_heartbeat_reply heartbeat_reply;
    kvf_proto_stat stat;
    kvf_proto_stat_reply stat_reply;
    kvf_proto_xfer xfer;
    kvf_proto_xfer_reply xfer_reply;
    kvf_proto_lookup lookup;
    kvf_proto_lookup_reply lookup_reply;
    kvf_proto_unpin unpin;
    kvf_proto_unpin_reply unpin_reply;
    kvf_proto_push push;
    kvf_proto_push_reply push_reply;
    kvf_proto_retired retired;
    kvf_proto_error error;
  } u;
} kvf_proto_msg;

/* "HELLO", "STORE_REPLY", ...; "unknown" for other values. Never NULL. */
const char *kvf_proto_type_name(uint16_t type);

/* Encode `msg` as one whole frame (header and payload) into a new buffer
 * *out of *out_len bytes; free() it. The message is checked against the same
 * limits the decoder enforces, so every frame encoded here decodes.
 * Returns KVF_SUCCESS, KVF_ERR_INVALID_ARGUMENT (NULL pointers, unknown type,
 * a field over a limit: the message names it), KVF_ERR_OUT_OF_MEMORY. */
kvf_status kvf_proto_encode(const kvf_proto_msg *msg, uint8_t **out, size_t *out_len);

/* Decode and check a header from KVF_PROTO_HEADER_SIZE bytes. *out is
 * filled even on failure, so a server can address its ERROR reply to the
 * request id. Rejects a wrong magic, a version other than KVF_PROTO_VERSION
 * ("header.version: peer speaks protocol version 2, this side speaks 1"),
 * an unknown type, a payload over max_payload (0: KVF_PROTO_MAX_PAYLOAD) and
 * nonzero flags, with KVF_ERR_PROTOCOL. */
kvf_status kvf_proto_header_decode(const uint8_t *bytes, uint32_t max_payload, kvf_proto_header *out);

/* Decode the payload of a frame whose header `h` has been decoded: exactly
 * h->payload_len bytes at `payload` (NULL allowed when 0). On success *out
 * owns what it points to (kvf_proto_msg_clear); on failure *out holds nothing
 * to free and KVF_ERR_PROTOCOL's message names the field. Also
 * KVF_ERR_OUT_OF_MEMORY and KVF_ERR_INVALID_ARGUMENT (NULL pointers). */
kvf_status kvf_proto_decode(const kvf_proto_header *h, const uint8_t *payload, kvf_proto_msg *out);

/* Decode one whole frame of exactly len bytes (header, then payload). */
kvf_status kvf_proto_frame_decode(const uint8_t *frame, size_t len, kvf_proto_msg *out);

/* Free what a decoded message owns and zero it. NULL is a no-op. */
void kvf_proto_msg_clear(kvf_proto_msg *msg);

/* Pick the version both sides speak: the highest in [min, max] that this
 * side speaks. KVF_ERR_PROTOCOL ("payload.max_version: client speaks
 * protocol versions 2..3, this side speaks 1..1") when there is none. */
kvf_status kvf_proto_negotiate(uint16_t min_version, uint16_t max_version, uint16_t *out);

/* An incremental frame reader: feed it bytes as they arrive, in pieces of
 * any size; it reassembles one frame at a time. The payload buffer is
 * allocated only after the header has been checked, so an oversize frame is
 * refused before a byte of memory is spent on it. A failure is sticky: the
 * connection is out of step and should be closed.
 *
 * A reader may also *hold* a large frame (hold_above, kvf_proto_reader_limit):
 * once the header of a frame whose payload is larger has been checked, the
 * reader stops there, allocating nothing and consuming nothing more, until
 * its owner grants the buffer (kvf_proto_reader_grant). A server uses it to
 * bound the memory that frames being received take over all connections. */
typedef struct kvf_proto_reader {
  uint32_t max_payload;
  uint32_t hold_above; /* 0: never hold; else payloads larger than this wait for a grant */
  uint8_t header_bytes[KVF_PROTO_HEADER_SIZE];
  size_t header_have;
  kvf_proto_header header; /* valid once header_have == KVF_PROTO_HEADER_SIZE */
  uint8_t *payload;
  size_t payload_have;
  int held;            /* the header is checked, the payload waits for kvf_proto_reader_grant */
  int ready;           /* a whole frame is waiting for kvf_proto_reader_take */
  kvf_status failed;   /* sticky; KVF_SUCCESS while healthy */
} kvf_proto_reader;

/* Start a reader that accepts payloads up to max_payload bytes (0:
 * KVF_PROTO_MAX_PAYLOAD; capped at it) and never holds. */
void kvf_proto_reader_init(kvf_proto_reader *r, uint32_t max_payload);

/* Change the limits for the frames whose header has not been checked yet:
 * payloads up to max_payload bytes (0: KVF_PROTO_MAX_PAYLOAD; capped at it)
 * are accepted, and those larger than hold_above (0: none) are held. The
 * frame being read, if its header is checked, keeps the limits it had. */
void kvf_proto_reader_limit(kvf_proto_reader *r, uint32_t max_payload, uint32_t hold_above);

/* Free the reader's buffer and reset it to its initial state (keeping its
 * limits). */
void kvf_proto_reader_reset(kvf_proto_reader *r);

/* Bytes the current frame still needs: a socket reader that reads at most
 * this many never reads into the next frame (nor past its descriptors). 0
 * when a frame is ready, held or the reader has failed. */
size_t kvf_proto_reader_want(const kvf_proto_reader *r);

/* The payload length of a held frame (header checked, no buffer yet); 0
 * when the reader holds nothing. */
uint32_t kvf_proto_reader_held(const kvf_proto_reader *r);

/* Allocate the held frame's payload buffer, so feeding goes on. Returns
 * KVF_SUCCESS; KVF_ERR_STATE (nothing is held); KVF_ERR_OUT_OF_MEMORY
 * (sticky, as a failed feed). */
kvf_status kvf_proto_reader_grant(kvf_proto_reader *r);

/* Consume bytes from data[0..len): at most up to the end of the current
 * frame. *consumed says how many were taken; *ready is set to 1 when a frame
 * is complete (take it before feeding more: until then nothing is consumed).
 * Returns KVF_SUCCESS, or the header's KVF_ERR_PROTOCOL (bad magic, version,
 * type, flags, a payload over the limit) or KVF_ERR_OUT_OF_MEMORY, after
 * which every call returns the same status. r->header holds the header's
 * fields once 24 bytes have arrived, also when it was refused. */
kvf_status kvf_proto_reader_feed(kvf_proto_reader *r, const uint8_t *data, size_t len, size_t *consumed,
                                 int *ready);

/* Hand over the completed frame: its header and its payload buffer
 * (*payload is NULL for an empty payload; the caller frees it). The reader
 * then waits for the next frame. KVF_ERR_STATE when no frame is ready. */
kvf_status kvf_proto_reader_take(kvf_proto_reader *r, kvf_proto_header *header, uint8_t **payload);

#ifdef __cplusplus
}
#endif

#endif /* KVF_HOST_PROTOCOL_H */
