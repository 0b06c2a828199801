"""The dispatcher: one decision per forward, a reason for it, the canary, no silent fallback.

`auto` is exercised with fake backends (the dispatcher takes its backends as an argument):
a correct one built on the reference, and broken ones that compute wrong numbers or fail to
compile, which the first-use check must catch.
"""

import logging
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np
import pytest

import reference
from jit_kernels import KernelBackend, rules
from jit_kernels.rules import SdpaPick
from jit_kernels.support import Geometry
from paged_prefix import dispatch
from paged_prefix.dispatch import ENV_VAR, Dispatcher
from paged_prefix.metadata import build_attention_metadata
from tests.conftest import HAS_CUDA, HAS_METAL, PagedCase, assert_close

GEOMETRY = Geometry(8, 2, 64, 16, mx.float16, 0.125)


@dataclass
class FakeAttention:
    """A 'kernel' that is the reference, optionally broken: off by `error` or failing to build."""

    error: float = 0.0
    fails: bool = False
    calls: int = 0

    def unsupported_reason(self, g):
        return None if g.head_dim == 64 else f"head_dim {g.head_dim}"

    def tile_rows(self, g):
        return (16,)

    def plan(self, cu, lens, g, seqs=None, block_m=None):
        return (cu, lens, g.scale), seqs, block_m

    def __call__(self, q, k_cache, v_cache, tables, plan):
        self.calls += 1
        if self.fails:
            raise RuntimeError("error: expected ';' (a compile error)")
        (cu, lens, scale), seqs, _ = plan
        out = reference.paged_attention(q, k_cache, v_cache, tables, cu, lens, scale)
        if seqs is not None:  # as the kernels: rows of sequences not planned stay unwritten
            planned = np.zeros(q.shape[0], dtype=bool)
            for s in seqs:
                planned[cu[s]:cu[s + 1]] = True
            out = mx.where(mx.array(planned)[:, None, None], out, float("nan"))
        return out * (1 + self.error)

    launch = __call__


class FakeGather:
    def unsupported_reason(self, dtype, head_dim):
        return None

    def check(self, k_cache, v_cache, plan):
        pass

    def launch(self, k_cache, v_cache, tables, plan):
        return [reference.gather_kv(k_cache, v_cache, tables[s], n)
                for s, n in zip(plan.seqs, plan.seq_lens)]


def fake_backend(rule=None, **broken):
    return KernelBackend("fake", FakeAttention(**broken), FakeGather(),
                         rule or (lambda cu, lens, g, tables: None))


@pytest.fixture(autouse=True)
def fresh_verdicts(monkeypatch):
    monkeypatch.setattr(dispatch, "_VERDICTS", {})


def run(dispatcher, q_lens=(5, 1), ctx=(13, 30)):
    c = PagedCase(list(q_lens), list(ctx), 8, 2, 64, 16, mx.float16, seed=0)
    meta = build_attention_metadata(list(q_lens), list(ctx), c.pages, 16, c.num_blocks)
    out = dispatcher.plan(meta, GEOMETRY)(c.q, c.k_new, c.v_new, c.k_cache, c.v_cache)
    assert_close(out, c.oracle(0.125), mx.float16)
    return dispatcher.last


def test_forced_reference_runs_and_is_counted():
    d = Dispatcher("reference", backends={})
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
    d = Dispatcher("auto", backends={"fake": backend}, strict=True)
    assert run(d).path == "fake" and d.counts == {"fake": 1}
    assert backend.attention.calls == 2  # the canary, then the call


def test_auto_follows_the_backends_rule_and_support():
    rule = fake_backend(rule=lambda cu, lens, g, tables: SdpaPick((0, 1), "measured faster"))
    choice = run(Dispatcher("auto", backends={"fake": rule}, strict=True))
    assert (choice.path, choice.reason, choice.backend) == ("sdpa", "measured faster", "fake")
    d = Dispatcher("auto", backends={"fake": fake_backend()}, strict=True)
    c = PagedCase([3], [20], 8, 2, 128, 16, mx.float16)
    meta = build_attention_metadata([3], [20], c.pages, 16, c.num_blocks)
    d.plan(meta, Geometry(8, 2, 128, 16, mx.float16, 0.125))
    assert d.last.path == "sdpa" and "head_dim 128" in d.last.reason


