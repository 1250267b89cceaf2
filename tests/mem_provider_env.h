// The provider a memory test runs on: the host provider, or the cumem
// provider over the fake driver (tests/fake_cumem.h). Both tables (system
// calls and driver) are wrapped by the fault injector for the whole test,
// counting only until a test arms a fault.
#pragma once

#include "fake_cumem.h"
#include "mem_test_util.h"

namespace kvf_mem_test {

enum class Prov { Host, FakeCumem };

inline const char *prov_name(Prov p) { return p == Prov::Host ? "Host" : "FakeCumem"; }

class ProviderEnv {
 public:
  explicit ProviderEnv(Prov p) : prov_(p) {}
  ProviderEnv(const ProviderEnv &) = delete;
  ProviderEnv &operator=(const ProviderEnv &) = delete;

  void install() {
    sys_previous_ = kvf_sys_table_install(&sys_);
#if KVF_WITH_CUDA
    if (prov_ == Prov::FakeCumem) {
      fake_ = fakecu::table();
      wrapped_ = cu_fault_table(&fake_);
      cu_previous_ = kvf_cuda_table_install(&wrapped_);
      live_ = fakecu::live();
    }
#endif
  }
  void uninstall() {
    disarm();
#if KVF_WITH_CUDA
    if (prov_ == Prov::FakeCumem) {
      kvf_cuda_table_install(cu_previous_);
      fakecu::Live l = fakecu::live();
      EXPECT_EQ(l.allocs, live_.allocs) << "fake driver allocations leaked";
      EXPECT_EQ(l.handles, live_.handles) << "fake driver handles leaked";
      EXPECT_EQ(l.reservations, live_.reservations) << "fake driver address ranges leaked";
      EXPECT_EQ(l.maps, live_.maps) << "fake driver mappings leaked";
    }
#endif
    kvf_sys_table_install(sys_previous_);
  }

  Prov prov() const { return prov_; }
  kvf_mem_provider provider() const {
    return prov_ == Prov::Host ? KVF_MEM_PROVIDER_HOST : KVF_MEM_PROVIDER_CUMEM;
  }
  // Call names of the import steps, for named faults.
  const char *reserve_call() const { return prov_ == Prov::Host ? "mmap" : "cuMemAddressReserve"; }
  const char *access_call() const { return prov_ == Prov::Host ? "mprotect" : "cuMemSetAccess"; }
  // In an unregister, the first call of this name is the unmap step.
  const char *unmap_call() const { return prov_ == Prov::Host ? "mmap" : "cuMemUnmap"; }
  // In a register rollback after set_access failed: occurrence of unmap_call().
  long unmap_nth_in_register() const { return prov_ == Prov::Host ? 3 : 1; }
  const char *address_free_call() const { return prov_ == Prov::Host ? "munmap" : "cuMemAddressFree"; }

  // Driver-side leak counts (all zero for the host provider).
  std::vector<int> driver_live() const {
#if KVF_WITH_CUDA
    if (prov_ == Prov::FakeCumem) {
      fakecu::Live l = fakecu::live();
      return {l.allocs, l.handles, l.reservations, l.maps};
    }
#endif
    return {0, 0, 0, 0};
  }

