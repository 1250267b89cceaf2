// Geometry files: the JSON loader (geometry/json.c) against docs/geometry.md.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

#include <jansson.h>

#include <kvferry/geometry.h>

namespace {

struct GeometryDeleter {
  void operator()(kvf_geometry *g) const { kvf_geometry_destroy(g); }
};
using GeometryPtr = std::unique_ptr<kvf_geometry, GeometryDeleter>;

kvf_status Load(const std::string &json, GeometryPtr *out, kvf_geometry_error *error = nullptr,
                const kvf_geometry_load_options *options = nullptr) {
  kvf_geometry *g = nullptr;
  kvf_status st = kvf_geometry_load_buffer(json.data(), json.size(), options, &g, error);
  if (st == KVF_SUCCESS) {
    EXPECT_NE(g, nullptr);
  } else {
    EXPECT_EQ(g, nullptr) << "the out-parameter must stay untouched on failure";
  }
  out->reset(g);
  return st;
}

// Replace the single occurrence of `from` (the test fails if it is not there exactly once).
std::string Edit(const std::string &json, const std::string &from, const std::string &to) {
  size_t at = json.find(from);
  EXPECT_NE(at, std::string::npos) << "edit target not found: " << from;
  if (at == std::string::npos) return json;
  EXPECT_EQ(json.find(from, at + 1), std::string::npos) << "edit target not unique: " << from;
  return json.substr(0, at) + to + json.substr(at + from.size());
}

// One full-attention group, two layers in a counted region.
const std::string kSmall = R"json({
  "format": "kvferry-geometry",
  "version": 1,
  "name": "tiny-full",
  "description": "two layers, bf16, K and V planes 64 KiB apart",
  "regions": [ { "name": "kv", "count": 2 } ],
  "groups": [
    { "name": "full", "kind": "full", "block_size": 16, "num_blocks": 8,
      "layers": [
        { "count": 2, "name": "layer", "region": "kv", "region_step": 1, "elem_bytes": 2,
          "block_stride": 8192, "planes": 2, "heads": 2, "head_bytes": 128,
          "plane_stride": 65536, "token_stride": 256, "head_stride": 128 }
      ] }
  ],
  "objects": { "chunk_tokens": 32 }
})json";

// A hybrid: full attention in kv[0..3]; a sliding-window group whose two
// layers share kv[0] and kv[2] with full layers 0 and 2 (region_step 2,
// layer_step 2); a recurrent group whose two layers sit one after the other
// in one region (offset_step); separate object groups; dcp rank 1 of 2.
const std::string kHybrid = R"json({
  "format": "kvferry-geometry",
  "version": 1,
  "name": "tiny-hybrid",
  "description": "hybrid test geometry",
  "regions": [
    { "name": "kv", "count": 4, "align": 4096 },
    { "name": "ssm", "size": 131072 }
  ],
  "groups": [
    { "name": "full", "kind": "full", "block_size": 16, "num_blocks": 8,
      "layers": [
        { "count": 4, "name": "attn", "region": "kv", "region_step": 1, "elem_bytes": 2,
          "block_stride": 16384, "planes": 2, "heads": 2, "head_bytes": [128, 128],
          "plane_stride": 4096, "token_stride": 256, "head_stride": 128 }
      ] },
    { "name": "swa", "kind": "sliding_window", "block_size": 16, "num_blocks": 8, "window": 64,
      "layers": [
        { "count": 2, "name": "swa", "region": "kv", "region_step": 2, "elem_bytes": 2,
          "block_stride": 16384, "planes": 2, "heads": 2, "head_bytes": 128,
          "plane_stride": 4096, "token_stride": 256, "head_stride": 128,
          "alias_of": { "group": "full", "layer": 0, "layer_step": 2 } }
      ] },
    { "name": "mamba", "kind": "recurrent", "num_blocks": 4,
      "layers": [
        { "count": 2, "name": "mamba", "region": "ssm", "offset": 0, "offset_step": 65536,
          "block_stride": 16384,
          "states": [ { "offset": 0, "bytes": 1024 }, { "offset": 1024, "bytes": 8192 } ] }
      ] }
  ],
  "objects": { "chunk_tokens": 64, "format": "native", "separate_windowed": true,
               "separate_recurrent": true },
  "dcp": { "world": 2, "rank": 1 }
})json";

TEST(Json, LoadsSmallGeometry) {
  GeometryPtr g;
  ASSERT_EQ(Load(kSmall, &g), KVF_SUCCESS) << kvf_last_error();
  EXPECT_STREQ(kvf_geometry_name(g.get()), "tiny-full");
  EXPECT_STREQ(kvf_geometry_description(g.get()), "two layers, bf16, K and V planes 64 KiB apart");
  ASSERT_EQ(kvf_geometry_num_regions(g.get()), 2u);
  ASSERT_EQ(kvf_geometry_num_groups(g.get()), 1u);
  kvf_region_info r = KVF_REGION_INFO_INIT;
  ASSERT_EQ(kvf_geometry_region(g.get(), 1, &r), KVF_SUCCESS);
  EXPECT_STREQ(r.name, "kv[1]");
  EXPECT_EQ(r.align, 256u);
  // Computed: plane 1 of block 7 ends at 65536 + 7*8192 + 16*256.
  EXPECT_EQ(r.size, 65536u + 7 * 8192u + 4096u);
  kvf_group_info gi = KVF_GROUP_INFO_INIT;
  ASSERT_EQ(kvf_geometry_group(g.get(), 0, &gi), KVF_SUCCESS);
  EXPECT_EQ(gi.kind, KVF_GROUP_FULL);
  EXPECT_EQ(gi.block_size, 16u);
  EXPECT_EQ(gi.num_blocks, 8u);
  EXPECT_EQ(gi.num_layers, 2u);
  kvf_view_desc v = KVF_VIEW_DESC_INIT;
  ASSERT_EQ(kvf_geometry_view(g.get(), 0, 1, &v), KVF_SUCCESS);
  EXPECT_STREQ(v.name, "layer[1]");
  EXPECT_EQ(v.region, 1u);
  EXPECT_EQ(v.offset, 0u);
  EXPECT_EQ(v.elem_bytes, 2u);
  EXPECT_EQ(v.block_stride, 8192u);
  EXPECT_EQ(v.planes, 2u);
  EXPECT_EQ(v.heads, 2u);
  EXPECT_EQ(v.head_bytes[0], 128u);
  EXPECT_EQ(v.head_bytes[1], 128u);
  EXPECT_EQ(v.plane_stride, 65536u);
  EXPECT_EQ(v.token_stride, 256u);
  EXPECT_EQ(v.head_stride, 128u);
  EXPECT_EQ(v.alias_group, -1);
  kvf_object_policy p = KVF_OBJECT_POLICY_INIT;
  ASSERT_EQ(kvf_geometry_policy(g.get(), &p), KVF_SUCCESS);
  EXPECT_EQ(p.chunk_tokens, 32u);
  EXPECT_EQ(p.format, KVF_FORMAT_CANONICAL);
  EXPECT_EQ(p.separate_windowed, 1);
  EXPECT_EQ(p.separate_recurrent, 0);
  uint32_t world = 0, rank = 9;
  ASSERT_EQ(kvf_geometry_dcp(g.get(), &world, &rank), KVF_SUCCESS);
  EXPECT_EQ(world, 1u);
  EXPECT_EQ(rank, 0u);
}

TEST(Json, LoadsHybridGeometry) {
  GeometryPtr g;
  ASSERT_EQ(Load(kHybrid, &g), KVF_SUCCESS) << kvf_last_error();
  EXPECT_STREQ(kvf_geometry_name(g.get()), "tiny-hybrid");
  ASSERT_EQ(kvf_geometry_num_regions(g.get()), 5u);
  ASSERT_EQ(kvf_geometry_num_groups(g.get()), 3u);
  EXPECT_EQ(kvf_geometry_num_aliases(g.get()), 2u);

  kvf_region_info r = KVF_REGION_INFO_INIT;
  ASSERT_EQ(kvf_geometry_region(g.get(), 3, &r), KVF_SUCCESS);
  EXPECT_STREQ(r.name, "kv[3]");
  EXPECT_EQ(r.align, 4096u);
  ASSERT_EQ(kvf_geometry_region(g.get(), 4, &r), KVF_SUCCESS);
  EXPECT_STREQ(r.name, "ssm");
  EXPECT_EQ(r.size, 131072u);
  EXPECT_EQ(r.num_views, 2u);
  ASSERT_EQ(kvf_geometry_region(g.get(), 2, &r), KVF_SUCCESS);
  EXPECT_EQ(r.num_views, 2u) << "kv[2] holds full layer 2 and its alias, swa layer 1";

  kvf_group_info gi = KVF_GROUP_INFO_INIT;
  ASSERT_EQ(kvf_geometry_group(g.get(), 1, &gi), KVF_SUCCESS);
  EXPECT_STREQ(gi.name, "swa");
  EXPECT_EQ(gi.kind, KVF_GROUP_SLIDING_WINDOW);
  EXPECT_EQ(gi.window, 64u);
  EXPECT_EQ(gi.num_layers, 2u);
  ASSERT_EQ(kvf_geometry_group(g.get(), 2, &gi), KVF_SUCCESS);
  EXPECT_EQ(gi.kind, KVF_GROUP_RECURRENT);
  EXPECT_EQ(gi.block_size, 1u) << "recurrent groups default to one state per slot";
  EXPECT_EQ(gi.num_blocks, 4u);

  kvf_view_desc v = KVF_VIEW_DESC_INIT;
  ASSERT_EQ(kvf_geometry_view(g.get(), 0, 3, &v), KVF_SUCCESS);
  EXPECT_STREQ(v.name, "attn[3]");
  EXPECT_EQ(v.region, 3u);
  EXPECT_EQ(v.head_bytes[0], 128u);
  EXPECT_EQ(v.head_bytes[1], 128u);
  ASSERT_EQ(kvf_geometry_view(g.get(), 1, 1, &v), KVF_SUCCESS);
  EXPECT_STREQ(v.name, "swa[1]");
  EXPECT_EQ(v.region, 2u) << "region_step 2: kv[0] + 1*2";
  EXPECT_EQ(v.alias_group, 0);
  EXPECT_EQ(v.alias_layer, 2) << "layer_step 2: layer 0 + 1*2";
  ASSERT_EQ(kvf_geometry_view(g.get(), 1, 0, &v), KVF_SUCCESS);
  EXPECT_EQ(v.region, 0u);
  EXPECT_EQ(v.alias_layer, 0);
  ASSERT_EQ(kvf_geometry_view(g.get(), 2, 1, &v), KVF_SUCCESS);
  EXPECT_STREQ(v.name, "mamba[1]");
  EXPECT_EQ(v.region, 4u);
  EXPECT_EQ(v.offset, 65536u) << "offset_step";
  EXPECT_EQ(v.elem_bytes, 1u);
  EXPECT_EQ(v.block_stride, 16384u);
  EXPECT_EQ(v.planes, 0u);
  EXPECT_EQ(v.heads, 0u);
  ASSERT_EQ(v.num_states, 2u);
  EXPECT_EQ(v.states[0].offset, 0u);
  EXPECT_EQ(v.states[0].bytes, 1024u);
  EXPECT_EQ(v.states[1].offset, 1024u);
  EXPECT_EQ(v.states[1].bytes, 8192u);
  EXPECT_EQ(v.alias_group, -1);

  kvf_object_policy p = KVF_OBJECT_POLICY_INIT;
  ASSERT_EQ(kvf_geometry_policy(g.get(), &p), KVF_SUCCESS);
  EXPECT_EQ(p.chunk_tokens, 64u);
  EXPECT_EQ(p.format, KVF_FORMAT_NATIVE);
  EXPECT_EQ(p.separate_windowed, 1);
  EXPECT_EQ(p.separate_recurrent, 1);
  EXPECT_EQ(kvf_geometry_num_object_groups(g.get()), 3u);
  uint32_t world = 0, rank = 0;
  ASSERT_EQ(kvf_geometry_dcp(g.get(), &world, &rank), KVF_SUCCESS);
  EXPECT_EQ(world, 2u);
  EXPECT_EQ(rank, 1u);
}

