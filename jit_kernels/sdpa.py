"""Executors on contiguous K/V: one `mx.fast.scaled_dot_product_attention` per sequence.

- `ContiguousSdpa`: a sequence with nothing cached attends over its own new K/V rows (the
  cache is never read back, as with mlx-lm's contiguous cache); a sequence whose pages are one
  run of consecutive blocks (the route finds those) reads those rows of the cache in place, as
  a strided view (under vLLM's allocator a lone conversation's blocks stay one run); one whose
  pages are a few runs reads each in place, one softmax over them all (`reference.joined_sdpa`:
  plain ops, for MLX's CPU backend, where SDPA is plain ops too);
- `GatheredSdpa`: the pages are copied out first, by a backend's page-gather kernel (one launch
  for the batch) or by MLX's take where there is none;
- `ReferenceAttention`: `reference.paged_attention`, the oracle, as an executor.
New rows and rows read in place reach SDPA as [L, Hkv, D] seen heads first, gathered pages as
[Hkv, L, D]: MLX builds a cuDNN graph per layout and shape (the routing rules count them).
Every variant runs here: a windowed sequence attends over its keys from `key_start` on only
(never the pages before it), with the window's mask where it cuts inside them; one with more new
queries than two chunks attends chunk by chunk, each chunk over its own window's keys (`spans`).
The masks are built when the plan is, once per forward and shape, and every layer reads them.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import mlx.core as mx

import reference

from .arrays import as_pages, as_rows, check_call
from .geometry import Geometry, Lengths
from .interface import Plan
from .page_gather import GatherPlan, PageGather, plan_gather

# A windowed sequence of more than two chunks of max(window, WINDOW_CHUNK_Q) queries attends
# chunk by chunk, each over the keys its chunk sees: the cost follows the window, not the
# prompt, where one masked call over the whole prompt grows with its square. 512-query chunks
# cost more than they saved up to 4096 queries on the H200 (docs/results.md, "End to end:
# Gemma 3").
WINDOW_CHUNK_Q = 2048


@dataclass(frozen=True)
class Span:
    """One SDPA call of a sequence: its queries q0:q1 over its keys k0:k1 (indices into the keys
    its source gives), with SDPA's mask for that shape."""

    q0: int
    q1: int
    k0: int
    k1: int
    mask: mx.array | str | None


def spans(q_len: int, k_len: int, window: int | None, chunk: int,
          masks: dict) -> tuple[Span, ...]:
    """The calls of one sequence: q_len queries at the last positions of its k_len keys, which
    start at its first visible key. `masks`: the masks built so far, by (queries, keys) shape,
    shared by every sequence of a plan (the chunks inside a prompt share one)."""
    def span(q0: int, q1: int, k0: int | None = None) -> Span:
        if k0 is None:  # from the first key the chunk's first query sees
            k0 = max(0, k_len - q_len + q0 - window + 1)
        k1 = k_len - q_len + q1
        shape = (q1 - q0, k1 - k0)
        if shape not in masks:
            masks[shape] = reference.window_mask(*shape, window)
        return Span(q0, q1, k0, k1, masks[shape])
    if window is None or k_len <= window or q_len <= 2 * chunk:  # one call over every key
        return (span(0, q_len, 0),)
    return tuple(span(a, min(a + chunk, q_len)) for a in range(0, q_len, chunk))


def plan_spans(lengths: Lengths, geometry: Geometry, seqs: tuple[int, ...],
               query_chunk: int | None, key_starts) -> tuple[tuple[Span, ...], ...]:
    """Per planned sequence its calls; `query_chunk` (a plan argument) overrides the chunk.
    `key_starts`: per planned sequence the first key its source gives (its first visible key,
    or one before it: keys before the first visible one are masked out)."""
    window = geometry.window
    if query_chunk is None:
        query_chunk = max(window or 0, WINDOW_CHUNK_Q)
    elif isinstance(query_chunk, bool) or not isinstance(query_chunk, numbers.Integral) or \
            query_chunk < 1:
        raise ValueError(f"query_chunk: a positive int, not {query_chunk!r}")
    masks: dict = {}
    return tuple(spans(int(lengths.q_lens[s]), int(lengths.seq_lens[s] - start), window,
                       query_chunk, masks) for s, start in zip(seqs, key_starts))


