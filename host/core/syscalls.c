/* The system-call table the memory layer goes through (host/syscalls.h). */
#define _GNU_SOURCE
#include "host/core/syscalls.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/error.h"
#include "host/core/log.h"

/* fcntl is variadic; the table's entry takes one int argument. */
static int kvf_sys_fcntl_int(int fd, int cmd, int arg) { return fcntl(fd, cmd, arg); }

static int kvf_sys_getrandom(void *buf, size_t len, unsigned int flags) {
  ssize_t n = getrandom(buf, len, flags);
  return n < 0 ? -1 : (int)n;
}

static const kvf_sys_table kvf_sys_libc = {
    .socket = socket,
    .socketpair = socketpair,
    .sendmsg = sendmsg,
    .recvmsg = recvmsg,
    .mmap = mmap,
    .munmap = munmap,
    .mprotect = mprotect,
    .memfd_create = memfd_create,
    .ftruncate = ftruncate,
    .fstat = fstat,
    .fcntl = kvf_sys_fcntl_int,
    .close = close,
    .getrandom = kvf_sys_getrandom,
};

/* The replacement (tests) or NULL; read and written atomically. */
static const kvf_sys_table *kvf_sys_replacement;

const kvf_sys_table *kvf_sys(void) {
  const kvf_sys_table *t = __atomic_load_n(&kvf_sys_replacement, __ATOMIC_ACQUIRE);
  return t ? t : &kvf_sys_libc;
}

const kvf_sys_table *kvf_sys_table_default(void) { return &kvf_sys_libc; }

const kvf_sys_table *kvf_sys_table_install(const kvf_sys_table *replacement) {
  return __atomic_exchange_n(&kvf_sys_replacement, replacement, __ATOMIC_ACQ_REL);
}

kvf_status kvf_sys_fail(kvf_status st, int err, const char *what, const char *file, int line) {
  char text[128];
  /* GNU strerror_r returns the message (maybe not in text). */
  const char *msg = strerror_r(err, text, sizeof text);
  const char *base = strrchr(file, '/');
  KVF_WARN(IPC, "%s: %s (errno %d) at %s:%d", what, msg, err, base ? base + 1 : file, line);
  return kvf_fail(st, "%s: %s", what, msg);
}

int kvf_sys_take_fds(struct msghdr *msg, int *fds, uint32_t *count, uint32_t max) {
  int overflow = 0;
  if (msg->msg_controllen == 0) return 0;
  for (struct cmsghdr *c = CMSG_FIRSTHDR(msg); c != NULL; c = CMSG_NXTHDR(msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    size_t n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < n; i++) {
      int fd;
      memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
      if (*count < max) {
        fds[(*count)++] = fd;
      } else {
        overflow = 1;
        kvf_sys_close(fd);
      }
    }
  }
  return overflow;
}

void kvf_sys_close(int fd) {
  if (fd < 0) return;
  if (KVF_SYS(close)(fd) != 0) {
    int e = errno;
    KVF_INFO(IPC, "close(%d): %s (the descriptor is released anyway)", fd, strerror(e));
  }
}
