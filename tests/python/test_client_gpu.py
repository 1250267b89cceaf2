"""kvferry.client with a GPU engine, against a real kvferryd serving the GPU.

The engine's KV cache lives in exportable cuMem memory made by kvferry
(kvferry.Allocation, provider cumem); CUDA is reached through ctypes only
(tests/python/cudart.py, no torch). Each test fills the cache from host
bytes, registers it with kvferryd (device = the GPU), STOREs some blocks,
RETRIEVEs them into other blocks, copies the whole cache back and checks it
to the byte against host copies, two ways: every byte of each retrieved
block equals the byte of its source block (strided views written from the
geometry's view fields), and the whole cache equals the host model (the
CPU reference gather of the source blocks scattered into a host copy), so a
stray write anywhere fails too.

Skipped, with the reason, without a GPU (conftest's gpu fixture) or without
the kvferryd binary. On a GPU machine: tests/gpu/run_python_served_gpu.sh.
Environment: KVF_TEST_DEVICE (default 0), KVF_KVFERRYD, KVF_LIBRARY.
KVF_TEST_GPU_EMULATE=1 runs the same tests without a GPU, on the host
backend (memfd memory, memmove for the CUDA copies, the ready-event test
skipped): a dry run of the checks themselves.
"""

import ctypes
import os
from ctypes import byref, c_size_t, c_void_p

import numpy as np
import pytest
from numpy.lib.stride_tricks import as_strided

import served
from conftest import tiny_geometry

import kvferry
from kvferry import client as kc
from kvferry.client import Client, chunk_keys

DEVICE = int(os.environ.get("KVF_TEST_DEVICE", "0"))
EMULATE = os.environ.get("KVF_TEST_GPU_EMULATE") == "1"
PROVIDER = "host" if EMULATE else "cumem"
ENGINE_DEVICE = -1 if EMULATE else DEVICE  # the device the engine registers
H2D, D2H = 1, 2
EVENT_DISABLE_TIMING, EVENT_INTERPROCESS = 0x2, 0x4


# ---- the dry run without a GPU ------------------------------------------------------------

class _HostLib:
    """The few cudart calls these tests make, on host memory."""

    def cudaMemcpy(self, dst, src, n, kind):
        ctypes.memmove(dst, src, n.value if isinstance(n, c_size_t) else n)
        return 0

    def cudaMemcpyAsync(self, dst, src, n, kind, stream):
        return self.cudaMemcpy(dst, src, n, kind)

    def cudaSetDevice(self, device):
        return 0

    def cudaFree(self, ptr):
        return 0


class _HostRuntime:
    device_count = 1

    def __init__(self):
        self.lib = _HostLib()

    def check(self, err, what):
        assert err == 0, what

    def synchronize(self):
        pass


if EMULATE:
    @pytest.fixture
    def gpu():
        return _HostRuntime()


# ---- the engine ------------------------------------------------------------------------

