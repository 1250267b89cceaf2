/* Logging: levels and subsystem masks from KVF_DEBUG*, read once. */
#define _GNU_SOURCE
#include "host/core/log.h"

#include <ctype.h>
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/syscall.h>
#include <unistd.h>

int kvf_log_level_now = -1;
uint32_t kvf_log_mask_now = KVF_LOG_ALL;

static pthread_once_t kvf_log_once = PTHREAD_ONCE_INIT;
/* Guards kvf_log_env_file and kvf_log_sink, and serializes writes so lines
 * from different threads never interleave. */
static pthread_mutex_t kvf_log_lock = PTHREAD_MUTEX_INITIALIZER;
static FILE *kvf_log_env_file; /* opened from KVF_DEBUG_FILE; never closed (lives until exit) */
static FILE *kvf_log_sink;     /* kvf_log_set_sink(); wins over the env file */
static char kvf_log_host[64] = "unknown";

static const char *const kvf_level_names[] = {"NONE", "WARN", "INFO", "TRACE"};

static const struct {
  const char *name;
  uint32_t bit;
} kvf_subsys_names[] = {
    {"INIT", KVF_LOG_INIT}, {"ENV", KVF_LOG_ENV},   {"GEOM", KVF_LOG_GEOM},
    {"CUDA", KVF_LOG_CUDA}, {"MEM", KVF_LOG_MEM},   {"IPC", KVF_LOG_IPC},
    {"XFER", KVF_LOG_XFER}, {"SERVER", KVF_LOG_SERVER}, {"TOPO", KVF_LOG_TOPO},
    {"ALL", KVF_LOG_ALL},
};

int kvf_log_parse_level(const char *text, kvf_log_level *out) {
  if (text == NULL) return -1;
  for (int i = 0; i < 4; i++) {
    if (strcasecmp(text, kvf_level_names[i]) == 0) {
      *out = (kvf_log_level)i;
      return 0;
    }
  }
  return -1;
}

int kvf_log_parse_subsys(const char *text, uint32_t *out, const char **bad) {
  uint32_t mask = 0;
  int invert = 0;
  int rc = 0;
  if (bad) *bad = NULL;
  if (text == NULL) {
    *out = KVF_LOG_ALL;
    return 0;
  }
  if (*text == '^') {
    invert = 1;
    text++;
  }
  const char *p = text;
  while (*p != '\0') {
    const char *end = strchr(p, ',');
    size_t len = end ? (size_t)(end - p) : strlen(p);
    /* Tolerate spaces around names ("IPC, XFER"). */
    const char *s = p;
    size_t n = len;
    while (n > 0 && isspace((unsigned char)*s)) { s++; n--; }
    while (n > 0 && isspace((unsigned char)s[n - 1])) n--;
    if (n > 0) {
      int found = 0;
      for (size_t i = 0; i < sizeof kvf_subsys_names / sizeof kvf_subsys_names[0]; i++) {
        if (strlen(kvf_subsys_names[i].name) == n && strncasecmp(s, kvf_subsys_names[i].name, n) == 0) {
          mask |= kvf_subsys_names[i].bit;
          found = 1;
          break;
        }
      }
      if (!found && rc == 0) {
        rc = -1;
        if (bad) *bad = s;
      }
    }
    if (end == NULL) break;
    p = end + 1;
  }
  *out = invert ? ~mask : mask;
  return rc;
}

static const char *kvf_subsys_name(uint32_t bit) {
  for (size_t i = 0; i < sizeof kvf_subsys_names / sizeof kvf_subsys_names[0]; i++)
    if (kvf_subsys_names[i].bit == bit) return kvf_subsys_names[i].name;
  return "?";
}

/* Expand %h (host) and %p (pid) in a KVF_DEBUG_FILE pattern. */
static void kvf_log_expand_path(const char *pattern, char *out, size_t cap) {
  size_t o = 0;
  for (const char *p = pattern; *p != '\0' && o + 1 < cap; p++) {
    char piece[64];
    const char *add = NULL;
    if (p[0] == '%' && p[1] == 'h') {
      add = kvf_log_host;
    } else if (p[0] == '%' && p[1] == 'p') {
      snprintf(piece, sizeof piece, "%ld", (long)getpid());
      add = piece;
    }
    if (add != NULL) {
      p++;
      for (; *add != '\0' && o + 1 < cap; add++) out[o++] = *add;
    } else {
      out[o++] = *p;
    }
  }
  out[o] = '\0';
}

