// Status codes, the per-thread detail message, the version, logging,
// parameters and the CUDA probe (host/log, host/param, host/cudawrap).
#include <gtest/gtest.h>

#include <dirent.h>
#include <stdlib.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <kvferry/kvferry.h>

extern "C" {
#include "common/error.h"
}
#include "host/core/cudawrap.h"
#include "host/core/log.h"
#include "host/core/param.h"

namespace {

// ---- status ---------------------------------------------------------------

struct PinnedStatus {
  kvf_status status;
  int value;
  const char *name;
};

// The numeric values are part of the ABI: this table must only ever grow.
const PinnedStatus kPinned[] = {
    {KVF_SUCCESS, 0, "success"},
    {KVF_ERR_INVALID_ARGUMENT, 1, "invalid argument"},
    {KVF_ERR_INVALID_GEOMETRY, 2, "invalid geometry"},
    {KVF_ERR_OUT_OF_MEMORY, 3, "out of memory"},
    {KVF_ERR_OVERFLOW, 4, "integer overflow"},
    {KVF_ERR_NOT_FOUND, 5, "not found"},
    {KVF_ERR_PARSE, 6, "parse error"},
    {KVF_ERR_IO, 7, "I/O error"},
    {KVF_ERR_NO_DRIVER, 8, "no CUDA driver"},
    {KVF_ERR_NO_DEVICE, 9, "no CUDA device"},
    {KVF_ERR_CUDA, 10, "CUDA error"},
    {KVF_ERR_UNSUPPORTED, 11, "unsupported"},
    {KVF_ERR_GEOMETRY_MISMATCH, 12, "geometry mismatch"},
    {KVF_ERR_STATE, 13, "wrong state"},
    {KVF_ERR_SYSTEM, 14, "system error"},
    {KVF_ERR_INTERNAL, 15, "internal error"},
    {KVF_ERR_TIMEOUT, 16, "timed out"},
    {KVF_ERR_BUSY, 17, "busy"},
    {KVF_ERR_PROTOCOL, 18, "protocol error"},
    {KVF_ERR_PERMISSION, 19, "permission denied"},
    {KVF_ERR_DISCONNECTED, 20, "disconnected"},
};

TEST(Status, ValuesArePinned) {
  for (const PinnedStatus &p : kPinned) EXPECT_EQ(static_cast<int>(p.status), p.value) << p.name;
}

TEST(Status, EveryValueHasItsOwnName) {
  std::set<std::string> seen;
  for (const PinnedStatus &p : kPinned) {
    const char *s = kvf_status_string(p.status);
    ASSERT_NE(s, nullptr);
    EXPECT_STREQ(s, p.name) << "status " << p.value;
    EXPECT_TRUE(seen.insert(s).second) << "duplicate name '" << s << "'";
  }
}

TEST(Status, UnknownValuesHaveAName) {
  EXPECT_STREQ(kvf_status_string(static_cast<kvf_status>(21)), "unknown status");
  EXPECT_STREQ(kvf_status_string(static_cast<kvf_status>(-1)), "unknown status");
  EXPECT_STREQ(kvf_status_string(static_cast<kvf_status>(100000)), "unknown status");
}

TEST(Status, LastErrorIsPerThread) {
  EXPECT_EQ(kvf_fail(KVF_ERR_PARSE, "main thread: field '%s'", "x"), KVF_ERR_PARSE);
  std::string other_before, other_after;
  std::thread t([&] {
    other_before = kvf_last_error();
    kvf_fail(KVF_ERR_IO, "other thread");
    other_after = kvf_last_error();
  });
  t.join();
  EXPECT_EQ(other_before, "") << "a new thread starts with an empty message";
  EXPECT_EQ(other_after, "other thread");
  EXPECT_STREQ(kvf_last_error(), "main thread: field 'x'") << "another thread's failure leaked in";
}

TEST(Status, LastErrorSurvivesSuccessAndTakesAPrefix) {
  kvf_fail(KVF_ERR_INVALID_ARGUMENT, "field 'block_size' is 0");
  kvf_geometry_destroy(nullptr);  // a call that cannot fail
  EXPECT_EQ(kvf_version(), static_cast<unsigned>(KVF_VERSION_NUMBER));
  EXPECT_STREQ(kvf_last_error(), "field 'block_size' is 0");
  kvf_error_prefix("loading %s: ", "g.json");
  EXPECT_STREQ(kvf_last_error(), "loading g.json: field 'block_size' is 0");
}

TEST(Status, LongMessagesAreTruncatedNotOverflowed) {
  std::string big(5000, 'a');
  kvf_fail(KVF_ERR_PARSE, "%s", big.c_str());
  size_t n = strlen(kvf_last_error());
  EXPECT_GT(n, 100u);
  EXPECT_LT(n, big.size());
}

// ---- version --------------------------------------------------------------

TEST(Version, HeaderMatchesLibrary) {
  EXPECT_EQ(kvf_version(), static_cast<unsigned>(KVF_VERSION_NUMBER));
  EXPECT_STREQ(kvf_version_string(), KVF_VERSION_STRING);
  char expect[32];
  snprintf(expect, sizeof expect, "%d.%d.%d", KVF_VERSION_MAJOR, KVF_VERSION_MINOR, KVF_VERSION_PATCH);
  EXPECT_STREQ(kvf_version_string(), expect);
  EXPECT_EQ(KVF_VERSION_NUMBER, KVF_VERSION_MAJOR * 10000 + KVF_VERSION_MINOR * 100 + KVF_VERSION_PATCH);
}

// ---- logging --------------------------------------------------------------

TEST(Log, ParsesLevels) {
  kvf_log_level l = KVF_LOG_NONE;
  ASSERT_EQ(kvf_log_parse_level("WARN", &l), 0);
  EXPECT_EQ(l, KVF_LOG_WARN);
  ASSERT_EQ(kvf_log_parse_level("info", &l), 0);
  EXPECT_EQ(l, KVF_LOG_INFO);
  ASSERT_EQ(kvf_log_parse_level("Trace", &l), 0);
  EXPECT_EQ(l, KVF_LOG_TRACE);
  ASSERT_EQ(kvf_log_parse_level("none", &l), 0);
  EXPECT_EQ(l, KVF_LOG_NONE);
  l = KVF_LOG_INFO;
  EXPECT_EQ(kvf_log_parse_level("verbose", &l), -1);
  EXPECT_EQ(kvf_log_parse_level("", &l), -1);
  EXPECT_EQ(kvf_log_parse_level("WARNING", &l), -1);
  EXPECT_EQ(kvf_log_parse_level(nullptr, &l), -1);
  EXPECT_EQ(l, KVF_LOG_INFO) << "a failed parse must not change the output";
}

TEST(Log, ParsesSubsystemLists) {
  uint32_t m = 0;
  const char *bad = nullptr;
  ASSERT_EQ(kvf_log_parse_subsys("IPC,XFER", &m, &bad), 0);
  EXPECT_EQ(m, KVF_LOG_IPC | KVF_LOG_XFER);
  ASSERT_EQ(kvf_log_parse_subsys(" cuda , server ", &m, &bad), 0);
  EXPECT_EQ(m, KVF_LOG_CUDA | KVF_LOG_SERVER);
  ASSERT_EQ(kvf_log_parse_subsys("ALL", &m, &bad), 0);
  EXPECT_EQ(m, KVF_LOG_ALL);
  ASSERT_EQ(kvf_log_parse_subsys("^CUDA,INIT", &m, &bad), 0);
  EXPECT_EQ(m, ~(KVF_LOG_CUDA | KVF_LOG_INIT));
  ASSERT_EQ(kvf_log_parse_subsys("INIT,ENV,GEOM,CUDA,MEM,IPC,XFER,SERVER,TOPO", &m, &bad), 0);
  EXPECT_EQ(m, 0x1ffu);
  EXPECT_EQ(kvf_log_parse_subsys("IPC,bogus,XFER", &m, &bad), -1);
  EXPECT_EQ(m, KVF_LOG_IPC | KVF_LOG_XFER) << "known names still count";
  ASSERT_NE(bad, nullptr);
  EXPECT_EQ(strncmp(bad, "bogus", 5), 0);
}

// Captures log lines through kvf_log_set_sink; restores level and sink.
class LogCapture {
 public:
  LogCapture(kvf_log_level level, uint32_t mask) {
    kvf_log_init();
    saved_level_ = __atomic_load_n(&kvf_log_level_now, __ATOMIC_RELAXED);
    saved_mask_ = __atomic_load_n(&kvf_log_mask_now, __ATOMIC_RELAXED);
    file_ = tmpfile();
    kvf_log_set_sink(file_);
    kvf_log_override(level, mask);
  }
  ~LogCapture() {
    kvf_log_override(static_cast<kvf_log_level>(saved_level_), saved_mask_);
    kvf_log_set_sink(nullptr);
    if (file_) fclose(file_);
  }
  std::string text() {
    std::string out;
    if (!file_) return out;
    fflush(file_);
    rewind(file_);
    char buf[4096];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, file_)) > 0) out.append(buf, n);
    return out;
  }
  bool ok() const { return file_ != nullptr; }

 private:
  FILE *file_ = nullptr;
  int saved_level_;
  uint32_t saved_mask_;
};

