"""Shared fixtures of the Python tests.

The tests import the package from python/ of this checkout (not an installed
copy) and use the library KVF_LIBRARY names (ctest sets it to the build's
libkvferry.so; without it the package searches as documented).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import kvferry  # noqa: E402

PRESET_DIR = ROOT / "geometry" / "presets"


def pytest_report_header(config):
    info = kvferry.cuda_probe()
    return ["kvferry %s from %s" % (kvferry.version(), kvferry.library_path()),
            "cuda: %s" % info.message]


@pytest.fixture(scope="session")
def layout_dump():
    """The JSON layout_dump prints (tests/python/layout_dump.c)."""
    exe = os.environ.get("KVF_LAYOUT_DUMP")
    if not exe:
        guess = Path(kvferry.library_path()).parent / "tests" / "layout_dump"
        if guess.exists():
            exe = str(guess)
    if not exe:
        pytest.skip("KVF_LAYOUT_DUMP is not set and no layout_dump next to the library "
                    "(ctest sets it; build the tests target)")
    out = subprocess.run([exe], check=True, capture_output=True, text=True,
                         env={k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}).stdout
    return json.loads(out)


@pytest.fixture(scope="session")
def gpu():
    """A CUDA runtime reached through ctypes, when a GPU is visible."""
    info = kvferry.cuda_probe()
    if not info.available:
        pytest.skip("no GPU: %s" % info.message)
    import cudart
    try:
        return cudart.Runtime()
    except OSError as exc:
        pytest.skip("a GPU is visible but libcudart cannot be loaded: %s" % exc)


def subprocess_env(**changes):
    """os.environ with changes (None removes a variable), for child pythons."""
    env = dict(os.environ)
    for key, value in changes.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


# Python source for the scripts that run without numpy (after `import
# kvferry`): `g`, a finalized one-region geometry of one full group (4 blocks
# of 4 tokens, 2 planes x 2 heads x 4 bytes at block stride 64, chunk_tokens
# 4), and `size`, its region's bytes.
RAW_GEOMETRY_SCRIPT = '''\
g = kvferry.Geometry("raw")
r = g.add_region(align=8)
grp = g.add_group("full", block_size=4, num_blocks=4)
g.add_view(grp, region=r, elem_bytes=1, block_stride=64, planes=2, heads=2, plane_stride=32,
           token_stride=8, head_stride=4, head_bytes=4)
g.set_policy(chunk_tokens=4)
g.finalize()
size = g.regions[0].size
'''


def tiny_geometry(num_blocks=8, chunk_tokens=8):
    """A small geometry built in code: one region, one full group of block
    size 4, two layers of 2 planes x 2 heads x 16 bytes (FlashInfer-like
    blocks, the layers half a region apart). Returns (geometry, region bytes)."""
    block = 2 * 4 * 2 * 16  # planes * tokens * heads * head_bytes = 256
    g = kvferry.Geometry("tiny", "two layers in one region")
    r = g.add_region(name="kv", align=8)  # caches in bytearrays: malloc's alignment
    grp = g.add_group(name="full", block_size=4, num_blocks=num_blocks)
    for layer in range(2):
        g.add_view(grp, region=r, elem_bytes=2, offset=layer * num_blocks * block,
                   block_stride=block, planes=2, heads=2, plane_stride=4 * 2 * 16,
                   token_stride=2 * 16, head_stride=16, head_bytes=16, name="layer%d" % layer)
    g.set_policy(chunk_tokens=chunk_tokens)
    g.finalize()
    return g, 2 * num_blocks * block


def tiny_expected(cache, token_begin, token_end, ids, num_blocks=8, chunk_tokens=8):
    """Canonical objects of tiny_geometry for a table covering local blocks
    from 0, from the view formula written out: [P][L][T][H][16 bytes]."""
    block = 256
    objects = []
    for cb in range(token_begin, token_end, chunk_tokens):
        out = bytearray()
        tokens = range(cb, min(cb + chunk_tokens, token_end))
        for p in range(2):
            for layer in range(2):
                for t in tokens:
                    b = ids[t // 4]
                    for h in range(2):
                        off = layer * num_blocks * block + b * block + p * 128 + (t % 4) * 32 + h * 16
                        out += cache[off:off + 16]
        objects.append(bytes(out))
    return objects
