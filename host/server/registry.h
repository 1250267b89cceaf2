/*
 * Internal: the cache server's registration lifecycle (DESIGN.md §8), with no
 * sockets and no threads of its own, so kvferryd's connection and completion
 * threads call it and the tests drive it directly.
 *
 * A registry sits on top of an import table (kvferry/memory.h). It keeps, per
 * client (a connection id):
 *   - registrations: registering -> active -> draining -> closed, and failed
 *     for a rolled-back attempt. At most one registration of a client is
 *     active (the one that serves); one that was replaced, unregistered or
 *     reaped drains: it refuses new leases, and its import-table registration
 *     is unregistered (unmapped) only once its lease count is zero, at once or
 *     from the release of its last lease. A failed unmap leaves it draining
 *     (unmap pending) for a later unregister, reap or collect to retry: never
 *     a device synchronize, never a device reset;
 *   - leases: a store or retrieve holds one on the active registration from
 *     admission until its completion is proven;
 *   - a heartbeat time: the reaper closes clients silent past a timeout
 *     (close = drain every registration and refuse new ones);
 * and, for the whole registry, a bounded completion table keyed by
 * (client, request id), so a retried request is answered with its recorded
 * outcome and a duplicate completion is ignored.
 *
 * Registering again replaces the active registration only when the new one
 * fully succeeds: the import table's registration is all or nothing, and a
 * failed attempt leaves the previous registration active and leased as it was.
 *
 * Threading: every function is safe from any thread except create/destroy.
 * Lease acquire/release and lookups take one registry mutex for a few
 * instructions; import-table calls (map, unmap) run outside it, so a slow
 * unmap never blocks acquires of other clients. Time is passed in by the
 * caller (kvf_now_ns() of common/clock.h for the real clock), so tests can move it.
 */
#ifndef KVF_HOST_REGISTRY_H
#define KVF_HOST_REGISTRY_H

#include <stdint.h>

#include <kvferry/memory.h>
#include <kvferry/status.h>

#include "host/memory/import_table.h"

