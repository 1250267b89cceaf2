/* The import table (kvferry/memory.h): one mapping per exporter-assigned
 * identity, an alias count per mapping, all-or-nothing registration and
 * step-by-step retryable close. docs/memory.md describes the states.
 *
 * Lists (all guarded by table->lock):
 *   live:    mappings that registrations use, found by identity; a mapping
 *            is here from the commit of the registration that created it
 *            until its alias count drops to zero;
 *   closing: mappings with alias count zero whose close has a step left;
 *            owner is the registration whose unregister must finish it, or
 *            NULL for leftovers of a rolled-back registration
 *            (kvf_import_table_collect).
 * Sizes here are small (an engine has a few allocations per GPU, a server a
 * few dozen clients), so lookups are linear scans. */
#define _GNU_SOURCE
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <kvferry/memory.h>

#include "common/error.h"
#include "common/versioned.h"
#include "host/core/log.h"
#include "host/memory/import_table.h"
#include "host/memory/provider.h"
#include "host/core/syscalls.h"

typedef struct kvf_import_mapping {
  kvf_mem_identity id;
  const kvf_provider_ops *ops;
  kvf_import_res res;
  uint64_t aliases;             /* views of active registrations using it */
  struct kvf_import_reg *owner; /* closing list: the registration that closes it, or NULL */
  uint64_t owner_client;        /* the client whose registration imported it */
  uint64_t account;             /* its quota account */
  uint64_t mark;                /* per-client counting */
  struct kvf_import_mapping *next;
} kvf_import_mapping;

typedef struct kvf_reg_view {
  kvf_import_mapping *m;
  uint64_t offset;
  uint64_t size;
} kvf_reg_view;

struct kvf_import_reg {
  kvf_import_table *table;
  uint64_t client;
  int state;                  /* kvf_import_reg_state; written under the lock, read atomically */
  uint32_t num_views;
  kvf_reg_view *views;
  uint32_t num_maps;          /* distinct mappings of the views */
  kvf_import_mapping **maps;  /* NULL once this registration has closed it */
  uint8_t *closer;            /* 1: this registration dropped the last alias and closes maps[i] */
  struct kvf_import_reg *next;
};

struct kvf_import_table {
  pthread_mutex_t lock; /* guards every field below, every mapping and every registration's lists */
  int *access_devices;
  uint32_t num_access_devices;
  kvf_import_mapping *live;
  kvf_import_mapping *closing;
  kvf_import_reg *regs;
  uint64_t mark_seq;
  uint64_t imports_total;
  uint64_t dedup_total;
  uint64_t rollbacks_total;
  kvf_import_policy policy;
};

static int kvf_id_same_key(const kvf_mem_identity *a, const kvf_mem_identity *b) {
  return a->instance_id == b->instance_id && a->allocation_id == b->allocation_id && a->generation == b->generation;
}

static kvf_import_mapping *kvf_list_find(kvf_import_mapping *list, const kvf_mem_identity *id) {
  for (kvf_import_mapping *m = list; m != NULL; m = m->next)
    if (kvf_id_same_key(&m->id, id)) return m;
  return NULL;
}

static void kvf_list_remove(kvf_import_mapping **list, kvf_import_mapping *m) {
  for (kvf_import_mapping **p = list; *p != NULL; p = &(*p)->next)
    if (*p == m) {
      *p = m->next;
      m->next = NULL;
      return;
    }
}

/* Run the close steps still to do: unmap, address free, release. Each step
 * clears its bit when done, so calling again retries only what is left.
 * Returns the first failure (with the mapping named in the message). */
static kvf_status kvf_mapping_close(kvf_import_mapping *m) {
  kvf_status first = KVF_SUCCESS, st;
  char msg[512] = "";
  kvf_import_res *r = &m->res;
  if (r->held & KVF_RES_MAPPED) {
    if ((st = m->ops->unmap(r)) != KVF_SUCCESS) {
      first = st;
      snprintf(msg, sizeof msg, "%s", kvf_last_error());
    }
  }
  /* The range cannot be freed while the memory is still mapped into it. */
  if (!(r->held & KVF_RES_MAPPED) && (r->held & KVF_RES_RESERVED)) {
    if ((st = m->ops->address_free(r)) != KVF_SUCCESS && first == KVF_SUCCESS) {
      first = st;
      snprintf(msg, sizeof msg, "%s", kvf_last_error());
    }
  }
  /* Releasing the handle is independent of the mapping: do it regardless. */
  if (r->held & KVF_RES_HANDLE) {
    if ((st = m->ops->release(r)) != KVF_SUCCESS && first == KVF_SUCCESS) {
      first = st;
      snprintf(msg, sizeof msg, "%s", kvf_last_error());
    }
  }
  if (first != KVF_SUCCESS) {
    char idtext[128];
    kvf_mem_identity_format(&m->id, idtext, sizeof idtext);
    KVF_WARN(IPC, "closing the mapping of %s: %s (the step is kept for a retry)", idtext, msg);
    return kvf_fail(first, "closing the mapping of %s: %s", idtext, msg);
  }
  return KVF_SUCCESS;
}

/* Close each distinct descriptor of views that is not consumed yet. */
static void kvf_views_close_fds(const kvf_import_view *views, uint32_t n, uint8_t *consumed) {
  for (uint32_t i = 0; i < n; i++) {
    int fd = views[i].fd;
    if (fd < 0 || (consumed && consumed[i])) continue;
    /* Views sharing a number are consumed together, so an earlier view with
     * this number means it was closed here already. */
    int seen = 0;
    for (uint32_t j = 0; j < i && !seen; j++) seen = views[j].fd == fd;
    if (seen) continue;
    kvf_sys_close(fd);
  }
}

/* Mark every view whose descriptor number is fd as consumed. */
static void kvf_views_consume(const kvf_import_view *views, uint32_t n, int fd, uint8_t *consumed) {
  for (uint32_t i = 0; i < n; i++)
    if (views[i].fd == fd) consumed[i] = 1;
}

static kvf_status kvf_views_check(const kvf_import_view *views, uint32_t n) {
  char idtext[128];
  for (uint32_t i = 0; i < n; i++) {
    const kvf_import_view *v = &views[i];
    uint64_t end;
    if (kvf_provider_get(v->identity.provider) == NULL)
      return kvf_fail(KVF_ERR_UNSUPPORTED, "views[%u].identity.provider %u is not host (1) or cumem (2)", i,
                      v->identity.provider);
    if (v->size == 0) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "views[%u].size is 0", i);
    if (!kvf_add_u64(v->offset, v->size, &end) || end > v->identity.size)
      return kvf_fail(KVF_ERR_INVALID_ARGUMENT,
                      "views[%u]: offset %" PRIu64 " + size %" PRIu64 " is past the end of %s", i, v->offset, v->size,
                      kvf_mem_identity_format(&v->identity, idtext, sizeof idtext));
    if (v->fd < -1) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "views[%u].fd %d is not a descriptor or -1", i, v->fd);
    if (v->fd >= 0)
      for (uint32_t j = 0; j < i; j++)
        if (views[j].fd == v->fd && !kvf_id_same_key(&views[j].identity, &v->identity))
          return kvf_fail(KVF_ERR_INVALID_ARGUMENT,
                          "views[%u].fd %d is also views[%u].fd, which names another allocation", i, v->fd, j);
  }
  return KVF_SUCCESS;
}

/* The identity a view states must agree with the mapping held for its key;
 * *field gets the identity field that disagrees. */
static kvf_status kvf_mapping_agrees(const kvf_import_mapping *m, const kvf_mem_identity *id, const char **field) {
  char a[128], b[128];
  *field = m->id.size != id->size ? "size" : m->id.provider != id->provider ? "provider" : "device_uuid";
  if (m->id.size != id->size || m->id.provider != id->provider ||
      memcmp(m->id.device_uuid, id->device_uuid, sizeof id->device_uuid) != 0)
    return kvf_fail(KVF_ERR_PROTOCOL, "%s: identity %s disagrees with the mapping held for it (%s)", *field,
                    kvf_mem_identity_format(id, a, sizeof a), kvf_mem_identity_format(&m->id, b, sizeof b));
  return KVF_SUCCESS;
}

kvf_status kvf_import_table_create(const kvf_import_table_options *caller, kvf_import_table **out) {
  kvf_import_table_options local = KVF_IMPORT_TABLE_OPTIONS_INIT;
  const kvf_import_table_options *options = caller != NULL ? &local : NULL;
  if (out == NULL) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_import_table_create: out is NULL");
  if (options != NULL) {
    kvf_status vs = KVF_VERSIONED_IN(kvf_import_table_options, &local, caller);
    if (vs != KVF_SUCCESS) return vs;
    if (options->num_access_devices > 0 && options->access_devices == NULL)
      return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_import_table_create: options.access_devices is NULL");
    if (options->num_access_devices > 64)
      return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_import_table_create: options.num_access_devices %u is over 64",
                      options->num_access_devices);
    for (uint32_t i = 0; i < options->num_access_devices; i++)
      if (options->access_devices[i] < 0)
        return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_import_table_create: options.access_devices[%u] is %d", i,
                        options->access_devices[i]);
  }
  kvf_import_table *t = calloc(1, sizeof *t);
  if (t == NULL) return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "kvf_import_table_create: no memory");
  if (options != NULL && options->num_access_devices > 0) {
    t->access_devices = malloc(options->num_access_devices * sizeof(int));
    if (t->access_devices == NULL) {
      free(t);
      return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "kvf_import_table_create: no memory");
    }
    memcpy(t->access_devices, options->access_devices, options->num_access_devices * sizeof(int));
    t->num_access_devices = options->num_access_devices;
  }
  pthread_mutex_init(&t->lock, NULL);
  *out = t;
  return KVF_SUCCESS;
}

static void kvf_reg_free(kvf_import_reg *reg) {
  if (reg == NULL) return;
  free(reg->views);
  free(reg->maps);
  free(reg->closer);
  free(reg);
}

/* Record that view `view` is at fault in `field`: *fault (when given) gets
 * the field and the reason (the current message without a leading
 * "field: "), and the thread's message names the view. Returns st. */
static kvf_status kvf_view_fault(kvf_import_fault *fault, uint32_t view, const char *field, kvf_status st) {
  char reason[512];
  const char *text = kvf_last_error();
  size_t n = strlen(field);
  if (strncmp(text, field, n) == 0 && text[n] == ':' && text[n + 1] == ' ') text += n + 2;
  snprintf(reason, sizeof reason, "%s", text);
  if (fault != NULL) {
    fault->view = view;
    fault->field = field;
    snprintf(fault->message, sizeof fault->message, "%s", reason);
  }
  return kvf_fail(st, "views[%u].%s: %s", view, field, reason);
}

/* The field a provider's refusal names ("fd: ...", "size: ..."), or NULL. */
static const char *kvf_provider_field(void) {
  const char *text = kvf_last_error();
  if (strncmp(text, "fd: ", 4) == 0) return "fd";
  if (strncmp(text, "size: ", 6) == 0) return "size";
  return NULL;
}

/* Under the lock: bytes of the mappings that count for `account` (all of
 * them when all is set): from import to address free. */
static uint64_t kvf_bytes_held(const kvf_import_table *t, uint64_t account, int all) {
  uint64_t sum = 0;
  for (int pass = 0; pass < 2; pass++)
    for (const kvf_import_mapping *m = pass ? t->closing : t->live; m != NULL; m = m->next)
      if (m->res.held != 0 && (all || m->account == account) && __builtin_add_overflow(sum, m->id.size, &sum))
        return UINT64_MAX;
  return sum;
}

void kvf_import_table_mapped_bytes(kvf_import_table *t, uint64_t account, uint64_t *account_bytes,
                                   uint64_t *total_bytes) {
  if (t == NULL) return;
  pthread_mutex_lock(&t->lock);
  if (account_bytes != NULL) *account_bytes = kvf_bytes_held(t, account, 0);
  if (total_bytes != NULL) *total_bytes = kvf_bytes_held(t, 0, 1);
  pthread_mutex_unlock(&t->lock);
}

/* Under the lock: whether `fresh` new bytes fit the quotas; *fault and the
 * message name the one that does not. */
