/* The engine-side client of kvferryd (kvferry/client.h). */
#include <kvferry/client.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "geometry/error.h"
#include "host/endpoint.h"
#include "host/protocol.h"

struct kvf_client {
  kvf_conn conn;
  uint64_t next_request;
  uint32_t timeout_ms;
  kvf_client_info info;
};

/* Send `req` (with descriptors) and wait for its reply of type `want`.
 * An ERROR reply becomes its status with "field: message" as the last error.
 * On success *reply owns what it decoded (kvf_proto_msg_clear). */
static kvf_status client_call(kvf_client *c, kvf_proto_msg *req, const int *fds, uint32_t num_fds, uint16_t want,
                              kvf_proto_msg *reply) {
  memset(reply, 0, sizeof(*reply));
  req->request_id = c->next_request++;
  kvf_status st = kvf_conn_send(&c->conn, req, fds, num_fds, (int)c->timeout_ms);
  if (st != KVF_SUCCESS) return st;
  for (;;) {
    kvf_proto_header h;
    uint8_t *payload = NULL;
    int rfds[KVF_PROTO_MAX_FDS];
    uint32_t nr = 0;
    st = kvf_conn_read_frame(&c->conn, (int)c->timeout_ms, &h, &payload, rfds, KVF_PROTO_MAX_FDS, &nr);
    if (st != KVF_SUCCESS) return st;
    for (uint32_t i = 0; i < nr; i++) close(rfds[i]); /* a server never sends any */
    st = kvf_proto_decode(&h, payload, reply);
    free(payload);
    if (st != KVF_SUCCESS) return st;
    if (reply->request_id != req->request_id && reply->request_id != 0) {
      kvf_proto_msg_clear(reply); /* a stale reply to an earlier, timed-out request */
      continue;
    }
    if (reply->type == KVF_PROTO_ERROR) {
      kvf_status es = (kvf_status)reply->u.error.status;
      if (es == KVF_SUCCESS) es = KVF_ERR_INTERNAL;
      if (reply->u.error.field[0])
        kvf_fail(es, "%s: %s", reply->u.error.field, reply->u.error.message);
      else
        kvf_fail(es, "%s", reply->u.error.message);
      kvf_proto_msg_clear(reply);
      return es;
    }
    if (reply->type != want) {
      uint16_t got = reply->type;
      kvf_proto_msg_clear(reply);
      return kvf_fail(KVF_ERR_PROTOCOL, "header.type: expected %s, the server sent %s", kvf_proto_type_name(want),
                      kvf_proto_type_name(got));
    }
    return KVF_SUCCESS;
  }
}

kvf_status kvf_client_connect(const kvf_client_options *options, kvf_client **out, kvf_client_info *info) {
  if (!options || !out) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_client_connect: NULL argument");
  *out = NULL;
  if (options->struct_size != sizeof(kvf_client_options) || options->version != KVF_CLIENT_VERSION)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "options.struct_size: fill options from KVF_CLIENT_OPTIONS_INIT");
  if (!options->socket_dir) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "options.socket_dir: required");
  if (options->name && strlen(options->name) >= KVF_PROTO_NAME_MAX)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "options.name: longer than %u bytes", KVF_PROTO_NAME_MAX - 1);
  kvf_client *c = calloc(1, sizeof(*c));
  if (!c) return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "kvf_client_connect: out of memory");
  c->timeout_ms = options->timeout_ms ? options->timeout_ms : 10000;
  c->next_request = 1;
  kvf_proto_msg req, rep;
  memset(&req, 0, sizeof(req));
  kvf_status st = kvf_endpoint_connect(options->socket_dir, 0, &c->conn);
  if (st != KVF_SUCCESS) goto fail;
  req.type = KVF_PROTO_HELLO;
  req.u.hello.min_version = KVF_PROTO_VERSION;
  req.u.hello.max_version = KVF_PROTO_VERSION;
  req.u.hello.pid = (uint32_t)getpid();
  st = kvf_mem_instance(&req.u.hello.instance_id, &req.u.hello.generation);
  if (st != KVF_SUCCESS) goto fail;
  if (options->name) snprintf(req.u.hello.name, sizeof(req.u.hello.name), "%s", options->name);
  st = client_call(c, &req, NULL, 0, KVF_PROTO_HELLO_REPLY, &rep);
  if (st != KVF_SUCCESS) goto fail;
  c->info.client_id = rep.u.hello_reply.client_id;
  c->info.boot_token = rep.u.hello_reply.boot_token;
  c->info.server_pid = rep.u.hello_reply.server_pid;
  c->info.heartbeat_period_ms = rep.u.hello_reply.heartbeat_period_ms;
  c->info.heartbeat_timeout_ms = rep.u.hello_reply.heartbeat_timeout_ms;
  c->info.protocol_version = rep.u.hello_reply.version;
  kvf_proto_msg_clear(&rep);
  if (info) *info = c->info;
  *out = c;
  return KVF_SUCCESS;
