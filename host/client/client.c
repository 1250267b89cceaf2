/*
 * The engine-side client of kvferryd (kvferry/client.h).
 *
 * Threading: any number of threads call in at once. Requests are matched to
 * replies by request id through a table of requests in flight (c->pending):
 *
 *  - sending: a request is entered in the table first, then its whole frame
 *    is written under c->send_lock, so frames never interleave;
 *  - receiving: a thread that waits for a reply not yet filed takes the
 *    reader role if nobody holds it, reads one frame without the state lock
 *    (a poll of at most KVF_CLIENT_READ_SLICE_MS), files it under its request
 *    id, gives the role back and wakes every waiter; a thread that finds the
 *    role taken sleeps on c->cond until something is filed or its deadline;
 *  - a frame that can not be read (EOF, a reset, a broken stream) kills the
 *    connection: c->dead is set and every waiter without a reply returns it
 *    (KVF_ERR_DISCONNECTED for a closed connection).
 *
 * A reply to a request nobody waits for any more (a synchronous call that
 * timed out) is dropped when it arrives, so a late reply never answers a
 * later request.
 *
 * The heartbeat thread (options.heartbeat_thread) is a caller like any other:
 * it sends HEARTBEAT through the same path every period and keeps the boot
 * token it saw. Once the connection is dead it stops sending and instead
 * probes the socket directory once per period with a fresh connection (HELLO,
 * then close), so that kvf_client_server_restarted() turns 1 when a server
 * with another boot token answers there. kvf_client_disconnect() wakes it at
 * once (condition variable, and shutdown() of the socket for a thread that is
 * inside a call).
 */
#define _GNU_SOURCE
#include <kvferry/client.h>

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <openssl/evp.h>

#include "common/clock.h"
#include "common/error.h"
#include "common/utf8.h"
#include "common/versioned.h"
#include "host/client/client_internal.h"
#include "host/ipc/endpoint.h"
#include "host/core/log.h"
#include "host/core/param.h"
#include "host/ipc/protocol.h"

#define KVF_CLIENT_READ_SLICE_MS 100 /* longest poll of one reader turn */
#define KVF_CLIENT_PROBE_SLICE_MS 50 /* a restart probe checks for disconnect this often */
#define KVF_CLIENT_MAX_SPIN_US 1000000 /* KVF_CLIENT_SPIN_US beyond a second is taken as a second */
#define KVF_CLIENT_DETAIL_MAX (KVF_PROTO_FIELD_MAX + KVF_PROTO_MESSAGE_MAX + 8)

_Static_assert(KVF_PROTO_MAX_GROUPS == KVF_MAX_GROUPS, "a reply's groups fit kvf_client_result");
_Static_assert(KVF_PROTO_MAX_PIN_MS == KVF_CLIENT_MAX_PIN_MS, "one pin limit");
_Static_assert(sizeof(kvf_proto_chunk_key) == sizeof(*((kvf_client_lookup_desc *)0)->chunk_keys),
               "LOOKUP's keys are the wire's keys");

/* One request in flight. */
typedef struct kvf_client_pending {
  uint64_t id;
  uint16_t want;   /* the reply type that answers it */
  int async;       /* submitted with kvf_client_submit: kvf_client_wait may collect it */
  int done;        /* a reply or a failure has been filed */
  kvf_status status;                   /* the filed failure; KVF_SUCCESS with a reply */
  char detail[KVF_CLIENT_DETAIL_MAX];  /* the failure's message */
  kvf_proto_msg reply;                 /* owned once done with KVF_SUCCESS */
  struct kvf_client_pending *next;
} kvf_client_pending;

/* A STORE or RETRIEVE whose work may still touch the engine's blocks: in
 * flight (no reply yet), or answered before the server proved its work
 * complete (timed out, cancelled) and waiting for its RETIRED notice. A
 * request answered done or failed (or refused with an ERROR) was retired
 * before its reply was sent, and has no entry. */
typedef struct kvf_client_unretired {
  uint64_t id;
  int answered; /* its reply came (timed out or cancelled): RETIRED follows */
  struct kvf_client_unretired *next;
} kvf_client_unretired;

struct kvf_client {
  kvf_conn conn; /* reads: the reader role's holder only; writes: under send_lock */
  uint32_t timeout_ms;
  uint32_t max_payload; /* the server's, from HELLO */
  kvf_client_info info; /* fixed after connect */
  char *socket_dir;     /* for restart probes */
  char name[KVF_PROTO_NAME_MAX];

  pthread_mutex_t send_lock; /* guards writes on conn: one whole frame at a time */

  pthread_mutex_t lock; /* guards everything below */
  pthread_cond_t cond;  /* something was filed, the reader role freed, or the connection died */
  uint64_t next_request;
  kvf_client_pending *pending; /* requests in flight */
  kvf_client_unretired *unretired; /* STORE/RETRIEVE not proven retired */
  uint64_t max_issued;             /* the highest request id sent */
  int reading;                 /* a thread holds the reader role */
  uint64_t spin_us;            /* waits read without sleeping this long first (client_spin_turns): 0 unless the
                                  live registration names a GPU, then KVF_CLIENT_SPIN_US (or a test's) */
  /* The live registration as the replies say, in the server's order
   * whatever order threads apply them in (registration ids only grow): the
   * newest REGISTER reply's, unless an UNREGISTER reply named it or a newer
   * one (spin_follow). */
  uint64_t newest_registration; /* the highest id a REGISTER reply gave */
  int newest_on_gpu;            /* that registration names a GPU */
  uint64_t newest_unregistered; /* the highest id an UNREGISTER reply named */
  kvf_status dead;             /* the connection is unusable: why; KVF_SUCCESS while healthy */
  char dead_detail[KVF_CLIENT_DETAIL_MAX];

  /* The heartbeat thread. stopping is also read without the lock. */
  int hb_running;
  pthread_t hb_thread;
  pthread_cond_t hb_cond; /* stopping was set (with lock) */
  _Atomic int stopping;
  uint32_t hb_period_ms;
  _Atomic uint64_t hb_sequence;
  _Atomic uint64_t seen_boot_token; /* the last boot token the heartbeat thread saw; 0: none yet */
};

/* ---- time ------------------------------------------------------------------ */

/* Wait on cond (lock held) until woken or the monotonic deadline (ms). */
static void cond_wait_until(pthread_cond_t *cond, pthread_mutex_t *lock, int64_t deadline_ms) {
  struct timespec ts = kvf_timespec_ms(deadline_ms);
  (void)pthread_cond_timedwait(cond, lock, &ts);
}

/* ---- the table of requests in flight (c->lock held) ------------------------- */

static kvf_client_pending *pending_find(kvf_client *c, uint64_t id) {
  for (kvf_client_pending *p = c->pending; p; p = p->next)
    if (p->id == id) return p;
  return NULL;
}

static void pending_unlink(kvf_client *c, kvf_client_pending *p) {
  for (kvf_client_pending **at = &c->pending; *at; at = &(*at)->next)
    if (*at == p) {
      *at = p->next;
      p->next = NULL;
      return;
    }
}

static void pending_free(kvf_client_pending *p) {
  if (!p) return;
  kvf_proto_msg_clear(&p->reply);
  free(p);
}

/* Drop request `id` (a caller gave up waiting): a late reply finds no entry
 * and is discarded. */
static void pending_forget(kvf_client *c, uint64_t id) {
  kvf_client_pending *gone = pending_find(c, id);
  if (gone) {
    pending_unlink(c, gone);
    pending_free(gone);
  }
}

static void pending_fail(kvf_client_pending *p, kvf_status st, const char *detail) {
  p->done = 1;
  p->status = st;
  snprintf(p->detail, sizeof(p->detail), "%s", detail);
}

/* ---- retirement (c->lock held) ---------------------------------------------- */

static kvf_client_unretired **unretired_at(kvf_client *c, uint64_t id) {
  kvf_client_unretired **at = &c->unretired;
  while (*at && (*at)->id != id) at = &(*at)->next;
  return at;
}

static void unretired_drop(kvf_client *c, uint64_t id) {
  kvf_client_unretired **at = unretired_at(c, id);
  if (!*at) return;
  kvf_client_unretired *gone = *at;
  *at = gone->next;
  free(gone);
  pthread_cond_broadcast(&c->cond); /* wake kvf_client_wait_retired */
}

/* A frame for request id arrived (before it is matched to a waiter, who may
 * have given up): what it says about the request's retirement. */
