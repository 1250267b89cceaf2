/*
 * Geometry files: JSON (docs/geometry.md) -> the public builder API, and
 * back (kvf_geometry_to_json, at the end).
 *
 * The loader is strict: every key is known, every number has the right type
 * and range, and every name a layer refers to exists. Failures name the JSON
 * path ("groups[1].layers[0].token_stride: ..."). The loader only translates;
 * every geometric rule (strides, overlaps, limits on sizes) is left to
 * kvf_geometry_finalize(), whose status and error pass through with the
 * message prefixed by the JSON path of the entry that made the failing
 * view, group or region (the loader remembers where each view came from).
 */
#define _POSIX_C_SOURCE 200809L

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <jansson.h>

#include <kvferry/geometry.h>

#include "common/error.h"
#include "common/versioned.h"
#include "geometry/geometry_internal.h"

/* Geometry files are a few KiB; anything this large is not one, and a cap
 * keeps a stray path (a model checkpoint, /dev/zero) from eating memory. */
#define KVF_JSON_MAX_BYTES ((size_t)16 << 20)

/* JSON paths we build: "groups[g]", "groups[g].layers[e]" and one more
 * level below a layer ("....alias_of", "....states[s]"); each buffer holds
 * the one above it plus its own suffix. */
#define KVF_JSON_GROUP_PATH_MAX 48
#define KVF_JSON_LAYER_PATH_MAX 96
#define KVF_JSON_PATH_MAX 160

/* One expanded region ("kv[3]") and the entry of "regions" it came from. */
typedef struct kvf_json_region {
  char name[KVF_NAME_MAX];
  uint32_t entry; /* index into the loader's entries */
} kvf_json_region;

/* Where one view came from: layer k of entry `entry` of its group's
 * "layers", an entry of `count` layers. */
typedef struct kvf_json_view_origin {
  uint32_t entry;
  uint32_t k;
  uint32_t count;
} kvf_json_view_origin;

/* One entry of "regions" (its plain name resolves to its first region). */
typedef struct kvf_json_region_entry {
  char name[KVF_NAME_MAX];
  uint32_t first;
  uint32_t count;
} kvf_json_region_entry;

typedef struct kvf_json_loader {
  kvf_geometry *geometry;
  uint32_t num_blocks_override;
  json_t *groups_json; /* the "groups" array, for messages about later groups */

  kvf_json_region *regions;
  uint32_t num_regions;
  kvf_json_region_entry *entries;
  uint32_t num_entries;

  uint32_t num_groups;
  char group_names[KVF_MAX_GROUPS][KVF_NAME_MAX];
  uint32_t group_layers[KVF_MAX_GROUPS]; /* views added so far */
  uint32_t group_blocks[KVF_MAX_GROUPS]; /* num_blocks in effect (after any override) */

  /* Every view added, in order; groups add theirs one after the other, so
   * view (g, l) is origins[group_first[g] + l]. */
  kvf_json_view_origin *origins;
  uint32_t num_origins;
  uint32_t cap_origins;
  uint32_t group_first[KVF_MAX_GROUPS];

  /* Where the first failure happened, for kvf_geometry_error. */
  int32_t error_group;
  int32_t error_layer;
  char error_field[32];
} kvf_json_loader;

/* Copy a string that came from the file into buf for a message: control
 * bytes become '?', and long strings are cut with "...". */
static const char *kvf_json_printable(const char *s, char *buf, size_t size) {
  size_t i = 0;
  for (; s[i] != '\0' && i + 1 < size; ++i) {
    unsigned char c = (unsigned char)s[i];
    buf[i] = (c < 0x20 || c == 0x7f) ? '?' : (char)c;
  }
  buf[i] = '\0';
  if (s[i] != '\0' && size > 4) memcpy(buf + size - 4, "...", 4);
  return buf;
}

/* Report a failure at JSON path `where` + "." + `key` (either may be empty
 * or NULL) and remember the key as the failing field. */
static kvf_status kvf_json_fail(kvf_json_loader *l, kvf_status status, const char *where,
                                const char *key, const char *fmt, ...) KVF_PRINTF(5, 6);
static kvf_status kvf_json_fail(kvf_json_loader *l, kvf_status status, const char *where,
                                const char *key, const char *fmt, ...) {
  char detail[512];
  char shown_key[72];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(detail, sizeof detail, fmt, ap);
  va_end(ap);
  if (where == NULL) where = "";
  if (key == NULL) key = "";
  kvf_json_printable(key, shown_key, sizeof shown_key);
  snprintf(l->error_field, sizeof l->error_field, "%.31s", shown_key);
  if (where[0] == '\0' && shown_key[0] == '\0')
    return kvf_fail(status, "top level: %s", detail);
  return kvf_fail(status, "%s%s%s: %s", where, (where[0] != '\0' && shown_key[0] != '\0') ? "." : "",
                  shown_key, detail);
}

/* Reject any key of obj that is not in allowed[0..n). */
static kvf_status kvf_json_check_keys(kvf_json_loader *l, json_t *obj, const char *where,
                                      const char *const *allowed, size_t n) {
  const char *key;
  json_t *value;
  json_object_foreach(obj, key, value) {
    size_t i = 0;
    (void)value;
    while (i < n && strcmp(key, allowed[i]) != 0) ++i;
    if (i == n) return kvf_json_fail(l, KVF_ERR_PARSE, where, key, "unknown key");
  }
  return KVF_SUCCESS;
}

/* ---- typed getters: absent keys leave *out at its default ------------- */

static kvf_status kvf_json_missing(kvf_json_loader *l, const char *where, const char *key) {
  return kvf_json_fail(l, KVF_ERR_PARSE, where, key, "required key is missing");
}

/* A non-negative integer. *present (may be NULL) says whether the key was there. */
static kvf_status kvf_json_get_u64(kvf_json_loader *l, json_t *obj, const char *where, const char *key,
                                   int required, uint64_t *out, int *present) {
  json_t *v = json_object_get(obj, key);
  if (present != NULL) *present = v != NULL;
  if (v == NULL) return required ? kvf_json_missing(l, where, key) : KVF_SUCCESS;
  /* jansson keeps integers as long long: larger literals are syntax errors. */
  if (!json_is_integer(v) || json_integer_value(v) < 0)
    return kvf_json_fail(l, KVF_ERR_PARSE, where, key, "expected a non-negative integer");
  *out = (uint64_t)json_integer_value(v);
  return KVF_SUCCESS;
}

static kvf_status kvf_json_get_u32(kvf_json_loader *l, json_t *obj, const char *where, const char *key,
                                   int required, uint32_t *out, int *present) {
  uint64_t v = *out;
  kvf_status st = kvf_json_get_u64(l, obj, where, key, required, &v, present);
  if (st != KVF_SUCCESS) return st;
  if (v > UINT32_MAX)
    return kvf_json_fail(l, KVF_ERR_PARSE, where, key,
                         "expected a non-negative integer no larger than 4294967295, got %llu",
                         (unsigned long long)v);
  *out = (uint32_t)v;
  return KVF_SUCCESS;
}

/* A count: an integer >= 1 (default 1). */
static kvf_status kvf_json_get_count(kvf_json_loader *l, json_t *obj, const char *where, uint32_t *out) {
  kvf_status st;
  *out = 1;
  st = kvf_json_get_u32(l, obj, where, "count", 0, out, NULL);
  if (st != KVF_SUCCESS) return st;
  if (*out == 0) return kvf_json_fail(l, KVF_ERR_PARSE, where, "count", "expected a positive integer");
  return KVF_SUCCESS;
}

static kvf_status kvf_json_get_string(kvf_json_loader *l, json_t *obj, const char *where,
                                      const char *key, int required, const char **out) {
  json_t *v = json_object_get(obj, key);
  if (v == NULL) return required ? kvf_json_missing(l, where, key) : KVF_SUCCESS;
  if (!json_is_string(v)) return kvf_json_fail(l, KVF_ERR_PARSE, where, key, "expected a string");
  *out = json_string_value(v);
  return KVF_SUCCESS;
}

/* A name that the loader stores: 1 .. KVF_NAME_MAX-1 bytes (after `suffix`
 * bytes of "[k]" are added for counted entries). */
static kvf_status kvf_json_get_name(kvf_json_loader *l, json_t *obj, const char *where, int required,
                                    size_t suffix, const char **out) {
  kvf_status st = kvf_json_get_string(l, obj, where, "name", required, out);
  if (st != KVF_SUCCESS || *out == NULL) return st;
  if ((*out)[0] == '\0') return kvf_json_fail(l, KVF_ERR_PARSE, where, "name", "must not be empty");
  if (strlen(*out) + suffix > KVF_NAME_MAX - 1)
    return kvf_json_fail(l, KVF_ERR_PARSE, where, "name", "longer than %u bytes%s", KVF_NAME_MAX - 1,
                         suffix != 0 ? " with its [index] suffix" : "");
  return KVF_SUCCESS;
}

