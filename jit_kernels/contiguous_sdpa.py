"""Attention on contiguous K/V, one `mx.fast.scaled_dot_product_attention` per sequence.

Where a sequence's K/V come from, decided once per forward by `plan_sdpa`:
- nothing cached: its own new K/V rows; the cache is never read back (what mlx-lm does with its
  contiguous cache);
- its pages are one run of consecutive blocks (a plan given the host block table sees that):
  those rows of the cache, read in place as a strided view, as mlx-lm's SDPA reads its cache
  (under vLLM's allocator, a lone conversation's blocks stay one run turn after turn);
- otherwise: its pages copied out by a gather: a backend's page-gather kernel (one launch for
  the batch), or MLX's own take (`reference.gather_kv`) where no kernel exists;
- or, for the sequences a plan is told to (`prefill_seqs`, the rule's pick on Hopper), no
  SDPA at all: the backend's prefill kernel reads their pages itself, one launch for them all.
The first two give SDPA the same layout ([L, Hkv, D] rows seen heads first), the gather another
([Hkv, L, D]); MLX builds one cuDNN graph per layout and shape (see `rules.CudaSdpaRule`).

The contract is the reference's plus the new rows `k`, `v` [T, Hkv, D], which the cache already
holds; the caches may also come as stored (`support.as_pages`), which the gather kernel reads
with no view op. A plan made with a host block table holds the blocks it reads in place: the
calls must pass the same table. A plan may hold only some of a batch's sequences (the
dispatcher's mixed path: the paged kernel runs the rest).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

import reference

from .page_gather import GatherPlan, PageGather, plan_gather
from .support import Geometry, Lengths, as_pages, as_rows, check_call, page_runs

PREFILL = "prefill kernel"  # a planned sequence's source: the prefill kernel attends it


@dataclass(frozen=True)
class SdpaPlan:
    geometry: Geometry
    lengths: Lengths
    # per planned sequence: its rows of q (start, end) and where its K/V come from: an int, its
    # index in the gather's output; a slice, its rows of the cache, read in place; None, its
    # own new rows (nothing cached); PREFILL, the prefill kernel's output
    rows: tuple[tuple[int, int, int | slice | str | None], ...]
    gather: GatherPlan  # the planned sequences to gather, in batch order
    whole: bool  # one sequence holding every row of q: no slicing (each slice is an op a layer)
    cache_rows: int  # the cache rows the reads in place need: the caches must hold as many
    prefill: tuple | None = None  # (the prefill kernel, its plan of the PREFILL sequences)

    def sources(self) -> str:
        """Where the planned sequences' K/V come from, for a log line."""
        kinds = Counter("gathered" if isinstance(source, int) else
                        "uncached" if source is None else
                        "read by the prefill kernel" if source == PREFILL else "read in place"
                        for *_, source in self.rows)
        return "sequences: " + ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items()))


def plan_sdpa(cu_seqlens_q: np.ndarray, seq_lens: np.ndarray, geometry: Geometry,
              seqs=None, block_tables=None, prefill_seqs=(), prefill_kernel=None) -> SdpaPlan:
    """`seqs`: plan only these sequences (sorted batch indices); None plans all.
    `block_tables`: the host copy of the table the calls will pass; with it a sequence whose
    pages are one run of consecutive blocks is read in place, not gathered.
    `prefill_seqs`: planned sequences with a cached prefix that `prefill_kernel` attends."""
    lengths = Lengths.of(cu_seqlens_q, seq_lens)
    picked = lengths.subset(seqs)
    cu, lens = lengths.cu_seqlens_q.tolist(), lengths.seq_lens.tolist()
    planned = range(len(lens)) if picked is None else picked.tolist()
    g = geometry
    cached = [s for s in planned if lens[s] > cu[s + 1] - cu[s]]
    prefill_seqs = sorted({int(s) for s in prefill_seqs})
    if prefill_seqs and (prefill_kernel is None or not set(prefill_seqs) <= set(cached)):
        raise ValueError(f"prefill_seqs: {prefill_seqs} must be planned sequences with a cached "
                         "prefix, given with their kernel")
    cached = [s for s in cached if s not in prefill_seqs]
    runs = {} if block_tables is None else page_runs(block_tables, lengths.seq_lens, cached,
                                                     g.block_size)
    in_place = {s: slice(b * g.block_size, b * g.block_size + lens[s]) for s, b in runs.items()}
    gathered = [s for s in cached if s not in in_place]
    source = {**in_place, **{s: i for i, s in enumerate(gathered)},
              **{s: PREFILL for s in prefill_seqs}}
    rows = tuple((cu[s], cu[s + 1], source.get(s)) for s in planned)
    prefill = None
    if prefill_seqs:
        prefill = prefill_kernel, prefill_kernel.plan(lengths.cu_seqlens_q, lengths.seq_lens, g,
                                                      seqs=prefill_seqs)
    return SdpaPlan(g, lengths, rows, plan_gather(lengths.seq_lens, gathered, g.block_size,
                                                  g.num_kv_heads, g.head_dim, g.dtype),
                    whole=rows[0][:2] == (0, cu[-1]),
                    cache_rows=max((r.stop for r in in_place.values()), default=0),
                    prefill=prefill)


