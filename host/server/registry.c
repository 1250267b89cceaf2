/*
 * The server's registration lifecycle over the import table: clients,
 * registrations (registering -> active -> draining -> closed, failed),
 * leases, heartbeats and the reaper, a bounded completion table, counters.
 * See host/registry.h and DESIGN.md §8.
 *
 * Locking: one mutex (r->lock) guards every client record and registration
 * field except the state, which is also mirrored in an atomic so accessors
 * can read it without the lock. Import-table calls (register, unregister)
 * never run under r->lock: a registration is "claimed" (unmapping = 1) under
 * the lock, unmapped outside it, and finished under it again, so exactly one
 * thread unmaps a registration and nobody frees it meanwhile. The completion
 * table has its own mutex (r->comp_lock); the two are never held together.
 */
#define _GNU_SOURCE
#include "host/server/registry.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/clock.h"
#include "common/error.h"
#include "common/versioned.h"
#include "host/core/log.h"

#define KVF_REGISTRY_DEFAULT_COMPLETIONS 4096u

struct kvf_reg_client;

struct kvf_registry_reg {
  struct kvf_reg_client *client; /* fixed at begin */
  uint64_t id;                   /* fixed at begin */
  _Atomic int state;             /* kvf_registry_state; written under r->lock */
  kvf_import_reg *ireg;          /* set at commit (under r->lock), fixed afterwards */
  uint64_t leases;               /* r->lock */
  int unmapping;                 /* r->lock: a thread is running the unmap (outside the lock) */
  int unmap_failed;              /* r->lock: the last unmap failed; retried by a later sweep */
  uint64_t pass;                 /* r->lock: the last sweep that tried it (a sweep tries each once) */
  struct kvf_registry_reg *next; /* r->lock: the client's draining list */
};

typedef struct kvf_reg_client {
  uint64_t id;
  uint64_t last_seen_ns;      /* last heartbeat */
  int closed;                 /* disconnected or reaped: no new registrations or leases */
  kvf_registry_reg *active;   /* the registration that serves, or NULL */
  kvf_registry_reg *attempt;  /* the attempt in progress, or NULL */
  kvf_registry_reg *draining; /* draining registrations, newest first */
  uint64_t leases_total, leases_refused_total, closed_total, failed_total;
} kvf_reg_client;

typedef struct kvf_completion {
  uint64_t client, request_id;
  kvf_registry_outcome outcome;
  int32_t next; /* next slot in the same bucket, or -1 */
  int used;
} kvf_completion;

struct kvf_registry {
  kvf_import_table *table; /* not owned; internally serialized */

  /* Guards clients[] and every kvf_reg_client, every kvf_registry_reg field
   * but the fixed ones, next_id, pass and the registry totals below. */
  pthread_mutex_t lock;
  /* Broadcast (holding lock) when a lease count reaches zero or an unmap
   * finishes; wait_idle waits on it. Uses CLOCK_MONOTONIC. */
  pthread_cond_t idle;
  kvf_reg_client **clients;
  size_t num_clients, cap_clients;
  uint64_t next_id, pass;
  uint64_t leases_total, leases_refused_total, closed_total, failed_total, reaped_total;

  /* Guards the completion table: slots, buckets, head, count and its totals. */
  pthread_mutex_t comp_lock;
  kvf_completion *slots;   /* comp_cap slots filled in FIFO order, so the oldest is slots[head] */
  int32_t *buckets;        /* first slot of each hash bucket, or -1 */
  uint32_t comp_cap, comp_mask, head, count;
  uint64_t comp_duplicate_total, comp_evicted_total;
};

/* ---- helpers ---------------------------------------------------------------- */

static void set_state(kvf_registry_reg *e, kvf_registry_state s) {
  atomic_store_explicit(&e->state, (int)s, memory_order_release);
}

static kvf_reg_client *find_client(kvf_registry *r, uint64_t id) {
  for (size_t i = 0; i < r->num_clients; i++)
    if (r->clients[i]->id == id) return r->clients[i];
  return NULL;
}

/* Under r->lock: the client, created (open, heartbeat now) if unknown. */
static kvf_status get_or_open_client(kvf_registry *r, uint64_t id, uint64_t now_ns, kvf_reg_client **out) {
  kvf_reg_client *c = find_client(r, id);
  if (c != NULL) {
    *out = c;
    return KVF_SUCCESS;
  }
  if (r->num_clients == r->cap_clients) {
    size_t cap = r->cap_clients ? r->cap_clients * 2 : 8;
    kvf_reg_client **grown = realloc(r->clients, cap * sizeof *grown);
    if (grown == NULL) return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "registry: no memory for client %" PRIu64, id);
    r->clients = grown;
    r->cap_clients = cap;
  }
  c = calloc(1, sizeof *c);
  if (c == NULL) return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "registry: no memory for client %" PRIu64, id);
  c->id = id;
  c->last_seen_ns = now_ns;
  r->clients[r->num_clients++] = c;
  *out = c;
  return KVF_SUCCESS;
}

