// The one rule for versioned structs (kvferry/kvferry.h, "Versioned
// structs"; common/versioned.h): the helper itself, then every versioned
// struct, public and internal, through the real function that takes it:
//   (1) an older caller's smaller struct_size works, the fields it lacks
//       take their defaults (inputs) or are never written (outputs);
//   (2) a newer caller's larger struct_size whose extra bytes are zero works
//       the same, and the extra bytes are never written;
//   (3) extra bytes that are not zero are refused, naming the struct, with
//       the caller's struct untouched;
//   (4) struct_size 0, below the 8-byte header or above 64 KiB, and version
//       0, are refused naming the struct and the field.
#include <gtest/gtest.h>

#include <ftw.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cctype>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>

#include <kvferry/kvferry.h>

#include "common/clock.h"
#include "common/error.h"
#include "common/versioned.h"
#include "host/core/topology.h"
#include "host/server/registry.h"
#include "host/server/server.h"

#include "server_test_util.h"

namespace {

using kvf_server_test::kTinyGeometry;

bool Has(const std::string &haystack, const std::string &needle) { return haystack.find(needle) != std::string::npos; }

std::string InitMacro(const std::string &name) {
  std::string s;
  for (char ch : name) s += (char)std::toupper((unsigned char)ch);
  return s + "_INIT";
}

// ---- the helper ------------------------------------------------------------------

// A struct of this library's (as the helper sees it), and the same struct as
// an older header had it (without `c`).
struct Sample {
  uint32_t struct_size;
  uint32_t version;
  uint32_t a;
  uint32_t pad; /* explicit: no hidden padding in these tests */
  uint64_t b;
  uint64_t c;
};
const Sample kSampleInit = {sizeof(Sample), 1, 7, 0, 8, 9};

struct Buffer {
  alignas(16) unsigned char bytes[256];
  Buffer() { memset(bytes, 0, sizeof bytes); }
  void header(uint32_t size, uint32_t version) {
    memcpy(bytes, &size, 4);
    memcpy(bytes + 4, &version, 4);
  }
  uint32_t size() const {
    uint32_t s;
    memcpy(&s, bytes, 4);
    return s;
  }
};

TEST(Versioned, InTakesAnOlderCallersFieldsAndDefaultsTheRest) {
  Sample caller = {offsetof(Sample, c), 1, 70, 0, 80, 90};
  Sample local = kSampleInit;
  ASSERT_EQ(kvf_versioned_in(&local, sizeof local, &caller, "kvf_sample"), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(local.a, 70u);
  EXPECT_EQ(local.b, 80u);
  EXPECT_EQ(local.c, 9u) << "past the caller's struct_size: the default";
  EXPECT_EQ(local.struct_size, sizeof(Sample)) << "the library's copy keeps its own header";
  EXPECT_EQ(local.version, 1u);
}

TEST(Versioned, InTakesEveryFieldOfACallerOfTheSameSize) {
  Sample caller = {sizeof(Sample), 5, 70, 0, 80, 90};
  Sample local = kSampleInit;
  ASSERT_EQ(kvf_versioned_in(&local, sizeof local, &caller, "kvf_sample"), KVF_SUCCESS);
  EXPECT_EQ(local.c, 90u);
  EXPECT_EQ(local.version, 1u) << "a version is informational: the size decides";
}

TEST(Versioned, InAcceptsAHeaderOnlyStruct) {
  Sample caller = {8, 1, 70, 0, 80, 90};
  Sample local = kSampleInit;
  ASSERT_EQ(kvf_versioned_in(&local, sizeof local, &caller, "kvf_sample"), KVF_SUCCESS);
  EXPECT_EQ(local.a, 7u);
  EXPECT_EQ(local.b, 8u);
  EXPECT_EQ(local.c, 9u);
}

TEST(Versioned, InAcceptsANewerCallersZeroTail) {
  Buffer buf;
  Sample s = {0, 1, 70, 0, 80, 90};
  memcpy(buf.bytes, &s, sizeof s);
  buf.header(sizeof buf.bytes, 3);
  Sample local = kSampleInit;
  ASSERT_EQ(kvf_versioned_in(&local, sizeof local, buf.bytes, "kvf_sample"), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(local.c, 90u);
  EXPECT_EQ(local.struct_size, sizeof(Sample));
}

TEST(Versioned, RefusesANewerCallersNonzeroTailNamingTheByte) {
  Buffer buf;
  memcpy(buf.bytes, &kSampleInit, 24);  // as if this library's struct were 24 bytes
  buf.header(96, 1);
  buf.bytes[40] = 1;
  Sample local = kSampleInit;
  local.a = 1234;
  EXPECT_EQ(kvf_versioned_in(&local, 24, buf.bytes, "kvf_xfer_options"), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_STREQ(kvf_last_error(),
               "kvf_xfer_options: struct_size 96 is larger than this library's 24 and byte 40 is not zero: "
               "built against a newer kvferry?");
  EXPECT_EQ(local.a, 1234u) << "local is untouched on failure";
  // Bytes the library knows may hold anything; only the tail must be zero.
  buf.bytes[40] = 0;
  buf.bytes[23] = 0xff;
  EXPECT_EQ(kvf_versioned_in(&local, 24, buf.bytes, "kvf_xfer_options"), KVF_SUCCESS) << kvf_last_error();
  // The last byte of the caller's struct counts too.
  buf.bytes[95] = 2;
  EXPECT_EQ(kvf_versioned_in(&local, 24, buf.bytes, "kvf_xfer_options"), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(Has(kvf_last_error(), "byte 95 is not zero")) << kvf_last_error();
}

TEST(Versioned, RefusesBadHeadersNamingTheStructAndTheField) {
  Sample local = kSampleInit;
  Sample caller = kSampleInit;
  caller.struct_size = 0;
  EXPECT_EQ(kvf_versioned_in(&local, sizeof local, &caller, "kvf_client_options"), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_STREQ(kvf_last_error(), "kvf_client_options.struct_size 0: fill it from KVF_CLIENT_OPTIONS_INIT");
  caller.struct_size = 7;
  EXPECT_EQ(kvf_versioned_in(&local, sizeof local, &caller, "kvf_client_options"), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_STREQ(kvf_last_error(),
               "kvf_client_options.struct_size 7 is smaller than its 8-byte header: fill it from "
               "KVF_CLIENT_OPTIONS_INIT");
  caller.struct_size = KVF_VERSIONED_MAX_BYTES + 1;
  EXPECT_EQ(kvf_versioned_in(&local, sizeof local, &caller, "kvf_client_options"), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(Has(kvf_last_error(), "kvf_client_options.struct_size 65537 is larger than the 65536 bytes"))
      << kvf_last_error();
  caller = kSampleInit;
  caller.version = 0;
  EXPECT_EQ(kvf_versioned_in(&local, sizeof local, &caller, "kvf_client_options"), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_STREQ(kvf_last_error(), "kvf_client_options.version 0: fill it from KVF_CLIENT_OPTIONS_INIT");
  EXPECT_EQ(kvf_versioned_in(&local, sizeof local, nullptr, "kvf_client_options"), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_STREQ(kvf_last_error(), "kvf_client_options is NULL");
  EXPECT_EQ(memcmp(&local, &kSampleInit, sizeof local), 0) << "local is untouched on failure";
}

TEST(Versioned, AcceptsTheLargestSize) {
  std::unique_ptr<unsigned char[]> big(new unsigned char[KVF_VERSIONED_MAX_BYTES]());
  uint32_t size = KVF_VERSIONED_MAX_BYTES, version = 1;
  memcpy(big.get(), &size, 4);
  memcpy(big.get() + 4, &version, 4);
  Sample local = kSampleInit;
  EXPECT_EQ(kvf_versioned_check(big.get(), sizeof local, "kvf_sample"), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(kvf_versioned_in(&local, sizeof local, big.get(), "kvf_sample"), KVF_SUCCESS);
  EXPECT_EQ(local.a, 0u);
  big[KVF_VERSIONED_MAX_BYTES - 1] = 1;
  EXPECT_EQ(kvf_versioned_check(big.get(), sizeof local, "kvf_sample"), KVF_ERR_INVALID_ARGUMENT);
}

TEST(Versioned, ReadsAnUnalignedCaller) {
  Buffer buf;
  Sample s = {offsetof(Sample, b), 1, 70, 0, 80, 90};
  memcpy(buf.bytes + 1, &s, sizeof s);
  Sample local = kSampleInit;
  ASSERT_EQ(kvf_versioned_in(&local, sizeof local, buf.bytes + 1, "kvf_sample"), KVF_SUCCESS);
  EXPECT_EQ(local.a, 70u);
  EXPECT_EQ(local.b, 8u);
}

TEST(Versioned, OutWritesOnlyWhatFitsAnOlderCaller) {
  Buffer buf;
  memset(buf.bytes, 0x5a, sizeof buf.bytes);
  buf.header(offsetof(Sample, c), 1);
  const Sample local = {sizeof(Sample), 1, 70, 0, 80, 90};
  ASSERT_EQ(kvf_versioned_out(buf.bytes, &local, sizeof local, "kvf_sample"), KVF_SUCCESS);
  Sample got;
  memcpy(&got, buf.bytes, sizeof got);
  EXPECT_EQ(got.struct_size, offsetof(Sample, c)) << "the caller's header is never rewritten";
  EXPECT_EQ(got.version, 1u);
  EXPECT_EQ(got.a, 70u);
  EXPECT_EQ(got.b, 80u);
  for (size_t i = offsetof(Sample, c); i < sizeof buf.bytes; i++) ASSERT_EQ(buf.bytes[i], 0x5a) << "byte " << i;
}

TEST(Versioned, OutLeavesANewerCallersTailAndHeaderAlone) {
  Buffer buf;
  buf.header(sizeof buf.bytes, 9);
  const Sample local = {sizeof(Sample), 1, 70, 0, 80, 90};
  ASSERT_EQ(kvf_versioned_out(buf.bytes, &local, sizeof local, "kvf_sample"), KVF_SUCCESS);
  Sample got;
  memcpy(&got, buf.bytes, sizeof got);
  EXPECT_EQ(got.struct_size, sizeof buf.bytes);
  EXPECT_EQ(got.version, 9u);
  EXPECT_EQ(got.c, 90u);
  for (size_t i = sizeof(Sample); i < sizeof buf.bytes; i++) ASSERT_EQ(buf.bytes[i], 0) << "byte " << i;
}

TEST(Versioned, OutWritesNothingOnFailure) {
  const Sample local = {sizeof(Sample), 1, 70, 0, 80, 90};
  for (uint32_t size : {0u, 4u, KVF_VERSIONED_MAX_BYTES + 1}) {
    Buffer buf;
    memset(buf.bytes, 0x5a, sizeof buf.bytes);
    buf.header(size, 1);
    Buffer before = buf;
    EXPECT_EQ(kvf_versioned_out(buf.bytes, &local, sizeof local, "kvf_sample"), KVF_ERR_INVALID_ARGUMENT) << size;
    EXPECT_EQ(memcmp(buf.bytes, before.bytes, sizeof buf.bytes), 0) << size;
  }
  Buffer buf;
  buf.header(sizeof buf.bytes, 1);
  buf.bytes[100] = 3;
  Buffer before = buf;
  EXPECT_EQ(kvf_versioned_out(buf.bytes, &local, sizeof local, "kvf_sample"), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(Has(kvf_last_error(), "kvf_sample: struct_size 256 is larger than this library's 32 and byte 100"))
      << kvf_last_error();
  EXPECT_EQ(memcmp(buf.bytes, before.bytes, sizeof buf.bytes), 0);
  EXPECT_EQ(kvf_versioned_out(nullptr, &local, sizeof local, "kvf_sample"), KVF_ERR_INVALID_ARGUMENT);
}

// ---- the rule, struct by struct -------------------------------------------------

// A caller's struct of type T as a caller built against another kvferry
// header passes it: sizeof(T) bytes of `value`, then kExtra more.
constexpr size_t kExtra = 64;
template <typename T>
struct Caller {
  alignas(16) unsigned char bytes[sizeof(T) + kExtra];
  explicit Caller(const T &value) {
    memset(bytes, 0, sizeof bytes);
    memcpy(bytes, &value, sizeof(T));
  }
  T *get() { return reinterpret_cast<T *>(bytes); }
  uint32_t size() const {
    uint32_t s;
    memcpy(&s, bytes, 4);
    return s;
  }
  uint32_t version() const {
    uint32_t v;
    memcpy(&v, bytes + 4, 4);
    return v;
  }
  void set_size(size_t n) {
    uint32_t s = (uint32_t)n;
    memcpy(bytes, &s, 4);
  }
  void set_version(uint32_t v) { memcpy(bytes + 4, &v, 4); }
  // Fill every byte from `from` on (an output's fields the caller lacks).
  void poison_from(size_t from, unsigned char with = 0x5a) { memset(bytes + from, with, sizeof bytes - from); }
  bool untouched_from(size_t from, unsigned char with = 0x5a) const {
    for (size_t i = from; i < sizeof bytes; i++)
      if (bytes[i] != with) return false;
    return true;
  }
};

// Cases (2), (3) and (4) for struct type T named `name`: `call` runs the
// real function on a caller's struct (and releases what it made), `init` is
// the struct as the test fills it, and `want` is what `call` returns for it.
template <typename T, typename Call>
void ExpectTheRule(const std::string &name, const T &init, Call call, kvf_status want) {
  SCOPED_TRACE(name);
  {
    Caller<T> plain(init);
    ASSERT_EQ(call(plain.get()), want) << kvf_last_error();
  }
  {  // (2) a newer caller, zero tail: works the same; nothing past sizeof(T) is written
    Caller<T> c(init);
    c.set_size(sizeof c.bytes);
    EXPECT_EQ(call(c.get()), want) << kvf_last_error();
    EXPECT_EQ(c.size(), sizeof c.bytes) << "the caller's struct_size is never rewritten";
    EXPECT_EQ(c.version(), init.version);
    EXPECT_TRUE(c.untouched_from(sizeof(T), 0)) << "the newer caller's fields are never written";
  }
  {  // (3) a newer caller, nonzero tail: refused, naming the struct and the byte; untouched
    Caller<T> c(init);
    c.set_size(sizeof c.bytes);
    c.bytes[sizeof(T) + 5] = 1;
    Caller<T> before = c;
    EXPECT_EQ(call(c.get()), KVF_ERR_INVALID_ARGUMENT);
    EXPECT_TRUE(Has(kvf_last_error(), name + ": struct_size " + std::to_string(sizeof c.bytes) +
                                          " is larger than this library's " + std::to_string(sizeof(T)) +
                                          " and byte " + std::to_string(sizeof(T) + 5) + " is not zero"))
        << kvf_last_error();
    EXPECT_EQ(memcmp(c.bytes, before.bytes, sizeof c.bytes), 0) << "touched on failure";
  }
  // (4) bad headers: refused, naming the struct and the field; untouched
  struct Bad {
    uint32_t size, version;
    std::string says;
  };
  const Bad bads[] = {
      {0, init.version, name + ".struct_size 0: fill it from " + InitMacro(name)},
      {4, init.version, name + ".struct_size 4 is smaller than its 8-byte header"},
      {KVF_VERSIONED_MAX_BYTES + 1, init.version, name + ".struct_size 65537 is larger than"},
      {(uint32_t)sizeof(T), 0, name + ".version 0: fill it from " + InitMacro(name)},
  };
  for (const Bad &b : bads) {
    Caller<T> c(init);
    c.set_size(b.size);
    c.set_version(b.version);
    Caller<T> before = c;
    EXPECT_EQ(call(c.get()), KVF_ERR_INVALID_ARGUMENT) << b.says;
    EXPECT_TRUE(Has(kvf_last_error(), b.says)) << "'" << kvf_last_error() << "' does not say '" << b.says << "'";
    EXPECT_EQ(memcmp(c.bytes, before.bytes, sizeof c.bytes), 0) << "touched on failure: " << b.says;
  }
}

// ---- geometry -------------------------------------------------------------------

struct GeometryDeleter {
  void operator()(kvf_geometry *g) const { kvf_geometry_destroy(g); }
};
using GeometryPtr = std::unique_ptr<kvf_geometry, GeometryDeleter>;

// One region, one full group of 4 blocks of 16 tokens, one layer of 2
// planes x 1 head x 128 bytes, chunks of 16 tokens.
struct Descs {
  kvf_region_desc region = KVF_REGION_DESC_INIT;
  kvf_group_desc group = KVF_GROUP_DESC_INIT;
  kvf_view_desc view = KVF_VIEW_DESC_INIT;
  kvf_object_policy policy = KVF_OBJECT_POLICY_INIT;
  Descs() {
    group.block_size = 16;
    group.num_blocks = 4;
    view.elem_bytes = 2;
    view.block_stride = 2048;
    view.planes = 2;
    view.heads = 1;
    view.plane_stride = 4 * 2048;
    view.token_stride = 128;
    view.head_stride = 128;
    view.head_bytes[0] = view.head_bytes[1] = 128;
    policy.chunk_tokens = 16;
  }
};

// Build and finalize a geometry from these descriptors; the first failing
// call's status.
kvf_status Build(const kvf_region_desc *r, const kvf_group_desc *gd, const kvf_view_desc *v,
                 const kvf_object_policy *p, GeometryPtr *out = nullptr) {
  kvf_geometry *raw = nullptr;
  kvf_status st = kvf_geometry_create(&raw);
  if (st) return st;
  GeometryPtr g(raw);
  if ((st = kvf_geometry_add_region(raw, r, nullptr)) || (st = kvf_geometry_add_group(raw, gd, nullptr)) ||
      (st = kvf_geometry_add_view(raw, 0, v, nullptr)) || (st = kvf_geometry_set_policy(raw, p)) ||
      (st = kvf_geometry_finalize(raw, nullptr)))
    return st;
  if (out) *out = std::move(g);
  return KVF_SUCCESS;
}

GeometryPtr Tiny() {
  Descs d;
  GeometryPtr g;
  EXPECT_EQ(Build(&d.region, &d.group, &d.view, &d.policy, &g), KVF_SUCCESS) << kvf_last_error();
  return g;
}

TEST(VersionedGeometry, RegionDesc) {
  Descs d;
  d.region.align = 4096;
  ExpectTheRule<kvf_region_desc>("kvf_region_desc", d.region,
                                 [&](kvf_region_desc *r) { return Build(r, &d.group, &d.view, &d.policy); },
                                 KVF_SUCCESS);
  // (1) a caller without `align`: the default (256), not the caller's 4096.
  Caller<kvf_region_desc> older(d.region);
  older.set_size(offsetof(kvf_region_desc, align));
  GeometryPtr g;
  ASSERT_EQ(Build(older.get(), &d.group, &d.view, &d.policy, &g), KVF_SUCCESS) << kvf_last_error();
  kvf_region_info ri = KVF_REGION_INFO_INIT;
  ASSERT_EQ(kvf_geometry_region(g.get(), 0, &ri), KVF_SUCCESS);
  EXPECT_EQ(ri.align, 256u);
  ASSERT_EQ(Build(&d.region, &d.group, &d.view, &d.policy, &g), KVF_SUCCESS);
  ASSERT_EQ(kvf_geometry_region(g.get(), 0, &ri), KVF_SUCCESS);
  EXPECT_EQ(ri.align, 4096u) << "the same field, from a caller of this size";
}

TEST(VersionedGeometry, GroupDesc) {
  Descs d;
  ExpectTheRule<kvf_group_desc>("kvf_group_desc", d.group,
                                [&](kvf_group_desc *gd) { return Build(&d.region, gd, &d.view, &d.policy); },
                                KVF_SUCCESS);
  // (1) a caller without `chunk`: a full group's chunk of 32 is an error,
  // unless the caller's struct ends before it (the default 0).
  d.group.chunk = 32;
  EXPECT_EQ(Build(&d.region, &d.group, &d.view, &d.policy), KVF_ERR_INVALID_GEOMETRY);
  Caller<kvf_group_desc> older(d.group);
  older.set_size(offsetof(kvf_group_desc, chunk));
  GeometryPtr g;
  ASSERT_EQ(Build(&d.region, older.get(), &d.view, &d.policy, &g), KVF_SUCCESS) << kvf_last_error();
  kvf_group_info gi = KVF_GROUP_INFO_INIT;
  ASSERT_EQ(kvf_geometry_group(g.get(), 0, &gi), KVF_SUCCESS);
  EXPECT_EQ(gi.chunk, 0u);
  EXPECT_EQ(gi.num_blocks, 4u);
}

TEST(VersionedGeometry, ViewDescIn) {
  Descs d;
  ExpectTheRule<kvf_view_desc>("kvf_view_desc", d.view,
                               [&](kvf_view_desc *v) { return Build(&d.region, &d.group, v, &d.policy); },
                               KVF_SUCCESS);
  // (1) a caller without `alias_layer`: it reads back as the default -1.
  d.view.alias_layer = 3;
  Caller<kvf_view_desc> older(d.view);
  older.set_size(offsetof(kvf_view_desc, alias_layer));
  GeometryPtr g;
  ASSERT_EQ(Build(&d.region, &d.group, older.get(), &d.policy, &g), KVF_SUCCESS) << kvf_last_error();
  kvf_view_desc v = KVF_VIEW_DESC_INIT;
  ASSERT_EQ(kvf_geometry_view(g.get(), 0, 0, &v), KVF_SUCCESS);
  EXPECT_EQ(v.alias_layer, -1);
  EXPECT_EQ(v.block_stride, 2048u);
  EXPECT_EQ(v.struct_size, sizeof(kvf_view_desc));
}

TEST(VersionedGeometry, ViewDescOut) {
  GeometryPtr g = Tiny();
  ASSERT_TRUE(g);
  const kvf_view_desc init = KVF_VIEW_DESC_INIT;
  ExpectTheRule<kvf_view_desc>("kvf_view_desc", init,
                               [&](kvf_view_desc *v) { return kvf_geometry_view(g.get(), 0, 0, v); }, KVF_SUCCESS);
  Caller<kvf_view_desc> older(init);
  older.poison_from(offsetof(kvf_view_desc, alias_layer));
  older.set_size(offsetof(kvf_view_desc, alias_layer));
  ASSERT_EQ(kvf_geometry_view(g.get(), 0, 0, older.get()), KVF_SUCCESS);
  EXPECT_EQ(older.get()->alias_group, -1);
  EXPECT_EQ(older.get()->token_stride, 128u);
  EXPECT_TRUE(older.untouched_from(offsetof(kvf_view_desc, alias_layer)));
  EXPECT_EQ(older.size(), offsetof(kvf_view_desc, alias_layer));
}

TEST(VersionedGeometry, ObjectPolicyIn) {
  Descs d;
  ExpectTheRule<kvf_object_policy>("kvf_object_policy", d.policy,
                                   [&](kvf_object_policy *p) { return Build(&d.region, &d.group, &d.view, p); },
                                   KVF_SUCCESS);
  // (1) a caller without `separate_recurrent`: the default 0.
  d.policy.separate_recurrent = 1;
  Caller<kvf_object_policy> older(d.policy);
  older.set_size(offsetof(kvf_object_policy, separate_recurrent));
  GeometryPtr g;
  ASSERT_EQ(Build(&d.region, &d.group, &d.view, older.get(), &g), KVF_SUCCESS) << kvf_last_error();
  kvf_object_policy p = KVF_OBJECT_POLICY_INIT;
  ASSERT_EQ(kvf_geometry_policy(g.get(), &p), KVF_SUCCESS);
  EXPECT_EQ(p.separate_recurrent, 0);
  EXPECT_EQ(p.chunk_tokens, 16u);
  ASSERT_EQ(Build(&d.region, &d.group, &d.view, &d.policy, &g), KVF_SUCCESS);
  ASSERT_EQ(kvf_geometry_policy(g.get(), &p), KVF_SUCCESS);
  EXPECT_EQ(p.separate_recurrent, 1);
}

TEST(VersionedGeometry, ObjectPolicyOut) {
  GeometryPtr g = Tiny();
  ASSERT_TRUE(g);
  const kvf_object_policy init = KVF_OBJECT_POLICY_INIT;
  ExpectTheRule<kvf_object_policy>("kvf_object_policy", init,
                                   [&](kvf_object_policy *p) { return kvf_geometry_policy(g.get(), p); },
                                   KVF_SUCCESS);
  Caller<kvf_object_policy> older(init);
  older.poison_from(offsetof(kvf_object_policy, separate_recurrent));
  older.set_size(offsetof(kvf_object_policy, separate_recurrent));
  ASSERT_EQ(kvf_geometry_policy(g.get(), older.get()), KVF_SUCCESS);
  EXPECT_EQ(older.get()->chunk_tokens, 16u);
  EXPECT_TRUE(older.untouched_from(offsetof(kvf_object_policy, separate_recurrent)));
}

TEST(VersionedGeometry, RegionInfo) {
  GeometryPtr g = Tiny();
  ASSERT_TRUE(g);
  const kvf_region_info init = KVF_REGION_INFO_INIT;
  ExpectTheRule<kvf_region_info>("kvf_region_info", init,
                                 [&](kvf_region_info *i) { return kvf_geometry_region(g.get(), 0, i); }, KVF_SUCCESS);
  Caller<kvf_region_info> older(init);
  older.poison_from(8);
  older.set_size(offsetof(kvf_region_info, num_views));
  ASSERT_EQ(kvf_geometry_region(g.get(), 0, older.get()), KVF_SUCCESS);
  EXPECT_EQ(older.get()->size, 16384u);
  EXPECT_EQ(older.get()->align, 256u);
  EXPECT_TRUE(older.untouched_from(offsetof(kvf_region_info, num_views)));
  EXPECT_EQ(older.size(), offsetof(kvf_region_info, num_views));
}

TEST(VersionedGeometry, GroupInfo) {
  GeometryPtr g = Tiny();
  ASSERT_TRUE(g);
  const kvf_group_info init = KVF_GROUP_INFO_INIT;
  ExpectTheRule<kvf_group_info>("kvf_group_info", init,
                                [&](kvf_group_info *i) { return kvf_geometry_group(g.get(), 0, i); }, KVF_SUCCESS);
  Caller<kvf_group_info> older(init);
  older.poison_from(8);
  older.set_size(offsetof(kvf_group_info, max_block_stride));
  ASSERT_EQ(kvf_geometry_group(g.get(), 0, older.get()), KVF_SUCCESS);
  EXPECT_EQ(older.get()->num_blocks, 4u);
  EXPECT_EQ(older.get()->payload_per_block, 2u * 16 * 128);
  EXPECT_TRUE(older.untouched_from(offsetof(kvf_group_info, max_block_stride)));
}

TEST(VersionedGeometry, ObjectGroupInfo) {
  GeometryPtr g = Tiny();
  ASSERT_TRUE(g);
  const kvf_object_group_info init = KVF_OBJECT_GROUP_INFO_INIT;
  ExpectTheRule<kvf_object_group_info>(
      "kvf_object_group_info", init,
      [&](kvf_object_group_info *i) { return kvf_geometry_object_group(g.get(), 0, i); }, KVF_SUCCESS);
  Caller<kvf_object_group_info> older(init);
  older.poison_from(8);
  older.set_size(offsetof(kvf_object_group_info, recurrent_bytes));
  ASSERT_EQ(kvf_geometry_object_group(g.get(), 0, older.get()), KVF_SUCCESS);
  EXPECT_EQ(older.get()->num_groups, 1u);
  EXPECT_EQ(older.get()->bytes_per_token, 2u * 128);
  EXPECT_TRUE(older.untouched_from(offsetof(kvf_object_group_info, recurrent_bytes)));
}

TEST(VersionedGeometry, LoadOptions) {
  kvf_geometry_load_options o = KVF_GEOMETRY_LOAD_OPTIONS_INIT;
  o.num_blocks_override = 8;
  auto load = [](const kvf_geometry_load_options *opt, uint32_t *num_blocks) {
    kvf_geometry *g = nullptr;
    kvf_status st = kvf_geometry_load_buffer(kTinyGeometry, strlen(kTinyGeometry), opt, &g, nullptr);
    if (st == KVF_SUCCESS && num_blocks) {
      kvf_group_info gi = KVF_GROUP_INFO_INIT;
      EXPECT_EQ(kvf_geometry_group(g, 0, &gi), KVF_SUCCESS);
      *num_blocks = gi.num_blocks;
    }
    kvf_geometry_destroy(g);
    return st;
  };
  ExpectTheRule<kvf_geometry_load_options>(
      "kvf_geometry_load_options", o, [&](kvf_geometry_load_options *opt) { return load(opt, nullptr); },
      KVF_SUCCESS);
  uint32_t blocks = 0;
  ASSERT_EQ(load(&o, &blocks), KVF_SUCCESS);
  EXPECT_EQ(blocks, 8u);
  // (1) a header-only caller: no override, the file's 4 blocks.
  Caller<kvf_geometry_load_options> older(o);
  older.set_size(offsetof(kvf_geometry_load_options, num_blocks_override));
  ASSERT_EQ(load(older.get(), &blocks), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(blocks, 4u);
}

// ---- copy requests and transfers ----------------------------------------------------

struct AlignedDeleter {
  void operator()(void *p) const { free(p); }
};

// A gather of chunk 0 (tokens [0, 16)) from block 1 of Tiny().
struct Request {
  std::unique_ptr<void, AlignedDeleter> cache{aligned_alloc(4096, 16384)};
  std::unique_ptr<void, AlignedDeleter> object{aligned_alloc(4096, 4096)};
  void *bases[1];
  void *objects[1];
  uint32_t ids[1] = {1};
  kvf_group_blocks groups[1];
  kvf_copy_request req = KVF_COPY_REQUEST_INIT;
  Request() {
    memset(cache.get(), 0x11, 16384);
    memset(object.get(), 0, 4096);
    bases[0] = cache.get();
    objects[0] = object.get();
    groups[0] = {ids, 0, 1};
    req.region_bases = bases;
    req.token_begin = 0;
    req.token_end = 16;
    req.groups = groups;
    req.objects = objects;
  }
};

TEST(VersionedCopy, CopyRequest) {
  GeometryPtr g = Tiny();
  ASSERT_TRUE(g);
  Request r;
  kvf_xfer *x = nullptr;
  ASSERT_EQ(kvf_xfer_create(g.get(), nullptr, &x), KVF_SUCCESS) << kvf_last_error();
  ExpectTheRule<kvf_copy_request>(
      "kvf_copy_request", r.req, [&](kvf_copy_request *q) { return kvf_copy_request_check(g.get(), q); },
      KVF_SUCCESS);
  ExpectTheRule<kvf_copy_request>(
      "kvf_copy_request", r.req, [&](kvf_copy_request *q) { return kvf_reference_gather(g.get(), q); },
      KVF_SUCCESS);
  ExpectTheRule<kvf_copy_request>(
      "kvf_copy_request", r.req, [&](kvf_copy_request *q) { return kvf_xfer_gather(x, q, nullptr); }, KVF_SUCCESS);
  ExpectTheRule<kvf_copy_request>(
      "kvf_copy_request", r.req, [&](kvf_copy_request *q) { return kvf_xfer_scatter(x, q, nullptr); }, KVF_SUCCESS);
  EXPECT_EQ(kvf_copy_request_chunks(g.get(), &r.req), 1u);
  Caller<kvf_copy_request> bad(r.req);
  bad.set_version(0);
  EXPECT_EQ(kvf_copy_request_chunks(g.get(), bad.get()), 0u) << "not a request: no chunks";

  // (1) a caller without `objects`: the default NULL, so a moving group
  // lacks its object; a table that moves nothing needs none.
  Caller<kvf_copy_request> older(r.req);
  older.set_size(offsetof(kvf_copy_request, objects));
  EXPECT_EQ(kvf_copy_request_check(g.get(), older.get()), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(Has(kvf_last_error(), "objects[0]: NULL")) << kvf_last_error();
  EXPECT_EQ(kvf_xfer_gather(x, older.get(), nullptr), KVF_ERR_INVALID_ARGUMENT);
  uint32_t skip[1] = {KVF_BLOCK_SKIP};
  kvf_group_blocks none[1] = {{skip, 0, 1}};
  older.get()->groups = none;
  EXPECT_EQ(kvf_copy_request_check(g.get(), older.get()), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(kvf_reference_gather(g.get(), older.get()), KVF_SUCCESS) << kvf_last_error();
  kvf_xfer_destroy(x);
}

TEST(VersionedCopy, XferOptions) {
  GeometryPtr g = Tiny();
  ASSERT_TRUE(g);
  auto create = [&](const kvf_xfer_options *o) {
    kvf_xfer *x = nullptr;
    kvf_status st = kvf_xfer_create(g.get(), o, &x);
    kvf_xfer_destroy(x);
    return st;
  };
  kvf_xfer_options o = KVF_XFER_OPTIONS_INIT;
  o.host_threads = 2;
  ExpectTheRule<kvf_xfer_options>("kvf_xfer_options", o, create, KVF_SUCCESS);
  // (1) a caller without `host_threads`: its 65 (over the limit) is not read.
  o.host_threads = 65;
  EXPECT_EQ(create(&o), KVF_ERR_INVALID_ARGUMENT);
  Caller<kvf_xfer_options> older(o);
  older.set_size(offsetof(kvf_xfer_options, host_threads));
  EXPECT_EQ(create(older.get()), KVF_SUCCESS) << kvf_last_error();
}

TEST(VersionedCopy, XferStats) {
  GeometryPtr g = Tiny();
  ASSERT_TRUE(g);
  Request r;
  kvf_xfer *x = nullptr;
  ASSERT_EQ(kvf_xfer_create(g.get(), nullptr, &x), KVF_SUCCESS);
  ASSERT_EQ(kvf_xfer_gather(x, &r.req, nullptr), KVF_SUCCESS) << kvf_last_error();
  const kvf_xfer_stats init = KVF_XFER_STATS_INIT;
  ExpectTheRule<kvf_xfer_stats>("kvf_xfer_stats", init, [&](kvf_xfer_stats *s) { return kvf_xfer_last_stats(x, s); },
                                KVF_SUCCESS);
  kvf_xfer_stats full = KVF_XFER_STATS_INIT;
  ASSERT_EQ(kvf_xfer_last_stats(x, &full), KVF_SUCCESS);
  EXPECT_EQ(full.payload_bytes, 4096u);
  // (1) a caller without `payload_bytes`: never written.
  Caller<kvf_xfer_stats> older(init);
  older.poison_from(8);
  older.set_size(offsetof(kvf_xfer_stats, payload_bytes));
  ASSERT_EQ(kvf_xfer_last_stats(x, older.get()), KVF_SUCCESS);
  EXPECT_EQ(older.get()->tasks, full.tasks);
  EXPECT_EQ(older.get()->route, KVF_ROUTE_HOST);
  EXPECT_TRUE(older.untouched_from(offsetof(kvf_xfer_stats, payload_bytes)));
  kvf_xfer_destroy(x);
}

// ---- device and topology ------------------------------------------------------------

TEST(VersionedDevice, CudaInfo) {
  kvf_cuda_info full = KVF_CUDA_INFO_INIT;
  kvf_status want = kvf_cuda_probe(&full);
  ASSERT_NE(want, KVF_ERR_INVALID_ARGUMENT) << kvf_last_error();
  const kvf_cuda_info init = KVF_CUDA_INFO_INIT;
  ExpectTheRule<kvf_cuda_info>("kvf_cuda_info", init, kvf_cuda_probe, want);
  // (1) a caller without `message`: the counts are written, the message not.
  Caller<kvf_cuda_info> older(init);
  older.poison_from(8);
  older.set_size(offsetof(kvf_cuda_info, message));
  EXPECT_EQ(kvf_cuda_probe(older.get()), want);
  EXPECT_EQ(older.get()->device_count, full.device_count);
  EXPECT_EQ(older.get()->driver_version, full.driver_version);
  EXPECT_TRUE(older.untouched_from(offsetof(kvf_cuda_info, message)));
}

struct TopologyDeleter {
  void operator()(kvf_topology *t) const { kvf_topology_destroy(t); }
};

// Two cores on one NUMA node and one GPU that hwloc cannot locate.
std::unique_ptr<kvf_topology, TopologyDeleter> FakeTopology() {
  static const kvf_topo_pci_id gpus[1] = {{0, 0, 0x3b, 0, 0}};
  kvf_topology_options o = {};
  o.synthetic = "numa:1 core:2 pu:1";
  o.gpus = gpus;
  o.num_gpus = 1;
  o.use_gpus = 1;
  kvf_topology *t = nullptr;
  EXPECT_EQ(kvf_topology_create_with(&o, &t), KVF_SUCCESS) << kvf_last_error();
  return std::unique_ptr<kvf_topology, TopologyDeleter>(t);
}

TEST(VersionedTopology, TopologyInfo) {
  auto t = FakeTopology();
  ASSERT_TRUE(t);
  const kvf_topology_info init = KVF_TOPOLOGY_INFO_INIT;
  ExpectTheRule<kvf_topology_info>("kvf_topology_info", init,
                                   [&](kvf_topology_info *i) { return kvf_topology_info_get(t.get(), i); },
                                   KVF_SUCCESS);
  Caller<kvf_topology_info> older(init);
  older.poison_from(8);
  older.set_size(offsetof(kvf_topology_info, gpu_note));
  ASSERT_EQ(kvf_topology_info_get(t.get(), older.get()), KVF_SUCCESS);
  EXPECT_EQ(older.get()->num_gpus, 1u);
  EXPECT_EQ(older.get()->num_cores, 2u);
  EXPECT_TRUE(older.untouched_from(offsetof(kvf_topology_info, gpu_note)));
}

TEST(VersionedTopology, NumaNodeInfo) {
  auto t = FakeTopology();
  ASSERT_TRUE(t);
  const kvf_numa_node_info init = KVF_NUMA_NODE_INFO_INIT;
  ExpectTheRule<kvf_numa_node_info>("kvf_numa_node_info", init,
                                    [&](kvf_numa_node_info *n) { return kvf_topology_numa_node(t.get(), 0, n); },
                                    KVF_SUCCESS);
  Caller<kvf_numa_node_info> older(init);
  older.poison_from(8);
  older.set_size(offsetof(kvf_numa_node_info, cpus));
  ASSERT_EQ(kvf_topology_numa_node(t.get(), 0, older.get()), KVF_SUCCESS);
  EXPECT_EQ(older.get()->num_cores, 2u);
  EXPECT_TRUE(older.untouched_from(offsetof(kvf_numa_node_info, cpus)));
}

TEST(VersionedTopology, GpuPlacement) {
  auto t = FakeTopology();
  ASSERT_TRUE(t);
  const kvf_gpu_placement init = KVF_GPU_PLACEMENT_INIT;
  ExpectTheRule<kvf_gpu_placement>("kvf_gpu_placement", init,
                                   [&](kvf_gpu_placement *p) { return kvf_topology_gpu(t.get(), 0, p); },
                                   KVF_SUCCESS);
  Caller<kvf_gpu_placement> older(init);
  older.poison_from(8);
  older.set_size(offsetof(kvf_gpu_placement, note));
  ASSERT_EQ(kvf_topology_gpu(t.get(), 0, older.get()), KVF_SUCCESS);
  EXPECT_EQ(older.get()->device, 0);
  EXPECT_EQ(older.get()->located, 0);
  EXPECT_TRUE(older.untouched_from(offsetof(kvf_gpu_placement, note)));
}

// ---- memory ---------------------------------------------------------------------------

// The name /proc gives an exported host allocation's memfd.
std::string MemfdName(kvf_mem_alloc *a) {
  int fd = -1;
  if (kvf_mem_alloc_export(a, &fd, nullptr) != KVF_SUCCESS) return "";
  char path[64], target[PATH_MAX];
  snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
  ssize_t n = readlink(path, target, sizeof target - 1);
  close(fd);
  return n > 0 ? std::string(target, (size_t)n) : "";
}

TEST(VersionedMemory, MemAllocOptions) {
  kvf_mem_alloc_options o = KVF_MEM_ALLOC_OPTIONS_INIT;
  o.size = 4096;
  o.name = "versioned-test";
  auto create = [](const kvf_mem_alloc_options *opt, std::string *name) {
    kvf_mem_alloc *a = nullptr;
    kvf_status st = kvf_mem_alloc_create(opt, &a);
    if (st == KVF_SUCCESS && name) *name = MemfdName(a);
    kvf_mem_alloc_destroy(a);
    return st;
  };
  ExpectTheRule<kvf_mem_alloc_options>(
      "kvf_mem_alloc_options", o, [&](kvf_mem_alloc_options *opt) { return create(opt, nullptr); }, KVF_SUCCESS);
  std::string name;
  ASSERT_EQ(create(&o, &name), KVF_SUCCESS);
  EXPECT_TRUE(Has(name, "memfd:versioned-test")) << name;
  // (1) a caller without `name`: the default name.
  Caller<kvf_mem_alloc_options> older(o);
  older.set_size(offsetof(kvf_mem_alloc_options, name));
  ASSERT_EQ(create(older.get(), &name), KVF_SUCCESS) << kvf_last_error();
  EXPECT_TRUE(Has(name, "memfd:kvferry")) << name;
}

TEST(VersionedMemory, ImportTableOptions) {
  auto create = [](const kvf_import_table_options *opt) {
    kvf_import_table *t = nullptr;
    kvf_status st = kvf_import_table_create(opt, &t);
    kvf_import_table_destroy(t);
    return st;
  };
  kvf_import_table_options o = KVF_IMPORT_TABLE_OPTIONS_INIT;
  ExpectTheRule<kvf_import_table_options>("kvf_import_table_options", o, create, KVF_SUCCESS);
  // (1) a caller without `num_access_devices`: its 65 (over the limit) is not read.
  o.num_access_devices = 65;
  EXPECT_EQ(create(&o), KVF_ERR_INVALID_ARGUMENT);
  Caller<kvf_import_table_options> older(o);
  older.set_size(offsetof(kvf_import_table_options, num_access_devices));
  EXPECT_EQ(create(older.get()), KVF_SUCCESS) << kvf_last_error();
}

TEST(VersionedMemory, ImportStats) {
  kvf_import_table *t = nullptr;
  ASSERT_EQ(kvf_import_table_create(nullptr, &t), KVF_SUCCESS);
  const kvf_import_stats init = KVF_IMPORT_STATS_INIT;
  ExpectTheRule<kvf_import_stats>("kvf_import_stats", init,
                                  [&](kvf_import_stats *s) { return kvf_import_table_stats(t, s); }, KVF_SUCCESS);
  ExpectTheRule<kvf_import_stats>("kvf_import_stats", init,
                                  [&](kvf_import_stats *s) { return kvf_import_table_client_stats(t, 1, s); },
                                  KVF_SUCCESS);
  for (int client = 0; client < 2; client++) {
    Caller<kvf_import_stats> older(init);
    older.poison_from(8);
    older.set_size(offsetof(kvf_import_stats, rollbacks_total));
    ASSERT_EQ(client ? kvf_import_table_client_stats(t, 1, older.get()) : kvf_import_table_stats(t, older.get()),
              KVF_SUCCESS);
    EXPECT_EQ(older.get()->registrations, 0u);
    EXPECT_EQ(older.get()->dedup_total, 0u);
    EXPECT_TRUE(older.untouched_from(offsetof(kvf_import_stats, rollbacks_total)));
  }
  kvf_import_table_destroy(t);
}

// ---- the server's internals -----------------------------------------------------------

int RemoveOne(const char *path, const struct stat *, int, struct FTW *) { return remove(path); }

class VersionedServer : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/kvf_versioned_test_XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    base_ = tmpl;
    dir_ = base_ + "/sock";
  }
  void TearDown() override { nftw(base_.c_str(), RemoveOne, 16, FTW_DEPTH | FTW_PHYS); }
  std::string base_, dir_;
};

TEST_F(VersionedServer, ServerOptions) {
  auto create = [](const kvf_server_options *o) {
    kvf_server *s = nullptr;
    kvf_status st = kvf_server_create(o, &s);
    kvf_server_destroy(s);
    return st;
  };
  kvf_server_options o = KVF_SERVER_OPTIONS_INIT;
  o.socket_dir = dir_.c_str();
  o.test_completion_delay_ms = 5;
  ExpectTheRule<kvf_server_options>("kvf_server_options", o, create, KVF_SUCCESS);
  // (1) a caller without `test_completion_delay_ms`.
  Caller<kvf_server_options> older(o);
  older.set_size(offsetof(kvf_server_options, test_completion_delay_ms));
  EXPECT_EQ(create(older.get()), KVF_SUCCESS) << kvf_last_error();
  // A caller without `socket_dir` has none: the default NULL is refused.
  older.set_size(offsetof(kvf_server_options, socket_dir));
  EXPECT_EQ(create(older.get()), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(Has(kvf_last_error(), "options.socket_dir")) << kvf_last_error();
}

TEST(VersionedRegistry, RegistryOptions) {
  kvf_import_table *t = nullptr;
  ASSERT_EQ(kvf_import_table_create(nullptr, &t), KVF_SUCCESS);
  auto create = [&](const kvf_registry_options *o) {
    kvf_registry *r = nullptr;
    kvf_status st = kvf_registry_create(t, o, &r);
    kvf_registry_destroy(r);
    return st;
  };
  kvf_registry_options o = KVF_REGISTRY_OPTIONS_INIT;
  o.completion_capacity = 16;
  ExpectTheRule<kvf_registry_options>("kvf_registry_options", o, create, KVF_SUCCESS);
  // (1) a header-only caller: its capacity over 2^24 is not read.
  o.completion_capacity = 1u << 25;
  EXPECT_EQ(create(&o), KVF_ERR_INVALID_ARGUMENT);
  Caller<kvf_registry_options> older(o);
  older.set_size(offsetof(kvf_registry_options, completion_capacity));
  EXPECT_EQ(create(older.get()), KVF_SUCCESS) << kvf_last_error();
  kvf_import_table_destroy(t);
}

TEST(VersionedRegistry, RegistryStats) {
  kvf_import_table *t = nullptr;
  ASSERT_EQ(kvf_import_table_create(nullptr, &t), KVF_SUCCESS);
  kvf_registry *r = nullptr;
  ASSERT_EQ(kvf_registry_create(t, nullptr, &r), KVF_SUCCESS);
  ASSERT_EQ(kvf_registry_client_open(r, 7, kvf_now_ns()), KVF_SUCCESS);
  const kvf_registry_stats init = KVF_REGISTRY_STATS_INIT;
  ExpectTheRule<kvf_registry_stats>("kvf_registry_stats", init,
                                    [&](kvf_registry_stats *s) { return kvf_registry_stats_get(r, s); }, KVF_SUCCESS);
  ExpectTheRule<kvf_registry_stats>("kvf_registry_stats", init,
                                    [&](kvf_registry_stats *s) { return kvf_registry_client_stats(r, 7, s); },
                                    KVF_SUCCESS);
  // An unknown client's counters are written (all 0) with KVF_ERR_NOT_FOUND.
  ExpectTheRule<kvf_registry_stats>("kvf_registry_stats", init,
                                    [&](kvf_registry_stats *s) { return kvf_registry_client_stats(r, 99, s); },
                                    KVF_ERR_NOT_FOUND);
  Caller<kvf_registry_stats> older(init);
  older.poison_from(8);
  older.set_size(offsetof(kvf_registry_stats, completions_evicted_total));
  ASSERT_EQ(kvf_registry_stats_get(r, older.get()), KVF_SUCCESS);
  EXPECT_EQ(older.get()->clients, 1u);
  EXPECT_EQ(older.get()->completions_duplicate_total, 0u);
  EXPECT_TRUE(older.untouched_from(offsetof(kvf_registry_stats, completions_evicted_total)));
  kvf_registry_destroy(r);
  kvf_import_table_destroy(t);
}

// ---- the client, against a server in this process -----------------------------------

class VersionedClient : public VersionedServer {
 protected:
  void SetUp() override {
    VersionedServer::SetUp();
    kvf_server_options so = KVF_SERVER_OPTIONS_INIT;
    so.socket_dir = dir_.c_str();
    ASSERT_EQ(server_.start(so), KVF_SUCCESS) << kvf_last_error();
    kvf_geometry *g = nullptr;
    ASSERT_EQ(kvf_geometry_load_buffer(kTinyGeometry, strlen(kTinyGeometry), nullptr, &g, nullptr), KVF_SUCCESS);
    kvf_region_info ri = KVF_REGION_INFO_INIT;
    ASSERT_EQ(kvf_geometry_region(g, 0, &ri), KVF_SUCCESS);
    region_bytes_ = ri.size;
    kvf_geometry_destroy(g);
    kvf_mem_alloc_options ao = KVF_MEM_ALLOC_OPTIONS_INIT;
    ao.size = 2 * region_bytes_;
    ASSERT_EQ(kvf_mem_alloc_create(&ao, &alloc_), KVF_SUCCESS) << kvf_last_error();
  }
  void TearDown() override {
    server_.stop();
    kvf_mem_alloc_destroy(alloc_);
    VersionedServer::TearDown();
  }

  kvf_client_options Options() const {
    kvf_client_options o = KVF_CLIENT_OPTIONS_INIT;
    o.socket_dir = dir_.c_str();
    o.name = "versioned";
    return o;
  }
  // A connected client (released at TearDown's disconnect by the caller).
  kvf_client *Connect() {
    kvf_client_options o = Options();
    kvf_client *c = nullptr;
    EXPECT_EQ(kvf_client_connect(&o, &c, nullptr), KVF_SUCCESS) << kvf_last_error();
    return c;
  }
  kvf_status Register(kvf_client *c) {
    kvf_client_region regs[2] = {{alloc_, 0, region_bytes_}, {alloc_, region_bytes_, region_bytes_}};
    return kvf_client_register(c, kTinyGeometry, strlen(kTinyGeometry), -1, regs, 2, nullptr);
  }

  kvf_server_test::InProcessServer server_;
  kvf_mem_alloc *alloc_ = nullptr;
  uint64_t region_bytes_ = 0;
};

// A STORE of chunk 0 (tokens [0, 16)) from block 0.
struct Store {
  kvf_chunk_key keys[1] = {{{0x12, 0x34}}};
  uint32_t ids[1] = {0};
  kvf_group_blocks groups[1];
  kvf_client_xfer x = KVF_CLIENT_XFER_INIT;
  Store() {
    groups[0] = {ids, 0, 1};
    x.token_begin = 0;
    x.token_end = 16;
    x.chunk_keys = keys;
    x.num_chunk_keys = 1;
    x.groups = groups;
    x.num_groups = 1;
  }
};

TEST_F(VersionedClient, ClientOptions) {
  auto connect = [](const kvf_client_options *o) {
    kvf_client *c = nullptr;
    kvf_status st = kvf_client_connect(o, &c, nullptr);
    kvf_client_disconnect(c);
    return st;
  };
  kvf_client_options o = Options();
  ExpectTheRule<kvf_client_options>("kvf_client_options", o, connect, KVF_SUCCESS);
  // (1) a caller without `heartbeat_period_ms`: its period, longer than the
  // server's timeout, is not read (the server's period is used).
  o.heartbeat_thread = 1;
  o.heartbeat_period_ms = 1000000;
  EXPECT_EQ(connect(&o), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(Has(kvf_last_error(), "heartbeat_period_ms")) << kvf_last_error();
  Caller<kvf_client_options> older(o);
  older.set_size(offsetof(kvf_client_options, heartbeat_period_ms));
  EXPECT_EQ(connect(older.get()), KVF_SUCCESS) << kvf_last_error();
}

TEST_F(VersionedClient, ClientRegisterDesc) {
  kvf_client *c = Connect();
  ASSERT_NE(c, nullptr);
  kvf_client_region regs[2] = {{alloc_, 0, region_bytes_}, {alloc_, region_bytes_, region_bytes_}};
  struct kvf_client_register_desc d = KVF_CLIENT_REGISTER_DESC_INIT;
  EXPECT_EQ(d.version, KVF_CLIENT_VERSION);
  EXPECT_EQ(KVF_CLIENT_VERSION, 2u);
  d.geometry_json = kTinyGeometry;
  d.geometry_len = strlen(kTinyGeometry);
  d.regions = regs;
  d.num_regions = 2;
  auto reg = [&](const struct kvf_client_register_desc *x) {
    kvf_status st = kvf_client_register_desc(c, x, nullptr);
    if (st == KVF_SUCCESS) {
      EXPECT_EQ(kvf_client_unregister(c, 0, nullptr), KVF_SUCCESS) << kvf_last_error();
    }
    return st;
  };
  ExpectTheRule<struct kvf_client_register_desc>("kvf_client_register_desc", d, reg, KVF_SUCCESS);
  // (1) a caller without the shard fields: shard 0 of 1, whatever its tail
  // would have said.
  d.shard_index = 5;
  d.shard_count = 2;
  EXPECT_EQ(reg(&d), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(Has(kvf_last_error(), "desc.shard_index")) << kvf_last_error();
  Caller<struct kvf_client_register_desc> older(d);
  older.set_size(offsetof(struct kvf_client_register_desc, shard_index));
  EXPECT_EQ(reg(older.get()), KVF_SUCCESS) << kvf_last_error();
  kvf_client_disconnect(c);
}

TEST_F(VersionedClient, ClientXfer) {
  kvf_client *c = Connect();
  ASSERT_NE(c, nullptr);
  ASSERT_EQ(Register(c), KVF_SUCCESS) << kvf_last_error();
  Store s;
  ExpectTheRule<kvf_client_xfer>("kvf_client_xfer", s.x,
                                 [&](kvf_client_xfer *x) { return kvf_client_store(c, x, nullptr); }, KVF_SUCCESS);
  ExpectTheRule<kvf_client_xfer>(
      "kvf_client_xfer", s.x,
      [&](kvf_client_xfer *x) {
        uint64_t id = 0;
        kvf_status st = kvf_client_submit(c, KVF_CLIENT_RETRIEVE, x, &id);
        if (st != KVF_SUCCESS) return st;
        kvf_client_result r = KVF_CLIENT_RESULT_INIT;
        return kvf_client_wait(c, id, 0, &r);
      },
      KVF_SUCCESS);
  // (1) a caller without `ready_event`: its 64 zero bytes (no event) are not read.
  static const uint8_t zeros[64] = {0};
  s.x.ready_event = zeros;
  EXPECT_EQ(kvf_client_store(c, &s.x, nullptr), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(Has(kvf_last_error(), "xfer.ready_event")) << kvf_last_error();
  Caller<kvf_client_xfer> older(s.x);
  older.set_size(offsetof(kvf_client_xfer, ready_event));
  EXPECT_EQ(kvf_client_store(c, older.get(), nullptr), KVF_SUCCESS) << kvf_last_error();
  kvf_client_disconnect(c);
}

TEST_F(VersionedClient, ClientResult) {
  kvf_client *c = Connect();
  ASSERT_NE(c, nullptr);
  ASSERT_EQ(Register(c), KVF_SUCCESS) << kvf_last_error();
  Store s;
  const kvf_client_result init = KVF_CLIENT_RESULT_INIT;
  ExpectTheRule<kvf_client_result>("kvf_client_result", init,
                                   [&](kvf_client_result *r) { return kvf_client_store(c, &s.x, r); }, KVF_SUCCESS);
  ExpectTheRule<kvf_client_result>("kvf_client_result", init,
                                   [&](kvf_client_result *r) { return kvf_client_retrieve(c, &s.x, r); },
                                   KVF_SUCCESS);
  // kvf_client_wait checks the struct before it waits: a refused call leaves
  // the reply to a later wait.
  ExpectTheRule<kvf_client_result>(
      "kvf_client_result", init,
      [&](kvf_client_result *r) {
        uint64_t id = 0;
        kvf_status st = kvf_client_submit(c, KVF_CLIENT_RETRIEVE, &s.x, &id);
        if (st != KVF_SUCCESS) return st;
        st = kvf_client_wait(c, id, 0, r);
        if (st == KVF_ERR_INVALID_ARGUMENT) {
          std::string why = kvf_last_error();
          kvf_client_result good = KVF_CLIENT_RESULT_INIT;
          EXPECT_EQ(kvf_client_wait(c, id, 0, &good), KVF_SUCCESS) << "the reply was kept: " << kvf_last_error();
          EXPECT_EQ(good.outcome, KVF_CLIENT_DONE);
          kvf_fail(st, "%s", why.c_str());  // the message the check wrote
        }
        return st;
      },
      KVF_SUCCESS);
  kvf_client_result full = KVF_CLIENT_RESULT_INIT;
  ASSERT_EQ(kvf_client_retrieve(c, &s.x, &full), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(full.prefix_tokens, 16u);
  EXPECT_EQ(full.num_object_groups, 1u);
  EXPECT_EQ(full.object_group_prefix[0], 16u);
  // (1) a caller without `object_group_prefix`: never written.
  Caller<kvf_client_result> older(init);
  older.poison_from(8);
  older.set_size(offsetof(kvf_client_result, object_group_prefix));
  ASSERT_EQ(kvf_client_retrieve(c, &s.x, older.get()), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(older.get()->outcome, KVF_CLIENT_DONE);
  EXPECT_EQ(older.get()->prefix_tokens, 16u);
  EXPECT_EQ(older.get()->num_object_groups, 1u);
  EXPECT_TRUE(older.untouched_from(offsetof(kvf_client_result, object_group_prefix)));
  kvf_client_disconnect(c);
}

TEST_F(VersionedClient, ClientInfo) {
  kvf_client_options o = Options();
  auto connect = [&](kvf_client_info *info) {
    kvf_client *c = nullptr;
    kvf_status st = kvf_client_connect(&o, &c, info);
    kvf_client_disconnect(c);
    return st;
  };
  const kvf_client_info init = KVF_CLIENT_INFO_INIT;
  ExpectTheRule<kvf_client_info>("kvf_client_info", init, connect, KVF_SUCCESS);
  // (1) a caller without `protocol_version`: never written.
  Caller<kvf_client_info> older(init);
  older.poison_from(8);
  older.set_size(offsetof(kvf_client_info, protocol_version));
  ASSERT_EQ(connect(older.get()), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(older.get()->boot_token, kvf_server_boot_token(server_.s));
  EXPECT_EQ(older.get()->server_pid, (uint32_t)getpid());
  EXPECT_TRUE(older.untouched_from(offsetof(kvf_client_info, protocol_version)));
}

TEST_F(VersionedClient, ClientRegistration) {
  kvf_client *c = Connect();
  ASSERT_NE(c, nullptr);
  kvf_client_region regs[2] = {{alloc_, 0, region_bytes_}, {alloc_, region_bytes_, region_bytes_}};
  auto reg = [&](kvf_client_registration *out) {
    return kvf_client_register(c, kTinyGeometry, strlen(kTinyGeometry), -1, regs, 2, out);
  };
  const kvf_client_registration init = KVF_CLIENT_REGISTRATION_INIT;
  ExpectTheRule<kvf_client_registration>("kvf_client_registration", init, reg, KVF_SUCCESS);
  // (1) a caller without `aliases`: never written.
  Caller<kvf_client_registration> older(init);
  older.poison_from(8);
  older.set_size(offsetof(kvf_client_registration, aliases));
  ASSERT_EQ(reg(older.get()), KVF_SUCCESS) << kvf_last_error();
  EXPECT_NE(older.get()->fingerprint, 0u);
  EXPECT_EQ(older.get()->imports, 1u);
  EXPECT_TRUE(older.untouched_from(offsetof(kvf_client_registration, aliases)));
  kvf_client_disconnect(c);
}

TEST_F(VersionedClient, ClientStats) {
  kvf_client *c = Connect();
  ASSERT_NE(c, nullptr);
  const kvf_client_stats init = KVF_CLIENT_STATS_INIT;
  ExpectTheRule<kvf_client_stats>("kvf_client_stats", init, [&](kvf_client_stats *s) { return kvf_client_stat(c, s); },
                                  KVF_SUCCESS);
  kvf_client_stat_record records[4];
  uint32_t count = 0;
  ExpectTheRule<kvf_client_stats>(
      "kvf_client_stats", init,
      [&](kvf_client_stats *s) { return kvf_client_stat_clients(c, s, records, 4, &count); }, KVF_SUCCESS);
  EXPECT_EQ(count, 1u);
  // (1) a caller without `lanes`: never written.
  for (int per_client = 0; per_client < 2; per_client++) {
    Caller<kvf_client_stats> older(init);
    older.poison_from(8);
    older.set_size(offsetof(kvf_client_stats, lanes));
    ASSERT_EQ(per_client ? kvf_client_stat_clients(c, older.get(), records, 4, &count) : kvf_client_stat(c, older.get()),
              KVF_SUCCESS)
        << kvf_last_error();
    EXPECT_EQ(older.get()->boot_token, kvf_server_boot_token(server_.s));
    EXPECT_EQ(older.get()->in_flight, 0u);
    EXPECT_TRUE(older.untouched_from(offsetof(kvf_client_stats, lanes)));
  }
  kvf_client_disconnect(c);
}

}  // namespace
