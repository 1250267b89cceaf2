// The L1 object store (host/l1.h): reserve / commit / abort / lookup, PRESENT
// dedup, header mismatches, LRU eviction of whole entries across pools,
// pinned and reserved entries kept, extent coalescing, a randomized run
// against a model, and a multi-threaded stress (run it under TSan too).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "chunk_key_util.h"
#include "host/server/l1.h"

namespace {

constexpr uint64_t kAlign = KVF_L1_ALIGN;

uint64_t round_up(uint64_t v) { return (v + kAlign - 1) / kAlign * kAlign; }

uint64_t mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

kvf_object_header make_header(uint32_t og, uint64_t payload) {
  kvf_object_header h;
  std::memset(&h, 0, sizeof h);
  h.magic = KVF_OBJECT_MAGIC;
  h.header_version = 1;
  h.format = 0;
  h.fingerprint = 0xF00DF00DCAFEull;
  h.object_group = og;
  h.dcp_rank = 0;
  h.token_begin = 256;
  h.token_end = 512;
  h.payload_bytes = payload;
  return h;
}

// Chunk key number v in the scope most tests use (one geometry, unsharded).
kvf_l1_key L1Key(uint64_t v, uint64_t fingerprint = 0xF00DF00DCAFEull, uint32_t shard_index = 0,
                 uint32_t shard_count = 1) {
  kvf_l1_key k;
  std::memset(&k, 0, sizeof k);
  k.chunk = KeyOf(v);
  k.fingerprint = fingerprint;
  k.shard_index = shard_index;
  k.shard_count = shard_count;
  return k;
}

kvf_l1_object_spec make_spec(uint64_t key, uint32_t og, uint64_t payload) {
  kvf_l1_object_spec s;
  std::memset(&s, 0, sizeof s);
  s.key = L1Key(key);
  s.object_group = og;
  s.header = make_header(og, payload);
  return s;
}

// The bytes an object of (key, og, version) holds.
void fill(void *data, uint64_t n, uint64_t key, uint32_t og, uint64_t version) {
  uint64_t seed = mix(key * 131 + og * 7 + version * 1000003);
  auto *b = static_cast<unsigned char *>(data);
  for (uint64_t i = 0; i < n; i++) b[i] = (unsigned char)((seed >> ((i % 8) * 8)) ^ (i * 31));
}

bool intact(const void *data, uint64_t n, uint64_t key, uint32_t og, uint64_t version) {
  uint64_t seed = mix(key * 131 + og * 7 + version * 1000003);
  auto *b = static_cast<const unsigned char *>(data);
  for (uint64_t i = 0; i < n; i++)
    if (b[i] != (unsigned char)((seed >> ((i % 8) * 8)) ^ (i * 31))) return false;
  return true;
}

// Pools of aligned host memory and a store over them.
struct Store {
  std::vector<void *> mems;
  std::vector<kvf_l1_pool_desc> descs;
  kvf_l1 *l1 = nullptr;

  explicit Store(std::vector<std::pair<int, uint64_t>> pools) {
    for (auto &p : pools) {
      void *m = std::aligned_alloc(kAlign, p.second);
      std::memset(m, 0xEE, p.second);
      mems.push_back(m);
      descs.push_back(kvf_l1_pool_desc{p.first, m, p.second});
    }
    EXPECT_EQ(kvf_l1_create(descs.data(), (uint32_t)descs.size(), &l1), KVF_SUCCESS) << kvf_last_error();
  }
  ~Store() {
    kvf_l1_destroy(l1);
    for (void *m : mems) std::free(m);
  }
  kvf_l1_stats stats(int device = KVF_L1_ALL_POOLS) const {
    kvf_l1_stats s;
    EXPECT_EQ(kvf_l1_stats_get(l1, device, &s), KVF_SUCCESS) << kvf_last_error();
    return s;
  }
  const unsigned char *base(int i) const { return static_cast<const unsigned char *>(mems[i]); }

  // Reserve, fill and commit one object (version 0). Returns the status.
  kvf_status put(int device, uint64_t key, uint32_t og, uint64_t payload, void **data = nullptr) {
    kvf_l1_object_spec s = make_spec(key, og, payload);
    kvf_l1_slot slot;
    kvf_l1_reservation *r = nullptr;
    kvf_status st = kvf_l1_reserve(l1, device, &s, 1, &slot, &r, nullptr);
    if (st != KVF_SUCCESS) return st;
    if (slot.state == KVF_L1_SLOT_RESERVED) fill(slot.data, payload, key, og, 0);
    if (data) *data = slot.data;
    kvf_l1_commit(l1, r);
    return KVF_SUCCESS;
  }
  // Whether (key, og) is found committed with intact version-0 bytes (pins
  // and unpins, so the entry becomes most recently used).
  bool has(uint64_t key, uint32_t og) {
    kvf_l1_query q{L1Key(key), og};
    kvf_l1_found f;
    kvf_l1_pin *pin = nullptr;
    EXPECT_EQ(kvf_l1_lookup_pin(l1, &q, 1, &f, &pin), KVF_SUCCESS) << kvf_last_error();
    bool ok = f.found == 1;
    if (ok) {
      EXPECT_TRUE(intact(f.data, f.header.payload_bytes, key, og, 0)) << "key " << key << " og " << og;
    }
    kvf_l1_unpin(l1, pin);
    return ok;
  }
  kvf_l1_pin *pin(uint64_t key, uint32_t og) {
    kvf_l1_query q{L1Key(key), og};
    kvf_l1_found f;
    kvf_l1_pin *p = nullptr;
    EXPECT_EQ(kvf_l1_lookup_pin(l1, &q, 1, &f, &p), KVF_SUCCESS) << kvf_last_error();
    EXPECT_EQ(f.found, 1) << "key " << key;
    return p;
  }
};

bool same_stats(const kvf_l1_stats &a, const kvf_l1_stats &b) { return std::memcmp(&a, &b, sizeof a) == 0; }

bool contains(const std::string &haystack, const std::string &needle) {
  return haystack.find(needle) != std::string::npos;
}

}  // namespace