/* Under r->lock: free a closed client that holds nothing any more. */
static void maybe_free_client(kvf_registry *r, kvf_reg_client *c) {
  if (!c->closed || c->active != NULL || c->attempt != NULL || c->draining != NULL) return;
  for (size_t i = 0; i < r->num_clients; i++)
    if (r->clients[i] == c) {
      r->clients[i] = r->clients[--r->num_clients];
      break;
    }
  free(c);
}

/* Under r->lock: move a registration (active, or just committed) to draining. */
static void drain_locked(kvf_registry_reg *e) {
  kvf_reg_client *c = e->client;
  if (c->active == e) c->active = NULL;
  set_state(e, KVF_REGISTRY_DRAINING);
  e->next = c->draining;
  c->draining = e;
}

/* Under r->lock: claim e for unmapping if it drains, holds no lease and no
 * other thread is unmapping it. */
static int claim_locked(kvf_registry_reg *e) {
  if (atomic_load_explicit(&e->state, memory_order_relaxed) != KVF_REGISTRY_DRAINING) return 0;
  if (e->leases != 0 || e->unmapping) return 0;
  e->unmapping = 1;
  return 1;
}

/* Called holding r->lock with e claimed: unmap outside the lock, then finish.
 * On success e (and maybe its client) is freed. Returns the unmap's status. */
static kvf_status unmap_claimed_locked(kvf_registry *r, kvf_registry_reg *e) {
  kvf_reg_client *c = e->client;
  uint64_t client_id = c->id, reg_id = e->id;
  pthread_mutex_unlock(&r->lock);
  /* Nobody else touches e meanwhile: it holds no lease, refuses new ones,
   * and unmapping = 1 keeps every other sweep off it. */
  kvf_status st = kvf_import_table_unregister(r->table, e->ireg);
  pthread_mutex_lock(&r->lock);
  e->unmapping = 0;
  if (st == KVF_SUCCESS) {
    for (kvf_registry_reg **p = &c->draining; *p != NULL; p = &(*p)->next)
      if (*p == e) {
        *p = e->next;
        break;
      }
    set_state(e, KVF_REGISTRY_CLOSED);
    c->closed_total++;
    r->closed_total++;
    free(e);
    KVF_INFO(SERVER, "registry: client %" PRIu64 " registration %" PRIu64 " unmapped", client_id, reg_id);
    maybe_free_client(r, c);
  } else {
    e->unmap_failed = 1;
    KVF_WARN(SERVER, "registry: client %" PRIu64 " registration %" PRIu64 " unmap failed (%s), left draining for a retry",
             client_id, reg_id, kvf_status_string(st));
  }
  pthread_cond_broadcast(&r->idle);
  return st;
}

/* Under r->lock: unmap every claimable draining registration of the client
 * (each tried once). Returns KVF_SUCCESS when nothing of it is left
 * draining, else the first unmap failure, else KVF_ERR_BUSY (leased, or
 * another thread unmaps). The client may be freed. */
static kvf_status sweep_client_locked(kvf_registry *r, uint64_t client_id) {
  uint64_t pass = ++r->pass;
  kvf_status first = KVF_SUCCESS;
  for (;;) {
    kvf_reg_client *c = find_client(r, client_id);
    if (c == NULL) break;
    kvf_registry_reg *e = c->draining;
    while (e != NULL && (e->pass == pass || !claim_locked(e))) e = e->next;
    if (e == NULL) {
      if (first == KVF_SUCCESS && c->draining != NULL) {
        /* Left: leased ones (unmapped on their last release) or another
         * thread's unmap in progress. */
        first = kvf_fail(KVF_ERR_BUSY, "registry: client %" PRIu64 " still holds leases or is being unmapped",
                         client_id);
      }
      break;
    }
    e->pass = pass;
    kvf_status st = unmap_claimed_locked(r, e);
    if (st != KVF_SUCCESS && first == KVF_SUCCESS) first = st;
  }
  return first;
}

/* Under r->lock: unmap every claimable draining registration of every client
 * (each tried once). Returns the first unmap failure (leases are no failure). */