def _attend(q: mx.array, ks: list[mx.array], vs: list[mx.array], g: Geometry, sinks,
            calls: tuple[Span, ...], laid_head_major: bool = False) -> mx.array:
    """q [L, H, D] at the last positions of the keys that the pieces ks, vs [1, Hkv, Li, D]
    hold in key order -> [L, H, D], each call over its share of them: one piece through SDPA
    (`laid_head_major`: rows of a heads-major cache, read as they lie), several with one
    softmax over them (`reference.joined_sdpa`)."""
    def call(qc: mx.array, c: Span) -> mx.array:
        kc, vc = _cut(ks, c.k0, c.k1), _cut(vs, c.k0, c.k1)
        if len(ks) > 1:
            return reference.tokens_first(reference.joined_sdpa(
                reference.heads_first(qc), kc, vc, g.scale, c.mask, g.softcap, sinks))
        return reference.tokens_first(reference.masked_sdpa(
            reference.heads_first(qc), kc[0], vc[0], g.scale, c.mask, g.softcap, sinks,
            kv_laid_head_major=laid_head_major))

    if len(calls) == 1:  # no slices: each is an op a layer
        return call(q, calls[0])
    return mx.concatenate([call(q[c.q0:c.q1], c) for c in calls], axis=0)


def _cut(pieces: list[mx.array], k0: int, k1: int) -> list[mx.array]:
    """Keys k0:k1 of the pieces [1, Hkv, Li, D] laid end to end: a piece wholly inside is
    passed as it is (no slice op), one partly inside sliced."""
    out, first = [], 0
    for p in pieces:
        n = p.shape[2]
        if first < k1 and first + n > k0:
            a, b = max(k0 - first, 0), min(k1 - first, n)
            out.append(p if (a, b) == (0, n) else p[:, :, a:b])
        first += n
    return out


def _assemble(out: mx.array | None, rows: list[mx.array], plan: Plan) -> mx.array:
    """The planned sequences' rows (in plan order) as [T, H, D]; see `interface`."""
    if out is None and plan.whole:
        return rows[0] if len(rows) == 1 else mx.concatenate(rows, axis=0)
    if out is None:
        g = plan.geometry
        out = mx.zeros((plan.lengths.num_tokens, g.num_heads, g.head_dim), dtype=g.dtype)
    cu = plan.lengths.cu_seqlens_q
    for s, r in zip(plan.seqs, rows):
        out[int(cu[s]):int(cu[s + 1])] = r
    return out


def _q_rows(q: mx.array, plan: Plan, s: int) -> mx.array:
    if plan.whole and len(plan.seqs) == 1:  # no slice: each is an op a layer
        return q
    cu = plan.lengths.cu_seqlens_q
    return q[int(cu[s]):int(cu[s + 1])]


@dataclass(frozen=True)
class ContiguousPlan(Plan):
    # per planned sequence: its visible cache rows read in place (one slice a run of blocks),
    # or None: its own new rows
    sources: tuple[tuple[slice, ...] | None, ...]
    cache_rows: int  # the cache rows the reads in place need
    calls: tuple[tuple[Span, ...], ...]  # per planned sequence (`spans`)


class _OnMlx:
    """An executor of MLX ops only: it runs any geometry and has no kernel to check."""

    def unsupported_reason(self, geometry: Geometry) -> str | None:
        return None

    def canary_plannings(self, geometry: Geometry) -> tuple[dict, ...]:
        return ()

    def check(self, q, k, v, k_cache, v_cache, plan: Plan, sinks=None) -> None:
        check_call(self.name, plan.geometry, plan.lengths, q, k, v, k_cache, v_cache,
                   plan.block_tables, sinks)


