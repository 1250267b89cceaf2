"""The CUDA probe (kvferry.cuda_probe)."""

import subprocess
import sys

from conftest import ROOT, subprocess_env

import kvferry
from kvferry import Status


def test_probe_reports_without_raising():
    info = kvferry.cuda_probe()
    assert info.status in (Status.SUCCESS, Status.NO_DRIVER, Status.NO_DEVICE, Status.CUDA)
    assert info.message
    assert info.available == (info.status == Status.SUCCESS and info.device_count > 0)
    if not info.available:
        assert info.device_count == 0


def test_kvf_cuda_disable_hides_the_driver():
    code = ("import sys; sys.path.insert(0, %r); import kvferry; i = kvferry.cuda_probe(); "
            "print(i.status.name, i.driver_version, i.device_count)" % str(ROOT / "python"))
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                         env=subprocess_env(KVF_CUDA_DISABLE="1")).stdout.split()
    assert out == ["NO_DRIVER", "0", "0"]
