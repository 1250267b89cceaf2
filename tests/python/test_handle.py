"""Owned C handles (kvferry._handle): destroyed exactly once, after the
calls in flight, never under a pin; and no leaks through dropped objects."""

import gc
import os
import threading
import time

import pytest

import kvferry
from kvferry import KvferryError, Status
from kvferry._handle import Handle


def test_destroyed_once_and_refused_after():
    destroyed = []
    h = Handle(0x1000, destroyed.append, "thing")
    with h.use() as ptr:
        assert ptr == 0x1000
    h.close()
    h.close()
    assert destroyed == [0x1000] and h.closed
    with pytest.raises(KvferryError) as e:
        with h.use():
            pass
    assert (e.value.status, e.value.field) == (Status.STATE, "thing")


def test_close_waits_for_a_call_in_flight():
    order = []
    h = Handle(1, lambda p: order.append("destroy"), "thing")
    entered = threading.Event()

    def call():
        with h.use():
            entered.set()
            time.sleep(0.1)
            order.append("call done")

    t = threading.Thread(target=call)
    t.start()
    entered.wait()
    h.close()
    t.join()
    assert order == ["call done", "destroy"]


def test_pins_refuse_close():
    destroyed = []
    h = Handle(1, destroyed.append, "geometry")
    h.pin("transfer context")
    with pytest.raises(KvferryError, match="1 transfer context"):
        h.close()
    h.unpin()
    h.close()
    assert destroyed == [1]
    with pytest.raises(KvferryError):
        h.pin("transfer context")


def _open_fds():
    return len(os.listdir("/proc/self/fd"))


def test_dropped_objects_free_what_they_hold():
    before = _open_fds()
    for _ in range(200):
        a = kvferry.Allocation.create(1 << 16)  # a memfd each: leaks would show as descriptors
        g = kvferry.Geometry.preset("deepseek-v3-mla-bf16")
        x = kvferry.Transfer(g)
        del a, x, g
    gc.collect()
    assert _open_fds() <= before + 2
