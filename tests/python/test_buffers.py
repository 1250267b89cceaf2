"""Buffers, streams and block ids from the objects callers hold (kvferry._buffers)."""

import ctypes
import mmap
from ctypes import POINTER, c_int64, c_void_p, py_object

import numpy as np
import pytest

import kvferry
from kvferry import KvferryError, RawBuffer
from kvferry._buffers import _DLManagedTensor, as_buffer, block_ids, stream_handle

pythonapi_capsule_new = ctypes.pythonapi.PyCapsule_New
pythonapi_capsule_new.restype = py_object
pythonapi_capsule_new.argtypes = [c_void_p, ctypes.c_char_p, c_void_p]


class Unversioned:
    """A DLPack producer older than DLPack 1.0: no max_version argument."""

    def __init__(self, a):
        self.a = a

    def __dlpack__(self, stream=None):
        return self.a.__dlpack__()

    def __dlpack_device__(self):
        return self.a.__dlpack_device__()


class FakeGpuTensor:
    """An unversioned DLPack capsule of a made-up CUDA tensor, built with
    ctypes (the memory is never touched): checks the stream argument and the
    device, shape and strides read back."""

    _name = b"dltensor"

    def __init__(self, ptr, shape, strides, code=2, bits=16):
        n = len(shape)
        self.shape = (c_int64 * n)(*shape)
        self.strides = (c_int64 * n)(*strides) if strides is not None else None
        self.managed = _DLManagedTensor()
        t = self.managed.dl_tensor
        t.data = ptr
        t.device.device_type, t.device.device_id = 2, 1
        t.ndim = n
        t.dtype.code, t.dtype.bits, t.dtype.lanes = code, bits, 1
        t.shape = ctypes.cast(self.shape, POINTER(c_int64))
        t.strides = ctypes.cast(self.strides, POINTER(c_int64)) if self.strides else None
        t.byte_offset = 64
        self.streams = []

    def __dlpack_device__(self):
        return (2, 1)

    def __dlpack__(self, stream=None):
        self.streams.append(stream)
        return pythonapi_capsule_new(ctypes.addressof(self.managed), self._name, None)


class ArrayInterfaceOnly:
    def __init__(self, a):
        self.a = a
        self.__array_interface__ = a.__array_interface__


def test_numpy_through_versioned_dlpack():
    a = np.arange(24, dtype=np.float16).reshape(2, 3, 4).transpose(0, 2, 1)
    v = as_buffer(a, "x")
    assert v.source == "dlpack"
    assert "dltensor_versioned" in repr(v.keep[1])
    assert (v.ptr, v.shape, v.strides, v.itemsize) == (a.ctypes.data, a.shape, a.strides, 2)
    assert (v.dtype, v.kind, v.device, v.readonly) == ("float16", "f", "cpu", False)
    assert not v.contiguous and v.nbytes == a.nbytes


def test_unversioned_dlpack_and_the_array_interface_agree():
    a = np.arange(60, dtype=np.int32).reshape(3, 4, 5)[:, ::2, 1:]
    views = [as_buffer(x, "x") for x in (a, Unversioned(a), ArrayInterfaceOnly(a))]
    assert [v.source for v in views] == ["dlpack", "dlpack", "array_interface"]
    assert '"dltensor"' in repr(views[1].keep[1])
    for v in views:
        assert (v.ptr, v.shape, v.strides, v.itemsize, v.kind) == (
            a.ctypes.data, a.shape, a.strides, 4, "i")
        assert v.span == (a.ctypes.data, a.ctypes.data + 2 * 80 + 1 * 40 + 3 * 4 + 4)


def test_read_only_dlpack_is_flagged():
    a = np.zeros(16, np.uint8)
    a.flags.writeable = False
    assert as_buffer(a, "x").readonly


def test_a_gpu_dlpack_producer_gets_no_synchronization_request():
    t = FakeGpuTensor(0x7000_0000, (2, 8, 16), None, code=4, bits=16)
    v = as_buffer(t, "x")
    assert t.streams == [-1]  # no sync: the caller orders work on its stream
    assert (v.device, v.device_index, v.dtype) == ("cuda", 1, "bfloat16")
    assert v.ptr == 0x7000_0000 + 64
    assert v.strides == (256, 32, 2)  # NULL strides: compact row-major
    t2 = FakeGpuTensor(0x8000_0000, (4, 4), (1, 4), code=10, bits=8)
    v2 = as_buffer(t2, "x")
    assert (v2.dtype, v2.strides, v2.itemsize) == ("float8_e4m3fn", (1, 4), 1)


def test_cuda_array_interface_strides_are_bytes():
    class Cai:
        __cuda_array_interface__ = {"shape": (4, 8), "typestr": "<f2", "data": (0x1000, True),
                                    "strides": (2, 8), "version": 3}

    v = as_buffer(Cai(), "x")
    assert (v.device, v.strides, v.readonly, v.itemsize) == ("cuda", (2, 8), True, 2)
    masked = {"shape": (4,), "typestr": "|u1", "data": (0x1000, False), "mask": object(),
              "version": 3}
    with pytest.raises(KvferryError, match="masked"):
        as_buffer(type("M", (), {"__cuda_array_interface__": masked})(), "x")


