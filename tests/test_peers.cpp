// kvferryd peers (host/server/peers.h, docs/peers.md) across real
// processes on loopback: kvferryd A is the real binary in a child process
// (so it can be SIGKILLed and restarted), B is the server object on a thread
// of this test (so its L1, its fetches and its peers' counters can be read),
// both over UCX with the transport UCX_TLS names. Engines are host-backend
// clients in this process: a cache stored through A is retrieved through B
// and compared byte for byte.
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/shm.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <openssl/evp.h>
#include <openssl/hmac.h>

#include <kvferry/client.h>
#include <kvferry/geometry.h>
#include <kvferry/memory.h>

#include "server_test_util.h"
#include "host/core/param.h"
#include "host/server/peer_transport.h"
#include "host/server/peers.h"
#include "host/server/server.h"

namespace {

using Clock = std::chrono::steady_clock;

void sleep_ms(int ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); }
int64_t ms_since(Clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count();
}

using kvf_server_test::preset_json;
using kvf_server_test::splitmix;

struct TempDir : kvf_server_test::TempDir {
  TempDir() : kvf_server_test::TempDir("kvf-peers") {}
};

std::string write_secret(const std::string &path, const std::string &text, mode_t mode = 0600) {
  int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  if (fd < 0) return "";
  if (write(fd, text.data(), text.size()) != (ssize_t)text.size()) {
    close(fd);
    return "";
  }
  fchmod(fd, mode);
  close(fd);
  return path;
}

// A TCP port free now on 127.0.0.1, below the ephemeral range (32768 and
// up): an outgoing connection's ephemeral port, or a UCX interface's own
// listening port, can never take it while A restarts.
uint16_t free_port() {
  static uint64_t seed = (uint64_t)getpid() * 0x9E3779B97F4A7C15ull;
  for (int tries = 0; tries < 1000; tries++) {
    uint16_t port = (uint16_t)(20000 + splitmix(&seed) % 12000);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_port = htons(port);
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    int ok = bind(fd, (sockaddr *)&sa, sizeof sa) == 0;
    close(fd);
    if (ok) return port;
  }
  return 0;
}

// ---- kvferryd A, the real binary ------------------------------------------------

struct Daemon {
  pid_t pid = -1;
  std::string dir;
  ~Daemon() { kill_now(); }
  std::string start(const std::string &socket_dir, const std::vector<std::string> &extra) {
    dir = socket_dir;
    std::vector<std::string> args = {KVF_KVFERRYD_PATH, "--socket-dir", socket_dir, "--devices", "none",
                                     "--l1-mb", "256"};
    args.insert(args.end(), extra.begin(), extra.end());
    // argv is built before fork: the child of this multi-threaded process
    // (B's threads, UCX's) calls nothing but execv and _exit.
    std::vector<char *> argv;
    for (auto &arg : args) argv.push_back(const_cast<char *>(arg.c_str()));
    argv.push_back(nullptr);
    fflush(stdout);
    fflush(stderr);
    pid = fork();
    if (pid == 0) {
      execv(argv[0], argv.data());
      _exit(127);
    }
    auto t0 = Clock::now();
    std::string sock = socket_dir + "/kvferryd.sock";
    while (ms_since(t0) < 10000) {
      struct stat sb;
      if (stat(sock.c_str(), &sb) == 0) return "";
      int status = 0;
      if (waitpid(pid, &status, WNOHANG) == pid) {
        pid = -1;
        return "kvferryd exited with status " + std::to_string(status);
      }
      sleep_ms(10);
    }
    return "kvferryd did not start";
  }
  void kill_now() {
    if (pid <= 0) return;
    kill(pid, SIGKILL);
    waitpid(pid, nullptr, 0);
    pid = -1;
    unlink((dir + "/kvferryd.sock").c_str());
  }
  int stop() {
    if (pid <= 0) return -1;
    kill(pid, SIGTERM);
    int status = 0;
    waitpid(pid, &status, 0);
    pid = -1;
    return status;
  }
};

// The largest System V or POSIX shared-memory mapping of process pid.
uint64_t largest_shared_segment(pid_t pid) {
  FILE *f = fopen(("/proc/" + std::to_string(pid) + "/maps").c_str(), "r");
  if (!f) return 0;
  char line[512];
  uint64_t best = 0;
  while (fgets(line, sizeof(line), f)) {
    unsigned long lo = 0, hi = 0;
    if (sscanf(line, "%lx-%lx", &lo, &hi) != 2) continue;
    if ((strstr(line, "SYSV") || strstr(line, "/dev/shm/")) && hi - lo > best) best = hi - lo;
  }
  fclose(f);
  return best;
}

// ---- kvferryd B, in this process ------------------------------------------------

struct ServerB : kvf_server_test::InProcessServer {
  std::vector<std::string> peer_addrs;
  std::vector<const char *> peer_ptrs;
  std::string secret;
  kvf_status start(const std::string &dir, const std::string &peer, const std::string &secret_file,
                   const char *listen = nullptr) {
    kvf_server_options o = KVF_SERVER_OPTIONS_INIT;
    o.socket_dir = dir.c_str();
    o.heartbeat_timeout_ms = 60000;
    o.l1_bytes = 256ull << 20;
    peer_addrs = {peer};
    for (auto &a : peer_addrs) peer_ptrs.push_back(a.c_str());
    o.peers = peer_ptrs.data();
    o.num_peers = (uint32_t)peer_ptrs.size();
    secret = secret_file;
    o.peer_secret_file = secret.c_str();
    o.peer_listen = listen;
    o.peer_fetch_timeout_ms = 2000;
    return InProcessServer::start(o);
  }
  kvf_peers *peers() { return kvf_server_peers(s); }
  bool wait_ready(int64_t ms = 10000) {
    auto t0 = Clock::now();
    while (ms_since(t0) < ms) {
      if (kvf_peers_ready(peers()) > 0) return true;
      sleep_ms(10);
    }
    return false;
  }
  kvf_peer_info info() {
    kvf_peer_info i;
    memset(&i, 0, sizeof i);
    kvf_peers_info(peers(), &i, 1);
    return i;
  }
  kvf_dataplane_stats data() {
    kvf_dataplane_stats d;
    memset(&d, 0, sizeof d);
    EXPECT_EQ(kvf_server_data_stats(s, &d), KVF_SUCCESS) << kvf_last_error();
    return d;
  }
};

// ---- engines -------------------------------------------------------------------

// Full attention, 2 layers in 2 regions, K and V, 2 heads of 128 bytes,
// 16-token blocks without padding, chunk_tokens 64: every byte of the cache
// is payload, so caches that moved the same blocks compare whole.
std::string geometry_json(uint32_t nb, uint32_t heads = 2) {
  uint32_t hb = 128, token_stride = heads * hb, block_stride = 16 * token_stride;
  char buf[2048];
  snprintf(buf, sizeof buf, R"({
  "format": "kvferry-geometry", "version": 1, "name": "peers",
  "regions": [{"name": "kv", "count": 2, "size": 0}],
  "groups": [{"name": "full", "kind": "full", "block_size": 16, "num_blocks": %u,
    "layers": [{"count": 2, "name": "layer", "region": "kv", "region_step": 1, "offset": 0,
      "elem_bytes": 2, "block_stride": %u, "planes": 2, "heads": %u, "head_bytes": %u,
      "plane_stride": "num_blocks * block_stride", "token_stride": %u, "head_stride": %u}]}],
  "objects": {"chunk_tokens": 64, "format": "canonical"}
})",
           nb, block_stride, heads, hb, token_stride, hb);
  return buf;
}

struct Engine {
  std::string json;
  kvf_geometry *g = nullptr;
  std::vector<uint64_t> offsets, sizes;
  uint64_t total = 0;
  kvf_mem_alloc *alloc = nullptr;
  kvf_client *c = nullptr;
  kvf_client_registration reg = KVF_CLIENT_REGISTRATION_INIT;
  ~Engine() { close(); }
  std::string open(const std::string &dir, const std::string &geometry, uint64_t seed) {
    json = geometry;
    kvf_geometry_error err;
    if (kvf_geometry_load_buffer(json.data(), json.size(), nullptr, &g, &err) != KVF_SUCCESS)
      return std::string("geometry: ") + kvf_last_error();
    for (uint32_t r = 0; r < kvf_geometry_num_regions(g); r++) {
      kvf_region_info ri = KVF_REGION_INFO_INIT;
      kvf_geometry_region(g, r, &ri);
      total = (total + 4095) / 4096 * 4096;
      offsets.push_back(total);
      sizes.push_back(ri.size);
      total += ri.size;
    }
    kvf_mem_alloc_options o = KVF_MEM_ALLOC_OPTIONS_INIT;
    o.provider = KVF_MEM_PROVIDER_HOST;
    o.size = total;
    o.name = "kvf-test-peers";
    if (kvf_mem_alloc_create(&o, &alloc) != KVF_SUCCESS) return std::string("alloc: ") + kvf_last_error();
    uint64_t s = seed;
    uint8_t *p = mem();
    for (uint64_t i = 0; i < total; i++) p[i] = (uint8_t)splitmix(&s);
    return attach(dir);
  }
  std::string attach(const std::string &dir) {
    kvf_client_disconnect(c);
    c = nullptr;
    kvf_client_options co = KVF_CLIENT_OPTIONS_INIT;
    co.socket_dir = dir.c_str();
    co.name = "peers-engine";
    co.timeout_ms = 20000;
    if (kvf_client_connect(&co, &c, nullptr) != KVF_SUCCESS) return std::string("connect: ") + kvf_last_error();
    std::vector<kvf_client_region> regions;
    for (size_t r = 0; r < offsets.size(); r++) regions.push_back({alloc, offsets[r], sizes[r]});
    if (kvf_client_register(c, json.data(), json.size(), -1, regions.data(), (uint32_t)regions.size(), &reg) !=
        KVF_SUCCESS)
      return std::string("register: ") + kvf_last_error();
    return "";
  }
  uint8_t *mem() const { return static_cast<uint8_t *>(kvf_mem_alloc_ptr(alloc)); }
  void close() {
    kvf_client_disconnect(c);
    c = nullptr;
    kvf_mem_alloc_destroy(alloc);
    alloc = nullptr;
    kvf_geometry_destroy(g);
    g = nullptr;
  }
};

