"""Failed transfers: reported to vLLM's scheduler, never restored as garbage.

A kvf_xfer call that fails is made here by making kvferry.Transfer's gather
or scatter raise what the library raises when the CUDA runtime refuses an
enqueue (Status.CUDA, kvferry/transfer.h): a stand-in for kvferry's failure,
which the host backend cannot produce; vLLM's classes are all real.
"""

import pytest
import torch

import kvferry
import kvferry.vllm
from engine import Engine, attention_specs, check_load, expected_block


def transfer(report_failures=True):
    return kvferry.vllm.offloading_transfer_config(1 << 24, report_failures=report_failures)


class Failing:
    """Make kvferry.Transfer.<method> raise for its next ``count`` calls."""

    def __init__(self, monkeypatch, method, count=1):
        self.calls = 0
        self.failed = 0
        self.count = count
        original = getattr(kvferry.Transfer, method)

        def wrapper(xfer, request, stream=None):
            self.calls += 1
            if self.failed < self.count:
                self.failed += 1
                raise kvferry.KvferryError(kvferry.Status.CUDA,
                                           "cudaLaunchKernel: injected by the test")
            return original(xfer, request, stream)

        monkeypatch.setattr(kvferry.Transfer, method, wrapper)


def prompt_of(n, seed=37):
    return [(i * seed) % 900 + 5 for i in range(n)]


def store_then_reload(engine, prompt, before_reload=None):
    engine.add(prompt)
    engine.run()
    engine.poison()
    engine.reset_gpu_prefix_cache()
    if before_reload is not None:
        before_reload()
    b = engine.add(prompt + [7, 8, 9])
    engine.run()
    return b


