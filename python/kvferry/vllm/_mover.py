"""The transfers of the in-process offloading, without vLLM's classes: the
pinned CPU pool, its chunk states, the planning of a job into one
kvferry CopyRequest per unit, and the lanes that run them (kvferry.Transfer
on a stream of the job's own with CUDA events, or on the host backend).

:class:`kvferry.vllm.offloading.KvferryOffloadingWorker` is vLLM's face of
it; this module needs torch and numpy only, so the GPU path can be tested
where vLLM is not installed.

A job is what vLLM's offloading scheduler makes (``GPULoadStoreSpec`` and
``CPULoadStoreSpec``, ``vllm/v1/kv_offload/base.py``): per offloaded group
``g``, ``group_sizes[g]`` GPU blocks holding the request's logical blocks
``block_indices[g]`` onwards, and the CPU chunk ids holding them, the first
chunk entered ``block_indices[g] % blocks_per_chunk`` sub-blocks in
(``vllm/v1/kv_offload/cpu/gpu_worker.py``, ``transfer_async``).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Deque, Dict, List, Optional, Sequence, Set, Tuple

import numpy as np
import torch

from .. import DEVICE_HOST, BlockTable, CopyRequest, KvferryError, Transfer
from ._layout import Layout

logger = logging.getLogger("vllm.kvferry.offloading")

#: CPU chunk states, per chunk id.
UNWRITTEN, VALID, PENDING, BAD = 0, 1, 2, 3

LANES = ("store", "load", "expedited")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class Job:
    job_id: int
    store: bool
    num_bytes: int
    chunks: np.ndarray                   # CPU chunk ids the job reads or writes
    gpu_blocks: np.ndarray               # GPU block ids it reads or writes
    requests: List[Tuple[int, CopyRequest]] = field(default_factory=list)
    success: bool = True
    reason: str = ""
    t0: float = 0.0
    seconds: Optional[float] = None
    stream: Any = None
    start: Any = None
    end: Any = None                      # None: complete (host backend, or nothing enqueued)


class _Lane:
    """One direction's transfer contexts and its jobs in submission order."""

    def __init__(self, name: str, layout: Layout, device: Optional[int], max_sms: int,
                 host_threads: int) -> None:
        self.name = name
        self.device = device
        self.transfers: List[Transfer] = []
        try:
            for unit in layout.units:
                self.transfers.append(Transfer(unit.geometry,
                                               DEVICE_HOST if device is None else device,
                                               max_sms=max_sms, host_threads=host_threads))
        except BaseException:
            self.close()
            raise
        self.jobs: Deque[Job] = deque()
        self.streams: List[Any] = []
        self.events: List[Any] = []

    def _event(self) -> Any:
        return self.events.pop() if self.events else torch.cuda.Event(enable_timing=True)

    def run(self, job: Job) -> None:
        """Move the job's bytes: at once on the host, enqueued on a stream of
        the job's own on a GPU."""
        if self.device is None:
            job.t0 = time.perf_counter()
            for unit, request in job.requests:
                try:
                    if job.store:
                        self.transfers[unit].gather(request)
                    else:
                        self.transfers[unit].scatter(request)
                except KvferryError as e:
                    job.success, job.reason = False, str(e)
                    break
            job.seconds = time.perf_counter() - job.t0
            self.jobs.append(job)
            return
        stream = self.streams.pop() if self.streams else torch.cuda.Stream(device=self.device)
        job.stream, job.start, job.end = stream, self._event(), self._event()
        # Stores read what the model wrote; loads write blocks that earlier
        # work (zeroing, the previous owner) may still touch: both wait for
        # the compute stream, and for the job before them in this lane.
        stream.wait_stream(torch.cuda.current_stream(self.device))
        if self.jobs and self.jobs[-1].end is not None:
            stream.wait_event(self.jobs[-1].end)
        job.start.record(stream)
        for unit, request in job.requests:
            try:
                if job.store:
                    self.transfers[unit].gather(request, stream)
                else:
                    self.transfers[unit].scatter(request, stream)
            except KvferryError as e:
                # What was enqueued stays and runs (kvferry/transfer.h): the
                # job completes, failed, when its end event does.
                job.success, job.reason = False, str(e)
                break
        try:
            job.end.record(stream)
        except RuntimeError as e:  # a broken CUDA context
            job.success, job.reason, job.end = False, job.reason or str(e), None
        self.jobs.append(job)

    def finished(self) -> List[Job]:
        out = []
        while self.jobs and (self.jobs[0].end is None or self.jobs[0].end.query()):
            job = self.jobs.popleft()
            if job.end is not None:
                job.seconds = job.start.elapsed_time(job.end) * 1e-3
                self.events += [job.start, job.end]
                self.streams.append(job.stream)
                job.start = job.end = job.stream = None
            out.append(job)
        return out

    def wait(self, job_ids: Set[int]) -> None:
        for job in self.jobs:
            if job.job_id in job_ids and job.end is not None:
                job.end.synchronize()

    def drain(self) -> None:
        for job in self.jobs:
            if job.end is not None:
                job.end.synchronize()

    def close(self) -> None:
        for x in self.transfers:
            x.close()
        self.transfers = []