// Chunk keys of a prompt of token ids drawn from seed, under a seed naming
// the model (the same for every layout of it).
std::vector<kvf_chunk_key> prompt_keys(const kvf_geometry *g, uint64_t seed, uint64_t tokens, uint32_t C) {
  (void)g;
  std::vector<uint32_t> ids(tokens);
  uint64_t s = seed;
  for (auto &t : ids) t = (uint32_t)(splitmix(&s) % 151552);
  std::vector<kvf_chunk_key> keys((tokens + C - 1) / C);
  kvf_chunk_key model;
  EXPECT_EQ(kvf_chunk_seed("test_peers model", 16, &model), KVF_SUCCESS);
  EXPECT_EQ(kvf_chunk_keys(&model, ids.data(), 4, tokens, C, keys.data()), keys.size());
  return keys;
}

// One STORE or RETRIEVE of tokens [0, T) through blocks ids (block b of the
// prompt in ids[b]).
kvf_status xfer(Engine &e, bool store, const std::vector<kvf_chunk_key> &keys, const std::vector<uint32_t> &ids, uint64_t T,
                kvf_client_result *r) {
  kvf_group_blocks gb = {ids.data(), 0, (uint32_t)ids.size()};
  kvf_client_xfer x = KVF_CLIENT_XFER_INIT;
  x.token_begin = 0;
  x.token_end = T;
  x.format = KVF_FORMAT_CANONICAL;
  x.chunk_keys = keys.data();
  x.num_chunk_keys = (uint32_t)keys.size();
  x.groups = &gb;
  x.num_groups = 1;
  *r = KVF_CLIENT_RESULT_INIT;
  return store ? kvf_client_store(e.c, &x, r) : kvf_client_retrieve(e.c, &x, r);
}

std::vector<uint32_t> shuffled(uint32_t n, uint64_t seed) {
  std::vector<uint32_t> p(n);
  for (uint32_t i = 0; i < n; i++) p[i] = i;
  for (uint32_t i = n - 1; i > 0; i--) std::swap(p[i], p[splitmix(&seed) % (i + 1)]);
  return p;
}

// Bytes of blocks ids[0 .. nblocks) equal in both caches (each block's
// payload in every region, both planes)?
std::string compare_blocks(const Engine &a, const Engine &b, const std::vector<uint32_t> &ids, uint64_t nblocks,
                           uint32_t nb, uint32_t block_bytes) {
  for (size_t r = 0; r < a.offsets.size(); r++)
    for (uint32_t plane = 0; plane < 2; plane++)
      for (uint64_t k = 0; k < nblocks; k++) {
        uint64_t off = a.offsets[r] + (uint64_t)plane * nb * block_bytes + (uint64_t)ids[k] * block_bytes;
        if (memcmp(a.mem() + off, b.mem() + off, block_bytes) != 0)
          return "region " + std::to_string(r) + " plane " + std::to_string(plane) + " prompt block " +
                 std::to_string(k) + " (block id " + std::to_string(ids[k]) + ") differs";
      }
  return "";
}

// ---- the fixture -----------------------------------------------------------------

// Shared memory for the gets: UCX_TLS=sm,self,tcp and KVF_PEER_SHM=1 for B
// (this process) and the A it starts. KVF_PEER_SHM is read once per
// process: set by a case, it would stay on for the in-process B of every
// later case while their A (a new process) has it off, and UCX refuses
// endpoints whose failure handling differs; so such a case runs alone (as
// ctest runs it). Returns why it cannot ("": it can).
std::string use_shared_memory() {
  if (::testing::UnitTest::GetInstance()->test_to_run_count() > 1)
    return "KVF_PEER_SHM is a per-process parameter: run this case alone, as ctest does";
  setenv("UCX_TLS", "sm,self,tcp", 1);
  setenv("KVF_PEER_SHM", "1", 1);
  if (kvf_param_peer_shm() != 1) {
    unsetenv("UCX_TLS");
    return "KVF_PEER_SHM was read before this case set it (parameters are read once per process): run the case "
           "alone, as ctest does";
  }
  return "";
}

class Peers : public ::testing::Test {
 public:
  static constexpr uint32_t kBlocks = 256, kHeads = 2;
  static constexpr uint32_t kBlockBytes = 16 * kHeads * 128;

 protected:
  TempDir tmp;
  std::string secret, dir_a, dir_b, addr;
  Daemon a;
  ServerB b;

  void SetUp() override {
    ASSERT_FALSE(tmp.path.empty());
    secret = write_secret(tmp.path + "/secret", "correct horse battery staple 0123456789\n");
    ASSERT_FALSE(secret.empty());
    dir_a = tmp.path + "/a";
    dir_b = tmp.path + "/b";
    addr = "127.0.0.1:" + std::to_string(free_port());
  }
  std::string start_a(const std::string &secret_file = "") {
    return a.start(dir_a, {"--listen", addr, "--peer-secret-file", secret_file.empty() ? secret : secret_file});
  }
  // A SIGKILLed 0-40 ms from now (the delay drawn from *rng), on a thread
  // the caller joins: the kill lands anywhere in what the caller does next.
  std::thread kill_a_within_40ms(uint64_t *rng) {
    int delay_us = (int)(splitmix(rng) % 40000);
    return std::thread([this, delay_us] {
      std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
      a.kill_now();
    });
  }
};

// Store T tokens (keys of 64 tokens from `seed`) through src from the first
// T/16 of nb shuffled blocks (by `shuffle`): the keys and block ids.
void store_prompt(Engine &src, uint64_t seed, uint32_t nb, uint64_t shuffle, uint64_t T,
                  std::vector<kvf_chunk_key> *keys, std::vector<uint32_t> *ids) {
  *keys = prompt_keys(src.g, seed, T, 64);
  *ids = shuffled(nb, shuffle);
  ids->resize(T / 16);
  kvf_client_result r;
  ASSERT_EQ(xfer(src, true, *keys, *ids, T, &r), KVF_SUCCESS) << kvf_last_error();
  ASSERT_EQ(r.prefix_tokens, T);
}

void expect_b_idle(ServerB &b, const std::string &when) {
  auto t0 = Clock::now();
  kvf_peers_counters pc;
  kvf_dataplane_stats d;
  for (;;) {
    kvf_peers_counters_get(b.peers(), &pc);
    d = b.data();
    if ((pc.fetches_in_flight == 0 && d.l1.objects_reserved == 0 && d.in_flight == 0) || ms_since(t0) > 10000) break;
    sleep_ms(5);
  }
  EXPECT_EQ(pc.fetches_in_flight, 0u) << when;
  EXPECT_EQ(d.l1.objects_reserved, 0u) << when;
  EXPECT_EQ(d.l1.bytes_reserved, 0u) << when;
  EXPECT_EQ(d.l1.objects_pinned, 0u) << when;
  EXPECT_EQ(d.in_flight, 0u) << when;
}

