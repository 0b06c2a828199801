"""CUDA paged-prefill attention on Hopper tensor cores (wgmma, sm_90a), through NVRTC and
`mx.fast.precompiled_cuda_kernel`.

Same contract, plan, work list, split-KV merge and launch order as `cuda_paged_attention` (it
subclasses it); only the tile products differ. A threadblock is one warpgroup (four warps, 64
query rows); S = Q K^T and O += P V are warpgroup MMAs reading K and V straight from shared
memory (`wgmma.mma_async` m64n64k16 and m64n128k16), where the mma.sync kernel has every warp
load every K/V fragment through `ldmatrix` for its own 16 rows: a quarter of the shared-memory
traffic per product. Q and P stay in registers as the A operand (the m16n8k16 fragment layout,
so the online softmax and the epilogue are the mma.sync kernel's own source).

K/V tiles land through cp.async (paged: every 16-byte chunk resolves its page) in the 128-byte
swizzled layout wgmma reads: a tile [BLOCK_N keys][D] is stored as D / 64 column blocks of
[BLOCK_N][64], 16-byte chunk c of key row r at chunk c ^ (r % 8). K is the B operand K-major
(keys are its N), V the B operand N-major (transposed: keys are its K).

`mx.fast.cuda_kernel` compiles for sm_90, which has no wgmma, so the source is compiled for
sm_90a by NVRTC (`nvrtc.py`) once per variant and launched as a cubin. MLX copies and hashes a
precompiled kernel's bytes on every call (~0.25 us per KB on the H200; this cubin is ~58 KB), so
a call costs ~10 us more host time than the mma.sync kernel's (docs/gpu.md).
"""

from __future__ import annotations

import mlx.core as mx

from . import cuda_paged_attention as cpa
from . import nvrtc
from .geometry import Geometry, Lengths, dtype_name
from .sources import source_hash

ARCH = "sm_90a"
BLOCK_M = 64  # one warpgroup: four warps of 16 rows
THREADS = 128
WGMMA_HEAD_DIMS = (128,)  # others run the mma.sync kernel's variants
# 168 registers a thread: three blocks per SM (two: 204). No spills, but 24 bytes at group 1,
# block 8 (one value kept across the key loop, read back in the split epilogue: nvcc 13.0)
MIN_BLOCKS_PER_SM = 3
STAGES = 2  # K/V tiles in flight + 1; 3 measured no faster, 4 fits one block per SM
# Split KV in parts of at least 9 kv tiles, where the mma.sync kernel takes 8 (see there): a
# split's fp32 partial is stored and read back. H200, us a call on the GPU alone, 20 calls at
# once (the sweep's measure) / one after another (chained), over the ceiling's (cuDNN on
# contiguous K/V), 8 against 9 (docs/h200/split_chunk.json): C1024_Lq64 1.08 / 0.86 against
# 1.02 / 0.99, C2048_Lq64 1.11 / 0.70 against 1.06 / 0.69, C512_Lq64 1.08 / 0.99 against
# 0.79 / 1.04, C1024_Lq16 0.55 / 0.83 against 0.56 / 0.94; the same at C4096 and C16384 (the
# even share of 132 items is the larger chunk there). Fewer, longer parts cost a lone call's
# latency at C <= 1024 (still at or under the ceiling's) and buy throughput wherever launches
# overlap.
SPLIT_MIN_KV_TILES = 9


def _wgmma(n: int) -> str:
    """`wgmma_n{n}<TRANS_B>(d, a, accumulate, b_desc)`: d[n / 2] (+)= A (64 x 16, registers) B
    (16 x n, shared memory); `accumulate` false overwrites d; TRANS_B 1: B is N-major."""
    regs = n // 2
    d = ", ".join(f"%{i}" for i in range(regs))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(regs))
    return f"""
template <int TRANS_B> __device__ __forceinline__ void wgmma_n{n}(float* d, const uint32_t* a,
                                                                bool accumulate, uint64_t b) {{
  asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{regs + 5}, 0;\\n"
               "wgmma.mma_async.sync.aligned.m64n{n}k16.f32." AB "." AB " "
               "{{{d}}}, {{%{regs}, %{regs + 1}, %{regs + 2}, %{regs + 3}}}, %{regs + 4}, p, 1, 1, "
               "%{regs + 6};\\n}}\\n"
               : {outs}
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(int(accumulate)),
                 "n"(TRANS_B));
}}"""


# NVRTC sees no headers: the few types and constants the sources use are declared here.
PRELUDE = r"""
typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif
"""

