/* Internal: the entry points of the CUDA kernel (kernels/xfer_kernel.cu),
 * called by the transfer contexts (host/core/xfer.c).
 *
 * Both files include this header, so a definition that drifts from its
 * declaration is a compile error in xfer_kernel.cu rather than a silent ABI
 * mismatch at link time (C linkage carries no signature). Unlike plan.h this
 * header needs the CUDA runtime's types: include it only where KVF_WITH_CUDA
 * is set. */
#ifndef KVF_KERNELS_LAUNCH_H
#define KVF_KERNELS_LAUNCH_H

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Threads per CTA of the gather/scatter kernel. */
int kvf_kernel_threads(void);

/* The largest launch blob the kernel takes in its parameters (CUDA 12.1+
 * allows 32764 bytes of kernel parameters on every GPU kvferry supports). */
#define KVF_KERNEL_PARAM_MAX 32752

/* The parameter sizes the kernel is built for, ascending (xfer_kernel.cu
 * says why these; kvf_kernel_param_room takes the first that holds a blob).
 * Here so that a stand-in for the kernel (perf/host_path_stub.c) rounds
 * the same way. */
#define KVF_KERNEL_PARAM_SIZES 2048, 4096, 6144, 8192, 12288, 16384, KVF_KERNEL_PARAM_MAX

/* Bytes of parameters a blob of blob_bytes is launched with (the smallest
 * variant that holds it), 0 when it is larger than KVF_KERNEL_PARAM_MAX. */
size_t kvf_kernel_param_room(size_t blob_bytes);

/* Whether the kernels loaded on the current device may be launched with
 * overlap (kvf_kernel_launch_params): compiled for compute capability 9.0
 * or later (a PTX version of 90 or more), so that their warps wait for the
 * grid they overlap. The caller also checks the device's own capability. */
int kvf_kernel_can_overlap(void);

/* Load every kernel variant's module now (module loading is lazy): a
 * context's first call then pays no loading. */
cudaError_t kvf_kernel_preload(void);

/* Which kernel a launch runs. */
enum {
  KVF_KERNEL_GRID_STRIDE = 0, /* one task per step, every warp striding the tasks */
  KVF_KERNEL_WALK = 1,        /* the warp walk (kernels/walk.h), one CTA of kvf_kernel_threads() per SM */
  KVF_KERNEL_WALK_SPREAD = 2, /* the warp walk in small CTAs, several per SM and several rounds of them,
                                 scheduled by the hardware, each lane with twice the loads in flight: only
                                 for launches that may use every SM */
  KVF_KERNEL_WALK_SPREAD_SHALLOW = 3 /* the same with the walk's usual loads in flight and more CTAs an SM
                                        (a spread outside the deep window, KVF_XFER_SPREAD_DEEP_KB up to
                                        KVF_XFER_SPREAD_DEEP_MAX_MB) */
};

/* Whether `kernel` is one of the spread walks. */
static inline int kvf_kernel_is_spread(int kernel) {
  return kernel == KVF_KERNEL_WALK_SPREAD || kernel == KVF_KERNEL_WALK_SPREAD_SHALLOW;
}

/* Launch the kernel on `stream` over the launch blob at `device_blob`
 * (kernels/plan.h, already in device memory in stream order) on at most
 * *ctas SMs; *ctas is lowered to what total_tasks can use (in CTAs of
 * kvf_kernel_threads()) and returned. kernel: KVF_KERNEL_*; the first two
 * launch *ctas CTAs, one per SM, so a cap on *ctas caps the SMs; a spread
 * launch runs as many small CTAs as its tasks use, on every SM. Returns the
 * launch's error (cudaSuccess when it was enqueued); with KVF_DEBUG_SYNC it
 * also synchronizes `stream` and returns the kernel's error. The stream is
 * the last argument. */
cudaError_t kvf_kernel_launch(const void *device_blob, uint64_t total_tasks, uint32_t *ctas, int kernel,
                              cudaStream_t stream);

/* The same launch with the blob in the kernel's parameters: host_blob is a
 * host copy of a blob of blob_bytes (at most KVF_KERNEL_PARAM_MAX), readable
 * for kvf_kernel_param_room(blob_bytes) bytes; the launch copies it when it
 * is called, so nothing needs to stay alive after it returns, and a graph
 * that captures the launch keeps its own copy. overlap (warp walks only,
 * where kvf_kernel_can_overlap and the device is of compute capability 9.0
 * or later; the blob's header must say overlap = 1): launch as a
 * programmatic dependent of the stream's previous kernel, so that the launch
 * and each warp's first decode (the blob is in the parameters) may run while
 * that kernel's last CTAs drain (a kernel that never lets its dependents
 * start early does so as each of its CTAs exits); every warp waits for that
 * kernel's completion and memory (griddepcontrol.wait) before its first
 * access to memory, and before it exits. The kernel in turn lets the
 * stream's next kernel launch as it starts (launch_dependents). Returns
 * cudaErrorInvalidValue for a blob too large (nothing launched). */
cudaError_t kvf_kernel_launch_params(const void *host_blob, size_t blob_bytes, uint64_t total_tasks, uint32_t *ctas,
                                     int kernel, int overlap, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif
