// One client can never stall or starve another (issue 12): kvferryd's event
// loop under attack, with real processes. The server runs in a forked
// process (as kvferryd would), each attacker in forked processes writing raw
// frames over the socket, and a legitimate engine in the test process: a
// kvf_client with its heartbeat thread and a registration of the tiny
// host-backend geometry. During each attack the test measures the engine's
// heartbeat round trip, and the time a new client takes to connect and get
// a STAT answered, and holds them to a bound; the engine must never be
// reaped, and the attacker gets an ERROR naming the field or is
// disconnected.
//
// The bounds are stated once (kHeartbeatP99Ms and below) and hold on a
// loaded 2-core machine under ASan: the attackers then compete with the
// server for the CPU, so they are a few times what an idle machine shows,
// and far below what an attack that works costs (seconds: the attack's
// whole duration).
#include <gtest/gtest.h>

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <poll.h>
#include <signal.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <kvferry/client.h>
#include <kvferry/geometry.h>
#include <kvferry/memory.h>

#include "chunk_key_util.h"
#include "host/core/log.h"
#include "host/ipc/endpoint.h"
#include "host/ipc/protocol.h"
#include "host/server/server.h"

#include "mem_test_util.h"
#include "server_test_util.h"

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define KVF_TEST_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define KVF_TEST_SANITIZED 1
#endif
#endif

namespace {

using kvf_mem_test::fd_count;
using kvf_server_test::kTinyGeometry;

// ---- the bounds ----------------------------------------------------------------

// The engine's heartbeat round trip (kvf_client_heartbeat) during an attack:
// 99th percentile and worst case.
constexpr double kHeartbeatP99Ms = 50.0;
constexpr double kHeartbeatMaxMs = 250.0;
// A new client: connect, HELLO, STAT, disconnect, worst case.
constexpr double kConnectMaxMs = 500.0;
// The server's VmRSS says what it holds, except under a sanitizer: ASan
// keeps freed blocks in quarantine (256 MiB) and both add shadow memory, so
// there the memory bounds are printed, not asserted.
#ifdef KVF_TEST_SANITIZED
constexpr bool kRssBounds = false;
#else
constexpr bool kRssBounds = true;
#endif

// ---- time, processes, /proc -------------------------------------------------------

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

// A child's exit status, or 1000 + the signal that ended it; -1 if it still
// runs after timeout_ms.
int reap(pid_t pid, int timeout_ms) {
  int64_t deadline = mono_ms() + timeout_ms;
  for (;;) {
    int status = 0;
    pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid) return WIFEXITED(status) ? WEXITSTATUS(status) : 1000 + WTERMSIG(status);
    if (r < 0 && errno != EINTR) return -2;
    if (mono_ms() > deadline) return -1;
    sleep_ms(2);
  }
}

pid_t fork_clean() {
  std::fflush(nullptr);
  return fork();
}

// A field of /proc/<pid>/status ("VmRSS" in kB, "Threads"), or -1.
long proc_status(pid_t pid, const char *field) {
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
  FILE *f = fopen(path, "r");
  if (!f) return -1;
  char line[256];
  long v = -1;
  size_t n = strlen(field);
  while (fgets(line, sizeof line, f))
    if (!strncmp(line, field, n) && line[n] == ':') {
      v = strtol(line + n + 1, nullptr, 10);
      break;
    }
  fclose(f);
  return v;
}

int proc_fds(pid_t pid) {
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/fd", (int)pid);
  DIR *d = opendir(path);
  if (!d) return -1;
  int n = 0;
  while (struct dirent *e = readdir(d))
    if (e->d_name[0] != '.') n++;
  closedir(d);
  return n;
}

// The value once it holds still for stable_reads reads 20 ms apart (100 ms
// by default: a dropped connection is closed a moment after the peer
// notices), within 5 s more than that.
template <typename F>
long steady(F read, int stable_reads = 5) {
  long last = read(), same = 0;
  for (int i = 0; i < 250 + stable_reads && same < stable_reads; i++) {
    sleep_ms(20);
    long now = read();
    same = now == last ? same + 1 : 0;
    last = now;
  }
  return last;
}

// ---- latency -------------------------------------------------------------------

struct Latency {
  std::mutex mu;
  std::vector<double> ms;
  int failures = 0;
  std::string first_failure;
  void add(double v) {
    std::lock_guard<std::mutex> g(mu);
    ms.push_back(v);
  }
  void fail(const std::string &why) {
    std::lock_guard<std::mutex> g(mu);
    if (failures++ == 0) first_failure = why;
  }
  double pct(double p) {
    std::lock_guard<std::mutex> g(mu);
    if (ms.empty()) return 0;
    std::vector<double> v = ms;
    std::sort(v.begin(), v.end());
    size_t i = (size_t)(p / 100.0 * (double)(v.size() - 1) + 0.5);
    return v[std::min(i, v.size() - 1)];
  }
  double max() { return pct(100); }
  size_t count() {
    std::lock_guard<std::mutex> g(mu);
    return ms.size();
  }
  std::string summary() {
    char b[256];
    snprintf(b, sizeof b, "%zu samples, p50 %.2f ms, p99 %.2f ms, max %.2f ms, %d failed%s%s", count(), pct(50),
             pct(99), max(), failures, failures ? ": " : "", first_failure.c_str());
    return b;
  }
};

// ---- raw frames ------------------------------------------------------------------

std::vector<uint8_t> encode(const kvf_proto_msg &m) {
  uint8_t *f = nullptr;
  size_t n = 0;
  if (kvf_proto_encode(&m, &f, &n) != KVF_SUCCESS) return {};
  std::vector<uint8_t> v(f, f + n);
  free(f);
  return v;
}

std::vector<uint8_t> hello_frame(uint64_t request_id) {
  kvf_proto_msg m;
  memset(&m, 0, sizeof m);
  m.type = KVF_PROTO_HELLO;
  m.request_id = request_id;
  m.u.hello.min_version = m.u.hello.max_version = KVF_PROTO_VERSION;
  m.u.hello.pid = (uint32_t)getpid();
  m.u.hello.instance_id = 0x4154544143ull; /* "ATTAC" */
  snprintf(m.u.hello.name, sizeof m.u.hello.name, "attacker");
  return encode(m);
}

std::vector<uint8_t> heartbeat_frame(uint64_t request_id) {
  kvf_proto_msg m;
  memset(&m, 0, sizeof m);
  m.type = KVF_PROTO_HEARTBEAT;
  m.request_id = request_id;
  m.u.heartbeat.sequence = request_id;
  return encode(m);
}

// A connected socket to dir's server (blocking, or not), or -1.
int connect_raw(const std::string &dir, bool nonblocking) {
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | (nonblocking ? SOCK_NONBLOCK : 0), 0);
  if (fd < 0) return -1;
  struct sockaddr_un a;
  memset(&a, 0, sizeof a);
  a.sun_family = AF_UNIX;
  snprintf(a.sun_path, sizeof a.sun_path, "%s/%s", dir.c_str(), KVF_ENDPOINT_SOCKET_NAME);
  if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

bool write_all(int fd, const uint8_t *p, size_t n) {
  while (n > 0) {
    ssize_t w = write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    p += w;
    n -= (size_t)w;
  }
  return true;
}

