"""Geometries: files, JSON text, presets, built in code, read back (kvferry.geometry)."""

import json
import shutil

import pytest

from conftest import PRESET_DIR, tiny_geometry

import kvferry
from kvferry import GroupKind, KvferryError, ObjectFormat, State, Status, View

PRESETS = sorted(p.stem for p in PRESET_DIR.glob("*.json"))


def test_presets_are_listed_and_load():
    assert kvferry.presets() == PRESETS
    for name in PRESETS:
        with kvferry.Geometry.preset(name) as g:
            assert g.name == name
            assert g.finalized and g.num_groups >= 1 and g.description


def test_preset_lookup(monkeypatch, tmp_path):
    with pytest.raises(KvferryError) as e:
        kvferry.Geometry.preset("no-such-preset")
    assert (e.value.status, e.value.field) == (Status.NOT_FOUND, "preset")
    assert "llama-3.1-8b-fa-nhd" in e.value.message  # the presets there are listed
    # KVF_PRESET_DIR comes first, as for the CLI.
    shutil.copy(PRESET_DIR / "deepseek-v3-mla-bf16.json", tmp_path / "only-one.json")
    monkeypatch.setenv("KVF_PRESET_DIR", str(tmp_path))
    assert kvferry.preset_dirs()[0] == tmp_path
    assert kvferry.presets() == ["only-one"]
    with kvferry.Geometry.preset("only-one", num_blocks=4) as g:
        assert g.groups[0].num_blocks == 4
    # A path is a file, wherever it is.
    with kvferry.Geometry.preset(str(PRESET_DIR / "gpt-oss-20b-like.json")) as g:
        assert g.num_groups == 2


def test_files_and_json_text():
    path = PRESET_DIR / "glm-like-hybrid.json"
    text = path.read_text()
    geometries = [kvferry.Geometry.from_file(path), kvferry.Geometry.from_json(text),
                  kvferry.Geometry.from_json(text.encode()), kvferry.Geometry.from_json(json.loads(text))]
    prints = {(g.fingerprint("canonical"), g.fingerprint("native")) for g in geometries}
    assert len(prints) == 1
    for g in geometries:
        g.close()


def test_to_json_round_trips():
    for name in PRESETS:
        with kvferry.Geometry.preset(name, num_blocks=12) as g:
            text = g.to_json()
            with kvferry.Geometry.from_json(text) as back:
                assert back.to_json() == text
                for fmt in ObjectFormat:
                    assert back.fingerprint(fmt) == g.fingerprint(fmt)
                for gi in range(g.num_groups):
                    assert back.views(gi) == g.views(gi)
                assert back.regions == g.regions


def test_load_errors_name_the_field():
    with pytest.raises(KvferryError) as e:
        kvferry.Geometry.from_file(PRESET_DIR / "missing.json")
    assert e.value.status == Status.NOT_FOUND
    with pytest.raises(KvferryError) as e:
        kvferry.Geometry.from_json('{"format":')
    assert e.value.status == Status.PARSE and "line 1" in e.value.message
    doc = json.loads((PRESET_DIR / "llama-3.1-8b-fa-nhd.json").read_text())
    doc["groups"][0]["layers"][0]["tokn_stride"] = 1
    with pytest.raises(KvferryError) as e:
        kvferry.Geometry.from_json(doc)
    assert (e.value.status, e.value.field) == (Status.PARSE, "groups[0].layers[0].tokn_stride")
    assert (e.value.group, e.value.layer) == (0, 0)
    del doc["groups"][0]["layers"][0]["tokn_stride"]
    doc["groups"][0]["layers"][0]["token_stride"] = 8
    with pytest.raises(KvferryError) as e:
        kvferry.Geometry.from_json(doc)
    assert (e.value.status, e.value.field) == (Status.INVALID_GEOMETRY, "token_stride")
    assert (e.value.group, e.value.layer) == (0, 0)


def test_built_in_code_with_defaults():
    g = kvferry.Geometry("built", "in code")
    assert not g.finalized
    r = g.add_region()
    assert r == 0
    full = g.add_group("full", num_blocks=8)            # kind full, block size 16
    swa = g.add_group("swa", "sliding_window", block_size=16, num_blocks=8, window=40)
    rec = g.add_group("mamba", GroupKind.RECURRENT, num_blocks=4)
    page = 16 * 2 * 64
    v = View(region=0, elem_bytes=2, block_stride=page, planes=2, heads=1, plane_stride=16 * 64,
             token_stride=64, head_bytes=64)
    assert g.add_view(full, v, name="attn") == 0
    assert g.add_view(swa, v, alias=(0, 0), name="swa") == 0
    assert g.add_view(rec, region=0, block_stride=page, states=[(0, 256), State(256, 512)],
                      alias=(0, 0)) == 0
    g.set_policy(chunk_tokens=32)
    g.set_policy(separate_recurrent=True)  # keeps chunk_tokens
    assert g.finalize() is g
    assert g.finalized and g.name == "built" and g.description == "in code"
    assert g.policy == kvferry.Policy(32, ObjectFormat.CANONICAL, True, True)
    assert [x.kind for x in g.groups] == [GroupKind.FULL, GroupKind.SLIDING_WINDOW,
                                          GroupKind.RECURRENT]
    assert g.groups[1].window == 40 and g.groups[0].block_size == 16
    assert g.num_object_groups == 3 and g.num_aliases == 2
    assert g.regions[0].size == 7 * page + 16 * 2 * 64  # the smallest size holding every view
    assert g.regions[0].align == 256
    assert g.view(0, 0) == View(region=0, elem_bytes=2, block_stride=page, planes=2, heads=1,
                                plane_stride=16 * 64, token_stride=64, head_bytes=(64, 64),
                                name="attn")
    assert g.view("mamba", 0).states == (State(0, 256), State(256, 512))
    assert g.view("swa", 0).alias == (0, 0)
    assert g.object_group(2) == kvferry.ObjectGroup(2, (2,), False, True, 0, 768)
    assert "built" in repr(g)
    # Read-only now.
    with pytest.raises(KvferryError) as e:
        g.add_region()
    assert e.value.status == Status.STATE
    g.close()


