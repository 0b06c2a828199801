"""The CUDA kernels' attention variants (`reference.contract`: sliding window, logit softcap,
sinks) against the float64 oracle, and the windowed plans.

On a CUDA GPU (gpu-marked): the paged kernel ("cuda": the wgmma kernel at head dim 128 on
Hopper; "cuda-mma": the mma.sync kernel) and, on Hopper, the prefill kernel, on `PagedCase`
layouts whose pages wholly left of each sequence's first visible key hold NaN besides the
unowned ones, so a kernel that reads a page left of its window, or ignores a window, cap or
sink, fails. Windows W of 1, 7, a block, a block + 1 and 4096 (at least the context); caps over
large scores; sinks of both signs, one far above every score; split rows whose late parts
dominate; decode and prefill rows, fp16 and bf16, every block size and group.
Anywhere: the planner's windowed work list emulated in numpy against the oracle; what each
variant compiles and what its launch receives (stand-ins for MLX and NVRTC).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from jit_kernels import available_backends
from jit_kernels import cuda_paged_attention as cuda_attention
from jit_kernels import hopper_paged_attention as hopper_attention
from jit_kernels import hopper_prefill_attention as prefill_attention
from jit_kernels import plan as tile_plan
from jit_kernels.geometry import Geometry
from tests.conftest import (
    TOLERANCES,
    CubinStandIns,
    PagedCase,
    assert_close,
    plan_of,
    window_edge_case,
    zeros,
)
from tests.test_kernels import BACKENDS, emulate_plan, get_backend
from tests.test_prefill_kernel import hopper

CUDA_BACKENDS = [p for p in BACKENDS if p.values[0] in ("cuda", "cuda-mma")]
FEATURE_SETS = ["window", "softcap", "sinks", "window+sinks", "window+softcap",
                "window+softcap+sinks"]


def variant(num_heads, num_kv_heads, head_dim, block_size, dtype, window=None, softcap=None,
            sinks=False, scale=None) -> Geometry:
    return Geometry(num_heads, num_kv_heads, head_dim, block_size, dtype,
                    scale or head_dim ** -0.5, window=window, softcap=softcap, sinks=sinks)


def sink_logits(num_heads, seed=0) -> mx.array:
    """Sinks of both signs around the log of a long row's sum (so they weigh as much as its
    keys); head 0's far above every score (its rows' outputs near zero), head 1's far below."""
    x = np.random.default_rng(seed).standard_normal(num_heads).astype(np.float32) * 3 + 4
    x[0], x[1 % num_heads] = 25.0, -25.0
    return mx.array(x)


def differs(a: np.ndarray, b: np.ndarray, dtype: mx.Dtype) -> bool:
    """Whether `a` fails the dtype's tolerance against `b`: an answer the checks tell apart."""
    atol, rtol = TOLERANCES[dtype]
    return bool((np.abs(a - b) - (atol + rtol * np.abs(b))).max() > 0)


def check(kernel, g: Geometry, q_lens, ctx_lens, sinks=None, seqs=None, block_m=None,
          **case) -> object:
    """`kernel` on a PagedCase of `g` (pages left of its window poisoned) against the oracle, on
    the planned sequences' rows; returns the plan."""
    c = PagedCase(q_lens, ctx_lens, g.num_heads, g.num_kv_heads, g.head_dim, g.block_size,
                  g.dtype, window=g.window, **case)
    assert kernel.unsupported_reason(g) is None
    options = {} if seqs is None else {"seqs": seqs}
    if block_m is not None:
        if block_m not in kernel.tile_rows(g):
            pytest.skip(f"{kernel.name} plans no {block_m}-row tiles at head dim {g.head_dim}")
        options["block_m"] = block_m
    out, plan = c.attend(kernel, g, sinks=sinks, **options)
    want = c.oracle(g.scale, g.window, g.softcap, sinks)
    rows = np.concatenate([np.arange(c.cu_seqlens_q[s], c.cu_seqlens_q[s + 1])
                           for s in (range(len(q_lens)) if seqs is None else seqs)])
    assert_close(out[mx.array(rows)], want[rows], g.dtype,
                 f"{g.describe()} W={g.window} q={q_lens} ctx={ctx_lens}", c.q_scale)
    return plan


