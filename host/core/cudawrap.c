/* The CUDA driver entry-point table, loaded once through the runtime. */
#include "host/core/cudawrap.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <kvferry/device.h>

#include "common/error.h"
#include "common/versioned.h"
#include "host/core/log.h"
#include "host/core/param.h"

#ifdef KVF_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

/* Written once by the load routine under kvf_cuda_once, read-only after. */
static pthread_once_t kvf_cuda_once = PTHREAD_ONCE_INIT;
static kvf_status kvf_cuda_load_status = KVF_ERR_INTERNAL;
static char kvf_cuda_load_message[256] = "CUDA driver not loaded yet";
static int kvf_cuda_loaded_driver_version;

#ifdef KVF_WITH_CUDA

static kvf_cuda_table kvf_cuda_driver_table;
/* The replacement table (tests), or NULL; read and written atomically. */
static const kvf_cuda_table *kvf_cuda_replacement;

const kvf_cuda_table *kvf_cuda(void) {
  const kvf_cuda_table *t = __atomic_load_n(&kvf_cuda_replacement, __ATOMIC_ACQUIRE);
  return t ? t : &kvf_cuda_driver_table;
}

const kvf_cuda_table *kvf_cuda_table_driver(void) { return &kvf_cuda_driver_table; }

const kvf_cuda_table *kvf_cuda_table_install(const kvf_cuda_table *replacement) {
  return __atomic_exchange_n(&kvf_cuda_replacement, replacement, __ATOMIC_ACQ_REL);
}

kvf_status kvf_cu_status(CUresult result) {
  switch (result) {
  case CUDA_SUCCESS: return KVF_SUCCESS;
  case CUDA_ERROR_NO_DEVICE: return KVF_ERR_NO_DEVICE;
  case CUDA_ERROR_NOT_INITIALIZED:
  case CUDA_ERROR_DEINITIALIZED:
  case CUDA_ERROR_CALL_REQUIRES_NEWER_DRIVER:
  case CUDA_ERROR_STUB_LIBRARY:
  case CUDA_ERROR_SYSTEM_DRIVER_MISMATCH:
  case CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE: return KVF_ERR_NO_DRIVER;
  case CUDA_ERROR_NOT_SUPPORTED: return KVF_ERR_UNSUPPORTED;
  default: return KVF_ERR_CUDA;
  }
}

const char *kvf_cu_describe(CUresult result, char *buf, size_t cap) {
  const kvf_cuda_table *t = kvf_cuda();
  const char *name = NULL, *text = NULL;
  /* The driver's own strings when it is there; the number otherwise. */
  if (t->cuGetErrorName == NULL || t->cuGetErrorName(result, &name) != CUDA_SUCCESS) name = NULL;
  if (t->cuGetErrorString == NULL || t->cuGetErrorString(result, &text) != CUDA_SUCCESS) text = NULL;
  if (name != NULL && text != NULL)
    snprintf(buf, cap, "%s (%s)", name, text);
  else if (name != NULL)
    snprintf(buf, cap, "%s", name);
  else
    snprintf(buf, cap, "CUresult %d", (int)result);
  return buf;
}

kvf_status kvf_cu_fail(CUresult result, const char *fn, const char *file, int line) {
  char what[192];
  kvf_cu_describe(result, what, sizeof what);
  const char *base = strrchr(file, '/');
  KVF_WARN(CUDA, "%s failed: %s at %s:%d", fn, what, base ? base + 1 : file, line);
  return kvf_fail(kvf_cu_status(result), "%s: %s", fn, what);
}

/* Map a runtime error met while looking up entry points. */
static kvf_status kvf_cudart_status(cudaError_t e) {
  switch (e) {
  case cudaSuccess: return KVF_SUCCESS;
  case cudaErrorNoDevice: return KVF_ERR_NO_DEVICE;
  case cudaErrorInsufficientDriver:
  case cudaErrorStubLibrary:
  case cudaErrorCallRequiresNewerDriver:
  case cudaErrorSystemDriverMismatch:
  case cudaErrorCompatNotSupportedOnDevice:
  case cudaErrorInitializationError: return KVF_ERR_NO_DRIVER;
  default: return KVF_ERR_CUDA;
  }
}

/* Record the load result; the message is replayed into each caller's
 * kvf_last_error(). */
static void kvf_cuda_set_result(kvf_status st, const char *fmt, ...) KVF_PRINTF(2, 3);
static void kvf_cuda_set_result(kvf_status st, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(kvf_cuda_load_message, sizeof kvf_cuda_load_message, fmt, ap);
  va_end(ap);
  kvf_cuda_load_status = st;
}

/* The runtime refuses lookups when it cannot initialize, most often because
 * no device is visible (CUDA_VISIBLE_DEVICES="", say): say that plainly. */
