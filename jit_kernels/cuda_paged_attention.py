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
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from . import plan as tile_plan
from .geometry import Geometry, Lengths, dtype_name
from .interface import PagedAttentionKernel, Plan, refuse_unsupported
from .sources import source_hash

BLOCK_N = 64  # keys per K/V tile; query tiles are 64 or 128 rows (choose_block_m)
STAGES = 2  # K/V smem stages (tiles in flight + 1); 3 measured no faster (decode 10% slower)
HEAD_DIMS = (64, 128)
NUM_SMS = 132  # H100/H200 SXM; MLX does not report the SM count
PAD = 8  # smem row padding (elements): 16 bytes shift each row by 4 banks for ldmatrix
LOG2E = math.log2(math.e)
MIN_WORDS = 4  # the counters kept longer than MLX's pool of <= 8-byte arrays (qk_scale_bits)
# Launches of one split plan that may run at once, each on its own set of arrival counters
# (independent calls of a plan evaluated together; a forward's layers are ordered by their data).
# H200, 20 calls of one plan evaluated together, GPU time a call, 1 / 4 / 8 / 16 sets:
# C=4096, Lq=16 24.4 / 9.1 / 7.6 / 7.2 us; C=1024, Lq=16 16.8 / 5.0 / 3.9 / 3.5; the Lq=64
# points no faster past 4 (docs/h200/counter_sets.txt).
COUNTER_SETS = 16
MERGE_ROWS = 16  # rows a thread merges at once: every one's load of a split in flight together

