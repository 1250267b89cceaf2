// Geometry: every validation rule (status, and a message naming the group,
// layer and field), window and DCP math, object layout, fingerprints and
// object headers.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>

#include <kvferry/copy.h>

namespace {

// A valid baseline: two FlashAttention NHD layers (2, NB, BS, H, D) in one
// region each, bf16, 4 heads of 64, block 16, 8 blocks.
struct Spec {
  std::vector<kvf_region_desc> regions;
  std::vector<kvf_group_desc> groups;
  std::vector<std::pair<uint32_t, kvf_view_desc>> views;
  kvf_object_policy policy = KVF_OBJECT_POLICY_INIT;
  uint32_t dcp_world = 1, dcp_rank = 0;

  static kvf_view_desc nhd(uint32_t region) {
    kvf_view_desc v = KVF_VIEW_DESC_INIT;
    v.region = region;
    v.elem_bytes = 2;
    v.planes = 2;
    v.heads = 4;
    v.head_bytes[0] = v.head_bytes[1] = 128;
    v.head_stride = 128;
    v.token_stride = 512;
    v.block_stride = 16 * 512;
    v.plane_stride = 8 * 16 * 512;
    return v;
  }
  static Spec baseline() {
    Spec s;
    kvf_region_desc r = KVF_REGION_DESC_INIT;
    r.name = "layer0";
    s.regions.push_back(r);
    r.name = "layer1";
    s.regions.push_back(r);
    kvf_group_desc gd = KVF_GROUP_DESC_INIT;
    gd.name = "full";
    gd.num_blocks = 8;
    s.groups.push_back(gd);
    s.views.push_back({0, nhd(0)});
    s.views.push_back({0, nhd(1)});
    return s;
  }
};

struct Built {
  kvf_geometry *g = nullptr;
  kvf_status status = KVF_SUCCESS;
  kvf_geometry_error err{};
  std::string message;
  ~Built() { kvf_geometry_destroy(g); }
};

std::unique_ptr<Built> build(const Spec &s) {
  auto b = std::make_unique<Built>();
  EXPECT_EQ(kvf_geometry_create(&b->g), KVF_SUCCESS);
  for (const auto &r : s.regions) EXPECT_EQ(kvf_geometry_add_region(b->g, &r, nullptr), KVF_SUCCESS);
  for (const auto &gd : s.groups) EXPECT_EQ(kvf_geometry_add_group(b->g, &gd, nullptr), KVF_SUCCESS);
  for (const auto &v : s.views) EXPECT_EQ(kvf_geometry_add_view(b->g, v.first, &v.second, nullptr), KVF_SUCCESS);
  EXPECT_EQ(kvf_geometry_set_policy(b->g, &s.policy), KVF_SUCCESS);
  EXPECT_EQ(kvf_geometry_set_dcp(b->g, s.dcp_world, s.dcp_rank), KVF_SUCCESS);
  b->status = kvf_geometry_finalize(b->g, &b->err);
  b->message = b->status ? kvf_last_error() : "";
  return b;
}

// Expect `mutate` to break exactly one rule, reported with `status`, naming
// `field` (in err.field and the message) and the group/layer given.
void expect_rule(const char *field, std::function<void(Spec &)> mutate, int32_t group = 0, int32_t layer = -1,
                 kvf_status status = KVF_ERR_INVALID_GEOMETRY) {
  Spec s = Spec::baseline();
  mutate(s);
  auto b = build(s);
  ASSERT_EQ(b->status, status) << "rule on '" << field << "' not enforced; message: " << b->message;
  EXPECT_NE(b->message.find(field), std::string::npos) << "message does not name '" << field << "': " << b->message;
  EXPECT_NE(std::string(b->err.field).find(field), std::string::npos) << "err.field = " << b->err.field;
  EXPECT_EQ(b->err.group, group) << b->message;
  EXPECT_EQ(b->err.layer, layer) << b->message;
  EXPECT_STREQ(b->err.message, b->message.c_str());
  if (group >= 0) {
    EXPECT_NE(b->message.find("group"), std::string::npos) << b->message;
  }
  if (layer >= 0) {
    EXPECT_NE(b->message.find("layer " + std::to_string(layer)), std::string::npos) << b->message;
  }
}

TEST(GeometryValidation, BaselineIsValid) {
  auto b = build(Spec::baseline());
  ASSERT_EQ(b->status, KVF_SUCCESS) << b->message;
  kvf_region_info ri = KVF_REGION_INFO_INIT;
  ASSERT_EQ(kvf_geometry_region(b->g, 0, &ri), KVF_SUCCESS);
  EXPECT_EQ(ri.size, 2u * 8 * 16 * 512);  // computed: both planes of 8 blocks
}

TEST(GeometryValidation, GeometryLevelRules) {
  expect_rule("regions", [](Spec &s) { s.regions.clear(); s.views.clear(); }, -1);
  expect_rule("groups", [](Spec &s) { s.groups.clear(); s.views.clear(); }, -1);
  expect_rule("chunk_tokens", [](Spec &s) { s.policy.chunk_tokens = 0; }, -1);
  expect_rule("format", [](Spec &s) { s.policy.format = (kvf_object_format)7; }, -1);
  expect_rule("separate_windowed", [](Spec &s) { s.policy.separate_windowed = 2; }, -1);
  expect_rule("regions", [](Spec &s) { s.views.pop_back(); }, -1);  // region 1 holds no view
}

TEST(GeometryValidation, RegionRules) {
  expect_rule("align", [](Spec &s) { s.regions[1].align = 48; }, -1);
  expect_rule("size", [](Spec &s) { s.regions[0].size = (1ull << 62) + 1; }, -1);
  expect_rule("name", [](Spec &s) { s.regions[1].name = "layer0"; }, -1);
}

TEST(GeometryValidation, GroupRules) {
  expect_rule("kind", [](Spec &s) { s.groups[0].kind = (kvf_group_kind)9; });
  expect_rule("num_blocks", [](Spec &s) { s.groups[0].num_blocks = 0; });
  expect_rule("block_size", [](Spec &s) { s.groups[0].block_size = 0; });
  expect_rule("block_size", [](Spec &s) { s.groups[0].block_size = KVF_MAX_BLOCK_SIZE + 1; });
  expect_rule("window", [](Spec &s) { s.groups[0].kind = KVF_GROUP_SLIDING_WINDOW; });
  expect_rule("window", [](Spec &s) { s.groups[0].window = 128; });
  expect_rule("chunk", [](Spec &s) { s.groups[0].kind = KVF_GROUP_CHUNKED_LOCAL; });
  expect_rule("chunk", [](Spec &s) { s.groups[0].chunk = 64; });
  expect_rule("chunk_tokens", [](Spec &s) { s.policy.chunk_tokens = 200; });  // not a multiple of 16
  expect_rule("chunk_tokens", [](Spec &s) { s.dcp_world = 32; });            // 256 % (16*32) != 0
  expect_rule("layers", [](Spec &s) {
    kvf_group_desc gd = KVF_GROUP_DESC_INIT;
    gd.name = "empty";
    gd.num_blocks = 4;
    s.groups.push_back(gd);
  }, 1);
  expect_rule("name", [](Spec &s) {
    kvf_group_desc gd = s.groups[0];
    s.groups.push_back(gd);
    s.views[1].first = 1;
  }, 1);
}

TEST(GeometryValidation, ViewFieldRules) {
  expect_rule("region", [](Spec &s) { s.views[1].second.region = 5; }, 0, 1);
  expect_rule("elem_bytes", [](Spec &s) { s.views[0].second.elem_bytes = 3; }, 0, 0);
  expect_rule("elem_bytes", [](Spec &s) { s.views[0].second.elem_bytes = 0; }, 0, 0);
  expect_rule("offset", [](Spec &s) { s.views[0].second.offset = 3; }, 0, 0);
  expect_rule("block_stride", [](Spec &s) { s.views[1].second.block_stride += 1; }, 0, 1);
  expect_rule("block_stride", [](Spec &s) { s.views[1].second.block_stride = 0; }, 0, 1);
  expect_rule("plane_stride", [](Spec &s) { s.views[0].second.plane_stride += 1; }, 0, 0);
  expect_rule("token_stride", [](Spec &s) { s.views[0].second.token_stride += 1; }, 0, 0);
  expect_rule("head_stride", [](Spec &s) { s.views[0].second.head_stride += 1; }, 0, 0);
  expect_rule("planes", [](Spec &s) { s.views[0].second.planes = 3; }, 0, 0);
  expect_rule("planes", [](Spec &s) { s.views[0].second.planes = 0; }, 0, 0);
  expect_rule("heads", [](Spec &s) { s.views[0].second.heads = 0; }, 0, 0);
  expect_rule("heads", [](Spec &s) { s.views[0].second.heads = KVF_MAX_HEADS + 1; }, 0, 0);
  expect_rule("head_bytes", [](Spec &s) { s.views[0].second.head_bytes[1] = 0; }, 0, 0);
  expect_rule("head_bytes", [](Spec &s) { s.views[0].second.head_bytes[0] = KVF_MAX_HEAD_BYTES + 2; }, 0, 0);
  expect_rule("head_bytes", [](Spec &s) { s.views[0].second.head_bytes[0] = 127; }, 0, 0);  // not elem-aligned
  expect_rule("head_bytes", [](Spec &s) {
    s.views[0].second.planes = 1;  // a single plane must not carry V's bytes
  }, 0, 0);
  expect_rule("num_states", [](Spec &s) { s.views[0].second.num_states = 1; }, 0, 0);
  expect_rule("heads", [](Spec &s) {
    // planes x block_size x heads: absurd run count per block.
    s.groups[0].block_size = 4096;
    s.policy.chunk_tokens = 4096;
    s.views[0].second.heads = 2048;
    s.views[0].second.head_bytes[0] = s.views[0].second.head_bytes[1] = 2;
  }, 0, 0);
}

TEST(GeometryValidation, RunsOfOneViewMustNotOverlap) {
  // Each stride must step over everything the smaller dimensions span.
  expect_rule("token_stride", [](Spec &s) { s.views[0].second.token_stride = 256; }, 0, 0);  // 4 heads x 128 > 256
  expect_rule("head_stride", [](Spec &s) { s.views[0].second.head_stride = 64; }, 0, 0);    // head bytes 128 > 64
  expect_rule("block_stride", [](Spec &s) { s.views[1].second.block_stride = 4096; }, 0, 1);  // payload 8192 > 4096
  expect_rule("plane_stride", [](Spec &s) { s.views[0].second.plane_stride = 8 * 16 * 512 - 512; }, 0, 0);
  // A padded block stride (vLLM page_size_padded) is fine.
  Spec ok = Spec::baseline();
  for (auto &v : ok.views) {
    v.second.block_stride = 16 * 512 + 1024;
    v.second.plane_stride = 8 * v.second.block_stride;
  }
  auto b = build(ok);
  EXPECT_EQ(b->status, KVF_SUCCESS) << b->message;
}

TEST(GeometryValidation, ViewsMustFitTheirRegionForTheLargestBlock) {
  // Block 0 fits (plane 1 of it ends at 65536 + 8192), block 7 does not: the
  // group has more blocks than the region holds, so num_blocks is at fault
  // (the view's strides are fine).
  expect_rule("num_blocks", [](Spec &s) { s.regions[0].size = 2 * 8 * 16 * 512 - 1; }, 0, 0);
  Spec s = Spec::baseline();
  s.regions[0].size = 2 * 8 * 16 * 512;
  auto b = build(s);
  ASSERT_EQ(b->status, KVF_SUCCESS) << b->message;
  // The message names num_blocks, the region and its size, where the last
  // block ends and how many blocks the region holds.
  Spec t = Spec::baseline();
  t.regions[0].size = 100000;
  auto c = build(t);
  ASSERT_EQ(c->status, KVF_ERR_INVALID_GEOMETRY);
  EXPECT_STREQ(c->err.field, "num_blocks");
  for (const char *want : {"num_blocks 8", "block 7", "ends at byte 131072", "past the end of region 0 'layer0'",
                           "100000 bytes", "holds 4 blocks"})
    EXPECT_NE(c->message.find(want), std::string::npos) << want << ": " << c->message;
}

TEST(GeometryValidation, RegionTooSmallForOneBlockNamesItsSize) {
  // Plane 1 of block 0 starts at 65536: a 65536-byte region cannot hold one
  // block of the view, whatever num_blocks is.
  expect_rule("size", [](Spec &s) { s.regions[1].size = 8 * 16 * 512; }, 0, 1);
  Spec s = Spec::baseline();
  s.regions[1].size = 8 * 16 * 512;
  auto b = build(s);
  for (const char *want : {"size 65536 of region 1 'layer1'", "block 0", "ends at byte 73728"})
    EXPECT_NE(b->message.find(want), std::string::npos) << want << ": " << b->message;
  // A view that starts past its region's end names its offset.
  expect_rule("offset", [](Spec &s) {
    s.regions[1].size = 2 * 8 * 16 * 512;
    s.views[1].second.offset = 2 * 8 * 16 * 512;
  }, 0, 1);
}

TEST(GeometryValidation, RecurrentSlotsPastTheRegionNameNumBlocks) {
  Spec s = Spec::baseline();
  kvf_group_desc gd = KVF_GROUP_DESC_INIT;
  gd.name = "mamba";
  gd.kind = KVF_GROUP_RECURRENT;
  gd.num_blocks = 4;
  s.groups.push_back(gd);
  kvf_region_desc r = KVF_REGION_DESC_INIT;
  r.name = "state";
  r.size = 2 * 4096;  // room for two slots
  s.regions.push_back(r);
  kvf_view_desc v = KVF_VIEW_DESC_INIT;
  v.region = 2;
  v.block_stride = 4096;
  v.num_states = 1;
  v.states[0] = {0, 3072};
  s.views.push_back({1, v});
  auto b = build(s);
  ASSERT_EQ(b->status, KVF_ERR_INVALID_GEOMETRY) << b->message;
  EXPECT_STREQ(b->err.field, "num_blocks");
  EXPECT_EQ(b->err.group, 1);
  EXPECT_EQ(b->err.layer, 0);
  EXPECT_NE(b->message.find("holds 2 blocks"), std::string::npos) << b->message;
}

TEST(GeometryValidation, PlanesOneBlockPoolApartNameNumBlocks) {
  // K and V a pool of 8 blocks apart (plane_stride = 8 x block_stride), but
  // 16 blocks: K's blocks 8..15 would run into V. The strides describe an
  // 8-block pool; num_blocks is what does not match them.
  expect_rule("num_blocks", [](Spec &s) { s.groups[0].num_blocks = 16; }, 0, 0);
  Spec s = Spec::baseline();
  s.groups[0].num_blocks = 16;
  auto b = build(s);
  for (const char *want : {"num_blocks 16", "plane_stride 65536", "room for 8 blocks"})
    EXPECT_NE(b->message.find(want), std::string::npos) << want << ": " << b->message;
  // A plane stride that is no whole number of blocks stays a stride error
  // (RunsOfOneViewMustNotOverlap), and so does a block stride below the payload.
  expect_rule("plane_stride", [](Spec &s) {
    s.groups[0].num_blocks = 16;
    s.views[0].second.plane_stride = 8 * 16 * 512 + 512;
  }, 0, 0);
}

TEST(GeometryValidation, IntegerOverflowIsReported) {
  expect_rule("block_stride", [](Spec &s) {
    s.groups[0].num_blocks = KVF_MAX_BLOCKS;
    s.views[0].second.block_stride = 1ull << 40;
    s.views[0].second.plane_stride = 1ull << 36;
  }, 0, 0, KVF_ERR_OVERFLOW);
  expect_rule("offset", [](Spec &s) { s.views[0].second.offset = UINT64_MAX - 1; }, 0, 0, KVF_ERR_OVERFLOW);
}

TEST(GeometryValidation, OverlappingViewsMustBeDeclaredAliases) {
  auto same_region = [](Spec &s) { s.views[1].second.region = 0; s.regions.pop_back(); };
  expect_rule("offset", same_region, 0, 1);
  // The message names both views.
  Spec s = Spec::baseline();
  same_region(s);
  auto b = build(s);
  EXPECT_NE(b->message.find("layer 0"), std::string::npos) << b->message;
  EXPECT_NE(b->message.find("alias_of"), std::string::npos) << b->message;
  // Declared: accepted and counted.
  s.views[1].second.alias_group = 0;
  s.views[1].second.alias_layer = 0;
  auto ok = build(s);
  ASSERT_EQ(ok->status, KVF_SUCCESS) << ok->message;
  EXPECT_EQ(kvf_geometry_num_aliases(ok->g), 1u);
}

TEST(GeometryValidation, InterleavedViewsOfOneRegionAreNotOverlaps) {
  // Cross-layer NHD (NB, L, 2, BS, H, D): layers interleave block by block.
  Spec s = Spec::baseline();
  s.regions.pop_back();
  for (uint32_t l = 0; l < 2; l++) {
    kvf_view_desc &v = s.views[l].second;
    v.region = 0;
    v.plane_stride = 16 * 512;
    v.block_stride = 2 * 2 * 16 * 512;
    v.offset = l * 2 * 16 * 512;
  }
  auto b = build(s);
  EXPECT_EQ(b->status, KVF_SUCCESS) << b->message;
  // Shift layer 1 by one token row: now it meets layer 0's V plane.
  s.views[1].second.offset -= 512;
  auto c = build(s);
  EXPECT_EQ(c->status, KVF_ERR_INVALID_GEOMETRY);
  EXPECT_STREQ(c->err.field, "offset");
}

TEST(GeometryValidation, TooManyMutuallyOverlappingViewsAreRefusedQuickly) {
  // 3 x 1024 views of one tensor, all declared aliases: over 4M pairs whose
  // extents meet. Finalize refuses instead of spending minutes on them.
  Spec s = Spec::baseline();
  s.regions.pop_back();
  s.views.clear();
  for (int gi = 0; gi < 3; gi++) {
    kvf_group_desc gd = KVF_GROUP_DESC_INIT;
    gd.name = gi == 0 ? "g0" : gi == 1 ? "g1" : "g2";
    gd.num_blocks = 8;
    s.groups.push_back(gd);
    for (int l = 0; l < 1024; l++) {
      kvf_view_desc v = Spec::nhd(0);
      if (gi || l) {
        v.alias_group = 0;
        v.alias_layer = 0;
      }
      s.views.push_back({(uint32_t)gi, v});
    }
  }
  s.groups.erase(s.groups.begin());  // drop the baseline's own group: g0..g2 are groups 0..2
  auto b = build(s);
  ASSERT_EQ(b->status, KVF_ERR_INVALID_GEOMETRY) << b->message;
  EXPECT_STREQ(b->err.field, "regions[0]");
  EXPECT_NE(b->message.find("pairs of views"), std::string::npos) << b->message;
}

// Layers interleaved byte by byte (each layer owns every L-th byte of a
// 4096-run block footprint): valid, and a 454-byte file. Checking every pair
// of them run by run took 8-17 s at 24 layers; a merge of the sorted runs
// takes milliseconds, and a geometry needing more than the validation budget
// is refused quickly, naming the pair.
Spec byte_interleaved(uint32_t layers, uint32_t heads = 4096) {
  Spec s;
  kvf_region_desc r = KVF_REGION_DESC_INIT;
  r.name = "kv";
  s.regions.push_back(r);
  kvf_group_desc gd = KVF_GROUP_DESC_INIT;
  gd.name = "full";
  gd.block_size = 1;
  gd.num_blocks = 2;
  s.groups.push_back(gd);
  for (uint32_t l = 0; l < layers; l++) {
    kvf_view_desc v = KVF_VIEW_DESC_INIT;
    v.region = 0;
    v.elem_bytes = 1;
    v.planes = 1;
    v.heads = heads;
    v.head_bytes[0] = 1;
    v.head_stride = layers;
    v.token_stride = (uint64_t)heads * layers;
    v.block_stride = (uint64_t)heads * layers;
    v.offset = l;
    s.views.push_back({0, v});
  }
  s.policy.chunk_tokens = 1;
  return s;
}

double ms_since(const std::chrono::steady_clock::time_point &t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

TEST(GeometryValidation, ByteInterleavedLayersAreCheckedQuickly) {
  for (uint32_t layers : {24u, 64u}) {
    SCOPED_TRACE(std::to_string(layers) + " layers");
    auto t0 = std::chrono::steady_clock::now();
    auto b = build(byte_interleaved(layers));
    double ms = ms_since(t0);
    EXPECT_EQ(b->status, KVF_SUCCESS) << b->message;
    std::printf("%u byte-interleaved layers: validated in %.1f ms\n", layers, ms);
    EXPECT_LT(ms, 1000.0) << "the overlap check is back to pairs of runs";
    // One byte moved onto its neighbour's: found, naming the later layer.
    Spec s = byte_interleaved(layers);
    s.views[layers - 1].second.offset = layers - 2;
    t0 = std::chrono::steady_clock::now();
    auto c = build(s);
    EXPECT_LT(ms_since(t0), 1000.0);
    ASSERT_EQ(c->status, KVF_ERR_INVALID_GEOMETRY);
    EXPECT_STREQ(c->err.field, "offset");
    EXPECT_EQ(c->err.layer, (int32_t)layers - 1) << c->message;
    EXPECT_NE(c->message.find("overlaps"), std::string::npos) << c->message;
  }
}

TEST(GeometryValidation, AnOverlapCheckPastTheBudgetIsRefusedNamingThePair) {
  // 1024 byte-interleaved layers: half a million pairs of 4096-run footprints.
  auto t0 = std::chrono::steady_clock::now();
  auto b = build(byte_interleaved(1024));
  double ms = ms_since(t0);
  std::printf("1024 byte-interleaved layers: refused in %.1f ms: %s\n", ms, b->message.c_str());
  ASSERT_EQ(b->status, KVF_ERR_INVALID_GEOMETRY);
  EXPECT_STREQ(b->err.field, "offset");
  EXPECT_EQ(b->err.group, 0);
  EXPECT_GT(b->err.layer, 0);
  EXPECT_NE(b->message.find("validation budget"), std::string::npos) << b->message;
  EXPECT_NE(b->message.find("alias_of"), std::string::npos) << b->message;
  EXPECT_LT(ms, 2000.0);
  // Declared aliases are not compared at all.
  Spec s = byte_interleaved(1024);
  for (uint32_t l = 1; l < 1024; l++) {
    s.views[l].second.alias_group = 0;
    s.views[l].second.alias_layer = 0;
  }
  auto c = build(s);
  EXPECT_EQ(c->status, KVF_SUCCESS) << c->message;
}

// Every byte each view touches, by brute force, against finalize's verdict:
// random pairs of views of one region with one block stride, footprints
// of a few to a few hundred runs, as many block strides apart as it takes to
// exercise both the per-d merge and the per-pair-of-runs paths.
TEST(GeometryValidation, OverlapVerdictMatchesBruteForce) {
  uint64_t seed = 0x9e3779b97f4a7c15ull;
  auto rnd = [&seed](uint64_t n) {
    seed ^= seed << 13;
    seed ^= seed >> 7;
    seed ^= seed << 17;
    return n ? seed % n : 0;
  };
  int checked = 0, overlapping = 0;
  for (int iter = 0; iter < 3000; iter++) {
    Spec s;
    kvf_region_desc r = KVF_REGION_DESC_INIT;
    r.name = "kv";
    s.regions.push_back(r);
    kvf_group_desc gd = KVF_GROUP_DESC_INIT;
    gd.name = "g0";
    gd.block_size = 1 + (uint32_t)rnd(3);
    gd.num_blocks = 1 + (uint32_t)rnd(6);
    s.groups.push_back(gd);
    uint32_t heads = 1 + (uint32_t)rnd(6);
    uint64_t hb = 1 + rnd(3);
    uint64_t hs = hb + rnd(4);
    uint64_t ts = heads * hs + rnd(5);
    uint64_t block_payload = gd.block_size * ts;
    bool heads_outer = rnd(4) == 0;  // heads spread over many block strides
    uint64_t bs;
    if (heads_outer) {
      // (H, NB, BS, D): a head's run of one block, then the next block.
      ts = hb + rnd(2);
      block_payload = gd.block_size * ts;
      bs = block_payload + rnd(3);
      hs = gd.num_blocks * bs + rnd(3);
    } else {
      bs = block_payload + rnd(8);
    }
    for (int l = 0; l < 2; l++) {
      kvf_view_desc v = KVF_VIEW_DESC_INIT;
      v.region = 0;
      v.elem_bytes = 1;
      v.planes = 1;
      v.heads = heads;
      v.head_bytes[0] = (uint32_t)hb;
      v.head_stride = hs;
      v.token_stride = ts;
      v.block_stride = bs;
      v.offset = rnd(3 * bs + 8);
      s.views.push_back({0, v});
    }
    auto b = build(s);
    if (b->status != KVF_SUCCESS && b->err.field != std::string("offset")) continue;  // an invalid view
    // Brute force.
    uint64_t size = 0;
    std::vector<std::vector<uint64_t>> bytes(2);
    for (int l = 0; l < 2; l++) {
      const kvf_view_desc &v = s.views[l].second;
      for (uint64_t blk = 0; blk < gd.num_blocks; blk++)
        for (uint64_t t = 0; t < gd.block_size; t++)
          for (uint64_t h = 0; h < heads; h++)
            for (uint64_t x = 0; x < hb; x++) {
              uint64_t at = v.offset + blk * bs + t * ts + h * hs + x;
              bytes[l].push_back(at);
              if (at + 1 > size) size = at + 1;
            }
    }
    std::vector<uint8_t> owner(size, 0);
    bool self_overlap = false, cross = false;
    for (int l = 0; l < 2; l++)
      for (uint64_t at : bytes[l]) {
        if (owner[at] & (1u << l)) self_overlap = true;
        if (owner[at] & ~(1u << l)) cross = true;
        owner[at] |= (uint8_t)(1u << l);
      }
    if (self_overlap) continue;  // finalize refuses the view itself
    checked++;
    overlapping += cross;
    EXPECT_EQ(b->status != KVF_SUCCESS, cross)
        << "iteration " << iter << ": finalize says '" << b->message << "', brute force says "
        << (cross ? "overlap" : "disjoint") << " (heads " << heads << ", head_bytes " << hb << ", head_stride " << hs
        << ", token_stride " << ts << ", block_stride " << bs << ", blocks " << gd.num_blocks << ", offsets "
        << s.views[0].second.offset << " and " << s.views[1].second.offset << ")";
    if (HasFailure()) break;
  }
  std::printf("%d pairs checked, %d overlapping\n", checked, overlapping);
  EXPECT_GT(checked, 1000);
  EXPECT_GT(overlapping, 100);
  EXPECT_GT(checked - overlapping, 100);
}

TEST(GeometryValidation, AliasRules) {
  expect_rule("alias_of", [](Spec &s) { s.views[1].second.alias_group = 3; s.views[1].second.alias_layer = 0; }, 0, 1);
  expect_rule("alias_of", [](Spec &s) { s.views[0].second.alias_group = 0; s.views[0].second.alias_layer = 1; }, 0, 0);
  expect_rule("alias_of", [](Spec &s) { s.views[1].second.alias_group = 0; s.views[1].second.alias_layer = 0; }, 0, 1);
}

TEST(GeometryValidation, RecurrentRules) {
  auto recurrent = [](Spec &s) {
    kvf_group_desc gd = KVF_GROUP_DESC_INIT;
    gd.name = "mamba";
    gd.kind = KVF_GROUP_RECURRENT;
    gd.num_blocks = 4;
    s.groups.push_back(gd);
    kvf_region_desc r = KVF_REGION_DESC_INIT;
    r.name = "state";
    s.regions.push_back(r);
    kvf_view_desc v = KVF_VIEW_DESC_INIT;
    v.region = 2;
    v.elem_bytes = 2;
    v.block_stride = 4096;
    v.num_states = 2;
    v.states[0] = {0, 1024};
    v.states[1] = {1024, 2048};
    s.views.push_back({1, v});
  };
  Spec s = Spec::baseline();
  recurrent(s);
  auto b = build(s);
  ASSERT_EQ(b->status, KVF_SUCCESS) << b->message;
  expect_rule("planes", [&](Spec &x) { recurrent(x); x.views[2].second.heads = 2; }, 1, 0);
  expect_rule("num_states", [&](Spec &x) { recurrent(x); x.views[2].second.num_states = 0; }, 1, 0);
  expect_rule("num_states", [&](Spec &x) { recurrent(x); x.views[2].second.num_states = KVF_MAX_STATES + 1; }, 1, 0);
  expect_rule("states[1]", [&](Spec &x) { recurrent(x); x.views[2].second.states[1].bytes = 0; }, 1, 0);
  expect_rule("states[1]", [&](Spec &x) { recurrent(x); x.views[2].second.states[1].bytes = 4000; }, 1, 0);
  expect_rule("states[1]", [&](Spec &x) { recurrent(x); x.views[2].second.states[1].offset = 512; }, 1, 0);
  expect_rule("states.offset", [&](Spec &x) { recurrent(x); x.views[2].second.states[1].offset = 1025; }, 1, 0);
}

TEST(GeometryValidation, BuildingRulesAndStates) {
  kvf_geometry *g = nullptr;
  EXPECT_EQ(kvf_geometry_create(nullptr), KVF_ERR_INVALID_ARGUMENT);
  ASSERT_EQ(kvf_geometry_create(&g), KVF_SUCCESS);
  EXPECT_EQ(kvf_geometry_set_dcp(g, 4, 4), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvf_last_error()).find("rank"), std::string::npos);
  EXPECT_EQ(kvf_geometry_set_dcp(g, 0, 0), KVF_ERR_INVALID_ARGUMENT);
  kvf_view_desc v = KVF_VIEW_DESC_INIT;
  EXPECT_EQ(kvf_geometry_add_view(g, 0, &v, nullptr), KVF_ERR_INVALID_ARGUMENT);  // no group 0 yet
  kvf_region_desc bad = KVF_REGION_DESC_INIT;
  bad.version = 0;
  EXPECT_EQ(kvf_geometry_add_region(g, &bad, nullptr), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvf_last_error()).find("version"), std::string::npos);
  kvf_geometry_destroy(g);
  kvf_geometry_destroy(nullptr);  // a no-op

