/* The cumem provider: CUDA virtual memory management with POSIX file
 * descriptor handles (the driver rules in FIELD-NOTES.md):
 *   - the handle type is requested at cuMemCreate; sizes are multiples of the
 *     granularity;
 *   - cuMemMap grants no access: cuMemSetAccess for every device that will
 *     touch the mapping;
 *   - each import pairs with one cuMemRelease, which may come right after
 *     cuMemMap: the mapping keeps the memory alive;
 *   - cuMemUnmap takes the whole mapping, cuMemAddressFree the whole range.
 * Every driver call goes through the entry-point table (host/cudawrap.h).
 *
 * The VMM calls need a current context; when the calling thread has none,
 * the device's primary context is retained (once per device, for the life
 * of the process, as the CUDA runtime does) and made current. */
#define _GNU_SOURCE
#include "host/memory/provider.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "common/error.h"
#include "host/core/cudawrap.h"
#include "host/core/log.h"
#include "host/core/syscalls.h"

/* Devices an access list may name (more than any machine has). */
#define KVF_CUMEM_MAX_DEVICES 64

#ifdef KVF_WITH_CUDA

/* Primary contexts this library retained, one per device; guarded by the lock. */
static pthread_mutex_t kvf_cumem_ctx_lock = PTHREAD_MUTEX_INITIALIZER;
static CUcontext kvf_cumem_primary[KVF_CUMEM_MAX_DEVICES];

static kvf_status kvf_cumem_device(int ordinal, CUdevice *dev, const char *field) {
  int count = 0;
  KVF_CU_CHECK(cuDeviceGetCount, &count);
  if (ordinal < 0 || ordinal >= count || ordinal >= KVF_CUMEM_MAX_DEVICES)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "%s %d is not a visible CUDA device (0..%d)", field, ordinal, count - 1);
  KVF_CU_CHECK(cuDeviceGet, dev, ordinal);
  return KVF_SUCCESS;
}

/* Make sure the calling thread has a current context (device `ordinal`'s
 * primary context if it has none). */
static kvf_status kvf_cumem_bind(int ordinal) {
  CUcontext cur = NULL;
  CUdevice dev;
  kvf_status st = KVF_SUCCESS;
  KVF_CU_CHECK(cuCtxGetCurrent, &cur);
  if (cur != NULL) return KVF_SUCCESS;
  if ((st = kvf_cumem_device(ordinal, &dev, "device")) != KVF_SUCCESS) return st;
  pthread_mutex_lock(&kvf_cumem_ctx_lock);
  if (kvf_cumem_primary[ordinal] == NULL) {
    CUcontext c = NULL;
    KVF_CU_CHECK_GOTO(st, out, cuDevicePrimaryCtxRetain, &c, dev);
    kvf_cumem_primary[ordinal] = c;
  }
  cur = kvf_cumem_primary[ordinal];
out:
  pthread_mutex_unlock(&kvf_cumem_ctx_lock);
  if (st != KVF_SUCCESS) return st;
  KVF_CU_CHECK(cuCtxSetCurrent, cur);
  return KVF_SUCCESS;
}

static void kvf_cumem_prop(CUmemAllocationProp *prop, int ordinal) {
  memset(prop, 0, sizeof *prop);
  prop->type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop->location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop->location.id = ordinal;
  prop->requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
}

