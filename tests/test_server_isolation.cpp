// One client of kvferryd can never stall it for the others, write into
// another client's memory, or exhaust the server (issue 12), tried as a
// hostile client would: real processes, raw frames with real descriptors
// over the real socket, the server in a forked process as kvferryd runs.
//
//   - a REGISTER whose geometry is as expensive to check as one can make
//     it: a heartbeating engine keeps its latency under 50 ms throughout,
//     and a STAT on a new connection is answered meanwhile;
//   - a REGISTER naming another client's allocation identity, with a pipe
//     or with a memfd of its own: refused naming the field, and the owner's
//     memory is never written;
//   - REGISTERs claiming sparse allocations until the address space is
//     full: refused by the mapped-bytes quotas, and an engine still
//     registers;
//   - STOREs and RETRIEVEs whose numbers sit at the top of the 64-bit
//     range (tokens, block ids): refused naming the field within a second,
//     where the block arithmetic used to wrap and spin the loop forever;
//   - a STORE or RETRIEVE of 2^40 one-token blocks naming one of them:
//     answered within a second (admission walks the table, not the range);
//   - HELLO names that are not UTF-8: refused naming payload.name; and a
//     name that is an escape sequence reaches `kvferry stat`'s terminal
//     output escaped;
//   - a REGISTER region past its allocation (or whose end wraps 64 bits):
//     refused naming payload.regions[i].length, and the connection stays.
// Each test ends with the server's descriptors and memfd mappings back at
// their count before the attack and a clean stop.
#include <gtest/gtest.h>

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <jansson.h>

#include <kvferry/client.h>
#include <kvferry/geometry.h>
#include <kvferry/memory.h>

#include "chunk_key_util.h"
#include "host/ipc/endpoint.h"
#include "host/ipc/protocol.h"
#include "host/server/server.h"

#include "mem_test_util.h"
#include "server_test_util.h"

namespace {

using kvf_mem_test::fd_count;
using kvf_server_test::kTimingScale;
using kvf_server_test::kTinyGeometry;

// ---- processes, pipes, /proc --------------------------------------------------

int64_t mono_us() {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}
int64_t mono_ms() { return mono_us() / 1000; }

void sleep_ms(int64_t ms) {
  if (ms <= 0) return;
  struct timespec ts = {(time_t)(ms / 1000), (long)(ms % 1000) * 1000000L};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
  }
}

int remove_one(const char *path, const struct stat *, int, struct FTW *) { return remove(path); }

pid_t fork_clean() {
  std::fflush(nullptr);
  return fork();
}

// A child's exit status, or 1000 + the signal that ended it; -1 if it is
// still running after timeout_ms.
int reap(pid_t pid, int timeout_ms) {
  int64_t deadline = mono_ms() + timeout_ms;
  for (;;) {
    int status = 0;
    pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid) return WIFEXITED(status) ? WEXITSTATUS(status) : 1000 + WTERMSIG(status);
    if (r < 0 && errno != EINTR) return -2;
    if (mono_ms() > deadline) return -1;
    sleep_ms(5);
  }
}

