// kvferryd's server object and the client API, multi-process on the host
// provider: the server runs in a forked process (as kvferryd would), engines
// in forked processes or in the test process itself.
#include <gtest/gtest.h>

#include <dirent.h>
#include <fcntl.h>
#include <ftw.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <string>
#include <vector>

#include <kvferry/client.h>
#include <kvferry/geometry.h>
#include <kvferry/memory.h>

#include "host/ipc/endpoint.h"
#include "host/ipc/protocol.h"
#include "host/server/server.h"

#include "mem_test_util.h"
#include "server_test_util.h"

namespace {

using kvf_mem_test::fd_count;

int remove_one(const char *path, const struct stat *, int, struct FTW *) { return remove(path); }

using kvf_server_test::kTinyGeometry;

uint64_t region_size() {
  kvf_geometry *g = nullptr;
  if (kvf_geometry_load_buffer(kTinyGeometry, strlen(kTinyGeometry), nullptr, &g, nullptr) != KVF_SUCCESS) return 0;
  kvf_region_info info = KVF_REGION_INFO_INIT;
  uint64_t size = kvf_geometry_region(g, 0, &info) == KVF_SUCCESS ? info.size : 0;
  kvf_geometry_destroy(g);
  return size;
}

kvf_server *g_child_server;
void child_on_term(int) { kvf_server_stop(g_child_server); }

void sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, nullptr);
}

// An engine: register both regions from one host allocation (1 import, 2
// aliases), say so on `ready`, then heartbeat every 50 ms until `control`
// gives a byte ('q': unregister and exit 0) or closes. Exit status: 0 ok,
// 10+ a step that failed.
[[noreturn]] void engine_main(const std::string &dir, int ready, int control, uint64_t size) {
  kvf_client_options o = KVF_CLIENT_OPTIONS_INIT;
  o.socket_dir = dir.c_str();
  o.name = "engine";
  kvf_client *c = nullptr;
  if (kvf_client_connect(&o, &c, nullptr) != KVF_SUCCESS) _exit(10);
  kvf_mem_alloc_options ao = KVF_MEM_ALLOC_OPTIONS_INIT;
  ao.size = 2 * size;
  kvf_mem_alloc *a = nullptr;
  if (kvf_mem_alloc_create(&ao, &a) != KVF_SUCCESS) _exit(11);
  kvf_client_region regs[2] = {{a, 0, size}, {a, size, size}};
  if (kvf_client_register(c, kTinyGeometry, strlen(kTinyGeometry), -1, regs, 2, nullptr) != KVF_SUCCESS) _exit(12);
  char b = 'r';
  if (write(ready, &b, 1) != 1) _exit(13);
  for (;;) {
    struct pollfd p = {control, POLLIN, 0};
    int rc = poll(&p, 1, 50);
    if (rc > 0) {
      ssize_t n = read(control, &b, 1);
      if (n == 1 && b == 'q') {
        uint32_t state = 0;
        if (kvf_client_unregister(c, 0, &state) != KVF_SUCCESS || state != KVF_PROTO_REG_CLOSED) _exit(14);
        kvf_client_disconnect(c);
        kvf_mem_alloc_destroy(a);
        _exit(0);
      }
      _exit(0); /* control closed: just go (a crash-like exit without unregister) */
    }
    if (kvf_client_heartbeat(c, nullptr) != KVF_SUCCESS) _exit(15);
  }
}

struct Engine {
  pid_t pid = -1;
  int control = -1;
};

