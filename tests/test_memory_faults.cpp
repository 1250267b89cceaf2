// Fault injection over the memory layer: the k-th call (system call or
// driver entry point) fails, for every k along export -> send -> receive ->
// register (import, reserve, map, access, release) and along unregister
// (unmap, address free, release), on the host provider and on the cumem
// provider over the fake driver. After each k: no descriptor, mapping,
// handle or address range leaked (/proc/self/fd, the table's counters, the
// fake driver's live counts), and the client's earlier registration still
// moves data both ways.
#include <gtest/gtest.h>

#include <cstdio>
#include <set>
#include <string>
#include <vector>

#include <kvferry/memory.h>

#include "mem_provider_env.h"

using namespace kvf_mem_test;

namespace {

constexpr uint64_t kClient = 7;

// What one registration message carries.
struct Message {
  uint32_t count;
  uint32_t reserved;
  kvf_mem_identity ids[3];
};

class FaultSweep : public ::testing::TestWithParam<Prov> {
 protected:
  FaultSweep() : env_(GetParam()) {}

  void SetUp() override {
    env_.install();
    ASSERT_EQ(kvf_mem_granularity(env_.provider(), 0, &gran_), KVF_SUCCESS) << kvf_last_error();
    for (int i = 0; i < 4; i++) {
      owned_.push_back(make_alloc(env_.provider(), (i + 1) * gran_));
      ASSERT_TRUE(owned_.back());
      allocs_.push_back(owned_.back().get());
    }
    kvf_import_table *t = nullptr;
    ASSERT_EQ(kvf_import_table_create(nullptr, &t), KVF_SUCCESS);
    table_.reset(t);
    // The client's earlier registration: allocations 0 and 1, whole and a slice.
    std::vector<kvf_import_view> v = whole_views({allocs_[0], allocs_[1]});
    kvf_import_view slice = v[1];
    slice.fd = -1;
    slice.offset = gran_ / 2;
    slice.size = gran_ / 4;
    v.push_back(slice);
    ASSERT_EQ(kvf_import_table_register(t, kClient, v.data(), (uint32_t)v.size(), &prior_), KVF_SUCCESS)
        << kvf_last_error();
    base_fds_ = fd_count();
    base_table_ = held(table_stats(t));
    base_client_ = held(client_stats(t, kClient));
    base_driver_ = env_.driver_live();
  }
  void TearDown() override {
    if (table_) {
      EXPECT_EQ(kvf_import_table_unregister(table_.get(), prior_), KVF_SUCCESS) << kvf_last_error();
    }
    table_.reset();
    owned_.clear();
    env_.uninstall();
  }

  // Everything is back where it was, and the earlier registration works.
  void expect_baseline(long k) {
    EXPECT_EQ(fd_count(), base_fds_) << "k=" << k << " (" << faults().hit_name << "): descriptors leaked";
    EXPECT_EQ(held(table_stats(table_.get())), base_table_) << "k=" << k << " (" << faults().hit_name << ")";
    EXPECT_EQ(held(client_stats(table_.get(), kClient)), base_client_) << "k=" << k;
    EXPECT_EQ(env_.driver_live(), base_driver_) << "k=" << k << " (" << faults().hit_name << "): driver leak";
    EXPECT_EQ(kvf_import_reg_get_state(prior_), KVF_IMPORT_REG_ACTIVE);
    EXPECT_TRUE(moves_data(prior_, allocs_, (uint64_t)k)) << "k=" << k;
  }

