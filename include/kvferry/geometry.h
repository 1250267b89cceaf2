/*
 * kvferry/geometry.h - where every byte of an engine's paged KV cache lives,
 * and how it maps into cache objects.
 *
 * A geometry is built once, validated by kvf_geometry_finalize(), and then
 * read-only. It has:
 *   - regions: memory allocations, identified by index; their base addresses
 *     are supplied at copy time, so one geometry serves any process mapping;
 *   - groups: KV-cache groups (layers sharing one block table) of a kind
 *     (full, sliding window, chunked local, recurrent), a block size in tokens
 *     and a block count; each holds one view per layer;
 *   - views: one layer's cache inside one region, as byte strides
 *       addr(b, p, t, h) = base(region) + offset + b*block_stride
 *                          + p*plane_stride + t*token_stride + h*head_stride
 *     with runs of head_bytes[p] contiguous bytes; recurrent views instead
 *     hold state tensors at byte offsets inside a padded slot (block);
 *   - the object policy: tokens per chunk, object format, and whether
 *     windowed and recurrent groups get object groups of their own;
 *   - decode-context parallelism: this rank's place among D interleaved ranks.
 *
 * Threading: building (add/set/finalize) is not thread-safe on one geometry.
 * A finalized geometry is immutable and may be read from any number of
 * threads at once. Nothing here touches a GPU or a stream.
 */
#ifndef KVFERRY_GEOMETRY_H
#define KVFERRY_GEOMETRY_H

#include <kvferry/status.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Limits that validation enforces ("absurd sizes"). */
#define KVF_MAX_REGIONS 4096u
#define KVF_MAX_GROUPS 64u
#define KVF_MAX_LAYERS_PER_GROUP 1024u
#define KVF_MAX_PLANES 2u
#define KVF_MAX_HEADS 4096u
#define KVF_MAX_HEAD_BYTES (1u << 20)
#define KVF_MAX_BLOCK_SIZE 65536u
#define KVF_MAX_BLOCKS (1u << 31)
#define KVF_MAX_STATES 8u
#define KVF_MAX_DCP_WORLD 1024u
#define KVF_MAX_CHUNK_TOKENS (1u << 24)
#define KVF_NAME_MAX 64u
/* Steps kvf_geometry_finalize may spend checking that views of one region do
 * not overlap (runs of block footprints built and compared); a geometry
 * that needs more is refused naming the pair of views (docs/geometry.md,
 * rule 10). Real layouts need a few thousand; this is tens of milliseconds. */
#define KVF_GEOMETRY_OVERLAP_BUDGET (1ull << 25)

/* A block id that means "no block here": nothing is read or written for it. */
#define KVF_BLOCK_SKIP UINT32_MAX

typedef struct kvf_geometry kvf_geometry;

typedef enum kvf_group_kind {
  KVF_GROUP_FULL = 0,           /* every token is retained */
  KVF_GROUP_SLIDING_WINDOW = 1, /* after N tokens keeps [N-W+1, N) */
  KVF_GROUP_CHUNKED_LOCAL = 2,  /* after N tokens keeps [floor(N/C)*C, N) */
  KVF_GROUP_RECURRENT = 3,      /* one state slot per sequence (Mamba, linear attention) */
} kvf_group_kind;

typedef enum kvf_object_format {
  KVF_FORMAT_CANONICAL = 0, /* [P][L][T][H][bytes]: portable between layouts */
  KVF_FORMAT_NATIVE = 1,    /* per layer, block payloads in address order: same geometry only */
} kvf_object_format;

/* Every descriptor starts with its size and version so fields can be added
 * without breaking callers. Fill it from its _INIT macro, then set fields. */
#define KVF_DESC_VERSION 1u

typedef struct kvf_region_desc {
  uint32_t struct_size;
  uint32_t version;
  const char *name; /* optional, for messages; copied (at most KVF_NAME_MAX-1 bytes) */
  uint64_t size;    /* bytes; 0 means "the smallest size that holds every view" (set at finalize) */
  uint64_t align;   /* alignment the base address will have; power of two; default 256 */
} kvf_region_desc;
#define KVF_REGION_DESC_INIT {sizeof(kvf_region_desc), KVF_DESC_VERSION, NULL, 0, 256}

