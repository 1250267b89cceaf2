// Kernels for test_xfer's ordering checks (xfer_spin.cu): one that spins on
// the GPU for a while (the no-synchronize test keeps a stream busy with
// it), and a pair that checks overlapped (programmatic dependent) launches.
#ifndef KVF_TESTS_XFER_SPIN_H
#define KVF_TESTS_XFER_SPIN_H

#include <cuda_runtime_api.h>

#include <stddef.h>

extern "C" cudaError_t kvf_test_spin(cudaStream_t stream, double milliseconds);

// Most copies one call of the two below takes.
#define KVF_TEST_MAX_COPIES 96

// Enqueue a kernel that lets the stream's next kernel start at once (if that
// one was launched as a programmatic dependent), spins about `milliseconds`,
// then copies bytes[i] bytes from src[i] to dst[i] (device memory), i < n.
extern "C" cudaError_t kvf_test_late_copy(cudaStream_t stream, double milliseconds, int n, void *const *dst,
                                          const void *const *src, const size_t *bytes);

// Enqueue the same copies as a programmatic dependent of the stream's
// previous kernel that never waits for it: after kvf_test_late_copy it
// reads the sources before that kernel wrote them, which shows that this
// GPU and driver do overlap such launches.
extern "C" cudaError_t kvf_test_unwaiting_copy(cudaStream_t stream, int n, void *const *dst, const void *const *src,
                                               const size_t *bytes);

#endif