static kvf_status kvf_quota_check(kvf_import_table *t, uint64_t account, uint64_t fresh, kvf_import_fault *fault) {
  const char *field = NULL;
  uint64_t held = 0, limit = 0;
  if (t->policy.max_account_bytes != 0) {
    held = kvf_bytes_held(t, account, 0);
    limit = t->policy.max_account_bytes;
    if (held > limit || fresh > limit - held) field = "quota.mapped_bytes";
  }
  if (field == NULL && t->policy.max_total_bytes != 0) {
    held = kvf_bytes_held(t, 0, 1);
    limit = t->policy.max_total_bytes;
    if (held > limit || fresh > limit - held) field = "quota.server_mapped_bytes";
  }
  if (field == NULL) return KVF_SUCCESS;
  char reason[384];
  int account_wide = field[6] == 'm';
  snprintf(reason, sizeof reason,
           "%s %" PRIu64 " bytes mapped and this registration claims %" PRIu64 " more, over the limit of %" PRIu64
           " bytes",
           account_wide ? "this account has" : "the server has", held, fresh, limit);
  if (fault != NULL) {
    fault->view = KVF_IMPORT_NO_VIEW;
    fault->field = field;
    snprintf(fault->message, sizeof fault->message, "%s", reason);
  }
  return kvf_fail(KVF_ERR_BUSY, "%s: %s", field, reason);
}

kvf_status kvf_import_table_register(kvf_import_table *t, uint64_t client, const kvf_import_view *views,
                                     uint32_t n, kvf_import_reg **out) {
  return kvf_import_table_register_ex(t, client, 0, views, n, out, NULL);
}

