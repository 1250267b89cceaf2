/*
 * Internal: the parts of the transfer contexts (host/core/xfer.c) that tests
 * reach.
 *
 * - The staged route's plan (host/core/xfer_stage.c): which objects of a
 *   request cross PCIe through the two device staging buffers, which bytes of
 *   each, and how the request splits into batches of whole chunks. Pure C,
 *   no CUDA: the planning is tested without a GPU, and a GPU test predicts
 *   from it what a failed call leaves written.
 * - A failure-injection hook for the staged route's enqueue, and read-only
 *   views of a context's staging state, for the GPU tests of
 *   include/kvferry/transfer.h's failure contract.
 *
 * Threading: the plan functions are pure. The hook is a process-wide atomic:
 * set it before the code under test runs and clear it after (like
 * kvf_cuda_table_install in host/core/cudawrap.h).
 */
#ifndef KVF_HOST_XFER_INTERNAL_H
#define KVF_HOST_XFER_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include <kvferry/copy.h>
#include <kvferry/transfer.h>

#include "kernels/plan.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- the staged route's plan --------------------------------------------- */

/* Offsets and sizes in a staging buffer are multiples of this. */
#define KVF_STAGE_ALIGN 256u

typedef struct kvf_stage_batch {
  uint64_t k0, k1; /* chunks [k0, k1) of the request */
  uint64_t bytes;  /* bytes of its staging buffer it uses */
} kvf_stage_batch;

/* Objects are indexed as in the request: chunk-major, then object group. */
typedef struct kvf_stage_plan {
  uint64_t num_chunks;
  uint64_t num_objects;      /* num_chunks * object groups */
  unsigned char *staged;     /* [num_objects] 1: through a staging buffer; 0: the direct kernel's, or NULL */
  uint64_t *span;            /* [2 * num_objects] a staged object's bytes [lo, hi) that cross PCIe */
  uint64_t *size;            /* [num_objects] a staged object's room in a buffer (its size, rounded up); else 0 */
  uint64_t *offset;          /* [num_objects] a staged object's place in its batch's buffer (after batching) */
  kvf_stage_batch *batches;  /* [num_chunks] after batching */
  uint64_t num_batches;      /* 0 until kvf_stage_plan_batches */
  uint64_t max_chunk;        /* room of the largest chunk: the least buffer size */
  int any_direct;            /* some non-NULL object goes the direct way (a gather writing it in part) */
} kvf_stage_plan;

/* Classify the objects of a request that kvf_copy_request_check accepted:
 * every non-NULL object is staged, except that a gather stages only objects
 * whose moving parts (attention part, recurrent part) it writes whole. A
 * staged object's span is the parts the request touches. Returns
 * KVF_SUCCESS or KVF_ERR_OUT_OF_MEMORY (then *out is empty and needs no free). */
kvf_status kvf_stage_plan_objects(const kvf_geometry *geometry, const kvf_copy_request *request, int gather,
                                  kvf_stage_plan *out);

/* Split the chunks into batches for buffers of `cap` bytes: each batch takes
 * whole chunks in order while their staged objects fit, and at least one
 * chunk (cap must be at least max_chunk). The batch at the pipeline's
 * exposed end, a gather's first (the copy engine waits for its first
 * kernel) or a scatter's last (its last kernel runs after every copy),
 * holds at most edge_cap bytes, and at least one chunk (0: no such limit).
 * Fills offset, batches and num_batches. */
void kvf_stage_plan_batches(kvf_stage_plan *plan, uint64_t cap, uint64_t edge_cap, int gather);

/* Free what kvf_stage_plan_objects allocated; the plan is then empty. */
void kvf_stage_plan_free(kvf_stage_plan *plan);

/* ---- pieces: the copy engine starts after a batch's first piece ---------- */

/* Most kernel launches (pieces) one staged batch is split into. */
#define KVF_STAGE_MAX_PIECES 16
/* Most MiB a staging size may name (KVF_XFER_STAGING_MB, _STAGE_EDGE_MB):
 * a byte count << 20 must not wrap. */
#define KVF_STAGE_MAX_MB (1 << 20)
/* The largest KVF_XFER_SPREAD_KB (a TiB). */
#define KVF_SPREAD_MAX_KB (1 << 30)
/* Most KVF_XFER_BATCH_LINK_GBPS (far past any link, and small enough that
 * bytes / rate stays exact in nanoseconds). */
#define KVF_BATCH_MAX_LINK_GBPS 100000
/* Most runs of a staged call's straight copy-engine part (the host time of
 * cudaMemcpyBatchAsync grows with its runs). */
#define KVF_STAGE_STRAIGHT_MAX_RUNS 256
/* The straight part under an SM cap below KVF_SMALL_STAGE_SMS: this many
 * times KVF_XFER_STAGE_STRAIGHT_KB (host/core/xfer.c, plan_straight). */