static kvf_status sweep_all_locked(kvf_registry *r) {
  uint64_t pass = ++r->pass;
  kvf_status first = KVF_SUCCESS;
  for (;;) {
    kvf_registry_reg *found = NULL;
    for (size_t i = 0; i < r->num_clients && found == NULL; i++)
      for (kvf_registry_reg *e = r->clients[i]->draining; e != NULL; e = e->next)
        if (e->pass != pass && claim_locked(e)) {
          found = e;
          break;
        }
    if (found == NULL) break;
    found->pass = pass;
    kvf_status st = unmap_claimed_locked(r, found);
    if (st != KVF_SUCCESS && first == KVF_SUCCESS) first = st;
  }
  return first;
}

/* ---- create / destroy ------------------------------------------------------- */

kvf_status kvf_registry_create(kvf_import_table *table, const kvf_registry_options *options,
                               kvf_registry **out) {
  if (out == NULL) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "registry: 'out' is NULL");
  *out = NULL;
  if (table == NULL) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "registry: 'table' is NULL");
  uint32_t cap = KVF_REGISTRY_DEFAULT_COMPLETIONS;
  if (options != NULL) {
    kvf_registry_options opt = KVF_REGISTRY_OPTIONS_INIT;
    kvf_status vs = KVF_VERSIONED_IN(kvf_registry_options, &opt, options);
    if (vs != KVF_SUCCESS) return vs;
    if (opt.completion_capacity > (1u << 24))
      return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "registry: 'completion_capacity' %u is over 2^24",
                      opt.completion_capacity);
    if (opt.completion_capacity != 0) cap = opt.completion_capacity;
  }
  kvf_status st = KVF_SUCCESS;
  pthread_condattr_t ca;
  int have_lock = 0, have_cond = 0, have_comp = 0, have_ca = 0;
  kvf_registry *r = calloc(1, sizeof *r);
  if (r == NULL) {
    st = kvf_fail(KVF_ERR_OUT_OF_MEMORY, "registry: no memory");
    goto out;
  }
  r->table = table;
  uint32_t nb = 1;
  while (nb < 2 * cap) nb <<= 1; /* load factor at most 1/2 */
  r->slots = calloc(cap, sizeof *r->slots);
  r->buckets = malloc(nb * sizeof *r->buckets);
  if (r->slots == NULL || r->buckets == NULL) {
    st = kvf_fail(KVF_ERR_OUT_OF_MEMORY, "registry: no memory for %u completions", cap);
    goto out;
  }
  for (uint32_t i = 0; i < nb; i++) r->buckets[i] = -1;
  r->comp_cap = cap;
  r->comp_mask = nb - 1;
  int err = pthread_mutex_init(&r->lock, NULL);
  have_lock = err == 0;
  if (err == 0) {
    err = pthread_condattr_init(&ca);
    have_ca = err == 0;
  }
  if (err == 0) err = pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  if (err == 0) {
    err = pthread_cond_init(&r->idle, &ca);
    have_cond = err == 0;
  }
  if (err == 0) {
    err = pthread_mutex_init(&r->comp_lock, NULL);
    have_comp = err == 0;
  }
  if (err != 0) {
    st = kvf_fail(KVF_ERR_SYSTEM, "registry: pthread init: %s", strerror(err));
    goto out;
  }
  *out = r;
  r = NULL;
out:
  if (have_ca) pthread_condattr_destroy(&ca);
  if (r != NULL) {
    if (have_comp) pthread_mutex_destroy(&r->comp_lock);
    if (have_cond) pthread_cond_destroy(&r->idle);
    if (have_lock) pthread_mutex_destroy(&r->lock);
    free(r->slots);
    free(r->buckets);
    free(r);
  }
  return st;
}

void kvf_registry_destroy(kvf_registry *r) {
  if (r == NULL) return;
  pthread_mutex_lock(&r->lock);
  for (size_t i = 0; i < r->num_clients; i++) {
    kvf_reg_client *c = r->clients[i];
    c->closed = 1;
    if (c->active != NULL) drain_locked(c->active);
  }
  (void)sweep_all_locked(r); /* failures are logged there */
  for (size_t i = 0; i < r->num_clients; i++) {
    kvf_reg_client *c = r->clients[i];
    kvf_registry_reg *e = c->draining;
    while (e != NULL) {
      kvf_registry_reg *next = e->next;
      if (e->leases != 0)
        KVF_WARN(SERVER, "registry destroyed with %" PRIu64 " leases held on client %" PRIu64
                         " registration %" PRIu64 ": left to the import table",
                 e->leases, c->id, e->id);
      free(e);
      e = next;
    }
    if (c->attempt != NULL) {
      KVF_WARN(SERVER, "registry destroyed during an attempt of client %" PRIu64, c->id);
      free(c->attempt);
    }
    free(c);
  }
  pthread_mutex_unlock(&r->lock);
  free(r->clients);
  free(r->slots);
  free(r->buckets);
  pthread_mutex_destroy(&r->comp_lock);
  pthread_cond_destroy(&r->idle);
  pthread_mutex_destroy(&r->lock);
  free(r);
}

