"""KvferryConnector: vLLM's KV cache served by kvferryd (loaded by module path).

One ``--kv-transfer-config`` line turns it on (docs/vllm.md):
``{"kv_connector": "KvferryConnector", "kv_connector_module_path":
"kvferry.vllm.connector", "kv_role": "kv_both", "kv_load_failure_policy":
"recompute", "kv_connector_extra_config": {"kvferry_socket_dir": DIR}}``.
kvferryd keeps the objects across engine restarts and shares them between
engines of the same model and parallel layout on the machine.

Worker side (each tensor-parallel rank): the KV cache is allocated from
kvferry's exportable pool (:meth:`KvferryConnector.get_mem_pool_context`,
GPU), its geometry is built from the registered tensors and the KV cache
config by the in-process spec's code (:func:`._layout.layout_from_registered`:
groups, kinds, windows, Mamba states, padded pages) and registered with
kvferryd as shard ``rank`` of ``tp``. RETRIEVEs run in ``start_load_kv``,
STOREs of the chunks each step completed in ``wait_for_save`` (on a GPU
with an interprocess CUDA event recorded after the forward pass, which
kvferryd's stream waits for). Failed loads are reported to vLLM's scheduler
(``failed_recving``; the block ids too for one KV cache group). When
kvferryd restarts the worker connects again and registers again.

Scheduler side: the hit query is a LOOKUP with a short pin; the loads are
asynchronous (the request waits in ``WAITING_FOR_REMOTE_KVS``). LOOKUP needs a
registration of the same canonical geometry: the scheduler registers a
one-block twin in kvferry host memory, built by the same code from vLLM's
own view functions, and checks its fingerprint against the workers'.

Chunk keys come from vLLM's block hashes: kvferry chunk ``k`` (tokens
``[k*C, (k+1)*C)``) is named ``SHA-256(seed || block_hashes[(k+1)*C/h - 1])``
with ``h`` vLLM's hash block size. vLLM chains its hashes (each hashes its
parent's hash, the block's tokens and the extra keys: LoRA, multimodal
hashes, cache salt), so the hash of a chunk's last block names the whole
prefix up to the chunk's end; the seed folds in what vLLM's hash does not
(the model, its revision, dtypes and the hash algorithm; vLLM's NONE_HASH,
the first block's parent, is in the hashes already). kvferryd scopes
objects by the geometry's canonical fingerprint and the shard.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch

import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                               KVConnectorMetadata,
                                                               KVConnectorRole,
                                                               KVConnectorTransferResults,
                                                               KVConnectorWorkerMetadata,
                                                               SupportsHMA)
from vllm.v1.kv_cache_interface import (KVCacheTensor, MambaSpec, UniformTypeKVCacheSpecs,
                                        create_kv_cache_views)

from .. import client as kvc
from .._errors import KvferryError, Status
from ..geometry import Geometry, GroupKind
from ..memory import Allocation, MemProvider
from . import CONNECTOR_MODULE, VLLM_VERSION
from ._layout import Layout, layout_from_registered

logger = logging.getLogger("vllm.kvferry.connector")

if vllm.__version__.split("+")[0] != VLLM_VERSION:
    logger.warning("kvferry.vllm is written and tested against vLLM %s; this is vLLM %s",
                   VLLM_VERSION, vllm.__version__)

__all__ = ["KvferryConnector", "KvferryConnectorMetadata", "KvferryWorkerMetadata",
           "ServedSettings", "host_kv_caches", "served_transfer_config"]

#: vLLM's null block (``BlockPool.null_block``, the first block popped at
#: start): blocks a sliding window dropped and unallocated slots hold it.
NULL_BLOCK = 0
SKIP = -1


def served_transfer_config(socket_dir: str, **extra_config: Any) -> Dict[str, Any]:
    """The ``--kv-transfer-config`` of the served connector, as a dict
    (``json.dumps`` it, or pass it to ``vllm.config.KVTransferConfig(**...)``);
    ``extra_config``: more ``kv_connector_extra_config`` keys."""
    extra: Dict[str, Any] = {"kvferry_socket_dir": str(socket_dir)}
    extra.update(extra_config)
    return {"kv_connector": "KvferryConnector", "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra}


# ---- settings --------------------------------------------------------------------------

@dataclass
class _Group:
    """One prefix-cacheable vLLM group (what kvferry stores)."""

    group_id: int
    layer_names: List[str] = field(default_factory=list)  # empty: the group's own


@dataclass
class ServedSettings:
    """``kv_connector_extra_config`` keys and what is derived from vLLM's config."""

    socket_dir: str
    chunk_tokens: int          #: C, tokens per kvferry chunk (kvferry_chunk_tokens)
    hash_block_size: int       #: tokens per vLLM block hash
    block_sizes: Dict[int, int]  #: prefix-cacheable group id -> vLLM block size
    recurrent: Set[int]        #: group ids of Mamba groups
    pin_ms: int
    timeout_ms: int
    reconnect_ms: int
    seed: bytes
    tp_size: int
    groups: List[_Group]
    num_groups: int            #: all KV cache groups of the config

    @classmethod
    def from_config(cls, vllm_config: Any, kv_cache_config: Any) -> "ServedSettings":
        from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

        extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
        socket_dir = extra.get("kvferry_socket_dir") or os.environ.get("KVFERRY_SOCKET_DIR")
        if not socket_dir:
            raise ValueError("KvferryConnector: kv_connector_extra_config.kvferry_socket_dir "
                             "(kvferryd's --socket-dir) is required")
        chunk = int(extra.get("kvferry_chunk_tokens", 256))
        hbs = int(resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)[1])
        groups, sizes, recurrent = [], {}, set()
        for gid in kv_cache_config.prefix_cacheable_group_ids:
            spec = kv_cache_config.kv_cache_groups[gid].kv_cache_spec
            if isinstance(spec, UniformTypeKVCacheSpecs):
                spec = next(iter(spec.kv_cache_specs.values()))
            groups.append(_Group(int(gid)))
            sizes[int(gid)] = int(spec.block_size)
            if isinstance(spec, MambaSpec):
                recurrent.add(int(gid))
        if not groups:
            raise ValueError("KvferryConnector: the KV cache config has no prefix-cacheable "
                             "group: nothing kvferryd could store")
        what = "kv_connector_extra_config.kvferry_chunk_tokens"
        if chunk <= 0:
            raise ValueError("KvferryConnector: %s must be positive, not %d" % (what, chunk))
        for gid, bs in sorted(sizes.items()):
            if chunk % bs:
                raise ValueError("KvferryConnector: %s = %d is not a whole number of KV cache "
                                 "group %d's blocks of %d tokens" % (what, chunk, gid, bs))
        if chunk % hbs:
            raise ValueError("KvferryConnector: %s = %d is not a whole number of vLLM's hash "
                             "blocks of %d tokens" % (what, chunk, hbs))
        parallel = vllm_config.parallel_config
        if int(getattr(parallel, "decode_context_parallel_size", 1) or 1) > 1:
            raise ValueError("KvferryConnector: decode context parallelism is not supported")
        if int(getattr(parallel, "pipeline_parallel_size", 1) or 1) > 1:
            raise ValueError("KvferryConnector: pipeline parallelism is not supported")
        model, cache = vllm_config.model_config, vllm_config.cache_config
        algo = str(getattr(cache, "prefix_caching_hash_algo", "sha256"))
        if not algo.startswith("sha256") and os.environ.get("PYTHONHASHSEED") is None:
            logger.warning("KvferryConnector: prefix_caching_hash_algo %s hashes with a random "
                           "per-process seed unless PYTHONHASHSEED is set: kvferryd's objects "
                           "will not be found by another engine process", algo)
        seed_text = "|".join(str(x) for x in (
            "kvferry-vllm-v1", model.model, getattr(model, "revision", None), model.dtype,
            cache.cache_dtype, algo, extra.get("kvferry_key_salt", "")))
        if kvc.KEY_BYTES == 32:
            seed = kvc.chunk_seed(seed_text.encode("utf-8"))
        else:  # a version-1 library (uint64 keys): the same rule, 8 bytes kept
            seed = hashlib.sha256(b"kvferry-seed-v1" + seed_text.encode("utf-8")).digest()
        return cls(str(socket_dir), chunk, hbs, sizes, recurrent,
                   int(extra.get("kvferry_pin_ms", 10000)),
                   int(extra.get("kvferry_timeout_ms", 10000)),
                   int(extra.get("kvferry_reconnect_ms", 1000)), seed,
                   int(parallel.tensor_parallel_size), groups,
                   len(kv_cache_config.kv_cache_groups))

    def key(self, block_hash: bytes) -> Any:
        """The chunk key of a chunk whose last vLLM block has ``block_hash``."""
        digest = hashlib.sha256(self.seed + bytes(block_hash)).digest()
        if kvc.KEY_BYTES == 32:
            return digest
        return int.from_bytes(digest[:8], "little") or 1