  // Export allocations 1..3 (1 is already mapped: the dedup path), send them
  // with their identities over a socket pair, receive, and register three
  // views per allocation. Returns the first failure.
  kvf_status pipeline(int sv[2], kvf_import_reg **reg) {
    Message m{};
    int fds[3] = {-1, -1, -1};
    kvf_status st = KVF_SUCCESS;
    m.count = 3;
    for (int i = 0; i < 3; i++)
      if ((st = kvf_mem_alloc_export(allocs_[i + 1], &fds[i], &m.ids[i])) != KVF_SUCCESS) {
        for (int j = 0; j < i; j++) close(fds[j]);
        return st;
      }
    if ((st = kvf_ipc_send(sv[0], &m, sizeof m, fds, 3, KVF_IPC_CLOSE_FDS)) != KVF_SUCCESS) return st;
    Message got{};
    int in[3] = {-1, -1, -1};
    uint32_t n = 0;
    if ((st = kvf_ipc_recv(sv[1], &got, sizeof got, in, 3, &n)) != KVF_SUCCESS) return st;
    EXPECT_EQ(n, 3u);
    std::vector<kvf_import_view> views;
    for (uint32_t i = 0; i < got.count; i++)
      for (uint64_t part = 0; part < 3; part++) {
        kvf_import_view v{};
        v.identity = got.ids[i];
        v.fd = part == 0 ? in[i] : -1;
        v.size = got.ids[i].size / 4;
        v.offset = part * v.size;
        views.push_back(v);
      }
    return kvf_import_table_register(table_.get(), kClient, views.data(), (uint32_t)views.size(), reg);
  }

