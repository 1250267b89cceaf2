"""Copy requests and the CPU reference gather/scatter (kvferry.copy)."""

import ctypes
import gc

import numpy as np
import pytest

from conftest import tiny_expected, tiny_geometry

import kvferry
from kvferry import KvferryError, Status


def _cache(nbytes, seed=1):
    rng = np.random.default_rng(seed)
    return bytearray(rng.integers(0, 256, nbytes, dtype=np.uint8).tobytes())


def test_reference_gather_then_scatter_round_trips():
    g, size = tiny_geometry()
    cache = _cache(size)
    ids = [5, 2, 7, 0]
    objects = [bytearray(g.object_size(0, k, 16)) for k in range(2)]
    req = kvferry.CopyRequest(g, 0, 16, blocks=[ids], objects=objects, region_bases=[cache])
    assert req.num_chunks == 2
    req.check()
    kvferry.reference_gather(req)
    assert [bytes(o) for o in objects] == tiny_expected(cache, 0, 16, ids)
    back = bytearray(size)
    kvferry.reference_scatter(kvferry.CopyRequest(g, 0, 16, blocks=[ids], objects=objects,
                                                  region_bases=[back]))
    for layer in range(2):
        for b in ids:
            off = layer * 8 * 256 + b * 256
            assert back[off:off + 256] == cache[off:off + 256]
    moved = {layer * 8 * 256 + b * 256 + i for layer in range(2) for b in ids for i in range(256)}
    assert all(back[i] == 0 for i in range(size) if i not in moved)


def test_skipped_blocks_leave_objects_untouched():
    g, size = tiny_geometry()
    cache = _cache(size)
    for skip in (-1, None, kvferry.BLOCK_SKIP):
        obj = bytearray(b"\xee" * g.object_size(0, 0, 8))
        kvferry.reference_gather(kvferry.CopyRequest(g, 0, 8, blocks=[[3, skip]], objects=[obj],
                                                     region_bases=[cache]))
        # token rows of block 1 (tokens 4..7): plane 0 layer 0 rows 4..7, 32 bytes each
        assert obj[4 * 32:8 * 32] == b"\xee" * 128
        assert obj[:4 * 32] != b"\xee" * 128


def test_block_tables_in_every_form():
    g, size = tiny_geometry()
    cache = _cache(size)
    want = tiny_expected(cache, 8, 16, [None, None, 6, 1])
    forms = [
        {"blocks": [kvferry.BlockTable([6, 1], first_block=2)]},
        {"blocks": {"full": kvferry.BlockTable(np.array([6, 1], np.int64), 2)}},
        {"blocks": {0: kvferry.BlockTable(np.array([9, 9, 6, 1], np.uint32)[2:], 2)}},
        {"blocks": [kvferry.BlockTable(np.array([6, 0, 1], np.int32)[::2], 2)]},
        {"blocks": [kvferry.BlockTable(range(6, 0, -5), 2)]},
    ]
    for form in forms:
        obj = bytearray(g.object_size(0, 1, 16))
        kvferry.reference_gather(kvferry.CopyRequest(g, 8, 16, objects={(0, 0): obj},
                                                     region_bases={0: cache}, **form))
        assert bytes(obj) == want[0], form


@pytest.mark.parametrize("ids, field, text", [
    ([0, -2], "blocks['full'][1]", "-2 is not a block id"),
    ([0, 2**32], "blocks['full'][1]", "is not a block id"),
    ([0, 1.5], "blocks['full'][1]", "is not a block id"),
    ([True], "blocks['full'][0]", "is not a block id"),
    (np.array([1, -3]), "blocks['full'][1]", "-3 is not a block id"),
    (np.array([1, 2**40], np.uint64), "blocks['full'][1]", "is not a block id"),
    (np.zeros((2, 2), np.int32), "blocks['full']", "one-dimensional"),
    (np.zeros(2, np.float32), "blocks['full']", "must be integers"),
])
def test_bad_block_ids_name_group_and_index(ids, field, text):
    g, size = tiny_geometry()
    with pytest.raises(KvferryError) as e:
        kvferry.CopyRequest(g, 0, 8, blocks=[ids], objects=[bytearray(4096)],
                            region_bases=[bytearray(size)])
    assert e.value.status == Status.INVALID_ARGUMENT
    assert e.value.field == field
    assert text in e.value.message