#define KVF_STAGE_STRAIGHT_CAPPED_FACTOR 3

/* Split the segments a request moves into at most `pieces` pieces of whole
 * views (a view's planes or states stay together, so the bytes of an object
 * that a piece writes interleave with no other piece's), in plan order.
 * Piece sizes, in bytes per token of the request (a recurrent state's
 * bytes spread over its tokens), grow geometrically (1, 2, 4, ... parts)
 * for a gather, whose first piece's kernel runs before the copy engine can
 * start, and shrink for a scatter, whose last piece's kernel runs after the
 * copy engine is done.
 * masks is [pieces][plan->num_segments]; piece p takes segment s when
 * masks[p * num_segments + s] is 1 (segments of groups the request does not
 * move are in none). Returns the number of pieces made (at least 1, at most
 * the number of moving views). */
uint32_t kvf_stage_piece_masks(const kvf_geometry *geometry, const kvf_plan *plan, const kvf_copy_request *request,
                               int gather, uint32_t pieces, unsigned char *masks);

/* The same with sizes growing by `growth` from one piece to the next (1:
 * equal pieces; kvf_stage_piece_masks is growth 2). */
uint32_t kvf_stage_piece_masks_growth(const kvf_geometry *geometry, const kvf_plan *plan,
                                      const kvf_copy_request *request, int gather, uint32_t pieces, uint32_t growth,
                                      unsigned char *masks);

/* The views of a request (a staged call's first batch for a gather, its
 * last for a scatter) that the copy engine moves straight between the cache
 * and the host objects while the kernels stage the rest: whole views whose
 * every segment moves and is linear (one run per block on both sides) with
 * blocks of at least min_run bytes, taken from the first view on (from the
 * last when from_end) until they hold at least `target` bytes, and never
 * past `limit` bytes or `max_runs` blocks (the view that would pass either
 * ends the pick: a larger part would leave the call none). Sets
 * pick[s] (of plan->num_segments) for their segments, clears the others, and
 * returns their bytes as counted from the request's block ranges (skipped
 * block ids included: an upper bound; 0 when none is picked). */
uint64_t kvf_stage_straight_pick(const kvf_geometry *geometry, const kvf_plan *plan, const kvf_copy_request *request,
                                 int from_end, uint64_t min_run, uint64_t target, uint64_t limit, uint64_t max_runs,
                                 unsigned char *pick);

/* A memo of the staged plan's steps that read a request only through the
 * blocks each of its groups moves and its token count: the piece split
 * (kvf_stage_piece_masks_growth) and the straight part's views
 * (kvf_stage_straight_pick). Both walk every segment of the plan (160 on
 * the 80-layer tp4 slice), and a context asks them the same question for
 * every chunk of one size it moves, whatever the chunk's place and block
 * ids. Answers are keyed by the plan's address, so a memo belongs to one
 * context, whose plans do not change while it lives; it is zeroed before
 * its first use and owned by the caller's lock.
 * Measured on the development VM (kvf_host_path, perf/results/
 * 2026-12-05-cpu-plan-memo): the piece split was a quarter of the tp4
 * slice's one-chunk staged call and a sixth of Llama's; with the memo those
 * calls took 0.68-0.70x (tp4) and 0.77-0.90x (Llama) of their host time. */
/* kvf_stage_piece_masks_growth and kvf_stage_straight_pick through the
 * memo (common/memo.h: its last KVF_MEMO_SLOTS answers; release it with
 * kvf_memo_free): the same results and the same bytes written. Without
 * memory for a slot the answer is computed and not kept. */
uint32_t kvf_stage_piece_masks_memo(kvf_memo *memo, const kvf_geometry *geometry, const kvf_plan *plan,
                                    const kvf_copy_request *request, int gather, uint32_t pieces, uint32_t growth,
                                    unsigned char *masks);
uint64_t kvf_stage_straight_pick_memo(kvf_memo *memo, const kvf_geometry *geometry, const kvf_plan *plan,
                                      const kvf_copy_request *request, int from_end, uint64_t min_run,
                                      uint64_t target, uint64_t limit, uint64_t max_runs, unsigned char *pick);

/* A contiguous byte range of one object. */
typedef struct kvf_stage_run {
  uint64_t object; /* index into the request's objects */
  uint64_t offset; /* from the object's start */
  uint64_t bytes;
} kvf_stage_run;

/* The object byte ranges a blob's tasks write (gather) or read (scatter),
 * merged where they touch and sorted by (object, offset). object_base[i] is
 * the address the blob holds for object i (its place in a staging buffer)
 * and is where offsets count from. *holes is set when a merged range holds
 * bytes no task touches (a gather must not copy such a range back). *runs is
 * allocated (free it); returns KVF_SUCCESS or KVF_ERR_OUT_OF_MEMORY. */
