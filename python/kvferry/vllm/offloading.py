"""vLLM's offloading connector with kvferry moving the blocks (in process).

Loaded by vLLM by module path; docs/vllm.md has the ``--kv-transfer-config``
lines. Three classes:

- :class:`KvferryOffloadingSpec`, an ``OffloadingSpec``
  (``vllm/v1/kv_offload/base.py``): on the scheduler side it returns vLLM's
  own ``CPUOffloadingManager`` (LRU or ARC, the CPU chunk pool, store
  thresholds, events, metrics), sized like vLLM's CPU spec sizes it; on the
  worker side it returns a :class:`KvferryOffloadingWorker`.
- :class:`KvferryOffloadingWorker`, an ``OffloadingWorker``: stores (GPU ->
  CPU) and loads (CPU -> GPU) with kvferry. Each job is one kvf_xfer call
  per unit (one for every model whose offloaded groups share a block size
  and have at most one full-attention group), on a stream of its own that
  waits for the compute stream and the job before it in its lane (stores,
  loads, expedited loads), with CUDA events for completion. The CPU pool
  is pinned host memory (``torch.empty(..., pin_memory=True)``: cudaHostAlloc,
  which kvferry's transfer reaches), one slot of ``blocks_per_chunk``
  objects per chunk id of vLLM's manager, each object one vLLM block of one
  group in kvferry's canonical format (padding stripped). On a CPU KV cache
  (CPU engines, tests) the copies run on kvferry's host backend, within the
  submit call.
- :class:`KvferryOffloadingConnector`, vLLM's ``OffloadingConnector`` with a
  worker side that hands the registered KV cache tensors and the KV cache
  config to the spec (the geometry then has K/V planes, heads and tokens),
  and reports a failed load (``get_block_ids_with_load_errors`` for a model
  with one KV cache group, ``failed_recving`` for an asynchronous load)
  where vLLM's connector asserts; on the scheduler side it drops a failed
  store's chunks from the manager and offers a request whose load failed
  no hit again (vLLM then recomputes it).

The worker also remembers the chunks it failed to store: a load from them
fails (and is reported) instead of restoring bytes that were never written.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Set, Tuple

import numpy as np

import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingWorkerMetadata)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (
    OffloadingConnectorWorker)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.v1.kv_offload.base import (BlockIDsLoadStoreSpec, CanonicalKVCaches, GPULoadStoreSpec,
                                     LoadStoreSpec, OffloadingManager, OffloadingSpec,
                                     OffloadingWorker, TransferResult)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.common import CPUOffloadingInfo
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from . import VLLM_VERSION
from ._layout import Layout, layout_from_canonical, layout_from_registered
from ._mover import Mover

# Under vLLM's "vllm" logger, so the lines go where vLLM's own do.
logger = logging.getLogger("vllm.kvferry.offloading")

if vllm.__version__.split("+")[0] != VLLM_VERSION:
    logger.warning("kvferry.vllm is written and tested against vLLM %s; this is vLLM %s",
                   VLLM_VERSION, vllm.__version__)

__all__ = ["KvferryOffloadingSpec", "KvferryOffloadingWorker", "KvferryOffloadingConnector",
           "KvferryWorkerMetadata"]


class KvferryOffloadingWorker(OffloadingWorker):
    """vLLM's OffloadingWorker over a :class:`kvferry.vllm._mover.Mover`.

    Args:
        layout: the geometries and object placement; the worker owns it.
        num_chunks: CPU chunk ids of vLLM's manager (0 .. num_chunks-1).
        device: the CUDA device of the KV cache, or None for a CPU cache.
        max_sms, host_threads: for kvferry.Transfer.
    """

    def __init__(self, layout: Layout, num_chunks: int, device: Optional[int] = None, *,
                 max_sms: int = 0, host_threads: int = 0) -> None:
        self.mover = Mover(layout, num_chunks, device, max_sms=max_sms, host_threads=host_threads)
        self.layout = layout
        self.num_chunks = self.mover.num_chunks
        self._failed_loads: Dict[int, np.ndarray] = {}
        logger.info("kvferry offloading worker: %d CPU chunks of %d bytes (%.2f GB %s), %s; %s",
                    self.num_chunks, layout.slot_bytes, self.mover.pool.numel() / 1e9,
                    "pinned" if device is not None else "host backend",
                    "geometry from the registered tensors" if layout.source == "registered"
                    else "geometry from vLLM's canonical pages", layout.describe())

    def chunk_object(self, chunk_id: int, group: int, sub_block: int = 0) -> memoryview:
        """The bytes of one object in the CPU pool (Mover.chunk_object)."""
        return self.mover.chunk_object(chunk_id, group, sub_block)

    def _submit(self, lane: str, job_id: int, gpu: Any, cpu: Any, store: bool) -> bool:
        if not isinstance(gpu, GPULoadStoreSpec) or not isinstance(cpu, BlockIDsLoadStoreSpec):
            raise TypeError("kvferry offloading moves GPU blocks to CPU chunks, not %s -> %s"
                            % (type(gpu).__name__, type(cpu).__name__))
        self.mover.submit(lane, job_id, store, gpu.block_ids, gpu.group_sizes, gpu.block_indices,
                          cpu.block_ids)
        return True

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec,
                     dst_spec: LoadStoreSpec) -> bool:
        """GPU -> CPU. Accepted whenever the specs are: a failure of the job
        is reported by get_finished."""
        return self._submit("store", job_id, src_spec, dst_spec, True)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec,
                    expedited: bool = False) -> bool:
        """CPU -> GPU, on a lane of its own when expedited (waited for in the step)."""
        return self._submit("expedited" if expedited else "load", job_id, dst_spec, src_spec, False)

    def get_finished(self) -> List[TransferResult]:
        results = []
        for job in self.mover.finished():
            if not job.success and not job.store:
                self._failed_loads[job.job_id] = job.gpu_blocks
            results.append(TransferResult(job_id=job.job_id, success=job.success,
                                          transfer_size=job.num_bytes if job.success else None,
                                          transfer_time=job.seconds if job.success else None))
        return results

    def wait(self, job_ids: Set[int]) -> None:
        self.mover.wait(job_ids)

    def pop_failed_load(self, job_id: int) -> Optional[np.ndarray]:
        """The GPU block ids of a load get_finished reported failed (once)."""
        return self._failed_loads.pop(job_id, None)

    def shutdown(self) -> None:
        self.mover.close()


class KvferryOffloadingSpec(OffloadingSpec):
    """The kvferry offloading spec (``spec_name`` "KvferryOffloadingSpec",
    ``spec_module_path`` "kvferry.vllm.offloading").

    ``kv_connector_extra_config`` keys: ``cpu_bytes_to_use`` (required; the
    pool of all workers together, as for vLLM's CPU spec), vLLM's
    ``blocks_per_chunk`` or ``block_size``, ``eviction_policy`` ("lru",
    "arc"), ``cache_policy_module_path``, ``store_threshold``,
    ``max_tracker_size``, ``offload_prompt_only``, ``sync_load_budget_bytes``;
    and kvferry's ``kvferry_max_sms`` and ``kvferry_host_threads``.
    """

    BLOCK_SIZE_ALIGNMENT = CPUOffloadingSpec.BLOCK_SIZE_ALIGNMENT

    @classmethod
    def build_metric_definitions(cls, extra_config: Dict[str, Any]) -> Dict[str, Any]:
        # The manager is vLLM's CPU manager: the same metrics.
        return CPUOffloadingSpec.build_metric_definitions(extra_config)

    @classmethod
    def config_info_keys(cls, extra_config: Dict[str, Any]) -> Tuple[str, ...]:
        return CPUOffloadingInfo.config_info_keys()

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        cpu_bytes = self.extra_config.get("cpu_bytes_to_use")
        if not cpu_bytes:
            raise ValueError("kvferry offloading: cpu_bytes_to_use must be given in "
                             "kv_connector_extra_config")
        # Sized as vLLM's CPU spec sizes a chunk without the replicated
        # layout: every worker's bytes of blocks_per_chunk blocks, rounded
        # to the page size. A worker's slot holds only its own, unpadded.
        world = max(config.parallel.world_size, 1)
        self.worker_bytes_per_chunk = config.worker_kv_bytes_per_block * self.blocks_per_chunk
        self.num_chunks = 0
        self.kv_bytes_per_chunk = 0
        if self.worker_bytes_per_chunk > 0:
            self.kv_bytes_per_chunk = -(-self.worker_bytes_per_chunk * world
                                        // self.BLOCK_SIZE_ALIGNMENT) * self.BLOCK_SIZE_ALIGNMENT
            self.num_chunks = int(cpu_bytes) // self.kv_bytes_per_chunk
        self.cpu_info = CPUOffloadingInfo.from_config(config, self.num_chunks,
                                                      self.kv_bytes_per_chunk)
        self.eviction_policy: str = self.extra_config.get("eviction_policy", "lru")
        self.cache_policy_module_path: Optional[str] = self.extra_config.get(
            "cache_policy_module_path")
        self.max_sms = int(self.extra_config.get("kvferry_max_sms", 0))
        self.host_threads = int(self.extra_config.get("kvferry_host_threads", 0))
        self._manager: Optional[OffloadingManager] = None
        self._worker: Optional[KvferryOffloadingWorker] = None
        self._registered: Optional[Tuple[Mapping[str, Any], Any]] = None

    def get_manager(self) -> OffloadingManager:
        """vLLM's CPUOffloadingManager over this spec's chunks."""
        if self._manager is None:
            self._manager = CPUOffloadingManager(
                num_chunks=self.num_chunks,
                cache_policy=self.eviction_policy,
                cache_policy_module_path=self.cache_policy_module_path,
                enable_events=self.kv_events_config.enable_kv_cache_events,
                store_threshold=int(self.extra_config.get("store_threshold", 0)),
                max_tracker_size=int(self.extra_config.get("max_tracker_size", 64_000)),
                info=self.cpu_info,
            )
        return self._manager

    def attach_registered_kv_caches(self, kv_caches: Mapping[str, Any], kv_cache_config: Any) -> None:
        """Give the worker the tensors vLLM registered and the KV cache
        config, before get_worker (KvferryOffloadingConnector does)."""
        self._registered = (dict(kv_caches), kv_cache_config)

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is not None:
            return self._worker
        groups = self.config.groups
        if self._registered is not None:
            layout = layout_from_registered(self._registered[0], self._registered[1], groups,
                                            self.blocks_per_chunk)
        else:
            logger.info("kvferry offloading: vLLM's OffloadingConnector gives the spec pages "
                        "only; KvferryOffloadingConnector gives it the registered tensors")
            layout = layout_from_canonical(kv_caches, groups, self.blocks_per_chunk)
        try:
            if self.worker_bytes_per_chunk and layout.slot_bytes > self.worker_bytes_per_chunk:
                logger.warning("kvferry offloading: a CPU chunk takes %d bytes, vLLM accounts %d "
                               "for it: the pool is larger than cpu_bytes_to_use says",
                               layout.slot_bytes, self.worker_bytes_per_chunk)
            device = kv_caches.tensors[0].tensor.device
            index = None
            if device.type == "cuda":
                import torch

                index = device.index if device.index is not None else torch.cuda.current_device()
            self._worker = KvferryOffloadingWorker(
                layout, self.num_chunks, index,
                max_sms=self.max_sms, host_threads=self.host_threads)
        except BaseException:
            layout.close()
            raise
        self._registered = None  # the geometry keeps what it needs
        return self._worker


@dataclass
class KvferryWorkerMetadata(OffloadingWorkerMetadata):
    """vLLM's worker -> scheduler metadata of the offloading connector, with
    the jobs that failed on some worker (job id -> workers)."""

    failed_jobs: Dict[int, int] = field(default_factory=dict)

    def mark_failed(self, job_id: int) -> None:
        self.failed_jobs[job_id] = 1

    def aggregate(self, other: Any) -> "KvferryWorkerMetadata":
        merged = OffloadingWorkerMetadata.aggregate(self, other)
        failed = dict(self.failed_jobs)
        for job_id, n in getattr(other, "failed_jobs", {}).items():
            failed[job_id] = failed.get(job_id, 0) + n
        return KvferryWorkerMetadata(completed_jobs=merged.completed_jobs,
                                     transfer_stats=merged.transfer_stats, failed_jobs=failed)


class _KvferryConnectorWorker(OffloadingConnectorWorker):
    """vLLM's offloading connector worker, with the registered tensors handed
    to the spec and failed jobs reported instead of asserted."""

    def __init__(self, spec: OffloadingSpec, vllm_config: Any, kv_cache_config: Any) -> None:
        super().__init__(spec, vllm_config, kv_cache_config)
        self._connector_worker_meta = KvferryWorkerMetadata()
        self._failed_recving: Set[str] = set()
        self._invalid_block_ids: Set[int] = set()
        self._single_group = len(kv_cache_config.kv_cache_groups) == 1

    def register_kv_caches(self, kv_caches: Dict[str, Any]) -> None:
        assert isinstance(self.spec, KvferryOffloadingSpec)
        self.spec.attach_registered_kv_caches(kv_caches, self.kv_cache_config)
        super().register_kv_caches(kv_caches)

    def get_finished(self, finished_req_ids: Set[str]) -> Tuple[Set[str], Set[str]]:
        # OffloadingConnectorWorker.get_finished, with failures reported.
        assert self.worker is not None
        finished_recving: Set[str] = set()
        meta = self._connector_worker_meta
        for result in self.worker.get_finished():
            job_id = result.job_id
            is_load = job_id in self._load_jobs
            if result.success and result.transfer_time is not None \
                    and result.transfer_size is not None:
                stats = meta.transfer_stats
                (stats.load if is_load else stats.store).record(result.transfer_size,
                                                                result.transfer_time)
            # Completed either way (the scheduler releases the job's chunks);
            # a failure is also told to the scheduler side (failed_jobs),
            # which drops a failed store's chunks and stops offering a
            # request the hit whose load failed.
            meta.mark_completed(job_id)
            req_id = self._load_jobs.pop(job_id, None)
            if req_id is not None:
                finished_recving.add(req_id)
            if result.success:
                continue
            if isinstance(meta, KvferryWorkerMetadata):
                meta.mark_failed(job_id)
            if not is_load:
                continue
            blocks = None
            if isinstance(self.worker, KvferryOffloadingWorker):
                blocks = self.worker.pop_failed_load(job_id)
            if req_id is not None:
                self._failed_recving.add(req_id)
            if self._single_group and blocks is not None:
                self._invalid_block_ids.update(int(b) for b in blocks)
            elif req_id is None:
                # vLLM 0.33 takes block-level failures for one KV cache group
                # only, and a synchronous load's request is already running.
                raise RuntimeError(
                    "kvferry offloading: synchronous load job %d failed, and vLLM cannot take "
                    "block-level load failures for a model with %d KV cache groups; set "
                    "sync_load_budget_bytes to 0 (asynchronous loads) for such models"
                    % (job_id, len(self.kv_cache_config.kv_cache_groups)))
        return set(), finished_recving

    def build_connector_worker_meta(self) -> Optional[OffloadingWorkerMetadata]:
        meta = self._connector_worker_meta
        if not meta.completed_jobs:
            return None
        self._connector_worker_meta = KvferryWorkerMetadata()
        return meta

    def take_failed_recving(self) -> Set[str]:
        out, self._failed_recving = self._failed_recving, set()
        return out

    def take_invalid_block_ids(self) -> Set[int]:
        out, self._invalid_block_ids = self._invalid_block_ids, set()
        return out


class KvferryOffloadingConnector(OffloadingConnector):
    """vLLM's OffloadingConnector for the kvferry spec (``kv_connector``
    "KvferryOffloadingConnector", ``kv_connector_module_path``
    "kvferry.vllm.offloading").

    Worker side: gives the spec the registered KV cache tensors and the KV
    cache config, and reports a failed load (``get_block_ids_with_load_errors``
    with one KV cache group, ``failed_recving`` for an asynchronous load).
    Scheduler side: vLLM's, plus what a failure needs there: a failed store's
    chunks are dropped from the manager before they could be offered
    (``complete_store(success=False)``), and a request whose load failed is
    offered no hit again, so vLLM's retry recomputes instead of loading
    again.
    """

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._load_failed: Set[str] = set()   # requests offered no hit again
        self._failed_jobs: Set[int] = set()   # failed on some worker, not yet completed
        if self.connector_worker is not None:
            spec = self.connector_worker.spec
            if not isinstance(spec, KvferryOffloadingSpec):
                raise ValueError("KvferryOffloadingConnector needs spec_name "
                                 "'KvferryOffloadingSpec' and spec_module_path "
                                 "'kvferry.vllm.offloading' in kv_connector_extra_config, "
                                 "not %s" % type(spec).__name__)
            self.connector_worker = _KvferryConnectorWorker(spec, vllm_config, kv_cache_config)

    # -- worker side -------------------------------------------------------------

    def get_transfer_results(self, finished_req_ids: Set[str]) -> KVConnectorTransferResults:
        results = super().get_transfer_results(finished_req_ids)
        assert isinstance(self.connector_worker, _KvferryConnectorWorker)
        failed = self.connector_worker.take_failed_recving()
        results.failed_recving |= failed
        results.finished_recving |= failed
        return results

    def get_block_ids_with_load_errors(self) -> Set[int]:
        if not isinstance(self.connector_worker, _KvferryConnectorWorker):
            return set()
        return self.connector_worker.take_invalid_block_ids()

    # -- scheduler side ------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> Tuple[Optional[int], bool]:
        if request.request_id in self._load_failed:
            # vLLM's lookup with nothing to load: its bookkeeping of the
            # request starts over as for any lookup, and the answer is no hit.
            return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens,
                                                             max_num_new_tokens=0)
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_connector_output(self, connector_output: Any) -> None:
        meta = connector_output.kv_connector_worker_meta
        self._failed_jobs.update(getattr(meta, "failed_jobs", None) or {})
        if self._failed_jobs and meta is not None:
            # Before vLLM's processing, which completes every job as a
            # success, once every worker has reported it: the job's keys and
            # request are still known here (OffloadingConnectorScheduler
            # ._jobs, vLLM 0.33). Until every worker has, another may still
            # be writing the job's chunks, so they stay allocated.
            sched = self.scheduler
            with sched._manager_locked():
                for job_id, count in meta.completed_jobs.items():
                    if job_id not in self._failed_jobs:
                        continue
                    status = sched._jobs.get(job_id)
                    state = sched._req_status.get(status.req_id) if status else None
                    if status is not None and state is not None and status.pending_count > count:
                        continue
                    self._failed_jobs.discard(job_id)
                    if status is None or state is None:
                        continue  # a job from before a cache reset
                    if status.is_store:
                        sched.manager.complete_store(status.keys, state.req_context, success=False)
                    else:
                        self._load_failed.add(status.req_id)
        super().update_connector_output(connector_output)

    def request_finished(self, request: Any, block_ids: List[int]) -> Tuple[bool, Any]:
        self._load_failed.discard(request.request_id)
        return super().request_finished(request, block_ids)

    def request_finished_all_groups(self, request: Any,
                                    block_ids: Tuple[List[int], ...]) -> Tuple[bool, Any]:
        self._load_failed.discard(request.request_id)
        return super().request_finished_all_groups(request, block_ids)
