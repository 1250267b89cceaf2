/* The kvferryd server object: one poll loop over the listener and the
 * connections (host/server.h). */
#define _GNU_SOURCE /* pipe2 */
#include "host/server/server.h"

#include <errno.h>
#ifdef __GLIBC__
#include <malloc.h> /* malloc_trim */
#endif
#include <pthread.h>
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include <kvferry/geometry.h>
#include <kvferry/memory.h>

#include "common/clock.h"
#include "common/error.h"
#include "common/versioned.h"
#include "host/server/dataplane.h"
#include "host/server/peer_transport.h"
#include "host/server/peers.h"
#include "host/server/register.h"
#include "host/memory/import_table.h"
#include "host/ipc/endpoint.h"
#include "host/core/log.h"
#include "host/core/param.h"
#include "host/ipc/protocol.h"

/* An encoded frame on its way out: in the outbox (from a completion thread,
 * addressed by client id) or in a connection's queue (sent bytes counted). */
typedef struct kvf_server_out {
  struct kvf_server_out *next;
  uint64_t client_id;
  uint64_t request_id; /* outbox: the STORE or RETRIEVE it answers */
  size_t len, sent;
  uint8_t *frame;
} kvf_server_out;

/* What one queued reply costs besides its frame: the entry and the
 * allocator's headers of both. A client's queue is charged this much. */
#define KVF_SERVER_OUT_OVERHEAD (sizeof(kvf_server_out) + 32u)

/* The request ids of a client's STORE/RETRIEVE admitted and not answered:
 * an open-addressing set (linear probing, backward-shift deletion), grown
 * as needed up to the in-flight limit. */
typedef struct kvf_id_set {
  uint64_t *ids;
  uint8_t *used;
  uint32_t cap; /* a power of two, or 0 */
  uint32_t count;
} kvf_id_set;

/* One turn of the loop (one poll) gives each readable connection at most
 * this much reading: a client that keeps its socket full delays the others
 * by a few requests' work per turn, never by its whole flood. New
 * connections are accepted every turn, a bounded number at a time. */
#define KVF_SERVER_TURN_FRAMES 8u
#define KVF_SERVER_TURN_BYTES (256u << 10)
#define KVF_SERVER_TURN_ACCEPTS 32u

/* Frame memory. Before HELLO a connection may send nothing larger than a
 * HELLO (this much payload). After it, a frame whose payload is at most
 * KVF_SERVER_SMALL_FRAME (heartbeats, STAT, most STORE/RETRIEVE) is always
 * read: max_clients x this is the allowance's bound. A larger frame is held
 * after its header until the server-wide pool (max_buffered_bytes) has room
 * for its whole payload, first come first served; until then the connection
 * is not read. */
#define KVF_SERVER_HELLO_MAX_PAYLOAD 4096u
#define KVF_SERVER_SMALL_FRAME (64u << 10)

/* Memory that returns. glibc keeps what is freed below the heap's top: a
 * client that queued 8 MiB of small replies and was dropped left 13.7 MiB
 * of the server's RSS behind (measured, ServerFairness.MemoryDescriptorsAnd
 * ThreadsReturnAfterTheAttacks), all of which malloc_trim(0) gives back, in
 * about 2.5 ms for such a heap. So once the memory the loop holds for
 * clients (reply queues, the frame pool) has fallen this far below its
 * high-water mark, the loop trims, at most once a second. */
#define KVF_SERVER_TRIM_BYTES (8ull << 20)
#define KVF_SERVER_MAX_GENERATIONS 8u /* generations of its instance one connection may register */

/* A LOOKUP's pin, held for its connection until unpinned, expired or the
 * connection goes. */
typedef struct kvf_server_pin {
  uint64_t id;
  uint64_t deadline_ns;
  uint32_t chunks;
  kvf_l1_pin *pin;
} kvf_server_pin;

typedef struct kvf_server_conn {
  kvf_conn conn;
  uint64_t client_id;   /* the registry's client id; assigned at accept */
  uint64_t accepted_ns; /* HELLO is due hello_timeout_ms after this */
  int hello_done;
  uint32_t pid;         /* from HELLO (SO_PEERCRED's in conn.peer) */
  char name[KVF_PROTO_NAME_MAX];
  /* Alive as of then: the accept, or the last poll that found bytes from it
   * waiting (read that turn or later: a client is never blamed for the
   * loop's backlog). The reaper compares it with the time of the last poll,
   * never with "now", so a heartbeat that arrived after that poll is not
   * missed. */
  uint64_t last_seen_ns;
  kvf_dp_binding *binding; /* the active registration's geometry on its lane, or NULL */
  /* Replies not written yet: written without blocking as the socket takes
   * them, so a client that stops reading never stalls the loop. */
  kvf_server_out *q_head, *q_tail;
  uint64_t q_bytes;            /* memory the queue holds: frames + KVF_SERVER_OUT_OVERHEAD each */
  uint64_t q_stalled_since_ns; /* last progress while the queue was not empty */
  kvf_status q_failed;         /* a write failed: drop the connection */
  /* The frame being read. */
  uint64_t frame_started_ns; /* its first byte (or its grant) arrived then; 0 between frames */
  uint32_t granted;          /* bytes of the frame pool (s->buffered) its payload holds */
  uint64_t wait_seq;         /* nonzero: its header is held, waiting for the pool (order of arrival) */
  int dry;                   /* its last read found the socket empty: the sender is behind, not us */
  int paused;                /* it was not readable at the last poll (conn_readable) */
  kvf_id_set in_flight;      /* its STORE/RETRIEVE admitted and not answered */
  /* Paused: its REGISTER is with the registration worker. No further frame
   * of it is read (its requests stay in order) and it is not reaped until
   * server_finish_registers() queues the reply. */
  int register_busy;
  /* Identities (DESIGN.md §9): the instance HELLO named, and the
   * generations of it this connection has registered. While it is
   * connected, no other process may register them. */
  uint64_t instance_id, generation;
  uint64_t bound_gen[KVF_SERVER_MAX_GENERATIONS];
  uint32_t num_bound;
  /* num_bound before the REGISTER in progress: a refused REGISTER unbinds
   * what its claim bound, so that only registrations that succeeded hold
   * generations (a refusal must not keep another process out of them). */
  uint32_t bound_before_register;
  /* LOOKUP pins: [num_pins] of an array of pins_cap (at most max_client_pins). */
  kvf_server_pin *pins;
  uint32_t num_pins, pins_cap;
  uint64_t pinned_chunks; /* the sum of pins[].chunks */
  uint64_t last_pin_id;   /* ids count up from 1; every id up to this one was given out */
  uint32_t pushes;        /* PUSHes waiting for their peer's answer */
} kvf_server_conn;


struct kvf_server {
  kvf_server_options opt;
  kvf_import_table *table;
  kvf_registry *registry;
  kvf_endpoint *ep;
  int stop_pipe[2];
  int stop_flag; /* atomic */
  int running;   /* atomic */
  uint64_t boot_token;
  uint64_t next_client_id;
  kvf_server_conn **conns; /* [num_conns] */
  uint32_t num_conns;
  struct pollfd *pfds; /* [2 + max_clients] */
  uint64_t last_collect_ns;
  uint64_t refused, evicted;   /* connections refused or evicted since the last warning about it */
  uint64_t refused_warned_ns;  /* when that warning was last written (one a second at most) */
  uint64_t buffered;           /* frame pool: payload bytes granted to frames being read */
  uint32_t waiting;            /* connections whose frame waits for the pool */
  uint64_t wait_next;          /* the next wait_seq */
  uint64_t held_high;          /* high-water mark of reply queues + frame pool since the last trim */
  uint64_t trimmed_ns;         /* the last malloc_trim */
  kvf_topology *topology;
  kvf_dataplane *dp;
  int *devices;
  pthread_mutex_t out_mu; /* the outbox */
  int out_mu_init;
  kvf_server_out *out_head, *out_tail;
  kvf_register_worker *reg_worker;
  kvf_register_req *reg_done_head, *reg_done_tail; /* finished REGISTERs for the loop (out_mu) */
  uint64_t pin_deadline_ns; /* the earliest deadline of any pin (UINT64_MAX: none); loop thread */
  kvf_peers *peers;            /* NULL: no peering */
  kvf_pt_context *pt_ctx;      /* the peer transport's context (NULL: no peering); made before the data
                                  plane and freed after it, since the pools may be its memory */
  struct kvf_server_fetch *fetching;                /* RETRIEVEs waiting for peers (the loop's) */
  struct kvf_server_fetch *fetch_done_head, *fetch_done_tail; /* ... whose fetch is over (out_mu) */
};

/* Work handed to the peers for one request: a RETRIEVE or LOOKUP that
 * missed here, waiting for the peers' fetch (its frame, decoded again when
 * the fetch is over and answered as any other), or a PUSH waiting for its
 * peer's answer. */
#define KVF_SERVER_MAX_PUSHES 16u /* PUSHes in flight per connection */
typedef struct kvf_server_fetch {
  struct kvf_server_fetch *next;      /* in s->fetching */
  struct kvf_server_fetch *done_next; /* in the done list */
  kvf_server *s;
  uint64_t client_id;
  kvf_proto_header h;
  uint8_t *payload;
  uint64_t objects; /* what the fetch committed */
  uint32_t spec;    /* status: the missing object a peer holds through another geometry */
  kvf_status status;
  char message[256];
  kvf_l1_object_spec *specs; /* what was asked for (to name a refused one) */
  /* A PUSH (h.type KVF_PROTO_PUSH; payload unused): */
  uint32_t n;           /* specs */
  uint32_t *chunk_of;   /* [n] each spec's chunk */
  uint8_t *result;      /* [n] KVF_PEERS_PUSH_* */
  uint64_t bytes;       /* committed on the peer */
} kvf_server_fetch;

/* ---- helpers -------------------------------------------------------------- */

static uint32_t id_slot(const kvf_id_set *set, uint64_t id) {
  id ^= id >> 33; /* splitmix64's finalizer: client ids are often sequential */
  id *= 0xff51afd7ed558ccdull;
  id ^= id >> 33;
  return (uint32_t)id & (set->cap - 1);
}

static int id_set_has(const kvf_id_set *set, uint64_t id) {
  if (!set->cap) return 0;
  for (uint32_t i = id_slot(set, id); set->used[i]; i = (i + 1) & (set->cap - 1))
    if (set->ids[i] == id) return 1;
  return 0;
}

static kvf_status id_set_add(kvf_id_set *set, uint64_t id) {
  if ((set->count + 1) * 2 > set->cap) { /* keep it at most half full */
    kvf_id_set bigger = {NULL, NULL, set->cap ? set->cap * 2 : 16, 0};
    bigger.ids = malloc(sizeof(*bigger.ids) * bigger.cap);
    bigger.used = calloc(bigger.cap, 1);
    if (!bigger.ids || !bigger.used) {
      free(bigger.ids);
      free(bigger.used);
      return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "requests in flight: out of memory");
    }
    for (uint32_t i = 0; i < set->cap; i++)
      if (set->used[i]) (void)id_set_add(&bigger, set->ids[i]);
    free(set->ids);
    free(set->used);
    *set = bigger;
  }
  uint32_t i = id_slot(set, id);
  while (set->used[i]) i = (i + 1) & (set->cap - 1);
  set->ids[i] = id;
  set->used[i] = 1;
  set->count++;
  return KVF_SUCCESS;
}

static void id_set_remove(kvf_id_set *set, uint64_t id) {
  if (!set->cap) return;
  uint32_t mask = set->cap - 1, i = id_slot(set, id);
  while (set->used[i] && set->ids[i] != id) i = (i + 1) & mask;
  if (!set->used[i]) return;
  /* Shift back the entries of the run after i that may live in its place. */
  for (uint32_t j = (i + 1) & mask; set->used[j]; j = (j + 1) & mask) {
    uint32_t home = id_slot(set, set->ids[j]);
    if (((j - home) & mask) >= ((j - i) & mask)) { /* i lies between home and j */
      set->ids[i] = set->ids[j];
      i = j;
    }
  }
  set->used[i] = 0;
  set->count--;
}

