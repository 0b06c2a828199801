"""The Metal backend's kernels, as MLX would compile them, run on the CPU (tests/metal_emu).

Every kernel variant the backend can generate compiles with warnings as errors; the real
wrapper (`MetalPagedAttention`, `PageGather`) runs the emulated kernels against the float64
oracle per element (|out - oracle| <= atol + rtol |oracle|, conftest's pair per dtype) on
NaN-poisoned caches: unowned pages and every block-table entry past a sequence's pages hold
NaN. Planted bugs (source mutations of the real kernel strings) must each fail a named case.
"""

from __future__ import annotations

import itertools
import mmap
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
import pytest

import reference
from jit_kernels import metal_backend
from jit_kernels import metal_paged_attention as metal_attention
from jit_kernels import plan as tile_plan
from jit_kernels.geometry import BLOCK_SIZES, FEATURES, MAX_GROUP, Geometry
from jit_kernels.page_gather import plan_gather
from tests.conftest import TOLERANCES, PagedCase, assert_close
from tests.metal_emu import KernelError, build, metal_kernel
from tests.metal_emu.source import mlx_printed_source

pytestmark = pytest.mark.emulated

DTYPES = {"fp16": mx.float16, "bf16": mx.bfloat16}
# every variant's features but the plain one's, as `Geometry.features` spells them
FEATURE_SETS = ["+".join(name for name, on in zip(FEATURES, mask) if on)
                for mask in itertools.product((False, True), repeat=len(FEATURES))][1:]


def run_attention(case: PagedCase, g: Geometry, kernel_factory=metal_kernel, sinks=None):
    """The Metal backend's paged attention with its kernels built by `kernel_factory` (the
    emulation, or a compile-only or mutated stand-in): the one place that knows its API."""
    out, plan = case.attend(metal_backend(kernel_factory).attention, g, sinks=sinks)
    return out, plan.tiles


def run_gather(case: PagedCase, g: Geometry, kernel_factory=metal_kernel):
    """The Metal backend's page gather of every sequence: [(k, v)], each [Hkv, L, D], from the
    page of its first visible key on (`g.window`)."""
    seqs = list(range(len(case.seq_lens)))
    plan = plan_gather(case.seq_lens, seqs, g.block_size, g.num_kv_heads, g.head_dim,
                       g.dtype, case.lengths.key_starts(g.window))
    gathered = metal_backend(kernel_factory).gathered.gather.launch(
        case.k_cache, case.v_cache, case.block_tables, plan)
    return [tuple(x.reshape(-1, *x.shape[-2:]) for x in pair) for pair in gathered]


# --- every variant: MLX's exact source, compiled with warnings as errors ----------------------

class RecordedLaunches:
    """A `metal_kernel` stand-in whose launches are recorded, not run (zeros come back):
    driving the real wrapper with it yields exactly the kernels and launches of a real run."""

    def __init__(self):
        self.launches: dict[str, tuple] = {}  # kernel name -> (kernel, factory kw, launch kw)

    def __call__(self, **factory_kw):
        kernel = metal_kernel(**factory_kw)

        def launch(**call_kw):
            name = kernel.assemble(call_kw["inputs"], call_kw["output_dtypes"],
                                   call_kw.get("template")).kernel_name
            self.launches[name] = (kernel, factory_kw, call_kw)
            return [mx.zeros(s, d) for s, d in zip(call_kw["output_shapes"],
                                                    call_kw["output_dtypes"])]

        return launch