bool put(int fd, const void *p, size_t n) {
  const char *b = static_cast<const char *>(p);
  while (n > 0) {
    ssize_t w = write(fd, b, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    b += w;
    n -= (size_t)w;
  }
  return true;
}

// Read exactly n bytes within timeout_ms; false on timeout or end of file.
bool get(int fd, void *p, size_t n, int timeout_ms) {
  char *b = static_cast<char *>(p);
  int64_t deadline = mono_ms() + timeout_ms;
  while (n > 0) {
    struct pollfd pf = {fd, POLLIN, 0};
    int left = (int)std::max<int64_t>(0, deadline - mono_ms());
    int rc = poll(&pf, 1, left);
    if (rc < 0 && errno == EINTR) continue;
    if (rc <= 0) return false;
    ssize_t r = read(fd, b, n);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    b += r;
    n -= (size_t)r;
  }
  return true;
}

int proc_entries(const std::string &path) {
  DIR *d = opendir(path.c_str());
  if (d == nullptr) return -1;
  int n = 0;
  while (struct dirent *e = readdir(d))
    if (e->d_name[0] != '.') n++;
  closedir(d);
  return n;
}

// Mappings of memfds in a process (the host provider's imports).
int memfd_mappings(const std::string &maps_path) {
  std::ifstream f(maps_path);
  std::string line;
  int n = 0;
  while (std::getline(f, line))
    if (line.find("/memfd:") != std::string::npos) n++;
  return n;
}

// The count once it holds still for 60 ms.
int steady(const std::function<int()> &count) {
  int last = count(), same = 0;
  for (int i = 0; i < 250 && same < 3; i++) {
    sleep_ms(20);
    int now = count();
    same = now == last ? same + 1 : 0;
    last = now;
  }
  return last;
}

// ---- the server, in a process of its own ------------------------------------------

kvf_server *g_child_server;
void child_on_term(int) { kvf_server_stop(g_child_server); }

// Exit codes of the server process: 0 a clean stop with nothing left mapped
// and the descriptors and memfd mappings it started with.
constexpr const char *kServerCodes =
    "2 create, 3 run, 4 still mapped or registered, 5 descriptors leaked, 6 memfd mappings leaked";

struct ServerProcess {
  pid_t pid = -1;
  ~ServerProcess() { kill_now(); }
  bool start(const std::string &dir, uint32_t heartbeat_timeout_ms,
             const std::function<void(kvf_server_options &)> &tweak = nullptr) {
    pid = fork_clean();
    if (pid < 0) return false;
    if (pid == 0) {
      int fds = fd_count(), maps = memfd_mappings("/proc/self/maps");
      kvf_server_options o = KVF_SERVER_OPTIONS_INIT;
      o.socket_dir = dir.c_str();
      o.heartbeat_timeout_ms = heartbeat_timeout_ms;
      if (tweak) tweak(o);
      if (kvf_server_create(&o, &g_child_server) != KVF_SUCCESS) {
        std::fprintf(stderr, "server: %s\n", kvf_last_error());
        _exit(2);
      }
      signal(SIGTERM, child_on_term);
      signal(SIGPIPE, SIG_IGN);
      kvf_status st = kvf_server_run(g_child_server);
      kvf_registry_stats s = KVF_REGISTRY_STATS_INIT;
      kvf_server_stats(g_child_server, &s);
      kvf_server_destroy(g_child_server);
      if (st != KVF_SUCCESS) _exit(3);
      if (s.imports != 0 || s.aliases != 0 || s.active != 0 || s.draining != 0) _exit(4);
      if (fd_count() != fds) _exit(5);
      if (memfd_mappings("/proc/self/maps") != maps) _exit(6);
      _exit(0);
    }
    return kvf_server_test::wait_until_accepting(dir);
  }
  std::string proc(const char *what) const { return "/proc/" + std::to_string(pid) + "/" + what; }
  int fds() const { return steady([this] { return proc_entries(proc("fd")); }); }
  int memfd_maps() const { return steady([this] { return memfd_mappings(proc("maps")); }); }
  // SIGTERM and the exit status (see kServerCodes).
  int stop(int timeout_ms = 60000) {
    if (pid <= 0) return -1;
    kill(pid, SIGTERM);
    int st = reap(pid, timeout_ms);
    if (st != -1) pid = -1;
    return st;
  }
  void kill_now() {
    if (pid > 0) {
      kill(pid, SIGKILL);
      reap(pid, 10000);
      pid = -1;
    }
  }
};

// ---- raw frames ------------------------------------------------------------------

// A connection speaking frames directly, to send what the client library
// never would.
class RawConn {
 public:
  RawConn() = default;
  RawConn(const RawConn &) = delete;
  RawConn &operator=(const RawConn &) = delete;
  ~RawConn() { close(); }
  void close() {
    if (open_) kvf_conn_close(&conn_);
    open_ = false;
  }
  // Connect and say HELLO with this process's instance (or the one given).
  kvf_status open(const std::string &dir, uint64_t instance = 0, uint64_t generation = 0, const char *name = "") {
    kvf_status st = kvf_endpoint_connect(dir.c_str(), 0, &conn_);
    if (st != KVF_SUCCESS) return st;
    open_ = true;
    kvf_proto_msg m;
    std::memset(&m, 0, sizeof m);
    m.type = KVF_PROTO_HELLO;
    m.u.hello.min_version = m.u.hello.max_version = KVF_PROTO_VERSION;
    m.u.hello.pid = (uint32_t)getpid();
    kvf_mem_instance(&m.u.hello.instance_id, &m.u.hello.generation);
    if (instance) m.u.hello.instance_id = instance;
    if (generation) m.u.hello.generation = generation;
    std::snprintf(m.u.hello.name, sizeof m.u.hello.name, "%s", name);
    kvf_proto_msg reply;
    st = call(&m, nullptr, 0, &reply);
    if (st == KVF_SUCCESS && reply.type != KVF_PROTO_HELLO_REPLY) st = (kvf_status)reply.u.error.status;
    kvf_proto_msg_clear(&reply);
    return st;
  }
  // Send and read the reply (an ERROR is a reply too). The descriptors stay
  // the caller's.
  kvf_status call(kvf_proto_msg *m, const int *fds, uint32_t num_fds, kvf_proto_msg *reply, int timeout_ms = 60000) {
    std::memset(reply, 0, sizeof(*reply));
    m->request_id = next_++;
    kvf_status st = kvf_conn_send(&conn_, m, fds, num_fds, 10000);
    if (st != KVF_SUCCESS) return st;
    kvf_proto_header h;
    uint8_t *payload = nullptr;
    int rfds[4];
    uint32_t n = 0;
    st = kvf_conn_read_frame(&conn_, timeout_ms, &h, &payload, rfds, 4, &n);
    if (st != KVF_SUCCESS) return st;
    for (uint32_t i = 0; i < n; i++) ::close(rfds[i]);
    st = kvf_proto_decode(&h, payload, reply);
    std::free(payload);
    if (st == KVF_SUCCESS && reply->request_id != m->request_id) st = KVF_ERR_PROTOCOL;
    return st;
  }
  kvf_status simple(uint16_t type, kvf_proto_msg *reply) {
    kvf_proto_msg m;
    std::memset(&m, 0, sizeof m);
    m.type = type;
    return call(&m, nullptr, 0, reply);
  }
  kvf_conn *conn() { return &conn_; }

 private:
  kvf_conn conn_{};
  bool open_ = false;
  uint64_t next_ = 1;
};

// A region of a REGISTER frame for `id`, bytes [offset, offset + length),
// carried by descriptor fd_index.
kvf_proto_region region_of(const kvf_mem_identity &id, uint64_t offset, uint64_t length, uint32_t fd_index) {
  kvf_proto_region r;
  std::memset(&r, 0, sizeof r);
  r.instance_id = id.instance_id;
  r.allocation_id = id.allocation_id;
  r.generation = id.generation;
  r.size = id.size;
  std::memcpy(r.device_uuid, id.device_uuid, sizeof r.device_uuid);
  r.provider = id.provider;
  r.offset = offset;
  r.length = length;
  r.fd_index = fd_index;
  return r;
}

// REGISTER `json` with `regions` and `fds` on c; the reply in *reply.
kvf_status register_raw(RawConn &c, const std::string &json, std::vector<kvf_proto_region> regions,
                        const std::vector<int> &fds, kvf_proto_msg *reply) {
  std::vector<char> text(json.begin(), json.end());
  text.push_back('\0');
  kvf_proto_msg m;
  std::memset(&m, 0, sizeof m);
  m.type = KVF_PROTO_REGISTER;
  m.u.reg.device = -1;
  m.u.reg.shard_count = 1;
  m.u.reg.num_fds = (uint32_t)fds.size();
  m.u.reg.geometry_json = text.data();
  m.u.reg.geometry_json_len = (uint32_t)json.size();
  m.u.reg.regions = regions.data();
  m.u.reg.num_regions = (uint32_t)regions.size();
  return c.call(&m, fds.data(), (uint32_t)fds.size(), reply);
}

// "field: message" of an ERROR reply, or what the reply was instead.
std::string describe(const kvf_proto_msg &r) {
  if (r.type == KVF_PROTO_ERROR) return std::string(r.u.error.field) + ": " + r.u.error.message;
  char b[64];
  std::snprintf(b, sizeof b, "reply type 0x%04x", r.type);
  return b;
}

// The regions' sizes of a geometry text (0 on failure).
std::vector<uint64_t> region_sizes(const std::string &json) {
  std::vector<uint64_t> sizes;
  kvf_geometry *g = nullptr;
  if (kvf_geometry_load_buffer(json.data(), json.size(), nullptr, &g, nullptr) != KVF_SUCCESS) return sizes;
  for (uint32_t i = 0; i < kvf_geometry_num_regions(g); i++) {
    kvf_region_info info = KVF_REGION_INFO_INIT;
    sizes.push_back(kvf_geometry_region(g, i, &info) == KVF_SUCCESS ? info.size : 0);
  }
  kvf_geometry_destroy(g);
  return sizes;
}

uint64_t round_page(uint64_t n) {
  uint64_t p = (uint64_t)sysconf(_SC_PAGESIZE);
  return (n + p - 1) / p * p;
}

// ---- the heartbeating engine --------------------------------------------------

// What an engine says when it is told to stop.
struct EngineReport {
  int32_t status;       // of its registration (then of its last failed call)
  uint32_t heartbeats;  // answered
  uint32_t failures;    // heartbeats that failed
  double max_ms, mean_ms;
  uint64_t instance_id, allocation_id, generation, size;  // its allocation's identity
  char message[256];
};

// An engine: register the tiny geometry over one host allocation filled
// with `fill`, report (status, identity) on `report`, then heartbeat every
// 2 ms, timing each, until `control` gives a byte; then check that its
// memory still holds `fill` everywhere (status KVF_ERR_INTERNAL if not),
// unregister, report the figures and exit 0.
[[noreturn]] void engine_main(const std::string &dir, int control, int report, uint8_t fill) {
  EngineReport rep;
  std::memset(&rep, 0, sizeof rep);
  kvf_client_options o = KVF_CLIENT_OPTIONS_INIT;
  o.socket_dir = dir.c_str();
  o.name = "engine";
  kvf_client *c = nullptr;
  uint64_t size = region_sizes(kTinyGeometry).at(0);
  kvf_mem_alloc_options ao = KVF_MEM_ALLOC_OPTIONS_INIT;
  ao.size = 2 * size;
  kvf_mem_alloc *a = nullptr;
  kvf_status st = kvf_client_connect(&o, &c, nullptr);
  if (st == KVF_SUCCESS) st = kvf_mem_alloc_create(&ao, &a);
  if (st == KVF_SUCCESS) {
    std::memset(kvf_mem_alloc_ptr(a), fill, 2 * size);
    kvf_mem_identity id;
    kvf_mem_alloc_identity(a, &id);
    rep.instance_id = id.instance_id;
    rep.allocation_id = id.allocation_id;
    rep.generation = id.generation;
    rep.size = id.size;
    kvf_client_region regs[2] = {{a, 0, size}, {a, size, size}};
    st = kvf_client_register(c, kTinyGeometry, strlen(kTinyGeometry), -1, regs, 2, nullptr);
  }
  rep.status = st;
  if (st != KVF_SUCCESS) std::snprintf(rep.message, sizeof rep.message, "%s", kvf_last_error());
  if (!put(report, &rep, sizeof rep) || st != KVF_SUCCESS) _exit(10);
  double total = 0;
  for (;;) {
    struct pollfd p = {control, POLLIN, 0};
    if (poll(&p, 1, 2) != 0) break;
    int64_t t0 = mono_us();
    st = kvf_client_heartbeat(c, nullptr);
    double ms = (double)(mono_us() - t0) / 1000.0;
    if (st != KVF_SUCCESS) {
      if (rep.failures++ == 0) std::snprintf(rep.message, sizeof rep.message, "heartbeat: %s", kvf_last_error());
      rep.status = st;
      continue;
    }
    rep.heartbeats++;
    total += ms;
    rep.max_ms = std::max(rep.max_ms, ms);
  }
  rep.mean_ms = rep.heartbeats ? total / rep.heartbeats : 0;
  const uint8_t *mem = static_cast<const uint8_t *>(kvf_mem_alloc_ptr(a));
  for (uint64_t i = 0; i < 2 * size; i++)
    if (mem[i] != fill) {
      rep.status = KVF_ERR_INTERNAL;
      std::snprintf(rep.message, sizeof rep.message, "byte %" PRIu64 " of the engine's memory is 0x%02x, not 0x%02x",
                    i, mem[i], fill);
      break;
    }
  if (rep.failures == 0 && rep.status == KVF_SUCCESS) {
    uint32_t state = 0;
    st = kvf_client_unregister(c, 0, &state);
    if (st != KVF_SUCCESS) {
      rep.status = st;
      std::snprintf(rep.message, sizeof rep.message, "unregister: %s", kvf_last_error());
    }
  }
  kvf_client_disconnect(c);
  kvf_mem_alloc_destroy(a);
  put(report, &rep, sizeof rep);
  _exit(0);
}

struct Child {
  pid_t pid = -1;
  int control = -1, report = -1;
};

// ---- the fixture -------------------------------------------------------------------

class Isolation : public ::testing::Test {
 protected:
  void SetUp() override {
    signal(SIGPIPE, SIG_IGN);
    char tmpl[] = "/tmp/kvf-isolation-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    base_ = tmpl;
    dir_ = base_ + "/sock";
    fds_before_ = fd_count();
  }
  void TearDown() override {
    for (Child &c : children_) {
      if (c.pid > 0) {
        kill(c.pid, SIGKILL);
        reap(c.pid, 10000);
      }
      if (c.control >= 0) close(c.control);
      if (c.report >= 0) close(c.report);
    }
    server_.kill_now();
    nftw(base_.c_str(), remove_one, 16, FTW_DEPTH | FTW_PHYS);
    EXPECT_EQ(fd_count(), fds_before_) << "descriptors leaked in the test process";
  }

  // The kvferryd binary at `path` serving dir_, once it accepts connections
  // (killed in TearDown if the test fails first).
  void start_server_binary(const char *path) {
    pid_t d = fork_clean();
    ASSERT_GE(d, 0);
    if (d == 0) {
      execl(path, path, "--socket-dir", dir_.c_str(), "--log-level", "none", "--l1-mb", "64", (char *)nullptr);
      _exit(127);
    }
    server_.pid = d;
    bool up = false;
    for (int i = 0; i < 500 && !up; i++) {
      kvf_conn c;
      up = kvf_endpoint_connect(dir_.c_str(), 0, &c) == KVF_SUCCESS;
      if (up) kvf_conn_close(&c);
      if (!up) sleep_ms(10);
    }
    ASSERT_TRUE(up) << "kvferryd did not start";
  }

  // Fork `body(control, report)`: its exit status is its return value.
  Child &spawn(const std::function<int(int, int)> &body) {
    int ctl[2], rep[2];
    EXPECT_EQ(pipe(ctl), 0);
    EXPECT_EQ(pipe(rep), 0);
    pid_t pid = fork_clean();
    if (pid == 0) {
      close(ctl[1]);
      close(rep[0]);
      _exit(body(ctl[0], rep[1]));
    }
    close(ctl[0]);
    close(rep[1]);
    children_.push_back(Child{pid, ctl[1], rep[0]});
    return children_.back();
  }
  int finish(Child &c, int timeout_ms = 30000) {
    int st = reap(c.pid, timeout_ms);
    if (st != -1) c.pid = -1;
    return st;
  }

  // A heartbeating engine, registered (its first report checked).
  Child &start_engine(uint8_t fill, EngineReport *first) {
    Child &e = spawn([this, fill](int ctl, int rep) -> int { engine_main(dir_, ctl, rep, fill); });
    std::memset(first, 0, sizeof *first);
    EXPECT_TRUE(get(e.report, first, sizeof *first, 20000)) << "the engine did not report";
    EXPECT_EQ(first->status, KVF_SUCCESS) << first->message;
    return e;
  }
  // Tell an engine to stop; its final report.
  EngineReport stop_engine(Child &e) {
    EngineReport r;
    std::memset(&r, 0, sizeof r);
    r.status = -1;
    EXPECT_TRUE(put(e.control, "q", 1));
    EXPECT_TRUE(get(e.report, &r, sizeof r, 30000)) << "no final report from the engine";
    EXPECT_EQ(finish(e), 0);
    return r;
  }

  // After a refused REGISTER on conn: the connection still answers, and the
  // server holds no registration or import, and no descriptor or mapping
  // beyond the fds0 and maps0 it had before.
  void expect_nothing_kept(RawConn &conn, int fds0, int maps0) {
    kvf_proto_msg r;
    ASSERT_EQ(conn.simple(KVF_PROTO_HEARTBEAT, &r), KVF_SUCCESS) << "the connection must stay";
    EXPECT_EQ(r.type, KVF_PROTO_HEARTBEAT_REPLY);
    kvf_proto_msg_clear(&r);
    kvf_client_stats s = stat_now();
    EXPECT_EQ(s.active, 0u);
    EXPECT_EQ(s.imports, 0u);
    EXPECT_EQ(server_.fds(), fds0) << "the server kept the descriptor";
    EXPECT_EQ(server_.memfd_maps(), maps0) << "the server kept a mapping";
  }

  // STAT over a new connection: the totals, and how long it took.
  kvf_client_stats stat_now(double *ms = nullptr) {
    kvf_client_stats s = KVF_CLIENT_STATS_INIT;
    int64_t t0 = mono_us();
    kvf_client_options o = KVF_CLIENT_OPTIONS_INIT;
    o.socket_dir = dir_.c_str();
    kvf_client *c = nullptr;
    EXPECT_EQ(kvf_client_connect(&o, &c, nullptr), KVF_SUCCESS) << kvf_last_error();
    if (c) {
      EXPECT_EQ(kvf_client_stat(c, &s), KVF_SUCCESS) << kvf_last_error();
      kvf_client_disconnect(c);
    }
    if (ms) *ms = (double)(mono_us() - t0) / 1000.0;
    return s;
  }

  std::string base_, dir_;
  ServerProcess server_;
  std::deque<Child> children_;  // a deque: references stay valid as children are added
  int fds_before_ = 0;
};

// ---- 1. a REGISTER that is expensive to check ------------------------------------

// Geometries as expensive to validate as one can make them.
struct Heavy {
  const char *what;
  std::string json;
  uint64_t region_size;  // of its one region (computed here, not by loading it: that is the slow part)
};

std::string interleaved_json(uint32_t layers) {
  // Layers interleaved byte by byte: 4096 one-byte runs per block each.
  char b[1024];
  std::snprintf(b, sizeof b,
                R"({"format":"kvferry-geometry","version":1,"name":"stall","regions":[{"name":"r","size":0}],)"
                R"("groups":[{"name":"g","kind":"full","block_size":1,"num_blocks":2,"layers":[{"count":%u,)"
                R"("region":"r","offset":0,"offset_step":1,"elem_bytes":1,"block_stride":%u,"planes":1,)"
                R"("heads":4096,"head_bytes":1,"plane_stride":0,"token_stride":%u,"head_stride":%u}]}],)"
                R"("objects":{"chunk_tokens":1,"format":"canonical"}})",
                layers, 4096 * layers, 4096 * layers, layers);
  return b;
}

std::string many_pairs_json() {
  // 64 x 1024 views of one region whose extents all meet: the pair cap.
  std::string j = R"({"format":"kvferry-geometry","version":1,"name":"pairs","regions":[{"name":"kv","size":0}],"groups":[)";
  for (int gi = 0; gi < 64; gi++) {
    char b[512];
    std::snprintf(b, sizeof b,
                  R"(%s{"name":"g%d","kind":"full","block_size":1,"num_blocks":4,"layers":[{"count":1024,)"
                  R"("region":"kv","offset":%d,"offset_step":16,"elem_bytes":1,"block_stride":1048576,"planes":1,)"
                  R"("heads":1,"head_bytes":16,"plane_stride":0,"token_stride":16,"head_stride":16}]})",
                  gi ? "," : "", gi, gi * 1024 * 16);
    j += b;
  }
  j += R"(],"objects":{"chunk_tokens":64,"format":"canonical"}})";
  return j;
}

std::vector<Heavy> heavy_geometries() {
  // Interleaved: 2 blocks of 4096 x layers bytes; the pairs: 4 blocks of 1 MiB.
  return {{"24 layers interleaved byte by byte (the 454-byte frame of the issue)", interleaved_json(24), 2 * 4096 * 24},
          {"64 layers interleaved byte by byte (valid: the most work under the budget)", interleaved_json(64),
           2 * 4096 * 64},
          {"1024 layers interleaved byte by byte (past the budget)", interleaved_json(1024), 2 * 4096 * 1024},
          {"65536 views whose extents all meet (past the pair cap)", many_pairs_json(), 4u << 20}};
}

struct AttackReport {
  uint32_t sent, answered, registered, refused;
  double max_ms;
  char last[256];
};

// REGISTER each heavy geometry in turn over one connection for `ms`, with
// sealed memfds of the regions' sizes; every REGISTER must be answered.
int heavy_attacker(const std::string &dir, int64_t ms, int report) {
  AttackReport rep;
  std::memset(&rep, 0, sizeof rep);
  RawConn c;
  if (c.open(dir) != KVF_SUCCESS) return 20;
  std::vector<Heavy> heavy = heavy_geometries();
  int64_t end = mono_ms() + ms;
  for (size_t k = 0; mono_ms() < end || rep.sent < heavy.size(); k++) {
    const Heavy &h = heavy[k % heavy.size()];
    uint64_t size = round_page(h.region_size);
    kvf_mem_alloc_options o = KVF_MEM_ALLOC_OPTIONS_INIT;
    o.size = size;
    kvf_mem_alloc *a = nullptr;
    if (kvf_mem_alloc_create(&o, &a) != KVF_SUCCESS) return 21;
    kvf_mem_identity id;
    int fd = -1;
    if (kvf_mem_alloc_export(a, &fd, &id) != KVF_SUCCESS) return 22;
    kvf_proto_msg reply;
    int64_t t0 = mono_us();
    rep.sent++;
    kvf_status st = register_raw(c, h.json, {region_of(id, 0, size, 0)}, {fd}, &reply);
    close(fd);
    kvf_mem_alloc_destroy(a);
    if (st != KVF_SUCCESS) {
      std::snprintf(rep.last, sizeof rep.last, "%s: no reply: %s", h.what, kvf_status_string(st));
      break;
    }
    rep.answered++;
    rep.max_ms = std::max(rep.max_ms, (double)(mono_us() - t0) / 1000.0);
    if (reply.type == KVF_PROTO_REGISTER_REPLY)
      rep.registered++;
    else
      rep.refused++;
    std::snprintf(rep.last, sizeof rep.last, "%s: %s", h.what, describe(reply).c_str());
    kvf_proto_msg_clear(&reply);
  }
  return put(report, &rep, sizeof rep) ? 0 : 23;
}

TEST_F(Isolation, ARegisterThatIsExpensiveToCheckDelaysOnlyItsSender) {
  // How long the worst geometries take to check, here, on one thread.
  for (const Heavy &h : heavy_geometries()) {
    int64_t t0 = mono_us();
    kvf_geometry *g = nullptr;
    kvf_status st = kvf_geometry_load_buffer(h.json.data(), h.json.size(), nullptr, &g, nullptr);
    std::printf("%s: %zu bytes, %s in %.1f ms\n", h.what, h.json.size(), st == KVF_SUCCESS ? "valid" : "refused",
                (double)(mono_us() - t0) / 1000.0);
    if (st == KVF_SUCCESS) {
      EXPECT_EQ(region_sizes(h.json).at(0), h.region_size) << h.what;
    }
    kvf_geometry_destroy(g);
  }
  // A short heartbeat timeout: an engine the loop stops answering is reaped.
  ASSERT_TRUE(server_.start(dir_, 1000));
  int fds0 = server_.fds(), maps0 = server_.memfd_maps();
  EngineReport first;
  Child &engine = start_engine(0x5a, &first);
  ASSERT_EQ(first.status, KVF_SUCCESS);
  Child &attacker = spawn([this](int, int rep) { return heavy_attacker(dir_, 3000, rep); });

  // Meanwhile a STAT on a new connection, again and again.
  double stat_max = 0;
  int stats = 0;
  AttackReport ar;
  std::memset(&ar, 0, sizeof ar);
  bool reported = false;
  for (int64_t end = mono_ms() + 120000; mono_ms() < end && !reported;) {
    double ms = 0;
    kvf_client_stats s = stat_now(&ms);
    EXPECT_EQ(s.active >= 1, true) << "the engine's registration is gone";
    stat_max = std::max(stat_max, ms);
    stats++;
    struct pollfd p = {attacker.report, POLLIN, 0};
    if (poll(&p, 1, 20) == 1) reported = get(attacker.report, &ar, sizeof ar, 1000);
  }
  ASSERT_TRUE(reported) << "the attacker never finished";
  EXPECT_EQ(finish(attacker), 0);
  EngineReport er = stop_engine(engine);
  std::printf("attacker: %u REGISTERs, %u answered (%u registered, %u refused), slowest %.1f ms; last: %s\n",
              ar.sent, ar.answered, ar.registered, ar.refused, ar.max_ms, ar.last);
  std::printf("engine: %u heartbeats meanwhile, mean %.3f ms, max %.1f ms, %u failed%s%s\n", er.heartbeats,
              er.mean_ms, er.max_ms, er.failures, er.failures ? ": " : "", er.failures ? er.message : "");
  std::printf("STAT on a new connection: %d, max %.1f ms\n", stats, stat_max);
  EXPECT_EQ(ar.answered, ar.sent) << ar.last;
  EXPECT_GE(ar.sent, 4u);
  EXPECT_GT(ar.refused, 0u);
  EXPECT_GT(ar.registered, 0u);
  EXPECT_EQ(er.status, KVF_SUCCESS) << er.message;
  EXPECT_EQ(er.failures, 0u) << er.message;
  EXPECT_GT(er.heartbeats, 100u);
  EXPECT_LT(er.max_ms, 50.0 * kTimingScale) << "a heartbeat waited behind another client's REGISTER";
  EXPECT_LT(stat_max, 100.0 * kTimingScale) << "a STAT waited behind another client's REGISTER";
  EXPECT_EQ(server_.fds(), fds0) << "the server kept descriptors";
  EXPECT_EQ(server_.memfd_maps(), maps0) << "the server kept mappings";
  EXPECT_EQ(server_.stop(), 0) << kServerCodes;
}

// ---- 2. descriptors and identities ---------------------------------------------

// A sealed host allocation for the tiny geometry (both its regions).
struct HostAlloc {
  kvf_mem_alloc *a = nullptr;
  kvf_mem_identity id{};
  uint64_t region = 0;  // bytes of one region of the tiny geometry
  explicit HostAlloc(uint8_t fill = 0) {
    region = region_sizes(kTinyGeometry).at(0);
    kvf_mem_alloc_options o = KVF_MEM_ALLOC_OPTIONS_INIT;
    o.size = 2 * region;
    EXPECT_EQ(kvf_mem_alloc_create(&o, &a), KVF_SUCCESS) << kvf_last_error();
    if (a) {
      kvf_mem_alloc_identity(a, &id);
      std::memset(kvf_mem_alloc_ptr(a), fill, 2 * region);
    }
  }
  HostAlloc(const HostAlloc &) = delete;
  HostAlloc &operator=(const HostAlloc &) = delete;
  ~HostAlloc() { kvf_mem_alloc_destroy(a); }
  int fd() const {
    int f = -1;
    EXPECT_EQ(kvf_mem_alloc_export(a, &f, nullptr), KVF_SUCCESS);
    return f;
  }
};

// REGISTER the tiny geometry with both regions in allocation `id` (one
// descriptor), closing fd.
kvf_status register_tiny(RawConn &c, const kvf_mem_identity &id, uint64_t region, int fd, kvf_proto_msg *reply) {
  kvf_status st = register_raw(c, kTinyGeometry, {region_of(id, 0, region, 0), region_of(id, region, region, 0)},
                               {fd}, reply);
  close(fd);
  return st;
}

// REGISTER the tiny geometry in a on c and expect it accepted.
void expect_registered(RawConn &c, const HostAlloc &a) {
  kvf_proto_msg reply;
  ASSERT_EQ(register_tiny(c, a.id, a.region, a.fd(), &reply), KVF_SUCCESS);
  ASSERT_EQ(reply.type, KVF_PROTO_REGISTER_REPLY) << describe(reply);
  kvf_proto_msg_clear(&reply);
}

// After refusals, connection c still registers allocation a correctly (the
// tiny geometry), then unregisters it.
void register_then_unregister(RawConn &c, const HostAlloc &a) {
  ASSERT_NO_FATAL_FAILURE(expect_registered(c, a));
  kvf_proto_msg reply;
  ASSERT_EQ(c.simple(KVF_PROTO_UNREGISTER, &reply), KVF_SUCCESS);
  EXPECT_EQ(reply.type, KVF_PROTO_UNREGISTER_REPLY) << describe(reply);
  kvf_proto_msg_clear(&reply);
}

// Descriptors that are not a sealed memfd of `size` bytes.
std::vector<std::pair<const char *, int>> wrong_descriptors(const std::string &dir, uint64_t size) {
  std::vector<std::pair<const char *, int>> out;
  int p[2];
  EXPECT_EQ(pipe2(p, O_CLOEXEC), 0);
  close(p[1]);
  out.push_back({"a pipe", p[0]});
  int sv[2];
  EXPECT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  close(sv[1]);
  out.push_back({"a socket", sv[0]});
  std::string path = dir + "/regular-file";
  int f = open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  EXPECT_GE(f, 0);
  EXPECT_EQ(ftruncate(f, (off_t)size), 0);
  unlink(path.c_str());
  out.push_back({"a regular file of the right size", f});
  int m = memfd_create("kvf-unsealed", MFD_CLOEXEC);
  EXPECT_EQ(ftruncate(m, (off_t)size), 0);
  out.push_back({"a memfd of the right size without seals", m});
  return out;
}

TEST_F(Isolation, ADescriptorMustBeTheAllocationItsIdentityNames) {
  ASSERT_TRUE(server_.start(dir_, 30000));
  HostAlloc a(1), b(2), c(3);
  RawConn conn;
  ASSERT_EQ(conn.open(dir_), KVF_SUCCESS);
  ASSERT_NO_FATAL_FAILURE(expect_registered(conn, a));
  kvf_proto_msg reply;
  int fds0 = server_.fds(), maps0 = server_.memfd_maps();
  auto still_serving = [&](const char *what) {
    kvf_proto_msg r;
    ASSERT_EQ(conn.simple(KVF_PROTO_HEARTBEAT, &r), KVF_SUCCESS) << what << ": the connection must stay";
    EXPECT_EQ(r.type, KVF_PROTO_HEARTBEAT_REPLY) << what;
    kvf_proto_msg_clear(&r);
    kvf_client_stats s = stat_now();
    EXPECT_EQ(s.active, 1u) << what;
    EXPECT_EQ(s.imports, 1u) << what << ": only a's mapping";
    EXPECT_EQ(s.aliases, 2u) << what;
    EXPECT_EQ(server_.fds(), fds0) << what << ": the server kept the descriptor";
    EXPECT_EQ(server_.memfd_maps(), maps0) << what << ": the server kept a mapping";
  };
  auto expect_refused = [&](const char *what, const char *field, const kvf_proto_msg &r) {
    ASSERT_EQ(r.type, KVF_PROTO_ERROR) << what << ": " << describe(r);
    EXPECT_EQ(r.u.error.status, (uint32_t)KVF_ERR_PROTOCOL) << what << ": " << describe(r);
    EXPECT_STREQ(r.u.error.field, field) << what << ": " << describe(r);
    std::printf("%s: %s\n", what, describe(r).c_str());
  };

  // a's identity (mapped: this connection registered it) with other descriptors.
  std::vector<std::pair<const char *, int>> wrong = wrong_descriptors(base_, a.id.size);
  wrong.push_back({"another sealed memfd of the same size (b's)", b.fd()});
  for (auto &w : wrong) {
    SCOPED_TRACE(std::string("a's identity with ") + w.first);
    ASSERT_EQ(register_tiny(conn, a.id, a.region, w.second, &reply), KVF_SUCCESS);
    expect_refused(w.first, "payload.regions[0].fd_index", reply);
    kvf_proto_msg_clear(&reply);
    still_serving(w.first);
  }
  // b's identity (new) with descriptors that are not a sealed memfd of its size.
  wrong = wrong_descriptors(base_, b.id.size);
  for (auto &w : wrong) {
    SCOPED_TRACE(std::string("b's identity with ") + w.first);
    ASSERT_EQ(register_tiny(conn, b.id, b.region, w.second, &reply), KVF_SUCCESS);
    expect_refused(w.first, "payload.regions[0].fd_index", reply);
    kvf_proto_msg_clear(&reply);
    still_serving(w.first);
  }
  {
    SCOPED_TRACE("b's memfd, its identity claiming twice its size");
    kvf_mem_identity big = b.id;
    big.size *= 2;
    ASSERT_EQ(register_tiny(conn, big, b.region, b.fd(), &reply), KVF_SUCCESS);
    expect_refused("an identity larger than its memfd", "payload.regions[0].size", reply);
    kvf_proto_msg_clear(&reply);
    still_serving("an identity larger than its memfd");
  }
  {
    // Region 0 in c (fine), region 1 in b with a pipe: nothing of c is mapped.
    int p[2];
    ASSERT_EQ(pipe2(p, O_CLOEXEC), 0);
    close(p[1]);
    int cfd = c.fd();
    ASSERT_EQ(register_raw(conn, kTinyGeometry, {region_of(c.id, 0, c.region, 0), region_of(b.id, 0, b.region, 1)},
                           {cfd, p[0]}, &reply),
              KVF_SUCCESS);
    close(cfd);
    close(p[0]);
    expect_refused("the second of two allocations with a pipe", "payload.regions[1].fd_index", reply);
    kvf_proto_msg_clear(&reply);
    still_serving("the second of two allocations with a pipe");
  }
  // a's own descriptor again: re-registered (an alias of its mapping).
  ASSERT_NO_FATAL_FAILURE(register_then_unregister(conn, a));
  conn.close();
  EXPECT_EQ(server_.stop(), 0) << kServerCodes;
}

// A REGISTER whose region runs past its allocation (offset + length over
// the size, or wrapping 64 bits) is a request the server refuses, not a bad
// frame: an ERROR naming the region's length, nothing mapped or kept, and
// the connection registers correctly afterwards. It used to be refused by
// the frame decoder (KVF_ERR_PROTOCOL), and the connection dropped.
TEST_F(Isolation, ARegionPastItsAllocationIsRefusedAndTheConnectionStays) {
  ASSERT_TRUE(server_.start(dir_, 30000));
  HostAlloc a(1);
  const uint64_t R = a.region;  // the allocation holds 2 R bytes, region 1 needs R
  const std::string past = "passes the allocation's " + std::to_string(2 * R) + " bytes";
  RawConn conn;
  ASSERT_EQ(conn.open(dir_), KVF_SUCCESS);
  int fds0 = server_.fds(), maps0 = server_.memfd_maps();
  struct Case {
    std::string what;
    uint64_t offset, length;
  } cases[] = {
      {"offset R + 4096, length R: 4096 bytes past the end", R + 4096, R},
      {"offset R, length 2R", R, 2 * R},
      {"offset 0, length 2R + 1", 0, 2 * R + 1},
      {"offset 2^64 - 4096, length 8192 (the end wraps to 4096)", UINT64_MAX - 4095, 8192},
      {"offset 2^64 - 4096, length R + 4096 (the end wraps to R)", UINT64_MAX - 4095, R + 4096},
      {"offset 2^64 - 1, length 2^64 - 1", UINT64_MAX, UINT64_MAX},
  };
  kvf_proto_msg reply;
  for (const Case &k : cases) {
    SCOPED_TRACE(k.what);
    int fd = a.fd();
    kvf_status st =
        register_raw(conn, kTinyGeometry, {region_of(a.id, 0, R, 0), region_of(a.id, k.offset, k.length, 0)}, {fd},
                     &reply);
    close(fd);
    ASSERT_EQ(st, KVF_SUCCESS) << "no reply: the server dropped the connection";
    std::printf("%s: %s\n", k.what.c_str(), describe(reply).c_str());
    ASSERT_EQ(reply.type, KVF_PROTO_ERROR) << describe(reply);
    EXPECT_EQ(reply.u.error.status, (uint32_t)KVF_ERR_INVALID_ARGUMENT) << describe(reply);
    EXPECT_STREQ(reply.u.error.field, "payload.regions[1].length") << describe(reply);
    EXPECT_NE(std::string(reply.u.error.message).find(past), std::string::npos) << describe(reply);
    EXPECT_NE(std::string(reply.u.error.message).find("offset " + std::to_string(k.offset)), std::string::npos)
        << describe(reply);
    kvf_proto_msg_clear(&reply);
    ASSERT_NO_FATAL_FAILURE(expect_nothing_kept(conn, fds0, maps0));
  }
  // The same connection registers the allocation correctly, and unregisters.
  ASSERT_NO_FATAL_FAILURE(register_then_unregister(conn, a));
  conn.close();

  // The C client sends such a region as given: it gets the server's
  // refusal and registers on the same connection afterwards.
  kvf_client_options o = KVF_CLIENT_OPTIONS_INIT;
  o.socket_dir = dir_.c_str();
  kvf_client *c = nullptr;
  ASSERT_EQ(kvf_client_connect(&o, &c, nullptr), KVF_SUCCESS) << kvf_last_error();
  kvf_client_region bad[2] = {{a.a, 0, R}, {a.a, R + 4096, R}};
  EXPECT_EQ(kvf_client_register(c, kTinyGeometry, strlen(kTinyGeometry), -1, bad, 2, nullptr),
            KVF_ERR_INVALID_ARGUMENT);
  std::string err = kvf_last_error();
  std::printf("kvf_client_register: %s\n", err.c_str());
  EXPECT_NE(err.find("payload.regions[1].length: offset " + std::to_string(R + 4096)), std::string::npos) << err;
  EXPECT_NE(err.find(past), std::string::npos) << err;
  EXPECT_EQ(kvf_client_heartbeat(c, nullptr), KVF_SUCCESS) << kvf_last_error();
  kvf_client_region good[2] = {{a.a, 0, R}, {a.a, R, R}};
  EXPECT_EQ(kvf_client_register(c, kTinyGeometry, strlen(kTinyGeometry), -1, good, 2, nullptr), KVF_SUCCESS)
      << kvf_last_error();
  EXPECT_EQ(kvf_client_unregister(c, 0, nullptr), KVF_SUCCESS) << kvf_last_error();
  kvf_client_disconnect(c);
  EXPECT_EQ(server_.memfd_maps(), maps0);
  EXPECT_EQ(server_.stop(), 0) << kServerCodes;
}

// A REGISTER whose region names instance 0, a provider that is none,
// an allocation of 0 bytes, an empty range or a descriptor the frame does
// not carry is a well-formed frame with a wrong value: the server refuses
// it naming the field (instance 0 is not the sender's instance, so
// KVF_ERR_PERMISSION; the others KVF_ERR_INVALID_ARGUMENT), keeps nothing,
// and the connection registers correctly afterwards. The frame decoder
// used to refuse these (KVF_ERR_PROTOCOL), which dropped the connection.
TEST_F(Isolation, RegionFaultsAreRefusedNamingTheFieldAndTheConnectionStays) {
  ASSERT_TRUE(server_.start(dir_, 30000));
  HostAlloc a(1);
  const uint64_t R = a.region;
  RawConn conn;
  ASSERT_EQ(conn.open(dir_), KVF_SUCCESS);
  int fds0 = server_.fds(), maps0 = server_.memfd_maps();
  struct Case {
    std::string what, field, message;
    void (*spoil)(kvf_proto_region *);
    kvf_status status = KVF_ERR_INVALID_ARGUMENT;
  } cases[] = {
      {"instance 0", "payload.regions[1].instance_id", "0000000000000000 is not this connection's instance",
       [](kvf_proto_region *r) { r->instance_id = 0; }, KVF_ERR_PERMISSION},
      {"provider 3", "payload.regions[1].provider", "3 is not a provider",
       [](kvf_proto_region *r) { r->provider = 3; }},
      {"provider 0", "payload.regions[1].provider", "0 is not a provider",
       [](kvf_proto_region *r) { r->provider = 0; }},
      {"an allocation of 0 bytes", "payload.regions[1].size", "0 bytes, an allocation is never empty",
       [](kvf_proto_region *r) { r->size = 0; }},
      {"an empty range", "payload.regions[1].length", "0 bytes, a region is never empty",
       [](kvf_proto_region *r) { r->length = 0; }},
      {"descriptor 1 of 1", "payload.regions[1].fd_index", "1, but 1 descriptors came",
       [](kvf_proto_region *r) { r->fd_index = 1; }},
      {"descriptor 2^32 - 1 of 1", "payload.regions[1].fd_index", "4294967295, but 1 descriptors came",
       [](kvf_proto_region *r) { r->fd_index = UINT32_MAX; }},
  };
  kvf_proto_msg reply;
  for (const Case &k : cases) {
    SCOPED_TRACE(k.what);
    kvf_proto_region spoilt = region_of(a.id, R, R, 0);
    k.spoil(&spoilt);
    int fd = a.fd();
    kvf_status st = register_raw(conn, kTinyGeometry, {region_of(a.id, 0, R, 0), spoilt}, {fd}, &reply);
    close(fd);
    ASSERT_EQ(st, KVF_SUCCESS) << "no reply: the server dropped the connection";
    std::printf("%s: %s\n", k.what.c_str(), describe(reply).c_str());
    ASSERT_EQ(reply.type, KVF_PROTO_ERROR) << describe(reply);
    EXPECT_EQ(reply.u.error.status, (uint32_t)k.status) << describe(reply);
    EXPECT_STREQ(reply.u.error.field, k.field.c_str()) << describe(reply);
    EXPECT_NE(std::string(reply.u.error.message).find(k.message), std::string::npos) << describe(reply);
    kvf_proto_msg_clear(&reply);
    ASSERT_NO_FATAL_FAILURE(expect_nothing_kept(conn, fds0, maps0));
  }
  ASSERT_NO_FATAL_FAILURE(register_then_unregister(conn, a));
  conn.close();
  EXPECT_EQ(server_.memfd_maps(), maps0);
  EXPECT_EQ(server_.stop(), 0) << kServerCodes;
}

// In a child: connect as `instance` / `generation` (HELLO) and REGISTER a
// fresh allocation of its own under that identity (allocation id
// `allocation_id`, or the allocation's own when 0). Its exit status: 0 when
// registered, else the step that failed (40 connect, 41 no reply, 42 refused,
// the reply on stderr after `who`).
int register_fresh_as(const std::string &dir, uint64_t instance, uint64_t generation, uint64_t allocation_id,
                      const char *who) {
  HostAlloc fresh(1);
  RawConn c;
  if (c.open(dir, instance, generation) != KVF_SUCCESS) return 40;
  kvf_mem_identity id = fresh.id;
  id.instance_id = instance;
  id.generation = generation;
  if (allocation_id) id.allocation_id = allocation_id;
  kvf_proto_msg reply;
  if (register_tiny(c, id, fresh.region, fresh.fd(), &reply) != KVF_SUCCESS) return 41;
  int ok = reply.type == KVF_PROTO_REGISTER_REPLY;
  if (!ok) std::fprintf(stderr, "%s: %s\n", who, describe(reply).c_str());
  kvf_proto_msg_clear(&reply);
  return ok ? 0 : 42;
}

// A refused REGISTER binds nothing: the generations a connection holds
// (no other process may register them while it is connected) are those of
// its registrations that succeeded. Otherwise a process that knows an
// engine's instance could send REGISTERs the server refuses in the
// engine's name and keep the engine out of its own allocations, and each
// refusal would use up one of the connection's generation slots.
constexpr uint64_t kGenerationSlots = 8;  // KVF_SERVER_MAX_GENERATIONS (host/server/server.c)

TEST_F(Isolation, ARefusedRegisterBindsNoGeneration) {
  ASSERT_TRUE(server_.start(dir_, 30000));
  const uint64_t instance = 0x1d1e5ca1ab1e0001ull, generation = 7;
  HostAlloc mine(1);
  kvf_mem_identity id = mine.id;
  id.instance_id = instance;
  id.generation = generation;
  RawConn squatter;
  ASSERT_EQ(squatter.open(dir_, instance, generation), KVF_SUCCESS);
  kvf_proto_msg reply;
  // Refusals in the engine's generation, then in as many others as a
  // connection has generation slots.
  for (uint64_t k = 0; k <= kGenerationSlots; k++) {
    kvf_mem_identity spoilt = id;
    spoilt.generation = k == 0 ? generation : 100 + k;
    SCOPED_TRACE(spoilt.generation);
    kvf_proto_region empty = region_of(spoilt, mine.region, mine.region, 0);
    empty.length = 0; /* refused by the registration worker, after the claim */
    int fd = mine.fd();
    ASSERT_EQ(register_raw(squatter, kTinyGeometry, {region_of(spoilt, 0, mine.region, 0), empty}, {fd}, &reply),
              KVF_SUCCESS);
    close(fd);
    ASSERT_EQ(reply.type, KVF_PROTO_ERROR) << describe(reply);
    EXPECT_STREQ(reply.u.error.field, "payload.regions[1].length") << describe(reply);
    kvf_proto_msg_clear(&reply);
  }
  // Another process of that instance and generation (the squatter still
  // connected) registers its own allocation.
  Child &engine = spawn([this](int, int) { return register_fresh_as(dir_, instance, generation, 0, "engine"); });
  EXPECT_EQ(finish(engine), 0) << "the refused REGISTER kept the generation bound to its sender";
  // The squatter's connection is unharmed and registers its own.
  EXPECT_EQ(squatter.simple(KVF_PROTO_HEARTBEAT, &reply), KVF_SUCCESS);
  kvf_proto_msg_clear(&reply);
  ASSERT_EQ(register_tiny(squatter, id, mine.region, mine.fd(), &reply), KVF_SUCCESS);
  EXPECT_EQ(reply.type, KVF_PROTO_REGISTER_REPLY) << describe(reply);
  kvf_proto_msg_clear(&reply);
  // A claim refused part way (its first new generation would fill the
  // last slot, the second finds none) binds neither.
  for (uint64_t gen = 201; gen < 200 + kGenerationSlots - 1; gen++) {  // 7 bound with generation 7
    kvf_mem_identity more = id;
    more.generation = gen;
    ASSERT_EQ(register_tiny(squatter, more, mine.region, mine.fd(), &reply), KVF_SUCCESS);
    ASSERT_EQ(reply.type, KVF_PROTO_REGISTER_REPLY) << describe(reply);
    kvf_proto_msg_clear(&reply);
  }
  kvf_mem_identity last = id, past = id;
  last.generation = 300;
  past.generation = 301;
  int fd = mine.fd();
  ASSERT_EQ(register_raw(squatter, kTinyGeometry,
                         {region_of(last, 0, mine.region, 0), region_of(past, mine.region, mine.region, 0)}, {fd},
                         &reply),
            KVF_SUCCESS);
  close(fd);
  ASSERT_EQ(reply.type, KVF_PROTO_ERROR) << describe(reply);
  EXPECT_EQ(reply.u.error.status, (uint32_t)KVF_ERR_PERMISSION) << describe(reply);
  EXPECT_STREQ(reply.u.error.field, "payload.regions[1].generation") << describe(reply);
  kvf_proto_msg_clear(&reply);
  Child &next = spawn([this](int, int) { return register_fresh_as(dir_, instance, 300, 0, "generation 300"); });
  EXPECT_EQ(finish(next), 0) << "the claim refused part way kept generation 300 bound";
  squatter.close();
  EXPECT_EQ(server_.stop(), 0) << kServerCodes;
}

// What a process that REGISTERs while another's REGISTER of the same
// generation is still being checked saw.
struct BusyReport {
  uint32_t busy, attempts, registered;
  char message[KVF_PROTO_MESSAGE_MAX];
};

// While a REGISTER is on the registration worker, the generations it named
// are bound only until it is answered: another process naming one then is
// answered KVF_ERR_BUSY (try again), not "registered it first", and
// registers once the first REGISTER has been refused.
TEST_F(Isolation, AGenerationNamedByARegisterStillBeingCheckedIsBusyNotBound) {
  ASSERT_TRUE(server_.start(dir_, 30000));
  const uint64_t instance = 0x1d1e5ca1ab1e0002ull, generation = 9;
  // The engine: told to start, it REGISTERs every millisecond until
  // registered (5 s at most) and reports what it saw.
  Child &engine = spawn([this](int ctl, int rep) {
    BusyReport r;
    std::memset(&r, 0, sizeof r);
    HostAlloc fresh(1);
    RawConn c; /* connected first, so that its REGISTERs follow the signal at once */
    if (c.open(dir_, instance, generation) != KVF_SUCCESS) return 51;
    char go;
    if (read(ctl, &go, 1) != 1) return 50;
    kvf_mem_identity id = fresh.id;
    id.instance_id = instance;
    id.generation = generation;
    for (int64_t end = mono_ms() + 5000; !r.registered && mono_ms() < end; sleep_ms(1)) {
      kvf_proto_msg reply;
      if (register_tiny(c, id, fresh.region, fresh.fd(), &reply) != KVF_SUCCESS) return 52;
      r.attempts++;
      if (reply.type == KVF_PROTO_REGISTER_REPLY) r.registered = 1;
      if (reply.type == KVF_PROTO_ERROR && reply.u.error.status == (uint32_t)KVF_ERR_BUSY) r.busy++;
      if (reply.type == KVF_PROTO_ERROR)
        std::snprintf(r.message, sizeof r.message, "%s", reply.u.error.message);
      kvf_proto_msg_clear(&reply);
    }
    return put(rep, &r, sizeof r) ? 0 : 53;
  });
  // The squatter: a REGISTER in the engine's name whose geometry takes the
  // worker about 200 ms to refuse (heavy_geometries' last).
  const Heavy heavy = heavy_geometries().back();
  const uint64_t size = round_page(heavy.region_size);
  kvf_mem_alloc_options o = KVF_MEM_ALLOC_OPTIONS_INIT;
  o.size = size;
  kvf_mem_alloc *a = nullptr;
  ASSERT_EQ(kvf_mem_alloc_create(&o, &a), KVF_SUCCESS) << kvf_last_error();
  kvf_mem_identity id;
  int fd = -1;
  ASSERT_EQ(kvf_mem_alloc_export(a, &fd, &id), KVF_SUCCESS) << kvf_last_error();
  id.instance_id = instance;
  id.generation = generation;
  RawConn squatter;
  ASSERT_EQ(squatter.open(dir_, instance, generation), KVF_SUCCESS);
  kvf_proto_msg slow;
  std::memset(&slow, 0, sizeof slow);
  kvf_status slow_st = KVF_ERR_INTERNAL;
  std::thread t([&] { slow_st = register_raw(squatter, heavy.json, {region_of(id, 0, size, 0)}, {fd}, &slow); });
  sleep_ms(20); /* the squatter's REGISTER is claimed as it arrives */
  ASSERT_EQ(write(engine.control, "g", 1), 1);
  BusyReport r;
  ASSERT_TRUE(get(engine.report, &r, sizeof r, 30000)) << "the engine stopped: " << finish(engine);
  t.join();
  close(fd);
  kvf_mem_alloc_destroy(a);
  EXPECT_EQ(finish(engine), 0);
  ASSERT_EQ(slow_st, KVF_SUCCESS);
  EXPECT_EQ(slow.type, KVF_PROTO_ERROR) << "the squatter's REGISTER was not refused: " << describe(slow);
  kvf_proto_msg_clear(&slow);
  std::printf("engine: %u attempts, %u busy, registered %u; last refusal: %s\n", r.attempts, r.busy, r.registered,
              r.message);
  EXPECT_EQ(r.registered, 1u) << r.message;
  EXPECT_GE(r.busy, 1u) << "no REGISTER of the engine's ran while the squatter's was checked";
  EXPECT_NE(std::string(r.message).find("still in progress"), std::string::npos) << r.message;
  squatter.close();
  EXPECT_EQ(server_.stop(), 0) << kServerCodes;
}

// STORE or RETRIEVE tokens [0, 16) of the tiny geometry (one chunk, key
// `key`, block 0) on c's live registration; the reply.
kvf_status xfer_block0(RawConn &c, uint16_t type, uint64_t key, kvf_proto_msg *reply) {
  kvf_chunk_key keys[1] = {KeyOf(key)};
  uint32_t ids[1] = {0};
  kvf_proto_group g;
  std::memset(&g, 0, sizeof g);
  g.first_block = 0;
  g.block_ids = ids;
  g.count = 1;
  kvf_proto_msg m;
  std::memset(&m, 0, sizeof m);
  m.type = type;
  m.u.xfer.token_begin = 0;
  m.u.xfer.token_end = 16;
  m.u.xfer.chunk_keys = keys;
  m.u.xfer.num_chunk_keys = 1;
  m.u.xfer.groups = &g;
  m.u.xfer.num_groups = 1;
  return c.call(&m, nullptr, 0, reply);
}

// What the identity attacker saw, per attempt.
struct IdentityAttempt {
  uint16_t type;    // of the REGISTER's reply
  uint32_t status;  // ERROR's
  char field[KVF_PROTO_FIELD_MAX];
  char message[KVF_PROTO_MESSAGE_MAX];
  uint64_t restored;  // bytes a RETRIEVE then moved through the registration it got, if any
};
constexpr int kIdentityAttempts = 3;
const char *const kIdentityAttemptNames[kIdentityAttempts] = {
    "its own instance in HELLO, the engine's identity, a pipe",
    "the engine's instance and generation in HELLO, the engine's identity, a pipe",
    "the engine's instance and generation in HELLO, the engine's identity, a sealed memfd of its own"};

// Store block 0 of its own memory (0xa7 bytes) under key 0x5eed, then try
// to register the engine's allocation three ways; whenever a REGISTER is
// granted, RETRIEVE that key through it (into the engine's memory).
int identity_attacker(const std::string &dir, const EngineReport &victim, int report) {
  IdentityAttempt out[kIdentityAttempts];
  std::memset(out, 0, sizeof out);
  HostAlloc own(0xa7), other(0xa7);
  RawConn mine;
  if (mine.open(dir) != KVF_SUCCESS) return 30;
  kvf_proto_msg reply;
  if (register_tiny(mine, own.id, own.region, own.fd(), &reply) != KVF_SUCCESS ||
      reply.type != KVF_PROTO_REGISTER_REPLY)
    return 31;
  kvf_proto_msg_clear(&reply);
  if (xfer_block0(mine, KVF_PROTO_STORE, 0x5eed, &reply) != KVF_SUCCESS || reply.type != KVF_PROTO_STORE_REPLY ||
      reply.u.xfer_reply.outcome != 1)
    return 32;
  kvf_proto_msg_clear(&reply);
  kvf_mem_identity theirs = own.id;
  theirs.instance_id = victim.instance_id;
  theirs.allocation_id = victim.allocation_id;
  theirs.generation = victim.generation;
  theirs.size = victim.size;
  RawConn as_victim;
  if (as_victim.open(dir, victim.instance_id, victim.generation) != KVF_SUCCESS) return 33;
  for (int k = 0; k < kIdentityAttempts; k++) {
    RawConn &c = k == 0 ? mine : as_victim;
    int fd = -1;
    if (k < 2) {
      int p[2];
      if (pipe2(p, O_CLOEXEC) != 0) return 34;
      close(p[1]);
      fd = p[0];
    } else {
      fd = other.fd();
    }
    if (register_tiny(c, theirs, own.region, fd, &reply) != KVF_SUCCESS) return 35;
    out[k].type = reply.type;
    if (reply.type == KVF_PROTO_ERROR) {
      out[k].status = reply.u.error.status;
      std::snprintf(out[k].field, sizeof out[k].field, "%s", reply.u.error.field);
      std::snprintf(out[k].message, sizeof out[k].message, "%s", reply.u.error.message);
    }
    bool granted = reply.type == KVF_PROTO_REGISTER_REPLY;
    kvf_proto_msg_clear(&reply);
    if (granted) {
      if (xfer_block0(c, KVF_PROTO_RETRIEVE, 0x5eed, &reply) != KVF_SUCCESS) return 36;
      if (reply.type == KVF_PROTO_RETRIEVE_REPLY) out[k].restored = reply.u.xfer_reply.bytes_done;
      kvf_proto_msg_clear(&reply);
    }
  }
  return put(report, out, sizeof out) ? 0 : 37;
}

TEST_F(Isolation, AnotherClientsAllocationIsRefusedWhateverTheDescriptor) {
  ASSERT_TRUE(server_.start(dir_, 30000));
  int fds0 = server_.fds(), maps0 = server_.memfd_maps();
  EngineReport victim;
  Child &engine = start_engine(0x5a, &victim);
  ASSERT_EQ(victim.status, KVF_SUCCESS);
  Child &attacker = spawn([this, &victim](int, int rep) { return identity_attacker(dir_, victim, rep); });
  IdentityAttempt out[kIdentityAttempts];
  ASSERT_TRUE(get(attacker.report, out, sizeof out, 30000)) << "the attacker stopped: " << finish(attacker);
  EXPECT_EQ(finish(attacker), 0);
  for (int k = 0; k < kIdentityAttempts; k++) {
    SCOPED_TRACE(kIdentityAttemptNames[k]);
    std::printf("%s: %s%s%s%s\n", kIdentityAttemptNames[k],
                out[k].type == KVF_PROTO_ERROR ? out[k].field : "REGISTERED",
                out[k].type == KVF_PROTO_ERROR ? ": " : "", out[k].message,
                out[k].restored ? " -- and its RETRIEVE wrote into the engine's memory" : "");
    EXPECT_EQ(out[k].type, KVF_PROTO_ERROR);
    EXPECT_EQ(out[k].status, (uint32_t)KVF_ERR_PERMISSION) << out[k].message;
    EXPECT_STREQ(out[k].field, "payload.regions[0].instance_id") << out[k].message;
    EXPECT_EQ(out[k].restored, 0u);
  }
  // The engine's memory holds its own bytes, and it was served throughout.
  EngineReport er = stop_engine(engine);
  EXPECT_EQ(er.status, KVF_SUCCESS) << er.message;
  EXPECT_EQ(er.failures, 0u) << er.message;
  // Once the engine is gone its instance is free again: a new process of it
  // (a restart with the same generation, new memory) registers.
  Child &restart = spawn([this, &victim](int, int) {
    return register_fresh_as(dir_, victim.instance_id, victim.generation, victim.allocation_id + 1000, "restart");
  });
  EXPECT_EQ(finish(restart), 0) << "the engine's instance stayed bound after it left";
  EXPECT_EQ(server_.fds(), fds0) << "the server kept descriptors";
  EXPECT_EQ(server_.memfd_maps(), maps0) << "the server kept mappings";
  EXPECT_EQ(server_.stop(), 0) << kServerCodes;
}

// Two connections of one process share its instance, but a mapping belongs
// to the connection that imported it: the other one's REGISTER of that
// allocation is refused even with the allocation's own descriptor, and its
// own allocations register.
TEST_F(Isolation, AMappingBelongsToTheConnectionThatImportedIt) {
  ASSERT_TRUE(server_.start(dir_, 30000));
  HostAlloc a(1), b(2);
  RawConn one, two;
  ASSERT_EQ(one.open(dir_), KVF_SUCCESS);
  ASSERT_EQ(two.open(dir_), KVF_SUCCESS);
  ASSERT_NO_FATAL_FAILURE(expect_registered(one, a));
  kvf_proto_msg reply;
  ASSERT_EQ(register_tiny(two, a.id, a.region, a.fd(), &reply), KVF_SUCCESS);
  std::printf("the other connection, a's own descriptor: %s\n", describe(reply).c_str());
  ASSERT_EQ(reply.type, KVF_PROTO_ERROR) << describe(reply);
  EXPECT_EQ(reply.u.error.status, (uint32_t)KVF_ERR_PERMISSION);
  EXPECT_STREQ(reply.u.error.field, "payload.regions[0].instance_id");
  kvf_proto_msg_clear(&reply);
  ASSERT_EQ(register_tiny(two, b.id, b.region, b.fd(), &reply), KVF_SUCCESS);
  EXPECT_EQ(reply.type, KVF_PROTO_REGISTER_REPLY) << describe(reply);
  kvf_proto_msg_clear(&reply);
  kvf_client_stats s = stat_now();
  EXPECT_EQ(s.active, 2u);
  EXPECT_EQ(s.imports, 2u);
  EXPECT_EQ(s.aliases, 4u);
  one.close();
  two.close();
  EXPECT_EQ(server_.stop(), 0) << kServerCodes;
}

// ---- 3. exhaustion ----------------------------------------------------------------

// A sparse memfd of `size` bytes sealed against shrinking and growing: what
// the host provider imports, costing almost nothing until touched.
int sparse_memfd(uint64_t size) {
  int fd = memfd_create("kvf-sparse", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return -1;
  if (ftruncate(fd, (off_t)size) != 0 || fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

struct FloodReport {
  uint32_t registers, granted, refused, connections;
  uint64_t granted_bytes;  // claimed by the REGISTERs granted and still held
  uint32_t quota_refusals;
  char first_refusal[320], last_refusal[320];
};

// Claim sparse allocations from 64 TiB halving down to 32 KiB, each granted
// one held by its own connection (one registration each), the same size
// again while it is granted: the server's address space fills up. Report,
// then hold everything until `control` closes.
int flood_attacker(const std::string &dir, int control, int report) {
  FloodReport rep;
  std::memset(&rep, 0, sizeof rep);
  std::deque<RawConn> conns;
  uint64_t region = region_sizes(kTinyGeometry).at(0);
  conns.emplace_back();
  if (conns.back().open(dir) != KVF_SUCCESS) return 50;
  uint64_t next_id = 1u << 20;
  uint64_t instance = 0, generation = 0;
  kvf_mem_instance(&instance, &generation);
  for (uint64_t size = 64ull << 40; size >= (32u << 10) && rep.registers < 200 && conns.size() < 200;) {
    int fd = sparse_memfd(size);
    if (fd < 0) return 51;
    kvf_mem_identity id;
    std::memset(&id, 0, sizeof id);
    id.instance_id = instance;
    id.generation = generation;
    id.allocation_id = next_id++;
    id.size = size;
    id.provider = KVF_MEM_PROVIDER_HOST;
    kvf_proto_msg reply;
    rep.registers++;
    if (register_tiny(conns.back(), id, region, fd, &reply) != KVF_SUCCESS) return 52;
    if (reply.type == KVF_PROTO_REGISTER_REPLY) {
      rep.granted++;
      rep.granted_bytes += size;
      conns.emplace_back();  // the next claim on a connection of its own
      if (conns.back().open(dir) != KVF_SUCCESS) return 53;
    } else {
      rep.refused++;
      std::string d = describe(reply);
      if (std::strncmp(reply.u.error.field, "quota.", 6) == 0) rep.quota_refusals++;
      if (rep.refused == 1) std::snprintf(rep.first_refusal, sizeof rep.first_refusal, "%s", d.c_str());
      std::snprintf(rep.last_refusal, sizeof rep.last_refusal, "%s", d.c_str());
      size /= 2;
    }
    kvf_proto_msg_clear(&reply);
  }
  rep.connections = (uint32_t)conns.size();
  if (!put(report, &rep, sizeof rep)) return 54;
  char b;
  while (read(control, &b, 1) > 0) {
  }
  return 0;
}

TEST_F(Isolation, ClaimsOfHugeSparseAllocationsAreCappedAndAnEngineStillRegisters) {
  // The per-process default is max(2 TiB, 2 x RAM): 1 TiB here, so the
  // figures do not depend on the machine.
  ASSERT_TRUE(server_.start(dir_, 30000, [](kvf_server_options &o) { o.max_client_mapped_bytes = 1ull << 40; }));
  int fds0 = server_.fds(), maps0 = server_.memfd_maps();
  Child &attacker = spawn([this](int ctl, int rep) { return flood_attacker(dir_, ctl, rep); });
  FloodReport fr;
  ASSERT_TRUE(get(attacker.report, &fr, sizeof fr, 120000)) << "the attacker stopped: " << finish(attacker, 1000);
  std::printf("attacker: %u REGISTERs over %u connections: %u granted (%.1f TiB claimed and held), %u refused "
              "(%u by a quota)\n  first refusal: %s\n  last refusal: %s\n",
              fr.registers, fr.connections, fr.granted, (double)fr.granted_bytes / (double)(1ull << 40), fr.refused,
              fr.quota_refusals, fr.first_refusal, fr.last_refusal);
  // An engine registers meanwhile, and is served.
  EngineReport first;
  Child &engine = start_engine(0x5a, &first);
  EXPECT_EQ(first.status, KVF_SUCCESS) << "the engine could not register: " << first.message;
  if (first.status == KVF_SUCCESS) {
    EngineReport er = stop_engine(engine);
    EXPECT_EQ(er.status, KVF_SUCCESS) << er.message;
  }
  EXPECT_GT(fr.quota_refusals, 0u);
  EXPECT_NE(std::strstr(fr.first_refusal, "quota.mapped_bytes: "), nullptr) << fr.first_refusal;
  EXPECT_LE(fr.granted_bytes, 1ull << 40) << "one process holds more than its limit";
  // The attacker leaves: everything it held is unmapped.
  close(attacker.control);
  attacker.control = -1;
  EXPECT_EQ(finish(attacker), 0);
  kvf_client_stats s = stat_now();
  for (int i = 0; i < 100 && s.imports != 0; i++) {
    sleep_ms(20);
    s = stat_now();
  }
  EXPECT_EQ(s.imports, 0u);
  EXPECT_EQ(server_.fds(), fds0) << "the server kept descriptors";
  EXPECT_EQ(server_.memfd_maps(), maps0) << "the server kept mappings";
  EXPECT_EQ(server_.stop(), 0) << kServerCodes;
}

// Register a sparse allocation of `size` bytes (both tiny regions in it) on c.
kvf_status register_sparse(RawConn &c, uint64_t size, uint64_t allocation_id, kvf_proto_msg *reply) {
  uint64_t region = region_sizes(kTinyGeometry).at(0);
  int fd = sparse_memfd(size);
  if (fd < 0) return KVF_ERR_SYSTEM;
  kvf_mem_identity id;
  std::memset(&id, 0, sizeof id);
  kvf_mem_instance(&id.instance_id, &id.generation);
  id.allocation_id = allocation_id;
  id.size = size;
  id.provider = KVF_MEM_PROVIDER_HOST;
  return register_tiny(c, id, region, fd, reply);
}

// The server-wide cap on mapped bytes holds across processes, and a
// client's registrations, live and draining (held by requests in flight),
// are capped.
TEST_F(Isolation, TheServerWideCapAndTheRegistrationCapHold) {
  ASSERT_TRUE(server_.start(dir_, 30000, [](kvf_server_options &o) {
    o.max_mapped_bytes = 4ull << 30;
    o.max_client_mapped_bytes = 3ull << 30;
    o.max_client_registrations = 3;
    o.test_completion_delay_ms = 1500;  // a STORE holds its lease that long
  }));
  int fds0 = server_.fds(), maps0 = server_.memfd_maps();
  // Another process holds 3 GiB.
  Child &holder = spawn([this](int ctl, int rep) {
    RawConn c;
    kvf_proto_msg reply;
    if (c.open(dir_) != KVF_SUCCESS || register_sparse(c, 3ull << 30, 1, &reply) != KVF_SUCCESS) return 60;
    char ok = reply.type == KVF_PROTO_REGISTER_REPLY ? 'y' : 'n';
    kvf_proto_msg_clear(&reply);
    if (!put(rep, &ok, 1)) return 61;
    char b;
    while (read(ctl, &b, 1) > 0) {
    }
    return 0;
  });
  char ok = 0;
  ASSERT_TRUE(get(holder.report, &ok, 1, 20000));
  ASSERT_EQ(ok, 'y');
  RawConn c;
  ASSERT_EQ(c.open(dir_), KVF_SUCCESS);
  kvf_proto_msg reply;
  ASSERT_EQ(register_sparse(c, 2ull << 30, 2, &reply), KVF_SUCCESS);
  std::printf("2 GiB beside another process's 3 GiB: %s\n", describe(reply).c_str());
  ASSERT_EQ(reply.type, KVF_PROTO_ERROR);
  EXPECT_EQ(reply.u.error.status, (uint32_t)KVF_ERR_BUSY);
  EXPECT_STREQ(reply.u.error.field, "quota.server_mapped_bytes");
  kvf_proto_msg_clear(&reply);
  ASSERT_EQ(register_sparse(c, 512ull << 20, 3, &reply), KVF_SUCCESS);
  EXPECT_EQ(reply.type, KVF_PROTO_REGISTER_REPLY) << describe(reply);
  kvf_proto_msg_clear(&reply);
  // The holder leaves: its 3 GiB are unmapped, and 2 GiB fit now.
  close(holder.control);
  holder.control = -1;
  EXPECT_EQ(finish(holder), 0);
  kvf_status st = KVF_SUCCESS;
  for (int i = 0; i < 100; i++) {
    ASSERT_EQ(register_sparse(c, 2ull << 30, 4 + i, &reply), KVF_SUCCESS);
    st = reply.type == KVF_PROTO_REGISTER_REPLY ? KVF_SUCCESS : (kvf_status)reply.u.error.status;
    kvf_proto_msg_clear(&reply);
    if (st == KVF_SUCCESS) break;
    sleep_ms(20);
  }
  EXPECT_EQ(st, KVF_SUCCESS) << "the holder's bytes were not given back";
  c.close();

  // Registrations: live + draining at most 3. Each STORE holds a lease on
  // the registration it was admitted on for 1.5 s, so the one it replaces
  // drains until then.
  kvf_client_options co = KVF_CLIENT_OPTIONS_INIT;
  co.socket_dir = dir_.c_str();
  kvf_client *cl = nullptr;
  ASSERT_EQ(kvf_client_connect(&co, &cl, nullptr), KVF_SUCCESS) << kvf_last_error();
  HostAlloc a(7);
  kvf_client_region regs[2] = {{a.a, 0, a.region}, {a.a, a.region, a.region}};
  uint32_t block0[1] = {0};
  kvf_group_blocks g = {block0, 0, 1};
  std::vector<uint64_t> requests;
  kvf_status last = KVF_SUCCESS;
  std::string refusal;
  for (int k = 0; k < 4; k++) {
    last = kvf_client_register(cl, kTinyGeometry, strlen(kTinyGeometry), -1, regs, 2, nullptr);
    if (last != KVF_SUCCESS) {
      refusal = kvf_last_error();
      break;
    }
    kvf_chunk_key key = KeyOf(0x100 + (uint64_t)k);
    kvf_client_xfer x = KVF_CLIENT_XFER_INIT;
    x.token_begin = 0;
    x.token_end = 16;
    x.chunk_keys = &key;
    x.num_chunk_keys = 1;
    x.groups = &g;
    x.num_groups = 1;
    uint64_t id = 0;
    ASSERT_EQ(kvf_client_submit(cl, KVF_CLIENT_STORE, &x, &id), KVF_SUCCESS) << kvf_last_error();
    requests.push_back(id);
  }
  std::printf("a fourth registration while three are held: %s\n", refusal.c_str());
  EXPECT_EQ(last, KVF_ERR_BUSY);
  EXPECT_EQ(refusal.rfind("quota.registrations: ", 0), 0u) << refusal;
  EXPECT_EQ(requests.size(), 3u);
  for (uint64_t id : requests) {
    kvf_client_result r = KVF_CLIENT_RESULT_INIT;
    EXPECT_EQ(kvf_client_wait(cl, id, 30000, &r), KVF_SUCCESS) << kvf_last_error();
  }
  // Once their requests retire the draining ones go: it registers again.
  for (int i = 0; i < 100; i++) {
    last = kvf_client_register(cl, kTinyGeometry, strlen(kTinyGeometry), -1, regs, 2, nullptr);
    if (last == KVF_SUCCESS) break;
    sleep_ms(20);
  }
  EXPECT_EQ(last, KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(kvf_client_unregister(cl, 0, nullptr), KVF_SUCCESS) << kvf_last_error();
  kvf_client_disconnect(cl);
  EXPECT_EQ(server_.fds(), fds0) << "the server kept descriptors";
  EXPECT_EQ(server_.memfd_maps(), maps0) << "the server kept mappings";
  EXPECT_EQ(server_.stop(), 0) << kServerCodes;
}

// ---- 4. numbers at the top of the 64-bit range ---------------------------------

// One STORE or RETRIEVE on c's live registration of the tiny geometry (16
// tokens a chunk and a block, 4 blocks): tokens [begin, end), one key, the
// group's table at first_block with `ids`; the reply within timeout_ms.
kvf_status xfer_raw(RawConn &c, uint16_t type, uint64_t begin, uint64_t end, uint64_t first_block,
                    std::vector<uint32_t> ids, kvf_proto_msg *reply, int timeout_ms) {
  kvf_chunk_key keys[1] = {KeyOf(0x70b)};
  kvf_proto_group g;
  std::memset(&g, 0, sizeof g);
  g.first_block = first_block;
  g.block_ids = ids.data();
  g.count = (uint32_t)ids.size();
  kvf_proto_msg m;
  std::memset(&m, 0, sizeof m);
  m.type = type;
  m.u.xfer.token_begin = begin;
  m.u.xfer.token_end = end;
  m.u.xfer.chunk_keys = keys;
  m.u.xfer.num_chunk_keys = 1;
  m.u.xfer.groups = &g;
  m.u.xfer.num_groups = 1;
  return c.call(&m, nullptr, 0, reply, timeout_ms);
}

// A one-frame hang (issue 12): a request whose token range lies at the top
// of the 64-bit range made the request check's block loop wrap and spin the
// event loop forever (nobody served, SIGTERM ignored). Each is refused with
// an ERROR naming the field within a second, the connection stays, and the
// server still stops cleanly.
TEST_F(Isolation, NumbersAtTheTopOfThe64BitRangeAreRefusedNamingTheField) {
  ASSERT_TRUE(server_.start(dir_, 30000, [](kvf_server_options &o) { o.l1_bytes = 64ull << 20; }));
  HostAlloc a(1);
  RawConn conn;
  ASSERT_EQ(conn.open(dir_), KVF_SUCCESS);
  ASSERT_NO_FATAL_FAILURE(expect_registered(conn, a));
  kvf_proto_msg reply;
  const uint64_t top = UINT64_MAX - 15;  // 2^64 - 16: a multiple of chunk_tokens 16
  struct Case {
    const char *what;
    uint64_t begin, end, first_block;
    std::vector<uint32_t> ids;
    const char *field;
  } cases[] = {
      {"tokens [2^64-16, 2^64-15), block 0 at first_block 0 (the issue's frame)", top, top + 1, 0, {0},
       "payload.token_end"},
      {"tokens [2^64-16, 2^64-1)", top, UINT64_MAX, 0, {0}, "payload.token_end"},
      {"tokens [2^64-16, 2^64-15), the block table where those tokens are", top, top + 1, top / 16, {0},
       "payload.token_end"},
      {"tokens [0, 16), first_block 2^64-1 with 2 ids (first_block + count wraps)", 0, 16, UINT64_MAX, {0, 1},
       "payload.groups[0].first_block"},
  };
  for (uint16_t type : {(uint16_t)KVF_PROTO_STORE, (uint16_t)KVF_PROTO_RETRIEVE})
    for (const Case &k : cases) {
      SCOPED_TRACE(std::string(kvf_proto_type_name(type)) + " " + k.what);
      int64_t t0 = mono_us();
      kvf_status st = xfer_raw(conn, type, k.begin, k.end, k.first_block, k.ids, &reply, 5000);
      double ms = (double)(mono_us() - t0) / 1000.0;
      std::printf("%s %s: %s in %.1f ms\n", kvf_proto_type_name(type), k.what,
                  st == KVF_SUCCESS ? describe(reply).c_str() : kvf_status_string(st), ms);
      if (st != KVF_SUCCESS) {
        int rc = server_.stop(10000);
        FAIL() << "no reply within 5 s (" << kvf_status_string(st) << "): the server hangs; SIGTERM "
               << (rc == -1 ? "did not stop it within 10 s" : "then stopped it");
      }
      EXPECT_LT(ms, 1000.0 * kTimingScale);
      EXPECT_EQ(reply.type, KVF_PROTO_ERROR) << describe(reply);
      EXPECT_EQ(reply.u.error.status, (uint32_t)KVF_ERR_INVALID_ARGUMENT) << describe(reply);
      EXPECT_STREQ(reply.u.error.field, k.field) << describe(reply);
      kvf_proto_msg_clear(&reply);
      // The connection stays and is served.
      ASSERT_EQ(conn.simple(KVF_PROTO_HEARTBEAT, &reply), KVF_SUCCESS);
      EXPECT_EQ(reply.type, KVF_PROTO_HEARTBEAT_REPLY);
      kvf_proto_msg_clear(&reply);
    }
  // A request at the top that fits still works as any other: the last
  // chunk below 2^64, stored and restored (nothing held there: a miss).
  ASSERT_EQ(xfer_raw(conn, KVF_PROTO_RETRIEVE, top - 16, top, (top - 16) / 16, {0}, &reply, 5000), KVF_SUCCESS);
  EXPECT_EQ(reply.type, KVF_PROTO_RETRIEVE_REPLY) << describe(reply);
  kvf_proto_msg_clear(&reply);
  ASSERT_EQ(xfer_raw(conn, KVF_PROTO_STORE, top - 16, top, (top - 16) / 16, {0}, &reply, 5000), KVF_SUCCESS);
  ASSERT_EQ(reply.type, KVF_PROTO_STORE_REPLY) << describe(reply);
  EXPECT_EQ(reply.u.xfer_reply.outcome, 1u) << reply.u.xfer_reply.message;
  EXPECT_EQ(reply.u.xfer_reply.prefix_tokens, top);
  kvf_proto_msg_clear(&reply);
  conn.close();
  int rc = server_.stop(10000);
  EXPECT_EQ(rc, 0) << (rc == -1 ? "SIGTERM did not stop the server within 10 s" : kServerCodes);
}

// A one-frame stall: a geometry of 1-token blocks and chunks of 2^24
// tokens (both within the limits), and a STORE or RETRIEVE of 65536 chunks
// naming one block. The request check walked every block of every chunk
// (2^40 of them) whatever the table held; it now walks only the blocks the
// table names, so the request is answered within a second and another
// client is served meanwhile.
TEST_F(Isolation, AdmissionWorkIsBoundedByTheTableNotTheChunkSize) {
  ASSERT_TRUE(server_.start(dir_, 30000, [](kvf_server_options &o) { o.l1_bytes = 64ull << 20; }));
  const std::string json = R"({"format": "kvferry-geometry", "version": 1, "name": "wide-chunks",
    "regions": [{"name": "kv", "size": 0}],
    "groups": [{"name": "full", "kind": "full", "block_size": 1, "num_blocks": 4,
      "layers": [{"count": 1, "name": "layer", "region": "kv", "offset": 0, "elem_bytes": 2,
        "block_stride": 64, "planes": 1, "heads": 1, "head_bytes": 64, "plane_stride": 0,
        "token_stride": 64, "head_stride": 64}]}],
    "objects": {"chunk_tokens": 16777216, "format": "canonical"}})";
  std::vector<uint64_t> sizes = region_sizes(json);
  ASSERT_EQ(sizes.size(), 1u);
  uint64_t size = round_page(sizes[0]);
  kvf_mem_alloc_options ao = KVF_MEM_ALLOC_OPTIONS_INIT;
  ao.size = size;
  kvf_mem_alloc *raw = nullptr;
  ASSERT_EQ(kvf_mem_alloc_create(&ao, &raw), KVF_SUCCESS) << kvf_last_error();
  std::unique_ptr<kvf_mem_alloc, void (*)(kvf_mem_alloc *)> a(raw, kvf_mem_alloc_destroy);
  kvf_mem_identity id;
  int fd = -1;
  ASSERT_EQ(kvf_mem_alloc_export(a.get(), &fd, &id), KVF_SUCCESS);
  RawConn conn;
  ASSERT_EQ(conn.open(dir_), KVF_SUCCESS);
  kvf_proto_msg reply;
  ASSERT_EQ(register_raw(conn, json, {region_of(id, 0, sizes[0], 0)}, {fd}, &reply), KVF_SUCCESS);
  close(fd);
  ASSERT_EQ(reply.type, KVF_PROTO_REGISTER_REPLY) << describe(reply);
  kvf_proto_msg_clear(&reply);
  const uint32_t chunks = KVF_PROTO_MAX_CHUNKS;
  std::vector<kvf_chunk_key> keys(chunks);
  for (uint32_t k = 0; k < chunks; k++) keys[k] = KeyOf(0x9000 + k);
  uint32_t ids[1] = {0};
  for (uint16_t type : {(uint16_t)KVF_PROTO_STORE, (uint16_t)KVF_PROTO_RETRIEVE}) {
    SCOPED_TRACE(kvf_proto_type_name(type));
    kvf_proto_group g;
    std::memset(&g, 0, sizeof g);
    g.block_ids = ids;
    g.count = 1;
    kvf_proto_msg m;
    std::memset(&m, 0, sizeof m);
    m.type = type;
    m.u.xfer.token_end = (uint64_t)chunks << 24;
    m.u.xfer.chunk_keys = keys.data();
    m.u.xfer.num_chunk_keys = chunks;
    m.u.xfer.groups = &g;
    m.u.xfer.num_groups = 1;
    int64_t t0 = mono_us();
    kvf_status st = conn.call(&m, nullptr, 0, &reply, 5000);
    double ms = (double)(mono_us() - t0) / 1000.0;
    std::printf("%s of 2^40 tokens (65536 chunks of 2^24 one-token blocks; a 2 MiB frame), one block named: %s in %.1f ms\n",
                kvf_proto_type_name(type), st == KVF_SUCCESS ? describe(reply).c_str() : kvf_status_string(st), ms);
    if (st != KVF_SUCCESS) {
      int rc = server_.stop(10000);
      FAIL() << "no reply within 5 s (" << kvf_status_string(st) << "): the loop is stuck in admission; SIGTERM "
             << (rc == -1 ? "did not stop it within 10 s" : "then stopped it");
    }
    EXPECT_LT(ms, 1000.0 * kTimingScale);
    EXPECT_EQ(reply.type, (uint16_t)(type | KVF_PROTO_REPLY)) << describe(reply);
    kvf_proto_msg_clear(&reply);
  }
  double stat_ms = 0;
  stat_now(&stat_ms);
  EXPECT_LT(stat_ms, 1000.0 * kTimingScale);
  conn.close();
  EXPECT_EQ(server_.stop(10000), 0) << kServerCodes;
}

// ---- 5. names -----------------------------------------------------------------------

// HELLO over a fresh connection with the name's raw bytes (the client
// library refuses to send what is not UTF-8); the reply.
kvf_status hello_raw(const std::string &dir, const std::string &name, kvf_proto_msg *reply, kvf_conn *conn) {
  kvf_status st = kvf_endpoint_connect(dir.c_str(), 0, conn);
  if (st != KVF_SUCCESS) return st;
  uint64_t instance = 0, generation = 0;
  kvf_mem_instance(&instance, &generation);
  std::vector<uint8_t> f(KVF_PROTO_HEADER_SIZE + 28 + name.size());
  auto le = [&](size_t at, uint64_t v, unsigned n) {
    for (unsigned i = 0; i < n; i++) f[at + i] = (uint8_t)(v >> (8 * i));
  };
  le(0, KVF_PROTO_MAGIC, 4);
  le(4, KVF_PROTO_VERSION, 2);
  le(6, KVF_PROTO_HELLO, 2);
  le(8, 1, 8);
  le(16, f.size() - KVF_PROTO_HEADER_SIZE, 4);
  size_t p = KVF_PROTO_HEADER_SIZE;
  le(p + 0, KVF_PROTO_VERSION, 2);
  le(p + 2, KVF_PROTO_VERSION, 2);
  le(p + 4, (uint32_t)getpid(), 4);
  le(p + 8, instance, 8);
  le(p + 16, generation, 8);
  le(p + 24, name.size(), 4);
  std::memcpy(f.data() + p + 28, name.data(), name.size());
  if (!put(conn->fd, f.data(), f.size())) return KVF_ERR_SYSTEM;
  kvf_proto_header h;
  uint8_t *payload = nullptr;
  uint32_t n = 0;
  st = kvf_conn_read_frame(conn, 5000, &h, &payload, nullptr, 0, &n);
  if (st != KVF_SUCCESS) return st;
  st = kvf_proto_decode(&h, payload, reply);
  std::free(payload);
  return st;
}

// The protocol says names are UTF-8: a HELLO whose name is not (overlong,
// surrogate, past U+10FFFF, cut short) gets an ERROR naming payload.name and
// the connection is closed; the server serves the next client as before.
TEST_F(Isolation, HelloNamesThatAreNotUtf8AreRefusedNamingTheField) {
  ASSERT_TRUE(server_.start(dir_, 30000, [](kvf_server_options &o) { o.l1_bytes = 64ull << 20; }));
  const std::pair<const char *, std::string> bad[] = {
      {"an overlong '/' (C0 AF)", "engine\xc0\xaf"},
      {"a surrogate (ED A0 80)", "\xed\xa0\x80"},
      {"U+110000 (F4 90 80 80)", "\xf4\x90\x80\x80-x"},
      {"a sequence cut short at the end (E2 82)", "price \xe2\x82"},
      {"a lone continuation byte (80)", "\x80"},
  };
  for (const auto &b : bad) {
    SCOPED_TRACE(b.first);
    kvf_conn conn;
    kvf_proto_msg reply;
    std::memset(&reply, 0, sizeof reply);
    ASSERT_EQ(hello_raw(dir_, b.second, &reply, &conn), KVF_SUCCESS) << kvf_last_error();
    std::printf("a name with %s: %s\n", b.first, describe(reply).c_str());
    EXPECT_EQ(reply.type, KVF_PROTO_ERROR) << describe(reply);
    EXPECT_EQ(reply.u.error.status, (uint32_t)KVF_ERR_PROTOCOL) << describe(reply);
    EXPECT_STREQ(reply.u.error.field, "payload.name") << describe(reply);
    kvf_proto_msg_clear(&reply);
    // Then the server closes the connection.
    kvf_proto_header h;
    uint8_t *payload = nullptr;
    uint32_t n = 0;
    EXPECT_NE(kvf_conn_read_frame(&conn, 5000, &h, &payload, nullptr, 0, &n), KVF_SUCCESS);
    std::free(payload);
    kvf_conn_close(&conn);
  }
  // Well-formed names of every length class are welcome, and the client
  // library refuses to send one that is not.
  for (const char *good : {"w\xc3\xb6rker", "\xe2\x82\xac-engine", "\xf0\x9f\x98\x80"}) {
    RawConn c;
    EXPECT_EQ(c.open(dir_, 0, 0, good), KVF_SUCCESS) << good;
  }
  kvf_client_options o = KVF_CLIENT_OPTIONS_INIT;
  o.socket_dir = dir_.c_str();
  o.name = "bad\xc0\xaf";
  kvf_client *cl = nullptr;
  EXPECT_EQ(kvf_client_connect(&o, &cl, nullptr), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(std::string(kvf_last_error()).rfind("options.name: not UTF-8", 0), 0u) << kvf_last_error();
  kvf_client_disconnect(cl);
  EXPECT_EQ(stat_now().active, 0u);
  EXPECT_EQ(server_.stop(), 0) << kServerCodes;
}

#if defined(KVF_KVFERRYD_PATH) && defined(KVF_KVFERRY_PATH)
// What a command printed on stdout (and its exit status in *rc).
std::string run_capture(const std::string &cmd, int *rc) {
  std::string out;
  FILE *p = popen(cmd.c_str(), "r");
  if (p == nullptr) return out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  int st = pclose(p);
  *rc = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return out;
}

// A client named with terminal escape sequences (set the window title,
// clear the screen, ring the bell): `kvferry stat` against the kvferryd
// binary shows them as \xNN text, never as raw bytes.
TEST_F(Isolation, KvferryStatEscapesControlCharactersInClientNames) {
  ASSERT_NO_FATAL_FAILURE(start_server_binary(KVF_KVFERRYD_PATH));
  const char *evil = "\x1b]0;pwned\x07\x1b[2J\x1b[31mred\\x";
  RawConn c;
  ASSERT_EQ(c.open(dir_, 0, 0, evil), KVF_SUCCESS);
  for (const char *json : {"", " --json"}) {
    SCOPED_TRACE(json[0] ? "--json" : "text");
    int rc = -1;
    std::string out = run_capture(std::string(KVF_KVFERRY_PATH) + " stat --socket-dir " + dir_ + json, &rc);
    EXPECT_EQ(rc, 0) << out;
    size_t raw = out.find_first_of("\x1b\x07");
    EXPECT_EQ(raw, std::string::npos) << "a raw control byte at offset " << raw << " of:\n" << out;
    for (unsigned char ch : out)
      EXPECT_TRUE(ch == '\n' || (ch >= 0x20 && ch < 0x7f)) << "byte 0x" << std::hex << (int)ch << " in:\n" << out;
    if (!json[0]) {
      EXPECT_NE(out.find("\\x1b]0;pwned\\x07\\x1b[2J\\x1b[31mred\\\\x"), std::string::npos) << out;
      std::printf("%s", out.c_str());
    }
  }
  c.close();
  EXPECT_EQ(server_.stop(10000), 0) << "kvferryd's exit status";
}

// `kvferry stat --json` is JSON a parser reads back: a name of control
// characters, quotes and a backslash, and one of UTF-8 past ASCII, come back
// exactly as sent, in an output of printable ASCII. (Names that are not
// UTF-8 never get this far: HELLO refuses them.)
TEST_F(Isolation, KvferryStatJsonKeepsClientNames) {
  ASSERT_NO_FATAL_FAILURE(start_server_binary(KVF_KVFERRYD_PATH));
  const char *const names[] = {"\x1b[31mred \"q\" \\", "caf\xc3\xa9 \xe6\x97\xa5\xe6\x9c\xac"};
  RawConn conns[2];
  for (int i = 0; i < 2; i++) ASSERT_EQ(conns[i].open(dir_, 0, 0, names[i]), KVF_SUCCESS);
  int rc = -1;
  std::string out = run_capture(std::string(KVF_KVFERRY_PATH) + " stat --json --socket-dir " + dir_, &rc);
  EXPECT_EQ(rc, 0) << out;
  for (unsigned char ch : out)
    EXPECT_TRUE(ch == '\n' || (ch >= 0x20 && ch < 0x7f)) << "byte 0x" << std::hex << (int)ch << " in:\n" << out;
  json_error_t err;
  json_t *root = json_loads(out.c_str(), 0, &err);
  ASSERT_NE(root, nullptr) << "not JSON (" << err.text << " at line " << err.line << "):\n" << out;
  json_t *clients = json_object_get(root, "clients");
  ASSERT_TRUE(json_is_array(clients)) << out;
  for (const char *name : names) {
    bool found = false;
    for (size_t i = 0; i < json_array_size(clients); i++) {
      const char *got = json_string_value(json_object_get(json_array_get(clients, i), "name"));
      found = found || (got && std::string(got) == name);
    }
    EXPECT_TRUE(found) << "no client named " << testing::PrintToString(name) << " in:\n" << out;
  }
  EXPECT_TRUE(json_is_integer(json_object_get(root, "server_pid"))) << out;
  EXPECT_TRUE(json_is_string(json_object_get(root, "boot_token"))) << out;
  EXPECT_TRUE(json_is_object(json_object_get(root, "l1"))) << out;
  EXPECT_TRUE(json_is_array(json_object_get(root, "peers"))) << out;
  json_decref(root);
  for (RawConn &c : conns) c.close();
  EXPECT_EQ(server_.stop(10000), 0) << "kvferryd's exit status";
}
#endif

}  // namespace
