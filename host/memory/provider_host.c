/* The host provider: shared host memory from memfd_create + mmap.
 *
 * The memfd is sealed against shrinking and growing before it is exported,
 * so an importer can trust its size (a file shrunk under a mapping turns
 * reads into SIGBUS). The importer's steps mirror cuMem's, each a separate
 * system call through the fault-injectable table: reserve (an anonymous
 * PROT_NONE range), map (the memfd over it, still PROT_NONE), set access
 * (mprotect read/write), release (close the memfd: the mapping keeps the
 * memory alive), unmap (an anonymous PROT_NONE range over it again) and
 * address free (munmap). */
#define _GNU_SOURCE
#include "host/memory/provider.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/error.h"
#include "host/core/log.h"
#include "host/core/syscalls.h"

static uint64_t kvf_host_page(void) {
  long p = sysconf(_SC_PAGESIZE);
  return p > 0 ? (uint64_t)p : 4096u;
}

static kvf_status kvf_host_granularity(int device, uint64_t *out) {
  (void)device;
  *out = kvf_host_page();
  return KVF_SUCCESS;
}

static kvf_status kvf_host_create(const kvf_mem_alloc_options *o, uint64_t size, kvf_mem_alloc *a) {
  kvf_status st = KVF_SUCCESS;
  int fd = -1;
  void *p = MAP_FAILED;
  if (size > (uint64_t)INT64_MAX || size > (uint64_t)SIZE_MAX)
    return kvf_fail(KVF_ERR_OVERFLOW, "host provider: size %" PRIu64 " is too large", size);
  fd = KVF_SYS(memfd_create)(o->name ? o->name : "kvferry", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return KVF_SYS_FAIL(KVF_ERR_SYSTEM, errno, "memfd_create");
  if (KVF_SYS(ftruncate)(fd, (off_t)size) != 0) {
    st = KVF_SYS_FAIL(errno == ENOSPC || errno == ENOMEM ? KVF_ERR_OUT_OF_MEMORY : KVF_ERR_SYSTEM, errno,
                      "ftruncate of the memfd");
    goto out;
  }
  if (KVF_SYS(fcntl)(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    st = KVF_SYS_FAIL(KVF_ERR_SYSTEM, errno, "fcntl(F_ADD_SEALS) on the memfd");
    goto out;
  }
  p = KVF_SYS(mmap)(NULL, (size_t)size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    st = KVF_SYS_FAIL(errno == ENOMEM ? KVF_ERR_OUT_OF_MEMORY : KVF_ERR_SYSTEM, errno, "mmap of the memfd");
    goto out;
  }
  a->ptr = p;
  a->fd = fd;
  a->device = -1;
  memset(a->identity.device_uuid, 0, sizeof a->identity.device_uuid);
  fd = -1;
out:
  kvf_sys_close(fd);
  return st;
}

static kvf_status kvf_host_export(kvf_mem_alloc *a, int *fd) {
  int d = KVF_SYS(fcntl)(a->fd, F_DUPFD_CLOEXEC, 0);
  if (d < 0) return KVF_SYS_FAIL(KVF_ERR_SYSTEM, errno, "fcntl(F_DUPFD_CLOEXEC) exporting a memfd");
  *fd = d;
  return KVF_SUCCESS;
}

static void kvf_host_destroy(kvf_mem_alloc *a) {
  if (a->owned && a->ptr != NULL && KVF_SYS(munmap)(a->ptr, (size_t)a->size) != 0)
    KVF_WARN(MEM, "munmap(%p, %" PRIu64 ") of a host allocation: %s (leaked)", a->ptr, a->size, strerror(errno));
  kvf_sys_close(a->fd);
  a->fd = -1;
}

/* What a host descriptor is, for messages. */
static const char *kvf_host_kind(mode_t m) {
  return S_ISFIFO(m) ? "a pipe" : S_ISSOCK(m) ? "a socket" : S_ISDIR(m) ? "a directory" : S_ISCHR(m) ? "a device"
         : S_ISBLK(m) ? "a block device" : "not a regular file";
}

static kvf_status kvf_host_import(int fd, const kvf_mem_identity *id, kvf_import_res *r) {
  kvf_status st = KVF_SUCCESS;
  struct stat s;
  uint64_t page = kvf_host_page();
  if (KVF_SYS(fstat)(fd, &s) != 0) {
    st = KVF_SYS_FAIL(errno == EBADF ? KVF_ERR_INVALID_ARGUMENT : KVF_ERR_SYSTEM, errno,
                      "fstat of an imported host descriptor");
    goto out;
  }
  if (!S_ISREG(s.st_mode)) {
    st = kvf_fail(KVF_ERR_PROTOCOL, "fd: descriptor %d is %s, not a memfd (host provider)", fd, kvf_host_kind(s.st_mode));
    goto out;
  }
  if ((uint64_t)s.st_size != id->size || id->size % page != 0 || id->size > (uint64_t)SIZE_MAX) {
    st = kvf_fail(KVF_ERR_PROTOCOL,
                  "size: identity size %" PRIu64 " does not match the descriptor's %lld bytes (or is not a "
                  "multiple of the page size %" PRIu64 ")",
                  id->size, (long long)s.st_size, page);
    goto out;
  }
  int seals = KVF_SYS(fcntl)(fd, F_GET_SEALS, 0);
  if (seals < 0 && errno == EINVAL) {
    st = kvf_fail(KVF_ERR_PROTOCOL, "fd: descriptor %d is a file that cannot be sealed, not a memfd (host provider)",
                  fd);
    goto out;
  }
  if (seals < 0) {
    st = KVF_SYS_FAIL(KVF_ERR_SYSTEM, errno, "fcntl(F_GET_SEALS) on an imported host descriptor");
    goto out;
  }
  if (!(seals & F_SEAL_SHRINK)) {
    st = kvf_fail(KVF_ERR_PROTOCOL,
                  "fd: the memfd is not sealed against shrinking (F_SEAL_SHRINK); a shrink would turn "
                  "reads of the mapping into SIGBUS. Allocate with kvf_mem_alloc_create");
    goto out;
  }
  r->fd = fd;
  r->size = id->size;
  r->align = page;
  r->device = -1;
  r->st_dev = (uint64_t)s.st_dev;
  r->st_ino = (uint64_t)s.st_ino;
  r->held |= KVF_RES_HANDLE;
  fd = -1;
out:
  kvf_sys_close(fd);
  return st;
}

static kvf_status kvf_host_same(int fd, const kvf_mem_identity *id, const kvf_import_res *r) {
  struct stat s;
  if (KVF_SYS(fstat)(fd, &s) != 0)
    return KVF_SYS_FAIL(errno == EBADF ? KVF_ERR_INVALID_ARGUMENT : KVF_ERR_SYSTEM, errno,
                        "fstat of a host descriptor for a mapped identity");
  if (!S_ISREG(s.st_mode))
    return kvf_fail(KVF_ERR_PROTOCOL, "fd: descriptor %d is %s, not the memfd mapped for this identity", fd,
                    kvf_host_kind(s.st_mode));
  if ((uint64_t)s.st_dev != r->st_dev || (uint64_t)s.st_ino != r->st_ino)
    return kvf_fail(KVF_ERR_PROTOCOL,
                    "fd: descriptor %d (inode %" PRIu64 " on device %" PRIu64 ") is not the memfd mapped for this "
                    "identity (inode %" PRIu64 " on device %" PRIu64 ")",
                    fd, (uint64_t)s.st_ino, (uint64_t)s.st_dev, r->st_ino, r->st_dev);
  if ((uint64_t)s.st_size != id->size)
    return kvf_fail(KVF_ERR_PROTOCOL, "size: identity size %" PRIu64 " does not match the descriptor's %lld bytes",
                    id->size, (long long)s.st_size);
  return KVF_SUCCESS;
}

static kvf_status kvf_host_reserve(kvf_import_res *r) {
  void *p = KVF_SYS(mmap)(NULL, (size_t)r->size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED)
    return KVF_SYS_FAIL(errno == ENOMEM ? KVF_ERR_OUT_OF_MEMORY : KVF_ERR_SYSTEM, errno,
                        "mmap reserving an address range for a host import");
  r->addr = p;
  r->held |= KVF_RES_RESERVED;
  return KVF_SUCCESS;
}

static kvf_status kvf_host_map(kvf_import_res *r) {
  void *p = KVF_SYS(mmap)(r->addr, (size_t)r->size, PROT_NONE, MAP_SHARED | MAP_FIXED, r->fd, 0);
  if (p == MAP_FAILED)
    return KVF_SYS_FAIL(errno == ENOMEM ? KVF_ERR_OUT_OF_MEMORY : KVF_ERR_SYSTEM, errno, "mmap of a host import");
  r->held |= KVF_RES_MAPPED;
  return KVF_SUCCESS;
}

static kvf_status kvf_host_set_access(kvf_import_res *r, const int *devices, uint32_t n) {
  (void)devices;
  (void)n;
  if (KVF_SYS(mprotect)(r->addr, (size_t)r->size, PROT_READ | PROT_WRITE) != 0)
    return KVF_SYS_FAIL(KVF_ERR_SYSTEM, errno, "mprotect granting access to a host import");
  r->held |= KVF_RES_ACCESS;
  return KVF_SUCCESS;
}

static kvf_status kvf_host_release(kvf_import_res *r) {
  if (!(r->held & KVF_RES_HANDLE)) return KVF_SUCCESS;
  kvf_sys_close(r->fd); /* the descriptor is gone even if close reports an error */
  r->fd = -1;
  r->held &= ~KVF_RES_HANDLE;
  return KVF_SUCCESS;
}

static kvf_status kvf_host_unmap(kvf_import_res *r) {
  if (!(r->held & KVF_RES_MAPPED)) return KVF_SUCCESS;
  /* Put a reservation back over the range, so the address stays ours until
   * address_free, as with cuMemUnmap. */
  void *p = KVF_SYS(mmap)(r->addr, (size_t)r->size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE,
                          -1, 0);
  if (p == MAP_FAILED) return KVF_SYS_FAIL(KVF_ERR_SYSTEM, errno, "mmap unmapping a host import");
  r->held &= ~(KVF_RES_MAPPED | KVF_RES_ACCESS);
  return KVF_SUCCESS;
}

static kvf_status kvf_host_address_free(kvf_import_res *r) {
  if (!(r->held & KVF_RES_RESERVED)) return KVF_SUCCESS;
  if (KVF_SYS(munmap)(r->addr, (size_t)r->size) != 0)
    return KVF_SYS_FAIL(KVF_ERR_SYSTEM, errno, "munmap freeing a host import's address range");
  r->held &= ~KVF_RES_RESERVED;
  r->addr = NULL;
  return KVF_SUCCESS;
}

const kvf_provider_ops kvf_provider_host = {
    .kind = KVF_MEM_PROVIDER_HOST,
    .name = "host",
    .granularity = kvf_host_granularity,
    .create = kvf_host_create,
    .find = NULL,
    .export_fd = kvf_host_export,
    .destroy = kvf_host_destroy,
    .import = kvf_host_import,
    .same = kvf_host_same,
    .reserve = kvf_host_reserve,
    .map = kvf_host_map,
    .set_access = kvf_host_set_access,
    .release = kvf_host_release,
    .unmap = kvf_host_unmap,
    .address_free = kvf_host_address_free,
};
