/* kvferryd's socket endpoint: the socket directory, the server lock, peer
 * checks, and frame I/O with descriptors (host/endpoint.h). */
#define _GNU_SOURCE
#include "host/ipc/endpoint.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/error.h"
#include "host/core/log.h"
#include "host/core/syscalls.h"
#include "host/ipc/fdpass.h"

#define KVF_SUN_PATH_MAX sizeof(((struct sockaddr_un *)0)->sun_path)

struct kvf_endpoint {
  int listen_fd;
  int lock_fd;  /* holds the flock for as long as the endpoint lives */
  dev_t sock_dev; /* what was bound, so close removes only our own socket */
  ino_t sock_ino;
  char dir[KVF_SUN_PATH_MAX];
  char path[KVF_SUN_PATH_MAX];
};

/* ---- time ------------------------------------------------------------------ */

/* Milliseconds left before the deadline, for poll(): -1 (no limit) when
 * timeout_ms is negative, 0 once it has passed. */
static int time_left(int timeout_ms, int64_t deadline) {
  if (timeout_ms < 0) return -1;
  int64_t left = deadline - kvf_now_ms();
  if (left <= 0) return 0;
  return left > INT_MAX ? INT_MAX : (int)left;
}

/* Wait for `events` on fd until the deadline. 1: ready (or an error the
 * next call will report), 0: the time is up, -1: poll failed (errno). */
static int wait_fd(int fd, short events, int timeout_ms, int64_t deadline) {
  for (;;) {
    int left = time_left(timeout_ms, deadline);
    if (left == 0) return 0;
    struct pollfd p = {fd, events, 0};
    int r = poll(&p, 1, left);
    if (r > 0) return 1;
    if (r == 0) return 0;
    if (errno != EINTR) return -1;
  }
}

/* ---- the socket directory -------------------------------------------------- */

/* dir + "/" + name into out (cap bytes), checked against a socket address. */
static kvf_status join_path(const char *dir, const char *name, char *out, size_t cap) {
  int n = snprintf(out, cap, "%s/%s", dir, name);
  if (n < 0 || (size_t)n >= cap)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT,
                    "socket_dir: '%s' is too long: %s/%s needs %d bytes, a Unix socket address holds %zu", dir, dir,
                    name, n + 1, cap);
  return KVF_SUCCESS;
}

kvf_status kvf_endpoint_check_dir(const char *dir) {
  char sock[KVF_SUN_PATH_MAX];
  struct stat st;
  kvf_status rc;
  if (dir == NULL || dir[0] == '\0') return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "socket_dir: NULL or empty");
  if ((rc = join_path(dir, KVF_ENDPOINT_SOCKET_NAME, sock, sizeof sock))) return rc;
  if (lstat(dir, &st) != 0) {
    int e = errno;
    if (e != ENOENT) return KVF_SYS_FAIL(KVF_ERR_SYSTEM, e, "lstat(socket directory)");
    if (mkdir(dir, 0700) != 0 && errno != EEXIST) {
      e = errno;
      kvf_status s = KVF_SYS_FAIL(e == EACCES ? KVF_ERR_PERMISSION : KVF_ERR_SYSTEM, e, "mkdir(socket directory)");
      kvf_error_prefix("socket directory %s: ", dir);
      return s;
    }
    /* The umask may have taken bits away; the owner needs all three. */
    if (chmod(dir, 0700) != 0) return KVF_SYS_FAIL(KVF_ERR_SYSTEM, errno, "chmod(socket directory, 0700)");
    KVF_INFO(SERVER, "created socket directory %s (mode 0700)", dir);
    if (lstat(dir, &st) != 0) return KVF_SYS_FAIL(KVF_ERR_SYSTEM, errno, "lstat(socket directory)");
  }
  if (S_ISLNK(st.st_mode))
    return kvf_fail(KVF_ERR_PERMISSION, "socket directory %s: is a symbolic link; give the real directory", dir);
  if (!S_ISDIR(st.st_mode)) return kvf_fail(KVF_ERR_PERMISSION, "socket directory %s: is not a directory", dir);
  if (st.st_uid != geteuid())
    return kvf_fail(KVF_ERR_PERMISSION,
                    "socket directory %s: owned by uid %u, but this process runs as uid %u; it must be owned by the "
                    "server's user",
                    dir, (unsigned)st.st_uid, (unsigned)geteuid());
  if ((st.st_mode & 077) != 0 || (st.st_mode & 0700) != 0700)
    return kvf_fail(KVF_ERR_PERMISSION, "socket directory %s: mode %04o, it must be 0700 (chmod 700 %s)", dir,
                    (unsigned)(st.st_mode & 07777), dir);
  return KVF_SUCCESS;
}

