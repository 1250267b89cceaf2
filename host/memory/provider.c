/* Exporter-side allocations (kvferry/memory.h): identities, the process's
 * list of live allocations, and dispatch to the providers. */
#define _GNU_SOURCE
#include "host/memory/provider.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/error.h"
#include "common/versioned.h"
#include "host/core/log.h"
#include "host/core/syscalls.h"

const kvf_provider_ops *kvf_provider_get(uint32_t kind) {
  switch (kind) {
  case KVF_MEM_PROVIDER_HOST: return &kvf_provider_host;
  case KVF_MEM_PROVIDER_CUMEM: return &kvf_provider_cumem;
  default: return NULL;
  }
}

/* ---- instance id, generation, allocation ids ---------------------------- */

/* Guards the fields below. */
static pthread_mutex_t kvf_instance_lock = PTHREAD_MUTEX_INITIALIZER;
static pid_t kvf_instance_pid;       /* the process that drew or set the id; 0: none yet */
static int kvf_instance_explicit;    /* set by kvf_mem_instance_set (kept across fork) */
static uint64_t kvf_instance_id_now;
static uint64_t kvf_instance_generation = 1;
static uint64_t kvf_instance_next_alloc = 1;

/* Draw a random non-zero id. */
static kvf_status kvf_instance_draw(uint64_t *out) {
  uint64_t v = 0;
  size_t got = 0;
  while (got < sizeof v) {
    int n = KVF_SYS(getrandom)((char *)&v + got, sizeof v - got, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      return KVF_SYS_FAIL(KVF_ERR_SYSTEM, errno, "getrandom (drawing the memory instance id)");
    }
    got += (size_t)n;
  }
  *out = v ? v : 1;
  return KVF_SUCCESS;
}

/* With the lock held: make sure this process has an instance id. A forked
 * child draws its own, unless the caller set one explicitly, so parent and
 * child never hand out the same identity. */
static kvf_status kvf_instance_ensure_locked(void) {
  pid_t pid = getpid();
  if (kvf_instance_pid == pid) return KVF_SUCCESS;
  if (kvf_instance_pid != 0 && kvf_instance_explicit) {
    kvf_instance_pid = pid;
    return KVF_SUCCESS;
  }
  uint64_t id;
  kvf_status st = kvf_instance_draw(&id);
  if (st != KVF_SUCCESS) return st;
  kvf_instance_id_now = id;
  kvf_instance_pid = pid;
  kvf_instance_next_alloc = 1;
  return KVF_SUCCESS;
}

kvf_status kvf_mem_instance_set(uint64_t instance_id, uint64_t generation) {
  kvf_status st = KVF_SUCCESS;
  uint64_t id = instance_id;
  if (id == 0 && (st = kvf_instance_draw(&id)) != KVF_SUCCESS) return st;
  pthread_mutex_lock(&kvf_instance_lock);
  kvf_instance_id_now = id;
  kvf_instance_generation = generation;
  kvf_instance_explicit = instance_id != 0;
  kvf_instance_pid = getpid();
  pthread_mutex_unlock(&kvf_instance_lock);
  return KVF_SUCCESS;
}

kvf_status kvf_mem_instance(uint64_t *instance_id, uint64_t *generation) {
  pthread_mutex_lock(&kvf_instance_lock);
  kvf_status st = kvf_instance_ensure_locked();
  if (st == KVF_SUCCESS) {
    if (instance_id) *instance_id = kvf_instance_id_now;
    if (generation) *generation = kvf_instance_generation;
  }
  pthread_mutex_unlock(&kvf_instance_lock);
  return st;
}

kvf_status kvf_mem_next_identity(kvf_mem_identity *id) {
  pthread_mutex_lock(&kvf_instance_lock);
  kvf_status st = kvf_instance_ensure_locked();
  if (st == KVF_SUCCESS) {
    id->instance_id = kvf_instance_id_now;
    id->generation = kvf_instance_generation;
    id->allocation_id = kvf_instance_next_alloc++;
  }
  pthread_mutex_unlock(&kvf_instance_lock);
  return st;
}

