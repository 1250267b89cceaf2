/* perf/bench_peers_plan.h - the host side of the peers' baselines
 * (bench_peers.h): the tables each design walks, built from kvferry's
 * planner, and a CPU walk of each design over them. kvf_runs_check runs the
 * CPU walks against the CPU reference for every preset, so a table that
 * would make a peer move the wrong bytes is caught without a GPU; the GPU
 * kernels (bench_peers.cu) walk the same tables the same way. Host only. */
#ifndef KVF_PERF_BENCH_PEERS_PLAN_H
#define KVF_PERF_BENCH_PEERS_PLAN_H

#include <cstdint>
#include <string>
#include <vector>

#include <kvferry/copy.h>

namespace kvfb {

/* One (layer, plane) of the request as the peers see it: heads unfused. */
struct PeerEntry {
  uint64_t src_token, src_head, dst_token, dst_head; /* bytes: cache side, object side */
  uint32_t heads, head_bytes, tokens, first_item;
};

/* One (layer, plane, block): the block's first row on both sides. */
struct PeerItem {
  char *cache;
  char *object;
  uint32_t valid; /* tokens the block moves */
  uint32_t entry;
};

/* SGLang's work item: one token of one group, every layer and plane. */
struct PeerTok {
  uint32_t e0, e1; /* the group's entries */
  uint32_t j, t;   /* block (index within each entry's items) and token in it */
};

struct PeerHostTables {
  bool gather = true;
  std::vector<PeerEntry> entries;
  std::vector<PeerItem> items; /* entry-major: entry e's are [first_item, first_item + count) */
  std::vector<PeerTok> toks;
  uint32_t align = 16;         /* largest unit every stride, row and pointer allows */
  uint32_t max_heads = 0;
};

/* Build the tables for `request` (pointers as the kernels will reach them).
 * Returns false with *why when the request is outside the designs. */
bool peer_tables(const kvf_geometry *g, const kvf_copy_request &request, bool gather, PeerHostTables *out,
                 std::string *why);

/* The units each design copies in: LMCache MP 16, 4 or 2 (0: none fits);
 * LMCache legacy and SGLang 8-byte words (narrower when a row needs it). */
int peer_mp_unit(const PeerHostTables &t);
int peer_word_unit(const PeerHostTables &t);

/* CPU walks of the designs over the tables, unit by unit as the kernels go:
 * "mp" per (item, head, token), "legacy" per (item, token), "sglang" per
 * token item over every entry of its group. */
void peer_walk_cpu(const PeerHostTables &t, const std::string &design);

} // namespace kvfb

#endif
