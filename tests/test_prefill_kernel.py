"""The Hopper prefill kernel (TMA page loads, warp-specialized) and the rule that hands it long
suffixes over cached prefixes.

On a Hopper GPU (gpu-marked): against the float64 oracle, per element, with conftest's
tolerances, on `PagedCase` layouts (pages shuffled across a NaN-poisoned cache, table padding
pointing at poison, outputs never pre-zeroed), every variant the kernel builds; and through the
dispatcher, where the rule must pick it. Anywhere: its source, its launch contract with
stand-ins, its support rules, and the rule and dispatcher plumbing with a fake kernel.
"""

from __future__ import annotations

import logging
import math

import mlx.core as mx
import numpy as np
import pytest

from jit_kernels import GatheredSdpa, KernelBackend, available_backends
from jit_kernels import hopper_prefill_attention as prefill_attention
from jit_kernels import plan as tile_plan
from jit_kernels.geometry import Geometry
from paged_prefix import rules
from paged_prefix.attention_metadata import build_attention_metadata
from paged_prefix.dispatch import Dispatcher
from paged_prefix.route import Source
from tests.conftest import HAS_WGMMA, CubinStandIns, PagedCase, assert_close, plan_of
from tests.test_dispatch import FakeAttention, FakeGather
from tests.test_kernels import ask

G128 = Geometry(32, 8, 128, 16, mx.bfloat16, 128 ** -0.5)


def hopper(test):
    """On a Hopper GPU only (gpu-marked)."""
    return pytest.mark.gpu(pytest.mark.skipif(not HAS_WGMMA, reason="no Hopper GPU")(test))


def test_source_is_one_self_contained_unit():
    """NVRTC gets no include path: the source declares what it uses, for either 16-bit type."""
    for dtype, ab in ((mx.bfloat16, "bf16"), (mx.float16, "f16")):
        g = Geometry(32, 8, 128, 16, dtype, 128 ** -0.5)
        src = prefill_attention.kernel_source("paged_prefill_tma_test", g)
        assert "#include" not in src and 'extern "C" __global__' in src
        assert "#define KERNEL_NAME paged_prefill_tma_test\n" in src and f'#define AB "{ab}"' in src
        assert "tma_load4(" in src and "setmaxnreg" in src


def test_launch_contract():
    """Compiled once per variant for sm_90a, launched as a cubin: a block of 384 threads per
    128-row work item, planned unsplit; the caches' map templates encoded once per shape."""
    stand_ins, encoded = CubinStandIns(), []
    compiled, launched = stand_ins.compiled, stand_ins.launched

    def maps(rows, bs, hkv):
        encoded.append((rows, bs, hkv))
        return np.zeros(256, dtype=np.uint8)

    kernel = prefill_attention.HopperPrefillAttention(stand_ins.compile, stand_ins.precompiled,
                                                      maps)
    c = PagedCase([300, 5], [1500, 700], 32, 8, 128, 16, mx.bfloat16)
    out, plan = c.attend(kernel, G128)
    work = plan.tiles.work_host
    assert not plan.tiles.num_slots and (work[:, tile_plan.KV_START] == 0).all()  # unsplit
    assert plan.tiles.num_items == (10 + 1) * 8  # 128 rows: 32 tokens of group 4, 8 kv heads
    assert out.shape == c.q.shape and out.dtype == c.q.dtype
    kernel.run(c.q, c.k_new, c.v_new, c.k_cache, c.v_cache, plan)
    assert [arch for _, arch in compiled] == ["sm_90a"]
    assert encoded == [(c.num_blocks * 16, 16, 8)]
    kw = launched[0]
    assert kw["name"] == compiled[0][0] and prefill_attention.unit("").hash in kw["name"]
    assert kw["grid"] == (plan.tiles.num_items * 384, 1, 1) and kw["threadgroup"] == (384, 1, 1)
    assert kw["scalars"] == [32, c.block_tables.shape[1]] and kw["ensure_row_contiguous"]
    assert kw["shared_memory"] == 2 * 3 * 128 * 128 * 2 + 1024 and len(kw["inputs"]) == 6
    some = kernel.plan(c.lengths, G128, c.block_tables, seqs=[1])
    assert set(some.tiles.work_host[:, tile_plan.SEQ].tolist()) == {1}


@pytest.mark.parametrize("change,match", [
    (dict(head_dim=64, num_heads=8, num_kv_heads=2), "head_dim"),
    (dict(block_size=64), "block size"),
    (dict(dtype=mx.float32), "dtype"),
    (dict(scale=-1.0), "scale"),
])
def test_unsupported_geometry_is_refused_with_the_reason(change, match):
    kernel = prefill_attention.HopperPrefillAttention(lambda *a: b"", lambda **kw: None)
    g = Geometry(**{**dict(num_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
                           dtype=mx.bfloat16, scale=0.1), **change})
    assert match in kernel.unsupported_reason(g)
    with pytest.raises(ValueError, match=match):
        plan_of(kernel, np.array([0, 4]), np.array([9]), g)


