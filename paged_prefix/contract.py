"""The attention contract shared by the reference and every JIT kernel.

    out = paged_attention(q, k_cache, v_cache, meta, scale)

q        [T, H, D]   new tokens of all sequences, packed by `meta.cu_seqlens_q`, RoPE applied.
k_cache  [num_blocks, block_size, Hkv, D]   paged keys (after RoPE), already holding the
v_cache  [num_blocks, block_size, Hkv, D]   new tokens' K/V: the cache write comes first.
meta     AttentionMetadata (block_tables, seq_lens, context_lens, cu_seqlens_q).
scale    softmax scale (usually D ** -0.5).
out      [T, H, D], q's dtype.

Query head h reads kv head h // (H // Hkv) (GQA). New token i of sequence s attends to keys
0 .. context_lens[s] + i of that sequence (bottom-right-aligned causal); keys are read
through block_tables[s], never from a contiguous copy in the kernels.
"""

from __future__ import annotations

import mlx.core as mx

from .metadata import AttentionMetadata


def check_attention_inputs(
    q: mx.array, k_cache: mx.array, v_cache: mx.array, meta: AttentionMetadata
) -> None:
    """Raise ValueError naming the first input that breaks the contract."""
    if q.ndim != 3:
        raise ValueError(f"q: expected [T, H, D], got shape {q.shape}")
    if q.shape[0] != meta.num_tokens:
        raise ValueError(f"q: {q.shape[0]} rows but cu_seqlens_q packs {meta.num_tokens} tokens")
    if k_cache.ndim != 4:
        raise ValueError(f"k_cache: expected [num_blocks, block_size, Hkv, D], got {k_cache.shape}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache: shape {v_cache.shape} differs from k_cache {k_cache.shape}")
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    if block_size != meta.block_size:
        raise ValueError(f"k_cache: block size {block_size} but metadata says {meta.block_size}")
    if num_blocks < meta.num_blocks:
        raise ValueError(
            f"k_cache: {num_blocks} blocks but block tables may name {meta.num_blocks}")
    if q.shape[2] != head_dim:
        raise ValueError(f"q: head_dim {q.shape[2]} differs from the cache's {head_dim}")
    if q.shape[1] % num_kv_heads:
        raise ValueError(f"q: {q.shape[1]} heads is not a multiple of {num_kv_heads} kv heads")
    if q.dtype != k_cache.dtype or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"q: dtype {q.dtype} must match k_cache {k_cache.dtype} and v_cache {v_cache.dtype}"
        )