static void id_set_free(kvf_id_set *set) {
  free(set->ids);
  free(set->used);
  memset(set, 0, sizeof(*set));
}

static kvf_status conn_flush(kvf_server_conn *c);

static void conn_queue_free(kvf_server_conn *c) {
  while (c->q_head) {
    kvf_server_out *o = c->q_head;
    c->q_head = o->next;
    free(o->frame);
    free(o);
  }
  c->q_tail = NULL;
  c->q_bytes = 0;
}

/* Give c's share of the frame pool back (its frame was taken, or c goes). */
static void conn_pool_release(kvf_server *s, kvf_server_conn *c) {
  s->buffered -= c->granted;
  c->granted = 0;
  if (c->wait_seq) {
    c->wait_seq = 0;
    s->waiting--;
  }
}

/* ---- LOOKUP pins (loop thread) ---------------------------------------------- */

/* Release c's pin at index i (the last one takes its place). */
static void conn_pin_release(kvf_server *s, kvf_server_conn *c, uint32_t i) {
  kvf_dataplane_unpin(s->dp, c->pins[i].pin);
  c->pinned_chunks -= c->pins[i].chunks;
  c->pins[i] = c->pins[--c->num_pins];
}

static void conn_pins_free(kvf_server *s, kvf_server_conn *c) {
  while (c->num_pins) conn_pin_release(s, c, c->num_pins - 1);
  free(c->pins);
  c->pins = NULL;
  c->pins_cap = 0;
}

/* Release every pin whose deadline has passed at `now`; recompute the
 * earliest deadline left. Walks every pin, but only when one is due. */
static void server_expire_pins(kvf_server *s, uint64_t now) {
  if (now < s->pin_deadline_ns) return;
  uint64_t next = UINT64_MAX;
  for (uint32_t k = 0; k < s->num_conns; k++) {
    kvf_server_conn *c = s->conns[k];
    for (uint32_t i = 0; i < c->num_pins;) {
      if (c->pins[i].deadline_ns <= now) {
        KVF_TRACE(SERVER, "client %llu: pin %llu expired", (unsigned long long)c->client_id,
                  (unsigned long long)c->pins[i].id);
        conn_pin_release(s, c, i);
        continue;
      }
      if (c->pins[i].deadline_ns < next) next = c->pins[i].deadline_ns;
      i++;
    }
  }
  s->pin_deadline_ns = next;
}

static void server_conn_drop(kvf_server *s, uint32_t index, const char *why) {
  kvf_server_conn *c = s->conns[index];
  conn_pins_free(s, c); /* pins go with their connection */
  conn_pool_release(s, c);
  (void)conn_flush(c); /* a last ERROR, if the socket takes it now */
  conn_queue_free(c);
  KVF_INFO(SERVER, "client %llu (pid %u, '%s') disconnected: %s", (unsigned long long)c->client_id,
           (unsigned)c->conn.peer.pid, c->name, why);
  kvf_status st = kvf_registry_client_close(s->registry, c->client_id);
  if (st != KVF_SUCCESS && st != KVF_ERR_BUSY)
    KVF_WARN(SERVER, "client %llu: close left registrations draining: %s", (unsigned long long)c->client_id,
             kvf_last_error());
  kvf_conn_close(&c->conn);
  kvf_dataplane_unbind(c->binding);
  id_set_free(&c->in_flight);
  free(c);
  s->conns[index] = s->conns[s->num_conns - 1];
  s->num_conns--;
}

/* Write what c's queue holds until the socket would block. Returns
 * KVF_SUCCESS (written, or waiting for POLLOUT) or why the connection is
 * unusable (sticky). */
static kvf_status conn_flush(kvf_server_conn *c) {
  if (c->q_failed != KVF_SUCCESS) return c->q_failed;
  while (c->q_head) {
    kvf_server_out *o = c->q_head;
    ssize_t n = send(c->conn.fd, o->frame + o->sent, o->len - o->sent, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return KVF_SUCCESS;
      c->q_failed = kvf_fail(KVF_ERR_DISCONNECTED, "connection: send: %s", strerror(errno));
      return c->q_failed;
    }
    o->sent += (size_t)n;
    c->q_stalled_since_ns = kvf_now_ns();
    if (o->sent == o->len) {
      c->q_head = o->next;
      if (!c->q_head) c->q_tail = NULL;
      c->q_bytes -= o->len + KVF_SERVER_OUT_OVERHEAD;
      free(o->frame);
      free(o);
    }
  }
  return KVF_SUCCESS;
}

/* Queue an encoded frame for c (ownership moves) and write what the socket
 * takes now. Returns KVF_SUCCESS, or why c must be dropped: a queue over
 * max_reply_queue_bytes (the loop stops reading c at half of it, so only
 * replies to requests already admitted can get it there). */
static kvf_status conn_queue(kvf_server *s, kvf_server_conn *c, uint8_t *frame, size_t len) {
  kvf_server_out *o = calloc(1, sizeof(*o));
  if (!o) {
    free(frame);
    return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "reply: out of memory");
  }
  if (c->q_bytes + len + KVF_SERVER_OUT_OVERHEAD > s->opt.max_reply_queue_bytes) {
    free(frame);
    free(o);
    c->q_failed = kvf_fail(KVF_ERR_BUSY, "quota.reply_queue_bytes: more than %llu bytes of replies unread",
                           (unsigned long long)s->opt.max_reply_queue_bytes);
    return c->q_failed;
  }
  o->frame = frame;
  o->len = len;
  if (!c->q_head) c->q_stalled_since_ns = kvf_now_ns();
  if (c->q_tail)
    c->q_tail->next = o;
  else
    c->q_head = o;
  c->q_tail = o;
  c->q_bytes += len + KVF_SERVER_OUT_OVERHEAD;
  return conn_flush(c);
}

/* Send `msg` to c (queued; never blocks). A failure means c must be dropped. */
static kvf_status server_send(kvf_server *s, kvf_server_conn *c, const kvf_proto_msg *msg) {
  uint8_t *frame = NULL;
  size_t len = 0;
  kvf_status st = kvf_proto_encode(msg, &frame, &len);
  if (st != KVF_SUCCESS) return st;
  return conn_queue(s, c, frame, len);
}

/* Answer request_id with an ERROR (detail NULL: kvf_last_error()). */
static kvf_status server_send_error(kvf_server *s, kvf_server_conn *c, uint64_t request_id, kvf_status status,
                                    const char *detail) {
  kvf_proto_msg m;
  kvf_conn_error_msg(&m, request_id, status, detail);
  return server_send(s, c, &m);
}

/* The data plane's reply callback (any thread): encode now, queue for the
 * loop, wake it. Replies to a client gone meanwhile are dropped there. */
static void server_post_reply(void *ctx, uint64_t client_id, const kvf_proto_msg *reply) {
  kvf_server *s = ctx;
  kvf_server_out *o = calloc(1, sizeof(*o));
  if (!o || kvf_proto_encode(reply, &o->frame, &o->len) != KVF_SUCCESS) {
    KVF_WARN(SERVER, "client %llu: reply to request %llu lost: %s", (unsigned long long)client_id,
             (unsigned long long)reply->request_id, o ? kvf_last_error() : "out of memory");
    free(o);
    return;
  }
  o->client_id = client_id;
  o->request_id = reply->request_id;
  pthread_mutex_lock(&s->out_mu);
  if (s->out_tail)
    s->out_tail->next = o;
  else
    s->out_head = o;
  s->out_tail = o;
  pthread_mutex_unlock(&s->out_mu);
  char b = 1;
  ssize_t n = write(s->stop_pipe[1], &b, 1); /* full pipe: a wake-up is already pending */
  (void)n;
}

static kvf_server_conn *conn_by_client(kvf_server *s, uint64_t client_id, uint32_t *index) {
  for (uint32_t i = 0; i < s->num_conns; i++)
    if (s->conns[i]->client_id == client_id) {
      *index = i;
      return s->conns[i];
    }
  return NULL;
}

/* Queue every reply the completion threads posted (loop thread). Drops
 * nothing itself: the caller sweeps connections whose writes failed, so the
 * connection array never moves under a walk over it. */
static void server_flush_outbox(kvf_server *s) {
  pthread_mutex_lock(&s->out_mu);
  kvf_server_out *o = s->out_head;
  s->out_head = s->out_tail = NULL;
  pthread_mutex_unlock(&s->out_mu);
  while (o) {
    kvf_server_out *next = o->next;
    uint32_t index = 0;
    kvf_server_conn *c = conn_by_client(s, o->client_id, &index);
    if (c) {
      id_set_remove(&c->in_flight, o->request_id); /* answered */
      (void)conn_queue(s, c, o->frame, o->len); /* a failure marks c (q_failed): dropped by the sweep */
    } else {
      free(o->frame); /* the client is gone */
    }
    free(o);
    o = next;
  }
}

/* The registration worker's callback (its thread): hand the finished
 * REGISTER to the loop through the outbox's lock and wake-up. */
static void server_post_register(void *ctx, kvf_register_req *req) {
  kvf_server *s = ctx;
  req->next = NULL;
  pthread_mutex_lock(&s->out_mu);
  if (s->reg_done_tail)
    s->reg_done_tail->next = req;
  else
    s->reg_done_head = req;
  s->reg_done_tail = req;
  pthread_mutex_unlock(&s->out_mu);
  char b = 1;
  ssize_t n = write(s->stop_pipe[1], &b, 1); /* full pipe: a wake-up is already pending */
  (void)n;
}

/* Finish the REGISTERs the worker is done with (loop thread): the new
 * binding replaces the connection's, the reply is queued and the connection
 * is read again. A connection gone meanwhile has its registration drained
 * (closing a client is idempotent, and its id is never reused). */
static void server_finish_registers(kvf_server *s) {
  pthread_mutex_lock(&s->out_mu);
  kvf_register_req *req = s->reg_done_head;
  s->reg_done_head = s->reg_done_tail = NULL;
  pthread_mutex_unlock(&s->out_mu);
  uint64_t now = kvf_now_ns();
  while (req) {
    kvf_register_req *next = req->next;
    uint32_t index = 0;
    kvf_server_conn *c = conn_by_client(s, req->client_id, &index);
    if (c && c->register_busy) {
      if (req->binding) {
        kvf_dataplane_unbind(c->binding);
        c->binding = req->binding;
        req->binding = NULL;
      }
      c->register_busy = 0;
      if (req->status != KVF_SUCCESS) c->num_bound = c->bound_before_register;
      c->last_seen_ns = now; /* the time the REGISTER took does not count as silence */
      (void)kvf_registry_heartbeat(s->registry, c->client_id, now);
      if (req->frame) {
        (void)conn_queue(s, c, req->frame, req->frame_len); /* a failure marks c: dropped by the sweep */
        req->frame = NULL;
      } else {
        c->q_failed = kvf_fail(KVF_ERR_INTERNAL, "register: no reply could be encoded");
      }
    } else {
      kvf_status st = kvf_registry_client_close(s->registry, req->client_id);
      if (st != KVF_SUCCESS && st != KVF_ERR_BUSY)
        KVF_WARN(SERVER, "client %llu (gone during its REGISTER): close left registrations draining: %s",
                 (unsigned long long)req->client_id, kvf_last_error());
    }
    kvf_register_req_free(req);
    req = next;
  }
}

static void close_fds(int *fds, uint32_t n) {
  for (uint32_t i = 0; i < n; i++)
    if (fds[i] >= 0) {
      close(fds[i]);
      fds[i] = -1;
    }
}

