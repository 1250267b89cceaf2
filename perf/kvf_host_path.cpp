/* perf/kvf_host_path.cpp - kvferry's own host time per call on its GPU
 * routes, and the bytes those routes move, on a machine without a GPU.
 *
 * The CUDA runtime and the kernel's entry points are perf/host_path_stub.c:
 * device memory is host memory the stub answers for, and enqueued work runs
 * on the CPU at once. So the real kvf_xfer code (route choice, the staged
 * route's plan, the batch route's runs, the tables) runs as on a GPU
 * machine, and two things can be measured here:
 *
 *   verify: each (preset, direction) call moves exactly what the CPU
 *     reference (kvf_reference_gather/scatter) moves, byte for byte;
 *   time:   the host time of each call alone (calls 200 us apart, so every
 *     rule sees an idle stream), with the work left out: planning, tables,
 *     runs and the stub's calls, none of the driver's time. On the H200
 *     machine's KVM guest the same code ran 2-3 times slower than here
 *     (perf/results/2026-12-04-h200-unfit-memo: plan_us 1.9-5.3 us there
 *     against 1.0-2.0 here for a one-chunk d2d call), and each CUDA call
 *     adds its own 0.1-7 us there.
 *
 *   kvf_host_path [--preset-dir DIR] [--presets a,b] [--tokens N] [--reps N]
 *                 [--directions d2d,d2h,h2d] [--format canonical|native]
 *                 [--skip-every K] [--calls N] [--expect-cached-runs]
 *                 [--expect-cached-blobs] [--deferred] [--busy-queries N]
 *                 [--expect-batch-calls ramp|one] [--verify-only] [--json FILE]
 *
 * --skip-every K makes every K-th id of each block table KVF_BLOCK_SKIP
 * (blocks that move nothing: holes in the objects). --calls N verifies N
 * calls a row, back to back, each with other block ids (the second's in
 * order); --expect-cached-runs then fails a row whose later one-batch
 * staged calls never took their pieces' runs from the context's cache
 * (host/core/xfer_internal.h, kvf_stage_blob_runs_cached), and
 * --expect-cached-blobs one whose later calls never took a blob from the
 * context's memo (kernels/plan.h, kvf_blob_build_memo): the blobs those
 * calls launch are then the memo's, checked against the reference.
 * --deferred makes every call a deferred one (kvf_xfer_gather_deferred),
 * joined into the stream after it: the context's thread plans and enqueues
 * it. A row then fails when a call did not run on that thread or when a
 * wait was enqueued ahead of what it waits for (the stub's early waits);
 * the time is the post's alone, the join left out.
 * --busy-queries N makes the call's stream answer "not ready" to its next N
 * queries before each verified call, as an event the caller records just
 * before a call keeps a GPU's stream busy for a few us (not with
 * --deferred, whose calls run on the context's own stream);
 * --expect-batch-calls then fails a row whose batch-API calls (the copy
 * engine's route) did not ramp (ramp: more than one cudaMemcpyBatchAsync
 * call where the runs pass twice KVF_XFER_BATCH_FIRST_RUNS) or did not make one
 * call (one).
 *
 * Exit status: 0 when every call succeeded and matched the reference. */
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <dirent.h>
#include <sys/resource.h>
#include <string>
#include <vector>

#include <kvferry/copy.h>
#include <kvferry/geometry.h>
#include <kvferry/status.h>
#include <kvferry/transfer.h>

#include "bench_plan.h"
#include "host/core/xfer_internal.h"
#include "host_path_stub.h"

#include <cuda_runtime_api.h>

#ifndef KVF_PRESET_DIR_BUILD
#define KVF_PRESET_DIR_BUILD "geometry/presets"
#endif

using namespace kvfb;

