"""CUDA paged-prefill attention through `mx.fast.cuda_kernel` (tensor-core mma.sync, sm_80+).

Contract: `paged_prefix.contract`. One launch serves prefill and decode rows of every sequence;
K/V are read from the paged cache through the block table (no gather copy). Host planning
(tile work list, split-KV) lives in `schedule.py` and is built once per forward.

FlashAttention-2-style: Q fragments in registers, K/V tiles through cp.async into padded smem,
ldmatrix + mma.sync m16n8k16 (fp32 accumulate), online softmax in base 2; the rows of a tile
are (token, head-in-group) pairs so one K/V tile serves a whole GQA group; fully visible tiles
skip the mask, tiles past the causal frontier are never visited; when the tiles are too few
for the GPU the key range is split and a second kernel merges the partials by log-sum-exp.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from paged_prefix.metadata import AttentionMetadata

from . import schedule, support

BLOCK_N = 64  # keys per K/V tile; query tiles are 64 or 128 rows (choose_block_m)
STAGES = 2  # K/V smem stages (tiles in flight + 1); 3 measured no faster (decode 10% slower)
HEAD_DIMS = (64, 128)
NUM_SMS = 132  # H100/H200 SXM; MLX does not report the SM count
PAD = 8  # smem row padding (elements): 16 bytes shift each row by 4 banks for ldmatrix

HEADER = r"""
// Tile constants (see cuda_paged_attention.py): BLOCK_M (template) query rows x BLOCK_N keys
// per step, one warp per 16 rows; smem rows are padded by PAD elements.
constexpr int BLOCK_N = 64, PAD = 8;
constexpr int WORK_COLS = 8, MERGE_COLS = 5;

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// 16-byte async copy global -> shared; zero-fills when !valid (src is then not read).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
               :: "r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n"); }
