// Presets: every file in geometry/presets loads and finalizes, and for every
// preset family the CPU reference copies agree with the engine's own tensor
// indexing.
//
// The independent check builds each region as the engine would, addressing
// rows through the engine's logical shape and physical order (a row-major
// index over e.g. (2, NB, BS, H, D) for FlashAttention NHD), never through the
// view formula of the geometry. The expected canonical objects
// ([P][L][T][H][bytes], then recurrent states back to back) and their
// offsets are computed here too. Then:
//   gather:  filled cache -> poisoned objects; each object must equal the
//            expected one (moved rows hold the pattern, the rest poison);
//   scatter: expected objects -> a freshly poisoned cache; moved rows must
//            hold the pattern and every other byte (padding, other heads,
//            other blocks) must still hold the poison.
#include <gtest/gtest.h>

#include <kvferry/copy.h>
#include <kvferry/geometry.h>

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <initializer_list>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

namespace {

const char *const kAllPresets[] = {
    "llama-3.1-8b-fa-nhd",           "llama-3.1-8b-fa-hnd",
    "llama-3.1-8b-flashinfer-nhd",   "llama-3.1-8b-flashinfer-hnd",
    "llama-3.1-8b-crosslayer-fa-nhd", "llama-3.1-8b-crosslayer-fa-hnd",
    "deepseek-v3-mla-bf16",          "deepseek-v3-mla-fp8-656",
    "llama-3.1-8b-fp8-inline-scales", "gpt-oss-20b-like",
    "qwen3-next-like-hybrid",        "glm-like-hybrid",
    "llama-3.1-70b-tp4-rank2-slice", "deepseek-v3-mla-dcp4-rank1",
};

std::string preset_path(const std::string &name) { return std::string(KVF_PRESET_DIR) + "/" + name + ".json"; }

struct GeometryDeleter {
  void operator()(kvf_geometry *g) const { kvf_geometry_destroy(g); }
};
using GeometryPtr = std::unique_ptr<kvf_geometry, GeometryDeleter>;

kvf_status load(const std::string &name, uint32_t num_blocks, GeometryPtr *out, kvf_geometry_error *err) {
  kvf_geometry_load_options opts = KVF_GEOMETRY_LOAD_OPTIONS_INIT;
  opts.num_blocks_override = num_blocks;
  kvf_geometry *g = nullptr;
  *err = kvf_geometry_error{};
  kvf_status st = kvf_geometry_load_file(preset_path(name).c_str(), &opts, &g, err);
  out->reset(g);
  return st;
}

std::vector<std::string> preset_files() {
  std::vector<std::string> names;
  for (const auto &entry : std::filesystem::directory_iterator(KVF_PRESET_DIR))
    if (entry.path().extension() == ".json") names.push_back(entry.path().stem().string());
  std::sort(names.begin(), names.end());
  return names;
}

// ---- byte patterns -----------------------------------------------------------

uint64_t mix(uint64_t x) {  // splitmix64 finalizer
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Key of one engine row: (group, layer, plane, block, token, head). States
// use plane = 2 + state index and token = head = 0.
uint64_t row_key(uint32_t g, uint32_t l, uint32_t p, uint64_t b, uint32_t t, uint32_t h) {
  uint64_t k = mix(g + 1);
  k = mix(k ^ l);
  k = mix(k ^ p);
  k = mix(k ^ b);
  k = mix(k ^ t);
  return mix(k ^ h);
}

// Byte i of a row is byte (i mod 8) of mix(key + i/8), in memory order.
void write_pattern(uint8_t *dst, uint64_t key, uint64_t len) {
  for (uint64_t w = 0; w * 8 < len; w++) {
    uint64_t m = mix(key + w);
    std::memcpy(dst + w * 8, &m, std::min<uint64_t>(8, len - w * 8));
  }
}

// Background of a cache region: a function of (region, offset, salt), so a
// byte written where it should not be, or left where it should be
// overwritten, shows. Word-wise for speed under sanitizers.
uint64_t background_word(uint32_t region, uint64_t word, uint8_t salt) {
  return (word * 0x9E3779B97F4A7C15ull) ^ ((uint64_t)region * 0x632BE59BD9B4E019ull) ^
         (salt * 0x0101010101010101ull);
}
uint8_t background_byte(uint32_t region, uint64_t off, uint8_t salt) {
  uint64_t w = background_word(region, off >> 3, salt);
  uint8_t b[8];
  std::memcpy(b, &w, 8);
  return b[off & 7];
}

constexpr uint8_t kObjectPoison = 0xC3;
constexpr uint8_t kSourceSalt = 0x11;
constexpr uint8_t kDestSalt = 0x77;

// Row-major linear index of `idx` in a tensor of dims `shape` (outermost first).
uint64_t rm(std::initializer_list<uint64_t> shape, std::initializer_list<uint64_t> idx) {
  EXPECT_EQ(shape.size(), idx.size());
  uint64_t lin = 0;
  auto s = shape.begin();
  for (auto i = idx.begin(); i != idx.end(); ++i, ++s) {
    EXPECT_LT(*i, *s);
    lin = lin * *s + *i;
  }
  return lin;
}

// ---- the engine model of a preset ------------------------------------------

struct Loc {
  uint32_t region;
  uint64_t offset;
};

struct GroupModel {
  bool recurrent = false;
  uint32_t window = 0;  // sliding_window(W) when non-zero
  uint32_t object_group = 0;
  uint32_t layers = 0;
  uint32_t block_size = 1;
  uint32_t planes = 0, heads = 0;
  uint32_t row[2] = {0, 0};
  // Attention: start of the row (layer, plane, block, token, head) in the engine's tensor.
  std::function<Loc(uint32_t, uint32_t, uint64_t, uint32_t, uint32_t)> row_at;
  // Recurrent: state tensors of a layer and where state s of slot b starts.
  std::vector<uint64_t> state_bytes;
  std::function<Loc(uint32_t, uint32_t, uint64_t)> state_at;
};

struct Model {
  std::string preset;
  uint32_t num_blocks = 8;  // num_blocks_override the check loads with
  uint32_t dcp_world = 1, dcp_rank = 0;
  uint64_t chunk_tokens = 256;
  uint64_t token_begin = 0, token_end = 0;
  std::vector<uint64_t> region_bytes;  // the engine's allocation per region
  std::vector<GroupModel> groups;      // in the geometry's group order
  uint32_t object_groups = 1;
};

GroupModel attention(uint32_t layers, uint32_t bs, uint32_t planes, uint32_t heads, uint32_t row,
                     std::function<Loc(uint32_t, uint32_t, uint64_t, uint32_t, uint32_t)> at) {
  GroupModel g;
  g.layers = layers;
  g.block_size = bs;
  g.planes = planes;
  g.heads = heads;
  g.row[0] = row;
  g.row[1] = planes > 1 ? row : 0;
  g.row_at = std::move(at);
  return g;
}

void attention_range(Model &m) {  // one full chunk, then a partial one ending mid-block
  m.token_begin = m.chunk_tokens;
  m.token_end = m.token_begin + m.chunk_tokens + m.chunk_tokens / 2 + 3;
}

// Two full chunks, then a partial one: only full chunks carry a recurrent
// state, though every object reserves room for it.
void hybrid_range(Model &m) {
  m.token_begin = m.chunk_tokens;
  m.token_end = 3 * m.chunk_tokens + m.chunk_tokens / 2 + 3;
}

// Llama 3.1 8B per-layer tensors: FlashAttention (2, NB, BS, H, D) NHD or
// [2, NB, H, BS, D] HND; FlashInfer (NB, 2, BS, H, D) NHD or [NB, 2, H, BS, D] HND.
Model llama8b(const std::string &preset, bool flashinfer, bool hnd) {
  // FlashAttention puts K/V outermost: its planes are a whole pool of NB
  // blocks apart, NB being the override the check loads with.
  const uint64_t L = 32, H = 8, D = 128, BS = 16, E = 2, NB = 8;
  Model m;
  m.preset = preset;
  m.region_bytes.assign(L, 2 * NB * BS * H * D * E);
  m.groups.push_back(attention(L, BS, 2, H, D * E, [=](uint32_t l, uint32_t p, uint64_t b, uint32_t t, uint32_t h) {
    uint64_t i = !flashinfer ? (hnd ? rm({2, NB, H, BS, D}, {p, b, h, t, 0}) : rm({2, NB, BS, H, D}, {p, b, t, h, 0}))
                             : (hnd ? rm({NB, 2, H, BS, D}, {b, p, h, t, 0}) : rm({NB, 2, BS, H, D}, {b, p, t, h, 0}));
    return Loc{l, i * E};
  }));
  attention_range(m);
  return m;
}

// Cross-layer: FlashAttention NHD (NB, L, 2, BS, H, D), HND (NB, H, L, 2, BS, D), one region.
Model llama8b_crosslayer(const std::string &preset, bool hnd) {
  const uint64_t L = 32, H = 8, D = 128, BS = 16, E = 2, NB = 8;
  Model m;
  m.preset = preset;
  m.region_bytes.assign(1, NB * L * 2 * BS * H * D * E);
  m.groups.push_back(attention(L, BS, 2, H, D * E, [=](uint32_t l, uint32_t p, uint64_t b, uint32_t t, uint32_t h) {
    uint64_t i = hnd ? rm({NB, H, L, 2, BS, D}, {b, h, l, p, t, 0}) : rm({NB, L, 2, BS, H, D}, {b, l, p, t, h, 0});
    return Loc{0, i * E};
  }));
  attention_range(m);
  return m;
}

// DeepSeek V3 MLA: (NB, 64, row elements) per layer, one latent "head".
Model deepseek_mla(const std::string &preset, uint64_t row_elems, uint64_t elem, uint32_t dcp_world,
                   uint32_t dcp_rank) {
  const uint64_t L = 61, BS = 64, NB = 8;
  Model m;
  m.preset = preset;
  m.dcp_world = dcp_world;
  m.dcp_rank = dcp_rank;
  m.region_bytes.assign(L, NB * BS * row_elems * elem);
  m.groups.push_back(attention(L, BS, 1, 1, (uint32_t)(row_elems * elem),
                               [=](uint32_t l, uint32_t, uint64_t b, uint32_t t, uint32_t) {
                                 return Loc{l, rm({NB, BS, row_elems}, {b, t, 0}) * elem};
                               }));
  attention_range(m);
  return m;
}

// fp8 per-token-head quantisation: FlashAttention NHD (2, NB, BS, H, 132) uint8.
Model llama8b_fp8_inline() {
  const uint64_t L = 32, H = 8, R = 128 + 4, BS = 16, NB = 8;  // NB: see llama8b
  Model m;
  m.preset = "llama-3.1-8b-fp8-inline-scales";
  m.region_bytes.assign(L, 2 * NB * BS * H * R);
  m.groups.push_back(attention(L, BS, 2, H, (uint32_t)R, [=](uint32_t l, uint32_t p, uint64_t b, uint32_t t, uint32_t h) {
    return Loc{l, rm({2, NB, BS, H, R}, {p, b, t, h, 0})};
  }));
  attention_range(m);
  return m;
}

// Llama 3.1 70B, TP rank 2 of 4: heads 4-5 of a FlashInfer NHD (NB, 2, BS, 8, D) tensor.
Model llama70b_slice() {
  const uint64_t L = 80, H = 8, D = 128, BS = 16, E = 2, NB = 8, first = 4;
  Model m;
  m.preset = "llama-3.1-70b-tp4-rank2-slice";
  m.region_bytes.assign(L, NB * 2 * BS * H * D * E);
  m.groups.push_back(attention(L, BS, 2, 2, D * E, [=](uint32_t l, uint32_t p, uint64_t b, uint32_t t, uint32_t h) {
    return Loc{l, rm({NB, 2, BS, H, D}, {b, p, t, first + h, 0}) * E};
  }));
  attention_range(m);
  return m;
}

// gpt-oss-20b-like: 12 full + 12 sliding_window(128) layers; layer i of both
// groups in one FlashAttention NHD tensor (2, NB, 16, 8, 64).
Model gpt_oss() {
  const uint64_t L = 12, H = 8, D = 64, BS = 16, E = 2, NB = 8;  // NB: see llama8b
  Model m;
  m.preset = "gpt-oss-20b-like";
  m.region_bytes.assign(L, 2 * NB * BS * H * D * E);
  auto at = [=](uint32_t l, uint32_t p, uint64_t b, uint32_t t, uint32_t h) {
    return Loc{l, rm({2, NB, BS, H, D}, {p, b, t, h, 0}) * E};
  };
  m.groups.push_back(attention(L, BS, 2, H, D * E, at));
  m.groups.push_back(attention(L, BS, 2, H, D * E, at));
  m.groups[1].window = 128;
  m.groups[1].object_group = 1;  // separate_windowed
  m.object_groups = 2;
  attention_range(m);
  return m;
}

GroupModel recurrent(uint32_t layers, uint32_t object_group, uint64_t page, std::vector<uint64_t> states) {
  GroupModel g;
  g.recurrent = true;
  g.object_group = object_group;
  g.layers = layers;
  std::vector<uint64_t> starts;
  uint64_t pos = 0;
  for (uint64_t s : states) {
    starts.push_back(pos);  // vLLM lays a layer's state tensors back to back in its page
    pos += s;
  }
  g.state_bytes = std::move(states);
  g.state_at = [=](uint32_t l, uint32_t s, uint64_t slot) { return Loc{l, slot * page + starts[s]}; };
  return g;
}

// Qwen3-Next TP4 rank: per region a raw (NB, 278528-byte page) tensor; the
// full-attention layer views it as (NB, 2, 272, 1, 256) bf16, each linear
// layer as conv (3 x 2048 bf16) then ssm (8 x 128 x 128 bf16) per slot.
Model qwen3_next() {
  const uint64_t L = 12, BS = 272, H = 1, D = 256, E = 2, NB = 12, page = 278528;
  Model m;
  m.preset = "qwen3-next-like-hybrid";
  m.num_blocks = NB;  // 3 blocks for each of the 4 groups
  m.chunk_tokens = 544;
  m.region_bytes.assign(L, NB * page);
  m.groups.push_back(attention(L, BS, 2, H, D * E, [=](uint32_t l, uint32_t p, uint64_t b, uint32_t t, uint32_t h) {
    return Loc{l, rm({NB, 2, BS, H, D}, {b, p, t, h, 0}) * E};
  }));
  for (int j = 0; j < 3; j++) m.groups.push_back(recurrent(L, 0, page, {3 * 2048 * E, 8 * 128 * 128 * E}));
  hybrid_range(m);
  return m;
}

// glm-like-hybrid: per region a raw (NB, 40960-byte page) tensor; attention
// (full and sliding) fills [2, 16, 4, 128] bf16 of a page, the recurrent
// layer conv (3 x 1024 bf16) then ssm (4 x 64 x 64 bf16).
Model glm_like() {
  const uint64_t L = 8, BS = 16, H = 4, D = 128, E = 2, NB = 16, page = 40960;
  Model m;
  m.preset = "glm-like-hybrid";
  m.num_blocks = NB;
  m.region_bytes.assign(L, NB * page);
  auto at = [=](uint32_t l, uint32_t p, uint64_t b, uint32_t t, uint32_t h) {
    return Loc{l, b * page + rm({2, BS, H, D}, {p, t, h, 0}) * E};
  };
  m.groups.push_back(attention(L, BS, 2, H, D * E, at));
  m.groups.push_back(attention(L, BS, 2, H, D * E, at));
  m.groups[1].window = 512;
  m.groups[1].object_group = 1;
  m.groups.push_back(recurrent(L, 2, page, {3 * 1024 * E, 4 * 64 * 64 * E}));
  m.object_groups = 3;
  hybrid_range(m);
  return m;
}

std::vector<Model> all_models() {
  return {
      llama8b("llama-3.1-8b-fa-nhd", false, false),
      llama8b("llama-3.1-8b-fa-hnd", false, true),
      llama8b("llama-3.1-8b-flashinfer-nhd", true, false),
      llama8b("llama-3.1-8b-flashinfer-hnd", true, true),
      llama8b_crosslayer("llama-3.1-8b-crosslayer-fa-nhd", false),
      llama8b_crosslayer("llama-3.1-8b-crosslayer-fa-hnd", true),
      deepseek_mla("deepseek-v3-mla-bf16", 576, 2, 1, 0),
      deepseek_mla("deepseek-v3-mla-fp8-656", 656, 1, 1, 0),
      llama8b_fp8_inline(),
      gpt_oss(),
      qwen3_next(),
      glm_like(),
      llama70b_slice(),
      deepseek_mla("deepseek-v3-mla-dcp4-rank1", 576, 2, 4, 1),
  };
}

Model model_for(const std::string &preset) {
  for (Model &m : all_models())
    if (m.preset == preset) return m;
  ADD_FAILURE() << "no model for preset " << preset;
  return Model{};
}

// ---- buffers -----------------------------------------------------------------

struct Buffer {
  std::unique_ptr<uint8_t, decltype(&std::free)> mem{nullptr, &std::free};
  uint64_t size = 0;
  explicit Buffer(uint64_t n) : size(n) {
    uint64_t rounded = (n + 4095) / 4096 * 4096;
    mem.reset(static_cast<uint8_t *>(std::aligned_alloc(4096, rounded ? rounded : 4096)));
  }
  uint8_t *data() const { return mem.get(); }
};

void fill_background(Buffer &buf, uint32_t region, uint8_t salt) {
  uint8_t *d = buf.data();
  uint64_t words = buf.size / 8;
  for (uint64_t w = 0; w < words; w++) {
    uint64_t v = background_word(region, w, salt);
    std::memcpy(d + w * 8, &v, 8);
  }
  for (uint64_t o = words * 8; o < buf.size; o++) d[o] = background_byte(region, o, salt);
}

// ---- the check ---------------------------------------------------------------

// One run that moves: where it is in the cache and in which object.
struct MovedRun {
  uint32_t region;
  uint64_t cache_off;
  uint64_t object;  // chunk * object_groups + og
  uint64_t object_off;
  uint64_t len;
  uint64_t key;
  std::string what() const {
    return "region " + std::to_string(region) + " +" + std::to_string(cache_off) + ", object " +
           std::to_string(object) + " +" + std::to_string(object_off);
  }
};

struct Table {
  uint64_t first_block = 0;
  std::vector<uint32_t> ids;
};

class PresetFamily : public ::testing::TestWithParam<std::string> {};

// Compare a region after scatter: the moved runs (sorted, disjoint) hold the
// pattern; every other byte holds the destination background.
void verify_region(const Buffer &buf, uint32_t region, const std::vector<const MovedRun *> &runs) {
  int reported = 0;
  uint64_t pos = 0;
  const uint8_t *d = buf.data();
  auto check_background = [&](uint64_t from, uint64_t to) {
    uint64_t o = from;
    for (; o < to && (o & 7); o++)
      if (d[o] != background_byte(region, o, kDestSalt) && reported++ < 3)
        ADD_FAILURE() << "region " << region << " byte " << o << ": written, but no moved run covers it";
    for (; o + 8 <= to; o += 8) {
      uint64_t v, want = background_word(region, o >> 3, kDestSalt);
      std::memcpy(&v, d + o, 8);
      if (v != want && reported++ < 3)
        ADD_FAILURE() << "region " << region << " bytes " << o << "..+8: written, but no moved run covers them";
    }
    for (; o < to; o++)
      if (d[o] != background_byte(region, o, kDestSalt) && reported++ < 3)
        ADD_FAILURE() << "region " << region << " byte " << o << ": written, but no moved run covers it";
  };
  std::vector<uint8_t> want;
  for (const MovedRun *r : runs) {
    ASSERT_GE(r->cache_off, pos) << "model error: moved runs overlap at " << r->what();
    check_background(pos, r->cache_off);
    want.resize(r->len);
    write_pattern(want.data(), r->key, r->len);
    if (std::memcmp(d + r->cache_off, want.data(), r->len) != 0 && reported++ < 3)
      ADD_FAILURE() << "run " << r->what() << ": not scattered";
    pos = r->cache_off + r->len;
  }
  check_background(pos, buf.size);
}

TEST_P(PresetFamily, ReferenceCopiesMatchEngineIndexing) {
  const Model m = model_for(GetParam());
  ASSERT_FALSE(m.groups.empty());
  GeometryPtr geo;
  kvf_geometry_error err;
  ASSERT_EQ(load(m.preset, m.num_blocks, &geo, &err), KVF_SUCCESS) << err.message;
  kvf_geometry *g = geo.get();
  const uint32_t G = (uint32_t)m.groups.size();
  const uint64_t C = m.chunk_tokens, D = m.dcp_world, R = m.dcp_rank;

  // Shape of the geometry, against the model.
  ASSERT_EQ(kvf_geometry_num_regions(g), m.region_bytes.size());
  ASSERT_EQ(kvf_geometry_num_groups(g), G);
  ASSERT_EQ(kvf_geometry_num_object_groups(g), m.object_groups);
  kvf_object_policy pol = KVF_OBJECT_POLICY_INIT;
  ASSERT_EQ(kvf_geometry_policy(g, &pol), KVF_SUCCESS);
  ASSERT_EQ(pol.chunk_tokens, C);
  uint32_t world = 0, rank = 0;
  ASSERT_EQ(kvf_geometry_dcp(g, &world, &rank), KVF_SUCCESS);
  ASSERT_EQ(world, m.dcp_world);
  ASSERT_EQ(rank, m.dcp_rank);
  for (uint32_t gi = 0; gi < G; gi++) {
    kvf_group_info gin = KVF_GROUP_INFO_INIT;
    ASSERT_EQ(kvf_geometry_group(g, gi, &gin), KVF_SUCCESS);
    kvf_group_kind kind = m.groups[gi].recurrent ? KVF_GROUP_RECURRENT
                          : m.groups[gi].window ? KVF_GROUP_SLIDING_WINDOW
                                                : KVF_GROUP_FULL;
    ASSERT_EQ(gin.kind, kind) << "group " << gi;
    ASSERT_EQ(gin.window, m.groups[gi].window) << "group " << gi;
    ASSERT_EQ(gin.num_layers, m.groups[gi].layers) << "group " << gi;
    ASSERT_EQ(gin.num_blocks, m.num_blocks) << "group " << gi;
    ASSERT_EQ(gin.object_group, m.groups[gi].object_group) << "group " << gi;
    if (!m.groups[gi].recurrent) {
      ASSERT_EQ(gin.block_size, m.groups[gi].block_size) << "group " << gi;
    }
  }

  // Region sizes: the smallest size holding every row and state of every
  // addressable block, and within the engine's allocation.
  std::vector<uint64_t> need(m.region_bytes.size(), 0);
  for (const GroupModel &gm : m.groups)
    for (uint32_t l = 0; l < gm.layers; l++)
      for (uint64_t b = 0; b < m.num_blocks; b++) {
        if (gm.recurrent) {
          for (uint32_t s = 0; s < gm.state_bytes.size(); s++) {
            Loc at = gm.state_at(l, s, b);
            need[at.region] = std::max(need[at.region], at.offset + gm.state_bytes[s]);
          }
          continue;
        }
        for (uint32_t p = 0; p < gm.planes; p++)
          for (uint32_t t = 0; t < gm.block_size; t++)
            for (uint32_t h = 0; h < gm.heads; h++) {
              Loc at = gm.row_at(l, p, b, t, h);
              need[at.region] = std::max(need[at.region], at.offset + gm.row[p]);
            }
      }
  for (uint32_t r = 0; r < m.region_bytes.size(); r++) {
    kvf_region_info ri = KVF_REGION_INFO_INIT;
    ASSERT_EQ(kvf_geometry_region(g, r, &ri), KVF_SUCCESS);
    ASSERT_EQ(ri.size, need[r]) << "region " << r;
    ASSERT_LE(ri.size, m.region_bytes[r]) << "region " << r;
  }

  // Object layout per object group, computed here: planes outermost, then
  // the attention layers in registration order, tokens, heads; then every
  // recurrent layer's states back to back.
  std::vector<uint64_t> plane_bpt(2 * m.object_groups, 0), rec_bytes(m.object_groups, 0);
  for (const GroupModel &gm : m.groups)
    for (uint32_t l = 0; l < gm.layers; l++) {
      for (uint32_t p = 0; p < gm.planes; p++) plane_bpt[2 * gm.object_group + p] += (uint64_t)gm.heads * gm.row[p];
      for (uint64_t s : gm.state_bytes) rec_bytes[gm.object_group] += s;
    }
  for (uint32_t og = 0; og < m.object_groups; og++) {
    kvf_object_group_info oi = KVF_OBJECT_GROUP_INFO_INIT;
    ASSERT_EQ(kvf_geometry_object_group(g, og, &oi), KVF_SUCCESS);
    EXPECT_EQ(oi.bytes_per_token, plane_bpt[2 * og] + plane_bpt[2 * og + 1]) << "object group " << og;
    EXPECT_EQ(oi.recurrent_bytes, rec_bytes[og]) << "object group " << og;
  }
  // Offset of (group, layer, plane) / (group, layer, state) in an object of n tokens.
  auto attention_offset = [&](uint32_t gi, uint32_t l, uint32_t p, uint64_t n) {
    uint32_t og = m.groups[gi].object_group;
    uint64_t off = 0;
    for (uint32_t q = 0; q < p; q++) off += n * plane_bpt[2 * og + q];
    for (uint32_t gj = 0; gj <= gi; gj++) {
      const GroupModel &gm = m.groups[gj];
      if (gm.recurrent || gm.object_group != og || p >= gm.planes) continue;
      off += (uint64_t)(gj < gi ? gm.layers : l) * n * gm.heads * gm.row[p];
    }
    return off;
  };
  auto state_offset = [&](uint32_t gi, uint32_t l, uint32_t s, uint64_t n) {
    uint32_t og = m.groups[gi].object_group;
    uint64_t off = n * (plane_bpt[2 * og] + plane_bpt[2 * og + 1]);
    for (uint32_t gj = 0; gj <= gi; gj++) {
      const GroupModel &gm = m.groups[gj];
      if (!gm.recurrent || gm.object_group != og) continue;
      uint64_t layer_bytes = 0;
      for (uint64_t b : gm.state_bytes) layer_bytes += b;
      off += (uint64_t)(gj < gi ? gm.layers : l) * layer_bytes;
    }
    for (uint32_t q = 0; q < s; q++) off += m.groups[gi].state_bytes[q];
    return off;
  };

  // Random disjoint block ids per group (aliasing groups share tensors).
  std::mt19937 rng((uint32_t)std::hash<std::string>{}(m.preset));
  std::vector<uint32_t> pool(m.num_blocks);
  for (uint32_t i = 0; i < m.num_blocks; i++) pool[i] = i;
  std::shuffle(pool.begin(), pool.end(), rng);
  std::vector<std::vector<uint32_t>> owned(G);
  for (uint32_t i = 0; i < m.num_blocks; i++) owned[i < m.num_blocks / G * G ? i % G : 0].push_back(pool[i]);

  // The request: chunks of [token_begin, token_end); per group a table that
  // straddles the first chunk boundary, with one skipped entry.
  const uint64_t chunks = (m.token_end - m.token_begin + C - 1) / C;
  const uint64_t K0 = m.token_begin / C;
  std::vector<Table> tables(G);
  for (uint32_t gi = 0; gi < G; gi++) {
    const GroupModel &gm = m.groups[gi];
    Table &tb = tables[gi];
    tb.ids = owned[gi];
    uint64_t n = tb.ids.size();
    if (gm.recurrent) {
      // Local block k is the state at the end of chunk k; start one early
      // when the table is long enough to cover a block outside the request.
      tb.first_block = n >= chunks + 1 ? K0 - 1 : K0;
      continue;
    }
    uint64_t boundary = (m.token_begin + C) / D / gm.block_size;  // first local block of request chunk 1
    tb.first_block = boundary > n / 2 ? boundary - n / 2 : 0;
    if (n >= 3 && boundary + 1 - tb.first_block < n) tb.ids[boundary + 1 - tb.first_block] = KVF_BLOCK_SKIP;
  }
  auto block_of = [&](uint32_t gi, uint64_t local_block) -> uint32_t {
    const Table &tb = tables[gi];
    if (local_block < tb.first_block || local_block - tb.first_block >= tb.ids.size()) return KVF_BLOCK_SKIP;
    return tb.ids[local_block - tb.first_block];
  };

  // Expected objects and the runs that move, from the engine's indexing.
  const uint32_t OG = m.object_groups;
  std::vector<uint64_t> obj_size(chunks * OG);
  std::vector<Buffer> expected;
  std::vector<MovedRun> runs;
  uint64_t moved_tokens = 0, moved_states = 0;
  for (uint64_t k = 0; k < chunks; k++) {
    uint64_t cb = m.token_begin + k * C, ce = std::min(cb + C, m.token_end);
    std::vector<uint64_t> locals;  // this rank's tokens of the chunk, in order, as local tokens
    for (uint64_t t = cb; t < ce; t++)
      if (t % D == R) locals.push_back(t / D);
    const uint64_t n = locals.size();
    for (uint32_t og = 0; og < OG; og++) {
      // Recurrent state exists only at chunk boundaries: a partial chunk reserves none.
      uint64_t size = n * (plane_bpt[2 * og] + plane_bpt[2 * og + 1]) + (ce - cb == C ? rec_bytes[og] : 0);
      obj_size[k * OG + og] = size;
      uint64_t lib = 0;
      ASSERT_EQ(kvf_geometry_object_size(g, og, K0 + k, m.token_end, &lib), KVF_SUCCESS) << kvf_last_error();
      ASSERT_EQ(lib, size) << "object group " << og << " chunk " << k;
      expected.emplace_back(size);
      std::memset(expected.back().data(), kObjectPoison, size);
    }
    for (uint32_t gi = 0; gi < G; gi++) {
      const GroupModel &gm = m.groups[gi];
      const uint64_t obj = k * OG + gm.object_group;
      uint8_t *dst = expected[obj].data();
      if (gm.recurrent) {
        if ((K0 + k + 1) * C > m.token_end) continue;  // the chunk does not end inside the request
        uint32_t slot = block_of(gi, K0 + k);
        if (slot == KVF_BLOCK_SKIP) continue;
        moved_states++;
        for (uint32_t l = 0; l < gm.layers; l++)
          for (uint32_t s = 0; s < gm.state_bytes.size(); s++) {
            Loc at = gm.state_at(l, s, slot);
            MovedRun r{at.region, at.offset, obj, state_offset(gi, l, s, n), gm.state_bytes[s], row_key(gi, l, 2 + s, slot, 0, 0)};
            write_pattern(dst + r.object_off, r.key, r.len);
            runs.push_back(r);
          }
        continue;
      }
      for (uint64_t i = 0; i < n; i++) {
        uint32_t b = block_of(gi, locals[i] / gm.block_size);
        if (b == KVF_BLOCK_SKIP) continue;
        uint32_t t = (uint32_t)(locals[i] % gm.block_size);
        moved_tokens++;
        for (uint32_t p = 0; p < gm.planes; p++)
          for (uint32_t l = 0; l < gm.layers; l++)
            for (uint32_t h = 0; h < gm.heads; h++) {
              Loc at = gm.row_at(l, p, b, t, h);
              uint64_t off = attention_offset(gi, l, p, n) + (i * gm.heads + h) * gm.row[p];
              MovedRun r{at.region, at.offset, obj, off, gm.row[p], row_key(gi, l, p, b, t, h)};
              write_pattern(dst + off, r.key, r.len);
              runs.push_back(r);
            }
      }
    }
  }
  ASSERT_GT(moved_tokens, 0u) << "model error: the request moves no attention token";
  for (const GroupModel &gm : m.groups)
    if (gm.recurrent) {
      ASSERT_GT(moved_states, 0u) << "model error: the request moves no state";
    }

  // The library's segment offsets must agree with ours (n = tokens of chunk 0).
  {
    uint64_t n0 = 0;
    for (uint64_t t = m.token_begin; t < m.token_begin + C; t++) n0 += t % D == R;
    for (uint32_t gi = 0; gi < G; gi++)
      for (uint32_t l = 0; l < m.groups[gi].layers; l++) {
        uint64_t off = 0, len = 0;
        const GroupModel &gm = m.groups[gi];
        ASSERT_EQ(kvf_geometry_object_segment(g, KVF_FORMAT_CANONICAL, gi, l, 0, n0, &off, &len), KVF_SUCCESS);
        if (gm.recurrent) {
          EXPECT_EQ(off, state_offset(gi, l, 0, n0)) << "group " << gi << " layer " << l;
        } else {
          EXPECT_EQ(off, attention_offset(gi, l, 0, n0)) << "group " << gi << " layer " << l;
          EXPECT_EQ(len, n0 * gm.heads * gm.row[0]) << "group " << gi << " layer " << l;
        }
      }
  }

  // The engine's caches: background everywhere, then every row and state
  // of the blocks each group owns written through the engine's indexing.
  std::vector<Buffer> cache;
  for (uint32_t r = 0; r < m.region_bytes.size(); r++) {
    cache.emplace_back(m.region_bytes[r]);
    fill_background(cache.back(), r, kSourceSalt);
  }
  for (uint32_t gi = 0; gi < G; gi++) {
    const GroupModel &gm = m.groups[gi];
    for (uint32_t b : owned[gi])
      for (uint32_t l = 0; l < gm.layers; l++) {
        if (gm.recurrent) {
          for (uint32_t s = 0; s < gm.state_bytes.size(); s++) {
            Loc at = gm.state_at(l, s, b);
            ASSERT_LE(at.offset + gm.state_bytes[s], m.region_bytes[at.region]);
            write_pattern(cache[at.region].data() + at.offset, row_key(gi, l, 2 + s, b, 0, 0), gm.state_bytes[s]);
          }
          continue;
        }
        for (uint32_t p = 0; p < gm.planes; p++)
          for (uint32_t t = 0; t < gm.block_size; t++)
            for (uint32_t h = 0; h < gm.heads; h++) {
              Loc at = gm.row_at(l, p, b, t, h);
              ASSERT_LE(at.offset + gm.row[p], m.region_bytes[at.region]);
              write_pattern(cache[at.region].data() + at.offset, row_key(gi, l, p, b, t, h), gm.row[p]);
            }
      }
  }

  std::vector<void *> bases;
  for (Buffer &b : cache) bases.push_back(b.data());
  std::vector<kvf_group_blocks> gb(G);
  for (uint32_t gi = 0; gi < G; gi++)
    gb[gi] = kvf_group_blocks{tables[gi].ids.data(), tables[gi].first_block, (uint32_t)tables[gi].ids.size()};
  std::vector<Buffer> objects;
  std::vector<void *> object_ptrs;
  for (uint64_t i = 0; i < chunks * OG; i++) {
    objects.emplace_back(obj_size[i]);
    std::memset(objects.back().data(), kObjectPoison, obj_size[i]);
    object_ptrs.push_back(objects.back().data());
  }
  kvf_copy_request req = KVF_COPY_REQUEST_INIT;
  req.region_bases = bases.data();
  req.token_begin = m.token_begin;
  req.token_end = m.token_end;
  req.format = KVF_FORMAT_CANONICAL;
  req.groups = gb.data();
  req.objects = object_ptrs.data();
  ASSERT_EQ(kvf_copy_request_chunks(g, &req), chunks);

  // Gather.
  ASSERT_EQ(kvf_reference_gather(g, &req), KVF_SUCCESS) << kvf_last_error();
  for (uint64_t i = 0; i < chunks * OG; i++) {
    if (std::memcmp(objects[i].data(), expected[i].data(), obj_size[i]) == 0) continue;
    uint64_t o = 0;
    while (objects[i].data()[o] == expected[i].data()[o]) o++;
    std::string where = "poison (nothing moves there)";
    for (const MovedRun &r : runs)
      if (r.object == i && o >= r.object_off && o < r.object_off + r.len) where = "run from " + r.what();
    ADD_FAILURE() << "object " << i << " (chunk " << i / OG << ", object group " << i % OG << ") differs at byte " << o
                  << " of " << obj_size[i] << ": " << where;
  }

  // Scatter the expected objects into a freshly poisoned cache.
  for (uint32_t r = 0; r < cache.size(); r++) fill_background(cache[r], r, kDestSalt);
  for (uint64_t i = 0; i < chunks * OG; i++) object_ptrs[i] = expected[i].data();
  ASSERT_EQ(kvf_reference_scatter(g, &req), KVF_SUCCESS) << kvf_last_error();
  std::vector<std::vector<const MovedRun *>> by_region(cache.size());
  for (const MovedRun &r : runs) by_region[r.region].push_back(&r);
  for (uint32_t r = 0; r < cache.size(); r++) {
    auto &v = by_region[r];
    std::sort(v.begin(), v.end(), [](const MovedRun *a, const MovedRun *b) { return a->cache_off < b->cache_off; });
    verify_region(cache[r], r, v);
  }
}

std::vector<std::string> model_names() {
  std::vector<std::string> names;
  for (const Model &m : all_models()) names.push_back(m.preset);
  return names;
}

INSTANTIATE_TEST_SUITE_P(Presets, PresetFamily, ::testing::ValuesIn(model_names()),
                         [](const ::testing::TestParamInfo<std::string> &info) {
                           std::string s = info.param;
                           for (char &c : s)
                             if (!std::isalnum((unsigned char)c)) c = '_';
                           return s;
                         });

// ---- loading -------------------------------------------------------------------

TEST(Presets, EveryFileLoadsAndFinalizes) {
  std::vector<std::string> files = preset_files();
  ASSERT_FALSE(files.empty()) << "no presets in " << KVF_PRESET_DIR;
  for (const std::string &name : files) {
    for (uint32_t nb : {8u, 0u}) {
      GeometryPtr g;
      kvf_geometry_error err;
      ASSERT_EQ(load(name, nb, &g, &err), KVF_SUCCESS) << name << " (num_blocks_override " << nb << "): " << err.message;
      EXPECT_EQ(std::string(kvf_geometry_name(g.get())), name) << "the name must match the file name";
      EXPECT_GT(std::strlen(kvf_geometry_description(g.get())), 40u) << name << ": describe the model and layout";
      EXPECT_NE(kvf_geometry_fingerprint(g.get(), KVF_FORMAT_CANONICAL), 0u) << name;
      kvf_group_info gi = KVF_GROUP_INFO_INIT;
      ASSERT_EQ(kvf_geometry_group(g.get(), 0, &gi), KVF_SUCCESS);
      EXPECT_EQ(gi.num_blocks, nb ? nb : 32u) << name;
    }
  }
}

TEST(Presets, TheListedPresetsExistAndEveryFileHasAFamilyCheck) {
  std::set<std::string> files;
  for (const std::string &f : preset_files()) files.insert(f);
  for (const char *name : kAllPresets) EXPECT_TRUE(files.count(name)) << "missing preset " << name;
  std::set<std::string> checked;
  for (const Model &m : all_models()) checked.insert(m.preset);
  for (const std::string &f : files) EXPECT_TRUE(checked.count(f)) << f << ": no independent family check";
}

TEST(Presets, NhdAndHndOfOneModelShareTheCanonicalFingerprint) {
  // Canonical objects are portable between layouts of the same model.
  const char *same[] = {"llama-3.1-8b-fa-nhd", "llama-3.1-8b-fa-hnd", "llama-3.1-8b-flashinfer-nhd",
                        "llama-3.1-8b-flashinfer-hnd", "llama-3.1-8b-crosslayer-fa-nhd",
                        "llama-3.1-8b-crosslayer-fa-hnd"};
  uint64_t first = 0;
  for (const char *name : same) {
    GeometryPtr g;
    kvf_geometry_error err;
    ASSERT_EQ(load(name, 8, &g, &err), KVF_SUCCESS) << name << ": " << err.message;
    uint64_t fp = kvf_geometry_fingerprint(g.get(), KVF_FORMAT_CANONICAL);
    if (!first) first = fp;
    EXPECT_EQ(fp, first) << name;
  }
}

TEST(Presets, PlaneOuterLayoutsFollowTheBlockCount) {
  // FlashAttention's K/V-outermost tensors space K and V by the engine's
  // pool size: the presets say "num_blocks * block_stride", so any override
  // (here far above the file's 32 blocks) loads, with the planes a whole
  // pool apart and the regions sized for it.
  const uint32_t nb = 100;
  for (const char *name : {"llama-3.1-8b-fa-nhd", "llama-3.1-8b-fa-hnd", "llama-3.1-8b-fp8-inline-scales",
                           "gpt-oss-20b-like"}) {
    GeometryPtr g;
    kvf_geometry_error err;
    ASSERT_EQ(load(name, nb, &g, &err), KVF_SUCCESS) << name << ": " << err.message;
    for (uint32_t gi = 0; gi < kvf_geometry_num_groups(g.get()); gi++) {
      kvf_group_info info = KVF_GROUP_INFO_INIT;
      ASSERT_EQ(kvf_geometry_group(g.get(), gi, &info), KVF_SUCCESS);
      ASSERT_EQ(info.num_blocks, nb) << name;
      for (uint32_t l = 0; l < info.num_layers; l++) {
        kvf_view_desc v = KVF_VIEW_DESC_INIT;
        ASSERT_EQ(kvf_geometry_view(g.get(), gi, l, &v), KVF_SUCCESS) << name;
        ASSERT_EQ(v.planes, 2u) << name;
        EXPECT_EQ(v.plane_stride, (uint64_t)nb * v.block_stride) << name << " group " << gi << " layer " << l;
        kvf_region_info ri = KVF_REGION_INFO_INIT;
        ASSERT_EQ(kvf_geometry_region(g.get(), v.region, &ri), KVF_SUCCESS);
        EXPECT_EQ(ri.size, 2 * (uint64_t)nb * v.block_stride) << name << " region " << v.region;
      }
    }
    // And with the file's own block count.
    GeometryPtr own;
    ASSERT_EQ(load(name, 0, &own, &err), KVF_SUCCESS) << name << ": " << err.message;
    kvf_view_desc v = KVF_VIEW_DESC_INIT;
    ASSERT_EQ(kvf_geometry_view(own.get(), 0, 0, &v), KVF_SUCCESS) << name;
    EXPECT_EQ(v.plane_stride, 32u * v.block_stride) << name;
  }
}

}  // namespace
