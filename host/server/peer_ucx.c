/* The peer transport over UCX's UCP API (host/server/peer_transport.h):
 * one worker (single-threaded: the peer thread), a sockaddr listener,
 * endpoints with peer error handling, active messages for control (always
 * eager, id 0, the sender's endpoint as reply_ep), ucp_mem_map + rkeys and
 * ucp_get_nbx for the data. A context (kvf_pt_context) is the UCP context:
 * memory it allocates (ucp_mem_map with ALLOCATE) is what posix/sysv can
 * map into a peer on this host. */
#define _GNU_SOURCE
#include "host/server/peer_transport.h"

#include "common/clock.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/shm.h>
#include <sys/socket.h>
#include <unistd.h>

#include <ucp/api/ucp.h>

#include "common/error.h"
#include "host/core/log.h"
#include "host/core/param.h"

#define PT_AM_ID 0u
/* The transport's own message: the sender's worker address. A second
 * endpoint, made from it, carries the gets: UCP makes sockaddr endpoints
 * over network transports only (tcp here), while one made from a worker
 * address may use shared memory (cma, posix, sysv) between processes of one
 * host. It is made only when a key is unpacked, i.e. after the caller
 * authenticated the peer: an unauthenticated peer cannot make us connect
 * anywhere. */
#define PT_AM_ADDR 1u
#define PT_MAX_ADDR (64u << 10)

typedef struct pt_get {
  struct pt_get *next, *prev; /* in the connection's list of gets in flight */
  struct pt_get *done_next;   /* gets that completed at once, run at the next progress */
  kvf_pt_conn *conn;
  kvf_pt_get_done done;
  void *arg;
  kvf_status status;
} pt_get;

struct kvf_pt_conn {
  kvf_pt *t;
  kvf_pt_conn *next, *prev;
  ucp_ep_h ep;      /* the sockaddr endpoint: messages */
  ucp_ep_h data_ep; /* from the peer's worker address: gets (NULL: ep carries them) */
  void *peer_addr;  /* the peer's worker address, once sent */
  size_t peer_addr_len;
  void *user;
  int failed;     /* the error handler ran (or the endpoint could not be made) */
  int reported;   /* on_error was called */
  int closing;
  char why[160];
  pt_get *gets;   /* in flight */
};

struct kvf_pt_context {
  ucp_context_h ucp;
  kvf_pt_mem *allocs; /* kvf_pt_mem_alloc's regions, for kvf_pt_mem_register to find */
  uint32_t transports; /* made on it and not destroyed yet */
};

struct kvf_pt_mem {
  kvf_pt_context *ctx;
  ucp_mem_h memh;
  kvf_pt_mem *parent; /* a registration inside an allocation: its memh and key are the parent's */
  void *base;
  size_t len;
  void *key;
  size_t key_len;
  int allocated;           /* by kvf_pt_mem_alloc */
  kvf_pt_mem *next, *prev; /* an allocation: in ctx->allocs */
  uint32_t users;          /* an allocation: registrations inside it */
};

struct kvf_pt_rkey {
  ucp_rkey_h rkey;
  ucp_ep_h ep;            /* the endpoint it was unpacked on: its gets go there */
  const uint8_t *mapped;  /* the region, mapped here (a peer's System V segment on this host): its gets
                             are memcpys from it, bounded by it; NULL: UCX's gets */
  uint64_t base, size;    /* the region (remote addresses), when mapped */
};

struct kvf_pt {
  kvf_pt_callbacks cb;
  kvf_pt_context *ctx;
  int own_ctx;     /* made with no context: ctx is ours */
  ucp_worker_h worker;
  ucp_listener_h listener;
  int efd;         /* the worker's event descriptor */
  int wake[2];     /* kvf_pt_signal's pipe */
  kvf_pt_conn *conns;
  pt_get *done_head; /* gets completed inside kvf_pt_get, their callbacks not run yet */
  ucp_address_t *addr; /* this worker's address */
  size_t addr_len;
  int failures_pending; /* some connection failed and was not reported yet */
};

static kvf_status ucs_fail(const char *what, ucs_status_t s) {
  return kvf_fail(KVF_ERR_SYSTEM, "%s: %s", what, ucs_status_string(s));
}

static int parse_addr(const char *addr_port, struct sockaddr_in *sa) {
  char host[64];
  const char *colon = addr_port ? strrchr(addr_port, ':') : NULL;
  if (!colon || (size_t)(colon - addr_port) >= sizeof(host) || colon == addr_port) return -1;
  memcpy(host, addr_port, (size_t)(colon - addr_port));
  host[colon - addr_port] = 0;
  char *end = NULL;
  errno = 0;
  long port = strtol(colon + 1, &end, 10);
  if (errno || end == colon + 1 || *end || port < 0 || port > 65535) return -1;
  memset(sa, 0, sizeof(*sa));
  sa->sin_family = AF_INET;
  sa->sin_port = htons((uint16_t)port);
  if (inet_pton(AF_INET, host, &sa->sin_addr) != 1) return -1;
  return 0;
}

