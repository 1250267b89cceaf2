"""Exportable allocations and their identities (kvferry/memory.h, exporter side).

Two providers: ``MemProvider.CUMEM`` (CUDA virtual memory with POSIX file
descriptor handles, the memory an engine's KV pool must live in to be shared
with kvferryd) and ``MemProvider.HOST`` (a sealed memfd mapped read/write, the
host backend's shared memory).

Threading: everything here is safe from any thread.
"""

from __future__ import annotations

import ctypes
import enum
from ctypes import byref, c_int, c_uint64, c_void_p
from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence, Tuple, Union

from . import _structs as S
from ._buffers import as_buffer
from ._errors import Status
from ._handle import Handle, HandleOwner
from ._lib import fail, lib

__all__ = ["MemProvider", "MemIdentity", "Allocation", "mem_instance", "set_mem_instance",
           "mem_granularity", "device_from_uuid"]


class MemProvider(enum.IntEnum):
    """kvf_mem_provider (values pinned: they travel in identities)."""

    HOST = 1   #: memfd + mmap
    CUMEM = 2  #: CUDA VMM, POSIX file descriptor handles

    @classmethod
    def parse(cls, value: Union["MemProvider", str, int]) -> "MemProvider":
        """A provider from its enum, its value or its name ("host", "cumem")."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str) and value.upper() in cls.__members__:
            return cls[value.upper()]
        if isinstance(value, int) and not isinstance(value, bool) and value in (1, 2):
            return cls(value)
        raise fail(Status.INVALID_ARGUMENT, "%r is not 'host' or 'cumem'" % (value,), "provider")


@dataclass(frozen=True)
class MemIdentity:
    """kvf_mem_identity: what an exporter says about an allocation it exports.

    An importer keys its mappings by (instance_id, allocation_id,
    generation). ``bytes(identity)`` is the 64-byte C struct, as it travels
    between processes; :meth:`from_bytes` reads it back.
    """

    instance_id: int
    allocation_id: int
    generation: int
    size: int
    device_uuid: bytes
    provider: MemProvider

    @classmethod
    def _from_c(cls, c: S.kvf_mem_identity) -> "MemIdentity":
        try:
            provider = MemProvider(c.provider)
        except ValueError:
            provider = c.provider
        return cls(c.instance_id, c.allocation_id, c.generation, c.size, bytes(c.device_uuid),
                   provider)

    def _to_c(self) -> S.kvf_mem_identity:
        c = S.kvf_mem_identity()
        c.instance_id, c.allocation_id = self.instance_id, self.allocation_id
        c.generation, c.size = self.generation, self.size
        ctypes.memmove(c.device_uuid, bytes(self.device_uuid)[:16].ljust(16, b"\0"), 16)
        c.provider = int(self.provider)
        return c

    def __bytes__(self) -> bytes:
        return bytes(self._to_c())

    @classmethod
    def from_bytes(cls, data: bytes) -> "MemIdentity":
        """An identity from its 64 bytes."""
        size = ctypes.sizeof(S.kvf_mem_identity)
        if len(data) != size:
            raise fail(Status.INVALID_ARGUMENT, "%d bytes, an identity has %d" % (len(data), size),
                       "data")
        return cls._from_c(S.kvf_mem_identity.from_buffer_copy(bytes(data)))

    def __str__(self) -> str:
        buf = ctypes.create_string_buffer(160)
        c = self._to_c()
        return S.text(lib.kvf_mem_identity_format(byref(c), buf, len(buf)))


class Allocation(HandleOwner):
    """An exportable allocation (kvf_mem_alloc): created here, or found under
    a pointer someone else allocated.

    Use :meth:`create` or :meth:`find`. ``close()`` (or the context manager,
    or ``__del__`` as a fallback) drops this object's reference
    (kvf_mem_alloc_destroy); the last one unmaps memory this process created
    (importers that still map it keep it alive). Arrays that view the memory
    do not keep it mapped: close the allocation only when nothing uses it any
    more.

    Host allocations expose ``__array_interface__`` and cumem allocations
    ``__cuda_array_interface__`` (one dimension of ``size`` bytes), so they
    can be handed to :class:`kvferry.CopyRequest`, or viewed with
    ``numpy.asarray(alloc)`` / ``torch.as_tensor(alloc, device="cuda")``.
    """

    def __init__(self, ptr: int, provider: MemProvider) -> None:
        # Internal: use create() or find().
        self._handle = Handle(ptr, lib.kvf_mem_alloc_destroy, "allocation")
        self.provider = provider

    @classmethod
    def create(cls, size: int, provider: Union[MemProvider, str] = MemProvider.HOST,
               device: int = 0, access_devices: Optional[Sequence[int]] = None,
               name: Optional[str] = None) -> "Allocation":
        """Allocate exportable memory (kvf_mem_alloc_create).

        size is rounded up to the provider's granularity. cumem memory lives
        on ``device`` and is made readable and writable by every device in
        ``access_devices`` (default: ``device`` alone); its contents start
        undefined. Host memory starts as zero; ``name`` names its memfd.
        Raises KvferryError: INVALID_ARGUMENT, UNSUPPORTED (the device cannot
        export POSIX file descriptors), NO_DRIVER / NO_DEVICE / CUDA, SYSTEM,
        OUT_OF_MEMORY.
        """
        provider = MemProvider.parse(provider)
        opts = S.kvf_mem_alloc_options.init()
        opts.provider = provider
        opts.device = int(device)
        opts.size = int(size)
        devices = None
        if access_devices:
            devices = (c_int * len(access_devices))(*[int(d) for d in access_devices])
            opts.access_devices = ctypes.cast(devices, ctypes.POINTER(c_int))
            opts.num_access_devices = len(access_devices)
        keep = name.encode("utf-8") if name is not None else None
        opts.name = keep
        out = c_void_p()
        lib.kvf_mem_alloc_create(byref(opts), byref(out))
        return cls(out.value or 0, provider)

    @classmethod
    def find(cls, ptr: Any, provider: Union[MemProvider, str] = MemProvider.CUMEM) -> "Allocation":
        """The allocation holding ``ptr`` (kvf_mem_alloc_find): an int
        address, or any buffer (a tensor: its data pointer is used).

        A live allocation of this process comes back with one more reference
        (same identity); for cumem, memory another allocator made with the
        POSIX-FD handle type is found through the driver. Raises KvferryError:
        UNSUPPORTED for memory that cannot be exported (cudaMalloc'd memory,
        torch's default caching allocator: the message says what to allocate
        instead), INVALID_ARGUMENT for a pointer in no allocation.
        """
        provider = MemProvider.parse(provider)
        if isinstance(ptr, bool) or not isinstance(ptr, int):
            ptr = as_buffer(ptr, "ptr").ptr
        out = c_void_p()
        lib.kvf_mem_alloc_find(provider, ptr or None, byref(out))
        return cls(out.value or 0, provider)

    @property
    def ptr(self) -> int:
        """Base address in this process (a device address for cumem)."""
        with self._handle.use() as a:
            return lib.kvf_mem_alloc_ptr(a) or 0

    @property
    def size(self) -> int:
        """Size in bytes, after rounding."""
        with self._handle.use() as a:
            return lib.kvf_mem_alloc_size(a)

    @property
    def identity(self) -> MemIdentity:
        """The allocation's identity."""
        c = S.kvf_mem_identity()
        with self._handle.use() as a:
            lib.kvf_mem_alloc_identity(a, byref(c))
        return MemIdentity._from_c(c)

    def export(self) -> Tuple[int, MemIdentity]:
        """(fd, identity): a new close-on-exec descriptor for the allocation.
        The caller owns the descriptor: pass it on (socket.send_fds) and
        close it (os.close)."""
        fd = c_int(-1)
        c = S.kvf_mem_identity()
        with self._handle.use() as a:
            lib.kvf_mem_alloc_export(a, byref(fd), byref(c))
        return fd.value, MemIdentity._from_c(c)

    def _interface(self) -> Dict[str, Any]:
        return {"shape": (self.size,), "typestr": "|u1", "data": (self.ptr, False),
                "strides": None, "version": 3}

    @property
    def __array_interface__(self) -> Dict[str, Any]:
        if self.provider != MemProvider.HOST:
            raise AttributeError("__array_interface__: a cumem allocation is device memory")
        return self._interface()

    @property
    def __cuda_array_interface__(self) -> Dict[str, Any]:
        if self.provider != MemProvider.CUMEM:
            raise AttributeError("__cuda_array_interface__: a host allocation is host memory")
        return self._interface()

    def __repr__(self) -> str:
        if self.closed:
            return "<kvferry.Allocation (closed)>"
        return "<kvferry.Allocation %s, %d bytes at 0x%x>" % (self.provider.name.lower(), self.size,
                                                              self.ptr)