def test_python_buffer_protocol():
    raw = bytearray(range(100))
    mm = mmap.mmap(-1, 4096)
    for obj, n, ro in [(raw, 100, False), (bytes(raw), 100, True), (memoryview(raw)[10:30], 20, False),
                       ((ctypes.c_uint16 * 8)(), 16, False), (mm, 4096, False)]:
        v = as_buffer(obj, "x")
        assert v.source == "buffer"
        assert (v.nbytes, v.readonly, v.device) == (n, ro, "cpu"), obj
    assert as_buffer(memoryview(raw)[10:30], "x").ptr == as_buffer(raw, "x").ptr + 10
    assert as_buffer((ctypes.c_uint16 * 8)(), "x").kind == "u"
    # The export is held while the view lives: the bytearray cannot resize.
    v = as_buffer(raw, "x")
    with pytest.raises(BufferError):
        raw.extend(b"x")
    del v
    raw.extend(b"x")
    mm.close()


def test_raw_buffers_and_refusals():
    v = as_buffer((0x1234, 99), "x")
    assert (v.ptr, v.nbytes, v.device) == (0x1234, 99, "unknown")
    v = as_buffer(RawBuffer(0x5000, 10, device="cuda", device_index=3), "x")
    assert (v.where, v.nbytes) == ("cuda:3", 10)
    with pytest.raises(KvferryError, match="bare pointer has no length") as e:
        as_buffer(0x1234, "objects[2]")
    assert e.value.field == "objects[2]"
    with pytest.raises(KvferryError, match="is not a buffer") as e:
        as_buffer("text", "region_bases[1]")
    assert e.value.field == "region_bases[1]"
    with pytest.raises(KvferryError):
        RawBuffer(-1, 4)


def test_streams():
    class NewStyle:
        def __cuda_stream__(self):
            return (0, 0xABC)

    class Attribute:
        __cuda_stream__ = (0, 0xDEF)

    class TorchLike:
        cuda_stream = 0x123

    assert stream_handle(None) == 0
    assert stream_handle(7) == 7
    assert stream_handle(NewStyle()) == 0xABC
    assert stream_handle(Attribute()) == 0xDEF
    assert stream_handle(TorchLike()) == 0x123
    assert stream_handle(c_void_p(0x55)) == 0x55
    for bad in (-2, False, "s", object()):
        with pytest.raises(KvferryError) as e:
            stream_handle(bad)
        assert e.value.field == "stream"

    class Broken:
        def __cuda_stream__(self):
            return 5

    with pytest.raises(KvferryError, match="not \\(version, handle\\)"):
        stream_handle(Broken())


def _ids(x):
    ptr, n, keep = block_ids(x, "blocks[0]")
    return [ptr[i] for i in range(n)], keep


def test_block_ids_from_every_kind_of_table():
    skip = kvferry.BLOCK_SKIP
    assert _ids([1, None, -1, 4])[0] == [1, skip, skip, 4]
    assert _ids((i for i in (3, 2)))[0] == [3, 2]
    assert _ids(np.array([5, -1, 7], np.int64))[0] == [5, skip, 7]
    assert _ids(np.array([5, 6], np.uint64))[0] == [5, 6]
    assert _ids(np.array([0, 9, 1, 9], np.int16)[::2])[0] == [0, 1]
    assert _ids(Unversioned(np.array([8, -1], np.int32)))[0] == [8, skip]  # no numpy path
    assert _ids(ArrayInterfaceOnly(np.array([2, 3], np.uint8)))[0] == [2, 3]
    assert _ids(None)[0] == []
    ids, keep = _ids(np.array([1, 2], np.int32))
    assert keep.dtype == np.uint32 and keep.flags.c_contiguous


def test_block_ids_on_a_gpu_are_refused():
    t = FakeGpuTensor(0x9000_0000, (4,), None, code=0, bits=32)
    with pytest.raises(KvferryError, match="must be in host memory") as e:
        block_ids(t, "blocks['full']")
    assert e.value.field == "blocks['full']"


def test_sub_byte_dtypes_have_no_itemsize():
    t = FakeGpuTensor(0x9000_0000, (4, 8), None, code=17, bits=4)
    v = as_buffer(t, "x")
    assert v.itemsize == 0 and v.dtype == "float4_e2m1fn"
    with pytest.raises(KvferryError, match="whole-byte element type"):
        kvferry.from_tensors([kvferry.TensorGroup([t], "blocks,head_size")])



def test_a_producer_that_refuses_every_protocol_is_reported_whole():
    class RequiresGrad:  # what a torch tensor that requires grad does
        def __dlpack__(self, **kwargs):
            raise RuntimeError("Can't export tensors that require gradient")

        @property
        def __cuda_array_interface__(self):
            raise RuntimeError("Can't get __cuda_array_interface__ on Variable that requires grad")

    with pytest.raises(KvferryError) as e:
        as_buffer(RequiresGrad(), "objects[0]")
    assert e.value.field == "objects[0]"
    assert "require gradient" in e.value.message and "requires grad" in e.value.message
