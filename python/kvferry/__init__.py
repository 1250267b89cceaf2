"""kvferry from Python: move paged KV-cache blocks between an engine's KV
cache and cache objects.

The package is pure Python over libkvferry.so (ctypes): importing it loads
the library (see :mod:`kvferry._lib` for where it is looked for) and nothing
else; numpy and torch are never imported by the package, only used through
the objects a caller passes (DLPack, ``__cuda_array_interface__``,
``__array_interface__``). docs/python.md has examples of every use.

Every failing call raises :class:`KvferryError`, with ``.status`` (a
:class:`Status`), ``.field`` and ``.message``.

Modules: :mod:`kvferry.geometry` (geometries, presets), :mod:`kvferry.tensors`
(geometries from tensors), :mod:`kvferry.copy` (copy requests, the CPU
reference), :mod:`kvferry.transfer` (transfer contexts),
:mod:`kvferry.device` (the CUDA probe), :mod:`kvferry.memory` (exportable
allocations), :mod:`kvferry.topology`, :mod:`kvferry.client` (the kvferryd
client; imported on its own: ``from kvferry.client import Client``).
"""

from __future__ import annotations

from typing import Tuple, Union

from . import _lib
from ._buffers import RawBuffer
from ._errors import KvferryError, Status
from ._structs import HEADER_VERSION
from .copy import BlockTable, CopyRequest, reference_gather, reference_scatter
from .device import CudaInfo, cuda_probe
from .geometry import (BLOCK_SKIP, Geometry, Group, GroupKind, ObjectFormat, ObjectGroup,
                       ObjectHeader, Policy, Region, State, View, preset_dirs, presets)
from .memory import (Allocation, MemIdentity, MemProvider, device_from_uuid, mem_granularity,
                     mem_instance, set_mem_instance)
from .tensors import (VLLM_CROSS_LAYER, VLLM_FLASH_ATTN, VLLM_FLASHINFER, VLLM_MLA, TensorGroup,
                      from_tensors)
from .topology import GpuPlacement, NumaNode, Topology, topology
from .transfer import DEVICE_HOST, Route, Transfer, TransferStats

__version__ = "0.1.0"

Geometry.from_tensors = staticmethod(from_tensors)  # type: ignore[attr-defined]


def version() -> str:
    """The library's version, "MAJOR.MINOR.PATCH" (kvf_version_string)."""
    return _lib.lib.kvf_version_string().decode()


def version_info() -> Tuple[int, int, int]:
    """The library's version as (major, minor, patch) (kvf_version)."""
    n = _lib.lib.kvf_version()
    return n // 10000, n // 100 % 100, n % 100


def library_path() -> str:
    """The path (or soname) libkvferry was loaded from."""
    return _lib.library_path


def status_string(status: Union[Status, int]) -> str:
    """The library's short name for a status (kvf_status_string)."""
    return _lib.lib.kvf_status_string(int(status)).decode()


__all__ = [
    "__version__", "version", "version_info", "library_path", "status_string", "HEADER_VERSION",
    "KvferryError", "Status", "RawBuffer",
    "Geometry", "GroupKind", "ObjectFormat", "View", "State", "Region", "Group", "ObjectGroup",
    "Policy", "ObjectHeader", "BLOCK_SKIP", "preset_dirs", "presets",
    "TensorGroup", "from_tensors", "VLLM_FLASH_ATTN", "VLLM_FLASHINFER", "VLLM_MLA",
    "VLLM_CROSS_LAYER",
    "BlockTable", "CopyRequest", "reference_gather", "reference_scatter",
    "Transfer", "TransferStats", "Route", "DEVICE_HOST",
    "CudaInfo", "cuda_probe",
    "Allocation", "MemIdentity", "MemProvider", "mem_instance", "set_mem_instance",
    "mem_granularity", "device_from_uuid",
    "Topology", "NumaNode", "GpuPlacement", "topology",
]
