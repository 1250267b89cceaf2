/* The kvferryd wire protocol: frame encode/decode and the incremental reader
 * (host/protocol.h, docs/protocol.md). */
#define _POSIX_C_SOURCE 200809L /* strnlen */
#include "host/ipc/protocol.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "common/utf8.h"

_Static_assert(KVF_PROTO_KEY_BYTES == KVF_CHUNK_KEY_BYTES && sizeof(kvf_chunk_key) == KVF_PROTO_KEY_BYTES,
               "a chunk key is its 32 bytes, on the wire and in memory");
_Static_assert(KVF_PROTO_MAX_SHARDS == KVF_CLIENT_MAX_SHARDS, "the client checks the protocol's shard limit");

/* kvf_status values an ERROR reply may carry: 1 .. the highest pinned one. */
#define KVF_PROTO_MAX_STATUS 20u

/* Fixed sizes of the array elements, for counting before allocating. */
#define KVF_PROTO_REGION_WIRE 88u /* 4 x u64, 16-byte uuid, 2 x u32, 3 x u64, 2 x u32 */
#define KVF_PROTO_COUNTERS_WIRE (KVF_PROTO_REG_NUM_STATES * 4u + 24u)

const char *kvf_proto_type_name(uint16_t type) {
  switch (type) {
  case KVF_PROTO_HELLO: return "HELLO";
  case KVF_PROTO_REGISTER: return "REGISTER";
  case KVF_PROTO_UNREGISTER: return "UNREGISTER";
  case KVF_PROTO_HEARTBEAT: return "HEARTBEAT";
  case KVF_PROTO_STAT: return "STAT";
  case KVF_PROTO_STORE: return "STORE";
  case KVF_PROTO_RETRIEVE: return "RETRIEVE";
  case KVF_PROTO_LOOKUP: return "LOOKUP";
  case KVF_PROTO_UNPIN: return "UNPIN";
  case KVF_PROTO_PUSH: return "PUSH";
  case KVF_PROTO_HELLO_REPLY: return "HELLO_REPLY";
  case KVF_PROTO_REGISTER_REPLY: return "REGISTER_REPLY";
  case KVF_PROTO_UNREGISTER_REPLY: return "UNREGISTER_REPLY";
  case KVF_PROTO_HEARTBEAT_REPLY: return "HEARTBEAT_REPLY";
  case KVF_PROTO_STAT_REPLY: return "STAT_REPLY";
  case KVF_PROTO_STORE_REPLY: return "STORE_REPLY";
  case KVF_PROTO_RETRIEVE_REPLY: return "RETRIEVE_REPLY";
  case KVF_PROTO_LOOKUP_REPLY: return "LOOKUP_REPLY";
  case KVF_PROTO_UNPIN_REPLY: return "UNPIN_REPLY";
  case KVF_PROTO_PUSH_REPLY: return "PUSH_REPLY";
  case KVF_PROTO_RETIRED: return "RETIRED";
  case KVF_PROTO_ERROR: return "ERROR";
  default: return "unknown";
  }
}

static int type_known(uint16_t type) { return strcmp(kvf_proto_type_name(type), "unknown") != 0; }

/* ---- writing ------------------------------------------------------------- */

/* A growable byte buffer; `oom` is sticky so callers check once at the end. */
typedef struct wbuf {
  uint8_t *p;
  size_t len, cap;
  int oom;
} wbuf;

static uint8_t *w_reserve(wbuf *w, size_t n) {
  if (w->oom) return NULL;
  if (n > SIZE_MAX - w->len) {
    w->oom = 1;
    return NULL;
  }
  if (w->len + n > w->cap) {
    size_t cap = w->cap ? w->cap : 256;
    while (cap < w->len + n) cap = cap > SIZE_MAX / 2 ? w->len + n : cap * 2;
    uint8_t *np = realloc(w->p, cap);
    if (!np) {
      w->oom = 1;
      return NULL;
    }
    w->p = np;
    w->cap = cap;
  }
  uint8_t *at = w->p + w->len;
  w->len += n;
  return at;
}

static void put_le(uint8_t *at, uint64_t v, unsigned bytes) {
  for (unsigned i = 0; i < bytes; i++) at[i] = (uint8_t)(v >> (8 * i));
}
static void w_u16(wbuf *w, uint16_t v) {
  uint8_t *at = w_reserve(w, 2);
  if (at) put_le(at, v, 2);
}
static void w_u32(wbuf *w, uint32_t v) {
  uint8_t *at = w_reserve(w, 4);
  if (at) put_le(at, v, 4);
}
static void w_u64(wbuf *w, uint64_t v) {
  uint8_t *at = w_reserve(w, 8);
  if (at) put_le(at, v, 8);
}
static void w_bytes(wbuf *w, const void *src, size_t n) {
  uint8_t *at = w_reserve(w, n);
  if (at && n) memcpy(at, src, n);
}
static void w_str(wbuf *w, const char *s, size_t len) {
  w_u32(w, (uint32_t)len);
  w_bytes(w, s, len);
}

/* Encode-side checks: the same limits the decoder enforces. */
static kvf_status e_str(const char *s, size_t cap, const char *field, size_t *len) {
  size_t n = strnlen(s, cap);
  if (n >= cap)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "%s: not NUL-terminated within %zu bytes", field, cap);
  *len = n;
  return KVF_SUCCESS;
}

static void w_counters(wbuf *w, const kvf_proto_counters *c) {
  for (unsigned i = 0; i < KVF_PROTO_REG_NUM_STATES; i++) w_u32(w, c->registrations[i]);
  w_u64(w, c->imports);
  w_u64(w, c->aliases);
  w_u64(w, c->leases);
}

/* Chunk keys, the one place their wire form is written. */
static void w_keys(wbuf *w, const kvf_proto_chunk_key *keys, uint32_t n) {
  for (uint32_t k = 0; k < n; k++) w_bytes(w, keys[k].bytes, KVF_PROTO_KEY_BYTES);
}

static int key_zero(const kvf_chunk_key *k);

/* The index of the first key that is not one (all zero), or n. */
static uint32_t keys_first_zero(const kvf_proto_chunk_key *keys, uint32_t n) {
  uint32_t k = 0;
  while (k < n && !key_zero(&keys[k])) k++;
  return k;
}

/* ---- LOOKUP rules both directions share ----------------------------------- */

/* The checks on a LOOKUP that need none of its keys (prefix "lookup" and
 * KVF_ERR_INVALID_ARGUMENT for the encoder, "payload" and KVF_ERR_PROTOCOL
 * for the decoder, as xfer_check_fixed). */
/* The range, format and key count of a LOOKUP or PUSH (`what` names it in
 * the count's message). */
static kvf_status keyed_range_check(uint64_t token_begin, uint64_t token_end, uint32_t format,
                                    uint32_t num_chunk_keys, const char *what, const char *p, kvf_status err) {
  if (token_end <= token_begin)
    return kvf_fail(err, "%s.token_end: %llu is not after token_begin %llu", p, (unsigned long long)token_end,
                    (unsigned long long)token_begin);
  if (format > 1) return kvf_fail(err, "%s.format: %u is neither 0 (canonical) nor 1 (native)", p, format);
  if (num_chunk_keys == 0) return kvf_fail(err, "%s.num_chunk_keys: 0, a %s spans at least one chunk", p, what);
  if (num_chunk_keys > KVF_PROTO_MAX_CHUNKS)
    return kvf_fail(err, "%s.num_chunk_keys: count %u exceeds the %u limit", p, num_chunk_keys, KVF_PROTO_MAX_CHUNKS);
  if (num_chunk_keys > token_end - token_begin)
    return kvf_fail(err, "%s.num_chunk_keys: %u chunks for a range of %llu tokens", p, num_chunk_keys,
                    (unsigned long long)(token_end - token_begin));
  return KVF_SUCCESS;
}

static kvf_status lookup_check_fixed(const kvf_proto_lookup *q, const char *p, kvf_status err) {
  if (q->pin_ms > KVF_PROTO_MAX_PIN_MS)
    return kvf_fail(err, "%s.pin_ms: %u exceeds the %u ms limit", p, q->pin_ms, KVF_PROTO_MAX_PIN_MS);
  return keyed_range_check(q->token_begin, q->token_end, q->format, q->num_chunk_keys, "lookup", p, err);
}

static kvf_status lookup_reply_check(const kvf_proto_lookup_reply *x, const char *p, kvf_status err) {
  if (x->num_object_groups > KVF_PROTO_MAX_GROUPS)
    return kvf_fail(err, "%s.num_object_groups: count %u exceeds the %u limit", p, x->num_object_groups,
                    KVF_PROTO_MAX_GROUPS);
  if ((x->pin_id == 0) != (x->pinned_chunks == 0))
    return kvf_fail(err, "%s.pinned_chunks: %u with pin_id %llu (0 exactly when nothing is pinned)", p,
                    x->pinned_chunks, (unsigned long long)x->pin_id);
  return KVF_SUCCESS;
}

/* ---- PUSH rules both directions share -------------------------------------- */

static kvf_status push_check_fixed(const kvf_proto_push *q, const char *p, kvf_status err) {
  return keyed_range_check(q->token_begin, q->token_end, q->format, q->num_chunk_keys, "push", p, err);
}