HEADER = cpa.COLUMNS + cpa.DEVICE_HELPERS + r"""
// two floats -> two 16-bit floats in one register, x in the low half (the A-fragment order)
template <typename X> struct Mma {
  static __device__ __forceinline__ uint32_t pack(float x, float y) {
    uint32_t r;
    asm("cvt.rn." AB "x2.f32 %0, %2, %1;\n" : "=r"(r) : "f"(x), "f"(y));
    return r;
  }
};
__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}
// cp.async wrote the tiles through the generic proxy; wgmma reads them through the async proxy
__device__ __forceinline__ void fence_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// keeps the compiler from touching accumulators between a wgmma's issue and its wait
__device__ __forceinline__ void pin(float& x) { asm volatile("" : "+f"(x) :: "memory"); }
// shared-memory matrix descriptor, 128-byte swizzle: start, leading and stride byte offsets
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t lead, uint32_t stride) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) |
         static_cast<uint64_t>((lead & 0x3FFFF) >> 4) << 16 |
         static_cast<uint64_t>((stride & 0x3FFFF) >> 4) << 32 | 1ull << 62;
}
""" + _wgmma(cpa.BLOCK_N) + _wgmma(128)

# Q as the A operand and the running softmax state of rows row_lo and row_lo + 8 of a warp (the
# m16n8k16 layout; padding rows are zero), P packed from a tile's probabilities (into p, which
# PACK_P declares), and O += P V from the V tile at v_t (PV_ISSUE only issues it); the
# warp-specialized prefill kernel (hopper_prefill_attention.py) takes them too.
Q_AND_STATE = r"""
  uint32_t qf[KSTEPS][4];
  for (int i = 0; i < 2; ++i) {
    const int row = row_lo + 8 * i;
    const bool ok = row < rows;
    const T* src = q + (static_cast<size_t>(tok0 + (ok ? row : 0) / GROUP) * H + kvh * GROUP +
                        (ok ? row : 0) % GROUP) * D + (lane % 4) * 2;
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks) {
      qf[ks][i] = ok ? *reinterpret_cast<const uint32_t*>(src + ks * 16) : 0u;
      qf[ks][2 + i] = ok ? *reinterpret_cast<const uint32_t*>(src + ks * 16 + 8) : 0u;
    }
  }

  float o[MT][DTILES][4] = {};
  float m_run[MT][2], l_run[MT][2];
  int pos_row[MT][2];
  for (int i = 0; i < 2; ++i) {
    m_run[0][i] = -INFINITY;
    l_run[0][i] = 0.f;
    pos_row[0][i] = pos0 + (row_lo + 8 * i) / GROUP;
  }
  const int mask_from = min(pos0 + 1, kv_end);
"""
P_FROM_S = r"""#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
      p[kk][0] = Mma<T>::pack(s[0][2 * kk][0], s[0][2 * kk][1]);
      p[kk][1] = Mma<T>::pack(s[0][2 * kk][2], s[0][2 * kk][3]);
      p[kk][2] = Mma<T>::pack(s[0][2 * kk + 1][0], s[0][2 * kk + 1][1]);
      p[kk][3] = Mma<T>::pack(s[0][2 * kk + 1][2], s[0][2 * kk + 1][3]);
    }
"""
PACK_P = "\n    uint32_t p[BLOCK_N / 16][4];  // P as the A operand, 16 keys per k-step\n" + P_FROM_S


def pv_issue(layout: str, descriptor: str) -> str:
    """O += P V from the V tile at v_t, issued and not waited on: per 16 keys an m64n128k16
    wgmma, its N-major B at `descriptor` (of kk, the k-step) for the tile's `layout`."""
    return (r"""#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk)  // N-major B: """ + layout + r"""
      wgmma_n128<1>(&o[0][0][0], p[kk], true,
                    """ + descriptor + r""");
    wgmma_commit();
""")


PV_ISSUE = pv_issue("64-column blocks HALF apart",
                    "smem_desc(v_t + kk * 2 * GROUP_BYTES, HALF * 2, GROUP_BYTES)")
PIN_O = r"""    for (int dt = 0; dt < DTILES; ++dt)
      for (int e = 0; e < 4; ++e) pin(o[0][dt][e]);
"""
PV_PRODUCT = "    wgmma_fence();\n" + PV_ISSUE + "    wgmma_wait();\n" + PIN_O


def s_issue(width: int) -> str:
    """S = Q K^T of the K tile at k_t into s, issued and not waited on: m64n{width}k16 wgmmas."""
    return (r"""    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks)  // K-major B: rows of 128 bytes, 8-row atoms
      wgmma_n""" + str(width) + r"""<0>(&s[0][0][0], qf[ks], ks > 0,
          smem_desc(k_t + (ks / 4) * HALF * 2 + (ks % 4) * 32, 16, GROUP_BYTES));
    wgmma_commit();
""")

