"""Attention on contiguous K/V, one `mx.fast.scaled_dot_product_attention` per sequence.

A sequence with nothing cached attends over its own new K/V rows and never reads the cache
back (what mlx-lm does with its contiguous cache); one with a cached prefix attends over its
pages copied out by a gather: a backend's page-gather kernel (one launch for the batch), or
MLX's own take (`reference.gather_kv`) where no kernel exists. The contract is the reference's
plus the new rows `k`, `v` [T, Hkv, D], which the cache already holds; the caches may also come
as stored (`support.as_pages`), which the gather kernel reads with no view op.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

import reference

from .page_gather import GatherPlan, PageGather, plan_gather
from .support import Geometry, Lengths, as_pages, check_call


@dataclass(frozen=True)
class SdpaPlan:
    geometry: Geometry
    lengths: Lengths
    # per sequence: its rows of q (start, end) and its index in the gather's output, or -1
    # when nothing is cached (it attends over its new rows)
    rows: tuple[tuple[int, int, int], ...]
    gather: GatherPlan  # the sequences with a cached prefix, in batch order


def plan_sdpa(cu_seqlens_q: np.ndarray, seq_lens: np.ndarray, geometry: Geometry) -> SdpaPlan:
    lengths = Lengths.of(cu_seqlens_q, seq_lens)
    cu, lens = lengths.cu_seqlens_q.tolist(), lengths.seq_lens.tolist()
    cached = [s for s in range(len(lens)) if lens[s] > cu[s + 1] - cu[s]]
    index = {s: i for i, s in enumerate(cached)}
    rows = tuple((cu[s], cu[s + 1], index.get(s, -1)) for s in range(len(lens)))
    g = geometry
    return SdpaPlan(g, lengths, rows, plan_gather(lengths.seq_lens, cached, g.block_size,
                                                  g.num_kv_heads, g.head_dim, g.dtype))


def sdpa_attention(
    q: mx.array, k: mx.array, v: mx.array, k_cache: mx.array, v_cache: mx.array,
    block_tables: mx.array, plan: SdpaPlan, gather: PageGather | None = None,
) -> mx.array:
    """out [T, H, D]; `gather` None copies prefixes with MLX's take. No host sync."""
    pages = as_pages(k_cache, plan.geometry)
    check_call("sdpa", plan.geometry, q, pages, as_pages(v_cache, plan.geometry), block_tables,
               plan.lengths)
    want = (q.shape[0], pages.shape[2], pages.shape[3])
    if k.shape != want or v.shape != want:
        raise ValueError(f"k, v: new rows must be {want}, got {k.shape} and {v.shape}")
    if gather is not None and plan.gather.seqs:
        gather.check(k_cache, v_cache, plan.gather)
    return attend(q, k, v, k_cache, v_cache, block_tables, plan, gather)


def attend(
    q: mx.array, k: mx.array, v: mx.array, k_cache: mx.array, v_cache: mx.array,
    block_tables: mx.array, plan: SdpaPlan, gather: PageGather | None = None,
) -> mx.array:
    """`sdpa_attention` without its entry check, for callers that validated the plan against
    these arrays already (a forward calls it once per layer: every op here counts)."""
    g, geometry = plan.gather, plan.geometry
    if not g.seqs:
        gathered = []
    elif gather is None:
        k_pages, v_pages = as_pages(k_cache, geometry), as_pages(v_cache, geometry)
        gathered = [reference.gather_kv(k_pages, v_pages, block_tables[s], n)
                    for s, n in zip(g.seqs, g.seq_lens)]
    else:
        gathered = gather.launch(k_cache, v_cache, block_tables, g)
    whole = len(plan.rows) == 1  # one sequence: no slicing (each slice is an op per layer)
    outs = []
    for start, end, i in plan.rows:
        if i >= 0:
            ks, vs = gathered[i]
        else:  # in the cache's dtype, so both sources give the same numbers
            ks, vs = (x if whole else x[start:end] for x in (k, v))
            if ks.dtype != geometry.dtype:
                ks, vs = ks.astype(geometry.dtype), vs.astype(geometry.dtype)
            ks, vs = reference.heads_first(ks), reference.heads_first(vs)
        qs = reference.heads_first(q if whole else q[start:end])
        outs.append(reference.tokens_first(reference.sdpa(qs, ks, vs, geometry.scale)))
    return outs[0] if whole else mx.concatenate(outs, axis=0)
