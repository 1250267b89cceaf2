"""kvferry geometries from vLLM's own KV cache objects, and where each block's
object lives in the CPU pool.

vLLM 0.33 registers one tensor per layer, a strided view into the one int8
backing allocation of the whole KV cache (``vllm/v1/worker/utils.py``,
``allocate_kv_cache``): attention layers as ``[B, H, N, C]`` in the cache's
dtype, where C holds K then V of one (head, token) (``(head_size +
head_size_v)`` elements, ``AttentionSpec.state_content_size_bytes``), Mamba
layers as ``[B, 1, 1, C]`` int8 whose C bytes hold the layer's states back to
back (``MambaBase.bind_kv_cache``). B is ``num_blocks`` times the kernel
blocks per block when the attention backend splits blocks. Cache groups
overlay each other: the i-th layers of several groups view the same bytes.

A *unit* is one kvferry geometry (one kvf_xfer call per job): the offloaded
vLLM groups whose blocks hold the same number of (kvferry) tokens, with at
most one group that shares kvferry's object group 0 (full attention), since
vLLM keeps each group's chunks apart. Recurrent groups join the first unit.
One kvferry chunk is one vLLM block of the unit, so a job's logical block j
is the request's chunk j, and the object of (block j, group g) is one
sub-block of the CPU chunk that holds it.

Two sources:

- :func:`layout_from_registered` (the registered tensors and the KV cache
  config, handed over by ``KvferryOffloadingConnector``): K and V planes,
  heads and tokens, kinds and windows from the specs, Mamba states by the
  specs' shapes, padding stripped; objects in kvferry's canonical format.
- :func:`layout_from_canonical` (only vLLM's ``CanonicalKVCaches``, what the
  plain ``OffloadingConnector`` gives a spec): each layer's unpadded page as
  one row per block, one unit per group.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from .. import _lib
from .._errors import KvferryError, Status
from ..geometry import Geometry, GroupKind
from ..tensors import TensorGroup, from_tensors

#: Bytes between the objects of one CPU chunk are rounded up to this.
OBJECT_ALIGN = 16


def _round_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


@dataclass
class GroupPlan:
    """One offloaded vLLM group: where it is in its unit and in a CPU chunk."""

    index: int                  #: position among the offloaded groups (GPULoadStoreSpec order)
    group_id: int               #: the KVCacheConfig group id
    name: str
    kind: GroupKind
    unit: int = -1              #: the unit (geometry) holding it
    kv_group: int = -1          #: its group index in that geometry
    object_group: int = -1      #: its object group there
    ratio: int = 1              #: kvferry blocks per vLLM block (kernel block splitting)
    tokens: int = 1             #: kvferry tokens per vLLM block (attention; 0: recurrent)
    object_bytes: int = 0       #: bytes of the object of one block
    sub_stride: int = 0         #: bytes between sub-blocks in a CPU chunk
    layers: List[str] = field(default_factory=list)


@dataclass
class GroupInput:
    """One offloaded group, described without vLLM's classes: what
    :func:`build_layout` needs (and what :func:`layout_from_registered`
    derives from vLLM's specs and tensors)."""

    group_id: int
    kind: GroupKind
    layers: Dict[str, Any]       #: name -> attention view, or a recurrent layer's state views
    layout: Optional[str] = None  #: the attention views' dimension names
    window: int = 0
    chunk: int = 0
    ratio: int = 1               #: kvferry blocks per vLLM block
    tokens: int = 0              #: kvferry tokens per vLLM block (attention)


@dataclass
class Unit:
    """One kvferry geometry and the vLLM groups it moves."""

    geometry: Geometry
    chunk_tokens: int
    groups: List[int]           #: GroupPlan indices


@dataclass
class Layout:
    """Every unit, every offloaded group, and the CPU chunk they share."""

    units: List[Unit]
    groups: List[GroupPlan]
    blocks_per_chunk: int
    source: str                 #: "registered" or "canonical"
    slot_bytes: int = 0         #: bytes of one CPU chunk (all sub-blocks of the largest group)

    def finish(self) -> None:
        for g in self.groups:
            unit = self.units[g.unit]
            g.object_group = unit.geometry.group(g.kv_group).object_group
            g.object_bytes = unit.geometry.object_size(g.object_group, 0, unit.chunk_tokens)
            g.sub_stride = _round_up(g.object_bytes, OBJECT_ALIGN)
        self.slot_bytes = _round_up(
            max(g.sub_stride for g in self.groups) * self.blocks_per_chunk, OBJECT_ALIGN)

    def close(self) -> None:
        for u in self.units:
            u.geometry.close()

    def describe(self) -> str:
        parts = []
        for i, u in enumerate(self.units):
            names = ", ".join("%s(%s, %d layers, %d B/block)" % (
                self.groups[g].name, self.groups[g].kind.name.lower(), len(self.groups[g].layers),
                self.groups[g].object_bytes) for g in u.groups)
            parts.append("unit %d [%d tokens/block]: %s" % (i, u.chunk_tokens, names))
        return "; ".join(parts)


def _fail(message: str, field: str = "kv_caches") -> KvferryError:
    return _lib.fail(Status.INVALID_ARGUMENT, message, field)


def _layer_specs(kv_group: Any) -> Tuple[Any, Dict[str, Any]]:
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    spec = kv_group.kv_cache_spec
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return spec, dict(spec.kv_cache_specs)
    return spec, {}


def _kind_of(spec: Any) -> Tuple[GroupKind, int, int]:
    """(kind, window, chunk) of a vLLM layer spec."""
    from vllm.v1.kv_cache_interface import (AttentionSpec, ChunkedLocalAttentionSpec, MambaSpec,
                                            SlidingWindowSpec)

    if isinstance(spec, MambaSpec):
        return GroupKind.RECURRENT, 0, 0
    if isinstance(spec, SlidingWindowSpec):
        return GroupKind.SLIDING_WINDOW, int(spec.sliding_window), 0
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return GroupKind.CHUNKED_LOCAL, 0, int(spec.attention_chunk_size)
    if isinstance(spec, AttentionSpec):
        # FullAttentionSpec (MLA, sinks, and sliding-window layers when the
        # hybrid allocator is off: every block is kept), and attention specs
        # kvferry has no kind for, which keep every block as well.
        return GroupKind.FULL, 0, 0
    raise _fail("layer spec %s is neither attention nor Mamba: kvferry does not know its "
                "layout" % type(spec).__name__)


def _attention_view(tensor: Any, spec: Any, what: str) -> Tuple[Any, str]:
    """The layer's ``[B, H, N, C]`` view as bytes, with C split into K and V
    planes when it is exactly K then V of equal sizes."""
    if tensor.dim() != 4:
        raise _fail("%s: a %d-dimensional tensor, vLLM 0.33 registers attention caches as "
                    "[blocks, heads, tokens, content]" % (what, tensor.dim()))
    if tensor.stride(-1) != 1:
        raise _fail("%s: the content dimension is not contiguous (stride %d)"
                    % (what, tensor.stride(-1)))
    elem = tensor.element_size()
    raw = tensor.view(_torch().uint8)            # [B, H, N, C bytes]
    content = raw.shape[-1]
    head = int(spec.head_size) * elem
    dense = (getattr(spec, "state_content_bytes", None) is None
             and int(spec.head_size_v) == int(spec.head_size) and head > 0
             and content == 2 * head)
    if dense:
        return raw.unflatten(-1, (2, head)), "blocks,heads,tokens,planes,head_size"
    # MLA latent rows, packed or quantised contents, K and V of different
    # sizes: the content is one row per (head, token).
    return raw, "blocks,heads,tokens,head_size"


def _mamba_states(tensor: Any, spec: Any, what: str) -> List[Any]:
    """The layer's states as ``[slots, bytes]`` views: the ``[B, 1, 1, C]``
    page view cut where ``MambaBase.bind_kv_cache`` cuts it (the spec's
    shapes and dtypes, back to back)."""
    torch = _torch()
    if tensor.dim() != 4 or tensor.shape[1] != 1 or tensor.shape[2] != 1:
        raise _fail("%s: expected vLLM 0.33's [blocks, 1, 1, bytes] Mamba page view, got shape %s"
                    % (what, tuple(tensor.shape)))
    pages = tensor.view(torch.uint8)[:, 0, 0, :]
    states = []
    offset = 0
    for shape, dtype in zip(spec.shapes, spec.dtypes):
        n = prod(shape) * torch.empty((), dtype=dtype).element_size()
        states.append(pages[:, offset:offset + n])
        offset += n
    if offset != pages.shape[1] or not states:
        raise _fail("%s: the spec's states hold %d bytes, the page view %d" %
                    (what, offset, pages.shape[1]))
    return states


def _torch() -> Any:
    import torch

    return torch


def _assign_units(groups: List[GroupPlan], build: Any, chunk_of: Mapping[int, int]) -> List[Unit]:
    """Put the groups into units: same tokens per block, at most one group in
    object group 0 (full attention) per unit; recurrent groups join the
    first unit. ``build(plan indices, chunk_tokens)`` makes the geometry."""
    buckets: List[Tuple[int, List[int], bool]] = []   # (chunk tokens, plans, has full)
    recurrent: List[int] = []
    for g in groups:
        if g.kind == GroupKind.RECURRENT:
            recurrent.append(g.index)
            continue
        tokens = chunk_of[g.index]
        full = g.kind == GroupKind.FULL
        for i, (t, members, has_full) in enumerate(buckets):
            if t == tokens and not (full and has_full):
                members.append(g.index)
                buckets[i] = (t, members, has_full or full)
                break
        else:
            buckets.append((tokens, [g.index], full))
    if not buckets:
        buckets.append((1, [], False))
    buckets[0][1].extend(recurrent)
    units = []
    try:
        for u, (tokens, members, _) in enumerate(buckets):
            members.sort()
            for k, gi in enumerate(members):
                groups[gi].unit = u
                groups[gi].kv_group = k
            units.append(Unit(build(members, tokens), tokens, members))
    except BaseException:
        for unit in units:
            unit.geometry.close()
        raise
    return units


def build_layout(inputs: Sequence[GroupInput], blocks_per_chunk: int,
                 source: str = "registered", chunk_blocks: int = 1) -> Layout:
    """The units, geometries and object placement of the offloaded groups,
    in the order of a job's ``group_sizes``.

    ``chunk_blocks``: vLLM blocks per kvferry chunk (the geometry's
    ``chunk_tokens`` is that many blocks' tokens). The in-process spec keeps
    1, one object per block; the served connector (kvferry.vllm.connector)
    makes chunks of several blocks, the unit kvferryd stores and names."""
    plans: List[GroupPlan] = []
    for index, gin in enumerate(inputs):
        if not gin.layers:
            raise _fail("group %d has no layers" % gin.group_id)
        recurrent = gin.kind == GroupKind.RECURRENT
        plans.append(GroupPlan(index, gin.group_id, "g%d" % gin.group_id, gin.kind,
                               ratio=1 if recurrent else gin.ratio,
                               tokens=0 if recurrent else gin.tokens, layers=list(gin.layers)))
    chunk_of = {p.index: p.tokens for p in plans}

    def build(members: List[int], chunk_tokens: int) -> Geometry:
        tgs = []
        for gi in members:
            gin, p = inputs[gi], plans[gi]
            tgs.append(TensorGroup(gin.layers, gin.layout, kind=p.kind, name=p.name,
                                   window=gin.window if p.kind == GroupKind.SLIDING_WINDOW else 0,
                                   chunk=gin.chunk if p.kind == GroupKind.CHUNKED_LOCAL else 0))
        return from_tensors(tgs, chunk_tokens=chunk_tokens * chunk_blocks, separate_windowed=True,
                            separate_recurrent=True,
                            name="vllm-%s" % "-".join(plans[g].name for g in members),
                            description="vLLM KV cache groups %s (kvferry.vllm, %s)"
                            % ([plans[g].group_id for g in members], source))

    layout = Layout(_assign_units(plans, build, chunk_of), plans, blocks_per_chunk, source)
    layout.finish()
    return layout


def layout_from_registered(kv_caches: Mapping[str, Any], kv_cache_config: Any,
                           offload_groups: Sequence[Any], blocks_per_chunk: int,
                           chunk_blocks: int = 1) -> Layout:
    """The layout from the tensors vLLM registered (``register_kv_caches``)
    and the KV cache config.

    Args:
        kv_caches: layer name -> the registered tensor.
        kv_cache_config: vLLM's ``KVCacheConfig``.
        offload_groups: the offloaded groups, ``OffloadingConfig.groups``
            (their order is the order of a job's ``group_sizes``).
        blocks_per_chunk: vLLM blocks per CPU chunk.
        chunk_blocks: vLLM blocks per kvferry chunk (build_layout).
    """
    from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec

    num_blocks = int(kv_cache_config.num_blocks)
    inputs: List[GroupInput] = []
    for og in offload_groups:
        group_id = int(og.group_id)
        kv_group = kv_cache_config.kv_cache_groups[group_id]
        group_spec, per_layer = _layer_specs(kv_group)
        names = list(og.layer_names) or list(kv_group.layer_names)
        gin = GroupInput(group_id, GroupKind.FULL, {})
        seen: Dict[Tuple[int, Tuple[int, ...], Tuple[int, ...]], str] = {}
        kinds = set()
        for name in names:
            what = "group %d layer %r" % (group_id, name)
            if name not in kv_caches:
                raise _fail("%s: no registered tensor" % what)
            spec = per_layer.get(name, group_spec)
            tensor = kv_caches[name]
            key = (tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()))
            if key in seen:
                # A layer that reads another layer's cache (KV sharing): the
                # bytes move once, with the layer that owns them.
                continue
            seen[key] = name
            kind, gin.window, gin.chunk = _kind_of(spec)
            kinds.add(kind)
            if isinstance(spec, MambaSpec):
                gin.layers[name] = _mamba_states(tensor, spec, what)
                continue
            assert isinstance(spec, AttentionSpec)
            if tensor.shape[0] % num_blocks:
                raise _fail("%s: %d blocks, not a multiple of the config's %d"
                            % (what, tensor.shape[0], num_blocks))
            ratio = tensor.shape[0] // num_blocks
            view, gin.layout = _attention_view(tensor, spec, what)
            tokens = view.shape[2] * ratio
            if gin.tokens and (ratio != gin.ratio or tokens != gin.tokens):
                raise _fail("%s: %d kernel blocks of %d tokens per block, the group's first layer "
                            "has %d of %d" % (what, ratio, view.shape[2], gin.ratio,
                                              gin.tokens // gin.ratio))
            gin.ratio, gin.tokens = ratio, tokens
            gin.layers[name] = view
        if len(kinds) != 1:
            raise _fail("group %d mixes layer kinds %s" % (group_id, sorted(k.name for k in kinds)))
        gin.kind = kinds.pop()
        inputs.append(gin)
    return build_layout(inputs, blocks_per_chunk, "registered", chunk_blocks)


def layout_from_canonical(kv_caches: Any, offload_groups: Sequence[Any],
                          blocks_per_chunk: int) -> Layout:
    """The layout from vLLM's ``CanonicalKVCaches`` alone: each layer's
    unpadded page (``CanonicalKVCacheRef.page_size_bytes``) as one row per
    block, every group in a geometry of its own (all of them full-attention
    groups as far as kvferry can tell, which share object group 0)."""
    inputs = []
    for index, refs in enumerate(kv_caches.group_data_refs):
        og = offload_groups[index]
        rows = {}
        for ref in refs:
            tensor = kv_caches.tensors[ref.tensor_idx].tensor
            if tensor.dim() != 2 or tensor.stride(1) != 1:
                raise _fail("canonical tensor %d: expected [blocks, page bytes], shape %s "
                            "strides %s" % (ref.tensor_idx, tuple(tensor.shape),
                                            tuple(tensor.stride())), "group_data_refs")
            rows["t%d" % ref.tensor_idx] = \
                tensor.view(_torch().uint8)[:, :ref.page_size_bytes].unsqueeze(1)
        inputs.append(GroupInput(int(og.group_id), GroupKind.FULL, rows,
                                 "blocks,tokens,head_size", ratio=1, tokens=1))
    return build_layout(inputs, blocks_per_chunk, "canonical")
