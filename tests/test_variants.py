"""Attention variants through the route: windows, caps and sinks reach every executor or are
refused by it, never ignored (`reference.contract`).

Fake backends (built on the reference) stand in for kernels that implement a variant or lack
it; the real SDPA executors and MLX's take run as they are. Outputs are checked against the
float64 oracle; engagement is checked on the route's sources and the fakes' launches.
"""

import logging

import mlx.core as mx
import numpy as np
import pytest

import reference
from jit_kernels import ContiguousSdpa, GatheredSdpa, KernelBackend
from jit_kernels.arrays import as_pages
from jit_kernels.geometry import Geometry
from jit_kernels.interface import PagedAttentionKernel, Plan
from jit_kernels.sdpa import WINDOW_CHUNK_Q
from paged_prefix.attention_metadata import build_attention_metadata
from paged_prefix.dispatch import Dispatcher
from paged_prefix.route import Source, page_runs
from tests.conftest import PagedCase, assert_close
from tests.test_dispatch import FakeGather, never

BS = 16


class VariantFake(PagedAttentionKernel):
    """The reference as a 'kernel' implementing `features`; `bug` plants one mistake."""

    name = "variant-fake"
    head_dims = (64,)

    def __init__(self, features=(), bug=None):
        super().__init__(None)
        self.features, self.bug, self.launches = tuple(features), bug, 0

    def tile_rows(self, g):
        return (16,)

    def plan(self, lengths, g, block_tables, seqs=None, block_m=None):
        return Plan(g, lengths, block_tables, lengths.seqs(seqs))

    def launch(self, q, k_cache, v_cache, plan, sinks=None):
        self.launches += 1
        g, lengths = plan.geometry, plan.lengths
        window = g.window
        if self.bug == "window off by one" and window is not None:
            window += 1
        if self.bug == "sink dropped":
            sinks = None
        return reference.paged_attention(q, as_pages(k_cache, g), as_pages(v_cache, g),
                                         plan.block_tables, lengths.cu_seqlens_q,
                                         lengths.seq_lens, g.scale, window=window,
                                         softcap=g.softcap, sinks=sinks)


def geometry(**variant) -> Geometry:
    return Geometry(8, 2, 64, BS, mx.float16, 0.125, **variant)


def forward(d: Dispatcher, g: Geometry, q_lens, ctx, runs=None, sinks=None, seed=0):
    c = PagedCase(list(q_lens), list(ctx), 8, 2, 64, BS, mx.float16, seed=seed, runs=runs,
                  window=g.window)
    out = c.forward(d, g, sinks=sinks)
    assert_close(out, c.oracle(g.scale, g.window, g.softcap, sinks), mx.float16)
    return d.last, c


def with_fake(kernel, gather=None, **kwargs) -> Dispatcher:
    backend = KernelBackend("fake", kernel, GatheredSdpa(gather or FakeGather()))
    return Dispatcher("auto", backends={"fake": backend}, rule_of=lambda b: never, **kwargs)


@pytest.mark.parametrize("gather_window", [True, False], ids=["gather-window", "gather-whole"])
def test_a_kernel_without_the_window_is_routed_around_and_says_so(caplog, gather_window):
    kernel, gather = VariantFake(), FakeGather()
    if not gather_window:
        gather.features = ()
    d = with_fake(kernel, gather)
    with caplog.at_level(logging.INFO, logger="paged_prefix.dispatch"):
        route, _ = forward(d, geometry(window=40), q_lens=(5, 1, 7), ctx=(100, 90, 0))
    assert route.path == "sdpa" and "window (not built into this kernel)" in route.reason
    assert "window" in caplog.text and kernel.launches == 0
    # cached prefixes on shuffled pages are copied from the window's first page on: by the
    # gather kernel where it copies windows (its contract: from that page), else by MLX's take
    assert route.sources == (Source.GATHERED, Source.GATHERED, Source.NEW_ROWS)
    assert gather.launched[-1:] == ([(0, 1)] if gather_window else [])


