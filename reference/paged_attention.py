"""Gather-based paged attention: the reference path and the oracle for the kernels.

Each sequence's K/V are gathered from its block table into contiguous arrays, then
`mx.fast.scaled_dot_product_attention` runs with the "causal" mask, which MLX aligns
bottom-right when there are fewer queries than keys, and which takes Hkv < H heads
natively (no repeated K/V).
"""

from __future__ import annotations

import mlx.core as mx

from paged_prefix.contract import check_attention_inputs
from paged_prefix.metadata import AttentionMetadata


def gather_kv(
    k_cache: mx.array, v_cache: mx.array, block_table: mx.array, seq_len: int
) -> tuple[mx.array, mx.array]:
    """Contiguous K/V of one sequence.

    k_cache, v_cache: [num_blocks, block_size, Hkv, D]; block_table: [n] int32 with
    n * block_size >= seq_len. Returns two [seq_len, Hkv, D] arrays.
    """
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    n = -(-seq_len // block_size)
    ids = block_table[:n]
    k = k_cache[ids].reshape(n * block_size, num_kv_heads, head_dim)[:seq_len]
    v = v_cache[ids].reshape(n * block_size, num_kv_heads, head_dim)[:seq_len]
    return k, v


def paged_attention(
    q: mx.array, k_cache: mx.array, v_cache: mx.array, meta: AttentionMetadata, scale: float
) -> mx.array:
    """The contract of `paged_prefix.contract`, one gather + SDPA per sequence."""
    check_attention_inputs(q, k_cache, v_cache, meta)
    outs = []
    cu = meta.cu_seqlens_q_host
    for s in range(meta.num_seqs):
        start, end = int(cu[s]), int(cu[s + 1])
        k, v = gather_kv(k_cache, v_cache, meta.block_tables[s], int(meta.seq_lens_host[s]))
        qs = q[start:end].transpose(1, 0, 2)[None]  # [1, H, Lq, D]
        o = mx.fast.scaled_dot_product_attention(
            qs,
            k.transpose(1, 0, 2)[None],
            v.transpose(1, 0, 2)[None],
            scale=scale,
            mask="causal" if end - start > 1 else None,
        )
        outs.append(o[0].transpose(1, 0, 2))  # [Lq, H, D]
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)