kvf_status kvf_import_table_register_ex(kvf_import_table *t, uint64_t client, uint64_t account,
                                        const kvf_import_view *views, uint32_t n, kvf_import_reg **out,
                                        kvf_import_fault *fault) {
  kvf_status st = KVF_SUCCESS;
  kvf_import_reg *reg = NULL;
  uint8_t *consumed = NULL;
  kvf_import_mapping **fresh = NULL; /* mappings this attempt creates, in order */
  uint32_t *fresh_view = NULL;       /* the view whose descriptor each is imported from */
  uint32_t num_fresh = 0, dedup = 0;
  int locked = 0;

  if (fault != NULL) {
    fault->view = KVF_IMPORT_NO_VIEW;
    fault->field = NULL;
    fault->message[0] = '\0';
  }
  if (views == NULL) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_import_table_register: views is NULL");
  if (t == NULL || out == NULL || n == 0) {
    st = kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_import_table_register: %s",
                  t == NULL ? "table is NULL" : out == NULL ? "out is NULL" : "num_views is 0");
    goto fail;
  }
  if ((st = kvf_views_check(views, n)) != KVF_SUCCESS) goto fail;
  if (account == 0) account = client;

  reg = calloc(1, sizeof *reg);
  consumed = calloc(n, 1);
  fresh = calloc(n, sizeof *fresh);
  fresh_view = calloc(n, sizeof *fresh_view);
  if (reg != NULL) {
    reg->views = calloc(n, sizeof *reg->views);
    reg->maps = calloc(n, sizeof *reg->maps);
    reg->closer = calloc(n, 1);
  }
  if (reg == NULL || consumed == NULL || fresh == NULL || fresh_view == NULL || reg->views == NULL ||
      reg->maps == NULL || reg->closer == NULL) {
    st = kvf_fail(KVF_ERR_OUT_OF_MEMORY, "kvf_import_table_register: no memory for %u views", n);
    goto fail;
  }
  reg->table = t;
  reg->client = client;
  reg->num_views = n;
  reg->state = KVF_IMPORT_REG_REGISTERING;

  pthread_mutex_lock(&t->lock);
  locked = 1;
  /* 1. Every view's mapping: one of this attempt, one the table holds, or
   *    a new one (imported below). A descriptor sent for an identity the
   *    table maps must be that allocation. Nothing is imported yet. */
  for (uint32_t i = 0; i < n; i++) {
    const kvf_mem_identity *id = &views[i].identity;
    kvf_import_mapping *m = NULL;
    for (uint32_t k = 0; k < num_fresh && m == NULL; k++)
      if (kvf_id_same_key(&fresh[k]->id, id)) m = fresh[k];
    int live = 0;
    if (m == NULL && (m = kvf_list_find(t->live, id)) != NULL) {
      live = 1;
      dedup++;
    }
    if (m != NULL && live && t->policy.owned && m->owner_client != client) {
      char idtext[128];
      kvf_fail(KVF_ERR_PERMISSION,
               "%s is mapped for client %" PRIu64 ", which imported it; a client aliases only the allocations it "
               "imported itself",
               kvf_mem_identity_format(id, idtext, sizeof idtext), m->owner_client);
      st = kvf_view_fault(fault, i, "identity", KVF_ERR_PERMISSION);
      goto fail;
    }
    if (m != NULL) {
      const char *field = NULL;
      if ((st = kvf_mapping_agrees(m, id, &field)) != KVF_SUCCESS) {
        st = kvf_view_fault(fault, i, field, st);
        goto fail;
      }
      int fd = views[i].fd, seen = 0;
      for (uint32_t j = 0; j < i && !seen; j++) seen = fd >= 0 && views[j].fd == fd;
      if (live && fd >= 0 && !seen && (st = m->ops->same(fd, id, &m->res)) != KVF_SUCCESS) {
        const char *pf = kvf_provider_field();
        if (pf != NULL) st = kvf_view_fault(fault, i, pf, st);
        goto fail;
      }
    } else {
      /* A new identity: imported from the first view of it carrying a descriptor. */
      uint32_t j = i;
      while (j < n && !(views[j].fd >= 0 && kvf_id_same_key(&views[j].identity, id))) j++;
      if (j == n) {
        char idtext[128];
        st = kvf_fail(KVF_ERR_INVALID_ARGUMENT,
                      "views[%u]: no descriptor for %s, which this table does not map yet (send its fd)", i,
                      kvf_mem_identity_format(id, idtext, sizeof idtext));
        if (fault != NULL) {
          fault->view = i;
          fault->field = "fd";
          snprintf(fault->message, sizeof fault->message, "%s", kvf_last_error() + strcspn(kvf_last_error(), " ") + 1);
        }
        goto fail;
      }
      m = calloc(1, sizeof *m);
      if (m == NULL) {
        st = kvf_fail(KVF_ERR_OUT_OF_MEMORY, "kvf_import_table_register: no memory for a mapping");
        goto fail;
      }
      m->id = *id;
      m->owner_client = client;
      m->account = account;
      m->ops = kvf_provider_get(id->provider);
      m->res.fd = -1;
      m->res.device = -1;
      fresh_view[num_fresh] = j;
      fresh[num_fresh++] = m;
    }
    reg->views[i].m = m;
    reg->views[i].offset = views[i].offset;
    reg->views[i].size = views[i].size;
  }
  /* The quotas, on what the new identities claim, before anything is imported. */
  uint64_t claimed = 0;
  for (uint32_t k = 0; k < num_fresh; k++)
    if (__builtin_add_overflow(claimed, fresh[k]->id.size, &claimed)) claimed = UINT64_MAX;
  if ((st = kvf_quota_check(t, account, claimed, fault)) != KVF_SUCCESS) goto fail;
  /* 2. Import every new identity: the provider looks at its descriptor (a
   *    sealed memfd of the identity's size; a driver export of memory on
   *    the identity's GPU) and refuses what is not, before anything of this
   *    registration is mapped. */
  for (uint32_t k = 0; k < num_fresh; k++) {
    kvf_import_mapping *m = fresh[k];
    int fd = views[fresh_view[k]].fd;
    kvf_views_consume(views, n, fd, consumed); /* import always takes the descriptor */
    if ((st = m->ops->import(fd, &m->id, &m->res)) != KVF_SUCCESS) {
      const char *pf = kvf_provider_field();
      if (pf != NULL) st = kvf_view_fault(fault, fresh_view[k], pf, st);
      goto fail;
    }
  }
  /* 3. Map them. */
  for (uint32_t k = 0; k < num_fresh; k++) {
    kvf_import_mapping *m = fresh[k];
    if ((st = m->ops->reserve(&m->res)) != KVF_SUCCESS) goto fail;
    if ((st = m->ops->map(&m->res)) != KVF_SUCCESS) goto fail;
    if ((st = m->ops->set_access(&m->res, t->access_devices, t->num_access_devices)) != KVF_SUCCESS) goto fail;
    /* The mapping keeps the memory alive: the handle is not needed any more. */
    if ((st = m->ops->release(&m->res)) != KVF_SUCCESS) goto fail;
  }
  /* Descriptors of identities already mapped, and duplicates. */
  kvf_views_close_fds(views, n, consumed);
  memset(consumed, 1, n);

  /* Commit: nothing below can fail. */
  for (uint32_t i = 0; i < n; i++) {
    kvf_import_mapping *m = reg->views[i].m;
    m->aliases++;
    uint32_t k = 0;
    while (k < reg->num_maps && reg->maps[k] != m) k++;
    if (k == reg->num_maps) reg->maps[reg->num_maps++] = m;
  }
  for (uint32_t k = 0; k < num_fresh; k++) {
    fresh[k]->next = t->live;
    t->live = fresh[k];
  }
  t->imports_total += num_fresh;
  t->dedup_total += dedup;
  __atomic_store_n(&reg->state, KVF_IMPORT_REG_ACTIVE, __ATOMIC_RELEASE);
  reg->next = t->regs;
  t->regs = reg;
  pthread_mutex_unlock(&t->lock);
  KVF_INFO(IPC, "client %" PRIu64 ": registered %u views over %u mappings (%u imported, %u reused)", client, n,
           reg->num_maps, num_fresh, reg->num_maps - num_fresh);
  free(consumed);
  free(fresh);
  free(fresh_view);
  *out = reg;
  return KVF_SUCCESS;