static kvf_status kvf_json_get_bool(kvf_json_loader *l, json_t *obj, const char *where, const char *key,
                                    int *out) {
  json_t *v = json_object_get(obj, key);
  if (v == NULL) return KVF_SUCCESS;
  if (!json_is_boolean(v)) return kvf_json_fail(l, KVF_ERR_PARSE, where, key, "expected true or false");
  *out = json_is_true(v) ? 1 : 0;
  return KVF_SUCCESS;
}

/* An object or array member (absent -> *out NULL unless required). */
static kvf_status kvf_json_get_typed(kvf_json_loader *l, json_t *obj, const char *where, const char *key,
                                     int required, json_type type, json_t **out) {
  json_t *v = json_object_get(obj, key);
  *out = NULL;
  if (v == NULL) return required ? kvf_json_missing(l, where, key) : KVF_SUCCESS;
  if (json_typeof(v) != type)
    return kvf_json_fail(l, KVF_ERR_PARSE, where, key, "expected %s",
                         type == JSON_OBJECT ? "an object" : "an array");
  *out = v;
  return KVF_SUCCESS;
}

/* Decimal digits of "[k]" for k < count. */
static size_t kvf_json_suffix_len(uint32_t count) {
  size_t digits = 1;
  if (count <= 1) return 0;
  for (uint32_t k = count - 1; k >= 10; k /= 10) ++digits;
  return digits + 2;
}

/* ---- regions ------------------------------------------------------------ */

static int kvf_json_region_name_taken(const kvf_json_loader *l, const char *name) {
  for (uint32_t i = 0; i < l->num_regions; ++i)
    if (strcmp(l->regions[i].name, name) == 0) return 1;
  for (uint32_t i = 0; i < l->num_entries; ++i)
    if (strcmp(l->entries[i].name, name) == 0) return 1;
  return 0;
}

static kvf_status kvf_json_parse_regions(kvf_json_loader *l, json_t *root) {
  static const char *const keys[] = {"name", "count", "size", "align"};
  json_t *arr;
  size_t n;
  kvf_status st = kvf_json_get_typed(l, root, "", "regions", 1, JSON_ARRAY, &arr);
  if (st != KVF_SUCCESS) return st;
  n = json_array_size(arr);
  if (n == 0) return kvf_json_fail(l, KVF_ERR_PARSE, "", "regions", "expected at least one region");
  if (n > KVF_MAX_REGIONS)
    return kvf_json_fail(l, KVF_ERR_INVALID_GEOMETRY, "", "regions", "%zu entries, at most %u regions",
                         n, KVF_MAX_REGIONS);
  l->entries = calloc(n, sizeof *l->entries);
  if (l->entries == NULL) return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "loading geometry: out of memory");

  for (size_t e = 0; e < n; ++e) {
    char where[KVF_JSON_PATH_MAX];
    json_t *obj = json_array_get(arr, e);
    const char *name = NULL;
    uint32_t count;
    kvf_region_desc desc = KVF_REGION_DESC_INIT;
    snprintf(where, sizeof where, "regions[%zu]", e);
    if (!json_is_object(obj)) return kvf_json_fail(l, KVF_ERR_PARSE, where, NULL, "expected an object");
    if ((st = kvf_json_check_keys(l, obj, where, keys, sizeof keys / sizeof keys[0])) != KVF_SUCCESS ||
        (st = kvf_json_get_count(l, obj, where, &count)) != KVF_SUCCESS ||
        (st = kvf_json_get_name(l, obj, where, 1, kvf_json_suffix_len(count), &name)) != KVF_SUCCESS ||
        (st = kvf_json_get_u64(l, obj, where, "size", 0, &desc.size, NULL)) != KVF_SUCCESS ||
        (st = kvf_json_get_u64(l, obj, where, "align", 0, &desc.align, NULL)) != KVF_SUCCESS)
      return st;
    if (count > KVF_MAX_REGIONS - l->num_regions)
      return kvf_json_fail(l, KVF_ERR_INVALID_GEOMETRY, where, "count",
                           "%u more regions would exceed the limit of %u", count, KVF_MAX_REGIONS);
    if (l->regions == NULL) {
      /* Allocated once at the limit: 4096 small records. */
      l->regions = calloc(KVF_MAX_REGIONS, sizeof *l->regions);
      if (l->regions == NULL) return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "loading geometry: out of memory");
    }

    kvf_json_region_entry *entry = &l->entries[l->num_entries];
    char shown[72];
    if (kvf_json_region_name_taken(l, name))
      return kvf_json_fail(l, KVF_ERR_PARSE, where, "name", "duplicate region name '%s'",
                           kvf_json_printable(name, shown, sizeof shown));
    for (uint32_t k = 0; k < count; ++k) {
      kvf_json_region *r = &l->regions[l->num_regions + k];
      if (count == 1)
        snprintf(r->name, sizeof r->name, "%s", name);
      else
        snprintf(r->name, sizeof r->name, "%s[%u]", name, k);
      /* An expanded name may collide with an earlier plain one ("kv[1]"). */
      if (kvf_json_region_name_taken(l, r->name))
        return kvf_json_fail(l, KVF_ERR_PARSE, where, "name", "region name '%s' is already taken",
                             kvf_json_printable(r->name, shown, sizeof shown));
      r->entry = l->num_entries;
    }
    snprintf(entry->name, sizeof entry->name, "%s", name);
    entry->first = l->num_regions;
    entry->count = count;
    ++l->num_entries;
    for (uint32_t k = 0; k < count; ++k) {
      uint32_t index;
      desc.name = l->regions[l->num_regions].name;
      st = kvf_geometry_add_region(l->geometry, &desc, &index);
      if (st != KVF_SUCCESS) {
        kvf_error_prefix("%s: ", where);
        return st;
      }
      ++l->num_regions;
    }
  }
  return KVF_SUCCESS;
}

/* Resolve a region reference: an expanded name ("kv[5]", or a plain name of
 * an uncounted entry) or the plain name of a counted entry (its first region). */
static int kvf_json_find_region(const kvf_json_loader *l, const char *name, uint32_t *index) {
  for (uint32_t i = 0; i < l->num_regions; ++i)
    if (strcmp(l->regions[i].name, name) == 0) {
      *index = i;
      return 1;
    }
  for (uint32_t i = 0; i < l->num_entries; ++i)
    if (strcmp(l->entries[i].name, name) == 0) {
      *index = l->entries[i].first;
      return 1;
    }
  return 0;
}

/* ---- groups and layers -------------------------------------------------- */

static const char *const kvf_json_kind_names[] = {"full", "sliding_window", "chunked_local", "recurrent"};

/* Keys of a layer entry, and the ones that belong to one kind of group. */
static const char *const kvf_json_layer_keys[] = {
    "count",       "name",   "region",     "region_step",  "offset",     "offset_step",
    "elem_bytes",  "block_stride", "planes", "heads",      "head_bytes", "plane_stride",
    "token_stride", "head_stride", "states", "alias_of"};
static const char *const kvf_json_attention_keys[] = {"planes",       "heads",        "head_bytes",
                                                      "plane_stride", "token_stride", "head_stride"};

static kvf_status kvf_json_parse_states(kvf_json_loader *l, json_t *obj, const char *where,
                                        kvf_view_desc *view) {
  static const char *const keys[] = {"offset", "bytes"};
  json_t *arr;
  kvf_status st = kvf_json_get_typed(l, obj, where, "states", 1, JSON_ARRAY, &arr);
  if (st != KVF_SUCCESS) return st;
  if (json_array_size(arr) > KVF_MAX_STATES)
    return kvf_json_fail(l, KVF_ERR_INVALID_GEOMETRY, where, "states", "%zu states, at most %u",
                         json_array_size(arr), KVF_MAX_STATES);
  view->num_states = (uint32_t)json_array_size(arr);
  for (uint32_t s = 0; s < view->num_states; ++s) {
    char swhere[KVF_JSON_PATH_MAX];
    json_t *so = json_array_get(arr, s);
    snprintf(swhere, sizeof swhere, "%s.states[%u]", where, s);
    if (!json_is_object(so)) return kvf_json_fail(l, KVF_ERR_PARSE, swhere, NULL, "expected an object");
    if ((st = kvf_json_check_keys(l, so, swhere, keys, 2)) != KVF_SUCCESS ||
        (st = kvf_json_get_u64(l, so, swhere, "offset", 1, &view->states[s].offset, NULL)) != KVF_SUCCESS ||
        (st = kvf_json_get_u64(l, so, swhere, "bytes", 1, &view->states[s].bytes, NULL)) != KVF_SUCCESS)
      return st;
  }
  return KVF_SUCCESS;
}

/* Is `text` the expression "num_blocks * block_stride" (spaces optional)? */
static int kvf_json_is_blocks_expr(const char *text) {
  const char *want = "num_blocks*block_stride";
  for (; *text; ++text) {
    if (*text == ' ') continue;
    if (*text != *want) return 0;
    ++want;
  }
  return *want == '\0';
}

