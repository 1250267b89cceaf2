/* kvferryd's REGISTER path on its own worker thread (host/server/register.h). */
#define _GNU_SOURCE
#include "host/server/register.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <kvferry/geometry.h>
#include <kvferry/memory.h>

#include "common/clock.h"
#include "common/error.h"
#include "host/core/log.h"
#include "host/ipc/endpoint.h"

struct kvf_register_worker {
  kvf_register_options opt;
  pthread_mutex_t mu;  /* guards everything below */
  kvf_register_req *head, *tail;
  int stopping;
  int running;         /* the thread is working through the queue */
  int joinable;        /* a thread was started and not joined yet */
  pthread_t thread;
};

static void close_fds(int *fds, uint32_t n) {
  for (uint32_t i = 0; i < n; i++)
    if (fds[i] >= 0) {
      close(fds[i]);
      fds[i] = -1;
    }
}

/* Check REGISTER against its geometry and build the views. On failure every
 * descriptor is closed and kvf_last_error() names the field. On success the
 * views own the descriptors they name (fds[] entries moved there are -1) and
 * descriptors no region uses are closed. */
static kvf_status register_prepare(const kvf_proto_register *rg, int *fds, uint32_t num_fds, kvf_geometry **geom_out,
                                   kvf_import_view **views_out) {
  kvf_status st;
  kvf_geometry *g = NULL;
  kvf_import_view *views = NULL;
  int *claimed = NULL; /* per descriptor: 1 + the region that first named it, or 0 */
  *geom_out = NULL;
  *views_out = NULL;
  if (rg->num_fds != num_fds) {
    st = kvf_fail(KVF_ERR_PROTOCOL, "payload.num_fds: the frame says %u descriptors, %u arrived",
                  (unsigned)rg->num_fds, (unsigned)num_fds);
    goto out;
  }
  kvf_geometry_error gerr;
  st = kvf_geometry_load_buffer(rg->geometry_json, rg->geometry_json_len, NULL, &g, &gerr);
  if (st != KVF_SUCCESS) {
    kvf_error_prefix("payload.geometry_json: ");
    goto out;
  }
  uint32_t nreg = kvf_geometry_num_regions(g);
  if (rg->num_regions != nreg) {
    st = kvf_fail(KVF_ERR_INVALID_ARGUMENT, "payload.num_regions: %u regions sent, the geometry has %u",
                  (unsigned)rg->num_regions, (unsigned)nreg);
    goto out;
  }
  views = calloc(nreg ? nreg : 1, sizeof(*views));
  claimed = calloc(num_fds ? num_fds : 1, sizeof(*claimed));
  if (!views || !claimed) {
    st = kvf_fail(KVF_ERR_OUT_OF_MEMORY, "register: out of memory");
    goto out;
  }
  for (uint32_t i = 0; i < nreg; i++) {
    const kvf_proto_region *pr = &rg->regions[i];
    kvf_region_info info = KVF_REGION_INFO_INIT;
    st = kvf_geometry_region(g, i, &info);
    if (st != KVF_SUCCESS) goto out;
    if (pr->provider != KVF_MEM_PROVIDER_HOST && pr->provider != KVF_MEM_PROVIDER_CUMEM) {
      st = kvf_fail(KVF_ERR_INVALID_ARGUMENT, "payload.regions[%u].provider: %u is not a provider (1 host, 2 cumem)",
                    (unsigned)i, (unsigned)pr->provider);
      goto out;
    }
    if (pr->fd_index >= num_fds) {
      st = kvf_fail(KVF_ERR_INVALID_ARGUMENT, "payload.regions[%u].fd_index: %u, but %u descriptors came",
                    (unsigned)i, (unsigned)pr->fd_index, (unsigned)num_fds);
      goto out;
    }
    if (pr->size == 0) {
      st = kvf_fail(KVF_ERR_INVALID_ARGUMENT, "payload.regions[%u].size: 0 bytes, an allocation is never empty",
                    (unsigned)i);
      goto out;
    }
    if (pr->length == 0) {
      st = kvf_fail(KVF_ERR_INVALID_ARGUMENT, "payload.regions[%u].length: 0 bytes, a region is never empty",
                    (unsigned)i);
      goto out;
    }
    /* Within its allocation, the sum checked (an offset near 2^64 must not
     * wrap back inside). A refusal like any other here: the frame was
     * well formed, so the connection stays (the decoder leaves this to us). */
    uint64_t end = 0;
    if (!kvf_add_u64(pr->offset, pr->length, &end) || end > pr->size) {
      st = kvf_fail(KVF_ERR_INVALID_ARGUMENT,
                    "payload.regions[%u].length: offset %llu + length %llu passes the allocation's %llu bytes",
                    (unsigned)i, (unsigned long long)pr->offset, (unsigned long long)pr->length,
                    (unsigned long long)pr->size);
      goto out;
    }
    if (pr->length < info.size) {
      st = kvf_fail(KVF_ERR_INVALID_ARGUMENT,
                    "payload.regions[%u].length: %llu bytes, the geometry's region '%s' needs %llu", (unsigned)i,
                    (unsigned long long)pr->length, info.name, (unsigned long long)info.size);
      goto out;
    }
    if (info.align > 1 && (pr->offset % info.align) != 0) {
      st = kvf_fail(KVF_ERR_INVALID_ARGUMENT,
                    "payload.regions[%u].offset: %llu is not a multiple of the region's alignment %llu", (unsigned)i,
                    (unsigned long long)pr->offset, (unsigned long long)info.align);
      goto out;
    }
    kvf_import_view *v = &views[i];
    memset(v, 0, sizeof(*v));
    v->identity.instance_id = pr->instance_id;
    v->identity.allocation_id = pr->allocation_id;
    v->identity.generation = pr->generation;
    v->identity.size = pr->size;
    memcpy(v->identity.device_uuid, pr->device_uuid, sizeof(v->identity.device_uuid));
    v->identity.provider = pr->provider;
    v->offset = pr->offset;
    v->size = pr->length;
    v->fd = -1;
    /* One descriptor goes to the first view that names it; the import table
     * maps it once per identity (views of one identity may share it). */
    if (claimed[pr->fd_index] == 0) {
      claimed[pr->fd_index] = (int)i + 1;
      v->fd = fds[pr->fd_index];
    } else {
      const kvf_proto_region *first = &rg->regions[claimed[pr->fd_index] - 1];
      if (first->instance_id != pr->instance_id || first->allocation_id != pr->allocation_id ||
          first->generation != pr->generation) {
        st = kvf_fail(KVF_ERR_INVALID_ARGUMENT,
                      "payload.regions[%u].fd_index: descriptor %u already names another allocation (region %d)",
                      (unsigned)i, (unsigned)pr->fd_index, claimed[pr->fd_index] - 1);
        goto out;
      }
    }
  }
  /* Ownership moves: descriptors named by a view now belong to the views
   * (the registry's commit closes them); the others are closed here. */
  for (uint32_t f = 0; f < num_fds; f++) {
    if (claimed[f] == 0) close(fds[f]);
    fds[f] = -1;
  }
  *geom_out = g;
  *views_out = views;
  g = NULL;
  views = NULL;
  st = KVF_SUCCESS;
out:
  if (st != KVF_SUCCESS) close_fds(fds, num_fds);
  free(claimed);
  free(views);
  kvf_geometry_destroy(g);
  return st;
}