  auto b = build(Spec::baseline());
  ASSERT_EQ(b->status, KVF_SUCCESS);
  EXPECT_EQ(kvf_geometry_finalize(b->g, nullptr), KVF_ERR_STATE);
  kvf_region_desc r = KVF_REGION_DESC_INIT;
  EXPECT_EQ(kvf_geometry_add_region(b->g, &r, nullptr), KVF_ERR_STATE);
}

// ---- windows, DCP, layouts -------------------------------------------------

std::unique_ptr<Built> windowed(kvf_group_kind kind, uint32_t param, uint32_t world = 1, uint32_t rank = 0) {
  Spec s = Spec::baseline();
  s.groups[0].kind = kind;
  if (kind == KVF_GROUP_SLIDING_WINDOW) s.groups[0].window = param;
  if (kind == KVF_GROUP_CHUNKED_LOCAL) s.groups[0].chunk = param;
  s.groups[0].num_blocks = 64;
  for (auto &v : s.views) v.second.plane_stride = 64 * 16 * 512;
  s.dcp_world = world;
  s.dcp_rank = rank;
  s.policy.chunk_tokens = 256;
  return build(s);
}

TEST(GeometryWindows, SlidingWindowRetainsTheLastWMinusOneTokens) {
  auto b = windowed(KVF_GROUP_SLIDING_WINDOW, 128);
  ASSERT_EQ(b->status, KVF_SUCCESS) << b->message;
  uint64_t begin, first, end;
  ASSERT_EQ(kvf_geometry_retained_tokens(b->g, 0, 1000, &begin), KVF_SUCCESS);
  EXPECT_EQ(begin, 1000u - 128 + 1);  // vLLM: max(0, N - W + 1) tokens skipped
  ASSERT_EQ(kvf_geometry_retained_blocks(b->g, 0, 1000, &first, &end), KVF_SUCCESS);
  EXPECT_EQ(first, 873u / 16);
  EXPECT_EQ(end, (1000u + 15) / 16);
  ASSERT_EQ(kvf_geometry_retained_tokens(b->g, 0, 100, &begin), KVF_SUCCESS);
  EXPECT_EQ(begin, 0u);  // shorter than the window: everything
  ASSERT_EQ(kvf_geometry_retained_blocks(b->g, 0, 0, &first, &end), KVF_SUCCESS);
  EXPECT_EQ(first, end);
}

