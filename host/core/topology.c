/* GPU placement from hwloc (kvferry/topology.h, host/topology.h). */
#include "host/core/topology.h"

#include <hwloc.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <kvferry/device.h>

#include "common/error.h"
#include "common/versioned.h"
#include "host/core/cudawrap.h"

#define KVF_TOPO_MAX_GPUS 64u

typedef struct kvf_topology {
  kvf_topology_info info;
  kvf_numa_node_info *nodes; /* [info.num_numa_nodes] */
  kvf_gpu_placement *gpus;   /* [info.num_gpus] */
} kvf_topology;

/* A cpu or node list, cut with "..." if it does not fit. */
static void list_string(char *dst, size_t cap, hwloc_const_bitmap_t set) {
  int n = hwloc_bitmap_list_snprintf(dst, cap, set);
  if (n >= 0 && (size_t)n >= cap && cap > 4) memcpy(dst + cap - 4, "...", 4);
}

/* The GPUs' PCI ids from the driver, or zero GPUs and the reason. */
static kvf_status cuda_gpus(kvf_topo_pci_id *ids, uint32_t *num, char *note, size_t note_cap) {
  (void)ids; /* unused in a build without CUDA */
  *num = 0;
  kvf_cuda_info info = KVF_CUDA_INFO_INIT;
  kvf_status st = kvf_cuda_probe(&info);
  if (st == KVF_ERR_NO_DRIVER || st == KVF_ERR_NO_DEVICE) {
    /* The probe's message is a whole line; it is cut to the note's size. */
    const char *why = info.message[0] ? info.message : kvf_status_string(st);
    size_t used = (size_t)snprintf(note, note_cap, "no GPU visible: ");
    if (used < note_cap) {
      size_t n = strlen(why);
      if (n > note_cap - used - 1) n = note_cap - used - 1;
      memcpy(note + used, why, n);
      note[used + n] = '\0';
    }
    return KVF_SUCCESS;
  }
  if (st) return st;
#ifdef KVF_WITH_CUDA
  if ((st = kvf_cuda_ready())) return st;
  int count = 0;
  KVF_CU_CHECK(cuDeviceGetCount, &count);
  if (count <= 0) {
    snprintf(note, note_cap, "no GPU visible: the driver lists no device");
    return KVF_SUCCESS;
  }
  if ((uint32_t)count > KVF_TOPO_MAX_GPUS) count = (int)KVF_TOPO_MAX_GPUS;
  for (int i = 0; i < count; i++) {
    CUdevice dev;
    int dom = 0, bus = 0, slot = 0;
    KVF_CU_CHECK(cuDeviceGet, &dev, i);
    KVF_CU_CHECK(cuDeviceGetAttribute, &dom, CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID, dev);
    KVF_CU_CHECK(cuDeviceGetAttribute, &bus, CU_DEVICE_ATTRIBUTE_PCI_BUS_ID, dev);
    KVF_CU_CHECK(cuDeviceGetAttribute, &slot, CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID, dev);
    ids[i] = (kvf_topo_pci_id){i, (uint32_t)dom, (uint32_t)bus, (uint32_t)slot, 0};
  }
  *num = (uint32_t)count;
  return KVF_SUCCESS;
#else
  snprintf(note, note_cap, "no GPU visible: built without CUDA");
  return KVF_SUCCESS;
#endif
}

/* Cores whose cpus intersect `set`, in hwloc's order. Returns how many were
 * written (at most cap). */
static unsigned cores_in(hwloc_topology_t topo, hwloc_const_bitmap_t set, hwloc_obj_t *cores, unsigned cap) {
  unsigned n = 0;
  hwloc_obj_type_t type = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_CORE) > 0 ? HWLOC_OBJ_CORE : HWLOC_OBJ_PU;
  for (hwloc_obj_t c = hwloc_get_next_obj_by_type(topo, type, NULL); c && n < cap;
       c = hwloc_get_next_obj_by_type(topo, type, c))
    if (c->cpuset && hwloc_bitmap_intersects(c->cpuset, set)) cores[n++] = c;
  return n;
}

/* The first usable cpu of a core, as an OS index. */
static int core_cpu(hwloc_obj_t core, hwloc_const_bitmap_t allowed) {
  hwloc_bitmap_t b = hwloc_bitmap_dup(core->cpuset);
  int cpu = -1;
  if (b) {
    hwloc_bitmap_and(b, b, allowed);
    cpu = hwloc_bitmap_first(b);
    if (cpu < 0) cpu = hwloc_bitmap_first(core->cpuset);
    hwloc_bitmap_free(b);
  }
  return cpu;
}

