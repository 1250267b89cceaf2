/* kvferry: the command-line tool.
 *
 *   kvferry geometry check FILE...   validate geometry files and summarize them
 *   kvferry demo [options]           a store/retrieve round trip through kvferryd, every byte verified
 *   kvferry bench [ARGS...]          the transfer benchmark (execs perf/kvf_bench)
 *   kvferry topo                     NUMA nodes, cores and the per-GPU placement
 *   kvferry version
 *
 * Uses the public API only. */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <jansson.h>

#include <kvferry/kvferry.h>
#include <kvferry/topology.h>

#include "demo_util.h"

#ifdef KVF_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

#if defined(__GNUC__)
#define KVF_CLI_PRINTF(fmt, first) __attribute__((format(printf, fmt, first)))
#else
#define KVF_CLI_PRINTF(fmt, first)
#endif

#ifndef KVF_PRESET_DIR_BUILD
#define KVF_PRESET_DIR_BUILD ""
#endif
#ifndef KVF_PRESET_DIR_INSTALL
#define KVF_PRESET_DIR_INSTALL ""
#endif

static void usage(FILE *out) {
  fprintf(out,
          "usage: kvferry <command> [options]\n"
          "\n"
          "commands:\n"
          "  geometry check FILE...   validate geometry files (JSON, see docs/geometry.md) and print a\n"
          "                           summary of each: per group what one block of one layer holds\n"
          "                           (planes x tokens x heads x bytes, or the recurrent states) and\n"
          "                           where its stride goes (padding, K and V pools, cross-layer\n"
          "                           blocks, head slices), object sizes per object group, aliases.\n"
          "                           Exits 1 if any file is invalid.\n"
          "  demo [--preset NAME|FILE] [--tokens N] [--seed S] [--host] [--keep] [--in-process]\n"
          "                           the served round trip: start kvferryd, run one engine process per\n"
          "                           GPU (one on the host backend without a GPU, or with --host) on a\n"
          "                           preset geometry (default glm-like-hybrid), store a prefix of N\n"
          "                           tokens (default 32768) into the server's L1, restart each engine\n"
          "                           (its imports and aliases go to 0, L1 keeps the objects), register\n"
          "                           again with new block ids, retrieve the prefix (sliding-window\n"
          "                           groups restore their retained window, the recurrent group its\n"
          "                           state at the prefix's end), verify every byte and report. --keep\n"
          "                           keeps kvferryd's log. --in-process runs the same round trip through\n"
          "                           the transfer API in this process instead (GPU 0 or the host).\n"
          "  stat [--socket-dir DIR] [--json]\n"
          "                           a running kvferryd's counters: registrations by state,\n"
          "                           imports, aliases, leases, L1 objects and bytes, requests,\n"
          "                           and the same per connected client\n"
          "                           (DIR defaults to $KVF_SOCKET_DIR)\n"
          "  presets                  list the preset geometries\n"
          "  bench [ARGS...]          run the transfer benchmark (kvf_bench from perf/, built with\n"
          "                           -DKVF_BUILD_PERF=ON) with ARGS; 'kvferry bench --help' lists them\n"
          "  topo                     print the machine's NUMA nodes and cores, and where the cache\n"
          "                           server would place each GPU's threads and L1 memory (or that\n"
          "                           no GPU is visible, and why)\n"
          "  version                  print the library version\n"
          "\n"
          "Presets are looked up in $KVF_PRESET_DIR, then next to the build, then in the install prefix.\n");
}

/* ---- presets ------------------------------------------------------------- */

static int is_dir(const char *p) {
  struct stat st;
  return p && *p && stat(p, &st) == 0 && S_ISDIR(st.st_mode);
}

static const char *preset_dir(void) {
  const char *env = getenv("KVF_PRESET_DIR");
  if (is_dir(env)) return env;
  if (is_dir(KVF_PRESET_DIR_BUILD)) return KVF_PRESET_DIR_BUILD;
  if (is_dir(KVF_PRESET_DIR_INSTALL)) return KVF_PRESET_DIR_INSTALL;
  return NULL;
}

/* NAME (a preset) or a path to a file. */
static int resolve_geometry(const char *arg, char *path, size_t len) {
  struct stat st;
  if (strchr(arg, '/') || stat(arg, &st) == 0) {
    snprintf(path, len, "%s", arg);
    return 0;
  }
  const char *dir = preset_dir();
  if (!dir) {
    fprintf(stderr, "kvferry: preset '%s': no preset directory found (set KVF_PRESET_DIR)\n", arg);
    return -1;
  }
  snprintf(path, len, "%s/%s.json", dir, arg);
  return 0;
}

static int cmd_presets(void) {
  const char *dir = preset_dir();
  if (!dir) {
    fprintf(stderr, "kvferry: no preset directory found (set KVF_PRESET_DIR)\n");
    return 1;
  }
  char cmd[4200];
  snprintf(cmd, sizeof cmd, "ls -1 '%s' | sed -n 's/\\.json$//p'", dir);
  return system(cmd) == 0 ? 0 : 1;
}

/* ---- geometry check --------------------------------------------------------- */

/* Append printf-style text to buf (len bytes), cutting what does not fit. */
KVF_CLI_PRINTF(3, 4)
static void appendf(char *buf, size_t len, const char *fmt, ...) {
  size_t n = strlen(buf);
  if (n + 1 >= len) return;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf + n, len - n, fmt, ap);
  va_end(ap);
}

/* The first view of the alias class of (group, layer): aliases point back. */
static void alias_root(const kvf_geometry *g, uint32_t *group, uint32_t *layer) {
  for (;;) {
    kvf_view_desc v = KVF_VIEW_DESC_INIT;
    if (kvf_geometry_view(g, *group, *layer, &v) != KVF_SUCCESS || v.alias_group < 0) return;
    *group = (uint32_t)v.alias_group;
    *layer = (uint32_t)v.alias_layer;
  }
}

/* The payload one block stride of a view holds: the whole block, or its
 * larger plane when K and V are two pools (*planes_outside, may be NULL);
 * for a recurrent view, the slot's states. */
