"""CUDA paged-prefill attention through `mx.fast.cuda_kernel` (tensor-core mma.sync, sm_80+).

Contract: `paged_prefix.contract`. One launch serves prefill and decode rows of every sequence;
K/V are read from the paged cache through the block table (no gather copy). Host planning
(tile work list, split-KV) lives in `schedule.py` and is built once per forward.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

import mlx.core as mx

from paged_prefix.contract import check_attention_inputs
from paged_prefix.metadata import AttentionMetadata

from . import schedule, support

BLOCK_M = 64  # query rows per threadblock: (token, head-in-group) pairs, 16 per warp
BLOCK_N = 64  # keys per K/V tile
NUM_THREADS = 128  # 4 warps
HEAD_DIMS = (64, 128)
NUM_SMS = 132  # H100/H200 SXM; MLX does not report the SM count
PAD = 8  # smem row padding (elements): 16 bytes shift each row by 4 banks for ldmatrix

HEADER = r"""
// Tile constants (see cuda_paged_attention.py): BLOCK_M query rows x BLOCK_N keys per step,
// 4 warps of 16 rows each; smem rows are padded by PAD elements.
constexpr int BLOCK_M = 64, BLOCK_N = 64, NUM_THREADS = 128, PAD = 8;
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
__device__ __forceinline__ void cp_async_wait_1() { asm volatile("cp.async.wait_group 1;\n"); }
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
#          params int32 [H, Hkv, log2(block_size), max_blocks]; scale float32 [1].
# Outputs: out [T, H, D] T (items with SLOT < 0);
#          o_part [slots, BLOCK_M, D] float32, lse_part [slots, BLOCK_M] float32 (SLOT >= 0):
#          per-split output normalised by its own row sum, and its log2-sum-exp (-inf: no key).
# Grid: one threadblock of NUM_THREADS per work item. Template: T, HEAD_DIM, GROUP.
# Smem: K and V tiles, double-buffered, [2][BLOCK_N][HEAD_DIM + PAD] each; Q passes through
# K buffer 1 on its way to registers.
ATTENTION_SOURCE = r"""
  constexpr int D = HEAD_DIM, LD = D + PAD, CHUNKS = D / 8;   // 16-byte chunks per row
  constexpr int KSTEPS = D / 16, DTILES = D / 8, NTILES = BLOCK_N / 8;
  constexpr int ROWS_PER_PASS = NUM_THREADS / CHUNKS;
  extern __shared__ __align__(16) unsigned char smem[];
  T* sK = reinterpret_cast<T*>(smem);          // [2][BLOCK_N][LD]
  T* sV = sK + 2 * BLOCK_N * LD;               // [2][BLOCK_N][LD]
  T* sQ = sK + BLOCK_N * LD;                   // [BLOCK_M][LD], aliases K buffer 1

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int* item = work + static_cast<size_t>(blockIdx.x) * WORK_COLS;
  const int seq = item[0], tok0 = item[1], ntok = item[2], pos0 = item[3], kvh = item[4];
  const int kv_start = item[5], kv_end = item[6], slot = item[7];
  const int H = params[0], HKV = params[1], BS_LOG2 = params[2], MAX_BLOCKS = params[3];
  const int rows = ntok * GROUP;
  const float scale_log2 = scale[0] * 1.4426950408889634f;  // softmax in base 2

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
      const int s = (buf * BLOCK_N + r) * LD + ch * 8;
      cp_async16(smem_addr(sK + s), k_cache + off, ok);
      cp_async16(smem_addr(sV + s), v_cache + off, ok);
    }
  };
  load_kv(kv_start, 0);
  cp_async_commit();
  cp_async_wait_1();  // Q has landed
  __syncthreads();

  // Q fragments stay in registers (A operand of S = Q K^T)
  const bool warp_active = warp * 16 < rows;  // warp-uniform: padding warps only load
  uint32_t qf[KSTEPS][4];
  for (int ks = 0; ks < KSTEPS; ++ks)
    ldsm_x4(smem_addr(sQ + (warp * 16 + lane % 16) * LD + ks * 16 + (lane / 16) * 8), qf[ks]);
  __syncthreads();  // K buffer 1 is free for the first prefetch

  float o[DTILES][4] = {};
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};
  const int row_lo = warp * 16 + lane / 4;  // this thread's rows: row_lo and row_lo + 8
  const int pos_row[2] = {pos0 + row_lo / GROUP, pos0 + (row_lo + 8) / GROUP};
  // keys < mask_from are visible to every row of the tile: those tiles skip the mask
  const int mask_from = min(pos0 + 1, kv_end);
  const int num_tiles = (kv_end - kv_start + BLOCK_N - 1) / BLOCK_N;

  for (int t = 0; t < num_tiles; ++t) {
    const int n0 = kv_start + t * BLOCK_N, buf = t & 1;
    if (t + 1 < num_tiles) load_kv(n0 + BLOCK_N, buf ^ 1);
    cp_async_commit();
    cp_async_wait_1();  // tile t has landed
    __syncthreads();
    if (warp_active) {
      const T* k_t = sK + buf * BLOCK_N * LD;
      const T* v_t = sV + buf * BLOCK_N * LD;
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
        const float alpha = exp2f(m_run[i] * scale_log2 - base);
        m_run[i] = mx;
        float sum = 0.f;
        for (int nt = 0; nt < NTILES; ++nt)
          for (int e = 2 * i; e < 2 * i + 2; ++e) {
            s[nt][e] = exp2f(fmaf(s[nt][e], scale_log2, -base));
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
    __syncthreads();  // buffer `buf` is refilled by the next iteration's prefetch
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
# Grid: one threadblock of NUM_THREADS per split tile; a warp per row, D / 32 columns a lane.
MERGE_SOURCE = r"""
  constexpr int D = HEAD_DIM, PER_LANE = D / 32;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int* item = merge + static_cast<size_t>(blockIdx.x) * MERGE_COLS;
  const int tok0 = item[0], ntok = item[1], kvh = item[2], first = item[3], nsplit = item[4];
  const int H = params[0];
  for (int row = warp; row < ntok * GROUP; row += NUM_THREADS / 32) {
    float top = -INFINITY;
    for (int s = 0; s < nsplit; ++s)
      top = fmaxf(top, lse_part[static_cast<size_t>(first + s) * BLOCK_M + row]);
    const float base = top == -INFINITY ? 0.f : top;
    float acc[PER_LANE] = {}, sum = 0.f;
    for (int s = 0; s < nsplit; ++s) {
      const size_t r = static_cast<size_t>(first + s) * BLOCK_M + row;
      const float w = exp2f(lse_part[r] - base);
      sum += w;
      for (int j = 0; j < PER_LANE; ++j) acc[j] += w * o_part[r * D + lane * PER_LANE + j];
    }
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    T* dst = out + (static_cast<size_t>(tok0 + row / GROUP) * H + kvh * GROUP + row % GROUP) * D;
    for (int j = 0; j < PER_LANE; ++j) dst[lane * PER_LANE + j] = static_cast<T>(acc[j] * inv);
  }
