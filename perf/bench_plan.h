/* perf/bench_plan.h - what one benchmark request moves, worked out on the
 * host from the public geometry API: block tables, object layout, and the
 * list of contiguous runs (source, destination, bytes) that the baselines
 * copy one by one or in a batch.
 *
 * The run list follows the CPU reference (geometry/copy.c) formula for
 * formula, in object order, merging runs that are contiguous on both sides;
 * kvf_runs_check proves it moves exactly the reference's bytes for every
 * preset. Host only: nothing here touches a GPU. */
#ifndef KVF_PERF_BENCH_PLAN_H
#define KVF_PERF_BENCH_PLAN_H

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <kvferry/copy.h>

namespace kvfb {

/* The blocks a request of `tokens` tokens (global [0, tokens)) moves: what a
 * store of that prefix moves in the engine. Full groups: every block; windowed
 * groups: the retained window; recurrent groups: the state at the prefix's end
 * (one slot, only when tokens is a multiple of chunk_tokens). */
struct Tables {
  std::vector<std::vector<uint32_t>> ids; /* per group */
  std::vector<kvf_group_blocks> groups;   /* per group, pointing into ids */
  uint64_t blocks = 0;                    /* ids used, all groups */
};

/* Number of block ids per group a request of `tokens` needs (the sum over
 * groups is the number of ids one buffer set draws from the pool). */
uint64_t plan_blocks_needed(const kvf_geometry *g, uint64_t tokens);

/* Draw the tables from pool[*next ...]; ids are distinct across all groups
 * (groups that alias one tensor must never share an id). Returns false if the
 * pool runs out. */
bool plan_tables(const kvf_geometry *g, uint64_t tokens, const std::vector<uint32_t> &pool, size_t *next,
                 Tables *out);

/* Objects one request needs: offsets inside one buffer set's arena (each
 * object aligned to `align` bytes), NULL-equivalent (UINT64_MAX) where the
 * (chunk, object group) pair moves nothing. */
struct ObjectLayout {
  uint64_t chunks = 0;
  uint32_t num_object_groups = 0;
  std::vector<uint64_t> offset; /* [chunks * num_object_groups]; UINT64_MAX: not needed */
  std::vector<uint64_t> size;   /* payload bytes of each object */
  uint64_t span = 0;            /* arena bytes one set needs */
  uint64_t objects = 0;         /* objects needed */
};

bool plan_objects(const kvf_geometry *g, uint64_t tokens, const Tables &t, uint64_t align, ObjectLayout *out);

/* Object pointers for the request: arena + offset, NULL where not needed. */
std::vector<void *> plan_object_pointers(const ObjectLayout &layout, char *arena);

/* Contiguous runs of a request, as absolute addresses. For a gather, src is
 * the cache and dst the object; for a scatter, the other way round. */
struct Runs {
  std::vector<const void *> src;
  std::vector<void *> dst;
  std::vector<size_t> size;
  uint64_t bytes = 0;      /* payload bytes (padding never counted) */
  uint64_t raw_runs = 0;   /* runs before merging (one per (plane, token, head) or state) */
  size_t count() const { return size.size(); }
};

/* Enumerate the runs of `request` (its region bases and objects must be set).
 * Returns false, with *error set, on an inconsistent request. */
bool plan_runs(const kvf_geometry *g, const kvf_copy_request *request, bool gather, Runs *out,
               std::string *error);

/* A uniform subsample of at most max_runs runs (every k-th run), for
 * baselines too slow to time in full; *fraction gets its share of the bytes. */
Runs plan_sample(const Runs &all, size_t max_runs, double *fraction);

/* Shuffled pool 0 .. n-1 (Fisher-Yates with splitmix64). */
std::vector<uint32_t> plan_pool(uint32_t n, uint64_t seed);

uint64_t splitmix64(uint64_t *state);

} // namespace kvfb

#endif