fail:
  kvf_conn_close(&c->conn);
  free(c);
  return st;
}

kvf_status kvf_client_register(kvf_client *client, const char *geometry_json, size_t len, int device,
                               const kvf_client_region *regions, uint32_t num_regions,
                               kvf_client_registration *out) {
  if (!client || !geometry_json || (!regions && num_regions))
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_client_register: NULL argument");
  if (len > KVF_PROTO_MAX_GEOMETRY_JSON)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "geometry_json: %zu bytes, the limit is %u", len,
                    KVF_PROTO_MAX_GEOMETRY_JSON);
  if (num_regions > KVF_PROTO_MAX_REGIONS)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "num_regions: %u over the limit %u", num_regions,
                    KVF_PROTO_MAX_REGIONS);
  kvf_status st = KVF_SUCCESS;
  int fds[KVF_PROTO_MAX_FDS] = {0}; /* closed on every path: initialized for the compiler */
  kvf_mem_alloc *exported[KVF_PROTO_MAX_FDS];
  uint32_t num_fds = 0;
  kvf_proto_msg req, rep;
  memset(&req, 0, sizeof(req));
  memset(&rep, 0, sizeof(rep));
  char *json = malloc(len + 1);
  kvf_proto_region *pr = calloc(num_regions ? num_regions : 1, sizeof(*pr));
  if (!json || !pr) {
    st = kvf_fail(KVF_ERR_OUT_OF_MEMORY, "kvf_client_register: out of memory");
    goto out;
  }
  memcpy(json, geometry_json, len);
  json[len] = '\0';
  for (uint32_t i = 0; i < num_regions; i++) {
    if (!regions[i].alloc) {
      st = kvf_fail(KVF_ERR_INVALID_ARGUMENT, "regions[%u].alloc: NULL", i);
      goto out;
    }
    /* Export each distinct allocation once. */
    uint32_t k = 0;
    while (k < num_fds && exported[k] != regions[i].alloc) k++;
    kvf_mem_identity id;
    if (k == num_fds) {
      if (num_fds == KVF_PROTO_MAX_FDS) {
        st = kvf_fail(KVF_ERR_INVALID_ARGUMENT, "regions[%u].alloc: more than %u distinct allocations", i,
                      KVF_PROTO_MAX_FDS);
        goto out;
      }
      st = kvf_mem_alloc_export(regions[i].alloc, &fds[num_fds], &id);
      if (st != KVF_SUCCESS) goto out;
      exported[num_fds++] = regions[i].alloc;
    } else {
      st = kvf_mem_alloc_identity(regions[i].alloc, &id);
      if (st != KVF_SUCCESS) goto out;
    }
    pr[i].instance_id = id.instance_id;
    pr[i].allocation_id = id.allocation_id;
    pr[i].generation = id.generation;
    pr[i].size = id.size;
    memcpy(pr[i].device_uuid, id.device_uuid, sizeof(pr[i].device_uuid));
    pr[i].provider = id.provider;
    pr[i].offset = regions[i].offset;
    pr[i].length = regions[i].length;
    pr[i].fd_index = k;
  }
  req.type = KVF_PROTO_REGISTER;
  req.u.reg.device = device;
  req.u.reg.num_fds = num_fds;
  req.u.reg.geometry_json = json;
  req.u.reg.geometry_json_len = (uint32_t)len;
  req.u.reg.regions = pr;
  req.u.reg.num_regions = num_regions;
  st = client_call(client, &req, fds, num_fds, KVF_PROTO_REGISTER_REPLY, &rep);
  if (st != KVF_SUCCESS) goto out;
  if (out) {
    out->registration_id = rep.u.register_reply.registration_id;
    out->fingerprint = rep.u.register_reply.fingerprint;
    out->imports = rep.u.register_reply.imports;
    out->aliases = rep.u.register_reply.aliases;
  }
  kvf_proto_msg_clear(&rep);
