/*
 * Internal: the few CUDA runtime calls the server's data path makes on a
 * device lane (host/dataplane.c), behind plain types so the data path is
 * one C file that builds with and without CUDA. Without CUDA every call but
 * the host pool returns KVF_ERR_UNSUPPORTED.
 *
 * Threading: each function may be called from any thread; it makes `device`
 * current for the call and restores the caller's current device.
 */
#ifndef KVF_HOST_SERVER_CUDA_H
#define KVF_HOST_SERVER_CUDA_H

#include <stdint.h>

#include <kvferry/status.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvf_scuda_event kvf_scuda_event;

/* A non-blocking stream of `device` (*stream is a cudaStream_t). */
kvf_status kvf_scuda_stream_create(int device, void **stream);
void kvf_scuda_stream_destroy(int device, void *stream);

/* An engine's ready event (a cudaEventInterprocess event of another
 * process) opened in `device`'s context, kept open so that it can be waited
 * on again: every cudaStreamWaitEvent on it waits for the engine's latest
 * record at the time of the wait. */
typedef struct kvf_scuda_ipc_event kvf_scuda_ipc_event;

/* Open the event whose 64-byte cudaIpcEventHandle_t is `handle`. Returns
 * KVF_SUCCESS and *out; KVF_ERR_INVALID_ARGUMENT naming
 * payload.ready_handle when the driver refuses the handle;
 * KVF_ERR_OUT_OF_MEMORY; KVF_ERR_CUDA. */
kvf_status kvf_scuda_ipc_event_open(int device, const uint8_t handle[64], kvf_scuda_ipc_event **out);

/* Make `stream` (of the event's device) wait for the event's latest record.
 * KVF_ERR_CUDA. */
kvf_status kvf_scuda_ipc_event_wait(kvf_scuda_ipc_event *event, void *stream);

/* Close the event (the waits already enqueued keep what they need). NULL is
 * a no-op. */
void kvf_scuda_ipc_event_close(kvf_scuda_ipc_event *event);

/* An event (timing disabled) recorded on `stream` now: what the stream has
 * queued so far is done once it has completed. */
kvf_status kvf_scuda_event_record(int device, void *stream, kvf_scuda_event **out);

/* 1: completed; 0: not yet; a status < 0 is never returned: a failed
 * event (sticky error) returns KVF_ERR_CUDA via *error and 1, so the caller
 * stops waiting (the context is then unusable: nothing is released early
 * since nothing can run any more). */
int kvf_scuda_event_done(kvf_scuda_event *event, kvf_status *error);
void kvf_scuda_event_destroy(kvf_scuda_event *event);

/* Synchronize `stream` (the fallback proof when recording an event failed:
 * this stream only, never the device). */
kvf_status kvf_scuda_stream_sync(int device, void *stream);

/* L1 pool memory: `bytes` of host memory placed on NUMA node numa_node (-1:
 * anywhere) and, with pin_device >= 0, page-locked and registered portable
 * through that device (every device's kernels reach it). pin_device -1:
 * plain anonymous memory (a host-only server). Returns KVF_SUCCESS and *base
 * (page-aligned); KVF_ERR_OUT_OF_MEMORY; KVF_ERR_CUDA. */
kvf_status kvf_scuda_pool_alloc(int pin_device, int numa_node, uint64_t bytes, void **base);
void kvf_scuda_pool_free(int pin_device, void *base, uint64_t bytes);

/* Place and pin memory allocated elsewhere (not touched yet) as
 * kvf_scuda_pool_alloc does its own: bound to NUMA node numa_node (-1:
 * anywhere), page-locked through pin_device (-1: not). KVF_ERR_CUDA.
 * kvf_scuda_pool_unpin undoes the pinning (the memory stays). */
kvf_status kvf_scuda_pool_pin(int pin_device, int numa_node, void *base, uint64_t bytes);
void kvf_scuda_pool_unpin(int pin_device, void *base);

/* Make `device` the calling thread's current device for good (a lane's
 * own threads: their calls then switch nothing). KVF_ERR_CUDA. */
kvf_status kvf_scuda_thread_bind(int device);

/* Warm a GPU lane up before its first request: one gather and one scatter
 * on `stream` through each route the lane's requests take (the copy
 * engine's batch API, the staged route, the direct kernel; those the
 * KVF_XFER_* parameters leave on), between a small device buffer and
 * pinned host memory of its own, then the completion event a request
 * records, waited for. So the first launches, copies and event operations
 * of the process, of the lane's stream and of the lane's threads, and
 * whatever the driver sets up on first use behind them, are paid here and
 * not by the first STORE. Everything it makes is released before it
 * returns. Blocks the caller until the stream is idle (a lane thread,
 * before it serves). Returns KVF_SUCCESS; on failure, the step that failed
 * (kvf_last_error; the lane still serves: its first request sets up what
 * this did not). */
kvf_status kvf_scuda_lane_warm(int device, void *stream);

/* Number of visible CUDA devices (0 without a driver, a GPU, or CUDA). */
int kvf_scuda_device_count(void);

#ifdef __cplusplus
}
#endif

#endif /* KVF_HOST_SERVER_CUDA_H */
