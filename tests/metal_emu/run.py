"""Runs one launch of a built kernel in a forked child process.

The child shares the parent's memory copy-on-write, so inputs need no copy; outputs live in
shared anonymous mappings that the child writes in place. A crash (out-of-bounds access), a
failed emulation check (divergent barrier, threadgroup memory over the limit) or a hang (a
barrier some thread never reaches) ends only the child and comes back as a KernelError.
"""

from __future__ import annotations

import ctypes
import faulthandler
import functools
import mmap
import os
import select
import signal
from pathlib import Path

import numpy as np

_ERROR_BYTES = 1024
_KERNEL_FAILED = 3  # runtime.cpp's fail()


class KernelError(RuntimeError):
    """The emulated kernel failed: an emulation check, a crash or a timeout."""


def shared_array(shape, dtype) -> np.ndarray:
    """A numpy array in memory a forked child writes back to the parent."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    buf = mmap.mmap(-1, max(nbytes, 1))
    return np.frombuffer(buf, dtype=dtype, count=nbytes // dtype.itemsize).reshape(shape)


@functools.cache
def _library(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    lib.msl_emu_launch.restype = ctypes.c_int
    lib.msl_emu_launch.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_uint),
                                   ctypes.c_ulonglong, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                                   ctypes.c_int]
    return lib


def _wait(pid: int, timeout: float) -> int | None:
    """The child's wait status, or None if it is still running after `timeout` seconds."""
    fd = os.pidfd_open(pid)
    try:
        ready, _, _ = select.select([fd], [], [], timeout)
    finally:
        os.close(fd)
    if not ready:
        return None
    return os.waitpid(pid, 0)[1]


def launch(library: Path, buffers: list[np.ndarray], grid, threadgroup, *, seed: int,
           concurrency: int, jitter: int, timeout: float) -> None:
    lib = _library(library)
    pointers = (ctypes.c_void_p * len(buffers))(*[b.ctypes.data for b in buffers])
    dims = (ctypes.c_uint * 6)(*grid, *threadgroup)
    error = shared_array((_ERROR_BYTES,), np.uint8)
    pid = os.fork()
    if pid == 0:  # the child: run, then leave without Python's exit handlers
        code = 4
        faulthandler.disable()  # a crash is reported by the parent, not dumped by the child
        try:
            code = lib.msl_emu_launch(pointers, dims, seed, concurrency, jitter,
                                      error.ctypes.data, _ERROR_BYTES)
        finally:
            os._exit(code)
    status = _wait(pid, timeout)
    if status is None:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise KernelError(f"timed out after {timeout:.0f} s: a barrier or SIMD collective that "
                          "some thread never reaches?")
    if os.WIFSIGNALED(status):
        name = signal.Signals(os.WTERMSIG(status)).name
        raise KernelError(f"the kernel crashed ({name}): an out-of-bounds or misaligned access?")
    code = os.WEXITSTATUS(status)
    if code == _KERNEL_FAILED:
        raise KernelError(bytes(error).split(b"\0", 1)[0].decode(errors="replace"))
    if code != 0:
        raise KernelError(f"the launch failed (exit status {code})")
