"""CUDA paged-prefill attention through `mx.fast.cuda_kernel` (tensor-core mma.sync, sm_80+).

Contract: `reference.contract`. One launch serves prefill and decode rows of every sequence;
K/V are read from the paged cache through the block table (no gather copy). The work list is
planned once per forward from host arrays (`plan.py`); every layer's launch only reads it.

FlashAttention-2-style: Q fragments in registers, K/V tiles through cp.async into padded smem,
ldmatrix + mma.sync m16n8k16 (fp32 accumulate), online softmax in base 2; the rows of a tile
are (token, head-in-group) pairs so one K/V tile serves a whole GQA group; fully visible tiles
skip the mask, tiles past the causal frontier are never visited. When the tiles are too few
for the GPU the key range is split, and the last split of a tile to finish merges the tile's
partials by log-sum-exp inside the same launch (per-tile counters), its own from shared memory.

Variants (`reference.contract`), each compiled in or out: a sliding window (the plan starts a
tile's keys at the kv tile of its first visible key, so whole tiles left of the window are never
read and its splits follow W), a logit softcap (its constants compiled in, as the scale), sinks
(joined once per row, at its store or in the merge).
"""

from __future__ import annotations

import functools
import math
import numbers
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from . import plan as tile_plan
from . import sources
from .geometry import Geometry, Lengths, dtype_name
from .interface import PagedAttentionKernel, Plan, refuse_unsupported

BLOCK_N = 64  # keys per K/V tile; query tiles are 64 or 128 rows (choose_block_m)
STAGES = 2  # K/V smem stages (tiles in flight + 1); 3 measured no faster (decode 10% slower)
HEAD_DIMS = (64, 128)
NUM_SMS = 132  # H100/H200 SXM; MLX does not report the SM count
PAD = 8  # smem row padding (elements): 16 bytes shift each row by 4 banks for ldmatrix
LOG2E = math.log2(math.e)
MIN_WORDS = 4  # the counters kept longer than MLX's pool of <= 8-byte arrays (qk_scale_bits)
# Launches of one split plan that may run at once, each on its own set of arrival counters
# (independent calls of a plan evaluated together; a forward's layers are ordered by their data).
# Measured faster up to 16 sets at short suffixes, no faster past 4 at Lq=64
# (docs/h200/counter_sets.txt).
COUNTER_SETS = 16
MERGE_ROWS = 16  # rows a thread merges at once: every one's load of a split in flight together

FEATURES = ("window", "softcap", "sinks")  # the variants every CUDA attention kernel compiles


@functools.cache
def source(features: str) -> sources.MlxSource:
    """The kernel of a variant's features (`Geometry.features`): kernels/paged_attention_mma.cu
    behind the feature flags, the tile constants and the work-list columns."""
    return sources.mlx_kernel("paged_attention_mma.cu", sources.attention_prelude(
        sources.CUDA, features, BLOCK_N=BLOCK_N, MERGE_ROWS=MERGE_ROWS, PAD=PAD))

# Prefill-heavy forwards take 128-row tiles (each K/V tile feeds 128 rows: half the L2 traffic
# per FLOP of 64-row tiles) when they still give at least this many threadblocks; decode
# batches and short suffixes keep 64-row tiles (more, smaller blocks in flight per SM).
MIN_TILES_FOR_BLOCK_M_128 = 118  # ~0.9 x NUM_SMS: 128-row blocks run one per SM
# Rows per warp of 128-row tiles: 32 (four warps, each two m16 tiles against every K/V fragment
# it loads) or 16 (eight warps); 64-row tiles keep 16 (decode rows fill few of them). Measured
# at D=128 only (docs/kernels.md): other head dims keep 16.
WARP_M_128 = 32
WARP_M_128_HEAD_DIMS = (128,)
# Split KV into about SPLIT_ITEMS_PER_SM items per SM, a tile of n kv tiles into ceil(n / chunk)
# balanced parts, chunk = max(SPLIT_MIN_KV_TILES, the even share): parts of 4-8 tiles or more.
# A split's fp32 partial (32 KB at 64 rows, D=128) costs as much traffic as two K/V tiles
# read: chunks of 8 or more at one item per SM measured faster than 2-tile chunks at two per SM
# at all but the longest prefix (docs/results.md, "Split chunking").
SPLIT_MIN_KV_TILES = 8
SPLIT_ITEMS_PER_SM = 1


def scale_compiles(scale: float) -> bool:
    """Whether the kernel can compile this scale in: positive and finite (a negative constant,
    in MLX's name for the compiled kernel, is no C identifier)."""
    return isinstance(scale, numbers.Real) and math.isfinite(scale) and scale > 0


def scale_reason(scale: float) -> str | None:
    """Why a kernel that compiles the scale in cannot take this one, or None."""
    if scale_compiles(scale):
        return None
    return f"scale {scale!r} (the kernel compiles in a positive finite scale)"


def float_bits(x: float) -> int:
    """The float32 bits of x as an int: how a kernel's float constant is compiled in."""
    return int(np.array(x, dtype=np.float32).view(np.int32))