static uint64_t view_payload(const kvf_geometry *g, uint32_t group, const kvf_view_desc *v, int *planes_outside) {
  kvf_group_info gi = KVF_GROUP_INFO_INIT;
  kvf_geometry_group(g, group, &gi);
  if (gi.kind == KVF_GROUP_RECURRENT) {
    uint64_t sum = 0;
    for (uint32_t s = 0; s < v->num_states; s++) sum += v->states[s].bytes;
    if (planes_outside) *planes_outside = 0;
    return sum;
  }
  int outside = v->planes == 2 && v->block_stride != 0 && v->plane_stride >= v->block_stride;
  if (planes_outside) *planes_outside = outside;
  uint64_t row = (uint64_t)gi.block_size * v->heads;
  if (outside) return row * (v->head_bytes[0] > v->head_bytes[1] ? v->head_bytes[0] : v->head_bytes[1]);
  return row * ((uint64_t)v->head_bytes[0] + (v->planes > 1 ? v->head_bytes[1] : 0));
}

/* "no padding" or "padded by N bytes", for a stride of which `used` bytes are payload. */
static void append_padding(char *out, size_t len, uint64_t stride, uint64_t used) {
  if (used >= stride)
    appendf(out, len, "no padding");
  else
    appendf(out, len, "padded by %" PRIu64 " bytes", stride - used);
}

/* Where a block stride goes. K and V in two pools: the stride holds one
 * plane. Views of other layers (not aliases) in the same block of the same
 * region: a cross-layer layout. A gap between a view's heads: a head slice
 * (tensor parallelism). Otherwise padding, with the aliased view that
 * sized a shared page (a hybrid's attention page padded to the recurrent
 * slot, or back). */
static void describe_stride(const kvf_geometry *g, uint32_t gi, const kvf_view_desc *v, char *out, size_t len) {
  kvf_group_info info = KVF_GROUP_INFO_INIT;
  kvf_geometry_group(g, gi, &info);
  int outside = 0;
  uint64_t payload = view_payload(g, gi, v, &outside), bs = v->block_stride;
  appendf(out, len, "%s stride %" PRIu64, info.kind == KVF_GROUP_RECURRENT ? "slot" : "block", bs);
  if (outside) {
    appendf(out, len, " holds one plane, K and V are two pools, ");
    if ((uint64_t)info.num_blocks * bs == v->plane_stride)
      appendf(out, len, "num_blocks x block stride = %" PRIu64 " bytes apart", v->plane_stride);
    else
      appendf(out, len, "%" PRIu64 " bytes apart", v->plane_stride);
  }
  if (bs <= payload) {
    appendf(out, len, " (no padding)");
    return;
  }
  /* Other views in this block of the region: layers of one cross-layer tensor. */
  uint32_t rg = gi, rl = 0, n = 0, groups_seen = 0;
  uint64_t sum = 0;
  alias_root(g, &rg, &rl);
  for (uint32_t h = 0; h < kvf_geometry_num_groups(g); h++) {
    kvf_group_info hi = KVF_GROUP_INFO_INIT;
    kvf_geometry_group(g, h, &hi);
    uint32_t before = n;
    for (uint32_t l = 0; l < hi.num_layers; l++) {
      kvf_view_desc w = KVF_VIEW_DESC_INIT;
      uint32_t wg = h, wl = l;
      kvf_geometry_view(g, h, l, &w);
      alias_root(g, &wg, &wl);
      if (w.region != v->region || w.block_stride != bs || w.offset / bs != v->offset / bs) continue;
      if ((wg != rg || wl != rl) || (h == gi && l == 0)) {
        n++;
        sum += view_payload(g, h, &w, NULL);
      }
    }
    if (n > before) groups_seen++;
  }
  if (n > 1) {
    const char *what = info.kind == KVF_GROUP_RECURRENT ? "states" : v->planes == 2 ? "K and V" : "rows";
    if (n == info.num_layers && groups_seen == 1)
      appendf(out, len, ": the block holds every layer's %s (cross-layer: %u layers x %" PRIu64 " bytes, ", what, n,
          payload);
    else
      appendf(out, len, ": the block holds %u layers' %s (cross-layer: %" PRIu64 " bytes, ", n, what, sum);
    append_padding(out, len, bs, sum);
    appendf(out, len, ")");
    return;
  }
  /* A head slice: the stride of the dimension just outside the heads
   * leaves room for more heads of the same size than the view holds. With
   * one head, only a token row wider than the head is recognised. */
  if (info.kind != KVF_GROUP_RECURRENT) {
    uint64_t maxhb = v->head_bytes[0] > v->head_bytes[1] ? v->head_bytes[0] : v->head_bytes[1];
    uint64_t unit = v->heads > 1 ? v->head_stride : maxhb, span = maxhb;
    struct { const char *name; uint64_t count, stride; } d[3] = {
        {"token", info.block_size, v->token_stride},
        {"plane of a block", outside ? 1 : v->planes, v->plane_stride},
        {"block", 2, bs}};
    /* What the heads span: one head's own extent (the dimensions inside it) and the heads. */
    if (v->heads > 1)
      for (int i = 0; i < 2; i++)
        if (d[i].count > 1 && d[i].stride < unit) span += (d[i].count - 1) * d[i].stride;
    if (v->heads > 1) span += (uint64_t)(v->heads - 1) * unit;
    int next = -1;
    for (int i = 0; i < 3; i++) {
      if (d[i].count <= 1 || d[i].stride <= unit || (v->heads == 1 && i != 0)) continue;
      if (next < 0 || d[i].stride < d[next].stride) next = i;
    }
    if (next >= 0 && unit != 0 && d[next].stride > span && d[next].stride % unit == 0 &&
        d[next].stride / unit > v->heads && v->offset % unit == 0) {
      uint64_t room = d[next].stride / unit, first = (v->offset % d[next].stride) / unit;
      uint64_t full = payload / v->heads * room;
      appendf(out, len, ": each %s has room for %" PRIu64 " heads, this view holds heads %" PRIu64 "-%" PRIu64
          " (a head slice; ", d[next].name, room, first, first + v->heads - 1);
      append_padding(out, len, bs, full);
      appendf(out, len, ")");
      return;
    }
  }
  appendf(out, len, " (");
  append_padding(out, len, bs, payload);
  /* The aliased views sharing the page: the largest says what sized it. */
  uint64_t biggest = payload;
  uint32_t by = UINT32_MAX;
  for (uint32_t h = 0; h < kvf_geometry_num_groups(g); h++) {
    if (h == gi) continue;
    kvf_group_info hi = KVF_GROUP_INFO_INIT;
    kvf_geometry_group(g, h, &hi);
    for (uint32_t l = 0; l < hi.num_layers; l++) {
      kvf_view_desc w = KVF_VIEW_DESC_INIT;
      uint32_t wg = h, wl = l;
      kvf_geometry_view(g, h, l, &w);
      alias_root(g, &wg, &wl);
      if (wg != rg || wl != rl || w.region != v->region) continue;
      uint64_t p = view_payload(g, h, &w, NULL);
      if (p > biggest) biggest = p, by = h;
      break;
    }
  }
  if (by != UINT32_MAX) {
    kvf_group_info bi = KVF_GROUP_INFO_INIT;
    kvf_geometry_group(g, by, &bi);
    appendf(out, len, "; the page is shared with group '%s', whose %s is %" PRIu64 " bytes", bi.name,
        bi.kind == KVF_GROUP_RECURRENT ? "slot" : "block", biggest);
  }
  appendf(out, len, ")");
}