COLUMNS = f"""
// Tile constants and work-list columns, injected from cuda_paged_attention.py / plan.py.
constexpr int BLOCK_N = {BLOCK_N}, MERGE_ROWS = {MERGE_ROWS};
constexpr int WORK_COLS = {tile_plan.WORK_COLS};
{tile_plan.column_constants("W_", tile_plan.WORK_COLUMNS, "constexpr int")}
"""
# Device helpers both CUDA kernels use (this one and hopper_paged_attention.py).
DEVICE_HELPERS = r"""
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
// another block's store, seen once this load sees its count (the split merge's wait)
__device__ __forceinline__ int load_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}
// gpu-scope loads through a generic address (global, or this block's shared memory): never a
// stale L1 line of another block's store
__device__ __forceinline__ float load_relaxed(const float* p) {
  float v;
  asm volatile("ld.relaxed.gpu.f32 %0, [%1];\n" : "=f"(v) : "l"(p));
  return v;
}
__device__ __forceinline__ float4 load_relaxed(const float4* p) {
  float4 v;
  asm volatile("ld.relaxed.gpu.v4.f32 {%0, %1, %2, %3}, [%4];\n"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
  return v;
}
// 2^x; -inf -> 0 (the masked softmax terms)
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
"""
HEADER = COLUMNS + f"constexpr int PAD = {PAD};\n" + DEVICE_HELPERS + r"""
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

# Inputs:  q [T, H, D] T; k_cache, v_cache [num_blocks, BS, Hkv, D] T, or the same bytes in any
#          dtype (a PagedKVCache's 4-byte words, passed as stored);
#          block_tables [S, max_blocks] int32; work [num_items, WORK_COLS] int32 (plan.py);
#          counters int32 [2 num_tiles], zero between launches (each tile's last split resets its
#          two, so one array serves launch after launch); after: never read, an output of the
#          last launch that took the same counters, so that MLX runs the two in order (it orders
#          the launches of one evaluation only by the buffers they share).
# Outputs: out [T, H, D] T;
#          o_part [slots, BLOCK_M, D] float32, lse_part [slots, BLOCK_M] float32: scratch of split
#          tiles, per-split output normalised by its own row sum and its log2-sum-exp (-inf: no key).
# Grid: one threadblock of 32 * BLOCK_M / WARP_M threads (a warp per WARP_M rows) per work item.
# Template: T, HEAD_DIM, GROUP, BLOCK_M, WARP_M (16 or 32), STAGES, BS (block size, a power of
# two), QK_SCALE_BITS (the float32 bits of scale * log2(e)). A warp of 32 rows runs two m16
# tiles against each K/V fragment it loads from smem: half the ldmatrix traffic per product of
# 16-row warps.
# Smem: STAGES K/V stages [K][V], each [BLOCK_N][HEAD_DIM + PAD], then Q [BLOCK_M][HEAD_DIM + PAD]
# when WARP_M = 32 (a warp re-reads its Q fragments every tile: the registers hold two tiles'
# accumulators instead); with WARP_M = 16, Q passes through the last stage on its way to
# registers. Pipeline: STAGES - 1 K/V tiles in flight; one barrier per tile (after the wait,
# before refilling the stage the previous iteration read).
_MMA_SYNC_MAIN = r"""
  constexpr int D = HEAD_DIM, LD = D + PAD, CHUNKS = D / 8;   // 16-byte chunks per row
  constexpr int KSTEPS = D / 16, DTILES = D / 8, NTILES = BLOCK_N / 8;
  constexpr int MT = WARP_M / 16;              // m16 tiles per warp
  constexpr int NUM_THREADS = 32 * BLOCK_M / WARP_M, ROWS_PER_PASS = NUM_THREADS / CHUNKS;
  constexpr int BUF = 2 * BLOCK_N * LD;        // one K + V stage
  constexpr int STAGE_BYTES = STAGES * BUF * 2;
  static_assert(MT == 1 || MT == 2, "a warp holds 16 or 32 rows");
  static_assert(MT > 1 || BLOCK_M <= 2 * BLOCK_N, "Q staging fits one K + V stage");
  static_assert((BS & (BS - 1)) == 0, "block size is a power of two");
  extern __shared__ __align__(16) unsigned char smem[];
  T* sK = reinterpret_cast<T*>(smem);          // stage b: K at sK + b * BUF
  T* sV = sK + BLOCK_N * LD;                   //          V at sV + b * BUF
  T* sQ = sK + (MT > 1 ? STAGES : STAGES - 1) * BUF;  // [BLOCK_M][LD]: own, or the last stage

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int* item = work + static_cast<size_t>(blockIdx.x) * WORK_COLS;
  const int seq = item[W_SEQ], tok0 = item[W_TOK0], ntok = item[W_NTOK], pos0 = item[W_POS0];
  const int kvh = item[W_KV_HEAD], kv_start = item[W_KV_START], kv_end = item[W_KV_END];
  const int slot = item[W_SLOT];
  const int H = q_shape[1], HKV = H / GROUP, MAX_BLOCKS = block_tables_shape[1];
  const T* kc = reinterpret_cast<const T*>(k_cache);  // caches may come as stored words
  const T* vc = reinterpret_cast<const T*>(v_cache);
  const int rows = ntok * GROUP;
  const float scale_log2 = __int_as_float(QK_SCALE_BITS);

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
  const size_t page_stride = row_stride * BS;
  const size_t head_off = static_cast<size_t>(kvh) * D + ch * 8;
  auto load_kv = [&](int n0, int buf) {
    for (int r = tid / CHUNKS; r < BLOCK_N; r += ROWS_PER_PASS) {
      const int key = n0 + r;
      const bool ok = key < kv_end;
      const int kk = ok ? key : kv_start;
      const size_t off = static_cast<size_t>(table[kk / BS]) * page_stride +
                         static_cast<size_t>(kk % BS) * row_stride + head_off;
      const int s = buf * BUF + r * LD + ch * 8;
      cp_async16(smem_addr(sK + s), kc + off, ok);
      cp_async16(smem_addr(sV + s), vc + off, ok);
    }
  };
  const int num_tiles = (kv_end - kv_start + BLOCK_N - 1) / BLOCK_N;
  for (int t = 0; t < STAGES - 1; ++t) {  // prologue: one (maybe empty) group per stage
    if (t < num_tiles) load_kv(kv_start + t * BLOCK_N, t);
    cp_async_commit();
  }
  cp_async_wait<STAGES - 1>();  // Q has landed
  __syncthreads();

  // A operand of S = Q K^T: 16-row warps keep their Q fragments in registers
  const bool warp_active = warp * WARP_M < rows;  // warp-uniform: padding warps only load
  auto q_frag = [&](int mt, int ks, uint32_t* a) {
    ldsm_x4(smem_addr(sQ + (warp * WARP_M + mt * 16 + lane % 16) * LD + ks * 16 + (lane / 16) * 8),
            a);
  };
  uint32_t qf[MT == 1 ? KSTEPS : 1][4];
  if constexpr (MT == 1)
    for (int ks = 0; ks < KSTEPS; ++ks) q_frag(0, ks, qf[ks]);

  float o[MT][DTILES][4] = {};
  float m_run[MT][2], l_run[MT][2];
  // this thread's rows: row_lo + 16 mt + 8 i, for m-tile mt and half i
  const int row_lo = warp * WARP_M + lane / 4;
  int pos_row[MT][2];
  for (int mt = 0; mt < MT; ++mt)
    for (int i = 0; i < 2; ++i) {
      m_run[mt][i] = -INFINITY;
      l_run[mt][i] = 0.f;
      pos_row[mt][i] = pos0 + (row_lo + 16 * mt + 8 * i) / GROUP;
    }
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
      float s[MT][NTILES][4] = {};
      for (int ks = 0; ks < KSTEPS; ++ks) {
        uint32_t a[MT][4];
        for (int mt = 0; mt < MT; ++mt) {
          if constexpr (MT == 1) {
            for (int r = 0; r < 4; ++r) a[0][r] = qf[ks][r];
          } else {
            q_frag(mt, ks, a[mt]);
          }
        }
        for (int np = 0; np < NTILES / 2; ++np) {
          uint32_t b[4];
          ldsm_x4(smem_addr(k_t + (np * 16 + lane % 8 + (lane / 16) * 8) * LD + ks * 16 +
                            ((lane / 8) % 2) * 8), b);
          for (int mt = 0; mt < MT; ++mt) {
            Mma<T>::run(s[mt][2 * np], a[mt], b[0], b[1]);
            Mma<T>::run(s[mt][2 * np + 1], a[mt], b[2], b[3]);
          }
        }
      }