TEST(GeometryWindows, ChunkedLocalRetainsTheCurrentChunk) {
  auto b = windowed(KVF_GROUP_CHUNKED_LOCAL, 512);
  ASSERT_EQ(b->status, KVF_SUCCESS) << b->message;
  uint64_t begin, first, end;
  ASSERT_EQ(kvf_geometry_retained_tokens(b->g, 0, 1300, &begin), KVF_SUCCESS);
  EXPECT_EQ(begin, 1024u);
  ASSERT_EQ(kvf_geometry_retained_blocks(b->g, 0, 1300, &first, &end), KVF_SUCCESS);
  EXPECT_EQ(first, 64u);
  EXPECT_EQ(end, 82u);
  ASSERT_EQ(kvf_geometry_retained_tokens(b->g, 0, 1024, &begin), KVF_SUCCESS);
  EXPECT_EQ(begin, 1024u);  // at a chunk boundary the next token starts a fresh chunk
}

TEST(GeometryWindows, FullGroupsRetainEverythingAndRecurrentStateNeedsABoundary) {
  auto b = build(Spec::baseline());
  ASSERT_EQ(b->status, KVF_SUCCESS);
  uint64_t begin, chunk;
  ASSERT_EQ(kvf_geometry_retained_tokens(b->g, 0, 777, &begin), KVF_SUCCESS);
  EXPECT_EQ(begin, 0u);
  ASSERT_EQ(kvf_geometry_recurrent_state(b->g, 512, &chunk), KVF_SUCCESS);
  EXPECT_EQ(chunk, 1u);
  EXPECT_EQ(kvf_geometry_recurrent_state(b->g, 500, &chunk), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvf_last_error()).find("prefix_tokens"), std::string::npos);
  EXPECT_EQ(kvf_geometry_recurrent_state(b->g, 0, &chunk), KVF_ERR_INVALID_ARGUMENT);
}

