"""Compile an inline CUDA source for one GPU architecture with NVRTC, for
`mx.fast.precompiled_cuda_kernel`.

`mx.fast.cuda_kernel` compiles for the device's plain compute capability (sm_90 on Hopper),
where the wgmma instructions do not exist: they need the architecture-specific sm_90a target.
This calls the same libnvrtc that MLX's CUDA backend loads (CUDA 13: `libnvrtc.so.13`), found
on the loader's path, in the `nvidia/cu13/lib` folder of an installed NVIDIA wheel, or under
CUDA_HOME. The source must be self-contained (no #include): NVRTC gets no include path here.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from pathlib import Path

LIBRARY = "libnvrtc.so.13"


class NvrtcError(RuntimeError):
    """NVRTC is missing, or refused a source (the message holds its log)."""


def _candidates() -> list[str]:
    paths = [LIBRARY]
    for entry in sys.path:
        paths.append(str(Path(entry) / "nvidia" / "cu13" / "lib" / LIBRARY))
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            paths += [str(Path(home) / "lib64" / LIBRARY), str(Path(home) / "lib" / LIBRARY)]
    return paths


@functools.cache
def library() -> ctypes.CDLL:
    tried = []
    for path in _candidates():
        if os.sep in path and not Path(path).exists():
            continue
        try:
            return ctypes.CDLL(path)
        except OSError as error:
            tried.append(f"{path}: {error}")
    raise NvrtcError(f"{LIBRARY} not found (tried the loader path, nvidia/cu13/lib on "
                     f"sys.path and CUDA_HOME): {'; '.join(tried) or 'no candidate exists'}")


def _check(lib: ctypes.CDLL, status: int, call: str) -> None:
    if status:
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        raise NvrtcError(f"{call}: {lib.nvrtcGetErrorString(status).decode()}")


def compile_cubin(source: str, name: str, arch: str, options: tuple[str, ...] = ()) -> bytes:
    """The cubin of `source` for `arch` (e.g. "sm_90a"); `name` names the program in logs."""
    lib = library()
    prog = ctypes.c_void_p()
    _check(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), f"{name}.cu".encode(),
                                       0, None, None), "nvrtcCreateProgram")
    try:
        opts = [f"--gpu-architecture={arch}", "-std=c++17", "-default-device", *options]
        argv = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
        status = lib.nvrtcCompileProgram(prog, len(opts), argv)
        if status:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, log)
            raise NvrtcError(f"{name} for {arch}: {log.value.decode(errors='replace')[-4000:]}")
        size = ctypes.c_size_t()
        _check(lib, lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
        cubin = ctypes.create_string_buffer(size.value)
        _check(lib, lib.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        return cubin.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