def first_visible_tile(work: np.ndarray, window: int, block_n: int) -> np.ndarray:
    """Per work item the first key of the kv tile holding its tile's first visible key."""
    return np.maximum(work[:, tile_plan.POS0] - window + 1, 0) // block_n * block_n


# -- the planner, anywhere -------------------------------------------------------------------

@pytest.mark.parametrize("window", [1, 7, 8, 9, 4096])
@pytest.mark.parametrize("features", ["window", "window+sinks", "window+softcap+sinks"])
@pytest.mark.parametrize("q_lens,ctx_lens,num_sms", [
    ([16], [300], 132),                 # a short suffix over a long prefix: split
    ([1, 1, 1], [90, 0, 400], 132),     # decode rows, one with no context
    ([5, 1, 37], [13, 60, 0], 1),       # mixed, unsplit
    ([40, 2], [600, 500], 16),          # long tiles split, the others not
    ([1] * 16, list(range(95, 111)), 132),  # a first visible key at every offset in a kv tile
])
def test_windowed_plan_covers_every_visible_key_once(window, features, q_lens, ctx_lens,
                                                     num_sms):
    """A windowed work list (CPU-only), emulated with the kernels' algorithm, gives the oracle;
    every tile starts at the kv tile of its first visible key and no item reaches below it."""
    group, block_m, block_n = 2, 16, 16
    softcap = 1.5 if "softcap" in features else None
    sinks = sink_logits(2 * group) if "sinks" in features else None
    c = PagedCase(q_lens, ctx_lens, 2 * group, 2, 8, 8, mx.float32, q_scale=3.0)
    tiles = tile_plan.build_tile_plan(c.cu_seqlens_q, c.seq_lens, group, 2, block_m, block_n,
                                      num_sms=num_sms, window=window)
    work = tiles.work_host
    assert work.shape[1] == len(tile_plan.work_columns(True))
    assert (work[:, tile_plan.WINDOW] == window).all()
    lowest = first_visible_tile(work, window, block_n)
    assert (work[:, tile_plan.KV_START] >= lowest).all()
    firsts = work[:, tile_plan.SLOT] <= work[:, tile_plan.FIRST_SLOT]  # unsplit or first part
    assert (work[firsts, tile_plan.KV_START] == lowest[firsts]).all()
    sink_np = None if sinks is None else np.array(sinks).astype(np.float64)  # no GPU float64
    got = emulate_plan(c, 0.3, group, tiles, block_m, window, softcap, sink_np)
    want = c.oracle(0.3, window, softcap, sinks)
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("kind", ["mma", "wgmma"])
def test_a_windowed_decode_row_costs_what_its_window_does(kind):
    """A decode row with W = 4096 over a 32K context is planned as a context of its in-window
    kv tiles is (4096 keys and the part of a tile before them): the same splits of the same
    lengths, from the window's kv tile on (host-only)."""
    g = variant(32, 8, 128, 16, mx.bfloat16, window=4096)
    plain = variant(32, 8, 128, 16, mx.bfloat16)
    attention = (cuda_attention.CudaPagedAttention() if kind == "mma" else
                 hopper_attention.HopperPagedAttention())
    first = (32768 - 4096 + 1) // cuda_attention.BLOCK_N * cuda_attention.BLOCK_N
    windowed = plan_of(attention, np.array([0, 1]), np.array([32768 + 1]), g).tiles.work_host
    short = plan_of(attention, np.array([0, 1]), np.array([32768 + 1 - first]),
                    plain).tiles.work_host
    keys = windowed[:, tile_plan.KV_END] - windowed[:, tile_plan.KV_START]
    assert len(windowed) == len(short) > 8  # split, as the short context is
    np.testing.assert_array_equal(np.sort(keys), np.sort(short[:, tile_plan.KV_END] -
                                                         short[:, tile_plan.KV_START]))
    assert windowed[:, tile_plan.KV_START].min() == first
    assert keys.sum() == 4096 * 8 + (32768 - 4096 + 1 - first) * 8  # 8 kv heads


