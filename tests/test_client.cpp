// The engine-side client library (kvferry/client.h): its heartbeat thread,
// restart detection, replies matched to concurrent callers, chunk keys, and
// STORE/RETRIEVE submit/wait. Against a real server running in this process
// (host/server.h), and against a scripted fake server (host/endpoint.h) where
// the test needs replies the real one does not give yet (out of order, late,
// STORE/RETRIEVE outcomes).
#include <gtest/gtest.h>

#include <ftw.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <kvferry/client.h>
#include <kvferry/geometry.h>
#include <kvferry/memory.h>

#include "chunk_key_util.h"
#include "server_test_util.h"
#include "host/client/client_internal.h"
#include "host/core/param.h"
#include "host/ipc/endpoint.h"
#include "host/ipc/protocol.h"
#include "host/server/server.h"

#include "mem_test_util.h"

namespace {

using kvf_mem_test::fd_count;
using Clock = std::chrono::steady_clock;

int remove_one(const char *path, const struct stat *, int, struct FTW *) { return remove(path); }

void sleep_ms(int ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); }

int64_t ms_since(Clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count();
}

bool has(const char *haystack, const std::string &needle) { return std::string(haystack).find(needle) != std::string::npos; }

using kvf_server_test::kTinyGeometry;

// A server in this process, started with a heartbeat timeout.
struct RealServer : kvf_server_test::InProcessServer {
  kvf_status start(const std::string &dir, uint32_t heartbeat_timeout_ms) {
    kvf_server_options o = KVF_SERVER_OPTIONS_INIT;
    o.socket_dir = dir.c_str();
    o.heartbeat_timeout_ms = heartbeat_timeout_ms;
    return InProcessServer::start(o);
  }
};

// A scripted server for one client: answers HELLO, then runs `script` on the
// connection (its own thread). Frames are read and written with the codec,
// so what it sees is exactly what the client sent.
class FakeServer {
 public:
  static constexpr uint64_t kBootToken = 0xB007B007ull;

  FakeServer(const std::string &dir, std::function<void(kvf_conn *)> script, uint32_t period_ms = 1000,
             uint32_t timeout_ms = 5000) {
    kvf_conn_init(&conn_, -1, 0);
    EXPECT_EQ(kvf_endpoint_listen(dir.c_str(), 0, &ep_), KVF_SUCCESS) << kvf_last_error();
    thread_ = std::thread([this, script, period_ms, timeout_ms] {
      if (!ep_ || kvf_endpoint_accept(ep_, 5000, 0, &conn_) != KVF_SUCCESS) {
        ADD_FAILURE() << "fake server: no client connected: " << kvf_last_error();
        return;
      }
      kvf_proto_msg m;
      if (!Read(&conn_, &m)) return;
      EXPECT_EQ(m.type, KVF_PROTO_HELLO);
      kvf_proto_msg r = Msg(KVF_PROTO_HELLO_REPLY, m.request_id);
      r.u.hello_reply = {1, (uint32_t)getpid(), kBootToken, 1, period_ms, timeout_ms, KVF_PROTO_MAX_PAYLOAD};
      kvf_proto_msg_clear(&m);
      Send(&conn_, r);
      script(&conn_);
    });
  }
  ~FakeServer() {
    thread_.join();
    kvf_conn_close(&conn_);
    kvf_endpoint_close(ep_);
  }

  static kvf_proto_msg Msg(uint16_t type, uint64_t id) {
    kvf_proto_msg m;
    memset(&m, 0, sizeof m);
    m.type = type;
    m.request_id = id;
    return m;
  }
  // Read one message (the caller clears it); false (and a test failure
  // unless `quiet`) when nothing decodable arrived in time.
  static bool Read(kvf_conn *c, kvf_proto_msg *m, int timeout_ms = 5000, bool quiet = false) {
    kvf_proto_header h;
    uint8_t *payload = nullptr;
    int fds[KVF_PROTO_MAX_FDS];
    uint32_t n = 0;
    memset(m, 0, sizeof *m);
    kvf_status st = kvf_conn_read_frame(c, timeout_ms, &h, &payload, fds, KVF_PROTO_MAX_FDS, &n);
    for (uint32_t i = 0; i < n; i++) close(fds[i]);
    if (st == KVF_SUCCESS) st = kvf_proto_decode(&h, payload, m);
    free(payload);
    if (st != KVF_SUCCESS && !quiet) ADD_FAILURE() << "fake server: " << kvf_last_error();
    return st == KVF_SUCCESS;
  }
  // Read n RETRIEVEs into *got as (request id, token_end); false when one
  // did not arrive.
  static bool ReadRetrieves(kvf_conn *c, int n, std::vector<std::pair<uint64_t, uint64_t>> *got) {
    for (int i = 0; i < n; i++) {
      kvf_proto_msg m;
      if (!Read(c, &m)) return false;
      EXPECT_EQ(m.type, KVF_PROTO_RETRIEVE);
      got->emplace_back(m.request_id, m.u.xfer.token_end);
      kvf_proto_msg_clear(&m);
    }
    return true;
  }
  static void Send(kvf_conn *c, const kvf_proto_msg &m) {
    EXPECT_EQ(kvf_conn_send(c, &m, nullptr, 0, 5000), KVF_SUCCESS) << kvf_last_error();
  }
  // A RETRIEVE_REPLY (or STORE_REPLY) to request `id`, done, with
  // prefix_tokens = `prefix`.
  static void SendDone(kvf_conn *c, uint16_t type, uint64_t id, uint64_t prefix) {
    kvf_proto_msg r = Msg(type, id);
    uint64_t blocks[2] = {prefix / 16, 1};
    uint64_t og[1] = {prefix};
    r.u.xfer_reply.outcome = 1;
    r.u.xfer_reply.prefix_tokens = prefix;
    r.u.xfer_reply.objects_done = 2;
    r.u.xfer_reply.bytes_done = 4096;
    r.u.xfer_reply.group_blocks = blocks;
    r.u.xfer_reply.num_groups = 2;
    if (type == KVF_PROTO_RETRIEVE_REPLY) {
      r.u.xfer_reply.og_prefix_tokens = og;
      r.u.xfer_reply.num_object_groups = 1;
    }
    Send(c, r);
  }

 private:
  kvf_endpoint *ep_ = nullptr;
  kvf_conn conn_;
  std::thread thread_;
};

// Store an int that is no enumerator into an enum the C library reads.
template <typename E>
void SetInt(E *e, int v) {
  static_assert(sizeof(E) == sizeof(int), "an int-sized enum");
  memcpy(e, &v, sizeof v);
}

// One valid xfer: 64 tokens [0, 64) in chunks of 16 (4 keys), one group of
// 4 blocks.
kvf_chunk_key Key(uint8_t b) { return KeyOf(b); }