/* The REGISTER region field an import fault names (host/memory/import_table.h). */
static const char *region_field(const char *import_field) {
  if (!strcmp(import_field, "identity")) return "instance_id";
  if (!strcmp(import_field, "fd")) return "fd_index";
  return import_field; /* size, provider, device_uuid: the same names */
}

/* Encode `msg` as req's reply. */
static void set_reply(kvf_register_req *req, const kvf_proto_msg *msg) {
  free(req->frame);
  req->frame = NULL;
  req->frame_len = 0;
  if (kvf_proto_encode(msg, &req->frame, &req->frame_len) != KVF_SUCCESS) {
    KVF_WARN(SERVER, "client %llu: the reply to REGISTER %llu could not be encoded: %s",
             (unsigned long long)req->client_id, (unsigned long long)req->request_id, kvf_last_error());
    req->frame = NULL;
    req->frame_len = 0;
  }
}

static void set_error(kvf_register_req *req, kvf_status st) {
  kvf_proto_msg m;
  kvf_conn_error_msg(&m, req->request_id, st, NULL);
  set_reply(req, &m);
}

/* The whole REGISTER: geometry, views, registry attempt, lane binding,
 * import (all or nothing), reply. Every descriptor of req is consumed. */
static void register_run(kvf_register_worker *w, kvf_register_req *req) {
  const kvf_proto_register *rg = &req->reg;
  kvf_registry *registry = w->opt.registry;
  kvf_geometry *g = NULL;
  kvf_import_view *views = NULL;
  kvf_registry_reg *attempt = NULL;
  kvf_dp_binding *binding = NULL;
  uint64_t t0 = kvf_now_ns();
  kvf_status st = register_prepare(rg, req->fds, req->num_fds, &g, &views);
  if (st != KVF_SUCCESS) goto fail;
  if (w->opt.max_client_registrations != 0) {
    /* Live and draining ones (a draining one waits for its requests in
     * flight): each holds its mappings and its lane binding. */
    kvf_registry_stats cs = KVF_REGISTRY_STATS_INIT;
    (void)kvf_registry_client_stats(registry, req->client_id, &cs);
    if (cs.active + cs.draining + cs.registering + 1 > w->opt.max_client_registrations) {
      for (uint32_t i = 0; i < rg->num_regions; i++)
        if (views[i].fd >= 0) close(views[i].fd);
      st = kvf_fail(KVF_ERR_BUSY,
                    "quota.registrations: the client holds %llu live and %llu draining registrations; with this one "
                    "it would be over its limit of %u (a draining one goes once its requests in flight retire; "
                    "kvferryd --max-client-registrations)",
                    (unsigned long long)cs.active, (unsigned long long)cs.draining,
                    (unsigned)w->opt.max_client_registrations);
      goto fail;
    }
  }
  st = kvf_registry_register_begin(registry, req->client_id, kvf_now_ns(), &attempt);
  if (st == KVF_SUCCESS) {
    /* The lane first: a device this server does not serve is refused
     * before anything is mapped. The binding owns the geometry from here. */
    st = kvf_dataplane_bind(w->opt.dp, g, rg->device, kvf_registry_reg_id(attempt), rg->shard_index,
                            rg->shard_count, &binding);
    g = NULL;
    if (st != KVF_SUCCESS) (void)kvf_registry_register_abort(registry, attempt);
  }
  if (st != KVF_SUCCESS) {
    for (uint32_t i = 0; i < rg->num_regions; i++)
      if (views[i].fd >= 0) close(views[i].fd);
    goto fail;
  }
  uint64_t id = kvf_registry_reg_id(attempt);
  kvf_import_fault fault;
  /* Mapped bytes are counted per client process (SO_PEERCRED), however
   * many connections it opens. */
  uint64_t account = req->peer_pid > 0 ? (uint64_t)req->peer_pid : req->client_id;
  st = kvf_registry_register_commit_ex(registry, attempt, account, views, rg->num_regions, &fault);
  if (st != KVF_SUCCESS) {
    kvf_dataplane_unbind(binding);
    binding = NULL;
    if (fault.field != NULL && fault.view < rg->num_regions)
      kvf_fail(st, "payload.regions[%u].%s: %s; the previous registration stays", (unsigned)fault.view,
               region_field(fault.field), fault.message);
    else if (fault.field != NULL && !strncmp(fault.field, "quota.", 6))
      kvf_fail(st, "%s: %s (%s; kvferryd %s); the previous registration stays", fault.field, fault.message,
               !strcmp(fault.field, "quota.mapped_bytes") ? "counted per client process" : "the whole server",
               !strcmp(fault.field, "quota.mapped_bytes") ? "--max-client-mapped-gb" : "--max-mapped-gb");
    else
      kvf_error_prefix("payload.regions: registration failed, the previous one stays: ");
    goto fail;
  }
  free(views);
  /* Its first STORE must cost what later ones do (issue 15): what the
   * binding can set up now that the memory is mapped is done here. */
  kvf_dataplane_prepare(binding, req->client_id);
  kvf_registry_stats cs = KVF_REGISTRY_STATS_INIT;
  (void)kvf_registry_client_stats(registry, req->client_id, &cs);
  KVF_INFO(SERVER, "client %llu: registration %llu active (%u regions, %llu imports, %llu aliases; %.1f ms)",
           (unsigned long long)req->client_id, (unsigned long long)id, (unsigned)rg->num_regions,
           (unsigned long long)cs.imports, (unsigned long long)cs.aliases, (double)(kvf_now_ns() - t0) / 1e6);
  kvf_proto_msg r;
  memset(&r, 0, sizeof(r));
  r.type = KVF_PROTO_REGISTER_REPLY;
  r.request_id = req->request_id;
  r.u.register_reply.registration_id = id;
  r.u.register_reply.fingerprint = kvf_geometry_fingerprint(kvf_dp_binding_geometry(binding), KVF_FORMAT_CANONICAL);
  r.u.register_reply.imports = cs.imports > UINT32_MAX ? UINT32_MAX : (uint32_t)cs.imports;
  r.u.register_reply.aliases = cs.aliases > UINT32_MAX ? UINT32_MAX : (uint32_t)cs.aliases;
  req->status = KVF_SUCCESS;
  req->registration_id = id;
  req->binding = binding;
  set_reply(req, &r);
  return;
fail:
  KVF_INFO(SERVER, "client %llu: REGISTER refused (%.1f ms): %s", (unsigned long long)req->client_id,
           (double)(kvf_now_ns() - t0) / 1e6, kvf_last_error());
  free(views);
  kvf_geometry_destroy(g);
  req->status = st;
  set_error(req, st);
}