# -- what each variant compiles and launches, anywhere ----------------------------------------

class MlxKernelStandIn:
    """MLX's `cuda_kernel` stood in for: what each built kernel was given, and each launch."""

    def __init__(self):
        self.built, self.launched = [], []

    def __call__(self, **kw):
        self.built.append(kw)

        def kernel(**call):
            self.launched.append(call)
            return zeros(call["output_shapes"], call["output_dtypes"])
        return kernel


def planned(attention, g: Geometry, q_lens, ctx_lens, sinks=None):
    """A plan of `g` over host lengths with a one-column table, launched once."""
    plan = plan_of(attention, np.concatenate([[0], np.cumsum(q_lens)]),
                   np.array(q_lens) + np.array(ctx_lens), g)
    q = mx.zeros((sum(q_lens), g.num_heads, g.head_dim), dtype=g.dtype)
    cache = mx.zeros((4, g.block_size, g.num_kv_heads, g.head_dim), dtype=g.dtype)
    attention.launch(q, cache, cache, plan, sinks)
    return plan


@pytest.mark.parametrize("features", FEATURE_SETS)
def test_mma_variant_compiles_its_features_and_launches_in_window(features):
    """The mma.sync kernel of a variant: its own source (feature flags on, its hash in the
    name), a sinks input (float32) exactly with sinks, the cap's constants in its template, the
    window's work list (W in every item, no item left of its tile's window)."""
    g = variant(8, 2, 64, 16, mx.bfloat16, window=100 if "window" in features else None,
                softcap=30.0 if "softcap" in features else None, sinks="sinks" in features)
    assert g.features == features
    mlx = MlxKernelStandIn()
    attention = cuda_attention.CudaPagedAttention(mlx)
    assert attention.unsupported_reason(g) is None
    sinks = sink_logits(8).astype(mx.bfloat16) if g.sinks else None
    plan = planned(attention, g, [1, 20], [3000, 500], sinks)
    (kw,), (call,) = mlx.built, mlx.launched
    text = cuda_attention.source(features)
    assert text.hash != cuda_attention.source("").hash and text.hash in kw["name"]
    assert features.replace("+", "_") in kw["name"]
    for name in ("window", "softcap", "sinks"):
        assert f"#define {name.upper()} {int(name in features)}\n" in kw["header"]
    assert ("sinks" in kw["input_names"]) == g.sinks == (len(call["inputs"]) == 8)
    if g.sinks:
        assert call["inputs"][-1].dtype == mx.float32
        np.testing.assert_array_equal(np.array(call["inputs"][-1]),
                                      np.array(sinks.astype(mx.float32)))
    template = dict(call["template"])
    assert ("CAP_IN_BITS" in template) == (g.softcap is not None)
    if g.softcap is not None:
        assert np.int32(template["CAP_OUT_BITS"]).view(np.float32) == np.float32(30.0 / g.scale)
        assert np.int32(template["CAP_IN_BITS"]).view(np.float32) == \
            np.float32(2 * cuda_attention.LOG2E * g.scale / 30.0)
    work = np.array(call["inputs"][4])
    assert work.shape[1] == len(tile_plan.work_columns(g.window is not None))
    np.testing.assert_array_equal(work, plan.tiles.work_host)
    if g.window is not None:  # in-window tiles only: at most W + the tile's tokens + a tile
        keys = work[:, tile_plan.KV_END] - work[:, tile_plan.KV_START]
        assert (work[:, tile_plan.KV_START] >= first_visible_tile(work, 100, 64)).all()
        assert (keys <= 100 + work[:, tile_plan.NTOK] + cuda_attention.BLOCK_N - 2).all()