int g_evaluations = 0;
int Evaluated() { return ++g_evaluations; }

TEST(Log, FiltersByLevelAndSubsystemBeforeFormatting) {
  LogCapture cap(KVF_LOG_INFO, KVF_LOG_IPC);
  ASSERT_TRUE(cap.ok());
  g_evaluations = 0;
  KVF_INFO(IPC, "shown %d", Evaluated());
  KVF_INFO(XFER, "hidden-by-mask %d", Evaluated());
  KVF_TRACE(IPC, "hidden-by-level %d", Evaluated());
  KVF_WARN(XFER, "warnings ignore the mask %d", 7);
  std::string t = cap.text();
  EXPECT_EQ(g_evaluations, 1) << "arguments of disabled messages must not be evaluated";
  EXPECT_NE(t.find("kvferry INFO IPC shown 1\n"), std::string::npos) << t;
  EXPECT_EQ(t.find("hidden"), std::string::npos) << t;
  EXPECT_NE(t.find("kvferry WARN XFER warnings ignore the mask 7\n"), std::string::npos) << t;
}

TEST(Log, LinesCarryHostPidTid) {
  LogCapture cap(KVF_LOG_TRACE, KVF_LOG_ALL);
  ASSERT_TRUE(cap.ok());
  KVF_TRACE(GEOM, "traced");
  std::string t = cap.text();
  char host[256] = "";
  ASSERT_EQ(gethostname(host, sizeof host - 1), 0);
  if (char *dot = strchr(host, '.')) *dot = '\0';
  std::string prefix = std::string(host) + ":" + std::to_string(getpid()) + ":";
  EXPECT_EQ(t.rfind(prefix, 0), 0u) << t;
  EXPECT_NE(t.find(" kvferry TRACE GEOM test_status.cpp:"), std::string::npos) << t;
  EXPECT_NE(t.find(" traced\n"), std::string::npos) << t;
}