class Supports:
    """A stand-in prefill kernel for the host-side rule: supports head dim 128 only."""

    @staticmethod
    def unsupported_reason(g):
        return None if g.head_dim == 128 else f"head_dim {g.head_dim}"


@pytest.mark.parametrize("q_lens,ctx_lens,first,then", [
    ([512], [4096], (0,), (0,)),            # 8x: the prefill kernel, always
    ([256], [1024], (0,), (0,)),            # 4x, the bound
    ([2048], [8192], (0,), (0,)),           # CUDA_PREFILL_MAX_Q itself
    ([512], [1024], (0,), ()),              # 2x: until its cuDNN graph is built, then SDPA
    ([4096], [16384], (0,), ()),            # more new tokens than CUDA_PREFILL_MAX_Q: the same
    ([4096], [0], (), ()),                  # nothing cached: the paged kernel, then SDPA
    ([64, 512], [99999, 2048], (1,), (1,)),  # a short suffix stays on the paged kernel
])
def test_rule_hands_cached_long_suffixes_to_the_prefill_kernel(q_lens, ctx_lens, first, then):
    """The first time a shape comes (no cuDNN graph) every picked sequence with a cached prefix
    takes the prefill kernel; once its graph is worth building (here from the second time:
    graph_build_ms=0), SDPA takes those under 4x (or over 2048 new)."""
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    lens = np.array(q_lens) + np.array(ctx_lens)
    rule = rules.CudaSdpaRule(prefill=Supports(), graph_build_ms=0)
    for want in (first, then):
        pick = ask(rule, cu, lens, G128)
        assert (pick.prefill if pick else ()) == want
        if want:
            assert set(want) <= set(pick.seqs) and "prefill kernel" in pick.reason
    long = tuple(s for s, q in enumerate(q_lens) if q >= rules.CUDA_SDPA_MIN_Q)
    assert pick.seqs == long  # the second time: every long prefill leaves the paged kernel
    assert ask(rules.CudaSdpaRule(), cu, lens, G128) is None  # no prefill kernel: as before
    other = Geometry(32, 8, 64, 16, mx.bfloat16, 0.125)  # a geometry it does not support
    assert ask(rule, cu, lens, other) is None


def test_the_prefill_kernels_time_counts_toward_a_graph_at_its_own_rate():
    """A suffix the prefill kernel takes while its shape has no graph adds the prefill kernel's
    smaller estimated extra time (CUDA_PREFILL_OVER_SDPA), so it waits for more forwards than
    on the paged kernel; one it always takes (>= 4x prefix, gathered) adds nothing."""
    cu, lens = np.array([0, 512]), np.array([1536])  # 2x: SDPA's, once its graph is worth it
    extra = rules.kernel_extra_ms(512, 1536, G128, 32, rules.CUDA_PREFILL_OVER_SDPA)
    forwards = math.ceil(rules.CUDA_GRAPH_BUILD_MS / extra)
    assert forwards > 4 * math.ceil(rules.CUDA_GRAPH_BUILD_MS /
                                    rules.kernel_extra_ms(512, 1536, G128, 32))
    rule = rules.CudaSdpaRule(prefill=Supports())
    assert all(ask(rule, cu, lens, G128, layers=32).prefill == (0,) for _ in range(forwards))
    pick = ask(rule, cu, lens, G128, layers=32)
    assert (pick.seqs, pick.prefill) == ((0,), ())
    always = (np.array([0, 512]), np.array([4608]))  # 8x
    for _ in range(3):
        assert ask(rule, *always, G128, layers=32).prefill == (0,)
    assert not any(shape[4:6] == (512, 4608) for shape in rule._kernel_ms)


def test_rule_reads_a_run_of_pages_in_place_once_its_graph_is_built():
    """Pages in one run have no gather to save: the prefill kernel until SDPA's graph for that
    layout is built, then SDPA reading them in place; gathered, the same shape stays on the
    prefill kernel. Beside decode rows, a cached sequence takes the prefill kernel however
    short its prefix is, where the paged kernel took it before."""
    rule = rules.CudaSdpaRule(prefill=Supports(), graph_build_ms=0)
    cu, lens = np.array([0, 512]), np.array([4608])
    run = np.arange(3, 3 + 288, dtype=np.int32)[None]
    assert ask(rule, cu, lens, G128, run).prefill == (0,)
    pick = ask(rule, cu, lens, G128, run)
    assert pick.seqs == (0,) and pick.prefill == ()
    assert ask(rule, cu, lens, G128, run[:, ::-1].copy()).prefill == (0,)
    mixed = ask(rule, np.array([0, 1, 513, 1213, 1813]), np.array([90, 4608, 1400, 600]), G128)
    assert (mixed.seqs, mixed.prefill) == ((1, 2), (1, 2))  # 700 over 700, 600 uncached