@pytest.mark.parametrize("features", FEATURE_SETS)
def test_hopper_variants_compile_their_features(features):
    """The wgmma and prefill kernels of a variant: their own translation unit (flags on, the cap's
    constants compiled in, the kernel named for the features, the constants and the unit's
    hash), launched with the sinks (float32) after their other inputs exactly with sinks."""
    g = variant(32, 8, 128, 16, mx.bfloat16, window=100 if "window" in features else None,
                softcap=30.0 if "softcap" in features else None, sinks="sinks" in features)
    sinks = sink_logits(32) if g.sinks else None
    stand_ins, sources_seen = CubinStandIns(), []

    def compile(source, name, arch):
        sources_seen.append(source)
        return stand_ins.compile(source, name, arch)
    wgmma = hopper_attention.HopperPagedAttention(MlxKernelStandIn(), compile=compile,
                                                  precompiled_kernel=stand_ins.precompiled)
    prefill = prefill_attention.HopperPrefillAttention(compile, stand_ins.precompiled,
                                                       lambda *_: np.zeros(256, np.uint8))
    for kernel, unit in ((wgmma, hopper_attention.unit), (prefill, prefill_attention.unit)):
        assert kernel.unsupported_reason(g) is None
        plan = planned(kernel, g, [300, 1], [2000, 900], sinks)
        name, source, kw = stand_ins.compiled[-1][0], sources_seen[-1], stand_ins.launched[-1]
        assert unit(features).hash in name and unit(features).hash != unit("").hash
        assert features.replace("+", "_") in name and kw["name"] == name
        for flag in ("window", "softcap", "sinks"):
            assert f"#define {flag.upper()} {int(flag in features)}\n" in source
        assert ("CAP_IN_BITS = " in source) == (g.softcap is not None)
        assert (kw["inputs"][-1].dtype == mx.float32) == g.sinks
        np.testing.assert_array_equal(np.array(kw["inputs"][4]), plan.tiles.work_host)
        if g.window is not None:
            block_n = prefill_attention.KV_TILE if kernel is prefill else cuda_attention.BLOCK_N
            work = plan.tiles.work_host
            assert (work[:, tile_plan.KV_START] >= first_visible_tile(work, 100, block_n)).all()


def test_cuda_kernels_implement_every_variant_and_refuse_other_dtypes():
    """Every feature is built into the CUDA kernels; their other rules still hold."""
    g = variant(32, 8, 128, 16, mx.bfloat16, window=7, softcap=50.0, sinks=True)
    kernels = (cuda_attention.CudaPagedAttention(lambda **_: None),
               hopper_attention.HopperPagedAttention(lambda **_: None),
               prefill_attention.HopperPrefillAttention(lambda *_: b"", lambda **_: None))
    for kernel in kernels:
        assert kernel.unsupported_reason(g) is None
        odd = variant(32, 8, 128, 16, mx.float32, window=7, sinks=True)
        assert "dtype" in kernel.unsupported_reason(odd)


def test_sinks_are_given_exactly_with_a_sinks_geometry():
    """The entry check refuses sinks a plan's geometry lacks, and a sinks geometry without them."""
    attention = cuda_attention.CudaPagedAttention(lambda **_: None)
    c = PagedCase([3, 1], [20, 9], 8, 2, 64, 16, mx.bfloat16)
    args = (c.q, c.k_new, c.v_new, c.k_cache, c.v_cache)
    with_sinks = attention.plan(c.lengths, variant(8, 2, 64, 16, mx.bfloat16, sinks=True),
                                c.block_tables)
    plain = attention.plan(c.lengths, variant(8, 2, 64, 16, mx.bfloat16), c.block_tables)
    with pytest.raises(ValueError, match="sinks"):
        attention.check(*args, with_sinks)
    with pytest.raises(ValueError, match="sinks"):
        attention.check(*args, plain, sink_logits(8))
    with pytest.raises(ValueError, match="sinks"):
        attention.check(*args, with_sinks, sink_logits(4))


