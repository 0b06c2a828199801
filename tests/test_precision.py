"""Float32 is float32 on every backend (`paged_prefix.precision`): MLX's TF32 default is turned
off before MLX loads, unless the user set it."""

import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from tests.conftest import HAS_CUDA


def test_importing_paged_prefix_turns_tf32_off():
    assert os.environ.get("MLX_ENABLE_TF32") == "0"


def test_a_users_choice_is_kept():
    code = "import os, paged_prefix; print(os.environ['MLX_ENABLE_TF32'])"
    env = {**os.environ, "MLX_ENABLE_TF32": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "1"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA backend")
def test_float32_matmul_on_cuda_is_float32():
    """TF32 rounds operands to 10 mantissa bits: ~1e-3 relative on a 1024-long dot product of
    unit normals, where float32 is within ~1e-5 (the bound below)."""
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((256, 1024)), rng.standard_normal((1024, 256))
    got = np.array(mx.array(a, dtype=mx.float32) @ mx.array(b, dtype=mx.float32))
    want = a.astype(np.float32).astype(np.float64) @ b.astype(np.float32).astype(np.float64)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
