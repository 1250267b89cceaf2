/*
 * Internal: the CUDA driver, reached only through one table of entry points.
 *
 * kvferry never links libcuda: the table is filled at run time through the
 * CUDA runtime's cudaGetDriverEntryPointByVersion (the runtime is linked
 * statically), so the library loads on machines without a driver and says so
 * with KVF_ERR_NO_DRIVER instead of failing to load. Every driver call goes
 * through KVF_CU(fn), which reads the active table; tests install a wrapped
 * copy (kvf_cuda_table_install) to fail the k-th call or to fake a driver.
 *
 * Built without KVF_WITH_CUDA, only kvf_cuda_load() and kvf_cuda_ready()
 * exist and both return KVF_ERR_NO_DRIVER.
 *
 * Threading: loading runs once per process (pthread_once) and is safe from
 * any thread. Installing a replacement table is not synchronized with calls
 * in flight: install it before the code under test runs and restore it after.
 */
#ifndef KVF_HOST_CUDAWRAP_H
#define KVF_HOST_CUDAWRAP_H

#include <kvferry/status.h>

#ifdef KVF_WITH_CUDA
#include <cuda.h>
#include <cudaTypedefs.h>
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Load the driver entry points, cuInit(0) and count the devices, once per
 * process; later calls return the same result. Returns KVF_SUCCESS,
 * KVF_ERR_NO_DRIVER (no driver, too old, KVF_CUDA_DISABLE=1, or a build
 * without CUDA), KVF_ERR_NO_DEVICE (no visible device) or KVF_ERR_CUDA; on
 * failure the calling thread's kvf_last_error() says why. */
kvf_status kvf_cuda_load(void);

/* KVF_SUCCESS when driver calls may be made through KVF_CU: a replacement
 * table is installed, or kvf_cuda_load() succeeded. Otherwise the status and
 * message of kvf_cuda_load(). */
kvf_status kvf_cuda_ready(void);

/* The driver's CUDA version seen while loading (1000*major + 10*minor), 0 if
 * no driver was found or loading has not run. */
int kvf_cuda_driver_version(void);

#ifdef KVF_WITH_CUDA

/* The ABI every entry point is requested at. The typedefs below are the
 * newest versions of these functions as of CUDA 12.0, so asking for 12.0
 * pins exactly those signatures even on newer drivers. */
#define KVF_CUDA_ENTRY_VERSION 12000

/* X(member, "symbol", PFN type) for every driver function kvferry calls.
 * Members are named after the function; cuda.h's _v2 renaming macros apply
 * to the member names and to KVF_CU(fn) alike, so they always agree. */
#define KVF_CUDA_ENTRY_POINTS(X)                                                        \
  X(cuInit, "cuInit", PFN_cuInit_v2000)                                                 \
  X(cuDriverGetVersion, "cuDriverGetVersion", PFN_cuDriverGetVersion_v2020)             \
  X(cuGetErrorString, "cuGetErrorString", PFN_cuGetErrorString_v6000)                   \
  X(cuGetErrorName, "cuGetErrorName", PFN_cuGetErrorName_v6000)                         \
  X(cuDeviceGetCount, "cuDeviceGetCount", PFN_cuDeviceGetCount_v2000)                   \
  X(cuDeviceGet, "cuDeviceGet", PFN_cuDeviceGet_v2000)                                  \
  X(cuDeviceGetAttribute, "cuDeviceGetAttribute", PFN_cuDeviceGetAttribute_v2000)       \
  X(cuDeviceGetName, "cuDeviceGetName", PFN_cuDeviceGetName_v2000)                      \
  X(cuDeviceGetUuid, "cuDeviceGetUuid", PFN_cuDeviceGetUuid_v11040)                     \
  X(cuCtxGetCurrent, "cuCtxGetCurrent", PFN_cuCtxGetCurrent_v4000)                      \
  X(cuCtxSetCurrent, "cuCtxSetCurrent", PFN_cuCtxSetCurrent_v4000)                      \
  X(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", PFN_cuDevicePrimaryCtxRetain_v7000) \
  X(cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease", PFN_cuDevicePrimaryCtxRelease_v11000) \
  X(cuMemCreate, "cuMemCreate", PFN_cuMemCreate_v10020)                                 \
  X(cuMemRelease, "cuMemRelease", PFN_cuMemRelease_v10020)                              \
  X(cuMemAddressReserve, "cuMemAddressReserve", PFN_cuMemAddressReserve_v10020)         \
  X(cuMemAddressFree, "cuMemAddressFree", PFN_cuMemAddressFree_v10020)                  \
  X(cuMemMap, "cuMemMap", PFN_cuMemMap_v10020)                                          \
  X(cuMemUnmap, "cuMemUnmap", PFN_cuMemUnmap_v10020)                                    \
  X(cuMemSetAccess, "cuMemSetAccess", PFN_cuMemSetAccess_v10020)                        \
  X(cuMemGetAllocationGranularity, "cuMemGetAllocationGranularity",                     \
    PFN_cuMemGetAllocationGranularity_v10020)                                           \
  X(cuMemExportToShareableHandle, "cuMemExportToShareableHandle",                       \
    PFN_cuMemExportToShareableHandle_v10020)                                            \
  X(cuMemImportFromShareableHandle, "cuMemImportFromShareableHandle",                   \
    PFN_cuMemImportFromShareableHandle_v10020)                                          \
  X(cuMemGetAddressRange, "cuMemGetAddressRange", PFN_cuMemGetAddressRange_v3020)       \
  X(cuMemRetainAllocationHandle, "cuMemRetainAllocationHandle",                         \
    PFN_cuMemRetainAllocationHandle_v11000)                                             \
  X(cuMemGetAllocationPropertiesFromHandle, "cuMemGetAllocationPropertiesFromHandle",   \
    PFN_cuMemGetAllocationPropertiesFromHandle_v10020)                                 \
  X(cuStreamWaitValue64, "cuStreamWaitValue64", PFN_cuStreamWaitValue64_v11070)         \
  X(cuStreamWriteValue64, "cuStreamWriteValue64", PFN_cuStreamWriteValue64_v11070)

