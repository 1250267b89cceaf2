"""Finding and loading libkvferry.so, and the C prototypes the package calls.

The library is looked for, in this order:

1. ``$KVF_LIBRARY``: a path to the library. When set, it is the only place
   tried (a wrong path is an error, never a silent fallback).
2. Next to the package: a ``libkvferry.so*`` copied into the installed
   ``kvferry/`` directory.
3. The build tree of the source checkout the package comes from (the package
   run from ``python/`` in the checkout, or installed from it with ``pip
   install ./python``, which records the checkout): ``build/`` and each
   directory below it that holds a build (``build/release`` and
   ``build/ci-release`` first). Builds made with ``KVF_SANITIZE`` are skipped
   unless the sanitizer runtime is already loaded (LD_PRELOAD).
4. The install prefix: ``lib/`` (and ``lib64/``) of ``sys.prefix``, of the
   interpreter's base prefix and of ``/usr/local``, then the dynamic loader's
   own search (``ctypes.util.find_library``, ``LD_LIBRARY_PATH``, ldconfig).

If none loads, ImportError says every place that was looked at and why it
did not do.

Modules that bind more of the C API (``kvferry.client`` later) declare their
functions with :func:`declare` and raise through :func:`check`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from ctypes import POINTER, c_char_p, c_int, c_size_t, c_uint, c_uint32, c_uint64, c_void_p
from pathlib import Path
from typing import Any, Callable, List, Optional, Sequence, Tuple

from . import _structs as S
from ._errors import KvferryError, Status, parse_field

PACKAGE_DIR = Path(__file__).resolve().parent
_SONAMES = ("libkvferry.so", "libkvferry.so.%d" % S.HEADER_VERSION[0])
_PREFERRED_BUILDS = ("release", "ci-release")


def source_roots() -> List[Path]:
    """kvferry source checkouts this package belongs to: the one around it
    (run from python/ in a checkout) and the one pip installed it from."""
    roots: List[Path] = []
    here = PACKAGE_DIR.parent.parent
    if (here / "include" / "kvferry" / "kvferry.h").is_file():
        roots.append(here)
    try:
        from . import _install_info  # type: ignore[attr-defined]  # written by setup.py
        recorded = Path(_install_info.SOURCE_ROOT)
        if (recorded / "include" / "kvferry" / "kvferry.h").is_file() and recorded not in roots:
            roots.append(recorded)
    except ImportError:
        pass
    return roots


def _sanitizer_loaded() -> bool:
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            text = maps.read()
    except OSError:
        return False
    return "libclang_rt.asan" in text or "libasan" in text


def _build_sanitizers(build_dir: Path) -> str:
    """KVF_SANITIZE of a CMake build directory ("" when none)."""
    try:
        with open(build_dir / "CMakeCache.txt", encoding="utf-8", errors="replace") as cache:
            for line in cache:
                if line.startswith("KVF_SANITIZE:"):
                    return line.split("=", 1)[1].strip()
    except OSError:
        pass
    return ""


def build_dirs(root: Path) -> List[Path]:
    """Build directories under root/build that hold libkvferry.so, in the
    order they are tried."""
    top = root / "build"
    found: List[Path] = []
    if (top / "libkvferry.so").exists():
        found.append(top)
    try:
        subdirs = sorted(p for p in top.iterdir() if p.is_dir())
    except OSError:
        subdirs = []
    subdirs.sort(key=lambda p: (_PREFERRED_BUILDS.index(p.name) if p.name in _PREFERRED_BUILDS
                                else len(_PREFERRED_BUILDS), p.name))
    for sub in subdirs:
        if (sub / "libkvferry.so").exists():
            found.append(sub)
    return found


def _candidates() -> List[Tuple[str, Optional[str]]]:
    """(place, path-or-soname) in search order; path None: nothing there."""
    out: List[Tuple[str, Optional[str]]] = []
    for name in sorted(os.listdir(PACKAGE_DIR)):
        if name.startswith("libkvferry.so"):
            out.append(("next to the package", str(PACKAGE_DIR / name)))
            break
    else:
        out.append(("next to the package (%s/libkvferry.so*)" % PACKAGE_DIR, None))
    roots = source_roots()
    if not roots:
        out.append(("a build tree (the package is not run from, or installed from, a kvferry "
                    "checkout)", None))
    for root in roots:
        dirs = build_dirs(root)
        if not dirs:
            out.append(("the build tree %s/build (no libkvferry.so built there)" % root, None))
        for d in dirs:
            san = _build_sanitizers(d)
            if san and not _sanitizer_loaded():
                out.append(("the build tree %s (skipped: built with KVF_SANITIZE=%s, which needs "
                            "the sanitizer runtime in LD_PRELOAD)" % (d, san), None))
                continue
            out.append(("the build tree", str(d / "libkvferry.so")))
    prefixes = [sys.prefix]
    if sys.base_prefix != sys.prefix:
        prefixes.append(sys.base_prefix)
    prefixes.append("/usr/local")
    for prefix in prefixes:
        for libdir in ("lib", "lib64"):
            path = Path(prefix) / libdir / "libkvferry.so"
            if path.exists():
                out.append(("the install prefix", str(path)))
            else:
                out.append(("the install prefix (%s: absent)" % path, None))
    found = ctypes.util.find_library("kvferry")
    out.append(("ctypes.util.find_library('kvferry')", found) if found
               else ("ctypes.util.find_library('kvferry') (found nothing)", None))
    out.append(("the dynamic loader's search path (LD_LIBRARY_PATH, ld.so.cache)", _SONAMES[1]))
    return out


def _load() -> Tuple[ctypes.CDLL, str]:
    env = os.environ.get("KVF_LIBRARY")
    if env:
        try:
            return ctypes.CDLL(env), env
        except OSError as exc:
            raise ImportError("kvferry: KVF_LIBRARY=%s cannot be loaded: %s (unset KVF_LIBRARY "
                              "to search the usual places)" % (env, exc)) from None
    tried: List[str] = ["$KVF_LIBRARY (not set)"]
    for place, path in _candidates():
        if path is None:
            tried.append(place)
            continue
        try:
            return ctypes.CDLL(path), path
        except OSError as exc:
            tried.append("%s: %s: %s" % (place, path, exc))
    raise ImportError(
        "kvferry: libkvferry.so not found. Build it (see README.md), then set KVF_LIBRARY to its "
        "path, copy it next to the package, or install it (cmake --install). Looked at:\n  "
        + "\n  ".join(tried))


lib, library_path = _load()
# libc's free, for the strings the library malloc's (kvf_geometry_to_json).
_libc = ctypes.CDLL(None)
free = _libc.free
free.argtypes = [c_void_p]
free.restype = None


# ---- errors ------------------------------------------------------------------

def last_error() -> str:
    """The calling thread's kvf_last_error() message."""
    raw = lib.kvf_last_error()
    return raw.decode("utf-8", errors="replace") if raw else ""


