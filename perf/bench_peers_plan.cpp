/* perf/bench_peers_plan.cpp - the peers' tables and CPU walks
 * (bench_peers_plan.h). */
#include "bench_peers_plan.h"

#include <algorithm>
#include <cstring>

#include "kernels/plan.h"

namespace kvfb {

static uint32_t align_of(uint64_t x) {
  uint32_t a = 16;
  while (a > 1 && x % a) a >>= 1;
  return a;
}

bool peer_tables(const kvf_geometry *g, const kvf_copy_request &r, bool gather, PeerHostTables *t, std::string *why) {
  *t = PeerHostTables();
  t->gather = gather;
  /* kvferry's planner gives each (layer, plane) segment's strides and each
   * block's base pointers; the designs then do their own walk. */
  kvf_plan plan;
  if (kvf_plan_build(g, r.format, &plan) != KVF_SUCCESS) {
    *why = std::string("plan: ") + kvf_last_error();
    return false;
  }
  std::vector<uint8_t> blob(kvf_blob_size(g, &plan, &r, nullptr) + 64);
  kvf_blob_build(g, &plan, &r, gather ? 1 : 0, nullptr, blob.data());
  const auto *h = reinterpret_cast<const kvf_blob_header *>(blob.data());
  const kvf_blob_entry *e = kvf_blob_entries(blob.data());
  /* Each entry's segment: its group and view say which layer and plane. */
  std::vector<uint32_t> seg_of(plan.num_segments);
  kvf_blob_entry_segments(g, &plan, &r, nullptr, seg_of.data());
  std::vector<kvf_segment> segs(h->num_entries);
  for (uint32_t i = 0; i < h->num_entries; i++) segs[i] = plan.segments[seg_of[i]];
  kvf_plan_free(&plan);
  uint64_t nb = kvf_blob_blocks(blob.data(), nullptr, 0);
  std::vector<kvf_blob_block> blocks(nb);
  kvf_blob_blocks(blob.data(), blocks.data(), nb);
  std::vector<uint32_t> group_of;
  for (uint32_t i = 0; i < h->num_entries; i++) {
    const kvf_segment &s = segs[i];
    if (s.recurrent) {
      *why = "recurrent state: outside the peers' designs (attention caches only)";
      return false;
    }
    /* Plane p of layer l: the view's head count and bytes (a group's
     * entries are its layers in order, each layer's planes together). */
    uint32_t first = i;
    while (first > 0 && segs[first - 1].group == s.group) first--;
    uint32_t layer = 0, plane = 0;
    for (uint32_t k = first + 1; k <= i; k++) layer += segs[k].view != segs[k - 1].view;
    for (uint32_t k = i; k > first && segs[k - 1].view == s.view; k--) plane++;
    kvf_view_desc d = KVF_VIEW_DESC_INIT;
    if (kvf_geometry_view(g, s.group, layer, &d) != KVF_SUCCESS) {
      *why = "geometry view lookup failed";
      return false;
    }
    PeerEntry de{};
    de.tokens = s.tokens;
    de.src_token = s.src_token;
    de.dst_token = s.dst_token;
    if (s.heads == 1 && d.heads > 1) { /* fused at plan time: heads contiguous on both sides */
      de.heads = d.heads;
      de.head_bytes = d.head_bytes[plane];
      de.src_head = de.dst_head = d.head_bytes[plane];
    } else {
      de.heads = s.heads;
      de.head_bytes = s.run;
      de.src_head = s.src_head;
      de.dst_head = s.dst_head;
    }
    t->max_heads = std::max(t->max_heads, de.heads);
    t->align = std::min(t->align, align_of(de.head_bytes | (de.tokens > 1 ? de.src_token | de.dst_token : 0) |
                                           (de.heads > 1 ? de.src_head | de.dst_head : 0)));
    t->entries.push_back(de);
    group_of.push_back(s.group);
  }
  std::vector<uint32_t> count(t->entries.size(), 0);
  for (const kvf_blob_block &b : blocks) count[b.entry]++;
  for (uint32_t i = 0, at = 0; i < t->entries.size(); i++) {
    t->entries[i].first_item = at;
    at += count[i];
  }
  for (const kvf_blob_block &b : blocks) {
    t->items.push_back(
        {b.cache, b.object, (uint32_t)(b.units / kvf_blob_shape_of(blob.data(), &e[b.entry])->units_per_token), b.entry});
    t->align = std::min(t->align, align_of((uint64_t)(uintptr_t)b.cache | (uint64_t)(uintptr_t)b.object));
  }
  /* SGLang's token items: a group's entries move the same blocks. */
  for (uint32_t i = 0; i < t->entries.size();) {
    uint32_t j = i;
    while (j < t->entries.size() && group_of[j] == group_of[i]) j++;
    for (uint32_t k = i; k < j; k++)
      if (count[k] != count[i]) {
        *why = "layers of one group move different blocks";
        return false;
      }
    for (uint32_t b = 0; b < count[i]; b++) {
      const PeerItem &it = t->items[t->entries[i].first_item + b];
      for (uint32_t tok = 0; tok < it.valid; tok++) t->toks.push_back({i, j, b, tok});
    }
    i = j;
  }
  return true;
}

int peer_mp_unit(const PeerHostTables &t) { return t.align >= 16 ? 16 : t.align >= 4 ? 4 : t.align >= 2 ? 2 : 0; }
int peer_word_unit(const PeerHostTables &t) { return std::min<int>(8, (int)t.align); }

static void copy_unit(const PeerHostTables &t, char *cache, char *object, int unit) {
  if (t.gather)
    memcpy(object, cache, unit);
  else
    memcpy(cache, object, unit);
}

void peer_walk_cpu(const PeerHostTables &t, const std::string &design) {
  if (design == "mp") {
    int u = peer_mp_unit(t);
    for (const PeerItem &it : t.items) {
      const PeerEntry &e = t.entries[it.entry];
      for (uint32_t h = 0; h < e.heads; h++)
        for (uint32_t tok = 0; tok < it.valid; tok++)
          for (uint32_t i = 0; i < e.head_bytes / u; i++)
            copy_unit(t, it.cache + tok * e.src_token + h * e.src_head + i * u,
                      it.object + tok * e.dst_token + h * e.dst_head + i * u, u);
    }
  } else if (design == "legacy") {
    int u = peer_word_unit(t);
    for (const PeerItem &it : t.items) {
      const PeerEntry &e = t.entries[it.entry];
      const uint32_t uph = e.head_bytes / u;
      for (uint32_t tok = 0; tok < it.valid; tok++)
        for (uint32_t i = 0; i < e.heads * uph; i++) {
          uint32_t h = i / uph, k = i - h * uph;
          copy_unit(t, it.cache + tok * e.src_token + h * e.src_head + k * u,
                    it.object + tok * e.dst_token + h * e.dst_head + k * u, u);
        }
    }
  } else {
    int u = peer_word_unit(t);
    for (const PeerTok &k : t.toks)
      for (uint32_t x = k.e0; x < k.e1; x++) {
        const PeerEntry &e = t.entries[x];
        const PeerItem &it = t.items[e.first_item + k.j];
        for (uint32_t h = 0; h < e.heads; h++)
          for (uint32_t i = 0; i < e.head_bytes / u; i++)
            copy_unit(t, it.cache + k.t * e.src_token + h * e.src_head + i * u,
                      it.object + k.t * e.dst_token + h * e.dst_head + i * u, u);
      }
  }
}

} // namespace kvfb