@dataclass
class CountingAttention(FakeAttention):
    plans: int = 0
    planned: list = field(default_factory=list)  # each plan's sequences (None: all)

    def plan(self, cu, lens, g, seqs=None, block_m=None):
        self.plans += 1
        self.planned.append(None if seqs is None else list(seqs))
        return super().plan(cu, lens, g, seqs, block_m)


def test_a_batch_planned_again_reuses_its_plan_per_chosen_path():
    """The benchmark repeats one batch: its plan (device arrays the host writes) is built once
    per path, and a new batch or a new choice (the rule flips after a shape's first request)
    plans afresh."""
    asked = set()

    def second_time_sdpa(cu, lens, g, tables):  # rules.CudaSdpaRule's shape memory, in small
        key = tuple(np.diff(cu))
        seen = key in asked
        asked.add(key)
        return SdpaPick(tuple(range(len(lens))), "asked before") if seen else None
    attention = CountingAttention()
    d = Dispatcher("auto", backends={"fake": KernelBackend("fake", attention, FakeGather(),
                                                           second_time_sdpa)}, strict=True)
    c = PagedCase([5, 1], [13, 30], 8, 2, 64, 16, mx.float16, seed=0)
    meta = build_attention_metadata([5, 1], [13, 30], c.pages, 16, c.num_blocks)
    args = (c.q, c.k_new, c.v_new, c.k_cache, c.v_cache)
    first = d.plan(meta, GEOMETRY)
    assert first.choice.path == "fake" and attention.plans == 2  # the canary's, then this one
    sdpa = [d.plan(meta, GEOMETRY) for _ in range(3)]
    assert {a.choice.path for a in sdpa} == {"sdpa"}
    assert sdpa[0]._unchecked is sdpa[2]._unchecked  # planned once for the three
    for attention_call in (first, *sdpa):
        assert_close(attention_call(*args), c.oracle(0.125), mx.float16)
    again = build_attention_metadata([5, 1], [13, 30], c.pages, 16, c.num_blocks)
    assert d.plan(again, GEOMETRY)._unchecked is not sdpa[0]._unchecked
    assert attention.plans == 2


@pytest.fixture
def pick_long(monkeypatch):
    """CUDA's length rule, sending every prefill of >= 8 tokens to SDPA (a test's size)."""
    monkeypatch.setattr(rules, "CUDA_SDPA_MIN_Q", 8)
    return rules.cuda_prefers_sdpa


@pytest.mark.parametrize("q_lens,ctx,sdpa_seqs", [
    ([9, 1, 3], [20, 40, 0], (0,)),        # a long suffix over a prefix beside a decode row
    ([1, 12, 2, 8], [7, 0, 33, 16], (1, 3)),  # one fresh, one cached; picked rows not first
    ([3, 30], [50, 5], (1,)),              # the picked sequence holds the last rows
])
def test_auto_mixes_sdpa_and_the_kernel_when_the_rule_picks_some_sequences(q_lens, ctx,
                                                                           sdpa_seqs, pick_long):
    """The kernel plans only the other sequences (the fake leaves the rest NaN, as the real
    kernels leave them unwritten); SDPA's rows overwrite them: the oracle holds everywhere."""
    backend = KernelBackend("fake", CountingAttention(), FakeGather(), pick_long)
    d = Dispatcher("auto", backends={"fake": backend}, strict=True)
    choice = run(d, q_lens, ctx)
    assert (choice.path, choice.backend, choice.sdpa_seqs) == ("mixed", "fake", sdpa_seqs)
    assert "prefills of >= 8 tokens" in choice.reason and d.counts == {"mixed": 1}
    assert choice.components() == ("attention", "gather")
    # the canary planned the whole batch; the forward planned the others only
    assert backend.attention.planned[-1] == [s for s in range(len(q_lens)) if s not in sdpa_seqs]


@dataclass
class CountingGather(FakeGather):
    launched: list = field(default_factory=list)  # each launch's sequences

    def launch(self, k_cache, v_cache, tables, plan):
        self.launched.append(plan.seqs)
        return super().launch(k_cache, v_cache, tables, plan)


@pytest.mark.parametrize("picked,path", [((0, 1, 2), "sdpa"), ((0, 1), "mixed")])
def test_sdpa_reads_a_run_of_pages_in_place_and_gathers_the_rest(picked, path):
    """The dispatcher hands the host block table to the rule and to the SDPA plan: sequence 0's
    pages are one run of blocks, read in place; only sequence 1's are gathered."""
    tables = []

    def rule(cu, lens, g, table):
        tables.append(table)
        return SdpaPick(picked, "measured faster")
    gather = CountingGather()
    d = Dispatcher("auto", backends={"fake": KernelBackend("fake", FakeAttention(), gather,
                                                           rule)}, strict=True)
    c = PagedCase([9, 3, 1], [20, 40, 30], 8, 2, 64, 16, mx.float16, seed=2,
                  runs=[True, False, True])
    meta = build_attention_metadata([9, 3, 1], [20, 40, 30], c.pages, 16, c.num_blocks)
    attention = d.plan(meta, GEOMETRY)
    gather.launched.clear()  # the first-use check's
    out = attention(c.q, c.k_new, c.v_new, c.k_cache, c.v_cache)
    assert_close(out, c.oracle(0.125), mx.float16)
    assert d.last.path == path and gather.launched == [(1,)]
    assert d.last_sources == f"sequences: 1 gathered, {len(picked) - 1} read in place"
    assert tables[-1] is meta.block_tables_host


def test_mixed_path_layers_after_the_first_take_the_unchecked_launch(pick_long):
    backend = KernelBackend("fake", CountingAttention(), FakeGather(), pick_long)
    d = Dispatcher("auto", backends={"fake": backend}, strict=True)
    c = PagedCase([9, 1], [20, 40], 8, 2, 64, 16, mx.float16, seed=3)
    meta = build_attention_metadata([9, 1], [20, 40], c.pages, 16, c.num_blocks)
    attention = d.plan(meta, GEOMETRY)
    args = (c.q, c.k_new, c.v_new, c.k_cache, c.v_cache)
    for _ in range(3):
        assert_close(attention(*args), c.oracle(0.125), mx.float16)
    assert d.counts == {"mixed": 3}
    with pytest.raises(ValueError, match="k, v"):  # the first call of a forward checks
        d.plan(build_attention_metadata([9, 1], [20, 40], c.pages, 16, c.num_blocks),
               GEOMETRY)(c.q, c.k_new[:3], c.v_new, c.k_cache, c.v_cache)


def test_mixed_path_canary_checks_both_kernels(caplog, pick_long):
    backend = KernelBackend("fake", FakeAttention(error=0.02), FakeGather(), pick_long)
    d = Dispatcher("auto", backends={"fake": backend}, strict=False)
    with caplog.at_level(logging.WARNING, logger="paged_prefix.dispatch"):
        choice = run(d, [9, 1], [20, 40])
    assert choice.path == "reference" and "attention kernel failed" in choice.reason


@pytest.mark.parametrize("broken", [dict(error=0.02), dict(fails=True)],
                         ids=["wrong-numbers", "compile-error"])
def test_canary_falls_back_to_the_reference_with_a_logged_reason(broken, caplog):
    backend = fake_backend(**broken)
    d = Dispatcher("auto", backends={"fake": backend}, strict=False)
    with caplog.at_level(logging.WARNING, logger="paged_prefix.dispatch"):
        first = run(d)
        run(d)
    assert first.path == "reference" and "first-use check" in first.reason
    assert d.counts == {"reference": 2}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "dtype=float16 head_dim=64 group=4 block=16" in warnings[0]
    assert backend.attention.calls == 1  # checked once per process, never run after


@dataclass
class TwoHeightAttention(FakeAttention):
    """Plans 16- or 32-row tiles; wrong only at `broken_rows`."""

    broken_rows: int = 32
    heights: list = field(default_factory=list)

    def tile_rows(self, g):
        return (16, 32)

    def __call__(self, q, k_cache, v_cache, tables, plan):
        self.heights.append(plan[2])
        return super().__call__(q, k_cache, v_cache, tables, plan) * \
            (1.02 if plan[2] == self.broken_rows else 1.0)


