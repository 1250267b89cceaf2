"""The ctypes mirrors (kvferry/_structs.py) against the C headers.

layout_dump (tests/python/layout_dump.c, built with the test suite) prints
sizeof, alignment and every field's offset and size of each public struct,
the bytes of every _INIT macro, every enum value and the constants the
package mirrors. These tests compare all of it with the package, and check
that layout_dump's lists name every struct, field and enum value the headers
declare: a header change not carried into the package fails here, naming
what differs and where to fix it.
"""

import ctypes
import re

import pytest

from conftest import ROOT

import kvferry
from kvferry import _structs as S
from kvferry.geometry import GroupKind, ObjectFormat
from kvferry.memory import MemProvider
from kvferry.transfer import Route
from kvferry.client import Op, Outcome

HEADERS = sorted((ROOT / "include" / "kvferry").glob("*.h"))
FIX = ("update tests/python/layout_dump.c and python/kvferry/_structs.py (and the Python "
       "wrapper that fills or reads the struct)")

# C enum -> (Python enum, how a member's C name is made).
ENUMS = {
    "kvf_status": (kvferry.Status,
                   lambda m: "KVF_SUCCESS" if m == "SUCCESS" else "KVF_ERR_" + m),
    "kvf_group_kind": (GroupKind, lambda m: "KVF_GROUP_" + m),
    "kvf_object_format": (ObjectFormat, lambda m: "KVF_FORMAT_" + m),
    "kvf_xfer_route": (Route, lambda m: "KVF_ROUTE_" + m),
    "kvf_mem_provider": (MemProvider, lambda m: "KVF_MEM_PROVIDER_" + m),
    "kvf_client_outcome": (Outcome, lambda m: "KVF_CLIENT_" + m),
    "kvf_client_op": (Op, lambda m: "KVF_CLIENT_" + m),
}


def _strip_comments(text):
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", " ", text)


def header_structs():
    """{struct: [field, ...]} of every struct with a body in the headers:
    typedef'd ones by their typedef name, tag-only ones (``struct X {...};``,
    whose name a function takes, as with struct stat) by their tag."""
    out = {}
    for path in HEADERS:
        text = _strip_comments(path.read_text())
        found = [(m.group(3), m.group(2)) for m in
                 re.finditer(r"typedef\s+struct\s+(\w+)\s*\{(.*?)\}\s*(\w+)\s*;", text, re.S)]
        found += [(m.group(1), m.group(2)) for m in
                  re.finditer(r"\bstruct\s+(\w+)\s*\{([^{}]*)\}\s*;", text)
                  if not text[:m.start()].rstrip().endswith("typedef")]
        for name, body in found:
            fields = []
            for decl in body.split(";"):
                decl = re.sub(r"\[[^\]]*\]", "", decl).strip()
                if not decl:
                    continue
                for part in decl.split(","):
                    names = re.findall(r"[A-Za-z_]\w*", part)
                    fields.append(names[-1])
            out[name] = (fields, path.name)
    return out


def header_enums():
    """{enum: [member, ...]} of every typedef'd enum in the headers."""
    out = {}
    for path in HEADERS:
        text = _strip_comments(path.read_text())
        for m in re.finditer(r"typedef\s+enum\s+(\w+)\s*\{(.*?)\}\s*(\w+)\s*;", text, re.S):
            members = [re.match(r"\s*(\w+)", item).group(1)
                       for item in m.group(2).split(",") if item.strip()]
            out[m.group(3)] = (members, path.name)
    return out


def test_headers_are_parsed():
    structs = header_structs()
    assert "kvf_view_desc" in structs and "kvf_gpu_placement" in structs
    assert structs["kvf_client_register_desc"][0][-2:] == ["shard_index", "shard_count"]
    assert structs["kvf_client_stats"][0][3:6] == ["registering", "active", "draining"]
    assert "kvf_status" in header_enums()


def test_layout_dump_lists_every_header_struct_and_field(layout_dump):
    problems = []
    dumped = layout_dump["structs"]
    for name, (fields, header) in sorted(header_structs().items()):
        if name not in dumped:
            problems.append("%s (%s) is not listed in layout_dump.c" % (name, header))
            continue
        listed = [f[0] for f in dumped[name]["fields"]]
        if listed != fields:
            problems.append("%s: the header (%s) has fields %s, layout_dump.c lists %s"
                            % (name, header, fields, listed))
    for name in dumped:
        if name not in header_structs():
            problems.append("layout_dump.c lists %s, which no header declares" % name)
    assert not problems, "\n".join(problems + [FIX])


def test_every_struct_is_bound_or_known_unbound(layout_dump):
    problems = []
    for name in layout_dump["structs"]:
        if name not in S.STRUCTS and name not in S.UNBOUND:
            problems.append("%s: neither a ctypes struct in _structs.STRUCTS nor listed in "
                            "_structs.UNBOUND" % name)
    for name in S.STRUCTS:
        if name not in layout_dump["structs"]:
            problems.append("_structs.%s mirrors no struct layout_dump.c lists" % name)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("name", sorted(S.STRUCTS))
