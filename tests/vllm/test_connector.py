"""KvferryConnector (kvferry.vllm.connector) against the real vLLM package and
a real kvferryd, on the CPU.

vLLM's own Scheduler and connector factory drive the connector (engine.py,
in the model runner's order); the KV cache is vLLM's layout over kvferry
host memory (host_kv_caches: a sealed memfd kvferryd imports), so kvferryd's
host backend gathers and scatters the engine's real blocks. The tests store
a prompt, poison the KV cache and reset vLLM's prefix cache, and check that
the same prompt hits (LOOKUP), loads (RETRIEVE) into other blocks and holds
the stored bytes; that a failed load is reported and recomputed; that the
connector reconnects and registers again after kvferryd restarts; and that a
new engine (new connector instances, the same kvferryd) finds the objects.
"""

import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

from engine import POISON, Engine, attention_specs, expected_block  # noqa: E402

import kvferry  # noqa: E402
import served  # noqa: E402  (tests/python/served.py: kvferryd processes)
from kvferry import client as kvc  # noqa: E402

C = 32           # tokens per kvferry chunk: two vLLM blocks of 16
BS = 16

@pytest.fixture
def kvferryd(tmp_path):
    with served.factory(tmp_path) as start:
        yield start


def retrieves(loads, queries):
    """kvferryd's RETRIEVE count: without LOOKUP in the library the hit
    queries are RETRIEVEs too (kvferry.vllm.connector._Scheduler.query)."""
    return loads + (0 if kvc.has_lookup() else queries)


def transfer(server, **extra):
    from kvferry.vllm.connector import served_transfer_config

    extra.setdefault("kvferry_chunk_tokens", C)
    extra.setdefault("kvferry_reconnect_ms", 50)
    return served_transfer_config(str(server.socket_dir), **extra)


class HostAlloc:
    """kv_alloc for Engine: vLLM's views over kvferry host memory."""

    def __init__(self):
        self.allocations = []

    def __call__(self, kv_cache_config, device, layout, kernel_block_sizes=None):
        from kvferry.vllm.connector import host_kv_caches

        caches, alloc = host_kv_caches(kv_cache_config, layout, kernel_block_sizes)
        self.allocations.append(alloc)
        return caches


def make_engine(server, specs=None, **extra):
    specs = specs or attention_specs([(i, "full") for i in range(4)])
    return Engine(transfer(server, **extra), specs, kv_alloc=HostAlloc())


def scheduler_side(engine):
    return engine.scheduler.connector.connector_scheduler


def worker_side(engine):
    return engine.worker.connector_worker


def prompt(n, salt=0):
    return [(i * 37 + salt * 101) % 900 + 20 for i in range(n)]


