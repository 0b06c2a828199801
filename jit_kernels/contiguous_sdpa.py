"""Attention on contiguous K/V, one `mx.fast.scaled_dot_product_attention` per sequence.

A sequence with nothing cached attends over its own new K/V rows and never reads the cache
back (what mlx-lm does with its contiguous cache); one with a cached prefix attends over its
pages copied out by a gather: a backend's page-gather kernel (one launch for the batch), or
MLX's own take (`reference.gather_kv`) where no kernel exists. The contract is the reference's
plus the new rows `k`, `v` [T, Hkv, D], which the cache already holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

import reference

from .page_gather import GatherPlan, PageGather, plan_gather
from .support import Geometry, Lengths, check_call


@dataclass(frozen=True)
class SdpaPlan:
    geometry: Geometry
    lengths: Lengths
    rows: tuple[tuple[int, int], ...]  # each sequence's rows of q: (start, end)
    gather: GatherPlan  # the sequences with a cached prefix, in batch order


def plan_sdpa(cu_seqlens_q: np.ndarray, seq_lens: np.ndarray, geometry: Geometry) -> SdpaPlan:
    lengths = Lengths.of(cu_seqlens_q, seq_lens)
    cu, lens = lengths.cu_seqlens_q, lengths.seq_lens
    cached = [s for s in range(len(lens)) if lens[s] > cu[s + 1] - cu[s]]
    rows = tuple((int(a), int(b)) for a, b in zip(cu[:-1], cu[1:]))
    return SdpaPlan(geometry, lengths, rows, plan_gather(lens, cached, geometry.block_size,
                                                         geometry.num_kv_heads, geometry.head_dim))


def sdpa_attention(
    q: mx.array, k: mx.array, v: mx.array, k_cache: mx.array, v_cache: mx.array,
    block_tables: mx.array, plan: SdpaPlan, gather: PageGather | None = None,
) -> mx.array:
    """out [T, H, D]; `gather` None copies prefixes with MLX's take. No host sync."""
    check_call("sdpa", plan.geometry, q, k_cache, v_cache, block_tables, plan.lengths)
    want = (q.shape[0], k_cache.shape[2], k_cache.shape[3])
    if k.shape != want or v.shape != want:
        raise ValueError(f"k, v: new rows must be {want}, got {k.shape} and {v.shape}")
    return attend(q, k, v, k_cache, v_cache, block_tables, plan, gather)


def attend(
    q: mx.array, k: mx.array, v: mx.array, k_cache: mx.array, v_cache: mx.array,
    block_tables: mx.array, plan: SdpaPlan, gather: PageGather | None = None,
) -> mx.array:
    """`sdpa_attention` without its entry check, for callers that validated the plan against
    these arrays already (a forward calls it once per layer: every op here counts)."""
    g = plan.gather
    if not g.seqs:
        gathered = []
    elif gather is None:
        gathered = [reference.gather_kv(k_cache, v_cache, block_tables[s], n)
                    for s, n in zip(g.seqs, g.seq_lens)]
    else:
        gathered = gather(k_cache, v_cache, block_tables, g)
    by_seq = dict(zip(g.seqs, gathered))
    whole = len(plan.rows) == 1  # one sequence: no slicing (each slice is an op per layer)
    outs = []
    for s, (start, end) in enumerate(plan.rows):
        if s in by_seq:
            ks, vs = by_seq[s]
        else:  # in the cache's dtype, so both sources give the same numbers
            ks, vs = (x if whole else x[start:end] for x in (k, v))
            if ks.dtype != k_cache.dtype:
                ks, vs = ks.astype(k_cache.dtype), vs.astype(k_cache.dtype)
            ks, vs = reference.heads_first(ks), reference.heads_first(vs)
        qs = reference.heads_first(q if whole else q[start:end])
        outs.append(reference.tokens_first(reference.sdpa(qs, ks, vs, plan.geometry.scale)))
    return outs[0] if whole else mx.concatenate(outs, axis=0)
