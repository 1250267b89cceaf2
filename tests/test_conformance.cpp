// Conformance of the CPU reference copies: every preset x both directions x
// both formats, random block ids (with skipped "null" blocks and window-only
// retrieval), poisoned outputs. A gather then a scatter into a fresh cache
// must reproduce exactly the selected blocks' bytes and leave every other
// byte (padding, other blocks, other heads) untouched; a gather must write
// every object byte of a moved block and no byte of a skipped one.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <kvferry/copy.h>

#include "conformance_util.h"

namespace {

using kvf_test::GeometryPtr;
using kvf_test::load_preset;
using kvf_test::preset_names;

using kvf_test::Plan;

// Tokens of a request: one full chunk plus one attention "unit" (the least
// common multiple of block_size * dcp world), so the last object is partial
// but holds whole blocks (valid for both formats).
uint64_t request_tokens(const kvf_geometry *g) {
  kvf_object_policy pol = KVF_OBJECT_POLICY_INIT;
  kvf_geometry_policy(g, &pol);
  uint32_t world = 1;
  kvf_geometry_dcp(g, &world, nullptr);
  uint64_t unit = 1;
  for (uint32_t i = 0; i < kvf_geometry_num_groups(g); i++) {
    kvf_group_info gi = KVF_GROUP_INFO_INIT;
    kvf_geometry_group(g, i, &gi);
    if (gi.kind != KVF_GROUP_RECURRENT) unit = std::lcm(unit, (uint64_t)gi.block_size * world);
  }
  return pol.chunk_tokens + (unit < pol.chunk_tokens ? unit : 0);
}

// Blocks each group needs for [0, tokens): local blocks, or chunks for recurrent groups.
std::vector<uint64_t> blocks_needed(const kvf_geometry *g, uint64_t tokens) {
  kvf_object_policy pol = KVF_OBJECT_POLICY_INIT;
  kvf_geometry_policy(g, &pol);
  std::vector<uint64_t> need;
  for (uint32_t i = 0; i < kvf_geometry_num_groups(g); i++) {
    kvf_group_info gi = KVF_GROUP_INFO_INIT;
    kvf_geometry_group(g, i, &gi);
    if (gi.kind == KVF_GROUP_RECURRENT) {
      need.push_back((tokens + pol.chunk_tokens - 1) / pol.chunk_tokens);
    } else {
      uint64_t first, end;
      EXPECT_EQ(kvf_geometry_local_blocks(g, i, 0, tokens, &first, &end), KVF_SUCCESS);
      need.push_back(end);
    }
  }
  return need;
}

// Distinct block ids across all groups (aliasing groups share memory, so
// the engine never gives two of them one block), about one in eight skipped.
Plan make_plan(const kvf_geometry *g, uint64_t tokens, uint32_t num_blocks, std::mt19937_64 &rng, bool skips) {
  Plan plan;
  plan.token_end = tokens;
  std::vector<uint32_t> pool(num_blocks);
  for (uint32_t i = 0; i < num_blocks; i++) pool[i] = i;
  std::shuffle(pool.begin(), pool.end(), rng);
  size_t next = 0;
  for (uint64_t n : blocks_needed(g, tokens)) {
    std::vector<uint32_t> ids;
    for (uint64_t b = 0; b < n; b++) {
      uint32_t id = pool.at(next++);
      ids.push_back(skips && rng() % 8 == 0 ? KVF_BLOCK_SKIP : id);
    }
    if (!ids.empty() && std::all_of(ids.begin(), ids.end(), [](uint32_t x) { return x == KVF_BLOCK_SKIP; }))
      ids[0] = pool.at(next++);  // keep at least one block moving per group
    plan.ids.push_back(ids);
    plan.first_block.push_back(0);
  }
  return plan;
}

struct Case {
  std::string preset;
  kvf_object_format format;
};

void PrintTo(const Case &c, std::ostream *os) {
  *os << c.preset << "/" << kvf_object_format_name(c.format);
}

class Conformance : public ::testing::TestWithParam<Case> {};
class WindowConformance : public ::testing::TestWithParam<Case> {};

TEST_P(Conformance, GatherThenScatterReproducesSelectedBytesOnly) {
  const Case &c = GetParam();
  std::mt19937_64 rng(std::hash<std::string>{}(c.preset) ^ (uint64_t)c.format);

  // Size the pool from what one request needs, so every id is distinct.
  GeometryPtr probe = load_preset(c.preset, 4);
  ASSERT_TRUE(probe) << kvf_last_error();
  uint64_t tokens = request_tokens(probe.get());
  uint64_t total = 0;
  for (uint64_t n : blocks_needed(probe.get(), tokens)) total += n;
  uint32_t num_blocks = (uint32_t)(total + total / 4 + 2);
  GeometryPtr geo = load_preset(c.preset, num_blocks);
  ASSERT_TRUE(geo) << kvf_last_error();
  const kvf_geometry *g = geo.get();

  Plan plan = make_plan(g, tokens, num_blocks, rng, true);
  kvf_test::Cache source(g), restored(g);
  source.fill_random(rng);
  restored.fill_random(rng);
  kvf_test::Cache before = restored.clone();

  // Gather twice into objects poisoned differently: bytes that differ were
  // not written, and must be exactly the bytes of skipped blocks.
  kvf_test::Objects objects_a(g, plan.token_begin, plan.token_end), objects_b(g, plan.token_begin, plan.token_end);
  objects_a.fill(0x5A);
  objects_b.fill(0xA5);
  auto request = [&](kvf_test::Cache &cache, kvf_test::Objects &objects, const Plan &p) {
    return kvf_test::Request(g, cache, objects, p.token_begin, p.token_end, c.format, p.ids, p.first_block);
  };
  kvf_test::Request ga = request(source, objects_a, plan), gb = request(source, objects_b, plan);
  ASSERT_EQ(kvf_reference_gather(g, ga.get()), KVF_SUCCESS) << kvf_last_error();
  ASSERT_EQ(kvf_reference_gather(g, gb.get()), KVF_SUCCESS) << kvf_last_error();
  uint64_t unwritten = objects_a.count_differences(objects_b);
  uint64_t moved = kvf_test::payload_bytes(g, plan.token_begin, plan.token_end, plan.ids, plan.first_block);
  EXPECT_EQ(objects_a.total_bytes() - unwritten, moved) << "gather wrote a different number of bytes than it moves";

  // Scatter into the poisoned cache: selected runs equal the source, every
  // other byte keeps its poison.
  kvf_test::Request sa = request(restored, objects_a, plan);
  ASSERT_EQ(kvf_reference_scatter(g, sa.get()), KVF_SUCCESS) << kvf_last_error();
  kvf_test::Mask mask = kvf_test::selected_mask(g, plan.token_begin, plan.token_end, plan.ids, plan.first_block);
  EXPECT_EQ(mask.count(), moved);
  kvf_test::expect_restored(g, source, before, restored, mask);
}

TEST_P(WindowConformance, WindowOnlyRetrievalWritesOnlyTheRetainedBlocks) {
  const Case &c = GetParam();
  std::mt19937_64 rng(std::hash<std::string>{}(c.preset) * 31 + (uint64_t)c.format);
  GeometryPtr probe = load_preset(c.preset, 4);
  ASSERT_TRUE(probe) << kvf_last_error();
  // Grow the prefix by whole chunks until every windowed group drops blocks.
  kvf_object_policy pol = KVF_OBJECT_POLICY_INIT;
  kvf_geometry_policy(probe.get(), &pol);
  uint64_t tokens = request_tokens(probe.get());
  for (int grow = 0; grow < 64; grow++, tokens += pol.chunk_tokens) {
    bool all_trim = true;
    for (uint32_t i = 0; i < kvf_geometry_num_groups(probe.get()); i++) {
      kvf_group_info gi = KVF_GROUP_INFO_INIT;
      kvf_geometry_group(probe.get(), i, &gi);
      uint64_t first, end;
      if ((gi.kind == KVF_GROUP_SLIDING_WINDOW || gi.kind == KVF_GROUP_CHUNKED_LOCAL) &&
          kvf_geometry_retained_blocks(probe.get(), i, tokens, &first, &end) == KVF_SUCCESS && first == 0)
        all_trim = false;
    }
    if (all_trim) break;
  }
  uint64_t total = 0;
  for (uint64_t n : blocks_needed(probe.get(), tokens)) total += n;
  uint32_t num_blocks = (uint32_t)(total + 2);
  GeometryPtr geo = load_preset(c.preset, num_blocks);
  ASSERT_TRUE(geo);
  const kvf_geometry *g = geo.get();

  Plan full = make_plan(g, tokens, num_blocks, rng, false);
  kvf_test::Cache source(g), restored(g);
  source.fill_random(rng);
  restored.fill_random(rng);
  kvf_test::Cache before = restored.clone();
  kvf_test::Objects objects(g, full.token_begin, full.token_end);
  objects.fill(0x33);
  kvf_test::Request gather(g, source, objects, full.token_begin, full.token_end, c.format, full.ids, full.first_block);
  ASSERT_EQ(kvf_reference_gather(g, gather.get()), KVF_SUCCESS) << kvf_last_error();

  // Retrieve the prefix with each windowed group's table cut to its retained
  // window, as the engine's table holds null blocks before it.
  Plan window = full;
  bool any_window = false;
  for (uint32_t i = 0; i < kvf_geometry_num_groups(g); i++) {
    kvf_group_info gi = KVF_GROUP_INFO_INIT;
    kvf_geometry_group(g, i, &gi);
    if (gi.kind != KVF_GROUP_SLIDING_WINDOW && gi.kind != KVF_GROUP_CHUNKED_LOCAL) continue;
    uint64_t first, end;
    ASSERT_EQ(kvf_geometry_retained_blocks(g, i, full.token_end, &first, &end), KVF_SUCCESS);
    auto &ids = window.ids[i];
    ASSERT_LE(end, ids.size());
    ids.erase(ids.begin(), ids.begin() + (long)first);
    window.first_block[i] = first;
    any_window = any_window || first > 0;
  }
  kvf_test::Request scatter(g, restored, objects, window.token_begin, window.token_end, c.format, window.ids,
                            window.first_block);
  ASSERT_EQ(kvf_reference_scatter(g, scatter.get()), KVF_SUCCESS) << kvf_last_error();
  kvf_test::Mask mask = kvf_test::selected_mask(g, window.token_begin, window.token_end, window.ids, window.first_block);
  kvf_test::expect_restored(g, source, before, restored, mask);
  EXPECT_TRUE(any_window) << "no windowed group trims blocks at this prefix: the test would prove nothing";
}

std::vector<Case> all_cases() {
  std::vector<Case> cases;
  for (const std::string &name : preset_names())
    for (kvf_object_format f : {KVF_FORMAT_CANONICAL, KVF_FORMAT_NATIVE}) cases.push_back({name, f});
  return cases;
}

std::string case_name(const ::testing::TestParamInfo<Case> &info) {
  std::string n = info.param.preset + (info.param.format == KVF_FORMAT_CANONICAL ? "_canonical" : "_native");
  for (char &ch : n)
    if (!isalnum((unsigned char)ch)) ch = '_';
  return n;
}

// Presets with a sliding-window or chunked-local group.
std::vector<Case> windowed_cases() {
  std::vector<Case> cases;
  for (const Case &c : all_cases()) {
    GeometryPtr g = load_preset(c.preset, 4);
    if (!g) continue;  // reported by the main suite
    for (uint32_t i = 0; i < kvf_geometry_num_groups(g.get()); i++) {
      kvf_group_info gi = KVF_GROUP_INFO_INIT;
      kvf_geometry_group(g.get(), i, &gi);
      if (gi.kind == KVF_GROUP_SLIDING_WINDOW || gi.kind == KVF_GROUP_CHUNKED_LOCAL) {
        cases.push_back(c);
        break;
      }
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Presets, Conformance, ::testing::ValuesIn(all_cases()), case_name);
INSTANTIATE_TEST_SUITE_P(Presets, WindowConformance, ::testing::ValuesIn(windowed_cases()), case_name);
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(Conformance);
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(WindowConformance);

TEST(Conformance, PresetsArePresent) {
  EXPECT_GE(preset_names().size(), 14u) << "geometry/presets/ should hold every preset the foundation issue names";
}

}  // namespace