static kvf_status place_gpu(hwloc_topology_t topo, const kvf_topo_pci_id *id, int has_pci, kvf_gpu_placement *p,
                            hwloc_bitmap_t local) {
  *p = (kvf_gpu_placement)KVF_GPU_PLACEMENT_INIT;
  p->device = id->device;
  snprintf(p->pci_bus_id, sizeof p->pci_bus_id, "%04x:%02x:%02x.%x", id->domain & 0xffffu, id->bus & 0xffu,
           id->dev & 0x1fu, id->func & 0x7u);
  hwloc_obj_t pci = has_pci ? hwloc_get_pcidev_by_busid(topo, id->domain, id->bus, id->dev, id->func) : NULL;
  hwloc_obj_t anc = pci ? hwloc_get_non_io_ancestor_obj(topo, pci) : NULL;
  hwloc_const_bitmap_t all = hwloc_topology_get_topology_cpuset(topo);
  if (anc && anc->cpuset && !hwloc_bitmap_iszero(anc->cpuset)) {
    p->located = 1;
    hwloc_bitmap_copy(local, anc->cpuset);
    hwloc_bitmap_and(local, local, all);
    if (hwloc_bitmap_iszero(local)) hwloc_bitmap_copy(local, all);
    int node = anc->nodeset ? hwloc_bitmap_first(anc->nodeset) : -1;
    if (node < 0) {
      p->numa_node = 0;
      snprintf(p->numa_nodes, sizeof p->numa_nodes, "0");
      snprintf(p->note, sizeof p->note, "hwloc gives no NUMA node for %s: using node 0", p->pci_bus_id);
    } else {
      p->numa_node = node;
      list_string(p->numa_nodes, sizeof p->numa_nodes, anc->nodeset);
    }
  } else {
    /* No locality: every cpu and node 0 still work, only less well. */
    hwloc_bitmap_copy(local, all);
    p->numa_node = 0;
    snprintf(p->numa_nodes, sizeof p->numa_nodes, "0");
    snprintf(p->note, sizeof p->note, "%s not found in hwloc's PCI tree (%s): using every cpu and NUMA node 0",
             p->pci_bus_id, has_pci ? "no such device" : "hwloc has no PCI information");
  }
  list_string(p->local_cpus, sizeof p->local_cpus, local);
  return KVF_SUCCESS;
}

kvf_status kvf_topology_create_with(const kvf_topology_options *options, kvf_topology **out) {
  if (!out) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_topology_create: out is NULL");
  kvf_status st = KVF_SUCCESS;
  hwloc_topology_t topo = NULL;
  hwloc_bitmap_t *locals = NULL;
  hwloc_obj_t *cores = NULL;
  kvf_topo_pci_id ids[KVF_TOPO_MAX_GPUS];
  uint32_t num_gpus = 0;
  kvf_topology *t = calloc(1, sizeof *t);
  if (!t) return kvf_fail(KVF_ERR_OUT_OF_MEMORY, "kvf_topology_create: out of memory");
  t->info = (kvf_topology_info)KVF_TOPOLOGY_INFO_INIT;

  /* The GPUs first: without them nothing below needs PCI devices. */
  if (options && options->use_gpus) {
    num_gpus = options->num_gpus > KVF_TOPO_MAX_GPUS ? KVF_TOPO_MAX_GPUS : options->num_gpus;
    if (num_gpus) memcpy(ids, options->gpus, num_gpus * sizeof ids[0]);
    else
      snprintf(t->info.gpu_note, sizeof t->info.gpu_note, "%s",
               options->no_gpu_note ? options->no_gpu_note : "no GPU visible");
  } else if ((st = cuda_gpus(ids, &num_gpus, t->info.gpu_note, sizeof t->info.gpu_note))) {
    kvf_error_prefix("kvf_topology_create: listing GPUs: ");
    goto out;
  }

  if (hwloc_topology_init(&topo) != 0) {
    topo = NULL;
    st = kvf_fail(KVF_ERR_SYSTEM, "kvf_topology_create: hwloc_topology_init failed");
    goto out;
  }
  if (options && options->synthetic && hwloc_topology_set_synthetic(topo, options->synthetic) != 0) {
    st = kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_topology_create: hwloc rejects synthetic topology '%s'",
                  options->synthetic);
    goto out;
  }
  /* PCI devices only when there is a GPU to find: scanning them costs time. */
  if (num_gpus) hwloc_topology_set_io_types_filter(topo, HWLOC_TYPE_FILTER_KEEP_IMPORTANT);
  if (hwloc_topology_load(topo) != 0) {
    st = kvf_fail(KVF_ERR_SYSTEM, "kvf_topology_create: hwloc_topology_load failed");
    goto out;
  }

  hwloc_const_bitmap_t all = hwloc_topology_get_topology_cpuset(topo);
  int ncores = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_CORE);
  int npus = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_PU);
  int nnodes = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_NUMANODE);
  t->info.num_pus = npus > 0 ? (uint32_t)npus : 1;
  t->info.num_cores = ncores > 0 ? (uint32_t)ncores : t->info.num_pus;
  t->info.has_pci = hwloc_get_next_pcidev(topo, NULL) != NULL;
  list_string(t->info.cpus, sizeof t->info.cpus, all);

  /* NUMA nodes; a machine hwloc shows none on still has one. */
  t->info.num_numa_nodes = nnodes > 0 ? (uint32_t)nnodes : 1;
  t->nodes = calloc(t->info.num_numa_nodes, sizeof *t->nodes);
  cores = calloc(t->info.num_cores + t->info.num_pus, sizeof *cores);
  if (!t->nodes || !cores) {
    st = kvf_fail(KVF_ERR_OUT_OF_MEMORY, "kvf_topology_create: out of memory");
    goto out;
  }
  for (uint32_t i = 0; i < t->info.num_numa_nodes; i++) {
    kvf_numa_node_info *n = &t->nodes[i];
    *n = (kvf_numa_node_info)KVF_NUMA_NODE_INFO_INIT;
    hwloc_obj_t obj = nnodes > 0 ? hwloc_get_obj_by_type(topo, HWLOC_OBJ_NUMANODE, i) : NULL;
    hwloc_const_bitmap_t set = obj && obj->cpuset ? obj->cpuset : all;
    n->os_index = obj ? obj->os_index : 0;
    n->memory_bytes = obj ? obj->attr->numanode.local_memory : 0;
    n->num_cores = cores_in(topo, set, cores, t->info.num_cores + t->info.num_pus);
    list_string(n->cpus, sizeof n->cpus, set);
  }

  if (num_gpus) {
    t->gpus = calloc(num_gpus, sizeof *t->gpus);
    locals = calloc(num_gpus, sizeof *locals);
    if (!t->gpus || !locals) {
      st = kvf_fail(KVF_ERR_OUT_OF_MEMORY, "kvf_topology_create: out of memory");
      goto out;
    }
  }
  for (uint32_t g = 0; g < num_gpus; g++) {
    locals[g] = hwloc_bitmap_alloc();
    if (!locals[g]) {
      st = kvf_fail(KVF_ERR_OUT_OF_MEMORY, "kvf_topology_create: out of memory");
      goto out;
    }
    place_gpu(topo, &ids[g], t->info.has_pci, &t->gpus[g], locals[g]);
    /* GPUs with the same locality take turns on its cores: the k-th such
     * GPU gets cores 2k and 2k+1 (wrapping when there are too few). */
    unsigned rank = 0;
    for (uint32_t o = 0; o < g; o++) rank += hwloc_bitmap_isequal(locals[o], locals[g]) ? 1u : 0u;
    unsigned nc = cores_in(topo, locals[g], cores, t->info.num_cores + t->info.num_pus);
    if (nc == 0) {
      st = kvf_fail(KVF_ERR_INTERNAL, "kvf_topology_create: GPU %d's cpus %s hold no core", ids[g].device,
                    t->gpus[g].local_cpus);
      goto out;
    }
    t->gpus[g].worker_cpu = core_cpu(cores[(2u * rank) % nc], locals[g]);
    t->gpus[g].completion_cpu = core_cpu(cores[(2u * rank + 1u) % nc], locals[g]);
    if (2u * rank + 2u > nc) {
      size_t used = strlen(t->gpus[g].note);
      snprintf(t->gpus[g].note + used, sizeof t->gpus[g].note - used, "%s%u local core%s for %u GPU%s: cores are shared",
               used ? "; " : "", nc, nc == 1 ? "" : "s", rank + 1, rank ? "s" : "");
    }
  }
  t->info.num_gpus = num_gpus;
  *out = t;
  t = NULL;
