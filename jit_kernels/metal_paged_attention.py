"""Metal paged-prefill attention through `mx.fast.metal_kernel` (simdgroup 8x8 MMA, Apple GPUs).

Contract: `paged_prefix.contract`. The Metal twin of `cuda_paged_attention.py`: the same work
list and split-KV plan (`schedule.py`), the same per-item algorithm, Apple-native tiles. One
launch serves prefill and decode rows of every sequence; K/V are read from the paged cache
through the block table (no gather copy); split tiles are combined by a second, merge launch.

Nothing here has been run or timed on Apple hardware (it was written on a machine with no
Metal back-end). The kernel sources were checked by compiling them as C++ against a CPU mock of
the MSL subset they use (a thread per GPU thread, barriers, 8x8 simdgroup MMA and shuffles on
steel's lane layout) and comparing with `reference.dense_attention`.
"""

from __future__ import annotations

import functools
import math

import mlx.core as mx

from paged_prefix.metadata import AttentionMetadata

from . import schedule, support

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
# (schedule.build_tile_plan). Unmeasured: Apple GPUs have 8 (M1) to 80 (M3 Ultra) cores and
# MLX does not report the count.
GPU_CORES = 16
LOG2E = math.log2(math.e)


HEADER = f"""
#include <metal_simdgroup>
#include <metal_simdgroup_matrix>
#define PP_UNROLL _Pragma("clang loop unroll(full)")
// Tile constants (see metal_paged_attention.py) and the work/merge list columns (schedule.py).
constant constexpr int BLOCK_Q = {BLOCK_Q};
constant constexpr int NUM_THREADS = {NUM_THREADS};
constant constexpr int WORK_COLS = {schedule.WORK_COLS};
constant constexpr int MERGE_COLS = {schedule.MERGE_COLS};
constant constexpr int W_SEQ = {schedule.SEQ}, W_TOK0 = {schedule.TOK0}, W_NTOK = {schedule.NTOK};
constant constexpr int W_POS0 = {schedule.POS0}, W_KV_HEAD = {schedule.KV_HEAD};
constant constexpr int W_KV_START = {schedule.KV_START}, W_KV_END = {schedule.KV_END};
constant constexpr int W_SLOT = {schedule.SLOT};
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

# Inputs:  q [T, H, D] T; k_cache, v_cache [num_blocks, BS, Hkv, D] T (row-contiguous);
#          block_tables [S, max_blocks] int32; work [num_items, WORK_COLS] int32 (schedule.py);
#          qk_scale float32 [1] = scale * log2(e), folded into Q so the softmax runs on exp2.
# Outputs: out [T, H, D] T (items with SLOT < 0);
#          o_part [slots, BLOCK_Q, D] float32, lse_part [slots, BLOCK_Q] float32 (SLOT >= 0): per-split
#          output normalised by its own row sum, and its log2-sum-exp (-inf: the split saw no key).
# Template: T, HEAD_DIM, GROUP, BS (block size), BN (keys per K/V tile).
# Grid: one threadgroup of NUM_THREADS per work item. Tile row r (simdgroup r / 8) is token
# r / GROUP, query head KV_HEAD * GROUP + r % GROUP, so each K/V tile serves the whole group.
# Threadgroup memory: k_s, v_s [BN][HEAD_DIM + PAD] (row-major: the loader's stores are
# contiguous, where a transposed K tile would stride them by a row), row_off [2][BN] int64
# (page offsets, double-buffered).
# Fragments: Q, O and S are simdgroup_float8x8 in registers; a lane holds row fm, columns
# fn, fn + 1 of each (MLX steel's layout). K/V are converted to float on their way from
# threadgroup memory into fragments (simdgroup_load needs matching element types), so every
# MMA and the online softmax run in fp32.
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
  const int num_kv_heads = k_cache_shape[2];
  const int num_heads = num_kv_heads * GROUP;
  const int rows = ntok * GROUP;
  auto table = block_tables + long(seq) * block_tables_shape[1];
  const long row_stride = long(num_kv_heads) * D;
  const long head_off = long(kvh) * D;

  // This lane's fragment coordinates (row fm, columns fn and fn + 1 of every 8x8 fragment).
  const int fm = (lane & 16) / 4 + (lane & 6) / 2;
  const int fn = (lane & 8) / 2 + (lane & 1) * 2;
  const int r = sg * 8 + fm;                  // tile row
  const bool row_valid = r < rows;
  const bool sg_active = sg * 8 < rows;       // simdgroup-uniform: idle bands only load
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
        kv = *(const device vec<T, 4>*)(k_cache + off + d);
        vv = *(const device vec<T, 4>*)(v_cache + off + d);
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

# Inputs:  o_part, lse_part (above); merge [num_tiles, MERGE_COLS] int32 (schedule.py).
# Output:  out [T, H, D] T. Template: T, HEAD_DIM, GROUP, NUM_HEADS.
# Grid: one threadgroup of NUM_THREADS per tile; a simdgroup per row, columns lane + 32 j.
MERGE_SOURCE = r"""
  constexpr int D = HEAD_DIM, PER_LANE = D / 32;
  const uint sg = simdgroup_index_in_threadgroup, lane = thread_index_in_simdgroup;
  auto item = merge + threadgroup_position_in_grid.x * MERGE_COLS;  // constant if < 8 ints
  const int tok0 = item[0], ntok = item[1], kvh = item[2], first = item[3], nsplit = item[4];
  for (int row = sg; row < ntok * GROUP; row += NUM_THREADS / 32) {
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
    device T* dst = out + (long(tok0 + row / GROUP) * NUM_HEADS + kvh * GROUP + row % GROUP) * D;
    PP_UNROLL for (int j = 0; j < PER_LANE; ++j) dst[lane + 32 * j] = T(acc[j] * inv);
  }