static kvf_status kvf_cumem_granularity(int device, uint64_t *out) {
  kvf_status st;
  CUdevice dev;
  CUmemAllocationProp prop;
  size_t g = 0;
  if ((st = kvf_cuda_ready()) != KVF_SUCCESS) return st;
  if ((st = kvf_cumem_device(device, &dev, "device")) != KVF_SUCCESS) return st;
  kvf_cumem_prop(&prop, device);
  KVF_CU_CHECK(cuMemGetAllocationGranularity, &g, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
  if (g == 0) return kvf_fail(KVF_ERR_CUDA, "cuMemGetAllocationGranularity returned 0 for device %d", device);
  *out = g;
  return KVF_SUCCESS;
}

static kvf_status kvf_cumem_uuid(CUdevice dev, uint8_t out[16]) {
  CUuuid u;
  KVF_CU_CHECK(cuDeviceGetUuid, &u, dev);
  memcpy(out, u.bytes, 16);
  return KVF_SUCCESS;
}

/* Fill descs with read/write access for `first` (>= 0) and every device in
 * the list, each once. */
static kvf_status kvf_cumem_access(int first, const int *devices, uint32_t n, CUmemAccessDesc *descs,
                                   uint32_t *count, const char *field) {
  int visible = 0;
  uint32_t k = 0;
  KVF_CU_CHECK(cuDeviceGetCount, &visible);
  for (int64_t i = -1; i < (int64_t)n; i++) {
    int d = i < 0 ? first : devices[i];
    if (d < 0 && i < 0) continue;
    if (d < 0 || d >= visible || d >= KVF_CUMEM_MAX_DEVICES)
      return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "%s[%lld] %d is not a visible CUDA device (0..%d)", field,
                      (long long)i, d, visible - 1);
    int seen = 0;
    for (uint32_t j = 0; j < k; j++) seen |= descs[j].location.id == d;
    if (seen) continue;
    memset(&descs[k], 0, sizeof descs[k]);
    descs[k].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    descs[k].location.id = d;
    descs[k].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    k++;
  }
  *count = k;
  return KVF_SUCCESS;
}

static kvf_status kvf_cumem_create(const kvf_mem_alloc_options *o, uint64_t size, kvf_mem_alloc *a) {
  kvf_status st;
  CUdevice dev;
  CUmemAllocationProp prop;
  CUmemAccessDesc descs[KVF_CUMEM_MAX_DEVICES];
  uint32_t ndesc = 0;
  size_t gran = 0;
  int attr = 0;
  CUmemGenericAllocationHandle h = 0;
  CUdeviceptr ptr = 0;
  int created = 0, reserved = 0, mapped = 0;

  if ((st = kvf_cuda_ready()) != KVF_SUCCESS) return st;
  if ((st = kvf_cumem_device(o->device, &dev, "options.device")) != KVF_SUCCESS) return st;
  if (o->num_access_devices > KVF_CUMEM_MAX_DEVICES)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "options.num_access_devices %u is more than %d", o->num_access_devices,
                    KVF_CUMEM_MAX_DEVICES);
  if ((st = kvf_cumem_access(o->device, o->access_devices, o->num_access_devices, descs, &ndesc,
                             "options.access_devices")) != KVF_SUCCESS)
    return st;
  KVF_CU_CHECK(cuDeviceGetAttribute, &attr, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev);
  if (!attr)
    return kvf_fail(KVF_ERR_UNSUPPORTED, "device %d does not support CUDA virtual memory management", o->device);
  KVF_CU_CHECK(cuDeviceGetAttribute, &attr, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, dev);
  if (!attr)
    return kvf_fail(KVF_ERR_UNSUPPORTED,
                    "device %d cannot export memory as POSIX file descriptors "
                    "(CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED is 0)",
                    o->device);
  if ((st = kvf_cumem_bind(o->device)) != KVF_SUCCESS) return st;
  kvf_cumem_prop(&prop, o->device);
  KVF_CU_CHECK(cuMemGetAllocationGranularity, &gran, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
  if (gran == 0 || size % gran != 0)
    return kvf_fail(KVF_ERR_INTERNAL, "cumem create: size %" PRIu64 " is not a multiple of the granularity %zu", size,
                    gran);
  if ((st = kvf_cumem_uuid(dev, a->identity.device_uuid)) != KVF_SUCCESS) return st;

  KVF_CU_CHECK_GOTO(st, out, cuMemCreate, &h, (size_t)size, &prop, 0);
  created = 1;
  KVF_CU_CHECK_GOTO(st, out, cuMemAddressReserve, &ptr, (size_t)size, gran, 0, 0);
  reserved = 1;
  KVF_CU_CHECK_GOTO(st, out, cuMemMap, ptr, (size_t)size, 0, h, 0);
  mapped = 1;
  KVF_CU_CHECK_GOTO(st, out, cuMemSetAccess, ptr, (size_t)size, descs, ndesc);
  a->ptr = (void *)(uintptr_t)ptr;
  a->handle = (uint64_t)h;
  a->device = o->device;
  return KVF_SUCCESS;

out:
  /* Undo in reverse; failures here are logged (the first error is what the
   * caller sees). */
  if (mapped && KVF_CU(cuMemUnmap)(ptr, (size_t)size) != CUDA_SUCCESS)
    KVF_WARN(MEM, "cuMemUnmap while undoing a failed cumem allocation failed (range leaked)");
  if (reserved && KVF_CU(cuMemAddressFree)(ptr, (size_t)size) != CUDA_SUCCESS)
    KVF_WARN(MEM, "cuMemAddressFree while undoing a failed cumem allocation failed");
  if (created && KVF_CU(cuMemRelease)(h) != CUDA_SUCCESS)
    KVF_WARN(MEM, "cuMemRelease while undoing a failed cumem allocation failed");
  return st;
}

