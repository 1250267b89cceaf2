// kvferryd's data path (host/dataplane.h): STORE and RETRIEVE through a real
// server (host/server.h, on a thread of this process) into its L1 object
// store, on the host backend. Engines are in-process clients, or forked
// processes where the test kills them; their KV caches are memfd
// allocations (KVF_MEM_PROVIDER_HOST) holding every region of the geometry.
//
// The oracle is the CPU reference (kvferry/copy.h): the cache a RETRIEVE
// leaves is the reference gather of the source cache (its STORE tables) into
// objects, scattered into a copy of the destination's initial bytes through
// the destination tables restricted as the contract says (full groups: the
// whole prefix; sliding windows: kvf_geometry_retained_blocks at the
// prefix; recurrent: the slot, with the state of chunk prefix/C - 1). Every
// byte of the allocation is compared, so padding and blocks that must not
// move keep their poison.
//
// Geometries: the glm-like-hybrid preset (full, sliding_window 512 and
// recurrent groups; chunk_tokens 256; three object groups) with num_blocks
// cut down, and small full-attention geometries written here (padded
// blocks, chunk_tokens 64).
#include <gtest/gtest.h>

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <kvferry/client.h>
#include <kvferry/copy.h>
#include <kvferry/geometry.h>
#include <kvferry/memory.h>

#include "server_test_util.h"
#include "common/error.h"
#include "host/client/client_internal.h"
#include "host/server/dataplane.h"
#include "host/server/registry.h"
#include "host/server/server.h"

namespace {

using Clock = std::chrono::steady_clock;

void sleep_ms(int ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); }

int64_t ms_since(Clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count();
}

bool has(const char *haystack, const std::string &needle) {
  return std::string(haystack).find(needle) != std::string::npos;
}

using kvf_server_test::preset_json;
using kvf_server_test::splitmix;

// A temporary directory; the server's socket directory is <tmp>/s.
struct TempDir : kvf_server_test::TempDir {
  TempDir() : kvf_server_test::TempDir("kvf-dataplane") {}
};

// ---- geometries ----------------------------------------------------------------

// The hybrid preset: 8 regions, groups full / sliding(512) / recurrent.
std::string hybrid_json(uint32_t nb) { return preset_json("glm-like-hybrid.json", nb); }
constexpr uint32_t kHybridBlocks = 160;
constexpr uint64_t kHybridTokens = 1024; // 4 chunks; the window (512) spans the last two

// Pure full attention: 2 layers in 2 regions, K and V planes, `heads` heads
// of head_bytes, 16-token blocks padded by 256 bytes (the copies must leave
// the padding alone), chunk_tokens `chunk`.
std::string small_json(uint32_t nb, uint32_t heads = 1, uint32_t head_bytes = 128, uint32_t chunk = 64) {
  uint32_t token_stride = heads * head_bytes, block_stride = 16 * token_stride + 256;
  char buf[2048];
  snprintf(buf, sizeof buf, R"({
  "format": "kvferry-geometry", "version": 1, "name": "dataplane-small",
  "regions": [{"name": "kv", "count": 2, "size": 0}],
  "groups": [{"name": "full", "kind": "full", "block_size": 16, "num_blocks": %u,
    "layers": [{"count": 2, "name": "layer", "region": "kv", "region_step": 1, "offset": 0,
      "elem_bytes": 2, "block_stride": %u, "planes": 2, "heads": %u, "head_bytes": %u,
      "plane_stride": "num_blocks * block_stride", "token_stride": %u, "head_stride": %u}]}],
  "objects": {"chunk_tokens": %u, "format": "canonical"}
})",
           nb, block_stride, heads, head_bytes, token_stride, head_bytes, chunk);
  return buf;
}

kvf_geometry *load(const std::string &json) {
  kvf_geometry *g = nullptr;
  kvf_geometry_error err;
  EXPECT_EQ(kvf_geometry_load_buffer(json.data(), json.size(), nullptr, &g, &err), KVF_SUCCESS) << kvf_last_error();
  return g;
}

uint32_t chunk_tokens(const kvf_geometry *g) {
  kvf_object_policy pol = KVF_OBJECT_POLICY_INIT;
  kvf_geometry_policy(g, &pol);
  return pol.chunk_tokens;
}

kvf_group_info group_info(const kvf_geometry *g, uint32_t i) {
  kvf_group_info gi = KVF_GROUP_INFO_INIT;
  EXPECT_EQ(kvf_geometry_group(g, i, &gi), KVF_SUCCESS);
  return gi;
}

// Chunk keys of a prompt of `tokens` token ids drawn from `seed`, all under
// one model's seed: the same prompt gives the same keys in every geometry
// (the server tells geometries apart, not the keys).
std::vector<kvf_chunk_key> prompt_keys(const kvf_geometry *g, uint64_t seed, uint64_t tokens) {
  std::vector<uint32_t> ids(tokens);
  uint64_t s = seed * 7919 + 17;
  for (auto &t : ids) t = (uint32_t)(splitmix(&s) % 151552);
  uint32_t C = chunk_tokens(g);
  std::vector<kvf_chunk_key> keys((tokens + C - 1) / C);
  kvf_chunk_key model;
  EXPECT_EQ(kvf_chunk_seed("test-model", 10, &model), KVF_SUCCESS);
  uint64_t n = kvf_chunk_keys(&model, ids.data(), 4, tokens, C, keys.data());
  EXPECT_EQ(n, keys.size());
  return keys;
}

// ---- memory --------------------------------------------------------------------

// Page-aligned host bytes (the reference copies need aligned region bases).
struct Bytes {
  uint8_t *p = nullptr;
  size_t n = 0;
  explicit Bytes(size_t size) : n(size) {
    void *q = nullptr;
    if (posix_memalign(&q, 4096, size ? size : 1) == 0) p = static_cast<uint8_t *>(q);
  }
  Bytes(const Bytes &) = delete;
  Bytes &operator=(const Bytes &) = delete;
  ~Bytes() { free(p); }
};

// Where each region lives inside one allocation (as tools/demo_served.c).
struct Layout {
  std::vector<uint64_t> offsets, sizes;
  uint64_t total = 0;
  explicit Layout(const kvf_geometry *g) {
    for (uint32_t r = 0; r < kvf_geometry_num_regions(g); r++) {
      kvf_region_info ri = KVF_REGION_INFO_INIT;
      kvf_geometry_region(g, r, &ri);
      uint64_t align = ri.align < 4096 ? 4096 : ri.align;
      total = (total + align - 1) / align * align;
      offsets.push_back(total);
      sizes.push_back(ri.size);
      total += ri.size;
    }
  }
  std::vector<void *> bases(uint8_t *base) const {
    std::vector<void *> b;
    for (uint64_t o : offsets) b.push_back(base + o);
    return b;
  }
};

void fill(uint8_t *p, uint64_t n, uint64_t seed) {
  uint64_t s = seed;
  uint64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t v = splitmix(&s);
    memcpy(p + i, &v, 8);
  }
  for (; i < n; i++) p[i] = (uint8_t)splitmix(&s);
}

// "" when equal, else where the first difference is and how many bytes differ.
std::string compare(const uint8_t *got, const uint8_t *want, uint64_t n, const Layout &lay) {
  if (memcmp(got, want, n) == 0) return "";
  uint64_t first = UINT64_MAX, count = 0;
  for (uint64_t i = 0; i < n; i++)
    if (got[i] != want[i]) {
      if (first == UINT64_MAX) first = i;
      count++;
    }
  int region = -1;
  for (size_t r = 0; r < lay.offsets.size(); r++)
    if (first >= lay.offsets[r] && first < lay.offsets[r] + lay.sizes[r]) region = (int)r;
  char b[256];
  snprintf(b, sizeof b, "%" PRIu64 " bytes differ, the first at offset %" PRIu64 " (region %d, +%" PRIu64 ")", count,
           first, region, region >= 0 ? first - lay.offsets[(size_t)region] : 0);
  return b;
}

// ---- block tables --------------------------------------------------------------

// One group's blocks: attention groups move local blocks [first, first + n);
// a recurrent group's one slot holds the state of chunk `first`.
struct Span {
  uint64_t first = 0, n = 0;
};

struct Tables {
  std::vector<std::vector<uint32_t>> ids;
  std::vector<uint64_t> first;
  std::vector<kvf_group_blocks> view() const {
    std::vector<kvf_group_blocks> v(ids.size());
    for (size_t i = 0; i < ids.size(); i++)
      v[i] = {ids[i].empty() ? nullptr : ids[i].data(), first[i], (uint32_t)ids[i].size()};
    return v;
  }
};

// Block ids 0 .. nb-1 shuffled by seed: groups that alias one tensor take
// disjoint ids from it, as an engine does.
std::vector<uint32_t> shuffled(uint32_t nb, uint64_t seed) {
  std::vector<uint32_t> p(nb);
  for (uint32_t i = 0; i < nb; i++) p[i] = i;
  uint64_t s = seed;
  for (uint32_t i = nb - 1; i > 0; i--) std::swap(p[i], p[splitmix(&s) % (i + 1)]);
  return p;
}

Tables make_tables(const std::vector<Span> &spans, const std::vector<uint32_t> &pool, size_t offset = 0) {
  Tables t;
  size_t next = offset;
  for (const Span &s : spans) {
    t.first.push_back(s.first);
    t.ids.emplace_back();
    for (uint64_t k = 0; k < s.n; k++) t.ids.back().push_back(pool.at(next++));
  }
  return t;
}

// What a STORE of [tb, te) gives: every block of the range for full groups,
// the window retained at te for sliding ones (every block with
// whole_windowed), the state at te for recurrent ones (none without
// `recurrent`, or when te is not on a chunk boundary).
std::vector<Span> store_spans(const kvf_geometry *g, uint64_t tb, uint64_t te, bool whole_windowed = false,
                              bool recurrent = true) {
  std::vector<Span> v;
  uint32_t C = chunk_tokens(g);
  for (uint32_t i = 0; i < kvf_geometry_num_groups(g); i++) {
    kvf_group_info gi = group_info(g, i);
    Span s;
    if (gi.kind == KVF_GROUP_RECURRENT) {
      if (recurrent && te % C == 0) s = {te / C - 1, 1};
    } else {
      uint64_t lb = 0, le = 0;
      EXPECT_EQ(kvf_geometry_local_blocks(g, i, tb, te, &lb, &le), KVF_SUCCESS);
      if (gi.kind != KVF_GROUP_FULL && !whole_windowed) {
        uint64_t fb = 0, eb = 0;
        EXPECT_EQ(kvf_geometry_retained_blocks(g, i, te, &fb, &eb), KVF_SUCCESS);
        lb = std::max(lb, fb);
        le = std::min(le, eb);
      }
      s = {lb, le > lb ? le - lb : 0};
    }
    v.push_back(s);
  }
  return v;
}

// What a RETRIEVE of [tb, te) gives: the engine's whole table for every
// attention group (the server picks the retained blocks), one recurrent slot.
std::vector<Span> retrieve_spans(const kvf_geometry *g, uint64_t tb, uint64_t te, bool recurrent = true) {
  std::vector<Span> v;
  for (uint32_t i = 0; i < kvf_geometry_num_groups(g); i++) {
    kvf_group_info gi = group_info(g, i);
    if (gi.kind == KVF_GROUP_RECURRENT) {
      v.push_back({0, recurrent ? 1u : 0u});
      continue;
    }
    uint64_t lb = 0, le = 0;
    EXPECT_EQ(kvf_geometry_local_blocks(g, i, tb, te, &lb, &le), KVF_SUCCESS);
    v.push_back({lb, le - lb});
  }
  return v;
}

// The destination tables as the contract restricts them for a prefix P.
Tables restrict_to(const kvf_geometry *g, const Tables &t, uint64_t P) {
  Tables r = t;
  uint32_t C = chunk_tokens(g);
  for (uint32_t i = 0; i < kvf_geometry_num_groups(g); i++) {
    kvf_group_info gi = group_info(g, i);
    if (r.ids[i].empty()) continue;
    if (gi.kind == KVF_GROUP_RECURRENT) {
      r.first[i] = P / C - 1;
      continue;
    }
    uint64_t fb = 0, eb = 0;
    EXPECT_EQ(kvf_geometry_retained_blocks(g, i, P, &fb, &eb), KVF_SUCCESS);
    for (size_t k = 0; k < r.ids[i].size(); k++) {
      uint64_t blk = r.first[i] + k;
      if (blk < fb || blk >= eb) r.ids[i][k] = KVF_BLOCK_SKIP;
    }
  }
  return r;
}

// Counts a request moving `t` over [tb, P) must report: whole blocks per
// group, objects whose chunk moves a block of their object group, their bytes.
struct Counts {
  uint64_t objects = 0, bytes = 0;
  std::vector<uint64_t> blocks;
};

