"""kvferry.client against a real kvferryd process (the built binary), on the
host backend, with memfd allocations from kvferry.memory.

kvferryd is found as $KVF_KVFERRYD, else tools/kvferryd next to the library
the package loaded (the build tree); the tests skip, saying so, without it
(tests/python/served.py). Each test starts its own server in a fresh socket
directory and stops it (SIGTERM, then SIGKILL) afterwards.
"""

import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import served
from conftest import RAW_GEOMETRY_SCRIPT, ROOT, subprocess_env, tiny_geometry

import kvferry
from kvferry import client as kc
from kvferry.client import Client, Outcome, chunk_keys

NB, BLOCK, CHUNK = 8, 256, 8  # tiny_geometry: 8 blocks of 4 tokens, 256 bytes per block and layer


@pytest.fixture
def server_factory(tmp_path):
    """start(*args) -> a Kvferryd on the test's socket directory (the same one
    for every call: a restart), stopped after the test."""
    with served.factory(tmp_path, devices="none", l1_mb=64) as start:
        yield start


@pytest.fixture
def server(server_factory):
    return server_factory()


class Engine:
    """A host-backend engine: tiny_geometry over one memfd allocation, filled
    with random bytes, viewed as (layer, block, 256 bytes)."""

    def __init__(self, seed=1):
        self.geometry, self.size = tiny_geometry(num_blocks=NB, chunk_tokens=CHUNK)
        self.alloc = kvferry.Allocation.create(self.size, provider="host", name="kv-test")
        self.cache = np.asarray(self.alloc)
        self.cache[:] = np.random.default_rng(seed).integers(0, 256, self.size, dtype=np.uint8)
        self.blocks = self.cache.reshape(2, NB, BLOCK)

    def register(self, c, **kw):
        return c.register(self.geometry, [(self.alloc, 0, self.size)], **kw)

    def close(self):
        self.cache = self.blocks = None
        self.alloc.close()
        self.geometry.close()


@pytest.fixture
def engine():
    e = Engine()
    yield e
    e.close()


def keys_for(tokens, seed=7):
    return chunk_keys(kc.chunk_seed(b"test-model|%d" % seed), tokens, chunk_tokens=CHUNK)


TOKENS = list(range(1000, 1016))  # 16 tokens: 2 chunks of 8, 4 blocks


def wait_until(pred, timeout, step=0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step)
    return pred()


# ---- connect, info, register -------------------------------------------------------

def test_connect_and_info(server):
    with Client.connect(server.socket_dir, name="info-test", timeout_ms=5000) as c:
        info = c.info
        assert info.server_pid == server.pid
        assert info.client_id > 0 and info.boot_token != 0
        assert 0 < info.heartbeat_period_ms < info.heartbeat_timeout_ms
        assert info.protocol_version >= 1
        assert "kvferryd pid %d" % server.pid in repr(c)
        assert c.heartbeat() == info.boot_token
        assert not c.server_restarted
    assert c.closed and "closed" in repr(c)
    c.close()  # idempotent
    with pytest.raises(kvferry.KvferryError) as e:
        c.stat()
    assert e.value.status == kvferry.Status.STATE and e.value.field == "client"


def test_connect_without_server(tmp_path):
    with pytest.raises(kvferry.KvferryError) as e:
        Client.connect(tmp_path / "nobody")
    assert e.value.status == kvferry.Status.NOT_FOUND
    assert e.value.field == "socket_dir"


def test_connect_bad_options(server):
    with pytest.raises(kvferry.KvferryError) as e:
        Client.connect(server.socket_dir, name="x" * 64)
    assert e.value.status == kvferry.Status.INVALID_ARGUMENT and e.value.field == "options.name"
    with pytest.raises(kvferry.KvferryError) as e:
        Client.connect(server.socket_dir, timeout_ms=-1)
    assert e.value.field == "timeout_ms"


