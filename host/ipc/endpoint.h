/*
 * Internal: kvferryd's socket endpoint (DESIGN.md section 9, docs/protocol.md).
 *
 * Server side: kvf_endpoint_listen() takes a socket directory, creates it
 * 0700 (or checks that it is a directory owned by this user with no group or
 * other permission bits), takes an exclusive flock on <dir>/kvferryd.lock so
 * a second server on the same directory is refused (naming the holder's pid
 * when it is known), replaces a stale socket left by a crashed server, and
 * listens on <dir>/kvferryd.sock, mode 0600. kvf_endpoint_accept() checks
 * each peer with SO_PEERCRED before anything else: a peer with another uid is
 * logged (uid, pid) and closed.
 *
 * Connections: a kvf_conn wraps one connected socket and a frame reader
 * (host/protocol.h). kvf_conn_read_frame() returns one whole frame and the
 * descriptors that came with it (SCM_RIGHTS, close-on-exec); it keeps a
 * partial frame across calls, so it serves a poll loop (timeout 0) as well
 * as a blocking caller. kvf_conn_write_frame() sends one frame, optionally
 * with descriptors. Both retry EINTR and wait with poll() up to a timeout
 * whatever the socket's O_NONBLOCK setting. A connection that failed (a
 * malformed frame, truncated descriptors) is out of step: every later read
 * returns the same status; answer with kvf_conn_send_error() if possible,
 * then close it. A write cut off mid-frame fails every later write.
 *
 * Client side: kvf_endpoint_connect() connects to a directory's socket and
 * says clearly when no server runs there.
 *
 * Threading: a kvf_endpoint or kvf_conn is used by one thread at a time.
 * Nothing here installs signal handlers; writes use MSG_NOSIGNAL.
 */
#ifndef KVF_HOST_ENDPOINT_H
#define KVF_HOST_ENDPOINT_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include <kvferry/status.h>

#include "host/ipc/protocol.h"

