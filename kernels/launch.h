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

#include <stdint.h>

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Threads per CTA of the gather/scatter kernel. */
int kvf_kernel_threads(void);

/* Launch the kernel on `stream` over the launch blob at `device_blob`
 * (kernels/plan.h, already in device memory in stream order) with at most
 * *ctas CTAs (one per SM at most); *ctas is lowered to what total_tasks can
 * use and returned. Returns the launch's error (cudaSuccess when it was
 * enqueued); with KVF_DEBUG_SYNC it also synchronizes `stream` and returns
 * the kernel's error. The stream is the last argument. */
cudaError_t kvf_kernel_launch(const void *device_blob, uint64_t total_tasks, uint32_t *ctas, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif
