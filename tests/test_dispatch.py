"""The dispatcher: one route per forward, a reason for it, the canary, no silent fallback.

`auto` is exercised with fake backends (the dispatcher takes its backends and rules as
arguments): a correct one built on the reference, and broken ones that compute wrong numbers
or fail to compile, which the first-use check must catch.
"""

import logging
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
import pytest

import reference
from jit_kernels import GatheredSdpa, KernelBackend
from jit_kernels.arrays import as_pages
from jit_kernels.geometry import Geometry
from jit_kernels.interface import PagedAttentionKernel, Plan
from paged_prefix import route as route_module
from paged_prefix import rules
from paged_prefix.attention_metadata import build_attention_metadata
from paged_prefix.dispatch import ENV_VAR, Dispatcher
from paged_prefix.route import Source
from paged_prefix.rules import SdpaPick
from tests.conftest import HAS_CUDA, HAS_METAL, PagedCase, assert_close

GEOMETRY = Geometry(8, 2, 64, 16, mx.float16, 0.125)


@dataclass(frozen=True)
class FakePlan(Plan):
    block_m: int | None = None


class FakeAttention(PagedAttentionKernel):
    """A 'kernel' that is the reference, optionally broken: off by `error` or failing to build;
    rows of sequences it did not plan are NaN (the real kernels leave them unwritten)."""

    name = "fake"

    def __init__(self, error: float = 0.0, fails: bool = False, heights=(16,)):
        super().__init__(None)
        self.error, self.fails, self.heights = error, fails, heights
        self.calls = 0
        self.planned = []  # each plan's sequences
        self.launched_heights = []

    def unsupported_reason(self, g):
        return None if g.head_dim == 64 else f"head_dim {g.head_dim}"

    def tile_rows(self, g):
        return self.heights

    def plan(self, lengths, g, block_tables, seqs=None, block_m=None):
        self.planned.append(lengths.seqs(seqs))
        return FakePlan(g, lengths, block_tables, lengths.seqs(seqs), self._block_m(block_m, g))

    def launch(self, q, k_cache, v_cache, plan, sinks=None):
        self.calls += 1
        self.launched_heights.append(plan.block_m)
        if self.fails:
            raise RuntimeError("error: expected ';' (a compile error)")
        g, lengths = plan.geometry, plan.lengths
        out = reference.paged_attention(q, as_pages(k_cache, g), as_pages(v_cache, g),
                                        plan.block_tables, lengths.cu_seqlens_q,
                                        lengths.seq_lens, g.scale)
        planned = np.zeros(q.shape[0], dtype=bool)
        cu = lengths.cu_seqlens_q
        for s in plan.seqs:
            planned[cu[s]:cu[s + 1]] = True
        out = mx.where(mx.array(planned)[:, None, None], out, float("nan"))
        return out * (1 + self.error)


class FakeGather:
    """A page-gather 'kernel' to the real one's contract (a window's pages from the page of its
    first visible key on): MLX's take, optionally broken (V copied where K belongs)."""

    backend = "fake"
    features = ("window",)

    def __init__(self, broken: bool = False):
        self.broken = broken
        self.launched = []  # each launch's sequences

    def unsupported_reason(self, g):
        return None

    def check(self, k_cache, v_cache, plan):
        pass

    def launch(self, k_cache, v_cache, tables, plan):
        self.launched.append(plan.seqs)
        bs = k_cache.shape[1]
        kv = [reference.gather_kv(k_cache, v_cache, tables[s], n, first * bs)
              for s, n, first in zip(plan.seqs, plan.seq_lens, plan.first_pages)]
        return [(v, v) for _, v in kv] if self.broken else kv


def never(lengths, g, runs, layers):
    return None


def fake_backend(attention=None, gather=None):
    return KernelBackend("fake", attention or FakeAttention(), GatheredSdpa(gather or FakeGather()))


def dispatcher(path="auto", backend=None, rule=never, **kwargs):
    backends = {} if backend is None else {"fake": backend}
    return Dispatcher(path, backends=backends, rule_of=lambda b: rule, **kwargs)