/* One group: what one block (slot) of one layer holds, in the tensor's
 * terms, and its stride. */
static void print_group(const kvf_geometry *g, uint32_t gi) {
  kvf_group_info info = KVF_GROUP_INFO_INIT;
  kvf_view_desc v = KVF_VIEW_DESC_INIT;
  char line[512] = "";
  kvf_geometry_group(g, gi, &info);
  kvf_geometry_view(g, gi, 0, &v);
  printf("    group %u '%s' (%s", gi, info.name, kvf_group_kind_name(info.kind));
  if (info.kind == KVF_GROUP_SLIDING_WINDOW) printf(" %u", info.window);
  if (info.kind == KVF_GROUP_CHUNKED_LOCAL) printf(" %u", info.chunk);
  if (info.kind == KVF_GROUP_RECURRENT)
    printf(", %u slots, %u layer%s", info.num_blocks, info.num_layers, info.num_layers == 1 ? "" : "s");
  else
    printf(", %u tokens/block, %u blocks, %u layer%s", info.block_size, info.num_blocks, info.num_layers,
           info.num_layers == 1 ? "" : "s");
  if (v.alias_group >= 0) {
    kvf_group_info ai = KVF_GROUP_INFO_INIT;
    kvf_geometry_group(g, (uint32_t)v.alias_group, &ai);
    printf(", sharing the tensors of group '%s'", ai.name);
  }
  printf("):\n");
  uint64_t payload = view_payload(g, gi, &v, NULL);
  if (info.kind == KVF_GROUP_RECURRENT) {
    appendf(line, sizeof line, "one slot of one layer = %u state%s (", v.num_states, v.num_states == 1 ? "" : "s");
    for (uint32_t s = 0; s < v.num_states; s++)
      appendf(line, sizeof line, "%s%" PRIu64, s ? " + " : "", v.states[s].bytes);
    appendf(line, sizeof line, " bytes) = %" PRIu64 " bytes; ", payload);
  } else {
    appendf(line, sizeof line, "one block of one layer = ");
    if (v.planes == 2 && v.head_bytes[0] != v.head_bytes[1])
      appendf(line, sizeof line, "%u tokens x %u head%s x (K %u + V %u bytes)", info.block_size, v.heads,
          v.heads == 1 ? "" : "s", v.head_bytes[0], v.head_bytes[1]);
    else {
      appendf(line, sizeof line, "%u plane%s x %u tokens x %u head%s x %u bytes", v.planes, v.planes == 1 ? "" : "s",
          info.block_size, v.heads, v.heads == 1 ? "" : "s", v.head_bytes[0]);
      if (v.elem_bytes > 1) appendf(line, sizeof line, " (%u elements)", v.head_bytes[0] / v.elem_bytes);
    }
    appendf(line, sizeof line, " = %" PRIu64 " bytes; ",
        (uint64_t)info.block_size * v.heads * ((uint64_t)v.head_bytes[0] + (v.planes > 1 ? v.head_bytes[1] : 0)));
  }
  describe_stride(g, gi, &v, line, sizeof line);
  /* Layer 0 speaks for the group when every layer has its shape. */
  for (uint32_t l = 1; l < info.num_layers; l++) {
    kvf_view_desc w = KVF_VIEW_DESC_INIT;
    kvf_geometry_view(g, gi, l, &w);
    if (w.planes != v.planes || w.heads != v.heads || w.head_bytes[0] != v.head_bytes[0] ||
        w.head_bytes[1] != v.head_bytes[1] || w.block_stride != v.block_stride || w.plane_stride != v.plane_stride ||
        w.token_stride != v.token_stride || w.head_stride != v.head_stride || w.num_states != v.num_states ||
        (w.num_states && memcmp(w.states, v.states, w.num_states * sizeof w.states[0]) != 0)) {
      appendf(line, sizeof line, "; this is layer 0, layer %u differs", l);
      break;
    }
  }
  printf("      %s\n", line);
}

static void print_summary(const char *path, const kvf_geometry *g) {
  kvf_object_policy pol = KVF_OBJECT_POLICY_INIT;
  uint32_t world, rank;
  char a[32], b[32];
  kvf_geometry_policy(g, &pol);
  kvf_geometry_dcp(g, &world, &rank);
  printf("%s: ok\n", path);
  printf("  name: %s\n", kvf_geometry_name(g));
  uint32_t ng = kvf_geometry_num_groups(g), nr = kvf_geometry_num_regions(g);
  uint64_t region_bytes = 0;
  for (uint32_t r = 0; r < nr; r++) {
    kvf_region_info ri = KVF_REGION_INFO_INIT;
    kvf_geometry_region(g, r, &ri);
    region_bytes += ri.size;
  }
  human(region_bytes, a, sizeof a);
  printf("  regions: %u (%s in all)   aliases: %u declared\n", nr, a, kvf_geometry_num_aliases(g));
  if (world > 1) printf("  decode-context parallel: rank %u of %u (tokens t with t mod %u == %u)\n", rank, world, world, rank);
  printf("  groups: %u\n", ng);
  for (uint32_t i = 0; i < ng; i++) print_group(g, i);
  printf("  objects: %u tokens per chunk, %s format, fingerprint canonical %016" PRIx64 " native %016" PRIx64 "\n",
         pol.chunk_tokens, kvf_object_format_name(pol.format), kvf_geometry_fingerprint(g, KVF_FORMAT_CANONICAL),
         kvf_geometry_fingerprint(g, KVF_FORMAT_NATIVE));
  for (uint32_t o = 0; o < kvf_geometry_num_object_groups(g); o++) {
    kvf_object_group_info oi = KVF_OBJECT_GROUP_INFO_INIT;
    kvf_geometry_object_group(g, o, &oi);
    uint64_t size = 0;
    kvf_geometry_object_size(g, o, 0, pol.chunk_tokens, &size);
    human(size, a, sizeof a);
    human(oi.bytes_per_token, b, sizeof b);
    printf("    object group %u: groups", o);
    for (uint32_t k = 0; k < oi.num_groups; k++) printf(" %u", oi.groups[k]);
    printf("; %s per full chunk (%s per token", a, b);
    if (oi.has_recurrent) printf(" + %" PRIu64 " B of recurrent state", oi.recurrent_bytes);
    printf(")\n");
  }
}