@pytest.mark.parametrize("q_lens,ctx_lens,window,prefill,sdpa", [
    ([4096], [16384], 4096, (), ()),     # cut by the window, too long for the prefill kernel
    ([512], [16384], 4096, (0,), ()),    # cut: the prefill kernel, run of pages or not
    ([512], [1024], 4096, (), (0,)),     # 1536 keys inside the window: SDPA, its graph built
    ([4096], [0], 4096, (), (0,)),       # a fresh prompt of one window: causal SDPA
    ([8192], [0], 4096, (), ()),         # a fresh prompt of two windows: the paged kernel
])
def test_a_window_that_cuts_the_keys_keeps_the_prefill_off_sdpa(q_lens, ctx_lens, window,
                                                                 prefill, sdpa):
    """MLX's SDPA takes a window's mask through its unfused fallback (8.8x the paged kernel at
    W=4096, C=16384, Lq=4096 on the H200), so such a prefill never goes to SDPA, laid out in
    one run of pages or not, asked for before or not."""
    g = Geometry(32, 8, 128, 16, mx.bfloat16, 128 ** -0.5, window=window)
    cu, lens = np.array([0, q_lens[0]]), np.array(q_lens) + np.array(ctx_lens)
    run = np.arange(1, 1 + -(-int(lens[0]) // 16), dtype=np.int32)[None]
    rule = rules.CudaSdpaRule(prefill=Supports(), graph_build_ms=0)
    for table in (None, run, None, run):
        pick = ask(rule, cu, lens, g, table)
    got_prefill = pick.prefill if pick else ()
    got_sdpa = tuple(s for s in pick.seqs if s not in pick.prefill) if pick else ()
    assert (got_prefill, got_sdpa) == (prefill, sdpa)
    if pick and not sdpa:
        assert rules.WINDOW_MASK_REASON in pick.reason


def fake_rule(lengths, g, runs, layers):
    """The CUDA rule's prefill choice at a test's size: prefills of >= 8 tokens leave the
    paged kernel, those over a prefix of 4x go to the prefill kernel."""
    q, lens = lengths.q_lens, lengths.seq_lens
    seqs = tuple(int(s) for s in np.flatnonzero(q >= 8))
    if not seqs:
        return None
    return rules.SdpaPick(seqs, "long", tuple(s for s in seqs if lens[s] - q[s] >= 4 * q[s]))


class FakePrefill(FakeAttention):
    name = "fake prefill"

    def canary_plannings(self, g):
        return ({},)

    def plan(self, lengths, g, block_tables, seqs=None):
        return super().plan(lengths, g, block_tables, seqs)


def prefill_backend(prefill=None):
    return KernelBackend("fake", FakeAttention(), GatheredSdpa(FakeGather()),
                         prefill or FakePrefill())


def _run(d, q_lens, ctx, seed=0):
    c = PagedCase(list(q_lens), list(ctx), 8, 2, 64, 16, mx.float16, seed=seed)
    meta = build_attention_metadata(list(q_lens), list(ctx), c.pages, 16, c.num_blocks)
    g = Geometry(8, 2, 64, 16, mx.float16, 0.125)
    attention = d.plan(meta, g)
    args = (c.q, c.k_new, c.v_new, c.k_cache, c.v_cache)
    attention.check(*args)
    for _ in range(2):
        assert_close(attention(*args), c.oracle(0.125), mx.float16)
    return attention.route


@pytest.mark.parametrize("q_lens,ctx,path,sdpa_seqs,prefill_seqs", [
    ([9], [40], "sdpa", (), (0,)),                    # one sequence: the kernel alone
    ([9, 12], [40, 20], "sdpa", (1,), (0,)),          # and SDPA (gathered) beside it
    ([9, 1, 3], [40, 30, 0], "mixed", (), (0,)),      # beside the paged kernel's rows
    ([1, 12, 9, 2], [7, 0, 80, 16], "mixed", (1,), (2,)),
])
def test_dispatcher_runs_the_prefill_kernel_for_the_rules_sequences(q_lens, ctx, path,
                                                                    sdpa_seqs, prefill_seqs):
    backend = prefill_backend()
    d = Dispatcher("auto", backends={"fake": backend}, strict=True, rule_of=lambda b: fake_rule)
    chosen = _run(d, q_lens, ctx)
    assert (chosen.path, chosen.seqs(Source.PREFILL)) == (path, prefill_seqs)
    assert chosen.seqs(Source.NEW_ROWS, Source.IN_PLACE, Source.GATHERED) == sdpa_seqs
    assert chosen.backend == "fake"
    assert backend.prefill.planned[-1] == prefill_seqs  # the forward's plan: its sequences only
    assert "prefill kernel" in chosen.summary()


def test_a_failing_prefill_kernel_is_caught_by_the_canary(caplog):
    """Its first use is checked like every kernel's: strict raises, auto logs and falls back."""
    with pytest.raises(RuntimeError, match="fake prefill for"):
        _run(Dispatcher("auto", backends={"fake": prefill_backend(FakePrefill(error=0.02))},
                        strict=True, rule_of=lambda b: fake_rule), [9], [40])
    with caplog.at_level(logging.WARNING, logger="paged_prefix.dispatch"):
        chosen = _run(Dispatcher("auto", backends={"fake": prefill_backend(
            FakePrefill(error=0.02))}, strict=False, rule_of=lambda b: fake_rule), [9], [40])
    assert chosen.path == "reference" and "fake prefill failed" in chosen.reason
    assert "fake prefill" in caplog.text


# -- on a Hopper GPU ------------------------------------------------------------------------

def _check_kernel(q_lens, ctx_lens, group=4, num_kv_heads=8, block_size=16, dtype=mx.bfloat16,
                  seqs=None, seed=0):
    g = Geometry(group * num_kv_heads, num_kv_heads, 128, block_size, dtype, 128 ** -0.5)
    c = PagedCase(q_lens, ctx_lens, g.num_heads, num_kv_heads, 128, block_size, dtype, seed=seed)
    kernel = available_backends()["cuda"].prefill
    out, plan = c.attend(kernel, g, seqs=seqs)
    want = c.oracle(g.scale)
    rows = np.concatenate([np.arange(c.cu_seqlens_q[s], c.cu_seqlens_q[s + 1])
                           for s in (range(len(q_lens)) if seqs is None else seqs)])
    assert_close(out[mx.array(rows)], want[rows], dtype, f"q={q_lens} ctx={ctx_lens} seqs={seqs}")
    return out, kernel, c, plan


@hopper
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_variants(dtype, group, block_size):
    """Every variant the kernel builds: a partial last page and tile, causal rows past 128."""
    _check_kernel([129], [1000], group, 2, block_size, dtype)


@hopper
@pytest.mark.parametrize("q_lens,ctx_lens,seqs", [
    ([300, 77, 5], [16, 2000, 3333], None),  # partial pages and tiles, three sequences
    ([64, 1, 200], [0, 511, 45], None),      # a decode row, an uncached one
    ([1000], [17], None),
    ([512], [4096], None),
    ([256, 1, 600], [2048, 50, 2400], [0, 2]),  # a plan of some: the others' rows unwritten
])
def test_layouts(q_lens, ctx_lens, seqs):
    _check_kernel(q_lens, ctx_lens, seqs=seqs, seed=len(q_lens))


@hopper
def test_a_long_prefix():
    """70040 keys: pages past 2**16 rows of the cache, 548 tiles of keys in one item."""
    _check_kernel([40], [70000], group=4, num_kv_heads=1, block_size=32)


@hopper
def test_repeated_calls_are_bitwise_equal_and_caches_as_stored_read_alike():
    out, kernel, c, plan = _check_kernel([512], [4096])
    again = kernel.run(c.q, c.k_new, c.v_new, c.k_cache, c.v_cache, plan)
    words = [x.view(mx.uint32).reshape(-1, 8, 64) for x in (c.k_cache, c.v_cache)]
    stored = kernel.run(c.q, c.k_new, c.v_new, *words, plan)
    assert mx.array_equal(out, again).item() and mx.array_equal(out, stored).item()


@hopper
def test_the_dispatcher_picks_it_on_the_real_backend(caplog):
    """4096 cached tokens, 512 new, pages shuffled: the rule's prefill kernel, the first time."""
    c = PagedCase([512], [4096], 32, 8, 128, 16, mx.bfloat16, seed=3)
    meta = build_attention_metadata([512], [4096], c.pages, 16, c.num_blocks)
    d = Dispatcher("auto", strict=True)
    with caplog.at_level(logging.INFO, logger="paged_prefix.dispatch"):
        attention = d.plan(meta, G128)
    assert (attention.route.path, attention.route.seqs(Source.PREFILL)) == ("sdpa", (0,))
    attention.check(c.q, c.k_new, c.v_new, c.k_cache, c.v_cache)
    out = attention(c.q, c.k_new, c.v_new, c.k_cache, c.v_cache)
    assert_close(out, c.oracle(G128.scale), mx.bfloat16)
    assert "prefill kernel" in caplog.text and attention.route.summary() == "1 prefill kernel"