out:
  if (locals)
    for (uint32_t g = 0; g < num_gpus; g++) hwloc_bitmap_free(locals[g]);
  free(locals);
  free(cores);
  if (topo) hwloc_topology_destroy(topo);
  kvf_topology_destroy(t);
  return st;
}

kvf_status kvf_topology_create(kvf_topology **out) { return kvf_topology_create_with(NULL, out); }

void kvf_topology_destroy(kvf_topology *topology) {
  if (!topology) return;
  free(topology->nodes);
  free(topology->gpus);
  free(topology);
}

kvf_status kvf_topology_info_get(const kvf_topology *topology, kvf_topology_info *out) {
  if (!topology || !out) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_topology_info_get: NULL argument");
  return KVF_VERSIONED_OUT(kvf_topology_info, out, &topology->info);
}

kvf_status kvf_topology_numa_node(const kvf_topology *topology, uint32_t index, kvf_numa_node_info *out) {
  if (!topology || !out) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_topology_numa_node: NULL argument");
  kvf_status st = KVF_VERSIONED_CHECK(kvf_numa_node_info, out);
  if (st) return st;
  if (index >= topology->info.num_numa_nodes)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_topology_numa_node: index %u, the machine has %u NUMA nodes",
                    index, topology->info.num_numa_nodes);
  return KVF_VERSIONED_OUT(kvf_numa_node_info, out, &topology->nodes[index]);
}

kvf_status kvf_topology_gpu(const kvf_topology *topology, uint32_t index, kvf_gpu_placement *out) {
  if (!topology || !out) return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_topology_gpu: NULL argument");
  kvf_status st = KVF_VERSIONED_CHECK(kvf_gpu_placement, out);
  if (st) return st;
  if (index >= topology->info.num_gpus)
    return kvf_fail(KVF_ERR_INVALID_ARGUMENT, "kvf_topology_gpu: index %u, %u GPUs are placed", index,
                    topology->info.num_gpus);
  return KVF_VERSIONED_OUT(kvf_gpu_placement, out, &topology->gpus[index]);
}
