/* Internal: the thread-local detail message behind kvf_last_error(). Every
 * layer of the library reports failures through kvf_fail(). */
#ifndef KVF_COMMON_ERROR_H
#define KVF_COMMON_ERROR_H

#include <kvferry/status.h>

#if defined(__GNUC__)
#  define KVF_PRINTF(fmt_index, first_arg) __attribute__((format(printf, fmt_index, first_arg)))
#else
#  define KVF_PRINTF(fmt_index, first_arg)
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Replace the calling thread's detail message and return `status`, so a
 * failing site reads `return kvf_fail(KVF_ERR_..., "field 'x': ...", ...);`. */
kvf_status kvf_fail(kvf_status status, const char *fmt, ...) KVF_PRINTF(2, 3);

/* Prepend a short trail ("loading geometry.json: ") to the current message. */
void kvf_error_prefix(const char *fmt, ...) KVF_PRINTF(1, 2);

#ifdef __cplusplus
}
#endif

/* Checked arithmetic: return false on unsigned 64-bit overflow. */
static inline int kvf_mul_u64(uint64_t a, uint64_t b, uint64_t *out) {
  return !__builtin_mul_overflow(a, b, out);
}
static inline int kvf_add_u64(uint64_t a, uint64_t b, uint64_t *out) {
  return !__builtin_add_overflow(a, b, out);
}

#endif
