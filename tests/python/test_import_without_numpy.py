"""`pip install ./python` into a fresh venv with neither numpy nor torch: the
package imports, finds the library by itself (the checkout's build tree,
recorded at install), runs a host-backend gather with raw pointers, and
imports kvferry.client (chunk keys of a ctypes array). test_client.py's
test_client_without_numpy runs the client against kvferryd without numpy."""

import shutil
import subprocess
import sys

import pytest

from conftest import RAW_GEOMETRY_SCRIPT, ROOT, subprocess_env

SCRIPT = r'''
import ctypes, sys
import kvferry
assert not any(m in sys.modules for m in ("numpy", "torch")), sorted(sys.modules)
print(kvferry.library_path())
''' + RAW_GEOMETRY_SCRIPT + r'''
cache = (ctypes.c_uint8 * size)(*[(7 * i) % 251 for i in range(size)])
want = b"".join(bytes(cache[2 * 64 + p * 32 + t * 8 + h * 4:][:4])
                for p in range(2) for t in range(4) for h in range(2))
for run in ("transfer", "reference"):
    obj = (ctypes.c_uint8 * g.object_size(0, 0, 4))()
    req = kvferry.CopyRequest(g, 0, 4, blocks=[[2]],
                              objects=[(ctypes.addressof(obj), ctypes.sizeof(obj))],
                              region_bases=[(ctypes.addressof(cache), ctypes.sizeof(cache))])
    if run == "transfer":
        with kvferry.Transfer(g) as xfer:
            xfer.gather(req)
    else:
        kvferry.reference_gather(req)
    assert bytes(obj) == want, run
g.close()
import kvferry.client
seed = kvferry.client.chunk_seed(b"m")
assert len(kvferry.client.chunk_keys(seed, (ctypes.c_int32 * 9)(*range(9)), chunk_tokens=4)) == 3
assert not any(m in sys.modules for m in ("numpy", "torch")), sorted(sys.modules)
print("ok")
'''


def _clean_build_outputs():
    shutil.rmtree(ROOT / "python" / "build", ignore_errors=True)
    for info in (ROOT / "python").glob("*.egg-info"):
        shutil.rmtree(info, ignore_errors=True)


def test_fresh_venv_without_numpy(tmp_path):
    venv = tmp_path / "venv"
    env = subprocess_env(LD_PRELOAD=None, PYTHONPATH=None)  # pip runs unsanitized
    made = subprocess.run([sys.executable, "-m", "venv", str(venv)], capture_output=True,
                          text=True, env=env)
    if made.returncode != 0:
        pytest.skip("python -m venv failed (offline or no ensurepip): %s" % made.stderr[-300:])
    py = str(venv / "bin" / "python")
    # Offline, the venv's own setuptools (and wheel) build the package; when it
    # lacks them, pip fetches a build backend from PyPI (skipped if it cannot).
    has_setuptools = subprocess.run([py, "-c", "import setuptools, wheel"], capture_output=True,
                                    env=env).returncode == 0
    cmd = [py, "-m", "pip", "install", "--no-deps", "--quiet", "--disable-pip-version-check"]
    if has_setuptools:  # build offline with the venv's own setuptools
        cmd.append("--no-build-isolation")
    cmd.append(str(ROOT / "python"))
    try:
        installed = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path)
    finally:
        _clean_build_outputs()
    if installed.returncode != 0:
        if not has_setuptools:
            pytest.skip("pip could not fetch setuptools to build the package (offline?): %s"
                        % installed.stderr[-300:])
        pytest.fail("pip install ./python failed:\n" + installed.stdout + installed.stderr)
    listing = subprocess.run([py, "-m", "pip", "list", "--format=freeze"], capture_output=True,
                             text=True, env=env).stdout
    assert "numpy" not in listing and "torch" not in listing and "kvferry==" in listing
    # Run from elsewhere, without KVF_LIBRARY: the installed package finds
    # the library in the checkout's build tree.
    run = subprocess.run([py, "-c", SCRIPT], capture_output=True, text=True, cwd=tmp_path,
                         env=subprocess_env(KVF_LIBRARY=None, PYTHONPATH=None))
    assert run.returncode == 0, run.stdout + run.stderr
    lib, ok = run.stdout.split()
    assert ok == "ok"
    assert lib.startswith(str(ROOT / "build")), lib