kvf_status kvf_stage_blob_runs(const void *blob, const uint64_t *object_base, kvf_stage_run **runs, uint64_t *count,
                               int *holes);

/* kvf_stage_blob_runs remembered for the blobs a context builds again and
 * again: a staged call's pieces of one request shape give the same runs
 * whatever their block ids, as long as the same blocks are skipped (the runs
 * are object extents in a staging buffer), and wherever the request lies in
 * its sequence and whichever staging buffer its pieces fill. A blob's key is
 * what the listing reads as it reads it: each object as present or not and
 * its place from its base, the header and shapes with the request's place
 * made relative to its start, the entries, and each id as whether it moves
 * (below the header's num_blocks_max).
 * Measured on the development VM (kvf_host_path, perf/results/
 * 2026-12-04-cpu-host-path): the listing was about 40% of the 80-layer tp4
 * slice's one-chunk staged call (whose planning took 28-30 us on the H200's
 * host); through the cache the call's host time went from 11.0-11.1 to
 * 6.3-6.9 us, Llama's layouts' 5.4-6.6 to 3.5-4.8 us, the glm-like and
 * gpt-oss-like hybrids' 4.6-5.9 to 3.7-5.1 us. A hit costs 0.25-0.5 us
 * where the listing took 1.2-5.1 us; a miss 12-15% more than the listing. */
/* kvf_stage_blob_runs(blob, object_base, ...) through the cache
 * (common/memo.h: its last KVF_MEMO_SLOTS listings, a slot a piece for up
 * to KVF_STAGE_MAX_PIECES pieces of one batch; release it with
 * kvf_memo_free): *runs points into the cache, valid until its next call.
 * Without memory for a key the blob is listed and kept under none;
 * KVF_ERR_OUT_OF_MEMORY only where the listing fails (*runs NULL). */
kvf_status kvf_stage_blob_runs_cached(kvf_memo *cache, const void *blob, const uint64_t *object_base,
                                      const kvf_stage_run **runs, uint64_t *count, int *holes);

/* The blob's runs for cudaMemcpyBatchAsync (the copy-batch route, a staged
 * call's straight part), when every block of every entry is one contiguous
 * run on both sides, the runs are at least min_run bytes (the shortest may
 * be shorter: a partial last block) and at most max_runs. Runs that continue
 * each other on both sides are merged. Returns 1 with *dst, *src, *size (of
 * *count entries) allocated: free them; 0 when the runs do not fit and -1
 * out of memory, both with the three arrays NULL. */
int kvf_stage_batch_runs(const void *blob, int gather, uint64_t min_run, uint64_t max_runs, void ***dst,
                         const void ***src, size_t **size, size_t *count);

/* The fewest runs a checked request's batch-API listing
 * (kvf_stage_batch_runs) can merge into: its blocks' runs less every merge
 * its ids allow (a block whose id follows the block before's, one between
 * consecutive segments). 0 when an object is missing (its blocks leave the
 * listing). The copy-batch route refuses a request over its limit by this
 * floor without building its runs. */
uint64_t kvf_stage_batch_runs_floor(const kvf_geometry *geometry, const kvf_plan *plan,
                                    const kvf_copy_request *request);

/* How many of the `left` runs still to enqueue the next cudaMemcpyBatchAsync
 * of a ramped batch takes, when `done` calls were made before it: `first`,
 * then twice as many each call, and the rest in one call once the next
 * doubling would reach it (first 0: all of them at once). The copy engine
 * starts on the first call's runs while the host enqueues the next: the
 * batch API's host time grows with its runs (KVF_XFER_BATCH_FIRST_RUNS). */
uint64_t kvf_batch_ramp_runs(uint64_t done, uint64_t first, uint64_t left);

/* The runs of a ramped batch's next call, paced by the host (KVF_XFER_BATCH_
 * LINK_GBPS): the previous call enqueued `prev` runs in prev_host_ns, and
 * the copy engine needs prev_engine_ns for their bytes; the next call takes
 * as many runs as the host enqueues in that time, at least 1.5 and at most
 * 2 times prev (doubling outran a host at 0.8 us a run: the copy engine sat
 * idle between calls, and smaller steps cost calls), and all of the `left`
 * runs when they fit that time or leave at most a quarter of a call behind.
 * A host that took longer for the previous call (its fixed cost included)
 * than the copy engine needs for it doubles, as kvf_batch_ramp_runs.
 * prev_host_ns 0 counts as a fast host. Never 0 when left is not. */
uint64_t kvf_batch_ramp_next(uint64_t prev, uint64_t left, uint64_t prev_host_ns, uint64_t prev_engine_ns);