# ---- KV caches in kvferry host memory --------------------------------------------------

def host_kv_caches(kv_cache_config: Any, layout: Any, kernel_block_sizes: Optional[List[int]] = None,
                   name: str = "vllm-kv-cache") -> Tuple[Dict[str, torch.Tensor], Allocation]:
    """vLLM's ``allocate_kv_cache`` on the CPU, over kvferry host memory that
    kvferryd can import: one :class:`kvferry.Allocation` (a sealed memfd) as
    the backing int8 buffer, viewed per layer by vLLM's own
    ``create_kv_cache_views`` as ``allocate_kv_cache`` does. Returns the
    layer tensors and the allocation (keep it open while they are used).
    On a GPU, allocate inside :meth:`KvferryConnector.get_mem_pool_context`
    instead."""
    import numpy as np

    from vllm.v1.kv_cache_layout import KVCacheLayout

    if isinstance(layout, str):
        layout = KVCacheLayout[layout]
    tensors = list(kv_cache_config.kv_cache_tensors)
    sizes = {t.size for t in tensors}
    if len(sizes) != 1:
        raise ValueError("KV cache tensors must share one backing allocation")
    size = sizes.pop()
    alloc = Allocation.create(max(size, 1), provider=MemProvider.HOST, name=name)
    buf = torch.from_numpy(np.asarray(alloc)).view(torch.int8)[:size]
    kv_caches: Dict[str, torch.Tensor] = {}
    for tensor in tensors:
        layer = tensor.layers[0]
        group_id, group = next((i, g) for i, g in enumerate(kv_cache_config.kv_cache_groups)
                               if layer in g.layer_names)
        spec = group.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            spec = spec.kv_cache_specs[layer]
        if not spec.has_layer_views:
            kv_caches.update((n, buf) for n in tensor.layers)
            continue
        kernel = None
        if kernel_block_sizes is not None and group_id < len(kernel_block_sizes):
            kernel = kernel_block_sizes[group_id]
        views = create_kv_cache_views(buf, spec, kv_cache_config.num_blocks_of(tensor), layout,
                                      tensor, kernel_block_size=kernel)
        kv_caches.update(zip(tensor.layers, views))
    return kv_caches, alloc