class Server : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/kvf_server_test_XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    base_ = tmpl;
    dir_ = base_ + "/sock";
    size_ = region_size();
    ASSERT_GT(size_, 0u) << kvf_last_error();
    fds_before_ = fd_count();
    signal(SIGPIPE, SIG_IGN); /* a dead engine's control pipe must fail the test, not kill it */
  }

  void TearDown() override {
    for (Engine &e : engines_) {
      if (e.pid > 0) {
        kill(e.pid, SIGKILL);
        waitpid(e.pid, nullptr, 0);
      }
      if (e.control >= 0) close(e.control);
    }
    if (server_pid_ > 0) {
      kill(server_pid_, SIGKILL);
      waitpid(server_pid_, nullptr, 0);
    }
    nftw(base_.c_str(), remove_one, 16, FTW_DEPTH | FTW_PHYS);
    EXPECT_EQ(fd_count(), fds_before_) << "descriptors leaked in the test process";
  }

  // Fork the server; it exits 0 after SIGTERM only if it drained cleanly and
  // holds no more descriptors than before it started.
  void start_server(uint32_t heartbeat_timeout_ms) {
    server_pid_ = fork();
    ASSERT_GE(server_pid_, 0);
    if (server_pid_ == 0) {
      int before = fd_count();
      kvf_server_options o = KVF_SERVER_OPTIONS_INIT;
      o.socket_dir = dir_.c_str();
      o.heartbeat_timeout_ms = heartbeat_timeout_ms;
      if (kvf_server_create(&o, &g_child_server) != KVF_SUCCESS) _exit(2);
      signal(SIGTERM, child_on_term);
      kvf_status st = kvf_server_run(g_child_server);
      kvf_registry_stats s = KVF_REGISTRY_STATS_INIT;
      kvf_server_stats(g_child_server, &s);
      kvf_server_destroy(g_child_server);
      if (st != KVF_SUCCESS) _exit(3);
      if (s.imports != 0 || s.aliases != 0 || s.active != 0) _exit(4);
      if (fd_count() != before) _exit(5);
      _exit(0);
    }
    // Ready once the socket accepts.
    if (!kvf_server_test::wait_until_accepting(dir_)) FAIL() << "the server did not start";
  }

  void stop_server_expect_clean() {
    kvf_server_test::stop_expect_clean(server_pid_, "2 create, 3 run, 4 still mapped, 5 descriptors leaked");
  }

  Engine &start_engine() {
    int ready[2], control[2];
    EXPECT_EQ(pipe(ready), 0);
    EXPECT_EQ(pipe(control), 0);
    pid_t pid = fork();
    if (pid == 0) {
      close(ready[0]);
      close(control[1]);
      engine_main(dir_, ready[1], control[0], size_);
    }
    close(ready[1]);
    close(control[0]);
    char b = 0;
    struct pollfd p = {ready[0], POLLIN, 0};
    EXPECT_EQ(poll(&p, 1, 10000), 1);
    EXPECT_EQ(read(ready[0], &b, 1), 1) << "the engine failed before registering";
    close(ready[0]);
    engines_.push_back(Engine{pid, control[1]});
    return engines_.back();
  }

  // Tell an engine to unregister and exit; its exit status must be 0.
  void finish_engine(Engine &e) {
    char q = 'q';
    ASSERT_EQ(write(e.control, &q, 1), 1);
    int status = 0;
    ASSERT_EQ(waitpid(e.pid, &status, 0), e.pid);
    e.pid = -1;
    close(e.control);
    e.control = -1;
    ASSERT_TRUE(WIFEXITED(status));
    EXPECT_EQ(WEXITSTATUS(status), 0) << "10+: the engine step that failed";
  }

  // STAT over a fresh connection (a connection kept silent would be reaped).
  kvf_client_stats stat_now() {
    kvf_client_stats s = KVF_CLIENT_STATS_INIT;  // all counters 0
    kvf_client_options o = KVF_CLIENT_OPTIONS_INIT;
    o.socket_dir = dir_.c_str();
    kvf_client *c = nullptr;
    EXPECT_EQ(kvf_client_connect(&o, &c, nullptr), KVF_SUCCESS) << kvf_last_error();
    if (!c) return s;
    EXPECT_EQ(kvf_client_stat(c, &s), KVF_SUCCESS) << kvf_last_error();
    kvf_client_disconnect(c);
    return s;
  }

  // Wait up to ms for imports to reach `imports`; the last STAT.
  kvf_client_stats wait_imports(uint64_t imports, int ms) {
    kvf_client_stats s = stat_now();
    for (int waited = 0; s.imports != imports && waited < ms; waited += 20) {
      sleep_ms(20);
      s = stat_now();
    }
    return s;
  }

  // Send raw bytes on a new connection; return the ERROR it gets back.
  kvf_proto_error raw_error(const uint8_t *bytes, size_t len) {
    kvf_proto_error e;
    memset(&e, 0, sizeof(e));
    kvf_conn c;
    EXPECT_EQ(kvf_endpoint_connect(dir_.c_str(), 0, &c), KVF_SUCCESS);
    EXPECT_EQ(write(c.fd, bytes, len), (ssize_t)len);
    kvf_proto_header h;
    uint8_t *payload = nullptr;
    int fds[4];
    uint32_t nfds = 0;
    EXPECT_EQ(kvf_conn_read_frame(&c, 5000, &h, &payload, fds, 4, &nfds), KVF_SUCCESS) << kvf_last_error();
    kvf_proto_msg m;
    if (kvf_proto_decode(&h, payload, &m) == KVF_SUCCESS) {
      EXPECT_EQ(m.type, KVF_PROTO_ERROR);
      if (m.type == KVF_PROTO_ERROR) e = m.u.error;
      kvf_proto_msg_clear(&m);
    } else {
      ADD_FAILURE() << "the reply did not decode: " << kvf_last_error();
    }
    free(payload);
    // Then the server hangs up.
    EXPECT_EQ(kvf_conn_read_frame(&c, 5000, &h, &payload, fds, 4, &nfds), KVF_ERR_DISCONNECTED);
    kvf_conn_close(&c);
    return e;
  }

  std::string base_, dir_;
  uint64_t size_ = 0;
  int fds_before_ = 0;
  pid_t server_pid_ = -1;
  std::vector<Engine> engines_;
};

