"""Transfer contexts (kvferry.Transfer): the host backend everywhere, the
CUDA backend where a GPU is visible (skipped with the reason otherwise)."""

import threading
import time

import numpy as np
import pytest

from conftest import tiny_expected, tiny_geometry

import engines
import kvferry
from kvferry import KvferryError, Status


def _cache(nbytes, seed=3):
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def test_host_gather_and_scatter_match_the_reference():
    g, size = tiny_geometry()
    cache = _cache(size)
    ids = [6, 1, 3, 4]
    with kvferry.Transfer(g, host_threads=2) as xfer:
        objects = [np.zeros(g.object_size(0, k, 16), np.uint8) for k in range(2)]
        req = kvferry.CopyRequest(g, 0, 16, blocks=[ids], objects=objects, region_bases=[cache])
        xfer.gather(req)
        assert [o.tobytes() for o in objects] == tiny_expected(cache.tobytes(), 0, 16, ids)
        stats = xfer.last_stats()
        assert stats.route == kvferry.Route.HOST
        assert stats.payload_bytes == sum(o.nbytes for o in objects)
        back = np.zeros(size, np.uint8)
        xfer.scatter(kvferry.CopyRequest(g, 0, 16, blocks=[ids], objects=objects,
                                         region_bases=[back]))
        view = cache.reshape(2, 8, 256)
        assert np.array_equal(back.reshape(2, 8, 256)[:, ids], view[:, ids])
        assert repr(xfer) == "<kvferry.Transfer on host>"
    assert xfer.closed
    xfer.close()  # idempotent
    with pytest.raises(KvferryError) as e:
        xfer.gather(req)
    assert e.value.status == Status.STATE and e.value.field == "transfer context"


def test_flush_on_the_host_backend_returns_at_once():
    g, size = tiny_geometry()
    cache = _cache(size)
    with kvferry.Transfer(g) as xfer:
        objects = [np.zeros(g.object_size(0, k, 16), np.uint8) for k in range(2)]
        xfer.gather(kvferry.CopyRequest(g, 0, 16, blocks=[[6, 1, 3, 4]], objects=objects,
                                        region_bases=[cache]))
        assert xfer.flush() is None
    with pytest.raises(KvferryError) as e:
        xfer.flush()
    assert e.value.status == Status.STATE and e.value.field == "transfer context"


def test_deferred_calls_on_the_host_backend_run_at_once_with_tickets():
    g, size = tiny_geometry()
    cache = _cache(size)
    ids = [6, 1, 3, 4]
    with kvferry.Transfer(g) as xfer:
        with pytest.raises(KvferryError) as e:
            xfer.query(1)
        assert e.value.status == Status.INVALID_ARGUMENT and e.value.field == "ticket"
        objects = [np.zeros(g.object_size(0, k, 16), np.uint8) for k in range(2)]
        req = kvferry.CopyRequest(g, 0, 16, blocks=[ids], objects=objects, region_bases=[cache])
        ticket = xfer.gather_deferred(req)
        assert ticket == 1
        assert [o.tobytes() for o in objects] == tiny_expected(cache.tobytes(), 0, 16, ids)
        assert xfer.query(ticket) is True
        assert xfer.join(ticket) is None
        back = np.zeros(size, np.uint8)
        assert xfer.scatter_deferred(kvferry.CopyRequest(g, 0, 16, blocks=[ids], objects=objects,
                                                         region_bases=[back]), 0) == 2
        view = cache.reshape(2, 8, 256)
        assert np.array_equal(back.reshape(2, 8, 256)[:, ids], view[:, ids])
        xfer.flush()
        for bad in (0, 3, -1, 1 << 64, 1.0, True, "1"):
            with pytest.raises(KvferryError) as e:
                xfer.join(bad)
            assert e.value.status == Status.INVALID_ARGUMENT and e.value.field == "ticket", bad
        # A bad request fails at the call, naming the field, and takes no ticket.
        with pytest.raises(KvferryError) as e:
            xfer.gather_deferred(kvferry.CopyRequest(g, 0, 16, blocks=[[6, 1, 3, 99]], objects=objects,
                                                     region_bases=[cache]))
        assert e.value.field is not None and e.value.field.startswith("groups[0]")
        with pytest.raises(KvferryError) as e:
            xfer.query(3)
        assert e.value.field == "ticket"
    with pytest.raises(KvferryError) as e:
        xfer.gather_deferred(req)
    assert e.value.status == Status.STATE and e.value.field == "transfer context"