static void fill_counters(const kvf_registry_stats *st, kvf_proto_counters *out) {
  memset(out, 0, sizeof(*out));
  out->registrations[KVF_PROTO_REG_REGISTERING] = st->registering > UINT32_MAX ? UINT32_MAX : (uint32_t)st->registering;
  out->registrations[KVF_PROTO_REG_ACTIVE] = st->active > UINT32_MAX ? UINT32_MAX : (uint32_t)st->active;
  out->registrations[KVF_PROTO_REG_DRAINING] = st->draining > UINT32_MAX ? UINT32_MAX : (uint32_t)st->draining;
  out->registrations[KVF_PROTO_REG_CLOSED] = st->closed_total > UINT32_MAX ? UINT32_MAX : (uint32_t)st->closed_total;
  out->registrations[KVF_PROTO_REG_FAILED] = st->failed_total > UINT32_MAX ? UINT32_MAX : (uint32_t)st->failed_total;
  out->imports = st->imports;
  out->aliases = st->aliases;
  out->leases = st->leases;
}

/* ---- requests --------------------------------------------------------------
 * Each handler returns KVF_SUCCESS when it replied (with a result or an
 * ERROR) and the connection stays; any other status drops the connection
 * (after an ERROR when one can still be written). */

static kvf_status handle_hello(kvf_server *s, kvf_server_conn *c, const kvf_proto_msg *m) {
  if (c->hello_done) {
    server_send_error(s, c, m->request_id, KVF_ERR_PROTOCOL, "header.type: HELLO sent twice");
    return KVF_ERR_PROTOCOL;
  }
  uint16_t version = 0;
  kvf_status st = kvf_proto_negotiate(m->u.hello.min_version, m->u.hello.max_version, &version);
  if (st != KVF_SUCCESS) {
    server_send_error(s, c, m->request_id, st, NULL);
    return st;
  }
  st = kvf_registry_client_open(s->registry, c->client_id, kvf_now_ns());
  if (st != KVF_SUCCESS) {
    server_send_error(s, c, m->request_id, st, NULL);
    return st;
  }
  c->hello_done = 1;
  /* From the next frame on: up to max_frame_bytes, the larger ones through the pool. */
  kvf_proto_reader_limit(&c->conn.reader, s->opt.max_frame_bytes, KVF_SERVER_SMALL_FRAME);
  c->pid = m->u.hello.pid;
  c->instance_id = m->u.hello.instance_id;
  c->generation = m->u.hello.generation;
  snprintf(c->name, sizeof(c->name), "%s", m->u.hello.name);
  KVF_INFO(SERVER, "client %llu: HELLO from pid %u (peer pid %d) '%s', version %u",
           (unsigned long long)c->client_id, (unsigned)c->pid, (int)c->conn.peer.pid, c->name, (unsigned)version);
  kvf_proto_msg r;
  memset(&r, 0, sizeof(r));
  r.type = KVF_PROTO_HELLO_REPLY;
  r.request_id = m->request_id;
  r.u.hello_reply.version = version;
  r.u.hello_reply.server_pid = (uint32_t)getpid();
  r.u.hello_reply.boot_token = s->boot_token;
  r.u.hello_reply.client_id = c->client_id;
  r.u.hello_reply.heartbeat_period_ms = s->opt.heartbeat_period_ms;
  r.u.hello_reply.heartbeat_timeout_ms = s->opt.heartbeat_timeout_ms;
  r.u.hello_reply.max_payload = s->opt.max_frame_bytes;
  return server_send(s, c, &r);
}

/* Whether c may register the allocations its regions name: each region's
 * instance is c's (its HELLO's), and each generation of it is registered
 * by no live connection of another process. On success binds the
 * generations to c (undone when the worker refuses the REGISTER); on
 * failure binds nothing.
 * Returns KVF_SUCCESS; KVF_ERR_BUSY when another process's REGISTER still
 * on the worker names a generation (retryable: it is bound only if that
 * one succeeds); else KVF_ERR_PERMISSION; kvf_last_error() names the
 * region. Cost: regions + connections x generations, bounded. */
static kvf_status register_claim(kvf_server *s, kvf_server_conn *c, const kvf_proto_register *rg) {
  uint64_t gens[KVF_SERVER_MAX_GENERATIONS];
  uint32_t first[KVF_SERVER_MAX_GENERATIONS], ng = 0;
  for (uint32_t i = 0; i < rg->num_regions; i++) {
    const kvf_proto_region *r = &rg->regions[i];
    if (r->instance_id != c->instance_id)
      return kvf_fail(KVF_ERR_PERMISSION,
                      "payload.regions[%u].instance_id: %016llx is not this connection's instance %016llx (its "
                      "HELLO): a client registers only the allocations it exported itself",
                      (unsigned)i, (unsigned long long)r->instance_id, (unsigned long long)c->instance_id);
    uint32_t g = 0;
    while (g < ng && gens[g] != r->generation) g++;
    if (g == ng) {
      if (ng == KVF_SERVER_MAX_GENERATIONS)
        return kvf_fail(KVF_ERR_PERMISSION, "payload.regions[%u].generation: more than %u generations in one REGISTER",
                        (unsigned)i, KVF_SERVER_MAX_GENERATIONS);
      gens[ng] = r->generation;
      first[ng++] = i;
    }
  }
  for (uint32_t g = 0; g < ng; g++) {
    /* A firm binding anywhere answers PERMISSION; one made by a REGISTER
     * still on the worker, which keeps the generation only if it succeeds,
     * answers BUSY (try again) when nothing binds it firmly. */
    const kvf_server_conn *pending = NULL;
    for (uint32_t k = 0; k < s->num_conns; k++) {
      const kvf_server_conn *d = s->conns[k];
      if (d == c || d->instance_id != c->instance_id || d->conn.peer.pid == c->conn.peer.pid) continue;
      for (uint32_t b = 0; b < d->num_bound; b++) {
        if (d->bound_gen[b] != gens[g]) continue;
        if (d->register_busy && b >= d->bound_before_register) {
          pending = d;
          continue;
        }
        return kvf_fail(KVF_ERR_PERMISSION,
                        "payload.regions[%u].instance_id: instance %016llx generation %llu is bound to client %llu "
                        "(pid %d), which registered it first and is still connected; a restarted engine counts its "
                        "generation up (kvf_mem_instance_set)",
                        (unsigned)first[g], (unsigned long long)c->instance_id, (unsigned long long)gens[g],
                        (unsigned long long)d->client_id, (int)d->conn.peer.pid);
      }
    }
    if (pending)
      return kvf_fail(KVF_ERR_BUSY,
                      "payload.regions[%u].instance_id: instance %016llx generation %llu is named by a REGISTER of "
                      "client %llu (pid %d) still in progress; it binds the generation only if it succeeds: try again",
                      (unsigned)first[g], (unsigned long long)c->instance_id, (unsigned long long)gens[g],
                      (unsigned long long)pending->client_id, (int)pending->conn.peer.pid);
  }
  /* The generations c does not hold yet, all checked before any is bound. */
  uint64_t add[KVF_SERVER_MAX_GENERATIONS];
  uint32_t na = 0;
  for (uint32_t g = 0; g < ng; g++) {
    uint32_t b = 0;
    while (b < c->num_bound && c->bound_gen[b] != gens[g]) b++;
    if (b < c->num_bound) continue;
    if (c->num_bound + na == KVF_SERVER_MAX_GENERATIONS)
      return kvf_fail(KVF_ERR_PERMISSION,
                      "payload.regions[%u].generation: this connection registered %u generations already",
                      (unsigned)first[g], KVF_SERVER_MAX_GENERATIONS);
    add[na++] = gens[g];
  }
  for (uint32_t i = 0; i < na; i++) c->bound_gen[c->num_bound++] = add[i];
  return KVF_SUCCESS;
}

/* REGISTER goes to the registration worker (host/server/register.h) with
 * its descriptors; the connection is paused (no further frame of it is read,
 * so its requests stay in order) until server_finish_registers() queues the
 * reply. Returns KVF_SUCCESS, or why the connection must be dropped. */
static kvf_status handle_register(kvf_server *s, kvf_server_conn *c, kvf_proto_msg *m, int *fds, uint32_t num_fds) {
  c->bound_before_register = c->num_bound;
  kvf_status st = register_claim(s, c, &m->u.reg);
  if (st != KVF_SUCCESS) {
    close_fds(fds, num_fds);
    KVF_INFO(SERVER, "client %llu (pid %d): REGISTER refused: %s", (unsigned long long)c->client_id,
             (int)c->conn.peer.pid, kvf_last_error());
    return server_send_error(s, c, m->request_id, st, NULL);
  }
  kvf_register_req *req = calloc(1, sizeof(*req));
  if (!req) {
    c->num_bound = c->bound_before_register;
    close_fds(fds, num_fds);
    return server_send_error(s, c, m->request_id, KVF_ERR_OUT_OF_MEMORY, "register: out of memory");
  }
  req->client_id = c->client_id;
  req->request_id = m->request_id;
  req->peer_pid = c->conn.peer.pid;
  req->reg = m->u.reg; /* ownership of the geometry text and the regions moves */
  m->u.reg.geometry_json = NULL;
  m->u.reg.regions = NULL;
  for (uint32_t i = 0; i < num_fds; i++) {
    req->fds[i] = fds[i];
    fds[i] = -1;
  }
  req->num_fds = num_fds;
  c->register_busy = 1;
  kvf_register_submit(s->reg_worker, req);
  return KVF_SUCCESS;
}

static kvf_status handle_unregister(kvf_server *s, kvf_server_conn *c, const kvf_proto_msg *m) {
  uint64_t want = m->u.unregister.registration_id;
  uint64_t active = kvf_registry_active_id(s->registry, c->client_id);
  kvf_proto_msg r;
  memset(&r, 0, sizeof(r));
  r.type = KVF_PROTO_UNREGISTER_REPLY;
  r.request_id = m->request_id;
  r.u.unregister_reply.registration_id = want ? want : active;
  if (want != 0 && want != active) {
    /* Not the live one: replaced or unregistered already. Idempotent; it
     * is unmapped (3) only once its requests in flight, and those of the
     * registrations it replaced (the same memory, maybe), have retired. */
    r.u.unregister_reply.state = kvf_registry_draining_upto(s->registry, c->client_id, want) ? KVF_PROTO_REG_DRAINING
                                                                                          : KVF_PROTO_REG_CLOSED;
    return server_send(s, c, &r);
  }
  kvf_status st = kvf_registry_unregister(s->registry, c->client_id);
  if (st != KVF_SUCCESS && st != KVF_ERR_BUSY)
    return server_send_error(s, c, m->request_id, st, NULL);
  if (st == KVF_SUCCESS || st == KVF_ERR_BUSY) {
    /* Requests in flight keep their own reference to the binding. */
    kvf_dataplane_unbind(c->binding);
    c->binding = NULL;
  }
  r.u.unregister_reply.state = st == KVF_SUCCESS ? KVF_PROTO_REG_CLOSED : KVF_PROTO_REG_DRAINING;
  return server_send(s, c, &r);
}

