// Device helpers of every CUDA kernel here: shared-memory addresses, 16-byte async copies,
// the gpu-scope loads of the split merge, base-2 exponentials and reciprocals, rows of q and out.

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
// 1 / x; inf -> 0
__device__ __forceinline__ float fast_rcp(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
// Element offset of row r of a query tile in q or out [T, H, D]: the tile's rows are
// (token, head-in-group) pairs, r = GROUP * (token - tok0) + head - kvh * GROUP (plan.py).
template <int GROUP, int D>
__device__ __forceinline__ size_t row_offset(int tok0, int H, int kvh, int r) {
  return (static_cast<size_t>(tok0 + r / GROUP) * H + kvh * GROUP + r % GROUP) * D;
}
