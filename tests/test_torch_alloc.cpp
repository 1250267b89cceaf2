// libkvferry_torch_alloc.so, the exportable allocator torch loads
// (python/torch_alloc/kvferry_torch_alloc.h), without torch: the module is
// dlopen'ed by path and its entry points are taken with dlsym, as
// torch.cuda.CUDAPluggableAllocator does (ctypes.CDLL, then the two names).
// This binary links the shared libkvferry, so the module's libkvferry.so.0
// is this process's one, as it is in a Python process that imported kvferry.
//
//   TorchAlloc.*     everywhere: the entry points and their types, the shared
//                    libkvferry, failures return NULL and say why, foreign
//                    pointers are ignored
//   TorchAllocGpu.*  on a GPU (skipped without, with the reason): rounded
//                    exportable segments that kvf_mem_alloc_find finds under
//                    any interior pointer with the same identity; a found
//                    reference keeps the memory after torch frees it; free
//                    waits for the segment's stream; threads allocating and
//                    freeing at once; every visible device
//
// The module is $KVF_TORCH_ALLOC_LIBRARY, else the one this build made.
#include <gtest/gtest.h>

#include <dlfcn.h>
#include <sys/types.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include <kvferry/device.h>
#include <kvferry/memory.h>

#include "python/torch_alloc/kvferry_torch_alloc.h"

#if KVF_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace {

// What torch's CUDAPluggableAllocator casts the two symbols to
// (torch/csrc/cuda/CUDAPluggableAllocator.h: std::function<void*(size_t,
// int, cudaStream_t)> and std::function<void(void*, size_t, int,
// cudaStream_t)>).
using TorchMallocFn = void *(size_t, int, struct CUstream_st *);
using TorchFreeFn = void(void *, size_t, int, struct CUstream_st *);

struct Module {
  void *handle = nullptr;
  std::string path;
  std::string error;
  // Typed as the header declares them (decltype), so a header change that
  // breaks torch's types fails the static_asserts below.
  decltype(&kvf_torch_alloc) alloc = nullptr;
  decltype(&kvf_torch_free) free = nullptr;
  decltype(&kvf_torch_alloc_identity) identity = nullptr;
  decltype(&kvf_torch_alloc_stats) stats = nullptr;
  decltype(&kvf_torch_alloc_libkvferry_anchor) anchor = nullptr;
  decltype(&kvf_torch_alloc_libkvferry_path) libkvferry_path = nullptr;

  uint64_t segments() const {
    uint64_t n = 0;
    stats(&n, nullptr);
    return n;
  }
  uint64_t bytes() const {
    uint64_t n = 0;
    stats(nullptr, &n);
    return n;
  }
};

// ssize_t and size_t have one size and one passing convention, so calling
// kvf_torch_alloc through torch's types is exactly what torch does.
static_assert(sizeof(ssize_t) == sizeof(size_t), "torch passes a size_t");
static_assert(std::is_same<decltype(&kvf_torch_alloc), void *(*)(ssize_t, int, struct CUstream_st *)>::value,
              "alloc_fn: void*(ssize_t size, int device, cudaStream_t stream)");
static_assert(std::is_same<decltype(&kvf_torch_free), void (*)(void *, ssize_t, int, struct CUstream_st *)>::value,
              "free_fn: void(void* ptr, ssize_t size, int device, cudaStream_t stream)");
#if KVF_WITH_CUDA
static_assert(std::is_same<cudaStream_t, struct CUstream_st *>::value, "cudaStream_t is struct CUstream_st *");
#endif

template <typename T>
bool take(void *handle, const char *name, T *out, std::string *error) {
  dlerror();
  void *sym = dlsym(handle, name);
  if (sym == nullptr) {
    const char *e = dlerror();
    *error = std::string("dlsym ") + name + ": " + (e ? e : "NULL");
    return false;
  }
  *out = reinterpret_cast<T>(sym);
  return true;
}

