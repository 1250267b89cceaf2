"""Exportable allocations, identities and the instance (kvferry.memory)."""

import ctypes
import os
import stat

import numpy as np
import pytest

from conftest import tiny_expected, tiny_geometry

import cudart

import kvferry
from kvferry import Allocation, KvferryError, MemIdentity, MemProvider, Status


def test_host_allocation_export_and_identity():
    page = kvferry.mem_granularity("host")
    assert page == os.sysconf("SC_PAGE_SIZE")
    with Allocation.create(page + 1, name="kv-pool") as a:
        assert a.size == 2 * page and a.ptr and a.provider == MemProvider.HOST
        ident = a.identity
        instance, generation = kvferry.mem_instance()
        assert (ident.instance_id, ident.generation) == (instance, generation)
        assert ident.size == a.size and ident.provider == MemProvider.HOST
        assert ident.device_uuid == bytes(16)
        assert len(bytes(ident)) == 64 and MemIdentity.from_bytes(bytes(ident)) == ident
        assert str(ident).startswith("host:")
        fd, exported = a.export()
        try:
            assert exported == ident
            assert stat.S_ISREG(os.fstat(fd).st_mode)
            assert os.fstat(fd).st_size == a.size
            assert not os.get_inheritable(fd)  # close-on-exec
        finally:
            os.close(fd)
        # Found again under any interior pointer: same allocation, same identity.
        with Allocation.find(a.ptr + 100, provider="host") as again:
            assert again.identity == ident and again.ptr == a.ptr
        # Host memory is a numpy array away, and zero to start with.
        view = np.asarray(a)
        assert view.shape == (a.size,) and not view.any()
        assert not hasattr(a, "__cuda_array_interface__")
    assert a.closed
    a.close()
    assert repr(a) == "<kvferry.Allocation (closed)>"
    with pytest.raises(KvferryError) as e:
        a.export()
    assert e.value.status == Status.STATE


def test_an_allocation_is_a_region_base():
    g, size = tiny_geometry()
    with Allocation.create(size) as a:
        cache = np.asarray(a)
        cache[:] = np.random.default_rng(2).integers(0, 256, a.size, dtype=np.uint8)
        obj = bytearray(g.object_size(0, 0, 8))
        kvferry.reference_gather(kvferry.CopyRequest(g, 0, 8, blocks=[[3, 6]], objects=[obj],
                                                     region_bases=[a]))
        assert bytes(obj) == tiny_expected(cache.tobytes(), 0, 8, [3, 6])[0]
    g.close()


def test_find_refuses_what_it_does_not_hold():
    buf = bytearray(4096)
    with pytest.raises(KvferryError) as e:
        Allocation.find(buf, provider="host")
    assert e.value.status == Status.INVALID_ARGUMENT
    with pytest.raises(KvferryError) as e:
        Allocation.find(0, provider="host")
    assert e.value.status == Status.INVALID_ARGUMENT
    with pytest.raises(KvferryError) as e:
        Allocation.create(4096, provider="disk")
    assert e.value.field == "provider"
    with pytest.raises(KvferryError) as e:
        Allocation.create(0)
    assert e.value.status == Status.INVALID_ARGUMENT
    with pytest.raises(KvferryError) as e:
        kvferry.device_from_uuid(b"short")
    assert e.value.field == "uuid"


def test_instance_and_generation():
    old = kvferry.mem_instance()
    try:
        kvferry.set_mem_instance(0x1234, 7)
        assert kvferry.mem_instance() == (0x1234, 7)
        with Allocation.create(1) as a:
            assert (a.identity.instance_id, a.identity.generation) == (0x1234, 7)
        kvferry.set_mem_instance(0, 1)  # 0: a new random id
        assert kvferry.mem_instance()[0] not in (0, 0x1234)
    finally:
        kvferry.set_mem_instance(*old)


def test_cumem_without_a_gpu_fails_clearly():
    if kvferry.cuda_probe().available:
        pytest.skip("a GPU is visible: the no-GPU failure cannot be seen here")
    with pytest.raises(KvferryError) as e:
        Allocation.create(1 << 21, provider="cumem")
    assert e.value.status in (Status.NO_DRIVER, Status.NO_DEVICE, Status.UNSUPPORTED)
    with pytest.raises(KvferryError) as e:
        kvferry.mem_granularity("cumem", 0)
    assert e.value.status in (Status.NO_DRIVER, Status.NO_DEVICE, Status.UNSUPPORTED)


# ---- on a GPU ---------------------------------------------------------------------

def test_gpu_cumem_allocation(gpu):
    gran = kvferry.mem_granularity("cumem", 0)
    assert gran >= 1 << 21 and gran & (gran - 1) == 0
    with Allocation.create(gran + 1, provider=MemProvider.CUMEM, device=0) as a:
        assert a.size == 2 * gran
        ident = a.identity
        assert ident.provider == MemProvider.CUMEM and ident.device_uuid != bytes(16)
        assert kvferry.device_from_uuid(ident.device_uuid) == 0
        fd, exported = a.export()
        os.close(fd)
        assert exported == ident
        # The allocation under an interior pointer, found again (same identity).
        with Allocation.find(a.ptr + 4096) as found:
            assert found.identity == ident
        assert a.__cuda_array_interface__["data"][0] == a.ptr
        assert not hasattr(a, "__array_interface__")
        # A kernel reads and writes it: a transfer with it as the cache.
        g, size = tiny_geometry()
        host = np.random.default_rng(4).integers(0, 256, size, dtype=np.uint8)
        dev = gpu.malloc(size)
        dev.upload(host.tobytes())
        gpu.check(gpu.lib.cudaMemcpy(ctypes.c_void_p(a.ptr), ctypes.c_void_p(dev.ptr),
                                     ctypes.c_size_t(size), cudart.D2D), "cudaMemcpy D2D")
        obj = gpu.pinned(g.object_size(0, 0, 8))
        with kvferry.Transfer(g, device=0) as xfer:
            xfer.gather(kvferry.CopyRequest(g, 0, 8, blocks=[[1, 5]], objects=[obj.array],
                                            region_bases=[a]))
        gpu.synchronize()
        assert bytes(obj.array) == tiny_expected(host.tobytes(), 0, 8, [1, 5])[0]
        obj.free()
        dev.free()
        g.close()


def test_gpu_cudamalloc_memory_cannot_be_exported(gpu):
    d = gpu.malloc(1 << 20)
    try:
        with pytest.raises(KvferryError) as e:
            Allocation.find(d)
        assert e.value.status == Status.UNSUPPORTED
        assert e.value.message
    finally:
        d.free()