TEST(GeometryDcp, RankHoldsEveryWorldthToken) {
  auto b = windowed(KVF_GROUP_FULL, 0, 4, 1);
  ASSERT_EQ(b->status, KVF_SUCCESS) << b->message;
  // Rank 1 of 4 holds 1, 5, 9, ...: tokens [0, 10) hold 1, 5, 9 -> 3 local tokens.
  EXPECT_EQ(kvf_geometry_local_tokens(b->g, 10), 3u);
  EXPECT_EQ(kvf_geometry_local_tokens(b->g, 1), 0u);
  EXPECT_EQ(kvf_geometry_local_tokens(b->g, 2), 1u);
  uint64_t first, end;
  // Global [256, 512) -> local [64, 128) -> blocks [4, 8).
  ASSERT_EQ(kvf_geometry_local_blocks(b->g, 0, 256, 512, &first, &end), KVF_SUCCESS);
  EXPECT_EQ(first, 4u);
  EXPECT_EQ(end, 8u);
  // Brute force against the definition for many ranges.
  for (uint64_t t0 = 0; t0 < 80; t0 += 7)
    for (uint64_t t1 = t0; t1 < 200; t1 += 13) {
      uint64_t lo = UINT64_MAX, hi = 0, before = 0;
      for (uint64_t t = 0; t < t1; t++) {
        if (t % 4 != 1) continue;
        if (t >= t0) {
          lo = std::min(lo, before / 16);
          hi = std::max(hi, before / 16 + 1);
        }
        before++;
      }
      ASSERT_EQ(kvf_geometry_local_blocks(b->g, 0, t0, t1, &first, &end), KVF_SUCCESS);
      if (lo == UINT64_MAX) {
        EXPECT_EQ(first, end);
      } else {
        EXPECT_EQ(first, lo) << t0 << ".." << t1;
        EXPECT_EQ(end, hi) << t0 << ".." << t1;
      }
    }
}

