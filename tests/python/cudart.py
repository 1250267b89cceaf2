"""The CUDA runtime through ctypes, for the GPU tests: device and pinned
memory, copies and streams, with no torch or cupy.

libcudart is found by name: ctypes.util.find_library("cudart"), then the
CUDA toolkit's lib64 ($CUDA_HOME, /usr/local/cuda).
"""

import ctypes
import ctypes.util
import glob
import os
from ctypes import byref, c_int, c_size_t, c_void_p


def _load():
    names = []
    found = ctypes.util.find_library("cudart")
    if found:
        names.append(found)
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            names += sorted(glob.glob(os.path.join(home, "lib64", "libcudart.so*")), reverse=True)
    names += sorted(glob.glob("/usr/local/cuda*/lib64/libcudart.so*"), reverse=True)
    errors = []
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError as exc:
            errors.append("%s: %s" % (name, exc))
    raise OSError("libcudart not found (%s)" % ("; ".join(errors) or "no candidates"))


H2D, D2H, D2D = 1, 2, 3


class DeviceBuffer:
    """cudaMalloc'd memory with __cuda_array_interface__ (bytes)."""

    def __init__(self, rt, nbytes):
        self.rt = rt
        self.nbytes = nbytes
        ptr = c_void_p()
        rt.check(rt.lib.cudaMalloc(byref(ptr), c_size_t(nbytes)), "cudaMalloc")
        self.ptr = ptr.value

    @property
    def __cuda_array_interface__(self):
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.ptr, False),
                "strides": None, "version": 3}

    def upload(self, host_bytes):
        data = bytes(host_bytes)
        self.rt.check(self.rt.lib.cudaMemcpy(c_void_p(self.ptr), data, c_size_t(len(data)), H2D),
                      "cudaMemcpy H2D")

    def download(self):
        out = ctypes.create_string_buffer(self.nbytes)
        self.rt.check(self.rt.lib.cudaMemcpy(out, c_void_p(self.ptr), c_size_t(self.nbytes), D2H),
                      "cudaMemcpy D2H")
        return out.raw

    def free(self):
        if self.ptr:
            self.rt.lib.cudaFree(c_void_p(self.ptr))
            self.ptr = 0


class PinnedBuffer:
    """cudaHostAlloc'd (pinned, mapped) host memory, as a ctypes char array."""

    def __init__(self, rt, nbytes):
        self.rt = rt
        self.nbytes = nbytes
        ptr = c_void_p()
        rt.check(rt.lib.cudaHostAlloc(byref(ptr), c_size_t(nbytes), 0), "cudaHostAlloc")
        self.ptr = ptr.value
        self.array = (ctypes.c_char * nbytes).from_address(self.ptr)

    def free(self):
        if self.ptr:
            self.array = None
            self.rt.lib.cudaFreeHost(c_void_p(self.ptr))
            self.ptr = 0


class Stream:
    """A cudaStream_t exposing __cuda_stream__ (version 0, handle)."""

    def __init__(self, rt):
        self.rt = rt
        handle = c_void_p()
        rt.check(rt.lib.cudaStreamCreate(byref(handle)), "cudaStreamCreate")
        self.handle = handle.value

    def __cuda_stream__(self):
        return (0, self.handle)

    def synchronize(self):
        self.rt.check(self.rt.lib.cudaStreamSynchronize(c_void_p(self.handle)),
                      "cudaStreamSynchronize")

    def destroy(self):
        if self.handle:
            self.rt.lib.cudaStreamDestroy(c_void_p(self.handle))
            self.handle = 0


class Runtime:
    def __init__(self):
        self.lib = _load()
        self.lib.cudaGetErrorString.restype = ctypes.c_char_p
        self.lib.cudaGetErrorString.argtypes = [c_int]
        count = c_int(0)
        self.check(self.lib.cudaGetDeviceCount(byref(count)), "cudaGetDeviceCount")
        self.device_count = count.value

    def check(self, err, what):
        if err != 0:
            raise RuntimeError("%s: %s" % (what, self.lib.cudaGetErrorString(err).decode()))

    def malloc(self, nbytes):
        return DeviceBuffer(self, nbytes)

    def pinned(self, nbytes):
        return PinnedBuffer(self, nbytes)

    def stream(self):
        return Stream(self)

    def synchronize(self):
        self.check(self.lib.cudaDeviceSynchronize(), "cudaDeviceSynchronize")
