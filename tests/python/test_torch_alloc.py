"""The exportable allocator for torch: libkvferry_torch_alloc.so and
kvferry.torch (python/torch_alloc, python/kvferry/torch.py).

Three levels, each skipping with its reason where it cannot run:
- everywhere: the library is found, shares the package's libkvferry, and
  importing kvferry (or kvferry.torch) never imports torch;
- with torch (a CUDA build of it; ``scripts/torch-venv`` makes a venv with
  the pinned one, ctest label ``torch``): torch.cuda.CUDAPluggableAllocator
  loads the library; without a GPU the pool is refused, and the test says
  what torch refused;
- on a GPU: segments allocated through ctypes (cudart for the copies, no
  torch), then tensors from a MemPool built on it, each found with
  kvferry.Allocation.find at its interior offset, with the identity the
  allocator gave it, exported, and freed.
"""

import ctypes
import gc
import os
import shutil
import subprocess
import sys
from ctypes import c_void_p

import pytest

from conftest import ROOT, subprocess_env

import kvferry
import kvferry.torch as kt
from kvferry import Allocation, KvferryError, MemProvider, Status


def _run(code, **env):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=subprocess_env(**env))


def _torch():
    """torch, or a skip saying why it cannot be used here."""
    try:
        import torch
    except ImportError as exc:
        pytest.skip("torch is not installed in this python (%s): scripts/torch-venv makes a venv "
                    "with it, ctest -L torch runs this file there" % exc)
    if torch.version.cuda is None:
        pytest.skip("torch %s is a CPU build: it has no pluggable CUDA allocator" % torch.__version__)
    return torch


def _torch_gpu():
    torch = _torch()
    if not torch.cuda.is_available():
        pytest.skip("torch %s sees no GPU (kvferry: %s)"
                    % (torch.__version__, kvferry.cuda_probe().message))
    return torch


# ---- everywhere ----------------------------------------------------------------------

def test_importing_kvferry_and_kvferry_torch_never_imports_torch():
    out = _run("import sys; sys.path.insert(0, %r)\n"
               "import kvferry, kvferry.torch\n"
               "print(kvferry.torch.allocator_library_path())\n"
               "print(kvferry.torch.allocator_stats())\n"
               "assert 'torch' not in sys.modules, 'torch was imported'\n" % str(ROOT / "python"))
    assert out.returncode == 0, out.stderr
    path, stats = out.stdout.split("\n")[:2]
    assert path.endswith(kt.LIBRARY_NAME)
    assert stats == "(0, 0)"


def test_the_library_is_found_and_shares_the_package_libkvferry():
    path = kt.allocator_library_path()
    if os.environ.get("KVF_TORCH_ALLOC_LIBRARY"):
        assert path == os.environ["KVF_TORCH_ALLOC_LIBRARY"]
    lib = ctypes.CDLL(path)
    for name in (kt.ALLOC_FN, kt.FREE_FN):
        assert ctypes.cast(getattr(lib, name), c_void_p).value
    lib.kvf_torch_alloc_libkvferry_path.restype = ctypes.c_char_p
    assert os.path.samefile(lib.kvf_torch_alloc_libkvferry_path().decode(), kvferry.library_path())
    with pytest.raises(KvferryError) as e:
        kt.allocation_identity(12345)
    assert e.value.status == Status.NOT_FOUND


FIND = ("import sys; sys.path.insert(0, %r)\n"
        "import kvferry.torch\n"
        "try:\n"
        "    print(kvferry.torch.allocator_library_path())\n"
        "except kvferry.KvferryError as e:\n"
        "    print(e.status.name, e.message)\n")


def test_it_is_found_next_to_the_libkvferry_the_package_loaded():
    out = _run(FIND % str(ROOT / "python"), KVF_TORCH_ALLOC_LIBRARY=None)
    assert out.returncode == 0, out.stderr
    found = out.stdout.strip()
    assert found.endswith(kt.LIBRARY_NAME), found
    assert os.path.dirname(os.path.realpath(found)) == \
        os.path.dirname(os.path.realpath(kvferry.library_path()))