TEST(GeometryLayout, ObjectSizesAndCanonicalSegments) {
  auto b = build(Spec::baseline());
  ASSERT_EQ(b->status, KVF_SUCCESS);
  ASSERT_EQ(kvf_geometry_num_object_groups(b->g), 1u);
  uint64_t size;
  // 256 tokens x 2 layers x 2 planes x 4 heads x 128 bytes.
  ASSERT_EQ(kvf_geometry_object_size(b->g, 0, 0, 1000, &size), KVF_SUCCESS);
  EXPECT_EQ(size, 256u * 2 * 2 * 4 * 128);
  ASSERT_EQ(kvf_geometry_object_size(b->g, 0, 3, 1000, &size), KVF_SUCCESS);  // last chunk: 232 tokens
  EXPECT_EQ(size, 232u * 2 * 2 * 4 * 128);
  EXPECT_EQ(kvf_geometry_object_size(b->g, 0, 4, 1000, &size), KVF_ERR_INVALID_ARGUMENT);
  // [P][L][T][H][bytes]: plane 1 of layer 0 comes after plane 0 of both layers.
  uint64_t off, len;
  ASSERT_EQ(kvf_geometry_object_segment(b->g, KVF_FORMAT_CANONICAL, 0, 0, 1, 256, &off, &len), KVF_SUCCESS);
  EXPECT_EQ(off, 2u * 256 * 512);
  EXPECT_EQ(len, 256u * 512);
  ASSERT_EQ(kvf_geometry_object_segment(b->g, KVF_FORMAT_CANONICAL, 0, 1, 0, 256, &off, &len), KVF_SUCCESS);
  EXPECT_EQ(off, 256u * 512);
  // Native: each layer's block payloads back to back.
  ASSERT_EQ(kvf_geometry_object_segment(b->g, KVF_FORMAT_NATIVE, 0, 1, 0, 256, &off, &len), KVF_SUCCESS);
  EXPECT_EQ(off, 256u * 1024);
  EXPECT_EQ(len, 256u * 1024);
}