static int cmd_geometry_check(int argc, char **argv) {
  if (argc < 1) {
    fprintf(stderr, "kvferry geometry check: name at least one FILE\n");
    return 2;
  }
  int bad = 0;
  for (int i = 0; i < argc; i++) {
    char path[4096];
    if (resolve_geometry(argv[i], path, sizeof path)) {
      bad = 1;
      continue;
    }
    kvf_geometry *g = NULL;
    kvf_geometry_error err;
    kvf_status st = kvf_geometry_load_file(path, NULL, &g, &err);
    if (st) {
      /* The loader's messages start with the path already. */
      const char *msg = kvf_last_error();
      size_t n = strlen(path);
      if (strncmp(msg, path, n) == 0 && msg[n] == ':' && msg[n + 1] == ' ') msg += n + 2;
      printf("%s: error: %s: %s\n", path, kvf_status_string(st), msg);
      bad = 1;
      continue;
    }
    print_summary(path, g);
    kvf_geometry_destroy(g);
  }
  return bad;
}

/* ---- demo -------------------------------------------------------------------- */

typedef struct demo_objects {
  uint64_t count; /* slots: chunks x object groups */
  uint64_t used;  /* objects allocated */
  int pinned;     /* cudaHostAlloc'd (GPU runs), else malloc'd */
  void **ptr;
  uint64_t bytes;
} demo_objects;

static void objects_free(demo_objects *o) {
  for (uint64_t i = 0; o->ptr && i < o->count; i++) {
#ifdef KVF_WITH_CUDA
    if (o->pinned) {
      cudaFreeHost(o->ptr[i]);
      continue;
    }
#endif
    free(o->ptr[i]);
  }
  free(o->ptr);
  memset(o, 0, sizeof *o);
}

/* Does chunk k move a block of any group of object group og? */
static int chunk_needs_object(const kvf_geometry *g, const demo_tables *t, uint64_t k, uint32_t og, uint64_t tokens) {
  kvf_object_policy pol = KVF_OBJECT_POLICY_INIT;
  kvf_geometry_policy(g, &pol);
  uint64_t cb = k * pol.chunk_tokens, ce = cb + pol.chunk_tokens < tokens ? cb + pol.chunk_tokens : tokens;
  for (uint32_t gi = 0; gi < t->num_groups; gi++) {
    kvf_group_info info = KVF_GROUP_INFO_INIT;
    kvf_geometry_group(g, gi, &info);
    if (info.object_group != og || t->count[gi] == 0) continue;
    uint64_t first = t->first[gi], end = first + t->count[gi], lo, hi;
    if (info.kind == KVF_GROUP_RECURRENT) {
      lo = k;
      hi = k + 1;
    } else {
      kvf_geometry_local_blocks(g, gi, cb, ce, &lo, &hi);
    }
    if (lo < end && first < hi) return 1;
  }
  return 0;
}

/* Objects for the (chunk, object group) pairs the store's tables touch. */
static int objects_make(const kvf_geometry *g, uint64_t tokens, const demo_tables *t, demo_objects *o) {
  kvf_object_policy pol = KVF_OBJECT_POLICY_INIT;
  kvf_geometry_policy(g, &pol);
  uint64_t chunks = (tokens + pol.chunk_tokens - 1) / pol.chunk_tokens;
  uint32_t nog = kvf_geometry_num_object_groups(g);
  o->count = chunks * nog;
  o->ptr = calloc(o->count, sizeof *o->ptr);
  if (!o->ptr) return -1;
  for (uint64_t k = 0; k < chunks; k++)
    for (uint32_t og = 0; og < nog; og++) {
      uint64_t size;
      if (!chunk_needs_object(g, t, k, og, tokens)) continue;
      if (kvf_geometry_object_size(g, og, k, tokens, &size)) return -1;
#ifdef KVF_WITH_CUDA
      if (o->pinned) {
        if (cudaHostAlloc(&o->ptr[k * nog + og], size ? size : 1, cudaHostAllocDefault) != cudaSuccess) return -1;
      } else
#endif
      if (!(o->ptr[k * nog + og] = malloc(size ? size : 1))) return -1;
      memset(o->ptr[k * nog + og], 0xA5, size);
      o->bytes += size;
      o->used++;
    }
  return 0;
}

/* Move the prefix a few chunks per call so progress can be shown; on a GPU
 * each call is one kernel launch on `stream`, timed with the wall clock
 * around the synchronizations. Returns the seconds spent in the transfers. */
static kvf_status run_chunks(const kvf_geometry *g, kvf_xfer *x, void *stream, int scatter, uint64_t tokens,
                             demo_cache *cache, const demo_tables *t, demo_objects *o, const char *what,
                             double *seconds) {
  kvf_object_policy pol = KVF_OBJECT_POLICY_INIT;
  kvf_geometry_policy(g, &pol);
  uint64_t chunks = (tokens + pol.chunk_tokens - 1) / pol.chunk_tokens, per_call = chunks / 16 ? chunks / 16 : 1;
  uint32_t nog = kvf_geometry_num_object_groups(g);
  kvf_group_blocks *gb = calloc(t->num_groups, sizeof *gb);
  if (!gb) return KVF_ERR_OUT_OF_MEMORY;
  for (uint32_t i = 0; i < t->num_groups; i++) gb[i] = (kvf_group_blocks){t->ids[i], t->first[i], t->count[i]};
  int shown = -1, tty = isatty(STDERR_FILENO);
  kvf_status st = KVF_SUCCESS;
  *seconds = 0;
  for (uint64_t k = 0; k < chunks && !st; k += per_call) {
    kvf_copy_request req = KVF_COPY_REQUEST_INIT;
    req.region_bases = cache->device ? cache->device : cache->bases;
    req.token_begin = k * pol.chunk_tokens;
    req.token_end = (k + per_call) * pol.chunk_tokens < tokens ? (k + per_call) * pol.chunk_tokens : tokens;
    req.format = pol.format;
    req.groups = gb;
    req.objects = o->ptr + k * nog;
    double t0 = now_s();
    st = scatter ? kvf_xfer_scatter(x, &req, stream) : kvf_xfer_gather(x, &req, stream);
#ifdef KVF_WITH_CUDA
    if (!st && cache->device && cudaStreamSynchronize(stream) != cudaSuccess) st = KVF_ERR_CUDA;
#endif
    *seconds += now_s() - t0;
    uint64_t done = k + per_call < chunks ? k + per_call : chunks;
    int pct = (int)(100 * done / chunks);
    if (pct / 10 != shown / 10 || done == chunks) {
      /* One line rewritten on a terminal, one line per step in a log. */
      fprintf(stderr, "%s  %s: chunk %" PRIu64 "/%" PRIu64 " (%d%%)%s", tty ? "\r" : "", what, done, chunks, pct,
              tty ? "" : "\n");
      shown = pct;
    }
  }
  if (tty) fprintf(stderr, "\n");
  free(gb);
  return st;
}