static kvf_status push_reply_check(const kvf_proto_push_reply *x, const char *p, kvf_status err) {
  if (x->bytes_pushed && !x->objects_pushed)
    return kvf_fail(err, "%s.bytes_pushed: %llu bytes for 0 objects", p, (unsigned long long)x->bytes_pushed);
  return KVF_SUCCESS;
}

/* ---- STORE / RETRIEVE rules both directions share ------------------------- */

/* The checks on a STORE or RETRIEVE that need none of its arrays. The
 * encoder runs them on what it is given (prefix "xfer",
 * KVF_ERR_INVALID_ARGUMENT), the decoder on the fixed fields it has read
 * ("payload", KVF_ERR_PROTOCOL), so a frame the encoder writes always
 * decodes and both name a field the same way. */
static kvf_status xfer_check_fixed(const kvf_proto_xfer *x, uint16_t type, const char *p, kvf_status err) {
  if (x->token_end <= x->token_begin)
    return kvf_fail(err, "%s.token_end: %llu is not after token_begin %llu", p, (unsigned long long)x->token_end,
                    (unsigned long long)x->token_begin);
  if (x->format > 1) return kvf_fail(err, "%s.format: %u is neither 0 (canonical) nor 1 (native)", p, x->format);
  if (x->ready_kind > KVF_PROTO_READY_CUDA_EVENT)
    return kvf_fail(err, "%s.ready_kind: %u is neither 0 (none) nor 1 (CUDA event)", p, x->ready_kind);
  if (type == KVF_PROTO_RETRIEVE && x->ready_kind != KVF_PROTO_READY_NONE)
    return kvf_fail(err, "%s.ready_kind: %u, but a RETRIEVE waits for nothing (0)", p, x->ready_kind);
  unsigned nz = 0; /* the first nonzero byte of the handle */
  while (nz < KVF_PROTO_READY_HANDLE_BYTES && x->ready_handle[nz] == 0) nz++;
  if (x->ready_kind == KVF_PROTO_READY_NONE && nz < KVF_PROTO_READY_HANDLE_BYTES)
    return kvf_fail(err, "%s.ready_handle: byte %u is 0x%02x; the handle is all zero unless ready_kind is 1", p, nz,
                    (unsigned)x->ready_handle[nz]);
  if (x->ready_kind == KVF_PROTO_READY_CUDA_EVENT && nz == KVF_PROTO_READY_HANDLE_BYTES)
    return kvf_fail(err, "%s.ready_handle: all zero, but ready_kind 1 needs a CUDA event handle", p);
  if (x->num_chunk_keys == 0) return kvf_fail(err, "%s.num_chunk_keys: 0, a request spans at least one chunk", p);
  if (x->num_chunk_keys > KVF_PROTO_MAX_CHUNKS)
    return kvf_fail(err, "%s.num_chunk_keys: count %u exceeds the %u limit", p, x->num_chunk_keys,
                    KVF_PROTO_MAX_CHUNKS);
  /* Whatever the chunk size, every chunk holds at least one token. */
  if (x->num_chunk_keys > x->token_end - x->token_begin)
    return kvf_fail(err, "%s.num_chunk_keys: %u chunks for a range of %llu tokens", p, x->num_chunk_keys,
                    (unsigned long long)(x->token_end - x->token_begin));
  if (x->num_groups == 0) return kvf_fail(err, "%s.num_groups: 0, nothing to move", p);
  if (x->num_groups > KVF_PROTO_MAX_GROUPS)
    return kvf_fail(err, "%s.num_groups: count %u exceeds the %u limit", p, x->num_groups, KVF_PROTO_MAX_GROUPS);
  return KVF_SUCCESS;
}

/* REGISTER's shard, both directions (see xfer_check_fixed). */
static kvf_status shard_check(uint32_t index, uint32_t count, const char *p, kvf_status err) {
  if (count == 0) return kvf_fail(err, "%s.shard_count: 0; an unsharded worker is shard 0 of 1", p);
  if (count > KVF_PROTO_MAX_SHARDS)
    return kvf_fail(err, "%s.shard_count: %u exceeds the %u limit", p, count, KVF_PROTO_MAX_SHARDS);
  if (index >= count) return kvf_fail(err, "%s.shard_index: %u is not below shard_count %u", p, index, count);
  return KVF_SUCCESS;
}

static int key_zero(const kvf_chunk_key *k) {
  uint8_t any = 0;
  for (unsigned i = 0; i < KVF_PROTO_KEY_BYTES; i++) any |= k->bytes[i];
  return any == 0;
}

static const char *outcome_name(uint32_t outcome) {
  switch (outcome) {
  case 1: return "done";
  case 2: return "failed";
  case 3: return "cancelled";
  case 4: return "timed out";
  default: return "unknown";
  }
}

/* The same for a STORE_REPLY or RETRIEVE_REPLY: everything but the arrays'
 * contents and the message. */
static kvf_status xfer_reply_check(const kvf_proto_xfer_reply *x, uint16_t type, const char *p, kvf_status err) {
  if (x->status > KVF_PROTO_MAX_STATUS) return kvf_fail(err, "%s.status: %u is not a kvf_status", p, x->status);
  if (x->outcome < 1 || x->outcome > 4)
    return kvf_fail(err, "%s.outcome: %u is not 1 (done), 2 (failed), 3 (cancelled) or 4 (timed out)", p,
                    x->outcome);
  if (x->outcome == 1 && x->status != 0)
    return kvf_fail(err, "%s.status: %u, but the outcome is done (status 0)", p, x->status);
  if (x->outcome != 1 && x->status == 0)
    return kvf_fail(err, "%s.status: 0 (success), but the outcome is %s", p, outcome_name(x->outcome));
  if (x->num_groups > KVF_PROTO_MAX_GROUPS)
    return kvf_fail(err, "%s.num_groups: count %u exceeds the %u limit", p, x->num_groups, KVF_PROTO_MAX_GROUPS);
  if (x->num_object_groups > KVF_PROTO_MAX_GROUPS)
    return kvf_fail(err, "%s.num_object_groups: count %u exceeds the %u limit", p, x->num_object_groups,
                    KVF_PROTO_MAX_GROUPS);
  if (type == KVF_PROTO_STORE_REPLY && x->num_object_groups != 0)
    return kvf_fail(err, "%s.num_object_groups: %u, a STORE_REPLY carries none", p, x->num_object_groups);
  if (type == KVF_PROTO_RETRIEVE_REPLY && x->objects_present != 0)
    return kvf_fail(err, "%s.objects_present: %llu, a RETRIEVE_REPLY carries 0", p,
                    (unsigned long long)x->objects_present);
  return KVF_SUCCESS;
}