def test_a_request_of_another_geometry_is_refused():
    g1, size = tiny_geometry()
    g2, _ = tiny_geometry()
    req = kvferry.CopyRequest(g1, 0, 8, blocks=[[0]], objects=[bytearray(4096)],
                              region_bases=[bytearray(size)])
    with kvferry.Transfer(g2) as xfer, pytest.raises(KvferryError) as e:
        xfer.gather(req)
    assert e.value.field == "request"


def test_the_geometry_outlives_its_contexts():
    g, _ = tiny_geometry()
    xfer = kvferry.Transfer(g)
    with pytest.raises(KvferryError) as e:
        g.close()
    assert e.value.status == Status.STATE
    xfer.close()
    g.close()
    assert g.closed
    with pytest.raises(KvferryError) as e:
        kvferry.Transfer(g)
    assert e.value.status == Status.STATE


def test_host_backend_refuses_device_memory():
    g, size = tiny_geometry()
    req = kvferry.CopyRequest(g, 0, 8, blocks=[[0]], objects=[bytearray(4096)],
                              region_bases=[kvferry.RawBuffer(1 << 20, size, device="cuda",
                                                              device_index=0)])
    with kvferry.Transfer(g) as xfer, pytest.raises(KvferryError) as e:
        xfer.gather(req)
    assert e.value.field == "region_bases[0]"
    assert "cuda:0" in e.value.message


def test_bad_streams_name_the_stream():
    g, size = tiny_geometry()
    req = kvferry.CopyRequest(g, 0, 8, blocks=[[0]], objects=[bytearray(4096)],
                              region_bases=[bytearray(size)])
    with kvferry.Transfer(g) as xfer:
        for stream in ("default", -1, True):
            with pytest.raises(KvferryError) as e:
                xfer.gather(req, stream)
            assert e.value.field == "stream"
        xfer.gather(req, 0)  # the host backend ignores the stream


def test_concurrent_calls_and_close():
    model = engines.build("llama-3.1-8b-fa-nhd")
    engines.fill(model, 5)
    g = model.geometry()
    xfer = kvferry.Transfer(g, host_threads=1)
    errors = []
    size = g.object_size(0, 0, 256)
    want = []

    def work(i):
        try:
            obj = np.zeros(size, np.uint8)
            req = kvferry.CopyRequest(g, 0, 256, blocks=[[(i + k) % 8 for k in range(16)]],
                                      objects=[obj])
            for _ in range(5):
                xfer.gather(req)
            want.append((i, obj))
        except KvferryError as exc:  # a call after close: refused cleanly
            if exc.status != Status.STATE:
                errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    ref = np.zeros(size, np.uint8)
    for i, obj in want:
        kvferry.reference_gather(kvferry.CopyRequest(
            g, 0, 256, blocks=[[(i + k) % 8 for k in range(16)]], objects=[ref]))
        assert np.array_equal(obj, ref)
    closer = threading.Thread(target=xfer.close)
    closer.start()
    closer.join()
    assert xfer.closed
    g.close()


def test_a_device_without_a_gpu_fails_clearly():
    info = kvferry.cuda_probe()
    if info.available:
        pytest.skip("a GPU is visible: the no-GPU failure cannot be seen here")
    g, _ = tiny_geometry()
    with pytest.raises(KvferryError) as e:
        kvferry.Transfer(g, device=0)
    assert e.value.status in (Status.NO_DRIVER, Status.NO_DEVICE, Status.UNSUPPORTED)
    assert e.value.message


# ---- on a GPU ---------------------------------------------------------------------

def _device_cache(gpu, model):
    bufs = []
    for b in model.buffers:
        d = gpu.malloc(b.nbytes)
        d.upload(b.tobytes())
        bufs.append(d)
    return bufs


