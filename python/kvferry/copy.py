"""Copy requests and the CPU reference gather/scatter (kvferry/copy.h).

A :class:`CopyRequest` says which blocks of which groups move between a KV
cache and which cache objects, for the global tokens [token_begin,
token_end) of one sequence. Build it once from Python objects (buffers,
block tables); it keeps every object it was given alive, and the C request
it holds can be passed to :func:`reference_gather`, :func:`reference_scatter`
and :class:`kvferry.Transfer` as often as needed.

Block tables: ``block_ids[i]`` is the engine block holding this rank's local
block ``first_block + i``. Entries of -1 or None (and KVF_BLOCK_SKIP) move
nothing. For a recurrent group, local block k is the state at the end of
chunk k and its id is the slot.
"""

from __future__ import annotations

import ctypes
from ctypes import byref, c_void_p
from typing import Any, List, Mapping, Optional, Sequence, Tuple, Union

from . import _structs as S
from ._buffers import BufferView, as_buffer, block_ids
from ._errors import Status
from ._lib import fail, lib
from .geometry import Geometry, ObjectFormat

__all__ = ["BlockTable", "CopyRequest", "reference_gather", "reference_scatter"]


class BlockTable:
    """A block table with its local offset: ``block_ids[i]`` is the engine
    block of local block ``first_block + i``. A bare sequence or array of ids
    given to :class:`CopyRequest` means ``first_block=0``."""

    __slots__ = ("block_ids", "first_block")

    def __init__(self, block_ids: Any, first_block: int = 0) -> None:
        self.block_ids = block_ids
        self.first_block = int(first_block)
        if self.first_block < 0:
            raise fail(Status.INVALID_ARGUMENT, "%d is negative" % self.first_block, "first_block")


def _per_index(value: Any, count: int, what: str,
               key: Any = None) -> List[Any]:
    """A list of `count` entries from a sequence of that length or a mapping
    of index (or key(name) -> index) to entry."""
    if isinstance(value, Mapping):
        out: List[Any] = [None] * count
        for k, v in value.items():
            i = key(k) if key is not None and not isinstance(k, int) else k
            if not isinstance(i, int) or not 0 <= i < count:
                raise fail(Status.INVALID_ARGUMENT, "key %r: not one of the %d entries" % (k, count),
                           what)
            out[i] = v
        return out
    out = list(value)
    if len(out) != count:
        raise fail(Status.INVALID_ARGUMENT, "%d entries given, the geometry has %d"
                   % (len(out), count), what)
    return out