def layout(geometry):
    """(offsets, total bytes): every region in one allocation, each at an
    offset aligned to its align (at least 256)."""
    offsets, off = [], 0
    for r in geometry.regions:
        a = max(int(r.align), 256)
        off = -(-off // a) * a
        offsets.append(off)
        off += int(r.size)
    return offsets, off


class GpuEngine:
    """A geometry's regions in one cumem allocation on DEVICE, with the host
    bytes it was last filled with."""

    def __init__(self, rt, geometry, seed):
        self.rt = rt
        self.geometry = geometry
        self.offsets, self.nbytes = layout(geometry)
        self.alloc = kvferry.Allocation.create(self.nbytes, provider=PROVIDER, device=DEVICE,
                                               name="kv-gpu-test")
        assert self.alloc.size >= self.nbytes
        self.host = np.random.default_rng(seed).integers(0, 256, self.nbytes, dtype=np.uint8)
        self.upload(self.host)

    def regions(self):
        return [(self.alloc, off, int(r.size)) for off, r in zip(self.offsets,
                                                                 self.geometry.regions)]

    def upload(self, data):
        data = np.ascontiguousarray(data, dtype=np.uint8)
        assert data.size == self.nbytes
        self.rt.check(self.rt.lib.cudaMemcpy(c_void_p(self.alloc.ptr), c_void_p(data.ctypes.data),
                                             c_size_t(self.nbytes), H2D), "cudaMemcpy H2D")
        self.rt.synchronize()
        self.host = data.copy()

    def download(self):
        out = np.empty(self.nbytes, np.uint8)
        self.rt.synchronize()
        self.rt.check(self.rt.lib.cudaMemcpy(c_void_p(out.ctypes.data), c_void_p(self.alloc.ptr),
                                             c_size_t(self.nbytes), D2H), "cudaMemcpy D2H")
        return out

    def close(self):
        self.alloc.close()


class HostEngine:
    """The same geometry in a memfd allocation (a host-backend engine)."""

    def __init__(self, geometry, seed):
        self.geometry = geometry
        self.offsets, self.nbytes = layout(geometry)
        self.alloc = kvferry.Allocation.create(self.nbytes, provider="host", name="kv-host-test")
        self.cache = np.asarray(self.alloc)[:self.nbytes]
        self.cache[:] = np.random.default_rng(seed).integers(0, 256, self.nbytes, dtype=np.uint8)

    def regions(self):
        return [(self.alloc, off, int(r.size)) for off, r in zip(self.offsets,
                                                                 self.geometry.regions)]

    def close(self):
        self.cache = None
        self.alloc.close()


# ---- what the bytes must be --------------------------------------------------------------

def block_views(cache, geometry, offsets):
    """{(group, layer, plane): array [num_blocks, block_size, heads, head_bytes]}
    over cache (uint8, 1-D), from the views' byte strides: the bytes of each
    block, as the geometry says the engine lays them out."""
    out = {}
    for gi, group in enumerate(geometry.groups):
        assert group.kind == kvferry.GroupKind.FULL, "these tests use full-attention groups"
        for layer, view in enumerate(geometry.views(gi)):
            for p in range(view.planes):
                base = offsets[view.region] + view.offset + p * view.plane_stride
                out[(gi, layer, p)] = as_strided(
                    cache[base:], shape=(group.num_blocks, group.block_size, view.heads,
                                         view.head_bytes[p]),
                    strides=(view.block_stride, view.token_stride, view.head_stride, 1),
                    writeable=False)
    return out


def check_blocks_moved(before, after, geometry, offsets, src, dst):
    """Every byte of block dst[i] after equals block src[i] before."""
    b, a = block_views(before, geometry, offsets), block_views(after, geometry, offsets)
    bad = []
    for key in b:
        for s, d in zip(src, dst):
            if not np.array_equal(a[key][d], b[key][s]):
                n = int(np.count_nonzero(a[key][d] != b[key][s]))
                bad.append("group %d layer %d plane %d: block %d (from %d): %d bytes differ"
                           % (key + (d, s, n)))
    assert not bad, "%d block images differ, first: %s" % (len(bad), "; ".join(bad[:8]))


def aligned_copy(data, align=4096):
    """A copy of a uint8 array whose first byte is aligned (the reference
    copies check region bases against the regions' alignment)."""
    data = np.asarray(data, dtype=np.uint8)
    raw = np.empty(data.size + align, np.uint8)
    skip = -raw.ctypes.data % align
    out = raw[skip:skip + data.size]
    out[:] = data
    return out


def model_after_retrieve(before, geometry, offsets, token_begin, token_end, src, dst,
                         receiver=None):
    """The host model: the reference gather of src from `before` (the
    sender's bytes), scattered at dst into a copy of `receiver` (the
    receiver's bytes before the RETRIEVE; default `before`: the same engine)
    (kvferry.reference_gather/scatter)."""
    C = geometry.policy.chunk_tokens
    nog = geometry.num_object_groups
    chunks = geometry.num_chunks(token_begin, token_end)
    objects = [np.zeros(geometry.object_size(og, token_begin // C + k, token_end), np.uint8)
               for k in range(chunks) for og in range(nog)]
    before = aligned_copy(before)
    src_bases = [before[off:off + r.size] for off, r in zip(offsets, geometry.regions)]
    kvferry.reference_gather(kvferry.CopyRequest(geometry, token_begin, token_end, blocks=[src],
                                                 objects=objects, region_bases=src_bases))
    model = aligned_copy(before if receiver is None else receiver)
    dst_bases = [model[off:off + r.size] for off, r in zip(offsets, geometry.regions)]
    kvferry.reference_scatter(kvferry.CopyRequest(geometry, token_begin, token_end, blocks=[dst],
                                                  objects=objects, region_bases=dst_bases))
    return model


def assert_equal_bytes(got, want, what):
    if np.array_equal(got, want):
        return
    diff = np.flatnonzero(got != want)
    raise AssertionError("%s: %d of %d bytes differ; first at byte %d (got %d, want %d), last at "
                         "%d" % (what, diff.size, want.size, diff[0], got[diff[0]], want[diff[0]],
                                 diff[-1]))


def keys_for(geometry, tokens, salt):
    return chunk_keys(kc.chunk_seed(b"gpu-test|%s" % salt.encode()), tokens,
                      chunk_tokens=geometry.policy.chunk_tokens)


def blocks_for(geometry, tokens, seed):
    """(src, dst): disjoint, shuffled block tables of the tokens' blocks."""
    group = geometry.groups[0]
    n = -(-tokens // group.block_size)
    assert 2 * n <= group.num_blocks, (n, group.num_blocks)
    perm = np.random.default_rng(seed).permutation(group.num_blocks)
    return [int(x) for x in perm[:n]], [int(x) for x in perm[n:2 * n]]


# ---- fixtures --------------------------------------------------------------------------

@pytest.fixture
def gpu_server(gpu, tmp_path):
    if gpu.device_count <= DEVICE:
        pytest.skip("KVF_TEST_DEVICE=%d, but %d GPUs are visible" % (DEVICE, gpu.device_count))
    gpu.check(gpu.lib.cudaSetDevice(DEVICE), "cudaSetDevice")
    gpu.check(gpu.lib.cudaFree(c_void_p(0)), "cudaFree(0): the primary context")
    try:
        kvferry.mem_granularity(PROVIDER, DEVICE)
    except kvferry.KvferryError as exc:
        pytest.fail("cumem memory is not available on device %d: %s" % (DEVICE, exc))
    devices = "none" if EMULATE else str(DEVICE)
    with served.factory(tmp_path, devices=devices, l1_mb=256 if EMULATE else 1024) as start:
        server = start()
        yield server
        print("kvferryd log tail:\n" + server.log_text(2000))


@pytest.fixture
def gpu_server_1ms(gpu, tmp_path):
    """kvferryd with a request timeout of 1 ms: a GPU RETRIEVE of tens of MiB
    is reported timed out while its copy still runs (host-lane requests are
    never timed out: they have no event to wait for)."""
    if gpu.device_count <= DEVICE:
        pytest.skip("KVF_TEST_DEVICE=%d, but %d GPUs are visible" % (DEVICE, gpu.device_count))
    gpu.check(gpu.lib.cudaSetDevice(DEVICE), "cudaSetDevice")
    gpu.check(gpu.lib.cudaFree(c_void_p(0)), "cudaFree(0): the primary context")
    devices = "none" if EMULATE else str(DEVICE)
    with served.factory(tmp_path, devices=devices, l1_mb=256 if EMULATE else 1024) as start:
        server = start("--request-timeout-ms", "1", "--host-l1-mb", "512")
        yield server
        print("kvferryd log tail:\n" + server.log_text(2000))


GEOMETRIES = [
    pytest.param(lambda: tiny_geometry(num_blocks=64, chunk_tokens=8)[0], 64, id="tiny"),
    pytest.param(lambda: kvferry.Geometry.preset("llama-3.1-8b-fa-hnd", num_blocks=64), 512,
                 id="llama-3.1-8b-fa-hnd"),
    pytest.param(lambda: kvferry.Geometry.preset("llama-3.1-8b-crosslayer-fa-nhd", num_blocks=64),
                 512, id="llama-3.1-8b-crosslayer-fa-nhd"),
    pytest.param(lambda: kvferry.Geometry.preset("deepseek-v3-mla-bf16", num_blocks=16), 512,
                 id="deepseek-v3-mla-bf16"),
]


# ---- the tests -------------------------------------------------------------------------

@pytest.mark.parametrize("make, tokens", GEOMETRIES)
def test_gpu_store_then_retrieve_into_other_blocks(gpu, gpu_server, make, tokens):
    geometry = make()
    engine = GpuEngine(gpu, geometry, seed=11)
    try:
        src, dst = blocks_for(geometry, tokens, seed=5)
        keys = keys_for(geometry, list(range(7, 7 + tokens)), geometry.name)
        chunks = geometry.num_chunks(0, tokens)
        nog = geometry.num_object_groups
        with Client.connect(gpu_server.socket_dir, name="gpu-engine", timeout_ms=60000) as c:
            reg = c.register(geometry, engine.regions(), device=ENGINE_DEVICE)
            assert reg.imports == 1, reg
            assert reg.fingerprint == geometry.fingerprint("canonical"), reg
            r = c.store(0, tokens, keys, [src])
            assert r.done and r.prefix_tokens == tokens, r
            assert (r.objects_done, r.objects_present) == (chunks * nog, 0), r
            # The STORE read the cache and wrote nothing into it.
            assert_equal_bytes(engine.download(), engine.host, "the cache after the STORE")
            r = c.retrieve(0, tokens, keys, [np.array(dst, dtype=np.int64)])
            assert r.done and r.prefix_tokens == tokens and r.objects_done == chunks * nog, r
            after = engine.download()
            check_blocks_moved(engine.host, after, geometry, engine.offsets, src, dst)
            want = model_after_retrieve(engine.host, geometry, engine.offsets, 0, tokens, src, dst)
            assert_equal_bytes(after, want, "the cache after the RETRIEVE")
            again = c.store(0, tokens, keys, [src])
            assert again.done and again.objects_present == chunks * nog and \
                again.objects_done == 0, again
            s = c.stat()  # (in_flight may still count the last request: it retires after its reply)
            assert s.lanes >= (1 if EMULATE else 2) and s.l1_objects >= chunks * nog, s
            c.unregister()
    finally:
        engine.close()
        geometry.close()


def test_gpu_many_in_flight(gpu, gpu_server):
    """Eight STOREs in flight, then eight RETRIEVEs in flight, each its own
    sequence and blocks; the whole cache checked against the host model."""
    geometry = tiny_geometry(num_blocks=64, chunk_tokens=8)[0]
    engine = GpuEngine(gpu, geometry, seed=12)
    try:
        perm = [int(x) for x in np.random.default_rng(3).permutation(64)]
        seqs = [(list(range(100 * i, 100 * i + 16)), perm[4 * i:4 * i + 4],
                 perm[32 + 4 * i:32 + 4 * i + 4]) for i in range(8)]
        with Client.connect(gpu_server.socket_dir, name="gpu-many", timeout_ms=60000) as c:
            c.register(geometry, engine.regions(), device=ENGINE_DEVICE)
            keys = [keys_for(geometry, t, "many") for t, _, _ in seqs]
            ids = [c.submit("store", 0, 16, k, [s]) for k, (_, s, _) in zip(keys, seqs)]
            for rid in ids:
                r = c.wait(rid)
                assert r.done and r.prefix_tokens == 16, r
            ids = [c.submit("retrieve", 0, 16, k, [d]) for k, (_, _, d) in zip(keys, seqs)]
            for rid in ids:
                r = c.wait(rid)
                assert r.done and r.prefix_tokens == 16, r
            after = engine.download()
            src = [b for _, s, _ in seqs for b in s]
            dst = [b for _, _, d in seqs for b in d]
            check_blocks_moved(engine.host, after, geometry, engine.offsets, src, dst)
            want = engine.host.copy()
            for _, s, d in seqs:
                want = model_after_retrieve(want, geometry, engine.offsets, 0, 16, s, d)
            assert_equal_bytes(after, want, "the cache after eight RETRIEVEs")
    finally:
        engine.close()
        geometry.close()


def test_gpu_store_waits_for_the_ready_event(gpu, gpu_server):
    """The blocks are written on a stream (junk eight times, then the final
    bytes) and the STORE is sent at once with an interprocess event recorded
    after the writes: the server's copy must wait for it and store the final
    bytes."""
    if EMULATE:
        pytest.skip("needs a GPU: a ready event is a CUDA interprocess event")
    geometry = kvferry.Geometry.preset("llama-3.1-8b-fa-hnd", num_blocks=64)
    engine = GpuEngine(gpu, geometry, seed=13)
    lib = gpu.lib
    stream = gpu.stream()
    junk = gpu.pinned(engine.nbytes)
    final = gpu.pinned(engine.nbytes)
    event = c_void_p()
    try:
        rng = np.random.default_rng(14)
        np.frombuffer(junk.array, np.uint8)[:] = rng.integers(0, 256, engine.nbytes, np.uint8)
        new = rng.integers(0, 256, engine.nbytes, dtype=np.uint8)
        np.frombuffer(final.array, np.uint8)[:] = new
        gpu.check(lib.cudaEventCreateWithFlags(byref(event), EVENT_DISABLE_TIMING |
                                               EVENT_INTERPROCESS), "cudaEventCreateWithFlags")
        handle = (ctypes.c_char * 64)()
        gpu.check(lib.cudaIpcGetEventHandle(byref(handle), event), "cudaIpcGetEventHandle")
        tokens = 512
        src, dst = blocks_for(geometry, tokens, seed=6)
        keys = keys_for(geometry, list(range(tokens)), "ready-event")
        with Client.connect(gpu_server.socket_dir, name="gpu-event", timeout_ms=60000) as c:
            c.register(geometry, engine.regions(), device=ENGINE_DEVICE)
            for _ in range(8):
                gpu.check(lib.cudaMemcpyAsync(c_void_p(engine.alloc.ptr), c_void_p(junk.ptr),
                                              c_size_t(engine.nbytes), H2D,
                                              c_void_p(stream.handle)), "cudaMemcpyAsync")
            gpu.check(lib.cudaMemcpyAsync(c_void_p(engine.alloc.ptr), c_void_p(final.ptr),
                                          c_size_t(engine.nbytes), H2D, c_void_p(stream.handle)),
                      "cudaMemcpyAsync")
            gpu.check(lib.cudaEventRecord(event, c_void_p(stream.handle)), "cudaEventRecord")
            r = c.store(0, tokens, keys, [src], ready_event=bytes(handle))
            assert r.done and r.prefix_tokens == tokens, r
            stream.synchronize()
            r = c.retrieve(0, tokens, keys, [dst])
            assert r.done and r.prefix_tokens == tokens, r
            after = engine.download()
            check_blocks_moved(new, after, geometry, engine.offsets, src, dst)
            want = model_after_retrieve(new, geometry, engine.offsets, 0, tokens, src, dst)
            assert_equal_bytes(after, want, "the cache after the RETRIEVE")
    finally:
        if event.value:
            lib.cudaEventDestroy(event)
        stream.destroy()
        junk.free()
        final.free()
        engine.close()
        geometry.close()


def test_gpu_store_reuses_the_ready_event(gpu, gpu_server):
    """One event recorded again for each of three STOREs (as the vLLM
    connector does): the server keeps it open across STOREs of the
    registration, and each copy still waits for the latest record, so each
    STORE holds that round's final bytes, never an earlier round's."""
    if EMULATE:
        pytest.skip("needs a GPU: a ready event is a CUDA interprocess event")
    geometry = kvferry.Geometry.preset("llama-3.1-8b-fa-hnd", num_blocks=64)
    engine = GpuEngine(gpu, geometry, seed=15)
    lib = gpu.lib
    stream = gpu.stream()
    junk = gpu.pinned(engine.nbytes)
    final = gpu.pinned(engine.nbytes)
    event = c_void_p()
    try:
        rng = np.random.default_rng(16)
        np.frombuffer(junk.array, np.uint8)[:] = rng.integers(0, 256, engine.nbytes, np.uint8)
        gpu.check(lib.cudaEventCreateWithFlags(byref(event), EVENT_DISABLE_TIMING |
                                               EVENT_INTERPROCESS), "cudaEventCreateWithFlags")
        handle = (ctypes.c_char * 64)()
        gpu.check(lib.cudaIpcGetEventHandle(byref(handle), event), "cudaIpcGetEventHandle")
        tokens = 512
        src, dst = blocks_for(geometry, tokens, seed=7)
        with Client.connect(gpu_server.socket_dir, name="gpu-event-reuse", timeout_ms=60000) as c:
            c.register(geometry, engine.regions(), device=ENGINE_DEVICE)
            for round_ in range(3):
                new = rng.integers(0, 256, engine.nbytes, dtype=np.uint8)
                np.frombuffer(final.array, np.uint8)[:] = new
                keys = keys_for(geometry, list(range(tokens)), "ready-event-reuse-%d" % round_)
                for _ in range(8):
                    gpu.check(lib.cudaMemcpyAsync(c_void_p(engine.alloc.ptr), c_void_p(junk.ptr),
                                                  c_size_t(engine.nbytes), H2D,
                                                  c_void_p(stream.handle)), "cudaMemcpyAsync")
                gpu.check(lib.cudaMemcpyAsync(c_void_p(engine.alloc.ptr), c_void_p(final.ptr),
                                              c_size_t(engine.nbytes), H2D, c_void_p(stream.handle)),
                          "cudaMemcpyAsync")
                gpu.check(lib.cudaEventRecord(event, c_void_p(stream.handle)), "cudaEventRecord")
                r = c.store(0, tokens, keys, [src], ready_event=bytes(handle))
                assert r.done and r.prefix_tokens == tokens, (round_, r)
                stream.synchronize()
                r = c.retrieve(0, tokens, keys, [dst])
                assert r.done and r.prefix_tokens == tokens, (round_, r)
                after = engine.download()
                check_blocks_moved(new, after, geometry, engine.offsets, src, dst)
                want = model_after_retrieve(new, geometry, engine.offsets, 0, tokens, src, dst)
                assert_equal_bytes(after, want, "round %d: the cache after the RETRIEVE" % round_)
    finally:
        if event.value:
            lib.cudaEventDestroy(event)
        stream.destroy()
        junk.free()
        final.free()
        engine.close()
        geometry.close()


@pytest.mark.parametrize("direction", ["host-to-gpu", "gpu-to-host"])
def test_gpu_and_host_engines_share_objects(gpu, gpu_server, direction):
    """One engine stores, an engine of the other kind (same geometry, its own
    client) retrieves the same keys into other blocks: the objects in L1 are
    the same bytes whichever lane wrote them."""
    geometry = kvferry.Geometry.preset("llama-3.1-8b-fa-nhd", num_blocks=64)
    tokens = 512
    g_engine = GpuEngine(gpu, geometry, seed=21)
    h_engine = HostEngine(geometry, seed=22)
    try:
        src, dst = blocks_for(geometry, tokens, seed=7)
        keys = keys_for(geometry, list(range(3, 3 + tokens)), "cross-" + direction)
        with Client.connect(gpu_server.socket_dir, name="gpu-side", timeout_ms=60000) as cg, \
                Client.connect(gpu_server.socket_dir, name="host-side", timeout_ms=60000) as ch:
            cg.register(geometry, g_engine.regions(), device=ENGINE_DEVICE)
            ch.register(geometry, h_engine.regions(), device=-1)
            if direction == "host-to-gpu":
                sender, receiver = ch, cg
                sent, receiver_before = h_engine.cache.copy(), g_engine.host.copy()
            else:
                sender, receiver = cg, ch
                sent, receiver_before = g_engine.host.copy(), h_engine.cache.copy()
            r = sender.store(0, tokens, keys, [src])
            assert r.done and r.prefix_tokens == tokens, r
            r = receiver.retrieve(0, tokens, keys, [dst])
            assert r.done and r.prefix_tokens == tokens, r
            after = g_engine.download() if direction == "host-to-gpu" else h_engine.cache.copy()
            check_blocks_moved(sent, after, geometry, g_engine.offsets, src, dst)
            want = model_after_retrieve(sent, geometry, g_engine.offsets, 0, tokens, src, dst,
                                        receiver=receiver_before)
            assert_equal_bytes(after, want, "the receiver's cache after the RETRIEVE")
    finally:
        g_engine.close()
        h_engine.close()
        geometry.close()


@pytest.mark.skipif(not kc.has_lookup(), reason="this libkvferry has no kvf_client_lookup / "
                    "kvf_client_wait_retired (i13-lookup not merged)")
def test_gpu_timed_out_retrieve_is_retired_and_its_bytes_are_whole(gpu, gpu_server_1ms):
    """A host engine stores 64 MiB (the host lane never times out); a GPU
    engine LOOKUPs it with a pin, then RETRIEVEs it under a 1 ms request
    timeout: the reply may come TIMED_OUT while the copy runs. Once
    wait_retired returns, the blocks must hold every byte, and the whole cache
    must match the host model; then a second RETRIEVE of the same blocks
    (after the retirement) gives the same bytes."""
    geometry = kvferry.Geometry.preset("llama-3.1-8b-fa-hnd", num_blocks=64)
    tokens = 512
    g_engine = GpuEngine(gpu, geometry, seed=31)
    h_engine = HostEngine(geometry, seed=32)
    try:
        src, dst = blocks_for(geometry, tokens, seed=8)
        keys = keys_for(geometry, list(range(11, 11 + tokens)), "retired")
        chunks = geometry.num_chunks(0, tokens)
        with Client.connect(gpu_server_1ms.socket_dir, name="gpu-retired", timeout_ms=60000) as cg, \
                Client.connect(gpu_server_1ms.socket_dir, name="host-store", timeout_ms=60000) as ch:
            cg.register(geometry, g_engine.regions(), device=ENGINE_DEVICE)
            ch.register(geometry, h_engine.regions(), device=-1)
            sent, before = h_engine.cache.copy(), g_engine.host.copy()
            r = ch.store(0, tokens, keys, [src])
            assert r.done and r.prefix_tokens == tokens and r.objects_done == chunks, r
            found = cg.lookup(0, tokens, keys, pin_ms=30000)
            assert found.prefix_tokens == tokens and found.object_group_prefix == (tokens,), found
            assert found.pin_id != 0 and found.pinned_chunks == chunks, found
            outcomes = []
            for attempt in range(2):
                rid = cg.submit("retrieve", 0, tokens, keys, [dst])
                r = cg.wait(rid)
                outcomes.append(r.outcome)
                if r.outcome == kc.Outcome.TIMED_OUT:
                    assert r.status == kvferry.Status.TIMEOUT, r
                else:
                    assert r.done and r.prefix_tokens == tokens, r
                cg.wait_retired(rid, 60000)  # at once when it was done
                after = g_engine.download()
                check_blocks_moved(sent, after, geometry, g_engine.offsets, src, dst)
                want = model_after_retrieve(sent, geometry, g_engine.offsets, 0, tokens, src, dst,
                                            receiver=before)
                assert_equal_bytes(after, want, "the GPU cache once retrieve %d retired "
                                   "(outcome %s)" % (attempt, r.outcome))
            print("outcomes under a 1 ms request timeout: %s" % [o.name for o in outcomes])
            cg.unpin(found.pin_id)
    finally:
        g_engine.close()
        h_engine.close()
        geometry.close()
