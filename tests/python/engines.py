"""Engine models: each preset's KV cache built the way the engine builds its
tensors, with numpy.

For every preset in geometry/presets/, ``build(name)`` allocates one numpy
buffer per allocation the engine makes and views it as the engine does: the
logical shape with the strides of the backend's physical order (a reshape to
the physical shape, then a transpose to the logical one, like vLLM's
``view(physical).permute(...)``), or a strided view into a raw int8 page
buffer (vLLM's hybrid models). Shapes and orders follow tools/gen_presets.py;
no stride is computed from the preset files.

A model also keeps, per layer, the tensor re-arranged as (P, NB, BS, H, R)
with numpy (``canon``), so tests can index rows in the canonical order
without the geometry's formulas.
"""

import mmap
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Tuple

import numpy as np
from numpy.lib.stride_tricks import as_strided

import kvferry

BF16 = np.uint16  # numpy has no bfloat16: a 2-byte element is what matters
FP8 = np.uint8


@dataclass
class GroupModel:
    name: str
    kind: str
    layout: Optional[str]
    layers: List[Any]                 # what TensorGroup gets: tensors, or lists of state tensors
    names: List[str]
    window: int = 0
    canon: List[np.ndarray] = field(default_factory=list)  # attention: (P, NB, BS, H, R) per layer
    states: List[List[np.ndarray]] = field(default_factory=list)  # recurrent: (NB, ...) per state

    @property
    def recurrent(self) -> bool:
        return self.kind == "recurrent"

    def tensor_group(self) -> kvferry.TensorGroup:
        layers = dict(zip(self.names, self.layers)) if self.names else self.layers
        return kvferry.TensorGroup(layers, self.layout, kind=self.kind, name=self.name,
                                   window=self.window)


@dataclass
class Model:
    preset: str
    num_blocks: int
    chunk_tokens: int
    buffers: List[np.ndarray]         # one uint8 buffer per engine allocation
    groups: List[GroupModel]
    separate_recurrent: bool = False
    dcp: Tuple[int, int] = (1, 0)

    def geometry(self, **kwargs: Any) -> kvferry.Geometry:
        return kvferry.from_tensors([g.tensor_group() for g in self.groups],
                                    chunk_tokens=self.chunk_tokens,
                                    separate_recurrent=self.separate_recurrent, dcp=self.dcp,
                                    name=self.preset, **kwargs)


def _raw(nbytes: int) -> np.ndarray:
    """A zeroed, page-aligned allocation of exactly nbytes (as cudaMalloc
    gives: the file's regions have the default 256-byte alignment)."""
    return np.frombuffer(mmap.mmap(-1, nbytes), np.uint8)


def _permuted(buf: np.ndarray, dtype: Any, physical: List[str], logical: List[str],
              dims: dict) -> np.ndarray:
    """buf viewed as `physical` (outermost first), then transposed to `logical`."""
    x = buf.view(dtype).reshape([dims[d] for d in physical])
    return x.transpose([physical.index(d) for d in logical])


def _canon(t: np.ndarray, logical: List[str], layer: Optional[int] = None) -> np.ndarray:
    """A logical tensor as (P, NB, BS, H, R), with numpy only."""
    if layer is not None:
        t = t[(slice(None),) * logical.index("L") + (layer,)]  # a view, not a copy
        logical = [d for d in logical if d != "L"]
    for d in ("P", "H"):
        if d not in logical:
            t = t[..., np.newaxis]
            logical = logical + [d]
    return t.transpose([logical.index(d) for d in ("P", "NB", "T", "H", "R")])


FA = ["P", "NB", "T", "H", "R"]   # FlashAttention logical (2, NB, BS, H, D)
FI = ["NB", "P", "T", "H", "R"]   # FlashInfer logical (NB, 2, BS, H, D)


def llama8b(preset: str, physical: List[str], logical: List[str]) -> Model:
    L, H, D, BS, NB = 32, 8, 128, 16, 8
    dims = {"P": 2, "NB": NB, "T": BS, "H": H, "R": D}
    buffers = [_raw(2 * NB * BS * H * D * 2) for _ in range(L)]
    tensors = [_permuted(b, BF16, physical, logical, dims) for b in buffers]
    layout = kvferry.VLLM_FLASH_ATTN if logical == FA else kvferry.VLLM_FLASHINFER
    g = GroupModel("full", "full", layout, tensors, ["layer[%d]" % l for l in range(L)],
                   canon=[_canon(t, logical) for t in tensors])
    return Model(preset, NB, 256, buffers, [g])