@pytest.mark.parametrize("broken_rows,checked", [(16, [16]), (32, [16, 32])])
def test_canary_checks_every_tile_height(broken_rows, checked):
    """A tile height that only large batches choose is checked (and built) at first use too,
    not when a request's batch first needs it."""
    attention = TwoHeightAttention(broken_rows=broken_rows)
    d = Dispatcher("auto", backends={"fake": KernelBackend("fake", attention, FakeGather(),
                                                           lambda cu, lens, g, tables: None)},
                   strict=False)
    choice = run(d)
    assert choice.path == "reference" and f"{broken_rows}-row query tiles" in choice.reason
    assert attention.heights == checked  # a failure ends the check
    good = TwoHeightAttention(broken_rows=0)
    d = Dispatcher("auto", backends={"fake": KernelBackend("fake", good, FakeGather(),
                                                           lambda cu, lens, g, tables: None)}, strict=True)
    dispatch._VERDICTS.clear()
    assert run(d).path == "fake" and good.heights == [16, 32, None]


class BrokenGather(FakeGather):
    """Copies V where K belongs: a page gather that computes wrong numbers."""

    def launch(self, k_cache, v_cache, tables, plan):
        return [(v, v) for _, v in super().launch(k_cache, v_cache, tables, plan)]


def test_the_first_forward_checks_every_kernel_of_the_backend(caplog):
    """A kernel-path forward checks the page gather too, once: the first later step that
    would run it (here a forced sdpa forward, strict) needs no check inside a request and
    acts on the verdict already logged."""
    attention = CountingAttention()
    backend = KernelBackend("fake", attention, BrokenGather(), lambda cu, lens, g, tables: None)
    with caplog.at_level(logging.WARNING, logger="paged_prefix.dispatch"):
        assert run(Dispatcher("auto", backends={"fake": backend}, strict=True)).path == "fake"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "fake gather kernel" in warnings[0]
    checks = attention.plans
    with pytest.raises(RuntimeError, match="gather kernel .* failed its first-use check"):
        run(Dispatcher("sdpa", backends={"fake": backend}))
    assert attention.plans == checks and len(caplog.records) == 1  # no check ran again


@pytest.mark.parametrize("path", ["auto", "fake"])
def test_canary_failure_raises_when_strict_or_forced(path):
    d = Dispatcher(path, backends={"fake": fake_backend(error=0.02)}, strict=path == "auto")
    with pytest.raises(RuntimeError, match="first-use check"):
        run(d)


@pytest.mark.parametrize("path", ["cuda", "metal"])
def test_forcing_a_missing_backend_raises(path):
    with pytest.raises(ValueError, match=ENV_VAR):
        run(Dispatcher(path, backends={}))


def test_env_var_override_and_bad_value(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "reference")
    assert Dispatcher().path == "reference"
    monkeypatch.setenv(ENV_VAR, "flash")
    with pytest.raises(ValueError, match=ENV_VAR):
        Dispatcher()


def test_plan_refuses_a_geometry_for_another_block_size():
    meta = build_attention_metadata([3], [20], [[1, 2]], 16, 4)
    with pytest.raises(ValueError, match="block size"):
        Dispatcher("reference", backends={}).plan(meta, Geometry(8, 2, 64, 32, mx.float16, 0.1))


def test_geometry_checks_its_fields():
    with pytest.raises(ValueError, match="num_heads"):
        Geometry(6, 4, 64, 16, mx.float16, 0.1)
    with pytest.raises(ValueError, match="head_dim"):
        Geometry(8, 2, 64.0, 16, mx.float16, 0.1)


def test_the_dense_oracle_sees_the_fake_error():
    """The fake's 2% error is real: the per-element check catches it on its own."""
    c = PagedCase([5, 1], [13, 30], 8, 2, 64, 16, mx.float16)
    out = FakeAttention(error=0.02)(c.q, c.k_cache, c.v_cache, c.block_tables,
                                    ((c.cu_seqlens_q, c.seq_lens, 0.125), None, None))
    with pytest.raises(AssertionError):
        assert_close(out, c.oracle(0.125), mx.float16)
    assert np.isfinite(np.array(out.astype(mx.float32))).all()