static void unretired_note(kvf_client *c, const kvf_proto_header *h, kvf_status dst, const kvf_proto_msg *m) {
  kvf_client_unretired *u = *unretired_at(c, h->request_id);
  if (!u || dst != KVF_SUCCESS) return; /* undecodable: nothing is known, the entry stays */
  if (m->type == KVF_PROTO_RETIRED) {
    unretired_drop(c, h->request_id);
  } else if (m->type == KVF_PROTO_ERROR) {
    unretired_drop(c, h->request_id); /* refused before admission: nothing ran */
  } else if (m->type == KVF_PROTO_STORE_REPLY || m->type == KVF_PROTO_RETRIEVE_REPLY) {
    uint32_t oc = m->u.xfer_reply.outcome;
    if (oc == KVF_CLIENT_TIMED_OUT || oc == KVF_CLIENT_CANCELLED)
      u->answered = 1; /* its RETIRED notice follows */
    else
      unretired_drop(c, h->request_id); /* done or failed: retired before the reply */
  }
}

/* The connection is unusable from now on (c->lock held). */
static void client_kill(kvf_client *c, kvf_status st, const char *detail) {
  if (c->dead) return;
  c->dead = st;
  snprintf(c->dead_detail, sizeof(c->dead_detail), "%s", detail);
  KVF_INFO(IPC, "client %llu: connection lost: %s", (unsigned long long)c->info.client_id, detail);
  pthread_cond_broadcast(&c->cond);
}

/* ---- receiving ----------------------------------------------------------------- */

/* File one frame that arrived (c->lock held): decoded into `m` (owned, taken)
 * or a decode failure `dst`. */
static void client_file(kvf_client *c, const kvf_proto_header *h, kvf_status dst, kvf_proto_msg *m) {
  char detail[KVF_CLIENT_DETAIL_MAX];
  if (dst == KVF_SUCCESS && m->type == KVF_PROTO_ERROR && h->request_id == 0) {
    /* The server could not read one of our headers: it hangs up next. */
    snprintf(detail, sizeof(detail), "%s%s%s", m->u.error.field, m->u.error.field[0] ? ": " : "",
             m->u.error.message);
    client_kill(c, m->u.error.status ? (kvf_status)m->u.error.status : KVF_ERR_PROTOCOL, detail);
    kvf_proto_msg_clear(m);
    return;
  }
  unretired_note(c, h, dst, m);
  if (dst == KVF_SUCCESS && m->type == KVF_PROTO_RETIRED) {
    /* A notice, not a reply: nobody waits for it as one. */
    kvf_proto_msg_clear(m);
    return;
  }
  kvf_client_pending *p = pending_find(c, h->request_id);
  if (!p || p->done) {
    KVF_INFO(IPC, "client %llu: dropped a %s for request %llu nobody waits for", (unsigned long long)c->info.client_id,
             kvf_proto_type_name(h->type), (unsigned long long)h->request_id);
    if (dst == KVF_SUCCESS) kvf_proto_msg_clear(m);
    return;
  }
  if (dst != KVF_SUCCESS) {
    pending_fail(p, dst, kvf_last_error());
    return;
  }
  if (m->type == KVF_PROTO_ERROR) {
    kvf_status es = m->u.error.status ? (kvf_status)m->u.error.status : KVF_ERR_INTERNAL;
    snprintf(detail, sizeof(detail), "%s%s%s", m->u.error.field, m->u.error.field[0] ? ": " : "",
             m->u.error.message);
    pending_fail(p, es, detail);
    kvf_proto_msg_clear(m);
    return;
  }
  if (m->type != p->want) {
    snprintf(detail, sizeof(detail), "header.type: expected %s, the server sent %s", kvf_proto_type_name(p->want),
             kvf_proto_type_name(m->type));
    pending_fail(p, KVF_ERR_PROTOCOL, detail);
    kvf_proto_msg_clear(m);
    return;
  }
  p->done = 1;
  p->status = KVF_SUCCESS;
  p->reply = *m;
  memset(m, 0, sizeof(*m));
}

/* One reader turn: called with c->lock held and the reader role taken;
 * returns the same way. Reads at most one frame. Returns 0 when nothing
 * came within slice_ms, 1 when a frame was filed or the connection died. */
static int client_read_turn(kvf_client *c, int slice_ms) {
  pthread_mutex_unlock(&c->lock);
  kvf_proto_header h;
  uint8_t *payload = NULL;
  int fds[KVF_PROTO_MAX_FDS];
  uint32_t nfds = 0;
  kvf_proto_msg m;
  memset(&m, 0, sizeof(m));
  kvf_status st = kvf_conn_read_frame(&c->conn, slice_ms, &h, &payload, fds, KVF_PROTO_MAX_FDS, &nfds);
  for (uint32_t i = 0; i < nfds; i++) close(fds[i]); /* a server never sends any */
  kvf_status dst = KVF_SUCCESS;
  if (st == KVF_SUCCESS) dst = kvf_proto_decode(&h, payload, &m);
  free(payload);
  char detail[KVF_CLIENT_DETAIL_MAX];
  if (st != KVF_SUCCESS && st != KVF_ERR_TIMEOUT) snprintf(detail, sizeof(detail), "%s", kvf_last_error());
  pthread_mutex_lock(&c->lock);
  if (st == KVF_SUCCESS)
    client_file(c, &h, dst, &m);
  else if (st != KVF_ERR_TIMEOUT)
    client_kill(c, st, detail);
  return st != KVF_ERR_TIMEOUT;
}

/* Reader turns that do not sleep, until a frame is filed, the connection
 * dies or until_ns: a reply that arrives while the waiter sleeps in poll()
 * costs it a wake-up, and on an H200 host that was most of the ~65 us a
 * served 256-token request took over the in-process call with kvferryd's
 * own threads spinning (perf/results/2026-12-03-h200-served-spin). Same
 * locking as client_read_turn; the role is held throughout. */
static void client_spin_turns(kvf_client *c, uint64_t until_ns) {
  for (;;) {
    if (client_read_turn(c, 0) || kvf_now_ns() >= until_ns) return;
    pthread_mutex_unlock(&c->lock);
    sched_yield();
    pthread_mutex_lock(&c->lock);
  }
}

/* A spin length in us: negative is none, more than a second a second. */
static uint64_t spin_bound(int64_t us) {
  return us <= 0 ? 0 : us > KVF_CLIENT_MAX_SPIN_US ? KVF_CLIENT_MAX_SPIN_US : (uint64_t)us;
}

/* The waits spin for a live GPU registration only (client_wait_locked says
 * why); c->lock held. */
static void spin_follow(kvf_client *c) {
  int live = c->newest_registration > c->newest_unregistered;
  c->spin_us = live && c->newest_on_gpu ? spin_bound(kvf_param_client_spin_us()) : 0;
}

/* Wait for request `id` until deadline_ms (c->lock held). Returns
 * KVF_SUCCESS with *out the filed entry, unlinked (the caller frees it);
 * KVF_ERR_TIMEOUT (the entry stays); KVF_ERR_NOT_FOUND (no such request);
 * or the dead connection's status (the entry is gone). */
static kvf_status client_wait_locked(kvf_client *c, uint64_t id, int async, int64_t deadline_ms,
                                     kvf_client_pending **out) {
  *out = NULL;
  /* Reading without sleeping first (client_spin_turns), for the clients of
   * GPU caches only: a host-only kvferryd's copies run on the cores a
   * spinning waiter would take from them. */
  uint64_t spin_until = c->spin_us ? kvf_now_ns() + c->spin_us * 1000ull : 0;
  for (;;) {
    kvf_client_pending *p = pending_find(c, id);
    if (!p || p->async != async)
      return kvf_fail(KVF_ERR_NOT_FOUND, "request_id: %llu is not a request in flight", (unsigned long long)id);
    if (p->done) {
      pending_unlink(c, p);
      *out = p;
      return KVF_SUCCESS;
    }
    if (c->dead) {
      pending_unlink(c, p);
      pending_free(p);
      return kvf_fail(c->dead, "%s", c->dead_detail);
    }
    int64_t left = deadline_ms - kvf_now_ms();
    if (left <= 0)
      return kvf_fail(KVF_ERR_TIMEOUT, "request %llu: no reply from the server in time", (unsigned long long)id);
    if (!c->reading) {
      c->reading = 1;
      uint64_t now_ns = kvf_now_ns(), deadline_ns = (uint64_t)deadline_ms * 1000000ull;
      if (now_ns < spin_until && now_ns < deadline_ns)
        client_spin_turns(c, spin_until < deadline_ns ? spin_until : deadline_ns);
      else
        client_read_turn(c, left < KVF_CLIENT_READ_SLICE_MS ? (int)left : KVF_CLIENT_READ_SLICE_MS);
      c->reading = 0;
      pthread_cond_broadcast(&c->cond); /* a reply was filed, or the role is free for another */
    } else {
      cond_wait_until(&c->cond, &c->lock, deadline_ms);
    }
  }
}