static void conn_link(kvf_pt *t, kvf_pt_conn *c) {
  c->t = t;
  c->next = t->conns;
  if (t->conns) t->conns->prev = c;
  t->conns = c;
}

static void conn_unlink(kvf_pt_conn *c) {
  kvf_pt *t = c->t;
  if (c->prev)
    c->prev->next = c->next;
  else if (t->conns == c)
    t->conns = c->next;
  if (c->next) c->next->prev = c->prev;
  c->next = c->prev = NULL;
}

static kvf_pt_conn *conn_by_ep(kvf_pt *t, ucp_ep_h ep) {
  for (kvf_pt_conn *c = t->conns; c; c = c->next)
    if (c->ep == ep || (c->data_ep && c->data_ep == ep)) return c;
  return NULL;
}

static void on_ep_error(void *arg, ucp_ep_h ep, ucs_status_t status) {
  kvf_pt_conn *c = arg;
  (void)ep;
  if (c->failed) return;
  c->failed = 1;
  snprintf(c->why, sizeof(c->why), "transport: %s", ucs_status_string(status));
  c->t->failures_pending = 1;
}

static ucs_status_t on_am(void *arg, const void *header, size_t header_length, void *data, size_t length,
                          const ucp_am_recv_param_t *param) {
  kvf_pt *t = arg;
  (void)header;
  (void)header_length;
  if (!(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)) {
    KVF_INFO(SERVER, "peer transport: a message without its sender dropped");
    return UCS_OK;
  }
  kvf_pt_conn *c = conn_by_ep(t, param->reply_ep);
  if (!c || c->closing || c->failed) return UCS_OK;
  if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
    /* Control messages are always sent eager: a rendezvous one is not ours. */
    c->failed = 1;
    snprintf(c->why, sizeof(c->why), "a rendezvous message (%zu bytes; control messages are eager)", length);
    t->failures_pending = 1;
    return UCS_OK; /* the data is released */
  }
  t->cb.on_message(t->cb.ctx, c, data, length);
  return UCS_OK;
}

static ucs_status_t on_am_addr(void *arg, const void *header, size_t header_length, void *data, size_t length,
                               const ucp_am_recv_param_t *param) {
  kvf_pt *t = arg;
  (void)header;
  (void)header_length;
  if (!(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)) return UCS_OK;
  kvf_pt_conn *c = conn_by_ep(t, param->reply_ep);
  if (!c || c->closing || c->failed) return UCS_OK;
  if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) || c->peer_addr || length == 0 || length > PT_MAX_ADDR) {
    c->failed = 1;
    snprintf(c->why, sizeof(c->why), "a bad worker address message (%zu bytes)", length);
    t->failures_pending = 1;
    return UCS_OK;
  }
  c->peer_addr = malloc(length);
  if (c->peer_addr) {
    memcpy(c->peer_addr, data, length);
    c->peer_addr_len = length;
  }
  return UCS_OK;
}

static kvf_status send_raw(kvf_pt_conn *c, unsigned id, const void *data, size_t len);

static void conn_send_address(kvf_pt_conn *c) {
  if (send_raw(c, PT_AM_ADDR, c->t->addr, c->t->addr_len) != KVF_SUCCESS) {
    c->failed = 1;
    snprintf(c->why, sizeof(c->why), "sending the worker address: %s", kvf_last_error());
    c->t->failures_pending = 1;
  }
}

static void on_conn_request(ucp_conn_request_h req, void *arg) {
  kvf_pt *t = arg;
  kvf_pt_conn *c = calloc(1, sizeof(*c));
  if (!c) {
    (void)ucp_listener_reject(t->listener, req);
    return;
  }
  ucp_ep_params_t p;
  memset(&p, 0, sizeof(p));
  p.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLER | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  p.conn_request = req;
  p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  p.err_handler.cb = on_ep_error;
  p.err_handler.arg = c;
  ucs_status_t s = ucp_ep_create(t->worker, &p, &c->ep);
  if (s != UCS_OK) {
    KVF_WARN(SERVER, "peer transport: accepting a peer: %s", ucs_status_string(s));
    free(c);
    return;
  }
  conn_link(t, c);
  conn_send_address(c);
  t->cb.on_accept(t->cb.ctx, c);
}

