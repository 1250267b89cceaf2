"""Buffers, streams and block ids from whatever the caller holds.

Buffers come through, in this order: ``__dlpack__`` (versioned and
unversioned DLPack capsules, read with ctypes), ``__cuda_array_interface__``
(strides in bytes), ``__array_interface__`` (numpy), the Python buffer
protocol (bytearray, mmap, memoryview, ctypes arrays), a :class:`RawBuffer`,
or a raw ``(pointer, length)`` tuple. Nothing here imports numpy or torch;
numpy is used for block ids only when the caller passes numpy arrays (it is
then already imported).
"""

from __future__ import annotations

import ctypes
import operator
import sys
from ctypes import POINTER, Structure, c_char_p, c_int, c_int32, c_int64, c_ssize_t, c_uint8, \
    c_uint16, c_uint32, c_uint64, c_void_p, py_object
from typing import Any, List, Optional, Sequence, Tuple

from ._errors import Status
from ._lib import fail
from ._structs import BLOCK_SKIP

__all__ = ["RawBuffer", "BufferView", "as_buffer", "stream_handle", "block_ids",
           "allocation_extent", "HOST_DEVICES"]

# Memory the CPU can read and write: the host backend and the reference copies
# accept only these.
HOST_DEVICES = ("cpu", "cuda_host", "cuda_managed", "rocm_host", "unknown")


class RawBuffer:
    """A raw memory range: a pointer, its length in bytes and where it lives.

    Use it for memory no buffer protocol describes (a cudaMalloc pointer, an
    mmap'd address): ``RawBuffer(ptr, nbytes, device="cuda", device_index=0)``.
    A plain ``(ptr, nbytes)`` tuple is the same with ``device="unknown"``
    (treated as host memory by the host-only checks). ``owner`` is kept alive
    as long as the RawBuffer is.
    """

    __slots__ = ("ptr", "nbytes", "device", "device_index", "owner", "readonly")

    def __init__(self, ptr: int, nbytes: int, device: str = "unknown",
                 device_index: Optional[int] = None, owner: Any = None,
                 readonly: bool = False) -> None:
        self.ptr = int(ptr)
        self.nbytes = int(nbytes)
        if self.ptr < 0 or self.nbytes < 0:
            raise fail(Status.INVALID_ARGUMENT, "pointer %d and length %d must be non-negative"
                       % (self.ptr, self.nbytes), "buffer")
        self.device = device
        self.device_index = device_index
        self.owner = owner
        self.readonly = readonly

    def __repr__(self) -> str:
        return "RawBuffer(0x%x, %d, device=%r)" % (self.ptr, self.nbytes, self.device)


class BufferView:
    """What the package knows about one buffer: where its first element is,
    its shape and byte strides when it has them, its element type and
    device, and the objects that keep it alive."""

    __slots__ = ("ptr", "shape", "strides", "itemsize", "dtype", "kind", "device",
                 "device_index", "readonly", "source", "keep")

    def __init__(self, ptr: int, shape: Tuple[int, ...], strides: Tuple[int, ...],
                 itemsize: int, dtype: str, kind: str, device: str, device_index: Optional[int],
                 readonly: bool, source: str, keep: List[Any]) -> None:
        self.ptr = ptr
        self.shape = shape
        self.strides = strides
        self.itemsize = itemsize
        self.dtype = dtype
        self.kind = kind
        self.device = device
        self.device_index = device_index
        self.readonly = readonly
        self.source = source
        self.keep = keep

    @property
    def span(self) -> Tuple[int, int]:
        """[lo, hi): the bytes the buffer's elements cover."""
        lo = hi = self.ptr
        for n, s in zip(self.shape, self.strides):
            if n == 0:
                return self.ptr, self.ptr
            if s >= 0:
                hi += (n - 1) * s
            else:
                lo += (n - 1) * s
        return lo, hi + self.itemsize

    @property
    def nbytes(self) -> int:
        """Bytes from ptr to the end of the span (what the caller may touch)."""
        lo, hi = self.span
        return hi - self.ptr if lo == self.ptr else 0

    @property
    def contiguous(self) -> bool:
        """True when the elements are C-contiguous from ptr."""
        step = self.itemsize
        for n, s in reversed(list(zip(self.shape, self.strides))):
            if n != 1 and s != step:
                return False
            step *= n
        return True

    @property
    def host_accessible(self) -> bool:
        return self.device in HOST_DEVICES

    @property
    def where(self) -> str:
        return self.device if self.device_index is None else "%s:%d" % (self.device, self.device_index)


