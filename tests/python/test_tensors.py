"""kvferry.from_tensors: geometries from the engine's tensors.

For every preset, the engine's tensors are built with numpy as the engine
builds them (tests/python/engines.py); the geometry from those tensors must
equal the preset file's (same views, groups and fingerprints), and a gather
through it must produce, byte for byte, what numpy indexing of the tensors
gives in the canonical [P][L][T][H][bytes] order; a scatter must write back
exactly the moved rows.
"""

import gc

import numpy as np
import pytest

from conftest import PRESET_DIR

import engines
import kvferry
from kvferry import KvferryError, Status

PRESETS = sorted(p.stem for p in PRESET_DIR.glob("*.json"))


def test_every_preset_has_an_engine_model():
    missing = [p for p in PRESETS if p not in engines.BUILDERS]
    assert not missing, "add an engine model to tests/python/engines.py for %s" % missing


def _group_fields(g):
    return (g.name, g.kind, g.block_size, g.num_blocks, g.window, g.chunk, g.num_layers,
            g.object_group, g.payload_per_block, g.max_block_stride)


@pytest.mark.parametrize("preset", PRESETS)
def test_geometry_from_tensors_equals_preset(preset):
    model = engines.build(preset)
    with model.geometry() as g, kvferry.Geometry.preset(preset, model.num_blocks) as p:
        for fmt in kvferry.ObjectFormat:
            assert g.fingerprint(fmt) == p.fingerprint(fmt), fmt
        assert g.policy == p.policy
        assert g.dcp == p.dcp
        assert g.num_aliases == p.num_aliases
        assert [_group_fields(x) for x in g.groups] == [_group_fields(x) for x in p.groups]
        assert g.object_groups == p.object_groups
        for gi in range(p.num_groups):
            assert g.views(gi) == p.views(gi), "group %d" % gi
        assert g.num_regions == p.num_regions
        for mine, theirs, buf in zip(g.regions, p.regions, model.buffers):
            # Regions are the engine's allocations; the file's are the
            # smallest size holding the views (smaller for a head slice).
            assert mine.size == buf.nbytes
            assert theirs.size <= mine.size
        assert [b.ptr for b in g.bases] == [b.ctypes.data for b in model.buffers]


def _first_difference(got, want):
    diff = np.flatnonzero(got != want)
    return "first difference at byte %d of %d (%d bytes differ)" % (diff[0], got.size, diff.size)


