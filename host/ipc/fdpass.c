/* Descriptor passing over Unix stream sockets: the one SCM_RIGHTS path
 * (host/ipc/fdpass.h) and, over it, the blocking whole-message calls of
 * kvferry/memory.h (kvf_ipc_send/recv: descriptors on the first byte,
 * EINTR retried, partial transfers continued). */
#define _GNU_SOURCE
#include "host/ipc/fdpass.h"

#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <kvferry/memory.h>

#include "common/error.h"
#include "host/core/log.h"
#include "host/core/syscalls.h"

/* A control buffer big enough for KVF_FDPASS_MAX_FDS descriptors, aligned
 * for struct cmsghdr. */
typedef union kvf_fdpass_control {
  struct cmsghdr align;
  char bytes[CMSG_SPACE(sizeof(int) * KVF_FDPASS_MAX_FDS)];
} kvf_fdpass_control;

kvf_status kvf_fdpass_errno_status(int err) {
  switch (err) {
  case EPIPE:
  case ECONNRESET:
  case ENOTCONN: return KVF_ERR_DISCONNECTED;
  case EAGAIN: return KVF_ERR_TIMEOUT; /* EWOULDBLOCK is the same value on Linux */
  case ENOMEM:
  case ENOBUFS: return KVF_ERR_OUT_OF_MEMORY;
  default: return KVF_ERR_SYSTEM;
  }
}

ssize_t kvf_fdpass_sendmsg(int sock, const void *buf, size_t len, const int *fds, uint32_t num_fds, int flags) {
  kvf_fdpass_control ctl;
  struct iovec iov = {(void *)buf, len};
  struct msghdr msg;
  memset(&msg, 0, sizeof msg);
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  if (num_fds > 0) {
    memset(&ctl, 0, sizeof ctl);
    msg.msg_control = ctl.bytes;
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * num_fds);
    struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * num_fds);
    memcpy(CMSG_DATA(c), fds, sizeof(int) * num_fds);
  }
  return KVF_SYS(sendmsg)(sock, &msg, flags | MSG_NOSIGNAL);
}

ssize_t kvf_fdpass_recvmsg(int sock, void *buf, size_t len, int *fds, uint32_t max_fds, uint32_t *num_fds,
                           uint32_t room, int flags, uint32_t *problems) {
  kvf_fdpass_control ctl;
  struct iovec iov = {buf, len};
  struct msghdr msg;
  memset(&msg, 0, sizeof msg);
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  if (room > 0) {
    msg.msg_control = ctl.bytes;
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * room);
  }
  ssize_t r = KVF_SYS(recvmsg)(sock, &msg, flags | MSG_CMSG_CLOEXEC);
  if (r < 0) return r;
  /* Take every descriptor that arrived before the caller judges the message. */
  if (kvf_sys_take_fds(&msg, fds, num_fds, max_fds)) *problems |= KVF_FDPASS_OVERFLOW;
  if (msg.msg_flags & MSG_CTRUNC) *problems |= KVF_FDPASS_CTRUNC;
  return r;
}