// Read one frame within timeout_ms and decode it; false on EOF, timeout or
// garbage.
bool read_msg(int fd, int timeout_ms, kvf_proto_msg *out) {
  kvf_conn c;
  kvf_conn_init(&c, fd, 0);
  kvf_proto_header h;
  uint8_t *payload = nullptr;
  int fds[4];
  uint32_t nfds = 0;
  bool ok = kvf_conn_read_frame(&c, timeout_ms, &h, &payload, fds, 4, &nfds) == KVF_SUCCESS &&
            kvf_proto_decode(&h, payload, out) == KVF_SUCCESS;
  free(payload);
  c.fd = -1; /* the socket stays the caller's */
  kvf_conn_close(&c);
  return ok;
}

// Wait for a byte on fd (the go signal); false when it closed first.
bool wait_go(int fd) {
  char b = 0;
  for (;;) {
    ssize_t n = read(fd, &b, 1);
    if (n < 0 && errno == EINTR) continue;
    return n == 1;
  }
}

// ---- the server ------------------------------------------------------------------

kvf_server *g_child_server;
void child_on_term(int) { kvf_server_stop(g_child_server); }

using Options = std::function<void(kvf_server_options *)>;

// kvferryd's server object in a forked process. It exits 0 after SIGTERM only
// if it drained cleanly (nothing mapped or leased) and holds as many
// descriptors as before it was created.
class ServerProcess {
 public:
  ~ServerProcess() { kill_now(); }
  bool start(const std::string &dir, const Options &set) {
    pid_ = fork_clean();
    if (pid_ < 0) return false;
    if (pid_ == 0) {
      sigset_t term, old;
      sigemptyset(&term);
      sigaddset(&term, SIGTERM);
      sigprocmask(SIG_BLOCK, &term, &old);
      signal(SIGTERM, child_on_term);
      signal(SIGPIPE, SIG_IGN);
      int before = fd_count();
      kvf_server_options o = KVF_SERVER_OPTIONS_INIT;
      o.socket_dir = dir.c_str();
      if (set) set(&o);
      if (kvf_server_create(&o, &g_child_server) != KVF_SUCCESS) _exit(2);
      sigprocmask(SIG_SETMASK, &old, nullptr);
      kvf_status st = kvf_server_run(g_child_server);
      kvf_registry_stats s = KVF_REGISTRY_STATS_INIT;
      kvf_server_stats(g_child_server, &s);
      kvf_server_destroy(g_child_server);
      if (st != KVF_SUCCESS) _exit(3);
      if (s.imports != 0 || s.aliases != 0 || s.active != 0 || s.leases != 0) _exit(4);
      if (fd_count() != before) _exit(5);
      _exit(0);
    }
    return wait_ready(dir);
  }
  // The real kvferryd binary, with extra flags.
  bool start_binary(const std::string &binary, const std::string &dir, const std::vector<std::string> &flags) {
    pid_ = fork_clean();
    if (pid_ < 0) return false;
    if (pid_ == 0) {
      std::vector<const char *> argv = {binary.c_str(), "--socket-dir", dir.c_str(), "--devices", "none"};
      for (const std::string &f : flags) argv.push_back(f.c_str());
      argv.push_back(nullptr);
      execv(binary.c_str(), (char *const *)argv.data());
      _exit(127);
    }
    return wait_ready(dir);
  }
  // SIGTERM; the exit status (0: drained cleanly; 2 create, 3 run, 4 still
  // mapped, 5 descriptors leaked).
  int stop() {
    if (pid_ <= 0) return -1;
    kill(pid_, SIGTERM);
    int st = reap(pid_, 20000);
    if (st == -1) {
      kill(pid_, SIGKILL);
      st = 2000 + reap(pid_, 20000);
    }
    pid_ = -1;
    return st;
  }
  void kill_now() {
    if (pid_ <= 0) return;
    kill(pid_, SIGKILL);
    reap(pid_, 20000);
    pid_ = -1;
  }
  pid_t pid() const { return pid_; }

 private:
  bool wait_ready(const std::string &dir) {
    for (int i = 0; i < 1000; i++) {
      int fd = connect_raw(dir, false);
      if (fd >= 0) {
        close(fd);
        return true;
      }
      if (reap(pid_, 0) >= 0) {
        pid_ = -1;
        return false;
      }
      sleep_ms(10);
    }
    return false;
  }
  pid_t pid_ = -1;
};

// ---- attackers -------------------------------------------------------------------

// A forked attacker: it waits for go(), attacks, and exits with 0 when it
// could attack (10+: the step that failed). stop() closes its control pipe.
struct Attacker {
  pid_t pid = -1;
  int go_fd = -1;
  void go() {
    char b = 'g';
    if (write(go_fd, &b, 1) != 1) ADD_FAILURE() << "the attacker is gone";
  }
  int finish(int timeout_ms = 20000) {
    if (go_fd >= 0) close(go_fd);
    go_fd = -1;
    if (pid <= 0) return -1;
    int st = reap(pid, timeout_ms);
    if (st == -1) {
      kill(pid, SIGKILL);
      st = 2000 + reap(pid, 20000);
    }
    pid = -1;
    return st;
  }
  ~Attacker() {
    if (pid > 0) {
      kill(pid, SIGKILL);
      reap(pid, 20000);
    }
    if (go_fd >= 0) close(go_fd);
  }
};

// body(go_fd) runs in the child; its return value is the exit status.
void spawn(Attacker *a, const std::function<int(int)> &body) {
  int p[2];
  ASSERT_EQ(pipe2(p, O_CLOEXEC), 0);
  pid_t pid = fork_clean();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    close(p[1]);
    signal(SIGPIPE, SIG_IGN);
    _exit(body(p[0]));
  }
  close(p[0]);
  a->pid = pid;
  a->go_fd = p[1];
}

// Flood: HELLO, then heartbeats as fast as the socket takes them for
// duration_ms, while a second process reads every reply. Writes to `report`
// how many heartbeats the server took ("frames\n").
int flood_main(const std::string &dir, int go, int duration_ms, int report) {
  std::vector<uint8_t> hello = hello_frame(1);
  std::vector<uint8_t> burst;
  for (int i = 0; i < 4096; i++) {
    std::vector<uint8_t> f = heartbeat_frame(2 + (uint64_t)i);
    burst.insert(burst.end(), f.begin(), f.end());
  }
  if (!wait_go(go)) return 10;
  int fd = connect_raw(dir, false);
  if (fd < 0) return 11;
  if (!write_all(fd, hello.data(), hello.size())) return 12;
  kvf_proto_msg m;
  if (!read_msg(fd, 5000, &m) || m.type != KVF_PROTO_HELLO_REPLY) return 13;
  kvf_proto_msg_clear(&m);
  pid_t reader = fork();
  if (reader == 0) {
    static uint8_t sink[1 << 16];
    for (;;) {
      ssize_t n = read(fd, sink, sizeof sink);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) _exit(0);
    }
  }
  if (reader < 0) return 14;
  struct timeval tv = {0, 200000}; /* a write blocked this long: look at the clock */
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  int64_t end = mono_ms() + duration_ms;
  size_t off = 0;
  uint64_t written = 0;
  while (mono_ms() < end) {
    ssize_t w = write(fd, burst.data() + off, burst.size() - off);
    if (w < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (w <= 0) break; /* dropped */
    off = (off + (size_t)w) % burst.size();
    written += (uint64_t)w;
  }
  dprintf(report, "%llu\n", (unsigned long long)(written / (burst.size() / 4096)));
  close(fd);
  kill(reader, SIGKILL);
  waitpid(reader, nullptr, 0);
  return 0;
}