  ProviderEnv env_;
  uint64_t gran_ = 0;
  std::vector<AllocPtr> owned_;
  std::vector<kvf_mem_alloc *> allocs_;
  TablePtr table_;
  kvf_import_reg *prior_ = nullptr;
  int base_fds_ = 0;
  std::vector<uint64_t> base_table_, base_client_;
  std::vector<int> base_driver_;
};

void report(const char *what, long k, const std::set<std::string> &names) {
  std::string list;
  for (const auto &n : names) list += (list.empty() ? "" : ", ") + n;
  std::printf("[  sweep   ] %s: failed calls 1..%ld in turn, %zu kinds: %s\n", what, k - 1, names.size(),
              list.c_str());
  ::testing::Test::RecordProperty("faults_injected", (int)(k - 1));
}

std::string param_name(const ::testing::TestParamInfo<Prov> &info) { return prov_name(info.param); }

std::vector<std::string> expected_register_calls(Prov p) {
  if (p == Prov::Host) return {"fcntl", "sendmsg", "recvmsg", "fstat", "mmap", "mprotect"};
  return {"cuMemExportToShareableHandle", "fcntl", "sendmsg", "recvmsg", "cuMemImportFromShareableHandle",
          "cuMemGetAllocationPropertiesFromHandle", "cuMemAddressReserve", "cuMemMap", "cuMemSetAccess",
          "cuMemRelease"};
}

TEST_P(FaultSweep, EveryFailureAlongRegisterLeavesNothingBehind) {
  std::set<std::string> failed_calls;
  long k = 1;
  for (; k < 2000; k++) {
    int sv[2];
    ASSERT_EQ(kvf_ipc_socketpair(sv), KVF_SUCCESS);
    kvf_import_reg *reg = nullptr;
    arm(k);
    kvf_status st = pipeline(sv, &reg);
    bool hit = faults().hit;
    std::string name = faults().hit_name;
    disarm();
    close(sv[0]);
    close(sv[1]);
    if (!hit) {
      // Past the last call: the whole pipeline ran without a fault.
      ASSERT_EQ(st, KVF_SUCCESS) << kvf_last_error();
      kvf_import_stats s = table_stats(table_.get());
      EXPECT_EQ(s.imports, 4u);
      EXPECT_EQ(s.aliases, 3u + 9u);
      ASSERT_EQ(kvf_import_table_unregister(table_.get(), reg), KVF_SUCCESS);
      expect_baseline(k);
      break;
    }
    failed_calls.insert(name);
    if (st == KVF_SUCCESS) {
      // A fault the pipeline absorbs (a close reporting an error after
      // closing): the registration is whole.
      EXPECT_EQ(table_stats(table_.get()).aliases, 3u + 9u) << "k=" << k << " " << name;
      ASSERT_EQ(kvf_import_table_unregister(table_.get(), reg), KVF_SUCCESS);
    } else {
      EXPECT_EQ(reg, nullptr);
      EXPECT_NE(kvf_last_error()[0], '\0');
    }
    expect_baseline(k);
    if (HasFailure()) break;
  }
  EXPECT_GT(k, 10);
  report("register", k, failed_calls);
  for (const std::string &c : expected_register_calls(env_.prov()))
    EXPECT_TRUE(failed_calls.count(c)) << c << " was never failed";
}

TEST_P(FaultSweep, EveryFailureAlongUnregisterCanBeRetried) {
  std::set<std::string> failed_calls;
  long k = 1;
  for (; k < 2000; k++) {
    int sv[2];
    ASSERT_EQ(kvf_ipc_socketpair(sv), KVF_SUCCESS);
    kvf_import_reg *reg = nullptr;
    ASSERT_EQ(pipeline(sv, &reg), KVF_SUCCESS) << kvf_last_error();
    close(sv[0]);
    close(sv[1]);
    arm(k);
    kvf_status st = kvf_import_table_unregister(table_.get(), reg);
    bool hit = faults().hit;
    std::string name = faults().hit_name;
    disarm();
    if (!hit) {
      ASSERT_EQ(st, KVF_SUCCESS) << kvf_last_error();
      expect_baseline(k);
      break;
    }
    failed_calls.insert(name);
    if (st != KVF_SUCCESS) {
      EXPECT_EQ(kvf_import_reg_get_state(reg), KVF_IMPORT_REG_CLOSING) << "k=" << k << " " << name;
      kvf_import_stats s = table_stats(table_.get());
      EXPECT_GE(s.pending_closes, 1u);
      EXPECT_EQ(s.aliases, 3u) << "the aliases are gone at once";
      EXPECT_TRUE(moves_data(prior_, allocs_, (uint64_t)k)) << "a failed close does not touch other mappings";
      ASSERT_EQ(kvf_import_table_unregister(table_.get(), reg), KVF_SUCCESS) << kvf_last_error();
    }
    expect_baseline(k);
    if (HasFailure()) break;
  }
  EXPECT_GT(k, 3);
  report("unregister", k, failed_calls);
  std::vector<std::string> want = env_.prov() == Prov::Host
                                      ? std::vector<std::string>{"mmap", "munmap"}
                                      : std::vector<std::string>{"cuMemUnmap", "cuMemAddressFree"};
  for (const std::string &c : want) EXPECT_TRUE(failed_calls.count(c)) << c << " was never failed";
}

TEST_P(FaultSweep, EveryFailureAlongAllocateAndExportLeavesNothingBehind) {
  std::set<std::string> failed_calls;
  long k = 1;
  for (; k < 500; k++) {
    arm(k);
    kvf_mem_alloc_options o = KVF_MEM_ALLOC_OPTIONS_INIT;
    o.provider = env_.provider();
    o.size = 3 * gran_;
    kvf_mem_alloc *a = nullptr;
    int fd = -1;
    kvf_status st = kvf_mem_alloc_create(&o, &a);
    if (st == KVF_SUCCESS) st = kvf_mem_alloc_export(a, &fd, nullptr);
    bool hit = faults().hit;
    if (hit) failed_calls.insert(faults().hit_name);
    disarm();
    if (st == KVF_SUCCESS) {
      EXPECT_TRUE(fd_cloexec(fd));
    }
    if (fd >= 0) close(fd);
    kvf_mem_alloc_destroy(a);  // destroy itself is not swept: it cannot report a failure
    EXPECT_EQ(fd_count(), base_fds_) << "k=" << k << " " << faults().hit_name;
    EXPECT_EQ(env_.driver_live(), base_driver_) << "k=" << k << " " << faults().hit_name;
    if (!hit) {
      EXPECT_EQ(st, KVF_SUCCESS) << kvf_last_error();
      break;
    }
  }
  EXPECT_GT(k, 3);
  report("allocate+export", k, failed_calls);
}

INSTANTIATE_TEST_SUITE_P(Providers, FaultSweep, ::testing::ValuesIn(all_providers()), param_name);

}  // namespace
