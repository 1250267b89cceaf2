// Internal: the warp walk of a launch blob (kernels/plan.h), shared by the
// CUDA kernel (kernels/xfer_kernel.cu) and a CPU emulation in the tests, which
// compile this very code for the host and run it lane by lane.
//
// Work split: warp w of W takes the contiguous task range
// [T*w/W, T*(w+1)/W) of the blob's T tasks, not every W-th task. Its first
// task's entry comes from the header's multiplier where the entries hold as
// many tasks each, else from the blob's task -> entry table (one read and a
// short forward scan), and consecutive tasks of one block (its slices) are
// one unit range copied in one loop: a warp decodes each block it touches
// once, where the grid-stride walk decoded every task (a binary search over
// the entries, the id, the object: a chain of dependent loads per 512 to
// 8192 bytes; the first H200 run measured one-chunk D2D 6-10% faster with
// 16 KiB tasks than with 4 KiB, and 30-40% slower with 1 KiB:
// perf/results/2026-12-01-h200-run1/cross.json, task_waves variants).
//
// Addressing: lanes copy consecutive units of `vec` bytes, 32 apart per
// unrolled step, so the warp's accesses stay coalesced. A run-contiguous
// entry (heads fused, tokens back to back on both sides) puts unit u at
// u*vec on both sides. Otherwise unit u is (token, head, column) of the
// block; each lane divides once per block and then steps 32 units with two
// compares and adds, instead of two 32-bit divisions per unit and side (the
// grid-stride kernel spent about 120 instructions per 16-byte unit there:
// HND's 256-byte runs reached 13 GB/s per SM, 1095 of 1660 GB/s D2D at one
// chunk, 53 GB/s at 4 SMs; NHD's contiguous runs 35 GB/s per SM).
//
// Order: units follow the object's order (token, head, column) unless the
// blob asks for the cache's order (header cache_order) and the block is a
// gather's head-major one (HND: a head's tokens back to back in the cache,
// a token's heads back to back in the object): then heads are outermost and
// the reads walk the cache's addresses while the writes stride, which L2
// absorbs. Measured on an H200 (perf/results/2026-12-01-h200-d2d): Llama HND
// one chunk d2d 80.7 -> 82.0% of memcpy, 4096 tokens 89.5 -> 91.9%.
//
// Start: a warp's first loads wait for its whole decode (header, task ->
// entry table, entry, id and shape, object), a chain of dependent table
// reads and divisions that a plain copy kernel does not have: on an H200,
// Nsight Compute timed the one-chunk MLA kernel at 12.5 us against 10.2 us
// for a plain copy of the same 8 KiB tasks, 4.4x its instructions
// (perf/results/2026-12-02-h200-ramp/probe.md). So a task a warp takes
// no division to find its task, the first chunk of a request none to find
// its object, and a gather asks L2 for its first round's lines as soon as
// it knows its cache block, while it still decodes the object's side
// (prefetch_first_round). Measured there (walk.md, per call, of memcpy):
// one chunk +1 to +5 points on every preset (MLA 82 -> 84.5%, the DCP rank
// 69 -> 74%, Llama HND 84 -> 86.7%, the tp4 slice 79 -> 82%); 4096 tokens
// +0 to +1.6. Then no division and one table level less on the way: the
// block of a task by the entry's multiplier (slices_magic), its object
// index without dividing by the block's tokens (the entry's lb_rel and the
// shape's blocks_per_chunk), the first chunk's object read with the entry (its
// object_group), and a task's entry by the header's multiplier where every
// entry has as many tasks (no task -> entry table read). Measured on an H200
// (perf/results/2026-12-02-h200-decode, ab.md, per call, one chunk):
// +0.2 to +3.4 points on 13 of 14 presets (MLA 85.0 -> 86.1%, the DCP rank
// 72.6 -> 76.0%, the fp8 Llama 82.9 -> 85.5%), the glm-like hybrid -1.2.
// What is left is latency, not instructions: a build whose copy loop had a
// third of the instructions (no predicates or per-unit addresses in whole
// rounds, no R2UR) measured the same per call, and 512 more instructions
// before each warp's first load cost nothing, where half a microsecond of
// waiting there cost each call half a microsecond (perf/results/
// 2026-12-02-h200-d2d-start). Hence one round of table reads per block
// (copy_block).
//
// Overlap: a launch that overlaps the stream's previous kernel (kernels/
// launch.h) reads only its blob, in its parameters, until each warp has
// decoded its first block; the warp then waits for that kernel
// (wait_previous_grid) before its first load or store.
//
// Every lane of a warp computes the same block decode (uniform values); no
// lane reads another's registers, so running lanes one after another on the
// CPU is exactly the GPU's result (sources and destinations never overlap).
#ifndef KVF_KERNELS_WALK_H
#define KVF_KERNELS_WALK_H