"""

_SOURCE_HASH = support.source_hash(HEADER, ATTENTION_SOURCE, MERGE_SOURCE)


def _variant(dtype: mx.Dtype, head_dim: int, group: int) -> str:
    return f"{support.dtype_name(dtype)}_d{head_dim}_g{group}"


@functools.cache
def _attention_kernel(dtype: mx.Dtype, head_dim: int, group: int, block_size: int):
    # ensure_row_contiguous (the default) copies a strided input: PagedKVCache.blocks() views
    # are contiguous, so the caches are bound in place.
    return mx.fast.metal_kernel(
        name=f"metal_paged_prefill_{_SOURCE_HASH}_{_variant(dtype, head_dim, group)}_b{block_size}",
        input_names=["q", "k_cache", "v_cache", "block_tables", "work", "qk_scale"],
        output_names=["out", "o_part", "lse_part"],
        source=ATTENTION_SOURCE,
        header=HEADER,
    )


@functools.cache
def _merge_kernel(dtype: mx.Dtype, head_dim: int, group: int):
    return mx.fast.metal_kernel(
        name=f"metal_paged_merge_{_SOURCE_HASH}_{_variant(dtype, head_dim, group)}",
        input_names=["o_part", "lse_part", "merge"],
        output_names=["out"],
        source=MERGE_SOURCE,
        header=HEADER,
    )


def _tile_plan(meta: AttentionMetadata, group: int, num_kv_heads: int, head_dim: int):
    bn = BLOCK_N[head_dim]
    return meta.plan(
        f"metal_paged:{BLOCK_Q}x{bn}:g{group}:hkv{num_kv_heads}",
        lambda m: schedule.build_tile_plan(m, group, num_kv_heads, BLOCK_Q, bn, GPU_CORES),
    )


def _scale_log2(meta: AttentionMetadata, scale: float) -> mx.array:
    # One small device array per forward, not one per layer call.
    return meta.plan(f"metal_paged:scale{scale!r}",
                     lambda m: mx.array([scale * LOG2E], dtype=mx.float32))


def unsupported_reason(q: mx.array, k_cache: mx.array, meta: AttentionMetadata) -> str | None:
    if not mx.metal.is_available():
        return "no Metal device"
    return support.unsupported_reason(q, k_cache, HEAD_DIMS)


def reference_is_faster(q: mx.array, k_cache: mx.array, meta: AttentionMetadata) -> str | None:
    # Unmeasured on Apple hardware: no rule yet, so the kernel is taken whenever it supports
    # the call. Replace with a measured rule (like the CUDA one) once timed on an M-series GPU.
    return None


def paged_attention(
    q: mx.array, k_cache: mx.array, v_cache: mx.array, meta: AttentionMetadata, scale: float
) -> mx.array:
    """The contract of `paged_prefix.contract` in one kernel launch (two when KV is split)."""
    support.validate_call("metal", q, k_cache, v_cache, meta, unsupported_reason(q, k_cache, meta))
    _, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    plan = _tile_plan(meta, group, num_kv_heads, head_dim)
    slots = max(plan.num_slots, 1)  # outputs cannot be empty; unused when nothing is split
    out, o_part, lse_part = _attention_kernel(q.dtype, head_dim, group, block_size)(
        inputs=[q, k_cache, v_cache, meta.block_tables, plan.work, _scale_log2(meta, scale)],
        template=[("T", q.dtype), ("HEAD_DIM", head_dim), ("GROUP", group),
                  ("BS", block_size), ("BN", BLOCK_N[head_dim])],
        grid=(plan.num_items * NUM_THREADS, 1, 1),
        threadgroup=(NUM_THREADS, 1, 1),
        output_shapes=[q.shape, (slots, BLOCK_Q, head_dim), (slots, BLOCK_Q)],
        output_dtypes=[q.dtype, mx.float32, mx.float32],
    )
    if plan.merge is None:
        return out
    return _merge_kernel(q.dtype, head_dim, group)(
        inputs=[o_part, lse_part, plan.merge],
        template=[("T", q.dtype), ("HEAD_DIM", head_dim), ("GROUP", group),
                  ("NUM_HEADS", num_heads)],
        grid=(plan.merge.shape[0] * NUM_THREADS, 1, 1),
        threadgroup=(NUM_THREADS, 1, 1),
        output_shapes=[q.shape],
        output_dtypes=[q.dtype],
    )[0]