/* The most KVF_XFER_BATCH_BACK_TO_BACK_US (a second). */
#define KVF_BATCH_MAX_BACK_TO_BACK_US 1000000

/* How long a call waits for its busy stream where idleness decides its
 * route or the batch route's ramp (host/core/xfer.c, stream_idle_soon,
 * says why). */
#define KVF_IDLE_WAIT_NS 5000

/* Whether a batch-API call of `runs` runs, whose copies take engine_ns at
 * KVF_XFER_BATCH_LINK_GBPS, would keep the copy engine waiting for the host:
 * the context's last batch call took prev_host_ns of host time (from taking
 * the context to its return) for prev_runs runs, a comparable call (half to
 * twice the runs: a call's fixed cost says nothing of another size's), and
 * at that rate this call's host time outlasts engine_ns. prev_runs 0 (no
 * batch call yet): no. */
int kvf_batch_host_bound(uint64_t prev_host_ns, uint64_t prev_runs, uint64_t runs, uint64_t engine_ns);

/* Host-bound calls that take the staged route in a row before one takes
 * the batch route again, to measure the host anew (KVF_XFER_BATCH_HOST_BOUND). */
#define KVF_BATCH_HOST_BOUND_RETRY 8
/* The staged route's cost in thousandths of its copies' time at
 * KVF_XFER_BATCH_LINK_GBPS, what a host-bound call weighs the batch route's
 * host time against: KVF_XFER_BATCH_STAGED_COST when set (the value of
 * KVF_BATCH_STAGED_COST_EIGHTH, an eighth more, was the rule's margin from
 * 2026-12-03); else, a call on an idle stream weighs latencies
 * (kvf_batch_alone_outlasts_staged), and a call that came while the stream
 * worked on the call before it, the median of the context's last
 * KVF_STAGED_COST_SAMPLES measures of such calls' spans on the stream (their
 * period back to back; kvf_staged_cost_of), KVF_BATCH_STAGED_COST_UNMEASURED
 * until there are that many: host-bound calls back to back take the staged
 * route, and are measured, until then. Every KVF_STAGED_COST_REMEASURE-th
 * such call that the measures keep on the batch route (it would go staged
 * unmeasured) goes staged to be measured again, so a cost measured high
 * (the copy engine shared for a while) does not keep the rule off for good.
 * The staged route ran 1.02-1.08x its copies back to back on some H200
 * leases and 1.135x on another (perf/results/2026-12-04-h200-final): no
 * constant suits both, and under an eighth more the rule never tried it. */
#define KVF_BATCH_STAGED_COST_EIGHTH 1125
#define KVF_BATCH_STAGED_COST_UNMEASURED 1000
#define KVF_BATCH_MAX_STAGED_COST 1000000000ull
#define KVF_STAGED_COST_SAMPLES 4
#define KVF_STAGED_COST_REMEASURE 32

/* Whether a batch-API call of `runs` runs, whose copies take engine_ns at
 * KVF_XFER_BATCH_LINK_GBPS, goes staged for its host time: the context's
 * last two batch calls (last_*, before_*; runs 0: none) are both
 * host-bound by kvf_batch_host_bound against engine_ns times
 * staged_cost / 1000 (kvf_staged_cost_of; saturating). */
int kvf_batch_host_outlasts_staged(uint64_t last_host_ns, uint64_t last_runs, uint64_t before_host_ns,
                                   uint64_t before_runs, uint64_t runs, uint64_t engine_ns, uint64_t staged_cost);

/* The batch route's latency for a call alone on an idle stream, from its
 * start to its last copy's end, as the ramp would enqueue it: `runs` runs
 * whose host time is host_ns in all (spread evenly over the runs) and whose
 * copies take engine_ns, the first call of `first` runs
 * (KVF_XFER_BATCH_FIRST_RUNS; 0: one call), each later one of
 * kvf_batch_ramp_next's size; a call's copies start once the host has
 * enqueued it and the copy engine is done with the previous call's, and
 * each call costs KVF_BATCH_ALONE_CALL_NS more. On the H200 the fp8 MLA
 * chunk's latency alone (244 runs, 186 us at 55 GB/s) measured 1.10-1.16x
 * a memcpy's where this gave 1.02-1.03x the copy without the calls' cost
 * (host 99-126 us), 1.22-1.23 where it gave 1.12-1.21 (151-168), 1.30-1.32
 * where 1.28-1.53 (181-190) and 1.56-1.75 where 1.61-1.82 (206-244): past
 * the copy time the ramp doubles, so its last call, half the runs, is
 * copied after all the host time
 * (perf/results/2026-12-04-h200-hostbound-measured). A model: the host
 * time it is given (from the call's start, planning included) is spread
 * evenly over the runs, where the ramp paces by each call's own; it assumes
 * the ramp, where a call right after a host-bound one makes one call
 * (kvf_batch_back_to_back); and it is not monotonic in the host time,
 * since the ramp's steps change shape with the host's rate (the fp8 chunk's
 * latency drops 5.4% of the copy at 96 us; some shapes more). Saturates
 * at UINT64_MAX; 0 for 0 runs. */
