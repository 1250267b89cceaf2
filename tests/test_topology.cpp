// GPU placement (kvferry/topology.h): this machine without a GPU, and
// synthetic machines with invented GPUs that hwloc cannot locate.
#include <gtest/gtest.h>

#include <string>

#include <kvferry/topology.h>

#include "host/core/topology.h"

TEST(Topology, ThisMachineWithoutGpuIsSane) {
  kvf_topology *t = nullptr;
  ASSERT_EQ(kvf_topology_create(&t), KVF_SUCCESS) << kvf_last_error();
  kvf_topology_info info = KVF_TOPOLOGY_INFO_INIT;
  ASSERT_EQ(kvf_topology_info_get(t, &info), KVF_SUCCESS);
  EXPECT_GE(info.num_numa_nodes, 1u);
  EXPECT_GE(info.num_cores, 1u);
  EXPECT_GE(info.num_pus, info.num_cores);
  EXPECT_STRNE(info.cpus, "");
  if (info.num_gpus == 0) {
    EXPECT_NE(std::string(info.gpu_note).find("no GPU visible"), std::string::npos) << info.gpu_note;
  } else {
    kvf_gpu_placement p = KVF_GPU_PLACEMENT_INIT;
    ASSERT_EQ(kvf_topology_gpu(t, 0, &p), KVF_SUCCESS);
    EXPECT_GE(p.worker_cpu, 0);
  }
  uint32_t cores = 0;
  for (uint32_t i = 0; i < info.num_numa_nodes; i++) {
    kvf_numa_node_info n = KVF_NUMA_NODE_INFO_INIT;
    ASSERT_EQ(kvf_topology_numa_node(t, i, &n), KVF_SUCCESS);
    EXPECT_STRNE(n.cpus, "");
    cores += n.num_cores;
  }
  EXPECT_GE(cores, info.num_cores);
  kvf_numa_node_info n = KVF_NUMA_NODE_INFO_INIT;
  EXPECT_EQ(kvf_topology_numa_node(t, info.num_numa_nodes, &n), KVF_ERR_INVALID_ARGUMENT);
  kvf_gpu_placement p = KVF_GPU_PLACEMENT_INIT;
  EXPECT_EQ(kvf_topology_gpu(t, info.num_gpus, &p), KVF_ERR_INVALID_ARGUMENT);
  kvf_topology_destroy(t);
  kvf_topology_destroy(nullptr);
}

TEST(Topology, NoDriverGivesZeroGpusAndTheReason) {
  setenv("KVF_CUDA_DISABLE", "1", 1);  // read once per process; harmless if loading already ran
  kvf_topology_options o = {};
  o.use_gpus = 1;
  o.no_gpu_note = "no GPU visible: test";
  kvf_topology *t = nullptr;
  ASSERT_EQ(kvf_topology_create_with(&o, &t), KVF_SUCCESS) << kvf_last_error();
  kvf_topology_info info = KVF_TOPOLOGY_INFO_INIT;
  ASSERT_EQ(kvf_topology_info_get(t, &info), KVF_SUCCESS);
  EXPECT_EQ(info.num_gpus, 0u);
  EXPECT_STREQ(info.gpu_note, "no GPU visible: test");
  kvf_topology_destroy(t);
}