static kvf_status handle_stat(kvf_server *s, kvf_server_conn *c, const kvf_proto_msg *m) {
  kvf_registry_stats st = KVF_REGISTRY_STATS_INIT;
  kvf_status rc = kvf_registry_stats_get(s->registry, &st);
  if (rc != KVF_SUCCESS) return server_send_error(s, c, m->request_id, rc, NULL);
  kvf_proto_msg r;
  memset(&r, 0, sizeof(r));
  r.type = KVF_PROTO_STAT_REPLY;
  r.request_id = m->request_id;
  r.u.stat_reply.boot_token = s->boot_token;
  fill_counters(&st, &r.u.stat_reply.total);
  kvf_dataplane_stats ds;
  if (kvf_dataplane_stats_get(s->dp, &ds) == KVF_SUCCESS) {
    kvf_proto_data_counters *d = &r.u.stat_reply.data;
    d->l1_objects = ds.l1.objects;
    d->l1_bytes = ds.l1.bytes_committed;
    d->l1_pool_bytes = ds.l1.pool_bytes;
    d->l1_evicted_entries_total = ds.l1.evicted_entries_total;
    d->stores_total = ds.stores_total;
    d->retrieves_total = ds.retrieves_total;
    d->in_flight = ds.in_flight;
    d->lanes = ds.lanes;
  }
  kvf_proto_stat_client *clients = NULL;
  if (m->u.stat.flags & KVF_PROTO_STAT_PER_CLIENT) {
    uint32_t n = s->num_conns < KVF_PROTO_MAX_STAT_CLIENTS ? s->num_conns : KVF_PROTO_MAX_STAT_CLIENTS;
    clients = calloc(n ? n : 1, sizeof(*clients));
    if (!clients)
      return server_send_error(s, c, m->request_id, KVF_ERR_OUT_OF_MEMORY, "stat: out of memory");
    for (uint32_t i = 0; i < n; i++) {
      kvf_server_conn *o = s->conns[i];
      kvf_registry_stats cs = KVF_REGISTRY_STATS_INIT;
      (void)kvf_registry_client_stats(s->registry, o->client_id, &cs); /* unknown: zeros */
      clients[i].client_id = o->client_id;
      clients[i].pid = o->pid;
      snprintf(clients[i].name, sizeof(clients[i].name), "%s", o->name);
      fill_counters(&cs, &clients[i].counters);
    }
    r.u.stat_reply.clients = clients;
    r.u.stat_reply.num_clients = n;
  }
  kvf_proto_stat_peer *peers = NULL;
  if (m->u.stat.flags & KVF_PROTO_STAT_PEERS) {
    kvf_peer_info info[KVF_PROTO_MAX_STAT_PEERS];
    uint32_t n = kvf_peers_info(s->peers, info, KVF_PROTO_MAX_STAT_PEERS);
    if (n > KVF_PROTO_MAX_STAT_PEERS) n = KVF_PROTO_MAX_STAT_PEERS;
    peers = calloc(n ? n : 1, sizeof(*peers));
    if (!peers) {
      free(clients);
      return server_send_error(s, c, m->request_id, KVF_ERR_OUT_OF_MEMORY, "stat: out of memory");
    }
    for (uint32_t i = 0; i < n; i++) {
      _Static_assert(sizeof(peers[i].addr) == sizeof(info[i].addr), "peer addresses fit the wire's");
      memcpy(peers[i].addr, info[i].addr, sizeof(peers[i].addr));
      peers[i].addr[sizeof(peers[i].addr) - 1] = 0;
      peers[i].state = info[i].state;
      peers[i].outgoing = info[i].outgoing;
      peers[i].boot_token = info[i].boot_token;
      peers[i].connects = info[i].connects;
      peers[i].objects_pulled = info[i].objects_pulled;
      peers[i].bytes_pulled = info[i].bytes_pulled;
      peers[i].objects_served = info[i].objects_served;
      peers[i].failures = info[i].failures;
      peers[i].objects_pushed = info[i].objects_pushed;
      peers[i].bytes_pushed = info[i].bytes_pushed;
    }
    r.u.stat_reply.has_peers = 1;
    r.u.stat_reply.peers = peers;
    r.u.stat_reply.num_peers = n;
  }
  rc = server_send(s, c, &r);
  free(clients);
  free(peers);
  return rc;
}

/* LOOKUP: answered here, on the loop, bounded by the keys it sends. A pin
 * is checked against c's quotas before anything is looked up (counting as
 * many chunks as keys were sent), so a refusal holds nothing. */
static kvf_status handle_lookup(kvf_server *s, kvf_server_conn *c, const kvf_proto_msg *m) {
  const kvf_proto_lookup *q = &m->u.lookup;
  int want_pin = q->pin_ms > 0;
  if (want_pin && c->num_pins >= s->opt.max_client_pins) {
    kvf_fail(KVF_ERR_BUSY, "quota.pins: %u pins held, the limit is %u (max_client_pins); unpin one or let it expire",
             (unsigned)c->num_pins, (unsigned)s->opt.max_client_pins);
    return server_send_error(s, c, m->request_id, KVF_ERR_BUSY, NULL);
  }
  if (want_pin && c->pinned_chunks + q->num_chunk_keys > s->opt.max_client_pinned_chunks) {
    kvf_fail(KVF_ERR_BUSY,
             "quota.pinned_chunks: %llu chunks pinned, this LOOKUP may pin %u more, the limit is %u "
             "(max_client_pinned_chunks)",
             (unsigned long long)c->pinned_chunks, (unsigned)q->num_chunk_keys,
             (unsigned)s->opt.max_client_pinned_chunks);
    return server_send_error(s, c, m->request_id, KVF_ERR_BUSY, NULL);
  }
  if (want_pin && c->num_pins == c->pins_cap) {
    uint32_t cap = c->pins_cap ? c->pins_cap * 2 : 8;
    if (cap > s->opt.max_client_pins) cap = s->opt.max_client_pins;
    kvf_server_pin *np = realloc(c->pins, (size_t)cap * sizeof(*np));
    if (!np) return server_send_error(s, c, m->request_id, KVF_ERR_OUT_OF_MEMORY, "lookup: out of memory");
    c->pins = np;
    c->pins_cap = cap;
  }
  kvf_dp_lookup_result res;
  kvf_l1_pin *pin = NULL;
  kvf_status st = kvf_dataplane_lookup(s->dp, c->binding, q, &res, want_pin ? &pin : NULL);
  if (st != KVF_SUCCESS) {
    KVF_INFO(SERVER, "client %llu: LOOKUP %llu refused: %s", (unsigned long long)c->client_id,
             (unsigned long long)m->request_id, kvf_last_error());
    return server_send_error(s, c, m->request_id, st, NULL);
  }
  kvf_proto_msg r;
  memset(&r, 0, sizeof(r));
  r.type = KVF_PROTO_LOOKUP_REPLY;
  r.request_id = m->request_id;
  r.u.lookup_reply.prefix_tokens = res.prefix_tokens;
  r.u.lookup_reply.og_prefix_tokens = res.og_prefix;
  r.u.lookup_reply.num_object_groups = res.num_object_groups;
  if (pin) {
    kvf_server_pin *p = &c->pins[c->num_pins++];
    p->id = ++c->last_pin_id;
    p->deadline_ns = kvf_now_ns() + (uint64_t)q->pin_ms * 1000000ull;
    p->chunks = res.pinned_chunks;
    p->pin = pin;
    c->pinned_chunks += p->chunks;
    if (p->deadline_ns < s->pin_deadline_ns) s->pin_deadline_ns = p->deadline_ns;
    r.u.lookup_reply.pin_id = p->id;
    r.u.lookup_reply.pinned_chunks = p->chunks;
  }
  return server_send(s, c, &r);
}

/* UNPIN: idempotent for any pin this connection was given (released now, or
 * gone already: expired or unpinned); NOT_FOUND for an id never given out. */
static kvf_status handle_unpin(kvf_server *s, kvf_server_conn *c, const kvf_proto_msg *m) {
  uint64_t id = m->u.unpin.pin_id;
  if (id > c->last_pin_id) {
    kvf_fail(KVF_ERR_NOT_FOUND, "payload.pin_id: %llu was never given out on this connection (the last was %llu)",
             (unsigned long long)id, (unsigned long long)c->last_pin_id);
    return server_send_error(s, c, m->request_id, KVF_ERR_NOT_FOUND, NULL);
  }
  kvf_proto_msg r;
  memset(&r, 0, sizeof(r));
  r.type = KVF_PROTO_UNPIN_REPLY;
  r.request_id = m->request_id;
  r.u.unpin_reply.pin_id = id;
  for (uint32_t i = 0; i < c->num_pins; i++)
    if (c->pins[i].id == id) {
      conn_pin_release(s, c, i);
      r.u.unpin_reply.released = 1;
      break;
    }
  return server_send(s, c, &r);
}

/* ---- fetch on miss (host/server/peers.h) ---------------------------------- */

/* The peer thread's callback: the fetch is over, hand it to the loop. */
static void server_post_done(kvf_server_fetch *f);
static void server_post_fetch(void *arg, uint64_t objects, uint32_t spec, kvf_status status, const char *message) {
  kvf_server_fetch *f = arg;
  f->objects = objects;
  f->spec = spec;
  f->status = status;
  snprintf(f->message, sizeof(f->message), "%s", message ? message : "");
  server_post_done(f);
}

/* Hand f to the loop (any thread). */
static void server_post_done(kvf_server_fetch *f) {
  kvf_server *s = f->s;
  f->done_next = NULL;
  pthread_mutex_lock(&s->out_mu);
  if (s->fetch_done_tail)
    s->fetch_done_tail->done_next = f;
  else
    s->fetch_done_head = f;
  s->fetch_done_tail = f;
  pthread_mutex_unlock(&s->out_mu);
  char b = 1;
  ssize_t n = write(s->stop_pipe[1], &b, 1); /* full pipe: a wake-up is already pending */
  (void)n;
}

static int server_fetch_pending(kvf_server *s, uint64_t client_id, uint64_t request_id) {
  for (kvf_server_fetch *f = s->fetching; f; f = f->next)
    if (f->client_id == client_id && f->h.request_id == request_id) return 1;
  return 0;
}

/* A RETRIEVE or LOOKUP: when ready peers may hold what L1 lacks, start a
 * fetch and return 1 (the request is answered when it is over); 0: answer
 * it now. */
static int server_fetch_start(kvf_server *s, kvf_server_conn *c, const kvf_proto_header *h, const uint8_t *payload,
                              const kvf_proto_msg *m) {
  if (!s->peers || !c->binding || kvf_peers_ready(s->peers) == 0) return 0;
  kvf_l1_object_spec *specs = NULL;
  uint32_t n = 0;
  int device = -1;
  kvf_status ms = h->type == KVF_PROTO_LOOKUP
                      ? kvf_dataplane_lookup_missing(s->dp, c->binding, &m->u.lookup, &specs, &n, &device)
                      : kvf_dataplane_retrieve_missing(s->dp, c->binding, m, &specs, &n, &device);
  if (ms != KVF_SUCCESS || n == 0) {
    free(specs);
    return 0; /* a request submit refuses, or nothing missing */
  }
  if (n > KVF_PEERS_MAX_OBJECTS) n = KVF_PEERS_MAX_OBJECTS; /* the first chunks: the prefix is what counts */
  kvf_server_fetch *f = calloc(1, sizeof(*f));
  uint8_t *copy = malloc(h->payload_len ? h->payload_len : 1);
  if (!f || !copy) {
    free(f);
    free(copy);
    free(specs);
    return 0;
  }
  if (h->payload_len) memcpy(copy, payload, h->payload_len);
  f->s = s;
  f->client_id = c->client_id;
  f->h = *h;
  f->payload = copy;
  f->specs = specs;
  if (kvf_peers_fetch(s->peers, device, specs, n, server_post_fetch, f) != KVF_SUCCESS) {
    KVF_INFO(SERVER, "client %llu: %s %llu: no fetch from peers: %s", (unsigned long long)c->client_id,
             kvf_proto_type_name(h->type), (unsigned long long)h->request_id, kvf_last_error());
    free(copy);
    free(f);
    free(specs);
    return 0;
  }
  KVF_INFO(SERVER, "client %llu: %s %llu: %u objects missing here, asking %u peers", (unsigned long long)c->client_id,
           kvf_proto_type_name(h->type), (unsigned long long)h->request_id, n, kvf_peers_ready(s->peers));
  f->next = s->fetching;
  s->fetching = f;
  return 1;
}

static void server_fetch_free(kvf_server_fetch *f) {
  free(f->chunk_of);
  free(f->result);
  free(f->specs);
  free(f->payload);
  free(f);
}

