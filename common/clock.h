/* Internal: the monotonic clock every layer reads (deadlines, heartbeats,
 * timeouts). CLOCK_MONOTONIC never jumps with the wall clock; condition
 * variables that wait on it must be created with pthread_condattr_setclock. */
#ifndef KVF_COMMON_CLOCK_H
#define KVF_COMMON_CLOCK_H

#include <stdint.h>
#include <time.h>

/* Nanoseconds on the monotonic clock. */
static inline uint64_t kvf_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Milliseconds on the monotonic clock. */
static inline int64_t kvf_now_ms(void) { return (int64_t)(kvf_now_ns() / 1000000ull); }

/* A monotonic time in milliseconds as the timespec pthread_cond_timedwait takes. */
static inline struct timespec kvf_timespec_ms(int64_t ms) {
  struct timespec ts = {(time_t)(ms / 1000), (long)(ms % 1000) * 1000000L};
  return ts;
}

#endif /* KVF_COMMON_CLOCK_H */
