/* Tunables from KVF_* environment variables, read once. */
#include "host/core/param.h"

#include <ctype.h>
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>

#include "host/core/log.h"

/* Serializes first reads so each variable is parsed (and warned about) once. */
static pthread_mutex_t kvf_param_lock = PTHREAD_MUTEX_INITIALIZER;

int kvf_param_parse_int(const char *text, int64_t *out) {
  if (text == NULL) return -1;
  while (isspace((unsigned char)*text)) text++;
  /* Decimal only: strtoll's base 0 would read "010" as 8. */
  const char *digits = text + (*text == '+' || *text == '-');
  if (!isdigit((unsigned char)*digits)) return -1;
  char *end = NULL;
  errno = 0;
  long long v = strtoll(text, &end, 10);
  if (errno == ERANGE) return -1;
  while (isspace((unsigned char)*end)) end++;
  if (*end != '\0') return -1;
  if ((int64_t)v == KVF_PARAM_UNSET) return -1;
  *out = (int64_t)v;
  return 0;
}

int64_t kvf_param_read(const char *env, int64_t deflt) {
  const char *text = getenv(env);
  int64_t v;
  if (text == NULL || *text == '\0') return deflt;
  if (kvf_param_parse_int(text, &v) != 0) {
    KVF_WARN(ENV, "%s='%.64s' is not a decimal integer; using the default %lld", env, text, (long long)deflt);
    return deflt;
  }
  KVF_INFO(ENV, "%s set to %lld", env, (long long)v);
  return v;
}

void kvf_param_load(const char *env, int64_t deflt, int64_t *cache) {
  pthread_mutex_lock(&kvf_param_lock);
  if (__atomic_load_n(cache, __ATOMIC_ACQUIRE) == KVF_PARAM_UNSET)
    __atomic_store_n(cache, kvf_param_read(env, deflt), __ATOMIC_RELEASE);
  pthread_mutex_unlock(&kvf_param_lock);
}

#define KVF_PARAM_DEFINE_X(name, env, deflt, desc) KVF_PARAM(name, env, deflt)
KVF_PARAM_LIST(KVF_PARAM_DEFINE_X)
#undef KVF_PARAM_DEFINE_X

#define KVF_STR_(x) #x
#define KVF_STR(x) KVF_STR_(x)
#define KVF_PARAM_ROW_X(name, env, deflt, desc) {env, "int", KVF_STR(deflt), desc},

static const kvf_param_info kvf_params[] = {
    {"KVF_DEBUG", "string", "WARN", "log level: NONE, WARN, INFO or TRACE"},
    {"KVF_DEBUG_SUBSYS", "string", "ALL",
     "subsystems to log (INIT, ENV, GEOM, CUDA, MEM, IPC, XFER, SERVER, TOPO, ALL); a leading ^ excludes "
     "the listed ones; warnings are always shown"},
    {"KVF_DEBUG_FILE", "string", "(stderr)", "append log lines to this file; %h expands to the host, %p to the pid"},
    KVF_PARAM_LIST(KVF_PARAM_ROW_X)
};

const kvf_param_info *kvf_param_table(size_t *count) {
  if (count) *count = sizeof kvf_params / sizeof kvf_params[0];
  return kvf_params;
}
