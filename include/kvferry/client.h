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
 * Threading: a kvf_client is used by one thread at a time (a heartbeat
 * thread needs its own lock around the client, or its own connection).
 */
#ifndef KVFERRY_CLIENT_H
#define KVFERRY_CLIENT_H

#include <stddef.h>
#include <stdint.h>

#include <kvferry/memory.h>
#include <kvferry/status.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KVF_CLIENT_VERSION 1u

typedef struct kvf_client kvf_client;

typedef struct kvf_client_options {
  uint32_t struct_size;
  uint32_t version;
  const char *socket_dir; /* the server's socket directory; required */
  const char *name;       /* for the server's logs and STAT (at most 63 bytes); NULL: "" */
  uint32_t timeout_ms;    /* the longest one request waits for its reply; 0: 10000 */
} kvf_client_options;
#define KVF_CLIENT_OPTIONS_INIT {sizeof(kvf_client_options), KVF_CLIENT_VERSION, NULL, NULL, 0}

/* What the server said at connect. */
typedef struct kvf_client_info {
  uint64_t client_id;  /* the server's name for this connection */
  uint64_t boot_token; /* the server's boot token */
  uint32_t server_pid;
  uint32_t heartbeat_period_ms;  /* send a heartbeat at least this often */
  uint32_t heartbeat_timeout_ms; /* silent longer than this: reaped */
  uint16_t protocol_version;
} kvf_client_info;

/* One region of the geometry: bytes [offset, offset + length) of `alloc`
 * (created by kvf_mem_alloc_create or found by kvf_mem_alloc_find). Several
 * regions may share one allocation: it is exported once. */
typedef struct kvf_client_region {
  kvf_mem_alloc *alloc;
  uint64_t offset;
  uint64_t length;
} kvf_client_region;

/* What a registration got. */
typedef struct kvf_client_registration {
  uint64_t registration_id;
  uint64_t fingerprint; /* the server's canonical fingerprint of the geometry */
  uint32_t imports;     /* mappings the server holds for this client */
  uint32_t aliases;     /* views of this client's active registration */
} kvf_client_registration;

/* Server-wide counters (STAT). */
typedef struct kvf_client_stats {
  uint64_t boot_token;
  uint32_t registering, active, draining; /* registrations by state now */
  uint32_t closed_total, failed_total;    /* since the server started */
  uint64_t imports, aliases, leases;
} kvf_client_stats;

/* Connect to the server of options->socket_dir and say HELLO. Returns
 * KVF_SUCCESS and *out (info, may be NULL, filled); KVF_ERR_NOT_FOUND (no
 * server runs there); KVF_ERR_PERMISSION; KVF_ERR_PROTOCOL (the server speaks
 * another protocol version: the message names both); KVF_ERR_TIMEOUT;
 * KVF_ERR_DISCONNECTED; KVF_ERR_INVALID_ARGUMENT; KVF_ERR_OUT_OF_MEMORY;
 * KVF_ERR_SYSTEM. */
KVF_API kvf_status kvf_client_connect(const kvf_client_options *options, kvf_client **out, kvf_client_info *info);

/* Register `geometry_json` (len bytes, the geometry file's text) with one
 * region per geometry region, in order. `device` is the GPU the engine runs
 * on (-1: host). All or nothing on the server: on failure the previous
 * registration, if any, keeps serving. Returns KVF_SUCCESS and *out (may be
 * NULL); the server's status (KVF_ERR_INVALID_ARGUMENT, KVF_ERR_PARSE,
 * KVF_ERR_INVALID_GEOMETRY, KVF_ERR_PROTOCOL...: the message names the
 * field); KVF_ERR_TIMEOUT / KVF_ERR_DISCONNECTED (the connection is then
 * unusable: disconnect); KVF_ERR_INVALID_ARGUMENT (NULL pointers, more than
 * 253 distinct allocations). */
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

/* The server's counters. */
KVF_API kvf_status kvf_client_stat(kvf_client *client, kvf_client_stats *out);

/* Close the connection (the server then drains what this client
 * registered). NULL is a no-op. */
KVF_API void kvf_client_disconnect(kvf_client *client);

#ifdef __cplusplus
}
#endif

#endif /* KVFERRY_CLIENT_H */