fail:
  if (locked) {
    /* Undo every step of this attempt, newest first. A close that fails
     * leaves the mapping for kvf_import_table_collect; the status returned
     * stays the one that made the attempt fail. */
    char msg[768];
    snprintf(msg, sizeof msg, "%s", kvf_last_error());
    int leftovers = 0;
    for (uint32_t k = num_fresh; k-- > 0;) {
      kvf_import_mapping *m = fresh[k];
      if (m->res.held != 0 && kvf_mapping_close(m) != KVF_SUCCESS) {
        m->owner = NULL;
        m->next = t->closing;
        t->closing = m;
        leftovers++;
      } else {
        free(m);
      }
    }
    t->rollbacks_total++;
    pthread_mutex_unlock(&t->lock);
    KVF_INFO(IPC, "client %" PRIu64 ": registration of %u views rolled back: %s", client, n, msg);
    if (leftovers)
      kvf_fail(st, "registering %u views for client %" PRIu64 ": %s (%d mapping%s could not be closed yet; "
               "kvf_import_table_collect retries)", n, client, msg, leftovers, leftovers == 1 ? "" : "s");
    else
      kvf_fail(st, "registering %u views for client %" PRIu64 ": %s", n, client, msg);
  }
  if (views != NULL && n > 0) kvf_views_close_fds(views, n, consumed);
  kvf_reg_free(reg);
  free(consumed);
  free(fresh);
  free(fresh_view);
  return st;
}

kvf_status kvf_import_table_set_policy(kvf_import_table *t, const kvf_import_policy *policy) {
  if (t == NULL || policy == NULL)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_import_table_set_policy: %s is NULL", t ? "policy" : "table");
  pthread_mutex_lock(&t->lock);
  t->policy = *policy;
  pthread_mutex_unlock(&t->lock);
  return KVF_SUCCESS;
}

