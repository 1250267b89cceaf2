/* Internal: the representation of a geometry, shared by geometry/, kernels/
 * and host/. Everything derived here is computed once by finalize. */
#ifndef KVF_GEOMETRY_INTERNAL_H
#define KVF_GEOMETRY_INTERNAL_H

#include <kvferry/copy.h>

typedef struct kvf_region {
  char name[KVF_NAME_MAX];
  uint64_t size;
  uint64_t align;
  uint32_t num_views;
} kvf_region;

/* Dimensions of an attention view's runs inside one block. */
enum { KVF_DIM_PLANE = 0, KVF_DIM_TOKEN = 1, KVF_DIM_HEAD = 2 };

typedef struct kvf_view {
  kvf_view_desc desc; /* desc.name is NULL: the name lives in name[] */
  char name[KVF_NAME_MAX];
  uint32_t group;
  uint32_t layer;
  int is_recurrent;
  /* Derived at finalize. */
  uint64_t bytes_per_token;         /* attention: heads * (head_bytes[0] + head_bytes[1]) */
  uint64_t block_payload;           /* attention: block_size * bytes_per_token; recurrent: sum of states */
  uint64_t end_offset;              /* one past the last byte touched, from the region base, largest block */
  uint64_t canonical_prefix[KVF_MAX_PLANES]; /* bytes per token of earlier attention layers of the object group, per plane */
  uint64_t native_prefix;           /* bytes per token of earlier attention layers of the object group */
  uint64_t recurrent_prefix;        /* bytes of earlier recurrent layers of the object group */
  uint32_t alias_root;              /* global view index of the first view of its alias class */
} kvf_view;

typedef struct kvf_group {
  kvf_group_desc desc; /* desc.name is NULL: the name lives in name[] */
  char name[KVF_NAME_MAX];
  uint32_t *views; /* global view indices, in layer order */
  uint32_t num_views;
  uint32_t cap_views;
  uint32_t object_group;
} kvf_group;

typedef struct kvf_object_group {
  uint32_t num_groups;
  uint32_t groups[KVF_MAX_GROUPS];
  int has_attention;
  int has_recurrent;
  uint64_t plane_bytes_per_token[KVF_MAX_PLANES]; /* canonical plane sections, per local token */
  uint64_t bytes_per_token;                       /* sum of the above */
  uint64_t recurrent_bytes;
} kvf_object_group;

struct kvf_geometry {
  int finalized;
  char name[KVF_NAME_MAX];
  char *description;
  kvf_region *regions;
  uint32_t num_regions, cap_regions;
  kvf_group *groups;
  uint32_t num_groups, cap_groups;
  kvf_view *views;
  uint32_t num_views, cap_views;
  kvf_object_policy policy;
  uint32_t dcp_world;
  uint32_t dcp_rank;
  kvf_object_group *object_groups;
  uint32_t num_object_groups;
  uint32_t num_aliases;
  uint64_t fingerprint[2]; /* by kvf_object_format */
  /* The region the last failed finalize blamed (a region rule, or a view
   * running past its region), or -1: the JSON loader names its entry. */
  int32_t error_region;
};

static inline const kvf_view *kvf_group_view(const kvf_geometry *g, uint32_t group, uint32_t layer) {
  return &g->views[g->groups[group].views[layer]];
}

/* Local (this rank's) token index of global token t: the count of this
 * rank's tokens before t. */
static inline uint64_t kvf_local_token(const kvf_geometry *g, uint64_t t) {
  if (g->dcp_world == 1) return t;
  if (t <= g->dcp_rank) return 0;
  return (t - g->dcp_rank - 1) / g->dcp_world + 1; /* ceil((t - rank) / world), never wrapping */
}

/* kvf_copy_request_check, which also hands back the library's copy of the
 * request in *local (may be NULL): the caller's struct read by the
 * versioned-struct rule (common/versioned.h), fields an older caller does
 * not know set from KVF_COPY_REQUEST_INIT. Code behind a public entry point
 * reads that copy, never the caller's struct. */
#ifdef __cplusplus
extern "C"
#endif
kvf_status kvf_copy_request_check_local(const kvf_geometry *geometry, const kvf_copy_request *request,
                                        kvf_copy_request *local);

#endif