// Idle: hold up to `want` connections that never say HELLO for duration_ms;
// a connection the server drops is replaced at once. Writes to `report` how
// many it opened and how many the server dropped ("opened dropped\n").
int idle_main(const std::string &dir, int go, size_t want, int duration_ms, int report) {
  if (!wait_go(go)) return 10;
  std::vector<int> fds;
  std::vector<struct pollfd> pf;
  long opened = 0, dropped = 0;
  int64_t end = mono_ms() + duration_ms;
  while (mono_ms() < end) {
    while (fds.size() < want) {
      int fd = connect_raw(dir, true);
      if (fd < 0) break; /* the backlog is full: the server has not accepted yet */
      fds.push_back(fd);
      opened++;
    }
    pf.resize(fds.size());
    for (size_t i = 0; i < fds.size(); i++) pf[i] = {fds[i], POLLIN, 0};
    int rc = poll(pf.data(), pf.size(), 2);
    if (rc < 0 && errno != EINTR) return 11;
    for (size_t i = fds.size(); i-- > 0;) {
      if (!pf[i].revents) continue;
      char buf[4096];
      ssize_t n = read(fds[i], buf, sizeof buf);
      if (n > 0) continue; /* an ERROR: the close follows */
      close(fds[i]);
      fds[i] = fds.back();
      fds.pop_back();
      dropped++;
    }
  }
  for (int fd : fds) close(fd);
  dprintf(report, "%ld %ld\n", opened, dropped);
  return 0;
}

// The 24-byte header of a STORE frame with payload_len bytes of payload.
std::vector<uint8_t> store_header(uint64_t request_id, uint32_t payload_len) {
  std::vector<uint8_t> h(KVF_PROTO_HEADER_SIZE, 0);
  auto put = [&h](size_t at, uint64_t v, int n) {
    for (int i = 0; i < n; i++) h[at + i] = (uint8_t)(v >> (8 * i));
  };
  put(0, KVF_PROTO_MAGIC, 4);
  put(4, KVF_PROTO_VERSION, 2);
  put(6, KVF_PROTO_STORE, 2);
  put(8, request_id, 8);
  put(16, payload_len, 4);
  return h;
}

// Partial frames: n connections each say HELLO, then send the header of a
// STORE of payload_len bytes and all its payload but the last byte, then hold
// them until duration_ms has passed. Writes to `report` how many connections
// the server dropped and the field of the first ERROR it sent
// ("dropped field\n").
int partial_main(const std::string &dir, int go, int n, uint32_t payload_len, int duration_ms, int report) {
  std::vector<uint8_t> hello = hello_frame(1);
  std::vector<uint8_t> frame = store_header(2, payload_len);
  frame.resize(KVF_PROTO_HEADER_SIZE + payload_len - 1, 0);
  if (!wait_go(go)) return 10;
  std::vector<int> fds;
  for (int i = 0; i < n; i++) {
    int fd = connect_raw(dir, false);
    if (fd < 0) return 11;
    if (!write_all(fd, hello.data(), hello.size())) return 12;
    kvf_proto_msg m;
    if (!read_msg(fd, 5000, &m) || m.type != KVF_PROTO_HELLO_REPLY) return 13;
    kvf_proto_msg_clear(&m);
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
    fds.push_back(fd);
  }
  std::vector<size_t> off(fds.size(), 0);
  std::vector<bool> gone(fds.size(), false);
  std::string field = "-";
  int dropped = 0;
  int64_t end = mono_ms() + duration_ms;
  while (mono_ms() < end) {
    std::vector<struct pollfd> pf(fds.size());
    for (size_t i = 0; i < fds.size(); i++)
      pf[i] = {gone[i] ? -1 : fds[i], (short)(POLLIN | (off[i] < frame.size() ? POLLOUT : 0)), 0};
    int rc = poll(pf.data(), pf.size(), 5);
    if (rc < 0 && errno != EINTR) return 14;
    for (size_t i = 0; i < fds.size(); i++) {
      if (gone[i]) continue;
      if (pf[i].revents & POLLOUT) {
        ssize_t w = write(fds[i], frame.data() + off[i], frame.size() - off[i]);
        if (w > 0) off[i] += (size_t)w;
      }
      if (pf[i].revents & (POLLIN | POLLHUP | POLLERR)) {
        fcntl(fds[i], F_SETFL, fcntl(fds[i], F_GETFL) & ~O_NONBLOCK);
        kvf_proto_msg m;
        if (read_msg(fds[i], 1000, &m)) {
          if (m.type == KVF_PROTO_ERROR && field == "-") field = m.u.error.field[0] ? m.u.error.field : "(none)";
          kvf_proto_msg_clear(&m);
        }
        gone[i] = true;
        dropped++;
      }
    }
  }
  for (int fd : fds) close(fd);
  dprintf(report, "%d %s\n", dropped, field.c_str());
  return 0;
}

// Never reads: HELLO, then STATs with a record per client (a reply ten
// times the request) as fast as the socket takes them, never reading a
// reply, for duration_ms. Writes to `report` how many bytes of requests the
// server took and whether it closed the connection ("bytes closed\n").
int unread_main(const std::string &dir, int go, int duration_ms, int report) {
  std::vector<uint8_t> hello = hello_frame(1);
  kvf_proto_msg m;
  memset(&m, 0, sizeof m);
  m.type = KVF_PROTO_STAT;
  m.u.stat.flags = KVF_PROTO_STAT_PER_CLIENT;
  std::vector<uint8_t> burst;
  for (int i = 0; i < 4096; i++) {
    m.request_id = 2 + (uint64_t)i;
    std::vector<uint8_t> f = encode(m);
    burst.insert(burst.end(), f.begin(), f.end());
  }
  if (!wait_go(go)) return 10;
  int fd = connect_raw(dir, false);
  if (fd < 0) return 11;
  if (!write_all(fd, hello.data(), hello.size())) return 12;
  kvf_proto_msg r;
  if (!read_msg(fd, 5000, &r) || r.type != KVF_PROTO_HELLO_REPLY) return 13;
  kvf_proto_msg_clear(&r);
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
  uint64_t written = 0;
  size_t off = 0;
  int closed = 0;
  int64_t end = mono_ms() + duration_ms;
  while (mono_ms() < end && !closed) {
    ssize_t w = write(fd, burst.data() + off, burst.size() - off);
    if (w > 0) {
      written += (uint64_t)w;
      off = (off + (size_t)w) % burst.size();
      continue;
    }
    if (w < 0 && errno != EAGAIN && errno != EINTR) {
      closed = 1;
      break;
    }
    struct pollfd p = {fd, POLLOUT, 0};
    poll(&p, 1, 5);
    if (p.revents & (POLLHUP | POLLERR)) closed = 1;
  }
  close(fd);
  dprintf(report, "%llu %d\n", (unsigned long long)written, closed);
  return 0;
}

// What an attacker wrote on its report pipe, within timeout_ms.
std::string read_report(int fd, int timeout_ms) {
  std::string out;
  int64_t end = mono_ms() + timeout_ms;
  while (mono_ms() < end && (out.empty() || out.back() != '\n')) {
    struct pollfd p = {fd, POLLIN, 0};
    if (poll(&p, 1, 50) != 1) continue;
    char b[256];
    ssize_t n = read(fd, b, sizeof b);
    if (n <= 0) break;
    out.append(b, (size_t)n);
  }
  return out;
}

// ---- the legitimate engine ----------------------------------------------------------

