"""Metal paged-prefill attention through `mx.fast.metal_kernel` (simdgroup 8x8 MMA, Apple GPUs).

Contract: `reference.contract`. The Metal twin of `cuda_paged_attention.py`: the same work list
and split-KV plan (`plan.py`), the same per-item algorithm, Apple-native tiles. One launch serves
prefill and decode rows of every sequence; K/V are read from the paged cache through the block
table (no gather copy); the caches may come typed or as a `PagedKVCache` stores them (the
same bytes as 4-byte words), as for the CUDA kernel. Split tiles are combined by a second,
merge launch: merging inside the attention launch (as the CUDA kernel does) needs a
device-scope release/acquire between threadgroups, which MSL offers only from Metal 3.2 on, and
nothing here could check it on Apple hardware.

Variants (compile-time features, each its own kernel): a sliding window (its size a column of
the plan's work list; kv tiles left of a query tile's window are never visited, nor its keys
there read), logit softcapping and attention sinks (a split row's sink joins in the merge).

Nothing here has been run or timed on Apple hardware. The exact sources MLX would compile are
executed on the CPU by the tests (`tests/metal_emu`), against a float64 oracle.
"""

from __future__ import annotations

import functools
import math
import sys
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from . import plan as tile_plan
from . import sources
from .geometry import FEATURES, Geometry, Lengths, dtype_name
from .interface import PagedAttentionKernel, Plan, refuse_unsupported

# Query-tile rows (the plan's block_m): 4 simdgroups x one 8-row fragment band each; a tile
# holds BLOCK_Q // group tokens, so rows past ntok * group (2 of 32 for group 3) are padding.
BLOCK_Q = 32
NUM_THREADS = 128  # 4 simdgroups of 32
# D=256 holds 128 fp32 fragment elements of Q and O per thread: expect register spills there.
HEAD_DIMS = (64, 96, 128, 256)
# Keys per K/V tile; threadgroup bytes (K + V tiles with 16-byte row padding, 2-byte elements,
# + page offsets) stay under the 32 KB limit: D=64 9,728; D=96 13,824; D=128 17,920; D=256 17,152.
BLOCK_N = {64: 32, 96: 32, 128: 32, 256: 16}
# Split KV when a forward has fewer than GPU_CORES query tiles, into about 2 x GPU_CORES items
# (plan.build_tile_plan). Unmeasured: Apple GPUs have 8 (M1) to 80 (M3 Ultra) cores and
# MLX does not report the count.
GPU_CORES = 16
LOG2E = math.log2(math.e)


@functools.cache
def attention_source(features: str) -> sources.MlxSource:
    """kernels/paged_attention.metal for a variant's features (`Geometry.features`)."""
    return sources.mlx_kernel("paged_attention.metal", sources.attention_prelude(
        sources.METAL, features, BLOCK_Q=BLOCK_Q, NUM_THREADS=NUM_THREADS))


@functools.cache
def merge_source(sinks: bool) -> sources.MlxSource:
    """kernels/split_merge.metal, which split tiles end with; its only feature is the sink."""
    return sources.mlx_kernel(
        "split_merge.metal",
        sources.feature_flags("sinks" * sinks) +
        sources.constants(sources.METAL, BLOCK_Q=BLOCK_Q, NUM_THREADS=NUM_THREADS) +
        sources.columns(sources.METAL, "M_", tile_plan.MERGE_COLUMNS, "MERGE_COLS"))


# The plain variant's kernels (no window, cap or sinks).
ATTENTION, MERGE = attention_source(""), merge_source(False)


@dataclass(frozen=True)
class MetalAttentionPlan(Plan):
    tiles: tile_plan.TilePlan
    qk_scale: mx.array  # float32 [1]: scale * log2(e), folded into Q; softcapped: scale / cap
    # the cap's input after qk_scale: softcap float32 [1] (cap * log2(e)) when the geometry has
    # one (a window's W is a column of the work list)
    feature_inputs: tuple[mx.array, ...]
    launch: dict  # the attention call's arguments other than its inputs
    merge_launch: dict | None  # the merge's, when the plan splits keys