TEST(Json, BufferNeedNotBeTerminated) {
  // Trailing bytes past len are not read: a parse would reject them.
  std::string padded = kSmall + "} garbage";
  GeometryPtr g;
  kvf_geometry *raw = nullptr;
  ASSERT_EQ(kvf_geometry_load_buffer(padded.data(), kSmall.size(), nullptr, &raw, nullptr), KVF_SUCCESS)
      << kvf_last_error();
  g.reset(raw);
  EXPECT_EQ(Load(padded, &g), KVF_ERR_PARSE);
}

TEST(Json, NamesAreExpandedAndResolved) {
  // "kv[1]" names one region of a counted entry, the plain "kv" its first;
  // an unnamed layer entry leaves its views unnamed.
  std::string json = Edit(kSmall, R"({ "count": 2, "name": "layer", "region": "kv", "region_step": 1, "elem_bytes": 2,)",
                          R"({ "region": "kv[1]", "name": "second", "elem_bytes": 2,
          "block_stride": 8192, "planes": 2, "heads": 2, "head_bytes": 128,
          "plane_stride": 65536, "token_stride": 256, "head_stride": 128 },
        { "region": "kv", "elem_bytes": 2,)");
  GeometryPtr g;
  ASSERT_EQ(Load(json, &g), KVF_SUCCESS) << kvf_last_error();
  kvf_view_desc v = KVF_VIEW_DESC_INIT;
  ASSERT_EQ(kvf_geometry_view(g.get(), 0, 0, &v), KVF_SUCCESS);
  EXPECT_EQ(v.region, 1u);
  EXPECT_STREQ(v.name, "second") << "a single layer keeps its name without an index";
  ASSERT_EQ(kvf_geometry_view(g.get(), 0, 1, &v), KVF_SUCCESS);
  EXPECT_EQ(v.region, 0u);
  EXPECT_STREQ(v.name, "");
}

// Names returned by kvf_geometry_view must stay valid for the geometry's
// lifetime, however many views were added (and storage grown) after them.
TEST(Json, ViewNamesSurviveManyLayers) {
  std::string json = Edit(kSmall, R"({ "name": "kv", "count": 2 })", R"({ "name": "kv", "count": 40 })");
  json = Edit(json, R"({ "count": 2, "name": "layer")", R"({ "count": 40, "name": "layer")");
  GeometryPtr g;
  ASSERT_EQ(Load(json, &g), KVF_SUCCESS) << kvf_last_error();
  for (uint32_t l = 0; l < 40; ++l) {
    kvf_view_desc v = KVF_VIEW_DESC_INIT;
    ASSERT_EQ(kvf_geometry_view(g.get(), 0, l, &v), KVF_SUCCESS);
    EXPECT_EQ(std::string(v.name), "layer[" + std::to_string(l) + "]");
    EXPECT_EQ(v.region, l);
  }
}

TEST(Json, LayerStepDefaultsToOne) {
  std::string json = Edit(kHybrid, R"("region": "kv", "region_step": 2,)", R"("region": "kv[1]", "region_step": 1,)");
  json = Edit(json, R"("layer": 0, "layer_step": 2 })", R"("layer": 1 })");
  GeometryPtr g;
  ASSERT_EQ(Load(json, &g), KVF_SUCCESS) << kvf_last_error();
  kvf_view_desc v = KVF_VIEW_DESC_INIT;
  ASSERT_EQ(kvf_geometry_view(g.get(), 1, 1, &v), KVF_SUCCESS);
  EXPECT_EQ(v.region, 2u);
  EXPECT_EQ(v.alias_group, 0);
  EXPECT_EQ(v.alias_layer, 2);
}

// ---- schema errors: KVF_ERR_PARSE (or a limit: INVALID_GEOMETRY), naming the JSON path ----

struct SchemaCase {
  const char *what;
  const char *from;   // edit applied to kHybrid
  const char *to;
  kvf_status status;
  const char *path;   // must appear in kvf_last_error()
  const char *detail; // and so must this
};