/* The pid a running server wrote into its lock file; 0 when unknown. */
static long lock_holder_pid(int lock_fd) {
  char buf[32];
  ssize_t n = pread(lock_fd, buf, sizeof buf - 1, 0);
  if (n <= 0) return 0;
  buf[n] = '\0';
  char *end = NULL;
  long pid = strtol(buf, &end, 10);
  return (end != buf && pid > 0) ? pid : 0;
}

kvf_status kvf_endpoint_listen(const char *dir, int backlog, kvf_endpoint **out) {
  kvf_status rc = KVF_SUCCESS;
  kvf_endpoint *ep = NULL;
  char lock_path[KVF_SUN_PATH_MAX];
  struct sockaddr_un addr;
  struct stat st;
  int bound = 0;

  if (out == NULL) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_endpoint_listen: out is NULL");
  *out = NULL;
  if ((rc = kvf_endpoint_check_dir(dir))) return rc;
  ep = calloc(1, sizeof *ep);
  if (ep == NULL) return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "kvf_endpoint_listen: out of memory");
  ep->listen_fd = -1;
  ep->lock_fd = -1;
  snprintf(ep->dir, sizeof ep->dir, "%s", dir);
  if ((rc = join_path(dir, KVF_ENDPOINT_SOCKET_NAME, ep->path, sizeof ep->path))) goto out;
  if ((rc = join_path(dir, KVF_ENDPOINT_LOCK_NAME, lock_path, sizeof lock_path))) goto out;

  /* The lock decides who serves the directory: the kernel drops it when its
   * holder dies, so a crashed server never blocks the next one. */
  ep->lock_fd = open(lock_path, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (ep->lock_fd < 0) {
    rc = KVF_SYS_FAIL(KVF_ERR_SYSTEM, errno, "open(lock file)");
    kvf_error_prefix("socket directory %s: ", dir);
    goto out;
  }
  if (flock(ep->lock_fd, LOCK_EX | LOCK_NB) != 0) {
    int e = errno;
    if (e == EWOULDBLOCK) {
      long pid = lock_holder_pid(ep->lock_fd);
      char who[48] = "another kvferryd";
      if (pid > 0) snprintf(who, sizeof who, "another kvferryd (pid %ld)", pid);
      rc = kvf_fail(KVF_ERR_BUSY,
                    "socket directory %s: %s is already serving it; stop it first or give this one another "
                    "socket directory",
                    dir, who);
    } else {
      rc = KVF_SYS_FAIL(KVF_ERR_SYSTEM, e, "flock(lock file)");
    }
    goto out;
  }
  {
    char pid[32];
    int n = snprintf(pid, sizeof pid, "%ld\n", (long)getpid());
    if (ftruncate(ep->lock_fd, 0) != 0 || pwrite(ep->lock_fd, pid, (size_t)n, 0) != n)
      KVF_INFO(SERVER, "%s: could not record this server's pid: %s", lock_path, strerror(errno));
  }

  /* Holding the lock, anything at the socket path is a leftover of a server
   * that died without cleaning up. Replace a socket, but never remove
   * something that is not one. */
  if (lstat(ep->path, &st) == 0) {
    if (!S_ISSOCK(st.st_mode)) {
      rc = kvf_fail(KVF_ERR_PERMISSION, "socket directory %s: %s exists and is not a socket; refusing to remove it",
                    dir, ep->path);
      goto out;
    }
    if (unlink(ep->path) != 0 && errno != ENOENT) {
      rc = KVF_SYS_FAIL(KVF_ERR_SYSTEM, errno, "unlink(stale socket)");
      goto out;
    }
    KVF_WARN(SERVER, "replaced the stale socket %s left by a server that exited without cleaning up", ep->path);
  } else if (errno != ENOENT) {
    rc = KVF_SYS_FAIL(KVF_ERR_SYSTEM, errno, "lstat(socket)");
    goto out;
  }

  ep->listen_fd = KVF_SYS(socket)(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (ep->listen_fd < 0) {
    rc = KVF_SYS_FAIL(KVF_ERR_SYSTEM, errno, "socket(AF_UNIX, SOCK_STREAM)");
    goto out;
  }
  memset(&addr, 0, sizeof addr);
  addr.sun_family = AF_UNIX;
  memcpy(addr.sun_path, ep->path, strlen(ep->path) + 1);
  if (bind(ep->listen_fd, (struct sockaddr *)&addr, sizeof addr) != 0) {
    rc = KVF_SYS_FAIL(KVF_ERR_SYSTEM, errno, "bind(socket)");
    kvf_error_prefix("%s: ", ep->path);
    goto out;
  }
  bound = 1;
  /* bind() applies the umask; the directory already keeps others out, and
   * 0600 says the same on the socket itself. */
  if (chmod(ep->path, 0600) != 0 || lstat(ep->path, &st) != 0) {
    rc = KVF_SYS_FAIL(KVF_ERR_SYSTEM, errno, "chmod(socket, 0600)");
    goto out;
  }
  ep->sock_dev = st.st_dev;
  ep->sock_ino = st.st_ino;
  if (listen(ep->listen_fd, backlog > 0 ? backlog : 64) != 0) {
    rc = KVF_SYS_FAIL(KVF_ERR_SYSTEM, errno, "listen(socket)");
    goto out;
  }
  KVF_INFO(SERVER, "listening on %s (pid %ld)", ep->path, (long)getpid());
  *out = ep;
  ep = NULL;
out:
  if (ep != NULL) {
    if (bound) unlink(ep->path);
    kvf_sys_close(ep->listen_fd);
    kvf_sys_close(ep->lock_fd);
    free(ep);
  }
  return rc;
}

int kvf_endpoint_fd(const kvf_endpoint *ep) { return ep ? ep->listen_fd : -1; }

const char *kvf_endpoint_socket_path(const kvf_endpoint *ep) { return ep ? ep->path : ""; }

void kvf_endpoint_close(kvf_endpoint *ep) {
  struct stat st;
  if (ep == NULL) return;
  /* Remove the socket before the lock goes, so a server that takes the lock
   * next never has its own socket removed. */
  if (lstat(ep->path, &st) == 0 && st.st_dev == ep->sock_dev && st.st_ino == ep->sock_ino) unlink(ep->path);
  kvf_sys_close(ep->listen_fd);
  kvf_sys_close(ep->lock_fd);
  KVF_INFO(SERVER, "stopped listening on %s", ep->path);
  free(ep);
}

kvf_status kvf_endpoint_accept(kvf_endpoint *ep, int timeout_ms, uint32_t max_payload, kvf_conn *conn) {
  if (conn != NULL) kvf_conn_init(conn, -1, max_payload);
  if (ep == NULL || conn == NULL) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_endpoint_accept: NULL argument");
  int64_t deadline = kvf_now_ms() + (timeout_ms > 0 ? timeout_ms : 0);
  int fd;
  for (;;) {
    fd = accept4(ep->listen_fd, NULL, NULL, SOCK_CLOEXEC);
    if (fd >= 0) break;
    int e = errno;
    /* A client that gave up between poll and accept is not an error. */
    if (e == EINTR || e == ECONNABORTED) continue;
    if (e != EAGAIN) return KVF_SYS_FAIL(KVF_ERR_SYSTEM, e, "accept4(socket)");
    int w = wait_fd(ep->listen_fd, POLLIN, timeout_ms, deadline);
    if (w == 0) return kvf_fail(KVF_ERR_TIMEOUT, "accept: no client connected within %d ms", timeout_ms);
    if (w < 0) return KVF_SYS_FAIL(KVF_ERR_SYSTEM, errno, "poll(listening socket)");
  }
  /* Before anything is read from the peer, let alone a descriptor. */
  struct ucred cred;
  socklen_t len = sizeof cred;
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    kvf_status rc = KVF_SYS_FAIL(KVF_ERR_SYSTEM, errno, "getsockopt(SO_PEERCRED)");
    kvf_sys_close(fd);
    return rc;
  }
  if (cred.uid != geteuid()) {
    KVF_WARN(SERVER, "refused a client on %s: uid %u pid %ld; only uid %u may connect", ep->path,
             (unsigned)cred.uid, (long)cred.pid, (unsigned)geteuid());
    kvf_sys_close(fd);
    return kvf_fail(KVF_ERR_PERMISSION, "peer: uid %u (pid %ld) is not this server's uid %u; refused",
                    (unsigned)cred.uid, (long)cred.pid, (unsigned)geteuid());
  }
  kvf_conn_init(conn, fd, max_payload);
  conn->peer.pid = cred.pid;
  conn->peer.uid = cred.uid;
  conn->peer.gid = cred.gid;
  KVF_INFO(IPC, "accepted a client on %s: pid %ld", ep->path, (long)cred.pid);
  return KVF_SUCCESS;
}

