// The memory layer in one process (kvferry/memory.h): allocations, export,
// identities, the import table (one mapping per identity, alias counts,
// all-or-nothing registration, retryable close, counters), and a transfer on
// imported mappings. Every case runs on the host provider, and on the cumem
// provider over a CPU model of the driver's VMM API (tests/fake_cumem.h)
// when the build has CUDA headers. Cross-process cases are in test_ipc.cpp,
// fault sweeps in test_memory_faults.cpp, real-GPU cases in
// test_memory_gpu.cpp.
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <kvferry/device.h>
#include <kvferry/memory.h>
#include <kvferry/transfer.h>

#include "mem_provider_env.h"

using namespace kvf_mem_test;

namespace {

class MemoryTest : public ::testing::TestWithParam<Prov> {
 protected:
  MemoryTest() : env_(GetParam()) {}
  void SetUp() override {
    env_.install();
    fds_before_ = fd_count();
    kvf_status st = kvf_mem_granularity(env_.provider(), 0, &gran_);
    ASSERT_EQ(st, KVF_SUCCESS) << kvf_last_error();
  }
  void TearDown() override {
    env_.uninstall();
    EXPECT_EQ(fd_count(), fds_before_) << "descriptors leaked";
  }
  kvf_mem_provider provider() const { return env_.provider(); }