/* The worker thread: runs while there is work, then exits, so an idle
 * server holds no registration thread (and the thread's allocator caches go
 * back with it). */
static void *register_main(void *arg) {
  kvf_register_worker *w = arg;
  (void)pthread_setname_np(pthread_self(), "kvf-register");
  pthread_mutex_lock(&w->mu);
  while (w->head && !w->stopping) {
    kvf_register_req *req = w->head;
    w->head = req->next;
    if (!w->head) w->tail = NULL;
    req->next = NULL;
    pthread_mutex_unlock(&w->mu);
    register_run(w, req);
    w->opt.done(w->opt.done_ctx, req);
    pthread_mutex_lock(&w->mu);
  }
  w->running = 0;
  pthread_mutex_unlock(&w->mu);
  return NULL;
}

kvf_status kvf_register_worker_create(const kvf_register_options *options, kvf_register_worker **out) {
  if (!options || !out || !options->registry || !options->dp || !options->done)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_register_worker_create: NULL argument");
  *out = NULL;
  kvf_register_worker *w = calloc(1, sizeof(*w));
  if (!w) return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "kvf_register_worker_create: out of memory");
  w->opt = *options;
  int err = pthread_mutex_init(&w->mu, NULL);
  if (err != 0) {
    free(w);
    return kvf_fail(KVF_ERR_SYSTEM, "kvf_register_worker_create: pthread_mutex_init: %s", strerror(err));
  }
  *out = w;
  return KVF_SUCCESS;
}