def run(d, q_lens=(5, 1), ctx=(13, 30), runs=None, seed=0):
    c = PagedCase(list(q_lens), list(ctx), 8, 2, 64, 16, mx.float16, seed=seed, runs=runs)
    meta = build_attention_metadata(list(q_lens), list(ctx), c.pages, 16, c.num_blocks)
    attention = d.plan(meta, GEOMETRY)
    args = (c.q, c.k_new, c.v_new, c.k_cache, c.v_cache)
    attention.check(*args)
    assert_close(attention(*args), c.oracle(0.125), mx.float16)
    return d.last


def test_forced_reference_runs_and_is_counted():
    d = dispatcher("reference")
    assert run(d).path == "reference" and d.counts == {"reference": 1}


@pytest.mark.skipif(HAS_CUDA or HAS_METAL, reason="a GPU backend is present")
def test_auto_on_cpu_takes_sdpa_and_says_why(caplog):
    d = Dispatcher("auto")
    with caplog.at_level(logging.INFO, logger="paged_prefix.dispatch"):
        run(d)
        run(d)
    assert d.last.path == "sdpa" and "no GPU kernel backend" in d.last.reason
    logged = [r for r in caplog.records if "paged attention: sdpa" in r.getMessage()]
    assert len(logged) == 1  # once per distinct case, not per forward


def test_auto_takes_the_kernel_when_it_supports_the_call():
    backend = fake_backend()
    d = dispatcher(backend=backend, strict=True)
    assert run(d).path == "fake" and d.counts == {"fake": 1}
    assert backend.attention.calls == 2  # the canary, then the call


def test_auto_follows_the_backends_rule_and_support():
    rule = lambda lengths, g, runs, layers: SdpaPick((0, 1), "measured faster")  # noqa: E731
    chosen = run(dispatcher(backend=fake_backend(), rule=rule, strict=True))
    assert (chosen.path, chosen.reason, chosen.backend) == ("sdpa", "measured faster", "fake")
    d = dispatcher(backend=fake_backend(), strict=True)
    c = PagedCase([3], [20], 8, 2, 128, 16, mx.float16)
    meta = build_attention_metadata([3], [20], c.pages, 16, c.num_blocks)
    d.plan(meta, Geometry(8, 2, 128, 16, mx.float16, 0.125))
    assert d.last.path == "sdpa" and "head_dim 128" in d.last.reason


def test_a_batch_planned_again_reuses_its_plan_per_route():
    """The benchmark repeats one batch: its plan (device arrays the host writes) is built once
    per route, and a new batch or a new route (the rule flips after a shape's first request)
    plans afresh."""
    asked = set()

    def second_time_sdpa(lengths, g, runs, layers):  # rules.CudaSdpaRule's shape memory, in small
        key = tuple(lengths.q_lens)
        seen = key in asked
        asked.add(key)
        return SdpaPick(lengths.seqs(), "asked before") if seen else None
    backend = fake_backend()
    d = dispatcher(backend=backend, rule=second_time_sdpa, strict=True)
    c = PagedCase([5, 1], [13, 30], 8, 2, 64, 16, mx.float16, seed=0)
    meta = build_attention_metadata([5, 1], [13, 30], c.pages, 16, c.num_blocks)
    args = (c.q, c.k_new, c.v_new, c.k_cache, c.v_cache)
    first = d.plan(meta, GEOMETRY)
    assert first.route.path == "fake" and len(backend.attention.planned) == 2  # canary, this
    sdpa = [d.plan(meta, GEOMETRY) for _ in range(3)]
    assert {a.route.path for a in sdpa} == {"sdpa"}
    assert sdpa[0] is sdpa[2]  # planned once for the three
    for attention in (first, *sdpa):
        assert_close(attention(*args), c.oracle(0.125), mx.float16)
    again = build_attention_metadata([5, 1], [13, 30], c.pages, 16, c.num_blocks)
    assert d.plan(again, GEOMETRY) is not sdpa[0]
    assert len(backend.attention.planned) == 2


@pytest.fixture
def pick_long(monkeypatch):
    """CUDA's length rule, sending every prefill of >= 8 tokens to SDPA (a test's size)."""
    monkeypatch.setattr(rules, "CUDA_SDPA_MIN_Q", 8)
    return lambda lengths, g, runs, layers: rules.cuda_prefers_sdpa(lengths)