namespace {

struct Options {
  std::string preset_dir = KVF_PRESET_DIR_BUILD;
  std::vector<std::string> presets; /* empty: every preset in the directory */
  std::vector<std::string> directions = {"d2d", "d2h", "h2d"};
  uint64_t tokens = 256;
  int reps = 200;
  kvf_object_format format = KVF_FORMAT_CANONICAL;
  uint64_t skip_every = 0; /* every k-th block id of each table is KVF_BLOCK_SKIP (0: none) */
  int calls = 1;           /* verified calls per row */
  bool expect_cached_runs = false; /* fail a row whose later staged calls never took runs from the cache */
  bool expect_cached_blobs = false; /* fail a row whose later calls never took a blob from the memo */
  bool deferred = false; /* every call deferred, then joined */
  unsigned busy_queries = 0; /* the stream answers "not ready" to this many queries after each call starts */
  std::string expect_batch_calls; /* "ramp" or "one": what a batch-route call must have made */
  bool verify_only = false;
  std::string json;
};

std::vector<std::string> split(const std::string &s) {
  std::vector<std::string> out;
  size_t at = 0;
  while (at <= s.size()) {
    size_t comma = s.find(',', at);
    if (comma == std::string::npos) comma = s.size();
    if (comma > at) out.push_back(s.substr(at, comma - at));
    at = comma + 1;
  }
  return out;
}

std::vector<std::string> preset_names(const std::string &dir) {
  std::vector<std::string> names;
  DIR *d = opendir(dir.c_str());
  if (!d) return names;
  while (dirent *e = readdir(d)) {
    std::string n = e->d_name;
    if (n.size() > 5 && n.compare(n.size() - 5, 5, ".json") == 0) names.push_back(n.substr(0, n.size() - 5));
  }
  closedir(d);
  std::sort(names.begin(), names.end());
  return names;
}

void fill(void *p, uint64_t n, uint64_t seed) {
  auto *b = static_cast<unsigned char *>(p);
  uint64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t v = splitmix64(&seed);
    memcpy(b + i, &v, 8);
  }
  for (; i < n; i++) b[i] = (unsigned char)splitmix64(&seed);
}