static void kvf_cuda_lookup_failed(cudaError_t e, const char *symbol, int drv) {
  const char *visible = getenv("CUDA_VISIBLE_DEVICES");
  if (e == cudaErrorNoDevice)
    kvf_cuda_set_result(KVF_ERR_NO_DEVICE, "CUDA driver %d.%d found but no device is visible%s%.64s%s",
                        drv / 1000, drv % 1000 / 10, visible ? " (CUDA_VISIBLE_DEVICES='" : "",
                        visible ? visible : "", visible ? "')" : "");
  else
    kvf_cuda_set_result(kvf_cudart_status(e), "looking up %s in the CUDA driver: %s (%s)", symbol,
                        cudaGetErrorName(e), cudaGetErrorString(e));
}

static void kvf_cuda_load_once(void) {
  kvf_cuda_table t;
  int drv = 0;
  int count = 0;
  char what[192];
  CUresult r;

  memset(&t, 0, sizeof t);
  if (kvf_param_cuda_disable() != 0) {
    kvf_cuda_set_result(KVF_ERR_NO_DRIVER, "CUDA disabled by KVF_CUDA_DISABLE=%lld",
                        (long long)kvf_param_cuda_disable());
    goto out;
  }

  /* Reports 0 (not an error) when libcuda.so.1 cannot be loaded. */
  cudaError_t e = cudaDriverGetVersion(&drv);
  if (e != cudaSuccess || drv <= 0) {
    kvf_cuda_set_result(KVF_ERR_NO_DRIVER, "no CUDA driver found (libcuda.so.1 could not be loaded)");
    goto out;
  }
  kvf_cuda_loaded_driver_version = drv;
  /* The static runtime needs a driver of its own major version or newer. */
  if (drv / 1000 < CUDART_VERSION / 1000) {
    kvf_cuda_set_result(KVF_ERR_NO_DRIVER,
                        "the CUDA driver supports CUDA %d.%d; kvferry was built with CUDA %d.%d and needs a "
                        "driver for CUDA %d.0 or newer",
                        drv / 1000, drv % 1000 / 10, CUDART_VERSION / 1000, CUDART_VERSION % 1000 / 10,
                        CUDART_VERSION / 1000);
    goto out;
  }

#define KVF_CUDA_LOOKUP_X(member, symbol, type)                                                          \
  {                                                                                                      \
    void *fn = NULL;                                                                                     \
    enum cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;                         \
    e = cudaGetDriverEntryPointByVersion(symbol, &fn, KVF_CUDA_ENTRY_VERSION, cudaEnableDefault, &q);    \
    if (e != cudaSuccess) {                                                                              \
      kvf_cuda_lookup_failed(e, symbol, drv);                                                            \
      goto out;                                                                                          \
    }                                                                                                    \
    if (q != cudaDriverEntryPointSuccess || fn == NULL) {                                                \
      kvf_cuda_set_result(KVF_ERR_NO_DRIVER, "the CUDA driver (CUDA %d.%d) has no %s for the CUDA %d.%d ABI", \
                          drv / 1000, drv % 1000 / 10, symbol, KVF_CUDA_ENTRY_VERSION / 1000,            \
                          KVF_CUDA_ENTRY_VERSION % 1000 / 10);                                           \
      goto out;                                                                                          \
    }                                                                                                    \
    t.member = (type)fn;                                                                                 \
  }
  KVF_CUDA_ENTRY_POINTS(KVF_CUDA_LOOKUP_X)
#undef KVF_CUDA_LOOKUP_X

  /* Publish the table before calling through it, so error names resolve. */
  kvf_cuda_driver_table = t;

  r = t.cuInit(0);
  if (r != CUDA_SUCCESS) {
    kvf_cuda_set_result(kvf_cu_status(r), "cuInit: %s", kvf_cu_describe(r, what, sizeof what));
    goto out;
  }
  r = t.cuDeviceGetCount(&count);
  if (r != CUDA_SUCCESS) {
    kvf_cuda_set_result(kvf_cu_status(r), "cuDeviceGetCount: %s", kvf_cu_describe(r, what, sizeof what));
    goto out;
  }
  if (count <= 0) {
    kvf_cuda_set_result(KVF_ERR_NO_DEVICE, "CUDA driver %d.%d found but no device is visible", drv / 1000,
                        drv % 1000 / 10);
    goto out;
  }
  kvf_cuda_set_result(KVF_SUCCESS, "CUDA driver %d.%d, %d device%s", drv / 1000, drv % 1000 / 10, count,
                      count == 1 ? "" : "s");

out:
  if (kvf_cuda_load_status == KVF_SUCCESS)
    KVF_INFO(INIT, "%s", kvf_cuda_load_message);
  else
    KVF_INFO(INIT, "CUDA unavailable: %s", kvf_cuda_load_message);
}

