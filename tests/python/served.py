"""kvferryd processes for the Python tests (test_client.py, test_client_gpu.py).

kvferryd is found as $KVF_KVFERRYD, else tools/kvferryd next to the library
the package loaded (the build tree). A test that needs it and finds none is
skipped, saying where it looked.
"""

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

import kvferry
from kvferry.client import Client


def kvferryd_path():
    env = os.environ.get("KVF_KVFERRYD")
    if env:
        return Path(env)
    return Path(kvferry.library_path()).resolve().parent / "tools" / "kvferryd"


class Kvferryd:
    """One kvferryd process serving socket_dir; its output goes to log_path."""

    def __init__(self, socket_dir, log_path, args=(), devices="none", l1_mb=64):
        self.socket_dir = Path(socket_dir)
        self.log_path = Path(log_path)
        self.argv = [str(kvferryd_path()), "--socket-dir", str(self.socket_dir), "--devices",
                     devices, "--l1-mb", str(l1_mb), "--log-level", "info"] + list(args)
        self.proc = None
        self.log = None

    def start(self, timeout=60.0):
        """Start the server and return once a client can connect (HELLO)."""
        self.log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.argv, stdout=self.log, stderr=self.log,
                                     stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError("kvferryd (%s) exited with status %s:\n%s"
                                     % (" ".join(self.argv), self.proc.returncode,
                                        self.log_text()))
            if (self.socket_dir / "kvferryd.sock").exists():
                try:
                    Client.connect(self.socket_dir, heartbeat=False, timeout_ms=5000).close()
                    return self
                except kvferry.KvferryError as exc:
                    last = exc
            time.sleep(0.05)
        raise AssertionError("kvferryd did not serve %s within %.0f s (last: %s):\n%s"
                             % (self.socket_dir, timeout, last, self.log_text()))

    @property
    def pid(self):
        return self.proc.pid

    def log_text(self, tail=6000):
        try:
            return self.log_path.read_text(errors="replace")[-tail:]
        except OSError:
            return ""

    def kill(self):
        """SIGKILL: a crash, the socket left behind."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def stop(self):
        """SIGTERM (after a SIGCONT, for a test that stopped it), then SIGKILL.
        Returns the exit status."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        if self.log is not None:
            self.log.close()
            self.log = None
        return self.proc.returncode


@contextlib.contextmanager
def factory(log_dir, **kw):
    """Yields start(*args) -> a started Kvferryd, every one on the same fresh
    socket directory (a later one is a restart); stops them all at the end.
    Skips the test when there is no kvferryd binary."""
    if not kvferryd_path().is_file():
        pytest.skip("no kvferryd at %s (set KVF_KVFERRYD or build the kvferryd target)"
                    % kvferryd_path())
    # A short directory (socket paths are limited to 107 bytes), made 0700.
    top = Path(tempfile.mkdtemp(prefix="kvf-py-", dir="/tmp" if os.path.isdir("/tmp") else None))
    started = []

    def start(*args):
        d = Kvferryd(top / "sock", Path(log_dir) / ("kvferryd-%d.log" % len(started)), args, **kw)
        started.append(d)
        return d.start()

    try:
        yield start
    finally:
        for d in reversed(started):
            d.stop()
        shutil.rmtree(top, ignore_errors=True)
