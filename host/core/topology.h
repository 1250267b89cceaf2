/*
 * Internal: how kvf_topology_create() is put together, so tests can run the
 * placement on a machine description and a list of GPUs of their choosing
 * (an hwloc synthetic topology has no PCI devices: every GPU takes the
 * fallback) without a GPU or a driver.
 */
#ifndef KVF_HOST_TOPOLOGY_H
#define KVF_HOST_TOPOLOGY_H

#include <kvferry/topology.h>

#ifdef __cplusplus
extern "C" {
#endif

/* A GPU's PCI address as the driver reports it. */
typedef struct kvf_topo_pci_id {
  int device; /* CUDA ordinal */
  uint32_t domain, bus, dev, func;
} kvf_topo_pci_id;

typedef struct kvf_topology_options {
  const char *synthetic;        /* hwloc synthetic description ("pack:2 numa:1 core:4 pu:2"); NULL: this machine */
  const kvf_topo_pci_id *gpus;  /* used instead of asking the driver when use_gpus is set */
  uint32_t num_gpus;
  int use_gpus;
  const char *no_gpu_note;      /* with use_gpus and num_gpus 0: the reason to report */
} kvf_topology_options;

/* kvf_topology_create() with the machine and the GPU list overridden. */
kvf_status kvf_topology_create_with(const kvf_topology_options *options, kvf_topology **out);

#ifdef __cplusplus
}
#endif

#endif /* KVF_HOST_TOPOLOGY_H */
