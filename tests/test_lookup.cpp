// LOOKUP and RETIRED notices (docs/protocol.md): kvferryd's server object in
// a forked process (as kvferryd runs), engines in the test process on the
// host backend (memfd caches), everything over the real socket. LOOKUP
// reports the prefix each object group holds by RETRIEVE's rule (full,
// sliding-window and recurrent groups of the glm-like-hybrid preset), moves
// nothing, and pins what a RETRIEVE would read against eviction until the
// pin expires, is unpinned or its connection closes, within quotas that are
// refused by name. A RETRIEVE that times out (completions held back by the
// server's test hook) is followed by a RETIRED notice once its work is
// proven done, and kvf_client_wait_retired waits for exactly that.
#include <gtest/gtest.h>

#include <ftw.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include <kvferry/client.h>
#include <kvferry/geometry.h>
#include <kvferry/memory.h>

#include "host/server/server.h"

#include "server_test_util.h"

#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define KVF_TEST_LSAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__)
#define KVF_TEST_LSAN 1
#endif
#ifdef KVF_TEST_LSAN
#include <sanitizer/lsan_interface.h>
#endif

namespace {

using Clock = std::chrono::steady_clock;

void sleep_ms(int ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); }
int64_t ms_since(Clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count();
}
bool has(const std::string &s, const std::string &needle) { return s.find(needle) != std::string::npos; }
int remove_one(const char *path, const struct stat *, int, struct FTW *) { return remove(path); }

using kvf_server_test::preset_json;
using kvf_server_test::splitmix;

// The hybrid preset (full, sliding_window 512, recurrent; chunk_tokens 256;
// three object groups) with nb blocks per group, as an engine sends it.
std::string hybrid_json(uint32_t nb) { return preset_json("glm-like-hybrid.json", nb); }

// Full attention only: 2 layers, 16-token blocks of 2 planes x 128 bytes,
// chunk_tokens 64: one object is 2 * 2 * 64 * 128 = 32 KiB.
std::string small_json(uint32_t nb) {
  char buf[1024];
  snprintf(buf, sizeof buf, R"({
  "format": "kvferry-geometry", "version": 1, "name": "lookup-small",
  "regions": [{"name": "kv", "count": 2, "size": 0}],
  "groups": [{"name": "full", "kind": "full", "block_size": 16, "num_blocks": %u,
    "layers": [{"count": 2, "name": "layer", "region": "kv", "region_step": 1, "offset": 0,
      "elem_bytes": 2, "block_stride": 2048, "planes": 2, "heads": 1, "head_bytes": 128,
      "plane_stride": "num_blocks * block_stride", "token_stride": 128, "head_stride": 128}]}],
  "objects": {"chunk_tokens": 64, "format": "canonical"}
})",
           nb);
  return buf;
}
constexpr uint64_t kSmallObject = 32768;

// ---- the server, in a process of its own --------------------------------------

struct ServerConfig {
  uint64_t l1_bytes = 64ull << 20;
  uint32_t delay_ms = 0, timeout_ms = 0;
  uint32_t max_pins = 0, max_pinned_chunks = 0;
};

kvf_server *g_child;
void child_on_term(int) { kvf_server_stop(g_child); }

class Lookup : public ::testing::Test {
 protected:
  void SetUp() override {
    char t[] = "/tmp/kvf-lookup-XXXXXX";
    ASSERT_NE(mkdtemp(t), nullptr);
    base_ = t;
    dir_ = base_ + "/s";
    signal(SIGPIPE, SIG_IGN);
  }
  void TearDown() override {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    nftw(base_.c_str(), remove_one, 16, FTW_DEPTH | FTW_PHYS);
  }

