"""Geometries from the engine's own tensors, in elements and dtypes.

An engine knows its KV cache as tensors: one per layer (or one for all
layers), with a logical shape such as ``(2, num_blocks, block_size,
num_kv_heads, head_size)`` and strides that put the dimensions in the
backend's physical order. :func:`from_tensors` reads each tensor's data
pointer, shape, strides and element size through the buffer protocols
(DLPack, ``__cuda_array_interface__``, ``__array_interface__``; no torch
needed), and builds the regions and views: byte strides are computed here,
never by the caller.

- Regions: one per allocation. A tensor's allocation is what the caller
  gives in ``allocations``, else what the tensor says (a torch tensor's
  untyped storage, the array at the bottom of a numpy array's ``.base``
  chain), else the bytes its view spans; tensors whose allocations overlap
  share one region.
- Aliases: a view that shares a byte with a view of an earlier group in the
  same region is declared its alias (vLLM shares one tensor between the
  i-th layers of its groups). The test is exact for views with one block
  stride (block footprints compared at every block offset that can meet),
  by spans otherwise. Overlap inside one group is left to validation,
  which rejects it.

Layouts name the tensor's logical dimensions, outermost first, as a
comma-separated string, a sequence, or a mapping of name to dimension
index. Names (case-insensitive, with synonyms):

=============  ============================================  =========
name           synonyms                                      needed
=============  ============================================  =========
``blocks``     ``num_blocks``, ``nb``, ``slots``             always
``planes``     ``kv``, ``p`` (K and V: size 1 or 2)          optional
``tokens``     ``block_size``, ``bs``, ``t``                 attention
``heads``      ``num_kv_heads``, ``h``                       optional
``head_size``  ``head_dim``, ``d``, ``r``, ``row``           attention
``layers``     ``num_layers``, ``l`` (one tensor, all layers) optional
``_`` or ``1`` a dimension of size 1 to ignore               optional
=============  ============================================  =========

Recurrent (Mamba) groups take, per layer, one state tensor or a sequence of
them (conv state, SSM state, ...): the ``blocks`` dimension (the first,
unless a layout names it) indexes state slots and the remaining dimensions
must be contiguous; the states of one layer share one slot stride.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from ._buffers import BufferView, RawBuffer, allocation_extent, as_buffer
from ._errors import KvferryError, Status
from ._lib import fail
from .geometry import Geometry, GroupKind, ObjectFormat, State, View

__all__ = ["TensorGroup", "from_tensors", "VLLM_FLASH_ATTN", "VLLM_FLASHINFER", "VLLM_MLA",
           "VLLM_CROSS_LAYER", "LAYOUT_NAMES"]

#: vLLM FlashAttention ``(2, num_blocks, block_size, num_kv_heads, head_size)``;
#: the HND order is in the strides, so the same names serve it.
VLLM_FLASH_ATTN = "planes,blocks,tokens,heads,head_size"
#: vLLM FlashInfer and Triton ``(num_blocks, 2, block_size, num_kv_heads, head_size)``.
VLLM_FLASHINFER = "blocks,planes,tokens,heads,head_size"
#: vLLM MLA ``(num_blocks, block_size, 576)``: one plane, one "head" row.
VLLM_MLA = "blocks,tokens,head_size"
#: vLLM cross-layer ``(num_blocks, num_layers, 2, block_size, num_kv_heads, head_size)``.
VLLM_CROSS_LAYER = "blocks,layers,planes,tokens,heads,head_size"

LAYOUT_NAMES: Dict[str, str] = {}
for _canon, _names in {
    "blocks": ("blocks", "block", "num_blocks", "nb", "slots", "slot"),
    "planes": ("planes", "plane", "kv", "p"),
    "tokens": ("tokens", "token", "block_size", "bs", "t"),
    "heads": ("heads", "head", "num_kv_heads", "num_heads", "h"),
    "head_size": ("head_size", "head_dim", "d", "r", "row"),
    "layers": ("layers", "layer", "num_layers", "l"),
    "_": ("_", "1"),
}.items():
    for _n in _names:
        LAYOUT_NAMES[_n] = _canon


class TensorGroup:
    """One KV-cache group described by its tensors.

    Args:
        layers: the group's layers in order: a sequence, or a mapping of
            layer name to tensor (the names go into the views). Attention:
            one tensor per layer, or one tensor with a ``layers`` dimension
            for several. Recurrent: per layer a state tensor or a sequence of
            state tensors.
        layout: the tensors' logical dimensions (see the module doc), e.g.
            ``kvferry.VLLM_FLASH_ATTN``. Required for attention groups;
            optional for recurrent ones (default: slots first).
        kind: "full", "sliding_window", "chunked_local" or "recurrent".
        name: the group's name.
        block_size: if given, checked against the tensors' ``tokens`` size.
        num_blocks: block ids 0 .. num_blocks-1 (at most the tensors'
            ``blocks`` size; default that size).
        window: W tokens, for sliding_window.
        chunk: C tokens, for chunked_local.
    """

    def __init__(self, layers: Union[Sequence[Any], Mapping[str, Any]],
                 layout: Optional[Union[str, Sequence[str], Mapping[str, int]]] = None, *,
                 kind: Union[GroupKind, str] = GroupKind.FULL, name: Optional[str] = None,
                 block_size: Optional[int] = None, num_blocks: Optional[int] = None,
                 window: int = 0, chunk: int = 0) -> None:
        if isinstance(layers, Mapping):
            self.layers: List[Tuple[Optional[str], Any]] = [(str(k), v) for k, v in layers.items()]
        else:
            self.layers = [(None, v) for v in layers]
        self.layout = layout
        self.kind = GroupKind.parse(kind)
        self.name = name
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.window = window
        self.chunk = chunk


# ---- reading tensors ------------------------------------------------------------

def _parse_layout(layout: Any, ndim: int, what: str) -> Tuple[Dict[str, int], List[int]]:
    """{canonical name: dimension} and the dimensions named '_'."""
    if layout is None:
        raise fail(Status.INVALID_ARGUMENT, "a layout naming the tensor's dimensions is required "
                   "(for example kvferry.VLLM_FLASH_ATTN = %r)" % VLLM_FLASH_ATTN, what)
    if isinstance(layout, Mapping):
        items = [(str(k), int(v)) for k, v in layout.items()]
    else:
        names = layout.replace("(", "").replace(")", "").split(",") if isinstance(layout, str) \
            else list(layout)
        names = [str(n).strip() for n in names if str(n).strip()]
        if len(names) != ndim:
            raise fail(Status.INVALID_ARGUMENT, "layout %r names %d dimensions, the tensor has %d"
                       % (layout, len(names), ndim), what)
        items = [(n, i) for i, n in enumerate(names)]
    out: Dict[str, int] = {}
    singles = []
    for raw, index in items:
        canon = LAYOUT_NAMES.get(raw.lower())
        if canon is None:
            raise fail(Status.INVALID_ARGUMENT, "layout name %r is not one of %s" % (
                raw, ", ".join(sorted(set(LAYOUT_NAMES.values())))), what)
        if not 0 <= index < ndim:
            raise fail(Status.INVALID_ARGUMENT, "layout %r: dimension %d of a %d-dimensional "
                       "tensor" % (raw, index, ndim), what)
        if canon == "_":
            singles.append(index)
            continue
        if canon in out:
            raise fail(Status.INVALID_ARGUMENT, "layout names %r twice" % canon, what)
        out[canon] = index
    return out, singles


def _elem_bytes(itemsize: int, values: Sequence[int]) -> int:
    e = itemsize if itemsize in (1, 2, 4, 8, 16) else 1
    while e > 1 and any(v % e for v in values):
        e //= 2
    return e


class _Spec:
    """One layer view before regions are known: absolute addresses."""

    def __init__(self, what: str, name: Optional[str], ptr: int, fields: Dict[str, Any],
                 extent_of: Any, view: BufferView, num_blocks: int, block_size: int,
                 states: Optional[List[Tuple[int, int]]] = None) -> None:
        self.what = what
        self.name = name
        self.ptr = ptr                 # absolute address of block 0 (slot 0)
        self.fields = fields           # View fields other than region, offset, name
        self.extent_of = extent_of     # the tensor(s) to ask for an allocation
        self.view = view
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.states = states           # recurrent: absolute (ptr, bytes) per state
        self.region = -1
        self.offset = 0
        self.alias: Optional[Tuple[int, int]] = None
        self.span_bytes: Tuple[int, int] = (0, 0)  # [lo, hi) of the view, set once sizes are known

    def span(self, num_blocks: int) -> Tuple[int, int]:
        f = self.fields
        last = (num_blocks - 1) * f["block_stride"]
        if self.states is not None:
            lo = min(p for p, _ in self.states)
            return lo, lo + last + max(p + n - lo for p, n in self.states)
        hi = (self.ptr + last + (f["planes"] - 1) * f["plane_stride"]
              + (self.block_size - 1) * f["token_stride"] + (f["heads"] - 1) * f["head_stride"]
              + max(f["head_bytes"]))
        return self.ptr, hi


def _check_strides(view: BufferView, dims: Dict[str, int], singles: List[int], what: str) -> None:
    for name, i in dims.items():
        if view.strides[i] < 0 and view.shape[i] > 1:
            raise fail(Status.INVALID_ARGUMENT, "dimension %d (%s) has a negative stride" % (i, name),
                       what)
    for i in singles:
        if view.shape[i] != 1:
            raise fail(Status.INVALID_ARGUMENT, "dimension %d is named '_' but has size %d"
                       % (i, view.shape[i]), what)


def _attention_specs(obj: Any, name: Optional[str], layout: Any, what: str) -> List[_Spec]:
    view = as_buffer(obj, what)
    if not view.itemsize:
        raise fail(Status.INVALID_ARGUMENT, "needs a whole-byte element type (dtype "
                   "%s); view sub-byte types as uint8" % view.dtype, what)
    dims, singles = _parse_layout(layout, len(view.shape), what)
    for need in ("blocks", "tokens", "head_size"):
        if need not in dims:
            raise fail(Status.INVALID_ARGUMENT, "the layout names no %r dimension" % need, what)
    unknown = set(range(len(view.shape))) - set(dims.values()) - set(singles)
    if unknown:
        raise fail(Status.INVALID_ARGUMENT, "dimensions %s are not named" % sorted(unknown), what)
    _check_strides(view, dims, singles, what)
    shape, strides, e = view.shape, view.strides, view.itemsize

    def size(d: str) -> int:
        return shape[dims[d]] if d in dims else 1

    def stride(d: str) -> int:
        return strides[dims[d]] if d in dims and shape[dims[d]] > 1 else 0

    planes, heads, block_size = size("planes"), size("heads"), size("tokens")
    if planes not in (1, 2):
        raise fail(Status.INVALID_ARGUMENT, "the planes dimension has size %d (K and V: 1 or 2)"
                   % planes, what)
    if size("head_size") > 1 and strides[dims["head_size"]] != e:
        raise fail(Status.INVALID_ARGUMENT, "the head_size dimension is not contiguous (stride "
                   "%d bytes, element %d bytes): a head row must be one run" %
                   (strides[dims["head_size"]], e), what)
    fields = {
        "planes": planes, "heads": heads,
        "block_stride": strides[dims["blocks"]],
        "plane_stride": stride("planes"), "token_stride": stride("tokens"),
        "head_stride": stride("heads"),
        "head_bytes": (size("head_size") * e,) * planes,
        "itemsize": e,
    }
    layers = size("layers")
    specs = []
    for l in range(layers):
        lname = name if "layers" not in dims else ("%s[%d]" % (name, l) if name else None)
        lwhat = what if "layers" not in dims else "%s, layer %d" % (what, l)
        specs.append(_Spec(lwhat, lname, view.ptr + l * stride("layers"), dict(fields), obj, view,
                           size("blocks"), block_size))
    return specs


def _slot_dim(layout: Any, what: str) -> int:
    """The slot dimension of recurrent state tensors: 0 by default, an int,
    or where a layout (string, sequence or mapping) puts ``blocks``. The
    other names of a recurrent layout are free (states differ in rank)."""
    if layout is None:
        return 0
    if isinstance(layout, int) and not isinstance(layout, bool):
        return layout
    if isinstance(layout, Mapping):
        for k, v in layout.items():
            if LAYOUT_NAMES.get(str(k).lower()) == "blocks":
                return int(v)
    else:
        names = layout.split(",") if isinstance(layout, str) else list(layout)
        for i, n in enumerate(names):
            if LAYOUT_NAMES.get(str(n).strip().lower()) == "blocks":
                return i
    raise fail(Status.INVALID_ARGUMENT, "layout %r names no slot ('blocks') dimension" % (layout,),
               what)


def _recurrent_spec(obj: Any, name: Optional[str], layout: Any, what: str) -> _Spec:
    tensors = list(obj) if isinstance(obj, (list, tuple)) else [obj]
    if not tensors:
        raise fail(Status.INVALID_ARGUMENT, "a recurrent layer needs at least one state tensor",
                   what)
    states: List[Tuple[int, int]] = []
    views: List[BufferView] = []
    slot = num_blocks = e = 0
    for s, t in enumerate(tensors):
        swhat = "%s.states[%d]" % (what, s)
        view = as_buffer(t, swhat)
        if not view.shape or not view.itemsize:
            raise fail(Status.INVALID_ARGUMENT, "a state tensor needs a shape with a slot "
                       "dimension and a whole-byte element type", swhat)
        b = _slot_dim(layout, swhat)
        if not 0 <= b < len(view.shape):
            raise fail(Status.INVALID_ARGUMENT, "the slot dimension %d is not one of the tensor's %d"
                       % (b, len(view.shape)), swhat)
        rest = [i for i in range(len(view.shape)) if i != b]
        step = view.itemsize
        for i in reversed(rest):
            if view.shape[i] != 1 and view.strides[i] != step:
                raise fail(Status.INVALID_ARGUMENT, "the state is not contiguous within a slot "
                           "(dimension %d has stride %d, expected %d)" % (i, view.strides[i], step),
                           swhat)
            step *= view.shape[i]
        nbytes = step
        if s == 0:
            slot, num_blocks = view.strides[b], view.shape[b]
        elif view.strides[b] != slot or view.shape[b] != num_blocks:
            raise fail(Status.INVALID_ARGUMENT, "%d slots %d bytes apart, but state 0 has %d slots "
                       "%d bytes apart: a layer's states share one slot stride"
                       % (view.shape[b], view.strides[b], num_blocks, slot), swhat)
        if slot < 0:
            raise fail(Status.INVALID_ARGUMENT, "the slot dimension has a negative stride", swhat)
        states.append((view.ptr, nbytes))
        views.append(view)
        e = view.itemsize if s == 0 else min(e, view.itemsize)
    lo = min(p for p, _ in states)
    fields = {"block_stride": slot, "itemsize": e,
              "states": tuple((p - lo, n) for p, n in states)}
    return _Spec(what, name, lo, fields, tensors, views[0], num_blocks, 1, states=states)


# ---- regions ----------------------------------------------------------------------

def _extent(spec: _Spec, allocations: List[BufferView], span: Tuple[int, int]) -> Tuple[int, int]:
    lo, hi = span
    for a in allocations:
        alo, ahi = a.span
        if alo <= lo and hi <= ahi:
            return alo, ahi
    if allocations:
        raise fail(Status.INVALID_ARGUMENT, "bytes [0x%x, 0x%x) lie in none of the allocations given"
                   % (lo, hi), spec.what)
    sources = spec.extent_of if isinstance(spec.extent_of, list) else [spec.extent_of]
    for src in sources:
        ext = allocation_extent(src)
        if ext is not None and ext[0] <= lo and hi <= ext[0] + ext[1]:
            return ext[0], ext[0] + ext[1]
    return lo, hi


_MAX_FOOTPRINT_RUNS = 1 << 16


def _footprint(spec: _Spec) -> Optional[List[Tuple[int, int]]]:
    """The bytes one block (slot) of a view covers, as merged [lo, hi)
    intervals from the view's block 0; None when there are too many runs to
    list (the caller then compares spans)."""
    f = spec.fields
    if spec.states is not None:
        runs = [(p - spec.ptr, p - spec.ptr + n) for p, n in spec.states]
    else:
        if f["planes"] * spec.block_size * f["heads"] > _MAX_FOOTPRINT_RUNS:
            return None
        runs = [(p * f["plane_stride"] + t * f["token_stride"] + h * f["head_stride"],
                 p * f["plane_stride"] + t * f["token_stride"] + h * f["head_stride"]
                 + f["head_bytes"][p])
                for p in range(f["planes"]) for t in range(spec.block_size)
                for h in range(f["heads"])]
    runs.sort()
    merged: List[Tuple[int, int]] = []
    for lo, hi in runs:
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


def _overlaps(a: _Spec, a_blocks: int, b: _Spec, b_blocks: int) -> bool:
    """Whether two views share a byte: exactly, block footprint against
    block footprint, when they have one block stride (vLLM's shared and
    interleaved tensors); by their spans otherwise."""
    alo, ahi = a.span_bytes
    blo, bhi = b.span_bytes
    if not (alo < bhi and blo < ahi):
        return False
    stride = a.fields["block_stride"]
    fa, fb = _footprint(a), _footprint(b)
    if stride != b.fields["block_stride"] or fa is None or fb is None:
        return True
    delta = b.ptr - a.ptr  # b's block j starts at delta + j*stride from a's block 0
    ext_a, ext_b = fa[-1][1], fb[-1][1]
    if stride == 0:
        shifts = [delta]
    else:
        # Block pairs (i, j) whose footprints can meet: k = j - i with
        # -ext_b < delta + k*stride < ext_a.
        k_lo = max(-(a_blocks - 1), (-ext_b - delta) // stride + 1)
        k_hi = min(b_blocks - 1, -((delta - ext_a) // stride) - 1)
        shifts = [delta + k * stride for k in range(k_lo, k_hi + 1)]
    for shift in shifts:
        i = j = 0
        while i < len(fa) and j < len(fb):
            lo = max(fa[i][0], fb[j][0] + shift)
            hi = min(fa[i][1], fb[j][1] + shift)
            if lo < hi:
                return True
            if fa[i][1] <= fb[j][1] + shift:
                i += 1
            else:
                j += 1
    return False


def _align(base: int) -> int:
    a = 1
    while a < 256 and base % (a * 2) == 0:
        a *= 2
    return a


def from_tensors(groups: Sequence[TensorGroup], *, chunk_tokens: int = 256,
                 format: Union[ObjectFormat, str] = ObjectFormat.CANONICAL,
                 separate_windowed: bool = True, separate_recurrent: bool = False,
                 dcp: Tuple[int, int] = (1, 0), allocations: Optional[Sequence[Any]] = None,
                 alias_across_groups: bool = True, name: str = "",
                 description: str = "") -> Geometry:
    """Build and finalize a geometry from the engine's tensors.

    Args:
        groups: the KV-cache groups, in order (:class:`TensorGroup`).
        chunk_tokens, format, separate_windowed, separate_recurrent: the
            object policy (see :class:`kvferry.Policy`).
        dcp: (world, rank) of decode-context parallelism.
        allocations: buffers or ``(pointer, length)`` ranges that hold the
            tensors (the pools the engine allocated); each becomes a region.
            Default: what the tensors say, else the bytes they span.
        alias_across_groups: declare views that overlap a view of an earlier
            group as its aliases (vLLM's shared tensors).
        name, description: the geometry's.

    Returns a finalized :class:`kvferry.Geometry` whose ``bases`` hold each
    region's memory (and keep the tensors alive), so a
    :class:`kvferry.CopyRequest` needs no region bases. Raises KvferryError
    naming the group, layer and dimension for a tensor that does not fit,
    and the validation statuses of :meth:`kvferry.Geometry.finalize`.
    """
    if isinstance(groups, TensorGroup):
        groups = [groups]
    all_specs: List[List[_Spec]] = []
    for gi, group in enumerate(groups):
        if not isinstance(group, TensorGroup):
            raise fail(Status.INVALID_ARGUMENT, "expected a kvferry.TensorGroup, got %s"
                       % type(group).__name__, "groups[%d]" % gi)
        specs: List[_Spec] = []
        for li, (lname, obj) in enumerate(group.layers):
            what = "groups[%d].layers[%s]" % (gi, repr(lname) if lname is not None else li)
            if group.kind == GroupKind.RECURRENT:
                specs.append(_recurrent_spec(obj, lname, group.layout, what))
            else:
                specs.extend(_attention_specs(obj, lname, group.layout, what))
        if not specs:
            raise fail(Status.INVALID_ARGUMENT, "a group needs at least one layer",
                       "groups[%d].layers" % gi)
        all_specs.append(specs)

    # Group sizes: every layer of a group agrees.
    sizes = []
    for gi, (group, specs) in enumerate(zip(groups, all_specs)):
        nb = {s.num_blocks for s in specs}
        bs = {s.block_size for s in specs}
        if len(nb) > 1 or len(bs) > 1:
            raise fail(Status.INVALID_ARGUMENT, "layers disagree on num_blocks %s or block_size %s"
                       % (sorted(nb), sorted(bs)), "groups[%d]" % gi)
        num_blocks, block_size = nb.pop(), bs.pop()
        if group.num_blocks is not None:
            if not 0 < group.num_blocks <= num_blocks:
                raise fail(Status.INVALID_ARGUMENT, "%d, but the tensors hold %d blocks"
                           % (group.num_blocks, num_blocks), "groups[%d].num_blocks" % gi)
            num_blocks = group.num_blocks
        if group.block_size is not None and group.kind != GroupKind.RECURRENT \
                and group.block_size != block_size:
            raise fail(Status.INVALID_ARGUMENT, "%d, but the tensors' tokens dimension is %d"
                       % (group.block_size, block_size), "groups[%d].block_size" % gi)
        sizes.append((num_blocks, block_size))

    # Regions: merge the allocations (or spans) that overlap, numbered in
    # order of first use.
    alloc_views = [as_buffer(a, "allocations[%d]" % i) for i, a in enumerate(allocations or ())]
    intervals: List[Tuple[int, int, int]] = []  # (lo, hi, spec serial)
    flat: List[Tuple[int, _Spec]] = []
    for gi, specs in enumerate(all_specs):
        for s in specs:
            s.span_bytes = s.span(sizes[gi][0])
            lo, hi = _extent(s, alloc_views, s.span_bytes)
            intervals.append((lo, hi, len(flat)))
            flat.append((gi, s))
    merged: List[List[int]] = []  # [lo, hi] of each set of overlapping intervals
    owner = [0] * len(flat)
    for lo, hi, serial in sorted(intervals):
        if merged and lo < merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
        owner[serial] = len(merged) - 1
    numbering: Dict[int, int] = {}
    for serial in range(len(flat)):
        m = owner[serial]
        if m not in numbering:
            numbering[m] = len(numbering)
    regions: List[Dict[str, Any]] = [dict() for _ in numbering]
    for m, index in numbering.items():
        regions[index] = {"lo": merged[m][0], "hi": merged[m][1], "device": None, "keep": []}
    for serial, (gi, s) in enumerate(flat):
        r = numbering[owner[serial]]
        s.region = r
        s.offset = s.ptr - regions[r]["lo"]
        dev = (s.view.device, s.view.device_index)
        if regions[r]["device"] is None:
            regions[r]["device"] = dev
        elif regions[r]["device"] != dev:
            raise fail(Status.INVALID_ARGUMENT, "memory on %s, but region %d is on %s" % (
                s.view.where, r, "%s:%s" % regions[r]["device"]), s.what)
        regions[r]["keep"].append(s.extent_of)

    # Aliases across groups.
    if alias_across_groups:
        seen: List[Tuple[int, int, _Spec]] = []  # (group, layer, spec) of earlier groups
        for gi, specs in enumerate(all_specs):
            for s in specs:
                for g0, l0, t in seen:
                    if g0 < gi and t.region == s.region and \
                            _overlaps(t, sizes[g0][0], s, sizes[gi][0]):
                        s.alias = (g0, l0)
                        break
            seen.extend((gi, li, s) for li, s in enumerate(specs))

    geometry = Geometry(name, description)
    try:
        for region in regions:
            geometry.add_region(size=region["hi"] - region["lo"], align=_align(region["lo"]))
        for gi, (group, specs) in enumerate(zip(groups, all_specs)):
            num_blocks, block_size = sizes[gi]
            recurrent = group.kind == GroupKind.RECURRENT
            g = geometry.add_group(group.name, group.kind, 1 if recurrent else block_size,
                                   num_blocks, group.window, group.chunk)
            for s in specs:
                f = dict(s.fields)
                itemsize = f.pop("itemsize")
                if recurrent:
                    states = f.pop("states")
                    e = _elem_bytes(itemsize, [s.offset, f["block_stride"]]
                                    + [x for st in states for x in st])
                    view = View(region=s.region, elem_bytes=e, offset=s.offset,
                                states=tuple(State(o, n) for o, n in states), alias=s.alias,
                                name=s.name, **f)
                else:
                    e = _elem_bytes(itemsize, [s.offset, f["block_stride"], f["plane_stride"],
                                               f["token_stride"], f["head_stride"]]
                                    + list(f["head_bytes"]))
                    view = View(region=s.region, elem_bytes=e, offset=s.offset, alias=s.alias,
                                name=s.name, **f)
                geometry.add_view(g, view)
        geometry.set_policy(chunk_tokens=chunk_tokens, format=ObjectFormat.parse(format),
                            separate_windowed=separate_windowed,
                            separate_recurrent=separate_recurrent)
        if tuple(dcp) != (1, 0):
            geometry.set_dcp(*dcp)
        geometry.finalize()
    except KvferryError:
        geometry.close()
        raise
    geometry.bases = tuple(
        RawBuffer(x["lo"], x["hi"] - x["lo"], device=x["device"][0], device_index=x["device"][1],
                  owner=x["keep"]) for x in regions)
    return geometry