def error(status: int, geometry_error: Optional[S.kvf_geometry_error] = None) -> KvferryError:
    """A KvferryError for a failed C call, from kvf_last_error() (and the
    geometry error struct the call filled, when it takes one)."""
    message = last_error()
    field = group = layer = None
    if geometry_error is not None and geometry_error.status == status:
        field = S.text(geometry_error.field) or None
        if geometry_error.group >= 0:
            group = geometry_error.group
        if geometry_error.layer >= 0:
            layer = geometry_error.layer
        if not message:
            message = S.text(geometry_error.message)
    parsed = parse_field(message)
    if field is None:
        field = parsed
    elif parsed and len(parsed) > len(field) and parsed.endswith(field):
        field = parsed  # the loader's JSON path ("groups[0].layers[1].token_stride")
    return KvferryError(status, message, field=field, group=group, layer=layer)


def check(status: int, geometry_error: Optional[S.kvf_geometry_error] = None) -> None:
    """Raise KvferryError unless status is KVF_SUCCESS."""
    if status != 0:
        raise error(status, geometry_error)


def fail(status: Status, message: str, field: Optional[str] = None) -> KvferryError:
    """A KvferryError the package raises itself (argument checks), worded
    like the library's own: "field: message"."""
    return KvferryError(status, "%s: %s" % (field, message) if field else message, field=field)