kvf_status kvf_pt_context_create(kvf_pt_context **out) {
  if (!out) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_pt_context_create: NULL argument");
  *out = NULL;
  kvf_pt_context *c = calloc(1, sizeof(*c));
  if (!c) return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "peer transport: out of memory");
  ucp_config_t *config = NULL;
  /* A restarted kvferryd listens on its port again at once, while sockets
   * of its previous run may linger in TIME_WAIT (ucp_config_modify does not
   * reach the CM's options in UCX 1.13: the environment does). A value the
   * user set wins. */
  (void)setenv("UCX_TCP_CM_REUSEADDR", "y", 0);
  ucs_status_t s = ucp_config_read(NULL, NULL, &config);
  if (s != UCS_OK) {
    free(c);
    return ucs_fail("ucp_config_read (check the UCX_* environment)", s);
  }
  ucp_params_t pp;
  memset(&pp, 0, sizeof(pp));
  pp.field_mask = UCP_PARAM_FIELD_FEATURES;
  pp.features = UCP_FEATURE_AM | UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP;
  s = ucp_init(&pp, config, &c->ucp);
  ucp_config_release(config);
  if (s != UCS_OK) {
    free(c);
    return ucs_fail("ucp_init (check UCX_TLS)", s);
  }
  *out = c;
  return KVF_SUCCESS;
}

void kvf_pt_context_destroy(kvf_pt_context *c) {
  if (!c) return;
  if (c->allocs || c->transports) {
    /* The caller's bug: cleaning UCX up under them would be a use after
     * free. Report it and keep the context (a leak). */
    KVF_WARN(SERVER, "peer transport: a context freed while %s still uses it (left allocated)",
             c->allocs ? "allocated memory" : "a transport");
    return;
  }
  ucp_cleanup(c->ucp);
  free(c);
}

kvf_status kvf_pt_create(kvf_pt_context *ctx, const kvf_pt_callbacks *cb, kvf_pt **out) {
  if (!cb || !out || !cb->on_accept || !cb->on_message || !cb->on_error)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_pt_create: NULL argument");
  *out = NULL;
  kvf_pt *t = calloc(1, sizeof(*t));
  if (!t) return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "peer transport: out of memory");
  t->cb = *cb;
  t->efd = -1;
  t->wake[0] = t->wake[1] = -1;
  kvf_status st = KVF_SUCCESS;
  if (!ctx) {
    st = kvf_pt_context_create(&ctx);
    if (st != KVF_SUCCESS) {
      free(t);
      return st;
    }
    t->own_ctx = 1;
  }
  t->ctx = ctx;
  ctx->transports++;
  ucs_status_t s;
  ucp_worker_params_t wp;
  memset(&wp, 0, sizeof(wp));
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;
  s = ucp_worker_create(t->ctx->ucp, &wp, &t->worker);
  if (s != UCS_OK) {
    st = ucs_fail("ucp_worker_create", s);
    goto fail;
  }
  s = ucp_worker_get_efd(t->worker, &t->efd);
  if (s != UCS_OK) {
    st = ucs_fail("ucp_worker_get_efd", s);
    goto fail;
  }
  ucp_am_handler_param_t ap;
  memset(&ap, 0, sizeof(ap));
  ap.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
  ap.id = PT_AM_ID;
  ap.cb = on_am;
  ap.arg = t;
  s = ucp_worker_set_am_recv_handler(t->worker, &ap);
  if (s != UCS_OK) {
    st = ucs_fail("ucp_worker_set_am_recv_handler", s);
    goto fail;
  }
  ap.id = PT_AM_ADDR;
  ap.cb = on_am_addr;
  s = ucp_worker_set_am_recv_handler(t->worker, &ap);
  if (s != UCS_OK) {
    st = ucs_fail("ucp_worker_set_am_recv_handler", s);
    goto fail;
  }
  s = ucp_worker_get_address(t->worker, &t->addr, &t->addr_len);
  if (s != UCS_OK) {
    st = ucs_fail("ucp_worker_get_address", s);
    goto fail;
  }
  if (pipe2(t->wake, O_CLOEXEC | O_NONBLOCK) != 0) {
    st = kvf_fail(KVF_ERR_SYSTEM, "peer transport: pipe: %s", strerror(errno));
    goto fail;
  }
  *out = t;
  return KVF_SUCCESS;
fail:
  kvf_pt_destroy(t);
  return st;
}

void kvf_pt_destroy(kvf_pt *t) {
  if (!t) return;
  while (t->conns) kvf_pt_close(t->conns);
  if (t->listener) ucp_listener_destroy(t->listener);
  if (t->addr) ucp_worker_release_address(t->worker, t->addr);
  if (t->worker) {
    /* A peer that was reconnecting as we stop leaves UCX's own wireup
     * endpoints with messages in flight; UCX 1.13 asserts in
     * ucp_worker_destroy when it purges them (seen once in CI, the lying-peer
     * case). Progress the worker a short, bounded while first. */
    uint64_t until = kvf_now_ns() + 100000000ull;
    while (kvf_now_ns() < until) {
      if (!ucp_worker_progress(t->worker)) usleep(1000);
    }
    ucp_worker_destroy(t->worker);
  }
  t->ctx->transports--;
  if (t->own_ctx) kvf_pt_context_destroy(t->ctx);
  if (t->wake[0] >= 0) close(t->wake[0]);
  if (t->wake[1] >= 0) close(t->wake[1]);
  free(t);
}