typedef struct kvf_group_desc {
  uint32_t struct_size;
  uint32_t version;
  const char *name;     /* optional, for messages; copied */
  kvf_group_kind kind;
  uint32_t block_size;  /* tokens per block (ignored for recurrent groups: one state per slot) */
  uint32_t num_blocks;  /* block ids of this group are 0 .. num_blocks-1 */
  uint32_t window;      /* sliding_window: W tokens; must be 0 otherwise */
  uint32_t chunk;       /* chunked_local: C tokens; must be 0 otherwise */
} kvf_group_desc;
#define KVF_GROUP_DESC_INIT {sizeof(kvf_group_desc), KVF_DESC_VERSION, NULL, KVF_GROUP_FULL, 16, 0, 0, 0}

/* One state tensor of a recurrent layer: bytes at an offset inside the slot.
 * An array element: a fixed layout (kvferry/kvferry.h), never extended. */
typedef struct kvf_state_desc {
  uint64_t offset; /* from the view's slot start */
  uint64_t bytes;
} kvf_state_desc;

typedef struct kvf_view_desc {
  uint32_t struct_size;
  uint32_t version;
  const char *name;       /* optional layer name, for messages; copied */
  uint32_t region;        /* index of the region this view lives in */
  uint32_t elem_bytes;    /* element size (1 fp8, 2 bf16, ...): offset and strides are multiples of it */
  uint64_t offset;        /* bytes from the region base to block 0, plane 0, token 0, head 0 */
  uint64_t block_stride;  /* physical page stride (may exceed the payload: padded pages) */
  /* Attention views (full, sliding_window, chunked_local groups): */
  uint32_t planes;        /* 2 for separate K and V, 1 for MLA or fused rows */
  uint32_t heads;         /* heads in this view */
  uint64_t plane_stride;
  uint64_t token_stride;
  uint64_t head_stride;
  uint32_t head_bytes[KVF_MAX_PLANES]; /* contiguous bytes per (plane, token, head); V may differ from K */
  /* Recurrent views: state tensors inside a slot of block_stride bytes. */
  uint32_t num_states;
  kvf_state_desc states[KVF_MAX_STATES];
  /* Declared aliasing: this view may overlap the view (alias_group, alias_layer),
   * which must be an earlier view of the same region (the engine shares one
   * tensor between the i-th layers of several groups, using disjoint block ids).
   * alias_group = -1 declares nothing. */
  int32_t alias_group;
  int32_t alias_layer;
} kvf_view_desc;
#define KVF_VIEW_DESC_INIT \
  {sizeof(kvf_view_desc), KVF_DESC_VERSION, NULL, 0, 1, 0, 0, 0, 0, 0, 0, 0, {0, 0}, 0, {{0, 0}}, -1, -1}

typedef struct kvf_object_policy {
  uint32_t struct_size;
  uint32_t version;
  uint32_t chunk_tokens;      /* global tokens per object; a multiple of every attention group's block_size * dcp_world */
  kvf_object_format format;   /* the format objects are made in by default */
  int separate_windowed;      /* each sliding_window / chunked_local group gets its own object group (default 1) */
  int separate_recurrent;     /* each recurrent group gets its own object group (default 0) */
} kvf_object_policy;
#define KVF_OBJECT_POLICY_INIT {sizeof(kvf_object_policy), KVF_DESC_VERSION, 256, KVF_FORMAT_CANONICAL, 1, 0}

/* Detail of a validation failure: which group, layer and field, and why. A
 * fixed layout without a header (kvferry/kvferry.h): it is filled on
 * failure, when a header the caller forgot would hide the real error. */
typedef struct kvf_geometry_error {
  kvf_status status;
  int32_t group;              /* -1 when the rule is not about one group */
  int32_t layer;              /* -1 when the rule is not about one layer */
  char field[32];             /* the field that broke the rule ("token_stride"), "" if none */
  char message[320];          /* full message, also stored as kvf_last_error() */
} kvf_geometry_error;