def test_failed_load_is_reported_and_recomputed(monkeypatch):
    engine = Engine(transfer(True), attention_specs([(0, "full"), (1, "full")]))
    try:
        prompt = prompt_of(100)
        holder = {}
        b = store_then_reload(engine, prompt,
                              lambda: holder.setdefault("f", Failing(monkeypatch, "scatter")))
        assert holder["f"].failed == 1
        (load,) = engine.loads       # vLLM's retry is offered no hit: it recomputes
        loaded = set(int(x) for x in load.dst_spec.block_ids)
        invalid = set().union(*(o.invalid_block_ids for o in engine.outputs))
        failed = set().union(*(o.failed_recving for o in engine.outputs))
        # One KV cache group: the blocks, and the asynchronous load's request.
        assert invalid == loaded
        assert failed == {b.request_id}
        # vLLM recomputed the prompt (kv_load_failure_policy "recompute"):
        # the blocks hold the right bytes although the load failed.
        for layer, name, gi, view in engine.layer_views():
            for i, block in enumerate(engine.tables[b.request_id][0][:100 // 16]):
                assert torch.equal(view[block], expected_block(engine, layer, view, prompt, i, 16))
        # The chunks were released: nothing stays pinned in the manager.
        assert engine.manager._num_evictable_cache_chunks == 100 // 16
    finally:
        engine.shutdown()


def test_failed_store_is_dropped(monkeypatch):
    engine = Engine(transfer(True), attention_specs([(0, "full"), (1, "full")]))
    try:
        prompt = prompt_of(100)
        store = Failing(monkeypatch, "gather")
        b = store_then_reload(engine, prompt)
        assert store.failed == 1
        # The failed store's chunks left vLLM's manager before they were
        # offered: the second request missed and computed, and stored them.
        assert engine.loads == []
        assert not any(o.failed_recving or o.invalid_block_ids for o in engine.outputs)
        assert store.calls == 2
        engine.poison()
        engine.reset_gpu_prefix_cache()
        engine.add(prompt + [31])
        engine.run()
        (load,) = engine.loads
        assert check_load(engine, load, prompt) == 2 * (100 // 16)
        assert b.request_id not in engine.scheduler.requests
    finally:
        engine.shutdown()


def test_failed_store_chunks_are_not_loaded(monkeypatch):
    """The worker's own guard, under the scheduler's: a load from chunks
    whose store failed fails without a copy."""
    engine = Engine(transfer(True), attention_specs([(0, "full"), (1, "full")]))
    try:
        from vllm.v1.kv_offload.base import GPULoadStoreSpec
        from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

        worker = engine.offloader
        Failing(monkeypatch, "gather")
        scatter = Failing(monkeypatch, "scatter", count=0)
        worker.submit_store(1000, GPULoadStoreSpec([3, 4], group_sizes=[2], block_indices=[0]),
                            CPULoadStoreSpec([7, 8]))
        (result,) = worker.get_finished()
        assert result.job_id == 1000 and not result.success
        worker.submit_load(1001, CPULoadStoreSpec([8]),
                           GPULoadStoreSpec([5], group_sizes=[1], block_indices=[1]))
        (result,) = worker.get_finished()
        assert result.job_id == 1001 and not result.success
        assert scatter.calls == 0
        assert list(worker.pop_failed_load(1001)) == [5]
    finally:
        engine.shutdown()


def test_failed_load_hybrid_reports_the_request(monkeypatch):
    """Several KV cache groups: vLLM takes request-level failures only
    (block ids are per group), so the load fails as ``failed_recving``."""
    engine = Engine(transfer(True), attention_specs([(0, "full"), (1, "sliding"), (2, "full"),
                                                     (3, "sliding")]))
    try:
        prompt = prompt_of(200, 53)
        holder = {}
        b = store_then_reload(engine, prompt,
                              lambda: holder.setdefault("f", Failing(monkeypatch, "scatter")))
        assert holder["f"].failed == 1
        assert set().union(*(o.failed_recving for o in engine.outputs)) == {b.request_id}
        assert not set().union(*(o.invalid_block_ids for o in engine.outputs))
        assert b.request_id not in engine.scheduler.requests   # finished after recomputing
    finally:
        engine.shutdown()


def test_failed_load_with_vllms_connector_asserts(monkeypatch):
    """vLLM 0.33's OffloadingConnector has no path for a failed job
    (offloading/worker.py asserts TransferResult.success): the documented
    reason for KvferryOffloadingConnector."""
    engine = Engine(transfer(False), attention_specs([(0, "full"), (1, "full")]))
    try:
        with pytest.raises(AssertionError):
            store_then_reload(engine, prompt_of(100),
                              lambda: Failing(monkeypatch, "scatter"))
    finally:
        engine.shutdown()


def test_load_after_a_failed_load_succeeds(monkeypatch):
    """A failed load does not spoil the chunks: the next request loads them."""
    engine = Engine(transfer(True), attention_specs([(0, "full"), (1, "full")]))
    try:
        prompt = prompt_of(100)
        holder = {}
        store_then_reload(engine, prompt,
                          lambda: holder.setdefault("f", Failing(monkeypatch, "scatter")))
        engine.poison()
        engine.reset_gpu_prefix_cache()
        engine.add(prompt + [21, 22])
        engine.run()
        assert len(engine.loads) == 2
        assert check_load(engine, engine.loads[1], prompt) == 2 * (100 // 16)
    finally:
        engine.shutdown()


def test_worker_metadata_aggregates_failures():
    """vLLM's KVOutputAggregator merges the workers' metadata with aggregate():
    a job failed on one worker of two stays failed, completed by both."""
    from kvferry.vllm.offloading import KvferryWorkerMetadata

    one, two = KvferryWorkerMetadata(), KvferryWorkerMetadata()
    one.mark_completed(5)
    one.mark_failed(5)
    two.mark_completed(5)
    two.mark_completed(6)
    merged = one.aggregate(two)
    assert isinstance(merged, KvferryWorkerMetadata)
    assert merged.completed_jobs == {5: 2, 6: 1} and merged.failed_jobs == {5: 1}
    merged = two.aggregate(one)
    assert merged.completed_jobs == {5: 2, 6: 1} and merged.failed_jobs == {5: 1}