TEST(L1, RoundTrip) {
  Store st({{-1, 1 << 20}});
  kvf_l1_stats s0 = st.stats();
  EXPECT_EQ(s0.pool_bytes, 1u << 20);
  EXPECT_EQ(s0.bytes_free, 1u << 20);

  kvf_l1_object_spec specs[3] = {make_spec(11, 0, 1000), make_spec(11, 1, 5000), make_spec(12, 0, 256)};
  kvf_l1_slot slots[3];
  kvf_l1_reservation *r = nullptr;
  ASSERT_EQ(kvf_l1_reserve(st.l1, -1, specs, 3, slots, &r, nullptr), KVF_SUCCESS) << kvf_last_error();
  for (int i = 0; i < 3; i++) {
    ASSERT_EQ(slots[i].state, KVF_L1_SLOT_RESERVED);
    ASSERT_NE(slots[i].data, nullptr);
    EXPECT_EQ((uintptr_t)slots[i].data % kAlign, 0u);
    fill(slots[i].data, specs[i].header.payload_bytes, KeyNum(specs[i].key.chunk), specs[i].object_group, 0);
  }
  kvf_l1_stats s1 = st.stats(-1);
  EXPECT_EQ(s1.objects_reserved, 3u);
  EXPECT_EQ(s1.bytes_reserved, 6256u);
  EXPECT_EQ(s1.objects, 0u);
  EXPECT_EQ(s1.entries, 2u);
  EXPECT_EQ(s1.bytes_free, (1u << 20) - round_up(1000) - round_up(5000) - 256);

  // Reserved objects are invisible.
  kvf_l1_query q[4] = {{L1Key(11), 0}, {L1Key(11), 1}, {L1Key(12), 0}, {L1Key(13), 0}};
  kvf_l1_found f[4];
  kvf_l1_pin *pin = nullptr;
  ASSERT_EQ(kvf_l1_lookup_pin(st.l1, q, 4, f, &pin), KVF_SUCCESS);
  for (int i = 0; i < 4; i++) EXPECT_EQ(f[i].found, 0);
  kvf_l1_unpin(st.l1, pin);

  kvf_l1_commit(st.l1, r);
  kvf_l1_stats s2 = st.stats();
  EXPECT_EQ(s2.objects, 3u);
  EXPECT_EQ(s2.bytes_committed, 6256u);
  EXPECT_EQ(s2.objects_reserved, 0u);
  EXPECT_EQ(s2.committed_total, 3u);

  ASSERT_EQ(kvf_l1_lookup_pin(st.l1, q, 4, f, &pin), KVF_SUCCESS);
  for (int i = 0; i < 3; i++) {
    ASSERT_EQ(f[i].found, 1);
    EXPECT_EQ(f[i].data, slots[i].data);
    EXPECT_EQ(std::memcmp(&f[i].header, &specs[i].header, sizeof f[i].header), 0);
    EXPECT_TRUE(intact(f[i].data, f[i].header.payload_bytes, KeyNum(q[i].key.chunk), q[i].object_group, 0));
  }
  EXPECT_EQ(f[3].found, 0);
  EXPECT_EQ(f[3].data, nullptr);
  EXPECT_EQ(st.stats().objects_pinned, 3u);
  kvf_l1_unpin(st.l1, pin);
  EXPECT_EQ(st.stats().objects_pinned, 0u);
}

// One chunk key in four scopes: four entries, each found only through its
// own fingerprint and shard, each with its own bytes.
TEST(L1, KeysInAnotherScopeAreOtherEntries) {
  Store st({{-1, 8192}});
  const kvf_l1_key scopes[4] = {L1Key(7), L1Key(7, 0xBEEF), L1Key(7, 0xF00DF00DCAFEull, 1, 2),
                                L1Key(7, 0xF00DF00DCAFEull, 0, 2)};
  for (uint32_t i = 0; i < 4; i++) {
    kvf_l1_object_spec sp = make_spec(7, 0, 256);
    sp.key = scopes[i];
    kvf_l1_slot slot;
    kvf_l1_reservation *r = nullptr;
    ASSERT_EQ(kvf_l1_reserve(st.l1, -1, &sp, 1, &slot, &r, nullptr), KVF_SUCCESS) << kvf_last_error();
    ASSERT_EQ(slot.state, KVF_L1_SLOT_RESERVED) << "scope " << i << " found another scope's object";
    fill(slot.data, 256, 7, 0, i);
    kvf_l1_commit(st.l1, r);
  }
  EXPECT_EQ(st.stats().entries, 4u);
  for (uint32_t i = 0; i < 4; i++) {
    kvf_l1_query q{scopes[i], 0};
    kvf_l1_found f;
    kvf_l1_pin *pin = nullptr;
    ASSERT_EQ(kvf_l1_lookup_pin(st.l1, &q, 1, &f, &pin), KVF_SUCCESS);
    ASSERT_EQ(f.found, 1);
    EXPECT_TRUE(intact(f.data, 256, 7, 0, i)) << "scope " << i;
    kvf_l1_unpin(st.l1, pin);
  }
  kvf_l1_query miss{L1Key(7, 0xF00DF00DCAFEull, 2, 4), 0};
  kvf_l1_found f;
  kvf_l1_pin *pin = nullptr;
  ASSERT_EQ(kvf_l1_lookup_pin(st.l1, &miss, 1, &f, &pin), KVF_SUCCESS);
  EXPECT_EQ(f.found, 0);
  kvf_l1_unpin(st.l1, pin);
}

TEST(L1, RepeatedQueryPinsTwiceAndOneUnpinReleases) {
  Store st({{-1, 512}});
  ASSERT_EQ(st.put(-1, 1, 0, 512), KVF_SUCCESS);
  kvf_l1_query q[2] = {{L1Key(1), 0}, {L1Key(1), 0}};
  kvf_l1_found f[2];
  kvf_l1_pin *both = nullptr, *one = nullptr;
  ASSERT_EQ(kvf_l1_lookup_pin(st.l1, q, 2, f, &both), KVF_SUCCESS);
  ASSERT_EQ(kvf_l1_lookup_pin(st.l1, q, 1, f, &one), KVF_SUCCESS);
  EXPECT_EQ(st.stats().objects_pinned, 1u);
  kvf_l1_unpin(st.l1, both);
  // Still pinned by `one`: a new object cannot evict it.
  EXPECT_EQ(st.put(-1, 2, 0, 256), KVF_ERR_OUT_OF_MEMORY);
  kvf_l1_unpin(st.l1, one);
  EXPECT_EQ(st.stats().objects_pinned, 0u);
  EXPECT_EQ(st.put(-1, 2, 0, 256), KVF_SUCCESS);
  EXPECT_FALSE(st.has(1, 0));
}