TEST(Log, NoneSilencesWarnings) {
  LogCapture cap(KVF_LOG_NONE, KVF_LOG_ALL);
  ASSERT_TRUE(cap.ok());
  KVF_WARN(CUDA, "must not appear");
  EXPECT_EQ(cap.text(), "");
}

TEST(Log, ConcurrentLinesDoNotInterleave) {
  LogCapture cap(KVF_LOG_INFO, KVF_LOG_ALL);
  ASSERT_TRUE(cap.ok());
  std::vector<std::thread> threads;
  for (int i = 0; i < 4; i++)
    threads.emplace_back([i] {
      for (int j = 0; j < 200; j++) KVF_INFO(XFER, "thread %d line %d end", i, j);
    });
  for (auto &t : threads) t.join();
  std::string t = cap.text();
  size_t lines = 0, pos = 0;
  while ((pos = t.find('\n', pos)) != std::string::npos) {
    lines++;
    pos++;
  }
  EXPECT_EQ(lines, 800u);
  size_t start = 0;
  while (start < t.size()) {
    size_t end = t.find('\n', start);
    std::string line = t.substr(start, end - start);
    ASSERT_NE(line.find(" kvferry INFO XFER thread "), std::string::npos) << line;
    ASSERT_EQ(line.substr(line.size() - 4), " end") << line;
    start = end + 1;
  }
}

// The environment is read once per process, so these run in a fresh child
// (gtest's threadsafe death-test style re-executes the binary). The child
// inherits KVF_TEST_LOGDIR, so parent and child agree on the directory.
std::string ChildDir() {
  const char *d = getenv("KVF_TEST_LOGDIR");
  if (d) return d;
  char tmpl[] = "/tmp/kvf-test-log.XXXXXX";
  const char *made = mkdtemp(tmpl);
  if (!made) return "";
  setenv("KVF_TEST_LOGDIR", made, 1);
  return made;
}