#ifdef __cplusplus
extern "C" {
#endif

#define KVF_REGISTRY_VERSION 1u

typedef struct kvf_registry kvf_registry;
/* One registration of a client. Handles come from register_begin (an
 * attempt, until commit or abort) and from lease_acquire (valid until the
 * matching release). */
typedef struct kvf_registry_reg kvf_registry_reg;

/* Registration states (DESIGN.md §8). Values are pinned (STAT reports them). */
typedef enum kvf_registry_state {
  KVF_REGISTRY_REGISTERING = 0, /* between register_begin and commit/abort */
  KVF_REGISTRY_ACTIVE = 1,      /* serving: leases granted */
  KVF_REGISTRY_DRAINING = 2,    /* no new leases; unmapped once its leases are gone */
  KVF_REGISTRY_CLOSED = 3,      /* unmapped (the handle is freed when it gets here) */
  KVF_REGISTRY_FAILED = 4,      /* a rolled-back attempt (freed at once) */
} kvf_registry_state;

typedef struct kvf_registry_options {
  uint32_t struct_size;
  uint32_t version;
  uint32_t completion_capacity; /* completions remembered; the oldest is evicted beyond it.
                                   0: 4096 */
} kvf_registry_options;
#define KVF_REGISTRY_OPTIONS_INIT {sizeof(kvf_registry_options), KVF_REGISTRY_VERSION, 0}

/* Create a registry over `table` (not owned: it must outlive the registry).
 * options may be NULL. Returns KVF_SUCCESS and *out; KVF_ERR_INVALID_ARGUMENT
 * (NULL table or out, bad options), KVF_ERR_OUT_OF_MEMORY, KVF_ERR_SYSTEM. */
kvf_status kvf_registry_create(kvf_import_table *table, const kvf_registry_options *options,
                               kvf_registry **out);

/* Unregister every registration that holds no lease (failures are logged and
 * left to the import table's destroy), and free the registry. Registrations
 * still leased are logged and left in the import table. NULL is a no-op.
 * Must not race any other call. */
void kvf_registry_destroy(kvf_registry *r);

/* ---- clients and heartbeats ---------------------------------------------- */

/* Make `client` known (a connection accepted) with its heartbeat at now_ns.
 * Opening a client that is already open only refreshes its heartbeat.
 * Returns KVF_SUCCESS; KVF_ERR_INVALID_ARGUMENT (NULL); KVF_ERR_STATE (the
 * client was closed and still drains: use a new id); KVF_ERR_OUT_OF_MEMORY. */
kvf_status kvf_registry_client_open(kvf_registry *r, uint64_t client, uint64_t now_ns);

/* Record a heartbeat of `client` at now_ns. Returns KVF_SUCCESS;
 * KVF_ERR_INVALID_ARGUMENT (NULL); KVF_ERR_NOT_FOUND (unknown client);
 * KVF_ERR_STATE (closed: reaped or disconnected). */
kvf_status kvf_registry_heartbeat(kvf_registry *r, uint64_t client, uint64_t now_ns);

/* Close `client` (disconnected, or dead): drain every registration of it,
 * unmap those without leases now, and refuse new registrations and leases.
 * Its record goes once its last registration is closed. Idempotent.
 * Returns KVF_SUCCESS (everything unmapped); KVF_ERR_BUSY (leases held, or
 * another thread is unmapping: the unmap follows the last release); an
 * unknown client is KVF_SUCCESS (nothing of it is mapped); an unmap's status (KVF_ERR_SYSTEM,
 * KVF_ERR_CUDA: the registration stays draining; call again or collect). */
kvf_status kvf_registry_client_close(kvf_registry *r, uint64_t client);

/* The reaper: close every open client whose last heartbeat is more than
 * timeout_ns before now_ns. *reaped (may be NULL) gets how many were closed
 * by this call. Returns KVF_SUCCESS, or the first unmap failure (every
 * silent client is still closed; retry with collect); KVF_ERR_BUSY is not a
 * failure here (leased registrations unmap on their last release). */
kvf_status kvf_registry_reap(kvf_registry *r, uint64_t now_ns, uint64_t timeout_ns, uint32_t *reaped);

/* ---- registration -------------------------------------------------------- */

/* Start registering for `client` (opened now if unknown): a registration in
 * state registering, returned in *attempt, to be finished by exactly one of
 * commit or abort. Returns KVF_SUCCESS; KVF_ERR_INVALID_ARGUMENT (NULL);
 * KVF_ERR_BUSY (an attempt of this client is already in progress);
 * KVF_ERR_STATE (the client is closed); KVF_ERR_OUT_OF_MEMORY. */
kvf_status kvf_registry_register_begin(kvf_registry *r, uint64_t client, uint64_t now_ns,
                                       kvf_registry_reg **attempt);

/* Register the views with the import table (all or nothing, outside the
 * registry lock; every descriptor in views is closed, as
 * kvf_import_table_register does) and finish the attempt. On success the
 * attempt becomes the client's active registration and the one it replaces
 * drains (unmapped now if it holds no lease; a failure of that unmap is
 * logged and left to collect: the commit still succeeds). On failure the
 * attempt is rolled back (failed, freed) and the previous registration stays
 * active, untouched. If the client was closed while the views were mapped,
 * the new registration is drained at once and KVF_ERR_STATE returned.
 * The attempt handle is invalid after this call whatever it returns.
 * Returns KVF_SUCCESS; KVF_ERR_INVALID_ARGUMENT (NULL, not an attempt);
 * KVF_ERR_STATE; any status of kvf_import_table_register. */
kvf_status kvf_registry_register_commit(kvf_registry *r, kvf_registry_reg *attempt,
                                        const kvf_import_view *views, uint32_t num_views);

/* kvf_registry_register_commit, with the import's quota account (0: the
 * client) and its fault (why a view was refused, or which quota,
 * host/memory/import_table.h) in *fault (may be NULL). */
kvf_status kvf_registry_register_commit_ex(kvf_registry *r, kvf_registry_reg *attempt, uint64_t account,
                                           const kvf_import_view *views, uint32_t num_views, kvf_import_fault *fault);

/* Give up an attempt before its views were registered (a bad frame, missing
 * descriptors): it becomes failed and is freed; the previous registration
 * stays active. Descriptors the caller received stay the caller's to close.
 * Returns KVF_SUCCESS; KVF_ERR_INVALID_ARGUMENT (NULL, not an attempt). */
kvf_status kvf_registry_register_abort(kvf_registry *r, kvf_registry_reg *attempt);

/* UNREGISTER: drain the client's active registration (if any) and retry the
 * unmap of every draining registration of it that holds no lease.
 * Idempotent and retryable: with nothing left it returns KVF_SUCCESS.
 * Returns KVF_SUCCESS (nothing of the client is mapped any more);
 * KVF_ERR_BUSY (leases held or an unmap in progress elsewhere: the unmap
 * follows the last release); an unmap's status (left draining: call again).
 * An unknown client is KVF_SUCCESS (nothing of it is mapped). */
kvf_status kvf_registry_unregister(kvf_registry *r, uint64_t client);

/* Retry every pending unmap (draining registrations with no lease whose
 * unmap failed) and the import table's own pending closes
 * (kvf_import_table_collect). Returns KVF_SUCCESS when none is left, else the
 * first failure (the rest are still tried); KVF_ERR_INVALID_ARGUMENT. */
kvf_status kvf_registry_collect(kvf_registry *r);

/* ---- leases -------------------------------------------------------------- */

/* Take a lease on the client's active registration: *out stays valid, and
 * its import-table registration mapped, until the matching release.
 * Returns KVF_SUCCESS; KVF_ERR_INVALID_ARGUMENT (NULL); KVF_ERR_NOT_FOUND
 * (unknown client); KVF_ERR_STATE (no active registration: none yet, or
 * draining: draining refuses new leases). */
kvf_status kvf_registry_lease_acquire(kvf_registry *r, uint64_t client, kvf_registry_reg **out);

/* Release a lease taken by lease_acquire. If it was the last lease of a
 * draining registration, that registration is unmapped by this call (outside
 * the lock); the lease is released whatever the unmap returns.
 * Returns KVF_SUCCESS; KVF_ERR_INVALID_ARGUMENT (NULL); KVF_ERR_STATE (the
 * registration holds no lease: a double release); an unmap's status (the
 * registration stays draining, unmap pending: collect or unregister retries). */
kvf_status kvf_registry_lease_release(kvf_registry *r, kvf_registry_reg *reg);

/* Wait until `client` holds no lease and nothing of it is being unmapped, or
 * timeout_ms passes. Returns KVF_SUCCESS; KVF_ERR_TIMEOUT (nothing is
 * released because of it); KVF_ERR_NOT_FOUND (unknown client: nothing to
 * wait for); KVF_ERR_INVALID_ARGUMENT. */
kvf_status kvf_registry_wait_idle(kvf_registry *r, uint64_t client, uint32_t timeout_ms);

/* The registration's import-table registration (for its views), valid while
 * a lease on it is held; NULL for NULL or an attempt. */
const kvf_import_reg *kvf_registry_reg_import(const kvf_registry_reg *reg);

/* The registration's state (read atomically); KVF_REGISTRY_FAILED for NULL. */
kvf_registry_state kvf_registry_reg_state(const kvf_registry_reg *reg);

/* The registration's id: unique within the registry, increasing with each
 * register_begin (0 for NULL). */
uint64_t kvf_registry_reg_id(const kvf_registry_reg *reg);

/* The client's active registration id, or 0 (none, unknown client). */
uint64_t kvf_registry_active_id(kvf_registry *r, uint64_t client);

/* Whether the client's registration `id`, or one older than it (ids only
 * grow), is draining: replaced or unregistered, with leases still held or
 * its unmap still pending. 0 for an unknown client, and when every
 * registration up to `id` is unmapped. Cost: the client's draining
 * registrations. */
int kvf_registry_draining_upto(kvf_registry *r, uint64_t client, uint64_t id);

/* ---- completions --------------------------------------------------------- */

/* A request's logical outcome. */
typedef enum kvf_outcome_kind {
  KVF_OUTCOME_DONE = 1,
  KVF_OUTCOME_FAILED = 2,
  KVF_OUTCOME_CANCELLED = 3,
  KVF_OUTCOME_TIMED_OUT = 4,
} kvf_outcome_kind;

typedef struct kvf_registry_outcome {
  uint32_t kind;     /* kvf_outcome_kind */
  kvf_status status; /* why it failed (KVF_SUCCESS when done) */
  uint64_t value;    /* request-specific: whole blocks stored or restored */
} kvf_registry_outcome;

/* Record the outcome of (client, request_id). The first record wins: a
 * duplicate completion is ignored (*duplicate = 1; may be NULL). When the
 * table is full the oldest record is evicted (a completion older than the
 * table's capacity can no longer be told from a new one).
 * Returns KVF_SUCCESS; KVF_ERR_INVALID_ARGUMENT (NULL r or outcome, unknown
 * kind). */
kvf_status kvf_registry_completion_record(kvf_registry *r, uint64_t client, uint64_t request_id,
                                          const kvf_registry_outcome *outcome, int *duplicate);

/* The recorded outcome of (client, request_id), to answer a retried request
 * without running it again. Returns KVF_SUCCESS and *out; KVF_ERR_NOT_FOUND
 * (never recorded, or evicted); KVF_ERR_INVALID_ARGUMENT. */
kvf_status kvf_registry_completion_lookup(kvf_registry *r, uint64_t client, uint64_t request_id,
                                          kvf_registry_outcome *out);

/* ---- STAT ---------------------------------------------------------------- */

/* Counters, for the whole registry or for one client; fields marked
 * (registry) are 0 in a client's counters. */
typedef struct kvf_registry_stats {
  uint32_t struct_size;
  uint32_t version;
  uint64_t clients;            /* (registry) client records held (open, or closed and draining) */
  uint64_t clients_closed;     /* closed clients still draining (1 or 0 for a client) */
  uint64_t registering;        /* attempts in progress */
  uint64_t active;             /* active registrations */
  uint64_t draining;           /* draining registrations (unmap_pending included) */
  uint64_t unmap_pending;      /* draining, no lease, an unmap failed: collect retries */
  uint64_t leases;             /* leases held */
  uint64_t imports;            /* the import table's mappings held (kvf_import_stats) */
  uint64_t aliases;            /* the import table's views of active registrations */
  uint64_t leases_total;       /* leases granted since creation */
  uint64_t leases_refused_total; /* acquires refused (no active registration) */
  uint64_t closed_total;       /* registrations unmapped */
  uint64_t failed_total;       /* attempts rolled back or aborted */
  uint64_t reaped_total;       /* (registry) clients closed by the reaper */
  uint64_t completions;        /* (registry) completion records held */
  uint64_t completions_duplicate_total; /* (registry) duplicate completions ignored */
  uint64_t completions_evicted_total;   /* (registry) records evicted as the oldest */
} kvf_registry_stats;
#define KVF_REGISTRY_STATS_INIT \
  {sizeof(kvf_registry_stats), KVF_REGISTRY_VERSION, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}

/* Counters for the whole registry. Returns KVF_SUCCESS;
 * KVF_ERR_INVALID_ARGUMENT (NULL, or an out that breaks the versioned-struct
 * rule of kvferry/kvferry.h, which the internal structs follow too: fill it
 * from KVF_REGISTRY_STATS_INIT). */
kvf_status kvf_registry_stats_get(kvf_registry *r, kvf_registry_stats *out);

/* Counters for one client. Same statuses, plus KVF_ERR_NOT_FOUND (unknown
 * client: all counters 0). */
kvf_status kvf_registry_client_stats(kvf_registry *r, uint64_t client, kvf_registry_stats *out);

#ifdef __cplusplus
}
#endif

#endif /* KVF_HOST_REGISTRY_H */