static int cmd_demo(int argc, char **argv) {
  const char *preset = "glm-like-hybrid";
  uint64_t tokens = 32768, seed = 20261129;
  int force_host = 0;
  for (int i = 0; i < argc; i++) {
    if (!strcmp(argv[i], "--preset") && i + 1 < argc) {
      preset = argv[++i];
    } else if (!strcmp(argv[i], "--tokens") && i + 1 < argc) {
      tokens = strtoull(argv[++i], NULL, 10);
    } else if (!strcmp(argv[i], "--host")) {
      force_host = 1;
    } else if (!strcmp(argv[i], "--seed") && i + 1 < argc) {
      seed = strtoull(argv[++i], NULL, 10);
    } else if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
      usage(stdout);
      return 0;
    } else {
      fprintf(stderr, "kvferry demo: unknown option '%s' (see kvferry --help)\n", argv[i]);
      return 2;
    }
  }
  if (tokens == 0 || tokens > (1u << 24)) {
    fprintf(stderr, "kvferry demo: --tokens must be 1..16777216\n");
    return 2;
  }
  char path[4096];
  if (resolve_geometry(preset, path, sizeof path)) return 1;

  kvf_cuda_info cuda = KVF_CUDA_INFO_INIT;
  kvf_status cst = force_host ? KVF_ERR_NO_DRIVER : kvf_cuda_probe(&cuda);
  int on_gpu = cst == KVF_SUCCESS && cuda.device_count > 0;
  printf("kvferry %s demo: %s, %" PRIu64 " tokens\n", kvf_version_string(), preset, tokens);
  if (on_gpu)
    printf("  backend: GPU 0 (%s): KV cache in device memory, objects in pinned host memory\n", cuda.message);
  else if (force_host)
    printf("  backend: host (--host): KV cache and objects in host memory, copied by CPU threads\n");
  else
    printf("  backend: host (%s: %s)\n", kvf_status_string(cst), kvf_last_error());
  fflush(stdout);
  void *stream = NULL;
  kvf_xfer *xfer = NULL;
  kvf_geometry *g = NULL;
  int rc = 1;
  demo_cache src = {0}, dst = {0}, poison = {0};
  demo_tables stored = {0}, restored = {0};
  demo_objects objs = {0};
  uint32_t *pool = NULL, num_blocks = 0;
  kvf_status st = KVF_SUCCESS;
  if (demo_geometry_load(path, tokens, &g, &num_blocks) || !(pool = demo_pool_make(num_blocks, seed))) goto out;
  uint64_t rng = seed ^ 0x5eed;

  fprintf(stderr, "  preparing the engine's KV cache (%u blocks per group)...\n", num_blocks);
  kvf_xfer_options xo = KVF_XFER_OPTIONS_INIT;
  xo.device = on_gpu ? 0 : KVF_DEVICE_HOST;
  if ((st = kvf_xfer_create(g, &xo, &xfer))) {
    fprintf(stderr, "kvferry demo: transfer context: %s\n", kvf_last_error());
    goto out;
  }
#ifdef KVF_WITH_CUDA
  if (on_gpu && cudaStreamCreateWithFlags((cudaStream_t *)&stream, cudaStreamNonBlocking) != cudaSuccess) {
    fprintf(stderr, "kvferry demo: cudaStreamCreate failed\n");
    goto out;
  }
