// The registry's leases and drain logic (host/registry.h) under many
// threads, over a real import table on the host provider. Meant to run clean
// under ThreadSanitizer (KVF_SANITIZE=thread) as well as gcc and ASan.
//
// Eight lease threads take leases on several clients' registrations, hold
// them a little and read every view of the leased registration (a view
// unmapped under its lease faults; one remapped to other memory reads the
// wrong tag); meanwhile two registrars re-register, unregister and abort, a
// closer disconnects clients (which then come back under a new id), a
// reaper moves a fake clock and reaps the clients it lets go silent, a
// collector collects and waits for idle clients, a completion thread
// records and looks up outcomes, and a watcher checks the counters never
// go negative or past what the threads can hold. At the end every count
// is back to zero.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <kvferry/memory.h>

#include "host/core/log.h"
#include "host/server/registry.h"
#include "mem_provider_env.h"
#include "mem_test_util.h"

using namespace kvf_mem_test;

namespace {

constexpr int kAllocs = 6;         // shared by every client: mappings are deduplicated across them
constexpr int kSlots = 4;          // engines; a closed or reaped one comes back under a new id
constexpr int kWorkers = 8;        // lease threads
constexpr int kRegistrars = 2;
constexpr int kMaxViewsPerReg = 6;
constexpr int kRunMs = 4000;
constexpr uint64_t kFirstClient = 1000;

// A registration as its registrar built it: the tag of each view's
// allocation, in view order. Lease holders check the views against it.
struct Expected {
  std::vector<uint8_t> tags;
};

class RegistryStress : public ::testing::Test {
 protected:
  void SetUp() override {
    fds_before_ = fd_count();
    kvf_import_table *t = nullptr;
    ASSERT_EQ(kvf_import_table_create(nullptr, &t), KVF_SUCCESS) << kvf_last_error();
    table_.reset(t);
    ASSERT_EQ(kvf_registry_create(table_.get(), nullptr, &reg_), KVF_SUCCESS) << kvf_last_error();
    uint64_t gran = 0;
    ASSERT_EQ(kvf_mem_granularity(KVF_MEM_PROVIDER_HOST, 0, &gran), KVF_SUCCESS);
    for (int i = 0; i < kAllocs; i++) {
      allocs_.push_back(make_alloc(KVF_MEM_PROVIDER_HOST, (uint64_t)(1 + i % 3) * gran));
      ASSERT_TRUE(allocs_.back());
      // Every byte of allocation i is its tag: a view reads it anywhere.
      std::memset(kvf_mem_alloc_ptr(allocs_[i].get()), tag_of(i), kvf_mem_alloc_size(allocs_[i].get()));
      kvf_mem_identity id;
      ASSERT_EQ(kvf_mem_alloc_identity(allocs_[i].get(), &id), KVF_SUCCESS);
      alloc_ids_.push_back(id.allocation_id);
    }
  }
  void TearDown() override {
    kvf_registry_destroy(reg_);
    if (table_) {
      EXPECT_EQ(held(table_stats(table_.get())), zero_held()) << "the import table still holds something";
    }
    table_.reset();
    allocs_.clear();
    EXPECT_EQ(fd_count(), fds_before_) << "descriptors leaked";
  }
  static uint8_t tag_of(int alloc) { return (uint8_t)(0x40 + alloc); }
  int alloc_index(uint64_t allocation_id) const {
    for (int i = 0; i < kAllocs; i++)
      if (alloc_ids_[i] == allocation_id) return i;
    return -1;
  }

