"""Gather-based paged attention: the reference path and the oracle for the kernels.

Each sequence's visible K/V (from `key_start` on) are gathered from its block table into
contiguous arrays, then `mx.fast.scaled_dot_product_attention` runs with the "causal" mask,
which MLX aligns bottom-right when there are fewer queries than keys, and which takes Hkv < H
heads natively (no repeated K/V). A window that cuts inside the gathered keys becomes a boolean
mask; softcapped logits, which SDPA cannot take, run as plain ops in float32 (`joined_sdpa`).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .contract import check_paged_inputs, check_scale, check_variant

_HALF = (mx.float16, mx.bfloat16)


def key_start(context_len, window: int | None):
    """The first key any new query of a sequence sees: its first new query sits at position
    `context_len` and, with a window W, sees keys from context_len - W + 1 on. Works on ints
    and on numpy arrays of context lengths alike."""
    if window is None:
        return context_len * 0
    return np.maximum(context_len - window + 1, 0)


def window_mask(q_len: int, k_len: int, window: int | None) -> mx.array | str | None:
    """SDPA's mask for q_len queries at the last positions of k_len keys: bottom-right causal,
    and with a window W each query's W latest keys only (a boolean array once W cuts inside).
    Callers that attend many times over one shape build it once (`masked_sdpa`)."""
    if window is None or k_len <= window:
        return "causal" if q_len > 1 else None
    q_pos = mx.arange(k_len - q_len, k_len)[:, None]
    k_pos = mx.arange(k_len)[None, :]
    return (k_pos <= q_pos) & (k_pos > q_pos - window)


def joined_sdpa(q: mx.array, ks, vs, scale: float, mask, softcap: float | None = None,
                sinks: mx.array | None = None) -> mx.array:
    """Attention over the keys of several K/V pieces as over their concatenation, in plain
    float32 ops, without copying the pieces together: one softmax over every piece's scores,
    then each piece's share of the values. So pages that lie in a few runs of blocks are read
    where they lie, and softcapped logits (cap * tanh(scale q.k / cap)), which SDPA cannot
    take, run here too.

    q [1, H, Lq, D] at the last Lq positions of the joined keys; ks, vs: pieces [1, Hkv, Li, D]
    in key order; `mask` for [Lq, sum Li] as `masked_sdpa` takes it.
    """
    _, heads, q_len, head_dim = q.shape
    kv_heads = ks[0].shape[1]
    group = heads // kv_heads
    k_len = sum(k.shape[2] for k in ks)
    # a kv head's queries stacked, so each piece is one matmul with no broadcast K
    qg = q.astype(mx.float32).reshape(1, kv_heads, group * q_len, head_dim)
    scores = [qg @ k.astype(mx.float32).swapaxes(-1, -2) for k in ks]
    s = scores[0] if len(scores) == 1 else mx.concatenate(scores, axis=-1)
    s = s.reshape(1, kv_heads, group, q_len, k_len) * scale
    if softcap is not None:
        s = softcap * mx.tanh(s / softcap)
    if isinstance(mask, str):  # "causal", bottom-right
        mask = mx.arange(k_len)[None, :] <= mx.arange(k_len - q_len, k_len)[:, None]
    if mask is not None:
        s = mx.where(mask, s, -mx.inf)
    if sinks is not None:  # a column of its own that holds no value
        sink = mx.broadcast_to(sinks.astype(mx.float32).reshape(1, kv_heads, group, 1, 1),
                               (*s.shape[:-1], 1))
        s = mx.concatenate([s, sink], axis=-1)
    p = mx.softmax(s, axis=-1, precise=True).reshape(1, kv_heads, group * q_len, -1)
    out, first = None, 0
    for v in vs:
        n = v.shape[2]
        part = p[..., first:first + n] @ v.astype(mx.float32)
        out, first = part if out is None else out + part, first + n
    return out.reshape(1, heads, q_len, head_dim).astype(q.dtype)


def sdpa(q: mx.array, k: mx.array, v: mx.array, scale: float, window: int | None = None,
         softcap: float | None = None, sinks: mx.array | None = None) -> mx.array:
    """Bottom-right causal attention of one sequence, with fp32 scores on every backend.

    q [1, H, Lq, D] at the last Lq positions of k, v [1, Hkv, Lk, D]; returns q's shape and
    dtype. `window`, `softcap`, `sinks` as in `reference.contract`.
    """
    return masked_sdpa(q, k, v, scale, window_mask(q.shape[2], k.shape[2], window), softcap,
                       sinks)


def masked_sdpa(q: mx.array, k: mx.array, v: mx.array, scale: float, mask,
                softcap: float | None = None, sinks: mx.array | None = None, *,
                kv_laid_head_major: bool = False) -> mx.array:
    """`sdpa` with its mask given: `window_mask(Lq, Lk, window)` of these shapes. MLX's CPU
    fallback computes half-precision inputs with half-precision scores (up to ~1e-2 off for
    large scores), while the GPU kernels accumulate scores in fp32: on the CPU half inputs are
    upcast so that the reference means the same thing everywhere. There K and V also go in as
    head-major copies: that SDPA is plain ops, which ran slower over the caches' token-major
    rows (a SmolLM2 decode step 1.24-1.28x mlx-lm's without the copies, 1.16-1.18x with them:
    docs/cpu.md), unless `kv_laid_head_major` says each kv head's rows already lie together in
    memory (a heads-major cache read in place), which that SDPA reads as they are. The GPU path
    is untouched.
    """
    if softcap is not None:
        return joined_sdpa(q, (k,), (v,), scale, mask, softcap, sinks)
    extra = {} if sinks is None else {"sinks": sinks.astype(mx.float32)}
    if mx.default_device() == mx.cpu:
        half = q.dtype in _HALF
        if half or not kv_laid_head_major:
            k, v = (x.astype(mx.float32) if half else mx.contiguous(x) for x in (k, v))
        out = mx.fast.scaled_dot_product_attention(q.astype(mx.float32) if half else q, k, v,
                                                   scale=scale, mask=mask, **extra)
        return out.astype(q.dtype) if half else out
    if sinks is not None and q.dtype in _HALF:
        extra["sinks"] = sinks.astype(q.dtype)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask, **extra)


def heads_first(x: mx.array) -> mx.array:
    """[L, heads, D] -> [1, heads, L, D] as a view (expand, then transpose: transposing first
    and expanding a strided array would copy it)."""
    return x[None].transpose(0, 2, 1, 3)


def tokens_first(o: mx.array) -> mx.array:
    """SDPA's [1, H, L, D] output -> [L, H, D]; a view, since MLX lays the output out like q."""
    _, heads, length, head_dim = o.shape
    return o.transpose(0, 2, 1, 3).reshape(length, heads, head_dim)