const SchemaCase kSchemaCases[] = {
    {"unknown key", R"("token_stride": 256, "head_stride": 128,
          "alias_of")",
     R"("tokn_stride": 256, "head_stride": 128,
          "alias_of")", KVF_ERR_PARSE, "groups[1].layers[0].tokn_stride", "unknown key"},
    {"unknown top-level key", R"("dcp":)", R"("dpc":)", KVF_ERR_PARSE, "dpc", "unknown key"},
    {"unknown key in a state", R"({ "offset": 1024, "bytes": 8192 })", R"({ "offset": 1024, "byte": 8192 })",
     KVF_ERR_PARSE, "groups[2].layers[0].states[1].byte", "unknown key"},
    {"wrong type", R"("window": 64)", R"("window": "64")", KVF_ERR_PARSE, "groups[1].window",
     "expected a non-negative integer"},
    {"negative number", R"("offset_step": 65536)", R"("offset_step": -65536)", KVF_ERR_PARSE,
     "groups[2].layers[0].offset_step", "expected a non-negative integer"},
    {"fractional number", R"("num_blocks": 4,)", R"("num_blocks": 4.5,)", KVF_ERR_PARSE, "groups[2].num_blocks",
     "expected a non-negative integer"},
    {"uint32 out of range", R"("num_blocks": 4,)", R"("num_blocks": 4294967296,)", KVF_ERR_PARSE,
     "groups[2].num_blocks", "4294967295"},
    {"head_bytes entry out of range", R"([128, 128])", R"([128, 4294967296])", KVF_ERR_PARSE,
     "groups[0].layers[0].head_bytes[1]", "4294967295"},
    {"missing required key", R"(, "token_stride": 256, "head_stride": 128 }
      ] },
    { "name": "swa")",
     R"(, "head_stride": 128 }
      ] },
    { "name": "swa")", KVF_ERR_PARSE, "groups[0].layers[0].token_stride", "required key is missing"},
    {"missing plane_stride with two planes", R"("plane_stride": 4096, "token_stride": 256, "head_stride": 128 }
      ] },
    { "name": "swa")",
     R"("token_stride": 256, "head_stride": 128 }
      ] },
    { "name": "swa")", KVF_ERR_PARSE, "groups[0].layers[0].plane_stride", "required when planes is 2"},
    {"missing top-level key", R"("name": "tiny-hybrid",)", "", KVF_ERR_PARSE, "name", "required key is missing"},
    {"unknown region", R"("region": "ssm")", R"("region": "ssn")", KVF_ERR_PARSE, "groups[2].layers[0].region",
     "unknown region 'ssn'"},
    {"region index past the count", R"("region": "ssm")", R"("region": "kv[4]")", KVF_ERR_PARSE,
     "groups[2].layers[0].region", "unknown region 'kv[4]'"},
    {"region_step out of the counted region", R"("region_step": 2,)", R"("region_step": 4,)", KVF_ERR_PARSE,
     "groups[1].layers[0].region_step", "'kv', which has 4 regions"},
    {"unknown alias group", R"("group": "full", "layer": 0, "layer_step": 2)",
     R"("group": "fulll", "layer": 0, "layer_step": 2)", KVF_ERR_PARSE, "groups[1].layers[0].alias_of.group",
     "unknown group 'fulll'"},
    {"alias of a layer that does not exist", R"("layer": 0, "layer_step": 2)", R"("layer": 4, "layer_step": 2)",
     KVF_ERR_PARSE, "groups[1].layers[0].alias_of.layer", "earlier view"},
    {"alias stepping past the target group", R"("layer": 0, "layer_step": 2)", R"("layer": 0, "layer_step": 4)",
     KVF_ERR_PARSE, "groups[1].layers[0].alias_of.layer_step", "earlier view"},
    {"unknown kind", R"("kind": "sliding_window")", R"("kind": "sliding")", KVF_ERR_PARSE, "groups[1].kind",
     "unknown kind 'sliding'"},
    {"window on a full group", R"("name": "full", "kind": "full",)",
     R"("name": "full", "kind": "full", "window": 64,)", KVF_ERR_PARSE, "groups[0].window",
     "only sliding_window"},
    {"window missing", R"(, "window": 64,)", ",", KVF_ERR_PARSE, "groups[1].window", "required key is missing"},
    {"chunk missing", R"("kind": "sliding_window", "block_size": 16, "num_blocks": 8, "window": 64,)",
     R"("kind": "chunked_local", "block_size": 16, "num_blocks": 8,)", KVF_ERR_PARSE, "groups[1].chunk",
     "required key is missing"},
    {"states on an attention layer", R"("head_bytes": [128, 128],)",
     R"("head_bytes": [128, 128], "states": [],)", KVF_ERR_PARSE, "groups[0].layers[0].states",
     "only recurrent groups"},
    {"attention key on a recurrent layer", R"("block_stride": 16384,
          "states")",
     R"("block_stride": 16384, "heads": 1,
          "states")", KVF_ERR_PARSE, "groups[2].layers[0].heads", "not allowed in a recurrent group"},
    {"head_bytes array of the wrong length", R"([128, 128])", R"([128])", KVF_ERR_PARSE,
     "groups[0].layers[0].head_bytes", "one integer per plane"},
    {"head_bytes of the wrong type", R"([128, 128])", R"("128")", KVF_ERR_PARSE, "groups[0].layers[0].head_bytes",
     "expected a non-negative integer or an array"},
    {"boolean of the wrong type", R"("separate_windowed": true)", R"("separate_windowed": 1)", KVF_ERR_PARSE,
     "objects.separate_windowed", "expected true or false"},
    {"unknown object format", R"("format": "native")", R"("format": "fancy")", KVF_ERR_PARSE, "objects.format",
     "unknown format 'fancy'"},
    {"wrong file format", R"("format": "kvferry-geometry")", R"("format": "kvferry-plan")", KVF_ERR_PARSE,
     "format", "kvferry-geometry"},
    {"future version", R"("version": 1)", R"("version": 2)", KVF_ERR_PARSE, "version", "version 1"},
    {"regions not an array", R"("regions": [
    { "name": "kv", "count": 4, "align": 4096 },
    { "name": "ssm", "size": 131072 }
  ])",
     R"("regions": { "name": "kv" })", KVF_ERR_PARSE, "regions", "expected an array"},
    {"empty regions", R"("regions": [
    { "name": "kv", "count": 4, "align": 4096 },
    { "name": "ssm", "size": 131072 }
  ])",
     R"("regions": [])", KVF_ERR_PARSE, "regions", "at least one region"},
    {"zero count", R"("count": 4, "name": "attn")", R"("count": 0, "name": "attn")", KVF_ERR_PARSE,
     "groups[0].layers[0].count", "positive integer"},
    {"duplicate group name", R"("name": "swa", "kind")", R"("name": "full", "kind")", KVF_ERR_PARSE,
     "groups[1].name", "duplicate group name 'full'"},
    {"region name collides with an expanded one", R"({ "name": "ssm", "size": 131072 })",
     R"({ "name": "kv[2]", "size": 131072 })", KVF_ERR_PARSE, "regions[1].name", "'kv[2]'"},
    {"empty name", R"("name": "tiny-hybrid")", R"("name": "")", KVF_ERR_PARSE, "name", "must not be empty"},
    {"name too long", R"("name": "tiny-hybrid")",
     R"("name": "a-name-that-is-much-longer-than-sixty-three-bytes-which-is-the-limit")", KVF_ERR_PARSE, "name",
     "longer than 63 bytes"},
    {"alias to a later group", R"("count": 4, "name": "attn", "region": "kv", "region_step": 1,)",
     R"("count": 4, "name": "attn", "region": "kv", "region_step": 1, "alias_of": { "group": "swa", "layer": 0 },)",
     KVF_ERR_PARSE, "groups[0].layers[0].alias_of.group", "declared later"},
    {"too many states", R"({ "offset": 0, "bytes": 1024 },)",
     R"({ "offset": 0, "bytes": 1 }, { "offset": 1, "bytes": 1 }, { "offset": 2, "bytes": 1 },
        { "offset": 3, "bytes": 1 }, { "offset": 4, "bytes": 1 }, { "offset": 5, "bytes": 1 },
        { "offset": 6, "bytes": 1 }, { "offset": 7, "bytes": 1 },)",
     KVF_ERR_INVALID_GEOMETRY, "groups[2].layers[0].states", "at most 8"},
    {"too many layers", R"("count": 4, "name": "attn")", R"("count": 1025, "name": "attn")",
     KVF_ERR_INVALID_GEOMETRY, "groups[0].layers[0].count", "limit of 1024"},
    {"dcp rank not below world", R"("rank": 1)", R"("rank": 2)", KVF_ERR_INVALID_GEOMETRY, "dcp.rank",
     "below world 2"},
    {"dcp rank missing", R"(, "rank": 1)", "", KVF_ERR_PARSE, "dcp.rank", "required key is missing"},
    {"offset_step overflow", R"("count": 2, "name": "mamba", "region": "ssm", "offset": 0, "offset_step": 65536)",
     R"("count": 3, "name": "mamba", "region": "ssm", "offset": 9223372036854775807,
        "offset_step": 9223372036854775807)",
     KVF_ERR_OVERFLOW, "groups[2].layers[0].offset_step", "overflows"},
};

TEST(Json, SchemaErrorsNameTheJsonPath) {
  for (const SchemaCase &c : kSchemaCases) {
    SCOPED_TRACE(c.what);
    std::string json = Edit(kHybrid, c.from, c.to);
    GeometryPtr g;
    kvf_geometry_error err;
    memset(&err, 0x5a, sizeof err);
    EXPECT_EQ(Load(json, &g, &err), c.status) << kvf_last_error();
    std::string msg = kvf_last_error();
    EXPECT_NE(msg.find(std::string(c.path) + ":"), std::string::npos) << msg;
    EXPECT_NE(msg.find(c.detail), std::string::npos) << msg;
    EXPECT_EQ(err.status, c.status);
    EXPECT_STREQ(err.message, kvf_last_error());
  }
}

TEST(Json, SchemaErrorFillsGroupLayerAndField) {
  std::string json = Edit(kHybrid, R"("offset_step": 65536)", R"("offset_step": "x")");
  GeometryPtr g;
  kvf_geometry_error err;
  ASSERT_EQ(Load(json, &g, &err), KVF_ERR_PARSE);
  EXPECT_EQ(err.group, 2);
  EXPECT_EQ(err.layer, 0);
  EXPECT_STREQ(err.field, "offset_step");
  // A layer error in the second entry of a group points at its first expanded layer.
  json = Edit(kSmall, R"("head_stride": 128 }
      ] })",
              R"("head_stride": 128 },
        { "count": 1, "region": "kv", "block_stride": -1 }
      ] })");
  ASSERT_EQ(Load(json, &g, &err), KVF_ERR_PARSE);
  EXPECT_EQ(err.group, 0);
  EXPECT_EQ(err.layer, 2);
  EXPECT_STREQ(err.field, "block_stride");
  EXPECT_NE(std::string(kvf_last_error()).find("groups[0].layers[1].block_stride:"), std::string::npos);
}

TEST(Json, UnprintableKeysAreSanitized) {
  std::string json = Edit(kSmall, R"("name": "tiny-full",)", "\"na\\u0001me\": 1, \"name\": \"x\",");
  GeometryPtr g;
  ASSERT_EQ(Load(json, &g), KVF_ERR_PARSE);
  EXPECT_NE(std::string(kvf_last_error()).find("na?me: unknown key"), std::string::npos) << kvf_last_error();
}

TEST(Json, SyntaxErrorReportsLineAndColumn) {
  const std::string json = "{\n  \"format\": \"kvferry-geometry\",\n  \"version\": 1\n  \"name\": \"x\"\n}\n";
  GeometryPtr g;
  kvf_geometry_error err;
  ASSERT_EQ(Load(json, &g, &err), KVF_ERR_PARSE);
  std::string msg = kvf_last_error();
  EXPECT_NE(msg.find("line 4, column"), std::string::npos) << msg;
  EXPECT_EQ(err.status, KVF_ERR_PARSE);
}

TEST(Json, DuplicateKeysAreRejected) {
  std::string json = Edit(kSmall, R"("version": 1,)", R"("version": 1, "version": 1,)");
  GeometryPtr g;
  ASSERT_EQ(Load(json, &g), KVF_ERR_PARSE);
  EXPECT_NE(std::string(kvf_last_error()).find("duplicate"), std::string::npos) << kvf_last_error();
  EXPECT_NE(std::string(kvf_last_error()).find("line 3"), std::string::npos) << kvf_last_error();
}