static kvf_status kvf_cumem_find(const void *ptr, kvf_mem_alloc *a) {
  kvf_status st;
  CUdeviceptr base = 0;
  size_t size = 0;
  CUmemGenericAllocationHandle h = 0;
  CUmemAllocationProp prop;
  CUdevice dev;
  CUresult r;
  char what[192];

  if ((st = kvf_cuda_ready()) != KVF_SUCCESS) return st;
  if ((st = kvf_cumem_bind(0)) != KVF_SUCCESS) return st;
  r = KVF_CU(cuMemGetAddressRange)(&base, &size, (CUdeviceptr)(uintptr_t)ptr);
  if (r != CUDA_SUCCESS)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT,
                    "kvf_mem_alloc_find: %p is not device memory the CUDA driver knows (cuMemGetAddressRange: %s)",
                    ptr, kvf_cu_describe(r, what, sizeof what));
  r = KVF_CU(cuMemRetainAllocationHandle)(&h, (void *)(uintptr_t)base);
  if (r != CUDA_SUCCESS)
    return kvf_fail(KVF_ERR_UNSUPPORTED,
                    "kvf_mem_alloc_find: %p is device memory that was not allocated with cuMemCreate (cudaMalloc'd "
                    "or from a caching allocator?), so it cannot be exported to another process "
                    "(cuMemRetainAllocationHandle: %s). Allocate the KV cache with kvf_mem_alloc_create "
                    "(provider cumem), or with cuMemCreate and CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR",
                    ptr, kvf_cu_describe(r, what, sizeof what));
  KVF_CU_CHECK_GOTO(st, out, cuMemGetAllocationPropertiesFromHandle, &prop, h);
  if (!(prop.requestedHandleTypes & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)) {
    st = kvf_fail(KVF_ERR_UNSUPPORTED,
                  "kvf_mem_alloc_find: the cuMem allocation at %p was created without "
                  "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, so it cannot be exported; allocate it with "
                  "kvf_mem_alloc_create (provider cumem) or request that handle type at cuMemCreate",
                  (void *)(uintptr_t)base);
    goto out;
  }
  if (prop.location.type != CU_MEM_LOCATION_TYPE_DEVICE) {
    st = kvf_fail(KVF_ERR_UNSUPPORTED, "kvf_mem_alloc_find: the cuMem allocation at %p is not device memory "
                  "(location type %d); only device memory is exported so far",
                  (void *)(uintptr_t)base, (int)prop.location.type);
    goto out;
  }
  if ((st = kvf_cumem_device(prop.location.id, &dev, "allocation location")) != KVF_SUCCESS) goto out;
  if ((st = kvf_cumem_uuid(dev, a->identity.device_uuid)) != KVF_SUCCESS) goto out;
  a->ptr = (void *)(uintptr_t)base;
  a->size = size;
  a->handle = (uint64_t)h;
  a->device = prop.location.id;
  return KVF_SUCCESS;
out:
  if (KVF_CU(cuMemRelease)(h) != CUDA_SUCCESS) KVF_WARN(MEM, "cuMemRelease of a retained handle failed (leaked)");
  return st;
}

