// The server's registration lifecycle (host/registry.h) over a real import
// table on the host provider: states, leases and draining, the unmap deferred
// to the last lease, re-registration that fails and leaves the previous one
// serving, a retryable unmap after an injected failure, the reaper, the
// completion table, counters, and a many-thread stress case meant to run
// under ThreadSanitizer as well (KVF_SANITIZE=thread).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

#include <kvferry/memory.h>

#include "host/core/log.h"
#include "host/server/registry.h"
#include "mem_test_util.h"
#include "mem_provider_env.h"

using namespace kvf_mem_test;

namespace {

constexpr kvf_mem_provider kHost = KVF_MEM_PROVIDER_HOST;

kvf_registry_stats reg_stats(kvf_registry *r) {
  kvf_registry_stats s = KVF_REGISTRY_STATS_INIT;
  EXPECT_EQ(kvf_registry_stats_get(r, &s), KVF_SUCCESS) << kvf_last_error();
  return s;
}
kvf_registry_stats reg_client_stats(kvf_registry *r, uint64_t client, kvf_status want = KVF_SUCCESS) {
  kvf_registry_stats s = KVF_REGISTRY_STATS_INIT;
  EXPECT_EQ(kvf_registry_client_stats(r, client, &s), want) << kvf_last_error();
  return s;
}

// One import table and one registry, host allocations to register, and a
// descriptor count that must come back at the end.
class RegistryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    fds_before_ = fd_count();
    kvf_import_table *t = nullptr;
    ASSERT_EQ(kvf_import_table_create(nullptr, &t), KVF_SUCCESS) << kvf_last_error();
    table_.reset(t);
    ASSERT_EQ(kvf_mem_granularity(kHost, 0, &gran_), KVF_SUCCESS);
    for (int i = 0; i < 3; i++) {
      allocs_.push_back(make_alloc(kHost, 2 * gran_));
      ASSERT_TRUE(allocs_.back());
    }
    make_registry(0);
  }
  void TearDown() override {
    kvf_registry_destroy(reg_);
    reg_ = nullptr;
    if (table_) {
      kvf_import_stats s = table_stats(table_.get());
      EXPECT_EQ(held(s), zero_held()) << "the import table holds something after the test";
    }
    table_.reset();
    allocs_.clear();
    EXPECT_EQ(fd_count(), fds_before_) << "descriptors leaked";
  }
  void make_registry(uint32_t completions) {
    kvf_registry_destroy(reg_);
    reg_ = nullptr;
    kvf_registry_options o = KVF_REGISTRY_OPTIONS_INIT;
    o.completion_capacity = completions;
    ASSERT_EQ(kvf_registry_create(table_.get(), &o, &reg_), KVF_SUCCESS) << kvf_last_error();
  }
  std::vector<kvf_mem_alloc *> raw(std::initializer_list<int> which) {
    std::vector<kvf_mem_alloc *> v;
    for (int i : which) v.push_back(allocs_[i].get());
    return v;
  }
  // begin + commit over whole views of the chosen allocations.
  kvf_status register_allocs(uint64_t client, std::initializer_list<int> which) {
    kvf_registry_reg *attempt = nullptr;
    kvf_status st = kvf_registry_register_begin(reg_, client, 0, &attempt);
    if (st != KVF_SUCCESS) return st;
    std::vector<kvf_import_view> v = whole_views(raw(which));
    return kvf_registry_register_commit(reg_, attempt, v.data(), (uint32_t)v.size());
  }

  TablePtr table_;
  kvf_registry *reg_ = nullptr;
  std::vector<AllocPtr> allocs_;
  uint64_t gran_ = 0;
  int fds_before_ = 0;
};