def _errcheck(result: int, func: Any, args: Any) -> int:
    if result != 0:
        raise error(result)
    return result


def declare(name: str, restype: Any, argtypes: Sequence[Any], raises: bool = False) -> Callable:
    """Declare the prototype of lib.<name>. raises=True: the function returns
    a kvf_status and a failure raises KvferryError."""
    fn = getattr(lib, name)
    fn.restype = restype
    fn.argtypes = list(argtypes)
    if raises:
        fn.errcheck = _errcheck
    return fn


def status_fn(name: str, *argtypes: Any) -> Callable:
    """A kvf_status function that raises KvferryError when it fails."""
    return declare(name, c_int, argtypes, raises=True)


def plain_fn(name: str, restype: Any, *argtypes: Any) -> Callable:
    """A function whose result the caller interprets."""
    return declare(name, restype, argtypes)


VP = c_void_p
P = POINTER
u32, u64 = c_uint32, c_uint64

# status.h
plain_fn("kvf_status_string", c_char_p, c_int)
plain_fn("kvf_last_error", c_char_p)
plain_fn("kvf_version", c_uint)
plain_fn("kvf_version_string", c_char_p)

# geometry.h
status_fn("kvf_geometry_create", P(VP))
plain_fn("kvf_geometry_destroy", None, VP)
status_fn("kvf_geometry_add_region", VP, P(S.kvf_region_desc), P(u32))
status_fn("kvf_geometry_add_group", VP, P(S.kvf_group_desc), P(u32))
status_fn("kvf_geometry_add_view", VP, u32, P(S.kvf_view_desc), P(u32))
status_fn("kvf_geometry_set_policy", VP, P(S.kvf_object_policy))
status_fn("kvf_geometry_set_dcp", VP, u32, u32)
plain_fn("kvf_geometry_finalize", c_int, VP, P(S.kvf_geometry_error))
plain_fn("kvf_geometry_num_regions", u32, VP)
plain_fn("kvf_geometry_num_groups", u32, VP)
plain_fn("kvf_geometry_num_object_groups", u32, VP)
plain_fn("kvf_geometry_num_aliases", u32, VP)
status_fn("kvf_geometry_region", VP, u32, P(S.kvf_region_info))
status_fn("kvf_geometry_group", VP, u32, P(S.kvf_group_info))
status_fn("kvf_geometry_object_group", VP, u32, P(S.kvf_object_group_info))
status_fn("kvf_geometry_view", VP, u32, u32, P(S.kvf_view_desc))
status_fn("kvf_geometry_policy", VP, P(S.kvf_object_policy))
status_fn("kvf_geometry_dcp", VP, P(u32), P(u32))
plain_fn("kvf_geometry_fingerprint", u64, VP, c_int)
plain_fn("kvf_geometry_local_tokens", u64, VP, u64)
status_fn("kvf_geometry_local_blocks", VP, u32, u64, u64, P(u64), P(u64))
status_fn("kvf_geometry_retained_tokens", VP, u32, u64, P(u64))
status_fn("kvf_geometry_retained_blocks", VP, u32, u64, P(u64), P(u64))
status_fn("kvf_geometry_recurrent_state", VP, u64, P(u64))
status_fn("kvf_geometry_object_size", VP, u32, u64, u64, P(u64))
status_fn("kvf_geometry_object_segment", VP, c_int, u32, u32, u32, u64, P(u64), P(u64))
status_fn("kvf_object_header_init", VP, c_int, u32, u64, u64, P(S.kvf_object_header))
status_fn("kvf_object_header_check", VP, P(S.kvf_object_header), u32)
plain_fn("kvf_geometry_load_file", c_int, c_char_p, P(S.kvf_geometry_load_options), P(VP),
         P(S.kvf_geometry_error))