std::string ReadDir(const std::string &dir) {
  std::string all;
  DIR *d = opendir(dir.c_str());
  if (!d) return all;
  while (struct dirent *e = readdir(d)) {
    if (e->d_name[0] == '.') continue;
    std::string path = dir + "/" + e->d_name;
    if (FILE *f = fopen(path.c_str(), "r")) {
      char buf[4096];
      size_t n;
      while ((n = fread(buf, 1, sizeof buf, f)) > 0) all.append(buf, n);
      fclose(f);
    }
    unlink(path.c_str());
  }
  closedir(d);
  rmdir(dir.c_str());
  return all;
}

TEST(Log, ReadsTheEnvironmentOnce) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  std::string dir = ChildDir();
  ASSERT_FALSE(dir.empty());
  setenv("KVF_DEBUG", "info", 1);
  setenv("KVF_DEBUG_SUBSYS", "^CUDA", 1);
  setenv("KVF_DEBUG_FILE", (dir + "/log.%p").c_str(), 1);
  EXPECT_EXIT(
      {
        kvf_log_init();
        int code = 0;
        if (kvf_log_level_now != KVF_LOG_INFO) code = 2;
        else if (kvf_log_mask_now != ~KVF_LOG_CUDA) code = 3;
        KVF_INFO(IPC, "to the file");
        KVF_INFO(CUDA, "masked out");
        setenv("KVF_DEBUG", "none", 1);  // too late: read once
        kvf_log_init();
        if (kvf_log_level_now != KVF_LOG_INFO) code = 4;
        exit(code);
      },
      ::testing::ExitedWithCode(0), "");
  unsetenv("KVF_DEBUG");
  unsetenv("KVF_DEBUG_SUBSYS");
  unsetenv("KVF_DEBUG_FILE");
  unsetenv("KVF_TEST_LOGDIR");
  std::string t = ReadDir(dir);
  EXPECT_NE(t.find("kvferry INFO IPC to the file\n"), std::string::npos) << t;
  EXPECT_EQ(t.find("masked out"), std::string::npos) << t;
}

TEST(Log, BadEnvironmentWarnsAndFallsBack) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  std::string dir = ChildDir();
  ASSERT_FALSE(dir.empty());
  setenv("KVF_DEBUG", "loud", 1);
  setenv("KVF_DEBUG_SUBSYS", "IPC,nope", 1);
  setenv("KVF_DEBUG_FILE", (dir + "/log").c_str(), 1);
  EXPECT_EXIT(
      {
        kvf_log_init();
        exit(kvf_log_level_now == KVF_LOG_WARN ? 0 : 2);
      },
      ::testing::ExitedWithCode(0), "");
  unsetenv("KVF_DEBUG");
  unsetenv("KVF_DEBUG_SUBSYS");
  unsetenv("KVF_DEBUG_FILE");
  unsetenv("KVF_TEST_LOGDIR");
  std::string t = ReadDir(dir);
  EXPECT_NE(t.find("WARN ENV KVF_DEBUG='loud'"), std::string::npos) << t;
  EXPECT_NE(t.find("WARN ENV KVF_DEBUG_SUBSYS"), std::string::npos) << t;
  EXPECT_NE(t.find("'nope'"), std::string::npos) << t;
}

// ---- parameters -----------------------------------------------------------

TEST(Param, ParsesDecimalIntegers) {
  int64_t v = 0;
  ASSERT_EQ(kvf_param_parse_int("42", &v), 0);
  EXPECT_EQ(v, 42);
  ASSERT_EQ(kvf_param_parse_int(" -7 ", &v), 0);
  EXPECT_EQ(v, -7);
  ASSERT_EQ(kvf_param_parse_int("+3", &v), 0);
  EXPECT_EQ(v, 3);
  ASSERT_EQ(kvf_param_parse_int("010", &v), 0);
  EXPECT_EQ(v, 10) << "decimal, not octal";
  ASSERT_EQ(kvf_param_parse_int("9223372036854775807", &v), 0);
  EXPECT_EQ(v, INT64_MAX);
  v = 99;
  for (const char *bad : {"", " ", "abc", "12x", "1.5", "0x10", "--1", "+", "1 2", "9223372036854775808",
                          "-9223372036854775808"}) {
    EXPECT_EQ(kvf_param_parse_int(bad, &v), -1) << "'" << bad << "'";
  }
  EXPECT_EQ(kvf_param_parse_int(nullptr, &v), -1);
  EXPECT_EQ(v, 99) << "a failed parse must not change the output";
}