/* ---- client ----------------------------------------------------------------- */

kvf_status kvf_endpoint_connect(const char *dir, uint32_t max_payload, kvf_conn *conn) {
  char path[KVF_SUN_PATH_MAX];
  struct sockaddr_un addr;
  struct stat st;
  kvf_status rc;
  int fd = -1;

  if (conn != NULL) kvf_conn_init(conn, -1, max_payload);
  if (dir == NULL || dir[0] == '\0' || conn == NULL)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_endpoint_connect: NULL argument or empty socket_dir");
  if ((rc = join_path(dir, KVF_ENDPOINT_SOCKET_NAME, path, sizeof path))) return rc;
  fd = KVF_SYS(socket)(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return KVF_SYS_FAIL(KVF_ERR_SYSTEM, errno, "socket(AF_UNIX, SOCK_STREAM)");
  memset(&addr, 0, sizeof addr);
  addr.sun_family = AF_UNIX;
  memcpy(addr.sun_path, path, strlen(path) + 1);
  while (connect(fd, (struct sockaddr *)&addr, sizeof addr) != 0) {
    int e = errno;
    if (e == EINTR) continue;
    if (e == EISCONN) break; /* an interrupted connect completed meanwhile */
    kvf_sys_close(fd);
    switch (e) {
    case ENOENT:
      if (stat(dir, &st) != 0)
        return kvf_fail(KVF_ERR_NOT_FOUND, "socket_dir: no kvferryd serves %s: the directory does not exist", dir);
      return kvf_fail(KVF_ERR_NOT_FOUND, "socket_dir: no kvferryd serves %s: %s does not exist", dir, path);
    case ECONNREFUSED:
      return kvf_fail(KVF_ERR_NOT_FOUND,
                      "socket_dir: no kvferryd serves %s: nothing listens on %s (a server exited without "
                      "cleaning up)",
                      dir, path);
    case EACCES:
    case EPERM:
      return kvf_fail(KVF_ERR_PERMISSION,
                      "socket_dir: %s: permission denied; the server runs as another user (uid %u here)", path,
                      (unsigned)geteuid());
    default:
      rc = KVF_SYS_FAIL(KVF_ERR_SYSTEM, e, "connect(kvferryd socket)");
      kvf_error_prefix("%s: ", path);
      return rc;
    }
  }
  kvf_conn_init(conn, fd, max_payload);
  return KVF_SUCCESS;
}

/* ---- connections ---------------------------------------------------------- */

void kvf_conn_init(kvf_conn *conn, int fd, uint32_t max_payload) {
  if (conn == NULL) return;
  memset(conn, 0, sizeof *conn);
  conn->fd = fd;
  kvf_proto_reader_init(&conn->reader, max_payload);
}

static void conn_drop_fds(kvf_conn *conn) {
  for (uint32_t i = 0; i < conn->num_fds; i++) kvf_sys_close(conn->fds[i]);
  conn->num_fds = 0;
}

void kvf_conn_close(kvf_conn *conn) {
  if (conn == NULL) return;
  conn_drop_fds(conn);
  kvf_sys_close(conn->fd);
  conn->fd = -1;
  kvf_proto_reader_reset(&conn->reader);
}

/* The peer hung up: a clean disconnect between frames, a protocol error in
 * the middle of one. */
static kvf_status conn_closed_status(const kvf_conn *conn) {
  const kvf_proto_reader *r = &conn->reader;
  if (r->header_have == 0 && conn->num_fds == 0)
    return kvf_fail(KVF_ERR_DISCONNECTED, "connection: the peer closed it");
  if (r->header_have < KVF_PROTO_HEADER_SIZE)
    return kvf_fail(KVF_ERR_PROTOCOL, "frame: the peer closed the connection after %zu of the header's %u bytes",
                    r->header_have, KVF_PROTO_HEADER_SIZE);
  return kvf_fail(KVF_ERR_PROTOCOL, "frame: the peer closed the connection after %zu of the payload's %u bytes",
                  r->payload_have, r->header.payload_len);
}

/* The header to hand back with a failure: what arrived, when it is one of
 * ours (a wrong magic means its request id means nothing). */
static void conn_failed_header(const kvf_conn *conn, kvf_proto_header *header) {
  if (conn->reader.header_have == KVF_PROTO_HEADER_SIZE && conn->reader.header.magic == KVF_PROTO_MAGIC)
    *header = conn->reader.header;
}

/* kvf_conn_read_frame and kvf_conn_read_some: wait up to timeout_ms, read
 * at most max_bytes; *bytes_read and *drained (both set) say how many came
 * and whether the socket was found empty. */
static kvf_status conn_read(kvf_conn *conn, int timeout_ms, size_t max_bytes, size_t *bytes_read, int *drained,
                            kvf_proto_header *header, uint8_t **payload, int *fds, uint32_t max_fds,
                            uint32_t *num_fds) {
  uint8_t buf[16384];
  kvf_status rc = KVF_SUCCESS;

  *bytes_read = 0;
  *drained = 0;
  if (payload) *payload = NULL;
  if (num_fds) *num_fds = 0;
  if (header) memset(header, 0, sizeof *header);
  if (conn == NULL || header == NULL || payload == NULL || num_fds == NULL || (max_fds > 0 && fds == NULL))
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_conn_read_frame: NULL argument");
  if (max_fds > KVF_PROTO_MAX_FDS)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_conn_read_frame: max_fds %u is more than %u", max_fds,
                    KVF_PROTO_MAX_FDS);
  if (conn->fd < 0) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_conn_read_frame: the connection is closed");
  if (conn->failed) {
    conn_failed_header(conn, header);
    return kvf_fail(conn->failed, "connection: failed earlier; close it");
  }
  int64_t deadline = kvf_now_ms() + (timeout_ms > 0 ? timeout_ms : 0);
  for (;;) {
    /* Never read past this frame: the next frame's descriptors ride on its
     * first byte, and a read stops at them only if we do not ask for it. */
    size_t want = kvf_proto_reader_want(&conn->reader);
    if (want == 0) /* held: the owner grants the payload's buffer first (kvf_conn_grant) */
      return kvf_fail(KVF_ERR_TIMEOUT, "connection: the frame waits for its buffer");
    if (*bytes_read >= max_bytes) return kvf_fail(KVF_ERR_TIMEOUT, "connection: read budget spent");
    if (want > max_bytes - *bytes_read) want = max_bytes - *bytes_read;
    if (want > sizeof buf) want = sizeof buf;
    uint32_t problems = 0;
    /* Room for a whole frame's worth: more than max_fds is then our error
     * (overflow), more than the room the kernel's (MSG_CTRUNC). */
    ssize_t n = kvf_fdpass_recvmsg(conn->fd, buf, want, conn->fds, max_fds, &conn->num_fds, KVF_PROTO_MAX_FDS,
                                   MSG_DONTWAIT, &problems);
    if (n < 0) {
      int e = errno;
      if (e == EINTR) continue;
      if (e == EAGAIN) {
        int w = wait_fd(conn->fd, POLLIN, timeout_ms, deadline);
        if (w > 0) continue;
        if (w == 0) {
          *drained = 1;
          return kvf_fail(KVF_ERR_TIMEOUT, "connection: no whole frame within %d ms", timeout_ms);
        }
        rc = KVF_SYS_FAIL(KVF_ERR_SYSTEM, errno, "poll(connection)");
        goto fail;
      }
      if (e == ECONNRESET) {
        /* The peer closed with our data unread: a hang-up like EOF, not a
         * system failure worth a warning. */
        rc = conn_closed_status(conn);
        goto fail;
      }
      rc = KVF_SYS_FAIL(kvf_fdpass_errno_status(e), e, "recvmsg(connection)");
      goto fail;
    }
    if (problems & KVF_FDPASS_CTRUNC) {
      rc = kvf_fail(KVF_ERR_PROTOCOL, "frame.fds: descriptors were truncated (MSG_CTRUNC); those that arrived were "
                                      "closed");
      goto fail;
    }
    if (problems & KVF_FDPASS_OVERFLOW) {
      rc = kvf_fail(KVF_ERR_PROTOCOL, "frame.fds: more than %u descriptors came with one frame", max_fds);
      goto fail;
    }
    if (n == 0) {
      rc = conn_closed_status(conn);
      goto fail;
    }
    *bytes_read += (size_t)n;
    size_t consumed = 0;
    int ready = 0;
    rc = kvf_proto_reader_feed(&conn->reader, buf, (size_t)n, &consumed, &ready);
    if (rc) goto fail;
    if (consumed != (size_t)n) {
      rc = kvf_fail(KVF_ERR_INTERNAL, "frame: read %zd bytes past the frame's end, %zu consumed", n, consumed);
      goto fail;
    }
    if (ready) {
      rc = kvf_proto_reader_take(&conn->reader, header, payload);
      if (rc) goto fail;
      if (conn->num_fds > 0) memcpy(fds, conn->fds, sizeof(int) * conn->num_fds);
      *num_fds = conn->num_fds;
      conn->num_fds = 0;
      return KVF_SUCCESS;
    }
  }
fail:
  conn->failed = rc;
  conn_drop_fds(conn);
  conn_failed_header(conn, header);
  return rc;
}