static kvf_status encode_payload(const kvf_proto_msg *m, wbuf *w) {
  size_t n = 0, n2 = 0;
  kvf_status st;
  switch (m->type) {
  case KVF_PROTO_HELLO: {
    const kvf_proto_hello *h = &m->u.hello;
    if ((st = e_str(h->name, KVF_PROTO_NAME_MAX, "hello.name", &n))) return st;
    size_t bad = 0;
    const char *why = "";
    if (!kvf_utf8_valid(h->name, n, &bad, &why))
      return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "hello.name: not UTF-8: %s at byte %zu (0x%02x)", why, bad,
                      (unsigned)(uint8_t)h->name[bad]);
    w_u16(w, h->min_version);
    w_u16(w, h->max_version);
    w_u32(w, h->pid);
    w_u64(w, h->instance_id);
    w_u64(w, h->generation);
    w_str(w, h->name, n);
    return KVF_SUCCESS;
  }
  case KVF_PROTO_HELLO_REPLY: {
    const kvf_proto_hello_reply *h = &m->u.hello_reply;
    w_u16(w, h->version);
    w_u16(w, 0);
    w_u32(w, h->server_pid);
    w_u64(w, h->boot_token);
    w_u64(w, h->client_id);
    w_u32(w, h->heartbeat_period_ms);
    w_u32(w, h->heartbeat_timeout_ms);
    w_u32(w, h->max_payload);
    return KVF_SUCCESS;
  }
  case KVF_PROTO_REGISTER: {
    const kvf_proto_register *r = &m->u.reg;
    if (r->num_regions > KVF_PROTO_MAX_REGIONS)
      return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "register.num_regions: %u exceeds the %u limit", r->num_regions,
                      KVF_PROTO_MAX_REGIONS);
    if (r->num_fds > KVF_PROTO_MAX_FDS)
      return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "register.num_fds: %u exceeds the %u limit", r->num_fds,
                      KVF_PROTO_MAX_FDS);
    if (r->geometry_json_len > KVF_PROTO_MAX_GEOMETRY_JSON)
      return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "register.geometry_json: %u bytes exceed the %u limit",
                      r->geometry_json_len, KVF_PROTO_MAX_GEOMETRY_JSON);
    if ((r->geometry_json_len && !r->geometry_json) || (r->num_regions && !r->regions))
      return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "register: NULL geometry_json or regions with a nonzero count");
    if ((st = shard_check(r->shard_index, r->shard_count, "register", KVF_ERR_INVALID_ARGUMENT))) return st;
    w_u32(w, (uint32_t)r->device);
    w_u32(w, r->num_fds);
    w_u32(w, r->num_regions);
    w_u32(w, r->shard_index);
    w_u32(w, r->shard_count);
    w_str(w, r->geometry_json, r->geometry_json_len);
    for (uint32_t i = 0; i < r->num_regions; i++) {
      const kvf_proto_region *g = &r->regions[i];
      w_u64(w, g->instance_id);
      w_u64(w, g->allocation_id);
      w_u64(w, g->generation);
      w_u64(w, g->size);
      w_bytes(w, g->device_uuid, 16);
      w_u32(w, g->provider);
      w_u32(w, 0); /* reserved0 */
      w_u64(w, 0); /* reserved1 */
      w_u64(w, g->offset);
      w_u64(w, g->length);
      w_u32(w, g->fd_index);
      w_u32(w, 0);
    }
    return KVF_SUCCESS;
  }
  case KVF_PROTO_REGISTER_REPLY:
    w_u64(w, m->u.register_reply.registration_id);
    w_u64(w, m->u.register_reply.fingerprint);
    w_u32(w, m->u.register_reply.imports);
    w_u32(w, m->u.register_reply.aliases);
    return KVF_SUCCESS;
  case KVF_PROTO_UNREGISTER:
    w_u64(w, m->u.unregister.registration_id);
    return KVF_SUCCESS;
  case KVF_PROTO_UNREGISTER_REPLY:
    w_u64(w, m->u.unregister_reply.registration_id);
    w_u32(w, m->u.unregister_reply.state);
    w_u32(w, 0);
    return KVF_SUCCESS;
  case KVF_PROTO_HEARTBEAT:
    w_u64(w, m->u.heartbeat.sequence);
    return KVF_SUCCESS;
  case KVF_PROTO_HEARTBEAT_REPLY:
    w_u64(w, m->u.heartbeat_reply.sequence);
    w_u64(w, m->u.heartbeat_reply.boot_token);
    return KVF_SUCCESS;
  case KVF_PROTO_STAT:
    w_u32(w, m->u.stat.flags);
    return KVF_SUCCESS;
  case KVF_PROTO_STAT_REPLY: {
    const kvf_proto_stat_reply *s = &m->u.stat_reply;
    if (s->num_clients > KVF_PROTO_MAX_STAT_CLIENTS)
      return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "stat_reply.num_clients: %u exceeds the %u limit", s->num_clients,
                      KVF_PROTO_MAX_STAT_CLIENTS);
    if (s->num_clients && !s->clients)
      return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "stat_reply.clients: NULL with a nonzero count");
    w_u64(w, s->boot_token);
    w_counters(w, &s->total);
    w_u64(w, s->data.l1_objects);
    w_u64(w, s->data.l1_bytes);
    w_u64(w, s->data.l1_pool_bytes);
    w_u64(w, s->data.l1_evicted_entries_total);
    w_u64(w, s->data.stores_total);
    w_u64(w, s->data.retrieves_total);
    w_u64(w, s->data.in_flight);
    w_u32(w, s->data.lanes);
    w_u32(w, s->num_clients);
    for (uint32_t i = 0; i < s->num_clients; i++) {
      const kvf_proto_stat_client *c = &s->clients[i];
      if ((st = e_str(c->name, KVF_PROTO_NAME_MAX, "stat_reply.clients[].name", &n))) return st;
      w_u64(w, c->client_id);
      w_u32(w, c->pid);
      w_str(w, c->name, n);
      w_counters(w, &c->counters);
    }
    if (s->has_peers) {
      if (s->num_peers > KVF_PROTO_MAX_STAT_PEERS || (s->num_peers && !s->peers))
        return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "stat_reply.num_peers: %u (at most %u, with peers)", s->num_peers,
                        KVF_PROTO_MAX_STAT_PEERS);
      w_u32(w, s->num_peers);
      for (uint32_t i = 0; i < s->num_peers; i++) {
        const kvf_proto_stat_peer *pr = &s->peers[i];
        if ((st = e_str(pr->addr, KVF_PROTO_NAME_MAX, "stat_reply.peers[].addr", &n))) return st;
        w_str(w, pr->addr, n);
        w_u32(w, pr->state);
        w_u32(w, pr->outgoing);
        w_u64(w, pr->boot_token);
        w_u64(w, pr->connects);
        w_u64(w, pr->objects_pulled);
        w_u64(w, pr->bytes_pulled);
        w_u64(w, pr->objects_served);
        w_u64(w, pr->failures);
        w_u64(w, pr->objects_pushed);
        w_u64(w, pr->bytes_pushed);
      }
    }
    return KVF_SUCCESS;
  }
  case KVF_PROTO_STORE:
  case KVF_PROTO_RETRIEVE: {
    const kvf_proto_xfer *x = &m->u.xfer;
    if ((st = xfer_check_fixed(x, m->type, "xfer", KVF_ERR_INVALID_ARGUMENT))) return st;
    if (!x->chunk_keys) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "xfer.chunk_keys: NULL with a nonzero count");
    if (!x->groups) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "xfer.groups: NULL with a nonzero count");
    for (uint32_t k = 0; k < x->num_chunk_keys; k++)
      if (key_zero(&x->chunk_keys[k]))
        return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "xfer.chunk_keys[%u]: all zero is not a key", k);
    for (uint32_t i = 0; i < x->num_groups; i++) {
      const kvf_proto_group *g = &x->groups[i];
      if (g->count > KVF_PROTO_MAX_BLOCKS_PER_GROUP)
        return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "xfer.groups[%u].block_ids: count %u exceeds the %u limit", i,
                        g->count, KVF_PROTO_MAX_BLOCKS_PER_GROUP);
      if (g->count && !g->block_ids)
        return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "xfer.groups[%u].block_ids: NULL with a nonzero count", i);
    }
    w_u64(w, x->registration_id);
    w_u64(w, x->token_begin);
    w_u64(w, x->token_end);
    w_u32(w, x->format);
    w_u32(w, x->ready_kind);
    w_bytes(w, x->ready_handle, KVF_PROTO_READY_HANDLE_BYTES);
    w_u32(w, x->num_chunk_keys);
    w_u32(w, x->num_groups);
    for (uint32_t k = 0; k < x->num_chunk_keys; k++) w_bytes(w, x->chunk_keys[k].bytes, KVF_PROTO_KEY_BYTES);
    for (uint32_t i = 0; i < x->num_groups; i++) {
      const kvf_proto_group *g = &x->groups[i];
      w_u64(w, g->first_block);
      w_u32(w, g->count);
      for (uint32_t k = 0; k < g->count; k++) w_u32(w, g->block_ids[k]);
    }
    return KVF_SUCCESS;
  }
  case KVF_PROTO_STORE_REPLY:
  case KVF_PROTO_RETRIEVE_REPLY: {
    const kvf_proto_xfer_reply *x = &m->u.xfer_reply;
    if ((st = xfer_reply_check(x, m->type, "xfer_reply", KVF_ERR_INVALID_ARGUMENT))) return st;
    if (x->num_groups && !x->group_blocks)
      return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "xfer_reply.group_blocks: NULL with a nonzero count");
    if (x->num_object_groups && !x->og_prefix_tokens)
      return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "xfer_reply.og_prefix_tokens: NULL with a nonzero count");
    if ((st = e_str(x->message, KVF_PROTO_MESSAGE_MAX, "xfer_reply.message", &n))) return st;
    w_u32(w, x->status);
    w_u32(w, x->outcome);
    w_u64(w, x->prefix_tokens);
    w_u64(w, x->objects_done);
    w_u64(w, x->objects_present);
    w_u64(w, x->bytes_done);
    w_u32(w, x->num_groups);
    w_u32(w, x->num_object_groups);
    for (uint32_t i = 0; i < x->num_groups; i++) w_u64(w, x->group_blocks[i]);
    for (uint32_t i = 0; i < x->num_object_groups; i++) w_u64(w, x->og_prefix_tokens[i]);
    w_str(w, x->message, n);
    return KVF_SUCCESS;
  }
  case KVF_PROTO_LOOKUP: {
    const kvf_proto_lookup *q = &m->u.lookup;
    if ((st = lookup_check_fixed(q, "lookup", KVF_ERR_INVALID_ARGUMENT))) return st;
    if (!q->chunk_keys) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "lookup.chunk_keys: NULL with a nonzero count");
    uint32_t zero = keys_first_zero(q->chunk_keys, q->num_chunk_keys);
    if (zero < q->num_chunk_keys)
      return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "lookup.chunk_keys[%u]: all zero is not a key", zero);
    w_u64(w, q->registration_id);
    w_u64(w, q->token_begin);
    w_u64(w, q->token_end);
    w_u32(w, q->format);
    w_u32(w, q->pin_ms);
    w_u32(w, q->num_chunk_keys);
    w_u32(w, 0); /* reserved */
    w_keys(w, q->chunk_keys, q->num_chunk_keys);
    return KVF_SUCCESS;
  }
  case KVF_PROTO_LOOKUP_REPLY: {
    const kvf_proto_lookup_reply *x = &m->u.lookup_reply;
    if ((st = lookup_reply_check(x, "lookup_reply", KVF_ERR_INVALID_ARGUMENT))) return st;
    if (x->num_object_groups && !x->og_prefix_tokens)
      return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "lookup_reply.og_prefix_tokens: NULL with a nonzero count");
    w_u64(w, x->prefix_tokens);
    w_u64(w, x->pin_id);
    w_u32(w, x->pinned_chunks);
    w_u32(w, x->num_object_groups);
    for (uint32_t i = 0; i < x->num_object_groups; i++) w_u64(w, x->og_prefix_tokens[i]);
    return KVF_SUCCESS;
  }
  case KVF_PROTO_PUSH: {
    const kvf_proto_push *q = &m->u.push;
    if ((st = push_check_fixed(q, "push", KVF_ERR_INVALID_ARGUMENT))) return st;
    if ((st = e_str(q->peer, KVF_PROTO_NAME_MAX, "push.peer", &n))) return st;
    if (n == 0) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "push.peer: empty; name a peer (ADDR:PORT or boot token)");
    for (size_t i = 0; i < n; i++)
      if (q->peer[i] < 0x21 || q->peer[i] > 0x7e)
        return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "push.peer: byte 0x%02x at %zu (an address or boot token is printable ASCII)",
                        (unsigned)(uint8_t)q->peer[i], i);
    if (!q->chunk_keys) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "push.chunk_keys: NULL with a nonzero count");
    uint32_t zero = keys_first_zero(q->chunk_keys, q->num_chunk_keys);
    if (zero < q->num_chunk_keys)
      return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "push.chunk_keys[%u]: all zero is not a key", zero);
    w_u64(w, q->registration_id);
    w_u64(w, q->token_begin);
    w_u64(w, q->token_end);
    w_u32(w, q->format);
    w_u32(w, q->num_chunk_keys);
    w_str(w, q->peer, n);
    w_keys(w, q->chunk_keys, q->num_chunk_keys);
    return KVF_SUCCESS;
  }
  case KVF_PROTO_PUSH_REPLY: {
    const kvf_proto_push_reply *x = &m->u.push_reply;
    if ((st = push_reply_check(x, "push_reply", KVF_ERR_INVALID_ARGUMENT))) return st;
    w_u64(w, x->objects_pushed);
    w_u64(w, x->objects_present);
    w_u64(w, x->objects_missing);
    w_u64(w, x->objects_failed);
    w_u64(w, x->bytes_pushed);
    w_u64(w, x->chunks_on_peer);
    return KVF_SUCCESS;
  }
  case KVF_PROTO_UNPIN:
    if (m->u.unpin.pin_id == 0) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "unpin.pin_id: 0 is not a pin");
    w_u64(w, m->u.unpin.pin_id);
    return KVF_SUCCESS;
  case KVF_PROTO_UNPIN_REPLY:
    if (m->u.unpin_reply.released > 1)
      return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "unpin_reply.released: %u is neither 0 nor 1",
                      m->u.unpin_reply.released);
    w_u64(w, m->u.unpin_reply.pin_id);
    w_u32(w, m->u.unpin_reply.released);
    w_u32(w, 0);
    return KVF_SUCCESS;
  case KVF_PROTO_RETIRED:
    if (m->u.retired.outcome != 3 && m->u.retired.outcome != 4)
      return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "retired.outcome: %u is neither 3 (cancelled) nor 4 (timed out)",
                      m->u.retired.outcome);
    w_u32(w, m->u.retired.outcome);
    w_u32(w, 0);
    return KVF_SUCCESS;
  case KVF_PROTO_ERROR: {
    const kvf_proto_error *e = &m->u.error;
    if ((st = e_str(e->field, KVF_PROTO_FIELD_MAX, "error.field", &n))) return st;
    if ((st = e_str(e->message, KVF_PROTO_MESSAGE_MAX, "error.message", &n2))) return st;
    w_u32(w, e->status);
    w_u16(w, e->version);
    w_u16(w, 0);
    w_str(w, e->field, n);
    w_str(w, e->message, n2);
    return KVF_SUCCESS;
  }
  default:
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "type: 0x%04x is not a message type", (unsigned)m->type);
  }
}