def qk_scale_bits(scale: float) -> int:
    """The float32 bits of scale * log2(e) as an int: the kernel's template constant. (MLX's
    CUDA allocator keeps arrays of at most 8 bytes in a read-mostly managed pool; each
    threadblock's read of a one-float scale array there took 2-15 us on the H200, where a
    whole launch over 32 decode rows with nothing cached now takes 4 us.)"""
    if not scale_compiles(scale):
        raise ValueError(f"scale: expected a positive finite float, got {scale!r}")
    return float_bits(scale * LOG2E)


def cap_constants(g: Geometry) -> dict[str, int]:
    """A softcap's compiled-in constants (kernels/softmax.cuh, `Logits`), as the scale's: the
    float32 bits of 2 log2(e) scale / cap and of cap / scale; none without a cap."""
    if g.softcap is None:
        return {}
    return {"CAP_IN_BITS": float_bits(2 * LOG2E * g.scale / g.softcap),
            "CAP_OUT_BITS": float_bits(g.softcap / g.scale)}


def sink_inputs(g: Geometry, sinks: mx.array | None) -> list[mx.array]:
    """The kernels' sinks input: float32 [H] where the geometry has sinks (the entry check has
    matched the two), else none."""
    if not g.sinks:
        return []
    return [sinks if sinks.dtype == mx.float32 else sinks.astype(mx.float32)]


def variant_name(g: Geometry) -> str:
    """A kernel name's part for the variant's features: "" or e.g. "_window_sinks"."""
    return "_" + g.features.replace("+", "_") if g.features else ""


def compiled_floats(g: Geometry) -> dict[str, int]:
    """The float constants a variant compiles in: the scale's, and a cap's."""
    return {"QK_SCALE_BITS": qk_scale_bits(g.scale), **cap_constants(g)}


def compiled_floats_name(g: Geometry) -> str:
    """A compiled kernel's name part for its float constants ("_q<bits>", a cap's "_c<bits>")."""
    return "".join(f"_{name[0].lower()}{bits:x}" for name, bits in compiled_floats(g).items())


def choose_block_m(num_tokens: int, group: int, num_kv_heads: int) -> int:
    # full 128-row tiles' worth of rows: decode rows (group rows a sequence) barely count
    tiles = num_tokens * group // 128 * num_kv_heads
    return 128 if tiles >= MIN_TILES_FOR_BLOCK_M_128 else 64


def splits_kv(block_m: int) -> bool:
    """Whether a plan of `block_m`-row tiles may split KV: 128-row plans are chosen only when
    they fill the GPU, so they never split."""
    return block_m != 128


class LaunchOrder:
    """Which arrival counters a plan's next launch takes, and which launch it must follow.

    A split plan holds COUNTER_SETS sets of counters, taken in turn. Each launch takes, as an
    (unread) input, an output of the last launch that took its set, so MLX runs those two in
    order; launches on other sets stay independent and may run at once (MLX orders the
    launches of one evaluation only by the buffers they share). Without the order, two calls
    of one plan that depend on nothing else (independent calls evaluated together) could run
    at once and count each other's splits. The layers of a forward are ordered by their data
    already. (Fresh zeroed counters per launch would need no order, but cost 13-56 us a call
    on the H200, GPU alone, where the launch at C=1024, Lq=16 takes 18 us.)"""

    def __init__(self, counters: tuple[mx.array, ...]):
        self.counters = counters  # sets of int32 [max(2 num_tiles, MIN_WORDS)], zero between launches
        self.after = list(counters)  # per set: what its next launch follows
        self.turn = 0

    def take(self) -> tuple[mx.array, mx.array]:
        """(the next launch's counters, what it follows); `ran` records the launch."""
        return self.counters[self.turn], self.after[self.turn]

    def ran(self, output: mx.array) -> None:
        self.after[self.turn] = output
        self.turn = (self.turn + 1) % len(self.counters)


@dataclass(frozen=True)
class CudaAttentionPlan(Plan):
    """One forward's launch plan: built once from host arrays, read by every layer (`order`
    alone changes: it holds the arrival counters and the last launches' outputs)."""

    block_m: int
    warp_m: int
    tiles: tile_plan.TilePlan
    order: LaunchOrder
    launch: dict  # the kernel call's arguments other than its inputs


