/*
 * Internal: tunables read once from KVF_* environment variables.
 *
 * Every integer parameter is declared once, in KVF_PARAM_LIST below, which
 * yields both its accessor (int64_t kvf_param_<name>(void), the value cached
 * on first use) and its row in kvf_param_table() (the README's parameter
 * table is that list). A value that is not a decimal integer logs one
 * warning naming the variable and the default is used.
 *
 * Threading: accessors are safe from any thread; the first call reads the
 * environment, later calls return the cached value. Setting the variable
 * after the first call has no effect.
 */
#ifndef KVF_HOST_PARAM_H
#define KVF_HOST_PARAM_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* X(name, ENV_NAME, default, description) for every integer parameter. */
#define KVF_PARAM_LIST(X)                                                                \
  X(cuda_disable, "KVF_CUDA_DISABLE", 0,                                                 \
    "1: never load the CUDA driver; GPU calls return KVF_ERR_NO_DRIVER (host backend only)") \
  X(xfer_pcie_sms, "KVF_XFER_PCIE_SMS", 4,                                               \
    "default SM cap for transfers between a GPU and host memory (measured: the fewest that reach the link)") \
  X(server_l1_prefault_mb, "KVF_SERVER_L1_PREFAULT_MB", 65536,                           \
    "kvferryd populates this many MiB of an L1 pool that is not pinned at start, so no STORE pays first-touch page faults (0: never)") \
  X(server_spin_us, "KVF_SERVER_SPIN_US", 2000,                                          \
    "a kvferryd lane thread pinned to its own core polls for its next request this long before it sleeps (0: never)") \
  X(server_loop_spin_us, "KVF_SERVER_LOOP_SPIN_US", 2000,                                \
    "a kvferryd serving GPUs polls its sockets without sleeping this long after its last activity (0: never; never without GPU lanes)") \
  X(client_spin_us, "KVF_CLIENT_SPIN_US", 1000,                                         \
    "once a registration names a GPU, a client waiting for kvferryd's reply reads its socket without sleeping this long (at most a second) before it sleeps in poll() (0: never)") \
  X(server_warmup, "KVF_SERVER_WARMUP", 1,                                               \
    "1: each kvferryd GPU lane runs one tiny gather and scatter through every route when it starts, so its first STORE sets nothing up (0: off)") \
  X(peer_shm, "KVF_PEER_SHM", 0,                                                        \
    "1: kvferryd pulls from peers on one host over shared memory: its L1 pools are UCX-allocated shared-memory segments a peer reads zero-copy; UCX 1.13 then gives that endpoint no peer-failure handling, so a peer that dies mid-pull is caught by the fetch timeout only (docs/peers.md)") \
  X(xfer_host_threads, "KVF_XFER_HOST_THREADS", 8,                                       \
    "most CPU threads one host-backend transfer uses (and at most one per online CPU)")  \
  X(xfer_host_stream_mb, "KVF_XFER_HOST_STREAM_MB", 4,                                   \
    "host-backend transfers of at least this many MiB write with streaming (non-temporal) stores (0: never)") \
  X(xfer_staging_mb, "KVF_XFER_STAGING_MB", 64,                                          \
    "MiB of each of the two device buffers that stage objects for the copy engine (0: kernels write host memory directly)") \
  X(xfer_stage_edge_mb, "KVF_XFER_STAGE_EDGE_MB", 16,                                    \
    "most MiB of a staged call's first batch (a gather) or last batch (a scatter), at least one chunk, so the copy engine starts early and the last kernel is short (0: as large as the others)") \
  X(xfer_stage_straight_kb, "KVF_XFER_STAGE_STRAIGHT_KB", 1024,                              \
    "KiB of a staged call's first (gather) or last (scatter) batch that the copy engine moves straight between the cache and host memory, in whole layers whose blocks are long runs (three times as much under an SM cap below 64, a tenth of the batch or more for a one-piece small request, never past half the batch; none for a small gather alone: KVF_XFER_STAGE_STRAIGHT_ALONE), while the kernels stage the rest (0: off)") \
  X(xfer_stage_straight_min_run, "KVF_XFER_STAGE_STRAIGHT_MIN_RUN", 16384,                   \
    "shortest run (a block of one layer) the copy engine moves straight for KVF_XFER_STAGE_STRAIGHT_KB") \
  X(xfer_stage_straight_alone, "KVF_XFER_STAGE_STRAIGHT_ALONE", 0,                        \
    "1: a staged gather on an idle stream (a call alone: idle when asked or within 5 us, unless within KVF_XFER_BATCH_BACK_TO_BACK_US of the previous call on it) keeps its straight part; 0: a small request of one batch, uncapped, has none, so the copy engine starts after the first piece's kernel, not after the straight part's batch call, whose host time a call alone waits for (calls behind other work, capped calls, calls of several batches and scatters keep it)") \
  X(xfer_stage_multi_pieces, "KVF_XFER_STAGE_MULTI_PIECES", 2,                           \
    "most pieces per batch of a staged call of more than one batch (0: KVF_XFER_STAGE_PIECES)") \
  X(xfer_stage_sms, "KVF_XFER_STAGE_SMS", 16,                                             \
    "SM cap of the on-GPU gather/scatter between the cache and the staging buffers")     \
  X(xfer_stage_pieces, "KVF_XFER_STAGE_PIECES", 4,                                       \
    "kernel launches per staged batch, whole layers each, growing (a gather) so the copy engine starts after the first (1: one per batch)") \
  X(xfer_stage_growth, "KVF_XFER_STAGE_GROWTH", 2,                                       \
    "size ratio of consecutive staged pieces (1..16): a gather's grow, a scatter's shrink") \
  X(xfer_stage_dma_batch, "KVF_XFER_STAGE_DMA_BATCH", 1,                                 \
    "1: a staged piece's copies go to the copy engine as one cudaMemcpyBatchAsync; 0: one cudaMemcpyAsync each") \
  X(xfer_param_table_bytes, "KVF_XFER_PARAM_TABLE_BYTES", 32752,                         \
    "launch tables up to this many bytes ride in the kernel's parameters instead of a separate upload (0: always upload; at most 32752)") \
  X(xfer_task_bytes, "KVF_XFER_TASK_BYTES", 8192,                                        \
    "most bytes one warp task moves (a multiple of 16, 16..65536)")                      \
  X(xfer_task_waves, "KVF_XFER_TASK_WAVES", 4,                                           \
    "tasks per warp a launch aims at: smaller tasks (down to 512 bytes) for small requests (0: always KVF_XFER_TASK_BYTES)") \
  X(xfer_device_task_waves, "KVF_XFER_DEVICE_TASK_WAVES", 1,                            \
    "the same for a device-to-device or peer launch that may use every SM (0: always KVF_XFER_TASK_BYTES)") \
  X(xfer_batch_min_run, "KVF_XFER_BATCH_MIN_RUN", 32768,                                 \
    "host<->device requests whose contiguous runs are at least this many bytes go to the copy engine's batch API (cudaMemcpyBatchAsync), no kernel") \
  X(xfer_small_stage_mb, "KVF_XFER_SMALL_STAGE_MB", 40,                                  \
    "staged host<->device requests of at most this many MiB use 2 pieces (1 for a call of one batch with a straight part: KVF_XFER_SMALL_STAGE_ONE_PIECE) and 64 SMs for their staging kernels (0: the defaults above for every size)") \
  X(xfer_small_stage_growth, "KVF_XFER_SMALL_STAGE_GROWTH", 4,                          \
    "size ratio of the two pieces of such a small request (1..16): a gather's first piece, whose kernel the copy engine waits for, is 1/(1+ratio) of it") \
  X(xfer_small_stage_one_piece, "KVF_XFER_SMALL_STAGE_ONE_PIECE", 1,                   \
    "1: such a small request of one batch that has a straight part (KVF_XFER_STAGE_STRAIGHT_KB) is one piece, and its straight part takes a tenth of the batch or more, so its copy hides the kernel; 0: 2 pieces all the same") \
  X(xfer_batch_max_runs, "KVF_XFER_BATCH_MAX_RUNS", 256,                                 \
    "... and have at most this many runs (its host cost grows with them; 0: never use the batch API route)") \
  X(xfer_batch_first_runs, "KVF_XFER_BATCH_FIRST_RUNS", 8,                              \
    "the batch API route enqueues its runs on an idle stream in calls of this many runs first, then larger ones (KVF_XFER_BATCH_LINK_GBPS), so the copy engine starts after the first call (0: all in one call)") \
  X(xfer_batch_link_gbps, "KVF_XFER_BATCH_LINK_GBPS", 55,                               \
    "after the first call of a ramped batch, each call takes as many runs as the host enqueued in the time the copy engine needs for the previous call's bytes at this many GB/s (1.5 to 2 times the previous call, or all the rest when it fits that time or leaves under a quarter call; twice when the host was slower than that copy); 0: twice as many each call") \
  X(xfer_batch_back_to_back_us, "KVF_XFER_BATCH_BACK_TO_BACK_US", 20,                   \
    "a batch-API call that comes within this many us of the return of the previous batch call (half to twice its runs), whose host time per run would outlast this call's copies, makes one cudaMemcpyBatchAsync call instead of a ramp (0: never); and only a host-bound call within this many us of the previous one's return goes staged behind a busy stream (KVF_XFER_BATCH_HOST_BOUND); and a call within it on the previous call's stream does not wait for that stream to go idle") \
  X(xfer_batch_host_bound, "KVF_XFER_BATCH_HOST_BOUND", 1,                            \
    "1: a request the batch API route fits takes the staged route for the batch API's host time: on an idle stream when, at the host time of the context's last two batch calls (each of half to twice its runs), the batch route's latency alone outlasts the staged route's; behind the context's previous call when those calls took more host time per run than the staged route needs for this call back to back (KVF_XFER_BATCH_STAGED_COST; with it fixed, that weighs calls alone too); not when the stream is busy other than with the context's previous call, that call host-bound and returned within KVF_XFER_BATCH_BACK_TO_BACK_US (between its start and end marks on the stream; busy otherwise, queued work hides the host); every 9th such call takes the batch route to measure the host again; 0 (or KVF_XFER_BATCH_LINK_GBPS 0, or KVF_XFER_STAGING_MB 0): never") \
  X(xfer_batch_staged_cost, "KVF_XFER_BATCH_STAGED_COST", 0,                          \
    "the staged route's cost the KVF_XFER_BATCH_HOST_BOUND rule weighs a batch call's host time against, in thousandths of its copies' time at KVF_XFER_BATCH_LINK_GBPS (1125: an eighth more), alone and back to back; 0: on an idle stream the batch route's latency alone (its ramp at the last two calls' host time, 2.5 us a call) against the staged route's (its copies at 1.01x plus 30 us for a gather, 10 for a scatter), and behind the previous call the median of the last 4 measured spans on the stream of staged host-bound calls made there (1000 until there are 4: such calls take the staged route and are measured; every 32nd call the measures keep batched is measured again)") \
  X(xfer_spread_kb, "KVF_XFER_SPREAD_KB", 4096,                                          \
    "a device-to-device or peer launch that may use every SM and moves at least this many KiB runs small CTAs, several rounds of them, that the GPU hands out as SMs free up (0: never; one CTA per SM then)") \
  X(xfer_spread_deep_kb, "KVF_XFER_SPREAD_DEEP_KB", 8192,                                \
    "a spread launch of at least this many KiB (and under KVF_XFER_SPREAD_DEEP_MAX_MB) is deep: each lane keeps 16 loads of 16 bytes (32 narrower) in flight, at least 3 CTAs an SM, where the others keep 8 (16) at 4-5; 0: never") \
  X(xfer_spread_deep_max_mb, "KVF_XFER_SPREAD_DEEP_MAX_MB", 12,                          \
    "a spread launch of this many MiB or more is not deep (0: no limit; on an H100, where deep was ahead up to 387 MiB, 512 suits better)") \
  X(xfer_overlap, "KVF_XFER_OVERLAP", 1,                                                 \
    "1: a device-to-device or peer launch that may use every SM (tables in its parameters, compute capability 9.0 and later) is a programmatic dependent launch: it may start while the stream's previous kernel drains and waits for it before touching memory, and lets a next kernel launched the same way start early; 0: neither") \
  X(xfer_cache_order, "KVF_XFER_CACHE_ORDER", 1,                                         \
    "1: a device-to-device gather walks head-major (HND) blocks in the cache's address order; 0: in the object's") \
  X(xfer_kernel, "KVF_XFER_KERNEL", 2,                                                   \
    "the transfer kernel's walk: 2 each warp a contiguous range of tasks, one decode per block, stepped addressing; 1 the grid-stride walk of one task per step")