 private:
  Prov prov_;
  kvf_sys_table sys_ = sys_fault_table();
  const kvf_sys_table *sys_previous_ = nullptr;
#if KVF_WITH_CUDA
  kvf_cuda_table fake_{}, wrapped_{};
  const kvf_cuda_table *cu_previous_ = nullptr;
  fakecu::Live live_{};
#endif
};

inline std::vector<Prov> all_providers() {
#if KVF_WITH_CUDA
  return {Prov::Host, Prov::FakeCumem};
#else
  return {Prov::Host};
#endif
}

// ---- small owners and helpers over the public API --------------------------

struct AllocDeleter {
  void operator()(kvf_mem_alloc *a) const { kvf_mem_alloc_destroy(a); }
};
using AllocPtr = std::unique_ptr<kvf_mem_alloc, AllocDeleter>;

struct TableDeleter {
  void operator()(kvf_import_table *t) const { kvf_import_table_destroy(t); }
};
using TablePtr = std::unique_ptr<kvf_import_table, TableDeleter>;

inline AllocPtr make_alloc(kvf_mem_provider provider, uint64_t size, int device = 0) {
  kvf_mem_alloc_options o = KVF_MEM_ALLOC_OPTIONS_INIT;
  o.provider = provider;
  o.size = size;
  o.device = device;
  kvf_mem_alloc *a = nullptr;
  kvf_status st = kvf_mem_alloc_create(&o, &a);
  EXPECT_EQ(st, KVF_SUCCESS) << kvf_last_error();
  return AllocPtr(st == KVF_SUCCESS ? a : nullptr);
}

inline kvf_import_stats table_stats(kvf_import_table *t) {
  kvf_import_stats s = KVF_IMPORT_STATS_INIT;
  EXPECT_EQ(kvf_import_table_stats(t, &s), KVF_SUCCESS) << kvf_last_error();
  return s;
}
inline kvf_import_stats client_stats(kvf_import_table *t, uint64_t client) {
  kvf_import_stats s = KVF_IMPORT_STATS_INIT;
  EXPECT_EQ(kvf_import_table_client_stats(t, client, &s), KVF_SUCCESS) << kvf_last_error();
  return s;
}
// The counters that must come back to where they were after a failure.
inline std::vector<uint64_t> held(const kvf_import_stats &s) {
  return {s.registrations, s.imports, s.aliases, s.bytes_mapped, s.handles, s.reservations, s.pending_closes};
}

inline std::vector<uint64_t> zero_held() { return std::vector<uint64_t>(7, 0); }

// Views of `layers` layers spread over allocs as LayerSpec lays them out;
// the first view of each allocation carries a fresh exported descriptor.
inline std::vector<kvf_import_view> layer_views(const std::vector<kvf_mem_alloc *> &allocs, const LayerSpec &s) {
  std::vector<kvf_import_view> v;
  std::vector<bool> sent(allocs.size(), false);
  for (uint32_t l = 0; l < s.layers(); l++) {
    uint32_t r = s.region_of(l);
    kvf_import_view view{};
    EXPECT_EQ(kvf_mem_alloc_identity(allocs[r], &view.identity), KVF_SUCCESS);
    view.fd = -1;
    if (!sent[r]) {
      EXPECT_EQ(kvf_mem_alloc_export(allocs[r], &view.fd, nullptr), KVF_SUCCESS) << kvf_last_error();
      sent[r] = true;
    }
    view.offset = s.offset_of(l);
    view.size = s.layer_bytes();
    v.push_back(view);
  }
  return v;
}

// One view over the whole of each allocation, each with a fresh descriptor.
inline std::vector<kvf_import_view> whole_views(const std::vector<kvf_mem_alloc *> &allocs) {
  std::vector<kvf_import_view> v;
  for (kvf_mem_alloc *a : allocs) {
    kvf_import_view view{};
    EXPECT_EQ(kvf_mem_alloc_export(a, &view.fd, &view.identity), KVF_SUCCESS) << kvf_last_error();
    view.offset = 0;
    view.size = kvf_mem_alloc_size(a);
    v.push_back(view);
  }
  return v;
}

// Data moves both ways between the exporter's pointers and every view of
// reg (the exporter's memory is in this process: host, or the fake driver's).
inline ::testing::AssertionResult moves_data(const kvf_import_reg *reg, const std::vector<kvf_mem_alloc *> &allocs,
                                             uint64_t seed) {
  for (uint32_t i = 0; i < kvf_import_reg_num_views(reg); i++) {
    kvf_import_view_info info;
    if (kvf_import_reg_view(reg, i, &info) != KVF_SUCCESS)
      return ::testing::AssertionFailure() << "view " << i << ": " << kvf_last_error();
    kvf_mem_alloc *owner = nullptr;
    for (kvf_mem_alloc *a : allocs) {
      kvf_mem_identity id;
      kvf_mem_alloc_identity(a, &id);
      if (id.allocation_id == info.identity.allocation_id && id.instance_id == info.identity.instance_id) owner = a;
    }
    if (owner == nullptr) return ::testing::AssertionFailure() << "view " << i << ": no exporter allocation";
    uint8_t *exp = static_cast<uint8_t *>(kvf_mem_alloc_ptr(owner)) + info.offset;
    uint8_t *imp = static_cast<uint8_t *>(info.ptr);
    uint64_t n = std::min<uint64_t>(info.size, 4096);
    fill_pattern(exp, n, seed + i, 1);
    if (check_pattern(imp, n, seed + i, 1) != n)
      return ::testing::AssertionFailure() << "view " << i << ": exporter's write not seen through the import";
    fill_pattern(imp + info.size - n, n, seed + i, 2);
    if (check_pattern(exp + info.size - n, n, seed + i, 2) != n)
      return ::testing::AssertionFailure() << "view " << i << ": importer's write not seen by the exporter";
  }
  return ::testing::AssertionSuccess();
}

}  // namespace kvf_mem_test
