"""Gather-based paged attention: the reference path and the oracle for the kernels.

Each sequence's K/V are gathered from its block table into contiguous arrays, then
`mx.fast.scaled_dot_product_attention` runs with the "causal" mask, which MLX aligns
bottom-right when there are fewer queries than keys, and which takes Hkv < H heads
natively (no repeated K/V).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .contract import check_paged_inputs

_HALF = (mx.float16, mx.bfloat16)


def sdpa(q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
    """Bottom-right causal SDPA of one sequence, with fp32 scores on every backend.

    q [1, H, Lq, D], k, v [1, Hkv, Lk, D]; returns q's shape and dtype. MLX's CPU fallback
    computes half-precision inputs with half-precision scores (up to ~1e-2 off for large
    scores), while the GPU kernels accumulate scores in fp32: on the CPU half inputs are
    upcast so that the reference means the same thing everywhere. The GPU path is untouched.
    """
    mask = "causal" if q.shape[2] > 1 else None
    if q.dtype in _HALF and mx.default_device() == mx.cpu:
        out = mx.fast.scaled_dot_product_attention(
            q.astype(mx.float32), k.astype(mx.float32), v.astype(mx.float32),
            scale=scale, mask=mask)
        return out.astype(q.dtype)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


def heads_first(x: mx.array) -> mx.array:
    """[L, heads, D] -> [1, heads, L, D] as a view (expand, then transpose: transposing first
    and expanding a strided array would copy it)."""
    return x[None].transpose(0, 2, 1, 3)


def tokens_first(o: mx.array) -> mx.array:
    """SDPA's [1, H, L, D] output -> [L, H, D]; a view, since MLX lays the output out like q."""
    _, heads, length, head_dim = o.shape
    return o.transpose(0, 2, 1, 3).reshape(length, heads, head_dim)


def gather_kv(
    k_cache: mx.array, v_cache: mx.array, block_table: mx.array, seq_len: int
) -> tuple[mx.array, mx.array]:
    """K/V of one sequence gathered from its pages, as SDPA takes them.

    k_cache, v_cache: [num_blocks, block_size, Hkv, D]; block_table: [n] int32 with
    n * block_size >= seq_len. Returns two [1, Hkv, seq_len, D] arrays.
    """
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    n = -(-seq_len // block_size)
    ids = block_table[:n]
    k = k_cache[ids].reshape(n * block_size, num_kv_heads, head_dim)[:seq_len]
    v = v_cache[ids].reshape(n * block_size, num_kv_heads, head_dim)[:seq_len]
    return heads_first(k), heads_first(v)


def paged_attention(
    q: mx.array, k_cache: mx.array, v_cache: mx.array, block_tables: mx.array,
    cu_seqlens_q: np.ndarray, seq_lens: np.ndarray, scale: float,
) -> mx.array:
    """The contract of `reference.contract`, one gather + SDPA per sequence."""
    check_paged_inputs(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens)
    outs = []
    for s in range(len(seq_lens)):
        start, end = int(cu_seqlens_q[s]), int(cu_seqlens_q[s + 1])
        k, v = gather_kv(k_cache, v_cache, block_tables[s], int(seq_lens[s]))
        outs.append(tokens_first(sdpa(heads_first(q[start:end]), k, v, scale)))
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)