@pytest.mark.parametrize("q_lens,ctx,sdpa_seqs", [
    ([9, 1, 3], [20, 40, 0], (0,)),        # a long suffix over a prefix beside a decode row
    ([1, 12, 2, 8], [7, 0, 33, 16], (1, 3)),  # one fresh, one cached; picked rows not first
    ([3, 30], [50, 5], (1,)),              # the picked sequence holds the last rows
])
def test_auto_mixes_sdpa_and_the_kernel_when_the_rule_picks_some_sequences(q_lens, ctx,
                                                                           sdpa_seqs, pick_long):
    """The kernel plans only the other sequences (the fake leaves the rest NaN, as the real
    kernels leave them unwritten); SDPA's rows overwrite them: the oracle holds everywhere."""
    backend = fake_backend()
    d = dispatcher(backend=backend, rule=pick_long, strict=True)
    chosen = run(d, q_lens, ctx)
    assert (chosen.path, chosen.backend) == ("mixed", "fake")
    assert chosen.seqs(*route_module.SDPA_SOURCES) == sdpa_seqs
    assert "prefills of >= 8 tokens" in chosen.reason and d.counts == {"mixed": 1}
    # the canary planned the whole batch; the forward planned the others only
    assert backend.attention.planned[-1] == tuple(s for s in range(len(q_lens))
                                                  if s not in sdpa_seqs)


@pytest.mark.parametrize("picked,path", [((0, 1, 2), "sdpa"), ((0, 1), "mixed")])
def test_sdpa_reads_a_run_of_pages_in_place_and_gathers_the_rest(picked, path):
    """The route sees the host block table once: sequence 0's pages are one run of blocks, read
    in place; only sequence 1's are gathered (sequence 2 is one run too)."""
    seen = []

    def rule(lengths, g, runs, layers):
        seen.append(dict(runs))
        return SdpaPick(picked, "measured faster")
    gather = FakeGather()
    d = dispatcher(backend=fake_backend(gather=gather), rule=rule, strict=True)
    gather.launched.clear()
    run(d, [9, 3, 1], [20, 40, 30], runs=[True, False, True], seed=2)
    assert d.last.path == path and gather.launched[-1] == (1,)
    assert d.last.summary() == f"1 gathered, {len(picked) - 1} read in place"
    assert sorted(seen[-1]) == [0, 2]


def test_page_runs_are_computed_once_per_forward(monkeypatch, pick_long):
    """One route per forward: the page runs of a mixed forward (rule, SDPA sources and plans
    all need them) are found once, whatever the number of layers."""
    calls = []
    real = route_module.page_runs
    monkeypatch.setattr(route_module, "page_runs",
                        lambda *a: calls.append(a) or real(*a))
    d = dispatcher(backend=fake_backend(), rule=pick_long, strict=True)
    c = PagedCase([9, 1, 12], [20, 40, 16], 8, 2, 64, 16, mx.float16, seed=4,
                  runs=[True, False, False])
    meta = build_attention_metadata([9, 1, 12], [20, 40, 16], c.pages, 16, c.num_blocks)
    attention = d.plan(meta, GEOMETRY)
    args = (c.q, c.k_new, c.v_new, c.k_cache, c.v_cache)
    attention.check(*args)
    for _ in range(4):  # four layers
        assert_close(attention(*args), c.oracle(0.125), mx.float16)
    assert d.last.path == "mixed" and len(calls) == 1
    assert d.last.sources == (Source.IN_PLACE, Source.PAGED, Source.GATHERED)