def test_gpu_gather_scatter_match_the_reference(gpu):
    model = engines.build("glm-like-hybrid")
    engines.fill(model, 11)
    host_geometry = model.geometry()
    req = engines.Request(model, host_geometry, seed=3)
    og_of = [x.object_group for x in host_geometry.groups]
    expected = req.expected(host_geometry.num_object_groups, og_of)
    device = _device_cache(gpu, model)
    # The same tensors' geometry, with the device copies as region bases.
    stream = gpu.stream()
    try:
        with kvferry.Transfer(host_geometry, device=0) as xfer:
            # Device cache -> pinned host objects (d2h), on a __cuda_stream__ stream.
            pinned = [gpu.pinned(max(e.size, 1)) for e in expected]
            for p in pinned:
                p.array[:] = bytes([engines.POISON]) * p.nbytes
            xfer.gather(kvferry.CopyRequest(host_geometry, req.token_begin, req.token_end,
                                            blocks=req.blocks(), objects=[p.array for p in pinned],
                                            region_bases=device), stream)
            stream.synchronize()
            assert xfer.last_stats().route == kvferry.Route.D2H
            for i, (p, e) in enumerate(zip(pinned, expected)):
                assert np.frombuffer(p.array, np.uint8, e.size).tobytes() == e.tobytes(), i
            # Device cache -> device objects (d2d), on an int stream handle.
            dobj = [gpu.malloc(max(e.size, 1)) for e in expected]
            for d, e in zip(dobj, expected):
                d.upload(bytes([engines.POISON]) * d.nbytes)
            xfer.gather(kvferry.CopyRequest(host_geometry, req.token_begin, req.token_end,
                                            blocks=req.blocks(), objects=dobj,
                                            region_bases=device), stream.handle)
            stream.synchronize()
            assert xfer.last_stats().route == kvferry.Route.D2D
            for i, (d, e) in enumerate(zip(dobj, expected)):
                assert d.download()[:e.size] == e.tobytes(), i
            # Device objects -> a poisoned device cache (scatter), legacy stream.
            dst, want = engines.build("glm-like-hybrid"), engines.build("glm-like-hybrid")
            engines.poison(dst, 0x5A)
            engines.poison(want, 0x5A)
            req.copy_moved_rows(model, want)
            ddst = _device_cache(gpu, dst)
            xfer.scatter(kvferry.CopyRequest(host_geometry, req.token_begin, req.token_end,
                                             blocks=req.blocks(), objects=dobj,
                                             region_bases=ddst), None)
            gpu.synchronize()
            for r, (d, w) in enumerate(zip(ddst, want.buffers)):
                assert d.download() == w.tobytes(), "region %d" % r
            for d in dobj + ddst:
                d.free()
            for p in pinned:
                p.free()
    finally:
        stream.destroy()
        for d in device:
            d.free()
        host_geometry.close()


def test_gpu_deferred_gather_and_scatter_match_the_reference(gpu):
    model = engines.build("glm-like-hybrid")
    engines.fill(model, 13)
    g = model.geometry()
    req = engines.Request(model, g, seed=5)
    og_of = [x.object_group for x in g.groups]
    expected = req.expected(g.num_object_groups, og_of)
    device = _device_cache(gpu, model)
    stream = gpu.stream()
    pinned = [gpu.pinned(max(e.size, 1)) for e in expected]
    try:
        with kvferry.Transfer(g, device=0) as xfer:
            for p in pinned:
                p.array[:] = bytes([engines.POISON]) * p.nbytes
            ticket = xfer.gather_deferred(kvferry.CopyRequest(
                g, req.token_begin, req.token_end, blocks=req.blocks(),
                objects=[p.array for p in pinned], region_bases=device), stream)
            assert ticket == 1
            deadline = time.monotonic() + 30
            while not xfer.query(ticket):  # the host polls; no stream waits
                assert time.monotonic() < deadline, "deferred call 1 never completed"
            for i, (p, e) in enumerate(zip(pinned, expected)):
                assert np.frombuffer(p.array, np.uint8, e.size).tobytes() == e.tobytes(), i
            # Back into a poisoned device cache, joined into the stream.
            dst, want = engines.build("glm-like-hybrid"), engines.build("glm-like-hybrid")
            engines.poison(dst, 0x5A)
            engines.poison(want, 0x5A)
            req.copy_moved_rows(model, want)
            ddst = _device_cache(gpu, dst)
            ticket = xfer.scatter_deferred(kvferry.CopyRequest(
                g, req.token_begin, req.token_end, blocks=req.blocks(),
                objects=[p.array for p in pinned], region_bases=ddst), stream)
            assert ticket == 2
            xfer.join(ticket, stream)
            stream.synchronize()
            for r, (d, w) in enumerate(zip(ddst, want.buffers)):
                assert d.download() == w.tobytes(), "region %d" % r
            xfer.flush()
            with pytest.raises(KvferryError) as e:
                xfer.join(3, stream)
            assert e.value.field == "ticket"
            for d in ddst:
                d.free()
    finally:
        for p in pinned:
            p.free()
        stream.destroy()
        for d in device:
            d.free()
        g.close()


