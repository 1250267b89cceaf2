/*
 * Internal: the system calls the memory layer makes, through one table of
 * function pointers, so tests can wrap it and fail the k-th call (the same
 * idea as the driver's entry-point table in host/cudawrap.h).
 *
 * Every call site goes through KVF_SYS(fn); the default table points at the
 * C library. kvf_sys_table_install() swaps in a replacement.
 *
 * Rules the wrappers must follow to stay faithful to Linux: a replacement
 * `close` that reports failure must still close the descriptor (Linux always
 * frees the descriptor, even when close returns -1, so the library never
 * retries a close).
 *
 * Threading: installing a replacement is not synchronized with calls in
 * flight: install before the code under test runs, restore after.
 */
#ifndef KVF_HOST_SYSCALLS_H
#define KVF_HOST_SYSCALLS_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include <kvferry/status.h>

#ifdef __cplusplus
extern "C" {
#endif

struct msghdr;
struct stat;

typedef struct kvf_sys_table {
  int (*socket)(int domain, int type, int protocol);
  int (*socketpair)(int domain, int type, int protocol, int sv[2]);
  ssize_t (*sendmsg)(int fd, const struct msghdr *msg, int flags);
  ssize_t (*recvmsg)(int fd, struct msghdr *msg, int flags);
  void *(*mmap)(void *addr, size_t length, int prot, int flags, int fd, off_t offset);
  int (*munmap)(void *addr, size_t length);
  int (*mprotect)(void *addr, size_t length, int prot);
  int (*memfd_create)(const char *name, unsigned int flags);
  int (*ftruncate)(int fd, off_t length);
  int (*fstat)(int fd, struct stat *st);
  int (*fcntl)(int fd, int cmd, int arg); /* only the int-argument commands are used */
  int (*close)(int fd);
  int (*getrandom)(void *buf, size_t len, unsigned int flags);
} kvf_sys_table;

/* The active table (the replacement, else the C library's). Never NULL. */
const kvf_sys_table *kvf_sys(void);

/* The C library's table, for wrappers that forward to it. */
const kvf_sys_table *kvf_sys_table_default(void);

/* Make `replacement` active (NULL: back to the C library). Returns the
 * previous replacement. The caller keeps it alive while installed. */
const kvf_sys_table *kvf_sys_table_install(const kvf_sys_table *replacement);

/* KVF_SYS(mmap)(NULL, size, ...) */
#define KVF_SYS(fn) (kvf_sys()->fn)

/* The failing site of a system call: log one warning (subsystem IPC or MEM
 * by the caller's choice), set kvf_last_error() to "<what>: <strerror>" and
 * return KVF_ERR_SYSTEM (or the status `st` the caller maps errno to). */
kvf_status kvf_sys_fail(kvf_status st, int err, const char *what, const char *file, int line);
#define KVF_SYS_FAIL(st, err, what) kvf_sys_fail((st), (err), (what), __FILE__, __LINE__)

/* Close a descriptor through the table. Linux frees the descriptor even when
 * close fails (EINTR, EIO), so a failure is only logged (INFO), never
 * retried. Negative fds are ignored. */
void kvf_sys_close(int fd);

struct msghdr;
/* Take every descriptor a received message carries (SCM_RIGHTS): append
 * them to fds[*count] while *count < max, and close the rest. Returns 1
 * when any had to be closed that way, else 0. Called before the message is
 * judged, so no descriptor stays open on an error path. */
int kvf_sys_take_fds(struct msghdr *msg, int *fds, uint32_t *count, uint32_t max);

#ifdef __cplusplus
}
#endif

#endif /* KVF_HOST_SYSCALLS_H */