kvf_status kvf_pt_listen(kvf_pt *t, const char *addr_port, uint16_t *port) {
  struct sockaddr_in sa;
  if (parse_addr(addr_port, &sa) != 0)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "--listen: '%s' is not ADDR:PORT (numeric IPv4)", addr_port ? addr_port : "");
  ucp_listener_params_t lp;
  memset(&lp, 0, sizeof(lp));
  lp.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
  lp.sockaddr.addr = (const struct sockaddr *)&sa;
  lp.sockaddr.addrlen = sizeof(sa);
  lp.conn_handler.cb = on_conn_request;
  lp.conn_handler.arg = t;
  ucs_status_t s = ucp_listener_create(t->worker, &lp, &t->listener);
  if (s != UCS_OK) return kvf_fail(KVF_ERR_SYSTEM, "--listen %s: ucp_listener_create: %s", addr_port, ucs_status_string(s));
  if (port) {
    ucp_listener_attr_t la;
    memset(&la, 0, sizeof(la));
    la.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
    *port = 0;
    if (ucp_listener_query(t->listener, &la) == UCS_OK && la.sockaddr.ss_family == AF_INET)
      *port = ntohs(((const struct sockaddr_in *)&la.sockaddr)->sin_port);
  }
  return KVF_SUCCESS;
}

kvf_status kvf_pt_connect(kvf_pt *t, const char *addr_port, kvf_pt_conn **out) {
  *out = NULL;
  struct sockaddr_in sa;
  if (parse_addr(addr_port, &sa) != 0)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "--peer: '%s' is not ADDR:PORT (numeric IPv4)", addr_port ? addr_port : "");
  kvf_pt_conn *c = calloc(1, sizeof(*c));
  if (!c) return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "peer transport: out of memory");
  ucp_ep_params_t p;
  memset(&p, 0, sizeof(p));
  p.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR | UCP_EP_PARAM_FIELD_ERR_HANDLER |
                 UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  p.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
  p.sockaddr.addr = (const struct sockaddr *)&sa;
  p.sockaddr.addrlen = sizeof(sa);
  p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  p.err_handler.cb = on_ep_error;
  p.err_handler.arg = c;
  ucs_status_t s = ucp_ep_create(t->worker, &p, &c->ep);
  if (s != UCS_OK) {
    free(c);
    return kvf_fail(KVF_ERR_SYSTEM, "peer %s: ucp_ep_create: %s", addr_port, ucs_status_string(s));
  }
  conn_link(t, c);
  conn_send_address(c);
  *out = c;
  return KVF_SUCCESS;
}

/* A forced close: every request of ep completes (with an error) in here. */
static void ep_close(kvf_pt *t, ucp_ep_h ep) {
  if (!ep) return;
  ucp_request_param_t p;
  memset(&p, 0, sizeof(p));
  p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  p.flags = UCP_EP_CLOSE_FLAG_FORCE;
  ucs_status_ptr_t req = ucp_ep_close_nbx(ep, &p);
  if (UCS_PTR_IS_PTR(req)) {
    while (ucp_request_check_status(req) == UCS_INPROGRESS) ucp_worker_progress(t->worker);
    ucp_request_free(req);
  }
}

void kvf_pt_close(kvf_pt_conn *c) {
  if (!c) return;
  kvf_pt *t = c->t;
  c->closing = 1;
  ep_close(t, c->data_ep);
  c->data_ep = NULL;
  ep_close(t, c->ep);
  c->ep = NULL;
  free(c->peer_addr);
  c->peer_addr = NULL;
  /* Gets completed at once but not reported yet belong to the done list. */
  for (pt_get **pp = &t->done_head; *pp;) {
    pt_get *g = *pp;
    if (g->conn == c) {
      *pp = g->done_next;
      g->done(g->arg, g->status);
      free(g);
    } else {
      pp = &g->done_next;
    }
  }
  if (c->gets) {
    /* A forced close completes every request of the endpoint; if one is left
     * its request still points at it: report it, and keep the record (a
     * small leak, never a use after free). */
    KVF_WARN(SERVER, "peer transport: gets still in flight after a forced close");
    for (pt_get *g = c->gets; g; g = g->next) {
      g->done(g->arg, KVF_ERR_DISCONNECTED);
      g->done = NULL;
      g->conn = NULL;
    }
    c->gets = NULL;
  }
  conn_unlink(c);
  free(c);
}

void kvf_pt_conn_set_user(kvf_pt_conn *c, void *user) { c->user = user; }
void *kvf_pt_conn_user(const kvf_pt_conn *c) { return c->user; }

static void on_send_done(void *request, ucs_status_t status, void *user_data) {
  (void)status;
  free(user_data);
  ucp_request_free(request);
}