class ContiguousSdpa(_OnMlx):
    name = "sdpa"

    def plan(self, lengths: Lengths, geometry: Geometry, block_tables: mx.array, seqs=None,
             runs: dict[int, tuple[tuple[int, int], ...]] | None = None,
             query_chunk: int | None = None) -> ContiguousPlan:
        """`runs`: for each planned sequence that sees cached keys, the runs of consecutive
        blocks its visible pages form, from the block holding its first visible key
        (`key_start`) on, each (first block, blocks): one run is read as a view, several are
        joined in one softmax; the others must see no cached key. `query_chunk`: see
        `plan_spans`."""
        seqs, runs = lengths.seqs(seqs), runs or {}
        bs, lens = geometry.block_size, lengths.seq_lens
        starts = lengths.key_starts(geometry.window)
        sees_cache = starts < lens - lengths.q_lens
        stray = sorted(set(runs) - set(seqs))
        cached = [s for s in seqs if sees_cache[s] and s not in runs]
        if stray or cached:
            raise ValueError(f"runs: sequences {stray or cached} are not planned, or see cached "
                             "keys with no runs of blocks to read in place")
        def rows(s: int) -> tuple[slice, ...]:  # noqa: E306
            first_page, pages = int(starts[s]) // bs, -(-int(lens[s]) // bs)
            if sum(n for _, n in runs[s]) != pages - first_page or \
                    any(n < 1 or b < 0 for b, n in runs[s]):
                raise ValueError(f"runs: sequence {s}'s runs {runs[s]} do not hold its "
                                 f"{pages - first_page} visible pages")
            skip, left, out = int(starts[s]) % bs, int(lens[s] - starts[s]), []
            for b, n in runs[s]:
                take = min(n * bs - skip, left)
                out.append(slice(b * bs + skip, b * bs + skip + take))
                skip, left = 0, left - take
            return tuple(out)
        sources = tuple(rows(s) if s in runs else None for s in seqs)
        cache_rows = max((r.stop for rs in sources if rs is not None for r in rs), default=0)
        return ContiguousPlan(geometry, lengths, block_tables, seqs, sources, cache_rows,
                              plan_spans(lengths, geometry, seqs, query_chunk,
                                         starts[list(seqs)]))

    def check(self, q, k, v, k_cache, v_cache, plan: ContiguousPlan, sinks=None) -> None:
        super().check(q, k, v, k_cache, v_cache, plan, sinks)
        held = as_rows(k_cache, plan.geometry).shape[0]
        if plan.cache_rows > held:
            raise ValueError(f"block_tables: the plan reads cache rows up to {plan.cache_rows}, "
                             f"the caches hold {held}")

    def run(self, q, k, v, k_cache, v_cache, plan: ContiguousPlan, out=None,
            sinks=None) -> mx.array:
        g, cu = plan.geometry, plan.lengths.cu_seqlens_q
        rows = None  # the caches' token rows, viewed once per call
        outs = []
        for s, source, calls in zip(plan.seqs, plan.sources, plan.calls):
            if source is None:  # in the cache's dtype, so every source gives the same numbers
                if plan.whole and len(plan.seqs) == 1:
                    ks, vs = k, v
                else:
                    ks, vs = k[int(cu[s]):int(cu[s + 1])], v[int(cu[s]):int(cu[s + 1])]
                if ks.dtype != g.dtype:
                    ks, vs = ks.astype(g.dtype), vs.astype(g.dtype)
                ks, vs = [reference.heads_first(ks)], [reference.heads_first(vs)]
            else:  # one view per run of blocks
                rows = rows or (as_rows(k_cache, g), as_rows(v_cache, g))
                ks = [reference.heads_first(rows[0][r]) for r in source]
                vs = [reference.heads_first(rows[1][r]) for r in source]
            outs.append(_attend(_q_rows(q, plan, s), ks, vs, g, sinks, calls,
                                laid_head_major=source is not None and g.heads_major))
        return _assemble(out, outs, plan)


@dataclass(frozen=True)
class GatheredPlan(Plan):
    gather: GatherPlan
    starts: tuple[int, ...]  # per planned sequence its first key gathered
    calls: tuple[tuple[Span, ...], ...]  # per planned sequence (`spans`)