"""
# Mask (diagonal and last tiles) and online softmax of one tile's scores s[MT][NTILES][4] (the
# m16n8 accumulator layout, which wgmma's accumulators share; left as probabilities): m_run,
# l_run, and alpha, the running output's rescale, which RESCALE_O then applies. Both kernels
# take these two and SPLIT_EPILOGUE as they are.
ONLINE_SOFTMAX = r"""
      float alpha[MT][2];  // the running rows' rescale for this tile (RESCALE_O applies it)
      if (n0 + BLOCK_N > mask_from) {  // diagonal or last tile: mask by position
        for (int mt = 0; mt < MT; ++mt)
          for (int nt = 0; nt < NTILES; ++nt)
            for (int e = 0; e < 4; ++e) {
              const int key = n0 + nt * 8 + (lane % 4) * 2 + (e & 1);
              if (key > pos_row[mt][e / 2] || key >= kv_end) s[mt][nt][e] = -INFINITY;
            }
      }
      for (int mt = 0; mt < MT; ++mt)
        for (int i = 0; i < 2; ++i) {  // online softmax of rows row_lo + 16 mt + 8 i
          float mx = m_run[mt][i];
          for (int nt = 0; nt < NTILES; ++nt)
            mx = fmaxf(mx, fmaxf(s[mt][nt][2 * i], s[mt][nt][2 * i + 1]));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
          const float base = mx == -INFINITY ? 0.f : mx * scale_log2;  // no key yet: no NaN
          alpha[mt][i] = fast_exp2(m_run[mt][i] * scale_log2 - base);
          m_run[mt][i] = mx;
          float sum = 0.f;
          for (int nt = 0; nt < NTILES; ++nt)
            for (int e = 2 * i; e < 2 * i + 2; ++e) {
              s[mt][nt][e] = fast_exp2(fmaf(s[mt][nt][e], scale_log2, -base));
              sum += s[mt][nt][e];
            }
          l_run[mt][i] = l_run[mt][i] * alpha[mt][i] + sum;  // this thread's share: the quad sums at the end
        }
