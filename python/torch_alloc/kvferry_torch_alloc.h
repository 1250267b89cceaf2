/*
 * kvferry_torch_alloc.h - libkvferry_torch_alloc.so, the exportable allocator
 * that torch.cuda.CUDAPluggableAllocator loads, so that a torch.cuda.MemPool
 * built on it holds tensors a cache server (kvferryd) can import.
 *
 * torch's caching allocator asks this library for whole segments (its own
 * rounding makes them multiples of 2 MiB) and carves tensors out of them at
 * interior offsets. Each segment is one kvf_mem_alloc of libkvferry
 * (kvf_mem_alloc_create, provider cumem): cuMemCreate with the POSIX file
 * descriptor handle type on the device torch names, rounded up to the
 * provider's granularity, mapped read/write for that device alone. Because the
 * segment is a live allocation of libkvferry, kvf_mem_alloc_find (and
 * kvferry.Allocation.find in Python) on any byte of any tensor in it returns
 * that allocation, with the identity it was created with.
 *
 * From Python use kvferry.torch.exportable_mem_pool(device) (docs/python.md);
 * it loads this library after libkvferry, so both share one libkvferry. The
 * library links libkvferry.so.0 and depends on its public API only.
 *
 * Threading: every function is safe from any thread (one lock guards the
 * table of live segments; the driver calls run outside it).
 *
 * Streams: cuMem allocation is not stream-ordered. kvf_torch_alloc ignores
 * its stream (the memory is usable on every stream at once). kvf_torch_free
 * first synchronizes the stream torch allocated the segment on (the stream
 * it passes), because cuMemUnmap, unlike cudaFree, does not wait for work
 * still queued on that memory; torch's caching allocator frees a segment
 * only when every block in it is free and the events of other streams that
 * used it (record_stream) have completed, so this is the only wait needed.
 * Do not call kvf_torch_free on a stream that is being captured.
 *
 * Failures are logged through kvferry's logging (KVF_DEBUG, default WARN,
 * subsystem MEM) and kvf_torch_alloc returns NULL, which torch's caching
 * allocator turns into its own OutOfMemoryError after releasing its cache
 * and retrying once; the calling thread's kvf_last_error() (libkvferry's)
 * still says why.
 */
#ifndef KVFERRY_TORCH_ALLOC_H
#define KVFERRY_TORCH_ALLOC_H

#include <stdint.h>
#include <sys/types.h>

#include <kvferry/memory.h>

#define KVF_TORCH_ALLOC_API __attribute__((visibility("default")))

#ifdef __cplusplus
extern "C" {
#endif

/* cudaStream_t, without the CUDA headers (the same type: a pointer to this
 * opaque struct). */
struct CUstream_st;

/* torch's alloc_fn (CUDAPluggableAllocator's MallocFuncType, void*(size_t,
 * int, cudaStream_t)): `size` bytes of exportable device memory on `device`
 * (an ordinal of this process), rounded up to the cumem granularity.
 * Contents are undefined. The stream is ignored (see Streams above).
 * Returns the base address, or NULL (size <= 0, no driver or device, a device
 * that cannot export POSIX file descriptors, out of memory); a NULL is logged
 * with the reason. */
KVF_TORCH_ALLOC_API void *kvf_torch_alloc(ssize_t size, int device, struct CUstream_st *stream);

/* torch's free_fn (FreeFuncType, void(void*, size_t, int, cudaStream_t)):
 * synchronize `stream` (on `device` when it is the legacy default stream,
 * NULL), then drop this library's reference to the allocation holding ptr,
 * which unmaps and frees the memory unless someone else still holds one
 * (a kvferry.Allocation found on it, say); an importer that maps it keeps the
 * memory alive until it unmaps. ptr must be a base kvf_torch_alloc returned;
 * NULL is a no-op; any other pointer is logged and ignored. size and device
 * are checked against what was allocated (a mismatch is only logged). */
KVF_TORCH_ALLOC_API void kvf_torch_free(void *ptr, ssize_t size, int device, struct CUstream_st *stream);

/* The identity of the live segment holding ptr (any byte of it), as
 * kvf_torch_alloc created it. Returns KVF_SUCCESS; KVF_ERR_INVALID_ARGUMENT
 * (out is NULL); KVF_ERR_NOT_FOUND (ptr is in no live segment of this
 * library). Neither failure sets kvf_last_error(). */
KVF_TORCH_ALLOC_API kvf_status kvf_torch_alloc_identity(const void *ptr, kvf_mem_identity *out);

/* Segments allocated and not freed yet, and their bytes after rounding.
 * Either pointer may be NULL. */
KVF_TORCH_ALLOC_API void kvf_torch_alloc_stats(uint64_t *segments, uint64_t *bytes);

/* The libkvferry this library calls: an address inside it (what its
 * kvf_version_string() returns), so a caller can check that it shares the
 * libkvferry it loaded itself (two copies would keep two tables of
 * allocations, and kvf_mem_alloc_find in one would not know the other's). */
KVF_TORCH_ALLOC_API const void *kvf_torch_alloc_libkvferry_anchor(void);

/* The path of that libkvferry, as the dynamic loader loaded it ("" if
 * unknown). */
KVF_TORCH_ALLOC_API const char *kvf_torch_alloc_libkvferry_path(void);

#ifdef __cplusplus
}
#endif

#endif /* KVFERRY_TORCH_ALLOC_H */