TEST(Json, RejectsNonObjectsAndEmptyInput) {
  GeometryPtr g;
  EXPECT_EQ(Load("[]", &g), KVF_ERR_PARSE);
  EXPECT_NE(std::string(kvf_last_error()).find("top level: expected an object"), std::string::npos)
      << kvf_last_error();
  EXPECT_EQ(Load("", &g), KVF_ERR_PARSE);
  EXPECT_NE(std::string(kvf_last_error()).find("line 1"), std::string::npos) << kvf_last_error();
  kvf_geometry *raw = nullptr;
  EXPECT_EQ(kvf_geometry_load_buffer(nullptr, 0, nullptr, &raw, nullptr), KVF_ERR_PARSE);
  EXPECT_EQ(kvf_geometry_load_buffer(nullptr, 5, nullptr, &raw, nullptr), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(kvf_geometry_load_buffer(kSmall.data(), kSmall.size(), nullptr, nullptr, nullptr),
            KVF_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(raw, nullptr);
}

TEST(Json, RejectsOversizedInput) {
  std::string big(((size_t)16 << 20) + 1, ' ');
  GeometryPtr g;
  EXPECT_EQ(Load(big, &g), KVF_ERR_PARSE);
  EXPECT_NE(std::string(kvf_last_error()).find("16 MiB"), std::string::npos) << kvf_last_error();
}

// ---- validation errors pass through from kvf_geometry_finalize ---------------

TEST(Json, ValidationErrorNamesTheJsonPath) {
  // A block stride smaller than a block's payload in one plane (16 tokens x 256 B = 4096).
  std::string json = Edit(kSmall, R"("block_stride": 8192)", R"("block_stride": 2048)");
  GeometryPtr g;
  kvf_geometry_error err;
  ASSERT_EQ(Load(json, &g, &err), KVF_ERR_INVALID_GEOMETRY);
  EXPECT_EQ(err.status, KVF_ERR_INVALID_GEOMETRY);
  EXPECT_EQ(err.group, 0);
  EXPECT_EQ(err.layer, 0);
  EXPECT_NE(err.field[0], '\0');
  EXPECT_STREQ(err.message, kvf_last_error());

  EXPECT_STREQ(err.field, "block_stride") << "the C field, as finalize names it";

  // The same through the builder gives the same status and message; the
  // loader puts the JSON path of the entry in front, with the layer of the
  // counted entry it expanded to.
  std::string from_file = kvf_last_error();
  kvf_geometry *raw = nullptr;
  ASSERT_EQ(kvf_geometry_create(&raw), KVF_SUCCESS);
  GeometryPtr built(raw);
  kvf_region_desc rd = KVF_REGION_DESC_INIT;
  rd.name = "kv[0]";
  ASSERT_EQ(kvf_geometry_add_region(raw, &rd, nullptr), KVF_SUCCESS);
  rd.name = "kv[1]";
  ASSERT_EQ(kvf_geometry_add_region(raw, &rd, nullptr), KVF_SUCCESS);
  kvf_group_desc gd = KVF_GROUP_DESC_INIT;
  gd.name = "full";
  gd.num_blocks = 8;
  ASSERT_EQ(kvf_geometry_add_group(raw, &gd, nullptr), KVF_SUCCESS);
  for (uint32_t l = 0; l < 2; ++l) {
    kvf_view_desc vd = KVF_VIEW_DESC_INIT;
    vd.name = l == 0 ? "layer[0]" : "layer[1]";
    vd.region = l;
    vd.elem_bytes = 2;
    vd.block_stride = 2048;
    vd.planes = 2;
    vd.heads = 2;
    vd.head_bytes[0] = vd.head_bytes[1] = 128;
    vd.plane_stride = 65536;
    vd.token_stride = 256;
    vd.head_stride = 128;
    ASSERT_EQ(kvf_geometry_add_view(raw, 0, &vd, nullptr), KVF_SUCCESS);
  }
  kvf_object_policy pol = KVF_OBJECT_POLICY_INIT;
  pol.chunk_tokens = 32;
  ASSERT_EQ(kvf_geometry_set_policy(raw, &pol), KVF_SUCCESS);
  ASSERT_EQ(kvf_geometry_finalize(raw, nullptr), KVF_ERR_INVALID_GEOMETRY);
  EXPECT_EQ(from_file, std::string("groups[0].layers[0].block_stride (k = 0 of count 2): ") + kvf_last_error());
}

// Each validation failure of a file names the JSON path of the key to
// change: the layer entry (and which of its count layers), the group, the
// region entry or the object policy.
struct ValidationCase {
  const char *what;
  const std::string *base;
  const char *from, *to;
  const char *prefix;  // the message starts with it
  const char *field;   // kvf_geometry_error.field: finalize's C field
  int32_t group, layer;
};

const ValidationCase kValidationCases[] = {
    {"a stride in a counted entry, layer k = 1", &kHybrid, R"("count": 2, "name": "mamba", "region": "ssm", "offset": 0, "offset_step": 65536)",
     R"("count": 2, "name": "mamba", "region": "ssm", "offset": 0, "offset_step": 131072)",
     "groups[2].layers[0].offset (k = 1 of count 2: offset + 1 x offset_step): group 'mamba' (2), layer 1 "
     "('mamba[1]'): offset 131072:", "offset",
     2, 1},
    {"an alias in another region", &kHybrid, R"("region_step": 2)", R"("region_step": 1)",
     "groups[1].layers[0].alias_of (k = 1 of count 2): group 'swa' (1), layer 1 ('swa[1]'): alias_of", "alias_of", 1,
     1},
    {"head_bytes given as an array", &kHybrid, R"("head_bytes": [128, 128])", R"("head_bytes": [128, 127])",
     "groups[0].layers[0].head_bytes (k = 0 of count 4): ", "head_bytes", 0, 0},
    {"head_bytes given as one integer", &kSmall, R"("head_bytes": 128)", R"("head_bytes": 0)",
     "groups[0].layers[0].head_bytes (k = 0 of count 2): ", "head_bytes[0]", 0, 0},
    {"a state", &kHybrid, R"({ "offset": 1024, "bytes": 8192 })", R"({ "offset": 512, "bytes": 8192 })",
     "groups[2].layers[0].states[1] (k = 0 of count 2): ", "states[1]", 2, 0},
    {"an uncounted region too small for one block", &kHybrid, R"("size": 131072)", R"("size": 4096)",
     "regions[1].size: group 'mamba' (2), layer 0 ('mamba[0]'): size 4096 of region 4 'ssm':", "size", 2, 0},
    {"a counted region too small for one block", &kSmall, R"({ "name": "kv", "count": 2 })",
     R"({ "name": "kv", "count": 2, "size": 65536 })",
     "regions[0].size (k = 0 of count 2): group 'full' (0), layer 0 ('layer[0]'): size 65536 of region 0 'kv[0]':",
     "size", 0, 0},
    {"a region too small for num_blocks", &kSmall, R"({ "name": "kv", "count": 2 })",
     R"({ "name": "kv", "count": 2, "size": 100000 })",
     "groups[0].num_blocks: group 'full' (0), layer 0 ('layer[0]'): num_blocks 8:", "num_blocks", 0, 0},
    {"a group rule", &kHybrid, R"("window": 64)", R"("window": 16777217)", "groups[1].window: group 'swa' (1): window",
     "window", 1, -1},
    {"the object policy", &kHybrid, R"("chunk_tokens": 64)", R"("chunk_tokens": 48)",
     "objects.chunk_tokens: group 'full' (0): chunk_tokens 48:", "chunk_tokens", 0, -1},
    {"a region nothing lives in", &kHybrid, R"({ "name": "ssm", "size": 131072 })",
     R"({ "name": "ssm", "size": 131072 }, { "name": "spare", "count": 3 })",
     "regions[2] (k = 0 of count 3): geometry: regions[5] 'spare[0]': no view lives in it", "regions[5]", -1, -1},
};

TEST(Json, ValidationErrorsNameTheEntry) {
  for (const ValidationCase &c : kValidationCases) {
    SCOPED_TRACE(c.what);
    GeometryPtr g;
    kvf_geometry_error err;
    ASSERT_EQ(Load(Edit(*c.base, c.from, c.to), &g, &err), KVF_ERR_INVALID_GEOMETRY) << kvf_last_error();
    std::string msg = kvf_last_error();
    EXPECT_EQ(msg.rfind(c.prefix, 0), 0u) << msg;
    EXPECT_STREQ(err.field, c.field) << msg;
    EXPECT_EQ(err.group, c.group) << msg;
    EXPECT_EQ(err.layer, c.layer) << msg;
    EXPECT_STREQ(err.message, msg.c_str());
  }
}

TEST(Json, ValidationErrorInALaterEntryNamesThatEntry) {
  // A second entry of one layer in kv[1] overlaps layer[1] of the first.
  std::string json = Edit(kSmall, R"("head_stride": 128 }
      ] })",
                          R"("head_stride": 128 },
        { "name": "extra", "region": "kv[1]", "elem_bytes": 2, "block_stride": 8192, "planes": 2, "heads": 2,
          "head_bytes": 128, "plane_stride": 65536, "token_stride": 256, "head_stride": 128 }
      ] })");
  GeometryPtr g;
  kvf_geometry_error err;
  ASSERT_EQ(Load(json, &g, &err), KVF_ERR_INVALID_GEOMETRY);
  std::string msg = kvf_last_error();
  EXPECT_EQ(msg.rfind("groups[0].layers[1].offset: group 'full' (0), layer 2 ('extra'): offset 0: overlaps", 0), 0u)
      << msg;
  EXPECT_EQ(err.layer, 2);
}

TEST(Json, ValidationErrorNamesTheOverride) {
  // 100 blocks of 8 KiB in each of K and V do not fit a region of a fixed 1 MiB.
  kvf_geometry_load_options opt = KVF_GEOMETRY_LOAD_OPTIONS_INIT;
  opt.num_blocks_override = 100;
  std::string json = Edit(Edit(kSmall, R"("plane_stride": 65536)", R"("plane_stride": "num_blocks * block_stride")"),
                          R"({ "name": "kv", "count": 2 })", R"({ "name": "kv", "count": 2, "size": 1048576 })");
  GeometryPtr g;
  kvf_geometry_error err;
  ASSERT_EQ(Load(json, &g, &err, &opt), KVF_ERR_INVALID_GEOMETRY);
  std::string msg = kvf_last_error();
  EXPECT_EQ(msg.rfind("groups[0].num_blocks (num_blocks_override 100): ", 0), 0u) << msg;
  EXPECT_STREQ(err.field, "num_blocks");
}

TEST(Json, ValidationErrorsFromOtherRules) {
  GeometryPtr g;
  // chunk_tokens must be a multiple of block_size x dcp world (16 x 2).
  EXPECT_EQ(Load(Edit(kHybrid, R"("chunk_tokens": 64)", R"("chunk_tokens": 48)"), &g), KVF_ERR_INVALID_GEOMETRY);
  // Without alias_of the sliding-window views overlap the full ones.
  EXPECT_EQ(Load(Edit(kHybrid, R"(,
          "alias_of": { "group": "full", "layer": 0, "layer_step": 2 })",
                      ""),
                 &g),
            KVF_ERR_INVALID_GEOMETRY);
  EXPECT_NE(std::string(kvf_last_error()).find("alias_of"), std::string::npos) << kvf_last_error();
  // A fixed region size too small for the largest block id.
  EXPECT_EQ(Load(Edit(kHybrid, R"("size": 131072)", R"("size": 65536)"), &g), KVF_ERR_INVALID_GEOMETRY);
}

// ---- options ---------------------------------------------------------------