static kvf_status kvf_json_parse_attention(kvf_json_loader *l, json_t *obj, const char *where, uint32_t group,
                                           kvf_view_desc *view) {
  json_t *hb, *ps;
  int present;
  kvf_status st;
  if ((st = kvf_json_get_u32(l, obj, where, "planes", 1, &view->planes, NULL)) != KVF_SUCCESS ||
      (st = kvf_json_get_u32(l, obj, where, "heads", 1, &view->heads, NULL)) != KVF_SUCCESS ||
      (st = kvf_json_get_u64(l, obj, where, "token_stride", 1, &view->token_stride, NULL)) != KVF_SUCCESS)
    return st;
  /* Layouts with K and V outermost ((2, num_blocks, ...)) space the planes
   * by the block count, which the engine picks at run time: the file may say
   * so, and the stride then follows num_blocks (and any override). */
  ps = json_object_get(obj, "plane_stride");
  if (ps != NULL && json_is_string(ps)) {
    if (!kvf_json_is_blocks_expr(json_string_value(ps)))
      return kvf_json_fail(l, KVF_ERR_PARSE, where, "plane_stride",
                           "expected a non-negative integer or the string \"num_blocks * block_stride\"");
    if (!kvf_mul_u64(l->group_blocks[group], view->block_stride, &view->plane_stride))
      return kvf_json_fail(l, KVF_ERR_OVERFLOW, where, "plane_stride", "num_blocks * block_stride overflows 64 bits");
    present = 1;
  } else if ((st = kvf_json_get_u64(l, obj, where, "plane_stride", 0, &view->plane_stride, &present)) !=
             KVF_SUCCESS) {
    return st;
  }
  if (!present && view->planes > 1)
    return kvf_json_fail(l, KVF_ERR_PARSE, where, "plane_stride", "required when planes is %u",
                         view->planes);
  if ((st = kvf_json_get_u64(l, obj, where, "head_stride", 0, &view->head_stride, &present)) != KVF_SUCCESS)
    return st;
  if (!present && view->heads > 1)
    return kvf_json_fail(l, KVF_ERR_PARSE, where, "head_stride", "required when heads is %u", view->heads);

  hb = json_object_get(obj, "head_bytes");
  if (hb == NULL) return kvf_json_missing(l, where, "head_bytes");
  if (json_is_array(hb)) {
    size_t n = json_array_size(hb);
    /* One entry per plane; a plane count finalize will reject still gets
     * its entries stored (up to two) so that its message is the one shown. */
    int planes_ok = view->planes >= 1 && view->planes <= KVF_MAX_PLANES;
    if ((planes_ok && n != view->planes) || n < 1 || n > KVF_MAX_PLANES)
      return kvf_json_fail(l, KVF_ERR_PARSE, where, "head_bytes",
                           "expected one integer per plane (%u), got an array of %zu", view->planes, n);
    for (size_t p = 0; p < n; ++p) {
      json_t *v = json_array_get(hb, p);
      const char *key = p == 0 ? "head_bytes[0]" : "head_bytes[1]";
      if (!json_is_integer(v) || json_integer_value(v) < 0)
        return kvf_json_fail(l, KVF_ERR_PARSE, where, key, "expected a non-negative integer");
      if (json_integer_value(v) > (json_int_t)UINT32_MAX)
        return kvf_json_fail(l, KVF_ERR_PARSE, where, key,
                             "expected a non-negative integer no larger than 4294967295");
      view->head_bytes[p] = (uint32_t)json_integer_value(v);
    }
  } else {
    uint32_t v = 0;
    if ((st = kvf_json_get_u32(l, obj, where, "head_bytes", 1, &v, NULL)) != KVF_SUCCESS) {
      /* Name both accepted shapes. */
      if (!json_is_integer(hb))
        return kvf_json_fail(l, KVF_ERR_PARSE, where, "head_bytes",
                             "expected a non-negative integer or an array of one per plane");
      return st;
    }
    view->head_bytes[0] = v;
    view->head_bytes[1] = view->planes >= 2 ? v : 0;
  }
  return KVF_SUCCESS;
}

/* Find a group by name among those added so far. */
static int kvf_json_find_group(const kvf_json_loader *l, const char *name, uint32_t *index) {
  for (uint32_t g = 0; g < l->num_groups; ++g)
    if (strcmp(l->group_names[g], name) == 0) {
      *index = g;
      return 1;
    }
  return 0;
}

/* Whether a later entry of "groups" carries this name (for a clearer message). */
static int kvf_json_group_declared_later(const kvf_json_loader *l, const char *name) {
  for (size_t g = l->num_groups; g < json_array_size(l->groups_json); ++g) {
    json_t *gn = json_object_get(json_array_get(l->groups_json, g), "name");
    if (json_is_string(gn) && strcmp(json_string_value(gn), name) == 0) return 1;
  }
  return 0;
}

typedef struct kvf_json_alias {
  int present;
  uint32_t group;
  uint32_t layer;
  uint32_t layer_step;
} kvf_json_alias;

static kvf_status kvf_json_parse_alias(kvf_json_loader *l, json_t *obj, const char *where,
                                       kvf_json_alias *alias) {
  static const char *const keys[] = {"group", "layer", "layer_step"};
  char awhere[KVF_JSON_PATH_MAX];
  char shown[72];
  const char *group = NULL;
  json_t *ao;
  kvf_status st = kvf_json_get_typed(l, obj, where, "alias_of", 0, JSON_OBJECT, &ao);
  if (st != KVF_SUCCESS || ao == NULL) return st;
  snprintf(awhere, sizeof awhere, "%s.alias_of", where);
  alias->present = 1;
  alias->layer_step = 1;
  if ((st = kvf_json_check_keys(l, ao, awhere, keys, 3)) != KVF_SUCCESS ||
      (st = kvf_json_get_string(l, ao, awhere, "group", 1, &group)) != KVF_SUCCESS ||
      (st = kvf_json_get_u32(l, ao, awhere, "layer", 1, &alias->layer, NULL)) != KVF_SUCCESS ||
      (st = kvf_json_get_u32(l, ao, awhere, "layer_step", 0, &alias->layer_step, NULL)) != KVF_SUCCESS)
    return st;
  /* The current group counts as found: a view may alias an earlier layer of its own group. */
  if (!kvf_json_find_group(l, group, &alias->group)) {
    if (kvf_json_group_declared_later(l, group))
      return kvf_json_fail(l, KVF_ERR_PARSE, awhere, "group",
                           "group '%s' is declared later; an alias must point to an earlier view",
                           kvf_json_printable(group, shown, sizeof shown));
    return kvf_json_fail(l, KVF_ERR_PARSE, awhere, "group", "unknown group '%s'",
                         kvf_json_printable(group, shown, sizeof shown));
  }
  return KVF_SUCCESS;
}