class Mover:
    """The CPU pool and the lanes of one worker.

    Args:
        layout: the geometries and object placement (from
            :mod:`kvferry.vllm._layout`); the mover owns and closes it.
        num_chunks: CPU chunk ids (0 .. num_chunks-1).
        device: the CUDA device of the KV cache, or None for a CPU cache
            (kvferry's host backend).
        max_sms: SM cap of a transfer's kernels (0: kvferry's default).
        host_threads: host backend threads (0: up to 8).
    """

    def __init__(self, layout: Layout, num_chunks: int, device: Optional[int] = None, *,
                 max_sms: int = 0, host_threads: int = 0) -> None:
        self.layout = layout
        self.num_chunks = int(num_chunks)
        self.device = device
        self._bpc = layout.blocks_per_chunk
        self.pool = torch.empty((max(self.num_chunks, 1), layout.slot_bytes), dtype=torch.uint8,
                                pin_memory=device is not None)
        self._base = self.pool.data_ptr()
        self.state = np.zeros(max(self.num_chunks, 1), np.uint8)
        self._lanes: Dict[str, _Lane] = {}
        try:
            for name in LANES:
                self._lanes[name] = _Lane(name, layout, device, max_sms, host_threads)
        except BaseException:
            for lane in self._lanes.values():
                lane.close()
            raise

    def chunk_object(self, chunk_id: int, group: int, sub_block: int = 0) -> memoryview:
        """The bytes of one object in the pool (for tests and tools): group
        ``group``'s block ``sub_block`` of chunk ``chunk_id``."""
        g = self.layout.groups[group]
        start = chunk_id * self.layout.slot_bytes + sub_block * g.sub_stride
        return memoryview(self.pool.numpy()).cast("B")[start:start + g.object_bytes]

    def plan(self, gpu_ids: Any, group_sizes: Sequence[int], block_indices: Sequence[int],
             cpu_ids: Any) -> Job:
        """The job's CopyRequests, one per unit that moves."""
        layout, bpc = self.layout, self._bpc
        gpu_ids = np.asarray(gpu_ids, dtype=np.int64)
        cpu_ids = np.asarray(cpu_ids, dtype=np.int64)
        sizes, starts = list(group_sizes), list(block_indices)
        if len(sizes) != len(layout.groups) or len(starts) != len(sizes):
            raise ValueError("a job for %d groups, %d are offloaded" % (len(sizes), len(layout.groups)))
        if cpu_ids.size and (cpu_ids.min() < 0 or cpu_ids.max() >= self.num_chunks):
            raise ValueError("CPU chunk ids outside 0..%d" % (self.num_chunks - 1))
        per_unit: Dict[int, Dict[str, Any]] = {}
        off_gpu = off_cpu = 0
        num_bytes = 0
        for gi, (n, s) in enumerate(zip(sizes, starts)):
            n, s = int(n), int(s)
            if n == 0:
                continue
            plan = layout.groups[gi]
            ids = gpu_ids[off_gpu:off_gpu + n]
            skip = s % bpc
            chunks = cpu_ids[off_cpu:off_cpu + _cdiv(n + skip, bpc)]
            off_gpu += n
            off_cpu += len(chunks)
            if len(ids) != n or len(chunks) != _cdiv(n + skip, bpc):
                raise ValueError("group %d: %d blocks from block %d need %d GPU blocks and %d "
                                 "CPU chunks, the job has %d and %d left" % (
                                     gi, n, s, n, _cdiv(n + skip, bpc), len(ids), len(chunks)))
            p = skip + np.arange(n, dtype=np.int64)
            addrs = (self._base + chunks[p // bpc] * layout.slot_bytes
                     + (p % bpc) * plan.sub_stride)
            if plan.ratio > 1:
                ids = (ids[:, None] * plan.ratio + np.arange(plan.ratio)).ravel()
            unit = per_unit.setdefault(plan.unit, {"tables": {}, "objects": [], "lo": s, "hi": s + n})
            unit["tables"][plan.kv_group] = BlockTable(ids, first_block=s * plan.ratio)
            unit["objects"].append((s, plan.object_group, plan.object_bytes, addrs))
            unit["lo"], unit["hi"] = min(unit["lo"], s), max(unit["hi"], s + n)
            num_bytes += n * plan.object_bytes
        if off_gpu != len(gpu_ids) or off_cpu != len(cpu_ids):
            raise ValueError("the job's group sizes cover %d GPU blocks and %d CPU chunks, it "
                             "has %d and %d" % (off_gpu, off_cpu, len(gpu_ids), len(cpu_ids)))
        job = Job(-1, False, num_bytes, cpu_ids, gpu_ids)
        for u, entry in sorted(per_unit.items()):
            unit = layout.units[u]
            lo = entry["lo"]
            objects: Dict[Tuple[int, int], Any] = {}
            for s, og, nbytes, addrs in entry["objects"]:
                for j, addr in enumerate(addrs.tolist(), start=s - lo):
                    objects[(j, og)] = (addr, nbytes)
            tables = [entry["tables"].get(k) for k in range(len(unit.groups))]
            job.requests.append((u, CopyRequest(unit.geometry, lo * unit.chunk_tokens,
                                                entry["hi"] * unit.chunk_tokens,
                                                blocks=tables, objects=objects)))
        return job

    def submit(self, lane: str, job_id: int, store: bool, gpu_ids: Any,
               group_sizes: Sequence[int], block_indices: Sequence[int], cpu_ids: Any) -> None:
        """Start a job (GPU -> CPU when ``store``). Never raises for the job's
        own failure: the job finishes failed, with its reason."""
        try:
            job = self.plan(gpu_ids, group_sizes, block_indices, cpu_ids)
        except (KvferryError, ValueError) as e:
            job = Job(job_id, store, 0, np.zeros(0, np.int64), np.asarray(gpu_ids, dtype=np.int64),
                      success=False, reason="cannot plan the job: %s" % e)
        job.job_id, job.store = job_id, store
        if job.success and not store:
            bad = job.chunks[self.state[job.chunks] != VALID]
            if bad.size:
                job.success = False
                job.reason = "CPU chunks %s were not stored whole" % sorted(set(bad.tolist()))
                job.requests = []
        if store and job.success:
            self.state[job.chunks] = PENDING
        if job.success:
            self._lanes[lane].run(job)
        else:
            self._lanes[lane].jobs.append(job)

    def finished(self) -> List[Job]:
        """The jobs that completed since the last call, each lane's in order."""
        out = []
        for lane in self._lanes.values():
            for job in lane.finished():
                if job.store:
                    self.state[job.chunks] = VALID if job.success else BAD
                if not job.success:
                    logger.error("kvferry offloading: %s job %d failed: %s",
                                 "store" if job.store else "load", job.job_id, job.reason)
                job.requests = []
                out.append(job)
        return out

    def wait(self, job_ids: Set[int]) -> None:
        """Block until those jobs' GPU work completed (their end events)."""
        for lane in self._lanes.values():
            lane.wait(job_ids)

    def close(self) -> None:
        """Wait for every job, close the transfer contexts and the geometries."""
        for lane in self._lanes.values():
            lane.drain()
        for lane in self._lanes.values():
            lane.close()
        self._lanes = {}
        self.layout.close()