TEST(GeometryLayout, ObjectGroupsFollowThePolicy) {
  auto make = [](int separate_windowed, int separate_recurrent) {
    Spec s = Spec::baseline();
    s.groups[0].num_blocks = 8;
    kvf_group_desc sw = KVF_GROUP_DESC_INIT;
    sw.name = "swa";
    sw.kind = KVF_GROUP_SLIDING_WINDOW;
    sw.window = 64;
    sw.num_blocks = 8;
    s.groups.push_back(sw);
    s.views[1].first = 1;
    kvf_group_desc rec = KVF_GROUP_DESC_INIT;
    rec.name = "mamba";
    rec.kind = KVF_GROUP_RECURRENT;
    rec.num_blocks = 8;
    s.groups.push_back(rec);
    kvf_region_desc r = KVF_REGION_DESC_INIT;
    r.name = "state";
    s.regions.push_back(r);
    kvf_view_desc v = KVF_VIEW_DESC_INIT;
    v.region = 2;
    v.block_stride = 4096;
    v.num_states = 1;
    v.states[0] = {0, 3000};
    s.views.push_back({2, v});
    s.policy.separate_windowed = separate_windowed;
    s.policy.separate_recurrent = separate_recurrent;
    return build(s);
  };
  auto all = make(0, 0);
  ASSERT_EQ(all->status, KVF_SUCCESS) << all->message;
  EXPECT_EQ(kvf_geometry_num_object_groups(all->g), 1u);
  uint64_t size;
  ASSERT_EQ(kvf_geometry_object_size(all->g, 0, 0, 256, &size), KVF_SUCCESS);
  EXPECT_EQ(size, 2u * 256 * 1024 + 3000);
  auto apart = make(1, 1);
  ASSERT_EQ(apart->status, KVF_SUCCESS) << apart->message;
  ASSERT_EQ(kvf_geometry_num_object_groups(apart->g), 3u);
  kvf_group_info gi = KVF_GROUP_INFO_INIT;
  kvf_geometry_group(apart->g, 2, &gi);
  EXPECT_EQ(gi.object_group, 2u);
  kvf_object_group_info oi = KVF_OBJECT_GROUP_INFO_INIT;
  ASSERT_EQ(kvf_geometry_object_group(apart->g, 2, &oi), KVF_SUCCESS);
  EXPECT_TRUE(oi.has_recurrent);
  EXPECT_FALSE(oi.has_attention);
  EXPECT_EQ(oi.recurrent_bytes, 3000u);
}

