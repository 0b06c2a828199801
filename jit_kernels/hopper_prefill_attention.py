"""Long prefills over cached prefixes on Hopper: a warp-specialized kernel that loads K/V pages
with TMA (sm_90a, through NVRTC and `mx.fast.precompiled_cuda_kernel`).

    plan = kernel.plan(lengths, geometry, block_tables, seqs)        # once per forward
    out = kernel.run(q, k, v, k_cache, v_cache, plan, out, sinks)    # every layer

What the wgmma kernel (`hopper_paged_attention`) cannot: keep the tensor cores fed at long
suffixes, where cuDNN's SDPA on contiguous K/V runs much faster (so the dispatcher sent those
sequences to a page gather + SDPA, paying the gather). This kernel has cuDNN's structure on
paged K/V: measured faster than gather + SDPA wherever the prefix holds four times the new
tokens or more, and close to cuDNN on K/V that are already contiguous (docs/results.md,
rules.CUDA_PREFILL_MIN_CTX_PER_Q). Three warpgroups a block, one work item (128 query rows of
one kv head, planned unsplit): a producer warp loading K/V pages with TMA (`tma.py`), two
consumer warpgroups overlapping S, softmax and P V (kernels/prefill_attention_tma.cu).

Rows of sequences the plan leaves out are not written. Same contract as the reference; caches
as pages or as a `PagedKVCache` stores them (the kernel reads bytes). The variants are the paged
kernel's (`cuda_paged_attention`): a window's tile starts at the kv tile of its first visible
key, and the pages of that tile left of the key are never read (their slots load the key's page
again, masked out).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from . import cuda_paged_attention as cpa
from . import hopper_paged_attention as hp
from . import nvrtc, sources, tma
from . import plan as tile_plan
from .arrays import check_call, device_array
from .geometry import Geometry, Lengths, dtype_name, unsupported_reason
from .interface import Plan, refuse_unsupported, write_rows

BLOCK_M = 128  # two consumer warpgroups of 64 rows
KV_TILE = 128  # keys a stage holds (64 measured slower, docs/results.md)
STAGES = 3  # V(t) stays while K(t + 1) and tile t + 2 land
THREADS = 384
PRODUCER_REGS, CONSUMER_REGS = 40, 232  # 128 x 40 + 256 x 232 <= 64K registers
HEAD_DIMS = (128,)
SMEM_BYTES = 2 * STAGES * KV_TILE * 128 * 2 + 1024  # K and V per stage, + alignment slack

@functools.cache
def unit(features: str) -> sources.TranslationUnit:
    """The kernel of a variant's features: kernels/prefill_attention_tma.cu behind the feature
    flags, the tile constants and the work-list columns."""
    return sources.translation_unit("prefill_attention_tma.cu", sources.attention_prelude(
        sources.CUDA, features, BLOCK_M=BLOCK_M, KV_TILE=KV_TILE, STAGES=STAGES,
        NUM_THREADS=THREADS, PRODUCER_REGS=PRODUCER_REGS, CONSUMER_REGS=CONSUMER_REGS), hp.ARCH)


def kernel_source(name: str, g: Geometry) -> str:
    """The whole translation unit of one variant: its constants, then the kernel, named `name`."""
    return unit(g.features).source(name, sources.half_type(g.dtype) + sources.constants(
        sources.CUDA, HEAD_DIM=g.head_dim, GROUP=g.group, BS=g.block_size,
        **cpa.compiled_floats(g)))


@dataclass(frozen=True)
class PrefillPlan(Plan):
    tiles: tile_plan.TilePlan


class HopperPrefillAttention:
    """The Hopper prefill kernel. `compile` turns a source into a cubin (NVRTC's, or a test's
    stand-in), `maps` encodes the caches' tensor-map templates."""

    name = "hopper prefill kernel"

    def __init__(self, compile=None, precompiled_kernel=None, maps=None):
        self._compile = compile or nvrtc.compile_cubin
        self._precompiled = precompiled_kernel or mx.fast.precompiled_cuda_kernel
        self._maps = maps or (lambda rows, bs, hkv: np.concatenate(
            [tma.k_map(rows, bs, hkv), tma.v_map(rows, bs, hkv)]))
        self._cubins: dict[tuple, tuple[str, bytes]] = {}
        self._templates: dict[tuple, mx.array] = {}

    def unsupported_reason(self, g: Geometry) -> str | None:
        # block sizes 8-32 (the shared rule's): whole swizzle atoms that tile KV_TILE
        return unsupported_reason(g, HEAD_DIMS, cpa.FEATURES) or cpa.scale_reason(g.scale)

    def canary_plannings(self, geometry: Geometry) -> tuple[dict, ...]:
        return ({},)

    def plan(self, lengths: Lengths, geometry: Geometry, block_tables: mx.array,
             seqs=None) -> PrefillPlan:
        refuse_unsupported(self, geometry)
        g, seqs = geometry, lengths.seqs(seqs)
        tiles = tile_plan.build_tile_plan(lengths.cu_seqlens_q, lengths.seq_lens, g.group,
                                          g.num_kv_heads, BLOCK_M, KV_TILE, cpa.NUM_SMS,
                                          min_items=0, seqs=np.asarray(seqs), window=g.window)
        return PrefillPlan(g, lengths, block_tables, seqs, tiles)

    def check(self, q, k, v, k_cache, v_cache, plan: PrefillPlan, sinks=None) -> None:
        check_call(self.name, plan.geometry, plan.lengths, q, k, v, k_cache, v_cache,
                   plan.block_tables, sinks)

    def run(self, q, k, v, k_cache, v_cache, plan: PrefillPlan, out=None,
            sinks=None) -> mx.array:
        return write_rows(out, self.launch(q, k_cache, v_cache, plan, sinks), plan)

    def launch(self, q: mx.array, k_cache: mx.array, v_cache: mx.array, plan: PrefillPlan,
               sinks: mx.array | None = None) -> mx.array:
        g, tiles, block_tables = plan.geometry, plan.tiles, plan.block_tables
        floats = cpa.compiled_floats_name(g)
        key = (g.dtype, g.group, g.block_size, g.features, floats)
        if key not in self._cubins:
            name = (f"paged_prefill_tma_{unit(g.features).hash}_{dtype_name(g.dtype)}"
                    f"_g{g.group}_b{g.block_size}{cpa.variant_name(g)}{floats}")
            self._cubins[key] = name, self._compile(kernel_source(name, g), name, hp.ARCH)
        name, cubin = self._cubins[key]
        rows = k_cache.nbytes // (g.num_kv_heads * g.head_dim * 2)
        shape = (rows, g.block_size, g.num_kv_heads)
        if shape not in self._templates:  # one per cache shape: a server's never changes
            self._templates[shape] = device_array(self._maps(*shape))
        return self._precompiled(
            name=name, compiled_source=cubin,
            inputs=[q, k_cache, v_cache, block_tables, tiles.work, self._templates[shape],
                    *cpa.sink_inputs(g, sinks)],
            output_shapes=[q.shape, (max(tiles.num_items, 1) * 256,)],
            output_dtypes=[q.dtype, mx.uint8], scalars=[q.shape[1], block_tables.shape[1]],
            grid=(tiles.num_items * THREADS, 1, 1), threadgroup=(THREADS, 1, 1),
            shared_memory=SMEM_BYTES, ensure_row_contiguous=True)[0]
