"""Support rules shared by the JIT paged-attention backends' `unsupported_reason`.

Each backend passes the head dims its tiles are compiled for; the rest is common: the tensor
cores take fp16/bf16 operands only, a query tile packs whole GQA groups (group <= 8), and the
kernels are tested at block sizes 8, 16 and 32 (any other size goes to the reference).
"""

from __future__ import annotations

import hashlib

import mlx.core as mx

from paged_prefix.contract import check_attention_inputs
from paged_prefix.metadata import AttentionMetadata

DTYPES = (mx.float16, mx.bfloat16)
BLOCK_SIZES = (8, 16, 32)
MAX_GROUP = 8


def unsupported_reason(q: mx.array, k_cache: mx.array, head_dims: tuple[int, ...]) -> str | None:
    """Why a kernel with these head dims cannot run this call, or None when it can."""
    if q.ndim != 3 or k_cache.ndim != 4:
        return f"shapes q {q.shape} / k_cache {k_cache.shape} are not [T,H,D] / [N,B,Hkv,D]"
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


def validate_call(
    backend: str, q: mx.array, k_cache: mx.array, v_cache: mx.array, meta: AttentionMetadata,
    why_not: str | None,
) -> None:
    """A kernel wrapper's entry check: the contract, then the backend's own support."""
    check_attention_inputs(q, k_cache, v_cache, meta)
    if why_not:
        raise ValueError(f"{backend} paged attention cannot run this call: {why_not}")


def source_hash(*sources: str) -> str:
    """Short hash of kernel sources, for kernel names: MLX caches compiled kernels by name
    (on disk too) and would silently reuse a stale one after a source change."""
    return hashlib.sha1("".join(sources).encode()).hexdigest()[:10]


def dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).split(".")[-1]