TEST_F(Server, RegisterUnregisterRoundTrip) {
  start_server(5000);
  kvf_client_options o = KVF_CLIENT_OPTIONS_INIT;
  o.socket_dir = dir_.c_str();
  kvf_client *c = nullptr;
  kvf_client_info info = KVF_CLIENT_INFO_INIT;
  ASSERT_EQ(kvf_client_connect(&o, &c, &info), KVF_SUCCESS) << kvf_last_error();
  EXPECT_NE(info.boot_token, 0u);
  EXPECT_EQ(info.heartbeat_timeout_ms, 5000u);
  EXPECT_EQ(info.server_pid, (uint32_t)server_pid_);
  uint64_t token = 0;
  ASSERT_EQ(kvf_client_heartbeat(c, &token), KVF_SUCCESS);
  EXPECT_EQ(token, info.boot_token);

  kvf_mem_alloc_options ao = KVF_MEM_ALLOC_OPTIONS_INIT;
  ao.size = 2 * size_;
  kvf_mem_alloc *a = nullptr;
  ASSERT_EQ(kvf_mem_alloc_create(&ao, &a), KVF_SUCCESS);
  kvf_client_region regs[2] = {{a, 0, size_}, {a, size_, size_}};
  kvf_client_registration r = KVF_CLIENT_REGISTRATION_INIT;
  ASSERT_EQ(kvf_client_register(c, kTinyGeometry, strlen(kTinyGeometry), -1, regs, 2, &r), KVF_SUCCESS)
      << kvf_last_error();
  EXPECT_NE(r.registration_id, 0u);
  EXPECT_NE(r.fingerprint, 0u);
  EXPECT_EQ(r.imports, 1u);
  EXPECT_EQ(r.aliases, 2u);
  kvf_client_stats s = stat_now();
  EXPECT_EQ(s.active, 1u);
  EXPECT_EQ(s.imports, 1u);
  EXPECT_EQ(s.aliases, 2u);
  EXPECT_EQ(s.boot_token, info.boot_token);

  // A registration that fails its checks leaves the live one serving.
  kvf_client_region short_regs[2] = {{a, 0, size_ - 1}, {a, size_, size_}};
  EXPECT_EQ(kvf_client_register(c, kTinyGeometry, strlen(kTinyGeometry), -1, short_regs, 2, nullptr),
            KVF_ERR_INVALID_ARGUMENT);
  EXPECT_NE(strstr(kvf_last_error(), "payload.regions[0].length"), nullptr) << kvf_last_error();
  EXPECT_EQ(kvf_client_register(c, "{", 1, -1, regs, 2, nullptr), KVF_ERR_PARSE);
  EXPECT_NE(strstr(kvf_last_error(), "payload.geometry_json"), nullptr) << kvf_last_error();
  EXPECT_EQ(kvf_client_register(c, kTinyGeometry, strlen(kTinyGeometry), -1, regs, 1, nullptr),
            KVF_ERR_INVALID_ARGUMENT);
  EXPECT_NE(strstr(kvf_last_error(), "payload.num_regions"), nullptr) << kvf_last_error();
  s = stat_now();
  EXPECT_EQ(s.active, 1u);
  EXPECT_EQ(s.imports, 1u);
  EXPECT_EQ(s.aliases, 2u);

  // Registering again replaces it; the old one is unmapped (same memory: one import).
  kvf_client_registration r2 = KVF_CLIENT_REGISTRATION_INIT;
  ASSERT_EQ(kvf_client_register(c, kTinyGeometry, strlen(kTinyGeometry), -1, regs, 2, &r2), KVF_SUCCESS);
  EXPECT_GT(r2.registration_id, r.registration_id);
  EXPECT_EQ(r2.fingerprint, r.fingerprint);
  s = stat_now();
  EXPECT_EQ(s.active, 1u);
  EXPECT_EQ(s.imports, 1u);
  EXPECT_EQ(s.aliases, 2u);

  uint32_t state = 0;
  ASSERT_EQ(kvf_client_unregister(c, 0, &state), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(state, (uint32_t)KVF_PROTO_REG_CLOSED);
  ASSERT_EQ(kvf_client_unregister(c, r2.registration_id, &state), KVF_SUCCESS) << "idempotent";
  EXPECT_EQ(state, (uint32_t)KVF_PROTO_REG_CLOSED);
  s = stat_now();
  EXPECT_EQ(s.active, 0u);
  EXPECT_EQ(s.imports, 0u);
  EXPECT_EQ(s.aliases, 0u);
  kvf_client_disconnect(c);
  kvf_mem_alloc_destroy(a);
  stop_server_expect_clean();
}

TEST_F(Server, KilledAndSilentEnginesAreReapedOthersKeepServing) {
  const uint32_t timeout_ms = 400;
  start_server(timeout_ms);
  start_engine();
  start_engine();
  start_engine();
  kvf_client_stats s = stat_now();
  EXPECT_EQ(s.active, 3u);
  EXPECT_EQ(s.imports, 3u);
  EXPECT_EQ(s.aliases, 6u);

  // SIGKILL: the connection closes and the client is drained at once.
  ASSERT_EQ(kill(engines_[1].pid, SIGKILL), 0);
  waitpid(engines_[1].pid, nullptr, 0);
  engines_[1].pid = -1;
  s = wait_imports(2, (int)timeout_ms);
  EXPECT_EQ(s.imports, 2u);
  EXPECT_EQ(s.aliases, 4u);
  EXPECT_EQ(s.active, 2u);

  // SIGSTOP: the connection stays open but silent; reaped after the timeout.
  ASSERT_EQ(kill(engines_[2].pid, SIGSTOP), 0);
  s = wait_imports(1, 3 * (int)timeout_ms);
  EXPECT_EQ(s.imports, 1u);
  EXPECT_EQ(s.aliases, 2u);
  EXPECT_EQ(s.active, 1u);

  // The survivor still serves: it unregisters cleanly (heartbeats all along).
  finish_engine(engines_[0]);
  s = stat_now();
  EXPECT_EQ(s.imports, 0u);
  EXPECT_EQ(s.aliases, 0u);
  EXPECT_EQ(s.active, 0u);
  stop_server_expect_clean();
}

TEST_F(Server, GarbageAndVersionMismatchAreRefusedOthersUnaffected) {
  start_server(2000);
  start_engine();

  // A frame with a wrong magic.
  uint8_t garbage[KVF_PROTO_HEADER_SIZE];
  memset(garbage, 0xAB, sizeof(garbage));
  kvf_proto_error e = raw_error(garbage, sizeof(garbage));
  EXPECT_EQ(e.status, (uint32_t)KVF_ERR_PROTOCOL);
  EXPECT_STREQ(e.field, "header.magic");

  // A HELLO whose header speaks protocol version 1 (8-byte keys, no
  // shard): both versions named.
  kvf_proto_msg hello;
  memset(&hello, 0, sizeof(hello));
  hello.type = KVF_PROTO_HELLO;
  hello.request_id = 7;
  hello.u.hello.min_version = 1;
  hello.u.hello.max_version = 1;
  hello.u.hello.instance_id = 1;
  uint8_t *frame = nullptr;
  size_t len = 0;
  ASSERT_EQ(kvf_proto_encode(&hello, &frame, &len), KVF_SUCCESS);
  frame[4] = 1; /* version, little-endian u16 at offset 4 */
  e = raw_error(frame, len);
  EXPECT_EQ(e.status, (uint32_t)KVF_ERR_PROTOCOL);
  EXPECT_STREQ(e.field, "header.version");
  EXPECT_NE(strstr(e.message, "peer speaks protocol version 1, this side speaks 2"), nullptr) << e.message;
  free(frame);

  // A HELLO in a version-2 frame that speaks only version 1.
  ASSERT_EQ(kvf_proto_encode(&hello, &frame, &len), KVF_SUCCESS);
  e = raw_error(frame, len);
  EXPECT_EQ(e.status, (uint32_t)KVF_ERR_PROTOCOL);
  EXPECT_STREQ(e.field, "payload.max_version");
  EXPECT_NE(strstr(e.message, "client speaks protocol versions 1..1, this side speaks 2..2"), nullptr) << e.message;
  free(frame);

  // A HELLO that asks for versions 3..4 only.
  hello.u.hello.min_version = 3;
  hello.u.hello.max_version = 4;
  ASSERT_EQ(kvf_proto_encode(&hello, &frame, &len), KVF_SUCCESS);
  e = raw_error(frame, len);
  EXPECT_EQ(e.status, (uint32_t)KVF_ERR_PROTOCOL);
  EXPECT_STREQ(e.field, "payload.max_version");
  EXPECT_NE(strstr(e.message, "3..4"), nullptr) << e.message;
  EXPECT_NE(strstr(e.message, "2..2"), nullptr) << e.message;
  free(frame);

  // A HELLO header with a payload cut short (the payload is garbage).
  hello.u.hello.min_version = 1;
  hello.u.hello.max_version = 1;
  ASSERT_EQ(kvf_proto_encode(&hello, &frame, &len), KVF_SUCCESS);
  uint8_t bad[KVF_PROTO_HEADER_SIZE + 3];
  memcpy(bad, frame, KVF_PROTO_HEADER_SIZE);
  bad[16] = 3; /* payload_len = 3 */
  bad[17] = bad[18] = bad[19] = 0;
  memset(bad + KVF_PROTO_HEADER_SIZE, 0xFF, 3);
  free(frame);
  e = raw_error(bad, sizeof(bad));
  EXPECT_EQ(e.status, (uint32_t)KVF_ERR_PROTOCOL);
  EXPECT_EQ(strncmp(e.field, "payload", 7), 0) << e.field << ": " << e.message;

  // A request before HELLO.
  kvf_proto_msg hb;
  memset(&hb, 0, sizeof(hb));
  hb.type = KVF_PROTO_HEARTBEAT;
  ASSERT_EQ(kvf_proto_encode(&hb, &frame, &len), KVF_SUCCESS);
  e = raw_error(frame, len);
  EXPECT_STREQ(e.field, "header.type");
  free(frame);

  // The engine kept its registration and its heartbeats worked all along.
  kvf_client_stats s = stat_now();
  EXPECT_EQ(s.active, 1u);
  EXPECT_EQ(s.imports, 1u);
  finish_engine(engines_[0]);
  stop_server_expect_clean();
}

// A client that pipelines requests and never reads the replies must not
// stall the server: others are served at once, and the silent reader is
// dropped after the write timeout (2000 ms by default).
TEST_F(Server, AClientThatDoesNotReadRepliesStallsNoOne) {
  start_server(10000);
  kvf_conn flood;
  ASSERT_EQ(kvf_endpoint_connect(dir_.c_str(), 0, &flood), KVF_SUCCESS);
  std::vector<uint8_t> bytes;
  auto append = [&bytes](const kvf_proto_msg &m) {
    uint8_t *f = nullptr;
    size_t n = 0;
    ASSERT_EQ(kvf_proto_encode(&m, &f, &n), KVF_SUCCESS);
    bytes.insert(bytes.end(), f, f + n);
    free(f);
  };
  kvf_proto_msg m;
  memset(&m, 0, sizeof(m));
  m.type = KVF_PROTO_HELLO;
  m.request_id = 1;
  m.u.hello.min_version = m.u.hello.max_version = KVF_PROTO_VERSION;
  m.u.hello.instance_id = 1;
  append(m);
  memset(&m, 0, sizeof(m));
  m.type = KVF_PROTO_STAT;
  for (int i = 0; i < 40000; i++) {
    m.request_id = 2 + (uint64_t)i;
    append(m);
  }
  // Write what the socket takes without blocking: replies pile up unread.
  size_t off = 0;
  int flags = fcntl(flood.fd, F_GETFL);
  ASSERT_EQ(fcntl(flood.fd, F_SETFL, flags | O_NONBLOCK), 0);
  for (int round = 0; round < 200 && off < bytes.size(); round++) {
    ssize_t n = write(flood.fd, bytes.data() + off, bytes.size() - off);
    if (n > 0) off += (size_t)n;
    else sleep_ms(5);
  }
  EXPECT_GT(off, bytes.size() / 4) << "the server stopped reading requests";
  // Another client is served promptly, again and again, meanwhile.
  for (int i = 0; i < 5; i++) {
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    kvf_client_stats st = stat_now();
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double ms = (double)(t1.tv_sec - t0.tv_sec) * 1e3 + (double)(t1.tv_nsec - t0.tv_nsec) / 1e6;
    EXPECT_LT(ms, 500.0 * kvf_server_test::kTimingScale) << "a STAT waited behind the client that does not read";
    EXPECT_NE(st.boot_token, 0u);
    sleep_ms(100);
  }
  // The silent reader is dropped: reading now gets the queued replies, then EOF.
  ASSERT_EQ(fcntl(flood.fd, F_SETFL, flags), 0);
  sleep_ms(2600);
  std::vector<uint8_t> sink(1 << 16);
  int eof = 0;
  for (int i = 0; i < 100000 && !eof; i++) {
    struct pollfd p = {flood.fd, POLLIN, 0};
    if (poll(&p, 1, 5000) != 1) break;
    ssize_t n = read(flood.fd, sink.data(), sink.size());
    if (n <= 0) eof = 1;
  }
  EXPECT_TRUE(eof) << "the server kept a client that did not read its replies";
  kvf_conn_close(&flood);
  stop_server_expect_clean();
}

// STAT per client: each connection's registrations and mappings by itself.
TEST_F(Server, StatListsEveryClientWithItsOwnCounters) {
  start_server(10000);
  Engine &e = start_engine();
  kvf_client_options o = KVF_CLIENT_OPTIONS_INIT;
  o.socket_dir = dir_.c_str();
  o.name = "observer";
  kvf_client *c = nullptr;
  ASSERT_EQ(kvf_client_connect(&o, &c, nullptr), KVF_SUCCESS) << kvf_last_error();
  kvf_client_stats total = KVF_CLIENT_STATS_INIT;
  kvf_client_stat_record rec[8];
  uint32_t n = 0;
  ASSERT_EQ(kvf_client_stat_clients(c, &total, rec, 8, &n), KVF_SUCCESS) << kvf_last_error();
  ASSERT_EQ(n, 2u);
  int engines = 0, observers = 0;
  for (uint32_t i = 0; i < n; i++) {
    if (!strcmp(rec[i].name, "engine")) {
      engines++;
      EXPECT_EQ(rec[i].pid, (uint32_t)e.pid);
      EXPECT_EQ(rec[i].active, 1u);
      EXPECT_EQ(rec[i].imports, 1u);
      EXPECT_EQ(rec[i].aliases, 2u);
    } else if (!strcmp(rec[i].name, "observer")) {
      observers++;
      EXPECT_EQ(rec[i].pid, (uint32_t)getpid());
      EXPECT_EQ(rec[i].active, 0u);
      EXPECT_EQ(rec[i].imports, 0u);
    }
  }
  EXPECT_EQ(engines, 1);
  EXPECT_EQ(observers, 1);
  EXPECT_EQ(total.imports, 1u);
  EXPECT_EQ(total.aliases, 2u);
  // A capacity smaller than the count: the count still says how many there are.
  ASSERT_EQ(kvf_client_stat_clients(c, nullptr, rec, 1, &n), KVF_SUCCESS);
  EXPECT_EQ(n, 2u);
  EXPECT_EQ(kvf_client_stat_clients(c, nullptr, nullptr, 1, &n), KVF_ERR_INVALID_ARGUMENT);
  kvf_client_disconnect(c);
  finish_engine(e);
  stop_server_expect_clean();
}

TEST_F(Server, SecondServerOnTheSameDirectoryIsRefused) {
  start_server(2000);
  kvf_server_options o = KVF_SERVER_OPTIONS_INIT;
  o.socket_dir = dir_.c_str();
  kvf_server *s = nullptr;
  EXPECT_EQ(kvf_server_create(&o, &s), KVF_ERR_BUSY);
  EXPECT_EQ(s, nullptr);
  EXPECT_NE(strstr(kvf_last_error(), std::to_string(server_pid_).c_str()), nullptr) << kvf_last_error();
  stop_server_expect_clean();
  // Once it is gone the directory can be served again, in this process.
  ASSERT_EQ(kvf_server_create(&o, &s), KVF_SUCCESS) << kvf_last_error();
  kvf_server_destroy(s);
}

TEST_F(Server, ManyRegisterCyclesLeaveNothingBehind) {
  start_server(5000);
  kvf_mem_alloc_options ao = KVF_MEM_ALLOC_OPTIONS_INIT;
  ao.size = 2 * size_;
  kvf_mem_alloc *a = nullptr;
  ASSERT_EQ(kvf_mem_alloc_create(&ao, &a), KVF_SUCCESS);
  kvf_client_region regs[2] = {{a, 0, size_}, {a, size_, size_}};
  int fds_start = fd_count();
  for (int i = 0; i < 200; i++) {
    kvf_client_options o = KVF_CLIENT_OPTIONS_INIT;
    o.socket_dir = dir_.c_str();
    kvf_client *c = nullptr;
    ASSERT_EQ(kvf_client_connect(&o, &c, nullptr), KVF_SUCCESS) << kvf_last_error();
    ASSERT_EQ(kvf_client_register(c, kTinyGeometry, strlen(kTinyGeometry), -1, regs, 2, nullptr), KVF_SUCCESS)
        << kvf_last_error();
    if (i % 2 == 0) {  // odd cycles: the disconnect drains it
      ASSERT_EQ(kvf_client_unregister(c, 0, nullptr), KVF_SUCCESS);
    }
    kvf_client_disconnect(c);
  }
  EXPECT_EQ(fd_count(), fds_start);
  kvf_client_stats s = wait_imports(0, 2000);
  EXPECT_EQ(s.imports, 0u);
  EXPECT_EQ(s.aliases, 0u);
  EXPECT_EQ(s.active, 0u);
  EXPECT_EQ(s.closed_total, 200u);
  kvf_mem_alloc_destroy(a);
  stop_server_expect_clean();  // the server checks its own descriptor count
}

// ---- keys are scoped by geometry and shard -------------------------------------

// An engine in this process: the tiny geometry (or `json`) in one host
// allocation filled with `fill`, registered as shard_index of shard_count.
struct ScopedEngine {
  kvf_client *c = nullptr;
  kvf_mem_alloc *a = nullptr;
  uint64_t size = 0; /* of one region */
  ScopedEngine(const ScopedEngine &) = delete;
  ScopedEngine &operator=(const ScopedEngine &) = delete;
  ScopedEngine(const std::string &dir, const std::string &json, uint32_t shard_index, uint32_t shard_count,
               uint8_t fill, uint64_t region) {
    size = region;
    kvf_client_options o = KVF_CLIENT_OPTIONS_INIT;
    o.socket_dir = dir.c_str();
    EXPECT_EQ(kvf_client_connect(&o, &c, nullptr), KVF_SUCCESS) << kvf_last_error();
    kvf_mem_alloc_options ao = KVF_MEM_ALLOC_OPTIONS_INIT;
    ao.size = 2 * size;
    EXPECT_EQ(kvf_mem_alloc_create(&ao, &a), KVF_SUCCESS) << kvf_last_error();
    if (!c || !a) return;
    uint8_t *p = static_cast<uint8_t *>(kvf_mem_alloc_ptr(a));
    for (uint64_t i = 0; i < 2 * size; i++) p[i] = (uint8_t)(fill + i * 7 + (i >> 8));
    kvf_client_region regs[2] = {{a, 0, size}, {a, size, size}};
    struct kvf_client_register_desc d = KVF_CLIENT_REGISTER_DESC_INIT;
    d.geometry_json = json.data();
    d.geometry_len = json.size();
    d.regions = regs;
    d.num_regions = 2;
    d.shard_index = shard_index;
    d.shard_count = shard_count;
    EXPECT_EQ(kvf_client_register_desc(c, &d, nullptr), KVF_SUCCESS) << kvf_last_error();
  }
  ~ScopedEngine() {
    if (c) {
      EXPECT_EQ(kvf_client_unregister(c, 0, nullptr), KVF_SUCCESS) << kvf_last_error();
    }
    kvf_client_disconnect(c);
    kvf_mem_alloc_destroy(a);
  }
  const uint8_t *bytes() const { return static_cast<const uint8_t *>(kvf_mem_alloc_ptr(a)); }
  std::vector<uint8_t> copy() const { return std::vector<uint8_t>(bytes(), bytes() + 2 * size); }
  // STORE or RETRIEVE tokens [0, 64) (4 chunks) through blocks 0..3.
  kvf_client_result xfer(kvf_client_op op, const std::vector<kvf_chunk_key> &keys) {
    uint32_t ids[4] = {0, 1, 2, 3};
    kvf_group_blocks g = {ids, 0, 4};
    kvf_client_xfer x = KVF_CLIENT_XFER_INIT;
    x.token_begin = 0;
    x.token_end = 64;
    x.chunk_keys = keys.data();
    x.num_chunk_keys = (uint32_t)keys.size();
    x.groups = &g;
    x.num_groups = 1;
    kvf_client_result r = KVF_CLIENT_RESULT_INIT;
    kvf_status st = op == KVF_CLIENT_STORE ? kvf_client_store(c, &x, &r) : kvf_client_retrieve(c, &x, &r);
    EXPECT_EQ(st, KVF_SUCCESS) << kvf_last_error();
    return r;
  }
};

// The same keys from a registration of another geometry (another canonical
// fingerprint: other head bytes) or another shard find nothing, and storing
// them there never touches what the first registration stored; the same
// geometry and shard are served what was stored, byte for byte.
TEST_F(Server, KeysAreServedOnlyToTheirGeometryAndShard) {
  start_server(5000);
  const std::string tiny = kTinyGeometry, other = [&] {
    std::string j = kTinyGeometry;
    size_t at = j.find("\"head_bytes\": 128");
    EXPECT_NE(at, std::string::npos);
    return j.replace(at, 17, "\"head_bytes\": 64");
  }();
  std::vector<uint32_t> tokens(64);
  for (uint32_t i = 0; i < 64; i++) tokens[i] = 1000 + i * 13;
  kvf_chunk_key seed;
  ASSERT_EQ(kvf_chunk_seed("tiny-model", 10, &seed), KVF_SUCCESS);
  std::vector<kvf_chunk_key> keys(4);
  ASSERT_EQ(kvf_chunk_keys(&seed, tokens.data(), 4, 64, 16, keys.data()), 4u);

  ScopedEngine writer(dir_, tiny, 0, 1, 0x11, size_);
  kvf_client_result r = writer.xfer(KVF_CLIENT_STORE, keys);
  EXPECT_EQ(r.prefix_tokens, 64u);
  EXPECT_EQ(r.objects_done, 4u);
  const std::vector<uint8_t> stored = writer.copy();

  struct Miss {
    const char *what;
    const std::string *json;
    uint32_t index, count;
    uint32_t head_bytes; /* of every 128-byte token row */
  } misses[] = {{"another geometry", &other, 0, 1, 64},
                {"shard 1 of 2", &tiny, 1, 2, 128},
                {"shard 0 of 2", &tiny, 0, 2, 128}};
  for (const Miss &m : misses) {
    SCOPED_TRACE(m.what);
    ScopedEngine e(dir_, *m.json, m.index, m.count, 0x77, size_);
    const std::vector<uint8_t> before = e.copy();
    r = e.xfer(KVF_CLIENT_RETRIEVE, keys);
    EXPECT_EQ(r.prefix_tokens, 0u) << "served another scope's objects";
    EXPECT_EQ(r.objects_done, 0u);
    EXPECT_EQ(r.bytes_done, 0u);
    EXPECT_TRUE(e.copy() == before) << "a miss wrote the cache";
    // Its own STORE of the same keys writes objects of its own: none of the
    // writer's is "already present".
    r = e.xfer(KVF_CLIENT_STORE, keys);
    EXPECT_EQ(r.objects_present, 0u);
    EXPECT_EQ(r.objects_done, 4u);
    ScopedEngine twin(dir_, *m.json, m.index, m.count, 0x33, size_);
    r = twin.xfer(KVF_CLIENT_RETRIEVE, keys);
    EXPECT_EQ(r.prefix_tokens, 64u);
    const std::vector<uint8_t> got = twin.copy();
    size_t wrong = 0;
    for (size_t i = 0; i < got.size(); i++) wrong += i % 128 < m.head_bytes && got[i] != before[i];
    EXPECT_EQ(wrong, 0u) << "its own scope serves what it stored";
  }

  // The writer's geometry and shard: served, byte for byte, unchanged by the
  // other scopes' stores.
  ScopedEngine reader(dir_, tiny, 0, 1, 0x55, size_);
  r = reader.xfer(KVF_CLIENT_RETRIEVE, keys);
  EXPECT_EQ(r.prefix_tokens, 64u);
  EXPECT_EQ(r.objects_done, 4u);
  EXPECT_TRUE(reader.copy() == stored) << "the same geometry and shard must be served the writer's bytes";
  kvf_client_stats s = stat_now();
  EXPECT_EQ(s.l1_objects, 16u) << "four scopes, four objects each";

  // A shard outside its count is refused before anything is sent.
  kvf_client_options o = KVF_CLIENT_OPTIONS_INIT;
  o.socket_dir = dir_.c_str();
  kvf_client *c = nullptr;
  ASSERT_EQ(kvf_client_connect(&o, &c, nullptr), KVF_SUCCESS) << kvf_last_error();
  kvf_client_region regs[2] = {{writer.a, 0, size_}, {writer.a, size_, size_}};
  struct kvf_client_register_desc d = KVF_CLIENT_REGISTER_DESC_INIT;
  d.geometry_json = kTinyGeometry;
  d.geometry_len = strlen(kTinyGeometry);
  d.regions = regs;
  d.num_regions = 2;
  d.shard_index = 2;
  d.shard_count = 2;
  EXPECT_EQ(kvf_client_register_desc(c, &d, nullptr), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_NE(strstr(kvf_last_error(), "desc.shard_index: 2 is not below shard_count 2"), nullptr) << kvf_last_error();
  d.shard_index = 0;
  d.shard_count = KVF_CLIENT_MAX_SHARDS + 1;
  EXPECT_EQ(kvf_client_register_desc(c, &d, nullptr), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_NE(strstr(kvf_last_error(), "desc.shard_count"), nullptr) << kvf_last_error();
  kvf_client_disconnect(c);
}

TEST_F(Server, ConnectWithoutServerSaysSo) {
  kvf_client_options o = KVF_CLIENT_OPTIONS_INIT;
  o.socket_dir = dir_.c_str();
  kvf_client *c = nullptr;
  EXPECT_EQ(kvf_client_connect(&o, &c, nullptr), KVF_ERR_NOT_FOUND);
  EXPECT_EQ(c, nullptr);
}

}  // namespace