/* ---- sending ----------------------------------------------------------------- */

/* Enter `req` in the table (reply type `want`) and send it with its
 * descriptors. On success *id is its request id and the entry waits for its
 * reply; on failure nothing is left in the table. */
static kvf_status client_send(kvf_client *c, kvf_proto_msg *req, const int *fds, uint32_t num_fds, uint16_t want,
                              int async, uint64_t *id) {
  kvf_client_pending *p = calloc(1, sizeof(*p));
  if (!p) return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "client: out of memory for a request");
  /* A STORE or RETRIEVE is unretired from before it goes out until its
   * reply (or RETIRED notice) says otherwise. */
  int track = req->type == KVF_PROTO_STORE || req->type == KVF_PROTO_RETRIEVE;
  kvf_client_unretired *u = track ? calloc(1, sizeof(*u)) : NULL;
  if (track && !u) {
    free(p);
    return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "client: out of memory for a request");
  }
  p->want = want;
  p->async = async;
  pthread_mutex_lock(&c->lock);
  if (c->dead) {
    kvf_status dead = kvf_fail(c->dead, "%s", c->dead_detail);
    pthread_mutex_unlock(&c->lock);
    free(p);
    free(u);
    return dead;
  }
  p->id = c->next_request++;
  if (p->id > c->max_issued) c->max_issued = p->id;
  p->next = c->pending;
  c->pending = p; /* before the frame goes out: another thread may read the reply first */
  if (u) {
    kvf_client_unretired **at = unretired_at(c, p->id);
    if (*at) { /* the same id again (kvf_client_test_next_request_id): one entry */
      free(u);
      (*at)->answered = 0;
    } else {
      u->id = p->id;
      *at = u;
    }
  }
  pthread_mutex_unlock(&c->lock);

  req->request_id = p->id;
  uint8_t *frame = NULL;
  size_t len = 0;
  kvf_status st = kvf_proto_encode(req, &frame, &len);
  int cut = 0;
  if (st == KVF_SUCCESS) {
    pthread_mutex_lock(&c->send_lock);
    st = kvf_conn_write_frame(&c->conn, frame, len, fds, num_fds, (int)c->timeout_ms);
    cut = st != KVF_SUCCESS && c->conn.write_failed != KVF_SUCCESS;
    pthread_mutex_unlock(&c->send_lock);
    free(frame);
  }
  if (st == KVF_SUCCESS) {
    *id = p->id;
    return KVF_SUCCESS;
  }
  char detail[KVF_CLIENT_DETAIL_MAX];
  snprintf(detail, sizeof(detail), "%s", kvf_last_error());
  pthread_mutex_lock(&c->lock);
  pending_unlink(c, p);
  /* Not sent whole: the server never admitted it. */
  if (track) unretired_drop(c, p->id);
  if (cut) client_kill(c, st, detail); /* part of a frame went out: the stream is out of step */
  pthread_mutex_unlock(&c->lock);
  pending_free(p);
  return kvf_fail(st, "%s", detail);
}

/* Hand the filed entry's outcome to the caller: its reply in *reply, or its
 * failure as status and last error. Frees p. */
static kvf_status pending_take(kvf_client_pending *p, kvf_proto_msg *reply) {
  kvf_status st = p->status;
  if (st == KVF_SUCCESS) {
    *reply = p->reply;
    memset(&p->reply, 0, sizeof(p->reply));
  } else {
    kvf_fail(st, "%s", p->detail);
  }
  pending_free(p);
  return st;
}

/* Send `req` and wait for its reply of type `want` for up to the client's
 * timeout. An ERROR reply becomes its status with "field: message" as the
 * last error. On success *reply owns what it decoded (kvf_proto_msg_clear).
 * A call that times out forgets its request: a late reply is dropped. */
static kvf_status client_call(kvf_client *c, kvf_proto_msg *req, const int *fds, uint32_t num_fds, uint16_t want,
                              kvf_proto_msg *reply) {
  memset(reply, 0, sizeof(*reply));
  int64_t deadline = kvf_now_ms() + c->timeout_ms;
  uint64_t id = 0;
  kvf_status st = client_send(c, req, fds, num_fds, want, 0, &id);
  if (st != KVF_SUCCESS) return st;
  kvf_client_pending *p = NULL;
  pthread_mutex_lock(&c->lock);
  st = client_wait_locked(c, id, 0, deadline, &p);
  if (st == KVF_ERR_TIMEOUT) pending_forget(c, id);
  pthread_mutex_unlock(&c->lock);
  if (st != KVF_SUCCESS) return st;
  return pending_take(p, reply);
}

/* ---- connect and the restart probe -------------------------------------------- */

/* Say HELLO on a fresh connection (no other thread uses it) and read the
 * reply within timeout_ms, giving up early when *stop turns nonzero. */
static kvf_status client_hello(kvf_conn *conn, const char *name, uint32_t timeout_ms, const _Atomic int *stop,
                               kvf_proto_hello_reply *out) {
  kvf_proto_msg req, rep;
  memset(&req, 0, sizeof(req));
  memset(&rep, 0, sizeof(rep));
  req.type = KVF_PROTO_HELLO;
  req.request_id = 1;
  req.u.hello.min_version = KVF_PROTO_VERSION;
  req.u.hello.max_version = KVF_PROTO_VERSION;
  req.u.hello.pid = (uint32_t)getpid();
  kvf_status st = kvf_mem_instance(&req.u.hello.instance_id, &req.u.hello.generation);
  if (st != KVF_SUCCESS) return st;
  snprintf(req.u.hello.name, sizeof(req.u.hello.name), "%s", name);
  st = kvf_conn_send(conn, &req, NULL, 0, (int)timeout_ms);
  if (st != KVF_SUCCESS) return st;
  int64_t deadline = kvf_now_ms() + timeout_ms;
  kvf_proto_header h;
  uint8_t *payload = NULL;
  int fds[KVF_PROTO_MAX_FDS];
  uint32_t nfds = 0;
  for (;;) {
    int64_t left = deadline - kvf_now_ms();
    if (left <= 0) return kvf_fail(KVF_ERR_TIMEOUT, "HELLO: no reply from the server within %u ms", timeout_ms);
    if (stop && atomic_load(stop)) return kvf_fail(KVF_ERR_DISCONNECTED, "HELLO: the client is disconnecting");
    int slice = stop && left > KVF_CLIENT_PROBE_SLICE_MS ? KVF_CLIENT_PROBE_SLICE_MS : (int)left;
    st = kvf_conn_read_frame(conn, slice, &h, &payload, fds, KVF_PROTO_MAX_FDS, &nfds);
    if (st == KVF_ERR_TIMEOUT) continue;
    if (st != KVF_SUCCESS) return st;
    break;
  }
  for (uint32_t i = 0; i < nfds; i++) close(fds[i]);
  st = kvf_proto_decode(&h, payload, &rep);
  free(payload);
  if (st != KVF_SUCCESS) return st;
  if (rep.type == KVF_PROTO_ERROR) {
    kvf_status es = rep.u.error.status ? (kvf_status)rep.u.error.status : KVF_ERR_INTERNAL;
    if (rep.u.error.field[0])
      kvf_fail(es, "%s: %s", rep.u.error.field, rep.u.error.message);
    else
      kvf_fail(es, "%s", rep.u.error.message);
    kvf_proto_msg_clear(&rep);
    return es;
  }
  if (rep.type != KVF_PROTO_HELLO_REPLY) {
    uint16_t got = rep.type;
    kvf_proto_msg_clear(&rep);
    return kvf_fail(KVF_ERR_PROTOCOL, "header.type: expected HELLO_REPLY, the server sent %s",
                    kvf_proto_type_name(got));
  }
  *out = rep.u.hello_reply;
  kvf_proto_msg_clear(&rep);
  return KVF_SUCCESS;
}

/* Once the connection is dead: is a server with another boot token serving
 * the directory now? Records the token it sees. */