static kvf_status send_raw(kvf_pt_conn *c, unsigned id, const void *data, size_t len) {
  if (c->failed || c->closing || !c->ep) return kvf_fail(KVF_ERR_DISCONNECTED, "peer transport: the connection failed");
  void *copy = malloc(len);
  if (!copy) return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "peer transport: out of memory");
  memcpy(copy, data, len);
  ucp_request_param_t p;
  memset(&p, 0, sizeof(p));
  p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  p.flags = UCP_AM_SEND_FLAG_EAGER | UCP_AM_SEND_FLAG_REPLY;
  p.cb.send = on_send_done;
  p.user_data = copy;
  ucs_status_ptr_t r = ucp_am_send_nbx(c->ep, id, NULL, 0, copy, len, &p);
  if (r == NULL) {
    free(copy);
    return KVF_SUCCESS;
  }
  if (UCS_PTR_IS_ERR(r)) {
    free(copy);
    return kvf_fail(KVF_ERR_DISCONNECTED, "peer transport: send: %s", ucs_status_string(UCS_PTR_STATUS(r)));
  }
  return KVF_SUCCESS;
}

kvf_status kvf_pt_send(kvf_pt_conn *c, const void *data, size_t len) {
  if (len == 0 || len > KVF_PT_MAX_MESSAGE)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "peer transport: a message of %zu bytes", len);
  return send_raw(c, PT_AM_ID, data, len);
}

/* One line of /proc/self/maps: its address range, its inode (a System V
 * segment's shmid) and whether it maps such a segment readable and shared.
 * 0 when the line does not parse. */
typedef struct maps_line {
  unsigned long lo, hi, ino;
  int sysv;        /* the path is a System V segment's */
  int shared_read; /* permissions r..s */
} maps_line;

static int maps_parse(const char *line, maps_line *m) {
  unsigned long off;
  char perms[8], dev[16];
  int path = 0;
  if (sscanf(line, "%lx-%lx %7s %lx %15s %lu %n", &m->lo, &m->hi, perms, &off, dev, &m->ino, &path) < 6) return 0;
  m->sysv = path && strncmp(line + path, "/SYSV", 5) == 0;
  m->shared_read = perms[0] == 'r' && perms[3] == 's';
  return 1;
}

/* The System V segment mapped at p (its shmid), or -1 when p is in none. */
static int sysv_shmid_at(const void *p) {
  FILE *f = fopen("/proc/self/maps", "re");
  if (!f) return -1;
  uintptr_t a = (uintptr_t)p;
  char *line = NULL;
  size_t cap = 0;
  int id = -1;
  maps_line m;
  while (getline(&line, &cap, f) > 0) {
    if (!maps_parse(line, &m) || a < m.lo || a >= m.hi) continue;
    if (m.sysv && m.ino <= INT_MAX) id = (int)m.ino;
    break;
  }
  free(line);
  fclose(f);
  return id;
}

/* UCX makes its System V segments mode 0660: anyone in the kvferryd user's
 * group could attach an L1 pool. Ours are the user's alone, as the process
 * memory they replace was (a peer kvferryd runs as the same user). */
static kvf_status sysv_restrict(const void *base) {
  int id = sysv_shmid_at(base);
  if (id < 0) return KVF_SUCCESS; /* not a System V segment (POSIX: reached through /proc/PID/fd only) */
  struct shmid_ds ds;
  if (shmctl(id, IPC_STAT, &ds) != 0)
    return kvf_fail(KVF_ERR_SYSTEM, "shmctl(IPC_STAT) of an L1 segment: %s", strerror(errno));
  ds.shm_perm.mode = (ds.shm_perm.mode & ~0777u) | 0600u;
  if (shmctl(id, IPC_SET, &ds) != 0)
    return kvf_fail(KVF_ERR_SYSTEM, "shmctl(IPC_SET, 0600) of an L1 segment: %s", strerror(errno));
  return KVF_SUCCESS;
}

/* Pack memh's key into a copy m owns. */
static kvf_status mem_pack(kvf_pt_mem *m) {
  void *buf = NULL;
  size_t n = 0;
  ucs_status_t s = ucp_rkey_pack(m->ctx->ucp, m->memh, &buf, &n);
  if (s != UCS_OK) return ucs_fail("ucp_rkey_pack", s);
  m->key = malloc(n ? n : 1);
  if (!m->key) {
    ucp_rkey_buffer_release(buf);
    return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "peer transport: out of memory");
  }
  memcpy(m->key, buf, n);
  m->key_len = n;
  ucp_rkey_buffer_release(buf);
  return KVF_SUCCESS;
}