double now_us() {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void pause_us(long us) {
  timespec ts{0, us * 1000};
  while (nanosleep(&ts, &ts) == -1 && errno == EINTR) {
  }
}

/* Every k-th id of each of t's tables becomes KVF_BLOCK_SKIP (k 0: none). */
void skip_blocks(Tables *t, uint64_t k) {
  if (k == 0) return;
  for (auto &ids : t->ids)
    for (size_t i = k - 1; i < ids.size(); i += k) ids[i] = KVF_BLOCK_SKIP;
}

struct Row {
  std::string preset, direction, path, error, skipped;
  uint64_t payload = 0;
  bool verified = false;
  double median_us = 0, p10_us = 0, p90_us = 0, plan_us = 0;
  double launches = 0, copies = 0, batch_runs = 0, pointer_queries = 0, page_faults = 0;
  int staged_later = 0, cached_later = 0; /* verified calls after the first staged in one batch, and of those
                                             the ones whose pieces' runs came from the context's cache */
  int later = 0, blobs_later = 0;          /* verified calls after the first, and of those the ones that took
                                              a blob from the context's memo */
};

/* One (preset, direction): verify once with the work done, then time with
 * the work left out. */
Row run_one(const Options &o, const std::string &preset, const std::string &direction) {
  Row row;
  row.preset = preset;
  row.direction = direction;
  const bool gather = direction != "h2d";
  const bool host_objects = direction != "d2d";
  const std::string path = o.preset_dir + "/" + preset + ".json";

  kvf_geometry *small = nullptr;
  kvf_geometry_load_options lo = KVF_GEOMETRY_LOAD_OPTIONS_INIT;
  lo.num_blocks_override = 4;
  if (kvf_geometry_load_file(path.c_str(), &lo, &small, nullptr)) {
    row.error = std::string("load: ") + kvf_last_error();
    return row;
  }
  const uint64_t need = plan_blocks_needed(small, o.tokens);
  kvf_geometry_destroy(small);
  kvf_geometry *g = nullptr;
  lo.num_blocks_override = (uint32_t)(need + 8);
  if (kvf_geometry_load_file(path.c_str(), &lo, &g, nullptr)) {
    row.error = std::string("load: ") + kvf_last_error();
    return row;
  }

  const uint32_t nreg = kvf_geometry_num_regions(g);
  std::vector<void *> cache(nreg, nullptr), ref_cache(nreg, nullptr);
  std::vector<uint64_t> region_size(nreg, 0);
  Tables t;
  ObjectLayout layout;
  std::vector<void *> objects, ref_objects;
  char *arena = nullptr, *ref_arena = nullptr;
  kvf_xfer *x = nullptr;
  kvf_xfer_options xo = KVF_XFER_OPTIONS_INIT;
  xo.device = 0;
  std::vector<double> times, plans;
  kvf_host_stub_counts c0, c1;
  /* Call ci's block tables: a shuffled pool, call 1's in order (consecutive
   * blocks), every skip_every-th id skipped. */
  auto draw_tables = [&](int ci) {
    std::vector<uint32_t> pool = plan_pool(lo.num_blocks_override, 42 + (uint64_t)ci);
    if (ci == 1) std::sort(pool.begin(), pool.end());
    size_t next = 0;
    if (!plan_tables(g, o.tokens, pool, &next, &t)) return false;
    skip_blocks(&t, o.skip_every);
    return true;
  };
  kvf_copy_request r = KVF_COPY_REQUEST_INIT, ref = KVF_COPY_REQUEST_INIT;
  /* A stream of the caller's own, as engines use: the legacy stream takes
   * neither the batch route nor a straight part. */
  cudaStream_t stream = nullptr;
  cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  uint64_t ticket = 0;
  /* A call; a deferred one is posted only (join_call joins it). */
  auto call = [&]() {
    if (o.deferred)
      return gather ? kvf_xfer_gather_deferred(x, &r, (kvf_stream)stream, &ticket)
                    : kvf_xfer_scatter_deferred(x, &r, (kvf_stream)stream, &ticket);
    return gather ? kvf_xfer_gather(x, &r, (kvf_stream)stream) : kvf_xfer_scatter(x, &r, (kvf_stream)stream);
  };
  auto join_call = [&]() { return o.deferred ? kvf_xfer_join(x, ticket, (kvf_stream)stream) : KVF_SUCCESS; };
  kvf_host_stub_counts w0, w1;
  kvf_host_stub_counts_get(&w0);

  for (uint32_t i = 0; i < nreg; i++) {
    kvf_region_info ri = KVF_REGION_INFO_INIT;
    kvf_geometry_region(g, i, &ri);
    region_size[i] = ri.size;
    cache[i] = kvf_host_stub_device_alloc(ri.size);
    ref_cache[i] = aligned_alloc(256, (ri.size + 255) / 256 * 256 + 256);
    if (!cache[i] || !ref_cache[i]) {
      row.error = "out of memory";
      goto out;
    }
    fill(cache[i], ri.size, 1000 + i);
  }
  if (!draw_tables(0) || !plan_objects(g, o.tokens, t, 256, &layout)) {
    row.error = "planning the request failed";
    goto out;
  }
  arena = static_cast<char *>(host_objects ? kvf_host_stub_pinned_alloc(layout.span)
                                           : kvf_host_stub_device_alloc(layout.span));
  ref_arena = static_cast<char *>(aligned_alloc(256, (layout.span + 255) / 256 * 256 + 256));
  if (!arena || !ref_arena) {
    row.error = "out of memory";
    goto out;
  }
  objects = plan_object_pointers(layout, arena);
  ref_objects = plan_object_pointers(layout, ref_arena);
  r.region_bases = cache.data();
  r.token_begin = 0;
  r.token_end = o.tokens;
  r.format = o.format;
  r.groups = t.groups.data();
  r.objects = objects.data();
  ref = r;
  ref.region_bases = ref_cache.data();
  ref.objects = ref_objects.data();

  /* The native format holds whole blocks: a request that would end one
   * mid-block is refused by design (a row skipped, not failed). */
  if (o.format == KVF_FORMAT_NATIVE && kvf_copy_request_check(g, &r) != KVF_SUCCESS) {
    row.skipped = kvf_last_error();
    goto out;
  }
  if (kvf_xfer_create(g, &xo, &x)) {
    row.error = std::string("kvf_xfer_create: ") + kvf_last_error();
    goto out;
  }

  /* Verify: each call against the same call on the reference's copies of
   * the inputs. Calls after the first come back to back with other block
   * ids: the second's in order (consecutive blocks, which the batch route's
   * runs merge), the rest shuffled anew, so the rules that remember earlier
   * calls (the batch route's listed shape, the staged route's measures) are
   * walked too. */
  kvf_host_stub_execute(1);
  for (int ci = 0; ci < o.calls; ci++) {
    if (ci > 0) {
      if (!draw_tables(ci)) {
        row.error = "planning the request failed";
        goto out;
      }
      r.groups = ref.groups = t.groups.data();
    }
    for (uint32_t i = 0; i < nreg; i++) memcpy(ref_cache[i], cache[i], region_size[i]);
    memset(arena, 0, layout.span);
    memset(ref_arena, 0, layout.span);
    if (!gather) {
      fill(arena, layout.span, 77 + (uint64_t)ci);
      memcpy(ref_arena, arena, layout.span);
    }
    if (o.busy_queries) kvf_host_stub_stream_busy(stream, o.busy_queries);
    if (call() || join_call()) {
      row.error = std::string(gather ? "kvf_xfer_gather" : "kvf_xfer_scatter") + (o.deferred ? "_deferred: " : ": ") +
                  kvf_last_error() + " (call " + std::to_string(ci + 1) + ")";
      goto out;
    }
    if (o.deferred) {
      /* The join waits for exactly what the thread wrote for this call: a
       * wait for less would end before the call's work. */
      kvf_host_stub_counts now;
      kvf_host_stub_counts_get(&now);
      if (now.last_value_waited != now.last_value_written) {
        row.error = "call " + std::to_string(ci + 1) + ": the join waited for " +
                    std::to_string(now.last_value_waited) + ", the call wrote " +
                    std::to_string(now.last_value_written);
        goto out;
      }
    }
    if (gather ? kvf_reference_gather(g, &ref) : kvf_reference_scatter(g, &ref)) {
      row.error = std::string("reference: ") + kvf_last_error();
      goto out;
    }
    {
      kvf_xfer_stats st = KVF_XFER_STATS_INIT;
      kvf_xfer_last_stats(x, &st);
      row.payload = st.payload_bytes;
      kvf_xfer_path_info pi;
      kvf_xfer_last_path(x, &pi);
      std::string name = kvf_xfer_path_name(pi.path);
      if (ci > 0) {
        row.later++;
        row.blobs_later += pi.blobs_cached > 0;
      }
      if (ci > 0 && pi.path == KVF_PATH_STAGED && pi.batches == 1) {
        row.staged_later++;
        row.cached_later += pi.runs_cached > 0;
      }
      if (o.deferred && !pi.deferred) {
        row.error = "call " + std::to_string(ci + 1) + " was not planned by the context's thread";
        goto out;
      }
      if (!o.expect_batch_calls.empty() && pi.path == KVF_PATH_COPY_BATCH) {
        kvf_xfer_tuning tn;
        kvf_xfer_get_tuning(x, &tn);
        const bool ramp = o.expect_batch_calls == "ramp";
        const uint64_t first = (uint64_t)tn.batch_first_runs;
        /* Up to twice `first` runs the first call takes them all. */
        const bool can_ramp = first > 0 && kvf_batch_ramp_runs(0, first, pi.dma_runs) < pi.dma_runs;
        if (ramp ? can_ramp && pi.dma_ops < 2 : pi.dma_ops != 1) {
          row.error = "call " + std::to_string(ci + 1) + ": " + std::to_string(pi.dma_ops) + " batch calls for " +
                      std::to_string(pi.dma_runs) + " runs, want " + (ramp ? "a ramp" : "one");
          goto out;
        }
      }
      if (ci == 0) row.path = name;
      else if (("+" + row.path + "+").find("+" + name + "+") == std::string::npos) row.path += "+" + name;
    }
    row.verified = memcmp(arena, ref_arena, layout.span) == 0;
    for (uint32_t i = 0; row.verified && i < nreg; i++)
      row.verified = memcmp(cache[i], ref_cache[i], region_size[i]) == 0;
    if (!row.verified) {
      row.error = "call " + std::to_string(ci + 1) + ": the moved bytes differ from the CPU reference's";
      goto out;
    }
  }
  /* The staged runs cache (kvf_stage_blob_runs_cached) serves calls of one
   * shape after the first: allow one call planned otherwise (a straight part
   * kept or dropped), not more. */
  if (o.expect_cached_runs && row.staged_later >= 2 && row.cached_later == 0) {
    row.error = std::to_string(row.staged_later) + " later staged calls, none took its runs from the cache";
    goto out;
  }
  /* The blob memo serves every call of a shape after the first; the routes
   * the rules pick may change between calls, so one such call is enough. */
  if (o.expect_cached_blobs && row.later >= 2 && row.blobs_later == 0) {
    row.error = std::to_string(row.later) + " later calls, none took a blob from the memo";
    goto out;
  }
  kvf_host_stub_counts_get(&w1);
  if (w1.early_waits != w0.early_waits) {
    row.error = std::to_string(w1.early_waits - w0.early_waits) + " of " +
                std::to_string(w1.value_waits - w0.value_waits) +
                " waits were enqueued ahead of the write they wait for";
    goto out;
  }
  if (o.deferred && w1.value_waits - w0.value_waits != (uint64_t)o.calls) {
    row.error = "the joins enqueued " + std::to_string(w1.value_waits - w0.value_waits) + " waits for " +
                std::to_string(o.calls) + " calls";
    goto out;
  }
  if (o.verify_only) goto out;

  /* Time: each call alone, the work left out. */
  kvf_host_stub_execute(0);
  kvf_host_stub_counts_get(&c0);
  rusage ru0, ru1;
  getrusage(RUSAGE_SELF, &ru0);
  for (int i = 0; i < o.reps; i++) {
    pause_us(200);
    double a = now_us();
    kvf_status s = call();
    double b = now_us();
    if (!s) s = join_call();
    if (s) {
      row.error = std::string("timed call: ") + kvf_last_error();
      goto out;
    }
    kvf_xfer_path_info pi;
    kvf_xfer_last_path(x, &pi);
    times.push_back(b - a);
    plans.push_back(pi.plan_us);
    row.path = kvf_xfer_path_name(pi.path);
  }
  kvf_host_stub_counts_get(&c1);
  getrusage(RUSAGE_SELF, &ru1);
  row.page_faults = double(ru1.ru_minflt - ru0.ru_minflt + ru1.ru_majflt - ru0.ru_majflt) / o.reps;
  std::sort(times.begin(), times.end());
  std::sort(plans.begin(), plans.end());
  row.median_us = times[times.size() / 2];
  row.p10_us = times[times.size() / 10];
  row.p90_us = times[times.size() * 9 / 10];
  row.plan_us = plans[plans.size() / 2];
  row.launches = double(c1.launches - c0.launches) / o.reps;
  row.copies = double(c1.copies - c0.copies + c1.batch_copies - c0.batch_copies) / o.reps;
  row.batch_runs = double(c1.batch_runs - c0.batch_runs) / o.reps;
  row.pointer_queries = double(c1.pointer_queries - c0.pointer_queries) / o.reps;

out:
  kvf_host_stub_execute(1);
  kvf_xfer_destroy(x);
  cudaStreamDestroy(stream);
  if (arena) kvf_host_stub_free(arena);
  free(ref_arena);
  for (uint32_t i = 0; i < nreg; i++) {
    if (cache[i]) kvf_host_stub_free(cache[i]);
    free(ref_cache[i]);
  }
  kvf_geometry_destroy(g);
  return row;
}

/* A string as a JSON string's contents (kvferry's messages are ASCII). */
std::string json_escape(const std::string &in) {
  std::string out;
  for (char ch : in) {
    if (ch == '"' || ch == '\\') out += '\\';
    if ((unsigned char)ch < 0x20) ch = ' ';
    out += ch;
  }
  return out;
}

int usage(const char *argv0) {
  fprintf(stderr,
          "usage: %s [--preset-dir DIR] [--presets a,b] [--tokens N] [--reps N] [--directions d2d,d2h,h2d]\n"
          "          [--format canonical|native] [--skip-every K] [--calls N] [--expect-cached-runs]\n"
          "          [--expect-cached-blobs] [--deferred] [--busy-queries N]\n"
          "          [--expect-batch-calls ramp|one]\n"
          "          [--verify-only] [--json FILE]\n",
          argv0);
  return 2;
}

} // namespace

