"""kvferry and torch: a ``torch.cuda.MemPool`` whose tensors kvferryd can import.

A stock torch tensor lives in cudaMalloc memory (torch's caching allocator),
which no other process can map. :func:`exportable_mem_pool` gives a pool
backed by ``libkvferry_torch_alloc.so`` through
``torch.cuda.CUDAPluggableAllocator``: every segment torch's caching
allocator asks for is cuMem memory created with the POSIX file descriptor
handle type (a ``kvferry.Allocation`` of provider cumem), so
``kvferry.Allocation.find(tensor)`` works on any tensor of the pool, at any
offset, and returns the segment with the identity it was created with::

    import torch, kvferry.torch
    with torch.cuda.use_mem_pool(kvferry.torch.exportable_mem_pool(0), device=0):
        kv = torch.zeros(2, 4096, 16, 8, 128, dtype=torch.bfloat16, device="cuda:0")
    alloc = kvferry.Allocation.find(kv)     # export it to kvferryd

This module imports torch only inside the functions that need it: importing
``kvferry`` (or this module) never imports torch. docs/python.md has the
limits (one device's access, no expandable segments, free synchronizes).

The library is looked for like libkvferry (kvferry._lib), in this order:

1. ``$KVF_TORCH_ALLOC_LIBRARY``: a path; when set, the only place tried;
2. next to the package: ``libkvferry_torch_alloc.so`` in the installed
   ``kvferry/`` directory (shipped in the wheel beside ``libkvferry.so*``);
3. next to the libkvferry the package loaded (a build directory, or the
   ``lib/`` it was installed to: the build and ``cmake --install`` put both
   side by side);
4. the build tree of the checkout (``build/`` and the build directories
   under it), then ``lib/`` of the install prefixes libkvferry is looked for
   in, then the dynamic loader.

A candidate is used only if it shares the libkvferry the package loaded
(its own table of live allocations is what ``Allocation.find`` reads); one
bound to another copy is skipped, and the error lists it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
import threading
from ctypes import POINTER, byref, c_char_p, c_int, c_ssize_t, c_uint64, c_void_p
from pathlib import Path
from typing import Any, List, Optional, Tuple

from . import _lib
from . import _structs as S
from ._errors import Status
from ._lib import fail
from .memory import MemIdentity

__all__ = ["LIBRARY_NAME", "ALLOC_FN", "FREE_FN", "allocator_library_path", "allocator_stats",
           "allocation_identity", "exportable_allocator", "exportable_mem_pool"]

#: The allocator library's file name.
LIBRARY_NAME = "libkvferry_torch_alloc.so"
#: The entry points CUDAPluggableAllocator is given.
ALLOC_FN = "kvf_torch_alloc"
FREE_FN = "kvf_torch_free"

# Guards _loaded and _allocator (each made once per process).
_state_lock = threading.Lock()
_loaded: Optional[Tuple[ctypes.CDLL, str]] = None
# The CUDAPluggableAllocator, kept for the life of the process: a MemPool
# holds only a raw pointer to the C++ allocator inside it.
_allocator: Any = None


def _anchor_of_package_library() -> Optional[int]:
    """An address inside the libkvferry the package loaded (what its
    kvf_version_string() returns)."""
    fn = ctypes.CFUNCTYPE(c_void_p)(("kvf_version_string", _lib.lib))
    return fn()


def _candidates() -> List[Tuple[str, Optional[str]]]:
    """(place, path-or-name) in search order; path None: nothing there."""
    out: List[Tuple[str, Optional[str]]] = []
    seen = set()

    def add(place: str, path: Path) -> None:
        key = str(path)
        if key in seen:
            return
        seen.add(key)
        out.append((place, key) if path.exists() else ("%s (%s: absent)" % (place, path), None))

    add("next to the package", _lib.PACKAGE_DIR / LIBRARY_NAME)
    loaded = Path(_lib.library_path)
    if loaded.is_absolute():
        add("next to the loaded libkvferry", loaded.resolve().parent / LIBRARY_NAME)
    for root in _lib.source_roots():
        for d in _lib.build_dirs(root):
            add("the build tree", d / LIBRARY_NAME)
    prefixes = [sys.prefix]
    if sys.base_prefix != sys.prefix:
        prefixes.append(sys.base_prefix)
    prefixes.append("/usr/local")
    for prefix in prefixes:
        for libdir in ("lib", "lib64"):
            add("the install prefix", Path(prefix) / libdir / LIBRARY_NAME)
    found = ctypes.util.find_library("kvferry_torch_alloc")
    out.append(("ctypes.util.find_library('kvferry_torch_alloc')", found) if found
               else ("ctypes.util.find_library('kvferry_torch_alloc') (found nothing)", None))
    return out


def _declare(lib: ctypes.CDLL) -> None:
    lib.kvf_torch_alloc.restype = c_void_p
    lib.kvf_torch_alloc.argtypes = [c_ssize_t, c_int, c_void_p]
    lib.kvf_torch_free.restype = None
    lib.kvf_torch_free.argtypes = [c_void_p, c_ssize_t, c_int, c_void_p]
    lib.kvf_torch_alloc_identity.restype = c_int
    lib.kvf_torch_alloc_identity.argtypes = [c_void_p, POINTER(S.kvf_mem_identity)]
    lib.kvf_torch_alloc_stats.restype = None
    lib.kvf_torch_alloc_stats.argtypes = [POINTER(c_uint64), POINTER(c_uint64)]
    lib.kvf_torch_alloc_libkvferry_anchor.restype = c_void_p
    lib.kvf_torch_alloc_libkvferry_anchor.argtypes = []
    lib.kvf_torch_alloc_libkvferry_path.restype = c_char_p
    lib.kvf_torch_alloc_libkvferry_path.argtypes = []


def _try(path: str) -> Tuple[Optional[ctypes.CDLL], str]:
    """Load one candidate: (library, "") or (None, why not)."""
    try:
        lib = ctypes.CDLL(path)
        _declare(lib)
    except (OSError, AttributeError) as exc:
        return None, str(exc)
    if lib.kvf_torch_alloc_libkvferry_anchor() != _anchor_of_package_library():
        theirs = (lib.kvf_torch_alloc_libkvferry_path() or b"?").decode(errors="replace")
        return None, ("it calls another libkvferry (%s) than the package loaded (%s), so "
                      "Allocation.find would not know its segments" % (theirs, _lib.library_path))
    return lib, ""


def _load() -> Tuple[ctypes.CDLL, str]:
    global _loaded
    with _state_lock:
        if _loaded is not None:
            return _loaded
        env = os.environ.get("KVF_TORCH_ALLOC_LIBRARY")
        if env:
            lib, why = _try(env)
            if lib is None:
                raise fail(Status.NOT_FOUND, "KVF_TORCH_ALLOC_LIBRARY=%s cannot be used: %s (unset it "
                           "to search the usual places)" % (env, why))
            _loaded = (lib, env)
            return _loaded
        tried = ["$KVF_TORCH_ALLOC_LIBRARY (not set)"]
        for place, path in _candidates():
            if path is None:
                tried.append(place)
                continue
            lib, why = _try(path)
            if lib is not None:
                _loaded = (lib, path)
                return _loaded
            tried.append("%s: %s: %s" % (place, path, why))
        raise fail(Status.NOT_FOUND, "%s not found. Build it with libkvferry (cmake builds it "
                   "next to libkvferry.so; README.md), then set KVF_TORCH_ALLOC_LIBRARY to its "
                   "path, copy it next to the package, or install it (cmake --install). "
                   "Looked at:\n  %s" % (LIBRARY_NAME, "\n  ".join(tried)))


def allocator_library_path() -> str:
    """The path of libkvferry_torch_alloc.so, loaded (without torch) and
    checked to share the package's libkvferry. Raises KvferryError
    NOT_FOUND, saying everywhere it looked."""
    return _load()[1]


def allocator_stats() -> Tuple[int, int]:
    """(segments, bytes) the allocator holds for torch right now: allocated
    and not freed yet, bytes after rounding to the granularity."""
    lib = _load()[0]
    segments, nbytes = c_uint64(), c_uint64()
    lib.kvf_torch_alloc_stats(byref(segments), byref(nbytes))
    return segments.value, nbytes.value


def allocation_identity(ptr: Any) -> MemIdentity:
    """The identity the allocator gave the segment holding ``ptr`` (an int
    address, or a tensor: its data pointer), as it created it. Raises
    KvferryError NOT_FOUND when the allocator holds no segment there (the
    tensor is not from an exportable pool)."""
    lib = _load()[0]
    addr = ptr if isinstance(ptr, int) and not isinstance(ptr, bool) else _data_ptr(ptr)
    out = S.kvf_mem_identity()
    st = lib.kvf_torch_alloc_identity(addr or None, byref(out))
    if st != 0:
        raise fail(Status(st) if st in Status._value2member_map_ else Status.INTERNAL,
                   "0x%x is in no segment of %s" % (addr or 0, LIBRARY_NAME), "ptr")
    return MemIdentity._from_c(out)


def _data_ptr(obj: Any) -> int:
    if hasattr(obj, "data_ptr"):
        return int(obj.data_ptr())
    from ._buffers import as_buffer
    return as_buffer(obj, "ptr").ptr


def _import_torch() -> Any:
    try:
        import torch
    except ImportError as exc:
        raise fail(Status.UNSUPPORTED, "kvferry.torch needs torch, which cannot be imported "
                   "here: %s" % exc) from None
    if not hasattr(torch._C, "_cuda_customAllocator"):
        raise fail(Status.UNSUPPORTED, "torch %s is built without CUDA (torch.version.cuda is "
                   "None): it has no pluggable CUDA allocator" % torch.__version__)
    return torch


def exportable_allocator() -> Any:
    """The process's ``torch.cuda.memory.CUDAPluggableAllocator`` over
    libkvferry_torch_alloc.so (made once, kept for the life of the process).
    Needs a torch built with CUDA, not a GPU. Most callers want
    :func:`exportable_mem_pool`; this one serves
    ``torch.cuda.memory.change_current_allocator`` (every tensor of the
    process exportable, before torch allocated anything)."""
    global _allocator
    torch = _import_torch()
    path = allocator_library_path()  # loaded and checked before torch loads it
    with _state_lock:
        if _allocator is None:
            _allocator = torch.cuda.memory.CUDAPluggableAllocator(path, ALLOC_FN, FREE_FN)
        return _allocator


def exportable_mem_pool(device: Any = None) -> Any:
    """A new ``torch.cuda.MemPool`` on ``device`` (an index, ``"cuda:N"``, a
    ``torch.device``; None: the current device) whose memory is exportable
    cuMem memory: allocate the KV cache inside
    ``torch.cuda.use_mem_pool(pool, device=device)``.

    Each call makes a new pool (torch keeps pools apart); all share the one
    allocator. Use the pool on its own device: on another device torch would
    route allocations to a pool without this allocator (plain cudaMalloc).
    Raises KvferryError: UNSUPPORTED (torch missing or built without CUDA),
    NO_DEVICE (torch sees no GPU), NOT_FOUND (the library is not found),
    INVALID_ARGUMENT (not a CUDA device).
    """
    torch = _import_torch()
    if not torch.cuda.is_available():
        from .device import cuda_probe
        raise fail(Status.NO_DEVICE, "torch %s sees no CUDA device, so it cannot make a memory "
                   "pool (kvferry: %s)" % (torch.__version__, cuda_probe().message))
    index = _device_index(torch, device)
    allocator = exportable_allocator()
    with torch.cuda.device(index):
        pool = torch.cuda.MemPool(allocator.allocator())
    # The pool holds a raw pointer to the allocator: keep it referenced too.
    pool._kvferry_allocator = allocator
    pool._kvferry_device = index
    return pool


def _device_index(torch: Any, device: Any) -> int:
    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, bool):
        raise fail(Status.INVALID_ARGUMENT, "%r is not a CUDA device" % (device,), "device")
    if isinstance(device, int):
        index = device
    else:
        try:
            dev = torch.device(device)
        except (TypeError, RuntimeError) as exc:
            raise fail(Status.INVALID_ARGUMENT, "%r is not a device: %s" % (device, exc),
                       "device") from None
        if dev.type != "cuda":
            raise fail(Status.INVALID_ARGUMENT, "%r is not a CUDA device" % (device,), "device")
        index = dev.index if dev.index is not None else torch.cuda.current_device()
    count = torch.cuda.device_count()
    if not 0 <= index < count:
        raise fail(Status.INVALID_ARGUMENT, "CUDA device %d is not visible (0..%d)"
                   % (index, count - 1), "device")
    return index