def llama8b_crosslayer(preset: str, physical: List[str]) -> Model:
    L, H, D, BS, NB = 32, 8, 128, 16, 8
    logical = ["NB", "L", "P", "T", "H", "R"]
    dims = {"NB": NB, "L": L, "P": 2, "T": BS, "H": H, "R": D}
    buf = _raw(NB * L * 2 * BS * H * D * 2)
    t = _permuted(buf, BF16, physical, logical, dims)
    g = GroupModel("full", "full", kvferry.VLLM_CROSS_LAYER, [t], ["layer"],
                   canon=[_canon(t, logical, l) for l in range(L)])
    return Model(preset, NB, 256, [buf], [g])


def deepseek_mla(preset: str, row: int, dtype: Any, dcp: Tuple[int, int] = (1, 0)) -> Model:
    L, BS, NB = 61, 64, 8
    itemsize = np.dtype(dtype).itemsize
    buffers = [_raw(NB * BS * row * itemsize) for _ in range(L)]
    tensors = [b.view(dtype).reshape(NB, BS, row) for b in buffers]
    g = GroupModel("full", "full", kvferry.VLLM_MLA, tensors, ["layer[%d]" % l for l in range(L)],
                   canon=[_canon(t, ["NB", "T", "R"]) for t in tensors])
    return Model(preset, NB, 256, buffers, [g], dcp=dcp)


def llama8b_fp8_inline() -> Model:
    L, H, R, BS, NB = 32, 8, 128 + 4, 16, 8
    dims = {"P": 2, "NB": NB, "T": BS, "H": H, "R": R}
    buffers = [_raw(2 * NB * BS * H * R) for _ in range(L)]
    tensors = [_permuted(b, FP8, FA, FA, dims) for b in buffers]
    g = GroupModel("full", "full", kvferry.VLLM_FLASH_ATTN, tensors,
                   ["layer[%d]" % l for l in range(L)], canon=[_canon(t, FA) for t in tensors])
    return Model("llama-3.1-8b-fp8-inline-scales", NB, 256, buffers, [g])


def llama70b_slice() -> Model:
    L, H, D, BS, NB, first, heads = 80, 8, 128, 16, 8, 4, 2
    dims = {"NB": NB, "P": 2, "T": BS, "H": H, "R": D}
    buffers = [_raw(NB * 2 * BS * H * D * 2) for _ in range(L)]
    full = [_permuted(b, BF16, FI, FI, dims) for b in buffers]
    tensors = [t[:, :, :, first:first + heads, :] for t in full]  # this rank's heads
    g = GroupModel("full", "full", kvferry.VLLM_FLASHINFER, tensors,
                   ["layer[%d]" % l for l in range(L)], canon=[_canon(t, FI) for t in tensors])
    return Model("llama-3.1-70b-tp4-rank2-slice", NB, 256, buffers, [g])


def gpt_oss() -> Model:
    L, H, D, BS, NB = 12, 8, 64, 16, 8
    dims = {"P": 2, "NB": NB, "T": BS, "H": H, "R": D}
    buffers = [_raw(2 * NB * BS * H * D * 2) for _ in range(L)]
    tensors = [_permuted(b, BF16, FA, FA, dims) for b in buffers]
    names = ["layer[%d]" % l for l in range(L)]
    canon = [_canon(t, FA) for t in tensors]
    # vLLM shares layer i's tensor between the full and the sliding-window group.
    full = GroupModel("full", "full", kvferry.VLLM_FLASH_ATTN, tensors, names, canon=canon)
    swa = GroupModel("sliding", "sliding_window", kvferry.VLLM_FLASH_ATTN, tensors, names,
                     window=128, canon=canon)
    return Model("gpt-oss-20b-like", NB, 256, buffers, [full, swa])


def _hybrid_page(buf: np.ndarray, page: int, NB: int, BS: int, H: int, D: int, logical: List[str]):
    """Attention of a hybrid model: K and V of a block adjacent inside a
    page of `page` bytes, as a strided bf16 view of the raw page buffer."""
    e = 2
    strides = {"NB": page, "P": BS * H * D * e, "T": H * D * e, "H": D * e, "R": e}
    sizes = {"NB": NB, "P": 2, "T": BS, "H": H, "R": D}
    return as_strided(buf.view(BF16), [sizes[d] for d in logical], [strides[d] for d in logical])


def _states(buf: np.ndarray, page: int, NB: int, shapes: List[Tuple[int, ...]]) -> List[np.ndarray]:
    """A recurrent layer's state tensors, back to back from each slot's start."""
    out, pos = [], 0
    for shape in shapes:
        nbytes = int(np.prod(shape)) * 2
        inner = [2]
        for n in reversed(shape[1:]):
            inner.insert(0, inner[0] * n)
        out.append(as_strided(buf[pos:].view(BF16), (NB,) + tuple(shape), (page,) + tuple(inner)))
        pos += nbytes
    return out