@pytest.fixture(scope="module")
def every_variant() -> RecordedLaunches:
    """dtype x head dim x GQA group x block size, each with its merge (a split plan) and page
    gather; plus a block table and a merge list under 8 ints (passed as `constant`); every
    variant's features (window, softcap, sinks and their combinations) x dtype x head dim at
    three (group, block size) pairs, each split (the sinks' merge)."""
    recorder = RecordedLaunches()
    for dtype, head_dim, group, bs in itertools.product(
            DTYPES.values(), metal_attention.HEAD_DIMS, range(1, MAX_GROUP + 1), BLOCK_SIZES):
        g = Geometry(2 * group, 2, head_dim, bs, dtype, head_dim ** -0.5)
        case = PagedCase([1], [300], 2 * group, 2, head_dim, bs, dtype)
        run_attention(case, g, recorder)
        run_gather(case, g, recorder)
    for features, dtype, head_dim, (group, bs) in itertools.product(
            FEATURE_SETS, DTYPES.values(), metal_attention.HEAD_DIMS,
            ((1, 8), (3, 16), (8, 32))):
        on = features.split("+")
        g = Geometry(2 * group, 2, head_dim, bs, dtype, head_dim ** -0.5,
                     window=100 if "window" in on else None,
                     softcap=5.0 if "softcap" in on else None, sinks="sinks" in on)
        case = PagedCase([1], [300], 2 * group, 2, head_dim, bs, dtype, window=g.window)
        run_attention(case, g, recorder, mx.zeros((2 * group,)) if g.sinks else None)
    small = PagedCase([1], [100], 2, 1, 64, 32, mx.float16)  # a 1 x 6 table, one merged tile
    run_attention(small, Geometry(2, 1, 64, 32, mx.float16, 0.125), recorder)
    gather_f32 = PagedCase([3], [20], 2, 1, 64, 16, mx.float32)
    run_gather(gather_f32, Geometry(2, 1, 64, 16, mx.float32, 0.125), recorder)
    names = recorder.launches
    variants = 2 * len(metal_attention.HEAD_DIMS) * MAX_GROUP * len(BLOCK_SIZES)
    kinds = {k: sum(k in n for n in names) for k in ("attention", "merge", "gather")}
    assert kinds["attention"] > variants and kinds["merge"] > variants, kinds
    assert kinds["gather"] > 2 * len(BLOCK_SIZES), kinds
    assert {k for k in kinds for n in names if k in n and "_int32_tc_" in n} >= {"attention", "merge"}
    for features in FEATURE_SETS:  # MLX puts "__" after the kernel's name
        assert any(f"_{features.replace('+', '_')}__" in n for n in names), features
    assert any("merge" in n and "_sinks__" in n for n in names)
    return recorder


def test_every_source_is_mlx_source(every_variant):
    for name, (kernel, factory_kw, call_kw) in every_variant.launches.items():
        ours = kernel.assemble(call_kw["inputs"], call_kw["output_dtypes"], call_kw.get("template"))
        assert ours.source == mlx_printed_source(factory_kw, call_kw), name


def test_every_variant_compiles_strictly(every_variant):
    units = {name: kernel.translation_unit(kw["inputs"], kw["output_dtypes"], kw.get("template"))
             for name, (kernel, _, kw) in every_variant.launches.items()}
    failures = build.strict_check(units)
    assert not failures, (f"{len(failures)} of {len(units)} kernels fail, e.g. "
                          f"{next(iter(failures.values()))}")


# --- the emulated kernels against the oracle -----------------------------------------------

# dtype -> [max |out - oracle|, max |out - oracle| / (atol + rtol |oracle|)] over the passing cases
WORST: dict[str, list[float]] = {}


@pytest.fixture(scope="module", autouse=True)
def report_worst_errors(request):
    yield
    plugins = request.config.pluginmanager
    with plugins.get_plugin("capturemanager").global_and_fixture_disabled():
        worst = ", ".join(f"{dtype} max |err| {abs_err:.2e} ({ratio:.2f} of its tolerance)"
                          for dtype, (abs_err, ratio) in WORST.items())
        if worst:
            plugins.get_plugin("terminalreporter").write_line(f"\nemulated Metal vs oracle: {worst}")


@dataclass(frozen=True)
class Checked:
    tiles: tile_plan.TilePlan
    guarded: int  # blocks left of the window that a read would have crashed on


def left_of_window(case: PagedCase, window: int | None) -> list[int]:
    """The blocks wholly left of their sequence's first visible key (PagedCase poisons them)."""
    ctx = case.seq_lens - np.diff(case.cu_seqlens_q)
    first = reference.key_start(ctx, window) // case.block_size
    return sorted(int(b) for s, n in enumerate(first) for b in case.tables[s, :n])


def unreadable(blocks: list[int], case: PagedCase, kernel_factory):
    """`kernel_factory` whose attention kernels may not read `blocks` of either cache: a read
    there crashes the launch (tests/metal_emu). Blocks must be whole memory pages."""
    page = case.k_cache[0].nbytes
    spans = [(b * page, (b + 1) * page) for b in blocks]

    def factory(**kw):
        kernel = kernel_factory(**kw)
        if "k_cache" in kw["input_names"]:
            kernel.unreadable = {"k_cache": spans, "v_cache": spans}
        return kernel

    return factory