int main(int argc, char **argv) {
  Options o;
  for (int i = 1; i < argc; i++) {
    std::string a = argv[i];
    auto value = [&]() -> std::string { return i + 1 < argc ? argv[++i] : std::string(); };
    if (a == "--preset-dir") o.preset_dir = value();
    else if (a == "--presets") o.presets = split(value());
    else if (a == "--directions") o.directions = split(value());
    else if (a == "--tokens") o.tokens = strtoull(value().c_str(), nullptr, 10);
    else if (a == "--reps") o.reps = atoi(value().c_str());
    else if (a == "--verify-only") o.verify_only = true;
    else if (a == "--format") {
      std::string f = value();
      if (f != "canonical" && f != "native") return usage(argv[0]);
      o.format = f == "native" ? KVF_FORMAT_NATIVE : KVF_FORMAT_CANONICAL;
    } else if (a == "--skip-every") o.skip_every = strtoull(value().c_str(), nullptr, 10);
    else if (a == "--calls") o.calls = atoi(value().c_str());
    else if (a == "--expect-cached-runs") o.expect_cached_runs = true;
    else if (a == "--expect-cached-blobs") o.expect_cached_blobs = true;
    else if (a == "--deferred") o.deferred = true;
    else if (a == "--busy-queries") {
      std::string v = value();
      char *end = nullptr;
      unsigned long q = strtoul(v.c_str(), &end, 10);
      if (v.empty() || *end || q == 0 || q > 0xffffffffUL) return usage(argv[0]);
      o.busy_queries = (unsigned)q;
    }
    else if (a == "--expect-batch-calls") {
      o.expect_batch_calls = value();
      if (o.expect_batch_calls != "ramp" && o.expect_batch_calls != "one") return usage(argv[0]);
    }
    else if (a == "--json") o.json = value();
    else return usage(argv[0]);
  }
  if (o.tokens == 0 || o.reps < 1 || o.calls < 1) return usage(argv[0]);
  /* A deferred call's batch route runs on the context's own stream, which
   * the harness does not hold. */
  if (o.deferred && (o.busy_queries || !o.expect_batch_calls.empty())) return usage(argv[0]);
  for (const std::string &d : o.directions)
    if (d != "d2d" && d != "d2h" && d != "h2d") return usage(argv[0]);
  if (o.presets.empty()) o.presets = preset_names(o.preset_dir);
  if (o.presets.empty()) {
    fprintf(stderr, "kvf_host_path: no presets in %s\n", o.preset_dir.c_str());
    return 2;
  }

  std::vector<Row> rows;
  int failed = 0;
  printf("%-32s %-4s %-18s %8s %9s %9s %8s %8s %6s %6s %7s %6s\n", "preset", "dir", "path", "verified", "host_us",
         "p90_us", "plan_us", "launches", "copies", "runs", "queries", "faults");
  for (const std::string &p : o.presets)
    for (const std::string &d : o.directions) {
      Row row = run_one(o, p, d);
      if (!row.skipped.empty()) {
        printf("%-32s %-4s skipped: %s\n", p.c_str(), d.c_str(), row.skipped.c_str());
      } else if (!row.error.empty()) {
        failed = 1;
        printf("%-32s %-4s FAILED: %s\n", p.c_str(), d.c_str(), row.error.c_str());
      } else {
        printf("%-32s %-4s %-18s %8s %9.2f %9.2f %8.2f %8.2f %6.2f %6.1f %7.2f %6.2f\n", p.c_str(), d.c_str(),
               row.path.c_str(), row.verified ? "yes" : "no", row.median_us, row.p90_us, row.plan_us, row.launches,
               row.copies, row.batch_runs, row.pointer_queries, row.page_faults);
      }
      fflush(stdout);
      rows.push_back(row);
    }

  if (!o.json.empty()) {
    FILE *f = fopen(o.json.c_str(), "w");
    if (!f) {
      fprintf(stderr, "kvf_host_path: %s: %s\n", o.json.c_str(), strerror(errno));
      return 1;
    }
    fprintf(f, "{\"schema\": \"kvf_host_path/1\", \"tokens\": %llu, \"reps\": %d, \"verify_only\": %s, \"rows\": [",
            (unsigned long long)o.tokens, o.reps, o.verify_only ? "true" : "false");
    for (size_t i = 0; i < rows.size(); i++) {
      const Row &w = rows[i];
      fprintf(f,
              "%s\n {\"preset\": \"%s\", \"direction\": \"%s\", \"path\": \"%s\", \"payload_bytes\": %llu, "
              "\"verified\": %s, \"host_us\": %.3f, \"p10_us\": %.3f, \"p90_us\": %.3f, \"plan_us\": %.3f, "
              "\"launches\": %.2f, \"copies\": %.2f, \"batch_runs\": %.1f, \"pointer_queries\": %.2f, "
              "\"page_faults\": %.2f, \"staged_later\": %d, \"cached_later\": %d, \"later\": %d, "
              "\"blobs_later\": %d, "
              "\"skipped\": \"%s\", \"error\": \"%s\"}",
              i ? "," : "", w.preset.c_str(), w.direction.c_str(), w.path.c_str(), (unsigned long long)w.payload,
              w.verified ? "true" : "false", w.median_us, w.p10_us, w.p90_us, w.plan_us, w.launches, w.copies,
              w.batch_runs, w.pointer_queries, w.page_faults, w.staged_later, w.cached_later, w.later, w.blobs_later,
              json_escape(w.skipped).c_str(),
              json_escape(w.error).c_str());
    }
    fprintf(f, "\n]}\n");
    fclose(f);
  }
  return failed;
}
