/* perf/kvf_trace.c - a timeline of any CUDA program's GPU work, for machines
 * without Nsight Systems (the lent H200 has ncu, not nsys).
 *
 * A CUDA injection library: run a program with
 *
 *   CUDA_INJECTION64_PATH=/path/libkvf_trace.so KVF_TRACE_FILE=out.csv prog ...
 *
 * and the driver loads it at cuInit; it asks CUPTI's activity API for every
 * kernel, memcpy and memset, and the runtime and driver API calls that
 * enqueued them, and writes one CSV line per record as CUPTI hands its
 * buffers over (all of them by the program's exit):
 *
 *   kind,start_ns,end_ns,stream,correlation,bytes,copy_kind,copies,name
 *
 * CUPTI groups a cudaMemcpyBatchAsync call's copies into one or more
 * memcpy records (one per call in the traces so far), copies counting the
 * copies of each. A "%p" in KVF_TRACE_FILE
 * becomes the process id, so that the processes of one run (kvferryd and
 * its clients) write their own files; without KVF_TRACE_FILE the lines go to
 * stderr. Records CUPTI dropped (its buffers full) are counted on stderr at
 * exit: missing records would read as idle time.
 *
 * Timestamps are CUPTI's, one clock for the GPU's records and the host's, so
 * a call's host span and its GPU work line up. kind is kernel, memcpy, memset,
 * runtime or driver; name is the kernel's or the API function's. Tracing
 * costs each API call some host time; the GPU work's own spans are exact. */
#define _GNU_SOURCE
#include <cupti.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum { kBufferBytes = 8 << 20 };

/* trace_mu guards trace_out and dropped_records: CUPTI hands completed
 * buffers over on its own thread, and the exit handler closes the file. */
static FILE *trace_out;
static size_t dropped_records;
static pthread_mutex_t trace_mu = PTHREAD_MUTEX_INITIALIZER;

static void CUPTIAPI buffer_requested(uint8_t **buffer, size_t *size, size_t *max_records) {
  *buffer = aligned_alloc(8, kBufferBytes);
  *size = *buffer ? kBufferBytes : 0;
  *max_records = 0;
}

static const char *copy_kind_name(uint8_t k) {
  switch (k) {
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOD: return "h2d";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOH: return "d2h";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOD: return "d2d";
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOH: return "h2h";
    case CUPTI_ACTIVITY_MEMCPY_KIND_PTOP: return "p2p";
    default: return "other";
  }
}

static void write_record(const CUpti_Activity *r) {
  switch (r->kind) {
    case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL:
    case CUPTI_ACTIVITY_KIND_KERNEL: {
      const CUpti_ActivityKernel10 *k = (const CUpti_ActivityKernel10 *)r;
      fprintf(trace_out, "kernel,%llu,%llu,%u,%u,0,,,%s\n", (unsigned long long)k->start,
              (unsigned long long)k->end, k->streamId, k->correlationId, k->name ? k->name : "?");
      break;
    }
    case CUPTI_ACTIVITY_KIND_MEMCPY: {
      const CUpti_ActivityMemcpy6 *m = (const CUpti_ActivityMemcpy6 *)r;
      fprintf(trace_out, "memcpy,%llu,%llu,%u,%u,%llu,%s,%llu,\n", (unsigned long long)m->start,
              (unsigned long long)m->end, m->streamId, m->correlationId, (unsigned long long)m->bytes,
              copy_kind_name(m->copyKind), (unsigned long long)m->copyCount);
      break;
    }
    case CUPTI_ACTIVITY_KIND_MEMSET: {
      const CUpti_ActivityMemset4 *m = (const CUpti_ActivityMemset4 *)r;
      fprintf(trace_out, "memset,%llu,%llu,%u,%u,%llu,,,\n", (unsigned long long)m->start,
              (unsigned long long)m->end, m->streamId, m->correlationId, (unsigned long long)m->bytes);
      break;
    }
    case CUPTI_ACTIVITY_KIND_RUNTIME:
    case CUPTI_ACTIVITY_KIND_DRIVER: {
      const CUpti_ActivityAPI *a = (const CUpti_ActivityAPI *)r;
      const char *name = NULL;
      cuptiGetCallbackName(r->kind == CUPTI_ACTIVITY_KIND_RUNTIME ? CUPTI_CB_DOMAIN_RUNTIME_API
                                                                   : CUPTI_CB_DOMAIN_DRIVER_API,
                           a->cbid, &name);
      fprintf(trace_out, "%s,%llu,%llu,0,%u,0,,,%s\n", r->kind == CUPTI_ACTIVITY_KIND_RUNTIME ? "runtime" : "driver",
              (unsigned long long)a->start, (unsigned long long)a->end, a->correlationId, name ? name : "?");
      break;
    }
    default: break;
  }
}

