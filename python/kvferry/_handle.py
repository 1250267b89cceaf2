"""An owned C handle: used by calls in flight, closed exactly once."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

from ._errors import KvferryError, Status


class Handle:
    """Owns one C pointer and its destroy function.

    ``use()`` yields the pointer for the length of a C call and refuses a
    closed handle (KvferryError, Status.STATE, naming the object). ``close()``
    refuses new uses, waits for the calls in flight on other threads, then
    destroys the pointer once; later closes do nothing. This is what makes
    close() safe against concurrent calls, which the C API leaves to the
    caller ("destroy must not race other calls").
    """

    __slots__ = ("_ptr", "_destroy", "_what", "_cond", "_users", "_pins", "_pinned_by")

    def __init__(self, ptr: int, destroy: Callable[[int], None], what: str) -> None:
        self._ptr: Optional[int] = ptr
        self._destroy = destroy
        self._what = what
        self._cond = threading.Condition(threading.Lock())
        self._users = 0
        self._pins = 0
        self._pinned_by = ""

    @property
    def closed(self) -> bool:
        return self._ptr is None

    @property
    def ptr(self) -> int:
        """The pointer, for calls the caller knows cannot race a close."""
        ptr = self._ptr
        if ptr is None:
            raise KvferryError(Status.STATE, "%s: closed" % self._what, field=self._what)
        return ptr

    @contextmanager
    def use(self) -> Iterator[int]:
        with self._cond:
            ptr = self._ptr
            if ptr is None:
                raise KvferryError(Status.STATE, "%s: closed" % self._what, field=self._what)
            self._users += 1
        try:
            yield ptr
        finally:
            with self._cond:
                self._users -= 1
                if self._users == 0:
                    self._cond.notify_all()

    def pin(self, by: str) -> int:
        """Hold the handle open for another object's lifetime (a transfer
        context holds its geometry): close() refuses while pins are held.
        Returns the pointer; release with unpin()."""
        with self._cond:
            ptr = self._ptr
            if ptr is None:
                raise KvferryError(Status.STATE, "%s: closed" % self._what, field=self._what)
            self._pins += 1
            self._pinned_by = by
            return ptr

    def unpin(self) -> None:
        with self._cond:
            self._pins -= 1

    def close(self) -> None:
        """Destroy the pointer once calls in flight are done. Raises
        KvferryError (Status.STATE) while pins are held."""
        with self._cond:
            ptr = self._ptr
            if ptr is None:
                return
            if self._pins:
                raise KvferryError(Status.STATE, "%s: %d %s(s) still use it: close them first"
                                   % (self._what, self._pins, self._pinned_by), field=self._what)
            self._ptr = None
            while self._users:
                self._cond.wait()
        self._destroy(ptr)

    def release(self) -> Optional[int]:
        """Give up ownership without destroying (the pointer moves elsewhere)."""
        with self._cond:
            ptr, self._ptr = self._ptr, None
            return ptr