def test_a_copy_next_to_the_package_comes_first(tmp_path):
    pkg = tmp_path / "site" / "kvferry"
    shutil.copytree(ROOT / "python" / "kvferry", pkg,
                    ignore=shutil.ignore_patterns("__pycache__", "lib*.so*"))
    shutil.copy(kt.allocator_library_path(), pkg / kt.LIBRARY_NAME)
    out = _run(FIND % str(pkg.parent), KVF_TORCH_ALLOC_LIBRARY=None)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(pkg / kt.LIBRARY_NAME)


def test_a_bad_path_or_nothing_found_says_where_it_looked(tmp_path):
    bad = _run(FIND % str(ROOT / "python"), KVF_TORCH_ALLOC_LIBRARY="/nonexistent/x.so")
    assert bad.returncode == 0, bad.stderr
    assert bad.stdout.startswith("NOT_FOUND KVF_TORCH_ALLOC_LIBRARY=/nonexistent/x.so cannot be used")
    # A copy of the package and of libkvferry, with no allocator anywhere near.
    pkg = tmp_path / "site" / "kvferry"
    shutil.copytree(ROOT / "python" / "kvferry", pkg,
                    ignore=shutil.ignore_patterns("__pycache__", "lib*.so*", "_install_info.py"))
    shutil.copy(kvferry.library_path(), pkg / "libkvferry.so")
    out = _run(FIND % str(pkg.parent), KVF_TORCH_ALLOC_LIBRARY=None, KVF_LIBRARY=None)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    if not text.startswith("NOT_FOUND"):
        pytest.skip("an allocator library is installed where the search looks: %s" % text.strip())
    # (libkvferry is next to the package here: that place is listed once.)
    for place in ("$KVF_TORCH_ALLOC_LIBRARY (not set)", "next to the package", "the install prefix",
                  "find_library('kvferry_torch_alloc')"):
        assert place in text, (place, text)


def test_a_library_bound_to_another_libkvferry_is_refused(tmp_path):
    # Load the allocator first (it brings the build's libkvferry), then make
    # the package load a copy of libkvferry (another file): two tables of
    # allocations in one process, which kvferry.torch must refuse.
    copy = tmp_path / "libkvferry.so.0"
    shutil.copy(os.path.realpath(kvferry.library_path()), copy)
    code = ("import ctypes, sys; sys.path.insert(0, %r)\n"
            "ctypes.CDLL(%r)\n"
            "import kvferry, kvferry.torch\n"
            "try:\n"
            "    kvferry.torch.allocator_library_path()\n"
            "except kvferry.KvferryError as e:\n"
            "    print(e.status.name, e.message)\n" % (str(ROOT / "python"), kt.allocator_library_path()))
    out = _run(code, KVF_LIBRARY=str(copy), KVF_TORCH_ALLOC_LIBRARY=kt.allocator_library_path())
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("NOT_FOUND"), out.stdout
    assert "it calls another libkvferry" in out.stdout, out.stdout
    assert str(copy) in out.stdout


# ---- with torch --------------------------------------------------------------------------

def test_cuda_pluggable_allocator_loads_it():
    torch = _torch()
    # Exactly what the docs tell torch users to write, and what
    # exportable_mem_pool does.
    direct = torch.cuda.memory.CUDAPluggableAllocator(kt.allocator_library_path(), kt.ALLOC_FN,
                                                      kt.FREE_FN)
    assert direct.allocator() is not None
    shared = kt.exportable_allocator()
    assert isinstance(shared, torch.cuda.memory.CUDAPluggableAllocator)
    assert kt.exportable_allocator() is shared
    if torch.cuda.is_available():
        return
    with pytest.raises(KvferryError) as e:
        kt.exportable_mem_pool(0)
    assert e.value.status == Status.NO_DEVICE
    assert "sees no CUDA device" in e.value.message
    try:
        torch.cuda.MemPool(shared.allocator())
    except Exception as exc:  # what torch itself refuses without a GPU
        refused = "%s: %s" % (type(exc).__name__, str(exc).splitlines()[0])
    else:
        refused = "nothing (a pool was made)"
    pytest.skip("no GPU: the allocator loads through CUDAPluggableAllocator, but torch %s cannot "
                "make a MemPool (it refused with %s)" % (torch.__version__, refused))