/* ---- building ---------------------------------------------------------- */

/* Create an empty geometry (policy defaults from KVF_OBJECT_POLICY_INIT, dcp
 * world 1 rank 0). Returns KVF_ERR_INVALID_ARGUMENT for a NULL out,
 * KVF_ERR_OUT_OF_MEMORY. */
KVF_API kvf_status kvf_geometry_create(kvf_geometry **out);

/* Destroy a geometry; NULL is a no-op. Not safe while another thread reads it. */
KVF_API void kvf_geometry_destroy(kvf_geometry *geometry);

/* Append a region; its index (0, 1, ...) is returned in *out_index (may be
 * NULL). Descriptor fields are checked at finalize, except struct_size and
 * version, which follow the versioned-struct rule (kvferry/kvferry.h).
 * Returns KVF_ERR_STATE after finalize, KVF_ERR_INVALID_ARGUMENT for a NULL
 * descriptor, one that breaks that rule, or too many regions. */
KVF_API kvf_status kvf_geometry_add_region(kvf_geometry *geometry, const kvf_region_desc *desc,
                                           uint32_t *out_index);

/* Append a group; its index is returned in *out_index (may be NULL). Same
 * statuses as kvf_geometry_add_region. */
KVF_API kvf_status kvf_geometry_add_group(kvf_geometry *geometry, const kvf_group_desc *desc,
                                          uint32_t *out_index);

/* Append a layer view to group `group`; the layer's index inside the group is
 * returned in *out_layer (may be NULL). Same statuses as above, plus
 * KVF_ERR_INVALID_ARGUMENT for an unknown group. */
KVF_API kvf_status kvf_geometry_add_view(kvf_geometry *geometry, uint32_t group,
                                         const kvf_view_desc *desc, uint32_t *out_layer);

/* Replace the object policy. Checked at finalize. */
KVF_API kvf_status kvf_geometry_set_policy(kvf_geometry *geometry, const kvf_object_policy *policy);

/* Declare this geometry as rank `rank` of `world` decode-context-parallel
 * ranks: rank r holds the global tokens t with t mod world == r. */
KVF_API kvf_status kvf_geometry_set_dcp(kvf_geometry *geometry, uint32_t world, uint32_t rank);

/* Validate every rule (see docs/geometry.md), size regions whose size is 0,
 * compute object layouts and the fingerprints, and make the geometry
 * read-only. On failure returns KVF_ERR_INVALID_GEOMETRY or KVF_ERR_OVERFLOW,
 * fills *error (may be NULL) and kvf_last_error() with a message naming the
 * group, the layer and the field; the geometry stays unfinalized and may be
 * destroyed. Calling it twice returns KVF_ERR_STATE. */
KVF_API kvf_status kvf_geometry_finalize(kvf_geometry *geometry, kvf_geometry_error *error);

/* ---- reading (finalized geometries) ------------------------------------ */

/* What kvf_geometry_region / _group / _object_group fill: versioned
 * structs (kvferry/kvferry.h), so fill each from its _INIT macro first. */
typedef struct kvf_region_info {
  uint32_t struct_size;
  uint32_t version;
  const char *name; /* "" when unnamed; valid while the geometry lives */
  uint64_t size;
  uint64_t align;
  uint32_t num_views; /* views that live in this region */
} kvf_region_info;
#define KVF_REGION_INFO_INIT {sizeof(kvf_region_info), KVF_DESC_VERSION, NULL, 0, 0, 0}

typedef struct kvf_group_info {
  uint32_t struct_size;
  uint32_t version;
  const char *name;
  kvf_group_kind kind;
  uint32_t block_size;
  uint32_t num_blocks;
  uint32_t window;
  uint32_t chunk;
  uint32_t num_layers;
  uint32_t object_group;       /* the object group this group's layers go into */
  uint64_t payload_per_block;  /* payload bytes of one block summed over layers (padding excluded) */
  uint64_t max_block_stride;   /* largest block_stride among the layers */
} kvf_group_info;
#define KVF_GROUP_INFO_INIT {sizeof(kvf_group_info), KVF_DESC_VERSION, NULL, KVF_GROUP_FULL, 0, 0, 0, 0, 0, 0, 0, 0}