/* ---- clients ---------------------------------------------------------------- */

kvf_status kvf_registry_client_open(kvf_registry *r, uint64_t client, uint64_t now_ns) {
  if (r == NULL) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "registry: 'r' is NULL");
  kvf_reg_client *c = NULL;
  pthread_mutex_lock(&r->lock);
  kvf_status st = get_or_open_client(r, client, now_ns, &c);
  if (st == KVF_SUCCESS) {
    if (c->closed)
      st = kvf_fail(KVF_ERR_STATE, "registry: client %" PRIu64 " is closed and still draining", client);
    else
      c->last_seen_ns = now_ns;
  }
  pthread_mutex_unlock(&r->lock);
  return st;
}

kvf_status kvf_registry_heartbeat(kvf_registry *r, uint64_t client, uint64_t now_ns) {
  if (r == NULL) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "registry: 'r' is NULL");
  kvf_status st = KVF_SUCCESS;
  pthread_mutex_lock(&r->lock);
  kvf_reg_client *c = find_client(r, client);
  if (c == NULL)
    st = kvf_fail(KVF_ERR_NOT_FOUND, "registry: heartbeat from unknown client %" PRIu64, client);
  else if (c->closed)
    st = kvf_fail(KVF_ERR_STATE, "registry: heartbeat from closed client %" PRIu64, client);
  else if (now_ns > c->last_seen_ns)
    c->last_seen_ns = now_ns;
  pthread_mutex_unlock(&r->lock);
  return st;
}

/* Under r->lock: close c (no new registrations or leases; drain the active one). */
static void close_client_locked(kvf_reg_client *c) {
  c->closed = 1;
  if (c->active != NULL) drain_locked(c->active);
}

kvf_status kvf_registry_client_close(kvf_registry *r, uint64_t client) {
  if (r == NULL) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "registry: 'r' is NULL");
  kvf_status st = KVF_SUCCESS;
  pthread_mutex_lock(&r->lock);
  kvf_reg_client *c = find_client(r, client);
  if (c != NULL) {
    close_client_locked(c);
    st = sweep_client_locked(r, client);
    c = find_client(r, client);
    if (c != NULL) maybe_free_client(r, c);
  }
  pthread_mutex_unlock(&r->lock);
  return st;
}

kvf_status kvf_registry_reap(kvf_registry *r, uint64_t now_ns, uint64_t timeout_ns, uint32_t *reaped) {
  if (reaped != NULL) *reaped = 0;
  if (r == NULL) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "registry: 'r' is NULL");
  uint32_t n = 0;
  pthread_mutex_lock(&r->lock);
  for (size_t i = 0; i < r->num_clients; i++) {
    kvf_reg_client *c = r->clients[i];
    if (c->closed || now_ns <= c->last_seen_ns || now_ns - c->last_seen_ns <= timeout_ns) continue;
    KVF_WARN(SERVER, "registry: client %" PRIu64 " silent for %" PRIu64 " ms: reaped", c->id,
             (now_ns - c->last_seen_ns) / 1000000u);
    close_client_locked(c);
    r->reaped_total++;
    n++;
  }
  kvf_status st = sweep_all_locked(r);
  /* Closed clients with nothing left go now (those with leases go from the
   * last release's unmap). */
  for (size_t i = 0; i < r->num_clients;) {
    kvf_reg_client *c = r->clients[i];
    size_t before = r->num_clients;
    maybe_free_client(r, c);
    if (r->num_clients == before) i++;
  }
  pthread_mutex_unlock(&r->lock);
  if (reaped != NULL) *reaped = n;
  return st;
}

/* ---- registration ----------------------------------------------------------- */