TEST(Param, InvalidValuesWarnAndUseTheDefault) {
  LogCapture cap(KVF_LOG_WARN, KVF_LOG_ALL);
  ASSERT_TRUE(cap.ok());
  unsetenv("KVF_TEST_PARAM");
  EXPECT_EQ(kvf_param_read("KVF_TEST_PARAM", 17), 17);
  setenv("KVF_TEST_PARAM", "", 1);
  EXPECT_EQ(kvf_param_read("KVF_TEST_PARAM", 17), 17);
  setenv("KVF_TEST_PARAM", "123", 1);
  EXPECT_EQ(kvf_param_read("KVF_TEST_PARAM", 17), 123);
  EXPECT_EQ(cap.text(), "") << "valid or unset values do not warn";
  setenv("KVF_TEST_PARAM", "12 apples", 1);
  EXPECT_EQ(kvf_param_read("KVF_TEST_PARAM", 17), 17);
  unsetenv("KVF_TEST_PARAM");
  std::string t = cap.text();
  EXPECT_NE(t.find("WARN ENV KVF_TEST_PARAM='12 apples'"), std::string::npos) << t;
  EXPECT_NE(t.find("17"), std::string::npos) << t;
}

static KVF_PARAM(test_cached, "KVF_TEST_CACHED", 5)
static KVF_PARAM(test_cached_bad, "KVF_TEST_CACHED_BAD", -3)

TEST(Param, AccessorReadsOnceAndCaches) {
  setenv("KVF_TEST_CACHED", "11", 1);
  std::vector<std::thread> threads;
  std::atomic<int> wrong{0};
  for (int i = 0; i < 4; i++)
    threads.emplace_back([&] {
      if (kvf_param_test_cached() != 11) wrong++;
    });
  for (auto &t : threads) t.join();
  EXPECT_EQ(wrong.load(), 0);
  setenv("KVF_TEST_CACHED", "12", 1);
  EXPECT_EQ(kvf_param_test_cached(), 11) << "read once: later changes are ignored";
  unsetenv("KVF_TEST_CACHED");

  LogCapture cap(KVF_LOG_WARN, KVF_LOG_ALL);
  setenv("KVF_TEST_CACHED_BAD", "lots", 1);
  EXPECT_EQ(kvf_param_test_cached_bad(), -3);
  EXPECT_EQ(kvf_param_test_cached_bad(), -3);
  unsetenv("KVF_TEST_CACHED_BAD");
  std::string t = cap.text();
  size_t first = t.find("KVF_TEST_CACHED_BAD");
  ASSERT_NE(first, std::string::npos) << t;
  EXPECT_EQ(t.find("KVF_TEST_CACHED_BAD", first + 1), std::string::npos) << "warned more than once: " << t;
}

TEST(Param, TableListsEveryVariable) {
  size_t n = 0;
  const kvf_param_info *table = kvf_param_table(&n);
  ASSERT_NE(table, nullptr);
  std::set<std::string> names;
  for (size_t i = 0; i < n; i++) {
    ASSERT_NE(table[i].env, nullptr);
    EXPECT_EQ(strncmp(table[i].env, "KVF_", 4), 0) << table[i].env;
    EXPECT_TRUE(names.insert(table[i].env).second) << "duplicate " << table[i].env;
    EXPECT_TRUE(strcmp(table[i].kind, "int") == 0 || strcmp(table[i].kind, "string") == 0) << table[i].env;
    EXPECT_GT(strlen(table[i].description), 10u) << table[i].env;
    EXPECT_GT(strlen(table[i].default_text), 0u) << table[i].env;
  }
  for (const char *want : {"KVF_DEBUG", "KVF_DEBUG_SUBSYS", "KVF_DEBUG_FILE", "KVF_CUDA_DISABLE"})
    EXPECT_EQ(names.count(want), 1u) << want << " missing from the table";
}

// ---- CUDA probe -----------------------------------------------------------

// Checks one probe result: success only with devices; failure only as "no
// driver" or "no device" on a machine like CI, always with a message.
void ExpectSaneProbe(kvf_status st, const kvf_cuda_info &info) {
  EXPECT_GT(strlen(info.message), 0u);
  EXPECT_EQ(info.struct_size, sizeof(kvf_cuda_info));
  EXPECT_EQ(info.version, KVF_CUDA_INFO_VERSION);
#ifdef KVF_WITH_CUDA
  EXPECT_GE(info.runtime_version, 12000);
#else
  EXPECT_EQ(info.runtime_version, 0);
#endif
  if (st == KVF_SUCCESS) {
    EXPECT_GT(info.device_count, 0);
    EXPECT_GE(info.driver_version, 12000);
  } else {
    EXPECT_TRUE(st == KVF_ERR_NO_DRIVER || st == KVF_ERR_NO_DEVICE)
        << kvf_status_string(st) << ": " << info.message;
    EXPECT_EQ(info.device_count, 0);
    EXPECT_STREQ(kvf_last_error(), info.message);
  }
}