def protectable(case: PagedCase) -> bool:
    """Whether a cache block is whole memory pages (so `unreadable` can guard it)."""
    return case.k_cache[0].nbytes % mmap.PAGESIZE == 0


def check(q_lens, ctx_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=0,
          q_scale=1.0, kernel_factory=metal_kernel, window=None, softcap=None, sinks=None,
          k_ramp=0.0):
    """Runs one case against the oracle; returns its tile plan and how many blocks left of the
    window were guarded. `sinks`: one float per head. With a window, the blocks left of it hold
    NaN and, where a block is whole memory pages, a read of them crashes the launch."""
    case = PagedCase(q_lens, ctx_lens, num_heads, num_kv_heads, head_dim, block_size, dtype,
                     seed=seed, q_scale=q_scale, window=window, k_ramp=k_ramp)
    poisoned = ~np.isfinite(np.array(case.k_cache[:, 0, 0, 0].astype(mx.float32)))
    pages = np.array([len(p) for p in case.pages])[:, None]
    padding = np.arange(case.tables.shape[1])[None, :] >= pages
    assert poisoned[case.tables[padding]].all(), "padded block-table entries must be poisoned"
    hidden = left_of_window(case, window)
    assert poisoned[hidden].all(), "blocks left of the window must be poisoned"
    guarded = hidden if protectable(case) else []
    if guarded:
        kernel_factory = unreadable(guarded, case, kernel_factory)
    g = Geometry(num_heads, num_kv_heads, head_dim, block_size, dtype, head_dim ** -0.5,
                 window=window, softcap=softcap, sinks=sinks is not None)
    sinks = None if sinks is None else mx.array(np.asarray(sinks, dtype=np.float32))
    out, tiles = run_attention(case, g, kernel_factory, sinks)
    want = case.oracle(g.scale, window, softcap, sinks)
    assert_close(out, want, dtype, f"q={q_lens} ctx={ctx_lens} D={head_dim} bs={block_size} "
                 f"{g.features}")
    atol, rtol = TOLERANCES[dtype]
    err = np.abs(np.array(out.astype(mx.float32)).astype(np.float64) - want)
    worst = WORST.setdefault(str(dtype).split(".")[-1], [0.0, 0.0])
    worst[:] = max(worst[0], err.max()), max(worst[1], (err / (atol + rtol * np.abs(want))).max())
    return Checked(tiles, len(guarded))


