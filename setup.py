"""Everything but the CBLAS shim is in pyproject.toml. On Linux the shim (a C file with no
Python in it, loaded by paged_prefix/cpu_blas.py through ctypes) puts MLX's CPU matmuls on
OpenBLAS; optional, so an install without a C compiler still works and cpu_blas says why
its matmuls are slow (docs/cpu.md)."""

import sys

from setuptools import Extension, setup

SHIM = Extension("paged_prefix._cblas_shim", ["paged_prefix/cblas_shim.c"],
                 extra_compile_args=["-O2"], optional=True)

setup(ext_modules=[SHIM] if sys.platform.startswith("linux") else [])