TEST_F(RegistryTest, StatesFollowTheLifecycle) {
  kvf_registry_reg *attempt = nullptr;
  ASSERT_EQ(kvf_registry_register_begin(reg_, 7, 0, &attempt), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(kvf_registry_reg_state(attempt), KVF_REGISTRY_REGISTERING);
  EXPECT_EQ(reg_stats(reg_).registering, 1u);
  EXPECT_EQ(kvf_registry_active_id(reg_, 7), 0u) << "an attempt does not serve";
  kvf_registry_reg *lease = nullptr;
  EXPECT_EQ(kvf_registry_lease_acquire(reg_, 7, &lease), KVF_ERR_STATE) << "no lease before the commit";
  kvf_registry_reg *second = nullptr;
  EXPECT_EQ(kvf_registry_register_begin(reg_, 7, 0, &second), KVF_ERR_BUSY) << "one attempt at a time";

  uint64_t id = kvf_registry_reg_id(attempt);
  std::vector<kvf_import_view> v = whole_views(raw({0, 1}));
  ASSERT_EQ(kvf_registry_register_commit(reg_, attempt, v.data(), 2), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(kvf_registry_active_id(reg_, 7), id);
  kvf_registry_stats s = reg_stats(reg_);
  EXPECT_EQ(s.registering, 0u);
  EXPECT_EQ(s.active, 1u);
  EXPECT_EQ(s.imports, 2u);
  EXPECT_EQ(s.aliases, 2u);
  EXPECT_EQ(s.clients, 1u);

  ASSERT_EQ(kvf_registry_lease_acquire(reg_, 7, &lease), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(kvf_registry_reg_state(lease), KVF_REGISTRY_ACTIVE);
  EXPECT_EQ(kvf_registry_reg_id(lease), id);
  EXPECT_TRUE(moves_data(kvf_registry_reg_import(lease), raw({0, 1}), 3));
  EXPECT_EQ(reg_client_stats(reg_, 7).leases, 1u);
  ASSERT_EQ(kvf_registry_lease_release(reg_, lease), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(kvf_registry_lease_release(reg_, lease), KVF_ERR_STATE) << "a double release is refused";

  ASSERT_EQ(kvf_registry_unregister(reg_, 7), KVF_SUCCESS) << kvf_last_error();
  s = reg_stats(reg_);
  EXPECT_EQ(s.active, 0u);
  EXPECT_EQ(s.draining, 0u);
  EXPECT_EQ(s.closed_total, 1u);
  EXPECT_EQ(s.imports, 0u);
  EXPECT_EQ(s.aliases, 0u);
  EXPECT_EQ(kvf_registry_lease_acquire(reg_, 7, &lease), KVF_ERR_STATE);
  EXPECT_EQ(kvf_registry_unregister(reg_, 7), KVF_SUCCESS) << "unregister is idempotent";
  EXPECT_EQ(kvf_registry_unregister(reg_, 12345), KVF_SUCCESS) << "nothing of an unknown client is mapped";
  EXPECT_EQ(kvf_registry_lease_acquire(reg_, 12345, &lease), KVF_ERR_NOT_FOUND);

  // The client is still open: it may register again.
  ASSERT_EQ(register_allocs(7, {2}), KVF_SUCCESS) << kvf_last_error();
  EXPECT_GT(kvf_registry_active_id(reg_, 7), id);
  ASSERT_EQ(kvf_registry_client_close(reg_, 7), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(reg_stats(reg_).clients, 0u) << "a closed client with nothing left is forgotten";
}

TEST_F(RegistryTest, DrainingRefusesLeasesAndUnmapsAfterTheLastOne) {
  ASSERT_EQ(register_allocs(1, {0}), KVF_SUCCESS) << kvf_last_error();
  kvf_registry_reg *a = nullptr, *b = nullptr, *c = nullptr;
  ASSERT_EQ(kvf_registry_lease_acquire(reg_, 1, &a), KVF_SUCCESS);
  ASSERT_EQ(kvf_registry_lease_acquire(reg_, 1, &b), KVF_SUCCESS);
  EXPECT_EQ(a, b);

  const uint64_t id = kvf_registry_reg_id(a);
  EXPECT_FALSE(kvf_registry_draining_upto(reg_, 1, id)) << "active is not draining";
  EXPECT_EQ(kvf_registry_unregister(reg_, 1), KVF_ERR_BUSY) << "leases held: the unmap is deferred";
  EXPECT_EQ(kvf_registry_reg_state(a), KVF_REGISTRY_DRAINING);
  EXPECT_TRUE(kvf_registry_draining_upto(reg_, 1, id));
  EXPECT_TRUE(kvf_registry_draining_upto(reg_, 1, id + 1)) << "a newer id: an older registration drains";
  EXPECT_FALSE(kvf_registry_draining_upto(reg_, 1, id - 1)) << "an older id: nothing before it drains";
  EXPECT_FALSE(kvf_registry_draining_upto(reg_, 2, id)) << "another client";
  EXPECT_EQ(kvf_registry_lease_acquire(reg_, 1, &c), KVF_ERR_STATE) << "draining refuses new leases";
  EXPECT_EQ(kvf_registry_wait_idle(reg_, 1, 20), KVF_ERR_TIMEOUT);
  kvf_registry_stats s = reg_client_stats(reg_, 1);
  EXPECT_EQ(s.draining, 1u);
  EXPECT_EQ(s.leases, 2u);
  EXPECT_EQ(s.leases_refused_total, 1u);
  EXPECT_EQ(s.imports, 1u) << "still mapped while leased";
  EXPECT_TRUE(moves_data(kvf_registry_reg_import(a), raw({0}), 5)) << "the leased views still work";

  ASSERT_EQ(kvf_registry_lease_release(reg_, a), KVF_SUCCESS);
  EXPECT_EQ(table_stats(table_.get()).imports, 1u) << "one lease left: still mapped";
  EXPECT_EQ(kvf_registry_unregister(reg_, 1), KVF_ERR_BUSY) << "a retry while leased is still deferred";

  // The last release unmaps, on another thread while a waiter waits.
  std::thread waiter([&] { EXPECT_EQ(kvf_registry_wait_idle(reg_, 1, 5000), KVF_SUCCESS) << kvf_last_error(); });
  ASSERT_EQ(kvf_registry_lease_release(reg_, b), KVF_SUCCESS) << kvf_last_error();
  waiter.join();
  EXPECT_EQ(held(table_stats(table_.get())), zero_held());
  EXPECT_FALSE(kvf_registry_draining_upto(reg_, 1, id)) << "unmapped";
  s = reg_stats(reg_);
  EXPECT_EQ(s.draining, 0u);
  EXPECT_EQ(s.leases, 0u);
  EXPECT_EQ(s.closed_total, 1u);
  EXPECT_EQ(s.leases_total, 2u);
  EXPECT_EQ(kvf_registry_unregister(reg_, 1), KVF_SUCCESS);
}

TEST_F(RegistryTest, FailedReRegistrationLeavesThePreviousActive) {
  ASSERT_EQ(register_allocs(3, {0}), KVF_SUCCESS) << kvf_last_error();
  uint64_t first = kvf_registry_active_id(reg_, 3);
  kvf_registry_reg *lease = nullptr;
  ASSERT_EQ(kvf_registry_lease_acquire(reg_, 3, &lease), KVF_SUCCESS);
  std::vector<uint64_t> before = held(table_stats(table_.get()));

  // 1: a view out of its allocation (the table refuses it before any step).
  kvf_registry_reg *attempt = nullptr;
  ASSERT_EQ(kvf_registry_register_begin(reg_, 3, 0, &attempt), KVF_SUCCESS);
  std::vector<kvf_import_view> bad = whole_views(raw({1}));
  bad[0].offset = gran_;  // offset + size > identity.size
  EXPECT_EQ(kvf_registry_register_commit(reg_, attempt, bad.data(), 1), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(kvf_registry_active_id(reg_, 3), first);
  EXPECT_EQ(kvf_registry_reg_state(lease), KVF_REGISTRY_ACTIVE);
  EXPECT_EQ(held(table_stats(table_.get())), before);

  // 2: an injected failure in the middle of mapping (set access).
  {
    SysFaultGuard guard;
    arm_named("mprotect", 1);
    ASSERT_EQ(kvf_registry_register_begin(reg_, 3, 0, &attempt), KVF_SUCCESS);
    std::vector<kvf_import_view> v = whole_views(raw({1, 2}));
    EXPECT_NE(kvf_registry_register_commit(reg_, attempt, v.data(), 2), KVF_SUCCESS);
    EXPECT_TRUE(faults().hit) << "the fault was not reached";
  }
  EXPECT_EQ(kvf_registry_active_id(reg_, 3), first);
  EXPECT_EQ(held(table_stats(table_.get())), before);

  // 3: an abort before any view arrived.
  ASSERT_EQ(kvf_registry_register_begin(reg_, 3, 0, &attempt), KVF_SUCCESS);
  ASSERT_EQ(kvf_registry_register_abort(reg_, attempt), KVF_SUCCESS);
  EXPECT_EQ(kvf_registry_active_id(reg_, 3), first);

  kvf_registry_stats s = reg_client_stats(reg_, 3);
  EXPECT_EQ(s.failed_total, 3u);
  EXPECT_EQ(s.active, 1u);
  EXPECT_EQ(s.registering, 0u);
  kvf_registry_reg *more = nullptr;
  ASSERT_EQ(kvf_registry_lease_acquire(reg_, 3, &more), KVF_SUCCESS) << "the previous one still serves";
  EXPECT_TRUE(moves_data(kvf_registry_reg_import(more), raw({0}), 9));
  ASSERT_EQ(kvf_registry_lease_release(reg_, more), KVF_SUCCESS);

  // A re-registration that succeeds replaces it; the old one drains until
  // its lease goes, then unmaps (its allocation is not in the new one).
  ASSERT_EQ(register_allocs(3, {1, 2}), KVF_SUCCESS) << kvf_last_error();
  EXPECT_GT(kvf_registry_active_id(reg_, 3), first);
  EXPECT_EQ(kvf_registry_reg_state(lease), KVF_REGISTRY_DRAINING);
  s = reg_client_stats(reg_, 3);
  EXPECT_EQ(s.active, 1u);
  EXPECT_EQ(s.draining, 1u);
  EXPECT_EQ(s.imports, 3u);
  EXPECT_EQ(s.aliases, 3u);
  ASSERT_EQ(kvf_registry_lease_release(reg_, lease), KVF_SUCCESS);
  s = reg_client_stats(reg_, 3);
  EXPECT_EQ(s.draining, 0u);
  EXPECT_EQ(s.imports, 2u);
  EXPECT_EQ(s.aliases, 2u);
  ASSERT_EQ(kvf_registry_client_close(reg_, 3), KVF_SUCCESS);
}

TEST_F(RegistryTest, AFailedUnmapIsRetriedByUnregisterAndCollect) {
  for (int via_collect = 0; via_collect < 2; via_collect++) {
    SCOPED_TRACE(via_collect ? "retried by collect" : "retried by unregister");
    ASSERT_EQ(register_allocs(4, {0, 1}), KVF_SUCCESS) << kvf_last_error();
    kvf_registry_reg *lease = nullptr;
    ASSERT_EQ(kvf_registry_lease_acquire(reg_, 4, &lease), KVF_SUCCESS);
    ASSERT_EQ(kvf_registry_unregister(reg_, 4), KVF_ERR_BUSY);
    {
      SysFaultGuard guard;
      arm_named("mmap", 1);  // host provider: the unmap step of an unregister
      EXPECT_EQ(kvf_registry_lease_release(reg_, lease), KVF_ERR_SYSTEM) << "the last release ran the unmap";
      EXPECT_TRUE(faults().hit);
    }
    kvf_registry_stats s = reg_client_stats(reg_, 4);
    EXPECT_EQ(s.leases, 0u) << "the lease is released whatever the unmap returned";
    EXPECT_EQ(s.draining, 1u);
    EXPECT_EQ(s.unmap_pending, 1u);
    EXPECT_GE(s.imports, 1u) << "the failed mapping is still held";
    kvf_registry_reg *again = nullptr;
    EXPECT_EQ(kvf_registry_lease_acquire(reg_, 4, &again), KVF_ERR_STATE);

    if (via_collect)
      ASSERT_EQ(kvf_registry_collect(reg_), KVF_SUCCESS) << kvf_last_error();
    else
      ASSERT_EQ(kvf_registry_unregister(reg_, 4), KVF_SUCCESS) << kvf_last_error();
    s = reg_client_stats(reg_, 4);
    EXPECT_EQ(s.draining, 0u);
    EXPECT_EQ(s.unmap_pending, 0u);
    EXPECT_EQ(s.imports, 0u);
    EXPECT_EQ(held(table_stats(table_.get())), zero_held());
    EXPECT_EQ(kvf_registry_unregister(reg_, 4), KVF_SUCCESS);
  }
}

TEST_F(RegistryTest, TheReaperDrainsSilentClientsOnly) {
  const uint64_t sec = 1000000000ull;
  ASSERT_EQ(kvf_registry_client_open(reg_, 1, 10 * sec), KVF_SUCCESS);
  ASSERT_EQ(kvf_registry_client_open(reg_, 2, 10 * sec), KVF_SUCCESS);
  ASSERT_EQ(register_allocs(1, {0}), KVF_SUCCESS) << kvf_last_error();
  ASSERT_EQ(register_allocs(2, {0, 1}), KVF_SUCCESS) << kvf_last_error();  // shares allocation 0
  kvf_registry_reg *lease = nullptr;
  ASSERT_EQ(kvf_registry_lease_acquire(reg_, 1, &lease), KVF_SUCCESS);

  uint32_t reaped = 99;
  ASSERT_EQ(kvf_registry_reap(reg_, 15 * sec, 10 * sec, &reaped), KVF_SUCCESS);
  EXPECT_EQ(reaped, 0u) << "nobody is silent for 10 s yet";
  ASSERT_EQ(kvf_registry_heartbeat(reg_, 2, 18 * sec), KVF_SUCCESS);
  ASSERT_EQ(kvf_registry_reap(reg_, 21 * sec, 10 * sec, &reaped), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(reaped, 1u);

  // Client 1 is dead: draining while its lease is held, refused everything new.
  EXPECT_EQ(kvf_registry_reg_state(lease), KVF_REGISTRY_DRAINING);
  kvf_registry_reg *x = nullptr;
  EXPECT_EQ(kvf_registry_lease_acquire(reg_, 1, &x), KVF_ERR_STATE);
  EXPECT_EQ(kvf_registry_register_begin(reg_, 1, 0, &x), KVF_ERR_STATE);
  EXPECT_EQ(kvf_registry_heartbeat(reg_, 1, 22 * sec), KVF_ERR_STATE);
  EXPECT_EQ(kvf_registry_client_open(reg_, 1, 22 * sec), KVF_ERR_STATE);
  kvf_registry_stats s = reg_stats(reg_);
  EXPECT_EQ(s.reaped_total, 1u);
  EXPECT_EQ(s.clients_closed, 1u);
  EXPECT_EQ(s.active, 1u);
  EXPECT_EQ(s.draining, 1u);
  EXPECT_EQ(s.imports, 2u);
  EXPECT_EQ(s.aliases, 3u) << "the dead client's leased view is still mapped until its last release";

  // Client 2 keeps serving; the last lease of client 1 unmaps it and the
  // client is forgotten. Allocation 0 stays mapped for client 2.
  ASSERT_EQ(kvf_registry_lease_acquire(reg_, 2, &x), KVF_SUCCESS);
  ASSERT_EQ(kvf_registry_lease_release(reg_, lease), KVF_SUCCESS);
  reg_client_stats(reg_, 1, KVF_ERR_NOT_FOUND);
  EXPECT_TRUE(moves_data(kvf_registry_reg_import(x), raw({0, 1}), 11));
  ASSERT_EQ(kvf_registry_lease_release(reg_, x), KVF_SUCCESS);
  s = reg_stats(reg_);
  EXPECT_EQ(s.clients, 1u);
  EXPECT_EQ(s.imports, 2u);
  EXPECT_EQ(s.aliases, 2u);
  EXPECT_EQ(kvf_registry_reap(reg_, 40 * sec, 10 * sec, &reaped), KVF_SUCCESS);
  EXPECT_EQ(reaped, 1u);
  EXPECT_EQ(reg_stats(reg_).clients, 0u) << "nothing leased: reaped and unmapped at once";
  EXPECT_EQ(kvf_registry_heartbeat(reg_, 2, 41 * sec), KVF_ERR_NOT_FOUND);
}

TEST_F(RegistryTest, ClosingDuringARegistrationDrainsTheNewOne) {
  kvf_registry_reg *attempt = nullptr;
  ASSERT_EQ(kvf_registry_register_begin(reg_, 6, 0, &attempt), KVF_SUCCESS);
  EXPECT_EQ(kvf_registry_client_close(reg_, 6), KVF_SUCCESS);
  std::vector<kvf_import_view> v = whole_views(raw({0}));
  EXPECT_EQ(kvf_registry_register_commit(reg_, attempt, v.data(), 1), KVF_ERR_STATE);
  EXPECT_EQ(reg_stats(reg_).clients, 0u);
  EXPECT_EQ(held(table_stats(table_.get())), zero_held()) << "mapped, then unmapped at once";
}

TEST_F(RegistryTest, CompletionsAreAnsweredOnceAndBounded) {
  make_registry(4);
  kvf_registry_outcome done{KVF_OUTCOME_DONE, KVF_SUCCESS, 12};
  kvf_registry_outcome failed{KVF_OUTCOME_FAILED, KVF_ERR_CUDA, 0};
  int dup = -1;
  ASSERT_EQ(kvf_registry_completion_record(reg_, 1, 100, &done, &dup), KVF_SUCCESS);
  EXPECT_EQ(dup, 0);
  ASSERT_EQ(kvf_registry_completion_record(reg_, 1, 100, &failed, &dup), KVF_SUCCESS);
  EXPECT_EQ(dup, 1) << "a duplicate completion is ignored";
  kvf_registry_outcome got{};
  ASSERT_EQ(kvf_registry_completion_lookup(reg_, 1, 100, &got), KVF_SUCCESS);
  EXPECT_EQ(got.kind, (uint32_t)KVF_OUTCOME_DONE) << "the first record wins";
  EXPECT_EQ(got.value, 12u);
  EXPECT_EQ(kvf_registry_completion_lookup(reg_, 2, 100, &got), KVF_ERR_NOT_FOUND) << "keyed by client too";
  ASSERT_EQ(kvf_registry_completion_record(reg_, 2, 100, &failed, &dup), KVF_SUCCESS);
  EXPECT_EQ(dup, 0);
  ASSERT_EQ(kvf_registry_completion_lookup(reg_, 2, 100, &got), KVF_SUCCESS);
  EXPECT_EQ(got.status, KVF_ERR_CUDA);
  kvf_registry_outcome bad{99, KVF_SUCCESS, 0};
  EXPECT_EQ(kvf_registry_completion_record(reg_, 1, 5, &bad, &dup), KVF_ERR_INVALID_ARGUMENT);

  // Fill past the bound: the oldest go first.
  for (uint64_t id = 200; id < 203; id++)
    ASSERT_EQ(kvf_registry_completion_record(reg_, 1, id, &done, nullptr), KVF_SUCCESS);
  EXPECT_EQ(kvf_registry_completion_lookup(reg_, 1, 100, &got), KVF_ERR_NOT_FOUND) << "the oldest was evicted";
  EXPECT_EQ(kvf_registry_completion_lookup(reg_, 2, 100, &got), KVF_SUCCESS);
  kvf_registry_stats s = reg_stats(reg_);
  EXPECT_EQ(s.completions, 4u);
  EXPECT_EQ(s.completions_evicted_total, 1u);
  EXPECT_EQ(s.completions_duplicate_total, 1u);

  // Many more: the table stays at its bound and only the newest 4 answer.
  for (uint64_t id = 1000; id < 1100; id++)
    ASSERT_EQ(kvf_registry_completion_record(reg_, id % 3, id, &done, nullptr), KVF_SUCCESS);
  for (uint64_t id = 1000; id < 1100; id++)
    EXPECT_EQ(kvf_registry_completion_lookup(reg_, id % 3, id, &got), id >= 1096 ? KVF_SUCCESS : KVF_ERR_NOT_FOUND)
        << id;
  EXPECT_EQ(reg_stats(reg_).completions, 4u);
}

TEST_F(RegistryTest, RejectsBadArguments) {
  kvf_registry *r = nullptr;
  EXPECT_EQ(kvf_registry_create(nullptr, nullptr, &r), KVF_ERR_INVALID_ARGUMENT);
  kvf_registry_options o = KVF_REGISTRY_OPTIONS_INIT;
  o.version = 0;
  EXPECT_EQ(kvf_registry_create(table_.get(), &o, &r), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(r, nullptr);
  kvf_registry_stats s = KVF_REGISTRY_STATS_INIT;
  s.struct_size = 3;
  EXPECT_EQ(kvf_registry_stats_get(reg_, &s), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(kvf_registry_lease_release(reg_, nullptr), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(kvf_registry_register_abort(reg_, nullptr), KVF_ERR_INVALID_ARGUMENT);
  ASSERT_EQ(register_allocs(1, {0}), KVF_SUCCESS);
  kvf_registry_reg *lease = nullptr;
  ASSERT_EQ(kvf_registry_lease_acquire(reg_, 1, &lease), KVF_SUCCESS);
  EXPECT_EQ(kvf_registry_register_abort(reg_, lease), KVF_ERR_INVALID_ARGUMENT) << "not an attempt";
  EXPECT_EQ(kvf_registry_register_commit(reg_, lease, nullptr, 0), KVF_ERR_INVALID_ARGUMENT);
  ASSERT_EQ(kvf_registry_lease_release(reg_, lease), KVF_SUCCESS);
  kvf_registry_destroy(nullptr);
}

// 8 threads acquire and release leases (and touch the leased memory, which
// faults if it was unmapped under them) while a registrar re-registers and
// unregisters, and a reaper reaps clients whose heartbeats it lets lapse.
// Everything returns to zero at the end. Run it under TSan too.
TEST_F(RegistryTest, StressLeasesWhileUnregisterAndTheReaperRun) {
  constexpr int kSlots = 3, kWorkers = 8;
  std::atomic<uint64_t> slot_client[kSlots];
  std::atomic<uint64_t> next_client{100};
  for (auto &c : slot_client) c = next_client++;
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> leases_ok{0}, refused{0}, registered{0}, reaped_n{0};
  std::atomic<int> errors{0};
  // Logical time: the registrar heartbeats live slots with it, the reaper
  // moves it and reaps anyone more than 2 ticks behind.
  std::atomic<uint64_t> now{10};
  // Hundreds of reaps: keep their warnings out of the test's output.
  FILE *devnull = std::fopen("/dev/null", "w");
  ASSERT_NE(devnull, nullptr);
  kvf_log_set_sink(devnull);

  std::vector<std::thread> workers;
  for (int w = 0; w < kWorkers; w++)
    workers.emplace_back([&, w] {
      unsigned x = (unsigned)w * 2654435761u + 1;
      while (!stop.load(std::memory_order_relaxed)) {
        x = x * 1103515245u + 12345u;
        uint64_t client = slot_client[(x >> 16) % kSlots].load();
        kvf_registry_reg *lease = nullptr;
        kvf_status st = kvf_registry_lease_acquire(reg_, client, &lease);
        if (st != KVF_SUCCESS) {
          if (st != KVF_ERR_STATE && st != KVF_ERR_NOT_FOUND) errors++;
          refused++;
          continue;
        }
        kvf_registry_state state = kvf_registry_reg_state(lease);
        if (state != KVF_REGISTRY_ACTIVE && state != KVF_REGISTRY_DRAINING) errors++;
        const kvf_import_reg *ir = kvf_registry_reg_import(lease);
        kvf_import_view_info info;
        if (kvf_import_reg_view(ir, 0, &info) != KVF_SUCCESS) {
          errors++;
        } else {
          volatile const uint8_t *p = static_cast<const uint8_t *>(info.ptr);
          (void)p[0];  // faults if unmapped under the lease
        }
        if (kvf_registry_lease_release(reg_, lease) != KVF_SUCCESS) errors++;
        leases_ok++;
      }
    });

  std::thread registrar([&] {
    unsigned x = 7;
    while (!stop.load(std::memory_order_relaxed)) {
      x = x * 1103515245u + 12345u;
      int slot = (int)((x >> 16) % kSlots);
      uint64_t client = slot_client[slot].load();
      if ((x >> 8) % 4 == 0) {
        kvf_status st = kvf_registry_unregister(reg_, client);
        if (st != KVF_SUCCESS && st != KVF_ERR_BUSY) errors++;
        continue;
      }
      kvf_registry_reg *attempt = nullptr;
      kvf_status st = kvf_registry_register_begin(reg_, client, now.load(), &attempt);
      if (st == KVF_ERR_STATE) {  // reaped: this slot's engine "restarts" as a new client
        slot_client[slot] = next_client++;
        continue;
      }
      if (st != KVF_SUCCESS) {
        errors++;
        continue;
      }
      std::vector<kvf_import_view> v = whole_views(raw({slot % 3, (slot + 1) % 3}));
      st = kvf_registry_register_commit(reg_, attempt, v.data(), (uint32_t)v.size());
      if (st == KVF_SUCCESS)
        registered++;
      else if (st != KVF_ERR_STATE)  // closed by the reaper meanwhile
        errors++;
      // Heartbeat every slot but the one whose turn it is to go silent (for
      // 20 ticks in turn; one period in kSlots + 1 nobody is silent).
      uint64_t t = now.load();
      uint64_t silent = (t / 20) % (kSlots + 1);
      for (int s = 0; s < kSlots; s++)
        if (silent != (uint64_t)s) kvf_registry_heartbeat(reg_, slot_client[s].load(), t);
    }
  });

  std::thread reaper([&] {
    while (!stop.load(std::memory_order_relaxed)) {
      uint64_t t = ++now;
      uint32_t n = 0;
      kvf_status st = kvf_registry_reap(reg_, t, 2, &n);
      if (st != KVF_SUCCESS) errors++;
      reaped_n += n;
      kvf_registry_stats s = reg_stats(reg_);
      (void)s;
      std::this_thread::sleep_for(std::chrono::microseconds(300));
    }
  });

  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  stop = true;
  for (auto &t : workers) t.join();
  registrar.join();
  reaper.join();
  kvf_log_set_sink(nullptr);
  std::fclose(devnull);

  EXPECT_EQ(errors.load(), 0);
  EXPECT_GT(leases_ok.load(), 100u);
  EXPECT_GT(registered.load(), 10u);
  EXPECT_GT(reaped_n.load(), 0u) << "the reaper never reaped: the test did not exercise it";
  kvf_registry_stats s = reg_stats(reg_);
  EXPECT_EQ(s.leases, 0u);
  EXPECT_EQ(s.unmap_pending, 0u);
  for (auto &c : slot_client) EXPECT_EQ(kvf_registry_client_close(reg_, c.load()), KVF_SUCCESS) << kvf_last_error();
  s = reg_stats(reg_);
  EXPECT_EQ(s.clients, 0u);
  EXPECT_EQ(s.active + s.draining + s.registering, 0u);
  EXPECT_EQ(s.imports, 0u);
  EXPECT_EQ(s.aliases, 0u);
  EXPECT_EQ(held(table_stats(table_.get())), zero_held());
  std::printf("stress: %llu leases, %llu refused, %llu registrations, %llu reaped\n",
              (unsigned long long)leases_ok.load(), (unsigned long long)refused.load(),
              (unsigned long long)registered.load(), (unsigned long long)reaped_n.load());
}

}  // namespace