TEST(Topology, GpusHwlocCannotLocateFallBackToEveryCpuAndNodeZero) {
  // Two packages with one NUMA node each, 4 cores of 2 threads: 16 cpus.
  kvf_topo_pci_id gpus[3] = {{0, 0, 0x3b, 0, 0}, {1, 0, 0x5e, 0, 0}, {2, 0, 0xd8, 0, 0}};
  kvf_topology_options o = {};
  o.synthetic = "pack:2 numa:1 core:4 pu:2";
  o.gpus = gpus;
  o.num_gpus = 3;
  o.use_gpus = 1;
  kvf_topology *t = nullptr;
  ASSERT_EQ(kvf_topology_create_with(&o, &t), KVF_SUCCESS) << kvf_last_error();
  kvf_topology_info info = KVF_TOPOLOGY_INFO_INIT;
  ASSERT_EQ(kvf_topology_info_get(t, &info), KVF_SUCCESS);
  EXPECT_EQ(info.num_numa_nodes, 2u);
  EXPECT_EQ(info.num_cores, 8u);
  EXPECT_EQ(info.num_pus, 16u);
  EXPECT_EQ(info.num_gpus, 3u);
  EXPECT_EQ(info.has_pci, 0);
  EXPECT_STREQ(info.cpus, "0-15");
  kvf_numa_node_info n = KVF_NUMA_NODE_INFO_INIT;
  ASSERT_EQ(kvf_topology_numa_node(t, 1, &n), KVF_SUCCESS);
  EXPECT_EQ(n.os_index, 1u);
  EXPECT_EQ(n.num_cores, 4u);
  EXPECT_STREQ(n.cpus, "8-15");
  int used[16] = {0};
  for (uint32_t g = 0; g < 3; g++) {
    kvf_gpu_placement p = KVF_GPU_PLACEMENT_INIT;
    ASSERT_EQ(kvf_topology_gpu(t, g, &p), KVF_SUCCESS);
    EXPECT_EQ(p.device, (int)g);
    EXPECT_EQ(p.located, 0);
    EXPECT_EQ(p.numa_node, 0);
    EXPECT_STREQ(p.local_cpus, "0-15");
    EXPECT_NE(std::string(p.note).find("hwloc has no PCI information"), std::string::npos) << p.note;
    ASSERT_GE(p.worker_cpu, 0);
    ASSERT_LT(p.worker_cpu, 16);
    ASSERT_GE(p.completion_cpu, 0);
    ASSERT_LT(p.completion_cpu, 16);
    EXPECT_NE(p.worker_cpu, p.completion_cpu);
    used[p.worker_cpu]++;
    used[p.completion_cpu]++;
  }
  // 8 cores for 3 GPUs: no two threads share a cpu, and each takes the
  // first thread of its core (even cpus in this synthetic numbering).
  for (int c = 0; c < 16; c++) {
    EXPECT_LE(used[c], 1) << "cpu " << c;
    if (c % 2) {
      EXPECT_EQ(used[c], 0) << "cpu " << c;
    }
  }
  kvf_gpu_placement p = KVF_GPU_PLACEMENT_INIT;
  ASSERT_EQ(kvf_topology_gpu(t, 0, &p), KVF_SUCCESS);
  EXPECT_STREQ(p.pci_bus_id, "0000:3b:00.0");
  kvf_topology_destroy(t);
}

TEST(Topology, MoreGpusThanCoresShareCoresWithANote) {
  kvf_topo_pci_id gpus[2] = {{0, 0, 1, 0, 0}, {1, 0, 2, 0, 0}};
  kvf_topology_options o = {};
  o.synthetic = "numa:1 core:2 pu:1";
  o.gpus = gpus;
  o.num_gpus = 2;
  o.use_gpus = 1;
  kvf_topology *t = nullptr;
  ASSERT_EQ(kvf_topology_create_with(&o, &t), KVF_SUCCESS) << kvf_last_error();
  kvf_gpu_placement p = KVF_GPU_PLACEMENT_INIT;
  ASSERT_EQ(kvf_topology_gpu(t, 1, &p), KVF_SUCCESS);
  EXPECT_NE(std::string(p.note).find("cores are shared"), std::string::npos) << p.note;
  EXPECT_GE(p.worker_cpu, 0);
  kvf_topology_destroy(t);
}

TEST(Topology, RejectsBadArguments) {
  EXPECT_EQ(kvf_topology_create(nullptr), KVF_ERR_INVALID_ARGUMENT);
  kvf_topology_options o = {};
  o.synthetic = "this is not a topology";
  o.use_gpus = 1;
  kvf_topology *t = nullptr;
  EXPECT_EQ(kvf_topology_create_with(&o, &t), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(t, nullptr);
  o.synthetic = "numa:1 core:1 pu:1";
  ASSERT_EQ(kvf_topology_create_with(&o, &t), KVF_SUCCESS);
  kvf_topology_info info = KVF_TOPOLOGY_INFO_INIT;
  info.version = 0;
  EXPECT_EQ(kvf_topology_info_get(t, &info), KVF_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(kvf_topology_info_get(t, nullptr), KVF_ERR_INVALID_ARGUMENT);
  kvf_topology_destroy(t);
}