typedef struct kvf_cuda_table {
#define KVF_CUDA_MEMBER_X(member, symbol, type) type member;
  KVF_CUDA_ENTRY_POINTS(KVF_CUDA_MEMBER_X)
#undef KVF_CUDA_MEMBER_X
} kvf_cuda_table;

/* The table driver calls go through: the installed replacement, else the
 * table loaded from the driver (entries may be NULL unless kvf_cuda_load()
 * succeeded: check kvf_cuda_ready() first). Never NULL. */
const kvf_cuda_table *kvf_cuda(void);

/* The table as loaded from the driver, for wrappers that forward to it.
 * Entries may be NULL unless kvf_cuda_load() succeeded. */
const kvf_cuda_table *kvf_cuda_table_driver(void);

/* Make `replacement` the active table (NULL: back to the driver's). Returns
 * the previous replacement (NULL if none). The caller keeps ownership and
 * keeps it alive while installed. */
const kvf_cuda_table *kvf_cuda_table_install(const kvf_cuda_table *replacement);

/* Call a driver function through the active table: KVF_CU(cuMemMap)(...). */
#define KVF_CU(fn) (kvf_cuda()->fn)

/* Map a CUresult to a kvf_status: NO_DEVICE, NO_DRIVER (not initialized,
 * insufficient or mismatched driver, stub library), UNSUPPORTED, or CUDA. */
kvf_status kvf_cu_status(CUresult result);

/* Write "CUDA_ERROR_NAME (description)" for `result` into buf, using the
 * active table's cuGetErrorName/String when present. Returns buf. */
const char *kvf_cu_describe(CUresult result, char *buf, size_t cap);

/* The failing site of a driver call: log one warning, set kvf_last_error()
 * to "fn: CUDA_ERROR_... (...)" and return the mapped status. */
kvf_status kvf_cu_fail(CUresult result, const char *fn, const char *file, int line);

/* KVF_CU_CHECK(cuMemMap, ptr, size, 0, handle, 0): call through the table
 * and return the mapped status from the enclosing function on failure. */
#define KVF_CU_CHECK(fn, ...)                                                           \
  do {                                                                                  \
    CUresult kvf_cu_r_ = KVF_CU(fn)(__VA_ARGS__);                                       \
    if (kvf_cu_r_ != CUDA_SUCCESS) return kvf_cu_fail(kvf_cu_r_, #fn, __FILE__, __LINE__); \
  } while (0)

/* As KVF_CU_CHECK, but store the status in `st` and jump to `label`. */
#define KVF_CU_CHECK_GOTO(st, label, fn, ...)                                           \
  do {                                                                                  \
    CUresult kvf_cu_r_ = KVF_CU(fn)(__VA_ARGS__);                                       \
    if (kvf_cu_r_ != CUDA_SUCCESS) {                                                    \
      (st) = kvf_cu_fail(kvf_cu_r_, #fn, __FILE__, __LINE__);                           \
      goto label;                                                                       \
    }                                                                                   \
  } while (0)

#endif /* KVF_WITH_CUDA */

#ifdef __cplusplus
}
#endif

#endif /* KVF_HOST_CUDAWRAP_H */