#endif
  objs.pinned = on_gpu;
  if (cache_alloc(g, &src, &rng, on_gpu) || tables_make(g, tokens, pool, num_blocks, &stored) ||
      objects_make(g, tokens, &stored, &objs)) {
    fprintf(stderr, "kvferry demo: out of memory\n");
    goto out;
  }
  uint64_t store_bytes = moved_bytes(g, &stored, tokens);
  double t_store = 0, t_retrieve = 0;
  if ((st = run_chunks(g, xfer, stream, 0, tokens, &src, &stored, &objs, "store (gather)", &t_store))) {
    fprintf(stderr, "kvferry demo: store: %s\n", kvf_last_error());
    goto out;
  }

  /* The engine restarts: a fresh cache full of garbage, new block ids. */
  for (uint32_t i = 0; i < num_blocks / 2; i++) {
    uint32_t x = pool[i];
    pool[i] = pool[num_blocks - 1 - i];
    pool[num_blocks - 1 - i] = x;
  }
  if (cache_alloc(g, &dst, &rng, on_gpu) || tables_make(g, tokens, pool, num_blocks, &restored)) {
    fprintf(stderr, "kvferry demo: out of memory\n");
    goto out;
  }
  poison.num_regions = dst.num_regions;
  poison.bases = calloc(dst.num_regions, sizeof *poison.bases);
  poison.sizes = calloc(dst.num_regions, sizeof *poison.sizes);
  if (!poison.bases || !poison.sizes) goto out;
  for (uint32_t r = 0; r < dst.num_regions; r++) {
    poison.sizes[r] = dst.sizes[r];
    if (!(poison.bases[r] = malloc(dst.sizes[r] ? dst.sizes[r] : 1))) goto out;
    memcpy(poison.bases[r], dst.bases[r], dst.sizes[r]);
  }
  uint64_t retrieve_bytes = moved_bytes(g, &restored, tokens);
  if ((st = run_chunks(g, xfer, stream, 1, tokens, &dst, &restored, &objs, "retrieve (scatter)", &t_retrieve))) {
    fprintf(stderr, "kvferry demo: retrieve: %s\n", kvf_last_error());
    goto out;
  }
  fprintf(stderr, "  verifying every byte of the restored cache...\n");
  if (cache_download(&dst)) {
    fprintf(stderr, "kvferry demo: copying the restored cache back failed\n");
    goto out;
  }
  uint64_t checked = 0, untouched = 0;
  int bad = demo_verify(g, tokens, &src, &stored, &dst, &poison, &restored, &checked, &untouched);

  char a[32], b[32], c[32];
  printf("  geometry: %u groups, %u object groups, %u aliases, fingerprint %016" PRIx64 "\n",
         kvf_geometry_num_groups(g), kvf_geometry_num_object_groups(g), kvf_geometry_num_aliases(g),
         kvf_geometry_fingerprint(g, KVF_FORMAT_CANONICAL));
  for (uint32_t i = 0; i < kvf_geometry_num_groups(g); i++) {
    kvf_group_info gi = KVF_GROUP_INFO_INIT;
    kvf_geometry_group(g, i, &gi);
    printf("    %-10s %-14s stored %5u blocks, restored %5u blocks (from block %" PRIu64 ")\n", gi.name,
           kvf_group_kind_name(gi.kind), stored.count[i], restored.count[i], restored.first[i]);
  }
  human(objs.bytes, a, sizeof a);
  printf("  objects: %" PRIu64 " (%s)\n", objs.used, a);
  human(store_bytes, a, sizeof a);
  human(retrieve_bytes, b, sizeof b);
  kvf_xfer_stats xs = KVF_XFER_STATS_INIT;
  kvf_xfer_last_stats(xfer, &xs);
  kvf_object_policy dpol = KVF_OBJECT_POLICY_INIT;
  kvf_geometry_policy(g, &dpol);
  uint64_t nchunks = (tokens + dpol.chunk_tokens - 1) / dpol.chunk_tokens, per = nchunks / 16 ? nchunks / 16 : 1;
  char how[64];
  snprintf(how, sizeof how, "%s, %" PRIu64 " calls", on_gpu ? "one kernel launch per call" : "CPU threads",
           (nchunks + per - 1) / per);
  printf("  store:    %s of payload in %.3f s (%.2f GB/s, %s)\n", a, t_store, (double)store_bytes / t_store / 1e9,
         how);
  printf("  retrieve: %s of payload in %.3f s (%.2f GB/s, %s; route %s, %u SMs)\n", b, t_retrieve,
         (double)retrieve_bytes / t_retrieve / 1e9, how, kvf_xfer_route_name(xs.route), xs.sms);
  human(checked, a, sizeof a);
  human(untouched, c, sizeof c);
  printf("  verified: %s restored byte for byte, %s of padding and other blocks untouched\n", a, c);
  if (bad || checked != retrieve_bytes) {
    printf("  verdict: FAILED (%s)\n", bad ? "bytes differ" : "restored byte count differs from the request");
    goto out;
  }
  printf("  verdict: OK (%" PRIu64 " blocks stored, %" PRIu64 " restored)\n", tables_blocks(&stored),
         tables_blocks(&restored));
  rc = 0;
out:
  objects_free(&objs);
  tables_free(&stored);
  tables_free(&restored);
  cache_free(&src);
  cache_free(&dst);
  cache_free(&poison);
  free(pool);
  kvf_xfer_destroy(xfer);
#ifdef KVF_WITH_CUDA
  if (stream) cudaStreamDestroy((cudaStream_t)stream);
#endif
  kvf_geometry_destroy(g);
  return rc;
}

/* `kvferry demo`: the served round trip through kvferryd (the default), or
 * with --in-process the transfer API alone in this process. */
static int cmd_demo_dispatch(int argc, char **argv) {
  const char *preset = "glm-like-hybrid";
  int in_process = 0;
  for (int i = 0; i < argc; i++) {
    if (!strcmp(argv[i], "--in-process")) in_process = 1;
    if (!strcmp(argv[i], "--preset") && i + 1 < argc) preset = argv[i + 1];
    if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
      usage(stdout);
      return 0;
    }
  }
  if (in_process) {
    /* cmd_demo parses its own options; drop the flag it does not know. */
    char **rest = malloc(sizeof(char *) * (size_t)(argc + 1));
    int n = 0;
    if (!rest) return 1;
    for (int i = 0; i < argc; i++)
      if (strcmp(argv[i], "--in-process")) rest[n++] = argv[i];
    int rc = cmd_demo(n, rest);
    free(rest);
    return rc;
  }
  for (int i = 0; i < argc; i++)
    if (strcmp(argv[i], "--tokens") && strcmp(argv[i], "--seed") && strcmp(argv[i], "--preset") &&
        strcmp(argv[i], "--host") && strcmp(argv[i], "--keep") && (i == 0 || (strcmp(argv[i - 1], "--tokens") &&
        strcmp(argv[i - 1], "--seed") && strcmp(argv[i - 1], "--preset")))) {
      fprintf(stderr, "kvferry demo: unknown option '%s' (see kvferry --help)\n", argv[i]);
      return 2;
    }
  char path[4096];
  if (resolve_geometry(preset, path, sizeof path)) return 1;
  return cmd_demo_served(argc, argv, path, preset);
}

/* ---- bench ------------------------------------------------------------------- */

/* Replace this process with kvf_bench: $KVF_BENCH, else next to this binary
 * (installed), else ../perf/kvf_bench (the build tree). */
static int cmd_bench(int argc, char **argv) {
  char dir[4096] = "", cand[3][4200];
  int n = 0;
  const char *env = getenv("KVF_BENCH");
  if (env && *env) snprintf(cand[n++], sizeof cand[0], "%s", env);
  ssize_t len = readlink("/proc/self/exe", dir, sizeof dir - 1);
  if (len > 0) {
    dir[len] = '\0';
    char *slash = strrchr(dir, '/');
    if (slash) *slash = '\0';
    snprintf(cand[n++], sizeof cand[0], "%s/kvf_bench", dir);
    snprintf(cand[n++], sizeof cand[0], "%s/../perf/kvf_bench", dir);
  }
  for (int i = 0; i < n; i++) {
    if (access(cand[i], X_OK) != 0) continue;
    char **args = calloc((size_t)argc + 2, sizeof *args);
    if (!args) return 1;
    args[0] = cand[i];
    for (int k = 0; k < argc; k++) args[k + 1] = argv[k];
    execv(cand[i], args);
    fprintf(stderr, "kvferry bench: cannot run %s: %s\n", cand[i], strerror(errno));
    free(args);
    return 1;
  }
  fprintf(stderr, "kvferry bench: kvf_bench not found (looked at%s%s%s%s%s%s). Build it with "
          "-DKVF_BUILD_PERF=ON (needs CUDA), install it next to kvferry, or set KVF_BENCH.\n",
          n > 0 ? " " : "", n > 0 ? cand[0] : "", n > 1 ? ", " : "", n > 1 ? cand[1] : "", n > 2 ? ", " : "",
          n > 2 ? cand[2] : "");
  return 1;
}

