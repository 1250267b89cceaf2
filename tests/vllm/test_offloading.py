"""The kvferry offloading spec in vLLM's offloading connector, on the CPU:
store, hit query, load into other blocks, byte for byte."""

import pytest
import torch

import kvferry
import kvferry.vllm
from engine import POISON, Engine, attention_specs, check_load, expected_block

CONNECTORS = {"kvferry": True, "vllm": False}


def transfer(report_failures=True, **extra):
    return kvferry.vllm.offloading_transfer_config(1 << 24, report_failures=report_failures,
                                                    **extra)


@pytest.mark.parametrize("connector", sorted(CONNECTORS))
def test_store_lookup_load_dense(connector):
    specs = attention_specs([(0, "full"), (1, "full")])
    engine = Engine(transfer(CONNECTORS[connector]), specs)
    try:
        from kvferry.vllm.offloading import KvferryOffloadingWorker

        assert isinstance(engine.offloader, KvferryOffloadingWorker)
        layout = engine.offloader.layout
        assert layout.source == ("registered" if CONNECTORS[connector] else "canonical")
        prompt = [(i * 37) % 900 + 5 for i in range(100)]
        a = engine.add(prompt)
        engine.run()
        a_blocks = engine.tables[a.request_id][0]
        stored = 100 // 16
        # The stored blocks are in the CPU pool: 6 chunks, one per block.
        assert engine.manager._num_allocated_chunks == stored

        engine.poison()
        engine.reset_gpu_prefix_cache()
        b = engine.add(prompt + [7, 8, 9])
        engine.run()
        assert len(engine.loads) == 1
        load = engine.loads[0]
        assert sum(load.dst_spec.group_sizes) == stored
        b_blocks = engine.tables[b.request_id][0]
        loaded = list(load.dst_spec.block_ids)
        assert loaded == b_blocks[:stored]
        assert not set(loaded) & set(a_blocks[:stored]), "B must load into other blocks"
        for layer, name, gi, view in engine.layer_views():
            for i, block in enumerate(loaded):
                want = expected_block(engine, layer, view, prompt, i, 16)
                assert torch.equal(view[block], want), (name, i, block)
        # Blocks no one wrote since the poison stay poison.
        used = set()
        for table in engine.tables.values():
            used.update(table[0])
        for layer, name, gi, view in engine.layer_views():
            for block in range(engine.kv_cache_config.num_blocks):
                if block not in used:
                    assert bool((view[block] == POISON).all()), (name, block)
        assert all(not o.invalid_block_ids and not o.failed_recving for o in engine.outputs)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("connector", sorted(CONNECTORS))
def test_store_lookup_load_hybrid_sliding_window(connector):
    """Full attention and sliding-window layers sharing one tensor per layer
    pair (vLLM's hybrid allocation): each group's chunks apart, one kvf_xfer
    call per job with the registered tensors."""
    specs = attention_specs([(0, "full"), (1, "sliding"), (2, "full"), (3, "sliding")])
    engine = Engine(transfer(CONNECTORS[connector]), specs)
    try:
        layout = engine.offloader.layout
        assert len(layout.groups) == 2
        assert len(layout.units) == (1 if CONNECTORS[connector] else 2)
        if CONNECTORS[connector]:
            geometry = layout.units[0].geometry
            assert geometry.num_object_groups == 2 and geometry.num_aliases == 2
        prompt = [(i * 53) % 900 + 5 for i in range(200)]
        engine.add(prompt)
        engine.run()
        engine.poison()
        engine.reset_gpu_prefix_cache()
        engine.add(prompt + [11, 12])
        engine.run()
        assert len(engine.loads) == 1
        load = engine.loads[0]
        full, sliding = load.dst_spec.group_sizes
        assert full == 200 // 16 and 0 < sliding < full, load.dst_spec.group_sizes
        assert check_load(engine, load, prompt) == 2 * (full + sliding)
    finally:
        engine.shutdown()


def mamba_specs(block_size=16):
    from vllm.v1.kv_cache_interface import MambaSpec

    specs = attention_specs([(0, "full")], block_size=block_size)
    for layer in (1, 2, 3):
        specs["model.layers.%d.mixer" % layer] = MambaSpec(
            block_size=block_size, shapes=((3, 96), (4, 16, 16)),
            dtypes=(torch.bfloat16, torch.float32), mamba_cache_mode="align")
    return specs


@pytest.mark.parametrize("connector", sorted(CONNECTORS))
def test_store_lookup_load_mamba_padded_pages(connector):
    """Attention and Mamba layers over one allocation, Mamba pages padded to
    the attention page (vLLM's hybrid planning): the states move without
    their padding, each Mamba group its own object group."""
    engine = Engine(transfer(CONNECTORS[connector]), mamba_specs(), mamba=True)
    try:
        layout = engine.offloader.layout
        assert layout.groups[1].object_bytes == 4672      # the page's padding stays behind
        if CONNECTORS[connector]:
            assert [g.kind.name for g in layout.groups] == ["FULL"] + ["RECURRENT"] * 3
            assert len(layout.units) == 1
            geometry = layout.units[0].geometry
            assert geometry.num_object_groups == 4
            mamba = geometry.view(1, 0)
            assert mamba.block_stride == 8192 and [s.bytes for s in mamba.states] == [576, 4096]
        else:
            assert len(layout.units) == 4                 # pages: a unit per group
        prompt = [(i * 41) % 900 + 5 for i in range(100)]
        engine.add(prompt)
        engine.run()
        engine.poison()
        engine.reset_gpu_prefix_cache()
        engine.add(prompt + [11, 12])
        engine.run()
        assert len(engine.loads) == 1
        load = engine.loads[0]
        # The attention blocks of the hit, and each Mamba group's state at its end.
        assert list(load.dst_spec.group_sizes) == [6, 1, 1, 1]
        assert list(load.dst_spec.block_indices) == [0, 5, 5, 5]
        assert check_load(engine, load, prompt) == 6 + 3
    finally:
        engine.shutdown()
