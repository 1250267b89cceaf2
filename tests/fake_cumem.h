// A CPU model of the CUDA driver's virtual-memory API, installed through
// the entry-point table (host/cudawrap.h), so the cumem provider and the
// import table run for real on a machine without a GPU: allocations are
// memfds, reservations are PROT_NONE ranges, cuMemMap maps the memfd,
// cuMemSetAccess is mprotect, exported handles are descriptors. It keeps the
// driver rules the library depends on and fails calls that break them (size
// not a multiple of the granularity, unmapping part of a mapping, freeing a
// range that still has memory mapped, using a released handle), and counts
// what is live so tests can see leaks from the driver's side.
//
// Importing the same descriptor twice gives two handles, as the real driver
// does. A descriptor carries its device and handle types in the memfd name,
// so a forked process can import it too. "Legacy" ranges model cudaMalloc'd
// memory: cuMemGetAddressRange knows them, cuMemRetainAllocationHandle refuses.
//
// Single-threaded, like the tests that use it.
#pragma once

#if KVF_WITH_CUDA

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <vector>

#include "host/core/cudawrap.h"

namespace fakecu {

constexpr size_t kGranularity = 2u << 20;

struct Alloc {
  int fd = -1;
  size_t size = 0;
  int device = 0;
  unsigned long long types = 0;
  int handles = 0;  // live handles naming it
  int maps = 0;     // live mappings of it
};
struct Handle {
  Alloc *a = nullptr;
  int refs = 0;
};
struct Range {
  uintptr_t addr;
  size_t size;
};
struct Map {
  uintptr_t addr;
  size_t size;
  Alloc *a;
  CUmemGenericAllocationHandle h;
};

struct State {
  std::map<CUmemGenericAllocationHandle, Handle> handles;
  CUmemGenericAllocationHandle next = 0x100;
  std::vector<Range> reservations;
  std::vector<Map> maps;
  std::vector<Range> legacy;
  int allocs = 0;
  int devices = 2;
  int posix_fd_supported = 1;
  long calls = 0;
};
inline State &S() {
  static State s;
  return s;
}
inline CUcontext &current() {
  static thread_local CUcontext c = nullptr;
  return c;
}

struct Live {
  int allocs, handles, reservations, maps;
};
inline Live live() {
  return {S().allocs, (int)S().handles.size(), (int)S().reservations.size(), (int)S().maps.size()};
}

inline void maybe_free(Alloc *a) {
  if (a->handles == 0 && a->maps == 0) {
    ::close(a->fd);
    delete a;
    S().allocs--;
  }
}

inline Alloc *new_alloc(int fd, size_t size, int device, unsigned long long types) {
  Alloc *a = new Alloc;
  a->fd = fd;
  a->size = size;
  a->device = device;
  a->types = types;
  S().allocs++;
  return a;
}

inline CUmemGenericAllocationHandle new_handle(Alloc *a) {
  CUmemGenericAllocationHandle h = S().next++;
  S().handles[h] = Handle{a, 1};
  a->handles++;
  return h;
}

inline Map *map_containing(uintptr_t p) {
  for (auto &m : S().maps)
    if (p >= m.addr && p - m.addr < m.size) return &m;
  return nullptr;
}

// A range that looks like cudaMalloc'd memory (not exportable).
inline void *legacy_alloc(size_t size) {
  void *p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  S().legacy.push_back({(uintptr_t)p, size});
  return p;
}
inline void legacy_free(void *p) {
  auto &v = S().legacy;
  for (size_t i = 0; i < v.size(); i++)
    if (v[i].addr == (uintptr_t)p) {
      ::munmap(p, v[i].size);
      v.erase(v.begin() + (long)i);
      return;
    }
}

// The driver's own descriptors live from here up, apart from the ones
// tests look at (exported descriptors are the caller's: those stay low).
constexpr int kHighFd = 512;
inline int high_fd(int fd) {
  int h = ::fcntl(fd, F_DUPFD_CLOEXEC, kHighFd);
  ::close(fd);
  return h;
}

inline CUresult cuInit(unsigned int) { return CUDA_SUCCESS; }
inline CUresult cuDriverGetVersion(int *v) {
  *v = 13000;
  return CUDA_SUCCESS;
}
inline CUresult cuGetErrorName(CUresult r, const char **s) {
  switch (r) {
  case CUDA_ERROR_INVALID_VALUE: *s = "CUDA_ERROR_INVALID_VALUE"; break;
  case CUDA_ERROR_OUT_OF_MEMORY: *s = "CUDA_ERROR_OUT_OF_MEMORY"; break;
  case CUDA_ERROR_NOT_SUPPORTED: *s = "CUDA_ERROR_NOT_SUPPORTED"; break;
  case CUDA_ERROR_INVALID_DEVICE: *s = "CUDA_ERROR_INVALID_DEVICE"; break;
  default: return CUDA_ERROR_INVALID_VALUE;
  }
  return CUDA_SUCCESS;
}
inline CUresult cuGetErrorString(CUresult r, const char **s) {
  const char *n = nullptr;
  if (fakecu::cuGetErrorName(r, &n) != CUDA_SUCCESS) return CUDA_ERROR_INVALID_VALUE;
  *s = "fake driver error";
  return CUDA_SUCCESS;
}
inline CUresult cuDeviceGetCount(int *n) {
  *n = S().devices;
  return CUDA_SUCCESS;
}
inline CUresult cuDeviceGet(CUdevice *d, int ordinal) {
  if (ordinal < 0 || ordinal >= S().devices) return CUDA_ERROR_INVALID_DEVICE;
  *d = ordinal;
  return CUDA_SUCCESS;
}
inline CUresult cuDeviceGetAttribute(int *v, CUdevice_attribute attr, CUdevice d) {
  if (d < 0 || d >= S().devices) return CUDA_ERROR_INVALID_DEVICE;
  if (attr == CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED)
    *v = S().posix_fd_supported;
  else if (attr == CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)
    *v = 1;
  else
    *v = 0;
  return CUDA_SUCCESS;
}
inline CUresult cuDeviceGetName(char *name, int len, CUdevice d) {
  std::snprintf(name, (size_t)len, "Fake VMM GPU %d", (int)d);
  return CUDA_SUCCESS;
}
inline CUresult cuDeviceGetUuid(CUuuid *u, CUdevice d) {
  if (d < 0 || d >= S().devices) return CUDA_ERROR_INVALID_DEVICE;
  std::memset(u->bytes, 0, sizeof u->bytes);
  u->bytes[0] = (char)0xFA;
  u->bytes[1] = (char)0xCE;
  u->bytes[15] = (char)d;
  return CUDA_SUCCESS;
}
inline CUresult cuCtxGetCurrent(CUcontext *c) {
  *c = current();
  return CUDA_SUCCESS;
}
inline CUresult cuCtxSetCurrent(CUcontext c) {
  current() = c;
  return CUDA_SUCCESS;
}
inline CUresult cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice d) {
  if (d < 0 || d >= S().devices) return CUDA_ERROR_INVALID_DEVICE;
  *c = reinterpret_cast<CUcontext>((uintptr_t)0x1000 + (uintptr_t)d * 16);
  return CUDA_SUCCESS;
}
inline CUresult cuDevicePrimaryCtxRelease(CUdevice) { return CUDA_SUCCESS; }