def test_register_geometry_and_json(server, engine):
    with Client.connect(server.socket_dir, name="reg") as c:
        reg = engine.register(c)
        assert reg.registration_id > 0
        assert reg.fingerprint == engine.geometry.fingerprint("canonical")
        assert (reg.imports, reg.aliases) == (1, 1)
        # JSON text, and the allocation alone (all of it) as the region.
        again = c.register(engine.geometry.to_json(), [engine.alloc])
        assert again.registration_id != reg.registration_id
        assert again.fingerprint == reg.fingerprint
        assert c.stat().active == 1  # the new registration replaced the old one
        assert c.unregister() in (2, 3)
        assert c.unregister(again.registration_id) in (2, 3, 0)  # idempotent
        assert c.stat().active == 0


def test_register_errors_name_the_field(server, engine):
    with Client.connect(server.socket_dir) as c:
        with pytest.raises(kvferry.KvferryError) as e:
            c.register('{"format": "kvferry-geometry"', [engine.alloc])
        assert e.value.status == kvferry.Status.PARSE
        with pytest.raises(kvferry.KvferryError) as e:  # a region past the allocation's end
            c.register(engine.geometry, [(engine.alloc, 4096, engine.size)])
        assert e.value.field == "regions[0].length", e.value  # the package's check
        with pytest.raises(kvferry.KvferryError) as e:  # shorter than the geometry's region
            c.register(engine.geometry, [(engine.alloc, 0, engine.size - 1)])
        assert e.value.status == kvferry.Status.INVALID_ARGUMENT
        assert e.value.field == "payload.regions[0].length", e.value  # the server's
        with pytest.raises(kvferry.KvferryError) as e:
            c.register(engine.geometry, ["not an allocation"])
        assert e.value.field == "regions[0]"
        with pytest.raises(kvferry.KvferryError) as e:
            c.register(42, [engine.alloc])
        assert e.value.field == "geometry"
        with pytest.raises(kvferry.KvferryError) as e:
            engine.register(c, shard_index=2, shard_count=2)
        assert e.value.status == kvferry.Status.INVALID_ARGUMENT and e.value.field, e.value
        assert "shard_index" in e.value.field, e.value
        assert c.stat().active == 0  # nothing registered, the connection still serves
        assert engine.register(c).registration_id > 0


# ---- STORE and RETRIEVE ----------------------------------------------------------------

def test_store_then_retrieve_into_other_blocks(server, engine):
    keys = keys_for(TOKENS)
    assert len(keys) == 2
    src, dst = [5, 2, 7, 0], np.array([1, 3, 4, 6], dtype=np.int32)
    want = engine.blocks[:, src].copy()
    before_dst = engine.blocks[:, dst].copy()
    assert not (want == before_dst).all()
    with Client.connect(server.socket_dir, name="engine0") as c:
        engine.register(c)
        r = c.store(0, 16, keys, [src])
        assert r.done and r.status == kvferry.Status.SUCCESS and r.outcome == Outcome.DONE
        assert (r.prefix_tokens, r.objects_done, r.objects_present) == (16, 2, 0)
        assert r.bytes_done == 4 * 2 * BLOCK and r.group_blocks == (4,)
        r = c.retrieve(0, 16, keys, [dst])
        assert r.done and r.prefix_tokens == 16 and r.objects_done == 2
        assert r.object_group_prefix == (16,) and r.group_blocks == (4,)
        assert (engine.blocks[:, dst] == want).all(), "the retrieved blocks differ from the stored"
        assert (engine.blocks[:, src] == want).all(), "the stored blocks changed"
        # The second chunk alone, into blocks named from local block 2 on (first_block).
        engine.blocks[:, [1, 3, 4, 6]] = 0
        r = c.retrieve(8, 16, keys[1:], [([4, 6], 2)])
        assert r.done and r.prefix_tokens == 16 and r.group_blocks == (2,)
        assert (engine.blocks[:, [4, 6]] == want[:, 2:]).all()
        assert not engine.blocks[:, [1, 3]].any()


def test_second_store_finds_objects_present(server, engine):
    keys = keys_for(TOKENS)
    with Client.connect(server.socket_dir) as c:
        engine.register(c)
        first = c.store(0, 16, keys, [[0, 1, 2, 3]])
        assert (first.objects_done, first.objects_present) == (2, 0)
        second = c.store(0, 16, keys, [kvferry.BlockTable(np.arange(4, 8), first_block=0)])
        assert second.done and (second.objects_done, second.objects_present) == (0, 2)
        assert second.bytes_done == 0 and second.prefix_tokens == 16