static kvf_status kvf_cumem_export(kvf_mem_alloc *a, int *fd) {
  int out = -1;
  kvf_status st;
  if ((st = kvf_cumem_bind(a->device)) != KVF_SUCCESS) return st;
  KVF_CU_CHECK(cuMemExportToShareableHandle, &out, (CUmemGenericAllocationHandle)a->handle,
               CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
  /* Keep it from leaking into children the exporter spawns. */
  if (KVF_SYS(fcntl)(out, F_SETFD, FD_CLOEXEC) != 0) {
    st = KVF_SYS_FAIL(KVF_ERR_SYSTEM, errno, "fcntl(F_SETFD, FD_CLOEXEC) on an exported cuMem descriptor");
    kvf_sys_close(out);
    return st;
  }
  *fd = out;
  return KVF_SUCCESS;
}

static void kvf_cumem_destroy(kvf_mem_alloc *a) {
  CUdeviceptr p = (CUdeviceptr)(uintptr_t)a->ptr;
  if (kvf_cumem_bind(a->device) != KVF_SUCCESS) {
    KVF_WARN(MEM, "destroying a cumem allocation: no context for device %d: %s (leaked)", a->device,
             kvf_last_error());
    return;
  }
  if (a->owned) {
    if (KVF_CU(cuMemUnmap)(p, (size_t)a->size) != CUDA_SUCCESS)
      KVF_WARN(MEM, "cuMemUnmap(%p) of a cumem allocation failed (leaked)", a->ptr);
    else if (KVF_CU(cuMemAddressFree)(p, (size_t)a->size) != CUDA_SUCCESS)
      KVF_WARN(MEM, "cuMemAddressFree(%p) of a cumem allocation failed", a->ptr);
  }
  if (KVF_CU(cuMemRelease)((CUmemGenericAllocationHandle)a->handle) != CUDA_SUCCESS)
    KVF_WARN(MEM, "cuMemRelease of a cumem allocation's handle failed (leaked)");
}

/* Visible device ordinal with this UUID. */
static kvf_status kvf_cumem_find_uuid(const uint8_t uuid[16], int *device) {
  int count = 0;
  KVF_CU_CHECK(cuDeviceGetCount, &count);
  for (int i = 0; i < count; i++) {
    CUdevice dev;
    CUuuid u;
    KVF_CU_CHECK(cuDeviceGet, &dev, i);
    KVF_CU_CHECK(cuDeviceGetUuid, &u, dev);
    if (memcmp(u.bytes, uuid, 16) == 0) {
      *device = i;
      return KVF_SUCCESS;
    }
  }
  return kvf_fail(KVF_ERR_NOT_FOUND,
                  "no visible CUDA device has UUID GPU-%02x%02x%02x%02x-...; check CUDA_VISIBLE_DEVICES", uuid[0],
                  uuid[1], uuid[2], uuid[3]);
}

kvf_status kvf_mem_device_from_uuid(const uint8_t uuid[16], int *device) {
  if (uuid == NULL || device == NULL)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_mem_device_from_uuid: %s is NULL", uuid ? "device" : "uuid");
  kvf_status st = kvf_cuda_ready();
  if (st != KVF_SUCCESS) return st;
  return kvf_cumem_find_uuid(uuid, device);
}

/* Whether an imported handle is device memory of device `ordinal`, as the
 * identity (its device UUID) says. */
static kvf_status kvf_cumem_check_props(const CUmemAllocationProp *prop, int ordinal) {
  if (prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
    return kvf_fail(KVF_ERR_PROTOCOL,
                    "fd: the identity names a GPU but the descriptor's memory is not device memory (location type %d)",
                    (int)prop->location.type);
  if (prop->location.id != ordinal)
    return kvf_fail(KVF_ERR_PROTOCOL,
                    "fd: the descriptor's memory is on device %d, the identity's GPU (by UUID) is device %d",
                    prop->location.id, ordinal);
  return KVF_SUCCESS;
}

static kvf_status kvf_cumem_import(int fd, const kvf_mem_identity *id, kvf_import_res *r) {
  kvf_status st;
  int ordinal = -1;
  CUmemGenericAllocationHandle h = 0;
  CUmemAllocationProp prop;
  size_t gran = 0;
  CUresult cr;
  struct stat sb;

  if ((st = kvf_cuda_ready()) != KVF_SUCCESS) goto out;
  if ((st = kvf_cumem_find_uuid(id->device_uuid, &ordinal)) != KVF_SUCCESS) {
    if (st == KVF_ERR_NOT_FOUND) {
      char why[256];
      snprintf(why, sizeof why, "%s", kvf_last_error());
      st = kvf_fail(KVF_ERR_NO_DEVICE, "cumem import: the GPU holding the memory is not visible here: %s", why);
    }
    goto out;
  }
  /* Recorded for diagnostics; not an identity (see kvf_cumem_same). */
  if (KVF_SYS(fstat)(fd, &sb) != 0) {
    st = KVF_SYS_FAIL(errno == EBADF ? KVF_ERR_INVALID_ARGUMENT : KVF_ERR_SYSTEM, errno,
                      "fstat of an imported cumem descriptor");
    goto out;
  }
  r->st_dev = (uint64_t)sb.st_dev;
  r->st_ino = (uint64_t)sb.st_ino;
  if ((st = kvf_cumem_bind(ordinal)) != KVF_SUCCESS) goto out;
  cr = KVF_CU(cuMemImportFromShareableHandle)(&h, (void *)(intptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  /* The descriptor has done its work either way. */
  kvf_sys_close(fd);
  fd = -1;
  if (cr != CUDA_SUCCESS) {
    st = kvf_cu_fail(cr, "cuMemImportFromShareableHandle", __FILE__, __LINE__);
    kvf_error_prefix("fd: ");
    goto out;
  }
  r->handle = (uint64_t)h;
  r->device = ordinal;
  r->held |= KVF_RES_HANDLE;
  KVF_CU_CHECK_GOTO(st, out, cuMemGetAllocationPropertiesFromHandle, &prop, h);
  /* The UUID is what identifies the GPU; the driver reports the imported
   * memory's location in this process's ordinals, which must be the
   * device that UUID is here. */
  if ((st = kvf_cumem_check_props(&prop, ordinal)) != KVF_SUCCESS) goto out;
  KVF_CU_CHECK_GOTO(st, out, cuMemGetAllocationGranularity, &gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
  if (gran == 0 || id->size == 0 || id->size % gran != 0 || id->size > (uint64_t)SIZE_MAX) {
    st = kvf_fail(KVF_ERR_PROTOCOL, "size: identity size %" PRIu64 " is not a multiple of the granularity %zu",
                  id->size, gran);
    goto out;
  }
  r->size = id->size;
  r->align = gran;
out:
  kvf_sys_close(fd);
  return st;
}

/* A descriptor sent for an identity this process maps already: import it
 * (the handle is released at once) and check that it is device memory of
 * the mapping's device. Its inode cannot tell allocations apart: with the
 * NVIDIA driver every POSIX-FD export is an open of /dev/nvidiactl (driver
 * 580.159.04 on an H200: exports of one allocation and of another all
 * fstat as dev 6, ino 142, a character device), and MemoryGpu.ExportInodes
 * reports it for each driver. So a descriptor of another allocation on the
 * same GPU passes this check: the table's ownership rule (only the client
 * that imported a mapping may alias it) is what keeps another client out. */
static kvf_status kvf_cumem_same(int fd, const kvf_mem_identity *id, const kvf_import_res *r) {
  (void)id;
  kvf_status st = KVF_SUCCESS;
  CUmemGenericAllocationHandle h = 0;
  CUmemAllocationProp prop;
  struct stat sb;
  if (KVF_SYS(fstat)(fd, &sb) != 0)
    return KVF_SYS_FAIL(errno == EBADF ? KVF_ERR_INVALID_ARGUMENT : KVF_ERR_SYSTEM, errno,
                        "fstat of a cumem descriptor for a mapped identity");
  if (S_ISFIFO(sb.st_mode) || S_ISSOCK(sb.st_mode) || S_ISDIR(sb.st_mode))
    return kvf_fail(KVF_ERR_PROTOCOL, "fd: descriptor %d is %s, not a cuMem export", fd,
                    S_ISFIFO(sb.st_mode) ? "a pipe" : S_ISSOCK(sb.st_mode) ? "a socket" : "a directory");
  if ((st = kvf_cumem_bind(r->device)) != KVF_SUCCESS) return st;
  CUresult cr =
      KVF_CU(cuMemImportFromShareableHandle)(&h, (void *)(intptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  if (cr != CUDA_SUCCESS) {
    st = kvf_cu_fail(cr, "cuMemImportFromShareableHandle", __FILE__, __LINE__);
    kvf_error_prefix("fd: descriptor %d for a mapped identity: ", fd);
    return st;
  }
  cr = KVF_CU(cuMemGetAllocationPropertiesFromHandle)(&prop, h);
  if (cr != CUDA_SUCCESS)
    st = kvf_cu_fail(cr, "cuMemGetAllocationPropertiesFromHandle", __FILE__, __LINE__);
  else
    st = kvf_cumem_check_props(&prop, r->device);
  /* A release that fails is tried once more; then the handle is lost (logged). */
  if (KVF_CU(cuMemRelease)(h) != CUDA_SUCCESS && KVF_CU(cuMemRelease)(h) != CUDA_SUCCESS)
    KVF_WARN(MEM, "cumem: the handle imported to check a descriptor could not be released (leaked)");
  return st;
}

static kvf_status kvf_cumem_reserve(kvf_import_res *r) {
  CUdeviceptr p = 0;
  kvf_status st = kvf_cumem_bind(r->device);
  if (st != KVF_SUCCESS) return st;
  KVF_CU_CHECK(cuMemAddressReserve, &p, (size_t)r->size, (size_t)r->align, 0, 0);
  r->addr = (void *)(uintptr_t)p;
  r->held |= KVF_RES_RESERVED;
  return KVF_SUCCESS;
}

static kvf_status kvf_cumem_map(kvf_import_res *r) {
  kvf_status st = kvf_cumem_bind(r->device);
  if (st != KVF_SUCCESS) return st;
  KVF_CU_CHECK(cuMemMap, (CUdeviceptr)(uintptr_t)r->addr, (size_t)r->size, 0, (CUmemGenericAllocationHandle)r->handle,
               0);
  r->held |= KVF_RES_MAPPED;
  return KVF_SUCCESS;
}

static kvf_status kvf_cumem_set_access(kvf_import_res *r, const int *devices, uint32_t n) {
  CUmemAccessDesc descs[KVF_CUMEM_MAX_DEVICES];
  uint32_t k = 0;
  kvf_status st = kvf_cumem_bind(r->device);
  if (st != KVF_SUCCESS) return st;
  if (n > KVF_CUMEM_MAX_DEVICES - 1)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "access_devices: %u devices is more than %d", n,
                    KVF_CUMEM_MAX_DEVICES - 1);
  if ((st = kvf_cumem_access(r->device, devices, n, descs, &k, "access_devices")) != KVF_SUCCESS) return st;
  KVF_CU_CHECK(cuMemSetAccess, (CUdeviceptr)(uintptr_t)r->addr, (size_t)r->size, descs, k);
  r->held |= KVF_RES_ACCESS;
  return KVF_SUCCESS;
}

static kvf_status kvf_cumem_release(kvf_import_res *r) {
  if (!(r->held & KVF_RES_HANDLE)) return KVF_SUCCESS;
  kvf_status st = kvf_cumem_bind(r->device);
  if (st != KVF_SUCCESS) return st;
  KVF_CU_CHECK(cuMemRelease, (CUmemGenericAllocationHandle)r->handle);
  r->held &= ~KVF_RES_HANDLE;
  r->handle = 0;
  return KVF_SUCCESS;
}

static kvf_status kvf_cumem_unmap(kvf_import_res *r) {
  if (!(r->held & KVF_RES_MAPPED)) return KVF_SUCCESS;
  kvf_status st = kvf_cumem_bind(r->device);
  if (st != KVF_SUCCESS) return st;
  KVF_CU_CHECK(cuMemUnmap, (CUdeviceptr)(uintptr_t)r->addr, (size_t)r->size);
  r->held &= ~(KVF_RES_MAPPED | KVF_RES_ACCESS);
  return KVF_SUCCESS;
}

static kvf_status kvf_cumem_address_free(kvf_import_res *r) {
  if (!(r->held & KVF_RES_RESERVED)) return KVF_SUCCESS;
  kvf_status st = kvf_cumem_bind(r->device);
  if (st != KVF_SUCCESS) return st;
  KVF_CU_CHECK(cuMemAddressFree, (CUdeviceptr)(uintptr_t)r->addr, (size_t)r->size);
  r->held &= ~KVF_RES_RESERVED;
  r->addr = NULL;
  return KVF_SUCCESS;
}

#else /* !KVF_WITH_CUDA: every operation says this build has no CUDA. */

static kvf_status kvf_cumem_none(void) { return kvf_cuda_ready(); }
static kvf_status kvf_cumem_granularity(int device, uint64_t *out) {
  (void)device;
  (void)out;
  return kvf_cumem_none();
}
static kvf_status kvf_cumem_create(const kvf_mem_alloc_options *o, uint64_t size, kvf_mem_alloc *a) {
  (void)o;
  (void)size;
  (void)a;
  return kvf_cumem_none();
}
static kvf_status kvf_cumem_find(const void *ptr, kvf_mem_alloc *a) {
  (void)ptr;
  (void)a;
  return kvf_cumem_none();
}
static kvf_status kvf_cumem_export(kvf_mem_alloc *a, int *fd) {
  (void)a;
  (void)fd;
  return kvf_cumem_none();
}
static void kvf_cumem_destroy(kvf_mem_alloc *a) { (void)a; }
static kvf_status kvf_cumem_import(int fd, const kvf_mem_identity *id, kvf_import_res *r) {
  (void)id;
  (void)r;
  kvf_sys_close(fd);
  return kvf_cumem_none();
}
static kvf_status kvf_cumem_same(int fd, const kvf_mem_identity *id, const kvf_import_res *r) {
  (void)fd;
  (void)id;
  (void)r;
  return kvf_cumem_none();
}
static kvf_status kvf_cumem_step(kvf_import_res *r) {
  (void)r;
  return kvf_cumem_none();
}
#define kvf_cumem_reserve kvf_cumem_step
#define kvf_cumem_map kvf_cumem_step
static kvf_status kvf_cumem_set_access(kvf_import_res *r, const int *devices, uint32_t n) {
  (void)devices;
  (void)n;
  return kvf_cumem_step(r);
}
/* Nothing can have been acquired: closing steps succeed. */
static kvf_status kvf_cumem_nothing(kvf_import_res *r) {
  (void)r;
  return KVF_SUCCESS;
}
#define kvf_cumem_release kvf_cumem_nothing
#define kvf_cumem_unmap kvf_cumem_nothing
#define kvf_cumem_address_free kvf_cumem_nothing

kvf_status kvf_mem_device_from_uuid(const uint8_t uuid[16], int *device) {
  if (uuid == NULL || device == NULL)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_mem_device_from_uuid: %s is NULL", uuid ? "device" : "uuid");
  return kvf_cumem_none();
}

#endif /* KVF_WITH_CUDA */

const kvf_provider_ops kvf_provider_cumem = {
    .kind = KVF_MEM_PROVIDER_CUMEM,
    .name = "cumem",
    .granularity = kvf_cumem_granularity,
    .create = kvf_cumem_create,
    .find = kvf_cumem_find,
    .export_fd = kvf_cumem_export,
    .destroy = kvf_cumem_destroy,
    .import = kvf_cumem_import,
    .same = kvf_cumem_same,
    .reserve = kvf_cumem_reserve,
    .map = kvf_cumem_map,
    .set_access = kvf_cumem_set_access,
    .release = kvf_cumem_release,
    .unmap = kvf_cumem_unmap,
    .address_free = kvf_cumem_address_free,
};
