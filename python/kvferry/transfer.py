"""Transfer contexts: gather and scatter on a GPU or on the host (kvferry/transfer.h).

Stream rules (GPU): work is enqueued on the stream given; nothing
synchronizes the device or the stream. The block ids and object pointers are
read before the call returns. On the host backend the call returns when the
copy is done.

Deferred calls (``gather_deferred``, ``scatter_deferred``): the calling
thread checks and copies the request and returns a ticket after a few
microseconds; a thread of the context plans and enqueues the call after the
work already on the stream given. Later work is not ordered after it until
``join`` (a stream waits for it) or ``query`` (the host asks whether it is
done).

Threading: one context may be used from several threads at once (the C
library serializes the staging of tables); ``close()`` waits for calls in
flight on other threads, then destroys the context, which waits for the GPU
work of its calls (their events, never a device synchronize).
"""

from __future__ import annotations

import enum
from ctypes import byref, c_int, c_uint64, c_void_p
from dataclasses import dataclass
from typing import Any, Optional

from . import _structs as S
from ._buffers import stream_handle
from ._errors import Status
from ._handle import Handle, HandleOwner
from ._lib import fail, lib
from .copy import CopyRequest
from .geometry import Geometry

__all__ = ["Route", "TransferStats", "Transfer", "DEVICE_HOST"]

DEVICE_HOST = S.DEVICE_HOST


class Route(enum.IntEnum):
    """kvf_xfer_route: where a transfer's bytes travelled."""

    HOST = 0          #: host backend: CPU copies
    D2D = 1           #: cache and objects in this GPU's memory
    D2H = 2           #: gather from this GPU into host memory
    H2D = 3           #: scatter from host memory into this GPU
    PEER = 4          #: one side in a peer GPU's memory
    HOST_TO_HOST = 5  #: both sides in (pinned) host memory, copied by the GPU


@dataclass(frozen=True)
class TransferStats:
    """kvf_xfer_stats: what the last successful call on a context did."""

    route: Route
    sms: int            #: CTAs launched (one per SM at most)
    tasks: int          #: (layer, plane, block, slice) work items
    payload_bytes: int  #: bytes moved (padding excluded)