class MetalPagedAttention(PagedAttentionKernel):
    """The Metal paged kernel; kernels are built once per variant through `metal_kernel`
    (MLX's factory; tests pass the CPU emulation of it, or a broken one)."""

    name = "metal paged kernel"
    head_dims = HEAD_DIMS
    features = FEATURES

    def __init__(self, metal_kernel=None):
        super().__init__(metal_kernel or mx.fast.metal_kernel)

    def tile_rows(self, geometry: Geometry) -> tuple[int, ...]:
        return (BLOCK_Q,)

    def canary_plannings(self, geometry: Geometry) -> tuple[dict, ...]:
        # At a large group the canary's case fills GPU_CORES query tiles and splits nothing:
        # one more planning splits every tile, so the merge kernel is built and checked too.
        return super().canary_plannings(geometry) + ({"block_m": BLOCK_Q, "split_kv_tiles": 1},)

    def plan(self, lengths: Lengths, geometry: Geometry, block_tables: mx.array, seqs=None,
             block_m: int | None = None,
             split_kv_tiles: int | None = None) -> MetalAttentionPlan:
        """`block_m`: one of `tile_rows` (there is one). `split_kv_tiles`: split every query
        tile's keys, however many tiles the plan has, into parts of at least this many kv
        tiles (the canary's check of the merge); None splits only the plans with fewer than
        GPU_CORES tiles."""
        refuse_unsupported(self, geometry)
        self._block_m(block_m, geometry)
        split_kv_tiles = self._split_kv_tiles(split_kv_tiles)
        g, seqs = geometry, lengths.seqs(seqs)
        split = {} if split_kv_tiles is None else dict(min_chunk=split_kv_tiles,
                                                        min_items=sys.maxsize)
        tiles = tile_plan.build_tile_plan(lengths.cu_seqlens_q, lengths.seq_lens, g.group,
                                          g.num_kv_heads, BLOCK_Q, BLOCK_N[g.head_dim],
                                          GPU_CORES, seqs=np.asarray(seqs), window=g.window,
                                          **split)
        feature_inputs = ()
        if g.softcap is not None:  # tanh takes the natural-unit logit over the cap
            qk_scale = g.scale / g.softcap
            feature_inputs = (mx.array([g.softcap * LOG2E], dtype=mx.float32),)
        else:
            qk_scale = g.scale * LOG2E
        out_shape = (lengths.num_tokens, g.num_heads, g.head_dim)
        slots = max(tiles.num_slots, 1)  # outputs cannot be empty; unused when nothing is split
        launch = dict(
            template=[("T", g.dtype), ("HEAD_DIM", g.head_dim), ("GROUP", g.group),
                      ("BS", g.block_size), ("BN", BLOCK_N[g.head_dim])],
            grid=(tiles.num_items * NUM_THREADS, 1, 1), threadgroup=(NUM_THREADS, 1, 1),
            output_shapes=[out_shape, (slots, BLOCK_Q, g.head_dim), (slots, BLOCK_Q)],
            output_dtypes=[g.dtype, mx.float32, mx.float32])
        merge_launch = None if tiles.merge is None else dict(
            template=[("T", g.dtype), ("HEAD_DIM", g.head_dim), ("GROUP", g.group),
                      ("NUM_HEADS", g.num_heads)],
            grid=(tiles.merge.shape[0] * NUM_THREADS, 1, 1), threadgroup=(NUM_THREADS, 1, 1),
            output_shapes=[out_shape], output_dtypes=[g.dtype])
        return MetalAttentionPlan(
            g, lengths, block_tables, seqs, tiles=tiles,
            qk_scale=mx.array([qk_scale], dtype=mx.float32), feature_inputs=feature_inputs,
            launch=launch, merge_launch=merge_launch)

    def _kernel(self, kind: str, g: Geometry):
        # the merge's only feature is the sink: windowed or capped variants share theirs
        features = g.features if kind == "attention" else "sinks" * g.sinks
        key = (kind, g.dtype, g.head_dim, g.group, g.block_size, features)
        if key not in self._kernels:
            used = [name for name in FEATURES if name in features.split("+")]
            variant = "_".join([f"{dtype_name(g.dtype)}_d{g.head_dim}_g{g.group}_b{g.block_size}",
                                *used])
            extra = [name for name in used if name != "window"]  # W rides in the work list
            inputs, outputs, source = {
                "attention": (["q", "k_cache", "v_cache", "block_tables", "work", "qk_scale",
                               *extra], ["out", "o_part", "lse_part"], attention_source(features)),
                "merge": (["o_part", "lse_part", "merge", "attn_out", *extra], ["out"],
                          merge_source(g.sinks)),
            }[kind]
            # ensure_row_contiguous (the default) copies a strided input: the runner's caches
            # (PagedKVCache's arrays, as stored) are contiguous, bound in place.
            self._kernels[key] = self._factory(
                name=f"metal_paged_{kind}_{source.hash}_{variant}", input_names=inputs,
                output_names=outputs, source=source.source, header=source.header)
        return self._kernels[key]

    def launch(self, q: mx.array, k_cache: mx.array, v_cache: mx.array,
               plan: MetalAttentionPlan, sinks: mx.array | None = None) -> mx.array:
        g, tiles = plan.geometry, plan.tiles
        sink_input = [sinks.astype(mx.float32)] if g.sinks else []
        out, o_part, lse_part = self._kernel("attention", g)(
            inputs=[q, k_cache, v_cache, plan.block_tables, tiles.work, plan.qk_scale,
                    *plan.feature_inputs, *sink_input],
            **plan.launch)
        if tiles.merge is None:
            return out
        return self._kernel("merge", g)(inputs=[o_part, lse_part, tiles.merge, out, *sink_input],
                                        **plan.merge_launch)[0]
