// Hopper warpgroup MMAs (sm_90a): a warpgroup of four warps computes 64 rows at once, its A
// operand (Q, or P) in registers in the m16n8k16 fragment layout, its B operand (K, or V) read
// by the tensor cores from shared memory in the 128-byte swizzle through a descriptor.
// T is the 16-bit storage type; AB ("bf16" or "f16") names the operands' type to the
// instructions.
#include "common.cuh"

constexpr int GROUP_BYTES = 8 * 128;  // a swizzle atom: 8 rows of 128 bytes

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
// wait until at most N of the warpgroup's committed wgmma groups are still in flight
template <int N> __device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(N) : "memory");
}
// cp.async wrote the tiles through the generic proxy; wgmma reads them through the async proxy
__device__ __forceinline__ void fence_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// keeps the compiler from touching accumulators between a wgmma's issue and its wait
__device__ __forceinline__ void pin(float& x) { asm volatile("" : "+f"(x) :: "memory"); }
template <int N> __device__ __forceinline__ void pin(float (&acc)[1][N][4]) {
  for (int n = 0; n < N; ++n)
    for (int e = 0; e < 4; ++e) pin(acc[0][n][e]);
}
// shared-memory matrix descriptor, 128-byte swizzle: start, leading and stride byte offsets
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t lead, uint32_t stride) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) |
         static_cast<uint64_t>((lead & 0x3FFFF) >> 4) << 16 |
         static_cast<uint64_t>((stride & 0x3FFFF) >> 4) << 32 | 1ull << 62;
}

// d (+)= A (64 x 16, registers: a[4]) B (16 x N, shared memory at descriptor b), d[N / 2] a
// thread; `accumulate` false overwrites d; TRANS_B 1: B is N-major. WGMMA_N defines wgmma_n<N>
// for one N: the accumulators' placeholders D_REGS ("%0, .., %(N/2 - 1)") and operands D_OPS,
// then the placeholders of A's four registers, B's descriptor, `accumulate` and TRANS_B.
#define WGMMA_D8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), \
                    "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
#define WGMMA_D32(i) WGMMA_D8(i), WGMMA_D8(i + 8), WGMMA_D8(i + 16), WGMMA_D8(i + 24)
#define WGMMA_D64 WGMMA_D32(0), WGMMA_D32(32)
#define WGMMA_REGS_0_31 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
                        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, " \
                        "%30, %31"
#define WGMMA_REGS_0_63 WGMMA_REGS_0_31 ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, " \
                        "%42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, " \
                        "%56, %57, %58, %59, %60, %61, %62, %63"
#define WGMMA_N(N, D_REGS, D_OPS, A0, A1, A2, A3, B, ACC, TRANS)                                 \
  template <int TRANS_B>                                                                         \
  __device__ __forceinline__ void wgmma_n##N(float* d, const uint32_t* a, bool accumulate,       \
                                             uint64_t b) {                                       \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #ACC ", 0;\n"                              \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." AB "." AB " "                 \
                 "{" D_REGS "}, {%" #A0 ", %" #A1 ", %" #A2 ", %" #A3 "}, %" #B ", p, 1, 1, %"   \
                 #TRANS ";\n}\n"                                                                 \
                 : D_OPS                                                                         \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(int(accumulate)),     \
                   "n"(TRANS_B));                                                                \
  }
WGMMA_N(64, WGMMA_REGS_0_31, WGMMA_D32(0), 32, 33, 34, 35, 36, 37, 38)
WGMMA_N(128, WGMMA_REGS_0_63, WGMMA_D64, 64, 65, 66, 67, 68, 69, 70)
#undef WGMMA_N
#undef WGMMA_REGS_0_63
#undef WGMMA_REGS_0_31
#undef WGMMA_D64
#undef WGMMA_D32
#undef WGMMA_D8

// Q as the A operand of rows row_lo and row_lo + 8 of a tile (a warp's 16 rows), straight
// from global memory; padding rows (rows and past) are zero.
template <int GROUP, int KSTEPS, typename Q>
__device__ __forceinline__ void load_q_fragments(uint32_t (&qf)[KSTEPS][4], const Q* q, int tok0,
                                                 int H, int kvh, int row_lo, int rows, int lane) {
  for (int i = 0; i < 2; ++i) {
    const int row = row_lo + 8 * i;
    const bool ok = row < rows;
    const Q* src = q + (static_cast<size_t>(tok0 + (ok ? row : 0) / GROUP) * H + kvh * GROUP +
                        (ok ? row : 0) % GROUP) * (16 * KSTEPS) + (lane % 4) * 2;
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks) {
      qf[ks][i] = ok ? *reinterpret_cast<const uint32_t*>(src + ks * 16) : 0u;
      qf[ks][2 + i] = ok ? *reinterpret_cast<const uint32_t*>(src + ks * 16 + 8) : 0u;
    }
  }
}

// S = Q K^T of the K tile at shared address k_t into s, issued and not waited on: KSTEPS
// m64nKEYSk16 wgmmas (the first overwrites s), K the B operand K-major. The tile holds
// KEYS = 8 NTILES keys as [D / 64][KEYS][64], swizzled.
template <int NTILES, int KSTEPS>
__device__ __forceinline__ void s_issue(float (&s)[1][NTILES][4], const uint32_t (&qf)[KSTEPS][4],
                                        uint32_t k_t) {
  constexpr int KEYS = 8 * NTILES, HALF = KEYS * 64;  // HALF: elements of a 64-column block
  static_assert(KEYS == 64 || KEYS == 128, "wgmma_n64 or wgmma_n128");
  wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < KSTEPS; ++ks) {  // K-major B: rows of 128 bytes, 8-row atoms
    const uint64_t k_desc = smem_desc(k_t + (ks / 4) * HALF * 2 + (ks % 4) * 32, 16, GROUP_BYTES);
    if constexpr (KEYS == 64)
      wgmma_n64<0>(&s[0][0][0], qf[ks], ks > 0, k_desc);
    else
      wgmma_n128<0>(&s[0][0][0], qf[ks], ks > 0, k_desc);
  }
  wgmma_commit();
}

// O += P V, issued and not waited on: per k-step kk (16 keys) an m64n128k16 wgmma, V the B
// operand N-major (transposed by its descriptor), v_desc(kk) the descriptor of its rows; the
// layout of V in shared memory is the caller's.
template <int KK, typename VDesc>
__device__ __forceinline__ void pv_issue(float (&o)[1][16][4], const uint32_t (&p)[KK][4],
                                         VDesc v_desc) {
#pragma unroll
  for (int kk = 0; kk < KK; ++kk) wgmma_n128<1>(&o[0][0][0], p[kk], true, v_desc(kk));
  wgmma_commit();
}