class CudaPagedAttention(PagedAttentionKernel):
    """The CUDA paged kernel; kernels are built once per variant through `cuda_kernel` (MLX's
    factory; tests pass a stand-in to break a kernel on purpose)."""

    name = "cuda paged kernel"
    head_dims = HEAD_DIMS
    features = FEATURES

    def __init__(self, cuda_kernel=None):
        super().__init__(cuda_kernel or mx.fast.cuda_kernel)

    def tile_rows(self, geometry: Geometry) -> tuple[int, ...]:
        return (64, 128)

    def split_min_kv_tiles_for(self, geometry: Geometry) -> int:
        """The fewest kv tiles a split part of this geometry's kernel takes."""
        return SPLIT_MIN_KV_TILES

    def canary_plannings(self, geometry: Geometry) -> tuple[dict, ...]:
        # The canary's contexts are a few kv tiles, under any split rule's minimum: one more
        # planning splits every 64-row tile into single kv tiles, so the merge runs too.
        plannings = super().canary_plannings(geometry)
        return plannings + tuple({**p, "split_kv_tiles": 1} for p in plannings
                                 if splits_kv(p["block_m"]))

    def unsupported_reason(self, geometry: Geometry) -> str | None:
        return scale_reason(geometry.scale) or super().unsupported_reason(geometry)

    def plan(self, lengths: Lengths, geometry: Geometry, block_tables: mx.array, seqs=None,
             block_m: int | None = None, split_kv_tiles: int | None = None) -> CudaAttentionPlan:
        """`block_m`: one of `tile_rows`; None chooses by the batch's size. `split_kv_tiles`:
        the fewest kv tiles of a split part; None takes the kernel's rule."""
        refuse_unsupported(self, geometry)
        seqs = lengths.seqs(seqs)
        g = geometry
        block_m = self._block_m(block_m, g) or choose_block_m(lengths.tokens_of(seqs), g.group,
                                                               g.num_kv_heads)
        split_kv_tiles = self._split_kv_tiles(split_kv_tiles) or self.split_min_kv_tiles_for(g)
        tiles = tile_plan.build_tile_plan(lengths.cu_seqlens_q, lengths.seq_lens, g.group,
                                          g.num_kv_heads, block_m, BLOCK_N, NUM_SMS,
                                          ctas_per_sm=SPLIT_ITEMS_PER_SM,
                                          min_chunk=split_kv_tiles,
                                          min_items=None if splits_kv(block_m) else 0,
                                          seqs=np.asarray(seqs), window=g.window)
        sets = COUNTER_SETS if tiles.num_slots else 1  # unsplit: counters never read
        counters = tuple(mx.zeros((max(2 * tiles.num_tiles, MIN_WORDS),), dtype=mx.int32)
                         for _ in range(sets))
        warp_m = WARP_M_128 if block_m == 128 and g.head_dim in WARP_M_128_HEAD_DIMS else 16
        threads = 32 * block_m // warp_m
        slots = max(tiles.num_slots, 1)  # outputs cannot be empty; unused when nothing is split
        launch = dict(
            template=[("T", g.dtype), ("HEAD_DIM", g.head_dim), ("GROUP", g.group),
                      ("BLOCK_M", block_m), ("WARP_M", warp_m), ("STAGES", STAGES),
                      ("BS", g.block_size), *compiled_floats(g).items()],
            grid=(tiles.num_items * threads, 1, 1),
            threadgroup=(threads, 1, 1),
            output_shapes=[(lengths.num_tokens, g.num_heads, g.head_dim),
                           (slots, block_m, g.head_dim), (slots, block_m)],
            output_dtypes=[g.dtype, mx.float32, mx.float32])
        return CudaAttentionPlan(g, lengths, block_tables, seqs, block_m=block_m, warp_m=warp_m,
                                 tiles=tiles, order=LaunchOrder(counters), launch=launch)

    def _kernel(self, g: Geometry, block_m: int, warp_m: int):
        key = (g.dtype, g.head_dim, g.group, g.block_size, block_m, warp_m, g.features)
        if key not in self._kernels:
            variant = (f"{dtype_name(g.dtype)}_d{g.head_dim}_g{g.group}_b{g.block_size}"
                       f"_m{block_m}_w{warp_m}_s{STAGES}{variant_name(g)}")
            q_smem = block_m * (g.head_dim + PAD) * 2 if warp_m > 16 else 0  # else in a stage
            text = source(g.features)
            self._kernels[key] = self._factory(
                name=f"paged_prefill_{text.hash}_{variant}",
                input_names=["q", "k_cache", "v_cache", "block_tables", "work", "counters",
                             "after"] + (["sinks"] if g.sinks else []),
                output_names=["out", "o_part", "lse_part"],
                source=text.source,
                header=text.header,
                # K and V per stage, 2-byte elements: 69.6 KB at D=128, 2 stages (> 48 KB
                # default), and Q's own 34.8 KB at 128 rows of 32-row warps
                shared_memory=2 * STAGES * BLOCK_N * (g.head_dim + PAD) * 2 + q_smem,
            )
        return self._kernels[key]

    def launch(self, q: mx.array, k_cache: mx.array, v_cache: mx.array,
               plan: CudaAttentionPlan, sinks: mx.array | None = None) -> mx.array:
        counters, after = plan.order.take()
        g = plan.geometry
        out, _, lse_part = self._kernel(g, plan.block_m, plan.warp_m)(
            inputs=[q, k_cache, v_cache, plan.block_tables, plan.tiles.work, counters, after,
                    *sink_inputs(g, sinks)],
            **plan.launch)
        if plan.tiles.num_slots:  # only split tiles count arrivals
            plan.order.ran(lse_part)
        return out
