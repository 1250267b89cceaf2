// kvferryd's socket endpoint (host/endpoint.h): the socket directory's
// checks, the one-server lock, stale sockets, SO_PEERCRED, and frames with
// descriptors over real sockets between real processes. Every case checks
// that it leaves no descriptor open.
#include <dirent.h>
#include <fcntl.h>
#include <ftw.h>
#include <grp.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "host/ipc/endpoint.h"
#include "host/core/log.h"
#include "host/core/syscalls.h"

#include "mem_test_util.h"

namespace {

using kvf_mem_test::fd_count;

int remove_one(const char *path, const struct stat *, int, struct FTW *) { return remove(path); }

void remove_tree(const std::string &path) {
  chmod(path.c_str(), 0700);
  nftw(path.c_str(), remove_one, 16, FTW_DEPTH | FTW_PHYS);
}

// Run fn in a child process; returns its pid. The child never returns into
// the test: it _exits with fn's result.
pid_t spawn(const std::function<int()> &fn) {
  pid_t pid = fork();
  if (pid == 0) _exit(fn());
  return pid;
}

// The child's exit status, or 1000 + signal when it was killed.
int reap(pid_t pid) {
  int status = 0;
  if (waitpid(pid, &status, 0) != pid) return -1;
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  return 1000 + WTERMSIG(status);
}

int64_t mono_ms() {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

int make_memfd(const char *text) {
  int fd = memfd_create("kvf-endpoint-test", MFD_CLOEXEC);
  if (fd >= 0 && write(fd, text, strlen(text)) != (ssize_t)strlen(text)) {
    close(fd);
    return -1;
  }
  return fd;
}

std::string read_fd_text(int fd) {
  char buf[64] = {0};
  ssize_t n = pread(fd, buf, sizeof buf - 1, 0);
  return n > 0 ? std::string(buf, (size_t)n) : std::string();
}

bool cloexec(int fd) { return (fcntl(fd, F_GETFD) & FD_CLOEXEC) != 0; }

// Read one frame and decode it; fds (if any) go to out_fds.
kvf_status read_msg(kvf_conn *c, int timeout_ms, kvf_proto_msg *msg, std::vector<int> *out_fds = nullptr) {
  kvf_proto_header h;
  uint8_t *payload = nullptr;
  int fds[KVF_PROTO_MAX_FDS];
  uint32_t n = 0;
  kvf_status st = kvf_conn_read_frame(c, timeout_ms, &h, &payload, fds, KVF_PROTO_MAX_FDS, &n);
  if (st) return st;
  st = kvf_proto_decode(&h, payload, msg);
  free(payload);
  for (uint32_t i = 0; i < n; i++) {
    if (out_fds)
      out_fds->push_back(fds[i]);
    else
      close(fds[i]);
  }
  return st;
}

kvf_status heartbeat(kvf_conn *c, uint64_t seq) {
  kvf_proto_msg m;
  memset(&m, 0, sizeof m);
  m.type = KVF_PROTO_HEARTBEAT;
  m.request_id = seq;
  m.u.heartbeat.sequence = seq;
  kvf_status st = kvf_conn_send(c, &m, nullptr, 0, 5000);
  if (st) return st;
  kvf_proto_msg r;
  memset(&r, 0, sizeof r);
  if ((st = read_msg(c, 5000, &r))) return st;
  if (r.type != KVF_PROTO_HEARTBEAT_REPLY || r.request_id != seq || r.u.heartbeat_reply.sequence != seq)
    st = KVF_ERR_PROTOCOL;
  kvf_proto_msg_clear(&r);
  return st;
}

std::vector<uint8_t> encode(const kvf_proto_msg &m) {
  uint8_t *p = nullptr;
  size_t n = 0;
  EXPECT_EQ(kvf_proto_encode(&m, &p, &n), KVF_SUCCESS) << kvf_last_error();
  std::vector<uint8_t> v(p, p + n);
  free(p);
  return v;
}

std::vector<uint8_t> heartbeat_frame(uint64_t seq) {
  kvf_proto_msg m;
  memset(&m, 0, sizeof m);
  m.type = KVF_PROTO_HEARTBEAT;
  m.request_id = seq;
  m.u.heartbeat.sequence = seq;
  return encode(m);
}

class Endpoint : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/kvf-endpoint-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    base_ = tmpl;
    dir_ = base_ + "/sock";
    fds_before_ = fd_count();
  }
  void TearDown() override {
    EXPECT_EQ(fd_count(), fds_before_) << "a descriptor was leaked";
    remove_tree(base_);
  }
  std::string sock_path() const { return dir_ + "/" KVF_ENDPOINT_SOCKET_NAME; }
  std::string base_, dir_;
  int fds_before_ = 0;
};

// ---- the socket directory -----------------------------------------------------

TEST_F(Endpoint, CreatesMissingDirectory0700EvenUnderAStrictUmask) {
  mode_t old = umask(0277);
  kvf_status st = kvf_endpoint_check_dir(dir_.c_str());
  umask(old);
  ASSERT_EQ(st, KVF_SUCCESS) << kvf_last_error();
  struct stat sb;
  ASSERT_EQ(lstat(dir_.c_str(), &sb), 0);
  EXPECT_TRUE(S_ISDIR(sb.st_mode));
  EXPECT_EQ(sb.st_mode & 07777, 0700u);
  EXPECT_EQ(sb.st_uid, geteuid());
  // An existing good directory passes again.
  EXPECT_EQ(kvf_endpoint_check_dir(dir_.c_str()), KVF_SUCCESS) << kvf_last_error();
}