  // Fork the server; it exits 0 after SIGTERM only after a clean run.
  void start(const ServerConfig &cfg = ServerConfig()) {
    pid_ = fork();
    ASSERT_GE(pid_, 0);
    if (pid_ == 0) {
      kvf_server_options o = KVF_SERVER_OPTIONS_INIT;
      o.socket_dir = dir_.c_str();
      o.heartbeat_timeout_ms = 60000;
      o.l1_bytes = cfg.l1_bytes;
      o.test_completion_delay_ms = cfg.delay_ms;
      o.request_timeout_ms = cfg.timeout_ms;
      o.max_client_pins = cfg.max_pins;
      o.max_client_pinned_chunks = cfg.max_pinned_chunks;
      if (kvf_server_create(&o, &g_child) != KVF_SUCCESS) _exit(2);
      signal(SIGTERM, child_on_term);
      kvf_status st = kvf_server_run(g_child);
      kvf_server_destroy(g_child);
#ifdef KVF_TEST_LSAN
      /* _exit skips the leak check: the server's pins and notices must
       * leave nothing behind. */
      if (__lsan_do_recoverable_leak_check()) _exit(4);
#endif
      _exit(st == KVF_SUCCESS ? 0 : 3);
    }
    if (!kvf_server_test::wait_until_accepting(dir_)) FAIL() << "the server did not start";
  }
  void stop_expect_clean() {
    kvf_server_test::stop_expect_clean(pid_, "2 create, 3 run, 4 leaks (sanitizer builds)");
  }
  void kill_server() {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

  std::string base_, dir_;
  pid_t pid_ = -1;
};

// ---- engines ---------------------------------------------------------------

// A client with its cache (one memfd allocation, regions back to back) and
// its registration.
struct Engine {
  std::string json;
  kvf_geometry *g = nullptr;
  kvf_mem_alloc *alloc = nullptr;
  kvf_client *c = nullptr;
  uint32_t C = 0;
  Engine() = default;
  Engine(const Engine &) = delete;
  Engine &operator=(const Engine &) = delete;
  ~Engine() {
    kvf_client_disconnect(c);
    kvf_mem_alloc_destroy(alloc);
    kvf_geometry_destroy(g);
  }
  std::string open(const std::string &dir, const std::string &geometry_json, const char *name) {
    json = geometry_json;
    if (kvf_geometry_load_buffer(json.data(), json.size(), nullptr, &g, nullptr) != KVF_SUCCESS)
      return std::string("geometry: ") + kvf_last_error();
    kvf_object_policy pol = KVF_OBJECT_POLICY_INIT;
    kvf_geometry_policy(g, &pol);
    C = pol.chunk_tokens;
    std::vector<uint64_t> offs, sizes;
    uint64_t total = 0;
    for (uint32_t r = 0; r < kvf_geometry_num_regions(g); r++) {
      kvf_region_info ri = KVF_REGION_INFO_INIT;
      kvf_geometry_region(g, r, &ri);
      uint64_t align = ri.align < 4096 ? 4096 : ri.align;
      total = (total + align - 1) / align * align;
      offs.push_back(total);
      sizes.push_back(ri.size);
      total += ri.size;
    }
    kvf_mem_alloc_options ao = KVF_MEM_ALLOC_OPTIONS_INIT;
    ao.provider = KVF_MEM_PROVIDER_HOST;
    ao.size = total;
    if (kvf_mem_alloc_create(&ao, &alloc) != KVF_SUCCESS) return std::string("alloc: ") + kvf_last_error();
    uint64_t s = 99;
    uint8_t *p = static_cast<uint8_t *>(kvf_mem_alloc_ptr(alloc));
    for (uint64_t i = 0; i < total; i++) p[i] = (uint8_t)splitmix(&s);
    kvf_client_options co = KVF_CLIENT_OPTIONS_INIT;
    co.socket_dir = dir.c_str();
    co.name = name;
    co.timeout_ms = 20000;
    if (kvf_client_connect(&co, &c, nullptr) != KVF_SUCCESS) return std::string("connect: ") + kvf_last_error();
    std::vector<kvf_client_region> regions;
    for (size_t r = 0; r < offs.size(); r++) regions.push_back({alloc, offs[r], sizes[r]});
    if (kvf_client_register(c, json.data(), json.size(), -1, regions.data(), (uint32_t)regions.size(), nullptr) !=
        KVF_SUCCESS)
      return std::string("register: ") + kvf_last_error();
    return "";
  }

  // Keys of a prompt of `tokens` token ids drawn from seed.
  std::vector<kvf_chunk_key> keys(uint64_t seed, uint64_t tokens) const {
    std::vector<uint32_t> ids(tokens);
    uint64_t s = seed * 7919 + 17;
    for (auto &t : ids) t = (uint32_t)(splitmix(&s) % 151552);
    kvf_chunk_key sk;
    EXPECT_EQ(kvf_chunk_seed("lookup-test", 11, &sk), KVF_SUCCESS) << kvf_last_error();
    std::vector<kvf_chunk_key> k((tokens + C - 1) / C);
    EXPECT_EQ(kvf_chunk_keys(&sk, ids.data(), 4, tokens, C, k.data()), k.size());
    return k;
  }