/* The peer thread's callback: a PUSH is over. */
static void server_post_push(void *arg, const uint8_t *result, uint32_t n, uint64_t bytes, kvf_status status,
                             const char *message) {
  kvf_server_fetch *f = arg;
  memcpy(f->result, result, n);
  f->bytes = bytes;
  f->status = status;
  snprintf(f->message, sizeof(f->message), "%s", message ? message : "");
  server_post_done(f);
}

/* PUSH: checked here (registration, range, the object count a peer message
 * holds), then handed to the peer thread; answered when the peer has
 * answered (server_push_reply). Nothing but bookkeeping on the loop. */
static kvf_status handle_push(kvf_server *s, kvf_server_conn *c, const kvf_proto_msg *m) {
  const kvf_proto_push *q = &m->u.push;
  if (!s->peers) {
    kvf_fail(KVF_ERR_UNSUPPORTED, "payload.peer: this kvferryd has no peers (start it with --peer or --listen)");
    return server_send_error(s, c, m->request_id, KVF_ERR_UNSUPPORTED, NULL);
  }
  if (c->pushes >= KVF_SERVER_MAX_PUSHES) {
    kvf_fail(KVF_ERR_BUSY, "quota.pushes: %u PUSHes in flight, the limit is %u; wait for a reply", (unsigned)c->pushes,
             KVF_SERVER_MAX_PUSHES);
    return server_send_error(s, c, m->request_id, KVF_ERR_BUSY, NULL);
  }
  kvf_l1_object_spec *specs = NULL;
  uint32_t *chunk_of = NULL, n = 0;
  kvf_status st = kvf_dataplane_push_specs(s->dp, c->binding, q, &specs, &chunk_of, &n);
  if (st == KVF_SUCCESS && n > KVF_PEERS_MAX_OBJECTS)
    st = kvf_fail(KVF_ERR_INVALID_ARGUMENT,
                  "payload.num_chunk_keys: %u chunks name %u objects, one PUSH moves at most %u: split it",
                  q->num_chunk_keys, n, KVF_PEERS_MAX_OBJECTS);
  if (st == KVF_SUCCESS && n == 0)
    st = kvf_fail(KVF_ERR_INVALID_ARGUMENT, "payload.token_end: the range names no object");
  kvf_server_fetch *f = st == KVF_SUCCESS ? calloc(1, sizeof(*f)) : NULL;
  if (st == KVF_SUCCESS && f) {
    f->result = calloc(n, 1);
    if (!f->result) {
      free(f);
      f = NULL;
    }
  }
  if (st == KVF_SUCCESS && !f) st = kvf_fail(KVF_ERR_OUT_OF_MEMORY, "push: out of memory");
  if (st == KVF_SUCCESS) {
    f->s = s;
    f->client_id = c->client_id;
    f->h.type = KVF_PROTO_PUSH;
    f->h.request_id = m->request_id;
    f->specs = specs;
    f->chunk_of = chunk_of;
    f->n = n;
    st = kvf_peers_push(s->peers, q->peer, specs, n, server_post_push, f);
    if (st != KVF_SUCCESS) {
      f->specs = NULL;
      f->chunk_of = NULL;
      server_fetch_free(f);
    }
  }
  if (st != KVF_SUCCESS) {
    free(specs);
    free(chunk_of);
    KVF_INFO(SERVER, "client %llu: PUSH %llu refused: %s", (unsigned long long)c->client_id,
             (unsigned long long)m->request_id, kvf_last_error());
    return server_send_error(s, c, m->request_id, st, NULL);
  }
  c->pushes++;
  f->next = s->fetching;
  s->fetching = f;
  KVF_INFO(SERVER, "client %llu: PUSH %llu: %u objects of %u chunks to peer %s", (unsigned long long)c->client_id,
           (unsigned long long)m->request_id, n, q->num_chunk_keys, q->peer);
  return KVF_SUCCESS;
}

/* Answer a PUSH whose peer answered (or was lost). */
static void server_push_reply(kvf_server *s, kvf_server_conn *c, const kvf_server_fetch *f) {
  if (c->pushes) c->pushes--;
  if (f->status != KVF_SUCCESS) {
    kvf_fail(f->status, "%s", f->message);
    (void)server_send_error(s, c, f->h.request_id, f->status, NULL);
    return;
  }
  kvf_proto_msg r;
  memset(&r, 0, sizeof(r));
  r.type = KVF_PROTO_PUSH_REPLY;
  r.request_id = f->h.request_id;
  kvf_proto_push_reply *x = &r.u.push_reply;
  uint64_t chunks = 0;
  int whole = 1;
  for (uint32_t i = 0; i < f->n; i++) {
    uint8_t v = f->result[i];
    x->objects_pushed += v == KVF_PEERS_PUSH_COPIED;
    x->objects_present += v == KVF_PEERS_PUSH_PRESENT;
    x->objects_missing += v == KVF_PEERS_PUSH_MISSING;
    x->objects_failed += v == KVF_PEERS_PUSH_FAILED;
    /* Specs come chunk by chunk: a chunk counts once all of its are there. */
    if (whole && v != KVF_PEERS_PUSH_COPIED && v != KVF_PEERS_PUSH_PRESENT) whole = 0;
    if (whole && (i + 1 == f->n || f->chunk_of[i + 1] != f->chunk_of[i])) chunks = (uint64_t)f->chunk_of[i] + 1;
  }
  x->bytes_pushed = f->bytes;
  x->chunks_on_peer = chunks;
  KVF_INFO(SERVER, "client %llu: PUSH %llu: %llu pushed, %llu there already, %llu not here, %llu failed",
           (unsigned long long)c->client_id, (unsigned long long)f->h.request_id,
           (unsigned long long)x->objects_pushed, (unsigned long long)x->objects_present,
           (unsigned long long)x->objects_missing, (unsigned long long)x->objects_failed);
  (void)server_send(s, c, &r);
}

/* A peer holds a key of f's request through another geometry or for
 * another model: the request is refused as such an object in local L1 is,
 * naming the key (its index among the request's keys). */
static kvf_status fetch_refusal(const kvf_server_fetch *f, const kvf_chunk_key *keys, uint32_t n) {
  uint64_t k = 0;
  while (k < n && memcmp(&keys[k], &f->specs[f->spec].key.chunk, sizeof(kvf_chunk_key)) != 0) k++;
  return kvf_fail(f->status, "payload.chunk_keys[%llu]: object group %u: %s", (unsigned long long)k,
                  (unsigned)f->specs[f->spec].object_group, f->message);
}

/* Submit the RETRIEVEs whose fetch is over (loop thread): L1 now holds what
 * the peers gave; the data plane restores the prefix it finds, as always. */
static void server_finish_fetches(kvf_server *s) {
  pthread_mutex_lock(&s->out_mu);
  kvf_server_fetch *f = s->fetch_done_head;
  s->fetch_done_head = s->fetch_done_tail = NULL;
  pthread_mutex_unlock(&s->out_mu);
  while (f) {
    kvf_server_fetch *next = f->done_next;
    for (kvf_server_fetch **pp = &s->fetching; *pp; pp = &(*pp)->next)
      if (*pp == f) {
        *pp = f->next;
        break;
      }
    uint32_t index = 0;
    kvf_server_conn *c = conn_by_client(s, f->client_id, &index);
    if (c && f->h.type == KVF_PROTO_PUSH) {
      server_push_reply(s, c, f);
    } else if (c && f->h.type == KVF_PROTO_LOOKUP) {
      kvf_proto_msg m;
      kvf_status st = kvf_proto_decode(&f->h, f->payload, &m);
      if (st == KVF_SUCCESS && f->status != KVF_SUCCESS) {
        st = fetch_refusal(f, m.u.lookup.chunk_keys, m.u.lookup.num_chunk_keys);
        (void)server_send_error(s, c, f->h.request_id, st, NULL);
      } else if (st == KVF_SUCCESS) {
        (void)handle_lookup(s, c, &m);
      } else {
        (void)server_send_error(s, c, f->h.request_id, st, NULL);
      }
      kvf_proto_msg_clear(&m);
    } else if (c) {
      kvf_proto_msg m;
      kvf_status st = kvf_proto_decode(&f->h, f->payload, &m);
      int decoded = st == KVF_SUCCESS;
      if (decoded && f->status != KVF_SUCCESS) {
        st = fetch_refusal(f, m.u.xfer.chunk_keys, m.u.xfer.num_chunk_keys);
      } else if (decoded) {
        st = kvf_dataplane_submit(s->dp, c->binding, c->client_id, &m);
      }
      if (st != KVF_SUCCESS) {
        id_set_remove(&c->in_flight, f->h.request_id);
        KVF_INFO(SERVER, "client %llu: RETRIEVE %llu refused after its fetch: %s", (unsigned long long)c->client_id,
                 (unsigned long long)f->h.request_id, kvf_last_error());
        (void)server_send_error(s, c, f->h.request_id, st, NULL);
      }
      if (decoded) kvf_proto_msg_clear(&m);
    }
    server_fetch_free(f);
    f = next;
  }
}

/* One whole frame from c. Returns KVF_SUCCESS to keep the connection. */
static kvf_status server_dispatch(kvf_server *s, kvf_server_conn *c, const kvf_proto_header *h, const uint8_t *payload,
                                  int *fds, uint32_t num_fds) {
  kvf_proto_msg m;
  kvf_status st = kvf_proto_decode(h, payload, &m);
  if (st != KVF_SUCCESS) {
    close_fds(fds, num_fds);
    KVF_INFO(SERVER, "client %llu: bad %s frame: %s", (unsigned long long)c->client_id, kvf_proto_type_name(h->type),
             kvf_last_error());
    server_send_error(s, c, h->request_id, st, NULL);
    return st;
  }
  if (h->type != KVF_PROTO_REGISTER) close_fds(fds, num_fds); /* only REGISTER carries descriptors */
  if (h->type & KVF_PROTO_REPLY) {
    st = kvf_fail(KVF_ERR_PROTOCOL, "header.type: %s is a reply; a client sends requests",
                  kvf_proto_type_name(h->type));
    server_send_error(s, c, h->request_id, st, NULL);
    goto out;
  }
  if (!c->hello_done && h->type != KVF_PROTO_HELLO) {
    st = kvf_fail(KVF_ERR_PROTOCOL, "header.type: %s before HELLO", kvf_proto_type_name(h->type));
    server_send_error(s, c, h->request_id, st, NULL);
    goto out;
  }
  switch (h->type) {
    case KVF_PROTO_HELLO: st = handle_hello(s, c, &m); break;
    case KVF_PROTO_REGISTER: st = handle_register(s, c, &m, fds, num_fds); break;
    case KVF_PROTO_UNREGISTER: st = handle_unregister(s, c, &m); break;
    case KVF_PROTO_HEARTBEAT: {
      kvf_proto_msg r;
      memset(&r, 0, sizeof(r));
      r.type = KVF_PROTO_HEARTBEAT_REPLY;
      r.request_id = m.request_id;
      r.u.heartbeat_reply.sequence = m.u.heartbeat.sequence;
      r.u.heartbeat_reply.boot_token = s->boot_token;
      st = server_send(s, c, &r);
      break;
    }
    case KVF_PROTO_STAT: st = handle_stat(s, c, &m); break;
    case KVF_PROTO_LOOKUP:
      st = server_fetch_start(s, c, h, payload, &m) ? KVF_SUCCESS : handle_lookup(s, c, &m);
      break;
    case KVF_PROTO_PUSH: st = handle_push(s, c, &m); break;
    case KVF_PROTO_UNPIN: st = handle_unpin(s, c, &m); break;
    case KVF_PROTO_STORE:
    case KVF_PROTO_RETRIEVE: {
      /* A retry of a request still in flight gets no second reply: it is
       * neither counted again nor refused. */
      int known = id_set_has(&c->in_flight, h->request_id);
      if (!known && c->in_flight.count >= s->opt.max_requests_in_flight) {
        st = kvf_fail(KVF_ERR_BUSY,
                      "quota.requests_in_flight: %u STORE/RETRIEVE in flight, the limit is %u "
                      "(max_requests_in_flight); wait for a reply",
                      (unsigned)c->in_flight.count, (unsigned)s->opt.max_requests_in_flight);
        st = server_send_error(s, c, h->request_id, st, NULL);
        break;
      }
      if (!known && (st = id_set_add(&c->in_flight, h->request_id)) != KVF_SUCCESS) {
        st = server_send_error(s, c, h->request_id, st, NULL);
        break;
      }
      if (known && server_fetch_pending(s, c->client_id, h->request_id)) break; /* its reply answers both */
      if (!known && h->type == KVF_PROTO_RETRIEVE && server_fetch_start(s, c, h, payload, &m)) break;
      st = kvf_dataplane_submit(s->dp, c->binding, c->client_id, &m);
      if (st != KVF_SUCCESS) {
        if (!known) id_set_remove(&c->in_flight, h->request_id);
        KVF_INFO(SERVER, "client %llu: %s %llu refused: %s", (unsigned long long)c->client_id,
                 kvf_proto_type_name(h->type), (unsigned long long)h->request_id, kvf_last_error());
        st = server_send_error(s, c, h->request_id, st, NULL);
      }
      break;
    }
    default:
      st = server_send_error(s, c, h->request_id, KVF_ERR_UNSUPPORTED, "header.type: not a request");
      break;
  }
out:
  kvf_proto_msg_clear(&m);
  return st;
}