# Inputs, outputs, grid: as cuda_paged_attention's ATTENTION_SOURCE (BLOCK_M = 64, WARP_M = 16,
# 128 threads), then the scalars H (query heads) and MAX_BLOCKS (block_tables' width).
# Compile-time: T (16-bit storage), AB ("bf16" / "f16"), HEAD_DIM, GROUP, BS, QK_SCALE_BITS, STAGES,
# BLOCK_M (64) and NUM_THREADS (128: one warpgroup).
# Smem (1024-byte aligned): STAGES x [K tile][V tile], each [HEAD_DIM / 64][BLOCK_N][64] swizzled.
# Pipeline: STAGES - 1 K/V tiles in flight; per tile one barrier, then S by HEAD_DIM / 16
# m64nBLOCK_Nk16 wgmmas (K-major B; the first overwrites S), the next tile's loads issued while
# they run (a table entry per load pass of ROWS_PER_PASS keys), the softmax in registers, and O
# by BLOCK_N / 16 m64n128k16 wgmmas (N-major B: V transposed by the descriptor).
ATTENTION_SOURCE = r"""
  constexpr int D = HEAD_DIM, CHUNKS = D / 8, KSTEPS = D / 16, DTILES = D / 8, NTILES = BLOCK_N / 8;
  constexpr int MT = 1, ROWS_PER_PASS = NUM_THREADS / CHUNKS;
  constexpr int GROUP_BYTES = 8 * 128;   // a swizzle atom: 8 rows of 128 bytes
  constexpr int HALF = BLOCK_N * 64, TILE = BLOCK_N * D;  // elements: a 64-column block, a tile
  constexpr int STAGE_BYTES = 2 * STAGES * TILE * 2;
  static_assert(D % 64 == 0, "whole 128-byte swizzle rows");
  // a key tile starts a page (KV_START is a multiple of BLOCK_N); a load pass stays in one page
  static_assert(BLOCK_N % BS == 0 && BS % ROWS_PER_PASS == 0, "pages and load passes nest");
  extern __shared__ __align__(16) unsigned char smem[];
  // swizzle atoms start on 1024-byte boundaries (the launch asks for 1024 bytes of slack)
  T* sK = reinterpret_cast<T*>(smem + ((1024 - (smem_addr(smem) & 1023)) & 1023));

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int* item = work + static_cast<size_t>(blockIdx.x) * WORK_COLS;
  const int seq = item[W_SEQ], tok0 = item[W_TOK0], ntok = item[W_NTOK], pos0 = item[W_POS0];
  const int kvh = item[W_KV_HEAD], kv_start = item[W_KV_START], kv_end = item[W_KV_END];
  const int slot = item[W_SLOT];
  const int HKV = H / GROUP;
  const T* kc = reinterpret_cast<const T*>(k_cache);  // caches may come as stored words
  const T* vc = reinterpret_cast<const T*>(v_cache);
  const int rows = ntok * GROUP;
  const float scale_log2 = __int_as_float(QK_SCALE_BITS);
  const bool warp_active = true;  // a warpgroup MMA takes all four warps, padding rows too

  const int ch = tid % CHUNKS;
  const int* table = block_tables + static_cast<size_t>(seq) * MAX_BLOCKS;
  const size_t row_stride = static_cast<size_t>(HKV) * D;
  const size_t page_stride = row_stride * BS;
  const size_t head_off = static_cast<size_t>(kvh) * D + ch * 8;
  // swizzled smem offset of this thread's chunk in key row r of a tile
  auto chunk_at = [&](int r) { return (ch / 8) * HALF + r * 64 + ((ch % 8) ^ (r % 8)) * 8; };
  auto load_kv = [&](int n0, int buf) {
#pragma unroll
    for (int pass = 0; pass < BLOCK_N / ROWS_PER_PASS; ++pass) {
      const int r = tid / CHUNKS + pass * ROWS_PER_PASS, key = n0 + r;
      const bool ok = key < kv_end;
      // a pass's rows share one page: one broadcast table load. With the loads issued behind
      // the S wgmma, fewer instructions where three blocks share an SM: 0.95-0.96x the time of
      // 20 calls at once at long suffixes (H200), but 1.03-1.06x one call at a time at Lq=16
      // over a cached prefix, whose short splits wait on each tile's loads (docs/gpu.md).
      const int first = n0 + pass * ROWS_PER_PASS;
      const size_t off =
          static_cast<size_t>(table[(first < kv_end ? first : kv_start) / BS]) * page_stride +
          static_cast<size_t>(first % BS + tid / CHUNKS) * row_stride + head_off;
      const int s = 2 * buf * TILE + chunk_at(r);
      cp_async16(smem_addr(sK + s), kc + off, ok);
      cp_async16(smem_addr(sK + s + TILE), vc + off, ok);
    }
  };
  const int num_tiles = (kv_end - kv_start + BLOCK_N - 1) / BLOCK_N;
  for (int t = 0; t < STAGES - 1; ++t) {
    if (t < num_tiles) load_kv(kv_start + t * BLOCK_N, t);
    cp_async_commit();
  }

  // Q fragments straight from global memory (the m16n8k16 A layout; padding rows are zero)
  const int row_lo = warp * 16 + lane / 4;""" + Q_AND_STATE + r"""
  for (int t = 0; t < num_tiles; ++t) {
    const int n0 = kv_start + t * BLOCK_N, buf = t % STAGES;
    cp_async_wait<STAGES - 2>();  // tile t has landed (this thread's part) ...
    fence_async_smem();           // ... visible to the tensor cores ...
    __syncthreads();              // ... every thread's part; tile t - 1 read by every warp
    const uint32_t k_t = smem_addr(sK + 2 * buf * TILE), v_t = k_t + TILE * 2;

    float s[MT][NTILES][4];
""" + s_issue(cpa.BLOCK_N) + r"""    // the next tile's loads issue while the tensor cores work on S
    const int next = t + STAGES - 1;
    if (next < num_tiles) load_kv(kv_start + next * BLOCK_N, next % STAGES);
    cp_async_commit();
    wgmma_wait();
    for (int nt = 0; nt < NTILES; ++nt)
      for (int e = 0; e < 4; ++e) pin(s[0][nt][e]);
""" + cpa.ONLINE_SOFTMAX + cpa.RESCALE_O + PACK_P + PV_PRODUCT + r"""  }
""" + cpa.SPLIT_EPILOGUE