inline CUresult cuMemGetAllocationGranularity(size_t *g, const CUmemAllocationProp *, CUmemAllocationGranularity_flags) {
  *g = kGranularity;
  return CUDA_SUCCESS;
}

inline CUresult cuMemCreate(CUmemGenericAllocationHandle *h, size_t size, const CUmemAllocationProp *prop,
                            unsigned long long) {
  if (size == 0 || size % kGranularity != 0) return CUDA_ERROR_INVALID_VALUE;
  if (prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE || prop->location.id < 0 ||
      prop->location.id >= S().devices)
    return CUDA_ERROR_INVALID_DEVICE;
  char name[64];
  std::snprintf(name, sizeof name, "fakecu:dev=%d:types=%llu", prop->location.id,
                (unsigned long long)prop->requestedHandleTypes);
  int fd = memfd_create(name, MFD_CLOEXEC);
  if (fd < 0) return CUDA_ERROR_OUT_OF_MEMORY;
  fd = high_fd(fd);
  if (ftruncate(fd, (off_t)size) != 0) {
    ::close(fd);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  *h = new_handle(new_alloc(fd, size, prop->location.id, prop->requestedHandleTypes));
  return CUDA_SUCCESS;
}

inline CUresult cuMemRelease(CUmemGenericAllocationHandle h) {
  auto it = S().handles.find(h);
  if (it == S().handles.end()) return CUDA_ERROR_INVALID_VALUE;
  if (--it->second.refs > 0) return CUDA_SUCCESS;
  Alloc *a = it->second.a;
  S().handles.erase(it);
  a->handles--;
  maybe_free(a);
  return CUDA_SUCCESS;
}

inline CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t align, CUdeviceptr, unsigned long long) {
  if (size == 0 || size % kGranularity != 0) return CUDA_ERROR_INVALID_VALUE;
  if (align == 0) align = kGranularity;
  void *p = ::mmap(nullptr, size + align, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  uintptr_t start = ((uintptr_t)p + align - 1) / align * align;
  if (start > (uintptr_t)p) ::munmap(p, start - (uintptr_t)p);
  uintptr_t end = (uintptr_t)p + size + align;
  if (end > start + size) ::munmap((void *)(start + size), end - (start + size));
  S().reservations.push_back({start, size});
  *ptr = (CUdeviceptr)start;
  return CUDA_SUCCESS;
}

inline CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
  auto &v = S().reservations;
  for (size_t i = 0; i < v.size(); i++)
    if (v[i].addr == (uintptr_t)ptr && v[i].size == size) {
      for (auto &m : S().maps)
        if (m.addr >= v[i].addr && m.addr < v[i].addr + v[i].size) return CUDA_ERROR_INVALID_VALUE;
      ::munmap((void *)ptr, size);
      v.erase(v.begin() + (long)i);
      return CUDA_SUCCESS;
    }
  return CUDA_ERROR_INVALID_VALUE;
}