class CopyRequest:
    """A kvf_copy_request built from Python objects.

    Args:
        geometry: a finalized :class:`Geometry`.
        token_begin, token_end: the global tokens [token_begin, token_end);
            token_begin is a multiple of the policy's chunk_tokens.
        blocks: one block table per group: a sequence with an entry per
            group (None: the group does not move), or a mapping from group
            index or name to its table. A table is a sequence of ints (None
            or -1 skip a block), a 1-D integer array or tensor in host memory,
            or a :class:`BlockTable` with a first_block.
        objects: the objects, a flat sequence indexed ``chunk *
            num_object_groups + object_group`` (None where that object group
            does not move), or a mapping from (chunk, object_group) to the
            object. Each is a buffer (see docs/python.md, "Buffers") holding
            at least the object's size.
        region_bases: one buffer per region (None for regions no moving view
            lives in), as a sequence or a mapping from region index. Default:
            the geometry's ``bases`` (geometries made by from_tensors).
        format: the object format; default the geometry's policy format.

    Raises KvferryError (INVALID_ARGUMENT) naming the argument, the group and
    the index for a bad entry, and for a buffer smaller than its region or
    object. The C request's own checks (block ids below num_blocks, region
    alignment, objects present where blocks move) run in :meth:`check` and
    in every gather and scatter.
    """

    def __init__(self, geometry: Geometry, token_begin: int, token_end: int, *,
                 blocks: Union[Sequence[Any], Mapping[Any, Any]],
                 objects: Union[Sequence[Any], Mapping[Tuple[int, int], Any]],
                 region_bases: Optional[Union[Sequence[Any], Mapping[int, Any]]] = None,
                 format: Optional[Union[ObjectFormat, str]] = None) -> None:
        if not isinstance(geometry, Geometry) or not geometry.finalized:
            raise fail(Status.INVALID_ARGUMENT, "a finalized kvferry.Geometry is required",
                       "geometry")
        self.geometry = geometry
        self.token_begin = int(token_begin)
        self.token_end = int(token_end)
        self.format = geometry._format(format)
        self._keep: List[Any] = []
        self._views: List[Tuple[str, BufferView, str]] = []  # (what, view, role)

        regions = geometry.regions
        groups = geometry.groups
        num_og = geometry.num_object_groups

        if region_bases is None:
            region_bases = geometry.bases
            if region_bases is None:
                raise fail(Status.INVALID_ARGUMENT, "required (this geometry was not made from "
                           "tensors, so it has no bases of its own)", "region_bases")
        bases = _per_index(region_bases, len(regions), "region_bases")
        self._bases = (c_void_p * max(len(bases), 1))()
        for i, b in enumerate(bases):
            if b is None:
                continue
            what = "region_bases[%d]" % i
            view = as_buffer(b, what)
            if view.nbytes < regions[i].size:
                raise fail(Status.INVALID_ARGUMENT, "%d bytes, but region %d%s is %d bytes"
                           % (view.nbytes, i, _named(regions[i].name), regions[i].size), what)
            self._bases[i] = view.ptr or None
            self._views.append((what, view, "cache"))

        tables = _per_index(blocks, len(groups), "blocks", key=geometry.group_index)
        self._groups = (S.kvf_group_blocks * max(len(tables), 1))()
        for gi, table in enumerate(tables):
            first = 0
            if isinstance(table, BlockTable):
                first, table = table.first_block, table.block_ids
            what = "blocks[%s]" % (repr(groups[gi].name) if groups[gi].name else gi)
            ptr, count, keep = block_ids(table, what)
            self._groups[gi].block_ids = ptr
            self._groups[gi].first_block = first
            self._groups[gi].count = count
            self._keep.append(keep)

        chunks = geometry.num_chunks(self.token_begin, self.token_end)
        self.num_chunks = chunks
        aligned = chunks > 0 and self.token_begin % geometry.policy.chunk_tokens == 0
        if isinstance(objects, Mapping):
            flat: List[Any] = [None] * (chunks * num_og)
            for key, obj in objects.items():
                try:
                    k, og = key
                except (TypeError, ValueError):
                    raise fail(Status.INVALID_ARGUMENT, "key %r: expected (chunk, object_group)"
                               % (key,), "objects") from None
                if not (0 <= k < chunks and 0 <= og < num_og):
                    raise fail(Status.INVALID_ARGUMENT, "key %r: the request has %d chunks of %d "
                               "object groups" % (key, chunks, num_og), "objects")
                flat[k * num_og + og] = obj
        else:
            flat = list(objects)
            if len(flat) != chunks * num_og:
                raise fail(Status.INVALID_ARGUMENT, "%d objects given, the request needs %d "
                           "(%d chunks x %d object groups)" % (len(flat), chunks * num_og, chunks,
                                                               num_og), "objects")
        self._objects = (c_void_p * max(len(flat), 1))()
        first_chunk = self.token_begin // geometry.policy.chunk_tokens
        for i, obj in enumerate(flat):
            if obj is None:
                continue
            what = "objects[%d]" % i
            view = as_buffer(obj, what)
            if not view.contiguous:
                raise fail(Status.INVALID_ARGUMENT, "an object must be contiguous memory", what)
            if aligned:
                need = geometry.object_size(i % num_og, first_chunk + i // num_og, self.token_end)
                if view.nbytes < need:
                    raise fail(Status.INVALID_ARGUMENT, "%d bytes, but chunk %d of object group %d "
                               "is %d bytes" % (view.nbytes, i // num_og, i % num_og, need), what)
            self._objects[i] = view.ptr or None
            self._views.append((what, view, "object"))

        c = S.kvf_copy_request.init()
        c.region_bases = ctypes.cast(self._bases, ctypes.POINTER(c_void_p))
        c.token_begin = self.token_begin
        c.token_end = self.token_end
        c.format = self.format
        c.groups = ctypes.cast(self._groups, ctypes.POINTER(S.kvf_group_blocks))
        c.objects = ctypes.cast(self._objects, ctypes.POINTER(c_void_p))
        self._c = c

    def _require(self, direction: str, host: bool) -> None:
        """Refuse buffers the call cannot use: device memory for the CPU,
        read-only destinations."""
        dest = "object" if direction == "gather" else "cache"
        for what, view, role in self._views:
            if host and not view.host_accessible:
                raise fail(Status.INVALID_ARGUMENT, "memory on %s: the host backend and the "
                           "reference copies run on the CPU" % view.where, what)
            if role == dest and view.readonly:
                raise fail(Status.INVALID_ARGUMENT, "read-only memory, but the %s writes it"
                           % direction, what)

    @property
    def c_request(self) -> S.kvf_copy_request:
        """The kvf_copy_request (valid while this object lives)."""
        return self._c

    def check(self) -> None:
        """kvf_copy_request_check: raise KvferryError naming the field of the
        first violation ("groups[1].block_ids[7]"); moves nothing."""
        with self.geometry._reading() as g:
            lib.kvf_copy_request_check(g, byref(self._c))

    def __repr__(self) -> str:
        return "<kvferry.CopyRequest tokens [%d, %d), %d chunks, %s>" % (
            self.token_begin, self.token_end, self.num_chunks, self.format.name.lower())


def _named(name: str) -> str:
    return " (%r)" % name if name else ""


def reference_gather(request: CopyRequest) -> None:
    """Gather (cache -> objects) on the calling thread, straight from the view
    formula (kvf_reference_gather): the oracle the kernels are tested against.
    Host memory only."""
    request._require("gather", host=True)
    with request.geometry._reading() as g:
        lib.kvf_reference_gather(g, byref(request._c))


def reference_scatter(request: CopyRequest) -> None:
    """Scatter (objects -> cache) on the calling thread (kvf_reference_scatter).
    Host memory only."""
    request._require("scatter", host=True)
    with request.geometry._reading() as g:
        lib.kvf_reference_scatter(g, byref(request._c))

