// kvf_xfer (kvferry/transfer.h) against the CPU reference (kvferry/copy.h).
//
// Every case builds the same inputs twice: the reference gather/scatter runs
// on one host copy, kvf_xfer on the other (on the host backend, or on a GPU
// after the inputs are uploaded and before the results are downloaded), and
// the two results must be identical byte for byte over every buffer: whole
// cache regions and whole objects, each with guard bytes around it. Outputs
// start poisoned (random cache bytes, 0x5A/0xA5 objects), so padding,
// unselected blocks, skipped blocks and the guards must keep their poison.
//
// Requests start at chunk 1 (token_begin = chunk_tokens) and end one
// attention unit into the next chunk, so they span a full object and a
// partial last one. Block ids are distinct across groups (aliasing groups
// share memory), about one in eight skipped; canonical cases pass a table
// padded with blocks before and after the range (which must not move), native
// cases a table cut to the range (first_block > 0).
//
// Host backend cases (XferHost*) run everywhere. GPU cases (XferGpu*) skip
// with the reason when kvf_cuda_probe finds no driver or device.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <unordered_set>
#include <vector>

#include <kvferry/copy.h>
#include <kvferry/device.h>
#include <kvferry/transfer.h>

#include "conformance_util.h"
#include "host/core/param.h"
#include "host/core/xfer_internal.h"
#include "kernels/walk.h"

#if KVF_WITH_CUDA
#include <cuda_runtime_api.h>
#include "xfer_spin.h"
#endif

namespace {

using kvf_test::GeometryPtr;

// The presets come from KVF_PRESET_DIR (compiled in), or from
// $KVF_TEST_PRESET_DIR when set: the GPU machine runs binaries built
// elsewhere, from a checkout at another path (tests/gpu/run_gpu_tests.sh).
const char *preset_dir_override() {
  const char *e = std::getenv("KVF_TEST_PRESET_DIR");
  return e && *e ? e : nullptr;
}

std::vector<std::string> preset_names() {
  const char *dir = preset_dir_override();
  if (!dir) return kvf_test::preset_names();
  std::vector<std::string> names;
  std::error_code ec;
  for (const auto &e : std::filesystem::directory_iterator(dir, ec))
    if (e.path().extension() == ".json") names.push_back(e.path().stem().string());
  std::sort(names.begin(), names.end());
  return names;
}

GeometryPtr load_preset(const std::string &name, uint32_t num_blocks) {
  const char *dir = preset_dir_override();
  if (!dir) return kvf_test::load_preset(name, num_blocks);
  kvf_geometry_load_options opt = KVF_GEOMETRY_LOAD_OPTIONS_INIT;
  opt.num_blocks_override = num_blocks;
  kvf_geometry *g = nullptr;
  kvf_geometry_error err;
  std::string path = std::string(dir) + "/" + name + ".json";
  if (kvf_geometry_load_file(path.c_str(), &opt, &g, &err) != KVF_SUCCESS) return nullptr;
  return GeometryPtr(g);
}

enum class Dir { Gather, Scatter };

const char *dir_name(Dir d) { return d == Dir::Gather ? "gather" : "scatter"; }
const char *format_name(kvf_object_format f) { return f == KVF_FORMAT_CANONICAL ? "canonical" : "native"; }

std::string sanitize(std::string n) {
  for (char &ch : n)
    if (!isalnum((unsigned char)ch)) ch = '_';
  return n;
}

// ---- plans -------------------------------------------------------------------

using kvf_test::Plan;

uint32_t chunk_tokens(const kvf_geometry *g) {
  kvf_object_policy pol = KVF_OBJECT_POLICY_INIT;
  kvf_geometry_policy(g, &pol);
  return pol.chunk_tokens;
}

bool is_recurrent(const kvf_geometry *g, uint32_t gi) {
  kvf_group_info info = KVF_GROUP_INFO_INIT;
  kvf_geometry_group(g, gi, &info);
  return info.kind == KVF_GROUP_RECURRENT;
}

bool is_windowed(const kvf_geometry *g, uint32_t gi) {
  kvf_group_info info = KVF_GROUP_INFO_INIT;
  kvf_geometry_group(g, gi, &info);
  return info.kind == KVF_GROUP_SLIDING_WINDOW || info.kind == KVF_GROUP_CHUNKED_LOCAL;
}

// The least common multiple of block_size * dcp world over attention groups:
// a request ending on it ends on whole blocks (valid for native objects).
uint64_t attention_unit(const kvf_geometry *g) {
  uint32_t world = 1;
  kvf_geometry_dcp(g, &world, nullptr);
  uint64_t unit = 1;
  for (uint32_t i = 0; i < kvf_geometry_num_groups(g); i++) {
    kvf_group_info gi = KVF_GROUP_INFO_INIT;
    kvf_geometry_group(g, i, &gi);
    if (gi.kind != KVF_GROUP_RECURRENT) unit = std::lcm(unit, (uint64_t)gi.block_size * world);
  }
  return unit;
}

// Local block range [first, end) of group gi that [tb, te) touches; for a
// recurrent group the chunks (slots) the range spans.
void needed_blocks(const kvf_geometry *g, uint32_t gi, uint64_t tb, uint64_t te, uint64_t *first, uint64_t *end) {
  uint64_t c = chunk_tokens(g);
  if (is_recurrent(g, gi)) {
    *first = tb / c;
    *end = (te + c - 1) / c;
    return;
  }
  EXPECT_EQ(kvf_geometry_local_blocks(g, gi, tb, te, first, end), KVF_SUCCESS) << kvf_last_error();
}

// A padded table covers more than the range, as an engine's table does: up to
// kPadBlocks entries before it (first_block = first - kPadBlocks, or 0) and
// kPadBlocks after; none of those may move.
constexpr uint64_t kPadBlocks = 1;

void table_range(const kvf_geometry *g, uint32_t gi, uint64_t tb, uint64_t te, bool padded, uint64_t *start,
                 uint64_t *first, uint64_t *end) {
  uint64_t e = 0;
  needed_blocks(g, gi, tb, te, first, &e);
  *start = padded ? (*first > kPadBlocks ? *first - kPadBlocks : 0) : *first;
  *end = padded ? e + kPadBlocks : e;
}

uint64_t ids_needed(const kvf_geometry *g, uint64_t tb, uint64_t te, bool padded) {
  uint64_t n = 0;
  for (uint32_t gi = 0; gi < kvf_geometry_num_groups(g); gi++) {
    uint64_t start = 0, first = 0, end = 0;
    table_range(g, gi, tb, te, padded, &start, &first, &end);
    n += end - start;
  }
  return n;
}

// Distinct random block ids; the first entry inside the range never skipped,
// so every group moves.
Plan make_plan(const kvf_geometry *g, uint64_t tb, uint64_t te, uint32_t num_blocks, std::mt19937_64 &rng,
               bool padded, bool skips) {
  Plan plan;
  plan.token_begin = tb;
  plan.token_end = te;
  std::vector<uint32_t> pool(num_blocks);
  std::iota(pool.begin(), pool.end(), 0u);
  std::shuffle(pool.begin(), pool.end(), rng);
  size_t next = 0;
  for (uint32_t gi = 0; gi < kvf_geometry_num_groups(g); gi++) {
    uint64_t start = 0, first = 0, end = 0;
    table_range(g, gi, tb, te, padded, &start, &first, &end);
    std::vector<uint32_t> ids;
    for (uint64_t b = start; b < end; b++) {
      uint32_t id = pool.at(next++);
      ids.push_back(skips && b != first && rng() % 8 == 0 ? KVF_BLOCK_SKIP : id);
    }
    plan.ids.push_back(ids);
    plan.first_block.push_back(start);
  }
  return plan;
}

// A loaded preset with a plan for it.
struct Prepared {
  GeometryPtr geo;
  Plan plan;
  const kvf_geometry *g() const { return geo.get(); }
};

bool has_recurrent(const kvf_geometry *g) {
  for (uint32_t i = 0; i < kvf_geometry_num_groups(g); i++)
    if (is_recurrent(g, i)) return true;
  return false;
}

// The standard request: [C, 2C + unit) (or [C, 2C) when the unit is a whole
// chunk), a full object and a partial one. The small request (GPU cases, to
// keep data and sanitizer time down): [C, C + unit), one partial object,
// or [C, 2C) where a recurrent group needs a full chunk to carry state.
// The pool of blocks is a quarter larger than the request needs.
void setup_standard(const std::string &preset, bool padded, uint64_t seed, Prepared *out, bool small = false) {
  GeometryPtr probe = load_preset(preset, 4);
  ASSERT_TRUE(probe) << preset << ": " << kvf_last_error();
  uint64_t c = chunk_tokens(probe.get()), unit = attention_unit(probe.get());
  uint64_t tb = c, te = 2 * c + (unit < c ? unit : 0);
  if (small) te = has_recurrent(probe.get()) || unit >= c ? 2 * c : c + unit;
  uint64_t n = ids_needed(probe.get(), tb, te, padded);
  uint32_t num_blocks = (uint32_t)(n + n / 4 + 2);
  out->geo = load_preset(preset, num_blocks);
  ASSERT_TRUE(out->geo) << preset << ": " << kvf_last_error();
  std::mt19937_64 rng(seed);
  out->plan = make_plan(out->g(), tb, te, num_blocks, rng, padded, true);
}

// Window-only retrieval: a prefix long enough that every windowed group
// drops blocks, each windowed group's table cut to its retained window (the
// engine holds null blocks before it), the other groups' tables whole.
void setup_window(const std::string &preset, uint64_t seed, Prepared *out) {
  GeometryPtr probe = load_preset(preset, 4);
  ASSERT_TRUE(probe) << preset << ": " << kvf_last_error();
  uint64_t c = chunk_tokens(probe.get()), unit = attention_unit(probe.get());
  uint64_t tokens = c + (unit < c ? unit : 0);
  for (int grow = 0; grow < 64; grow++, tokens += c) {
    bool all_trim = true;
    for (uint32_t i = 0; i < kvf_geometry_num_groups(probe.get()); i++) {
      uint64_t first = 0, end = 0;
      if (is_windowed(probe.get(), i) &&
          kvf_geometry_retained_blocks(probe.get(), i, tokens, &first, &end) == KVF_SUCCESS && first == 0)
        all_trim = false;
    }
    if (all_trim) break;
  }
  uint64_t n = ids_needed(probe.get(), 0, tokens, false);
  uint32_t num_blocks = (uint32_t)(n + 2);
  out->geo = load_preset(preset, num_blocks);
  ASSERT_TRUE(out->geo) << preset << ": " << kvf_last_error();
  const kvf_geometry *g = out->g();
  std::mt19937_64 rng(seed);
  Plan plan = make_plan(g, 0, tokens, num_blocks, rng, false, false);
  bool any_window = false;
  for (uint32_t i = 0; i < kvf_geometry_num_groups(g); i++) {
    if (!is_windowed(g, i)) continue;
    uint64_t first = 0, end = 0;
    ASSERT_EQ(kvf_geometry_retained_blocks(g, i, tokens, &first, &end), KVF_SUCCESS) << kvf_last_error();
    auto &ids = plan.ids[i];
    ASSERT_LE(end, ids.size());
    ids.erase(ids.begin(), ids.begin() + (long)first);
    plan.first_block[i] = first;
    any_window = any_window || first > 0;
  }
  ASSERT_TRUE(any_window) << preset << ": no windowed group trims blocks: the case would prove nothing";
  out->plan = plan;
}

uint64_t plan_payload(const kvf_geometry *g, const Plan &p) {
  return kvf_test::payload_bytes(g, p.token_begin, p.token_end, p.ids, p.first_block);
}

// ---- buffers with guards -----------------------------------------------------

// One host buffer: [lead guard][payload][tail guard], the whole of it compared.
struct GBuf {
  kvf_test::Buffer buf;
  size_t lead = 0, size = 0, align = 64;
  uint8_t *bytes() const { return buf.data.get(); }
  size_t total() const { return buf.size; }
  uint8_t *payload() const { return size ? bytes() + lead : nullptr; }
};
using Set = std::vector<GBuf>;

GBuf make_gbuf(size_t size, size_t lead, size_t tail, size_t align) {
  GBuf b;
  b.lead = lead;
  b.size = size;
  b.align = std::max<size_t>(align, 4096);
  b.buf = kvf_test::Buffer::make(size ? lead + size + tail : 0, b.align);
  return b;
}

constexpr size_t kObjectGuard = 64;

// Cache regions keep their alignment: the lead guard is a multiple of it.
Set make_cache_set(const kvf_geometry *g) {
  Set s;
  for (uint32_t r = 0; r < kvf_geometry_num_regions(g); r++) {
    kvf_region_info ri = KVF_REGION_INFO_INIT;
    kvf_geometry_region(g, r, &ri);
    size_t lead = std::max<uint64_t>(ri.align, 256);
    s.push_back(make_gbuf(ri.size, lead, 256, ri.align));
  }
  return s;
}

// Objects, chunk-major then object group; `misalign` shifts every object off
// 64-byte alignment.
Set make_object_set(const kvf_geometry *g, uint64_t tb, uint64_t te, size_t misalign) {
  Set s;
  uint64_t c = chunk_tokens(g);
  for (uint64_t b = tb; b < te; b += c)
    for (uint32_t og = 0; og < kvf_geometry_num_object_groups(g); og++) {
      uint64_t size = 0;
      EXPECT_EQ(kvf_geometry_object_size(g, og, b / c, te, &size), KVF_SUCCESS) << kvf_last_error();
      s.push_back(make_gbuf(size, kObjectGuard + misalign, kObjectGuard, 64));
    }
  return s;
}

void fill_random(Set &s, std::mt19937_64 &rng) {
  for (GBuf &b : s) {
    uint64_t x = rng();
    size_t i = 0;
    for (; i + 8 <= b.total(); i += 8) {
      x += 0x9E3779B97F4A7C15ull;  // splitmix64: fast enough for tens of MB per case
      uint64_t z = x;
      z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
      z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
      z ^= z >> 31;
      std::memcpy(b.bytes() + i, &z, 8);
    }
    for (; i < b.total(); i++) b.bytes()[i] = (uint8_t)rng();
  }
}

void fill(Set &s, uint8_t v) {
  for (GBuf &b : s) std::memset(b.bytes(), v, b.total());
}

Set clone(const Set &s) {
  Set c;
  for (const GBuf &b : s) {
    GBuf n = b;
    n.buf = kvf_test::Buffer::make(b.total(), b.align);
    std::memcpy(n.bytes(), b.bytes(), b.total());
    c.push_back(n);
  }
  return c;
}

std::vector<void *> payloads(const Set &s) {
  std::vector<void *> v;
  for (const GBuf &b : s) v.push_back(b.payload());
  return v;
}

// "" when equal; else which buffer, how many bytes, and where the first one is
// (relative to the payload: negative is the lead guard).
std::string diff(const char *what, const Set &got, const Set &want) {
  std::ostringstream os;
  for (size_t i = 0; i < want.size(); i++) {
    const uint8_t *a = got.at(i).bytes(), *b = want[i].bytes();
    size_t n = want[i].total();
    if (n == 0 || std::memcmp(a, b, n) == 0) continue;
    size_t count = 0, first = SIZE_MAX;
    for (size_t j = 0; j < n; j++)
      if (a[j] != b[j]) {
        count++;
        first = std::min(first, j);
      }
    long long at = (long long)first - (long long)want[i].lead;
    os << what << "[" << i << "]: " << count << " bytes differ, first at " << at
       << (at < 0 ? " (lead guard)" : (size_t)at >= want[i].size ? " (tail guard)" : "") << " (payload "
       << want[i].size << " bytes, got 0x" << std::hex << (int)a[first] << " want 0x" << (int)b[first] << std::dec
       << ")\n";
  }
  return os.str();
}

// A case's buffers: the cache regions and the objects.
struct Data {
  Set cache, objs;
};

Data clone(const Data &d) { return {clone(d.cache), clone(d.objs)}; }

// Make dst (a clone of src, or of a set of the same shape) hold src's bytes
// again without allocating: loops that start each round from the same
// inputs spent a third of their time in fresh buffers' page faults.
void refill(Set &to, const Set &from) {
  for (size_t i = 0; i < from.size(); i++) std::memcpy(to.at(i).bytes(), from[i].bytes(), from[i].total());
}
void refill(Data &dst, const Data &src) {
  refill(dst.cache, src.cache);
  refill(dst.objs, src.objs);
}

// Gather: a random cache, objects (and guards) poisoned. Scatter: random
// objects, a cache of different random bytes (the poison).
Data make_inputs(const kvf_geometry *g, const Plan &p, Dir dir, size_t misalign, std::mt19937_64 &rng,
                 uint8_t poison = 0x5A) {
  Data d{make_cache_set(g), make_object_set(g, p.token_begin, p.token_end, misalign)};
  fill_random(d.cache, rng);
  if (dir == Dir::Gather)
    fill(d.objs, poison);
  else
    fill_random(d.objs, rng);
  return d;
}

// Owns everything a kvf_copy_request points at.
struct Req {
  std::vector<void *> bases, objects;
  std::vector<std::vector<uint32_t>> ids;
  std::vector<kvf_group_blocks> groups;
  kvf_copy_request req = KVF_COPY_REQUEST_INIT;
  Req(const Plan &p, kvf_object_format format, std::vector<void *> region_bases, std::vector<void *> objs)
      : bases(std::move(region_bases)), objects(std::move(objs)), ids(p.ids) {
    for (size_t i = 0; i < ids.size(); i++) groups.push_back({nullptr, p.first_block[i], (uint32_t)ids[i].size()});
    req.token_begin = p.token_begin;
    req.token_end = p.token_end;
    req.format = format;
    rebind();
  }
  Req(const Req &) = delete;
  void rebind() {
    for (size_t i = 0; i < ids.size(); i++) groups[i].block_ids = ids[i].empty() ? nullptr : ids[i].data();
    req.region_bases = bases.data();
    req.groups = groups.data();
    req.objects = objects.data();
  }
  const kvf_copy_request *get() const { return &req; }
  // Overwrite every array the request points at (the call must have copied
  // what it needs before returning).
  void scrub() {
    for (auto &v : ids) std::fill(v.begin(), v.end(), 0xEEEEEEEEu);
    for (auto &b : bases) b = reinterpret_cast<void *>(uintptr_t{0xDEAD0000});
    for (auto &o : objects) o = reinterpret_cast<void *>(uintptr_t{0xDEAD1000});
    for (auto &gb : groups) gb = {nullptr, ~0ull, 0xEEEEEEEEu};
  }
};

kvf_status reference(const kvf_geometry *g, const Plan &p, kvf_object_format fmt, Dir dir, Data &d) {
  Req r(p, fmt, payloads(d.cache), payloads(d.objs));
  return dir == Dir::Gather ? kvf_reference_gather(g, r.get()) : kvf_reference_scatter(g, r.get());
}

struct XferDeleter {
  void operator()(kvf_xfer *x) const { kvf_xfer_destroy(x); }
};
using XferPtr = std::unique_ptr<kvf_xfer, XferDeleter>;

XferPtr make_xfer(const kvf_geometry *g, int device, uint32_t host_threads = 0, uint32_t max_sms = 0) {
  kvf_xfer_options opt = KVF_XFER_OPTIONS_INIT;
  opt.device = device;
  opt.host_threads = host_threads;
  opt.max_sms = max_sms;
  kvf_xfer *x = nullptr;
  kvf_status st = kvf_xfer_create(g, &opt, &x);
  EXPECT_EQ(st, KVF_SUCCESS) << "kvf_xfer_create(device " << device << "): " << kvf_last_error();
  return XferPtr(st == KVF_SUCCESS ? x : nullptr);
}

kvf_status call(kvf_xfer *x, Dir dir, const kvf_copy_request *r, kvf_stream s) {
  return dir == Dir::Gather ? kvf_xfer_gather(x, r, s) : kvf_xfer_scatter(x, r, s);
}

// A deferred call (kvf_xfer_gather_deferred or _scatter_deferred) after the
// work on `after`.
kvf_status call_deferred(kvf_xfer *x, Dir dir, const kvf_copy_request *r, kvf_stream after, uint64_t *ticket) {
  return dir == Dir::Gather ? kvf_xfer_gather_deferred(x, r, after, ticket)
                            : kvf_xfer_scatter_deferred(x, r, after, ticket);
}

kvf_xfer_stats stats_of(const kvf_xfer *x) {
  kvf_xfer_stats st = KVF_XFER_STATS_INIT;
  EXPECT_EQ(kvf_xfer_last_stats(x, &st), KVF_SUCCESS) << kvf_last_error();
  return st;
}

// ---- host backend ------------------------------------------------------------

// Runs one host-backend case and compares it with the reference.
void run_host_case(const kvf_geometry *g, const Plan &p, kvf_object_format fmt, Dir dir, uint32_t threads,
                   size_t misalign, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Data in = make_inputs(g, p, dir, misalign, rng);
  Data want = clone(in);
  ASSERT_EQ(reference(g, p, fmt, dir, want), KVF_SUCCESS) << kvf_last_error();
  uint64_t payload = plan_payload(g, p);
  ASSERT_GT(payload, 0u) << "the request moves nothing: the case would prove nothing";

  XferPtr x = make_xfer(g, KVF_DEVICE_HOST, threads);
  ASSERT_TRUE(x);
  Data got = clone(in);
  Req r(p, fmt, payloads(got.cache), payloads(got.objs));
  ASSERT_EQ(call(x.get(), dir, r.get(), nullptr), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(diff("cache region", got.cache, want.cache), "");
  EXPECT_EQ(diff("object", got.objs, want.objs), "");
  kvf_xfer_stats st = stats_of(x.get());
  EXPECT_EQ(st.route, KVF_ROUTE_HOST);
  EXPECT_EQ(st.payload_bytes, payload);
}

struct HostCase {
  std::string preset;
  kvf_object_format format;
  Dir dir;
};

void PrintTo(const HostCase &c, std::ostream *os) {
  *os << c.preset << "/" << format_name(c.format) << "/" << dir_name(c.dir);
}

// Threads rotate with format and direction, so every preset and direction
// runs with 1 and with 4 threads.
uint32_t host_threads_for(const HostCase &c) {
  return (c.format == KVF_FORMAT_CANONICAL) == (c.dir == Dir::Gather) ? 1 : 4;
}

uint64_t seed_of(const std::string &s, uint64_t salt) { return std::hash<std::string>{}(s) * 1000003u + salt; }

class XferHostConformance : public ::testing::TestWithParam<HostCase> {};
class XferHostWindow : public ::testing::TestWithParam<HostCase> {};
class XferHostMisaligned : public ::testing::TestWithParam<HostCase> {};

TEST_P(XferHostConformance, MatchesTheReferenceByteForByte) {
  const HostCase &c = GetParam();
  uint64_t seed = seed_of(c.preset, (uint64_t)c.format * 2 + (uint64_t)c.dir);
  Prepared s;
  ASSERT_NO_FATAL_FAILURE(setup_standard(c.preset, c.format == KVF_FORMAT_CANONICAL, seed, &s));
  run_host_case(s.g(), s.plan, c.format, c.dir, host_threads_for(c), 0, seed + 1);
}

TEST_P(XferHostWindow, WindowOnlyTablesMatchTheReference) {
  const HostCase &c = GetParam();
  uint64_t seed = seed_of(c.preset, 77 + (uint64_t)c.format * 2 + (uint64_t)c.dir);
  Prepared s;
  ASSERT_NO_FATAL_FAILURE(setup_window(c.preset, seed, &s));
  run_host_case(s.g(), s.plan, c.format, c.dir, 0, 0, seed + 1);
}

TEST_P(XferHostMisaligned, UnalignedObjectsMatchTheReference) {
  const HostCase &c = GetParam();
  uint64_t seed = seed_of(c.preset, 99 + (uint64_t)c.format * 2 + (uint64_t)c.dir);
  Prepared s;
  ASSERT_NO_FATAL_FAILURE(setup_standard(c.preset, false, seed, &s));
  for (size_t misalign : {1, 6}) {
    SCOPED_TRACE("objects misaligned by " + std::to_string(misalign));
    run_host_case(s.g(), s.plan, c.format, c.dir, 4, misalign, seed + misalign);
  }
}

bool preset_has_window(const std::string &preset) {
  GeometryPtr g = load_preset(preset, 4);
  if (!g) return false;  // the main suite reports it
  for (uint32_t i = 0; i < kvf_geometry_num_groups(g.get()); i++)
    if (is_windowed(g.get(), i)) return true;
  return false;
}

std::vector<HostCase> host_cases(bool windowed_only) {
  std::vector<HostCase> v;
  for (const std::string &p : preset_names()) {
    if (windowed_only && !preset_has_window(p)) continue;
    for (kvf_object_format f : {KVF_FORMAT_CANONICAL, KVF_FORMAT_NATIVE})
      for (Dir d : {Dir::Gather, Dir::Scatter}) v.push_back({p, f, d});
  }
  return v;
}

// Presets with rows that are not a multiple of 16 bytes (656, 132) and the
// hybrids (every group kind, recurrent states): also the GPU cases that run
// the standard two-object request.
const char *const kOddPresets[] = {"deepseek-v3-mla-fp8-656", "llama-3.1-8b-fp8-inline-scales", "glm-like-hybrid",
                                   "qwen3-next-like-hybrid"};

std::vector<HostCase> odd_cases() {
  std::vector<HostCase> v;
  for (const char *p : kOddPresets)
    for (kvf_object_format f : {KVF_FORMAT_CANONICAL, KVF_FORMAT_NATIVE})
      for (Dir d : {Dir::Gather, Dir::Scatter}) v.push_back({p, f, d});
  return v;
}

std::string host_case_name(const ::testing::TestParamInfo<HostCase> &info) {
  return sanitize(info.param.preset + "_" + format_name(info.param.format) + "_" + dir_name(info.param.dir));
}

INSTANTIATE_TEST_SUITE_P(Presets, XferHostConformance, ::testing::ValuesIn(host_cases(false)), host_case_name);
INSTANTIATE_TEST_SUITE_P(Presets, XferHostWindow, ::testing::ValuesIn(host_cases(true)), host_case_name);
INSTANTIATE_TEST_SUITE_P(Presets, XferHostMisaligned, ::testing::ValuesIn(odd_cases()), host_case_name);

TEST(XferHost, EveryPresetIsCovered) {
  EXPECT_GE(preset_names().size(), 14u);
  EXPECT_GE(host_cases(true).size(), 8u) << "expected at least two presets with windowed groups";
}

// One bad request per rule kvf_copy_request_check enforces.
struct Mutation {
  const char *name;
  void (*apply)(Req &r, const kvf_geometry *g);
};

uint32_t group_blocks(const kvf_geometry *g, uint32_t gi) {
  kvf_group_info info = KVF_GROUP_INFO_INIT;
  kvf_geometry_group(g, gi, &info);
  return info.num_blocks;
}

// A region a moving view lives in: group 0 layer 0's.
uint32_t first_region(const kvf_geometry *g) {
  kvf_view_desc v = KVF_VIEW_DESC_INIT;
  kvf_geometry_view(g, 0, 0, &v);
  return v.region;
}

const Mutation kMutations[] = {
    {"block id == num_blocks (first entry)", [](Req &r, const kvf_geometry *g) { r.ids[0][0] = group_blocks(g, 0); }},
    {"block id far out of range (last entry of the last group)",
     [](Req &r, const kvf_geometry *) { r.ids.back().back() = 0xFFFFFFFEu; }},
    {"token_begin not a multiple of chunk_tokens", [](Req &r, const kvf_geometry *) { r.req.token_begin += 1; }},
    {"token_end == token_begin", [](Req &r, const kvf_geometry *) { r.req.token_end = r.req.token_begin; }},
    {"unknown format", [](Req &r, const kvf_geometry *) { r.req.format = (kvf_object_format)7; }},
    {"groups NULL", [](Req &r, const kvf_geometry *) { r.req.groups = nullptr; }},
    {"region base NULL", [](Req &r, const kvf_geometry *g) { r.bases[first_region(g)] = nullptr; }},
    {"region base misaligned",
     [](Req &r, const kvf_geometry *g) {
       uint32_t reg = first_region(g);
       r.bases[reg] = static_cast<uint8_t *>(r.bases[reg]) + 64;
     }},
    {"object NULL", [](Req &r, const kvf_geometry *) { r.objects[0] = nullptr; }},
    {"native request ending mid-block",
     [](Req &r, const kvf_geometry *g) {
       uint32_t world = 1;  // one local token fewer on every dcp rank
       kvf_geometry_dcp(g, &world, nullptr);
       r.req.format = KVF_FORMAT_NATIVE;
       r.req.token_end -= world;
     }},
    {"struct_size 0", [](Req &r, const kvf_geometry *) { r.req.struct_size = 0; }},
    {"version 0", [](Req &r, const kvf_geometry *) { r.req.version = 0; }},
};

// Runs every mutation in both directions: the call returns the status (and
// the message) kvf_copy_request_check gives, and no buffer changes.
// `live`: the buffers' contents before any call; `pointers()`: the region
// bases and objects to put in the request (host or device memory);
// `sync_and_download()`: the buffers as they are now, after the stream's work.
template <typename Pointers, typename Sync>
void expect_bad_requests_rejected(const kvf_geometry *g, const Plan &p, kvf_xfer *x, const Data &live,
                                  Pointers &&pointers, Sync &&sync_and_download, kvf_stream stream) {
  for (Dir dir : {Dir::Gather, Dir::Scatter})
    for (const Mutation &m : kMutations) {
      SCOPED_TRACE(std::string(dir_name(dir)) + ": " + m.name);
      auto [bases, objs] = pointers();
      Req r(p, KVF_FORMAT_CANONICAL, bases, objs);
      m.apply(r, g);
      kvf_status want = kvf_copy_request_check(g, r.get());
      std::string want_msg = kvf_last_error();
      ASSERT_NE(want, KVF_SUCCESS) << "the mutation should make the request invalid";
      kvf_xfer_stats before = stats_of(x);
      EXPECT_EQ(call(x, dir, r.get(), stream), want);
      std::string msg = kvf_last_error();
      EXPECT_NE(msg.find(want_msg), std::string::npos)
          << "message '" << msg << "' should carry the check's '" << want_msg << "'";
      const Data &after = sync_and_download();
      EXPECT_EQ(diff("cache region", after.cache, live.cache), "");
      EXPECT_EQ(diff("object", after.objs, live.objs), "");
      kvf_xfer_stats now = stats_of(x);
      EXPECT_EQ(now.payload_bytes, before.payload_bytes) << "a failed call changed the stats";
      EXPECT_EQ(now.route, before.route);
    }
  // NULL request and NULL context.
  EXPECT_EQ(kvf_xfer_gather(x, nullptr, stream), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(kvf_xfer_scatter(x, nullptr, stream), KVF_ERR_INVALID_ARGUMENT);
  auto [bases, objs] = pointers();
  Req ok(p, KVF_FORMAT_CANONICAL, bases, objs);
  EXPECT_EQ(kvf_xfer_gather(nullptr, ok.get(), stream), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(kvf_xfer_scatter(nullptr, ok.get(), stream), KVF_ERR_INVALID_ARGUMENT);
}

TEST(XferHost, BadRequestsReturnTheCheckStatusAndWriteNothing) {
  for (const char *preset : {"glm-like-hybrid", "deepseek-v3-mla-dcp4-rank1"}) {
    SCOPED_TRACE(preset);
    Prepared s;
    ASSERT_NO_FATAL_FAILURE(setup_standard(preset, true, 5, &s));
    std::mt19937_64 rng(6);
    Data live = make_inputs(s.g(), s.plan, Dir::Gather, 0, rng);
    XferPtr x = make_xfer(s.g(), KVF_DEVICE_HOST, 2);
    ASSERT_TRUE(x);
    // A successful call first, so the stats have something to keep.
    Data scratch = clone(live);
    Req good(s.plan, KVF_FORMAT_CANONICAL, payloads(scratch.cache), payloads(scratch.objs));
    ASSERT_EQ(kvf_xfer_gather(x.get(), good.get(), nullptr), KVF_SUCCESS) << kvf_last_error();
    Data work = clone(live);
    expect_bad_requests_rejected(
        s.g(), s.plan, x.get(), live,
        [&] { return std::make_pair(payloads(work.cache), payloads(work.objs)); },
        [&]() -> const Data & { return work; }, nullptr);
  }
}

// A launch table indexes a request's block ids in 32 bits (kernels/plan.h):
// kvf_copy_request_check refuses block tables of more than 2^32 - 1 blocks in
// all, naming the group where the sum passes it, before it reads any table
// (the counts here are far larger than the arrays behind them: a check that
// read them first would read out of bounds), and a call returns that status
// with nothing written.
TEST(XferHost, RequestOfMoreThan32BitsOfBlocksIsRefusedBeforeAnyTableIsRead) {
  Prepared s;
  ASSERT_NO_FATAL_FAILURE(setup_standard("glm-like-hybrid", true, 5, &s));
  const kvf_geometry *g = s.g();
  std::mt19937_64 rng(6);
  Data live = make_inputs(g, s.plan, Dir::Gather, 0, rng), work = clone(live);
  Req r(s.plan, KVF_FORMAT_CANONICAL, payloads(work.cache), payloads(work.objs));
  ASSERT_GE(r.groups.size(), 2u);
  ASSERT_TRUE(r.groups[0].block_ids && r.groups[1].block_ids && r.groups[1].count > 0);
  r.groups[0].count = UINT32_MAX;  // alone the most a request may hold; group 1's blocks pass it
  EXPECT_EQ(kvf_copy_request_check(g, r.get()), KVF_ERR_INVALID_ARGUMENT);
  const std::string msg = kvf_last_error();
  EXPECT_NE(msg.find("groups[1].count"), std::string::npos) << msg;
  EXPECT_NE(msg.find("2^32 - 1 blocks"), std::string::npos) << msg;
  XferPtr x = make_xfer(g, KVF_DEVICE_HOST, 2);
  ASSERT_TRUE(x);
  EXPECT_EQ(kvf_xfer_gather(x.get(), r.get(), nullptr), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(diff("cache region", work.cache, live.cache), "");
  EXPECT_EQ(diff("object", work.objs, live.objs), "");
}

// A blob entry keeps a segment's place in an object in 32 bits
// (kvf_blob_entry): kvf_plan_build, and so kvf_xfer_create, refuse a
// geometry whose object holds 4 GiB or more before a layer, naming the
// layer and what is too large. Attention: five layers of 1 GiB a token
// (1024 heads of 1 MiB), the fifth starting 4 GiB into each token; recurrent:
// five layers of one 1 GiB state, the fifth 4 GiB into the object's states.
// Four such layers (the fourth at 3 GiB) plan.
TEST(XferHost, ObjectOffsetsOf4GiBOrMoreAreRefusedNamingTheLayer) {
  const uint64_t gib = 1ull << 30;
  auto attention = [&](int layers) {
    return R"({"format": "kvferry-geometry", "version": 1, "name": "wide-tokens",
      "regions": [{"name": "kv", "size": 0}],
      "groups": [{"name": "full", "kind": "full", "block_size": 1, "num_blocks": 1,
        "layers": [{"count": )" + std::to_string(layers) + R"(, "name": "layer", "region": "kv", "offset": 0,
          "offset_step": )" + std::to_string(gib) + R"(, "elem_bytes": 2, "block_stride": )" +
           std::to_string(gib * layers) + R"(, "planes": 1, "heads": 1024, "head_bytes": 1048576,
          "plane_stride": 0, "token_stride": )" + std::to_string(gib) + R"(, "head_stride": 1048576}]}],
      "objects": {"chunk_tokens": 16, "format": "canonical"}})";
  };
  auto recurrent = [&](int layers) {
    return R"({"format": "kvferry-geometry", "version": 1, "name": "wide-states",
      "regions": [{"name": "ssm", "size": 0}],
      "groups": [{"name": "mamba", "kind": "recurrent", "num_blocks": 1,
        "layers": [{"count": )" + std::to_string(layers) + R"(, "name": "mamba", "region": "ssm", "offset": 0,
          "offset_step": )" + std::to_string(gib) + R"(, "block_stride": )" + std::to_string(gib) + R"(,
          "states": [{"offset": 0, "bytes": )" + std::to_string(gib) + R"(}]}]}],
      "objects": {"chunk_tokens": 16, "format": "canonical"}})";
  };
  struct Case {
    const char *what;
    std::function<std::string(int)> json;
    const char *says;
  };
  for (const Case &c : {Case{"attention", attention, "of each token before it"},
                        Case{"recurrent", recurrent, "of the object's states"}})
    for (int layers : {4, 5}) {
      SCOPED_TRACE(std::string(c.what) + ", " + std::to_string(layers) + " layers");
      const std::string json = c.json(layers);
      kvf_geometry *raw = nullptr;
      kvf_geometry_error err;
      ASSERT_EQ(kvf_geometry_load_buffer(json.data(), json.size(), nullptr, &raw, &err), KVF_SUCCESS)
          << kvf_last_error();
      GeometryPtr g(raw);
      kvf_plan plan;
      const kvf_status st = kvf_plan_build(g.get(), KVF_FORMAT_CANONICAL, &plan);
      if (layers == 4) {
        EXPECT_EQ(st, KVF_SUCCESS) << kvf_last_error();
        if (st == KVF_SUCCESS) kvf_plan_free(&plan);
        continue;
      }
      EXPECT_EQ(st, KVF_ERR_UNSUPPORTED);
      const std::string msg = kvf_last_error();
      EXPECT_NE(msg.find("groups[0].layers[4]"), std::string::npos) << msg;
      EXPECT_NE(msg.find("4 GiB"), std::string::npos) << msg;
      EXPECT_NE(msg.find(c.says), std::string::npos) << msg;
      kvf_xfer *x = nullptr;
      EXPECT_EQ(kvf_xfer_create(g.get(), nullptr, &x), KVF_ERR_UNSUPPORTED);
      EXPECT_EQ(x, nullptr);
    }
}

// The kernels index a block's units in 32 bits: kvf_plan_build refuses a
// layer whose one block holds 2 GiB or more (two tokens of 1024 heads of
// 1 MiB), naming the group. (Its message was formatted from the plan after
// the plan was freed: AddressSanitizer's heap-use-after-free.)
TEST(XferHost, OneBlockOf2GiBOrMoreIsRefusedNamingTheGroup) {
  const uint64_t gib = 1ull << 30;
  const std::string json = R"({"format": "kvferry-geometry", "version": 1, "name": "wide-blocks",
    "regions": [{"name": "kv", "size": 0}],
    "groups": [{"name": "full", "kind": "full", "block_size": 2, "num_blocks": 1,
      "layers": [{"count": 1, "name": "layer", "region": "kv", "offset": 0, "elem_bytes": 2,
        "block_stride": )" + std::to_string(2 * gib) + R"(, "planes": 1, "heads": 1024, "head_bytes": 1048576,
        "plane_stride": 0, "token_stride": )" + std::to_string(gib) + R"(, "head_stride": 1048576}]}],
    "objects": {"chunk_tokens": 16, "format": "canonical"}})";
  kvf_geometry *raw = nullptr;
  kvf_geometry_error err;
  ASSERT_EQ(kvf_geometry_load_buffer(json.data(), json.size(), nullptr, &raw, &err), KVF_SUCCESS) << kvf_last_error();
  GeometryPtr g(raw);
  kvf_plan plan;
  EXPECT_EQ(kvf_plan_build(g.get(), KVF_FORMAT_CANONICAL, &plan), KVF_ERR_UNSUPPORTED);
  const std::string msg = kvf_last_error();
  EXPECT_NE(msg.find("group 0: one block of one layer holds 2 GiB or more"), std::string::npos) << msg;
}

TEST(XferHost, CreateRejectsBadArguments) {
  GeometryPtr g = load_preset("glm-like-hybrid", 8);
  ASSERT_TRUE(g);
  kvf_xfer *x = nullptr;
  EXPECT_EQ(kvf_xfer_create(nullptr, nullptr, &x), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(x, nullptr);
  EXPECT_EQ(kvf_xfer_create(g.get(), nullptr, nullptr), KVF_ERR_INVALID_ARGUMENT);

  kvf_xfer_options opt = KVF_XFER_OPTIONS_INIT;
  opt.struct_size = 0;
  EXPECT_EQ(kvf_xfer_create(g.get(), &opt, &x), KVF_ERR_INVALID_ARGUMENT);
  opt = KVF_XFER_OPTIONS_INIT;
  opt.version = 0;
  EXPECT_EQ(kvf_xfer_create(g.get(), &opt, &x), KVF_ERR_INVALID_ARGUMENT);
  opt = KVF_XFER_OPTIONS_INIT;
  opt.device = -2;
  EXPECT_EQ(kvf_xfer_create(g.get(), &opt, &x), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(x, nullptr);

  kvf_geometry *raw = nullptr;
  ASSERT_EQ(kvf_geometry_create(&raw), KVF_SUCCESS);
  GeometryPtr unfinalized(raw);
  EXPECT_EQ(kvf_xfer_create(unfinalized.get(), nullptr, &x), KVF_ERR_STATE);
  EXPECT_EQ(x, nullptr);

  // NULL options: the host backend.
  ASSERT_EQ(kvf_xfer_create(g.get(), nullptr, &x), KVF_SUCCESS) << kvf_last_error();
  XferPtr owned(x);
  kvf_xfer_destroy(nullptr);  // a no-op
  EXPECT_EQ(kvf_xfer_last_stats(owned.get(), nullptr), KVF_ERR_INVALID_ARGUMENT);
  kvf_xfer_stats st = KVF_XFER_STATS_INIT;
  EXPECT_EQ(kvf_xfer_last_stats(nullptr, &st), KVF_ERR_INVALID_ARGUMENT);
}

TEST(XferHost, CudaDeviceWithoutACudaDeviceFails) {
  kvf_cuda_info info = KVF_CUDA_INFO_INIT;
  if (kvf_cuda_probe(&info) == KVF_SUCCESS) GTEST_SKIP() << "a CUDA device is present: " << info.message;
  GeometryPtr g = load_preset("glm-like-hybrid", 8);
  ASSERT_TRUE(g);
  kvf_xfer_options opt = KVF_XFER_OPTIONS_INIT;
  opt.device = 0;
  kvf_xfer *x = nullptr;
  kvf_status st = kvf_xfer_create(g.get(), &opt, &x);
  EXPECT_TRUE(st == KVF_ERR_NO_DRIVER || st == KVF_ERR_NO_DEVICE || st == KVF_ERR_UNSUPPORTED)
      << kvf_status_string(st) << ": " << kvf_last_error();
  EXPECT_EQ(x, nullptr);
  EXPECT_STRNE(kvf_last_error(), "");
}

TEST(XferHost, RouteNames) {
  EXPECT_STREQ(kvf_xfer_route_name(KVF_ROUTE_D2H), "d2h");
  std::vector<std::string> names;
  for (kvf_xfer_route r : {KVF_ROUTE_HOST, KVF_ROUTE_D2D, KVF_ROUTE_D2H, KVF_ROUTE_H2D, KVF_ROUTE_PEER,
                           KVF_ROUTE_HOST_TO_HOST}) {
    const char *n = kvf_xfer_route_name(r);
    ASSERT_NE(n, nullptr);
    EXPECT_STRNE(n, "");
    names.push_back(n);
  }
  std::sort(names.begin(), names.end());
  EXPECT_EQ(std::unique(names.begin(), names.end()), names.end()) << "route names must be distinct";
  EXPECT_NE(kvf_xfer_route_name((kvf_xfer_route)99), nullptr);
}

TEST(XferHost, MoreThreadsThanWork) {
  // One block of one group moves; 64 threads must not trip over each other.
  GeometryPtr g = load_preset("llama-3.1-8b-fa-nhd", 8);
  ASSERT_TRUE(g);
  Plan p;
  p.token_begin = 0;
  p.token_end = 16;
  p.ids = {{5}};
  p.first_block = {0};
  for (Dir d : {Dir::Gather, Dir::Scatter}) {
    SCOPED_TRACE(dir_name(d));
    run_host_case(g.get(), p, KVF_FORMAT_CANONICAL, d, 64, 0, 11 + (uint64_t)d);
  }
}

// Deferred calls on the host backend run at once (the bytes are there when
// the call returns) and take tickets counted from 1, each done at once;
// joins, queries and flushes have nothing to wait for, and a ticket never
// given is refused, naming the field. Bad requests fail as a synchronous
// call's do, taking no ticket.
TEST(XferHost, DeferredCallsRunAtOnceOnTheHostBackend) {
  GeometryPtr g = load_preset("llama-3.1-8b-fa-nhd", 8);
  ASSERT_TRUE(g);
  Plan p;
  p.token_begin = 0;
  p.token_end = 48;
  p.ids = {{5, 2, 7}};
  p.first_block = {0};
  std::mt19937_64 rng(131);
  Data in = make_inputs(g.get(), p, Dir::Gather, 0, rng), want = clone(in);
  ASSERT_EQ(reference(g.get(), p, KVF_FORMAT_CANONICAL, Dir::Gather, want), KVF_SUCCESS) << kvf_last_error();
  XferPtr x = make_xfer(g.get(), KVF_DEVICE_HOST);
  ASSERT_TRUE(x);
  auto refused = [](kvf_status st, kvf_status want, const char *named) {
    std::string msg = kvf_last_error();
    EXPECT_EQ(st, want) << msg;
    EXPECT_NE(msg.find(named), std::string::npos) << msg;
  };
  int done = 0;
  refused(kvf_xfer_query(x.get(), 1, &done), KVF_ERR_INVALID_ARGUMENT, "ticket 1");
  refused(kvf_xfer_join(x.get(), 1, nullptr), KVF_ERR_INVALID_ARGUMENT, "ticket 1");
  Data got = clone(in);
  Req r(p, KVF_FORMAT_CANONICAL, payloads(got.cache), payloads(got.objs));
  uint64_t ticket = 0;
  ASSERT_EQ(kvf_xfer_gather_deferred(x.get(), r.get(), nullptr, &ticket), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(ticket, 1u);
  EXPECT_EQ(diff("object", got.objs, want.objs), "");
  EXPECT_EQ(kvf_xfer_query(x.get(), ticket, &done), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(done, 1);
  EXPECT_EQ(kvf_xfer_join(x.get(), ticket, nullptr), KVF_SUCCESS) << kvf_last_error();
  // A scatter of the gathered objects back into a zeroed cache.
  Data back = clone(got);
  for (GBuf &region : back.cache) std::memset(region.payload(), 0, region.size);
  Req rs(p, KVF_FORMAT_CANONICAL, payloads(back.cache), payloads(back.objs));
  ASSERT_EQ(kvf_xfer_scatter_deferred(x.get(), rs.get(), nullptr, &ticket), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(ticket, 2u);
  Data want_back = clone(back);
  ASSERT_EQ(reference(g.get(), p, KVF_FORMAT_CANONICAL, Dir::Scatter, want_back), KVF_SUCCESS) << kvf_last_error();
  // The reference scatters the same objects into the zeroed cache: equal.
  EXPECT_EQ(diff("cache region", back.cache, want_back.cache), "");
  EXPECT_EQ(kvf_xfer_flush(x.get()), KVF_SUCCESS) << kvf_last_error();
  // A bad request: the check's error, no ticket taken.
  Req bad(p, KVF_FORMAT_CANONICAL, payloads(got.cache), payloads(got.objs));
  bad.req.token_end = bad.req.token_begin;
  uint64_t untouched = 77;
  EXPECT_NE(kvf_xfer_gather_deferred(x.get(), bad.get(), nullptr, &untouched), KVF_SUCCESS);
  EXPECT_EQ(untouched, 77u);
  refused(kvf_xfer_query(x.get(), 3, &done), KVF_ERR_INVALID_ARGUMENT, "ticket 3");
  refused(kvf_xfer_query(x.get(), 0, &done), KVF_ERR_INVALID_ARGUMENT, "ticket 0");
  refused(kvf_xfer_join(x.get(), 0, nullptr), KVF_ERR_INVALID_ARGUMENT, "ticket 0");
  refused(kvf_xfer_gather_deferred(x.get(), r.get(), nullptr, nullptr), KVF_ERR_INVALID_ARGUMENT, "ticket");
  refused(kvf_xfer_scatter_deferred(nullptr, r.get(), nullptr, &ticket), KVF_ERR_INVALID_ARGUMENT,
          "kvf_xfer_scatter_deferred");
  refused(kvf_xfer_query(x.get(), 1, nullptr), KVF_ERR_INVALID_ARGUMENT, "kvf_xfer_query");
  refused(kvf_xfer_join(nullptr, 1, nullptr), KVF_ERR_INVALID_ARGUMENT, "kvf_xfer_join");
  refused(kvf_xfer_flush(nullptr), KVF_ERR_INVALID_ARGUMENT, "kvf_xfer_flush");
}

// Every block skipped: nothing moves, so no object is needed and `objects`
// may be NULL (kvf_copy_request_check accepts it). The launch blob must not
// read the missing array.
TEST(XferHost, AllBlocksSkippedNeedsNoObjects) {
  GeometryPtr g = load_preset("llama-3.1-8b-fa-nhd", 8);
  ASSERT_TRUE(g);
  kvf_region_info ri = KVF_REGION_INFO_INIT;
  ASSERT_EQ(kvf_geometry_region(g.get(), 0, &ri), KVF_SUCCESS);
  std::vector<unsigned char> cache(ri.size + ri.align, 0x5a);
  void *base = cache.data() + (ri.align - (uintptr_t)cache.data() % ri.align) % ri.align;
  std::vector<void *> bases(kvf_geometry_num_regions(g.get()), base);
  uint32_t ids[16];
  for (uint32_t &id : ids) id = KVF_BLOCK_SKIP;
  std::vector<kvf_group_blocks> groups(kvf_geometry_num_groups(g.get()));
  for (kvf_group_blocks &t : groups) t = {ids, 0, 16};
  kvf_copy_request r = KVF_COPY_REQUEST_INIT;
  r.region_bases = bases.data();
  r.token_begin = 0;
  r.token_end = 256;
  r.groups = groups.data();
  r.objects = nullptr;
  ASSERT_EQ(kvf_copy_request_check(g.get(), &r), KVF_SUCCESS) << kvf_last_error();
  XferPtr x = make_xfer(g.get(), KVF_DEVICE_HOST);
  ASSERT_TRUE(x);
  EXPECT_EQ(kvf_xfer_gather(x.get(), &r, nullptr), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(kvf_xfer_scatter(x.get(), &r, nullptr), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(kvf_reference_gather(g.get(), &r), KVF_SUCCESS) << kvf_last_error();
  for (unsigned char b : cache) ASSERT_EQ(b, 0x5a);
}

TEST(XferHost, ConcurrentCallsOnOneContext) {
  Prepared s;
  ASSERT_NO_FATAL_FAILURE(setup_standard("glm-like-hybrid", true, 21, &s));
  std::mt19937_64 rng(22);
  Data in = make_inputs(s.g(), s.plan, Dir::Gather, 0, rng);
  Data want = clone(in);
  ASSERT_EQ(reference(s.g(), s.plan, KVF_FORMAT_CANONICAL, Dir::Gather, want), KVF_SUCCESS);
  XferPtr x = make_xfer(s.g(), KVF_DEVICE_HOST, 2);
  ASSERT_TRUE(x);
  constexpr int kThreads = 4, kRounds = 3;
  std::vector<Set> outs;
  for (int t = 0; t < kThreads; t++) outs.push_back(clone(in.objs));
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; t++)
    threads.emplace_back([&, t] {
      for (int k = 0; k < kRounds; k++) {
        Req r(s.plan, KVF_FORMAT_CANONICAL, payloads(in.cache), payloads(outs[t]));
        if (kvf_xfer_gather(x.get(), r.get(), nullptr) != KVF_SUCCESS) failures++;
      }
    });
  for (auto &t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
  for (int t = 0; t < kThreads; t++) EXPECT_EQ(diff("object", outs[t], want.objs), "") << "thread " << t;
}

// ---- the staged route's plan (host/core/xfer_internal.h), no GPU needed -------
//
// Which objects of a host<->device request go through the device staging
// buffers, which of their bytes, and the batches of whole chunks a staged
// call enqueues one after another: the unit the failure contract of
// kvferry/transfer.h counts in. Pointers here are never dereferenced.

struct StagePlan {
  kvf_stage_plan p{};
  StagePlan() = default;
  StagePlan(const StagePlan &) = delete;
  StagePlan &operator=(const StagePlan &) = delete;
  ~StagePlan() { kvf_stage_plan_free(&p); }
};

// Chunks [0, chunks) of `preset` (plus `extra` tokens of a partial one),
// every block present, a table cut to the range.
void setup_chunks(const std::string &preset, uint64_t chunks, uint64_t extra, uint64_t seed, Prepared *out) {
  GeometryPtr probe = load_preset(preset, 4);
  ASSERT_TRUE(probe) << preset << ": " << kvf_last_error();
  uint64_t c = chunk_tokens(probe.get()), te = chunks * c + extra;
  uint64_t n = ids_needed(probe.get(), 0, te, false);
  uint32_t num_blocks = (uint32_t)(n + 2);
  out->geo = load_preset(preset, num_blocks);
  ASSERT_TRUE(out->geo) << preset << ": " << kvf_last_error();
  std::mt19937_64 rng(seed);
  out->plan = make_plan(out->g(), 0, te, num_blocks, rng, false, false);
}

// Aligned stand-ins for the cache regions and one per object (never read).
std::vector<void *> fake_bases(const kvf_geometry *g) {
  std::vector<void *> v;
  for (uint32_t r = 0; r < kvf_geometry_num_regions(g); r++)
    v.push_back(reinterpret_cast<void *>(uintptr_t{1} << 40 | uintptr_t{r} << 32));
  return v;
}

std::vector<void *> fake_objects(const kvf_geometry *g, const Plan &p) {
  uint64_t c = chunk_tokens(g), n = (p.token_end - p.token_begin + c - 1) / c * kvf_geometry_num_object_groups(g);
  std::vector<void *> v;
  for (uint64_t i = 0; i < n; i++) v.push_back(reinterpret_cast<void *>(uintptr_t{1} << 44 | (i + 1) << 24));
  return v;
}

uint64_t object_bytes(const kvf_geometry *g, const kvf_copy_request *r, uint64_t i) {
  uint32_t nog = kvf_geometry_num_object_groups(g);
  uint64_t size = 0;
  EXPECT_EQ(kvf_geometry_object_size(g, (uint32_t)(i % nog), r->token_begin / chunk_tokens(g) + i / nog,
                                     r->token_end, &size),
            KVF_SUCCESS)
      << kvf_last_error();
  return size;
}

// The invariants of a plan split for buffers of `cap` bytes, the batch at
// the exposed end (a gather's first, a scatter's last) at `edge` (0: cap).
void check_batches(const kvf_geometry *g, const kvf_copy_request *r, const kvf_stage_plan &p, uint64_t cap,
                   uint64_t edge = 0, int gather = 1) {
  uint64_t nog = kvf_geometry_num_object_groups(g), next = 0;
  const uint64_t ecap = edge == 0 || edge > cap ? cap : edge, nb = p.num_batches;
  ASSERT_EQ(p.num_objects, p.num_chunks * nog);
  ASSERT_GE(p.num_batches, 1u);
  ASSERT_LE(p.num_batches, p.num_chunks);
  auto chunk_bytes = [&](uint64_t k) {
    uint64_t b = 0;
    for (uint64_t og = 0; og < nog; og++) b += p.size[k * nog + og];
    return b;
  };
  for (uint64_t bi = 0; bi < p.num_batches; bi++) {
    const kvf_stage_batch &b = p.batches[bi];
    SCOPED_TRACE("batch " + std::to_string(bi));
    EXPECT_EQ(b.k0, next) << "batches must be consecutive runs of chunks";
    ASSERT_GT(b.k1, b.k0);
    next = b.k1;
    uint64_t used = 0;
    for (uint64_t i = b.k0 * nog; i < b.k1 * nog; i++) {
      if (!p.staged[i]) {
        EXPECT_EQ(p.size[i], 0u) << "object " << i;
        continue;
      }
      uint64_t size = object_bytes(g, r, i);
      EXPECT_EQ(p.offset[i], used) << "object " << i << ": staged objects are packed in order";
      EXPECT_EQ(p.offset[i] % KVF_STAGE_ALIGN, 0u) << "object " << i;
      EXPECT_EQ(p.size[i] % KVF_STAGE_ALIGN, 0u) << "object " << i;
      EXPECT_GE(p.size[i], size) << "object " << i;
      EXPECT_LT(p.size[i], size + KVF_STAGE_ALIGN) << "object " << i;
      EXPECT_LE(p.span[2 * i], p.span[2 * i + 1]) << "object " << i;
      EXPECT_LE(p.span[2 * i + 1], size) << "object " << i;
      used += p.size[i];
    }
    EXPECT_EQ(b.bytes, used);
    const bool edge_batch = ecap < cap && (gather ? bi == 0 : bi + 1 == nb);
    const uint64_t limit = edge_batch ? ecap : cap;
    EXPECT_LE(b.bytes, std::max(limit, p.max_chunk));
    if (b.k1 - b.k0 > 1) {
      EXPECT_LE(b.bytes, limit) << "several chunks must fit one buffer (the edge batch its smaller limit)";
    }
    // Greedy: the next chunk would not have fit, except where a scatter's
    // batches stop at its last batch.
    const bool before_edge = !gather && ecap < cap && bi + 2 == nb;
    if (b.k1 < p.num_chunks && !before_edge) {
      EXPECT_GT(b.bytes + chunk_bytes(b.k1), limit) << "the next chunk would have fit";
    }
    if (edge_batch && !gather && b.k0 > 0) {
      EXPECT_GT(b.bytes + chunk_bytes(b.k0 - 1), ecap) << "a scatter's last batch takes every trailing chunk that fits";
    }
  }
  EXPECT_EQ(next, p.num_chunks) << "the batches must cover every chunk";
}

TEST(XferStagePlan, BatchesAreWholeChunksThatFitOneBuffer) {
  for (const std::string &preset : preset_names()) {
    SCOPED_TRACE(preset);
    GeometryPtr probe = load_preset(preset, 4);
    ASSERT_TRUE(probe) << preset << ": " << kvf_last_error();
    uint64_t c = chunk_tokens(probe.get()), unit = attention_unit(probe.get());
    Prepared s;
    ASSERT_NO_FATAL_FAILURE(setup_chunks(preset, 6, unit < c ? unit : 0, 3, &s));
    const kvf_geometry *g = s.g();
    Req r(s.plan, KVF_FORMAT_CANONICAL, fake_bases(g), fake_objects(g, s.plan));
    ASSERT_EQ(kvf_copy_request_check(g, r.get()), KVF_SUCCESS) << kvf_last_error();
    for (int gather : {1, 0}) {
      SCOPED_TRACE(gather ? "gather" : "scatter");
      StagePlan sp;
      ASSERT_EQ(kvf_stage_plan_objects(g, r.get(), gather, &sp.p), KVF_SUCCESS) << kvf_last_error();
      EXPECT_EQ(sp.p.num_chunks, kvf_copy_request_chunks(g, r.get()));
      EXPECT_EQ(sp.p.any_direct, 0) << "every block is present: every object is written whole";
      for (uint64_t i = 0; i < sp.p.num_objects; i++) EXPECT_TRUE(sp.p.staged[i]) << "object " << i;
      ASSERT_GT(sp.p.max_chunk, 0u);
      uint64_t m = sp.p.max_chunk;
      for (uint64_t cap : {m, 2 * m + 1, m * 7 / 2, m * 100})
        for (uint64_t edge : {(uint64_t)0, (uint64_t)1, m, 2 * m + 1}) {
          SCOPED_TRACE("cap " + std::to_string(cap) + ", edge " + std::to_string(edge));
          kvf_stage_plan_batches(&sp.p, cap, edge, gather);
          ASSERT_NO_FATAL_FAILURE(check_batches(g, r.get(), sp.p, cap, edge, gather));
          if (cap == m) {
            EXPECT_GE(sp.p.num_batches, 3u) << "six full chunks in buffers of one chunk";
          }
          if (cap == m * 100 && edge == 0) {
            EXPECT_EQ(sp.p.num_batches, 1u);
          }
          if (cap == m * 100 && (edge == 1 || edge == m)) {
            // One chunk at the exposed end, the others together.
            EXPECT_EQ(sp.p.num_batches, 2u);
            const kvf_stage_batch &e = gather ? sp.p.batches[0] : sp.p.batches[sp.p.num_batches - 1];
            if (edge == 1) {
              EXPECT_EQ(e.k1 - e.k0, 1u) << "the edge batch takes at least its one chunk";
            }
          }
        }
    }
  }
}

// kvf_stage_plan_batches on chunks of hand-picked sizes (one object group):
// the exact batches, so the edge rules are checked where chunks differ (a
// short last chunk joins the scatter's last batch with its neighbours).
std::vector<std::pair<uint64_t, uint64_t>> batches_of(const std::vector<uint64_t> &sizes, uint64_t cap,
                                                      uint64_t edge, int gather) {
  kvf_stage_plan p = {};
  std::vector<uint64_t> size = sizes, offset(sizes.size());
  std::vector<kvf_stage_batch> batches(sizes.size());
  p.num_chunks = p.num_objects = sizes.size();
  p.size = size.data();
  p.offset = offset.data();
  p.batches = batches.data();
  kvf_stage_plan_batches(&p, cap, edge, gather);
  std::vector<std::pair<uint64_t, uint64_t>> out;
  for (uint64_t i = 0; i < p.num_batches; i++) out.push_back({batches[i].k0, batches[i].k1});
  return out;
}

TEST(XferStagePlan, EdgeBatchOnChunksOfDifferentSizes) {
  using B = std::vector<std::pair<uint64_t, uint64_t>>;
  const std::vector<uint64_t> sizes = {4, 4, 4, 4, 1, 1};  // a request ending in two short chunks
  // No edge limit: greedy at cap 8.
  EXPECT_EQ(batches_of(sizes, 8, 0, 1), (B{{0, 2}, {2, 4}, {4, 6}}));
  EXPECT_EQ(batches_of(sizes, 8, 0, 0), (B{{0, 2}, {2, 4}, {4, 6}}));
  // A gather's first batch at most 4: one chunk, then greedy at 16.
  EXPECT_EQ(batches_of(sizes, 16, 4, 1), (B{{0, 1}, {1, 6}}));
  EXPECT_EQ(batches_of(sizes, 12, 4, 1), (B{{0, 1}, {1, 4}, {4, 6}}));
  // A scatter's last batch: every trailing chunk that fits 6 (1 + 1 + 4).
  EXPECT_EQ(batches_of(sizes, 16, 6, 0), (B{{0, 3}, {3, 6}}));
  // Edge smaller than any chunk: still one chunk.
  EXPECT_EQ(batches_of(sizes, 16, 1, 1), (B{{0, 1}, {1, 6}}));
  EXPECT_EQ(batches_of(sizes, 16, 1, 0), (B{{0, 4}, {4, 5}, {5, 6}}));
  // Everything fits the edge: one batch either way.
  EXPECT_EQ(batches_of(sizes, 64, 32, 1), (B{{0, 6}}));
  EXPECT_EQ(batches_of(sizes, 64, 32, 0), (B{{0, 6}}));
  // Edge at or above cap: no edge rule.
  EXPECT_EQ(batches_of(sizes, 8, 8, 0), batches_of(sizes, 8, 0, 0));
  EXPECT_EQ(batches_of(sizes, 8, 100, 1), batches_of(sizes, 8, 0, 1));
  // One chunk; none.
  EXPECT_EQ(batches_of({5}, 4, 2, 0), (B{{0, 1}}));
  EXPECT_EQ(batches_of({}, 4, 2, 1), B{});
}

// A spread launch is deep from KVF_XFER_SPREAD_DEEP_KB up to, not
// including, KVF_XFER_SPREAD_DEEP_MAX_MB: at the defaults the MLA DCP
// rank's 4.3 MiB chunk is not, the 8.3-9.8 MiB chunks (GLM-like, gpt-oss,
// fp8 MLA) are, the qwen3-like and MLA chunks (15.8, 17.2 MiB) and larger
// are not; 0 turns either bound off.
TEST(XferTuning, SpreadIsDeepFromItsLowerBoundToBelowItsUpper) {
  kvf_xfer_tuning t;
  kvf_xfer_tuning_from_params(&t);
  const uint64_t kib = 1024, mib = kib * kib;
  EXPECT_FALSE(kvf_spread_is_deep(&t, 4497408)) << "the MLA DCP rank's chunk";
  EXPECT_FALSE(kvf_spread_is_deep(&t, 8192 * kib - 1));
  EXPECT_TRUE(kvf_spread_is_deep(&t, 8192 * kib));
  EXPECT_TRUE(kvf_spread_is_deep(&t, 9 * mib)) << "the gpt-oss-like chunk";
  EXPECT_TRUE(kvf_spread_is_deep(&t, 12 * mib - 1));
  EXPECT_FALSE(kvf_spread_is_deep(&t, 12 * mib));
  EXPECT_FALSE(kvf_spread_is_deep(&t, 17989632)) << "the MLA chunk";
  EXPECT_FALSE(kvf_spread_is_deep(&t, UINT64_MAX));
  t.spread_deep_max_mb = 512;
  EXPECT_TRUE(kvf_spread_is_deep(&t, 17989632)) << "an H100's better bound";
  EXPECT_FALSE(kvf_spread_is_deep(&t, 512 * mib)) << "4096 tokens of Llama 8B";
  t.spread_deep_max_mb = 0;
  EXPECT_TRUE(kvf_spread_is_deep(&t, UINT64_MAX)) << "no upper bound";
  t.spread_deep_kb = 0;
  EXPECT_FALSE(kvf_spread_is_deep(&t, 64 * mib)) << "never deep";
  t.spread_deep_kb = KVF_SPREAD_MAX_KB;
  t.spread_deep_max_mb = KVF_SPREAD_MAX_KB >> 10;
  EXPECT_FALSE(kvf_spread_is_deep(&t, ((uint64_t)KVF_SPREAD_MAX_KB << 10) - 1));
  EXPECT_FALSE(kvf_spread_is_deep(&t, (uint64_t)KVF_SPREAD_MAX_KB << 10)) << "an empty window at the top";
}

// The staging tunables: defaults as documented, out-of-range values refused
// by kvf_xfer_set_tuning with nothing changed and the field named.
TEST(XferTuning, StagingValuesAreCheckedAndDefaulted) {
  kvf_xfer_tuning t;
  kvf_xfer_tuning_from_params(&t);
  EXPECT_EQ(t.staging_mb, 64);
  EXPECT_EQ(t.stage_edge_mb, 16);
  EXPECT_EQ(t.stage_multi_pieces, 2);
  EXPECT_EQ(t.stage_straight_kb, 1024);
  EXPECT_EQ(t.stage_straight_min_run, 16384);
  EXPECT_EQ(t.stage_straight_alone, 0);
  EXPECT_EQ(t.spread_kb, 4096);
  EXPECT_EQ(t.spread_deep_kb, 8192);
  EXPECT_EQ(t.spread_deep_max_mb, 12);
  EXPECT_EQ(t.cache_order, 1);
  EXPECT_EQ(t.overlap, 1);
  EXPECT_EQ(t.device_task_waves, 1);
  EXPECT_EQ(t.batch_first_runs, 8);
  EXPECT_EQ(t.batch_link_gbps, 55);
  EXPECT_EQ(t.batch_staged_cost, 0) << "measured on the context";
  EXPECT_EQ(t.small_stage_growth, 4);
  EXPECT_EQ(t.small_stage_one_piece, 1);
  GeometryPtr g = load_preset("llama-3.1-8b-fa-nhd", 4);
  ASSERT_TRUE(g) << kvf_last_error();
  XferPtr x = make_xfer(g.get(), KVF_DEVICE_HOST);
  ASSERT_TRUE(x);
  kvf_xfer_tuning base;
  kvf_xfer_get_tuning(x.get(), &base);
  auto refused = [&](void (*change)(kvf_xfer_tuning &)) {
    kvf_xfer_tuning bad = base;
    change(bad);
    kvf_status st = kvf_xfer_set_tuning(x.get(), &bad);
    std::string said = kvf_last_error();
    kvf_xfer_tuning now;
    kvf_xfer_get_tuning(x.get(), &now);
    // The one field changed, named as the struct names it.
    const char *field = nullptr;
#define KVF_CHANGED(f) \
  if (bad.f != base.f) field = #f;
    KVF_CHANGED(stage_edge_mb) KVF_CHANGED(staging_mb) KVF_CHANGED(stage_multi_pieces)
    KVF_CHANGED(stage_straight_kb) KVF_CHANGED(stage_straight_min_run) KVF_CHANGED(stage_straight_alone)
    KVF_CHANGED(spread_kb) KVF_CHANGED(spread_deep_kb) KVF_CHANGED(spread_deep_max_mb)
    KVF_CHANGED(cache_order) KVF_CHANGED(overlap) KVF_CHANGED(device_task_waves) KVF_CHANGED(kernel)
    KVF_CHANGED(batch_first_runs) KVF_CHANGED(small_stage_growth) KVF_CHANGED(small_stage_one_piece)
    KVF_CHANGED(batch_link_gbps) KVF_CHANGED(batch_back_to_back_us)
    KVF_CHANGED(batch_host_bound) KVF_CHANGED(batch_staged_cost) KVF_CHANGED(task_bytes)
    KVF_CHANGED(stage_pieces) KVF_CHANGED(pcie_sms) KVF_CHANGED(stage_sms) KVF_CHANGED(stage_growth)
    KVF_CHANGED(param_bytes) KVF_CHANGED(task_waves) KVF_CHANGED(batch_min_run) KVF_CHANGED(batch_max_runs)
    KVF_CHANGED(stage_dma_batch) KVF_CHANGED(small_stage_mb)
#undef KVF_CHANGED
    EXPECT_TRUE(field && said.find(std::string(": ") + field + " ") != std::string::npos) << said;
    return st == KVF_ERR_INVALID_ARGUMENT && memcmp(&now, &base, sizeof now) == 0;
  };
  EXPECT_TRUE(refused([](kvf_xfer_tuning &v) { v.stage_edge_mb = -1; }));
  EXPECT_TRUE(refused([](kvf_xfer_tuning &v) { v.stage_edge_mb = (int64_t)KVF_STAGE_MAX_MB + 1; }));
  EXPECT_TRUE(refused([](kvf_xfer_tuning &v) { v.staging_mb = (int64_t)KVF_STAGE_MAX_MB + 1; }));
  EXPECT_TRUE(refused([](kvf_xfer_tuning &v) { v.stage_multi_pieces = -1; }));
  EXPECT_TRUE(refused([](kvf_xfer_tuning &v) { v.stage_multi_pieces = KVF_STAGE_MAX_PIECES + 1; }));
  EXPECT_TRUE(refused([](kvf_xfer_tuning &v) { v.stage_straight_kb = -1; }));
  EXPECT_TRUE(refused([](kvf_xfer_tuning &v) { v.stage_straight_kb = ((int64_t)KVF_STAGE_MAX_MB << 10) + 1; }));
  EXPECT_TRUE(refused([](kvf_xfer_tuning &v) { v.stage_straight_min_run = -1; }));
  EXPECT_TRUE(refused([](kvf_xfer_tuning &v) { v.stage_straight_min_run = ((int64_t)KVF_STAGE_MAX_MB << 20) + 1; }));
  EXPECT_TRUE(refused([](kvf_xfer_tuning &v) { v.stage_straight_alone = -1; }));
  EXPECT_TRUE(refused([](kvf_xfer_tuning &v) { v.stage_straight_alone = 2; }));
  EXPECT_TRUE(refused([](kvf_xfer_tuning &v) { v.spread_kb = -1; }));
  EXPECT_TRUE(refused([](kvf_xfer_tuning &v) { v.spread_kb = (int64_t)KVF_SPREAD_MAX_KB + 1; }));
  EXPECT_TRUE(refused([](kvf_xfer_tuning &v) { v.spread_deep_kb = -1; }));
  EXPECT_TRUE(refused([](kvf_xfer_tuning &v) { v.spread_deep_kb = (int64_t)KVF_SPREAD_MAX_KB + 1; }));
  EXPECT_TRUE(refused([](kvf_xfer_tuning &v) { v.spread_deep_max_mb = -1; }));
  EXPECT_TRUE(refused([](kvf_xfer_tuning &v) { v.spread_deep_max_mb = ((int64_t)KVF_SPREAD_MAX_KB >> 10) + 1; }));
  EXPECT_TRUE(refused([](kvf_xfer_tuning &v) { v.cache_order = 2; }));
  EXPECT_TRUE(refused([](kvf_xfer_tuning &v) { v.overlap = 2; }));
  EXPECT_TRUE(refused([](kvf_xfer_tuning &v) { v.overlap = -1; }));
  EXPECT_TRUE(refused([](kvf_xfer_tuning &v) { v.device_task_waves = -1; }));
  EXPECT_TRUE(refused([](kvf_xfer_tuning &v) { v.kernel = 3; }));
  EXPECT_TRUE(refused([](kvf_xfer_tuning &v) { v.batch_first_runs = -1; }));
  EXPECT_TRUE(refused([](kvf_xfer_tuning &v) { v.small_stage_growth = 0; }));
  EXPECT_TRUE(refused([](kvf_xfer_tuning &v) { v.small_stage_growth = 17; }));
  EXPECT_TRUE(refused([](kvf_xfer_tuning &v) { v.small_stage_one_piece = -1; }));
  EXPECT_TRUE(refused([](kvf_xfer_tuning &v) { v.small_stage_one_piece = 2; }));
  EXPECT_TRUE(refused([](kvf_xfer_tuning &v) { v.batch_link_gbps = -1; }));
  EXPECT_TRUE(refused([](kvf_xfer_tuning &v) { v.batch_link_gbps = KVF_BATCH_MAX_LINK_GBPS + 1; }));
  EXPECT_TRUE(refused([](kvf_xfer_tuning &v) { v.batch_back_to_back_us = -1; }));
  EXPECT_TRUE(refused([](kvf_xfer_tuning &v) { v.batch_back_to_back_us = KVF_BATCH_MAX_BACK_TO_BACK_US + 1; }));
  EXPECT_TRUE(refused([](kvf_xfer_tuning &v) { v.batch_host_bound = -1; }));
  EXPECT_TRUE(refused([](kvf_xfer_tuning &v) { v.batch_host_bound = 2; }));
  EXPECT_TRUE(refused([](kvf_xfer_tuning &v) { v.batch_staged_cost = -1; }));
  EXPECT_TRUE(refused([](kvf_xfer_tuning &v) { v.batch_staged_cost = (int64_t)KVF_BATCH_MAX_STAGED_COST + 1; }));
  EXPECT_TRUE(refused([](kvf_xfer_tuning &v) { v.task_bytes = 24; })) << "not a multiple of 16";
  EXPECT_TRUE(refused([](kvf_xfer_tuning &v) { v.task_bytes = 65536 + 16; }));
  EXPECT_TRUE(refused([](kvf_xfer_tuning &v) { v.stage_pieces = 0; }));
  EXPECT_TRUE(refused([](kvf_xfer_tuning &v) { v.stage_pieces = KVF_STAGE_MAX_PIECES + 1; }));
  EXPECT_TRUE(refused([](kvf_xfer_tuning &v) { v.task_bytes = 0; }));
  EXPECT_TRUE(refused([](kvf_xfer_tuning &v) { v.pcie_sms = -1; }));
  EXPECT_TRUE(refused([](kvf_xfer_tuning &v) { v.stage_sms = -1; }));
  EXPECT_TRUE(refused([](kvf_xfer_tuning &v) { v.stage_growth = 0; }));
  EXPECT_TRUE(refused([](kvf_xfer_tuning &v) { v.stage_growth = 17; }));
  EXPECT_TRUE(refused([](kvf_xfer_tuning &v) { v.param_bytes = -1; }));
  EXPECT_TRUE(refused([](kvf_xfer_tuning &v) { v.task_waves = -1; }));
  EXPECT_TRUE(refused([](kvf_xfer_tuning &v) { v.batch_min_run = -1; }));
  EXPECT_TRUE(refused([](kvf_xfer_tuning &v) { v.batch_max_runs = -1; }));
  EXPECT_TRUE(refused([](kvf_xfer_tuning &v) { v.stage_dma_batch = -1; }));
  EXPECT_TRUE(refused([](kvf_xfer_tuning &v) { v.small_stage_mb = -1; }));
  EXPECT_TRUE(refused([](kvf_xfer_tuning &v) { v.kernel = -1; }));
  kvf_xfer_tuning ok = base;
  ok.batch_back_to_back_us = 0;
  ok.batch_host_bound = 0;
  ok.batch_staged_cost = (int64_t)KVF_BATCH_MAX_STAGED_COST;
  ok.stage_edge_mb = 0;
  ok.stage_multi_pieces = 0;
  ok.stage_straight_kb = 0;
  ok.stage_straight_min_run = 0;
  ok.stage_straight_alone = 1;
  ok.batch_first_runs = 0;
  ok.small_stage_growth = 16;
  ok.small_stage_one_piece = 0;
  ok.batch_link_gbps = 0; // doubling
  EXPECT_EQ(kvf_xfer_set_tuning(x.get(), &ok), KVF_SUCCESS) << kvf_last_error();
}

uint32_t object_group_of(const kvf_geometry *g, uint32_t group) {
  for (uint32_t og = 0; og < kvf_geometry_num_object_groups(g); og++) {
    kvf_object_group_info info = KVF_OBJECT_GROUP_INFO_INIT;
    EXPECT_EQ(kvf_geometry_object_group(g, og, &info), KVF_SUCCESS);
    for (uint32_t i = 0; i < info.num_groups; i++)
      if (info.groups[i] == group) return og;
  }
  ADD_FAILURE() << "group " << group << " is in no object group";
  return 0;
}

// A gather writing an object only in part (a skipped block) cannot copy the
// whole object back from staging: that object goes the direct way, the
// others stay staged. A scatter stages everything; a NULL object neither.
TEST(XferStagePlan, GatherSendsObjectsItWritesInPartDirect) {
  Prepared s;
  ASSERT_NO_FATAL_FAILURE(setup_chunks("glm-like-hybrid", 3, 0, 7, &s));
  const kvf_geometry *g = s.g();
  uint32_t nog = kvf_geometry_num_object_groups(g), og0 = object_group_of(g, 0);
  ASSERT_EQ(nog, 3u);
  kvf_group_info g0 = KVF_GROUP_INFO_INIT;
  ASSERT_EQ(kvf_geometry_group(g, 0, &g0), KVF_SUCCESS);
  ASSERT_NE(g0.kind, KVF_GROUP_RECURRENT);
  uint64_t per_chunk = chunk_tokens(g) / g0.block_size;
  s.plan.ids[0][per_chunk + 3] = KVF_BLOCK_SKIP;  // chunk 1 of group 0
  // Chunk 2's object of the recurrent group moves nothing once its table is
  // cut short: the request may leave it NULL.
  uint32_t rec = 2, og_rec = object_group_of(g, rec);
  ASSERT_TRUE(is_recurrent(g, rec));
  s.plan.ids[rec].resize(2);
  std::vector<void *> objs = fake_objects(g, s.plan);
  objs[2 * nog + og_rec] = nullptr;
  Req r(s.plan, KVF_FORMAT_CANONICAL, fake_bases(g), objs);
  ASSERT_EQ(kvf_copy_request_check(g, r.get()), KVF_SUCCESS) << kvf_last_error();
  for (int gather : {1, 0}) {
    SCOPED_TRACE(gather ? "gather" : "scatter");
    StagePlan sp;
    ASSERT_EQ(kvf_stage_plan_objects(g, r.get(), gather, &sp.p), KVF_SUCCESS) << kvf_last_error();
    ASSERT_EQ(sp.p.num_objects, 3u * nog);
    for (uint64_t i = 0; i < sp.p.num_objects; i++) {
      bool null_obj = i == 2u * nog + og_rec, partial = i == 1u * nog + og0;
      EXPECT_EQ(sp.p.staged[i] != 0, !null_obj && !(gather && partial)) << "object " << i;
      if (sp.p.staged[i]) {
        EXPECT_EQ(sp.p.span[2 * i], 0u) << "object " << i << ": the request moves its only part";
        EXPECT_EQ(sp.p.span[2 * i + 1], object_bytes(g, r.get(), i)) << "object " << i;
      } else {
        EXPECT_EQ(sp.p.size[i], 0u) << "object " << i;
      }
    }
    EXPECT_EQ(sp.p.any_direct, gather);
    kvf_stage_plan_batches(&sp.p, sp.p.max_chunk, 0, gather);
    ASSERT_NO_FATAL_FAILURE(check_batches(g, r.get(), sp.p, sp.p.max_chunk, 0, gather));
  }
}

// Attention and state in one object (separate_recurrent false): a request
// moving only the state crosses PCIe with the state's bytes alone, at the
// end of the object.
TEST(XferStagePlan, SpanIsThePartsTheRequestMoves) {
  Prepared s;
  ASSERT_NO_FATAL_FAILURE(setup_chunks("qwen3-next-like-hybrid", 2, 0, 9, &s));
  const kvf_geometry *g = s.g();
  ASSERT_EQ(kvf_geometry_num_object_groups(g), 1u);
  kvf_object_group_info og = KVF_OBJECT_GROUP_INFO_INIT;
  ASSERT_EQ(kvf_geometry_object_group(g, 0, &og), KVF_SUCCESS);
  ASSERT_TRUE(og.has_attention && og.has_recurrent);
  uint64_t att = chunk_tokens(g) * og.bytes_per_token;
  for (bool state_only : {false, true}) {
    SCOPED_TRACE(state_only ? "state only" : "attention and state");
    Plan p = s.plan;
    if (state_only)
      for (uint32_t gi = 0; gi < kvf_geometry_num_groups(g); gi++)
        if (!is_recurrent(g, gi)) p.ids[gi].clear();
    Req r(p, KVF_FORMAT_CANONICAL, fake_bases(g), fake_objects(g, p));
    ASSERT_EQ(kvf_copy_request_check(g, r.get()), KVF_SUCCESS) << kvf_last_error();
    for (int gather : {1, 0}) {
      SCOPED_TRACE(gather ? "gather" : "scatter");
      StagePlan sp;
      ASSERT_EQ(kvf_stage_plan_objects(g, r.get(), gather, &sp.p), KVF_SUCCESS) << kvf_last_error();
      for (uint64_t i = 0; i < sp.p.num_objects; i++) {
        ASSERT_TRUE(sp.p.staged[i]) << "object " << i;
        EXPECT_EQ(sp.p.span[2 * i], state_only ? att : 0u) << "object " << i;
        EXPECT_EQ(sp.p.span[2 * i + 1], att + og.recurrent_bytes) << "object " << i;
        EXPECT_EQ(object_bytes(g, r.get(), i), att + og.recurrent_bytes) << "object " << i;
      }
    }
  }
}

// ---- pieces, task sizes and blocks (kernels/plan.h) ------------------------------
//
// What the staged route's pieces and the copy-engine batch route build on,
// checked on the CPU: a request's moving segments split into pieces of whole
// views, each piece's blob (with tasks cut small) copied by the CPU path
// must together give the reference's bytes exactly, and a gather piece's
// copies (its runs) cover exactly the bytes its tasks write; the blocks a
// blob lists, copied one contiguous run each, give the reference's bytes
// too wherever every entry is linear.

struct PlanHolder {
  kvf_plan p{};

  PlanHolder() = default;
  PlanHolder(const PlanHolder &) = delete;
  PlanHolder &operator=(const PlanHolder &) = delete;
  ~PlanHolder() { kvf_plan_free(&p); }
};

// The blob tests' common start: a preset's standard request over inputs for
// `dir` (seed + 1 draws them), planned for `format` (a canonical request
// passes a padded table, a native one a table cut to the range).
struct PresetRequest {
  Prepared s;
  PlanHolder plan;
  Data in;
  std::unique_ptr<Req> r;
};

void prepare_request(const std::string &preset, uint64_t seed, PresetRequest *out,
                     kvf_object_format format = KVF_FORMAT_CANONICAL, Dir dir = Dir::Gather) {
  ASSERT_NO_FATAL_FAILURE(setup_standard(preset, format == KVF_FORMAT_CANONICAL, seed, &out->s));
  ASSERT_EQ(kvf_plan_build(out->s.g(), format, &out->plan.p), KVF_SUCCESS) << kvf_last_error();
  std::mt19937_64 rng(seed + 1);
  out->in = make_inputs(out->s.g(), out->s.plan, dir, 0, rng);
  out->r = std::make_unique<Req>(out->s.plan, format, payloads(out->in.cache), payloads(out->in.objs));
}

// A chunked request (setup_chunks) with its canonical plan, on fake region
// bases and objects: for the plan-level cases that never touch memory.
struct PlannedRequest {
  Prepared s;
  PlanHolder plan;
  std::unique_ptr<Req> r;
  const kvf_geometry *g() const { return s.g(); }
};

void plan_chunks(const std::string &preset, uint64_t chunks, uint64_t extra, uint64_t seed, PlannedRequest *out) {
  ASSERT_NO_FATAL_FAILURE(setup_chunks(preset, chunks, extra, seed, &out->s));
  ASSERT_EQ(kvf_plan_build(out->g(), KVF_FORMAT_CANONICAL, &out->plan.p), KVF_SUCCESS) << kvf_last_error();
  out->r = std::make_unique<Req>(out->s.plan, KVF_FORMAT_CANONICAL, fake_bases(out->g()),
                                 fake_objects(out->g(), out->s.plan));
}

// Runs every task of a blob on the CPU.
void run_blob(const std::vector<uint8_t> &blob) {
  const auto *h = reinterpret_cast<const kvf_blob_header *>(blob.data());
  kvf_blob_run_cpu(blob.data(), 0, h->total_tasks);
}

std::vector<uint8_t> build_blob(const kvf_geometry *g, const kvf_plan &plan, const kvf_copy_request *r, bool gather,
                                const kvf_blob_opts *o) {
  std::vector<uint8_t> b(kvf_blob_size(g, &plan, r, o) + 64);
  // 16-byte alignment: vector storage from new is at least that.
  kvf_blob_build(g, &plan, r, gather ? 1 : 0, o, b.data());
  return b;
}

// The blocks of a blob by the plan's formulas (kernels/plan.h), each block
// on its own with plain divisions: cache = cache_base (base[region] +
// src_offset) + id*src_block; object = objects[k] + n_k*dst_per_token + dst_const +
// bi*dst_block, k the chunk holding the block's first token, n_k that
// chunk's local tokens in the request, bi the block's place in it; a
// recurrent block is chunk lb - chunk_begin's state. Skipped ids, blocks
// past the request's end and objects left out move nothing.
std::vector<kvf_blob_block> blocks_by_formula(const std::vector<uint8_t> &blob) {
  const auto *h = reinterpret_cast<const kvf_blob_header *>(blob.data());
  const auto *e = reinterpret_cast<const kvf_blob_entry *>(blob.data() + h->off_entries);
  const auto *ids = reinterpret_cast<const uint32_t *>(blob.data() + h->off_ids);
  const auto *objects = reinterpret_cast<const uint64_t *>(blob.data() + h->off_objects);
  std::vector<kvf_blob_block> out;
  for (uint32_t i = 0; i < h->num_entries; i++) {
    const kvf_blob_shape &s = *kvf_blob_shape_of(blob.data(), &e[i]);
    uint64_t end = i + 1 < h->num_entries ? e[i + 1].first_task : h->total_tasks;
    for (uint64_t j = 0; j < (end - e[i].first_task) / e[i].slices; j++) {
      uint32_t id = ids[e[i].ids_offset + j];
      uint64_t lb = e[i].lb_rel + j + (s.recurrent ? h->chunk_begin : h->lt_begin / s.tokens), k, units, off;
      if (s.recurrent) {
        k = lb - h->chunk_begin;
        units = s.units_per_run;
        off = h->chunk_local * e[i].dst_per_token + e[i].dst_const;
      } else {
        uint64_t t0 = lb * s.tokens, rel = t0 - h->lt_begin;
        k = rel / h->chunk_local;
        uint64_t nk = std::min<uint64_t>(h->lt_end - (h->lt_begin + k * h->chunk_local), h->chunk_local);
        units = std::min<uint64_t>(h->lt_end - t0, s.tokens) * s.units_per_token;
        off = nk * e[i].dst_per_token + e[i].dst_const + (rel - k * h->chunk_local) / s.tokens * s.dst_block;
      }
      uint64_t oi = k * h->num_object_groups + s.object_group;
      if (id == KVF_BLOCK_SKIP || id >= h->num_blocks_max || units == 0 || objects[oi] == 0) continue;
      kvf_blob_block b;
      b.entry = i;
      b.object_index = oi;
      b.cache = reinterpret_cast<char *>(e[i].cache_base + (uint64_t)id * s.src_block);
      b.object = reinterpret_cast<char *>(objects[oi] + off);
      b.units = units;
      out.push_back(b);
    }
  }
  return out;
}

// kvf_blob_blocks against blocks_by_formula, field by field.
void expect_blocks_by_formula(const std::vector<uint8_t> &blob) {
  uint64_t n = kvf_blob_blocks(blob.data(), nullptr, 0);
  std::vector<kvf_blob_block> got(n);
  ASSERT_EQ(kvf_blob_blocks(blob.data(), got.data(), n), n);
  std::vector<kvf_blob_block> want = blocks_by_formula(blob);
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); i++) {
    SCOPED_TRACE("block " + std::to_string(i));
    ASSERT_EQ(got[i].entry, want[i].entry);
    ASSERT_EQ(got[i].object_index, want[i].object_index);
    ASSERT_EQ((const void *)got[i].cache, (const void *)want[i].cache);
    ASSERT_EQ((const void *)got[i].object, (const void *)want[i].object);
    ASSERT_EQ(got[i].units, want[i].units);
  }
}

// kvf_stage_blob_runs against the runs of its blocks one by one: each
// block's object extent (kvf_blob_object_extent of its units), sorted by
// (object, offset) and merged where they touch or overlap; holes where a
// merged run holds bytes no block moves.
void expect_runs_by_blocks(const std::vector<uint8_t> &blob, const std::vector<uint64_t> &base) {
  struct Ext {
    uint64_t object, lo, hi, touched;
  };
  std::vector<Ext> ex;
  for (const kvf_blob_block &b : blocks_by_formula(blob)) {
    const kvf_blob_shape *sh =
        kvf_blob_shape_of(blob.data(), &kvf_blob_entries(blob.data())[b.entry]);
    uint64_t lo = reinterpret_cast<uint64_t>(b.object) - base[b.object_index];
    ex.push_back({b.object_index, lo, lo + kvf_blob_object_extent(sh, b.units), b.units * sh->vec});
  }
  std::stable_sort(ex.begin(), ex.end(),
                   [](const Ext &x, const Ext &y) { return x.object != y.object ? x.object < y.object : x.lo < y.lo; });
  std::vector<kvf_stage_run> want;
  bool want_holes = false;
  for (size_t i = 0; i < ex.size();) {
    Ext cur = ex[i++];
    while (i < ex.size() && ex[i].object == cur.object && ex[i].lo <= cur.hi) {
      cur.hi = std::max(cur.hi, ex[i].hi);
      cur.touched += ex[i].touched;
      i++;
    }
    want_holes = want_holes || cur.touched < cur.hi - cur.lo;
    want.push_back({cur.object, cur.lo, cur.hi - cur.lo});
  }
  kvf_stage_run *runs = nullptr;
  uint64_t n = 0;
  int holes = 0;
  ASSERT_EQ(kvf_stage_blob_runs(blob.data(), base.data(), &runs, &n, &holes), KVF_SUCCESS);
  std::vector<kvf_stage_run> got(runs, runs + n);
  free(runs);
  EXPECT_EQ(holes != 0, want_holes);
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); i++) {
    SCOPED_TRACE("run " + std::to_string(i));
    EXPECT_EQ(got[i].object, want[i].object);
    EXPECT_EQ(got[i].offset, want[i].offset);
    EXPECT_EQ(got[i].bytes, want[i].bytes);
  }
}

// A request that ends inside a block (every preset's first chunk and 5
// tokens of the next), with skipped ids: the blocks and the object runs of
// its pieces' blobs agree with the blocks taken one at a time, the short
// last block included.
TEST(XferBlob, RunsOfARequestEndingInsideABlockMatchItsBlocks) {
  for (const std::string &preset : preset_names()) {
    SCOPED_TRACE(preset);
    Prepared s;
    ASSERT_NO_FATAL_FAILURE(setup_chunks(preset, 1, 5, 41, &s));
    for (size_t gi = 0; gi < s.plan.ids.size(); gi++)
      for (size_t i = 1; i < s.plan.ids[gi].size(); i += 7) s.plan.ids[gi][i] = KVF_BLOCK_SKIP;
    const kvf_geometry *g = s.g();
    std::mt19937_64 rng(42);
    Data in = make_inputs(g, s.plan, Dir::Gather, 0, rng);
    PlanHolder plan;
    ASSERT_EQ(kvf_plan_build(g, KVF_FORMAT_CANONICAL, &plan.p), KVF_SUCCESS) << kvf_last_error();
    Req r(s.plan, KVF_FORMAT_CANONICAL, payloads(in.cache), payloads(in.objs));
    std::vector<uint64_t> base;
    for (void *o : r.objects) base.push_back(reinterpret_cast<uint64_t>(o));
    const uint32_t ns = plan.p.num_segments;
    std::vector<unsigned char> masks((size_t)2 * ns);
    for (int gather : {1, 0}) {
      SCOPED_TRACE(gather ? "gather" : "scatter");
      uint32_t made = kvf_stage_piece_masks(g, &plan.p, r.get(), gather, 2, masks.data());
      for (uint32_t p = 0; p < made; p++) {
        kvf_blob_opts o = {512, made > 1 ? masks.data() + (size_t)p * ns : nullptr, 0};
        std::vector<uint8_t> blob = build_blob(g, plan.p, r.get(), gather, &o);
        ASSERT_NO_FATAL_FAILURE(expect_blocks_by_formula(blob));
        ASSERT_NO_FATAL_FAILURE(expect_runs_by_blocks(blob, base));
      }
    }
  }
}

// The memo of built blobs (kvf_blob_build_memo) writes what kvf_blob_build
// writes, byte for byte, and returns its tasks, on every preset in both
// formats. Hits: the same request again; other ids with the same blocks
// skipped; an object moved keeping its alignment; the next chunk of the
// sequence where every group is full attention. Misses: a block skipped, the
// last block skipped, an object's alignment lowered, another region base,
// another segment mask, slice or direction, a table a block shorter at its
// start, and one as long ending a block before the request. More shapes
// than slots evict. A random walk of 300 requests (token
// ranges, ids, skips, tables' starts, objects, bases, masks, options) never
// differs from the build.
TEST(XferBlob, MemoBuildsWhatTheBuildBuilds) {
  uint64_t seed = 900;
  for (const std::string &preset : preset_names())
    for (kvf_object_format format : {KVF_FORMAT_CANONICAL, KVF_FORMAT_NATIVE}) {
      SCOPED_TRACE(preset + (format == KVF_FORMAT_NATIVE ? ", native" : ", canonical"));
      Prepared s;
      ASSERT_NO_FATAL_FAILURE(setup_chunks(preset, 3, 0, seed++, &s));
      const kvf_geometry *g = s.g();
      PlanHolder plan;
      ASSERT_EQ(kvf_plan_build(g, format, &plan.p), KVF_SUCCESS) << kvf_last_error();
      Req q(s.plan, format, fake_bases(g), fake_objects(g, s.plan));
      const uint64_t chunk = chunk_tokens(g), nog = kvf_geometry_num_object_groups(g);
      const size_t ns = plan.p.num_segments;
      bool all_full = true;
      for (uint32_t gi = 0; gi < kvf_geometry_num_groups(g); gi++) {
        kvf_group_info info = KVF_GROUP_INFO_INIT;
        kvf_geometry_group(g, gi, &info);
        all_full = all_full && info.kind == KVF_GROUP_FULL;
      }
      kvf_memo memo{};
      uint64_t hits = 0, misses = 0;
      // Tokens [from, to) of the three chunks, with their objects.
      auto request = [&](uint64_t from, uint64_t to) {
        kvf_copy_request r = *q.get();
        r.token_begin = q.get()->token_begin + from;
        r.token_end = q.get()->token_begin + to;
        r.objects = q.objects.data() + from / chunk * nog;
        return r;
      };
      // want: 1 a hit, 0 a miss, -1 either.
      auto expect_build = [&](const kvf_copy_request &r, int gather, const kvf_blob_opts *o, int want,
                              const std::string &what) {
        SCOPED_TRACE(what);
        ASSERT_EQ(kvf_copy_request_check(g, &r), KVF_SUCCESS) << kvf_last_error();
        const size_t size = kvf_blob_size(g, &plan.p, &r, o) + 64;
        std::vector<uint8_t> built(size, 0xA5), got(size, 0xA5);
        const uint64_t tasks = kvf_blob_build(g, &plan.p, &r, gather, o, built.data());
        EXPECT_EQ(kvf_blob_build_memo(&memo, g, &plan.p, &r, gather, o, got.data()), tasks);
        EXPECT_TRUE(got == built) << "the bytes written differ";
        if (want >= 0) {
          EXPECT_EQ(memo.hits, hits + (uint64_t)want);
          EXPECT_EQ(memo.misses, misses + (uint64_t)(1 - want));
        }
        hits = memo.hits;
        misses = memo.misses;
      };
      const kvf_copy_request first = request(0, chunk);
      ASSERT_NO_FATAL_FAILURE(expect_build(first, 1, nullptr, 0, "first"));
      ASSERT_NO_FATAL_FAILURE(expect_build(first, 1, nullptr, 1, "again"));
      ASSERT_NO_FATAL_FAILURE(expect_build(first, 0, nullptr, 0, "the other direction"));
      {
        // Other ids of the same blocks: each group's reversed.
        Req other(s.plan, format, fake_bases(g), fake_objects(g, s.plan));
        for (auto &ids : other.ids) std::reverse(ids.begin(), ids.end());
        other.rebind();
        kvf_copy_request r = first;
        r.groups = other.groups.data();
        ASSERT_NO_FATAL_FAILURE(expect_build(r, 1, nullptr, 1, "other ids"));
        // The first block the request moves skipped, then (it back) each group's last.
        uint64_t b0 = 0, b1 = 0;
        kvf_blob_group_window(g, &r, 0, &b0, &b1);
        ASSERT_LT(b0, b1);
        uint32_t &id = other.ids[0][b0 - other.groups[0].first_block];
        const uint32_t kept = id;
        id = KVF_BLOCK_SKIP;
        ASSERT_NO_FATAL_FAILURE(expect_build(r, 1, nullptr, 0, "a block skipped"));
        id = kept;
        ASSERT_NO_FATAL_FAILURE(expect_build(r, 1, nullptr, 1, "the block back"));
        const int one_block = b1 - b0 == 1; // its last is the first, skipped above: a hit
        for (uint32_t gi = 0; gi < other.ids.size(); gi++) {
          kvf_blob_group_window(g, &r, gi, &b0, &b1);
          if (b0 != b1) other.ids[gi][b1 - 1 - other.groups[gi].first_block] = KVF_BLOCK_SKIP;
        }
        ASSERT_NO_FATAL_FAILURE(expect_build(r, 1, nullptr, one_block ? -1 : 0, "the last blocks skipped"));
      }
      {
        std::vector<void *> objects(q.objects);
        kvf_copy_request r = first;
        r.objects = objects.data();
        objects[0] = static_cast<char *>(objects[0]) + 4096;
        ASSERT_NO_FATAL_FAILURE(expect_build(r, 1, nullptr, 1, "an object moved, as aligned"));
        objects[0] = static_cast<char *>(objects[0]) + 2;
        ASSERT_NO_FATAL_FAILURE(expect_build(r, 1, nullptr, 0, "an object less aligned"));
      }
      {
        std::vector<void *> bases(q.bases);
        bases.back() = static_cast<char *>(bases.back()) + 4096;
        kvf_copy_request r = first;
        r.region_bases = bases.data();
        ASSERT_NO_FATAL_FAILURE(expect_build(r, 1, nullptr, 0, "another region base"));
      }
      std::vector<unsigned char> half(ns, 0);
      for (size_t i = 0; i < ns; i += 2) half[i] = 1;
      kvf_blob_opts o_half = {0, half.data(), 0}, o_slice = {1024, nullptr, 0};
      ASSERT_NO_FATAL_FAILURE(expect_build(first, 1, &o_half, 0, "a mask"));
      ASSERT_NO_FATAL_FAILURE(expect_build(first, 1, &o_half, 1, "the mask again"));
      half[0] ^= 1;
      ASSERT_NO_FATAL_FAILURE(expect_build(first, 1, &o_half, 0, "another mask"));
      ASSERT_NO_FATAL_FAILURE(expect_build(first, 1, &o_slice, 0, "another slice"));
      if (all_full) {
        ASSERT_NO_FATAL_FAILURE(expect_build(request(chunk, 2 * chunk), 1, nullptr, 1, "the next chunk"));
      }
      {
        // The first group's table a block shorter at its start: as many
        // tokens, a block fewer.
        std::vector<kvf_group_blocks> groups(q.groups);
        groups[0].first_block += 1;
        groups[0].block_ids += 1;
        groups[0].count -= 1;
        kvf_copy_request r = first;
        r.groups = groups.data();
        ASSERT_NO_FATAL_FAILURE(expect_build(r, 1, nullptr, 0, "a table a block shorter"));
        // As many blocks again, from the request's first: the table ending a
        // block before the request does (the entries count from another block).
        uint64_t b0 = 0, b1 = 0;
        kvf_blob_group_window(g, &first, 0, &b0, &b1);
        groups[0] = q.groups[0];
        groups[0].count = (uint32_t)(b1 - 1 - groups[0].first_block);
        if (b1 - b0 > 1) {
          ASSERT_NO_FATAL_FAILURE(expect_build(r, 1, nullptr, 0, "a table ending a block early"));
        }
      }
      // More shapes than slots: the first is gone.
      for (uint32_t k = 0; k < KVF_MEMO_SLOTS; k++) {
        kvf_blob_opts o = {(uint32_t)(2048 + 16 * k), nullptr, 0};
        ASSERT_NO_FATAL_FAILURE(expect_build(first, 1, &o, 0, "eviction"));
      }
      ASSERT_NO_FATAL_FAILURE(expect_build(first, 1, nullptr, 0, "evicted"));
      // A random walk.
      std::mt19937_64 rng(seed);
      Req walk(s.plan, format, fake_bases(g), fake_objects(g, s.plan));
      std::vector<unsigned char> mask(ns, 1);
      const uint64_t hits_before = memo.hits;
      for (int step = 0; step < 300; step++) {
        // A request begins on a chunk; half of them are one chunk, as engines move them.
        uint64_t from = rng() % 3 * chunk, to = rng() % 2 ? from + chunk : from + 1 + rng() % (3 * chunk - from);
        if (format == KVF_FORMAT_NATIVE) to = (to + chunk - 1) / chunk * chunk; // native objects hold whole blocks
        switch (rng() % 7) {
        case 0: { // an id skipped, or one back
          auto &ids = walk.ids[rng() % walk.ids.size()];
          if (!ids.empty()) {
            uint32_t &id = ids[rng() % ids.size()];
            id = id == KVF_BLOCK_SKIP ? (uint32_t)(rng() % 4) : KVF_BLOCK_SKIP;
          }
          break;
        }
        case 1: { // two ids swapped
          auto &ids = walk.ids[rng() % walk.ids.size()];
          if (ids.size() > 1) std::swap(ids[rng() % ids.size()], ids[rng() % ids.size()]);
          break;
        }
        case 2: { // an object moved by 0, 2, 16 or 4096 bytes
          void *&o = walk.objects[rng() % walk.objects.size()];
          o = static_cast<char *>(o) + (uint64_t[]){0, 2, 16, 4096}[rng() % 4];
          break;
        }
        case 3: walk.bases[rng() % walk.bases.size()] = fake_bases(g)[0]; break;
        case 4: mask[rng() % ns] ^= 1; break;
        case 5: { // a table starting up to two blocks later, or as built
          const uint32_t gi = (uint32_t)(rng() % walk.ids.size()), later = (uint32_t)(rng() % 3);
          walk.groups[gi] = {nullptr, s.plan.first_block[gi], (uint32_t)walk.ids[gi].size()};
          if (walk.groups[gi].count > later) {
            walk.groups[gi].first_block += later;
            walk.groups[gi].count -= later;
          }
          break;
        }
        default: break;
        }
        // rebind, keeping each table's start
        for (size_t gi = 0; gi < walk.ids.size(); gi++)
          walk.groups[gi].block_ids = walk.ids[gi].empty() ? nullptr
                                                           : walk.ids[gi].data() + (walk.groups[gi].first_block -
                                                                                     s.plan.first_block[gi]);
        walk.req.region_bases = walk.bases.data();
        walk.req.groups = walk.groups.data();
        walk.req.objects = walk.objects.data();
        kvf_copy_request r = *walk.get();
        r.token_begin = walk.get()->token_begin + from;
        r.token_end = walk.get()->token_begin + to;
        r.objects = walk.objects.data() + from / chunk * nog;
        kvf_blob_opts o = {rng() % 2 ? 0u : 1024u, rng() % 2 ? mask.data() : nullptr, rng() % 3 ? 0u : 512u};
        ASSERT_NO_FATAL_FAILURE(
            expect_build(r, (int)(rng() % 2), &o, -1, "random step " + std::to_string(step)));
      }
      EXPECT_GT(memo.hits, hits_before);
      kvf_memo_free(&memo);
    }
}

// A geometry of recurrent groups only may have a chunk shorter than its DCP
// world (validation ties chunk_tokens to block_size x world only for
// attention groups), so a rank holds no token of a chunk (chunk_local 0).
// The blob memo answers such a request as the build does, and twice: it must
// not divide by the chunk's local tokens (it did, and the process died).
// The slot store under the memos: answers found by their keys' bytes, the
// oldest evicted first, keyless answers never found, taken values owned
// (ASan reports a leak or a double free otherwise).
TEST(XferMemo, KeepsFindsEvictsAndTakes) {
  kvf_memo memo{};
  auto key_of = [](uint64_t k) { return std::vector<unsigned char>(reinterpret_cast<unsigned char *>(&k),
                                                                  reinterpret_cast<unsigned char *>(&k) + sizeof k); };
  for (uint64_t k = 0; k < KVF_MEMO_SLOTS; k++) {
    const std::vector<unsigned char> key = key_of(k);
    const uint64_t value = 100 + k;
    if (k % 2) {
      auto *taken = static_cast<uint64_t *>(malloc(sizeof value));
      ASSERT_NE(taken, nullptr);
      *taken = value;
      ASSERT_NE(kvf_memo_keep_taking(&memo, key.data(), key.size(), taken, sizeof value, k, 2 * k), nullptr);
    } else {
      ASSERT_NE(kvf_memo_keep(&memo, key.data(), key.size(), &value, sizeof value, k, 2 * k), nullptr);
    }
  }
  for (uint64_t k = 0; k < KVF_MEMO_SLOTS; k++) {
    const std::vector<unsigned char> key = key_of(k);
    const kvf_memo_slot *s = kvf_memo_find(&memo, key.data(), key.size());
    ASSERT_NE(s, nullptr) << k;
    ASSERT_EQ(s->value_size, sizeof(uint64_t));
    uint64_t got = 0;
    memcpy(&got, s->value, sizeof got);
    EXPECT_EQ(got, 100 + k);
    EXPECT_EQ(s->result[0], k);
    EXPECT_EQ(s->result[1], 2 * k);
  }
  EXPECT_EQ(memo.hits, uint64_t{KVF_MEMO_SLOTS});
  // One more evicts the oldest (key 0) and no other; an empty answer taken
  // (no buffer) and a keyless one then take the next two slots.
  const std::vector<unsigned char> newest = key_of(1000), none = key_of(1001);
  const uint64_t v = 7;
  ASSERT_NE(kvf_memo_keep(&memo, newest.data(), newest.size(), &v, sizeof v, 0, 0), nullptr);
  EXPECT_EQ(kvf_memo_find(&memo, key_of(0).data(), sizeof(uint64_t)), nullptr);
  EXPECT_NE(kvf_memo_find(&memo, key_of(2).data(), sizeof(uint64_t)), nullptr);
  const kvf_memo_slot *empty = kvf_memo_keep_taking(&memo, none.data(), none.size(), nullptr, 0, 5, 0);
  ASSERT_NE(empty, nullptr);
  EXPECT_EQ(kvf_memo_find(&memo, none.data(), none.size()), empty);
  EXPECT_EQ(empty->value_size, 0u);
  ASSERT_NE(kvf_memo_keep(&memo, nullptr, 0, &v, sizeof v, 0, 0), nullptr);
  EXPECT_EQ(kvf_memo_find(&memo, key_of(2).data(), sizeof(uint64_t)), nullptr);  // evicted by the keyless one
  // The slot that held no buffer takes a copied answer on its next turn.
  for (uint64_t k = 0; k < KVF_MEMO_SLOTS; k++) {
    const std::vector<unsigned char> key = key_of(2000 + k);
    ASSERT_NE(kvf_memo_keep(&memo, key.data(), key.size(), &v, sizeof v, 0, 0), nullptr);
  }
  for (const kvf_memo_slot &s : memo.slots) EXPECT_NE(s.value, nullptr);
  kvf_memo_free(&memo);
}

// Recurrent groups only, a chunk of one token on a DCP world of two: a chunk
// holds no local token of any rank (chunk_local 0), which nothing may divide by.
const char kStatesOnlyDcpJson[] = R"({"format": "kvferry-geometry", "version": 1, "name": "states-only-dcp",
    "regions": [{"name": "state", "count": 1, "size": 0}],
    "groups": [{"name": "linear", "kind": "recurrent", "num_blocks": 8,
                "layers": [{"count": 1, "name": "layer", "region": "state", "offset": 0, "elem_bytes": 2,
                            "block_stride": 4096, "states": [{"offset": 0, "bytes": 4096}]}]}],
    "objects": {"chunk_tokens": 1, "format": "canonical"}, "dcp": {"world": 2, "rank": 1}})";

// The two chunks [0, 2) of kStatesOnlyDcpJson: blocks 3 and 5.
Plan states_only_dcp_plan() {
  Plan p;
  p.token_begin = 0;
  p.token_end = 2;
  p.ids = {{3, 5}};
  p.first_block = {0};
  return p;
}

GeometryPtr load_states_only_dcp() {
  kvf_geometry *raw = nullptr;
  kvf_geometry_error err;
  EXPECT_EQ(kvf_geometry_load_buffer(kStatesOnlyDcpJson, sizeof kStatesOnlyDcpJson - 1, nullptr, &raw, &err),
            KVF_SUCCESS)
      << kvf_last_error();
  return GeometryPtr(raw);
}

TEST(XferHost, StatesOnlyChunkShorterThanItsDcpWorldMatchesTheReference) {
  GeometryPtr g = load_states_only_dcp();
  ASSERT_TRUE(g);
  for (kvf_object_format f : {KVF_FORMAT_CANONICAL, KVF_FORMAT_NATIVE})
    for (Dir d : {Dir::Gather, Dir::Scatter})
      for (uint32_t threads : {1u, 4u}) {
        SCOPED_TRACE(std::string(format_name(f)) + "/" + dir_name(d) + "/" + std::to_string(threads) + " threads");
        run_host_case(g.get(), states_only_dcp_plan(), f, d, threads, 0, 71 + threads);
      }
}

TEST(XferBlob, MemoTakesAChunkShorterThanItsDcpWorld) {
  GeometryPtr geo = load_states_only_dcp();
  ASSERT_TRUE(geo);
  kvf_geometry *raw = geo.get();
  PlanHolder plan;
  ASSERT_EQ(kvf_plan_build(raw, KVF_FORMAT_CANONICAL, &plan.p), KVF_SUCCESS) << kvf_last_error();
  std::vector<uint32_t> ids{3, 5};
  kvf_group_blocks table{ids.data(), 0, 2};
  std::vector<void *> bases{reinterpret_cast<void *>(uintptr_t{1} << 40)};
  std::vector<void *> objects{reinterpret_cast<void *>(uintptr_t{1} << 44), reinterpret_cast<void *>(uintptr_t{1} << 45)};
  kvf_copy_request r = KVF_COPY_REQUEST_INIT;
  r.token_begin = 0;
  r.token_end = 2;
  r.format = KVF_FORMAT_CANONICAL;
  r.region_bases = bases.data();
  r.groups = &table;
  r.objects = objects.data();
  ASSERT_EQ(kvf_copy_request_check(raw, &r), KVF_SUCCESS) << kvf_last_error();
  const size_t size = kvf_blob_size(raw, &plan.p, &r, nullptr) + 64;
  std::vector<uint8_t> built(size, 0xA5);
  const uint64_t tasks = kvf_blob_build(raw, &plan.p, &r, 1, nullptr, built.data());
  ASSERT_GT(tasks, 0u);
  kvf_memo memo{};
  for (int time = 0; time < 2; time++) {
    std::vector<uint8_t> got(size, 0xA5);
    EXPECT_EQ(kvf_blob_build_memo(&memo, raw, &plan.p, &r, 1, nullptr, got.data()), tasks);
    EXPECT_TRUE(got == built) << "call " << time;
  }
  EXPECT_EQ(memo.hits, 1u);
  kvf_memo_free(&memo);
}

class XferPieces : public ::testing::TestWithParam<HostCase> {};

TEST_P(XferPieces, PiecesOfSmallTasksMatchTheReference) {
  const HostCase &c = GetParam();
  const bool gather = c.dir == Dir::Gather;
  uint64_t seed = seed_of(c.preset, 555 + (uint64_t)c.format * 2 + (uint64_t)c.dir);
  Prepared s;
  ASSERT_NO_FATAL_FAILURE(setup_standard(c.preset, c.format == KVF_FORMAT_CANONICAL, seed, &s));
  const kvf_geometry *g = s.g();
  std::mt19937_64 rng(seed + 1);
  Data in = make_inputs(g, s.plan, c.dir, 0, rng), want = clone(in);
  ASSERT_EQ(reference(g, s.plan, c.format, c.dir, want), KVF_SUCCESS) << kvf_last_error();
  PlanHolder plan;
  ASSERT_EQ(kvf_plan_build(g, c.format, &plan.p), KVF_SUCCESS) << kvf_last_error();
  const uint32_t ns = plan.p.num_segments;
  for (uint32_t pieces : {1u, 2u, 4u, 16u}) {
    SCOPED_TRACE("pieces " + std::to_string(pieces));
    Data got = clone(in);
    Req r(s.plan, c.format, payloads(got.cache), payloads(got.objs));
    std::vector<unsigned char> masks((size_t)pieces * ns);
    uint32_t made = kvf_stage_piece_masks(g, &plan.p, r.get(), gather, pieces, masks.data());
    ASSERT_GE(made, 1u);
    ASSERT_LE(made, pieces);
    // Every segment of a moving group in exactly one piece, a view's
    // segments in the same one.
    std::vector<int> owner(ns, -1);
    for (uint32_t p = 0; p < made; p++)
      for (uint32_t i = 0; i < ns; i++)
        if (masks[(size_t)p * ns + i]) {
          EXPECT_EQ(owner[i], -1) << "segment " << i << " in two pieces";
          owner[i] = (int)p;
        }
    for (uint32_t i = 1; i < ns; i++)
      if (plan.p.segments[i].view == plan.p.segments[i - 1].view) {
        EXPECT_EQ(owner[i], owner[i - 1]) << "segments " << i - 1 << " and " << i << " of one view split";
      }
    for (uint32_t p = 0; p < made; p++) {
      bool any = false;
      for (uint32_t i = 0; i < ns; i++) any = any || masks[(size_t)p * ns + i];
      EXPECT_TRUE(any) << "piece " << p << " is empty";
    }
    // The pieces' blobs, tasks cut to 512 bytes, copied on the CPU.
    uint64_t payload = 0;
    std::vector<uint64_t> base;
    for (void *o : r.objects) base.push_back(reinterpret_cast<uint64_t>(o));
    for (uint32_t p = 0; p < made; p++) {
      kvf_blob_opts o = {512, made > 1 ? masks.data() + (size_t)p * ns : nullptr, 0};
      std::vector<uint8_t> blob = build_blob(g, plan.p, r.get(), gather, &o);
      const auto *h = reinterpret_cast<const kvf_blob_header *>(blob.data());
      payload += h->payload_bytes;
      ASSERT_NO_FATAL_FAILURE(expect_blocks_by_formula(blob));
      ASSERT_NO_FATAL_FAILURE(expect_runs_by_blocks(blob, base));
      {
        // The same piece with every other object left out (a staged call's
        // batches and its direct launch split the objects so).
        std::vector<void *> half(r.objects.begin(), r.objects.end());
        for (size_t i = 1; i < half.size(); i += 2) half[i] = nullptr;
        kvf_copy_request rh = *r.get();
        rh.objects = half.data();
        SCOPED_TRACE("every other object left out");
        std::vector<uint8_t> hb = build_blob(g, plan.p, &rh, gather, &o);
        ASSERT_NO_FATAL_FAILURE(expect_blocks_by_formula(hb));
        ASSERT_NO_FATAL_FAILURE(expect_runs_by_blocks(hb, base));
      }
      run_blob(blob);
      // A piece's copies: when it has no holes they hold exactly the bytes
      // its tasks move.
      kvf_stage_run *runs = nullptr;
      uint64_t n = 0, bytes = 0;
      int holes = 0;
      ASSERT_EQ(kvf_stage_blob_runs(blob.data(), base.data(), &runs, &n, &holes), KVF_SUCCESS);
      for (uint64_t i = 0; i < n; i++) {
        bytes += runs[i].bytes;
        if (i > 0 && runs[i].object == runs[i - 1].object) {
          EXPECT_GT(runs[i].offset, runs[i - 1].offset + runs[i - 1].bytes) << "runs are merged where they touch";
        }
        EXPECT_LE(runs[i].offset + runs[i].bytes, r.objects[runs[i].object] ? got.objs[runs[i].object].size : 0)
            << "a run past its object";
      }
      free(runs);
      if (!holes) {
        EXPECT_EQ(bytes, h->payload_bytes) << "piece " << p << ": its runs must hold exactly the bytes it moves";
      } else {
        EXPECT_GT(bytes, h->payload_bytes);
      }
    }
    EXPECT_EQ(payload, plan_payload(g, s.plan));
    EXPECT_EQ(diff("cache region", got.cache, want.cache), "");
    EXPECT_EQ(diff("object", got.objs, want.objs), "");
  }
  // Reslicing a built blob gives the same bytes, and kvf_blob_blocks' blocks
  // copied as single runs too where every entry is linear.
  for (uint32_t slice : {0u, 512u, 1000u, 65536u}) {
    SCOPED_TRACE("reslice " + std::to_string(slice));
    Data got = clone(in);
    Req r(s.plan, c.format, payloads(got.cache), payloads(got.objs));
    std::vector<uint8_t> blob = build_blob(g, plan.p, r.get(), gather, nullptr);
    uint64_t tasks = kvf_blob_reslice(blob.data(), slice);
    EXPECT_EQ(tasks, reinterpret_cast<const kvf_blob_header *>(blob.data())->total_tasks);
    run_blob(blob);
    EXPECT_EQ(diff("cache region", got.cache, want.cache), "");
    EXPECT_EQ(diff("object", got.objs, want.objs), "");
  }
  {
    Data got = clone(in);
    Req r(s.plan, c.format, payloads(got.cache), payloads(got.objs));
    std::vector<uint8_t> blob = build_blob(g, plan.p, r.get(), gather, nullptr);
    const auto *h = reinterpret_cast<const kvf_blob_header *>(blob.data());
    const kvf_blob_entry *e = kvf_blob_entries(blob.data());
    std::vector<uint32_t> entry_segment(plan.p.num_segments);
    ASSERT_EQ(kvf_blob_entry_segments(g, &plan.p, r.get(), nullptr, entry_segment.data()), h->num_entries);
    bool linear = true;
    ASSERT_GE(h->num_shapes, 1u);
    ASSERT_LE(h->num_shapes, h->num_entries);
    ASSERT_EQ(h->off_buckets, (h->off_shapes + h->num_shapes * sizeof(kvf_blob_shape) + 15) / 16 * 16);
    ASSERT_EQ(h->size, h->off_buckets + h->num_buckets * sizeof(uint16_t));
    ASSERT_EQ(h->num_buckets == 0, h->entry_tasks_magic != 0) << "the table only where the multiplier does not serve";
    ASSERT_LE(h->size, kvf_blob_size(g, &plan.p, r.get(), nullptr)) << "kvf_blob_size is the bound";
    // Shapes are shared: no two stored the same (a blob holds at most 16 here).
    ASSERT_LE(h->num_shapes, 16u);
    for (uint32_t i = 0; i < h->num_shapes; i++)
      for (uint32_t j = i + 1; j < h->num_shapes; j++)
        EXPECT_NE(std::memcmp(&kvf_blob_shapes(blob.data())[i], &kvf_blob_shapes(blob.data())[j], sizeof(kvf_blob_shape)),
                  0)
            << "shapes " << i << " and " << j << " are the same";
    // The vector width each segment may take: its own alignment, its
    // region base's and every object of its object group's.
    const kvf_copy_request *req = r.get();
    auto align16 = [](uint64_t v) {
      uint32_t a = 16;
      while (a > 1 && v % a) a >>= 1;
      return a;
    };
    const uint32_t nog = kvf_geometry_num_object_groups(g);
    const uint64_t nobj = (req->token_end - req->token_begin + chunk_tokens(g) - 1) / chunk_tokens(g) * nog;
    std::vector<uint64_t> og_bits(nog, 0);
    for (uint64_t k = 0; k < nobj; k++) og_bits[k % nog] |= reinterpret_cast<uintptr_t>(req->objects[k]);
    for (uint32_t i = 0; i < h->num_entries; i++) {
      // Each entry's shape and offsets are its plan segment's.
      ASSERT_LT(e[i].shape, h->num_shapes);
      ASSERT_LT(entry_segment[i], plan.p.num_segments);
      const kvf_segment &seg = plan.p.segments[entry_segment[i]];
      const kvf_blob_shape &sh = *kvf_blob_shape_of(blob.data(), &e[i]);
      EXPECT_EQ(e[i].cache_base, reinterpret_cast<uintptr_t>(req->region_bases[seg.region]) + seg.src_offset);
      EXPECT_EQ(e[i].dst_const, seg.dst_const);
      EXPECT_EQ(sh.src_block, seg.src_block);
      EXPECT_EQ(sh.src_token, seg.src_token);
      EXPECT_EQ(sh.src_head, seg.src_head);
      EXPECT_EQ(e[i].dst_per_token, seg.dst_per_token);
      EXPECT_EQ(sh.dst_block, seg.dst_block);
      EXPECT_EQ(sh.dst_token, seg.dst_token);
      EXPECT_EQ(sh.dst_head, seg.dst_head);
      EXPECT_EQ(sh.run, seg.run);
      EXPECT_EQ(sh.heads, seg.heads);
      EXPECT_EQ(sh.tokens, seg.tokens);
      EXPECT_EQ(sh.object_group, seg.object_group);
      EXPECT_EQ(sh.recurrent, seg.recurrent);
      EXPECT_EQ(sh.run % sh.vec, 0u);
      EXPECT_EQ(seg.align % sh.vec, 0u);
      EXPECT_EQ(sh.units_per_run * sh.vec, sh.run);
      EXPECT_EQ(sh.units_per_token, (uint64_t)sh.units_per_run * sh.heads);
      EXPECT_EQ(sh.vec, std::min({seg.align, align16(reinterpret_cast<uintptr_t>(req->region_bases[seg.region])),
                                  align16(og_bits[seg.object_group])}))
          << "entry " << i;
      EXPECT_EQ(sh.slice_units, h->slice_bytes / sh.vec);
      const uint64_t block_units = (uint64_t)sh.run * sh.heads * sh.tokens / sh.vec;
      EXPECT_EQ(e[i].slices, (block_units + sh.slice_units - 1) / sh.slice_units);
      linear = linear && kvf_blob_shape_linear(&sh);
    }
    uint64_t n = kvf_blob_blocks(blob.data(), nullptr, 0);
    std::vector<kvf_blob_block> blocks(n);
    ASSERT_EQ(kvf_blob_blocks(blob.data(), blocks.data(), n), n);
    // kvf_blob_blocks steps from block to block; the plan's formulas
    // applied to each block on its own must agree (ASSERT: the copies
    // below go where these point).
    ASSERT_NO_FATAL_FAILURE(expect_blocks_by_formula(blob));
    uint64_t bytes = 0;
    for (const kvf_blob_block &b : blocks) {
      const kvf_blob_shape *sh = kvf_blob_shape_of(blob.data(), &e[b.entry]);
      bytes += b.units * sh->vec;
      EXPECT_GE(kvf_blob_object_extent(sh, b.units), b.units * sh->vec);
      if (linear) {
        size_t len = b.units * sh->vec;
        if (gather)
          std::memcpy(b.object, b.cache, len);
        else
          std::memcpy(b.cache, b.object, len);
      }
    }
    EXPECT_EQ(bytes, plan_payload(g, s.plan));
    if (linear) {
      EXPECT_EQ(diff("cache region (blocks as runs)", got.cache, want.cache), "");
      EXPECT_EQ(diff("object (blocks as runs)", got.objs, want.objs), "");
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Presets, XferPieces, ::testing::ValuesIn(host_cases(false)), host_case_name);

// ---- the kernel's warp walk, run on the CPU --------------------------------

// Every lane of `warps` warps runs kernels/walk.h's warp walk over the blob,
// one after another: the kernel's exact code for the host (lanes share no
// registers, sources and destinations never overlap, so the order is free).
// deep: a spread launch's twice the loads in flight a lane (kernels/
// xfer_kernel.cu, WalkShape), 1 otherwise.
void run_walk(const std::vector<uint8_t> &blob, uint64_t warps, int deep = 1) {
  const char *b = reinterpret_cast<const char *>(blob.data());
  for (uint64_t w = 0; w < warps; w++)
    for (uint32_t lane = 0; lane < kvf_walk::kLanes; lane++) {
      if (deep == 2)
        kvf_walk::run_warp<2>(b, w, warps, lane);
      else
        kvf_walk::run_warp<1>(b, w, warps, lane);
    }
}

// The warp walk against the reference: every preset, format, direction,
// several grid sizes (one warp; a prime; a full H200 at 512 threads), task
// sizes (512 bytes, the default, 64 KiB, odd ones), the staged route's
// pieces, objects split between two blobs (a staged call's batches and its
// direct launch), and misaligned objects (8-, 4-, 2- and 1-byte units).
class XferWalk : public ::testing::TestWithParam<HostCase> {};

TEST_P(XferWalk, WarpWalkMatchesTheReference) {
  const HostCase &c = GetParam();
  const bool gather = c.dir == Dir::Gather;
  uint64_t seed = seed_of(c.preset, 777 + (uint64_t)c.format * 2 + (uint64_t)c.dir);
  Prepared s;
  ASSERT_NO_FATAL_FAILURE(setup_standard(c.preset, c.format == KVF_FORMAT_CANONICAL, seed, &s));
  const kvf_geometry *g = s.g();
  PlanHolder plan;
  ASSERT_EQ(kvf_plan_build(g, c.format, &plan.p), KVF_SUCCESS) << kvf_last_error();
  ASSERT_EQ(plan.p.wide, 0u) << "every preset's in-block offsets fit 32 bits";
  const uint32_t ns = plan.p.num_segments;
  for (size_t misalign : {0, 8, 4, 6, 1}) {
    std::mt19937_64 rng(seed + misalign);
    Data in = make_inputs(g, s.plan, c.dir, misalign, rng), want = clone(in);
    ASSERT_EQ(reference(g, s.plan, c.format, c.dir, want), KVF_SUCCESS) << kvf_last_error();
    // Grids: one warp; a prime; a full H200 at 512 threads (2112 warps); far
    // more warps than tasks (a spread launch's 16 rounds of 128-thread
    // CTAs, 33792 warps, or 25344 at 3 CTAs an SM). deep: the deep spread's
    // twice the loads in flight a lane, on a few of them. cache_order: the
    // header's flag (a gather's head-major blocks in the cache's order; the walk ignores it elsewhere,
    // XferWalk.CacheOrderTakesHeadMajorGathersInAddressOrder checks where).
    struct Shape {
      uint32_t slice, pieces;
      uint64_t warps;
      uint32_t cache_order;
      int deep;
    };
    std::vector<Shape> shapes = {{0, 1, 2112, 0, 1},  {512, 1, 2112, 0, 1}, {512, 4, 7, 1, 1},
                                 {65536, 1, 1, 0, 1}, {1040, 1, 64, 1, 1},  {8192, 4, 132, 0, 1},
                                 {0, 1, 33792, 1, 1}, {0, 1, 25344, 1, 2},  {1040, 1, 7, 0, 2}};
    if (misalign) shapes = {{0, 1, 2112, 0, 1}, {512, 4, 5, 0, 2}, {512, 1, 33, 1, 1}};
    Data got = clone(in);
    for (const Shape &sh : shapes) {
      SCOPED_TRACE("misalign " + std::to_string(misalign) + ", slice " + std::to_string(sh.slice) + ", pieces " +
                   std::to_string(sh.pieces) + ", warps " + std::to_string(sh.warps) + ", cache order " +
                   std::to_string(sh.cache_order) + ", deep " + std::to_string(sh.deep));
      refill(got, in);
      Req r(s.plan, c.format, payloads(got.cache), payloads(got.objs));
      std::vector<unsigned char> masks((size_t)sh.pieces * ns);
      uint32_t made = sh.pieces > 1 ? kvf_stage_piece_masks(g, &plan.p, r.get(), gather, sh.pieces, masks.data()) : 1;
      for (uint32_t p = 0; p < made; p++) {
        kvf_blob_opts o = {sh.slice, made > 1 ? masks.data() + (size_t)p * ns : nullptr, 0};
        std::vector<uint8_t> blob = build_blob(g, plan.p, r.get(), gather, &o);
        reinterpret_cast<kvf_blob_header *>(blob.data())->cache_order = sh.cache_order;
        run_walk(blob, sh.warps, sh.deep);
      }
      EXPECT_EQ(diff("cache region", got.cache, want.cache), "");
      EXPECT_EQ(diff("object", got.objs, want.objs), "");
    }
    // Objects split between two blobs: the even ones, then the odd ones.
    {
      SCOPED_TRACE("misalign " + std::to_string(misalign) + ", objects in two blobs");
      refill(got, in);
      Req r(s.plan, c.format, payloads(got.cache), payloads(got.objs));
      std::vector<void *> all = r.objects;
      for (int half = 0; half < 2; half++) {
        for (size_t i = 0; i < all.size(); i++) r.objects[i] = (int)(i % 2) == half ? all[i] : nullptr;
        r.rebind();
        kvf_blob_opts o = {4096, nullptr, 0};
        std::vector<uint8_t> blob = build_blob(g, plan.p, r.get(), gather, &o);
        run_walk(blob, 2112);
      }
      EXPECT_EQ(diff("cache region", got.cache, want.cache), "");
      EXPECT_EQ(diff("object", got.objs, want.objs), "");
    }
  }
}

// A gather asks L2 for its first round's lines before it decodes the
// object's side (kernels/walk.h, prefetch_first_round): every line it asks
// for holds bytes of a block the blob moves, in the walk's addressing (a
// prefetch is only a hint, but it must touch nothing outside the blocks:
// no guard, no other plane or layer); a scatter asks for none. A block
// whose object another leg moves is asked for too (the object is decoded
// after the prefetch); the blobs here hold every object.
TEST_P(XferWalk, GatherPrefetchesOnlyCacheBytes) {
  const HostCase &c = GetParam();
  const bool gather = c.dir == Dir::Gather;
  const uint64_t seed = seed_of(c.preset, 991 + (uint64_t)c.format * 2 + (uint64_t)c.dir);
  PresetRequest pr;
  ASSERT_NO_FATAL_FAILURE(prepare_request(c.preset, seed, &pr, c.format, c.dir));
  const kvf_geometry *g = pr.s.g();
  const PlanHolder &plan = pr.plan;
  const Req &r = *pr.r;
  static std::vector<const char *> *asked;
  std::vector<const char *> lines;
  asked = &lines;
  kvf_walk::prefetch_hook = [](const char *p) { asked->push_back(p); };
  for (uint32_t slice : {0u, 512u, 8192u})
    for (uint32_t cache_order : {0u, 1u}) {
      kvf_blob_opts o = {slice, nullptr, 0};
      std::vector<uint8_t> blob = build_blob(g, plan.p, r.get(), gather, &o);
      reinterpret_cast<kvf_blob_header *>(blob.data())->cache_order = cache_order;
      run_walk(blob, 33792);
      run_walk(blob, 25344, 2);  // the spread's deep lanes ask for a longer first round
    }
  kvf_walk::prefetch_hook = nullptr;
  if (!gather) {
    EXPECT_TRUE(lines.empty()) << lines.size() << " lines asked for by a scatter";
    return;
  }
  EXPECT_FALSE(lines.empty());
  // The 128-byte lines holding the bytes the blocks move: unit u of a
  // block is (token, head, column) at token*src_token + head*src_head +
  // column*vec from its cache pointer (a linear block: u*vec), whatever
  // order a walk visits them in.
  kvf_blob_opts o = {0, nullptr, 0};
  std::vector<uint8_t> blob = build_blob(g, plan.p, r.get(), gather, &o);
  const uint64_t n = kvf_blob_blocks(blob.data(), nullptr, 0);
  std::vector<kvf_blob_block> blocks(n);
  ASSERT_EQ(kvf_blob_blocks(blob.data(), blocks.data(), n), n);
  const auto *entries = reinterpret_cast<const kvf_blob_entry *>(blob.data() +
                                                                 reinterpret_cast<const kvf_blob_header *>(blob.data())->off_entries);
  std::unordered_set<uintptr_t> moved;
  for (const kvf_blob_block &b : blocks) {
    const kvf_blob_shape *sh = kvf_blob_shape_of(blob.data(), &entries[b.entry]);
    const uintptr_t base = (uintptr_t)b.cache;
    if (kvf_blob_shape_linear(sh)) {
      for (uintptr_t a = base & ~(uintptr_t)127; a < base + b.units * sh->vec; a += 128) moved.insert(a);
      continue;
    }
    for (uint64_t u = 0; u < b.units; u += 1) {
      uint64_t tok = u / sh->units_per_token, rest = u % sh->units_per_token;
      uint64_t hd = rest / sh->units_per_run, c = rest % sh->units_per_run;
      moved.insert((base + tok * sh->src_token + hd * sh->src_head + c * sh->vec) & ~(uintptr_t)127);
    }
  }
  size_t outside = 0;
  for (const char *p : lines) outside += moved.count((uintptr_t)p & ~(uintptr_t)127) == 0;
  EXPECT_EQ(outside, 0u) << "of " << lines.size() << " lines asked for, outside the blocks moved";
}

INSTANTIATE_TEST_SUITE_P(Presets, XferWalk, ::testing::ValuesIn(host_cases(false)), host_case_name);

// A table changed after the host checked it: ids at or past the largest
// group's block count (the kernel's own bound, kernels/walk.h copy_block)
// move nothing, and nothing else changes, so the result is the reference's
// with those blocks skipped. Every id of every group but its first, in one warp, in
// a few, and in more warps than tasks (a spread launch's one task a warp).
// Under ASan (CI's second build) a read or write outside the cache or the
// objects fails too. Read before anything else is known, the decode must not
// use a bad id for an address it reads.
TEST(XferWalk, OutOfRangeIdsMoveNothing) {
  for (const char *preset : {"llama-3.1-8b-fa-hnd", "deepseek-v3-mla-bf16", "glm-like-hybrid"}) {
    for (Dir dir : {Dir::Gather, Dir::Scatter}) {
      const bool gather = dir == Dir::Gather;
      SCOPED_TRACE(std::string(preset) + (gather ? " gather" : " scatter"));
      Prepared s;
      ASSERT_NO_FATAL_FAILURE(setup_standard(preset, false, seed_of(preset, 4242), &s));
      const kvf_geometry *g = s.g();
      PlanHolder plan;
      ASSERT_EQ(kvf_plan_build(g, KVF_FORMAT_CANONICAL, &plan.p), KVF_SUCCESS) << kvf_last_error();
      uint32_t bound = 0;
      for (uint32_t gi = 0; gi < kvf_geometry_num_groups(g); gi++) {
        kvf_group_info info = KVF_GROUP_INFO_INIT;
        ASSERT_EQ(kvf_geometry_group(g, gi, &info), KVF_SUCCESS);
        bound = std::max(bound, info.num_blocks);
      }
      const uint32_t bad_ids[] = {bound, bound + 1, 0x7FFFFFFFu, 0xFFFFFFFEu};
      Plan skipped = s.plan, corrupt = s.plan;
      size_t changed = 0;
      for (size_t gi = 0; gi < s.plan.ids.size(); gi++)
        for (size_t i = 1; i < s.plan.ids[gi].size(); i++) {
          if (s.plan.ids[gi][i] == KVF_BLOCK_SKIP) continue;
          skipped.ids[gi][i] = KVF_BLOCK_SKIP;
          corrupt.ids[gi][i] = bad_ids[changed++ % 4];
        }
      ASSERT_GE(changed, 2u);
      std::mt19937_64 rng(seed_of(preset, gather ? 1 : 2));
      Data in = make_inputs(g, s.plan, dir, 0, rng), want = clone(in);
      ASSERT_EQ(reference(g, skipped, KVF_FORMAT_CANONICAL, dir, want), KVF_SUCCESS) << kvf_last_error();
      for (uint64_t warps : {1ull, 7ull, 33792ull}) {
        SCOPED_TRACE("warps " + std::to_string(warps));
        Data got = clone(in);
        // The blob takes the tables as they are: the check that would refuse
        // them (kvf_copy_request_check) runs before a call builds one.
        Req r(corrupt, KVF_FORMAT_CANONICAL, payloads(got.cache), payloads(got.objs));
        kvf_blob_opts o = {0, nullptr, 0};
        std::vector<uint8_t> blob = build_blob(g, plan.p, r.get(), gather, &o);
        run_walk(blob, warps);
        EXPECT_EQ(diff("cache region", got.cache, want.cache), "");
        EXPECT_EQ(diff("object", got.objs, want.objs), "");
      }
    }
  }
}

// The cache order (header cache_order) applies to the gathers of head-major
// blocks only, and there it visits a block's units in the cache's address
// order: unit u's source offset grows with u. Without it, or on a
// token-major cache, the walk keeps the object's order.
TEST(XferWalk, CacheOrderTakesHeadMajorGathersInAddressOrder) {
  struct Want {
    const char *preset;
    bool head_major;
  };
  for (Want w : {Want{"llama-3.1-8b-fa-hnd", true}, Want{"llama-3.1-8b-flashinfer-hnd", true},
                 Want{"llama-3.1-8b-fa-nhd", false}, Want{"deepseek-v3-mla-bf16", false}}) {
    Prepared s;
    ASSERT_NO_FATAL_FAILURE(setup_standard(w.preset, true, 91, &s));
    const kvf_geometry *g = s.g();
    PlanHolder plan;
    ASSERT_EQ(kvf_plan_build(g, KVF_FORMAT_CANONICAL, &plan.p), KVF_SUCCESS) << kvf_last_error();
    std::mt19937_64 rng(92);
    Data in = make_inputs(g, s.plan, Dir::Gather, 0, rng);
    Req r(s.plan, KVF_FORMAT_CANONICAL, payloads(in.cache), payloads(in.objs));
    for (int gather : {1, 0})
      for (uint32_t order : {1u, 0u}) {
        SCOPED_TRACE(std::string(w.preset) + (gather ? " gather" : " scatter") + ", cache order " +
                     std::to_string(order));
        std::vector<uint8_t> blob = build_blob(g, plan.p, r.get(), gather, nullptr);
        auto *h = reinterpret_cast<kvf_blob_header *>(blob.data());
        h->cache_order = order;
        ASSERT_GT(h->num_entries, 0u);
        for (uint32_t i = 0; i < h->num_entries; i++) {
          const kvf_blob_shape *x = kvf_blob_shape_of(blob.data(), &kvf_blob_entries(blob.data())[i]);
          const bool want = order && gather && w.head_major;
          ASSERT_EQ(kvf_walk::cache_order_of(h, x), want) << "entry " << i;
          if (kvf_walk::linear_of(x)) continue;
          // A whole block's units, walked with the strides the walk takes.
          const uint64_t units = (uint64_t)x->tokens * x->units_per_token;
          const kvf_walk::Strides st = kvf_walk::strides_of(h, x, units);
          const uint32_t upt = st.upr * st.heads;
          bool ascending = true;
          uint64_t last = 0;
          for (uint64_t u = 0; u < units; u++) {
            uint64_t outer = u / upt, inner = u % upt / st.upr, col = u % st.upr;
            uint64_t off = outer * st.src_token + inner * st.src_head + col * x->vec;
            if (u && off <= last) ascending = false;
            last = off;
          }
          EXPECT_EQ(ascending, want || !w.head_major) << "entry " << i << ": the cache side's offsets "
                                                      << (ascending ? "ascend" : "do not ascend");
        }
      }
  }
}

// The task -> entry table finds the same entry as a search over every task,
// and so does the header's multiplier where the entries' task counts are
// equal (then it is set: the walk reads no table).
TEST(XferWalk, TaskTableFindsEveryTasksEntry) {
  for (const char *preset : {"llama-3.1-70b-tp4-rank2-slice", "glm-like-hybrid", "deepseek-v3-mla-bf16"}) {
    SCOPED_TRACE(preset);
    PresetRequest pr;
    ASSERT_NO_FATAL_FAILURE(prepare_request(preset, 5, &pr));
    const kvf_geometry *g = pr.s.g();
    const PlanHolder &plan = pr.plan;
    const Req &r = *pr.r;
    for (uint32_t slice : {0u, 512u, 1040u, 65536u}) {
      kvf_blob_opts o = {slice, nullptr, 0};
      std::vector<uint8_t> blob = build_blob(g, plan.p, r.get(), true, &o);
      for (uint32_t reslice : {slice, 2048u}) {
        kvf_blob_reslice(blob.data(), reslice);
        const auto *h = reinterpret_cast<const kvf_blob_header *>(blob.data());
        const auto *e = reinterpret_cast<const kvf_blob_entry *>(blob.data() + h->off_entries);
        ASSERT_LE(h->num_buckets, KVF_BLOB_BUCKETS);
        uint32_t want = 0;
        for (uint64_t t = 0; t < h->total_tasks; t++) {
          while (want + 1 < h->num_entries && e[want + 1].first_task <= t) want++;
          ASSERT_EQ(kvf_blob_entry_of(blob.data(), t), want) << "task " << t << " of " << h->total_tasks;
          if (h->entry_tasks_magic) {
            ASSERT_EQ(((uint64_t)(uint32_t)t * h->entry_tasks_magic) >> 32, want) << "task " << t;
          }
        }
        const uint64_t per = h->total_tasks / h->num_entries;
        bool equal = per > 1;
        for (uint32_t i = 0; i < h->num_entries; i++) equal = equal && e[i].first_task == i * per;
        equal = equal && per * h->num_entries == h->total_tasks;
        EXPECT_EQ(h->entry_tasks_magic != 0, equal) << "slice " << slice << " re-cut " << reslice;
      }
    }
  }
}

// A build given task slots takes its slice from the payload at once: the
// same bytes as a build of the starting slice re-cut by kvf_blob_reslice to
// the slice the rule picks (the halving xfer.c used to run after the build),
// for every preset, direction, piece, and slot counts from none to far more
// than the tasks.
TEST(XferWalk, BuildTakesTheSliceARecutWouldGive) {
  for (const std::string &preset : preset_names()) {
    PresetRequest pr;
    ASSERT_NO_FATAL_FAILURE(prepare_request(preset, 17, &pr));
    const kvf_geometry *g = pr.s.g();
    const PlanHolder &plan = pr.plan;
    const Req &r = *pr.r;
    const uint32_t ns = plan.p.num_segments;
    std::vector<unsigned char> masks((size_t)2 * ns);
    uint32_t made = kvf_stage_piece_masks(g, &plan.p, r.get(), 1, 2, masks.data());
    for (int gather : {1, 0})
      for (uint32_t p = 0; p <= made; p++)  // p == made: every segment
        for (uint32_t start : {8192u, 1040u, 65536u})
          for (uint64_t slots : {0ull, 1ull, 64ull, 2112ull * 4, 132ull * 16 * 4 * 64}) {
            SCOPED_TRACE(preset + (gather ? " gather" : " scatter") + ", piece " + std::to_string(p) + ", slice " +
                         std::to_string(start) + ", slots " + std::to_string(slots));
            const unsigned char *mask = p < made ? masks.data() + (size_t)p * ns : nullptr;
            kvf_blob_opts direct = {start, mask, slots};
            std::vector<uint8_t> got = build_blob(g, plan.p, r.get(), gather, &direct);
            const auto *h = reinterpret_cast<const kvf_blob_header *>(got.data());
            // The oracle: build at `start`, then the halving rule, then re-cut.
            kvf_blob_opts plain = {start, mask, 0};
            std::vector<uint8_t> want = build_blob(g, plan.p, r.get(), gather, &plain);
            const auto *wh = reinterpret_cast<const kvf_blob_header *>(want.data());
            uint32_t slice = start;
            if (slots) {
              uint64_t need = wh->payload_bytes / slots;
              while (slice / 2 >= KVF_SLICE_MIN_BYTES && slice / 2 >= need) slice /= 2;
            }
            kvf_blob_reslice(want.data(), slice);
            ASSERT_EQ(got.size(), want.size());
            EXPECT_EQ(h->slice_bytes, wh->slice_bytes);
            EXPECT_EQ(h->total_tasks, wh->total_tasks);
            size_t at = 0;
            while (at < got.size() && got[at] == want[at]) at++;
            EXPECT_EQ(at, got.size()) << "the blobs differ at byte " << at;
          }
  }
}

// A blob's entries carry a multiplier for the division by their slices
// (kvf_blob_entry.slices_magic) wherever it is exact for all their tasks,
// and it is: every task of every entry, every preset, direction and slice
// (512-byte slices give the most slices a block). Their shapes carry the
// request's first block and a chunk's blocks, so the walk's block index
// needs no division.
TEST(XferWalk, EntriesDivideBySlicesWithoutADivision) {
  for (const std::string &preset : preset_names()) {
    PresetRequest pr;
    ASSERT_NO_FATAL_FAILURE(prepare_request(preset, 21, &pr));
    const kvf_geometry *g = pr.s.g();
    const PlanHolder &plan = pr.plan;
    const Req &r = *pr.r;
    for (int gather : {1, 0})
      for (uint32_t slice : {0u, 512u, 1040u, 65536u}) {
        SCOPED_TRACE(preset + (gather ? " gather" : " scatter") + ", slice " + std::to_string(slice));
        kvf_blob_opts o = {slice, nullptr, 0};
        std::vector<uint8_t> blob = build_blob(g, plan.p, r.get(), gather, &o);
        for (uint32_t recut : {0u, 512u}) {
          if (recut) kvf_blob_reslice(blob.data(), recut);  // the re-cut sets them too
          const auto *h = reinterpret_cast<const kvf_blob_header *>(blob.data());
          const auto *e = reinterpret_cast<const kvf_blob_entry *>(blob.data() + h->off_entries);
          for (uint32_t i = 0; i < h->num_entries; i++) {
            const uint64_t end = i + 1 < h->num_entries ? e[i + 1].first_task : h->total_tasks;
            const uint64_t tasks = end - e[i].first_task, slices = e[i].slices, blocks = tasks / slices;
            ASSERT_EQ(tasks % slices, 0u);
            // Where the multiplier is exact it is there: the walk's fast path is taken.
            EXPECT_EQ(e[i].slices_magic != 0, slices > 1 && blocks * slices * slices <= (1ull << 32)) << "entry " << i;
            if (e[i].slices_magic) {
              for (uint64_t t = 0; t < tasks; t++) {
                ASSERT_EQ(((uint64_t)(uint32_t)t * e[i].slices_magic) >> 32, t / slices)
                    << "entry " << i << " task " << t << " slices " << slices;
              }
            }
            const kvf_blob_shape &sh = *kvf_blob_shape_of(blob.data(), &e[i]);
            EXPECT_EQ(e[i].object_group, sh.object_group) << "entry " << i;
            if (!sh.recurrent) {
              EXPECT_EQ(sh.first_block, h->lt_begin / sh.tokens);
              EXPECT_EQ(sh.first_block * sh.tokens, h->lt_begin) << "the request starts a block";
              EXPECT_EQ(sh.blocks_per_chunk * sh.tokens, h->chunk_local) << "a chunk holds whole blocks";
            }
          }
        }
      }
  }
}

// The walk's 32-unit step is the division it replaces, for every run shape.
TEST(XferWalk, StepsAgreeWithDivision) {
  for (uint32_t upr : {1u, 2u, 3u, 5u, 8u, 16u, 31u, 32u, 33u, 36u, 64u, 72u, 100u})
    for (uint32_t heads : {1u, 2u, 3u, 7u, 8u, 32u, 40u}) {
      kvf_walk::Shape sh = kvf_walk::shape_of(upr, heads);
      const uint32_t ts = 100003, hs = 1009, vec = 4;  // strides: distinct digits of the offset
      kvf_walk::Deltas d = kvf_walk::deltas_of(sh, ts, hs, vec);
      for (uint32_t lane = 0; lane < 32; lane++) {
        uint32_t u = lane, tok = u / sh.upt, r = u % sh.upt;
        kvf_walk::Pos p = {r / upr, r % upr, tok * ts + (r / upr) * hs + (r % upr) * vec};
        for (int k = 0; k < 40; k++) {
          u += 32;
          kvf_walk::step(sh, d, p);
          uint32_t t2 = u / sh.upt, r2 = u % sh.upt;
          ASSERT_EQ(p.hd, r2 / upr) << "upr " << upr << " heads " << heads << " unit " << u;
          ASSERT_EQ(p.c, r2 % upr) << "upr " << upr << " heads " << heads << " unit " << u;
          ASSERT_EQ(p.off, t2 * ts + (r2 / upr) * hs + (r2 % upr) * vec) << "upr " << upr << " heads " << heads;
        }
      }
    }
}

// The straight part's views: whole linear views from the exposed end (a
// gather's first, a scatter's last) until the target and never past the
// limit, none where blocks are not one run or are shorter than the minimum.
TEST(XferStraight, PicksWholeLinearViewsFromTheExposedEnd) {
  struct Want {
    const char *preset;
    uint64_t min_run;
    uint64_t target;
    uint64_t limit;
    uint64_t max_runs;
    int from_end;
    std::vector<uint32_t> segments; // picked
    uint64_t bytes;
  };
  const uint64_t layer = 2ull * 16 * 32768; // Llama-8B NHD: 2 planes x 16 blocks x 32 KiB a chunk
  const uint64_t any = UINT64_MAX;
  const std::vector<Want> wants = {
      {"llama-3.1-8b-fa-nhd", 16384, 1 << 20, any, any, 0, {0, 1}, layer},
      {"llama-3.1-8b-fa-nhd", 16384, (1 << 20) + 1, any, any, 0, {0, 1, 2, 3}, 2 * layer},
      {"llama-3.1-8b-fa-nhd", 16384, 1 << 20, any, any, 1, {62, 63}, layer},
      {"llama-3.1-8b-fa-nhd", 16384, 0, any, any, 0, {}, 0},
      {"llama-3.1-8b-fa-nhd", 32769, 1 << 20, any, any, 0, {}, 0},  // 32 KiB blocks: too short
      {"llama-3.1-8b-fa-hnd", 0, 1 << 20, any, any, 0, {}, 0},      // a block is one run per head
      // The limits end the pick at the view that would pass one (a layer: 32 blocks).
      {"llama-3.1-8b-fa-nhd", 16384, 4 * layer, 3 * layer, any, 0, {0, 1, 2, 3, 4, 5}, 3 * layer},
      {"llama-3.1-8b-fa-nhd", 16384, 4 * layer, 3 * layer - 1, any, 1, {60, 61, 62, 63}, 2 * layer},
      {"llama-3.1-8b-fa-nhd", 16384, 1 << 20, layer - 1, any, 0, {}, 0},
      {"llama-3.1-8b-fa-nhd", 16384, 4 * layer, any, 96, 0, {0, 1, 2, 3, 4, 5}, 3 * layer},
      {"llama-3.1-8b-fa-nhd", 16384, 4 * layer, any, 95, 0, {0, 1, 2, 3}, 2 * layer},
  };
  for (const Want &w : wants) {
    SCOPED_TRACE(std::string(w.preset) + " min_run " + std::to_string(w.min_run) + " target " +
                 std::to_string(w.target) + " limit " + std::to_string(w.limit) + " max_runs " +
                 std::to_string(w.max_runs) + (w.from_end ? " from the end" : ""));
    PlannedRequest q;
    ASSERT_NO_FATAL_FAILURE(plan_chunks(w.preset, 1, 0, 23, &q));
    const kvf_plan &plan = q.plan.p;
    std::vector<unsigned char> pick(plan.num_segments, 7);
    uint64_t bytes = kvf_stage_straight_pick(q.g(), &plan, q.r->get(), w.from_end, w.min_run, w.target, w.limit,
                                             w.max_runs, pick.data());
    std::vector<uint32_t> got;
    for (uint32_t i = 0; i < plan.num_segments; i++) {
      EXPECT_LE(pick[i], 1) << "segment " << i << " neither picked nor cleared";
      if (pick[i]) got.push_back(i);
    }
    EXPECT_EQ(got, w.segments);
    EXPECT_EQ(bytes, w.bytes);
  }
  // A hybrid cache: the recurrent view (a 6 KiB conv state beside a 32 KiB
  // ssm state) is never picked whole, the attention views are.
  PlannedRequest q;
  ASSERT_NO_FATAL_FAILURE(plan_chunks("glm-like-hybrid", 1, 0, 29, &q));
  const kvf_plan &plan = q.plan.p;
  std::vector<unsigned char> pick(plan.num_segments);
  uint64_t all = kvf_stage_straight_pick(q.g(), &plan, q.r->get(), 1, 16384, UINT64_MAX, UINT64_MAX, UINT64_MAX,
                                         pick.data());
  uint64_t attention = 0;
  for (uint32_t i = 0; i < plan.num_segments; i++) {
    const kvf_segment &seg = plan.segments[i];
    EXPECT_EQ(pick[i], seg.recurrent ? 0 : 1) << "segment " << i;
    if (!seg.recurrent) attention += 16ull * seg.run * seg.tokens;
  }
  EXPECT_EQ(all, attention);
}

// The batch API's runs of a blob (the copy-batch route and the straight
// part): merged, checked against the shortest run and the most runs, and
// when they do not fit nothing is left for the caller to free. A request
// ending 3 tokens into a block has a 6 KiB last run a plane on Llama NHD.
TEST(XferStraight, BatchRunsLeaveNothingToFreeWhenTheyDoNotFit) {
  PlannedRequest q;
  ASSERT_NO_FATAL_FAILURE(plan_chunks("llama-3.1-8b-fa-nhd", 0, 195, 31, &q));
  std::vector<unsigned char> layer0(q.plan.p.num_segments, 0);
  layer0[0] = layer0[1] = 1; // both planes of layer 0: 13 blocks each, the last 3 tokens long
  kvf_blob_opts o = {0, layer0.data(), 0};
  for (int gather : {1, 0}) {
    SCOPED_TRACE(gather ? "gather" : "scatter");
    std::vector<uint8_t> blob = build_blob(q.g(), q.plan.p, q.r->get(), gather, &o);
    const auto *h = reinterpret_cast<const kvf_blob_header *>(blob.data());
    struct Case {
      uint64_t min_run, max_runs;
      int want;
    };
    // Fits; two short runs (one a plane) against 16 KiB; 26 runs against 10
    // (arrays made, then refused); against 4 (refused before any array).
    for (Case c : {Case{0, 256, 1}, Case{16384, 256, 0}, Case{0, 10, 0}, Case{0, 4, 0}}) {
      SCOPED_TRACE("min_run " + std::to_string(c.min_run) + " max_runs " + std::to_string(c.max_runs));
      void **dst = reinterpret_cast<void **>(8);
      const void **src = reinterpret_cast<const void **>(8);
      size_t *size = reinterpret_cast<size_t *>(8), count = 0;
      int fit = kvf_stage_batch_runs(blob.data(), gather, c.min_run, c.max_runs, &dst, &src, &size, &count);
      EXPECT_EQ(fit, c.want);
      if (fit != 1) {
        EXPECT_EQ(dst, nullptr);
        EXPECT_EQ(src, nullptr);
        EXPECT_EQ(size, nullptr);
        continue;
      }
      uint64_t bytes = 0, shorts = 0;
      for (size_t i = 0; i < count; i++) {
        bytes += size[i];
        shorts += size[i] < 16384;
      }
      EXPECT_EQ(bytes, h->payload_bytes);
      EXPECT_LE(count, 26u);
      EXPECT_EQ(shorts, 2u) << "one 6 KiB run a plane";
      free(dst);
      free(src);
      free(size);
      // The merge stops at the first run past max_runs: exactly the merged
      // count fits, one fewer is refused.
      for (uint64_t max_runs : {(uint64_t)count, (uint64_t)count - 1}) {
        SCOPED_TRACE("max_runs " + std::to_string(max_runs) + " of " + std::to_string(count) + " runs");
        size_t again = 0;
        int edge = kvf_stage_batch_runs(blob.data(), gather, 0, max_runs, &dst, &src, &size, &again);
        EXPECT_EQ(edge, max_runs == count ? 1 : 0);
        if (edge == 1) {
          EXPECT_EQ(again, count);
        } else {
          EXPECT_EQ(dst, nullptr);
        }
        free(dst);
        free(src);
        free(size);
      }
    }
  }
}

// kvf_stage_blob_runs_cached answers as kvf_stage_blob_runs would, and from
// its slots only where that answer cannot differ. Hits: other ids of the
// same blocks, the same pieces in the other staging buffer (objects and
// bases moved together), the next chunk of the sequence. Misses: a skipped
// block (a recurrent state's too), another object base, an object left out,
// a request one token shorter over the same blocks, another blob. More keys
// than slots evict; a random walk over all of these never differs from the
// listing.
TEST(XferStraight, StagedRunsCacheAnswersAsTheListingDoes) {
  for (const char *preset :
       {"llama-3.1-8b-fa-hnd", "glm-like-hybrid", "llama-3.1-70b-tp4-rank2-slice", "deepseek-v3-mla-bf16"}) {
    SCOPED_TRACE(preset);
    PlannedRequest q;
    ASSERT_NO_FATAL_FAILURE(plan_chunks(preset, 2, 100, 77, &q));
    const kvf_geometry *g = q.g();
    const uint64_t chunk = [&] {
      kvf_object_policy pol = KVF_OBJECT_POLICY_INIT;
      kvf_geometry_policy(g, &pol);
      return pol.chunk_tokens;
    }();
    bool all_full = true; // every group full attention: the request can move a chunk on as is
    for (uint32_t gi = 0; gi < kvf_geometry_num_groups(g); gi++) {
      kvf_group_info info = KVF_GROUP_INFO_INIT;
      kvf_geometry_group(g, gi, &info);
      all_full = all_full && info.kind == KVF_GROUP_FULL;
    }
    std::vector<unsigned char> half(q.plan.p.num_segments, 0);
    for (size_t i = 0; i < half.size(); i += 2) half[i] = 1;
    kvf_blob_opts o_half = {0, half.data(), 0};
    // The request as built, and variants of it (objects, token range, tables).
    std::vector<void *> objects(q.r->objects);
    std::vector<kvf_group_blocks> groups(q.r->groups);
    kvf_copy_request req = *q.r->get();
    auto blob_of = [&](const kvf_copy_request &r, const kvf_blob_opts *o) {
      return build_blob(g, q.plan.p, &r, true, o);
    };
    std::vector<uint64_t> base;
    for (void *obj : objects) base.push_back(reinterpret_cast<uint64_t>(obj));
    kvf_memo cache{};
    uint64_t hits = 0, misses = 0;
    // One answer checked against the listing; want: 1 from a slot, 0 listed,
    // -1 either (the random walk).
    auto expect_listing = [&](const std::vector<uint8_t> &blob, const std::vector<uint64_t> &b, int want,
                              const std::string &what) {
      SCOPED_TRACE(what);
      kvf_stage_run *fresh = nullptr;
      const kvf_stage_run *got = nullptr;
      uint64_t n = 0, m = 0;
      int holes = 0, got_holes = 0;
      ASSERT_EQ(kvf_stage_blob_runs(blob.data(), b.data(), &fresh, &n, &holes), KVF_SUCCESS);
      ASSERT_EQ(kvf_stage_blob_runs_cached(&cache, blob.data(), b.data(), &got, &m, &got_holes), KVF_SUCCESS);
      EXPECT_EQ(m, n);
      EXPECT_EQ(got_holes, holes);
      if (m == n && n > 0) {
        EXPECT_EQ(memcmp(got, fresh, sizeof *fresh * n), 0);
      }
      free(fresh);
      if (want >= 0) {
        EXPECT_EQ(cache.hits, hits + (uint64_t)want);
        EXPECT_EQ(cache.misses, misses + (uint64_t)(1 - want));
      }
      hits = cache.hits;
      misses = cache.misses;
    };
    std::vector<uint8_t> whole = blob_of(req, nullptr), part = blob_of(req, &o_half);
    const auto *h = reinterpret_cast<const kvf_blob_header *>(whole.data());
    auto *ids = reinterpret_cast<uint32_t *>(whole.data() + h->off_ids);
    const uint64_t num_ids = (h->off_objects - h->off_ids) / sizeof(uint32_t);
    ASSERT_NO_FATAL_FAILURE(expect_listing(whole, base, 0, "first"));
    ASSERT_NO_FATAL_FAILURE(expect_listing(part, base, 0, "another blob"));
    // Other ids of the same blocks: reversed among themselves.
    std::vector<uint32_t> moving;
    for (uint64_t i = 0; i < num_ids; i++)
      if (ids[i] < h->num_blocks_max) moving.push_back(ids[i]);
    ASSERT_GT(moving.size(), 2u);
    std::reverse(moving.begin(), moving.end());
    for (uint64_t i = 0, j = 0; i < num_ids; i++)
      if (ids[i] < h->num_blocks_max) ids[i] = moving[j++];
    ASSERT_NO_FATAL_FAILURE(expect_listing(whole, base, 1, "other ids, the same blocks"));
    ASSERT_NO_FATAL_FAILURE(expect_listing(part, base, 1, "the other blob again"));
    // A skipped block: other extents (or holes), never the slot's.
    const uint32_t kept = ids[1];
    ids[1] = KVF_BLOCK_SKIP;
    ASSERT_NO_FATAL_FAILURE(expect_listing(whole, base, 0, "a block skipped"));
    ids[1] = kept;
    ASSERT_NO_FATAL_FAILURE(expect_listing(whole, base, 1, "the block back"));
    // A recurrent state skipped (the hybrid's states are entries of their own).
    for (uint32_t e = 0; e < h->num_entries; e++) {
      const kvf_blob_entry &en = kvf_blob_entries(whole.data())[e];
      if (!kvf_blob_shape_of(whole.data(), &en)->recurrent || ids[en.ids_offset] >= h->num_blocks_max) continue;
      const uint32_t state = ids[en.ids_offset];
      ids[en.ids_offset] = KVF_BLOCK_SKIP;
      ASSERT_NO_FATAL_FAILURE(expect_listing(whole, base, 0, "a recurrent state skipped"));
      ids[en.ids_offset] = state;
      break;
    }
    std::vector<uint64_t> moved = base;
    moved[0] += 4096;
    ASSERT_NO_FATAL_FAILURE(expect_listing(whole, moved, 0, "another object base"));
    {
      // The pieces in the other staging buffer: objects and bases moved together.
      const uint64_t shift = uint64_t{1} << 30;
      std::vector<void *> far(objects);
      std::vector<uint64_t> far_base(base);
      for (size_t i = 0; i < far.size(); i++) {
        if (far[i]) far[i] = static_cast<char *>(far[i]) + shift;
        far_base[i] += shift;
      }
      kvf_copy_request r2 = req;
      r2.objects = far.data();
      std::vector<uint8_t> b2 = blob_of(r2, nullptr);
      ASSERT_NO_FATAL_FAILURE(expect_listing(b2, far_base, 1, "the other staging buffer"));
    }
    {
      // An object left out, its base kept.
      std::vector<void *> fewer(objects);
      fewer[0] = nullptr;
      kvf_copy_request r2 = req;
      r2.objects = fewer.data();
      std::vector<uint8_t> b2 = blob_of(r2, nullptr);
      ASSERT_NO_FATAL_FAILURE(expect_listing(b2, base, 0, "an object left out"));
    }
    {
      // One token shorter over the same blocks: only the header's end differs.
      kvf_copy_request r2 = req;
      r2.token_end -= 1;
      std::vector<uint8_t> b2 = blob_of(r2, nullptr);
      ASSERT_NO_FATAL_FAILURE(expect_listing(b2, base, 0, "one token shorter"));
    }
    if (all_full) {
      // The same request a chunk further on in its sequence.
      std::vector<kvf_group_blocks> on(groups);
      for (uint32_t gi = 0; gi < on.size(); gi++) {
        kvf_group_info info = KVF_GROUP_INFO_INIT;
        kvf_geometry_group(g, gi, &info);
        on[gi].first_block += chunk / info.block_size;
      }
      kvf_copy_request r2 = req;
      r2.token_begin += chunk;
      r2.token_end += chunk;
      r2.groups = on.data();
      ASSERT_EQ(kvf_copy_request_check(g, &r2), KVF_SUCCESS) << kvf_last_error();
      std::vector<uint8_t> b2 = blob_of(r2, nullptr);
      ASSERT_NO_FATAL_FAILURE(expect_listing(b2, base, 1, "the next chunk"));
    }
    // More keys than slots: each answer still the listing's.
    for (uint32_t k = 0; k < KVF_MEMO_SLOTS + 2; k++) {
      std::vector<uint64_t> other = base;
      other[0] += 8192 * (k + 2);
      ASSERT_NO_FATAL_FAILURE(expect_listing(whole, other, 0, "eviction"));
    }
    ASSERT_NO_FATAL_FAILURE(expect_listing(whole, base, 0, "evicted"));
    // A random walk over skips, ids and bases: never another answer.
    std::mt19937_64 rng(1234);
    for (int step = 0; step < 200; step++) {
      std::vector<uint8_t> &b = rng() % 2 ? whole : part;
      const auto *hb = reinterpret_cast<const kvf_blob_header *>(b.data());
      auto *bid = reinterpret_cast<uint32_t *>(b.data() + hb->off_ids);
      const uint64_t nid = (hb->off_objects - hb->off_ids) / sizeof(uint32_t);
      const uint64_t at = rng() % nid;
      switch (rng() % 3) {
      case 0: bid[at] = bid[at] < hb->num_blocks_max ? KVF_BLOCK_SKIP : (uint32_t)(rng() % hb->num_blocks_max); break;
      case 1: std::swap(bid[at], bid[rng() % nid]); break;
      default: break;
      }
      std::vector<uint64_t> bb = base;
      bb[rng() % bb.size()] += 256 * (rng() % 3);
      ASSERT_NO_FATAL_FAILURE(expect_listing(b, bb, -1, "random step " + std::to_string(step)));
    }
    kvf_memo_free(&cache);
  }
}

// kvf_stage_batch_runs_floor never exceeds the runs kvf_stage_batch_runs
// lists (merged), on every preset whose blocks are single runs, one and two
// chunks, tables whose ids follow the block before's with probability 0,
// 1/2, 9/10 or 1, with and without skipped blocks. It refuses a Llama NHD
// chunk of shuffled ids (1024 runs) over the route's 256, lets the same
// chunk in order (64 runs) through, and has no floor when an object is
// missing.
TEST(XferStraight, RunsFloorIsAtMostTheListedRuns) {
  uint64_t seed = 700, compared = 0;
  for (const std::string &preset : preset_names())
    for (uint64_t chunks : {1, 2})
      for (double p_follow : {0.0, 0.5, 0.9, 1.0})
        for (bool skips : {false, true})
          for (bool adjacent : {false, true}) {
          SCOPED_TRACE(preset + ", " + std::to_string(chunks) + " chunks, follow " + std::to_string(p_follow) +
                       (skips ? ", skips" : "") + (adjacent ? ", regions and objects end to end" : ""));
          PlannedRequest q;
          ASSERT_NO_FATAL_FAILURE(plan_chunks(preset, chunks, 0, seed++, &q));
          if (adjacent) { // runs may then merge across planes, regions and objects
            uintptr_t at = uintptr_t{1} << 40;
            for (uint32_t r = 0; r < q.r->bases.size(); r++) {
              kvf_region_info ri = KVF_REGION_INFO_INIT;
              ASSERT_EQ(kvf_geometry_region(q.g(), r, &ri), KVF_SUCCESS);
              q.r->bases[r] = reinterpret_cast<void *>(at);
              at += ri.size;
            }
            at = uintptr_t{1} << 44;
            for (uint64_t i = 0; i < q.r->objects.size(); i++) {
              q.r->objects[i] = reinterpret_cast<void *>(at);
              at += object_bytes(q.g(), q.r->get(), i);
            }
          }
          std::mt19937_64 rng(seed++);
          for (uint32_t gi = 0; gi < q.r->ids.size(); gi++) {
            std::vector<uint32_t> &ids = q.r->ids[gi];
            kvf_group_info info = KVF_GROUP_INFO_INIT;
            ASSERT_EQ(kvf_geometry_group(q.g(), gi, &info), KVF_SUCCESS);
            const uint32_t num_blocks = info.num_blocks;
            ASSERT_GE(num_blocks, ids.size());
            std::vector<bool> used(num_blocks, false);
            for (size_t i = 0; i < ids.size(); i++) {
              uint32_t id = 0;
              const bool follow = i > 0 && ids[i - 1] != KVF_BLOCK_SKIP && ids[i - 1] + 1 < num_blocks &&
                                  !used[ids[i - 1] + 1] && std::uniform_real_distribution<>(0, 1)(rng) < p_follow;
              if (follow) {
                id = ids[i - 1] + 1;
              } else {
                do id = (uint32_t)(rng() % num_blocks);
                while (used[id]);
              }
              used[id] = true;
              ids[i] = skips && i > 0 && rng() % 6 == 0 ? KVF_BLOCK_SKIP : id;
            }
          }
          q.r->rebind();
          std::vector<uint8_t> blob = build_blob(q.g(), q.plan.p, q.r->get(), true, nullptr);
          void **dst = nullptr;
          const void **src = nullptr;
          size_t *size = nullptr, count = 0;
          if (kvf_stage_batch_runs(blob.data(), 1, 0, uint64_t{1} << 30, &dst, &src, &size, &count) != 1)
            continue;  // blocks that are not single runs: the route never takes them
          free(dst);
          free(src);
          free(size);
          const uint64_t floor = kvf_stage_batch_runs_floor(q.g(), &q.plan.p, q.r->get());
          EXPECT_LE(floor, count);
          EXPECT_GE(floor, 1u);
          compared++;
        }
  EXPECT_GE(compared, 100u) << "presets whose blocks are single runs";

  PlannedRequest q;
  ASSERT_NO_FATAL_FAILURE(plan_chunks("llama-3.1-8b-fa-nhd", 1, 0, 31, &q));
  std::vector<uint32_t> &ids = q.r->ids[0];
  ASSERT_EQ(ids.size(), 16u);
  for (uint32_t i = 0; i < 16; i++) ids[i] = 15 - i; // no id follows the one before
  q.r->rebind();
  EXPECT_GT(kvf_stage_batch_runs_floor(q.g(), &q.plan.p, q.r->get()), 256u) << "1024 blocks, none merging";
  std::iota(ids.begin(), ids.end(), 0u);
  EXPECT_LE(kvf_stage_batch_runs_floor(q.g(), &q.plan.p, q.r->get()), 64u) << "in order: a run a plane at most";
  q.r->objects[0] = nullptr;
  q.r->rebind();
  EXPECT_EQ(kvf_stage_batch_runs_floor(q.g(), &q.plan.p, q.r->get()), 0u) << "a missing object: no floor";
}

// The batch API's runs go in calls of `first`, then twice as many, the
// rest in one call once the next doubling would reach it; first 0 is one
// call. Every run is enqueued exactly once, whatever the count.
TEST(XferBatchRamp, CallsDoubleFromTheFirstAndTakeTheRestWhole) {
  auto calls = [](uint64_t runs, uint64_t first) {
    std::vector<uint64_t> v;
    for (uint64_t left = runs, k = 0; left > 0; k++) {
      uint64_t m = kvf_batch_ramp_runs(k, first, left);
      EXPECT_GE(m, 1u);
      EXPECT_LE(m, left);
      if (m == 0 || m > left) break;
      v.push_back(m);
      left -= m;
    }
    return v;
  };
  // The MLA chunk's 244 runs, the DCP rank's 61, the qwen3-like chunk's 84.
  EXPECT_EQ(calls(244, 8), (std::vector<uint64_t>{8, 16, 32, 64, 124}));
  EXPECT_EQ(calls(61, 8), (std::vector<uint64_t>{8, 16, 37}));
  EXPECT_EQ(calls(84, 8), (std::vector<uint64_t>{8, 16, 60}));
  EXPECT_EQ(calls(244, 0), (std::vector<uint64_t>{244}));
  EXPECT_EQ(calls(16, 8), (std::vector<uint64_t>{16})) << "no call of fewer runs than the one before";
  EXPECT_EQ(calls(17, 8), (std::vector<uint64_t>{8, 9}));
  EXPECT_EQ(calls(25, 8), (std::vector<uint64_t>{8, 17}));
  EXPECT_EQ(calls(1, 8), (std::vector<uint64_t>{1}));
  EXPECT_EQ(calls(3, 1), (std::vector<uint64_t>{1, 2}));
  EXPECT_EQ(calls(7, 1), (std::vector<uint64_t>{1, 2, 4}));
  for (uint64_t runs : {1u, 2u, 9u, 100u, 255u, 256u, 1000u, 65536u})
    for (uint64_t first : {0u, 1u, 3u, 8u, 64u, 1000u}) {
      std::vector<uint64_t> v = calls(runs, first);
      EXPECT_EQ(std::accumulate(v.begin(), v.end(), uint64_t{0}), runs) << runs << " runs, first " << first;
      for (size_t i = 1; i < v.size(); i++) EXPECT_GE(v[i], v[i - 1]) << runs << " runs, first " << first;
    }
  // Shifts that would leave 64 bits take the rest.
  EXPECT_EQ(kvf_batch_ramp_runs(63, 8, 1000), 1000u);
  EXPECT_EQ(kvf_batch_ramp_runs(62, 8, UINT64_MAX), UINT64_MAX);
  EXPECT_EQ(kvf_batch_ramp_runs(1, UINT64_MAX / 2 + 1, UINT64_MAX), UINT64_MAX);
}

// One call instead of a ramp only right after a comparable batch call whose
// host time per run, for this call's runs, outlasts this call's copies.
TEST(XferBatchRamp, OneCallRightAfterAHostBoundCall) {
  const uint64_t w = 20000;  // the window, ns
  // The previous call: 244 runs in 200 us of host time. This one: 244 runs
  // whose copies take 188 us (host-bound) or 327 us (the host keeps ahead).
  EXPECT_TRUE(kvf_batch_back_to_back(200000, 244, 1000000, 1000000, w, 244, 188000)) << "at once";
  EXPECT_TRUE(kvf_batch_back_to_back(200000, 244, 1000000, 1019999, w, 244, 188000));
  EXPECT_FALSE(kvf_batch_back_to_back(200000, 244, 1000000, 1020000, w, 244, 188000)) << "the window has passed";
  EXPECT_FALSE(kvf_batch_back_to_back(200000, 244, 1000000, 1000001, w, 244, 327000)) << "the host keeps ahead";
  EXPECT_FALSE(kvf_batch_back_to_back(200000, 244, 0, 5000, w, 244, 188000)) << "no batch call yet";
  EXPECT_FALSE(kvf_batch_back_to_back(200000, 244, 1000000, 1000001, 0, 244, 188000)) << "window 0: never";
  EXPECT_FALSE(kvf_batch_back_to_back(200000, 244, 1000000, 999999, w, 244, 188000))
      << "a call that came in before the last returned";
  // A small call's host time says nothing of a large one's: 8 runs in 15 us
  // (1.9 us a run) would call a 244-run chunk host-bound.
  EXPECT_FALSE(kvf_batch_back_to_back(15000, 8, 1000000, 1000001, w, 244, 327000)) << "not comparable";
  EXPECT_FALSE(kvf_batch_back_to_back(200000, 244, 1000000, 1000001, w, 100, 10)) << "not comparable";
  EXPECT_TRUE(kvf_batch_back_to_back(100000, 122, 1000000, 1000001, w, 244, 188000)) << "twice the runs: comparable";
  EXPECT_FALSE(kvf_batch_back_to_back(200000, 0, 1000000, 1000001, w, 244, 188000));
  EXPECT_TRUE(kvf_batch_back_to_back(200000, 244, UINT64_MAX - 5, UINT64_MAX, w, 244, 188000))
      << "times near the clock's end";
}

// A request is host-bound when the context's last batch call, of half to
// twice its runs, took more host time per run than this call's copies need.
TEST(XferBatchRamp, HostBoundWhenTheLastComparableCallOutlastsTheCopies) {
  // The fp8 MLA chunk on a slow host: 244 runs in 220 us against a 188 us copy.
  EXPECT_TRUE(kvf_batch_host_bound(220000, 244, 244, 188000));
  EXPECT_FALSE(kvf_batch_host_bound(110000, 244, 244, 188000)) << "a fast host keeps ahead";
  EXPECT_FALSE(kvf_batch_host_bound(188000, 244, 244, 188000)) << "as fast as the copies: not behind";
  EXPECT_TRUE(kvf_batch_host_bound(188001, 244, 244, 188000));
  // The bf16 MLA chunk's 327 us copy outlasts that host.
  EXPECT_FALSE(kvf_batch_host_bound(220000, 244, 244, 327000));
  // Scaled to this call's runs, and only from a comparable call.
  EXPECT_TRUE(kvf_batch_host_bound(110000, 122, 244, 188000)) << "half the runs, half the time";
  EXPECT_FALSE(kvf_batch_host_bound(110000, 122, 244, 221000));
  EXPECT_TRUE(kvf_batch_host_bound(440000, 488, 244, 188000)) << "twice the runs";
  EXPECT_FALSE(kvf_batch_host_bound(15000, 8, 244, 10)) << "8 runs say nothing of 244";
  EXPECT_FALSE(kvf_batch_host_bound(900000, 489, 244, 10)) << "just over twice the runs";
  EXPECT_FALSE(kvf_batch_host_bound(220000, 0, 244, 188000)) << "no batch call yet";
  EXPECT_FALSE(kvf_batch_host_bound(220000, 244, 0, 0)) << "no runs";
  EXPECT_TRUE(kvf_batch_host_bound(UINT64_MAX, UINT64_MAX / 2, UINT64_MAX / 2, UINT64_MAX / 4))
      << "no overflow near the limits";
}

// With the cost fixed (KVF_XFER_BATCH_STAGED_COST; the eighth was the rule
// for every call until 2026-12-04), a request goes staged for its host time
// only when both of the last two batch calls outlast its copies by more
// than that cost (thousandths of the copy time).
TEST(XferBatchRamp, HostBoundStagingNeedsTwoCallsPastTheStagedRoutesCost) {
  static_assert(KVF_BATCH_STAGED_COST_EIGHTH == 1125, "the figures below assume an eighth");
  const uint64_t prior = KVF_BATCH_STAGED_COST_EIGHTH;
  // The fp8 MLA chunk: a 188 us copy, 211.5 us with the staged route's cost.
  EXPECT_FALSE(kvf_batch_host_outlasts_staged(211500, 244, 211500, 244, 244, 188000, prior)) << "at the cost: batched";
  EXPECT_TRUE(kvf_batch_host_outlasts_staged(211501, 244, 211501, 244, 244, 188000, prior));
  EXPECT_FALSE(kvf_batch_host_outlasts_staged(200000, 244, 200000, 244, 244, 188000, prior))
      << "past the copies, short of the cost (the break-even of the d07af0f run)";
  EXPECT_FALSE(kvf_batch_host_outlasts_staged(240000, 244, 150000, 244, 244, 188000, prior)) << "one slow call";
  EXPECT_FALSE(kvf_batch_host_outlasts_staged(150000, 244, 240000, 244, 244, 188000, prior)) << "the other one";
  EXPECT_FALSE(kvf_batch_host_outlasts_staged(240000, 244, 0, 0, 244, 188000, prior)) << "only one batch call yet";
  EXPECT_TRUE(kvf_batch_host_outlasts_staged(120000, 122, 240000, 244, 244, 188000, prior)) << "scaled per run";
  EXPECT_FALSE(kvf_batch_host_outlasts_staged(UINT64_MAX, 244, UINT64_MAX, 244, 244, UINT64_MAX - 1, prior))
      << "a cost past 64 bits saturates: nothing outlasts it";
  EXPECT_FALSE(kvf_batch_host_outlasts_staged(UINT64_MAX, 244, UINT64_MAX, 244, 244, UINT64_MAX / 2,
                                              KVF_BATCH_MAX_STAGED_COST))
      << "the largest cost saturates too";
  EXPECT_TRUE(kvf_batch_host_outlasts_staged(UINT64_MAX, 244, UINT64_MAX, 244, 244, 100, KVF_BATCH_MAX_STAGED_COST))
      << "the largest cost of a tiny copy: 100 ms, which the largest host time outlasts";
}

// The batch route's latency alone follows the ramp: while the host keeps
// ahead of the copy engine (the paced calls grow 1.5-2 times) it is about the
// copy time and the calls' cost; past it the calls double, and the last
// one, half the runs, is copied after all the host time. The fp8 MLA chunk
// (244 runs, 186 us at 55 GB/s) measured 1.10-1.16x a memcpy at a host of
// 99-126 us and 1.56-1.61x at 206-215 (perf/results/
// 2026-12-04-h200-hostbound-measured, run 4).
TEST(XferBatchRamp, AloneLatencyFollowsTheRamp) {
  static_assert(KVF_BATCH_ALONE_CALL_NS == 2500, "the figures below assume 2.5 us a call");
  const uint64_t copy_ns = 10244096 / 55;
  const double fast = (double)kvf_batch_alone_latency(244, 8, 120000, copy_ns) / (double)copy_ns;
  EXPECT_GT(fast, 1.08) << "seven calls' cost";
  EXPECT_LT(fast, 1.15) << "the host keeps ahead";
  const double slow = (double)kvf_batch_alone_latency(244, 8, 206000, copy_ns) / (double)copy_ns;
  EXPECT_GT(slow, 1.55);
  EXPECT_LT(slow, 1.65) << "the host's 206 us, then half the runs copied";
  EXPECT_EQ(kvf_batch_alone_latency(244, 0, 206000, copy_ns), 206000 + copy_ns + KVF_BATCH_ALONE_CALL_NS)
      << "one call";
  EXPECT_EQ(kvf_batch_alone_latency(8, 8, 10000, 6000), 18500u) << "one call of the first's size";
  EXPECT_EQ(kvf_batch_alone_latency(0, 8, 10000, 6000), 0u);
  EXPECT_EQ(kvf_batch_alone_latency(244, 8, UINT64_MAX, copy_ns), UINT64_MAX) << "saturates";
  EXPECT_EQ(kvf_batch_alone_latency(UINT64_MAX, 8, UINT64_MAX, UINT64_MAX), UINT64_MAX) << "a short loop at any size";
  uint64_t before = 0;
  for (uint64_t host = 0; host <= 400000; host += 1000) {
    uint64_t lat = kvf_batch_alone_latency(244, 8, host, copy_ns);
    EXPECT_GE(lat, host > copy_ns ? host : copy_ns) << host;
    // The ramp's steps change with the host's rate: a faster host can make
    // a shape slower (this one by 5.4% of the copy at 96 us without the
    // calls' cost, which took more calls there), never by 10%.
    EXPECT_GE(lat + copy_ns / 10, before) << "about monotonic in the host time: " << host;
    before = lat;
  }
}

// A call alone goes staged when, at each of the last two batch calls' host
// time, the batch route's latency alone (calls' cost included) outlasts the
// staged route's (its copies at 1.01x plus 30 us for a gather, which has no
// straight part alone, 10 us for a scatter). The fp8 MLA chunk (186 us):
// at a host of 206 us d2h alone took 1.56x a memcpy batched (run 4 of
// 2026-12-04) and the fixed eighth (209.5 us) kept it batched; at 168-170
// us both directions measured 1.22-1.23x batched, and h2d at 150 us was
// faster staged (1.11-1.16x); without its straight part d2h alone staged
// took 1.11-1.23x (perf/results/2026-12-04-h200-straight-alone). A host
// well ahead of the copies keeps a gather batched (a tie, 1.10-1.16x either
// way) and a scatter too while its calls' cost stays under the staged
// route's fixed part.
TEST(XferBatchRamp, CallAloneWeighsBothRoutesLatency) {
  static_assert(KVF_BATCH_STAGED_ALONE_RATE == 1010 && KVF_BATCH_STAGED_ALONE_GATHER_NS == 30000 &&
                    KVF_BATCH_STAGED_ALONE_SCATTER_NS == 10000,
                "the figures below assume 1.01x plus 30 and 10 us");
  const uint64_t copy_ns = 10244096 / 55;
  const int gather = 1, scatter = 0;
  EXPECT_TRUE(kvf_batch_alone_outlasts_staged(206000, 244, 206000, 244, 244, 8, copy_ns, gather));
  EXPECT_FALSE(kvf_batch_host_outlasts_staged(206000, 244, 206000, 244, 244, copy_ns, KVF_BATCH_STAGED_COST_EIGHTH))
      << "the eighth kept it batched";
  EXPECT_TRUE(kvf_batch_alone_outlasts_staged(168000, 244, 168000, 244, 244, 8, copy_ns, gather));
  EXPECT_TRUE(kvf_batch_alone_outlasts_staged(170000, 244, 170000, 244, 244, 8, copy_ns, scatter));
  EXPECT_TRUE(kvf_batch_alone_outlasts_staged(150000, 244, 150000, 244, 244, 8, copy_ns, scatter));
  EXPECT_FALSE(kvf_batch_alone_outlasts_staged(80000, 244, 80000, 244, 244, 8, copy_ns, gather)) << "host ahead";
  EXPECT_FALSE(kvf_batch_alone_outlasts_staged(20000, 244, 20000, 244, 244, 8, copy_ns, scatter)) << "far ahead";
  EXPECT_FALSE(kvf_batch_alone_outlasts_staged(206000, 244, 60000, 244, 244, 8, copy_ns, gather)) << "one fast call";
  EXPECT_FALSE(kvf_batch_alone_outlasts_staged(60000, 244, 206000, 244, 244, 8, copy_ns, gather)) << "the other";
  EXPECT_FALSE(kvf_batch_alone_outlasts_staged(206000, 244, 0, 0, 244, 8, copy_ns, gather)) << "one batch call yet";
  EXPECT_TRUE(kvf_batch_alone_outlasts_staged(103000, 122, 206000, 244, 244, 8, copy_ns, gather)) << "scaled per run";
  EXPECT_FALSE(kvf_batch_alone_outlasts_staged(900000, 489, 900000, 489, 244, 8, copy_ns, gather)) << "not comparable";
  EXPECT_FALSE(kvf_batch_alone_outlasts_staged(5000, 8, 5000, 8, 8, 8, 6000, scatter)) << "8 runs: 13.5 us batched";
  EXPECT_TRUE(kvf_batch_host_outlasts_staged(10000, 8, 10000, 8, 8, 6000, KVF_BATCH_STAGED_COST_EIGHTH))
      << "where the eighth sent a host of 10 us staged";
  EXPECT_FALSE(kvf_batch_alone_outlasts_staged(10000, 8, 10000, 8, 8, 8, 6000, gather)) << "18.5 us batched";
  EXPECT_TRUE(kvf_batch_alone_outlasts_staged(30000, 8, 30000, 8, 8, 8, 6000, gather)) << "a host past 30 us more";
  EXPECT_TRUE(kvf_batch_alone_outlasts_staged(UINT64_MAX, 244, UINT64_MAX, 244, 244, 8, copy_ns, gather));
  EXPECT_FALSE(kvf_batch_alone_outlasts_staged(UINT64_MAX, 244, UINT64_MAX, 244, 244, 8, UINT64_MAX, gather))
      << "a copy past 64 bits: nothing outlasts the staged route's";
  // Long copies stay batched: a request whose 976 runs the host enqueues in
  // 0.9 ms of 41 ms of copies (XferGpu.HostBoundCallAloneWeighsBothRoutesLatency).
  EXPECT_FALSE(kvf_batch_alone_outlasts_staged(900000, 976, 900000, 976, 976, 8, 41000000, scatter));
  EXPECT_FALSE(kvf_batch_alone_outlasts_staged(900000, 976, 900000, 976, 976, 8, 41000000, gather));
}

// The lease of 2026-12-04 (perf/results/2026-12-04-h200-final): the staged
// route ran the fp8 MLA chunk d2h at 213.1 us a call back to back for a
// 187.7 us copy (1.135x), its batch calls took 203-217 us of host time, and
// the constant eighth (211 us) sent calls staged that the batch route moved
// in 196-200. Weighed against the cost the context measured, those calls
// stay batched; on a lease where the staged route ran at 1.03x, a host at
// 205 us goes staged, which the eighth had refused.
TEST(XferBatchRamp, HostBoundStagingWeighsTheMeasuredStagedCost) {
  const uint64_t copy_ns = 187700;
  const uint64_t slow_staged = kvf_staged_cost_sample(213100, copy_ns);
  EXPECT_EQ(slow_staged, 1135u);
  EXPECT_TRUE(kvf_batch_host_outlasts_staged(212000, 244, 213000, 244, 244, copy_ns, KVF_BATCH_STAGED_COST_EIGHTH))
      << "the constant eighth sent these staged";
  EXPECT_FALSE(kvf_batch_host_outlasts_staged(212000, 244, 213000, 244, 244, copy_ns, slow_staged))
      << "the measured cost keeps them batched";
  EXPECT_TRUE(kvf_batch_host_outlasts_staged(214000, 244, 217000, 244, 244, copy_ns, slow_staged))
      << "a host slower than the staged route still goes staged";
  const uint64_t fast_staged = kvf_staged_cost_sample(193300, copy_ns);
  EXPECT_EQ(fast_staged, 1029u);
  EXPECT_TRUE(kvf_batch_host_outlasts_staged(205000, 244, 205000, 244, 244, copy_ns, fast_staged));
  EXPECT_FALSE(kvf_batch_host_outlasts_staged(205000, 244, 205000, 244, 244, copy_ns, KVF_BATCH_STAGED_COST_EIGHTH));
}

// A span becomes thousandths of the copy time, bounded; the cost weighed back
// to back is the fixed one when set, else, once four measures are taken, the
// median of the last four, else the copy time itself (unmeasured: host-bound
// calls back to back take the staged route, and are measured, until then).
TEST(XferBatchRamp, StagedCostIsTheMedianOfFourMeasuresUnlessFixed) {
  EXPECT_EQ(kvf_staged_cost_sample(0, 188000), 0u) << "no span: no measure";
  EXPECT_EQ(kvf_staged_cost_sample(200000, 0), 0u) << "no copy time: no measure";
  EXPECT_EQ(kvf_staged_cost_sample(188000, 188000), 1000u);
  EXPECT_EQ(kvf_staged_cost_sample(1, UINT64_MAX), 1u) << "at least 1";
  EXPECT_EQ(kvf_staged_cost_sample(UINT64_MAX, 1), KVF_BATCH_MAX_STAGED_COST) << "at most the cap";
  EXPECT_EQ(kvf_staged_cost_sample(200000, 100), 2000000u) << "a span against an absurd link rate";

  static_assert(KVF_STAGED_COST_SAMPLES == 4, "the figures below assume four measures");
  static_assert(KVF_BATCH_STAGED_COST_UNMEASURED == 1000, "unmeasured: host-bound calls back to back try it");
  const uint64_t four[KVF_STAGED_COST_SAMPLES] = {1180, 1024, 1120, 1135};
  EXPECT_EQ(kvf_staged_cost_of(four, 0, 0), (uint64_t)KVF_BATCH_STAGED_COST_UNMEASURED) << "nothing measured yet";
  EXPECT_EQ(kvf_staged_cost_of(four, 3, 0), (uint64_t)KVF_BATCH_STAGED_COST_UNMEASURED)
      << "three measures are not enough: one high span would have been half of them";
  EXPECT_EQ(kvf_staged_cost_of(four, 4, 0), 1127u) << "the mean of the middle two";
  EXPECT_EQ(kvf_staged_cost_of(four, 9, 0), 1127u) << "more measures taken: the ring's four";
  const uint64_t one_long[KVF_STAGED_COST_SAMPLES] = {1020, 1030, 5000, 1025};
  EXPECT_EQ(kvf_staged_cost_of(one_long, 4, 0), 1027u) << "a span that waited for other work moves it little";
  const uint64_t one_short[KVF_STAGED_COST_SAMPLES] = {1140, 1130, 1, 1135};
  EXPECT_EQ(kvf_staged_cost_of(one_short, 4, 0), 1132u) << "nor does one short span";
  EXPECT_EQ(kvf_staged_cost_of(four, 4, 1125), 1125u) << "KVF_XFER_BATCH_STAGED_COST fixes it";
  EXPECT_EQ(kvf_staged_cost_of(four, 0, 1), 1u);
  const uint64_t huge[KVF_STAGED_COST_SAMPLES] = {UINT64_MAX, UINT64_MAX, UINT64_MAX, UINT64_MAX};
  EXPECT_EQ(kvf_staged_cost_of(huge, 4, 0), UINT64_MAX) << "no overflow in the mean of the middle two";
}

// A paced ramp's next call: what the host enqueues in the previous call's
// copy time, between 1.5 and 2 times the previous call, everything left
// once it fits that time or would leave under a quarter call behind.
TEST(XferBatchRamp, PacedCallsTakeWhatTheHostEnqueuesInTheCopyTime) {
  EXPECT_EQ(kvf_batch_ramp_next(8, 236, 1000, 10000), 16u) << "a fast host doubles";
  EXPECT_EQ(kvf_batch_ramp_next(8, 236, 10000, 10000), 12u) << "a host as slow as the copy grows by half";
  EXPECT_EQ(kvf_batch_ramp_next(8, 236, 20000, 10000), 16u) << "a slower host doubles: fewer calls cost it less";
  EXPECT_EQ(kvf_batch_ramp_next(64, 120, 20000, 10000), 120u) << "... and takes the rest as doubling does";
  EXPECT_EQ(kvf_batch_ramp_next(8, 236, 10000, 14000), 12u);
  EXPECT_EQ(kvf_batch_ramp_next(8, 236, 10000, 17500), 14u) << "in between: what fits the copy time";
  EXPECT_EQ(kvf_batch_ramp_next(64, 124, 20000, 86000), 124u) << "the rest fits the copy time";
  EXPECT_EQ(kvf_batch_ramp_next(64, 118, 60000, 86000), 118u) << "the rest leaves under a quarter call";
  EXPECT_EQ(kvf_batch_ramp_next(64, 200, 60000, 86000), 96u);
  EXPECT_EQ(kvf_batch_ramp_next(8, 5, 10000, 1000), 5u) << "never more than is left";
  EXPECT_EQ(kvf_batch_ramp_next(8, 100, 0, 1000), 100u) << "an unmeasurably fast host takes the rest";
  EXPECT_EQ(kvf_batch_ramp_next(0, 100, 1000, 1000), 2u) << "from 0 runs as from 1";
  EXPECT_EQ(kvf_batch_ramp_next(8, 0, 1000, 1000), 0u);
  EXPECT_EQ(kvf_batch_ramp_next(UINT64_MAX - 5, UINT64_MAX, UINT64_MAX, 1), UINT64_MAX)
      << "steps that would wrap take the rest";
  EXPECT_EQ(kvf_batch_ramp_next(UINT64_MAX / 2 + 7, UINT64_MAX, 1, 1), UINT64_MAX / 2 + 7 + UINT64_MAX / 4 + 4);
  EXPECT_EQ(kvf_batch_ramp_next(1, UINT64_MAX, 1, UINT64_MAX), UINT64_MAX);
  EXPECT_EQ(kvf_batch_ramp_next(UINT64_MAX / 2 + 7, UINT64_MAX, UINT64_MAX, 0), UINT64_MAX);
}

// The ramp against a model of an idle stream (host: c + h a run per call;
// copy engine: each call's runs after the call returns and after the
// previous ones, d + e a run): on a host at 0.8 us a run (the H200 machine
// on a slow day) doubling left the copy engine idle between calls and the
// paced ramp does not; on a host at 0.3 us a run the paced ramp makes the
// doubling's calls. The MLA chunk: 244 runs of 72 KiB, e = 1.34 us at 55
// GB/s.
TEST(XferBatchRamp, PacedRampKeepsTheCopyEngineBusyOnASlowHost) {
  const double c = 3, d = 1, e = 72.0 * 1024 / 55e3; // us
  auto finish = [&](double h, bool paced, int *calls) {
    double host = 0, engine = 0;
    uint64_t left = 244, m = 0, host_ns = 0, engine_ns = 0;
    *calls = 0;
    for (uint64_t k = 0; left > 0; k++) {
      m = k > 0 && paced ? kvf_batch_ramp_next(m, left, host_ns, engine_ns) : kvf_batch_ramp_runs(k, 8, left);
      double took = c + h * (double)m;
      host += took;
      engine = std::max(engine, host) + d + e * (double)m;
      host_ns = (uint64_t)(took * 1e3);
      engine_ns = (uint64_t)(e * (double)m * 1e3);
      left -= m;
      ++*calls;
    }
    return engine;
  };
  int calls_doubling = 0, calls_paced = 0;
  double slow_doubling = finish(0.8, false, &calls_doubling), slow_paced = finish(0.8, true, &calls_paced);
  double bound = c + 8 * 0.8 + 244 * e; // the first call's host time, then the copy alone
  EXPECT_GT(slow_doubling - bound, 25.0) << "the model shows doubling's idle copy engine";
  EXPECT_LT(slow_paced - bound, 12.0) << "paced: " << slow_paced << " us, " << calls_paced << " calls";
  double fast_doubling = finish(0.3, false, &calls_doubling), fast_paced = finish(0.3, true, &calls_paced);
  EXPECT_EQ(calls_paced, calls_doubling);
  EXPECT_LE(fast_paced, fast_doubling + 0.01);
}

// Piece shares grow 1:2:4 for a gather (its first kernel is the part the
// copy engine waits for) and shrink for a scatter.
TEST(XferPieces, GatherPiecesGrowScatterPiecesShrink) {
  PlannedRequest q;
  ASSERT_NO_FATAL_FAILURE(plan_chunks("deepseek-v3-mla-bf16", 1, 0, 17, &q));
  const kvf_geometry *g = q.g();
  const PlanHolder &plan = q.plan;
  const Req &r = *q.r;
  const uint32_t ns = plan.p.num_segments;
  ASSERT_EQ(ns, 61u);
  for (int gather : {1, 0}) {
    SCOPED_TRACE(gather ? "gather" : "scatter");
    std::vector<unsigned char> masks(4 * ns);
    ASSERT_EQ(kvf_stage_piece_masks(g, &plan.p, r.get(), gather, 4, masks.data()), 4u);
    std::vector<int> count(4, 0);
    for (uint32_t p = 0; p < 4; p++)
      for (uint32_t i = 0; i < ns; i++) count[p] += masks[p * ns + i];
    for (uint32_t p = 0; p + 1 < 4; p++) {
      if (gather) {
        EXPECT_LT(count[p], count[p + 1]) << "piece " << p;
      } else {
        EXPECT_GT(count[p], count[p + 1]) << "piece " << p;
      }
    }
    EXPECT_LE(gather ? count[0] : count[3], 61 / 15 + 1) << "the exposed piece holds about a fifteenth";
    // Growth 8 over 3 pieces: 1:8:64 of 61 layers, the exposed one a single layer.
    std::vector<unsigned char> m8(3 * ns);
    ASSERT_EQ(kvf_stage_piece_masks_growth(g, &plan.p, r.get(), gather, 3, 8, m8.data()), 3u);
    std::vector<int> c8(3, 0);
    for (uint32_t p = 0; p < 3; p++)
      for (uint32_t i = 0; i < ns; i++) c8[p] += m8[p * ns + i];
    EXPECT_EQ(c8[0] + c8[1] + c8[2], 61);
    EXPECT_EQ(gather ? c8[0] : c8[2], 1) << "the exposed piece";
    EXPECT_LE(std::abs(c8[1] - 61 * 8 / 73), 1);
    // Growth 1: equal pieces.
    ASSERT_EQ(kvf_stage_piece_masks_growth(g, &plan.p, r.get(), gather, 3, 1, m8.data()), 3u);
    for (uint32_t p = 0; p < 3; p++) {
      int n = 0;
      for (uint32_t i = 0; i < ns; i++) n += m8[p * ns + i];
      EXPECT_LE(std::abs(n - 61 / 3), 1) << "piece " << p;
    }
  }
  // More pieces than views: one view each.
  std::vector<unsigned char> masks(16 * ns);
  PlannedRequest one;
  ASSERT_NO_FATAL_FAILURE(plan_chunks("glm-like-hybrid", 1, 0, 19, &one));
  const kvf_plan &p1 = one.plan.p;
  std::vector<unsigned char> m1(16 * p1.num_segments);
  uint32_t views = 0;
  for (uint32_t i = 0; i < p1.num_segments; i++) views += i == 0 || p1.segments[i].view != p1.segments[i - 1].view;
  EXPECT_EQ(kvf_stage_piece_masks(one.g(), &p1, one.r->get(), 1, 16, m1.data()), std::min<uint32_t>(views, 16));
}

// Pieces weigh the bytes they move. A hybrid's recurrent state is one per
// chunk while each attention layer moves a chunk's tokens: weighed as bytes
// per token (as before), a glm-like state (38 KiB) outweighed a 512 KiB
// layer 19 to 1, and a scatter's last pieces were one state each
// (perf/results/2026-12-03-h200-cap4-straight, the timelines). On one chunk
// (glm-like's sliding window is longer, so every group moves all of it) each
// boundary between pieces, in bytes from the planner's own blob of their
// segments, is within one view of where the shares put it.
TEST(XferPieces, PiecesWeighTheBytesTheyMove) {
  PlannedRequest q;
  ASSERT_NO_FATAL_FAILURE(plan_chunks("glm-like-hybrid", 1, 0, 23, &q));
  const kvf_plan &plan = q.plan.p;
  const uint32_t ns = plan.num_segments;
  auto bytes_of = [&](const unsigned char *mask, int gather) {
    kvf_blob_opts o = {0, mask, 0};
    std::vector<uint8_t> blob = build_blob(q.g(), plan, q.r->get(), gather, &o);
    return reinterpret_cast<const kvf_blob_header *>(blob.data())->payload_bytes;
  };
  uint64_t largest_view = 0;
  for (uint32_t i = 0; i < ns;) {
    std::vector<unsigned char> view(ns, 0);
    uint32_t j = i;
    while (j < ns && plan.segments[j].view == plan.segments[i].view) view[j++] = 1;
    largest_view = std::max<uint64_t>(largest_view, bytes_of(view.data(), 1));
    i = j;
  }
  std::vector<unsigned char> all(ns, 1);
  const uint64_t total = bytes_of(all.data(), 1);
  for (int gather : {1, 0})
    for (uint32_t pieces : {2u, 4u}) {
      const uint32_t growth = pieces == 2 ? 4 : 2;
      SCOPED_TRACE(std::string(gather ? "gather" : "scatter") + ", " + std::to_string(pieces) + " pieces");
      std::vector<unsigned char> masks(pieces * ns);
      ASSERT_EQ(kvf_stage_piece_masks_growth(q.g(), &plan, q.r->get(), gather, pieces, growth, masks.data()), pieces);
      double sum = 0, share[4];
      for (uint32_t p = 0; p < pieces; p++) {
        uint32_t e = gather ? p : pieces - 1 - p;
        share[p] = std::pow((double)growth, (double)e);
        sum += share[p];
      }
      double before = 0, got_before = 0;
      for (uint32_t p = 0; p < pieces; p++) {
        uint64_t got = bytes_of(&masks[(size_t)p * ns], gather);
        before += (double)total * share[p] / sum;
        got_before += (double)got;
        // Each boundary lands within one view of where the shares put it.
        EXPECT_LE(std::abs(got_before - before), (double)largest_view) << "after piece " << p << " (" << got << " bytes)";
      }
      EXPECT_EQ(got_before, (double)total);
    }
}

// The memo of the piece split and the straight pick (kvf_stage_*_memo) answers
// as the two steps do, byte for byte, on six presets (a sliding window,
// recurrent states and a DCP rank among them). Hits: the same question again, and the next
// chunk of a sequence where every group is full attention (another place and
// other block ids, the same blocks counted). Misses: a request a block
// shorter, a token shorter, as many tokens with a table a block shorter at
// its start, the other direction, other pieces or growth, a pick with
// another target. More questions than slots evict. A random walk
// of 300 questions over token ranges and parameters never differs from the
// steps themselves.
TEST(XferPieces, PlanMemoAnswersAsTheStepsDo) {
  for (const char *preset : {"llama-3.1-8b-fa-hnd", "glm-like-hybrid", "gpt-oss-20b-like", "qwen3-next-like-hybrid",
                             "llama-3.1-70b-tp4-rank2-slice", "deepseek-v3-mla-dcp4-rank1"}) {
    SCOPED_TRACE(preset);
    PlannedRequest q;
    ASSERT_NO_FATAL_FAILURE(plan_chunks(preset, 3, 0, 91, &q));
    const kvf_geometry *g = q.g();
    const kvf_plan &plan = q.plan.p;
    const size_t ns = plan.num_segments;
    kvf_object_policy pol = KVF_OBJECT_POLICY_INIT;
    kvf_geometry_policy(g, &pol);
    const uint64_t chunk = pol.chunk_tokens;
    bool all_full = true;
    uint64_t block = chunk; // the smallest block size of an attention group
    for (uint32_t gi = 0; gi < kvf_geometry_num_groups(g); gi++) {
      kvf_group_info info = KVF_GROUP_INFO_INIT;
      kvf_geometry_group(g, gi, &info);
      all_full = all_full && info.kind == KVF_GROUP_FULL;
      if (info.kind != KVF_GROUP_RECURRENT) block = std::min<uint64_t>(block, info.block_size);
    }
    const kvf_copy_request whole = *q.r->get();
    ASSERT_EQ(whole.token_end - whole.token_begin, 3 * chunk);
    auto tokens = [&](uint64_t from, uint64_t to) {
      kvf_copy_request r = whole;
      r.token_begin = whole.token_begin + from;
      r.token_end = whole.token_begin + to;
      return r;
    };
    struct Ask {
      bool pick;
      int gather;
      uint32_t pieces, growth;
      uint64_t target, limit;
    };
    kvf_memo memo{};
    uint64_t hits = 0, misses = 0;
    // want: 1 a hit, 0 a miss, -1 either.
    auto expect_same = [&](const kvf_copy_request &r, const Ask &a, int want, const std::string &what) {
      SCOPED_TRACE(what);
      ASSERT_EQ(kvf_copy_request_check(g, &r), KVF_SUCCESS) << kvf_last_error();
      std::vector<unsigned char> direct(KVF_STAGE_MAX_PIECES * ns + 1, 0xAB), got(direct);
      if (a.pick) {
        uint64_t d = kvf_stage_straight_pick(g, &plan, &r, !a.gather, 16384, a.target, a.limit, 128, direct.data());
        uint64_t m = kvf_stage_straight_pick_memo(&memo, g, &plan, &r, !a.gather, 16384, a.target, a.limit, 128,
                                                  got.data());
        EXPECT_EQ(m, d);
      } else {
        uint32_t d = kvf_stage_piece_masks_growth(g, &plan, &r, a.gather, a.pieces, a.growth, direct.data());
        uint32_t m = kvf_stage_piece_masks_memo(&memo, g, &plan, &r, a.gather, a.pieces, a.growth, got.data());
        EXPECT_EQ(m, d);
      }
      EXPECT_TRUE(got == direct) << "the bytes written differ";
      if (want >= 0) {
        EXPECT_EQ(memo.hits, hits + (uint64_t)want);
        EXPECT_EQ(memo.misses, misses + (uint64_t)(1 - want));
      }
      hits = memo.hits;
      misses = memo.misses;
    };
    const Ask masks{false, 1, 2, 4, 0, 0}, pick{true, 1, 0, 0, 2u << 20, 64u << 20};
    const kvf_copy_request first = tokens(0, chunk);
    for (const Ask &a : {masks, pick}) {
      const std::string kind = a.pick ? "pick: " : "masks: ";
      ASSERT_NO_FATAL_FAILURE(expect_same(first, a, 0, kind + "first"));
      ASSERT_NO_FATAL_FAILURE(expect_same(first, a, 1, kind + "again"));
      if (all_full) {
        // The next chunk with its own blocks: only the counts are asked.
        kvf_copy_request next = tokens(chunk, 2 * chunk);
        ASSERT_NO_FATAL_FAILURE(expect_same(next, a, 1, kind + "the next chunk"));
      }
      ASSERT_NO_FATAL_FAILURE(expect_same(tokens(0, chunk - block), a, 0, kind + "a block shorter"));
      ASSERT_NO_FATAL_FAILURE(expect_same(tokens(0, chunk - 1), a, 0, kind + "a token shorter"));
      {
        // As many tokens, the first group's table a block shorter at its start.
        std::vector<kvf_group_blocks> groups(whole.groups, whole.groups + kvf_geometry_num_groups(g));
        groups[0].first_block += 1;
        groups[0].block_ids += 1;
        groups[0].count -= 1;
        kvf_copy_request r = first;
        r.groups = groups.data();
        ASSERT_NO_FATAL_FAILURE(expect_same(r, a, 0, kind + "a table a block shorter"));
      }
      Ask other = a;
      other.gather = 0;
      ASSERT_NO_FATAL_FAILURE(expect_same(first, other, 0, kind + "the other direction"));
      other = a;
      if (a.pick)
        other.target *= 2;
      else
        other.pieces = 3;
      ASSERT_NO_FATAL_FAILURE(expect_same(first, other, 0, kind + "other parameters"));
      if (!a.pick) {
        other = a;
        other.growth = 2;
        ASSERT_NO_FATAL_FAILURE(expect_same(first, other, 0, kind + "another growth"));
      }
    }
    // More questions than slots: the first one asked is gone.
    for (uint32_t k = 0; k < KVF_MEMO_SLOTS; k++) {
      Ask a = pick;
      a.target = (uint64_t)(k + 16) << 20; // targets asked nowhere else
      ASSERT_NO_FATAL_FAILURE(expect_same(first, a, 0, "eviction"));
    }
    ASSERT_NO_FATAL_FAILURE(expect_same(first, masks, 0, "evicted"));
    // A random walk: token ranges, directions, pieces, growths and targets.
    std::mt19937_64 rng(4321);
    const uint64_t hits_before = memo.hits;
    std::vector<kvf_group_blocks> clipped(whole.groups, whole.groups + kvf_geometry_num_groups(g));
    for (int step = 0; step < 300; step++) {
      // A request begins on a chunk; half of them are one chunk, as engines move them.
      uint64_t from = rng() % 3 * chunk, to = rng() % 2 ? from + chunk : from + 1 + rng() % (3 * chunk - from);
      kvf_copy_request r = tokens(from, to);
      const uint32_t gi = (uint32_t)(rng() % clipped.size()), later = (uint32_t)(rng() % 3);
      clipped[gi] = whole.groups[gi]; // a table starting up to two blocks later
      if (clipped[gi].count > later) {
        clipped[gi].first_block += later;
        clipped[gi].block_ids += later;
        clipped[gi].count -= later;
      }
      r.groups = clipped.data();
      Ask a{rng() % 2 == 0, (int)(rng() % 2), 1 + (uint32_t)(rng() % 5), 1 + (uint32_t)(rng() % 4),
            (uint64_t)(1 + rng() % 4) << 20, (uint64_t)(2 + rng() % 8) << 20};
      ASSERT_NO_FATAL_FAILURE(expect_same(r, a, -1, "random step " + std::to_string(step)));
    }
    EXPECT_GT(memo.hits, hits_before);
    kvf_memo_free(&memo);
  }
}

// The injection hook belongs to the staged route: the host backend has no
// batches, and a host context has no staging or internal stream.
TEST(XferHost, TheStagedFailureHookLeavesTheHostBackendAlone) {
  Prepared s;
  ASSERT_NO_FATAL_FAILURE(setup_chunks("llama-3.1-8b-fa-nhd", 1, 0, 13, &s));
  const kvf_geometry *g = s.g();
  std::mt19937_64 rng(14);
  Data in = make_inputs(g, s.plan, Dir::Gather, 0, rng), want = clone(in);
  ASSERT_EQ(reference(g, s.plan, KVF_FORMAT_CANONICAL, Dir::Gather, want), KVF_SUCCESS) << kvf_last_error();
  XferPtr x = make_xfer(g, KVF_DEVICE_HOST, 2);
  ASSERT_TRUE(x);
  EXPECT_EQ(kvf_xfer_test_stage_bytes(x.get()), 0u);
  EXPECT_EQ(kvf_xfer_test_ce_stream(x.get()), nullptr);
  kvf_xfer_test_fail_at_batch(0);
  Req r(s.plan, KVF_FORMAT_CANONICAL, payloads(in.cache), payloads(in.objs));
  kvf_status st = kvf_xfer_gather(x.get(), r.get(), nullptr);
  kvf_xfer_test_fail_at_batch(-1);
  ASSERT_EQ(st, KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(diff("object", in.objs, want.objs), "");
}

// ---- GPU -----------------------------------------------------------------------

#if KVF_WITH_CUDA

#define CUDA_OK(expr)                                                                         \
  do {                                                                                        \
    cudaError_t e_ = (expr);                                                                  \
    ASSERT_EQ(e_, cudaSuccess) << #expr << ": " << cudaGetErrorName(e_) << " " << cudaGetErrorString(e_); \
  } while (0)

// Why the GPU cases cannot run here, or "" when they can.
const std::string &gpu_unavailable() {
  static const std::string why = [] {
    kvf_cuda_info info = KVF_CUDA_INFO_INIT;
    kvf_status st = kvf_cuda_probe(&info);
    if (st != KVF_SUCCESS) return std::string("no usable GPU (kvf_cuda_probe: ") + kvf_status_string(st) + ": " + info.message + ")";
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0) return std::string("no usable GPU (cudaGetDeviceCount: ") + cudaGetErrorString(e) + ")";
    return std::string();
  }();
  return why;
}

#define REQUIRE_GPU()                                        \
  do {                                                       \
    if (!gpu_unavailable().empty()) GTEST_SKIP() << gpu_unavailable(); \
  } while (0)

// Why peer cases cannot run, or "" once device 0 can reach device 1's memory.
const std::string &peer_unavailable() {
  static const std::string why = [] {
    if (!gpu_unavailable().empty()) return gpu_unavailable();
    int n = 0;
    cudaGetDeviceCount(&n);
    if (n < 2) return std::string("peer cases need two GPUs; this machine has ") + std::to_string(n);
    int can = 0;
    cudaDeviceCanAccessPeer(&can, 0, 1);
    if (!can) return std::string("device 0 cannot access device 1's memory (no P2P between them)");
    int prev = 0;
    cudaGetDevice(&prev);
    cudaSetDevice(0);
    cudaError_t e = cudaDeviceEnablePeerAccess(1, 0);
    cudaSetDevice(prev);
    if (e != cudaSuccess && e != cudaErrorPeerAccessAlreadyEnabled)
      return std::string("cudaDeviceEnablePeerAccess(1): ") + cudaGetErrorString(e);
    cudaGetLastError();
    return std::string();
  }();
  return why;
}

#define REQUIRE_PEER()                                          \
  do {                                                          \
    if (!peer_unavailable().empty()) GTEST_SKIP() << peer_unavailable(); \
  } while (0)

enum class Mem { Device, Pinned, Peer, Registered, Pageable };

const char *mem_name(Mem m) {
  switch (m) {
    case Mem::Device: return "device";
    case Mem::Pinned: return "pinned";
    case Mem::Peer: return "peer";
    case Mem::Registered: return "registered";
    case Mem::Pageable: return "pageable";
  }
  return "?";
}

// A mirror of one GBuf in memory of some kind: the same total size, the
// payload at the same offset, the base aligned like the host copy.
struct DevBuf {
  Mem kind = Mem::Device;
  void *raw = nullptr;
  uint8_t *base = nullptr;
  size_t total = 0, lead = 0, size = 0, raw_size = 0;
  DevBuf() = default;
  DevBuf(const DevBuf &) = delete;
  DevBuf &operator=(const DevBuf &) = delete;
  ~DevBuf() {
    if (!raw) return;
    switch (kind) {
      case Mem::Device:
      case Mem::Peer: cudaFree(raw); break;
      case Mem::Pinned: cudaFreeHost(raw); break;
      case Mem::Registered:
        cudaHostUnregister(raw);
        std::free(raw);
        break;
      case Mem::Pageable: std::free(raw); break;
    }
  }
  uint8_t *payload() const { return size ? base + lead : nullptr; }
};

struct DevSet {
  std::vector<std::unique_ptr<DevBuf>> bufs;
  std::vector<void *> payloads() const {
    std::vector<void *> v;
    for (const auto &b : bufs) v.push_back(b->payload());
    return v;
  }
};

// Allocate a mirror of `s` in memory of kind `kind` (on `device` for device
// kinds) and copy `s` into it.
void upload_new(const Set &s, Mem kind, int device, DevSet *out) {
  out->bufs.clear();
  for (const GBuf &h : s) {
    auto b = std::make_unique<DevBuf>();
    b->kind = kind;
    b->total = h.total();
    b->lead = h.lead;
    b->size = h.size;
    if (b->total) {
      size_t align = h.align;
      b->raw_size = (b->total + align - 1) / align * align + align;
      switch (kind) {
        case Mem::Device:
        case Mem::Peer: {
          int prev = 0;
          CUDA_OK(cudaGetDevice(&prev));
          CUDA_OK(cudaSetDevice(device));
          cudaError_t e = cudaMalloc(&b->raw, b->raw_size);
          CUDA_OK(cudaSetDevice(prev));
          CUDA_OK(e);
          break;
        }
        case Mem::Pinned: CUDA_OK(cudaHostAlloc(&b->raw, b->raw_size, cudaHostAllocMapped | cudaHostAllocPortable)); break;
        case Mem::Registered:
          b->raw = std::aligned_alloc(4096, (b->raw_size + 4095) / 4096 * 4096);
          ASSERT_NE(b->raw, nullptr);
          CUDA_OK(cudaHostRegister(b->raw, (b->raw_size + 4095) / 4096 * 4096, cudaHostRegisterPortable));
          break;
        case Mem::Pageable:
          b->raw = std::aligned_alloc(4096, (b->raw_size + 4095) / 4096 * 4096);
          ASSERT_NE(b->raw, nullptr);
          break;
      }
      uintptr_t p = reinterpret_cast<uintptr_t>(b->raw);
      b->base = reinterpret_cast<uint8_t *>((p + align - 1) / align * align);
      CUDA_OK(cudaMemcpy(b->base, h.bytes(), b->total, cudaMemcpyDefault));
    }
    out->bufs.push_back(std::move(b));
  }
}

void upload(const Set &s, const DevSet &d) {
  for (size_t i = 0; i < s.size(); i++)
    if (s[i].total()) CUDA_OK(cudaMemcpy(d.bufs.at(i)->base, s[i].bytes(), s[i].total(), cudaMemcpyDefault));
}

void download(const DevSet &d, Set &s) {
  for (size_t i = 0; i < s.size(); i++)
    if (s[i].total()) CUDA_OK(cudaMemcpy(s[i].bytes(), d.bufs.at(i)->base, s[i].total(), cudaMemcpyDefault));
}

struct Stream {
  cudaStream_t s = nullptr;
  Stream() {
    cudaSetDevice(0);
    EXPECT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  }
  ~Stream() {
    if (s) cudaStreamDestroy(s);
  }
  Stream(const Stream &) = delete;
  Stream &operator=(const Stream &) = delete;
};

// Where a GPU case's buffers live and what the call should report.
struct GpuConfig {
  Mem cache_kind = Mem::Device;
  Mem obj_kind = Mem::Device;
  int cache_device = 0, obj_device = 0;
  uint32_t max_sms = 0;
  bool legacy_stream = false;  // pass NULL (the legacy default stream)
  double busy_ms = 0;          // a spin kernel this long on the stream before the call
  int calls = 1;               // the call this many times, each after the last one's stream sync
  bool sync_each = true;       // false: the calls back to back, one sync after the last
  bool deferred = false;       // each call deferred (after the stream's work), then joined into the stream
  bool check_route = true;
  kvf_xfer_route route = KVF_ROUTE_D2D;
  // Applied to the context's tuning before the call (host/core/xfer_internal.h).
  std::function<void(kvf_xfer_tuning &)> tune;
  // Checked against kvf_xfer_last_path after the call.
  std::function<void(const kvf_xfer_path_info &)> check_path;
  // Checked against kvf_xfer_last_path after each of the calls (0-based).
  std::function<void(int, const kvf_xfer_path_info &)> check_each;
  // Run before each of the calls (0-based), after the busy spin of the first.
  std::function<void(int, kvf_xfer *, cudaStream_t)> before_each;
  // An event recorded on the stream right before each call, as a caller
  // timing it does: the stream is busy for the few us the GPU takes to
  // complete it.
  bool event_before_call = false;
  // The plan of call i when not the case's (nullptr: the case's). The bytes
  // are checked after the last call, which must use the case's plan, and
  // only a gather's are then the reference's: earlier scatters of another
  // plan leave their blocks written.
  std::function<const Plan *(int)> plan_for_call;
  // Each call on a stream of its own, created right before it (the one
  // before destroyed once synchronized): CUDA may hand a new stream the
  // destroyed one's handle.
  bool new_stream_each_call = false;
};

// Whether an uncapped device-to-device launch overlaps the previous kernel
// here (KVF_XFER_OVERLAP): compute capability 9.0 and the variable not 0.
bool overlap_expected() {
  int major = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  const char *env = std::getenv("KVF_XFER_OVERLAP");
  return major >= 9 && !(env && std::strcmp(env, "0") == 0);
}

kvf_xfer_route expected_route(Mem obj, Dir dir) {
  switch (obj) {
    case Mem::Device: return KVF_ROUTE_D2D;
    case Mem::Peer: return KVF_ROUTE_PEER;
    default: return dir == Dir::Gather ? KVF_ROUTE_D2H : KVF_ROUTE_H2D;
  }
}

int device_of(Mem m, int requested) { return m == Mem::Peer ? 1 : requested; }

// Runs one GPU case: inputs uploaded, one kvf_xfer call on device 0, the
// request's arrays scrubbed right after it returns, one stream sync, whole
// buffers downloaded and compared with the reference run on the host copy.
void run_gpu_case(const kvf_geometry *g, const Plan &p, kvf_object_format fmt, Dir dir, size_t misalign,
                  uint64_t seed, const GpuConfig &cfg, kvf_xfer_stats *stats_out = nullptr) {
  std::mt19937_64 rng(seed);
  Data in = make_inputs(g, p, dir, misalign, rng);
  Data want = clone(in);
  ASSERT_EQ(reference(g, p, fmt, dir, want), KVF_SUCCESS) << kvf_last_error();
  uint64_t payload = plan_payload(g, p);
  ASSERT_GT(payload, 0u);

  CUDA_OK(cudaSetDevice(0));
  DevSet dcache, dobjs;
  ASSERT_NO_FATAL_FAILURE(upload_new(in.cache, cfg.cache_kind, device_of(cfg.cache_kind, cfg.cache_device), &dcache));
  ASSERT_NO_FATAL_FAILURE(upload_new(in.objs, cfg.obj_kind, device_of(cfg.obj_kind, cfg.obj_device), &dobjs));
  ASSERT_FALSE(cfg.new_stream_each_call && cfg.legacy_stream) << "one stream or the other";
  ASSERT_TRUE(!cfg.plan_for_call || dir == Dir::Gather) << "another plan's scatter writes blocks the check would see";
  XferPtr x = make_xfer(g, 0, 0, cfg.max_sms);
  ASSERT_TRUE(x);
  if (cfg.tune) {
    kvf_xfer_tuning t;
    kvf_xfer_get_tuning(x.get(), &t);
    cfg.tune(t);
    ASSERT_EQ(kvf_xfer_set_tuning(x.get(), &t), KVF_SUCCESS) << kvf_last_error();
  }
  auto stream = std::make_unique<Stream>();
  cudaStream_t s = cfg.legacy_stream ? nullptr : stream->s;
  cudaEvent_t before_call = nullptr;
  if (cfg.event_before_call) CUDA_OK(cudaEventCreate(&before_call));
  struct EventGuard {
    cudaEvent_t e;
    ~EventGuard() {
      if (e) cudaEventDestroy(e);
    }
  } before_call_guard{before_call};

  for (int i = 0; i < cfg.calls; i++) {  // the same copy again: the same bytes land
    if (cfg.new_stream_each_call && i > 0) {
      CUDA_OK(cudaStreamSynchronize(s));
      const cudaStream_t destroyed = s;
      stream.reset();
      stream = std::make_unique<Stream>();
      s = stream->s;
      if (s == destroyed) std::printf("call %d: the new stream has the destroyed one's handle\n", i);
    }
    if (cfg.busy_ms > 0 && i == 0) CUDA_OK(kvf_test_spin(s, cfg.busy_ms));
    if (cfg.before_each) {
      ASSERT_NO_FATAL_FAILURE(cfg.before_each(i, x.get(), s));
    }
    const Plan *call_plan = cfg.plan_for_call ? cfg.plan_for_call(i) : nullptr;
    if (i + 1 == cfg.calls) {
      ASSERT_EQ(call_plan, nullptr) << "the last call checks the case's plan";
    }
    auto r = std::make_unique<Req>(call_plan ? *call_plan : p, fmt, dcache.payloads(), dobjs.payloads());
    if (before_call) CUDA_OK(cudaEventRecord(before_call, s));
    uint64_t ticket = 0;
    kvf_status st = cfg.deferred ? call_deferred(x.get(), dir, r->get(), s, &ticket) : call(x.get(), dir, r->get(), s);
    r->scrub();
    r.reset();
    ASSERT_EQ(st, KVF_SUCCESS) << kvf_last_error();
    if (cfg.deferred) {
      ASSERT_EQ(kvf_xfer_join(x.get(), ticket, s), KVF_SUCCESS) << kvf_last_error();
    }
    if (cfg.check_each) {
      kvf_xfer_path_info each;
      kvf_xfer_last_path(x.get(), &each);
      cfg.check_each(i, each);
    }
    if (cfg.sync_each || i + 1 == cfg.calls) CUDA_OK(cudaStreamSynchronize(s));
    CUDA_OK(cudaGetLastError());
  }

  Data got = clone(in);
  ASSERT_NO_FATAL_FAILURE(download(dcache, got.cache));
  ASSERT_NO_FATAL_FAILURE(download(dobjs, got.objs));
  EXPECT_EQ(diff("cache region", got.cache, want.cache), "");
  EXPECT_EQ(diff("object", got.objs, want.objs), "");

  kvf_xfer_stats st_out = stats_of(x.get());
  if (cfg.check_route) {
    EXPECT_EQ(st_out.route, cfg.route) << "got " << kvf_xfer_route_name(st_out.route) << ", want "
                                       << kvf_xfer_route_name(cfg.route);
  }
  EXPECT_EQ(st_out.payload_bytes, payload);
  kvf_xfer_path_info path;
  kvf_xfer_last_path(x.get(), &path);
  if (path.path == KVF_PATH_COPY_BATCH) {
    EXPECT_EQ(st_out.sms, 0u) << "the copy-engine batch route uses no SM";
  } else {
    EXPECT_GE(st_out.sms, 1u);
  }
  EXPECT_GE(st_out.tasks, 1u);
  if (cfg.check_path) cfg.check_path(path);
  if (stats_out) *stats_out = st_out;
}

struct GpuCase {
  std::string preset;
  kvf_object_format format;
  Dir dir;
  Mem obj_kind;
  size_t misalign;
};

void PrintTo(const GpuCase &c, std::ostream *os) {
  *os << c.preset << "/" << format_name(c.format) << "/" << dir_name(c.dir) << "/" << mem_name(c.obj_kind)
      << "/misalign " << c.misalign;
}

std::string gpu_case_name(const ::testing::TestParamInfo<GpuCase> &info) {
  const GpuCase &c = info.param;
  std::string n = c.preset + "_" + format_name(c.format) + "_" + dir_name(c.dir) + "_" + mem_name(c.obj_kind);
  if (c.misalign) n += "_off" + std::to_string(c.misalign);
  return sanitize(n);
}

class XferGpuConformance : public ::testing::TestWithParam<GpuCase> {};
class XferGpuMisaligned : public ::testing::TestWithParam<GpuCase> {};
class XferGpuWindow : public ::testing::TestWithParam<GpuCase> {};

void run_param_case(const GpuCase &c, bool window, bool small) {
  REQUIRE_GPU();
  if (c.obj_kind == Mem::Peer) REQUIRE_PEER();
  uint64_t seed = seed_of(c.preset, 1000 + (uint64_t)c.format * 64 + (uint64_t)c.dir * 16 + (uint64_t)c.obj_kind * 4 +
                                        c.misalign + (window ? 7 : 0));
  Prepared s;
  if (window) {
    ASSERT_NO_FATAL_FAILURE(setup_window(c.preset, seed, &s));
  } else {
    ASSERT_NO_FATAL_FAILURE(setup_standard(c.preset, c.format == KVF_FORMAT_CANONICAL, seed, &s, small));
  }
  GpuConfig cfg;
  cfg.obj_kind = c.obj_kind;
  cfg.route = expected_route(c.obj_kind, c.dir);
  run_gpu_case(s.g(), s.plan, c.format, c.dir, c.misalign, seed + 1, cfg);
}

TEST_P(XferGpuConformance, MatchesTheReferenceByteForByte) { run_param_case(GetParam(), false, true); }
TEST_P(XferGpuMisaligned, UnalignedObjectsMatchTheReference) { run_param_case(GetParam(), false, false); }
TEST_P(XferGpuWindow, WindowOnlyTablesMatchTheReference) { run_param_case(GetParam(), true, false); }

// The kernels' and the staged route's side of chunk_local 0 (see
// kStatesOnlyDcpJson): no division by a chunk's local tokens anywhere.
TEST(XferGpu, StatesOnlyChunkShorterThanItsDcpWorldMatchesTheReference) {
  REQUIRE_GPU();
  GeometryPtr g = load_states_only_dcp();
  ASSERT_TRUE(g);
  for (kvf_object_format f : {KVF_FORMAT_CANONICAL, KVF_FORMAT_NATIVE})
    for (Dir d : {Dir::Gather, Dir::Scatter})
      for (Mem m : {Mem::Device, Mem::Pinned}) {
        SCOPED_TRACE(std::string(format_name(f)) + "/" + dir_name(d) + (m == Mem::Device ? "/device" : "/pinned"));
        GpuConfig cfg;
        cfg.obj_kind = m;
        cfg.route = expected_route(m, d);
        cfg.calls = 2;  // the second call's blob comes from the memo
        run_gpu_case(g.get(), states_only_dcp_plan(), f, d, 0, 81 + (uint64_t)d, cfg);
      }
}

std::vector<GpuCase> gpu_cases() {
  std::vector<GpuCase> v;
  for (const std::string &p : preset_names())
    for (kvf_object_format f : {KVF_FORMAT_CANONICAL, KVF_FORMAT_NATIVE})
      for (Dir d : {Dir::Gather, Dir::Scatter})
        for (Mem m : {Mem::Device, Mem::Pinned, Mem::Peer}) v.push_back({p, f, d, m, 0});
  return v;
}

std::vector<GpuCase> gpu_misaligned_cases() {
  std::vector<GpuCase> v;
  for (const char *p : kOddPresets)
    for (kvf_object_format f : {KVF_FORMAT_CANONICAL, KVF_FORMAT_NATIVE})
      for (Dir d : {Dir::Gather, Dir::Scatter}) {
        v.push_back({p, f, d, Mem::Device, 1});
        v.push_back({p, f, d, Mem::Pinned, 8});
      }
  return v;
}

std::vector<GpuCase> gpu_window_cases() {
  std::vector<GpuCase> v;
  for (const HostCase &c : host_cases(true)) v.push_back({c.preset, c.format, c.dir, Mem::Device, 0});
  return v;
}

INSTANTIATE_TEST_SUITE_P(Presets, XferGpuConformance, ::testing::ValuesIn(gpu_cases()), gpu_case_name);
INSTANTIATE_TEST_SUITE_P(Presets, XferGpuMisaligned, ::testing::ValuesIn(gpu_misaligned_cases()), gpu_case_name);
INSTANTIATE_TEST_SUITE_P(Presets, XferGpuWindow, ::testing::ValuesIn(gpu_window_cases()), gpu_case_name);

// ---- routes: every route the planner can take, forced through the tuning ------
//
// The same byte-exact comparison with the CPU reference, once per route:
// tables uploaded or in kernel parameters, tiny tasks, the copy-engine batch
// route, staged batches in many pieces (their copies as one batch call or
// one memcpy each, tables in parameters or uploaded).

// How many batch calls kvf_batch_ramp_runs splits `runs` runs into.
uint64_t ramp_calls(uint64_t runs, uint64_t first) {
  uint64_t calls = 0;
  for (uint64_t left = runs; left > 0; calls++) left -= kvf_batch_ramp_runs(calls, first, left);
  return calls;
}

// The most batch calls a paced ramp (KVF_XFER_BATCH_LINK_GBPS) from
// `first` runs makes of `runs`: each call half again the previous one, as
// on a host as slow a run as the copy engine.
uint64_t paced_max_calls(uint64_t runs, uint64_t first) {
  uint64_t calls = 0, m = 0;
  for (uint64_t left = runs; left > 0; calls++) {
    m = calls == 0 ? kvf_batch_ramp_runs(0, first, left) : kvf_batch_ramp_next(m, left, 1, 1);
    left -= m;
  }
  return calls;
}

// Whether a call's batch calls are those of a paced ramp from `first`.
void expect_paced_calls(const kvf_xfer_path_info &p, uint64_t first) {
  // One call when the first call's rule takes everything (up to 2 * first).
  EXPECT_GE(p.dma_ops, kvf_batch_ramp_runs(0, first, p.dma_runs) < p.dma_runs ? 2u : 1u) << p.dma_runs << " runs";
  EXPECT_LE(p.dma_ops, paced_max_calls(p.dma_runs, first)) << p.dma_runs << " runs";
}

// The copy-engine batch route for any runs, its calls ramped from First
// runs (0: one call; the stream is idle, so a ramp applies), doubling.
// Staged, every request small, a straight part wherever a view is one run a
// block; OnePiece 0: the small request's 2 pieces, straight part or not.
template <int64_t OnePiece> void small_stage_straight_tune(kvf_xfer_tuning &t) {
  t.batch_max_runs = 0;
  t.stage_pieces = 4;
  t.small_stage_mb = 1 << 20;
  t.stage_straight_kb = 64;
  t.stage_straight_min_run = 0;
  t.stage_straight_alone = 1; // the case's gathers are alone on their stream
  t.small_stage_one_piece = OnePiece;
}

template <int64_t First> void copy_batch_tune(kvf_xfer_tuning &t) {
  t.batch_min_run = 0;
  t.batch_max_runs = 1 << 30;
  t.batch_first_runs = First;
  t.batch_link_gbps = 0;
}

template <int64_t First> void copy_batch_check(const kvf_xfer_path_info &p, Mem) {
  EXPECT_TRUE(p.path == KVF_PATH_COPY_BATCH || p.path == KVF_PATH_STAGED) << kvf_xfer_path_name(p.path);
  if (p.path == KVF_PATH_COPY_BATCH) {
    EXPECT_EQ(p.launches, 0u);
    EXPECT_EQ(p.dma_ops, ramp_calls(p.dma_runs, First)) << p.dma_runs << " runs, calls ramped from " << First;
  }
}

struct RouteVariant {
  const char *name;
  bool pinned_only;
  void (*tune)(kvf_xfer_tuning &);
  void (*check)(const kvf_xfer_path_info &, Mem);
  bool deferred = false; // through kvf_xfer_gather_deferred (_scatter_deferred) and a join
};

// The spread variants' common tuning: every device-to-device launch of a
// KiB or more spreads over small CTAs, deep ones from a KiB when `deep` (a
// conformance case moves less than the default's 8 MiB) and shallow ones
// otherwise; host objects take the direct kernel, uncapped, and still one
// CTA per SM.
void spread_everywhere(kvf_xfer_tuning &t, bool deep) {
  t.spread_kb = 1;
  t.spread_deep_kb = deep ? 1 : 0;
  t.spread_deep_max_mb = 0;  // deep at any size
  t.staging_mb = 0;
  t.pcie_sms = 0;
  t.batch_max_runs = 0;
}

const RouteVariant kRouteVariants[] = {
    // The default routes, each call planned and enqueued by the context's
    // thread (a deferred call, then joined into the stream); the request's
    // arrays are scrubbed as soon as the call returns, before the thread
    // reads them (it reads its copy).
    {"deferred", false, [](kvf_xfer_tuning &) {},
     [](const kvf_xfer_path_info &p, Mem) { EXPECT_EQ(p.deferred, 1u) << "the call ran on the caller's thread"; },
     true},
    {"upload", false,
     [](kvf_xfer_tuning &t) {
       t.param_bytes = 0;
       t.batch_max_runs = 0;
       t.stage_pieces = 1;
     },
     [](const kvf_xfer_path_info &p, Mem m) {
       EXPECT_EQ(p.path, m == Mem::Pinned ? KVF_PATH_STAGED : KVF_PATH_KERNEL) << kvf_xfer_path_name(p.path);
       EXPECT_EQ(p.param_launches, 0u);
       EXPECT_GE(p.uploads, 1u);
     }},
    {"params_small_tasks", false,
     [](kvf_xfer_tuning &t) {
       t.task_bytes = 512;
       t.batch_max_runs = 0;
       t.stage_pieces = 1;
     },
     [](const kvf_xfer_path_info &p, Mem m) {
       EXPECT_EQ(p.path, m == Mem::Pinned ? KVF_PATH_STAGED : KVF_PATH_KERNEL) << kvf_xfer_path_name(p.path);
       EXPECT_EQ(p.uploads, 0u) << "small tables ride in the kernel parameters";
       EXPECT_EQ(p.param_launches, p.launches);
       EXPECT_EQ(p.slice_bytes, 512u);
     }},
    {"copy_batch", true, copy_batch_tune<0>, copy_batch_check<0>},
    {"copy_batch_ramp", true, copy_batch_tune<2>, copy_batch_check<2>},
    // Paced by the host's measured enqueue time (KVF_XFER_BATCH_LINK_GBPS).
    {"copy_batch_paced", true,
     [](kvf_xfer_tuning &t) {
       copy_batch_tune<2>(t);
       t.batch_link_gbps = 55;
     },
     [](const kvf_xfer_path_info &p, Mem) {
       EXPECT_TRUE(p.path == KVF_PATH_COPY_BATCH || p.path == KVF_PATH_STAGED) << kvf_xfer_path_name(p.path);
       if (p.path == KVF_PATH_COPY_BATCH) expect_paced_calls(p, 2);
     }},
    {"pieces", true,
     [](kvf_xfer_tuning &t) {
       t.batch_max_runs = 0;
       t.stage_pieces = 16;
       t.task_waves = 8;
       t.small_stage_mb = 0;     // the 16 pieces themselves, not the small-request rule's 2
       t.stage_multi_pieces = 0; // nor the multi-batch rule's
     },
     [](const kvf_xfer_path_info &p, Mem) {
       EXPECT_EQ(p.path, KVF_PATH_STAGED) << kvf_xfer_path_name(p.path);
       EXPECT_GE(p.pieces, 1u);
       EXPECT_EQ(p.uploads, 0u);
     }},
    {"edge_batch", true,
     [](kvf_xfer_tuning &t) {
       t.batch_max_runs = 0;
       t.staging_mb = 2;  // several chunks a batch where chunks are small,
       t.stage_edge_mb = 1; // fewer in the first (gather) or last (scatter)
       t.stage_pieces = 4;
       t.stage_multi_pieces = 2;
       t.small_stage_mb = 0;
     },
     [](const kvf_xfer_path_info &p, Mem) {
       EXPECT_EQ(p.path, KVF_PATH_STAGED) << kvf_xfer_path_name(p.path);
       if (p.batches > 1) {
         EXPECT_LE(p.pieces, 2u) << "a call of several batches has at most KVF_XFER_STAGE_MULTI_PIECES pieces a batch";
       }
     }},
    {"small_stage_rule", true,
     [](kvf_xfer_tuning &t) {
       t.batch_max_runs = 0;
       t.stage_pieces = 4;
       t.small_stage_mb = 1 << 20; // every request counts as small
     },
     [](const kvf_xfer_path_info &p, Mem) {
       EXPECT_EQ(p.path, KVF_PATH_STAGED) << kvf_xfer_path_name(p.path);
       EXPECT_LE(p.pieces, 2u) << "a small request is staged in at most 2 pieces";
     }},
    {"small_stage_straight", true, small_stage_straight_tune<1>,
     [](const kvf_xfer_path_info &p, Mem) {
       EXPECT_EQ(p.path, KVF_PATH_STAGED) << kvf_xfer_path_name(p.path);
       if (p.straight_runs && p.batches == 1)
         EXPECT_EQ(p.pieces, 1u) << "a small request of one batch with a straight part is staged in one piece";
       else
         EXPECT_LE(p.pieces, 2u) << "a small request is staged in at most 2 pieces";
     }},
    {"small_stage_straight_two_pieces", true, small_stage_straight_tune<0>,
     [](const kvf_xfer_path_info &p, Mem) {
       EXPECT_EQ(p.path, KVF_PATH_STAGED) << kvf_xfer_path_name(p.path);
       // A straight part takes at most half the batch, so the request
       // moves at least two views, and the cut makes two pieces of them.
       if (p.straight_runs)
         EXPECT_EQ(p.pieces, 2u) << "with the rule off a small request keeps its 2 pieces";
       else
         EXPECT_LE(p.pieces, 2u) << "a small request is staged in at most 2 pieces";
     }},
    {"straight_part", true,
     [](kvf_xfer_tuning &t) {
       t.batch_max_runs = 0;
       t.stage_straight_kb = 1; // the first (last) view that is one run a block
       t.stage_straight_min_run = 0;
       t.stage_straight_alone = 1;
       t.stage_pieces = 2;
       t.small_stage_mb = 0;
     },
     [](const kvf_xfer_path_info &p, Mem) { EXPECT_EQ(p.path, KVF_PATH_STAGED) << kvf_xfer_path_name(p.path); }},
    {"straight_part_one_piece", true,
     [](kvf_xfer_tuning &t) {
       t.batch_max_runs = 0;
       t.stage_straight_kb = 64;
       t.stage_straight_min_run = 0;
       t.stage_straight_alone = 1;
       t.stage_pieces = 1; // the copies follow run lists all the same
       t.small_stage_mb = 0;
     },
     [](const kvf_xfer_path_info &p, Mem) { EXPECT_EQ(p.path, KVF_PATH_STAGED) << kvf_xfer_path_name(p.path); }},
    {"straight_part_batches", true,
     [](kvf_xfer_tuning &t) {
       t.batch_max_runs = 0;
       t.staging_mb = 2; // several batches where chunks are small
       t.stage_edge_mb = 1;
       t.stage_straight_kb = 16;
       t.stage_straight_min_run = 0;
       t.stage_straight_alone = 1;
       t.stage_pieces = 4;
       t.small_stage_mb = 0;
     },
     [](const kvf_xfer_path_info &p, Mem) { EXPECT_EQ(p.path, KVF_PATH_STAGED) << kvf_xfer_path_name(p.path); }},
    {"spread", false,
     [](kvf_xfer_tuning &t) { spread_everywhere(t, true); },
     [](const kvf_xfer_path_info &p, Mem m) {
       EXPECT_EQ(p.path, KVF_PATH_KERNEL) << kvf_xfer_path_name(p.path);
       EXPECT_EQ(p.launches, 1u);
       EXPECT_EQ(p.param_launches, 1u);
       EXPECT_EQ(p.spread_launches, m == Mem::Device ? 1u : 0u) << "only device-to-device launches spread";
       EXPECT_EQ(p.deep_launches, m == Mem::Device ? 1u : 0u);
       EXPECT_EQ(p.overlap_launches, m == Mem::Device && overlap_expected() ? 1u : 0u)
           << "only device-to-device launches overlap";
     }},
    {"spread_no_overlap", false,
     [](kvf_xfer_tuning &t) {
       spread_everywhere(t, true);
       t.overlap = 0;  // each launch starts after the stream's previous kernel
     },
     [](const kvf_xfer_path_info &p, Mem m) {
       EXPECT_EQ(p.path, KVF_PATH_KERNEL) << kvf_xfer_path_name(p.path);
       EXPECT_EQ(p.spread_launches, m == Mem::Device ? 1u : 0u);
       EXPECT_EQ(p.deep_launches, m == Mem::Device ? 1u : 0u);
       EXPECT_EQ(p.overlap_launches, 0u);
     }},
    {"spread_shallow", false,
     [](kvf_xfer_tuning &t) { spread_everywhere(t, false); },  // more CTAs, fewer loads a lane
     [](const kvf_xfer_path_info &p, Mem m) {
       EXPECT_EQ(p.path, KVF_PATH_KERNEL) << kvf_xfer_path_name(p.path);
       EXPECT_EQ(p.spread_launches, m == Mem::Device ? 1u : 0u);
       EXPECT_EQ(p.deep_launches, 0u);
       EXPECT_EQ(p.overlap_launches, m == Mem::Device && overlap_expected() ? 1u : 0u);
     }},
    {"spread_shallow_no_overlap", false,
     [](kvf_xfer_tuning &t) {
       spread_everywhere(t, false);
       t.overlap = 0;  // the shallow kernel's plain launch
     },
     [](const kvf_xfer_path_info &p, Mem m) {
       EXPECT_EQ(p.path, KVF_PATH_KERNEL) << kvf_xfer_path_name(p.path);
       EXPECT_EQ(p.spread_launches, m == Mem::Device ? 1u : 0u);
       EXPECT_EQ(p.deep_launches, 0u);
       EXPECT_EQ(p.overlap_launches, 0u);
     }},
    {"spread_shallow_uploaded", false,
     [](kvf_xfer_tuning &t) {
       spread_everywhere(t, false);
       t.param_bytes = 0;  // its device-memory tables' kernel
     },
     [](const kvf_xfer_path_info &p, Mem m) {
       EXPECT_EQ(p.path, KVF_PATH_KERNEL) << kvf_xfer_path_name(p.path);
       EXPECT_EQ(p.uploads, 1u);
       EXPECT_EQ(p.spread_launches, m == Mem::Device ? 1u : 0u);
       EXPECT_EQ(p.deep_launches, 0u);
     }},
    {"spread_uploaded_object_order", false,
     [](kvf_xfer_tuning &t) {
       spread_everywhere(t, true);
       t.param_bytes = 0;  // the device-memory tables' deep spread kernel
       t.cache_order = 0;  // and device-to-device gathers in the object's order
     },
     [](const kvf_xfer_path_info &p, Mem m) {
       EXPECT_EQ(p.path, KVF_PATH_KERNEL) << kvf_xfer_path_name(p.path);
       EXPECT_EQ(p.uploads, 1u);
       EXPECT_EQ(p.spread_launches, m == Mem::Device ? 1u : 0u);
       EXPECT_EQ(p.deep_launches, m == Mem::Device ? 1u : 0u);
       EXPECT_EQ(p.overlap_launches, 0u) << "only launches with their tables in parameters overlap";
     }},
    {"grid_stride_walk", false, [](kvf_xfer_tuning &t) { t.kernel = 1; },
     [](const kvf_xfer_path_info &p, Mem m) {
       if (m == Mem::Device) {
         EXPECT_EQ(p.path, KVF_PATH_KERNEL) << kvf_xfer_path_name(p.path);
       }
     }},
    {"pieces_memcpy_uploaded", true,
     [](kvf_xfer_tuning &t) {
       t.batch_max_runs = 0;
       t.stage_pieces = 3;
       t.stage_dma_batch = 0;
       t.param_bytes = 0;
       t.small_stage_mb = 0;
     },
     [](const kvf_xfer_path_info &p, Mem) {
       EXPECT_EQ(p.path, KVF_PATH_STAGED) << kvf_xfer_path_name(p.path);
       EXPECT_EQ(p.uploads, 1u);
       EXPECT_EQ(p.param_launches, 0u);
     }},
};

struct RouteCase {
  std::string preset;
  kvf_object_format format;
  Dir dir;
  Mem obj_kind;
  size_t variant;
};

void PrintTo(const RouteCase &c, std::ostream *os) {
  *os << c.preset << "/" << format_name(c.format) << "/" << dir_name(c.dir) << "/" << mem_name(c.obj_kind) << "/"
      << kRouteVariants[c.variant].name;
}

std::string route_case_name(const ::testing::TestParamInfo<RouteCase> &info) {
  const RouteCase &c = info.param;
  return sanitize(c.preset + "_" + format_name(c.format) + "_" + dir_name(c.dir) + "_" + mem_name(c.obj_kind) + "_" +
                  kRouteVariants[c.variant].name);
}

class XferGpuRoutes : public ::testing::TestWithParam<RouteCase> {};

TEST_P(XferGpuRoutes, MatchesTheReferenceByteForByte) {
  REQUIRE_GPU();
  const RouteCase &c = GetParam();
  const RouteVariant &v = kRouteVariants[c.variant];
  uint64_t seed = seed_of(c.preset, 5000 + c.variant * 64 + (uint64_t)c.format * 8 + (uint64_t)c.dir * 2 +
                                        (c.obj_kind == Mem::Pinned));
  Prepared s;
  // The standard request (a full object and a partial one): several chunks'
  // worth of batches and pieces, partial blocks and objects included.
  ASSERT_NO_FATAL_FAILURE(setup_standard(c.preset, c.format == KVF_FORMAT_CANONICAL, seed, &s, false));
  GpuConfig cfg;
  cfg.obj_kind = c.obj_kind;
  cfg.route = expected_route(c.obj_kind, c.dir);
  cfg.tune = v.tune;
  cfg.deferred = v.deferred;
  Mem m = c.obj_kind;
  cfg.check_path = [&v, m](const kvf_xfer_path_info &p) { v.check(p, m); };
  run_gpu_case(s.g(), s.plan, c.format, c.dir, 0, seed + 1, cfg);
}

std::vector<RouteCase> route_cases() {
  std::vector<RouteCase> v;
  for (const std::string &p : preset_names())
    for (kvf_object_format f : {KVF_FORMAT_CANONICAL, KVF_FORMAT_NATIVE})
      for (Dir d : {Dir::Gather, Dir::Scatter})
        for (Mem m : {Mem::Device, Mem::Pinned})
          for (size_t i = 0; i < sizeof kRouteVariants / sizeof kRouteVariants[0]; i++)
            if (m == Mem::Pinned || !kRouteVariants[i].pinned_only) v.push_back({p, f, d, m, i});
  return v;
}

INSTANTIATE_TEST_SUITE_P(Presets, XferGpuRoutes, ::testing::ValuesIn(route_cases()), route_case_name);

// The routes the default tuning picks for one chunk: the copy-engine batch
// API for long runs (a Llama NHD chunk: 1024 runs of 32 KiB), staged pieces
// for short ones (HND: 256-byte runs), tables in kernel parameters on the
// device, and the staged route on the legacy stream, which
// cudaMemcpyBatchAsync refuses; a staged chunk is a small request
// (KVF_XFER_SMALL_STAGE_MB), in one piece where it has a straight part
// (not a gather alone on its stream, as here: StagedGatherAloneLeavesOut
// ItsStraightPart). On the device a chunk (17-32 MiB) is a
// spread launch (KVF_XFER_SPREAD_KB), and an HND gather walks the cache's
// order (KVF_XFER_CACHE_ORDER).
TEST(XferGpu, DefaultRoutesForOneChunk) {
  REQUIRE_GPU();
  struct Want {
    const char *preset;
    Mem obj;
    bool legacy;
    kvf_xfer_path path;
    bool straight; // the copy engine moves the exposed layers itself
  };
  // One Llama chunk is 1024 runs: over KVF_XFER_BATCH_MAX_RUNS (the batch
  // API's host cost), staged, its first (last) layers straight from (to) the
  // cache but on the legacy stream; the MLA chunk's 244 runs take the batch
  // API; HND blocks are a run per head, none straight.
  const Want wants[] = {{"llama-3.1-8b-fa-nhd", Mem::Pinned, false, KVF_PATH_STAGED, true},
                        {"deepseek-v3-mla-bf16", Mem::Pinned, false, KVF_PATH_COPY_BATCH, false},
                        {"llama-3.1-8b-fa-hnd", Mem::Pinned, false, KVF_PATH_STAGED, false},
                        {"llama-3.1-8b-fa-nhd", Mem::Pinned, true, KVF_PATH_STAGED, false},
                        {"llama-3.1-8b-fa-nhd", Mem::Device, false, KVF_PATH_KERNEL, false},
                        {"llama-3.1-8b-fa-hnd", Mem::Device, false, KVF_PATH_KERNEL, false},
                        {"deepseek-v3-mla-bf16", Mem::Device, false, KVF_PATH_KERNEL, false}};
  for (const Want &w : wants)
    for (Dir d : {Dir::Gather, Dir::Scatter}) {
      SCOPED_TRACE(std::string(w.preset) + " " + mem_name(w.obj) + (w.legacy ? " legacy stream " : " ") + dir_name(d));
      Prepared s;
      ASSERT_NO_FATAL_FAILURE(setup_chunks(w.preset, 1, 0, 23, &s));
      GpuConfig cfg;
      cfg.obj_kind = w.obj;
      cfg.legacy_stream = w.legacy;
      cfg.route = expected_route(w.obj, d);
      kvf_xfer_path want = w.path;
      bool straight = w.straight && d == Dir::Scatter; // a gather alone has none
      bool cache_order = d == Dir::Gather; // the walk applies it to head-major blocks only
      // A device-to-device launch aims at KVF_XFER_DEVICE_TASK_WAVES tasks
      // per warp of 16-warp SMs: its slice for this payload.
      int sms = 0;
      CUDA_OK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
      const kvf_blob_opts device_opts = {0, nullptr,
                                         (uint64_t)sms * 16 * (uint64_t)kvf_param_xfer_device_task_waves()};
      const uint32_t device_slice = kvf_blob_slice_for(&device_opts, plan_payload(s.g(), s.plan));
      const bool small = sms >= KVF_SMALL_STAGE_SMS; // the small-request rule needs its 64 SMs
      cfg.check_path = [want, straight, cache_order, device_slice, small](const kvf_xfer_path_info &p) {
        EXPECT_EQ(p.path, want) << kvf_xfer_path_name(p.path);
        EXPECT_EQ(p.straight_runs > 0, straight) << p.straight_runs << " runs straight";
        EXPECT_EQ(p.uploads, 0u) << "one chunk's tables fit the kernel parameters";
        if (want == KVF_PATH_STAGED) {
          // A chunk is a small request (KVF_XFER_SMALL_STAGE_MB): one piece
          // behind its straight part, else two so the copy engine starts early.
          if (small && straight)
            EXPECT_EQ(p.pieces, 1u) << "the straight part hides the one piece's kernel";
          else
            EXPECT_GT(p.pieces, 1u) << "one chunk's batch is split so the copy engine starts early";
        }
        if (want == KVF_PATH_COPY_BATCH) {
          EXPECT_EQ(p.dma_runs, 244u) << "61 layers x 4 blocks";
          // From the default KVF_XFER_BATCH_FIRST_RUNS, paced by the host.
          expect_paced_calls(p, (uint64_t)kvf_param_xfer_batch_first_runs());
        }
        if (want == KVF_PATH_KERNEL) {
          EXPECT_EQ(p.spread_launches, 1u) << "a one-chunk device-to-device launch spreads";
          EXPECT_EQ(p.deep_launches, 0u) << "shallow: the MLA (17 MiB) and Llama (32 MiB) chunks are past KVF_XFER_SPREAD_DEEP_MAX_MB";
          EXPECT_EQ(p.overlap_launches, overlap_expected() ? 1u : 0u) << "and overlaps the stream's previous kernel";
          EXPECT_EQ(p.slice_bytes, device_slice) << "a device-to-device launch aims at 2 tasks per warp";
          EXPECT_EQ(p.cache_order, cache_order ? 1u : 0u);
        }
      };
      run_gpu_case(s.g(), s.plan, KVF_FORMAT_CANONICAL, d, 0, 24 + (uint64_t)d, cfg);
    }
}

// A staged gather alone on an idle stream has no straight part: the copy
// engine would start only after that part's batch call, whose host time
// outlasts the first piece's kernel (staged_straight, host/core/xfer.c);
// it takes two pieces instead. Behind other work it keeps the part in one
// piece, as it does alone with KVF_XFER_STAGE_STRAIGHT_ALONE=1 and under
// an SM cap of 4 (not measured alone: its part is three times larger for
// the slower kernels), and a scatter keeps it either way. Right behind an
// event the caller records (as a latency measure does) the call still
// finds its stream idle in most of five calls (this chunk's run listing
// for the batch route usually outlasts the event; stream_idle_soon waits
// out the rest). Every call is checked against the CPU reference.
TEST(XferGpu, StagedGatherAloneLeavesOutItsStraightPart) {
  REQUIRE_GPU();
  int sms = 0;
  CUDA_OK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  if (sms < KVF_SMALL_STAGE_SMS) GTEST_SKIP() << "one piece or two is the small-request rule's, which needs 64 SMs";
  struct Case {
    Dir dir;
    double busy_ms; // a spin ahead of the first call on its stream
    bool event_first; // an event recorded on the stream right before each call
    int64_t straight_alone;
    uint32_t max_sms;
    bool straight;
  };
  const Case cases[] = {{Dir::Gather, 0, false, 0, 0, false},
                        {Dir::Gather, 20, false, 0, 0, true},
                        {Dir::Gather, 0, false, 1, 0, true},
                        {Dir::Gather, 0, false, 0, 4, true},
                        {Dir::Scatter, 0, false, 0, 0, true},
                        {Dir::Gather, 0, true, 0, 0, false}};
  uint64_t seed = 90;
  for (const Case &c : cases) {
    SCOPED_TRACE(std::string(dir_name(c.dir)) + (c.busy_ms > 0 ? " behind a spin" : " alone") +
                 (c.event_first ? " behind an event" : "") + ", straight_alone " + std::to_string(c.straight_alone) +
                 ", max_sms " + std::to_string(c.max_sms));
    Prepared s;
    ASSERT_NO_FATAL_FAILURE(setup_chunks("llama-3.1-8b-fa-nhd", 1, 0, seed++, &s));
    GpuConfig cfg;
    cfg.obj_kind = Mem::Pinned;
    cfg.route = expected_route(Mem::Pinned, c.dir);
    cfg.busy_ms = c.busy_ms;
    cfg.max_sms = c.max_sms;
    const int64_t straight_alone = c.straight_alone;
    cfg.tune = [straight_alone](kvf_xfer_tuning &t) { t.stage_straight_alone = straight_alone; };
    if (c.event_first) {
      cfg.calls = 5;
      cfg.event_before_call = true;
    }
    int as_wanted = 0;
    const bool straight = c.straight, small = c.max_sms == 0;
    cfg.check_each = [straight, small, &as_wanted](int, const kvf_xfer_path_info &p) {
      ASSERT_EQ(p.path, KVF_PATH_STAGED) << kvf_xfer_path_name(p.path);
      if (small) {
        EXPECT_EQ(p.straight_runs > 0 ? 1u : 2u, p.pieces) << "one piece behind a straight part, else two";
      }
      if ((p.straight_runs > 0) == straight) as_wanted++;
    };
    run_gpu_case(s.g(), s.plan, KVF_FORMAT_CANONICAL, c.dir, 0, seed++, cfg);
    if (c.event_first)
      EXPECT_GE(as_wanted, 3) << "of 5 gathers right behind an event, found alone";
    else
      EXPECT_EQ(as_wanted, 1) << (straight ? "a straight part" : "no straight part");
  }
}

// A request whose ids cannot merge under KVF_XFER_BATCH_MAX_RUNS (a Llama
// chunk's 1024 blocks of shuffled ids: kvf_stage_batch_runs_floor) goes
// staged without building its batch-API runs; the same chunk with its ids
// in order (64 runs, one a plane) still takes the batch route. Calls:
// shuffled, shuffled, in order, shuffled, in order, shuffled (the case's
// plan, whose gather the last call checks).
TEST(XferGpu, RequestWhoseIdsCannotMergeUnderTheLimitIsNotListed) {
  REQUIRE_GPU();
  Prepared s;
  ASSERT_NO_FATAL_FAILURE(setup_chunks("llama-3.1-8b-fa-nhd", 1, 0, 61, &s));
  Plan in_order = s.plan;
  std::iota(in_order.ids[0].begin(), in_order.ids[0].end(), 0u);
  GpuConfig cfg;
  cfg.obj_kind = Mem::Pinned;
  cfg.route = KVF_ROUTE_D2H;
  cfg.calls = 6;
  cfg.tune = [](kvf_xfer_tuning &t) { t.batch_host_bound = 0; }; // the route by fit alone
  cfg.plan_for_call = [&in_order](int i) -> const Plan * { return i == 2 || i == 4 ? &in_order : nullptr; };
  cfg.check_each = [](int i, const kvf_xfer_path_info &p) {
    SCOPED_TRACE("call " + std::to_string(i));
    if (i == 2 || i == 4) {
      EXPECT_EQ(p.path, KVF_PATH_COPY_BATCH) << kvf_xfer_path_name(p.path);
      EXPECT_EQ(p.dma_runs, 64u) << "one run a plane";
      EXPECT_EQ(p.batch_listed, 1u);
    } else {
      EXPECT_EQ(p.path, KVF_PATH_STAGED) << kvf_xfer_path_name(p.path);
      EXPECT_EQ(p.batch_listed, 0u) << "refused by the floor, without listing";
    }
  };
  run_gpu_case(s.g(), s.plan, KVF_FORMAT_CANONICAL, Dir::Gather, 0, 62, cfg);
}

// A call alone that the host-bound rule would stage waits up to
// KVF_IDLE_WAIT_NS for its busy stream (an event recorded just before it
// may still be completing), but not when it came within
// KVF_XFER_BATCH_BACK_TO_BACK_US of the context's previous call on that
// stream: that stream's work is the previous call's. Each call from the
// third on (the first two measure the batch route's host time) finds a
// spin ahead of it. Window 1 s: no wait on the same stream; window 0, or a
// new stream each call (CUDA may give it the destroyed one's handle; the
// context tells streams by id): the whole wait.
TEST(XferGpu, CallBackToBackOnItsStreamDoesNotWaitForIt) {
  REQUIRE_GPU();
  struct Case {
    int64_t window_us;
    bool new_streams;
  };
  for (Case c : {Case{KVF_BATCH_MAX_BACK_TO_BACK_US, false}, Case{0, false}, Case{KVF_BATCH_MAX_BACK_TO_BACK_US, true}}) {
    SCOPED_TRACE("window " + std::to_string(c.window_us) + " us" + (c.new_streams ? ", a new stream each call" : ""));
    Prepared s;
    ASSERT_NO_FATAL_FAILURE(setup_chunks("deepseek-v3-mla-fp8-656", 1, 0, 63, &s));
    GpuConfig cfg;
    cfg.obj_kind = Mem::Pinned;
    cfg.route = KVF_ROUTE_D2H;
    cfg.calls = 5;
    cfg.new_stream_each_call = c.new_streams;
    const int64_t window_us = c.window_us;
    cfg.tune = [window_us](kvf_xfer_tuning &t) {
      t.batch_link_gbps = KVF_BATCH_MAX_LINK_GBPS; // every batch call host-bound: the rule asks its stream
      t.batch_staged_cost = 0;
      t.batch_back_to_back_us = window_us;
    };
    cfg.before_each = [](int i, kvf_xfer *, cudaStream_t stream) {
      if (i >= 2) CUDA_OK(kvf_test_spin(stream, 2));
    };
    const bool waits = c.window_us == 0 || c.new_streams;
    cfg.check_each = [waits](int i, const kvf_xfer_path_info &p) {
      SCOPED_TRACE("call " + std::to_string(i));
      if (i < 2) return;
      if (waits) {
        EXPECT_GE(p.idle_wait_us, KVF_IDLE_WAIT_NS / 1e3) << "a busy stream, not the previous call's";
      } else {
        EXPECT_EQ(p.idle_wait_us, 0.0) << "back to back on its stream: no wait";
      }
      EXPECT_EQ(p.path, KVF_PATH_COPY_BATCH) << "a busy stream: " << kvf_xfer_path_name(p.path);
    };
    run_gpu_case(s.g(), s.plan, KVF_FORMAT_CANONICAL, Dir::Gather, 0, 64, cfg);
  }
}

// The batch API route splits its runs into calls of 8, 16, 32, ... runs
// (KVF_XFER_BATCH_FIRST_RUNS) only when the stream is idle, so the copy
// engine starts early; behind queued work (a spin kernel) it makes one call,
// which the copy engine runs faster. Either way every byte lands, and asking
// the stream whether it is busy leaves no error behind (run_gpu_case checks
// cudaGetLastError after the call).
TEST(XferGpu, BatchCallsRampOnlyOnAnIdleStream) {
  REQUIRE_GPU();
  for (double busy_ms : {0.0, 20.0})
    for (Dir d : {Dir::Gather, Dir::Scatter}) {
      SCOPED_TRACE(std::string(busy_ms > 0 ? "busy " : "idle ") + dir_name(d));
      Prepared s;
      ASSERT_NO_FATAL_FAILURE(setup_chunks("deepseek-v3-mla-bf16", 1, 0, 29, &s));
      GpuConfig cfg;
      cfg.obj_kind = Mem::Pinned;
      cfg.route = expected_route(Mem::Pinned, d);
      cfg.busy_ms = busy_ms;
      cfg.tune = [](kvf_xfer_tuning &t) {
        t.batch_first_runs = 8;
        t.batch_link_gbps = 0; // doubling, so the calls are known
      };
      const uint64_t want_calls = busy_ms > 0 ? 1 : 5;  // 8, 16, 32, 64 and 124 runs
      cfg.check_path = [want_calls](const kvf_xfer_path_info &p) {
        ASSERT_EQ(p.path, KVF_PATH_COPY_BATCH) << kvf_xfer_path_name(p.path);
        EXPECT_EQ(p.dma_runs, 244u);
        EXPECT_EQ(p.dma_ops, want_calls);
      };
      run_gpu_case(s.g(), s.plan, KVF_FORMAT_CANONICAL, d, 0, 30 + (uint64_t)d, cfg);
    }
}

// A caller that records an event right before the call (to time it, or to
// mark its stream) leaves the stream busy for the few us the GPU takes to
// reach the event. The batch route still ramps there: it waits up to
// KVF_IDLE_WAIT_NS for the stream to go idle before its first call. One ask
// made one call of all 244 runs, its copies starting only after the host
// had enqueued them all (an H100 timed the chunk d2h alone at 1.21x a
// memcpy that way). Twenty calls each way, each behind its own event; the
// GPU may now and then take longer than the wait to reach the event (then
// the call waited the whole KVF_IDLE_WAIT_NS and made one call), so 18 of
// 20 must ramp.
TEST(XferGpu, BatchCallsRampBehindAnEventJustRecorded) {
  REQUIRE_GPU();
  for (Dir d : {Dir::Gather, Dir::Scatter}) {
    SCOPED_TRACE(dir_name(d));
    Prepared s;
    ASSERT_NO_FATAL_FAILURE(setup_chunks("deepseek-v3-mla-bf16", 1, 0, 29, &s));
    GpuConfig cfg;
    cfg.obj_kind = Mem::Pinned;
    cfg.route = expected_route(Mem::Pinned, d);
    cfg.event_before_call = true;
    cfg.calls = 20;
    cfg.tune = [](kvf_xfer_tuning &t) {
      t.batch_first_runs = 8;
      t.batch_link_gbps = 0;  // doubling, so the calls are known; no host-bound rule
    };
    int ramped = 0;
    cfg.check_each = [&ramped](int i, const kvf_xfer_path_info &p) {
      SCOPED_TRACE("call " + std::to_string(i));
      ASSERT_EQ(p.path, KVF_PATH_COPY_BATCH) << kvf_xfer_path_name(p.path);
      EXPECT_EQ(p.dma_runs, 244u);
      EXPECT_TRUE(p.dma_ops == 5 || p.dma_ops == 1) << p.dma_ops << " calls: the ramp's 8, 16, 32, 64 and 124 runs, or one";
      if (p.dma_ops == 1) {
        EXPECT_GE(p.idle_wait_us, KVF_IDLE_WAIT_NS / 1e3) << "one call only after waiting the whole wait";
      }
      ramped += p.dma_ops == 5;
    };
    run_gpu_case(s.g(), s.plan, KVF_FORMAT_CANONICAL, d, 0, 40 + (uint64_t)d, cfg);
    EXPECT_GE(ramped, 18) << "calls that ramped behind an event just recorded, of 20";
  }
}

// A batch call that comes right after a host-bound one (its host time
// outlasted its copies at KVF_XFER_BATCH_LINK_GBPS, here set so high that
// every call is) makes one call on an idle stream: back to back, the ramp's
// calls would only add host time. With the window at 0 it ramps as before.
TEST(XferGpu, BatchCallRightAfterAHostBoundOneIsOneCall) {
  REQUIRE_GPU();
  for (int64_t window_us : {0, KVF_BATCH_MAX_BACK_TO_BACK_US})
    for (Dir d : {Dir::Gather, Dir::Scatter}) {
      SCOPED_TRACE("window " + std::to_string(window_us) + " us, " + dir_name(d));
      Prepared s;
      ASSERT_NO_FATAL_FAILURE(setup_chunks("deepseek-v3-mla-bf16", 1, 0, 29, &s));
      GpuConfig cfg;
      cfg.obj_kind = Mem::Pinned;
      cfg.route = expected_route(Mem::Pinned, d);
      cfg.calls = 2;  // the second right after the first's sync (well within a second)
      cfg.tune = [window_us](kvf_xfer_tuning &t) {
        t.batch_first_runs = 8;
        t.batch_link_gbps = KVF_BATCH_MAX_LINK_GBPS;
        t.batch_back_to_back_us = window_us;
        t.batch_host_bound = 0; // the batch route however slow the host
      };
      cfg.check_path = [window_us](const kvf_xfer_path_info &p) {
        ASSERT_EQ(p.path, KVF_PATH_COPY_BATCH) << kvf_xfer_path_name(p.path);
        EXPECT_EQ(p.dma_runs, 244u);
        if (window_us > 0)
          EXPECT_EQ(p.dma_ops, 1u) << "back to back after a host-bound call: one call";
        else
          EXPECT_GE(p.dma_ops, 2u) << "no window: the idle stream's ramp";
      };
      run_gpu_case(s.g(), s.plan, KVF_FORMAT_CANONICAL, d, 0, 34 + (uint64_t)d, cfg);
    }
}

// A request the batch route fits goes staged when the context's last two
// batch calls were host-bound (KVF_XFER_BATCH_LINK_GBPS set so high here
// that every call is) and the stream has reached the previous call (each
// call here waits for the last): the first two calls take the batch route
// (one measure is not enough), the next KVF_BATCH_HOST_BOUND_RETRY go
// staged, then one takes the batch route to measure the host again, and on
// the idle stream it ramps (the mark it leaves for the next call must not
// make its own stream look busy). KVF_XFER_BATCH_HOST_BOUND 0: the batch
// route every time. Every call's bytes land as the reference says.
TEST(XferGpu, HostBoundBatchRequestGoesStagedAndMeasuresAgain) {
  REQUIRE_GPU();
  for (int64_t on : {1, 0})
    for (Dir d : {Dir::Gather, Dir::Scatter}) {
      SCOPED_TRACE(std::string(on ? "on " : "off ") + dir_name(d));
      Prepared s;
      ASSERT_NO_FATAL_FAILURE(setup_chunks("deepseek-v3-mla-fp8-656", 1, 0, 41, &s));
      GpuConfig cfg;
      cfg.obj_kind = Mem::Pinned;
      cfg.route = expected_route(Mem::Pinned, d);
      cfg.calls = KVF_BATCH_HOST_BOUND_RETRY + 4;
      cfg.tune = [on](kvf_xfer_tuning &t) {
        t.batch_link_gbps = KVF_BATCH_MAX_LINK_GBPS;
        t.batch_staged_cost = KVF_BATCH_STAGED_COST_EIGHTH; // the link rate is fake: a measured cost would be huge
        t.batch_host_bound = on;
        t.batch_first_runs = 8;
        t.batch_back_to_back_us = 0; // every batch call on the idle stream ramps
      };
      cfg.check_each = [on](int i, const kvf_xfer_path_info &p) {
        SCOPED_TRACE("call " + std::to_string(i));
        const bool batch = !on || i <= 1 || i == KVF_BATCH_HOST_BOUND_RETRY + 2;
        EXPECT_EQ(p.path, batch ? KVF_PATH_COPY_BATCH : KVF_PATH_STAGED) << kvf_xfer_path_name(p.path);
        EXPECT_EQ(p.host_bound, batch ? 0u : 1u);
        if (p.path == KVF_PATH_STAGED) {
          EXPECT_GE(p.launches, 1u) << "the staged route's kernels";
        } else {
          EXPECT_GE(p.dma_ops, 2u) << "an idle stream: the ramp's calls";
        }
      };
      run_gpu_case(s.g(), s.plan, KVF_FORMAT_CANONICAL, d, 0, 42 + (uint64_t)d, cfg);
    }
}

// With the staged route's cost not fixed (the default), a host-bound call
// alone on an idle stream weighs both routes' latency alone
// (kvf_batch_alone_outlasts_staged): the batch route's ramp at the host
// time of the context's last two batch calls against the staged route's
// copies at 1.01x plus 10-30 us. Four fp8 MLA chunks a call (976 runs, the
// batch route's limit raised to fit them; 0.4-0.9 ms of host time on the
// H200) at a link rate so high their copies take nanoseconds: the batch
// route's latency is its host time, past 30 us, so calls from the third on
// go staged but every ninth in a row. At 1 GB/s the copies take 41 ms,
// which the host keeps ahead of, and 1% of them outlasts the calls' cost:
// every call stays batched. Every call is
// synchronized and checked against the reference. Both verdicts are far
// from the break-even, so this checks the idle-stream branch's wiring (the
// rule before the model gave the same); XferBatchRamp's cases check the
// model's verdicts near it, the gather/scatter parts included. One chunk a
// call, each right behind an event the test records (asked with the last
// call's runs, before the GPU completes the event), still finds its stream
// idle (stream_idle_soon).
TEST(XferGpu, HostBoundCallAloneWeighsBothRoutesLatency) {
  REQUIRE_GPU();
  struct Case {
    int64_t link_gbps;
    uint64_t chunks;
    bool event_first; // an event recorded on the stream right before each call
  };
  for (Case c : {Case{(int64_t)KVF_BATCH_MAX_LINK_GBPS, 4, false}, Case{1, 4, false},
                 Case{(int64_t)KVF_BATCH_MAX_LINK_GBPS, 1, true}})
    for (Dir d : {Dir::Gather, Dir::Scatter}) {
      const int64_t link_gbps = c.link_gbps;
      SCOPED_TRACE("link " + std::to_string(link_gbps) + " GB/s, " + std::to_string(c.chunks) + " chunks, " +
                   (c.event_first ? "behind an event, " : "") + dir_name(d));
      Prepared s;
      ASSERT_NO_FATAL_FAILURE(setup_chunks("deepseek-v3-mla-fp8-656", c.chunks, 0, 51, &s));
      GpuConfig cfg;
      cfg.event_before_call = c.event_first;
      cfg.obj_kind = Mem::Pinned;
      cfg.route = expected_route(Mem::Pinned, d);
      cfg.calls = KVF_BATCH_HOST_BOUND_RETRY + 4;
      cfg.tune = [link_gbps](kvf_xfer_tuning &t) {
        t.batch_link_gbps = link_gbps;
        t.batch_staged_cost = 0;
        t.batch_back_to_back_us = 0; // every batch call on the idle stream ramps
        t.batch_max_runs = 4 * 256;
      };
      const bool host_bound = link_gbps > 1, event_first = c.event_first;
      int staged = 0;
      cfg.check_each = [host_bound, event_first, &staged](int i, const kvf_xfer_path_info &p) {
        SCOPED_TRACE("call " + std::to_string(i));
        EXPECT_EQ(p.back_to_back, 0u) << "every call alone";
        EXPECT_EQ(p.host_bound, p.path == KVF_PATH_STAGED ? 1u : 0u) << kvf_xfer_path_name(p.path);
        staged += p.path == KVF_PATH_STAGED;
        // Behind an event the GPU may take longer than the wait to complete
        // it now and then; one such call shifts the ninth call's retry.
        if (event_first) return;
        const bool batch = !host_bound || i <= 1 || i == KVF_BATCH_HOST_BOUND_RETRY + 2;
        EXPECT_EQ(p.path, batch ? KVF_PATH_COPY_BATCH : KVF_PATH_STAGED) << kvf_xfer_path_name(p.path);
      };
      run_gpu_case(s.g(), s.plan, KVF_FORMAT_CANONICAL, d, 0, 52 + (uint64_t)d, cfg);
      if (event_first) {
        EXPECT_GE(staged, KVF_BATCH_HOST_BOUND_RETRY - 2) << "of the " << KVF_BATCH_HOST_BOUND_RETRY + 1
                                                         << " calls the rule stages, staged behind an event";
      }
    }
}

// A request of the last listed one's shape (direction, format, tokens,
// which groups and objects move) asks the host-bound rule with that one's
// runs before listing its own (batch_shape_of), so a call the rule stages
// lists nothing; block ids are not part of the shape (a sequence's next
// chunk has other ids), the token count is. Four fp8 MLA chunks a call
// (976 runs), every call host-bound at a fake link rate: calls 0 and 1
// take the batch route and list; 2 and 3 (other ids) go staged without
// listing; 4 (three chunks: another shape) lists; 5 (four chunks again)
// lists, its shape no longer the last listed; 6 and 7 go staged without
// listing. Gathers only: the last call's objects are checked against the
// reference (the ids of calls 3 and 4 move other blocks).
TEST(XferGpu, RequestOfTheListedShapeAsksTheHostBoundRuleBeforeListing) {
  REQUIRE_GPU();
  Prepared s;
  ASSERT_NO_FATAL_FAILURE(setup_chunks("deepseek-v3-mla-fp8-656", 4, 0, 65, &s));
  Plan other_ids = s.plan, three_chunks = s.plan;
  std::reverse(other_ids.ids[0].begin(), other_ids.ids[0].end());
  three_chunks.token_end = 3 * chunk_tokens(s.g());
  GpuConfig cfg;
  cfg.obj_kind = Mem::Pinned;
  cfg.route = KVF_ROUTE_D2H;
  cfg.calls = 8;
  cfg.tune = [](kvf_xfer_tuning &t) {
    t.batch_link_gbps = KVF_BATCH_MAX_LINK_GBPS;
    t.batch_staged_cost = 0;
    t.batch_back_to_back_us = 0;
    t.batch_max_runs = 4 * 256;
  };
  cfg.plan_for_call = [&other_ids, &three_chunks](int i) -> const Plan * {
    return i == 3 ? &other_ids : i == 4 ? &three_chunks : nullptr;
  };
  cfg.check_each = [](int i, const kvf_xfer_path_info &p) {
    SCOPED_TRACE("call " + std::to_string(i));
    const bool lists = i <= 1 || i == 4 || i == 5;
    EXPECT_EQ(p.batch_listed, lists ? 1u : 0u);
    if (i <= 1) {
      EXPECT_EQ(p.path, KVF_PATH_COPY_BATCH) << "two batch calls measure the host first";
    } else if (!lists) {
      EXPECT_EQ(p.path, KVF_PATH_STAGED) << kvf_xfer_path_name(p.path);
      EXPECT_EQ(p.host_bound, 1u);
    }
  };
  run_gpu_case(s.g(), s.plan, KVF_FORMAT_CANONICAL, Dir::Gather, 0, 66, cfg);
}

// A host-bound call goes staged behind a busy stream only while that
// stream works on the context's call right before it, which came back
// within KVF_XFER_BATCH_BACK_TO_BACK_US. Here a host-bound call goes staged
// on the idle stream (call 2), and the last call finds work queued that is
// not the previous call's: the batch route, in one call. Each case leaves
// one guard to catch it (the window is 1 s unless said):
//   - another route's call right behind call 2 (batch route off for it),
//     then a spin kernel and the last call, while call 2's copies may still
//     run: the marks are call 2's, not the previous call's;
//   - the caller's spin kernel after call 2 has finished: call 2's end mark
//     is reached;
//   - the caller's spin kernel at once behind call 2, which is still
//     running, and a window of 1 us: the last call does not come back to
//     back (in this case nothing on the GPU tells the spin from call 2's
//     own work, so only the window can). Sixteen chunks in a call (the
//     batch route's limit raised to fit them) keep call 2 running for
//     milliseconds, far longer than the test takes to make call 3.
TEST(XferGpu, HostBoundCallBehindOtherWorkStaysBatched) {
  REQUIRE_GPU();
  enum Between { OtherRoute, SpinAfter, SpinAtOnce };
  for (Between between : {OtherRoute, SpinAfter, SpinAtOnce})
    for (Dir d : {Dir::Gather, Dir::Scatter}) {
      SCOPED_TRACE(std::string(between == OtherRoute  ? "another route's call, "
                               : between == SpinAfter ? "a spin after call 2, "
                                                      : "a spin at once, ") +
                   dir_name(d));
      Prepared s;
      ASSERT_NO_FATAL_FAILURE(setup_chunks("deepseek-v3-mla-fp8-656", between == SpinAtOnce ? 16 : 1, 0, 45, &s));
      GpuConfig cfg;
      cfg.obj_kind = Mem::Pinned;
      cfg.route = expected_route(Mem::Pinned, d);
      const int last = between == OtherRoute ? 4 : 3;
      cfg.calls = last + 1;
      cfg.sync_each = false;
      cfg.tune = [between](kvf_xfer_tuning &t) {
        t.batch_link_gbps = KVF_BATCH_MAX_LINK_GBPS;
        t.batch_staged_cost = KVF_BATCH_STAGED_COST_EIGHTH; // the link rate is fake: a measured cost would be huge
        t.batch_back_to_back_us = between == SpinAtOnce ? 1 : KVF_BATCH_MAX_BACK_TO_BACK_US;
        if (between == SpinAtOnce) t.batch_max_runs = 16 * 256;
      };
      int64_t max_runs = 0;
      cfg.before_each = [&max_runs, between, last](int i, kvf_xfer *x, cudaStream_t stream) {
        if (i <= 2 || (between == SpinAfter && i == 3)) CUDA_OK(cudaStreamSynchronize(stream));
        if (between == OtherRoute && i >= 3) {
          kvf_xfer_tuning t;
          kvf_xfer_get_tuning(x, &t);
          if (i == 3) max_runs = t.batch_max_runs;
          t.batch_max_runs = i == 3 ? 0 : max_runs;
          ASSERT_EQ(kvf_xfer_set_tuning(x, &t), KVF_SUCCESS) << kvf_last_error();
        }
        if (i == last) CUDA_OK(kvf_test_spin(stream, 200));
      };
      cfg.check_each = [last](int i, const kvf_xfer_path_info &p) {
        SCOPED_TRACE("call " + std::to_string(i));
        const bool batch = i <= 1 || i == last;
        EXPECT_EQ(p.path, batch ? KVF_PATH_COPY_BATCH : KVF_PATH_STAGED) << kvf_xfer_path_name(p.path);
        EXPECT_EQ(p.host_bound, i == 2 ? 1u : 0u);
        if (i == last) {
          EXPECT_EQ(p.dma_ops, 1u) << "queued work ahead: one batch call";
        }
      };
      run_gpu_case(s.g(), s.plan, KVF_FORMAT_CANONICAL, d, 0, 46 + (uint64_t)d, cfg);
    }
}

// Back to back on a host slower than the copies (KVF_XFER_BATCH_LINK_GBPS so
// high that every call is host-bound), a call that comes while the stream
// still works on the call before it goes staged: the stream waits for every
// other call (2, 4, 6 go staged on an idle stream) and the odd calls come
// right after, within the window (1 s here), milliseconds of the previous
// call's work still queued (sixteen chunks a call, the batch route's limit
// raised to fit them): they take the marks' branch. Two of the three
// suffice: a thread descheduled that long finds the previous call done.
TEST(XferGpu, HostBoundCallRightBehindThePreviousOneGoesStaged) {
  REQUIRE_GPU();
  for (Dir d : {Dir::Gather, Dir::Scatter}) {
    SCOPED_TRACE(dir_name(d));
    Prepared s;
    ASSERT_NO_FATAL_FAILURE(setup_chunks("deepseek-v3-mla-fp8-656", 16, 0, 47, &s));
    GpuConfig cfg;
    cfg.obj_kind = Mem::Pinned;
    cfg.route = expected_route(Mem::Pinned, d);
    cfg.calls = 8;
    cfg.sync_each = false;
    cfg.tune = [](kvf_xfer_tuning &t) {
      t.batch_link_gbps = KVF_BATCH_MAX_LINK_GBPS;
      t.batch_staged_cost = KVF_BATCH_STAGED_COST_EIGHTH; // the link rate is fake: a measured cost would be huge
      t.batch_back_to_back_us = KVF_BATCH_MAX_BACK_TO_BACK_US;
      t.batch_max_runs = 16 * 256;
    };
    cfg.before_each = [](int i, kvf_xfer *, cudaStream_t stream) {
      if (i % 2 == 0) CUDA_OK(cudaStreamSynchronize(stream));
    };
    int odd_staged = 0;
    cfg.check_each = [&odd_staged](int i, const kvf_xfer_path_info &p) {
      SCOPED_TRACE("call " + std::to_string(i));
      if (i <= 1) {
        EXPECT_EQ(p.path, KVF_PATH_COPY_BATCH) << "two batch calls measure the host first";
      } else if (i % 2 == 0) {
        EXPECT_EQ(p.path, KVF_PATH_STAGED) << "an idle stream: " << kvf_xfer_path_name(p.path);
        EXPECT_EQ(p.host_bound, 1u);
      } else if (p.path == KVF_PATH_STAGED) {
        EXPECT_EQ(p.host_bound, 1u);
        odd_staged++;
      }
    };
    run_gpu_case(s.g(), s.plan, KVF_FORMAT_CANONICAL, d, 0, 48 + (uint64_t)d, cfg);
    EXPECT_GE(odd_staged, 2) << "calls right behind the previous one's work took the batch route";
  }
}

// The staged route's cost back to back is measured on the context
// (KVF_XFER_BATCH_STAGED_COST 0, the default): the span on the stream of a
// staged host-bound call that came while the stream worked on the call
// before it, read by a later call once complete; from four measures on, a
// call back to back weighs their median, and until then the copies' time
// (host-bound calls back to back take the staged route and are measured). A
// call on an idle stream weighs both routes' latency alone (its milliseconds
// of host time against the staged route's 25-50 us and nanoseconds of copies:
// staged). With KVF_XFER_BATCH_LINK_GBPS set so high that every call is
// host-bound, a copy's time at that rate is nanoseconds, so the rule's
// verdict back to back turns on real times: the batch calls' host time
// against the measured span. Sixteen bf16 MLA chunks a call are 3904 runs of
// 72 KiB: 1.8-3.5 ms of batch-API host time on the H200's host (0.45-0.9 us
// a run) against a 5.2 ms copy at 55 GB/s, so the measures keep such calls
// batched. (Sixteen fp8 MLA chunks, 41 KiB runs, are a 3 ms copy for the
// same host time: a slow host rightly sends them staged.) The stream is
// synchronized before every even call and the odd ones come right behind
// it, milliseconds of the previous call still queued: calls 0 and 1 measure
// the host; calls weighed alone go staged; calls weighed back to back go
// staged until four spans are read, and take the batch route from then on.
// Every ninth host-bound call in a row takes the batch route to measure the
// host (KVF_BATCH_HOST_BOUND_RETRY). A fixed cost (KVF_XFER_BATCH_STAGED_COST
// 1125, the rule before it measured) keeps them all staged. Every call's
// bytes land as the reference says.
TEST(XferGpu, HostBoundRuleWeighsTheStagedRoutesMeasuredCost) {
  REQUIRE_GPU();
  for (int64_t fixed : {(int64_t)0, (int64_t)KVF_BATCH_STAGED_COST_EIGHTH})
    for (Dir d : {Dir::Gather, Dir::Scatter}) {
      SCOPED_TRACE(std::string(fixed ? "fixed cost, " : "measured cost, ") + dir_name(d));
      Prepared s;
      ASSERT_NO_FATAL_FAILURE(setup_chunks("deepseek-v3-mla-bf16", 16, 0, 49, &s));
      GpuConfig cfg;
      cfg.obj_kind = Mem::Pinned;
      cfg.route = expected_route(Mem::Pinned, d);
      cfg.calls = 24;
      cfg.sync_each = false;
      cfg.tune = [fixed](kvf_xfer_tuning &t) {
        t.batch_link_gbps = KVF_BATCH_MAX_LINK_GBPS;
        t.batch_staged_cost = fixed;
        t.batch_back_to_back_us = KVF_BATCH_MAX_BACK_TO_BACK_US;
        t.batch_max_runs = 16 * 256;
      };
      cfg.before_each = [](int i, kvf_xfer *, cudaStream_t stream) {
        if (i % 2 == 0) CUDA_OK(cudaStreamSynchronize(stream));
      };
      int staged_in_a_row = 0, explored = 0, batch_after_measures = 0;
      cfg.check_each = [&](int i, const kvf_xfer_path_info &p) {
        SCOPED_TRACE("call " + std::to_string(i));
        if (fixed) {
          EXPECT_EQ(p.staged_cost, (uint64_t)fixed);
          EXPECT_EQ(p.staged_cost_measures, 0u) << "a fixed cost is not measured";
        }
        const bool measured = p.staged_cost_measures >= KVF_STAGED_COST_SAMPLES;  // read at the call's start
        if (i <= 1) {
          EXPECT_EQ(p.path, KVF_PATH_COPY_BATCH) << "two batch calls measure the host first";
        } else if (staged_in_a_row == KVF_BATCH_HOST_BOUND_RETRY) {
          EXPECT_EQ(p.path, KVF_PATH_COPY_BATCH) << "the batch route measures the host again";
        } else if (p.back_to_back && measured && !fixed) {
          EXPECT_EQ(p.path, KVF_PATH_COPY_BATCH) << "the measured cost outlasts the host: "
                                                 << kvf_xfer_path_name(p.path);
          EXPECT_GT(p.staged_cost, (uint64_t)100000) << "a span of milliseconds against a copy of nanoseconds";
          batch_after_measures++;
        } else {
          EXPECT_EQ(p.path, KVF_PATH_STAGED) << "host-bound at a fixed or unmeasured cost: "
                                             << kvf_xfer_path_name(p.path);
          EXPECT_EQ(p.host_bound, 1u);
          if (p.back_to_back && !fixed) {
            EXPECT_EQ(p.staged_cost, (uint64_t)KVF_BATCH_STAGED_COST_UNMEASURED);
            explored++;
          }
        }
        staged_in_a_row = p.path == KVF_PATH_STAGED ? staged_in_a_row + 1 : 0;
      };
      run_gpu_case(s.g(), s.plan, KVF_FORMAT_CANONICAL, d, 0, 50 + (uint64_t)d, cfg);
      if (fixed) {
        EXPECT_EQ(batch_after_measures, 0);
      } else {
        // Each odd call from 3 on may be measured and read by the next (a
        // thread descheduled for milliseconds finds the stream idle and
        // goes unmeasured): four of the first nine suffice.
        EXPECT_GE(explored, KVF_STAGED_COST_SAMPLES) << "calls back to back unmeasured go staged";
        EXPECT_GE(batch_after_measures, 1) << "four odd calls were not measured and read";
      }
    }
}

// Behind queued work a host-bound request keeps the batch route: with a
// spin kernel holding the stream and the calls back to back, the first two
// measure the host, the third finds work queued on the stream (no earlier
// host-bound call to ask about) and the later ones find the stream still
// short of the call before them: the work queued ahead hides their host
// time, one batch call each. (Alone this test passes with the rule off as
// well; HostBoundBatchRequestGoesStagedAndMeasuresAgain shows it on.)
TEST(XferGpu, HostBoundBatchRequestBehindQueuedWorkStaysBatched) {
  REQUIRE_GPU();
  for (Dir d : {Dir::Gather, Dir::Scatter}) {
    SCOPED_TRACE(dir_name(d));
    Prepared s;
    ASSERT_NO_FATAL_FAILURE(setup_chunks("deepseek-v3-mla-fp8-656", 1, 0, 43, &s));
    GpuConfig cfg;
    cfg.obj_kind = Mem::Pinned;
    cfg.route = expected_route(Mem::Pinned, d);
    cfg.busy_ms = 200;  // far longer than the calls' host time
    cfg.calls = 5;
    cfg.sync_each = false;
    cfg.tune = [](kvf_xfer_tuning &t) {
      t.batch_link_gbps = KVF_BATCH_MAX_LINK_GBPS;
      t.batch_staged_cost = KVF_BATCH_STAGED_COST_EIGHTH; // the link rate is fake: a measured cost would be huge
    };
    cfg.check_each = [](int i, const kvf_xfer_path_info &p) {
      SCOPED_TRACE("call " + std::to_string(i));
      EXPECT_EQ(p.path, KVF_PATH_COPY_BATCH) << kvf_xfer_path_name(p.path);
      EXPECT_EQ(p.host_bound, 0u);
      if (i >= 1) {
        EXPECT_EQ(p.dma_ops, 1u) << "queued work ahead: one batch call";
      }
    };
    run_gpu_case(s.g(), s.plan, KVF_FORMAT_CANONICAL, d, 0, 44 + (uint64_t)d, cfg);
  }
}

// At the default cap a one-chunk request of these caches is small
// (KVF_XFER_SMALL_STAGE_MB): one piece, and a straight part of at least a
// tenth of it to hide that piece's kernel. Under an SM cap below 64 the
// straight part takes three times KVF_XFER_STAGE_STRAIGHT_KB (the slower
// kernels leave more to hide), and however large the target, the pick stops at half the batch and at
// KVF_STAGE_STRAIGHT_MAX_RUNS instead of leaving the call no straight part
// (a 4 MiB target did that to gpt-oss-like's one-chunk gather at 4 SMs, in
// kvf_bench's tables, whose sliding-window objects go direct).
// glm-like and gpt-oss-like (16 KiB runs) reach the run limit first, the
// MLA cache (72 KiB runs, 17 MiB a chunk) half the batch. Every call is
// checked against the CPU reference.
TEST(XferGpu, CappedCallsTakeALargerStraightPartWithinItsLimits) {
  REQUIRE_GPU();
  const uint64_t kib = 1024;
  int sms = 0;
  CUDA_OK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  for (const char *preset : {"glm-like-hybrid", "gpt-oss-20b-like", "deepseek-v3-mla-bf16"})
    for (Dir d : {Dir::Gather, Dir::Scatter}) {
      Prepared s;
      ASSERT_NO_FATAL_FAILURE(setup_chunks(preset, 1, 0, 61, &s));
      const uint64_t straight_kb[3] = {1024, 1024, 64 * 1024};  // default cap, 4 SMs, 4 SMs past every limit
      uint64_t bytes[3] = {0, 0, 0}, pieces[3] = {0, 0, 0}, payload = 0;
      for (int k = 0; k < 3; k++) {
        SCOPED_TRACE(std::string(preset) + ", " + dir_name(d) + ", case " + std::to_string(k));
        GpuConfig cfg;
        cfg.obj_kind = Mem::Pinned;
        cfg.route = expected_route(Mem::Pinned, d);
        cfg.max_sms = k == 0 ? 0 : 4;
        const uint64_t kb = straight_kb[k];
        cfg.tune = [kb](kvf_xfer_tuning &t) {
          t.batch_max_runs = 0;  // staged, the MLA cache too
          t.stage_straight_kb = (int64_t)kb;
          t.stage_straight_alone = 1;  // the gathers are alone on their stream
        };
        uint64_t *out = &bytes[k], *out_pieces = &pieces[k];
        cfg.check_path = [out, out_pieces](const kvf_xfer_path_info &p) {
          ASSERT_EQ(p.path, KVF_PATH_STAGED) << kvf_xfer_path_name(p.path);
          EXPECT_LE(p.straight_runs, (uint64_t)KVF_STAGE_STRAIGHT_MAX_RUNS);
          EXPECT_EQ(p.straight_runs > 0, p.straight_bytes > 0);
          *out = p.straight_bytes;
          *out_pieces = p.pieces;
        };
        kvf_xfer_stats st = KVF_XFER_STATS_INIT;
        ASSERT_NO_FATAL_FAILURE(run_gpu_case(s.g(), s.plan, KVF_FORMAT_CANONICAL, d, 0, 62 + (uint64_t)k, cfg, &st));
        payload = st.payload_bytes;
        // Here every object is staged and whole, so the batch is the payload.
        EXPECT_LE(bytes[k], st.payload_bytes / 2) << "the part stays within half the batch";
      }
      SCOPED_TRACE(std::string(preset) + ", " + dir_name(d));
      EXPECT_GE(bytes[0], 1024 * kib) << "the default cap's target, in whole layers";
      if (sms >= KVF_SMALL_STAGE_SMS) { // the small-request rule needs its 64 SMs
        EXPECT_EQ(pieces[0], 1u) << "a small request with a straight part is one piece";
        EXPECT_GE(bytes[0], payload / KVF_SMALL_STAGE_STRAIGHT_SHARE) << "which the straight part hides";
      }
      EXPECT_GE(bytes[1], KVF_STAGE_STRAIGHT_CAPPED_FACTOR * 1024 * kib) << "4 SMs: three times the target";
      EXPECT_GT(bytes[2], bytes[1]) << "a target past the limits still leaves a straight part, up to them";
    }
}

// A request ending 3 tokens into a block: the straight part's layers would
// carry a 6 KiB run a plane, under KVF_XFER_STAGE_STRAIGHT_MIN_RUN, so the
// call stages everything (and frees what it planned for the straight part
// once; the CPU case XferStraight.BatchRunsLeaveNothingToFreeWhenTheyDoNotFit
// checks the arrays are not left to free twice).
TEST(XferGpu, StraightPartFallsBackOnAShortLastBlock) {
  REQUIRE_GPU();
  for (Dir d : {Dir::Gather, Dir::Scatter}) {
    SCOPED_TRACE(dir_name(d));
    Prepared s;
    ASSERT_NO_FATAL_FAILURE(setup_chunks("llama-3.1-8b-fa-nhd", 0, 195, 41, &s));
    GpuConfig cfg;
    cfg.obj_kind = Mem::Pinned;
    cfg.route = expected_route(Mem::Pinned, d);
    cfg.tune = [](kvf_xfer_tuning &t) { t.batch_max_runs = 0; };
    cfg.check_path = [](const kvf_xfer_path_info &p) {
      EXPECT_EQ(p.path, KVF_PATH_STAGED) << kvf_xfer_path_name(p.path);
      EXPECT_EQ(p.straight_runs, 0u);
    };
    run_gpu_case(s.g(), s.plan, KVF_FORMAT_CANONICAL, d, 0, 42 + (uint64_t)d, cfg);
  }
}

TEST(XferGpu, HostRegisteredObjects) {
  REQUIRE_GPU();
  for (Dir d : {Dir::Gather, Dir::Scatter}) {
    SCOPED_TRACE(dir_name(d));
    Prepared s;
    ASSERT_NO_FATAL_FAILURE(setup_standard("glm-like-hybrid", true, 31, &s, true));
    GpuConfig cfg;
    cfg.obj_kind = Mem::Registered;
    cfg.route = expected_route(Mem::Registered, d);
    run_gpu_case(s.g(), s.plan, KVF_FORMAT_CANONICAL, d, 0, 32 + (uint64_t)d, cfg);
  }
}

TEST(XferGpu, PinnedCacheAndPinnedObjectsGoHostToHost) {
  REQUIRE_GPU();
  for (Dir d : {Dir::Gather, Dir::Scatter}) {
    SCOPED_TRACE(dir_name(d));
    Prepared s;
    ASSERT_NO_FATAL_FAILURE(setup_standard("gpt-oss-20b-like", false, 33, &s, true));
    GpuConfig cfg;
    cfg.cache_kind = Mem::Pinned;
    cfg.obj_kind = Mem::Pinned;
    cfg.route = KVF_ROUTE_HOST_TO_HOST;
    run_gpu_case(s.g(), s.plan, KVF_FORMAT_NATIVE, d, 0, 34 + (uint64_t)d, cfg);
  }
}

TEST(XferGpu, CacheOnAPeerGpu) {
  REQUIRE_GPU();
  REQUIRE_PEER();
  for (Dir d : {Dir::Gather, Dir::Scatter}) {
    SCOPED_TRACE(dir_name(d));
    Prepared s;
    ASSERT_NO_FATAL_FAILURE(setup_standard("glm-like-hybrid", true, 35, &s, true));
    GpuConfig cfg;
    cfg.cache_kind = Mem::Peer;
    cfg.obj_kind = Mem::Device;
    cfg.route = KVF_ROUTE_PEER;
    run_gpu_case(s.g(), s.plan, KVF_FORMAT_CANONICAL, d, 0, 36 + (uint64_t)d, cfg);
  }
}

TEST(XferGpu, LegacyDefaultStreamIsAccepted) {
  REQUIRE_GPU();
  Prepared s;
  ASSERT_NO_FATAL_FAILURE(setup_standard("llama-3.1-8b-fp8-inline-scales", false, 37, &s, true));
  GpuConfig cfg;
  cfg.legacy_stream = true;
  for (Dir d : {Dir::Gather, Dir::Scatter}) {
    SCOPED_TRACE(dir_name(d));
    run_gpu_case(s.g(), s.plan, KVF_FORMAT_NATIVE, d, 0, 38 + (uint64_t)d, cfg);
  }
}

TEST(XferGpu, MaxSmsCapsTheLaunch) {
  REQUIRE_GPU();
  Prepared s;
  ASSERT_NO_FATAL_FAILURE(setup_standard("llama-3.1-8b-fa-nhd", true, 41, &s, true));
  GpuConfig cfg;
  kvf_xfer_stats def = KVF_XFER_STATS_INIT;
  ASSERT_NO_FATAL_FAILURE(run_gpu_case(s.g(), s.plan, KVF_FORMAT_CANONICAL, Dir::Gather, 0, 42, cfg, &def));
  EXPECT_GT(def.sms, 3u) << "a default device-to-device launch of " << def.tasks
                         << " tasks should use more SMs than the caps below (else they prove nothing)";
  for (uint32_t cap : {1u, 3u}) {
    for (Dir d : {Dir::Gather, Dir::Scatter}) {
      SCOPED_TRACE("max_sms " + std::to_string(cap) + ", " + dir_name(d));
      cfg.max_sms = cap;
      kvf_xfer_stats st = KVF_XFER_STATS_INIT;
      ASSERT_NO_FATAL_FAILURE(run_gpu_case(s.g(), s.plan, KVF_FORMAT_CANONICAL, d, 0, 43 + cap, cfg, &st));
      EXPECT_LE(st.sms, cap);
      EXPECT_GE(st.sms, 1u);
    }
  }
}

TEST(XferGpu, CreateOnAnUnknownDeviceFails) {
  REQUIRE_GPU();
  GeometryPtr g = load_preset("glm-like-hybrid", 8);
  ASSERT_TRUE(g);
  int n = 0;
  CUDA_OK(cudaGetDeviceCount(&n));
  kvf_xfer_options opt = KVF_XFER_OPTIONS_INIT;
  opt.device = n;
  kvf_xfer *x = nullptr;
  EXPECT_EQ(kvf_xfer_create(g.get(), &opt, &x), KVF_ERR_INVALID_ARGUMENT) << kvf_last_error();
  EXPECT_EQ(x, nullptr);
}

TEST(XferGpu, BadRequestsAreRejectedBeforeAnythingIsEnqueued) {
  REQUIRE_GPU();
  Prepared s;
  ASSERT_NO_FATAL_FAILURE(setup_standard("glm-like-hybrid", true, 51, &s, true));
  std::mt19937_64 rng(52);
  Data live = make_inputs(s.g(), s.plan, Dir::Gather, 0, rng);
  DevSet dcache, dobjs;
  ASSERT_NO_FATAL_FAILURE(upload_new(live.cache, Mem::Device, 0, &dcache));
  ASSERT_NO_FATAL_FAILURE(upload_new(live.objs, Mem::Device, 0, &dobjs));
  XferPtr x = make_xfer(s.g(), 0);
  ASSERT_TRUE(x);
  Stream stream;
  // A good call first (into scratch objects), so the stats have something to keep.
  Data scratch = clone(live);
  DevSet sobjs;
  ASSERT_NO_FATAL_FAILURE(upload_new(scratch.objs, Mem::Device, 0, &sobjs));
  {
    Req good(s.plan, KVF_FORMAT_CANONICAL, dcache.payloads(), sobjs.payloads());
    ASSERT_EQ(kvf_xfer_gather(x.get(), good.get(), stream.s), KVF_SUCCESS) << kvf_last_error();
    CUDA_OK(cudaStreamSynchronize(stream.s));
  }
  bool sync_failed = false;
  Data got = clone(live);
  expect_bad_requests_rejected(
      s.g(), s.plan, x.get(), live, [&] { return std::make_pair(dcache.payloads(), dobjs.payloads()); },
      [&]() -> const Data & {
        if (cudaStreamSynchronize(stream.s) != cudaSuccess) sync_failed = true;
        download(dcache, got.cache);
        download(dobjs, got.objs);
        return got;
      },
      stream.s);
  EXPECT_FALSE(sync_failed);
  CUDA_OK(cudaGetLastError());
}

TEST(XferGpu, PageableHostMemoryIsRefused) {
  REQUIRE_GPU();
  Prepared s;
  ASSERT_NO_FATAL_FAILURE(setup_standard("glm-like-hybrid", true, 61, &s, true));
  std::mt19937_64 rng(62);
  XferPtr x = make_xfer(s.g(), 0);
  ASSERT_TRUE(x);
  Stream stream;
  struct Variant {
    Mem cache, objs;
    const char *field;
  };
  // Deferred, the context's thread finds it: the join (gather) or the query
  // (scatter) covering the call names the field, once.
  for (int defer : {0, 1})
  for (Variant v : {Variant{Mem::Device, Mem::Pageable, "objects"}, Variant{Mem::Pageable, Mem::Device, "region_bases"}})
    for (Dir d : {Dir::Gather, Dir::Scatter}) {
      SCOPED_TRACE(std::string(dir_name(d)) + ", pageable " + v.field + (defer ? ", deferred" : ""));
      Data live = make_inputs(s.g(), s.plan, d, 0, rng);
      DevSet dcache, dobjs;
      ASSERT_NO_FATAL_FAILURE(upload_new(live.cache, v.cache, 0, &dcache));
      ASSERT_NO_FATAL_FAILURE(upload_new(live.objs, v.objs, 0, &dobjs));
      Req r(s.plan, KVF_FORMAT_CANONICAL, dcache.payloads(), dobjs.payloads());
      ASSERT_EQ(kvf_copy_request_check(s.g(), r.get()), KVF_SUCCESS) << "the request is otherwise valid";
      uint64_t ticket = 0;
      kvf_status st = defer ? call_deferred(x.get(), d, r.get(), stream.s, &ticket) : call(x.get(), d, r.get(), stream.s);
      if (defer) {
        EXPECT_EQ(st, KVF_SUCCESS) << kvf_last_error();
        if (d == Dir::Gather) {
          st = kvf_xfer_join(x.get(), ticket, stream.s);
        } else {
          int done = 0;
          while ((st = kvf_xfer_query(x.get(), ticket, &done)) == KVF_SUCCESS && !done) std::this_thread::yield();
        }
      }
      EXPECT_EQ(st, KVF_ERR_INVALID_ARGUMENT);
      std::string msg = kvf_last_error();
      EXPECT_NE(msg.find(v.field), std::string::npos) << "the message should name " << v.field << ": " << msg;
      if (defer) {
        EXPECT_NE(msg.find("(call " + std::to_string(ticket) + ")"), std::string::npos) << msg;
        int done = 0;
        EXPECT_EQ(kvf_xfer_query(x.get(), ticket, &done), KVF_SUCCESS) << "reported once: " << kvf_last_error();
        EXPECT_EQ(kvf_xfer_flush(x.get()), KVF_SUCCESS) << "reported once: " << kvf_last_error();
      }
      CUDA_OK(cudaStreamSynchronize(stream.s));
      Data got = clone(live);
      ASSERT_NO_FATAL_FAILURE(download(dcache, got.cache));
      ASSERT_NO_FATAL_FAILURE(download(dobjs, got.objs));
      EXPECT_EQ(diff("cache region", got.cache, live.cache), "");
      EXPECT_EQ(diff("object", got.objs, live.objs), "");
    }
}

// RAII for a captured graph.
struct Graph {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  ~Graph() {
    if (exec) cudaGraphExecDestroy(exec);
    if (graph) cudaGraphDestroy(graph);
  }
};

// defer: the context's thread is started by a deferred call before the
// capture, and a deferred call on the capturing stream is refused (naming
// `after`), leaving the capture intact for the synchronous call.
void graph_case(Dir dir, bool upload_tables, int defer) {
  SCOPED_TRACE(upload_tables ? "tables uploaded" : "tables in kernel parameters");
  SCOPED_TRACE(defer ? "a deferred call first" : "no deferred call");
  Prepared s;
  ASSERT_NO_FATAL_FAILURE(setup_standard("glm-like-hybrid", true, 71 + (uint64_t)dir, &s, true));
  const kvf_geometry *g = s.g();
  std::mt19937_64 rng(72 + (uint64_t)dir);
  Data in1 = make_inputs(g, s.plan, dir, 0, rng, 0x5A), want1 = clone(in1);
  Data in2 = make_inputs(g, s.plan, dir, 0, rng, 0xA5), want2 = clone(in2);
  ASSERT_EQ(reference(g, s.plan, KVF_FORMAT_CANONICAL, dir, want1), KVF_SUCCESS);
  ASSERT_EQ(reference(g, s.plan, KVF_FORMAT_CANONICAL, dir, want2), KVF_SUCCESS);

  DevSet dcache, dobjs;
  ASSERT_NO_FATAL_FAILURE(upload_new(in1.cache, Mem::Device, 0, &dcache));
  ASSERT_NO_FATAL_FAILURE(upload_new(in1.objs, Mem::Device, 0, &dobjs));
  XferPtr x = make_xfer(g, 0);
  ASSERT_TRUE(x);
  if (upload_tables) {
    kvf_xfer_tuning t;
    kvf_xfer_get_tuning(x.get(), &t);
    t.param_bytes = 0;
    ASSERT_EQ(kvf_xfer_set_tuning(x.get(), &t), KVF_SUCCESS);
  }
  Stream stream;
  Graph graph;
  if (defer) {
    Req warm(s.plan, KVF_FORMAT_CANONICAL, dcache.payloads(), dobjs.payloads());
    uint64_t ticket = 0;
    ASSERT_EQ(call_deferred(x.get(), dir, warm.get(), stream.s, &ticket), KVF_SUCCESS) << kvf_last_error();
    ASSERT_EQ(kvf_xfer_join(x.get(), ticket, stream.s), KVF_SUCCESS) << kvf_last_error();
    CUDA_OK(cudaStreamSynchronize(stream.s));
    ASSERT_NO_FATAL_FAILURE(upload(in1.cache, dcache));
    ASSERT_NO_FATAL_FAILURE(upload(in1.objs, dobjs));
  }

  CUDA_OK(cudaStreamBeginCapture(stream.s, cudaStreamCaptureModeGlobal));
  auto r = std::make_unique<Req>(s.plan, KVF_FORMAT_CANONICAL, dcache.payloads(), dobjs.payloads());
  kvf_status refused = KVF_SUCCESS;
  std::string refusal;
  if (defer) {
    uint64_t ticket = 0;
    refused = call_deferred(x.get(), dir, r->get(), stream.s, &ticket);
    refusal = kvf_last_error();
  }
  kvf_status st = call(x.get(), dir, r->get(), stream.s);
  std::string msg = kvf_last_error();
  r->scrub();  // the captured work must not read these host arrays
  r.reset();
  cudaError_t end = cudaStreamEndCapture(stream.s, &graph.graph);  // end it before any assertion
  if (defer) {
    EXPECT_EQ(refused, KVF_ERR_INVALID_ARGUMENT) << refusal;
    EXPECT_EQ(refusal.rfind("after:", 0), 0u) << refusal;
  }
  ASSERT_EQ(st, KVF_SUCCESS) << msg;
  CUDA_OK(end);
  CUDA_OK(cudaGraphInstantiate(&graph.exec, graph.graph, 0));

  // Nothing ran at capture time.
  Data got = clone(in1);
  CUDA_OK(cudaStreamSynchronize(stream.s));
  ASSERT_NO_FATAL_FAILURE(download(dcache, got.cache));
  ASSERT_NO_FATAL_FAILURE(download(dobjs, got.objs));
  EXPECT_EQ(diff("cache region (before replay)", got.cache, in1.cache), "");
  EXPECT_EQ(diff("object (before replay)", got.objs, in1.objs), "");

  int replay = 0;
  for (const auto &[in, want] : {std::make_pair(&in1, &want1), std::make_pair(&in2, &want2)}) {
    SCOPED_TRACE("replay " + std::to_string(++replay));
    ASSERT_NO_FATAL_FAILURE(upload(in->cache, dcache));
    ASSERT_NO_FATAL_FAILURE(upload(in->objs, dobjs));
    CUDA_OK(cudaGraphLaunch(graph.exec, stream.s));
    CUDA_OK(cudaStreamSynchronize(stream.s));
    Data out = clone(*in);
    ASSERT_NO_FATAL_FAILURE(download(dcache, out.cache));
    ASSERT_NO_FATAL_FAILURE(download(dobjs, out.objs));
    EXPECT_EQ(diff("cache region", out.cache, want->cache), "");
    EXPECT_EQ(diff("object", out.objs, want->objs), "");
  }
}

TEST(XferGpu, GatherCapturedInAGraphReplaysTwice) {
  REQUIRE_GPU();
  for (int defer : {0, 1})
    for (bool upload : {false, true}) graph_case(Dir::Gather, upload, defer);
}

TEST(XferGpu, ScatterCapturedInAGraphReplaysTwice) {
  REQUIRE_GPU();
  for (int defer : {0, 1})
    for (bool upload : {false, true}) graph_case(Dir::Scatter, upload, defer);
}

// Host objects while capturing: neither the batch API nor the staged route
// can be captured; the direct kernel is, and replays exactly.
TEST(XferGpu, PinnedObjectsCapturedInAGraphTakeTheDirectKernel) {
  REQUIRE_GPU();
  for (Dir dir : {Dir::Gather, Dir::Scatter}) {
    SCOPED_TRACE(dir_name(dir));
    Prepared s;
    ASSERT_NO_FATAL_FAILURE(setup_chunks("llama-3.1-8b-fa-nhd", 1, 0, 75, &s));
    const kvf_geometry *g = s.g();
    std::mt19937_64 rng(76 + (uint64_t)dir);
    Data in = make_inputs(g, s.plan, dir, 0, rng), want = clone(in);
    ASSERT_EQ(reference(g, s.plan, KVF_FORMAT_CANONICAL, dir, want), KVF_SUCCESS);
    DevSet dcache, dobjs;
    ASSERT_NO_FATAL_FAILURE(upload_new(in.cache, Mem::Device, 0, &dcache));
    ASSERT_NO_FATAL_FAILURE(upload_new(in.objs, Mem::Pinned, 0, &dobjs));
    XferPtr x = make_xfer(g, 0);
    ASSERT_TRUE(x);
    Stream stream;
    Graph graph;
    CUDA_OK(cudaStreamBeginCapture(stream.s, cudaStreamCaptureModeGlobal));
    Req r(s.plan, KVF_FORMAT_CANONICAL, dcache.payloads(), dobjs.payloads());
    kvf_status st = call(x.get(), dir, r.get(), stream.s);
    std::string msg = kvf_last_error();
    cudaError_t end = cudaStreamEndCapture(stream.s, &graph.graph);
    ASSERT_EQ(st, KVF_SUCCESS) << msg;
    CUDA_OK(end);
    kvf_xfer_path_info path;
    kvf_xfer_last_path(x.get(), &path);
    EXPECT_EQ(path.path, KVF_PATH_KERNEL) << kvf_xfer_path_name(path.path);
    CUDA_OK(cudaGraphInstantiate(&graph.exec, graph.graph, 0));
    CUDA_OK(cudaGraphLaunch(graph.exec, stream.s));
    CUDA_OK(cudaStreamSynchronize(stream.s));
    Data got = clone(in);
    ASSERT_NO_FATAL_FAILURE(download(dcache, got.cache));
    ASSERT_NO_FATAL_FAILURE(download(dobjs, got.objs));
    EXPECT_EQ(diff("cache region", got.cache, want.cache), "");
    EXPECT_EQ(diff("object", got.objs, want.objs), "");
  }
}

// Behind a ~200 ms kernel on the same stream, the call must return at once,
// and its work must run after that kernel and the copies queued behind it.
TEST(XferGpu, CallDoesNotSynchronize) {
  REQUIRE_GPU();
  using clock = std::chrono::steady_clock;
  constexpr double kSpinMs = 200;
  Prepared s;
  ASSERT_NO_FATAL_FAILURE(setup_standard("gpt-oss-20b-like", true, 81, &s, true));
  const kvf_geometry *g = s.g();
  // Deferred calls too: the context's thread must wait for the spin and the
  // copies behind it as the stream does, and the join orders the stream
  // after the call.
  for (int defer : {0, 1})
  for (Dir dir : {Dir::Gather, Dir::Scatter}) {
    SCOPED_TRACE(std::string(dir_name(dir)) + (defer ? ", deferred" : ""));
    std::mt19937_64 rng(82 + (uint64_t)dir);
    Data old_in = make_inputs(g, s.plan, dir, 0, rng);
    Data in = make_inputs(g, s.plan, dir, 0, rng), want = clone(in);
    ASSERT_EQ(reference(g, s.plan, KVF_FORMAT_CANONICAL, dir, want), KVF_SUCCESS);
    DevSet dcache, dobjs, staged_cache, staged_objs;
    ASSERT_NO_FATAL_FAILURE(upload_new(old_in.cache, Mem::Device, 0, &dcache));
    ASSERT_NO_FATAL_FAILURE(upload_new(old_in.objs, Mem::Device, 0, &dobjs));
    ASSERT_NO_FATAL_FAILURE(upload_new(in.cache, Mem::Device, 0, &staged_cache));
    ASSERT_NO_FATAL_FAILURE(upload_new(in.objs, Mem::Device, 0, &staged_objs));
    XferPtr x = make_xfer(g, 0);
    ASSERT_TRUE(x);
    Stream stream;
    uint64_t ticket = 0;
    // Warm up (module loading, first-call allocations), then start from old_in.
    {
      Req warm(s.plan, KVF_FORMAT_CANONICAL, dcache.payloads(), dobjs.payloads());
      if (defer) {
        ASSERT_EQ(call_deferred(x.get(), dir, warm.get(), stream.s, &ticket), KVF_SUCCESS) << kvf_last_error();
        ASSERT_EQ(kvf_xfer_join(x.get(), ticket, stream.s), KVF_SUCCESS) << kvf_last_error();
      } else {
        ASSERT_EQ(call(x.get(), dir, warm.get(), stream.s), KVF_SUCCESS) << kvf_last_error();
      }
      CUDA_OK(cudaStreamSynchronize(stream.s));
      ASSERT_NO_FATAL_FAILURE(upload(old_in.cache, dcache));
      ASSERT_NO_FATAL_FAILURE(upload(old_in.objs, dobjs));
    }
    auto t_spin = clock::now();
    CUDA_OK(kvf_test_spin(stream.s, kSpinMs));
    // The real inputs arrive only after the spin: a transfer that ran early
    // would move old_in's bytes.
    for (auto [from, to] : {std::make_pair(&staged_cache, &dcache), std::make_pair(&staged_objs, &dobjs)})
      for (size_t i = 0; i < from->bufs.size(); i++)
        if (from->bufs[i]->total)
          CUDA_OK(cudaMemcpyAsync(to->bufs[i]->base, from->bufs[i]->base, from->bufs[i]->total,
                                  cudaMemcpyDeviceToDevice, stream.s));
    auto r = std::make_unique<Req>(s.plan, KVF_FORMAT_CANONICAL, dcache.payloads(), dobjs.payloads());
    auto t0 = clock::now();
    kvf_status st = defer ? call_deferred(x.get(), dir, r->get(), stream.s, &ticket) : call(x.get(), dir, r->get(), stream.s);
    auto t1 = clock::now();
    r->scrub();
    r.reset();
    cudaError_t q = cudaStreamQuery(stream.s);
    ASSERT_EQ(st, KVF_SUCCESS) << kvf_last_error();
    if (defer) {
      int done = 1;
      EXPECT_EQ(kvf_xfer_query(x.get(), ticket, &done), KVF_SUCCESS) << kvf_last_error();
      EXPECT_EQ(done, 0) << "the call's work was done while the stream still spun";
      ASSERT_EQ(kvf_xfer_join(x.get(), ticket, stream.s), KVF_SUCCESS) << kvf_last_error();
    }
    double call_ms = std::chrono::duration<double, std::milli>(t1 - t0).count();
    EXPECT_EQ(q, cudaErrorNotReady) << "the stream finished before the call returned: the call waited for it";
    EXPECT_LT(call_ms, kSpinMs / 4) << "the call took " << call_ms << " ms behind a " << kSpinMs << " ms kernel";
    CUDA_OK(cudaStreamSynchronize(stream.s));
    double total_ms = std::chrono::duration<double, std::milli>(clock::now() - t_spin).count();
    EXPECT_GT(total_ms, kSpinMs * 0.75) << "the spin kernel ran only " << total_ms << " ms: the check proves nothing";
    cudaGetLastError();  // cudaStreamQuery's cudaErrorNotReady
    Data got = clone(in);
    ASSERT_NO_FATAL_FAILURE(download(dcache, got.cache));
    ASSERT_NO_FATAL_FAILURE(download(dobjs, got.objs));
    EXPECT_EQ(diff("cache region", got.cache, want.cache), "");
    EXPECT_EQ(diff("object", got.objs, want.objs), "");
    EXPECT_EQ(kvf_xfer_flush(x.get()), KVF_SUCCESS) << kvf_last_error();
  }
}

// A device-to-device launch that may use every SM overlaps the stream's
// previous kernel (KVF_XFER_OVERLAP): it may start while that kernel runs,
// and each warp waits for it before touching memory. Here the previous
// kernel lets its dependents start at once and writes the cache's real
// bytes only after 20 ms: a gather that read before waiting would move the
// stale bytes. The scatter of the gathered objects into a second cache
// overlaps the gather the same way (the gather lets its dependents start as
// it begins). The same three kernels again captured into a graph (the
// overlap becomes a programmatic edge). A control first: a dependent that
// does not wait must read stale bytes, or this GPU did not overlap and the
// case cannot tell.
TEST(XferGpu, OverlappedLaunchesWaitForThePreviousKernel) {
  REQUIRE_GPU();
  int major = 0;
  CUDA_OK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0));
  if (major < 9) GTEST_SKIP() << "overlapped (programmatic dependent) launches need compute capability 9.0";
  constexpr double kLateMs = 20;  // far longer than enqueueing the two calls takes
  Prepared s;
  ASSERT_NO_FATAL_FAILURE(setup_chunks("llama-3.1-8b-fa-nhd", 1, 0, 97, &s));
  const kvf_geometry *g = s.g();
  std::mt19937_64 rng(98);
  Data stale = make_inputs(g, s.plan, Dir::Gather, 0, rng);
  Data in = make_inputs(g, s.plan, Dir::Gather, 0, rng), want = clone(in);
  ASSERT_EQ(reference(g, s.plan, KVF_FORMAT_CANONICAL, Dir::Gather, want), KVF_SUCCESS);
  Data want2{clone(in.cache), clone(want.objs)};  // the scatter's: want's objects into a poisoned cache
  fill(want2.cache, 0xA5);
  Set poisoned = clone(want2.cache);
  ASSERT_EQ(reference(g, s.plan, KVF_FORMAT_CANONICAL, Dir::Scatter, want2), KVF_SUCCESS);
  DevSet dcache, real, dobjs, dcache2, probe;
  ASSERT_NO_FATAL_FAILURE(upload_new(stale.cache, Mem::Device, 0, &dcache));
  ASSERT_NO_FATAL_FAILURE(upload_new(in.cache, Mem::Device, 0, &real));
  ASSERT_NO_FATAL_FAILURE(upload_new(stale.objs, Mem::Device, 0, &dobjs));
  ASSERT_NO_FATAL_FAILURE(upload_new(poisoned, Mem::Device, 0, &dcache2));
  ASSERT_NO_FATAL_FAILURE(upload_new(stale.cache, Mem::Device, 0, &probe));
  std::vector<void *> cache_at, real_at, probe_at;
  std::vector<size_t> bytes;
  for (size_t i = 0; i < dcache.bufs.size(); i++)
    if (dcache.bufs[i]->total) {
      cache_at.push_back(dcache.bufs[i]->base);
      real_at.push_back(real.bufs[i]->base);
      probe_at.push_back(probe.bufs[i]->base);
      bytes.push_back(dcache.bufs[i]->total);
    }
  const int n = (int)bytes.size();
  ASSERT_LE(n, KVF_TEST_MAX_COPIES);
  Stream stream;

  CUDA_OK(kvf_test_late_copy(stream.s, kLateMs, n, cache_at.data(), real_at.data(), bytes.data()));
  CUDA_OK(kvf_test_unwaiting_copy(stream.s, n, probe_at.data(), cache_at.data(), bytes.data()));
  CUDA_OK(cudaStreamSynchronize(stream.s));
  Set seen = clone(in.cache);
  ASSERT_NO_FATAL_FAILURE(download(probe, seen));
  if (diff("probe", seen, in.cache).empty())
    GTEST_SKIP() << "a dependent that does not wait read the late bytes: this GPU did not overlap the launches";
  ASSERT_NO_FATAL_FAILURE(upload(stale.cache, dcache));

  XferPtr x = make_xfer(g, 0);
  ASSERT_TRUE(x);
  kvf_xfer_tuning t;
  kvf_xfer_get_tuning(x.get(), &t);
  t.overlap = 1;  // whatever the environment says
  ASSERT_EQ(kvf_xfer_set_tuning(x.get(), &t), KVF_SUCCESS) << kvf_last_error();
  Req gather(s.plan, KVF_FORMAT_CANONICAL, dcache.payloads(), dobjs.payloads());
  Req scatter(s.plan, KVF_FORMAT_CANONICAL, dcache2.payloads(), dobjs.payloads());
  // Warm up (first-call work on the host), then start again from the stale bytes.
  ASSERT_EQ(call(x.get(), Dir::Gather, gather.get(), stream.s), KVF_SUCCESS) << kvf_last_error();
  ASSERT_EQ(call(x.get(), Dir::Scatter, scatter.get(), stream.s), KVF_SUCCESS) << kvf_last_error();
  CUDA_OK(cudaStreamSynchronize(stream.s));
  ASSERT_NO_FATAL_FAILURE(upload(stale.objs, dobjs));
  ASSERT_NO_FATAL_FAILURE(upload(poisoned, dcache2));
  kvf_xfer_path_info gp, sp;
  CUDA_OK(kvf_test_late_copy(stream.s, kLateMs, n, cache_at.data(), real_at.data(), bytes.data()));
  ASSERT_EQ(call(x.get(), Dir::Gather, gather.get(), stream.s), KVF_SUCCESS) << kvf_last_error();
  kvf_xfer_last_path(x.get(), &gp);
  ASSERT_EQ(call(x.get(), Dir::Scatter, scatter.get(), stream.s), KVF_SUCCESS) << kvf_last_error();
  kvf_xfer_last_path(x.get(), &sp);
  CUDA_OK(cudaStreamSynchronize(stream.s));
  EXPECT_EQ(gp.overlap_launches, 1u) << "the gather did not overlap: the case proves nothing";
  EXPECT_EQ(sp.overlap_launches, 1u) << "the scatter did not overlap: the case proves nothing";
  Data got = clone(in);
  ASSERT_NO_FATAL_FAILURE(download(dobjs, got.objs));
  EXPECT_EQ(diff("object", got.objs, want.objs), "");
  ASSERT_NO_FATAL_FAILURE(download(dcache2, got.cache));
  EXPECT_EQ(diff("second cache region", got.cache, want2.cache), "");

  // Captured: the same order must hold when the graph replays it.
  ASSERT_NO_FATAL_FAILURE(upload(stale.cache, dcache));
  ASSERT_NO_FATAL_FAILURE(upload(stale.objs, dobjs));
  ASSERT_NO_FATAL_FAILURE(upload(poisoned, dcache2));
  cudaGraph_t graph = nullptr;
  CUDA_OK(cudaStreamBeginCapture(stream.s, cudaStreamCaptureModeThreadLocal));
  CUDA_OK(kvf_test_late_copy(stream.s, kLateMs, n, cache_at.data(), real_at.data(), bytes.data()));
  kvf_status cs = call(x.get(), Dir::Gather, gather.get(), stream.s);
  kvf_status cs2 = cs == KVF_SUCCESS ? call(x.get(), Dir::Scatter, scatter.get(), stream.s) : cs;
  CUDA_OK(cudaStreamEndCapture(stream.s, &graph));
  ASSERT_EQ(cs, KVF_SUCCESS) << kvf_last_error();
  ASSERT_EQ(cs2, KVF_SUCCESS) << kvf_last_error();
  cudaGraphExec_t exec = nullptr;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  CUDA_OK(cudaGraphLaunch(exec, stream.s));
  CUDA_OK(cudaStreamSynchronize(stream.s));
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  Data replayed = clone(in);
  ASSERT_NO_FATAL_FAILURE(download(dobjs, replayed.objs));
  EXPECT_EQ(diff("object (graph)", replayed.objs, want.objs), "");
  ASSERT_NO_FATAL_FAILURE(download(dcache2, replayed.cache));
  EXPECT_EQ(diff("second cache region (graph)", replayed.cache, want2.cache), "");
}

TEST(XferGpu, ConcurrentCallsFromThreadsOnOneContext) {
  REQUIRE_GPU();
  Prepared s;
  ASSERT_NO_FATAL_FAILURE(setup_standard("glm-like-hybrid", true, 91, &s, true));
  std::mt19937_64 rng(92);
  Data in = make_inputs(s.g(), s.plan, Dir::Gather, 0, rng);
  Data want = clone(in);
  ASSERT_EQ(reference(s.g(), s.plan, KVF_FORMAT_CANONICAL, Dir::Gather, want), KVF_SUCCESS);
  DevSet dcache;
  ASSERT_NO_FATAL_FAILURE(upload_new(in.cache, Mem::Device, 0, &dcache));
  constexpr int kThreads = 4;
  std::vector<DevSet> dobjs(kThreads);
  for (auto &d : dobjs) ASSERT_NO_FATAL_FAILURE(upload_new(in.objs, Mem::Device, 0, &d));
  // Deferred: each thread posts on its own stream and joins the call back
  // into it, kRounds times. The transparent mode this replaced hung here
  // (its caller's stream waited for work not yet enqueued, on a hardware
  // queue the internal stream could share): run this case with
  // CUDA_DEVICE_MAX_CONNECTIONS=1 too, where every stream shares one.
  constexpr int kRounds = 8;
  for (int defer : {0, 1}) {
  SCOPED_TRACE(defer ? "deferred calls" : "synchronous calls");
  XferPtr x = make_xfer(s.g(), 0);
  ASSERT_TRUE(x);
  for (auto &d : dobjs) ASSERT_NO_FATAL_FAILURE(upload(in.objs, d));
  std::vector<std::unique_ptr<Stream>> streams;
  for (int t = 0; t < kThreads; t++) streams.push_back(std::make_unique<Stream>());
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; t++)
    threads.emplace_back([&, t] {
      cudaSetDevice(0);
      Req r(s.plan, KVF_FORMAT_CANONICAL, dcache.payloads(), dobjs[t].payloads());
      if (!defer) {
        if (kvf_xfer_gather(x.get(), r.get(), streams[t]->s) != KVF_SUCCESS) failures++;
        return;
      }
      for (int round = 0; round < kRounds; round++) {
        uint64_t ticket = 0;
        if (kvf_xfer_gather_deferred(x.get(), r.get(), streams[t]->s, &ticket) != KVF_SUCCESS ||
            kvf_xfer_join(x.get(), ticket, streams[t]->s) != KVF_SUCCESS)
          failures++;
      }
    });
  for (auto &t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
  for (int t = 0; t < kThreads; t++) {
    CUDA_OK(cudaStreamSynchronize(streams[t]->s));
    Set got = clone(in.objs);
    ASSERT_NO_FATAL_FAILURE(download(dobjs[t], got));
    EXPECT_EQ(diff("object", got, want.objs), "") << "thread " << t;
  }
  EXPECT_EQ(kvf_xfer_flush(x.get()), KVF_SUCCESS) << kvf_last_error();
  }
}

// Deferred calls queued behind a kernel, more of them than one context
// queues before posting waits (KVF_DEFER_DEPTH). Contexts 1 and 2 join the
// last call into the stream and the stream is synchronized before destroy:
// every call's bytes must be there. Context 2 takes the counter word
// context 1 gave back, with its value: counting from zero again would end
// its join's wait at once, before the work (the synchronize would return
// early and the objects would hold their poison). Context 3 is destroyed
// right after its last call, unjoined: destroy lets its thread enqueue
// every call and waits for their work.
TEST(XferGpu, DeferredCallsCompleteJoinedOrDestroyed) {
  REQUIRE_GPU();
  Prepared s;
  ASSERT_NO_FATAL_FAILURE(setup_standard("glm-like-hybrid", true, 121, &s, true));
  std::mt19937_64 rng(122);
  Data in = make_inputs(s.g(), s.plan, Dir::Gather, 0, rng), want = clone(in);
  ASSERT_EQ(reference(s.g(), s.plan, KVF_FORMAT_CANONICAL, Dir::Gather, want), KVF_SUCCESS);
  DevSet dcache;
  ASSERT_NO_FATAL_FAILURE(upload_new(in.cache, Mem::Device, 0, &dcache));
  constexpr int kCalls = 40;
  std::vector<DevSet> dobjs(kCalls);
  for (auto &d : dobjs) ASSERT_NO_FATAL_FAILURE(upload_new(in.objs, Mem::Pinned, 0, &d));
  Stream stream;
  for (int round = 0; round < 3; round++) {
    SCOPED_TRACE("context " + std::to_string(round + 1));
    for (auto &d : dobjs) ASSERT_NO_FATAL_FAILURE(upload(in.objs, d));
    XferPtr x = make_xfer(s.g(), 0);
    ASSERT_TRUE(x);
    CUDA_OK(kvf_test_spin(stream.s, 50));
    uint64_t ticket = 0;
    for (int i = 0; i < kCalls; i++) {
      Req r(s.plan, KVF_FORMAT_CANONICAL, dcache.payloads(), dobjs[i].payloads());
      ASSERT_EQ(kvf_xfer_gather_deferred(x.get(), r.get(), stream.s, &ticket), KVF_SUCCESS) << kvf_last_error();
    }
    EXPECT_EQ(ticket, (uint64_t)kCalls);
    if (round < 2) {
      ASSERT_EQ(kvf_xfer_join(x.get(), ticket, stream.s), KVF_SUCCESS) << kvf_last_error();
      CUDA_OK(cudaStreamSynchronize(stream.s));
      int done = 0;
      EXPECT_EQ(kvf_xfer_query(x.get(), ticket, &done), KVF_SUCCESS) << kvf_last_error();
      EXPECT_EQ(done, 1) << "the joined stream finished before the calls' work";
    }
    x.reset();
    CUDA_OK(cudaStreamSynchronize(stream.s));
    for (int i = 0; i < kCalls; i++) {
      Set got = clone(in.objs);
      ASSERT_NO_FATAL_FAILURE(download(dobjs[i], got));
      EXPECT_EQ(diff("object", got, want.objs), "") << "call " << i;
    }
  }
}

// Clears the staged failure hook when a case ends, passed or not.
struct FailAtBatch {
  explicit FailAtBatch(int64_t batch) { kvf_xfer_test_fail_at_batch(batch); }
  ~FailAtBatch() { kvf_xfer_test_fail_at_batch(-1); }
  FailAtBatch(const FailAtBatch &) = delete;
  FailAtBatch &operator=(const FailAtBatch &) = delete;
};

struct Event {
  cudaEvent_t e = nullptr;
  Event() { EXPECT_EQ(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), cudaSuccess); }
  ~Event() {
    if (e) cudaEventDestroy(e);
  }
  Event(const Event &) = delete;
  Event &operator=(const Event &) = delete;
};

// kvferry/transfer.h's failure contract on the staged route. A device cache
// and pinned objects; buffers small enough that the request takes at least
// three batches (KVF_XFER_STAGING_MB=1 when this process has not read it
// yet, as in a ctest run of this case alone; otherwise the request grows
// with the configured size). Batch 1's kernel launch is refused through the
// hook in host/core/xfer_internal.h, as the runtime would refuse it. Then:
// KVF_ERR_CUDA with a message naming the batch and the error; the objects
// (gather) or blocks (scatter) of the chunks before batch 1 written exactly
// as the CPU reference writes them, everything else keeping its poison (also
// a gather's object written in part, which the direct launch after the last
// batch would have moved); once an event recorded on the caller's stream
// has completed, no work of the call left on the internal copy-engine
// stream (it was joined back); and the stream and the context usable, the
// same call right after byte-exact.
TEST(XferGpu, StagedCallRefusedAtABatchKeepsTheBatchesBeforeIt) {
  REQUIRE_GPU();
  setenv("KVF_XFER_STAGING_MB", "1", 0);  // keeps a value the caller set
  int64_t mb = kvf_param_xfer_staging_mb();
  if (mb <= 0) GTEST_SKIP() << "KVF_XFER_STAGING_MB=" << mb << " turns the staged route off";
  const char *preset = "glm-like-hybrid";  // full, sliding-window and recurrent object groups
  GeometryPtr probe = load_preset(preset, 4);
  ASSERT_TRUE(probe) << kvf_last_error();
  uint64_t c = chunk_tokens(probe.get()), chunk_bytes = 0;
  for (uint32_t og = 0; og < kvf_geometry_num_object_groups(probe.get()); og++) {
    uint64_t size = 0;
    ASSERT_EQ(kvf_geometry_object_size(probe.get(), og, 0, c, &size), KVF_SUCCESS) << kvf_last_error();
    chunk_bytes += (size + KVF_STAGE_ALIGN - 1) / KVF_STAGE_ALIGN * KVF_STAGE_ALIGN;
  }
  // A fresh context's buffers: the configured size, or one chunk if larger.
  uint64_t cap = std::max<uint64_t>((uint64_t)mb << 20, chunk_bytes), chunks = 4 * (cap / chunk_bytes);
  if (chunks > 64)
    GTEST_SKIP() << "KVF_XFER_STAGING_MB=" << mb << " would need a request of " << chunks
                 << " chunks for three batches; run with KVF_XFER_STAGING_MB=1";
  constexpr uint64_t kRefused = 1;
  Prepared s;
  ASSERT_NO_FATAL_FAILURE(setup_chunks(preset, chunks, 0, 101, &s));
  const kvf_geometry *g = s.g();
  uint32_t nog = kvf_geometry_num_object_groups(g), og0 = object_group_of(g, 0);
  ASSERT_FALSE(is_recurrent(g, 0));
  s.plan.ids[0][3] = KVF_BLOCK_SKIP;  // a gather writes chunk 0's object of group 0 in part
  const std::pair<Dir, kvf_object_format> kCases[] = {{Dir::Gather, KVF_FORMAT_CANONICAL},
                                                      {Dir::Scatter, KVF_FORMAT_NATIVE},
                                                      {Dir::Gather, KVF_FORMAT_NATIVE}};
  // Deferred: the call returns KVF_SUCCESS, the context's thread meets the
  // refusal, and the join reports it (once); the rest holds.
  for (int defer : {0, 1})
  for (auto [dir, fmt] : kCases) {
    SCOPED_TRACE(std::string(dir_name(dir)) + ", " + format_name(fmt) + (defer ? ", deferred" : ""));
    const bool gather = dir == Dir::Gather;
    std::mt19937_64 rng(102 + (uint64_t)dir * 2 + (uint64_t)fmt);
    Data in = make_inputs(g, s.plan, dir, 0, rng), want = clone(in);
    ASSERT_EQ(reference(g, s.plan, fmt, dir, want), KVF_SUCCESS) << kvf_last_error();
    CUDA_OK(cudaSetDevice(0));
    DevSet dcache, dobjs;
    ASSERT_NO_FATAL_FAILURE(upload_new(in.cache, Mem::Device, 0, &dcache));
    ASSERT_NO_FATAL_FAILURE(upload_new(in.objs, Mem::Pinned, 0, &dobjs));
    XferPtr x = make_xfer(g, 0);
    ASSERT_TRUE(x);
    {
      kvf_xfer_tuning t;  // the staged route, not the copy-engine batch API
      kvf_xfer_get_tuning(x.get(), &t);
      t.batch_max_runs = 0;
      ASSERT_EQ(kvf_xfer_set_tuning(x.get(), &t), KVF_SUCCESS);
    }
    Stream stream;
    auto download_all = [&](Data *out) {
      *out = clone(in);
      download(dcache, out->cache);
      download(dobjs, out->objs);
    };

    // A successful call first: it is exact, takes the staged route and
    // sizes the buffers the plan below is read against. Then back to the
    // poisoned inputs.
    {
      Req r(s.plan, fmt, dcache.payloads(), dobjs.payloads());
      if (defer) {
        uint64_t ticket = 0;
        ASSERT_EQ(call_deferred(x.get(), dir, r.get(), stream.s, &ticket), KVF_SUCCESS) << kvf_last_error();
        ASSERT_EQ(kvf_xfer_join(x.get(), ticket, stream.s), KVF_SUCCESS) << kvf_last_error();
      } else {
        ASSERT_EQ(call(x.get(), dir, r.get(), stream.s), KVF_SUCCESS) << kvf_last_error();
      }
      CUDA_OK(cudaStreamSynchronize(stream.s));
      Data got;
      ASSERT_NO_FATAL_FAILURE(download_all(&got));
      EXPECT_EQ(diff("cache region (first call)", got.cache, want.cache), "");
      EXPECT_EQ(diff("object (first call)", got.objs, want.objs), "");
      EXPECT_EQ(stats_of(x.get()).route, expected_route(Mem::Pinned, dir));
      ASSERT_NO_FATAL_FAILURE(upload(in.cache, dcache));
      ASSERT_NO_FATAL_FAILURE(upload(in.objs, dobjs));
    }
    ASSERT_EQ(kvf_xfer_test_stage_bytes(x.get()), cap) << "the staging buffers are not the size the case assumes";

    // The batches the call enqueues.
    StagePlan sp;
    {
      Req r(s.plan, fmt, dcache.payloads(), dobjs.payloads());
      ASSERT_EQ(kvf_stage_plan_objects(g, r.get(), gather, &sp.p), KVF_SUCCESS) << kvf_last_error();
    }
    {
      kvf_xfer_tuning t;  // the batch sizes the context plans with
      kvf_xfer_get_tuning(x.get(), &t);
      kvf_stage_plan_batches(&sp.p, cap, (uint64_t)t.stage_edge_mb << 20, gather);
    }
    ASSERT_GE(sp.p.num_batches, 3u) << "the case needs batches before, at and after the refused one";
    ASSERT_EQ(sp.p.staged[og0] == 0, gather) << "chunk 0's object of group 0 goes direct for a gather only";
    const uint64_t kept = sp.p.batches[kRefused].k0;  // chunks [0, kept) are written

    // The refused call; its host arrays are scrubbed as soon as it returns.
    kvf_status st;
    std::string msg;
    {
      FailAtBatch hook(kRefused);
      auto r = std::make_unique<Req>(s.plan, fmt, dcache.payloads(), dobjs.payloads());
      uint64_t ticket = 0;
      st = defer ? call_deferred(x.get(), dir, r->get(), stream.s, &ticket) : call(x.get(), dir, r->get(), stream.s);
      msg = kvf_last_error();
      r->scrub();
      if (defer) {
        EXPECT_EQ(st, KVF_SUCCESS) << "a deferred call returns before it is planned: " << msg;
        EXPECT_EQ(ticket, 2u) << "the context's second deferred call";
        // Inside the hook's scope: the thread may not have reached it yet.
        st = kvf_xfer_join(x.get(), ticket, stream.s);
        msg = kvf_last_error();
        std::string named = std::string("deferred ") + dir_name(dir) + " (call 2): staged ";
        EXPECT_NE(msg.find(named), std::string::npos) << "message '" << msg << "' should say '" << named << "'";
        EXPECT_EQ(kvf_xfer_flush(x.get()), KVF_SUCCESS) << "a failure is reported once";
      }
    }
    EXPECT_EQ(st, KVF_ERR_CUDA) << msg;
    std::string where = std::string("staged ") + dir_name(dir) + ": enqueueing batch 1 of " +
                        std::to_string(sp.p.num_batches) + " (chunks " + std::to_string(kept) + "..";
    for (const std::string &part :
         {where, std::string(cudaGetErrorString(cudaErrorLaunchOutOfResources)),
          std::string("batches 0..0 were enqueued whole and will complete, batch 1 at most in part, nothing after it")})
      EXPECT_NE(msg.find(part), std::string::npos) << "message '" << msg << "' should say '" << part << "'";

    // Everything the call enqueued is ordered before later work on the
    // caller's stream: once that has run, the internal stream is idle.
    {
      Event done;
      CUDA_OK(cudaEventRecord(done.e, stream.s));
      CUDA_OK(cudaEventSynchronize(done.e));
      auto ce = reinterpret_cast<cudaStream_t>(kvf_xfer_test_ce_stream(x.get()));
      ASSERT_NE(ce, nullptr);
      cudaError_t q = cudaStreamQuery(ce);
      EXPECT_EQ(q, cudaSuccess) << "work of the refused call still runs on the internal stream ("
                                << cudaGetErrorName(q) << "): it was not joined back into the caller's stream";
      cudaGetLastError();
      CUDA_OK(cudaStreamQuery(stream.s));
    }

    // What it wrote: the chunks before the refused batch, nothing else.
    Data got, expect = clone(in);
    ASSERT_NO_FATAL_FAILURE(download_all(&got));
    if (gather) {
      for (uint64_t i = 0; i < kept * nog; i++)
        if (sp.p.staged[i]) std::memcpy(expect.objs[i].bytes(), want.objs[i].bytes(), want.objs[i].total());
    } else {
      Plan head = s.plan;
      head.token_end = head.token_begin + kept * c;
      ASSERT_EQ(reference(g, head, fmt, dir, expect), KVF_SUCCESS) << kvf_last_error();
    }
    EXPECT_EQ(diff("cache region (refused call)", got.cache, expect.cache), "");
    EXPECT_EQ(diff("object (refused call)", got.objs, expect.objs), "");
    if (gather) {
      EXPECT_EQ(diff("object (refused call; must keep the poison)", {got.objs[og0]}, {in.objs[og0]}), "")
          << "the object written in part moves in the direct launch after the last batch";
    }

    // The same call again on the same context and stream: exact.
    {
      Req r(s.plan, fmt, dcache.payloads(), dobjs.payloads());
      ASSERT_EQ(call(x.get(), dir, r.get(), stream.s), KVF_SUCCESS) << kvf_last_error();
      CUDA_OK(cudaStreamSynchronize(stream.s));
      CUDA_OK(cudaGetLastError());
      ASSERT_NO_FATAL_FAILURE(download_all(&got));
      EXPECT_EQ(diff("cache region (call after)", got.cache, want.cache), "");
      EXPECT_EQ(diff("object (call after)", got.objs, want.objs), "");
      kvf_xfer_stats stt = stats_of(x.get());
      EXPECT_EQ(stt.route, expected_route(Mem::Pinned, dir));
      EXPECT_EQ(stt.payload_bytes, plan_payload(g, s.plan));
    }
  }
}

TEST(XferGpu, CurrentDeviceIsRestored) {
  REQUIRE_GPU();
  REQUIRE_PEER();
  GeometryPtr g = load_preset("glm-like-hybrid", 8);
  ASSERT_TRUE(g);
  CUDA_OK(cudaSetDevice(1));
  XferPtr x = make_xfer(g.get(), 0);
  ASSERT_TRUE(x);
  int cur = -1;
  CUDA_OK(cudaGetDevice(&cur));
  EXPECT_EQ(cur, 1) << "kvf_xfer_create changed the current device";
  x.reset();
  CUDA_OK(cudaGetDevice(&cur));
  EXPECT_EQ(cur, 1) << "kvf_xfer_destroy changed the current device";
  CUDA_OK(cudaSetDevice(0));
}

#else  // !KVF_WITH_CUDA

TEST(XferGpu, NotBuilt) { GTEST_SKIP() << "built without CUDA (KVF_WITH_CUDA off): the GPU cases are not compiled"; }

#endif

}  // namespace