typedef struct kvf_object_group_info {
  uint32_t struct_size;
  uint32_t version;
  uint32_t num_groups;
  const uint32_t *groups;      /* group indices in registration order */
  int has_attention;           /* holds full / windowed layers */
  int has_recurrent;           /* holds recurrent states */
  uint64_t bytes_per_token;    /* attention payload bytes per local token */
  uint64_t recurrent_bytes;    /* recurrent state bytes per object */
} kvf_object_group_info;
#define KVF_OBJECT_GROUP_INFO_INIT {sizeof(kvf_object_group_info), KVF_DESC_VERSION, 0, NULL, 0, 0, 0, 0}

KVF_API uint32_t kvf_geometry_num_regions(const kvf_geometry *geometry);
KVF_API uint32_t kvf_geometry_num_groups(const kvf_geometry *geometry);
KVF_API uint32_t kvf_geometry_num_object_groups(const kvf_geometry *geometry);
/* Number of views declared as aliases of another view. */
KVF_API uint32_t kvf_geometry_num_aliases(const kvf_geometry *geometry);

/* Fill *out (filled from its _INIT macro) for region / group / object group
 * `index`. KVF_ERR_INVALID_ARGUMENT for an index out of range, NULL pointers
 * or an *out that breaks the versioned-struct rule, KVF_ERR_STATE if not
 * finalized; *out is untouched on failure. */
KVF_API kvf_status kvf_geometry_region(const kvf_geometry *geometry, uint32_t index, kvf_region_info *out);
KVF_API kvf_status kvf_geometry_group(const kvf_geometry *geometry, uint32_t index, kvf_group_info *out);
KVF_API kvf_status kvf_geometry_object_group(const kvf_geometry *geometry, uint32_t index,
                                             kvf_object_group_info *out);

/* Copy layer `layer` of group `group` into *out (name points into the
 * geometry). *out, and the policy's *out below, are filled from their _INIT
 * macro and written by the versioned-struct rule (kvferry/kvferry.h). */
KVF_API kvf_status kvf_geometry_view(const kvf_geometry *geometry, uint32_t group, uint32_t layer,
                                     kvf_view_desc *out);

/* The object policy and the dcp placement. */
KVF_API kvf_status kvf_geometry_policy(const kvf_geometry *geometry, kvf_object_policy *out);
KVF_API kvf_status kvf_geometry_dcp(const kvf_geometry *geometry, uint32_t *world, uint32_t *rank);

/* 64-bit fingerprint of everything that determines the bytes of an object in
 * `format`: for canonical, the logical shape (object groups, group kinds,
 * windows and chunks, layers, planes, heads, head bytes, state sizes, chunk
 * tokens, dcp world) — not block sizes or strides, so canonical objects move
 * between layouts; for native, also block sizes, state offsets and the order
 * of the strides, which fixes the order of a block's runs. Names never count.
 * Equal fingerprints mean objects are interchangeable. Returns 0 for an
 * unfinalized geometry. */
KVF_API uint64_t kvf_geometry_fingerprint(const kvf_geometry *geometry, kvf_object_format format);

/* ---- tokens, blocks and windows ---------------------------------------- */

/* The number of this rank's tokens among global tokens [0, global_tokens). */
KVF_API uint64_t kvf_geometry_local_tokens(const kvf_geometry *geometry, uint64_t global_tokens);

/* Local block range [*first_block, *end_block) of attention group `group`
 * holding this rank's tokens of the global range [token_begin, token_end).
 * Empty ranges give first == end. KVF_ERR_INVALID_ARGUMENT for a recurrent
 * group, an unknown group or token_begin > token_end. */
KVF_API kvf_status kvf_geometry_local_blocks(const kvf_geometry *geometry, uint32_t group,
                                             uint64_t token_begin, uint64_t token_end,
                                             uint64_t *first_block, uint64_t *end_block);