kvf_status kvf_pt_mem_alloc(kvf_pt_context *c, size_t len, kvf_pt_mem **out) {
  *out = NULL;
  if (len == 0) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "peer transport: an allocation of 0 bytes");
  kvf_pt_mem *m = calloc(1, sizeof(*m));
  if (!m) return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "peer transport: out of memory");
  m->ctx = c;
  ucp_mem_map_params_t mp;
  memset(&mp, 0, sizeof(mp));
  mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH | UCP_MEM_MAP_PARAM_FIELD_FLAGS;
  mp.address = NULL;
  mp.length = len;
  mp.flags = UCP_MEM_MAP_ALLOCATE;
  ucs_status_t s = ucp_mem_map(c->ucp, &mp, &m->memh);
  if (s != UCS_OK) {
    free(m);
    return kvf_fail(s == UCS_ERR_NO_MEMORY ? KVF_ERR_OUT_OF_MEMORY : KVF_ERR_SYSTEM,
                    "ucp_mem_map (ALLOCATE) of %zu bytes: %s", len, ucs_status_string(s));
  }
  ucp_mem_attr_t a;
  memset(&a, 0, sizeof(a));
  a.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
  kvf_status st;
  s = ucp_mem_query(m->memh, &a);
  if (s != UCS_OK || !a.address || a.length < len) {
    st = s != UCS_OK ? ucs_fail("ucp_mem_query", s)
                     : kvf_fail(KVF_ERR_SYSTEM, "ucp_mem_map (ALLOCATE) of %zu bytes gave %zu", len, a.length);
    goto fail;
  }
  m->base = a.address;
  m->len = len;
  m->allocated = 1;
  st = sysv_restrict(m->base);
  if (st != KVF_SUCCESS) goto fail;
  st = mem_pack(m);
  if (st != KVF_SUCCESS) goto fail;
  m->next = c->allocs;
  if (c->allocs) c->allocs->prev = m;
  c->allocs = m;
  *out = m;
  return KVF_SUCCESS;
fail:
  (void)ucp_mem_unmap(c->ucp, m->memh);
  free(m);
  return st;
}

void kvf_pt_mem_free(kvf_pt_mem *m) {
  if (!m) return;
  kvf_pt_context *c = m->ctx;
  if (!m->allocated) {
    KVF_WARN(SERVER, "peer transport: kvf_pt_mem_free of a registration (kvf_pt_mem_deregister it)");
    return;
  }
  if (m->users) {
    /* The caller's bug (a registration inside it is still live, a peer
     * may hold its key): keep the memory rather than unmap it under them. */
    KVF_WARN(SERVER, "peer transport: memory freed while %u registrations use it (left allocated)",
             (unsigned)m->users);
    return;
  }
  if (m->prev)
    m->prev->next = m->next;
  else
    c->allocs = m->next;
  if (m->next) m->next->prev = m->prev;
  (void)ucp_mem_unmap(c->ucp, m->memh);
  free(m->key);
  free(m);
}

void *kvf_pt_mem_base(const kvf_pt_mem *m) { return m->base; }

kvf_status kvf_pt_mem_register(kvf_pt *t, void *base, size_t len, kvf_pt_mem **out) {
  *out = NULL;
  kvf_pt_mem *m = calloc(1, sizeof(*m));
  if (!m) return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "peer transport: out of memory");
  m->ctx = t->ctx;
  m->base = base;
  m->len = len;
  uintptr_t b = (uintptr_t)base;
  for (kvf_pt_mem *a = t->ctx->allocs; a; a = a->next) {
    uintptr_t ab = (uintptr_t)a->base;
    if (b >= ab && len <= a->len && b - ab <= a->len - len) {
      /* Registered already, by UCX's allocation: mapping it again would
       * give a key without the shared-memory domains. */
      m->parent = a;
      m->memh = a->memh;
      m->key = a->key;
      m->key_len = a->key_len;
      a->users++;
      *out = m;
      return KVF_SUCCESS;
    }
  }
  ucp_mem_map_params_t mp;
  memset(&mp, 0, sizeof(mp));
  mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
  mp.address = base;
  mp.length = len;
  ucs_status_t s = ucp_mem_map(t->ctx->ucp, &mp, &m->memh);
  if (s != UCS_OK) {
    free(m);
    return ucs_fail("ucp_mem_map of an L1 pool", s);
  }
  kvf_status st = mem_pack(m);
  if (st != KVF_SUCCESS) {
    (void)ucp_mem_unmap(t->ctx->ucp, m->memh);
    free(m);
    return st;
  }
  *out = m;
  return KVF_SUCCESS;
}

void kvf_pt_mem_key(const kvf_pt_mem *m, const void **key, size_t *len) {
  *key = m->key;
  *len = m->key_len;
}

void kvf_pt_mem_deregister(kvf_pt_mem *m) {
  if (!m) return;
  if (m->parent) {
    m->parent->users--;
  } else {
    (void)ucp_mem_unmap(m->ctx->ucp, m->memh);
    free(m->key);
  }
  free(m);
}