def test_reading_before_finalize_and_after_close():
    g = kvferry.Geometry()
    with pytest.raises(KvferryError) as e:
        g.regions
    assert e.value.status == Status.STATE
    assert repr(g) == "<kvferry.Geometry (building)>"
    g.close()
    g.close()
    assert repr(g) == "<kvferry.Geometry (closed)>"
    with pytest.raises(KvferryError) as e:
        g.add_group()
    assert (e.value.status, e.value.field) == (Status.STATE, "geometry")


def test_validation_errors_name_group_layer_and_field():
    g = kvferry.Geometry()
    g.add_region()
    g.add_group("full", num_blocks=4, block_size=4)
    g.add_view(0, elem_bytes=2, block_stride=64, planes=2, heads=2, head_bytes=16,
               plane_stride=32, token_stride=8, head_stride=16, name="layer0")
    with pytest.raises(KvferryError) as e:
        g.finalize()
    err = e.value
    assert (err.status, err.group, err.layer, err.field) == (Status.INVALID_GEOMETRY, 0, 0,
                                                            "token_stride")
    assert "group 'full' (0), layer 0 ('layer0')" in err.message
    g.close()
    with pytest.raises(KvferryError) as e:
        kvferry.Geometry().add_group(kind="spiral")
    assert e.value.field == "kind"
    with pytest.raises(KvferryError) as e:
        View(head_bytes=(1, 2, 3))
    assert e.value.field == "head_bytes"
    with pytest.raises(KvferryError) as e:
        kvferry.Geometry().add_view(0, offset=-1)
    assert e.value.field == "offset"


def test_windows_blocks_and_objects():
    with kvferry.Geometry.preset("gpt-oss-20b-like", num_blocks=64) as g:
        assert g.local_tokens(1000) == 1000
        assert g.local_blocks("full", 0, 100) == (0, 7)
        assert g.retained_tokens("sliding", 1000) == 1000 - 128 + 1
        first, end = g.retained_blocks("sliding", 1000)
        assert (first, end) == ((1000 - 127) // 16, (1000 + 15) // 16)
        assert g.retained_blocks("full", 1000) == (0, 63)
        size = g.object_size(0, 0, 256)
        assert size == g.object_groups[0].bytes_per_token * 256
        assert g.object_segment("full", 1, plane=0, local_tokens=256) == (256 * 8 * 128,
                                                                          256 * 8 * 128)
        assert g.num_chunks(256, 700) == 2
    with kvferry.Geometry.preset("deepseek-v3-mla-dcp4-rank1") as g:
        assert g.dcp == (4, 1)
        assert g.local_tokens(10) == 3  # tokens 1, 5 and 9
    with kvferry.Geometry.preset("qwen3-next-like-hybrid") as g:
        assert g.recurrent_state(544 * 3) == 2
        with pytest.raises(KvferryError) as e:
            g.recurrent_state(100)
        assert e.value.field == "prefix_tokens"
        with pytest.raises(KvferryError):
            g.local_blocks("linear0", 0, 10)


def test_object_headers():
    g, _ = tiny_geometry()
    h = g.object_header(0, 1, 20)
    assert (h.magic, h.format, h.object_group, h.token_begin, h.token_end) == (
        0x4B56464F, ObjectFormat.CANONICAL, 0, 8, 16)
    assert h.fingerprint == g.fingerprint("canonical")
    assert h.payload_bytes == g.object_size(0, 1, 20)
    assert kvferry.ObjectHeader.from_bytes(bytes(h)) == h
    g.check_object_header(h, 0)
    other, _ = tiny_geometry(chunk_tokens=4)
    with pytest.raises(KvferryError) as e:
        other.check_object_header(h, 0)
    assert (e.value.status, e.value.field) == (Status.GEOMETRY_MISMATCH, "fingerprint")
    native = g.object_header(0, 0, 8, format="native")
    assert native.format == ObjectFormat.NATIVE
    g.close()
    other.close()
