/* perf/host_path_stub.h - the CPU stand-in for the CUDA runtime that
 * perf/kvf_host_path links (perf/host_path_stub.c says what it models). */
#ifndef KVF_PERF_HOST_PATH_STUB_H
#define KVF_PERF_HOST_PATH_STUB_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

struct CUstream_st; /* cudaStream_t's target */

/* Memory that cudaPointerGetAttributes reports as this device's (device)
 * or as pinned host memory (pinned); 256-byte aligned; NULL when out of
 * memory. */
void *kvf_host_stub_device_alloc(size_t size);
void *kvf_host_stub_pinned_alloc(size_t size);
void kvf_host_stub_free(void *p);

/* 1 (the default): enqueued work runs at once on the CPU; 0: it is only
 * counted (timing loops). */
void kvf_host_stub_execute(int on);

/* Calls enqueued so far, by kind. */
typedef struct kvf_host_stub_counts {
  uint64_t launches;       /* kernel launches, both kinds */
  uint64_t param_launches; /* of which with the blob in the parameters */
  uint64_t copies;         /* cudaMemcpyAsync */
  uint64_t batch_copies;   /* cudaMemcpyBatchAsync calls */
  uint64_t batch_runs;     /* their runs */
  uint64_t records;        /* cudaEventRecord */
  uint64_t waits;          /* cudaStreamWaitEvent */
  uint64_t pointer_queries;
  uint64_t value_writes;   /* cuStreamWriteValue64 */
  uint64_t value_waits;    /* cuStreamWaitValue64 */
  uint64_t early_waits;    /* of which enqueued before the write they wait for: never ending
                              where work runs in enqueue order (host_path_stub.c) */
  uint64_t last_value_written; /* the value of the last cuStreamWriteValue64 */
  uint64_t last_value_waited;  /* the value the last cuStreamWaitValue64 waited for */
} kvf_host_stub_counts;
void kvf_host_stub_counts_get(kvf_host_stub_counts *out);
/* Stream s (one the stub created) answers cudaErrorNotReady to its next
 * `queries` cudaStreamQuery calls, then idle again: work the GPU completes
 * soon, such as an event the caller recorded just before a call. */
void kvf_host_stub_stream_busy(struct CUstream_st *s, unsigned queries);
/* Whether the device answers that it can write and wait on 64-bit values
 * from a stream (1, the default); 0 makes deferred calls fail to start. */
void kvf_host_stub_mem_ops(int on);

#ifdef __cplusplus
}
#endif

#endif