def test_a_kernel_with_the_variant_runs_it():
    kernel = VariantFake(("window", "softcap", "sinks"))
    d = with_fake(kernel)
    sinks = mx.array(np.linspace(-3, 3, 8), dtype=mx.float32)
    route, _ = forward(d, geometry(window=33, softcap=5.0, sinks=True), (5, 1), (70, 50),
                       sinks=sinks)
    assert route.path == "fake" and route.sources == (Source.PAGED, Source.PAGED)
    assert kernel.launches >= 2  # its canary, then the forward


@pytest.mark.parametrize("bug,variant", [("window off by one", dict(window=40)),
                                         ("sink dropped", dict(sinks=True))])
def test_the_canary_runs_the_variant_and_catches_its_bug(bug, variant, caplog):
    strict = with_fake(VariantFake(("window", "sinks"), bug), strict=True)
    sinks = mx.array(np.linspace(-2, 4, 8), dtype=mx.float32) if variant.get("sinks") else None
    with pytest.raises(RuntimeError, match="first-use check"):
        forward(strict, geometry(**variant), (5, 1), (60, 45), sinks=sinks)
    lenient = with_fake(VariantFake(("window", "sinks"), bug), strict=False)
    with caplog.at_level(logging.WARNING, logger="paged_prefix.dispatch"):
        route, _ = forward(lenient, geometry(**variant), (5, 1), (60, 45), sinks=sinks)
    assert route.path == "reference" and "failed its first-use check" in caplog.text


def test_window_one_attends_over_new_rows_only():
    d = Dispatcher("sdpa", backends={})
    route, _ = forward(d, geometry(window=1), (6, 1), (40, 17))
    assert route.sources == (Source.NEW_ROWS, Source.NEW_ROWS)


def test_a_window_past_the_context_is_plain_causal_bit_for_bit():
    d = Dispatcher("sdpa", backends={})
    c = PagedCase([9, 1], [30, 20], 8, 2, 64, BS, mx.float16, seed=3)
    plain = c.forward(d, geometry())
    wide = c.forward(d, geometry(window=40))
    assert np.array_equal(np.array(plain), np.array(wide))


def test_visible_pages_in_one_run_are_read_in_place():
    """Pages left of the window may be anywhere (vLLM's null block, a reused block): only the
    visible ones must be consecutive to read them in place."""
    ctx, q_len, window = 100, 4, 30  # visible keys 71 ..: pages 4 .. 6
    c = PagedCase([q_len], [ctx], 8, 2, 64, BS, mx.float16, seed=1, runs=[True],
                  window=window)
    pages = list(c.pages[0])
    pages[:4] = pages[:4][::-1]  # no longer a run, left of the window only
    meta = build_attention_metadata([q_len], [ctx], [pages], BS, c.num_blocks)
    d = Dispatcher("sdpa", backends={})
    g = geometry(window=window)
    attention = d.plan(meta, g)
    args = (c.q, c.k_new, c.v_new, c.k_cache, c.v_cache)
    attention.check(*args)
    assert d.last.sources == (Source.IN_PLACE,)
    assert_close(attention(*args), c.oracle(g.scale, window), mx.float16)


def test_sinks_must_come_exactly_with_a_geometry_that_has_them():
    d = Dispatcher("sdpa", backends={})
    c = PagedCase([3], [10], 8, 2, 64, BS, mx.float16)
    with pytest.raises(ValueError, match="sinks"):
        c.forward(d, geometry(sinks=True))
    with pytest.raises(ValueError, match="sinks"):
        c.forward(d, geometry(), sinks=mx.zeros((8,)))
    with pytest.raises(ValueError, match="sinks"):
        c.forward(d, geometry(sinks=True), sinks=mx.zeros((4,)))


@pytest.mark.parametrize("field,value", [("window", 0), ("window", True), ("window", 2.0),
                                         ("softcap", 0.0), ("softcap", float("inf")),
                                         ("sinks", 1)])
def test_a_malformed_variant_names_its_field(field, value):
    with pytest.raises(ValueError, match=field):
        geometry(**{field: value})


def test_each_variant_plans_once_per_forward():
    """A model whose layers differ (sliding and global) plans one attention per kind."""
    c = PagedCase([5], [20], 8, 2, 64, BS, mx.float16)
    meta = build_attention_metadata([5], [20], c.pages, BS, c.num_blocks)
    d = Dispatcher("sdpa", backends={})
    local, full = geometry(window=8), geometry()
    first = [d.plan(meta, g) for g in (local, full, local, full)]
    assert first[0] is first[2] and first[1] is first[3] and first[0] is not first[1]


def test_each_groups_metadata_keeps_its_plans():
    """A forward over several KV-cache groups plans once per group's metadata; a step run again
    (the same metadata objects) reuses every one of them."""
    c = PagedCase([5], [20], 8, 2, 64, BS, mx.float16)
    metas = [build_attention_metadata([5], [20], c.pages, BS, c.num_blocks) for _ in range(3)]
    d = Dispatcher("sdpa", backends={})
    first = [d.plan(m, geometry()) for m in metas]
    again = [d.plan(m, geometry()) for m in metas]
    assert all(a is b for a, b in zip(first, again))


@pytest.mark.parametrize("variant", [{}, {"softcap": 30.0}, {"sinks": True}])
@pytest.mark.parametrize("source", ["new rows", "in place", "runs", "gathered"])
def test_a_long_windowed_prompt_attends_chunk_by_chunk(source, variant):
    """Each chunk of queries attends over the keys its window reaches, and nothing else: the
    pages left of each chunk's first visible key hold NaN for the chunk (they are another
    chunk's), so a chunk that read one would show it; outputs against the float64 oracle."""
    window, chunk = 24, 16  # 70 queries: more than two chunks
    q_len, ctx = (70, 0) if source == "new rows" else (69, 41)
    g = geometry(window=window, **variant)
    c = PagedCase([q_len], [ctx], 8, 2, 64, BS, mx.float16, seed=5, runs=[source == "in place"],
                  window=window)
    lengths = build_attention_metadata([q_len], [ctx], c.pages, BS, c.num_blocks).lengths
    if source == "gathered":
        executor = GatheredSdpa()
        plan = executor.plan(lengths, g, c.block_tables, query_chunk=chunk)
    else:
        executor = ContiguousSdpa()
        runs = page_runs(np.asarray(c.block_tables), lengths, [0], BS,
                         lengths.key_starts(window)) if ctx else {}
        assert all((len(r) > 1) == (source == "runs") for r in runs.values())
        plan = executor.plan(lengths, g, c.block_tables, runs=runs, query_chunk=chunk)
    calls = plan.calls[0]
    assert len(calls) == -(-q_len // chunk) and calls[-1].q1 == q_len
    assert all(0 < c_.k1 - c_.k0 <= chunk + window - 1 for c_ in calls)
    assert calls[2].mask is calls[3].mask  # one mask per shape, built with the plan
    sinks = mx.array(np.linspace(-1, 2, 8), dtype=mx.float32) if g.sinks else None
    args = (c.q, c.k_new, c.v_new, c.k_cache, c.v_cache)
    executor.check(*args, plan, sinks=sinks)
    out = executor.run(*args, plan, sinks=sinks)
    assert_close(out, c.oracle(g.scale, window, g.softcap, sinks), mx.float16)


def test_the_route_chunks_long_windowed_prompts_by_default():
    """A fresh prompt past two chunks of WINDOW_CHUNK_Q queries, a window cutting inside it."""
    d = Dispatcher("sdpa", backends={})
    g = geometry(window=40)
    q_len = 2 * WINDOW_CHUNK_Q + 100
    c = PagedCase([q_len, 3], [0, 50], 8, 2, 64, BS, mx.float16, seed=2, window=40)
    out = c.forward(d, g)
    assert_close(out, c.oracle(g.scale, 40), mx.float16)
    plan = d.plan(build_attention_metadata([q_len, 3], [0, 50], c.pages, BS, c.num_blocks), g)
    assert [len(calls) for _, p in plan.parts for calls in p.calls] == [3, 1]


@pytest.mark.parametrize("value", [0, -3, 2.5, True])
def test_a_bad_query_chunk_names_its_field(value):
    c = PagedCase([5], [0], 8, 2, 64, BS, mx.float16)
    lengths = build_attention_metadata([5], [0], c.pages, BS, c.num_blocks).lengths
    with pytest.raises(ValueError, match="query_chunk"):
        ContiguousSdpa().plan(lengths, geometry(window=2), c.block_tables, query_chunk=value)
