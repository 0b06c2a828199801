"""MLX's CPU matmuls on OpenBLAS (paged_prefix/cpu_blas.py): bound, forwarded right, reported.

Under `nox -s tests` (PAGED_PREFIX_CPU_BLAS=openblas) this process must run on OpenBLAS; the
other settings and a wrong import order are checked in child processes, since a process binds
its BLAS once."""

from __future__ import annotations

import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from paged_prefix import cpu_blas

LINUX = sys.platform.startswith("linux")


def child(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=120)


def test_this_process_runs_on_openblas():
    if not cpu_blas.status().active and cpu_blas.setting() != "openblas":
        pytest.skip(f"OpenBLAS not required here: {cpu_blas.status_line()}")
    assert cpu_blas.require().active, cpu_blas.status_line()
    assert "OpenBLAS" in cpu_blas.status_line()


@pytest.mark.skipif(not LINUX, reason="the shim is Linux's")
@pytest.mark.parametrize("dtype", [mx.float32, mx.float64, mx.complex64],
                         ids=["sgemm", "dgemm", "cgemm"])
@pytest.mark.parametrize("layout", ["nn", "nt", "tn"])
def test_forwarded_calls_compute_the_product(dtype, layout):
    """Every forwarded call, each transpose MLX passes (a linear layer's x @ w.T is "nt")."""
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((37, 53)), rng.standard_normal((53, 29))
    if dtype == mx.complex64:
        a, b = a + 1j * rng.standard_normal(a.shape), b + 1j * rng.standard_normal(b.shape)
    x = mx.array(a.T.copy(), dtype=dtype).T if layout == "tn" else mx.array(a, dtype=dtype)
    y = mx.array(b.T.copy(), dtype=dtype).T if layout == "nt" else mx.array(b, dtype=dtype)
    got = np.array(mx.matmul(x, y, stream=mx.cpu))
    tol = 1e-12 if dtype == mx.float64 else 2e-5
    np.testing.assert_allclose(got, a @ b, rtol=tol, atol=tol * 60)


@pytest.mark.skipif(not LINUX, reason="the shim is Linux's")
def test_bundled_setting_keeps_mlx_blas():
    done = child("from paged_prefix import cpu_blas; print(cpu_blas.status())",
                 PAGED_PREFIX_CPU_BLAS="bundled")
    assert done.returncode == 0, done.stderr
    assert "active=False" in done.stdout and "PAGED_PREFIX_CPU_BLAS=bundled" in done.stdout


@pytest.mark.skipif(not LINUX, reason="the shim is Linux's")
def test_mlx_imported_first_is_named_and_fails_where_required():
    code = "import mlx.core\nfrom paged_prefix import cpu_blas\nprint(cpu_blas.status_line())\n"
    done = child(code, PAGED_PREFIX_CPU_BLAS="")
    assert done.returncode == 0, done.stderr
    assert "bundled reference BLAS" in done.stdout and "imported before paged_prefix" in done.stdout
    done = child(code + "cpu_blas.require()", PAGED_PREFIX_CPU_BLAS="openblas")
    assert done.returncode != 0 and "RuntimeError: PAGED_PREFIX_CPU_BLAS=openblas" in done.stderr


def test_bad_setting_names_the_variable(monkeypatch):
    monkeypatch.setenv("PAGED_PREFIX_CPU_BLAS", "mkl")
    with pytest.raises(ValueError, match="PAGED_PREFIX_CPU_BLAS"):
        cpu_blas.setting()
