// Helpers for the memory-layer tests (test_memory*.cpp, test_ipc.cpp):
// descriptor and memory counts from /proc, a fault injector over the system
// call table (host/syscalls.h) and the driver entry-point table
// (host/cudawrap.h) that fails the k-th call, and a small geometry whose
// regions are allocations (4 allocations x 46 layers = 184 views).
#pragma once

#include <gtest/gtest.h>

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <kvferry/copy.h>
#include <kvferry/memory.h>

#include "host/core/syscalls.h"
#if KVF_WITH_CUDA
#include "host/core/cudawrap.h"
#endif

namespace kvf_mem_test {

// Open descriptors of this process (the directory's own descriptor excluded).
inline int fd_count() {
  DIR *d = opendir("/proc/self/fd");
  if (d == nullptr) return -1;
  int n = 0;
  while (struct dirent *e = readdir(d))
    if (e->d_name[0] != '.') n++;
  closedir(d);
  return n - 1;
}

// A kB field of /proc/self/status ("VmSize", "VmRSS"), or -1.
inline long proc_status_kb(const char *field) {
  FILE *f = std::fopen("/proc/self/status", "r");
  if (f == nullptr) return -1;
  char line[256];
  long v = -1;
  size_t n = std::strlen(field);
  while (std::fgets(line, sizeof line, f))
    if (std::strncmp(line, field, n) == 0 && line[n] == ':') {
      v = std::strtol(line + n + 1, nullptr, 10);
      break;
    }
  std::fclose(f);
  return v;
}

inline bool fd_is_open(int fd) { return fcntl(fd, F_GETFD) != -1 || errno != EBADF; }
inline bool fd_cloexec(int fd) { return (fcntl(fd, F_GETFD) & FD_CLOEXEC) != 0; }

// ---- fault injection ------------------------------------------------------

// One counter over both tables: the k-th counted call (1-based) fails.
struct FaultState {
  bool armed = false;
  long calls = 0;
  long fail_at = 0;      // 0: count only
  bool hit = false;
  std::string hit_name;
  int sys_errno = 0;     // errno injected (0: a per-call default)
  bool count_close = true;
  std::map<std::string, long> by_name;               // calls per name since arm()
  std::map<std::string, std::set<long>> fail_named;  // also fail these occurrences of a name (1-based)
};
inline FaultState &faults() {
  static FaultState s;
  return s;
}
inline void arm(long fail_at, int sys_errno = 0) {
  FaultState &s = faults();
  s.armed = true;
  s.calls = 0;
  s.fail_at = fail_at;
  s.hit = false;
  s.hit_name.clear();
  s.sys_errno = sys_errno;
  s.by_name.clear();
  s.fail_named.clear();
}
// Count only, and fail occurrence `nth` of call `name` (may be given several times).
inline void arm_named(const std::string &name, long nth) {
  FaultState &s = faults();
  if (!s.armed) arm(0);
  s.fail_named[name].insert(nth);
}
inline long calls_of(const std::string &name) {
  auto it = faults().by_name.find(name);
  return it == faults().by_name.end() ? 0 : it->second;
}
inline void disarm() { faults().armed = false; }
inline bool tick(const char *name) {
  FaultState &s = faults();
  if (!s.armed) return false;
  s.calls++;
  long nth = ++s.by_name[name];
  auto it = s.fail_named.find(name);
  if ((s.fail_at != 0 && s.calls == s.fail_at) || (it != s.fail_named.end() && it->second.count(nth))) {
    s.hit = true;
    s.hit_name = name;
    return true;
  }
  return false;
}
inline int inject_errno(int deflt) { return faults().sys_errno ? faults().sys_errno : deflt; }

inline const kvf_sys_table *sys_base() { return kvf_sys_table_default(); }

// The C library's table with every entry counted and failable.
inline kvf_sys_table sys_fault_table() {
  kvf_sys_table t = *kvf_sys_table_default();
  t.socket = [](int d, int ty, int p) {
    if (tick("socket")) return errno = inject_errno(EMFILE), -1;
    return sys_base()->socket(d, ty, p);
  };
  t.socketpair = [](int d, int ty, int p, int sv[2]) {
    if (tick("socketpair")) return errno = inject_errno(EMFILE), -1;
    return sys_base()->socketpair(d, ty, p, sv);
  };
  t.sendmsg = [](int fd, const struct msghdr *m, int f) -> ssize_t {
    if (tick("sendmsg")) return errno = inject_errno(ENOBUFS), -1;
    return sys_base()->sendmsg(fd, m, f);
  };
  t.recvmsg = [](int fd, struct msghdr *m, int f) -> ssize_t {
    if (tick("recvmsg")) return errno = inject_errno(ENOMEM), -1;
    return sys_base()->recvmsg(fd, m, f);
  };
  t.mmap = [](void *a, size_t l, int p, int f, int fd, off_t o) -> void * {
    if (tick("mmap")) return errno = inject_errno(ENOMEM), MAP_FAILED;
    return sys_base()->mmap(a, l, p, f, fd, o);
  };
  t.munmap = [](void *a, size_t l) {
    if (tick("munmap")) return errno = inject_errno(ENOMEM), -1;
    return sys_base()->munmap(a, l);
  };
  t.mprotect = [](void *a, size_t l, int p) {
    if (tick("mprotect")) return errno = inject_errno(ENOMEM), -1;
    return sys_base()->mprotect(a, l, p);
  };
  t.memfd_create = [](const char *n, unsigned f) {
    if (tick("memfd_create")) return errno = inject_errno(EMFILE), -1;
    return sys_base()->memfd_create(n, f);
  };
  t.ftruncate = [](int fd, off_t l) {
    if (tick("ftruncate")) return errno = inject_errno(ENOSPC), -1;
    return sys_base()->ftruncate(fd, l);
  };
  t.fstat = [](int fd, struct stat *s) {
    if (tick("fstat")) return errno = inject_errno(EIO), -1;
    return sys_base()->fstat(fd, s);
  };
  t.fcntl = [](int fd, int c, int a) {
    if (tick("fcntl")) return errno = inject_errno(EMFILE), -1;
    return sys_base()->fcntl(fd, c, a);
  };
  // Linux frees the descriptor even when close fails: do the same.
  t.close = [](int fd) {
    int r = sys_base()->close(fd);
    if (faults().count_close && tick("close")) return errno = inject_errno(EIO), -1;
    return r;
  };
  t.getrandom = [](void *b, size_t l, unsigned f) {
    if (tick("getrandom")) return errno = inject_errno(EAGAIN), -1;
    return sys_base()->getrandom(b, l, f);
  };
  return t;
}

struct SysFaultGuard {
  kvf_sys_table table = sys_fault_table();
  const kvf_sys_table *previous;
  SysFaultGuard() : previous(kvf_sys_table_install(&table)) {}
  ~SysFaultGuard() {
    disarm();
    kvf_sys_table_install(previous);
  }
};

#if KVF_WITH_CUDA
inline const kvf_cuda_table *&cu_inner() {
  static const kvf_cuda_table *inner;
  return inner;
}
inline bool cu_counted(const char *symbol) {
  // Error-string lookups only shape messages: never fail them.
  return std::strcmp(symbol, "cuGetErrorName") != 0 && std::strcmp(symbol, "cuGetErrorString") != 0;
}
// `inner` with every entry counted and failable (CUDA_ERROR_OUT_OF_MEMORY).
inline kvf_cuda_table cu_fault_table(const kvf_cuda_table *inner) {
  cu_inner() = inner;
  kvf_cuda_table w = *inner;
#define KVF_TEST_CU_WRAP_X(member, symbol, type)                                   \
  if (inner->member != nullptr)                                                    \
    w.member = [](auto... a) -> CUresult {                                         \
      if (cu_counted(symbol) && tick(symbol)) return CUDA_ERROR_OUT_OF_MEMORY;     \
      return cu_inner()->member(a...);                                             \
    };
  KVF_CUDA_ENTRY_POINTS(KVF_TEST_CU_WRAP_X)
#undef KVF_TEST_CU_WRAP_X
  return w;
}
#endif

// ---- a geometry whose regions are allocations -------------------------------

struct GeometryDeleter {
  void operator()(kvf_geometry *g) const { kvf_geometry_destroy(g); }
};
using GeometryPtr = std::unique_ptr<kvf_geometry, GeometryDeleter>;

struct LayerSpec {
  uint32_t regions = 4;
  uint32_t layers_per_region = 46;  // 4 x 46 = 184 layer views
  uint32_t num_blocks = 32;
  uint32_t block_size = 16;
  uint32_t heads = 2;
  uint32_t head_bytes = 64;
  uint64_t layer_bytes() const { return (uint64_t)num_blocks * 2 * block_size * heads * head_bytes; }
  uint64_t region_bytes() const { return layer_bytes() * layers_per_region; }
  uint32_t layers() const { return regions * layers_per_region; }
  uint32_t region_of(uint32_t layer) const { return layer / layers_per_region; }
  uint64_t offset_of(uint32_t layer) const { return (uint64_t)(layer % layers_per_region) * layer_bytes(); }
};

// One full-attention group, one layer view per (region, slot), K and V planes.
inline GeometryPtr make_geometry(const LayerSpec &s) {
  kvf_geometry *g = nullptr;
  if (kvf_geometry_create(&g) != KVF_SUCCESS) return nullptr;
  GeometryPtr p(g);
  for (uint32_t r = 0; r < s.regions; r++) {
    kvf_region_desc rd = KVF_REGION_DESC_INIT;
    rd.size = s.region_bytes();
    if (kvf_geometry_add_region(g, &rd, nullptr) != KVF_SUCCESS) return nullptr;
  }
  kvf_group_desc gd = KVF_GROUP_DESC_INIT;
  gd.block_size = s.block_size;
  gd.num_blocks = s.num_blocks;
  uint32_t group = 0;
  if (kvf_geometry_add_group(g, &gd, &group) != KVF_SUCCESS) return nullptr;
  for (uint32_t l = 0; l < s.layers(); l++) {
    kvf_view_desc v = KVF_VIEW_DESC_INIT;
    v.region = s.region_of(l);
    v.elem_bytes = 2;
    v.offset = s.offset_of(l);
    v.planes = 2;
    v.heads = s.heads;
    v.head_stride = s.head_bytes;
    v.token_stride = (uint64_t)s.heads * s.head_bytes;
    v.plane_stride = v.token_stride * s.block_size;
    v.block_stride = v.plane_stride * 2;
    v.head_bytes[0] = v.head_bytes[1] = s.head_bytes;
    if (kvf_geometry_add_view(g, group, &v, nullptr) != KVF_SUCCESS) return nullptr;
  }
  kvf_geometry_error err;
  if (kvf_geometry_finalize(g, &err) != KVF_SUCCESS) {
    ADD_FAILURE() << "geometry: " << err.message;
    return nullptr;
  }
  return p;
}

// Deterministic bytes for (seed, region, offset).
inline uint8_t pattern_byte(uint64_t seed, uint32_t region, uint64_t i) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + region * 0xBF58476D1CE4E5B9ull + i * 0x94D049BB133111EBull;
  x ^= x >> 29;
  return (uint8_t)(x ^ (x >> 17));
}
inline void fill_pattern(void *p, uint64_t n, uint64_t seed, uint32_t region) {
  uint8_t *b = static_cast<uint8_t *>(p);
  for (uint64_t i = 0; i < n; i++) b[i] = pattern_byte(seed, region, i);
}
// First index where p differs from the pattern, or n.
inline uint64_t check_pattern(const void *p, uint64_t n, uint64_t seed, uint32_t region) {
  const uint8_t *b = static_cast<const uint8_t *>(p);
  for (uint64_t i = 0; i < n; i++)
    if (b[i] != pattern_byte(seed, region, i)) return i;
  return n;
}