TEST_F(Endpoint, RefusesALooserModeNamingDirectoryAndMode) {
  for (mode_t mode : {0755, 0710, 0701, 0770, 0500}) {
    ASSERT_EQ(mkdir(dir_.c_str(), 0700), 0);
    ASSERT_EQ(chmod(dir_.c_str(), mode), 0);
    kvf_endpoint *ep = nullptr;
    EXPECT_EQ(kvf_endpoint_listen(dir_.c_str(), 0, &ep), KVF_ERR_PERMISSION) << std::oct << mode;
    EXPECT_EQ(ep, nullptr);
    std::string msg = kvf_last_error();
    char want[16];
    snprintf(want, sizeof want, "mode %04o", (unsigned)mode);
    EXPECT_NE(msg.find(dir_), std::string::npos) << msg;
    EXPECT_NE(msg.find(want), std::string::npos) << msg;
    // Nothing was created in the refused directory.
    EXPECT_NE(access((dir_ + "/" KVF_ENDPOINT_LOCK_NAME).c_str(), F_OK), 0);
    ASSERT_EQ(rmdir(dir_.c_str()), 0);
  }
}

TEST_F(Endpoint, RefusesADirectoryOwnedByAnotherUser) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to chown a directory to another uid";
  ASSERT_EQ(mkdir(dir_.c_str(), 0700), 0);
  ASSERT_EQ(chown(dir_.c_str(), 65534, 65534), 0);
  EXPECT_EQ(kvf_endpoint_check_dir(dir_.c_str()), KVF_ERR_PERMISSION);
  std::string msg = kvf_last_error();
  EXPECT_NE(msg.find("owned by uid 65534"), std::string::npos) << msg;
  EXPECT_NE(msg.find(dir_), std::string::npos) << msg;
}

TEST_F(Endpoint, RefusesSymlinksFilesAndOverlongPaths) {
  std::string real = base_ + "/real";
  ASSERT_EQ(mkdir(real.c_str(), 0700), 0);
  ASSERT_EQ(symlink(real.c_str(), dir_.c_str()), 0);
  EXPECT_EQ(kvf_endpoint_check_dir(dir_.c_str()), KVF_ERR_PERMISSION);
  EXPECT_NE(std::string(kvf_last_error()).find("symbolic link"), std::string::npos) << kvf_last_error();
  ASSERT_EQ(unlink(dir_.c_str()), 0);

  int fd = open(dir_.c_str(), O_CREAT | O_WRONLY | O_CLOEXEC, 0600);
  ASSERT_GE(fd, 0);
  close(fd);
  EXPECT_EQ(kvf_endpoint_check_dir(dir_.c_str()), KVF_ERR_PERMISSION);
  EXPECT_NE(std::string(kvf_last_error()).find("not a directory"), std::string::npos) << kvf_last_error();

  std::string longdir = base_ + "/" + std::string(120, 'd');
  EXPECT_EQ(kvf_endpoint_check_dir(longdir.c_str()), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvf_last_error()).find("socket_dir"), std::string::npos) << kvf_last_error();
  EXPECT_EQ(kvf_endpoint_check_dir(""), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(kvf_endpoint_check_dir(nullptr), KVF_ERR_INVALID_ARGUMENT);
}

// ---- listening, the lock, stale sockets -----------------------------------------