uint64_t tiny_region_size() {
  kvf_geometry *g = nullptr;
  if (kvf_geometry_load_buffer(kTinyGeometry, strlen(kTinyGeometry), nullptr, &g, nullptr) != KVF_SUCCESS) return 0;
  kvf_region_info info = KVF_REGION_INFO_INIT;
  uint64_t size = kvf_geometry_region(g, 0, &info) == KVF_SUCCESS ? info.size : 0;
  kvf_geometry_destroy(g);
  return size;
}

// An engine in the test process: connected with a heartbeat thread,
// registered (one host allocation, two regions).
struct Engine {
  kvf_client *c = nullptr;
  kvf_mem_alloc *a = nullptr;
  kvf_client_info info = KVF_CLIENT_INFO_INIT;
  kvf_status connect(const std::string &dir, uint32_t period_ms, uint32_t timeout_ms) {
    kvf_client_options o = KVF_CLIENT_OPTIONS_INIT;
    o.socket_dir = dir.c_str();
    o.name = "engine";
    o.heartbeat_thread = 1;
    o.heartbeat_period_ms = period_ms;
    o.timeout_ms = timeout_ms;
    kvf_status st = kvf_client_connect(&o, &c, &info);
    if (st != KVF_SUCCESS) return st;
    uint64_t size = tiny_region_size();
    kvf_mem_alloc_options ao = KVF_MEM_ALLOC_OPTIONS_INIT;
    ao.size = 2 * size;
    st = kvf_mem_alloc_create(&ao, &a);
    if (st != KVF_SUCCESS) return st;
    kvf_client_region regs[2] = {{a, 0, size}, {a, size, size}};
    return kvf_client_register(c, kTinyGeometry, strlen(kTinyGeometry), -1, regs, 2, nullptr);
  }
  // Its own record in STAT: still there and still active (never reaped).
  bool still_active(std::string *why) {
    kvf_client_stat_record rec[64];
    uint32_t n = 0;
    kvf_status st = kvf_client_stat_clients(c, nullptr, rec, 64, &n);
    if (st != KVF_SUCCESS) {
      *why = std::string("STAT: ") + kvf_status_string(st) + ": " + kvf_last_error();
      return false;
    }
    for (uint32_t i = 0; i < n && i < 64; i++)
      if (rec[i].client_id == info.client_id) {
        if (rec[i].active == 1) return true;
        *why = "its registration is no longer active (reaped)";
        return false;
      }
    *why = "the server no longer lists it (reaped)";
    return false;
  }
  ~Engine() {
    kvf_client_disconnect(c);
    kvf_mem_alloc_destroy(a);
  }
};

// Measure while an attack runs: the engine's heartbeat round trip every 10 ms,
// and a new client's connect + STAT every 200 ms, until `stop`.
struct Probe {
  Latency heartbeat, connect;
  std::atomic<bool> stop{false};
  std::thread hb_thread, connect_thread;
  void start(Engine *e, const std::string &dir) {
    hb_thread = std::thread([this, e] {
      while (!stop.load()) {
        int64_t t0 = mono_us();
        kvf_status st = kvf_client_heartbeat(e->c, nullptr);
        double ms = (double)(mono_us() - t0) / 1000.0;
        heartbeat.add(ms);
        if (st != KVF_SUCCESS) heartbeat.fail(std::string(kvf_status_string(st)) + ": " + kvf_last_error());
        sleep_ms(10);
      }
    });
    connect_thread = std::thread([this, dir] {
      while (!stop.load()) {
        int64_t t0 = mono_us();
        kvf_client_options o = KVF_CLIENT_OPTIONS_INIT;
        o.socket_dir = dir.c_str();
        o.name = "probe";
        o.timeout_ms = 5000;
        kvf_client *c = nullptr;
        kvf_status st = kvf_client_connect(&o, &c, nullptr);
        kvf_client_stats s = KVF_CLIENT_STATS_INIT;
        if (st == KVF_SUCCESS) st = kvf_client_stat(c, &s);
        std::string why = st == KVF_SUCCESS ? "" : std::string(kvf_status_string(st)) + ": " + kvf_last_error();
        kvf_client_disconnect(c);
        connect.add((double)(mono_us() - t0) / 1000.0);
        if (st != KVF_SUCCESS) connect.fail(why);
        sleep_ms(200);
      }
    });
  }
  void finish() {
    stop = true;
    if (hb_thread.joinable()) hb_thread.join();
    if (connect_thread.joinable()) connect_thread.join();
  }
  ~Probe() { finish(); }
  // The stated bounds, with the figures in the message.
  void expect_bounds(const char *attack) {
    SCOPED_TRACE(attack);
    printf("[ %s ] engine heartbeat: %s\n", attack, heartbeat.summary().c_str());
    printf("[ %s ] new client connect+STAT: %s\n", attack, connect.summary().c_str());
    EXPECT_GT(heartbeat.count(), 10u);
    EXPECT_EQ(heartbeat.failures, 0) << heartbeat.summary();
    EXPECT_LT(heartbeat.pct(99), kHeartbeatP99Ms) << heartbeat.summary();
    EXPECT_LT(heartbeat.max(), kHeartbeatMaxMs) << heartbeat.summary();
    EXPECT_GT(connect.count(), 2u);
    EXPECT_EQ(connect.failures, 0) << connect.summary();
    EXPECT_LT(connect.max(), kConnectMaxMs) << connect.summary();
  }
};

class ServerFairness : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/kvf_fairness_XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    base_ = tmpl;
    dir_ = base_ + "/sock";
    signal(SIGPIPE, SIG_IGN);
    fds_before_ = fd_count();
  }
  void TearDown() override {
    server_.kill_now();
    nftw(base_.c_str(), remove_one, 16, FTW_DEPTH | FTW_PHYS);
    EXPECT_EQ(fd_count(), fds_before_) << "descriptors leaked in the test process";
  }
  std::string base_, dir_;
  int fds_before_ = 0;
  ServerProcess server_;
};

// Starvation: two clients keep their sockets full of heartbeats (their
// replies read by another process) for 3 s. Before round-robin service the
// loop read one of them until it would block, for the whole flood: nobody
// else was answered or could connect, and the engine, heartbeating all
// along, was reaped.
TEST_F(ServerFairness, FloodingClientsDoNotStarveOthers) {
  const uint32_t hb_timeout_ms = 1000;
  ASSERT_TRUE(server_.start(dir_, [&](kvf_server_options *o) { o->heartbeat_timeout_ms = hb_timeout_ms; }));
  const int flood_ms = 3000;
  Attacker a[2];
  int rep[2][2];
  for (int i = 0; i < 2; i++) {
    ASSERT_EQ(pipe2(rep[i], O_CLOEXEC), 0);
    spawn(&a[i], [&](int go) { return flood_main(dir_, go, flood_ms, rep[i][1]); });
    close(rep[i][1]);
  }
  Engine e;
  ASSERT_EQ(e.connect(dir_, 100, 5000), KVF_SUCCESS) << kvf_last_error();
  Probe p;
  p.start(&e, dir_);
  sleep_ms(200);
  for (Attacker &x : a) x.go();
  sleep_ms(flood_ms);
  p.finish();
  for (int i = 0; i < 2; i++) {
    EXPECT_EQ(a[i].finish(), 0) << "10+: the attacker step that failed";
    std::string r = read_report(rep[i][0], 5000);
    close(rep[i][0]);
    printf("[ flood ] attacker %d: the server took %s heartbeats in %d ms\n", i, r.empty() ? "?" : r.substr(0, r.size() - 1).c_str(), flood_ms);
  }
  p.expect_bounds("flood");
  std::string why;
  EXPECT_TRUE(e.still_active(&why)) << why;
  EXPECT_EQ(kvf_client_heartbeat(e.c, nullptr), KVF_SUCCESS) << kvf_last_error();
  EXPECT_FALSE(kvf_client_server_restarted(e.c));
  kvf_client_disconnect(e.c);
  e.c = nullptr;
  EXPECT_EQ(server_.stop(), 0) << "2 create, 3 run, 4 still mapped, 5 descriptors leaked";
}

