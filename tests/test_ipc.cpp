// Descriptor passing (kvf_ipc_*) and the host provider across real
// processes: SCM_RIGHTS with MSG_CMSG_CLOEXEC and MSG_CTRUNC checked,
// interrupted calls retried, data coherent between a forked exporter and
// the importer, the importer's mapping outliving the exporter, and 1000
// register/unregister cycles without growth in descriptors or memory.
#include <gtest/gtest.h>

#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/wait.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <kvferry/memory.h>

#include "mem_provider_env.h"

using namespace kvf_mem_test;

namespace {

struct Pair {
  int fd[2] = {-1, -1};
  Pair() { EXPECT_EQ(kvf_ipc_socketpair(fd), KVF_SUCCESS) << kvf_last_error(); }
  ~Pair() {
    if (fd[0] >= 0) close(fd[0]);
    if (fd[1] >= 0) close(fd[1]);
  }
};

ino_t inode_of(int fd) {
  struct stat s;
  return fstat(fd, &s) == 0 ? s.st_ino : 0;
}

TEST(Ipc, DescriptorsArriveCloseOnExecAndTheSentOnesAreClosed) {
  int before = fd_count();
  {
    Pair p;
    EXPECT_TRUE(fd_cloexec(p.fd[0]));
    int pipefd[2];
    ASSERT_EQ(pipe(pipefd), 0);  // deliberately without O_CLOEXEC
    int mfd = memfd_create("kvf-ipc-test", 0);
    ASSERT_GE(mfd, 0);
    int send_fds[3] = {pipefd[0], pipefd[1], mfd};
    ino_t inodes[3] = {inode_of(pipefd[0]), inode_of(pipefd[1]), inode_of(mfd)};
    char msg[5] = "abcd";
    ASSERT_EQ(kvf_ipc_send(p.fd[0], msg, sizeof msg, send_fds, 3, KVF_IPC_CLOSE_FDS), KVF_SUCCESS)
        << kvf_last_error();
    for (int fd : send_fds) EXPECT_FALSE(fd_is_open(fd)) << "passed on, so closed";
    char got[5] = {0};
    int fds[4] = {-1, -1, -1, -1};
    uint32_t n = 99;
    ASSERT_EQ(kvf_ipc_recv(p.fd[1], got, sizeof got, fds, 4, &n), KVF_SUCCESS) << kvf_last_error();
    EXPECT_STREQ(got, "abcd");
    ASSERT_EQ(n, 3u);
    for (uint32_t i = 0; i < n; i++) {
      EXPECT_TRUE(fd_cloexec(fds[i])) << "MSG_CMSG_CLOEXEC";
      EXPECT_EQ(inode_of(fds[i]), inodes[i]);
      close(fds[i]);
    }
    // Without KVF_IPC_CLOSE_FDS the sender keeps its descriptors.
    int keep = memfd_create("kvf-ipc-keep", MFD_CLOEXEC);
    ASSERT_EQ(kvf_ipc_send(p.fd[0], "x", 1, &keep, 1, 0), KVF_SUCCESS);
    EXPECT_TRUE(fd_is_open(keep));
    ASSERT_EQ(kvf_ipc_recv(p.fd[1], got, 1, fds, 1, &n), KVF_SUCCESS);
    EXPECT_EQ(n, 1u);
    close(fds[0]);
    close(keep);
  }
  EXPECT_EQ(fd_count(), before);
}

TEST(Ipc, TruncatedDescriptorsAreClosedAndReported) {
  int before = fd_count();
  {
    Pair p;
    std::vector<int> many;
    for (int i = 0; i < 16; i++) many.push_back(memfd_create("kvf-ipc-many", MFD_CLOEXEC));
    uint64_t word = 7;
    ASSERT_EQ(kvf_ipc_send(p.fd[0], &word, sizeof word, many.data(), 16, KVF_IPC_CLOSE_FDS), KVF_SUCCESS);
    int during = fd_count();
    int fds[2] = {-1, -1};
    uint32_t n = 5;
    EXPECT_EQ(kvf_ipc_recv(p.fd[1], &word, sizeof word, fds, 2, &n), KVF_ERR_PROTOCOL);
    EXPECT_NE(std::string(kvf_last_error()).find("MSG_CTRUNC"), std::string::npos) << kvf_last_error();
    EXPECT_EQ(n, 0u);
    EXPECT_EQ(fd_count(), during) << "the descriptors that did arrive were closed";

    // No room for descriptors at all.
    int one = memfd_create("kvf-ipc-one", MFD_CLOEXEC);
    ASSERT_EQ(kvf_ipc_send(p.fd[0], &word, sizeof word, &one, 1, KVF_IPC_CLOSE_FDS), KVF_SUCCESS);
    EXPECT_EQ(kvf_ipc_recv(p.fd[1], &word, sizeof word, nullptr, 0, nullptr), KVF_ERR_PROTOCOL);
    EXPECT_EQ(fd_count(), during);
  }
  EXPECT_EQ(fd_count(), before);
}

TEST(Ipc, PeerClosingIsReportedAndLeavesNoDescriptor) {
  int before = fd_count();
  {
    Pair p;
    char buf[8];
    int fds[2];
    uint32_t n = 0;
    close(p.fd[0]);
    p.fd[0] = -1;
    EXPECT_EQ(kvf_ipc_recv(p.fd[1], buf, sizeof buf, fds, 2, &n), KVF_ERR_DISCONNECTED);
    // Sending to a closed peer: an error, never SIGPIPE.
    EXPECT_EQ(kvf_ipc_send(p.fd[1], buf, sizeof buf, nullptr, 0, 0), KVF_ERR_DISCONNECTED);
  }
  {
    // The peer closes in the middle of a message that carried descriptors.
    Pair p;
    int two[2] = {memfd_create("a", MFD_CLOEXEC), memfd_create("b", MFD_CLOEXEC)};
    ASSERT_EQ(kvf_ipc_send(p.fd[0], "abc", 3, two, 2, KVF_IPC_CLOSE_FDS), KVF_SUCCESS);
    close(p.fd[0]);
    p.fd[0] = -1;
    int during = fd_count();
    char buf[8];
    int fds[2];
    uint32_t n = 0;
    EXPECT_EQ(kvf_ipc_recv(p.fd[1], buf, sizeof buf, fds, 2, &n), KVF_ERR_PROTOCOL);
    EXPECT_NE(std::string(kvf_last_error()).find("after 3 of 8 bytes"), std::string::npos) << kvf_last_error();
    EXPECT_EQ(n, 0u);
    EXPECT_EQ(fd_count(), during);
  }
  EXPECT_EQ(fd_count(), before);
}

TEST(Ipc, ArgumentsAreChecked) {
  Pair p;
  char b = 0;
  int fd = memfd_create("kvf-ipc-arg", MFD_CLOEXEC);
  EXPECT_EQ(kvf_ipc_send(p.fd[0], &b, 0, &fd, 1, KVF_IPC_CLOSE_FDS), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_FALSE(fd_is_open(fd)) << "closed even when refused";
  int bad = -3;
  EXPECT_EQ(kvf_ipc_send(p.fd[0], &b, 1, &bad, 1, 0), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(kvf_ipc_send(p.fd[0], &b, 1, nullptr, 1, 0), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(kvf_ipc_send(p.fd[0], nullptr, 1, nullptr, 0, 0), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(kvf_ipc_send(p.fd[0], &b, 1, nullptr, 0, 8), KVF_ERR_INVALID_ARGUMENT);
  std::vector<int> too_many(KVF_IPC_MAX_FDS + 1, 0);
  EXPECT_EQ(kvf_ipc_send(p.fd[0], &b, 1, too_many.data(), KVF_IPC_MAX_FDS + 1, 0), KVF_ERR_INVALID_ARGUMENT);
  uint32_t n;
  EXPECT_EQ(kvf_ipc_recv(p.fd[1], &b, 0, nullptr, 0, &n), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(kvf_ipc_recv(p.fd[1], &b, 1, nullptr, 2, &n), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(kvf_ipc_socketpair(nullptr), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(kvf_ipc_send(-1, &b, 1, nullptr, 0, 0), KVF_ERR_SYSTEM);
}

TEST(Ipc, ReceiveTimeoutIsATimeout) {
  Pair p;
  struct timeval tv = {0, 20000};
  ASSERT_EQ(setsockopt(p.fd[1], SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv), 0);
  char b;
  EXPECT_EQ(kvf_ipc_recv(p.fd[1], &b, 1, nullptr, 0, nullptr), KVF_ERR_TIMEOUT);
}

TEST(Ipc, InterruptedCallsAreRetried) {
  // Injected EINTR on the first sendmsg and the first recvmsg.
  {
    SysFaultGuard guard;
    Pair p;
    int fd = memfd_create("kvf-ipc-eintr", MFD_CLOEXEC);
    arm_named("sendmsg", 1);
    arm_named("recvmsg", 1);
    faults().sys_errno = EINTR;
    ASSERT_EQ(kvf_ipc_send(p.fd[0], "hi", 2, &fd, 1, KVF_IPC_CLOSE_FDS), KVF_SUCCESS) << kvf_last_error();
    char got[2];
    int in = -1;
    uint32_t n = 0;
    ASSERT_EQ(kvf_ipc_recv(p.fd[1], got, 2, &in, 1, &n), KVF_SUCCESS) << kvf_last_error();
    EXPECT_TRUE(faults().hit);
    EXPECT_EQ(calls_of("sendmsg"), 2);
    EXPECT_EQ(calls_of("recvmsg"), 2);
    disarm();
    EXPECT_EQ(n, 1u);
    close(in);
  }
  // A real signal, delivered without SA_RESTART while recvmsg blocks.
  static std::atomic<int> signals{0};
  struct sigaction sa, old;
  std::memset(&sa, 0, sizeof sa);
  sa.sa_handler = [](int) { signals++; };
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = 0;  // no SA_RESTART: the call returns EINTR
  ASSERT_EQ(sigaction(SIGUSR1, &sa, &old), 0);
  Pair p;
  std::atomic<int> result{-1};
  uint64_t got = 0;
  std::thread reader([&] { result = kvf_ipc_recv(p.fd[1], &got, sizeof got, nullptr, 0, nullptr); });
  for (int i = 0; i < 5; i++) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    pthread_kill(reader.native_handle(), SIGUSR1);
  }
  uint64_t word = 0x1122334455667788ull;
  ASSERT_EQ(kvf_ipc_send(p.fd[0], &word, sizeof word, nullptr, 0, 0), KVF_SUCCESS);
  reader.join();
  sigaction(SIGUSR1, &old, nullptr);
  EXPECT_GE(signals.load(), 1);
  EXPECT_EQ(result.load(), KVF_SUCCESS);
  EXPECT_EQ(got, word);
}

// ---- across processes ----------------------------------------------------------

struct Offer {
  uint32_t count;
  uint32_t cycle;
  kvf_mem_identity ids[2];
};

// Run `child` in a forked process with its end of a socket pair; the parent
// gets the other end (with a receive timeout, so a dead child cannot hang it).
struct Child {
  pid_t pid = -1;
  int sock = -1;
  template <typename F>
  explicit Child(F child) {
    int sv[2];
    EXPECT_EQ(kvf_ipc_socketpair(sv), KVF_SUCCESS);
    pid = fork();
    if (pid == 0) {
      close(sv[0]);
      int rc = child(sv[1]);
      _exit(rc);
    }
    close(sv[1]);
    sock = sv[0];
    struct timeval tv = {20, 0};
    setsockopt(sock, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  }
  // The child's exit code, or -1.
  int wait() {
    int status = 0;
    if (pid > 0 && waitpid(pid, &status, 0) == pid) {
      pid = -1;
      return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    }
    return -1;
  }
  ~Child() {
    if (sock >= 0) close(sock);
    if (pid > 0) {
      kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
    }
  }
};

// The exporter side of the coherence test: two allocations filled with a
// pattern, offered with their descriptors; then checks what the importer wrote.
int coherent_exporter(int sock) {
  kvf_mem_alloc_options o = KVF_MEM_ALLOC_OPTIONS_INIT;
  o.provider = KVF_MEM_PROVIDER_HOST;
  o.size = 1 << 20;
  kvf_mem_alloc *a[2];
  Offer offer{};
  int fds[2];
  for (int i = 0; i < 2; i++) {
    if (kvf_mem_alloc_create(&o, &a[i]) != KVF_SUCCESS) return 10;
    fill_pattern(kvf_mem_alloc_ptr(a[i]), o.size, 1, (uint32_t)i);
    if (kvf_mem_alloc_export(a[i], &fds[i], &offer.ids[i]) != KVF_SUCCESS) return 11;
  }
  offer.count = 2;
  if (kvf_ipc_send(sock, &offer, sizeof offer, fds, 2, KVF_IPC_CLOSE_FDS) != KVF_SUCCESS) return 12;
  char cmd;
  if (kvf_ipc_recv(sock, &cmd, 1, nullptr, 0, nullptr) != KVF_SUCCESS || cmd != 'c') return 13;
  char ok = 1;
  for (int i = 0; i < 2; i++)
    if (check_pattern(kvf_mem_alloc_ptr(a[i]), o.size, 2, (uint32_t)i) != o.size) ok = 0;
  if (kvf_ipc_send(sock, &ok, 1, nullptr, 0, 0) != KVF_SUCCESS) return 14;
  if (kvf_ipc_recv(sock, &cmd, 1, nullptr, 0, nullptr) != KVF_SUCCESS) return 15;
  for (auto *x : a) kvf_mem_alloc_destroy(x);
  return 0;
}

TEST(IpcFork, HostMemoryIsCoherentBetweenExporterAndImporter) {
  int before = fd_count();
  {
    Child child(coherent_exporter);
    Offer offer{};
    int fds[2] = {-1, -1};
    uint32_t n = 0;
    ASSERT_EQ(kvf_ipc_recv(child.sock, &offer, sizeof offer, fds, 2, &n), KVF_SUCCESS) << kvf_last_error();
    ASSERT_EQ(n, 2u);
    EXPECT_TRUE(fd_cloexec(fds[0]));
    EXPECT_TRUE(fd_cloexec(fds[1]));
    EXPECT_NE(offer.ids[0].allocation_id, offer.ids[1].allocation_id);
    uint64_t mine = 0;
    kvf_mem_instance(&mine, nullptr);
    EXPECT_NE(offer.ids[0].instance_id, mine) << "the exporter's instance";

    kvf_import_table *t = nullptr;
    ASSERT_EQ(kvf_import_table_create(nullptr, &t), KVF_SUCCESS);
    TablePtr table(t);
    std::vector<kvf_import_view> views;
    for (int i = 0; i < 2; i++)
      for (uint64_t part = 0; part < 4; part++)
        views.push_back({offer.ids[i], part == 0 ? fds[i] : -1, part * (offer.ids[i].size / 4), offer.ids[i].size / 4});
    kvf_import_reg *reg = nullptr;
    ASSERT_EQ(kvf_import_table_register(t, 1, views.data(), (uint32_t)views.size(), &reg), KVF_SUCCESS)
        << kvf_last_error();
    EXPECT_EQ(table_stats(t).imports, 2u);
    EXPECT_EQ(table_stats(t).aliases, 8u);
    for (int i = 0; i < 2; i++) {
      kvf_import_view_info info;
      ASSERT_EQ(kvf_import_reg_view(reg, (uint32_t)i * 4, &info), KVF_SUCCESS);
      EXPECT_EQ(check_pattern(info.base, info.mapping_size, 1, (uint32_t)i), info.mapping_size)
          << "the exporter's bytes are visible";
      fill_pattern(info.base, info.mapping_size, 2, (uint32_t)i);
    }
    char cmd = 'c', ok = 0;
    ASSERT_EQ(kvf_ipc_send(child.sock, &cmd, 1, nullptr, 0, 0), KVF_SUCCESS);
    ASSERT_EQ(kvf_ipc_recv(child.sock, &ok, 1, nullptr, 0, nullptr), KVF_SUCCESS);
    EXPECT_EQ(ok, 1) << "the importer's bytes are visible to the exporter";
    cmd = 'q';
    ASSERT_EQ(kvf_ipc_send(child.sock, &cmd, 1, nullptr, 0, 0), KVF_SUCCESS);
    EXPECT_EQ(child.wait(), 0);
    ASSERT_EQ(kvf_import_table_unregister(t, reg), KVF_SUCCESS);
    EXPECT_EQ(held(table_stats(t)), zero_held());
  }
  EXPECT_EQ(fd_count(), before);
}

// The exporter frees its memory and exits; the importer's mapping keeps the
// memory, and its data, until the importer unmaps. One allocation is mapped
// before the exporter exits, the other only after (its descriptor in hand).
TEST(IpcFork, ImporterKeepsTheDataAfterTheExporterExits) {
  int before = fd_count();
  long vm_before = proc_status_kb("VmSize");
  {
    Child child([](int sock) {
      kvf_mem_alloc_options o = KVF_MEM_ALLOC_OPTIONS_INIT;
      o.provider = KVF_MEM_PROVIDER_HOST;
      o.size = 4 << 20;
      kvf_mem_alloc *a[2];
      Offer offer{};
      int fds[2];
      for (int i = 0; i < 2; i++) {
        if (kvf_mem_alloc_create(&o, &a[i]) != KVF_SUCCESS) return 10;
        fill_pattern(kvf_mem_alloc_ptr(a[i]), o.size, 5, (uint32_t)i);
        if (kvf_mem_alloc_export(a[i], &fds[i], &offer.ids[i]) != KVF_SUCCESS) return 11;
      }
      offer.count = 2;
      if (kvf_ipc_send(sock, &offer, sizeof offer, fds, 2, KVF_IPC_CLOSE_FDS) != KVF_SUCCESS) return 12;
      char cmd;
      if (kvf_ipc_recv(sock, &cmd, 1, nullptr, 0, nullptr) != KVF_SUCCESS) return 13;
      for (auto *x : a) {
        std::memset(kvf_mem_alloc_ptr(x), 0, 4096);  // last words before it goes
        fill_pattern(kvf_mem_alloc_ptr(x), 4096, 5, 0);
        kvf_mem_alloc_destroy(x);
      }
      return 0;
    });
    Offer offer{};
    int fds[2] = {-1, -1};
    uint32_t n = 0;
    ASSERT_EQ(kvf_ipc_recv(child.sock, &offer, sizeof offer, fds, 2, &n), KVF_SUCCESS) << kvf_last_error();
    ASSERT_EQ(n, 2u);
    kvf_import_table *t = nullptr;
    ASSERT_EQ(kvf_import_table_create(nullptr, &t), KVF_SUCCESS);
    TablePtr table(t);
    kvf_import_view first{offer.ids[0], fds[0], 0, offer.ids[0].size};
    kvf_import_reg *r0 = nullptr, *r1 = nullptr;
    ASSERT_EQ(kvf_import_table_register(t, 1, &first, 1, &r0), KVF_SUCCESS) << kvf_last_error();

    char cmd = 'x';
    ASSERT_EQ(kvf_ipc_send(child.sock, &cmd, 1, nullptr, 0, 0), KVF_SUCCESS);
    pid_t exporter = child.pid;
    ASSERT_EQ(child.wait(), 0);
    ASSERT_EQ(kill(exporter, 0), -1);  // gone (and reaped)

    kvf_import_view second{offer.ids[1], fds[1], 0, offer.ids[1].size};
    ASSERT_EQ(kvf_import_table_register(t, 1, &second, 1, &r1), KVF_SUCCESS) << kvf_last_error();
    for (kvf_import_reg *r : {r0, r1}) {
      kvf_import_view_info info;
      ASSERT_EQ(kvf_import_reg_view(r, 0, &info), KVF_SUCCESS);
      uint32_t region = r == r0 ? 0u : 1u;
      EXPECT_EQ(check_pattern(info.base, 4096, 5, 0), 4096u) << "the exporter's last write";
      const uint8_t *b = static_cast<const uint8_t *>(info.base);
      uint64_t bad = 0;
      for (uint64_t i = 4096; i < info.mapping_size; i++) bad += b[i] != pattern_byte(5, region, i);
      EXPECT_EQ(bad, 0u) << "the data outlives the exporter";
      std::memset(info.base, 0x77, info.mapping_size);  // still writable
    }
    EXPECT_EQ(table_stats(t).bytes_mapped, 8u << 20);
    ASSERT_EQ(kvf_import_table_unregister(t, r0), KVF_SUCCESS);
    ASSERT_EQ(kvf_import_table_unregister(t, r1), KVF_SUCCESS);
    EXPECT_EQ(held(table_stats(t)), zero_held());
  }
  EXPECT_EQ(fd_count(), before);
  EXPECT_LE(proc_status_kb("VmSize") - vm_before, 4096) << "the memory went away with the last mapping";
}

// 1000 cycles of export -> send -> receive -> register -> check -> unregister
// between a forked exporter and this process: neither side grows in
// descriptors, and this side does not grow in address space or RSS.
TEST(IpcFork, ThousandRegisterCyclesDoNotGrow) {
  constexpr uint32_t kCycles = 1000;
  constexpr uint64_t kSize = 4 << 20;
  Child child([](int sock) {
    kvf_mem_alloc_options o = KVF_MEM_ALLOC_OPTIONS_INIT;
    o.provider = KVF_MEM_PROVIDER_HOST;
    o.size = kSize;
    kvf_mem_alloc *a[2];
    for (auto &x : a)
      if (kvf_mem_alloc_create(&o, &x) != KVF_SUCCESS) return 10;
    int fds_start = 0;
    for (uint32_t cycle = 0; cycle < kCycles; cycle++) {
      if (cycle == 10) fds_start = fd_count();
      Offer offer{};
      int fds[2];
      offer.count = 2;
      offer.cycle = cycle;
      for (int i = 0; i < 2; i++) {
        std::memcpy(static_cast<char *>(kvf_mem_alloc_ptr(a[i])) + kSize - 8, &cycle, sizeof cycle);
        if (kvf_mem_alloc_export(a[i], &fds[i], &offer.ids[i]) != KVF_SUCCESS) return 11;
      }
      if (kvf_ipc_send(sock, &offer, sizeof offer, fds, 2, KVF_IPC_CLOSE_FDS) != KVF_SUCCESS) return 12;
      char ack;
      if (kvf_ipc_recv(sock, &ack, 1, nullptr, 0, nullptr) != KVF_SUCCESS || ack != 'k') return 13;
    }
    int growth = fd_count() - fds_start;
    for (auto *x : a) kvf_mem_alloc_destroy(x);
    return growth == 0 ? 0 : 20;
  });
  kvf_import_table *t = nullptr;
  ASSERT_EQ(kvf_import_table_create(nullptr, &t), KVF_SUCCESS);
  TablePtr table(t);
  int fds_start = 0;
  long vm_start = 0, rss_start = 0;
  for (uint32_t cycle = 0; cycle < kCycles; cycle++) {
    if (cycle == 10) {
      fds_start = fd_count();
      vm_start = proc_status_kb("VmSize");
      rss_start = proc_status_kb("VmRSS");
    }
    Offer offer{};
    int fds[2] = {-1, -1};
    uint32_t n = 0;
    ASSERT_EQ(kvf_ipc_recv(child.sock, &offer, sizeof offer, fds, 2, &n), KVF_SUCCESS) << kvf_last_error();
    ASSERT_EQ(n, 2u);
    ASSERT_EQ(offer.cycle, cycle);
    std::vector<kvf_import_view> views;
    for (int i = 0; i < 2; i++)
      for (uint64_t part = 0; part < 8; part++)
        views.push_back({offer.ids[i], part == 0 ? fds[i] : -1, part * (kSize / 8), kSize / 8});
    kvf_import_reg *reg = nullptr;
    ASSERT_EQ(kvf_import_table_register(t, 1, views.data(), (uint32_t)views.size(), &reg), KVF_SUCCESS)
        << kvf_last_error();
    kvf_import_view_info info;
    ASSERT_EQ(kvf_import_reg_view(reg, 15, &info), KVF_SUCCESS);
    uint32_t seen = 0;
    std::memcpy(&seen, static_cast<char *>(info.base) + kSize - 8, sizeof seen);
    ASSERT_EQ(seen, cycle) << "the exporter's write of this cycle";
    ASSERT_EQ(kvf_import_table_unregister(t, reg), KVF_SUCCESS);
    char ack = 'k';
    ASSERT_EQ(kvf_ipc_send(child.sock, &ack, 1, nullptr, 0, 0), KVF_SUCCESS);
  }
  EXPECT_EQ(child.wait(), 0) << "the exporter's descriptors did not grow (20: they did)";
  EXPECT_EQ(fd_count(), fds_start);
  long vm_growth = proc_status_kb("VmSize") - vm_start, rss_growth = proc_status_kb("VmRSS") - rss_start;
  EXPECT_LE(vm_growth, 16 * 1024) << "KiB of address space gained over 990 cycles (one leaked mapping is 4096)";
  EXPECT_LE(rss_growth, 16 * 1024) << "KiB of RSS gained";
  kvf_import_stats s = table_stats(t);
  EXPECT_EQ(held(s), zero_held());
  EXPECT_EQ(s.imports_total, 2u * kCycles);
}

}  // namespace