kvf_status kvf_proto_encode(const kvf_proto_msg *msg, uint8_t **out, size_t *out_len) {
  if (!msg || !out || !out_len) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_proto_encode: NULL argument");
  wbuf w = {0};
  kvf_status st = KVF_SUCCESS;
  w_reserve(&w, KVF_PROTO_HEADER_SIZE); /* filled once the payload's length is known */
  if ((st = encode_payload(msg, &w))) goto out;
  if (w.oom) {
    st = kvf_fail(KVF_ERR_OUT_OF_MEMORY, "kvf_proto_encode: out of memory for a %s frame",
                  kvf_proto_type_name(msg->type));
    goto out;
  }
  size_t payload = w.len - KVF_PROTO_HEADER_SIZE;
  if (payload > KVF_PROTO_MAX_PAYLOAD) {
    st = kvf_fail(KVF_ERR_INVALID_ARGUMENT, "payload: %zu bytes exceed the %u limit", payload,
                  KVF_PROTO_MAX_PAYLOAD);
    goto out;
  }
  put_le(w.p + 0, KVF_PROTO_MAGIC, 4);
  put_le(w.p + 4, KVF_PROTO_VERSION, 2);
  put_le(w.p + 6, msg->type, 2);
  put_le(w.p + 8, msg->request_id, 8);
  put_le(w.p + 16, payload, 4);
  put_le(w.p + 20, 0, 4);
  *out = w.p;
  *out_len = w.len;
  w.p = NULL;
out:
  free(w.p);
  return st;
}

/* ---- reading ------------------------------------------------------------- */

static uint64_t get_le(const uint8_t *at, unsigned bytes) {
  uint64_t v = 0;
  for (unsigned i = 0; i < bytes; i++) v |= (uint64_t)at[i] << (8 * i);
  return v;
}

/* A cursor over the payload. Every read names its field for the message. */
typedef struct rbuf {
  const uint8_t *p;
  size_t len, pos;
} rbuf;

static kvf_status r_need(rbuf *r, size_t n, const char *field) {
  if (r->len - r->pos < n)
    return kvf_fail(KVF_ERR_PROTOCOL, "%s: the payload ends at byte %zu, %zu bytes short", field, r->len,
                    n - (r->len - r->pos));
  return KVF_SUCCESS;
}
static kvf_status r_u16(rbuf *r, uint16_t *v, const char *field) {
  kvf_status st = r_need(r, 2, field);
  if (st) return st;
  *v = (uint16_t)get_le(r->p + r->pos, 2);
  r->pos += 2;
  return KVF_SUCCESS;
}
static kvf_status r_u32(rbuf *r, uint32_t *v, const char *field) {
  kvf_status st = r_need(r, 4, field);
  if (st) return st;
  *v = (uint32_t)get_le(r->p + r->pos, 4);
  r->pos += 4;
  return KVF_SUCCESS;
}
static kvf_status r_u64(rbuf *r, uint64_t *v, const char *field) {
  kvf_status st = r_need(r, 8, field);
  if (st) return st;
  *v = get_le(r->p + r->pos, 8);
  r->pos += 8;
  return KVF_SUCCESS;
}
static kvf_status r_zero16(rbuf *r, const char *field) {
  uint16_t v = 0;
  kvf_status st = r_u16(r, &v, field);
  if (!st && v) st = kvf_fail(KVF_ERR_PROTOCOL, "%s: reserved, must be 0 (got %u)", field, (unsigned)v);
  return st;
}
static kvf_status r_zero32(rbuf *r, const char *field) {
  uint32_t v = 0;
  kvf_status st = r_u32(r, &v, field);
  if (!st && v) st = kvf_fail(KVF_ERR_PROTOCOL, "%s: reserved, must be 0 (got %u)", field, v);
  return st;
}

/* A string: u32 length, then that many bytes with no NUL among them. Its
 * bytes stay in the payload; *s points at them (not terminated). */
static kvf_status r_str_view(rbuf *r, uint32_t max_len, const char *field, const uint8_t **s, uint32_t *len) {
  uint32_t n = 0;
  kvf_status st = r_u32(r, &n, field);
  if (st) return st;
  if (n > max_len) return kvf_fail(KVF_ERR_PROTOCOL, "%s: length %u exceeds the %u limit", field, n, max_len);
  if ((st = r_need(r, n, field))) return st;
  const uint8_t *at = r->p + r->pos;
  const uint8_t *nul = n ? memchr(at, 0, n) : NULL;
  if (nul) return kvf_fail(KVF_ERR_PROTOCOL, "%s: NUL byte at offset %zu", field, (size_t)(nul - at));
  *s = at;
  *len = n;
  r->pos += n;
  return KVF_SUCCESS;
}

/* A string into a fixed array of `cap` bytes (at most cap - 1 of text). */
static kvf_status r_str_fixed(rbuf *r, char *dst, size_t cap, const char *field) {
  const uint8_t *s = NULL;
  uint32_t n = 0;
  kvf_status st = r_str_view(r, (uint32_t)cap - 1, field, &s, &n);
  if (st) return st;
  if (n) memcpy(dst, s, n);
  dst[n] = '\0';
  return KVF_SUCCESS;
}

/* A count read from the wire, checked against its limit and against what
 * the rest of the payload can hold (elem bytes each) before any allocation. */
static kvf_status r_count(rbuf *r, uint32_t *count, uint32_t limit, size_t elem, const char *field) {
  kvf_status st = r_u32(r, count, field);
  if (st) return st;
  if (*count > limit)
    return kvf_fail(KVF_ERR_PROTOCOL, "%s: count %u exceeds the %u limit", field, *count, limit);
  if (elem && (r->len - r->pos) / elem < *count)
    return kvf_fail(KVF_ERR_PROTOCOL, "%s: count %u needs at least %zu bytes, the payload has %zu left", field,
                    *count, (size_t)*count * elem, r->len - r->pos);
  return KVF_SUCCESS;
}

/* Room for count elements of elem bytes in what is left of the payload
 * (the count itself already checked against its limit). */