kvf_status kvf_registry_register_begin(kvf_registry *r, uint64_t client, uint64_t now_ns,
                                       kvf_registry_reg **attempt) {
  if (attempt != NULL) *attempt = NULL;
  if (r == NULL || attempt == NULL)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "registry: '%s' is NULL", r == NULL ? "r" : "attempt");
  kvf_reg_client *c = NULL;
  pthread_mutex_lock(&r->lock);
  kvf_status st = get_or_open_client(r, client, now_ns, &c);
  if (st != KVF_SUCCESS) goto out;
  if (c->closed) {
    st = kvf_fail(KVF_ERR_STATE, "registry: client %" PRIu64 " is closed: register with a new connection", client);
    goto out;
  }
  if (c->attempt != NULL) {
    st = kvf_fail(KVF_ERR_BUSY, "registry: client %" PRIu64 " already has a registration in progress", client);
    goto out;
  }
  kvf_registry_reg *e = calloc(1, sizeof *e);
  if (e == NULL) {
    st = kvf_fail(KVF_ERR_OUT_OF_MEMORY, "registry: no memory for a registration");
    goto out;
  }
  e->client = c;
  e->id = ++r->next_id;
  set_state(e, KVF_REGISTRY_REGISTERING);
  c->attempt = e;
  *attempt = e;
out:
  pthread_mutex_unlock(&r->lock);
  return st;
}

/* Under r->lock: roll an attempt back (failed) and free it. */
static void fail_attempt_locked(kvf_registry *r, kvf_registry_reg *e) {
  kvf_reg_client *c = e->client;
  c->attempt = NULL;
  set_state(e, KVF_REGISTRY_FAILED);
  c->failed_total++;
  r->failed_total++;
  free(e);
  maybe_free_client(r, c);
}

/* Under r->lock: whether e is c's attempt in progress. */
static int is_attempt_locked(const kvf_registry_reg *e) {
  return atomic_load_explicit(&e->state, memory_order_relaxed) == KVF_REGISTRY_REGISTERING &&
         e->client->attempt == e;
}

kvf_status kvf_registry_register_commit(kvf_registry *r, kvf_registry_reg *attempt,
                                        const kvf_import_view *views, uint32_t num_views) {
  return kvf_registry_register_commit_ex(r, attempt, 0, views, num_views, NULL);
}

kvf_status kvf_registry_register_commit_ex(kvf_registry *r, kvf_registry_reg *attempt, uint64_t account,
                                           const kvf_import_view *views, uint32_t num_views, kvf_import_fault *fault) {
  if (r == NULL || attempt == NULL)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "registry: '%s' is NULL", r == NULL ? "r" : "attempt");
  pthread_mutex_lock(&r->lock);
  int ok = is_attempt_locked(attempt);
  uint64_t client = attempt->client->id;
  pthread_mutex_unlock(&r->lock);
  if (!ok) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "registry: 'attempt' is not a registration in progress");

  /* Outside the lock: mapping may be slow, and the attempt is ours alone
   * (only commit or abort finish it, and the caller calls one). */
  kvf_import_reg *ireg = NULL;
  kvf_status st = kvf_import_table_register_ex(r->table, client, account, views, num_views, &ireg, fault);

  pthread_mutex_lock(&r->lock);
  kvf_reg_client *c = attempt->client;
  if (st != KVF_SUCCESS) {
    KVF_INFO(SERVER, "registry: client %" PRIu64 " registration %" PRIu64 " failed (%s); the previous one stays",
             client, attempt->id, kvf_status_string(st));
    fail_attempt_locked(r, attempt);
    pthread_mutex_unlock(&r->lock);
    return st;
  }
  attempt->ireg = ireg;
  c->attempt = NULL;
  kvf_registry_reg *retire;
  if (c->closed) {
    /* Reaped or disconnected while mapping: this one never serves. */
    set_state(attempt, KVF_REGISTRY_ACTIVE);
    drain_locked(attempt);
    retire = attempt;
    st = kvf_fail(KVF_ERR_STATE, "registry: client %" PRIu64 " was closed during its registration", client);
  } else {
    retire = c->active;
    if (retire != NULL) drain_locked(retire);
    c->active = attempt;
    set_state(attempt, KVF_REGISTRY_ACTIVE);
    KVF_INFO(SERVER, "registry: client %" PRIu64 " registration %" PRIu64 " active", client, attempt->id);
  }
  if (retire != NULL && claim_locked(retire)) {
    kvf_status ust = unmap_claimed_locked(r, retire); /* logged there; collect retries */
    (void)ust;
    if (st != KVF_SUCCESS) /* keep the commit's message on top */
      kvf_fail(st, "registry: client %" PRIu64 " was closed during its registration", client);
  }
  pthread_mutex_unlock(&r->lock);
  return st;
}