def test_the_rule_weighs_the_layers_a_plan_serves():
    """`plan(meta, g, layers)` hands the rule the number of layers that run the plan (a cuDNN
    graph serves them all, kernel time adds up per layer); anything but a count >= 1 is
    refused naming it, before the route."""
    seen = []

    def rule(lengths, g, runs, layers):
        seen.append(layers)
    d = dispatcher(backend=fake_backend(), rule=rule, strict=True)
    c = PagedCase([9, 1], [20, 40], 8, 2, 64, 16, mx.float16, seed=3)
    meta = build_attention_metadata([9, 1], [20, 40], c.pages, 16, c.num_blocks)
    d.plan(meta, GEOMETRY)
    d.plan(meta, GEOMETRY, 24)
    d.plan(meta, GEOMETRY, np.int64(3))  # a count numpy made
    assert seen == [1, 24, 3] and all(type(n) is int for n in seen)
    for bad in (0, -2, 2.0, True, np.True_, None, "3"):
        with pytest.raises(ValueError, match="layers"):
            d.plan(meta, GEOMETRY, bad)
    assert seen == [1, 24, 3]


def test_rule_state_belongs_to_its_dispatcher():
    """Two dispatchers over one backend keep their own shape memory (the CUDA rule's)."""
    made = []

    def rule_of(backend):
        made.append(rules.CudaSdpaRule(capacity=4))
        return made[-1]
    backends = {"fake": fake_backend()}
    first, second = (Dispatcher("auto", backends=backends, rule_of=rule_of) for _ in range(2))
    assert first.rules["fake"] is made[0] and second.rules["fake"] is made[1]
    assert made[0] is not made[1]


def test_the_forwards_entry_check_runs_once_and_names_the_array(pick_long):
    d = dispatcher(backend=fake_backend(), rule=pick_long, strict=True)
    c = PagedCase([9, 1], [20, 40], 8, 2, 64, 16, mx.float16, seed=3)
    meta = build_attention_metadata([9, 1], [20, 40], c.pages, 16, c.num_blocks)
    attention = d.plan(meta, GEOMETRY)
    args = (c.q, c.k_new, c.v_new, c.k_cache, c.v_cache)
    for _ in range(3):
        assert_close(attention(*args), c.oracle(0.125), mx.float16)
    assert d.counts == {"mixed": 3}
    with pytest.raises(ValueError, match="k, v"):
        attention.check(c.q, c.k_new[:3], c.v_new, c.k_cache, c.v_cache)


def test_mixed_route_canary_checks_both_kernels(caplog, pick_long):
    d = dispatcher(backend=fake_backend(FakeAttention(error=0.02)), rule=pick_long,
                   strict=False)
    with caplog.at_level(logging.WARNING, logger="paged_prefix.dispatch"):
        chosen = run(d, [9, 1], [20, 40])
    assert chosen.path == "reference" and "fake failed its first-use check" in chosen.reason


@pytest.mark.parametrize("broken", [dict(error=0.02), dict(fails=True)],
                         ids=["wrong-numbers", "compile-error"])
def test_canary_falls_back_to_the_reference_with_a_logged_reason(broken, caplog):
    backend = fake_backend(FakeAttention(**broken))
    d = dispatcher(backend=backend, strict=False)
    with caplog.at_level(logging.WARNING, logger="paged_prefix.dispatch"):
        first = run(d)
        run(d)
    assert first.path == "reference" and "first-use check" in first.reason
    assert d.counts == {"reference": 2}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "dtype=float16 head_dim=64 group=4 block=16" in warnings[0]
    assert backend.attention.calls == 1  # checked once per backend, never run after


@pytest.mark.parametrize("broken_rows,checked", [(16, [16]), (32, [16, 32])])
def test_canary_checks_every_tile_height(broken_rows, checked):
    """A tile height that only large batches choose is checked (and built) at first use too,
    not when a request's batch first needs it."""
    class TwoHeights(FakeAttention):
        def launch(self, q, k_cache, v_cache, plan, sinks=None):
            out = super().launch(q, k_cache, v_cache, plan)
            return out * (1.02 if plan.block_m == broken_rows else 1.0)
    attention = TwoHeights(heights=(16, 32))
    chosen = run(dispatcher(backend=fake_backend(attention), strict=False))
    assert chosen.path == "reference" and f"block_m={broken_rows}" in chosen.reason
    assert attention.launched_heights == checked  # a failure ends the check
    broken_rows = 0
    good = TwoHeights(heights=(16, 32))
    assert run(dispatcher(backend=fake_backend(good), strict=True)).path == "fake"
    assert good.launched_heights == [16, 32, None]