static void CUPTIAPI buffer_completed(CUcontext ctx, uint32_t stream, uint8_t *buffer, size_t size, size_t valid) {
  (void)size;
  CUpti_Activity *r = NULL;
  size_t dropped = 0;
  cuptiActivityGetNumDroppedRecords(ctx, stream, &dropped);
  pthread_mutex_lock(&trace_mu);
  dropped_records += dropped;
  while (trace_out && cuptiActivityGetNextRecord(buffer, valid, &r) == CUPTI_SUCCESS) write_record(r);
  pthread_mutex_unlock(&trace_mu);
  free(buffer);
}

static void trace_finish(void) {
  cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
  size_t late = 0; /* dropped after the last buffer handed over */
  cuptiActivityGetNumDroppedRecords(NULL, 0, &late);
  pthread_mutex_lock(&trace_mu);
  if (dropped_records + late) fprintf(stderr, "kvf_trace: CUPTI dropped %zu records\n", dropped_records + late);
  if (trace_out && trace_out != stderr) fclose(trace_out);
  trace_out = NULL;
  pthread_mutex_unlock(&trace_mu);
}

/* Called by the driver at cuInit when CUDA_INJECTION64_PATH names this
 * library. Returns 1 on success, as the driver expects. */
__attribute__((visibility("default"))) int InitializeInjection(void);
int InitializeInjection(void) {
  const char *spec = getenv("KVF_TRACE_FILE");
  char path[4096];
  if (spec && *spec) {
    /* "%p" -> the process id (the first one; the rest of the name as is). */
    const char *pid = strstr(spec, "%p");
    int n = pid ? snprintf(path, sizeof path, "%.*s%d%s", (int)(pid - spec), spec, (int)getpid(), pid + 2)
                : snprintf(path, sizeof path, "%s", spec);
    if (n < 0 || (size_t)n >= sizeof path) {
      fprintf(stderr, "kvf_trace: KVF_TRACE_FILE is longer than %zu bytes\n", sizeof path - 1);
      return 0;
    }
  }
  trace_out = spec && *spec ? fopen(path, "w") : stderr;
  if (!trace_out) {
    fprintf(stderr, "kvf_trace: cannot open %s\n", path);
    return 0;
  }
  fprintf(trace_out, "kind,start_ns,end_ns,stream,correlation,bytes,copy_kind,copies,name\n");
  static const CUpti_ActivityKind kinds[] = {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_MEMCPY,
                                             CUPTI_ACTIVITY_KIND_MEMSET, CUPTI_ACTIVITY_KIND_RUNTIME,
                                             CUPTI_ACTIVITY_KIND_DRIVER};
  if (cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed) != CUPTI_SUCCESS) {
    fprintf(stderr, "kvf_trace: cuptiActivityRegisterCallbacks failed\n");
    return 0;
  }
  for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++)
    if (cuptiActivityEnable(kinds[i]) != CUPTI_SUCCESS)
      fprintf(stderr, "kvf_trace: activity kind %d not traced\n", (int)kinds[i]);
  atexit(trace_finish);
  return 1;
}
