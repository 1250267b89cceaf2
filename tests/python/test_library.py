"""Finding and loading libkvferry.so (kvferry._lib), and what an import does.

Each case runs a fresh interpreter, so the search really runs."""

import ctypes.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, subprocess_env

import kvferry


def _run(code, cwd=None, **env):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=cwd, env=subprocess_env(**env))


def _copy_package(tmp_path):
    dest = tmp_path / "site" / "kvferry"
    shutil.copytree(ROOT / "python" / "kvferry", dest,
                    ignore=shutil.ignore_patterns("__pycache__", "libkvferry.so*"))
    return dest


IMPORT = "import sys; sys.path.insert(0, %r); import kvferry; print(kvferry.library_path())"


def test_kvf_library_is_used_and_a_bad_one_is_an_error():
    out = _run(IMPORT % str(ROOT / "python"))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == os.environ.get("KVF_LIBRARY", out.stdout.strip())
    bad = _run(IMPORT % str(ROOT / "python"), KVF_LIBRARY="/nonexistent/libkvferry.so")
    assert bad.returncode != 0
    assert "ImportError: kvferry: KVF_LIBRARY=/nonexistent/libkvferry.so cannot be loaded" in bad.stderr


def test_the_build_tree_is_found_from_the_checkout():
    if not kvferry._lib.build_dirs(ROOT):
        pytest.skip("this checkout has no build tree holding libkvferry.so (the library was carried "
                    "from another machine's build)")
    out = _run(IMPORT % str(ROOT / "python"), KVF_LIBRARY=None)
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()).resolve().is_relative_to((ROOT / "build").resolve())


def test_a_copy_next_to_the_package_is_found(tmp_path):
    pkg = _copy_package(tmp_path)
    shutil.copy(kvferry.library_path(), pkg / "libkvferry.so")
    out = _run(IMPORT % str(pkg.parent), cwd=tmp_path, KVF_LIBRARY=None)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(pkg / "libkvferry.so")


def test_not_found_says_everywhere_it_looked(tmp_path):
    installed = [p for p in (Path(sys.prefix) / "lib" / "libkvferry.so",
                             Path("/usr/local/lib/libkvferry.so")) if p.exists()]
    if installed or ctypes.util.find_library("kvferry"):
        pytest.skip("libkvferry is installed on this machine (%s): the search would find it"
                    % (installed or ctypes.util.find_library("kvferry")))
    pkg = _copy_package(tmp_path)
    out = _run(IMPORT % str(pkg.parent), cwd=tmp_path, KVF_LIBRARY=None, LD_LIBRARY_PATH=None)
    assert out.returncode != 0
    err = out.stderr
    assert "libkvferry.so not found" in err
    for place in ("$KVF_LIBRARY (not set)", "next to the package", "a build tree",
                  "the install prefix", "find_library('kvferry')",
                  "the dynamic loader's search path"):
        assert place in err, (place, err)


def test_a_library_of_another_minor_version_is_refused(tmp_path):
    pkg = _copy_package(tmp_path)
    structs = pkg / "_structs.py"
    text, n = re.subn(r"HEADER_VERSION = \(\d+, \d+, \d+\)", "HEADER_VERSION = (0, 99, 0)",
                      structs.read_text())
    assert n == 1
    structs.write_text(text)
    out = _run(IMPORT % str(pkg.parent), cwd=tmp_path)
    assert out.returncode != 0
    assert "this package mirrors the 0.99 headers" in out.stderr


def test_importing_loads_the_library_and_nothing_else():
    code = ("import sys, threading; sys.path.insert(0, %r); import kvferry; "
            "print(sorted(m for m in ('numpy', 'torch', 'cupy') if m in sys.modules), "
            "threading.active_count())" % str(ROOT / "python"))
    out = _run(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[]", "1"]