static kvf_status r_room(rbuf *r, uint32_t count, size_t elem, const char *field) {
  if ((r->len - r->pos) / elem < count)
    return kvf_fail(KVF_ERR_PROTOCOL, "%s: count %u needs at least %zu bytes, the payload has %zu left", field, count,
                    (size_t)count * elem, r->len - r->pos);
  return KVF_SUCCESS;
}

static kvf_status r_counters(rbuf *r, kvf_proto_counters *c, const char *prefix) {
  char f[160];
  kvf_status st;
  for (unsigned i = 0; i < KVF_PROTO_REG_NUM_STATES; i++) {
    snprintf(f, sizeof f, "%s.registrations[%u]", prefix, i);
    if ((st = r_u32(r, &c->registrations[i], f))) return st;
  }
  snprintf(f, sizeof f, "%s.imports", prefix);
  if ((st = r_u64(r, &c->imports, f))) return st;
  snprintf(f, sizeof f, "%s.aliases", prefix);
  if ((st = r_u64(r, &c->aliases, f))) return st;
  snprintf(f, sizeof f, "%s.leases", prefix);
  return r_u64(r, &c->leases, f);
}

#define R(call)                        \
  do {                                 \
    if ((st = (call)) != KVF_SUCCESS) goto out; \
  } while (0)
#define BAD(...)                                  \
  do {                                            \
    st = kvf_fail(KVF_ERR_PROTOCOL, __VA_ARGS__); \
    goto out;                                     \
  } while (0)

static kvf_status decode_register(rbuf *r, kvf_proto_register *g) {
  kvf_status st = KVF_SUCCESS;
  uint32_t dev = 0;
  const uint8_t *json = NULL;
  char f[96];
  R(r_u32(r, &dev, "payload.device"));
  g->device = (int32_t)dev;
  if (g->device < -1) BAD("payload.device: %d is neither -1 (host) nor a device ordinal", (int)g->device);
  R(r_u32(r, &g->num_fds, "payload.num_fds"));
  if (g->num_fds > KVF_PROTO_MAX_FDS)
    BAD("payload.num_fds: count %u exceeds the %u limit", g->num_fds, KVF_PROTO_MAX_FDS);
  /* The regions follow the geometry text, so their count is checked against
   * the payload only once the text has been read. */
  R(r_u32(r, &g->num_regions, "payload.num_regions"));
  if (g->num_regions > KVF_PROTO_MAX_REGIONS)
    BAD("payload.num_regions: count %u exceeds the %u limit", g->num_regions, KVF_PROTO_MAX_REGIONS);
  if (g->num_regions == 0) BAD("payload.num_regions: 0, a geometry has at least one region");
  R(r_u32(r, &g->shard_index, "payload.shard_index"));
  R(r_u32(r, &g->shard_count, "payload.shard_count"));
  R(shard_check(g->shard_index, g->shard_count, "payload", KVF_ERR_PROTOCOL));
  R(r_str_view(r, KVF_PROTO_MAX_GEOMETRY_JSON, "payload.geometry_json", &json, &g->geometry_json_len));
  if (g->geometry_json_len == 0) BAD("payload.geometry_json: empty");
  if ((r->len - r->pos) / KVF_PROTO_REGION_WIRE < g->num_regions)
    BAD("payload.regions: count %u needs %zu bytes, the payload has %zu left", g->num_regions,
        (size_t)g->num_regions * KVF_PROTO_REGION_WIRE, r->len - r->pos);
  g->geometry_json = malloc((size_t)g->geometry_json_len + 1);
  g->regions = calloc(g->num_regions, sizeof *g->regions);
  if (!g->geometry_json || !g->regions) {
    st = kvf_fail(KVF_ERR_OUT_OF_MEMORY, "payload: out of memory decoding REGISTER");
    goto out;
  }
  memcpy(g->geometry_json, json, g->geometry_json_len);
  g->geometry_json[g->geometry_json_len] = '\0';
  for (uint32_t i = 0; i < g->num_regions; i++) {
    kvf_proto_region *x = &g->regions[i];
    uint64_t reserved1 = 0;
#define RF(name) (snprintf(f, sizeof f, "payload.regions[%u]." name, i), f)
    R(r_u64(r, &x->instance_id, RF("instance_id")));
    R(r_u64(r, &x->allocation_id, RF("allocation_id")));
    R(r_u64(r, &x->generation, RF("generation")));
    R(r_u64(r, &x->size, RF("size")));
    R(r_need(r, 16, RF("device_uuid")));
    memcpy(x->device_uuid, r->p + r->pos, 16);
    r->pos += 16;
    R(r_u32(r, &x->provider, RF("provider")));
    R(r_zero32(r, RF("reserved0")));
    R(r_u64(r, &reserved1, RF("reserved1")));
    if (reserved1) BAD("%s: reserved, must be 0", f);
    R(r_u64(r, &x->offset, RF("offset")));
    R(r_u64(r, &x->length, RF("length")));
    R(r_u32(r, &x->fd_index, RF("fd_index")));
    R(r_zero32(r, RF("reserved2")));
    /* A region's values (instance 0, an unknown provider, an empty
     * allocation or range, one past its allocation, a descriptor the frame
     * does not carry) are the server's checks (server.c register_claim,
     * register.c), not the frame's: a well-formed frame with a wrong value
     * is a request it refuses (KVF_ERR_PERMISSION for an instance not the
     * sender's, else KVF_ERR_INVALID_ARGUMENT), keeping the connection. */
#undef RF
  }
out:
  return st;
}

static kvf_status decode_xfer(rbuf *r, uint16_t type, kvf_proto_xfer *x) {
  kvf_status st = KVF_SUCCESS;
  char f[96];
  R(r_u64(r, &x->registration_id, "payload.registration_id"));
  R(r_u64(r, &x->token_begin, "payload.token_begin"));
  R(r_u64(r, &x->token_end, "payload.token_end"));
  R(r_u32(r, &x->format, "payload.format"));
  R(r_u32(r, &x->ready_kind, "payload.ready_kind"));
  R(r_need(r, KVF_PROTO_READY_HANDLE_BYTES, "payload.ready_handle"));
  memcpy(x->ready_handle, r->p + r->pos, KVF_PROTO_READY_HANDLE_BYTES);
  r->pos += KVF_PROTO_READY_HANDLE_BYTES;
  R(r_u32(r, &x->num_chunk_keys, "payload.num_chunk_keys"));
  R(r_u32(r, &x->num_groups, "payload.num_groups"));
  R(xfer_check_fixed(x, type, "payload", KVF_ERR_PROTOCOL));
  R(r_room(r, x->num_chunk_keys, KVF_PROTO_KEY_BYTES, "payload.chunk_keys"));
  x->chunk_keys = malloc((size_t)x->num_chunk_keys * sizeof *x->chunk_keys);
  if (!x->chunk_keys) {
    st = kvf_fail(KVF_ERR_OUT_OF_MEMORY, "payload: out of memory decoding %s", "chunk_keys");
    goto out;
  }
  for (uint32_t k = 0; k < x->num_chunk_keys; k++) {
    memcpy(x->chunk_keys[k].bytes, r->p + r->pos, KVF_PROTO_KEY_BYTES);
    r->pos += KVF_PROTO_KEY_BYTES;
    if (key_zero(&x->chunk_keys[k])) BAD("payload.chunk_keys[%u]: all zero is not a key", k);
  }
  /* Each group is at least 12 bytes (first_block, count). */
  R(r_room(r, x->num_groups, 12, "payload.groups"));
  x->groups = calloc(x->num_groups, sizeof *x->groups);
  if (!x->groups) {
    st = kvf_fail(KVF_ERR_OUT_OF_MEMORY, "payload: out of memory decoding %s", "groups");
    goto out;
  }
  for (uint32_t i = 0; i < x->num_groups; i++) {
    kvf_proto_group *g = &x->groups[i];
    snprintf(f, sizeof f, "payload.groups[%u].first_block", i);
    R(r_u64(r, &g->first_block, f));
    snprintf(f, sizeof f, "payload.groups[%u].block_ids", i);
    R(r_count(r, &g->count, KVF_PROTO_MAX_BLOCKS_PER_GROUP, 4, f));
    if (g->count == 0) continue;
    g->block_ids = malloc((size_t)g->count * sizeof *g->block_ids);
    if (!g->block_ids) {
      st = kvf_fail(KVF_ERR_OUT_OF_MEMORY, "payload: out of memory decoding %s", f);
      goto out;
    }
    for (uint32_t k = 0; k < g->count; k++) g->block_ids[k] = (uint32_t)get_le(r->p + r->pos + 4u * k, 4);
    r->pos += 4u * (size_t)g->count;
  }
out:
  return st;
}