def _twin_caches(kv_cache_config: Any) -> Tuple[Dict[str, torch.Tensor], Allocation, Any]:
    """One block of every layer, in kvferry host memory, as vLLM views it:
    the scheduler's twin of the workers' caches (the same canonical geometry,
    which is all LOOKUP needs)."""
    import copy

    twin = copy.copy(kv_cache_config)
    twin.num_blocks = 1
    tensors, offset = [], 0
    for t in kv_cache_config.kv_cache_tensors:
        layer = t.layers[0]
        group = next(g for g in kv_cache_config.kv_cache_groups if layer in g.layer_names)
        spec = group.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            spec = spec.kv_cache_specs[layer]
        page = int(spec.page_size_bytes)
        n = len(t.layers)
        tensors.append(KVCacheTensor(size=0, layers=list(t.layers), layer_stride=page,
                                     block_stride=page * n, offset=offset))
        offset += page * n
    for t in tensors:
        t.size = offset
    twin.kv_cache_tensors = tensors
    # The engine core's layout (strides never change a canonical fingerprint:
    # any layout gives the twin the workers' fingerprint).
    layout = getattr(kv_cache_config, "kv_cache_layout", None) or "LBHNC"
    caches, alloc = host_kv_caches(twin, layout, name="vllm-kv-twin")
    return caches, alloc, twin


def _regions(geometry: Geometry, provider: MemProvider) -> List[Tuple[Allocation, int, int]]:
    """(allocation, offset, length) of every region: the exportable
    allocation holding the region's memory."""
    out = []
    for i, region in enumerate(geometry.regions):
        base = geometry.bases[i]
        try:
            alloc = Allocation.find(base.ptr, provider=provider)
        except KvferryError as e:
            raise KvferryError(e.status, "region %d (%s) is not in memory kvferryd can import: "
                               "allocate the KV cache inside the connector's "
                               "get_mem_pool_context() on a GPU, or with "
                               "kvferry.vllm.connector.host_kv_caches on the CPU (%s)"
                               % (i, region.name, e.message), "kv_caches") from None
        out.append((alloc, base.ptr - alloc.ptr, int(region.size)))
    return out


# ---- the connection ---------------------------------------------------------------------

class _Link:
    """One kvferryd connection with its registration, made again after a
    kvferryd restart (``server_restarted``) or a lost connection."""

    def __init__(self, settings: ServedSettings, name: str,
                 register: Callable[[Any], Any]) -> None:
        self.settings = settings
        self.name = name
        self._register = register
        self.client: Optional[Any] = None
        self.registration: Optional[Any] = None
        self.registrations = 0          #: registrations made (1 + reconnections)
        self.boot_token = 0
        self._next_try = 0.0
        self._warned = False

    def get(self, raise_errors: bool = False) -> Optional[Any]:
        """The connected, registered client, or None (kvferryd is down, or
        refused the registration: tried again every kvferry_reconnect_ms).
        ``raise_errors``: a refused registration raises (at start)."""
        c = self.client
        if c is not None:
            try:
                restarted = c.server_restarted
            except KvferryError:
                restarted = True
            if not restarted:
                return c
            logger.warning("kvferry connector %s: kvferryd restarted; connecting and "
                           "registering again", self.name)
            self.drop()
        now = time.monotonic()
        if now < self._next_try:
            return None
        self._next_try = now + self.settings.reconnect_ms / 1000.0
        try:
            c = kvc.Client.connect(self.settings.socket_dir, name=self.name,
                                   timeout_ms=self.settings.timeout_ms, heartbeat=True)
        except KvferryError as e:
            if not self._warned:
                logger.warning("kvferry connector %s: kvferryd at %s is not reachable (%s); "
                               "no KV transfers until it is", self.name,
                               self.settings.socket_dir, e)
                self._warned = True
            return None
        try:
            self.registration = self._register(c)
        except KvferryError as e:
            c.close()
            if raise_errors:
                raise
            logger.error("kvferry connector %s: kvferryd refused the registration: %s",
                         self.name, e)
            return None
        except BaseException:
            c.close()
            raise
        self.client, self._warned = c, False
        self.boot_token = c.info.boot_token
        self.registrations += 1
        logger.info("kvferry connector %s: registered with kvferryd (pid %d): registration %d, "
                    "fingerprint %016x", self.name, c.info.server_pid,
                    self.registration.registration_id, self.registration.fingerprint)
        return c

    def lost(self, error: KvferryError) -> None:
        """A call failed: forget the connection if it is gone."""
        if error.status == Status.DISCONNECTED or \
                (self.client is not None and self.client.server_restarted):
            self.drop()
            self._next_try = 0.0

    def drop(self) -> None:
        if self.client is not None:
            try:
                self.client.close()
            except KvferryError:
                pass
        self.client = None
        self.registration = None

    def close(self) -> None:
        if self.client is not None and self.registration is not None:
            try:
                self.client.unregister()
            except KvferryError:
                pass
        self.drop()