inline CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle h,
                         unsigned long long) {
  auto it = S().handles.find(h);
  if (it == S().handles.end() || offset != 0) return CUDA_ERROR_INVALID_VALUE;
  Alloc *a = it->second.a;
  if (size != a->size) return CUDA_ERROR_INVALID_VALUE;
  bool inside = false;
  for (auto &r : S().reservations) inside |= (uintptr_t)ptr >= r.addr && (uintptr_t)ptr + size <= r.addr + r.size;
  if (!inside || map_containing((uintptr_t)ptr) != nullptr) return CUDA_ERROR_INVALID_VALUE;
  void *p = ::mmap((void *)ptr, size, PROT_NONE, MAP_SHARED | MAP_FIXED, a->fd, 0);
  if (p == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  S().maps.push_back({(uintptr_t)ptr, size, a, h});
  a->maps++;
  return CUDA_SUCCESS;
}

inline CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
  auto &v = S().maps;
  for (size_t i = 0; i < v.size(); i++)
    if (v[i].addr == (uintptr_t)ptr) {
      if (v[i].size != size) return CUDA_ERROR_INVALID_VALUE;  // no partial unmaps
      ::mmap((void *)ptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
      Alloc *a = v[i].a;
      v.erase(v.begin() + (long)i);
      a->maps--;
      maybe_free(a);
      return CUDA_SUCCESS;
    }
  return CUDA_ERROR_INVALID_VALUE;
}

inline CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count) {
  Map *m = map_containing((uintptr_t)ptr);
  if (m == nullptr || m->addr != (uintptr_t)ptr || m->size != size || count == 0) return CUDA_ERROR_INVALID_VALUE;
  for (size_t i = 0; i < count; i++)
    if (desc[i].location.type != CU_MEM_LOCATION_TYPE_DEVICE || desc[i].location.id < 0 ||
        desc[i].location.id >= S().devices)
      return CUDA_ERROR_INVALID_DEVICE;
  return ::mprotect((void *)ptr, size, PROT_READ | PROT_WRITE) == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

inline CUresult cuMemExportToShareableHandle(void *out, CUmemGenericAllocationHandle h, CUmemAllocationHandleType type,
                                             unsigned long long) {
  auto it = S().handles.find(h);
  if (it == S().handles.end()) return CUDA_ERROR_INVALID_VALUE;
  if (type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR || !(it->second.a->types & type))
    return CUDA_ERROR_NOT_SUPPORTED;
  // Deliberately without close-on-exec: the library must set it.
  int fd = ::dup(it->second.a->fd);
  if (fd < 0) return CUDA_ERROR_OUT_OF_MEMORY;
  *static_cast<int *>(out) = fd;
  return CUDA_SUCCESS;
}

inline CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *h, void *os,
                                               CUmemAllocationHandleType type) {
  if (type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) return CUDA_ERROR_NOT_SUPPORTED;
  int fd = (int)(intptr_t)os;
  char link[64], target[256];
  std::snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
  ssize_t n = ::readlink(link, target, sizeof target - 1);
  if (n < 0) return CUDA_ERROR_INVALID_VALUE;
  target[n] = '\0';
  int dev = -1;
  unsigned long long types = 0;
  if (std::sscanf(target, "/memfd:fakecu:dev=%d:types=%llu", &dev, &types) != 2) return CUDA_ERROR_INVALID_VALUE;
  struct stat st;
  if (::fstat(fd, &st) != 0) return CUDA_ERROR_INVALID_VALUE;
  int mine = ::fcntl(fd, F_DUPFD_CLOEXEC, kHighFd);
  if (mine < 0) return CUDA_ERROR_OUT_OF_MEMORY;
  *h = new_handle(new_alloc(mine, (size_t)st.st_size, dev, types));
  return CUDA_SUCCESS;
}

