// Test helpers shared by the conformance suites: presets, caches made of
// aligned host regions, objects, copy requests, and an independent map of
// the bytes a request selects (computed from the view formula, not from the
// object layout).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <kvferry/copy.h>

namespace kvf_test {

struct GeometryDeleter {
  void operator()(kvf_geometry *g) const { kvf_geometry_destroy(g); }
};
using GeometryPtr = std::unique_ptr<kvf_geometry, GeometryDeleter>;

inline std::string preset_path(const std::string &name) { return std::string(KVF_PRESET_DIR) + "/" + name + ".json"; }

inline std::vector<std::string> preset_names() {
  std::vector<std::string> names;
  std::error_code ec;
  for (const auto &e : std::filesystem::directory_iterator(KVF_PRESET_DIR, ec))
    if (e.path().extension() == ".json") names.push_back(e.path().stem().string());
  std::sort(names.begin(), names.end());
  return names;
}

inline GeometryPtr load_preset(const std::string &name, uint32_t num_blocks) {
  kvf_geometry_load_options opt = KVF_GEOMETRY_LOAD_OPTIONS_INIT;
  opt.num_blocks_override = num_blocks;
  kvf_geometry *g = nullptr;
  kvf_geometry_error err;
  if (kvf_geometry_load_file(preset_path(name).c_str(), &opt, &g, &err) != KVF_SUCCESS) return nullptr;
  return GeometryPtr(g);
}

struct Buffer {
  std::shared_ptr<uint8_t> data;
  size_t size = 0;
  static Buffer make(size_t size, size_t align) {
    Buffer b;
    size_t padded = (size + align - 1) / align * align;
    if (padded == 0) padded = align;
    b.data.reset(static_cast<uint8_t *>(std::aligned_alloc(align, padded)), std::free);
    b.size = size;
    return b;
  }
};

// A request's token range and block tables (entry i of ids[g] is local block
// first_block[g] + i of group g).
struct Plan {
  uint64_t token_begin = 0, token_end = 0;
  std::vector<std::vector<uint32_t>> ids;  // per group: the block table
  std::vector<uint64_t> first_block;       // per group
};

// A KV cache: one aligned host buffer per region.
struct Cache {
  std::vector<Buffer> regions;
  Cache() = default;
  explicit Cache(const kvf_geometry *g) {
    for (uint32_t r = 0; r < kvf_geometry_num_regions(g); r++) {
      kvf_region_info ri = KVF_REGION_INFO_INIT;
      kvf_geometry_region(g, r, &ri);
      regions.push_back(Buffer::make(ri.size, std::max<uint64_t>(ri.align, 64)));
    }
  }
  void fill_random(std::mt19937_64 &rng) {
    for (auto &r : regions) {
      size_t i = 0;
      for (; i + 8 <= r.size; i += 8) {
        uint64_t x = rng();
        std::memcpy(r.data.get() + i, &x, 8);
      }
      for (; i < r.size; i++) r.data.get()[i] = (uint8_t)rng();
    }
  }
  Cache clone() const {
    Cache c;
    for (const auto &r : regions) {
      Buffer b = Buffer::make(r.size, 256);
      std::memcpy(b.data.get(), r.data.get(), r.size);
      c.regions.push_back(b);
    }
    return c;
  }
  std::vector<void *> bases() const {
    std::vector<void *> v;
    for (const auto &r : regions) v.push_back(r.data.get());
    return v;
  }
};

// Objects of a request: chunk-major, then object group.
struct Objects {
  std::vector<std::vector<uint8_t>> buffers;
  uint32_t num_object_groups = 0;
  Objects(const kvf_geometry *g, uint64_t token_begin, uint64_t token_end) {
    kvf_object_policy pol = KVF_OBJECT_POLICY_INIT;
    kvf_geometry_policy(g, &pol);
    num_object_groups = kvf_geometry_num_object_groups(g);
    for (uint64_t b = token_begin; b < token_end; b += pol.chunk_tokens)
      for (uint32_t og = 0; og < num_object_groups; og++) {
        uint64_t size = 0;
        EXPECT_EQ(kvf_geometry_object_size(g, og, b / pol.chunk_tokens, token_end, &size), KVF_SUCCESS);
        buffers.emplace_back(size);
      }
  }
  void fill(uint8_t v) {
    for (auto &b : buffers) std::fill(b.begin(), b.end(), v);
  }
  uint64_t total_bytes() const {
    uint64_t n = 0;
    for (const auto &b : buffers) n += b.size();
    return n;
  }
  uint64_t count_differences(const Objects &o) const {
    uint64_t n = 0;
    for (size_t i = 0; i < buffers.size(); i++)
      for (size_t j = 0; j < buffers[i].size(); j++) n += buffers[i][j] != o.buffers[i][j];
    return n;
  }
  std::vector<void *> pointers() {
    std::vector<void *> v;
    for (auto &b : buffers) v.push_back(b.empty() ? nullptr : b.data());
    return v;
  }
};

// Owns everything a kvf_copy_request points at.
struct Request {
  std::vector<void *> bases, objects;
  std::vector<kvf_group_blocks> groups;
  std::vector<std::vector<uint32_t>> ids;
  kvf_copy_request req = KVF_COPY_REQUEST_INIT;
  Request(const kvf_geometry *, Cache &cache, Objects &objs, uint64_t token_begin, uint64_t token_end,
          kvf_object_format format, const std::vector<std::vector<uint32_t>> &block_ids,
          const std::vector<uint64_t> &first_block)
      : bases(cache.bases()), objects(objs.pointers()), ids(block_ids) {
    for (size_t i = 0; i < ids.size(); i++)
      groups.push_back({ids[i].empty() ? nullptr : ids[i].data(), first_block[i], (uint32_t)ids[i].size()});
    req.region_bases = bases.data();
    req.token_begin = token_begin;
    req.token_end = token_end;
    req.format = format;
    req.groups = groups.data();
    req.objects = objects.data();
  }
  Request(const Request &o) : bases(o.bases), objects(o.objects), groups(o.groups), ids(o.ids), req(o.req) { rebind(); }
  void rebind() {
    for (size_t i = 0; i < ids.size(); i++) groups[i].block_ids = ids[i].empty() ? nullptr : ids[i].data();
    req.region_bases = bases.data();
    req.groups = groups.data();
    req.objects = objects.data();
  }
  const kvf_copy_request *get() { return &req; }
};

// One flag per cache byte: does the request move it?
struct Mask {
  std::vector<std::vector<uint8_t>> regions;
  uint64_t marked_twice = 0;
  uint64_t count() const {
    uint64_t n = 0;
    for (const auto &r : regions) n += std::count(r.begin(), r.end(), 1);
    return n;
  }
  void mark(uint32_t region, uint64_t at, uint64_t len) {
    auto &r = regions.at(region);
    ASSERT_LE(at + len, r.size()) << "a selected run lies outside its region";
    for (uint64_t i = at; i < at + len; i++) {
      marked_twice += r[i] != 0;
      r[i] = 1;
    }
  }
};

// Walks every run the request selects, straight from the view formula.
template <typename F>
void for_each_selected_run(const kvf_geometry *g, uint64_t token_begin, uint64_t token_end,
                           const std::vector<std::vector<uint32_t>> &ids, const std::vector<uint64_t> &first_block,
                           F &&fn) {
  kvf_object_policy pol = KVF_OBJECT_POLICY_INIT;
  kvf_geometry_policy(g, &pol);
  auto block_for = [&](uint32_t gi, uint64_t lblock) -> uint32_t {
    if (lblock < first_block[gi] || lblock - first_block[gi] >= ids[gi].size()) return KVF_BLOCK_SKIP;
    return ids[gi][lblock - first_block[gi]];
  };
  for (uint32_t gi = 0; gi < kvf_geometry_num_groups(g); gi++) {
    kvf_group_info info = KVF_GROUP_INFO_INIT;
    kvf_geometry_group(g, gi, &info);
    for (uint32_t l = 0; l < info.num_layers; l++) {
      kvf_view_desc v = KVF_VIEW_DESC_INIT;
      kvf_geometry_view(g, gi, l, &v);
      if (info.kind == KVF_GROUP_RECURRENT) {
        for (uint64_t cb = token_begin; cb + pol.chunk_tokens <= token_end; cb += pol.chunk_tokens) {
          uint32_t id = block_for(gi, cb / pol.chunk_tokens);
          if (id == KVF_BLOCK_SKIP) continue;
          for (uint32_t s = 0; s < v.num_states; s++)
            fn(v.region, v.offset + (uint64_t)id * v.block_stride + v.states[s].offset, v.states[s].bytes);
        }
        continue;
      }
      uint64_t lb = kvf_geometry_local_tokens(g, token_begin), le = kvf_geometry_local_tokens(g, token_end);
      for (uint64_t lt = lb; lt < le; lt++) {
        uint32_t id = block_for(gi, lt / info.block_size);
        if (id == KVF_BLOCK_SKIP) continue;
        uint64_t t = lt % info.block_size;
        for (uint32_t p = 0; p < v.planes; p++)
          for (uint32_t h = 0; h < v.heads; h++)
            fn(v.region,
               v.offset + (uint64_t)id * v.block_stride + p * v.plane_stride + t * v.token_stride + h * v.head_stride,
               v.head_bytes[p]);
      }
    }
  }
}

inline uint64_t payload_bytes(const kvf_geometry *g, uint64_t tb, uint64_t te,
                              const std::vector<std::vector<uint32_t>> &ids, const std::vector<uint64_t> &first) {
  uint64_t n = 0;
  for_each_selected_run(g, tb, te, ids, first, [&](uint32_t, uint64_t, uint64_t len) { n += len; });
  return n;
}

inline Mask selected_mask(const kvf_geometry *g, uint64_t tb, uint64_t te,
                          const std::vector<std::vector<uint32_t>> &ids, const std::vector<uint64_t> &first) {
  Mask m;
  for (uint32_t r = 0; r < kvf_geometry_num_regions(g); r++) {
    kvf_region_info ri = KVF_REGION_INFO_INIT;
    kvf_geometry_region(g, r, &ri);
    m.regions.emplace_back(ri.size, 0);
  }
  for_each_selected_run(g, tb, te, ids, first, [&](uint32_t r, uint64_t at, uint64_t len) { m.mark(r, at, len); });
  EXPECT_EQ(m.marked_twice, 0u) << "two selected runs share bytes (aliasing groups given one block?)";
  return m;
}

// Selected bytes of `restored` equal `source`; all others equal `before`.
inline void expect_restored(const kvf_geometry *g, const Cache &source, const Cache &before, const Cache &restored,
                            const Mask &mask) {
  for (uint32_t r = 0; r < kvf_geometry_num_regions(g); r++) {
    const uint8_t *s = source.regions[r].data.get(), *b = before.regions[r].data.get(),
                  *x = restored.regions[r].data.get();
    uint64_t bad_selected = 0, bad_other = 0, first_bad = UINT64_MAX;
    for (size_t i = 0; i < source.regions[r].size; i++) {
      bool sel = mask.regions[r][i] != 0;
      bool ok = sel ? x[i] == s[i] : x[i] == b[i];
      if (!ok) {
        (sel ? bad_selected : bad_other)++;
        first_bad = std::min<uint64_t>(first_bad, i);
      }
    }
    EXPECT_EQ(bad_selected, 0u) << "region " << r << ": selected bytes not restored (first bad byte " << first_bad << ")";
    EXPECT_EQ(bad_other, 0u) << "region " << r << ": bytes outside the selection changed (first bad byte " << first_bad
                             << ")";
  }
}

}  // namespace kvf_test