# ---- metadata -------------------------------------------------------------------------

@dataclass
class _Op:
    """One STORE or RETRIEVE of one request: tokens [token_begin, token_end),
    the keys of its chunks, the request's block ids per KV cache group (index:
    group id; only the blocks up to token_end)."""

    req_id: str
    token_begin: int
    token_end: int
    keys: List[Any]
    block_ids: List[List[int]]
    skip_tokens: int = 0          #: RETRIEVE: tokens already computed locally (not written)


@dataclass
class KvferryConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> workers, per step."""

    loads: List[_Op] = field(default_factory=list)
    stores: List[_Op] = field(default_factory=list)


@dataclass
class KvferryWorkerMetadata(KVConnectorWorkerMetadata):
    """Workers -> scheduler: the canonical fingerprints they registered
    (rank -> fingerprint), sent after each registration."""

    fingerprints: Dict[int, int] = field(default_factory=dict)

    def aggregate(self, other: "KVConnectorWorkerMetadata") -> "KvferryWorkerMetadata":
        merged = dict(self.fingerprints)
        merged.update(getattr(other, "fingerprints", {}) or {})
        return KvferryWorkerMetadata(merged)


# ---- worker side ----------------------------------------------------------------------

class _Worker:
    def __init__(self, settings: ServedSettings, vllm_config: Any, kv_cache_config: Any) -> None:
        self.settings = settings
        self.kv_cache_config = kv_cache_config
        self.cuda = vllm_config.device_config.device_type == "cuda"
        self.rank = 0
        if settings.tp_size > 1:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self.rank = int(get_tensor_model_parallel_rank())
        self.layout: Optional[Layout] = None
        self.geometry: Optional[Geometry] = None
        self.regions: List[Tuple[Allocation, int, int]] = []
        self.device = -1
        self.link: Optional[_Link] = None
        self._loads: Dict[int, Tuple[_Op, Any]] = {}     # request id -> (op, client)
        self._stores: Dict[int, Tuple[_Op, Any, Any]] = {}  # request id -> (op, client, event)
        self._finished_recving: Set[str] = set()
        self._failed_recving: Set[str] = set()
        self._invalid_blocks: Set[int] = set()
        self._reported_registrations = 0
        self._event: Any = None                 # the interprocess ready event (GPU)
        self._event_handle = b""
        self.stats = {"stores": 0, "store_failures": 0, "loads": 0, "load_failures": 0}

    # -- registration --

    def mem_pool_context(self) -> Any:
        if not self.cuda:
            return None
        import kvferry.torch as kvt

        device = torch.cuda.current_device()
        return torch.cuda.use_mem_pool(kvt.exportable_mem_pool(device), device=device)

    def register_kv_caches(self, kv_caches: Dict[str, torch.Tensor]) -> None:
        s = self.settings
        tokens = {s.block_sizes[g.group_id] for g in s.groups if g.group_id not in s.recurrent}
        if len(tokens) != 1:
            raise ValueError("KvferryConnector: the prefix-cacheable attention groups have "
                             "block sizes %s; kvferryd takes one geometry per registration, whose "
                             "groups share a block size" % sorted(tokens))
        bs = tokens.pop()
        layout = layout_from_registered(kv_caches, self.kv_cache_config, s.groups, 1,
                                        chunk_blocks=s.chunk_tokens // bs)
        if len(layout.units) != 1:
            layout.close()
            raise ValueError("KvferryConnector: the KV cache needs %d kvferry geometries (%s); "
                             "kvferryd takes one per registration (two full-attention groups "
                             "are not supported)" % (len(layout.units), layout.describe()))
        self.layout = layout
        self.geometry = layout.units[0].geometry
        first = next(iter(kv_caches.values()))
        if first.device.type == "cuda":
            self.device = first.device.index if first.device.index is not None \
                else torch.cuda.current_device()
            provider = MemProvider.CUMEM
        else:
            self.device, provider = -1, MemProvider.HOST
        self.regions = _regions(self.geometry, provider)
        logger.info("kvferry connector worker %d: %s, %d-token chunks, %d regions", self.rank,
                    layout.describe(), s.chunk_tokens, len(self.regions))
        self.link = _Link(s, "vllm-worker-%d" % self.rank, self._register)
        self.link.get(raise_errors=True)   # a geometry kvferryd refuses fails the start

    def _register(self, client: Any) -> Any:
        return client.register(self.geometry, self.regions, device=self.device,
                               shard_index=self.rank, shard_count=self.settings.tp_size)

    # -- block tables --

    def _tables(self, op: _Op, load: bool) -> List[Any]:
        """One entry per geometry group (kvferry.client's ``blocks``)."""
        assert self.layout is not None
        s, C = self.settings, self.settings.chunk_tokens
        unit = self.layout.units[0]
        out: List[Any] = [None] * len(unit.groups)
        for plan_index in unit.groups:
            plan = self.layout.groups[plan_index]
            ids = op.block_ids[plan.group_id] if plan.group_id < len(op.block_ids) else []
            bs = s.block_sizes[plan.group_id]
            if plan.kind == GroupKind.RECURRENT:
                if load:
                    i = op.token_end // bs - 1
                    slot = ids[i] if 0 <= i < len(ids) and ids[i] != NULL_BLOCK else SKIP
                    out[plan.kv_group] = ([slot], 0) if slot != SKIP else None
                else:
                    table = []
                    for k in range(op.token_begin // C, op.token_end // C):
                        i = (k + 1) * C // bs - 1
                        table.append(ids[i] if i < len(ids) and ids[i] != NULL_BLOCK else SKIP)
                    out[plan.kv_group] = (table, op.token_begin // C)
                continue
            r = plan.ratio
            b0, b1 = op.token_begin // bs, -(-op.token_end // bs)
            table = []
            for i in range(b0, b1):
                bid = ids[i] if i < len(ids) else NULL_BLOCK
                if bid == NULL_BLOCK or (load and (i + 1) * bs <= op.skip_tokens):
                    table.extend([SKIP] * r)
                else:
                    table.extend(bid * r + j for j in range(r))
            out[plan.kv_group] = (table, b0 * r)
        return out

    def _failed_blocks(self, op: _Op, restored: int) -> Set[int]:
        """vLLM block ids of the (single) KV cache group a load left unwritten."""
        if self.settings.num_groups != 1:
            return set()
        bs = self.settings.block_sizes.get(0, 0)
        ids = op.block_ids[0] if op.block_ids else []
        if not bs:
            return set()
        lo = max(restored, op.skip_tokens) // bs
        return {b for b in ids[lo:-(-op.token_end // bs)] if b != NULL_BLOCK}

    def _fail_load(self, op: _Op, restored: int, why: str) -> None:
        logger.warning("kvferry connector worker %d: load of request %s tokens [%d, %d) failed "
                       "(%s); vLLM recomputes it", self.rank, op.req_id, op.token_begin,
                       op.token_end, why)
        self.stats["load_failures"] += 1
        self._failed_recving.add(op.req_id)
        self._finished_recving.add(op.req_id)
        self._invalid_blocks |= self._failed_blocks(op, restored)

    # -- per step --

    def drain_stores(self) -> None:
        """Wait for every STORE in flight: the blocks they read may be
        zeroed or rewritten from the next step on."""
        self._poll_stores(block=True)

    def start_load_kv(self, meta: KvferryConnectorMetadata) -> None:
        self.drain_stores()
        if not meta.loads:
            return
        client = self.link.get() if self.link is not None else None
        if client is not None and self.device >= 0:
            # A RETRIEVE carries no event for kvferryd to wait on (protocol:
            # ready_kind 0): blocks just freed may still be read by work
            # queued on the compute stream (asynchronous scheduling). vLLM
            # does not zero blocks an asynchronous load writes.
            torch.cuda.current_stream(self.device).synchronize()
        for op in meta.loads:
            if client is None:
                self._fail_load(op, op.token_begin, "kvferryd is not connected")
                continue
            try:
                rid = client.submit("retrieve", op.token_begin, op.token_end, op.keys,
                                    self._tables(op, load=True))
            except KvferryError as e:
                self.link.lost(e)
                self._fail_load(op, op.token_begin, str(e))
                if self.link.client is None:
                    client = None
                continue
            self._loads[rid] = (op, client)

    def wait_for_save(self, meta: Optional[KvferryConnectorMetadata]) -> None:
        if meta is None or not meta.stores:
            return
        client = self.link.get() if self.link is not None else None
        if client is None:
            self.stats["store_failures"] += len(meta.stores)
            return
        event, handle = None, None
        if self.device >= 0:
            # Recorded after the forward pass: kvferryd's stream waits for it.
            # One event serves every step: the STOREs of a step are answered
            # (drain_stores) before the next step records it again.
            if self._stores:
                self._poll_stores(block=True)   # not drained by this step's start
            if self._event is None:
                self._event = torch.cuda.Event(enable_timing=False, interprocess=True)
                self._event_handle = bytes(self._event.ipc_handle())
            event, handle = self._event, self._event_handle
            event.record(torch.cuda.current_stream(self.device))
        for op in meta.stores:
            try:
                rid = client.submit("store", op.token_begin, op.token_end, op.keys,
                                    self._tables(op, load=False), ready_event=handle)
            except KvferryError as e:
                self.link.lost(e)
                self.stats["store_failures"] += 1
                logger.warning("kvferry connector worker %d: store of request %s tokens "
                               "[%d, %d) not sent: %s", self.rank, op.req_id, op.token_begin,
                               op.token_end, e)
                if self.link.client is None:
                    return
                continue
            self._stores[rid] = (op, client, event)

    def _poll_stores(self, block: bool) -> None:
        for rid in list(self._stores):
            op, client, _event = self._stores[rid]
            try:
                result = client.wait(rid, timeout_ms=0 if block else 1)
            except KvferryError as e:
                if e.status == Status.TIMEOUT and not block:
                    continue
                if e.status == Status.TIMEOUT:
                    # Past the client's timeout: kvferryd retires the request
                    # later (wait_retired); the blocks it reads must stay.
                    try:
                        client.wait_retired(rid, self.settings.timeout_ms)
                    except KvferryError:
                        pass
                else:
                    self.link.lost(e)
                self.stats["store_failures"] += 1
                logger.warning("kvferry connector worker %d: store of request %s tokens [%d, %d) "
                               "failed: %s", self.rank, op.req_id, op.token_begin, op.token_end, e)
                del self._stores[rid]
                continue
            del self._stores[rid]
            if result.done:
                self.stats["stores"] += 1
            else:
                self.stats["store_failures"] += 1
                logger.warning("kvferry connector worker %d: store of request %s tokens [%d, %d): "
                               "%s (status %s)", self.rank, op.req_id, op.token_begin,
                               op.token_end, getattr(result.outcome, "name", result.outcome),
                               result.status)

    def _poll_loads(self) -> None:
        for rid in list(self._loads):
            op, client = self._loads[rid]
            try:
                result = client.wait(rid, timeout_ms=1)
            except KvferryError as e:
                if e.status == Status.TIMEOUT:
                    continue
                del self._loads[rid]
                self.link.lost(e)
                self._fail_load(op, op.token_begin, str(e))
                continue
            del self._loads[rid]
            if result.done and result.prefix_tokens >= op.token_end:
                self.stats["loads"] += 1
                self._finished_recving.add(op.req_id)
            else:
                self._fail_load(op, result.prefix_tokens if result.done else op.token_begin,
                                "restored tokens [%d, %d) of [%d, %d), %s"
                                % (op.token_begin, result.prefix_tokens, op.token_begin,
                                   op.token_end, getattr(result.outcome, "name", result.outcome)))

    def transfer_results(self) -> KVConnectorTransferResults:
        self._poll_stores(block=False)
        self._poll_loads()
        out = KVConnectorTransferResults(finished_recving=self._finished_recving,
                                         failed_recving=self._failed_recving)
        self._finished_recving, self._failed_recving = set(), set()
        return out

    def take_invalid_blocks(self) -> Set[int]:
        out, self._invalid_blocks = self._invalid_blocks, set()
        return out

    def worker_meta(self) -> Optional[KvferryWorkerMetadata]:
        link = self.link
        if link is None or link.registration is None \
                or link.registrations == self._reported_registrations:
            return None
        self._reported_registrations = link.registrations
        return KvferryWorkerMetadata({self.rank: int(link.registration.fingerprint)})

    def shutdown(self) -> None:
        self._poll_stores(block=True)
        for rid, (op, client) in list(self._loads.items()):
            try:
                client.wait(rid)
            except KvferryError:
                pass
        self._loads.clear()
        if self.link is not None:
            self.link.close()
        if self.layout is not None:
            self.layout.close()
            self.layout = None


# ---- scheduler side --------------------------------------------------------------------

@dataclass
class _Hit:
    hit: int                      #: tokens [0, hit) kvferryd holds (chunk multiple)
    num_computed: int             #: tokens vLLM had locally
    keys: List[Any]
    pin_id: int


class _Scheduler:
    def __init__(self, settings: ServedSettings, kv_cache_config: Any) -> None:
        self.settings = settings
        self.kv_cache_config = kv_cache_config
        self.kv_cache_manager: Any = None
        self._twin: Optional[Tuple[Dict[str, torch.Tensor], Allocation, Layout]] = None
        self.link = _Link(settings, "vllm-scheduler", self._register_twin)
        self.requests: Dict[str, Any] = {}
        self._keys: Dict[str, List[Any]] = {}
        self._hits: Dict[str, _Hit] = {}          # looked up, not yet allocated
        self._loading: Dict[str, int] = {}        # load sent: req id -> pin id (0: none)
        self._to_load: List[_Op] = []
        self._stored: Dict[str, int] = {}         # tokens [0, n) sent to STORE
        self.load_failed: Set[str] = set()        # offered no hit again
        self.worker_fingerprints: Dict[int, int] = {}
        self.hits_enabled = True

    def _register_twin(self, client: Any) -> Any:
        s = self.settings
        if self._twin is None:
            caches, alloc, twin_config = _twin_caches(self.kv_cache_config)
            tokens = {s.block_sizes[g.group_id] for g in s.groups if g.group_id not in s.recurrent}
            bs = tokens.pop() if len(tokens) == 1 else min(tokens)
            layout = layout_from_registered(caches, twin_config, s.groups, 1,
                                            chunk_blocks=s.chunk_tokens // bs)
            self._twin = (caches, alloc, layout)
        layout = self._twin[2]
        geometry = layout.units[0].geometry
        regions = _regions(geometry, MemProvider.HOST)
        return client.register(geometry, regions, device=-1, shard_index=0,
                               shard_count=s.tp_size)

    def keys(self, request: Any, n: int) -> List[Any]:
        """The keys of the request's first n chunks (from its block hashes)."""
        s = self.settings
        have = self._keys.setdefault(request.request_id, [])
        step = s.chunk_tokens // s.hash_block_size
        hashes = request.block_hashes
        while len(have) < n:
            have.append(s.key(hashes[(len(have) + 1) * step - 1]))
        return have[:n]

    def _unpin(self, pin_id: int) -> None:
        if not pin_id or self.link.client is None:
            return
        try:
            self.link.client.unpin(pin_id)
        except KvferryError as e:
            self.link.lost(e)

    def num_new_matched_tokens(self, request: Any, num_computed: int) -> Tuple[int, bool]:
        req_id = request.request_id
        self.requests[req_id] = request
        old = self._hits.pop(req_id, None)
        if old is not None:
            self._unpin(old.pin_id)
        if req_id in self.load_failed or not self.hits_enabled:
            return 0, False
        s = self.settings
        # At least the last token is computed (vLLM samples from it).
        limit = min(len(request.block_hashes) * s.hash_block_size, request.num_tokens - 1)
        n = limit // s.chunk_tokens
        if n * s.chunk_tokens <= num_computed:
            return 0, False
        client = self.link.get()
        if client is None:
            return 0, False
        keys = self.keys(request, n)
        try:
            prefix, pin_id = self.query(client, n * s.chunk_tokens, keys, s.pin_ms)
        except KvferryError as e:
            self.link.lost(e)
            logger.warning("kvferry connector: LOOKUP for request %s failed: %s", req_id, e)
            return 0, False
        hit = prefix // s.chunk_tokens * s.chunk_tokens
        if hit <= num_computed:
            self._unpin(pin_id)
            return 0, False
        self._hits[req_id] = _Hit(hit, num_computed, keys[:hit // s.chunk_tokens], pin_id)
        return hit - num_computed, True

    def query(self, client: Any, num_tokens: int, keys: Sequence[Any],
              pin_ms: int) -> Tuple[int, int]:
        """(tokens of [0, num_tokens) kvferryd would restore, pin id): a
        LOOKUP; with a library before LOOKUP (kvferry.client.has_lookup()
        false), a RETRIEVE on the twin whose block tables skip every block,
        which answers the same prefix, moves nothing and pins nothing."""
        if kvc.has_lookup():
            try:
                found = client.lookup(0, num_tokens, list(keys), pin_ms=pin_ms)
            except KvferryError as e:
                if e.status != Status.BUSY or not pin_ms:
                    raise
                # The connection's pin quota (kvferryd --max-pins): a hit
                # without a pin, which an eviction may turn into a failed load.
                found = client.lookup(0, num_tokens, list(keys), pin_ms=0)
            return int(found.prefix_tokens), int(found.pin_id)
        assert self._twin is not None
        geometry = self._twin[2].units[0].geometry
        C = self.settings.chunk_tokens
        blocks = []
        for group in geometry.groups:
            if group.kind == GroupKind.RECURRENT:
                blocks.append(([SKIP], 0))
            else:
                blocks.append(([SKIP] * -(-num_tokens // group.block_size), 0))
        result = client.retrieve(0, num_tokens, list(keys), blocks)
        return (int(result.prefix_tokens) if result.done else 0), 0

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external: int) -> None:
        req_id = request.request_id
        hit = self._hits.pop(req_id, None)
        if hit is None:
            return
        if num_external <= 0:
            self._unpin(hit.pin_id)
            return
        s, C = self.settings, self.settings.chunk_tokens
        ids = blocks.get_block_ids()
        begin = hit.num_computed // C * C
        tables = [list(ids[g][:-(-hit.hit // s.block_sizes[g])]) if g in s.block_sizes else []
                  for g in range(len(ids))]
        self._to_load.append(_Op(req_id, begin, hit.hit, hit.keys[begin // C:], tables,
                                 skip_tokens=hit.num_computed))
        self._loading[req_id] = hit.pin_id
        self._stored[req_id] = max(self._stored.get(req_id, 0), hit.hit)

    def build_meta(self, so: Any) -> KvferryConnectorMetadata:
        meta = KvferryConnectorMetadata(loads=self._to_load)
        self._to_load = []
        s, C = self.settings, self.settings.chunk_tokens
        computed = [(new.req_id, new.num_computed_tokens) for new in so.scheduled_new_reqs]
        cached = so.scheduled_cached_reqs
        computed.extend(zip(cached.req_ids, cached.num_computed_tokens))
        for req_id, num_computed in computed:
            request = self.requests.get(req_id)
            scheduled = so.num_scheduled_tokens.get(req_id, 0)
            if request is None or scheduled <= 0 or self.kv_cache_manager is None:
                continue
            end = min(num_computed + scheduled, len(request.block_hashes) * s.hash_block_size)
            top = end // C * C
            begin = self._stored.get(req_id, 0)
            if top <= begin:
                continue
            ids = self.kv_cache_manager.get_block_ids(req_id)
            tables = [list(ids[g][:top // s.block_sizes[g]]) if g in s.block_sizes else []
                      for g in range(len(ids))]
            meta.stores.append(_Op(req_id, begin, top, self.keys(request, top // C)[begin // C:],
                                   tables))
            self._stored[req_id] = top
        return meta

    def update_connector_output(self, out: Any) -> None:
        for req_id in out.failed_recving or ():
            self.load_failed.add(req_id)
        for req_id in out.finished_recving or ():
            self._unpin(self._loading.pop(req_id, 0))
        meta = out.kv_connector_worker_meta
        fps = getattr(meta, "fingerprints", None)
        if fps:
            self.worker_fingerprints.update(fps)
            twin = self.link.registration
            if twin is not None:
                bad = {r: fp for r, fp in fps.items() if fp != twin.fingerprint}
                if bad:
                    logger.error("kvferry connector: the workers registered fingerprints %s, the "
                                 "scheduler's lookup twin %016x: hits are off (a bug: the "
                                 "twin's geometry must equal the workers')",
                                 {r: "%016x" % f for r, f in bad.items()}, twin.fingerprint)
                    self.hits_enabled = False

    def request_finished(self, request: Any) -> Tuple[bool, Optional[Dict[str, Any]]]:
        req_id = request.request_id
        hit = self._hits.pop(req_id, None)
        if hit is not None:
            self._unpin(hit.pin_id)
        self._unpin(self._loading.pop(req_id, 0))
        self.requests.pop(req_id, None)
        self._keys.pop(req_id, None)
        self._stored.pop(req_id, None)
        self.load_failed.discard(req_id)
        # The worker waits for the STOREs of a step before the next step's
        # blocks are zeroed or written (handle_preemptions): freeing now is safe.
        return False, None

    def shutdown(self) -> None:
        for hit in self._hits.values():
            self._unpin(hit.pin_id)
        for pin in self._loading.values():
            self._unpin(pin)
        self._hits.clear()
        self._loading.clear()
        self.link.close()
        if self._twin is not None:
            self._twin[2].close()
            self._twin[1].close()
            self._twin = None


# ---- the connector --------------------------------------------------------------------

class KvferryConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM's KV connector over kvferryd (``kv_connector`` "KvferryConnector",
    ``kv_connector_module_path`` "kvferry.vllm.connector"); module docstring
    and docs/vllm.md say what it moves and when.

    ``kv_connector_extra_config``: ``kvferry_socket_dir`` (required, or
    ``$KVFERRY_SOCKET_DIR``: kvferryd's ``--socket-dir``),
    ``kvferry_chunk_tokens`` (256: tokens per kvferry chunk, a whole number
    of every group's blocks), ``kvferry_pin_ms`` (10000: how long a hit stays
    pinned for its load), ``kvferry_timeout_ms`` (10000),
    ``kvferry_reconnect_ms`` (1000), ``kvferry_key_salt`` ("").
    """

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.settings = ServedSettings.from_config(vllm_config, kv_cache_config)
        self.connector_worker: Optional[_Worker] = None
        self.connector_scheduler: Optional[_Scheduler] = None
        if role == KVConnectorRole.WORKER:
            self.connector_worker = _Worker(self.settings, vllm_config, kv_cache_config)
        else:
            self.connector_scheduler = _Scheduler(self.settings, kv_cache_config)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped store is a later miss

    # -- worker side --

    def get_mem_pool_context(self) -> Any:
        """kvferry's exportable pool on a GPU (kvferryd imports the KV cache);
        None on the CPU (allocate with :func:`host_kv_caches`)."""
        return self.connector_worker.mem_pool_context() if self.connector_worker else None

    def register_kv_caches(self, kv_caches: Dict[str, torch.Tensor]) -> None:
        assert self.connector_worker is not None
        self.connector_worker.register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        if self.connector_worker is not None:
            self.connector_worker.drain_stores()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvferryConnectorMetadata) and self.connector_worker is not None
        self.connector_worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: the request waits for them, not the layers

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return  # whole chunks are stored after the forward pass (wait_for_save)

    def wait_for_save(self) -> None:
        assert self.connector_worker is not None
        meta = self._connector_metadata
        self.connector_worker.wait_for_save(meta if isinstance(meta, KvferryConnectorMetadata)
                                            else None)

    def get_finished(self, finished_req_ids: Set[str]) -> Tuple[Set[str], Set[str]]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending, results.finished_recving

    def get_transfer_results(self, finished_req_ids: Set[str]) -> KVConnectorTransferResults:
        assert self.connector_worker is not None
        return self.connector_worker.transfer_results()

    def get_block_ids_with_load_errors(self) -> Set[int]:
        return self.connector_worker.take_invalid_blocks() if self.connector_worker else set()

    def build_connector_worker_meta(self) -> Optional[KvferryWorkerMetadata]:
        return self.connector_worker.worker_meta() if self.connector_worker else None

    def shutdown(self) -> None:
        if self.connector_worker is not None:
            self.connector_worker.shutdown()
        if self.connector_scheduler is not None:
            self.connector_scheduler.shutdown()

    # -- scheduler side --

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self.connector_scheduler is not None:
            self.connector_scheduler.kv_cache_manager = kv_cache_manager

    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> Tuple[Optional[int], bool]:
        assert self.connector_scheduler is not None
        return self.connector_scheduler.num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self.connector_scheduler is not None
        self.connector_scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KvferryConnectorMetadata:
        assert self.connector_scheduler is not None
        return self.connector_scheduler.build_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        if self.connector_scheduler is not None:
            self.connector_scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Any, block_ids: List[int]) -> Tuple[bool, Any]:
        assert self.connector_scheduler is not None
        return self.connector_scheduler.request_finished(request)

    def request_finished_all_groups(self, request: Any,
                                    block_ids: Tuple[List[int], ...]) -> Tuple[bool, Any]:
        assert self.connector_scheduler is not None
        return self.connector_scheduler.request_finished(request)