#include <stdint.h>

#include "kernels/plan.h"

#if defined(__CUDACC__)
#include <vector_types.h>
#endif

#if defined(__CUDACC__)
#define KVF_WALK_FN __host__ __device__ __forceinline__
#define KVF_WALK_UNROLL _Pragma("unroll")
#else
#define KVF_WALK_FN inline
#define KVF_WALK_UNROLL
#endif

namespace kvf_walk {

constexpr uint32_t kLanes = 32;

#if defined(__CUDACC__)
using Vec16 = uint4;
using Vec8 = uint2;
#else
struct alignas(16) Vec16 {
  uint32_t x, y, z, w;
};
struct alignas(8) Vec8 {
  uint32_t x, y;
};
#endif

template <int V> struct Unit;
template <> struct Unit<16> { using T = Vec16; };
template <> struct Unit<8> { using T = Vec8; };
template <> struct Unit<4> { using T = uint32_t; };
template <> struct Unit<2> { using T = uint16_t; };
template <> struct Unit<1> { using T = uint8_t; };

KVF_WALK_FN uint64_t min64(uint64_t a, uint64_t b) { return a < b ? a : b; }

// A non-contiguous block's units: unit u is (token, head, column) with
// u = (token*heads + head)*upr + column, at byte offset
// token*tok_stride + head*head_stride + column*vec on one side. Offsets
// inside one block fit 32 bits (plan.c marks segments where they do not,
// and such requests take the grid-stride kernel).
struct Shape {
  uint32_t upr, heads, upt;  // units per run, runs per token, units per token
  uint32_t sh, sc;           // 32 units = some tokens + sh heads + sc columns
};

KVF_WALK_FN Shape shape_of(uint32_t upr, uint32_t heads) {
  Shape s;
  s.upr = upr;
  s.heads = heads;
  s.upt = upr * heads;
  uint32_t sr = kLanes % s.upt;
  s.sh = sr / upr;
  s.sc = sr - s.sh * upr;
  return s;
}

// One side's offset deltas (mod 2^32): a 32-unit step, a column carry
// (column - upr, head + 1), a head carry (head - heads, token + 1).
struct Deltas {
  uint32_t step, col, head;
};

KVF_WALK_FN Deltas deltas_of(const Shape &s, uint32_t tok_stride, uint32_t head_stride, uint32_t vec) {
  Deltas d;
  d.step = (kLanes / s.upt) * tok_stride + s.sh * head_stride + s.sc * vec;
  d.col = head_stride - s.upr * vec;
  d.head = tok_stride - s.heads * head_stride;
  return d;
}

// Where a lane is: head and column of its unit, and the unit's offset on
// the side being walked.
struct Pos {
  uint32_t hd, c, off;
};

// p + 32 units: c + sc < 2*upr and hd + sh + 1 < 2*heads (sh < heads, as
// 32 mod upt < heads*upr), so at most one carry each.
KVF_WALK_FN void step(const Shape &s, const Deltas &d, Pos &p) {
  p.c += s.sc;
  p.hd += s.sh;
  p.off += d.step;
  if (p.c >= s.upr) {
    p.c -= s.upr;
    p.hd++;
    p.off += d.col;
  }
  if (p.hd >= s.heads) {
    p.hd -= s.heads;
    p.off += d.head;
  }
}

// The strides one block's units need: token and head strides of both
// sides (32 bits: see Shape), and the run's shape.
struct Strides {
  uint32_t src_token, src_head, dst_token, dst_head;
  uint32_t upr, heads;
};

// Loads in flight per lane before its stores: 8 of 16 bytes (128 bytes a
// lane, 4 KiB a warp), 16 of narrower units (rows like 132 or 656 bytes),
// times a launch shape's Deep (a spread launch's 2: one 8 KiB task a round;
// kernels/xfer_kernel.cu, WalkShape, says why).
KVF_WALK_FN constexpr uint32_t depth_of(uint32_t vec) { return vec >= 16 ? 8 : 16; }
template <int V> struct Depth { static constexpr int n = (int)depth_of(V); };

// Units [ub, ue) of one block, this lane's share; linear: unit u at u*V on
// both sides. Slots past the end are predicated off, not broken out of: a
// `break` in the unrolled loop made ptxas keep the narrow units' values in
// local memory, each load waited for by its spill store. The 32-bit unit
// indices do not wrap: a round is at most 1024 units past ue, and
// kvf_plan_build refuses blocks of 2 GiB or more.
template <int V, int Deep>
KVF_WALK_FN void copy_units(Strides st, bool linear, const char *src, char *dst, bool gather, uint32_t ub,
                              uint32_t ue, uint32_t lane) {
  using T = typename Unit<V>::T;
  constexpr int U = Depth<V>::n * Deep;
  const uint32_t first = ub + lane;
  if (first >= ue) return;
  if (linear) {
    for (uint32_t base = first; base < ue; base += kLanes * U) {
      T v[U];
KVF_WALK_UNROLL
      for (int i = 0; i < U; i++) {
        uint32_t u = base + i * kLanes;
        T x = {};  // defined on every path: no value carried between rounds
        if (u < ue) x = *reinterpret_cast<const T *>(src + (uint64_t)u * V);
        v[i] = x;
      }
KVF_WALK_UNROLL
      for (int i = 0; i < U; i++) {
        uint32_t u = base + i * kLanes;
        if (u < ue) *reinterpret_cast<T *>(dst + (uint64_t)u * V) = v[i];
      }
    }
    return;
  }
  // The source side walked in the load phase, the destination side in the
  // store phase, both from the round's first position.
  const uint32_t s_tok = gather ? st.src_token : st.dst_token, s_head = gather ? st.src_head : st.dst_head;
  const uint32_t d_tok = gather ? st.dst_token : st.src_token, d_head = gather ? st.dst_head : st.src_head;
  const Shape sh = shape_of(st.upr, st.heads);
  const Deltas ds = deltas_of(sh, s_tok, s_head, V), dd = deltas_of(sh, d_tok, d_head, V);
  const uint32_t tok = first / sh.upt, r = first - tok * sh.upt, hd = r / sh.upr, c = r - hd * sh.upr;
  Pos at_s = {hd, c, tok * s_tok + hd * s_head + c * (uint32_t)V};
  Pos at_d = {hd, c, tok * d_tok + hd * d_head + c * (uint32_t)V};
  for (uint32_t base = first; base < ue; base += kLanes * U) {
    T v[U];
    Pos p = at_s;
KVF_WALK_UNROLL
    for (int i = 0; i < U; i++) {
      uint32_t u = base + i * kLanes;
      T x = {};
      if (u < ue) x = *reinterpret_cast<const T *>(src + p.off);
      v[i] = x;
      step(sh, ds, p);
    }
    at_s = p;  // U steps on: the next round's start (when there is one)
    p = at_d;
KVF_WALK_UNROLL
    for (int i = 0; i < U; i++) {
      uint32_t u = base + i * kLanes;
      if (u < ue) *reinterpret_cast<T *>(dst + p.off) = v[i];
      step(sh, dd, p);
    }
    at_d = p;
  }
}

// Wait for the grid this one may overlap (a programmatic dependent launch:
// kvf_kernel_launch_params' overlap) to complete and its writes to be
// visible. Everything before it reads only the blob, which a launch that
// overlaps carries in its parameters. Returns at once in a grid launched
// without the overlap, and on the CPU.
KVF_WALK_FN void wait_previous_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Ask L2 for the 128-byte line at p (a no-op on the CPU). A gather's first
// loads depend on the whole decode; its source is known earlier than its
// object, so the line's trip from memory overlaps the rest of the decode.
#if !defined(__CUDA_ARCH__)
// Host builds only: the tests watch the lines a walk asks for.
inline void (*prefetch_hook)(const char *) = nullptr;
#endif

KVF_WALK_FN void prefetch_line(const char *p) {
#if defined(__CUDA_ARCH__)
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
#else
  if (prefetch_hook) prefetch_hook(p);
#endif
}

// t / d by the multiplier m = ceil(2^32 / d) the blob carries for d
// (kernels/plan.c, multiplier_exact: the build sets one only where it is
// exact, and there t < 2^32).
KVF_WALK_FN uint64_t mul_div(uint64_t t, uint32_t m) { return ((uint64_t)(uint32_t)t * m) >> 32; }

// 64-bit quotient, through 32 bits when both fit (one block's decode).
KVF_WALK_FN uint64_t div64(uint64_t a, uint64_t b) {
  if (((a | b) >> 32) == 0) return (uint32_t)a / (uint32_t)b;
  return a / b;
}

// A shape's blocks are each one contiguous range on both sides (heads
// fused, tokens back to back, or a state): unit u at u*vec.
KVF_WALK_FN bool linear_of(const kvf_blob_shape *sh) { return kvf_blob_shape_linear(sh) != 0; }

// What a block's decode reads of its shape, in one round (copy_block says
// why). Field by field rather than a copy of the whole kvf_blob_shape: the
// copy measured 0.3 points of memcpy slower per one-chunk call on average
// (H200, three runs of each build; perf/results/2026-12-02-h200-d2d-start).
struct ShapeFields {
  uint64_t src_block, src_token, src_head, dst_block, dst_token, dst_head, units_per_token;
  uint64_t slice_units, blocks_per_chunk;
  uint32_t run, heads, tokens, recurrent, units_per_run, vec;
};

KVF_WALK_FN ShapeFields shape_fields(const kvf_blob_shape *sh) {
  ShapeFields f;
  f.src_block = sh->src_block;
  f.src_token = sh->src_token;
  f.src_head = sh->src_head;
  f.dst_block = sh->dst_block;
  f.dst_token = sh->dst_token;
  f.dst_head = sh->dst_head;
  f.units_per_token = sh->units_per_token;
  f.slice_units = sh->slice_units;
  f.blocks_per_chunk = sh->blocks_per_chunk;
  f.run = sh->run;
  f.heads = sh->heads;
  f.tokens = sh->tokens;
  f.recurrent = sh->recurrent;
  f.units_per_run = sh->units_per_run;
  f.vec = sh->vec;
  return f;
}

KVF_WALK_FN bool linear_of(const ShapeFields &f) {
  return kvf_blocks_linear(f.heads, f.tokens, f.run, f.src_token, f.dst_token) != 0;
}

// Whether a block of shape f is walked in the cache's order: the blob asks
// for it (cache_order, the header's), it is a gather, and the cache is
// head-major (a head's tokens back to back, HND) while the units' order is
// token-major.
KVF_WALK_FN bool cache_order_of(bool cache_order, bool gather, const ShapeFields &f) {
  return cache_order && gather && !linear_of(f) && !f.recurrent && f.heads > 1 && f.src_head > f.src_token;
}
KVF_WALK_FN bool cache_order_of(const kvf_blob_header *h, const kvf_blob_shape *sh) {
  return cache_order_of(h->cache_order != 0, h->gather != 0, shape_fields(sh));
}

// The strides a non-linear block moving `units` units is walked with.
// In the cache's order heads are outermost, then the block's valid tokens:
// the same units, each to the same place, in another order (every warp of
// the block takes the same order, so the slices still split it exactly).
KVF_WALK_FN Strides strides_of(bool cache_order, bool gather, const ShapeFields &f, uint64_t units) {
  Strides st;
  st.src_token = (uint32_t)f.src_token;
  st.src_head = (uint32_t)f.src_head;
  st.dst_token = (uint32_t)f.dst_token;
  st.dst_head = (uint32_t)f.dst_head;
  st.upr = f.units_per_run;
  st.heads = f.heads;
  if (cache_order_of(cache_order, gather, f)) {
    st.src_token = (uint32_t)f.src_head;
    st.dst_token = (uint32_t)f.dst_head;
    st.src_head = (uint32_t)f.src_token;
    st.dst_head = (uint32_t)f.dst_token;
    st.heads = (uint32_t)div64(units, f.units_per_token);
  }
  return st;
}
KVF_WALK_FN Strides strides_of(const kvf_blob_header *h, const kvf_blob_shape *sh, uint64_t units) {
  return strides_of(h->cache_order != 0, h->gather != 0, shape_fields(sh), units);
}

// A gather's first round of loads from the cache, one 128-byte line a lane:
// lane i asks for the line of the unit 128*i bytes into the round, in the
// walk's order (copy_units' addressing), so that the lines come from memory
// while the walk still decodes the object's side. Units [ub, ue) of a block
// whose offsets fit 32 bits (Shape); deep: the launch shape's (depth_of).
KVF_WALK_FN void prefetch_first_round(const Strides &st, bool linear, const char *cache, uint32_t vec, uint64_t ub,
                                      uint64_t ue, uint32_t lane, uint32_t deep) {
  const uint64_t round = (uint64_t)kLanes * depth_of(vec) * deep;
  if (linear) {
    // The round's bytes are one range: no division on the way (a per-lane
    // 128 / vec here cost the linear gathers about a point).
    const uint64_t bytes = min64(ue - ub, round) * vec, at = (uint64_t)lane * 128;
    if (at < bytes) prefetch_line(cache + ub * vec + at);
    return;
  }
  const uint32_t per_line = vec >= 16 ? 8 : vec == 8 ? 16 : vec == 4 ? 32 : vec == 2 ? 64 : 128;  // 128 / vec
  const uint64_t u = ub + (uint64_t)lane * per_line;
  if (u >= ue || u >= ub + round) return;
  const uint32_t upt = st.upr * st.heads, uu = (uint32_t)u;
  const uint32_t tok = uu / upt, r = uu - tok * upt, hd = r / st.upr, c = r - hd * st.upr;
  prefetch_line(cache + (uint64_t)tok * st.src_token + (uint64_t)hd * st.src_head + (uint64_t)c * vec);
}

// Tasks [s0, s1) of block j of entry x (its slices): decode the block once,
// then copy the units those slices cover. The same formulas as plan.c's
// block_of and the grid-stride kernel's decode. *waited: whether this warp
// has waited for the previous grid (wait_previous_grid) yet.
//
// The decode's table reads go in one round after the entry's: the id and
// the shape's fields depend on the entry alone (the region's base is in the
// entry), and the first way out (a skipped block, an empty range) comes only after
// everything is computed from them, because ptxas moves a read below an
// early return that precedes its use: the id, the shape and the region were
// read one after another, each waiting for the last. (The first chunk's
// object, first used after the way out, is still read there.) Measured on
// an H200 (perf/results/2026-12-02-h200-d2d-start): half a microsecond of
// delay before each warp's first load made every one-chunk device-to-device
// call half a microsecond longer; this order, one chunk per call, +0.1 to
// +1.8 points of memcpy on every preset, mean +0.97 (three runs of each
// build, alternating); 4096 tokens within half a point but the
// gpt-oss-like +1.4 (one run against two).
template <int Deep>
KVF_WALK_FN void copy_block(const kvf_blob_header *h, const char *blob, const kvf_blob_entry *x, uint64_t j,
                            uint64_t s0, uint64_t s1, uint32_t lane, bool *waited) {
  const uint32_t ids_offset = x->ids_offset, shape = x->shape, group = x->object_group;
  const uint64_t rel = x->lb_rel + j, cache_base = x->cache_base, dst_per_token = x->dst_per_token,
                 dst_const = x->dst_const;
  const uint32_t id = reinterpret_cast<const uint32_t *>(blob + h->off_ids)[ids_offset + j];
  const ShapeFields f = shape_fields(reinterpret_cast<const kvf_blob_shape *>(blob + h->off_shapes) + shape);
  const uint64_t *objects = reinterpret_cast<const uint64_t *>(blob + h->off_objects);
  const uint64_t first_object = objects[group];
  const uint64_t cl = h->chunk_local, lt_begin = h->lt_begin, lt_end = h->lt_end;
  const uint32_t num_blocks_max = h->num_blocks_max, num_object_groups = h->num_object_groups;
  const bool gather = h->gather != 0, cache_order = h->cache_order != 0;
  // The host checked every id; this bound keeps a corrupted table harmless.
  const bool skip = id == KVF_BLOCK_SKIP || id >= num_blocks_max;
  uint64_t k, units, obj_off;
  if (f.recurrent) {
    k = rel;  // chunks from the request's first
    units = f.units_per_run;
    obj_off = cl * dst_per_token + dst_const;
  } else {
    // Blocks from the request's first (its first token starts a block); the
    // request's first chunk (all of a one-chunk request) divides nothing.
    const uint64_t d = rel, per_chunk = f.blocks_per_chunk;
    k = d < per_chunk ? 0 : div64(d, per_chunk);
    uint64_t n = min64(lt_end - (lt_begin + k * cl), cl);
    uint64_t valid = min64(lt_end - (lt_begin + d * f.tokens), (uint64_t)f.tokens);
    units = valid * f.units_per_token;
    obj_off = n * dst_per_token + dst_const + (d - k * per_chunk) * f.dst_block;
  }
  const uint64_t su = f.slice_units;
  const uint64_t ub = s0 * su, ue = min64(s1 * su, units);
  const uint64_t cache_at = cache_base + (uint64_t)id * f.src_block;
  const bool linear = linear_of(f);
  Strides st = {};
  if (!linear) st = strides_of(cache_order, gather, f, units);
  // The first way out only now: the compiler moves a read below an early
  // return that comes before its use, and the reads above then waited for
  // the id's.
  if (skip || ub >= ue) return;
  char *cache = reinterpret_cast<char *>(cache_at);
  if (!*waited) {
    wait_previous_grid();
    *waited = true;
  }
  // A gather's first lines, asked for before the object's side is decoded.
  if (gather) prefetch_first_round(st, linear, cache, f.vec, ub, ue, lane, Deep);
  // An object left out of this blob (another leg of the call moves it).
  uint64_t object = k == 0 ? first_object : objects[k * num_object_groups + group];
  if (object == 0) return;
  char *obj = reinterpret_cast<char *>(object) + obj_off;
  const char *src = gather ? cache : obj;
  char *dst = gather ? obj : cache;
  const uint32_t b = (uint32_t)ub, e = (uint32_t)ue;
  switch (f.vec) {
    case 16: copy_units<16, Deep>(st, linear, src, dst, gather, b, e, lane); break;
    case 8: copy_units<8, Deep>(st, linear, src, dst, gather, b, e, lane); break;
    case 4: copy_units<4, Deep>(st, linear, src, dst, gather, b, e, lane); break;
    case 2: copy_units<2, Deep>(st, linear, src, dst, gather, b, e, lane); break;
    default: copy_units<1, Deep>(st, linear, src, dst, gather, b, e, lane); break;
  }
}

// Warp `warp` of `warps`: its contiguous range of the blob's tasks, block by
// block. `lane` is this thread's lane (0..31); Deep: the launch shape's
// loads in flight (depth_of).
template <int Deep = 1>
KVF_WALK_FN void run_warp(const char *blob, uint64_t warp, uint64_t warps, uint32_t lane) {
  const kvf_blob_header *h = reinterpret_cast<const kvf_blob_header *>(blob);
  const uint64_t total = h->total_tasks;
  uint64_t t, t1;
  if (warps >= total) {
    // A task a warp (a spread launch), the first `total` warps: no division
    // on the way to the first load.
    if (warp >= total) return;
    t = warp;
    t1 = warp + 1;
  } else {
    // total * warp fits 64 bits: tasks are at least 16 bytes, warps a few thousand.
    t = total * warp / warps;
    t1 = total * (warp + 1) / warps;
    if (t >= t1) return;
  }
  const kvf_blob_entry *entries = reinterpret_cast<const kvf_blob_entry *>(blob + h->off_entries);
  const uint16_t *buckets = reinterpret_cast<const uint16_t *>(blob + h->off_buckets);
  const uint32_t n = h->num_entries;
  // Entries of equal task counts (header entry_tasks_magic) give a task's
  // entry by a multiplier; the others by the table and a short scan.
  const uint32_t entry_magic = h->entry_tasks_magic;
  uint32_t e = entry_magic ? 0 : buckets[t >> h->bucket_shift];
  bool waited = false;
  while (t < t1) {
    // The entry holding task t: forward from the table's (or the last) one.
    // Its fields are read with the next entry's first task, not after it.
    if (entry_magic) e = (uint32_t)mul_div(t, entry_magic);
    const kvf_blob_entry *x = &entries[e];
    if (!entry_magic)
      while (e + 1 < n && entries[e + 1].first_task <= t) x = &entries[++e];
    // The block of the entry's local task, by the entry's multiplier where
    // it has one (kvf_blob_entry.slices_magic: exact for all its tasks).
    const uint64_t slices = x->slices, first_task = x->first_task, local = t - first_task;
    // The multiplier used before any test, so that it is read with the
    // entry's other fields (see copy_block); a division only where the
    // entry has none.
    const uint32_t slices_magic = x->slices_magic;
    uint64_t j = slices == 1 ? local : mul_div(local, slices_magic);
    if (slices != 1 && slices_magic == 0) j = div64(local, slices);
    const uint64_t s = local - j * slices;
    // This block's remaining slices, up to the warp's last task.
    const uint64_t next = min64(t1, first_task + (j + 1) * slices);
    copy_block<Deep>(h, blob, x, j, s, s + (next - t), lane, &waited);
    t = next;
  }
}

}  // namespace kvf_walk

#endif
