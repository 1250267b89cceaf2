"""A vLLM engine on the CPU without a model: vLLM's own scheduler, KV cache
planning, KV cache allocation and connectors, and a stand-in for the model's
forward pass only (it writes known bytes into the KV cache slots of the
tokens each step computes, where a model would write its keys and values).

Everything else is vLLM's, driven in the order its model runner drives it
(``vllm/v1/worker/kv_connector_model_runner_mixin.py``): the engine core's
layout resolution and KV cache planning (``resolve_kv_cache_layout``,
``get_global_kv_cache_groups``, ``get_kv_cache_configs``), the worker's
allocation (``allocate_kv_cache``), ``Scheduler.schedule`` and
``update_from_output``, and on the worker side ``handle_preemptions``,
``bind_connector_metadata``, ``start_load_kv``, ``wait_for_save``,
``get_transfer_results``, ``get_block_ids_with_load_errors`` and
``build_connector_worker_meta``.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from vllm import SamplingParams
from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig,
                         VllmConfig)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.forward_context import ForwardContext
from vllm.utils.hashing import sha256
from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheConfig, MambaSpec
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache

EOS = 2
POISON = 0xEE

# A tiny Llama configuration: vLLM's ModelConfig reads it offline. The KV
# cache specs are given per test; the model's layers are not built.
_MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
    "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
    "num_hidden_layers": 4, "head_dim": 64, "vocab_size": 1024, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": EOS,
}
_model_dir: Optional[str] = None


def model_dir() -> str:
    global _model_dir
    if _model_dir is None:
        d = tempfile.mkdtemp(prefix="kvferry-vllm-model-")
        Path(d, "config.json").write_text(json.dumps(_MODEL_CONFIG))
        _model_dir = d
    return _model_dir


def make_vllm_config(transfer: dict, *, block_size: int = 16, max_model_len: int = 1024,
                     max_num_batched_tokens: int = 256, mamba: bool = False) -> VllmConfig:
    """vLLM's config for the engine, with ``transfer`` as --kv-transfer-config."""
    model = ModelConfig(model=model_dir(), skip_tokenizer_init=True, dtype="bfloat16",
                        max_model_len=max_model_len, seed=0)
    scheduler = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=max_num_batched_tokens,
                                max_model_len=max_model_len, is_encoder_decoder=False,
                                enable_chunked_prefill=True)
    cache = CacheConfig(block_size=block_size, enable_prefix_caching=True,
                        mamba_cache_mode="align" if mamba else "none")
    config = VllmConfig(model_config=model, scheduler_config=scheduler, cache_config=cache,
                        kv_transfer_config=KVTransferConfig(**transfer),
                        device_config=DeviceConfig("cpu"))
    # The CPU platform turns vLLM's hybrid KV cache manager off; the GPU
    # platforms, where the adapters run, keep it on (vllm/config/vllm.py).
    config.scheduler_config.disable_hybrid_kv_cache_manager = False
    return config


def plan_kv_cache(config: VllmConfig, specs: Dict[str, object],
                  memory: int) -> Tuple[KVCacheConfig, KVCacheLayout]:
    """The engine core's layout resolution and KV cache planning."""
    layout = resolve_kv_cache_layout(config, [[m.name for m in KVCacheLayout]], list(specs.values()))
    groups = get_global_kv_cache_groups(config, [specs])
    (kv_cache_config,) = get_kv_cache_configs(config, [specs], [memory], groups)
    kv_cache_config.kv_cache_layout = layout.name
    config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    return kv_cache_config, layout


