// A kernel that spins on the GPU for a while (xfer_spin.cu): the
// no-synchronize test keeps a stream busy with it.
#ifndef KVF_TESTS_XFER_SPIN_H
#define KVF_TESTS_XFER_SPIN_H

#include <cuda_runtime_api.h>

extern "C" cudaError_t kvf_test_spin(cudaStream_t stream, double milliseconds);

#endif
