"""The kvferryd client (kvferry/client.h): share an engine's KV cache with a
kvferryd server on the same machine.

A :class:`Client` connects to the server's socket directory, registers a
geometry with the exported allocations behind its regions (their file
descriptors travel over the socket), then STOREs blocks of the cache into the
server's L1 object store and RETRIEVEs them into other blocks, by chunk keys
(:func:`chunk_keys`). Everything goes through libkvferry's ``kvf_client_*``
functions; nothing here speaks the wire protocol itself.

Errors raise :class:`kvferry.KvferryError` with the status and the field the
library or the server named (``"xfer.groups[0].block_ids[3]"``,
``"xfer.num_chunk_keys"``).

Threading: one client may be used from any number of threads at once
(replies are matched to requests by id; ctypes releases the GIL during each
call). ``close()`` waits for the calls in flight on other threads first.

Chunk keys are ``bytes`` of 32 (KEY_BYTES): SHA-256 chains from
:func:`chunk_seed` and :func:`chunk_keys`, or an engine's own 32-byte block
hashes (vLLM's SHA-256 block hashes) passed as they are. The server files
objects under (key, object group, geometry fingerprint, shard), so the seed
names the model, not the shard.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import os
import sys
from ctypes import POINTER, byref, c_char_p, c_int, c_size_t, c_uint32, c_uint64, c_void_p
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

from . import _lib
from . import _structs as S
from ._buffers import as_buffer, block_ids as _block_ids
from ._errors import KvferryError, Status
from ._handle import Handle, HandleOwner
from ._lib import fail, lib
from .copy import BlockTable
from .geometry import Geometry, ObjectFormat
from .memory import Allocation

__all__ = ["Client", "ClientInfo", "Registration", "Result", "Outcome", "Op", "Stats",
           "ClientRecord", "LookupResult", "PushResult", "PeerRecord", "chunk_seed", "chunk_keys",
           "KEY_BYTES", "READY_EVENT_BYTES", "has_lookup", "has_push"]

#: Bytes of one chunk key (kvf_chunk_key).
KEY_BYTES: int = S.CHUNK_KEY_BYTES
#: Bytes of a ready event (a cudaIpcEventHandle_t).
READY_EVENT_BYTES = 64
_MAX_RECORDS = 1024  # STAT sends at most this many client records


# ---- prototypes ----------------------------------------------------------------------

def _declare_optional(name: str, restype: Any, *argtypes: Any) -> Optional[Callable]:
    """A function the library may not have yet (a newer client API)."""
    if not hasattr(lib, name):
        return None
    return _lib.declare(name, restype, argtypes)


_P = POINTER
_lib.plain_fn("kvf_client_connect", c_int, _P(S.kvf_client_options), _P(c_void_p),
              _P(S.kvf_client_info))
_lib.plain_fn("kvf_client_register", c_int, c_void_p, c_char_p, c_size_t, c_int,
              _P(S.kvf_client_region), c_uint32, _P(S.kvf_client_registration))
_lib.plain_fn("kvf_client_unregister", c_int, c_void_p, c_uint64, _P(c_uint32))
_lib.plain_fn("kvf_client_heartbeat", c_int, c_void_p, _P(c_uint64))
_lib.plain_fn("kvf_client_stat", c_int, c_void_p, _P(S.kvf_client_stats))
_lib.plain_fn("kvf_client_stat_clients", c_int, c_void_p, _P(S.kvf_client_stats),
              _P(S.kvf_client_stat_record), c_uint32, _P(c_uint32))
_lib.plain_fn("kvf_client_submit", c_int, c_void_p, c_int, _P(S.kvf_client_xfer), _P(c_uint64))
_lib.plain_fn("kvf_client_wait", c_int, c_void_p, c_uint64, c_uint32, _P(S.kvf_client_result))
_lib.plain_fn("kvf_client_store", c_int, c_void_p, _P(S.kvf_client_xfer), _P(S.kvf_client_result))
_lib.plain_fn("kvf_client_retrieve", c_int, c_void_p, _P(S.kvf_client_xfer),
              _P(S.kvf_client_result))
_lib.plain_fn("kvf_client_server_restarted", c_int, c_void_p)
_lib.plain_fn("kvf_client_disconnect", None, c_void_p)
_lib.plain_fn("kvf_client_register_desc", c_int, c_void_p, _P(S.kvf_client_register_desc),
              _P(S.kvf_client_registration))
_lib.plain_fn("kvf_chunk_seed", c_int, c_void_p, c_size_t, _P(S.kvf_chunk_key))
_lib.plain_fn("kvf_chunk_keys", c_uint64, _P(S.kvf_chunk_key), c_void_p, c_uint32, c_uint64,
              c_uint32, c_void_p)
# LOOKUP and retirement (api-plan.md, i13-lookup): bound when the library has them.
_lookup = _declare_optional("kvf_client_lookup", c_int, c_void_p, c_void_p, c_void_p)
_unpin = _declare_optional("kvf_client_unpin", c_int, c_void_p, c_uint64)
_wait_retired = _declare_optional("kvf_client_wait_retired", c_int, c_void_p, c_uint64, c_uint32)
_push = _declare_optional("kvf_client_push", c_int, c_void_p, c_void_p, c_void_p)
_stat_peers = _declare_optional("kvf_client_stat_peers", c_int, c_void_p, c_void_p, c_uint32, c_void_p)


def has_push() -> bool:
    """Whether the loaded library has PUSH and STAT's peer records
    (kvf_client_push, kvf_client_stat_peers; docs/peers.md)."""
    return _push is not None and _stat_peers is not None


def has_lookup() -> bool:
    """True when the library has LOOKUP, unpin and wait_retired (kvf_client_lookup)."""
    return _lookup is not None and _unpin is not None and _wait_retired is not None


def _unsupported(what: str, needs: str) -> KvferryError:
    return fail(Status.UNSUPPORTED, "this libkvferry (%s) has no %s: it needs a library with "
                "%s" % (_lib.library_path, what, needs), what)


def _check(status: int) -> None:
    if status != 0:
        raise _lib.error(status)


# ---- results -------------------------------------------------------------------------

class Outcome(enum.IntEnum):
    """kvf_client_outcome: how a STORE or RETRIEVE ended."""

    DONE = 1
    FAILED = 2
    CANCELLED = 3
    TIMED_OUT = 4  #: the server stopped waiting; the work may still touch the blocks


class Op(enum.IntEnum):
    """kvf_client_op."""

    STORE = 1
    RETRIEVE = 2

    @classmethod
    def parse(cls, value: Union["Op", str, int]) -> "Op":
        if isinstance(value, cls):
            return value
        if isinstance(value, str) and value.upper() in cls.__members__:
            return cls[value.upper()]
        if isinstance(value, int) and not isinstance(value, bool) and value in (1, 2):
            return cls(value)
        raise fail(Status.INVALID_ARGUMENT, "%r is not 'store' or 'retrieve'" % (value,), "op")


@dataclass(frozen=True)
class ClientInfo:
    """What the server said at connect (kvf_client_info)."""

    client_id: int             #: the server's name for this connection
    boot_token: int            #: changes when the server restarts
    server_pid: int
    heartbeat_period_ms: int   #: send a heartbeat at least this often
    heartbeat_timeout_ms: int  #: silent longer than this: reaped
    protocol_version: int


@dataclass(frozen=True)
class Registration:
    """What a registration got (kvf_client_registration)."""

    registration_id: int
    fingerprint: int  #: the server's canonical fingerprint of the geometry
    imports: int      #: mappings the server holds for this client
    aliases: int      #: views of this client's active registration


@dataclass(frozen=True)
class Result:
    """A STORE's or RETRIEVE's outcome (kvf_client_result).

    ``prefix_tokens``: STORE: tokens [token_begin, prefix_tokens) now held for
    every object group; RETRIEVE: tokens restored in every group (token_begin:
    a miss). ``objects_present``: STORE: objects already held, not written
    again. ``object_group_prefix``: RETRIEVE: the longest prefix each object
    group holds.
    """

    status: Union[Status, int]
    outcome: Union[Outcome, int]
    prefix_tokens: int
    objects_done: int
    objects_present: int
    bytes_done: int
    group_blocks: Tuple[int, ...]
    object_group_prefix: Tuple[int, ...]

    @property
    def done(self) -> bool:
        """True when the request was done (outcome DONE)."""
        return self.outcome == Outcome.DONE

    @classmethod
    def _from_c(cls, r: S.kvf_client_result) -> "Result":
        try:
            status: Union[Status, int] = Status(r.status)
        except ValueError:
            status = r.status
        try:
            outcome: Union[Outcome, int] = Outcome(r.outcome)
        except ValueError:
            outcome = r.outcome
        ng = min(r.num_groups, S.MAX_GROUPS)
        nog = min(r.num_object_groups, S.MAX_GROUPS)
        return cls(status, outcome, r.prefix_tokens, r.objects_done, r.objects_present,
                   r.bytes_done, tuple(r.group_blocks[:ng]), tuple(r.object_group_prefix[:nog]))


@dataclass(frozen=True)
class Stats:
    """The server's counters (kvf_client_stats, STAT)."""

    boot_token: int
    registering: int
    active: int
    draining: int
    closed_total: int
    failed_total: int
    imports: int
    aliases: int
    leases: int
    l1_objects: int       #: objects committed in the server's L1
    l1_bytes: int         #: their payload
    l1_pool_bytes: int    #: L1 memory over every lane
    l1_evicted_total: int
    stores_total: int
    retrieves_total: int
    in_flight: int
    lanes: int            #: one per GPU served, plus the host lane

    @classmethod
    def _from_c(cls, s: S.kvf_client_stats) -> "Stats":
        return cls(*(getattr(s, f) for f in cls.__dataclass_fields__))


@dataclass(frozen=True)
class ClientRecord:
    """One connected client in STAT (kvf_client_stat_record)."""

    client_id: int
    pid: int
    name: str
    registering: int
    active: int
    draining: int
    imports: int
    aliases: int
    leases: int

    @classmethod
    def _from_c(cls, r: S.kvf_client_stat_record) -> "ClientRecord":
        return cls(r.client_id, r.pid, S.text(r.name), r.registering, r.active, r.draining,
                   r.imports, r.aliases, r.leases)


@dataclass(frozen=True)
class LookupResult:
    """What a LOOKUP found (kvf_client_lookup_result): ``prefix_tokens`` is
    what a RETRIEVE of the same range would restore in every group;
    ``pin_id`` 0 when nothing was pinned."""

    prefix_tokens: int
    object_group_prefix: Tuple[int, ...]
    pin_id: int
    pinned_chunks: int


@dataclass(frozen=True)
class PushResult:
    """What a PUSH did (kvf_client_push_result): objects copied to the peer
    and committed there, held there already, not held here, refused or
    failed; ``chunks_on_peer`` leading chunks of the range are whole on the
    peer now."""

    objects_pushed: int
    objects_present: int
    objects_missing: int
    objects_failed: int
    bytes_pushed: int
    chunks_on_peer: int


@dataclass(frozen=True)
class PeerRecord:
    """One kvferryd peer in STAT (kvf_client_peer_record, docs/peers.md):
    ``state`` is "down", "handshake" or "ready"; ``boot_token`` names the
    peer for :meth:`Client.push` when it connected to this server."""

    addr: str
    state: str
    outgoing: bool
    boot_token: int
    connects: int
    objects_pulled: int
    bytes_pulled: int
    objects_served: int
    failures: int
    objects_pushed: int
    bytes_pushed: int

    @classmethod
    def _from_c(cls, r: S.kvf_client_peer_record) -> "PeerRecord":
        states = ("down", "handshake", "ready")
        return cls(S.text(r.addr), states[r.state] if r.state < 3 else "down", bool(r.outgoing),
                   r.boot_token, r.connects, r.objects_pulled, r.bytes_pulled, r.objects_served,
                   r.failures, r.objects_pushed, r.bytes_pushed)


# ---- chunk keys ----------------------------------------------------------------------

def chunk_seed(data: Union[bytes, bytearray, memoryview, str]) -> bytes:
    """The 32-byte seed of a chain of chunk keys (kvf_chunk_seed):
    SHA-256("kvferry-seed-v1" || data). Fold in everything that makes the
    cache bytes differ for the same tokens: the model, the tokenizer, extra
    keys (LoRA, multimodal hashes); the server scopes objects by geometry
    fingerprint and shard itself. A str is encoded as UTF-8."""
    raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    out = S.kvf_chunk_key()
    buf = ctypes.create_string_buffer(raw, len(raw)) if raw else None
    _check(lib.kvf_chunk_seed(buf, len(raw), byref(out)))
    return bytes(out)


_TOKEN_TYPES = {(4, "i"): ctypes.c_int32, (4, "u"): ctypes.c_uint32,
                (8, "i"): ctypes.c_int64, (8, "u"): ctypes.c_uint64}


def _tokens(tokens: Any, token_bytes: Optional[int]) -> Tuple[Any, int, int]:
    """(pointer-able buffer, count, token_bytes) of a token sequence or array."""
    if token_bytes is not None and token_bytes not in (4, 8):
        raise fail(Status.INVALID_ARGUMENT, "%r: tokens are 4 or 8 bytes" % (token_bytes,),
                   "token_bytes")
    np = sys.modules.get("numpy")
    if np is not None and isinstance(tokens, np.ndarray):
        a = tokens
        if a.ndim != 1 or a.dtype.kind not in "iu":
            raise fail(Status.INVALID_ARGUMENT, "a 1-D integer array is required (shape %s, "
                       "dtype %s)" % (a.shape, a.dtype), "tokens")
        width = token_bytes or (a.dtype.itemsize if a.dtype.itemsize in (4, 8) else 4)
        if a.dtype.itemsize != width:
            target = np.dtype("%s%d" % (a.dtype.kind, width))
            if a.size and (a.min() < np.iinfo(target).min or a.max() > np.iinfo(target).max):
                raise fail(Status.INVALID_ARGUMENT, "values do not fit in %d bytes" % width,
                           "tokens")
            a = a.astype(target)
        a = np.ascontiguousarray(a)
        return a, int(a.size), width
    if not isinstance(tokens, (list, tuple, range)) and any(
            hasattr(tokens, x) for x in ("__dlpack__", "__array_interface__")):
        view = as_buffer(tokens, "tokens")
        if not view.host_accessible or len(view.shape) != 1 or view.kind not in "iu":
            raise fail(Status.INVALID_ARGUMENT, "a 1-D integer array in host memory is "
                       "required (%s on %s)" % (view.dtype, view.where), "tokens")
        ctype = _TOKEN_TYPES.get((view.itemsize, view.kind))
        n, step = view.shape[0], view.strides[0]
        if ctype is not None and step == view.itemsize and token_bytes in (None, view.itemsize):
            return view, n, view.itemsize
        tokens = [int.from_bytes(ctypes.string_at(view.ptr + i * step, view.itemsize), "little",
                                 signed=view.kind == "i") for i in range(n)]
    values = list(tokens)
    width = token_bytes or 4
    ctype = ctypes.c_int32 if width == 4 else ctypes.c_int64
    lo, hi = -(1 << (8 * width - 1)), (1 << (8 * width)) - 1
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, int):
            try:
                v = values[i] = int(v.__index__())
            except (AttributeError, TypeError):
                raise fail(Status.INVALID_ARGUMENT, "%r is not an int" % (v,),
                           "tokens[%d]" % i) from None
        if not lo <= v <= hi:
            raise fail(Status.INVALID_ARGUMENT, "%d does not fit in %d bytes (pass token_bytes=8)"
                       % (v, width), "tokens[%d]" % i)
        if v >= 1 << (8 * width - 1):
            values[i] = v - (1 << (8 * width))
    arr = (ctype * len(values))(*values)
    return arr, len(values), width


def _ptr(buf: Any) -> Optional[int]:
    np = sys.modules.get("numpy")
    if np is not None and isinstance(buf, np.ndarray):
        return buf.ctypes.data or None
    if hasattr(buf, "ptr") and hasattr(buf, "shape"):  # a BufferView
        return buf.ptr or None
    return ctypes.addressof(buf) if len(buf) else None


def chunk_keys(seed: bytes, tokens: Any, chunk_tokens: int = 256,
               token_bytes: Optional[int] = None) -> List[bytes]:
    """Chained prefix keys (kvf_chunk_keys): key k names chunk k of tokens,
    ``ceil(len(tokens) / chunk_tokens)`` keys. Equal prefixes give equal keys.

    Args:
        seed: ``chunk_seed(...)``: 32 bytes, not all zero.
        tokens: a sequence of ints, or a 1-D integer array (numpy, or anything
            with the array interface or DLPack) in host memory.
        chunk_tokens: tokens per chunk: the geometry's policy chunk_tokens.
        token_bytes: bytes per token hashed, 4 or 8. Default: an array's own
            width (4 or 8; narrower arrays widen to 4), 4 (int32) for a
            sequence. The width is part of the key: hash the same token ids
            with the same width everywhere.

    Returns a list of ``bytes`` of KEY_BYTES, as docs/protocol.md's test
    vector shows (SHA-256 of the previous key and the chunk's token bytes).
    """
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or \
            not 0 < chunk_tokens <= S.MAX_CHUNK_TOKENS:
        raise fail(Status.INVALID_ARGUMENT, "%r is not in 1..%d" % (chunk_tokens,
                                                                    S.MAX_CHUNK_TOKENS),
                   "chunk_tokens")
    buf, n, width = _tokens(tokens, token_bytes)
    if n == 0:
        return []
    count = (n + chunk_tokens - 1) // chunk_tokens
    raw = bytes(seed) if isinstance(seed, (bytes, bytearray, memoryview)) else None
    if raw is None or len(raw) != KEY_BYTES or not any(raw):
        raise fail(Status.INVALID_ARGUMENT, "a seed is %d bytes, not all zero (chunk_seed())"
                   % KEY_BYTES, "seed")
    seed_buf = S.kvf_chunk_key.from_buffer_copy(raw)
    out = (ctypes.c_uint8 * (KEY_BYTES * count))()
    got = lib.kvf_chunk_keys(byref(seed_buf), _ptr(buf), width, n, chunk_tokens, out)
    if got != count:
        raise fail(Status.INVALID_ARGUMENT, "kvf_chunk_keys wrote %d keys, expected %d"
                   % (got, count), "tokens")
    data = bytes(out)
    return [data[i * KEY_BYTES:(i + 1) * KEY_BYTES] for i in range(count)]


def _keys_array(keys: Any) -> Tuple[Any, int]:
    """(ctypes array, count) of chunk keys for a request."""
    if keys is None:
        raise fail(Status.INVALID_ARGUMENT, "required", "keys")
    np = sys.modules.get("numpy")
    if isinstance(keys, (bytes, bytearray, memoryview)):
        raw = bytes(keys)
        if len(raw) % KEY_BYTES:
            raise fail(Status.INVALID_ARGUMENT, "%d bytes is not a whole number of %d-byte keys"
                       % (len(raw), KEY_BYTES), "keys")
        n = len(raw) // KEY_BYTES
    elif np is not None and isinstance(keys, np.ndarray):
        if keys.dtype != np.uint8 or keys.ndim != 2 or keys.shape[1] != KEY_BYTES:
            raise fail(Status.INVALID_ARGUMENT, "an array of keys is uint8 of shape (n, %d), not "
                       "%s %s" % (KEY_BYTES, keys.dtype, keys.shape), "keys")
        raw = np.ascontiguousarray(keys).tobytes()
        n = keys.shape[0]
    else:
        parts = []
        for i, k in enumerate(keys):
            if not isinstance(k, (bytes, bytearray, memoryview)) or len(bytes(k)) != KEY_BYTES:
                raise fail(Status.INVALID_ARGUMENT, "%r is not a chunk key (bytes of %d)"
                           % (k, KEY_BYTES), "keys[%d]" % i)
            parts.append(bytes(k))
        raw = b"".join(parts)
        n = len(parts)
    arr = (ctypes.c_uint8 * max(len(raw), 1)).from_buffer_copy(raw.ljust(1, b"\0"))
    return arr, n


# ---- the client ----------------------------------------------------------------------

RegionLike = Union[Allocation, Tuple[Allocation, int], Tuple[Allocation, int, int]]


class _Xfer:
    """A kvf_client_xfer with everything it points to kept alive."""

    __slots__ = ("c", "keep")

    def __init__(self, token_begin: int, token_end: int, keys: Any, blocks: Sequence[Any],
                 format: Union[ObjectFormat, str, int], ready_event: Any,
                 registration_id: int) -> None:
        keep: List[Any] = []
        c = S.kvf_client_xfer.init()
        c.registration_id = _u64(registration_id, "registration_id")
        c.token_begin = _u64(token_begin, "token_begin")
        c.token_end = _u64(token_end, "token_end")
        c.format = _format(format)
        karr, nkeys = _keys_array(keys)
        keep.append(karr)
        c.chunk_keys = ctypes.cast(karr, c_void_p)
        c.num_chunk_keys = nkeys
        if isinstance(blocks, (str, bytes)) or not hasattr(blocks, "__len__"):
            raise fail(Status.INVALID_ARGUMENT, "one entry per group of the geometry is required "
                       "(None, block ids, or (block ids, first_block))", "blocks")
        entries = list(blocks)
        groups = (S.kvf_group_blocks * max(len(entries), 1))()
        for gi, entry in enumerate(entries):
            ids, first = _split_entry(entry, gi)
            ptr, count, k = _block_ids(ids, "blocks[%d]" % gi)
            groups[gi].block_ids = ptr
            groups[gi].first_block = first
            groups[gi].count = count
            keep.append(k)
        keep.append(groups)
        c.groups = ctypes.cast(groups, POINTER(S.kvf_group_blocks))
        c.num_groups = len(entries)
        if ready_event is not None:
            raw = bytes(ready_event)
            if len(raw) != READY_EVENT_BYTES:
                raise fail(Status.INVALID_ARGUMENT, "%d bytes, a cudaIpcEventHandle_t has %d"
                           % (len(raw), READY_EVENT_BYTES), "ready_event")
            ev = ctypes.create_string_buffer(raw, READY_EVENT_BYTES)
            keep.append(ev)
            c.ready_event = ctypes.cast(ev, c_void_p)
        self.c = c
        self.keep = keep


def _split_entry(entry: Any, gi: int) -> Tuple[Any, int]:
    """(block ids, first_block) of one group's entry."""
    if entry is None:
        return None, 0
    if isinstance(entry, BlockTable):
        return entry.block_ids, entry.first_block
    if isinstance(entry, tuple) and len(entry) == 2 and not isinstance(entry[0], int) and \
            isinstance(entry[1], int) and not isinstance(entry[1], bool):
        if entry[1] < 0:
            raise fail(Status.INVALID_ARGUMENT, "%d is negative" % entry[1],
                       "blocks[%d].first_block" % gi)
        return entry[0], entry[1]
    return entry, 0