"""
RESCALE_O = r"""
      for (int mt = 0; mt < MT; ++mt)
        for (int dt = 0; dt < DTILES; ++dt)
          for (int e = 0; e < 4; ++e) o[mt][dt][e] *= alpha[mt][e / 2];
"""
_MMA_SYNC_PV = r"""
      for (int kk = 0; kk < BLOCK_N / 16; ++kk) {  // O += P V, P re-packed as the A operand
        uint32_t a[MT][4];
        for (int mt = 0; mt < MT; ++mt) {
          a[mt][0] = Mma<T>::pack(s[mt][2 * kk][0], s[mt][2 * kk][1]);
          a[mt][1] = Mma<T>::pack(s[mt][2 * kk][2], s[mt][2 * kk][3]);
          a[mt][2] = Mma<T>::pack(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
          a[mt][3] = Mma<T>::pack(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
        }
        for (int dp = 0; dp < DTILES / 2; ++dp) {
          uint32_t b[4];
          ldsm_x4_trans(smem_addr(v_t + (kk * 16 + lane % 8 + ((lane / 8) % 2) * 8) * LD +
                                  dp * 16 + (lane / 16) * 8), b);
          for (int mt = 0; mt < MT; ++mt) {
            Mma<T>::run(o[mt][2 * dp], a[mt], b[0], b[1]);
            Mma<T>::run(o[mt][2 * dp + 1], a[mt], b[2], b[3]);
          }
        }
      }
    }
  }

