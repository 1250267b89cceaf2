/* perf/kvf_runs_check.cpp - proves the benchmark's run lists (bench_plan.cpp)
 * move exactly the bytes the CPU reference moves, for every preset, both
 * formats and both directions, so the baselines time the same copy kvferry
 * does; and that the peers' tables (bench_peers_plan.cpp), walked on the CPU
 * the way each design's kernel walks them, do too wherever a design applies.
 * Host only; runs anywhere (ctest: perf_runs_check).
 *
 *   kvf_runs_check [PRESET_DIR] [TOKENS...]   default: the build's presets, 256 1000 2048 */
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <dirent.h>
#include <string>
#include <vector>

#include <kvferry/copy.h>

#include "bench_peers_plan.h"
#include "bench_plan.h"

#ifndef KVF_PRESET_DIR_BUILD
#define KVF_PRESET_DIR_BUILD ""
#endif

using namespace kvfb;

namespace {

struct HostCache {
  std::vector<void *> bases;
  std::vector<uint64_t> sizes;
  ~HostCache() {
    for (void *p : bases) free(p);
  }
};

void fill(void *p, uint64_t n, uint64_t seed) {
  uint8_t *b = (uint8_t *)p;
  uint64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t x = splitmix64(&seed);
    memcpy(b + i, &x, 8);
  }
  for (; i < n; i++) b[i] = (uint8_t)splitmix64(&seed);
}

bool alloc_cache(const kvf_geometry *g, HostCache *c, uint64_t seed) {
  for (uint32_t r = 0; r < kvf_geometry_num_regions(g); r++) {
    kvf_region_info ri = KVF_REGION_INFO_INIT;
    kvf_geometry_region(g, r, &ri);
    uint64_t align = ri.align < 64 ? 64 : ri.align, size = (ri.size + align - 1) / align * align;
    void *p = aligned_alloc(align, size ? size : align);
    if (!p) return false;
    fill(p, ri.size, seed + r);
    c->bases.push_back(p);
    c->sizes.push_back(ri.size);
  }
  return true;
}

/* Copy a run list (the baselines' view of the request) on the CPU. */
void run_copy(const Runs &runs) {
  for (size_t i = 0; i < runs.count(); i++) memcpy(runs.dst[i], runs.src[i], runs.size[i]);
}

/* Re-point a run list from one cache/objects allocation to another. */
Runs rebase(const Runs &runs, const HostCache &from_c, const HostCache &to_c, char *from_o, char *to_o,
            uint64_t o_span) {
  Runs out = runs;
  auto move = [&](const void *p) -> char * {
    const char *q = (const char *)p;
    if (q >= from_o && q < from_o + o_span) return to_o + (q - from_o);
    for (size_t r = 0; r < from_c.bases.size(); r++) {
      const char *b = (const char *)from_c.bases[r];
      if (q >= b && q < b + from_c.sizes[r]) return (char *)to_c.bases[r] + (q - b);
    }
    return nullptr;
  };
  for (size_t i = 0; i < runs.count(); i++) {
    out.src[i] = move(runs.src[i]);
    out.dst[i] = move(runs.dst[i]);
  }
  return out;
}