# ---- on a GPU, without torch -------------------------------------------------------------

def _module():
    lib = ctypes.CDLL(kt.allocator_library_path())
    lib.kvf_torch_alloc.restype = c_void_p
    lib.kvf_torch_alloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, c_void_p]
    lib.kvf_torch_free.restype = None
    lib.kvf_torch_free.argtypes = [c_void_p, ctypes.c_ssize_t, ctypes.c_int, c_void_p]
    return lib


def _copy_in(gpu, ptr, data):
    gpu.check(gpu.lib.cudaMemcpy(c_void_p(ptr), data, ctypes.c_size_t(len(data)), 1), "H2D")


def _copy_out(gpu, ptr, n):
    out = ctypes.create_string_buffer(n)
    gpu.check(gpu.lib.cudaMemcpy(out, c_void_p(ptr), ctypes.c_size_t(n), 2), "D2H")
    return out.raw


def test_gpu_segments_through_ctypes_are_found_exported_and_freed(gpu):
    lib = _module()
    g = kvferry.mem_granularity("cumem", 0)
    before = kt.allocator_stats()
    for size in (1, g, 3 * g + 5, 64 << 20):
        rounded = -(-size // g) * g
        base = lib.kvf_torch_alloc(size, 0, None)
        assert base, "kvf_torch_alloc(%d) returned NULL: %s" % (size, kvferry._lib.last_error())
        assert base % g == 0
        made = kt.allocation_identity(base)
        assert made.size == rounded and made.provider == MemProvider.CUMEM
        assert kvferry.device_from_uuid(made.device_uuid) == 0
        assert kt.allocator_stats() == (before[0] + 1, before[1] + rounded)
        for off in (0, 1, rounded // 3, rounded - 1):
            with Allocation.find(base + off) as found:
                assert found.ptr == base and found.size == rounded
                assert found.identity == made == kt.allocation_identity(base + off)
                fd, exported = found.export()
                try:
                    assert fd >= 0 and exported == made
                finally:
                    os.close(fd)
        data = bytes((i * 13 + size) % 256 for i in range(4096))
        _copy_in(gpu, base + rounded - len(data), data)
        with Allocation.find(base + rounded - 1) as found:
            # The found allocation is a __cuda_array_interface__ over the segment.
            assert found.__cuda_array_interface__["data"][0] == base
            assert _copy_out(gpu, found.ptr + rounded - len(data), len(data)) == data
        lib.kvf_torch_free(base, size, 0, None)
        assert kt.allocator_stats() == before
        with pytest.raises(KvferryError):
            Allocation.find(base)


def test_gpu_a_found_allocation_keeps_the_memory_after_the_free(gpu):
    lib = _module()
    size = 8 << 20
    base = lib.kvf_torch_alloc(size, 0, None)
    assert base, kvferry._lib.last_error()
    data = os.urandom(1 << 16)
    _copy_in(gpu, base + size // 2, data)
    held = Allocation.find(base + size // 2)
    identity = held.identity
    lib.kvf_torch_free(base, size, 0, None)  # torch let go; the holder has not
    assert _copy_out(gpu, base + size // 2, len(data)) == data
    with Allocation.find(base) as again:
        assert again.identity == identity
    held.close()  # the last reference: unmapped now
    with pytest.raises(KvferryError):
        Allocation.find(base)


# ---- on a GPU, with torch -----------------------------------------------------------------

def test_gpu_torch_tensors_from_the_pool_are_found_with_their_segment_identity(gpu):
    torch = _torch_gpu()
    before = kt.allocator_stats()
    pool = kt.exportable_mem_pool(0)
    shapes = [(2, 256, 16, 8, 128), (2, 256, 16, 8, 128), (1000,), (3, 5), (2, 33, 16, 4, 64),
              (64 << 20,)]
    with torch.cuda.use_mem_pool(pool, device=0):
        tensors = [torch.full(s, i + 1, dtype=torch.bfloat16 if len(s) > 2 else torch.int8,
                              device="cuda:0") for i, s in enumerate(shapes)]
        # A view into the middle of a tensor: a pointer well inside a segment.
        tensors.append(tensors[0][1, 17:40])
    torch.cuda.synchronize()
    segments, nbytes = kt.allocator_stats()
    assert segments > before[0], "the pool allocated nothing through the allocator"
    g = kvferry.mem_granularity("cumem", 0)
    seen = {}
    for t in tensors:
        ptr = t.data_ptr()
        with Allocation.find(t) as found:
            made = kt.allocation_identity(ptr)
            assert found.identity == made, "find gave another identity than the allocator's"
            assert found.ptr <= ptr < found.ptr + found.size
            storage = t.untyped_storage()  # the whole block torch carved (a view's base)
            assert found.ptr <= storage.data_ptr()
            assert storage.data_ptr() + storage.nbytes() <= found.ptr + found.size
            assert found.size % g == 0 and found.size == made.size
            fd, exported = found.export()
            os.close(fd)
            assert exported == made
            # Coherent: the segment, viewed through the found allocation, holds
            # the tensor's bytes at the tensor's offset.
            whole = torch.as_tensor(found, device="cuda:0")
            off = ptr - found.ptr
            n = t.numel() * t.element_size() if t.is_contiguous() else 0
            if n:
                assert torch.equal(whole[off:off + n], t.view(-1).view(torch.uint8))
            seen[made.allocation_id] = (found.ptr, found.size)
    # torch's own view of the pool's segments agrees with kvferry's.
    snap = [s for s in pool.snapshot() if s.get("device", 0) == 0]
    by_address = {s["address"]: s for s in snap}
    for base, size in seen.values():
        assert base in by_address, "segment 0x%x is not in the pool's snapshot" % base
        assert by_address[base]["total_size"] <= size
    # Drop everything: the pool gives its segments back through kvf_torch_free.
    del tensors, whole, t, storage
    gc.collect()
    torch.cuda.synchronize()
    del pool
    gc.collect()
    torch.cuda.empty_cache()
    assert kt.allocator_stats() == before, "segments left after the pool was dropped"


def test_gpu_torch_pool_device_and_errors(gpu):
    torch = _torch_gpu()
    with pytest.raises(KvferryError) as e:
        kt.exportable_mem_pool(torch.cuda.device_count())
    assert e.value.status == Status.INVALID_ARGUMENT and e.value.field == "device"
    with pytest.raises(KvferryError) as e:
        kt.exportable_mem_pool("cpu")
    assert e.value.status == Status.INVALID_ARGUMENT
    pool = kt.exportable_mem_pool("cuda:0")
    assert pool._kvferry_device == 0
    with torch.cuda.use_mem_pool(pool, device=0):
        x = torch.empty(5 << 20, dtype=torch.uint8, device="cuda:0")
    with Allocation.find(x) as found:
        assert found.identity == kt.allocation_identity(x)
    # A cudaMalloc'd tensor (torch's default pool) is refused with advice.
    y = torch.empty(5 << 20, dtype=torch.uint8, device="cuda:0")
    with pytest.raises(KvferryError) as e:
        Allocation.find(y)
    assert e.value.status == Status.UNSUPPORTED
    with pytest.raises(KvferryError):
        kt.allocation_identity(y)
    del x, y
    # The docs' one-liner: the pool is dropped when the block ends, the
    # tensor keeps its segment, and the segment goes back once the tensor
    # is gone too.
    gc.collect()
    torch.cuda.empty_cache()
    before = kt.allocator_stats()
    with torch.cuda.use_mem_pool(kt.exportable_mem_pool(0), device=0):
        z = torch.zeros(3 << 20, dtype=torch.uint8, device="cuda:0")
    gc.collect()
    z += 1
    assert int(z.sum()) == 3 << 20
    with Allocation.find(z[(2 << 20):]) as found:
        assert found.identity == kt.allocation_identity(z)
        assert found.ptr <= z.data_ptr() < found.ptr + found.size
    assert kt.allocator_stats()[0] == before[0] + 1
    del z
    gc.collect()
    torch.cuda.empty_cache()
    assert kt.allocator_stats() == before, "the segment outlived its tensor and its pool"