static kvf_status kvf_json_parse_layer(kvf_json_loader *l, json_t *obj, const char *where, uint32_t group,
                                       uint32_t entry_index, kvf_group_kind kind) {
  char shown[72];
  const char *name = NULL;
  const char *region = NULL;
  uint32_t count;
  uint32_t region_index;
  uint32_t region_step = 0;
  uint64_t offset_step = 0;
  kvf_json_alias alias = {0, 0, 0, 0};
  kvf_view_desc view = KVF_VIEW_DESC_INIT;
  const kvf_json_region_entry *entry;
  kvf_status st;

  if (!json_is_object(obj)) return kvf_json_fail(l, KVF_ERR_PARSE, where, NULL, "expected an object");
  st = kvf_json_check_keys(l, obj, where, kvf_json_layer_keys,
                           sizeof kvf_json_layer_keys / sizeof kvf_json_layer_keys[0]);
  if (st != KVF_SUCCESS) return st;
  /* Keys of the other kind of group are known but out of place. */
  if (kind == KVF_GROUP_RECURRENT) {
    for (size_t i = 0; i < sizeof kvf_json_attention_keys / sizeof kvf_json_attention_keys[0]; ++i)
      if (json_object_get(obj, kvf_json_attention_keys[i]) != NULL)
        return kvf_json_fail(l, KVF_ERR_PARSE, where, kvf_json_attention_keys[i],
                             "not allowed in a recurrent group (its layers have states)");
  } else if (json_object_get(obj, "states") != NULL) {
    return kvf_json_fail(l, KVF_ERR_PARSE, where, "states", "only recurrent groups have states");
  }

  if ((st = kvf_json_get_count(l, obj, where, &count)) != KVF_SUCCESS ||
      (st = kvf_json_get_name(l, obj, where, 0, kvf_json_suffix_len(count), &name)) != KVF_SUCCESS ||
      (st = kvf_json_get_string(l, obj, where, "region", 1, &region)) != KVF_SUCCESS ||
      (st = kvf_json_get_u32(l, obj, where, "region_step", 0, &region_step, NULL)) != KVF_SUCCESS ||
      (st = kvf_json_get_u64(l, obj, where, "offset", 0, &view.offset, NULL)) != KVF_SUCCESS ||
      (st = kvf_json_get_u64(l, obj, where, "offset_step", 0, &offset_step, NULL)) != KVF_SUCCESS ||
      (st = kvf_json_get_u32(l, obj, where, "elem_bytes", 0, &view.elem_bytes, NULL)) != KVF_SUCCESS ||
      (st = kvf_json_get_u64(l, obj, where, "block_stride", 1, &view.block_stride, NULL)) != KVF_SUCCESS)
    return st;
  if (kind == KVF_GROUP_RECURRENT)
    st = kvf_json_parse_states(l, obj, where, &view);
  else
    st = kvf_json_parse_attention(l, obj, where, group, &view);
  if (st != KVF_SUCCESS) return st;
  if ((st = kvf_json_parse_alias(l, obj, where, &alias)) != KVF_SUCCESS) return st;

  if (count > KVF_MAX_LAYERS_PER_GROUP - l->group_layers[group])
    return kvf_json_fail(l, KVF_ERR_INVALID_GEOMETRY, where, "count",
                         "%u more layers would exceed the limit of %u per group", count,
                         KVF_MAX_LAYERS_PER_GROUP);
  if (!kvf_json_find_region(l, region, &region_index))
    return kvf_json_fail(l, KVF_ERR_PARSE, where, "region", "unknown region '%s'",
                         kvf_json_printable(region, shown, sizeof shown));
  entry = &l->entries[l->regions[region_index].entry];
  if (count > 1 && region_step != 0) {
    /* The last layer must still land inside the region's own entry. */
    uint64_t last = (uint64_t)region_index + (uint64_t)(count - 1) * region_step;
    if (last >= (uint64_t)entry->first + entry->count)
      return kvf_json_fail(l, KVF_ERR_PARSE, where, "region_step",
                           "layer %u of this entry would use region %llu of '%s', which has %u region%s",
                           count - 1, (unsigned long long)(last - entry->first),
                           kvf_json_printable(entry->name, shown, sizeof shown), entry->count,
                           entry->count == 1 ? "" : "s");
  }

  for (uint32_t k = 0; k < count; ++k) {
    char layer_name[KVF_NAME_MAX];
    uint64_t step_offset;
    kvf_view_desc v = view;
    l->error_layer = (int32_t)l->group_layers[group];
    v.region = region_index + k * region_step;
    if (!kvf_mul_u64(offset_step, k, &step_offset) || !kvf_add_u64(view.offset, step_offset, &v.offset))
      return kvf_json_fail(l, KVF_ERR_OVERFLOW, where, "offset_step",
                           "offset + %u * offset_step overflows 64 bits", k);
    if (name != NULL) {
      if (count == 1)
        snprintf(layer_name, sizeof layer_name, "%s", name);
      else
        snprintf(layer_name, sizeof layer_name, "%s[%u]", name, k);
      v.name = layer_name;
    }
    if (alias.present) {
      uint64_t target = (uint64_t)alias.layer + (uint64_t)k * alias.layer_step;
      /* Aliases point back: the target view must exist already. */
      uint32_t have = l->group_layers[alias.group];
      if (target >= have)
        return kvf_json_fail(l, KVF_ERR_PARSE, where, k == 0 ? "alias_of.layer" : "alias_of.layer_step",
                             "layer %u of this entry would alias layer %llu of group '%s', which has "
                             "%u layer%s so far; an alias must point to an earlier view",
                             k, (unsigned long long)target, l->group_names[alias.group], have,
                             have == 1 ? "" : "s");
      v.alias_group = (int32_t)alias.group;
      v.alias_layer = (int32_t)target;
    }
    if (l->num_origins == l->cap_origins) {
      uint32_t cap = l->cap_origins ? l->cap_origins * 2 : 64;
      kvf_json_view_origin *grown = realloc(l->origins, (size_t)cap * sizeof *grown);
      if (grown == NULL) return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "loading geometry: out of memory");
      l->origins = grown;
      l->cap_origins = cap;
    }
    st = kvf_geometry_add_view(l->geometry, group, &v, NULL);
    if (st != KVF_SUCCESS) {
      kvf_error_prefix("%s: ", where);
      return st;
    }
    l->origins[l->num_origins++] = (kvf_json_view_origin){entry_index, k, count};
    ++l->group_layers[group];
  }
  return KVF_SUCCESS;
}

static kvf_status kvf_json_parse_group(kvf_json_loader *l, json_t *obj, uint32_t gi) {
  static const char *const keys[] = {"name", "kind", "block_size", "num_blocks", "window", "chunk", "layers"};
  char where[KVF_JSON_GROUP_PATH_MAX];
  char shown[72];
  const char *name = NULL;
  const char *kind_name = NULL;
  kvf_group_desc desc = KVF_GROUP_DESC_INIT;
  uint32_t index;
  uint32_t k;
  int present;
  json_t *layers;
  kvf_status st;

  snprintf(where, sizeof where, "groups[%u]", gi);
  if (!json_is_object(obj)) return kvf_json_fail(l, KVF_ERR_PARSE, where, NULL, "expected an object");
  if ((st = kvf_json_check_keys(l, obj, where, keys, sizeof keys / sizeof keys[0])) != KVF_SUCCESS ||
      (st = kvf_json_get_name(l, obj, where, 1, 0, &name)) != KVF_SUCCESS ||
      (st = kvf_json_get_string(l, obj, where, "kind", 1, &kind_name)) != KVF_SUCCESS)
    return st;
  if (kvf_json_find_group(l, name, &index))
    return kvf_json_fail(l, KVF_ERR_PARSE, where, "name", "duplicate group name '%s'",
                         kvf_json_printable(name, shown, sizeof shown));
  for (k = 0; k < sizeof kvf_json_kind_names / sizeof kvf_json_kind_names[0]; ++k)
    if (strcmp(kind_name, kvf_json_kind_names[k]) == 0) break;
  if (k == sizeof kvf_json_kind_names / sizeof kvf_json_kind_names[0])
    return kvf_json_fail(l, KVF_ERR_PARSE, where, "kind",
                         "unknown kind '%s' (full, sliding_window, chunked_local or recurrent)",
                         kvf_json_printable(kind_name, shown, sizeof shown));
  desc.kind = (kvf_group_kind)k;
  desc.name = name;

  /* Recurrent groups have one state per slot: block_size defaults to 1. */
  desc.block_size = 1;
  if ((st = kvf_json_get_u32(l, obj, where, "block_size", desc.kind != KVF_GROUP_RECURRENT, &desc.block_size,
                             NULL)) != KVF_SUCCESS ||
      (st = kvf_json_get_u32(l, obj, where, "num_blocks", 1, &desc.num_blocks, NULL)) != KVF_SUCCESS ||
      (st = kvf_json_get_u32(l, obj, where, "window", 0, &desc.window, &present)) != KVF_SUCCESS)
    return st;
  if (present != (desc.kind == KVF_GROUP_SLIDING_WINDOW))
    return present ? kvf_json_fail(l, KVF_ERR_PARSE, where, "window", "only sliding_window groups have a window")
                   : kvf_json_missing(l, where, "window");
  if ((st = kvf_json_get_u32(l, obj, where, "chunk", 0, &desc.chunk, &present)) != KVF_SUCCESS) return st;
  if (present != (desc.kind == KVF_GROUP_CHUNKED_LOCAL))
    return present ? kvf_json_fail(l, KVF_ERR_PARSE, where, "chunk", "only chunked_local groups have a chunk")
                   : kvf_json_missing(l, where, "chunk");
  if ((st = kvf_json_get_typed(l, obj, where, "layers", 1, JSON_ARRAY, &layers)) != KVF_SUCCESS) return st;
  if (json_array_size(layers) == 0)
    return kvf_json_fail(l, KVF_ERR_PARSE, where, "layers", "expected at least one layer entry");
  if (l->num_blocks_override != 0) desc.num_blocks = l->num_blocks_override;

  st = kvf_geometry_add_group(l->geometry, &desc, &index);
  if (st != KVF_SUCCESS) {
    kvf_error_prefix("%s: ", where);
    return st;
  }
  /* Registered before its layers, so a layer may alias an earlier one of its own group. */
  snprintf(l->group_names[gi], sizeof l->group_names[gi], "%s", name);
  l->group_blocks[gi] = desc.num_blocks;
  l->num_groups = gi + 1;
  l->group_first[gi] = l->num_origins;

  for (size_t e = 0; e < json_array_size(layers); ++e) {
    char lwhere[KVF_JSON_LAYER_PATH_MAX];
    snprintf(lwhere, sizeof lwhere, "%s.layers[%zu]", where, e);
    l->error_layer = (int32_t)l->group_layers[gi];
    st = kvf_json_parse_layer(l, json_array_get(layers, e), lwhere, gi, (uint32_t)e, desc.kind);
    if (st != KVF_SUCCESS) return st;
  }
  l->error_layer = -1;
  return KVF_SUCCESS;
}

