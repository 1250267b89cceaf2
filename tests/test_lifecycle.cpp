// kvferryd's control plane across real processes (issue 5): engines are
// forked processes using the public client API over the host provider
// (memfd), descriptors travel over the real socket, and the server runs in
// a forked process as kvferryd would, or on a thread of the test process
// where the test inspects it (its descriptors, memory, threads, or a
// system-call fault table). Geometries are presets with num_blocks cut down.
//
//   - engines SIGKILLed (or stopped) at random points while they register,
//     heartbeat, re-register and unregister; a survivor is served
//     throughout and the dead are reaped within the heartbeat timeout;
//   - a restarted engine is served anew;
//   - a re-registration that fails inside the server's import (every
//     system call of it in turn, and descriptors that are not what the
//     identity says) leaves the previous registration serving;
//   - a client of another uid is refused, at the directory and at
//     SO_PEERCRED, while a legitimate one keeps being served;
//   - 1000 connect/register/unregister/disconnect cycles leave the server's
//     descriptors, memory and threads where they were.
#include <gtest/gtest.h>

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <grp.h>
#include <malloc.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <functional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <kvferry/client.h>
#include <kvferry/geometry.h>
#include <kvferry/memory.h>

#include "host/ipc/endpoint.h"
#include "host/core/log.h"
#include "host/ipc/protocol.h"
#include "host/server/server.h"
#include "host/core/syscalls.h"

#include "mem_test_util.h"

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define KVF_TEST_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define KVF_TEST_SANITIZED 1
#endif
#endif
#ifdef KVF_TEST_SANITIZED
#include <sanitizer/allocator_interface.h>
#endif

