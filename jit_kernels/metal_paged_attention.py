"""Metal paged-prefill attention through `mx.fast.metal_kernel` (simdgroup 8x8 MMA, Apple GPUs).

Contract: `reference.contract`. The Metal twin of `cuda_paged_attention.py`: the same work list
and split-KV plan (`plan.py`), the same per-item algorithm, Apple-native tiles. One launch serves
prefill and decode rows of every sequence; K/V are read from the paged cache through the block
table (no gather copy); the caches may come typed or as a `PagedKVCache` stores them (the
same bytes as 4-byte words), as for the CUDA kernel. Split tiles are combined by a second,
merge launch: merging inside the attention launch (as the CUDA kernel does) needs a
device-scope release/acquire between threadgroups, which MSL offers only from Metal 3.2 on, and
nothing here could check it on Apple hardware.

Nothing here has been run or timed on Apple hardware. The exact sources MLX would compile are
executed on the CPU by the tests (`tests/metal_emu`), against a float64 oracle.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from . import plan as tile_plan
from .geometry import Geometry, Lengths, dtype_name
from .interface import PagedAttentionKernel, Plan, refuse_unsupported
from .sources import source_hash

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


HEADER = f"""
#include <metal_simdgroup>
#include <metal_simdgroup_matrix>
#define PP_UNROLL _Pragma("clang loop unroll(full)")
// Tile constants and work/merge-list columns, injected from metal_paged_attention.py / plan.py.
constant constexpr int BLOCK_Q = {BLOCK_Q};
constant constexpr int NUM_THREADS = {NUM_THREADS};
constant constexpr int WORK_COLS = {tile_plan.WORK_COLS};
constant constexpr int MERGE_COLS = {tile_plan.MERGE_COLS};
{tile_plan.column_constants("W_", tile_plan.WORK_COLUMNS, "constant constexpr int")}
{tile_plan.column_constants("M_", tile_plan.MERGE_COLUMNS, "constant constexpr int")}
constant constexpr float NEG_INF = -metal::numeric_limits<float>::infinity();
""" + r"""
// Element offset of key `key`'s row for one kv head in a [num_blocks, BS, Hkv, D] cache, in
// 64 bits (page offsets pass 2**31 in big caches); -1 past the item's keys (zero-filled).
// `table` is a device or constant pointer: MLX passes arrays under 8 elements as constant.
template <int BS, typename Table>
inline long pp_row_offset(Table table, int key, int kv_end, long row_stride, long head_off) {
  if (key >= kv_end) return -1;
  return (long(table[key / BS]) * BS + key % BS) * row_stride + head_off;
}
"""

ATTENTION_SOURCE = r"""
  constexpr int D = HEAD_DIM, TD = D / 8, TK = BN / 8;
  constexpr int PAD = 16 / sizeof(T);
  constexpr int LD = D + PAD;  // k_s / v_s row stride
  constexpr int CHUNKS = BN * D / 4;  // 4-element vectors per K (or V) tile
  static_assert(CHUNKS % NUM_THREADS == 0 && BN <= NUM_THREADS, "tile loader shape");
  threadgroup T k_s[BN * LD];
  threadgroup T v_s[BN * LD];
  threadgroup long row_off[2][BN];

  const uint tid = thread_index_in_threadgroup;
  const uint sg = simdgroup_index_in_threadgroup;
  const uint lane = thread_index_in_simdgroup;
  auto item = work + threadgroup_position_in_grid.x * WORK_COLS;
  const int seq = item[W_SEQ], tok0 = item[W_TOK0], ntok = item[W_NTOK], pos0 = item[W_POS0];
  const int kvh = item[W_KV_HEAD], kv_start = item[W_KV_START], kv_end = item[W_KV_END];
  const int slot = item[W_SLOT];
  const int num_heads = q_shape[1];
  const int num_kv_heads = num_heads / GROUP;
  auto kc = (const device T*)k_cache;  // caches may come as stored words
  auto vc = (const device T*)v_cache;
  const int rows = ntok * GROUP;
  auto table = block_tables + long(seq) * block_tables_shape[1];
  const long row_stride = long(num_kv_heads) * D;
  const long head_off = long(kvh) * D;

  // This lane's fragment coordinates (row fm, columns fn and fn + 1 of every 8x8 fragment).
  const int fm = (lane & 16) / 4 + (lane & 6) / 2;
  const int fn = (lane & 8) / 2 + (lane & 1) * 2;
  const int r = sg * 8 + fm;                  // tile row
  const bool row_valid = r < rows;
  const bool sg_active = int(sg) * 8 < rows;  // simdgroup-uniform: idle bands only load
  const int row_pos = pos0 + r / GROUP;       // absolute position: sees keys 0 .. row_pos
  const long q_off = (long(tok0 + r / GROUP) * num_heads + kvh * GROUP + r % GROUP) * D + fn;

  simdgroup_float8x8 q_frag[TD], o_acc[TD];
  const float qk = qk_scale[0];
  PP_UNROLL for (int td = 0; td < TD; ++td) {
    float2 v = float2(0.0f);
    if (row_valid) v = float2(float(q[q_off + td * 8]), float(q[q_off + td * 8 + 1])) * qk;
    q_frag[td].thread_elements()[0] = v.x;
    q_frag[td].thread_elements()[1] = v.y;
    o_acc[td] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  }
  float m_run = NEG_INF, l_run = 0.0f;  // this row's running max (log2 units) and sum
  // keys < mask_from are visible to every row of the tile: tiles below it skip the mask
  const int mask_from = min(pos0 + 1, kv_end);

  if (tid < BN)
    row_off[0][tid] = pp_row_offset<BS>(table, kv_start + tid, kv_end, row_stride, head_off);
  int buf = 0;
  for (int n0 = kv_start; n0 < kv_end; n0 += BN, buf ^= 1) {
    threadgroup_barrier(mem_flags::mem_threadgroup);  // last tile consumed; row_off[buf] ready
    PP_UNROLL for (int i = 0; i < CHUNKS / NUM_THREADS; ++i) {
      const int c = tid + i * NUM_THREADS;
      const int j = c / (D / 4), d = (c % (D / 4)) * 4;
      const long off = row_off[buf][j];
      vec<T, 4> kv = vec<T, 4>(T(0.0f)), vv = vec<T, 4>(T(0.0f));
      if (off >= 0) {  // zero past the keys: masked P * V must stay finite
        kv = *(const device vec<T, 4>*)(kc + off + d);
        vv = *(const device vec<T, 4>*)(vc + off + d);
      }
      PP_UNROLL for (int e = 0; e < 4; ++e) {
        k_s[j * LD + d + e] = kv[e];
        v_s[j * LD + d + e] = vv[e];
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // tile visible to every simdgroup
    // next tile's pages, resolved once per row while this one computes (other buffer)
    if (tid < BN)
      row_off[buf ^ 1][tid] = pp_row_offset<BS>(table, n0 + BN + tid, kv_end, row_stride, head_off);
    if (!sg_active) continue;

    simdgroup_float8x8 s_acc[TK];  // S = (Q * scale * log2 e) K^T, 8 rows x BN keys
    PP_UNROLL for (int tk = 0; tk < TK; ++tk)
      s_acc[tk] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    PP_UNROLL for (int td = 0; td < TD; ++td) {
      PP_UNROLL for (int tk = 0; tk < TK; ++tk) {
        const threadgroup T* src = k_s + (tk * 8 + fn) * LD + td * 8 + fm;  // K^T[d][key]
        simdgroup_float8x8 k_frag;
        k_frag.thread_elements()[0] = float(src[0]);
        k_frag.thread_elements()[1] = float(src[LD]);
        simdgroup_multiply_accumulate(s_acc[tk], q_frag[td], k_frag, s_acc[tk]);
      }
    }
    if (n0 + BN > mask_from) {  // diagonal, split-edge or last tile: mask by position
      PP_UNROLL for (int tk = 0; tk < TK; ++tk) {
        PP_UNROLL for (int e = 0; e < 2; ++e) {
          const int key = n0 + tk * 8 + fn + e;
          if (key > row_pos || key >= kv_end) s_acc[tk].thread_elements()[e] = NEG_INF;
        }
      }
    }
    // Online softmax; the 4 lanes of a row differ in lane bits 0 and 3.
    float m_new = m_run;
    PP_UNROLL for (int tk = 0; tk < TK; ++tk)
      m_new = max(m_new, max(s_acc[tk].thread_elements()[0], s_acc[tk].thread_elements()[1]));
    m_new = max(m_new, simd_shuffle_xor(m_new, ushort(1)));
    m_new = max(m_new, simd_shuffle_xor(m_new, ushort(8)));
    const float base = m_new == NEG_INF ? 0.0f : m_new;  // no visible key yet: no NaN
    const float alpha = exp2(m_run - base);
    float sum = 0.0f;
    PP_UNROLL for (int tk = 0; tk < TK; ++tk) {
      PP_UNROLL for (int e = 0; e < 2; ++e) {
        const float p = exp2(s_acc[tk].thread_elements()[e] - base);
        s_acc[tk].thread_elements()[e] = p;
        sum += p;
      }
    }
    sum += simd_shuffle_xor(sum, ushort(1));
    sum += simd_shuffle_xor(sum, ushort(8));
    l_run = l_run * alpha + sum;
    m_run = m_new;
    PP_UNROLL for (int td = 0; td < TD; ++td) {  // O = alpha O + P V (P stays fp32)
      o_acc[td].thread_elements()[0] *= alpha;
      o_acc[td].thread_elements()[1] *= alpha;
      PP_UNROLL for (int tk = 0; tk < TK; ++tk) {
        const threadgroup T* src = v_s + (tk * 8 + fm) * LD + td * 8 + fn;  // V[key][d]
        simdgroup_float8x8 v_frag;
        v_frag.thread_elements()[0] = float(src[0]);
        v_frag.thread_elements()[1] = float(src[1]);
        simdgroup_multiply_accumulate(o_acc[td], s_acc[tk], v_frag, o_acc[td]);
      }
    }
  }

  if (!row_valid) return;
  const float inv = l_run > 0.0f ? 1.0f / l_run : 0.0f;
  if (slot < 0) {
    device T* dst = out + q_off;
    PP_UNROLL for (int td = 0; td < TD; ++td) {
      dst[td * 8] = T(o_acc[td].thread_elements()[0] * inv);
      dst[td * 8 + 1] = T(o_acc[td].thread_elements()[1] * inv);
    }
  } else {
    device float* dst = o_part + (long(slot) * BLOCK_Q + r) * D + fn;
    PP_UNROLL for (int td = 0; td < TD; ++td) {
      dst[td * 8] = o_acc[td].thread_elements()[0] * inv;
      dst[td * 8 + 1] = o_acc[td].thread_elements()[1] * inv;
    }
    if (fn == 0) lse_part[long(slot) * BLOCK_Q + r] = l_run > 0.0f ? m_run + log2(l_run) : NEG_INF;
  }
"""

# Inputs:  o_part, lse_part (above); merge [num_tiles, MERGE_COLS] int32 (plan.py);
#          attn_out [T, H, D] T: the attention launch's `out`, final for unsplit tiles.
# Output:  out [T, H, D] T. Template: T, HEAD_DIM, GROUP, NUM_HEADS.
# Grid: one threadgroup of NUM_THREADS per tile; a simdgroup per row, columns lane + 32 j.
# An unsplit tile (FIRST_SLOT -1) only copies its rows over: outputs start uninitialised.
MERGE_SOURCE = r"""
  constexpr int D = HEAD_DIM, PER_LANE = D / 32;
  const uint sg = simdgroup_index_in_threadgroup, lane = thread_index_in_simdgroup;
  auto item = merge + threadgroup_position_in_grid.x * MERGE_COLS;  // constant if < 8 ints
  const int tok0 = item[M_TOK0], ntok = item[M_NTOK], kvh = item[M_KV_HEAD];
  const int first = item[M_FIRST_SLOT], nsplit = item[M_NUM_SPLITS];
  for (int row = sg; row < ntok * GROUP; row += NUM_THREADS / 32) {
    const long dst_off = (long(tok0 + row / GROUP) * NUM_HEADS + kvh * GROUP + row % GROUP) * D;
    device T* dst = out + dst_off;
    if (first < 0) {
      PP_UNROLL for (int j = 0; j < PER_LANE; ++j) dst[lane + 32 * j] = attn_out[dst_off + lane + 32 * j];
      continue;
    }
    float top = NEG_INF;
    for (int s = 0; s < nsplit; ++s) top = max(top, lse_part[long(first + s) * BLOCK_Q + row]);
    const float base = top == NEG_INF ? 0.0f : top;
    float acc[PER_LANE] = {0.0f}, sum = 0.0f;
    for (int s = 0; s < nsplit; ++s) {
      const long part = long(first + s) * BLOCK_Q + row;
      const float w = exp2(lse_part[part] - base);
      sum += w;
      PP_UNROLL for (int j = 0; j < PER_LANE; ++j) acc[j] += w * o_part[part * D + lane + 32 * j];
    }
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    PP_UNROLL for (int j = 0; j < PER_LANE; ++j) dst[lane + 32 * j] = T(acc[j] * inv);
  }
"""

_SOURCE_HASH = source_hash(HEADER, ATTENTION_SOURCE, MERGE_SOURCE)


@dataclass(frozen=True)
class MetalAttentionPlan(Plan):
    tiles: tile_plan.TilePlan
    qk_scale: mx.array  # float32 [1]: scale * log2(e), folded into Q
    launch: dict  # the attention call's arguments other than its inputs
    merge_launch: dict | None  # the merge's, when the plan splits keys


class MetalPagedAttention(PagedAttentionKernel):
    """The Metal paged kernel; kernels are built once per variant through `metal_kernel`
    (MLX's factory; tests pass the CPU emulation of it, or a broken one)."""

    name = "metal paged kernel"
    head_dims = HEAD_DIMS

    def __init__(self, metal_kernel=None):
        super().__init__(metal_kernel or mx.fast.metal_kernel)

    def tile_rows(self, geometry: Geometry) -> tuple[int, ...]:
        return (BLOCK_Q,)

    def plan(self, lengths: Lengths, geometry: Geometry, block_tables: mx.array, seqs=None,
             block_m: int | None = None) -> MetalAttentionPlan:
        """`block_m`: one of `tile_rows` (there is one)."""
        refuse_unsupported(self, geometry)
        self._block_m(block_m, geometry)
        g, seqs = geometry, lengths.seqs(seqs)
        tiles = tile_plan.build_tile_plan(lengths.cu_seqlens_q, lengths.seq_lens, g.group,
                                          g.num_kv_heads, BLOCK_Q, BLOCK_N[g.head_dim],
                                          GPU_CORES, seqs=np.asarray(seqs))
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
            qk_scale=mx.array([g.scale * LOG2E], dtype=mx.float32), launch=launch,
            merge_launch=merge_launch)

    def _kernel(self, kind: str, g: Geometry):
        key = (kind, g.dtype, g.head_dim, g.group, g.block_size)
        if key not in self._kernels:
            variant = f"{dtype_name(g.dtype)}_d{g.head_dim}_g{g.group}_b{g.block_size}"
            inputs, outputs, source = {
                "attention": (["q", "k_cache", "v_cache", "block_tables", "work", "qk_scale"],
                              ["out", "o_part", "lse_part"], ATTENTION_SOURCE),
                "merge": (["o_part", "lse_part", "merge", "attn_out"], ["out"], MERGE_SOURCE),
            }[kind]
            # ensure_row_contiguous (the default) copies a strided input: the runner's caches
            # (PagedKVCache's arrays, as stored) are contiguous, bound in place.
            self._kernels[key] = self._factory(
                name=f"metal_paged_{kind}_{_SOURCE_HASH}_{variant}", input_names=inputs,
                output_names=outputs, source=source, header=HEADER)
        return self._kernels[key]

    def launch(self, q: mx.array, k_cache: mx.array, v_cache: mx.array,
               plan: MetalAttentionPlan) -> mx.array:
        g, tiles = plan.geometry, plan.tiles
        out, o_part, lse_part = self._kernel("attention", g)(
            inputs=[q, k_cache, v_cache, plan.block_tables, tiles.work, plan.qk_scale],
            **plan.launch)
        if tiles.merge is None:
            return out
        return self._kernel("merge", g)(inputs=[o_part, lse_part, tiles.merge, out],
                                        **plan.merge_launch)[0]