def test_struct_layout_matches_header(layout_dump, name):
    c = layout_dump["structs"][name]
    cls = S.STRUCTS[name]
    problems = []
    py_fields = [(f[0], getattr(cls, f[0]).offset, getattr(cls, f[0]).size) for f in cls._fields_]
    c_fields = [tuple(f) for f in c["fields"]]
    py_names = [f[0] for f in py_fields]
    c_names = [f[0] for f in c_fields]
    for f in c_names:
        if f not in py_names:
            problems.append("field %s is in the C struct, missing from the ctypes struct" % f)
    for f in py_names:
        if f not in c_names:
            problems.append("field %s is in the ctypes struct, not in the C struct" % f)
    if not problems and py_names != c_names:
        problems.append("fields in a different order: C %s, ctypes %s" % (c_names, py_names))
    for (fname, off, size) in c_fields:
        for (pname, poff, psize) in py_fields:
            if pname == fname and (poff, psize) != (off, size):
                problems.append("field %s: C offset %d size %d, ctypes offset %d size %d"
                                % (fname, off, size, poff, psize))
    if ctypes.sizeof(cls) != c["size"]:
        problems.append("sizeof: C %d, ctypes %d" % (c["size"], ctypes.sizeof(cls)))
    if ctypes.alignment(cls) != c["align"]:
        problems.append("alignment: C %d, ctypes %d" % (c["align"], ctypes.alignment(cls)))
    assert not problems, "%s:\n  %s\n%s" % (name, "\n  ".join(problems), FIX)


def test_init_matches_init_macros(layout_dump):
    problems = []
    for name, defaults in sorted(layout_dump["defaults"].items()):
        cls = S.STRUCTS.get(name)
        if cls is None:
            continue  # unbound (checked below)
        raw = bytes(cls.init())
        for fname, hexbytes in defaults["fields"].items():
            field = getattr(cls, fname)
            got = raw[field.offset:field.offset + field.size].hex()
            if got != hexbytes:
                problems.append("%s.%s: %s gives %s, %s.init() gives %s (update _defaults_ in "
                                "_structs.py)" % (name, fname, defaults["macro"], hexbytes, name, got))
    assert not problems, "\n".join(problems)


def test_every_init_macro_is_mirrored(layout_dump):
    missing = [n for n in layout_dump["defaults"] if n not in S.STRUCTS and n not in S.UNBOUND]
    assert not missing


def test_enums_match_headers(layout_dump):
    problems = []
    dumped = layout_dump["enums"]
    for name, (members, header) in sorted(header_enums().items()):
        if name not in dumped:
            problems.append("enum %s (%s) is not listed in layout_dump.c" % (name, header))
        elif list(dumped[name]) != members:
            problems.append("enum %s: the header has %s, layout_dump.c lists %s"
                            % (name, members, list(dumped[name])))
    for name, values in sorted(dumped.items()):
        if name in S.UNBOUND_ENUMS:
            continue
        if name not in ENUMS:
            problems.append("enum %s has no Python mirror (add it to ENUMS here and to the "
                            "package, or to _structs.UNBOUND_ENUMS)" % name)
            continue
        cls, cname = ENUMS[name]
        py = {cname(m.name): int(m) for m in cls}
        if py != values:
            problems.append("enum %s: C %s, Python %s.%s %s" % (name, values, cls.__module__,
                                                                cls.__name__, py))
    assert not problems, "\n".join(problems)


def test_constants_match_headers(layout_dump):
    c = layout_dump["constants"]
    problems = ["%s: C %s, Python %s" % (k, c.get(k), v) for k, v in S.CONSTANTS.items()
                if c.get(k) != v]
    problems += ["%s is in layout_dump.c but not in _structs.CONSTANTS" % k
                 for k in c if k not in S.CONSTANTS]
    assert not problems, "\n".join(problems)


def test_library_version_is_the_headers_version(layout_dump):
    c = layout_dump["constants"]
    headers = (c["KVF_VERSION_MAJOR"], c["KVF_VERSION_MINOR"], c["KVF_VERSION_PATCH"])
    assert kvferry.HEADER_VERSION == headers
    assert kvferry.version_info() == headers
    assert kvferry.version() == "%d.%d.%d" % headers


def test_python_defaults_are_the_init_macros():
    # What the builders put in a descriptor when given nothing is what the
    # _INIT macro gives (which test_init_matches_init_macros ties to C).
    import inspect
    view, _ = kvferry.View()._to_c()
    assert bytes(view) == bytes(S.kvf_view_desc.init())
    assert bytes(kvferry.Policy()._to_c()) == bytes(S.kvf_object_policy.init())
    region = inspect.signature(kvferry.Geometry.add_region).parameters
    r = S.kvf_region_desc.init()
    assert (region["size"].default, region["align"].default) == (r.size, r.align)
    group = inspect.signature(kvferry.Geometry.add_group).parameters
    d = S.kvf_group_desc.init()
    assert (int(group["kind"].default), group["block_size"].default, group["num_blocks"].default,
            group["window"].default, group["chunk"].default) == (d.kind, d.block_size,
                                                                  d.num_blocks, d.window, d.chunk)
    xfer = inspect.signature(kvferry.Transfer).parameters
    o = S.kvf_xfer_options.init()
    assert (xfer["device"].default, xfer["max_sms"].default, xfer["host_threads"].default) == (
        o.device, o.max_sms, o.host_threads)