"""
# Normalise and store the rows, or a split's partial and log2-sum-exp; the last split of a tile
# to get here merges the tile's partials. It keeps its own partial on chip (in the K/V stages,
# free by then: STAGE_BYTES of them, row-padded so the MMA layout's stores spread over the
# banks), so a split tile of n parts writes and reads back n - 1 partials, not n. Whichever split
# is last, the merge reads the parts in slot order and the same fp32 values: bitwise the same.
SPLIT_EPILOGUE = r"""
  constexpr int STAGE_LD = D + 4;  // floats a staged partial row takes
  static_assert(BLOCK_M * (STAGE_LD + 1) * 4 <= STAGE_BYTES, "a partial fits the K/V stages");
  // splits take tickets as they get here: counters[2 tile] counts arrivals, [2 tile + 1] the
  // partials stored
  __shared__ int is_last;
  const int tile = item[W_TILE], first = item[W_FIRST_SLOT], nsplit = item[W_NUM_SPLITS];
  int* counter = const_cast<int*>(counters) + 2 * tile;
  float* staged = reinterpret_cast<float*>(sK);  // [BLOCK_M][STAGE_LD], then lse [BLOCK_M]
  if (slot >= 0) {
    __syncthreads();  // every warp is done with the K/V stages
    if (tid == 0) is_last = atomicAdd(counter, 1) == nsplit - 1;
    __syncthreads();
  }
  const bool keep = slot >= 0 && is_last;
  if (warp_active) {
    for (int mt = 0; mt < MT; ++mt)
      for (int i = 0; i < 2; ++i) {
        float l = l_run[mt][i];
        l += __shfl_xor_sync(0xffffffff, l, 1);
        l += __shfl_xor_sync(0xffffffff, l, 2);
        const float inv = l > 0.f ? 1.f / l : 0.f;
        const int row = row_lo + 16 * mt + 8 * i;
        if (row >= rows) continue;
        const int col = (lane % 4) * 2;
        if (slot < 0) {
          T* dst = out + (static_cast<size_t>(tok0 + row / GROUP) * H + kvh * GROUP + row % GROUP) * D;
          for (int dt = 0; dt < DTILES; ++dt)
            *reinterpret_cast<uint32_t*>(dst + dt * 8 + col) =
                Mma<T>::pack(o[mt][dt][2 * i] * inv, o[mt][dt][2 * i + 1] * inv);
        } else {
          float* dst = keep ? staged + row * STAGE_LD
                            : o_part + (static_cast<size_t>(slot) * BLOCK_M + row) * D;
          for (int dt = 0; dt < DTILES; ++dt)
            *reinterpret_cast<float2*>(dst + dt * 8 + col) =
                make_float2(o[mt][dt][2 * i] * inv, o[mt][dt][2 * i + 1] * inv);
          if (lane % 4 == 0)
            (keep ? staged + BLOCK_M * STAGE_LD : lse_part + static_cast<size_t>(slot) * BLOCK_M)
                [row] = l > 0.f ? m_run[mt][i] * scale_log2 + log2f(l) : -INFINITY;
        }
      }
  }
  if (slot < 0) return;

  // Every thread fences its partial stores before the block's store is counted (release) ...
  __threadfence();
  __syncthreads();
  if (!is_last) {
    if (tid == 0) atomicAdd(counter + 1, 1);
    return;
  }
  // ... and the last waits for the others' (they took their tickets first, so they are running
  // and store without waiting on anything), then fences before reading them (acquire).
  if (tid == 0)
    while (load_acquire(counter + 1) < nsplit - 1) {}
  __syncthreads();
  __threadfence();
  // A warp reads whole rows of a partial (a lane per float4 column; 16-lane rows at D=64), each
  // thread MERGE_ROWS rows at once, so one split's loads of all of them are in flight together;
  // rows rescale online, with no pass for their maxima first. (Two threads per row, each reading
  // half of it, spread every load of a warp over 16 rows: on the H200 the merge of 9 splits at
  // C=4096, Lq=16 took 11.9 us that way, 7.9 us this way.)
  constexpr int LANES_PER_ROW = D / 4, ROW_STEP = NUM_THREADS / LANES_PER_ROW;
  constexpr int RB = BLOCK_M / ROW_STEP < MERGE_ROWS ? BLOCK_M / ROW_STEP : MERGE_ROWS;
  const int c4 = tid % LANES_PER_ROW, own = slot - first;
  // other blocks wrote these through L2: relaxed loads never take them from this SM's L1
  const float* lse = lse_part + static_cast<size_t>(first) * BLOCK_M;
  const float4* part = reinterpret_cast<const float4*>(o_part) +
                       static_cast<size_t>(first) * BLOCK_M * LANES_PER_ROW + c4;
  const float* own_lse = staged + BLOCK_M * STAGE_LD;
  const float4* own_part = reinterpret_cast<const float4*>(staged) + c4;
  for (int r0 = tid / LANES_PER_ROW; r0 < rows; r0 += RB * ROW_STEP) {
    float4 acc[RB];
    float m[RB], l[RB];
    for (int j = 0; j < RB; ++j) {
      acc[j] = make_float4(0.f, 0.f, 0.f, 0.f);
      m[j] = -INFINITY;
      l[j] = 0.f;
    }
    for (int s = 0; s < nsplit; ++s) {
      float ls[RB];
      float4 x[RB];
      const bool mine = s == own;  // warp-uniform
      const float* lse_s = mine ? own_lse : lse + static_cast<size_t>(s) * BLOCK_M;
      const float4* part_s = mine ? own_part : part + static_cast<size_t>(s) * BLOCK_M * LANES_PER_ROW;
      const int row_step = mine ? STAGE_LD / 4 : LANES_PER_ROW;
#pragma unroll
      for (int j = 0; j < RB; ++j) {
        const int row = r0 + j * ROW_STEP, r = row < rows ? row : 0;
        ls[j] = row < rows ? load_relaxed(lse_s + r) : -INFINITY;
        x[j] = load_relaxed(part_s + r * row_step);
      }
#pragma unroll
      for (int j = 0; j < RB; ++j) {
        const float top = fmaxf(m[j], ls[j]);
        const float base = top == -INFINITY ? 0.f : top;  // no key yet: no NaN
        const float a = fast_exp2(m[j] - base), w = fast_exp2(ls[j] - base);
        m[j] = top;
        l[j] = l[j] * a + w;
        acc[j].x = acc[j].x * a + w * x[j].x;
        acc[j].y = acc[j].y * a + w * x[j].y;
        acc[j].z = acc[j].z * a + w * x[j].z;
        acc[j].w = acc[j].w * a + w * x[j].w;
      }
    }
    for (int j = 0; j < RB; ++j) {
      const int row = r0 + j * ROW_STEP;
      if (row >= rows) break;
      const float inv = l[j] > 0.f ? 1.f / l[j] : 0.f;
      T* dst = out + (static_cast<size_t>(tok0 + row / GROUP) * H + kvh * GROUP + row % GROUP) * D;
      *reinterpret_cast<uint2*>(dst + 4 * c4) =
          make_uint2(Mma<T>::pack(acc[j].x * inv, acc[j].y * inv),
                     Mma<T>::pack(acc[j].z * inv, acc[j].w * inv));
    }
  }
  if (tid == 0) counter[0] = counter[1] = 0;  // ready for the plan's next launch