# -- the paged kernel on a CUDA GPU -----------------------------------------------------------

@pytest.mark.parametrize("backend", CUDA_BACKENDS)
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("window_of", [lambda bs: 1, lambda bs: 7, lambda bs: bs,
                                       lambda bs: bs + 1, lambda bs: 4096],
                         ids=["W1", "W7", "Wblock", "Wblock+1", "W4096"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_m", [64, 128])
def test_window(backend, block_size, window_of, head_dim, block_m):
    """Prefill and decode rows, split and not, over contexts shorter and far longer than W."""
    g = variant(16, 4, head_dim, block_size, mx.bfloat16, window=window_of(block_size))
    attention = get_backend(backend).attention
    plan = check(attention, g, [5, 1, 70, 1, 33, 129], [block_size - 1, 998, 300, 31, 2000, 0],
                 block_m=block_m, seed=block_size)
    work = plan.tiles.work_host
    assert (work[:, tile_plan.WINDOW] == g.window).all()
    if g.window < 900:  # the long contexts' tiles start inside them
        assert work[:, tile_plan.KV_START].max() > 0


@pytest.mark.parametrize("backend", CUDA_BACKENDS)
@pytest.mark.parametrize("window", [32, 64])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_m", [64, 128])
def test_window_edges_at_kv_tile_starts(backend, window, head_dim, block_m):
    """`window_edge_case` (the Metal kernel runs it too, emulated)."""
    q_lens, ctx = window_edge_case(window)
    check(get_backend(backend).attention, variant(4, 2, head_dim, 16, mx.float16, window=window),
          q_lens, ctx, block_m=block_m, seed=window)


@pytest.mark.parametrize("backend", CUDA_BACKENDS)
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_m", [64, 128])
def test_sinks(backend, dtype, head_dim, block_m):
    """Sinks of both signs, one far above every score, on decode rows (split KV at 64-row
    tiles: joined once, in the merge) and prefill rows."""
    g = variant(8, 2, head_dim, 16, dtype, sinks=True)
    sinks = sink_logits(8, seed=4)
    plan = check(get_backend(backend).attention, g, [1, 1, 40, 7], [3000, 64, 200, 0],
                 sinks=sinks, block_m=block_m, seed=4)
    assert plan.tiles.num_slots or block_m == 128
    c = PagedCase([1, 1, 40, 7], [3000, 64, 200, 0], 8, 2, head_dim, 16, dtype, seed=4)
    assert differs(c.oracle(g.scale), c.oracle(g.scale, sinks=sinks), dtype)  # they matter


@pytest.mark.parametrize("backend", CUDA_BACKENDS)
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("softcap", [5.0, 50.0])
def test_softcap_bends_large_scores(backend, dtype, softcap):
    """|scale q.k| up to ~150, capped at 5 or 50 (Gemma 2's): the cap decides the output."""
    g = variant(8, 2, 128, 16, dtype, softcap=softcap)
    c = PagedCase([9, 1, 30], [40, 1500, 0], 8, 2, 128, 16, dtype, seed=2, q_scale=40.0)
    out, _ = c.attend(get_backend(backend).attention, g)
    want = c.oracle(g.scale, softcap=softcap)
    assert_close(out, want, dtype, f"cap {softcap}", c.q_scale)
    assert differs(c.oracle(g.scale), want, dtype)  # uncapped is another answer


@pytest.mark.parametrize("backend", CUDA_BACKENDS)
@pytest.mark.parametrize("window,softcap,sinks", [
    (128, None, True),     # GPT-OSS
    (100, 50.0, False),    # Gemma 2 (its local layers' 4096 at a test's size)
    (33, 20.0, True),
], ids=["window+sinks", "window+softcap", "window+softcap+sinks"])
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16], ids=["fp16", "bf16"])
def test_combined_variants(backend, window, softcap, sinks, dtype):
    g = variant(32, 8, 128, 16, dtype, window=window, softcap=softcap, sinks=sinks)
    check(get_backend(backend).attention, g, [1, 64, 1, 17, 300], [4000, 700, 90, 16, 0],
          sinks=sink_logits(32, seed=1) if sinks else None, seed=1, q_scale=4.0)


