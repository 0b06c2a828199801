// Tensor-core products of sm_80 and later: ldmatrix from padded shared memory and the
// m16n8k16 mma.sync (fp32 accumulate), for T = __nv_bfloat16 or __half.

__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t* r) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t addr, uint32_t* r) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// Mma<T>: the m16n8k16 tensor-core product, fp32 accumulate: c += a (16x16 row) * b (16x8 col),
// and pack: two floats as one register of the A operand, x in the low half. One specialization
// per 16-bit type; PTX names the type in the instructions.
template <typename T> struct Mma;
#define MMA_SYNC_OF(TYPE, PTX)                                                                     \
  template <> struct Mma<TYPE> {                                                                   \
    static __device__ __forceinline__ void run(float* c, const uint32_t* a, uint32_t b0,           \
                                               uint32_t b1) {                                      \
      asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." PTX "." PTX ".f32 "                    \
                   "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"                       \
                   : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                                \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));                \
    }                                                                                              \
    static __device__ __forceinline__ uint32_t pack(float x, float y) {                            \
      uint32_t r;                                                                                  \
      asm("cvt.rn." PTX "x2.f32 %0, %2, %1;\n" : "=r"(r) : "f"(x), "f"(y));                        \
      return r;                                                                                    \
    }                                                                                              \
  };
MMA_SYNC_OF(__nv_bfloat16, "bf16")
MMA_SYNC_OF(__half, "f16")
#undef MMA_SYNC_OF
