"""Dense attention oracle: contiguous K/V, explicit mask, float32, never touches a cache."""

from __future__ import annotations

import mlx.core as mx


def dense_attention(
    q: mx.array, k: mx.array, v: mx.array, scale: float, context_len: int = 0
) -> mx.array:
    """Bottom-right-aligned causal attention of one sequence, computed the slow obvious way.

    q: [Lq, H, D] queries at positions context_len .. context_len + Lq - 1.
    k, v: [context_len + Lq, Hkv, D] every key of the sequence.
    Returns [Lq, H, D] in q's dtype. K/V heads are repeated: clarity over memory.
    """
    lq, num_heads, _ = q.shape
    lk, num_kv_heads, _ = k.shape
    if lk != context_len + lq:
        raise ValueError(f"k: {lk} keys but context_len + Lq = {context_len + lq}")
    group = num_heads // num_kv_heads
    qf = q.astype(mx.float32).transpose(1, 0, 2)  # [H, Lq, D]
    kf = mx.repeat(k.astype(mx.float32).transpose(1, 0, 2), group, axis=0)  # [H, Lk, D]
    vf = mx.repeat(v.astype(mx.float32).transpose(1, 0, 2), group, axis=0)
    scores = (qf @ kf.transpose(0, 2, 1)) * scale  # [H, Lq, Lk]
    visible = mx.arange(lk)[None, :] <= (context_len + mx.arange(lq))[:, None]
    scores = mx.where(visible, scores, -mx.inf)
    out = mx.softmax(scores, axis=-1) @ vf  # [H, Lq, D]
    return out.transpose(1, 0, 2).astype(q.dtype)