def test_gpu_geometry_from_device_tensors(gpu):
    # Device buffers seen through __cuda_array_interface__, viewed as the
    # engine's tensors: the geometry's bases are device memory.
    nb, bs, h, d = 8, 16, 2, 64
    nbytes = 2 * nb * bs * h * d * 2
    buf = gpu.malloc(nbytes)
    host = _cache(nbytes, 9)
    buf.upload(host.tobytes())

    class Tensor:  # a (2, NB, BS, H, D) bf16 view of buf, FlashAttention NHD
        __cuda_array_interface__ = {"shape": (2, nb, bs, h, d), "typestr": "<V2",
                                    "data": (buf.ptr, False), "strides": None, "version": 3}

    try:
        with kvferry.from_tensors([kvferry.TensorGroup([Tensor()], kvferry.VLLM_FLASH_ATTN)],
                                  chunk_tokens=32) as g, kvferry.Transfer(g, device=0) as xfer:
            assert g.bases[0].device == "cuda"
            obj = gpu.pinned(g.object_size(0, 0, 32))
            xfer.gather(kvferry.CopyRequest(g, 0, 32, blocks=[[5, 2]], objects=[obj.array]))
            gpu.synchronize()
            ref = np.zeros(obj.nbytes, np.uint8)
            hg = kvferry.from_tensors([kvferry.TensorGroup(
                [host.view(np.uint16).reshape(2, nb, bs, h, d)], kvferry.VLLM_FLASH_ATTN)],
                chunk_tokens=32)
            kvferry.reference_gather(kvferry.CopyRequest(hg, 0, 32, blocks=[[5, 2]], objects=[ref]))
            hg.close()
            assert bytes(obj.array) == ref.tobytes()
            obj.free()
    finally:
        buf.free()


def test_gpu_max_sms_caps_the_launch(gpu):
    model = engines.build("llama-3.1-8b-fa-nhd")
    g = model.geometry()
    device = _device_cache(gpu, model)
    try:
        with kvferry.Transfer(g, device=0, max_sms=2) as xfer:
            obj = gpu.malloc(g.object_size(0, 0, 256))
            xfer.gather(kvferry.CopyRequest(g, 0, 256, blocks=[list(range(8)) * 2], objects=[obj],
                                            region_bases=device))
            gpu.synchronize()
            assert 0 < xfer.last_stats().sms <= 2
            obj.free()
    finally:
        for d in device:
            d.free()
        g.close()


def test_an_unclosed_context_releases_its_geometry_when_dropped():
    g, _ = tiny_geometry()
    xfer = kvferry.Transfer(g)
    del xfer  # no reference cycle: freed at once, the geometry no longer held
    g.close()
    assert g.closed


def test_closing_a_geometry_races_no_context_creation():
    # Either the context is created first (close refuses) or the geometry is
    # closed first (creation refuses): never a context on a freed geometry.
    for _ in range(50):
        g, _ = tiny_geometry()
        made, refused = [], []

        def create():
            try:
                made.append(kvferry.Transfer(g))
            except KvferryError as exc:
                refused.append(exc.status)

        t = threading.Thread(target=create)
        t.start()
        try:
            g.close()
            closed = True
        except KvferryError as exc:
            assert exc.status == Status.STATE
            closed = False
        t.join()
        if closed:
            assert not made and refused == [Status.STATE]
        else:
            assert len(made) == 1
            made[0].close()
            g.close()
