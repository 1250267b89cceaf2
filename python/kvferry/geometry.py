"""Geometries: where every byte of a paged KV cache lives (kvferry/geometry.h).

A :class:`Geometry` is built once, validated by :meth:`Geometry.finalize`,
and then read-only. Build one from a file (:meth:`Geometry.from_file`), from
JSON text (:meth:`Geometry.from_json`), from a preset
(:meth:`Geometry.preset`), in code (``add_region`` / ``add_group`` /
``add_view``, then ``finalize``), or from the engine's tensors
(:func:`kvferry.from_tensors`).

Threading: building is not thread-safe on one geometry; a finalized geometry
may be read from any number of threads at once. ``close()`` waits for reads
in flight on other threads.
"""

from __future__ import annotations

import ctypes
import enum
import json as _json
import os
import sys
from ctypes import byref, c_size_t, c_uint32, c_uint64, c_void_p
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, List, Mapping, Optional, Tuple, Union

from . import _lib
from . import _structs as S
from ._errors import Status
from ._handle import Handle, HandleOwner
from ._lib import check, fail, lib

__all__ = ["GroupKind", "ObjectFormat", "State", "View", "Region", "Group", "ObjectGroup",
           "Policy", "ObjectHeader", "Geometry", "preset_dirs", "presets", "BLOCK_SKIP"]

BLOCK_SKIP = S.BLOCK_SKIP


class GroupKind(enum.IntEnum):
    """kvf_group_kind: what a KV-cache group retains."""

    FULL = 0            #: every token
    SLIDING_WINDOW = 1  #: after N tokens keeps [N-W+1, N)
    CHUNKED_LOCAL = 2   #: after N tokens keeps [floor(N/C)*C, N)
    RECURRENT = 3       #: one state slot per sequence (Mamba, linear attention)

    @classmethod
    def parse(cls, value: Union["GroupKind", str, int]) -> "GroupKind":
        """A kind from its enum, its value or its name ("sliding_window")."""
        return _parse_enum(cls, value, "kind")


class ObjectFormat(enum.IntEnum):
    """kvf_object_format: the byte layout of cache objects."""

    CANONICAL = 0  #: [P][L][T][H][bytes], portable between layouts
    NATIVE = 1     #: per layer, block payloads in address order: same geometry only

    @classmethod
    def parse(cls, value: Union["ObjectFormat", str, int]) -> "ObjectFormat":
        """A format from its enum, its value or its name ("canonical")."""
        return _parse_enum(cls, value, "format")


def _parse_enum(cls: Any, value: Any, what: str) -> Any:
    if isinstance(value, cls):
        return value
    if isinstance(value, str):
        try:
            return cls[value.strip().upper()]
        except KeyError:
            pass
    elif isinstance(value, int) and not isinstance(value, bool):
        try:
            return cls(value)
        except ValueError:
            pass
    raise fail(Status.INVALID_ARGUMENT, "%r is not one of %s" % (
        value, ", ".join(m.name.lower() for m in cls)), what)


# ---- descriptions --------------------------------------------------------------

@dataclass(frozen=True)
class State:
    """One state tensor of a recurrent layer: bytes at an offset in the slot."""

    offset: int
    bytes: int