void kvf_register_submit(kvf_register_worker *w, kvf_register_req *req) {
  req->next = NULL;
  pthread_mutex_lock(&w->mu);
  if (w->tail)
    w->tail->next = req;
  else
    w->head = req;
  w->tail = req;
  int err = 0;
  if (!w->running) {
    /* The last thread finished its queue (or none ran yet): reap it, start one. */
    if (w->joinable) pthread_join(w->thread, NULL); /* it only returns once running is 0 */
    w->joinable = 0;
    err = pthread_create(&w->thread, NULL, register_main, w);
    if (err == 0) w->running = w->joinable = 1;
  }
  if (err != 0) {
    /* No thread: refuse what is queued (only this request: a running
     * thread would have taken the others). */
    w->head = w->tail = NULL;
  }
  pthread_mutex_unlock(&w->mu);
  if (err != 0) {
    KVF_WARN(SERVER, "client %llu: no registration thread (%s): REGISTER refused", (unsigned long long)req->client_id,
             strerror(err));
    req->status = kvf_fail(KVF_ERR_SYSTEM, "register: no thread to run it: %s; try again", strerror(err));
    close_fds(req->fds, req->num_fds);
    set_error(req, req->status);
    w->opt.done(w->opt.done_ctx, req);
  }
}

void kvf_register_worker_destroy(kvf_register_worker *w) {
  if (!w) return;
  pthread_mutex_lock(&w->mu);
  w->stopping = 1;
  int joinable = w->joinable;
  w->joinable = 0;
  pthread_mutex_unlock(&w->mu);
  if (joinable) pthread_join(w->thread, NULL);
  while (w->head) {
    kvf_register_req *req = w->head;
    w->head = req->next;
    kvf_register_req_free(req);
  }
  pthread_mutex_destroy(&w->mu);
  free(w);
}

void kvf_register_req_free(kvf_register_req *req) {
  if (!req) return;
  close_fds(req->fds, req->num_fds);
  kvf_dataplane_unbind(req->binding);
  free(req->frame);
  free(req->reg.geometry_json);
  free(req->reg.regions);
  free(req);
}