// wait until at most N of this thread's committed copy groups are still in flight
template <int N> __device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" :: "n"(N));
}
// 2^x; -inf -> 0 (the masked softmax terms)
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t* r) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t addr, uint32_t* r) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// m16n8k16 tensor-core product, fp32 accumulate: c += a (16x16 row) * b (16x8 col).
template <typename T> struct Mma;
template <> struct Mma<__nv_bfloat16> {
  static __device__ __forceinline__ void run(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  static __device__ __forceinline__ uint32_t pack(float x, float y) {
    __nv_bfloat162 v = __floats2bfloat162_rn(x, y);
    return *reinterpret_cast<uint32_t*>(&v);
  }
};
template <> struct Mma<__half> {
  static __device__ __forceinline__ void run(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  static __device__ __forceinline__ uint32_t pack(float x, float y) {
    __half2 v = __floats2half2_rn(x, y);
    return *reinterpret_cast<uint32_t*>(&v);
  }
};
"""

# Inputs:  q [T, H, D] T; k_cache, v_cache [num_blocks, block_size, Hkv, D] T;
#          block_tables [S, max_blocks] int32; work [num_items, WORK_COLS] int32 (schedule.py);
#          params int32 [H, Hkv, log2(block_size), max_blocks, bits of the float32 scale].
# Outputs: out [T, H, D] T (items with SLOT < 0);
#          o_part [slots, BLOCK_M, D] float32, lse_part [slots, BLOCK_M] float32 (SLOT >= 0):
#          per-split output normalised by its own row sum, and its log2-sum-exp (-inf: no key).
# Grid: one threadblock of 2 * BLOCK_M threads (a warp per 16 rows) per work item.
# Template: T, HEAD_DIM, GROUP, BLOCK_M, STAGES. Smem: STAGES K/V stages [K][V], each
# [BLOCK_N][HEAD_DIM + PAD]; Q passes through the last stage on its way to registers.
# Pipeline: STAGES - 1 K/V tiles in flight; one barrier per tile (after the wait, before
# refilling the stage the previous iteration read).
ATTENTION_SOURCE = r"""
  constexpr int D = HEAD_DIM, LD = D + PAD, CHUNKS = D / 8;   // 16-byte chunks per row
  constexpr int KSTEPS = D / 16, DTILES = D / 8, NTILES = BLOCK_N / 8;
  constexpr int NUM_THREADS = 2 * BLOCK_M, ROWS_PER_PASS = NUM_THREADS / CHUNKS;
  constexpr int BUF = 2 * BLOCK_N * LD;        // one K + V stage
  static_assert(BLOCK_M <= 2 * BLOCK_N, "Q staging fits one K + V stage");
  extern __shared__ __align__(16) unsigned char smem[];
  T* sK = reinterpret_cast<T*>(smem);          // stage b: K at sK + b * BUF
  T* sV = sK + BLOCK_N * LD;                   //          V at sV + b * BUF
  T* sQ = sK + (STAGES - 1) * BUF;             // [BLOCK_M][LD], aliases the last stage

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int* item = work + static_cast<size_t>(blockIdx.x) * WORK_COLS;
  const int seq = item[0], tok0 = item[1], ntok = item[2], pos0 = item[3], kvh = item[4];
  const int kv_start = item[5], kv_end = item[6], slot = item[7];
  const int H = params[0], HKV = params[1], BS_LOG2 = params[2], MAX_BLOCKS = params[3];
  const int rows = ntok * GROUP;
  const float scale_log2 = __int_as_float(params[4]) * 1.4426950408889634f;  // base-2 softmax

  // Q tile -> smem; padding rows are zero-filled
  const int ch = tid % CHUNKS;
  for (int r = tid / CHUNKS; r < BLOCK_M; r += ROWS_PER_PASS) {
    const bool ok = r < rows;
    const int rr = ok ? r : 0;
    const T* src = q + (static_cast<size_t>(tok0 + rr / GROUP) * H + kvh * GROUP + rr % GROUP) * D;
    cp_async16(smem_addr(sQ + r * LD + ch * 8), src + ch * 8, ok);
  }
  cp_async_commit();

  // K/V tile: each thread resolves the page of each of its rows once (K and V share it);
  // keys at or past kv_end are zero-filled so masked P * V stays finite.
  const int* table = block_tables + static_cast<size_t>(seq) * MAX_BLOCKS;
  const size_t row_stride = static_cast<size_t>(HKV) * D;
  const size_t page_stride = row_stride << BS_LOG2;
  const size_t head_off = static_cast<size_t>(kvh) * D + ch * 8;
  auto load_kv = [&](int n0, int buf) {
    for (int r = tid / CHUNKS; r < BLOCK_N; r += ROWS_PER_PASS) {
      const int key = n0 + r;
      const bool ok = key < kv_end;
      const int kk = ok ? key : kv_start;
      const size_t off = static_cast<size_t>(table[kk >> BS_LOG2]) * page_stride +
                         static_cast<size_t>(kk & ((1 << BS_LOG2) - 1)) * row_stride + head_off;
      const int s = buf * BUF + r * LD + ch * 8;
      cp_async16(smem_addr(sK + s), k_cache + off, ok);
      cp_async16(smem_addr(sV + s), v_cache + off, ok);
    }
  };
  const int num_tiles = (kv_end - kv_start + BLOCK_N - 1) / BLOCK_N;
  for (int t = 0; t < STAGES - 1; ++t) {  // prologue: one (maybe empty) group per stage
    if (t < num_tiles) load_kv(kv_start + t * BLOCK_N, t);
    cp_async_commit();
  }
  cp_async_wait<STAGES - 1>();  // Q has landed
  __syncthreads();

  // Q fragments stay in registers (A operand of S = Q K^T)
  const bool warp_active = warp * 16 < rows;  // warp-uniform: padding warps only load
  uint32_t qf[KSTEPS][4];
  for (int ks = 0; ks < KSTEPS; ++ks)
    ldsm_x4(smem_addr(sQ + (warp * 16 + lane % 16) * LD + ks * 16 + (lane / 16) * 8), qf[ks]);

  float o[DTILES][4] = {};
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};
  const int row_lo = warp * 16 + lane / 4;  // this thread's rows: row_lo and row_lo + 8
  const int pos_row[2] = {pos0 + row_lo / GROUP, pos0 + (row_lo + 8) / GROUP};
  // keys < mask_from are visible to every row of the tile: those tiles skip the mask
  const int mask_from = min(pos0 + 1, kv_end);

  for (int t = 0; t < num_tiles; ++t) {
    const int n0 = kv_start + t * BLOCK_N, buf = t % STAGES;
    cp_async_wait<STAGES - 2>();  // tile t has landed
    // every warp is done with tile t - 1 (and with Q): its stage can be refilled
    __syncthreads();
    const int next = t + STAGES - 1;
    if (next < num_tiles) load_kv(kv_start + next * BLOCK_N, next % STAGES);
    cp_async_commit();
    if (warp_active) {
      const T* k_t = sK + buf * BUF;
      const T* v_t = sV + buf * BUF;
      float s[NTILES][4] = {};
      for (int ks = 0; ks < KSTEPS; ++ks) {
        for (int np = 0; np < NTILES / 2; ++np) {
          uint32_t b[4];
          ldsm_x4(smem_addr(k_t + (np * 16 + lane % 8 + (lane / 16) * 8) * LD + ks * 16 +
                            ((lane / 8) % 2) * 8), b);
          Mma<T>::run(s[2 * np], qf[ks], b[0], b[1]);
          Mma<T>::run(s[2 * np + 1], qf[ks], b[2], b[3]);
        }
      }
      if (n0 + BLOCK_N > mask_from) {  // diagonal or last tile: mask by position
        for (int nt = 0; nt < NTILES; ++nt)
          for (int e = 0; e < 4; ++e) {
            const int key = n0 + nt * 8 + (lane % 4) * 2 + (e & 1);
            if (key > pos_row[e / 2] || key >= kv_end) s[nt][e] = -INFINITY;
          }
      }
      for (int i = 0; i < 2; ++i) {  // online softmax of rows row_lo + 8 i
        float mx = m_run[i];
        for (int nt = 0; nt < NTILES; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * i], s[nt][2 * i + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
        const float base = mx == -INFINITY ? 0.f : mx * scale_log2;  // no key yet: no NaN
        const float alpha = fast_exp2(m_run[i] * scale_log2 - base);
        m_run[i] = mx;
        float sum = 0.f;
        for (int nt = 0; nt < NTILES; ++nt)
          for (int e = 2 * i; e < 2 * i + 2; ++e) {
            s[nt][e] = fast_exp2(fmaf(s[nt][e], scale_log2, -base));
            sum += s[nt][e];
          }
        l_run[i] = l_run[i] * alpha + sum;  // per-thread share; the quad sums at the end
        for (int dt = 0; dt < DTILES; ++dt) {
          o[dt][2 * i] *= alpha;
          o[dt][2 * i + 1] *= alpha;
        }
      }
      for (int kk = 0; kk < BLOCK_N / 16; ++kk) {  // O += P V, P re-packed as the A operand
        const uint32_t a[4] = {Mma<T>::pack(s[2 * kk][0], s[2 * kk][1]),
                               Mma<T>::pack(s[2 * kk][2], s[2 * kk][3]),
                               Mma<T>::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                               Mma<T>::pack(s[2 * kk + 1][2], s[2 * kk + 1][3])};
        for (int dp = 0; dp < DTILES / 2; ++dp) {
          uint32_t b[4];
          ldsm_x4_trans(smem_addr(v_t + (kk * 16 + lane % 8 + ((lane / 8) % 2) * 8) * LD +
                                  dp * 16 + (lane / 16) * 8), b);
          Mma<T>::run(o[2 * dp], a, b[0], b[1]);
          Mma<T>::run(o[2 * dp + 1], a, b[2], b[3]);
        }
      }
    }
  }

  if (!warp_active) return;
  for (int i = 0; i < 2; ++i) {
    float l = l_run[i];
    l += __shfl_xor_sync(0xffffffff, l, 1);
    l += __shfl_xor_sync(0xffffffff, l, 2);
    const float inv = l > 0.f ? 1.f / l : 0.f;
    const int row = row_lo + 8 * i;
    if (row >= rows) continue;
    const int col = (lane % 4) * 2;
    if (slot < 0) {
      T* dst = out + (static_cast<size_t>(tok0 + row / GROUP) * H + kvh * GROUP + row % GROUP) * D;
      for (int dt = 0; dt < DTILES; ++dt)
        *reinterpret_cast<uint32_t*>(dst + dt * 8 + col) =
            Mma<T>::pack(o[dt][2 * i] * inv, o[dt][2 * i + 1] * inv);
    } else {
      float* dst = o_part + (static_cast<size_t>(slot) * BLOCK_M + row) * D;
      for (int dt = 0; dt < DTILES; ++dt)
        *reinterpret_cast<float2*>(dst + dt * 8 + col) =
            make_float2(o[dt][2 * i] * inv, o[dt][2 * i + 1] * inv);
      if (lane % 4 == 0)
        lse_part[static_cast<size_t>(slot) * BLOCK_M + row] =
            l > 0.f ? m_run[i] * scale_log2 + log2f(l) : -INFINITY;
    }
  }
"""

# Inputs:  o_part, lse_part (above); merge [num_tiles, MERGE_COLS] int32 (schedule.py);
#          params (above). Output: out [T, H, D] T.
# Grid: (split tile, block of NUM_THREADS / 32 rows); a warp per row, D / 32 columns a lane.
# Lanes compute the split weights in parallel, then every split's row is read with
# independent loads (a serial per-split chain was latency-bound: 150 us for 8 tiles).
# Template: T, HEAD_DIM, GROUP, BLOCK_M (the partials' row stride), NUM_THREADS.
MERGE_SOURCE = r"""
  constexpr int D = HEAD_DIM, PER_LANE = D / 32, WARPS = NUM_THREADS / 32;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int* item = merge + static_cast<size_t>(blockIdx.x) * MERGE_COLS;
  const int tok0 = item[0], ntok = item[1], kvh = item[2], first = item[3], nsplit = item[4];
  const int row = blockIdx.y * WARPS + warp;
  if (row >= ntok * GROUP) return;
  const int H = params[0];
  const float* lse = lse_part + static_cast<size_t>(first) * BLOCK_M + row;  // stride BLOCK_M
  const float* part = o_part + (static_cast<size_t>(first) * BLOCK_M + row) * D + lane * PER_LANE;
  float top = -INFINITY;
  for (int s = lane; s < nsplit; s += 32) top = fmaxf(top, lse[static_cast<size_t>(s) * BLOCK_M]);
  for (int off = 16; off > 0; off /= 2) top = fmaxf(top, __shfl_xor_sync(0xffffffff, top, off));
  const float base = top == -INFINITY ? 0.f : top;
  float acc[PER_LANE] = {}, sum = 0.f;
  for (int s0 = 0; s0 < nsplit; s0 += 32) {
    const int mine = s0 + lane;
    const float w_mine =
        mine < nsplit ? fast_exp2(lse[static_cast<size_t>(mine) * BLOCK_M] - base) : 0.f;
    sum += w_mine;
    const int n = min(32, nsplit - s0);
#pragma unroll 4
    for (int j = 0; j < n; ++j) {
      const float w = __shfl_sync(0xffffffff, w_mine, j);
      const float* src = part + static_cast<size_t>(s0 + j) * BLOCK_M * D;
      for (int c = 0; c < PER_LANE; ++c) acc[c] += w * src[c];
    }
  }
  for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffff, sum, off);
  const float inv = sum > 0.f ? 1.f / sum : 0.f;
  T* dst = out + (static_cast<size_t>(tok0 + row / GROUP) * H + kvh * GROUP + row % GROUP) * D;
  for (int c = 0; c < PER_LANE; ++c) dst[lane * PER_LANE + c] = static_cast<T>(acc[c] * inv);
"""

_SOURCE_HASH = support.source_hash(HEADER, ATTENTION_SOURCE, MERGE_SOURCE)
MERGE_THREADS = 128
# Prefill-heavy forwards take 128-row tiles (each K/V tile feeds 8 warps: half the L2 traffic
# per FLOP of 64-row tiles) when they still give at least this many threadblocks; decode
# batches and short suffixes keep 64-row tiles (more, smaller blocks in flight per SM).
MIN_TILES_FOR_BLOCK_M_128 = 118  # ~0.9 x NUM_SMS: 128-row blocks run one per SM


def _variant(dtype: mx.Dtype, head_dim: int, group: int, block_m: int, stages: int) -> str:
    return f"{support.dtype_name(dtype)}_d{head_dim}_g{group}_m{block_m}_s{stages}"


@functools.cache
def _attention_kernel(dtype: mx.Dtype, head_dim: int, group: int, block_m: int, stages: int):
    return mx.fast.cuda_kernel(
        name=f"paged_prefill_{_SOURCE_HASH}_{_variant(dtype, head_dim, group, block_m, stages)}",
        input_names=["q", "k_cache", "v_cache", "block_tables", "work", "params"],
        output_names=["out", "o_part", "lse_part"],
        source=ATTENTION_SOURCE,
        header=HEADER,
        # K and V per stage, 2-byte elements: 69.6 KB at D=128, 2 stages (over the 48 KB default)
        shared_memory=2 * stages * BLOCK_N * (head_dim + PAD) * 2,
    )


@functools.cache
def _merge_kernel(dtype: mx.Dtype, head_dim: int, group: int, block_m: int):
    return mx.fast.cuda_kernel(
        name=f"paged_merge_{_SOURCE_HASH}_{_variant(dtype, head_dim, group, block_m, 0)}",
        input_names=["o_part", "lse_part", "merge", "params"],
        output_names=["out"],
        source=MERGE_SOURCE,
        header=HEADER,
    )


@dataclass(frozen=True)
class _Launch:
    block_m: int
    plan: schedule.TilePlan
    params: mx.array  # int32 [H, Hkv, log2(block_size), max_blocks, float32 bits of scale]


def choose_block_m(meta: AttentionMetadata, group: int, num_kv_heads: int) -> int:
    # full 128-row tiles' worth of rows: decode rows (group rows a sequence) barely count
    tiles = meta.num_tokens * group // 128 * num_kv_heads
    return 128 if tiles >= MIN_TILES_FOR_BLOCK_M_128 else 64


def _launch_plan(meta: AttentionMetadata, num_heads: int, num_kv_heads: int,
                 scale: float) -> _Launch:
    """Tile plan and kernel parameters, built once per forward (and scale)."""
    group = num_heads // num_kv_heads

    def build(m: AttentionMetadata) -> _Launch:
        block_m = choose_block_m(m, group, num_kv_heads)
        # 128-row plans are chosen only when they fill the GPU: never split them
        plan = schedule.build_tile_plan(m, group, num_kv_heads, block_m, BLOCK_N, NUM_SMS,
                                        min_items=0 if block_m == 128 else None)
        scale_bits = int(np.array(scale, dtype=np.float32).view(np.int32))
        params = [num_heads, num_kv_heads, m.block_size.bit_length() - 1,
                  m.block_tables_host.shape[1], scale_bits]
        return _Launch(block_m, plan, mx.array(params, dtype=mx.int32))

    return meta.plan(f"cuda_paged:h{num_heads}:hkv{num_kv_heads}:scale{scale!r}", build)


def unsupported_reason(q: mx.array, k_cache: mx.array, meta: AttentionMetadata) -> str | None:
    if not mx.cuda.is_available():
        return "no CUDA device"
    return support.unsupported_reason(q, k_cache, HEAD_DIMS)


# Measured rule (H200, bf16, H=32, Hkv=8, D=128, block 16, shuffled pages, one sequence;
# 2026-11-29, two machines): time of the gather reference / time of this kernel (> 1: kernel
# wins). Lq=64 for comparison: 3.0 at C=4096, 4.1 at C=16384.
#              Lq=512       1024         2048   4096
#   C=0         1.8 - 2.3    1.9 - 2.4    1.5    0.90 - 0.92
#   C=4096      1.25 - 1.27  0.92 - 0.95  0.76   0.57 - 0.58
#   C=16384     0.98 - 1.02  0.72         0.55   0.47 - 0.49
# cuDNN's SDPA (wgmma) runs ~2.4x this kernel's mma.sync TFLOP/s, so the reference wins once a
# sequence's causal attention work Lq * (C + (Lq + 1) / 2) (FLOPs / 4HD) outweighs its gather
# copy and there are enough query tiles to fill the GPU without split-KV (Lq >= 512). The
# table crosses over between 2.2e6 (C=4096, Lq=512: kernel 1.25x) and 4.7e6 (C=4096, Lq=1024:
# reference 1.05x); C=16384, Lq=512 (8.5e6) is a tie and goes to the reference, so the
# dispatcher is never measurably slower than it. The reference wins a batch only when every
# sequence is such a long prefill: it runs sequence by sequence, so decode rows and short
# suffixes cost it a gather and a launch each (the sweep's 8-sequence mixed batch: kernel 2.4x).
LONG_PREFILL_MIN_Q = 512
LONG_PREFILL_MIN_WORK = 4.0e6


def reference_is_faster(q: mx.array, k_cache: mx.array, meta: AttentionMetadata) -> str | None:
    def measure(m: AttentionMetadata) -> str | None:
        q_lens = m.q_lens_host.astype(np.float64)
        work = q_lens * (m.context_lens_host + (q_lens + 1) / 2)
        if ((q_lens >= LONG_PREFILL_MIN_Q) & (work >= LONG_PREFILL_MIN_WORK)).all():
            return (f"every sequence is a long prefill (Lq >= {LONG_PREFILL_MIN_Q}, "
                    f"Lq * (C + (Lq + 1) / 2) >= {LONG_PREFILL_MIN_WORK:.0e}): gather + cuDNN "
                    "SDPA measured faster on the H200")
        return None

    return meta.plan("cuda_paged:reference_is_faster", measure)


def paged_attention(
    q: mx.array, k_cache: mx.array, v_cache: mx.array, meta: AttentionMetadata, scale: float
) -> mx.array:
    """The contract of `paged_prefix.contract` in one kernel launch (two when KV is split)."""
    support.validate_call("cuda", q, k_cache, v_cache, meta, unsupported_reason(q, k_cache, meta))
    _, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    launch = _launch_plan(meta, num_heads, num_kv_heads, scale)
    plan, block_m = launch.plan, launch.block_m
    slots = max(plan.num_slots, 1)  # outputs cannot be empty; unused when nothing is split
    template = [("T", q.dtype), ("HEAD_DIM", head_dim), ("GROUP", group), ("BLOCK_M", block_m)]
    out, o_part, lse_part = _attention_kernel(q.dtype, head_dim, group, block_m, STAGES)(
        inputs=[q, k_cache, v_cache, meta.block_tables, plan.work, launch.params],
        template=template + [("STAGES", STAGES)],
        grid=(plan.num_items * 2 * block_m, 1, 1),
        threadgroup=(2 * block_m, 1, 1),
        output_shapes=[q.shape, (slots, block_m, head_dim), (slots, block_m)],
        output_dtypes=[q.dtype, mx.float32, mx.float32],
    )
    if plan.merge is None:
        return out
    return _merge_kernel(q.dtype, head_dim, group, block_m)(
        inputs=[o_part, lse_part, plan.merge, launch.params],
        template=template + [("NUM_THREADS", MERGE_THREADS)],
        grid=(plan.merge.shape[0] * MERGE_THREADS, -(-plan.max_rows // (MERGE_THREADS // 32)), 1),
        threadgroup=(MERGE_THREADS, 1, 1),
        output_shapes=[q.shape],
        output_dtypes=[q.dtype],
    )[0]