TEST(Cuda, ProbeReportsWhatIsThere) {
  kvf_cuda_info info = KVF_CUDA_INFO_INIT;
  kvf_status st = kvf_cuda_probe(&info);
  ExpectSaneProbe(st, info);
  // Same answer the second time (loaded once).
  kvf_cuda_info again = KVF_CUDA_INFO_INIT;
  EXPECT_EQ(kvf_cuda_probe(&again), st);
  EXPECT_EQ(again.device_count, info.device_count);
  if (st == KVF_SUCCESS)
    std::printf("probe: %s\n", info.message);
  else
    std::printf("probe: %s: %s\n", kvf_status_string(st), info.message);
}

TEST(Cuda, ProbeFromManyThreadsAgrees) {
  std::vector<std::thread> threads;
  std::vector<kvf_status> results(8);
  std::vector<std::string> messages(8);
  for (int i = 0; i < 8; i++)
    threads.emplace_back([&, i] {
      kvf_cuda_info info = KVF_CUDA_INFO_INIT;
      results[i] = kvf_cuda_probe(&info);
      messages[i] = info.message;
    });
  for (auto &t : threads) t.join();
  for (int i = 1; i < 8; i++) {
    EXPECT_EQ(results[i], results[0]);
    EXPECT_EQ(messages[i], messages[0]);
  }
}

TEST(Cuda, ProbeRejectsBadArguments) {
  EXPECT_EQ(kvf_cuda_probe(nullptr), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvf_last_error()).find("out"), std::string::npos);

  kvf_cuda_info info = KVF_CUDA_INFO_INIT;
  info.struct_size = 4;  // smaller than the header (8 is a valid header-only struct)
  info.device_count = 1234;
  EXPECT_EQ(kvf_cuda_probe(&info), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvf_last_error()).find("struct_size"), std::string::npos) << kvf_last_error();
  EXPECT_EQ(info.device_count, 1234) << "left untouched on a bad argument";

  info = KVF_CUDA_INFO_INIT;
  info.version = 0;
  EXPECT_EQ(kvf_cuda_probe(&info), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvf_last_error()).find("version"), std::string::npos) << kvf_last_error();
}

TEST(Cuda, ProbeFillsOnlyWhatItKnowsOfALongerStruct) {
  struct {
    kvf_cuda_info info;
    unsigned char future[32];
  } big;
  memset(&big, 0xab, sizeof big);
  // A newer caller's fields this library does not know hold zero (their
  // defaults); nonzero ones are refused (test_versioned).
  memset(big.future, 0, sizeof big.future);
  big.info.struct_size = sizeof big;
  big.info.version = KVF_CUDA_INFO_VERSION;
  kvf_status st = kvf_cuda_probe(&big.info);
  EXPECT_TRUE(st == KVF_SUCCESS || st == KVF_ERR_NO_DRIVER || st == KVF_ERR_NO_DEVICE) << kvf_status_string(st);
  EXPECT_EQ(big.info.struct_size, sizeof big);
  for (unsigned char c : big.future) ASSERT_EQ(c, 0);
}

int ProbeDisabledChild() {
  kvf_cuda_info info = KVF_CUDA_INFO_INIT;
  kvf_status st = kvf_cuda_probe(&info);
#ifdef KVF_WITH_CUDA
  return st == KVF_ERR_NO_DRIVER && strstr(info.message, "KVF_CUDA_DISABLE") != nullptr ? 0 : 2;
#else
  return st == KVF_ERR_NO_DRIVER ? 0 : 2;  // a build without CUDA says so instead
#endif
}

TEST(Cuda, DisabledByEnvironment) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  setenv("KVF_CUDA_DISABLE", "1", 1);
  EXPECT_EXIT(exit(ProbeDisabledChild()), ::testing::ExitedWithCode(0), "");
  unsetenv("KVF_CUDA_DISABLE");
}

#ifdef KVF_WITH_CUDA
// A fake driver behind the entry-point table: how fault-injection tests will
// fail the k-th call without a GPU.
struct FakeDriver {
  static CUresult init_result;
  static CUresult version_result;
  static int device_count;
  static int calls;
  static int fail_call;  // 1-based call number to fail with CUDA_ERROR_OUT_OF_MEMORY; 0: none