def mem_instance() -> Tuple[int, int]:
    """(instance_id, generation) that new identities carry."""
    instance, generation = c_uint64(), c_uint64()
    lib.kvf_mem_instance(byref(instance), byref(generation))
    return instance.value, generation.value


def set_mem_instance(instance_id: int, generation: int) -> None:
    """Set the instance id and generation of allocations created or found
    afterwards (kvf_mem_instance_set); instance_id 0 draws a new random id."""
    lib.kvf_mem_instance_set(int(instance_id), int(generation))


def mem_granularity(provider: Union[MemProvider, str] = MemProvider.HOST, device: int = 0) -> int:
    """The allocation granularity of a provider on a device (2 MiB for cumem
    on an H200, the page size for host)."""
    out = c_uint64()
    lib.kvf_mem_granularity(MemProvider.parse(provider), int(device), byref(out))
    return out.value


def device_from_uuid(uuid: bytes) -> int:
    """The CUDA device ordinal, in this process, whose UUID is ``uuid`` (16
    bytes, as in MemIdentity.device_uuid). KvferryError NOT_FOUND when no
    visible device has it."""
    data = bytes(uuid)
    if len(data) != 16:
        raise fail(Status.INVALID_ARGUMENT, "%d bytes, a UUID has 16" % len(data), "uuid")
    out = c_int(-1)
    lib.kvf_mem_device_from_uuid(data, byref(out))
    return out.value
