/*
 * Internal: the memory provider interface (host/provider_host.c,
 * host/provider_cumem.c). The public kvf_mem_* functions (host/provider.c)
 * and the import table (host/import_table.c) reach a provider only through
 * these operations, so everything above them is provider-agnostic.
 *
 * Exporter side: create / find / export / destroy an allocation.
 * Importer side: a mapping moves through import -> reserve -> map ->
 * set_access -> release (of the import handle), and closes through
 * unmap -> address_free -> release. Each step sets or clears one bit of
 * kvf_import_res.held, and each closing step does nothing when its bit is
 * clear, so closing can be retried step by step.
 */
#ifndef KVF_HOST_PROVIDER_H
#define KVF_HOST_PROVIDER_H

#include <kvferry/memory.h>

#ifdef __cplusplus
extern "C" {
#endif

/* What a kvf_import_res holds right now. */
#define KVF_RES_HANDLE 1u   /* an import handle (cumem handle / host memfd) */
#define KVF_RES_RESERVED 2u /* an address range */
#define KVF_RES_MAPPED 4u   /* the memory mapped into the range */
#define KVF_RES_ACCESS 8u   /* access granted (informational; cleared by unmap) */

/* The importer's provider state of one mapping. */
typedef struct kvf_import_res {
  uint64_t handle; /* cumem: CUmemGenericAllocationHandle */
  int fd;          /* host: the memfd, held until released; -1 otherwise */
  void *addr;      /* reserved range */
  uint64_t size;   /* identity.size */
  uint64_t align;  /* cumem: granularity used for the reservation */
  int device;      /* cumem: ordinal of the device holding the memory; host: -1 */
  unsigned held;   /* KVF_RES_* bits */
  /* The first descriptor imported, as fstat saw it: a later descriptor sent
   * for the same identity must be the same object (`same`). */
  uint64_t st_dev, st_ino;
} kvf_import_res;

/* The exporter's live allocation (one per distinct allocation in this
 * process; kvf_mem_alloc_find hands out more references to it). */
struct kvf_mem_alloc {
  const struct kvf_provider_ops *ops;
  kvf_mem_identity identity;
  void *ptr;
  uint64_t size;
  int refs;      /* guarded by the registry lock */
  int owned;     /* 1: kvf_mem_alloc_create made it (destroy frees the memory) */
  int fd;        /* host: the memfd; -1 otherwise */
  uint64_t handle; /* cumem: the allocation handle (created or retained) */
  int device;    /* cumem: device ordinal; host: -1 */
  struct kvf_mem_alloc *next; /* registry list */
};

typedef struct kvf_provider_ops {
  kvf_mem_provider kind;
  const char *name;
  kvf_status (*granularity)(int device, uint64_t *out);
  /* Fill a->ptr, size, fd/handle/device and identity.device_uuid; size is
   * already rounded. On failure nothing is left allocated. */
  kvf_status (*create)(const kvf_mem_alloc_options *options, uint64_t size, kvf_mem_alloc *a);
  /* Find the allocation holding ptr (a->owned = 0); NULL: not supported. */
  kvf_status (*find)(const void *ptr, kvf_mem_alloc *a);
  kvf_status (*export_fd)(kvf_mem_alloc *a, int *fd);
  void (*destroy)(kvf_mem_alloc *a);

  /* Import `fd` (always consumed: closed or kept as the handle) as the
   * allocation `id` says; fills r->size, device, align, st_dev, st_ino;
   * sets HANDLE. Maps nothing: a descriptor that is not what the provider
   * exports, or not as large as id->size says, is refused here, before any
   * mapping of the registration is made. A refusal that is the sender's
   * fault is KVF_ERR_PROTOCOL with a message that starts with the field:
   * "fd: ..." (the descriptor) or "size: ..." (the identity's size). */
  kvf_status (*import)(int fd, const kvf_mem_identity *id, kvf_import_res *r);
  /* Is `fd` (not consumed) the allocation mapped as `r` for identity `id`?
   * host: fstat's device and inode equal r's, and the size id->size.
   * cumem: the descriptor imports (the handle is released at once) as
   * device memory of r's device; fstat's inode is not compared (every
   * export of the NVIDIA driver is an open of /dev/nvidiactl:
   * MemoryGpu.ExportInodes in tests/test_memory_gpu.cpp reports it). Returns
   * KVF_SUCCESS, or KVF_ERR_PROTOCOL ("fd: ...") and the driver's or the
   * system's status. */
  kvf_status (*same)(int fd, const kvf_mem_identity *id, const kvf_import_res *r);
  kvf_status (*reserve)(kvf_import_res *r);
  kvf_status (*map)(kvf_import_res *r);
  kvf_status (*set_access)(kvf_import_res *r, const int *devices, uint32_t num_devices);
  kvf_status (*release)(kvf_import_res *r);
  kvf_status (*unmap)(kvf_import_res *r);
  kvf_status (*address_free)(kvf_import_res *r);
} kvf_provider_ops;

extern const kvf_provider_ops kvf_provider_host;
extern const kvf_provider_ops kvf_provider_cumem;

/* The provider of a kind, or NULL. */
const kvf_provider_ops *kvf_provider_get(uint32_t kind);

/* A new allocation id, and the instance id and generation identities carry
 * now (redrawn after fork). Returns KVF_ERR_SYSTEM without random bytes. */
kvf_status kvf_mem_next_identity(kvf_mem_identity *id);

#ifdef __cplusplus
}
#endif

#endif /* KVF_HOST_PROVIDER_H */