  // Block tables for [tb, te): every block of full groups, the window
  // retained at te for sliding ones (every block with whole_windowed), the
  // state at te in slot `slot` for recurrent ones (none when recurrent is
  // false). Ids come from `first_id` on, distinct per block.
  struct Tables {
    std::vector<std::vector<uint32_t>> ids;
    std::vector<kvf_group_blocks> view;
  };
  Tables tables(uint64_t tb, uint64_t te, bool retrieve, bool whole_windowed = false, bool recurrent = true,
                uint32_t first_id = 0) const {
    Tables t;
    uint32_t ng = kvf_geometry_num_groups(g), next = first_id;
    t.ids.resize(ng);
    t.view.resize(ng);
    for (uint32_t i = 0; i < ng; i++) {
      kvf_group_info gi = KVF_GROUP_INFO_INIT;
      kvf_geometry_group(g, i, &gi);
      uint64_t lb = 0, le = 0;
      if (gi.kind == KVF_GROUP_RECURRENT) {
        if (recurrent && (retrieve || te % C == 0)) {
          lb = retrieve ? 0 : te / C - 1;
          le = lb + 1;
        }
      } else {
        EXPECT_EQ(kvf_geometry_local_blocks(g, i, tb, te, &lb, &le), KVF_SUCCESS);
        if (!retrieve && gi.kind != KVF_GROUP_FULL && !whole_windowed) {
          uint64_t fb = 0, eb = 0;
          EXPECT_EQ(kvf_geometry_retained_blocks(g, i, te, &fb, &eb), KVF_SUCCESS);
          lb = std::max(lb, fb);
          le = std::min(le, eb);
        }
      }
      for (uint64_t b = lb; b < le; b++) t.ids[i].push_back(next++ % gi.num_blocks);
      t.view[i] = {t.ids[i].empty() ? nullptr : t.ids[i].data(), lb, (uint32_t)t.ids[i].size()};
    }
    return t;
  }

  kvf_status xfer(kvf_client_op op, const std::vector<kvf_chunk_key> &all_keys, uint64_t tb, uint64_t te,
                  const Tables &t, kvf_client_result *r, uint64_t *submitted = nullptr) const {
    std::vector<kvf_chunk_key> k(all_keys.begin() + (long)(tb / C), all_keys.begin() + (long)((te + C - 1) / C));
    kvf_client_xfer x = KVF_CLIENT_XFER_INIT;
    x.token_begin = tb;
    x.token_end = te;
    x.chunk_keys = k.data();
    x.num_chunk_keys = (uint32_t)k.size();
    x.groups = t.view.data();
    x.num_groups = (uint32_t)t.view.size();
    if (submitted) return kvf_client_submit(c, op, &x, submitted);
    return op == KVF_CLIENT_STORE ? kvf_client_store(c, &x, r) : kvf_client_retrieve(c, &x, r);
  }
  kvf_status store(const std::vector<kvf_chunk_key> &k, uint64_t tb, uint64_t te, bool whole_windowed = false,
                   bool recurrent = true) const {
    kvf_client_result r = KVF_CLIENT_RESULT_INIT;
    return xfer(KVF_CLIENT_STORE, k, tb, te, tables(tb, te, false, whole_windowed, recurrent), &r);
  }

  kvf_status lookup(const std::vector<kvf_chunk_key> &all_keys, uint64_t tb, uint64_t te, kvf_client_lookup_result *out,
                    uint32_t pin_ms = 0) const {
    std::vector<kvf_chunk_key> k(all_keys.begin() + (long)(tb / C), all_keys.begin() + (long)((te + C - 1) / C));
    kvf_client_lookup_desc q = KVF_CLIENT_LOOKUP_DESC_INIT;
    q.token_begin = tb;
    q.token_end = te;
    q.chunk_keys = k.data();
    q.num_chunk_keys = (uint32_t)k.size();
    q.pin_ms = pin_ms;
    *out = KVF_CLIENT_LOOKUP_RESULT_INIT;
    return kvf_client_lookup(c, &q, out);
  }
};

std::string og_text(const kvf_client_lookup_result &r) {
  std::string s = "prefix " + std::to_string(r.prefix_tokens) + " og [";
  for (uint32_t i = 0; i < r.num_object_groups; i++) s += " " + std::to_string(r.object_group_prefix[i]);
  return s + " ] pin " + std::to_string(r.pin_id) + " chunks " + std::to_string(r.pinned_chunks);
}

void expect_lookup(const kvf_client_lookup_result &r, uint64_t prefix, const std::vector<uint64_t> &og,
                   const std::string &what) {
  SCOPED_TRACE(what + ": " + og_text(r));
  EXPECT_EQ(r.prefix_tokens, prefix);
  ASSERT_EQ(r.num_object_groups, og.size());
  for (size_t i = 0; i < og.size(); i++) EXPECT_EQ(r.object_group_prefix[i], og[i]) << "object group " << i;
}

kvf_client_stats stat(const Engine &e) {
  kvf_client_stats s = KVF_CLIENT_STATS_INIT;
  EXPECT_EQ(kvf_client_stat(e.c, &s), KVF_SUCCESS) << kvf_last_error();
  return s;
}

}  // namespace