static void client_probe_restart(kvf_client *c) {
  kvf_conn conn;
  if (kvf_endpoint_connect(c->socket_dir, 0, &conn) != KVF_SUCCESS) return;
  kvf_proto_hello_reply hr;
  uint32_t timeout = c->timeout_ms < c->hb_period_ms ? c->timeout_ms : c->hb_period_ms;
  if (client_hello(&conn, c->name, timeout, &c->stopping, &hr) == KVF_SUCCESS) {
    atomic_store(&c->seen_boot_token, hr.boot_token);
    if (hr.boot_token != c->info.boot_token)
      KVF_INFO(IPC, "client %llu: the server restarted (boot token %016llx, was %016llx)",
               (unsigned long long)c->info.client_id, (unsigned long long)hr.boot_token,
               (unsigned long long)c->info.boot_token);
  }
  kvf_conn_close(&conn);
}

static kvf_status client_heartbeat_once(kvf_client *c, uint64_t *boot_token);

static int client_restarted(const kvf_client *c) {
  uint64_t seen = atomic_load(&((kvf_client *)c)->seen_boot_token);
  return seen != 0 && seen != c->info.boot_token;
}

static void *client_heartbeat_main(void *arg) {
  kvf_client *c = arg;
  int64_t next = kvf_now_ms() + c->hb_period_ms;
  pthread_mutex_lock(&c->lock);
  while (!atomic_load(&c->stopping)) {
    if (kvf_now_ms() < next) {
      cond_wait_until(&c->hb_cond, &c->lock, next);
      continue;
    }
    next += c->hb_period_ms;
    int64_t now = kvf_now_ms();
    if (next <= now) next = now + c->hb_period_ms; /* a slow call: do not burst to catch up */
    int dead = c->dead != KVF_SUCCESS;
    pthread_mutex_unlock(&c->lock);
    if (!dead) {
      uint64_t token = 0;
      if (client_heartbeat_once(c, &token) == KVF_SUCCESS) atomic_store(&c->seen_boot_token, token);
    } else if (!client_restarted(c)) {
      client_probe_restart(c);
    }
    pthread_mutex_lock(&c->lock);
  }
  pthread_mutex_unlock(&c->lock);
  return NULL;
}

static void client_free(kvf_client *c) {
  kvf_conn_close(&c->conn);
  while (c->unretired) {
    kvf_client_unretired *u = c->unretired;
    c->unretired = u->next;
    free(u);
  }
  while (c->pending) {
    kvf_client_pending *p = c->pending;
    c->pending = p->next;
    pending_free(p);
  }
  pthread_cond_destroy(&c->hb_cond);
  pthread_cond_destroy(&c->cond);
  pthread_mutex_destroy(&c->lock);
  pthread_mutex_destroy(&c->send_lock);
  free(c->socket_dir);
  free(c);
}

kvf_status kvf_client_connect(const kvf_client_options *caller, kvf_client **out, kvf_client_info *info) {
  if (!caller || !out) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_client_connect: NULL argument");
  kvf_client_options local = KVF_CLIENT_OPTIONS_INIT;
  const kvf_client_options *options = &local;
  kvf_status vs = KVF_VERSIONED_IN(kvf_client_options, &local, caller);
  if (vs == KVF_SUCCESS && info) vs = KVF_VERSIONED_CHECK(kvf_client_info, info);
  if (vs != KVF_SUCCESS) return vs;
  if (!options->socket_dir) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "options.socket_dir: required");
  if (options->name && strlen(options->name) >= KVF_PROTO_NAME_MAX)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "options.name: longer than %u bytes", KVF_PROTO_NAME_MAX - 1);
  size_t name_bad = 0;
  const char *name_why = "";
  if (options->name && !kvf_utf8_valid(options->name, strlen(options->name), &name_bad, &name_why))
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "options.name: not UTF-8: %s at byte %zu (0x%02x)", name_why, name_bad,
                    (unsigned)(uint8_t)options->name[name_bad]);
  if (options->heartbeat_thread != 0 && options->heartbeat_thread != 1)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "options.heartbeat_thread: %d is neither 0 nor 1",
                    options->heartbeat_thread);

  kvf_status st = KVF_SUCCESS;
  kvf_client *c = calloc(1, sizeof(*c));
  if (!c) return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "kvf_client_connect: out of memory");
  kvf_conn_init(&c->conn, -1, 0);
  c->timeout_ms = options->timeout_ms ? options->timeout_ms : 10000;
  c->next_request = 2; /* 1 is the HELLO */
  snprintf(c->name, sizeof(c->name), "%s", options->name ? options->name : "");
  c->socket_dir = strdup(options->socket_dir);

  pthread_condattr_t ca;
  int err = pthread_condattr_init(&ca);
  if (!err) err = pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  if (!err) err = pthread_mutex_init(&c->send_lock, NULL);
  if (!err) err = pthread_mutex_init(&c->lock, NULL);
  if (!err) err = pthread_cond_init(&c->cond, &ca);
  if (!err) err = pthread_cond_init(&c->hb_cond, &ca);
  pthread_condattr_destroy(&ca);
  if (err || !c->socket_dir) {
    /* calloc's zeroes are not valid pthread objects everywhere: free by hand. */
    free(c->socket_dir);
    free(c);
    return kvf_fail(err == ENOMEM || !err ? KVF_ERR_OUT_OF_MEMORY : KVF_ERR_SYSTEM,
                    "kvf_client_connect: could not set up the client's locks (%s)", strerror(err ? err : ENOMEM));
  }

  st = kvf_endpoint_connect(options->socket_dir, 0, &c->conn);
  if (st != KVF_SUCCESS) goto fail;
  kvf_proto_hello_reply hr;
  st = client_hello(&c->conn, c->name, c->timeout_ms, NULL, &hr);
  if (st != KVF_SUCCESS) goto fail;
  c->info = (kvf_client_info)KVF_CLIENT_INFO_INIT;
  c->info.client_id = hr.client_id;
  c->info.boot_token = hr.boot_token;
  c->info.server_pid = hr.server_pid;
  c->info.heartbeat_period_ms = hr.heartbeat_period_ms;
  c->info.heartbeat_timeout_ms = hr.heartbeat_timeout_ms;
  c->info.protocol_version = hr.version;
  c->max_payload = hr.max_payload < KVF_PROTO_MAX_PAYLOAD ? hr.max_payload : KVF_PROTO_MAX_PAYLOAD;

  if (options->heartbeat_thread) {
    c->hb_period_ms = options->heartbeat_period_ms ? options->heartbeat_period_ms : hr.heartbeat_period_ms;
    if (c->hb_period_ms >= hr.heartbeat_timeout_ms) {
      st = kvf_fail(KVF_ERR_INVALID_ARGUMENT,
                    "options.heartbeat_period_ms: %u is not shorter than the server's heartbeat timeout %u ms",
                    c->hb_period_ms, hr.heartbeat_timeout_ms);
      goto fail;
    }
    c->hb_running = 1; /* before the thread exists: it is read without the lock */
    err = pthread_create(&c->hb_thread, NULL, client_heartbeat_main, c);
    if (err) {
      c->hb_running = 0;
      st = kvf_fail(KVF_ERR_SYSTEM, "kvf_client_connect: pthread_create(heartbeat): %s", strerror(err));
      goto fail;
    }
  }
  if (info) (void)KVF_VERSIONED_OUT(kvf_client_info, info, &c->info); /* checked above */
  *out = c;
  return KVF_SUCCESS;
fail:
  client_free(c);
  return st;
}

/* ---- registration, heartbeats, counters ------------------------------------------ */

kvf_status kvf_client_register(kvf_client *client, const char *geometry_json, size_t len, int device,
                               const kvf_client_region *regions, uint32_t num_regions,
                               kvf_client_registration *out) {
  struct kvf_client_register_desc d = KVF_CLIENT_REGISTER_DESC_INIT;
  d.geometry_json = geometry_json;
  d.geometry_len = len;
  d.device = device;
  d.regions = regions;
  d.num_regions = num_regions;
  return kvf_client_register_desc(client, &d, out);
}

