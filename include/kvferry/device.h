/*
 * kvferry/device.h - whether this process can use a CUDA driver and GPUs.
 *
 * kvferry reaches the CUDA driver only through entry points it looks up at
 * run time, so the library loads and its host backend works on a machine
 * without a driver or a GPU. kvf_cuda_probe() says what is there, without
 * creating a context on any device.
 *
 * The environment variable KVF_CUDA_DISABLE=1 makes kvferry behave as if no
 * driver were installed (the host backend only).
 *
 * Threading: safe from any thread. The driver is looked up once per process;
 * later probes reuse that result. Nothing here touches a stream.
 */
#ifndef KVFERRY_DEVICE_H
#define KVFERRY_DEVICE_H

#include <kvferry/status.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KVF_CUDA_INFO_VERSION 1u

/* What kvf_cuda_probe() found. Starts with its size and version, so fields
 * can be appended later: fill it from KVF_CUDA_INFO_INIT before the call. */
typedef struct kvf_cuda_info {
  uint32_t struct_size;
  uint32_t version;
  int driver_version;  /* CUDA version the driver supports, 1000*major + 10*minor; 0: no driver */
  int runtime_version; /* CUDA version kvferry was built against; 0: built without CUDA */
  int device_count;    /* visible devices (after CUDA_VISIBLE_DEVICES); 0 when none or no driver */
  char message[256];   /* one line: what was found, or why CUDA cannot be used */
} kvf_cuda_info;

#define KVF_CUDA_INFO_INIT {sizeof(kvf_cuda_info), KVF_CUDA_INFO_VERSION, 0, 0, 0, {0}}

/*
 * Probe the CUDA driver and count the devices.
 *
 * out: filled from KVF_CUDA_INFO_INIT. Unlike most out-parameters it is
 *      filled on failure too: driver_version, runtime_version and message
 *      say what was found and what is missing.
 *
 * Returns:
 *   KVF_SUCCESS               a driver is loaded and at least one device is visible
 *   KVF_ERR_NO_DRIVER         no driver, a driver too old for this build, a build
 *                             without CUDA, or KVF_CUDA_DISABLE=1
 *   KVF_ERR_NO_DEVICE         a driver but no visible device
 *   KVF_ERR_CUDA              the driver failed in another way
 *   KVF_ERR_INVALID_ARGUMENT  out is NULL, or breaks the versioned-struct rule
 *                             (kvferry/kvferry.h; out is then untouched)
 * On failure kvf_last_error() holds the same text as out->message.
 */
KVF_API kvf_status kvf_cuda_probe(kvf_cuda_info *out);

#ifdef __cplusplus
}
#endif

#endif /* KVFERRY_DEVICE_H */