static kvf_status kvf_json_parse_groups(kvf_json_loader *l, json_t *root) {
  json_t *arr;
  kvf_status st = kvf_json_get_typed(l, root, "", "groups", 1, JSON_ARRAY, &arr);
  if (st != KVF_SUCCESS) return st;
  if (json_array_size(arr) == 0) return kvf_json_fail(l, KVF_ERR_PARSE, "", "groups", "expected at least one group");
  if (json_array_size(arr) > KVF_MAX_GROUPS)
    return kvf_json_fail(l, KVF_ERR_INVALID_GEOMETRY, "", "groups", "%zu groups, at most %u",
                         json_array_size(arr), KVF_MAX_GROUPS);
  l->groups_json = arr;
  for (uint32_t g = 0; g < json_array_size(arr); ++g) {
    l->error_group = (int32_t)g;
    if ((st = kvf_json_parse_group(l, json_array_get(arr, g), g)) != KVF_SUCCESS) return st;
  }
  l->error_group = -1;
  return KVF_SUCCESS;
}

/* ---- policy, dcp and the top level --------------------------------------- */

static kvf_status kvf_json_parse_objects(kvf_json_loader *l, json_t *root) {
  static const char *const keys[] = {"chunk_tokens", "format", "separate_windowed", "separate_recurrent"};
  kvf_object_policy policy = KVF_OBJECT_POLICY_INIT;
  const char *format = NULL;
  char shown[72];
  json_t *obj;
  kvf_status st = kvf_json_get_typed(l, root, "", "objects", 0, JSON_OBJECT, &obj);
  if (st != KVF_SUCCESS || obj == NULL) return st;
  if ((st = kvf_json_check_keys(l, obj, "objects", keys, sizeof keys / sizeof keys[0])) != KVF_SUCCESS ||
      (st = kvf_json_get_u32(l, obj, "objects", "chunk_tokens", 0, &policy.chunk_tokens, NULL)) != KVF_SUCCESS ||
      (st = kvf_json_get_string(l, obj, "objects", "format", 0, &format)) != KVF_SUCCESS ||
      (st = kvf_json_get_bool(l, obj, "objects", "separate_windowed", &policy.separate_windowed)) != KVF_SUCCESS ||
      (st = kvf_json_get_bool(l, obj, "objects", "separate_recurrent", &policy.separate_recurrent)) != KVF_SUCCESS)
    return st;
  if (format != NULL) {
    if (strcmp(format, "canonical") == 0)
      policy.format = KVF_FORMAT_CANONICAL;
    else if (strcmp(format, "native") == 0)
      policy.format = KVF_FORMAT_NATIVE;
    else
      return kvf_json_fail(l, KVF_ERR_PARSE, "objects", "format", "unknown format '%s' (canonical or native)",
                           kvf_json_printable(format, shown, sizeof shown));
  }
  st = kvf_geometry_set_policy(l->geometry, &policy);
  if (st != KVF_SUCCESS) kvf_error_prefix("objects: ");
  return st;
}

static kvf_status kvf_json_parse_dcp(kvf_json_loader *l, json_t *root) {
  static const char *const keys[] = {"world", "rank"};
  uint32_t world = 1;
  uint32_t rank = 0;
  json_t *obj;
  kvf_status st = kvf_json_get_typed(l, root, "", "dcp", 0, JSON_OBJECT, &obj);
  if (st != KVF_SUCCESS || obj == NULL) return st;
  if ((st = kvf_json_check_keys(l, obj, "dcp", keys, 2)) != KVF_SUCCESS ||
      (st = kvf_json_get_u32(l, obj, "dcp", "world", 1, &world, NULL)) != KVF_SUCCESS ||
      (st = kvf_json_get_u32(l, obj, "dcp", "rank", 1, &rank, NULL)) != KVF_SUCCESS)
    return st;
  /* Checked here too so that the message names the JSON path. */
  if (world == 0 || world > KVF_MAX_DCP_WORLD)
    return kvf_json_fail(l, KVF_ERR_INVALID_GEOMETRY, "dcp", "world", "must be 1..%u, got %u", KVF_MAX_DCP_WORLD, world);
  if (rank >= world)
    return kvf_json_fail(l, KVF_ERR_INVALID_GEOMETRY, "dcp", "rank", "must be below world %u, got %u", world, rank);
  st = kvf_geometry_set_dcp(l->geometry, world, rank);
  if (st != KVF_SUCCESS) kvf_error_prefix("dcp: ");
  return st;
}

static kvf_status kvf_json_build(kvf_json_loader *l, json_t *root) {
  static const char *const keys[] = {"format", "version", "name", "description",
                                     "regions", "groups", "objects", "dcp"};
  const char *format = NULL;
  const char *name = NULL;
  const char *description = "";
  json_t *version;
  kvf_status st;

  if (!json_is_object(root)) return kvf_json_fail(l, KVF_ERR_PARSE, "", NULL, "expected an object");
  /* format and version first: a file of another kind or version should say
   * so rather than list the keys it does not share with this one. */
  if ((st = kvf_json_get_string(l, root, "", "format", 1, &format)) != KVF_SUCCESS) return st;
  if (strcmp(format, "kvferry-geometry") != 0)
    return kvf_json_fail(l, KVF_ERR_PARSE, "", "format", "expected \"kvferry-geometry\"");
  version = json_object_get(root, "version");
  if (version == NULL) return kvf_json_missing(l, "", "version");
  if (!json_is_integer(version) || json_integer_value(version) != 1)
    return kvf_json_fail(l, KVF_ERR_PARSE, "", "version", "unsupported version (this library reads version 1)");
  if ((st = kvf_json_check_keys(l, root, "", keys, sizeof keys / sizeof keys[0])) != KVF_SUCCESS ||
      (st = kvf_json_get_name(l, root, "", 1, 0, &name)) != KVF_SUCCESS ||
      (st = kvf_json_get_string(l, root, "", "description", 0, &description)) != KVF_SUCCESS ||
      (st = kvf_json_parse_regions(l, root)) != KVF_SUCCESS ||
      (st = kvf_json_parse_groups(l, root)) != KVF_SUCCESS ||
      (st = kvf_json_parse_objects(l, root)) != KVF_SUCCESS || (st = kvf_json_parse_dcp(l, root)) != KVF_SUCCESS)
    return st;
  return kvf_geometry_set_name(l->geometry, name, description);
}

/* ---- validation failures: the JSON path of what finalize blamed ----------- */

/* Append " (k = K of count N)" for a layer or region of a counted entry. */
static void kvf_json_append_k(char *buf, size_t len, uint32_t k, uint32_t count) {
  size_t n = strlen(buf);
  if (count > 1 && n < len) snprintf(buf + n, len - n, " (k = %u of count %u)", k, count);
}

/* The JSON key of a view's field as finalize names it (the C field). */
static const char *kvf_json_view_key(const kvf_json_loader *l, const kvf_geometry_error *e, uint32_t entry) {
  const char *f = e->field;
  if (strcmp(f, "num_states") == 0 || strcmp(f, "states.offset") == 0 || strcmp(f, "states.bytes") == 0)
    return "states";
  if (strncmp(f, "head_bytes[", 11) == 0) {
    /* "head_bytes[1]" is a JSON path only when the file gave an array. */
    json_t *group = json_array_get(l->groups_json, (size_t)e->group);
    json_t *layer = json_array_get(json_object_get(group, "layers"), entry);
    return json_is_array(json_object_get(layer, "head_bytes")) ? f : "head_bytes";
  }
  return f;
}

/* Write into buf the JSON path of the key that a failed finalize blamed:
 * the region entry for a region rule or a region too small for one block
 * ("regions[0].size (k = 3 of count 32)"), the layer entry for a view
 * ("groups[1].layers[0].block_stride (k = 2 of count 4)"), the group for a
 * group rule ("groups[0].num_blocks"), "objects..." for the policy. Empty
 * when the failure has no place in the file. */
static void kvf_json_validation_path(const kvf_json_loader *l, const kvf_geometry_error *e, char *buf, size_t len) {
  const char *f = e->field;
  int32_t region = l->geometry->error_region;
  buf[0] = '\0';
  if (region >= 0 && (uint32_t)region < l->num_regions && (e->group < 0 || strcmp(f, "size") == 0)) {
    uint32_t ei = l->regions[region].entry;
    const kvf_json_region_entry *re = &l->entries[ei];
    int key = strcmp(f, "size") == 0 || strcmp(f, "align") == 0 || strcmp(f, "name") == 0;
    snprintf(buf, len, "regions[%u]%s%s", ei, key ? "." : "", key ? f : "");
    kvf_json_append_k(buf, len, (uint32_t)region - re->first, re->count);
    return;
  }
  if (e->group >= 0 && (uint32_t)e->group < l->num_groups) {
    uint32_t gi = (uint32_t)e->group;
    if (strcmp(f, "chunk_tokens") == 0) {
      snprintf(buf, len, "objects.chunk_tokens");
      return;
    }
    if (e->layer >= 0 && strcmp(f, "num_blocks") != 0) {
      uint32_t at = l->group_first[gi] + (uint32_t)e->layer;
      if ((uint32_t)e->layer >= l->group_layers[gi] || at >= l->num_origins) return;
      const kvf_json_view_origin *o = &l->origins[at];
      snprintf(buf, len, "groups[%u].layers[%u]%s%s", gi, o->entry, f[0] != '\0' ? "." : "",
               kvf_json_view_key(l, e, o->entry));
      kvf_json_append_k(buf, len, o->k, o->count);
      if (o->k > 0 && strcmp(f, "offset") == 0) {
        /* Layer k's offset is offset + k * offset_step: say which to look at. */
        json_t *layer = json_array_get(json_object_get(json_array_get(l->groups_json, gi), "layers"), o->entry);
        json_t *step = json_object_get(layer, "offset_step");
        size_t n = strlen(buf);
        if (json_is_integer(step) && json_integer_value(step) != 0 && n > 0 && n < len)
          snprintf(buf + n - 1, len - (n - 1), ": offset + %u x offset_step)", o->k);
      }
      return;
    }
    snprintf(buf, len, "groups[%u]%s%s", gi, f[0] != '\0' ? "." : "", f);
    if (strcmp(f, "num_blocks") == 0 && l->num_blocks_override != 0) {
      size_t n = strlen(buf);
      if (n < len) snprintf(buf + n, len - n, " (num_blocks_override %u)", l->num_blocks_override);
    }
    return;
  }
  if (strcmp(f, "chunk_tokens") == 0 || strcmp(f, "format") == 0)
    snprintf(buf, len, "objects.%s", f);
  else if (strncmp(f, "separate_", 9) == 0)
    snprintf(buf, len, "objects");
  else if (strcmp(f, "dcp") == 0 || strcmp(f, "regions") == 0 || strcmp(f, "groups") == 0)
    snprintf(buf, len, "%s", f);
}