uint64_t kvf_batch_alone_latency(uint64_t runs, uint64_t first, uint64_t host_ns, uint64_t engine_ns);

/* What each of the ramp's calls adds to a call alone's latency on the copy
 * engine beyond its copies' time: the engine idles about 1.3 us between
 * calls (kvf_trace), and a call's copies start later than the even spread
 * of the host time says. On an H200 whose host kept ahead of the copy
 * engine, the batch route alone took 9-17 us more than the model without it
 * (bf16 and fp8 MLA chunks, 7 calls; qwen3-like, 4), and the MLA DCP rank's
 * 61 runs of 72 KiB 23-25 us (4 calls) (perf/results/
 * 2026-12-04-h200-straight-alone). */
#define KVF_BATCH_ALONE_CALL_NS 2500

/* The staged route's latency for a call alone, what kvf_batch_alone_
 * outlasts_staged weighs: its copies' time at KVF_XFER_BATCH_LINK_GBPS
 * times KVF_BATCH_STAGED_ALONE_RATE thousandths plus a fixed part, its
 * launches and the piece its copies wait for: a gather's first piece,
 * which the copy engine waits for (a gather alone has no straight part:
 * staged_straight in host/core/xfer.c), or a scatter's last kernel, which
 * waits for the copy engine behind the straight part's copies. Measured on
 * an H200 (perf/results/2026-12-04-h200-straight-alone: d2 on a lease whose
 * host kept ahead of the copy engine, d6 and f1 on others), one chunk
 * alone, staged, wall time less a memcpy's overhead, over the copy at 55
 * GB/s (bf16 and fp8 MLA, the DCP rank, qwen3-like: 82-327 us copies):
 * gathers +17.5 to +22 us on d2, +24 to +36 on d6 and f1; scatters +8 to
 * +12 (+13 at most on d6). The rate keeps long copies, where the staged
 * route's batches cost 1-2% (4096 tokens at 98% of memcpy and more), on the
 * batch route; the fixed parts are about those offsets less the rate's
 * share, the gather's at the later leases'. With the calls' cost in the
 * batch route's model (KVF_BATCH_ALONE_CALL_NS), of d2's eight rows it
 * sends three scatters (not qwen3-like's) staged: right on six, one tie
 * (qwen3-like's scatter 3 us faster staged), wrong on the DCP rank's gather
 * (8 us faster staged). A gather of the fp8 MLA chunk goes staged from 157
 * us of host (batched at 190-215 us it took 1.31-1.72x a memcpy, staged
 * 1.18-1.23x), of the bf16 chunk from 248 (at 200-217 us batched 1.085-1.10x,
 * staged 1.07-1.13x: a tie), a scatter from 32 and 56 us; and a scatter of
 * 8 runs (a 6 us copy) stays batched. Before the straight part was left out
 * of gathers alone, the fp8 MLA chunk d2h staged alone took 243-258 us, and
 * the gather's part was 50 us. */
#define KVF_BATCH_STAGED_ALONE_RATE 1010
#define KVF_BATCH_STAGED_ALONE_GATHER_NS 30000
#define KVF_BATCH_STAGED_ALONE_SCATTER_NS 10000

/* Whether a batch-API call of `runs` runs alone on an idle stream, whose
 * copies take engine_ns, goes staged for its host time: at the host time
 * of each of the context's last two batch calls (last_*, before_*; scaled
 * to `runs`, from a comparable call as kvf_batch_host_bound, runs 0: none)
 * the batch route's latency alone (kvf_batch_alone_latency, first as there)
 * outlasts the staged route's: engine_ns times KVF_BATCH_STAGED_ALONE_RATE
 * thousandths plus KVF_BATCH_STAGED_ALONE_GATHER_NS (gather 1) or
 * _SCATTER_NS. A small request stays batched where its host time is over
 * its copy's but under the staged route's fixed part (less the calls'). */
int kvf_batch_alone_outlasts_staged(uint64_t last_host_ns, uint64_t last_runs, uint64_t before_host_ns,
                                    uint64_t before_runs, uint64_t runs, uint64_t first, uint64_t engine_ns,
                                    int gather);

/* One measure of the staged route's cost: a staged call's span on the GPU
 * (span_ns) in thousandths of its copies' time at the link rate
 * (engine_ns), at least 1 and at most KVF_BATCH_MAX_STAGED_COST; 0 (no
 * measure) when either is 0. */
uint64_t kvf_staged_cost_sample(uint64_t span_ns, uint64_t engine_ns);

