"""MLX's CPU matmuls on OpenBLAS instead of the reference BLAS that `mlx[cpu]` bundles.

The wheel's libmlx.so links the reference BLAS it ships (mlx_cpu.libs/libblas-*.so.3), about
ten times slower than OpenBLAS at float32 matmuls (docs/cpu.md, measured by bench/cpu_blas.py).
`load()`, which `import paged_prefix` runs before any of its modules imports MLX, loads
scipy-openblas32's self-contained OpenBLAS and then the shim built from cblas_shim.c (the
unprefixed cblas_sgemm/dgemm/cgemm that MLX calls), both RTLD_GLOBAL: the dynamic linker
searches the global scope before a library's own dependencies, so mlx.core, imported after,
binds its cblas_* calls to the shim. Where mlx.core was imported first it has bound them
already, for the life of the process. `status()` runs one float32 matmul and reads the shim's
call counter, so "active" means MLX called OpenBLAS, not merely that it was loaded.

PAGED_PREFIX_CPU_BLAS (Linux only: macOS's MLX has Accelerate and nothing here runs):
  unset     OpenBLAS where installed, else MLX's bundled BLAS, which status_line() names
  openblas  required: require() raises where MLX's matmuls do not reach OpenBLAS (nox sets it)
  bundled   MLX's bundled reference BLAS (the benchmark's baseline)
OPENBLAS_NUM_THREADS, when set, is OpenBLAS's own thread count; else it runs one thread.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
from dataclasses import dataclass
from functools import lru_cache

ENV_VAR = "PAGED_PREFIX_CPU_BLAS"
SETTINGS = ("", "openblas", "bundled")
SHIM_MODULE = "paged_prefix._cblas_shim"
# One OpenBLAS thread unless OPENBLAS_NUM_THREADS says otherwise: a second one spins while it
# waits, against MLX's and vLLM's own threads; on 2 cores prefill ran 2.3x and decode up to 5x
# slower with it (bench/cpu_blas.py, docs/cpu.md).
THREADS_VAR, DEFAULT_THREADS = "OPENBLAS_NUM_THREADS", 1

_loaded: dict[str, ctypes.CDLL] = {}
_why_not: list[str] = []  # set once by load() where it loads nothing


def setting() -> str:
    value = os.environ.get(ENV_VAR, "").strip()
    if value not in SETTINGS:
        raise ValueError(f"{ENV_VAR}: expected unset, 'openblas' or 'bundled', got {value!r}")
    return value


def _find_libraries() -> tuple[str, str]:
    """(OpenBLAS, shim) paths, or OSError saying which is missing."""
    if importlib.util.find_spec("scipy_openblas32") is None:
        raise OSError("scipy-openblas32 is not installed (pip install scipy-openblas32)")
    shim = importlib.util.find_spec(SHIM_MODULE)
    if shim is None or not shim.origin:
        raise OSError("paged_prefix's CBLAS shim was not built: reinstall paged-prefix where a C "
                      "compiler is on PATH (setup.py builds it, optional)")
    import scipy_openblas32

    return (os.path.join(scipy_openblas32.get_lib_dir(), scipy_openblas32.get_library(True)),
            shim.origin)


def load() -> None:
    """OpenBLAS and the shim into the process's global symbol scope, once (see above)."""
    if _loaded or _why_not or not sys.platform.startswith("linux"):
        return
    if setting() == "bundled":
        _why_not.append(f"{ENV_VAR}=bundled")
        return
    if "mlx.core" in sys.modules:
        _why_not.append("mlx.core was imported before paged_prefix and bound MLX's own BLAS "
                        "(import paged_prefix first)")
        return
    try:
        openblas, shim = _find_libraries()
        _loaded["openblas"] = ctypes.CDLL(openblas, mode=ctypes.RTLD_GLOBAL)
        _loaded["shim"] = ctypes.CDLL(shim, mode=ctypes.RTLD_GLOBAL)  # after: it calls OpenBLAS
        if THREADS_VAR not in os.environ:
            _loaded["openblas"].scipy_openblas_set_num_threads(DEFAULT_THREADS)
    except OSError as e:
        _loaded.clear()
        _why_not.append(str(e))


@dataclass(frozen=True)
class Status:
    active: bool  # MLX's float32 matmul called OpenBLAS in this process
    detail: str   # OpenBLAS's build and threads, or why MLX uses its bundled BLAS


@lru_cache(maxsize=1)
def status() -> Status:
    if not sys.platform.startswith("linux"):
        return Status(False, "not Linux: MLX's own BLAS")
    load()
    if not _loaded:
        return Status(False, _why_not[0])
    import mlx.core as mx

    calls = _loaded["shim"].paged_prefix_cblas_calls
    calls.restype = ctypes.c_uint64
    before = calls()
    a = mx.ones((8, 8), dtype=mx.float32)
    mx.eval(mx.matmul(a, a, stream=mx.cpu))
    if calls() == before:
        return Status(False, "MLX's matmul did not reach the shim (was mlx.core loaded before "
                             "paged_prefix, by another module?)")
    openblas = _loaded["openblas"]
    openblas.scipy_openblas_get_config.restype = ctypes.c_char_p
    config = openblas.scipy_openblas_get_config().decode()
    return Status(True, f"{config}, {openblas.scipy_openblas_get_num_threads()} threads "
                        "(scipy-openblas32)")


def status_line() -> str:
    s = status()
    if s.active:
        return f"MLX's CPU matmuls run on {s.detail}"
    return (f"MLX's CPU matmuls run on its bundled reference BLAS, about 10x slower than "
            f"OpenBLAS in float32 (docs/cpu.md): {s.detail}")


def require() -> Status:
    """status(); raises where PAGED_PREFIX_CPU_BLAS=openblas and MLX's matmuls miss OpenBLAS."""
    s = status()
    if not s.active and setting() == "openblas":
        raise RuntimeError(f"{ENV_VAR}=openblas, but {status_line()}")
    return s