static void kvf_log_init_once(void) {
  char warn1[256] = "", warn2[256] = "", warn3[512] = "";
  kvf_log_level level = KVF_LOG_WARN;
  uint32_t mask = KVF_LOG_ALL;

  if (gethostname(kvf_log_host, sizeof kvf_log_host - 1) != 0) strcpy(kvf_log_host, "unknown");
  kvf_log_host[sizeof kvf_log_host - 1] = '\0';
  char *dot = strchr(kvf_log_host, '.');
  if (dot) *dot = '\0';

  const char *env = getenv("KVF_DEBUG");
  if (env != NULL && *env != '\0' && kvf_log_parse_level(env, &level) != 0) {
    level = KVF_LOG_WARN;
    snprintf(warn1, sizeof warn1, "KVF_DEBUG='%.64s' is not NONE, WARN, INFO or TRACE; using WARN", env);
  }
  env = getenv("KVF_DEBUG_SUBSYS");
  if (env != NULL && *env != '\0') {
    const char *bad = NULL;
    if (kvf_log_parse_subsys(env, &mask, &bad) != 0)
      snprintf(warn2, sizeof warn2, "KVF_DEBUG_SUBSYS: unknown subsystem in '%.64s' (at '%.16s'); ignoring it",
               env, bad ? bad : "");
  }
  env = getenv("KVF_DEBUG_FILE");
  if (env != NULL && *env != '\0') {
    char path[4096];
    kvf_log_expand_path(env, path, sizeof path);
    FILE *f = fopen(path, "ae"); /* e: O_CLOEXEC, so exec'd children do not inherit it */
    if (f == NULL) {
      snprintf(warn3, sizeof warn3, "KVF_DEBUG_FILE: cannot open '%.256s' (%s); logging to stderr", path,
               strerror(errno));
    } else {
      setvbuf(f, NULL, _IOLBF, 0);
      pthread_mutex_lock(&kvf_log_lock);
      kvf_log_env_file = f;
      pthread_mutex_unlock(&kvf_log_lock);
    }
  }

  __atomic_store_n(&kvf_log_mask_now, mask, __ATOMIC_RELAXED);
  __atomic_store_n(&kvf_log_level_now, (int)level, __ATOMIC_RELAXED);

  /* Written directly: the macros would re-enter this once-routine. */
  if (level >= KVF_LOG_WARN) {
    if (warn1[0]) kvf_log_write(KVF_LOG_WARN, KVF_LOG_ENV, __FILE__, __LINE__, "%s", warn1);
    if (warn2[0]) kvf_log_write(KVF_LOG_WARN, KVF_LOG_ENV, __FILE__, __LINE__, "%s", warn2);
    if (warn3[0]) kvf_log_write(KVF_LOG_WARN, KVF_LOG_ENV, __FILE__, __LINE__, "%s", warn3);
  }
}

void kvf_log_init(void) { pthread_once(&kvf_log_once, kvf_log_init_once); }

void kvf_log_override(kvf_log_level level, uint32_t mask) {
  kvf_log_init();
  __atomic_store_n(&kvf_log_mask_now, mask, __ATOMIC_RELAXED);
  __atomic_store_n(&kvf_log_level_now, (int)level, __ATOMIC_RELAXED);
}

void kvf_log_set_sink(FILE *sink) {
  kvf_log_init();
  pthread_mutex_lock(&kvf_log_lock);
  kvf_log_sink = sink;
  pthread_mutex_unlock(&kvf_log_lock);
}

void kvf_log_write(kvf_log_level level, uint32_t subsys, const char *file, int line, const char *fmt, ...) {
  char buf[2048];
  int saved_errno = errno; /* logging must not disturb the caller's errno */
  int lv = (int)level;
  if (lv < 0 || lv > 3) lv = 1;
  int n = snprintf(buf, sizeof buf, "%s:%ld:%ld kvferry %s %s ", kvf_log_host, (long)getpid(),
                   (long)syscall(SYS_gettid), kvf_level_names[lv], kvf_subsys_name(subsys));
  if (level == KVF_LOG_TRACE && file != NULL && n > 0 && (size_t)n < sizeof buf) {
    const char *base = strrchr(file, '/');
    n += snprintf(buf + n, sizeof buf - (size_t)n, "%s:%d ", base ? base + 1 : file, line);
  }
  if (n < 0) n = 0;
  if ((size_t)n >= sizeof buf - 2) n = (int)sizeof buf - 2;
  va_list ap;
  va_start(ap, fmt);
  int m = vsnprintf(buf + n, sizeof buf - 1 - (size_t)n, fmt, ap);
  va_end(ap);
  size_t len = (size_t)n + (m > 0 ? (size_t)m : 0);
  if (len > sizeof buf - 2) len = sizeof buf - 2; /* truncated message */
  buf[len++] = '\n';

  pthread_mutex_lock(&kvf_log_lock);
  FILE *out = kvf_log_sink ? kvf_log_sink : kvf_log_env_file ? kvf_log_env_file : stderr;
  fwrite(buf, 1, len, out);
  fflush(out);
  pthread_mutex_unlock(&kvf_log_lock);
  errno = saved_errno;
}
