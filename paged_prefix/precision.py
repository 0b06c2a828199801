"""Float32 means float32: MLX's CUDA backend (and Apple's M5-class GPUs) run float32
matmul-family ops as TF32 by default (10-bit mantissa), which put a float32 model's attention
~1e-3 relative off a float64 oracle on the H200. The runner turns that off unless the user set
MLX_ENABLE_TF32 (1 keeps MLX's default, faster and coarser), before MLX's first import, and
says which is in force. bfloat16 and float16 models are not affected."""

from __future__ import annotations

import os

ENV_VAR = "MLX_ENABLE_TF32"


def keep_float32() -> None:
    """Full float32 matmuls unless the user chose otherwise; call before importing mlx.core."""
    os.environ.setdefault(ENV_VAR, "0")


def status_line() -> str:
    value = os.environ.get(ENV_VAR)
    return ("float32 matmuls in full float32 (MLX_ENABLE_TF32=0)" if value == "0"
            else f"float32 matmuls may run as TF32 (MLX_ENABLE_TF32={value})")