struct GoodXfer {
  kvf_chunk_key keys[4] = {Key(11), Key(22), Key(33), Key(44)};
  uint32_t ids[4] = {0, 1, 2, 3};
  kvf_group_blocks groups[1];
  kvf_client_xfer x = KVF_CLIENT_XFER_INIT;
  GoodXfer() {
    groups[0].block_ids = ids;
    groups[0].first_block = 0;
    groups[0].count = 4;
    x.token_begin = 0;
    x.token_end = 64;
    x.chunk_keys = keys;
    x.num_chunk_keys = 4;
    x.groups = groups;
    x.num_groups = 1;
  }
};

class Client : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/kvf_client_test_XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    base_ = tmpl;
    dir_ = base_ + "/sock";
    fds_before_ = fd_count();
  }
  void TearDown() override {
    nftw(base_.c_str(), remove_one, 16, FTW_DEPTH | FTW_PHYS);
    EXPECT_EQ(fd_count(), fds_before_) << "descriptors leaked";
  }

  kvf_client *connect(int heartbeat_thread, uint32_t period_ms = 0, uint32_t timeout_ms = 0,
                      kvf_client_info *info = nullptr) {
    kvf_client_options o = KVF_CLIENT_OPTIONS_INIT;
    o.socket_dir = dir_.c_str();
    o.name = "test-client";
    o.heartbeat_thread = heartbeat_thread;
    o.heartbeat_period_ms = period_ms;
    o.timeout_ms = timeout_ms;
    kvf_client *c = nullptr;
    EXPECT_EQ(kvf_client_connect(&o, &c, info), KVF_SUCCESS) << kvf_last_error();
    return c;
  }

  std::string base_, dir_;
  int fds_before_ = 0;
};

// ---- the heartbeat thread and restarts (real server) ----------------------------

TEST_F(Client, HeartbeatThreadKeepsClientAliveSilentOneIsReaped) {
  RealServer server;
  ASSERT_EQ(server.start(dir_, 300), KVF_SUCCESS) << kvf_last_error();
  kvf_client_info info = KVF_CLIENT_INFO_INIT;
  kvf_client *beating = connect(1, 0, 0, &info);  // the server's period: 75 ms
  ASSERT_NE(beating, nullptr);
  EXPECT_EQ(info.heartbeat_timeout_ms, 300u);
  kvf_client *silent = connect(0);
  ASSERT_NE(silent, nullptr);
  sleep_ms(1000);  // more than 3 timeouts
  kvf_client_stats s = KVF_CLIENT_STATS_INIT;
  EXPECT_EQ(kvf_client_stat(beating, &s), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(s.boot_token, info.boot_token);
  EXPECT_EQ(kvf_client_stat(silent, &s), KVF_ERR_DISCONNECTED) << "the silent client was not reaped";
  EXPECT_EQ(kvf_client_heartbeat(silent, nullptr), KVF_ERR_DISCONNECTED) << "dead stays dead";
  EXPECT_EQ(kvf_client_server_restarted(beating), 0);
  EXPECT_EQ(kvf_client_server_restarted(silent), 0);
  kvf_client_disconnect(silent);
  kvf_client_disconnect(beating);
}

TEST_F(Client, HeartbeatOptionsAreChecked) {
  RealServer server;
  ASSERT_EQ(server.start(dir_, 300), KVF_SUCCESS) << kvf_last_error();
  kvf_client_options o = KVF_CLIENT_OPTIONS_INIT;
  o.socket_dir = dir_.c_str();
  kvf_client *c = nullptr;
  o.heartbeat_thread = 2;
  EXPECT_EQ(kvf_client_connect(&o, &c, nullptr), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(has(kvf_last_error(), "options.heartbeat_thread")) << kvf_last_error();
  o.heartbeat_thread = 1;
  o.heartbeat_period_ms = 300;  // not shorter than the server's timeout: it would be reaped
  EXPECT_EQ(kvf_client_connect(&o, &c, nullptr), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(has(kvf_last_error(), "options.heartbeat_period_ms: 300")) << kvf_last_error();
  EXPECT_EQ(c, nullptr);
}

TEST_F(Client, ServerRestartIsDetectedByTheHeartbeatThread) {
  RealServer first;
  ASSERT_EQ(first.start(dir_, 2000), KVF_SUCCESS) << kvf_last_error();
  kvf_client_info info = KVF_CLIENT_INFO_INIT;
  kvf_client *c = connect(1, 30, 0, &info);
  ASSERT_NE(c, nullptr);
  kvf_client *plain = connect(0);  // no heartbeat thread: never says restarted
  ASSERT_NE(plain, nullptr);
  sleep_ms(150);
  EXPECT_EQ(kvf_client_server_restarted(c), 0);
  first.stop();
  // No server at all: calls fail, and nothing has restarted yet.
  kvf_client_stats s = KVF_CLIENT_STATS_INIT;
  EXPECT_EQ(kvf_client_stat(c, &s), KVF_ERR_DISCONNECTED);
  sleep_ms(150);
  EXPECT_EQ(kvf_client_server_restarted(c), 0);

  RealServer second;
  ASSERT_EQ(second.start(dir_, 2000), KVF_SUCCESS) << kvf_last_error();
  ASSERT_NE(kvf_server_boot_token(second.s), info.boot_token);
  auto t0 = Clock::now();
  while (!kvf_client_server_restarted(c) && ms_since(t0) < 3000) sleep_ms(10);
  EXPECT_EQ(kvf_client_server_restarted(c), 1) << "the restart was not noticed";
  // The old connection stays dead: the engine connects and registers anew.
  EXPECT_EQ(kvf_client_stat(c, &s), KVF_ERR_DISCONNECTED);
  EXPECT_EQ(kvf_client_server_restarted(plain), 0);
  kvf_client *fresh = connect(0);
  ASSERT_NE(fresh, nullptr);
  EXPECT_EQ(kvf_client_stat(fresh, &s), KVF_SUCCESS);
  EXPECT_EQ(s.boot_token, kvf_server_boot_token(second.s));
  kvf_client_disconnect(fresh);
  kvf_client_disconnect(plain);
  kvf_client_disconnect(c);
}

TEST_F(Client, DisconnectStopsTheHeartbeatThreadPromptly) {
  {
    // Sleeping between heartbeats: a long period must not delay disconnect.
    RealServer server;
    ASSERT_EQ(server.start(dir_, 5000), KVF_SUCCESS) << kvf_last_error();
    kvf_client *c = connect(1, 4000);
    ASSERT_NE(c, nullptr);
    sleep_ms(50);
    auto t0 = Clock::now();
    kvf_client_disconnect(c);
    EXPECT_LT(ms_since(t0), 500 * kvf_server_test::kTimingScale);
  }
  {
    // Inside a heartbeat the server never answers (client timeout 10 s).
    std::atomic<bool> got_heartbeat{false};
    FakeServer fake(dir_, [&](kvf_conn *conn) {
      kvf_proto_msg m;
      if (FakeServer::Read(conn, &m)) {
        got_heartbeat = m.type == KVF_PROTO_HEARTBEAT;
        kvf_proto_msg_clear(&m);
      }
      // Then silence until the client hangs up.
      while (FakeServer::Read(conn, &m, 5000, true)) kvf_proto_msg_clear(&m);
    });
    kvf_client *c = connect(1, 20, 10000);
    ASSERT_NE(c, nullptr);
    auto t0 = Clock::now();
    while (!got_heartbeat && ms_since(t0) < 3000) sleep_ms(5);
    ASSERT_TRUE(got_heartbeat);
    sleep_ms(50);
    t0 = Clock::now();
    kvf_client_disconnect(c);
    EXPECT_LT(ms_since(t0), 500 * kvf_server_test::kTimingScale);
  }
}

// ---- concurrency -----------------------------------------------------------------

TEST_F(Client, ConcurrentCallsOnOneClientGetTheirOwnReplies) {
  RealServer server;
  ASSERT_EQ(server.start(dir_, 2000), KVF_SUCCESS) << kvf_last_error();
  kvf_client_info info = KVF_CLIENT_INFO_INIT;
  kvf_client *c = connect(1, 5, 0, &info);  // its heartbeat thread joins in
  ASSERT_NE(c, nullptr);

  kvf_geometry *g = nullptr;
  ASSERT_EQ(kvf_geometry_load_buffer(kTinyGeometry, strlen(kTinyGeometry), nullptr, &g, nullptr), KVF_SUCCESS);
  kvf_region_info ri = KVF_REGION_INFO_INIT;
  ASSERT_EQ(kvf_geometry_region(g, 0, &ri), KVF_SUCCESS);
  kvf_geometry_destroy(g);
  kvf_mem_alloc_options ao = KVF_MEM_ALLOC_OPTIONS_INIT;
  ao.size = 2 * ri.size;
  kvf_mem_alloc *a = nullptr;
  ASSERT_EQ(kvf_mem_alloc_create(&ao, &a), KVF_SUCCESS);
  kvf_client_region regs[2] = {{a, 0, ri.size}, {a, ri.size, ri.size}};

  // A mismatched reply fails loudly: STAT_REPLY where HEARTBEAT_REPLY was
  // expected is KVF_ERR_PROTOCOL, and a heartbeat checks its echoed sequence.
  constexpr int kThreads = 6, kCalls = 150;
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; t++) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kCalls; i++) {
        if (t == 0 && i % 10 == 0) {
          // Register and unregister amid the others (descriptors on the frame).
          kvf_client_registration r = KVF_CLIENT_REGISTRATION_INIT;
          if (kvf_client_register(c, kTinyGeometry, strlen(kTinyGeometry), -1, regs, 2, &r) != KVF_SUCCESS ||
              r.imports != 1 || kvf_client_unregister(c, r.registration_id, nullptr) != KVF_SUCCESS) {
            ADD_FAILURE() << "register cycle: " << kvf_last_error();
            failures++;
          }
        } else if ((i + t) % 2) {
          kvf_client_stats s = KVF_CLIENT_STATS_INIT;
          if (kvf_client_stat(c, &s) != KVF_SUCCESS || s.boot_token != info.boot_token || s.active > 1) {
            ADD_FAILURE() << "stat: " << kvf_last_error();
            failures++;
          }
        } else {
          uint64_t token = 0;
          if (kvf_client_heartbeat(c, &token) != KVF_SUCCESS || token != info.boot_token) {
            ADD_FAILURE() << "heartbeat: " << kvf_last_error();
            failures++;
          }
        }
      }
    });
  }
  for (auto &th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  kvf_client_stats s = KVF_CLIENT_STATS_INIT;
  ASSERT_EQ(kvf_client_stat(c, &s), KVF_SUCCESS);
  EXPECT_EQ(s.active, 0u);
  EXPECT_EQ(s.closed_total, (uint32_t)(kCalls / 10));
  kvf_client_disconnect(c);
  kvf_mem_alloc_destroy(a);
}

