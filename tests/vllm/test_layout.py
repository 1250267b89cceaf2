"""Geometries from vLLM's own objects: the registered KV cache tensors and the
KV cache config vLLM plans (kvferry.vllm._layout), and the objects they give."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kvferry
import kvferry.vllm
from engine import Engine, attention_specs, check_load

ROOT = Path(__file__).resolve().parents[2]


def transfer(report_failures=True, **extra):
    return kvferry.vllm.offloading_transfer_config(1 << 24, report_failures=report_failures,
                                                    **extra)


def test_dense_views_have_planes_heads_tokens():
    engine = Engine(transfer(), attention_specs([(0, "full"), (1, "full")], heads=2, head_size=64))
    try:
        layout = engine.offloader.layout
        (unit,) = layout.units
        g = unit.geometry
        assert unit.chunk_tokens == 16 and g.policy.chunk_tokens == 16
        (group,) = g.groups
        assert group.kind == kvferry.GroupKind.FULL and group.block_size == 16
        assert group.num_blocks == engine.kv_cache_config.num_blocks
        view = g.view(0, 0)
        # vLLM 0.33, LBHNC: [B][H][N][K|V], K and V 64 bf16 each.
        assert (view.planes, view.heads, view.head_bytes) == (2, 2, (128, 128))
        assert (view.plane_stride, view.token_stride, view.head_stride) == (128, 256, 16 * 256)
        assert view.block_stride == 2 * 16 * 256
        assert g.view(0, 1).offset - view.offset == engine.kv_cache_config.num_blocks * 8192
        assert layout.groups[0].object_bytes == 2 * 2 * 16 * 2 * 128   # planes, layers, T, H, D
        assert g.num_regions == 1     # one backing allocation, as vLLM allocates it
    finally:
        engine.shutdown()


def test_objects_are_canonical():
    """A stored block's object is kvferry's canonical [P][L][T][H][bytes]."""
    engine = Engine(transfer(), attention_specs([(0, "full"), (1, "full")]))
    try:
        prompt = [(i * 17) % 900 + 5 for i in range(40)]
        a = engine.add(prompt)
        engine.run()
        worker = engine.offloader
        block0 = engine.tables[a.request_id][0][0]
        (chunk,) = [c for c in range(worker.num_chunks) if worker.mover.state[c] == 1][:1]
        obj = torch.frombuffer(bytearray(worker.chunk_object(chunk, 0)), dtype=torch.uint8)
        layers = [engine.kv_caches[n].view(torch.uint8)[block0]        # [H, N, C]
                  for n in sorted(engine.kv_caches)]
        planes = []
        for p in range(2):
            for layer in layers:
                planes.append(layer[:, :, p * 128:(p + 1) * 128].transpose(0, 1).reshape(-1))
        assert torch.equal(obj, torch.cat(planes))
    finally:
        engine.shutdown()


def test_mla_rows_are_one_plane():
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    specs = {"model.layers.%d.self_attn.attn" % i:
             MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
             for i in range(2)}
    engine = Engine(transfer(), specs)
    try:
        view = engine.offloader.layout.units[0].geometry.view(0, 0)
        assert (view.planes, view.heads, view.head_bytes[0], view.token_stride) == \
            (1, 1, 1152, 1152)                 # 576 bf16: one latent row per token
        prompt = [(i * 13) % 900 + 5 for i in range(70)]
        engine.add(prompt)
        engine.run()
        engine.poison()
        engine.reset_gpu_prefix_cache()
        engine.add(prompt + [3])
        engine.run()
        (load,) = engine.loads
        assert check_load(engine, load, prompt) == 2 * (70 // 16)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("connector", [True, False])
def test_kernel_block_split(connector):
    """Blocks of 32 tokens that the attention backend splits into kernel
    blocks of 16: kvferry sees 2 blocks per vLLM block."""
    specs = attention_specs([(0, "full"), (1, "full")], block_size=32)
    engine = Engine(transfer(connector), specs, block_size=32, kernel_block_size=16)
    try:
        assert engine.kv_caches["model.layers.0.self_attn.attn"].shape[0] == \
            2 * engine.kv_cache_config.num_blocks
        (plan,) = engine.offloader.layout.groups
        if connector:
            assert (plan.ratio, plan.tokens) == (2, 32)
            assert engine.offloader.layout.units[0].geometry.groups[0].block_size == 16
        prompt = [(i * 19) % 900 + 5 for i in range(100)]
        engine.add(prompt)
        engine.run()
        engine.poison()
        engine.reset_gpu_prefix_cache()
        engine.add(prompt + [3])
        engine.run()
        (load,) = engine.loads
        assert check_load(engine, load, prompt) == 2 * (100 // 32)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("blocks_per_chunk", [2, 3])
def test_blocks_per_chunk(blocks_per_chunk):
    """CPU chunks of several blocks (vLLM's blocks_per_chunk): each block's
    object is a sub-block of its chunk, and a load may start inside one."""
    engine = Engine(transfer(blocks_per_chunk=blocks_per_chunk),
                    attention_specs([(0, "full"), (1, "sliding"), (2, "full"), (3, "sliding")]))
    try:
        layout = engine.offloader.layout
        assert layout.slot_bytes == blocks_per_chunk * max(g.sub_stride for g in layout.groups)
        prompt = [(i * 23) % 900 + 5 for i in range(230)]
        engine.add(prompt)
        engine.run()
        engine.poison()
        engine.reset_gpu_prefix_cache()
        engine.add(prompt + [4, 5])
        engine.run()
        (load,) = engine.loads
        assert check_load(engine, load, prompt) == sum(2 * n for n in load.dst_spec.group_sizes)
        assert load.dst_spec.group_sizes[0] > 0 and load.dst_spec.group_sizes[1] > 0
    finally:
        engine.shutdown()


def test_padding_and_other_blocks_untouched():
    """Only the stored blocks' payload moves: every byte a load did not
    restore (other blocks, padding) keeps the poison it had."""
    from test_offloading import mamba_specs

    engine = Engine(transfer(), mamba_specs(), mamba=True)
    try:
        prompt = [(i * 29) % 900 + 5 for i in range(100)]
        engine.add(prompt)
        engine.run()
        engine.poison()
        engine.reset_gpu_prefix_cache()
        saved = torch.empty(0, dtype=torch.uint8).set_(
            next(iter(engine.kv_caches.values())).untyped_storage()).clone()
        from vllm.v1.kv_offload.base import GPULoadStoreSpec
        from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

        # Load one attention block's chunk and one Mamba state into blocks 40, 41.
        worker = engine.offloader
        valid = [c for c in range(worker.num_chunks) if worker.mover.state[c] == 1]
        worker.submit_load(5000, CPULoadStoreSpec(valid[:1] + valid[-1:]),
                           GPULoadStoreSpec([40, 41], group_sizes=[1, 0, 0, 1],
                                            block_indices=[0, 0, 0, 5]))
        (result,) = worker.get_finished()
        assert result.success
        after = torch.empty(0, dtype=torch.uint8).set_(
            next(iter(engine.kv_caches.values())).untyped_storage())
        changed = (after != saved).nonzero().flatten()
        page = engine.kv_cache_config.kv_cache_tensors[0].block_stride
        blocks = set((changed // page).tolist())
        assert blocks <= {40, 41}
        state = engine.specs["model.layers.3.mixer"].real_page_size_bytes
        assert int(changed[(changed // page) == 41].max()) % page < state  # not the padding
    finally:
        engine.shutdown()


def test_importing_kvferry_vllm_imports_neither_vllm_nor_torch():
    code = ("import sys, kvferry, kvferry.vllm\n"
            "assert 'vllm' not in sys.modules and 'torch' not in sys.modules, "
            "sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch'))\n"
            "print(kvferry.vllm.VLLM_VERSION)\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "0.33.0"


def test_documented_transfer_configs_are_the_tested_ones():
    """The --kv-transfer-config lines of docs/vllm.md are what the tests run,
    and vLLM's KVTransferConfig takes them."""
    from vllm.config import KVTransferConfig

    text = (ROOT / "docs" / "vllm.md").read_text()
    lines = re.findall(r"--kv-transfer-config '(\{.*?\})'", text)
    assert len(lines) >= 2, "docs/vllm.md lost its --kv-transfer-config lines"
    documented = [json.loads(line) for line in lines]
    gib = 64 << 30
    assert kvferry.vllm.offloading_transfer_config(gib) in documented
    assert kvferry.vllm.offloading_transfer_config(gib, report_failures=False) in documented
    assert kvferry.vllm.served_transfer_config("/run/kvferry") in documented
    for config in documented:
        KVTransferConfig(**config)