/* Parse, build and finalize. `source` names the file in messages (NULL for buffers). */
static kvf_status kvf_json_load(const char *json, size_t len, const kvf_geometry_load_options *options,
                                kvf_geometry **out, kvf_geometry_error *error, const char *source) {
  kvf_json_loader l;
  json_error_t jerr;
  json_t *root = NULL;
  kvf_geometry_error verr;
  int validation = 0;
  kvf_status st;

  memset(&l, 0, sizeof l);
  l.error_group = -1;
  l.error_layer = -1;
  if (out == NULL || (json == NULL && len != 0)) {
    st = kvf_fail(KVF_ERR_INVALID_ARGUMENT, "loading geometry: %s is NULL", out == NULL ? "out" : "json");
    goto out;
  }
  if (options != NULL) {
    kvf_geometry_load_options opt = KVF_GEOMETRY_LOAD_OPTIONS_INIT;
    st = KVF_VERSIONED_IN(kvf_geometry_load_options, &opt, options);
    if (st != KVF_SUCCESS) {
      kvf_error_prefix("loading geometry: ");
      goto out;
    }
    l.num_blocks_override = opt.num_blocks_override;
  }
  if (len > KVF_JSON_MAX_BYTES) {
    st = kvf_fail(KVF_ERR_PARSE, "input is %zu bytes, more than the %zu MiB a geometry file may have", len,
                  KVF_JSON_MAX_BYTES >> 20);
    goto out;
  }
  /* Duplicate keys would let a typo'd second copy silently win. */
  root = json_loadb(json != NULL ? json : "", len, JSON_REJECT_DUPLICATES, &jerr);
  if (root == NULL) {
    char text[sizeof jerr.text];
    /* jansson quotes the offending bytes, which may be control characters. */
    st = kvf_fail(KVF_ERR_PARSE, "line %d, column %d: %s", jerr.line, jerr.column,
                  kvf_json_printable(jerr.text, text, sizeof text));
    goto out;
  }
  st = kvf_geometry_create(&l.geometry);
  if (st != KVF_SUCCESS) goto out;
  st = kvf_json_build(&l, root);
  if (st != KVF_SUCCESS) goto out;
  st = kvf_geometry_finalize(l.geometry, &verr);
  if (st != KVF_SUCCESS) {
    /* finalize's error, with the JSON path of what it blames in front. */
    char path[KVF_JSON_PATH_MAX];
    validation = 1;
    kvf_json_validation_path(&l, &verr, path, sizeof path);
    if (path[0] != '\0') kvf_error_prefix("%s: ", path);
    goto out;
  }
  *out = l.geometry;
  l.geometry = NULL;

out:
  if (st != KVF_SUCCESS) {
    if (source != NULL) kvf_error_prefix("%s: ", source);
    if (validation && error != NULL) {
      *error = verr;
      error->status = st; /* also for the failures finalize does not describe (out of memory) */
      snprintf(error->message, sizeof error->message, "%s", kvf_last_error());
    } else if (error != NULL) {
      memset(error, 0, sizeof *error);
      error->status = st;
      error->group = l.error_group;
      error->layer = l.error_layer;
      snprintf(error->field, sizeof error->field, "%s", l.error_field);
      snprintf(error->message, sizeof error->message, "%s", kvf_last_error());
    }
  }
  kvf_geometry_destroy(l.geometry);
  json_decref(root);
  free(l.regions);
  free(l.entries);
  free(l.origins);
  return st;
}

kvf_status kvf_geometry_load_buffer(const char *json, size_t len, const kvf_geometry_load_options *options,
                                    kvf_geometry **out, kvf_geometry_error *error) {
  return kvf_json_load(json, len, options, out, error, NULL);
}

/* Read a whole file, refusing more than KVF_JSON_MAX_BYTES. */
static kvf_status kvf_json_read_file(const char *path, char **data, size_t *len) {
  char reason[128];
  size_t cap = 64 << 10;
  size_t used = 0;
  char *buf = NULL;
  kvf_status st = KVF_SUCCESS;
  int fd;

  do {
    fd = open(path, O_RDONLY | O_CLOEXEC);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) {
    int err = errno;
    if (strerror_r(err, reason, sizeof reason) != 0) snprintf(reason, sizeof reason, "errno %d", err);
    return kvf_fail(err == ENOENT ? KVF_ERR_NOT_FOUND : KVF_ERR_IO, "geometry file '%s': %s", path, reason);
  }
  for (;;) {
    ssize_t got;
    if (used == cap) {
      char *grown;
      if (cap > KVF_JSON_MAX_BYTES) {
        st = kvf_fail(KVF_ERR_PARSE, "geometry file '%s': larger than %zu MiB, not a geometry file", path,
                      KVF_JSON_MAX_BYTES >> 20);
        goto out;
      }
      /* One byte past the cap tells "exactly at the cap" from "beyond it". */
      cap = cap * 2 > KVF_JSON_MAX_BYTES ? KVF_JSON_MAX_BYTES + 1 : cap * 2;
      grown = realloc(buf, cap);
      if (grown == NULL) {
        st = kvf_fail(KVF_ERR_OUT_OF_MEMORY, "geometry file '%s': out of memory", path);
        goto out;
      }
      buf = grown;
    }
    if (buf == NULL) {
      buf = malloc(cap);
      if (buf == NULL) {
        st = kvf_fail(KVF_ERR_OUT_OF_MEMORY, "geometry file '%s': out of memory", path);
        goto out;
      }
    }
    got = read(fd, buf + used, cap - used);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) {
      int err = errno;
      if (strerror_r(err, reason, sizeof reason) != 0) snprintf(reason, sizeof reason, "errno %d", err);
      st = kvf_fail(KVF_ERR_IO, "geometry file '%s': %s", path, reason);
      goto out;
    }
    if (got == 0) break;
    used += (size_t)got;
  }
  if (used > KVF_JSON_MAX_BYTES) {
    st = kvf_fail(KVF_ERR_PARSE, "geometry file '%s': larger than %zu MiB, not a geometry file", path,
                  KVF_JSON_MAX_BYTES >> 20);
    goto out;
  }
  *data = buf;
  *len = used;
  buf = NULL;
out:
  free(buf);
  close(fd);
  return st;
}

kvf_status kvf_geometry_load_file(const char *path, const kvf_geometry_load_options *options,
                                  kvf_geometry **out, kvf_geometry_error *error) {
  char *data = NULL;
  size_t len = 0;
  kvf_status st;
  if (path == NULL || out == NULL)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "loading geometry: %s is NULL", path == NULL ? "path" : "out");
  st = kvf_json_read_file(path, &data, &len);
  if (st != KVF_SUCCESS) {
    if (error != NULL) {
      memset(error, 0, sizeof *error);
      error->status = st;
      error->group = -1;
      error->layer = -1;
      snprintf(error->message, sizeof error->message, "%s", kvf_last_error());
    }
    return st;
  }
  st = kvf_json_load(data, len, options, out, error, path);
  free(data);
  return st;
}

/* ---- writing: a finalized geometry -> a geometry file --------------------- */

/* The writer emits the explicit form of the schema (one layer entry per view,
 * no count or _step keys, every key written even at its default), built
 * through jansson and dumped compact: the text is meant for REGISTER and for
 * kvf_geometry_load_buffer, not for people (pipe it through a pretty-printer). */

/* The loader requires region and group names and a geometry name; a geometry
 * built in code may leave them empty, and those get generated names. */
#define KVF_JSON_DEFAULT_NAME "geometry"

