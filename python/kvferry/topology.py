"""GPUs, NUMA nodes and the cores each GPU's server threads are pinned to
(kvferry/topology.h).

:func:`topology` reads the machine with hwloc once and returns plain data;
it works without a driver or a GPU (zero GPUs, the reason in ``gpu_note``).
Creation may take tens of milliseconds (it reads sysfs). Safe from any thread.
"""

from __future__ import annotations

from ctypes import byref, c_void_p
from dataclasses import dataclass
from typing import Tuple

from . import _structs as S
from ._lib import lib

__all__ = ["NumaNode", "GpuPlacement", "Topology", "topology"]


@dataclass(frozen=True)
class NumaNode:
    """kvf_numa_node_info: one NUMA node."""

    os_index: int      #: the node number the OS uses (numactl, mbind)
    num_cores: int     #: cores whose cpus are local to this node
    memory_bytes: int  #: local memory; 0 when hwloc does not know
    cpus: str          #: cpu list ("0-31")


@dataclass(frozen=True)
class GpuPlacement:
    """kvf_gpu_placement: where one GPU's server threads and L1 memory go."""

    device: int           #: CUDA device ordinal (after CUDA_VISIBLE_DEVICES)
    pci_bus_id: str       #: "0000:3b:00.0"; "" when the driver gave none
    located: bool         #: found in hwloc's PCI tree (else the fallback applies)
    numa_node: int        #: OS index of the node for L1 memory
    numa_nodes: str       #: every node local to the GPU ("0" or "0-1")
    local_cpus: str       #: cpus local to the GPU
    worker_cpu: int       #: cpu of the GPU's worker thread
    completion_cpu: int   #: cpu of its completion thread
    note: str             #: why the fallback applies, or how cores are shared


@dataclass(frozen=True)
class Topology:
    """kvf_topology_info, every NUMA node and every GPU's placement."""

    num_numa_nodes: int
    num_cores: int
    num_pus: int
    num_gpus: int
    has_pci: bool   #: hwloc saw PCI devices (GPUs can be located)
    cpus: str       #: every usable cpu, as a list
    gpu_note: str   #: why num_gpus is 0, else ""
    numa_nodes: Tuple[NumaNode, ...]
    gpus: Tuple[GpuPlacement, ...]


def topology() -> Topology:
    """Read the machine and place every visible CUDA device
    (kvf_topology_create, then every accessor); the C topology is freed
    before returning. Raises KvferryError: SYSTEM (hwloc could not read the
    machine), CUDA, OUT_OF_MEMORY."""
    handle = c_void_p()
    lib.kvf_topology_create(byref(handle))
    try:
        info = S.kvf_topology_info.init()
        lib.kvf_topology_info_get(handle, byref(info))
        nodes = []
        for i in range(info.num_numa_nodes):
            n = S.kvf_numa_node_info.init()
            lib.kvf_topology_numa_node(handle, i, byref(n))
            nodes.append(NumaNode(n.os_index, n.num_cores, n.memory_bytes, S.text(n.cpus)))
        gpus = []
        for i in range(info.num_gpus):
            p = S.kvf_gpu_placement.init()
            lib.kvf_topology_gpu(handle, i, byref(p))
            gpus.append(GpuPlacement(p.device, S.text(p.pci_bus_id), bool(p.located), p.numa_node,
                                     S.text(p.numa_nodes), S.text(p.local_cpus), p.worker_cpu,
                                     p.completion_cpu, S.text(p.note)))
        return Topology(info.num_numa_nodes, info.num_cores, info.num_pus, info.num_gpus,
                        bool(info.has_pci), S.text(info.cpus), S.text(info.gpu_note),
                        tuple(nodes), tuple(gpus))
    finally:
        lib.kvf_topology_destroy(handle)