// Store through A, retrieve through B: every block restored, byte for byte;
// a second RETRIEVE is served from B's own L1 (nothing pulled again).
void round_trip(Peers *t, Daemon &, ServerB &b, const std::string &dir_a, const std::string &dir_b, uint64_t seed) {
  const uint32_t nb = Peers::kBlocks;
  Engine src, dst;
  ASSERT_EQ(src.open(dir_a, geometry_json(nb), seed), "");
  ASSERT_EQ(dst.open(dir_b, geometry_json(nb), seed + 1), "");
  const uint64_t T = 4000; // 62 full chunks and a partial one: 250 blocks
  std::vector<kvf_chunk_key> keys = prompt_keys(src.g, seed, T, 64);
  std::vector<uint32_t> ids = shuffled(nb, seed);
  ids.resize((T + 15) / 16);
  kvf_client_result r;
  ASSERT_EQ(xfer(src, true, keys, ids, T, &r), KVF_SUCCESS) << kvf_last_error();
  ASSERT_EQ(r.prefix_tokens, T);
  ASSERT_EQ(r.objects_done, keys.size());
  std::vector<uint32_t> rids = shuffled(nb, seed + 7);
  rids.resize(ids.size());
  kvf_peer_info before = b.info();
  ASSERT_EQ(xfer(dst, false, keys, rids, T, &r), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(r.status, KVF_SUCCESS) << kvf_status_string(r.status);
  EXPECT_EQ(r.prefix_tokens, T) << kvf_status_string(r.status);
  EXPECT_EQ(r.objects_done, keys.size());
  // Compare block by block: the source's prompt block k in ids[k], the destination's in rids[k].
  for (size_t reg = 0; reg < src.offsets.size(); reg++)
    for (uint32_t plane = 0; plane < 2; plane++)
      for (uint64_t k = 0; k < T / 16; k++) {
        uint64_t so = src.offsets[reg] + (uint64_t)plane * nb * Peers::kBlockBytes + (uint64_t)ids[k] * Peers::kBlockBytes;
        uint64_t d0 = dst.offsets[reg] + (uint64_t)plane * nb * Peers::kBlockBytes + (uint64_t)rids[k] * Peers::kBlockBytes;
        ASSERT_EQ(memcmp(src.mem() + so, dst.mem() + d0, Peers::kBlockBytes), 0)
            << "region " << reg << " plane " << plane << " block " << k;
      }
  kvf_peer_info after = b.info();
  EXPECT_EQ(after.objects_pulled - before.objects_pulled, keys.size());
  // STAT shows the peers on both sides.
  kvf_client_peer_record rec[4];
  uint32_t n = 0;
  ASSERT_EQ(kvf_client_stat_peers(dst.c, rec, 4, &n), KVF_SUCCESS) << kvf_last_error();
  ASSERT_EQ(n, 1u);
  EXPECT_EQ(rec[0].state, 2u);
  EXPECT_EQ(rec[0].outgoing, 1u);
  EXPECT_EQ(rec[0].boot_token, after.boot_token);
  EXPECT_EQ(rec[0].objects_pulled, after.objects_pulled);
  EXPECT_EQ(rec[0].bytes_pulled, after.bytes_pulled);
  ASSERT_EQ(kvf_client_stat_peers(src.c, rec, 4, &n), KVF_SUCCESS) << kvf_last_error();
  ASSERT_GE(n, 1u);
  EXPECT_EQ(std::string(rec[n - 1].addr), "incoming");
  EXPECT_GE(rec[n - 1].objects_served, keys.size());
  EXPECT_GT(after.bytes_pulled, before.bytes_pulled);
  ASSERT_EQ(xfer(dst, false, keys, rids, T, &r), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(r.prefix_tokens, T);
  EXPECT_EQ(b.info().objects_pulled, after.objects_pulled) << "the second RETRIEVE pulled again";
  expect_b_idle(b, "after the round trip");
  (void)t;
}

TEST_F(Peers, StoreThroughARetrieveThroughBOverTcp) {
  setenv("UCX_TLS", "tcp", 1);
  ASSERT_EQ(start_a(), "");
  ASSERT_EQ(b.start(dir_b, addr, secret), KVF_SUCCESS) << kvf_last_error();
  ASSERT_TRUE(b.wait_ready()) << "B never authenticated with A";
  kvf_peer_info i = b.info();
  EXPECT_EQ(i.state, (uint32_t)KVF_PEER_READY);
  EXPECT_NE(i.boot_token, 0u);
  EXPECT_EQ(i.failures, 0u);
  round_trip(this, a, b, dir_a, dir_b, 11);
  b.stop();
  EXPECT_EQ(a.stop(), 0) << "A did not exit cleanly after SIGTERM";
  unsetenv("UCX_TLS");
}

TEST_F(Peers, StoreThroughARetrieveThroughBOverSharedMemory) {
  // Shared memory for the gets (cma, posix, sysv); the connection and the
  // messages go over the sockaddr CM and tcp.
  // KVF_PEER_SHM=1: UCX 1.13 uses shared memory only without peer-failure
  // handling on the data endpoint (docs/peers.md); use_shared_memory says why
  // the case runs alone.
  std::string no_shm = use_shared_memory();
  if (!no_shm.empty()) GTEST_SKIP() << no_shm;
  ASSERT_EQ(start_a(), "");
  // A's L1 pool is UCX's memory (a System V or POSIX segment), which UCX
  // maps into B for gets that are a memcpy: memory kvferryd allocated would
  // fall back to active messages.
  EXPECT_GE(largest_shared_segment(a.pid), 256ull << 20) << "A's L1 pool is not a shared-memory segment";
  ASSERT_EQ(b.start(dir_b, addr, secret), KVF_SUCCESS) << kvf_last_error();
  ASSERT_TRUE(b.wait_ready()) << "B never authenticated with A";
  round_trip(this, a, b, dir_a, dir_b, 23);
  b.stop();
  EXPECT_EQ(a.stop(), 0);
  unsetenv("UCX_TLS");
  unsetenv("KVF_PEER_SHM");
}

TEST_F(Peers, SecretFileMustBePrivate) {
  std::string open_secret = write_secret(tmp.path + "/open", "correct horse battery staple 0123456789\n", 0644);
  ServerB s;
  EXPECT_EQ(s.start(dir_b, addr, open_secret), KVF_ERR_PERMISSION);
  EXPECT_NE(std::string(kvf_last_error()).find(open_secret), std::string::npos) << kvf_last_error();
  EXPECT_NE(std::string(kvf_last_error()).find("0600"), std::string::npos) << kvf_last_error();
  std::string short_secret = write_secret(tmp.path + "/short", "tiny");
  EXPECT_EQ(s.start(dir_b, addr, short_secret), KVF_ERR_INVALID_ARGUMENT);
  // kvferryd refuses to start with it, naming the file.
  Daemon d;
  EXPECT_NE(d.start(dir_a, {"--listen", addr, "--peer-secret-file", open_secret}), "");
  EXPECT_NE(d.start(dir_a, {"--listen", addr}), "") << "peering without a secret must be refused";
}

TEST_F(Peers, WrongSecretIsRefusedAndNothingMoves) {
  setenv("UCX_TLS", "tcp", 1);
  ASSERT_EQ(start_a(), "");
  std::string other = write_secret(tmp.path + "/other", "another secret, not A's at all!!\n");
  ASSERT_EQ(b.start(dir_b, addr, other), KVF_SUCCESS) << kvf_last_error();
  EXPECT_FALSE(b.wait_ready(1500)) << "B authenticated with the wrong secret";
  EXPECT_GT(b.info().failures, 0u);
  // A stored, B cannot get it.
  Engine src, dst;
  ASSERT_EQ(src.open(dir_a, geometry_json(kBlocks), 5), "");
  ASSERT_EQ(dst.open(dir_b, geometry_json(kBlocks), 6), "");
  std::vector<kvf_chunk_key> keys = prompt_keys(src.g, 5, 640, 64);
  std::vector<uint32_t> ids = shuffled(kBlocks, 5);
  ids.resize(40);
  kvf_client_result r;
  ASSERT_EQ(xfer(src, true, keys, ids, 640, &r), KVF_SUCCESS) << kvf_last_error();
  ASSERT_EQ(xfer(dst, false, keys, ids, 640, &r), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(r.prefix_tokens, 0u);
  EXPECT_EQ(b.info().objects_pulled, 0u);
  b.stop();
  EXPECT_EQ(a.stop(), 0);
  unsetenv("UCX_TLS");
}

// A raw transport client: connects, sends what the test says, reports
// whether the server disconnected it.
struct RawPeer {
  kvf_pt *t = nullptr;
  kvf_pt_conn *c = nullptr;
  std::atomic<int> errored{0};
  std::vector<std::vector<uint8_t>> got;
  static void on_accept(void *, kvf_pt_conn *) {}
  static void on_message(void *ctx, kvf_pt_conn *, const void *d, size_t n) {
    auto *self = static_cast<RawPeer *>(ctx);
    const uint8_t *b = static_cast<const uint8_t *>(d);
    self->got.emplace_back(b, b + n);
  }
  static void on_error(void *ctx, kvf_pt_conn *, kvf_status, const char *) {
    static_cast<RawPeer *>(ctx)->errored = 1;
  }
  kvf_status connect(const std::string &addr) {
    kvf_pt_callbacks cb = {this, on_accept, on_message, on_error};
    kvf_status st = kvf_pt_create(nullptr, &cb, &t);
    if (st != KVF_SUCCESS) return st;
    return kvf_pt_connect(t, addr.c_str(), &c);
  }
  void pump(int ms) {
    auto t0 = Clock::now();
    while (ms_since(t0) < ms && !errored) {
      kvf_pt_progress(t);
      kvf_pt_wait(t, 5);
    }
  }
  ~RawPeer() {
    kvf_pt_close(c);
    kvf_pt_destroy(t);
  }
};

// The /proc/self/maps line of the mapping holding p ("" when none does).
std::string mapping_of(const void *p) {
  FILE *f = fopen("/proc/self/maps", "r");
  if (!f) return "";
  char line[512];
  std::string found;
  uintptr_t a = (uintptr_t)p;
  while (fgets(line, sizeof(line), f)) {
    unsigned long lo = 0, hi = 0;
    if (sscanf(line, "%lx-%lx", &lo, &hi) == 2 && a >= lo && a < hi) {
      found = line;
      break;
    }
  }
  fclose(f);
  return found;
}

// Memory the transport allocates (kvferryd's L1 pools with KVF_PEER_SHM=1)
// is a shared-memory segment UCX can map into a peer; registering a range
// inside it shares its key instead of mapping it again (a second mapping
// would lose the shared-memory domains), and it outlives the transport.
TEST(PeersTransport, AllocatedMemoryIsSharedRegisteredOnceAndOutlivesTheTransport) {
  setenv("UCX_TLS", "sm,self,tcp", 1);
  kvf_pt_context *ctx = nullptr;
  ASSERT_EQ(kvf_pt_context_create(&ctx), KVF_SUCCESS) << kvf_last_error();
  kvf_pt_mem *m = nullptr;
  EXPECT_EQ(kvf_pt_mem_alloc(ctx, 0, &m), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(m, nullptr);
  const size_t len = 4u << 20;
  ASSERT_EQ(kvf_pt_mem_alloc(ctx, len, &m), KVF_SUCCESS) << kvf_last_error();
  uint8_t *base = static_cast<uint8_t *>(kvf_pt_mem_base(m));
  ASSERT_NE(base, nullptr);
  EXPECT_EQ((uintptr_t)base % 4096, 0u);
  memset(base, 0x5a, len);
  std::string map = mapping_of(base);
  EXPECT_TRUE(map.find("SYSV") != std::string::npos || map.find("/dev/shm") != std::string::npos)
      << "not a shared-memory segment: " << map;
  if (map.find("SYSV") != std::string::npos) {
    // The kvferryd user's alone (UCX makes its segments 0660).
    unsigned long lo, hi, off, shmid = 0;
    char perms[8], dev[16];
    ASSERT_EQ(sscanf(map.c_str(), "%lx-%lx %7s %lx %15s %lu", &lo, &hi, perms, &off, dev, &shmid), 6) << map;
    struct shmid_ds ds;
    ASSERT_EQ(shmctl((int)shmid, IPC_STAT, &ds), 0) << strerror(errno);
    EXPECT_EQ(ds.shm_perm.mode & 0777u, 0600u);
  }
  const void *akey = nullptr;
  size_t akey_len = 0;
  kvf_pt_mem_key(m, &akey, &akey_len);
  ASSERT_GT(akey_len, 0u);

  RawPeer unused; // callbacks only
  kvf_pt_callbacks cb = {&unused, RawPeer::on_accept, RawPeer::on_message, RawPeer::on_error};
  kvf_pt *t = nullptr;
  ASSERT_EQ(kvf_pt_create(ctx, &cb, &t), KVF_SUCCESS) << kvf_last_error();
  kvf_pt_mem *inside = nullptr, *outside = nullptr;
  ASSERT_EQ(kvf_pt_mem_register(t, base + 4096, len - 8192, &inside), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(kvf_pt_mem_base(inside), base + 4096);
  const void *ikey = nullptr;
  size_t ikey_len = 0;
  kvf_pt_mem_key(inside, &ikey, &ikey_len);
  ASSERT_EQ(ikey_len, akey_len);
  EXPECT_EQ(memcmp(ikey, akey, akey_len), 0);
  std::vector<uint8_t> plain(1u << 20, 1);
  ASSERT_EQ(kvf_pt_mem_register(t, plain.data(), plain.size(), &outside), KVF_SUCCESS) << kvf_last_error();
  kvf_pt_mem_deregister(outside);
  kvf_pt_mem_deregister(inside);
  kvf_pt_destroy(t);
  // The memory is the context's: still there after the transport.
  EXPECT_EQ(base[len - 1], 0x5a);
  kvf_pt_mem_free(m);
  kvf_pt_context_destroy(ctx);
  unsetenv("UCX_TLS");
}

std::vector<uint8_t> peer_header(uint16_t type, uint32_t len, uint64_t id = 0) {
  std::vector<uint8_t> m(24, 0);
  uint32_t magic = 0x5046564Bu;
  uint16_t version = 1;
  memcpy(&m[0], &magic, 4);
  memcpy(&m[4], &type, 2);
  memcpy(&m[6], &version, 2);
  memcpy(&m[8], &len, 4);
  memcpy(&m[16], &id, 8);
  return m;
}

TEST_F(Peers, GarbageAndTruncatedMessagesDisconnectAndTheServerStaysUp) {
  setenv("UCX_TLS", "tcp", 1);
  ASSERT_EQ(start_a(), "");
  struct Case {
    const char *what;
    std::vector<uint8_t> bytes;
  };
  std::vector<Case> cases;
  cases.push_back({"garbage", std::vector<uint8_t>(100, 0xA5)});
  cases.push_back({"a short header", {1, 2, 3}});
  std::vector<uint8_t> h = peer_header(1, 24 + 10);
  h.resize(34, 7);
  cases.push_back({"a truncated HELLO", h});
  std::vector<uint8_t> lie = peer_header(1, 1000);
  lie.resize(64, 0);
  cases.push_back({"a length that lies", lie});
  std::vector<uint8_t> has = peer_header(4, 24 + 8 + 56);
  has.resize(24 + 8 + 56, 0);
  has[24] = 1;
  cases.push_back({"a HAS before authentication", has});
  std::vector<uint8_t> keys = peer_header(3, 32);
  keys.resize(32, 0);
  cases.push_back({"KEYS before authentication", keys});
  for (const Case &c : cases) {
    SCOPED_TRACE(c.what);
    RawPeer raw;
    ASSERT_EQ(raw.connect(addr), KVF_SUCCESS) << kvf_last_error();
    raw.pump(300); // A's HELLO arrives
    ASSERT_EQ(kvf_pt_send(raw.c, c.bytes.data(), c.bytes.size()), KVF_SUCCESS);
    raw.pump(5000);
    EXPECT_TRUE(raw.errored) << "A did not disconnect";
    int status = 0;
    EXPECT_EQ(waitpid(a.pid, &status, WNOHANG), 0) << "A died";
  }
  // A still serves peers: B authenticates and fetches.
  ASSERT_EQ(b.start(dir_b, addr, secret), KVF_SUCCESS) << kvf_last_error();
  ASSERT_TRUE(b.wait_ready());
  round_trip(this, a, b, dir_a, dir_b, 31);
  b.stop();
  EXPECT_EQ(a.stop(), 0);
  unsetenv("UCX_TLS");
}

// A SIGKILLed at random points of pulls: B keeps serving, reports exactly
// the prefix it restored (every reported block correct), holds nothing
// afterwards; a restarted A (a new boot token) is noticed and used again.
TEST_F(Peers, PeerKilledMidPullAbortsAndARestartedPeerIsUsedAgain) {
  setenv("UCX_TLS", getenv("KVF_TEST_KILL_TLS") ? getenv("KVF_TEST_KILL_TLS") : "tcp", 1);
  const uint32_t nb = 4096; // 65536 tokens: 1024 chunks of 64 KiB per object... of 2 regions
  std::string json = geometry_json(nb);
  uint64_t rng = 99;
  uint64_t last_boot = 0;
  for (int round = 0; round < 4; round++) {
    SCOPED_TRACE("round " + std::to_string(round));
    ASSERT_EQ(start_a(), "");
    if (round == 0) {
      ASSERT_EQ(b.start(dir_b, addr, secret), KVF_SUCCESS) << kvf_last_error();
    }
    ASSERT_TRUE(b.wait_ready(15000)) << "B did not (re)connect to A";
    kvf_peer_info i = b.info();
    EXPECT_NE(i.boot_token, last_boot) << "a restarted A must bring a new boot token";
    last_boot = i.boot_token;
    Engine src, dst;
    ASSERT_EQ(src.open(dir_a, json, 100 + round), "");
    ASSERT_EQ(dst.open(dir_b, json, 200 + round), "");
    const uint64_t T = 16384 * 2; // 512 chunks, 2048 blocks: 64 MiB of objects
    std::vector<kvf_chunk_key> keys;
    std::vector<uint32_t> ids;
    ASSERT_NO_FATAL_FAILURE(store_prompt(src, 100 + round, nb, round, T, &keys, &ids));
    bool last = round == 3;
    std::thread killer;
    if (!last) killer = kill_a_within_40ms(&rng);
    kvf_client_result r;
    kvf_status st = xfer(dst, false, keys, ids, T, &r);
    if (killer.joinable()) killer.join();
    ASSERT_EQ(st, KVF_SUCCESS) << kvf_last_error();
    EXPECT_EQ(r.status, KVF_SUCCESS) << kvf_status_string(r.status);
    EXPECT_LE(r.prefix_tokens, T);
    if (last) {
      EXPECT_EQ(r.prefix_tokens, T) << "the restarted A was not used";
    }
    // Every block the reply claims is the source's.
    EXPECT_EQ(compare_blocks(src, dst, ids, r.prefix_tokens / 16, nb, kBlockBytes), "") << "prefix " << r.prefix_tokens;
    expect_b_idle(b, "after the pull");
    // B serves on: its L1 answers what it committed.
    kvf_client_result again;
    ASSERT_EQ(xfer(dst, false, keys, ids, T, &again), KVF_SUCCESS) << kvf_last_error();
    EXPECT_GE(again.prefix_tokens, last ? T : 0u);
    if (!last) {
      a.kill_now();
      // B notices: the peer goes down.
      auto t0 = Clock::now();
      while (kvf_peers_ready(b.peers()) > 0 && ms_since(t0) < 10000) sleep_ms(10);
      EXPECT_EQ(kvf_peers_ready(b.peers()), 0u);
    }
    src.close();
    dst.close();
    expect_b_idle(b, "after the round");
  }
  kvf_peer_info fin = b.info();
  EXPECT_GE(fin.connects, 4u);
  b.stop();
  EXPECT_EQ(a.stop(), 0);
  unsetenv("UCX_TLS");
}

// ---- heterogeneous prefill/decode ---------------------------------------------

// 2 layers (one region each), 2 KV heads of 128 bytes, chunk_tokens 64.
// FlashAttention NHD, physical [P][NB][T][H][R], 16-token blocks; or
// FlashInfer HND, physical [NB][P][H][T][R], 32-token blocks.
struct Layout2 {
  bool hnd;
  uint32_t block, heads, nb;
  uint64_t block_stride() const { return (uint64_t)(hnd ? 2 : 1) * block * heads * 128; }
  uint64_t plane_stride() const { return hnd ? (uint64_t)heads * block * 128 : (uint64_t)nb * block_stride(); }
  uint64_t token_stride() const { return hnd ? 128 : (uint64_t)heads * 128; }
  uint64_t head_stride() const { return hnd ? (uint64_t)block * 128 : 128; }
  std::string json() const {
    char buf[2048];
    snprintf(buf, sizeof buf, R"({
  "format": "kvferry-geometry", "version": 1, "name": "%s",
  "regions": [{"name": "kv", "count": 2, "size": 0}],
  "groups": [{"name": "full", "kind": "full", "block_size": %u, "num_blocks": %u,
    "layers": [{"count": 2, "name": "layer", "region": "kv", "region_step": 1, "offset": 0,
      "elem_bytes": 2, "block_stride": %llu, "planes": 2, "heads": %u, "head_bytes": 128,
      "plane_stride": %llu, "token_stride": %llu, "head_stride": %llu}]}],
  "objects": {"chunk_tokens": 64, "format": "canonical"}
})",
             hnd ? "flashinfer-hnd-32" : "fa-nhd-16", block, nb, (unsigned long long)block_stride(), heads,
             (unsigned long long)plane_stride(), (unsigned long long)token_stride(), (unsigned long long)head_stride());
    return buf;
  }
  // Offset in region of (plane, token t of the prompt, head) given the prompt's block ids.
  uint64_t at(const std::vector<uint32_t> &ids, uint32_t plane, uint64_t t, uint32_t h) const {
    return plane * plane_stride() + ids[t / block] * block_stride() + (t % block) * token_stride() + h * head_stride();
  }
};

TEST_F(Peers, HeterogeneousLayoutsRetrieveCanonicalObjectsAndAnotherModelIsRefused) {
  setenv("UCX_TLS", "tcp", 1);
  ASSERT_EQ(start_a(), "");
  ASSERT_EQ(b.start(dir_b, addr, secret), KVF_SUCCESS) << kvf_last_error();
  ASSERT_TRUE(b.wait_ready());
  Layout2 la{false, 16, 2, 128}, lb{true, 32, 2, 64};
  Engine src, dst;
  ASSERT_EQ(src.open(dir_a, la.json(), 41), "");
  ASSERT_EQ(dst.open(dir_b, lb.json(), 42), "");
  ASSERT_EQ(kvf_geometry_fingerprint(src.g, KVF_FORMAT_CANONICAL), kvf_geometry_fingerprint(dst.g, KVF_FORMAT_CANONICAL))
      << "the same model in two layouts must make the same canonical objects";
  const uint64_t T = 1984; // 31 chunks: 124 blocks on A, 62 on B
  std::vector<kvf_chunk_key> keys = prompt_keys(src.g, 41, T, 64);
  std::vector<uint32_t> ida = shuffled(la.nb, 1), idb = shuffled(lb.nb, 2);
  ida.resize(T / 16);
  idb.resize(T / 32);
  kvf_client_result r;
  ASSERT_EQ(xfer(src, true, keys, ida, T, &r), KVF_SUCCESS) << kvf_last_error();
  ASSERT_EQ(r.prefix_tokens, T);
  ASSERT_EQ(xfer(dst, false, keys, idb, T, &r), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(r.status, KVF_SUCCESS) << kvf_status_string(r.status);
  ASSERT_EQ(r.prefix_tokens, T);
  for (size_t reg = 0; reg < 2; reg++)
    for (uint32_t p = 0; p < 2; p++)
      for (uint64_t t = 0; t < T; t++)
        for (uint32_t h = 0; h < 2; h++)
          ASSERT_EQ(memcmp(src.mem() + src.offsets[reg] + la.at(ida, p, t, h),
                           dst.mem() + dst.offsets[reg] + lb.at(idb, p, t, h), 128), 0)
              << "region " << reg << " plane " << p << " token " << t << " head " << h;
  // Another model (4 KV heads) sending A's keys: L1 scopes keys by the
  // canonical fingerprint, so A holds nothing for it, but it holds the key
  // for this model: B refuses the RETRIEVE naming the fingerprint, and
  // nothing moves.
  Layout2 lc{true, 32, 4, 64};
  Engine other;
  ASSERT_EQ(other.open(dir_b, lc.json(), 43), "");
  std::vector<kvf_chunk_key> keys2 = prompt_keys(src.g, 44, 640, 64);
  std::vector<uint32_t> ids2 = shuffled(la.nb, 3);
  ids2.resize(40);
  ASSERT_EQ(xfer(src, true, keys2, ids2, 640, &r), KVF_SUCCESS) << kvf_last_error();
  std::vector<uint32_t> idc = shuffled(lc.nb, 4);
  idc.resize(20);
  uint64_t failures = b.info().failures, pulled = b.info().objects_pulled;
  EXPECT_EQ(xfer(other, false, keys2, idc, 640, &r), KVF_ERR_GEOMETRY_MISMATCH) << kvf_last_error();
  std::string why = kvf_last_error();
  EXPECT_NE(why.find("payload.chunk_keys[0]"), std::string::npos) << why;
  EXPECT_NE(why.find("geometry.fingerprint"), std::string::npos) << why;
  EXPECT_NE(why.find("different model"), std::string::npos) << why;
  EXPECT_EQ(b.info().objects_pulled, pulled);
  EXPECT_EQ(b.info().failures, failures) << "a different model is refused, not counted as the peer's failure";
  EXPECT_EQ(b.data().l1.objects, (uint64_t)keys.size()) << "the other model's RETRIEVE committed something";
  expect_b_idle(b, "after the other model's refusal");
  b.stop();
  EXPECT_EQ(a.stop(), 0);
  unsetenv("UCX_TLS");
}

// ---- windows and recurrent groups ------------------------------------------------

// The hybrid preset (full, sliding_window 512, recurrent; chunk_tokens 256;
// three object groups) with nb blocks per group, as the JSON an engine sends.
std::string hybrid_json(uint32_t nb) { return preset_json("glm-like-hybrid.json", nb); }

// Block tables for every group: a STORE of [0, T) gives the full group's
// blocks, the window retained at T, the recurrent state at T; a RETRIEVE the
// whole table and one recurrent slot (test_dataplane.cpp's rules).
struct GroupTables {
  std::vector<std::vector<uint32_t>> ids;
  std::vector<kvf_group_blocks> gb;
  GroupTables(const kvf_geometry *g, uint64_t T, bool store, uint64_t seed) {
    uint32_t C = 0;
    {
      kvf_object_policy pol = KVF_OBJECT_POLICY_INIT;
      kvf_geometry_policy(g, &pol);
      C = pol.chunk_tokens;
    }
    uint32_t ng = kvf_geometry_num_groups(g);
    ids.resize(ng);
    gb.resize(ng);
    std::vector<uint64_t> first(ng, 0);
    uint64_t next = 0;
    /* Groups alias one tensor per layer index: they take disjoint ids from one pool, as an engine does. */
    kvf_group_info g0 = KVF_GROUP_INFO_INIT;
    kvf_geometry_group(g, 0, &g0);
    std::vector<uint32_t> pool = shuffled(g0.num_blocks, seed);
    for (uint32_t i = 0; i < ng; i++) {
      kvf_group_info gi = KVF_GROUP_INFO_INIT;
      kvf_geometry_group(g, i, &gi);
      uint64_t lb = 0, n = 0;
      if (gi.kind == KVF_GROUP_RECURRENT) {
        lb = store ? T / C - 1 : 0;
        n = 1;
      } else {
        uint64_t le = 0;
        kvf_geometry_local_blocks(g, i, 0, T, &lb, &le);
        if (store && gi.kind != KVF_GROUP_FULL) {
          uint64_t fb = 0, eb = 0;
          kvf_geometry_retained_blocks(g, i, T, &fb, &eb);
          lb = std::max(lb, fb);
          le = std::min(le, eb);
        }
        n = le > lb ? le - lb : 0;
      }
      first[i] = lb;
      for (uint64_t k = 0; k < n; k++) ids[i].push_back(pool.at(next++));
    }
    for (uint32_t i = 0; i < ng; i++) gb[i] = {ids[i].data(), first[i], (uint32_t)ids[i].size()};
  }
};

kvf_status xfer_groups(Engine &e, bool store, const std::vector<kvf_chunk_key> &keys, GroupTables &t, uint64_t T,
                       kvf_client_result *r) {
  kvf_client_xfer x = KVF_CLIENT_XFER_INIT;
  x.token_begin = 0;
  x.token_end = T;
  x.format = KVF_FORMAT_CANONICAL;
  x.chunk_keys = keys.data();
  x.num_chunk_keys = (uint32_t)keys.size();
  x.groups = t.gb.data();
  x.num_groups = (uint32_t)t.gb.size();
  *r = KVF_CLIENT_RESULT_INIT;
  return store ? kvf_client_store(e.c, &x, r) : kvf_client_retrieve(e.c, &x, r);
}

// The oracle: the same RETRIEVE through A itself (one server, the contract
// test_dataplane checks against the CPU reference), into a cache filled as
// B's: B's cache must end up identical, byte for byte (padding, blocks out
// of the window and other slots keep their poison in both).
TEST_F(Peers, WindowsAndRecurrentGroupsRetrieveThroughBAsThroughA) {
  setenv("UCX_TLS", "tcp", 1);
  ASSERT_EQ(start_a(), "");
  ASSERT_EQ(b.start(dir_b, addr, secret), KVF_SUCCESS) << kvf_last_error();
  ASSERT_TRUE(b.wait_ready());
  const std::string json = hybrid_json(160);
  const uint64_t T = 1024;
  Engine src, via_a, via_b;
  ASSERT_EQ(src.open(dir_a, json, 51), "");
  ASSERT_EQ(via_a.open(dir_a, json, 52), "");
  ASSERT_EQ(via_b.open(dir_b, json, 52), "");
  ASSERT_EQ(kvf_geometry_num_object_groups(src.g), 3u);
  std::vector<kvf_chunk_key> keys = prompt_keys(src.g, 51, T, 256);
  GroupTables st(src.g, T, true, 5), rt(src.g, T, false, 9), rt2(src.g, T, false, 9);
  kvf_client_result r, ra, rb;
  ASSERT_EQ(xfer_groups(src, true, keys, st, T, &r), KVF_SUCCESS) << kvf_last_error();
  ASSERT_EQ(r.prefix_tokens, T);
  EXPECT_EQ(r.objects_done, 7u); // full: 4, the window: 2, the state: 1
  ASSERT_EQ(xfer_groups(via_a, false, keys, rt, T, &ra), KVF_SUCCESS) << kvf_last_error();
  ASSERT_EQ(ra.prefix_tokens, T);
  ASSERT_EQ(xfer_groups(via_b, false, keys, rt2, T, &rb), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(rb.status, KVF_SUCCESS);
  EXPECT_EQ(rb.prefix_tokens, ra.prefix_tokens);
  EXPECT_EQ(rb.objects_done, ra.objects_done);
  EXPECT_EQ(rb.bytes_done, ra.bytes_done);
  ASSERT_EQ(rb.num_object_groups, ra.num_object_groups);
  for (uint32_t og = 0; og < ra.num_object_groups; og++)
    EXPECT_EQ(rb.object_group_prefix[og], ra.object_group_prefix[og]) << "object group " << og;
  for (uint32_t g = 0; g < ra.num_groups; g++) EXPECT_EQ(rb.group_blocks[g], ra.group_blocks[g]) << "group " << g;
  ASSERT_EQ(via_a.total, via_b.total);
  EXPECT_EQ(memcmp(via_a.mem(), via_b.mem(), via_a.total), 0) << "B's cache differs from the one A restored";
  EXPECT_EQ(b.info().objects_pulled, 7u);
  expect_b_idle(b, "after the hybrid retrieve");
  b.stop();
  EXPECT_EQ(a.stop(), 0);
  unsetenv("UCX_TLS");
}

// ---- a lying peer --------------------------------------------------------------

// A fake peer A that knows the secret and speaks the protocol, answering
// B's HAS with what `lie` says. Runs its transport on its own thread.
struct LyingPeer {
  enum Lie { kOffsetPastPool, kBadPool, kPayloadBytes, kWrongCount, kMagic, kNoAnswer };
  kvf_pt *t = nullptr;
  kvf_pt_conn *c = nullptr;
  kvf_pt_mem *mem = nullptr;
  std::vector<uint8_t> pool = std::vector<uint8_t>(1 << 20, 0x5A);
  // Instead of `pool`: memory its transport allocated (a System V segment
  // under UCX_TLS=sm,...), claimed in KEYS as shm_claim bytes.
  kvf_pt_context *ctx = nullptr;
  kvf_pt_mem *shm = nullptr;
  std::atomic<uint64_t> shm_claim{0};
  std::string secret;
  uint8_t nonce[32] = {1, 2, 3}, their_nonce[32] = {};
  uint64_t their_boot = 0;
  std::atomic<int> lie{kOffsetPastPool}, has_seen{0}, stop{0}, errored{0};
  // An OFFER to send from the transport's thread (it owns the connection),
  // and what B answered to it.
  std::mutex offer_mu;
  std::vector<uint8_t> offer_out;
  uint64_t offer_id = 0;
  std::atomic<int> offer_pending{0}, offer_answered{0};
  std::vector<uint8_t> offer_result;
  std::thread th;
  uint16_t port = 0;

  static void put(std::vector<uint8_t> &m, const void *p, size_t n) {
    const uint8_t *b = static_cast<const uint8_t *>(p);
    m.insert(m.end(), b, b + n);
  }
  void send_msg(uint16_t type, uint64_t id, const std::vector<uint8_t> &payload) {
    std::vector<uint8_t> m = peer_header_(type, (uint32_t)(24 + payload.size()), id);
    m.insert(m.end(), payload.begin(), payload.end());
    kvf_pt_send(c, m.data(), m.size());
  }
  static std::vector<uint8_t> peer_header_(uint16_t type, uint32_t len, uint64_t id) {
    std::vector<uint8_t> m(24, 0);
    uint32_t magic = 0x5046564Bu;
    uint16_t version = 1;
    memcpy(&m[0], &magic, 4);
    memcpy(&m[4], &type, 2);
    memcpy(&m[6], &version, 2);
    memcpy(&m[8], &len, 4);
    memcpy(&m[16], &id, 8);
    return m;
  }
  void on_msg(const uint8_t *m, size_t n) {
    if (n < 24) return;
    uint16_t type;
    memcpy(&type, m + 4, 2);
    uint64_t id;
    memcpy(&id, m + 16, 8);
    const uint8_t *b = m + 24;
    if (type == 1) { // HELLO: answer with AUTH over its nonce, ours, our boot token
      memcpy(their_nonce, b, 32);
      memcpy(&their_boot, b + 32, 8);
      std::vector<uint8_t> data;
      put(data, "kvferry-peer-auth-v1", 20);
      put(data, their_nonce, 32);
      put(data, nonce, 32);
      uint64_t boot = 0x1234;
      put(data, &boot, 8);
      uint8_t mac[32];
      unsigned int len = 0;
      HMAC(EVP_sha256(), secret.data(), (int)secret.size(), data.data(), data.size(), mac, &len);
      send_msg(2, 0, std::vector<uint8_t>(mac, mac + 32));
    } else if (type == 2) { // AUTH (not checked): our KEYS
      const void *key;
      size_t kl;
      kvf_pt_mem_key(mem, &key, &kl);
      std::vector<uint8_t> p(8, 0);
      uint32_t one = 1;
      memcpy(&p[0], &one, 4);
      int32_t dev = -1;
      uint32_t kl32 = (uint32_t)kl;
      uint64_t base = (uint64_t)(uintptr_t)(shm ? kvf_pt_mem_base(shm) : pool.data());
      uint64_t size = shm ? shm_claim.load() : pool.size();
      put(p, &dev, 4);
      put(p, &kl32, 4);
      put(p, &base, 8);
      put(p, &size, 8);
      put(p, key, kl);
      p.resize((p.size() + 7) & ~(size_t)7, 0);
      send_msg(3, 0, p);
    } else if (type == 9) { // OFFER_DONE
      std::lock_guard<std::mutex> g(offer_mu);
      uint32_t cnt;
      memcpy(&cnt, b, 4);
      offer_result.assign(b + 8, b + 8 + cnt);
      offer_answered++;
    } else if (type == 4 && lie == kNoAnswer) { // HAS: silence
      has_seen++;
    } else if (type == 4) { // HAS: lie
      uint32_t cnt;
      memcpy(&cnt, b, 4);
      std::vector<uint8_t> p(8, 0);
      uint32_t out = lie == kWrongCount ? cnt + 1 : cnt;
      memcpy(&p[0], &out, 4);
      for (uint32_t i = 0; i < out; i++) {
        kvf_object_header h;
        memcpy(&h, b + 8 + (size_t)(i < cnt ? i : 0) * 96 + 48, 48); // {L1 key (48), header (48)}
        uint32_t found = 1, poolix = lie == kBadPool ? 5 : 0;
        uint64_t off = lie == kOffsetPastPool ? pool.size() - 64 : 0;
        if (lie == kPayloadBytes) h.payload_bytes += 256;
        if (lie == kMagic) h.magic ^= 1;
        put(p, &found, 4);
        put(p, &poolix, 4);
        put(p, &off, 8);
        put(p, &h, 48);
      }
      has_seen++;
      send_msg(5, id, p);
    }
  }
  static void cb_accept(void *ctx, kvf_pt_conn *conn) {
    auto *self = static_cast<LyingPeer *>(ctx);
    self->c = conn;
    std::vector<uint8_t> hello(self->nonce, self->nonce + 32);
    uint64_t boot = 0x1234;
    put(hello, &boot, 8);
    self->send_msg(1, 0, hello);
  }
  static void cb_message(void *ctx, kvf_pt_conn *, const void *d, size_t n) {
    static_cast<LyingPeer *>(ctx)->on_msg(static_cast<const uint8_t *>(d), n);
  }
  static void cb_error(void *ctx, kvf_pt_conn *, kvf_status, const char *) { static_cast<LyingPeer *>(ctx)->errored = 1; }
  kvf_status start(const std::string &addr, const std::string &sec, bool shared = false) {
    secret = sec;
    kvf_pt_callbacks cb = {this, cb_accept, cb_message, cb_error};
    kvf_status st = KVF_SUCCESS;
    if (shared) {
      st = kvf_pt_context_create(&ctx);
      if (st == KVF_SUCCESS) st = kvf_pt_mem_alloc(ctx, pool.size(), &shm);
      if (st != KVF_SUCCESS) return st;
      shm_claim = pool.size();
    }
    st = kvf_pt_create(ctx, &cb, &t);
    if (st == KVF_SUCCESS && shm) st = kvf_pt_mem_register(t, kvf_pt_mem_base(shm), pool.size(), &mem);
    else if (st == KVF_SUCCESS) st = kvf_pt_mem_register(t, pool.data(), pool.size(), &mem);
    if (st == KVF_SUCCESS) st = kvf_pt_listen(t, addr.c_str(), &port);
    if (st != KVF_SUCCESS) return st;
    th = std::thread([this] {
      while (!stop) {
        kvf_pt_progress(t);
        if (offer_pending && c) {
          std::lock_guard<std::mutex> g(offer_mu);
          kvf_pt_send(c, offer_out.data(), offer_out.size());
          offer_pending = 0;
        }
        if (errored && c) { // B disconnected us: wait for its reconnect
          kvf_pt_close(c);
          c = nullptr;
          errored = 0;
        }
        kvf_pt_wait(t, 5);
      }
      kvf_pt_close(c);
      kvf_pt_mem_deregister(mem);
      kvf_pt_destroy(t);
    });
    return KVF_SUCCESS;
  }
  // Queue an OFFER of entries {L1 key, header, pool, offset}; raw_len
  // nonzero overrides the length the header states (a truncated message).
  struct OfferEntry {
    kvf_chunk_key chunk;
    uint64_t fingerprint;
    uint32_t shard_index, shard_count;
    kvf_object_header h;
    uint32_t pool;
    uint64_t off;
  };
  void offer(uint64_t id, const std::vector<OfferEntry> &es, int cut = 0) {
    std::vector<uint8_t> p(8, 0);
    uint32_t n = (uint32_t)es.size();
    memcpy(&p[0], &n, 4);
    for (const auto &e : es) {
      put(p, &e.chunk, 32);
      put(p, &e.fingerprint, 8);
      put(p, &e.shard_index, 4);
      put(p, &e.shard_count, 4);
      put(p, &e.h, 48);
      uint32_t zero = 0;
      put(p, &e.pool, 4);
      put(p, &zero, 4);
      put(p, &e.off, 8);
    }
    std::vector<uint8_t> m = peer_header_(8, (uint32_t)(24 + p.size() - cut), id);
    m.insert(m.end(), p.begin(), p.end() - cut);
    std::lock_guard<std::mutex> g(offer_mu);
    offer_out = m;
    offer_id = id;
    offer_pending = 1;
  }
  ~LyingPeer() {
    stop = 1;
    if (th.joinable()) th.join();
    kvf_pt_mem_free(shm);
    kvf_pt_context_destroy(ctx);
  }
};

TEST_F(Peers, APeerLyingAboutItsObjectsIsRefusedAndNothingIsCommitted) {
  setenv("UCX_TLS", "tcp", 1);
  LyingPeer liar;
  ASSERT_EQ(liar.start(addr, "correct horse battery staple 0123456789"), KVF_SUCCESS) << kvf_last_error();
  ASSERT_EQ(b.start(dir_b, addr, secret), KVF_SUCCESS) << kvf_last_error();
  ASSERT_TRUE(b.wait_ready()) << "B did not accept the fake peer's proof of the secret";
  Engine dst;
  ASSERT_EQ(dst.open(dir_b, geometry_json(kBlocks), 7), "");
  std::vector<kvf_chunk_key> keys = prompt_keys(dst.g, 7, 640, 64);
  std::vector<uint32_t> ids = shuffled(kBlocks, 7);
  ids.resize(40);
  const struct {
    int lie;
    const char *what;
    bool disconnects;
  } cases[] = {{LyingPeer::kOffsetPastPool, "an offset past its pool", false},
               {LyingPeer::kBadPool, "a pool it has no key for", false},
               {LyingPeer::kPayloadBytes, "another payload size", false},
               {LyingPeer::kMagic, "a header that is no object header", false},
               {LyingPeer::kWrongCount, "more answers than questions", true},
               {LyingPeer::kNoAnswer, "no answer within the fetch timeout", true}};
  for (const auto &cs : cases) {
    SCOPED_TRACE(cs.what);
    ASSERT_TRUE(b.wait_ready()) << "B did not reconnect to the fake peer";
    liar.lie = cs.lie;
    int seen = liar.has_seen;
    uint64_t failures = b.info().failures, connects_before = b.info().connects;
    kvf_client_result r;
    ASSERT_EQ(xfer(dst, false, keys, ids, 640, &r), KVF_SUCCESS) << kvf_last_error();
    EXPECT_EQ(r.prefix_tokens, 0u);
    EXPECT_GT(liar.has_seen, seen) << "B did not ask the peer";
    EXPECT_GT(b.info().failures, failures) << "the lie was not counted";
    EXPECT_EQ(b.info().objects_pulled, 0u);
    kvf_dataplane_stats d = b.data();
    EXPECT_EQ(d.l1.objects, 0u) << "something was committed";
    expect_b_idle(b, cs.what);
    if (cs.disconnects) {
      auto t0 = Clock::now();
      while (!(b.info().connects > connects_before && b.info().state == (uint32_t)KVF_PEER_READY) &&
             ms_since(t0) < 8000)
        sleep_ms(10);
      EXPECT_GT(b.info().connects, connects_before) << "B did not drop the peer and reconnect";
    }
  }
  b.stop();
  unsetenv("UCX_TLS");
}

// Over shared memory B reads a peer's pool through its own mapping of the
// peer's segment, which UCX does not bound: a peer claiming a pool larger
// than its segment would make B read its own memory, or fault. Such keys
// are refused; the same peer telling the truth is used. A POSIX segment
// (a file its owner can truncate under the reader) is not read through the
// mapping at all: its gets go over the network transports.
TEST_F(Peers, SharedMemoryKeysAreBoundedByTheirSegmentOrReadOverTheNetwork) {
  std::string no_shm = use_shared_memory();
  if (!no_shm.empty()) GTEST_SKIP() << no_shm;
  {
    LyingPeer liar;
    ASSERT_EQ(liar.start(addr, "correct horse battery staple 0123456789", true), KVF_SUCCESS) << kvf_last_error();
    liar.shm_claim = liar.pool.size() + (1ull << 30);
    ASSERT_EQ(b.start(dir_b, addr, secret), KVF_SUCCESS) << kvf_last_error();
    EXPECT_FALSE(b.wait_ready(2500)) << "B took a pool larger than the segment its key maps";
    EXPECT_GT(b.info().failures, 0u);
    liar.shm_claim = liar.pool.size();
    EXPECT_TRUE(b.wait_ready()) << "B refused a pool that its segment holds";
  }
  // A POSIX segment (a file the peer could truncate under B) is not read
  // through B's mapping: B takes the key, its gets go over the network.
  uint64_t connects = b.info().connects;
  setenv("UCX_ALLOC_PRIO", "md:posix", 1);
  {
    LyingPeer liar;
    kvf_status st = liar.start(addr, "correct horse battery staple 0123456789", true);
    unsetenv("UCX_ALLOC_PRIO");
    ASSERT_EQ(st, KVF_SUCCESS) << kvf_last_error();
    ASSERT_NE(mapping_of(kvf_pt_mem_base(liar.shm)).find("/dev/shm"), std::string::npos)
        << mapping_of(kvf_pt_mem_base(liar.shm));
    liar.shm_claim = liar.pool.size() + (1ull << 30);
    auto t0 = Clock::now();
    while (ms_since(t0) < 10000 && !(b.info().connects > connects && b.info().state == (uint32_t)KVF_PEER_READY))
      sleep_ms(10);
    EXPECT_GT(b.info().connects, connects) << "B refused a key it reads over the network";
  }
  b.stop();
  unsetenv("UCX_TLS");
  unsetenv("KVF_PEER_SHM");
}

// ---- push (prefill -> decode) and LOOKUP through peers ---------------------------

kvf_status push(Engine &e, const std::vector<kvf_chunk_key> &keys, uint64_t T, const std::string &peer,
                kvf_client_push_result *out) {
  kvf_client_push_desc d = KVF_CLIENT_PUSH_DESC_INIT;
  d.token_begin = 0;
  d.token_end = T;
  d.chunk_keys = keys.data();
  d.num_chunk_keys = (uint32_t)keys.size();
  d.peer = peer.c_str();
  *out = KVF_CLIENT_PUSH_RESULT_INIT;
  return kvf_client_push(e.c, &d, out);
}

// The name A knows B by: B connected to A, so its boot token (kvferry stat).
std::string incoming_peer_name(Engine &on_a) {
  kvf_client_peer_record rec[4];
  uint32_t n = 0;
  EXPECT_EQ(kvf_client_stat_peers(on_a.c, rec, 4, &n), KVF_SUCCESS) << kvf_last_error();
  for (uint32_t i = 0; i < n && i < 4; i++)
    if (!rec[i].outgoing && rec[i].state == 2) {
      char hex[17];
      snprintf(hex, sizeof hex, "%016" PRIx64, rec[i].boot_token);
      return hex;
    }
  return "";
}

TEST_F(Peers, PushCopiesChunksToTheNamedPeerWhichThenServesThemAlone) {
  setenv("UCX_TLS", "tcp", 1);
  ASSERT_EQ(start_a(), "");
  ASSERT_EQ(b.start(dir_b, addr, secret), KVF_SUCCESS) << kvf_last_error();
  ASSERT_TRUE(b.wait_ready());
  Engine src, dst;
  ASSERT_EQ(src.open(dir_a, geometry_json(kBlocks), 51), "");
  ASSERT_EQ(dst.open(dir_b, geometry_json(kBlocks), 52), "");
  const uint64_t T = 1984; // 31 chunks
  std::vector<kvf_chunk_key> keys = prompt_keys(src.g, 51, T, 64);
  std::vector<uint32_t> ids = shuffled(kBlocks, 5);
  ids.resize(T / 16);
  kvf_client_result r;
  ASSERT_EQ(xfer(src, true, keys, ids, T, &r), KVF_SUCCESS) << kvf_last_error();
  std::string name;
  auto t0 = Clock::now();
  while ((name = incoming_peer_name(src)).empty() && ms_since(t0) < 10000) sleep_ms(10);
  ASSERT_FALSE(name.empty()) << "A does not see B as a ready peer";

  // A name no peer has: refused naming the field, listing the peers.
  kvf_client_push_result pr;
  EXPECT_EQ(push(src, keys, T, "10.1.2.3:9", &pr), KVF_ERR_NOT_FOUND);
  std::string why = kvf_last_error();
  EXPECT_NE(why.find("payload.peer"), std::string::npos) << why;
  EXPECT_NE(why.find(name), std::string::npos) << "the refusal does not list the peers: " << why;

  uint64_t pulled = b.info().objects_pulled;
  ASSERT_EQ(push(src, keys, T, name, &pr), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(pr.objects_pushed, keys.size());
  EXPECT_EQ(pr.objects_present, 0u);
  EXPECT_EQ(pr.objects_missing, 0u);
  EXPECT_EQ(pr.objects_failed, 0u);
  EXPECT_EQ(pr.chunks_on_peer, keys.size());
  EXPECT_EQ(pr.bytes_pushed, (uint64_t)T * 2 * 2 * kHeads * 128) << "2 layers x K,V x heads x 128 bytes per token";
  EXPECT_EQ(b.info().objects_pulled - pulled, keys.size()) << "B did not pull what A offered";
  EXPECT_EQ(b.data().l1.objects, (uint64_t)keys.size());
  kvf_client_peer_record rec[4];
  uint32_t n = 0;
  ASSERT_EQ(kvf_client_stat_peers(src.c, rec, 4, &n), KVF_SUCCESS);
  ASSERT_GE(n, 1u);
  EXPECT_EQ(rec[n - 1].objects_pushed, keys.size());
  EXPECT_EQ(rec[n - 1].bytes_pushed, pr.bytes_pushed);

  // Again: B holds them already; keys A never stored are not held here.
  ASSERT_EQ(push(src, keys, T, name, &pr), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(pr.objects_present, keys.size());
  EXPECT_EQ(pr.objects_pushed, 0u);
  EXPECT_EQ(pr.chunks_on_peer, keys.size());
  std::vector<kvf_chunk_key> unknown = prompt_keys(src.g, 999, 640, 64);
  ASSERT_EQ(push(src, unknown, 640, name, &pr), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(pr.objects_missing, unknown.size());
  EXPECT_EQ(pr.chunks_on_peer, 0u);

  // A gone: B serves the pushed prefix from its own L1, byte for byte.
  a.kill_now();
  ASSERT_EQ(xfer(dst, false, keys, ids, T, &r), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(r.prefix_tokens, T);
  EXPECT_EQ(compare_blocks(src, dst, ids, T / 16, kBlocks, kBlockBytes), "");
  kvf_peers_counters pc;
  kvf_peers_counters_get(b.peers(), &pc);
  EXPECT_EQ(pc.offers_in_flight, 0u);
  expect_b_idle(b, "after the push");
  b.stop();
  unsetenv("UCX_TLS");
}

TEST_F(Peers, PushToAServerWithoutPeersIsRefusedNamingTheField) {
  Daemon lone;
  std::string dir = tmp.path + "/lone";
  ASSERT_EQ(lone.start(dir, {}), "");
  Engine e;
  ASSERT_EQ(e.open(dir, geometry_json(kBlocks), 3), "");
  std::vector<kvf_chunk_key> keys = prompt_keys(e.g, 3, 128, 64);
  kvf_client_push_result pr;
  EXPECT_EQ(push(e, keys, 128, "127.0.0.1:1", &pr), KVF_ERR_UNSUPPORTED);
  EXPECT_NE(std::string(kvf_last_error()).find("payload.peer"), std::string::npos) << kvf_last_error();
  // The client checks what it can before sending.
  EXPECT_EQ(push(e, keys, 128, "", &pr), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvf_last_error()).find("push.peer"), std::string::npos) << kvf_last_error();
  EXPECT_EQ(push(e, keys, 128, "bad name", &pr), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvf_last_error()).find("push.peer"), std::string::npos) << kvf_last_error();
  e.close();
  EXPECT_EQ(lone.stop(), 0);
}

TEST_F(Peers, LookupOnBFetchesFromASoTheRetrieveNeedsNoPeer) {
  setenv("UCX_TLS", "tcp", 1);
  ASSERT_EQ(start_a(), "");
  ASSERT_EQ(b.start(dir_b, addr, secret), KVF_SUCCESS) << kvf_last_error();
  ASSERT_TRUE(b.wait_ready());
  Engine src, dst;
  ASSERT_EQ(src.open(dir_a, geometry_json(kBlocks), 61), "");
  ASSERT_EQ(dst.open(dir_b, geometry_json(kBlocks), 62), "");
  const uint64_t T = 1024;
  std::vector<kvf_chunk_key> keys = prompt_keys(src.g, 61, T, 64);
  std::vector<uint32_t> ids = shuffled(kBlocks, 6);
  ids.resize(T / 16);
  kvf_client_result r;
  ASSERT_EQ(xfer(src, true, keys, ids, T, &r), KVF_SUCCESS) << kvf_last_error();
  kvf_client_lookup_desc q = KVF_CLIENT_LOOKUP_DESC_INIT;
  q.token_begin = 0;
  q.token_end = T;
  q.chunk_keys = keys.data();
  q.num_chunk_keys = (uint32_t)keys.size();
  q.pin_ms = 5000;
  kvf_client_lookup_result lr = KVF_CLIENT_LOOKUP_RESULT_INIT;
  ASSERT_EQ(kvf_client_lookup(dst.c, &q, &lr), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(lr.prefix_tokens, T) << "LOOKUP on B did not count what A holds";
  EXPECT_EQ(lr.pinned_chunks, keys.size());
  EXPECT_EQ(b.info().objects_pulled, keys.size());
  a.kill_now();
  ASSERT_EQ(xfer(dst, false, keys, ids, T, &r), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(r.prefix_tokens, T);
  EXPECT_EQ(compare_blocks(src, dst, ids, T / 16, kBlocks, kBlockBytes), "");
  ASSERT_EQ(kvf_client_unpin(dst.c, lr.pin_id), KVF_SUCCESS) << kvf_last_error();
  expect_b_idle(b, "after the LOOKUP's fetch");
  b.stop();
  unsetenv("UCX_TLS");
}

TEST_F(Peers, OffersWithBadHeadersAreRefusedAndAGoodOneIsCommittedWhole) {
  setenv("UCX_TLS", "tcp", 1);
  LyingPeer liar;
  ASSERT_EQ(liar.start(addr, "correct horse battery staple 0123456789"), KVF_SUCCESS) << kvf_last_error();
  ASSERT_EQ(b.start(dir_b, addr, secret), KVF_SUCCESS) << kvf_last_error();
  ASSERT_TRUE(b.wait_ready());
  Engine dst;
  ASSERT_EQ(dst.open(dir_b, geometry_json(kBlocks), 8), "");
  std::vector<kvf_chunk_key> keys = prompt_keys(dst.g, 8, 64, 64);
  LyingPeer::OfferEntry good;
  memset(&good, 0, sizeof good);
  good.chunk = keys[0];
  good.fingerprint = kvf_geometry_fingerprint(dst.g, KVF_FORMAT_CANONICAL);
  good.shard_index = 0;
  good.shard_count = 1;
  ASSERT_EQ(kvf_object_header_init(dst.g, KVF_FORMAT_CANONICAL, 0, 0, 64, &good.h), KVF_SUCCESS);
  ASSERT_LE(good.h.payload_bytes, liar.pool.size());
  auto send = [&](uint64_t id, const LyingPeer::OfferEntry &e) -> int {
    int answered = liar.offer_answered;
    liar.offer(id, {e});
    auto t0 = Clock::now();
    while (liar.offer_answered == answered && ms_since(t0) < 5000) sleep_ms(5);
    if (liar.offer_answered == answered) return -1;
    std::lock_guard<std::mutex> g(liar.offer_mu);
    return liar.offer_result.size() == 1 ? liar.offer_result[0] : -2;
  };
  struct Bad {
    const char *what;
    void (*spoil)(LyingPeer::OfferEntry &, size_t pool_size);
  };
  const Bad bad[] = {
      {"a header fingerprint that is not its key's", [](LyingPeer::OfferEntry &e, size_t) { e.h.fingerprint ^= 1; }},
      {"an offset past its pool", [](LyingPeer::OfferEntry &e, size_t n) { e.off = n - 64; }},
      {"a pool it sent no key for", [](LyingPeer::OfferEntry &e, size_t) { e.pool = 5; }},
      {"no payload", [](LyingPeer::OfferEntry &e, size_t) { e.h.payload_bytes = 0; }},
      {"a header that is no object header", [](LyingPeer::OfferEntry &e, size_t) { e.h.magic ^= 1; }},
      {"an empty token range", [](LyingPeer::OfferEntry &e, size_t) { e.h.token_end = e.h.token_begin; }},
  };
  uint64_t id = 100;
  for (const Bad &c : bad) {
    SCOPED_TRACE(c.what);
    LyingPeer::OfferEntry e = good;
    c.spoil(e, liar.pool.size());
    uint64_t failures = b.info().failures;
    EXPECT_EQ(send(++id, e), 0) << "refused (0) expected";
    EXPECT_GT(b.info().failures, failures) << "not counted as the peer's failure";
    EXPECT_EQ(b.data().l1.objects, 0u) << "something was committed";
    EXPECT_EQ(b.info().state, (uint32_t)KVF_PEER_READY) << "a refused object is no reason to disconnect";
  }
  // A whole, well-formed object: committed, then served as any other.
  EXPECT_EQ(send(++id, good), 1);
  EXPECT_EQ(b.data().l1.objects, 1u);
  EXPECT_EQ(send(++id, good), 2) << "offered again: held already";
  std::vector<uint32_t> ids = shuffled(kBlocks, 9);
  ids.resize(4);
  kvf_client_result r;
  ASSERT_EQ(xfer(dst, false, keys, ids, 64, &r), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(r.prefix_tokens, 64u);
  for (size_t reg = 0; reg < dst.offsets.size(); reg++)
    for (uint32_t plane = 0; plane < 2; plane++)
      for (uint32_t k = 0; k < 4; k++) {
        const uint8_t *blk = dst.mem() + dst.offsets[reg] + (uint64_t)plane * kBlocks * kBlockBytes +
                             (uint64_t)ids[k] * kBlockBytes;
        for (uint32_t i = 0; i < kBlockBytes; i++)
          ASSERT_EQ(blk[i], 0x5A) << "region " << reg << " plane " << plane << " block " << k << " byte " << i;
      }
  // A truncated OFFER is a bad message: an ERROR and a disconnect.
  uint64_t connects = b.info().connects;
  liar.offer(++id, {good}, 8);
  auto t0 = Clock::now();
  while (!(b.info().connects > connects && b.info().state == (uint32_t)KVF_PEER_READY) && ms_since(t0) < 8000)
    sleep_ms(10);
  EXPECT_GT(b.info().connects, connects) << "B did not drop the peer that sent a truncated OFFER";
  expect_b_idle(b, "after the offers");
  b.stop();
  unsetenv("UCX_TLS");
}

TEST_F(Peers, PusherKilledMidPullCommitsNothingPartialAndARestartedPusherIsUsedAgain) {
  setenv("UCX_TLS", "tcp", 1);
  const uint32_t nb = 4096;
  std::string json = geometry_json(nb);
  uint64_t rng = 77;
  int mid_pull = 0;
  ASSERT_EQ(b.start(dir_b, addr, secret), KVF_SUCCESS) << kvf_last_error();
  for (int round = 0; round < 4; round++) {
    SCOPED_TRACE("round " + std::to_string(round));
    ASSERT_EQ(start_a(), "");
    ASSERT_TRUE(b.wait_ready(15000)) << "B did not (re)connect to A";
    Engine src, dst;
    ASSERT_EQ(src.open(dir_a, json, 300 + round), "");
    ASSERT_EQ(dst.open(dir_b, json, 400 + round), "");
    const uint64_t T = 16384 * 2; // 512 chunks: 32 MiB of objects in one OFFER
    std::vector<kvf_chunk_key> keys;
    std::vector<uint32_t> ids;
    ASSERT_NO_FATAL_FAILURE(store_prompt(src, 300 + round, nb, round, T, &keys, &ids));
    kvf_client_result r;
    std::string name;
    auto t0 = Clock::now();
    while ((name = incoming_peer_name(src)).empty() && ms_since(t0) < 10000) sleep_ms(10);
    ASSERT_FALSE(name.empty());
    bool last = round == 3;
    std::thread killer;
    if (!last) killer = kill_a_within_40ms(&rng);
    kvf_client_push_result pr;
    uint64_t aborted = b.data().l1.aborted_total;
    kvf_status st = push(src, keys, T, name, &pr);
    if (killer.joinable()) killer.join();
    if (last) {
      ASSERT_EQ(st, KVF_SUCCESS) << kvf_last_error();
      EXPECT_EQ(pr.chunks_on_peer, keys.size()) << "the restarted A's push did not land";
    }
    a.kill_now();
    // Whatever B holds is whole: a RETRIEVE restores a prefix of the
    // source's bytes, all of it or none (one OFFER is one reservation).
    ASSERT_EQ(xfer(dst, false, keys, ids, T, &r), KVF_SUCCESS) << kvf_last_error();
    EXPECT_TRUE(r.prefix_tokens == 0 || r.prefix_tokens == T) << "prefix " << r.prefix_tokens;
    if (last) {
      EXPECT_EQ(r.prefix_tokens, T);
    }
    EXPECT_EQ(compare_blocks(src, dst, ids, r.prefix_tokens / 16, nb, kBlockBytes), "");
    uint64_t aborted_now = b.data().l1.aborted_total - aborted;
    mid_pull += aborted_now > 0;
    printf("round %d: push %s, B aborted %llu reserved objects, restores %llu of %llu tokens\n", round,
           kvf_status_string(st), (unsigned long long)aborted_now, (unsigned long long)r.prefix_tokens,
           (unsigned long long)T);
    kvf_peers_counters pc;
    t0 = Clock::now();
    do {
      kvf_peers_counters_get(b.peers(), &pc);
      if (pc.offers_in_flight == 0) break;
      sleep_ms(10);
    } while (ms_since(t0) < 10000);
    EXPECT_EQ(pc.offers_in_flight, 0u) << "an offer of a dead pusher is still open";
    expect_b_idle(b, "after the push");
    src.close();
    dst.close();
    t0 = Clock::now();
    while (kvf_peers_ready(b.peers()) > 0 && ms_since(t0) < 10000) sleep_ms(10);
  }
  EXPECT_GT(mid_pull, 0) << "no kill landed while B was pulling: the test did not test";
  b.stop();
  unsetenv("UCX_TLS");
}

}  // namespace