"""
ATTENTION_SOURCE = _MMA_SYNC_MAIN + ONLINE_SOFTMAX + RESCALE_O + _MMA_SYNC_PV + SPLIT_EPILOGUE

_SOURCE_HASH = source_hash(HEADER, ATTENTION_SOURCE)
# Prefill-heavy forwards take 128-row tiles (each K/V tile feeds 128 rows: half the L2 traffic
# per FLOP of 64-row tiles) when they still give at least this many threadblocks; decode
# batches and short suffixes keep 64-row tiles (more, smaller blocks in flight per SM).
MIN_TILES_FOR_BLOCK_M_128 = 118  # ~0.9 x NUM_SMS: 128-row blocks run one per SM
# Rows per warp of 128-row tiles: 32 (four warps, each two m16 tiles against every K/V fragment
# it loads) or 16 (eight warps); 64-row tiles keep 16 (decode rows fill few of them). Measured
# at D=128 only (H200, bench/chained_attention.py: 0.80x the time at Lq=4096, 1.01-1.07x at
# Lq=512): other head dims keep 16.
WARP_M_128 = 32
WARP_M_128_HEAD_DIMS = (128,)
# Split KV into about SPLIT_ITEMS_PER_SM items per SM, a tile of n kv tiles into ceil(n / chunk)
# balanced parts, chunk = max(SPLIT_MIN_KV_TILES, the even share): parts of 4-8 tiles or more.
# A split's fp32 partial (32 KB at 64 rows, D=128) costs as much traffic as two K/V tiles
# read; measured on the H200 (Nsight Compute, H=32, Hkv=8, Lq=16 and 64, C=1024..16384),
# chunk >= 8 at one item per SM took 0.42-0.98x the GPU time of 2-tile chunks at two
# per SM, except C=16384, Lq=64 (1.03-1.06x).
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


def qk_scale_bits(scale: float) -> int:
    """The float32 bits of scale * log2(e) as an int: the kernel's template constant. (MLX's
    CUDA allocator keeps arrays of at most 8 bytes in a read-mostly managed pool; each
    threadblock's read of a one-float scale array there took 2-15 us on the H200, where a
    whole launch over 32 decode rows with nothing cached now takes 4 us.)"""
    if not scale_compiles(scale):
        raise ValueError(f"scale: expected a positive finite float, got {scale!r}")
    return int(np.array(scale * LOG2E, dtype=np.float32).view(np.int32))


def choose_block_m(num_tokens: int, group: int, num_kv_heads: int) -> int:
    # full 128-row tiles' worth of rows: decode rows (group rows a sequence) barely count
    tiles = num_tokens * group // 128 * num_kv_heads
    return 128 if tiles >= MIN_TILES_FOR_BLOCK_M_128 else 64


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

    def __init__(self, cuda_kernel=None):
        super().__init__(cuda_kernel or mx.fast.cuda_kernel)

    def tile_rows(self, geometry: Geometry) -> tuple[int, ...]:
        return (64, 128)

    def split_min_kv_tiles_for(self, geometry: Geometry) -> int:
        """The fewest kv tiles a split part of this geometry's kernel takes."""
        return SPLIT_MIN_KV_TILES

    def unsupported_reason(self, geometry: Geometry) -> str | None:
        return scale_reason(geometry.scale) or super().unsupported_reason(geometry)

    def plan(self, lengths: Lengths, geometry: Geometry, block_tables: mx.array, seqs=None,
             block_m: int | None = None) -> CudaAttentionPlan:
        """`block_m`: one of `tile_rows`; None chooses by the batch's size."""
        refuse_unsupported(self, geometry)
        seqs = lengths.seqs(seqs)
        g = geometry
        block_m = self._block_m(block_m, g) or choose_block_m(lengths.tokens_of(seqs), g.group,
                                                               g.num_kv_heads)
        # 128-row plans are chosen only when they fill the GPU: never split them
        tiles = tile_plan.build_tile_plan(lengths.cu_seqlens_q, lengths.seq_lens, g.group,
                                          g.num_kv_heads, block_m, BLOCK_N, NUM_SMS,
                                          ctas_per_sm=SPLIT_ITEMS_PER_SM,
                                          min_chunk=self.split_min_kv_tiles_for(g),
                                          min_items=0 if block_m == 128 else None,
                                          seqs=np.asarray(seqs))
        sets = COUNTER_SETS if tiles.num_slots else 1  # unsplit: counters never read
        counters = tuple(mx.zeros((max(2 * tiles.num_tiles, MIN_WORDS),), dtype=mx.int32)
                         for _ in range(sets))
        warp_m = WARP_M_128 if block_m == 128 and g.head_dim in WARP_M_128_HEAD_DIMS else 16
        threads = 32 * block_m // warp_m
        slots = max(tiles.num_slots, 1)  # outputs cannot be empty; unused when nothing is split
        launch = dict(
            template=[("T", g.dtype), ("HEAD_DIM", g.head_dim), ("GROUP", g.group),
                      ("BLOCK_M", block_m), ("WARP_M", warp_m), ("STAGES", STAGES),
                      ("BS", g.block_size), ("QK_SCALE_BITS", qk_scale_bits(g.scale))],
            grid=(tiles.num_items * threads, 1, 1),
            threadgroup=(threads, 1, 1),
            output_shapes=[(lengths.num_tokens, g.num_heads, g.head_dim),
                           (slots, block_m, g.head_dim), (slots, block_m)],
            output_dtypes=[g.dtype, mx.float32, mx.float32])
        return CudaAttentionPlan(g, lengths, block_tables, seqs, block_m=block_m, warp_m=warp_m,
                                 tiles=tiles, order=LaunchOrder(counters), launch=launch)

    def _kernel(self, g: Geometry, block_m: int, warp_m: int):
        key = (g.dtype, g.head_dim, g.group, g.block_size, block_m, warp_m)
        if key not in self._kernels:
            variant = (f"{dtype_name(g.dtype)}_d{g.head_dim}_g{g.group}_b{g.block_size}"
                       f"_m{block_m}_w{warp_m}_s{STAGES}")
            q_smem = block_m * (g.head_dim + PAD) * 2 if warp_m > 16 else 0  # else in a stage
            self._kernels[key] = self._factory(
                name=f"paged_prefill_{_SOURCE_HASH}_{variant}",
                input_names=["q", "k_cache", "v_cache", "block_tables", "work", "counters",
                             "after"],
                output_names=["out", "o_part", "lse_part"],
                source=ATTENTION_SOURCE,
                header=HEADER,
                # K and V per stage, 2-byte elements: 69.6 KB at D=128, 2 stages (> 48 KB
                # default), and Q's own 34.8 KB at 128 rows of 32-row warps
                shared_memory=2 * STAGES * BLOCK_N * (g.head_dim + PAD) * 2 + q_smem,
            )
        return self._kernels[key]

    def launch(self, q: mx.array, k_cache: mx.array, v_cache: mx.array,
               plan: CudaAttentionPlan) -> mx.array:
        counters, after = plan.order.take()
        out, _, lse_part = self._kernel(plan.geometry, plan.block_m, plan.warp_m)(
            inputs=[q, k_cache, v_cache, plan.block_tables, plan.tiles.work, counters, after],
            **plan.launch)
        if plan.tiles.num_slots:  # only split tiles count arrivals
            plan.order.ran(lse_part)
        return out