# A prefix ending mid-page, a decode row at a page boundary, a chunk over several KV tiles, and a
# long decode row that the plan splits when the variant has few query tiles.
VARIANT_CASE = ([5, 1, 40, 1], lambda bs: [bs - 1, bs, bs + 1, 150])


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("head_dim", metal_attention.HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_variant_matches_oracle(dtype, head_dim, group, block_size):
    q_lens, ctx = VARIANT_CASE
    check(q_lens, ctx(block_size), 2 * group, 2, head_dim, block_size, DTYPES[dtype],
          seed=group + block_size)


CASES = {
    # one query tile over 63 KV tiles: 32 splits, the most the Metal plan makes (it aims at
    # 2 x GPU_CORES items), merged by the merge kernel; sharp scores, so that every split
    # carries weight in the output
    "splits_32": dict(q_lens=[2], ctx_lens=[2000], num_heads=4, num_kv_heads=1, head_dim=64,
                      block_size=16, dtype=mx.float16, q_scale=4.0),
    # a decode batch: every row its own tile, split by KV, one row with no context at all
    "decode_rows": dict(q_lens=[1] * 6, ctx_lens=[0, 1, 17, 64, 250, 511], num_heads=8,
                        num_kv_heads=2, head_dim=128, block_size=16, dtype=mx.float16),
    # prefill and decode rows in one launch, group 3 (2 padding rows in every 32-row tile)
    "mixed_group3": dict(q_lens=[45, 1, 7, 1], ctx_lens=[20, 99, 300, 0], num_heads=6,
                         num_kv_heads=2, head_dim=96, block_size=8, dtype=mx.float16),
    # a long prefill: diagonal tiles, fully visible tiles, unsplit
    "prefill_chunk": dict(q_lens=[130], ctx_lens=[70], num_heads=4, num_kv_heads=4, head_dim=64,
                          block_size=32, dtype=mx.bfloat16),
    # split parts that disagree by far: late keys' scores ~10x the first part's (|scale q.k| up
    # to ~150), as test_kernels' split case for every split path
    "splits_late_parts_dominate": dict(q_lens=[1, 2], ctx_lens=[2500, 900], num_heads=4,
                                       num_kv_heads=2, head_dim=64, block_size=16,
                                       dtype=mx.float16, q_scale=5.0, k_ramp=9.0),
}


@pytest.mark.parametrize("name", CASES)
def test_case_matches_oracle(name):
    tiles = check(**CASES[name]).tiles
    if name == "splits_32":
        assert int(tiles.work_host[:, tile_plan.NUM_SPLITS].max()) == 32
    if name == "decode_rows":
        assert tiles.merge is not None


GATHER_WINDOW = 40


def check_gather(dtype: str, window=None, kernel_factory=metal_kernel) -> None:
    """The gathered pages equal the sequences' keys and values bit for bit, from the page of
    each one's first visible key on; the pages before it hold NaN (never read)."""
    case = PagedCase([5, 1, 40], [7, 300, 33], 8, 2, 128, 16, DTYPES[dtype], seed=3,
                     window=window)
    g = Geometry(8, 2, 128, 16, DTYPES[dtype], 0.1, window=window)
    got = run_gather(case, g, kernel_factory)
    firsts = case.lengths.key_starts(window) // 16 * 16
    assert window is None or firsts.any()
    for s, pair in enumerate(got):
        for out, want in zip(pair, (case.k_seqs[s], case.v_seqs[s])):
            np.testing.assert_array_equal(
                np.array(out.view(mx.uint16)),
                np.array(want[int(firsts[s]):].transpose(1, 0, 2).view(mx.uint16)))


@pytest.mark.parametrize("window", [None, GATHER_WINDOW], ids=["full", "window"])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_page_gather_is_a_copy(dtype, window):
    check_gather(dtype, window)


GATHER_BUGS = {
    "window_rows_at_their_page_in_the_sequence": ("(page - first) * BS", "page * BS"),
    "window_heads_strided_by_the_whole_sequence": ("h) * out_len", "h) * seq_len"),
}


@pytest.mark.parametrize("bug", GATHER_BUGS)
def test_planted_gather_bug_is_caught(bug):
    old, new = GATHER_BUGS[bug]
    from jit_kernels.page_gather import SOURCES

    assert old in SOURCES["metal"].source, f"{bug}: the kernel changed, update its mutation"
    check_gather("fp16", GATHER_WINDOW)  # the case passes unmutated
    with pytest.raises((AssertionError, KernelError)):
        check_gather("fp16", GATHER_WINDOW, mutated((old, new)))


# --- planted bugs: each source mutation fails a named case ---------------------------------

def mutated(*edits: tuple[str, str]):
    """A `metal_kernel` whose source and header have each edit's old text replaced by its new,
    in turn."""

    def factory(**kw):
        for key in ("source", "header"):
            for old, new in edits:
                kw[key] = kw.get(key, "").replace(old, new)
        return metal_kernel(**kw)

    return factory


LAST_TILE_BARRIER = "threadgroup_barrier(mem_flags::mem_threadgroup);  // last tile consumed"
TILE_BARRIER = "threadgroup_barrier(mem_flags::mem_threadgroup);  // tile visible"
# bug: (mutation old -> new, the case that catches it: a test id above)
PLANTED_BUGS = {
    "causal_frontier_off_by_one": (
        ("if (key > row_pos ||", "if (key > row_pos + 1 ||"), "prefill_chunk"),
    "last_partial_block_reads_previous_page": (
        ("long(table[key / BS])", "long(table[min(key / BS, kv_end / BS - 1)])"), "mixed_group3"),
    "missing_barrier_before_tile_load": ((LAST_TILE_BARRIER, "//"), "prefill_chunk"),
    "missing_barrier_after_tile_load": ((TILE_BARRIER, "//"), "prefill_chunk"),
    "fragment_layout_row_major": (
        ("const int fm = (lane & 16) / 4 + (lane & 6) / 2;", "const int fm = lane / 4;"),
        "prefill_chunk"),
    # the defect an independent check found untested: no case had late parts far above the
    # first, so a merge that rescales by the first part's max (overflowing where a later one is
    # larger) passed every case but the one made for it
    "merge_rescales_by_the_first_split": (
        ("for (int s = 0; s < nsplit; ++s) top = max(top, lse_part[long(first + s) * BLOCK_Q + row]);",
         "top = lse_part[long(first) * BLOCK_Q + row];"), "splits_late_parts_dominate"),
    "merge_drops_a_split": (
        ("for (int s = 0; s < nsplit; ++s) {\n      const long part",
         "for (int s = 1; s < nsplit; ++s) {\n      const long part"), "decode_rows"),
    "softmax_skips_rescale": (("o_acc[td].thread_elements()[0] *= alpha;", ""), "prefill_chunk"),
    "row_max_over_wrong_lanes": (("simd_shuffle_xor(m_new, ushort(8))",
                                  "simd_shuffle_xor(m_new, ushort(2))"), "mixed_group3"),
    "prefetch_overwrites_live_offsets": (("row_off[buf ^ 1][tid] =", "row_off[buf][tid] ="),
                                         "prefill_chunk"),
    "diagonal_tile_left_unmasked": (("if (n0 + BN > mask_from)", "if (n0 + BN > mask_from + BN)"),
                                    "prefill_chunk"),
}


@pytest.mark.parametrize("bug", PLANTED_BUGS)
def test_planted_bug_is_caught(bug):
    (old, new), case = PLANTED_BUGS[bug]
    sources = [text for kernel in (metal_attention.ATTENTION, metal_attention.MERGE)
               for text in (kernel.header, kernel.source)]
    assert any(old in src for src in sources), f"{bug}: the kernels changed, update its mutation"
    with pytest.raises((AssertionError, KernelError)):
        check(**CASES[case], kernel_factory=mutated((old, new)))


# --- the first-use check catches a broken kernel before it serves a forward -------------------

@pytest.mark.parametrize("bug, strict", [("causal_frontier_off_by_one", False),
                                         ("missing_barrier_after_tile_load", False),
                                         ("causal_frontier_off_by_one", True)])
def test_canary_catches_a_broken_metal_kernel(bug, strict, monkeypatch, caplog):
    """A planted bug in the real Metal source, run through the dispatcher: the canary compares
    the variant with the reference on first use, logs one warning naming the variant and falls
    back to the reference (or raises when strict), before any forward uses the kernel."""
    from paged_prefix import dispatch
    from paged_prefix.attention_metadata import build_attention_metadata

    backend = metal_backend(mutated(PLANTED_BUGS[bug][0]))
    d = dispatch.Dispatcher("auto", backends={"metal": backend}, strict=strict)
    case = PagedCase([9, 1], [40, 70], 8, 2, 64, 16, mx.float16, seed=4)
    meta = build_attention_metadata([9, 1], [40, 70], case.pages, 16, case.num_blocks)
    g = Geometry(8, 2, 64, 16, mx.float16, 0.125)
    if strict:
        with pytest.raises(RuntimeError, match="first-use check"):
            d.plan(meta, g)
        return
    with caplog.at_level("WARNING", logger="paged_prefix.dispatch"):
        attention = d.plan(meta, g)
    assert attention.route.path == "reference" and "first-use check" in attention.route.reason
    assert any("metal paged kernel for dtype=float16 head_dim=64 group=4 block=16" in
               r.getMessage() for r in caplog.records)
    attention.check(case.q, case.k_new, case.v_new, case.k_cache, case.v_cache)
    out = attention(case.q, case.k_new, case.v_new, case.k_cache, case.v_cache)
    assert_close(out, case.oracle(0.125), mx.float16)
    assert d.counts == {"reference": 1}


def test_dispatcher_runs_the_checked_metal_kernel(monkeypatch):
    """Unbroken, the same variant passes its first-use check and `auto` engages the kernel."""
    from paged_prefix import dispatch
    from paged_prefix.attention_metadata import build_attention_metadata

    d = dispatch.Dispatcher("auto", backends={"metal": metal_backend(metal_kernel)}, strict=True)
    case = PagedCase([9, 1], [40, 70], 8, 2, 64, 16, mx.float16, seed=4)
    meta = build_attention_metadata([9, 1], [40, 70], case.pages, 16, case.num_blocks)
    attention = d.plan(meta, Geometry(8, 2, 64, 16, mx.float16, 0.125))
    attention.check(case.q, case.k_new, case.v_new, case.k_cache, case.v_cache)
    out = attention(case.q, case.k_new, case.v_new, case.k_cache, case.v_cache)
    assert attention.route.path == "metal" and d.counts == {"metal": 1}
    assert_close(out, case.oracle(0.125), mx.float16)