  static CUresult Count() { return ++calls == fail_call ? CUDA_ERROR_OUT_OF_MEMORY : CUDA_SUCCESS; }
  static CUresult CUDAAPI Init(unsigned int) { return init_result; }
  static CUresult CUDAAPI DriverGetVersion(int *v) {
    *v = 13000;
    return version_result;
  }
  static CUresult CUDAAPI DeviceGetCount(int *n) {
    *n = device_count;
    return CUDA_SUCCESS;
  }
  static CUresult CUDAAPI DeviceGet(CUdevice *d, int ordinal) {
    *d = ordinal;
    return CUDA_SUCCESS;
  }
  static CUresult CUDAAPI DeviceGetName(char *name, int len, CUdevice) {
    snprintf(name, static_cast<size_t>(len), "Fake GPU");
    return CUDA_SUCCESS;
  }
  static CUresult CUDAAPI GetErrorName(CUresult r, const char **s) {
    *s = r == CUDA_ERROR_OUT_OF_MEMORY ? "CUDA_ERROR_OUT_OF_MEMORY" : "CUDA_ERROR_FAKE";
    return CUDA_SUCCESS;
  }
  static CUresult CUDAAPI GetErrorString(CUresult, const char **s) {
    *s = "fake failure";
    return CUDA_SUCCESS;
  }
  static CUresult CUDAAPI MemRelease(CUmemGenericAllocationHandle) { return Count(); }

  static kvf_cuda_table Table() {
    kvf_cuda_table t;
    memset(&t, 0, sizeof t);
    t.cuInit = Init;
    t.cuDriverGetVersion = DriverGetVersion;
    t.cuDeviceGetCount = DeviceGetCount;
    t.cuDeviceGet = DeviceGet;
    t.cuDeviceGetName = DeviceGetName;
    t.cuGetErrorName = GetErrorName;
    t.cuGetErrorString = GetErrorString;
    t.cuMemRelease = MemRelease;
    return t;
  }
  static void Reset() {
    init_result = CUDA_SUCCESS;
    version_result = CUDA_SUCCESS;
    device_count = 2;
    calls = 0;
    fail_call = 0;
  }
};
CUresult FakeDriver::init_result;
CUresult FakeDriver::version_result;
int FakeDriver::device_count;
int FakeDriver::calls;
int FakeDriver::fail_call;

// Installs a table for one scope and always puts the previous one back.
class TableGuard {
 public:
  explicit TableGuard(const kvf_cuda_table *t) : previous_(kvf_cuda_table_install(t)) {}
  ~TableGuard() { kvf_cuda_table_install(previous_); }

 private:
  const kvf_cuda_table *previous_;
};

TEST(CudaTable, InstallReplacesAndRestores) {
  kvf_cuda_table fake = FakeDriver::Table();
  const kvf_cuda_table *driver = kvf_cuda();
  EXPECT_EQ(driver, kvf_cuda_table_driver());
  {
    TableGuard guard(&fake);
    EXPECT_EQ(kvf_cuda(), &fake);
    EXPECT_EQ(kvf_cuda_ready(), KVF_SUCCESS) << "an installed table is always ready";
  }
  EXPECT_EQ(kvf_cuda(), driver);
  EXPECT_EQ(kvf_cuda_table_install(nullptr), nullptr);
}

TEST(CudaTable, ProbeMapsFakeDriverResults) {
  FakeDriver::Reset();
  kvf_cuda_table fake = FakeDriver::Table();
  TableGuard guard(&fake);

  kvf_cuda_info info = KVF_CUDA_INFO_INIT;
  ASSERT_EQ(kvf_cuda_probe(&info), KVF_SUCCESS) << info.message;
  EXPECT_EQ(info.device_count, 2);
  EXPECT_EQ(info.driver_version, 13000);
  EXPECT_NE(strstr(info.message, "Fake GPU"), nullptr) << info.message;

  FakeDriver::device_count = 0;
  info = KVF_CUDA_INFO_INIT;
  EXPECT_EQ(kvf_cuda_probe(&info), KVF_ERR_NO_DEVICE) << info.message;
  EXPECT_EQ(info.device_count, 0);

  FakeDriver::Reset();
  FakeDriver::init_result = CUDA_ERROR_NO_DEVICE;
  info = KVF_CUDA_INFO_INIT;
  EXPECT_EQ(kvf_cuda_probe(&info), KVF_ERR_NO_DEVICE) << info.message;

  FakeDriver::init_result = CUDA_ERROR_SYSTEM_DRIVER_MISMATCH;
  EXPECT_EQ(kvf_cuda_probe(&info), KVF_ERR_NO_DRIVER) << info.message;

  FakeDriver::Reset();
  FakeDriver::version_result = CUDA_ERROR_UNKNOWN;
  info = KVF_CUDA_INFO_INIT;
  EXPECT_EQ(kvf_cuda_probe(&info), KVF_ERR_CUDA);
  EXPECT_STREQ(info.message, "cuDriverGetVersion: CUDA_ERROR_FAKE (fake failure)");
  EXPECT_STREQ(kvf_last_error(), info.message);
}