// Exhaustion of slots: one process holds up to 1000 connections that never
// say HELLO (every client slot, max_clients 256 by default), replacing each
// one the server drops. An engine registered before keeps being served, and
// new clients can always connect and be served: a newcomer takes the slot of
// the oldest connection without HELLO. A connection that never says HELLO
// is dropped after hello_timeout_ms with an ERROR naming connection.hello.
TEST_F(ServerFairness, IdleConnectionsDoNotHoldEverySlot) {
  const uint32_t hello_ms = 1000;
  ASSERT_TRUE(server_.start(dir_, [&](kvf_server_options *o) {
    o->heartbeat_timeout_ms = 10000;
    o->hello_timeout_ms = hello_ms;
  }));
  const int idle_ms = 3000;
  int rep[2];
  ASSERT_EQ(pipe2(rep, O_CLOEXEC), 0);
  Attacker a;
  spawn(&a, [&](int go) { return idle_main(dir_, go, 1000, idle_ms, rep[1]); });
  close(rep[1]);
  Engine e;
  ASSERT_EQ(e.connect(dir_, 100, 5000), KVF_SUCCESS) << kvf_last_error();
  long fds_base = steady([&] { return (long)proc_fds(server_.pid()); });
  Probe p;
  a.go();
  sleep_ms(300); /* the attacker holds every slot */
  p.start(&e, dir_);
  long fds_max = 0;
  for (int64_t end = mono_ms() + idle_ms - 500; mono_ms() < end;) {
    fds_max = std::max(fds_max, (long)proc_fds(server_.pid()));
    sleep_ms(20);
  }
  p.finish();
  EXPECT_EQ(a.finish(), 0) << "10+: the attacker step that failed";
  std::string report = read_report(rep[0], 5000);
  close(rep[0]);
  long opened = 0, dropped = 0;
  EXPECT_EQ(sscanf(report.c_str(), "%ld %ld", &opened, &dropped), 2) << report;
  printf("[ idle ] attacker opened %ld connections, the server dropped %ld; server descriptors %ld before, "
         "at most %ld during\n",
         opened, dropped, fds_base, fds_max);
  p.expect_bounds("idle");
  std::string why;
  EXPECT_TRUE(e.still_active(&why)) << why;
  EXPECT_LE(fds_max, fds_base + 256 + 8) << "the server held more connections than max_clients";
  EXPECT_LE(steady([&] { return (long)proc_fds(server_.pid()); }), fds_base) << "idle connections were not dropped";
  // One idle connection alone: dropped at its HELLO deadline, with an ERROR.
  int fd = connect_raw(dir_, false);
  ASSERT_GE(fd, 0);
  int64_t t0 = mono_ms();
  kvf_proto_msg m;
  ASSERT_TRUE(read_msg(fd, 5000, &m)) << "no ERROR before the connection closed";
  int64_t waited = mono_ms() - t0;
  EXPECT_EQ(m.type, KVF_PROTO_ERROR);
  EXPECT_STREQ(m.u.error.field, "connection.hello") << m.u.error.message;
  EXPECT_EQ(m.u.error.status, (uint32_t)KVF_ERR_TIMEOUT);
  kvf_proto_msg_clear(&m);
  char b;
  EXPECT_EQ(read(fd, &b, 1), 0) << "then the server closes it";
  close(fd);
  printf("[ idle ] a lone connection without HELLO was dropped after %lld ms (hello_timeout_ms %u)\n",
         (long long)waited, hello_ms);
  EXPECT_GE(waited, (int64_t)hello_ms - 50);
  EXPECT_LT(waited, (int64_t)hello_ms + 1000);
  kvf_client_disconnect(e.c);
  e.c = nullptr;
  EXPECT_EQ(server_.stop(), 0) << "2 create, 3 run, 4 still mapped, 5 descriptors leaked";
}

// Memory held by partial frames: 16 connections each send a 16 MiB frame one
// byte short and hold it. The server's memory stays bounded (the frame
// buffer pool), the engine is served throughout, the attackers are dropped
// with an ERROR naming the frame once their deadline passes, and the
// memory comes back.
TEST_F(ServerFairness, PartialFramesDoNotHoldUnboundedMemory) {
  const uint32_t frame_ms = 1000;
  ASSERT_TRUE(server_.start(dir_, [&](kvf_server_options *o) {
    o->heartbeat_timeout_ms = 10000;
    o->frame_timeout_ms = frame_ms;
  }));
  const int hold_ms = 4000;
  const int conns = 16;
  const uint32_t payload = KVF_PROTO_MAX_PAYLOAD;
  int rep[2];
  ASSERT_EQ(pipe2(rep, O_CLOEXEC), 0);
  Attacker a;
  spawn(&a, [&](int go) { return partial_main(dir_, go, conns, payload, hold_ms, rep[1]); });
  close(rep[1]);
  Engine e;
  ASSERT_EQ(e.connect(dir_, 100, 5000), KVF_SUCCESS) << kvf_last_error();
  long rss_base = steady([&] { return proc_status(server_.pid(), "VmRSS"); });
  Probe p;
  p.start(&e, dir_);
  a.go();
  // Meanwhile a legitimate large frame: a REGISTER whose geometry is padded
  // to 1 MiB. It waits its turn for the pool, then succeeds.
  std::atomic<int> big_status{-1};
  std::atomic<int64_t> big_ms{0};
  std::thread big([&] {
    sleep_ms(300); /* the attackers hold the pool by then */
    int64_t t0 = mono_ms();
    kvf_client_options o = KVF_CLIENT_OPTIONS_INIT;
    o.socket_dir = dir_.c_str();
    o.name = "big";
    o.timeout_ms = 20000;
    kvf_client *c = nullptr;
    kvf_status st = kvf_client_connect(&o, &c, nullptr);
    uint64_t size = tiny_region_size();
    kvf_mem_alloc_options ao = KVF_MEM_ALLOC_OPTIONS_INIT;
    ao.size = 2 * size;
    kvf_mem_alloc *m = nullptr;
    if (st == KVF_SUCCESS) st = kvf_mem_alloc_create(&ao, &m);
    std::string json = kTinyGeometry;
    json.append((1u << 20) - json.size(), ' ');
    kvf_client_region regs[2] = {{m, 0, size}, {m, size, size}};
    if (st == KVF_SUCCESS) st = kvf_client_register(c, json.data(), json.size(), -1, regs, 2, nullptr);
    if (st == KVF_SUCCESS) st = kvf_client_unregister(c, 0, nullptr);
    big_ms = mono_ms() - t0;
    big_status = st;
    kvf_client_disconnect(c);
    kvf_mem_alloc_destroy(m);
  });
  long rss_max = 0;
  for (int64_t end = mono_ms() + hold_ms; mono_ms() < end;) {
    rss_max = std::max(rss_max, proc_status(server_.pid(), "VmRSS"));
    sleep_ms(10);
  }
  p.finish();
  big.join();
  EXPECT_EQ(a.finish(), 0) << "10+: the attacker step that failed";
  std::string report = read_report(rep[0], 5000);
  close(rep[0]);
  long rss_after = steady([&] { return proc_status(server_.pid(), "VmRSS"); });
  printf("[ partial frames ] server VmRSS %ld kB before, %ld kB at most during (+%ld MiB), %ld kB after the "
         "attackers left; attacker: dropped + first ERROR field: %s",
         rss_base, rss_max, (rss_max - rss_base) / 1024, rss_after, report.c_str());
  printf("[ partial frames ] a 1 MiB REGISTER meanwhile: %s after %lld ms\n",
         kvf_status_string((kvf_status)big_status.load()), (long long)big_ms.load());
  p.expect_bounds("partial frames");
  std::string why;
  EXPECT_TRUE(e.still_active(&why)) << why;
  EXPECT_EQ(big_status.load(), (int)KVF_SUCCESS) << "the large legitimate frame was not served";
  // 16 x 16 MiB = 256 MiB if every partial frame is held; the pool is 64 MiB.
  if (kRssBounds) {
    EXPECT_LT(rss_max - rss_base, 96l << 10) << "partial frames held more than the frame buffer pool (64 MiB)";
  }
  int dropped = 0;
  char field[128] = "";
  EXPECT_EQ(sscanf(report.c_str(), "%d %127s", &dropped, field), 2) << report;
  EXPECT_GE(dropped, 8) << "slow senders were not dropped at their frame deadline";
  EXPECT_STREQ(field, "frame");
  kvf_client_disconnect(e.c);
  e.c = nullptr;
  EXPECT_EQ(server_.stop(), 0) << "2 create, 3 run, 4 still mapped, 5 descriptors leaked";
}

