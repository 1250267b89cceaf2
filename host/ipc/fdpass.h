/*
 * Internal: the one SCM_RIGHTS path. Every message that carries descriptors
 * over a Unix stream socket, blocking (kvf_ipc_send/recv, kvferry/memory.h)
 * or non-blocking (the endpoint's frame I/O, host/ipc/endpoint.h), goes
 * through these two calls: they build and parse the control message, receive
 * with MSG_CMSG_CLOEXEC, take every descriptor that arrived before anything
 * is judged (so none stays open on an error path) and report truncation.
 * Both go through the fault-injectable system-call table (host/core/syscalls.h).
 *
 * Threading: no state of their own; two threads must not send (or receive)
 * on one socket at once.
 */
#ifndef KVF_HOST_IPC_FDPASS_H
#define KVF_HOST_IPC_FDPASS_H

#include <stdint.h>
#include <sys/types.h>

#include <kvferry/memory.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The most descriptors one message carries (the kernel's SCM_MAX_FD). */
#define KVF_FDPASS_MAX_FDS KVF_IPC_MAX_FDS

/* What kvf_fdpass_recvmsg found wrong with the descriptors (bit flags). */
#define KVF_FDPASS_CTRUNC 1u   /* the kernel truncated them (MSG_CTRUNC): more than the room offered */
#define KVF_FDPASS_OVERFLOW 2u /* more arrived than max_fds: the extra ones were closed */

/* The status a failed sendmsg/recvmsg maps to: EPIPE, ECONNRESET, ENOTCONN
 * KVF_ERR_DISCONNECTED; EAGAIN KVF_ERR_TIMEOUT; ENOMEM, ENOBUFS
 * KVF_ERR_OUT_OF_MEMORY; anything else KVF_ERR_SYSTEM. */
kvf_status kvf_fdpass_errno_status(int err);

/* One sendmsg(2) of up to len bytes of buf with num_fds descriptors
 * (0 .. KVF_FDPASS_MAX_FDS, checked by the caller) attached by SCM_RIGHTS.
 * MSG_NOSIGNAL is always added to flags. A send that took no byte took no
 * descriptor either: attach them again on the retry, and only there.
 * Returns what sendmsg returns (-1 with errno). */
ssize_t kvf_fdpass_sendmsg(int sock, const void *buf, size_t len, const int *fds, uint32_t num_fds, int flags);

/* One recvmsg(2) of up to len bytes into buf, MSG_CMSG_CLOEXEC added to
 * flags, with control room for `room` descriptors (0 .. KVF_FDPASS_MAX_FDS;
 * more than that are truncated by the kernel). Every descriptor that arrived
 * is appended to fds[*num_fds ..] while *num_fds < max_fds and closed
 * otherwise; *problems gets KVF_FDPASS_CTRUNC / KVF_FDPASS_OVERFLOW or'ed
 * in (never cleared). fds may be NULL when max_fds is 0. Returns what
 * recvmsg returns (-1 with errno; nothing was received then). */
ssize_t kvf_fdpass_recvmsg(int sock, void *buf, size_t len, int *fds, uint32_t max_fds, uint32_t *num_fds,
                           uint32_t room, int flags, uint32_t *problems);

#ifdef __cplusplus
}
#endif

#endif /* KVF_HOST_IPC_FDPASS_H */
