// The memory layer on real GPUs (kvferry/memory.h with the cumem provider).
// Each cross-process case spawns this binary again as the exporter (a fresh
// process: CUDA cannot be used in a forked child of a process that has
// initialized it), which allocates cumem memory, fills it, and passes the
// descriptors over a socket pair; this process imports them.
//
//   MemoryGpu.CumemDataIsCoherentAcrossProcessesOnOneGpu
//   MemoryGpu.ManyViewsGiveOneImportPerAllocation      4 allocations, 184 views
//   MemoryGpu.KernelGathersFromAnImportedMapping       kvf_xfer_gather vs the reference
//   MemoryGpu.ImporterKeepsDataAfterTheExporterExits
//   MemoryGpu.CumemAcrossTwoGpus                       skipped with fewer than two GPUs
//   MemoryGpu.CudaMallocMemoryIsRefusedWithAdvice
//   MemoryGpu.FindsTheAllocationUnderAnInteriorPointer
//   MemoryGpu.FaultSweepOverTheRealDriver              every driver call of register/unregister
//   MemoryGpu.ExportInodes                             what fstat says of the driver's exports (reported)
//   MemoryGpuRole.Exporter                             the child's role (skips when run directly)
//
// Every case skips with the reason when kvf_cuda_probe finds no driver or GPU.
#include <gtest/gtest.h>

#include <limits.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/wait.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <kvferry/device.h>
#include <kvferry/memory.h>
#include <kvferry/transfer.h>

#include "mem_provider_env.h"

#if KVF_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

extern char **environ;

using namespace kvf_mem_test;