#ifdef __cplusplus
extern "C" {
#endif

#define KVF_ENDPOINT_SOCKET_NAME "kvferryd.sock"
#define KVF_ENDPOINT_LOCK_NAME "kvferryd.lock"

/* The peer of a connection, from SO_PEERCRED (its credentials at connect). */
typedef struct kvf_peer {
  pid_t pid;
  uid_t uid;
  gid_t gid;
} kvf_peer;

/* A listening server endpoint. Opaque. */
typedef struct kvf_endpoint kvf_endpoint;

/* One connection: the socket, its peer and the frame being reassembled.
 * Fields are read-only outside endpoint.c. */
typedef struct kvf_conn {
  int fd;           /* -1 when closed */
  kvf_peer peer;    /* filled by kvf_endpoint_accept; zero on the client side */
  kvf_status failed;       /* reads: sticky; KVF_SUCCESS while healthy */
  kvf_status write_failed; /* writes: sticky once a frame was cut off */
  kvf_proto_reader reader;
  int fds[KVF_PROTO_MAX_FDS]; /* descriptors of the frame being read */
  uint32_t num_fds;
} kvf_conn;

/* Check or create the socket directory `dir`: created 0700 when missing (its
 * parent must exist); an existing one must be a real directory (not a
 * symlink) owned by the effective uid with no group or other permission
 * bits. Returns KVF_SUCCESS; KVF_ERR_INVALID_ARGUMENT (NULL or empty dir, a
 * path too long for a socket address); KVF_ERR_PERMISSION (wrong owner, a
 * looser mode, not a directory: the message names the directory, the owner
 * or mode found and what is required); KVF_ERR_SYSTEM. */
kvf_status kvf_endpoint_check_dir(const char *dir);

/* Become the server of `dir`: check or create it (kvf_endpoint_check_dir),
 * lock it, replace a stale socket, bind and listen (backlog `backlog`; 0:
 * 64). Returns KVF_SUCCESS and *out; KVF_ERR_BUSY (another server holds the
 * directory: the message names it and the holder's pid when known);
 * KVF_ERR_PERMISSION (the directory failed its checks, or something other
 * than a socket sits at the socket's path); KVF_ERR_INVALID_ARGUMENT;
 * KVF_ERR_OUT_OF_MEMORY; KVF_ERR_SYSTEM. Nothing is left behind on failure. */
kvf_status kvf_endpoint_listen(const char *dir, int backlog, kvf_endpoint **out);

/* The listening descriptor (to poll for POLLIN), the socket's path. */
int kvf_endpoint_fd(const kvf_endpoint *ep);
const char *kvf_endpoint_socket_path(const kvf_endpoint *ep);

/* Accept one connection, waiting up to timeout_ms (negative: no limit; 0:
 * only one already waiting), and check its peer with SO_PEERCRED. On
 * success `conn` is initialized (kvf_conn_init) on the new close-on-exec
 * socket and conn->peer is set. Returns KVF_SUCCESS; KVF_ERR_TIMEOUT (nobody
 * connected in time); KVF_ERR_PERMISSION (the peer has another uid: it was
 * logged with its uid and pid and closed; keep accepting); KVF_ERR_SYSTEM;
 * KVF_ERR_INVALID_ARGUMENT. On failure conn->fd is -1. */
kvf_status kvf_endpoint_accept(kvf_endpoint *ep, int timeout_ms, uint32_t max_payload, kvf_conn *conn);

/* Stop serving: remove the socket (only if it is still the one this
 * endpoint bound), close it and release the lock. NULL is a no-op. */
void kvf_endpoint_close(kvf_endpoint *ep);

/* Connect to the server of `dir` (its kvferryd.sock). Returns KVF_SUCCESS
 * and conn initialized on a close-on-exec socket; KVF_ERR_NOT_FOUND (no
 * server runs there: the directory or socket is missing, or nobody listens
 * on it; the message says which); KVF_ERR_PERMISSION (the directory or socket
 * is not accessible to this user); KVF_ERR_INVALID_ARGUMENT; KVF_ERR_SYSTEM.
 * On failure conn->fd is -1. */
kvf_status kvf_endpoint_connect(const char *dir, uint32_t max_payload, kvf_conn *conn);

/* Take ownership of a connected socket `fd` (may be -1 for an empty conn);
 * payloads up to max_payload bytes are read (0: KVF_PROTO_MAX_PAYLOAD). */
void kvf_conn_init(kvf_conn *conn, int fd, uint32_t max_payload);

/* Close the socket, any descriptors of a partly read frame, and free the
 * reader's buffer. The conn can be initialized again. NULL is a no-op. */
void kvf_conn_close(kvf_conn *conn);

/* Read one whole frame, waiting up to timeout_ms in all (negative: no limit;
 * 0: only what has already arrived). A partial frame is kept across calls.
 * On success *header is the checked header, *payload the payload (NULL when
 * empty; free() it), and fds[0 .. *num_fds) the descriptors that came with
 * the frame, close-on-exec, owned by the caller. A frame with more than
 * max_fds descriptors is a protocol error.
 * Returns KVF_SUCCESS; KVF_ERR_TIMEOUT (no whole frame yet: call again; the
 * connection is still good); KVF_ERR_DISCONNECTED (the peer closed between
 * frames, or reset the connection); KVF_ERR_PROTOCOL (a bad header: *header
 * then holds what arrived if its magic was right, so an ERROR reply can
 * carry the request id; the peer closed mid-frame;
 * descriptors truncated, MSG_CTRUNC, or more than max_fds: every one that
 * arrived is closed); KVF_ERR_OUT_OF_MEMORY; KVF_ERR_SYSTEM;
 * KVF_ERR_INVALID_ARGUMENT. Any failure but TIMEOUT is sticky. On failure no
 * descriptor is handed out, *payload is NULL and *num_fds is 0. */
kvf_status kvf_conn_read_frame(kvf_conn *conn, int timeout_ms, kvf_proto_header *header, uint8_t **payload,
                               int *fds, uint32_t max_fds, uint32_t *num_fds);

/* The event loop's read: like kvf_conn_read_frame with timeout 0 (only what
 * has already arrived), but reading at most max_bytes from the socket in
 * this call, so one connection's turn is bounded. *bytes_read (may be NULL)
 * gets the bytes read; *drained (may be NULL) is 1 when the call stopped
 * because the socket had nothing more, 0 when it stopped on max_bytes, on a
 * whole frame or on a held header. Returns what kvf_conn_read_frame returns;
 * KVF_ERR_TIMEOUT means no whole frame yet: a partial frame is kept, and
 * when the reader holds the frame's header (kvf_proto_reader_limit: its
 * payload is larger than the hold limit; kvf_proto_reader_held says how
 * large) nothing more is read until kvf_conn_grant. */
kvf_status kvf_conn_read_some(kvf_conn *conn, size_t max_bytes, size_t *bytes_read, int *drained,
                              kvf_proto_header *header, uint8_t **payload, int *fds, uint32_t max_fds,
                              uint32_t *num_fds);

/* Allocate the payload buffer of the frame whose header conn's reader holds,
 * so reading goes on. Returns KVF_SUCCESS; KVF_ERR_STATE (nothing held);
 * KVF_ERR_OUT_OF_MEMORY (the connection has failed). */
kvf_status kvf_conn_grant(kvf_conn *conn);

/* Write the len bytes of one encoded frame, with num_fds descriptors
 * (SCM_RIGHTS) on its first byte, waiting up to timeout_ms in all
 * (negative: no limit). The descriptors stay the caller's. SIGPIPE is never
 * raised. Returns KVF_SUCCESS; KVF_ERR_DISCONNECTED (the peer is gone);
 * KVF_ERR_TIMEOUT (the peer did not drain in time; if part of the frame went
 * out the connection is out of step and now failed); KVF_ERR_INVALID_ARGUMENT
 * (num_fds over KVF_PROTO_MAX_FDS, a negative descriptor, len below the
 * header size); KVF_ERR_SYSTEM. */
kvf_status kvf_conn_write_frame(kvf_conn *conn, const uint8_t *frame, size_t len, const int *fds, uint32_t num_fds,
                                int timeout_ms);

/* Encode `msg` (kvf_proto_encode) and write it as above. */
kvf_status kvf_conn_send(kvf_conn *conn, const kvf_proto_msg *msg, const int *fds, uint32_t num_fds,
                         int timeout_ms);

/* Reply with the protocol's ERROR message to request `request_id`:
 * `status` (never KVF_SUCCESS: sent as KVF_ERR_INTERNAL), and `detail` in the
 * library's "field: message" form (NULL: kvf_last_error()), split so the
 * field travels in error.field ("" when detail names none) and the rest,
 * cut to fit, in error.message. Works on a connection whose reads failed
 * (only writes are needed). Returns what kvf_conn_write_frame returns. */
kvf_status kvf_conn_send_error(kvf_conn *conn, uint64_t request_id, kvf_status status, const char *detail,
                               int timeout_ms);

/* Fill *msg with the ERROR kvf_conn_send_error would send (same rules), for
 * callers that queue their frames. */
void kvf_conn_error_msg(kvf_proto_msg *msg, uint64_t request_id, kvf_status status, const char *detail);

#ifdef __cplusplus
}
#endif

#endif /* KVF_HOST_ENDPOINT_H */
