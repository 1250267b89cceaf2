/*
 * kvferry/topology.h - where each GPU sits in the machine, and where the
 * cache server places its threads and memory for it.
 *
 * kvf_topology_create() reads the machine with hwloc (NUMA nodes, cores,
 * PCI devices) and finds every visible CUDA device's PCI device in it. For
 * each GPU it derives a placement: the NUMA node(s) and cores local to the
 * GPU, one core for the server's worker thread and one for its completion
 * thread (spread so GPUs that share a locality do not share cores), and the
 * NUMA node for that GPU's L1 (pinned host) memory.
 *
 * It degrades instead of failing: without a driver or a GPU the topology has
 * zero GPUs and says why (kvf_topology_info.gpu_note); when hwloc has no PCI
 * information for a GPU (a container without /sys/bus/pci, say) that GPU's
 * placement falls back to every core and NUMA node 0, with a note.
 *
 * Threading: creation may take tens of milliseconds (it reads sysfs); a
 * created topology is immutable and may be read from any number of threads.
 * Nothing here creates a CUDA context or touches a stream.
 */
#ifndef KVFERRY_TOPOLOGY_H
#define KVFERRY_TOPOLOGY_H

#include <kvferry/status.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KVF_TOPO_VERSION 1u
#define KVF_TOPO_CPULIST_MAX 256u /* cpu lists ("0-23,48-71") are cut to fit, ending in "..." */
#define KVF_TOPO_NOTE_MAX 256u

typedef struct kvf_topology kvf_topology;

/* The machine as a whole. Fill from KVF_TOPOLOGY_INFO_INIT. */
typedef struct kvf_topology_info {
  uint32_t struct_size;
  uint32_t version;
  uint32_t num_numa_nodes; /* at least 1 */
  uint32_t num_cores;      /* at least 1 */
  uint32_t num_pus;        /* hardware threads; at least num_cores */
  uint32_t num_gpus;       /* visible CUDA devices placed; 0 without a driver or GPU */
  int has_pci;             /* 1 when hwloc saw PCI devices (GPUs can be located) */
  char cpus[KVF_TOPO_CPULIST_MAX];    /* every usable cpu, as a list ("0-31") */
  char gpu_note[KVF_TOPO_NOTE_MAX];   /* why num_gpus is 0 ("no CUDA driver: ..."), else "" */
} kvf_topology_info;
#define KVF_TOPOLOGY_INFO_INIT {sizeof(kvf_topology_info), KVF_TOPO_VERSION, 0, 0, 0, 0, 0, {0}, {0}}

/* One NUMA node. Fill from KVF_NUMA_NODE_INFO_INIT. */
typedef struct kvf_numa_node_info {
  uint32_t struct_size;
  uint32_t version;
  uint32_t os_index;     /* the node number the OS uses (numactl, mbind) */
  uint32_t num_cores;    /* cores whose cpus are local to this node */
  uint64_t memory_bytes; /* local memory; 0 when hwloc does not know */
  char cpus[KVF_TOPO_CPULIST_MAX];
} kvf_numa_node_info;
#define KVF_NUMA_NODE_INFO_INIT {sizeof(kvf_numa_node_info), KVF_TOPO_VERSION, 0, 0, 0, {0}}

/* Where one GPU's server threads and L1 memory go. Fill from
 * KVF_GPU_PLACEMENT_INIT. */
typedef struct kvf_gpu_placement {
  uint32_t struct_size;
  uint32_t version;
  int device;           /* CUDA device ordinal (after CUDA_VISIBLE_DEVICES) */
  char pci_bus_id[32];  /* "0000:3b:00.0"; "" when the driver gave none */
  int located;          /* 1: found in hwloc's PCI tree; 0: the fallback below applies */
  int numa_node;        /* OS index of the node for L1 memory (fallback: 0) */
  char numa_nodes[64];  /* every node local to the GPU, as a list ("0" or "0-1") */
  char local_cpus[KVF_TOPO_CPULIST_MAX]; /* cpus local to the GPU (fallback: every cpu) */
  int worker_cpu;       /* OS index of the cpu for the GPU's worker thread */
  int completion_cpu;   /* OS index of the cpu for its completion thread */
  char note[KVF_TOPO_NOTE_MAX]; /* why the fallback applies, or how cores are shared; "" if nothing to say */
} kvf_gpu_placement;
#define KVF_GPU_PLACEMENT_INIT \
  {sizeof(kvf_gpu_placement), KVF_TOPO_VERSION, 0, {0}, 0, 0, {0}, {0}, 0, 0, {0}}

/*
 * Read the machine and place every visible CUDA device.
 *
 * out: receives the topology; release it with kvf_topology_destroy().
 * Returns KVF_SUCCESS also when there is no driver or no GPU (zero GPUs, the
 * reason in kvf_topology_info.gpu_note) and when hwloc lacks PCI information
 * (fallback placements, with notes); KVF_ERR_INVALID_ARGUMENT (out is NULL),
 * KVF_ERR_OUT_OF_MEMORY, KVF_ERR_SYSTEM (hwloc could not read the machine),
 * KVF_ERR_CUDA (the driver failed while listing the devices' PCI ids).
 */
KVF_API kvf_status kvf_topology_create(kvf_topology **out);

/* Release a topology. NULL is a no-op. */
KVF_API void kvf_topology_destroy(kvf_topology *topology);

/* The machine summary. KVF_ERR_INVALID_ARGUMENT when a pointer is NULL or
 * out breaks the versioned-struct rule (kvferry/kvferry.h). *out is untouched
 * on failure, here and below. */
KVF_API kvf_status kvf_topology_info_get(const kvf_topology *topology, kvf_topology_info *out);

/* NUMA node `index` (0 .. num_numa_nodes-1, in hwloc's order).
 * KVF_ERR_INVALID_ARGUMENT for NULL pointers, an out that breaks the
 * versioned-struct rule or an index out of range. */
KVF_API kvf_status kvf_topology_numa_node(const kvf_topology *topology, uint32_t index, kvf_numa_node_info *out);

/* The placement of GPU `index` (0 .. num_gpus-1; the index is the CUDA
 * ordinal). KVF_ERR_INVALID_ARGUMENT for NULL pointers, an out that breaks the
 * versioned-struct rule or an index out of range. */
KVF_API kvf_status kvf_topology_gpu(const kvf_topology *topology, uint32_t index, kvf_gpu_placement *out);

#ifdef __cplusplus
}
#endif

#endif /* KVFERRY_TOPOLOGY_H */