@dataclass(frozen=True)
class View:
    """kvf_view_desc: one layer's cache inside one region, in bytes.

    ``addr(b, p, t, h) = base(region) + offset + b*block_stride +
    p*plane_stride + t*token_stride + h*head_stride``, runs of
    ``head_bytes[p]`` bytes. Recurrent views give ``states`` instead of the
    attention fields. Defaults are those of KVF_VIEW_DESC_INIT. ``alias``
    declares that this view may overlap the earlier view ``(group, layer)``
    of the same region. ``head_bytes`` may be given as one int for every
    plane.
    """

    region: int = 0
    elem_bytes: int = 1
    offset: int = 0
    block_stride: int = 0
    planes: int = 0
    heads: int = 0
    plane_stride: int = 0
    token_stride: int = 0
    head_stride: int = 0
    head_bytes: Tuple[int, ...] = (0, 0)
    states: Tuple[State, ...] = ()
    alias: Optional[Tuple[int, int]] = None
    name: Optional[str] = None

    def __post_init__(self) -> None:
        hb = self.head_bytes
        if isinstance(hb, int):
            hb = (hb,) * max(self.planes, 1) if hb else (0,)
        hb = tuple(int(x) for x in hb)
        if len(hb) > S.MAX_PLANES:
            raise fail(Status.INVALID_ARGUMENT, "%d entries, at most %d planes"
                       % (len(hb), S.MAX_PLANES), "head_bytes")
        object.__setattr__(self, "head_bytes", hb + (0,) * (S.MAX_PLANES - len(hb)))
        states = tuple(s if isinstance(s, State) else State(int(s[0]), int(s[1]))
                       for s in self.states)
        if len(states) > S.MAX_STATES:
            raise fail(Status.INVALID_ARGUMENT, "%d states, at most %d"
                       % (len(states), S.MAX_STATES), "states")
        object.__setattr__(self, "states", states)
        if self.alias is not None:
            object.__setattr__(self, "alias", (int(self.alias[0]), int(self.alias[1])))

    def _to_c(self) -> Tuple[S.kvf_view_desc, Optional[bytes]]:
        d = S.kvf_view_desc.init()
        name = _encode(self.name)
        d.name = name
        for key in ("region", "elem_bytes", "offset", "block_stride", "planes", "heads",
                    "plane_stride", "token_stride", "head_stride"):
            _set_uint(d, key, getattr(self, key))
        for p, hb in enumerate(self.head_bytes):
            d.head_bytes[p] = _uint(hb, "head_bytes[%d]" % p, 32)
        d.num_states = len(self.states)
        for s, st in enumerate(self.states):
            d.states[s].offset = _uint(st.offset, "states[%d].offset" % s, 64)
            d.states[s].bytes = _uint(st.bytes, "states[%d].bytes" % s, 64)
        if self.alias is not None:
            d.alias_group, d.alias_layer = self.alias
        return d, name

    @classmethod
    def _from_c(cls, d: S.kvf_view_desc) -> "View":
        alias = (d.alias_group, d.alias_layer) if d.alias_group >= 0 else None
        return cls(region=d.region, elem_bytes=d.elem_bytes, offset=d.offset,
                   block_stride=d.block_stride, planes=d.planes, heads=d.heads,
                   plane_stride=d.plane_stride, token_stride=d.token_stride,
                   head_stride=d.head_stride, head_bytes=tuple(d.head_bytes),
                   states=tuple(State(d.states[i].offset, d.states[i].bytes)
                                for i in range(d.num_states)),
                   alias=alias, name=S.text(d.name) or None)


@dataclass(frozen=True)
class Region:
    """kvf_region_info: one memory allocation of a finalized geometry."""

    index: int
    name: str
    size: int
    align: int
    num_views: int


@dataclass(frozen=True)
class Group:
    """kvf_group_info: one KV-cache group of a finalized geometry."""

    index: int
    name: str
    kind: GroupKind
    block_size: int
    num_blocks: int
    window: int
    chunk: int
    num_layers: int
    object_group: int
    payload_per_block: int
    max_block_stride: int


@dataclass(frozen=True)
class ObjectGroup:
    """kvf_object_group_info: the groups whose layers share one object per chunk."""

    index: int
    groups: Tuple[int, ...]
    has_attention: bool
    has_recurrent: bool
    bytes_per_token: int
    recurrent_bytes: int


@dataclass(frozen=True)
class Policy:
    """kvf_object_policy, defaults from KVF_OBJECT_POLICY_INIT."""

    chunk_tokens: int = 256
    format: ObjectFormat = ObjectFormat.CANONICAL
    separate_windowed: bool = True
    separate_recurrent: bool = False

    def _to_c(self) -> S.kvf_object_policy:
        p = S.kvf_object_policy.init()
        p.chunk_tokens = _uint(self.chunk_tokens, "chunk_tokens", 32)
        p.format = ObjectFormat.parse(self.format)
        p.separate_windowed = 1 if self.separate_windowed else 0
        p.separate_recurrent = 1 if self.separate_recurrent else 0
        return p