def qwen3_next() -> Model:
    L, BS, H, D, NB, page = 12, 272, 1, 256, 12, 278528
    buffers = [_raw(NB * page) for _ in range(L)]
    names = ["layer[%d]" % l for l in range(L)]
    attn = [_hybrid_page(b, page, NB, BS, H, D, FA) for b in buffers]
    groups = [GroupModel("full", "full", kvferry.VLLM_FLASH_ATTN, attn, names,
                         canon=[_canon(t, FA) for t in attn])]
    for j in range(3):
        layers = [_states(b, page, NB, [(3, 2048), (8, 128, 128)]) for b in buffers]
        groups.append(GroupModel("linear%d" % j, "recurrent", None, layers, names,
                                 states=layers))
    return Model("qwen3-next-like-hybrid", NB, 544, buffers, groups, separate_recurrent=False)


def glm_like() -> Model:
    L, BS, H, D, NB, page = 8, 16, 4, 128, 16, 40960
    buffers = [_raw(NB * page) for _ in range(L)]
    names = ["layer[%d]" % l for l in range(L)]
    attn = [_hybrid_page(b, page, NB, BS, H, D, FI) for b in buffers]
    canon = [_canon(t, FI) for t in attn]
    rec = [_states(b, page, NB, [(3, 1024), (4, 64, 64)]) for b in buffers]
    return Model("glm-like-hybrid", NB, 256, buffers, [
        GroupModel("full", "full", kvferry.VLLM_FLASHINFER, attn, names, canon=canon),
        GroupModel("sliding", "sliding_window", kvferry.VLLM_FLASHINFER, attn, names, window=512,
                   canon=canon),
        GroupModel("recurrent", "recurrent", "blocks", rec, names, states=rec),
    ], separate_recurrent=True)


BUILDERS: dict = {
    "llama-3.1-8b-fa-nhd": lambda: llama8b("llama-3.1-8b-fa-nhd", FA, FA),
    "llama-3.1-8b-fa-hnd": lambda: llama8b("llama-3.1-8b-fa-hnd", ["P", "NB", "H", "T", "R"], FA),
    "llama-3.1-8b-flashinfer-nhd": lambda: llama8b("llama-3.1-8b-flashinfer-nhd", FI, FI),
    "llama-3.1-8b-flashinfer-hnd": lambda: llama8b("llama-3.1-8b-flashinfer-hnd",
                                                   ["NB", "P", "H", "T", "R"], FI),
    "llama-3.1-8b-crosslayer-fa-nhd": lambda: llama8b_crosslayer(
        "llama-3.1-8b-crosslayer-fa-nhd", ["NB", "L", "P", "T", "H", "R"]),
    "llama-3.1-8b-crosslayer-fa-hnd": lambda: llama8b_crosslayer(
        "llama-3.1-8b-crosslayer-fa-hnd", ["NB", "H", "L", "P", "T", "R"]),
    "deepseek-v3-mla-bf16": lambda: deepseek_mla("deepseek-v3-mla-bf16", 576, BF16),
    "deepseek-v3-mla-fp8-656": lambda: deepseek_mla("deepseek-v3-mla-fp8-656", 656, FP8),
    "deepseek-v3-mla-dcp4-rank1": lambda: deepseek_mla("deepseek-v3-mla-dcp4-rank1", 576, BF16,
                                                       dcp=(4, 1)),
    "llama-3.1-8b-fp8-inline-scales": llama8b_fp8_inline,
    "gpt-oss-20b-like": gpt_oss,
    "qwen3-next-like-hybrid": qwen3_next,
    "glm-like-hybrid": glm_like,
    "llama-3.1-70b-tp4-rank2-slice": llama70b_slice,
}


def build(preset: str) -> Model:
    return BUILDERS[preset]()


# ---- what a gather must produce, from numpy indexing alone ----------------------

POISON = 0xC3