/* Whether the loop reads c now. Not while its frame waits for the frame
 * pool, nor while its unread replies hold half its reply quota (a client
 * that does not read is not read either). (Anything else that must hold c's reading, such as work started for
 * its last frame that has to finish before the next is read, belongs here
 * too: the loop then neither reads c nor blames it for silence or slowness,
 * and a paused connection's clocks restart when it resumes.) */
static int conn_readable(const kvf_server *s, const kvf_server_conn *c) {
  return !c->register_busy && c->wait_seq == 0 && c->q_bytes < s->opt.max_reply_queue_bytes / 2;
}

/* c's header asks for `len` bytes of the pool: grant them now if they fit
 * and nobody waits ahead, else queue c (it is not read until granted). */
static kvf_status conn_pool_ask(kvf_server *s, kvf_server_conn *c, uint32_t len) {
  if (s->waiting == 0 && s->buffered + len <= s->opt.max_buffered_bytes) {
    kvf_status st = kvf_conn_grant(&c->conn);
    if (st != KVF_SUCCESS) return st;
    c->granted = len;
    s->buffered += len;
    return KVF_SUCCESS;
  }
  c->wait_seq = ++s->wait_next;
  s->waiting++;
  KVF_INFO(SERVER, "client %llu: a %u-byte frame waits for buffer memory (%llu of %llu bytes in use, %u waiting)",
           (unsigned long long)c->client_id, len, (unsigned long long)s->buffered,
           (unsigned long long)s->opt.max_buffered_bytes, (unsigned)s->waiting);
  return KVF_SUCCESS;
}

/* Grant the pool to waiting frames, oldest first, while the oldest fits. */
static void server_pool_grant(kvf_server *s, uint64_t now) {
  while (s->waiting > 0) {
    kvf_server_conn *first = NULL;
    for (uint32_t i = 0; i < s->num_conns; i++) {
      kvf_server_conn *c = s->conns[i];
      if (c->wait_seq && (!first || c->wait_seq < first->wait_seq)) first = c;
    }
    if (!first) { /* cannot happen: every waiting connection is listed */
      s->waiting = 0;
      return;
    }
    uint32_t len = kvf_proto_reader_held(&first->conn.reader);
    if (s->buffered + len > s->opt.max_buffered_bytes) return;
    first->wait_seq = 0;
    s->waiting--;
    if (kvf_conn_grant(&first->conn) != KVF_SUCCESS) {
      /* Out of memory: the connection has failed; its next read says so. */
      KVF_WARN(SERVER, "client %llu: %s", (unsigned long long)first->client_id, kvf_last_error());
      continue;
    }
    first->granted = len;
    s->buffered += len;
    /* Its deadline runs from the grant, and it is behind until a read finds
     * more of it waiting (a sender that never sends the payload is dropped). */
    first->frame_started_ns = now;
    first->dry = 1;
  }
}

/* c's turn: read and dispatch what it has waiting, at most
 * KVF_SERVER_TURN_FRAMES frames and KVF_SERVER_TURN_BYTES bytes (the rest
 * waits for the next turn, after every other connection had its own).
 * Returns KVF_SUCCESS to keep c. */
static kvf_status server_conn_service(kvf_server *s, kvf_server_conn *c, const char **why) {
  int fds[KVF_PROTO_MAX_FDS];
  size_t budget = KVF_SERVER_TURN_BYTES;
  uint64_t now = kvf_now_ns();
  c->dry = 0;
  for (uint32_t frames = 0; frames < KVF_SERVER_TURN_FRAMES && budget > 0 && conn_readable(s, c);) {
    kvf_proto_header h;
    uint8_t *payload = NULL;
    uint32_t num_fds = 0;
    size_t got = 0;
    int drained = 0;
    kvf_status st =
        kvf_conn_read_some(&c->conn, budget, &got, &drained, &h, &payload, fds, KVF_PROTO_MAX_FDS, &num_fds);
    budget -= got < budget ? got : budget;
    if (st == KVF_ERR_TIMEOUT) {
      if (c->conn.reader.header_have > 0 && !c->frame_started_ns) c->frame_started_ns = now;
      uint32_t held = kvf_proto_reader_held(&c->conn.reader);
      if (held && !c->wait_seq) {
        st = conn_pool_ask(s, c, held);
        if (st != KVF_SUCCESS) {
          *why = "out of memory for a frame";
          return st;
        }
        continue; /* granted: read on; queued: the loop stops */
      }
      c->dry = drained;
      return KVF_SUCCESS;
    }
    if (st == KVF_ERR_DISCONNECTED) {
      *why = "peer closed";
      return st;
    }
    if (st != KVF_SUCCESS) {
      /* A bad header (wrong version or magic, oversize) or truncated frame:
       * answer if the socket still takes it, then drop the connection. */
      KVF_INFO(SERVER, "client %llu: %s", (unsigned long long)c->client_id, kvf_last_error());
      server_send_error(s, c, h.request_id, st, NULL);
      *why = "bad frame";
      return st;
    }
    frames++;
    c->frame_started_ns = 0;
    st = server_dispatch(s, c, &h, payload, fds, num_fds);
    free(payload);
    conn_pool_release(s, c);
    if (st != KVF_SUCCESS) {
      *why = "bad request or reply not delivered";
      return st;
    }
    if (c->register_busy) return KVF_SUCCESS; /* paused: the rest waits for the REGISTER's reply */
  }
  return KVF_SUCCESS;
}

/* Bytes from c were waiting at the poll of t_ns: it is alive as of then. */
static void conn_seen(kvf_server *s, kvf_server_conn *c, uint64_t t_ns) {
  if (t_ns <= c->last_seen_ns) return;
  c->last_seen_ns = t_ns;
  if (c->hello_done) (void)kvf_registry_heartbeat(s->registry, c->client_id, t_ns);
}

/* ---- the object ----------------------------------------------------------- */

/* With KVF_PEER_SHM=1 the L1 pools are the peer transport's memory: UCX's
 * posix/sysv then map a pool into a peer on this host and its gets are a
 * memcpy, where from memory we allocated they fall back to active messages
 * (30x slower, perf/results/2026-12-01-cpu-peers). */
static kvf_status server_pool_alloc(void *ctx, int device, uint64_t bytes, void **base, void **handle) {
  kvf_server *s = ctx;
  kvf_pt_mem *m = NULL;
  kvf_status st = kvf_pt_mem_alloc(s->pt_ctx, (size_t)bytes, &m);
  if (st != KVF_SUCCESS) return st;
  *base = kvf_pt_mem_base(m);
  *handle = m;
  KVF_INFO(SERVER, "lane %d: L1 pool allocated by the peer transport (KVF_PEER_SHM=1)", device);
  return KVF_SUCCESS;
}

static void server_pool_free(void *ctx, void *handle) {
  (void)ctx;
  kvf_pt_mem_free(handle);
}