// The frame limits one connection meets: before HELLO nothing larger than
// a HELLO; after it max_frame_bytes (told in HELLO_REPLY.max_payload); a
// frame begun and left unfinished is dropped at its deadline. Each time an
// ERROR names the field and the connection closes.
TEST_F(ServerFairness, FrameLimitsAndTheFrameDeadline) {
  const uint32_t frame_ms = 500;
  ASSERT_TRUE(server_.start(dir_, [&](kvf_server_options *o) {
    o->heartbeat_timeout_ms = 10000;
    o->frame_timeout_ms = frame_ms;
    o->max_frame_bytes = 64u << 10;
  }));
  auto expect_error_then_close = [](int fd, const char *field, uint32_t status) {
    kvf_proto_msg m;
    ASSERT_TRUE(read_msg(fd, 5000, &m)) << "no ERROR before the connection closed";
    EXPECT_EQ(m.type, KVF_PROTO_ERROR);
    EXPECT_STREQ(m.u.error.field, field) << m.u.error.message;
    EXPECT_EQ(m.u.error.status, status) << m.u.error.message;
    printf("[ limits ] %s: %s\n", m.u.error.field, m.u.error.message);
    kvf_proto_msg_clear(&m);
    char b;
    EXPECT_EQ(read(fd, &b, 1), 0) << "then the server closes it";
  };
  // Before HELLO: a 16 MiB header is refused before a byte is buffered.
  int fd = connect_raw(dir_, false);
  ASSERT_GE(fd, 0);
  std::vector<uint8_t> h = store_header(3, KVF_PROTO_MAX_PAYLOAD);
  ASSERT_TRUE(write_all(fd, h.data(), h.size()));
  expect_error_then_close(fd, "header.payload_len", KVF_ERR_PROTOCOL);
  close(fd);
  // After HELLO: the server says its limit, and holds to it.
  fd = connect_raw(dir_, false);
  ASSERT_GE(fd, 0);
  std::vector<uint8_t> hello = hello_frame(1);
  ASSERT_TRUE(write_all(fd, hello.data(), hello.size()));
  kvf_proto_msg m;
  ASSERT_TRUE(read_msg(fd, 5000, &m));
  ASSERT_EQ(m.type, KVF_PROTO_HELLO_REPLY);
  EXPECT_EQ(m.u.hello_reply.max_payload, 64u << 10);
  kvf_proto_msg_clear(&m);
  h = store_header(4, (64u << 10) + 1);
  ASSERT_TRUE(write_all(fd, h.data(), h.size()));
  expect_error_then_close(fd, "header.payload_len", KVF_ERR_PROTOCOL);
  close(fd);
  // A header trickled and left short, and a payload left one byte short.
  for (int payload : {0, 1}) {
    fd = connect_raw(dir_, false);
    ASSERT_GE(fd, 0);
    ASSERT_TRUE(write_all(fd, hello.data(), hello.size()));
    ASSERT_TRUE(read_msg(fd, 5000, &m));
    kvf_proto_msg_clear(&m);
    std::vector<uint8_t> f = store_header(5, 1000);
    f.resize(payload ? f.size() + 999 : 10, 0);
    int64_t t0 = mono_ms();
    ASSERT_TRUE(write_all(fd, f.data(), f.size()));
    expect_error_then_close(fd, "frame", KVF_ERR_TIMEOUT);
    int64_t waited = mono_ms() - t0;
    EXPECT_GE(waited, (int64_t)frame_ms - 50);
    EXPECT_LT(waited, (int64_t)frame_ms + 1000);
    close(fd);
  }
  EXPECT_EQ(server_.stop(), 0) << "2 create, 3 run, 4 still mapped, 5 descriptors leaked";
}

// STOREs that stay in flight (each completion held back), submitted as
// fast as the client library sends them, without waiting.
struct Pipeline {
  std::vector<uint64_t> ids;      // admitted or refused, in order of submission
  std::vector<kvf_status> status; // what kvf_client_wait said
  std::vector<std::string> why;
};

// Submit n STOREs of distinct one-chunk keys on e's registration, then wait
// for each.
Pipeline store_many(Engine &e, uint32_t n, uint64_t key_base) {
  Pipeline p;
  uint32_t block = 0;
  kvf_group_blocks g = {&block, 0, 1};
  for (uint32_t i = 0; i < n; i++) {
    kvf_chunk_key key = KeyOf(key_base + i);
    kvf_client_xfer x = KVF_CLIENT_XFER_INIT;
    x.token_begin = 0;
    x.token_end = 16;
    x.chunk_keys = &key;
    x.num_chunk_keys = 1;
    x.groups = &g;
    x.num_groups = 1;
    uint64_t id = 0;
    kvf_status st = kvf_client_submit(e.c, KVF_CLIENT_STORE, &x, &id);
    if (st != KVF_SUCCESS) {
      p.ids.push_back(0);
      p.status.push_back(st);
      p.why.push_back(std::string("submit: ") + kvf_last_error());
      continue;
    }
    p.ids.push_back(id);
  }
  for (size_t i = 0; i < p.ids.size(); i++) {
    if (!p.ids[i]) continue;
    kvf_client_result r = KVF_CLIENT_RESULT_INIT;
    kvf_status st = kvf_client_wait(e.c, p.ids[i], 20000, &r);
    if (st == KVF_SUCCESS) st = r.status;
    p.status.push_back(st);
    p.why.push_back(st == KVF_SUCCESS ? "" : kvf_last_error());
  }
  return p;
}

