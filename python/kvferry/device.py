"""Whether this process can use a CUDA driver and GPUs (kvferry/device.h).

kvferry reaches the driver only through entry points it looks up at run
time, so the package loads and its host backend works on a machine without a
driver or a GPU. ``KVF_CUDA_DISABLE=1`` in the environment makes kvferry
behave as if there were no driver. Safe from any thread.
"""

from __future__ import annotations

from ctypes import byref
from dataclasses import dataclass
from typing import Union

from . import _structs as S
from ._errors import Status
from ._lib import error, lib

__all__ = ["CudaInfo", "cuda_probe"]


@dataclass(frozen=True)
class CudaInfo:
    """kvf_cuda_info, and the probe's status."""

    status: Union[Status, int]  #: SUCCESS, NO_DRIVER, NO_DEVICE or CUDA
    driver_version: int   #: 1000*major + 10*minor the driver supports; 0: no driver
    runtime_version: int  #: the CUDA version kvferry was built against; 0: built without CUDA
    device_count: int     #: visible devices
    message: str          #: what was found, or why CUDA cannot be used

    @property
    def available(self) -> bool:
        """True when a driver is loaded and at least one device is visible."""
        return self.status == Status.SUCCESS and self.device_count > 0


def cuda_probe() -> CudaInfo:
    """Probe the CUDA driver and count the devices (kvf_cuda_probe), without
    creating a context on any device. A missing driver or device is not an
    error: it is in the result's status and message."""
    info = S.kvf_cuda_info.init()
    st = lib.kvf_cuda_probe(byref(info))
    if st == Status.INVALID_ARGUMENT:  # the struct itself was refused: a package bug
        raise error(st)
    try:
        status = Status(st)
    except ValueError:
        status = st
    return CudaInfo(status, info.driver_version, info.runtime_version, info.device_count,
                    S.text(info.message))