kvf_status kvf_server_create(const kvf_server_options *caller, kvf_server **out) {
  if (!caller || !out) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_server_create: NULL argument");
  kvf_server_options local = KVF_SERVER_OPTIONS_INIT;
  const kvf_server_options *options = &local;
  kvf_status vs = KVF_VERSIONED_IN(kvf_server_options, &local, caller);
  if (vs != KVF_SUCCESS) return vs;
  if (!options->socket_dir || !options->socket_dir[0])
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "options.socket_dir: required");
  kvf_status st;
  kvf_server *s = calloc(1, sizeof(*s));
  if (!s) return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "kvf_server_create: out of memory");
  s->opt = *options;
  s->stop_pipe[0] = s->stop_pipe[1] = -1;
  if (!s->opt.heartbeat_timeout_ms) s->opt.heartbeat_timeout_ms = 10000;
  if (!s->opt.heartbeat_period_ms) s->opt.heartbeat_period_ms = s->opt.heartbeat_timeout_ms / 4 ? s->opt.heartbeat_timeout_ms / 4 : 1;
  if (!s->opt.max_clients) s->opt.max_clients = 256;
  if (!s->opt.write_timeout_ms) s->opt.write_timeout_ms = 2000;
  if (!s->opt.hello_timeout_ms) s->opt.hello_timeout_ms = 5000;
  if (!s->opt.frame_timeout_ms) s->opt.frame_timeout_ms = 5000;
  if (!s->opt.max_frame_bytes) s->opt.max_frame_bytes = KVF_PROTO_MAX_PAYLOAD;
  if (!s->opt.max_buffered_bytes) s->opt.max_buffered_bytes = 64ull << 20;
  if (!s->opt.max_requests_in_flight) s->opt.max_requests_in_flight = 1024;
  if (!s->opt.max_reply_queue_bytes) s->opt.max_reply_queue_bytes = 16ull << 20;
  if (s->opt.max_reply_queue_bytes < (1u << 20)) {
    st = kvf_fail(KVF_ERR_INVALID_ARGUMENT, "options.max_reply_queue_bytes: %llu is less than 1 MiB (a STAT reply "
                  "may take 200 KiB)", (unsigned long long)s->opt.max_reply_queue_bytes);
    goto fail;
  }
  if (s->opt.max_frame_bytes < KVF_SERVER_HELLO_MAX_PAYLOAD || s->opt.max_frame_bytes > KVF_PROTO_MAX_PAYLOAD) {
    st = kvf_fail(KVF_ERR_INVALID_ARGUMENT, "options.max_frame_bytes: %u is not within %u .. %u (the protocol's limit)",
                  (unsigned)s->opt.max_frame_bytes, KVF_SERVER_HELLO_MAX_PAYLOAD, KVF_PROTO_MAX_PAYLOAD);
    goto fail;
  }
  if (s->opt.max_buffered_bytes < s->opt.max_frame_bytes) {
    st = kvf_fail(KVF_ERR_INVALID_ARGUMENT,
                  "options.max_buffered_bytes: %llu is less than max_frame_bytes %u: a frame that large could never "
                  "be read",
                  (unsigned long long)s->opt.max_buffered_bytes, (unsigned)s->opt.max_frame_bytes);
    goto fail;
  }
  if (!s->opt.max_mapped_bytes) s->opt.max_mapped_bytes = 64ull << 40;
  if (!s->opt.max_client_mapped_bytes) {
    /* An H200 engine maps ~141 GB per GPU (twice that while it re-registers
     * new memory); a host-backend engine may map most of the RAM. */
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    uint64_t ram = pages > 0 && page > 0 ? (uint64_t)pages * (uint64_t)page : 0;
    s->opt.max_client_mapped_bytes = 2 * ram > (2ull << 40) ? 2 * ram : 2ull << 40;
  }
  if (s->opt.max_client_mapped_bytes > s->opt.max_mapped_bytes) s->opt.max_client_mapped_bytes = s->opt.max_mapped_bytes;
  if (!s->opt.max_client_registrations) s->opt.max_client_registrations = 8;
  if (!s->opt.max_client_pins) s->opt.max_client_pins = 256;
  if (!s->opt.max_client_pinned_chunks) s->opt.max_client_pinned_chunks = 65536;
  s->pin_deadline_ns = UINT64_MAX;
  s->opt.socket_dir = NULL; /* not kept: only the endpoint needs it */
  s->opt.peer_listen = s->opt.peer_secret_file = NULL;
  s->opt.peers = NULL;
  s->next_client_id = 1;
  while (s->boot_token == 0) {
    if (getrandom(&s->boot_token, sizeof(s->boot_token), 0) != (ssize_t)sizeof(s->boot_token)) {
      st = kvf_fail(KVF_ERR_SYSTEM, "boot token: getrandom failed: %s", strerror(errno));
      goto fail;
    }
  }
  s->conns = calloc(s->opt.max_clients, sizeof(*s->conns));
  s->pfds = calloc((size_t)s->opt.max_clients + 2, sizeof(*s->pfds));
  if (!s->conns || !s->pfds) {
    st = kvf_fail(KVF_ERR_OUT_OF_MEMORY, "kvf_server_create: out of memory");
    goto fail;
  }
  if (pipe2(s->stop_pipe, O_CLOEXEC | O_NONBLOCK) != 0) {
    st = kvf_fail(KVF_ERR_SYSTEM, "stop pipe: %s", strerror(errno));
    goto fail;
  }
  st = kvf_import_table_create(NULL, &s->table);
  if (st != KVF_SUCCESS) goto fail;
  /* A mapping belongs to the connection that imported it (DESIGN.md §9). */
  kvf_import_policy policy;
  memset(&policy, 0, sizeof(policy));
  policy.owned = 1;
  policy.max_account_bytes = s->opt.max_client_mapped_bytes;
  policy.max_total_bytes = s->opt.max_mapped_bytes;
  st = kvf_import_table_set_policy(s->table, &policy);
  if (st != KVF_SUCCESS) goto fail;
  st = kvf_registry_create(s->table, NULL, &s->registry);
  if (st != KVF_SUCCESS) goto fail;
  if (pthread_mutex_init(&s->out_mu, NULL) != 0) {
    st = kvf_fail(KVF_ERR_SYSTEM, "kvf_server_create: mutex");
    goto fail;
  }
  s->out_mu_init = 1;
  /* Without hwloc's view the lanes still run, unpinned. */
  if (kvf_topology_create(&s->topology) != KVF_SUCCESS) {
    KVF_WARN(SERVER, "topology: %s; lane threads stay unpinned", kvf_last_error());
    s->topology = NULL;
  }
  if (options->peer_listen || options->num_peers) {
    st = kvf_pt_context_create(&s->pt_ctx);
    if (st != KVF_SUCCESS) goto fail;
  }
  kvf_dataplane_options dpo;
  memset(&dpo, 0, sizeof(dpo));
  dpo.registry = s->registry;
  if (s->pt_ctx && kvf_param_peer_shm() == 1) {
    dpo.pool_alloc = server_pool_alloc;
    dpo.pool_free = server_pool_free;
    dpo.pool_ctx = s;
  }
  dpo.devices = options->devices;
  dpo.num_devices = options->num_devices;
  dpo.l1_bytes = options->l1_bytes;
  dpo.host_l1_bytes = options->host_l1_bytes;
  dpo.job_timeout_ms = options->request_timeout_ms;
  dpo.topology = s->topology;
  dpo.reply = server_post_reply;
  dpo.reply_ctx = s;
  dpo.test_fail_step = options->test_fail_step;
  dpo.test_fail_type = options->test_fail_type;
  dpo.test_completion_delay_ms = options->test_completion_delay_ms;
  st = kvf_dataplane_create(&dpo, &s->dp);
  if (st != KVF_SUCCESS) goto fail;
  kvf_register_options ro;
  memset(&ro, 0, sizeof(ro));
  ro.registry = s->registry;
  ro.dp = s->dp;
  ro.max_client_registrations = s->opt.max_client_registrations;
  ro.done = server_post_register;
  ro.done_ctx = s;
  st = kvf_register_worker_create(&ro, &s->reg_worker);
  if (st != KVF_SUCCESS) goto fail;
  if (options->peer_listen || options->num_peers) {
    kvf_l1_pool_desc pools[65];
    uint32_t np = kvf_dataplane_pools(s->dp, pools, 65);
    kvf_peers_options po;
    memset(&po, 0, sizeof(po));
    po.listen = options->peer_listen;
    po.peers = options->peers;
    po.num_peers = options->num_peers;
    po.secret_file = options->peer_secret_file;
    po.boot_token = s->boot_token;
    po.l1 = kvf_dataplane_l1(s->dp);
    po.pools = pools;
    po.num_pools = np > 65 ? 65 : np;
    po.fetch_timeout_ms = options->peer_fetch_timeout_ms;
    po.transport_context = s->pt_ctx;
    st = kvf_peers_create(&po, &s->peers);
    if (st != KVF_SUCCESS) goto fail;
  }
  st = kvf_endpoint_listen(options->socket_dir, 0, &s->ep);
  if (st != KVF_SUCCESS) goto fail;
  KVF_INFO(SERVER, "listening on %s (heartbeat timeout %u ms, boot token %016llx)", kvf_endpoint_socket_path(s->ep),
           (unsigned)s->opt.heartbeat_timeout_ms, (unsigned long long)s->boot_token);
  KVF_INFO(SERVER, "quotas: %llu GiB mapped per client process, %llu GiB in all, %u registrations per client",
           (unsigned long long)(s->opt.max_client_mapped_bytes >> 30), (unsigned long long)(s->opt.max_mapped_bytes >> 30),
           (unsigned)s->opt.max_client_registrations);
  *out = s;
  return KVF_SUCCESS;
fail:
  kvf_server_destroy(s);
  return st;
}

void kvf_server_stop(kvf_server *s) {
  if (!s) return;
  __atomic_store_n(&s->stop_flag, 1, __ATOMIC_SEQ_CST);
  int saved = errno; /* signal handlers must not change errno */
  char b = 1;
  ssize_t n = write(s->stop_pipe[1], &b, 1); /* full pipe: a wake-up is already pending */
  (void)n;
  errno = saved;
}

uint64_t kvf_server_boot_token(const kvf_server *s) { return s ? s->boot_token : 0; }

const char *kvf_server_socket_path(const kvf_server *s) {
  return s && s->ep ? kvf_endpoint_socket_path(s->ep) : "";
}

kvf_status kvf_server_stats(kvf_server *s, kvf_registry_stats *out) {
  if (!s) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_server_stats: NULL server");
  return kvf_registry_stats_get(s->registry, out);
}

kvf_status kvf_server_data_stats(kvf_server *s, kvf_dataplane_stats *out) {
  if (!s || !out) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_server_data_stats: NULL argument");
  return kvf_dataplane_stats_get(s->dp, out);
}

/* The slot of the oldest connection that has not said HELLO, or -1. */
static int32_t oldest_without_hello(const kvf_server *s) {
  int32_t best = -1;
  for (uint32_t i = 0; i < s->num_conns; i++)
    if (!s->conns[i]->hello_done && (best < 0 || s->conns[i]->accepted_ns < s->conns[best]->accepted_ns))
      best = (int32_t)i;
  return best;
}

/* Refusals and evictions come in floods when someone holds or churns
 * connections: one warning a second says how many. */
static void warn_slots(kvf_server *s, uint64_t now) {
  if (!s->refused && !s->evicted) return;
  if (s->refused_warned_ns && now - s->refused_warned_ns < 1000000000ull) return;
  KVF_WARN(SERVER,
           "every client slot is taken (max_clients %u): %llu connections refused, %llu idle ones (no HELLO) "
           "dropped to make room since the last warning",
           (unsigned)s->opt.max_clients, (unsigned long long)s->refused, (unsigned long long)s->evicted);
  s->refused = s->evicted = 0;
  s->refused_warned_ns = now;
}

/* Accept what is waiting, at most KVF_SERVER_TURN_ACCEPTS. Called between
 * walks over the connections (it may drop one to make room). */
static void server_accept(kvf_server *s) {
  for (uint32_t turn = 0; turn < KVF_SERVER_TURN_ACCEPTS; turn++) {
    kvf_conn conn;
    kvf_status st = kvf_endpoint_accept(s->ep, 0, 0, &conn);
    if (st == KVF_ERR_TIMEOUT) break;
    if (st == KVF_ERR_PERMISSION) continue; /* logged by the endpoint */
    if (st != KVF_SUCCESS) {
      KVF_WARN(SERVER, "accept: %s", kvf_last_error());
      break;
    }
    uint64_t now = kvf_now_ns();
    if (s->num_conns >= s->opt.max_clients) {
      /* The reserve: a connection that has not said HELLO gives its slot to
       * the newcomer, oldest first (an engine says HELLO as it connects). */
      int32_t victim = oldest_without_hello(s);
      if (victim < 0) {
        kvf_conn_send_error(&conn, 0, KVF_ERR_BUSY,
                            "server: every client slot is taken (max_clients) by clients that said HELLO", 100);
        kvf_conn_close(&conn);
        s->refused++;
        continue;
      }
      kvf_server_conn *v = s->conns[victim];
      (void)server_send_error(s, v, 0, KVF_ERR_BUSY,
                              "server: every client slot is taken (max_clients); this connection had not said "
                              "HELLO and gave its slot to a newer one");
      server_conn_drop(s, (uint32_t)victim, "no HELLO yet, slot given to a new connection");
      s->evicted++;
    }
    kvf_server_conn *c = calloc(1, sizeof(*c));
    if (!c) {
      kvf_conn_close(&conn);
      break;
    }
    c->conn = conn;
    /* Until HELLO nothing larger than a HELLO; nothing is held. */
    kvf_proto_reader_limit(&c->conn.reader, KVF_SERVER_HELLO_MAX_PAYLOAD, 0);
    c->client_id = s->next_client_id++;
    c->accepted_ns = c->last_seen_ns = now;
    s->conns[s->num_conns++] = c;
    KVF_TRACE(SERVER, "client %llu: accepted pid %d", (unsigned long long)c->client_id, (int)conn.peer.pid);
  }
  warn_slots(s, kvf_now_ns());
}

/* Reap clients silent past the timeout as of the last poll (poll_ns): their
 * connections are dropped (a stopped or hung engine), and the registry's
 * reaper catches the rest. */