kvf_status kvf_cuda_ready(void) {
  if (__atomic_load_n(&kvf_cuda_replacement, __ATOMIC_ACQUIRE) != NULL) return KVF_SUCCESS;
  return kvf_cuda_load();
}

#else /* !KVF_WITH_CUDA */

static void kvf_cuda_load_once(void) {
  kvf_cuda_load_status = KVF_ERR_NO_DRIVER;
  snprintf(kvf_cuda_load_message, sizeof kvf_cuda_load_message,
           "this build of kvferry has no CUDA support (configured with KVF_WITH_CUDA=OFF or without nvcc)");
}

kvf_status kvf_cuda_ready(void) { return kvf_cuda_load(); }

#endif /* KVF_WITH_CUDA */

kvf_status kvf_cuda_load(void) {
  pthread_once(&kvf_cuda_once, kvf_cuda_load_once);
  if (kvf_cuda_load_status != KVF_SUCCESS) return kvf_fail(kvf_cuda_load_status, "%s", kvf_cuda_load_message);
  return KVF_SUCCESS;
}

int kvf_cuda_driver_version(void) {
  pthread_once(&kvf_cuda_once, kvf_cuda_load_once);
  return kvf_cuda_loaded_driver_version;
}

/* ---- kvf_cuda_probe ----------------------------------------------------- */

#ifdef KVF_WITH_CUDA
/* Ask the active table (the driver's or a test's) what is there now. */
static kvf_status kvf_cuda_probe_table(kvf_cuda_info *info) {
  const kvf_cuda_table *t = kvf_cuda();
  char what[192];
  int drv = 0, count = 0;
  CUresult r = t->cuInit(0);
  if (r != CUDA_SUCCESS) {
    snprintf(info->message, sizeof info->message, "cuInit: %s", kvf_cu_describe(r, what, sizeof what));
    return kvf_cu_status(r);
  }
  r = t->cuDriverGetVersion(&drv);
  if (r != CUDA_SUCCESS) {
    snprintf(info->message, sizeof info->message, "cuDriverGetVersion: %s", kvf_cu_describe(r, what, sizeof what));
    return kvf_cu_status(r);
  }
  info->driver_version = drv;
  r = t->cuDeviceGetCount(&count);
  if (r != CUDA_SUCCESS) {
    snprintf(info->message, sizeof info->message, "cuDeviceGetCount: %s", kvf_cu_describe(r, what, sizeof what));
    return kvf_cu_status(r);
  }
  if (count <= 0) {
    snprintf(info->message, sizeof info->message, "CUDA driver %d.%d found but no device is visible",
             drv / 1000, drv % 1000 / 10);
    return KVF_ERR_NO_DEVICE;
  }
  info->device_count = count;

  /* Name the first device; a failure here only shortens the message. */
  char name[96] = "";
  CUdevice dev;
  if (t->cuDeviceGet(&dev, 0) != CUDA_SUCCESS || t->cuDeviceGetName(name, (int)sizeof name, dev) != CUDA_SUCCESS)
    name[0] = '\0';
  name[sizeof name - 1] = '\0';
  snprintf(info->message, sizeof info->message, "CUDA driver %d.%d, runtime %d.%d, %d device%s%s%s%s", drv / 1000,
           drv % 1000 / 10, CUDART_VERSION / 1000, CUDART_VERSION % 1000 / 10, count, count == 1 ? "" : "s",
           name[0] ? " (0: " : "", name, name[0] ? ")" : "");
  return KVF_SUCCESS;
}
#endif

kvf_status kvf_cuda_probe(kvf_cuda_info *out) {
  if (out == NULL) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_cuda_probe: out is NULL");
  kvf_status vs = KVF_VERSIONED_CHECK(kvf_cuda_info, out);
  if (vs != KVF_SUCCESS) return vs;

  kvf_cuda_info info = KVF_CUDA_INFO_INIT;
  kvf_status st = kvf_cuda_ready();
#ifdef KVF_WITH_CUDA
  info.runtime_version = CUDART_VERSION;
  if (st == KVF_SUCCESS) st = kvf_cuda_probe_table(&info);
  else
#endif
  {
    info.driver_version = kvf_cuda_driver_version();
    snprintf(info.message, sizeof info.message, "%s", kvf_last_error());
  }

  /* Filled on failure too (kvferry/device.h). */
  (void)KVF_VERSIONED_OUT(kvf_cuda_info, out, &info);
  if (st != KVF_SUCCESS) return kvf_fail(st, "%s", info.message);
  return KVF_SUCCESS;
}