Counts expect_counts(const kvf_geometry *g, const Tables &t, uint64_t tb, uint64_t P) {
  Counts c;
  uint32_t C = chunk_tokens(g), ng = kvf_geometry_num_groups(g), nog = kvf_geometry_num_object_groups(g);
  c.blocks.assign(ng, 0);
  auto moving = [&](uint32_t i, uint64_t blk) {
    if (blk < t.first[i] || blk - t.first[i] >= t.ids[i].size()) return false;
    return t.ids[i][blk - t.first[i]] != KVF_BLOCK_SKIP;
  };
  for (uint32_t i = 0; i < ng; i++) {
    kvf_group_info gi = group_info(g, i);
    for (size_t k = 0; k < t.ids[i].size(); k++) {
      uint64_t blk = t.first[i] + k;
      if (t.ids[i][k] == KVF_BLOCK_SKIP) continue;
      if (gi.kind == KVF_GROUP_RECURRENT) {
        if ((blk + 1) * C > tb && (blk + 1) * C <= P) c.blocks[i]++;
      } else if (blk >= tb / gi.block_size && blk < P / gi.block_size) {
        c.blocks[i]++;
      }
    }
  }
  for (uint64_t cb = tb; cb < P; cb += C) {
    uint64_t ce = std::min<uint64_t>(cb + C, P);
    for (uint32_t og = 0; og < nog; og++) {
      bool moves = false;
      for (uint32_t i = 0; i < ng; i++) {
        kvf_group_info gi = group_info(g, i);
        if (gi.object_group != og) continue;
        if (gi.kind == KVF_GROUP_RECURRENT) {
          moves |= ce == P && ce - cb == C && moving(i, cb / C);
          continue;
        }
        for (uint64_t blk = cb / gi.block_size; blk < (ce + gi.block_size - 1) / gi.block_size; blk++)
          moves |= moving(i, blk);
      }
      if (!moves) continue;
      uint64_t bytes = 0;
      EXPECT_EQ(kvf_geometry_object_size(g, og, cb / C, P, &bytes), KVF_SUCCESS);
      c.objects++;
      c.bytes += bytes;
    }
  }
  return c;
}

// The oracle: into `dst` (a whole allocation of layout `lay`), what a RETRIEVE
// of [tb, P) through dst_tables leaves, the objects having been stored from
// `src` through src_tables.
void apply_retrieve(const kvf_geometry *g, kvf_object_format format, const Layout &lay, uint8_t *src,
                    const Tables &src_tables, uint8_t *dst, const Tables &dst_tables, uint64_t tb, uint64_t P) {
  uint32_t C = chunk_tokens(g), nog = kvf_geometry_num_object_groups(g);
  uint64_t chunks = (P - tb + C - 1) / C;
  std::vector<std::unique_ptr<Bytes>> store;
  std::vector<void *> objects(chunks * nog);
  for (uint64_t k = 0; k < chunks; k++)
    for (uint32_t og = 0; og < nog; og++) {
      uint64_t bytes = 0;
      ASSERT_EQ(kvf_geometry_object_size(g, og, tb / C + k, P, &bytes), KVF_SUCCESS);
      store.emplace_back(new Bytes(bytes));
      memset(store.back()->p, 0xA5, bytes);
      objects[k * nog + og] = store.back()->p;
    }
  std::vector<void *> sb = lay.bases(src), db = lay.bases(dst);
  std::vector<kvf_group_blocks> sg = src_tables.view();
  Tables r = restrict_to(g, dst_tables, P);
  std::vector<kvf_group_blocks> dg = r.view();
  kvf_copy_request q = KVF_COPY_REQUEST_INIT;
  q.token_begin = tb;
  q.token_end = P;
  q.format = format;
  q.objects = objects.data();
  q.region_bases = sb.data();
  q.groups = sg.data();
  ASSERT_EQ(kvf_reference_gather(g, &q), KVF_SUCCESS) << kvf_last_error();
  q.region_bases = db.data();
  q.groups = dg.data();
  ASSERT_EQ(kvf_reference_scatter(g, &q), KVF_SUCCESS) << kvf_last_error();
}

// ---- the server ------------------------------------------------------------------

struct ServerConfig {
  uint64_t l1_bytes = 256ull << 20;
  uint32_t fail_step = 0;
  uint16_t fail_type = 0;
  uint32_t delay_ms = 0;
  uint32_t timeout_ms = 0;
};

struct Server : kvf_server_test::InProcessServer {
  kvf_status start(const std::string &dir, const ServerConfig &cfg = ServerConfig()) {
    kvf_server_options o = KVF_SERVER_OPTIONS_INIT;
    o.socket_dir = dir.c_str();
    o.heartbeat_timeout_ms = 60000;
    o.l1_bytes = cfg.l1_bytes;
    o.test_fail_step = cfg.fail_step;
    o.test_fail_type = cfg.fail_type;
    o.test_completion_delay_ms = cfg.delay_ms;
    o.request_timeout_ms = cfg.timeout_ms;
    return InProcessServer::start(o);
  }

  kvf_registry_stats reg() {
    kvf_registry_stats r = KVF_REGISTRY_STATS_INIT;
    EXPECT_EQ(kvf_server_stats(s, &r), KVF_SUCCESS) << kvf_last_error();
    return r;
  }
  kvf_dataplane_stats data() {
    kvf_dataplane_stats d;
    memset(&d, 0, sizeof d);
    EXPECT_EQ(kvf_server_data_stats(s, &d), KVF_SUCCESS) << kvf_last_error();
    return d;
  }
  // Wait until nothing is in flight, leased, reserved or pinned.
  bool wait_idle(int64_t ms = 10000) {
    auto t0 = Clock::now();
    for (;;) {
      kvf_dataplane_stats d = data();
      kvf_registry_stats r = reg();
      if (d.in_flight == 0 && d.l1.objects_reserved == 0 && d.l1.objects_pinned == 0 && r.leases == 0) return true;
      if (ms_since(t0) > ms) return false;
      sleep_ms(2);
    }
  }
};

// Nothing held: no request in flight, no lease, no reservation, no pin.
void expect_nothing_held(Server &srv, const std::string &when) {
  EXPECT_TRUE(srv.wait_idle()) << when;
  kvf_dataplane_stats d = srv.data();
  EXPECT_EQ(d.in_flight, 0u) << when;
  EXPECT_EQ(d.l1.objects_reserved, 0u) << when;
  EXPECT_EQ(d.l1.bytes_reserved, 0u) << when;
  EXPECT_EQ(d.l1.objects_pinned, 0u) << when;
  EXPECT_EQ(srv.reg().leases, 0u) << when;
}

// ---- engines -----------------------------------------------------------------------

// An engine: its geometry (the test's copy, for the oracle), its cache (one
// memfd allocation holding every region), its client and registration.
struct Engine {
  std::string json;
  kvf_geometry *g = nullptr;
  std::unique_ptr<Layout> lay;
  kvf_mem_alloc *alloc = nullptr;
  kvf_client *c = nullptr;
  kvf_client_registration reg = KVF_CLIENT_REGISTRATION_INIT;

  Engine() = default;
  Engine(const Engine &) = delete;
  Engine &operator=(const Engine &) = delete;
  ~Engine() { close(); }

  // Load json, allocate and fill the cache from fill_seed. Returns "" or why not.
  std::string create(const std::string &geometry_json, uint64_t fill_seed) {
    json = geometry_json;
    kvf_geometry_error err;
    if (kvf_geometry_load_buffer(json.data(), json.size(), nullptr, &g, &err) != KVF_SUCCESS)
      return std::string("geometry: ") + kvf_last_error();
    lay.reset(new Layout(g));
    kvf_mem_alloc_options o = KVF_MEM_ALLOC_OPTIONS_INIT;
    o.provider = KVF_MEM_PROVIDER_HOST;
    o.size = lay->total;
    o.name = "kvf-test-dataplane";
    if (kvf_mem_alloc_create(&o, &alloc) != KVF_SUCCESS) return std::string("alloc: ") + kvf_last_error();
    fill(mem(), lay->total, fill_seed);
    return "";
  }
  // Connect and register. Returns "" or why not.
  std::string attach(const std::string &dir, const char *name, bool do_register = true) {
    kvf_client_options co = KVF_CLIENT_OPTIONS_INIT;
    co.socket_dir = dir.c_str();
    co.name = name;
    co.timeout_ms = 20000;
    if (kvf_client_connect(&co, &c, nullptr) != KVF_SUCCESS) return std::string("connect: ") + kvf_last_error();
    if (!do_register) return "";
    return attach_again();
  }
  // Register the cache again on the connected client (replacing the live
  // registration). Returns "" or why not.
  std::string attach_again() {
    std::vector<kvf_client_region> regions;
    for (size_t r = 0; r < lay->offsets.size(); r++) regions.push_back({alloc, lay->offsets[r], lay->sizes[r]});
    if (kvf_client_register(c, json.data(), json.size(), -1, regions.data(), (uint32_t)regions.size(), &reg) !=
        KVF_SUCCESS)
      return std::string("register: ") + kvf_last_error();
    return "";
  }
  std::string open(const std::string &dir, const std::string &geometry_json, uint64_t fill_seed,
                   const char *name) {
    std::string why = create(geometry_json, fill_seed);
    return why.empty() ? attach(dir, name) : why;
  }
  uint8_t *mem() const { return static_cast<uint8_t *>(kvf_mem_alloc_ptr(alloc)); }
  uint64_t size() const { return lay->total; }
  std::unique_ptr<Bytes> snapshot() const {
    std::unique_ptr<Bytes> b(new Bytes(size()));
    memcpy(b->p, mem(), size());
    return b;
  }
  void close() {
    kvf_client_disconnect(c);
    c = nullptr;
    kvf_mem_alloc_destroy(alloc);
    alloc = nullptr;
    kvf_geometry_destroy(g);
    g = nullptr;
  }
};

// A kvf_client_xfer and (copies of) the arrays it points to.
struct Xfer {
  kvf_client_xfer x = KVF_CLIENT_XFER_INIT;
  Tables t;
  std::vector<kvf_group_blocks> gb;
  std::vector<kvf_chunk_key> keys;
  Xfer(const Xfer &) = delete;
  Xfer &operator=(const Xfer &) = delete;
  Xfer(const Tables &tables, const std::vector<kvf_chunk_key> &all_keys, uint32_t C, uint64_t tb, uint64_t te,
       kvf_object_format format = KVF_FORMAT_CANONICAL)
      : t(tables) {
    gb = t.view();
    for (uint64_t k = tb / C; k < (te + C - 1) / C; k++) keys.push_back(all_keys.at(k));
    x.token_begin = tb;
    x.token_end = te;
    x.format = format;
    x.chunk_keys = keys.data();
    x.num_chunk_keys = (uint32_t)keys.size();
    x.groups = gb.data();
    x.num_groups = (uint32_t)gb.size();
  }
};

std::string result_text(const kvf_client_result &r) {
  char b[512];
  int n = snprintf(b, sizeof b, "status %s outcome %d prefix %" PRIu64 " objects %" PRIu64 " present %" PRIu64
                   " bytes %" PRIu64 " blocks [",
                   kvf_status_string(r.status), (int)r.outcome, r.prefix_tokens, r.objects_done, r.objects_present,
                   r.bytes_done);
  for (uint32_t i = 0; i < r.num_groups && n < 400; i++) n += snprintf(b + n, sizeof b - n, " %" PRIu64, r.group_blocks[i]);
  n += snprintf(b + n, sizeof b - n, " ] og_prefix [");
  for (uint32_t i = 0; i < r.num_object_groups && n < 480; i++)
    n += snprintf(b + n, sizeof b - n, " %" PRIu64, r.object_group_prefix[i]);
  snprintf(b + n, sizeof b - n, " ]");
  return b;
}

// The result's counts equal `c` (and prefix P).
void expect_result(const kvf_client_result &r, uint64_t P, const Counts &c, const std::string &what) {
  SCOPED_TRACE(what + ": " + result_text(r));
  EXPECT_EQ(r.status, KVF_SUCCESS);
  EXPECT_EQ(r.outcome, KVF_CLIENT_DONE);
  EXPECT_EQ(r.prefix_tokens, P);
  EXPECT_EQ(r.objects_done, c.objects);
  EXPECT_EQ(r.bytes_done, c.bytes);
  ASSERT_EQ(r.num_groups, c.blocks.size());
  for (size_t i = 0; i < c.blocks.size(); i++) EXPECT_EQ(r.group_blocks[i], c.blocks[i]) << "group " << i;
}

void expect_og_prefix(const kvf_client_result &r, const std::vector<uint64_t> &want, const std::string &what) {
  ASSERT_EQ(r.num_object_groups, want.size()) << what;
  for (size_t i = 0; i < want.size(); i++)
    EXPECT_EQ(r.object_group_prefix[i], want[i]) << what << ": object group " << i << ": " << result_text(r);
}

// A result that reports nothing moved at token_begin tb.
void expect_nothing_moved(const kvf_client_result &r, uint64_t tb, const std::string &what) {
  EXPECT_EQ(r.prefix_tokens, tb) << what << ": " << result_text(r);
  EXPECT_EQ(r.objects_done, 0u) << what << ": " << result_text(r);
  EXPECT_EQ(r.bytes_done, 0u) << what << ": " << result_text(r);
  for (uint32_t i = 0; i < r.num_groups; i++) EXPECT_EQ(r.group_blocks[i], 0u) << what << ": group " << i;
}

// ---- 1. Round trip, both object formats. ------------------------------------