def test_retrieve_miss_and_partial_prefix(server, engine):
    keys = keys_for(TOKENS)
    other = keys_for(TOKENS, seed=99)
    with Client.connect(server.socket_dir) as c:
        engine.register(c)
        untouched = engine.blocks.copy()
        miss = c.retrieve(0, 16, other, [[4, 5, 6, 7]])
        assert miss.done and miss.prefix_tokens == 0 and miss.objects_done == 0
        assert miss.object_group_prefix == (0,)
        assert (engine.blocks == untouched).all()
        # Only the first chunk stored: a retrieve of both restores 8 tokens.
        c.store(0, 8, keys[:1], [[0, 1]])
        want = engine.blocks[:, [0, 1]].copy()
        r = c.retrieve(0, 16, keys, [[4, 5, 6, 7]])
        assert r.done and r.prefix_tokens == 8 and r.object_group_prefix == (8,)
        assert (engine.blocks[:, [4, 5]] == want).all()
        assert (engine.blocks[:, [6, 7]] == untouched[:, [6, 7]]).all()


def test_submit_and_wait_many(server, engine):
    """Several requests in flight from several threads, collected by id."""
    seqs = [list(range(s * 100, s * 100 + 8)) for s in range(8)]
    with Client.connect(server.socket_dir) as c:
        engine.register(c)
        ids = [c.submit("store", 0, 8, keys_for(t), [[2 * (i % 4), 2 * (i % 4) + 1]])
               for i, t in enumerate(seqs)]
        assert len(set(ids)) == len(ids)
        results = [None] * len(ids)

        def waiter(i):
            results[i] = c.wait(ids[i], timeout_ms=10000)

        threads = [threading.Thread(target=waiter, args=(i,)) for i in range(len(ids))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert all(r is not None and r.done and r.prefix_tokens == 8 for r in results), results
        with pytest.raises(kvferry.KvferryError) as e:  # collected once
            c.wait(ids[0])
        assert e.value.status == kvferry.Status.NOT_FOUND and e.value.field == "request_id"
        rid = c.submit(kc.Op.RETRIEVE, 0, 8, keys_for(seqs[3]), [[6, 7]])
        r = c.wait(rid)
        assert r.done and r.prefix_tokens == 8


def test_stat_and_stat_clients(server, engine):
    keys = keys_for(TOKENS)
    with Client.connect(server.socket_dir, name="stat-me") as c, \
            Client.connect(server.socket_dir, name="bystander", heartbeat=False) as other:
        engine.register(c)
        c.store(0, 16, keys, [[0, 1, 2, 3]])
        c.retrieve(0, 16, keys, [[4, 5, 6, 7]])
        # in_flight drops when the request retires, which may be just after its reply.
        assert wait_until(lambda: other.stat().in_flight == 0, 5)
        s = other.stat()
        assert s.boot_token == c.info.boot_token
        assert (s.active, s.imports, s.aliases, s.leases) == (1, 1, 1, 0)
        assert s.l1_objects == 2 and s.l1_bytes == 4 * 2 * BLOCK
        assert s.stores_total == 1 and s.retrieves_total == 1 and s.in_flight == 0
        assert s.lanes == 1 and s.l1_pool_bytes >= 64 << 20
        s2, records = c.stat_clients()
        assert s2.l1_objects == 2
        mine = {r.name: r for r in records}
        assert set(mine) >= {"stat-me", "bystander"}, records
        assert mine["stat-me"].pid == os.getpid() and mine["stat-me"].active == 1
        assert mine["stat-me"].client_id == c.info.client_id
        assert mine["bystander"].active == 0
        _, few = c.stat_clients(capacity=1)
        assert len(few) == 1


def test_errors_name_the_field(server, engine):
    keys = keys_for(TOKENS)
    with Client.connect(server.socket_dir) as c:
        engine.register(c)
        with pytest.raises(kvferry.KvferryError) as e:  # the server: past num_blocks
            c.store(0, 16, keys, [[0, 1, 2, 99]])
        assert e.value.status == kvferry.Status.INVALID_ARGUMENT
        assert e.value.field == "payload.groups[0].block_ids[3]", e.value
        assert e.value.result is None  # refused: no outcome
        with pytest.raises(kvferry.KvferryError) as e:  # the server: 1 key for 2 chunks
            c.store(0, 16, keys[:1], [[0, 1, 2, 3]])
        assert e.value.status == kvferry.Status.INVALID_ARGUMENT
        assert e.value.field == "payload.chunk_keys", e.value
        with pytest.raises(kvferry.KvferryError) as e:  # the server: 3 keys for 2 chunks
            c.retrieve(0, 16, keys + keys[:1], [[0, 1, 2, 3]])
        assert e.value.field == "payload.chunk_keys", e.value
        with pytest.raises(kvferry.KvferryError) as e:  # the library: an empty range
            c.retrieve(16, 16, keys, [[0, 1, 2, 3]])
        assert e.value.field == "xfer.token_end", e.value
        with pytest.raises(kvferry.KvferryError) as e:  # the package: not a block id
            c.store(0, 16, keys, [[0, 1, -5, 3]])
        assert e.value.field == "blocks[0][2]", e.value
        with pytest.raises(kvferry.KvferryError) as e:
            c.store(0, 16, keys, [[0, 1, 2, 3], [4]])  # two groups for a geometry of one
        assert e.value.status == kvferry.Status.INVALID_ARGUMENT and e.value.field, e.value
        with pytest.raises(kvferry.KvferryError) as e:
            c.store(0, 16, keys, [[0, 1, 2, 3]], ready_event=b"\0" * 10)
        assert e.value.field == "ready_event"
        with pytest.raises(kvferry.KvferryError) as e:  # 64 bytes, but zero: not an event
            c.store(0, 16, keys, [[0, 1, 2, 3]], ready_event=bytes(64))
        assert e.value.field == "xfer.ready_event", e.value
        with pytest.raises(kvferry.KvferryError) as e:
            c.retrieve(4, 16, keys, [[0, 1, 2, 3]])  # not on a chunk boundary
        assert e.value.field and "token_begin" in e.value.field, e.value
        with pytest.raises(kvferry.KvferryError) as e:
            c.submit("copy", 0, 16, keys, [[0]])
        assert e.value.field == "op"
        with pytest.raises(kvferry.KvferryError) as e:
            c.store(0, 16, keys, [[0, 1, 2, 3]], format="sideways")
        assert e.value.status == kvferry.Status.INVALID_ARGUMENT
        # The client stays usable after every refusal.
        assert c.store(0, 16, keys, [[0, 1, 2, 3]]).done


def test_bad_keys(server, engine):
    with Client.connect(server.socket_dir) as c:
        engine.register(c)
        bad = [b"short", 1.5, 7]
        for k in bad:
            with pytest.raises(kvferry.KvferryError) as e:
                c.store(0, 8, [k], [[0, 1]])
            assert e.value.field == "keys[0]"
        with pytest.raises(kvferry.KvferryError) as e:
            c.store(0, 8, [bytes(32)], [[0, 1]])
        assert e.value.field == "xfer.chunk_keys[0]", e.value


# ---- restarts and timeouts ---------------------------------------------------------------

def test_kvferryd_restart(server_factory, engine):
    first = server_factory("--heartbeat-timeout-ms", "2000")
    keys = keys_for(TOKENS)
    c = Client.connect(first.socket_dir, name="survivor", heartbeat=True, heartbeat_period_ms=100)
    try:
        engine.register(c)
        assert c.store(0, 16, keys, [[0, 1, 2, 3]]).done
        boot = c.info.boot_token
        first.kill()
        second = server_factory("--heartbeat-timeout-ms", "2000")  # the same directory
        assert wait_until(lambda: c.server_restarted, 10), "server_restarted stayed false"
        with pytest.raises(kvferry.KvferryError) as e:
            c.stat()
        assert e.value.status == kvferry.Status.DISCONNECTED
        with Client.connect(second.socket_dir, name="again") as c2:
            assert c2.info.boot_token != boot and c2.info.server_pid == second.pid
            assert not c2.server_restarted
            engine.register(c2)
            want = engine.blocks[:, [0, 1, 2, 3]].copy()
            miss = c2.retrieve(0, 16, keys, [[4, 5, 6, 7]])  # the new server's L1 is empty
            assert miss.done and miss.prefix_tokens == 0
            assert c2.store(0, 16, keys, [[0, 1, 2, 3]]).objects_done == 2
            assert c2.retrieve(0, 16, keys, [[4, 5, 6, 7]]).prefix_tokens == 16
            assert (engine.blocks[:, [4, 5, 6, 7]] == want).all()
    finally:
        c.close()


def test_timeout_while_the_server_is_stopped(server, engine):
    """SIGSTOP kvferryd: a request gets no reply in time (TIMEOUT, the
    connection stays usable); a submitted one can be waited for again and
    completes once the server runs again."""
    keys = keys_for(TOKENS)
    with Client.connect(server.socket_dir, heartbeat=False, timeout_ms=300) as c:
        engine.register(c)
        os.kill(server.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(kvferry.KvferryError) as e:
                c.stat()
            assert e.value.status == kvferry.Status.TIMEOUT
            assert time.monotonic() - t0 < 5
            with pytest.raises(kvferry.KvferryError) as e:
                c.store(0, 16, keys, [[0, 1, 2, 3]])
            assert e.value.status == kvferry.Status.TIMEOUT and e.value.result is None
            rid = c.submit("store", 0, 16, keys, [[0, 1, 2, 3]])
            with pytest.raises(kvferry.KvferryError) as e:
                c.wait(rid, timeout_ms=200)
            assert e.value.status == kvferry.Status.TIMEOUT
        finally:
            os.kill(server.pid, signal.SIGCONT)
        r = c.wait(rid, timeout_ms=10000)  # waited for again: the reply came
        assert r.done and r.prefix_tokens == 16
        assert c.stat().l1_objects == 2
        assert c.heartbeat() == c.info.boot_token


# ---- LOOKUP, pins and retirement (i13-lookup) -----------------------------------------------

needs_lookup = pytest.mark.skipif(not kc.has_lookup(),
                                  reason="this libkvferry has no kvf_client_lookup / "
                                         "kvf_client_wait_retired (i13-lookup not merged)")


def test_lookup_unsupported_without_the_symbols(server):
    if kc.has_lookup():
        pytest.skip("the library has LOOKUP")
    with Client.connect(server.socket_dir) as c:
        for call in (lambda: c.lookup(0, 8, [1]), lambda: c.unpin(1),
                     lambda: c.wait_retired(1, 10)):
            with pytest.raises(kvferry.KvferryError) as e:
                call()
            assert e.value.status == kvferry.Status.UNSUPPORTED


@needs_lookup
def test_lookup_and_pin(server, engine):
    tokens = list(range(24))
    keys = chunk_keys(kc.chunk_seed(b"lookup"), tokens, chunk_tokens=CHUNK)
    with Client.connect(server.socket_dir) as c:
        engine.register(c)
        empty = c.lookup(0, 24, keys)
        assert empty.prefix_tokens == 0 and empty.pin_id == 0
        c.store(0, 16, keys[:2], [[0, 1, 2, 3]])
        found = c.lookup(0, 24, keys)
        assert found.prefix_tokens == 16 and found.object_group_prefix == (16,)
        assert found.pin_id == 0 and found.pinned_chunks == 0
        pinned = c.lookup(0, 24, keys, pin_ms=5000)
        assert pinned.prefix_tokens == 16 and pinned.pin_id != 0 and pinned.pinned_chunks == 2
        r = c.retrieve(0, 24, keys, [[4, 5, 6, 7, None, None]])
        assert r.prefix_tokens == 16
        c.unpin(pinned.pin_id)
        c.unpin(pinned.pin_id)  # idempotent
        assert c.lookup(8, 24, keys[1:]).prefix_tokens == 16  # from the second chunk on
        missed = c.lookup(0, 24, keys_for(list(range(24)), seed=3), pin_ms=1000)
        assert missed.prefix_tokens == 0 and missed.pin_id == 0 and missed.pinned_chunks == 0
        with pytest.raises(kvferry.KvferryError) as e:
            c.lookup(0, 24, keys, pin_ms=60001)
        assert e.value.status == kvferry.Status.INVALID_ARGUMENT
        assert e.value.field and "pin_ms" in e.value.field, e.value
        with pytest.raises(kvferry.KvferryError) as e:
            c.lookup(0, 24, keys[:2])  # 2 keys for 3 chunks
        assert e.value.field == "payload.chunk_keys", e.value
        with pytest.raises(kvferry.KvferryError) as e:
            c.lookup(0, 24, [bytes(32)] * 3)
        assert e.value.field and "chunk_keys[0]" in e.value.field, e.value
        with pytest.raises(kvferry.KvferryError) as e:
            c.unpin(0)
        assert e.value.status == kvferry.Status.INVALID_ARGUMENT
        with pytest.raises(kvferry.KvferryError) as e:
            c.unpin(pinned.pin_id + 1000)  # never a pin of this connection
        assert e.value.status == kvferry.Status.NOT_FOUND


@needs_lookup
def test_wait_retired_after_a_timeout(server, engine):
    """A request that timed out for the client is retired once the server has
    proven its work complete; wait_retired says when."""
    keys = keys_for(TOKENS)
    with Client.connect(server.socket_dir, heartbeat=False, timeout_ms=300) as c:
        engine.register(c)
        os.kill(server.pid, signal.SIGSTOP)
        try:
            rid = c.submit("retrieve", 0, 16, keys, [[4, 5, 6, 7]])
            with pytest.raises(kvferry.KvferryError) as e:
                c.wait(rid, timeout_ms=200)
            assert e.value.status == kvferry.Status.TIMEOUT
            with pytest.raises(kvferry.KvferryError) as e:
                c.wait_retired(rid, 200)
            assert e.value.status == kvferry.Status.TIMEOUT
        finally:
            os.kill(server.pid, signal.SIGCONT)
        c.wait_retired(rid, 10000)
        c.wait_retired(rid, 10000)  # retired stays retired
        r = c.wait(rid)  # the reply itself stays for wait
        assert r.done and r.prefix_tokens == 0  # nothing was stored: a miss
        done = c.submit("store", 0, 16, keys, [[0, 1, 2, 3]])
        assert c.wait(done).done
        c.wait_retired(done, 100)  # done: retired before its reply
        with pytest.raises(kvferry.KvferryError) as e:
            c.wait_retired(rid + 1000, 100)
        assert e.value.status == kvferry.Status.NOT_FOUND


# ---- chunk keys ------------------------------------------------------------------------------

def test_chunk_keys_chain_and_inputs():
    seed = kc.chunk_seed(b"model")
    tokens = list(range(20))
    keys = chunk_keys(seed, tokens, chunk_tokens=8)
    assert len(keys) == 3 and len(set(keys)) == 3
    assert chunk_keys(seed, tokens[:16], chunk_tokens=8) == keys[:2]  # a prefix keeps its keys
    assert chunk_keys(seed, np.array(tokens, dtype=np.int32), chunk_tokens=8) == keys
    assert chunk_keys(seed, np.array(tokens, dtype=np.int64), chunk_tokens=8, token_bytes=4) == keys
    assert chunk_keys(seed, np.array(tokens, dtype=np.int64), chunk_tokens=8) != keys  # 8 bytes
    assert chunk_keys(seed, tokens, chunk_tokens=8, token_bytes=8) == \
        chunk_keys(seed, np.array(tokens, dtype=np.int64), chunk_tokens=8)
    assert chunk_keys(seed, [], chunk_tokens=8) == []
    other = kc.chunk_seed(b"other")
    assert chunk_keys(other, tokens, chunk_tokens=8)[0] != keys[0]
    assert all(isinstance(k, bytes) and len(k) == 32 for k in keys)
    assert kc.chunk_seed("model") == seed and len(seed) == 32
    with pytest.raises(kvferry.KvferryError) as e:
        chunk_keys(bytes(32), tokens)
    assert e.value.field == "seed"
    with pytest.raises(kvferry.KvferryError) as e:
        chunk_keys(12345, tokens)
    assert e.value.field == "seed"
    with pytest.raises(kvferry.KvferryError) as e:
        chunk_keys(seed, tokens, chunk_tokens=0)
    assert e.value.field == "chunk_tokens"
    with pytest.raises(kvferry.KvferryError) as e:
        chunk_keys(seed, [1, 2, 1 << 40])
    assert e.value.field == "tokens[2]"
    with pytest.raises(kvferry.KvferryError) as e:
        chunk_keys(seed, tokens, token_bytes=2)
    assert e.value.field == "token_bytes"


def test_chunk_keys_match_the_documented_test_vector():
    """docs/protocol.md: model "example-model", tokens 0..9 as int32, C = 4."""
    seed = kc.chunk_seed(b"example-model")
    assert seed.hex() == "62042d691c2d741b6591302f95fd5fd4324ad444d32ea1ad2680340208423b11"
    keys = chunk_keys(seed, list(range(10)), chunk_tokens=4)
    assert [k.hex() for k in keys] == [
        "a813754b0dd61ef046617af334fb6c329e8295e91382cc97045d58ad695bce17",
        "c13df430f4da64bb3431e25fd70af8ae807b4b0547e84a20fa1c46d622b5eaec",
        "dd9400ddcaabd6d4f394a8bc010ae14eaaf99bbeedac7ea6b2b042c3aa586492"]
    # The construction, from hashlib: SHA-256(previous key || the chunk's token bytes).
    import hashlib
    assert hashlib.sha256(b"kvferry-seed-v1example-model").digest() == seed
    want, prev = [], seed
    for k in range(3):
        prev = hashlib.sha256(prev + np.arange(4 * k, min(4 * k + 4, 10), dtype="<i4").tobytes()
                              ).digest()
        want.append(prev)
    assert keys == want


def test_engine_hashes_as_keys(server, engine):
    """32-byte block hashes of the engine's own (vLLM's SHA-256 ones) are
    keys as they are: a list of bytes, one bytes object, or an (n, 32) array."""
    import hashlib
    hashes = [hashlib.sha256(b"block %d" % i).digest() for i in range(2)]
    with Client.connect(server.socket_dir) as c:
        engine.register(c)
        want = engine.blocks[:, [0, 1, 2, 3]].copy()
        assert c.store(0, 16, hashes, [[0, 1, 2, 3]]).objects_done == 2
        assert c.retrieve(0, 16, b"".join(hashes), [[4, 5, 6, 7]]).prefix_tokens == 16
        assert (engine.blocks[:, [4, 5, 6, 7]] == want).all()
        as_array = np.frombuffer(b"".join(hashes), np.uint8).reshape(2, 32)
        assert c.retrieve(0, 16, as_array, [[4, 5, 6, 7]]).prefix_tokens == 16
        with pytest.raises(kvferry.KvferryError) as e:
            c.retrieve(0, 16, b"x" * 33, [[4, 5, 6, 7]])
        assert e.value.field == "keys"


def test_shards_do_not_share_objects(server_factory):
    """The server files objects under the geometry and the shard: shard 1 of
    2 sending shard 0's keys misses, stores its own, and each is served its
    own bytes."""
    server = server_factory()
    keys = keys_for(TOKENS)
    e0, e1 = Engine(seed=1), Engine(seed=2)
    try:
        with Client.connect(server.socket_dir, name="rank0") as c0, \
                Client.connect(server.socket_dir, name="rank1") as c1:
            e0.register(c0, shard_index=0, shard_count=2)
            e1.register(c1, shard_index=1, shard_count=2)
            want0, want1 = e0.blocks[:, [0, 1, 2, 3]].copy(), e1.blocks[:, [0, 1, 2, 3]].copy()
            assert c0.store(0, 16, keys, [[0, 1, 2, 3]]).objects_done == 2
            miss = c1.retrieve(0, 16, keys, [[4, 5, 6, 7]])
            assert miss.done and miss.prefix_tokens == 0
            assert c1.store(0, 16, keys, [[0, 1, 2, 3]]).objects_done == 2  # its own objects
            assert c1.retrieve(0, 16, keys, [[4, 5, 6, 7]]).prefix_tokens == 16
            assert c0.retrieve(0, 16, keys, [[4, 5, 6, 7]]).prefix_tokens == 16
            assert (e0.blocks[:, [4, 5, 6, 7]] == want0).all()
            assert (e1.blocks[:, [4, 5, 6, 7]] == want1).all()
            assert c0.stat().l1_objects == 4
    finally:
        e0.close()
        e1.close()


# ---- without numpy ------------------------------------------------------------------------

NO_NUMPY = r'''
import ctypes, sys
sys.modules["numpy"] = None  # importing numpy now fails
sys.path.insert(0, sys.argv[2])
import kvferry
from kvferry.client import Client, chunk_keys, chunk_seed
''' + RAW_GEOMETRY_SCRIPT + r'''
with kvferry.Allocation.create(size, "host") as a:
    cache = (ctypes.c_uint8 * size).from_address(a.ptr)
    for i in range(size):
        cache[i] = (7 * i) % 251
    seed = chunk_seed(b"raw")
    keys = chunk_keys(seed, [1, 2, 3, 4], chunk_tokens=4)
    with Client.connect(sys.argv[1], name="no-numpy") as c:
        c.register(g, [a])
        assert c.store(0, 4, keys, [[2]]).done
        assert c.retrieve(0, 4, keys, [[0]]).prefix_tokens == 4
    assert bytes(cache[0:64]) == bytes(cache[128:192])
assert "numpy" not in sys.modules or sys.modules["numpy"] is None
g.close()
print("ok")
'''


def test_client_without_numpy(server):
    run = subprocess.run([sys.executable, "-c", NO_NUMPY, str(server.socket_dir),
                          str(ROOT / "python")], capture_output=True, text=True, timeout=120,
                         env=subprocess_env(PYTHONPATH=None))
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout + run.stderr


# ---- kvferryd peers: PUSH (docs/peers.md) ------------------------------------------

def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_push_to_a_peer_which_then_serves_alone(tmp_path, monkeypatch):
    """Two real kvferryd over UCX (tcp): an engine on A stores and pushes to
    B (named by the boot token A sees it by); with A killed, an engine on B
    retrieves every byte. A name no peer has is refused naming the field."""
    if not kc.has_push():
        pytest.skip("the library has no kvf_client_push")
    monkeypatch.setenv("UCX_TLS", "tcp")
    secret = tmp_path / "secret"
    secret.write_bytes(b"a peer secret of thirty-two bytes!\n")
    secret.chmod(0o600)
    addr = "127.0.0.1:%d" % _free_port()
    a = served.Kvferryd(tmp_path / "a", tmp_path / "a.log",
                        ["--listen", addr, "--peer-secret-file", str(secret)]).start()
    b = served.Kvferryd(tmp_path / "b", tmp_path / "b.log",
                        ["--peer", addr, "--peer-secret-file", str(secret)]).start()
    src, dst = Engine(seed=3), Engine(seed=4)
    try:
        keys = keys_for(TOKENS, seed=31)
        blocks = [5, 2, 7, 0]
        with Client.connect(a.socket_dir, name="prefill") as ca:
            src.register(ca)
            assert ca.store(0, 16, keys, [blocks]).done
            assert wait_until(lambda: any(p.state == "ready" and not p.outgoing
                                          for p in ca.stat_peers()), 15), a.log_text()
            incoming = [p for p in ca.stat_peers() if not p.outgoing][0]
            with pytest.raises(kvferry.KvferryError) as err:
                ca.push("10.9.8.7:1", 0, 16, keys)
            assert err.value.status == kvferry.Status.NOT_FOUND
            assert err.value.field == "payload.peer", err.value
            r = ca.push("%016x" % incoming.boot_token, 0, 16, keys)
            assert (r.objects_pushed, r.objects_failed, r.chunks_on_peer) == (2, 0, 2)
            assert r.bytes_pushed == 4 * 2 * BLOCK
            assert ca.stat_peers()[-1].objects_pushed == 2
        a.kill()
        with Client.connect(b.socket_dir, name="decode") as cb:
            dst.register(cb)
            r = cb.retrieve(0, 16, keys, [blocks])
            assert r.done and r.prefix_tokens == 16
            assert (dst.blocks[:, blocks] == src.blocks[:, blocks]).all(), "the pushed bytes differ"
            assert cb.stat_peers()[0].objects_pulled == 2
    finally:
        src.close()
        dst.close()
        a.stop()
        b.stop()
