"""The one exception type of the package, and the status codes it carries."""

from __future__ import annotations

import enum
import re
from typing import Optional, Union

__all__ = ["Status", "KvferryError", "parse_field"]


class Status(enum.IntEnum):
    """kvf_status: the status every kvferry C function returns.

    The values are pinned forever by the C library (kvferry/status.h): new
    codes are only appended. ``Status.SUCCESS`` is never raised.
    """

    SUCCESS = 0
    INVALID_ARGUMENT = 1
    INVALID_GEOMETRY = 2
    OUT_OF_MEMORY = 3
    OVERFLOW = 4
    NOT_FOUND = 5
    PARSE = 6
    IO = 7
    NO_DRIVER = 8
    NO_DEVICE = 9
    CUDA = 10
    UNSUPPORTED = 11
    GEOMETRY_MISMATCH = 12
    STATE = 13
    SYSTEM = 14
    INTERNAL = 15
    TIMEOUT = 16
    BUSY = 17
    PROTOCOL = 18
    PERMISSION = 19
    DISCONNECTED = 20

    @property
    def text(self) -> str:
        """The short name the C library gives the status (kvf_status_string)."""
        return _STATUS_TEXT.get(self, "unknown status")


# The same words as kvf_status_string(), so messages read alike whether the
# package or the library raised them (tests/python/test_errors.py checks).
_STATUS_TEXT = {
    Status.SUCCESS: "success",
    Status.INVALID_ARGUMENT: "invalid argument",
    Status.INVALID_GEOMETRY: "invalid geometry",
    Status.OUT_OF_MEMORY: "out of memory",
    Status.OVERFLOW: "integer overflow",
    Status.NOT_FOUND: "not found",
    Status.PARSE: "parse error",
    Status.IO: "I/O error",
    Status.NO_DRIVER: "no CUDA driver",
    Status.NO_DEVICE: "no CUDA device",
    Status.CUDA: "CUDA error",
    Status.UNSUPPORTED: "unsupported",
    Status.GEOMETRY_MISMATCH: "geometry mismatch",
    Status.STATE: "wrong state",
    Status.SYSTEM: "system error",
    Status.INTERNAL: "internal error",
    Status.TIMEOUT: "timed out",
    Status.BUSY: "busy",
    Status.PROTOCOL: "protocol error",
    Status.PERMISSION: "permission denied",
    Status.DISCONNECTED: "disconnected",
}


class KvferryError(Exception):
    """Raised by every failing kvferry call, from the C library or the package.

    Attributes:
        status: the :class:`Status` (an ``int`` if the library returned a code
            this package does not know yet).
        field: the field the failure is about, as the library named it
            (``"token_stride"``, ``"groups[1].block_ids[7]"``,
            ``"region_bases[0]"``), or ``None`` when the message names none.
        message: the full detail message (kvf_last_error() for C failures).
        group, layer: for geometry validation and loading failures, the group
            and layer index the rule is about, else ``None``.
    """

    def __init__(self, status: Union[Status, int], message: str, field: Optional[str] = None,
                 group: Optional[int] = None, layer: Optional[int] = None) -> None:
        try:
            status = Status(status)
        except ValueError:
            status = int(status)
        self.status: Union[Status, int] = status
        self.message: str = message
        self.field: Optional[str] = field if field else None
        self.group: Optional[int] = group
        self.layer: Optional[int] = layer
        super().__init__(message)

    def __str__(self) -> str:
        text = self.status.text if isinstance(self.status, Status) else "status %d" % self.status
        return "%s: %s" % (text, self.message) if self.message else text

    def __repr__(self) -> str:
        return "KvferryError(%r, %r, field=%r)" % (self.status, self.message, self.field)

    def __reduce__(self):  # picklable, for multiprocessing
        return (KvferryError, (int(self.status), self.message, self.field, self.group, self.layer))


# A field path: token_begin, groups[1].block_ids[7], options.size, out->version.
_PATH = r"[A-Za-z_][A-Za-z0-9_]*(?:\[-?\d+\]|\.[A-Za-z_][A-Za-z0-9_]*|->[A-Za-z_][A-Za-z0-9_]*)*"
# "path" alone, or "path VALUE" where VALUE is one number (decimal or hex),
# pointer or quoted name.
_SEGMENT = re.compile(r"^(%s)(?: (?:-?\d+|(?:0x)?[0-9a-fA-F]+|\(nil\)|NULL|'[^']*'))?$" % _PATH)
_TAIL = re.compile(r"^(%s) (?:is|must|has|was) " % _PATH)
_CALL = re.compile(r"^kvf_[a-z0-9_]+$")


def parse_field(message: str) -> Optional[str]:
    """The field a kvferry detail message names, or None.

    The library writes "field: message" or "field value: message", possibly
    after a trail of prefixes naming the call, the file or the geometry
    location ("kvf_xfer_create: device 7: no such CUDA device",
    "presets/x.json: groups[1].layers[0].token_stride: expected ...",
    "token_begin 5: must be a multiple of chunk_tokens 16").
    """
    parts = message.split(": ")
    for segment in parts[:-1]:
        segment = segment.strip()
        if _CALL.match(segment) or segment.endswith(".json"):
            continue
        m = _SEGMENT.match(segment)
        if m:
            return m.group(1)
    m = _TAIL.match(parts[-1].strip())
    if m:
        return m.group(1)
    return None