@dataclass(frozen=True)
class ObjectHeader:
    """kvf_object_header: the metadata stored with every object.

    ``bytes(header)`` / :meth:`from_bytes` give the C struct's bytes.
    """

    magic: int
    header_version: int
    format: ObjectFormat
    fingerprint: int
    object_group: int
    dcp_rank: int
    token_begin: int
    token_end: int
    payload_bytes: int

    def _to_c(self) -> S.kvf_object_header:
        h = S.kvf_object_header()
        for f in S.kvf_object_header._fields_:
            setattr(h, f[0], int(getattr(self, f[0])))
        return h

    @classmethod
    def _from_c(cls, h: S.kvf_object_header) -> "ObjectHeader":
        values = {f[0]: getattr(h, f[0]) for f in S.kvf_object_header._fields_}
        try:
            values["format"] = ObjectFormat(values["format"])
        except ValueError:
            pass
        return cls(**values)

    def __bytes__(self) -> bytes:
        return bytes(self._to_c())

    @classmethod
    def from_bytes(cls, data: bytes) -> "ObjectHeader":
        """The header stored in ``data`` (at least sizeof(kvf_object_header) bytes)."""
        size = ctypes.sizeof(S.kvf_object_header)
        if len(data) < size:
            raise fail(Status.INVALID_ARGUMENT, "%d bytes, a header has %d" % (len(data), size),
                       "data")
        return cls._from_c(S.kvf_object_header.from_buffer_copy(bytes(data[:size])))


# ---- helpers -------------------------------------------------------------------

def _encode(name: Optional[str]) -> Optional[bytes]:
    if name is None:
        return None
    if isinstance(name, bytes):
        return name
    return str(name).encode("utf-8")


