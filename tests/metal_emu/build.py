"""g++ builds of emulated kernels, cached on disk by the hash of everything that goes in.

-Wall -Wextra everywhere; strict builds (the compile check of every variant) make warnings
errors, builds for running let a warning pass. Suppressed, as emulation noise only:
-Wattributes (g++ ignores Metal's `[[kernel]]`, `[[buffer(n)]]`, `[[thread_position_in_grid]]`,
`[[host_name(...)]]`) and -Wunknown-pragmas (`clang loop unroll`). -fno-strict-aliasing because
Metal kernels cast device pointers to vector pointers (`*(const device vec<T, 4>*)(p)`), which
the GPU compiler allows."""

from __future__ import annotations

import hashlib
import os
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
INCLUDE = HERE / "include"
RUNTIME = HERE / "runtime.cpp"
CXX = os.environ.get("CXX", "g++")
FLAGS = ["-std=c++20", "-fPIC", "-pthread", "-fno-strict-aliasing",
         "-Wall", "-Wextra", "-Wno-attributes", "-Wno-unknown-pragmas"]
KERNEL_OPT = os.environ.get("MSL_EMU_OPT", "-O1")


class CompileError(RuntimeError):
    """g++ rejected a kernel (or the runtime); the message holds its diagnostics."""


def cache_dir() -> Path:
    root = os.environ.get("MSL_EMU_CACHE") or Path(tempfile.gettempdir()) / f"metal_emu-{os.getuid()}"
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def _toolchain_hash() -> str:
    """Compiler, flags, runtime and emulation headers: a change to any rebuilds everything."""
    h = hashlib.sha256()
    h.update(subprocess.run([CXX, "--version"], capture_output=True, text=True, check=True).stdout.encode())
    h.update(" ".join(FLAGS + [KERNEL_OPT]).encode())
    for path in sorted([RUNTIME, *INCLUDE.rglob("*")]):
        if path.is_file():
            h.update(path.name.encode() + path.read_bytes())
    return h.hexdigest()[:16]


_TOOLCHAIN: str | None = None


def toolchain() -> str:
    global _TOOLCHAIN
    if _TOOLCHAIN is None:
        _TOOLCHAIN = _toolchain_hash()
    return _TOOLCHAIN


def _compile(args: list[str], out: Path, what: str) -> None:
    """Runs g++ into a temporary name, then renames: concurrent builds never see half a file."""
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    proc = subprocess.run([CXX, *args, "-o", str(tmp)], capture_output=True, text=True)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise CompileError(f"{what} does not compile:\n{proc.stderr[-8000:]}")
    os.replace(tmp, out)


def runtime_object() -> Path:
    obj = cache_dir() / f"runtime-{toolchain()}.o"
    if not obj.exists():
        _compile([*FLAGS, "-Werror", "-O2", "-c", str(RUNTIME)], obj, "the emulation runtime")
    return obj


def _library(tu: str, strict: bool) -> tuple[Path, list[str]]:
    flags = [*FLAGS, KERNEL_OPT, *(["-Werror"] if strict else [])]
    key = hashlib.sha256((toolchain() + " ".join(flags) + tu).encode()).hexdigest()[:24]
    return cache_dir() / f"kernel-{key}.so", flags


def build(tu: str, strict: bool = False) -> Path:
    """The shared object of one translation unit (emulate.translation_unit), built once. A
    strict build of the same unit serves a non-strict request: it is the same object."""
    lib, flags = _library(tu, strict)
    if not strict and not lib.exists() and _library(tu, True)[0].exists():
        return _library(tu, True)[0]
    if not lib.exists():
        src = lib.with_suffix(".cpp")
        src.write_text(tu)
        _compile([*flags, "-shared", f"-I{INCLUDE}", str(src), str(runtime_object())], lib,
                 f"kernel {src}")
    return lib


def strict_check(tus: dict[str, str], jobs: int | None = None) -> dict[str, str]:
    """Compiles each translation unit with warnings as errors, in parallel (the threads only
    wait on g++); returns {name: diagnostics} of those that fail."""
    runtime_object()

    def check(item):
        try:
            build(item[1], strict=True)
        except CompileError as e:
            return item[0], str(e)
        return item[0], None

    with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as pool:
        return {name: err for name, err in pool.map(check, tus.items()) if err}