// Requests in flight per client: a client pipelining STOREs whose
// completions are held back gets an ERROR naming quota.requests_in_flight
// beyond max_requests_in_flight, and is served again once replies come; a
// pipeline of 512 under the default limit is never refused.
TEST_F(ServerFairness, RequestsInFlightAreCappedPerClient) {
  const uint32_t limit = 16;
  ASSERT_TRUE(server_.start(dir_, [&](kvf_server_options *o) {
    o->heartbeat_timeout_ms = 10000;
    o->test_completion_delay_ms = 20;
    o->max_requests_in_flight = limit;
  }));
  Engine e;
  ASSERT_EQ(e.connect(dir_, 100, 20000), KVF_SUCCESS) << kvf_last_error();
  Pipeline p = store_many(e, 3 * limit, 1000);
  uint32_t done = 0, refused = 0;
  std::string first_refusal;
  for (size_t i = 0; i < p.status.size(); i++) {
    if (p.status[i] == KVF_SUCCESS) done++;
    else if (p.status[i] == KVF_ERR_BUSY && p.why[i].find("quota.requests_in_flight") != std::string::npos) {
      if (!refused++) first_refusal = p.why[i];
    } else
      ADD_FAILURE() << "request " << i << ": " << kvf_status_string(p.status[i]) << ": " << p.why[i];
  }
  printf("[ in flight ] %u STOREs submitted at once, limit %u: %u done, %u refused (%s)\n", 3 * limit, limit, done,
         refused, first_refusal.c_str());
  EXPECT_GE(done, limit) << "the first requests up to the limit are admitted";
  EXPECT_GT(refused, 0u) << "nothing refused: the limit was not enforced";
  EXPECT_LE(done, 2 * limit) << "far more than the limit were admitted while the first were held";
  // Served again once replies came back.
  p = store_many(e, limit, 5000);
  for (size_t i = 0; i < p.status.size(); i++)
    EXPECT_EQ(p.status[i], KVF_SUCCESS) << "request " << i << ": " << p.why[i];
  kvf_client_disconnect(e.c);
  e.c = nullptr;
  EXPECT_EQ(server_.stop(), 0) << "2 create, 3 run, 4 still mapped, 5 descriptors leaked";
}

// The default limit leaves room for an engine pipelining a few hundred.
TEST_F(ServerFairness, AFewHundredRequestsInFlightAreWithinTheDefaults) {
  ASSERT_TRUE(server_.start(dir_, [&](kvf_server_options *o) {
    o->heartbeat_timeout_ms = 10000;
    o->test_completion_delay_ms = 1;
  }));
  Engine e;
  ASSERT_EQ(e.connect(dir_, 100, 30000), KVF_SUCCESS) << kvf_last_error();
  Pipeline p = store_many(e, 512, 1000);
  uint32_t done = 0;
  for (size_t i = 0; i < p.status.size(); i++) {
    EXPECT_EQ(p.status[i], KVF_SUCCESS) << "request " << i << ": " << p.why[i];
    done += p.status[i] == KVF_SUCCESS;
  }
  EXPECT_EQ(done, 512u);
  kvf_client_disconnect(e.c);
  e.c = nullptr;
  EXPECT_EQ(server_.stop(), 0) << "2 create, 3 run, 4 still mapped, 5 descriptors leaked";
}

// Queued reply bytes: a client that sends STATs and never reads a reply.
// The server stops reading it once its unread replies reach half of
// max_reply_queue_bytes, so what it holds for it stays bounded, and drops
// it after write_timeout_ms without progress; the engine is served
// throughout.
TEST_F(ServerFairness, AClientThatDoesNotReadItsRepliesHoldsBoundedMemory) {
  ASSERT_TRUE(server_.start(dir_, [&](kvf_server_options *o) { o->heartbeat_timeout_ms = 10000; }));
  const int unread_ms = 3500;
  int rep[2];
  ASSERT_EQ(pipe2(rep, O_CLOEXEC), 0);
  Attacker a;
  spawn(&a, [&](int go) { return unread_main(dir_, go, unread_ms, rep[1]); });
  close(rep[1]);
  Engine e;
  ASSERT_EQ(e.connect(dir_, 100, 5000), KVF_SUCCESS) << kvf_last_error();
  long rss_base = steady([&] { return proc_status(server_.pid(), "VmRSS"); });
  Probe p;
  p.start(&e, dir_);
  a.go();
  long rss_max = 0;
  for (int64_t end = mono_ms() + unread_ms; mono_ms() < end;) {
    rss_max = std::max(rss_max, proc_status(server_.pid(), "VmRSS"));
    sleep_ms(10);
  }
  p.finish();
  EXPECT_EQ(a.finish(), 0) << "10+: the attacker step that failed";
  std::string report = read_report(rep[0], 5000);
  close(rep[0]);
  unsigned long long written = 0;
  int closed = 0;
  EXPECT_EQ(sscanf(report.c_str(), "%llu %d", &written, &closed), 2) << report;
  printf("[ unread replies ] the server took %llu bytes of STAT requests, %s; server VmRSS %ld kB before, %ld kB "
         "at most during (+%ld MiB)\n",
         written, closed ? "then closed the connection" : "and kept the connection", rss_base, rss_max,
         (rss_max - rss_base) / 1024);
  p.expect_bounds("unread replies");
  std::string why;
  EXPECT_TRUE(e.still_active(&why)) << why;
  EXPECT_TRUE(closed) << "a client that never reads its replies must be dropped (write_timeout_ms)";
  // The default max_reply_queue_bytes is 16 MiB: reading stops at 8 MiB queued.
  if (kRssBounds) {
    EXPECT_LT(rss_max - rss_base, 24l << 10) << "the server held far more unread replies than its limit";
  }
  kvf_client_disconnect(e.c);
  e.c = nullptr;
  EXPECT_EQ(server_.stop(), 0) << "2 create, 3 run, 4 still mapped, 5 descriptors leaked";
}

// The frame pool hands memory out first come first served, and a frame's
// deadline holds from its grant: two senders each take half the pool and
// stall one byte short, a third sends only a header and waits; once the
// first two are dropped at their deadline it gets the memory, and having
// sent nothing more it is dropped one deadline later.
TEST_F(ServerFairness, AHeldFrameKeepsItsDeadlineOnceGranted) {
  const uint32_t frame_ms = 500;
  ASSERT_TRUE(server_.start(dir_, [&](kvf_server_options *o) {
    o->heartbeat_timeout_ms = 10000;
    o->frame_timeout_ms = frame_ms;
    o->max_frame_bytes = 128u << 10;
    o->max_buffered_bytes = 256u << 10;
  }));
  std::vector<uint8_t> hello = hello_frame(1);
  int fd[3];
  for (int i = 0; i < 3; i++) {
    fd[i] = connect_raw(dir_, false);
    ASSERT_GE(fd[i], 0);
    ASSERT_TRUE(write_all(fd[i], hello.data(), hello.size()));
    kvf_proto_msg m;
    ASSERT_TRUE(read_msg(fd[i], 5000, &m));
    kvf_proto_msg_clear(&m);
  }
  const uint32_t len = 100u << 10; /* over the 64 KiB every frame gets: through the pool */
  int64_t t0 = mono_ms();
  for (int i = 0; i < 2; i++) {
    std::vector<uint8_t> f = store_header(2, len);
    f.resize(f.size() + len - 1, 0);
    ASSERT_TRUE(write_all(fd[i], f.data(), f.size()));
  }
  sleep_ms(50);
  std::vector<uint8_t> h = store_header(3, len);
  ASSERT_TRUE(write_all(fd[2], h.data(), h.size()));
  int64_t dropped_ms[3];
  for (int i = 0; i < 3; i++) {
    kvf_proto_msg m;
    ASSERT_TRUE(read_msg(fd[i], 5000, &m)) << "connection " << i << ": no ERROR";
    dropped_ms[i] = mono_ms() - t0;
    EXPECT_EQ(m.type, KVF_PROTO_ERROR);
    EXPECT_STREQ(m.u.error.field, "frame") << m.u.error.message;
    kvf_proto_msg_clear(&m);
    close(fd[i]);
  }
  printf("[ pool ] two senders stalled in the pool dropped after %lld and %lld ms, the one that waited and sent "
         "nothing after %lld ms (frame_timeout_ms %u)\n",
         (long long)dropped_ms[0], (long long)dropped_ms[1], (long long)dropped_ms[2], frame_ms);
  EXPECT_GE(dropped_ms[2], dropped_ms[0] + (int64_t)frame_ms - 50) << "its deadline ran while it waited";
  EXPECT_LT(dropped_ms[2], dropped_ms[0] + (int64_t)frame_ms + 1000);
  EXPECT_EQ(server_.stop(), 0) << "2 create, 3 run, 4 still mapped, 5 descriptors leaked";
}