static kvf_status decode_xfer_reply(rbuf *r, uint16_t type, kvf_proto_xfer_reply *x) {
  kvf_status st = KVF_SUCCESS;
  R(r_u32(r, &x->status, "payload.status"));
  R(r_u32(r, &x->outcome, "payload.outcome"));
  R(r_u64(r, &x->prefix_tokens, "payload.prefix_tokens"));
  R(r_u64(r, &x->objects_done, "payload.objects_done"));
  R(r_u64(r, &x->objects_present, "payload.objects_present"));
  R(r_u64(r, &x->bytes_done, "payload.bytes_done"));
  R(r_u32(r, &x->num_groups, "payload.num_groups"));
  R(r_u32(r, &x->num_object_groups, "payload.num_object_groups"));
  R(xfer_reply_check(x, type, "payload", KVF_ERR_PROTOCOL));
  R(r_room(r, x->num_groups, 8, "payload.group_blocks"));
  if (x->num_groups) {
    x->group_blocks = malloc((size_t)x->num_groups * sizeof *x->group_blocks);
    if (!x->group_blocks) {
      st = kvf_fail(KVF_ERR_OUT_OF_MEMORY, "payload: out of memory decoding %s", "group_blocks");
      goto out;
    }
    for (uint32_t i = 0; i < x->num_groups; i++, r->pos += 8) x->group_blocks[i] = get_le(r->p + r->pos, 8);
  }
  R(r_room(r, x->num_object_groups, 8, "payload.og_prefix_tokens"));
  if (x->num_object_groups) {
    x->og_prefix_tokens = malloc((size_t)x->num_object_groups * sizeof *x->og_prefix_tokens);
    if (!x->og_prefix_tokens) {
      st = kvf_fail(KVF_ERR_OUT_OF_MEMORY, "payload: out of memory decoding %s", "og_prefix_tokens");
      goto out;
    }
    for (uint32_t i = 0; i < x->num_object_groups; i++, r->pos += 8)
      x->og_prefix_tokens[i] = get_le(r->p + r->pos, 8);
  }
  R(r_str_fixed(r, x->message, sizeof x->message, "payload.message"));
out:
  return st;
}

/* Chunk keys, the one place their wire form is read: n keys (the count
 * checked against its limit) into a new array, each nonzero. */
static kvf_status r_keys(rbuf *r, uint32_t n, kvf_proto_chunk_key **out, const char *field) {
  kvf_status st = r_room(r, n, KVF_PROTO_KEY_BYTES, field);
  if (st) return st;
  kvf_proto_chunk_key *keys = malloc((size_t)(n ? n : 1) * sizeof(*keys));
  if (!keys) return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "payload: out of memory decoding %s", field);
  *out = keys; /* owned by the message from here, also on failure */
  for (uint32_t k = 0; k < n; k++, r->pos += KVF_PROTO_KEY_BYTES) memcpy(keys[k].bytes, r->p + r->pos, KVF_PROTO_KEY_BYTES);
  uint32_t zero = keys_first_zero(keys, n);
  if (zero < n) return kvf_fail(KVF_ERR_PROTOCOL, "%s[%u]: all zero is not a key", field, zero);
  return KVF_SUCCESS;
}

static kvf_status decode_lookup(rbuf *r, kvf_proto_lookup *q) {
  kvf_status st = KVF_SUCCESS;
  R(r_u64(r, &q->registration_id, "payload.registration_id"));
  R(r_u64(r, &q->token_begin, "payload.token_begin"));
  R(r_u64(r, &q->token_end, "payload.token_end"));
  R(r_u32(r, &q->format, "payload.format"));
  R(r_u32(r, &q->pin_ms, "payload.pin_ms"));
  R(r_u32(r, &q->num_chunk_keys, "payload.num_chunk_keys"));
  R(r_zero32(r, "payload.reserved"));
  R(lookup_check_fixed(q, "payload", KVF_ERR_PROTOCOL));
  R(r_keys(r, q->num_chunk_keys, &q->chunk_keys, "payload.chunk_keys"));
out:
  return st;
}

static kvf_status decode_push(rbuf *r, kvf_proto_push *q) {
  kvf_status st = KVF_SUCCESS;
  R(r_u64(r, &q->registration_id, "payload.registration_id"));
  R(r_u64(r, &q->token_begin, "payload.token_begin"));
  R(r_u64(r, &q->token_end, "payload.token_end"));
  R(r_u32(r, &q->format, "payload.format"));
  R(r_u32(r, &q->num_chunk_keys, "payload.num_chunk_keys"));
  R(push_check_fixed(q, "payload", KVF_ERR_PROTOCOL));
  R(r_str_fixed(r, q->peer, sizeof q->peer, "payload.peer"));
  if (!q->peer[0]) {
    st = kvf_fail(KVF_ERR_PROTOCOL, "payload.peer: empty");
    goto out;
  }
  for (const char *c = q->peer; *c; c++)
    if (*c < 0x21 || *c > 0x7e) {
      st = kvf_fail(KVF_ERR_PROTOCOL, "payload.peer: byte 0x%02x at %zu (an address or boot token is printable ASCII)",
                    (unsigned)(uint8_t)*c, (size_t)(c - q->peer));
      goto out;
    }
  R(r_keys(r, q->num_chunk_keys, &q->chunk_keys, "payload.chunk_keys"));
out:
  return st;
}

static kvf_status decode_push_reply(rbuf *r, kvf_proto_push_reply *x) {
  kvf_status st = KVF_SUCCESS;
  R(r_u64(r, &x->objects_pushed, "payload.objects_pushed"));
  R(r_u64(r, &x->objects_present, "payload.objects_present"));
  R(r_u64(r, &x->objects_missing, "payload.objects_missing"));
  R(r_u64(r, &x->objects_failed, "payload.objects_failed"));
  R(r_u64(r, &x->bytes_pushed, "payload.bytes_pushed"));
  R(r_u64(r, &x->chunks_on_peer, "payload.chunks_on_peer"));
  R(push_reply_check(x, "payload", KVF_ERR_PROTOCOL));
out:
  return st;
}

static kvf_status decode_lookup_reply(rbuf *r, kvf_proto_lookup_reply *x) {
  kvf_status st = KVF_SUCCESS;
  R(r_u64(r, &x->prefix_tokens, "payload.prefix_tokens"));
  R(r_u64(r, &x->pin_id, "payload.pin_id"));
  R(r_u32(r, &x->pinned_chunks, "payload.pinned_chunks"));
  R(r_u32(r, &x->num_object_groups, "payload.num_object_groups"));
  R(lookup_reply_check(x, "payload", KVF_ERR_PROTOCOL));
  R(r_room(r, x->num_object_groups, 8, "payload.og_prefix_tokens"));
  if (x->num_object_groups) {
    x->og_prefix_tokens = malloc((size_t)x->num_object_groups * sizeof *x->og_prefix_tokens);
    if (!x->og_prefix_tokens) {
      st = kvf_fail(KVF_ERR_OUT_OF_MEMORY, "payload: out of memory decoding %s", "og_prefix_tokens");
      goto out;
    }
    for (uint32_t i = 0; i < x->num_object_groups; i++, r->pos += 8)
      x->og_prefix_tokens[i] = get_le(r->p + r->pos, 8);
  }
out:
  return st;
}