// A gather request over [0, tokens) with a fixed permutation of block ids.
struct GatherRequest {
  std::vector<void *> bases;
  std::vector<uint32_t> ids;
  std::vector<std::vector<uint8_t>> objects;  // host storage of the objects
  std::vector<void *> object_ptrs;
  kvf_group_blocks group{};
  kvf_copy_request req = KVF_COPY_REQUEST_INIT;
  uint64_t chunks = 0;
  GatherRequest(const kvf_geometry *g, const LayerSpec &s, std::vector<void *> region_bases, uint64_t tokens)
      : bases(std::move(region_bases)) {
    uint32_t nb = (uint32_t)(tokens / s.block_size);
    for (uint32_t i = 0; i < nb; i++) ids.push_back((i * 7 + 3) % s.num_blocks);
    group = {ids.data(), 0, nb};
    req.region_bases = bases.data();
    req.token_begin = 0;
    req.token_end = tokens;
    req.format = KVF_FORMAT_CANONICAL;
    req.groups = &group;
    kvf_object_policy pol = KVF_OBJECT_POLICY_INIT;
    kvf_geometry_policy(g, &pol);
    for (uint64_t b = 0; b < tokens; b += pol.chunk_tokens) {
      uint64_t size = 0;
      EXPECT_EQ(kvf_geometry_object_size(g, 0, b / pol.chunk_tokens, tokens, &size), KVF_SUCCESS);
      objects.emplace_back(size, 0xA5);
      chunks++;
    }
    for (auto &o : objects) object_ptrs.push_back(o.data());
    req.objects = object_ptrs.data();
  }
};

}  // namespace kvf_mem_test