kvf_status kvf_import_table_unregister(kvf_import_table *t, kvf_import_reg *reg) {
  if (t == NULL || reg == NULL)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_import_table_unregister: %s is NULL", t ? "reg" : "table");
  if (reg->table != t)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_import_table_unregister: the registration belongs to another table");
  pthread_mutex_lock(&t->lock);
  uint64_t client = reg->client;
  kvf_status st = KVF_SUCCESS;
  /* Keep the first close failure's status and message. */
  kvf_status step = KVF_SUCCESS;
  char msg[768] = "";
  if (reg->state == KVF_IMPORT_REG_ACTIVE || reg->state == KVF_IMPORT_REG_CLOSING) {
    /* Run the steps, capturing the first failure of a close step. */
    if (reg->state == KVF_IMPORT_REG_ACTIVE) {
      for (uint32_t i = 0; i < reg->num_views; i++) reg->views[i].m->aliases--;
      for (uint32_t k = 0; k < reg->num_maps; k++) {
        kvf_import_mapping *m = reg->maps[k];
        if (m->aliases != 0) continue;
        kvf_list_remove(&t->live, m);
        m->owner = reg;
        m->next = t->closing;
        t->closing = m;
        reg->closer[k] = 1;
      }
      __atomic_store_n(&reg->state, KVF_IMPORT_REG_CLOSING, __ATOMIC_RELEASE);
    }
    uint32_t left = 0;
    for (uint32_t k = 0; k < reg->num_maps; k++) {
      kvf_import_mapping *m = reg->maps[k];
      if (!reg->closer[k] || m == NULL) continue;
      kvf_status s = kvf_mapping_close(m);
      if (s != KVF_SUCCESS) {
        if (step == KVF_SUCCESS) {
          step = s;
          snprintf(msg, sizeof msg, "%s", kvf_last_error());
        }
        left++;
        continue;
      }
      kvf_list_remove(&t->closing, m);
      free(m);
      reg->maps[k] = NULL;
    }
    if (step != KVF_SUCCESS) {
      st = kvf_fail(step, "unregistering client %" PRIu64 ": %s (%u mapping%s left to close; call again to retry)",
                    client, msg, left, left == 1 ? "" : "s");
    } else {
      for (kvf_import_reg **p = &t->regs; *p != NULL; p = &(*p)->next)
        if (*p == reg) {
          *p = reg->next;
          break;
        }
      kvf_reg_free(reg);
      KVF_INFO(IPC, "client %" PRIu64 ": unregistered", client);
    }
  } else {
    st = kvf_fail(KVF_ERR_STATE, "kvf_import_table_unregister: the registration is in state %d", reg->state);
  }
  pthread_mutex_unlock(&t->lock);
  return st;
}

kvf_status kvf_import_table_collect(kvf_import_table *t) {
  if (t == NULL) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_import_table_collect: table is NULL");
  kvf_status first = KVF_SUCCESS;
  char msg[768] = "";
  pthread_mutex_lock(&t->lock);
  for (kvf_import_mapping **p = &t->closing; *p != NULL;) {
    kvf_import_mapping *m = *p;
    if (m->owner != NULL) {
      p = &m->next;
      continue;
    }
    kvf_status s = kvf_mapping_close(m);
    if (s != KVF_SUCCESS) {
      if (first == KVF_SUCCESS) {
        first = s;
        snprintf(msg, sizeof msg, "%s", kvf_last_error());
      }
      p = &m->next;
      continue;
    }
    *p = m->next;
    free(m);
  }
  pthread_mutex_unlock(&t->lock);
  if (first != KVF_SUCCESS) return kvf_fail(first, "kvf_import_table_collect: %s", msg);
  return KVF_SUCCESS;
}

void kvf_import_table_destroy(kvf_import_table *t) {
  if (t == NULL) return;
  while (t->regs != NULL) {
    kvf_import_reg *reg = t->regs;
    if (kvf_import_table_unregister(t, reg) != KVF_SUCCESS) {
      /* Give up on it: its mappings stay on the closing list, logged below. */
      KVF_WARN(IPC, "destroying the import table: client %" PRIu64 ": %s", reg->client, kvf_last_error());
      t->regs = reg->next;
      for (uint32_t k = 0; k < reg->num_maps; k++)
        if (reg->closer[k] && reg->maps[k] != NULL) reg->maps[k]->owner = NULL;
      kvf_reg_free(reg);
    }
  }
  if (kvf_import_table_collect(t) != KVF_SUCCESS)
    KVF_WARN(IPC, "destroying the import table: %s", kvf_last_error());
  while (t->closing != NULL) {
    kvf_import_mapping *m = t->closing;
    char idtext[128];
    KVF_WARN(IPC, "destroying the import table: the mapping of %s could not be closed and is leaked (held 0x%x)",
             kvf_mem_identity_format(&m->id, idtext, sizeof idtext), m->res.held);
    t->closing = m->next;
    free(m);
  }
  while (t->live != NULL) { /* unreachable: every live mapping has a registration */
    kvf_import_mapping *m = t->live;
    t->live = m->next;
    free(m);
  }
  pthread_mutex_destroy(&t->lock);
  free(t->access_devices);
  free(t);
}