kvf_status kvf_client_register_desc(kvf_client *client, const struct kvf_client_register_desc *caller,
                                    kvf_client_registration *out) {
  struct kvf_client_register_desc d = KVF_CLIENT_REGISTER_DESC_INIT;
  if (!client || !caller) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_client_register_desc: NULL argument");
  /* Not KVF_VERSIONED_IN: its name would read "struct ..." */
  kvf_status st = kvf_versioned_in(&d, sizeof d, caller, "kvf_client_register_desc");
  if (st != KVF_SUCCESS) return st;
  const char *geometry_json = d.geometry_json;
  size_t len = d.geometry_len;
  const kvf_client_region *regions = d.regions;
  uint32_t num_regions = d.num_regions;
  uint32_t shard_count = d.shard_count ? d.shard_count : 1;
  if (!geometry_json || (!regions && num_regions))
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_client_register: NULL argument");
  if (shard_count > KVF_CLIENT_MAX_SHARDS)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "desc.shard_count: %u exceeds the %u limit", shard_count,
                    KVF_CLIENT_MAX_SHARDS);
  if (d.shard_index >= shard_count)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "desc.shard_index: %u is not below shard_count %u", d.shard_index,
                    shard_count);
  if (len > KVF_PROTO_MAX_GEOMETRY_JSON)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "geometry_json: %zu bytes, the limit is %u", len,
                    KVF_PROTO_MAX_GEOMETRY_JSON);
  if (num_regions > KVF_PROTO_MAX_REGIONS)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "num_regions: %u over the limit %u", num_regions,
                    KVF_PROTO_MAX_REGIONS);
  st = out ? KVF_VERSIONED_CHECK(kvf_client_registration, out) : KVF_SUCCESS;
  if (st != KVF_SUCCESS) return st;
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
  req.u.reg.device = d.device;
  req.u.reg.shard_index = d.shard_index;
  req.u.reg.shard_count = shard_count;
  req.u.reg.num_fds = num_fds;
  req.u.reg.geometry_json = json;
  req.u.reg.geometry_json_len = (uint32_t)len;
  req.u.reg.regions = pr;
  req.u.reg.num_regions = num_regions;
  st = client_call(client, &req, fds, num_fds, KVF_PROTO_REGISTER_REPLY, &rep);
  if (st != KVF_SUCCESS) goto out;
  /* The new registration replaces the live one; a reply older than one
   * already applied changes nothing. */
  pthread_mutex_lock(&client->lock);
  uint64_t id = rep.u.register_reply.registration_id;
  if (id > client->newest_registration) {
    client->newest_registration = id;
    client->newest_on_gpu = d.device >= 0;
    spin_follow(client);
  }
  pthread_mutex_unlock(&client->lock);
  if (out) {
    kvf_client_registration got = KVF_CLIENT_REGISTRATION_INIT;
    got.registration_id = rep.u.register_reply.registration_id;
    got.fingerprint = rep.u.register_reply.fingerprint;
    got.imports = rep.u.register_reply.imports;
    got.aliases = rep.u.register_reply.aliases;
    (void)KVF_VERSIONED_OUT(kvf_client_registration, out, &got); /* checked above */
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
  /* The reply names the registration it ended (the live one for id 0, 0
   * when none was); an older one leaves the live one's spin. An id the
   * caller named counts only up to the newest this client was given: the
   * server echoes any id (one of another kvferryd's, a junk value), and a
   * higher one would mark registrations still to come as gone. */
  uint64_t gone = rep.u.unregister_reply.registration_id;
  pthread_mutex_lock(&client->lock);
  if (gone > client->newest_unregistered && (registration_id == 0 || gone <= client->newest_registration)) {
    client->newest_unregistered = gone;
    spin_follow(client);
  }
  pthread_mutex_unlock(&client->lock);
  if (state) *state = rep.u.unregister_reply.state;
  kvf_proto_msg_clear(&rep);
  return KVF_SUCCESS;
}

static kvf_status client_heartbeat_once(kvf_client *c, uint64_t *boot_token) {
  kvf_proto_msg req, rep;
  memset(&req, 0, sizeof(req));
  req.type = KVF_PROTO_HEARTBEAT;
  req.u.heartbeat.sequence = atomic_fetch_add(&c->hb_sequence, 1) + 1;
  kvf_status st = client_call(c, &req, NULL, 0, KVF_PROTO_HEARTBEAT_REPLY, &rep);
  if (st != KVF_SUCCESS) return st;
  uint64_t seq = rep.u.heartbeat_reply.sequence;
  if (boot_token) *boot_token = rep.u.heartbeat_reply.boot_token;
  kvf_proto_msg_clear(&rep);
  if (seq != req.u.heartbeat.sequence)
    return kvf_fail(KVF_ERR_PROTOCOL, "payload.sequence: %llu, the heartbeat sent %llu", (unsigned long long)seq,
                    (unsigned long long)req.u.heartbeat.sequence);
  return KVF_SUCCESS;
}

kvf_status kvf_client_heartbeat(kvf_client *client, uint64_t *boot_token) {
  if (!client) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_client_heartbeat: NULL client");
  return client_heartbeat_once(client, boot_token);
}

/* STAT with `flags`; fills *caller (may be NULL) and the client records. */
static kvf_status client_stat(kvf_client *client, uint32_t flags, kvf_client_stats *caller,
                              kvf_client_stat_record *records, uint32_t capacity, uint32_t *count) {
  kvf_status st = caller ? KVF_VERSIONED_CHECK(kvf_client_stats, caller) : KVF_SUCCESS;
  if (st != KVF_SUCCESS) return st;
  kvf_client_stats local = KVF_CLIENT_STATS_INIT, *out = caller ? &local : NULL;
  kvf_proto_msg req, rep;
  memset(&req, 0, sizeof(req));
  req.type = KVF_PROTO_STAT;
  req.u.stat.flags = flags;
  st = client_call(client, &req, NULL, 0, KVF_PROTO_STAT_REPLY, &rep);
  if (st != KVF_SUCCESS) return st;
  if (out) {
    const kvf_proto_counters *t = &rep.u.stat_reply.total;
    out->boot_token = rep.u.stat_reply.boot_token;
    out->registering = t->registrations[KVF_PROTO_REG_REGISTERING];
    out->active = t->registrations[KVF_PROTO_REG_ACTIVE];
    out->draining = t->registrations[KVF_PROTO_REG_DRAINING];
    out->closed_total = t->registrations[KVF_PROTO_REG_CLOSED];
    out->failed_total = t->registrations[KVF_PROTO_REG_FAILED];
    out->imports = t->imports;
    out->aliases = t->aliases;
    out->leases = t->leases;
    const kvf_proto_data_counters *d = &rep.u.stat_reply.data;
    out->l1_objects = d->l1_objects;
    out->l1_bytes = d->l1_bytes;
    out->l1_pool_bytes = d->l1_pool_bytes;
    out->l1_evicted_total = d->l1_evicted_entries_total;
    out->stores_total = d->stores_total;
    out->retrieves_total = d->retrieves_total;
    out->in_flight = d->in_flight;
    out->lanes = d->lanes;
    (void)KVF_VERSIONED_OUT(kvf_client_stats, caller, &local); /* checked above */
  }
  if (count) *count = rep.u.stat_reply.num_clients;
  for (uint32_t i = 0; records && i < rep.u.stat_reply.num_clients && i < capacity; i++) {
    const kvf_proto_stat_client *c = &rep.u.stat_reply.clients[i];
    kvf_client_stat_record *r = &records[i];
    memset(r, 0, sizeof(*r));
    r->client_id = c->client_id;
    r->pid = c->pid;
    snprintf(r->name, sizeof(r->name), "%s", c->name);
    r->registering = c->counters.registrations[KVF_PROTO_REG_REGISTERING];
    r->active = c->counters.registrations[KVF_PROTO_REG_ACTIVE];
    r->draining = c->counters.registrations[KVF_PROTO_REG_DRAINING];
    r->imports = c->counters.imports;
    r->aliases = c->counters.aliases;
    r->leases = c->counters.leases;
  }
  kvf_proto_msg_clear(&rep);
  return KVF_SUCCESS;
}

kvf_status kvf_client_stat(kvf_client *client, kvf_client_stats *out) {
  if (!client || !out) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_client_stat: NULL argument");
  return client_stat(client, 0, out, NULL, 0, NULL);
}

kvf_status kvf_client_stat_clients(kvf_client *client, kvf_client_stats *out, kvf_client_stat_record *records,
                                   uint32_t capacity, uint32_t *count) {
  if (!client || !count || (capacity && !records))
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_client_stat_clients: NULL argument");
  return client_stat(client, KVF_PROTO_STAT_PER_CLIENT, out, records, capacity, count);
}