kvf_status kvf_ipc_socketpair(int out[2]) {
  int sv[2];
  if (out == NULL) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_ipc_socketpair: out is NULL");
  if (KVF_SYS(socketpair)(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0)
    return KVF_SYS_FAIL(KVF_ERR_SYSTEM, errno, "socketpair(AF_UNIX, SOCK_STREAM)");
  out[0] = sv[0];
  out[1] = sv[1];
  return KVF_SUCCESS;
}

/* Close each distinct descriptor of the list once. */
static void kvf_ipc_close_list(const int *fds, uint32_t n) {
  for (uint32_t i = 0; i < n; i++) {
    int dup = 0;
    for (uint32_t j = 0; j < i && !dup; j++) dup = fds[j] == fds[i];
    if (!dup) kvf_sys_close(fds[i]);
  }
}

kvf_status kvf_ipc_send(int sock, const void *buf, size_t len, const int *fds, uint32_t num_fds, uint32_t flags) {
  kvf_status st = KVF_SUCCESS;
  size_t sent = 0;
  int attached = 0;

  if (flags & ~KVF_IPC_CLOSE_FDS) {
    st = kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_ipc_send: unknown flags 0x%x", flags & ~KVF_IPC_CLOSE_FDS);
    goto out;
  }
  if (num_fds > 0 && fds == NULL) {
    /* Nothing to close either. */
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_ipc_send: fds is NULL with num_fds %u", num_fds);
  }
  if (num_fds > KVF_IPC_MAX_FDS) {
    st = kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_ipc_send: num_fds %u is more than %u", num_fds, KVF_IPC_MAX_FDS);
    goto out;
  }
  if (len > 0 && buf == NULL) {
    st = kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_ipc_send: buf is NULL with len %zu", len);
    goto out;
  }
  if (num_fds > 0 && len == 0) {
    st = kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_ipc_send: descriptors need a message of at least one byte");
    goto out;
  }
  for (uint32_t i = 0; i < num_fds; i++)
    if (fds[i] < 0) {
      st = kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_ipc_send: fds[%u] is %d", i, fds[i]);
      goto out;
    }

  while (sent < len) {
    /* Descriptors ride on the first byte of the message only. */
    ssize_t r = kvf_fdpass_sendmsg(sock, (const char *)buf + sent, len - sent, fds, attached ? 0 : num_fds, 0);
    if (r < 0) {
      int e = errno;
      if (e == EINTR) continue;
      st = KVF_SYS_FAIL(kvf_fdpass_errno_status(e), e, sent ? "sendmsg (after part of the message was sent)" : "sendmsg");
      goto out;
    }
    attached = 1;
    sent += (size_t)r;
  }
out:
  if ((flags & KVF_IPC_CLOSE_FDS) && fds != NULL) kvf_ipc_close_list(fds, num_fds);
  return st;
}

kvf_status kvf_ipc_recv(int sock, void *buf, size_t len, int *fds, uint32_t max_fds, uint32_t *num_fds) {
  kvf_status st = KVF_SUCCESS;
  size_t have = 0;
  uint32_t got = 0;
  int overflow = 0;

  if (num_fds != NULL) *num_fds = 0;
  if (len == 0 || buf == NULL)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_ipc_recv: %s", len == 0 ? "len is 0" : "buf is NULL");
  if (max_fds > 0 && (fds == NULL || num_fds == NULL))
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_ipc_recv: %s is NULL with max_fds %u", fds ? "num_fds" : "fds",
                    max_fds);
  if (max_fds > KVF_IPC_MAX_FDS)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_ipc_recv: max_fds %u is more than %u", max_fds, KVF_IPC_MAX_FDS);

  while (have < len) {
    uint32_t problems = 0;
    /* Room for exactly max_fds: more than that is truncated by the kernel
     * and shows as MSG_CTRUNC. */
    ssize_t r = kvf_fdpass_recvmsg(sock, (char *)buf + have, len - have, fds, max_fds, &got, max_fds, 0, &problems);
    if (r < 0) {
      int e = errno;
      if (e == EINTR) continue;
      st = KVF_SYS_FAIL(kvf_fdpass_errno_status(e), e, have ? "recvmsg (in the middle of a message)" : "recvmsg");
      goto fail;
    }
    if (problems & KVF_FDPASS_OVERFLOW) overflow = 1;
    if (problems & KVF_FDPASS_CTRUNC) {
      st = kvf_fail(KVF_ERR_PROTOCOL,
                    "kvf_ipc_recv: descriptors were truncated (MSG_CTRUNC): the peer sent more than max_fds %u; "
                    "the %u that arrived were closed",
                    max_fds, got);
      goto fail;
    }
    if (r == 0) {
      if (have == 0 && got == 0)
        st = kvf_fail(KVF_ERR_DISCONNECTED, "kvf_ipc_recv: the peer closed the connection");
      else
        st = kvf_fail(KVF_ERR_PROTOCOL, "kvf_ipc_recv: the peer closed the connection after %zu of %zu bytes", have,
                      len);
      goto fail;
    }
    have += (size_t)r;
  }
  if (overflow) {
    st = kvf_fail(KVF_ERR_PROTOCOL, "kvf_ipc_recv: the peer sent more than max_fds %u descriptors", max_fds);
    goto fail;
  }
  if (num_fds != NULL) *num_fds = got;
  return KVF_SUCCESS;

fail:
  for (uint32_t i = 0; i < got; i++) kvf_sys_close(fds[i]);
  if (num_fds != NULL) *num_fds = 0;
  return st;
}