kvf_status kvf_conn_read_frame(kvf_conn *conn, int timeout_ms, kvf_proto_header *header, uint8_t **payload,
                               int *fds, uint32_t max_fds, uint32_t *num_fds) {
  size_t bytes = 0;
  int drained = 0;
  return conn_read(conn, timeout_ms, SIZE_MAX, &bytes, &drained, header, payload, fds, max_fds, num_fds);
}

kvf_status kvf_conn_read_some(kvf_conn *conn, size_t max_bytes, size_t *bytes_read, int *drained,
                              kvf_proto_header *header, uint8_t **payload, int *fds, uint32_t max_fds,
                              uint32_t *num_fds) {
  size_t b = 0;
  int d = 0;
  kvf_status rc = conn_read(conn, 0, max_bytes, &b, &d, header, payload, fds, max_fds, num_fds);
  if (bytes_read) *bytes_read = b;
  if (drained) *drained = d;
  return rc;
}

kvf_status kvf_conn_grant(kvf_conn *conn) {
  if (conn == NULL) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_conn_grant: NULL argument");
  kvf_status rc = kvf_proto_reader_grant(&conn->reader);
  if (rc != KVF_SUCCESS && rc != KVF_ERR_STATE) conn->failed = rc;
  return rc;
}

kvf_status kvf_conn_write_frame(kvf_conn *conn, const uint8_t *frame, size_t len, const int *fds, uint32_t num_fds,
                                int timeout_ms) {
  size_t sent = 0;
  kvf_status rc;

  if (conn == NULL || frame == NULL || (num_fds > 0 && fds == NULL))
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_conn_write_frame: NULL argument");
  if (len < KVF_PROTO_HEADER_SIZE)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_conn_write_frame: len %zu is shorter than a header", len);
  if (num_fds > KVF_PROTO_MAX_FDS)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_conn_write_frame: num_fds %u is more than %u", num_fds,
                    KVF_PROTO_MAX_FDS);
  for (uint32_t i = 0; i < num_fds; i++)
    if (fds[i] < 0) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_conn_write_frame: fds[%u] is %d", i, fds[i]);
  if (conn->fd < 0) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_conn_write_frame: the connection is closed");
  if (conn->write_failed) return kvf_fail(conn->write_failed, "connection: a write failed earlier; close it");

  int64_t deadline = kvf_now_ms() + (timeout_ms > 0 ? timeout_ms : 0);
  while (sent < len) {
    /* Descriptors ride on the frame's first byte; a send that took no
     * byte took no descriptor either, so a retry attaches them again. */
    ssize_t n = kvf_fdpass_sendmsg(conn->fd, frame + sent, len - sent, fds, sent == 0 ? num_fds : 0, MSG_DONTWAIT);
    if (n < 0) {
      int e = errno;
      if (e == EINTR) continue;
      if (e == EAGAIN) {
        int w = wait_fd(conn->fd, POLLOUT, timeout_ms, deadline);
        if (w > 0) continue;
        if (w == 0)
          rc = kvf_fail(KVF_ERR_TIMEOUT, "connection: the peer took %zu of the frame's %zu bytes within %d ms", sent,
                        len, timeout_ms);
        else
          rc = KVF_SYS_FAIL(KVF_ERR_SYSTEM, errno, "poll(connection)");
        if (sent > 0) conn->write_failed = rc; /* out of step: the frame is cut */
        return rc;
      }
      if (e == EPIPE || e == ECONNRESET)
        rc = kvf_fail(KVF_ERR_DISCONNECTED, "connection: the peer closed it (%zu of the frame's %zu bytes sent)", sent,
                      len);
      else
        rc = KVF_SYS_FAIL(kvf_fdpass_errno_status(e), e, "sendmsg(connection)");
      conn->write_failed = rc;
      return rc;
    }
    sent += (size_t)n;
  }
  return KVF_SUCCESS;
}

