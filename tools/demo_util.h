/* Helpers the kvferry CLI's demos share: a deterministic KV cache, block
 * tables for a prefix, and the byte-for-byte verification of a restore. */
#ifndef KVF_TOOLS_DEMO_UTIL_H
#define KVF_TOOLS_DEMO_UTIL_H

#include <stddef.h>
#include <stdint.h>

#include <kvferry/geometry.h>

/* A KV cache: host copies of every region (the bytes the demo checks) and,
 * on a GPU, the device regions the transfers use. */
typedef struct demo_cache {
  uint32_t num_regions;
  void **bases;   /* host copies */
  void **device;  /* device regions, NULL on the host backend */
  uint64_t *sizes;
} demo_cache;

/* A block table per group covering the blocks a request needs; ids drawn
 * from one shuffled pool, so groups that alias one tensor never share a block. */
typedef struct demo_tables {
  uint32_t num_groups;
  uint32_t **ids;
  uint64_t *first;
  uint32_t *count;
} demo_tables;

/* Seconds on the monotonic clock. */
double now_s(void);
/* The next value of a splitmix64 sequence. */
uint64_t splitmix(uint64_t *s);
/* "512.0 MiB" */
void human(uint64_t bytes, char *buf, size_t len);
/* Free a cache (NULL members are fine). */
void cache_free(demo_cache *c);
/* Host copies of every region filled from *seed (and device copies when on_gpu). */
int cache_alloc(const kvf_geometry *g, demo_cache *c, uint64_t *seed, int on_gpu);
/* Device regions back into the host copies (GPU only). */
int cache_download(demo_cache *c);
void tables_free(demo_tables *t);
/* Block tables of what each group keeps after `tokens`, ids from pool. */
int tables_make(const kvf_geometry *g, uint64_t tokens, uint32_t *pool, uint32_t pool_size, demo_tables *t);
uint64_t tables_blocks(const demo_tables *t);
/* 0 when every selected run of dst holds src's bytes of the same logical
 * block and every other byte still equals poison; counts what was checked. */
int demo_verify(const kvf_geometry *g, uint64_t tokens, const demo_cache *src, const demo_tables *old,
                const demo_cache *dst, const demo_cache *poison, const demo_tables *neu, uint64_t *checked,
                uint64_t *untouched);
/* Payload bytes the tables move for a prefix of `tokens`. */
uint64_t moved_bytes(const kvf_geometry *g, const demo_tables *t, uint64_t tokens);

/* Load a geometry file with enough blocks per group for a prefix of
 * `tokens` (what every group retains, plus slack). Prints why on failure. */
int demo_geometry_load(const char *path, uint64_t tokens, kvf_geometry **out, uint32_t *num_blocks);
/* Block ids 0 .. num_blocks-1 shuffled by seed (malloc'd). */
uint32_t *demo_pool_make(uint32_t num_blocks, uint64_t seed);

/* The served demo (demo_served.c): `kvferry demo` without --in-process, and
 * the engine process it starts (`kvferry demo-engine`). Exit statuses. */
int cmd_demo_served(int argc, char **argv, const char *geometry_path, const char *preset);
int cmd_demo_engine(int argc, char **argv);

#endif /* KVF_TOOLS_DEMO_UTIL_H */