TEST(GeometryFingerprint, ChangesWithTheObjectShapeNotWithNames) {
  auto a = build(Spec::baseline());
  Spec s = Spec::baseline();
  s.regions[0].name = "renamed";
  s.groups[0].name = "renamed";
  auto b = build(s);
  ASSERT_EQ(a->status, KVF_SUCCESS);
  ASSERT_EQ(b->status, KVF_SUCCESS);
  EXPECT_EQ(kvf_geometry_fingerprint(a->g, KVF_FORMAT_CANONICAL), kvf_geometry_fingerprint(b->g, KVF_FORMAT_CANONICAL));
  EXPECT_NE(kvf_geometry_fingerprint(a->g, KVF_FORMAT_CANONICAL), kvf_geometry_fingerprint(a->g, KVF_FORMAT_NATIVE));
  // HND order (heads outside tokens) keeps the canonical fingerprint but not the native one.
  Spec h = Spec::baseline();
  for (auto &v : h.views) {
    v.second.head_stride = 16 * 128;
    v.second.token_stride = 128;
  }
  auto c = build(h);
  ASSERT_EQ(c->status, KVF_SUCCESS) << c->message;
  EXPECT_EQ(kvf_geometry_fingerprint(a->g, KVF_FORMAT_CANONICAL), kvf_geometry_fingerprint(c->g, KVF_FORMAT_CANONICAL));
  EXPECT_NE(kvf_geometry_fingerprint(a->g, KVF_FORMAT_NATIVE), kvf_geometry_fingerprint(c->g, KVF_FORMAT_NATIVE));
  // More heads: a different object.
  Spec m = Spec::baseline();
  m.policy.chunk_tokens = 512;
  auto d = build(m);
  EXPECT_NE(kvf_geometry_fingerprint(a->g, KVF_FORMAT_CANONICAL), kvf_geometry_fingerprint(d->g, KVF_FORMAT_CANONICAL));
}

TEST(GeometryObjectHeader, MismatchesFailClearly) {
  auto a = build(Spec::baseline());
  Spec s = Spec::baseline();
  s.policy.chunk_tokens = 512;
  auto other = build(s);
  ASSERT_EQ(a->status, KVF_SUCCESS);
  kvf_object_header h;
  ASSERT_EQ(kvf_object_header_init(a->g, KVF_FORMAT_CANONICAL, 0, 1, 700, &h), KVF_SUCCESS);
  EXPECT_EQ(h.token_begin, 256u);
  EXPECT_EQ(h.token_end, 512u);
  EXPECT_EQ(kvf_object_header_check(a->g, &h, 0), KVF_SUCCESS);
  EXPECT_EQ(kvf_object_header_check(other->g, &h, 0), KVF_ERR_GEOMETRY_MISMATCH);
  EXPECT_NE(std::string(kvf_last_error()).find("fingerprint"), std::string::npos) << kvf_last_error();
  kvf_object_header bad = h;
  bad.payload_bytes++;
  EXPECT_EQ(kvf_object_header_check(a->g, &bad, 0), KVF_ERR_GEOMETRY_MISMATCH);
  EXPECT_NE(std::string(kvf_last_error()).find("payload_bytes"), std::string::npos);
  bad = h;
  bad.format = KVF_FORMAT_NATIVE;
  EXPECT_EQ(kvf_object_header_check(a->g, &bad, 0), KVF_ERR_GEOMETRY_MISMATCH);
  bad = h;
  bad.magic = 0;
  EXPECT_EQ(kvf_object_header_check(a->g, &bad, 0), KVF_ERR_GEOMETRY_MISMATCH);
  EXPECT_NE(std::string(kvf_last_error()).find("magic"), std::string::npos);
  bad = h;
  bad.dcp_rank = 3;
  EXPECT_EQ(kvf_object_header_check(a->g, &bad, 0), KVF_ERR_GEOMETRY_MISMATCH);
  EXPECT_NE(std::string(kvf_last_error()).find("dcp_rank"), std::string::npos);
}