// What KVF_CU_CHECK gives a caller: the mapped status and a message naming
// the driver function.
kvf_status ReleaseTwice(CUmemGenericAllocationHandle h) {
  KVF_CU_CHECK(cuMemRelease, h);
  KVF_CU_CHECK(cuMemRelease, h);
  return KVF_SUCCESS;
}

kvf_status ReleaseWithCleanup(CUmemGenericAllocationHandle h, int *cleaned) {
  kvf_status st = KVF_SUCCESS;
  KVF_CU_CHECK_GOTO(st, out, cuMemRelease, h);
  KVF_CU_CHECK_GOTO(st, out, cuMemRelease, h);
out:
  (*cleaned)++;
  return st;
}

TEST(CudaTable, CheckMacrosFailTheKthCall) {
  kvf_cuda_table fake = FakeDriver::Table();
  TableGuard guard(&fake);
  LogCapture cap(KVF_LOG_NONE, KVF_LOG_ALL);  // the failing site warns; keep the output quiet

  for (int k = 1; k <= 3; k++) {
    FakeDriver::Reset();
    FakeDriver::fail_call = k;
    kvf_status st = ReleaseTwice(1);
    if (k <= 2) {
      EXPECT_EQ(st, KVF_ERR_CUDA) << "k=" << k;
      EXPECT_EQ(FakeDriver::calls, k) << "stopped at the failing call";
      EXPECT_STREQ(kvf_last_error(), "cuMemRelease: CUDA_ERROR_OUT_OF_MEMORY (fake failure)");
    } else {
      EXPECT_EQ(st, KVF_SUCCESS);
      EXPECT_EQ(FakeDriver::calls, 2);
    }
    FakeDriver::Reset();
    FakeDriver::fail_call = k;
    int cleaned = 0;
    st = ReleaseWithCleanup(1, &cleaned);
    EXPECT_EQ(cleaned, 1) << "the out: label runs exactly once, k=" << k;
    EXPECT_EQ(st, k <= 2 ? KVF_ERR_CUDA : KVF_SUCCESS) << "k=" << k;
  }
}

TEST(CudaTable, ResultsMapToStatuses) {
  EXPECT_EQ(kvf_cu_status(CUDA_SUCCESS), KVF_SUCCESS);
  EXPECT_EQ(kvf_cu_status(CUDA_ERROR_NO_DEVICE), KVF_ERR_NO_DEVICE);
  EXPECT_EQ(kvf_cu_status(CUDA_ERROR_NOT_INITIALIZED), KVF_ERR_NO_DRIVER);
  EXPECT_EQ(kvf_cu_status(CUDA_ERROR_STUB_LIBRARY), KVF_ERR_NO_DRIVER);
  EXPECT_EQ(kvf_cu_status(CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE), KVF_ERR_NO_DRIVER);
  EXPECT_EQ(kvf_cu_status(CUDA_ERROR_NOT_SUPPORTED), KVF_ERR_UNSUPPORTED);
  EXPECT_EQ(kvf_cu_status(CUDA_ERROR_INVALID_VALUE), KVF_ERR_CUDA);
  EXPECT_EQ(kvf_cu_status(CUDA_ERROR_OUT_OF_MEMORY), KVF_ERR_CUDA);
}

TEST(CudaTable, DescribesResultsWithoutADriver) {
  kvf_cuda_table empty;
  memset(&empty, 0, sizeof empty);
  TableGuard guard(&empty);
  char buf[64];
  EXPECT_STREQ(kvf_cu_describe(CUDA_ERROR_INVALID_VALUE, buf, sizeof buf), "CUresult 1");
}
#endif  // KVF_WITH_CUDA

}  // namespace