inline CUresult cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp *prop, CUmemGenericAllocationHandle h) {
  auto it = S().handles.find(h);
  if (it == S().handles.end()) return CUDA_ERROR_INVALID_VALUE;
  std::memset(prop, 0, sizeof *prop);
  prop->type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop->location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop->location.id = it->second.a->device;
  prop->requestedHandleTypes = (CUmemAllocationHandleType)it->second.a->types;
  return CUDA_SUCCESS;
}

inline CUresult cuMemGetAddressRange(CUdeviceptr *base, size_t *size, CUdeviceptr p) {
  if (Map *m = map_containing((uintptr_t)p)) {
    *base = (CUdeviceptr)m->addr;
    *size = m->size;
    return CUDA_SUCCESS;
  }
  for (auto &r : S().legacy)
    if ((uintptr_t)p >= r.addr && (uintptr_t)p - r.addr < r.size) {
      *base = (CUdeviceptr)r.addr;
      *size = r.size;
      return CUDA_SUCCESS;
    }
  return CUDA_ERROR_INVALID_VALUE;
}

inline CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *h, void *addr) {
  Map *m = map_containing((uintptr_t)addr);
  if (m == nullptr) return CUDA_ERROR_INVALID_VALUE;  // legacy (cudaMalloc'd) memory lands here
  auto it = S().handles.find(m->h);
  if (it != S().handles.end()) {
    it->second.refs++;
  } else {
    S().handles[m->h] = Handle{m->a, 1};
    m->a->handles++;
  }
  *h = m->h;
  return CUDA_SUCCESS;
}

// The table of the fake driver (entries kvferry does not need stay NULL).
inline kvf_cuda_table table() {
  kvf_cuda_table t;
  std::memset(&t, 0, sizeof t);
  t.cuInit = cuInit;
  t.cuDriverGetVersion = cuDriverGetVersion;
  t.cuGetErrorString = cuGetErrorString;
  t.cuGetErrorName = cuGetErrorName;
  t.cuDeviceGetCount = cuDeviceGetCount;
  t.cuDeviceGet = cuDeviceGet;
  t.cuDeviceGetAttribute = cuDeviceGetAttribute;
  t.cuDeviceGetName = cuDeviceGetName;
  t.cuDeviceGetUuid = cuDeviceGetUuid;
  t.cuCtxGetCurrent = cuCtxGetCurrent;
  t.cuCtxSetCurrent = cuCtxSetCurrent;
  t.cuDevicePrimaryCtxRetain = cuDevicePrimaryCtxRetain;
  t.cuDevicePrimaryCtxRelease = cuDevicePrimaryCtxRelease;
  t.cuMemCreate = cuMemCreate;
  t.cuMemRelease = cuMemRelease;
  t.cuMemAddressReserve = cuMemAddressReserve;
  t.cuMemAddressFree = cuMemAddressFree;
  t.cuMemMap = cuMemMap;
  t.cuMemUnmap = cuMemUnmap;
  t.cuMemSetAccess = cuMemSetAccess;
  t.cuMemGetAllocationGranularity = cuMemGetAllocationGranularity;
  t.cuMemExportToShareableHandle = cuMemExportToShareableHandle;
  t.cuMemImportFromShareableHandle = cuMemImportFromShareableHandle;
  t.cuMemGetAddressRange = cuMemGetAddressRange;
  t.cuMemRetainAllocationHandle = cuMemRetainAllocationHandle;
  t.cuMemGetAllocationPropertiesFromHandle = cuMemGetAllocationPropertiesFromHandle;
  return t;
}

}  // namespace fakecu

#endif  // KVF_WITH_CUDA