/* The global tokens [*token_begin, prefix_tokens) a group retains after a
 * prefix of prefix_tokens tokens: everything for full groups, [N-W+1, N) for
 * sliding_window(W), [floor(N/C)*C, N) for chunked_local(C), and nothing for
 * recurrent groups (their state is governed by kvf_geometry_recurrent_state). */
KVF_API kvf_status kvf_geometry_retained_tokens(const kvf_geometry *geometry, uint32_t group,
                                                uint64_t prefix_tokens, uint64_t *token_begin);

/* The local block range [*first_block, *end_block) a group retains after a
 * prefix of prefix_tokens global tokens: the blocks holding any retained
 * token of this rank. Blocks before *first_block hold the null block in the
 * engine's table and are neither read nor written on retrieve. */
KVF_API kvf_status kvf_geometry_retained_blocks(const kvf_geometry *geometry, uint32_t group,
                                                uint64_t prefix_tokens, uint64_t *first_block,
                                                uint64_t *end_block);

/* Recurrent slot rule: the state after prefix_tokens tokens can be stored or
 * restored only at a chunk boundary. Sets *chunk_index to the chunk whose
 * object carries that state (prefix_tokens / chunk_tokens - 1) and returns
 * KVF_SUCCESS, or returns KVF_ERR_INVALID_ARGUMENT naming prefix_tokens when
 * it is 0 or not a multiple of chunk_tokens. */
KVF_API kvf_status kvf_geometry_recurrent_state(const kvf_geometry *geometry, uint64_t prefix_tokens,
                                                uint64_t *chunk_index);

/* ---- object layout ----------------------------------------------------- */

/* Payload bytes of the object of object group `object_group` for chunk
 * `chunk_index` of a sequence of total_tokens global tokens (the last chunk
 * may be partial, and then holds no recurrent state: state exists only at
 * chunk boundaries). Canonical and native objects have the same size. An
 * object group whose only content is recurrent state has size 0 for a
 * partial chunk. */
KVF_API kvf_status kvf_geometry_object_size(const kvf_geometry *geometry, uint32_t object_group,
                                            uint64_t chunk_index, uint64_t total_tokens,
                                            uint64_t *bytes);

/* Where one (layer, plane) segment starts inside an object holding
 * local_tokens tokens. Canonical: the segment is [T][H][head_bytes] for that
 * layer and plane. Native: plane is ignored and the segment is the layer's
 * block payloads back to back. Recurrent layers: the layer's states back to
 * back (plane ignored). *segment_bytes (may be NULL) gets the segment's
 * length in bytes: local_tokens x its bytes per token (attention), or the
 * layer's state bytes (recurrent). */
KVF_API kvf_status kvf_geometry_object_segment(const kvf_geometry *geometry, kvf_object_format format,
                                               uint32_t group, uint32_t layer, uint32_t plane,
                                               uint64_t local_tokens, uint64_t *offset,
                                               uint64_t *segment_bytes);

/* Metadata stored with every object, so a retrieve into another geometry or
 * format fails clearly instead of scattering garbage. A stored layout: fixed
 * (kvferry/kvferry.h), never extended. */
typedef struct kvf_object_header {
  uint32_t magic;          /* KVF_OBJECT_MAGIC */
  uint16_t header_version; /* 1 */
  uint16_t format;         /* kvf_object_format */
  uint64_t fingerprint;    /* kvf_geometry_fingerprint(geometry, format) */
  uint32_t object_group;
  uint32_t dcp_rank;
  uint64_t token_begin;    /* global tokens [token_begin, token_end) */
  uint64_t token_end;
  uint64_t payload_bytes;
} kvf_object_header;
#define KVF_OBJECT_MAGIC 0x4B56464Fu /* "KVFO" */

/* Fill *header for the object of chunk chunk_index of a total_tokens-token
 * sequence. Statuses as kvf_geometry_object_size. */
KVF_API kvf_status kvf_object_header_init(const kvf_geometry *geometry, kvf_object_format format,
                                          uint32_t object_group, uint64_t chunk_index,
                                          uint64_t total_tokens, kvf_object_header *header);