/* ---- topo ---------------------------------------------------------------- */

static int cmd_topo(void) {
  kvf_topology *t = NULL;
  kvf_status st = kvf_topology_create(&t);
  if (st) {
    fprintf(stderr, "kvferry topo: %s: %s\n", kvf_status_string(st), kvf_last_error());
    return 1;
  }
  kvf_topology_info info = KVF_TOPOLOGY_INFO_INIT;
  kvf_topology_info_get(t, &info);
  printf("machine: %u NUMA node%s, %u cores, %u cpus (%s)%s\n", info.num_numa_nodes,
         info.num_numa_nodes == 1 ? "" : "s", info.num_cores, info.num_pus, info.cpus,
         info.has_pci || info.num_gpus == 0 ? "" : ", no PCI information");
  for (uint32_t i = 0; i < info.num_numa_nodes; i++) {
    kvf_numa_node_info n = KVF_NUMA_NODE_INFO_INIT;
    if (kvf_topology_numa_node(t, i, &n)) continue;
    printf("  node %u: %u cores, cpus %s", n.os_index, n.num_cores, n.cpus);
    if (n.memory_bytes) printf(", %.1f GiB", (double)n.memory_bytes / (1024.0 * 1024.0 * 1024.0));
    printf("\n");
  }
  if (info.num_gpus == 0) printf("GPUs: none (%s)\n", info.gpu_note);
  for (uint32_t g = 0; g < info.num_gpus; g++) {
    kvf_gpu_placement p = KVF_GPU_PLACEMENT_INIT;
    if (kvf_topology_gpu(t, g, &p)) continue;
    printf("GPU %d (%s): NUMA node %d (local %s), cpus %s; worker on cpu %d, completion on cpu %d, "
           "L1 memory on node %d%s%s\n",
           p.device, p.pci_bus_id[0] ? p.pci_bus_id : "no PCI id", p.numa_node, p.numa_nodes, p.local_cpus,
           p.worker_cpu, p.completion_cpu, p.numa_node, p.note[0] ? "\n    note: " : "", p.note);
  }
  kvf_topology_destroy(t);
  return 0;
}

/* ---- stat ---------------------------------------------------------------- */

/* A client name for the terminal: a name is whatever its client sent, so
 * control characters (an escape sequence would drive the terminal) and
 * every other byte outside printable ASCII are shown as \xNN, and a
 * backslash as \\; printable ASCII is shown as is. */
static const char *text_safe(const char *name, char *buf, size_t cap) {
  size_t o = 0;
  for (size_t i = 0; name[i] && o + 5 < cap; i++) {
    unsigned char ch = (unsigned char)name[i];
    if (ch == '\\') {
      buf[o++] = '\\';
      buf[o++] = '\\';
    } else if (ch >= 0x20 && ch < 0x7f) {
      buf[o++] = (char)ch;
    } else {
      o += (size_t)snprintf(buf + o, cap - o, "\\x%02x", ch);
    }
  }
  buf[o] = 0;
  return buf;
}

/* STAT as one JSON object on stdout; 0, or -1 when out of memory. Names
 * are whatever clients sent, UTF-8 (the protocol refuses anything else):
 * json_dumpf escapes quotes and control characters and, with
 * JSON_ENSURE_ASCII, writes everything past ASCII as \uXXXX, so a parser
 * reads back the very name and a terminal sees no raw byte. */
static int print_stat_json(const kvf_client_info *info, const kvf_client_stats *st,
                           const kvf_client_stat_record *rec, uint32_t nrec, const kvf_client_peer_record *peers,
                           uint32_t npeers, const char *const *peer_states) {
  char token[17];
  snprintf(token, sizeof token, "%016" PRIx64, st->boot_token);
  json_t *clients = json_array(), *peer_list = json_array();
  json_t *root = json_pack(
      "{s:I, s:s, s:{s:I, s:I, s:I, s:I, s:I}, s:I, s:I, s:I, s:{s:I, s:I, s:I, s:I}, s:{s:I, s:I, s:I}, s:I, s:O, "
      "s:O}",
      "server_pid", (json_int_t)info->server_pid, "boot_token", token, "registrations", "registering",
      (json_int_t)st->registering, "active", (json_int_t)st->active, "draining", (json_int_t)st->draining,
      "closed_total", (json_int_t)st->closed_total, "failed_total", (json_int_t)st->failed_total, "imports",
      (json_int_t)st->imports, "aliases", (json_int_t)st->aliases, "leases", (json_int_t)st->leases, "l1", "objects",
      (json_int_t)st->l1_objects, "bytes", (json_int_t)st->l1_bytes, "pool_bytes", (json_int_t)st->l1_pool_bytes,
      "evicted_total", (json_int_t)st->l1_evicted_total, "requests", "stores_total", (json_int_t)st->stores_total,
      "retrieves_total", (json_int_t)st->retrieves_total, "in_flight", (json_int_t)st->in_flight, "lanes",
      (json_int_t)st->lanes, "clients", clients, "peers", peer_list);
  int ok = root != NULL;
  /* The clients, this one (the last connected) included. */
  for (uint32_t i = 0; ok && i < nrec; i++)
    ok = json_array_append_new(clients, json_pack("{s:I, s:I, s:s, s:{s:I, s:I, s:I}, s:I, s:I, s:I}", "client_id",
                                                  (json_int_t)rec[i].client_id, "pid", (json_int_t)rec[i].pid,
                                                  "name", rec[i].name, "registrations", "registering",
                                                  (json_int_t)rec[i].registering, "active",
                                                  (json_int_t)rec[i].active, "draining",
                                                  (json_int_t)rec[i].draining, "imports", (json_int_t)rec[i].imports,
                                                  "aliases", (json_int_t)rec[i].aliases, "leases",
                                                  (json_int_t)rec[i].leases)) == 0;
  for (uint32_t i = 0; ok && i < npeers; i++) {
    char peer_token[17];
    snprintf(peer_token, sizeof peer_token, "%016" PRIx64, peers[i].boot_token);
    ok = json_array_append_new(
             peer_list,
             json_pack("{s:s, s:s, s:b, s:s, s:I, s:I, s:I, s:I, s:I, s:I, s:I}", "addr", peers[i].addr,
                       "state", peer_states[peers[i].state < 3 ? peers[i].state : 0], "outgoing", peers[i].outgoing,
                       "boot_token", peer_token, "connects", (json_int_t)peers[i].connects, "objects_pulled",
                       (json_int_t)peers[i].objects_pulled, "bytes_pulled", (json_int_t)peers[i].bytes_pulled,
                       "objects_served", (json_int_t)peers[i].objects_served, "failures",
                       (json_int_t)peers[i].failures, "objects_pushed", (json_int_t)peers[i].objects_pushed,
                       "bytes_pushed", (json_int_t)peers[i].bytes_pushed)) == 0;
  }
  if (ok) ok = json_dumpf(root, stdout, JSON_ENSURE_ASCII) == 0 && putchar('\n') != EOF;
  json_decref(root);
  json_decref(clients);
  json_decref(peer_list);
  return ok ? 0 : -1;
}