/* A value no parameter may take: marks "not read yet" in the caches. */
#define KVF_PARAM_UNSET INT64_MIN

/* Read `env` now: its decimal value, or `deflt` when it is unset, empty, or
 * not an integer (the last logs a warning naming the variable). */
int64_t kvf_param_read(const char *env, int64_t deflt);

/* Fill *cache from `env` unless another thread already did (used by
 * KVF_PARAM; *cache starts as KVF_PARAM_UNSET). */
void kvf_param_load(const char *env, int64_t deflt, int64_t *cache);

/* Parse a decimal integer with optional sign and surrounding spaces.
 * Returns 0 and sets *out, or -1 (empty, junk, out of range). */
int kvf_param_parse_int(const char *text, int64_t *out);

/* KVF_PARAM(name, "KVF_ENV", default): defines int64_t kvf_param_name(void).
 * Use it in one .c file; declare it elsewhere with KVF_PARAM_DECLARE. */
#define KVF_PARAM(name, env, deflt)                                                       \
  int64_t kvf_param_##name(void) {                                                        \
    static int64_t kvf_cache_ = KVF_PARAM_UNSET;                                          \
    int64_t v_ = __atomic_load_n(&kvf_cache_, __ATOMIC_ACQUIRE);                          \
    if (v_ == KVF_PARAM_UNSET) {                                                          \
      kvf_param_load((env), (deflt), &kvf_cache_);                                        \
      v_ = __atomic_load_n(&kvf_cache_, __ATOMIC_ACQUIRE);                                \
    }                                                                                     \
    return v_;                                                                            \
  }
#define KVF_PARAM_DECLARE(name) int64_t kvf_param_##name(void)

#define KVF_PARAM_DECLARE_X(name, env, deflt, desc) KVF_PARAM_DECLARE(name);
KVF_PARAM_LIST(KVF_PARAM_DECLARE_X)
#undef KVF_PARAM_DECLARE_X

/* One row of the parameter table. */
typedef struct kvf_param_info {
  const char *env;         /* "KVF_DEBUG" */
  const char *kind;        /* "int" or "string" */
  const char *default_text; /* "WARN", "0" */
  const char *description;
} kvf_param_info;

/* Every KVF_* variable the library reads (logging's string ones included),
 * in a static array; *count receives its length. */
const kvf_param_info *kvf_param_table(size_t *count);

#ifdef __cplusplus
}
#endif

#endif /* KVF_HOST_PARAM_H */