namespace {

constexpr uint64_t kSeed = 21;       // what the exporter writes
constexpr uint64_t kBackSeed = 33;   // what the importer writes back
constexpr uint64_t kCheckBytes = 64 << 10;
constexpr int kChildSock = 100;      // the exporter's socket descriptor

#define KVF_REQUIRE_GPUS(n)                                                                         \
  do {                                                                                              \
    kvf_cuda_info info_ = KVF_CUDA_INFO_INIT;                                                       \
    if (kvf_cuda_probe(&info_) != KVF_SUCCESS) GTEST_SKIP() << "no CUDA: " << info_.message;        \
    if (info_.device_count < (n))                                                                   \
      GTEST_SKIP() << "needs " << (n) << " GPUs, found " << info_.device_count << ": " << info_.message; \
  } while (0)

struct Offer {
  uint32_t count;
  uint32_t device;
  kvf_mem_identity ids[8];
};

#if KVF_WITH_CUDA

#define CUDA_OK(expr)                                                             \
  do {                                                                            \
    cudaError_t e_ = (expr);                                                      \
    ASSERT_EQ(e_, cudaSuccess) << #expr << ": " << cudaGetErrorString(e_);        \
  } while (0)

// ---- the exporter (a child process) -------------------------------------------

// Allocate spec.regions cumem allocations on `device`, fill them with the
// pattern, offer them; then either wait for 'x' and exit (freeing everything
// first), or wait for 'c', check what the importer wrote back, answer, and
// wait for 'q'. Returns the process exit code.
int run_exporter(int sock, int device, bool exit_early) {
  LayerSpec spec;
  Offer offer{};
  int fds[8];
  std::vector<kvf_mem_alloc *> allocs;
  std::vector<uint8_t> host(spec.region_bytes());
  if (cudaSetDevice(device) != cudaSuccess) return 30;
  for (uint32_t r = 0; r < spec.regions; r++) {
    kvf_mem_alloc_options o = KVF_MEM_ALLOC_OPTIONS_INIT;
    o.provider = KVF_MEM_PROVIDER_CUMEM;
    o.device = device;
    o.size = spec.region_bytes();
    kvf_mem_alloc *a = nullptr;
    if (kvf_mem_alloc_create(&o, &a) != KVF_SUCCESS) {
      std::fprintf(stderr, "exporter: %s\n", kvf_last_error());
      return 31;
    }
    allocs.push_back(a);
    fill_pattern(host.data(), host.size(), kSeed, r);
    if (cudaMemcpy(kvf_mem_alloc_ptr(a), host.data(), host.size(), cudaMemcpyDefault) != cudaSuccess) return 32;
    if (kvf_mem_alloc_export(a, &fds[r], &offer.ids[r]) != KVF_SUCCESS) return 33;
  }
  offer.count = spec.regions;
  offer.device = (uint32_t)device;
  if (kvf_ipc_send(sock, &offer, sizeof offer, fds, spec.regions, KVF_IPC_CLOSE_FDS) != KVF_SUCCESS) return 34;
  char cmd = 0;
  if (kvf_ipc_recv(sock, &cmd, 1, nullptr, 0, nullptr) != KVF_SUCCESS) return 35;
  if (exit_early) {
    for (auto *a : allocs) kvf_mem_alloc_destroy(a);
    return cmd == 'x' ? 0 : 36;
  }
  if (cmd != 'c') return 37;
  char ok = 1;
  for (uint32_t r = 0; r < spec.regions; r++) {
    if (cudaMemcpy(host.data(), kvf_mem_alloc_ptr(allocs[r]), kCheckBytes, cudaMemcpyDefault) != cudaSuccess) return 38;
    if (check_pattern(host.data(), kCheckBytes, kBackSeed, r) != kCheckBytes) ok = 0;
  }
  if (kvf_ipc_send(sock, &ok, 1, nullptr, 0, 0) != KVF_SUCCESS) return 39;
  if (kvf_ipc_recv(sock, &cmd, 1, nullptr, 0, nullptr) != KVF_SUCCESS || cmd != 'q') return 40;
  for (auto *a : allocs) kvf_mem_alloc_destroy(a);
  return 0;
}

TEST(MemoryGpuRole, Exporter) {
  const char *role = std::getenv("KVF_TEST_MEM_ROLE");
  if (role == nullptr) GTEST_SKIP() << "the exporter's role in a child process of MemoryGpu tests";
  const char *dev = std::getenv("KVF_TEST_MEM_DEVICE");
  int rc = run_exporter(kChildSock, dev ? std::atoi(dev) : 0, std::strcmp(role, "exporter-exit") == 0);
  std::fflush(nullptr);
  _exit(rc);
}

// ---- the importer (this process) -------------------------------------------------

struct Exporter {
  pid_t pid = -1;
  int sock = -1;
  Exporter(const char *role, int device) {
    int sv[2];
    EXPECT_EQ(kvf_ipc_socketpair(sv), KVF_SUCCESS);
    char exe[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    EXPECT_GT(n, 0);
    exe[n > 0 ? n : 0] = '\0';
    std::vector<std::string> env;
    for (char **e = environ; *e; e++)
      if (std::strncmp(*e, "KVF_TEST_MEM_", 13) != 0 && std::strncmp(*e, "GTEST_", 6) != 0) env.push_back(*e);
    env.push_back(std::string("KVF_TEST_MEM_ROLE=") + role);
    env.push_back("KVF_TEST_MEM_DEVICE=" + std::to_string(device));
    std::vector<char *> envp;
    for (auto &s : env) envp.push_back(s.data());
    envp.push_back(nullptr);
    std::string filter = "--gtest_filter=MemoryGpuRole.Exporter";
    char *argv[] = {exe, filter.data(), nullptr};
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, sv[1], kChildSock);
    int rc = posix_spawn(&pid, exe, &fa, nullptr, argv, envp.data());
    posix_spawn_file_actions_destroy(&fa);
    EXPECT_EQ(rc, 0) << std::strerror(rc);
    if (rc != 0) pid = -1;
    close(sv[1]);
    sock = sv[0];
    struct timeval tv = {120, 0};
    setsockopt(sock, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  }
  int wait() {
    int status = 0;
    if (pid > 0 && waitpid(pid, &status, 0) == pid) {
      pid = -1;
      return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    }
    return -1;
  }
  void send(char c) { EXPECT_EQ(kvf_ipc_send(sock, &c, 1, nullptr, 0, 0), KVF_SUCCESS) << kvf_last_error(); }
  ~Exporter() {
    if (sock >= 0) close(sock);
    if (pid > 0) {
      kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
    }
  }
};

// What the importer holds: the table, one registration of the 184 layer
// views, and the region bases (one per imported allocation).
struct Imported {
  LayerSpec spec;
  TablePtr table;
  kvf_import_reg *reg = nullptr;
  std::vector<void *> bases;
  Offer offer{};
};

void receive_and_register(Exporter &ex, const std::vector<int> &access, Imported &im) {
  int fds[8] = {-1, -1, -1, -1, -1, -1, -1, -1};
  uint32_t n = 0;
  ASSERT_EQ(kvf_ipc_recv(ex.sock, &im.offer, sizeof im.offer, fds, 8, &n), KVF_SUCCESS) << kvf_last_error();
  ASSERT_EQ(n, im.spec.regions);
  kvf_import_table_options o = KVF_IMPORT_TABLE_OPTIONS_INIT;
  o.access_devices = access.data();
  o.num_access_devices = (uint32_t)access.size();
  kvf_import_table *t = nullptr;
  ASSERT_EQ(kvf_import_table_create(&o, &t), KVF_SUCCESS);
  im.table.reset(t);
  std::vector<kvf_import_view> views;
  for (uint32_t l = 0; l < im.spec.layers(); l++) {
    uint32_t r = im.spec.region_of(l);
    bool first = l % im.spec.layers_per_region == 0;
    views.push_back({im.offer.ids[r], first ? fds[r] : -1, im.spec.offset_of(l), im.spec.layer_bytes()});
  }
  ASSERT_EQ(kvf_import_table_register(t, 1, views.data(), (uint32_t)views.size(), &im.reg), KVF_SUCCESS)
      << kvf_last_error();
  for (uint32_t r = 0; r < im.spec.regions; r++) {
    kvf_import_view_info info;
    ASSERT_EQ(kvf_import_reg_view(im.reg, r * im.spec.layers_per_region, &info), KVF_SUCCESS);
    EXPECT_EQ(info.device, (int)im.offer.device);
    im.bases.push_back(info.base);
  }
}

void expect_exporter_data(const Imported &im) {
  std::vector<uint8_t> host(im.spec.region_bytes());
  for (uint32_t r = 0; r < im.spec.regions; r++) {
    CUDA_OK(cudaMemcpy(host.data(), im.bases[r], host.size(), cudaMemcpyDefault));
    EXPECT_EQ(check_pattern(host.data(), host.size(), kSeed, r), host.size()) << "region " << r;
  }
}

void write_back(const Imported &im) {
  std::vector<uint8_t> host(kCheckBytes);
  for (uint32_t r = 0; r < im.spec.regions; r++) {
    fill_pattern(host.data(), host.size(), kBackSeed, r);
    CUDA_OK(cudaMemcpy(im.bases[r], host.data(), host.size(), cudaMemcpyDefault));
  }
}

// A kvf_xfer gather on `device` whose region bases are the imported
// mappings, compared byte for byte with the reference gather on host copies.
void expect_kernel_gather(const Imported &im, int device) {
  GeometryPtr g = make_geometry(im.spec);
  ASSERT_TRUE(g);
  // Host copies start at the region alignment (256) like the mappings do.
  const size_t bytes = im.spec.region_bytes();
  std::vector<std::vector<uint8_t>> host(im.spec.regions, std::vector<uint8_t>(bytes + 256));
  std::vector<void *> host_bases;
  for (uint32_t r = 0; r < im.spec.regions; r++) {
    uint8_t *base = reinterpret_cast<uint8_t *>((reinterpret_cast<uintptr_t>(host[r].data()) + 255) & ~uintptr_t(255));
    fill_pattern(base, bytes, kSeed, r);
    host_bases.push_back(base);
  }
  GatherRequest want(g.get(), im.spec, host_bases, 512);
  ASSERT_EQ(kvf_reference_gather(g.get(), &want.req), KVF_SUCCESS) << kvf_last_error();

  GatherRequest got(g.get(), im.spec, im.bases, 512);
  CUDA_OK(cudaSetDevice(device));
  std::vector<void *> dev_objects;
  for (auto &o : got.objects) {
    void *d = nullptr;
    CUDA_OK(cudaMalloc(&d, o.size()));
    CUDA_OK(cudaMemset(d, 0xA5, o.size()));
    dev_objects.push_back(d);
  }
  got.req.objects = dev_objects.data();
  kvf_xfer_options xo = KVF_XFER_OPTIONS_INIT;
  xo.device = device;
  kvf_xfer *x = nullptr;
  ASSERT_EQ(kvf_xfer_create(g.get(), &xo, &x), KVF_SUCCESS) << kvf_last_error();
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  EXPECT_EQ(kvf_xfer_gather(x, &got.req, stream), KVF_SUCCESS) << kvf_last_error();
  CUDA_OK(cudaStreamSynchronize(stream));
  kvf_xfer_stats xs = KVF_XFER_STATS_INIT;
  EXPECT_EQ(kvf_xfer_last_stats(x, &xs), KVF_SUCCESS);
  EXPECT_EQ(xs.route, device == (int)im.offer.device ? KVF_ROUTE_D2D : KVF_ROUTE_PEER);
  for (size_t i = 0; i < got.objects.size(); i++) {
    CUDA_OK(cudaMemcpy(got.objects[i].data(), dev_objects[i], got.objects[i].size(), cudaMemcpyDefault));
    EXPECT_TRUE(got.objects[i] == want.objects[i]) << "object " << i;
    cudaFree(dev_objects[i]);
  }
  cudaStreamDestroy(stream);
  kvf_xfer_destroy(x);
}

void finish(Exporter &ex, Imported &im) {
  write_back(im);
  ex.send('c');
  char ok = 0;
  ASSERT_EQ(kvf_ipc_recv(ex.sock, &ok, 1, nullptr, 0, nullptr), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(ok, 1) << "the exporter sees what the importer wrote";
  ASSERT_EQ(kvf_import_table_unregister(im.table.get(), im.reg), KVF_SUCCESS) << kvf_last_error();
  im.reg = nullptr;
  EXPECT_EQ(held(table_stats(im.table.get())), zero_held());
  ex.send('q');
  EXPECT_EQ(ex.wait(), 0);
}

TEST(MemoryGpu, CumemDataIsCoherentAcrossProcessesOnOneGpu) {
  KVF_REQUIRE_GPUS(1);
  auto round = [] {
    Exporter ex("exporter", 0);
    Imported im;
    ASSERT_NO_FATAL_FAILURE(receive_and_register(ex, {0}, im));
    expect_exporter_data(im);
    finish(ex, im);
  };
  // The driver opens descriptors of its own the first time a process uses
  // a GPU and imports memory (seen on an H200: 16 -> 36): count leaks from
  // the end of a first round to the end of the next ones.
  ASSERT_NO_FATAL_FAILURE(round());
  int before = fd_count();
  ASSERT_NO_FATAL_FAILURE(round());
  ASSERT_NO_FATAL_FAILURE(round());
  EXPECT_EQ(fd_count(), before);
}

TEST(MemoryGpu, ManyViewsGiveOneImportPerAllocation) {
  KVF_REQUIRE_GPUS(1);
  Exporter ex("exporter", 0);
  Imported im;
  ASSERT_NO_FATAL_FAILURE(receive_and_register(ex, {}, im));
  kvf_import_stats s = table_stats(im.table.get());
  EXPECT_EQ(s.imports, 4u);
  EXPECT_EQ(s.aliases, 184u);
  EXPECT_EQ(s.handles, 0u);
  EXPECT_EQ(s.bytes_mapped, 4 * im.offer.ids[0].size);
  kvf_import_stats c = client_stats(im.table.get(), 1);
  EXPECT_EQ(c.imports, 4u);
  EXPECT_EQ(c.aliases, 184u);
  uint64_t gran = 0;
  ASSERT_EQ(kvf_mem_granularity(KVF_MEM_PROVIDER_CUMEM, 0, &gran), KVF_SUCCESS);
  EXPECT_EQ(im.offer.ids[0].size % gran, 0u);
  finish(ex, im);  // unregister takes imports and aliases to 0
  EXPECT_EQ(client_stats(im.table.get(), 1).aliases, 0u);
}

TEST(MemoryGpu, KernelGathersFromAnImportedMapping) {
  KVF_REQUIRE_GPUS(1);
  Exporter ex("exporter", 0);
  Imported im;
  ASSERT_NO_FATAL_FAILURE(receive_and_register(ex, {0}, im));
  expect_kernel_gather(im, 0);
  finish(ex, im);
}

TEST(MemoryGpu, ImporterKeepsDataAfterTheExporterExits) {
  KVF_REQUIRE_GPUS(1);
  Exporter ex("exporter-exit", 0);
  Imported im;
  ASSERT_NO_FATAL_FAILURE(receive_and_register(ex, {0}, im));
  ex.send('x');
  ASSERT_EQ(ex.wait(), 0) << "the exporter freed its allocations and exited";
  expect_exporter_data(im);
  expect_kernel_gather(im, 0);
  write_back(im);  // still writable
  ASSERT_EQ(kvf_import_table_unregister(im.table.get(), im.reg), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(held(table_stats(im.table.get())), zero_held());
}

TEST(MemoryGpu, CumemAcrossTwoGpus) {
  KVF_REQUIRE_GPUS(2);
  int can = 0;
  CUDA_OK(cudaDeviceCanAccessPeer(&can, 0, 1));
  if (!can) GTEST_SKIP() << "device 0 cannot access device 1 (no peer path)";
  Exporter ex("exporter", 1);  // memory on GPU 1, kernels on GPU 0
  Imported im;
  ASSERT_NO_FATAL_FAILURE(receive_and_register(ex, {0}, im));
  int dev = -1;
  ASSERT_EQ(kvf_mem_device_from_uuid(im.offer.ids[0].device_uuid, &dev), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(dev, 1);
  expect_exporter_data(im);
  expect_kernel_gather(im, 0);
  finish(ex, im);
}

TEST(MemoryGpu, CudaMallocMemoryIsRefusedWithAdvice) {
  KVF_REQUIRE_GPUS(1);
  CUDA_OK(cudaSetDevice(0));
  void *p = nullptr;
  CUDA_OK(cudaMalloc(&p, 1 << 20));
  kvf_mem_alloc *a = nullptr;
  EXPECT_EQ(kvf_mem_alloc_find(KVF_MEM_PROVIDER_CUMEM, static_cast<char *>(p) + 4096, &a), KVF_ERR_UNSUPPORTED);
  std::string msg = kvf_last_error();
  EXPECT_NE(msg.find("kvf_mem_alloc_create"), std::string::npos) << msg;
  EXPECT_EQ(a, nullptr);
  cudaFree(p);
  std::vector<char> host(64);
  EXPECT_EQ(kvf_mem_alloc_find(KVF_MEM_PROVIDER_CUMEM, host.data(), &a), KVF_ERR_INVALID_ARGUMENT) << kvf_last_error();
}

TEST(MemoryGpu, FindsTheAllocationUnderAnInteriorPointer) {
  KVF_REQUIRE_GPUS(1);
  CUDA_OK(cudaSetDevice(0));
  AllocPtr a = make_alloc(KVF_MEM_PROVIDER_CUMEM, 3 << 20, 0);
  ASSERT_TRUE(a);
  char *p = static_cast<char *>(kvf_mem_alloc_ptr(a.get()));
  kvf_mem_alloc *f = nullptr;
  ASSERT_EQ(kvf_mem_alloc_find(KVF_MEM_PROVIDER_CUMEM, p + 12345, &f), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(f, a.get());
  kvf_mem_alloc_destroy(f);
  // A foreign allocation (made with the driver directly) found through the
  // driver: cuMemGetAddressRange + cuMemRetainAllocationHandle.
  const kvf_cuda_table *cu = kvf_cuda();
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  size_t gran = 0;
  ASSERT_EQ(cu->cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED), CUDA_SUCCESS);
  CUmemGenericAllocationHandle h;
  CUdeviceptr d;
  ASSERT_EQ(cu->cuMemCreate(&h, 2 * gran, &prop, 0), CUDA_SUCCESS);
  ASSERT_EQ(cu->cuMemAddressReserve(&d, 2 * gran, gran, 0, 0), CUDA_SUCCESS);
  ASSERT_EQ(cu->cuMemMap(d, 2 * gran, 0, h, 0), CUDA_SUCCESS);
  CUmemAccessDesc acc{};
  acc.location = prop.location;
  acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  ASSERT_EQ(cu->cuMemSetAccess(d, 2 * gran, &acc, 1), CUDA_SUCCESS);
  ASSERT_EQ(kvf_mem_alloc_find(KVF_MEM_PROVIDER_CUMEM, (void *)(uintptr_t)(d + gran + 5), &f), KVF_SUCCESS)
      << kvf_last_error();
  EXPECT_EQ(kvf_mem_alloc_ptr(f), (void *)(uintptr_t)d);
  EXPECT_EQ(kvf_mem_alloc_size(f), 2 * gran);
  int fd = -1;
  EXPECT_EQ(kvf_mem_alloc_export(f, &fd, nullptr), KVF_SUCCESS) << kvf_last_error();
  EXPECT_TRUE(fd_cloexec(fd));
  close(fd);
  kvf_mem_alloc_destroy(f);
  EXPECT_EQ(cu->cuMemUnmap(d, 2 * gran), CUDA_SUCCESS);
  EXPECT_EQ(cu->cuMemAddressFree(d, 2 * gran), CUDA_SUCCESS);
  EXPECT_EQ(cu->cuMemRelease(h), CUDA_SUCCESS);
}

// In one process (export and import of the same allocations), every driver
// call and system call of register and of unregister fails in turn; after
// each, nothing leaked and the earlier registration still works.
// Whether the driver gives every POSIX-FD export of one allocation the same
// inode, and exports of different allocations different ones. Only if both
// held (on every driver we support) could the cumem provider's check of a
// descriptor sent for a mapped identity (kvf_cumem_same,
// host/memory/provider_cumem.c) compare the inode recorded at the first
// import, as the host provider does; it checks only that the descriptor
// imports as memory of the mapping's device. Reported (stdout, the test's
// properties), not asserted: run it on each driver and read the verdict.
// Driver 580.159.04 on an H200 (the same calls, in a standalone program):
// every export, of one allocation or of another, is an open of
// /dev/nvidiactl, dev 6 ino 142 mode 020666: the inode does NOT identify the
// allocation.
TEST(MemoryGpu, ExportInodes) {
  KVF_REQUIRE_GPUS(1);
  uint64_t gran = 0;
  ASSERT_EQ(kvf_mem_granularity(KVF_MEM_PROVIDER_CUMEM, 0, &gran), KVF_SUCCESS) << kvf_last_error();
  kvf_mem_alloc *a = nullptr, *b = nullptr;
  kvf_mem_alloc_options o = KVF_MEM_ALLOC_OPTIONS_INIT;
  o.provider = KVF_MEM_PROVIDER_CUMEM;
  o.device = 0;
  o.size = gran;
  ASSERT_EQ(kvf_mem_alloc_create(&o, &a), KVF_SUCCESS) << kvf_last_error();
  ASSERT_EQ(kvf_mem_alloc_create(&o, &b), KVF_SUCCESS) << kvf_last_error();
  struct Export {
    const char *what = "";
    int fd = -1;
    struct stat st {};
    std::string link;
  };
  Export ex[4];
  ex[0].what = "allocation A, export 1";
  ex[1].what = "allocation A, export 2";
  ex[2].what = "allocation B, export 1";
  ex[3].what = "allocation A, export 3 (after A's exports 1 and 2 were closed)";
  kvf_mem_alloc *of[4] = {a, a, b, a};
  for (int i = 0; i < 4; i++) {
    if (i == 3) {
      close(ex[0].fd);
      close(ex[1].fd);
      ex[0].fd = ex[1].fd = -1;
    }
    ASSERT_EQ(kvf_mem_alloc_export(of[i], &ex[i].fd, nullptr), KVF_SUCCESS) << kvf_last_error();
    ASSERT_EQ(fstat(ex[i].fd, &ex[i].st), 0);
    char path[64], target[PATH_MAX] = "";
    std::snprintf(path, sizeof path, "/proc/self/fd/%d", ex[i].fd);
    ssize_t n = readlink(path, target, sizeof target - 1);
    if (n > 0) target[n] = '\0';
    ex[i].link = target;
    std::printf("%-60s dev %llu ino %llu mode 0%o rdev %llu size %lld -> %s\n", ex[i].what,
                (unsigned long long)ex[i].st.st_dev, (unsigned long long)ex[i].st.st_ino, (unsigned)ex[i].st.st_mode,
                (unsigned long long)ex[i].st.st_rdev, (long long)ex[i].st.st_size, ex[i].link.c_str());
  }
  auto same = [](const struct stat &x, const struct stat &y) { return x.st_dev == y.st_dev && x.st_ino == y.st_ino; };
  bool one_allocation_one_inode = same(ex[0].st, ex[1].st) && same(ex[0].st, ex[3].st);
  bool two_allocations_two_inodes = !same(ex[0].st, ex[2].st);
  std::printf("verdict: exports of one allocation share an inode: %s; different allocations have different "
              "inodes: %s => the inode %s identify the allocation\n",
              one_allocation_one_inode ? "yes" : "no", two_allocations_two_inodes ? "yes" : "no",
              one_allocation_one_inode && two_allocations_two_inodes ? "does" : "does NOT");
  ::testing::Test::RecordProperty("one_allocation_one_inode", one_allocation_one_inode ? 1 : 0);
  ::testing::Test::RecordProperty("two_allocations_two_inodes", two_allocations_two_inodes ? 1 : 0);
  // What the table does with them today: A's export 3 aliases A's mapping;
  // B's export, sent for A's identity, imports as memory of the same device
  // and passes (the documented gap while the verdict is unknown).
  kvf_import_table *t = nullptr;
  ASSERT_EQ(kvf_import_table_create(nullptr, &t), KVF_SUCCESS);
  TablePtr table(t);
  kvf_mem_identity ida;
  ASSERT_EQ(kvf_mem_alloc_identity(a, &ida), KVF_SUCCESS);
  int fda = -1;
  ASSERT_EQ(kvf_mem_alloc_export(a, &fda, nullptr), KVF_SUCCESS);
  kvf_import_view v = {ida, fda, 0, gran};
  kvf_import_reg *r1 = nullptr, *r2 = nullptr, *r3 = nullptr;
  ASSERT_EQ(kvf_import_table_register(t, 1, &v, 1, &r1), KVF_SUCCESS) << kvf_last_error();
  v.fd = ex[3].fd;
  ex[3].fd = -1;
  EXPECT_EQ(kvf_import_table_register(t, 1, &v, 1, &r2), KVF_SUCCESS) << kvf_last_error();
  v.fd = ex[2].fd;
  ex[2].fd = -1;
  kvf_status st = kvf_import_table_register(t, 1, &v, 1, &r3);
  std::printf("B's export sent for A's identity: %s%s\n", kvf_status_string(st),
              st == KVF_SUCCESS ? " (passes: the device matches)" : "");
  for (kvf_import_reg *r : {r1, r2, r3}) {
    if (r) {
      EXPECT_EQ(kvf_import_table_unregister(t, r), KVF_SUCCESS) << kvf_last_error();
    }
  }
  for (auto &e : ex)
    if (e.fd >= 0) close(e.fd);
  table.reset();
  kvf_mem_alloc_destroy(a);
  kvf_mem_alloc_destroy(b);
}

TEST(MemoryGpu, FaultSweepOverTheRealDriver) {
  KVF_REQUIRE_GPUS(1);
  CUDA_OK(cudaSetDevice(0));
  CUDA_OK(cudaFree(nullptr));
  size_t free0 = 0, total = 0;
  CUDA_OK(cudaMemGetInfo(&free0, &total));
  int fds0 = fd_count();
  {
    std::vector<AllocPtr> owned;
    std::vector<kvf_mem_alloc *> allocs;
    for (int i = 0; i < 3; i++) {
      owned.push_back(make_alloc(KVF_MEM_PROVIDER_CUMEM, 2 << 20, 0));
      ASSERT_TRUE(owned.back());
      allocs.push_back(owned.back().get());
    }
    kvf_import_table *t = nullptr;
    ASSERT_EQ(kvf_import_table_create(nullptr, &t), KVF_SUCCESS);
    TablePtr table(t);
    std::vector<kvf_import_view> pv = whole_views({allocs[0]});
    kvf_import_reg *prior = nullptr;
    ASSERT_EQ(kvf_import_table_register(t, 1, pv.data(), 1, &prior), KVF_SUCCESS) << kvf_last_error();
    auto prior_works = [&](uint64_t seed) {
      kvf_import_view_info info;
      ASSERT_EQ(kvf_import_reg_view(prior, 0, &info), KVF_SUCCESS);
      std::vector<uint8_t> h(4096), back(4096);
      fill_pattern(h.data(), h.size(), seed, 0);
      CUDA_OK(cudaMemcpy(kvf_mem_alloc_ptr(allocs[0]), h.data(), h.size(), cudaMemcpyDefault));
      CUDA_OK(cudaMemcpy(back.data(), info.ptr, back.size(), cudaMemcpyDefault));
      EXPECT_EQ(back, h);
    };
    std::vector<uint64_t> base = held(table_stats(t));
    int base_fds = fd_count();

    SysFaultGuard sys;
    kvf_cuda_table wrapped = cu_fault_table(kvf_cuda_table_driver());
    const kvf_cuda_table *previous = kvf_cuda_table_install(&wrapped);
    long k = 1;
    int register_faults = 0, unregister_faults = 0;
    for (; k < 500; k++) {  // register
      std::vector<kvf_import_view> v = whole_views({allocs[0], allocs[1], allocs[2]});
      kvf_import_reg *reg = nullptr;
      arm(k);
      kvf_status st = kvf_import_table_register(t, 1, v.data(), 3, &reg);
      bool hit = faults().hit;
      disarm();
      if (st == KVF_SUCCESS) {
        ASSERT_EQ(kvf_import_table_unregister(t, reg), KVF_SUCCESS) << kvf_last_error();
      }
      EXPECT_EQ(held(table_stats(t)), base) << "k=" << k << " " << faults().hit_name;
      EXPECT_EQ(fd_count(), base_fds) << "k=" << k << " " << faults().hit_name;
      prior_works(k);
      if (!hit) break;
      register_faults++;
    }
    for (k = 1; k < 500; k++) {  // unregister
      std::vector<kvf_import_view> v = whole_views({allocs[1], allocs[2]});
      kvf_import_reg *reg = nullptr;
      ASSERT_EQ(kvf_import_table_register(t, 1, v.data(), 2, &reg), KVF_SUCCESS) << kvf_last_error();
      arm(k);
      kvf_status st = kvf_import_table_unregister(t, reg);
      bool hit = faults().hit;
      disarm();
      if (st != KVF_SUCCESS) {
        EXPECT_EQ(kvf_import_reg_get_state(reg), KVF_IMPORT_REG_CLOSING);
        ASSERT_EQ(kvf_import_table_unregister(t, reg), KVF_SUCCESS) << kvf_last_error();
      }
      EXPECT_EQ(held(table_stats(t)), base) << "k=" << k << " " << faults().hit_name;
      prior_works(1000 + k);
      if (!hit) break;
      unregister_faults++;
    }
    kvf_cuda_table_install(previous);
    EXPECT_GT(register_faults, 10);
    EXPECT_GT(unregister_faults, 2);
    ASSERT_EQ(kvf_import_table_unregister(t, prior), KVF_SUCCESS);
  }
  EXPECT_EQ(fd_count(), fds0);
  size_t free1 = 0;
  CUDA_OK(cudaMemGetInfo(&free1, &total));
  EXPECT_LE(free0 > free1 ? free0 - free1 : 0, (size_t)(2 << 20))
      << "device memory still held after every allocation and import was released";
}

#else  // !KVF_WITH_CUDA

TEST(MemoryGpu, NeedsACudaBuild) { GTEST_SKIP() << "this build of kvferry has no CUDA support"; }

#endif

}  // namespace