TEST_F(Client, OutOfOrderRepliesReachTheirWaiters) {
  constexpr int kThreads = 4;
  FakeServer fake(dir_, [&](kvf_conn *conn) {
    std::vector<std::pair<uint64_t, uint64_t>> got;
    if (!FakeServer::ReadRetrieves(conn, kThreads, &got)) return;
    for (auto it = got.rbegin(); it != got.rend(); ++it)
      FakeServer::SendDone(conn, KVF_PROTO_RETRIEVE_REPLY, it->first, it->second);
  });
  kvf_client *c = connect(0);
  ASSERT_NE(c, nullptr);
  std::vector<std::thread> threads;
  std::atomic<int> ok{0};
  for (int t = 0; t < kThreads; t++) {
    threads.emplace_back([&, t] {
      GoodXfer gx;
      gx.x.token_end = 16u * (uint64_t)(t + 1);  // t + 1 chunks: its own answer
      gx.x.num_chunk_keys = (uint32_t)(t + 1);
      kvf_client_result r = KVF_CLIENT_RESULT_INIT;
      kvf_status st = kvf_client_retrieve(c, &gx.x, &r);
      EXPECT_EQ(st, KVF_SUCCESS) << kvf_last_error();
      EXPECT_EQ(r.prefix_tokens, gx.x.token_end) << "thread " << t << " got another request's reply";
      EXPECT_EQ(r.group_blocks[0], gx.x.token_end / 16);
      if (st == KVF_SUCCESS && r.prefix_tokens == gx.x.token_end) ok++;
    });
  }
  for (auto &th : threads) th.join();
  EXPECT_EQ(ok.load(), kThreads);
  kvf_client_disconnect(c);
}