/* Whether [p, p + len) lies in one System V shared-memory segment mapped
 * here (contiguous mappings of one shmid, readable and shared), from
 * /proc/self/maps: 1 it does; 0 p is in such a segment, which ends before
 * p + len; -1 p is in no System V segment. */
static int sysv_mapping_covers(const void *p, uint64_t len) {
  FILE *f = fopen("/proc/self/maps", "re");
  if (!f) return -1; /* nothing to bound it by */
  uintptr_t a = (uintptr_t)p, end = 0;
  unsigned long inode = 0;
  char *line = NULL;
  size_t cap = 0;
  int ok = -1;
  maps_line m;
  while (getline(&line, &cap, f) > 0) {
    if (!maps_parse(line, &m)) continue;
    int sysv = m.sysv && m.shared_read;
    if (!end) {
      if (a < m.lo || a >= m.hi) continue;
      if (!sysv) break;
      inode = m.ino;
      end = m.hi;
      ok = 0;
    } else if (m.lo != end || !sysv || m.ino != inode) {
      break;
    } else {
      end = m.hi;
    }
    if (end - a >= len) {
      ok = 1;
      break;
    }
  }
  free(line);
  fclose(f);
  return ok;
}

/* k (unpacked on ep) maps the peer's region into this process when UCX
 * can read it through shared memory. UCX's own gets through such a mapping
 * are a memcpy that nothing bounds: a peer claiming a region larger than
 * its segment would make us read our own memory, or past it. So a mapped
 * region must lie inside one System V segment (which cannot shrink under
 * us, where a POSIX file can), and we read it ourselves, bounded by it.
 * Returns 1 (mapped and checked: k->mapped set), 0 (not mapped: UCX's
 * gets), -1 (a System V segment smaller than the region claimed), -2
 * (mapped, but not in a System V segment). */
static int rkey_map(kvf_pt_rkey *k, uint64_t base, uint64_t size) {
  void *p = NULL;
  if (ucp_rkey_ptr(k->rkey, base, &p) != UCS_OK || !p) return 0;
  int covers = sysv_mapping_covers(p, size);
  if (covers <= 0) return covers == 0 ? -1 : -2;
  k->mapped = p;
  k->base = base;
  k->size = size;
  return 1;
}

kvf_status kvf_pt_rkey_unpack(kvf_pt_conn *c, const void *key, size_t len, uint64_t base, uint64_t size,
                              kvf_pt_rkey **out) {
  *out = NULL;
  (void)len; /* UCP reads the packed key's own length */
  if (!c->ep || c->failed) return kvf_fail(KVF_ERR_DISCONNECTED, "peer transport: the connection failed");
  if (size == 0 || base + size < base)
    return kvf_fail(KVF_ERR_PROTOCOL, "a remote region of %llu bytes at %llx", (unsigned long long)size,
                    (unsigned long long)base);
  if (!c->data_ep && c->peer_addr) {
    ucp_ep_params_t p;
    memset(&p, 0, sizeof(p));
    /* UCX 1.13 selects shared-memory transports (cma, posix, sysv) only for
     * an endpoint without peer-failure handling: KVF_PEER_SHM=1 takes that
     * trade (a dead peer is then caught by the fetch timeout and the message
     * endpoint's failure); by default the gets keep peer-failure handling,
     * over the network transports. */
    int shm = kvf_param_peer_shm() == 1;
    p.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS |
                   (shm ? 0 : UCP_EP_PARAM_FIELD_ERR_HANDLER | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE);
    p.address = c->peer_addr;
    p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    p.err_handler.cb = on_ep_error;
    p.err_handler.arg = c;
    ucs_status_t es = ucp_ep_create(c->t->worker, &p, &c->data_ep);
    if (es != UCS_OK) {
      c->data_ep = NULL; /* the gets go over the message endpoint */
      KVF_INFO(SERVER, "peer transport: an endpoint from the peer's worker address: %s", ucs_status_string(es));
    }
  }
  kvf_pt_rkey *k = calloc(1, sizeof(*k));
  if (!k) return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "peer transport: out of memory");
  k->ep = c->data_ep ? c->data_ep : c->ep;
  ucs_status_t s = ucp_ep_rkey_unpack(k->ep, key, &k->rkey);
  if (s != UCS_OK) {
    free(k);
    return kvf_fail(KVF_ERR_PROTOCOL, "a remote key that does not unpack: %s", ucs_status_string(s));
  }
  int m = rkey_map(k, base, size);
  if (m == -1) {
    ucp_rkey_destroy(k->rkey);
    free(k);
    return kvf_fail(KVF_ERR_PROTOCOL, "a remote key whose shared-memory segment does not hold the %llu bytes "
                    "claimed", (unsigned long long)size);
  }
  if (m == -2 && k->ep != c->ep) {
    /* Shared memory we cannot bound: the message endpoint instead, whose
     * network transports have the peer read its own memory. */
    KVF_INFO(SERVER, "peer transport: a remote region of %llu bytes mapped here outside any System V segment: "
             "its gets go over the network transports", (unsigned long long)size);
    ucp_rkey_destroy(k->rkey);
    k->ep = c->ep;
    s = ucp_ep_rkey_unpack(k->ep, key, &k->rkey);
    if (s != UCS_OK) {
      free(k);
      return kvf_fail(KVF_ERR_PROTOCOL, "a remote key that does not unpack: %s", ucs_status_string(s));
    }
  }
  *out = k;
  return KVF_SUCCESS;
}