class Transfer(HandleOwner):
    """A transfer context (kvf_xfer) binding a finalized geometry to a backend.

    Args:
        geometry: the finalized :class:`Geometry`; it stays open while the
            context is (its close() refuses until this one is closed).
        device: a CUDA device ordinal, or -1 (``kvferry.DEVICE_HOST``) for the
            host backend.
        max_sms: cap on the SMs a launch uses; 0: the planner's default.
        host_threads: host backend threads; 0: up to 8.

    Raises KvferryError: NO_DRIVER / NO_DEVICE / UNSUPPORTED when a GPU is
    asked for where there is none, INVALID_ARGUMENT for an unknown device.

    ``close()`` (or the context manager, or ``__del__`` as a fallback)
    destroys the context, waiting for its calls' GPU work.
    """

    def __init__(self, geometry: Geometry, device: int = DEVICE_HOST, *, max_sms: int = 0,
                 host_threads: int = 0) -> None:
        if not isinstance(geometry, Geometry):
            raise fail(Status.INVALID_ARGUMENT, "a kvferry.Geometry is required", "geometry")
        opts = S.kvf_xfer_options.init()
        opts.device = int(device)
        opts.max_sms = int(max_sms)
        opts.host_threads = int(host_threads)
        if not geometry.finalized:
            raise fail(Status.STATE, "the geometry is not finalized", "geometry")
        # The context reads the geometry until it is destroyed: hold it open.
        g = geometry._handle.pin("transfer context")
        try:
            out = c_void_p()
            lib.kvf_xfer_create(g, byref(opts), byref(out))
        except BaseException:
            geometry._handle.unpin()
            raise
        self.geometry = geometry
        self.device = int(device)
        held = geometry._handle

        def destroy(ptr: int) -> None:  # refers to the geometry's handle only: no cycle
            lib.kvf_xfer_destroy(ptr)
            held.unpin()

        self._handle = Handle(out.value or 0, destroy, "transfer context")

    def _check_request(self, direction: str, request: CopyRequest) -> None:
        if not isinstance(request, CopyRequest):
            raise fail(Status.INVALID_ARGUMENT, "a kvferry.CopyRequest is required", "request")
        if request.geometry is not self.geometry:
            raise fail(Status.INVALID_ARGUMENT, "the request was built for another geometry "
                       "than this context's", "request")
        request._require(direction, host=self.device == DEVICE_HOST)

    def _run(self, fn: Any, direction: str, request: CopyRequest, stream: Any) -> None:
        self._check_request(direction, request)
        handle = stream_handle(stream)
        with self._handle.use() as x:
            fn(x, byref(request._c), handle or None)

    def _post(self, fn: Any, direction: str, request: CopyRequest, after: Any) -> int:
        self._check_request(direction, request)
        handle = stream_handle(after)
        ticket = c_uint64()
        with self._handle.use() as x:
            fn(x, byref(request._c), handle or None, byref(ticket))
        return ticket.value

    @staticmethod
    def _ticket(ticket: int) -> int:
        if isinstance(ticket, bool) or not isinstance(ticket, int) or not 0 < ticket < 1 << 64:
            raise fail(Status.INVALID_ARGUMENT, "ticket %r: a ticket a deferred call returned "
                       "is required" % (ticket,), "ticket")
        return ticket

    def gather(self, request: CopyRequest, stream: Any = None) -> None:
        """Copy the request's blocks from the cache into the objects, on
        ``stream`` (None: the legacy default stream; an int handle, an object
        with ``__cuda_stream__``, or a torch.cuda.Stream). Nothing is
        enqueued on failure."""
        self._run(lib.kvf_xfer_gather, "gather", request, stream)

    def scatter(self, request: CopyRequest, stream: Any = None) -> None:
        """Copy the request's objects into the cache blocks. Same rules as gather."""
        self._run(lib.kvf_xfer_scatter, "scatter", request, stream)

    def gather_deferred(self, request: CopyRequest, after: Any = None) -> int:
        """Hand a gather to the context's thread and return its ticket
        (kvf_xfer_gather_deferred): the request is checked (errors naming a
        field are raised here) and copied, so its arrays may be reused at
        once. The thread plans and enqueues the call after the work already
        on ``after`` (a stream, as for :meth:`gather`). Work enqueued later,
        on any stream, is not ordered after it: :meth:`join` orders a stream
        after it and :meth:`query` tells whether it is done; until then the
        call's blocks and objects must be left alone. Errors the thread
        meets are raised by the first join, query or flush covering the
        call. On the host backend the call runs at once and its ticket is
        already done. Raises INVALID_ARGUMENT (field ``after``) for a stream
        being captured into a graph."""
        return self._post(lib.kvf_xfer_gather_deferred, "gather", request, after)

    def scatter_deferred(self, request: CopyRequest, after: Any = None) -> int:
        """Hand a scatter to the context's thread and return its ticket
        (kvf_xfer_scatter_deferred). Same rules as :meth:`gather_deferred`."""
        return self._post(lib.kvf_xfer_scatter_deferred, "scatter", request, after)

    def join(self, ticket: int, stream: Any = None) -> None:
        """Order ``stream`` after the GPU work of the deferred calls up to
        ``ticket`` (kvf_xfer_join): waits until the context's thread has
        enqueued them, then enqueues on ``stream`` a wait for their work.
        Raises the first error one of them met that was not raised yet (the
        wait is enqueued all the same), and INVALID_ARGUMENT (field
        ``ticket``) for a ticket this context never gave."""
        t = self._ticket(ticket)
        handle = stream_handle(stream)
        with self._handle.use() as x:
            lib.kvf_xfer_join(x, t, handle or None)

    def query(self, ticket: int) -> bool:
        """Whether the GPU work of the deferred calls up to ``ticket`` is
        done (kvf_xfer_query), without waiting: once it is, what they
        gathered into host memory may be read and what they read reused.
        Raises the first error one of them met that was not raised yet, and
        INVALID_ARGUMENT (field ``ticket``) for a ticket this context never
        gave."""
        t = self._ticket(ticket)
        done = c_int(0)
        with self._handle.use() as x:
            lib.kvf_xfer_query(x, t, byref(done))
        return bool(done.value)

    def flush(self) -> None:
        """Wait until the context's thread has enqueued every deferred call
        made so far (not their GPU work) and raise the first error one of
        them met that was not raised yet (kvf_xfer_flush). Returns at once
        when no call was deferred, and on the host backend."""
        with self._handle.use() as x:
            lib.kvf_xfer_flush(x)

    def last_stats(self) -> TransferStats:
        """What the most recent successful call did (kvf_xfer_last_stats)."""
        stats = S.kvf_xfer_stats.init()
        with self._handle.use() as x:
            lib.kvf_xfer_last_stats(x, byref(stats))
        return TransferStats(Route(stats.route), stats.sms, stats.tasks, stats.payload_bytes)

    def __repr__(self) -> str:
        where = "host" if self.device == DEVICE_HOST else "cuda:%d" % self.device
        return "<kvferry.Transfer on %s%s>" % (where, " (closed)" if self.closed else "")


def route_name(route: Optional[Route]) -> str:
    """The library's short name of a route ("d2h")."""
    raw = lib.kvf_xfer_route_name(int(route or 0))
    return raw.decode() if raw else ""