kvf_status kvf_registry_register_abort(kvf_registry *r, kvf_registry_reg *attempt) {
  if (r == NULL || attempt == NULL)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "registry: '%s' is NULL", r == NULL ? "r" : "attempt");
  kvf_status st = KVF_SUCCESS;
  pthread_mutex_lock(&r->lock);
  if (!is_attempt_locked(attempt))
    st = kvf_fail(KVF_ERR_INVALID_ARGUMENT, "registry: 'attempt' is not a registration in progress");
  else
    fail_attempt_locked(r, attempt);
  pthread_mutex_unlock(&r->lock);
  return st;
}

kvf_status kvf_registry_unregister(kvf_registry *r, uint64_t client) {
  if (r == NULL) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "registry: 'r' is NULL");
  kvf_status st = KVF_SUCCESS;
  pthread_mutex_lock(&r->lock);
  kvf_reg_client *c = find_client(r, client);
  if (c != NULL) {
    if (c->active != NULL) drain_locked(c->active);
    st = sweep_client_locked(r, client);
  }
  pthread_mutex_unlock(&r->lock);
  return st;
}

kvf_status kvf_registry_collect(kvf_registry *r) {
  if (r == NULL) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "registry: 'r' is NULL");
  pthread_mutex_lock(&r->lock);
  kvf_status st = sweep_all_locked(r);
  pthread_mutex_unlock(&r->lock);
  kvf_status tst = kvf_import_table_collect(r->table);
  return st != KVF_SUCCESS ? st : tst;
}

/* ---- leases ----------------------------------------------------------------- */

kvf_status kvf_registry_lease_acquire(kvf_registry *r, uint64_t client, kvf_registry_reg **out) {
  if (out != NULL) *out = NULL;
  if (r == NULL || out == NULL)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "registry: '%s' is NULL", r == NULL ? "r" : "out");
  kvf_status st = KVF_SUCCESS;
  pthread_mutex_lock(&r->lock);
  kvf_reg_client *c = find_client(r, client);
  if (c == NULL) {
    st = kvf_fail(KVF_ERR_NOT_FOUND, "registry: lease for unknown client %" PRIu64, client);
  } else if (c->active == NULL) {
    c->leases_refused_total++;
    r->leases_refused_total++;
    st = kvf_fail(KVF_ERR_STATE, "registry: client %" PRIu64 " has no active registration (%s)", client,
                  c->closed ? "closed" : c->draining != NULL ? "draining" : "none yet");
  } else {
    kvf_registry_reg *e = c->active;
    e->leases++;
    c->leases_total++;
    r->leases_total++;
    *out = e;
  }
  pthread_mutex_unlock(&r->lock);
  return st;
}

kvf_status kvf_registry_lease_release(kvf_registry *r, kvf_registry_reg *reg) {
  if (r == NULL || reg == NULL)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "registry: '%s' is NULL", r == NULL ? "r" : "reg");
  kvf_status st = KVF_SUCCESS;
  pthread_mutex_lock(&r->lock);
  if (reg->leases == 0) {
    st = kvf_fail(KVF_ERR_STATE, "registry: registration %" PRIu64 " holds no lease (released twice?)", reg->id);
  } else if (--reg->leases == 0) {
    pthread_cond_broadcast(&r->idle);
    if (claim_locked(reg)) st = unmap_claimed_locked(r, reg); /* the last lease of a draining one */
  }
  pthread_mutex_unlock(&r->lock);
  return st;
}

/* Under r->lock: whether c holds a lease or is being unmapped. */
static int client_busy_locked(const kvf_reg_client *c) {
  if (c->active != NULL && c->active->leases != 0) return 1;
  for (const kvf_registry_reg *e = c->draining; e != NULL; e = e->next)
    if (e->leases != 0 || e->unmapping) return 1;
  return 0;
}

kvf_status kvf_registry_wait_idle(kvf_registry *r, uint64_t client, uint32_t timeout_ms) {
  if (r == NULL) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "registry: 'r' is NULL");
  struct timespec deadline = kvf_timespec_ms(kvf_now_ms() + (int64_t)timeout_ms);
  kvf_status st = KVF_SUCCESS;
  int first = 1;
  pthread_mutex_lock(&r->lock);
  for (;;) {
    kvf_reg_client *c = find_client(r, client);
    if (c == NULL) {
      if (first) st = kvf_fail(KVF_ERR_NOT_FOUND, "registry: wait for unknown client %" PRIu64, client);
      break; /* gone since: everything of it was unmapped */
    }
    first = 0;
    if (!client_busy_locked(c)) break;
    int err = pthread_cond_timedwait(&r->idle, &r->lock, &deadline);
    if (err == ETIMEDOUT) {
      c = find_client(r, client);
      if (c != NULL && client_busy_locked(c))
        st = kvf_fail(KVF_ERR_TIMEOUT, "registry: client %" PRIu64 " still holds leases after %u ms", client,
                      timeout_ms);
      break;
    }
  }
  pthread_mutex_unlock(&r->lock);
  return st;
}