def _c_strides(shape: Sequence[int], itemsize: int) -> Tuple[int, ...]:
    out = []
    step = itemsize
    for n in reversed(shape):
        out.append(step)
        step *= max(n, 1)
    return tuple(reversed(out))


# ---- DLPack ---------------------------------------------------------------------

class _DLDevice(Structure):
    _fields_ = [("device_type", c_int32), ("device_id", c_int32)]


class _DLDataType(Structure):
    _fields_ = [("code", c_uint8), ("bits", c_uint8), ("lanes", c_uint16)]


class _DLTensor(Structure):
    _fields_ = [("data", c_void_p), ("device", _DLDevice), ("ndim", c_int32),
                ("dtype", _DLDataType), ("shape", POINTER(c_int64)),
                ("strides", POINTER(c_int64)), ("byte_offset", c_uint64)]


class _DLManagedTensor(Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", c_void_p), ("deleter", c_void_p)]


class _DLPackVersion(Structure):
    _fields_ = [("major", c_uint32), ("minor", c_uint32)]


class _DLManagedTensorVersioned(Structure):
    _fields_ = [("version", _DLPackVersion), ("manager_ctx", c_void_p), ("deleter", c_void_p),
                ("flags", c_uint64), ("dl_tensor", _DLTensor)]


_DLPACK_FLAG_READ_ONLY = 1
_DL_DEVICES = {1: "cpu", 2: "cuda", 3: "cuda_host", 4: "opencl", 7: "vulkan", 8: "metal",
               9: "vpi", 10: "rocm", 11: "rocm_host", 12: "ext_dev", 13: "cuda_managed",
               14: "oneapi", 15: "webgpu", 16: "hexagon", 17: "maia"}
_DL_GPU_DEVICES = (2, 10, 13)  # producers take a stream argument for these
_DL_CODES = {0: ("int", "i"), 1: ("uint", "u"), 2: ("float", "f"), 3: ("opaque", "V"),
             4: ("bfloat", "f"), 5: ("complex", "c"), 6: ("bool", "b")}
_DL_FP8 = {7: "float8_e3m4", 8: "float8_e4m3", 9: "float8_e4m3b11fnuz", 10: "float8_e4m3fn",
           11: "float8_e4m3fnuz", 12: "float8_e5m2", 13: "float8_e5m2fnuz", 14: "float8_e8m0fnu",
           15: "float6_e2m3fn", 16: "float6_e3m2fn", 17: "float4_e2m1fn"}

_capsule_is_valid = ctypes.pythonapi.PyCapsule_IsValid
_capsule_is_valid.argtypes = [py_object, c_char_p]
_capsule_is_valid.restype = c_int
_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.argtypes = [py_object, c_char_p]
_capsule_pointer.restype = c_void_p


def _from_dlpack(obj: Any, what: str) -> BufferView:
    kwargs = {}
    dev = None
    device_fn = getattr(obj, "__dlpack_device__", None)
    if device_fn is not None:
        dev = tuple(device_fn())
        if int(dev[0]) in _DL_GPU_DEVICES:
            # -1: no synchronization. kvferry orders its work on the stream the
            # caller gives; making that stream wait for the producer is the
            # caller's job (an engine writes its cache on that stream anyway).
            kwargs["stream"] = -1
    try:
        capsule = obj.__dlpack__(max_version=(1, 0), **kwargs)
    except TypeError:  # a producer older than DLPack 1.0 takes no max_version
        capsule = obj.__dlpack__(**kwargs)
    readonly = False
    if _capsule_is_valid(capsule, b"dltensor_versioned"):
        managed = _DLManagedTensorVersioned.from_address(
            _capsule_pointer(capsule, b"dltensor_versioned"))
        if managed.version.major != 1:
            raise fail(Status.UNSUPPORTED, "DLPack version %d.%d: this package reads 1.x"
                       % (managed.version.major, managed.version.minor), what)
        readonly = bool(managed.flags & _DLPACK_FLAG_READ_ONLY)
        tensor = managed.dl_tensor
    elif _capsule_is_valid(capsule, b"dltensor"):
        tensor = _DLManagedTensor.from_address(_capsule_pointer(capsule, b"dltensor")).dl_tensor
    else:
        raise fail(Status.INVALID_ARGUMENT, "__dlpack__() returned %r, not a DLPack capsule"
                   % (capsule,), what)
    ndim = tensor.ndim
    shape = tuple(tensor.shape[i] for i in range(ndim))
    code, bits, lanes = tensor.dtype.code, tensor.dtype.bits, tensor.dtype.lanes
    total_bits = bits * lanes
    itemsize = total_bits // 8 if total_bits % 8 == 0 else 0
    if code in _DL_FP8:
        dtype, kind = _DL_FP8[code], "f"
    else:
        base, kind = _DL_CODES.get(code, ("code%d_" % code, "V"))
        dtype = base + ("" if base == "bool" else str(bits)) + ("x%d" % lanes if lanes != 1 else "")
    if tensor.strides:
        strides = tuple(tensor.strides[i] * itemsize for i in range(ndim))
    else:
        strides = _c_strides(shape, itemsize)
    ptr = (tensor.data or 0) + tensor.byte_offset
    device = _DL_DEVICES.get(tensor.device.device_type, "dlpack_device_%d" % tensor.device.device_type)
    # The capsule owns the producer's reference: while it lives (it is kept
    # here), the memory does; its destructor calls the deleter afterwards.
    return BufferView(ptr, shape, strides, itemsize, dtype, kind, device, tensor.device.device_id,
                      readonly, "dlpack", [obj, capsule])


# ---- array interfaces -------------------------------------------------------------

_TYPESTR_KINDS = {"f": "float", "i": "int", "u": "uint", "b": "bool", "c": "complex", "V": "void",
                  "S": "bytes", "U": "str", "m": "timedelta", "M": "datetime", "O": "object"}


def _from_interface(obj: Any, iface: dict, device: str, source: str, what: str) -> BufferView:
    if iface.get("mask") is not None:
        raise fail(Status.UNSUPPORTED, "masked arrays are not supported", what)
    typestr = iface["typestr"]
    kind = typestr[1]
    itemsize = int(typestr[2:])
    dtype = _TYPESTR_KINDS.get(kind, kind) + ("" if kind == "b" else str(itemsize * 8))
    shape = tuple(int(n) for n in iface["shape"])
    strides = iface.get("strides")
    strides = tuple(int(s) for s in strides) if strides is not None else _c_strides(shape, itemsize)
    data = iface.get("data")
    if not isinstance(data, tuple):
        raise fail(Status.UNSUPPORTED, "%s with data %r: only a (pointer, read-only) tuple is "
                   "supported" % (source, type(data).__name__), what)
    ptr, readonly = int(data[0] or 0), bool(data[1])
    return BufferView(ptr, shape, strides, itemsize, dtype, kind, device, None, readonly, source,
                      [obj])


# ---- the Python buffer protocol ----------------------------------------------------

class _PyBuffer(Structure):
    _fields_ = [("buf", c_void_p), ("obj", c_void_p), ("len", c_ssize_t), ("itemsize", c_ssize_t),
                ("readonly", c_int), ("ndim", c_int), ("format", c_char_p),
                ("shape", POINTER(c_ssize_t)), ("strides", POINTER(c_ssize_t)),
                ("suboffsets", POINTER(c_ssize_t)), ("internal", c_void_p)]


_get_buffer = ctypes.pythonapi.PyObject_GetBuffer
_get_buffer.argtypes = [py_object, POINTER(_PyBuffer), c_int]
_get_buffer.restype = c_int
_release_buffer = ctypes.pythonapi.PyBuffer_Release
_release_buffer.argtypes = [POINTER(_PyBuffer)]
_release_buffer.restype = None
_PYBUF_RECORDS_RO = 0x0010 | 0x0008 | 0x0004  # STRIDES | ND | FORMAT

_FORMAT_KINDS = {"b": "i", "h": "i", "i": "i", "l": "i", "q": "i", "n": "i",
                 "B": "u", "H": "u", "I": "u", "L": "u", "Q": "u", "N": "u", "c": "u",
                 "e": "f", "f": "f", "d": "f", "?": "b"}


class _BufferExport:
    """Holds a Py_buffer (which keeps its exporter alive and unresizable)
    and releases it when dropped."""

    __slots__ = ("view", "__weakref__")

    def __init__(self, obj: Any) -> None:
        self.view: Optional[_PyBuffer] = _PyBuffer()
        _get_buffer(obj, ctypes.byref(self.view), _PYBUF_RECORDS_RO)

    def __del__(self) -> None:
        view, self.view = self.view, None
        if view is not None and _release_buffer is not None:
            _release_buffer(ctypes.byref(view))


def _from_buffer_protocol(obj: Any, what: str) -> BufferView:
    export = _BufferExport(obj)
    v = export.view
    assert v is not None
    ndim = v.ndim
    shape = tuple(v.shape[i] for i in range(ndim)) if v.shape else (v.len // max(v.itemsize, 1),)
    strides = tuple(v.strides[i] for i in range(ndim)) if v.strides else _c_strides(shape, v.itemsize)
    fmt = (v.format or b"B").decode("ascii", errors="replace").lstrip("@=<>!")
    kind = _FORMAT_KINDS.get(fmt, "V")
    dtype = {"i": "int", "u": "uint", "f": "float", "b": "bool"}.get(kind, "void")
    dtype += "" if kind == "b" else str(v.itemsize * 8)
    return BufferView(v.buf or 0, shape, strides, v.itemsize, dtype, kind, "cpu", None,
                      bool(v.readonly), "buffer", [obj, export])


# ---- entry point ------------------------------------------------------------------

def as_buffer(obj: Any, what: str) -> BufferView:
    """A BufferView of obj, by the first protocol it supports. what names the
    argument in errors ("objects[3]")."""
    if isinstance(obj, BufferView):
        return obj
    if isinstance(obj, RawBuffer):
        return BufferView(obj.ptr, (obj.nbytes,), (1,), 1, "uint8", "u", obj.device,
                          obj.device_index, obj.readonly, "raw", [obj])
    if isinstance(obj, tuple) and len(obj) == 2 and all(isinstance(x, int) for x in obj):
        raw = RawBuffer(obj[0], obj[1])
        return BufferView(raw.ptr, (raw.nbytes,), (1,), 1, "uint8", "u", "unknown", None, False,
                          "raw", [])
    if isinstance(obj, (int, bool)):
        raise fail(Status.INVALID_ARGUMENT, "a bare pointer has no length: give (pointer, length) "
                   "or kvferry.RawBuffer(pointer, length, device=...)", what)
    errors = []
    if hasattr(obj, "__dlpack__"):
        try:
            return _from_dlpack(obj, what)
        except (BufferError, TypeError, RuntimeError, ValueError) as exc:
            errors.append("__dlpack__: %s" % exc)
    for attr, device, source in (("__cuda_array_interface__", "cuda", "cuda_array_interface"),
                                 ("__array_interface__", "cpu", "array_interface")):
        try:
            iface = getattr(obj, attr, None)
        except (RuntimeError, TypeError, ValueError) as exc:  # torch: a tensor that requires grad
            errors.append("%s: %s" % (attr, exc))
            continue
        if iface is not None:
            return _from_interface(obj, iface, device, source, what)
    try:
        return _from_buffer_protocol(obj, what)
    except (TypeError, BufferError, ValueError) as exc:
        errors.append("buffer protocol: %s" % exc)
    raise fail(Status.INVALID_ARGUMENT, "%s is not a buffer (no usable __dlpack__, "
               "__cuda_array_interface__, __array_interface__ or buffer protocol; %s)"
               % (type(obj).__name__, "; ".join(errors) or "none of them"), what)


def allocation_extent(obj: Any) -> Optional[Tuple[int, int]]:
    """(pointer, bytes) of the allocation a tensor views, when the object
    says: a torch tensor's untyped storage, or the array at the bottom of a
    numpy array's .base chain. None when unknown."""
    storage_fn = getattr(obj, "untyped_storage", None)
    if callable(storage_fn):
        try:
            storage = storage_fn()
            return int(storage.data_ptr()), int(storage.nbytes())
        except Exception:  # not torch after all
            return None
    if getattr(obj, "__array_interface__", None) is None:
        return None
    root = obj
    while True:
        base = getattr(root, "base", None)
        if base is None or getattr(base, "__array_interface__", None) is None:
            break
        root = base
    view = _from_interface(root, root.__array_interface__, "cpu", "array_interface", "base")
    lo, hi = view.span
    return lo, hi - lo


# ---- streams --------------------------------------------------------------------

def stream_handle(stream: Any) -> int:
    """A cudaStream_t as an int, from None (the legacy default stream, 0), an
    int handle, an object with ``__cuda_stream__`` (returning (version,
    handle)), one with a ``cuda_stream`` attribute (torch.cuda.Stream), or a
    ctypes.c_void_p."""
    if stream is None:
        return 0
    if isinstance(stream, bool):
        raise fail(Status.INVALID_ARGUMENT, "a bool is not a stream", "stream")
    if isinstance(stream, int):
        if stream < 0:
            raise fail(Status.INVALID_ARGUMENT, "%d is not a stream handle" % stream, "stream")
        return stream
    proto = getattr(stream, "__cuda_stream__", None)
    if proto is not None:
        value = proto() if callable(proto) else proto
        try:
            _version, handle = value
        except (TypeError, ValueError):
            raise fail(Status.INVALID_ARGUMENT, "__cuda_stream__ returned %r, not (version, "
                       "handle)" % (value,), "stream") from None
        return int(handle)
    handle = getattr(stream, "cuda_stream", None)
    if handle is not None:
        return int(handle)
    if isinstance(stream, ctypes.c_void_p):
        return stream.value or 0
    raise fail(Status.INVALID_ARGUMENT, "%s is not a stream (give None, an int handle, or an "
               "object with __cuda_stream__ or .cuda_stream)" % type(stream).__name__, "stream")


# ---- block ids --------------------------------------------------------------------

def _bad_id(what: str, index: int, value: Any) -> Exception:
    return fail(Status.INVALID_ARGUMENT, "%r is not a block id: block ids are 0 .. 2^32-2, "
                "and -1 or None skip a block" % (value,), "%s[%d]" % (what, index))


def _ids_numpy(np: Any, arr: Any, what: str) -> Tuple[Any, int, Any]:
    a = np.asarray(arr)
    if a.ndim != 1:
        raise fail(Status.INVALID_ARGUMENT, "block ids must be one-dimensional (shape %s)"
                   % (a.shape,), what)
    if a.dtype.kind not in "iu":
        raise fail(Status.INVALID_ARGUMENT, "block ids must be integers (dtype %s)" % a.dtype, what)
    if a.dtype.kind == "i":
        bad = a < -1
        if bad.any():
            i = int(np.argmax(bad))
            raise _bad_id(what, i, int(a[i]))
        a = np.where(a == -1, np.int64(BLOCK_SKIP), a.astype(np.int64))
    if a.size and a.dtype.itemsize > 4:
        big = a > BLOCK_SKIP
        if big.any():
            i = int(np.argmax(big))
            raise _bad_id(what, i, int(a[i]))
    out = np.ascontiguousarray(a, dtype=np.uint32)
    ptr = ctypes.cast(c_void_p(out.ctypes.data), POINTER(c_uint32))
    return ptr, int(out.size), out


def _ids_list(values: Sequence[Any], what: str) -> Tuple[Any, int, Any]:
    out = []
    for i, v in enumerate(values):
        if v is None:
            out.append(BLOCK_SKIP)
            continue
        if isinstance(v, bool):
            raise _bad_id(what, i, v)
        try:
            n = operator.index(v)
        except TypeError:
            raise _bad_id(what, i, v) from None
        if n == -1:
            n = BLOCK_SKIP
        elif n < 0 or n > BLOCK_SKIP:
            raise _bad_id(what, i, v)
        out.append(n)
    arr = (c_uint32 * len(out))(*out)
    return ctypes.cast(arr, POINTER(c_uint32)), len(out), arr


_ELEMENT_TYPES = {("i", 1): ctypes.c_int8, ("i", 2): ctypes.c_int16, ("i", 4): ctypes.c_int32,
                  ("i", 8): ctypes.c_int64, ("u", 1): ctypes.c_uint8, ("u", 2): ctypes.c_uint16,
                  ("u", 4): ctypes.c_uint32, ("u", 8): ctypes.c_uint64}


def block_ids(ids: Any, what: str) -> Tuple[Any, int, Any]:
    """(uint32 pointer or None, count, object to keep alive) for a block
    table: a sequence of ints, or a 1-D integer array or tensor in host
    memory. -1 and None become KVF_BLOCK_SKIP; other negative values and
    values above 2^32-1 raise KvferryError naming what[index]."""
    if ids is None:
        return None, 0, None
    np = sys.modules.get("numpy")
    if np is not None and isinstance(ids, np.ndarray):
        return _ids_numpy(np, ids, what)
    if isinstance(ids, (list, tuple, range)):
        return _ids_list(ids, what)
    if any(hasattr(ids, a) for a in ("__dlpack__", "__array_interface__",
                                     "__cuda_array_interface__")):
        view = as_buffer(ids, what)
        if not view.host_accessible:
            raise fail(Status.INVALID_ARGUMENT, "block ids must be in host memory (they are on "
                       "%s: copy them to the CPU first)" % view.where, what)
        if len(view.shape) != 1:
            raise fail(Status.INVALID_ARGUMENT, "block ids must be one-dimensional (shape %s)"
                       % (view.shape,), what)
        ctype = _ELEMENT_TYPES.get((view.kind, view.itemsize))
        if ctype is None:
            raise fail(Status.INVALID_ARGUMENT, "block ids must be integers (dtype %s)"
                       % view.dtype, what)
        n, step = view.shape[0], view.strides[0]
        if step == view.itemsize:
            values = list((ctype * n).from_address(view.ptr)) if n else []
        else:
            values = [ctype.from_address(view.ptr + i * step).value for i in range(n)]
        ptr, count, keep = _ids_list(values, what)
        return ptr, count, (keep, view)
    try:
        values = list(ids)
    except TypeError:
        raise fail(Status.INVALID_ARGUMENT, "%s is not a sequence of block ids"
                   % type(ids).__name__, what) from None
    return _ids_list(values, what)