#ifdef KVF_KVFERRYD_PATH
// What the server holds of the machine, from /proc.
struct Snapshot {
  long rss_kb = -1, threads = -1, fds = -1;
};
Snapshot steady_snapshot(pid_t pid) {
  Snapshot s;
  s.fds = steady([&] { return (long)proc_fds(pid); });
  s.threads = steady([&] { return proc_status(pid, "Threads"); });
  // Steady for 1.5 s: the loop trims at most once a second and wakes at
  // least every 250 ms, so a trim still due shows within that (a 100 ms
  // window once read the RSS before it, +12 MiB kept).
  s.rss_kb = steady([&] { return proc_status(pid, "VmRSS"); }, 75);
  return s;
}

// Memory returns: every attack above in turn against the kvferryd binary of
// this build (release in a release build), then every attacker gone. The
// server's descriptors and threads come back to where they were exactly,
// and its VmRSS stays within the pools' bounds during and comes back near
// where it was after (the loop trims what glibc keeps; sanitizer builds
// keep freed memory in quarantine, so only their descriptors and threads
// are held to it). With KVF_FAIRNESS_TRIM_PROBE=1 and gdb installed, the
// test then calls malloc_trim(0) in the server and reports what that gives
// back on top.
TEST_F(ServerFairness, MemoryDescriptorsAndThreadsReturnAfterTheAttacks) {
  ASSERT_TRUE(server_.start_binary(KVF_KVFERRYD_PATH, dir_,
                                   {"--heartbeat-timeout-ms", "10000", "--hello-timeout-ms", "1000",
                                    "--frame-timeout-ms", "1000", "--log-level", "none"}))
      << "kvferryd did not start";
  const pid_t pid = server_.pid();
  const int phase_ms = 2500;
  int rep[5][2];
  Attacker a[5];
  for (int i = 0; i < 5; i++) ASSERT_EQ(pipe2(rep[i], O_CLOEXEC), 0);
  spawn(&a[0], [&](int go) { return flood_main(dir_, go, phase_ms, rep[0][1]); });
  spawn(&a[1], [&](int go) { return flood_main(dir_, go, phase_ms, rep[1][1]); });
  spawn(&a[2], [&](int go) { return idle_main(dir_, go, 1000, phase_ms, rep[2][1]); });
  spawn(&a[3], [&](int go) { return partial_main(dir_, go, 16, KVF_PROTO_MAX_PAYLOAD, 2 * phase_ms, rep[3][1]); });
  spawn(&a[4], [&](int go) { return unread_main(dir_, go, phase_ms + 500, rep[4][1]); });
  for (int i = 0; i < 5; i++) close(rep[i][1]);
  Snapshot base = steady_snapshot(pid);
  long rss_peak = base.rss_kb;
  std::string phases; /* VmRSS after each attack, kB */
  {
    Engine e;
    ASSERT_EQ(e.connect(dir_, 100, 10000), KVF_SUCCESS) << kvf_last_error();
    Probe p;
    p.start(&e, dir_);
    auto run = [&](std::vector<int> which, int ms) {
      for (int i : which) a[i].go();
      for (int64_t end = mono_ms() + ms; mono_ms() < end;) {
        rss_peak = std::max(rss_peak, proc_status(pid, "VmRSS"));
        sleep_ms(10);
      }
      for (int i : which) {
        EXPECT_EQ(a[i].finish(), 0) << "attacker " << i << ": 10+: the step that failed";
        std::string r = read_report(rep[i][0], 5000);
        close(rep[i][0]);
      }
      phases += " " + std::to_string(steady([&] { return proc_status(pid, "VmRSS"); }));
    };
    run({0, 1}, phase_ms);   // flood
    run({2}, phase_ms);      // idle connections
    run({3}, 2 * phase_ms);  // partial frames
    run({4}, phase_ms + 500); // unread replies
    p.finish();
    p.expect_bounds("all attacks, kvferryd");
    std::string why;
    EXPECT_TRUE(e.still_active(&why)) << why;
  }
  Snapshot after = steady_snapshot(pid);
  printf("[ memory returns ] kvferryd pid %d: VmRSS %ld kB before, %ld kB at most during, %ld kB after (+%ld kB "
         "kept); threads %ld before, %ld after; descriptors %ld before, %ld after\n",
         (int)pid, base.rss_kb, rss_peak, after.rss_kb, after.rss_kb - base.rss_kb, base.threads, after.threads,
         base.fds, after.fds);
  printf("[ memory returns ] VmRSS after the flood, idle, partial-frame and unread-reply attacks (kB):%s\n",
         phases.c_str());
  EXPECT_EQ(after.fds, base.fds) << "descriptors did not come back";
  EXPECT_EQ(after.threads, base.threads) << "threads did not come back";
  // During: the frame pool (64 MiB), the frames' allowance, one client's
  // reply queue (16 MiB) and slack; 256 MiB when partial frames were unbounded.
  if (kRssBounds) {
    EXPECT_LT(rss_peak - base.rss_kb, 128l << 10);
    // The loop trims what glibc keeps (13.7 MiB after the unread-reply attack without it).
    EXPECT_LT(after.rss_kb - base.rss_kb, 8l << 10) << "the server kept much of what the attacks made it allocate";
  }
  const char *probe = getenv("KVF_FAIRNESS_TRIM_PROBE");
  if (probe && *probe == '1' && access("/usr/bin/gdb", X_OK) == 0) {
    char cmd[256];
    snprintf(cmd, sizeof cmd, "/usr/bin/gdb -p %d -batch -ex 'call (int)malloc_trim(0)' >/dev/null 2>&1", (int)pid);
    int rc = system(cmd);
    long trimmed = steady([&] { return proc_status(pid, "VmRSS"); });
    printf("[ memory returns ] malloc_trim(0) in kvferryd (gdb exit %d): VmRSS %ld kB -> %ld kB (%ld kB more "
           "returned)\n",
           rc, after.rss_kb, trimmed, after.rss_kb - trimmed);
  }
  EXPECT_EQ(server_.stop(), 0) << "kvferryd's exit status after SIGTERM";
}
#endif

}  // namespace