static void server_reap(kvf_server *s, uint64_t poll_ns) {
  uint64_t now = kvf_now_ns();
  server_expire_pins(s, now);
  uint64_t timeout_ns = (uint64_t)s->opt.heartbeat_timeout_ms * 1000000ull;
  uint64_t hello_ns = (uint64_t)s->opt.hello_timeout_ms * 1000000ull;
  uint64_t frame_ns = (uint64_t)s->opt.frame_timeout_ms * 1000000ull;
  for (uint32_t i = 0; i < s->num_conns;) {
    kvf_server_conn *c = s->conns[i];
    int readable = conn_readable(s, c) && !c->paused;
    /* A frame begun and not finished, with the socket dry at our last read
     * (the sender is behind, not the loop): a slow sender, dropped. */
    if (readable && c->frame_started_ns && c->dry && poll_ns > c->frame_started_ns &&
        poll_ns - c->frame_started_ns > frame_ns) {
      const kvf_proto_reader *r = &c->conn.reader;
      if (r->header_have < KVF_PROTO_HEADER_SIZE)
        kvf_fail(KVF_ERR_TIMEOUT, "frame: only %zu of the header's %u bytes arrived in %u ms (frame_timeout_ms)",
                 r->header_have, KVF_PROTO_HEADER_SIZE, (unsigned)s->opt.frame_timeout_ms);
      else
        kvf_fail(KVF_ERR_TIMEOUT, "frame: only %zu of the payload's %u bytes arrived in %u ms (frame_timeout_ms)",
                 r->payload_have, r->header.payload_len, (unsigned)s->opt.frame_timeout_ms);
      KVF_INFO(SERVER, "client %llu (pid %d): %s", (unsigned long long)c->client_id, (int)c->conn.peer.pid,
               kvf_last_error());
      (void)server_send_error(s, c, r->header_have == KVF_PROTO_HEADER_SIZE ? r->header.request_id : 0,
                              KVF_ERR_TIMEOUT, NULL);
      server_conn_drop(s, i, "frame not finished in time");
      continue;
    }
    if (!c->hello_done && poll_ns > c->accepted_ns && poll_ns - c->accepted_ns > hello_ns) {
      /* Anything it sent by the last poll was read before this: no HELLO came. */
      kvf_fail(KVF_ERR_TIMEOUT, "connection.hello: no HELLO within %u ms of connecting (hello_timeout_ms)",
               (unsigned)s->opt.hello_timeout_ms);
      (void)server_send_error(s, c, 0, KVF_ERR_TIMEOUT, NULL);
      server_conn_drop(s, i, "no HELLO in time");
      continue;
    }
    if (c->register_busy) { /* alive: waiting for its REGISTER (the registry's reaper too) */
      c->last_seen_ns = now;
      (void)kvf_registry_heartbeat(s->registry, c->client_id, now);
    }
    if (c->q_head && now > c->q_stalled_since_ns &&
        now - c->q_stalled_since_ns > (uint64_t)s->opt.write_timeout_ms * 1000000ull) {
      KVF_WARN(SERVER, "client %llu (pid %d): %llu reply bytes unread for %u ms, dropped",
               (unsigned long long)c->client_id, (int)c->conn.peer.pid, (unsigned long long)c->q_bytes,
               (unsigned)s->opt.write_timeout_ms);
      server_conn_drop(s, i, "replies not read");
      continue;
    }
    if (readable && poll_ns > c->last_seen_ns && poll_ns - c->last_seen_ns > timeout_ns) {
      KVF_WARN(SERVER, "client %llu (pid %d): silent for %llu ms, reaped", (unsigned long long)c->client_id,
               (int)c->conn.peer.pid, (unsigned long long)((poll_ns - c->last_seen_ns) / 1000000ull));
      server_conn_drop(s, i, "heartbeat timeout");
      continue;
    }
    i++;
  }
  uint64_t held = s->buffered;
  for (uint32_t i = 0; i < s->num_conns; i++) held += s->conns[i]->q_bytes;
  if (held > s->held_high) s->held_high = held;
  if (s->held_high - held >= KVF_SERVER_TRIM_BYTES && now - s->trimmed_ns > 1000000000ull) {
#ifdef __GLIBC__
    (void)malloc_trim(0);
    KVF_INFO(SERVER, "gave freed memory back (malloc_trim): clients' buffers fell from %llu to %llu bytes",
             (unsigned long long)s->held_high, (unsigned long long)held);
#endif
    s->held_high = held;
    s->trimmed_ns = now;
  }
  uint32_t reaped = 0;
  kvf_status st = kvf_registry_reap(s->registry, poll_ns, timeout_ns, &reaped);
  if (st != KVF_SUCCESS) KVF_WARN(SERVER, "reaper: %s", kvf_last_error());
  if (now - s->last_collect_ns > 1000000000ull) {
    s->last_collect_ns = now;
    (void)kvf_registry_collect(s->registry); /* retries unmaps that failed */
  }
}

kvf_status kvf_server_run(kvf_server *s) {
  if (!s) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_server_run: NULL server");
  if (__atomic_exchange_n(&s->running, 1, __ATOMIC_SEQ_CST) != 0 || !s->ep)
    return kvf_fail(KVF_ERR_STATE, "kvf_server_run: already running or already stopped");
  kvf_status result = KVF_SUCCESS;
  int tick = (int)(s->opt.heartbeat_timeout_ms / 4);
  if (tick < 10) tick = 10;
  if (tick > 250) tick = 250;
  /* With GPU lanes, the loop polls without sleeping for a while after any
   * activity: one request in flight then costs no wake-up on its way in
   * (the next request comes tens of microseconds after a reply) nor on its
   * reply's way out (posted ~0.6 ms after the request for a 256-token
   * chunk). On the H200 a served 256-token request took 0.79 ms at p50
   * against 0.66 ms from admission to proof inside kvferryd
   * (perf/results/2026-12-01-h200-served-warm): the rest is hand-offs.
   * Never on a host-only server: its cores are the copies' own. */
  uint64_t spin_ns = s->opt.num_devices ? (uint64_t)kvf_param_server_loop_spin_us() * 1000ull : 0;
  uint64_t active_ns = 0, reaped_ns = 0;
  while (!__atomic_load_n(&s->stop_flag, __ATOMIC_SEQ_CST)) {
    s->pfds[0] = (struct pollfd){.fd = s->stop_pipe[0], .events = POLLIN};
    s->pfds[1] = (struct pollfd){.fd = kvf_endpoint_fd(s->ep), .events = POLLIN};
    server_pool_grant(s, kvf_now_ns());
    uint32_t n = s->num_conns;
    uint64_t setup_ns = kvf_now_ns();
    for (uint32_t i = 0; i < n; i++) {
      kvf_server_conn *c = s->conns[i];
      int readable = conn_readable(s, c);
      if (readable && c->paused) {
        /* Resumed: the time it was held back is not its silence or slowness. */
        if (c->frame_started_ns) {
          c->frame_started_ns = setup_ns;
          c->dry = 1; /* until a read finds more of the frame waiting */
        }
        if (c->last_seen_ns < setup_ns) c->last_seen_ns = setup_ns;
      }
      c->paused = !readable;
      short events = (short)((readable ? POLLIN : 0) | (c->q_head ? POLLOUT : 0));
      /* A held connection is still polled for its peer hanging up. */
      s->pfds[2 + i] = (struct pollfd){.fd = c->conn.fd, .events = events};
    }
    int wait_ms = tick;
    if (s->pin_deadline_ns != UINT64_MAX) { /* wake for the next pin to expire */
      uint64_t now = kvf_now_ns();
      uint64_t left_ms = s->pin_deadline_ns > now ? (s->pin_deadline_ns - now + 999999) / 1000000 : 0;
      if (left_ms < (uint64_t)wait_ms) wait_ms = (int)left_ms;
    }
    int spinning = spin_ns && kvf_now_ns() - active_ns < spin_ns;
    if (spinning) wait_ms = 0;
    int rc = poll(s->pfds, 2 + n, wait_ms);
    if (rc < 0 && errno != EINTR) {
      result = kvf_fail(KVF_ERR_SYSTEM, "server: poll: %s", strerror(errno));
      break;
    }
    uint64_t poll_ns = kvf_now_ns();
    if (rc > 0) {
      active_ns = poll_ns;
      if (s->pfds[0].revents) {
        char buf[64];
        while (read(s->stop_pipe[0], buf, sizeof(buf)) > 0) {
        }
      }
      /* Connections first, walking backwards so a drop (which moves the last
       * connection into the hole) never skips one polled this turn. */
      for (uint32_t i = n; i-- > 0;) {
        short ev = s->pfds[2 + i].revents;
        if (!ev) continue;
        kvf_server_conn *c = s->conns[i];
        const char *why = "";
        if (ev & POLLIN) conn_seen(s, c, poll_ns);
        if ((ev & POLLOUT) && conn_flush(c) != KVF_SUCCESS) {
          server_conn_drop(s, i, "reply not delivered");
          continue;
        }
        if ((ev & ~POLLOUT) && !conn_readable(s, c)) {
          if (ev & (POLLHUP | POLLERR)) {
            server_conn_drop(s, i, "peer closed");
            continue;
          }
        } else if ((ev & ~POLLOUT) && server_conn_service(s, c, &why) != KVF_SUCCESS) {
          server_conn_drop(s, i, why);
          continue;
        }
        if (c->q_failed != KVF_SUCCESS) server_conn_drop(s, i, "reply not delivered");
      }
      if (s->pfds[1].revents) server_accept(s);
    }
    server_flush_outbox(s);
    server_finish_registers(s);
    server_finish_fetches(s);
    for (uint32_t i = s->num_conns; i-- > 0;)
      if (s->conns[i]->q_failed != KVF_SUCCESS) server_conn_drop(s, i, "reply not delivered");
    /* Spinning, the timers are checked once a millisecond, not every turn. */
    if (!spinning || rc > 0 || poll_ns - reaped_ns > 1000000ull) {
      server_reap(s, poll_ns);
      reaped_ns = poll_ns;
    } else {
      sched_yield();
    }
  }
  /* Stop: drain every client and stop listening. Requests in flight finish
   * (their completion events) before their leases let the unmaps run. */
  KVF_INFO(SERVER, "stopping: %u clients to drain", (unsigned)s->num_conns);
  server_flush_outbox(s);
  while (s->num_conns > 0) server_conn_drop(s, s->num_conns - 1, "server stopping");
  (void)kvf_registry_collect(s->registry);
  kvf_endpoint_close(s->ep);
  s->ep = NULL;
  return result;
}

struct kvf_peers *kvf_server_peers(kvf_server *s) { return s ? s->peers : NULL; }

void kvf_server_destroy(kvf_server *s) {
  if (!s) return;
  for (uint32_t i = 0; i < s->num_conns; i++) {
    conn_pins_free(s, s->conns[i]);
    kvf_conn_close(&s->conns[i]->conn);
    kvf_dataplane_unbind(s->conns[i]->binding);
    conn_queue_free(s->conns[i]);
    id_set_free(&s->conns[i]->in_flight);
    free(s->conns[i]);
  }
  kvf_endpoint_close(s->ep);
  /* The registration worker first (it uses the registry and the data
   * plane); REGISTERs it finished that the loop never took are undone. */
  kvf_register_worker_destroy(s->reg_worker);
  for (kvf_register_req *req = s->reg_done_head; req;) {
    kvf_register_req *next = req->next;
    (void)kvf_registry_client_close(s->registry, req->client_id);
    kvf_register_req_free(req);
    req = next;
  }
  s->reg_done_head = s->reg_done_tail = NULL;
  /* The peers before the data plane: their fetches abort their L1
   * reservations and call back (into the done list, freed here). */
  kvf_peers_destroy(s->peers);
  s->peers = NULL;
  for (kvf_server_fetch *f = s->fetch_done_head; f;) {
    kvf_server_fetch *next = f->done_next;
    server_fetch_free(f);
    f = next;
  }
  s->fetch_done_head = s->fetch_done_tail = NULL;
  s->fetching = NULL; /* every one of them was in the done list */
  /* The data plane retires every request (releasing its lease) before the
   * registry unmaps what is left. */
  kvf_dataplane_destroy(s->dp);
  /* After the peers (their transport) and the data plane (the pools). */
  kvf_pt_context_destroy(s->pt_ctx);
  kvf_topology_destroy(s->topology);
  if (s->out_mu_init) {
    kvf_server_out *o = s->out_head;
    while (o) {
      kvf_server_out *next = o->next;
      free(o->frame);
      free(o);
      o = next;
    }
    pthread_mutex_destroy(&s->out_mu);
  }
  kvf_registry_destroy(s->registry);
  kvf_import_table_destroy(s->table);
  if (s->stop_pipe[0] >= 0) close(s->stop_pipe[0]);
  if (s->stop_pipe[1] >= 0) close(s->stop_pipe[1]);
  free(s->conns);
  free(s->pfds);
  free(s);
}