  ProviderEnv env_;
  int fds_before_ = 0;
  uint64_t gran_ = 0;
};

std::string param_name(const ::testing::TestParamInfo<Prov> &info) { return prov_name(info.param); }

TEST_P(MemoryTest, AllocateRoundsExportsAndNamesTheIdentity) {
  AllocPtr a = make_alloc(provider(), gran_ + 1);
  ASSERT_TRUE(a);
  EXPECT_EQ(kvf_mem_alloc_size(a.get()), 2 * gran_) << "size rounds up to the granularity";
  ASSERT_NE(kvf_mem_alloc_ptr(a.get()), nullptr);
  std::memset(kvf_mem_alloc_ptr(a.get()), 0x5A, kvf_mem_alloc_size(a.get()));

  kvf_mem_identity id, id2;
  ASSERT_EQ(kvf_mem_alloc_identity(a.get(), &id), KVF_SUCCESS);
  uint64_t instance = 0, generation = 0;
  ASSERT_EQ(kvf_mem_instance(&instance, &generation), KVF_SUCCESS);
  EXPECT_EQ(id.instance_id, instance);
  EXPECT_EQ(id.generation, generation);
  EXPECT_NE(id.allocation_id, 0u);
  EXPECT_EQ(id.size, kvf_mem_alloc_size(a.get()));
  EXPECT_EQ(id.provider, (uint32_t)provider());
  uint8_t zero[16] = {0};
  if (env_.prov() == Prov::Host)
    EXPECT_EQ(std::memcmp(id.device_uuid, zero, 16), 0);
  else
    EXPECT_NE(std::memcmp(id.device_uuid, zero, 16), 0) << "cumem identities carry the GPU's UUID";

  // Every export is a new close-on-exec descriptor for the same identity.
  int fd1 = -1, fd2 = -1;
  ASSERT_EQ(kvf_mem_alloc_export(a.get(), &fd1, &id2), KVF_SUCCESS) << kvf_last_error();
  ASSERT_EQ(kvf_mem_alloc_export(a.get(), &fd2, nullptr), KVF_SUCCESS) << kvf_last_error();
  EXPECT_NE(fd1, fd2);
  EXPECT_TRUE(fd_cloexec(fd1));
  EXPECT_TRUE(fd_cloexec(fd2));
  EXPECT_EQ(std::memcmp(&id, &id2, sizeof id), 0);
  if (env_.prov() == Prov::Host) {
    // Sealed: an importer can trust the size.
    int seals = fcntl(fd1, F_GET_SEALS);
    EXPECT_TRUE(seals & F_SEAL_SHRINK);
    EXPECT_TRUE(seals & F_SEAL_GROW);
    EXPECT_NE(ftruncate(fd1, 0), 0);
  }
  close(fd1);
  close(fd2);

  AllocPtr b = make_alloc(provider(), 1);
  kvf_mem_identity idb;
  ASSERT_EQ(kvf_mem_alloc_identity(b.get(), &idb), KVF_SUCCESS);
  EXPECT_EQ(idb.instance_id, id.instance_id);
  EXPECT_NE(idb.allocation_id, id.allocation_id) << "allocation ids are never reused";
  EXPECT_EQ(kvf_mem_alloc_size(b.get()), gran_);
}

TEST_P(MemoryTest, FindReturnsTheSameAllocationForAnyInteriorPointer) {
  AllocPtr a = make_alloc(provider(), 3 * gran_);
  ASSERT_TRUE(a);
  char *p = static_cast<char *>(kvf_mem_alloc_ptr(a.get()));
  kvf_mem_alloc *f1 = nullptr, *f2 = nullptr;
  ASSERT_EQ(kvf_mem_alloc_find(provider(), p + gran_ + 17, &f1), KVF_SUCCESS) << kvf_last_error();
  ASSERT_EQ(kvf_mem_alloc_find(provider(), p + 3 * gran_ - 1, &f2), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(f1, a.get());
  EXPECT_EQ(f2, a.get());
  kvf_mem_alloc_destroy(f1);
  kvf_mem_alloc_destroy(f2);
  // Still alive: the creator holds its reference.
  p[0] = 1;
  EXPECT_EQ(kvf_mem_alloc_size(a.get()), 3 * gran_);

  // One past the end is not inside.
  kvf_mem_alloc *none = nullptr;
  EXPECT_NE(kvf_mem_alloc_find(provider(), p + 3 * gran_, &none), KVF_SUCCESS);
  EXPECT_EQ(none, nullptr);
}

TEST_P(MemoryTest, InvalidArgumentsNameTheField) {
  kvf_mem_alloc *a = nullptr;
  kvf_mem_alloc_options o = KVF_MEM_ALLOC_OPTIONS_INIT;
  o.provider = provider();
  EXPECT_EQ(kvf_mem_alloc_create(&o, &a), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvf_last_error()).find("size"), std::string::npos) << kvf_last_error();
  o.size = 1;
  o.provider = (kvf_mem_provider)7;
  EXPECT_EQ(kvf_mem_alloc_create(&o, &a), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvf_last_error()).find("provider"), std::string::npos) << kvf_last_error();
  o.provider = provider();
  o.size = UINT64_MAX;
  EXPECT_EQ(kvf_mem_alloc_create(&o, &a), KVF_ERR_OVERFLOW);
  o.size = 1;
  o.struct_size = 4;  // smaller than the header (8 is a valid header-only struct)
  EXPECT_EQ(kvf_mem_alloc_create(&o, &a), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(kvf_mem_alloc_create(nullptr, &a), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(a, nullptr);
  int fd = 123;
  EXPECT_EQ(kvf_mem_alloc_export(nullptr, &fd, nullptr), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(fd, -1);
  kvf_mem_alloc_destroy(nullptr);
  EXPECT_EQ(kvf_mem_alloc_ptr(nullptr), nullptr);
  EXPECT_EQ(kvf_mem_alloc_size(nullptr), 0u);
  kvf_import_table *t = nullptr;
  kvf_import_table_options to = KVF_IMPORT_TABLE_OPTIONS_INIT;
  to.num_access_devices = 1;
  EXPECT_EQ(kvf_import_table_create(&to, &t), KVF_ERR_INVALID_ARGUMENT);
  kvf_import_table_destroy(nullptr);
  EXPECT_EQ(kvf_import_reg_num_views(nullptr), 0u);
  EXPECT_EQ(kvf_import_reg_get_state(nullptr), KVF_IMPORT_REG_FAILED);
}

// The acceptance case: 4 allocations carrying 184 layer views give 4 imports
// and 184 aliases; unregister takes both to 0.
TEST_P(MemoryTest, ManyViewsShareOneMappingPerAllocation) {
  LayerSpec spec;
  std::vector<AllocPtr> owned;
  std::vector<kvf_mem_alloc *> allocs;
  for (uint32_t r = 0; r < spec.regions; r++) {
    owned.push_back(make_alloc(provider(), spec.region_bytes()));
    ASSERT_TRUE(owned.back());
    allocs.push_back(owned.back().get());
  }
  uint64_t mapped_bytes = 0;
  for (auto *a : allocs) mapped_bytes += kvf_mem_alloc_size(a);
  TablePtr table;
  {
    kvf_import_table *t = nullptr;
    ASSERT_EQ(kvf_import_table_create(nullptr, &t), KVF_SUCCESS);
    table.reset(t);
  }
  std::vector<kvf_import_view> views = layer_views(allocs, spec);
  ASSERT_EQ(views.size(), 184u);
  // The fake driver holds one descriptor per allocation it knows: not ours.
  int fds_with_exports = fd_count() - env_.driver_live()[0];
  kvf_import_reg *reg = nullptr;
  ASSERT_EQ(kvf_import_table_register(table.get(), 42, views.data(), (uint32_t)views.size(), &reg), KVF_SUCCESS)
      << kvf_last_error();
  EXPECT_EQ(fd_count() - env_.driver_live()[0], fds_with_exports - 4) << "every descriptor is closed once imported";
  for (const auto &v : views) {
    if (v.fd >= 0) {
      EXPECT_FALSE(fd_is_open(v.fd));
    }
  }
  EXPECT_EQ(kvf_import_reg_get_state(reg), KVF_IMPORT_REG_ACTIVE);
  EXPECT_EQ(kvf_import_reg_client(reg), 42u);
  EXPECT_EQ(kvf_import_reg_num_views(reg), 184u);

  kvf_import_stats s = table_stats(table.get());
  EXPECT_EQ(s.imports, 4u);
  EXPECT_EQ(s.aliases, 184u);
  EXPECT_EQ(s.bytes_mapped, mapped_bytes);
  EXPECT_EQ(s.handles, 0u) << "import handles are released after mapping";
  EXPECT_EQ(s.reservations, 4u);
  EXPECT_EQ(s.registrations, 1u);
  EXPECT_EQ(s.imports_total, 4u);
  kvf_import_stats c = client_stats(table.get(), 42);
  EXPECT_EQ(c.imports, 4u);
  EXPECT_EQ(c.aliases, 184u);
  EXPECT_EQ(c.bytes_mapped, mapped_bytes);
  EXPECT_EQ(client_stats(table.get(), 43).aliases, 0u);

  // Views of one allocation share its mapping; the base is a region base.
  kvf_import_view_info v0, v1, v46;
  ASSERT_EQ(kvf_import_reg_view(reg, 0, &v0), KVF_SUCCESS);
  ASSERT_EQ(kvf_import_reg_view(reg, 1, &v1), KVF_SUCCESS);
  ASSERT_EQ(kvf_import_reg_view(reg, 46, &v46), KVF_SUCCESS);
  EXPECT_EQ(v0.base, v1.base);
  EXPECT_NE(v0.base, v46.base);
  EXPECT_EQ(static_cast<char *>(v1.ptr), static_cast<char *>(v1.base) + spec.layer_bytes());
  EXPECT_EQ(v1.mapping_size, kvf_mem_alloc_size(allocs[0]));
  EXPECT_EQ(v0.device, env_.prov() == Prov::Host ? -1 : 0);
  kvf_import_view_info bad;
  EXPECT_EQ(kvf_import_reg_view(reg, 184, &bad), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(moves_data(reg, allocs, 1));

  ASSERT_EQ(kvf_import_table_unregister(table.get(), reg), KVF_SUCCESS) << kvf_last_error();
  s = table_stats(table.get());
  EXPECT_EQ(s.imports, 0u);
  EXPECT_EQ(s.aliases, 0u);
  EXPECT_EQ(s.bytes_mapped, 0u);
  EXPECT_EQ(s.reservations, 0u);
  EXPECT_EQ(s.registrations, 0u);
  c = client_stats(table.get(), 42);
  EXPECT_EQ(c.imports, 0u);
  EXPECT_EQ(c.aliases, 0u);
}

TEST_P(MemoryTest, UnmapsOnlyWhenTheLastAliasGoes) {
  std::vector<AllocPtr> owned;
  owned.push_back(make_alloc(provider(), gran_));
  owned.push_back(make_alloc(provider(), 2 * gran_));
  std::vector<kvf_mem_alloc *> allocs = {owned[0].get(), owned[1].get()};
  kvf_import_table *t = nullptr;
  ASSERT_EQ(kvf_import_table_create(nullptr, &t), KVF_SUCCESS);
  TablePtr table(t);

  // Client 1 registers both; client 2 registers the first again (dedup:
  // its descriptor is closed unused) and client 1 registers a second set.
  std::vector<kvf_import_view> v1 = whole_views(allocs);
  kvf_import_reg *r1 = nullptr, *r2 = nullptr, *r3 = nullptr;
  ASSERT_EQ(kvf_import_table_register(t, 1, v1.data(), 2, &r1), KVF_SUCCESS) << kvf_last_error();
  std::vector<kvf_import_view> v2 = whole_views({allocs[0]});
  arm(0);  // count calls
  ASSERT_EQ(kvf_import_table_register(t, 2, v2.data(), 1, &r2), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(calls_of(env_.reserve_call()), 0) << "an identity already mapped is not imported again";
  EXPECT_FALSE(fd_is_open(v2[0].fd));
  std::vector<kvf_import_view> v3 = v1;
  v3[1].fd = v3[0].fd = -1;  // the table maps both already: no descriptors needed
  ASSERT_EQ(kvf_import_table_register(t, 1, v3.data(), 2, &r3), KVF_SUCCESS) << kvf_last_error();
  disarm();

  kvf_import_view_info a, b;
  ASSERT_EQ(kvf_import_reg_view(r1, 0, &a), KVF_SUCCESS);
  ASSERT_EQ(kvf_import_reg_view(r2, 0, &b), KVF_SUCCESS);
  EXPECT_EQ(a.base, b.base) << "one mapping per identity, across clients";
  kvf_import_stats s = table_stats(t);
  EXPECT_EQ(s.imports, 2u);
  EXPECT_EQ(s.aliases, 5u);
  EXPECT_EQ(s.dedup_total, 3u);
  EXPECT_EQ(client_stats(t, 1).aliases, 4u);
  EXPECT_EQ(client_stats(t, 1).imports, 2u);
  EXPECT_EQ(client_stats(t, 2).imports, 1u);
  EXPECT_EQ(client_stats(t, 2).registrations, 1u);
  EXPECT_EQ(client_stats(t, 1).registrations, 2u);

  // Dropping r1 and r3 leaves allocation 0 mapped for r2, unmaps allocation 1.
  arm(0);
  ASSERT_EQ(kvf_import_table_unregister(t, r1), KVF_SUCCESS);
  EXPECT_EQ(calls_of(env_.unmap_call()), 0) << "still aliased by r2 and r3";
  ASSERT_EQ(kvf_import_table_unregister(t, r3), KVF_SUCCESS);
  EXPECT_EQ(calls_of(env_.unmap_call()), 1) << "allocation 1 lost its last alias";
  disarm();
  s = table_stats(t);
  EXPECT_EQ(s.imports, 1u);
  EXPECT_EQ(s.aliases, 1u);
  EXPECT_TRUE(moves_data(r2, allocs, 7));
  ASSERT_EQ(kvf_import_table_unregister(t, r2), KVF_SUCCESS);
  EXPECT_EQ(table_stats(t).imports, 0u);
}

TEST_P(MemoryTest, FailedRegistrationRollsBackAndKeepsThePriorOne) {
  std::vector<AllocPtr> owned;
  for (int i = 0; i < 3; i++) owned.push_back(make_alloc(provider(), gran_));
  std::vector<kvf_mem_alloc *> allocs = {owned[0].get(), owned[1].get(), owned[2].get()};
  kvf_import_table *t = nullptr;
  ASSERT_EQ(kvf_import_table_create(nullptr, &t), KVF_SUCCESS);
  TablePtr table(t);
  std::vector<kvf_import_view> prior_views = whole_views({allocs[0]});
  kvf_import_reg *prior = nullptr;
  ASSERT_EQ(kvf_import_table_register(t, 9, prior_views.data(), 1, &prior), KVF_SUCCESS);
  kvf_import_stats before = table_stats(t);

  // The same client tries again: allocation 0 (already mapped), allocation
  // 1 (imports fine), allocation 2 whose access step fails.
  std::vector<kvf_import_view> views = whole_views(allocs);
  arm_named(env_.access_call(), 2);
  kvf_import_reg *reg = nullptr;
  kvf_status st = kvf_import_table_register(t, 9, views.data(), 3, &reg);
  bool hit = faults().hit;
  disarm();
  ASSERT_TRUE(hit);
  EXPECT_NE(st, KVF_SUCCESS);
  EXPECT_EQ(reg, nullptr);
  EXPECT_NE(std::string(kvf_last_error()).find("client 9"), std::string::npos) << kvf_last_error();
  for (auto &v : views) EXPECT_FALSE(fd_is_open(v.fd)) << "descriptors are closed on failure too";
  kvf_import_stats after = table_stats(t);
  EXPECT_EQ(held(after), held(before)) << "every step of the attempt was undone";
  EXPECT_EQ(after.rollbacks_total, 1u);
  EXPECT_EQ(after.imports_total, before.imports_total);
  EXPECT_EQ(kvf_import_reg_get_state(prior), KVF_IMPORT_REG_ACTIVE);
  EXPECT_TRUE(moves_data(prior, allocs, 3));
  EXPECT_EQ(client_stats(t, 9).aliases, 1u);
  ASSERT_EQ(kvf_import_table_unregister(t, prior), KVF_SUCCESS);
}

TEST_P(MemoryTest, RejectsBadViewSetsAndClosesTheirDescriptors) {
  std::vector<AllocPtr> owned;
  owned.push_back(make_alloc(provider(), gran_));
  owned.push_back(make_alloc(provider(), gran_));
  std::vector<kvf_mem_alloc *> allocs = {owned[0].get(), owned[1].get()};
  kvf_import_table *t = nullptr;
  ASSERT_EQ(kvf_import_table_create(nullptr, &t), KVF_SUCCESS);
  TablePtr table(t);
  kvf_import_reg *reg = nullptr;
  auto expect_rejected = [&](std::vector<kvf_import_view> v, kvf_status want, const char *needle) {
    kvf_status st = kvf_import_table_register(t, 5, v.data(), (uint32_t)v.size(), &reg);
    EXPECT_EQ(st, want) << kvf_last_error();
    EXPECT_NE(std::string(kvf_last_error()).find(needle), std::string::npos) << kvf_last_error();
    EXPECT_EQ(reg, nullptr);
    for (auto &x : v) {
      if (x.fd >= 0) {
        EXPECT_FALSE(fd_is_open(x.fd)) << needle;
      }
    }
    EXPECT_EQ(table_stats(t).imports, 0u);
  };

  // An identity the table does not map, without a descriptor.
  std::vector<kvf_import_view> v = whole_views(allocs);
  close(v[1].fd);
  v[1].fd = -1;
  expect_rejected(v, KVF_ERR_INVALID_ARGUMENT, "views[1]: no descriptor");

  // A view past the end of its allocation.
  v = whole_views(allocs);
  v[0].offset = 8;
  expect_rejected(v, KVF_ERR_INVALID_ARGUMENT, "views[0]: offset 8");

  // One descriptor number for two allocations.
  v = whole_views(allocs);
  close(v[1].fd);
  v[1].fd = v[0].fd;
  expect_rejected(v, KVF_ERR_INVALID_ARGUMENT, "views[1].fd");

  // An identity that disagrees with another view of the same key.
  v = whole_views({allocs[0], allocs[0]});
  v[1].identity.size *= 2;
  v[1].size = v[1].identity.size;
  expect_rejected(v, KVF_ERR_PROTOCOL, "disagrees");

  // A descriptor that is not what the identity says (a pipe).
  int p[2];
  ASSERT_EQ(pipe2(p, O_CLOEXEC), 0);
  close(p[1]);
  v = whole_views({allocs[0]});
  close(v[0].fd);
  v[0].fd = p[0];
  kvf_status st = kvf_import_table_register(t, 5, v.data(), 1, &reg);
  EXPECT_NE(st, KVF_SUCCESS);
  EXPECT_FALSE(fd_is_open(p[0]));
  EXPECT_EQ(held(table_stats(t)), zero_held());

  // Unknown provider, size 0, NULL out.
  v = whole_views({allocs[0]});
  v[0].identity.provider = 9;
  expect_rejected(v, KVF_ERR_UNSUPPORTED, "provider");
  v = whole_views({allocs[0]});
  v[0].size = 0;
  expect_rejected(v, KVF_ERR_INVALID_ARGUMENT, "size is 0");
  v = whole_views({allocs[0]});
  EXPECT_EQ(kvf_import_table_register(t, 5, v.data(), 1, nullptr), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_FALSE(fd_is_open(v[0].fd));
  EXPECT_EQ(kvf_import_table_unregister(t, nullptr), KVF_ERR_INVALID_ARGUMENT);
}

TEST_P(MemoryTest, DisagreeingIdentityOfALiveMappingIsAProtocolError) {
  AllocPtr a = make_alloc(provider(), gran_);
  kvf_import_table *t = nullptr;
  ASSERT_EQ(kvf_import_table_create(nullptr, &t), KVF_SUCCESS);
  TablePtr table(t);
  std::vector<kvf_import_view> v = whole_views({a.get()});
  kvf_import_reg *r1 = nullptr, *r2 = nullptr;
  ASSERT_EQ(kvf_import_table_register(t, 1, v.data(), 1, &r1), KVF_SUCCESS);
  v = whole_views({a.get()});
  v[0].identity.device_uuid[3] ^= 1;
  EXPECT_EQ(kvf_import_table_register(t, 2, v.data(), 1, &r2), KVF_ERR_PROTOCOL);
  EXPECT_FALSE(fd_is_open(v[0].fd));
  EXPECT_EQ(table_stats(t).aliases, 1u);
  ASSERT_EQ(kvf_import_table_unregister(t, r1), KVF_SUCCESS);
}

// A descriptor sent for an identity the table maps must be that allocation:
// a pipe, or another allocation's descriptor, is refused naming the view's
// descriptor, and the live mapping is untouched. (cumem: another
// allocation on the same device passes until the driver's export inodes
// are known to be stable: MemoryGpu.ExportInodes; the pipe does not.)
TEST_P(MemoryTest, ADescriptorForAMappedIdentityMustBeThatAllocation) {
  AllocPtr a = make_alloc(provider(), gran_), b = make_alloc(provider(), gran_);
  kvf_import_table *t = nullptr;
  ASSERT_EQ(kvf_import_table_create(nullptr, &t), KVF_SUCCESS);
  TablePtr table(t);
  std::vector<kvf_import_view> v = whole_views({a.get()});
  kvf_import_reg *r1 = nullptr, *r2 = nullptr;
  ASSERT_EQ(kvf_import_table_register(t, 1, v.data(), 1, &r1), KVF_SUCCESS) << kvf_last_error();
  std::vector<int> wrong;
  int p[2];
  ASSERT_EQ(pipe2(p, O_CLOEXEC), 0);
  close(p[1]);
  wrong.push_back(p[0]);
  if (provider() == KVF_MEM_PROVIDER_HOST) {
    std::vector<kvf_import_view> vb = whole_views({b.get()});
    wrong.push_back(vb[0].fd);
  }
  for (int fd : wrong) {
    v = whole_views({a.get()});
    close(v[0].fd);
    v[0].fd = fd;
    EXPECT_EQ(kvf_import_table_register(t, 1, v.data(), 1, &r2), KVF_ERR_PROTOCOL) << kvf_last_error();
    EXPECT_NE(std::string(kvf_last_error()).find("views[0].fd: "), std::string::npos) << kvf_last_error();
    EXPECT_FALSE(fd_is_open(fd));
    kvf_import_stats s = table_stats(t);
    EXPECT_EQ(s.imports, 1u);
    EXPECT_EQ(s.aliases, 1u);
  }
  // Its own descriptor again: an alias.
  v = whole_views({a.get()});
  ASSERT_EQ(kvf_import_table_register(t, 1, v.data(), 1, &r2), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(table_stats(t).aliases, 2u);
  EXPECT_TRUE(moves_data(r1, {a.get()}, 11));
  ASSERT_EQ(kvf_import_table_unregister(t, r2), KVF_SUCCESS);
  ASSERT_EQ(kvf_import_table_unregister(t, r1), KVF_SUCCESS);
}

// A new identity whose descriptor is not what the provider exports is
// refused before anything of the registration is mapped, naming the view:
// here the second of two allocations comes with a pipe.
TEST_P(MemoryTest, AWrongDescriptorIsRefusedBeforeAnythingIsMapped) {
  AllocPtr a = make_alloc(provider(), gran_), b = make_alloc(provider(), gran_);
  kvf_import_table *t = nullptr;
  ASSERT_EQ(kvf_import_table_create(nullptr, &t), KVF_SUCCESS);
  TablePtr table(t);
  std::vector<kvf_import_view> v = whole_views({a.get(), b.get()});
  int p[2];
  ASSERT_EQ(pipe2(p, O_CLOEXEC), 0);
  close(p[1]);
  close(v[1].fd);
  v[1].fd = p[0];
  kvf_import_reg *reg = nullptr;
  arm(0);  // count calls
  kvf_status st = kvf_import_table_register(t, 1, v.data(), 2, &reg);
  long reserves = calls_of(env_.reserve_call());
  disarm();
  EXPECT_NE(st, KVF_SUCCESS);
  EXPECT_NE(std::string(kvf_last_error()).find("views[1].fd: "), std::string::npos) << kvf_last_error();
  EXPECT_EQ(reserves, 0) << "an address range was reserved before every descriptor was looked at";
  EXPECT_FALSE(fd_is_open(v[0].fd));
  EXPECT_FALSE(fd_is_open(p[0]));
  EXPECT_EQ(held(table_stats(t)), zero_held());
}

// Each close step is recorded: a failed unmap leaves the registration
// closing; the retry does only what is left, with no device reset.
TEST_P(MemoryTest, UnregisterIsRetryableStepByStep) {
  std::vector<AllocPtr> owned;
  owned.push_back(make_alloc(provider(), gran_));
  owned.push_back(make_alloc(provider(), gran_));
  std::vector<kvf_mem_alloc *> allocs = {owned[0].get(), owned[1].get()};
  kvf_import_table *t = nullptr;
  ASSERT_EQ(kvf_import_table_create(nullptr, &t), KVF_SUCCESS);
  TablePtr table(t);
  std::vector<kvf_import_view> v = whole_views(allocs);
  kvf_import_reg *reg = nullptr;
  ASSERT_EQ(kvf_import_table_register(t, 3, v.data(), 2, &reg), KVF_SUCCESS);

  // First try: the second mapping's unmap fails.
  arm_named(env_.unmap_call(), 2);
  kvf_status st = kvf_import_table_unregister(t, reg);
  disarm();
  ASSERT_NE(st, KVF_SUCCESS);
  EXPECT_NE(std::string(kvf_last_error()).find("call again"), std::string::npos) << kvf_last_error();
  EXPECT_EQ(kvf_import_reg_get_state(reg), KVF_IMPORT_REG_CLOSING);
  kvf_import_view_info info;
  EXPECT_EQ(kvf_import_reg_view(reg, 0, &info), KVF_ERR_STATE);
  kvf_import_stats s = table_stats(t);
  EXPECT_EQ(s.aliases, 0u);
  EXPECT_EQ(s.imports, 1u);
  EXPECT_EQ(s.pending_closes, 1u);
  EXPECT_EQ(s.bytes_mapped, gran_);
  EXPECT_EQ(s.registrations, 1u);
  kvf_import_stats c = client_stats(t, 3);
  EXPECT_EQ(c.pending_closes, 1u);
  EXPECT_EQ(c.imports, 1u);
  EXPECT_EQ(c.aliases, 0u);

  // Second try: the unmap succeeds, the address free fails.
  arm_named(env_.address_free_call(), 1);
  st = kvf_import_table_unregister(t, reg);
  disarm();
  ASSERT_NE(st, KVF_SUCCESS);
  s = table_stats(t);
  EXPECT_EQ(s.bytes_mapped, 0u) << "unmapped";
  EXPECT_EQ(s.reservations, 1u) << "range still held";

  // Third try: only the address free runs.
  arm(0);
  ASSERT_EQ(kvf_import_table_unregister(t, reg), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(calls_of(env_.unmap_call()), 0) << "the unmap is not redone";
  EXPECT_EQ(calls_of(env_.address_free_call()), 1);
  disarm();
  EXPECT_EQ(held(table_stats(t)), zero_held());
}

// A rollback whose own close fails keeps the mapping for collect.
TEST_P(MemoryTest, RollbackLeftoversAreCollected) {
  AllocPtr a = make_alloc(provider(), gran_);
  kvf_import_table *t = nullptr;
  ASSERT_EQ(kvf_import_table_create(nullptr, &t), KVF_SUCCESS);
  TablePtr table(t);
  std::vector<kvf_import_view> v = whole_views({a.get()});
  kvf_import_reg *reg = nullptr;
  arm_named(env_.access_call(), 1);
  arm_named(env_.unmap_call(), env_.unmap_nth_in_register());
  EXPECT_NE(kvf_import_table_register(t, 4, v.data(), 1, &reg), KVF_SUCCESS);
  disarm();
  EXPECT_NE(std::string(kvf_last_error()).find("kvf_import_table_collect"), std::string::npos) << kvf_last_error();
  kvf_import_stats s = table_stats(t);
  EXPECT_EQ(s.pending_closes, 1u);
  EXPECT_EQ(s.aliases, 0u);
  EXPECT_EQ(s.handles, 0u) << "the handle release is independent of the failed unmap";
  EXPECT_EQ(client_stats(t, 4).registrations, 0u);
  ASSERT_EQ(kvf_import_table_collect(t), KVF_SUCCESS) << kvf_last_error();
  EXPECT_EQ(held(table_stats(t)), zero_held());
}

// Destroying a table with live registrations closes everything.
TEST_P(MemoryTest, DestroyClosesLiveRegistrations) {
  AllocPtr a = make_alloc(provider(), gran_);
  kvf_import_table *t = nullptr;
  ASSERT_EQ(kvf_import_table_create(nullptr, &t), KVF_SUCCESS);
  std::vector<kvf_import_view> v = whole_views({a.get()});
  kvf_import_reg *reg = nullptr;
  ASSERT_EQ(kvf_import_table_register(t, 4, v.data(), 1, &reg), KVF_SUCCESS);
  v = whole_views({a.get()});
  ASSERT_EQ(kvf_import_table_register(t, 5, v.data(), 1, &reg), KVF_SUCCESS);
  kvf_import_table_destroy(t);  // TearDown checks descriptors and the fake driver's counts
}

// A kvf_xfer gather whose region bases are imported mappings (the host
// backend here; test_memory_gpu.cpp runs it on a GPU) matches the reference
// gather on the exporter's own pointers.
TEST_P(MemoryTest, TransferRunsOnImportedMappings) {
  LayerSpec spec;
  GeometryPtr g = make_geometry(spec);
  ASSERT_TRUE(g);
  std::vector<AllocPtr> owned;
  std::vector<kvf_mem_alloc *> allocs;
  std::vector<void *> exporter_bases;
  for (uint32_t r = 0; r < spec.regions; r++) {
    owned.push_back(make_alloc(provider(), spec.region_bytes()));
    ASSERT_TRUE(owned.back());
    allocs.push_back(owned.back().get());
    exporter_bases.push_back(kvf_mem_alloc_ptr(allocs.back()));
    fill_pattern(exporter_bases.back(), spec.region_bytes(), 11, r);
  }
  kvf_import_table *t = nullptr;
  ASSERT_EQ(kvf_import_table_create(nullptr, &t), KVF_SUCCESS);
  TablePtr table(t);
  std::vector<kvf_import_view> views = layer_views(allocs, spec);
  kvf_import_reg *reg = nullptr;
  ASSERT_EQ(kvf_import_table_register(t, 1, views.data(), (uint32_t)views.size(), &reg), KVF_SUCCESS);
  std::vector<void *> imported_bases(spec.regions);
  for (uint32_t l = 0; l < spec.layers(); l += spec.layers_per_region) {
    kvf_import_view_info info;
    ASSERT_EQ(kvf_import_reg_view(reg, l, &info), KVF_SUCCESS);
    imported_bases[spec.region_of(l)] = info.base;
    EXPECT_NE(info.base, exporter_bases[spec.region_of(l)]) << "a mapping of its own";
  }

  GatherRequest want(g.get(), spec, exporter_bases, 512);
  ASSERT_EQ(kvf_reference_gather(g.get(), &want.req), KVF_SUCCESS) << kvf_last_error();
  GatherRequest got(g.get(), spec, imported_bases, 512);
  kvf_xfer *x = nullptr;
  ASSERT_EQ(kvf_xfer_create(g.get(), nullptr, &x), KVF_SUCCESS) << kvf_last_error();
  ASSERT_EQ(kvf_xfer_gather(x, &got.req, nullptr), KVF_SUCCESS) << kvf_last_error();
  kvf_xfer_destroy(x);
  ASSERT_EQ(got.objects.size(), want.objects.size());
  for (size_t i = 0; i < got.objects.size(); i++) EXPECT_TRUE(got.objects[i] == want.objects[i]) << "object " << i;
  ASSERT_EQ(kvf_import_table_unregister(t, reg), KVF_SUCCESS);
}

INSTANTIATE_TEST_SUITE_P(Providers, MemoryTest, ::testing::ValuesIn(all_providers()), param_name);

// ---- provider-specific -------------------------------------------------------

TEST(MemoryHost, FindOnlyKnowsItsOwnAllocations) {
  std::vector<char> other(4096);
  kvf_mem_alloc *a = nullptr;
  EXPECT_EQ(kvf_mem_alloc_find(KVF_MEM_PROVIDER_HOST, other.data(), &a), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvf_last_error()).find("kvf_mem_alloc_create"), std::string::npos) << kvf_last_error();
  EXPECT_EQ(kvf_mem_alloc_find(KVF_MEM_PROVIDER_HOST, nullptr, &a), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(a, nullptr);
}

TEST(MemoryHost, UnsealedMemfdIsRefused) {
  int fd = memfd_create("kvf-test-unsealed", MFD_CLOEXEC);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, 4096), 0);
  kvf_import_view v{};
  v.identity.instance_id = 1;
  v.identity.allocation_id = 1;
  v.identity.generation = 1;
  v.identity.size = 4096;
  v.identity.provider = KVF_MEM_PROVIDER_HOST;
  v.fd = fd;
  v.size = 4096;
  kvf_import_table *t = nullptr;
  ASSERT_EQ(kvf_import_table_create(nullptr, &t), KVF_SUCCESS);
  kvf_import_reg *reg = nullptr;
  EXPECT_EQ(kvf_import_table_register(t, 1, &v, 1, &reg), KVF_ERR_PROTOCOL);
  EXPECT_NE(std::string(kvf_last_error()).find("F_SEAL_SHRINK"), std::string::npos) << kvf_last_error();
  EXPECT_FALSE(fd_is_open(fd));
  kvf_import_table_destroy(t);
}

TEST(MemoryInstance, IdentitiesDifferAcrossProcessesAndGenerations) {
  uint64_t id0 = 0, gen0 = 0;
  ASSERT_EQ(kvf_mem_instance(&id0, &gen0), KVF_SUCCESS);
  EXPECT_NE(id0, 0u);
  int p[2];
  ASSERT_EQ(pipe(p), 0);
  pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    uint64_t id = 0;
    kvf_mem_instance(&id, nullptr);
    ssize_t n = write(p[1], &id, sizeof id);
    _exit(n == (ssize_t)sizeof id ? 0 : 1);
  }
  uint64_t child = 0;
  ASSERT_EQ(read(p[0], &child, sizeof child), (ssize_t)sizeof child);
  int status = 0;
  waitpid(pid, &status, 0);
  close(p[0]);
  close(p[1]);
  EXPECT_NE(child, id0) << "a forked child draws its own instance id";
  uint64_t again = 0;
  kvf_mem_instance(&again, nullptr);
  EXPECT_EQ(again, id0);

  // An engine worker may set a stable id and count restarts in the generation.
  ASSERT_EQ(kvf_mem_instance_set(0x1234, 7), KVF_SUCCESS);
  AllocPtr a = make_alloc(KVF_MEM_PROVIDER_HOST, 1);
  kvf_mem_identity id;
  kvf_mem_alloc_identity(a.get(), &id);
  EXPECT_EQ(id.instance_id, 0x1234u);
  EXPECT_EQ(id.generation, 7u);
  char text[128];
  EXPECT_NE(std::string(kvf_mem_identity_format(&id, text, sizeof text)).find("host:0000000000001234:"),
            std::string::npos)
      << text;
  ASSERT_EQ(kvf_mem_instance_set(0, 1), KVF_SUCCESS);
  uint64_t fresh = 0;
  kvf_mem_instance(&fresh, nullptr);
  EXPECT_NE(fresh, 0x1234u);
}

// Registrations from several threads at once share mappings correctly.
TEST(MemoryHost, ConcurrentRegistrationsShareMappings) {
  int before = fd_count();
  {
    std::vector<AllocPtr> owned;
    std::vector<kvf_mem_alloc *> allocs;
    for (int i = 0; i < 3; i++) {
      owned.push_back(make_alloc(KVF_MEM_PROVIDER_HOST, 1 << 20));
      allocs.push_back(owned.back().get());
    }
    kvf_import_table *t = nullptr;
    ASSERT_EQ(kvf_import_table_create(nullptr, &t), KVF_SUCCESS);
    TablePtr table(t);
    // A long-lived registration keeps every allocation mapped: each thread's
    // registrations then alias the same three mappings.
    std::vector<kvf_import_view> base_views = whole_views(allocs);
    kvf_import_reg *base = nullptr;
    ASSERT_EQ(kvf_import_table_register(t, 99, base_views.data(), 3, &base), KVF_SUCCESS);
    std::atomic<int> failures{0};
    std::vector<std::thread> threads;
    for (uint64_t client = 1; client <= 4; client++)
      threads.emplace_back([&, client] {
        for (int cycle = 0; cycle < 50; cycle++) {
          kvf_mem_alloc *found = nullptr;
          if (kvf_mem_alloc_find(KVF_MEM_PROVIDER_HOST, static_cast<char *>(kvf_mem_alloc_ptr(allocs[1])) + 99,
                                 &found) != KVF_SUCCESS ||
              found != allocs[1])
            failures++;
          kvf_mem_alloc_destroy(found);
          std::vector<kvf_import_view> v;
          for (kvf_mem_alloc *a : allocs) {
            kvf_import_view view{};
            if (kvf_mem_alloc_export(a, &view.fd, &view.identity) != KVF_SUCCESS) failures++;
            view.size = 4096;
            view.offset = 4096 * client;
            v.push_back(view);
          }
          kvf_import_reg *reg = nullptr;
          if (kvf_import_table_register(t, client, v.data(), (uint32_t)v.size(), &reg) != KVF_SUCCESS) {
            failures++;
            continue;
          }
          kvf_import_view_info info;
          for (uint32_t i = 0; i < 3; i++) {
            if (kvf_import_reg_view(reg, i, &info) != KVF_SUCCESS) failures++;
            static_cast<uint8_t *>(info.ptr)[0] = (uint8_t)client;
            if (static_cast<uint8_t *>(kvf_mem_alloc_ptr(allocs[i]))[4096 * client] != (uint8_t)client) failures++;
          }
          if (kvf_import_table_unregister(t, reg) != KVF_SUCCESS) failures++;
        }
      });
    for (auto &th : threads) th.join();
    EXPECT_EQ(failures.load(), 0);
    kvf_import_stats s = table_stats(t);
    EXPECT_EQ(s.imports, 3u);
    EXPECT_EQ(s.aliases, 3u);
    EXPECT_EQ(s.imports_total, 3u) << "one import per allocation, however many threads";
    EXPECT_EQ(s.dedup_total, 4u * 50u * 3u);
    ASSERT_EQ(kvf_import_table_unregister(t, base), KVF_SUCCESS);
    EXPECT_EQ(held(table_stats(t)), zero_held());
  }
  EXPECT_EQ(fd_count(), before);
}

// Without a driver (this machine, or KVF_CUDA_DISABLE=1) the cumem provider
// says so, and a cumem descriptor handed to the table is still closed.
TEST(MemoryCumem, WithoutADriverFailsCleanly) {
  kvf_cuda_info info = KVF_CUDA_INFO_INIT;
  if (kvf_cuda_probe(&info) == KVF_SUCCESS) GTEST_SKIP() << "a CUDA driver is present: " << info.message;
  kvf_status none = kvf_cuda_probe(&info);
  kvf_mem_alloc_options o = KVF_MEM_ALLOC_OPTIONS_INIT;
  o.provider = KVF_MEM_PROVIDER_CUMEM;
  o.size = 1;
  kvf_mem_alloc *a = nullptr;
  EXPECT_EQ(kvf_mem_alloc_create(&o, &a), none) << kvf_last_error();
  EXPECT_EQ(a, nullptr);
  uint64_t g = 0;
  EXPECT_EQ(kvf_mem_granularity(KVF_MEM_PROVIDER_CUMEM, 0, &g), none);
  int fd = memfd_create("kvf-not-cumem", MFD_CLOEXEC);
  kvf_import_view v{};
  v.identity.allocation_id = 1;
  v.identity.size = 2 << 20;
  v.identity.provider = KVF_MEM_PROVIDER_CUMEM;
  v.fd = fd;
  v.size = 4096;
  kvf_import_table *t = nullptr;
  ASSERT_EQ(kvf_import_table_create(nullptr, &t), KVF_SUCCESS);
  kvf_import_reg *reg = nullptr;
  EXPECT_EQ(kvf_import_table_register(t, 1, &v, 1, &reg), none);
  EXPECT_FALSE(fd_is_open(fd));
  EXPECT_EQ(held(table_stats(t)), zero_held());
  kvf_import_table_destroy(t);
}

#if KVF_WITH_CUDA
class FakeCumemTest : public ::testing::Test {
 protected:
  FakeCumemTest() : env_(Prov::FakeCumem) {}
  void SetUp() override { env_.install(); }
  void TearDown() override { env_.uninstall(); }
  ProviderEnv env_;
};

// Memory from cudaMalloc (modelled: known to cuMemGetAddressRange, refused by
// cuMemRetainAllocationHandle) gets an error that says what to allocate.
TEST_F(FakeCumemTest, UnexportableMemorySaysWhatToAllocateInstead) {
  void *legacy = fakecu::legacy_alloc(1 << 20);
  kvf_mem_alloc *a = nullptr;
  EXPECT_EQ(kvf_mem_alloc_find(KVF_MEM_PROVIDER_CUMEM, static_cast<char *>(legacy) + 100, &a), KVF_ERR_UNSUPPORTED);
  std::string msg = kvf_last_error();
  EXPECT_NE(msg.find("cudaMalloc"), std::string::npos) << msg;
  EXPECT_NE(msg.find("kvf_mem_alloc_create"), std::string::npos) << msg;
  EXPECT_NE(msg.find("CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR"), std::string::npos) << msg;
  fakecu::legacy_free(legacy);

  // Not device memory at all.
  std::vector<char> host(64);
  EXPECT_EQ(kvf_mem_alloc_find(KVF_MEM_PROVIDER_CUMEM, host.data(), &a), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(a, nullptr);
}

// cuMem memory allocated by someone else: found from an interior pointer;
// the retained handle is released on destroy and the memory stays its owner's.
TEST_F(FakeCumemTest, FindsForeignAllocationsFromInteriorPointers) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 1;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  const kvf_cuda_table *cu = kvf_cuda();
  size_t size = 2 * fakecu::kGranularity;
  CUmemGenericAllocationHandle h;
  CUdeviceptr p;
  ASSERT_EQ(cu->cuMemCreate(&h, size, &prop, 0), CUDA_SUCCESS);
  ASSERT_EQ(cu->cuMemAddressReserve(&p, size, 0, 0, 0), CUDA_SUCCESS);
  ASSERT_EQ(cu->cuMemMap(p, size, 0, h, 0), CUDA_SUCCESS);
  CUmemAccessDesc d{};
  d.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  d.location.id = 1;
  d.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  ASSERT_EQ(cu->cuMemSetAccess(p, size, &d, 1), CUDA_SUCCESS);

  kvf_mem_alloc *a = nullptr, *again = nullptr;
  ASSERT_EQ(kvf_mem_alloc_find(KVF_MEM_PROVIDER_CUMEM, (void *)(uintptr_t)(p + 12345), &a), KVF_SUCCESS)
      << kvf_last_error();
  EXPECT_EQ(kvf_mem_alloc_ptr(a), (void *)(uintptr_t)p);
  EXPECT_EQ(kvf_mem_alloc_size(a), size);
  ASSERT_EQ(kvf_mem_alloc_find(KVF_MEM_PROVIDER_CUMEM, (void *)(uintptr_t)(p + size - 1), &again), KVF_SUCCESS);
  EXPECT_EQ(again, a) << "the same allocation, the same identity";
  kvf_mem_identity id;
  kvf_mem_alloc_identity(a, &id);
  CUuuid u;
  cu->cuDeviceGetUuid(&u, 1);
  EXPECT_EQ(std::memcmp(id.device_uuid, u.bytes, 16), 0) << "the identity names device 1";
  int dev = -1;
  ASSERT_EQ(kvf_mem_device_from_uuid(id.device_uuid, &dev), KVF_SUCCESS);
  EXPECT_EQ(dev, 1);

  // Export it and import it through a table: the mapping sits on device 1.
  kvf_import_view v{};
  ASSERT_EQ(kvf_mem_alloc_export(a, &v.fd, &v.identity), KVF_SUCCESS) << kvf_last_error();
  EXPECT_TRUE(fd_cloexec(v.fd)) << "exported descriptors are close-on-exec";
  v.size = size;
  kvf_import_table *t = nullptr;
  int access[] = {0};
  kvf_import_table_options o = KVF_IMPORT_TABLE_OPTIONS_INIT;
  o.access_devices = access;
  o.num_access_devices = 1;
  ASSERT_EQ(kvf_import_table_create(&o, &t), KVF_SUCCESS);
  kvf_import_reg *reg = nullptr;
  ASSERT_EQ(kvf_import_table_register(t, 1, &v, 1, &reg), KVF_SUCCESS) << kvf_last_error();
  kvf_import_view_info info;
  ASSERT_EQ(kvf_import_reg_view(reg, 0, &info), KVF_SUCCESS);
  EXPECT_EQ(info.device, 1);
  static_cast<char *>((void *)(uintptr_t)p)[5] = 42;
  EXPECT_EQ(static_cast<char *>(info.ptr)[5], 42);
  ASSERT_EQ(kvf_import_table_unregister(t, reg), KVF_SUCCESS);
  kvf_import_table_destroy(t);

  kvf_mem_alloc_destroy(again);
  kvf_mem_alloc_destroy(a);
  // The owner's memory is untouched by destroying the found allocation.
  static_cast<char *>((void *)(uintptr_t)p)[0] = 1;
  ASSERT_EQ(cu->cuMemUnmap(p, size), CUDA_SUCCESS);
  ASSERT_EQ(cu->cuMemAddressFree(p, size), CUDA_SUCCESS);
  ASSERT_EQ(cu->cuMemRelease(h), CUDA_SUCCESS);
}

TEST_F(FakeCumemTest, MemoryWithoutThePosixFdHandleTypeIsRefused) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  const kvf_cuda_table *cu = kvf_cuda();
  size_t size = fakecu::kGranularity;
  CUmemGenericAllocationHandle h;
  CUdeviceptr p;
  ASSERT_EQ(cu->cuMemCreate(&h, size, &prop, 0), CUDA_SUCCESS);
  ASSERT_EQ(cu->cuMemAddressReserve(&p, size, 0, 0, 0), CUDA_SUCCESS);
  ASSERT_EQ(cu->cuMemMap(p, size, 0, h, 0), CUDA_SUCCESS);
  kvf_mem_alloc *a = nullptr;
  EXPECT_EQ(kvf_mem_alloc_find(KVF_MEM_PROVIDER_CUMEM, (void *)(uintptr_t)p, &a), KVF_ERR_UNSUPPORTED);
  EXPECT_NE(std::string(kvf_last_error()).find("without CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR"), std::string::npos)
      << kvf_last_error();
  ASSERT_EQ(cu->cuMemUnmap(p, size), CUDA_SUCCESS);
  ASSERT_EQ(cu->cuMemAddressFree(p, size), CUDA_SUCCESS);
  ASSERT_EQ(cu->cuMemRelease(h), CUDA_SUCCESS);
}

TEST_F(FakeCumemTest, AccessIsGrantedToTheNamedDevicesOnly) {
  kvf_mem_alloc_options o = KVF_MEM_ALLOC_OPTIONS_INIT;
  o.provider = KVF_MEM_PROVIDER_CUMEM;
  o.size = 1;
  o.device = 0;
  int bad[] = {1, 5};
  o.access_devices = bad;
  o.num_access_devices = 2;
  kvf_mem_alloc *a = nullptr;
  EXPECT_EQ(kvf_mem_alloc_create(&o, &a), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvf_last_error()).find("access_devices[1] 5"), std::string::npos) << kvf_last_error();
  o.device = 2;
  o.num_access_devices = 0;
  EXPECT_EQ(kvf_mem_alloc_create(&o, &a), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvf_last_error()).find("options.device 2"), std::string::npos) << kvf_last_error();
  fakecu::S().posix_fd_supported = 0;
  o.device = 0;
  EXPECT_EQ(kvf_mem_alloc_create(&o, &a), KVF_ERR_UNSUPPORTED);
  EXPECT_NE(std::string(kvf_last_error()).find("POSIX file descriptors"), std::string::npos) << kvf_last_error();
  fakecu::S().posix_fd_supported = 1;

  // The importer's table names device 1 as well; device 1 is visible.
  AllocPtr ok = make_alloc(KVF_MEM_PROVIDER_CUMEM, 1, 0);
  kvf_import_table *t = nullptr;
  int access[] = {1, 1, 0};
  kvf_import_table_options to = KVF_IMPORT_TABLE_OPTIONS_INIT;
  to.access_devices = access;
  to.num_access_devices = 3;
  ASSERT_EQ(kvf_import_table_create(&to, &t), KVF_SUCCESS);
  std::vector<kvf_import_view> v = whole_views({ok.get()});
  kvf_import_reg *reg = nullptr;
  ASSERT_EQ(kvf_import_table_register(t, 1, v.data(), 1, &reg), KVF_SUCCESS) << kvf_last_error();
  kvf_import_table_destroy(t);
  // A table naming a device that does not exist fails at import, cleanly.
  int missing[] = {3};
  to.access_devices = missing;
  to.num_access_devices = 1;
  ASSERT_EQ(kvf_import_table_create(&to, &t), KVF_SUCCESS);
  v = whole_views({ok.get()});
  EXPECT_EQ(kvf_import_table_register(t, 1, v.data(), 1, &reg), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(held(table_stats(t)), zero_held());
  kvf_import_table_destroy(t);
}

TEST_F(FakeCumemTest, IdentityOfAnInvisibleGpuIsNoDevice) {
  AllocPtr a = make_alloc(KVF_MEM_PROVIDER_CUMEM, 1, 1);
  std::vector<kvf_import_view> v = whole_views({a.get()});
  fakecu::S().devices = 1;  // the importer sees one GPU only
  kvf_import_table *t = nullptr;
  ASSERT_EQ(kvf_import_table_create(nullptr, &t), KVF_SUCCESS);
  kvf_import_reg *reg = nullptr;
  EXPECT_EQ(kvf_import_table_register(t, 1, v.data(), 1, &reg), KVF_ERR_NO_DEVICE);
  EXPECT_NE(std::string(kvf_last_error()).find("CUDA_VISIBLE_DEVICES"), std::string::npos) << kvf_last_error();
  EXPECT_FALSE(fd_is_open(v[0].fd));
  fakecu::S().devices = 2;
  kvf_import_table_destroy(t);
}
#endif

}  // namespace
