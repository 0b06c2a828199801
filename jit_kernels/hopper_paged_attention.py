"""CUDA paged-prefill attention on Hopper tensor cores (wgmma, sm_90a), through NVRTC and
`mx.fast.precompiled_cuda_kernel`.

Same contract, plan, work list, split-KV merge and launch order as `cuda_paged_attention` (it
subclasses it); only the tile products differ. A threadblock is one warpgroup (four warps, 64
query rows); S = Q K^T and O += P V are warpgroup MMAs reading K and V straight from shared
memory (`wgmma.mma_async` m64n64k16 and m64n128k16), where the mma.sync kernel has every warp
load every K/V fragment through `ldmatrix` for its own 16 rows: a quarter of the shared-memory
traffic per product. Q and P stay in registers as the A operand (the m16n8k16 fragment layout,
so the online softmax and the split merge are the mma.sync kernel's own: kernels/softmax.cuh,
kernels/split_merge.inc). The kernel: kernels/paged_attention_wgmma.cu.

K/V tiles land through cp.async (paged: every 16-byte chunk resolves its page) in the 128-byte
swizzled layout wgmma reads: a tile [BLOCK_N keys][D] is stored as D / 64 column blocks of
[BLOCK_N][64], 16-byte chunk c of key row r at chunk c ^ (r % 8). K is the B operand K-major
(keys are its N), V the B operand N-major (transposed: keys are its K).

`mx.fast.cuda_kernel` compiles for sm_90, which has no wgmma, so the source is compiled for
sm_90a by NVRTC (`nvrtc.py`) once per variant and launched as a cubin. MLX copies and hashes a
precompiled kernel's bytes on every call (~0.25 us per KB on the H200; this cubin is ~58 KB), so
a call costs ~10 us more host time than the mma.sync kernel's (docs/results.md).
"""

from __future__ import annotations

import functools

import mlx.core as mx

from . import cuda_paged_attention as cpa
from . import nvrtc, sources
from .geometry import Geometry, Lengths, dtype_name

ARCH = "sm_90a"
BLOCK_M = 64  # one warpgroup: four warps of 16 rows
THREADS = 128
WGMMA_HEAD_DIMS = (128,)  # others run the mma.sync kernel's variants
# 168 registers a thread: three blocks per SM (two: 204). No spills, but 24 bytes at group 1,
# block 8 (one value kept across the key loop, read back in the split epilogue: nvcc 13.0)
MIN_BLOCKS_PER_SM = 3
STAGES = 2  # K/V tiles in flight + 1; 3 measured no faster, 4 fits one block per SM
# Split KV in parts of at least 9 kv tiles, where the mma.sync kernel takes 8 (see there): a
# split's fp32 partial is stored and read back. Measured both ways (docs/h200/split_chunk.json,
# docs/results.md, "Split chunking"): fewer, longer parts cost a lone call's latency at
# C <= 1024 (still at or under the ceiling's) and buy throughput wherever launches overlap.
SPLIT_MIN_KV_TILES = 9

@functools.cache
def unit(features: str) -> sources.TranslationUnit:
    """The kernel of a variant's features: kernels/paged_attention_wgmma.cu behind the feature
    flags, the tile constants and the work-list columns."""
    return sources.translation_unit("paged_attention_wgmma.cu", sources.attention_prelude(
        sources.CUDA, features, BLOCK_N=cpa.BLOCK_N, MERGE_ROWS=cpa.MERGE_ROWS, STAGES=STAGES,
        BLOCK_M=BLOCK_M, NUM_THREADS=THREADS, MIN_BLOCKS_PER_SM=MIN_BLOCKS_PER_SM), ARCH)


def kernel_source(name: str, g: Geometry) -> str:
    """The whole translation unit of one variant: its constants, then the kernel, named `name`."""
    return unit(g.features).source(name, sources.half_type(g.dtype) + sources.constants(
        sources.CUDA, HEAD_DIM=g.head_dim, GROUP=g.group, BS=g.block_size,
        **cpa.compiled_floats(g)))


def unavailable_reason() -> str | None:
    """Why this machine cannot run the wgmma kernel, or None when it can."""
    if not mx.cuda.is_available():
        return "no CUDA device"
    arch = mx.device_info().get("architecture")
    if arch != "sm_90":
        return f"GPU architecture {arch} (wgmma needs sm_90: H100, H200)"
    try:
        nvrtc.library()
    except nvrtc.NvrtcError as error:
        return str(error)
    return None


class HopperPagedAttention(cpa.CudaPagedAttention):
    """The CUDA paged kernel on Hopper: plan() once per forward, then call once per layer.

    Geometries with a wgmma variant (head dim 128) get 64-row tiles through warpgroup MMAs,
    the only height a plan then takes (measured faster than the mma.sync kernel's 128-row tiles
    at every point up to Lq = 512, docs/results.md); other head dims keep the mma.sync kernel and
    its heights. `compile` turns a source into a cubin (NVRTC's, or a test's stand-in).
    """

    def __init__(self, cuda_kernel=None, compile=None, precompiled_kernel=None):
        super().__init__(cuda_kernel)
        self._compile = compile or nvrtc.compile_cubin
        self._precompiled = precompiled_kernel or mx.fast.precompiled_cuda_kernel

    @staticmethod
    def uses_wgmma(geometry: Geometry) -> bool:
        return geometry.head_dim in WGMMA_HEAD_DIMS

    def tile_rows(self, geometry: Geometry) -> tuple[int, ...]:
        return (BLOCK_M,) if self.uses_wgmma(geometry) else super().tile_rows(geometry)

    def split_min_kv_tiles_for(self, geometry: Geometry) -> int:
        return (SPLIT_MIN_KV_TILES if self.uses_wgmma(geometry)
                else super().split_min_kv_tiles_for(geometry))

    def plan(self, lengths: Lengths, geometry: Geometry, block_tables: mx.array, seqs=None,
             block_m: int | None = None, split_kv_tiles: int | None = None
             ) -> cpa.CudaAttentionPlan:
        if block_m is None and self.uses_wgmma(geometry):
            block_m = BLOCK_M  # the parent checks a caller's height against tile_rows
        return super().plan(lengths, geometry, block_tables, seqs=seqs, block_m=block_m,
                            split_kv_tiles=split_kv_tiles)

    def _kernel(self, g: Geometry, block_m: int, warp_m: int):
        if not self.uses_wgmma(g):
            return super()._kernel(g, block_m, warp_m)
        floats = cpa.compiled_floats_name(g)
        key = ("wgmma", g.dtype, g.head_dim, g.group, g.block_size, g.features, floats)
        if key not in self._kernels:
            name = (f"paged_prefill_wgmma_{unit(g.features).hash}_{dtype_name(g.dtype)}"
                    f"_d{g.head_dim}_g{g.group}_b{g.block_size}{cpa.variant_name(g)}{floats}")
            cubin = self._compile(kernel_source(name, g), name, ARCH)
            smem = 2 * STAGES * cpa.BLOCK_N * g.head_dim * 2 + 1024  # + alignment slack

            def call(inputs, template, grid, threadgroup, output_shapes, output_dtypes):
                q, block_tables = inputs[0], inputs[3]
                return self._precompiled(
                    name=name, compiled_source=cubin, inputs=inputs, output_shapes=output_shapes,
                    output_dtypes=output_dtypes, scalars=[q.shape[1], block_tables.shape[1]],
                    grid=grid, threadgroup=threadgroup, shared_memory=smem,
                    ensure_row_contiguous=True)
            self._kernels[key] = call
        return self._kernels[key]