def _u64(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            value = value.__index__()
        except (AttributeError, TypeError):
            raise fail(Status.INVALID_ARGUMENT, "%r is not an int" % (value,), what) from None
    if not 0 <= value < 1 << 64:
        raise fail(Status.INVALID_ARGUMENT, "%d is not in 0..2^64-1" % value, what)
    return int(value)


def _u32(value: Any, what: str) -> int:
    v = _u64(value, what)
    if v >= 1 << 32:
        raise fail(Status.INVALID_ARGUMENT, "%d is not in 0..2^32-1" % v, what)
    return v


def _format(value: Union[ObjectFormat, str, int]) -> int:
    return int(ObjectFormat.parse(value))


class Client(HandleOwner):
    """A connection to kvferryd (kvf_client). Make one with :meth:`connect`;
    close it with :meth:`close` or the context manager (``__del__`` as a
    fallback): the server then drains what it registered.

    A client whose server went away stays disconnected (calls raise
    DISCONNECTED): when :attr:`server_restarted` turns true, connect a new
    client and register again.
    """

    def __init__(self, ptr: int, info: ClientInfo, socket_dir: str, heartbeat: bool) -> None:
        # Internal: use Client.connect().
        self._handle = Handle(ptr, lib.kvf_client_disconnect, "client")
        self._info = info
        self.socket_dir = socket_dir
        self._heartbeat = heartbeat
        self._regions: List[Any] = []  # the allocations of the last registration

    @classmethod
    def connect(cls, socket_dir: Any, name: Optional[str] = None, timeout_ms: int = 10000,
                heartbeat: bool = True, heartbeat_period_ms: int = 0) -> "Client":
        """Connect to the kvferryd serving ``socket_dir`` and say HELLO
        (kvf_client_connect).

        Args:
            socket_dir: the server's socket directory (str or path).
            name: for the server's logs and STAT (at most 63 bytes of UTF-8).
            timeout_ms: the longest one request waits for its reply (0: 10000).
            heartbeat: True: a thread of the library sends heartbeats until
                close (and notices server restarts); False: call
                :meth:`heartbeat` yourself at least every
                ``info.heartbeat_period_ms``.
            heartbeat_period_ms: the thread's period (0: the server's).

        Raises KvferryError: NOT_FOUND (no server runs there), PERMISSION,
        PROTOCOL (another protocol version), TIMEOUT, DISCONNECTED,
        INVALID_ARGUMENT (naming the option).
        """
        path = os.fsencode(socket_dir)
        opts = S.kvf_client_options.init()
        opts.socket_dir = path
        name_b = name.encode("utf-8") if name is not None else None
        opts.name = name_b
        opts.timeout_ms = _u32(timeout_ms, "timeout_ms")
        opts.heartbeat_thread = 1 if heartbeat else 0
        opts.heartbeat_period_ms = _u32(heartbeat_period_ms, "heartbeat_period_ms")
        info = S.kvf_client_info.init()
        out = c_void_p()
        _check(lib.kvf_client_connect(byref(opts), byref(out), byref(info)))
        return cls(out.value or 0, ClientInfo(info.client_id, info.boot_token, info.server_pid,
                                              info.heartbeat_period_ms, info.heartbeat_timeout_ms,
                                              info.protocol_version),
                   os.fsdecode(path), bool(heartbeat))

    # -- lifetime --

    def close(self) -> None:
        """Disconnect (kvf_client_disconnect), after the calls in flight on
        other threads. Idempotent."""
        super().close()
        self._regions = []

    def __repr__(self) -> str:
        if self.closed:
            return "<kvferry.client.Client (closed)>"
        return "<kvferry.client.Client %d of kvferryd pid %d at %s>" % (
            self._info.client_id, self._info.server_pid, self.socket_dir)

    @property
    def info(self) -> ClientInfo:
        """What the server said at connect."""
        return self._info

    # -- registration --

    def register(self, geometry: Union[Geometry, str, bytes], regions: Sequence[RegionLike],
                 device: int = -1, shard_index: int = 0, shard_count: int = 1) -> Registration:
        """Register a geometry and the memory of its regions (kvf_client_register_desc).

        Args:
            geometry: a finalized :class:`kvferry.Geometry`, or the geometry
                file's JSON text.
            regions: one per geometry region, in order: ``(allocation, offset,
                length)`` (bytes [offset, offset + length) of a
                :class:`kvferry.Allocation`), ``(allocation, offset)`` (to the
                allocation's end) or an allocation (all of it). Several regions
                may share one allocation: it is exported once.
            device: the GPU the engine runs on; -1 for the host backend.
            shard_index, shard_count: this worker's tensor-parallel (x DCP)
                rank and their number (0 of 1 or 0 of 0: unsharded). The
                server files what a registration stores under its geometry's
                fingerprint and its shard: another shard never finds it.

        All or nothing on the server: on failure the previous registration
        keeps serving. Raises KvferryError with the server's status and field
        (INVALID_GEOMETRY, PARSE, INVALID_ARGUMENT naming
        ``payload.regions[1].length``...).
        """
        if isinstance(geometry, Geometry):
            text = geometry.to_json().encode("utf-8")
        elif isinstance(geometry, str):
            text = geometry.encode("utf-8")
        elif isinstance(geometry, (bytes, bytearray)):
            text = bytes(geometry)
        else:
            raise fail(Status.INVALID_ARGUMENT, "a kvferry.Geometry or JSON text is required, "
                       "not %s" % type(geometry).__name__, "geometry")
        items = list(regions)
        arr = (S.kvf_client_region * max(len(items), 1))()
        allocs: List[Allocation] = []
        for i, item in enumerate(items):
            what = "regions[%d]" % i
            if isinstance(item, Allocation):
                alloc, offset, length = item, 0, None
            elif isinstance(item, tuple) and len(item) in (2, 3) and isinstance(item[0], Allocation):
                alloc, offset = item[0], _u64(item[1], what + ".offset")
                length = _u64(item[2], what + ".length") if len(item) == 3 else None
            else:
                raise fail(Status.INVALID_ARGUMENT, "%r: a kvferry.Allocation, (allocation, "
                           "offset) or (allocation, offset, length) is required" % (item,), what)
            if alloc.closed:
                raise fail(Status.STATE, "the allocation is closed", what + ".alloc")
            size = alloc.size
            if length is None:
                if offset > size:
                    raise fail(Status.INVALID_ARGUMENT, "offset %d is past the allocation's %d "
                               "bytes" % (offset, size), what + ".offset")
                length = size - offset
            elif offset + length > size:
                # Checked here too, before anything is exported or sent (this field
                # name, regions[i].length); kvferryd refuses it as well, with
                # INVALID_ARGUMENT naming payload.regions[i].length, and keeps the connection.
                raise fail(Status.INVALID_ARGUMENT, "offset %d + length %d runs past the "
                           "allocation's %d bytes" % (offset, length, size), what + ".length")
            arr[i].alloc = alloc._handle.ptr
            arr[i].offset = offset
            arr[i].length = length
            allocs.append(alloc)
        device = int(device)
        shard_index = _u32(shard_index, "shard_index")
        shard_count = _u32(shard_count, "shard_count")
        out = S.kvf_client_registration.init()
        with self._handle.use() as c, contextlib.ExitStack() as stack:
            for a in allocs:  # the allocations stay open for the length of the call
                stack.enter_context(a._handle.use())
            desc = S.kvf_client_register_desc.init()
            desc.geometry_json = text
            desc.geometry_len = len(text)
            desc.device = device
            desc.regions = ctypes.cast(arr, c_void_p)
            desc.num_regions = len(items)
            desc.shard_index = shard_index
            desc.shard_count = shard_count
            st = lib.kvf_client_register_desc(c, byref(desc), byref(out))
        _check(st)
        self._regions = allocs
        return Registration(out.registration_id, out.fingerprint, out.imports, out.aliases)

    def unregister(self, registration_id: int = 0) -> int:
        """Unregister ``registration_id`` (0: the live one; an id already gone
        is not an error). Returns 3 when it is unmapped, 2 when it drains
        (leases held: the unmap follows)."""
        state = c_uint32(0)
        with self._handle.use() as c:
            _check(lib.kvf_client_unregister(c, _u64(registration_id, "registration_id"),
                                             byref(state)))
        return state.value

    # -- liveness --

    def heartbeat(self) -> int:
        """Send a heartbeat; returns the server's boot token (differs from
        ``info.boot_token`` once the server restarted)."""
        token = c_uint64(0)
        with self._handle.use() as c:
            _check(lib.kvf_client_heartbeat(c, byref(token)))
        return token.value

    @property
    def server_restarted(self) -> bool:
        """True once a server answers on the socket directory with another
        boot token than the one at connect (noticed by the heartbeat thread:
        always False for a client connected with heartbeat=False). This client
        stays disconnected: connect a new one and register again."""
        with self._handle.use() as c:
            return bool(lib.kvf_client_server_restarted(c))

    # -- STAT --

    def stat(self) -> Stats:
        """The server's counters (STAT)."""
        out = S.kvf_client_stats.init()
        with self._handle.use() as c:
            _check(lib.kvf_client_stat(c, byref(out)))
        return Stats._from_c(out)

    def stat_clients(self, capacity: int = _MAX_RECORDS) -> Tuple[Stats, List[ClientRecord]]:
        """The server's counters and one record per connected client (at most
        ``capacity``; the server sends at most 1024)."""
        capacity = max(1, min(_u32(capacity, "capacity"), _MAX_RECORDS))
        out = S.kvf_client_stats.init()
        records = (S.kvf_client_stat_record * capacity)()
        count = c_uint32(0)
        with self._handle.use() as c:
            _check(lib.kvf_client_stat_clients(c, byref(out), records, capacity, byref(count)))
        return Stats._from_c(out), [ClientRecord._from_c(records[i])
                                    for i in range(min(count.value, capacity))]

    def stat_peers(self) -> List[PeerRecord]:
        """The server's kvferryd peers (STAT with peer records; empty for a
        server without peering). Raises KvferryError UNSUPPORTED with a
        library without peers."""
        if not has_push():
            raise _unsupported("kvf_client_stat_peers", "peers (i16-peers)")
        records = (S.kvf_client_peer_record * 64)()
        count = c_uint32(0)
        with self._handle.use() as c:
            _check(_stat_peers(c, records, 64, byref(count)))  # type: ignore[misc]
        return [PeerRecord._from_c(records[i]) for i in range(min(count.value, 64))]

    # -- STORE and RETRIEVE --

    def submit(self, op: Union[Op, str], token_begin: int, token_end: int, keys: Any,
               blocks: Sequence[Any], format: Union[ObjectFormat, str] = "canonical",
               ready_event: Any = None, registration_id: int = 0) -> int:
        """Send a STORE or RETRIEVE and return its request id at once
        (kvf_client_submit); collect its outcome with :meth:`wait`.

        Args:
            op: "store" or "retrieve" (or :class:`Op`).
            token_begin, token_end: the global tokens [token_begin,
                token_end); token_begin a multiple of chunk_tokens.
            keys: one chunk key per chunk the range spans (:func:`chunk_keys`
                of the whole sequence, sliced from ``token_begin //
                chunk_tokens``).
            blocks: one entry per geometry group, in order: None (the group
                does not move), its block ids (a sequence, a numpy array or a
                CPU tensor of int32/int64; -1 and None skip a block), or
                ``(block_ids, first_block)`` / :class:`kvferry.BlockTable` when
                the table starts at local block first_block. For a recurrent
                group, see kvferry/client.h (the state slot).
            format: "canonical" or "native".
            ready_event: STORE on a GPU: the 64 bytes of a
                cudaIpcEventHandle_t recorded after the blocks were written;
                None: the blocks are ready now. RETRIEVE: None.
            registration_id: 0: the live registration.

        Raises KvferryError INVALID_ARGUMENT naming the field
        (``blocks[0][3]``, ``xfer.num_chunk_keys``), TIMEOUT, DISCONNECTED.
        """
        op = Op.parse(op)
        x = _Xfer(token_begin, token_end, keys, blocks, format, ready_event, registration_id)
        rid = c_uint64(0)
        with self._handle.use() as c:
            _check(lib.kvf_client_submit(c, int(op), byref(x.c), byref(rid)))
        return rid.value

    def wait(self, request_id: int, timeout_ms: int = 0) -> Result:
        """The outcome of a submitted request (kvf_client_wait; timeout_ms 0:
        the client's timeout). Returns the :class:`Result` whenever the
        server answered with an outcome (``result.done`` says whether it was
        done; a TIMED_OUT request may still touch its blocks: see
        :meth:`wait_retired`). Raises KvferryError with the server's status
        when it refused the request (the field it named; nothing moved),
        TIMEOUT (no answer yet: wait again), NOT_FOUND (not a request in
        flight), DISCONNECTED."""
        out = S.kvf_client_result.init()
        with self._handle.use() as c:
            _check(lib.kvf_client_wait(c, _u64(request_id, "request_id"),
                                       _u32(timeout_ms, "timeout_ms"), byref(out)))
        return Result._from_c(out)

    def _xfer(self, fn: Callable, *args: Any, **kwargs: Any) -> Result:
        x = _Xfer(*args, **kwargs)
        out = S.kvf_client_result.init()
        out.outcome = 0  # tells an outcome from a refusal: the library writes it only with one
        with self._handle.use() as c:
            st = fn(c, byref(x.c), byref(out))
        if st == 0:
            return Result._from_c(out)
        err = _lib.error(st)
        err.result = Result._from_c(out) if out.outcome else None  # type: ignore[attr-defined]
        raise err

    def store(self, token_begin: int, token_end: int, keys: Any, blocks: Sequence[Any],
              format: Union[ObjectFormat, str] = "canonical", ready_event: Any = None,
              registration_id: int = 0) -> Result:
        """STORE blocks into the server's L1 and wait (kvf_client_store).
        Arguments as :meth:`submit`. Returns the :class:`Result` when done
        (``objects_present``: objects L1 held already). Raises KvferryError
        otherwise: when the server answered with another outcome (failed,
        timed out, cancelled) the error's ``.result`` holds it, else
        ``.result`` is None (refused, no reply in time: the request is then
        forgotten, DISCONNECTED)."""
        return self._xfer(lib.kvf_client_store, token_begin, token_end, keys, blocks, format,
                          ready_event, registration_id)

    def retrieve(self, token_begin: int, token_end: int, keys: Any, blocks: Sequence[Any],
                 format: Union[ObjectFormat, str] = "canonical",
                 registration_id: int = 0) -> Result:
        """RETRIEVE objects from L1 into blocks and wait (kvf_client_retrieve).
        Arguments and errors as :meth:`store`. A miss is no error:
        ``result.prefix_tokens`` is token_begin (nothing restored)."""
        return self._xfer(lib.kvf_client_retrieve, token_begin, token_end, keys, blocks, format,
                          None, registration_id)

    # -- LOOKUP, pins, retirement --

    def lookup(self, token_begin: int, token_end: int, keys: Any, pin_ms: int = 0,
               format: Union[ObjectFormat, str] = "canonical",
               registration_id: int = 0) -> LookupResult:
        """How many tokens of the prefix each object group holds, moving
        nothing (kvf_client_lookup). ``pin_ms`` > 0 (at most 60000) pins the
        chunks found that long, so a RETRIEVE that follows finds them; give
        the pin back with :meth:`unpin`. Raises KvferryError UNSUPPORTED with
        a library without LOOKUP."""
        if not has_lookup():
            raise _unsupported("kvf_client_lookup", "LOOKUP (i13-lookup)")
        karr, nkeys = _keys_array(keys)
        req = S.kvf_client_lookup_desc.init()
        req.registration_id = _u64(registration_id, "registration_id")
        req.token_begin = _u64(token_begin, "token_begin")
        req.token_end = _u64(token_end, "token_end")
        req.format = _format(format)
        req.chunk_keys = ctypes.cast(karr, c_void_p)
        req.num_chunk_keys = nkeys
        req.pin_ms = _u32(pin_ms, "pin_ms")
        out = S.kvf_client_lookup_result.init()
        with self._handle.use() as c:
            _check(_lookup(c, byref(req), byref(out)))  # type: ignore[misc]
        nog = min(out.num_object_groups, S.MAX_GROUPS)
        return LookupResult(out.prefix_tokens, tuple(out.object_group_prefix[:nog]), out.pin_id,
                            out.pinned_chunks)

    def push(self, peer: str, token_begin: int, token_end: int, keys: Any,
             format: Union[ObjectFormat, str] = "canonical", registration_id: int = 0) -> PushResult:
        """Copy the objects the server holds for ``keys`` (the chunks of
        [token_begin, token_end), every object group) into the L1 of the
        kvferryd peer ``peer`` (kvf_client_push): its ``--peer ADDR:PORT``,
        or its boot token as 16 hex digits (:meth:`stat_peers`). Returns once
        the peer has committed them (whole, checked objects only). Raises
        KvferryError NOT_FOUND (no ready peer of that name, field
        ``payload.peer``), UNSUPPORTED (a server without peers), BUSY (16
        pushes in flight), INVALID_ARGUMENT (naming the field), DISCONNECTED
        (the peer was lost first)."""
        if not has_push():
            raise _unsupported("kvf_client_push", "PUSH (i16-peers)")
        if not isinstance(peer, str):
            raise fail(Status.INVALID_ARGUMENT, "a str (ADDR:PORT or a boot token)", "push.peer")
        if not peer.isascii():
            raise fail(Status.INVALID_ARGUMENT, "not ASCII", "push.peer")
        name = peer.encode("ascii")
        karr, nkeys = _keys_array(keys)
        req = S.kvf_client_push_desc.init()
        req.registration_id = _u64(registration_id, "registration_id")
        req.token_begin = _u64(token_begin, "token_begin")
        req.token_end = _u64(token_end, "token_end")
        req.format = _format(format)
        req.chunk_keys = ctypes.cast(karr, c_void_p)
        req.num_chunk_keys = nkeys
        req.peer = name
        out = S.kvf_client_push_result.init()
        with self._handle.use() as c:
            _check(_push(c, byref(req), byref(out)))  # type: ignore[misc]
        return PushResult(out.objects_pushed, out.objects_present, out.objects_missing,
                          out.objects_failed, out.bytes_pushed, out.chunks_on_peer)

    def unpin(self, pin_id: int) -> None:
        """Give back the pin a :meth:`lookup` took (kvf_client_unpin)."""
        if not has_lookup():
            raise _unsupported("kvf_client_unpin", "LOOKUP (i13-lookup)")
        with self._handle.use() as c:
            _check(_unpin(c, _u64(pin_id, "pin_id")))  # type: ignore[misc]

    def wait_retired(self, request_id: int, timeout_ms: int = 0) -> None:
        """Wait until the server proved the work of ``request_id`` complete
        (kvf_client_wait_retired): after it returns, the blocks a timed-out or
        cancelled STORE/RETRIEVE named may be reused. Returns at once for a
        request that finished normally. Raises KvferryError TIMEOUT (not yet),
        NOT_FOUND (never a request of this client), DISCONNECTED, UNSUPPORTED
        (a library without retirement notices)."""
        if not has_lookup():
            raise _unsupported("kvf_client_wait_retired", "RETIRED notices (i13-lookup)")
        with self._handle.use() as c:
            _check(_wait_retired(c, _u64(request_id, "request_id"),  # type: ignore[misc]
                                 _u32(timeout_ms, "timeout_ms")))