@pytest.mark.parametrize("preset", PRESETS)
def test_gather_and_scatter_match_numpy_indexing(preset):
    model = engines.build(preset)
    engines.fill(model, seed=len(preset))
    g = model.geometry()
    req = engines.Request(model, g, seed=7)
    og_of = [x.object_group for x in g.groups]
    expected = req.expected(g.num_object_groups, og_of)
    num_og = g.num_object_groups
    C = model.chunk_tokens
    for i, e in enumerate(expected):
        assert e.size == g.object_size(i % num_og, req.token_begin // C + i // num_og, req.token_end)

    def gather(geometry, run, **kwargs):
        objects = [np.full(e.size, engines.POISON, np.uint8) for e in expected]
        request = kvferry.CopyRequest(geometry, req.token_begin, req.token_end,
                                      blocks=req.blocks(), objects=objects, **kwargs)
        request.check()
        run(request)
        for i, (got, want) in enumerate(zip(objects, expected)):
            assert np.array_equal(got, want), "object %d: %s" % (i, _first_difference(got, want))
        return objects

    objects = gather(g, kvferry.reference_gather)
    with kvferry.Transfer(g) as xfer:
        gather(g, xfer.gather)
        assert xfer.last_stats().route == kvferry.Route.HOST
    # The preset file's geometry over the same buffers makes the same objects.
    with kvferry.Geometry.preset(preset, model.num_blocks) as p:
        gather(p, kvferry.reference_gather, region_bases=model.buffers)

    # Scatter into a poisoned cache: exactly the moved rows come back.
    dst, want = engines.build(preset), engines.build(preset)
    engines.poison(dst, 0x5A)
    engines.poison(want, 0x5A)
    req.copy_moved_rows(model, want)
    g2 = dst.geometry()
    with kvferry.Transfer(g2, host_threads=2) as xfer:
        xfer.scatter(kvferry.CopyRequest(g2, req.token_begin, req.token_end, blocks=req.blocks(),
                                         objects=objects))
    for r, (got, w) in enumerate(zip(dst.buffers, want.buffers)):
        assert np.array_equal(got, w), "region %d: %s" % (r, _first_difference(got, w))
    g.close()
    g2.close()


# ---- layouts, regions and aliases -------------------------------------------------

def _fa(nb=4, bs=16, h=2, d=8, dtype=np.uint16):
    return np.zeros((2, nb, bs, h, d), dtype)


def test_layout_forms_agree():
    t = _fa()
    forms = [kvferry.VLLM_FLASH_ATTN, ["P", "NB", "T", "H", "D"],
             {"planes": 0, "blocks": 1, "tokens": 2, "heads": 3, "head_size": 4},
             "(kv, num_blocks, block_size, num_kv_heads, head_dim)"]
    views = []
    for layout in forms:
        with kvferry.from_tensors([kvferry.TensorGroup([t], layout)], chunk_tokens=16) as g:
            views.append(g.view(0, 0))
    assert all(v == views[0] for v in views)
    v = views[0]
    assert (v.planes, v.heads, v.elem_bytes, v.head_bytes) == (2, 2, 2, (16, 16))
    assert (v.block_stride, v.plane_stride, v.token_stride, v.head_stride) == (
        16 * 2 * 8 * 2, 4 * 16 * 2 * 8 * 2, 2 * 8 * 2, 8 * 2)


def test_layout_errors_name_the_layer_and_dimension():
    t = _fa()
    cases = [
        (None, "layout naming"),
        ("blocks,tokens,heads,head_size", "names 4 dimensions, the tensor has 5"),
        ("planes,blocks,tokens,heads,widgets", "'widgets' is not one of"),
        ("planes,blocks,tokens,tokens,head_size", "names 'tokens' twice"),
        ("planes,blocks,tokens,_,head_size", "named '_' but has size 2"),
    ]
    for layout, text in cases:
        with pytest.raises(KvferryError) as e:
            kvferry.from_tensors([kvferry.TensorGroup({"attn0": t}, layout)])
        assert e.value.status == Status.INVALID_ARGUMENT
        assert e.value.field == "groups[0].layers['attn0']"
        assert text in str(e.value), str(e.value)
    # head_size must be the contiguous dimension.
    with pytest.raises(KvferryError, match="head_size dimension is not contiguous"):
        kvferry.from_tensors([kvferry.TensorGroup([t.transpose(0, 1, 2, 4, 3)],
                                                  kvferry.VLLM_FLASH_ATTN)])
    with pytest.raises(KvferryError, match="planes dimension has size 3"):
        kvferry.from_tensors([kvferry.TensorGroup([np.zeros((3, 4, 16, 2, 8), np.uint16)],
                                                  kvferry.VLLM_FLASH_ATTN)])
    with pytest.raises(KvferryError, match="negative stride"):
        kvferry.from_tensors([kvferry.TensorGroup([t[:, ::-1]], kvferry.VLLM_FLASH_ATTN)])
    with pytest.raises(KvferryError, match="disagree on num_blocks"):
        kvferry.from_tensors([kvferry.TensorGroup([t, _fa(nb=5)], kvferry.VLLM_FLASH_ATTN)])
    with pytest.raises(KvferryError) as e:
        kvferry.from_tensors([kvferry.TensorGroup([t], kvferry.VLLM_FLASH_ATTN, block_size=32)])
    assert e.value.field == "groups[0].block_size"


def test_one_pool_is_one_region():
    # An engine that carves every layer out of one pool: with allocations= (or
    # the numpy base chain) the pool is one region, layers at their offsets.
    L, per_layer = 3, _fa().nbytes
    pool = np.zeros(L * per_layer + 4096, np.uint8)
    layers = [pool[l * per_layer:(l + 1) * per_layer].view(np.uint16).reshape(2, 4, 16, 2, 8)
              for l in range(L)]
    for kwargs in ({}, {"allocations": [pool]}, {"allocations": [(pool.ctypes.data, pool.nbytes)]}):
        with kvferry.from_tensors([kvferry.TensorGroup(layers, kvferry.VLLM_FLASH_ATTN)],
                                  chunk_tokens=16, **kwargs) as g:
            assert g.num_regions == 1
            assert g.regions[0].size == pool.nbytes
            assert [v.offset for v in g.views(0)] == [l * per_layer for l in range(L)]
            assert g.bases[0].ptr == pool.ctypes.data


class InterfaceOnly:
    """An array known only by its __array_interface__ (no base, no DLPack)."""

    def __init__(self, a):
        self.a = a
        self.__array_interface__ = a.__array_interface__


def test_without_allocation_info_a_region_spans_its_views():
    pool = np.zeros(2 * _fa().nbytes, np.uint8)
    a = pool[:_fa().nbytes].view(np.uint16).reshape(2, 4, 16, 2, 8)
    b = pool[_fa().nbytes:].view(np.uint16).reshape(2, 4, 16, 2, 8)
    with kvferry.from_tensors([kvferry.TensorGroup([InterfaceOnly(a), InterfaceOnly(b)],
                                                   kvferry.VLLM_FLASH_ATTN)], chunk_tokens=16) as g:
        assert g.num_regions == 2  # adjacent, not overlapping: two regions
        assert [r.size for r in g.regions] == [a.nbytes, b.nbytes]
    with pytest.raises(KvferryError, match="lie in none of the allocations"):
        kvferry.from_tensors([kvferry.TensorGroup([a], kvferry.VLLM_FLASH_ATTN)],
                             allocations=[b])


def test_overlap_inside_a_group_is_refused_naming_the_layer():
    t = _fa()
    with pytest.raises(KvferryError) as e:
        kvferry.from_tensors([kvferry.TensorGroup([t, t], kvferry.VLLM_FLASH_ATTN)], chunk_tokens=16)
    assert e.value.status == Status.INVALID_GEOMETRY
    assert (e.value.group, e.value.layer) == (0, 1)
    assert e.value.field == "offset"


def test_shared_tensors_across_groups_are_aliases():
    model = engines.gpt_oss()
    with model.geometry() as g:
        assert g.num_aliases == 12
        assert g.view(1, 3).alias == (0, 3)
    with pytest.raises(KvferryError) as e:
        model.geometry(alias_across_groups=False)
    assert e.value.status == Status.INVALID_GEOMETRY and e.value.group == 1


def test_recurrent_states_need_one_slot_stride():
    buf = np.zeros(4 * 4096, np.uint8)
    conv = np.lib.stride_tricks.as_strided(buf.view(np.uint16), (4, 8), (4096, 2))
    other = np.zeros((4, 16), np.uint16)
    with pytest.raises(KvferryError, match="share one slot stride") as e:
        kvferry.from_tensors([kvferry.TensorGroup([[conv, other]], kind="recurrent")])
    assert e.value.field == "groups[0].layers[0].states[1]"
    noncontig = np.lib.stride_tricks.as_strided(buf.view(np.uint16), (4, 2, 8), (4096, 2, 4))
    with pytest.raises(KvferryError, match="not contiguous within a slot"):
        kvferry.from_tensors([kvferry.TensorGroup([noncontig], kind="recurrent")])
    # Slots first by default; a layout may put them elsewhere.
    states = np.zeros((4, 8), np.uint16).T  # 8 state elements per slot, 4 slots, slot dim last
    with kvferry.from_tensors([kvferry.TensorGroup([states], "state,blocks", kind="recurrent")],
                              chunk_tokens=16) as g:
        assert g.groups[0].num_blocks == 4
        v = g.view(0, 0)
        assert (v.block_stride, v.states) == (16, (kvferry.State(0, 16),))


def test_cuda_array_interface_tensors_make_device_regions():
    t = _fa()

    class FakeCuda:  # what a CUDA tensor exposes; never dereferenced here
        __cuda_array_interface__ = {"shape": t.shape, "typestr": "<u2", "strides": t.strides,
                                    "data": (t.ctypes.data, False), "version": 3}

    with kvferry.from_tensors([kvferry.TensorGroup([FakeCuda()], kvferry.VLLM_FLASH_ATTN)],
                              chunk_tokens=16) as g:
        host = kvferry.from_tensors([kvferry.TensorGroup([t], kvferry.VLLM_FLASH_ATTN)],
                                    chunk_tokens=16)
        assert g.view(0, 0) == host.view(0, 0)
        assert g.bases[0].device == "cuda" and host.bases[0].device == "cpu"
        # The host backend refuses device memory, naming the region.
        objects = [np.zeros(g.object_size(0, 0, 16), np.uint8)]
        req = kvferry.CopyRequest(g, 0, 16, blocks=[[0]], objects=objects)
        with pytest.raises(KvferryError) as e:
            kvferry.reference_gather(req)
        assert e.value.field == "region_bases[0]"
        host.close()


def test_geometry_keeps_its_tensors_alive():
    t = _fa(dtype=np.uint16)
    t[...] = np.arange(t.size, dtype=np.uint16).reshape(t.shape)
    want = t[:, 2, 3].copy()
    g = kvferry.from_tensors([kvferry.TensorGroup([t], kvferry.VLLM_FLASH_ATTN)], chunk_tokens=16)
    del t
    gc.collect()
    obj = np.zeros(g.object_size(0, 0, 16), np.uint8)
    kvferry.reference_gather(kvferry.CopyRequest(g, 0, 16, blocks=[[2]], objects=[obj]))
    # canonical [P][T][H][bytes]: token 3 of plane p at p*16*32 + 3*32
    got = np.stack([obj[p * 512 + 96:p * 512 + 128].view(np.uint16).reshape(2, 8) for p in (0, 1)])
    assert np.array_equal(got, want)
    g.close()


def test_strided_views_into_one_shared_int8_buffer():
    # vLLM's hybrid allocation: one int8 buffer for the layers of a group,
    # block b of layer l at offset + l*layer_stride + b*block_stride, here
    # two attention layers and two Mamba layers sharing the pages.
    NB, BS, H, D, L = 6, 16, 2, 64, 4
    page = 2 * BS * H * D * 2 + 512              # attention page, padded
    offset, layer_stride, block_stride = 4096, page, L * page
    raw = np.frombuffer(np.random.default_rng(1).bytes(offset + NB * block_stride), np.uint8).copy()
    attn = [np.lib.stride_tricks.as_strided(
        raw[offset + l * layer_stride:].view(np.uint16), (2, NB, BS, H, D),
        (BS * H * D * 2, block_stride, H * D * 2, D * 2, 2)) for l in (0, 1)]
    mamba = [[np.lib.stride_tricks.as_strided(raw[offset + l * layer_stride:].view(np.uint16),
                                              (NB, 3, 64), (block_stride, 128, 2)),
              np.lib.stride_tricks.as_strided(raw[offset + l * layer_stride + 384:].view(np.uint16),
                                              (NB, 4, 32), (block_stride, 64, 2))] for l in (2, 3)]
    g = kvferry.from_tensors([kvferry.TensorGroup(attn, kvferry.VLLM_FLASH_ATTN, name="attn"),
                              kvferry.TensorGroup(mamba, kind="recurrent", name="mamba")],
                             chunk_tokens=32)
    assert g.num_regions == 1 and g.regions[0].size == raw.nbytes and g.num_aliases == 0
    assert [v.offset for v in g.views(0) + g.views(1)] == [offset + l * page for l in range(L)]
    assert {v.block_stride for v in g.views(0) + g.views(1)} == {block_stride}
    assert g.view(0, 0).plane_stride == BS * H * D * 2
    assert g.view(1, 0).states == (kvferry.State(0, 384), kvferry.State(384, 256))
    objects = [np.zeros(g.object_size(og, 0, 32), np.uint8) for og in range(g.num_object_groups)]
    kvferry.reference_gather(kvferry.CopyRequest(g, 0, 32, blocks=[[4, 1], [5]],
                                                 objects=objects))
    obj = objects[0]
    seg = obj[:2 * 2 * 32 * H * D * 2].view(np.uint16).reshape(2, 2, 32, H, D)  # [P][L][T][H][D]
    for layer in range(2):
        for t in range(32):
            assert (seg[:, layer, t] == attn[layer][:, [4, 1][t // BS], t % BS]).all()
    states = obj[seg.nbytes:]
    want = b"".join(np.ascontiguousarray(s[5]).tobytes() for layer in mamba for s in layer)
    assert states.tobytes() == want
    g.close()