def sdpa_attention(
    q: mx.array, k: mx.array, v: mx.array, k_cache: mx.array, v_cache: mx.array,
    block_tables: mx.array, plan: SdpaPlan, gather: PageGather | None = None,
) -> mx.array:
    """out [T, H, D]; `gather` None copies prefixes with MLX's take. No host sync. The plan
    must hold every sequence (a partial plan's rows come from `attend_rows`)."""
    check_sdpa_call(q, k, v, k_cache, v_cache, block_tables, plan, gather)
    if sum(end - start for start, end, _ in plan.rows) != q.shape[0]:
        raise ValueError("plan: sdpa_attention needs a plan of every sequence")
    return attend(q, k, v, k_cache, v_cache, block_tables, plan, gather)


def check_sdpa_call(q: mx.array, k: mx.array, v: mx.array, k_cache: mx.array,
                    v_cache: mx.array, block_tables: mx.array, plan: SdpaPlan,
                    gather: PageGather | None = None) -> None:
    """The SDPA path's entry check: the contract's shapes, the new rows, the gather's pages."""
    pages = as_pages(k_cache, plan.geometry)
    check_call("sdpa", plan.geometry, q, pages, as_pages(v_cache, plan.geometry), block_tables,
               plan.lengths)
    want = (q.shape[0], pages.shape[2], pages.shape[3])
    if k.shape != want or v.shape != want:
        raise ValueError(f"k, v: new rows must be {want}, got {k.shape} and {v.shape}")
    if plan.cache_rows > pages.shape[0] * pages.shape[1]:
        raise ValueError(f"block_tables: the plan reads cache rows up to {plan.cache_rows}, the "
                         f"caches hold {pages.shape[0] * pages.shape[1]}")
    if gather is not None and plan.gather.seqs:
        gather.check(k_cache, v_cache, plan.gather)


def attend(
    q: mx.array, k: mx.array, v: mx.array, k_cache: mx.array, v_cache: mx.array,
    block_tables: mx.array, plan: SdpaPlan, gather: PageGather | None = None,
) -> mx.array:
    """`sdpa_attention` without its entry check, for callers that validated the plan against
    these arrays already (a forward calls it once per layer: every op here counts)."""
    outs = attend_rows(q, k, v, k_cache, v_cache, block_tables, plan, gather)
    return outs[0] if plan.whole else mx.concatenate(outs, axis=0)


def attend_into(
    out: mx.array, q: mx.array, k: mx.array, v: mx.array, k_cache: mx.array, v_cache: mx.array,
    block_tables: mx.array, plan: SdpaPlan, gather: PageGather | None = None,
) -> mx.array:
    """`out` [T, H, D] with each planned sequence's rows overwritten by its SDPA output (in
    place when nothing else holds `out`, as a kernel's fresh output)."""
    for (start, end, _), rows in zip(plan.rows, attend_rows(q, k, v, k_cache, v_cache,
                                                            block_tables, plan, gather)):
        out[start:end] = rows
    return out


def attend_rows(
    q: mx.array, k: mx.array, v: mx.array, k_cache: mx.array, v_cache: mx.array,
    block_tables: mx.array, plan: SdpaPlan, gather: PageGather | None = None,
) -> list[mx.array]:
    """Each planned sequence's output [end - start, H, D], in the order of `plan.rows`."""
    g, geometry = plan.gather, plan.geometry
    if not g.seqs:
        gathered = []
    elif gather is None:
        k_pages, v_pages = as_pages(k_cache, geometry), as_pages(v_cache, geometry)
        gathered = [reference.gather_kv(k_pages, v_pages, block_tables[s], n)
                    for s, n in zip(g.seqs, g.seq_lens)]
    else:
        gathered = gather.launch(k_cache, v_cache, block_tables, g)
    prefilled = None  # the prefill kernel's output: rows of its sequences only
    if plan.prefill is not None:
        kernel, prefill_plan = plan.prefill
        prefilled = kernel.launch(q, k_cache, v_cache, block_tables, prefill_plan)
    rows = None  # the caches' token rows, viewed once per call
    outs = []
    for start, end, source in plan.rows:
        if source == PREFILL:
            outs.append(prefilled if plan.whole else prefilled[start:end])
            continue
        if isinstance(source, int):
            ks, vs = gathered[source]
        else:
            if source is None:  # in the cache's dtype, so every source gives the same numbers
                ks, vs = (x if plan.whole else x[start:end] for x in (k, v))
                if ks.dtype != geometry.dtype:
                    ks, vs = ks.astype(geometry.dtype), vs.astype(geometry.dtype)
            else:
                rows = rows or (as_rows(k_cache, geometry), as_rows(v_cache, geometry))
                ks, vs = rows[0][source], rows[1][source]
            ks, vs = reference.heads_first(ks), reference.heads_first(vs)
        qs = reference.heads_first(q if plan.whole else q[start:end])
        outs.append(reference.tokens_first(reference.sdpa(qs, ks, vs, geometry.scale)))
    return outs