plain_fn("kvf_geometry_load_buffer", c_int, c_char_p, c_size_t, P(S.kvf_geometry_load_options),
         P(VP), P(S.kvf_geometry_error))
status_fn("kvf_geometry_to_json", VP, P(VP), P(c_size_t))
plain_fn("kvf_geometry_name", c_char_p, VP)
plain_fn("kvf_geometry_description", c_char_p, VP)
status_fn("kvf_geometry_set_name", VP, c_char_p, c_char_p)
plain_fn("kvf_group_kind_name", c_char_p, c_int)
plain_fn("kvf_object_format_name", c_char_p, c_int)

# copy.h
plain_fn("kvf_copy_request_chunks", u64, VP, P(S.kvf_copy_request))
status_fn("kvf_copy_request_check", VP, P(S.kvf_copy_request))
status_fn("kvf_reference_gather", VP, P(S.kvf_copy_request))
status_fn("kvf_reference_scatter", VP, P(S.kvf_copy_request))

# device.h (the probe's status is data, not an error)
plain_fn("kvf_cuda_probe", c_int, P(S.kvf_cuda_info))

# transfer.h
status_fn("kvf_xfer_create", VP, P(S.kvf_xfer_options), P(VP))
plain_fn("kvf_xfer_destroy", None, VP)
status_fn("kvf_xfer_gather", VP, P(S.kvf_copy_request), VP)
status_fn("kvf_xfer_scatter", VP, P(S.kvf_copy_request), VP)
status_fn("kvf_xfer_last_stats", VP, P(S.kvf_xfer_stats))
status_fn("kvf_xfer_gather_deferred", VP, P(S.kvf_copy_request), VP, P(u64))
status_fn("kvf_xfer_scatter_deferred", VP, P(S.kvf_copy_request), VP, P(u64))
status_fn("kvf_xfer_join", VP, u64, VP)
status_fn("kvf_xfer_query", VP, u64, P(c_int))
status_fn("kvf_xfer_flush", VP)
plain_fn("kvf_xfer_route_name", c_char_p, c_int)

# memory.h
status_fn("kvf_mem_instance_set", u64, u64)
status_fn("kvf_mem_instance", P(u64), P(u64))
status_fn("kvf_mem_granularity", c_int, c_int, P(u64))
status_fn("kvf_mem_alloc_create", P(S.kvf_mem_alloc_options), P(VP))
status_fn("kvf_mem_alloc_find", c_int, VP, P(VP))
plain_fn("kvf_mem_alloc_destroy", None, VP)
plain_fn("kvf_mem_alloc_ptr", VP, VP)
plain_fn("kvf_mem_alloc_size", u64, VP)
status_fn("kvf_mem_alloc_identity", VP, P(S.kvf_mem_identity))
status_fn("kvf_mem_alloc_export", VP, P(c_int), P(S.kvf_mem_identity))
status_fn("kvf_mem_device_from_uuid", c_char_p, P(c_int))
plain_fn("kvf_mem_identity_format", c_char_p, P(S.kvf_mem_identity), c_char_p, c_size_t)

# topology.h
status_fn("kvf_topology_create", P(VP))
plain_fn("kvf_topology_destroy", None, VP)
status_fn("kvf_topology_info_get", VP, P(S.kvf_topology_info))
status_fn("kvf_topology_numa_node", VP, u32, P(S.kvf_numa_node_info))
status_fn("kvf_topology_gpu", VP, u32, P(S.kvf_gpu_placement))


def _check_version() -> None:
    number = lib.kvf_version()
    have = (number // 10000, number // 100 % 100, number % 100)
    want = S.HEADER_VERSION
    # Until 1.0 a minor release may change structs: major and minor must match.
    if have[:2] != want[:2]:
        raise ImportError(
            "kvferry: %s is version %d.%d.%d, but this package mirrors the %d.%d headers: "
            "install the package from the same kvferry source as the library"
            % ((library_path,) + have + want[:2]))


_check_version()