/* The staged route's cost back to back: `fixed` when above 0
 * (KVF_XFER_BATCH_STAGED_COST), else, once n reaches
 * KVF_STAGED_COST_SAMPLES, the median of samples[0, KVF_STAGED_COST_SAMPLES)
 * (the mean of the middle two: one span that waited for other work, or
 * one short one, moves it little), else KVF_BATCH_STAGED_COST_UNMEASURED. */
uint64_t kvf_staged_cost_of(const uint64_t *samples, size_t n, int64_t fixed);

/* Whether a call that came in at start_ns is back to back with a previous
 * one that returned at prev_end_ns (0: none): within window_ns after it
 * (KVF_XFER_BATCH_BACK_TO_BACK_US; 0: never). */
int kvf_came_back_to_back(uint64_t prev_end_ns, uint64_t start_ns, uint64_t window_ns);

/* Whether a batch-API call of `runs` runs, whose copies take engine_ns at
 * KVF_XFER_BATCH_LINK_GBPS, makes them in one call instead of a ramp: it
 * came in (start_ns) within window_ns of the return (prev_end_ns; 0: none
 * yet) of the context's previous batch call, which took prev_host_ns of host
 * time for prev_runs runs, a comparable call (half to twice the runs), and
 * at that call's host time a run this call's host time outlasts its copies.
 * Calls back to back on such a host keep the copy engine waiting for the
 * host whatever the ramp does, and each of the ramp's calls costs host time:
 * measured on an H200, the fp8 MLA chunk back to back at 45.2 GB/s against
 * 50.3 for cudaMemcpyBatchAsync in one call each
 * (perf/results/2026-12-03-h200-batch-back-to-back). window_ns 0: never. */
int kvf_batch_back_to_back(uint64_t prev_host_ns, uint64_t prev_runs, uint64_t prev_end_ns, uint64_t start_ns,
                           uint64_t window_ns, uint64_t runs, uint64_t engine_ns);

/* ---- tuning: the parameters a context's routes follow --------------------- */

/* Read once from the KVF_* parameters (host/core/param.h) at context
 * creation; the benchmark and tests override them per context to measure
 * crossovers and to force a route. */
typedef struct kvf_xfer_tuning {
  int64_t pcie_sms;        /* KVF_XFER_PCIE_SMS: SM cap of direct host<->device launches */
  int64_t staging_mb;      /* KVF_XFER_STAGING_MB: each staging buffer (0: no staged route) */
  int64_t stage_sms;       /* KVF_XFER_STAGE_SMS: SM cap of the staged route's kernels */
  int64_t stage_pieces;    /* KVF_XFER_STAGE_PIECES: kernel launches per staged batch (1: one) */
  int64_t stage_growth;    /* KVF_XFER_STAGE_GROWTH: size ratio of consecutive pieces (1..16) */
  int64_t stage_edge_mb;   /* KVF_XFER_STAGE_EDGE_MB: a gather's first / a scatter's last batch (0: no limit) */
  int64_t stage_multi_pieces; /* KVF_XFER_STAGE_MULTI_PIECES: most pieces per batch of a multi-batch call (0: off) */
  int64_t stage_straight_kb; /* KVF_XFER_STAGE_STRAIGHT_KB: the edge batch's bytes the copy engine moves straight (0: off) */
  int64_t stage_straight_min_run; /* KVF_XFER_STAGE_STRAIGHT_MIN_RUN: shortest block run it moves straight */
  int64_t stage_straight_alone; /* KVF_XFER_STAGE_STRAIGHT_ALONE: 1: a gather alone (idle stream) keeps it too */
  int64_t stage_dma_batch; /* KVF_XFER_STAGE_DMA_BATCH: 1: a piece's copies are one cudaMemcpyBatchAsync */
  int64_t param_bytes;     /* KVF_XFER_PARAM_TABLE_BYTES: tables up to this size go in kernel parameters */
  int64_t task_bytes;      /* KVF_XFER_TASK_BYTES: most bytes a task moves */
  int64_t task_waves;      /* KVF_XFER_TASK_WAVES: tasks per warp a launch aims at (0: always task_bytes) */
  int64_t device_task_waves; /* KVF_XFER_DEVICE_TASK_WAVES: the same for uncapped d2d and peer launches */
  int64_t batch_min_run;   /* KVF_XFER_BATCH_MIN_RUN: smallest run for the copy-engine batch route */
  int64_t batch_max_runs;  /* KVF_XFER_BATCH_MAX_RUNS: most runs for it (0: the route is off) */
  int64_t batch_first_runs; /* KVF_XFER_BATCH_FIRST_RUNS: runs of a ramped batch's first call (0: one call) */
  int64_t batch_link_gbps;  /* KVF_XFER_BATCH_LINK_GBPS: the copy engine's rate a ramp paces by (0: doubling) */
  int64_t batch_back_to_back_us; /* KVF_XFER_BATCH_BACK_TO_BACK_US: a call this soon after a host-bound batch call
                                    makes one call (0: never); and a host-bound call this soon after the
                                    previous one may go staged behind a busy stream */
  int64_t batch_host_bound; /* KVF_XFER_BATCH_HOST_BOUND: 1: a batch request takes the staged route for its host
                               time: alone on an idle stream where the batch route's modelled latency outlasts
                               the staged route's, or host-bound behind the context's previous call alone */
  int64_t batch_staged_cost; /* KVF_XFER_BATCH_STAGED_COST: the staged route's cost that rule weighs, in
                                thousandths of the copies' time (0: modelled alone, measured back to back) */
  int64_t kernel;          /* KVF_XFER_KERNEL: 1 the grid-stride walk, 2 (or 0) the warp walk (kernels/walk.h) */
  int64_t spread_kb;       /* KVF_XFER_SPREAD_KB: uncapped launches of at least this payload spread (0: never) */
  int64_t spread_deep_kb;  /* KVF_XFER_SPREAD_DEEP_KB: spread launches of at least this payload are deep (0: never) */
  int64_t spread_deep_max_mb; /* KVF_XFER_SPREAD_DEEP_MAX_MB: ... and of less than this one (0: no limit) */
  int64_t cache_order;     /* KVF_XFER_CACHE_ORDER: 1: d2d gathers walk HND blocks in cache order */
  int64_t overlap;         /* KVF_XFER_OVERLAP: 1: uncapped d2d/peer launches overlap the previous kernel */
  int64_t small_stage_mb;  /* KVF_XFER_SMALL_STAGE_MB: staged requests of at most this payload use 2 pieces
                              (1 for one batch with a straight part: small_stage_one_piece) and at least
                              KVF_SMALL_STAGE_SMS SMs (0: off) */
  int64_t small_stage_growth; /* KVF_XFER_SMALL_STAGE_GROWTH: their pieces' size ratio (1..16) */
  int64_t small_stage_one_piece; /* KVF_XFER_SMALL_STAGE_ONE_PIECE: 1: such a request of one batch with a
                                    straight part is one piece, the straight part a tenth of it or more;
                                    0: 2 pieces all the same */
} kvf_xfer_tuning;