static kvf_status decode_payload(uint16_t type, rbuf *r, kvf_proto_msg *m) {
  kvf_status st = KVF_SUCCESS;
  switch (type) {
  case KVF_PROTO_HELLO: {
    kvf_proto_hello *h = &m->u.hello;
    R(r_u16(r, &h->min_version, "payload.min_version"));
    R(r_u16(r, &h->max_version, "payload.max_version"));
    if (h->min_version == 0) BAD("payload.min_version: 0 is not a protocol version");
    if (h->max_version < h->min_version)
      BAD("payload.max_version: %u is below min_version %u", h->max_version, h->min_version);
    R(r_u32(r, &h->pid, "payload.pid"));
    R(r_u64(r, &h->instance_id, "payload.instance_id"));
    if (h->instance_id == 0) BAD("payload.instance_id: 0 is not an instance id");
    R(r_u64(r, &h->generation, "payload.generation"));
    R(r_str_fixed(r, h->name, sizeof h->name, "payload.name"));
    size_t bad = 0;
    const char *why = "";
    if (!kvf_utf8_valid(h->name, strlen(h->name), &bad, &why))
      BAD("payload.name: not UTF-8: %s at byte %zu (0x%02x)", why, bad, (unsigned)(uint8_t)h->name[bad]);
    break;
  }
  case KVF_PROTO_HELLO_REPLY: {
    kvf_proto_hello_reply *h = &m->u.hello_reply;
    R(r_u16(r, &h->version, "payload.version"));
    if (h->version == 0) BAD("payload.version: 0 is not a protocol version");
    R(r_zero16(r, "payload.reserved"));
    R(r_u32(r, &h->server_pid, "payload.server_pid"));
    R(r_u64(r, &h->boot_token, "payload.boot_token"));
    R(r_u64(r, &h->client_id, "payload.client_id"));
    R(r_u32(r, &h->heartbeat_period_ms, "payload.heartbeat_period_ms"));
    R(r_u32(r, &h->heartbeat_timeout_ms, "payload.heartbeat_timeout_ms"));
    if (h->heartbeat_period_ms == 0) BAD("payload.heartbeat_period_ms: 0");
    if (h->heartbeat_timeout_ms <= h->heartbeat_period_ms)
      BAD("payload.heartbeat_timeout_ms: %u is not longer than the period %u", h->heartbeat_timeout_ms,
          h->heartbeat_period_ms);
    R(r_u32(r, &h->max_payload, "payload.max_payload"));
    if (h->max_payload < 4096u) BAD("payload.max_payload: %u is below the 4096-byte minimum", h->max_payload);
    break;
  }
  case KVF_PROTO_REGISTER: R(decode_register(r, &m->u.reg)); break;
  case KVF_PROTO_REGISTER_REPLY:
    R(r_u64(r, &m->u.register_reply.registration_id, "payload.registration_id"));
    if (m->u.register_reply.registration_id == 0) BAD("payload.registration_id: 0");
    R(r_u64(r, &m->u.register_reply.fingerprint, "payload.fingerprint"));
    R(r_u32(r, &m->u.register_reply.imports, "payload.imports"));
    R(r_u32(r, &m->u.register_reply.aliases, "payload.aliases"));
    break;
  case KVF_PROTO_UNREGISTER:
    R(r_u64(r, &m->u.unregister.registration_id, "payload.registration_id"));
    break;
  case KVF_PROTO_UNREGISTER_REPLY:
    R(r_u64(r, &m->u.unregister_reply.registration_id, "payload.registration_id"));
    R(r_u32(r, &m->u.unregister_reply.state, "payload.state"));
    if (m->u.unregister_reply.state >= KVF_PROTO_REG_NUM_STATES)
      BAD("payload.state: %u is not a registration state", m->u.unregister_reply.state);
    R(r_zero32(r, "payload.reserved"));
    break;
  case KVF_PROTO_HEARTBEAT: R(r_u64(r, &m->u.heartbeat.sequence, "payload.sequence")); break;
  case KVF_PROTO_HEARTBEAT_REPLY:
    R(r_u64(r, &m->u.heartbeat_reply.sequence, "payload.sequence"));
    R(r_u64(r, &m->u.heartbeat_reply.boot_token, "payload.boot_token"));
    break;
  case KVF_PROTO_STAT:
    R(r_u32(r, &m->u.stat.flags, "payload.flags"));
    if (m->u.stat.flags & ~(KVF_PROTO_STAT_PER_CLIENT | KVF_PROTO_STAT_PEERS))
      BAD("payload.flags: unknown bits 0x%x", m->u.stat.flags & ~(KVF_PROTO_STAT_PER_CLIENT | KVF_PROTO_STAT_PEERS));
    break;
  case KVF_PROTO_STAT_REPLY: {
    kvf_proto_stat_reply *s = &m->u.stat_reply;
    char f[96];
    R(r_u64(r, &s->boot_token, "payload.boot_token"));
    R(r_counters(r, &s->total, "payload.total"));
    R(r_u64(r, &s->data.l1_objects, "payload.data.l1_objects"));
    R(r_u64(r, &s->data.l1_bytes, "payload.data.l1_bytes"));
    R(r_u64(r, &s->data.l1_pool_bytes, "payload.data.l1_pool_bytes"));
    R(r_u64(r, &s->data.l1_evicted_entries_total, "payload.data.l1_evicted_entries_total"));
    R(r_u64(r, &s->data.stores_total, "payload.data.stores_total"));
    R(r_u64(r, &s->data.retrieves_total, "payload.data.retrieves_total"));
    R(r_u64(r, &s->data.in_flight, "payload.data.in_flight"));
    R(r_u32(r, &s->data.lanes, "payload.data.lanes"));
    /* A client record is at least 16 bytes plus its counters. */
    R(r_count(r, &s->num_clients, KVF_PROTO_MAX_STAT_CLIENTS, 16u + KVF_PROTO_COUNTERS_WIRE,
              "payload.clients"));
    if (s->num_clients) {
      s->clients = calloc(s->num_clients, sizeof *s->clients);
      if (!s->clients) {
        st = kvf_fail(KVF_ERR_OUT_OF_MEMORY, "payload: out of memory decoding STAT_REPLY");
        goto out;
      }
    }
    for (uint32_t i = 0; i < s->num_clients; i++) {
      kvf_proto_stat_client *c = &s->clients[i];
      snprintf(f, sizeof f, "payload.clients[%u].client_id", i);
      R(r_u64(r, &c->client_id, f));
      snprintf(f, sizeof f, "payload.clients[%u].pid", i);
      R(r_u32(r, &c->pid, f));
      snprintf(f, sizeof f, "payload.clients[%u].name", i);
      R(r_str_fixed(r, c->name, sizeof c->name, f));
      snprintf(f, sizeof f, "payload.clients[%u].counters", i);
      R(r_counters(r, &c->counters, f));
    }
    if (r->pos == r->len) break; /* no peer section: the STAT did not ask */
    s->has_peers = 1;
    /* A peer record is at least 4 + 8 + 48 bytes. */
    R(r_count(r, &s->num_peers, KVF_PROTO_MAX_STAT_PEERS, 60u, "payload.peers"));
    if (s->num_peers) {
      s->peers = calloc(s->num_peers, sizeof *s->peers);
      if (!s->peers) {
        st = kvf_fail(KVF_ERR_OUT_OF_MEMORY, "payload: out of memory decoding STAT_REPLY");
        goto out;
      }
    }
    for (uint32_t i = 0; i < s->num_peers; i++) {
      kvf_proto_stat_peer *pr = &s->peers[i];
      snprintf(f, sizeof f, "payload.peers[%u].addr", i);
      R(r_str_fixed(r, pr->addr, sizeof pr->addr, f));
      snprintf(f, sizeof f, "payload.peers[%u]", i);
      R(r_u32(r, &pr->state, f));
      R(r_u32(r, &pr->outgoing, f));
      R(r_u64(r, &pr->boot_token, f));
      R(r_u64(r, &pr->connects, f));
      R(r_u64(r, &pr->objects_pulled, f));
      R(r_u64(r, &pr->bytes_pulled, f));
      R(r_u64(r, &pr->objects_served, f));
      R(r_u64(r, &pr->failures, f));
      R(r_u64(r, &pr->objects_pushed, f));
      R(r_u64(r, &pr->bytes_pushed, f));
      if (pr->state > 2) BAD("payload.peers[%u].state: %u is not a peer state", i, pr->state);
    }
    break;
  }
  case KVF_PROTO_STORE:
  case KVF_PROTO_RETRIEVE: R(decode_xfer(r, type, &m->u.xfer)); break;
  case KVF_PROTO_STORE_REPLY:
  case KVF_PROTO_RETRIEVE_REPLY: R(decode_xfer_reply(r, type, &m->u.xfer_reply)); break;
  case KVF_PROTO_LOOKUP: R(decode_lookup(r, &m->u.lookup)); break;
  case KVF_PROTO_LOOKUP_REPLY: R(decode_lookup_reply(r, &m->u.lookup_reply)); break;
  case KVF_PROTO_PUSH: R(decode_push(r, &m->u.push)); break;
  case KVF_PROTO_PUSH_REPLY: R(decode_push_reply(r, &m->u.push_reply)); break;
  case KVF_PROTO_UNPIN:
    R(r_u64(r, &m->u.unpin.pin_id, "payload.pin_id"));
    if (m->u.unpin.pin_id == 0) BAD("payload.pin_id: 0 is not a pin");
    break;
  case KVF_PROTO_UNPIN_REPLY:
    R(r_u64(r, &m->u.unpin_reply.pin_id, "payload.pin_id"));
    R(r_u32(r, &m->u.unpin_reply.released, "payload.released"));
    if (m->u.unpin_reply.released > 1) BAD("payload.released: %u is neither 0 nor 1", m->u.unpin_reply.released);
    R(r_zero32(r, "payload.reserved"));
    break;
  case KVF_PROTO_RETIRED:
    R(r_u32(r, &m->u.retired.outcome, "payload.outcome"));
    if (m->u.retired.outcome != 3 && m->u.retired.outcome != 4)
      BAD("payload.outcome: %u is neither 3 (cancelled) nor 4 (timed out)", m->u.retired.outcome);
    R(r_zero32(r, "payload.reserved"));
    break;
  case KVF_PROTO_ERROR: {
    kvf_proto_error *e = &m->u.error;
    R(r_u32(r, &e->status, "payload.status"));
    if (e->status == 0 || e->status > KVF_PROTO_MAX_STATUS)
      BAD("payload.status: %u is not a failing kvf_status (1..%u)", e->status, KVF_PROTO_MAX_STATUS);
    R(r_u16(r, &e->version, "payload.version"));
    if (e->version == 0) BAD("payload.version: 0 is not a protocol version");
    R(r_zero16(r, "payload.reserved"));
    R(r_str_fixed(r, e->field, sizeof e->field, "payload.field"));
    R(r_str_fixed(r, e->message, sizeof e->message, "payload.message"));
    break;
  }
  default: BAD("header.type: 0x%04x is not a message type", (unsigned)type);
  }
  if (r->pos != r->len)
    BAD("payload: %zu bytes left over after the %s message (%zu of %zu used)", r->len - r->pos,
        kvf_proto_type_name(type), r->pos, r->len);
out:
  return st;
}

kvf_status kvf_proto_header_decode(const uint8_t *bytes, uint32_t max_payload, kvf_proto_header *out) {
  if (!bytes || !out) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_proto_header_decode: NULL argument");
  if (max_payload == 0 || max_payload > KVF_PROTO_MAX_PAYLOAD) max_payload = KVF_PROTO_MAX_PAYLOAD;
  out->magic = (uint32_t)get_le(bytes + 0, 4);
  out->version = (uint16_t)get_le(bytes + 4, 2);
  out->type = (uint16_t)get_le(bytes + 6, 2);
  out->request_id = get_le(bytes + 8, 8);
  out->payload_len = (uint32_t)get_le(bytes + 16, 4);
  out->flags = (uint32_t)get_le(bytes + 20, 4);
  if (out->magic != KVF_PROTO_MAGIC)
    return kvf_fail(KVF_ERR_PROTOCOL, "header.magic: 0x%08x is not a kvferry frame (expected 0x%08x, \"KVFP\")",
                    out->magic, KVF_PROTO_MAGIC);
  if (out->version != KVF_PROTO_VERSION)
    return kvf_fail(KVF_ERR_PROTOCOL, "header.version: peer speaks protocol version %u, this side speaks %u",
                    (unsigned)out->version, KVF_PROTO_VERSION);
  if (!type_known(out->type))
    return kvf_fail(KVF_ERR_PROTOCOL, "header.type: 0x%04x is not a message type", (unsigned)out->type);
  if (out->payload_len > max_payload)
    return kvf_fail(KVF_ERR_PROTOCOL, "header.payload_len: %u bytes exceed the %u-byte limit", out->payload_len,
                    max_payload);
  if (out->flags) return kvf_fail(KVF_ERR_PROTOCOL, "header.flags: reserved, must be 0 (got 0x%x)", out->flags);
  return KVF_SUCCESS;
}