const char *kvf_mem_identity_format(const kvf_mem_identity *id, char *buf, size_t cap) {
  if (buf == NULL || cap == 0) return buf;
  buf[0] = '\0';
  if (id == NULL) return buf;
  const kvf_provider_ops *ops = kvf_provider_get(id->provider);
  snprintf(buf, cap, "%s:%016" PRIx64 ":%" PRIu64 ":%" PRIu64 " (%" PRIu64 " bytes)", ops ? ops->name : "unknown",
           id->instance_id, id->allocation_id, id->generation, id->size);
  return buf;
}

/* ---- the registry of live allocations ---------------------------------- */

/* Guards kvf_alloc_list and every kvf_mem_alloc's refs and next. */
static pthread_mutex_t kvf_alloc_lock = PTHREAD_MUTEX_INITIALIZER;
static kvf_mem_alloc *kvf_alloc_list;

/* With the lock held: the live allocation of `provider` holding ptr. */
static kvf_mem_alloc *kvf_alloc_lookup_locked(kvf_mem_provider provider, const void *ptr) {
  uintptr_t p = (uintptr_t)ptr;
  for (kvf_mem_alloc *a = kvf_alloc_list; a != NULL; a = a->next)
    if (a->identity.provider == (uint32_t)provider && p >= (uintptr_t)a->ptr && p - (uintptr_t)a->ptr < a->size)
      return a;
  return NULL;
}

kvf_status kvf_mem_granularity(kvf_mem_provider provider, int device, uint64_t *out) {
  if (out == NULL) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_mem_granularity: out is NULL");
  const kvf_provider_ops *ops = kvf_provider_get(provider);
  if (ops == NULL) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_mem_granularity: unknown provider %d", (int)provider);
  return ops->granularity(device, out);
}

kvf_status kvf_mem_alloc_create(const kvf_mem_alloc_options *caller, kvf_mem_alloc **out) {
  kvf_status st;
  uint64_t gran = 0, size = 0;
  kvf_mem_alloc *a = NULL;
  kvf_mem_alloc_options local = KVF_MEM_ALLOC_OPTIONS_INIT;
  const kvf_mem_alloc_options *options = &local;
  if (out == NULL) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_mem_alloc_create: out is NULL");
  if (caller == NULL) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_mem_alloc_create: options is NULL");
  if ((st = KVF_VERSIONED_IN(kvf_mem_alloc_options, &local, caller)) != KVF_SUCCESS) return st;
  const kvf_provider_ops *ops = kvf_provider_get(options->provider);
  if (ops == NULL)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_mem_alloc_create: options.provider %d is not host (1) or cumem (2)",
                    (int)options->provider);
  if (options->size == 0) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_mem_alloc_create: options.size is 0");
  if (options->num_access_devices > 0 && options->access_devices == NULL)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT,
                    "kvf_mem_alloc_create: options.access_devices is NULL with num_access_devices %u",
                    options->num_access_devices);
  if ((st = ops->granularity(options->device, &gran)) != KVF_SUCCESS) {
    if (st == KVF_ERR_INVALID_ARGUMENT) kvf_error_prefix("options.");
    return st;
  }
  if (!kvf_add_u64(options->size, gran - 1, &size))
    return kvf_fail(KVF_ERR_OVERFLOW, "kvf_mem_alloc_create: options.size %" PRIu64 " cannot be rounded up to %" PRIu64,
                    options->size, gran);
  size -= size % gran;

  a = calloc(1, sizeof *a);
  if (a == NULL) return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "kvf_mem_alloc_create: no memory for the allocation record");
  a->ops = ops;
  a->fd = -1;
  a->device = -1;
  a->refs = 1;
  a->owned = 1;
  if ((st = kvf_mem_next_identity(&a->identity)) != KVF_SUCCESS) goto out;
  a->identity.provider = (uint32_t)ops->kind;
  a->identity.size = size;
  if ((st = ops->create(options, size, a)) != KVF_SUCCESS) goto out;
  a->size = size;

  pthread_mutex_lock(&kvf_alloc_lock);
  a->next = kvf_alloc_list;
  kvf_alloc_list = a;
  pthread_mutex_unlock(&kvf_alloc_lock);
  KVF_INFO(MEM, "allocated %" PRIu64 " bytes of %s memory at %p (allocation %" PRIu64 ")", size, ops->name, a->ptr,
           a->identity.allocation_id);
  *out = a;
  a = NULL;