kvf_status kvf_client_stat_peers(kvf_client *client, kvf_client_peer_record *records, uint32_t capacity,
                                 uint32_t *count) {
  if (!client || !count || (capacity && !records))
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_client_stat_peers: NULL argument");
  kvf_proto_msg req, rep;
  memset(&req, 0, sizeof(req));
  req.type = KVF_PROTO_STAT;
  req.u.stat.flags = KVF_PROTO_STAT_PEERS;
  kvf_status st = client_call(client, &req, NULL, 0, KVF_PROTO_STAT_REPLY, &rep);
  if (st != KVF_SUCCESS) return st;
  *count = rep.u.stat_reply.num_peers;
  for (uint32_t i = 0; i < rep.u.stat_reply.num_peers && i < capacity; i++) {
    const kvf_proto_stat_peer *p = &rep.u.stat_reply.peers[i];
    kvf_client_peer_record *r = &records[i];
    memset(r, 0, sizeof(*r));
    snprintf(r->addr, sizeof(r->addr), "%s", p->addr);
    r->state = p->state;
    r->outgoing = p->outgoing;
    r->boot_token = p->boot_token;
    r->connects = p->connects;
    r->objects_pulled = p->objects_pulled;
    r->bytes_pulled = p->bytes_pulled;
    r->objects_served = p->objects_served;
    r->failures = p->failures;
    r->objects_pushed = p->objects_pushed;
    r->bytes_pushed = p->bytes_pushed;
  }
  kvf_proto_msg_clear(&rep);
  return KVF_SUCCESS;
}

/* ---- chunk keys ------------------------------------------------------------------ */

/* SHA-256 through OpenSSL's one-shot EVP_Digest (not deprecated in
 * OpenSSL 3, unlike SHA256_Init and friends), over up to two pieces. */
static int key_sha256(const void *a, size_t alen, const void *b, size_t blen, kvf_chunk_key *out) {
  EVP_MD_CTX *ctx = EVP_MD_CTX_new();
  unsigned int n = 0;
  int ok = ctx && EVP_DigestInit_ex(ctx, EVP_sha256(), NULL) && EVP_DigestUpdate(ctx, a, alen) &&
           (blen == 0 || EVP_DigestUpdate(ctx, b, blen)) && EVP_DigestFinal_ex(ctx, out->bytes, &n) &&
           n == KVF_CHUNK_KEY_BYTES;
  EVP_MD_CTX_free(ctx);
  return ok;
}

static int key_is_zero(const kvf_chunk_key *k) {
  uint8_t any = 0;
  for (unsigned i = 0; i < KVF_CHUNK_KEY_BYTES; i++) any |= k->bytes[i];
  return any == 0;
}

#define KVF_SEED_PREFIX "kvferry-seed-v1"

kvf_status kvf_chunk_seed(const void *data, size_t len, kvf_chunk_key *seed) {
  if (!seed || (!data && len)) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_chunk_seed: NULL argument");
  if (!key_sha256(KVF_SEED_PREFIX, sizeof(KVF_SEED_PREFIX) - 1, data, len, seed))
    return kvf_fail(KVF_ERR_INTERNAL, "kvf_chunk_seed: libcrypto's SHA-256 failed");
  return KVF_SUCCESS;
}

uint64_t kvf_chunk_keys(const kvf_chunk_key *seed, const void *tokens, uint32_t token_bytes, uint64_t num_tokens,
                        uint32_t chunk_tokens, kvf_chunk_key *keys) {
  if (!seed || !tokens || !keys || chunk_tokens == 0 || token_bytes == 0 || key_is_zero(seed)) return 0;
  uint64_t total = 0, chunk_bytes = 0;
  if (!kvf_mul_u64(num_tokens, token_bytes, &total) || total > SIZE_MAX) return 0;
  chunk_bytes = (uint64_t)chunk_tokens * token_bytes; /* two u32: fits */
  const uint8_t *p = tokens;
  const kvf_chunk_key *prev = seed;
  uint64_t n = 0;
  for (uint64_t at = 0; at < total; at += chunk_bytes) {
    uint64_t len = total - at < chunk_bytes ? total - at : chunk_bytes;
    kvf_chunk_key k;
    if (!key_sha256(prev->bytes, KVF_CHUNK_KEY_BYTES, p + at, (size_t)len, &k)) return 0;
    keys[n] = k; /* all zero only if SHA-256 were broken: the server refuses it then */
    prev = &keys[n++];
  }
  return n;
}

/* ---- STORE and RETRIEVE ------------------------------------------------------------ */

/* The rules a STORE, a RETRIEVE and a LOOKUP share: a token range, an object
 * format and a chunk key per chunk of it (1..KVF_PROTO_MAX_CHUNKS, none all
 * zero). Fields are named "<what>.<field>" (what: "xfer" or "lookup"). */
static kvf_status range_check(const char *what, uint64_t token_begin, uint64_t token_end, kvf_object_format format,
                              const kvf_chunk_key *chunk_keys, uint32_t num_chunk_keys) {
  if (token_end <= token_begin)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "%s.token_end: %llu is not after token_begin %llu", what,
                    (unsigned long long)token_end, (unsigned long long)token_begin);
  if (format != KVF_FORMAT_CANONICAL && format != KVF_FORMAT_NATIVE)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "%s.format: %d is neither canonical (0) nor native (1)", what,
                    (int)format);
  if (num_chunk_keys == 0 || num_chunk_keys > KVF_PROTO_MAX_CHUNKS)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "%s.num_chunk_keys: %u is not in 1..%u", what, num_chunk_keys,
                    KVF_PROTO_MAX_CHUNKS);
  if (num_chunk_keys > token_end - token_begin)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "%s.num_chunk_keys: %u chunks for a range of %llu tokens", what,
                    num_chunk_keys, (unsigned long long)(token_end - token_begin));
  if (!chunk_keys) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "%s.chunk_keys: NULL", what);
  for (uint32_t k = 0; k < num_chunk_keys; k++)
    if (key_is_zero(&chunk_keys[k]))
      return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "%s.chunk_keys[%u]: all zero is not a key", what, k);
  return KVF_SUCCESS;
}

/* Check a kvf_client_xfer against what the protocol carries, naming the
 * field, before anything is sent. *payload gets the frame's payload bytes. */
static kvf_status xfer_check(const kvf_client *c, kvf_client_op op, const kvf_client_xfer *x, uint64_t *payload) {
  kvf_status st = range_check("xfer", x->token_begin, x->token_end, x->format, x->chunk_keys, x->num_chunk_keys);
  if (st != KVF_SUCCESS) return st;
  if (x->num_groups == 0 || x->num_groups > KVF_PROTO_MAX_GROUPS)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "xfer.num_groups: %u is not in 1..%u", x->num_groups,
                    KVF_PROTO_MAX_GROUPS);
  if (!x->groups) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "xfer.groups: NULL");
  uint64_t bytes = 104u + (uint64_t)KVF_CHUNK_KEY_BYTES * x->num_chunk_keys;
  for (uint32_t i = 0; i < x->num_groups; i++) {
    uint32_t count = x->groups[i].block_ids ? x->groups[i].count : 0;
    if (count > KVF_PROTO_MAX_BLOCKS_PER_GROUP)
      return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "xfer.groups[%u].count: %u exceeds the %u limit", i, count,
                      KVF_PROTO_MAX_BLOCKS_PER_GROUP);
    bytes += 12u + 4u * (uint64_t)count;
  }
  if (bytes > c->max_payload)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT,
                    "xfer.groups: the request needs %llu payload bytes, the server takes at most %u: split it",
                    (unsigned long long)bytes, c->max_payload);
  if (x->ready_event) {
    if (op == KVF_CLIENT_RETRIEVE)
      return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "xfer.ready_event: a RETRIEVE waits for no event; pass NULL");
    const uint8_t *h = x->ready_event;
    unsigned nz = 0;
    while (nz < KVF_PROTO_READY_HANDLE_BYTES && h[nz] == 0) nz++;
    if (nz == KVF_PROTO_READY_HANDLE_BYTES)
      return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "xfer.ready_event: %u zero bytes are not an event handle",
                      KVF_PROTO_READY_HANDLE_BYTES);
  }
  *payload = bytes;
  return KVF_SUCCESS;
}