class Engine:
    """vLLM's scheduler and worker-side connector over CPU KV cache tensors."""

    def __init__(self, transfer: dict, specs: Dict[str, object], *, memory: int = 1 << 22,
                 block_size: int = 16, max_num_batched_tokens: int = 256,
                 mamba: bool = False, kernel_block_size: Optional[int] = None,
                 kv_alloc=None) -> None:
        """``kv_alloc(kv_cache_config, device, layout, kernel_block_sizes)``
        allocates the KV cache instead of vLLM's ``allocate_kv_cache`` (the
        served connector's tests: memory kvferryd can import)."""
        self.config = make_vllm_config(transfer, block_size=block_size,
                                       max_num_batched_tokens=max_num_batched_tokens, mamba=mamba)
        self.kv_cache_config, self.layout = plan_kv_cache(self.config, specs, memory)
        self.specs = specs
        self.scheduler = Scheduler(vllm_config=self.config, kv_cache_config=self.kv_cache_config,
                                   structured_output_manager=StructuredOutputManager(self.config),
                                   block_size=self.scheduler_block_size(), log_stats=True)
        self.worker = KVConnectorFactory.create_connector(
            config=self.config, role=KVConnectorRole.WORKER, kv_cache_config=self.kv_cache_config)
        kernel = None
        if kernel_block_size is not None:  # the attention backend splits blocks
            kernel = [kernel_block_size] * len(self.kv_cache_config.kv_cache_groups)
        self.kv_caches = (kv_alloc or allocate_kv_cache)(
            self.kv_cache_config, torch.device("cpu"), self.layout, kernel_block_sizes=kernel)
        self.worker.register_kv_caches(self.kv_caches)
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(self.hash_block_size(), sha256)
        self.tables: Dict[str, List[List[int]]] = {}   # req id -> block ids per group
        self.tokens: Dict[str, List[int]] = {}
        self.outputs: List[KVConnectorOutput] = []
        self.loads: List[object] = []                  # load jobs the scheduler made
        self._ctx = ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={})
        self._next_id = 0

    def scheduler_block_size(self) -> int:
        from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

        return resolve_kv_cache_block_sizes(self.kv_cache_config, self.config)[0]

    def hash_block_size(self) -> int:
        from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

        return resolve_kv_cache_block_sizes(self.kv_cache_config, self.config)[1]

    @property
    def manager(self):
        """vLLM's offloading manager on the scheduler side."""
        return self.scheduler.connector.connector_scheduler.manager

    def offloader_config_groups(self):
        """The offloaded groups, in the order of a job's group sizes."""
        return self.worker.connector_worker.spec.config.groups

    @property
    def offloader(self):
        """The spec's worker (kvferry's KvferryOffloadingWorker)."""
        return self.worker.connector_worker.worker

    # -- requests ------------------------------------------------------------

    def add(self, prompt: Sequence[int], max_tokens: int = 1) -> Request:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        params.update_from_generation_config({}, EOS)
        request = Request(request_id="r%d" % self._next_id, prompt_token_ids=list(prompt),
                          sampling_params=params, pooling_params=None, block_hasher=self.hasher)
        self._next_id += 1
        self.tokens[request.request_id] = list(prompt)
        self.scheduler.add_request(request)
        return request

    # -- the model's stand-in --------------------------------------------------

    @staticmethod
    def pattern(layer: int, positions: torch.Tensor, tokens: torch.Tensor, width: int) -> torch.Tensor:
        """The bytes the stand-in writes for tokens at positions: [n, width]."""
        base = positions * 131 + tokens * 7 + layer * 29 + 3
        return ((base[:, None] + torch.arange(width)[None, :] * 5) % 251).to(torch.uint8)

    def layer_views(self):
        """(index, name, group, [B, H, N, C bytes] view) of the attention layers."""
        out = []
        for gi, group in enumerate(self.kv_cache_config.kv_cache_groups):
            for name in group.layer_names:
                spec = self.specs[name]
                if isinstance(spec, AttentionSpec):
                    layer = int(name.split(".")[2])
                    out.append((layer, name, gi, self.kv_caches[name].view(torch.uint8)))
        return out

    def mamba_views(self):
        out = []
        for gi, group in enumerate(self.kv_cache_config.kv_cache_groups):
            for name in group.layer_names:
                if isinstance(self.specs[name], MambaSpec):
                    out.append((int(name.split(".")[2]), name, gi,
                                self.kv_caches[name].view(torch.uint8)[:, 0, 0, :]))
        return out

    def group_block_size(self, gi: int) -> int:
        return self.kv_cache_config.kv_cache_groups[gi].kv_cache_spec.block_size

    def _forward(self, req_id: str, start: int, count: int) -> None:
        """Write the KV of tokens [start, start+count) of a request."""
        if count <= 0:
            return
        tokens = torch.tensor(self.tokens[req_id][start:start + count])
        positions = torch.arange(start, start + count)
        for layer, name, gi, view in self.layer_views():
            table = torch.tensor(self.tables[req_id][gi])
            bs = self.group_block_size(gi)
            ratio = view.shape[0] // self.kv_cache_config.num_blocks
            kblocks = table[positions // bs] * ratio + (positions % bs) // view.shape[2]
            offsets = positions % view.shape[2]
            keep = table[positions // bs] != 0
            values = self.pattern(layer, positions, tokens, view.shape[1] * view.shape[3])
            view[kblocks[keep], :, offsets[keep], :] = values[keep].view(-1, view.shape[1],
                                                                           view.shape[3])
        for layer, name, gi, pages in self.mamba_views():
            # Mamba in vLLM's align mode: the state after every block
            # boundary the step crosses is kept in that block, the running
            # state after the last token in the block holding it.
            table, bs, end = self.tables[req_id][gi], self.group_block_size(gi), start + count
            marks = [(k + 1) * bs for k in range(start // bs, end // bs) if (k + 1) * bs > start]
            if end % bs:
                marks.append(end)
            for mark in marks:
                block = table[(mark - 1) // bs]
                if block:
                    pages[block] = self.mamba_state(layer, mark, pages.shape[1])

    def mamba_state(self, layer: int, tokens: int, width: int) -> torch.Tensor:
        """The state the stand-in keeps after ``tokens`` tokens."""
        return self.pattern(layer, torch.tensor([tokens]), torch.tensor([1]), width)[0]

    # -- one engine step ----------------------------------------------------------

    def step(self, before_worker=None):
        """One step; ``before_worker(scheduler_output)`` runs between the
        scheduler and the worker (what may happen between them)."""
        out = self.scheduler.schedule()
        meta = out.kv_connector_metadata
        self.loads.extend(getattr(meta, "load_jobs", {}).values())
        if before_worker is not None:
            before_worker(out)
        for new in out.scheduled_new_reqs:
            self.tables[new.req_id] = [list(ids) for ids in new.block_ids]
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                self.tables[req_id] = [list(ids) for ids in new_ids]
            elif new_ids is not None:
                for table, ids in zip(self.tables[req_id], new_ids):
                    table.extend(ids)
        # The worker, in the model runner's order.
        self.worker.handle_preemptions(meta)
        self.worker.bind_connector_metadata(meta)
        if out.has_sync_kv_loads:
            self.worker.start_load_kv(self._ctx)
        computed = {new.req_id: new.num_computed_tokens for new in out.scheduled_new_reqs}
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        for req_id, n in out.num_scheduled_tokens.items():
            self._forward(req_id, computed[req_id], n)
        if not out.has_sync_kv_loads:
            self.worker.start_load_kv(self._ctx)
        self.worker.wait_for_save()
        results = self.worker.get_transfer_results(out.finished_req_ids)
        kv_out = KVConnectorOutput(finished_sending=results.finished_sending,
                                   finished_recving=results.finished_recving,
                                   failed_recving=results.failed_recving,
                                   invalid_block_ids=self.worker.get_block_ids_with_load_errors(),
                                   kv_connector_worker_meta=self.worker.build_connector_worker_meta())
        self.outputs.append(kv_out)
        self.worker.clear_connector_metadata()
        # Sample one token per request that reached the end of its tokens.
        req_ids, sampled = [], []
        for req_id, n in out.num_scheduled_tokens.items():
            req_ids.append(req_id)
            done = computed[req_id] + n >= len(self.tokens[req_id])
            token = (computed[req_id] + n) % 1000 + 10 if done else None
            sampled.append([token] if token is not None else [])
            if token is not None:
                self.tokens[req_id].append(token)
        runner = ModelRunnerOutput(req_ids=req_ids,
                                   req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                   sampled_token_ids=sampled, kv_connector_output=kv_out)
        self.scheduler.update_from_output(out, runner)
        return out

    def run(self, max_steps: int = 200, before_worker=None) -> None:
        """Step until no request is left and every transfer has completed."""
        for _ in range(max_steps):
            if not self.scheduler.requests and not self.scheduler.connector.has_pending_push_work():
                return
            self.step(before_worker)
        raise AssertionError("the engine did not finish in %d steps" % max_steps)

    def poison(self) -> None:
        """Overwrite the whole KV cache (what other requests would do)."""
        for t in {id(t.untyped_storage()): t for t in self.kv_caches.values()}.values():
            torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).fill_(POISON)

    def reset_gpu_prefix_cache(self) -> None:
        assert self.scheduler.reset_prefix_cache(reset_connector=False)

    def shutdown(self) -> None:
        self.worker.shutdown()
        self.scheduler.connector.shutdown()


def expected_block(engine: Engine, layer: int, view: torch.Tensor, tokens: Sequence[int],
                   block_index: int, bs: int) -> torch.Tensor:
    """What block ``block_index`` of a request with ``tokens`` holds: [H, N, C]."""
    positions = torch.arange(block_index * bs, (block_index + 1) * bs)
    toks = torch.tensor([tokens[p] for p in positions.tolist()])
    return engine.pattern(layer, positions, toks, view.shape[1] * view.shape[3]).view(
        bs, view.shape[1], view.shape[3]).transpose(0, 1)


def attention_specs(names: Iterable[Tuple[int, str]], *, block_size: int = 16, heads: int = 2,
                    head_size: int = 64, window: int = 64, dtype=torch.bfloat16):
    """Layer specs as vLLM's attention layers report them."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    specs = {}
    for layer, kind in names:
        name = "model.layers.%d.self_attn.attn" % layer
        if kind == "full":
            specs[name] = FullAttentionSpec(block_size=block_size, num_kv_heads=heads,
                                            head_size=head_size, dtype=dtype)
        else:
            specs[name] = SlidingWindowSpec(block_size=block_size, num_kv_heads=heads,
                                            head_size=head_size, dtype=dtype,
                                            sliding_window=window)
    return specs


def check_load(engine: Engine, load, tokens: Sequence[int]) -> int:
    """Check every block a load job wrote against what the stand-in model
    wrote for ``tokens``; returns the blocks checked."""
    spec = load.dst_spec
    ids = list(spec.block_ids)
    offsets = [0]
    for n in spec.group_sizes:
        offsets.append(offsets[-1] + n)
    offloaded = [g.group_id for g in engine.offloader_config_groups()]
    checked = 0
    views = engine.layer_views()
    mamba = engine.mamba_views()
    for k, (n, start) in enumerate(zip(spec.group_sizes, spec.block_indices)):
        gi = offloaded[k]
        bs = engine.group_block_size(gi)
        for layer, name, g, view in views:
            if g != gi:
                continue
            for i in range(n):
                block = ids[offsets[k] + i]
                want = expected_block(engine, layer, view, tokens, start + i, bs)
                ratio = view.shape[0] // engine.kv_cache_config.num_blocks
                got = view[block * ratio:(block + 1) * ratio].transpose(0, 1).reshape(
                    view.shape[1], -1, view.shape[3])
                assert torch.equal(got, want), (name, start + i, block)
                checked += 1
        for layer, name, g, pages in mamba:
            if g != gi:
                continue
            state_bytes = engine.specs[name].real_page_size_bytes
            for i in range(n):
                block = ids[offsets[k] + i]
                want = engine.mamba_state(layer, (start + i + 1) * bs, pages.shape[1])
                assert torch.equal(pages[block, :state_bytes], want[:state_bytes]), (name, block)
                # The padding of the page is not the state's: never written.
                padding = torch.empty(0, dtype=torch.uint8).set_(pages.untyped_storage())[
                    block * pages.stride(0) + state_bytes:(block + 1) * pages.stride(0)]
                assert bool((padding == POISON).all()), (name, block)
                checked += 1
    return checked
