"""An owned C handle: used by calls in flight, closed exactly once; and the
lifetime methods of the objects that own one."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional, TypeVar

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


_Owner = TypeVar("_Owner", bound="HandleOwner")


class HandleOwner:
    """Mixin for an object whose C object is the :class:`Handle` in
    ``self._handle`` (a client, an allocation, a geometry, a transfer
    context): ``closed``, an idempotent ``close()``, the context manager
    (``with`` closes on the way out) and a ``__del__`` that closes a dropped
    object and swallows what that raises.

    The subclass sets ``self._handle`` in its ``__init__``; one that holds
    more than the handle overrides ``close()`` and calls ``super().close()``
    first, so nothing is dropped when the handle refuses to close.
    """

    __slots__ = ()

    _handle: Handle

    @property
    def closed(self) -> bool:
        """True once close() destroyed the C object."""
        return self._handle.closed

    def close(self) -> None:
        """Destroy the C object, once the calls in flight on other threads
        are done. Idempotent."""
        self._handle.close()

    def __enter__(self: _Owner) -> _Owner:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        # The handle only: __init__ may have failed before it was set, and
        # what else close() releases goes with the object anyway.
        handle = getattr(self, "_handle", None)
        if handle is not None:
            try:
                handle.close()
            except Exception:
                pass