TEST(L1, PresentDedup) {
  Store st({{0, 64 * 1024}, {1, 64 * 1024}});
  ASSERT_EQ(st.put(0, 5, 0, 700), KVF_SUCCESS);

  // Reserved by another request, and committed: both PRESENT, in any pool;
  // a new object in the same call is still reserved.
  kvf_l1_object_spec a = make_spec(6, 0, 300);
  kvf_l1_slot sa;
  kvf_l1_reservation *ra = nullptr;
  ASSERT_EQ(kvf_l1_reserve(st.l1, 0, &a, 1, &sa, &ra, nullptr), KVF_SUCCESS);
  ASSERT_EQ(sa.state, KVF_L1_SLOT_RESERVED);

  kvf_l1_object_spec b[3] = {make_spec(5, 0, 700), make_spec(6, 0, 300), make_spec(5, 1, 400)};
  kvf_l1_slot sb[3];
  kvf_l1_reservation *rb = nullptr;
  ASSERT_EQ(kvf_l1_reserve(st.l1, 1, b, 3, sb, &rb, nullptr), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(sb[0].state, KVF_L1_SLOT_PRESENT);
  EXPECT_EQ(sb[0].data, nullptr);
  EXPECT_EQ(sb[1].state, KVF_L1_SLOT_PRESENT);
  EXPECT_EQ(sb[2].state, KVF_L1_SLOT_RESERVED);
  EXPECT_GE((const unsigned char *)sb[2].data, st.base(1));
  EXPECT_EQ(st.stats(1).objects_reserved, 1u);
  fill(sb[2].data, 400, 5, 1, 0);
  kvf_l1_commit(st.l1, rb);

  // A handle whose every slot is PRESENT commits (or aborts) as a no-op.
  kvf_l1_object_spec c = make_spec(5, 1, 400);
  kvf_l1_slot sc;
  kvf_l1_reservation *rc = nullptr;
  ASSERT_EQ(kvf_l1_reserve(st.l1, 0, &c, 1, &sc, &rc, nullptr), KVF_SUCCESS);
  EXPECT_EQ(sc.state, KVF_L1_SLOT_PRESENT);
  ASSERT_NE(rc, nullptr);
  kvf_l1_stats before = st.stats();
  kvf_l1_abort(st.l1, rc);
  kvf_l1_stats after = st.stats();
  EXPECT_TRUE(same_stats(before, after));

  kvf_l1_abort(st.l1, ra);
  EXPECT_FALSE(st.has(6, 0));
  EXPECT_TRUE(st.has(5, 0));
  EXPECT_TRUE(st.has(5, 1));
  kvf_l1_stats s = st.stats();
  EXPECT_EQ(s.objects, 2u);
  EXPECT_EQ(s.entries, 1u);
  EXPECT_EQ(s.aborted_total, 1u);
}

TEST(L1, HeaderMismatchNamesTheField) {
  Store st({{-1, 64 * 1024}});
  ASSERT_EQ(st.put(-1, 9, 2, 1000), KVF_SUCCESS);
  kvf_l1_object_spec held = make_spec(10, 0, 500);  // reserved, not committed
  kvf_l1_slot hs;
  kvf_l1_reservation *hr = nullptr;
  ASSERT_EQ(kvf_l1_reserve(st.l1, -1, &held, 1, &hs, &hr, nullptr), KVF_SUCCESS);

  struct Case {
    const char *field;
    void (*mutate)(kvf_object_header *);
  } cases[] = {
      {"format", [](kvf_object_header *h) { h->format = 1; }},
      {"fingerprint", [](kvf_object_header *h) { h->fingerprint ^= 1; }},
      {"dcp_rank", [](kvf_object_header *h) { h->dcp_rank = 3; }},
      {"token_begin", [](kvf_object_header *h) { h->token_begin = 0; }},
      {"token_end", [](kvf_object_header *h) { h->token_end = 300; }},
      {"payload_bytes", [](kvf_object_header *h) { h->payload_bytes += 1; }},
  };
  for (uint64_t key : {9ull, 10ull}) {
    uint32_t og = key == 9 ? 2 : 0;
    uint64_t payload = key == 9 ? 1000 : 500;
    for (const Case &c : cases) {
      kvf_l1_object_spec specs[2] = {make_spec(77, 0, 300), make_spec(key, og, payload)};
      c.mutate(&specs[1].header);
      kvf_l1_slot slots[2];
      kvf_l1_reservation *r = nullptr;
      kvf_l1_stats before = st.stats();
      uint32_t failed = 0;
      EXPECT_EQ(kvf_l1_reserve(st.l1, -1, specs, 2, slots, &r, &failed), KVF_ERR_GEOMETRY_MISMATCH) << c.field;
      EXPECT_TRUE(contains(kvf_last_error(), std::string("specs[1].header.") + c.field)) << kvf_last_error();
      EXPECT_EQ(failed, 1u) << "the failing spec, as a value";
      EXPECT_EQ(r, nullptr);
      kvf_l1_stats after = st.stats();
      EXPECT_TRUE(same_stats(before, after)) << "nothing reserved on failure (" << c.field << ")";
    }
  }
  kvf_l1_abort(st.l1, hr);
}

TEST(L1, AbortFreesSpace) {
  Store st({{0, 32 * 1024}, {1, 32 * 1024}});
  kvf_l1_stats s0 = st.stats(), p0 = st.stats(0);
  kvf_l1_object_spec specs[4] = {make_spec(1, 0, 1), make_spec(1, 1, 8000), make_spec(2, 0, 257),
                                 make_spec(3, 0, 4096)};
  kvf_l1_slot slots[4];
  kvf_l1_reservation *r = nullptr;
  ASSERT_EQ(kvf_l1_reserve(st.l1, 0, specs, 4, slots, &r, nullptr), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(st.stats(0).bytes_free, 32 * 1024 - (256 + 8192 + 512 + 4096));
  EXPECT_EQ(st.stats(1).bytes_free, 32u * 1024);
  EXPECT_EQ(st.stats().entries, 3u);
  kvf_l1_abort(st.l1, r);
  kvf_l1_stats s1 = st.stats(), p1 = st.stats(0);
  EXPECT_EQ(s1.bytes_free, s1.pool_bytes);
  EXPECT_EQ(p1.bytes_free, 32u * 1024);
  EXPECT_EQ(s1.aborted_total, 4u);
  s1.aborted_total = 0;
  p1.aborted_total = 0;
  EXPECT_TRUE(same_stats(s0, s1));
  EXPECT_TRUE(same_stats(p0, p1));
  // The whole pool is one extent again.
  void *data = nullptr;
  ASSERT_EQ(st.put(0, 4, 0, 32 * 1024, &data), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(data, st.mems[0]);
}

TEST(L1, EvictsLruWholeEntriesAcrossPools) {
  Store st({{0, 4096}, {1, 4096}});
  // Entries 1..4: object group 0 in pool 0, object group 1 in pool 1, 1 KiB each.
  for (uint64_t k = 1; k <= 4; k++) {
    ASSERT_EQ(st.put(0, k, 0, 1024), KVF_SUCCESS) << kvf_last_error();
    ASSERT_EQ(st.put(1, k, 1, 1024), KVF_SUCCESS) << kvf_last_error();
  }
  EXPECT_EQ(st.stats(0).bytes_free, 0u);
  EXPECT_EQ(st.stats(1).bytes_free, 0u);
  // A lookup refreshes entry 1: entry 2 is now the least recently used.
  EXPECT_TRUE(st.has(1, 0));
  ASSERT_EQ(st.put(0, 5, 0, 1024), KVF_SUCCESS) << kvf_last_error();
  EXPECT_FALSE(st.has(2, 0));
  EXPECT_FALSE(st.has(2, 1));  // the whole entry, in the other pool too
  kvf_l1_stats all = st.stats(), p0 = st.stats(0), p1 = st.stats(1);
  EXPECT_EQ(all.evicted_entries_total, 1u);
  EXPECT_EQ(all.evicted_bytes_total, 2048u);
  EXPECT_EQ(p0.evicted_entries_total, 1u);
  EXPECT_EQ(p1.evicted_entries_total, 1u);
  EXPECT_EQ(p1.evicted_bytes_total, 1024u);
  EXPECT_EQ(p1.bytes_free, 1024u);
  EXPECT_EQ(p1.objects, 3u);
  EXPECT_EQ(p1.entries, 3u);
  EXPECT_EQ(all.entries, 4u);
  for (uint64_t k : {1ull, 3ull, 4ull}) {
    EXPECT_TRUE(st.has(k, 0)) << k;
    EXPECT_TRUE(st.has(k, 1)) << k;
  }
  // Recency now: 5 (committed), then the lookups 1, 3, 4: but has(k, 1)
  // follows has(k, 0), so the order oldest first is 5, 1, 3, 4. A 2 KiB
  // object in pool 1 (free: entry 2's old 1 KiB there) fits once its
  // neighbour goes: entry 1 (the LRU one with an object in pool 1; entry 5
  // has none there) sits at [0, 1K), entry 2's hole at [1K, 2K).
  void *data = nullptr;
  ASSERT_EQ(st.put(1, 6, 0, 2048, &data), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(data, st.mems[1]);
  EXPECT_FALSE(st.has(1, 0));
  EXPECT_FALSE(st.has(1, 1));
  EXPECT_TRUE(st.has(5, 0));
  EXPECT_TRUE(st.has(3, 1));
  EXPECT_TRUE(st.has(4, 1));
  EXPECT_EQ(st.stats().evicted_entries_total, 2u);
  EXPECT_EQ(st.stats(0).bytes_free, 1024u);  // entry 1's pool-0 object went with it
}

TEST(L1, EvictionSkipsPinnedAndReservedEntries) {
  Store st({{-1, 8192}});
  for (uint64_t k = 1; k <= 7; k++) ASSERT_EQ(st.put(-1, k, 0, 1024), KVF_SUCCESS);
  kvf_l1_object_spec s8 = make_spec(8, 0, 1024);
  kvf_l1_slot slot8;
  kvf_l1_reservation *r8 = nullptr;
  ASSERT_EQ(kvf_l1_reserve(st.l1, -1, &s8, 1, &slot8, &r8, nullptr), KVF_SUCCESS);
  fill(slot8.data, 1024, 8, 0, 0);
  kvf_l1_pin *pins[3];
  for (uint64_t k = 1; k <= 3; k++) pins[k - 1] = st.pin(k, 0);
  // LRU oldest first: 4 5 6 7 1 2 3 (pinned), 8 reserved. 2 KiB evicts 4, 5.
  ASSERT_EQ(st.put(-1, 9, 0, 2048), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(st.stats().evicted_entries_total, 2u);
  kvf_l1_stats s = st.stats();
  EXPECT_EQ(s.objects_pinned, 3u);
  EXPECT_EQ(s.objects_reserved, 1u);

  // 5 KiB: only 6, 7 and 9 (4 KiB) are evictable: refused, nothing evicted.
  kvf_l1_stats before = st.stats();
  kvf_l1_object_spec big = make_spec(10, 0, 5120);
  kvf_l1_slot bs;
  kvf_l1_reservation *br = nullptr;
  EXPECT_EQ(kvf_l1_reserve(st.l1, -1, &big, 1, &bs, &br, nullptr), KVF_ERR_OUT_OF_MEMORY);
  EXPECT_TRUE(contains(kvf_last_error(), "needs 5120 bytes")) << kvf_last_error();
  EXPECT_TRUE(contains(kvf_last_error(), "4096 more evictable")) << kvf_last_error();
  kvf_l1_stats after = st.stats();
  EXPECT_TRUE(same_stats(before, after));
  for (uint64_t k : {6ull, 7ull, 9ull}) EXPECT_TRUE(st.has(k, 0)) << k;

  // The pinned ones survive the pins' readers and go once unpinned.
  for (int i = 0; i < 3; i++) kvf_l1_unpin(st.l1, pins[i]);
  EXPECT_EQ(st.stats().objects_pinned, 0u);
  ASSERT_EQ(st.put(-1, 10, 0, 5120), KVF_SUCCESS) << kvf_last_error();
  EXPECT_TRUE(intact(slot8.data, 1024, 8, 0, 0));  // the reservation was neither moved nor overwritten
  EXPECT_EQ(st.stats().objects_reserved, 1u);
  kvf_l1_commit(st.l1, r8);
  EXPECT_TRUE(st.has(8, 0));
  EXPECT_TRUE(st.has(10, 0));
}

TEST(L1, RefusedReservationEvictsNothing) {
  // Four 256-byte objects A B C D; B and D pinned: A and C are evictable,
  // 512 bytes, but never contiguous, so a 512-byte object cannot fit.
  Store st({{-1, 1024}});
  for (uint64_t k = 1; k <= 4; k++) ASSERT_EQ(st.put(-1, k, 0, 256), KVF_SUCCESS);
  kvf_l1_pin *pb = st.pin(2, 0), *pd = st.pin(4, 0);
  kvf_l1_stats before = st.stats();
  kvf_l1_object_spec s = make_spec(5, 0, 512);
  kvf_l1_slot slot;
  kvf_l1_reservation *r = nullptr;
  EXPECT_EQ(kvf_l1_reserve(st.l1, -1, &s, 1, &slot, &r, nullptr), KVF_ERR_OUT_OF_MEMORY);
  kvf_l1_stats after = st.stats();
  EXPECT_TRUE(same_stats(before, after));
  EXPECT_TRUE(st.has(1, 0));
  EXPECT_TRUE(st.has(3, 0));
  // Unpin D. Recency oldest first: B, D (the pins), A, C (the has calls).
  // B is still pinned; D alone frees 256 bytes, A adds a hole that does not
  // touch it, C joins D's: D, A and C are evicted, the object lands at 512.
  kvf_l1_unpin(st.l1, pd);
  void *data = nullptr;
  ASSERT_EQ(st.put(-1, 5, 0, 512, &data), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(data, (void *)(st.base(0) + 512));
  EXPECT_TRUE(st.has(2, 0));
  EXPECT_FALSE(st.has(1, 0));
  EXPECT_FALSE(st.has(3, 0));
  EXPECT_FALSE(st.has(4, 0));
  EXPECT_EQ(st.stats().evicted_entries_total, 3u);
  kvf_l1_unpin(st.l1, pb);
}

TEST(L1, FreedExtentsCoalesce) {
  const uint64_t pool = 256 * 1024;
  Store st({{-1, pool}});
  std::mt19937_64 rng(42);
  struct Held {
    kvf_l1_reservation *r;
    const unsigned char *data;
    uint64_t len;
  };
  std::vector<Held> held;
  for (uint64_t k = 1;; k++) {
    uint64_t payload = 1 + rng() % 3000;
    kvf_l1_object_spec s = make_spec(k, 0, payload);
    kvf_l1_slot slot;
    kvf_l1_reservation *r = nullptr;
    kvf_status status = kvf_l1_reserve(st.l1, -1, &s, 1, &slot, &r, nullptr);
    if (status == KVF_ERR_OUT_OF_MEMORY) break;
    ASSERT_EQ(status, KVF_SUCCESS) << kvf_last_error();
    held.push_back({r, (const unsigned char *)slot.data, round_up(payload)});
  }
  ASSERT_GT(held.size(), 100u);
  // Commit every third one: these are freed by eviction below.
  for (size_t i = 0; i < held.size(); i += 3) {
    kvf_l1_commit(st.l1, held[i].r);
    held[i].r = nullptr;
  }
  std::sort(held.begin(), held.end(), [](const Held &a, const Held &b) { return a.data < b.data; });
  for (size_t i = 1; i < held.size(); i++) ASSERT_LE(held[i - 1].data + held[i - 1].len, held[i].data);
  EXPECT_LT(st.stats().bytes_free, 3000u + 256);
  std::shuffle(held.begin(), held.end(), rng);
  for (Held &h : held)
    if (h.r) kvf_l1_abort(st.l1, h.r);
  EXPECT_EQ(st.stats().objects_reserved, 0u);
  // The committed third and the aborted holes merge: one object of the
  // whole pool fits (evicting every committed entry).
  void *data = nullptr;
  ASSERT_EQ(st.put(-1, 1000000, 0, pool, &data), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(data, st.mems[0]);
  kvf_l1_stats s = st.stats();
  EXPECT_EQ(s.bytes_free, 0u);
  EXPECT_EQ(s.objects, 1u);
  EXPECT_EQ(s.entries, 1u);
}

TEST(L1, BadArgumentsNameTheField) {
  void *mem = std::aligned_alloc(kAlign, 8192);
  unsigned char *m = static_cast<unsigned char *>(mem);
  kvf_l1 *l1 = nullptr;
  struct CreateCase {
    std::vector<kvf_l1_pool_desc> pools;
    const char *msg;
  } creates[] = {
      {{{-1, nullptr, 4096}}, "pools[0].base: NULL"},
      {{{0, m, 4096}, {1, m + 4096 + 16, 1024}}, "pools[1].base"},
      {{{0, m, 4096}, {0, m + 4096, 1024}}, "pools[1].device"},
      {{{0, m, 4096}, {1, m + 2048, 1024}}, "overlaps pools[0]"},
      {{{0, m, 100}}, "pools[0].size"},
      {{{-2, m, 4096}}, "pools[0].device"},
  };
  for (auto &c : creates) {
    EXPECT_EQ(kvf_l1_create(c.pools.data(), (uint32_t)c.pools.size(), &l1), KVF_ERR_INVALID_ARGUMENT) << c.msg;
    EXPECT_TRUE(contains(kvf_last_error(), c.msg)) << kvf_last_error();
    EXPECT_EQ(l1, nullptr);
  }
  kvf_l1_pool_desc one{3, m, 8192};
  EXPECT_EQ(kvf_l1_create(&one, 0, &l1), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(kvf_last_error(), "num_pools"));
  EXPECT_EQ(kvf_l1_create(&one, 65, &l1), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(kvf_l1_create(nullptr, 1, &l1), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(kvf_l1_create(&one, 1, nullptr), KVF_ERR_INVALID_ARGUMENT);
  ASSERT_EQ(kvf_l1_create(&one, 1, &l1), KVF_SUCCESS);

  kvf_l1_slot slots[3];
  kvf_l1_reservation *r = nullptr;
  kvf_l1_object_spec good[1] = {make_spec(1, 0, 100)};
  EXPECT_EQ(kvf_l1_reserve(l1, 3, good, 0, slots, &r, nullptr), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(kvf_last_error(), "n: 0"));
  EXPECT_EQ(kvf_l1_reserve(l1, 3, nullptr, 1, slots, &r, nullptr), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(kvf_last_error(), "specs is NULL"));
  EXPECT_EQ(kvf_l1_reserve(l1, 3, good, 1, nullptr, &r, nullptr), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(kvf_l1_reserve(l1, 3, good, 1, slots, nullptr, nullptr), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(kvf_l1_reserve(nullptr, 3, good, 1, slots, &r, nullptr), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(kvf_l1_reserve(l1, 4, good, 1, slots, &r, nullptr), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(kvf_last_error(), "device: no pool 4"));

  struct SpecCase {
    void (*mutate)(kvf_l1_object_spec *);
    const char *msg;
  } specs[] = {
      {[](kvf_l1_object_spec *s) { s->key = L1Key(0); }, "specs[2].key.chunk"},
      {[](kvf_l1_object_spec *s) { s->object_group = KVF_MAX_GROUPS; }, "specs[2].object_group"},
      {[](kvf_l1_object_spec *s) { s->header.object_group = 5; }, "specs[2].header.object_group"},
      {[](kvf_l1_object_spec *s) { s->header.payload_bytes = 0; }, "specs[2].header.payload_bytes"},
      {[](kvf_l1_object_spec *s) { s->header.payload_bytes = UINT64_MAX - 3; }, "specs[2].header.payload_bytes"},
      {[](kvf_l1_object_spec *s) { s->header.magic = 7; }, "specs[2].header.magic"},
      {[](kvf_l1_object_spec *s) { s->header.header_version = 2; }, "specs[2].header.header_version"},
      {[](kvf_l1_object_spec *s) { *s = make_spec(1, 0, 100); }, "specs[2]: repeats specs[0]"},
  };
  for (auto &c : specs) {
    kvf_l1_object_spec three[3] = {make_spec(1, 0, 100), make_spec(2, 0, 100), make_spec(3, 1, 100)};
    c.mutate(&three[2]);
    uint32_t failed = 0;
    EXPECT_EQ(kvf_l1_reserve(l1, 3, three, 3, slots, &r, &failed), KVF_ERR_INVALID_ARGUMENT) << c.msg;
    EXPECT_TRUE(contains(kvf_last_error(), c.msg)) << kvf_last_error();
    EXPECT_EQ(failed, 2u) << c.msg;
  }
  // Failures about no one spec, and success, leave no index.
  uint32_t failed = 0;
  EXPECT_EQ(kvf_l1_reserve(l1, 4, good, 1, slots, &r, &failed), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(failed, UINT32_MAX);
  // Larger than the pool: out of memory, with the sizes.
  kvf_l1_object_spec huge = make_spec(1, 0, 8193);
  failed = 0;
  EXPECT_EQ(kvf_l1_reserve(l1, 3, &huge, 1, slots, &r, &failed), KVF_ERR_OUT_OF_MEMORY);
  EXPECT_TRUE(contains(kvf_last_error(), "8448")) << kvf_last_error();
  EXPECT_EQ(failed, UINT32_MAX);
  failed = 0;
  ASSERT_EQ(kvf_l1_reserve(l1, 3, good, 1, slots, &r, &failed), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(failed, UINT32_MAX);
  kvf_l1_abort(l1, r);

  kvf_l1_query q[2] = {{L1Key(1), 0}, {L1Key(0), 0}};
  kvf_l1_found f[2];
  kvf_l1_pin *pin = nullptr;
  EXPECT_EQ(kvf_l1_lookup_pin(l1, q, 2, f, &pin), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(kvf_last_error(), "queries[1].key.chunk"));
  q[1] = {L1Key(2), 64};
  EXPECT_EQ(kvf_l1_lookup_pin(l1, q, 2, f, &pin), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(kvf_last_error(), "queries[1].object_group"));
  // No queries: an empty handle.
  ASSERT_EQ(kvf_l1_lookup_pin(l1, nullptr, 0, nullptr, &pin), KVF_SUCCESS);
  ASSERT_NE(pin, nullptr);
  kvf_l1_unpin(l1, pin);
  EXPECT_EQ(kvf_l1_lookup_pin(l1, nullptr, 1, f, &pin), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(kvf_l1_lookup_pin(l1, q, 1, nullptr, &pin), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(kvf_l1_lookup_pin(l1, q, 1, f, nullptr), KVF_ERR_INVALID_ARGUMENT);

  kvf_l1_stats s;
  EXPECT_EQ(kvf_l1_stats_get(l1, 2, &s), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(kvf_last_error(), "device: no pool 2"));
  EXPECT_EQ(kvf_l1_stats_get(l1, 3, nullptr), KVF_ERR_INVALID_ARGUMENT);
  ASSERT_EQ(kvf_l1_stats_get(l1, 3, &s), KVF_SUCCESS);
  EXPECT_EQ(s.objects_reserved, 0u);
  EXPECT_EQ(s.entries, 0u);
  EXPECT_EQ(s.bytes_free, 8192u);

  kvf_l1_commit(l1, nullptr);
  kvf_l1_abort(l1, nullptr);
  kvf_l1_unpin(l1, nullptr);
  kvf_l1_destroy(l1);
  kvf_l1_destroy(nullptr);
  std::free(mem);
}

TEST(L1, PoolSizeRoundsDownAndDestroyFreesHeldHandles) {
  void *mem = std::aligned_alloc(kAlign, 4096);
  kvf_l1_pool_desc d{-1, mem, 4000};
  kvf_l1 *l1 = nullptr;
  ASSERT_EQ(kvf_l1_create(&d, 1, &l1), KVF_SUCCESS);
  kvf_l1_stats s;
  ASSERT_EQ(kvf_l1_stats_get(l1, -1, &s), KVF_SUCCESS);
  EXPECT_EQ(s.pool_bytes, 3840u);
  EXPECT_EQ(s.bytes_free, 3840u);
  kvf_l1_object_spec a = make_spec(1, 0, 1000), b = make_spec(2, 0, 1000);
  kvf_l1_slot slot;
  kvf_l1_reservation *ra = nullptr, *rb = nullptr;
  ASSERT_EQ(kvf_l1_reserve(l1, -1, &a, 1, &slot, &ra, nullptr), KVF_SUCCESS);
  kvf_l1_commit(l1, ra);
  ASSERT_EQ(kvf_l1_reserve(l1, -1, &b, 1, &slot, &rb, nullptr), KVF_SUCCESS);
  kvf_l1_query q{L1Key(1), 0};
  kvf_l1_found f;
  kvf_l1_pin *pin = nullptr;
  ASSERT_EQ(kvf_l1_lookup_pin(l1, &q, 1, &f, &pin), KVF_SUCCESS);
  ASSERT_EQ(f.found, 1);
  kvf_l1_destroy(l1);  // rb and pin still held: logged and freed (ASan checks the leak)
  std::free(mem);
}

// ---- randomized, against a model ----------------------------------------------

namespace {

struct ModelObj {
  int state;  // 1 reserved, 2 committed
  int pool;   // index into the store's pools
  uint64_t payload, version;
  const unsigned char *data;
  uint64_t pins;
};

using Key = std::pair<uint64_t, uint32_t>;

struct Model {
  Store &st;
  std::map<Key, ModelObj> objs;
  std::map<uint64_t, uint64_t> recency;  // chunk key -> last touch (larger is newer)
  uint64_t clock = 0, next_version = 1, refused = 0;
  struct Res {
    kvf_l1_reservation *h;
    std::vector<Key> keys;
  };
  struct Pin {
    kvf_l1_pin *h;
    std::vector<Key> keys;
  };
  std::vector<Res> reservations;
  std::vector<Pin> pins;

  explicit Model(Store &s) : st(s) {}

  static uint64_t payload_of(const Key &k) { return 1 + mix(k.first * 3 + k.second) % 3500; }

  bool key_live(uint64_t key) const {
    auto it = objs.lower_bound({key, 0});
    return it != objs.end() && it->first.first == key;
  }

  void check_invariants() {
    for (size_t pi = 0; pi < st.descs.size(); pi++) {
      int dev = st.descs[pi].device;
      kvf_l1_stats s = st.stats(dev);
      uint64_t objects = 0, bytes = 0, reserved = 0, rbytes = 0, pinned = 0, used = 0;
      std::set<uint64_t> keys;
      std::vector<std::pair<const unsigned char *, uint64_t>> extents;
      for (auto &kv : objs) {
        const ModelObj &o = kv.second;
        if (o.pool != (int)pi) continue;
        keys.insert(kv.first.first);
        used += round_up(o.payload);
        extents.push_back({o.data, round_up(o.payload)});
        if (o.state == 2) {
          objects++;
          bytes += o.payload;
          if (o.pins) pinned++;
        } else {
          reserved++;
          rbytes += o.payload;
        }
      }
      ASSERT_EQ(s.objects, objects);
      ASSERT_EQ(s.bytes_committed, bytes);
      ASSERT_EQ(s.objects_reserved, reserved);
      ASSERT_EQ(s.bytes_reserved, rbytes);
      ASSERT_EQ(s.objects_pinned, pinned);
      ASSERT_EQ(s.entries, keys.size());
      ASSERT_EQ(s.bytes_free + used, s.pool_bytes);
      std::sort(extents.begin(), extents.end());
      for (size_t i = 0; i < extents.size(); i++) {
        ASSERT_GE(extents[i].first, st.base((int)pi));
        ASSERT_LE(extents[i].first + extents[i].second, st.base((int)pi) + s.pool_bytes);
        if (i) {
          ASSERT_LE(extents[i - 1].first + extents[i - 1].second, extents[i].first) << "extents overlap";
        }
      }
    }
    std::set<uint64_t> keys;
    for (auto &kv : objs) keys.insert(kv.first.first);
    ASSERT_EQ(st.stats().entries, keys.size());
  }

  // After a reserve in pool `pi` that evicted `evicted` entries: find them
  // (a lookup of every committed object), check they were the oldest
  // evictable entries with an object in that pool, and forget them.
  void sync_evictions(int pi, uint64_t evicted, uint64_t evicted_bytes, const std::set<uint64_t> &named,
                      const std::map<uint64_t, uint64_t> &recency_before) {
    // The candidates as the store saw them before the call, oldest first.
    std::vector<std::pair<uint64_t, uint64_t>> candidates;  // (recency, key)
    for (auto &kr : recency_before) {
      uint64_t key = kr.first;
      bool in_pool = false, blocked = named.count(key) != 0, any = false;
      for (auto it = objs.lower_bound({key, 0}); it != objs.end() && it->first.first == key; ++it) {
        any = true;
        if (it->second.pool == pi) in_pool = true;
        if (it->second.state == 1 || it->second.pins) blocked = true;
      }
      if (any && in_pool && !blocked) candidates.push_back({kr.second, key});
    }
    std::sort(candidates.begin(), candidates.end());
    ASSERT_LE(evicted, candidates.size());
    uint64_t bytes = 0;
    std::set<uint64_t> gone;
    for (uint64_t i = 0; i < evicted; i++) gone.insert(candidates[i].second);

    std::vector<kvf_l1_query> q;
    std::vector<Key> qk;
    for (auto &kv : objs)
      if (kv.second.state == 2) {
        q.push_back({L1Key(kv.first.first), kv.first.second});
        qk.push_back(kv.first);
      }
    if (q.empty()) return;
    std::vector<kvf_l1_found> f(q.size());
    kvf_l1_pin *pin = nullptr;
    ASSERT_EQ(kvf_l1_lookup_pin(st.l1, q.data(), (uint32_t)q.size(), f.data(), &pin), KVF_SUCCESS);
    for (size_t i = 0; i < q.size(); i++) {
      bool expect_gone = gone.count(qk[i].first) != 0;
      ASSERT_EQ(f[i].found, expect_gone ? 0 : 1)
          << "key " << qk[i].first << " og " << qk[i].second << (expect_gone ? " should be evicted" : " evicted");
      if (expect_gone) {
        bytes += objs[qk[i]].payload;
      } else {
        ASSERT_EQ(f[i].data, objs[qk[i]].data);
        recency[qk[i].first] = ++clock;  // the probe refreshed it
      }
    }
    kvf_l1_unpin(st.l1, pin);
    ASSERT_EQ(bytes, evicted_bytes);
    for (uint64_t key : gone) {
      for (auto it = objs.lower_bound({key, 0}); it != objs.end() && it->first.first == key;) it = objs.erase(it);
      recency.erase(key);
    }
  }

  void op_reserve(std::mt19937_64 &rng) {
    int pi = (int)(rng() % st.descs.size());
    uint32_t n = 1 + rng() % 4;
    std::vector<kvf_l1_object_spec> specs;
    std::set<Key> seen;
    int mismatch_at = -1;
    while (specs.size() < n) {
      Key k{1 + rng() % 40, (uint32_t)(rng() % 3)};
      if (!seen.insert(k).second) continue;
      specs.push_back(make_spec(k.first, k.second, payload_of(k)));
      if (mismatch_at < 0 && objs.count(k) && rng() % 20 == 0) {
        specs.back().header.token_end += 1;
        mismatch_at = (int)specs.size() - 1;
      }
    }
    // The first spec that names a live object with another header fails the call.
    std::vector<kvf_l1_slot> slots(n);
    kvf_l1_reservation *r = nullptr;
    kvf_l1_stats before = st.stats();
    std::map<uint64_t, uint64_t> recency_before = recency;
    kvf_status status = kvf_l1_reserve(st.l1, st.descs[pi].device, specs.data(), n, slots.data(), &r, nullptr);
    if (mismatch_at >= 0) {
      ASSERT_EQ(status, KVF_ERR_GEOMETRY_MISMATCH);
      ASSERT_TRUE(contains(kvf_last_error(), "specs[" + std::to_string(mismatch_at) + "].header.token_end"))
          << kvf_last_error();
      kvf_l1_stats after = st.stats();
      ASSERT_TRUE(same_stats(before, after));
      return;
    }
    if (status == KVF_ERR_OUT_OF_MEMORY) {
      refused++;
      kvf_l1_stats after = st.stats();
      ASSERT_TRUE(same_stats(before, after)) << "a refused reservation changed the store";
      return;
    }
    ASSERT_EQ(status, KVF_SUCCESS) << kvf_last_error();
    std::set<uint64_t> named;
    for (auto &s : specs) named.insert(KeyNum(s.key.chunk));
    kvf_l1_stats after = st.stats();
    Res res{r, {}};
    for (uint32_t i = 0; i < n; i++) {
      Key k{KeyNum(specs[i].key.chunk), specs[i].object_group};
      if (objs.count(k)) {
        ASSERT_EQ(slots[i].state, KVF_L1_SLOT_PRESENT) << i;
        continue;
      }
      ASSERT_EQ(slots[i].state, KVF_L1_SLOT_RESERVED) << i;
    }
    // Evictions are judged against the state before this call's objects.
    ASSERT_NO_FATAL_FAILURE(sync_evictions(pi, after.evicted_entries_total - before.evicted_entries_total,
                                           after.evicted_bytes_total - before.evicted_bytes_total, named,
                                           recency_before));
    for (uint32_t i = 0; i < n; i++) {
      if (slots[i].state != KVF_L1_SLOT_RESERVED) continue;
      Key k{KeyNum(specs[i].key.chunk), specs[i].object_group};
      if (!key_live(k.first)) recency[k.first] = ++clock;  // a new entry starts most recently used
      uint64_t v = next_version++;
      fill(slots[i].data, specs[i].header.payload_bytes, k.first, k.second, v);
      objs[k] = ModelObj{1, pi, specs[i].header.payload_bytes, v, (const unsigned char *)slots[i].data, 0};
      res.keys.push_back(k);
    }
    reservations.push_back(res);
  }

  void op_finish(std::mt19937_64 &rng, bool commit) {
    if (reservations.empty()) return;
    size_t i = rng() % reservations.size();
    Res res = reservations[i];
    reservations.erase(reservations.begin() + (long)i);
    for (const Key &k : res.keys) {
      const ModelObj &o = objs.at(k);
      ASSERT_TRUE(intact(o.data, o.payload, k.first, k.second, o.version)) << "reserved bytes overwritten";
    }
    if (commit) {
      kvf_l1_commit(st.l1, res.h);
      for (const Key &k : res.keys) {
        objs[k].state = 2;
        recency[k.first] = ++clock;
      }
    } else {
      kvf_l1_abort(st.l1, res.h);
      for (const Key &k : res.keys) {
        objs.erase(k);
        if (!key_live(k.first)) recency.erase(k.first);
      }
    }
  }

  void op_lookup(std::mt19937_64 &rng) {
    uint32_t n = 1 + rng() % 4;
    std::vector<kvf_l1_query> q(n);
    for (auto &x : q) x = {L1Key(1 + rng() % 40), (uint32_t)(rng() % 3)};
    std::vector<kvf_l1_found> f(n);
    kvf_l1_pin *pin = nullptr;
    ASSERT_EQ(kvf_l1_lookup_pin(st.l1, q.data(), n, f.data(), &pin), KVF_SUCCESS);
    Pin p{pin, {}};
    for (uint32_t i = 0; i < n; i++) {
      Key k{KeyNum(q[i].key.chunk), q[i].object_group};
      auto it = objs.find(k);
      bool expect = it != objs.end() && it->second.state == 2;
      ASSERT_EQ(f[i].found, expect ? 1 : 0) << "key " << k.first << " og " << k.second;
      if (!expect) continue;
      ModelObj &o = it->second;
      ASSERT_EQ(f[i].data, o.data);
      ASSERT_EQ(f[i].header.payload_bytes, o.payload);
      ASSERT_TRUE(intact(f[i].data, o.payload, k.first, k.second, o.version)) << "committed bytes changed";
      o.pins++;
      recency[k.first] = ++clock;
      p.keys.push_back(k);
    }
    if (pins.size() < 6 && rng() % 2) {
      pins.push_back(p);
    } else {
      unpin(p);
    }
  }

  void unpin(const Pin &p) {
    kvf_l1_unpin(st.l1, p.h);
    for (const Key &k : p.keys) objs.at(k).pins--;
  }

  void op_unpin(std::mt19937_64 &rng) {
    if (pins.empty()) return;
    size_t i = rng() % pins.size();
    Pin p = pins[i];
    pins.erase(pins.begin() + (long)i);
    for (const Key &k : p.keys) {
      const ModelObj &o = objs.at(k);
      ASSERT_TRUE(intact(o.data, o.payload, k.first, k.second, o.version)) << "pinned bytes changed";
    }
    unpin(p);
  }
};

}  // namespace

TEST(L1, RandomOperationsMatchAModel) {
  Store st({{0, 24 * 1024}, {1, 40 * 1024}});
  Model m(st);
  std::mt19937_64 rng(20240611);
  uint64_t evicted_seen = 0;
  for (int step = 0; step < 6000; step++) {
    uint64_t dice = rng() % 100;
    uint64_t ev = st.stats().evicted_entries_total;
    if (dice < 35 && m.reservations.size() < 5) {
      ASSERT_NO_FATAL_FAILURE(m.op_reserve(rng)) << "step " << step;
    } else if (dice < 55) {
      ASSERT_NO_FATAL_FAILURE(m.op_finish(rng, true)) << "step " << step;
    } else if (dice < 63) {
      ASSERT_NO_FATAL_FAILURE(m.op_finish(rng, false)) << "step " << step;
    } else if (dice < 85) {
      ASSERT_NO_FATAL_FAILURE(m.op_lookup(rng)) << "step " << step;
    } else {
      ASSERT_NO_FATAL_FAILURE(m.op_unpin(rng)) << "step " << step;
    }
    evicted_seen += st.stats().evicted_entries_total - ev;
    ASSERT_NO_FATAL_FAILURE(m.check_invariants()) << "step " << step;
  }
  // The run must have exercised eviction and refusal, not just the easy path.
  EXPECT_GT(evicted_seen, 100u);
  EXPECT_GT(m.refused, 0u);
  while (!m.pins.empty()) ASSERT_NO_FATAL_FAILURE(m.op_unpin(rng));
  while (!m.reservations.empty()) ASSERT_NO_FATAL_FAILURE(m.op_finish(rng, false));
  ASSERT_NO_FATAL_FAILURE(m.check_invariants());
  EXPECT_EQ(st.stats().objects_reserved, 0u);
}

// ---- threads ----------------------------------------------------------------------

TEST(L1, ThreadedStress) {
  // Every writer of (key, og) writes the same bytes (version 0), so PRESENT
  // dedup between threads is safe and every reader can check what it finds.
  Store st({{0, 96 * 1024}, {1, 96 * 1024}});
  const int kThreads = 8, kIters = 1500;
  std::atomic<uint64_t> found_total{0}, reserved_total{0}, refused_total{0};
  auto payload_of = [](uint64_t key, uint32_t og) { return 1 + mix(key * 5 + og) % 5000; };
  auto worker = [&](int t) {
    std::mt19937_64 rng(1000 + t);
    for (int it = 0; it < kIters; it++) {
      if (rng() % 2) {
        uint32_t n = 1 + rng() % 3;
        std::vector<kvf_l1_object_spec> specs;
        std::set<Key> seen;
        while (specs.size() < n) {
          Key k{1 + rng() % 150, (uint32_t)(rng() % 2)};
          if (seen.insert(k).second) specs.push_back(make_spec(k.first, k.second, payload_of(k.first, k.second)));
        }
        std::vector<kvf_l1_slot> slots(n);
        kvf_l1_reservation *r = nullptr;
        kvf_status s = kvf_l1_reserve(st.l1, (int)(rng() % 2), specs.data(), n, slots.data(), &r, nullptr);
        if (s == KVF_ERR_OUT_OF_MEMORY) {
          refused_total++;
          continue;
        }
        ASSERT_EQ(s, KVF_SUCCESS) << kvf_last_error();
        for (uint32_t i = 0; i < n; i++)
          if (slots[i].state == KVF_L1_SLOT_RESERVED) {
            fill(slots[i].data, specs[i].header.payload_bytes, KeyNum(specs[i].key.chunk), specs[i].object_group, 0);
            reserved_total++;
          }
        if (rng() % 8 == 0) kvf_l1_abort(st.l1, r);
        else kvf_l1_commit(st.l1, r);
      } else {
        uint32_t n = 1 + rng() % 4;
        std::vector<kvf_l1_query> q(n);
        for (auto &x : q) x = {L1Key(1 + rng() % 150), (uint32_t)(rng() % 2)};
        std::vector<kvf_l1_found> f(n);
        kvf_l1_pin *pin = nullptr;
        ASSERT_EQ(kvf_l1_lookup_pin(st.l1, q.data(), n, f.data(), &pin), KVF_SUCCESS);
        if (rng() % 4 == 0) std::this_thread::yield();  // hold the pin while others evict
        for (uint32_t i = 0; i < n; i++) {
          if (!f[i].found) continue;
          found_total++;
          ASSERT_EQ(f[i].header.payload_bytes, payload_of(KeyNum(q[i].key.chunk), q[i].object_group));
          ASSERT_TRUE(intact(f[i].data, f[i].header.payload_bytes, KeyNum(q[i].key.chunk), q[i].object_group, 0))
              << "thread " << t << " key " << KeyNum(q[i].key.chunk);
        }
        kvf_l1_unpin(st.l1, pin);
      }
    }
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; t++) threads.emplace_back(worker, t);
  for (auto &th : threads) th.join();

  kvf_l1_stats all = st.stats();
  EXPECT_EQ(all.objects_reserved, 0u);
  EXPECT_EQ(all.objects_pinned, 0u);
  EXPECT_GT(found_total.load(), 1000u);
  EXPECT_GT(all.evicted_entries_total, 100u);
  // What is left is consistent: its extents account for every used byte and
  // do not overlap.
  std::vector<kvf_l1_query> q;
  for (uint64_t k = 1; k <= 150; k++)
    for (uint32_t og = 0; og < 2; og++) q.push_back({L1Key(k), og});
  std::vector<kvf_l1_found> f(q.size());
  kvf_l1_pin *pin = nullptr;
  ASSERT_EQ(kvf_l1_lookup_pin(st.l1, q.data(), (uint32_t)q.size(), f.data(), &pin), KVF_SUCCESS);
  for (int pi = 0; pi < 2; pi++) {
    std::vector<std::pair<const unsigned char *, uint64_t>> ext;
    uint64_t used = 0;
    for (size_t i = 0; i < q.size(); i++) {
      if (!f[i].found) continue;
      auto *d = (const unsigned char *)f[i].data;
      if (d < st.base(pi) || d >= st.base(pi) + 96 * 1024) continue;
      EXPECT_TRUE(intact(d, f[i].header.payload_bytes, KeyNum(q[i].key.chunk), q[i].object_group, 0));
      ext.push_back({d, round_up(f[i].header.payload_bytes)});
      used += round_up(f[i].header.payload_bytes);
    }
    std::sort(ext.begin(), ext.end());
    for (size_t i = 1; i < ext.size(); i++) EXPECT_LE(ext[i - 1].first + ext[i - 1].second, ext[i].first);
    EXPECT_EQ(st.stats(pi).bytes_free + used, 96u * 1024);
  }
  kvf_l1_unpin(st.l1, pin);
}