void kvf_pt_rkey_destroy(kvf_pt_rkey *k) {
  if (!k) return;
  ucp_rkey_destroy(k->rkey);
  free(k);
}

static void get_unlink(pt_get *g) {
  kvf_pt_conn *c = g->conn;
  if (!c) return;
  if (g->prev)
    g->prev->next = g->next;
  else
    c->gets = g->next;
  if (g->next) g->next->prev = g->prev;
  g->next = g->prev = NULL;
}

static void on_get_done(void *request, ucs_status_t status, void *user_data) {
  pt_get *g = user_data;
  ucp_request_free(request);
  if (!g->done) return; /* reported at a forced close already (kvf_pt_close) */
  get_unlink(g);
  g->done(g->arg, status == UCS_OK ? KVF_SUCCESS : KVF_ERR_DISCONNECTED);
  free(g);
}

kvf_status kvf_pt_get(kvf_pt_conn *c, kvf_pt_rkey *k, uint64_t remote_addr, void *local, size_t len,
                      kvf_pt_get_done done, void *arg) {
  if (!c->ep || c->failed || c->closing) return kvf_fail(KVF_ERR_DISCONNECTED, "peer transport: the connection failed");
  if (k->mapped && (remote_addr < k->base || len > k->size || remote_addr - k->base > k->size - len))
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "peer transport: a get of %zu bytes at %llx, outside the region its "
                    "key maps", len, (unsigned long long)remote_addr);
  pt_get *g = calloc(1, sizeof(*g));
  if (!g) return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "peer transport: out of memory");
  g->conn = c;
  g->done = done;
  g->arg = arg;
  if (k->mapped) {
    /* What UCX's sysv get would do, bounded: one copy from the mapping. */
    memcpy(local, k->mapped + (remote_addr - k->base), len);
    g->status = KVF_SUCCESS;
    g->done_next = c->t->done_head;
    c->t->done_head = g;
    return KVF_SUCCESS;
  }
  ucp_request_param_t p;
  memset(&p, 0, sizeof(p));
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  p.cb.send = on_get_done;
  p.user_data = g;
  ucs_status_ptr_t r = ucp_get_nbx(k->ep, local, len, remote_addr, k->rkey, &p);
  if (r == NULL) {
    g->status = KVF_SUCCESS;
    g->done_next = c->t->done_head;
    c->t->done_head = g;
    return KVF_SUCCESS;
  }
  if (UCS_PTR_IS_ERR(r)) {
    free(g);
    return kvf_fail(KVF_ERR_DISCONNECTED, "peer transport: get: %s", ucs_status_string(UCS_PTR_STATUS(r)));
  }
  g->next = c->gets;
  if (c->gets) c->gets->prev = g;
  c->gets = g;
  return KVF_SUCCESS;
}

int kvf_pt_progress(kvf_pt *t) {
  int any = 0;
  while (ucp_worker_progress(t->worker)) any = 1;
  while (t->done_head) {
    pt_get *g = t->done_head;
    t->done_head = g->done_next;
    g->done(g->arg, g->status);
    free(g);
    any = 1;
  }
  if (t->failures_pending) {
    t->failures_pending = 0;
    for (kvf_pt_conn *c = t->conns; c; c = c->next)
      if (c->failed && !c->reported && !c->closing) {
        c->reported = 1;
        t->cb.on_error(t->cb.ctx, c, KVF_ERR_DISCONNECTED, c->why);
        any = 1;
        /* on_error may not close c (closing is the caller's, outside callbacks). */
      }
  }
  char buf[64];
  while (read(t->wake[0], buf, sizeof(buf)) > 0) any = 1;
  return any;
}

void kvf_pt_wait(kvf_pt *t, int timeout_ms) {
  if (t->done_head || t->failures_pending) return;
  ucs_status_t s = ucp_worker_arm(t->worker);
  if (s == UCS_ERR_BUSY) return; /* events are waiting */
  struct pollfd p[2] = {{t->efd, POLLIN, 0}, {t->wake[0], POLLIN, 0}};
  (void)poll(p, 2, s == UCS_OK ? timeout_ms : (timeout_ms < 1 ? timeout_ms : 1));
}

void kvf_pt_signal(kvf_pt *t) {
  char b = 1;
  ssize_t n = write(t->wake[1], &b, 1);
  (void)n;
}