// The module, loaded once for the whole binary.
const Module &module() {
  static Module m = [] {
    Module r;
    const char *env = std::getenv("KVF_TORCH_ALLOC_LIBRARY");
    r.path = env && *env ? env : KVF_TORCH_ALLOC_PATH;
    r.handle = dlopen(r.path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (r.handle == nullptr) {
      const char *e = dlerror();
      r.error = "dlopen " + r.path + ": " + (e ? e : "?");
      return r;
    }
    if (take(r.handle, "kvf_torch_alloc", &r.alloc, &r.error) &&
        take(r.handle, "kvf_torch_free", &r.free, &r.error) &&
        take(r.handle, "kvf_torch_alloc_identity", &r.identity, &r.error) &&
        take(r.handle, "kvf_torch_alloc_stats", &r.stats, &r.error) &&
        take(r.handle, "kvf_torch_alloc_libkvferry_anchor", &r.anchor, &r.error) &&
        take(r.handle, "kvf_torch_alloc_libkvferry_path", &r.libkvferry_path, &r.error))
      r.error.clear();
    return r;
  }();
  return m;
}

#define KVF_REQUIRE_MODULE()                                                           \
  const Module &m = module();                                                          \
  ASSERT_TRUE(m.error.empty()) << m.error

[[maybe_unused]] bool same_identity(const kvf_mem_identity &a, const kvf_mem_identity &b) {
  return std::memcmp(&a, &b, sizeof a) == 0;
}

TEST(TorchAlloc, EntryPointsLoadWithDlsymAsTorchLoadsThem) {
  KVF_REQUIRE_MODULE();
  // torch.cuda.CUDAPluggableAllocator: ctypes.CDLL(path), getattr(lib, name),
  // then torch._C._cuda_customAllocator(alloc_ptr, free_ptr), which casts the
  // two addresses to these types.
  auto *as_malloc = reinterpret_cast<TorchMallocFn *>(dlsym(m.handle, "kvf_torch_alloc"));
  auto *as_free = reinterpret_cast<TorchFreeFn *>(dlsym(m.handle, "kvf_torch_free"));
  ASSERT_NE(as_malloc, nullptr);
  ASSERT_NE(as_free, nullptr);
  EXPECT_EQ(reinterpret_cast<void *>(as_malloc), reinterpret_cast<void *>(m.alloc));
  // Nothing else is exported: torch looks up no optional hook by name.
  for (const char *internal : {"kvf_log_write", "kvf_log_init", "kvf_ta_wait"}) {
    dlerror();
    EXPECT_EQ(dlsym(m.handle, internal), nullptr) << internal << " is exported";
  }
}

TEST(TorchAlloc, SharesThisProcessLibkvferry) {
  KVF_REQUIRE_MODULE();
  // The module resolved libkvferry.so.0 to the copy this binary linked.
  EXPECT_EQ(m.anchor(), static_cast<const void *>(kvf_version_string()));
  std::string path = m.libkvferry_path();
  EXPECT_NE(path.find("libkvferry.so"), std::string::npos) << path;
}

TEST(TorchAlloc, FailuresReturnNullAndSayWhy) {
  KVF_REQUIRE_MODULE();
  uint64_t before = m.segments();
  EXPECT_EQ(m.alloc(0, 0, nullptr), nullptr);
  EXPECT_EQ(m.alloc(-1, 0, nullptr), nullptr);
  kvf_cuda_info info = KVF_CUDA_INFO_INIT;
  if (kvf_cuda_probe(&info) != KVF_SUCCESS) {
    // No driver or no GPU: NULL, and libkvferry's message is the probe's.
    EXPECT_EQ(m.alloc(1 << 20, 0, nullptr), nullptr);
    EXPECT_EQ(std::string(kvf_last_error()), std::string(info.message));
  } else {
    EXPECT_EQ(m.alloc(1 << 20, -1, nullptr), nullptr);
    EXPECT_NE(std::string(kvf_last_error()).find("device"), std::string::npos) << kvf_last_error();
    EXPECT_EQ(m.alloc(1 << 20, 4096, nullptr), nullptr);
    EXPECT_NE(std::string(kvf_last_error()).find("device"), std::string::npos) << kvf_last_error();
    // More than any GPU has (1 PiB): the driver refuses it.
    EXPECT_EQ(m.alloc(static_cast<ssize_t>(1) << 50, 0, nullptr), nullptr);
    EXPECT_NE(std::string(kvf_last_error()).find("cuMem"), std::string::npos) << kvf_last_error();
  }
  EXPECT_EQ(m.segments(), before);
}

TEST(TorchAlloc, ForeignPointersAreIgnored) {
  KVF_REQUIRE_MODULE();
  uint64_t before = m.segments();
  m.free(nullptr, 0, 0, nullptr);
  int local = 0;
  m.free(&local, sizeof local, 0, nullptr);  // logged, ignored
  kvf_mem_identity id;
  EXPECT_EQ(m.identity(&local, &id), KVF_ERR_NOT_FOUND);
  EXPECT_EQ(m.identity(&local, nullptr), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(m.segments(), before);
}

// ---- on a GPU ---------------------------------------------------------------------

#define KVF_REQUIRE_GPU()                                                                      \
  do {                                                                                         \
    kvf_cuda_info info_ = KVF_CUDA_INFO_INIT;                                                  \
    if (kvf_cuda_probe(&info_) != KVF_SUCCESS) GTEST_SKIP() << "no CUDA: " << info_.message;   \
  } while (0)

#if KVF_WITH_CUDA

#define CUDA_OK(expr)                                                             \
  do {                                                                            \
    cudaError_t e_ = (expr);                                                      \
    ASSERT_EQ(e_, cudaSuccess) << #expr << ": " << cudaGetErrorString(e_);        \
  } while (0)

uint64_t granularity(int device) {
  uint64_t g = 0;
  EXPECT_EQ(kvf_mem_granularity(KVF_MEM_PROVIDER_CUMEM, device, &g), KVF_SUCCESS) << kvf_last_error();
  return g;
}

// Check one segment from the outside, as the Python package and kvferryd's
// client see it: kvf_mem_alloc_find under interior pointers, identity,
// export, data written and read back through the runtime.
void check_segment(const Module &m, void *p, uint64_t requested, int device) {
  uint64_t g = granularity(device);
  uint64_t rounded = (requested + g - 1) / g * g;
  ASSERT_NE(p, nullptr) << kvf_last_error();
  EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % g, 0u) << "segment not aligned to the granularity";
  kvf_mem_identity made;
  ASSERT_EQ(m.identity(p, &made), KVF_SUCCESS);
  EXPECT_EQ(made.size, rounded);
  EXPECT_EQ(made.provider, static_cast<uint32_t>(KVF_MEM_PROVIDER_CUMEM));
  int on = -1;
  ASSERT_EQ(kvf_mem_device_from_uuid(made.device_uuid, &on), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(on, device);

  char *base = static_cast<char *>(p);
  for (uint64_t off : {uint64_t(0), uint64_t(1), uint64_t(4096 + 16), rounded / 2, rounded - 1}) {
    SCOPED_TRACE("offset " + std::to_string(off));
    kvf_mem_identity via_module;
    ASSERT_EQ(m.identity(base + off, &via_module), KVF_SUCCESS);
    EXPECT_TRUE(same_identity(via_module, made));
    kvf_mem_alloc *found = nullptr;
    ASSERT_EQ(kvf_mem_alloc_find(KVF_MEM_PROVIDER_CUMEM, base + off, &found), KVF_SUCCESS) << kvf_last_error();
    EXPECT_EQ(kvf_mem_alloc_ptr(found), p);
    EXPECT_EQ(kvf_mem_alloc_size(found), rounded);
    kvf_mem_identity id;
    ASSERT_EQ(kvf_mem_alloc_identity(found, &id), KVF_SUCCESS);
    EXPECT_TRUE(same_identity(id, made)) << "find gave another identity: not libkvferry's own record";
    int fd = -1;
    kvf_mem_identity exported;
    ASSERT_EQ(kvf_mem_alloc_export(found, &fd, &exported), KVF_SUCCESS) << kvf_last_error();
    EXPECT_GE(fd, 0);
    EXPECT_TRUE(same_identity(exported, made));
    close(fd);
    kvf_mem_alloc_destroy(found);
  }
  // The memory is device memory of `device`, readable and writable there.
  std::vector<unsigned char> out(8192), back(8192);
  for (size_t i = 0; i < out.size(); i++) out[i] = static_cast<unsigned char>(i * 7 + requested);
  uint64_t at = rounded - out.size();
  CUDA_OK(cudaSetDevice(device));
  CUDA_OK(cudaMemcpy(base + at, out.data(), out.size(), cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(back.data(), base + at, back.size(), cudaMemcpyDeviceToHost));
  EXPECT_EQ(out, back);
}

TEST(TorchAllocGpu, SegmentsAreRoundedExportableAndFoundUnderAnyInteriorPointer) {
  KVF_REQUIRE_GPU();
  KVF_REQUIRE_MODULE();
  uint64_t g = granularity(0);
  uint64_t before = m.segments(), before_bytes = m.bytes();
  for (uint64_t size : {uint64_t(1), g, g + 1, uint64_t(20) << 20, uint64_t(3) << 30}) {
    SCOPED_TRACE("size " + std::to_string(size));
    void *p = m.alloc(static_cast<ssize_t>(size), 0, nullptr);
    ASSERT_NO_FATAL_FAILURE(check_segment(m, p, size, 0));
    EXPECT_EQ(m.segments(), before + 1);
    EXPECT_EQ(m.bytes(), before_bytes + (size + g - 1) / g * g);
    m.free(p, static_cast<ssize_t>(size), 0, nullptr);
    EXPECT_EQ(m.segments(), before);
    EXPECT_EQ(m.bytes(), before_bytes);
    // Freed: the range is unmapped, nobody finds it any more.
    kvf_mem_alloc *gone = nullptr;
    EXPECT_NE(kvf_mem_alloc_find(KVF_MEM_PROVIDER_CUMEM, p, &gone), KVF_SUCCESS);
    EXPECT_EQ(gone, nullptr);
  }
}

TEST(TorchAllocGpu, AFoundReferenceKeepsTheMemoryAfterTorchFreesIt) {
  KVF_REQUIRE_GPU();
  KVF_REQUIRE_MODULE();
  uint64_t size = 4 << 20;
  char *p = static_cast<char *>(m.alloc(static_cast<ssize_t>(size), 0, nullptr));
  ASSERT_NE(p, nullptr) << kvf_last_error();
  std::vector<unsigned char> pattern(size / 2, 0xa5), back(size / 2);
  CUDA_OK(cudaMemcpy(p + size / 2, pattern.data(), pattern.size(), cudaMemcpyHostToDevice));
  kvf_mem_alloc *held = nullptr;
  ASSERT_EQ(kvf_mem_alloc_find(KVF_MEM_PROVIDER_CUMEM, p + size / 2, &held), KVF_SUCCESS) << kvf_last_error();
  kvf_mem_identity id;
  ASSERT_EQ(kvf_mem_alloc_identity(held, &id), KVF_SUCCESS);
  uint64_t before = m.segments();
  m.free(p, static_cast<ssize_t>(size), 0, nullptr);
  EXPECT_EQ(m.segments(), before - 1);  // the module let go
  // ... but the memory is still mapped, with its data, for the holder.
  CUDA_OK(cudaMemcpy(back.data(), p + size / 2, back.size(), cudaMemcpyDeviceToHost));
  EXPECT_EQ(back, pattern);
  kvf_mem_alloc *again = nullptr;
  ASSERT_EQ(kvf_mem_alloc_find(KVF_MEM_PROVIDER_CUMEM, p, &again), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(again, held);
  kvf_mem_alloc_destroy(again);
  kvf_mem_alloc_destroy(held);  // the last reference unmaps
  kvf_mem_alloc *gone = nullptr;
  EXPECT_NE(kvf_mem_alloc_find(KVF_MEM_PROVIDER_CUMEM, p, &gone), KVF_SUCCESS);
}

void CUDART_CB sleep_on_stream(void *ms) {
  std::this_thread::sleep_for(std::chrono::milliseconds(*static_cast<int *>(ms)));
}

TEST(TorchAllocGpu, FreeWaitsForWorkQueuedOnTheSegmentsStream) {
  KVF_REQUIRE_GPU();
  KVF_REQUIRE_MODULE();
  static int delay_ms = 300;
  uint64_t size = 64 << 20;
  cudaStream_t made = nullptr;
  CUDA_OK(cudaSetDevice(0));
  CUDA_OK(cudaStreamCreateWithFlags(&made, cudaStreamNonBlocking));
  for (cudaStream_t s : {made, static_cast<cudaStream_t>(nullptr)}) {
    SCOPED_TRACE(s ? "a created stream" : "the legacy default stream");
    void *p = m.alloc(static_cast<ssize_t>(size), 0, s);
    ASSERT_NE(p, nullptr) << kvf_last_error();
    // A host callback holds the stream; the memset behind it still writes
    // the segment when free is called.
    CUDA_OK(cudaLaunchHostFunc(s, sleep_on_stream, &delay_ms));
    CUDA_OK(cudaMemsetAsync(p, 0x5a, size, s));
    auto t0 = std::chrono::steady_clock::now();
    m.free(p, static_cast<ssize_t>(size), 0, s);
    auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0);
    EXPECT_GE(waited.count(), delay_ms * 8 / 10) << "free returned before the stream's work was done";
    EXPECT_EQ(cudaStreamQuery(s), cudaSuccess);
  }
  // The memset ran on mapped memory: no sticky error.
  CUDA_OK(cudaDeviceSynchronize());
  CUDA_OK(cudaStreamDestroy(made));
}

TEST(TorchAllocGpu, ThreadsAllocateFindAndFreeAtOnce) {
  KVF_REQUIRE_GPU();
  KVF_REQUIRE_MODULE();
  uint64_t g = granularity(0);
  uint64_t before = m.segments();
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; t++)
    threads.emplace_back([&, t] {
      std::vector<std::pair<char *, uint64_t>> mine;
      for (int i = 0; i < 24; i++) {
        uint64_t size = g * (1 + (t + i) % 4) - (i % 2);
        char *p = static_cast<char *>(m.alloc(static_cast<ssize_t>(size), 0, nullptr));
        if (p == nullptr) {
          failures++;
          continue;
        }
        mine.emplace_back(p, size);
        kvf_mem_identity a, b;
        kvf_mem_alloc *found = nullptr;
        if (m.identity(p + size - 1, &a) != KVF_SUCCESS ||
            kvf_mem_alloc_find(KVF_MEM_PROVIDER_CUMEM, p + size / 3, &found) != KVF_SUCCESS ||
            kvf_mem_alloc_identity(found, &b) != KVF_SUCCESS || !same_identity(a, b))
          failures++;
        kvf_mem_alloc_destroy(found);
        if (i % 3 == 2) {  // free some while others are being made
          m.free(mine.front().first, static_cast<ssize_t>(mine.front().second), 0, nullptr);
          mine.erase(mine.begin());
        }
      }
      for (auto &seg : mine) m.free(seg.first, static_cast<ssize_t>(seg.second), 0, nullptr);
    });
  for (auto &th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(m.segments(), before);
}

TEST(TorchAllocGpu, EveryVisibleDeviceGetsItsOwnMemory) {
  KVF_REQUIRE_GPU();
  KVF_REQUIRE_MODULE();
  int count = 0;
  CUDA_OK(cudaGetDeviceCount(&count));
  std::vector<kvf_mem_identity> ids;
  for (int d = 0; d < count; d++) {
    SCOPED_TRACE("device " + std::to_string(d));
    void *p = m.alloc(3 << 20, d, nullptr);
    ASSERT_NO_FATAL_FAILURE(check_segment(m, p, 3 << 20, d));
    kvf_mem_identity id;
    ASSERT_EQ(m.identity(p, &id), KVF_SUCCESS);
    for (const auto &other : ids) EXPECT_NE(std::memcmp(other.device_uuid, id.device_uuid, 16), 0);
    ids.push_back(id);
    m.free(p, 3 << 20, d, nullptr);
  }
}

#else  // !KVF_WITH_CUDA

TEST(TorchAllocGpu, NeedsACudaBuild) { GTEST_SKIP() << "this build has no CUDA (KVF_WITH_CUDA=OFF)"; }

#endif

}  // namespace