class GatheredSdpa:
    """`gather`: the backend's page-gather kernel, which copies a windowed sequence's pages
    from the one of its first visible key on (the keys before that key masked out); None
    copies with MLX's take, from the first visible key itself."""

    def __init__(self, gather: PageGather | None = None):
        self.gather = gather
        self.name = "MLX gather + sdpa" if gather is None else f"{gather.backend} gather + sdpa"

    def unsupported_reason(self, geometry: Geometry) -> str | None:
        if self.gather is None:
            return None
        if geometry.window is not None and "window" not in self.gather.features:
            return "window (the gather kernel copies whole sequences)"
        return self.gather.unsupported_reason(geometry)

    def canary_plannings(self, geometry: Geometry) -> tuple[dict, ...]:
        return () if self.gather is None else ({},)

    def plan(self, lengths: Lengths, geometry: Geometry, block_tables: mx.array,
             seqs=None, query_chunk: int | None = None) -> GatheredPlan:
        """`query_chunk`: see `plan_spans`."""
        why_not = self.unsupported_reason(geometry)
        if why_not:
            raise ValueError(f"{self.name} cannot run this geometry: {why_not}")
        g, seqs = geometry, lengths.seqs(seqs)
        visible = lengths.key_starts(g.window)
        gather = plan_gather(lengths.seq_lens, list(seqs), g.block_size, g.num_kv_heads,
                             g.head_dim, g.dtype, visible)
        starts = tuple(f * g.block_size for f in gather.first_pages) if self.gather else \
            tuple(int(visible[s]) for s in seqs)
        return GatheredPlan(g, lengths, block_tables, seqs, gather, starts,
                            plan_spans(lengths, g, seqs, query_chunk, starts))

    def check(self, q, k, v, k_cache, v_cache, plan: GatheredPlan, sinks=None) -> None:
        if self.gather is not None:  # first: the copy's own rule on the bytes it reads
            self.gather.check(k_cache, v_cache, plan.gather)
        check_call(self.name, plan.geometry, plan.lengths, q, k, v, k_cache, v_cache,
                   plan.block_tables, sinks)

    def gathered(self, k_cache, v_cache, plan: GatheredPlan) -> list[tuple[mx.array, mx.array]]:
        """Each planned sequence's visible K/V, [1, Hkv, L, D]: the copy this executor attends
        over."""
        if self.gather is not None:
            return self.gather.launch(k_cache, v_cache, plan.block_tables, plan.gather)
        k_pages, v_pages = as_pages(k_cache, plan.geometry), as_pages(v_cache, plan.geometry)
        return [reference.gather_kv(k_pages, v_pages, plan.block_tables[s], int(n), start)
                for s, n, start in zip(plan.seqs, plan.gather.seq_lens, plan.starts)]

    def run(self, q, k, v, k_cache, v_cache, plan: GatheredPlan, out=None,
            sinks=None) -> mx.array:
        kv = self.gathered(k_cache, v_cache, plan)
        outs = [_attend(_q_rows(q, plan, s), [ks], [vs], plan.geometry, sinks, calls)
                for s, (ks, vs), calls in zip(plan.seqs, kv, plan.calls)]
        return _assemble(out, outs, plan)


class ReferenceAttention(_OnMlx):
    """`reference.paged_attention` over every sequence of the batch."""

    name = "reference"

    def plan(self, lengths: Lengths, geometry: Geometry, block_tables: mx.array,
             seqs=None) -> Plan:
        seqs = lengths.seqs(seqs)
        if len(seqs) != lengths.num_seqs:
            raise ValueError("seqs: the reference plans every sequence of the batch")
        return Plan(geometry, lengths, block_tables, seqs)

    def run(self, q, k, v, k_cache, v_cache, plan: Plan, out=None, sinks=None) -> mx.array:
        g, lengths = plan.geometry, plan.lengths
        return reference.paged_attention(q, as_pages(k_cache, g), as_pages(v_cache, g),
                                         plan.block_tables, lengths.cu_seqlens_q,
                                         lengths.seq_lens, g.scale, window=g.window,
                                         softcap=g.softcap, sinks=sinks)