TEST_F(Endpoint, SocketIs0600AndASameUidPeerIsAccepted) {
  kvf_endpoint *ep = nullptr;
  ASSERT_EQ(kvf_endpoint_listen(dir_.c_str(), 0, &ep), KVF_SUCCESS) << kvf_last_error();
  struct stat sb;
  ASSERT_EQ(lstat(sock_path().c_str(), &sb), 0);
  EXPECT_TRUE(S_ISSOCK(sb.st_mode));
  EXPECT_EQ(sb.st_mode & 0777, 0600u);
  EXPECT_EQ(sock_path(), kvf_endpoint_socket_path(ep));
  EXPECT_TRUE(cloexec(kvf_endpoint_fd(ep)));

  kvf_conn srv, cli;
  EXPECT_EQ(kvf_endpoint_accept(ep, 0, 0, &srv), KVF_ERR_TIMEOUT); // nobody yet
  ASSERT_EQ(kvf_endpoint_connect(dir_.c_str(), 0, &cli), KVF_SUCCESS) << kvf_last_error();
  ASSERT_EQ(kvf_endpoint_accept(ep, 2000, 0, &srv), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(srv.peer.uid, geteuid());
  EXPECT_EQ(srv.peer.pid, getpid());
  EXPECT_TRUE(cloexec(srv.fd));
  EXPECT_TRUE(cloexec(cli.fd));
  kvf_conn_close(&cli);
  kvf_conn_close(&srv);
  kvf_endpoint_close(ep);
  EXPECT_NE(access(sock_path().c_str(), F_OK), 0) << "close removes the socket";
}

TEST_F(Endpoint, ASecondServerOnTheDirectoryIsRefusedNamingTheHolder) {
  kvf_endpoint *ep = nullptr, *ep2 = nullptr;
  ASSERT_EQ(kvf_endpoint_listen(dir_.c_str(), 0, &ep), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(kvf_endpoint_listen(dir_.c_str(), 0, &ep2), KVF_ERR_BUSY);
  EXPECT_EQ(ep2, nullptr);
  std::string msg = kvf_last_error();
  EXPECT_NE(msg.find(dir_), std::string::npos) << msg;
  EXPECT_NE(msg.find("pid " + std::to_string(getpid())), std::string::npos) << msg;

  // From another process too, and the first server's socket survives it.
  std::string dir = dir_;
  pid_t child = spawn([dir] {
    kvf_endpoint *e = nullptr;
    kvf_status st = kvf_endpoint_listen(dir.c_str(), 0, &e);
    return (int)st;
  });
  EXPECT_EQ(reap(child), (int)KVF_ERR_BUSY);
  kvf_conn cli, srv;
  ASSERT_EQ(kvf_endpoint_connect(dir_.c_str(), 0, &cli), KVF_SUCCESS) << kvf_last_error();
  ASSERT_EQ(kvf_endpoint_accept(ep, 2000, 0, &srv), KVF_SUCCESS) << kvf_last_error();
  kvf_conn_close(&cli);
  kvf_conn_close(&srv);

  // Once the first one stops, the directory can be served again.
  kvf_endpoint_close(ep);
  ASSERT_EQ(kvf_endpoint_listen(dir_.c_str(), 0, &ep2), KVF_SUCCESS) << kvf_last_error();
  kvf_endpoint_close(ep2);
}

TEST_F(Endpoint, AStaleSocketFromACrashedServerIsReplaced) {
  int ready[2];
  ASSERT_EQ(pipe2(ready, O_CLOEXEC), 0);
  std::string dir = dir_;
  pid_t child = spawn([&] {
    kvf_endpoint *e = nullptr;
    if (kvf_endpoint_listen(dir.c_str(), 0, &e) != KVF_SUCCESS) return 1;
    char c = 'r';
    if (write(ready[1], &c, 1) != 1) return 2;
    for (;;) pause();
  });
  close(ready[1]);
  char c = 0;
  ASSERT_EQ(read(ready[0], &c, 1), 1);
  close(ready[0]);
  kill(child, SIGKILL); // no cleanup: the socket file stays behind
  EXPECT_EQ(reap(child), 1000 + SIGKILL);

  struct stat sb;
  ASSERT_EQ(lstat(sock_path().c_str(), &sb), 0);
  EXPECT_TRUE(S_ISSOCK(sb.st_mode));
  kvf_conn cli;
  EXPECT_EQ(kvf_endpoint_connect(dir_.c_str(), 0, &cli), KVF_ERR_NOT_FOUND);
  EXPECT_NE(std::string(kvf_last_error()).find("nothing listens"), std::string::npos) << kvf_last_error();
  EXPECT_EQ(cli.fd, -1);

  kvf_endpoint *ep = nullptr;
  kvf_log_override(KVF_LOG_NONE, KVF_LOG_ALL); // the replacement warns; keep the test output clean
  kvf_status st = kvf_endpoint_listen(dir_.c_str(), 0, &ep);
  kvf_log_override(KVF_LOG_WARN, KVF_LOG_ALL);
  ASSERT_EQ(st, KVF_SUCCESS) << kvf_last_error();
  kvf_conn srv;
  ASSERT_EQ(kvf_endpoint_connect(dir_.c_str(), 0, &cli), KVF_SUCCESS) << kvf_last_error();
  ASSERT_EQ(kvf_endpoint_accept(ep, 2000, 0, &srv), KVF_SUCCESS) << kvf_last_error();
  kvf_conn_close(&cli);
  kvf_conn_close(&srv);
  kvf_endpoint_close(ep);
}

TEST_F(Endpoint, SomethingOtherThanASocketAtTheSocketPathIsLeftAlone) {
  ASSERT_EQ(mkdir(dir_.c_str(), 0700), 0);
  int fd = open(sock_path().c_str(), O_CREAT | O_WRONLY | O_CLOEXEC, 0600);
  ASSERT_GE(fd, 0);
  close(fd);
  kvf_endpoint *ep = nullptr;
  EXPECT_EQ(kvf_endpoint_listen(dir_.c_str(), 0, &ep), KVF_ERR_PERMISSION);
  EXPECT_NE(std::string(kvf_last_error()).find("not a socket"), std::string::npos) << kvf_last_error();
  struct stat sb;
  ASSERT_EQ(lstat(sock_path().c_str(), &sb), 0);
  EXPECT_TRUE(S_ISREG(sb.st_mode));
}

TEST_F(Endpoint, ConnectSaysClearlyWhenNoServerRuns) {
  kvf_conn cli;
  EXPECT_EQ(kvf_endpoint_connect(dir_.c_str(), 0, &cli), KVF_ERR_NOT_FOUND);
  std::string msg = kvf_last_error();
  EXPECT_NE(msg.find("no kvferryd serves " + dir_), std::string::npos) << msg;
  EXPECT_NE(msg.find("directory does not exist"), std::string::npos) << msg;
  ASSERT_EQ(mkdir(dir_.c_str(), 0700), 0);
  EXPECT_EQ(kvf_endpoint_connect(dir_.c_str(), 0, &cli), KVF_ERR_NOT_FOUND);
  EXPECT_NE(std::string(kvf_last_error()).find(sock_path() + " does not exist"), std::string::npos)
      << kvf_last_error();
  EXPECT_EQ(cli.fd, -1);
}

// ---- frames ---------------------------------------------------------------------

TEST_F(Endpoint, FrameWithDescriptorsRoundTripsBetweenTwoProcesses) {
  kvf_endpoint *ep = nullptr;
  ASSERT_EQ(kvf_endpoint_listen(dir_.c_str(), 0, &ep), KVF_SUCCESS) << kvf_last_error();
  const size_t json_len = 1u << 20; // larger than the socket buffer: partial writes and reads
  std::string dir = dir_;
  pid_t child = spawn([&]() -> int {
    // The child leaves its copies of the listening socket and lock alone
    // (closing the endpoint would remove the parent's socket); _exit drops them.
    kvf_conn c;
    if (kvf_endpoint_connect(dir.c_str(), 0, &c)) return 10;
    int mem = make_memfd("from-child");
    int p[2];
    if (mem < 0 || pipe2(p, O_CLOEXEC)) return 11;
    std::string json(json_len, 'g');
    kvf_proto_msg m;
    memset(&m, 0, sizeof m);
    m.type = KVF_PROTO_REGISTER;
    m.request_id = 7;
    m.u.reg.device = -1;
    m.u.reg.shard_count = 1;
    m.u.reg.num_fds = 2;
    m.u.reg.geometry_json = &json[0];
    m.u.reg.geometry_json_len = (uint32_t)json_len;
    kvf_proto_region region;
    memset(&region, 0, sizeof region);
    region.instance_id = region.allocation_id = region.generation = 1;
    region.size = region.length = 10;
    region.provider = 1;
    m.u.reg.regions = &region;
    m.u.reg.num_regions = 1;
    int out[2] = {mem, p[1]};
    if (kvf_conn_send(&c, &m, out, 2, 10000)) return 12;
    close(mem);
    close(p[1]);
    kvf_proto_msg r;
    memset(&r, 0, sizeof r);
    std::vector<int> got;
    if (read_msg(&c, 10000, &r, &got)) return 13;
    if (r.type != KVF_PROTO_REGISTER_REPLY || r.request_id != 7 || r.u.register_reply.registration_id != 99) return 14;
    if (got.size() != 1 || read_fd_text(got[0]) != "from-server" || !cloexec(got[0])) return 15;
    char x = 0;
    if (read(p[0], &x, 1) != 1 || x != 'x') return 16; // the parent wrote into the pipe end we passed
    close(got[0]);
    close(p[0]);
    kvf_conn_close(&c);
    return 0;
  });
  ASSERT_GT(child, 0);

  kvf_conn srv;
  ASSERT_EQ(kvf_endpoint_accept(ep, 10000, 0, &srv), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(srv.peer.pid, child);
  EXPECT_EQ(srv.peer.uid, geteuid());
  kvf_proto_msg m;
  memset(&m, 0, sizeof m);
  std::vector<int> got;
  ASSERT_EQ(read_msg(&srv, 10000, &m, &got), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(m.type, KVF_PROTO_REGISTER);
  EXPECT_EQ(m.request_id, 7u);
  EXPECT_EQ(m.u.reg.geometry_json_len, json_len);
  EXPECT_EQ(m.u.reg.num_fds, 2u);
  kvf_proto_msg_clear(&m);
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(read_fd_text(got[0]), "from-child");
  EXPECT_TRUE(cloexec(got[0]));
  EXPECT_TRUE(cloexec(got[1]));
  EXPECT_EQ(write(got[1], "x", 1), 1);
  for (int fd : got) close(fd);

  int mem = make_memfd("from-server");
  ASSERT_GE(mem, 0);
  kvf_proto_msg r;
  memset(&r, 0, sizeof r);
  r.type = KVF_PROTO_REGISTER_REPLY;
  r.request_id = 7;
  r.u.register_reply.registration_id = 99;
  EXPECT_EQ(kvf_conn_send(&srv, &r, &mem, 1, 10000), KVF_SUCCESS) << kvf_last_error();
  close(mem); // the descriptors stay the caller's
  EXPECT_EQ(reap(child), 0);
  kvf_conn_close(&srv);
  kvf_endpoint_close(ep);
}

TEST_F(Endpoint, APartialFrameWaitsForTheRestAcrossCalls) {
  int sv[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  kvf_conn c;
  kvf_conn_init(&c, sv[0], 0);
  std::vector<uint8_t> f = heartbeat_frame(5);
  ASSERT_EQ(write(sv[1], f.data(), 10), 10);
  kvf_proto_header h;
  uint8_t *payload = nullptr;
  uint32_t n = 0;
  EXPECT_EQ(kvf_conn_read_frame(&c, 0, &h, &payload, nullptr, 0, &n), KVF_ERR_TIMEOUT);
  int64_t t0 = mono_ms();
  EXPECT_EQ(kvf_conn_read_frame(&c, 50, &h, &payload, nullptr, 0, &n), KVF_ERR_TIMEOUT);
  EXPECT_GE(mono_ms() - t0, 45);
  ASSERT_EQ(write(sv[1], f.data() + 10, f.size() - 10), (ssize_t)(f.size() - 10));
  ASSERT_EQ(kvf_conn_read_frame(&c, 1000, &h, &payload, nullptr, 0, &n), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(h.type, KVF_PROTO_HEARTBEAT);
  EXPECT_EQ(h.request_id, 5u);
  EXPECT_EQ(h.payload_len, 8u);
  free(payload);
  // The peer closing between frames is a clean disconnect.
  close(sv[1]);
  EXPECT_EQ(kvf_conn_read_frame(&c, 1000, &h, &payload, nullptr, 0, &n), KVF_ERR_DISCONNECTED);
  kvf_conn_close(&c);
}

// The event loop's read: at most max_bytes per call, saying whether the
// socket ran dry; a held header reads nothing more until granted.
TEST_F(Endpoint, ReadSomeKeepsToItsBudgetAndSaysWhenTheSocketIsDry) {
  int sv[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  kvf_conn c;
  kvf_conn_init(&c, sv[0], 0);
  std::vector<uint8_t> f = heartbeat_frame(5);  // 24 + 8 bytes
  std::vector<uint8_t> two = f;
  two.insert(two.end(), f.begin(), f.end());
  ASSERT_EQ(write(sv[1], two.data(), two.size()), (ssize_t)two.size());
  kvf_proto_header h;
  uint8_t *payload = nullptr;
  uint32_t n = 0;
  size_t got = 0;
  int dry = -1;
  EXPECT_EQ(kvf_conn_read_some(&c, 10, &got, &dry, &h, &payload, nullptr, 0, &n), KVF_ERR_TIMEOUT);
  EXPECT_EQ(got, 10u);
  EXPECT_EQ(dry, 0);  // stopped on the budget: more is waiting
  ASSERT_EQ(kvf_conn_read_some(&c, 1 << 20, &got, &dry, &h, &payload, nullptr, 0, &n), KVF_SUCCESS)
      << kvf_last_error();
  EXPECT_EQ(got, f.size() - 10);  // never past the frame
  EXPECT_EQ(dry, 0);
  EXPECT_EQ(h.request_id, 5u);
  free(payload);
  ASSERT_EQ(kvf_conn_read_some(&c, 1 << 20, &got, &dry, &h, &payload, nullptr, 0, &n), KVF_SUCCESS);
  free(payload);
  EXPECT_EQ(kvf_conn_read_some(&c, 1 << 20, &got, &dry, &h, &payload, nullptr, 0, &n), KVF_ERR_TIMEOUT);
  EXPECT_EQ(got, 0u);
  EXPECT_EQ(dry, 1);
  // Held: a payload over the hold limit waits, the socket untouched.
  kvf_proto_reader_limit(&c.reader, 0, 4);
  ASSERT_EQ(write(sv[1], f.data(), f.size()), (ssize_t)f.size());
  EXPECT_EQ(kvf_conn_read_some(&c, 1 << 20, &got, &dry, &h, &payload, nullptr, 0, &n), KVF_ERR_TIMEOUT);
  EXPECT_EQ(got, (size_t)KVF_PROTO_HEADER_SIZE);
  EXPECT_EQ(kvf_proto_reader_held(&c.reader), 8u);
  EXPECT_EQ(kvf_conn_read_some(&c, 1 << 20, &got, &dry, &h, &payload, nullptr, 0, &n), KVF_ERR_TIMEOUT);
  EXPECT_EQ(got, 0u);
  EXPECT_EQ(dry, 0);
  ASSERT_EQ(kvf_conn_grant(&c), KVF_SUCCESS);
  ASSERT_EQ(kvf_conn_read_some(&c, 1 << 20, &got, &dry, &h, &payload, nullptr, 0, &n), KVF_SUCCESS);
  EXPECT_EQ(got, 8u);
  EXPECT_EQ(h.payload_len, 8u);
  free(payload);
  close(sv[1]);
  EXPECT_EQ(kvf_conn_read_some(&c, 1 << 20, &got, &dry, &h, &payload, nullptr, 0, &n), KVF_ERR_DISCONNECTED);
  kvf_conn_close(&c);
}

TEST_F(Endpoint, AWriteThePeerDoesNotDrainTimesOutAndFailsTheConnection) {
  int sv[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  kvf_conn c;
  kvf_conn_init(&c, sv[0], 0);
  std::string json(4u << 20, 'j');
  kvf_proto_msg m;
  memset(&m, 0, sizeof m);
  m.type = KVF_PROTO_REGISTER;
  m.u.reg.shard_count = 1;
  m.u.reg.geometry_json = &json[0];
  m.u.reg.geometry_json_len = (uint32_t)json.size();
  int64_t t0 = mono_ms();
  EXPECT_EQ(kvf_conn_send(&c, &m, nullptr, 0, 50), KVF_ERR_TIMEOUT);
  EXPECT_GE(mono_ms() - t0, 45);
  EXPECT_EQ(c.write_failed, KVF_ERR_TIMEOUT) << "part of the frame went out: out of step";
  std::vector<uint8_t> f = heartbeat_frame(1);
  EXPECT_EQ(kvf_conn_write_frame(&c, f.data(), f.size(), nullptr, 0, 1000), KVF_ERR_TIMEOUT);
  // A peer that is gone is DISCONNECTED, and never raises SIGPIPE.
  kvf_conn c2;
  int sv2[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv2), 0);
  kvf_conn_init(&c2, sv2[0], 0);
  close(sv2[1]);
  EXPECT_EQ(kvf_conn_write_frame(&c2, f.data(), f.size(), nullptr, 0, 1000), KVF_ERR_DISCONNECTED);
  int bad = -1;
  EXPECT_EQ(kvf_conn_write_frame(&c2, f.data(), f.size(), &bad, 1, 1000), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(kvf_conn_write_frame(&c2, f.data(), 10, nullptr, 0, 1000), KVF_ERR_INVALID_ARGUMENT);
  kvf_conn_close(&c2);
  kvf_conn_close(&c);
  close(sv[1]);
}

TEST_F(Endpoint, TooManyDescriptorsAreAProtocolErrorAndAllAreClosed) {
  int sv[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  kvf_conn tx, rx;
  kvf_conn_init(&tx, sv[1], 0);
  kvf_conn_init(&rx, sv[0], 0);
  int base = fd_count();
  int three[3] = {make_memfd("a"), make_memfd("b"), make_memfd("c")};
  std::vector<uint8_t> f = heartbeat_frame(3);
  ASSERT_EQ(kvf_conn_write_frame(&tx, f.data(), f.size(), three, 3, 1000), KVF_SUCCESS) << kvf_last_error();
  for (int fd : three) close(fd);
  kvf_proto_header h;
  uint8_t *payload = nullptr;
  int fds[1];
  uint32_t n = 7;
  EXPECT_EQ(kvf_conn_read_frame(&rx, 1000, &h, &payload, fds, 1, &n), KVF_ERR_PROTOCOL);
  EXPECT_NE(std::string(kvf_last_error()).find("frame.fds"), std::string::npos) << kvf_last_error();
  EXPECT_EQ(n, 0u);
  EXPECT_EQ(payload, nullptr);
  EXPECT_EQ(fd_count(), base) << "every descriptor that arrived was closed";
  // Sticky: the connection is out of step.
  EXPECT_EQ(kvf_conn_read_frame(&rx, 1000, &h, &payload, fds, 1, &n), KVF_ERR_PROTOCOL);
  kvf_conn_close(&tx);
  kvf_conn_close(&rx);
}

TEST_F(Endpoint, BackToBackFramesKeepTheirOwnDescriptors) {
  int sv[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  kvf_conn tx, rx;
  kvf_conn_init(&tx, sv[1], 0);
  kvf_conn_init(&rx, sv[0], 0);
  // Frames with 0, 1, 2, 0 descriptors, all written before any is read.
  std::vector<std::vector<int>> sent = {{}, {make_memfd("b0")}, {make_memfd("c0"), make_memfd("c1")}, {}};
  for (size_t i = 0; i < sent.size(); i++) {
    std::vector<uint8_t> f = heartbeat_frame(i);
    ASSERT_EQ(kvf_conn_write_frame(&tx, f.data(), f.size(), sent[i].data(), (uint32_t)sent[i].size(), 1000),
              KVF_SUCCESS)
        << kvf_last_error();
    for (int fd : sent[i]) close(fd);
  }
  const char *texts[4][2] = {{}, {"b0"}, {"c0", "c1"}, {}};
  for (size_t i = 0; i < sent.size(); i++) {
    kvf_proto_header h;
    uint8_t *payload = nullptr;
    int fds[8];
    uint32_t n = 0;
    ASSERT_EQ(kvf_conn_read_frame(&rx, 1000, &h, &payload, fds, 8, &n), KVF_SUCCESS) << kvf_last_error();
    free(payload);
    EXPECT_EQ(h.request_id, i);
    ASSERT_EQ(n, sent[i].size()) << "frame " << i;
    for (uint32_t k = 0; k < n; k++) {
      EXPECT_EQ(read_fd_text(fds[k]), texts[i][k]);
      close(fds[k]);
    }
  }
  kvf_conn_close(&tx);
  kvf_conn_close(&rx);
}

// recvmsg that reports MSG_CTRUNC whenever descriptors arrive.
ssize_t ctrunc_recvmsg(int fd, struct msghdr *msg, int flags) {
  ssize_t r = kvf_sys_table_default()->recvmsg(fd, msg, flags);
  if (r >= 0 && msg->msg_controllen > 0) msg->msg_flags |= MSG_CTRUNC;
  return r;
}

TEST_F(Endpoint, TruncatedDescriptorsMsgCtruncAreAProtocolErrorAndClosed) {
  int sv[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  kvf_conn tx, rx;
  kvf_conn_init(&tx, sv[1], 0);
  kvf_conn_init(&rx, sv[0], 0);
  int base = fd_count();
  int two[2] = {make_memfd("a"), make_memfd("b")};
  std::vector<uint8_t> f = heartbeat_frame(4);
  ASSERT_EQ(kvf_conn_write_frame(&tx, f.data(), f.size(), two, 2, 1000), KVF_SUCCESS) << kvf_last_error();
  close(two[0]);
  close(two[1]);
  kvf_sys_table table = *kvf_sys_table_default();
  table.recvmsg = ctrunc_recvmsg;
  kvf_sys_table_install(&table);
  kvf_proto_header h;
  uint8_t *payload = nullptr;
  int fds[8];
  uint32_t n = 0;
  kvf_status st = kvf_conn_read_frame(&rx, 1000, &h, &payload, fds, 8, &n);
  kvf_sys_table_install(nullptr);
  EXPECT_EQ(st, KVF_ERR_PROTOCOL);
  EXPECT_NE(std::string(kvf_last_error()).find("MSG_CTRUNC"), std::string::npos) << kvf_last_error();
  EXPECT_EQ(n, 0u);
  EXPECT_EQ(fd_count(), base);
  kvf_conn_close(&tx);
  kvf_conn_close(&rx);
}

TEST_F(Endpoint, ErrorReplyNamesTheField) {
  int sv[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  kvf_conn tx, rx;
  kvf_conn_init(&tx, sv[1], 0);
  kvf_conn_init(&rx, sv[0], 0);
  struct Case {
    kvf_status status;
    std::string detail, field, message;
    kvf_status want_status;
  };
  std::string longtext(2000, 'm');
  std::vector<Case> cases = {
      {KVF_ERR_PROTOCOL, "header.version: peer speaks protocol version 2, this side speaks 1", "header.version",
       "peer speaks protocol version 2, this side speaks 1", KVF_ERR_PROTOCOL},
      {KVF_ERR_BUSY, "no field in this one: really", "", "no field in this one: really", KVF_ERR_BUSY},
      {KVF_SUCCESS, "x: y", "x", "y", KVF_ERR_INTERNAL},
      {KVF_ERR_PROTOCOL, "f: " + longtext, "f", longtext.substr(0, KVF_PROTO_MESSAGE_MAX - 1), KVF_ERR_PROTOCOL},
  };
  uint64_t id = 100;
  for (const Case &k : cases) {
    ASSERT_EQ(kvf_conn_send_error(&tx, id, k.status, k.detail.c_str(), 1000), KVF_SUCCESS) << kvf_last_error();
    kvf_proto_msg m;
    memset(&m, 0, sizeof m);
    ASSERT_EQ(read_msg(&rx, 1000, &m), KVF_SUCCESS) << kvf_last_error();
    EXPECT_EQ(m.type, KVF_PROTO_ERROR);
    EXPECT_EQ(m.request_id, id);
    EXPECT_EQ(m.u.error.status, (uint32_t)k.want_status);
    EXPECT_EQ(m.u.error.version, KVF_PROTO_VERSION);
    EXPECT_EQ(std::string(m.u.error.field), k.field);
    EXPECT_EQ(std::string(m.u.error.message), k.message);
    id++;
  }
  // NULL detail: the calling thread's last error.
  kvf_fail(KVF_ERR_PROTOCOL, "payload.pid: must not be 0");
  ASSERT_EQ(kvf_conn_send_error(&tx, 1, KVF_ERR_PROTOCOL, nullptr, 1000), KVF_SUCCESS);
  kvf_proto_msg m;
  memset(&m, 0, sizeof m);
  ASSERT_EQ(read_msg(&rx, 1000, &m), KVF_SUCCESS) << kvf_last_error();
  EXPECT_STREQ(m.u.error.field, "payload.pid");
  EXPECT_STREQ(m.u.error.message, "must not be 0");
  kvf_conn_close(&tx);
  kvf_conn_close(&rx);
}

// ---- a small server: bad clients are answered and dropped, others served ---------

// Serves HEARTBEAT on a poll loop in a thread. A frame that fails to read or
// decode gets an ERROR reply, then the connection is closed.
class TestServer {
 public:
  explicit TestServer(kvf_endpoint *ep) : ep_(ep) {
    EXPECT_EQ(pipe2(stop_, O_CLOEXEC), 0);
    thread_ = std::thread([this] { run(); });
  }
  ~TestServer() {
    if (write(stop_[1], "q", 1) != 1) abort();
    thread_.join();
    close(stop_[0]);
    close(stop_[1]);
  }
  std::atomic<int> errors_sent{0}, refused{0};

 private:
  void serve(kvf_conn *c) {
    for (;;) {
      kvf_proto_header h;
      uint8_t *payload = nullptr;
      int fds[KVF_PROTO_MAX_FDS];
      uint32_t n = 0;
      kvf_status st = kvf_conn_read_frame(c, 0, &h, &payload, fds, KVF_PROTO_MAX_FDS, &n);
      if (st == KVF_ERR_TIMEOUT) return;
      if (st == KVF_ERR_DISCONNECTED) {
        kvf_conn_close(c);
        return;
      }
      kvf_proto_msg m;
      memset(&m, 0, sizeof m);
      if (st == KVF_SUCCESS) {
        for (uint32_t i = 0; i < n; i++) close(fds[i]);
        st = kvf_proto_decode(&h, payload, &m);
        free(payload);
      }
      if (st == KVF_SUCCESS && m.type != KVF_PROTO_HEARTBEAT)
        st = kvf_fail(KVF_ERR_PROTOCOL, "header.type: %s is not served here", kvf_proto_type_name(m.type));
      if (st != KVF_SUCCESS) {
        kvf_conn_send_error(c, h.request_id, st, nullptr, 1000);
        errors_sent++;
        kvf_proto_msg_clear(&m);
        kvf_conn_close(c);
        return;
      }
      kvf_proto_msg r;
      memset(&r, 0, sizeof r);
      r.type = KVF_PROTO_HEARTBEAT_REPLY;
      r.request_id = m.request_id;
      r.u.heartbeat_reply.sequence = m.u.heartbeat.sequence;
      r.u.heartbeat_reply.boot_token = 42;
      kvf_proto_msg_clear(&m);
      if (kvf_conn_send(c, &r, nullptr, 0, 1000) != KVF_SUCCESS) {
        kvf_conn_close(c);
        return;
      }
    }
  }
  void run() {
    std::vector<kvf_conn *> conns;
    for (;;) {
      std::vector<pollfd> p = {{stop_[0], POLLIN, 0}, {kvf_endpoint_fd(ep_), POLLIN, 0}};
      for (kvf_conn *c : conns) p.push_back({c->fd, POLLIN, 0});
      if (poll(p.data(), p.size(), 1000) < 0) continue;
      if (p[0].revents) break;
      if (p[1].revents & POLLIN) {
        kvf_conn *c = new kvf_conn;
        kvf_status st = kvf_endpoint_accept(ep_, 0, 0, c);
        if (st == KVF_SUCCESS)
          conns.push_back(c);
        else {
          if (st == KVF_ERR_PERMISSION) refused++;
          delete c;
        }
      }
      for (size_t i = 0; i + 2 < p.size(); i++) // a connection accepted just now was not polled
        if (p[i + 2].revents) serve(conns[i]);
      for (size_t i = 0; i < conns.size();) {
        if (conns[i]->fd < 0) {
          delete conns[i];
          conns.erase(conns.begin() + (long)i);
        } else {
          i++;
        }
      }
    }
    for (kvf_conn *c : conns) {
      kvf_conn_close(c);
      delete c;
    }
  }
  kvf_endpoint *ep_;
  int stop_[2] = {-1, -1};
  std::thread thread_;
};

// Expect an ERROR reply naming `field` (a prefix is enough) for request `id`,
// then the server hanging up.
void expect_error_then_hangup(kvf_conn *c, const std::string &field, uint64_t id, const std::string &in_message) {
  kvf_proto_msg m;
  memset(&m, 0, sizeof m);
  ASSERT_EQ(read_msg(c, 5000, &m), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(m.type, KVF_PROTO_ERROR);
  EXPECT_EQ(m.u.error.status, (uint32_t)KVF_ERR_PROTOCOL);
  EXPECT_EQ(std::string(m.u.error.field).rfind(field, 0), 0u) << m.u.error.field << ": " << m.u.error.message;
  EXPECT_EQ(m.request_id, id);
  EXPECT_NE(std::string(m.u.error.message).find(in_message), std::string::npos) << m.u.error.message;
  kvf_proto_msg_clear(&m);
  EXPECT_EQ(read_msg(c, 5000, &m), KVF_ERR_DISCONNECTED) << kvf_last_error();
}

TEST_F(Endpoint, BadClientsGetAnErrorAndAreDroppedWhileAnotherKeepsWorking) {
  kvf_endpoint *ep = nullptr;
  ASSERT_EQ(kvf_endpoint_listen(dir_.c_str(), 0, &ep), KVF_SUCCESS) << kvf_last_error();
  {
    TestServer server(ep);
    kvf_conn good;
    ASSERT_EQ(kvf_endpoint_connect(dir_.c_str(), 0, &good), KVF_SUCCESS) << kvf_last_error();
    uint64_t seq = 1;
    ASSERT_EQ(heartbeat(&good, seq++), KVF_SUCCESS) << kvf_last_error();

    struct Bad {
      const char *what;
      std::function<void(int fd)> send;
      std::string field;
      uint64_t id;
      std::string in_message;
    };
    std::vector<uint8_t> hb = heartbeat_frame(77);
    std::vector<Bad> bad = {
        {"garbage", [](int fd) {
           const char g[] = "GET / HTTP/1.1\r\nHost: kvferry\r\n\r\n";
           ASSERT_EQ(write(fd, g, sizeof g - 1), (ssize_t)(sizeof g - 1));
         }, "header.magic", 0, "not a kvferry frame"},
        {"wrong version", [&](int fd) {
           std::vector<uint8_t> f = hb;
           f[4] = 1; // version 1 (8-byte keys), little-endian
           ASSERT_EQ(write(fd, f.data(), f.size()), (ssize_t)f.size());
         }, "header.version", 77, "peer speaks protocol version 1, this side speaks 2"},
        {"truncated payload", [&](int fd) {
           ASSERT_EQ(write(fd, hb.data(), hb.size() - 3), (ssize_t)(hb.size() - 3));
           shutdown(fd, SHUT_WR);
         }, "frame", 77, "5 of the payload's 8 bytes"},
        {"truncated header", [&](int fd) {
           ASSERT_EQ(write(fd, hb.data(), 11), 11);
           shutdown(fd, SHUT_WR);
         }, "frame", 0, "11 of the header's 24 bytes"},
        {"short payload", [&](int fd) {
           std::vector<uint8_t> f(hb.begin(), hb.end() - 4);
           f[16] = 4; // payload_len 4: too short for HEARTBEAT's u64
           ASSERT_EQ(write(fd, f.data(), f.size()), (ssize_t)f.size());
         }, "payload", 77, ""},
        {"oversize payload", [&](int fd) {
           std::vector<uint8_t> f = hb;
           f[19] = 0x7f; // payload_len far over the limit
           ASSERT_EQ(write(fd, f.data(), f.size()), (ssize_t)f.size());
         }, "header.payload_len", 77, ""},
    };
    for (const Bad &b : bad) {
      SCOPED_TRACE(b.what);
      kvf_conn c;
      ASSERT_EQ(kvf_endpoint_connect(dir_.c_str(), 0, &c), KVF_SUCCESS) << kvf_last_error();
      ASSERT_EQ(heartbeat(&c, 1000), KVF_SUCCESS) << "a fresh client is served";
      b.send(c.fd);
      expect_error_then_hangup(&c, b.field, b.id, b.in_message);
      kvf_conn_close(&c);
      EXPECT_EQ(heartbeat(&good, seq++), KVF_SUCCESS) << "the other client keeps working: " << kvf_last_error();
    }
    EXPECT_EQ(server.errors_sent.load(), (int)bad.size());
    kvf_conn_close(&good);
  }
  kvf_endpoint_close(ep);
}

// ---- a peer with another uid -----------------------------------------------------

TEST_F(Endpoint, APeerWithAnotherUidIsRefusedAndLogged) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to run a client as another uid (nobody, 65534)";
  kvf_endpoint *ep = nullptr;
  ASSERT_EQ(kvf_endpoint_listen(dir_.c_str(), 0, &ep), KVF_SUCCESS) << kvf_last_error();
  std::string dir = dir_;
  auto as_nobody = [&](const std::function<int()> &fn) {
    return spawn([&]() -> int {
      if (setgroups(0, nullptr) != 0 || setgid(65534) != 0 || setuid(65534) != 0) return 20;
      return fn();
    });
  };
  // With the directory as the server made it, another user cannot even reach the socket.
  pid_t child = as_nobody([&] {
    kvf_conn c;
    return kvf_endpoint_connect(dir.c_str(), 0, &c) == KVF_ERR_PERMISSION ? 0 : 21;
  });
  EXPECT_EQ(reap(child), 0);

  // Opened up on purpose, the SO_PEERCRED check still refuses it.
  ASSERT_EQ(chmod(base_.c_str(), 0711), 0);
  ASSERT_EQ(chmod(dir_.c_str(), 0711), 0);
  ASSERT_EQ(chmod(sock_path().c_str(), 0666), 0);
  char *logbuf = nullptr;
  size_t loglen = 0;
  FILE *sink = open_memstream(&logbuf, &loglen);
  ASSERT_NE(sink, nullptr);
  kvf_log_override(KVF_LOG_WARN, KVF_LOG_ALL);
  kvf_log_set_sink(sink);
  child = as_nobody([&] {
    kvf_conn c;
    if (kvf_endpoint_connect(dir.c_str(), 0, &c) != KVF_SUCCESS) return 22;
    kvf_proto_msg m;
    memset(&m, 0, sizeof m);
    kvf_status st = read_msg(&c, 5000, &m); // the server hangs up without a word
    kvf_conn_close(&c);
    return st == KVF_ERR_DISCONNECTED ? 0 : 23;
  });
  kvf_conn srv;
  EXPECT_EQ(kvf_endpoint_accept(ep, 5000, 0, &srv), KVF_ERR_PERMISSION);
  std::string msg = kvf_last_error();
  EXPECT_EQ(srv.fd, -1);
  EXPECT_EQ(reap(child), 0);
  kvf_log_set_sink(nullptr);
  fclose(sink);
  std::string log(logbuf, loglen);
  free(logbuf);
  EXPECT_NE(msg.find("uid 65534"), std::string::npos) << msg;
  EXPECT_NE(log.find("uid 65534 pid " + std::to_string(child)), std::string::npos) << log;
  kvf_endpoint_close(ep);
}

} // namespace
