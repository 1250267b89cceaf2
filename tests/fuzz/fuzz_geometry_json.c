/* libFuzzer target: kvf_geometry_load_buffer on arbitrary bytes.
 *
 * Any input must either load (and then every read call must work on it) or
 * fail with a parse, validation or overflow status and a message; nothing
 * may crash, leak, hang or trip a sanitizer. Seeds: the presets (geometry/presets)
 * and tests/fuzz/corpus/. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <kvferry/geometry.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* A broken invariant is a finding: abort so libFuzzer saves the input. */
#define KVF_FUZZ_REQUIRE(cond) \
  do {                         \
    if (!(cond)) abort();      \
  } while (0)

static void kvf_fuzz_read(const kvf_geometry *g) {
  uint32_t world = 0, rank = 0;
  kvf_object_policy policy = KVF_OBJECT_POLICY_INIT;
  KVF_FUZZ_REQUIRE(kvf_geometry_num_groups(g) > 0 && kvf_geometry_num_regions(g) > 0);
  KVF_FUZZ_REQUIRE(kvf_geometry_policy(g, &policy) == KVF_SUCCESS);
  KVF_FUZZ_REQUIRE(kvf_geometry_dcp(g, &world, &rank) == KVF_SUCCESS && rank < world);
  KVF_FUZZ_REQUIRE(kvf_geometry_name(g) != NULL && kvf_geometry_description(g) != NULL);
  (void)kvf_geometry_fingerprint(g, KVF_FORMAT_CANONICAL);
  (void)kvf_geometry_fingerprint(g, KVF_FORMAT_NATIVE);
  for (uint32_t r = 0; r < kvf_geometry_num_regions(g); ++r) {
    kvf_region_info info = KVF_REGION_INFO_INIT;
    KVF_FUZZ_REQUIRE(kvf_geometry_region(g, r, &info) == KVF_SUCCESS && info.size > 0);
    KVF_FUZZ_REQUIRE(info.name != NULL && strlen(info.name) < KVF_NAME_MAX);
  }
  for (uint32_t gi = 0; gi < kvf_geometry_num_groups(g); ++gi) {
    kvf_group_info info = KVF_GROUP_INFO_INIT;
    uint64_t begin, first, end;
    KVF_FUZZ_REQUIRE(kvf_geometry_group(g, gi, &info) == KVF_SUCCESS);
    KVF_FUZZ_REQUIRE(info.name != NULL && strlen(info.name) < KVF_NAME_MAX);
    KVF_FUZZ_REQUIRE(info.object_group < kvf_geometry_num_object_groups(g));
    for (uint32_t l = 0; l < info.num_layers; ++l) {
      kvf_view_desc v = KVF_VIEW_DESC_INIT;
      uint64_t offset, bytes;
      KVF_FUZZ_REQUIRE(kvf_geometry_view(g, gi, l, &v) == KVF_SUCCESS);
      KVF_FUZZ_REQUIRE(v.region < kvf_geometry_num_regions(g));
      KVF_FUZZ_REQUIRE(v.name != NULL && strlen(v.name) < KVF_NAME_MAX); /* still valid memory */
      KVF_FUZZ_REQUIRE(kvf_geometry_object_segment(g, KVF_FORMAT_CANONICAL, gi, l, 0, policy.chunk_tokens, &offset,
                                                   &bytes) == KVF_SUCCESS);
      KVF_FUZZ_REQUIRE(kvf_geometry_object_segment(g, KVF_FORMAT_NATIVE, gi, l, 0, policy.chunk_tokens, &offset,
                                                   &bytes) == KVF_SUCCESS);
    }
    (void)kvf_geometry_retained_tokens(g, gi, 3 * (uint64_t)policy.chunk_tokens + 1, &begin);
    (void)kvf_geometry_retained_blocks(g, gi, 3 * (uint64_t)policy.chunk_tokens + 1, &first, &end);
  }
  for (uint32_t o = 0; o < kvf_geometry_num_object_groups(g); ++o) {
    uint64_t bytes;
    kvf_object_header header;
    KVF_FUZZ_REQUIRE(kvf_geometry_object_size(g, o, 0, policy.chunk_tokens, &bytes) == KVF_SUCCESS);
    KVF_FUZZ_REQUIRE(kvf_object_header_init(g, KVF_FORMAT_CANONICAL, o, 0, policy.chunk_tokens, &header) ==
                     KVF_SUCCESS);
    KVF_FUZZ_REQUIRE(kvf_object_header_check(g, &header, o) == KVF_SUCCESS);
  }
}

static void kvf_fuzz_load(const uint8_t *data, size_t size, const kvf_geometry_load_options *options) {
  kvf_geometry *g = NULL;
  kvf_geometry_error error;
  kvf_status st = kvf_geometry_load_buffer((const char *)data, size, options, &g, &error);
  if (st == KVF_SUCCESS) {
    KVF_FUZZ_REQUIRE(g != NULL);
    kvf_fuzz_read(g);
  } else {
    /* The documented failures of a load from memory, each with a message. */
    KVF_FUZZ_REQUIRE(g == NULL);
    KVF_FUZZ_REQUIRE(st == KVF_ERR_PARSE || st == KVF_ERR_INVALID_GEOMETRY || st == KVF_ERR_OVERFLOW ||
                     st == KVF_ERR_OUT_OF_MEMORY);
    KVF_FUZZ_REQUIRE(kvf_last_error()[0] != '\0' && error.status == st);
  }
  kvf_geometry_destroy(g);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  kvf_geometry_load_options options = KVF_GEOMETRY_LOAD_OPTIONS_INIT;
  kvf_fuzz_load(data, size, NULL);
  /* Again with a block-count override, which changes every size product. */
  options.num_blocks_override = 1u + (uint32_t)(size % 7u);
  kvf_fuzz_load(data, size, &options);
  return 0;
}