kvf_status kvf_proto_decode(const kvf_proto_header *h, const uint8_t *payload, kvf_proto_msg *out) {
  if (!h || !out || (h->payload_len && !payload))
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_proto_decode: NULL argument");
  kvf_proto_msg m;
  memset(&m, 0, sizeof m);
  m.type = h->type;
  m.request_id = h->request_id;
  rbuf r = {payload, h->payload_len, 0};
  kvf_status st = decode_payload(h->type, &r, &m);
  if (st) {
    kvf_proto_msg_clear(&m);
    return st;
  }
  *out = m;
  return KVF_SUCCESS;
}

kvf_status kvf_proto_frame_decode(const uint8_t *frame, size_t len, kvf_proto_msg *out) {
  if (!frame || !out) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_proto_frame_decode: NULL argument");
  if (len < KVF_PROTO_HEADER_SIZE)
    return kvf_fail(KVF_ERR_PROTOCOL, "header: %zu bytes, a header is %u", len, KVF_PROTO_HEADER_SIZE);
  kvf_proto_header h;
  kvf_status st = kvf_proto_header_decode(frame, 0, &h);
  if (st) return st;
  if (len - KVF_PROTO_HEADER_SIZE != h.payload_len)
    return kvf_fail(KVF_ERR_PROTOCOL, "header.payload_len: %u, but the frame has %zu payload bytes", h.payload_len,
                    len - KVF_PROTO_HEADER_SIZE);
  return kvf_proto_decode(&h, frame + KVF_PROTO_HEADER_SIZE, out);
}

void kvf_proto_msg_clear(kvf_proto_msg *msg) {
  if (!msg) return;
  switch (msg->type) {
  case KVF_PROTO_REGISTER:
    free(msg->u.reg.geometry_json);
    free(msg->u.reg.regions);
    break;
  case KVF_PROTO_STAT_REPLY:
    free(msg->u.stat_reply.clients);
    free(msg->u.stat_reply.peers);
    break;
  case KVF_PROTO_STORE:
  case KVF_PROTO_RETRIEVE:
    free(msg->u.xfer.chunk_keys);
    if (msg->u.xfer.groups)
      for (uint32_t i = 0; i < msg->u.xfer.num_groups; i++) free(msg->u.xfer.groups[i].block_ids);
    free(msg->u.xfer.groups);
    break;
  case KVF_PROTO_STORE_REPLY:
  case KVF_PROTO_RETRIEVE_REPLY:
    free(msg->u.xfer_reply.group_blocks);
    free(msg->u.xfer_reply.og_prefix_tokens);
    break;
  case KVF_PROTO_LOOKUP: free(msg->u.lookup.chunk_keys); break;
  case KVF_PROTO_LOOKUP_REPLY: free(msg->u.lookup_reply.og_prefix_tokens); break;
  case KVF_PROTO_PUSH: free(msg->u.push.chunk_keys); break;
  default: break;
  }
  memset(msg, 0, sizeof *msg);
}

kvf_status kvf_proto_negotiate(uint16_t min_version, uint16_t max_version, uint16_t *out) {
  if (!out) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_proto_negotiate: NULL out");
  if (min_version > max_version)
    return kvf_fail(KVF_ERR_PROTOCOL, "payload.max_version: %u is below min_version %u", max_version, min_version);
  if (min_version > KVF_PROTO_VERSION || max_version < KVF_PROTO_VERSION)
    return kvf_fail(KVF_ERR_PROTOCOL,
                    "payload.max_version: client speaks protocol versions %u..%u, this side speaks %u..%u",
                    min_version, max_version, KVF_PROTO_VERSION, KVF_PROTO_VERSION);
  *out = KVF_PROTO_VERSION;
  return KVF_SUCCESS;
}

/* ---- the incremental reader ------------------------------------------------ */

static uint32_t reader_cap(uint32_t max_payload) {
  return (max_payload == 0 || max_payload > KVF_PROTO_MAX_PAYLOAD) ? KVF_PROTO_MAX_PAYLOAD : max_payload;
}

void kvf_proto_reader_init(kvf_proto_reader *r, uint32_t max_payload) {
  memset(r, 0, sizeof *r);
  r->max_payload = reader_cap(max_payload);
}

void kvf_proto_reader_limit(kvf_proto_reader *r, uint32_t max_payload, uint32_t hold_above) {
  if (!r) return;
  r->max_payload = reader_cap(max_payload);
  r->hold_above = hold_above;
}

void kvf_proto_reader_reset(kvf_proto_reader *r) {
  if (!r) return;
  uint32_t max = r->max_payload, hold = r->hold_above;
  free(r->payload);
  kvf_proto_reader_init(r, max);
  r->hold_above = hold;
}

size_t kvf_proto_reader_want(const kvf_proto_reader *r) {
  if (r->failed || r->ready || r->held) return 0;
  if (r->header_have < KVF_PROTO_HEADER_SIZE) return KVF_PROTO_HEADER_SIZE - r->header_have;
  return r->header.payload_len - r->payload_have;
}

uint32_t kvf_proto_reader_held(const kvf_proto_reader *r) { return r && r->held ? r->header.payload_len : 0; }

/* The payload buffer of the checked header. */
static kvf_status reader_alloc(kvf_proto_reader *r) {
  r->payload = malloc(r->header.payload_len);
  if (!r->payload) {
    r->failed = KVF_ERR_OUT_OF_MEMORY;
    return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "reader: out of memory for a %u-byte payload", r->header.payload_len);
  }
  return KVF_SUCCESS;
}

kvf_status kvf_proto_reader_grant(kvf_proto_reader *r) {
  if (!r) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_proto_reader_grant: NULL argument");
  if (r->failed) return kvf_fail(r->failed, "reader: the connection already failed; close it");
  if (!r->held) return kvf_fail(KVF_ERR_STATE, "reader: no frame is held");
  kvf_status st = reader_alloc(r);
  if (st) return st;
  r->held = 0;
  return KVF_SUCCESS;
}

kvf_status kvf_proto_reader_feed(kvf_proto_reader *r, const uint8_t *data, size_t len, size_t *consumed,
                                 int *ready) {
  if (!r || (len && !data) || !consumed || !ready)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_proto_reader_feed: NULL argument");
  *consumed = 0;
  *ready = r->ready;
  if (r->failed) return kvf_fail(r->failed, "reader: the connection already failed; close it");
  size_t used = 0;
  while (used < len && !r->ready && !r->held) {
    if (r->header_have < KVF_PROTO_HEADER_SIZE) {
      size_t n = KVF_PROTO_HEADER_SIZE - r->header_have;
      if (n > len - used) n = len - used;
      memcpy(r->header_bytes + r->header_have, data + used, n);
      r->header_have += n;
      used += n;
      if (r->header_have < KVF_PROTO_HEADER_SIZE) break;
      /* Checked here, before the payload buffer exists: an oversize length
       * costs nothing. */
      kvf_status st = kvf_proto_header_decode(r->header_bytes, r->max_payload, &r->header);
      if (st) {
        r->failed = st;
        *consumed = used;
        return st;
      }
      r->payload_have = 0;
      if (r->hold_above && r->header.payload_len > r->hold_above) {
        r->held = 1; /* the owner grants the buffer (kvf_proto_reader_grant) */
        break;
      }
      if (r->header.payload_len) {
        st = reader_alloc(r);
        if (st) {
          *consumed = used;
          return st;
        }
      }
    } else {
      size_t n = r->header.payload_len - r->payload_have;
      if (n > len - used) n = len - used;
      memcpy(r->payload + r->payload_have, data + used, n);
      r->payload_have += n;
      used += n;
    }
    if (r->header_have == KVF_PROTO_HEADER_SIZE && r->payload_have == r->header.payload_len) r->ready = 1;
  }
  /* A header with an empty payload completes without another byte. */
  if (!r->ready && !r->held && r->header_have == KVF_PROTO_HEADER_SIZE && r->payload_have == r->header.payload_len)
    r->ready = 1;
  *consumed = used;
  *ready = r->ready;
  return KVF_SUCCESS;
}

kvf_status kvf_proto_reader_take(kvf_proto_reader *r, kvf_proto_header *header, uint8_t **payload) {
  if (!r || !header || !payload) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_proto_reader_take: NULL argument");
  if (!r->ready) return kvf_fail(KVF_ERR_STATE, "reader: no whole frame has arrived yet");
  *header = r->header;
  *payload = r->payload;
  r->payload = NULL;
  r->payload_have = 0;
  r->header_have = 0;
  r->ready = 0;
  memset(&r->header, 0, sizeof r->header);
  return KVF_SUCCESS;
}