typedef struct kvf_json_writer {
  char (*region_names)[KVF_NAME_MAX];
  char group_names[KVF_MAX_GROUPS][KVF_NAME_MAX];
  /* The dump, in our own allocation so the caller can free() it whatever
   * allocator jansson was given (json_set_alloc_funcs). */
  char *text;
  size_t len;
  size_t cap;
  int too_large;
} kvf_json_writer;

/* Strict UTF-8 (RFC 3629: no overlong forms, no surrogates, nothing above
 * U+10FFFF), which is what jansson's parser accepts. */
static int kvf_json_is_utf8(const char *s) {
  const unsigned char *p = (const unsigned char *)s;
  while (*p != 0) {
    uint32_t cp;
    int extra;
    if (*p < 0x80) {
      ++p;
      continue;
    }
    if (*p >= 0xC2 && *p <= 0xDF) {
      cp = *p & 0x1Fu;
      extra = 1;
    } else if (*p >= 0xE0 && *p <= 0xEF) {
      cp = *p & 0x0Fu;
      extra = 2;
    } else if (*p >= 0xF0 && *p <= 0xF4) {
      cp = *p & 0x07u;
      extra = 3;
    } else {
      return 0;
    }
    ++p;
    for (int i = 0; i < extra; ++i, ++p) {
      if ((*p & 0xC0) != 0x80) return 0; /* also stops at the NUL */
      cp = (cp << 6) | (*p & 0x3Fu);
    }
    if ((extra == 2 && cp < 0x800) || (extra == 3 && cp < 0x10000) || cp > 0x10FFFF ||
        (cp >= 0xD800 && cp <= 0xDFFF))
      return 0;
  }
  return 1;
}

/* obj[key] = s, refusing text a geometry file cannot carry. `where` names it. */
static kvf_status kvf_json_put_string(json_t *obj, const char *key, const char *s, const char *where) {
  if (!kvf_json_is_utf8(s))
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_geometry_to_json: %s%s%s: not valid UTF-8, which JSON requires",
                    where, where[0] != '\0' ? "." : "", key);
  if (json_object_set_new_nocheck(obj, key, json_stringn_nocheck(s, strlen(s))) != 0)
    return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "kvf_geometry_to_json: out of memory");
  return KVF_SUCCESS;
}

/* obj[key] = v. Geometry files hold integers up to 2^63-1 (jansson's range);
 * only the stride of a dimension with a single element can exceed it. */
static kvf_status kvf_json_put_u64(json_t *obj, const char *key, uint64_t v, const char *where) {
  if (v > (uint64_t)INT64_MAX)
    return kvf_fail(KVF_ERR_OVERFLOW,
                    "kvf_geometry_to_json: %s%s%s: %llu is larger than 2^63-1, the largest integer a geometry "
                    "file holds",
                    where, where[0] != '\0' ? "." : "", key, (unsigned long long)v);
  if (json_object_set_new_nocheck(obj, key, json_integer((json_int_t)v)) != 0)
    return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "kvf_geometry_to_json: out of memory");
  return KVF_SUCCESS;
}

/* obj[key] = value, taking the reference (also on failure). */
static kvf_status kvf_json_put(json_t *obj, const char *key, json_t *value) {
  if (json_object_set_new_nocheck(obj, key, value) != 0)
    return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "kvf_geometry_to_json: out of memory");
  return KVF_SUCCESS;
}

/* arr += value, taking the reference (also on failure). */
static kvf_status kvf_json_append(json_t *arr, json_t *value) {
  if (json_array_append_new(arr, value) != 0)
    return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "kvf_geometry_to_json: out of memory");
  return KVF_SUCCESS;
}

/* Give every unnamed entry of names[0..n) the name "<stem><i>", or
 * "<stem><i>_<k>" when that is some other entry's name. Generated names
 * cannot collide with each other: only entry i generates "<stem><i>...". */
static void kvf_json_name_unnamed(char (*names)[KVF_NAME_MAX], uint32_t n, const char *stem) {
  for (uint32_t i = 0; i < n; ++i) {
    if (names[i][0] != '\0') continue;
    char candidate[KVF_NAME_MAX];
    for (uint32_t k = 0;; ++k) {
      int taken = 0;
      if (k == 0)
        snprintf(candidate, sizeof candidate, "%s%u", stem, i);
      else
        snprintf(candidate, sizeof candidate, "%s%u_%u", stem, i, k);
      for (uint32_t j = 0; j < n && !taken; ++j) taken = j != i && strcmp(names[j], candidate) == 0;
      if (!taken) break;
    }
    memcpy(names[i], candidate, sizeof candidate);
  }
}

static kvf_status kvf_json_write_regions(kvf_json_writer *w, const kvf_geometry *g, json_t *root) {
  uint32_t n = kvf_geometry_num_regions(g);
  json_t *arr = json_array();
  kvf_status st = kvf_json_put(root, "regions", arr);
  if (st != KVF_SUCCESS) return st;
  for (uint32_t i = 0; i < n; ++i) {
    kvf_region_info info = KVF_REGION_INFO_INIT;
    if ((st = kvf_geometry_region(g, i, &info)) != KVF_SUCCESS) return st;
    snprintf(w->region_names[i], KVF_NAME_MAX, "%s", info.name);
  }
  kvf_json_name_unnamed(w->region_names, n, "region");
  for (uint32_t i = 0; i < n; ++i) {
    char where[KVF_JSON_PATH_MAX];
    kvf_region_info info = KVF_REGION_INFO_INIT;
    json_t *obj = json_object();
    snprintf(where, sizeof where, "regions[%u]", i);
    if ((st = kvf_json_append(arr, obj)) != KVF_SUCCESS ||
        (st = kvf_geometry_region(g, i, &info)) != KVF_SUCCESS ||
        (st = kvf_json_put_string(obj, "name", w->region_names[i], where)) != KVF_SUCCESS ||
        (st = kvf_json_put_u64(obj, "size", info.size, where)) != KVF_SUCCESS ||
        (st = kvf_json_put_u64(obj, "align", info.align, where)) != KVF_SUCCESS)
      return st;
  }
  return KVF_SUCCESS;
}

/* The attention keys of a layer entry: planes, heads, head_bytes (one per
 * plane), and the three strides, all explicit. */
static kvf_status kvf_json_write_attention(json_t *obj, const kvf_view_desc *v, const char *where) {
  json_t *hb = NULL; /* created where obj takes it, so no failure path owns it */
  kvf_status st;
  if ((st = kvf_json_put_u64(obj, "planes", v->planes, where)) != KVF_SUCCESS ||
      (st = kvf_json_put_u64(obj, "heads", v->heads, where)) != KVF_SUCCESS ||
      (st = kvf_json_put(obj, "head_bytes", hb = json_array())) != KVF_SUCCESS)
    return st;
  /* Finalize allows 1 or 2 planes, and head_bytes beyond them are 0. */
  for (uint32_t p = 0; p < v->planes && p < KVF_MAX_PLANES; ++p)
    if ((st = kvf_json_append(hb, json_integer((json_int_t)v->head_bytes[p]))) != KVF_SUCCESS) return st;
  if ((st = kvf_json_put_u64(obj, "plane_stride", v->plane_stride, where)) != KVF_SUCCESS ||
      (st = kvf_json_put_u64(obj, "token_stride", v->token_stride, where)) != KVF_SUCCESS ||
      (st = kvf_json_put_u64(obj, "head_stride", v->head_stride, where)) != KVF_SUCCESS)
    return st;
  return KVF_SUCCESS;
}

static kvf_status kvf_json_write_states(json_t *obj, const kvf_view_desc *v, const char *where) {
  json_t *arr = json_array();
  kvf_status st = kvf_json_put(obj, "states", arr);
  if (st != KVF_SUCCESS) return st;
  for (uint32_t s = 0; s < v->num_states && s < KVF_MAX_STATES; ++s) {
    char swhere[KVF_JSON_PATH_MAX];
    json_t *so = json_object();
    snprintf(swhere, sizeof swhere, "%s.states[%u]", where, s);
    if ((st = kvf_json_append(arr, so)) != KVF_SUCCESS ||
        (st = kvf_json_put_u64(so, "offset", v->states[s].offset, swhere)) != KVF_SUCCESS ||
        (st = kvf_json_put_u64(so, "bytes", v->states[s].bytes, swhere)) != KVF_SUCCESS)
      return st;
  }
  return KVF_SUCCESS;
}