int check_one(const std::string &path, kvf_object_format format, uint64_t tokens_in) {
  kvf_geometry *g = nullptr;
  kvf_geometry_load_options opt = KVF_GEOMETRY_LOAD_OPTIONS_INIT;
  opt.num_blocks_override = 4;
  if (kvf_geometry_load_file(path.c_str(), &opt, &g, nullptr)) {
    fprintf(stderr, "%s: %s\n", path.c_str(), kvf_last_error());
    return 1;
  }
  kvf_object_policy pol = KVF_OBJECT_POLICY_INIT;
  kvf_geometry_policy(g, &pol);
  uint64_t tokens = tokens_in;
  /* Native objects hold whole blocks: round to whole chunks. */
  if (format == KVF_FORMAT_NATIVE) tokens = (tokens + pol.chunk_tokens - 1) / pol.chunk_tokens * pol.chunk_tokens;
  uint64_t need = plan_blocks_needed(g, tokens);
  kvf_geometry_destroy(g);
  opt.num_blocks_override = (uint32_t)(need + need / 4 + 4);
  if (kvf_geometry_load_file(path.c_str(), &opt, &g, nullptr)) {
    fprintf(stderr, "%s: %s\n", path.c_str(), kvf_last_error());
    return 1;
  }
  int bad = 0;
  std::vector<uint32_t> pool = plan_pool(opt.num_blocks_override, tokens * 7 + 1);
  size_t next = 0;
  Tables t;
  ObjectLayout lay;
  HostCache ca, cb;
  std::string err;
  Runs runs;
  char *oa = nullptr, *ob = nullptr;
  uint64_t payload = 0;
  int peers_ok = 0;
  std::string peers_na;
  if (!plan_tables(g, tokens, pool, &next, &t) || !plan_objects(g, tokens, t, 256, &lay) ||
      !alloc_cache(g, &ca, 11) || !alloc_cache(g, &cb, 11)) {
    fprintf(stderr, "%s: planning or allocation failed\n", path.c_str());
    kvf_geometry_destroy(g);
    return 1;
  }
  oa = (char *)aligned_alloc(256, lay.span + 256);
  ob = (char *)aligned_alloc(256, lay.span + 256);
  fill(oa, lay.span, 99);
  memcpy(ob, oa, lay.span);
  std::vector<void *> pa = plan_object_pointers(lay, oa), pb = plan_object_pointers(lay, ob);
  kvf_copy_request req = KVF_COPY_REQUEST_INIT;
  req.token_begin = 0;
  req.token_end = tokens;
  req.format = format;
  req.groups = t.groups.data();

  /* Gather: reference into A, runs into B. */
  req.region_bases = ca.bases.data();
  req.objects = pa.data();
  if (kvf_reference_gather(g, &req)) {
    fprintf(stderr, "%s: reference gather: %s\n", path.c_str(), kvf_last_error());
    bad = 1;
    goto out;
  }
  req.region_bases = cb.bases.data();
  req.objects = pb.data();
  if (!plan_runs(g, &req, true, &runs, &err)) {
    fprintf(stderr, "%s: plan_runs: %s\n", path.c_str(), err.c_str());
    bad = 1;
    goto out;
  }
  run_copy(runs);
  payload = runs.bytes;
  if (memcmp(oa, ob, lay.span)) {
    fprintf(stderr, "%s %s %llu tokens: gather through runs differs from the reference\n", path.c_str(),
            kvf_object_format_name(format), (unsigned long long)tokens);
    bad = 1;
  }
  /* Scatter: new object contents, reference into cache A, runs into cache B. */
  fill(oa, lay.span, 1234);
  memcpy(ob, oa, lay.span);
  req.region_bases = ca.bases.data();
  req.objects = pa.data();
  if (kvf_reference_scatter(g, &req)) {
    fprintf(stderr, "%s: reference scatter: %s\n", path.c_str(), kvf_last_error());
    bad = 1;
    goto out;
  }
  req.region_bases = cb.bases.data();
  req.objects = pb.data();
  if (!plan_runs(g, &req, false, &runs, &err)) {
    fprintf(stderr, "%s: plan_runs: %s\n", path.c_str(), err.c_str());
    bad = 1;
    goto out;
  }
  run_copy(runs);
  for (size_t r = 0; r < ca.bases.size(); r++)
    if (memcmp(ca.bases[r], cb.bases[r], ca.sizes[r])) {
      fprintf(stderr, "%s %s %llu tokens: scatter through runs differs from the reference in region %zu\n",
              path.c_str(), kvf_object_format_name(format), (unsigned long long)tokens, r);
      bad = 1;
    }
  if (runs.bytes != payload) {
    fprintf(stderr, "%s: gather and scatter run bytes differ (%llu vs %llu)\n", path.c_str(),
            (unsigned long long)payload, (unsigned long long)runs.bytes);
    bad = 1;
  }
  /* The peers' designs over their tables, both directions. */
  for (const char *design : {"mp", "legacy", "sglang"})
    for (int gather : {1, 0}) {
      std::string why;
      PeerHostTables pt;
      if (gather) {
        fill(oa, lay.span, 77);
        memcpy(ob, oa, lay.span);
        req.region_bases = ca.bases.data();
        req.objects = pa.data();
        kvf_reference_gather(g, &req);
      } else {
        fill(oa, lay.span, 555);
        memcpy(ob, oa, lay.span);
        req.region_bases = ca.bases.data();
        req.objects = pa.data();
        kvf_reference_scatter(g, &req);
      }
      req.region_bases = cb.bases.data();
      req.objects = pb.data();
      if (!peer_tables(g, req, gather, &pt, &why)) {
        if (!strcmp(design, "mp") && gather) peers_na = why;
        continue;
      }
      if (!strcmp(design, "mp") && (peer_mp_unit(pt) == 0 || pt.max_heads > 32)) continue;
      peer_walk_cpu(pt, design);
      bool same = gather ? memcmp(oa, ob, lay.span) == 0 : true;
      for (size_t r = 0; !gather && r < ca.bases.size(); r++) same = same && !memcmp(ca.bases[r], cb.bases[r], ca.sizes[r]);
      if (!same) {
        fprintf(stderr, "%s %s %llu tokens: peer design %s %s differs from the reference\n", path.c_str(),
                kvf_object_format_name(format), (unsigned long long)tokens, design, gather ? "gather" : "scatter");
        bad = 1;
      }
      peers_ok++;
    }
  {
    /* The sampler and rebasing used by the benchmark keep bytes consistent. */
    double frac;
    Runs s = plan_sample(runs, 100, &frac);
    if (s.count() > 100 || frac <= 0 || frac > 1.0 + 1e-12) {
      fprintf(stderr, "%s: plan_sample broken\n", path.c_str());
      bad = 1;
    }
    Runs back = rebase(rebase(runs, cb, ca, ob, oa, lay.span), ca, cb, oa, ob, lay.span);
    for (size_t i = 0; i < runs.count() && !bad; i++)
      if (back.src[i] != runs.src[i] || back.dst[i] != runs.dst[i]) bad = 1;
  }
  printf("%-40s %-9s %6llu tokens: %8llu runs (%9llu unmerged), %11llu payload bytes, avg run %8.0f B, %3llu objects, "
         "%d peer walks%s%s: %s\n",
         kvf_geometry_name(g), kvf_object_format_name(format), (unsigned long long)tokens,
         (unsigned long long)runs.count(), (unsigned long long)runs.raw_runs, (unsigned long long)runs.bytes,
         runs.count() ? (double)runs.bytes / (double)runs.count() : 0.0, (unsigned long long)lay.objects, peers_ok,
         peers_na.empty() ? "" : " (peers: ", peers_na.empty() ? "" : (peers_na + ")").c_str(), bad ? "FAIL" : "ok");
out:
  free(oa);
  free(ob);
  kvf_geometry_destroy(g);
  return bad;
}

} // namespace