TEST(Dataplane, RoundTripRestoresEveryByteInBothFormats) {
  TempDir tmp;
  Server srv;
  ASSERT_EQ(srv.start(tmp.sock()), KVF_SUCCESS) << kvf_last_error();
  const std::string json = hybrid_json(kHybridBlocks);
  Engine src, dst;
  ASSERT_EQ(src.open(tmp.sock(), json, 101, "source"), "");
  ASSERT_EQ(dst.open(tmp.sock(), json, 202, "destination"), "");
  const kvf_geometry *g = src.g;
  const uint32_t C = chunk_tokens(g), nog = kvf_geometry_num_object_groups(g);
  ASSERT_EQ(C, 256u);
  ASSERT_EQ(nog, 3u);
  const uint64_t T = kHybridTokens;

  uint64_t committed = 0, committed_bytes = 0;
  const kvf_object_format formats[] = {KVF_FORMAT_CANONICAL, KVF_FORMAT_NATIVE};
  for (int f = 0; f < 2; f++) {
    SCOPED_TRACE(kvf_object_format_name(formats[f]));
    std::vector<kvf_chunk_key> keys = prompt_keys(g, 1000 + f, T);
    Tables st = make_tables(store_spans(g, 0, T), shuffled(kHybridBlocks, 11 + f));
    Tables rt = make_tables(retrieve_spans(g, 0, T), shuffled(kHybridBlocks, 23 + f));
    Counts sc = expect_counts(g, st, 0, T);
    // Full: 4 objects; sliding: the 2 chunks of the window; recurrent: 1.
    EXPECT_EQ(sc.objects, 7u);
    kvf_client_result r = KVF_CLIENT_RESULT_INIT;
    Xfer sx(st, keys, C, 0, T, formats[f]);
    ASSERT_EQ(kvf_client_store(src.c, &sx.x, &r), KVF_SUCCESS) << kvf_last_error();
    expect_result(r, T, sc, "store");
    EXPECT_EQ(r.objects_present, 0u);
    EXPECT_EQ(r.group_blocks[0], 64u); // 1024 tokens of 16-token blocks
    EXPECT_EQ(r.group_blocks[1], 32u); // the 512-token window
    EXPECT_EQ(r.group_blocks[2], 1u);
    committed += sc.objects;
    committed_bytes += sc.bytes;

    // The same store again: everything is already held.
    kvf_client_result r2 = KVF_CLIENT_RESULT_INIT;
    ASSERT_EQ(kvf_client_store(src.c, &sx.x, &r2), KVF_SUCCESS) << kvf_last_error();
    EXPECT_EQ(r2.objects_done, 0u) << result_text(r2);
    EXPECT_EQ(r2.objects_present, sc.objects) << result_text(r2);
    EXPECT_EQ(r2.prefix_tokens, T) << result_text(r2);

    kvf_dataplane_stats d = srv.data();
    EXPECT_EQ(d.l1.objects, committed);
    EXPECT_EQ(d.l1.bytes_committed, committed_bytes);
    EXPECT_EQ(d.l1.objects_reserved, 0u);

    // Retrieve into the other registration: other block ids, poison everywhere.
    std::unique_ptr<Bytes> want = dst.snapshot();
    std::unique_ptr<Bytes> src_bytes = src.snapshot();
    apply_retrieve(g, formats[f], *dst.lay, src_bytes->p, st, want->p, rt, 0, T);
    kvf_client_result rr = KVF_CLIENT_RESULT_INIT;
    Xfer rx(rt, keys, C, 0, T, formats[f]);
    ASSERT_EQ(kvf_client_retrieve(dst.c, &rx.x, &rr), KVF_SUCCESS) << kvf_last_error();
    Counts rc = expect_counts(g, restrict_to(g, rt, T), 0, T);
    EXPECT_EQ(rc.objects, 7u);
    expect_result(rr, T, rc, "retrieve");
    expect_og_prefix(rr, {T, T, T}, "retrieve");
    EXPECT_EQ(compare(dst.mem(), want->p, dst.size(), *dst.lay), "");
    // The source's cache is untouched by its own store.
    EXPECT_EQ(compare(src.mem(), src_bytes->p, src.size(), *src.lay), "");
    expect_nothing_held(srv, "after the round trip");
  }
  kvf_dataplane_stats d = srv.data();
  EXPECT_EQ(d.l1.objects, committed);
  EXPECT_EQ(d.l1.committed_total, committed);
  EXPECT_EQ(d.stores_total, 4u);
  EXPECT_EQ(d.retrieves_total, 2u);
  EXPECT_EQ(d.done_total, 6u);
  EXPECT_EQ(d.failed_total + d.timed_out_total + d.cancelled_total, 0u);
  // STAT over the socket says the same.
  kvf_client_stats cs = KVF_CLIENT_STATS_INIT;
  ASSERT_EQ(kvf_client_stat(dst.c, &cs), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(cs.l1_objects, committed) << "STAT does not report L1's objects";
  EXPECT_EQ(cs.l1_bytes, committed_bytes);
  EXPECT_EQ(cs.stores_total, 4u);
  EXPECT_EQ(cs.retrieves_total, 2u);
  EXPECT_GE(cs.lanes, 1u);
  EXPECT_EQ(cs.leases, 0u);
}

// ---- 2. Retained window and recurrent state. --------------------------------

TEST(Dataplane, RetrieveWritesOnlyTheWindowAndTheRecurrentSlot) {
  TempDir tmp;
  Server srv;
  ASSERT_EQ(srv.start(tmp.sock()), KVF_SUCCESS) << kvf_last_error();
  const std::string json = hybrid_json(kHybridBlocks);
  Engine src, dst;
  ASSERT_EQ(src.open(tmp.sock(), json, 303, "source"), "");
  ASSERT_EQ(dst.open(tmp.sock(), json, 404, "destination"), "");
  const kvf_geometry *g = src.g;
  const uint32_t C = chunk_tokens(g);
  const uint64_t T = kHybridTokens;

  // Store every sliding block (objects for all 4 chunks of the window group).
  std::vector<kvf_chunk_key> keys = prompt_keys(g, 77, T);
  Tables st = make_tables(store_spans(g, 0, T, /*whole_windowed=*/true), shuffled(kHybridBlocks, 5));
  kvf_client_result r = KVF_CLIENT_RESULT_INIT;
  Xfer sx(st, keys, C, 0, T);
  ASSERT_EQ(kvf_client_store(src.c, &sx.x, &r), KVF_SUCCESS) << kvf_last_error();
  Counts sc = expect_counts(g, st, 0, T);
  EXPECT_EQ(sc.objects, 9u);
  expect_result(r, T, sc, "store");
  EXPECT_EQ(r.group_blocks[1], 64u);

  // The retrieve reads only the window's objects and writes only its blocks.
  Tables rt = make_tables(retrieve_spans(g, 0, T), shuffled(kHybridBlocks, 6));
  std::unique_ptr<Bytes> want = dst.snapshot();
  std::unique_ptr<Bytes> sb = src.snapshot();
  apply_retrieve(g, KVF_FORMAT_CANONICAL, *dst.lay, sb->p, st, want->p, rt, 0, T);
  kvf_client_result rr = KVF_CLIENT_RESULT_INIT;
  Xfer rx(rt, keys, C, 0, T);
  ASSERT_EQ(kvf_client_retrieve(dst.c, &rx.x, &rr), KVF_SUCCESS) << kvf_last_error();
  Counts rc = expect_counts(g, restrict_to(g, rt, T), 0, T);
  EXPECT_EQ(rc.objects, 7u); // not 9: the sliding objects of chunks 0 and 1 are not read
  expect_result(rr, T, rc, "retrieve");
  EXPECT_EQ(rr.group_blocks[1], 32u);
  EXPECT_EQ(compare(dst.mem(), want->p, dst.size(), *dst.lay), "");
  // Directly: the sliding blocks before the window kept their poison, and
  // the recurrent slot holds the source's state of chunk 3.
  {
    kvf_view_desc v = KVF_VIEW_DESC_INIT;
    ASSERT_EQ(kvf_geometry_view(g, 1, 0, &v), KVF_SUCCESS);
    uint8_t *d = dst.mem() + dst.lay->offsets[v.region] + v.offset;
    const uint8_t *p0 = want->p + dst.lay->offsets[v.region] + v.offset; // == the poison there
    for (uint64_t blk = 0; blk < 32; blk++) {
      uint64_t at = (uint64_t)rt.ids[1][blk] * v.block_stride;
      ASSERT_EQ(memcmp(d + at, p0 + at, v.block_stride), 0) << "sliding block " << blk << " was written";
    }
    kvf_view_desc rv = KVF_VIEW_DESC_INIT;
    ASSERT_EQ(kvf_geometry_view(g, 2, 0, &rv), KVF_SUCCESS);
    const uint8_t *s = src.mem() + src.lay->offsets[rv.region] + rv.offset + (uint64_t)st.ids[2][0] * rv.block_stride;
    const uint8_t *q = dst.mem() + dst.lay->offsets[rv.region] + rv.offset + (uint64_t)rt.ids[2][0] * rv.block_stride;
    for (uint32_t k = 0; k < rv.num_states; k++)
      EXPECT_EQ(memcmp(s + rv.states[k].offset, q + rv.states[k].offset, rv.states[k].bytes), 0) << "state " << k;
  }
  expect_nothing_held(srv, "after the windowed retrieve");

  // Stored without the recurrent slot: the recurrent object group misses,
  // so nothing is restored at all.
  std::vector<kvf_chunk_key> keys2 = prompt_keys(g, 78, T);
  Tables st2 = make_tables(store_spans(g, 0, T, false, /*recurrent=*/false), shuffled(kHybridBlocks, 7));
  kvf_client_result r2 = KVF_CLIENT_RESULT_INIT;
  Xfer sx2(st2, keys2, C, 0, T);
  ASSERT_EQ(kvf_client_store(src.c, &sx2.x, &r2), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(r2.objects_done, 6u) << result_text(r2);
  EXPECT_EQ(r2.prefix_tokens, T) << result_text(r2); // the held prefix counts full attention
  EXPECT_EQ(r2.group_blocks[2], 0u);
  uint64_t objects_before = srv.data().l1.objects;
  std::unique_ptr<Bytes> before = dst.snapshot();
  kvf_client_result rr2 = KVF_CLIENT_RESULT_INIT;
  Xfer rx2(rt, keys2, C, 0, T);
  ASSERT_EQ(kvf_client_retrieve(dst.c, &rx2.x, &rr2), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(rr2.status, KVF_SUCCESS);
  expect_nothing_moved(rr2, 0, "recurrent state missing");
  expect_og_prefix(rr2, {T, T, 0}, "recurrent state missing");
  EXPECT_EQ(compare(dst.mem(), before->p, dst.size(), *dst.lay), "") << "a miss wrote the cache";
  expect_nothing_held(srv, "after the recurrent miss");
  EXPECT_EQ(srv.data().l1.objects, objects_before);
}

// ---- 3. Partial prefix. -----------------------------------------------------

TEST(Dataplane, PartialPrefixRestoresExactlyTheStoredHalf) {
  TempDir tmp;
  Server srv;
  ASSERT_EQ(srv.start(tmp.sock()), KVF_SUCCESS) << kvf_last_error();
  const std::string json = hybrid_json(kHybridBlocks);
  Engine src, dst;
  ASSERT_EQ(src.open(tmp.sock(), json, 505, "source"), "");
  ASSERT_EQ(dst.open(tmp.sock(), json, 606, "destination"), "");
  const kvf_geometry *g = src.g;
  const uint32_t C = chunk_tokens(g);
  const uint64_t T = kHybridTokens, H = T / 2;
  std::vector<kvf_chunk_key> keys = prompt_keys(g, 91, T);

  // The first two chunks, window and state at 512 (all chained keys of the
  // whole prompt are known, only the first two are stored).
  Tables st = make_tables(store_spans(g, 0, H), shuffled(kHybridBlocks, 31));
  kvf_client_result r = KVF_CLIENT_RESULT_INIT;
  Xfer sx(st, keys, C, 0, H);
  ASSERT_EQ(kvf_client_store(src.c, &sx.x, &r), KVF_SUCCESS) << kvf_last_error();
  expect_result(r, H, expect_counts(g, st, 0, H), "store of the first half");

  Tables rt = make_tables(retrieve_spans(g, 0, T), shuffled(kHybridBlocks, 32));
  std::unique_ptr<Bytes> want = dst.snapshot();
  std::unique_ptr<Bytes> sb = src.snapshot();
  apply_retrieve(g, KVF_FORMAT_CANONICAL, *dst.lay, sb->p, st, want->p, rt, 0, H);
  kvf_client_result rr = KVF_CLIENT_RESULT_INIT;
  Xfer rx(rt, keys, C, 0, T);
  ASSERT_EQ(kvf_client_retrieve(dst.c, &rx.x, &rr), KVF_SUCCESS) << kvf_last_error();
  Counts rc = expect_counts(g, restrict_to(g, rt, H), 0, H);
  EXPECT_EQ(rc.objects, 5u); // 2 full + 2 sliding (the window at 512) + the state
  expect_result(rr, H, rc, "retrieve of the whole range");
  EXPECT_EQ(rr.group_blocks[0], 32u);
  EXPECT_EQ(rr.group_blocks[1], 32u);
  expect_og_prefix(rr, {H, H, H}, "retrieve of the whole range");
  EXPECT_EQ(compare(dst.mem(), want->p, dst.size(), *dst.lay), "");
  expect_nothing_held(srv, "after the partial retrieve");

  // The second half stored by a second request: the whole prefix comes back.
  Tables st2 = make_tables(store_spans(g, H, T), shuffled(kHybridBlocks, 33));
  kvf_client_result r2 = KVF_CLIENT_RESULT_INIT;
  Xfer sx2(st2, keys, C, H, T);
  ASSERT_EQ(kvf_client_store(src.c, &sx2.x, &r2), KVF_SUCCESS) << kvf_last_error();
  expect_result(r2, T, expect_counts(g, st2, H, T), "store of the second half");
  // Oracle for the whole prefix: full blocks of the first half from st, the
  // rest (window, state at 1024) from st2.
  Tables both = st;
  for (uint32_t i = 0; i < kvf_geometry_num_groups(g); i++) {
    kvf_group_info gi = group_info(g, i);
    if (gi.kind == KVF_GROUP_FULL) {
      both.ids[i].insert(both.ids[i].end(), st2.ids[i].begin(), st2.ids[i].end());
    } else {
      both.ids[i] = st2.ids[i];
      both.first[i] = st2.first[i];
    }
  }
  Tables rt2 = make_tables(retrieve_spans(g, 0, T), shuffled(kHybridBlocks, 34));
  std::unique_ptr<Bytes> want2 = dst.snapshot();
  apply_retrieve(g, KVF_FORMAT_CANONICAL, *dst.lay, sb->p, both, want2->p, rt2, 0, T);
  kvf_client_result rr2 = KVF_CLIENT_RESULT_INIT;
  Xfer rx2(rt2, keys, C, 0, T);
  ASSERT_EQ(kvf_client_retrieve(dst.c, &rx2.x, &rr2), KVF_SUCCESS) << kvf_last_error();
  expect_result(rr2, T, expect_counts(g, restrict_to(g, rt2, T), 0, T), "retrieve after both halves");
  EXPECT_EQ(compare(dst.mem(), want2->p, dst.size(), *dst.lay), "");
}

// A prompt that ends inside a block: the last chunk's object holds its 8
// tokens, and only whole blocks are counted (a partly written block is
// never reported as moved), on both sides.
TEST(Dataplane, PartialLastChunkCountsWholeBlocksOnly) {
  TempDir tmp;
  Server srv;
  ASSERT_EQ(srv.start(tmp.sock()), KVF_SUCCESS) << kvf_last_error();
  const std::string json = small_json(64);
  Engine src, dst;
  ASSERT_EQ(src.open(tmp.sock(), json, 111, "source"), "");
  ASSERT_EQ(dst.open(tmp.sock(), json, 222, "destination"), "");
  const kvf_geometry *g = src.g;
  const uint32_t C = chunk_tokens(g);
  const uint64_t T = C + 8; // 72 tokens: 4 whole blocks and 8 tokens of a fifth
  std::vector<kvf_chunk_key> keys = prompt_keys(g, 12, T);
  ASSERT_EQ(keys.size(), 2u);
  Tables st = make_tables(store_spans(g, 0, T), shuffled(64, 1));
  ASSERT_EQ(st.ids[0].size(), 5u);
  kvf_client_result r = KVF_CLIENT_RESULT_INIT;
  Xfer sx(st, keys, C, 0, T);
  ASSERT_EQ(kvf_client_store(src.c, &sx.x, &r), KVF_SUCCESS) << kvf_last_error();
  Counts sc = expect_counts(g, st, 0, T);
  EXPECT_EQ(sc.blocks[0], 4u);
  EXPECT_EQ(sc.bytes, 32768u + 8 * 512u);
  expect_result(r, T, sc, "store");

  Tables rt = make_tables(retrieve_spans(g, 0, T), shuffled(64, 2));
  std::unique_ptr<Bytes> want = dst.snapshot();
  std::unique_ptr<Bytes> sb = src.snapshot();
  apply_retrieve(g, KVF_FORMAT_CANONICAL, *dst.lay, sb->p, st, want->p, rt, 0, T);
  kvf_client_result rr = KVF_CLIENT_RESULT_INIT;
  Xfer rx(rt, keys, C, 0, T);
  ASSERT_EQ(kvf_client_retrieve(dst.c, &rx.x, &rr), KVF_SUCCESS) << kvf_last_error();
  expect_result(rr, T, expect_counts(g, restrict_to(g, rt, T), 0, T), "retrieve");
  EXPECT_EQ(rr.group_blocks[0], 4u);
  EXPECT_EQ(compare(dst.mem(), want->p, dst.size(), *dst.lay), "");
  expect_nothing_held(srv, "after the partial chunk");
}

// ---- 4. Bad requests: an ERROR naming the field; nothing written, nothing held. ---

TEST(Dataplane, BadRequestsNameTheFieldAndHoldNothing) {
  TempDir tmp;
  Server srv;
  ASSERT_EQ(srv.start(tmp.sock()), KVF_SUCCESS) << kvf_last_error();
  const std::string json = hybrid_json(kHybridBlocks);
  Engine src, dst;
  ASSERT_EQ(src.open(tmp.sock(), json, 707, "source"), "");
  ASSERT_EQ(dst.open(tmp.sock(), json, 808, "destination"), "");
  const kvf_geometry *g = src.g;
  const uint32_t C = chunk_tokens(g);
  const uint64_t T = kHybridTokens;
  std::vector<kvf_chunk_key> keys = prompt_keys(g, 5, T);
  Tables st = make_tables(store_spans(g, 0, T), shuffled(kHybridBlocks, 41));
  kvf_client_result r = KVF_CLIENT_RESULT_INIT;
  Xfer sx(st, keys, C, 0, T);
  ASSERT_EQ(kvf_client_store(src.c, &sx.x, &r), KVF_SUCCESS) << kvf_last_error();
  const uint64_t objects = srv.data().l1.objects;
  ASSERT_EQ(objects, 7u);
  Tables rt = make_tables(retrieve_spans(g, 0, T), shuffled(kHybridBlocks, 42));
  Tables dst_st = make_tables(store_spans(g, 0, T), shuffled(kHybridBlocks, 43));

  // Send one bad request; expect `status` and `field` in the message, and
  // nothing written, held or committed.
  auto bad = [&](const char *what, kvf_client *c, kvf_client_op op, const kvf_client_xfer *x, kvf_status status,
                 const std::string &field) {
    SCOPED_TRACE(what);
    std::unique_ptr<Bytes> before = dst.snapshot();
    kvf_client_result res = KVF_CLIENT_RESULT_INIT;
    kvf_status got = op == KVF_CLIENT_STORE ? kvf_client_store(c, x, &res) : kvf_client_retrieve(c, x, &res);
    std::string msg = kvf_last_error();
    EXPECT_EQ(got, status) << kvf_status_string(got) << ": " << msg;
    EXPECT_TRUE(has(msg.c_str(), field)) << "the message does not name " << field << ": " << msg;
    EXPECT_EQ(compare(dst.mem(), before->p, dst.size(), *dst.lay), "");
    expect_nothing_held(srv, what);
    kvf_dataplane_stats d = srv.data();
    EXPECT_EQ(d.l1.objects, objects);
    EXPECT_EQ(d.l1.committed_total, objects);
  };

  {
    Tables t = rt;
    t.ids[1][3] = kHybridBlocks; // one past the last block
    Xfer x(t, keys, C, 0, T);
    bad("retrieve, block id out of range", dst.c, KVF_CLIENT_RETRIEVE, &x.x, KVF_ERR_INVALID_ARGUMENT,
        "payload.groups[1].block_ids[3]");
    Tables t2 = dst_st;
    t2.ids[0][17] = 1u << 30;
    Xfer x2(t2, keys, C, 0, T);
    bad("store, block id out of range", dst.c, KVF_CLIENT_STORE, &x2.x, KVF_ERR_INVALID_ARGUMENT,
        "payload.groups[0].block_ids[17]");
  }
  {
    Xfer x(rt, keys, C, 0, T);
    x.x.num_chunk_keys = 3;
    bad("retrieve, 3 keys for 4 chunks", dst.c, KVF_CLIENT_RETRIEVE, &x.x, KVF_ERR_INVALID_ARGUMENT,
        "payload.chunk_keys");
    Xfer x2(dst_st, keys, C, 0, T);
    x2.x.num_chunk_keys = 2;
    bad("store, 2 keys for 4 chunks", dst.c, KVF_CLIENT_STORE, &x2.x, KVF_ERR_INVALID_ARGUMENT, "payload.chunk_keys");
  }
  {
    Xfer x(rt, keys, C, 0, T);
    x.x.num_groups = 2;
    bad("retrieve, 2 groups for 3", dst.c, KVF_CLIENT_RETRIEVE, &x.x, KVF_ERR_INVALID_ARGUMENT, "payload.num_groups");
    Xfer x2(dst_st, keys, C, 0, T);
    x2.x.num_groups = 2;
    bad("store, 2 groups for 3", dst.c, KVF_CLIENT_STORE, &x2.x, KVF_ERR_INVALID_ARGUMENT, "payload.num_groups");
  }
  {
    Xfer x(rt, keys, C, 0, T);
    x.x.token_begin = 16; // [16, 1024) spans 4 chunks: the key count is right
    bad("retrieve, token_begin off a chunk boundary", dst.c, KVF_CLIENT_RETRIEVE, &x.x, KVF_ERR_INVALID_ARGUMENT,
        "payload.token_begin");
    Xfer x2(dst_st, keys, C, 0, T);
    x2.x.token_begin = 16;
    bad("store, token_begin off a chunk boundary", dst.c, KVF_CLIENT_STORE, &x2.x, KVF_ERR_INVALID_ARGUMENT,
        "payload.token_begin");
  }
  {
    Xfer x(rt, keys, C, 0, T);
    x.x.registration_id = dst.reg.registration_id + 1000;
    bad("retrieve, not the live registration", dst.c, KVF_CLIENT_RETRIEVE, &x.x, KVF_ERR_STATE,
        "payload.registration_id");
    Xfer x2(dst_st, keys, C, 0, T);
    x2.x.registration_id = src.reg.registration_id; // another client's
    bad("store, another client's registration", dst.c, KVF_CLIENT_STORE, &x2.x, KVF_ERR_STATE,
        "payload.registration_id");
  }
  {
    // A connection that never registered.
    Engine bare;
    ASSERT_EQ(bare.create(small_json(16), 1), "");
    ASSERT_EQ(bare.attach(tmp.sock(), "bare", /*do_register=*/false), "");
    Xfer x(rt, keys, C, 0, T);
    bad("retrieve before any registration", bare.c, KVF_CLIENT_RETRIEVE, &x.x, KVF_ERR_STATE,
        "payload.registration_id");
    bad("store before any registration", bare.c, KVF_CLIENT_STORE, &x.x, KVF_ERR_STATE, "payload.registration_id");
  }
  {
    // The same keys through another geometry (other heads: another canonical
    // fingerprint; same chunk_tokens and payload bytes per object): L1 files
    // objects under the registration's fingerprint too, so it finds nothing.
    Engine other;
    ASSERT_EQ(other.open(tmp.sock(), small_json(96, 2, 64, 256), 9, "other-geometry"), "");
    Tables ot = make_tables(retrieve_spans(other.g, 0, T), shuffled(96, 1));
    Xfer x(ot, keys, C, 0, T);
    std::unique_ptr<Bytes> before = other.snapshot();
    kvf_client_result res = KVF_CLIENT_RESULT_INIT;
    ASSERT_EQ(kvf_client_retrieve(other.c, &x.x, &res), KVF_SUCCESS) << kvf_last_error();
    expect_nothing_moved(res, 0, "another geometry");
    EXPECT_EQ(compare(other.mem(), before->p, other.size(), *other.lay), "");
    expect_nothing_held(srv, "another geometry");

    // (Storing them files objects of their own: test_server.cpp,
    // Server.KeysAreServedOnlyToTheirGeometryAndShard.)
  }
  {
    Xfer x(rt, keys, C, 0, T, KVF_FORMAT_NATIVE);
    bad("retrieve native objects stored canonical", dst.c, KVF_CLIENT_RETRIEVE, &x.x, KVF_ERR_GEOMETRY_MISMATCH,
        "payload.format");
  }
  {
    // Unknown keys: a miss, not an error.
    std::vector<kvf_chunk_key> unknown = prompt_keys(g, 999, T);
    Xfer x(rt, unknown, C, 0, T);
    std::unique_ptr<Bytes> before = dst.snapshot();
    kvf_client_result res = KVF_CLIENT_RESULT_INIT;
    ASSERT_EQ(kvf_client_retrieve(dst.c, &x.x, &res), KVF_SUCCESS) << kvf_last_error();
    expect_nothing_moved(res, 0, "unknown keys");
    expect_og_prefix(res, {0, 0, 0}, "unknown keys");
    EXPECT_EQ(compare(dst.mem(), before->p, dst.size(), *dst.lay), "");
    // From token 512 on: the miss reports token_begin.
    Xfer x2(rt, unknown, C, 512, T);
    kvf_client_result res2 = KVF_CLIENT_RESULT_INIT;
    ASSERT_EQ(kvf_client_retrieve(dst.c, &x2.x, &res2), KVF_SUCCESS) << kvf_last_error();
    expect_nothing_moved(res2, 512, "unknown keys from 512");
    expect_og_prefix(res2, {512, 512, 512}, "unknown keys from 512");
    EXPECT_EQ(compare(dst.mem(), before->p, dst.size(), *dst.lay), "");
    expect_nothing_held(srv, "unknown keys");
  }
  // After all that, the good request still works.
  std::unique_ptr<Bytes> want = dst.snapshot();
  std::unique_ptr<Bytes> sb = src.snapshot();
  apply_retrieve(g, KVF_FORMAT_CANONICAL, *dst.lay, sb->p, st, want->p, rt, 0, T);
  kvf_client_result res = KVF_CLIENT_RESULT_INIT;
  Xfer x(rt, keys, C, 0, T);
  ASSERT_EQ(kvf_client_retrieve(dst.c, &x.x, &res), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(compare(dst.mem(), want->p, dst.size(), *dst.lay), "");
  EXPECT_EQ(srv.data().l1.aborted_total, 0u);
}

// ---- 5. Failure injected at every step. -------------------------------------

TEST(Dataplane, FailureAtEveryStepLeavesNothingBehind) {
  const std::string json = hybrid_json(kHybridBlocks);
  for (uint32_t step = KVF_DP_FAIL_LEASED; step <= KVF_DP_FAIL_PROOF; step++) {
    SCOPED_TRACE("test_fail_step " + std::to_string(step));
    TempDir tmp;
    Server srv;
    ServerConfig cfg;
    cfg.fail_step = step;
    ASSERT_EQ(srv.start(tmp.sock(), cfg), KVF_SUCCESS) << kvf_last_error();
    Engine e;
    ASSERT_EQ(e.open(tmp.sock(), json, 1100 + step, "engine"), "");
    const kvf_geometry *g = e.g;
    const uint32_t C = chunk_tokens(g);
    const uint64_t T = kHybridTokens;
    std::vector<kvf_chunk_key> keys = prompt_keys(g, 3, T);
    Tables st = make_tables(store_spans(g, 0, T), shuffled(kHybridBlocks, 51));
    Xfer sx(st, keys, C, 0, T);
    std::unique_ptr<Bytes> before = e.snapshot();
    kvf_client_result r = KVF_CLIENT_RESULT_INIT;
    kvf_status got = kvf_client_store(e.c, &sx.x, &r);
    EXPECT_NE(got, KVF_SUCCESS);
    if (step <= KVF_DP_FAIL_RESERVED) {
      // Refused at admission: an ERROR.
      EXPECT_EQ(got, KVF_ERR_SYSTEM) << kvf_last_error();
      EXPECT_TRUE(has(kvf_last_error(), "injected")) << kvf_last_error();
    } else {
      EXPECT_EQ(r.outcome, KVF_CLIENT_FAILED) << result_text(r);
      EXPECT_EQ(got, r.status);
      expect_nothing_moved(r, 0, "failed store");
    }
    expect_nothing_held(srv, "after the failed store");
    kvf_dataplane_stats d = srv.data();
    EXPECT_EQ(d.l1.objects, 0u);
    EXPECT_EQ(d.l1.committed_total, 0u);
    EXPECT_EQ(d.l1.bytes_free, d.l1.pool_bytes);
    // A reservation was made (and aborted) from step 2 on.
    EXPECT_EQ(d.l1.aborted_total, step >= KVF_DP_FAIL_RESERVED ? 7u : 0u);
    EXPECT_EQ(compare(e.mem(), before->p, e.size(), *e.lay), "") << "a store wrote the engine's cache";

    // A retrieve (nothing is stored: every store fails here) reports nothing
    // restored and writes nothing.
    Tables rt = make_tables(retrieve_spans(g, 0, T), shuffled(kHybridBlocks, 52));
    Xfer rx(rt, keys, C, 0, T);
    kvf_client_result rr = KVF_CLIENT_RESULT_INIT;
    got = kvf_client_retrieve(e.c, &rx.x, &rr);
    if (step <= KVF_DP_FAIL_RESERVED) {
      EXPECT_EQ(got, KVF_ERR_SYSTEM) << kvf_last_error();
    } else if (step == KVF_DP_FAIL_PROOF) {
      EXPECT_EQ(rr.outcome, KVF_CLIENT_FAILED) << result_text(rr);
      expect_nothing_moved(rr, 0, "failed retrieve");
    } else {
      // A miss has no copy to fail.
      EXPECT_EQ(got, KVF_SUCCESS) << kvf_last_error();
      expect_nothing_moved(rr, 0, "retrieve miss");
    }
    EXPECT_EQ(compare(e.mem(), before->p, e.size(), *e.lay), "");
    expect_nothing_held(srv, "after the failed retrieve");

    // A server without injection accepts the same store.
    e.close();
    srv.stop();
    TempDir tmp2;
    Server ok;
    ASSERT_EQ(ok.start(tmp2.sock()), KVF_SUCCESS) << kvf_last_error();
    Engine e2;
    ASSERT_EQ(e2.open(tmp2.sock(), json, 1100 + step, "engine"), "");
    kvf_client_result r2 = KVF_CLIENT_RESULT_INIT;
    ASSERT_EQ(kvf_client_store(e2.c, &sx.x, &r2), KVF_SUCCESS) << kvf_last_error();
    expect_result(r2, T, expect_counts(e2.g, st, 0, T), "the store without injection");
    EXPECT_EQ(ok.data().l1.objects, 7u);
  }
}

// A retrieve of stored objects failing at every step: refused (steps 1-2) or
// failed (3-4), never a block reported restored, nothing held afterwards, and
// the objects stay in L1 for the next retrieve.
TEST(Dataplane, RetrieveFailureAtEveryStepReportsNothingRestored) {
  const std::string json = hybrid_json(kHybridBlocks);
  for (uint32_t step = KVF_DP_FAIL_LEASED; step <= KVF_DP_FAIL_PROOF; step++) {
    SCOPED_TRACE("test_fail_step " + std::to_string(step) + " (retrieves only)");
    TempDir tmp;
    Server srv;
    ServerConfig cfg;
    cfg.fail_step = step;
    cfg.fail_type = KVF_PROTO_RETRIEVE;
    ASSERT_EQ(srv.start(tmp.sock(), cfg), KVF_SUCCESS) << kvf_last_error();
    Engine e;
    ASSERT_EQ(e.open(tmp.sock(), json, 1200 + step, "engine"), "");
    const kvf_geometry *g = e.g;
    const uint32_t C = chunk_tokens(g);
    const uint64_t T = kHybridTokens;
    std::vector<kvf_chunk_key> keys = prompt_keys(g, 4, T);
    Tables st = make_tables(store_spans(g, 0, T), shuffled(kHybridBlocks, 61));
    Xfer sx(st, keys, C, 0, T);
    kvf_client_result r = KVF_CLIENT_RESULT_INIT;
    ASSERT_EQ(kvf_client_store(e.c, &sx.x, &r), KVF_SUCCESS) << kvf_last_error();
    const uint64_t objects = srv.data().l1.objects;
    ASSERT_GT(objects, 0u);
    Tables rt = make_tables(retrieve_spans(g, 0, T), shuffled(kHybridBlocks, 62));
    Xfer rx(rt, keys, C, 0, T);
    kvf_client_result rr = KVF_CLIENT_RESULT_INIT;
    kvf_status got = kvf_client_retrieve(e.c, &rx.x, &rr);
    EXPECT_NE(got, KVF_SUCCESS);
    if (step <= KVF_DP_FAIL_RESERVED) {
      EXPECT_EQ(got, KVF_ERR_SYSTEM) << kvf_last_error();
      EXPECT_TRUE(has(kvf_last_error(), "injected")) << kvf_last_error();
    } else {
      EXPECT_EQ(rr.outcome, KVF_CLIENT_FAILED) << result_text(rr);
      expect_nothing_moved(rr, 0, "failed retrieve");
    }
    expect_nothing_held(srv, "after the failed retrieve");
    EXPECT_EQ(srv.data().l1.objects, objects) << "a failed retrieve lost objects";
  }
}

// A request sent again under the same id (a retry) is answered from the
// completion table: the recorded outcome, nothing run twice.
TEST(Dataplane, ARetriedRequestIsAnsweredFromTheCompletionTable) {
  const std::string json = hybrid_json(kHybridBlocks);
  TempDir tmp;
  Server srv;
  ASSERT_EQ(srv.start(tmp.sock()), KVF_SUCCESS) << kvf_last_error();
  Engine e;
  ASSERT_EQ(e.open(tmp.sock(), json, 1300, "engine"), "");
  const kvf_geometry *g = e.g;
  const uint32_t C = chunk_tokens(g);
  const uint64_t T = kHybridTokens;
  std::vector<kvf_chunk_key> keys = prompt_keys(g, 5, T);
  Tables st = make_tables(store_spans(g, 0, T), shuffled(kHybridBlocks, 71));
  Xfer sx(st, keys, C, 0, T);
  kvf_client_test_next_request_id(e.c, 7000);
  kvf_client_result first = KVF_CLIENT_RESULT_INIT;
  ASSERT_EQ(kvf_client_store(e.c, &sx.x, &first), KVF_SUCCESS) << kvf_last_error();
  ASSERT_GT(first.objects_done, 0u);
  const kvf_dataplane_stats before = srv.data();
  // The retry: same id, same request.
  kvf_client_test_next_request_id(e.c, 7000);
  kvf_client_result again = KVF_CLIENT_RESULT_INIT;
  ASSERT_EQ(kvf_client_store(e.c, &sx.x, &again), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(again.outcome, KVF_CLIENT_DONE);
  EXPECT_EQ(again.prefix_tokens, first.prefix_tokens) << "the recorded outcome's prefix";
  const kvf_dataplane_stats after = srv.data();
  EXPECT_EQ(after.stores_total, before.stores_total) << "the retry was run again";
  EXPECT_EQ(after.l1.committed_total, before.l1.committed_total);
  // A new id is a new request (its objects are already held).
  kvf_client_result fresh = KVF_CLIENT_RESULT_INIT;
  ASSERT_EQ(kvf_client_store(e.c, &sx.x, &fresh), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(srv.data().stores_total, before.stores_total + 1);
  EXPECT_EQ(fresh.objects_done, 0u);
  EXPECT_EQ(fresh.objects_present, first.objects_done);
  expect_nothing_held(srv, "after the retries");
}

// An object is written whole or not at all: with the recurrent group in the
// full group's object group (separate_recurrent false), a STORE that leaves
// the recurrent group out stores nothing of that object group.
TEST(Dataplane, AStoreMissingAGroupOfAnObjectGroupStoresNoneOfIt) {
  std::string json = hybrid_json(kHybridBlocks);
  const std::string from = "\"separate_recurrent\":true"; // kvf_geometry_to_json writes no spaces
  ASSERT_NE(json.find(from), std::string::npos) << json;
  json.replace(json.find(from), from.size(), "\"separate_recurrent\":false");
  TempDir tmp;
  Server srv;
  ASSERT_EQ(srv.start(tmp.sock()), KVF_SUCCESS) << kvf_last_error();
  Engine e;
  ASSERT_EQ(e.open(tmp.sock(), json, 1400, "engine"), "");
  const kvf_geometry *g = e.g;
  ASSERT_EQ(kvf_geometry_num_object_groups(g), 2u) << "full+recurrent, sliding";
  const uint32_t C = chunk_tokens(g);
  const uint64_t T = kHybridTokens;
  std::vector<kvf_chunk_key> keys = prompt_keys(g, 9, T);
  // No recurrent slot: object group 0 (full + recurrent) is incomplete in every chunk.
  Tables st = make_tables(store_spans(g, 0, T, false, /*recurrent=*/false), shuffled(kHybridBlocks, 81));
  Xfer sx(st, keys, C, 0, T);
  kvf_client_result r = KVF_CLIENT_RESULT_INIT;
  ASSERT_EQ(kvf_client_store(e.c, &sx.x, &r), KVF_SUCCESS) << kvf_last_error();
  const uint32_t og0 = group_info(g, 0).object_group;
  EXPECT_EQ(r.group_blocks[0], 0u) << "full blocks were stored into objects whose recurrent part is garbage";
  EXPECT_EQ(r.prefix_tokens, 0u);
  // Only the sliding object group's window objects are held.
  EXPECT_EQ(srv.data().l1.objects, r.objects_done);
  EXPECT_GT(r.objects_done, 0u);
  EXPECT_LT(r.objects_done, keys.size()) << "object group " << og0 << " was stored";
  expect_nothing_held(srv, "after the store");
}

// A STORE the transfer would refuse is refused before L1 is touched: it
// evicts nothing, even when it would have needed the room.
TEST(Dataplane, ARefusedStoreEvictsNothing) {
  TempDir tmp;
  Server srv;
  ServerConfig cfg;
  cfg.l1_bytes = 160 * 1024; // room for one 4-chunk store of the small geometry (128 KiB), not two
  ASSERT_EQ(srv.start(tmp.sock(), cfg), KVF_SUCCESS) << kvf_last_error();
  const std::string json = small_json(64);
  Engine e;
  ASSERT_EQ(e.open(tmp.sock(), json, 1500, "engine"), "");
  const kvf_geometry *g = e.g;
  const uint32_t C = chunk_tokens(g);
  std::vector<kvf_chunk_key> ka = prompt_keys(g, 21, 4 * C), kb = prompt_keys(g, 22, 4 * C);
  Tables ta = make_tables({{0, 4 * C / 16}}, shuffled(64, 3));
  Xfer sa(ta, ka, C, 0, 4 * C);
  kvf_client_result r = KVF_CLIENT_RESULT_INIT;
  ASSERT_EQ(kvf_client_store(e.c, &sa.x, &r), KVF_SUCCESS) << kvf_last_error();
  const kvf_dataplane_stats before = srv.data();
  ASSERT_GT(before.l1.objects, 0u);
  // Native objects hold whole blocks: a range ending mid-block is refused.
  Xfer sb(ta, kb, C, 0, 4 * C - 3, KVF_FORMAT_NATIVE);
  kvf_client_result rb = KVF_CLIENT_RESULT_INIT;
  EXPECT_EQ(kvf_client_store(e.c, &sb.x, &rb), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(has(kvf_last_error(), "token_end")) << kvf_last_error();
  const kvf_dataplane_stats after = srv.data();
  EXPECT_EQ(after.l1.objects, before.l1.objects);
  EXPECT_EQ(after.l1.evicted_entries_total, before.l1.evicted_entries_total) << "a refused store evicted";
  expect_nothing_held(srv, "after the refused store");
}

// ---- 6. Eviction under pressure while a retrieve is pinned. -----------------

TEST(Dataplane, EvictionNeverTakesPinnedEntries) {
  TempDir tmp;
  Server srv;
  const std::string json = small_json(64); // 64-token chunks of 2 * 2 * 64 * 128 = 32 KiB
  std::unique_ptr<kvf_geometry, void (*)(kvf_geometry *)> owned(load(json), kvf_geometry_destroy);
  kvf_geometry *g = owned.get();
  ASSERT_NE(g, nullptr);
  const uint32_t C = chunk_tokens(g);
  uint64_t object = 0;
  ASSERT_EQ(kvf_geometry_object_size(g, 0, 0, C, &object), KVF_SUCCESS);
  ASSERT_EQ(object, 32768u);
  ServerConfig cfg;
  cfg.l1_bytes = 2 * object; // room for two one-chunk entries
  cfg.delay_ms = 300;
  ASSERT_EQ(srv.start(tmp.sock(), cfg), KVF_SUCCESS) << kvf_last_error();
  Engine e, d;
  ASSERT_EQ(e.open(tmp.sock(), json, 61, "engine"), "");
  ASSERT_EQ(d.open(tmp.sock(), json, 62, "destination"), "");
  std::vector<uint32_t> pool = shuffled(64, 8);
  // Each entry is one chunk from its own blocks (4 blocks per chunk).
  auto one_chunk = [&](size_t slot) { return make_tables({{0, C / 16}}, pool, slot * 4); };
  std::vector<kvf_chunk_key> kx = prompt_keys(g, 1, C), ka = prompt_keys(g, 2, C), kc = prompt_keys(g, 3, C),
                        kd = prompt_keys(g, 4, C), kb = prompt_keys(g, 5, 2 * C);
  Tables tx = one_chunk(0), ta = one_chunk(1), tc = one_chunk(2), tdd = one_chunk(3);
  Tables tb2 = make_tables({{0, 2 * C / 16}}, pool, 16);
  auto store = [&](const Tables &t, const std::vector<kvf_chunk_key> &keys, uint64_t tokens) {
    kvf_client_result r = KVF_CLIENT_RESULT_INIT;
    Xfer x(t, keys, C, 0, tokens);
    kvf_status st = kvf_client_store(e.c, &x.x, &r);
    return st;
  };
  ASSERT_EQ(store(tx, kx, C), KVF_SUCCESS) << kvf_last_error();
  ASSERT_EQ(store(ta, ka, C), KVF_SUCCESS) << kvf_last_error();
  ASSERT_EQ(srv.data().l1.objects, 2u);

  // A retrieve of A in flight (held back 300 ms): A is pinned.
  Tables rt = make_tables({{0, C / 16}}, shuffled(64, 9));
  Xfer rx(rt, ka, C, 0, C);
  std::unique_ptr<Bytes> want = d.snapshot();
  std::unique_ptr<Bytes> eb = e.snapshot();
  apply_retrieve(g, KVF_FORMAT_CANONICAL, *d.lay, eb->p, ta, want->p, rt, 0, C);
  uint64_t rid = 0;
  auto t0 = Clock::now();
  ASSERT_EQ(kvf_client_submit(d.c, KVF_CLIENT_RETRIEVE, &rx.x, &rid), KVF_SUCCESS) << kvf_last_error();

  // Two chunks fit only by evicting X and A: A is pinned, so the store fails
  // and evicts nothing (X stays).
  kvf_status st = store(tb2, kb, 2 * C);
  std::string why = kvf_last_error();
  EXPECT_EQ(st, KVF_ERR_OUT_OF_MEMORY) << why;
  EXPECT_TRUE(has(why.c_str(), "payload.chunk_keys: pool -1: ")) << why;
  EXPECT_TRUE(has(why.c_str(), "nothing was evicted")) << why;
  kvf_dataplane_stats s = srv.data();
  EXPECT_EQ(s.l1.evicted_entries_total, 0u);
  EXPECT_EQ(s.l1.objects, 2u);
  // One chunk fits by evicting X, the least recently used unpinned entry.
  uint64_t cid = 0;
  Xfer cx(tc, kc, C, 0, C);
  ASSERT_EQ(kvf_client_submit(e.c, KVF_CLIENT_STORE, &cx.x, &cid), KVF_SUCCESS) << kvf_last_error();
  for (auto t1 = Clock::now(); srv.data().l1.objects_reserved == 0 && ms_since(t1) < 5000;) sleep_ms(1);
  s = srv.data();
  ASSERT_LT(ms_since(t0), 250 * kvf_server_test::kTimingScale) << "too slow: the retrieve of A may no longer be pinned";
  EXPECT_EQ(s.l1.objects_pinned, 1u);
  EXPECT_EQ(s.l1.objects_reserved, 1u);
  EXPECT_EQ(s.l1.evicted_entries_total, 1u);
  EXPECT_EQ(s.l1.objects, 1u); // A

  kvf_client_result rr = KVF_CLIENT_RESULT_INIT;
  ASSERT_EQ(kvf_client_wait(d.c, rid, 0, &rr), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(rr.status, KVF_SUCCESS) << result_text(rr);
  EXPECT_EQ(rr.prefix_tokens, C) << result_text(rr);
  EXPECT_EQ(compare(d.mem(), want->p, d.size(), *d.lay), "") << "A's bytes changed while it was pinned";
  kvf_client_result cr = KVF_CLIENT_RESULT_INIT;
  ASSERT_EQ(kvf_client_wait(e.c, cid, 0, &cr), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(cr.status, KVF_SUCCESS) << result_text(cr);
  s = srv.data();
  EXPECT_EQ(s.l1.objects, 2u); // A and C
  EXPECT_EQ(s.l1.objects_pinned, 0u);

  // Unpinned, A is now the least recently used: the next store evicts it.
  ASSERT_EQ(store(tdd, kd, C), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(srv.data().l1.evicted_entries_total, 2u);
  kvf_client_result ra = KVF_CLIENT_RESULT_INIT;
  ASSERT_EQ(kvf_client_retrieve(d.c, &rx.x, &ra), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(ra.prefix_tokens, 0u) << "A should have been evicted: " << result_text(ra);
  kvf_client_result rc = KVF_CLIENT_RESULT_INIT;
  Xfer rcx(rt, kc, C, 0, C);
  ASSERT_EQ(kvf_client_retrieve(d.c, &rcx.x, &rc), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(rc.prefix_tokens, C) << "C should have stayed: " << result_text(rc);
  expect_nothing_held(srv, "after the eviction test");
}

// ---- 7. Timeout: answered early, released only once proven. -----------------

TEST(Dataplane, TimedOutRequestIsAnsweredEarlyAndReleasedLate) {
  TempDir tmp;
  Server srv;
  ServerConfig cfg;
  cfg.timeout_ms = 100;
  cfg.delay_ms = 600;
  ASSERT_EQ(srv.start(tmp.sock(), cfg), KVF_SUCCESS) << kvf_last_error();
  const std::string json = small_json(64);
  Engine e;
  ASSERT_EQ(e.open(tmp.sock(), json, 71, "engine"), "");
  const uint32_t C = chunk_tokens(e.g);
  std::vector<kvf_chunk_key> keys = prompt_keys(e.g, 7, 2 * C);
  Tables t = make_tables({{0, 2 * C / 16}}, shuffled(64, 1));
  Xfer x(t, keys, C, 0, 2 * C);
  kvf_client_result r = KVF_CLIENT_RESULT_INIT;
  auto t0 = Clock::now();
  kvf_status st = kvf_client_store(e.c, &x.x, &r);
  int64_t answered = ms_since(t0);
  EXPECT_EQ(st, r.status);
  EXPECT_EQ(r.outcome, KVF_CLIENT_TIMED_OUT) << result_text(r);
  EXPECT_EQ(r.status, KVF_ERR_TIMEOUT) << result_text(r);
  EXPECT_GE(answered, 90);
  EXPECT_LT(answered, 450 * kvf_server_test::kTimingScale) << "the timeout was not answered at about 100 ms";
  // The store will be aborted: its reply must not claim anything stored.
  expect_nothing_moved(r, 0, "timed-out store");
  // Still held: the lease and the reservation, until the (delayed) proof.
  kvf_registry_stats rs = srv.reg();
  kvf_dataplane_stats d = srv.data();
  if (ms_since(t0) < 500) {
    EXPECT_EQ(rs.leases, 1u);
    EXPECT_EQ(d.l1.objects_reserved, 2u);
    EXPECT_EQ(d.in_flight, 1u);
  }
  while (srv.reg().leases != 0 && ms_since(t0) < 5000) sleep_ms(2);
  int64_t released = ms_since(t0);
  EXPECT_GE(released, 550) << "the lease was released before the completion was proven";
  expect_nothing_held(srv, "after the proof");
  d = srv.data();
  EXPECT_EQ(d.l1.objects, 0u);
  EXPECT_EQ(d.l1.aborted_total, 2u);
  EXPECT_EQ(d.l1.committed_total, 0u);
  EXPECT_EQ(d.timed_out_total, 1u);
  EXPECT_EQ(d.done_total, 0u);
  // The client is still served (its late reply was not sent twice).
  kvf_client_stats cs = KVF_CLIENT_STATS_INIT;
  EXPECT_EQ(kvf_client_stat(e.c, &cs), KVF_SUCCESS) << kvf_last_error();
}

// Completions are proven one after the other on the host lane, each held
// back `delay`: a request queued behind another waits up to twice that, so
// with delay < timeout < 2 * delay the first request of a burst is done and
// the second times out. That gives a timed-out RETRIEVE of objects that are
// really held (its scatter already ran), and a store that finds the objects
// of a timed-out store still reserved.
constexpr uint32_t kQueueDelayMs = 300, kQueueTimeoutMs = 500;

TEST(Dataplane, TimedOutRetrieveReportsNothingRestored) {
  TempDir tmp;
  Server srv;
  ServerConfig cfg;
  cfg.timeout_ms = kQueueTimeoutMs;
  cfg.delay_ms = kQueueDelayMs;
  ASSERT_EQ(srv.start(tmp.sock(), cfg), KVF_SUCCESS) << kvf_last_error();
  const std::string json = small_json(64);
  Engine e, d;
  ASSERT_EQ(e.open(tmp.sock(), json, 81, "engine"), "");
  ASSERT_EQ(d.open(tmp.sock(), json, 82, "destination"), "");
  const uint32_t C = chunk_tokens(e.g);
  std::vector<kvf_chunk_key> kx = prompt_keys(e.g, 1, 2 * C), kf = prompt_keys(e.g, 2, 2 * C);
  Tables tx = make_tables({{0, 2 * C / 16}}, shuffled(64, 1)), tf = make_tables({{0, 2 * C / 16}}, shuffled(64, 1), 8);
  Xfer sx(tx, kx, C, 0, 2 * C), sf(tf, kf, C, 0, 2 * C);
  kvf_client_result r = KVF_CLIENT_RESULT_INIT;
  ASSERT_EQ(kvf_client_store(e.c, &sx.x, &r), KVF_SUCCESS) << kvf_last_error() << " " << result_text(r);

  // A filler store first, then the retrieve behind it: it times out.
  Tables rt = make_tables({{0, 2 * C / 16}}, shuffled(64, 2));
  Xfer rx(rt, kx, C, 0, 2 * C);
  uint64_t fid = 0, rid = 0;
  auto t0 = Clock::now();
  ASSERT_EQ(kvf_client_submit(e.c, KVF_CLIENT_STORE, &sf.x, &fid), KVF_SUCCESS) << kvf_last_error();
  // Another connection: make sure the filler is admitted first.
  while (srv.data().stores_total < 2 && ms_since(t0) < 100) sleep_ms(1);
  ASSERT_EQ(srv.data().stores_total, 2u);
  ASSERT_EQ(kvf_client_submit(d.c, KVF_CLIENT_RETRIEVE, &rx.x, &rid), KVF_SUCCESS) << kvf_last_error();
  kvf_client_result rr = KVF_CLIENT_RESULT_INIT;
  ASSERT_EQ(kvf_client_wait(d.c, rid, 0, &rr), KVF_SUCCESS) << kvf_last_error();
  int64_t answered = ms_since(t0);
  EXPECT_EQ(rr.outcome, KVF_CLIENT_TIMED_OUT) << result_text(rr);
  EXPECT_GE(answered, (int64_t)kQueueTimeoutMs - 20);
  EXPECT_LT(answered, 2 * (int64_t)kQueueDelayMs) << "the timeout was not answered before the proof";
  // The engine cannot know how much of its blocks the copy wrote: none may
  // be reported restored.
  expect_nothing_moved(rr, 0, "timed-out retrieve");
  // The pins are held until the proof.
  if (ms_since(t0) < 2 * (int64_t)kQueueDelayMs - 50) {
    EXPECT_EQ(srv.data().l1.objects_pinned, 2u);
    EXPECT_GE(srv.reg().leases, 1u);
  }
  kvf_client_result fr = KVF_CLIENT_RESULT_INIT;
  ASSERT_EQ(kvf_client_wait(e.c, fid, 0, &fr), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(fr.outcome, KVF_CLIENT_DONE) << "the filler store was not meant to time out: " << result_text(fr);
  expect_nothing_held(srv, "after the timed-out retrieve");
  EXPECT_GE(ms_since(t0), 2 * (int64_t)kQueueDelayMs - 20) << "released before the proof";
  EXPECT_EQ(srv.data().l1.objects, 4u);
}

TEST(Dataplane, StoreFindingATimedOutStoresReservationDoesNotClaimIt) {
  TempDir tmp;
  Server srv;
  ServerConfig cfg;
  cfg.timeout_ms = kQueueTimeoutMs;
  cfg.delay_ms = kQueueDelayMs;
  ASSERT_EQ(srv.start(tmp.sock(), cfg), KVF_SUCCESS) << kvf_last_error();
  const std::string json = small_json(64);
  Engine e, d;
  ASSERT_EQ(e.open(tmp.sock(), json, 83, "engine"), "");
  ASSERT_EQ(d.open(tmp.sock(), json, 84, "destination"), "");
  const uint32_t C = chunk_tokens(e.g);
  std::vector<kvf_chunk_key> ka = prompt_keys(e.g, 1, 2 * C), kf = prompt_keys(e.g, 2, 2 * C);
  Tables ta = make_tables({{0, 2 * C / 16}}, shuffled(64, 1)), tf = make_tables({{0, 2 * C / 16}}, shuffled(64, 1), 8);
  Xfer sa(ta, ka, C, 0, 2 * C), sf(tf, kf, C, 0, 2 * C);
  // F is proven at ~300 ms; A, queued behind it, times out at 500 ms and is
  // aborted at its proof (~600 ms). B, the same store sent at ~500 ms,
  // finds A's objects reserved.
  uint64_t fid = 0, aid = 0, bid = 0;
  ASSERT_EQ(kvf_client_submit(e.c, KVF_CLIENT_STORE, &sf.x, &fid), KVF_SUCCESS) << kvf_last_error();
  ASSERT_EQ(kvf_client_submit(e.c, KVF_CLIENT_STORE, &sa.x, &aid), KVF_SUCCESS) << kvf_last_error();
  kvf_client_result ar = KVF_CLIENT_RESULT_INIT;
  ASSERT_EQ(kvf_client_wait(e.c, aid, 0, &ar), KVF_SUCCESS) << kvf_last_error();
  ASSERT_EQ(ar.outcome, KVF_CLIENT_TIMED_OUT) << result_text(ar);
  ASSERT_EQ(kvf_client_submit(e.c, KVF_CLIENT_STORE, &sa.x, &bid), KVF_SUCCESS) << kvf_last_error();
  kvf_client_result br = KVF_CLIENT_RESULT_INIT, fr = KVF_CLIENT_RESULT_INIT;
  ASSERT_EQ(kvf_client_wait(e.c, fid, 0, &fr), KVF_SUCCESS) << kvf_last_error();
  ASSERT_EQ(kvf_client_wait(e.c, bid, 0, &br), KVF_SUCCESS) << kvf_last_error();
  ASSERT_TRUE(srv.wait_idle());
  EXPECT_EQ(srv.data().l1.aborted_total, 2u) << "A's reservation was not aborted";
  // Whatever B reports as held must be held.
  Tables rt = make_tables({{0, 2 * C / 16}}, shuffled(64, 2));
  Xfer rx(rt, ka, C, 0, 2 * C);
  kvf_client_result rr = KVF_CLIENT_RESULT_INIT;
  ASSERT_EQ(kvf_client_retrieve(d.c, &rx.x, &rr), KVF_SUCCESS) << kvf_last_error();
  if (br.outcome == KVF_CLIENT_DONE) {
    EXPECT_EQ(rr.prefix_tokens, br.prefix_tokens)
        << "B reported [0, " << br.prefix_tokens << ") held (" << result_text(br)
        << "), but A's reservation it counted as present was aborted: L1 holds " << rr.prefix_tokens << " tokens";
  }
}

// ---- 8. An engine SIGKILLed while its stores are in flight. -----------------

// The killed engine's cache and stores, regenerated identically by the test.
constexpr uint32_t kVictimBlocks = 256, kVictimStores = 6;
constexpr uint64_t kVictimSeed = 8080;

Tables victim_tables(const kvf_geometry *g, uint32_t i) {
  uint32_t C = chunk_tokens(g);
  return make_tables({{0, 2 * C / 16}}, shuffled(kVictimBlocks, kVictimSeed), (size_t)i * 8);
}
std::vector<kvf_chunk_key> victim_keys(const kvf_geometry *g, uint32_t i) {
  return prompt_keys(g, 4000 + i, 2 * chunk_tokens(g));
}

// The forked engine: wait for 'g', register, submit its stores, report 'S',
// then wait to be killed. Exit codes name the step that failed.
int victim_main(const std::string &dir, int control, int report) {
  char b = 0;
  if (read(control, &b, 1) != 1 || b != 'g') return 10;
  Engine e;
  if (!e.open(dir, small_json(kVictimBlocks), kVictimSeed, "victim").empty()) return 11;
  uint32_t C = chunk_tokens(e.g);
  std::vector<std::unique_ptr<Xfer>> xs;
  for (uint32_t i = 0; i < kVictimStores; i++) {
    xs.emplace_back(new Xfer(victim_tables(e.g, i), victim_keys(e.g, i), C, 0, 2 * C));
    uint64_t id = 0;
    if (kvf_client_submit(e.c, KVF_CLIENT_STORE, &xs.back()->x, &id) != KVF_SUCCESS) return 12;
  }
  b = 'S';
  if (write(report, &b, 1) != 1) return 13;
  for (;;) pause();
}

// An UNREGISTER of a replaced registration whose request is still in
// flight answers "draining" (2), not "unmapped" (3): the client library
// documents 3 as the server no longer touching that memory, which an engine
// may take as leave to reuse it. Once the request retires, 3.
TEST(Dataplane, UnregisteringAReplacedRegistrationThatStillDrainsSaysDraining) {
  TempDir tmp;
  Server srv;
  ServerConfig cfg;
  cfg.delay_ms = 2000; /* the STORE holds its lease that long */
  ASSERT_EQ(srv.start(tmp.sock(), cfg), KVF_SUCCESS) << kvf_last_error();
  const std::string json = small_json(64);
  Engine e;
  ASSERT_EQ(e.open(tmp.sock(), json, 72, "engine"), "");
  const uint64_t replaced = e.reg.registration_id;
  const uint32_t C = chunk_tokens(e.g);
  std::vector<kvf_chunk_key> keys = prompt_keys(e.g, 8, C);
  Tables t = make_tables({{0, C / 16}}, shuffled(64, 2));
  Xfer x(t, keys, C, 0, C);
  uint64_t rid = 0;
  ASSERT_EQ(kvf_client_submit(e.c, KVF_CLIENT_STORE, &x.x, &rid), KVF_SUCCESS) << kvf_last_error();
  auto t0 = Clock::now();
  while (srv.reg().leases == 0 && ms_since(t0) < 5000) sleep_ms(1);
  ASSERT_EQ(srv.reg().leases, 1u) << "the STORE never took its lease";
  // The same memory registered again: the first registration drains.
  e.reg = KVF_CLIENT_REGISTRATION_INIT;
  ASSERT_EQ(e.attach_again(), "");
  ASSERT_NE(e.reg.registration_id, replaced);
  uint32_t state = 0;
  ASSERT_EQ(kvf_client_unregister(e.c, replaced, &state), KVF_SUCCESS) << kvf_last_error();
  // A lease goes only from 1 to 0: held now, it was held when the server
  // answered.
  if (srv.reg().leases == 1) {
    EXPECT_EQ(state, 2u) << "the replaced registration still holds the STORE's lease";
  } else {
    ADD_FAILURE() << "the STORE retired before the UNREGISTER was answered (" << ms_since(t0)
                  << " ms): nothing was checked";
  }
  kvf_client_result r = KVF_CLIENT_RESULT_INIT;
  ASSERT_EQ(kvf_client_wait(e.c, rid, 0, &r), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(r.status, KVF_SUCCESS) << result_text(r);
  ASSERT_TRUE(srv.wait_idle());
  ASSERT_EQ(kvf_client_unregister(e.c, replaced, &state), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(state, 3u);
  EXPECT_EQ(srv.reg().draining, 0u);
  // The live registration was left alone.
  EXPECT_EQ(srv.reg().active, 1u);
}

TEST(Dataplane, KilledEngineIsReapedAfterItsStoresRetire) {
  TempDir tmp;
  int c[2], r[2];
  ASSERT_EQ(pipe2(c, O_CLOEXEC), 0);
  ASSERT_EQ(pipe2(r, O_CLOEXEC), 0);
  // Fork before any thread of this test runs (no lock inherited held).
  fflush(stdout);
  fflush(stderr);
  pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    close(c[1]);
    close(r[0]);
    _exit(victim_main(tmp.sock(), c[0], r[1]));
  }
  close(c[0]);
  close(r[1]);
  struct Reap {
    pid_t pid;
    ~Reap() {
      if (pid > 0) {
        kill(pid, SIGKILL);
        waitpid(pid, nullptr, 0);
      }
    }
  } reap{pid};

  Server srv;
  ServerConfig cfg;
  cfg.delay_ms = 150; // the victim's 6 stores retire over ~0.9 s
  ASSERT_EQ(srv.start(tmp.sock(), cfg), KVF_SUCCESS) << kvf_last_error();
  const std::string json = small_json(kVictimBlocks);
  Engine b;
  ASSERT_EQ(b.open(tmp.sock(), json, 9090, "survivor"), "");
  const kvf_registry_stats base = srv.reg();
  const uint32_t C = chunk_tokens(b.g);

  char go = 'g';
  ASSERT_EQ(write(c[1], &go, 1), 1);
  struct pollfd p = {r[0], POLLIN, 0};
  ASSERT_EQ(poll(&p, 1, 20000), 1);
  char got = 0;
  ASSERT_EQ(read(r[0], &got, 1), 1) << "the victim exited early";
  ASSERT_EQ(got, 'S');
  for (auto t1 = Clock::now(); srv.data().stores_total < kVictimStores && ms_since(t1) < 5000;) sleep_ms(1);
  ASSERT_EQ(srv.data().stores_total, kVictimStores);

  // The survivor stores and retrieves throughout, checking every byte.
  std::atomic<bool> stop{false};
  std::atomic<int> rounds{0};
  std::string survivor_error;
  std::thread survivor([&] {
    for (int i = 0; !stop.load() || i < 2; i++) {
      std::vector<kvf_chunk_key> keys = prompt_keys(b.g, 7000 + i, 2 * C);
      Tables st = make_tables({{0, 2 * C / 16}}, shuffled(kVictimBlocks, 1), (size_t)(i % 4) * 8);
      Tables rt = make_tables({{0, 2 * C / 16}}, shuffled(kVictimBlocks, 1), 128 + (size_t)(i % 4) * 8);
      Xfer sx(st, keys, C, 0, 2 * C), rx(rt, keys, C, 0, 2 * C);
      kvf_client_result sr = KVF_CLIENT_RESULT_INIT, rr = KVF_CLIENT_RESULT_INIT;
      if (kvf_client_store(b.c, &sx.x, &sr) != KVF_SUCCESS) {
        survivor_error = std::string("store: ") + kvf_last_error();
        return;
      }
      std::unique_ptr<Bytes> want = b.snapshot();
      apply_retrieve(b.g, KVF_FORMAT_CANONICAL, *b.lay, b.mem(), st, want->p, rt, 0, 2 * C);
      if (kvf_client_retrieve(b.c, &rx.x, &rr) != KVF_SUCCESS || rr.prefix_tokens != 2 * C) {
        survivor_error = std::string("retrieve: ") + kvf_last_error() + " " + result_text(rr);
        return;
      }
      std::string diff = compare(b.mem(), want->p, b.size(), *b.lay);
      if (!diff.empty()) {
        survivor_error = "round " + std::to_string(i) + ": " + diff;
        return;
      }
      rounds++;
    }
  });

  // SIGKILL while the stores are in flight.
  kvf_dataplane_stats d = srv.data();
  EXPECT_GE(d.in_flight, kVictimStores - 1) << "the victim's stores were not in flight";
  ASSERT_EQ(kill(pid, SIGKILL), 0);
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  reap.pid = -1;
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "the victim exited with " << status;

  // The connection closes: the registration drains, its memory stays mapped
  // while its stores are in flight, and is unmapped only once they retire.
  // (kvf_server_stats reads the registry, then the import table: a sample
  // may see "draining" and the unmapped imports of the moment after.)
  bool drained_seen = false;
  auto t0 = Clock::now();
  for (;;) {
    kvf_registry_stats rs = srv.reg();
    kvf_dataplane_stats ds = srv.data(); // read after: at most as many in flight as at the unmap
    if (rs.draining == 1) drained_seen = true;
    if (rs.imports <= base.imports || rs.aliases <= base.aliases) {
      // Unmapped: the victim's requests have retired (the survivor has at
      // most one in flight; the victim's last may still be between its
      // lease release and the in-flight counter).
      EXPECT_LE(ds.in_flight, 2u) << "unmapped while the victim's stores were in flight (" << ms_since(t0)
                                  << " ms after the kill)";
      EXPECT_GE(ms_since(t0), 300) << "unmapped too early: 6 stores held back 150 ms each were in flight";
      break;
    }
    if (ms_since(t0) > 15000) {
      ADD_FAILURE() << "the victim's registration was not unmapped (draining " << rs.draining << ")";
      break;
    }
    sleep_ms(1);
  }
  EXPECT_TRUE(drained_seen) << "the killed engine's registration never drained";
  stop = true;
  survivor.join();
  EXPECT_EQ(survivor_error, "");
  EXPECT_GE(rounds.load(), 2);
  ASSERT_TRUE(srv.wait_idle());
  kvf_registry_stats after = srv.reg();
  EXPECT_EQ(after.imports, base.imports);
  EXPECT_EQ(after.aliases, base.aliases);
  EXPECT_EQ(after.active, 1u);

  // Every committed object of the victim holds exactly the reference gather
  // of its cache (regenerated here): retrieve each store's keys.
  Engine ref;
  ASSERT_EQ(ref.create(json, kVictimSeed), ""); // the victim's cache, byte for byte
  int restored = 0;
  for (uint32_t i = 0; i < kVictimStores; i++) {
    SCOPED_TRACE("victim store " + std::to_string(i));
    Tables rt = make_tables({{0, 2 * C / 16}}, shuffled(kVictimBlocks, 2), 64 + (size_t)i * 8);
    Xfer rx(rt, victim_keys(b.g, i), C, 0, 2 * C);
    std::unique_ptr<Bytes> before = b.snapshot();
    kvf_client_result rr = KVF_CLIENT_RESULT_INIT;
    ASSERT_EQ(kvf_client_retrieve(b.c, &rx.x, &rr), KVF_SUCCESS) << kvf_last_error();
    std::unique_ptr<Bytes> want(new Bytes(b.size()));
    memcpy(want->p, before->p, b.size());
    if (rr.prefix_tokens > 0) {
      restored++;
      apply_retrieve(b.g, KVF_FORMAT_CANONICAL, *b.lay, ref.mem(), victim_tables(ref.g, i), want->p, rt, 0,
                     rr.prefix_tokens);
    }
    EXPECT_EQ(compare(b.mem(), want->p, b.size(), *b.lay), "") << result_text(rr);
  }
  // The victim's memory stayed mapped, so its stores completed.
  EXPECT_EQ(restored, (int)kVictimStores);
  close(c[1]);
  close(r[0]);
}

// ---- 9. Many requests in flight. --------------------------------------------

TEST(Dataplane, SixtyFourStoresInFlightFromOneClient) {
  TempDir tmp;
  Server srv;
  ASSERT_EQ(srv.start(tmp.sock()), KVF_SUCCESS) << kvf_last_error();
  constexpr uint32_t kN = 64, kNB = 800;
  const std::string json = small_json(kNB);
  Engine e, d;
  ASSERT_EQ(e.open(tmp.sock(), json, 91, "engine"), "");
  ASSERT_EQ(d.open(tmp.sock(), json, 92, "destination"), "");
  const kvf_geometry *g = e.g;
  const uint32_t C = chunk_tokens(g);
  std::vector<uint32_t> spool = shuffled(kNB, 3), dpool = shuffled(kNB, 4);
  // Request i stores i % 3 + 1 chunks from its own blocks: distinct counts
  // and bytes tell the replies apart.
  std::vector<std::unique_ptr<Xfer>> sx, rx;
  std::vector<Tables> st, rt;
  std::vector<uint64_t> tokens;
  for (uint32_t i = 0; i < kN; i++) {
    uint64_t n = (i % 3 + 1) * C;
    tokens.push_back(n);
    st.push_back(make_tables({{0, n / 16}}, spool, (size_t)i * 12));
    rt.push_back(make_tables({{0, n / 16}}, dpool, (size_t)i * 12));
  }
  for (uint32_t i = 0; i < kN; i++) {
    std::vector<kvf_chunk_key> keys = prompt_keys(g, 100 + i, tokens[i]);
    sx.emplace_back(new Xfer(st[i], keys, C, 0, tokens[i]));
    rx.emplace_back(new Xfer(rt[i], keys, C, 0, tokens[i]));
  }
  std::vector<uint64_t> ids(kN);
  for (uint32_t i = 0; i < kN; i++)
    ASSERT_EQ(kvf_client_submit(e.c, KVF_CLIENT_STORE, &sx[i]->x, &ids[i]), KVF_SUCCESS) << kvf_last_error();
  // Collected in reverse order of submission.
  for (uint32_t k = kN; k-- > 0;) {
    kvf_client_result r = KVF_CLIENT_RESULT_INIT;
    ASSERT_EQ(kvf_client_wait(e.c, ids[k], 0, &r), KVF_SUCCESS) << kvf_last_error();
    expect_result(r, tokens[k], expect_counts(g, st[k], 0, tokens[k]), "store " + std::to_string(k));
  }
  uint64_t chunks = 0;
  for (uint64_t n : tokens) chunks += n / C;
  EXPECT_EQ(srv.data().l1.objects, chunks);

  // 64 retrieves at once into disjoint blocks of the destination.
  std::unique_ptr<Bytes> want = d.snapshot();
  std::unique_ptr<Bytes> eb = e.snapshot();
  for (uint32_t i = 0; i < kN; i++)
    apply_retrieve(g, KVF_FORMAT_CANONICAL, *d.lay, eb->p, st[i], want->p, rt[i], 0, tokens[i]);
  for (uint32_t i = 0; i < kN; i++)
    ASSERT_EQ(kvf_client_submit(d.c, KVF_CLIENT_RETRIEVE, &rx[i]->x, &ids[i]), KVF_SUCCESS) << kvf_last_error();
  for (uint32_t i = 0; i < kN; i++) {
    uint32_t k = (i * 37) % kN; // some other order
    kvf_client_result r = KVF_CLIENT_RESULT_INIT;
    ASSERT_EQ(kvf_client_wait(d.c, ids[k], 0, &r), KVF_SUCCESS) << kvf_last_error();
    expect_result(r, tokens[k], expect_counts(g, restrict_to(g, rt[k], tokens[k]), 0, tokens[k]),
                  "retrieve " + std::to_string(k));
  }
  EXPECT_EQ(compare(d.mem(), want->p, d.size(), *d.lay), "");
  expect_nothing_held(srv, "after 128 requests");
}

TEST(Dataplane, EightClientsInThreads) {
  TempDir tmp;
  Server srv;
  ASSERT_EQ(srv.start(tmp.sock()), KVF_SUCCESS) << kvf_last_error();
  constexpr int kClients = 8, kRounds = 4;
  constexpr uint32_t kNB = 96;
  const std::string json = small_json(kNB);
  std::vector<std::string> errors(kClients);
  std::vector<std::thread> threads;
  for (int t = 0; t < kClients; t++)
    threads.emplace_back([&, t] {
      Engine e;
      std::string why = e.open(tmp.sock(), json, 500 + t, "thread");
      if (!why.empty()) {
        errors[t] = why;
        return;
      }
      const uint32_t C = chunk_tokens(e.g);
      std::vector<uint32_t> pool = shuffled(kNB, 600 + t);
      for (int i = 0; i < kRounds; i++) {
        // Keys shared by pairs of threads: stores race on the same objects.
        std::vector<kvf_chunk_key> keys = prompt_keys(e.g, 10000 + (t / 2) * 100 + i, 3 * C);
        Tables st = make_tables({{0, 3 * C / 16}}, pool, (size_t)(i % 2) * 12);
        Tables rt = make_tables({{0, 3 * C / 16}}, pool, 48 + (size_t)(i % 2) * 12);
        Xfer sx(st, keys, C, 0, 3 * C), rx(rt, keys, C, 0, 3 * C);
        kvf_client_result sr = KVF_CLIENT_RESULT_INIT, rr = KVF_CLIENT_RESULT_INIT;
        if (kvf_client_store(e.c, &sx.x, &sr) != KVF_SUCCESS || sr.prefix_tokens != 3 * C ||
            sr.objects_done + sr.objects_present != 3) {
          errors[t] = std::string("store: ") + kvf_last_error() + " " + result_text(sr);
          return;
        }
        // The partner thread's cache differs: whoever stored first, the
        // objects hold one of the two (whole objects, never a mix).
        std::unique_ptr<Bytes> before = e.snapshot();
        if (kvf_client_retrieve(e.c, &rx.x, &rr) != KVF_SUCCESS || rr.prefix_tokens != 3 * C ||
            rr.objects_done != 3 || rr.group_blocks[0] != 12) {
          errors[t] = std::string("retrieve: ") + kvf_last_error() + " " + result_text(rr);
          return;
        }
        bool ok = false;
        for (int who = 0; who < 2 && !ok; who++) {
          int owner = (t / 2) * 2 + who;
          Bytes src(e.size());
          fill(src.p, e.size(), 500 + owner);
          std::vector<uint32_t> opool = shuffled(kNB, 600 + owner);
          Tables ost = make_tables({{0, 3 * C / 16}}, opool, (size_t)(i % 2) * 12);
          std::unique_ptr<Bytes> want(new Bytes(e.size()));
          memcpy(want->p, before->p, e.size());
          apply_retrieve(e.g, KVF_FORMAT_CANONICAL, *e.lay, src.p, ost, want->p, rt, 0, 3 * C);
          ok = compare(e.mem(), want->p, e.size(), *e.lay).empty();
        }
        if (!ok) {
          errors[t] = "round " + std::to_string(i) + ": the restored blocks match neither writer";
          return;
        }
      }
    });
  for (auto &th : threads) th.join();
  for (int t = 0; t < kClients; t++) EXPECT_EQ(errors[t], "") << "client " << t;
  expect_nothing_held(srv, "after 8 clients");
  kvf_dataplane_stats d = srv.data();
  EXPECT_EQ(d.stores_total, (uint64_t)kClients * kRounds);
  EXPECT_EQ(d.retrieves_total, (uint64_t)kClients * kRounds);
  EXPECT_EQ(d.l1.objects, (uint64_t)kClients / 2 * kRounds * 3);
}

// options.pool_alloc (kvferryd's peer transport with KVF_PEER_SHM=1): the
// pool is the caller's region and goes back through pool_free at destroy;
// a failed or unaligned allocation is given back at once and the lane takes
// anonymous memory, so nothing is leaked either way.
struct PoolAllocator {
  int allocs = 0, frees = 0;
  int fail = 0;      // 1: pool_alloc fails; 2: it returns an unaligned base
  void *given = nullptr, *freed = nullptr;
  static kvf_status alloc(void *ctx, int device, uint64_t bytes, void **base, void **handle) {
    auto *a = static_cast<PoolAllocator *>(ctx);
    a->allocs++;
    EXPECT_EQ(device, -1);
    if (a->fail == 1) return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "test: no memory");
    void *p = mmap(nullptr, bytes + 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "test: mmap");
    a->given = p;
    *base = static_cast<uint8_t *>(p) + (a->fail == 2 ? 64 : 0);
    *handle = p;
    return KVF_SUCCESS;
  }
  static void release(void *ctx, void *handle) {
    auto *a = static_cast<PoolAllocator *>(ctx);
    a->frees++;
    a->freed = handle;
  }
};

void noop_reply(void *, uint64_t, const kvf_proto_msg *) {}

TEST(Dataplane, PoolsComeFromTheCallersAllocatorAndGoBackToIt) {
  kvf_import_table *table = nullptr;
  kvf_registry *registry = nullptr;
  ASSERT_EQ(kvf_import_table_create(nullptr, &table), KVF_SUCCESS) << kvf_last_error();
  ASSERT_EQ(kvf_registry_create(table, nullptr, &registry), KVF_SUCCESS) << kvf_last_error();
  for (int fail = 0; fail < 3; fail++) {
    SCOPED_TRACE("fail " + std::to_string(fail));
    PoolAllocator a;
    a.fail = fail;
    kvf_dataplane_options o;
    memset(&o, 0, sizeof(o));
    o.registry = registry;
    o.l1_bytes = 8u << 20;
    o.reply = noop_reply;
    o.pool_alloc = PoolAllocator::alloc;
    o.pool_ctx = &a;
    kvf_dataplane *dp = nullptr;
    EXPECT_EQ(kvf_dataplane_create(&o, &dp), KVF_ERR_INVALID_ARGUMENT) << "pool_alloc without pool_free";
    o.pool_free = PoolAllocator::release;
    ASSERT_EQ(kvf_dataplane_create(&o, &dp), KVF_SUCCESS) << kvf_last_error();
    kvf_l1_pool_desc pools[2];
    ASSERT_EQ(kvf_dataplane_pools(dp, pools, 2), 1u);
    EXPECT_EQ(a.allocs, 1);
    ASSERT_NE(pools[0].base, nullptr);
    EXPECT_EQ(pools[0].size, 8u << 20);
    if (fail == 0) {
      EXPECT_EQ(pools[0].base, a.given);
      EXPECT_EQ(a.frees, 0);
    } else {
      EXPECT_NE(pools[0].base, a.given) << "a failed allocation must not be used";
      EXPECT_EQ(a.frees, fail == 2 ? 1 : 0) << "an unaligned region goes back at once";
    }
    memset(pools[0].base, 0x11, 8u << 20);
    kvf_dataplane_destroy(dp);
    EXPECT_EQ(a.frees, fail == 1 ? 0 : 1);
    if (fail != 1) {
      EXPECT_EQ(a.freed, a.given);
    }
    if (a.given) munmap(a.given, (8u << 20) + 4096);
  }
  kvf_registry_destroy(registry);
  kvf_import_table_destroy(table);
}

}  // namespace