"""

_SOURCE_HASH = hashlib.sha1((HEADER + ATTENTION_SOURCE + MERGE_SOURCE).encode()).hexdigest()[:10]


def _smem_bytes(head_dim: int) -> int:
    return 4 * BLOCK_N * (head_dim + PAD) * 2  # K, V x double buffer, 2-byte elements


@functools.cache
def _attention_kernel(dtype: mx.Dtype, head_dim: int, group: int):
    variant = f"{str(dtype).split('.')[-1]}_d{head_dim}_g{group}"
    return mx.fast.cuda_kernel(
        name=f"paged_prefill_{_SOURCE_HASH}_{variant}",
        input_names=["q", "k_cache", "v_cache", "block_tables", "work", "params", "scale"],
        output_names=["out", "o_part", "lse_part"],
        source=ATTENTION_SOURCE,
        header=HEADER,
        shared_memory=_smem_bytes(head_dim),  # 69.6 KB at D=128: above the 48 KB default
    )


@functools.cache
def _merge_kernel(dtype: mx.Dtype, head_dim: int, group: int):
    variant = f"{str(dtype).split('.')[-1]}_d{head_dim}_g{group}"
    return mx.fast.cuda_kernel(
        name=f"paged_merge_{_SOURCE_HASH}_{variant}",
        input_names=["o_part", "lse_part", "merge", "params"],
        output_names=["out"],
        source=MERGE_SOURCE,
        header=HEADER,
    )


@dataclass(frozen=True)
class _Launch:
    plan: schedule.TilePlan
    params: mx.array  # int32 [H, Hkv, log2(block_size), max_blocks]


def _launch_plan(meta: AttentionMetadata, num_heads: int, num_kv_heads: int) -> _Launch:
    group = num_heads // num_kv_heads

    def build(m: AttentionMetadata) -> _Launch:
        plan = schedule.build_tile_plan(m, group, num_kv_heads, BLOCK_M, BLOCK_N, NUM_SMS)
        params = [num_heads, num_kv_heads, m.block_size.bit_length() - 1,
                  m.block_tables_host.shape[1]]
        return _Launch(plan, mx.array(params, dtype=mx.int32))

    return meta.plan(f"cuda_paged:{BLOCK_M}x{BLOCK_N}:h{num_heads}:hkv{num_kv_heads}", build)


def unsupported_reason(q: mx.array, k_cache: mx.array, meta: AttentionMetadata) -> str | None:
    if not mx.cuda.is_available():
        return "no CUDA device"
    if q.ndim != 3 or k_cache.ndim != 4:
        return f"shapes q {q.shape} / k_cache {k_cache.shape} are not [T,H,D] / [N,B,Hkv,D]"
    return support.unsupported_reason(q, k_cache, HEAD_DIMS)


def reference_is_faster(q: mx.array, k_cache: mx.array, meta: AttentionMetadata) -> str | None:
    return None


def paged_attention(
    q: mx.array, k_cache: mx.array, v_cache: mx.array, meta: AttentionMetadata, scale: float
) -> mx.array:
    """The contract of `paged_prefix.contract` in one kernel launch (two when KV is split)."""
    check_attention_inputs(q, k_cache, v_cache, meta)
    why_not = unsupported_reason(q, k_cache, meta)
    if why_not:
        raise ValueError(f"cuda paged attention cannot run this call: {why_not}")
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    launch = _launch_plan(meta, num_heads, num_kv_heads)
    plan = launch.plan
    slots = max(plan.num_slots, 1)  # outputs cannot be empty; unused when nothing is split
    template = [("T", q.dtype), ("HEAD_DIM", head_dim), ("GROUP", group)]
    out, o_part, lse_part = _attention_kernel(q.dtype, head_dim, group)(
        inputs=[q, k_cache, v_cache, meta.block_tables, plan.work, launch.params,
                mx.array([scale], dtype=mx.float32)],
        template=template,
        grid=(plan.num_items * NUM_THREADS, 1, 1),
        threadgroup=(NUM_THREADS, 1, 1),
        output_shapes=[q.shape, (slots, BLOCK_M, head_dim), (slots, BLOCK_M)],
        output_dtypes=[q.dtype, mx.float32, mx.float32],
    )
    if plan.merge is None:
        return out
    return _merge_kernel(q.dtype, head_dim, group)(
        inputs=[o_part, lse_part, plan.merge, launch.params],
        template=template,
        grid=(plan.merge.shape[0] * NUM_THREADS, 1, 1),
        threadgroup=(NUM_THREADS, 1, 1),
        output_shapes=[q.shape],
        output_dtypes=[q.dtype],
    )[0]
