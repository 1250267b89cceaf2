// Sizes of each preset's one-chunk gather blob (kernels/plan.h), as the d2d launch carries it in
// its kernel parameters. Built against the library on the CPU machine:
//   g++ -std=c++17 -I. -Iinclude -Ibuild/rel/include perf/results/2026-12-02-h200-entry48/blob_sizes.cpp \
//       perf/bench_plan.cpp build/rel/libkvferry.a -lpthread -ljansson -lhwloc -lcrypto -L/usr/local/cuda/lib64 -lcudart -ldl
//   ./a.out geometry/presets/*.json
#include <cstdio>
#include <string>
#include <vector>
#include "perf/bench_plan.h"
extern "C" {
#include "kernels/plan.h"
}
#include <kvferry/kvferry.h>
int main(int argc, char **argv) {
  for (int i = 1; i < argc; i++) {
    kvf_geometry_load_options lo = KVF_GEOMETRY_LOAD_OPTIONS_INIT;
    lo.num_blocks_override = 4096;
    kvf_geometry *g = nullptr; kvf_geometry_error err;
    if (kvf_geometry_load_file(argv[i], &lo, &g, &err)) { printf("%s: load failed\n", argv[i]); continue; }
    kvf_object_policy pol = KVF_OBJECT_POLICY_INIT; kvf_geometry_policy(g, &pol);
    uint64_t tokens = pol.chunk_tokens;
    std::vector<uint32_t> pool = kvfb::plan_pool(4096, 1); size_t next = 0;
    kvfb::Tables t; kvfb::plan_tables(g, tokens, pool, &next, &t);
    kvfb::ObjectLayout L; kvfb::plan_objects(g, tokens, t, 256, &L);
    std::vector<char> arena(L.span + 4096);
    std::vector<void*> objs = kvfb::plan_object_pointers(L, (char*)(((uintptr_t)arena.data() + 255) & ~(uintptr_t)255));
    uint32_t nr = kvf_geometry_num_regions(g);
    std::vector<void*> bases(nr, (void*)0x100000000ull);
    kvf_copy_request r = KVF_COPY_REQUEST_INIT;
    r.region_bases = bases.data(); r.token_begin = 0; r.token_end = tokens; r.groups = t.groups.data(); r.objects = objs.data();
    kvf_plan plan; kvf_plan_build(g, KVF_FORMAT_CANONICAL, &plan);
    uint64_t bound = kvf_blob_size(g, &plan, &r, nullptr);
    std::vector<char> blob(bound + 256);
    kvf_blob_opts o = {8192, nullptr, 0};
    kvf_blob_build(g, &plan, &r, 1, &o, blob.data());
    const kvf_blob_header *h = (const kvf_blob_header*)blob.data();
    printf("%-34s tokens %4llu entries %4u shapes %u buckets %3u bound %6llu size %6llu\n", kvf_geometry_name(g), (unsigned long long)tokens, h->num_entries, h->num_shapes, h->num_buckets, (unsigned long long)bound, (unsigned long long)h->size);
    kvf_plan_free(&plan);
    kvf_geometry_destroy(g);
  }
}