TEST(Json, NumBlocksOverrideReplacesEveryGroup) {
  kvf_geometry_load_options opt = KVF_GEOMETRY_LOAD_OPTIONS_INIT;
  opt.num_blocks_override = 2;
  GeometryPtr g;
  ASSERT_EQ(Load(kHybrid, &g, nullptr, &opt), KVF_SUCCESS) << kvf_last_error();
  for (uint32_t i = 0; i < kvf_geometry_num_groups(g.get()); ++i) {
    kvf_group_info gi = KVF_GROUP_INFO_INIT;
    ASSERT_EQ(kvf_geometry_group(g.get(), i, &gi), KVF_SUCCESS);
    EXPECT_EQ(gi.num_blocks, 2u) << "group " << i;
  }
  kvf_region_info r = KVF_REGION_INFO_INIT;
  ASSERT_EQ(kvf_geometry_region(g.get(), 0, &r), KVF_SUCCESS);
  EXPECT_EQ(r.size, 16384u + 8192u) << "computed region sizes follow the override";
  ASSERT_EQ(kvf_geometry_region(g.get(), 4, &r), KVF_SUCCESS);
  EXPECT_EQ(r.size, 131072u) << "a size given in the file stays";

  // Zero means "as in the file".
  opt.num_blocks_override = 0;
  ASSERT_EQ(Load(kHybrid, &g, nullptr, &opt), KVF_SUCCESS) << kvf_last_error();
  kvf_group_info gi = KVF_GROUP_INFO_INIT;
  ASSERT_EQ(kvf_geometry_group(g.get(), 2, &gi), KVF_SUCCESS);
  EXPECT_EQ(gi.num_blocks, 4u);

  // The override is validated like the file: 32 slots of 16 KiB no longer
  // fit between the recurrent layers placed 64 KiB apart.
  opt.num_blocks_override = 32;
  kvf_geometry_error err;
  EXPECT_EQ(Load(kHybrid, &g, &err, &opt), KVF_ERR_INVALID_GEOMETRY);
  EXPECT_STREQ(err.field, "num_blocks") << err.message;  // the region holds 8 slots: the count is at fault
  EXPECT_EQ(err.group, 2);
}

// ---- plane_stride as "num_blocks * block_stride" ----------------------------

// kSmall's plane_stride, 65536, is its num_blocks (8) times block_stride (8192).
const std::string kSmallPlaneStride = R"("plane_stride": 65536)";

kvf_view_desc FirstView(const GeometryPtr &g) {
  kvf_view_desc v = KVF_VIEW_DESC_INIT;
  EXPECT_EQ(kvf_geometry_view(g.get(), 0, 0, &v), KVF_SUCCESS) << kvf_last_error();
  return v;
}

TEST(Json, PlaneStrideStringFollowsNumBlocks) {
  GeometryPtr fixed;
  ASSERT_EQ(Load(kSmall, &fixed), KVF_SUCCESS) << kvf_last_error();
  for (const char *spelling : {"num_blocks * block_stride", "num_blocks*block_stride", "  num_blocks  *block_stride "}) {
    SCOPED_TRACE(spelling);
    std::string json = Edit(kSmall, kSmallPlaneStride, std::string("\"plane_stride\": \"") + spelling + "\"");
    GeometryPtr g;
    ASSERT_EQ(Load(json, &g), KVF_SUCCESS) << kvf_last_error();
    EXPECT_EQ(FirstView(g).plane_stride, 8u * 8192u) << "computed from the file's num_blocks";
    EXPECT_EQ(kvf_geometry_fingerprint(g.get(), KVF_FORMAT_NATIVE),
              kvf_geometry_fingerprint(fixed.get(), KVF_FORMAT_NATIVE))
        << "the same layout as the integer it stands for";
  }
}

TEST(Json, PlaneStrideStringFollowsTheOverride) {
  std::string json = Edit(kSmall, kSmallPlaneStride, R"("plane_stride": "num_blocks * block_stride")");
  kvf_geometry_load_options opt = KVF_GEOMETRY_LOAD_OPTIONS_INIT;
  for (uint32_t nb : {3u, 100u}) {
    SCOPED_TRACE(nb);
    opt.num_blocks_override = nb;
    GeometryPtr g;
    ASSERT_EQ(Load(json, &g, nullptr, &opt), KVF_SUCCESS) << kvf_last_error();
    kvf_view_desc v = FirstView(g);
    EXPECT_EQ(v.plane_stride, (uint64_t)nb * 8192u);
    kvf_region_info r = KVF_REGION_INFO_INIT;
    ASSERT_EQ(kvf_geometry_region(g.get(), 0, &r), KVF_SUCCESS);
    // V of the last block ends a pool past its K: a block's 16 tokens fill
    // 4096 of its 8192 bytes.
    EXPECT_EQ(r.size, nb * 8192u + (nb - 1) * 8192u + 16u * 256u) << "K and V of every block, a pool apart";
  }
  // The integer form stays fixed: 100 blocks of K run into V. The strides
  // describe an 8-block pool, so the error names num_blocks.
  opt.num_blocks_override = 100;
  GeometryPtr g;
  kvf_geometry_error err;
  EXPECT_EQ(Load(kSmall, &g, &err, &opt), KVF_ERR_INVALID_GEOMETRY);
  EXPECT_STREQ(err.field, "num_blocks") << err.message;
  EXPECT_NE(std::string(err.message).find("room for 8 blocks"), std::string::npos) << err.message;
}

TEST(Json, PlaneStrideRejectsOtherStrings) {
  for (const char *text : {"num_blocks * 2", "block_stride * num_blocks", "num_blocks * block_stride * 2",
                           "num_blocks", "65536", ""}) {
    SCOPED_TRACE(text);
    std::string json = Edit(kSmall, kSmallPlaneStride, std::string("\"plane_stride\": \"") + text + "\"");
    GeometryPtr g;
    kvf_geometry_error err;
    ASSERT_EQ(Load(json, &g, &err), KVF_ERR_PARSE);
    EXPECT_EQ(err.status, KVF_ERR_PARSE);
    EXPECT_STREQ(err.field, "plane_stride");
    EXPECT_EQ(err.group, 0);
    EXPECT_EQ(err.layer, 0);
    std::string msg = kvf_last_error();
    EXPECT_NE(msg.find("groups[0].layers[0].plane_stride:"), std::string::npos) << msg;
    EXPECT_NE(msg.find("num_blocks * block_stride"), std::string::npos) << "say what is accepted: " << msg;
  }
}

TEST(Json, RejectsUnknownOptionsVersion) {
  kvf_geometry_load_options opt = KVF_GEOMETRY_LOAD_OPTIONS_INIT;
  opt.version = 0;  // any other version is informational: the size decides
  GeometryPtr g;
  EXPECT_EQ(Load(kSmall, &g, nullptr, &opt), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvf_last_error()).find("KVF_GEOMETRY_LOAD_OPTIONS_INIT"), std::string::npos);
  opt = KVF_GEOMETRY_LOAD_OPTIONS_INIT;
  opt.struct_size = 4;
  EXPECT_EQ(Load(kSmall, &g, nullptr, &opt), KVF_ERR_INVALID_ARGUMENT);
}

// ---- files -----------------------------------------------------------------