_SOURCE_HASH = source_hash(PRELUDE, HEADER, ATTENTION_SOURCE,
                                   f"{ARCH} {THREADS} {MIN_BLOCKS_PER_SM} {STAGES}")
INPUTS = ("q", "k_cache", "v_cache", "block_tables", "work", "counters", "after")
OUTPUTS = ("out", "o_part", "lse_part")


def kernel_source(name: str, g: Geometry) -> str:
    """The whole translation unit of one variant: constants, helpers, the extern "C" kernel."""
    ab = "bf16" if g.dtype == mx.bfloat16 else "f16"
    params = ", ".join([f"const {'T' if n in ('q', 'k_cache', 'v_cache') else 'int'}* {n}"
                        for n in INPUTS] +
                       [f"{'T' if n == 'out' else 'float'}* {n}" for n in OUTPUTS] +
                       ["int H", "int MAX_BLOCKS"])
    constants = (f"typedef unsigned short T;\n#define AB \"{ab}\"\n"
                 f"constexpr int HEAD_DIM = {g.head_dim}, GROUP = {g.group}, BS = {g.block_size}, "
                 f"STAGES = {STAGES}, QK_SCALE_BITS = {cpa.qk_scale_bits(g.scale)}, "
                 f"BLOCK_M = {BLOCK_M}, NUM_THREADS = {THREADS};\n")
    return (PRELUDE + constants + HEADER +
            f'extern "C" __global__ void __launch_bounds__({THREADS}, {MIN_BLOCKS_PER_SM}) '
            f'{name}({params}) {{\n' +
            ATTENTION_SOURCE + "}\n")


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
    at every point up to Lq = 512, docs/gpu.md); other head dims keep the mma.sync kernel and
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
             block_m: int | None = None) -> cpa.CudaAttentionPlan:
        if block_m is None and self.uses_wgmma(geometry):
            block_m = BLOCK_M  # the parent checks a caller's height against tile_rows
        return super().plan(lengths, geometry, block_tables, seqs=seqs, block_m=block_m)

    def _kernel(self, g: Geometry, block_m: int, warp_m: int):
        if not self.uses_wgmma(g):
            return super()._kernel(g, block_m, warp_m)
        bits = cpa.qk_scale_bits(g.scale)
        key = ("wgmma", g.dtype, g.head_dim, g.group, g.block_size, bits)
        if key not in self._kernels:
            name = (f"paged_prefill_wgmma_{_SOURCE_HASH}_{dtype_name(g.dtype)}"
                    f"_d{g.head_dim}_g{g.group}_b{g.block_size}_q{bits:x}")
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