const kvf_import_reg *kvf_registry_reg_import(const kvf_registry_reg *reg) {
  /* Set at commit before the registration became active; a lease holder
   * got the pointer through r->lock afterwards, so no race. */
  return reg == NULL ? NULL : reg->ireg;
}

kvf_registry_state kvf_registry_reg_state(const kvf_registry_reg *reg) {
  if (reg == NULL) return KVF_REGISTRY_FAILED;
  return (kvf_registry_state)atomic_load_explicit(&((kvf_registry_reg *)reg)->state, memory_order_acquire);
}

uint64_t kvf_registry_reg_id(const kvf_registry_reg *reg) { return reg == NULL ? 0 : reg->id; }

uint64_t kvf_registry_active_id(kvf_registry *r, uint64_t client) {
  if (r == NULL) return 0;
  pthread_mutex_lock(&r->lock);
  kvf_reg_client *c = find_client(r, client);
  uint64_t id = c != NULL && c->active != NULL ? c->active->id : 0;
  pthread_mutex_unlock(&r->lock);
  return id;
}

int kvf_registry_draining_upto(kvf_registry *r, uint64_t client, uint64_t id) {
  if (r == NULL) return 0;
  int draining = 0;
  pthread_mutex_lock(&r->lock);
  kvf_reg_client *c = find_client(r, client);
  for (const kvf_registry_reg *e = c != NULL ? c->draining : NULL; e != NULL && !draining; e = e->next)
    draining = e->id <= id;
  pthread_mutex_unlock(&r->lock);
  return draining;
}

/* ---- completions ------------------------------------------------------------ */

static uint32_t comp_hash(const kvf_registry *r, uint64_t client, uint64_t request_id) {
  uint64_t x = client * 0x9E3779B97F4A7C15ull ^ (request_id + 0x632BE59BD9B4E019ull);
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 29;
  return (uint32_t)x & r->comp_mask;
}

/* Under comp_lock: the slot of (client, request_id), or -1. */
static int32_t comp_find(const kvf_registry *r, uint64_t client, uint64_t request_id) {
  for (int32_t i = r->buckets[comp_hash(r, client, request_id)]; i >= 0; i = r->slots[i].next)
    if (r->slots[i].client == client && r->slots[i].request_id == request_id) return i;
  return -1;
}

kvf_status kvf_registry_completion_record(kvf_registry *r, uint64_t client, uint64_t request_id,
                                          const kvf_registry_outcome *outcome, int *duplicate) {
  if (duplicate != NULL) *duplicate = 0;
  if (r == NULL || outcome == NULL)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "registry: '%s' is NULL", r == NULL ? "r" : "outcome");
  if (outcome->kind < KVF_OUTCOME_DONE || outcome->kind > KVF_OUTCOME_TIMED_OUT)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "registry: outcome 'kind' %u is unknown", outcome->kind);
  pthread_mutex_lock(&r->comp_lock);
  if (comp_find(r, client, request_id) >= 0) {
    r->comp_duplicate_total++;
    if (duplicate != NULL) *duplicate = 1;
    pthread_mutex_unlock(&r->comp_lock);
    KVF_INFO(SERVER, "registry: duplicate completion of client %" PRIu64 " request %" PRIu64 " ignored", client,
             request_id);
    return KVF_SUCCESS;
  }
  int32_t s = (int32_t)r->head;
  kvf_completion *slot = &r->slots[s];
  if (slot->used) { /* the oldest: unlink it from its bucket */
    int32_t *p = &r->buckets[comp_hash(r, slot->client, slot->request_id)];
    while (*p != s) p = &r->slots[*p].next;
    *p = slot->next;
    r->comp_evicted_total++;
  } else {
    r->count++;
  }
  uint32_t b = comp_hash(r, client, request_id);
  slot->client = client;
  slot->request_id = request_id;
  slot->outcome = *outcome;
  slot->used = 1;
  slot->next = r->buckets[b];
  r->buckets[b] = s;
  r->head = (r->head + 1) % r->comp_cap;
  pthread_mutex_unlock(&r->comp_lock);
  return KVF_SUCCESS;
}