static kvf_status kvf_stats_check(kvf_import_table *t, kvf_import_stats *out, const char *fn) {
  if (t == NULL || out == NULL) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "%s: %s is NULL", fn, t ? "out" : "table");
  return KVF_VERSIONED_CHECK(kvf_import_stats, out);
}

kvf_status kvf_import_table_stats(kvf_import_table *t, kvf_import_stats *caller) {
  kvf_status st = kvf_stats_check(t, caller, "kvf_import_table_stats");
  if (st != KVF_SUCCESS) return st;
  kvf_import_stats local = KVF_IMPORT_STATS_INIT, *out = &local;
  pthread_mutex_lock(&t->lock);
  for (kvf_import_reg *r = t->regs; r != NULL; r = r->next) out->registrations++;
  for (int pass = 0; pass < 2; pass++)
    for (kvf_import_mapping *m = pass ? t->closing : t->live; m != NULL; m = m->next) {
      out->imports++;
      out->aliases += m->aliases;
      if (m->res.held & KVF_RES_MAPPED) out->bytes_mapped += m->res.size;
      if (m->res.held & KVF_RES_HANDLE) out->handles++;
      if (m->res.held & KVF_RES_RESERVED) out->reservations++;
      if (pass) out->pending_closes++;
    }
  out->imports_total = t->imports_total;
  out->dedup_total = t->dedup_total;
  out->rollbacks_total = t->rollbacks_total;
  pthread_mutex_unlock(&t->lock);
  return KVF_VERSIONED_OUT(kvf_import_stats, caller, &local);
}

kvf_status kvf_import_table_client_stats(kvf_import_table *t, uint64_t client, kvf_import_stats *caller) {
  kvf_status st = kvf_stats_check(t, caller, "kvf_import_table_client_stats");
  if (st != KVF_SUCCESS) return st;
  kvf_import_stats local = KVF_IMPORT_STATS_INIT, *out = &local;
  pthread_mutex_lock(&t->lock);
  uint64_t mark = ++t->mark_seq;
  for (kvf_import_reg *r = t->regs; r != NULL; r = r->next) {
    if (r->client != client) continue;
    out->registrations++;
    int active = r->state == KVF_IMPORT_REG_ACTIVE;
    if (active) out->aliases += r->num_views;
    for (uint32_t k = 0; k < r->num_maps; k++) {
      kvf_import_mapping *m = r->maps[k];
      /* A closing registration still holds the mappings it must close. */
      if (m == NULL || !(active || r->closer[k])) continue;
      if (!active) out->pending_closes++;
      if (m->mark == mark) continue;
      m->mark = mark;
      out->imports++;
      if (m->res.held & KVF_RES_MAPPED) out->bytes_mapped += m->res.size;
    }
  }
  pthread_mutex_unlock(&t->lock);
  return KVF_VERSIONED_OUT(kvf_import_stats, caller, &local);
}

kvf_import_reg_state kvf_import_reg_get_state(const kvf_import_reg *reg) {
  if (reg == NULL) return KVF_IMPORT_REG_FAILED;
  return (kvf_import_reg_state)__atomic_load_n(&reg->state, __ATOMIC_ACQUIRE);
}

uint64_t kvf_import_reg_client(const kvf_import_reg *reg) { return reg ? reg->client : 0; }

uint32_t kvf_import_reg_num_views(const kvf_import_reg *reg) { return reg ? reg->num_views : 0; }

kvf_status kvf_import_reg_view(const kvf_import_reg *reg, uint32_t index, kvf_import_view_info *out) {
  if (reg == NULL || out == NULL)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_import_reg_view: %s is NULL", reg ? "out" : "reg");
  if (index >= reg->num_views)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_import_reg_view: index %u is not below num_views %u", index,
                    reg->num_views);
  if (__atomic_load_n(&reg->state, __ATOMIC_ACQUIRE) != KVF_IMPORT_REG_ACTIVE)
    return kvf_fail(KVF_ERR_STATE, "kvf_import_reg_view: the registration is closing");
  const kvf_reg_view *v = &reg->views[index];
  out->base = v->m->res.addr;
  out->ptr = (char *)v->m->res.addr + v->offset;
  out->offset = v->offset;
  out->size = v->size;
  out->mapping_size = v->m->res.size;
  out->device = v->m->res.device;
  out->identity = v->m->id;
  return KVF_SUCCESS;
}