namespace {

using kvf_mem_test::fd_count;

// ---- processes, pipes, /proc -------------------------------------------------

int64_t mono_ms() {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

void sleep_ms(int64_t ms) {
  if (ms <= 0) return;
  struct timespec ts = {(time_t)(ms / 1000), (long)(ms % 1000) * 1000000L};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
  }
}

int remove_one(const char *path, const struct stat *, int, struct FTW *) { return remove(path); }

// A child's exit status, or 1000 + the signal that ended it; -1 if it is
// still running after timeout_ms (negative: wait for ever).
int reap(pid_t pid, int timeout_ms = -1) {
  int64_t deadline = mono_ms() + timeout_ms;
  for (;;) {
    int status = 0;
    pid_t r = waitpid(pid, &status, timeout_ms < 0 ? 0 : WNOHANG);
    if (r == pid) return WIFEXITED(status) ? WEXITSTATUS(status) : 1000 + WTERMSIG(status);
    if (r < 0 && errno != EINTR) return -2;
    if (timeout_ms >= 0 && mono_ms() > deadline) return -1;
    if (r == 0) sleep_ms(5);
  }
}

// fork() with stdio flushed first, so a child never writes the parent's
// buffered output a second time.
pid_t fork_clean() {
  std::fflush(nullptr);
  return fork();
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

bool put_byte(int fd, char c) { return put(fd, &c, 1); }

// Entries of a /proc directory (descriptors, threads), or -1.
int proc_entries(const std::string &path) {
  DIR *d = opendir(path.c_str());
  if (d == nullptr) return -1;
  int n = 0;
  while (struct dirent *e = readdir(d))
    if (e->d_name[0] != '.') n++;
  closedir(d);
  return n;
}

// The count once it holds still for 60 ms (a connection the peer closed
// is closed by the server a moment after its registry work).
int steady_entries(const std::string &path) {
  int last = proc_entries(path), same = 0;
  for (int i = 0; i < 200 && same < 3; i++) {
    sleep_ms(20);
    int now = proc_entries(path);
    same = now == last ? same + 1 : 0;
    last = now;
  }
  return last;
}

long rss_kb() {
  long size = 0, resident = 0;
  FILE *f = std::fopen("/proc/self/statm", "r");
  if (f == nullptr) return -1;
  int n = std::fscanf(f, "%ld %ld", &size, &resident);
  std::fclose(f);
  return n == 2 ? resident * (sysconf(_SC_PAGESIZE) / 1024) : -1;
}

// Bytes the allocator has handed out and not had back (the sanitizers'
// allocator keeps freed blocks in quarantine, which RSS would count).
uint64_t heap_in_use() {
#ifdef KVF_TEST_SANITIZED
  return (uint64_t)__sanitizer_get_current_allocated_bytes();
#else
  struct mallinfo2 mi = mallinfo2();
  return (uint64_t)mi.uordblks + (uint64_t)mi.hblkhd;
#endif
}

std::string status_name(int st) { return kvf_status_string((kvf_status)st); }

// ---- geometries: presets with fewer blocks ------------------------------------

// A preset as an engine with a small pool loads it (num_blocks_override),
// and the JSON it sends: the same geometry written out by
// kvf_geometry_to_json (the server loads the text as sent).
struct Model {
  std::string name;
  std::string json;
  std::vector<uint64_t> size, align;  // per region
  uint32_t regions() const { return (uint32_t)size.size(); }
};

bool load_model(const std::string &file, uint32_t num_blocks, Model *out, std::string *why) {
  std::string path = std::string(KVF_PRESET_DIR) + "/" + file;
  kvf_geometry *g = nullptr;
  kvf_geometry_load_options o = KVF_GEOMETRY_LOAD_OPTIONS_INIT;
  o.num_blocks_override = num_blocks;
  kvf_geometry_error err;
  if (kvf_geometry_load_file(path.c_str(), &o, &g, &err) != KVF_SUCCESS) {
    *why = file + " (num_blocks_override): " + err.message;
    return false;
  }
  char *json = nullptr;
  size_t len = 0;
  bool ok = kvf_geometry_to_json(g, &json, &len) == KVF_SUCCESS;
  if (!ok) *why = file + ": kvf_geometry_to_json: " + kvf_last_error();
  if (ok) {
    out->name = file;
    out->json.assign(json, len);
    out->size.clear();
    out->align.clear();
    for (uint32_t i = 0; i < kvf_geometry_num_regions(g); i++) {
      kvf_region_info r = KVF_REGION_INFO_INIT;
      if (kvf_geometry_region(g, i, &r) != KVF_SUCCESS || r.size == 0) {
        *why = file + ": region " + std::to_string(i) + " has no size";
        ok = false;
        break;
      }
      out->size.push_back(r.size);
      out->align.push_back(r.align ? r.align : 1);
    }
  }
  free(json);
  kvf_geometry_destroy(g);
  return ok;
}

// An engine's KV memory: the model's regions over k host allocations
// (region i in allocation i % k, each at its alignment). Registered, it
// costs the server k imports and one alias per region.
struct EngineMemory {
  std::vector<kvf_mem_alloc *> allocs;
  std::vector<kvf_client_region> regions;
  EngineMemory() = default;
  EngineMemory(const EngineMemory &) = delete;
  EngineMemory &operator=(const EngineMemory &) = delete;
  ~EngineMemory() { clear(); }
  void clear() {
    for (kvf_mem_alloc *a : allocs) kvf_mem_alloc_destroy(a);
    allocs.clear();
    regions.clear();
  }
  uint32_t imports() const { return (uint32_t)allocs.size(); }
};

kvf_status make_memory(const Model &m, uint32_t k, EngineMemory *mem) {
  mem->clear();
  if (k == 0 || k > m.regions()) return KVF_ERR_INVALID_ARGUMENT;
  std::vector<uint64_t> end(k, 0), offset(m.regions(), 0);
  for (uint32_t i = 0; i < m.regions(); i++) {
    uint64_t &e = end[i % k];
    offset[i] = (e + m.align[i] - 1) / m.align[i] * m.align[i];
    e = offset[i] + m.size[i];
  }
  for (uint32_t a = 0; a < k; a++) {
    kvf_mem_alloc_options o = KVF_MEM_ALLOC_OPTIONS_INIT;
    o.size = end[a];
    o.name = "kvf-lifecycle";
    kvf_mem_alloc *alloc = nullptr;
    kvf_status st = kvf_mem_alloc_create(&o, &alloc);
    if (st != KVF_SUCCESS) return st;
    mem->allocs.push_back(alloc);
  }
  for (uint32_t i = 0; i < m.regions(); i++) mem->regions.push_back({mem->allocs[i % k], offset[i], m.size[i]});
  return KVF_SUCCESS;
}

// Register mem as model m; a success whose reply does not count what mem
// implies (k imports, one alias per region) is KVF_ERR_INTERNAL.
kvf_status register_memory(kvf_client *c, const Model &m, const EngineMemory &mem, kvf_client_registration *r) {
  kvf_client_registration local = KVF_CLIENT_REGISTRATION_INIT;
  if (r == nullptr) r = &local;
  kvf_status st = kvf_client_register(c, m.json.data(), m.json.size(), -1, mem.regions.data(), m.regions(), r);
  if (st == KVF_SUCCESS && (r->imports != mem.imports() || r->aliases != m.regions())) return KVF_ERR_INTERNAL;
  return st;
}

kvf_client *connect_client(const std::string &dir, const char *name, kvf_status *st_out = nullptr,
                           kvf_client_info *info = nullptr) {
  kvf_client_options o = KVF_CLIENT_OPTIONS_INIT;
  o.socket_dir = dir.c_str();
  o.name = name;
  kvf_client *c = nullptr;
  kvf_status st = kvf_client_connect(&o, &c, info);
  if (st_out) *st_out = st;
  return st == KVF_SUCCESS ? c : nullptr;
}

// ---- STAT --------------------------------------------------------------------

// STAT over a fresh connection (a connection kept silent would be reaped).
bool stat_fresh(const std::string &dir, kvf_client_stats *out) {
  const kvf_client_stats zero = KVF_CLIENT_STATS_INIT;  // all counters 0
  *out = zero;
  kvf_client *c = connect_client(dir, "stat");
  if (c == nullptr) return false;
  bool ok = kvf_client_stat(c, out) == KVF_SUCCESS;
  kvf_client_disconnect(c);
  return ok;
}

// What the server should hold once everything dead is gone.
struct Want {
  uint64_t imports, aliases;
  uint32_t active;
};

bool settled(const kvf_client_stats &s, const Want &w) {
  return s.imports == w.imports && s.aliases == w.aliases && s.active == w.active && s.draining == 0 &&
         s.registering == 0 && s.leases == 0;
}

std::string describe(const kvf_client_stats &s) {
  char b[256];
  std::snprintf(b, sizeof b,
                "imports %" PRIu64 ", aliases %" PRIu64 ", leases %" PRIu64
                ", registering %u, active %u, draining %u, closed_total %u, failed_total %u",
                s.imports, s.aliases, s.leases, s.registering, s.active, s.draining, s.closed_total, s.failed_total);
  return b;
}

// Poll STAT until it shows w or ms pass; *last gets the last STAT.
bool wait_settled(const std::string &dir, const Want &w, int64_t ms, kvf_client_stats *last) {
  int64_t deadline = mono_ms() + ms;
  for (;;) {
    bool ok = stat_fresh(dir, last);
    if (ok && settled(*last, w)) return true;
    if (mono_ms() > deadline) return false;
    sleep_ms(10);
  }
}

// ---- the server --------------------------------------------------------------

kvf_server *g_child_server;
void child_on_term(int) { kvf_server_stop(g_child_server); }

// kvferryd in a forked process. It exits 0 after SIGTERM only if it drained
// cleanly (nothing mapped, leased or active) and holds as many descriptors
// as before it was created.
class ServerProcess {
 public:
  ~ServerProcess() { kill_now(); }

  // log_path: warnings go there (line-buffered, readable while it runs).
  bool start(const std::string &dir, uint32_t heartbeat_timeout_ms, const std::string &log_path = "") {
    dir_ = dir;
    pid_ = fork_clean();
    if (pid_ < 0) return false;
    if (pid_ == 0) {
      // SIGTERM waits until the server exists to be stopped.
      sigset_t term, old;
      sigemptyset(&term);
      sigaddset(&term, SIGTERM);
      sigprocmask(SIG_BLOCK, &term, &old);
      signal(SIGTERM, child_on_term);
      if (!log_path.empty()) {
        FILE *f = std::fopen(log_path.c_str(), "w");
        if (f == nullptr) _exit(6);
        setvbuf(f, nullptr, _IOLBF, 0);
        kvf_log_override(KVF_LOG_WARN, KVF_LOG_ALL);
        kvf_log_set_sink(f);
      }
      int before = fd_count();
      kvf_server_options o = KVF_SERVER_OPTIONS_INIT;
      o.socket_dir = dir.c_str();
      o.heartbeat_timeout_ms = heartbeat_timeout_ms;
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
    for (int i = 0; i < 1000; i++) {  // ready once the socket accepts
      kvf_conn c;
      if (kvf_endpoint_connect(dir.c_str(), 0, &c) == KVF_SUCCESS) {
        kvf_conn_close(&c);
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

  // SIGTERM; the exit status (0: drained cleanly; 2 create, 3 run, 4 still
  // mapped, 5 descriptors leaked, 6 log file).
  int stop() {
    if (pid_ <= 0) return -1;
    kill(pid_, SIGTERM);
    int st = reap(pid_, 20000);
    if (st == -1) {
      kill(pid_, SIGKILL);
      st = 2000 + reap(pid_);
    }
    pid_ = -1;
    return st;
  }

  void kill_now() {
    if (pid_ <= 0) return;
    kill(pid_, SIGKILL);
    reap(pid_);
    pid_ = -1;
  }

  pid_t pid() const { return pid_; }

 private:
  std::string dir_;
  pid_t pid_ = -1;
};

// kvferryd's server object on a thread of the test process, so the test
// can count the server's descriptors, memory and threads, or install a
// system-call table under it. Fork engines before start(): a child forked
// while the server's threads run could inherit a lock one of them held.
class ServerThread {
 public:
  ~ServerThread() {
    stop();
    kvf_server_destroy(server_);
  }
  kvf_status start(const std::string &dir, uint32_t heartbeat_timeout_ms) {
    kvf_server_options o = KVF_SERVER_OPTIONS_INIT;
    o.socket_dir = dir.c_str();
    o.heartbeat_timeout_ms = heartbeat_timeout_ms;
    kvf_status st = kvf_server_create(&o, &server_);
    if (st != KVF_SUCCESS) return st;
    thread_ = std::thread([this] { run_status_ = kvf_server_run(server_); });
    return KVF_SUCCESS;
  }
  // Stop and join; kvf_server_run's status.
  int stop() {
    if (!thread_.joinable()) return run_status_.load();
    kvf_server_stop(server_);
    thread_.join();
    return run_status_.load();
  }
  kvf_registry_stats stats() {
    kvf_registry_stats s = KVF_REGISTRY_STATS_INIT;
    EXPECT_EQ(kvf_server_stats(server_, &s), KVF_SUCCESS) << kvf_last_error();
    return s;
  }
  // Wait up to ms for the registry to hold nothing but `w`.
  bool wait_settled(const Want &w, int64_t ms, kvf_registry_stats *last) {
    int64_t deadline = mono_ms() + ms;
    for (;;) {
      *last = stats();
      if (last->imports == w.imports && last->aliases == w.aliases && last->active == w.active &&
          last->draining == 0 && last->registering == 0 && last->leases == 0)
        return true;
      if (mono_ms() > deadline) return false;
      sleep_ms(5);
    }
  }

 private:
  kvf_server *server_ = nullptr;
  std::thread thread_;
  std::atomic<int> run_status_{-1};
};

// ---- engines -----------------------------------------------------------------

// A forked engine with a command pipe (test -> engine) and a report pipe
// (engine -> test). Its exit status says which step failed.
struct Engine {
  pid_t pid = -1;
  int control = -1;
  int report = -1;
};

Engine spawn_engine(const std::function<int(int control, int report)> &body) {
  int c[2], r[2];
  Engine e;
  if (pipe2(c, O_CLOEXEC) != 0) return e;
  if (pipe2(r, O_CLOEXEC) != 0) {
    close(c[0]);
    close(c[1]);
    return e;
  }
  pid_t pid = fork_clean();
  if (pid == 0) {
    close(c[1]);
    close(r[0]);
    _exit(body(c[0], r[1]));
  }
  close(c[0]);
  close(r[1]);
  if (pid < 0) {
    close(c[1]);
    close(r[0]);
    return e;
  }
  e.pid = pid;
  e.control = c[1];
  e.report = r[0];
  return e;
}

void close_engine(Engine *e) {
  if (e->pid > 0) {
    kill(e->pid, SIGKILL);
    reap(e->pid);
    e->pid = -1;
  }
  if (e->control >= 0) close(e->control);
  if (e->report >= 0) close(e->report);
  e->control = e->report = -1;
}

// What an engine reports after a command.
struct Report {
  int32_t status;
  uint32_t imports, aliases;
  uint64_t registration_id;
  char message[240];
};

bool send_report(int fd, kvf_status st, const kvf_client_registration *r = nullptr) {
  Report rep;
  std::memset(&rep, 0, sizeof rep);
  rep.status = st;
  if (r) {
    rep.imports = r->imports;
    rep.aliases = r->aliases;
    rep.registration_id = r->registration_id;
  }
  if (st != KVF_SUCCESS) std::snprintf(rep.message, sizeof rep.message, "%s", kvf_last_error());
  return put(fd, &rep, sizeof rep);
}

// A scripted engine: memory A (model a over 1 allocation) and memory B
// (model b over 2) made at start; each command byte runs one call and is
// answered with a Report: 'c' connect, 'A'/'B' register that memory (the
// reply's counts reported as they came), 'h' heartbeat, 'u' unregister the
// live registration, 'q' disconnect and exit 0. End of file on the command
// pipe: disconnect and exit 0 without a word. instance/generation:
// kvf_mem_instance_set before anything (0: leave the random one).
int scripted_engine(const std::string &dir, const Model &a, const Model &b, uint64_t instance, uint64_t generation,
                    int control, int report) {
  if (instance != 0 && kvf_mem_instance_set(instance, generation) != KVF_SUCCESS) return 10;
  EngineMemory ma, mb;
  if (make_memory(a, 1, &ma) != KVF_SUCCESS) return 11;
  if (make_memory(b, std::min<uint32_t>(2, b.regions()), &mb) != KVF_SUCCESS) return 12;
  kvf_client *c = nullptr;
  for (;;) {
    char cmd = 0;
    if (!get(control, &cmd, 1, 600000)) {
      kvf_client_disconnect(c);
      return 0;
    }
    kvf_status st = KVF_SUCCESS;
    kvf_client_registration r = KVF_CLIENT_REGISTRATION_INIT;  // all fields 0
    switch (cmd) {
      case 'c':
        kvf_client_disconnect(c);
        c = connect_client(dir, "scripted", &st);
        break;
      case 'A':
      case 'B': {
        const Model &m = cmd == 'A' ? a : b;
        const EngineMemory &mem = cmd == 'A' ? ma : mb;
        st = c ? kvf_client_register(c, m.json.data(), m.json.size(), -1, mem.regions.data(), m.regions(), &r)
               : KVF_ERR_STATE;
        break;
      }
      case 'h': st = c ? kvf_client_heartbeat(c, nullptr) : KVF_ERR_STATE; break;
      case 'u': {
        uint32_t state = 0;
        st = c ? kvf_client_unregister(c, 0, &state) : KVF_ERR_STATE;
        if (st == KVF_SUCCESS && state != KVF_PROTO_REG_CLOSED) st = KVF_ERR_INTERNAL;
        break;
      }
      case 'q':
        kvf_client_disconnect(c);
        send_report(report, KVF_SUCCESS);
        return 0;
      default: return 13;
    }
    if (!send_report(report, st, &r)) return 14;
  }
}

// Send one command to a scripted engine and read its report.
Report command(const Engine &e, char cmd, int timeout_ms = 30000) {
  Report rep;
  std::memset(&rep, 0, sizeof rep);
  if (!put_byte(e.control, cmd) || !get(e.report, &rep, sizeof rep, timeout_ms)) {
    rep.status = -1;
    std::snprintf(rep.message, sizeof rep.message, "no report from the engine (command '%c')", cmd);
  }
  return rep;
}

// An engine that registers model m over k allocations, reports, then
// heartbeats every 50 ms until 'q' (unregister, exit 0) or the end of the
// command pipe (exit 0 silently).
int holding_engine(const std::string &dir, const Model &m, uint32_t k, uint64_t instance, uint64_t generation,
                   int control, int report) {
  if (instance != 0 && kvf_mem_instance_set(instance, generation) != KVF_SUCCESS) return 10;
  EngineMemory mem;
  if (make_memory(m, k, &mem) != KVF_SUCCESS) return 11;
  kvf_status st = KVF_SUCCESS;
  kvf_client *c = connect_client(dir, "holding", &st);
  if (c == nullptr) return 12;
  kvf_client_registration r = KVF_CLIENT_REGISTRATION_INIT;
  st = register_memory(c, m, mem, &r);
  if (!send_report(report, st, &r) || st != KVF_SUCCESS) return 13;
  for (;;) {
    char cmd = 0;
    struct pollfd p = {control, POLLIN, 0};
    int rc = poll(&p, 1, 50);
    if (rc > 0) {
      if (read(control, &cmd, 1) != 1) return 0;
      if (cmd == 'q') {
        uint32_t state = 0;
        if (kvf_client_unregister(c, 0, &state) != KVF_SUCCESS || state != KVF_PROTO_REG_CLOSED) return 14;
        kvf_client_disconnect(c);
        return 0;
      }
    }
    if (kvf_client_heartbeat(c, nullptr) != KVF_SUCCESS) return 15;
  }
}

// ---- the fixture --------------------------------------------------------------

class Lifecycle : public ::testing::Test {
 protected:
  void SetUp() override {
    signal(SIGPIPE, SIG_IGN);  // a dead engine's pipe must fail the test, not kill it
    char tmpl[] = "/tmp/kvf-lifecycle-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    base_ = tmpl;
    dir_ = base_ + "/sock";
    std::string why;
    ASSERT_TRUE(load_model("deepseek-v3-mla-bf16.json", 2, &mla_, &why)) << why;       // 61 regions
    ASSERT_TRUE(load_model("gpt-oss-20b-like.json", 2, &oss_, &why)) << why;           // 12 regions
    ASSERT_TRUE(load_model("llama-3.1-8b-crosslayer-fa-nhd.json", 2, &cross_, &why)) << why;  // 1 region
    ASSERT_TRUE(load_model("glm-like-hybrid.json", 2, &glm_, &why)) << why;            // 8 regions, 3 groups
    fds_before_ = fd_count();
  }
  void TearDown() override {
    for (Engine &e : engines_) close_engine(&e);
    server_.kill_now();
    chmod(base_.c_str(), 0700);
    nftw(base_.c_str(), remove_one, 16, FTW_DEPTH | FTW_PHYS);
    EXPECT_EQ(fd_count(), fds_before_) << "descriptors leaked in the test process";
  }
  Engine &add(Engine e) {
    engines_.push_back(e);
    return engines_.back();
  }
  // An engine's exit, expected 0; the status otherwise.
  int finish(Engine &e, int timeout_ms = 30000) {
    int st = reap(e.pid, timeout_ms);
    if (st != -1) e.pid = -1;
    close_engine(&e);
    return st;
  }

  std::string base_, dir_;
  Model mla_, oss_, cross_, glm_;
  ServerProcess server_;
  std::deque<Engine> engines_;  // a deque: references stay valid as engines are added
  int fds_before_ = 0;
};

// ---- 1. engines killed at random points ----------------------------------------

// What a churning engine reports when it settles on command.
struct Settled {
  uint32_t imports, aliases;
};

// An engine that loops: connect, register a random model over 1-3
// allocations, heartbeat, re-register (the same memory or new memory),
// heartbeat, then unregister and disconnect, or just disconnect (the
// server drains it), or unregister and register again first. Every call
// must succeed: a failure exits with the step's code. The survivor also
// takes commands between iterations: 'p' settle (register models[0] over 2
// allocations, report the counts, heartbeat until the next command), 'r'
// resume (unregister first), 'q' unregister and exit 0.
int churn_engine(const std::string &dir, const std::vector<Model> &models, uint64_t seed, bool survivor, int control,
                 int report) {
  std::mt19937_64 rng(seed);
  const Model &home = models[0];
  for (;;) {
    if (survivor) {
      struct pollfd p = {control, POLLIN, 0};
      if (poll(&p, 1, 0) > 0) {
        char cmd = 0;
        if (read(control, &cmd, 1) != 1 || cmd != 'p') return 30;
        EngineMemory mem;
        if (make_memory(home, 2, &mem) != KVF_SUCCESS) return 31;
        kvf_client *c = connect_client(dir, "survivor");
        if (c == nullptr) return 32;
        kvf_client_registration r = KVF_CLIENT_REGISTRATION_INIT;
        if (register_memory(c, home, mem, &r) != KVF_SUCCESS) return 33;
        Settled s = {r.imports, r.aliases};
        if (!put(report, &s, sizeof s)) return 34;
        for (;;) {
          struct pollfd q = {control, POLLIN, 0};
          int rc = poll(&q, 1, 50);
          if (rc > 0) {
            if (read(control, &cmd, 1) != 1) return 35;
            uint32_t state = 0;
            if (kvf_client_unregister(c, 0, &state) != KVF_SUCCESS || state != KVF_PROTO_REG_CLOSED) return 36;
            kvf_client_disconnect(c);
            if (cmd == 'q') return 0;
            if (cmd != 'r') return 37;
            break;
          }
          if (kvf_client_heartbeat(c, nullptr) != KVF_SUCCESS) return 38;
        }
      }
    }
    const Model &m = models[rng() % models.size()];
    uint32_t k = 1 + (uint32_t)(rng() % std::min<uint32_t>(3, m.regions()));
    kvf_client_info info = KVF_CLIENT_INFO_INIT;
    kvf_client *c = connect_client(dir, survivor ? "survivor" : "victim", nullptr, &info);
    if (c == nullptr) return 10;
    EngineMemory mem;
    if (make_memory(m, k, &mem) != KVF_SUCCESS) return 11;
    if (register_memory(c, m, mem, nullptr) != KVF_SUCCESS) return 12;
    for (uint64_t h = rng() % 3; h > 0; h--) {
      uint64_t token = 0;
      if (kvf_client_heartbeat(c, &token) != KVF_SUCCESS) return 13;
      if (token != info.boot_token) return 14;
    }
    if (rng() % 2) {  // the same memory again: the mappings are shared, nothing new is imported
      if (register_memory(c, m, mem, nullptr) != KVF_SUCCESS) return 15;
    } else {  // new memory, maybe another model: the old registration is unmapped
      const Model &m2 = models[rng() % models.size()];
      EngineMemory mem2;
      if (make_memory(m2, 1 + (uint32_t)(rng() % std::min<uint32_t>(3, m2.regions())), &mem2) != KVF_SUCCESS)
        return 16;
      if (register_memory(c, m2, mem2, nullptr) != KVF_SUCCESS) return 17;
    }
    if (kvf_client_heartbeat(c, nullptr) != KVF_SUCCESS) return 18;
    uint32_t state = 0;
    switch (rng() % 3) {
      case 0:
        if (kvf_client_unregister(c, 0, &state) != KVF_SUCCESS || state != KVF_PROTO_REG_CLOSED) return 19;
        break;
      case 1: break;  // disconnect while registered
      case 2:
        if (kvf_client_unregister(c, 0, &state) != KVF_SUCCESS || state != KVF_PROTO_REG_CLOSED) return 20;
        if (register_memory(c, m, mem, nullptr) != KVF_SUCCESS) return 21;
        if (kvf_client_unregister(c, 0, &state) != KVF_SUCCESS || state != KVF_PROTO_REG_CLOSED) return 22;
        break;
    }
    kvf_client_disconnect(c);
  }
}

uint64_t test_seed() {
  const char *env = std::getenv("KVF_TEST_SEED");
  if (env && *env) return std::strtoull(env, nullptr, 0);
  return ((uint64_t)std::random_device{}() << 32) ^ std::random_device{}();
}

TEST_F(Lifecycle, EnginesKilledAtRandomPointsAreReapedAndTheSurvivorIsServedThroughout) {
  const uint64_t seed = test_seed();
  std::printf("seed %" PRIu64 " (KVF_TEST_SEED=%" PRIu64 " replays it)\n", seed, seed);
  RecordProperty("seed", std::to_string(seed));
  std::mt19937_64 rng(seed);
  constexpr uint32_t kTimeoutMs = 1000;
  constexpr int64_t kMarginMs = 1500;  // the loop's tick and a loaded 2-core machine under ASan
  constexpr int kRounds = 4, kVictims = 4;
  const std::vector<Model> models = {mla_, oss_, cross_, glm_};
  ASSERT_TRUE(server_.start(dir_, kTimeoutMs));
  Engine &survivor = add(spawn_engine([&](int ctl, int rep) {
    return churn_engine(dir_, models, seed ^ 0x5u, true, ctl, rep);
  }));
  ASSERT_GT(survivor.pid, 0);

  // The survivor settles; the server must hold its registration and nothing else within the timeout.
  auto check_only_survivor = [&](int64_t since_ms, const char *when) {
    ASSERT_TRUE(put_byte(survivor.control, 'p'));
    Settled s{};
    ASSERT_TRUE(get(survivor.report, &s, sizeof s, 20000))
        << when << ": the survivor did not settle (exit status " << reap(survivor.pid, 1000) << ")";
    EXPECT_EQ(s.imports, 2u);
    EXPECT_EQ(s.aliases, models[0].regions());
    kvf_client_stats st = KVF_CLIENT_STATS_INIT;
    bool ok = wait_settled(dir_, Want{s.imports, s.aliases, 1}, kTimeoutMs + kMarginMs - (mono_ms() - since_ms), &st);
    int64_t took = mono_ms() - since_ms;
    EXPECT_TRUE(ok) << when << ": not reaped within " << kTimeoutMs << " + " << kMarginMs << " ms: " << describe(st)
                    << " (seed " << seed << ")";
    if (ok) std::printf("%s: only the survivor's registration left after %lld ms\n", when, (long long)took);
  };

  for (int round = 0; round < kRounds; round++) {
    // Churning engines, and in odd rounds one that holds a registration for
    // sure. Each dies at its own random time: SIGKILL closes its connection
    // at once; a SIGSTOPped one hangs with its connection open (the holder
    // always, a churner one time in five), and only the heartbeat timeout
    // finds it.
    std::vector<Engine *> victims;
    std::vector<int> sig;
    for (int v = 0; v < kVictims; v++) {
      uint64_t vseed = rng();
      victims.push_back(&add(spawn_engine([&, vseed](int ctl, int rep) {
        return churn_engine(dir_, models, vseed, false, ctl, rep);
      })));
      ASSERT_GT(victims.back()->pid, 0);
      sig.push_back(rng() % 5 == 0 ? SIGSTOP : SIGKILL);
    }
    if (round % 2 == 1) {
      const Model &hm = models[rng() % models.size()];
      victims.push_back(&add(spawn_engine([&](int ctl, int rep) {
        return holding_engine(dir_, hm, 1, 0, 0, ctl, rep);
      })));
      Report r{};
      ASSERT_TRUE(get(victims.back()->report, &r, sizeof r, 20000));
      ASSERT_EQ(r.status, KVF_SUCCESS) << r.message;
      sig.push_back(SIGSTOP);
    }
    std::vector<std::pair<int64_t, int>> plan;
    for (size_t v = 0; v < victims.size(); v++) plan.push_back({(int64_t)(20 + rng() % 400), (int)v});
    std::sort(plan.begin(), plan.end());
    int hung = 0;
    int64_t t0 = mono_ms();
    for (auto &[at, v] : plan) {
      sleep_ms(t0 + at - mono_ms());
      int rc = reap(victims[v]->pid, 0);
      ASSERT_EQ(rc, -1) << "round " << round << ": victim " << v << " ended on its own with status " << rc
                        << " (10+: the step that failed; seed " << seed << ")";
      ASSERT_EQ(kill(victims[v]->pid, sig[v]), 0);
      hung += sig[v] == SIGSTOP;
    }
    std::string when = "round " + std::to_string(round) + " (" + std::to_string(hung) + " hung)";
    check_only_survivor(mono_ms(), when.c_str());
    for (size_t v = 0; v < victims.size(); v++) {
      if (sig[v] == SIGSTOP) kill(victims[v]->pid, SIGKILL);
      EXPECT_EQ(reap(victims[v]->pid), 1000 + SIGKILL) << when << ": victim " << v;
      victims[v]->pid = -1;
      close_engine(victims[v]);
    }
    ASSERT_TRUE(put_byte(survivor.control, 'r'));
  }
  check_only_survivor(mono_ms(), "the end");
  ASSERT_TRUE(put_byte(survivor.control, 'q'));
  EXPECT_EQ(finish(survivor), 0) << "the survivor failed a call (30+: settling, 10+: churning)";
  kvf_client_stats st = KVF_CLIENT_STATS_INIT;
  EXPECT_TRUE(wait_settled(dir_, Want{0, 0, 0}, 2000, &st)) << describe(st);
  EXPECT_EQ(server_.stop(), 0) << "2 create, 3 run, 4 still mapped, 5 descriptors leaked";
}

// ---- 2. a restarted engine -------------------------------------------------------

TEST_F(Lifecycle, ARestartedEngineIsServedAnew) {
  constexpr uint32_t kTimeoutMs = 800;
  constexpr int64_t kMarginMs = 1500;
  const uint64_t instance = 0x6b76665f72657374ull;
  ASSERT_TRUE(server_.start(dir_, kTimeoutMs));
  const Want one{2, mla_.regions(), 1}, two{4, 2ull * mla_.regions(), 2}, none{0, 0, 0};
  auto holder = [&](uint64_t generation) -> Engine & {
    Engine &e = add(spawn_engine([&, generation](int ctl, int rep) {
      return holding_engine(dir_, mla_, 2, instance, generation, ctl, rep);
    }));
    Report r{};
    EXPECT_TRUE(get(e.report, &r, sizeof r, 20000)) << "no report from generation " << generation;
    EXPECT_EQ(r.status, KVF_SUCCESS) << status_name(r.status) << ": " << r.message;
    EXPECT_EQ(r.imports, 2u);
    EXPECT_EQ(r.aliases, mla_.regions());
    return e;
  };
  kvf_client_stats st = KVF_CLIENT_STATS_INIT;

  // Generation 1 registers and dies; the server drains it.
  Engine &g1 = holder(1);
  EXPECT_TRUE(wait_settled(dir_, one, 1000, &st)) << describe(st);
  ASSERT_EQ(kill(g1.pid, SIGKILL), 0);
  EXPECT_EQ(finish(g1), 1000 + SIGKILL);
  int64_t t = mono_ms();
  EXPECT_TRUE(wait_settled(dir_, none, kTimeoutMs + kMarginMs, &st)) << describe(st);
  EXPECT_EQ(st.closed_total, 1u);
  std::printf("the killed engine was unmapped after %lld ms\n", (long long)(mono_ms() - t));

  // Its restart (generation 2) registers the same kind of memory anew.
  Engine &g2 = holder(2);
  EXPECT_TRUE(wait_settled(dir_, one, 1000, &st)) << "only the new engine's memory: " << describe(st);

  // Generation 2 hangs instead; generation 3 is served beside it until the
  // hung one is reaped (its memory is other memory: the generation differs).
  ASSERT_EQ(kill(g2.pid, SIGSTOP), 0);
  t = mono_ms();
  Engine &g3 = holder(3);
  ASSERT_TRUE(stat_fresh(dir_, &st));
  // The hung one heartbeat at most 50 ms before it stopped: it is not
  // reaped before timeout - 50 ms. Only a STAT taken after that can miss it.
  if (mono_ms() - t < (int64_t)kTimeoutMs - 100) {
    EXPECT_TRUE(settled(st, two)) << "both mapped: " << describe(st);
  } else {
    std::printf("too slow to see both engines mapped (%lld ms)\n", (long long)(mono_ms() - t));
  }
  EXPECT_TRUE(wait_settled(dir_, one, kTimeoutMs + kMarginMs, &st))
      << "the hung engine was not reaped: " << describe(st);
  std::printf("the hung engine was reaped after %lld ms\n", (long long)(mono_ms() - t));
  ASSERT_TRUE(put_byte(g3.control, 'q'));
  EXPECT_EQ(finish(g3), 0) << "the new engine's heartbeats or unregister failed";
  kill(g2.pid, SIGKILL);
  EXPECT_EQ(finish(g2), 1000 + SIGKILL);
  EXPECT_TRUE(wait_settled(dir_, none, 2000, &st)) << describe(st);
  EXPECT_EQ(st.closed_total, 3u);
  EXPECT_EQ(server_.stop(), 0) << "2 create, 3 run, 4 still mapped, 5 descriptors leaked";
}

// ---- 3. a re-registration that fails inside the server's import --------------

// Fails the k-th system call of the host import steps (fstat, fcntl, mmap,
// mprotect) made while armed. Counted with atomics: the server's thread
// ticks them while the test thread arms.
std::atomic<bool> g_armed{false};
std::atomic<long> g_calls{0}, g_fail_at{0};
std::atomic<const char *> g_hit{nullptr};

bool import_fault(const char *name) {
  if (!g_armed.load()) return false;
  if (++g_calls != g_fail_at.load()) return false;
  g_hit = name;
  return true;
}
void arm_import_fault(long k) {
  g_calls = 0;
  g_fail_at = k;
  g_hit = nullptr;
  g_armed = true;
}

kvf_sys_table import_fault_table() {
  kvf_sys_table t = *kvf_sys_table_default();
  t.fstat = [](int fd, struct stat *s) {
    if (import_fault("fstat")) return errno = EIO, -1;
    return kvf_sys_table_default()->fstat(fd, s);
  };
  t.fcntl = [](int fd, int cmd, int arg) {
    if (import_fault("fcntl")) return errno = EBADF, -1;
    return kvf_sys_table_default()->fcntl(fd, cmd, arg);
  };
  t.mmap = [](void *a, size_t l, int p, int f, int fd, off_t o) -> void * {
    if (import_fault("mmap")) return errno = ENOMEM, MAP_FAILED;
    return kvf_sys_table_default()->mmap(a, l, p, f, fd, o);
  };
  t.mprotect = [](void *a, size_t l, int p) {
    if (import_fault("mprotect")) return errno = EACCES, -1;
    return kvf_sys_table_default()->mprotect(a, l, p);
  };
  return t;
}

TEST_F(Lifecycle, AReRegistrationFailingAtEveryImportStepLeavesThePreviousServing) {
  // The engine first: nothing may run on another thread when it forks.
  Engine &e = add(spawn_engine([&](int ctl, int rep) { return scripted_engine(dir_, cross_, oss_, 0, 0, ctl, rep); }));
  ASSERT_GT(e.pid, 0);
  kvf_sys_table table = import_fault_table();
  const kvf_sys_table *previous = kvf_sys_table_install(&table);
  FILE *devnull = std::fopen("/dev/null", "w");  // every injected failure warns
  ASSERT_NE(devnull, nullptr);
  kvf_log_set_sink(devnull);
  {
    ServerThread server;
    ASSERT_EQ(server.start(dir_, 30000), KVF_SUCCESS) << kvf_last_error();
    Report r = command(e, 'c');
    ASSERT_EQ(r.status, KVF_SUCCESS) << r.message;
    r = command(e, 'A');
    ASSERT_EQ(r.status, KVF_SUCCESS) << r.message;
    const Want a{1, cross_.regions(), 1};
    kvf_registry_stats s;
    ASSERT_TRUE(server.wait_settled(a, 1000, &s));
    int fds = fd_count();  // the server's and the test's: received descriptors must not stay

    // Registration B (2 allocations: 2 imports) with its k-th import call failing, for every k.
    long k = 1;
    for (; k < 100; k++) {
      SCOPED_TRACE("import call " + std::to_string(k) + " fails");
      arm_import_fault(k);
      r = command(e, 'B');
      g_armed = false;
      if (r.status == KVF_SUCCESS) break;
      ASSERT_NE(g_hit.load(), nullptr) << "failed without the fault: " << status_name(r.status) << ": " << r.message;
      EXPECT_NE(std::strstr(r.message, "payload.regions"), nullptr) << r.message;
      s = server.stats();
      EXPECT_EQ(s.active, 1u) << "call " << g_hit.load();
      EXPECT_EQ(s.imports, a.imports) << "call " << g_hit.load() << ": the attempt's mappings were not undone";
      EXPECT_EQ(s.aliases, a.aliases) << "call " << g_hit.load();
      EXPECT_EQ(s.registering + s.draining + s.leases + s.unmap_pending, 0u) << "call " << g_hit.load();
      EXPECT_EQ(s.failed_total, (uint64_t)k) << "each failure is one rolled-back attempt";
      EXPECT_EQ(s.closed_total, 0u) << "the previous registration was never unmapped";
      EXPECT_EQ(fd_count(), fds) << "call " << g_hit.load() << ": a received descriptor stayed open";
      r = command(e, 'h');
      EXPECT_EQ(r.status, KVF_SUCCESS) << "the connection stays: " << r.message;
    }
    // 5 calls per import (fstat, fcntl, reserve mmap, map mmap, mprotect), 2
    // imports; call 11 is the unmap of A, replaced by B once B is mapped: its
    // failure does not fail the commit, and the server's collect retries it.
    EXPECT_EQ(k, 11) << "the number of import calls changed; check the counting";
    ASSERT_NE(g_hit.load(), nullptr) << "the replaced registration was not unmapped in the commit";
    EXPECT_STREQ(g_hit.load(), "mmap");
    // (A 12th call may follow: the server's collect retrying A's unmap.)
    EXPECT_GE(g_calls.load(), k) << "the successful attempt made the calls failed in turn, then the unmap";
    EXPECT_EQ(r.imports, 3u) << "B's 2, and A's mapping whose unmap failed";
    EXPECT_EQ(r.aliases, oss_.regions()) << "A's views are gone from the count even though its unmap failed";
    s = server.stats();
    EXPECT_EQ(s.active, 1u);
    // A waits for the server's collect (once a second), unless it already ran.
    EXPECT_TRUE((s.unmap_pending == 1 && s.imports == 3) || (s.unmap_pending == 0 && s.imports == 2))
        << "unmap_pending " << s.unmap_pending << ", imports " << s.imports;
    const Want b{2, oss_.regions(), 1};
    EXPECT_TRUE(server.wait_settled(b, 3000, &s)) << "A's unmap was not retried: imports " << s.imports;
    EXPECT_EQ(s.closed_total, 1u);

    // Once more the other way (B live, A's import fails at its first call),
    // then the unregister of the live one takes everything back to zero.
    arm_import_fault(1);
    r = command(e, 'A');
    g_armed = false;
    EXPECT_NE(r.status, KVF_SUCCESS);
    EXPECT_TRUE(server.wait_settled(b, 1000, &s));
    r = command(e, 'u');
    EXPECT_EQ(r.status, KVF_SUCCESS) << r.message;
    EXPECT_TRUE(server.wait_settled(Want{0, 0, 0}, 1000, &s)) << "imports " << s.imports << ", aliases " << s.aliases;
    EXPECT_EQ(fd_count(), fds);
    r = command(e, 'q');
    EXPECT_EQ(finish(e), 0);
    EXPECT_EQ(server.stop(), KVF_SUCCESS);
  }
  kvf_sys_table_install(previous);
  kvf_log_set_sink(nullptr);
  std::fclose(devnull);
}

// Raw frames, to send what the client library never would: an identity
// whose descriptor is something else.
class RawConn {
 public:
  ~RawConn() { kvf_conn_close(&conn_); }
  bool open(const std::string &dir) {
    if (kvf_endpoint_connect(dir.c_str(), 0, &conn_) != KVF_SUCCESS) return false;
    kvf_proto_msg m;
    std::memset(&m, 0, sizeof m);
    m.type = KVF_PROTO_HELLO;
    m.u.hello.min_version = m.u.hello.max_version = KVF_PROTO_VERSION;
    m.u.hello.pid = (uint32_t)getpid();
    kvf_mem_instance(&m.u.hello.instance_id, &m.u.hello.generation);
    kvf_proto_msg reply;
    bool ok = call(&m, nullptr, 0, &reply) == KVF_SUCCESS && reply.type == KVF_PROTO_HELLO_REPLY;
    kvf_proto_msg_clear(&reply);
    return ok;
  }
  // Send and read the reply (an ERROR is a reply too). The descriptors stay ours.
  kvf_status call(kvf_proto_msg *m, const int *fds, uint32_t num_fds, kvf_proto_msg *reply) {
    std::memset(reply, 0, sizeof(*reply));
    m->request_id = next_++;
    kvf_status st = kvf_conn_send(&conn_, m, fds, num_fds, 5000);
    if (st != KVF_SUCCESS) return st;
    kvf_proto_header h;
    uint8_t *payload = nullptr;
    int rfds[4];
    uint32_t n = 0;
    st = kvf_conn_read_frame(&conn_, 10000, &h, &payload, rfds, 4, &n);
    if (st != KVF_SUCCESS) return st;
    for (uint32_t i = 0; i < n; i++) close(rfds[i]);
    st = kvf_proto_decode(&h, payload, reply);
    std::free(payload);
    if (st == KVF_SUCCESS && reply->request_id != m->request_id) st = KVF_ERR_PROTOCOL;
    return st;
  }
  // REGISTER model m as one region of allocation `id` at offset 0, length
  // len, with descriptor fd (closed here).
  kvf_status register_one(const Model &m, const kvf_mem_identity &id, uint64_t len, int fd, kvf_proto_msg *reply) {
    kvf_proto_region region;
    std::memset(&region, 0, sizeof region);
    region.instance_id = id.instance_id;
    region.allocation_id = id.allocation_id;
    region.generation = id.generation;
    region.size = id.size;
    std::memcpy(region.device_uuid, id.device_uuid, sizeof region.device_uuid);
    region.provider = id.provider;
    region.length = len;
    std::vector<char> json(m.json.begin(), m.json.end());
    json.push_back('\0');
    kvf_proto_msg msg;
    std::memset(&msg, 0, sizeof msg);
    msg.type = KVF_PROTO_REGISTER;
    msg.u.reg.device = -1;
    msg.u.reg.shard_count = 1;
    msg.u.reg.num_fds = 1;
    msg.u.reg.geometry_json = json.data();
    msg.u.reg.geometry_json_len = (uint32_t)m.json.size();
    msg.u.reg.regions = &region;
    msg.u.reg.num_regions = 1;
    kvf_status st = call(&msg, &fd, 1, reply);
    close(fd);
    return st;
  }
  kvf_status simple(uint16_t type, kvf_proto_msg *reply) {
    kvf_proto_msg m;
    std::memset(&m, 0, sizeof m);
    m.type = type;
    return call(&m, nullptr, 0, reply);
  }
  kvf_proto_counters stat() {
    kvf_proto_msg reply;
    kvf_proto_counters c;
    std::memset(&c, 0, sizeof c);
    EXPECT_EQ(simple(KVF_PROTO_STAT, &reply), KVF_SUCCESS);
    EXPECT_EQ(reply.type, KVF_PROTO_STAT_REPLY);
    if (reply.type == KVF_PROTO_STAT_REPLY) c = reply.u.stat_reply.total;
    kvf_proto_msg_clear(&reply);
    return c;
  }

 private:
  kvf_conn conn_{};
  uint64_t next_ = 1;
};

TEST_F(Lifecycle, ADescriptorThatIsNotWhatItsIdentitySaysFailsTheImportAndThePreviousStays) {
  ASSERT_TRUE(server_.start(dir_, 30000));
  const Model &m = cross_;  // one region
  const uint64_t len = m.size[0];
  auto alloc = [](uint64_t size) {
    kvf_mem_alloc_options o = KVF_MEM_ALLOC_OPTIONS_INIT;
    o.size = size;
    kvf_mem_alloc *a = nullptr;
    EXPECT_EQ(kvf_mem_alloc_create(&o, &a), KVF_SUCCESS) << kvf_last_error();
    return a;
  };
  kvf_mem_alloc *a = alloc(len), *b = alloc(len), *other = alloc(2 * len);
  ASSERT_TRUE(a && b && other);
  kvf_mem_identity ida, idb;
  int fd = -1;
  RawConn c;
  ASSERT_TRUE(c.open(dir_));
  ASSERT_EQ(kvf_mem_alloc_export(a, &fd, &ida), KVF_SUCCESS);
  kvf_proto_msg reply;
  ASSERT_EQ(c.register_one(m, ida, len, fd, &reply), KVF_SUCCESS);
  ASSERT_EQ(reply.type, KVF_PROTO_REGISTER_REPLY) << reply.u.error.field << ": " << reply.u.error.message;
  uint64_t live = reply.u.register_reply.registration_id;
  kvf_proto_msg_clear(&reply);
  ASSERT_EQ(kvf_mem_alloc_identity(b, &idb), KVF_SUCCESS);
  const std::string server_fds = "/proc/" + std::to_string(server_.pid()) + "/fd";
  int fds0 = proc_entries(server_fds);
  ASSERT_GT(fds0, 0);

  struct Case {
    const char *what;
    std::function<int()> make_fd;  // the descriptor sent with b's identity
    uint64_t identity_size;        // what the identity says b's size is
  };
  std::vector<Case> cases = {
      {"another memfd of another size",
       [&] {
         int f = -1;
         EXPECT_EQ(kvf_mem_alloc_export(other, &f, nullptr), KVF_SUCCESS);
         return f;
       },
       idb.size},
      {"b's own memfd, with an identity that claims twice its size",
       [&] {
         int f = -1;
         EXPECT_EQ(kvf_mem_alloc_export(b, &f, nullptr), KVF_SUCCESS);
         return f;
       },
       2 * idb.size},
      {"a memfd of the right size without seals",
       [&] {
         int f = memfd_create("kvf-unsealed", MFD_CLOEXEC);
         EXPECT_EQ(ftruncate(f, (off_t)idb.size), 0);
         return f;
       },
       idb.size},
      {"a pipe",
       [&] {
         int p[2];
         EXPECT_EQ(pipe2(p, O_CLOEXEC), 0);
         close(p[1]);
         return p[0];
       },
       idb.size},
  };
  uint32_t failed = 0;
  for (const Case &k : cases) {
    SCOPED_TRACE(k.what);
    int f = k.make_fd();
    ASSERT_GE(f, 0);
    kvf_mem_identity id = idb;
    id.size = k.identity_size;
    ASSERT_EQ(c.register_one(m, id, len, f, &reply), KVF_SUCCESS) << "the connection must stay";
    ASSERT_EQ(reply.type, KVF_PROTO_ERROR);
    EXPECT_EQ(reply.u.error.status, (uint32_t)KVF_ERR_PROTOCOL) << reply.u.error.field << ": " << reply.u.error.message;
    EXPECT_EQ(std::strncmp(reply.u.error.field, "payload.regions", 15), 0)
        << reply.u.error.field << ": " << reply.u.error.message;
    kvf_proto_msg_clear(&reply);
    failed++;  // refused inside the import: a rolled-back attempt
    ASSERT_EQ(c.simple(KVF_PROTO_HEARTBEAT, &reply), KVF_SUCCESS);
    EXPECT_EQ(reply.type, KVF_PROTO_HEARTBEAT_REPLY);
    kvf_proto_msg_clear(&reply);
    kvf_proto_counters s = c.stat();
    EXPECT_EQ(s.registrations[KVF_PROTO_REG_ACTIVE], 1u);
    EXPECT_EQ(s.imports, 1u);
    EXPECT_EQ(s.aliases, 1u);
    EXPECT_EQ(s.leases, 0u);
    EXPECT_EQ(s.registrations[KVF_PROTO_REG_FAILED], failed);
    EXPECT_EQ(proc_entries(server_fds), fds0) << "the server kept the bad descriptor";
  }
  // The previous registration is still the live one and unregisters cleanly.
  kvf_proto_msg un;
  std::memset(&un, 0, sizeof un);
  un.type = KVF_PROTO_UNREGISTER;
  ASSERT_EQ(c.call(&un, nullptr, 0, &reply), KVF_SUCCESS);
  ASSERT_EQ(reply.type, KVF_PROTO_UNREGISTER_REPLY);
  EXPECT_EQ(reply.u.unregister_reply.registration_id, live);
  EXPECT_EQ(reply.u.unregister_reply.state, (uint32_t)KVF_PROTO_REG_CLOSED);
  kvf_proto_msg_clear(&reply);
  kvf_proto_counters s = c.stat();
  EXPECT_EQ(s.imports, 0u);
  EXPECT_EQ(s.aliases, 0u);
  EXPECT_EQ(s.registrations[KVF_PROTO_REG_ACTIVE], 0u);
  kvf_mem_alloc_destroy(a);
  kvf_mem_alloc_destroy(b);
  kvf_mem_alloc_destroy(other);
  EXPECT_EQ(server_.stop(), 0) << "2 create, 3 run, 4 still mapped, 5 descriptors leaked";
}

// ---- 4. another uid ----------------------------------------------------------------

TEST_F(Lifecycle, AClientOfAnotherUidIsRefusedWhileTheServerKeepsServing) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to run a client as another uid (nobody, 65534)";
  const std::string log = base_ + "/server.log";
  ASSERT_TRUE(server_.start(dir_, 30000, log));
  Engine &e = add(spawn_engine([&](int ctl, int rep) { return scripted_engine(dir_, mla_, oss_, 0, 0, ctl, rep); }));
  Report r = command(e, 'c');
  ASSERT_EQ(r.status, KVF_SUCCESS) << r.message;
  r = command(e, 'A');
  ASSERT_EQ(r.status, KVF_SUCCESS) << r.message;
  const Want a{1, mla_.regions(), 1};

  // Connect as nobody; the child's exit status is 100 + the status it got.
  auto as_nobody = [&]() {
    pid_t pid = fork_clean();
    if (pid == 0) {
      if (setgroups(0, nullptr) != 0 || setgid(65534) != 0 || setuid(65534) != 0) _exit(99);
      kvf_status st = KVF_SUCCESS;
      kvf_client *c = connect_client(dir_, "intruder", &st);
      if (c != nullptr) {  // it must not get this far; if it did, try to do harm
        kvf_client_stats s = KVF_CLIENT_STATS_INIT;
        kvf_client_stat(c, &s);
        kvf_client_disconnect(c);
      }
      _exit(100 + (int)st);
    }
    return reap(pid, 20000);
  };

  // The server made its directory 0700: with the path above it open, the
  // directory alone keeps another user from the socket.
  ASSERT_EQ(chmod(base_.c_str(), 0711), 0);
  int rc = as_nobody();
  EXPECT_EQ(rc, 100 + KVF_ERR_PERMISSION) << "got " << (rc >= 100 ? status_name(rc - 100) : std::to_string(rc));

  // Opened up on purpose: the server's SO_PEERCRED check still refuses it
  // (it hangs up before HELLO is answered).
  ASSERT_EQ(chmod(dir_.c_str(), 0711), 0);
  ASSERT_EQ(chmod((dir_ + "/" KVF_ENDPOINT_SOCKET_NAME).c_str(), 0666), 0);
  for (int i = 0; i < 3; i++) {
    rc = as_nobody();
    EXPECT_EQ(rc, 100 + KVF_ERR_DISCONNECTED) << "got " << (rc >= 100 ? status_name(rc - 100) : std::to_string(rc));
  }

  // The legitimate engine was served all along, and a new client is.
  r = command(e, 'h');
  EXPECT_EQ(r.status, KVF_SUCCESS) << r.message;
  kvf_client_stats st = KVF_CLIENT_STATS_INIT;
  EXPECT_TRUE(wait_settled(dir_, a, 1000, &st)) << describe(st);
  std::ifstream in(log);
  std::stringstream text;
  text << in.rdbuf();
  EXPECT_NE(text.str().find("uid 65534"), std::string::npos) << "the refusal was not logged: " << text.str();
  r = command(e, 'u');
  EXPECT_EQ(r.status, KVF_SUCCESS) << r.message;
  r = command(e, 'q');
  EXPECT_EQ(finish(e), 0);
  EXPECT_TRUE(wait_settled(dir_, Want{0, 0, 0}, 1000, &st)) << describe(st);
  EXPECT_EQ(server_.stop(), 0) << "2 create, 3 run, 4 still mapped, 5 descriptors leaked";
}

// ---- 5. many cycles ------------------------------------------------------------------

// 1000 connect/register/unregister/disconnect cycles from a child process
// against a server on a thread of this process: the server's descriptors,
// threads and memory stay where they were after a warmup.
TEST_F(Lifecycle, AThousandCyclesLeaveTheServersDescriptorsMemoryAndThreadsAlone) {
  constexpr int kWarmup = 100, kCycles = 1000;
  const Model &m = mla_;  // 61 regions over 2 allocations: 2 imports, 61 aliases a cycle
  // 'g' starts the warmup, 'w' says it is done; 'g' again runs the rest, 'd' when done.
  Engine &e = add(spawn_engine([&](int ctl, int rep) {
    EngineMemory mem;
    if (make_memory(m, 2, &mem) != KVF_SUCCESS) return 10;
    char cmd = 0;
    for (int i = 0; i < kCycles; i++) {
      if ((i == 0 || i == kWarmup) && (!get(ctl, &cmd, 1, 120000) || cmd != 'g')) return 11;
      kvf_client *c = connect_client(dir_, "cycler");
      if (c == nullptr) return 12;
      if (register_memory(c, m, mem, nullptr) != KVF_SUCCESS) return 13;
      uint32_t state = 0;
      // Even cycles unregister; odd ones leave it to the disconnect.
      if (i % 2 == 0 && (kvf_client_unregister(c, 0, &state) != KVF_SUCCESS || state != KVF_PROTO_REG_CLOSED))
        return 14;
      kvf_client_disconnect(c);
      if ((i == kWarmup - 1 || i == kCycles - 1) && !put_byte(rep, i == kWarmup - 1 ? 'w' : 'd')) return 15;
    }
    return 0;
  }));
  ASSERT_GT(e.pid, 0);
  const std::string self_fd = "/proc/self/fd", self_task = "/proc/self/task";
  ServerThread server;
  ASSERT_EQ(server.start(dir_, 30000), KVF_SUCCESS) << kvf_last_error();
  kvf_registry_stats s;
  char ack = 0;
  ASSERT_TRUE(put_byte(e.control, 'g'));
  ASSERT_TRUE(get(e.report, &ack, 1, 120000)) << "warmup: the cycler stopped (" << reap(e.pid, 1000) << ")";
  ASSERT_TRUE(server.wait_settled(Want{0, 0, 0}, 5000, &s));
  int fds0 = steady_entries(self_fd), threads0 = proc_entries(self_task);
  long rss0 = rss_kb();
  uint64_t heap0 = heap_in_use();
  int64_t t0 = mono_ms();
  ASSERT_TRUE(put_byte(e.control, 'g'));
  ASSERT_TRUE(get(e.report, &ack, 1, 300000)) << "the cycler stopped (" << reap(e.pid, 1000) << ")";
  int64_t took = mono_ms() - t0;
  EXPECT_TRUE(server.wait_settled(Want{0, 0, 0}, 5000, &s)) << "imports " << s.imports << ", aliases " << s.aliases;
  int fds1 = steady_entries(self_fd), threads1 = proc_entries(self_task);
  long rss1 = rss_kb();
  uint64_t heap1 = heap_in_use();
  EXPECT_EQ(finish(e), 0) << "10+: the cycler's step that failed";  // (closes its pipes: after the count)
  std::printf("%d cycles in %lld ms; descriptors %d -> %d, threads %d -> %d, RSS %ld -> %ld KiB, heap %" PRIu64
              " -> %" PRIu64 " bytes\n",
              kCycles - kWarmup, (long long)took, fds0, fds1, threads0, threads1, rss0, rss1, heap0, heap1);
  EXPECT_EQ(fds1, fds0) << "the server leaks descriptors";
  EXPECT_EQ(threads1, threads0) << "the server leaks threads";
  // A leak of 64 bytes a cycle shows; allocator noise does not.
  EXPECT_LE(heap1, heap0 + 32 * 1024) << "the server's heap grows with the cycles";
#ifndef KVF_TEST_SANITIZED  // the sanitizers' quarantine and shadow grow RSS on their own
  EXPECT_LE(rss1, rss0 + 4096) << "the server's RSS grows with the cycles";
#endif
  EXPECT_EQ(s.imports + s.aliases + s.leases + s.active + s.draining + s.registering, 0u);
  EXPECT_EQ(s.closed_total, (uint64_t)kCycles) << "every cycle's registration was unmapped once";
  EXPECT_EQ(s.failed_total, 0u);
  EXPECT_EQ(server.stop(), KVF_SUCCESS);
}

}  // namespace
