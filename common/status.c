/* Status names, the thread-local detail message, and the run-time version. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include <kvferry/status.h>
#include <kvferry/version.h>

#include "common/error.h"

#define KVF_ERROR_MAX 1024

/* One message per thread: a failure on one thread never clobbers another's. */
static _Thread_local char kvf_error_message[KVF_ERROR_MAX];

const char *kvf_status_string(kvf_status status) {
  switch (status) {
  case KVF_SUCCESS: return "success";
  case KVF_ERR_INVALID_ARGUMENT: return "invalid argument";
  case KVF_ERR_INVALID_GEOMETRY: return "invalid geometry";
  case KVF_ERR_OUT_OF_MEMORY: return "out of memory";
  case KVF_ERR_OVERFLOW: return "integer overflow";
  case KVF_ERR_NOT_FOUND: return "not found";
  case KVF_ERR_PARSE: return "parse error";
  case KVF_ERR_IO: return "I/O error";
  case KVF_ERR_NO_DRIVER: return "no CUDA driver";
  case KVF_ERR_NO_DEVICE: return "no CUDA device";
  case KVF_ERR_CUDA: return "CUDA error";
  case KVF_ERR_UNSUPPORTED: return "unsupported";
  case KVF_ERR_GEOMETRY_MISMATCH: return "geometry mismatch";
  case KVF_ERR_STATE: return "wrong state";
  case KVF_ERR_SYSTEM: return "system error";
  case KVF_ERR_INTERNAL: return "internal error";
  case KVF_ERR_TIMEOUT: return "timed out";
  case KVF_ERR_BUSY: return "busy";
  case KVF_ERR_PROTOCOL: return "protocol error";
  case KVF_ERR_PERMISSION: return "permission denied";
  case KVF_ERR_DISCONNECTED: return "disconnected";
  }
  return "unknown status";
}

const char *kvf_last_error(void) { return kvf_error_message; }

kvf_status kvf_fail(kvf_status status, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(kvf_error_message, sizeof kvf_error_message, fmt, ap);
  va_end(ap);
  return status;
}

void kvf_error_prefix(const char *fmt, ...) {
  char prefix[256];
  char old[KVF_ERROR_MAX];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(prefix, sizeof prefix, fmt, ap);
  va_end(ap);
  memcpy(old, kvf_error_message, sizeof old);
  /* Prefix, then as much of the old message as fits (truncation is fine). */
  size_t n = strlen(prefix), m = strlen(old);
  if (n > KVF_ERROR_MAX - 1) n = KVF_ERROR_MAX - 1;
  if (m > KVF_ERROR_MAX - 1 - n) m = KVF_ERROR_MAX - 1 - n;
  memcpy(kvf_error_message, prefix, n);
  memcpy(kvf_error_message + n, old, m);
  kvf_error_message[n + m] = '\0';
}

unsigned kvf_version(void) { return KVF_VERSION_NUMBER; }

const char *kvf_version_string(void) { return KVF_VERSION_STRING; }