@pytest.mark.parametrize("backend", CUDA_BACKENDS)
@pytest.mark.parametrize("window", [None, 2000])
def test_split_rows_whose_late_parts_dominate_with_sinks(backend, window):
    """Keys split many ways (a window's in-window range only), late parts' scores far above the
    first's: the merge rescales every part by the largest and joins the sink once."""
    g = variant(4, 2, 64, 16, mx.float16, window=window, sinks=True)
    plan = check(get_backend(backend).attention, g, [1, 2], [2500, 900], sinks=sink_logits(4, 3),
                 q_scale=5.0, k_ramp=9.0)
    assert plan.tiles.num_slots and int(plan.tiles.work_host[:, tile_plan.NUM_SPLITS].max()) >= 4


@pytest.mark.parametrize("backend", CUDA_BACKENDS)
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_every_variant_builds(backend, dtype, head_dim, group, block_size):
    """Every compiled variant with all three features: a window a block and one key long."""
    g = variant(2 * group, 2, head_dim, block_size, dtype, window=block_size + 1, softcap=30.0,
                sinks=True)
    check(get_backend(backend).attention, g, [5, 1, 70, 1], [block_size - 1, block_size, 301, 300],
          sinks=sink_logits(2 * group, group), seed=group + block_size, q_scale=3.0)


@pytest.mark.parametrize("backend", CUDA_BACKENDS)
@pytest.mark.parametrize("features", FEATURE_SETS)
def test_first_use_check_runs_each_variant(backend, features):
    """The canary builds and checks a variant's kernels at every tile height, its keys named
    for the features."""
    from paged_prefix import canary

    g = variant(32, 8, 128, 16, mx.bfloat16, window=512 if "window" in features else None,
                softcap=50.0 if "softcap" in features else None, sinks="sinks" in features)
    attention = get_backend(backend).attention
    attention._kernels.clear()
    assert canary.check(attention, g) is None
    assert attention._kernels and all(features in key for key in attention._kernels)


# -- the prefill kernel on a Hopper GPU -------------------------------------------------------

@hopper
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("window_of", [lambda bs: 1, lambda bs: 7, lambda bs: bs,
                                       lambda bs: bs + 1, lambda bs: 4096],
                         ids=["W1", "W7", "Wblock", "Wblock+1", "W4096"])
def test_prefill_window(block_size, window_of):
    """128-row tiles over windows that start mid-page, mid-tile and before the sequence."""
    g = variant(16, 4, 128, block_size, mx.bfloat16, window=window_of(block_size))
    kernel = available_backends()["cuda"].prefill
    plan = check(kernel, g, [300, 77, 5, 600], [16, 2000, 3333, 2400], seed=block_size)
    assert (plan.tiles.work_host[:, tile_plan.WINDOW] == g.window).all()


@hopper
@pytest.mark.parametrize("features", FEATURE_SETS)
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16], ids=["fp16", "bf16"])
def test_prefill_variants(features, dtype):
    g = variant(32, 8, 128, 16, dtype, window=300 if "window" in features else None,
                softcap=20.0 if "softcap" in features else None, sinks="sinks" in features)
    check(available_backends()["cuda"].prefill, g, [256, 1, 600], [2048, 50, 2400],
          sinks=sink_logits(32, 5) if g.sinks else None, seqs=[0, 2], seed=5, q_scale=4.0)


@hopper
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_prefill_every_variant_builds(dtype, group, block_size):
    g = variant(2 * group, 2, 128, block_size, dtype, window=block_size * 9 + 1, softcap=30.0,
                sinks=True)
    check(available_backends()["cuda"].prefill, g, [129, 40], [1000, 3], seed=group,
          sinks=sink_logits(2 * group, group), q_scale=3.0)

