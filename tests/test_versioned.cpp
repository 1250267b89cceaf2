// The one rule for versioned structs (common/versioned.h): the helper.
#include <gtest/gtest.h>

#include <string.h>

#include <cstddef>
#include <memory>
#include <string>

#include "common/versioned.h"

namespace {

bool Has(const std::string &haystack, const std::string &needle) { return haystack.find(needle) != std::string::npos; }

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

}  // namespace