// ---- copy requests -----------------------------------------------------------

TEST(CopyRequest, BadRequestsNameTheField) {
  auto b = build(Spec::baseline());
  ASSERT_EQ(b->status, KVF_SUCCESS);
  std::vector<uint8_t> r0(1 << 20), r1(1 << 20), obj(1 << 20);
  // Region bases must honour the region's 256-byte alignment.
  auto align = [](std::vector<uint8_t> &v) { return (void *)(((uintptr_t)v.data() + 255) & ~(uintptr_t)255); };
  void *bases[2] = {align(r0), align(r1)};
  uint32_t ids[4] = {1, 2, KVF_BLOCK_SKIP, 3};
  kvf_group_blocks groups[1] = {{ids, 0, 4}};
  void *objects[1] = {obj.data()};
  kvf_copy_request req = KVF_COPY_REQUEST_INIT;
  req.region_bases = bases;
  req.token_end = 64;
  req.groups = groups;
  req.objects = objects;
  ASSERT_EQ(kvf_copy_request_check(b->g, &req), KVF_SUCCESS) << kvf_last_error();
  auto expect = [&](const char *field, std::function<void(kvf_copy_request &)> mutate) {
    kvf_copy_request r = req;
    kvf_group_blocks gcopy[1] = {groups[0]};
    uint32_t idcopy[4];
    std::memcpy(idcopy, ids, sizeof ids);
    gcopy[0].block_ids = idcopy;
    r.groups = gcopy;
    mutate(r);
    EXPECT_EQ(kvf_reference_gather(b->g, &r), KVF_ERR_INVALID_ARGUMENT) << field;
    EXPECT_NE(std::string(kvf_last_error()).find(field), std::string::npos) << kvf_last_error();
  };
  expect("token_begin", [](kvf_copy_request &r) { r.token_begin = 16; r.token_end = 300; });
  expect("token_end", [](kvf_copy_request &r) { r.token_end = 0; });
  expect("groups[0].block_ids[1]", [](kvf_copy_request &r) { ((uint32_t *)r.groups[0].block_ids)[1] = 8; });
  expect("region_bases[1]", [&](kvf_copy_request &r) {
    static void *partial[2];
    partial[0] = bases[0];
    partial[1] = nullptr;
    r.region_bases = partial;
  });
  expect("region_bases[0]", [&](kvf_copy_request &r) {
    static void *misaligned[2];
    misaligned[0] = (char *)bases[0] + 16;
    misaligned[1] = bases[1];
    r.region_bases = misaligned;
  });
  expect("objects[0]", [](kvf_copy_request &r) {
    static void *none[1] = {nullptr};
    r.objects = none;
  });
  expect("token_end", [](kvf_copy_request &r) { r.format = KVF_FORMAT_NATIVE; r.token_end = 40; });
  expect("format", [](kvf_copy_request &r) { r.format = (kvf_object_format)5; });
  expect("version", [](kvf_copy_request &r) { r.version = 0; });
  // A block table that skips everything needs no object.
  kvf_copy_request r = req;
  uint32_t skip[1] = {KVF_BLOCK_SKIP};
  kvf_group_blocks g1[1] = {{skip, 0, 1}};
  void *none[1] = {nullptr};
  r.groups = g1;
  r.objects = none;
  EXPECT_EQ(kvf_reference_gather(b->g, &r), KVF_SUCCESS) << kvf_last_error();
}

// A range at the top of the 64-bit range (issue 12): the chunk that holds
// token_end must end by 2^64 - 1, else the check refuses it naming
// token_end. The block loop of the check used to wrap there and spin
// forever; the block helpers round up without wrapping.
TEST(CopyRequest, ARangeAtTheTopOf64BitsIsRefusedNotLooped) {
  auto b = build(Spec::baseline());
  ASSERT_EQ(b->status, KVF_SUCCESS);
  kvf_object_policy pol = KVF_OBJECT_POLICY_INIT;
  ASSERT_EQ(kvf_geometry_policy(b->g, &pol), KVF_SUCCESS);
  const uint64_t C = pol.chunk_tokens, top = UINT64_MAX / C * C;  // the last chunk boundary
  std::vector<uint8_t> r0(1 << 20), r1(1 << 20), obj(1 << 20);
  auto align = [](std::vector<uint8_t> &v) { return (void *)(((uintptr_t)v.data() + 255) & ~(uintptr_t)255); };
  void *bases[2] = {align(r0), align(r1)};
  uint32_t ids[1] = {1};
  kvf_group_blocks groups[1] = {{ids, 0, 1}};
  void *objects[1] = {obj.data()};
  kvf_copy_request req = KVF_COPY_REQUEST_INIT;
  req.region_bases = bases;
  req.groups = groups;
  req.objects = objects;
  for (uint64_t end : {top + 1, UINT64_MAX}) {
    req.token_begin = top;
    req.token_end = end;
    EXPECT_EQ(kvf_copy_request_check(b->g, &req), KVF_ERR_INVALID_ARGUMENT) << end;
    EXPECT_EQ(std::string(kvf_last_error()).rfind("token_end ", 0), 0u) << kvf_last_error();
    EXPECT_EQ(kvf_copy_request_chunks(b->g, &req), 1u);
  }
  // The last whole chunk below 2^64 is a request like any other.
  req.token_begin = top - C;
  req.token_end = top;
  EXPECT_EQ(kvf_copy_request_check(b->g, &req), KVF_SUCCESS) << kvf_last_error();
  // Blocks of [0, 2^64 - 1): rounded up, not wrapped to 0.
  kvf_group_info gi = KVF_GROUP_INFO_INIT;
  ASSERT_EQ(kvf_geometry_group(b->g, 0, &gi), KVF_SUCCESS);
  uint64_t fb = 1, eb = 0;
  ASSERT_EQ(kvf_geometry_local_blocks(b->g, 0, 0, UINT64_MAX, &fb, &eb), KVF_SUCCESS);
  EXPECT_EQ(fb, 0u);
  EXPECT_EQ(eb, UINT64_MAX / gi.block_size + (UINT64_MAX % gi.block_size != 0));
}

}  // namespace
