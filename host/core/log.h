/*
 * Internal: logging. Levels and subsystem masks come from the environment,
 * read once per process:
 *   KVF_DEBUG        NONE | WARN | INFO | TRACE (case-insensitive; default WARN)
 *   KVF_DEBUG_SUBSYS comma list of INIT, ENV, GEOM, CUDA, MEM, IPC, XFER,
 *                    SERVER, TOPO or ALL; a leading '^' selects every
 *                    subsystem except the listed ones (default ALL)
 *   KVF_DEBUG_FILE   write here instead of stderr; %h expands to the host
 *                    name, %p to the process id
 * Each line reads "host:pid:tid kvferry LEVEL SUBSYS message". Warnings are
 * never filtered by subsystem. The level and mask are tested before any
 * argument is evaluated or formatted, so a disabled KVF_TRACE costs one load
 * and a compare.
 *
 * Threading: every function here is safe from any thread; one line is
 * written with one write under a lock, so lines never interleave.
 */
#ifndef KVF_HOST_LOG_H
#define KVF_HOST_LOG_H

#include <stdint.h>
#include <stdio.h>

#include <kvferry/status.h>

#include "common/error.h" /* KVF_PRINTF */

#ifdef __cplusplus
extern "C" {
#endif

typedef enum kvf_log_level {
  KVF_LOG_NONE = 0,
  KVF_LOG_WARN = 1,
  KVF_LOG_INFO = 2,
  KVF_LOG_TRACE = 3,
} kvf_log_level;

/* Subsystem bits; a message carries exactly one. */
#define KVF_LOG_INIT (1u << 0)   /* library and driver start-up */
#define KVF_LOG_ENV (1u << 1)    /* KVF_* parameters */
#define KVF_LOG_GEOM (1u << 2)   /* geometry building, JSON, presets */
#define KVF_LOG_CUDA (1u << 3)   /* driver entry points and driver calls */
#define KVF_LOG_MEM (1u << 4)    /* memory providers */
#define KVF_LOG_IPC (1u << 5)    /* sockets, descriptor passing, imports */
#define KVF_LOG_XFER (1u << 6)   /* transfers */
#define KVF_LOG_SERVER (1u << 7) /* server lifecycle, leases */
#define KVF_LOG_TOPO (1u << 8)   /* hwloc placement */
#define KVF_LOG_ALL 0xffffffffu

/* Current level and mask; -1 until the environment has been read. Read with
 * relaxed atomics: a racing reader sees either the old or the new value. */
extern int kvf_log_level_now;
extern uint32_t kvf_log_mask_now;

/* Read the environment (once per process; later calls return at once). */
void kvf_log_init(void);

/* Whether a message of this level and subsystem would be written. */
static inline int kvf_log_enabled(kvf_log_level level, uint32_t subsys) {
  int now = __atomic_load_n(&kvf_log_level_now, __ATOMIC_RELAXED);
  if (now < 0) {
    kvf_log_init();
    now = __atomic_load_n(&kvf_log_level_now, __ATOMIC_RELAXED);
  }
  if ((int)level > now) return 0;
  return level == KVF_LOG_WARN || (__atomic_load_n(&kvf_log_mask_now, __ATOMIC_RELAXED) & subsys) != 0;
}

/* Format and write one line. Call through the macros, which test the level
 * first; calling it directly writes unconditionally. */
void kvf_log_write(kvf_log_level level, uint32_t subsys, const char *file, int line,
                   const char *fmt, ...) KVF_PRINTF(5, 6);

#define KVF_LOG_AT(level, subsys, ...)                                                  \
  do {                                                                                  \
    if (kvf_log_enabled((level), KVF_LOG_##subsys))                                     \
      kvf_log_write((level), KVF_LOG_##subsys, __FILE__, __LINE__, __VA_ARGS__);        \
  } while (0)

/* KVF_WARN(CUDA, "cuMemMap failed: %s", name): subsys is a bare name from the
 * list above. */
#define KVF_WARN(subsys, ...) KVF_LOG_AT(KVF_LOG_WARN, subsys, __VA_ARGS__)
#define KVF_INFO(subsys, ...) KVF_LOG_AT(KVF_LOG_INFO, subsys, __VA_ARGS__)
#define KVF_TRACE(subsys, ...) KVF_LOG_AT(KVF_LOG_TRACE, subsys, __VA_ARGS__)

/* Parse a level name ("warn", "INFO", ...). Returns 0 and sets *out, or -1
 * for an unknown name (NULL or "" is unknown). */
int kvf_log_parse_level(const char *text, kvf_log_level *out);

/* Parse a subsystem list ("IPC,XFER", "^CUDA", "ALL"). Returns 0 and sets
 * *out; returns -1 if any name is unknown, with *out holding the mask of the
 * known names and *bad (may be NULL) pointing at the first unknown one. */
int kvf_log_parse_subsys(const char *text, uint32_t *out, const char **bad);

/* Replace the level and mask (tools' -v flags, tests). Reads the environment
 * first if that has not happened yet, so the override is not undone later. */
void kvf_log_override(kvf_log_level level, uint32_t mask);

/* Send lines to `sink` instead (NULL: back to the KVF_DEBUG_FILE or stderr).
 * The caller keeps ownership of `sink` and must keep it open while set. */
void kvf_log_set_sink(FILE *sink);

#ifdef __cplusplus
}
#endif

#endif /* KVF_HOST_LOG_H */