def check_blocks(engine, req_id, tokens, num_tokens):
    """Blocks [0, num_tokens / BS) of the request hold what the stand-in
    model wrote for its tokens; returns the blocks checked."""
    table = engine.tables[req_id][0]
    checked = 0
    for layer, name, gi, view in engine.layer_views():
        for i in range(num_tokens // BS):
            got = view[table[i]]
            want = expected_block(engine, layer, view, tokens, i, BS)
            assert torch.equal(got, want), (name, i, table[i])
            checked += 1
    return checked


def settle(engine):
    """What the next step would do first (handle_preemptions): collect the
    STOREs in flight, before anything rewrites their blocks."""
    engine.worker.handle_preemptions(None)


def store_and_reload(engine, tokens):
    """Run a prompt (stored), poison the cache, reset vLLM's prefix cache and
    run it again: returns the second request."""
    first = engine.add(tokens)
    engine.run()
    settle(engine)
    assert worker_side(engine).stats["stores"] > 0, worker_side(engine).stats
    engine.poison()
    engine.reset_gpu_prefix_cache()
    second = engine.add(tokens)
    engine.run()
    assert first.request_id != second.request_id
    return second


def test_store_hit_load(kvferryd):
    server = kvferryd()
    engine = make_engine(server)
    tokens = prompt(100)                                  # 3 whole chunks (96 tokens) + 4
    try:
        assert engine.worker.get_mem_pool_context() is None     # the CPU: host_kv_caches
        second = store_and_reload(engine, tokens)
        w = worker_side(engine)
        assert w.stats["loads"] == 1 and w.stats["load_failures"] == 0, w.stats
        # The hit: every whole chunk but never the last token.
        assert w.link.registrations == 1 and scheduler_side(engine).link.registrations == 1
        assert check_blocks(engine, second.request_id, tokens, 96) == 4 * 6
        # Poisoned before the load: the blocks the load did not write were
        # computed again by the stand-in (tokens 96..99), nothing is poison.
        stats = w.link.client.stat()
        assert stats.l1_objects >= 3 and stats.retrieves_total == retrieves(1, 2), stats
        # The scheduler's lookup twin and the worker registered one geometry.
        fp = w.link.registration.fingerprint
        assert scheduler_side(engine).worker_fingerprints == {0: fp}
        assert scheduler_side(engine).link.registration.fingerprint == fp
        assert scheduler_side(engine).hits_enabled
    finally:
        engine.shutdown()


def test_keys_follow_vllm_block_hashes(kvferryd):
    """Chunk k is named SHA-256(seed || the hash of its last vLLM block):
    keys made by that rule from the request's block hashes find what the
    connector stored, and a prompt sharing only the first chunk hits that
    chunk alone (vLLM's hashes chain the prefix)."""
    import hashlib

    server = kvferryd()
    engine = make_engine(server)
    a = prompt(100)
    b = a[:C] + prompt(68, salt=3)
    try:
        ra = engine.add(a)
        engine.run()
        settle(engine)
        sched = scheduler_side(engine)
        seed = sched.settings.seed
        keys = []
        for k in range(3):
            digest = hashlib.sha256(seed + bytes(ra.block_hashes[(k + 1) * C // BS - 1])).digest()
            keys.append(digest if kvc.KEY_BYTES == 32 else
                        int.from_bytes(digest[:8], "little") or 1)
        assert sched.query(sched.link.client, 3 * C, keys, 0) == (3 * C, 0)
        engine.poison()
        engine.reset_gpu_prefix_cache()
        rb = engine.add(b)
        engine.run()
        w = worker_side(engine)
        assert w.stats["loads"] == 1, w.stats
        assert check_blocks(engine, rb.request_id, b, C) == 4 * 2
        # Block 2 on was computed again (not loaded): it holds b's bytes too.
        assert check_blocks(engine, rb.request_id, b, 96) == 4 * 6
    finally:
        engine.shutdown()


def test_failed_load_reported(kvferryd):
    """A load that restores less than the LOOKUP found (the objects went
    between the scheduler's query and the worker's RETRIEVE, simulated by
    naming chunks kvferryd never stored) is reported in failed_recving and
    invalid_block_ids, and vLLM recomputes the prompt."""
    server = kvferryd()
    engine = make_engine(server)
    tokens = prompt(100, salt=5)
    try:
        engine.add(tokens)
        engine.run()
        settle(engine)
        engine.poison()
        engine.reset_gpu_prefix_cache()
        req = engine.add(tokens)

        def lose_objects(out):
            for op in out.kv_connector_metadata.loads:
                op.keys = [kvc.chunk_seed(b"gone-%d" % i) if kvc.KEY_BYTES == 32 else 1000 + i
                           for i in range(len(op.keys))]

        engine.step(before_worker=lose_objects)
        engine.run()
        w = worker_side(engine)
        assert w.stats["load_failures"] == 1 and w.stats["loads"] == 0, w.stats
        failed = set().union(*(o.failed_recving for o in engine.outputs))
        assert req.request_id in failed
        invalid = set().union(*(o.invalid_block_ids for o in engine.outputs))
        assert invalid, "the unwritten blocks are reported"
        # Recomputed: every block holds the model's bytes, none is poison.
        assert check_blocks(engine, req.request_id, tokens, 96) == 4 * 6
        assert scheduler_side(engine).load_failed == set()   # forgotten when it finished
    finally:
        engine.shutdown()


def _wait(pred, what, timeout=15.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError("timed out waiting for " + what)


def test_kvferryd_restart(kvferryd):
    """kvferryd dies and a new one serves the directory: both connector
    sides notice (server_restarted), connect and register again, and the
    new server's objects are stored and loaded."""
    server = kvferryd()
    engine = make_engine(server)
    try:
        engine.add(prompt(70, salt=7))
        engine.run()
        settle(engine)
        w, s = worker_side(engine), scheduler_side(engine)
        assert w.link.registrations == 1 and s.link.registrations == 1
        old_boot = w.link.boot_token
        server.kill()
        server = kvferryd()
        _wait(lambda: w.link.client.server_restarted and s.link.client.server_restarted,
              "the clients to see the restart")
        tokens = prompt(100, salt=8)
        second = store_and_reload(engine, tokens)
        assert w.link.registrations == 2 and s.link.registrations == 2
        assert w.link.boot_token != old_boot
        assert w.stats["loads"] == 1, w.stats
        assert check_blocks(engine, second.request_id, tokens, 96) == 4 * 6
        # The new server: the first prompt's and this one's queries, one load.
        assert w.link.client.stat().retrieves_total == retrieves(1, 2)
    finally:
        engine.shutdown()
        server.stop()


def test_kvferryd_down_at_start(kvferryd):
    """An engine that starts while kvferryd is down runs without it (no hit,
    stores dropped), and connects and registers once kvferryd serves."""
    server = kvferryd()
    server.kill()                                         # the directory stays, nobody serves
    engine = make_engine(server)
    try:
        w, s = worker_side(engine), scheduler_side(engine)
        assert w.link.client is None and w.link.registrations == 0
        engine.add(prompt(70, salt=17))
        engine.run()
        assert w.stats["stores"] == 0 and w.stats["store_failures"] > 0, w.stats
        assert s.link.registrations == 0
        server = kvferryd()
        time.sleep(0.1)                                   # past kvferry_reconnect_ms (50)
        tokens = prompt(100, salt=18)
        second = store_and_reload(engine, tokens)
        assert w.link.registrations == 1 and s.link.registrations == 1
        assert w.stats["loads"] == 1, w.stats
        assert check_blocks(engine, second.request_id, tokens, 96) == 4 * 6
    finally:
        engine.shutdown()
        server.stop()


def test_engine_restart_objects_still_served(kvferryd):
    """A new engine (new vLLM objects, new connector instances, a new KV
    cache) on the same kvferryd hits the objects the first one stored."""
    server = kvferryd()
    tokens = prompt(130, salt=9)                          # 4 whole chunks
    first = make_engine(server)
    try:
        first.add(tokens)
        first.run()
        settle(first)
        assert worker_side(first).stats["stores"] > 0
    finally:
        first.shutdown()
    second = make_engine(server)
    try:
        second.poison()
        req = second.add(tokens)
        second.run()
        w = worker_side(second)
        assert w.stats["loads"] == 1 and w.stats["load_failures"] == 0, w.stats
        assert check_blocks(second, req.request_id, tokens, 128) == 4 * 8
        stats = w.link.client.stat()
        assert stats.retrieves_total == retrieves(1, 2)   # the first engine's query too
    finally:
        second.shutdown()


class Loads:
    """before_worker hook: the load ops the scheduler sent."""

    def __init__(self):
        self.ops = []

    def __call__(self, out):
        self.ops.extend(out.kv_connector_metadata.loads)


def test_hybrid_sliding_window(kvferryd):
    """Full attention and sliding-window layers (vLLM's hybrid allocation,
    groups overlaid on one tensor per layer pair): one geometry, two object
    groups; the load restores every full block and the window's blocks."""
    server = kvferryd()
    specs = attention_specs([(0, "full"), (1, "sliding"), (2, "full"), (3, "sliding")])
    engine = Engine(transfer(server), specs, kv_alloc=HostAlloc())
    tokens = prompt(200, salt=11)
    try:
        geometry = worker_side(engine).geometry
        assert geometry.num_object_groups == 2 and geometry.num_aliases == 2
        engine.add(tokens)
        engine.run()
        settle(engine)
        engine.poison()
        engine.reset_gpu_prefix_cache()
        loads = Loads()
        req = engine.add(tokens)
        engine.run(before_worker=loads)
        assert worker_side(engine).stats["loads"] == 1, worker_side(engine).stats
        (op,) = loads.ops
        assert op.token_begin == 0 and op.token_end == 192
        checked = {0: 0, 1: 0}
        for layer, name, gi, view in engine.layer_views():
            table = engine.tables[req.request_id][gi]
            for i in range(op.token_end // BS):
                if table[i] == 0:          # a block the window dropped: vLLM's null block
                    continue
                want = expected_block(engine, layer, view, tokens, i, BS)
                assert torch.equal(view[table[i]], want), (name, i, table[i])
                checked[gi] += 1
        assert checked[0] == 2 * 12 and 0 < checked[1] < checked[0], checked
    finally:
        engine.shutdown()


def test_mamba_padded_pages(kvferryd):
    """Attention and Mamba layers over one allocation, Mamba pages padded to
    the attention page: the state at the hit's end is restored into the
    hit's last Mamba block, without its padding."""
    from test_offloading import mamba_specs

    server = kvferryd()
    engine = Engine(transfer(server), mamba_specs(), mamba=True, kv_alloc=HostAlloc())
    tokens = prompt(200, salt=13)
    try:
        geometry = worker_side(engine).geometry
        assert geometry.num_object_groups == 4
        engine.add(tokens)
        engine.run()
        settle(engine)
        engine.poison()
        engine.reset_gpu_prefix_cache()
        loads = Loads()
        req = engine.add(tokens)
        engine.run(before_worker=loads)
        assert worker_side(engine).stats["loads"] == 1, worker_side(engine).stats
        (op,) = loads.ops
        hit = op.token_end
        assert hit > 0 and hit % C == 0
        for layer, name, gi, view in engine.layer_views():
            table = engine.tables[req.request_id][gi]
            for i in range(hit // BS):
                want = expected_block(engine, layer, view, tokens, i, BS)
                assert torch.equal(view[table[i]], want), (name, i)
        states = 0
        for layer, name, gi, pages in engine.mamba_views():
            block = engine.tables[req.request_id][gi][hit // BS - 1]
            state_bytes = engine.specs[name].real_page_size_bytes
            want = engine.mamba_state(layer, hit, pages.shape[1])
            assert torch.equal(pages[block, :state_bytes], want[:state_bytes]), name
            padding = torch.empty(0, dtype=torch.uint8).set_(pages.untyped_storage())[
                block * pages.stride(0) + state_bytes:(block + 1) * pages.stride(0)]
            assert bool((padding == POISON).all()), name
            states += 1
        assert states == 3
    finally:
        engine.shutdown()


def test_local_hit_then_served(kvferryd):
    """vLLM's own prefix cache has part of the prompt (3 blocks, not a whole
    number of chunks) and kvferryd more: the load starts at the chunk
    holding the local hit's end and skips the blocks vLLM had (shared with
    another request: never written), then fills the rest."""
    server = kvferryd()
    engine = make_engine(server)
    a = prompt(100, salt=21)
    x = a[:48] + prompt(20, salt=22)          # a's first 3 blocks, then different
    try:
        engine.add(a)
        engine.run()
        settle(engine)
        engine.poison()
        engine.reset_gpu_prefix_cache()
        loads = Loads()
        rx = engine.add(x)                    # kvferryd: chunk 0; vLLM keeps blocks 0..2
        engine.run(before_worker=loads)
        settle(engine)
        ra = engine.add(a)
        engine.run(before_worker=loads)
        assert [(op.token_begin, op.token_end, op.skip_tokens) for op in loads.ops] == \
            [(0, 32, 0), (32, 96, 48)]
        assert engine.tables[ra.request_id][0][:3] == engine.tables[rx.request_id][0][:3]
        assert check_blocks(engine, ra.request_id, a, 96) == 4 * 6
        assert worker_side(engine).stats["loads"] == 2
    finally:
        engine.shutdown()


def test_chunk_not_whole_blocks_refused(kvferryd):
    server = kvferryd()
    with pytest.raises(ValueError, match="kvferry_chunk_tokens = 24 is not a whole number"):
        make_engine(server, kvferry_chunk_tokens=24)


def test_cpu_cache_must_be_importable(kvferryd):
    """A KV cache in torch's own CPU memory is refused, saying what to use."""
    server = kvferryd()
    with pytest.raises(kvferry.KvferryError, match="host_kv_caches"):
        Engine(transfer(server), attention_specs([(i, "full") for i in range(2)]))