out:
  for (uint32_t i = 0; i < num_fds; i++) close(fds[i]); /* the server has its own copies */
  free(json);
  free(pr);
  return st;
}

kvf_status kvf_client_unregister(kvf_client *client, uint64_t registration_id, uint32_t *state) {
  if (!client) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_client_unregister: NULL client");
  kvf_proto_msg req, rep;
  memset(&req, 0, sizeof(req));
  req.type = KVF_PROTO_UNREGISTER;
  req.u.unregister.registration_id = registration_id;
  kvf_status st = client_call(client, &req, NULL, 0, KVF_PROTO_UNREGISTER_REPLY, &rep);
  if (st != KVF_SUCCESS) return st;
  if (state) *state = rep.u.unregister_reply.state;
  kvf_proto_msg_clear(&rep);
  return KVF_SUCCESS;
}

kvf_status kvf_client_heartbeat(kvf_client *client, uint64_t *boot_token) {
  if (!client) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_client_heartbeat: NULL client");
  kvf_proto_msg req, rep;
  memset(&req, 0, sizeof(req));
  req.type = KVF_PROTO_HEARTBEAT;
  req.u.heartbeat.sequence = client->next_request;
  kvf_status st = client_call(client, &req, NULL, 0, KVF_PROTO_HEARTBEAT_REPLY, &rep);
  if (st != KVF_SUCCESS) return st;
  if (boot_token) *boot_token = rep.u.heartbeat_reply.boot_token;
  kvf_proto_msg_clear(&rep);
  return KVF_SUCCESS;
}

kvf_status kvf_client_stat(kvf_client *client, kvf_client_stats *out) {
  if (!client || !out) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_client_stat: NULL argument");
  kvf_proto_msg req, rep;
  memset(&req, 0, sizeof(req));
  req.type = KVF_PROTO_STAT;
  kvf_status st = client_call(client, &req, NULL, 0, KVF_PROTO_STAT_REPLY, &rep);
  if (st != KVF_SUCCESS) return st;
  const kvf_proto_counters *t = &rep.u.stat_reply.total;
  memset(out, 0, sizeof(*out));
  out->boot_token = rep.u.stat_reply.boot_token;
  out->registering = t->registrations[KVF_PROTO_REG_REGISTERING];
  out->active = t->registrations[KVF_PROTO_REG_ACTIVE];
  out->draining = t->registrations[KVF_PROTO_REG_DRAINING];
  out->closed_total = t->registrations[KVF_PROTO_REG_CLOSED];
  out->failed_total = t->registrations[KVF_PROTO_REG_FAILED];
  out->imports = t->imports;
  out->aliases = t->aliases;
  out->leases = t->leases;
  kvf_proto_msg_clear(&rep);
  return KVF_SUCCESS;
}

void kvf_client_disconnect(kvf_client *client) {
  if (!client) return;
  kvf_conn_close(&client->conn);
  free(client);
}
