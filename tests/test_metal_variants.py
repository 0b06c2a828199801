"""The Metal kernels' attention variants (sliding window, logit softcap, sinks), emulated on the
CPU (tests/metal_emu) against the float64 oracle (`oracle64(..., window=, softcap=, sinks=)`).

Blocks wholly left of a sequence's window hold NaN and, where a block is whole memory pages, a
read of them crashes the launch: the kernels skip those pages, they do not mask them. Planted
bugs (source mutations of the real kernel texts, in this harness only) must each fail a named
case that passes unmutated.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from jit_kernels import metal_backend
from jit_kernels import metal_paged_attention as metal_attention
from jit_kernels import plan as tile_plan
from jit_kernels.geometry import BLOCK_SIZES, Geometry
from paged_prefix import dispatch
from paged_prefix.attention_metadata import build_attention_metadata
from tests.conftest import PagedCase, assert_close, window_edge_case
from tests.metal_emu import KernelError, metal_kernel
from tests.test_metal_emulated import DTYPES, FEATURE_SETS, check, mutated

pytestmark = pytest.mark.emulated


def sinks_of(num_heads: int, seed: int = 0) -> np.ndarray:
    """Sinks from -4 to 8 in a shuffled order: some negligible, some outweighing the hundreds
    of keys they join (e^8 ~ 3,000 unit-scale keys)."""
    return np.random.default_rng(seed).permutation(np.linspace(-4.0, 8.0, num_heads))


# --- sliding windows ---------------------------------------------------------------------

# W = 1 (each row sees itself), 7, a block, a block + 1, one past every context.
def windows(bs: int) -> list[int]:
    return [1, 7, bs, bs + 1, 4096]


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("w", range(5), ids=["w1", "w7", "wbs", "wbs+1", "w4096"])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_window_matches_oracle(dtype, block_size, w, group):
    """Prefill rows, decode rows and a chunk over several kv tiles; kv heads chosen so that a
    block is one memory page (4096 bytes at D=64): every block left of a window is guarded."""
    window, kv_heads = windows(block_size)[w], 32 // block_size
    ctx = [3 * block_size + 2, 4 * block_size, 150, 300]
    got = check([5, 1, 40, 1], ctx, group * kv_heads, kv_heads, 64, block_size, DTYPES[dtype],
                seed=w + block_size, window=window)
    assert (got.guarded > 0) == (window < 4096), "the guard must engage"


@pytest.mark.parametrize("head_dim, block_size, kv_heads", [(96, 32, 2), (128, 16, 2),
                                                            (256, 32, 1)])
def test_window_head_dims(head_dim, block_size, kv_heads):
    """Other tile widths (BN = 16 at D=256: a block spans two kv tiles), blocks guarded."""
    got = check([9, 1, 1], [100, 77, 200], 3 * kv_heads, kv_heads, head_dim, block_size,
                mx.float16, seed=head_dim, window=block_size + 9)
    assert got.guarded > 0


@pytest.mark.parametrize("window", [32, 64])
@pytest.mark.parametrize("head_dim", [64, 256])
def test_window_edges_at_kv_tile_starts(window, head_dim):
    """`window_edge_case` (the CUDA kernels run it too)."""
    q_lens, ctx = window_edge_case(window)
    check(q_lens, ctx, 4, 2, head_dim, 16, mx.float16, seed=window, window=window)


def test_window_splits_only_its_range():
    """A decode row with W = 700 over 2,000 keys, late keys' scores far above early ones': the
    plan splits the in-window tiles only, as many parts as a 700-key context gets, and no item
    reaches left of the window's first kv tile."""
    bn, window, ctx = metal_attention.BLOCK_N[64], 700, 2000
    got = check([1], [ctx], 8, 2, 64, 16, mx.float16, window=window, k_ramp=4.0, q_scale=2.0)
    work = got.tiles.work_host
    first = (ctx - window + 1) // bn * bn
    assert got.guarded > 0 and work[:, tile_plan.KV_START].min() == first
    in_window = -(-(ctx + 1) // bn) - first // bn
    plain = tile_plan.build_tile_plan(np.array([0, 1]), np.array([in_window * bn]), 4, 2,
                                      metal_attention.BLOCK_Q, bn, metal_attention.GPU_CORES)
    splits = int(work[:, tile_plan.NUM_SPLITS].max())
    assert splits > 1 and splits == int(plain.work_host[:, tile_plan.NUM_SPLITS].max())


# --- softcap and sinks, alone and together ---------------------------------------------------

VARIANT_CASES = {
    # a window cutting every prefix: prefill rows over an edge tile below the diagonal, decode
    # rows; the first kv tile of the 190-key sequence holds a whole block left of its window
    "window_prefill": dict(q_lens=[40, 1, 5], ctx_lens=[150, 190, 64 + 6], num_heads=4,
                           num_kv_heads=2, head_dim=64, block_size=16, dtype=mx.float16,
                           window=33),
    # window 7, key_start a multiple of the block inside a kv tile: the key before it is in a
    # guarded block of the tile the plan starts at
    "window_block_edge": dict(q_lens=[1, 3], ctx_lens=[80 + 6, 112 + 6], num_heads=4,
                              num_kv_heads=2, head_dim=64, block_size=16, dtype=mx.float16,
                              window=7),
    # logits scale * q.k / cap near 1: where tanh bends
    "softcap_bends": dict(q_lens=[20, 1], ctx_lens=[60, 130], num_heads=6, num_kv_heads=2,
                          head_dim=64, block_size=8, dtype=mx.float16, softcap=5.0,
                          q_scale=4.0),
    # logits hundreds of times the cap (q.k ~ 200 q_scale units): split rows, a capped max
    "softcap_saturates": dict(q_lens=[1, 1, 3], ctx_lens=[300, 90, 40], num_heads=4,
                              num_kv_heads=1, head_dim=64, block_size=16, dtype=mx.float16,
                              softcap=1.5, q_scale=200.0),
    # sinks on unsplit tiles: a long prefill chunk, group 3
    "sinks_unsplit": dict(q_lens=[130], ctx_lens=[70], num_heads=6, num_kv_heads=2,
                          head_dim=96, block_size=32, dtype=mx.float16, sinks=sinks_of(6)),
    # sinks on split decode rows, late splits dominating: the merge adds each row's sink once
    "sinks_split": dict(q_lens=[1, 1, 2], ctx_lens=[600, 250, 511], num_heads=8,
                        num_kv_heads=2, head_dim=128, block_size=16, dtype=mx.float16,
                        sinks=sinks_of(8, 1), k_ramp=1.0),
    # GPT-OSS: window + sinks, group 8, decode and prefill rows over splits
    "window_sinks": dict(q_lens=[1, 17, 1], ctx_lens=[400, 150, 20], num_heads=16,
                         num_kv_heads=2, head_dim=64, block_size=16, dtype=mx.bfloat16,
                         window=128, sinks=sinks_of(16, 2)),
    # Gemma 2: window + softcap at D=256 (16-key tiles under 32-key blocks)
    "window_softcap": dict(q_lens=[9, 1], ctx_lens=[120, 300], num_heads=4, num_kv_heads=2,
                           head_dim=256, block_size=32, dtype=mx.bfloat16, window=50,
                           softcap=8.0, q_scale=3.0),
    "all_three": dict(q_lens=[1, 6, 1], ctx_lens=[333, 44, 0], num_heads=6, num_kv_heads=3,
                      head_dim=128, block_size=8, dtype=mx.float16, window=100, softcap=4.0,
                      sinks=sinks_of(6, 3), q_scale=3.0),
}


# the cases whose plans split keys (the merge runs), and the one that must not
SPLIT = {"softcap_saturates", "sinks_split", "window_sinks", "all_three"}


@pytest.mark.parametrize("name", VARIANT_CASES)
def test_variant_case_matches_oracle(name):
    got = check(**VARIANT_CASES[name])
    if name in SPLIT or name == "sinks_unsplit":
        assert (got.tiles.merge is not None) == (name in SPLIT)


# --- planted bugs: each mutation of the real sources fails its case --------------------------

SOFTCAP_BLOCK = """\
    PP_UNROLL for (int tk = 0; tk < TK; ++tk) {
      s_acc[tk].thread_elements()[0] = softcap[0] * tanh(s_acc[tk].thread_elements()[0]);
      s_acc[tk].thread_elements()[1] = softcap[0] * tanh(s_acc[tk].thread_elements()[1]);
    }
"""
ROW_MAX = "m_new = max(m_new, simd_shuffle_xor(m_new, ushort(8)));\n"
LOGITS = [f"s_acc[tk].thread_elements()[{e}]" for e in (0, 1)]  # a lane's two of a fragment
# the cap taken after the max (masked logits kept at -inf, so only the max is wrong)
CAP_AFTER_MAX = ROW_MAX + SOFTCAP_BLOCK
for x in LOGITS:
    CAP_AFTER_MAX = CAP_AFTER_MAX.replace(f"= softcap[0] * tanh({x});",
                                          f"= {x} == NEG_INF ? NEG_INF : softcap[0] * tanh({x});")
# bug: (edits (old -> new), the case that catches it)
PLANTED_BUGS = {
    "window_off_by_one": ([("row_lo = row_pos - win + 1;", "row_lo = row_pos - win;")],
                          "window_prefill"),
    "window_first_key_off_by_one": ([("max(pos0 - win + 1, 0)", "max(pos0 - win, 0)")],
                                    "window_block_edge"),
    "one_tile_too_many_skipped": ([("kv_lo / BN * BN", "(kv_lo / BN + 1) * BN")], "window_prefill"),
    "window_edge_tile_unmasked": ([(" || n0 < edge_to)", ")")], "window_prefill"),
    "loader_reads_left_of_the_window": ([(" && n0 + j >= kv_lo)", ")")], "window_prefill"),
    "cap_after_the_max": ([(SOFTCAP_BLOCK, ""), (ROW_MAX, CAP_AFTER_MAX)], "softcap_saturates"),
    "cap_on_log2_logits": ([(f"tanh({x})", f"tanh({x} * M_LOG2E_F)") for x in LOGITS],
                           "softcap_bends"),
    "sink_dropped_in_the_merge": ([("    sum = exp2(sink - base);\n", "")], "sinks_split"),
    "sink_added_per_split": ([("if (slot < 0) {  // the sink", "if (true) {  // the sink")],
                             "sinks_split"),
    "sink_in_natural_units": ([("% GROUP] * M_LOG2E_F", "% GROUP]")], "sinks_unsplit"),
}


@pytest.mark.parametrize("bug", PLANTED_BUGS)
def test_planted_variant_bug_is_caught(bug):
    edits, case = PLANTED_BUGS[bug]
    kernels = [*map(metal_attention.attention_source, FEATURE_SETS),
               metal_attention.merge_source(True)]
    texts = [text for kernel in kernels for text in (kernel.header, kernel.source)]
    for old, _ in edits:
        assert any(old in text for text in texts), f"{bug}: the kernels changed, update it"
    with pytest.raises((AssertionError, KernelError)):
        check(**VARIANT_CASES[case], kernel_factory=mutated(*edits))


# --- through the dispatcher: the first-use check, then the kernel ------------------------------

GPT_OSS = Geometry(8, 2, 64, 16, mx.float16, 0.125, window=48, sinks=True)


def forward(d: dispatch.Dispatcher, g: Geometry):
    case = PagedCase([9, 1], [40, 170], 8, 2, 64, 16, mx.float16, seed=4, window=g.window)
    meta = build_attention_metadata([9, 1], [40, 170], case.pages, 16, case.num_blocks)
    sinks = mx.array(sinks_of(8).astype(np.float32))
    attention = d.plan(meta, g)
    attention.check(case.q, case.k_new, case.v_new, case.k_cache, case.v_cache, sinks)
    out = attention(case.q, case.k_new, case.v_new, case.k_cache, case.v_cache, sinks)
    assert_close(out, case.oracle(g.scale, g.window, g.softcap, sinks), mx.float16)
    return attention


def test_dispatcher_runs_the_windowed_metal_kernel():
    """A window + sinks variant passes its first-use check and `auto` engages the kernel."""
    d = dispatch.Dispatcher("auto", backends={"metal": metal_backend(metal_kernel)}, strict=True)
    attention = forward(d, GPT_OSS)
    assert attention.route.path == "metal" and d.counts == {"metal": 1}


def test_canary_catches_a_dropped_sink():
    """The merge planted to drop the sink: the first-use check's split rows catch it and the
    variant falls back to the reference."""
    edits, _ = PLANTED_BUGS["sink_dropped_in_the_merge"]
    d = dispatch.Dispatcher("auto", backends={"metal": metal_backend(mutated(*edits))},
                            strict=False)
    attention = forward(d, GPT_OSS)
    assert attention.route.path == "reference" and "first-use check" in attention.route.reason