// A client's waits spin (KVF_CLIENT_SPIN_US) while its live registration
// names a GPU, and only then: unregistering it, or a registration of host
// memory replacing it, ends the spin (a host-only kvferryd's copies run on
// the cores a spinning waiter takes); unregistering an older registration
// leaves the live one's. The fake server answers REGISTER with registration
// ids 11, 12, ... (after `scripted` ids, when set) and UNREGISTER as done,
// naming the id it ended as kvferryd does (the live one for 0, 0 when none
// is), or `scripted_gone` when set: replies as two threads of an engine
// may apply them, out of the server's order.
TEST_F(Client, WaitsSpinOnlyWhileTheLiveRegistrationNamesAGpu) {
  std::atomic<uint64_t> scripted{0}, scripted_gone{0};
  FakeServer fake(dir_, [&](kvf_conn *conn) {
    uint64_t next_id = 11, live = 0;
    for (;;) {
      kvf_proto_msg m;
      if (!FakeServer::Read(conn, &m, 5000, true)) return;  // the client disconnected
      kvf_proto_msg r = FakeServer::Msg(KVF_PROTO_ERROR, m.request_id);
      if (m.type == KVF_PROTO_REGISTER) {
        r.type = KVF_PROTO_REGISTER_REPLY;
        uint64_t id = scripted.exchange(0);
        r.u.register_reply.registration_id = live = id ? id : next_id++;
      } else if (m.type == KVF_PROTO_UNREGISTER) {
        uint64_t want = m.u.unregister.registration_id, gone = scripted_gone.exchange(0);
        if (!gone) gone = want ? want : live;
        if (gone == live) live = 0;
        r.type = KVF_PROTO_UNREGISTER_REPLY;
        r.u.unregister_reply.registration_id = gone;
        r.u.unregister_reply.state = 3;
      } else {
        ADD_FAILURE() << "fake server: message type " << m.type;
      }
      kvf_proto_msg_clear(&m);
      FakeServer::Send(conn, r);
    }
  });
  kvf_client *c = connect(0);
  ASSERT_NE(c, nullptr);
  kvf_mem_alloc_options ao = KVF_MEM_ALLOC_OPTIONS_INIT;
  ao.size = 2 * 4096;
  kvf_mem_alloc *a = nullptr;
  ASSERT_EQ(kvf_mem_alloc_create(&ao, &a), KVF_SUCCESS) << kvf_last_error();
  kvf_client_region regs[2] = {{a, 0, 4096}, {a, 4096, 4096}};
  auto reg = [&](int device) {
    kvf_client_registration out = KVF_CLIENT_REGISTRATION_INIT;
    EXPECT_EQ(kvf_client_register(c, kTinyGeometry, strlen(kTinyGeometry), device, regs, 2, &out), KVF_SUCCESS)
        << kvf_last_error();
    return out.registration_id;
  };
  const uint64_t spin = (uint64_t)kvf_param_client_spin_us();
  ASSERT_GT(spin, 0u) << "KVF_CLIENT_SPIN_US is set to 0 here";
  EXPECT_EQ(kvf_client_test_spin_us(c), 0u) << "no registration yet";
  EXPECT_EQ(reg(0), 11u);
  EXPECT_EQ(kvf_client_test_spin_us(c), spin) << "the live registration names GPU 0";
  EXPECT_EQ(kvf_client_unregister(c, 0, nullptr), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(kvf_client_test_spin_us(c), 0u) << "the GPU registration is gone";
  EXPECT_EQ(reg(0), 12u);
  EXPECT_EQ(reg(-1), 13u);
  EXPECT_EQ(kvf_client_test_spin_us(c), 0u) << "host memory replaced the GPU registration";
  EXPECT_EQ(reg(0), 14u);
  EXPECT_EQ(kvf_client_unregister(c, 12, nullptr), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(kvf_client_test_spin_us(c), spin) << "an older registration went, the live one stays";
  EXPECT_EQ(kvf_client_unregister(c, 14, nullptr), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(kvf_client_test_spin_us(c), 0u) << "the live registration went by its id";
  // Out of order: the reply of an UNREGISTER the server handled after
  // REGISTER 15 is applied first, then that REGISTER's reply: nothing is
  // live. Then REGISTER 16 (GPU), and a stale reply (id 9, older than the
  // newest applied) changes nothing.
  scripted_gone = 15;
  EXPECT_EQ(kvf_client_unregister(c, 0, nullptr), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(reg(0), 15u);
  EXPECT_EQ(kvf_client_test_spin_us(c), 0u) << "registration 15 was already unregistered";
  EXPECT_EQ(reg(0), 16u);
  EXPECT_EQ(kvf_client_test_spin_us(c), spin);
  scripted = 9;
  EXPECT_EQ(reg(-1), 9u);
  EXPECT_EQ(kvf_client_test_spin_us(c), spin) << "a stale REGISTER reply replaced the live registration";
  // An id the client was never given (another kvferryd's, a junk value):
  // unregistering it succeeds (the server echoes it) and marks nothing to
  // come as gone.
  EXPECT_EQ(kvf_client_unregister(c, 1000, nullptr), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(kvf_client_test_spin_us(c), spin);
  EXPECT_EQ(reg(0), 17u);
  EXPECT_EQ(kvf_client_test_spin_us(c), spin) << "registration 17 counted as gone after unregistering 1000";
  kvf_client_disconnect(c);
  kvf_mem_alloc_destroy(a);
}

// Waits that read without sleeping first (KVF_CLIENT_SPIN_US; a client of a
// GPU cache), here for half a second: replies out of order, some inside a
// spin and two long after the first ones, reach their own waiters, each
// returns as soon as its reply is filed (not at the spin's end), and a call
// whose deadline (5 ms) comes before the spin's end keeps it.
TEST_F(Client, SpinningWaitersGetTheirOwnRepliesAndKeepTheirDeadlines) {
  constexpr int kThreads = 4;
  FakeServer fake(dir_, [&](kvf_conn *conn) {
    std::vector<std::pair<uint64_t, uint64_t>> got;
    if (!FakeServer::ReadRetrieves(conn, kThreads, &got)) return;
    // Newest first; the last two 30 ms later.
    for (size_t i = got.size(); i-- > 0;) {
      if (i < 2) sleep_ms(30);
      FakeServer::SendDone(conn, KVF_PROTO_RETRIEVE_REPLY, got[i].first, got[i].second);
    }
    kvf_proto_msg m;  // then a STAT never answered: its 5 ms wait gives up
    if (!FakeServer::Read(conn, &m)) return;
    kvf_proto_msg_clear(&m);
    FakeServer::Read(conn, &m, 5000, true);  // until the client disconnects
  });
  kvf_client *c = connect(0, 0, 5);  // synchronous calls wait 5 ms
  ASSERT_NE(c, nullptr);
  kvf_client_test_spin(c, 500000);  // spins of half a second
  std::vector<std::thread> threads;
  std::atomic<int> ok{0};
  std::vector<uint64_t> ids(kThreads);
  for (int t = 0; t < kThreads; t++) {
    GoodXfer gx;
    gx.x.token_end = 16u * (uint64_t)(t + 1);  // t + 1 chunks: its own answer
    gx.x.num_chunk_keys = (uint32_t)(t + 1);
    ASSERT_EQ(kvf_client_submit(c, KVF_CLIENT_RETRIEVE, &gx.x, &ids[t]), KVF_SUCCESS) << kvf_last_error();
  }
  auto t0 = Clock::now();
  for (int t = 0; t < kThreads; t++) {
    threads.emplace_back([&, t] {
      kvf_client_result r = KVF_CLIENT_RESULT_INIT;
      kvf_status st = kvf_client_wait(c, ids[t], 5000, &r);
      EXPECT_EQ(st, KVF_SUCCESS) << kvf_last_error();
      EXPECT_EQ(r.prefix_tokens, 16u * (uint64_t)(t + 1)) << "waiter " << t << " got another request's reply";
      if (st == KVF_SUCCESS && r.prefix_tokens == 16u * (uint64_t)(t + 1)) ok++;
    });
  }
  for (auto &th : threads) th.join();
  EXPECT_EQ(ok.load(), kThreads);
  EXPECT_LT(ms_since(t0), 400) << "a waiter spun on after its reply was filed";
  kvf_client_stats s = KVF_CLIENT_STATS_INIT;
  t0 = Clock::now();
  EXPECT_EQ(kvf_client_stat(c, &s), KVF_ERR_TIMEOUT) << kvf_last_error();
  EXPECT_GE(ms_since(t0), 4);
  EXPECT_LT(ms_since(t0), 400) << "the spin overran the call's deadline";
  kvf_client_disconnect(c);
}

TEST_F(Client, LateReplyToATimedOutCallIsDropped) {
  FakeServer fake(dir_, [&](kvf_conn *conn) {
    kvf_proto_msg m;
    if (!FakeServer::Read(conn, &m)) return;
    uint64_t first = m.request_id;
    kvf_proto_msg_clear(&m);
    sleep_ms(300);  // the client gave up after 100 ms
    kvf_proto_msg r = FakeServer::Msg(KVF_PROTO_STAT_REPLY, first);
    r.u.stat_reply.boot_token = 111;
    FakeServer::Send(conn, r);
    if (!FakeServer::Read(conn, &m)) return;
    r = FakeServer::Msg(KVF_PROTO_STAT_REPLY, m.request_id);
    r.u.stat_reply.boot_token = 222;
    kvf_proto_msg_clear(&m);
    FakeServer::Send(conn, r);
  });
  kvf_client *c = connect(0, 0, 100);
  ASSERT_NE(c, nullptr);
  kvf_client_stats s = KVF_CLIENT_STATS_INIT;
  EXPECT_EQ(kvf_client_stat(c, &s), KVF_ERR_TIMEOUT);
  sleep_ms(400);  // the late reply is on its way
  ASSERT_EQ(kvf_client_stat(c, &s), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(s.boot_token, 222u) << "a late reply answered a later request";
  kvf_client_disconnect(c);
}

TEST_F(Client, DisconnectFailsEveryWaiter) {
  constexpr int kThreads = 3;
  FakeServer fake(dir_, [&](kvf_conn *conn) {
    for (int i = 0; i < kThreads; i++) {
      kvf_proto_msg m;
      if (!FakeServer::Read(conn, &m)) return;
      kvf_proto_msg_clear(&m);
    }
    sleep_ms(100);
    kvf_conn_close(conn);  // the server goes away with every request unanswered
  });
  kvf_client *c = connect(0);
  ASSERT_NE(c, nullptr);
  std::vector<std::thread> threads;
  std::atomic<int> disconnected{0};
  for (int t = 0; t < kThreads; t++) {
    threads.emplace_back([&] {
      kvf_client_stats s = KVF_CLIENT_STATS_INIT;
      if (kvf_client_stat(c, &s) == KVF_ERR_DISCONNECTED) disconnected++;
    });
  }
  for (auto &th : threads) th.join();
  EXPECT_EQ(disconnected.load(), kThreads);
  kvf_client_disconnect(c);
}

// ---- chunk keys -----------------------------------------------------------------------

kvf_chunk_key Seed(const std::string &model) {
  kvf_chunk_key k;
  EXPECT_EQ(kvf_chunk_seed(model.data(), model.size(), &k), KVF_SUCCESS) << kvf_last_error();
  return k;
}

std::string Hex(const kvf_chunk_key &k) { return KeyHex(k); }

std::vector<kvf_chunk_key> Keys(const kvf_chunk_key &seed, const std::vector<uint32_t> &tokens, uint32_t chunk) {
  std::vector<kvf_chunk_key> keys(tokens.size() / chunk + 2);
  uint64_t n = kvf_chunk_keys(&seed, tokens.data(), 4, tokens.size(), chunk, keys.data());
  keys.resize(n);
  return keys;
}

int BitsDiffer(const kvf_chunk_key &a, const kvf_chunk_key &b) {
  int d = 0;
  for (unsigned i = 0; i < KVF_CHUNK_KEY_BYTES; i++) d += __builtin_popcount((unsigned)(a.bytes[i] ^ b.bytes[i]));
  return d;
}

// The vector docs/protocol.md gives, computed independently (Python's
// hashlib): seed "example-model", the 32-bit little-endian tokens 0..9 in
// chunks of 4 (the last one partial).
TEST(ChunkKeys, MatchTheDocumentedTestVector) {
  kvf_chunk_key seed = Seed("example-model");
  EXPECT_EQ(Hex(seed), "62042d691c2d741b6591302f95fd5fd4324ad444d32ea1ad2680340208423b11");
  std::vector<uint32_t> tokens = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9};
  std::vector<kvf_chunk_key> k = Keys(seed, tokens, 4);
  ASSERT_EQ(k.size(), 3u);
  EXPECT_EQ(Hex(k[0]), "a813754b0dd61ef046617af334fb6c329e8295e91382cc97045d58ad695bce17");
  EXPECT_EQ(Hex(k[1]), "c13df430f4da64bb3431e25fd70af8ae807b4b0547e84a20fa1c46d622b5eaec");
  EXPECT_EQ(Hex(k[2]), "dd9400ddcaabd6d4f394a8bc010ae14eaaf99bbeedac7ea6b2b042c3aa586492");
  // The seed of nothing: SHA-256("kvferry-seed-v1").
  kvf_chunk_key empty;
  ASSERT_EQ(kvf_chunk_seed(nullptr, 0, &empty), KVF_SUCCESS);
  EXPECT_EQ(Hex(empty), "8d75ee443b995d12f4ace7d57fcfff7036d3ccf1678c37010a3e10c8eda6140a");
}

TEST(ChunkKeys, EqualPrefixesEqualKeysAnyChangeChangesEveryLaterKey) {
  std::mt19937 rng(7);
  std::vector<uint32_t> tokens(100);
  for (auto &t : tokens) t = rng() % 50000;
  const kvf_chunk_key m1 = Seed("model-1"), m2 = Seed("model-2");
  std::vector<kvf_chunk_key> a = Keys(m1, tokens, 16);
  ASSERT_EQ(a.size(), 7u) << "ceil(100 / 16) chunks, the last one partial";
  EXPECT_TRUE(Keys(m1, tokens, 16) == a) << "not deterministic";
  const kvf_chunk_key zero = {};
  for (const kvf_chunk_key &k : a) EXPECT_NE(k, zero);
  for (size_t i = 0; i < a.size(); i++)
    for (size_t j = i + 1; j < a.size(); j++) EXPECT_NE(a[i], a[j]);

  // An equal prefix gives equal keys, whatever follows.
  std::vector<uint32_t> prefix(tokens.begin(), tokens.begin() + 48);
  std::vector<kvf_chunk_key> p = Keys(m1, prefix, 16);
  ASSERT_EQ(p.size(), 3u);
  EXPECT_TRUE(std::equal(p.begin(), p.end(), a.begin()));

  // Any changed token (every position, one bit) changes its chunk's key and
  // every later one, never an earlier one.
  for (size_t i = 0; i < tokens.size(); i++) {
    std::vector<uint32_t> edited = tokens;
    edited[i] ^= 1u << (i % 32);
    std::vector<kvf_chunk_key> e = Keys(m1, edited, 16);
    ASSERT_EQ(e.size(), a.size());
    for (size_t k = 0; k < a.size(); k++) {
      if (k < i / 16)
        EXPECT_EQ(e[k], a[k]) << "token " << i << ", chunk " << k;
      else
        EXPECT_NE(e[k], a[k]) << "token " << i << ", chunk " << k;
    }
  }

  // The seed names the model: another seed, other keys everywhere.
  std::vector<kvf_chunk_key> other = Keys(m2, tokens, 16);
  for (size_t k = 0; k < a.size(); k++) EXPECT_NE(other[k], a[k]);

  // A partial chunk is not the full chunk padded with token 0.
  std::vector<uint32_t> partial(tokens.begin(), tokens.begin() + 20), padded = partial;
  padded.resize(32, 0);
  std::vector<kvf_chunk_key> kp = Keys(m1, partial, 16), kq = Keys(m1, padded, 16);
  ASSERT_EQ(kp.size(), 2u);
  ASSERT_EQ(kq.size(), 2u);
  EXPECT_EQ(kp[0], kq[0]);
  EXPECT_NE(kp[1], kq[1]);

  // Keys follow the bytes: 2-byte tokens hash their own width.
  std::vector<uint16_t> narrow(tokens.size());
  for (size_t i = 0; i < tokens.size(); i++) narrow[i] = (uint16_t)tokens[i];
  kvf_chunk_key nk[8];
  EXPECT_EQ(kvf_chunk_keys(&m1, narrow.data(), 2, narrow.size(), 16, nk), 7u);
  EXPECT_NE(nk[0], a[0]);

  // Bad arguments write nothing; an all-zero seed is not a seed.
  kvf_chunk_key out[2] = {};
  EXPECT_EQ(kvf_chunk_keys(&m1, nullptr, 4, 10, 16, out), 0u);
  EXPECT_EQ(kvf_chunk_keys(&m1, tokens.data(), 4, 10, 0, out), 0u);
  EXPECT_EQ(kvf_chunk_keys(&m1, tokens.data(), 4, 10, 16, nullptr), 0u);
  EXPECT_EQ(kvf_chunk_keys(&m1, tokens.data(), 0, 10, 16, out), 0u);
  EXPECT_EQ(kvf_chunk_keys(&m1, tokens.data(), 4, 0, 16, out), 0u);
  EXPECT_EQ(kvf_chunk_keys(nullptr, tokens.data(), 4, 10, 16, out), 0u);
  EXPECT_EQ(kvf_chunk_keys(&zero, tokens.data(), 4, 10, 16, out), 0u);
  EXPECT_EQ(kvf_chunk_keys(&m1, tokens.data(), 4, UINT64_MAX, 16, out), 0u) << "bytes overflow";
  EXPECT_EQ(out[0], zero);
  EXPECT_EQ(kvf_chunk_seed("x", 1, nullptr), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(kvf_chunk_seed(nullptr, 1, &out[0]), KVF_ERR_INVALID_ARGUMENT);
}

// Every input bit reaches the output: flipping one bit of a chunk flips
// about half of its key's 256 bits, and of the next key's.
TEST(ChunkKeys, OneBitFlipsHalfTheKey) {
  std::mt19937 rng(11);
  std::vector<uint32_t> tokens(32);
  for (auto &t : tokens) t = rng();
  const kvf_chunk_key seed = Seed("model");
  std::vector<kvf_chunk_key> base = Keys(seed, tokens, 16);
  ASSERT_EQ(base.size(), 2u);
  double sum0 = 0, sum1 = 0;
  int min0 = 256, n = 0;
  for (size_t i = 0; i < 16; i++) {
    for (int bit = 0; bit < 32; bit++, n++) {
      std::vector<uint32_t> t = tokens;
      t[i] ^= 1u << bit;
      std::vector<kvf_chunk_key> k = Keys(seed, t, 16);
      int d0 = BitsDiffer(k[0], base[0]), d1 = BitsDiffer(k[1], base[1]);
      sum0 += d0;
      sum1 += d1;
      min0 = std::min(min0, d0);
    }
  }
  EXPECT_NEAR(sum0 / n, 128.0, 4.0);
  EXPECT_NEAR(sum1 / n, 128.0, 4.0);
  EXPECT_GE(min0, 80);
  // And the seed's bits too.
  double sums = 0;
  for (int bit = 0; bit < 256; bit++) {
    kvf_chunk_key s2 = seed;
    s2.bytes[bit / 8] ^= (uint8_t)(1u << (bit % 8));
    sums += BitsDiffer(Keys(s2, tokens, 16)[0], base[0]);
  }
  EXPECT_NEAR(sums / 256, 128.0, 6.0);
}

// ---- STORE / RETRIEVE ---------------------------------------------------------------------

TEST_F(Client, SubmitOfABadXferNamesTheFieldAndSendsNothing) {
  std::atomic<uint16_t> first_type{0};
  FakeServer fake(dir_, [&](kvf_conn *conn) {
    kvf_proto_msg m;
    if (!FakeServer::Read(conn, &m)) return;
    first_type = m.type;  // must be the heartbeat sent after every refusal
    kvf_proto_msg r = FakeServer::Msg(KVF_PROTO_HEARTBEAT_REPLY, m.request_id);
    r.u.heartbeat_reply = {m.u.heartbeat.sequence, FakeServer::kBootToken};
    kvf_proto_msg_clear(&m);
    FakeServer::Send(conn, r);
  });
  kvf_client *c = connect(0);
  ASSERT_NE(c, nullptr);
  std::vector<uint32_t> many(KVF_PROTO_MAX_BLOCKS_PER_GROUP, 1);
  kvf_group_blocks big[4];
  for (auto &b : big) b = {many.data(), 0, (uint32_t)many.size()};
  const uint8_t zeros[64] = {0};
  uint8_t handle[64];
  memset(handle, 0x5A, sizeof handle);
  struct Case {
    int op;  // an int: 7 is not a kvf_client_op, and C++ may not hold it in one
    std::function<void(GoodXfer &)> edit;
    std::string field;
  };
  std::vector<Case> cases = {
      {KVF_CLIENT_STORE, [](GoodXfer &g) { g.x.struct_size = 4; }, "xfer.struct_size"},
      {KVF_CLIENT_STORE, [](GoodXfer &g) { g.x.token_end = 0; }, "xfer.token_end"},
      {KVF_CLIENT_STORE, [](GoodXfer &g) { SetInt(&g.x.format, 5); }, "xfer.format"},
      {KVF_CLIENT_STORE, [](GoodXfer &g) { g.x.num_chunk_keys = 0; }, "xfer.num_chunk_keys"},
      {KVF_CLIENT_STORE, [](GoodXfer &g) { g.x.num_chunk_keys = KVF_PROTO_MAX_CHUNKS + 1; }, "xfer.num_chunk_keys"},
      {KVF_CLIENT_STORE, [](GoodXfer &g) { g.x.token_end = 3; }, "xfer.num_chunk_keys: 4 chunks for a range of 3"},
      {KVF_CLIENT_STORE, [](GoodXfer &g) { g.x.chunk_keys = nullptr; }, "xfer.chunk_keys: NULL"},
      {KVF_CLIENT_STORE, [](GoodXfer &g) { g.keys[2] = kvf_chunk_key{}; }, "xfer.chunk_keys[2]: all zero is not a key"},
      {KVF_CLIENT_RETRIEVE, [](GoodXfer &g) { g.x.num_groups = 0; }, "xfer.num_groups"},
      {KVF_CLIENT_RETRIEVE, [](GoodXfer &g) { g.x.num_groups = 65; }, "xfer.num_groups"},
      {KVF_CLIENT_RETRIEVE, [](GoodXfer &g) { g.x.groups = nullptr; }, "xfer.groups: NULL"},
      {KVF_CLIENT_RETRIEVE, [](GoodXfer &g) { g.groups[0].count = KVF_PROTO_MAX_BLOCKS_PER_GROUP + 1; },
       "xfer.groups[0].count"},
      {KVF_CLIENT_RETRIEVE, [&](GoodXfer &g) { g.x.groups = big, g.x.num_groups = 4; }, "xfer.groups: the request needs"},
      {KVF_CLIENT_RETRIEVE, [&](GoodXfer &g) { g.x.ready_event = handle; }, "xfer.ready_event: a RETRIEVE"},
      {KVF_CLIENT_STORE, [&](GoodXfer &g) { g.x.ready_event = zeros; }, "xfer.ready_event: 64 zero bytes"},
      {7, [](GoodXfer &) {}, "op: 7"},
  };
  for (const Case &k : cases) {
    GoodXfer g;
    k.edit(g);
    uint64_t id = 12345;
    // Converted in the call, never stored: C++ must not load a 7 from a kvf_client_op.
    EXPECT_EQ(kvf_client_submit(c, static_cast<kvf_client_op>(k.op), &g.x, &id), KVF_ERR_INVALID_ARGUMENT) << k.field;
    EXPECT_TRUE(has(kvf_last_error(), k.field)) << "'" << kvf_last_error() << "' does not name " << k.field;
    EXPECT_EQ(id, 12345u);
    kvf_client_result r = KVF_CLIENT_RESULT_INIT;
    if (k.op == KVF_CLIENT_STORE) {
      EXPECT_EQ(kvf_client_store(c, &g.x, &r), KVF_ERR_INVALID_ARGUMENT) << k.field;
    }
  }
  GoodXfer g;
  uint64_t id = 0;
  EXPECT_EQ(kvf_client_submit(c, KVF_CLIENT_STORE, nullptr, &id), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(kvf_client_submit(c, KVF_CLIENT_STORE, &g.x, nullptr), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(kvf_client_submit(nullptr, KVF_CLIENT_STORE, &g.x, &id), KVF_ERR_INVALID_ARGUMENT);
  kvf_client_result bad = KVF_CLIENT_RESULT_INIT;
  bad.struct_size = 4;
  EXPECT_EQ(kvf_client_store(c, &g.x, &bad), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(has(kvf_last_error(), "result.struct_size")) << kvf_last_error();
  // Nothing reached the server: the first frame after HELLO is this heartbeat.
  ASSERT_EQ(kvf_client_heartbeat(c, nullptr), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(first_type.load(), KVF_PROTO_HEARTBEAT);
  kvf_client_disconnect(c);
}

TEST_F(Client, SubmitWaitCarriesEveryFieldBothWays) {
  uint8_t handle[64];
  for (int i = 0; i < 64; i++) handle[i] = (uint8_t)(i + 1);
  FakeServer fake(dir_, [&](kvf_conn *conn) {
    kvf_proto_msg st, rt;
    if (!FakeServer::Read(conn, &st) || !FakeServer::Read(conn, &rt)) return;
    // The STORE as sent.
    EXPECT_EQ(st.type, KVF_PROTO_STORE);
    EXPECT_EQ(st.u.xfer.registration_id, 5u);
    EXPECT_EQ(st.u.xfer.token_begin, 16u);
    EXPECT_EQ(st.u.xfer.token_end, 60u);
    EXPECT_EQ(st.u.xfer.format, 1u);
    EXPECT_EQ(st.u.xfer.ready_kind, (uint32_t)KVF_PROTO_READY_CUDA_EVENT);
    EXPECT_EQ(0, memcmp(st.u.xfer.ready_handle, handle, 64));
    ASSERT_EQ(st.u.xfer.num_chunk_keys, 3u);
    EXPECT_EQ(st.u.xfer.chunk_keys[2].bytes[0], 33u);
    ASSERT_EQ(st.u.xfer.num_groups, 2u);
    EXPECT_EQ(st.u.xfer.groups[0].count, 3u);
    EXPECT_EQ(st.u.xfer.groups[0].first_block, 1u);
    EXPECT_EQ(st.u.xfer.groups[0].block_ids[2], 9u);
    EXPECT_EQ(st.u.xfer.groups[1].count, 0u) << "NULL block_ids: the group does not move";
    // The RETRIEVE waits for nothing.
    EXPECT_EQ(rt.type, KVF_PROTO_RETRIEVE);
    EXPECT_EQ(rt.u.xfer.ready_kind, 0u);
    // Answer the RETRIEVE first, with an ERROR (refused before admission)...
    kvf_proto_msg e = FakeServer::Msg(KVF_PROTO_ERROR, rt.request_id);
    e.u.error.status = KVF_ERR_INVALID_ARGUMENT;
    e.u.error.version = 1;
    strcpy(e.u.error.field, "payload.groups[0].block_ids[2]");
    strcpy(e.u.error.message, "9 is not below num_blocks 4");
    FakeServer::Send(conn, e);
    // ... then the STORE: failed after admission, partly stored.
    kvf_proto_msg r = FakeServer::Msg(KVF_PROTO_STORE_REPLY, st.request_id);
    uint64_t blocks[2] = {2, 0};
    r.u.xfer_reply.status = KVF_ERR_OUT_OF_MEMORY;
    r.u.xfer_reply.outcome = 2;
    r.u.xfer_reply.prefix_tokens = 48;
    r.u.xfer_reply.objects_done = 1;
    r.u.xfer_reply.objects_present = 1;
    r.u.xfer_reply.bytes_done = 8192;
    r.u.xfer_reply.group_blocks = blocks;
    r.u.xfer_reply.num_groups = 2;
    strcpy(r.u.xfer_reply.message, "L1 is full");
    FakeServer::Send(conn, r);
    kvf_proto_msg_clear(&st);
    kvf_proto_msg_clear(&rt);
    // A third request: a RETRIEVE that is done.
    kvf_proto_msg m;
    if (!FakeServer::Read(conn, &m)) return;
    FakeServer::SendDone(conn, KVF_PROTO_RETRIEVE_REPLY, m.request_id, 32);
    kvf_proto_msg_clear(&m);
  });
  kvf_client *c = connect(0);
  ASSERT_NE(c, nullptr);
  kvf_chunk_key keys[3] = {Key(11), Key(22), Key(33)};
  uint32_t ids[3] = {7, 8, 9};
  kvf_group_blocks groups[2] = {{ids, 1, 3}, {nullptr, 0, 5}};
  kvf_client_xfer x = KVF_CLIENT_XFER_INIT;
  x.registration_id = 5;
  x.token_begin = 16;
  x.token_end = 60;
  x.format = KVF_FORMAT_NATIVE;
  x.chunk_keys = keys;
  x.num_chunk_keys = 3;
  x.groups = groups;
  x.num_groups = 2;
  x.ready_event = handle;
  uint64_t store_id = 0, retrieve_id = 0;
  ASSERT_EQ(kvf_client_submit(c, KVF_CLIENT_STORE, &x, &store_id), KVF_SUCCESS) << kvf_last_error();
  x.ready_event = nullptr;
  ASSERT_EQ(kvf_client_submit(c, KVF_CLIENT_RETRIEVE, &x, &retrieve_id), KVF_SUCCESS) << kvf_last_error();
  EXPECT_NE(store_id, retrieve_id);

  kvf_client_result r = KVF_CLIENT_RESULT_INIT;
  EXPECT_EQ(kvf_client_wait(c, store_id + retrieve_id + 100, 50, &r), KVF_ERR_NOT_FOUND);
  // Collected in the other order than they were answered.
  ASSERT_EQ(kvf_client_wait(c, store_id, 0, &r), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(r.status, KVF_ERR_OUT_OF_MEMORY);
  EXPECT_EQ(r.outcome, KVF_CLIENT_FAILED);
  EXPECT_TRUE(has(kvf_last_error(), "L1 is full")) << kvf_last_error();
  EXPECT_EQ(r.prefix_tokens, 48u);
  EXPECT_EQ(r.objects_done, 1u);
  EXPECT_EQ(r.objects_present, 1u);
  EXPECT_EQ(r.bytes_done, 8192u);
  ASSERT_EQ(r.num_groups, 2u);
  EXPECT_EQ(r.group_blocks[0], 2u);
  EXPECT_EQ(r.num_object_groups, 0u);
  EXPECT_EQ(kvf_client_wait(c, store_id, 50, &r), KVF_ERR_NOT_FOUND) << "collected once";

  EXPECT_EQ(kvf_client_wait(c, retrieve_id, 0, &r), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(has(kvf_last_error(), "payload.groups[0].block_ids[2]: 9 is not below")) << kvf_last_error();

  // store/retrieve: KVF_SUCCESS only when done.
  kvf_client_result rr = KVF_CLIENT_RESULT_INIT;
  ASSERT_EQ(kvf_client_retrieve(c, &x, &rr), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(rr.outcome, KVF_CLIENT_DONE);
  EXPECT_EQ(rr.status, KVF_SUCCESS);
  EXPECT_EQ(rr.prefix_tokens, 32u);
  ASSERT_EQ(rr.num_object_groups, 1u);
  EXPECT_EQ(rr.object_group_prefix[0], 32u);
  kvf_client_disconnect(c);
}

TEST_F(Client, WaitTimesOutThenWaitsAgain) {
  std::atomic<bool> release{false};
  FakeServer fake(dir_, [&](kvf_conn *conn) {
    kvf_proto_msg m;
    if (!FakeServer::Read(conn, &m)) return;
    auto t0 = Clock::now();
    while (!release && ms_since(t0) < 5000) sleep_ms(5);
    kvf_proto_msg r = FakeServer::Msg(KVF_PROTO_STORE_REPLY, m.request_id);
    r.u.xfer_reply.status = KVF_ERR_TIMEOUT;
    r.u.xfer_reply.outcome = 4;
    FakeServer::Send(conn, r);
    kvf_proto_msg_clear(&m);
  });
  kvf_client *c = connect(0);
  ASSERT_NE(c, nullptr);
  GoodXfer g;
  uint64_t id = 0;
  ASSERT_EQ(kvf_client_submit(c, KVF_CLIENT_STORE, &g.x, &id), KVF_SUCCESS) << kvf_last_error();
  kvf_client_result r = KVF_CLIENT_RESULT_INIT;
  auto t0 = Clock::now();
  EXPECT_EQ(kvf_client_wait(c, id, 60, &r), KVF_ERR_TIMEOUT);
  EXPECT_GE(ms_since(t0), 55);
  release = true;
  ASSERT_EQ(kvf_client_wait(c, id, 0, &r), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(r.outcome, KVF_CLIENT_TIMED_OUT);
  EXPECT_EQ(r.status, KVF_ERR_TIMEOUT);
  kvf_client_disconnect(c);
}

// The real server refuses a STORE with no registration behind it (its exact
// status belongs to the server's tests); the connection stays usable.
TEST_F(Client, RealServerAnswersAStoreWithoutDroppingTheClient) {
  RealServer server;
  ASSERT_EQ(server.start(dir_, 2000), KVF_SUCCESS) << kvf_last_error();
  kvf_client *c = connect(0);
  ASSERT_NE(c, nullptr);
  GoodXfer g;
  kvf_client_result r = KVF_CLIENT_RESULT_INIT;
  kvf_status st = kvf_client_store(c, &g.x, &r);  // no registration: never done
  EXPECT_NE(st, KVF_SUCCESS);
  EXPECT_NE(st, KVF_ERR_DISCONNECTED) << kvf_last_error();
  EXPECT_NE(st, KVF_ERR_TIMEOUT) << kvf_last_error();
  EXPECT_NE(st, KVF_ERR_PROTOCOL) << "the server could not decode the STORE: " << kvf_last_error();
  EXPECT_TRUE(kvf_last_error()[0]) << "a refusal says why";
  kvf_client_stats s = KVF_CLIENT_STATS_INIT;
  EXPECT_EQ(kvf_client_stat(c, &s), KVF_SUCCESS) << "the connection survives: " << kvf_last_error();
  EXPECT_EQ(kvf_client_wait(c, 999, 10, &r), KVF_ERR_NOT_FOUND);
  kvf_client_disconnect(c);
}

}  // namespace
