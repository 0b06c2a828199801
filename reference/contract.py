"""The paged-attention contract shared by the reference and every JIT kernel.

    out = paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale,
                          window=None, softcap=None, sinks=None)

q             [T, H, D]   new tokens of all sequences, packed, RoPE applied.
k_cache       [num_blocks, block_size, Hkv, D]   paged keys (after RoPE) and values, already
v_cache       [num_blocks, block_size, Hkv, D]   holding the new tokens: the cache write comes first.
block_tables  [S, max_blocks] int32 (device): row s lists sequence s's blocks in order; only the
              first ceil(seq_lens[s] / block_size) entries are read.
cu_seqlens_q  [S + 1] host ints: sequence s owns rows cu_seqlens_q[s] : cu_seqlens_q[s + 1] of q.
seq_lens      [S] host ints: cached + new tokens of each sequence.
scale         softmax scale (usually D ** -0.5).
out           [T, H, D], q's dtype.

Query head h reads kv head h // (H // Hkv) (GQA). New token i of sequence s sits at position
context_lens[s] + i, where context_lens = seq_lens - q_lens, and attends to keys
0 .. context_lens[s] + i (bottom-right-aligned causal). Kernels read keys through the block
table, never from a contiguous copy; block ids are the caller's to validate (they live on the
device here, and reading them back would cost a sync per call).

Variants (each layer's own; None leaves it out):
window   W >= 1: the query at position p sees keys max(0, p - W + 1) .. p. The first key any new
         query of sequence s sees is key_start = max(0, context_lens[s] - W + 1): pages wholly
         before it are never read (under vLLM's hybrid KV manager they are the null block or
         another request's).
softcap  cap > 0: each logit s = scale * q.k becomes cap * tanh(s / cap) before mask and softmax.
sinks    [H] float32: per query head a logit that joins the softmax's denominator and holds no
         value: out_h = sum_j e^(s_j - m) v_j / (sum_j e^(s_j - m) + e^(sink_h - m)).
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np


def host_ints(values, field: str) -> np.ndarray:
    """A flat host array of integers as int64; floats and bools are refused, not truncated."""
    arr = np.asarray(values)
    if arr.ndim == 1 and arr.size == 0:  # an empty list carries no dtype
        return arr.astype(np.int64)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise ValueError(f"{field}: expected a flat array of integers, got {arr.dtype} "
                         f"of shape {arr.shape}")
    if arr.dtype == np.uint64 and arr.size and arr.max() > np.iinfo(np.int64).max:
        raise ValueError(f"{field}: {arr.max()} does not fit int64")
    return arr.astype(np.int64)


def check_lengths(cu_seqlens_q: np.ndarray,
                  seq_lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The host half of the contract (what a plan checks once per forward); returns both as
    int64 arrays."""
    cu_seqlens_q = host_ints(cu_seqlens_q, "cu_seqlens_q")
    seq_lens = host_ints(seq_lens, "seq_lens")
    num_seqs = len(seq_lens)
    if num_seqs == 0:
        raise ValueError("seq_lens: a batch needs at least one sequence")
    if len(cu_seqlens_q) != num_seqs + 1:
        raise ValueError(f"cu_seqlens_q: expected {num_seqs + 1} entries for {num_seqs} "
                         f"sequences, got {len(cu_seqlens_q)}")
    q_lens = np.diff(cu_seqlens_q)
    if cu_seqlens_q[0] != 0 or (q_lens < 1).any():
        raise ValueError(f"cu_seqlens_q: must start at 0 and grow by >= 1, got {list(cu_seqlens_q)}")
    if (seq_lens < q_lens).any():
        raise ValueError(f"seq_lens: {list(seq_lens)} shorter than the new tokens {list(q_lens)}")
    return cu_seqlens_q, seq_lens


def check_arrays(q: mx.array, k_cache: mx.array, v_cache: mx.array, block_tables: mx.array,
                 num_tokens: int, num_seqs: int, max_seq_len: int) -> None:
    """The device half: shapes and dtypes only, cheap enough for every layer's call."""
    if q.ndim != 3:
        raise ValueError(f"q: expected [T, H, D], got shape {q.shape}")
    if k_cache.ndim != 4:
        raise ValueError(f"k_cache: expected [num_blocks, block_size, Hkv, D], got {k_cache.shape}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache: shape {v_cache.shape} differs from k_cache {k_cache.shape}")
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    if q.shape[2] != head_dim:
        raise ValueError(f"q: head_dim {q.shape[2]} differs from the cache's {head_dim}")
    if q.shape[1] % num_kv_heads:
        raise ValueError(f"q: {q.shape[1]} heads is not a multiple of {num_kv_heads} kv heads")
    if q.dtype != k_cache.dtype or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"q: dtype {q.dtype} must match k_cache {k_cache.dtype} and v_cache {v_cache.dtype}")
    if q.shape[0] != num_tokens:
        raise ValueError(f"q: {q.shape[0]} rows but cu_seqlens_q packs {num_tokens} tokens")
    if block_tables.ndim != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables: expected [{num_seqs}, max_blocks], got {block_tables.shape}")
    if block_tables.dtype != mx.int32:
        raise ValueError(f"block_tables: dtype {block_tables.dtype}, expected int32")
    needed = -(-max_seq_len // block_size)
    if block_tables.shape[1] < needed:
        raise ValueError(f"block_tables: {block_tables.shape[1]} columns but the longest "
                         f"sequence needs {needed} blocks of {block_size}")


def check_paged_inputs(
    q: mx.array, k_cache: mx.array, v_cache: mx.array, block_tables: mx.array,
    cu_seqlens_q: np.ndarray, seq_lens: np.ndarray,
) -> None:
    """Raise ValueError naming the first input that breaks the contract (no device sync)."""
    cu, lens = check_lengths(cu_seqlens_q, seq_lens)
    check_arrays(q, k_cache, v_cache, block_tables, int(cu[-1]), len(lens), int(lens.max()))


def check_scale(scale) -> None:
    """Any finite real scale is attention (a kernel may compile in positive ones only)."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or \
            not math.isfinite(scale):
        raise ValueError(f"scale: expected a finite float, got {scale!r}")


def check_variant(window, softcap, sinks, num_heads: int) -> None:
    """The variant arguments: ValueError naming the first that is malformed."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                               or window < 1):
        raise ValueError(f"window: expected a positive int or None, got {window!r}")
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float))
                                or not math.isfinite(softcap) or softcap <= 0):
        raise ValueError(f"softcap: expected a positive finite float or None, got {softcap!r}")
    if sinks is not None and (not isinstance(sinks, mx.array) or sinks.shape != (num_heads,)
                              or not mx.issubdtype(sinks.dtype, mx.floating)):
        raise ValueError(f"sinks: expected a float [{num_heads}] array (one per query head), got "
                         f"{getattr(sinks, 'shape', type(sinks).__name__)}")