  TablePtr table_;
  kvf_registry *reg_ = nullptr;
  std::vector<AllocPtr> allocs_;
  std::vector<uint64_t> alloc_ids_;
  int fds_before_ = 0;
};

// A counter that wrapped below zero or ran away reads as a huge number.
bool sane(uint64_t v, uint64_t bound) { return v <= bound; }

TEST_F(RegistryStress, LeasesStayMappedWhileEverythingElseChurns) {
  std::atomic<uint64_t> slot_client[kSlots];
  std::atomic<uint64_t> next_client{kFirstClient};
  for (auto &c : slot_client) c = next_client++;
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> now{1};  // the fake clock: the reaper moves it
  std::atomic<int> errors{0};
  std::mutex error_mu;           // guards first_error
  std::string first_error;
  auto fail = [&](const std::string &what) {
    if (errors++ == 0) {
      std::lock_guard<std::mutex> g(error_mu);
      first_error = what;
    }
  };
  std::atomic<uint64_t> leases_ok{0}, refused{0}, committed{0}, commit_refused{0}, aborted{0}, unregistered{0},
      closed{0}, reaped{0}, collects{0}, stat_reads{0}, completions{0}, views_read{0};
  std::mutex expected_mu;  // guards expected (registration id -> its views)
  std::map<uint64_t, Expected> expected;
  // Every reap warns: keep hundreds of them out of the test's output.
  FILE *devnull = std::fopen("/dev/null", "w");
  ASSERT_NE(devnull, nullptr);
  kvf_log_set_sink(devnull);

  // Read every view of a leased registration and compare its bytes with the
  // tags its registrar recorded. Any failure names the registration.
  auto check_views = [&](kvf_registry_reg *lease) {
    uint64_t id = kvf_registry_reg_id(lease);
    Expected want;
    {
      std::lock_guard<std::mutex> g(expected_mu);
      auto it = expected.find(id);
      if (it == expected.end()) return fail("lease on registration " + std::to_string(id) + " nobody registered");
      want = it->second;
    }
    const kvf_import_reg *ir = kvf_registry_reg_import(lease);
    if (kvf_import_reg_num_views(ir) != want.tags.size())
      return fail("registration " + std::to_string(id) + ": view count differs");
    for (uint32_t v = 0; v < want.tags.size(); v++) {
      kvf_import_view_info info;
      if (kvf_import_reg_view(ir, v, &info) != KVF_SUCCESS)
        return fail("registration " + std::to_string(id) + ": view unreadable under a lease: " + kvf_last_error());
      volatile const uint8_t *p = static_cast<const uint8_t *>(info.ptr);
      int owner = alloc_index(info.identity.allocation_id);
      // Unmapped memory faults here; memory of another allocation reads the wrong tag.
      if (p[0] != want.tags[v] || p[info.size - 1] != want.tags[v] || owner < 0 || tag_of(owner) != want.tags[v])
        return fail("registration " + std::to_string(id) + " view " + std::to_string(v) + ": wrong bytes");
      views_read++;
    }
  };

  std::vector<std::thread> threads;
  // ---- lease holders
  for (int w = 0; w < kWorkers; w++)
    threads.emplace_back([&, w] {
      std::mt19937 rng(1000u + (unsigned)w);
      while (!stop.load(std::memory_order_relaxed)) {
        // Sometimes two leases at once, on two clients (or the same one twice).
        int n = (rng() % 4 == 0) ? 2 : 1;
        kvf_registry_reg *held_leases[2] = {nullptr, nullptr};
        for (int i = 0; i < n; i++) {
          uint64_t client = slot_client[rng() % kSlots].load();
          kvf_status st = kvf_registry_lease_acquire(reg_, client, &held_leases[i]);
          if (st != KVF_SUCCESS) {
            held_leases[i] = nullptr;
            if (st != KVF_ERR_STATE && st != KVF_ERR_NOT_FOUND)
              fail(std::string("lease_acquire: ") + kvf_status_string(st));
            refused++;
            continue;
          }
          kvf_registry_state state = kvf_registry_reg_state(held_leases[i]);
          if (state != KVF_REGISTRY_ACTIVE && state != KVF_REGISTRY_DRAINING)
            fail("a leased registration in state " + std::to_string((int)state));
          check_views(held_leases[i]);
        }
        // Hold them a while, so drains and unmaps have to wait for us.
        if (rng() % 2) std::this_thread::sleep_for(std::chrono::microseconds(rng() % 200));
        for (int i = 0; i < n; i++) {
          if (!held_leases[i]) continue;
          check_views(held_leases[i]);  // still mapped, still the same memory
          kvf_status st = kvf_registry_lease_release(reg_, held_leases[i]);
          if (st != KVF_SUCCESS) fail(std::string("lease_release: ") + kvf_status_string(st) + ": " + kvf_last_error());
          leases_ok++;
        }
      }
    });

  // ---- registrars: re-register (views of 1..3 shared allocations, some
  // aliased twice), unregister, or begin and abort
  for (int rgi = 0; rgi < kRegistrars; rgi++)
    threads.emplace_back([&, rgi] {
      std::mt19937 rng(2000u + (unsigned)rgi);
      while (!stop.load(std::memory_order_relaxed)) {
        int slot = (int)(rng() % kSlots);
        uint64_t client = slot_client[slot].load();
        unsigned what = rng() % 8;
        if (what == 0) {
          kvf_status st = kvf_registry_unregister(reg_, client);
          if (st != KVF_SUCCESS && st != KVF_ERR_BUSY) fail(std::string("unregister: ") + kvf_status_string(st));
          unregistered++;
          continue;
        }
        kvf_registry_reg *attempt = nullptr;
        kvf_status st = kvf_registry_register_begin(reg_, client, now.load(), &attempt);
        if (st == KVF_ERR_STATE || st == KVF_ERR_BUSY) continue;  // closed meanwhile, or the other registrar's turn
        if (st != KVF_SUCCESS) {
          fail(std::string("register_begin: ") + kvf_status_string(st));
          continue;
        }
        if (what == 1) {
          if (kvf_registry_register_abort(reg_, attempt) != KVF_SUCCESS) fail("register_abort");
          aborted++;
          continue;
        }
        std::vector<kvf_mem_alloc *> pick;
        int nalloc = 1 + (int)(rng() % 3);
        int first = (int)(rng() % kAllocs);
        for (int i = 0; i < nalloc; i++) pick.push_back(allocs_[(first + i) % kAllocs].get());
        std::vector<kvf_import_view> views = whole_views(pick);
        Expected e;
        for (int i = 0; i < nalloc; i++) e.tags.push_back(tag_of((first + i) % kAllocs));
        if (rng() % 2) {  // a second view (an alias) of the first allocation, its second half
          kvf_import_view alias = views[0];
          alias.fd = -1;
          alias.offset = views[0].size / 2;
          alias.size = views[0].size - alias.offset;
          views.push_back(alias);
          e.tags.push_back(e.tags[0]);
        }
        {
          std::lock_guard<std::mutex> g(expected_mu);
          expected[kvf_registry_reg_id(attempt)] = e;
        }
        st = kvf_registry_register_commit(reg_, attempt, views.data(), (uint32_t)views.size());
        if (st == KVF_SUCCESS)
          committed++;
        else if (st == KVF_ERR_STATE)  // closed while mapping: drained at once
          commit_refused++;
        else
          fail(std::string("register_commit: ") + kvf_status_string(st) + ": " + kvf_last_error());
        // Heartbeat every slot but the one whose turn it is to go silent.
        uint64_t t = now.load();
        int silent = (int)((t / 40) % (kSlots + 2));
        for (int s = 0; s < kSlots; s++)
          if (s != silent) (void)kvf_registry_heartbeat(reg_, slot_client[s].load(), t);
      }
    });

  // ---- the closer: an engine disconnects; it comes back under a new id
  threads.emplace_back([&] {
    std::mt19937 rng(3000u);
    while (!stop.load(std::memory_order_relaxed)) {
      std::this_thread::sleep_for(std::chrono::microseconds(500 + rng() % 1500));
      int slot = (int)(rng() % kSlots);
      uint64_t old = slot_client[slot].exchange(next_client++);
      kvf_status st = kvf_registry_client_close(reg_, old);
      if (st != KVF_SUCCESS && st != KVF_ERR_BUSY) fail(std::string("client_close: ") + kvf_status_string(st));
      closed++;
      // KVF_ERR_STATE: the reaper or the closer's next turn closed it already.
      st = kvf_registry_client_open(reg_, slot_client[slot].load(), now.load());
      if (st != KVF_SUCCESS && st != KVF_ERR_STATE) fail(std::string("client_open: ") + kvf_status_string(st));
    }
  });

  // ---- the reaper: moves the clock, reaps clients 3 ticks silent; a reaped
  // slot comes back under a new id
  threads.emplace_back([&] {
    while (!stop.load(std::memory_order_relaxed)) {
      uint64_t t = ++now;
      uint32_t n = 0;
      kvf_status st = kvf_registry_reap(reg_, t, 3, &n);
      if (st != KVF_SUCCESS) fail(std::string("reap: ") + kvf_status_string(st));
      reaped += n;
      for (int s = 0; s < kSlots; s++) {
        uint64_t c = slot_client[s].load();
        kvf_registry_stats cs = KVF_REGISTRY_STATS_INIT;
        if (kvf_registry_client_stats(reg_, c, &cs) == KVF_SUCCESS && cs.clients_closed == 1) {
          uint64_t fresh = next_client++;
          if (slot_client[s].compare_exchange_strong(c, fresh)) {
            // KVF_ERR_STATE: the closer replaced and closed it meanwhile.
            st = kvf_registry_client_open(reg_, fresh, t);
            if (st != KVF_SUCCESS && st != KVF_ERR_STATE)
              fail(std::string("client_open after a reap: ") + kvf_status_string(st));
          }
        }
      }
      std::this_thread::sleep_for(std::chrono::microseconds(250));
    }
  });

  // ---- the collector: collect, and wait for a client to go idle
  threads.emplace_back([&] {
    std::mt19937 rng(4000u);
    while (!stop.load(std::memory_order_relaxed)) {
      kvf_status st = kvf_registry_collect(reg_);
      if (st != KVF_SUCCESS) fail(std::string("collect: ") + kvf_status_string(st));
      collects++;
      st = kvf_registry_wait_idle(reg_, slot_client[rng() % kSlots].load(), 1);
      if (st != KVF_SUCCESS && st != KVF_ERR_TIMEOUT && st != KVF_ERR_NOT_FOUND)
        fail(std::string("wait_idle: ") + kvf_status_string(st));
      std::this_thread::sleep_for(std::chrono::microseconds(300));
    }
  });

  // ---- completions: the first record wins, lookups see it or nothing
  threads.emplace_back([&] {
    std::mt19937 rng(5000u);
    uint64_t id = 1;
    while (!stop.load(std::memory_order_relaxed)) {
      uint64_t client = slot_client[rng() % kSlots].load();
      kvf_registry_outcome o{KVF_OUTCOME_DONE, KVF_SUCCESS, id};
      int dup = -1;
      if (kvf_registry_completion_record(reg_, client, id, &o, &dup) != KVF_SUCCESS || dup != 0) fail("record");
      kvf_registry_outcome again{KVF_OUTCOME_FAILED, KVF_ERR_CUDA, 0};
      if (kvf_registry_completion_record(reg_, client, id, &again, &dup) != KVF_SUCCESS || dup != 1)
        fail("a duplicate completion was not ignored");
      kvf_registry_outcome got{};
      kvf_status st = kvf_registry_completion_lookup(reg_, client, id, &got);
      if (st == KVF_SUCCESS && (got.value != id || got.kind != KVF_OUTCOME_DONE)) fail("lookup: not the first record");
      if (st != KVF_SUCCESS && st != KVF_ERR_NOT_FOUND) fail("lookup");
      completions++;
      id++;
      if (id % 64 == 0) std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  });

  // ---- the watcher: counters stay within what the threads can hold
  threads.emplace_back([&] {
    while (!stop.load(std::memory_order_relaxed)) {
      kvf_registry_stats s = KVF_REGISTRY_STATS_INIT;
      if (kvf_registry_stats_get(reg_, &s) != KVF_SUCCESS) {
        fail("stats_get");
        continue;
      }
      // Counts read under the registry's lock agree with each other; imports
      // and aliases come from the table a moment apart, so they get a bound
      // that holds whatever happened in between (and catches a wrap below 0).
      uint64_t ids = next_client.load() - kFirstClient;
      bool ok = sane(s.leases, 2 * kWorkers) && sane(s.registering, kRegistrars) && sane(s.clients, ids) &&
                sane(s.clients_closed, s.clients) && sane(s.active, s.clients) && sane(s.draining, 1u << 20) &&
                sane(s.unmap_pending, s.draining) && sane(s.imports, kAllocs) &&
                sane(s.aliases, (ids + 2 * kWorkers + kRegistrars) * kMaxViewsPerReg) && sane(s.completions, 4096);
      if (!ok) {
        char buf[320];
        std::snprintf(buf, sizeof buf,
                      "counters out of range: clients %llu closed %llu registering %llu active %llu draining %llu "
                      "pending %llu leases %llu imports %llu aliases %llu",
                      (unsigned long long)s.clients, (unsigned long long)s.clients_closed,
                      (unsigned long long)s.registering, (unsigned long long)s.active,
                      (unsigned long long)s.draining, (unsigned long long)s.unmap_pending,
                      (unsigned long long)s.leases, (unsigned long long)s.imports, (unsigned long long)s.aliases);
        fail(buf);
      }
      // One client's view: at most one active registration, never a negative count.
      for (int sl = 0; sl < kSlots; sl++) {
        kvf_registry_stats cs = KVF_REGISTRY_STATS_INIT;
        if (kvf_registry_client_stats(reg_, slot_client[sl].load(), &cs) == KVF_SUCCESS &&
            (!sane(cs.active, 1) || !sane(cs.leases, 2 * kWorkers) || !sane(cs.imports, kAllocs) ||
             !sane(cs.registering, kRegistrars)))
          fail("a client's counters out of range");
      }
      stat_reads++;
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  });

  std::this_thread::sleep_for(std::chrono::milliseconds(kRunMs));
  stop = true;
  for (auto &t : threads) t.join();
  kvf_log_set_sink(nullptr);
  std::fclose(devnull);

  EXPECT_EQ(errors.load(), 0) << "first: " << first_error;
  std::printf("stress: %llu leases (%llu views read), %llu refused, %llu commits (%llu refused), %llu aborts, "
              "%llu unregisters, %llu closes, %llu reaped, %llu collects, %llu completions, %llu stat reads\n",
              (unsigned long long)leases_ok.load(), (unsigned long long)views_read.load(),
              (unsigned long long)refused.load(), (unsigned long long)committed.load(),
              (unsigned long long)commit_refused.load(), (unsigned long long)aborted.load(),
              (unsigned long long)unregistered.load(), (unsigned long long)closed.load(),
              (unsigned long long)reaped.load(), (unsigned long long)collects.load(),
              (unsigned long long)completions.load(), (unsigned long long)stat_reads.load());
  // Every path ran, or the test proved nothing.
  EXPECT_GT(leases_ok.load(), 200u);
  EXPECT_GT(refused.load(), 0u) << "no lease was ever refused: draining was never seen";
  EXPECT_GT(committed.load(), 20u);
  EXPECT_GT(aborted.load(), 0u);
  EXPECT_GT(unregistered.load(), 0u);
  EXPECT_GT(closed.load(), 0u);
  EXPECT_GT(reaped.load(), 0u) << "the reaper never reaped";
  EXPECT_GT(stat_reads.load(), 0u);

  kvf_registry_stats s = KVF_REGISTRY_STATS_INIT;
  ASSERT_EQ(kvf_registry_stats_get(reg_, &s), KVF_SUCCESS);
  EXPECT_EQ(s.leases, 0u);
  EXPECT_EQ(s.registering, 0u);
  EXPECT_EQ(s.unmap_pending, 0u);
  EXPECT_EQ(s.leases_total, leases_ok.load());
  // Close every client id ever used (a registrar that read an id just before
  // the closer replaced it may have opened it again): everything unmaps at
  // once, no lease is held.
  for (uint64_t c = kFirstClient; c < next_client.load(); c++)
    EXPECT_EQ(kvf_registry_client_close(reg_, c), KVF_SUCCESS) << c << ": " << kvf_last_error();
  ASSERT_EQ(kvf_registry_stats_get(reg_, &s), KVF_SUCCESS);
  EXPECT_EQ(s.clients, 0u);
  EXPECT_EQ(s.active + s.draining + s.registering, 0u);
  EXPECT_EQ(s.imports, 0u);
  EXPECT_EQ(s.aliases, 0u);
  EXPECT_EQ(s.leases, 0u);
  EXPECT_EQ(held(table_stats(table_.get())), zero_held());
}

}  // namespace