def _uint(value: Any, what: str, bits: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            value = int(value.__index__())
        except AttributeError:
            raise fail(Status.INVALID_ARGUMENT, "%r is not an integer" % (value,), what) from None
    if value < 0 or value >= 1 << bits:
        raise fail(Status.INVALID_ARGUMENT, "%d does not fit in %d unsigned bits" % (value, bits),
                   what)
    return value


def _set_uint(struct: Any, key: str, value: Any) -> None:
    ctype = dict(type(struct)._fields_)[key]
    setattr(struct, key, _uint(value, key, ctypes.sizeof(ctype) * 8))


def _load_options(num_blocks: Optional[int]) -> Optional[S.kvf_geometry_load_options]:
    if num_blocks is None:
        return None
    opts = S.kvf_geometry_load_options.init()
    opts.num_blocks_override = _uint(num_blocks, "num_blocks", 32)
    return opts


def preset_dirs() -> List[Path]:
    """Where presets are looked for, in order (the CLI's order):
    ``$KVF_PRESET_DIR``, the source checkout's ``geometry/presets``, then the
    install prefix's ``share/kvferry/presets`` (next to the loaded library,
    then ``sys.prefix`` and ``/usr/local``). The first that exists is used."""
    out: List[Path] = []
    env = os.environ.get("KVF_PRESET_DIR")
    if env:
        out.append(Path(env))
    for root in _lib.source_roots():
        out.append(root / "geometry" / "presets")
    libdir = Path(_lib.library_path).resolve().parent if os.sep in _lib.library_path else None
    if libdir is not None:
        out.append(libdir.parent / "share" / "kvferry" / "presets")
    for prefix in (sys.prefix, "/usr/local"):
        out.append(Path(prefix) / "share" / "kvferry" / "presets")
    seen: List[Path] = []
    for p in out:
        if p not in seen:
            seen.append(p)
    return seen


def _preset_dir() -> Path:
    dirs = preset_dirs()
    for d in dirs:
        if d.is_dir():
            return d
    raise fail(Status.NOT_FOUND, "no preset directory found (set KVF_PRESET_DIR); looked in "
               + ", ".join(str(d) for d in dirs), "preset")


def presets() -> List[str]:
    """The names of the presets in the preset directory, sorted."""
    return sorted(p.stem for p in _preset_dir().glob("*.json"))


# ---- the geometry ----------------------------------------------------------------

class Geometry(HandleOwner):
    """A kvferry geometry (kvf_geometry).

    ``Geometry()`` starts an empty one to build in code; the classmethods
    load finalized ones. Use it as a context manager or call :meth:`close`
    (``__del__`` frees it otherwise). A geometry must outlive the
    :class:`kvferry.Transfer` contexts made for it: ``close()`` refuses while
    one is open.

    Geometries made by :func:`kvferry.from_tensors` also carry ``bases``:
    each region's memory, which :class:`kvferry.CopyRequest` uses when it is
    given no region bases.
    """

    def __init__(self, name: str = "", description: str = "") -> None:
        out = c_void_p()
        lib.kvf_geometry_create(byref(out))
        self._init(out.value or 0, finalized=False)
        self._policy = Policy()
        if name or description:
            self.set_name(name, description)

    def _init(self, ptr: int, finalized: bool) -> None:
        self._handle = Handle(ptr, lib.kvf_geometry_destroy, "geometry")
        self._finalized = finalized
        self.bases: Optional[Tuple[Any, ...]] = None

    @classmethod
    def _adopt(cls, ptr: int) -> "Geometry":
        self = cls.__new__(cls)
        self._init(ptr, finalized=True)
        self._policy = self.policy
        return self

    # -- loading --

    @classmethod
    def from_file(cls, path: Union[str, os.PathLike], num_blocks: Optional[int] = None) -> "Geometry":
        """Load, validate and finalize a geometry file (docs/geometry.md).

        num_blocks, when given, replaces every group's num_blocks (region
        sizes left at 0 in the file are computed for it). Raises
        KvferryError: NOT_FOUND / IO for an unreadable file, PARSE naming the
        JSON path, or a validation status naming group, layer and field.
        """
        out = c_void_p()
        err = S.kvf_geometry_error()
        opts = _load_options(num_blocks)
        st = lib.kvf_geometry_load_file(os.fsencode(path), byref(opts) if opts else None,
                                        byref(out), byref(err))
        check(st, err)
        return cls._adopt(out.value or 0)

    @classmethod
    def from_json(cls, text: Union[str, bytes, Mapping[str, Any]],
                  num_blocks: Optional[int] = None) -> "Geometry":
        """Load a geometry from JSON text (str or bytes) or from the dict a
        geometry file parses into. Statuses as :meth:`from_file`."""
        if isinstance(text, Mapping):
            text = _json.dumps(text)
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        out = c_void_p()
        err = S.kvf_geometry_error()
        opts = _load_options(num_blocks)
        st = lib.kvf_geometry_load_buffer(data, len(data), byref(opts) if opts else None,
                                          byref(out), byref(err))
        check(st, err)
        return cls._adopt(out.value or 0)

    @classmethod
    def preset(cls, name: str, num_blocks: Optional[int] = None) -> "Geometry":
        """Load a preset by name ("llama-3.1-8b-fa-nhd") from the preset
        directory (see :func:`preset_dirs`), or a path to a file."""
        if os.sep in name or name.endswith(".json"):
            return cls.from_file(name, num_blocks)
        directory = _preset_dir()
        path = directory / (name + ".json")
        if not path.is_file():
            raise fail(Status.NOT_FOUND, "%r is not in %s (presets there: %s)"
                       % (name, directory, ", ".join(presets()) or "none"), "preset")
        return cls.from_file(path, num_blocks)

    # -- building --

    def _building(self) -> int:
        if self._finalized:
            raise fail(Status.STATE, "the geometry is finalized and read-only", "geometry")
        return self._handle.ptr

    def add_region(self, name: Optional[str] = None, size: int = 0, align: int = 256) -> int:
        """Append a region (kvf_geometry_add_region); returns its index.
        size 0: the smallest size holding every view, computed at finalize."""
        ptr = self._building()
        d = S.kvf_region_desc.init()
        keep = _encode(name)
        d.name = keep
        d.size = _uint(size, "size", 64)
        d.align = _uint(align, "align", 64)
        index = c_uint32()
        lib.kvf_geometry_add_region(ptr, byref(d), byref(index))
        return index.value

    def add_group(self, name: Optional[str] = None, kind: Union[GroupKind, str] = GroupKind.FULL,
                  block_size: int = 16, num_blocks: int = 0, window: int = 0,
                  chunk: int = 0) -> int:
        """Append a group (kvf_geometry_add_group); returns its index.
        Defaults as KVF_GROUP_DESC_INIT. window is for sliding_window groups,
        chunk for chunked_local ones; block_size is ignored for recurrent
        groups."""
        ptr = self._building()
        d = S.kvf_group_desc.init()
        keep = _encode(name)
        d.name = keep
        d.kind = GroupKind.parse(kind)
        d.block_size = _uint(block_size, "block_size", 32)
        d.num_blocks = _uint(num_blocks, "num_blocks", 32)
        d.window = _uint(window, "window", 32)
        d.chunk = _uint(chunk, "chunk", 32)
        index = c_uint32()
        lib.kvf_geometry_add_group(ptr, byref(d), byref(index))
        return index.value

    def add_view(self, group: int, view: Optional[View] = None, **fields: Any) -> int:
        """Append a layer view to ``group`` (kvf_geometry_add_view); returns
        the layer's index in the group. Give a :class:`View`, or its fields
        as keyword arguments (they override the View's when both are given)."""
        ptr = self._building()
        if view is None:
            view = View(**fields)
        elif fields:
            view = replace(view, **fields)
        d, _keep = view._to_c()
        layer = c_uint32()
        lib.kvf_geometry_add_view(ptr, _uint(group, "group", 32), byref(d), byref(layer))
        return layer.value

    def set_policy(self, policy: Optional[Policy] = None, **fields: Any) -> None:
        """Replace the object policy: a :class:`Policy`, or some of its
        fields (the others keep their current values)."""
        ptr = self._building()
        policy = replace(policy or self._policy, **fields)
        c = policy._to_c()
        lib.kvf_geometry_set_policy(ptr, byref(c))
        self._policy = policy

    def set_dcp(self, world: int, rank: int) -> None:
        """Declare this geometry rank ``rank`` of ``world`` decode-context-parallel ranks."""
        lib.kvf_geometry_set_dcp(self._building(), _uint(world, "world", 32),
                                 _uint(rank, "rank", 32))

    def set_name(self, name: str, description: str = "") -> None:
        """Record the geometry's name and description."""
        lib.kvf_geometry_set_name(self._building(), _encode(name) or b"",
                                  _encode(description) or b"")

    def finalize(self) -> "Geometry":
        """Validate every rule, size the regions whose size is 0, compute the
        object layouts and fingerprints, and make the geometry read-only.
        Raises KvferryError (INVALID_GEOMETRY or OVERFLOW) with ``group``,
        ``layer`` and ``field`` of the broken rule. Returns self."""
        ptr = self._building()
        err = S.kvf_geometry_error()
        check(lib.kvf_geometry_finalize(ptr, byref(err)), err)
        self._finalized = True
        return self

    # -- lifetime --

    @property
    def finalized(self) -> bool:
        """True once finalize() succeeded (loaded geometries are finalized)."""
        return self._finalized

    def close(self) -> None:
        """Free the geometry, once reads in flight on other threads are done.
        Refused (Status.STATE) while a Transfer made for it is open. Closing
        twice does nothing."""
        super().close()
        self.bases = None

    def __repr__(self) -> str:
        if self.closed:
            return "<kvferry.Geometry (closed)>"
        if not self._finalized:
            return "<kvferry.Geometry (building)>"
        return "<kvferry.Geometry %r: %d regions, %d groups, %d object groups>" % (
            self.name, self.num_regions, self.num_groups, self.num_object_groups)

    # -- reading --

    def _reading(self):
        if not self._finalized:
            raise fail(Status.STATE, "the geometry is not finalized", "geometry")
        return self._handle.use()

    @property
    def name(self) -> str:
        """The geometry's name ("" when none was set)."""
        with self._handle.use() as g:
            return S.text(lib.kvf_geometry_name(g))

    @property
    def description(self) -> str:
        """The geometry's description ("" when none was set)."""
        with self._handle.use() as g:
            return S.text(lib.kvf_geometry_description(g))

    @property
    def num_regions(self) -> int:
        """Number of regions."""
        with self._reading() as g:
            return lib.kvf_geometry_num_regions(g)

    @property
    def num_groups(self) -> int:
        """Number of groups."""
        with self._reading() as g:
            return lib.kvf_geometry_num_groups(g)

    @property
    def num_object_groups(self) -> int:
        """Number of object groups (objects per chunk)."""
        with self._reading() as g:
            return lib.kvf_geometry_num_object_groups(g)

    @property
    def num_aliases(self) -> int:
        """Views declared as aliases of another view."""
        with self._reading() as g:
            return lib.kvf_geometry_num_aliases(g)

    def region(self, index: int) -> Region:
        """Region ``index`` (kvf_geometry_region)."""
        info = S.kvf_region_info.init()
        with self._reading() as g:
            lib.kvf_geometry_region(g, _uint(index, "index", 32), byref(info))
            return Region(index, S.text(info.name), info.size, info.align, info.num_views)

    @property
    def regions(self) -> List[Region]:
        """Every region, in index order."""
        return [self.region(i) for i in range(self.num_regions)]

    def group(self, index: Union[int, str]) -> Group:
        """Group ``index`` (kvf_geometry_group), by index or by name."""
        i = self.group_index(index)
        info = S.kvf_group_info.init()
        with self._reading() as g:
            lib.kvf_geometry_group(g, i, byref(info))
            return Group(i, S.text(info.name), GroupKind(info.kind), info.block_size,
                         info.num_blocks, info.window, info.chunk, info.num_layers,
                         info.object_group, info.payload_per_block, info.max_block_stride)

    @property
    def groups(self) -> List[Group]:
        """Every group, in index order."""
        return [self.group(i) for i in range(self.num_groups)]

    def group_index(self, key: Union[int, str]) -> int:
        """The index of a group given by index or by name."""
        if isinstance(key, str):
            info = S.kvf_group_info.init()
            with self._reading() as g:
                for i in range(lib.kvf_geometry_num_groups(g)):
                    lib.kvf_geometry_group(g, i, byref(info))
                    if S.text(info.name) == key:
                        return i
            raise fail(Status.NOT_FOUND, "no group is named %r" % key, "group")
        return _uint(key, "group", 32)

    def object_group(self, index: int) -> ObjectGroup:
        """Object group ``index`` (kvf_geometry_object_group)."""
        info = S.kvf_object_group_info.init()
        with self._reading() as g:
            lib.kvf_geometry_object_group(g, _uint(index, "index", 32), byref(info))
            return ObjectGroup(index, tuple(info.groups[i] for i in range(info.num_groups)),
                               bool(info.has_attention), bool(info.has_recurrent),
                               info.bytes_per_token, info.recurrent_bytes)

    @property
    def object_groups(self) -> List[ObjectGroup]:
        """Every object group, in index order."""
        return [self.object_group(i) for i in range(self.num_object_groups)]

    def view(self, group: Union[int, str], layer: int) -> View:
        """Layer ``layer`` of group ``group`` (kvf_geometry_view)."""
        gi = self.group_index(group)
        d = S.kvf_view_desc.init()
        with self._reading() as g:
            lib.kvf_geometry_view(g, gi, _uint(layer, "layer", 32), byref(d))
            return View._from_c(d)

    def views(self, group: Union[int, str]) -> List[View]:
        """Every layer view of a group, in layer order."""
        info = self.group(group)
        return [self.view(info.index, layer) for layer in range(info.num_layers)]

    @property
    def policy(self) -> Policy:
        """The object policy (kvf_geometry_policy)."""
        p = S.kvf_object_policy.init()
        with self._handle.use() as g:
            lib.kvf_geometry_policy(g, byref(p))
        return Policy(p.chunk_tokens, ObjectFormat(p.format), bool(p.separate_windowed),
                      bool(p.separate_recurrent))

    @property
    def dcp(self) -> Tuple[int, int]:
        """(world, rank) of decode-context parallelism."""
        world, rank = c_uint32(), c_uint32()
        with self._handle.use() as g:
            lib.kvf_geometry_dcp(g, byref(world), byref(rank))
        return world.value, rank.value

    def _format(self, format: Optional[Union[ObjectFormat, str]]) -> ObjectFormat:
        return self._policy.format if format is None else ObjectFormat.parse(format)

    def fingerprint(self, format: Optional[Union[ObjectFormat, str]] = None) -> int:
        """The 64-bit fingerprint of objects in ``format`` (default: the
        policy's); equal fingerprints mean interchangeable objects."""
        with self._reading() as g:
            return lib.kvf_geometry_fingerprint(g, self._format(format))

    # -- tokens, blocks, windows --

    def local_tokens(self, global_tokens: int) -> int:
        """This rank's tokens among global tokens [0, global_tokens)."""
        with self._reading() as g:
            return lib.kvf_geometry_local_tokens(g, _uint(global_tokens, "global_tokens", 64))

    def local_blocks(self, group: Union[int, str], token_begin: int,
                     token_end: int) -> Tuple[int, int]:
        """(first, end): the local blocks of attention group ``group`` holding
        this rank's tokens of the global range [token_begin, token_end)."""
        gi = self.group_index(group)
        first, end = c_uint64(), c_uint64()
        with self._reading() as g:
            lib.kvf_geometry_local_blocks(g, gi, _uint(token_begin, "token_begin", 64),
                                          _uint(token_end, "token_end", 64), byref(first), byref(end))
        return first.value, end.value

    def retained_tokens(self, group: Union[int, str], prefix_tokens: int) -> int:
        """The first global token a group retains after ``prefix_tokens`` tokens."""
        gi = self.group_index(group)
        begin = c_uint64()
        with self._reading() as g:
            lib.kvf_geometry_retained_tokens(g, gi, _uint(prefix_tokens, "prefix_tokens", 64),
                                             byref(begin))
        return begin.value

    def retained_blocks(self, group: Union[int, str], prefix_tokens: int) -> Tuple[int, int]:
        """(first, end): the local blocks a group retains after ``prefix_tokens`` tokens."""
        gi = self.group_index(group)
        first, end = c_uint64(), c_uint64()
        with self._reading() as g:
            lib.kvf_geometry_retained_blocks(g, gi, _uint(prefix_tokens, "prefix_tokens", 64),
                                             byref(first), byref(end))
        return first.value, end.value

    def recurrent_state(self, prefix_tokens: int) -> int:
        """The chunk whose object carries the recurrent state after
        ``prefix_tokens`` tokens (a chunk boundary, else KvferryError)."""
        chunk = c_uint64()
        with self._reading() as g:
            lib.kvf_geometry_recurrent_state(g, _uint(prefix_tokens, "prefix_tokens", 64),
                                             byref(chunk))
        return chunk.value

    # -- objects --

    def num_chunks(self, token_begin: int, token_end: int) -> int:
        """Chunks (objects per object group) of global tokens [token_begin, token_end)."""
        c = self._policy.chunk_tokens
        if token_end <= token_begin:
            return 0
        return (token_end - 1) // c - token_begin // c + 1

    def object_size(self, object_group: int, chunk_index: int, total_tokens: int) -> int:
        """Payload bytes of object group ``object_group``'s object for chunk
        ``chunk_index`` of a ``total_tokens``-token sequence."""
        out = c_uint64()
        with self._reading() as g:
            lib.kvf_geometry_object_size(g, _uint(object_group, "object_group", 32),
                                         _uint(chunk_index, "chunk_index", 64),
                                         _uint(total_tokens, "total_tokens", 64), byref(out))
        return out.value

    def object_segment(self, group: Union[int, str], layer: int, plane: int = 0,
                       local_tokens: int = 0,
                       format: Optional[Union[ObjectFormat, str]] = None) -> Tuple[int, int]:
        """(offset, size): where the (layer, plane) segment starts in an
        object of ``local_tokens`` tokens, and its size in bytes (for
        attention ``local_tokens`` rows of the layer's heads; for a recurrent
        layer its states, plane ignored). Native: the layer's block payloads."""
        gi = self.group_index(group)
        offset, row = c_uint64(), c_uint64()
        with self._reading() as g:
            lib.kvf_geometry_object_segment(g, self._format(format), gi, _uint(layer, "layer", 32),
                                            _uint(plane, "plane", 32),
                                            _uint(local_tokens, "local_tokens", 64),
                                            byref(offset), byref(row))
        return offset.value, row.value

    def object_header(self, object_group: int, chunk_index: int, total_tokens: int,
                      format: Optional[Union[ObjectFormat, str]] = None) -> ObjectHeader:
        """The header of an object (kvf_object_header_init)."""
        h = S.kvf_object_header()
        with self._reading() as g:
            lib.kvf_object_header_init(g, self._format(format),
                                       _uint(object_group, "object_group", 32),
                                       _uint(chunk_index, "chunk_index", 64),
                                       _uint(total_tokens, "total_tokens", 64), byref(h))
        return ObjectHeader._from_c(h)

    def check_object_header(self, header: ObjectHeader, object_group: int) -> None:
        """Raise KvferryError (GEOMETRY_MISMATCH, naming the field) unless an
        object with ``header`` can be scattered into ``object_group``."""
        h = header._to_c()
        with self._reading() as g:
            lib.kvf_object_header_check(g, byref(h), _uint(object_group, "object_group", 32))

    def to_json(self) -> str:
        """The geometry as a geometry file (kvf_geometry_to_json) that
        :meth:`from_json` loads back into an equal geometry."""
        out = c_void_p()
        n = c_size_t()
        with self._reading() as g:
            lib.kvf_geometry_to_json(g, byref(out), byref(n))
        try:
            return ctypes.string_at(out.value or 0, n.value).decode("utf-8")
        finally:
            _lib.free(out)