out:
  free(a);
  return st;
}

kvf_status kvf_mem_alloc_find(kvf_mem_provider provider, const void *ptr, kvf_mem_alloc **out) {
  kvf_status st;
  if (out == NULL) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_mem_alloc_find: out is NULL");
  if (ptr == NULL) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_mem_alloc_find: ptr is NULL");
  const kvf_provider_ops *ops = kvf_provider_get(provider);
  if (ops == NULL)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_mem_alloc_find: provider %d is not host (1) or cumem (2)",
                    (int)provider);

  pthread_mutex_lock(&kvf_alloc_lock);
  kvf_mem_alloc *hit = kvf_alloc_lookup_locked(provider, ptr);
  if (hit != NULL) hit->refs++;
  pthread_mutex_unlock(&kvf_alloc_lock);
  if (hit != NULL) {
    *out = hit;
    return KVF_SUCCESS;
  }
  if (ops->find == NULL)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT,
                    "kvf_mem_alloc_find: %p is not in any %s allocation of this process; only memory made by "
                    "kvf_mem_alloc_create can be exported by this provider",
                    ptr, ops->name);

  kvf_mem_alloc *a = calloc(1, sizeof *a);
  if (a == NULL) return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "kvf_mem_alloc_find: no memory for the allocation record");
  a->ops = ops;
  a->fd = -1;
  a->device = -1;
  a->refs = 1;
  a->owned = 0;
  /* The driver calls run outside the registry lock. */
  if ((st = ops->find(ptr, a)) != KVF_SUCCESS) {
    free(a);
    return st;
  }
  a->identity.provider = (uint32_t)ops->kind;
  a->identity.size = a->size;
  if ((st = kvf_mem_next_identity(&a->identity)) != KVF_SUCCESS) {
    ops->destroy(a);
    free(a);
    return st;
  }

  /* Another thread may have found the same allocation meanwhile: keep one. */
  pthread_mutex_lock(&kvf_alloc_lock);
  hit = kvf_alloc_lookup_locked(provider, ptr);
  if (hit != NULL) {
    hit->refs++;
  } else {
    a->next = kvf_alloc_list;
    kvf_alloc_list = a;
  }
  pthread_mutex_unlock(&kvf_alloc_lock);
  if (hit != NULL) {
    ops->destroy(a);
    free(a);
    a = hit;
  }
  *out = a;
  return KVF_SUCCESS;
}

void kvf_mem_alloc_destroy(kvf_mem_alloc *a) {
  if (a == NULL) return;
  int last = 0;
  pthread_mutex_lock(&kvf_alloc_lock);
  if (--a->refs == 0) {
    last = 1;
    for (kvf_mem_alloc **p = &kvf_alloc_list; *p != NULL; p = &(*p)->next)
      if (*p == a) {
        *p = a->next;
        break;
      }
  }
  pthread_mutex_unlock(&kvf_alloc_lock);
  if (!last) return;
  a->ops->destroy(a);
  free(a);
}

void *kvf_mem_alloc_ptr(const kvf_mem_alloc *a) { return a ? a->ptr : NULL; }

uint64_t kvf_mem_alloc_size(const kvf_mem_alloc *a) { return a ? a->size : 0; }

kvf_status kvf_mem_alloc_identity(const kvf_mem_alloc *a, kvf_mem_identity *out) {
  if (a == NULL || out == NULL)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_mem_alloc_identity: %s is NULL", a ? "out" : "alloc");
  *out = a->identity;
  return KVF_SUCCESS;
}

kvf_status kvf_mem_alloc_export(kvf_mem_alloc *a, int *fd, kvf_mem_identity *identity) {
  if (fd == NULL) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_mem_alloc_export: fd is NULL");
  *fd = -1;
  if (a == NULL) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_mem_alloc_export: alloc is NULL");
  kvf_status st = a->ops->export_fd(a, fd);
  if (st != KVF_SUCCESS) {
    *fd = -1;
    return st;
  }
  if (identity) *identity = a->identity;
  return KVF_SUCCESS;
}