static int cmd_stat(int argc, char **argv) {
  const char *dir = getenv("KVF_SOCKET_DIR");
  int json = 0;
  for (int i = 0; i < argc; i++) {
    if (!strcmp(argv[i], "--json"))
      json = 1;
    else if (!strcmp(argv[i], "--socket-dir") && i + 1 < argc)
      dir = argv[++i];
    else {
      fprintf(stderr, "kvferry stat: unknown option '%s' (--socket-dir DIR, --json)\n", argv[i]);
      return 2;
    }
  }
  if (!dir || !*dir) {
    fprintf(stderr, "kvferry stat: name the server's socket directory (--socket-dir DIR or KVF_SOCKET_DIR)\n");
    return 2;
  }
  kvf_client_options opt = KVF_CLIENT_OPTIONS_INIT;
  opt.socket_dir = dir;
  opt.name = "kvferry stat";
  kvf_client *c = NULL;
  kvf_client_info info = KVF_CLIENT_INFO_INIT;
  kvf_client_stats st = KVF_CLIENT_STATS_INIT;
  enum { MAX_RECORDS = 1024 };
  static kvf_client_stat_record rec[MAX_RECORDS];
  uint32_t nrec = 0;
  enum { MAX_PEERS = 64 };
  static kvf_client_peer_record peers[MAX_PEERS];
  uint32_t npeers = 0;
  kvf_status s = kvf_client_connect(&opt, &c, &info);
  if (s == KVF_SUCCESS) s = kvf_client_stat_clients(c, &st, rec, MAX_RECORDS, &nrec);
  if (s == KVF_SUCCESS) s = kvf_client_stat_peers(c, peers, MAX_PEERS, &npeers);
  kvf_client_disconnect(c);
  if (npeers > MAX_PEERS) npeers = MAX_PEERS;
  static const char *const peer_states[] = {"down", "handshake", "ready"};
  if (nrec > MAX_RECORDS) nrec = MAX_RECORDS;
  if (s != KVF_SUCCESS) {
    fprintf(stderr, "kvferry stat: %s: %s\n", kvf_status_string(s), kvf_last_error());
    return 1;
  }
  if (json) {
    if (print_stat_json(&info, &st, rec, nrec, peers, npeers, peer_states)) {
      fprintf(stderr, "kvferry stat: out of memory writing JSON\n");
      return 1;
    }
  } else {
    char a[32], b[32], shown[4 * sizeof(rec[0].name) + 8];
    printf("kvferryd pid %u, boot token %016" PRIx64 ", %u lanes (GPUs served, plus the host)\n", info.server_pid,
           st.boot_token, st.lanes);
    printf("  registrations: %u active, %u registering, %u draining (%u closed, %u failed since start)\n", st.active,
           st.registering, st.draining, st.closed_total, st.failed_total);
    printf("  imports %" PRIu64 ", aliases %" PRIu64 ", leases held %" PRIu64 "\n", st.imports, st.aliases, st.leases);
    human(st.l1_bytes, a, sizeof a);
    human(st.l1_pool_bytes, b, sizeof b);
    printf("  L1: %" PRIu64 " objects, %s of %s (%" PRIu64 " chunks evicted since start)\n", st.l1_objects, a, b,
           st.l1_evicted_total);
    printf("  requests: %" PRIu64 " stores, %" PRIu64 " retrieves admitted, %" PRIu64 " in flight\n", st.stores_total,
           st.retrieves_total, st.in_flight);
    printf("  clients: %u connected\n", nrec);
    for (uint32_t i = 0; i < nrec; i++)
      printf("    %-6" PRIu64 " pid %-8u %-20s registrations %u active, %u registering, %u draining; imports %" PRIu64
             ", aliases %" PRIu64 ", leases %" PRIu64 "\n",
             rec[i].client_id, rec[i].pid, rec[i].name[0] ? text_safe(rec[i].name, shown, sizeof shown) : "-",
             rec[i].active, rec[i].registering,
             rec[i].draining, rec[i].imports, rec[i].aliases, rec[i].leases);
    if (npeers) printf("  peers: %u\n", npeers);
    for (uint32_t i = 0; i < npeers; i++) {
      human(peers[i].bytes_pulled, a, sizeof a);
      human(peers[i].bytes_pushed, b, sizeof b);
      printf("    %-21s %-9s %s boot token %016" PRIx64 ", %" PRIu64 " connects, %" PRIu64 " objects (%s) pulled, %" PRIu64
             " (%s) pushed, %" PRIu64 " served, %" PRIu64 " failures\n",
             peers[i].addr, peer_states[peers[i].state < 3 ? peers[i].state : 0],
             peers[i].outgoing ? "outgoing" : "incoming", peers[i].boot_token, peers[i].connects,
             peers[i].objects_pulled, a, peers[i].objects_pushed, b, peers[i].objects_served, peers[i].failures);
    }
  }
  return 0;
}

int main(int argc, char **argv) {
  if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) {
    usage(argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  if (!strcmp(argv[1], "version") || !strcmp(argv[1], "--version")) {
    printf("kvferry %s\n", kvf_version_string());
    return 0;
  }
  if (!strcmp(argv[1], "geometry") && argc >= 3 && !strcmp(argv[2], "check"))
    return cmd_geometry_check(argc - 3, argv + 3);
  if (!strcmp(argv[1], "demo")) return cmd_demo_dispatch(argc - 2, argv + 2);
  if (!strcmp(argv[1], "demo-engine")) return cmd_demo_engine(argc - 2, argv + 2);
  if (!strcmp(argv[1], "presets")) return cmd_presets();
  if (!strcmp(argv[1], "stat")) return cmd_stat(argc - 2, argv + 2);
  if (!strcmp(argv[1], "bench")) return cmd_bench(argc - 2, argv + 2);
  if (!strcmp(argv[1], "topo")) return cmd_topo();
  fprintf(stderr, "kvferry: unknown command '%s'\n\n", argv[1]);
  usage(stderr);
  return 2;
}