/* Check that an object described by *header can be scattered through this
 * geometry into object group object_group. KVF_ERR_GEOMETRY_MISMATCH with a
 * message naming the field that differs (fingerprint, format, object_group,
 * dcp_rank, payload_bytes) otherwise. */
KVF_API kvf_status kvf_object_header_check(const kvf_geometry *geometry, const kvf_object_header *header,
                                           uint32_t object_group);

/* ---- files ------------------------------------------------------------- */

/* Options for loading a geometry file. num_blocks_override, when non-zero,
 * replaces every group's num_blocks (region sizes left at 0 in the file are
 * then computed for it). */
typedef struct kvf_geometry_load_options {
  uint32_t struct_size;
  uint32_t version;
  uint32_t num_blocks_override;
} kvf_geometry_load_options;
#define KVF_GEOMETRY_LOAD_OPTIONS_INIT {sizeof(kvf_geometry_load_options), KVF_DESC_VERSION, 0}

/* Load, validate and finalize a geometry from a JSON file (docs/geometry.md).
 * options may be NULL. Returns KVF_ERR_IO / KVF_ERR_NOT_FOUND for an
 * unreadable file, KVF_ERR_PARSE for bad JSON or a schema violation (the
 * message names the JSON path and, for syntax errors, line and column), or a
 * validation status as kvf_geometry_finalize (error filled as finalize fills
 * it, may be NULL; the message starts with the JSON path of the entry that
 * made the failing view, group or region). */
KVF_API kvf_status kvf_geometry_load_file(const char *path, const kvf_geometry_load_options *options,
                                          kvf_geometry **out, kvf_geometry_error *error);

/* Same, from a buffer of len bytes (need not be NUL-terminated). */
KVF_API kvf_status kvf_geometry_load_buffer(const char *json, size_t len,
                                            const kvf_geometry_load_options *options,
                                            kvf_geometry **out, kvf_geometry_error *error);

/* Write a finalized geometry as a geometry file (docs/geometry.md) that
 * kvf_geometry_load_buffer loads back into an equal geometry: the same
 * regions (sizes included), groups, views, aliases, object policy, DCP
 * placement, name and description, hence the same fingerprints. The text is
 * the explicit form (one layer entry per view, every key written, integer
 * plane strides) without whitespace, and the same geometry always gives the
 * same bytes. The loader requires names that a geometry built in code may
 * lack: an empty geometry name is written as "geometry", an unnamed region i
 * as "region<i>" and an unnamed group g as "group<g>" (with "_<k>" added
 * should that name be taken); unnamed layers stay unnamed. *json
 * (NUL-terminated, *len bytes before the NUL; len may be NULL) is malloc'd:
 * free() it. Returns KVF_SUCCESS; KVF_ERR_INVALID_ARGUMENT (NULL pointers,
 * or a name or the description that is not valid UTF-8); KVF_ERR_STATE (not
 * finalized); KVF_ERR_OVERFLOW (a value above 2^63-1, the largest integer a
 * file holds, possible only for the stride of a dimension with one element,
 * or text beyond the 16 MiB the loader reads; the message names the JSON
 * path); KVF_ERR_OUT_OF_MEMORY. *json is untouched on failure. Reads the
 * geometry only: any number of threads may call it at once. */
KVF_API kvf_status kvf_geometry_to_json(const kvf_geometry *geometry, char **json, size_t *len);

/* The name and description the file gave ("" when absent); valid while the
 * geometry lives. */
KVF_API const char *kvf_geometry_name(const kvf_geometry *geometry);
KVF_API const char *kvf_geometry_description(const kvf_geometry *geometry);

/* Record the name and description (copied). Used by the loader; callers that
 * build geometries in code may set them too. */
KVF_API kvf_status kvf_geometry_set_name(kvf_geometry *geometry, const char *name, const char *description);

/* Short names of enum values ("sliding_window", "canonical"). */
KVF_API const char *kvf_group_kind_name(kvf_group_kind kind);
KVF_API const char *kvf_object_format_name(kvf_object_format format);

#ifdef __cplusplus
}
#endif

#endif /* KVFERRY_GEOMETRY_H */