kvf_status kvf_client_submit(kvf_client *client, kvf_client_op op, const kvf_client_xfer *caller,
                             uint64_t *request_id) {
  if (!client || !caller || !request_id)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_client_submit: NULL argument");
  if (op != KVF_CLIENT_STORE && op != KVF_CLIENT_RETRIEVE)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "op: %d is neither KVF_CLIENT_STORE (1) nor KVF_CLIENT_RETRIEVE (2)",
                    (int)op);
  kvf_client_xfer local = KVF_CLIENT_XFER_INIT;
  const kvf_client_xfer *xfer = &local;
  kvf_status st = KVF_VERSIONED_IN(kvf_client_xfer, &local, caller);
  if (st != KVF_SUCCESS) return st;
  uint64_t payload = 0;
  st = xfer_check(client, op, xfer, &payload);
  if (st != KVF_SUCCESS) return st;
  kvf_proto_group *groups = calloc(xfer->num_groups, sizeof(*groups));
  if (!groups) return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "kvf_client_submit: out of memory");
  for (uint32_t i = 0; i < xfer->num_groups; i++) {
    groups[i].first_block = xfer->groups[i].first_block;
    /* NULL or count 0: the group does not move (kvf_group_blocks). The
     * encoder only reads the ids. */
    groups[i].block_ids = (uint32_t *)xfer->groups[i].block_ids;
    groups[i].count = xfer->groups[i].block_ids ? xfer->groups[i].count : 0;
  }
  kvf_proto_msg req;
  memset(&req, 0, sizeof(req));
  req.type = op == KVF_CLIENT_STORE ? KVF_PROTO_STORE : KVF_PROTO_RETRIEVE;
  kvf_proto_xfer *x = &req.u.xfer;
  x->registration_id = xfer->registration_id;
  x->token_begin = xfer->token_begin;
  x->token_end = xfer->token_end;
  x->format = (uint32_t)xfer->format;
  if (xfer->ready_event) {
    x->ready_kind = KVF_PROTO_READY_CUDA_EVENT;
    memcpy(x->ready_handle, xfer->ready_event, KVF_PROTO_READY_HANDLE_BYTES);
  }
  x->chunk_keys = (kvf_chunk_key *)xfer->chunk_keys; /* the encoder only reads them */
  x->num_chunk_keys = xfer->num_chunk_keys;
  x->groups = groups;
  x->num_groups = xfer->num_groups;
  uint64_t id = 0;
  st = client_send(client, &req, NULL, 0, op == KVF_CLIENT_STORE ? KVF_PROTO_STORE_REPLY : KVF_PROTO_RETRIEVE_REPLY,
                   1, &id);
  free(groups);
  if (st == KVF_SUCCESS) *request_id = id;
  return st;
}

void kvf_client_test_next_request_id(kvf_client *client, uint64_t id) {
  if (!client || !id) return;
  pthread_mutex_lock(&client->lock);
  client->next_request = id;
  pthread_mutex_unlock(&client->lock);
}

void kvf_client_test_spin(kvf_client *client, int64_t spin_us) {
  if (!client) return;
  pthread_mutex_lock(&client->lock);
  client->spin_us = spin_bound(spin_us);
  pthread_mutex_unlock(&client->lock);
}

uint64_t kvf_client_test_spin_us(kvf_client *client) {
  if (!client) return 0;
  pthread_mutex_lock(&client->lock);
  uint64_t us = client->spin_us;
  pthread_mutex_unlock(&client->lock);
  return us;
}

static const char *outcome_name(uint32_t outcome) {
  switch (outcome) {
  case KVF_CLIENT_DONE: return "done";
  case KVF_CLIENT_FAILED: return "failed";
  case KVF_CLIENT_CANCELLED: return "cancelled";
  case KVF_CLIENT_TIMED_OUT: return "timed out";
  default: return "unknown";
  }
}

/* Wait for an async request; `forget`: drop it on a timeout too. *result is
 * the library's own (whole) struct: the callers copy it out. */
static kvf_status client_wait(kvf_client *c, uint64_t request_id, uint32_t timeout_ms, kvf_client_result *result,
                              int forget) {
  int64_t deadline = kvf_now_ms() + (timeout_ms ? timeout_ms : c->timeout_ms);
  kvf_client_pending *p = NULL;
  pthread_mutex_lock(&c->lock);
  kvf_status st = client_wait_locked(c, request_id, 1, deadline, &p);
  if (st == KVF_ERR_TIMEOUT && forget) pending_forget(c, request_id);
  pthread_mutex_unlock(&c->lock);
  if (st != KVF_SUCCESS) return st;
  kvf_proto_msg rep;
  st = pending_take(p, &rep);
  if (st != KVF_SUCCESS) return st;
  const kvf_proto_xfer_reply *r = &rep.u.xfer_reply;
  result->status = (kvf_status)r->status;
  result->outcome = (kvf_client_outcome)r->outcome;
  result->prefix_tokens = r->prefix_tokens;
  result->objects_done = r->objects_done;
  result->objects_present = r->objects_present;
  result->bytes_done = r->bytes_done;
  result->num_groups = r->num_groups;
  memset(result->group_blocks, 0, sizeof(result->group_blocks));
  for (uint32_t i = 0; i < r->num_groups; i++) result->group_blocks[i] = r->group_blocks[i];
  result->num_object_groups = r->num_object_groups;
  memset(result->object_group_prefix, 0, sizeof(result->object_group_prefix));
  for (uint32_t i = 0; i < r->num_object_groups; i++) result->object_group_prefix[i] = r->og_prefix_tokens[i];
  if (r->outcome != KVF_CLIENT_DONE) {
    /* The reason travels as the waiter's last error. */
    if (r->message[0])
      kvf_fail(result->status, "request %llu %s: %s", (unsigned long long)request_id, outcome_name(r->outcome),
               r->message);
    else
      kvf_fail(result->status, "request %llu %s", (unsigned long long)request_id, outcome_name(r->outcome));
  }
  kvf_proto_msg_clear(&rep);
  return KVF_SUCCESS;
}

kvf_status kvf_client_wait(kvf_client *client, uint64_t request_id, uint32_t timeout_ms, kvf_client_result *result) {
  if (!client || !result) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_client_wait: NULL argument");
  /* Checked before waiting: a bad struct must not consume the reply. */
  kvf_status st = KVF_VERSIONED_CHECK(kvf_client_result, result);
  if (st != KVF_SUCCESS) return st;
  kvf_client_result local = KVF_CLIENT_RESULT_INIT;
  st = client_wait(client, request_id, timeout_ms, &local, 0);
  if (st != KVF_SUCCESS) return st;
  return KVF_VERSIONED_OUT(kvf_client_result, result, &local);
}

static kvf_status client_xfer(kvf_client *c, kvf_client_op op, const kvf_client_xfer *xfer,
                              kvf_client_result *result) {
  kvf_client_result local = KVF_CLIENT_RESULT_INIT;
  if (!c || !xfer) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_client_%s: NULL argument",
                                   op == KVF_CLIENT_STORE ? "store" : "retrieve");
  kvf_status st = result ? KVF_VERSIONED_CHECK(kvf_client_result, result) : KVF_SUCCESS;
  if (st != KVF_SUCCESS) return st;
  uint64_t id = 0;
  st = kvf_client_submit(c, op, xfer, &id);
  if (st != KVF_SUCCESS) return st;
  /* Nobody can wait again for a request id the caller never saw: a timeout
   * forgets it. */
  st = client_wait(c, id, 0, &local, 1);
  if (st != KVF_SUCCESS) return st;
  if (result) (void)KVF_VERSIONED_OUT(kvf_client_result, result, &local); /* checked above */
  return local.outcome == KVF_CLIENT_DONE ? KVF_SUCCESS : local.status;
}

kvf_status kvf_client_store(kvf_client *client, const kvf_client_xfer *xfer, kvf_client_result *result) {
  return client_xfer(client, KVF_CLIENT_STORE, xfer, result);
}

kvf_status kvf_client_retrieve(kvf_client *client, const kvf_client_xfer *xfer, kvf_client_result *result) {
  return client_xfer(client, KVF_CLIENT_RETRIEVE, xfer, result);
}

/* ---- LOOKUP, pins and retirement ----------------------------------------------- */

