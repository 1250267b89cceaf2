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
/* a rounded up to a multiple of m (m > 0); false when that passes 2^64 - 1. */
static inline int kvf_round_up_u64(uint64_t a, uint64_t m, uint64_t *out) {
  uint64_t q = a / m;
  if (a % m == 0) {
    *out = a;
    return 1;
  }
  return q + 1 != 0 && kvf_mul_u64(q + 1, m, out);
}
/* ceil(a / m) for m > 0, without the overflow of (a + m - 1) / m. */
static inline uint64_t kvf_div_up_u64(uint64_t a, uint64_t m) { return a / m + (a % m != 0); }

#endif