static kvf_status kvf_json_write_layer(const kvf_json_writer *w, const kvf_geometry *g, json_t *layers,
                                       uint32_t group, kvf_group_kind kind, uint32_t layer,
                                       const char *gwhere) {
  char where[KVF_JSON_LAYER_PATH_MAX];
  kvf_view_desc v = KVF_VIEW_DESC_INIT;
  json_t *obj = json_object();
  kvf_status st;
  snprintf(where, sizeof where, "%s.layers[%u]", gwhere, layer);
  if ((st = kvf_json_append(layers, obj)) != KVF_SUCCESS ||
      (st = kvf_geometry_view(g, group, layer, &v)) != KVF_SUCCESS)
    return st;
  /* Layer names are optional in files: an unnamed view stays unnamed. */
  if (v.name != NULL && v.name[0] != '\0' && (st = kvf_json_put_string(obj, "name", v.name, where)) != KVF_SUCCESS)
    return st;
  if ((st = kvf_json_put_string(obj, "region", w->region_names[v.region], where)) != KVF_SUCCESS ||
      (st = kvf_json_put_u64(obj, "offset", v.offset, where)) != KVF_SUCCESS ||
      (st = kvf_json_put_u64(obj, "elem_bytes", v.elem_bytes, where)) != KVF_SUCCESS ||
      (st = kvf_json_put_u64(obj, "block_stride", v.block_stride, where)) != KVF_SUCCESS)
    return st;
  st = kind == KVF_GROUP_RECURRENT ? kvf_json_write_states(obj, &v, where) : kvf_json_write_attention(obj, &v, where);
  if (st != KVF_SUCCESS) return st;
  if (v.alias_group >= 0) {
    char awhere[KVF_JSON_PATH_MAX];
    json_t *ao = json_object();
    snprintf(awhere, sizeof awhere, "%s.alias_of", where);
    if ((st = kvf_json_put(obj, "alias_of", ao)) != KVF_SUCCESS ||
        (st = kvf_json_put_string(ao, "group", w->group_names[v.alias_group], awhere)) != KVF_SUCCESS ||
        (st = kvf_json_put_u64(ao, "layer", (uint64_t)v.alias_layer, awhere)) != KVF_SUCCESS)
      return st;
  }
  return KVF_SUCCESS;
}

static kvf_status kvf_json_write_groups(kvf_json_writer *w, const kvf_geometry *g, json_t *root) {
  uint32_t n = kvf_geometry_num_groups(g);
  json_t *arr = json_array();
  kvf_status st = kvf_json_put(root, "groups", arr);
  if (st != KVF_SUCCESS) return st;
  for (uint32_t i = 0; i < n; ++i) {
    kvf_group_info info = KVF_GROUP_INFO_INIT;
    if ((st = kvf_geometry_group(g, i, &info)) != KVF_SUCCESS) return st;
    snprintf(w->group_names[i], KVF_NAME_MAX, "%s", info.name);
  }
  kvf_json_name_unnamed(w->group_names, n, "group");
  for (uint32_t i = 0; i < n; ++i) {
    char where[KVF_JSON_GROUP_PATH_MAX];
    kvf_group_info info = KVF_GROUP_INFO_INIT;
    json_t *obj = json_object();
    json_t *layers = NULL;
    snprintf(where, sizeof where, "groups[%u]", i);
    if ((st = kvf_json_append(arr, obj)) != KVF_SUCCESS ||
        (st = kvf_geometry_group(g, i, &info)) != KVF_SUCCESS ||
        (st = kvf_json_put_string(obj, "name", w->group_names[i], where)) != KVF_SUCCESS ||
        (st = kvf_json_put(obj, "kind", json_string(kvf_group_kind_name(info.kind)))) != KVF_SUCCESS ||
        /* Written for recurrent groups too: the loader's default of 1 need not be what the builder got. */
        (st = kvf_json_put_u64(obj, "block_size", info.block_size, where)) != KVF_SUCCESS ||
        (st = kvf_json_put_u64(obj, "num_blocks", info.num_blocks, where)) != KVF_SUCCESS ||
        (info.kind == KVF_GROUP_SLIDING_WINDOW &&
         (st = kvf_json_put_u64(obj, "window", info.window, where)) != KVF_SUCCESS) ||
        (info.kind == KVF_GROUP_CHUNKED_LOCAL &&
         (st = kvf_json_put_u64(obj, "chunk", info.chunk, where)) != KVF_SUCCESS) ||
        (st = kvf_json_put(obj, "layers", layers = json_array())) != KVF_SUCCESS)
      return st;
    for (uint32_t l = 0; l < info.num_layers; ++l)
      if ((st = kvf_json_write_layer(w, g, layers, i, info.kind, l, where)) != KVF_SUCCESS) return st;
  }
  return KVF_SUCCESS;
}

static kvf_status kvf_json_write_tail(const kvf_geometry *g, json_t *root) {
  kvf_object_policy policy = KVF_OBJECT_POLICY_INIT;
  uint32_t world = 1;
  uint32_t rank = 0;
  json_t *objects = json_object();
  json_t *dcp = json_object();
  kvf_status st = kvf_json_put(root, "objects", objects);
  if (st != KVF_SUCCESS) {
    json_decref(dcp);
    return st;
  }
  if ((st = kvf_json_put(root, "dcp", dcp)) != KVF_SUCCESS ||
      (st = kvf_geometry_policy(g, &policy)) != KVF_SUCCESS ||
      (st = kvf_geometry_dcp(g, &world, &rank)) != KVF_SUCCESS ||
      (st = kvf_json_put_u64(objects, "chunk_tokens", policy.chunk_tokens, "objects")) != KVF_SUCCESS ||
      (st = kvf_json_put(objects, "format", json_string(kvf_object_format_name(policy.format)))) != KVF_SUCCESS ||
      (st = kvf_json_put(objects, "separate_windowed", json_boolean(policy.separate_windowed))) != KVF_SUCCESS ||
      (st = kvf_json_put(objects, "separate_recurrent", json_boolean(policy.separate_recurrent))) != KVF_SUCCESS ||
      (st = kvf_json_put_u64(dcp, "world", world, "dcp")) != KVF_SUCCESS ||
      (st = kvf_json_put_u64(dcp, "rank", rank, "dcp")) != KVF_SUCCESS)
    return st;
  return KVF_SUCCESS;
}

/* json_dump_callback sink: append to w->text, refusing to grow past what the
 * loader reads back (KVF_JSON_MAX_BYTES). */
static int kvf_json_sink(const char *buffer, size_t size, void *data) {
  kvf_json_writer *w = data;
  if (size > KVF_JSON_MAX_BYTES - w->len) {
    w->too_large = 1;
    return -1;
  }
  if (w->len + size + 1 > w->cap) {
    size_t cap = w->cap != 0 ? w->cap : 16 << 10;
    char *grown;
    while (cap < w->len + size + 1) cap *= 2;
    grown = realloc(w->text, cap);
    if (grown == NULL) return -1;
    w->text = grown;
    w->cap = cap;
  }
  memcpy(w->text + w->len, buffer, size);
  w->len += size;
  w->text[w->len] = '\0';
  return 0;
}

kvf_status kvf_geometry_to_json(const kvf_geometry *geometry, char **json, size_t *len) {
  kvf_json_writer w;
  json_t *root = NULL;
  kvf_region_info first = KVF_REGION_INFO_INIT;
  const char *name;
  kvf_status st;

  memset(&w, 0, sizeof w);
  if (geometry == NULL || json == NULL)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_geometry_to_json: %s is NULL",
                    geometry == NULL ? "geometry" : "json");
  /* A finalized geometry has at least one region; an unfinalized one says STATE. */
  st = kvf_geometry_region(geometry, 0, &first);
  if (st == KVF_ERR_STATE)
    return kvf_fail(KVF_ERR_STATE, "kvf_geometry_to_json: the geometry is not finalized");
  if (st != KVF_SUCCESS) return st;

  w.region_names = calloc(kvf_geometry_num_regions(geometry), sizeof *w.region_names);
  root = json_object();
  if (w.region_names == NULL || root == NULL) {
    st = kvf_fail(KVF_ERR_OUT_OF_MEMORY, "kvf_geometry_to_json: out of memory");
    goto out;
  }
  name = kvf_geometry_name(geometry);
  if ((st = kvf_json_put(root, "format", json_string("kvferry-geometry"))) != KVF_SUCCESS ||
      (st = kvf_json_put(root, "version", json_integer(1))) != KVF_SUCCESS ||
      (st = kvf_json_put_string(root, "name", name[0] != '\0' ? name : KVF_JSON_DEFAULT_NAME, "")) != KVF_SUCCESS ||
      (st = kvf_json_put_string(root, "description", kvf_geometry_description(geometry), "")) != KVF_SUCCESS ||
      (st = kvf_json_write_regions(&w, geometry, root)) != KVF_SUCCESS ||
      (st = kvf_json_write_groups(&w, geometry, root)) != KVF_SUCCESS ||
      (st = kvf_json_write_tail(geometry, root)) != KVF_SUCCESS)
    goto out;
  if (json_dump_callback(root, kvf_json_sink, &w, JSON_COMPACT | JSON_PRESERVE_ORDER) != 0) {
    st = w.too_large ? kvf_fail(KVF_ERR_OVERFLOW,
                                "kvf_geometry_to_json: the geometry file would exceed the %zu MiB the loader reads",
                                KVF_JSON_MAX_BYTES >> 20)
                     : kvf_fail(KVF_ERR_OUT_OF_MEMORY, "kvf_geometry_to_json: out of memory");
    goto out;
  }
  *json = w.text;
  if (len != NULL) *len = w.len;
  w.text = NULL;

out:
  free(w.text);
  json_decref(root);
  free(w.region_names);
  return st;
}