kvf_status kvf_registry_completion_lookup(kvf_registry *r, uint64_t client, uint64_t request_id,
                                          kvf_registry_outcome *out) {
  if (r == NULL || out == NULL)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "registry: '%s' is NULL", r == NULL ? "r" : "out");
  kvf_status st = KVF_SUCCESS;
  pthread_mutex_lock(&r->comp_lock);
  int32_t i = comp_find(r, client, request_id);
  if (i >= 0)
    *out = r->slots[i].outcome;
  else
    st = kvf_fail(KVF_ERR_NOT_FOUND, "registry: no completion recorded for client %" PRIu64 " request %" PRIu64,
                  client, request_id);
  pthread_mutex_unlock(&r->comp_lock);
  return st;
}

/* ---- STAT ------------------------------------------------------------------- */

static kvf_status check_stats(const kvf_registry *r, const kvf_registry_stats *out) {
  if (r == NULL || out == NULL)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "registry: '%s' is NULL", r == NULL ? "r" : "out");
  return KVF_VERSIONED_CHECK(kvf_registry_stats, out);
}

/* Under r->lock: add c's current counts to out. */
static void add_client_counts(const kvf_reg_client *c, kvf_registry_stats *out) {
  out->clients_closed += c->closed ? 1 : 0;
  out->registering += c->attempt != NULL ? 1 : 0;
  if (c->active != NULL) {
    out->active++;
    out->leases += c->active->leases;
  }
  for (const kvf_registry_reg *e = c->draining; e != NULL; e = e->next) {
    out->draining++;
    out->leases += e->leases;
    if (e->leases == 0 && e->unmap_failed && !e->unmapping) out->unmap_pending++;
  }
}

kvf_status kvf_registry_stats_get(kvf_registry *r, kvf_registry_stats *caller) {
  kvf_status st = check_stats(r, caller);
  if (st != KVF_SUCCESS) return st;
  kvf_registry_stats local = KVF_REGISTRY_STATS_INIT, *out = &local;
  pthread_mutex_lock(&r->lock);
  out->clients = r->num_clients;
  for (size_t i = 0; i < r->num_clients; i++) add_client_counts(r->clients[i], out);
  out->leases_total = r->leases_total;
  out->leases_refused_total = r->leases_refused_total;
  out->closed_total = r->closed_total;
  out->failed_total = r->failed_total;
  out->reaped_total = r->reaped_total;
  pthread_mutex_unlock(&r->lock);
  pthread_mutex_lock(&r->comp_lock);
  out->completions = r->count;
  out->completions_duplicate_total = r->comp_duplicate_total;
  out->completions_evicted_total = r->comp_evicted_total;
  pthread_mutex_unlock(&r->comp_lock);
  /* Outside both locks (the table has its own): imports and aliases may be
   * a moment apart from the counts above. */
  kvf_import_stats is = KVF_IMPORT_STATS_INIT;
  st = kvf_import_table_stats(r->table, &is);
  if (st != KVF_SUCCESS) return st;
  out->imports = is.imports;
  out->aliases = is.aliases;
  return KVF_VERSIONED_OUT(kvf_registry_stats, caller, &local);
}

kvf_status kvf_registry_client_stats(kvf_registry *r, uint64_t client, kvf_registry_stats *caller) {
  kvf_status st = check_stats(r, caller);
  if (st != KVF_SUCCESS) return st;
  kvf_registry_stats local = KVF_REGISTRY_STATS_INIT, *out = &local;
  pthread_mutex_lock(&r->lock);
  kvf_reg_client *c = find_client(r, client);
  if (c != NULL) {
    add_client_counts(c, out);
    out->leases_total = c->leases_total;
    out->leases_refused_total = c->leases_refused_total;
    out->closed_total = c->closed_total;
    out->failed_total = c->failed_total;
  }
  pthread_mutex_unlock(&r->lock);
  kvf_import_stats is = KVF_IMPORT_STATS_INIT;
  st = kvf_import_table_client_stats(r->table, client, &is);
  if (st != KVF_SUCCESS) return st;
  out->imports = is.imports;
  out->aliases = is.aliases;
  /* An unknown client's counters are written too (all 0: registry.h). */
  (void)KVF_VERSIONED_OUT(kvf_registry_stats, caller, &local); /* checked above */
  if (c == NULL) return kvf_fail(KVF_ERR_NOT_FOUND, "registry: unknown client %" PRIu64, client);
  return KVF_SUCCESS;
}
