"""Support rules shared by the JIT paged-attention backends' `unsupported_reason`.

Each backend passes the head dims its tiles are compiled for; the rest is common: the tensor
cores take fp16/bf16 operands only, a query tile packs whole GQA groups (group <= 8), and the
kernels are tested at block sizes 8, 16 and 32 (any other size goes to the reference).
"""

from __future__ import annotations

import mlx.core as mx

DTYPES = (mx.float16, mx.bfloat16)
BLOCK_SIZES = (8, 16, 32)
MAX_GROUP = 8


def unsupported_reason(q: mx.array, k_cache: mx.array, head_dims: tuple[int, ...]) -> str | None:
    """Why a kernel with these head dims cannot run this call, or None when it can.

    Call after `check_attention_inputs` (shapes are assumed consistent).
    """
    if q.dtype not in DTYPES:
        return f"dtype {q.dtype} (kernels take float16/bfloat16)"
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    if head_dim not in head_dims:
        return f"head_dim {head_dim} (kernel built for {head_dims})"
    group = q.shape[1] // num_kv_heads
    if not 1 <= group <= MAX_GROUP:
        return f"GQA group {group} (kernel packs groups of 1..{MAX_GROUP})"
    if block_size not in BLOCK_SIZES:
        return f"block size {block_size} (kernel tested for {BLOCK_SIZES})"
    return None