/* The staged route's kernels for a small request (KVF_XFER_SMALL_STAGE_MB). */
#define KVF_SMALL_STAGE_SMS 64
#define KVF_SMALL_STAGE_PIECES 2
/* Such a request in one piece moves 1/this of its batch straight, or more. */
#define KVF_SMALL_STAGE_STRAIGHT_SHARE 10

void kvf_xfer_tuning_from_params(kvf_xfer_tuning *out);

/* Whether a spread launch moving `payload` bytes is deep under tuning t:
 * at least spread_deep_kb KiB (not 0) and, where spread_deep_max_mb is not
 * 0, under that many MiB (kernels/xfer_kernel.cu, WalkShape, has the
 * measurements). */
int kvf_spread_is_deep(const kvf_xfer_tuning *t, uint64_t payload);

/* Replace a context's tuning (not while calls run on it; KVF_ERR_INVALID_ARGUMENT
 * for values out of range: negative, or task_bytes not 16..65536). */
kvf_status kvf_xfer_set_tuning(kvf_xfer *xfer, const kvf_xfer_tuning *tuning);
void kvf_xfer_get_tuning(const kvf_xfer *xfer, kvf_xfer_tuning *out);

/* ---- ready before the first call ------------------------------------------ */

/* Classify region_bases[0 .. num_regions) as a call's route_of does and
 * remember those in device memory, so a first call with these bases makes
 * no pointer query for them (one cudaPointerGetAttributes per region, up to
 * 23 us on an 80-region geometry). For a caller that knows the bases before
 * its first call (kvferryd, once a registration's memory is mapped). A base
 * a call would refuse is left for that call to refuse, naming the field:
 * nothing is remembered for it and KVF_SUCCESS is still returned. Host
 * contexts: nothing to do. Returns KVF_ERR_INVALID_ARGUMENT for NULLs. Not
 * while calls run on the context. */
kvf_status kvf_xfer_prepare_regions(kvf_xfer *xfer, void *const *region_bases);

/* How the last successful call on a context moved its bytes. */
typedef enum kvf_xfer_path {
  KVF_PATH_NONE = 0,
  KVF_PATH_HOST,           /* host backend */
  KVF_PATH_KERNEL,         /* one kernel launch */
  KVF_PATH_STAGED,         /* kernels through the staging buffers and the copy engine */
  KVF_PATH_COPY_BATCH      /* cudaMemcpyBatchAsync of the request's runs, no kernel */
} kvf_xfer_path;

