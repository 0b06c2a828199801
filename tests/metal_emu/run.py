"""Runs one launch of a built kernel in a forked child process.

The child shares the parent's memory copy-on-write, so inputs need no copy; outputs live in
shared anonymous mappings that the child writes in place. A crash (out-of-bounds access), a
failed emulation check (divergent barrier, threadgroup memory over the limit) or a hang (a
barrier some thread never reaches) ends only the child and comes back as a KernelError.
Pages of an input a kernel must never read (`unreadable`) are made inaccessible in the child
alone: a read there is a crash, and the parent's copy stays readable.
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
_PROTECT_FAILED = 5  # mprotect of an unreadable span


class KernelError(RuntimeError):
    """The emulated kernel failed: an emulation check, a crash or a timeout."""


_ALIGN = 64  # Metal buffers start 64-byte aligned; the emulation's do too
_SLACK = 0xA5  # the bytes around a buffer, checked after every launch
_PROT_NONE = 0
_libc = ctypes.CDLL(None, use_errno=True)


class _Guarded(mmap.mmap):
    """A shared mapping holding one array at `start`, `nbytes` long, between guard pages."""

    start = nbytes = 0


def shared_array(shape, dtype) -> np.ndarray:
    """A numpy array in memory a forked child writes back to the parent, with exact bounds: it
    ends at most 63 bytes before an inaccessible page, starts on a 64-byte boundary after one,
    and the bytes between are a pattern `launch` checks, so an access past the last page faults
    and a write anywhere outside the array is an error, however close to its ends."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    span = -(-max(nbytes, 1) // _ALIGN) * _ALIGN
    pages = -(-span // mmap.PAGESIZE)
    buf = _Guarded(-1, (pages + 2) * mmap.PAGESIZE)
    buf[:] = bytes([_SLACK]) * len(buf)
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    for guard in (base, base + (pages + 1) * mmap.PAGESIZE):
        if _libc.mprotect(ctypes.c_void_p(guard), mmap.PAGESIZE, _PROT_NONE):
            raise OSError(ctypes.get_errno(), "mprotect of a guard page failed")
    buf.start, buf.nbytes = (pages + 1) * mmap.PAGESIZE - span, nbytes
    arr = np.frombuffer(buf, dtype=np.uint8, count=nbytes, offset=buf.start)
    return arr.view(dtype).reshape(shape)


def _written_outside(buffer: np.ndarray) -> str | None:
    """Where a launch wrote around a `shared_array`, or None (no check for other arrays)."""
    buf = buffer
    while isinstance(buf, np.ndarray):
        buf = buf.base
    if isinstance(buf, memoryview):
        buf = buf.obj
    if not isinstance(buf, _Guarded):
        return None
    start, nbytes = buf.start, buf.nbytes
    view = memoryview(buf)
    below = np.frombuffer(view[mmap.PAGESIZE:start], np.uint8)
    above = np.frombuffer(view[start + nbytes:len(buf) - mmap.PAGESIZE], np.uint8)
    before, past = np.flatnonzero(below != _SLACK), np.flatnonzero(above != _SLACK)
    if len(before):
        return f"at byte offset {int(before[0]) - len(below)} (before its start)"
    if len(past):
        return f"at byte offset {nbytes + int(past[0])} (its size is {nbytes} bytes)"
    return None


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


def page_span(buffer: np.ndarray, start: int, stop: int) -> tuple[int, int]:
    """(address, bytes) of bytes start:stop of `buffer`, which must be whole memory pages:
    a range only partly protected would prove nothing about its other bytes."""
    address = buffer.ctypes.data + start
    if start < 0 or stop > buffer.nbytes or address % mmap.PAGESIZE or (stop - start) % mmap.PAGESIZE:
        raise ValueError(f"unreadable: bytes {start}:{stop} of a {buffer.nbytes}-byte buffer at "
                         f"{buffer.ctypes.data:#x} are not whole pages of {mmap.PAGESIZE}")
    return address, stop - start


def launch(library: Path, buffers: list[np.ndarray], grid, threadgroup, *, seed: int,
           concurrency: int, jitter: int, timeout: float, unreadable=()) -> None:
    """`unreadable`: (address, bytes) spans (`page_span`) that no thread may touch."""
    lib = _library(library)
    pointers = (ctypes.c_void_p * len(buffers))(*[b.ctypes.data for b in buffers])
    dims = (ctypes.c_uint * 6)(*grid, *threadgroup)
    error = shared_array((_ERROR_BYTES,), np.uint8)
    pid = os.fork()
    if pid == 0:  # the child: run, then leave without Python's exit handlers
        code = 4
        faulthandler.disable()  # a crash is reported by the parent, not dumped by the child
        try:
            for address, nbytes in unreadable:
                if _libc.mprotect(ctypes.c_void_p(address), ctypes.c_size_t(nbytes), _PROT_NONE):
                    os._exit(_PROTECT_FAILED)
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
        read = ", or a read of a page it must not read" if unreadable else ""
        raise KernelError(f"the kernel crashed ({name}): an out-of-bounds or misaligned "
                          f"access{read}?")
    code = os.WEXITSTATUS(status)
    if code == _KERNEL_FAILED:
        raise KernelError(bytes(error).split(b"\0", 1)[0].decode(errors="replace"))
    if code == _PROTECT_FAILED:
        raise KernelError("the pages a kernel must not read could not be protected")
    if code != 0:
        raise KernelError(f"the launch failed (exit status {code})")
    for i, buffer in enumerate(buffers):
        where = _written_outside(buffer)
        if where:
            raise KernelError(f"the kernel wrote out of bounds of buffer {i}, {where}")