class Request:
    """Block tables and the chunks of one request, and the objects a gather
    of it must produce, computed from the model's tensors with numpy."""

    def __init__(self, model: Model, geometry: kvferry.Geometry, seed: int) -> None:
        self.model = model
        C = model.chunk_tokens
        world, rank = model.dcp
        has_recurrent = any(g.recurrent for g in model.groups)
        # One full chunk after the first, then (attention-only models) a partial one.
        self.token_begin = C
        self.token_end = 3 * C if has_recurrent else 2 * C + C // 2 + 3
        rng = np.random.default_rng(seed)
        pool = rng.permutation(model.num_blocks).tolist()
        G = len(model.groups)
        owned: List[List[int]] = [[] for _ in range(G)]
        for i, b in enumerate(pool):  # disjoint ids: aliasing groups share tensors
            owned[i % G].append(b)
        self.tables: List[Tuple[int, List[Optional[int]]]] = []
        for gi, g in enumerate(model.groups):
            ids: List[Optional[int]] = list(owned[gi])
            if g.recurrent:
                first = self.token_begin // C  # local block k: the state at the end of chunk k
                self.tables.append((first, ids))
                continue
            bs = g.canon[0].shape[2]
            boundary = (self.token_begin + C) // world // bs  # first local block of chunk 1
            first = max(0, boundary - len(ids) // 2)
            if len(ids) >= 3:
                ids[boundary + 1 - first] = None  # a skipped block
            self.tables.append((first, ids))
        self.geometry = geometry

    def block_of(self, gi: int, local_block: int) -> Optional[int]:
        first, ids = self.tables[gi]
        i = local_block - first
        return ids[i] if 0 <= i < len(ids) else None

    def chunks(self) -> List[Tuple[int, List[int]]]:
        """(global chunk index, this rank's local tokens of it) per chunk."""
        C = self.model.chunk_tokens
        world, rank = self.model.dcp
        out = []
        for cb in range(self.token_begin, self.token_end, C):
            ce = min(cb + C, self.token_end)
            out.append((cb // C, [t // world for t in range(cb, ce) if t % world == rank]))
        return out

    def expected(self, num_object_groups: int, og_of: List[int]) -> List[Optional[np.ndarray]]:
        """The objects a gather writes, poison where no moved block covers."""
        C = self.model.chunk_tokens
        out: List[Optional[np.ndarray]] = []
        for chunk, locals_ in self.chunks():
            full = (chunk + 1) * C <= self.token_end
            for og in range(num_object_groups):
                parts: List[np.ndarray] = []
                members = [gi for gi, g in enumerate(self.model.groups) if og_of[gi] == og]
                planes = max((self.model.groups[gi].canon[0].shape[0] for gi in members
                              if not self.model.groups[gi].recurrent), default=0)
                for p in range(planes):
                    for gi in members:
                        g = self.model.groups[gi]
                        if g.recurrent:
                            continue
                        for a in g.canon:
                            if p >= a.shape[0]:
                                continue
                            n, row = len(locals_), a.shape[3] * a.shape[4] * a.itemsize
                            seg = np.full((n, row), POISON, np.uint8)
                            bs = a.shape[2]
                            for i, j in enumerate(locals_):
                                b = self.block_of(gi, j // bs)
                                if b is not None:
                                    seg[i] = np.ascontiguousarray(a[p, b, j % bs]).view(np.uint8).ravel()
                            parts.append(seg.ravel())
                for gi in members:
                    g = self.model.groups[gi]
                    if not g.recurrent or not full:
                        continue
                    slot = self.block_of(gi, chunk)
                    for layer in g.states:
                        for s in layer:
                            if slot is None:
                                parts.append(np.full(s[0].nbytes, POISON, np.uint8))
                            else:
                                parts.append(np.ascontiguousarray(s[slot]).view(np.uint8).ravel())
                out.append(np.concatenate(parts) if parts else np.zeros(0, np.uint8))
        return out

    def blocks(self) -> List[kvferry.BlockTable]:
        return [kvferry.BlockTable(ids, first) for first, ids in self.tables]

    def copy_moved_rows(self, src: Model, dst: Model) -> None:
        """Write into dst's tensors every row and state the request moves,
        from src's: what a scatter of the gathered objects must do."""
        C = self.model.chunk_tokens
        for chunk, locals_ in self.chunks():
            for gi, (gs, gd) in enumerate(zip(src.groups, dst.groups)):
                if gs.recurrent:
                    slot = self.block_of(gi, chunk)
                    if (chunk + 1) * C <= self.token_end and slot is not None:
                        for ls, ld in zip(gs.states, gd.states):
                            for s, d in zip(ls, ld):
                                d[slot] = s[slot]
                    continue
                for a, d in zip(gs.canon, gd.canon):
                    bs = a.shape[2]
                    for j in locals_:
                        b = self.block_of(gi, j // bs)
                        if b is not None:
                            d[:, b, j % bs] = a[:, b, j % bs]


def fill(model: Model, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for buf in model.buffers:
        buf[:] = rng.integers(0, 256, buf.size, dtype=np.uint8)


def poison(model: Model, value: int) -> None:
    for buf in model.buffers:
        buf[:] = value


Builder = Callable[[], Model]