def gather_kv(
    k_cache: mx.array, v_cache: mx.array, block_table: mx.array, seq_len: int, start: int = 0
) -> tuple[mx.array, mx.array]:
    """Keys and values start .. seq_len - 1 of one sequence gathered from its pages, as SDPA
    takes them; the pages wholly before `start` are never read.

    k_cache, v_cache: [num_blocks, block_size, Hkv, D]; block_table: [n] int32 with
    n * block_size >= seq_len. Returns two [1, Hkv, seq_len - start, D] arrays.
    """
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    first, n = start // block_size, -(-seq_len // block_size)
    ids = block_table[first:n]
    rows = slice(start - first * block_size, seq_len - first * block_size)
    k = k_cache[ids].reshape(-1, num_kv_heads, head_dim)[rows]
    v = v_cache[ids].reshape(-1, num_kv_heads, head_dim)[rows]
    return heads_first(k), heads_first(v)


def paged_attention(
    q: mx.array, k_cache: mx.array, v_cache: mx.array, block_tables: mx.array,
    cu_seqlens_q: np.ndarray, seq_lens: np.ndarray, scale: float, *,
    window: int | None = None, softcap: float | None = None, sinks: mx.array | None = None,
) -> mx.array:
    """The contract of `reference.contract`, one gather + SDPA per sequence."""
    check_paged_inputs(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens)
    check_scale(scale)
    check_variant(window, softcap, sinks, q.shape[1])
    outs = []
    for s in range(len(seq_lens)):
        start, end = int(cu_seqlens_q[s]), int(cu_seqlens_q[s + 1])
        seq_len = int(seq_lens[s])
        first = int(key_start(seq_len - (end - start), window))
        k, v = gather_kv(k_cache, v_cache, block_tables[s], seq_len, first)
        outs.append(tokens_first(sdpa(heads_first(q[start:end]), k, v, scale, window, softcap,
                                      sinks)))
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)
