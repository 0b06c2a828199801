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
// thread; `accumulate` false overwrites d; TRANS_B 1: B is N-major.
template <int TRANS_B>
__device__ __forceinline__ void wgmma_n64(float* d, const uint32_t* a, bool accumulate, uint64_t b) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n64k16.f32." AB "." AB " "
               "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, "
               "%18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
               "{%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
                 "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]),
                 "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]),
                 "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
                 "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]),
                 "+f"(d[31])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(int(accumulate)),
                 "n"(TRANS_B));
}
template <int TRANS_B>
__device__ __forceinline__ void wgmma_n128(float* d, const uint32_t* a, bool accumulate, uint64_t b) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n128k16.f32." AB "." AB " "
               "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, "
               "%18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, "
               "%34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, "
               "%50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
               "{%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
                 "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]),
                 "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]),
                 "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
                 "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]),
                 "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]),
                 "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]),
                 "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
                 "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]),
                 "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]),
                 "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(int(accumulate)),
                 "n"(TRANS_B));
}

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