def test_the_first_forward_checks_every_executor_of_the_backend(caplog):
    """A kernel-path forward checks the page gather's copy too, once: the first later step
    that would run it (here a forced sdpa forward, strict) needs no check inside a request
    and acts on the verdict already logged."""
    backend = fake_backend(gather=FakeGather(broken=True))
    with caplog.at_level(logging.WARNING, logger="paged_prefix.dispatch"):
        assert run(dispatcher(backend=backend, strict=True)).path == "fake"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "fake gather + sdpa" in warnings[0]
    assert "gathered k differs" in warnings[0]
    checks = len(backend.attention.planned)
    with pytest.raises(RuntimeError, match="gather \\+ sdpa .* failed its first-use check"):
        run(dispatcher("sdpa", backend=backend))
    assert len(backend.attention.planned) == checks and len(caplog.records) == 1


@pytest.mark.parametrize("path", ["auto", "fake"])
def test_canary_failure_raises_when_strict_or_forced(path):
    d = dispatcher(path, backend=fake_backend(FakeAttention(error=0.02)), strict=path == "auto")
    with pytest.raises(RuntimeError, match="first-use check"):
        run(d)


@pytest.mark.parametrize("path", ["cuda", "metal"])
def test_forcing_a_missing_backend_raises(path):
    with pytest.raises(ValueError, match=ENV_VAR):
        run(dispatcher(path))


def test_env_var_override_and_bad_value(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "reference")
    assert Dispatcher().path == "reference"
    monkeypatch.setenv(ENV_VAR, "flash")
    with pytest.raises(ValueError, match=ENV_VAR):
        Dispatcher()


def test_plan_refuses_a_geometry_for_another_block_size():
    meta = build_attention_metadata([3], [20], [[1, 2]], 16, 4)
    with pytest.raises(ValueError, match="block size"):
        dispatcher("reference").plan(meta, Geometry(8, 2, 64, 32, mx.float16, 0.1))


def test_geometry_checks_its_fields():
    with pytest.raises(ValueError, match="num_heads"):
        Geometry(6, 4, 64, 16, mx.float16, 0.1)
    with pytest.raises(ValueError, match="head_dim"):
        Geometry(8, 2, 64.0, 16, mx.float16, 0.1)
    for scale in (float("nan"), float("inf"), "0.125", True):
        with pytest.raises(ValueError, match="scale"):
            Geometry(8, 2, 64, 16, mx.float16, scale)
    for dtype in ("float16", mx.int32, mx.float64):
        with pytest.raises(ValueError, match="dtype"):
            Geometry(8, 2, 64, 16, dtype, 0.1)


def test_the_dense_oracle_sees_the_fake_error():
    """The fake's 2% error is real: the per-element check catches it on its own."""
    c = PagedCase([5, 1], [13, 30], 8, 2, 64, 16, mx.float16)
    kernel = FakeAttention(error=0.02)
    meta = build_attention_metadata([5, 1], [13, 30], c.pages, 16, c.num_blocks)
    out = kernel.run(c.q, c.k_new, c.v_new, c.k_cache, c.v_cache,
                     kernel.plan(meta.lengths, GEOMETRY, meta.block_tables))
    with pytest.raises(AssertionError):
        assert_close(out, c.oracle(0.125), mx.float16)
    assert np.isfinite(np.array(out.astype(mx.float32))).all()


def test_a_gathers_first_use_check_compares_its_copy_not_sdpa(monkeypatch):
    """A copy is exact, the SDPA after it may round otherwise on its layout (on CUDA at head dim
    32 the last digits differed, and bit equality failed every variant): the check compares the
    gathered K/V with MLX's own gather, bit for bit, and never runs the attention."""
    from paged_prefix import canary

    monkeypatch.setattr(GatheredSdpa, "run", lambda *a, **k: pytest.fail("SDPA ran"))
    for head_dim, dtype in ((32, mx.float16), (32, mx.float32), (64, mx.bfloat16)):
        g = Geometry(4, 2, head_dim, 16, dtype, head_dim ** -0.5)
        assert canary.check(GatheredSdpa(FakeGather()), g) is None
        why = canary.check(GatheredSdpa(FakeGather(broken=True)), g)
        assert why and "gathered k differs" in why