typedef struct kvf_xfer_path_info {
  kvf_xfer_path path;
  uint32_t launches;       /* kernel launches */
  uint32_t param_launches; /* of those, with their tables in the kernel parameters */
  uint32_t spread_launches; /* of those, spread over every SM in small CTAs (KVF_XFER_SPREAD_KB; d2d, peers) */
  uint32_t deep_launches;  /* of those, deep: twice the loads in flight a lane (KVF_XFER_SPREAD_DEEP_KB) */
  uint32_t overlap_launches; /* of those, programmatic dependents of the stream's previous kernel (KVF_XFER_OVERLAP) */
  uint32_t cache_order;    /* 1: the (last) launch asked its warp walk for the cache's order on head-major
                              blocks (a d2d gather; other blocks keep the object's) */
  uint32_t uploads;        /* table uploads (host -> device copies before a launch) */
  uint32_t batches;        /* staged batches */
  uint32_t pieces;         /* staged pieces per batch */
  uint64_t dma_ops;        /* copy-engine calls (memcpy or batch calls) */
  uint64_t dma_runs;       /* byte ranges they copy */
  uint64_t straight_runs;  /* of those, runs a staged call's copy engine moves straight (KVF_XFER_STAGE_STRAIGHT_KB) */
  uint64_t straight_bytes; /* and their payload bytes (counted as a blob counts them) */
  uint32_t slice_bytes;    /* task size of the (last) launch */
  double host_us;          /* host time of the call, from entering to returning */
  double plan_us;          /* of host_us, the part before its first enqueue: checks, route, tables, runs */
  uint32_t deferred;       /* 1: planned and enqueued by the context's thread (a deferred call); host_us is its time */
  uint32_t host_bound;     /* 1: staged although the batch route fits, for the batch route's host time
                              (KVF_XFER_BATCH_HOST_BOUND: alone, its modelled latency; back to back, the host
                              slower than the staged route's period) */
  uint64_t staged_cost;    /* after the call, the staged route's cost back to back that the host-bound
                              rule weighs, in thousandths of the copies' time (kvf_staged_cost_of) */
  uint64_t staged_cost_measures; /* the context's measures of it since the tuning last changed how it is weighed
                                    (KVF_XFER_BATCH_STAGED_COST 0) */
  uint32_t back_to_back;   /* 1: the host-bound rule weighed this call as one back to back (the stream busy with
                              the context's previous call), so against staged_cost; 0: alone, or not asked */
  uint32_t batch_listed;   /* 1: the call built its request's batch-API runs (KVF_PATH_COPY_BATCH, or refused
                              there: too many runs, too short, or staged by the host-bound rule once listed) */
  double idle_wait_us;     /* of host_us, the time the call waited for its stream to become idle (a call alone
                              the host-bound rule weighs, a small gather's straight part, the batch route's
                              ramp: stream_idle_soon) */
  uint32_t runs_cached;    /* staged pieces whose copy-engine runs came from the context's cache
                              (kvf_stage_blob_runs_cached) */
  uint32_t blobs_cached;   /* the call's blobs that came from the context's memo (kvf_blob_build_memo) */
} kvf_xfer_path_info;

const char *kvf_xfer_path_name(kvf_xfer_path path);
void kvf_xfer_last_path(const kvf_xfer *xfer, kvf_xfer_path_info *out);

/* ---- test hooks (the CUDA backend) --------------------------------------- */

/* Make every later staged call refuse the kernel launch of its batch `batch`
 * (0-based; -1: off, the default), as if the CUDA runtime had returned
 * cudaErrorLaunchOutOfResources there. Whatever the call enqueued before
 * that launch stays enqueued, exactly as with a real refusal: a gather has
 * enqueued batches [0, batch) whole and nothing of batch `batch` that
 * writes an object; a scatter has enqueued batches [0, batch) whole and the
 * copy-engine fill of batch `batch`'s staging buffer, which writes no block.
 * Calls with fewer batches are not affected. */
void kvf_xfer_test_fail_at_batch(int64_t batch);

/* Bytes of each of the context's two staging buffers (0 until they are
 * allocated): the most a batch may hold. Calls batch by KVF_XFER_STAGING_MB
 * (at least one chunk) within it, which is this size on a fresh context
 * whose tuning did not change. Not synchronized with calls in flight. */
size_t kvf_xfer_test_stage_bytes(const kvf_xfer *xfer);

/* The context's internal copy-engine stream (a cudaStream_t), to check that
 * a call left no work on it behind the caller's stream. NULL on the host
 * backend. */
kvf_stream kvf_xfer_test_ce_stream(const kvf_xfer *xfer);

#ifdef __cplusplus
}
#endif

#endif /* KVF_HOST_XFER_INTERNAL_H */