class JsonFile : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("kvf_test_json_" + std::to_string(getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string Write(const std::string &name, const std::string &text) {
    std::string path = (dir_ / name).string();
    std::ofstream(path, std::ios::binary) << text;
    return path;
  }
  std::filesystem::path dir_;
};

TEST_F(JsonFile, LoadsAFile) {
  std::string path = Write("small.json", kSmall);
  kvf_geometry *raw = nullptr;
  ASSERT_EQ(kvf_geometry_load_file(path.c_str(), nullptr, &raw, nullptr), KVF_SUCCESS) << kvf_last_error();
  GeometryPtr g(raw);
  EXPECT_STREQ(kvf_geometry_name(g.get()), "tiny-full");
}

TEST_F(JsonFile, MissingFileIsNotFound) {
  std::string path = (dir_ / "no-such-geometry.json").string();
  kvf_geometry *raw = nullptr;
  kvf_geometry_error err;
  EXPECT_EQ(kvf_geometry_load_file(path.c_str(), nullptr, &raw, &err), KVF_ERR_NOT_FOUND);
  EXPECT_EQ(raw, nullptr);
  std::string msg = kvf_last_error();
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
  EXPECT_NE(msg.find(strerror(ENOENT)), std::string::npos) << msg;
  EXPECT_EQ(err.status, KVF_ERR_NOT_FOUND);
}

TEST_F(JsonFile, DirectoryIsAnIoError) {
  kvf_geometry *raw = nullptr;
  EXPECT_EQ(kvf_geometry_load_file(dir_.string().c_str(), nullptr, &raw, nullptr), KVF_ERR_IO);
  EXPECT_NE(std::string(kvf_last_error()).find(dir_.string()), std::string::npos) << kvf_last_error();
  EXPECT_EQ(raw, nullptr);
}

TEST_F(JsonFile, ErrorsInAFileNameTheFile) {
  std::string path = Write("bad.json", Edit(kSmall, R"("token_stride": 256)", R"("token_stride": true)"));
  kvf_geometry *raw = nullptr;
  ASSERT_EQ(kvf_geometry_load_file(path.c_str(), nullptr, &raw, nullptr), KVF_ERR_PARSE);
  std::string msg = kvf_last_error();
  EXPECT_EQ(msg.rfind(path + ": groups[0].layers[0].token_stride:", 0), 0u) << msg;

  // Validation failures too, before the JSON path.
  path = Write("invalid.json", Edit(kSmall, R"("block_stride": 8192)", R"("block_stride": 2048)"));
  kvf_geometry_error err;
  ASSERT_EQ(kvf_geometry_load_file(path.c_str(), nullptr, &raw, &err), KVF_ERR_INVALID_GEOMETRY);
  msg = kvf_last_error();
  EXPECT_EQ(msg.rfind(path + ": groups[0].layers[0].block_stride (k = 0 of count 2): group 'full' (0)", 0), 0u)
      << msg;
  EXPECT_STREQ(err.message, msg.c_str());

  path = Write("syntax.json", "{\n\n  \"format\": ,\n}");
  ASSERT_EQ(kvf_geometry_load_file(path.c_str(), nullptr, &raw, nullptr), KVF_ERR_PARSE);
  msg = kvf_last_error();
  EXPECT_NE(msg.find(path + ": line 3, column"), std::string::npos) << msg;
}

TEST_F(JsonFile, OversizedFileIsRejected) {
  std::string path = Write("big.json", std::string(((size_t)16 << 20) + 1, ' '));
  kvf_geometry *raw = nullptr;
  EXPECT_EQ(kvf_geometry_load_file(path.c_str(), nullptr, &raw, nullptr), KVF_ERR_PARSE);
  EXPECT_NE(std::string(kvf_last_error()).find("16 MiB"), std::string::npos) << kvf_last_error();
  EXPECT_EQ(raw, nullptr);
}

// docs/geometry.md's worked example loads and expands as its table says.
TEST(Json, DocumentedExampleLoads) {
  std::ifstream in(KVF_SOURCE_DIR "/docs/geometry.md");
  ASSERT_TRUE(in) << "cannot read docs/geometry.md";
  std::string doc((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  size_t begin = doc.find("```json\n");
  ASSERT_NE(begin, std::string::npos);
  begin += 8;
  size_t end = doc.find("```", begin);
  ASSERT_NE(end, std::string::npos);
  GeometryPtr g;
  ASSERT_EQ(Load(doc.substr(begin, end - begin), &g), KVF_SUCCESS) << kvf_last_error();
  kvf_view_desc v = KVF_VIEW_DESC_INIT;
  ASSERT_EQ(kvf_geometry_view(g.get(), 1, 1, &v), KVF_SUCCESS);
  EXPECT_STREQ(v.name, "swa[1]");
  EXPECT_EQ(v.region, 2u);
  EXPECT_EQ(v.alias_group, 0);
  EXPECT_EQ(v.alias_layer, 2);
  ASSERT_EQ(kvf_geometry_view(g.get(), 2, 1, &v), KVF_SUCCESS);
  EXPECT_EQ(v.offset, 65536u);
  kvf_region_info r = KVF_REGION_INFO_INIT;
  ASSERT_EQ(kvf_geometry_region(g.get(), 0, &r), KVF_SUCCESS);
  EXPECT_EQ(r.size, 122880u);
  ASSERT_EQ(kvf_geometry_region(g.get(), 4, &r), KVF_SUCCESS);
  EXPECT_EQ(r.size, 123904u);
  ASSERT_EQ(kvf_geometry_num_object_groups(g.get()), 2u);
  kvf_object_group_info og = KVF_OBJECT_GROUP_INFO_INIT;
  ASSERT_EQ(kvf_geometry_object_group(g.get(), 0, &og), KVF_SUCCESS);
  ASSERT_EQ(og.num_groups, 2u);
  EXPECT_EQ(og.groups[0], 0u);
  EXPECT_EQ(og.groups[1], 2u);
}

TEST(Json, EveryPresetLoads) {
  std::vector<std::string> presets;
  std::error_code ec;
  for (const auto &entry : std::filesystem::directory_iterator(KVF_PRESET_DIR, ec))
    if (entry.path().extension() == ".json") presets.push_back(entry.path().string());
  if (presets.empty()) GTEST_SKIP() << "no presets in " KVF_PRESET_DIR " yet (tools/gen_presets.py writes them)";
  for (const std::string &path : presets) {
    SCOPED_TRACE(path);
    kvf_geometry *raw = nullptr;
    kvf_geometry_error err;
    ASSERT_EQ(kvf_geometry_load_file(path.c_str(), nullptr, &raw, &err), KVF_SUCCESS) << kvf_last_error();
    GeometryPtr g(raw);
    std::string stem = std::filesystem::path(path).stem().string();
    EXPECT_STREQ(kvf_geometry_name(g.get()), stem.c_str()) << "a preset is named after its file";
    EXPECT_GT(kvf_geometry_num_groups(g.get()), 0u);
    EXPECT_NE(kvf_geometry_fingerprint(g.get(), KVF_FORMAT_CANONICAL), 0u);
  }
}

// ---- writing: kvf_geometry_to_json -------------------------------------------

struct FreeDeleter {
  void operator()(char *p) const { free(p); }
};

// kvf_geometry_to_json as a std::string; checks *len against the text.
std::string ToJson(const kvf_geometry *g) {
  char *raw = nullptr;
  size_t len = 0;
  kvf_status st = kvf_geometry_to_json(g, &raw, &len);
  std::unique_ptr<char, FreeDeleter> text(raw);
  EXPECT_EQ(st, KVF_SUCCESS) << kvf_last_error();
  if (st != KVF_SUCCESS || raw == nullptr) return std::string();
  EXPECT_EQ(len, strlen(raw)) << "len is the bytes before the NUL";
  return std::string(raw, len);
}

// Names compared only where the original had one (the writer generates the rest).
void ExpectSameName(const char *original, const char *reloaded, bool generated_ok) {
  if (generated_ok && original[0] == '\0') {
    EXPECT_NE(reloaded[0], '\0') << "an unnamed entry is written with a generated name";
  } else {
    EXPECT_STREQ(original, reloaded);
  }
}

// Every public property of a and b, field by field.
void ExpectSameGeometry(const kvf_geometry *a, const kvf_geometry *b, bool generated_ok = false) {
  for (kvf_object_format f : {KVF_FORMAT_CANONICAL, KVF_FORMAT_NATIVE}) {
    EXPECT_NE(kvf_geometry_fingerprint(a, f), 0u);
    EXPECT_EQ(kvf_geometry_fingerprint(a, f), kvf_geometry_fingerprint(b, f)) << kvf_object_format_name(f);
  }
  ExpectSameName(kvf_geometry_name(a), kvf_geometry_name(b), generated_ok);
  EXPECT_STREQ(kvf_geometry_description(a), kvf_geometry_description(b));
  ASSERT_EQ(kvf_geometry_num_regions(a), kvf_geometry_num_regions(b));
  ASSERT_EQ(kvf_geometry_num_groups(a), kvf_geometry_num_groups(b));
  ASSERT_EQ(kvf_geometry_num_object_groups(a), kvf_geometry_num_object_groups(b));
  EXPECT_EQ(kvf_geometry_num_aliases(a), kvf_geometry_num_aliases(b));

  for (uint32_t i = 0; i < kvf_geometry_num_regions(a); ++i) {
    SCOPED_TRACE("region " + std::to_string(i));
    kvf_region_info ra = KVF_REGION_INFO_INIT, rb = KVF_REGION_INFO_INIT;
    ASSERT_EQ(kvf_geometry_region(a, i, &ra), KVF_SUCCESS);
    ASSERT_EQ(kvf_geometry_region(b, i, &rb), KVF_SUCCESS);
    ExpectSameName(ra.name, rb.name, generated_ok);
    EXPECT_EQ(ra.size, rb.size);
    EXPECT_EQ(ra.align, rb.align);
    EXPECT_EQ(ra.num_views, rb.num_views);
  }
  for (uint32_t g = 0; g < kvf_geometry_num_groups(a); ++g) {
    SCOPED_TRACE("group " + std::to_string(g));
    kvf_group_info ga = KVF_GROUP_INFO_INIT, gb = KVF_GROUP_INFO_INIT;
    ASSERT_EQ(kvf_geometry_group(a, g, &ga), KVF_SUCCESS);
    ASSERT_EQ(kvf_geometry_group(b, g, &gb), KVF_SUCCESS);
    ExpectSameName(ga.name, gb.name, generated_ok);
    EXPECT_EQ(ga.kind, gb.kind);
    EXPECT_EQ(ga.block_size, gb.block_size);
    EXPECT_EQ(ga.num_blocks, gb.num_blocks);
    EXPECT_EQ(ga.window, gb.window);
    EXPECT_EQ(ga.chunk, gb.chunk);
    EXPECT_EQ(ga.object_group, gb.object_group);
    EXPECT_EQ(ga.payload_per_block, gb.payload_per_block);
    EXPECT_EQ(ga.max_block_stride, gb.max_block_stride);
    ASSERT_EQ(ga.num_layers, gb.num_layers);
    for (uint32_t l = 0; l < ga.num_layers; ++l) {
      SCOPED_TRACE("layer " + std::to_string(l));
      kvf_view_desc va = KVF_VIEW_DESC_INIT, vb = KVF_VIEW_DESC_INIT;
      ASSERT_EQ(kvf_geometry_view(a, g, l, &va), KVF_SUCCESS);
      ASSERT_EQ(kvf_geometry_view(b, g, l, &vb), KVF_SUCCESS);
      EXPECT_STREQ(va.name, vb.name);
      EXPECT_EQ(va.region, vb.region);
      EXPECT_EQ(va.elem_bytes, vb.elem_bytes);
      EXPECT_EQ(va.offset, vb.offset);
      EXPECT_EQ(va.block_stride, vb.block_stride);
      EXPECT_EQ(va.planes, vb.planes);
      EXPECT_EQ(va.heads, vb.heads);
      EXPECT_EQ(va.plane_stride, vb.plane_stride);
      EXPECT_EQ(va.token_stride, vb.token_stride);
      EXPECT_EQ(va.head_stride, vb.head_stride);
      for (uint32_t p = 0; p < KVF_MAX_PLANES; ++p) EXPECT_EQ(va.head_bytes[p], vb.head_bytes[p]) << "plane " << p;
      ASSERT_EQ(va.num_states, vb.num_states);
      for (uint32_t s = 0; s < va.num_states; ++s) {
        EXPECT_EQ(va.states[s].offset, vb.states[s].offset) << "state " << s;
        EXPECT_EQ(va.states[s].bytes, vb.states[s].bytes) << "state " << s;
      }
      EXPECT_EQ(va.alias_group, vb.alias_group);
      EXPECT_EQ(va.alias_layer, vb.alias_layer);
    }
  }
  for (uint32_t o = 0; o < kvf_geometry_num_object_groups(a); ++o) {
    SCOPED_TRACE("object group " + std::to_string(o));
    kvf_object_group_info oa = KVF_OBJECT_GROUP_INFO_INIT, ob = KVF_OBJECT_GROUP_INFO_INIT;
    ASSERT_EQ(kvf_geometry_object_group(a, o, &oa), KVF_SUCCESS);
    ASSERT_EQ(kvf_geometry_object_group(b, o, &ob), KVF_SUCCESS);
    ASSERT_EQ(oa.num_groups, ob.num_groups);
    for (uint32_t i = 0; i < oa.num_groups; ++i) EXPECT_EQ(oa.groups[i], ob.groups[i]);
    EXPECT_EQ(oa.has_attention, ob.has_attention);
    EXPECT_EQ(oa.has_recurrent, ob.has_recurrent);
    EXPECT_EQ(oa.bytes_per_token, ob.bytes_per_token);
    EXPECT_EQ(oa.recurrent_bytes, ob.recurrent_bytes);
  }
  kvf_object_policy pa = KVF_OBJECT_POLICY_INIT, pb = KVF_OBJECT_POLICY_INIT;
  ASSERT_EQ(kvf_geometry_policy(a, &pa), KVF_SUCCESS);
  ASSERT_EQ(kvf_geometry_policy(b, &pb), KVF_SUCCESS);
  EXPECT_EQ(pa.chunk_tokens, pb.chunk_tokens);
  EXPECT_EQ(pa.format, pb.format);
  EXPECT_EQ(pa.separate_windowed, pb.separate_windowed);
  EXPECT_EQ(pa.separate_recurrent, pb.separate_recurrent);
  uint32_t wa = 0, ra = 0, wb = 0, rb = 0;
  ASSERT_EQ(kvf_geometry_dcp(a, &wa, &ra), KVF_SUCCESS);
  ASSERT_EQ(kvf_geometry_dcp(b, &wb, &rb), KVF_SUCCESS);
  EXPECT_EQ(wa, wb);
  EXPECT_EQ(ra, rb);
}

// to_json -> load_buffer (no options) -> equal geometry, and a second
// to_json gives the same bytes. Returns the reloaded geometry.
GeometryPtr RoundTrip(const kvf_geometry *g, bool generated_ok = false) {
  std::string first = ToJson(g);
  GeometryPtr back;
  EXPECT_EQ(Load(first, &back), KVF_SUCCESS) << kvf_last_error() << "\n" << first;
  if (!back) return back;
  ExpectSameGeometry(g, back.get(), generated_ok);
  EXPECT_EQ(ToJson(back.get()), first) << "the output must be stable";
  return back;
}

TEST(JsonWrite, EveryPresetRoundTrips) {
  std::vector<std::string> presets;
  std::error_code ec;
  for (const auto &entry : std::filesystem::directory_iterator(KVF_PRESET_DIR, ec))
    if (entry.path().extension() == ".json") presets.push_back(entry.path().string());
  if (presets.empty()) GTEST_SKIP() << "no presets in " KVF_PRESET_DIR;
  for (const std::string &path : presets) {
    for (uint32_t override_blocks : {0u, 37u}) {
      SCOPED_TRACE(path + " num_blocks_override " + std::to_string(override_blocks));
      kvf_geometry_load_options opt = KVF_GEOMETRY_LOAD_OPTIONS_INIT;
      opt.num_blocks_override = override_blocks;
      kvf_geometry *raw = nullptr;
      ASSERT_EQ(kvf_geometry_load_file(path.c_str(), &opt, &raw, nullptr), KVF_SUCCESS) << kvf_last_error();
      GeometryPtr g(raw);
      GeometryPtr back = RoundTrip(g.get());
      ASSERT_TRUE(back);
      kvf_group_info gi = KVF_GROUP_INFO_INIT;
      ASSERT_EQ(kvf_geometry_group(back.get(), 0, &gi), KVF_SUCCESS);
      if (override_blocks != 0) {
        EXPECT_EQ(gi.num_blocks, override_blocks) << "reloaded without the override";
      }
    }
  }
}

TEST(JsonWrite, LoaderFixturesRoundTrip) {
  for (const std::string *json : {&kSmall, &kHybrid}) {
    GeometryPtr g;
    ASSERT_EQ(Load(*json, &g), KVF_SUCCESS) << kvf_last_error();
    std::string text = ToJson(g.get());
    // The explicit form: no compact-form keys, one entry per view.
    for (const char *key : {"\"count\"", "\"region_step\"", "\"offset_step\"", "\"layer_step\""})
      EXPECT_EQ(text.find(key), std::string::npos) << key << " in " << text;
    RoundTrip(g.get());
  }
}

// A hybrid built in code: full attention with V narrower than K, a sliding
// window group aliasing full layer 0, a recurrent group with two states
// (block_size left at the builder's 16), DCP rank 1 of 2, a non-default
// policy, and text that JSON must escape.
TEST(JsonWrite, CodeBuiltGeometryRoundTrips) {
  kvf_geometry *raw = nullptr;
  ASSERT_EQ(kvf_geometry_create(&raw), KVF_SUCCESS);
  GeometryPtr g(raw);
  const uint32_t nb = 6, bs = 16, heads = 2;
  kvf_region_desc r = KVF_REGION_DESC_INIT;
  r.name = "kv[0]";  // a plain name that looks expanded
  r.align = 4096;
  ASSERT_EQ(kvf_geometry_add_region(g.get(), &r, nullptr), KVF_SUCCESS);
  r.name = "kv1";
  r.size = 1 << 20;  // larger than needed: kept as given
  r.align = 256;
  ASSERT_EQ(kvf_geometry_add_region(g.get(), &r, nullptr), KVF_SUCCESS);
  r.name = "ssm \"states\"";
  r.size = 0;
  ASSERT_EQ(kvf_geometry_add_region(g.get(), &r, nullptr), KVF_SUCCESS);

  kvf_group_desc gd = KVF_GROUP_DESC_INIT;
  gd.name = "full";
  gd.block_size = bs;
  gd.num_blocks = nb;
  ASSERT_EQ(kvf_geometry_add_group(g.get(), &gd, nullptr), KVF_SUCCESS);
  gd.name = "swa";
  gd.kind = KVF_GROUP_SLIDING_WINDOW;
  gd.window = 48;
  ASSERT_EQ(kvf_geometry_add_group(g.get(), &gd, nullptr), KVF_SUCCESS);
  gd = KVF_GROUP_DESC_INIT;
  gd.name = "mamba";
  gd.kind = KVF_GROUP_RECURRENT;
  gd.num_blocks = 3;
  ASSERT_EQ(kvf_geometry_add_group(g.get(), &gd, nullptr), KVF_SUCCESS);

  // FlashInfer-like [NB][P][BS][H][D] with K 192 bytes and V 128 bytes per head.
  kvf_view_desc v = KVF_VIEW_DESC_INIT;
  v.elem_bytes = 2;
  v.planes = 2;
  v.heads = heads;
  v.head_bytes[0] = 192;
  v.head_bytes[1] = 128;
  v.token_stride = heads * 192;
  v.head_stride = 192;
  v.plane_stride = bs * heads * 192;
  v.block_stride = 2 * bs * heads * 192;
  for (uint32_t region : {0u, 1u}) {
    v.region = region;
    v.name = region == 0 ? "attn.0" : "";  // one unnamed layer
    ASSERT_EQ(kvf_geometry_add_view(g.get(), 0, &v, nullptr), KVF_SUCCESS);
  }
  v.region = 0;
  v.name = "swa.0";
  v.alias_group = 0;
  v.alias_layer = 0;
  ASSERT_EQ(kvf_geometry_add_view(g.get(), 1, &v, nullptr), KVF_SUCCESS);
  // A second window layer: one plane (MLA-like), in region 1 after full layer 1's pages.
  kvf_view_desc m = KVF_VIEW_DESC_INIT;
  m.name = "swa.1";
  m.region = 1;
  m.elem_bytes = 2;
  m.planes = 1;
  m.heads = 1;
  m.head_bytes[0] = 576;
  m.token_stride = 576;
  m.block_stride = bs * 576;
  m.offset = nb * 2 * bs * heads * 192;
  ASSERT_EQ(kvf_geometry_add_view(g.get(), 1, &m, nullptr), KVF_SUCCESS);

  kvf_view_desc s = KVF_VIEW_DESC_INIT;
  s.name = "mamba.0";
  s.region = 2;
  s.elem_bytes = 4;
  s.block_stride = 8192;
  s.num_states = 2;
  s.states[0] = {0, 1024};
  s.states[1] = {2048, 4096};
  ASSERT_EQ(kvf_geometry_add_view(g.get(), 2, &s, nullptr), KVF_SUCCESS);
  s.name = "mamba.1";
  s.offset = 3 * 8192;
  ASSERT_EQ(kvf_geometry_add_view(g.get(), 2, &s, nullptr), KVF_SUCCESS);

  kvf_object_policy p = KVF_OBJECT_POLICY_INIT;
  p.chunk_tokens = 64;  // a multiple of block_size 16 * dcp world 2
  p.format = KVF_FORMAT_NATIVE;
  p.separate_windowed = 0;
  p.separate_recurrent = 1;
  ASSERT_EQ(kvf_geometry_set_policy(g.get(), &p), KVF_SUCCESS);
  ASSERT_EQ(kvf_geometry_set_dcp(g.get(), 2, 1), KVF_SUCCESS);
  ASSERT_EQ(kvf_geometry_set_name(g.get(), "built in code", "K/V \"planes\"\n\tcaf\xc3\xa9 \\ \xe2\x9c\x93"),
            KVF_SUCCESS);
  kvf_geometry_error err;
  ASSERT_EQ(kvf_geometry_finalize(g.get(), &err), KVF_SUCCESS) << err.message;

  // Preconditions of the comparison: the features under test are there.
  ASSERT_EQ(kvf_geometry_num_aliases(g.get()), 1u);
  ASSERT_EQ(kvf_geometry_num_object_groups(g.get()), 2u);
  kvf_group_info gi = KVF_GROUP_INFO_INIT;
  ASSERT_EQ(kvf_geometry_group(g.get(), 2, &gi), KVF_SUCCESS);
  ASSERT_EQ(gi.block_size, 16u) << "the builder keeps a recurrent group's block_size";

  GeometryPtr back = RoundTrip(g.get());
  ASSERT_TRUE(back);
  kvf_view_desc got = KVF_VIEW_DESC_INIT;
  ASSERT_EQ(kvf_geometry_view(back.get(), 0, 1, &got), KVF_SUCCESS);
  EXPECT_STREQ(got.name, "") << "an unnamed layer stays unnamed";
  kvf_region_info ri = KVF_REGION_INFO_INIT;
  ASSERT_EQ(kvf_geometry_region(back.get(), 1, &ri), KVF_SUCCESS);
  EXPECT_EQ(ri.size, 1u << 20);
}

// The loader requires geometry, region and group names: the writer makes
// them up where a geometry built in code has none, avoiding names in use.
TEST(JsonWrite, UnnamedEntriesGetGeneratedNames) {
  kvf_geometry *raw = nullptr;
  ASSERT_EQ(kvf_geometry_create(&raw), KVF_SUCCESS);
  GeometryPtr g(raw);
  kvf_region_desc r = KVF_REGION_DESC_INIT;
  ASSERT_EQ(kvf_geometry_add_region(g.get(), &r, nullptr), KVF_SUCCESS);  // unnamed region 0
  r.name = "region1";                                                       // taken from region 1's generated name
  ASSERT_EQ(kvf_geometry_add_region(g.get(), &r, nullptr), KVF_SUCCESS);
  r.name = nullptr;
  ASSERT_EQ(kvf_geometry_add_region(g.get(), &r, nullptr), KVF_SUCCESS);  // unnamed region 2
  kvf_group_desc gd = KVF_GROUP_DESC_INIT;
  gd.num_blocks = 4;
  ASSERT_EQ(kvf_geometry_add_group(g.get(), &gd, nullptr), KVF_SUCCESS);  // unnamed group 0
  gd.name = "group0";
  ASSERT_EQ(kvf_geometry_add_group(g.get(), &gd, nullptr), KVF_SUCCESS);
  kvf_view_desc v = KVF_VIEW_DESC_INIT;
  v.planes = 1;
  v.heads = 1;
  v.head_bytes[0] = 64;
  v.token_stride = 64;
  v.block_stride = 16 * 64;
  for (uint32_t region : {0u, 1u, 2u}) {
    v.region = region;
    v.alias_group = -1;
    ASSERT_EQ(kvf_geometry_add_view(g.get(), region == 2 ? 1 : 0, &v, nullptr), KVF_SUCCESS);
  }
  // Alias group 0 (unnamed) from group 1: the reference must use the generated name.
  v.region = 0;
  v.alias_group = 0;
  v.alias_layer = 0;
  ASSERT_EQ(kvf_geometry_add_view(g.get(), 1, &v, nullptr), KVF_SUCCESS);
  ASSERT_EQ(kvf_geometry_finalize(g.get(), nullptr), KVF_SUCCESS) << kvf_last_error();

  GeometryPtr back = RoundTrip(g.get(), /*generated_ok=*/true);
  ASSERT_TRUE(back);
  EXPECT_STREQ(kvf_geometry_name(back.get()), "geometry");
  kvf_region_info ri = KVF_REGION_INFO_INIT;
  ASSERT_EQ(kvf_geometry_region(back.get(), 0, &ri), KVF_SUCCESS);
  EXPECT_STREQ(ri.name, "region0");
  ASSERT_EQ(kvf_geometry_region(back.get(), 1, &ri), KVF_SUCCESS);
  EXPECT_STREQ(ri.name, "region1");
  ASSERT_EQ(kvf_geometry_region(back.get(), 2, &ri), KVF_SUCCESS);
  EXPECT_STREQ(ri.name, "region2");
  kvf_group_info gi = KVF_GROUP_INFO_INIT;
  ASSERT_EQ(kvf_geometry_group(back.get(), 0, &gi), KVF_SUCCESS);
  EXPECT_STREQ(gi.name, "group0_1") << "group0 is group 1's name";
  ASSERT_EQ(kvf_geometry_group(back.get(), 1, &gi), KVF_SUCCESS);
  EXPECT_STREQ(gi.name, "group0");
}

TEST(JsonWrite, ArgumentsAndState) {
  GeometryPtr g;
  ASSERT_EQ(Load(kSmall, &g), KVF_SUCCESS) << kvf_last_error();
  char *text = reinterpret_cast<char *>(0x1);  // must stay untouched on failure
  EXPECT_EQ(kvf_geometry_to_json(nullptr, &text, nullptr), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvf_last_error()).find("geometry is NULL"), std::string::npos) << kvf_last_error();
  EXPECT_EQ(kvf_geometry_to_json(g.get(), nullptr, nullptr), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvf_last_error()).find("json is NULL"), std::string::npos) << kvf_last_error();

  kvf_geometry *raw = nullptr;
  ASSERT_EQ(kvf_geometry_create(&raw), KVF_SUCCESS);
  GeometryPtr empty(raw);
  size_t len = 7;
  EXPECT_EQ(kvf_geometry_to_json(empty.get(), &text, &len), KVF_ERR_STATE);
  EXPECT_NE(std::string(kvf_last_error()).find("not finalized"), std::string::npos) << kvf_last_error();
  EXPECT_EQ(text, reinterpret_cast<char *>(0x1));
  EXPECT_EQ(len, 7u);

  // len may be NULL.
  text = nullptr;
  ASSERT_EQ(kvf_geometry_to_json(g.get(), &text, nullptr), KVF_SUCCESS) << kvf_last_error();
  ASSERT_NE(text, nullptr);
  EXPECT_EQ(std::string(text), ToJson(g.get()));
  free(text);
}

// Names and the description are C strings of any bytes; JSON text is UTF-8.
TEST(JsonWrite, RejectsTextThatIsNotUtf8) {
  struct Case {
    const char *name;
    const char *description;
    const char *field;
  } cases[] = {
      {"bad\xff", "", "name"},
      {"ok", "overlong \xc0\xaf", "description"},
      {"ok", "surrogate \xed\xa0\x80", "description"},
      {"ok", "cut \xe2\x9c", "description"},
      {"ok", "above U+10FFFF \xf4\x90\x80\x80", "description"},
  };
  for (const Case &c : cases) {
    SCOPED_TRACE(c.description);
    GeometryPtr g;
    ASSERT_EQ(Load(kSmall, &g), KVF_SUCCESS) << kvf_last_error();
    ASSERT_EQ(kvf_geometry_set_name(g.get(), c.name, c.description), KVF_SUCCESS);
    char *text = nullptr;
    EXPECT_EQ(kvf_geometry_to_json(g.get(), &text, nullptr), KVF_ERR_INVALID_ARGUMENT);
    EXPECT_EQ(text, nullptr);
    EXPECT_NE(std::string(kvf_last_error()).find(std::string(c.field) + ": not valid UTF-8"), std::string::npos)
        << kvf_last_error();
  }
  // Valid multi-byte text of every length passes.
  GeometryPtr g;
  ASSERT_EQ(Load(kSmall, &g), KVF_SUCCESS) << kvf_last_error();
  ASSERT_EQ(kvf_geometry_set_name(g.get(), "\xc3\xa9\xe2\x9c\x93\xf0\x9f\x9a\xa2", "\xf4\x8f\xbf\xbf"), KVF_SUCCESS);
  RoundTrip(g.get());
}

// A dimension with one element may have any stride; a file cannot hold one
// above 2^63-1, and the writer says which key instead of writing a negative.
TEST(JsonWrite, StrideBeyondFileIntegersIsOverflow) {
  kvf_geometry *raw = nullptr;
  ASSERT_EQ(kvf_geometry_create(&raw), KVF_SUCCESS);
  GeometryPtr g(raw);
  kvf_region_desc r = KVF_REGION_DESC_INIT;
  r.name = "kv";
  ASSERT_EQ(kvf_geometry_add_region(g.get(), &r, nullptr), KVF_SUCCESS);
  kvf_group_desc gd = KVF_GROUP_DESC_INIT;
  gd.name = "full";
  gd.num_blocks = 1;
  ASSERT_EQ(kvf_geometry_add_group(g.get(), &gd, nullptr), KVF_SUCCESS);
  kvf_view_desc v = KVF_VIEW_DESC_INIT;
  v.planes = 1;
  v.heads = 1;
  v.head_bytes[0] = 64;
  v.token_stride = 64;
  v.block_stride = UINT64_MAX - 1023;  // one block: never multiplied
  ASSERT_EQ(kvf_geometry_add_view(g.get(), 0, &v, nullptr), KVF_SUCCESS);
  ASSERT_EQ(kvf_geometry_finalize(g.get(), nullptr), KVF_SUCCESS) << kvf_last_error();
  char *text = nullptr;
  EXPECT_EQ(kvf_geometry_to_json(g.get(), &text, nullptr), KVF_ERR_OVERFLOW);
  EXPECT_EQ(text, nullptr);
  EXPECT_NE(std::string(kvf_last_error()).find("groups[0].layers[0].block_stride"), std::string::npos)
      << kvf_last_error();
}

// Readers share a finalized geometry: concurrent writers give the same text.
TEST(JsonWrite, ConcurrentCallsAgree) {
  GeometryPtr g;
  ASSERT_EQ(Load(kHybrid, &g), KVF_SUCCESS) << kvf_last_error();
  std::string expected = ToJson(g.get());
  std::vector<std::string> got(4);
  std::vector<std::thread> threads;
  for (size_t i = 0; i < got.size(); ++i)
    threads.emplace_back([&, i] {
      for (int k = 0; k < 20; ++k) {
        char *text = nullptr;
        if (kvf_geometry_to_json(g.get(), &text, nullptr) != KVF_SUCCESS) return;
        got[i] = text;
        free(text);
      }
    });
  for (auto &t : threads) t.join();
  for (const std::string &s : got) EXPECT_EQ(s, expected);
}

// Every jansson allocation the writer makes may fail: it then returns
// KVF_ERR_OUT_OF_MEMORY, leaves *json alone and frees what it built (the
// sanitizer build's leak check sees the rest).
size_t g_alloc_budget = SIZE_MAX;  // allocations left before they fail
void *FailingMalloc(size_t size) {
  if (g_alloc_budget == 0) return nullptr;
  --g_alloc_budget;
  return malloc(size);
}

TEST(JsonWrite, OutOfMemoryAtEveryAllocation) {
  GeometryPtr g;
  ASSERT_EQ(Load(kHybrid, &g), KVF_SUCCESS) << kvf_last_error();
  const std::string expected = ToJson(g.get());
  json_malloc_t saved_malloc;
  json_free_t saved_free;
  json_get_alloc_funcs(&saved_malloc, &saved_free);
  json_set_alloc_funcs(FailingMalloc, free);
  size_t failures = 0;
  kvf_status st = KVF_ERR_OUT_OF_MEMORY;
  for (size_t budget = 0; budget < 100000 && st == KVF_ERR_OUT_OF_MEMORY; ++budget) {
    g_alloc_budget = budget;
    char *text = reinterpret_cast<char *>(0x1);
    st = kvf_geometry_to_json(g.get(), &text, nullptr);
    if (st == KVF_ERR_OUT_OF_MEMORY) {
      ++failures;
      EXPECT_EQ(text, reinterpret_cast<char *>(0x1)) << "budget " << budget;
    } else if (st == KVF_SUCCESS) {
      EXPECT_EQ(std::string(text), expected);
      free(text);
    }
  }
  g_alloc_budget = SIZE_MAX;
  json_set_alloc_funcs(saved_malloc, saved_free);
  EXPECT_EQ(st, KVF_SUCCESS) << kvf_last_error();
  EXPECT_GT(failures, 50u) << "the writer should allocate through jansson for every node";
  RecordProperty("allocation_failures", std::to_string(failures));
}

}  // namespace