kvf_status kvf_conn_send(kvf_conn *conn, const kvf_proto_msg *msg, const int *fds, uint32_t num_fds,
                         int timeout_ms) {
  uint8_t *frame = NULL;
  size_t len = 0;
  kvf_status rc = kvf_proto_encode(msg, &frame, &len);
  if (rc == KVF_SUCCESS) rc = kvf_conn_write_frame(conn, frame, len, fds, num_fds, timeout_ms);
  free(frame);
  return rc;
}

void kvf_conn_error_msg(kvf_proto_msg *msg, uint64_t request_id, kvf_status status, const char *detail) {
  /* Copied first: detail may be kvf_last_error(), overwritten by later calls. */
  char text[KVF_PROTO_FIELD_MAX + KVF_PROTO_MESSAGE_MAX];
  snprintf(text, sizeof text, "%s", detail ? detail : kvf_last_error());
  memset(msg, 0, sizeof *msg);
  msg->type = KVF_PROTO_ERROR;
  msg->request_id = request_id;
  msg->u.error.status = status == KVF_SUCCESS ? (uint32_t)KVF_ERR_INTERNAL : (uint32_t)status;
  msg->u.error.version = KVF_PROTO_VERSION;
  /* "field: message" when the text before ": " reads as a field name. */
  const char *body = text;
  const char *sep = strstr(text, ": ");
  if (sep != NULL && sep > text && (size_t)(sep - text) < KVF_PROTO_FIELD_MAX &&
      strcspn(text, " \t\n") >= (size_t)(sep - text)) {
    memcpy(msg->u.error.field, text, (size_t)(sep - text));
    body = sep + 2;
  }
  /* Cut to fit; messages are one line, so a cut loses only the tail. */
  size_t blen = strnlen(body, sizeof msg->u.error.message - 1);
  memcpy(msg->u.error.message, body, blen);
}

kvf_status kvf_conn_send_error(kvf_conn *conn, uint64_t request_id, kvf_status status, const char *detail,
                               int timeout_ms) {
  kvf_proto_msg msg;
  kvf_conn_error_msg(&msg, request_id, status, detail);
  return kvf_conn_send(conn, &msg, NULL, 0, timeout_ms);
}