// ---- LOOKUP: the prefix per object group, by RETRIEVE's rule ------------------

TEST_F(Lookup, HybridPrefixPerObjectGroupMovingNothing) {
  start();
  Engine e;
  ASSERT_EQ(e.open(dir_, hybrid_json(160), "engine"), "");
  const uint32_t C = e.C;
  ASSERT_EQ(C, 256u);
  const std::vector<kvf_chunk_key> k = e.keys(1, 4 * C), other = e.keys(2, 4 * C);
  // [0, 1024): full objects of every chunk, sliding objects of the window
  // retained at 1024 (chunks 2 and 3), the recurrent state at 1024.
  ASSERT_EQ(e.store(k, 0, 4 * C), KVF_SUCCESS) << kvf_last_error();
  kvf_client_stats before = stat(e);
  EXPECT_EQ(before.l1_objects, 4u + 2u + 1u);

  kvf_client_lookup_result r;
  ASSERT_EQ(e.lookup(k, 0, 4 * C, &r), KVF_SUCCESS) << kvf_last_error();
  expect_lookup(r, 4 * C, {4 * C, 4 * C, 4 * C}, "the whole stored range");
  EXPECT_EQ(r.pin_id, 0u);
  EXPECT_EQ(r.pinned_chunks, 0u);
  // From a later chunk boundary: the same objects, a prefix from there.
  ASSERT_EQ(e.lookup(k, C, 4 * C, &r), KVF_SUCCESS) << kvf_last_error();
  expect_lookup(r, 4 * C, {4 * C, 4 * C, 4 * C}, "from chunk 1");
  // Three chunks: full reaches 768; the window at 768 needs chunk 1's
  // sliding object and the state at 768 was never stored: both miss, so
  // nothing would be restored.
  ASSERT_EQ(e.lookup(k, 0, 3 * C, &r), KVF_SUCCESS) << kvf_last_error();
  expect_lookup(r, 0, {3 * C, 0, 0}, "three chunks");
  // A partial last chunk: the object of chunk 3 holds [768, 1024), not
  // [768, 900): it does not count.
  ASSERT_EQ(e.lookup(k, 0, 900, &r), KVF_SUCCESS) << kvf_last_error();
  expect_lookup(r, 0, {3 * C, 0, 0}, "a partial last chunk");
  // Misses give token_begin.
  ASSERT_EQ(e.lookup(other, 0, 4 * C, &r), KVF_SUCCESS) << kvf_last_error();
  expect_lookup(r, 0, {0, 0, 0}, "unknown keys");
  ASSERT_EQ(e.lookup(other, 2 * C, 4 * C, &r), KVF_SUCCESS) << kvf_last_error();
  expect_lookup(r, 2 * C, {2 * C, 2 * C, 2 * C}, "unknown keys from chunk 2");

  // The recurrent state counts at exactly the boundary it was stored at:
  // store [0, 512) too (sliding chunks 0 and 1, the state at 512).
  ASSERT_EQ(e.store(k, 0, 2 * C), KVF_SUCCESS) << kvf_last_error();
  ASSERT_EQ(e.lookup(k, 0, 3 * C, &r), KVF_SUCCESS) << kvf_last_error();
  expect_lookup(r, 2 * C, {3 * C, 3 * C, 2 * C}, "state at 512, not at 768");
  ASSERT_EQ(e.lookup(k, 0, 4 * C, &r), KVF_SUCCESS) << kvf_last_error();
  expect_lookup(r, 4 * C, {4 * C, 4 * C, 4 * C}, "state at 1024");
  // (A reply goes out just before its request leaves the in-flight count.)
  before = stat(e);
  for (int i = 0; i < 500 && before.in_flight != 0; i++) {
    sleep_ms(2);
    before = stat(e);
  }
  ASSERT_EQ(before.in_flight, 0u);

  // LOOKUP moved nothing: the server's counters are what they were.
  for (int i = 0; i < 20; i++) ASSERT_EQ(e.lookup(k, 0, 4 * C, &r), KVF_SUCCESS) << kvf_last_error();
  kvf_client_stats after = stat(e);
  EXPECT_EQ(after.l1_objects, before.l1_objects);
  EXPECT_EQ(after.l1_bytes, before.l1_bytes);
  EXPECT_EQ(after.stores_total, before.stores_total);
  EXPECT_EQ(after.retrieves_total, before.retrieves_total);
  EXPECT_EQ(after.l1_evicted_total, before.l1_evicted_total);
  EXPECT_EQ(after.in_flight, 0u);
  EXPECT_EQ(after.leases, 0u);

  // And the RETRIEVEs that follow restore exactly what LOOKUP said.
  for (uint64_t te : {3 * C, 4 * C}) {
    kvf_client_lookup_result l;
    ASSERT_EQ(e.lookup(k, 0, te, &l), KVF_SUCCESS) << kvf_last_error();
    kvf_client_result rr = KVF_CLIENT_RESULT_INIT;
    ASSERT_EQ(e.xfer(KVF_CLIENT_RETRIEVE, k, 0, te, e.tables(0, te, true, false, true, 200), &rr), KVF_SUCCESS)
        << kvf_last_error();
    EXPECT_EQ(rr.prefix_tokens, l.prefix_tokens) << "te " << te;
    ASSERT_EQ(rr.num_object_groups, l.num_object_groups);
    for (uint32_t i = 0; i < l.num_object_groups; i++)
      EXPECT_EQ(rr.object_group_prefix[i], l.object_group_prefix[i]) << "te " << te << " object group " << i;
  }

  // Bad lookups are refused naming the field; the connection stays.
  kvf_client_lookup_desc q = KVF_CLIENT_LOOKUP_DESC_INIT;
  q.token_begin = 10;
  q.token_end = 4 * C;
  q.chunk_keys = k.data();
  q.num_chunk_keys = 4;
  EXPECT_EQ(kvf_client_lookup(e.c, &q, &r), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(has(kvf_last_error(), "payload.token_begin")) << kvf_last_error();
  q.token_begin = 0;
  q.num_chunk_keys = 3;
  EXPECT_EQ(kvf_client_lookup(e.c, &q, &r), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(has(kvf_last_error(), "payload.chunk_keys: 3 keys sent")) << kvf_last_error();
  q.num_chunk_keys = 4;
  q.registration_id = 12345;
  EXPECT_EQ(kvf_client_lookup(e.c, &q, &r), KVF_ERR_STATE);
  EXPECT_TRUE(has(kvf_last_error(), "payload.registration_id")) << kvf_last_error();
  q.registration_id = 0;
  q.format = KVF_FORMAT_NATIVE; // stored canonical
  EXPECT_EQ(kvf_client_lookup(e.c, &q, &r), KVF_ERR_GEOMETRY_MISMATCH);
  EXPECT_TRUE(has(kvf_last_error(), "payload.format")) << kvf_last_error();
  ASSERT_EQ(e.lookup(k, 0, 4 * C, &r), KVF_SUCCESS) << kvf_last_error();
  // No registration: nothing to look up against.
  ASSERT_EQ(kvf_client_unregister(e.c, 0, nullptr), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(e.lookup(k, 0, 4 * C, &r), KVF_ERR_STATE);
  EXPECT_TRUE(has(kvf_last_error(), "no registration")) << kvf_last_error();
  stop_expect_clean();
}

// ---- pins --------------------------------------------------------------------

TEST_F(Lookup, PinnedChunksSurviveEvictionUntilUnpinnedExpiredOrDisconnected) {
  ServerConfig cfg;
  cfg.l1_bytes = 2 * kSmallObject; // two one-chunk entries
  start(cfg);
  Engine e;
  ASSERT_EQ(e.open(dir_, small_json(64), "engine"), "");
  const uint32_t C = e.C;
  const std::vector<kvf_chunk_key> ka = e.keys(1, C), kb = e.keys(2, C), kd = e.keys(4, 2 * C), kf = e.keys(5, C);
  ASSERT_EQ(e.store(ka, 0, C), KVF_SUCCESS) << kvf_last_error();
  ASSERT_EQ(e.store(kb, 0, C), KVF_SUCCESS) << kvf_last_error();

  kvf_client_lookup_result r;
  ASSERT_EQ(e.lookup(ka, 0, C, &r, KVF_CLIENT_MAX_PIN_MS), KVF_SUCCESS) << kvf_last_error();
  expect_lookup(r, C, {C}, "A, pinned");
  EXPECT_NE(r.pin_id, 0u);
  EXPECT_EQ(r.pinned_chunks, 1u);
  const uint64_t pin_a = r.pin_id;
  // Two chunks fit only by evicting A and B: A is pinned, so the store is
  // refused and evicts nothing.
  kvf_status st = e.store(kd, 0, 2 * C);
  EXPECT_EQ(st, KVF_ERR_OUT_OF_MEMORY) << kvf_last_error();
  EXPECT_EQ(stat(e).l1_evicted_total, 0u);
  ASSERT_EQ(e.lookup(ka, 0, C, &r), KVF_SUCCESS) << kvf_last_error();
  expect_lookup(r, C, {C}, "A is still held");
  // Unpinned (twice: idempotent), A may go.
  ASSERT_EQ(kvf_client_unpin(e.c, pin_a), KVF_SUCCESS) << kvf_last_error();
  ASSERT_EQ(kvf_client_unpin(e.c, pin_a), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(kvf_client_unpin(e.c, pin_a + 100), KVF_ERR_NOT_FOUND);
  EXPECT_TRUE(has(kvf_last_error(), "payload.pin_id")) << kvf_last_error();
  EXPECT_EQ(kvf_client_unpin(e.c, 0), KVF_ERR_INVALID_ARGUMENT);
  ASSERT_EQ(e.store(kd, 0, 2 * C), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(stat(e).l1_evicted_total, 2u);
  ASSERT_EQ(e.lookup(ka, 0, C, &r), KVF_SUCCESS) << kvf_last_error();
  expect_lookup(r, 0, {0}, "A was evicted");

  // A pin that expires: D pinned for 300 ms keeps F out until then.
  auto t0 = Clock::now();
  ASSERT_EQ(e.lookup(kd, 0, 2 * C, &r, 300), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(r.pinned_chunks, 2u);
  EXPECT_EQ(e.store(kf, 0, C), KVF_ERR_OUT_OF_MEMORY) << kvf_last_error();
  if (ms_since(t0) < 250) {
    ASSERT_EQ(e.lookup(kd, 0, 2 * C, &r), KVF_SUCCESS);
    expect_lookup(r, 2 * C, {2 * C}, "D while pinned");
  }
  sleep_ms(450);
  ASSERT_EQ(e.store(kf, 0, C), KVF_SUCCESS) << "the pin did not expire: " << kvf_last_error();
  ASSERT_EQ(kvf_client_unpin(e.c, r.pin_id ? r.pin_id : 2), KVF_SUCCESS) << "an expired pin unpins quietly";

  // A pin goes with its connection.
  {
    Engine other;
    ASSERT_EQ(other.open(dir_, small_json(64), "other"), "");
    ASSERT_EQ(other.lookup(kf, 0, C, &r, KVF_CLIENT_MAX_PIN_MS), KVF_SUCCESS) << kvf_last_error();
    EXPECT_EQ(r.pinned_chunks, 1u);
    EXPECT_EQ(e.store(kd, 0, 2 * C), KVF_ERR_OUT_OF_MEMORY) << "F is pinned by the other connection";
  }
  bool stored = false;
  for (int i = 0; i < 100 && !stored; i++) {
    stored = e.store(kd, 0, 2 * C) == KVF_SUCCESS;
    if (!stored) sleep_ms(20);
  }
  EXPECT_TRUE(stored) << "the closed connection's pin was not released: " << kvf_last_error();
  // A miss pins nothing.
  ASSERT_EQ(e.lookup(ka, 0, C, &r, 1000), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(r.pin_id, 0u);
  EXPECT_EQ(r.pinned_chunks, 0u);
  stop_expect_clean();
}

TEST_F(Lookup, PinLimitsAreRefusedNamingTheField) {
  ServerConfig cfg;
  cfg.max_pins = 2;
  cfg.max_pinned_chunks = 3;
  start(cfg);
  Engine e;
  ASSERT_EQ(e.open(dir_, small_json(64), "engine"), "");
  const uint32_t C = e.C;
  const std::vector<kvf_chunk_key> k = e.keys(1, 4 * C);
  ASSERT_EQ(e.store(k, 0, 4 * C), KVF_SUCCESS) << kvf_last_error();
  kvf_client_lookup_result r;
  // Over the protocol's limit: refused before anything is sent.
  EXPECT_EQ(e.lookup(k, 0, C, &r, KVF_CLIENT_MAX_PIN_MS + 1), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(has(kvf_last_error(), "lookup.pin_ms: 60001 exceeds the 60000 ms limit")) << kvf_last_error();
  // A lookup that may pin 4 chunks, over max_pinned_chunks 3.
  EXPECT_EQ(e.lookup(k, 0, 4 * C, &r, 1000), KVF_ERR_BUSY);
  EXPECT_TRUE(has(kvf_last_error(), "quota.pinned_chunks")) << kvf_last_error();
  // Without a pin no quota applies.
  ASSERT_EQ(e.lookup(k, 0, 4 * C, &r), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(r.prefix_tokens, 4 * C);
  // Two pins, then the third is refused by count.
  kvf_client_lookup_result p1, p2;
  ASSERT_EQ(e.lookup(k, 0, C, &p1, 10000), KVF_SUCCESS) << kvf_last_error();
  ASSERT_EQ(e.lookup(k, 0, C, &p2, 10000), KVF_SUCCESS) << kvf_last_error();
  EXPECT_NE(p1.pin_id, p2.pin_id);
  EXPECT_EQ(e.lookup(k, 0, C, &r, 10000), KVF_ERR_BUSY);
  EXPECT_TRUE(has(kvf_last_error(), "quota.pins: 2 pins held, the limit is 2")) << kvf_last_error();
  // and by chunks: 2 pinned, one lookup of 2 more chunks is over 3.
  ASSERT_EQ(kvf_client_unpin(e.c, p2.pin_id), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(e.lookup(k, 0, 3 * C, &r, 10000), KVF_ERR_BUSY);
  EXPECT_TRUE(has(kvf_last_error(), "quota.pinned_chunks")) << kvf_last_error();
  ASSERT_EQ(e.lookup(k, 0, 2 * C, &r, 10000), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(r.pinned_chunks, 2u);
  // The connection is still served.
  kvf_client_stats s = stat(e);
  EXPECT_EQ(s.l1_objects, 4u);
  stop_expect_clean();
}

// ---- RETIRED notices ------------------------------------------------------------

// Completions are proven one after another, each held back kDelayMs: with
// kDelayMs < kTimeoutMs < 2 * kDelayMs the first request of a burst is done
// and the one queued behind it times out, then retires at about 2 * kDelayMs.
constexpr uint32_t kDelayMs = 300, kTimeoutMs = 500;

ServerConfig delayed_config() {
  ServerConfig cfg;
  cfg.delay_ms = kDelayMs;
  cfg.timeout_ms = kTimeoutMs;
  return cfg;
}

// Such a burst: a filler STORE of kf's two chunks, then the RETRIEVE of kx
// (stored before) queued behind it, which times out. Their request ids in
// *fid and *rid.
void submit_filler_then_retrieve(const Engine &e, const std::vector<kvf_chunk_key> &kx,
                                 const std::vector<kvf_chunk_key> &kf, uint64_t *fid, uint64_t *rid) {
  const uint32_t C = e.C;
  ASSERT_EQ(e.xfer(KVF_CLIENT_STORE, kf, 0, 2 * C, e.tables(0, 2 * C, false, false, true, 8), nullptr, fid),
            KVF_SUCCESS)
      << kvf_last_error();
  ASSERT_EQ(e.xfer(KVF_CLIENT_RETRIEVE, kx, 0, 2 * C, e.tables(0, 2 * C, true, false, true, 20), nullptr, rid),
            KVF_SUCCESS)
      << kvf_last_error();
}

TEST_F(Lookup, TimedOutRetrieveIsFollowedByItsRetiredNotice) {
  start(delayed_config());
  Engine e;
  ASSERT_EQ(e.open(dir_, small_json(64), "engine"), "");
  const uint32_t C = e.C;
  const std::vector<kvf_chunk_key> kx = e.keys(1, 2 * C), kf = e.keys(2, 2 * C);
  ASSERT_EQ(e.store(kx, 0, 2 * C), KVF_SUCCESS) << kvf_last_error();

  // A filler store, then the retrieve queued behind it: it times out.
  uint64_t fid = 0, rid = 0;
  auto t0 = Clock::now();
  ASSERT_NO_FATAL_FAILURE(submit_filler_then_retrieve(e, kx, kf, &fid, &rid));
  // Before its reply: in flight, not retired.
  EXPECT_EQ(kvf_client_wait_retired(e.c, rid, 50), KVF_ERR_TIMEOUT);
  EXPECT_TRUE(has(kvf_last_error(), "still in flight")) << kvf_last_error();
  kvf_client_result rr = KVF_CLIENT_RESULT_INIT;
  ASSERT_EQ(kvf_client_wait(e.c, rid, 0, &rr), KVF_SUCCESS) << kvf_last_error();
  ASSERT_EQ(rr.outcome, KVF_CLIENT_TIMED_OUT) << "the retrieve was meant to time out";
  int64_t answered = ms_since(t0);
  // Answered, not yet proven: no notice.
  if (answered < 2 * (int64_t)kDelayMs - 80) {
    EXPECT_EQ(kvf_client_wait_retired(e.c, rid, 20), KVF_ERR_TIMEOUT);
    EXPECT_TRUE(has(kvf_last_error(), "no RETIRED notice yet")) << kvf_last_error();
  }
  // The notice comes once the work is proven done (its completion).
  ASSERT_EQ(kvf_client_wait_retired(e.c, rid, 5000), KVF_SUCCESS) << kvf_last_error();
  int64_t retired = ms_since(t0);
  EXPECT_GE(retired, 2 * (int64_t)kDelayMs - 30) << "retired before its completion was proven";
  EXPECT_EQ(stat(e).in_flight, 0u) << "the notice came before the request was released";
  // Again: at once.
  EXPECT_EQ(kvf_client_wait_retired(e.c, rid, 1), KVF_SUCCESS);
  // The filler completed normally: retired at once, its reply still there.
  EXPECT_EQ(kvf_client_wait_retired(e.c, fid, 1), KVF_SUCCESS) << kvf_last_error();
  kvf_client_result fr = KVF_CLIENT_RESULT_INIT;
  ASSERT_EQ(kvf_client_wait(e.c, fid, 0, &fr), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(fr.outcome, KVF_CLIENT_DONE);
  // Never a request of this client.
  EXPECT_EQ(kvf_client_wait_retired(e.c, rid + 1000, 1), KVF_ERR_NOT_FOUND);
  EXPECT_TRUE(has(kvf_last_error(), "never a request of this client")) << kvf_last_error();
  EXPECT_EQ(kvf_client_wait_retired(e.c, 0, 1), KVF_ERR_NOT_FOUND);
  // A request refused before admission (an ERROR) is retired at once.
  uint64_t bad = 0;
  std::vector<kvf_chunk_key> k1 = e.keys(3, C);
  Engine::Tables t = e.tables(0, C, false);
  kvf_client_xfer x = KVF_CLIENT_XFER_INIT;
  x.token_begin = 0;
  x.token_end = 2 * C; // two chunks, one key
  x.chunk_keys = k1.data();
  x.num_chunk_keys = 1;
  x.groups = t.view.data();
  x.num_groups = (uint32_t)t.view.size();
  ASSERT_EQ(kvf_client_submit(e.c, KVF_CLIENT_STORE, &x, &bad), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(kvf_client_wait_retired(e.c, bad, 5000), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(kvf_client_wait(e.c, bad, 0, &fr), KVF_ERR_INVALID_ARGUMENT);
  stop_expect_clean();
}

TEST_F(Lookup, AConnectionThatDiesBeforeTheNoticeSaysSo) {
  start(delayed_config());
  Engine e;
  ASSERT_EQ(e.open(dir_, small_json(64), "engine"), "");
  const uint32_t C = e.C;
  const std::vector<kvf_chunk_key> kx = e.keys(1, 2 * C), kf = e.keys(2, 2 * C);
  ASSERT_EQ(e.store(kx, 0, 2 * C), KVF_SUCCESS) << kvf_last_error();
  uint64_t fid = 0, rid = 0;
  ASSERT_NO_FATAL_FAILURE(submit_filler_then_retrieve(e, kx, kf, &fid, &rid));
  kvf_client_result rr = KVF_CLIENT_RESULT_INIT;
  ASSERT_EQ(kvf_client_wait(e.c, rid, 0, &rr), KVF_SUCCESS) << kvf_last_error();
  ASSERT_EQ(rr.outcome, KVF_CLIENT_TIMED_OUT);
  // The server dies before the proof: the notice never comes.
  kill_server();
  EXPECT_EQ(kvf_client_wait_retired(e.c, rid, 5000), KVF_ERR_DISCONNECTED);
  EXPECT_TRUE(has(kvf_last_error(), "before its work was proven retired")) << kvf_last_error();
  // A request that had completed normally stays retired.
  kvf_client_result fr = KVF_CLIENT_RESULT_INIT;
  (void)kvf_client_wait(e.c, fid, 100, &fr);
  if (fr.outcome == KVF_CLIENT_DONE) {
    EXPECT_EQ(kvf_client_wait_retired(e.c, fid, 1), KVF_SUCCESS);
  }
}
