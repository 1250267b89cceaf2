/* perf/bench_peers.h - the peers' transfer kernels as baselines: our own
 * implementations of the published designs, run on the same blocks and
 * objects as kvferry and checked against the CPU reference like every
 * contender (kvf_bench.cu).
 *
 * Facts taken from the published code (read, not copied):
 *   - LMCache multiprocess block kernel (csrc/cuda/mp_mem_kernels.cu,
 *     multi_layer_block_transfer_kernel; csrc/mp/src/native_transfer_kernel.cu):
 *     grid (planes, blocks, layers), one CTA per (plane, block, layer);
 *     threads (x: min(units per head, 32), y: heads (at most 32), z: tokens,
 *     min(block size, 1024 / (x*y), 64)); head rows moved as 16-, 4- or
 *     2-byte units (the widest dividing the head's bytes); 16-byte units with
 *     ld.global.cs / st.global.cs. The MP server runs it on device
 *     temporaries and copies them to and from host memory with one memcpy
 *     each (execute_object_group_transfer): "lmcache-mp-staged" here; the
 *     kernel alone on host objects is "lmcache-mp".
 *   - LMCache's legacy kernel (csrc/mem_kernels.cu,
 *     load_and_reshape_multi_layer_kernel): grid (tokens, layers, planes),
 *     one CTA per (token, layer, plane), min(8-byte words per token, 128)
 *     threads striding the token's row in 8-byte units, writing host memory
 *     directly (pinned, mapped).
 *   - SGLang HiCache IO (sgl-kernel/csrc/kvcacheio/transfer.cu
 *     transfer_kv_all_layer; python/sglang/jit_kernel/csrc/hicache.cuh):
 *     one warp per (token) item looping every layer, K then V; 8-byte units
 *     (ld.global.nc / st.global.cg); num_warps_per_block 32 (1024 threads),
 *     items_per_warp = ceil(items / (block_quota * 32)), CTAs =
 *     ceil(items / (items_per_warp * 32)): about block_quota CTAs (default
 *     2; "sglang-q<N>" runs N, e.g. the SM count).
 *
 * Generalised where our presets need it and the published kernels assume a
 * layout: heads with a stride (HND) are walked head by head, units narrow
 * to what the run, strides and pointers allow, and per-(layer, plane, block)
 * base pointers are precomputed on the host (each design's own slot or
 * block-id arithmetic is what those pointers replace). Recurrent states are
 * outside every peer's design: such presets report "not applicable". */
#ifndef KVF_PERF_BENCH_PEERS_H
#define KVF_PERF_BENCH_PEERS_H

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <kvferry/copy.h>

#include "bench_peers_plan.h"
#include "bench_plan.h"

namespace kvfb {

enum class PeerDesign { LmcacheMp, LmcacheMpStaged, LmcacheLegacy, Sglang };

struct Peer {
  std::string name;
  PeerDesign design;
  int quota = 2; /* SGLang: CTAs (block_quota) */
};

/* The peers a run measures: names from "lmcache-mp, lmcache-mp-staged,
 * lmcache-legacy, sglang-q2, sglang-q<N>, sglang-qsm" (qsm: the SM count). */
std::vector<Peer> peers_from_list(const std::string &list, int sm_count);

struct PeerTables; /* device tables of one request (one buffer set) */

struct PeerTablesDeleter {
  void operator()(PeerTables *t) const;
};
using PeerTablesPtr = std::unique_ptr<PeerTables, PeerTablesDeleter>;

/* Build the device tables for `request` (its region bases and objects as the
 * kernels will reach them, the objects at `arena` + layout offsets) moving in
 * direction `gather`. objects_in_host: the objects are host memory (the
 * staged design then gets device temporaries laid out like the objects, and
 * one memcpy per object). Returns NULL with *why set when the request is
 * outside the designs (recurrent states). */
PeerTablesPtr peer_prepare(const kvf_geometry *g, const kvf_copy_request &request, bool gather, bool objects_in_host,
                           char *arena, const ObjectLayout &layout, std::string *why);

/* Enqueue one transfer of `t` with `peer`'s design on `s` (throws on a CUDA
 * error). Returns "" or why this design does not apply to these tables
 * (then nothing is enqueued). */
std::string peer_launch(const Peer &peer, const PeerTables &t, cudaStream_t s);

/* One line: the design's launch shape for these tables (for the JSON). */
std::string peer_shape(const Peer &peer, const PeerTables &t);

} // namespace kvfb

#endif