int main(int argc, char **argv) {
  std::string dir = argc > 1 ? argv[1] : KVF_PRESET_DIR_BUILD;
  if (const char *env = getenv("KVF_PRESET_DIR"); env && argc <= 1) dir = env;
  std::vector<uint64_t> sizes;
  for (int i = 2; i < argc; i++) sizes.push_back(strtoull(argv[i], nullptr, 10));
  if (sizes.empty()) sizes = {256, 1000, 2048};
  std::vector<std::string> files;
  if (DIR *d = opendir(dir.c_str())) {
    while (dirent *e = readdir(d)) {
      std::string n = e->d_name;
      if (n.size() > 5 && n.compare(n.size() - 5, 5, ".json") == 0) files.push_back(dir + "/" + n);
    }
    closedir(d);
  }
  if (files.empty()) {
    fprintf(stderr, "kvf_runs_check: no presets in '%s'\n", dir.c_str());
    return 2;
  }
  std::sort(files.begin(), files.end());
  int bad = 0;
  for (const std::string &f : files)
    for (uint64_t s : sizes)
      for (kvf_object_format fmt : {KVF_FORMAT_CANONICAL, KVF_FORMAT_NATIVE}) bad |= check_one(f, fmt, s);
  printf("%s\n", bad ? "kvf_runs_check: FAILED" : "kvf_runs_check: all run lists match the reference");
  return bad;
}