def test_the_library_checks_name_the_field():
    g, size = tiny_geometry()
    cache = bytearray(size)
    obj = [bytearray(4096)] * 2
    with pytest.raises(KvferryError) as e:
        kvferry.reference_gather(kvferry.CopyRequest(g, 0, 8, blocks=[[0, 8]], objects=obj[:1],
                                                     region_bases=[cache]))
    assert e.value.field == "groups[0].block_ids[1]"
    with pytest.raises(KvferryError) as e:
        kvferry.CopyRequest(g, 4, 8, blocks=[[0]], objects=obj[:1], region_bases=[cache]).check()
    assert e.value.field == "token_begin"
    with pytest.raises(KvferryError) as e:
        kvferry.CopyRequest(g, 0, 8, blocks=[[0]], objects=[None], region_bases=[cache]).check()
    assert e.value.field == "objects[0]"
    with pytest.raises(KvferryError) as e:
        kvferry.CopyRequest(g, 0, 8, blocks=[[0]], objects=obj[:1], region_bases=[None]).check()
    assert e.value.field == "region_bases[0]"


def test_python_checks_name_the_argument():
    g, size = tiny_geometry()
    cache = bytearray(size)

    def request(**kw):
        args = dict(blocks=[[0]], objects=[bytearray(4096)], region_bases=[cache])
        args.update(kw)
        return kvferry.CopyRequest(g, 0, 8, **args)

    cases = [
        ({"blocks": [[0], [1]]}, "blocks", "2 entries given, the geometry has 1"),
        ({"objects": []}, "objects", "0 objects given, the request needs 1"),
        ({"objects": {(1, 0): bytearray(4096)}}, "objects", "the request has 1 chunks"),
        ({"objects": [bytearray(10)]}, "objects[0]", "10 bytes, but chunk 0 of object group 0"),
        ({"objects": [np.zeros((64, 64), np.uint8)[:, :32]]}, "objects[0]", "contiguous"),
        ({"region_bases": [bytearray(size - 1)]}, "region_bases[0]", "region 0 ('kv') is"),
        ({"region_bases": [12345]}, "region_bases[0]", "a bare pointer has no length"),
        ({"region_bases": [object()]}, "region_bases[0]", "is not a buffer"),
    ]
    for kwargs, field, text in cases:
        with pytest.raises(KvferryError) as e:
            request(**kwargs)
        assert (e.value.field, e.value.status) == (field, Status.INVALID_ARGUMENT), kwargs
        assert text in e.value.message, (kwargs, e.value.message)
    with pytest.raises(KvferryError) as e:
        request(blocks={"nope": [0]})
    assert (e.value.status, e.value.field) == (Status.NOT_FOUND, "group")
    with pytest.raises(KvferryError, match="no bases of its own"):
        kvferry.CopyRequest(g, 0, 8, blocks=[[0]], objects=[bytearray(4096)])


def test_read_only_destinations_are_refused():
    g, size = tiny_geometry()
    cache = bytes(size)
    req = kvferry.CopyRequest(g, 0, 8, blocks=[[0]], objects=[bytes(4096)], region_bases=[cache])
    with pytest.raises(KvferryError, match="read-only memory, but the gather writes it") as e:
        kvferry.reference_gather(req)
    assert e.value.field == "objects[0]"
    with pytest.raises(KvferryError, match="read-only memory, but the scatter writes it") as e:
        kvferry.reference_scatter(req)
    assert e.value.field == "region_bases[0]"


def test_raw_pointers_with_lengths():
    g, size = tiny_geometry()
    cache = (ctypes.c_char * size).from_buffer(_cache(size))
    obj = (ctypes.c_char * g.object_size(0, 0, 8))()
    kvferry.reference_gather(kvferry.CopyRequest(
        g, 0, 8, blocks=[[4, 1]], objects=[(ctypes.addressof(obj), ctypes.sizeof(obj))],
        region_bases=[kvferry.RawBuffer(ctypes.addressof(cache), size, device="cpu")]))
    assert obj.raw == tiny_expected(bytes(cache), 0, 8, [4, 1])[0]


def test_a_request_keeps_its_buffers_alive():
    g, size = tiny_geometry()
    data = _cache(size)
    want = tiny_expected(data, 0, 8, [2, 3])[0]
    req = kvferry.CopyRequest(g, 0, 8, blocks=[np.array([2, 3])],
                              objects=[np.zeros(len(want), np.uint8)],
                              region_bases=[np.frombuffer(bytes(data), np.uint8).copy()])
    gc.collect()
    kvferry.reference_gather(req)
    assert bytes(req._views[-1][1].keep[0]) == want


def test_a_closed_geometry_is_refused():
    g, size = tiny_geometry()
    req = kvferry.CopyRequest(g, 0, 8, blocks=[[0]], objects=[bytearray(4096)],
                              region_bases=[bytearray(size)])
    g.close()
    with pytest.raises(KvferryError) as e:
        kvferry.reference_gather(req)
    assert e.value.status == Status.STATE and e.value.field == "geometry"