kvf_status kvf_client_lookup(kvf_client *client, const kvf_client_lookup_desc *caller, kvf_client_lookup_result *out) {
  if (!client || !caller || !out) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_client_lookup: NULL argument");
  kvf_client_lookup_desc local = KVF_CLIENT_LOOKUP_DESC_INIT;
  const kvf_client_lookup_desc *q = &local;
  kvf_status st = KVF_VERSIONED_IN(kvf_client_lookup_desc, &local, caller);
  if (st == KVF_SUCCESS) st = KVF_VERSIONED_CHECK(kvf_client_lookup_result, out);
  if (st != KVF_SUCCESS) return st;
  st = range_check("lookup", q->token_begin, q->token_end, q->format, q->chunk_keys, q->num_chunk_keys);
  if (st != KVF_SUCCESS) return st;
  if (q->pin_ms > KVF_CLIENT_MAX_PIN_MS)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "lookup.pin_ms: %u exceeds the %u ms limit", q->pin_ms,
                    KVF_CLIENT_MAX_PIN_MS);
  uint64_t bytes = 40u + (uint64_t)KVF_PROTO_KEY_BYTES * q->num_chunk_keys;
  if (bytes > client->max_payload)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT,
                    "lookup.chunk_keys: the request needs %llu payload bytes, the server takes at most %u: split it",
                    (unsigned long long)bytes, client->max_payload);
  kvf_proto_msg req, rep;
  memset(&req, 0, sizeof(req));
  req.type = KVF_PROTO_LOOKUP;
  req.u.lookup.registration_id = q->registration_id;
  req.u.lookup.token_begin = q->token_begin;
  req.u.lookup.token_end = q->token_end;
  req.u.lookup.format = (uint32_t)q->format;
  req.u.lookup.pin_ms = q->pin_ms;
  req.u.lookup.chunk_keys = (kvf_proto_chunk_key *)q->chunk_keys; /* the encoder only reads them */
  req.u.lookup.num_chunk_keys = q->num_chunk_keys;
  st = client_call(client, &req, NULL, 0, KVF_PROTO_LOOKUP_REPLY, &rep);
  if (st != KVF_SUCCESS) return st;
  kvf_client_lookup_result res = KVF_CLIENT_LOOKUP_RESULT_INIT;
  const kvf_proto_lookup_reply *r = &rep.u.lookup_reply;
  res.prefix_tokens = r->prefix_tokens;
  res.num_object_groups = r->num_object_groups;
  for (uint32_t i = 0; i < r->num_object_groups; i++) res.object_group_prefix[i] = r->og_prefix_tokens[i];
  res.pin_id = r->pin_id;
  res.pinned_chunks = r->pinned_chunks;
  kvf_proto_msg_clear(&rep);
  return KVF_VERSIONED_OUT(kvf_client_lookup_result, out, &res);
}

kvf_status kvf_client_push(kvf_client *client, const kvf_client_push_desc *caller, kvf_client_push_result *out) {
  if (!client || !caller || !out) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_client_push: NULL argument");
  kvf_client_push_desc local = KVF_CLIENT_PUSH_DESC_INIT;
  const kvf_client_push_desc *q = &local;
  kvf_status st = KVF_VERSIONED_IN(kvf_client_push_desc, &local, caller);
  if (st == KVF_SUCCESS) st = KVF_VERSIONED_CHECK(kvf_client_push_result, out);
  if (st != KVF_SUCCESS) return st;
  st = range_check("push", q->token_begin, q->token_end, q->format, q->chunk_keys, q->num_chunk_keys);
  if (st != KVF_SUCCESS) return st;
  if (!q->peer) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "push.peer: NULL; name a peer (ADDR:PORT or boot token)");
  size_t plen = strnlen(q->peer, KVF_PROTO_NAME_MAX);
  if (plen >= KVF_PROTO_NAME_MAX)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "push.peer: longer than %u bytes", KVF_PROTO_NAME_MAX - 1);
  uint64_t bytes = 40u + plen + (uint64_t)KVF_PROTO_KEY_BYTES * q->num_chunk_keys;
  if (bytes > client->max_payload)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT,
                    "push.chunk_keys: the request needs %llu payload bytes, the server takes at most %u: split it",
                    (unsigned long long)bytes, client->max_payload);
  kvf_proto_msg req, rep;
  memset(&req, 0, sizeof(req));
  req.type = KVF_PROTO_PUSH;
  req.u.push.registration_id = q->registration_id;
  req.u.push.token_begin = q->token_begin;
  req.u.push.token_end = q->token_end;
  req.u.push.format = (uint32_t)q->format;
  memcpy(req.u.push.peer, q->peer, plen);
  req.u.push.chunk_keys = (kvf_proto_chunk_key *)q->chunk_keys; /* the encoder only reads them */
  req.u.push.num_chunk_keys = q->num_chunk_keys;
  st = client_call(client, &req, NULL, 0, KVF_PROTO_PUSH_REPLY, &rep);
  if (st != KVF_SUCCESS) return st;
  kvf_client_push_result res = KVF_CLIENT_PUSH_RESULT_INIT;
  const kvf_proto_push_reply *r = &rep.u.push_reply;
  res.objects_pushed = r->objects_pushed;
  res.objects_present = r->objects_present;
  res.objects_missing = r->objects_missing;
  res.objects_failed = r->objects_failed;
  res.bytes_pushed = r->bytes_pushed;
  res.chunks_on_peer = r->chunks_on_peer;
  kvf_proto_msg_clear(&rep);
  return KVF_VERSIONED_OUT(kvf_client_push_result, out, &res);
}

kvf_status kvf_client_unpin(kvf_client *client, uint64_t pin_id) {
  if (!client) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_client_unpin: NULL client");
  if (pin_id == 0) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "pin_id: 0 is not a pin");
  kvf_proto_msg req, rep;
  memset(&req, 0, sizeof(req));
  req.type = KVF_PROTO_UNPIN;
  req.u.unpin.pin_id = pin_id;
  kvf_status st = client_call(client, &req, NULL, 0, KVF_PROTO_UNPIN_REPLY, &rep);
  if (st != KVF_SUCCESS) return st;
  kvf_proto_msg_clear(&rep);
  return KVF_SUCCESS;
}

kvf_status kvf_client_wait_retired(kvf_client *c, uint64_t request_id, uint32_t timeout_ms) {
  if (!c) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_client_wait_retired: NULL client");
  int64_t deadline = kvf_now_ms() + (timeout_ms ? timeout_ms : c->timeout_ms);
  kvf_status st = KVF_SUCCESS;
  pthread_mutex_lock(&c->lock);
  if (request_id == 0 || request_id > c->max_issued) {
    st = kvf_fail(KVF_ERR_NOT_FOUND, "request_id: %llu was never a request of this client",
                  (unsigned long long)request_id);
    goto out;
  }
  for (;;) {
    kvf_client_unretired *u = *unretired_at(c, request_id);
    if (!u) break; /* retired: normally (before its reply) or by its notice */
    if (c->dead) {
      st = kvf_fail(KVF_ERR_DISCONNECTED,
                    "request %llu: the connection closed before its work was proven retired (%s): treat the blocks "
                    "it named as written until the server has exited or unmapped them",
                    (unsigned long long)request_id, c->dead_detail);
      goto out;
    }
    int64_t left = deadline - kvf_now_ms();
    if (left <= 0) {
      st = kvf_fail(KVF_ERR_TIMEOUT, "request %llu: %s", (unsigned long long)request_id,
                    u->answered ? "no RETIRED notice yet: its work may still touch the blocks"
                                : "no reply yet: it is still in flight");
      goto out;
    }
    if (!c->reading) {
      c->reading = 1;
      client_read_turn(c, left < KVF_CLIENT_READ_SLICE_MS ? (int)left : KVF_CLIENT_READ_SLICE_MS);
      c->reading = 0;
      pthread_cond_broadcast(&c->cond);
    } else {
      cond_wait_until(&c->cond, &c->lock, deadline);
    }
  }
out:
  pthread_mutex_unlock(&c->lock);
  return st;
}

int kvf_client_server_restarted(const kvf_client *client) {
  if (!client || !client->hb_running) return 0;
  return client_restarted(client);
}

void kvf_client_disconnect(kvf_client *client) {
  if (!client) return;
  if (client->hb_running) {
    pthread_mutex_lock(&client->lock);
    atomic_store(&client->stopping, 1);
    pthread_cond_broadcast(&client->hb_cond);
    pthread_mutex_unlock(&client->lock);
    /* A heartbeat inside a call returns at once: its read sees EOF. */
    if (client->conn.fd >= 0) (void)shutdown(client->conn.fd, SHUT_RDWR);
    pthread_join(client->hb_thread, NULL);
  }
  client_free(client);
}
