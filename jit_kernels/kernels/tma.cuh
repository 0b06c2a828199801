// Hopper's tensor memory accelerator (sm_90a): mbarriers, 3-d and 4-d box loads completing on
// one, and a threadblock's own copies of tensor maps (tma.py encodes their templates on the
// host; MLX hands a kernel its arrays' addresses on the device only, so each block patches
// the caches' addresses into its copies and publishes them for the TMA unit).
#include "common.cuh"

__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, int phase) {
  asm volatile("{\n.reg .pred done;\nWAIT_%=:\n"
               "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
               "@!done bra WAIT_%=;\n}\n" :: "r"(bar), "r"(phase) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_expect(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void tma_load(uint32_t dst, const void* map, int c0, int c1, int c2,
                                         uint32_t bar) {
  asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
               " [%0], [%1, {%2, %3, %4}], [%5];"
               :: "r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(bar) : "memory");
}
__device__ __forceinline__ void tma_load4(uint32_t dst, const void* map, int c0, int c1, int c2,
                                          int c3, uint32_t bar) {
  asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
               " [%0], [%1, {%2, %3, %4, %5}], [%6];"
               :: "r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar) : "memory");
}
// One whole warp (lane: its lane): template m of `tpl` (N x 128 bytes) copied to `staged`
// (shared, 128-byte aligned), the address bases[m] patched in and published to `published`
// (global, N x 128 bytes); the threads that load through them then call acquire_maps.
template <int N>
__device__ __forceinline__ void publish_maps(int lane, const unsigned char* tpl,
                                             const void* const (&bases)[N],
                                             unsigned char (*staged)[128],
                                             unsigned char* published) {
  for (int m = 0; m < N; ++m)
    reinterpret_cast<uint32_t*>(staged[m])[lane] =
        reinterpret_cast<const uint32_t*>(tpl + 128 * m)[lane];
  __syncwarp();
  if (lane == 0)
    for (int m = 0; m < N; ++m)
      asm volatile("tensormap.replace.tile.global_address.shared::cta.b1024.b64 [%0], %1;"
                   :: "r"(smem_addr(staged[m])), "l"(bases[m]) : "memory");
  __syncwarp();
  for (int m = 0; m < N; ++m)
    asm volatile("tensormap.cp_fenceproxy.global.shared::cta.tensormap::generic.release.gpu"
                 ".sync.aligned [%0], [%1], 128;" :: "l"(published + 128 * m),
                 "r"(smem_addr(staged[m])) : "memory");
}
// A thread, after publish_maps: the published maps made visible to its TMA loads.
template <int N>
__device__ __forceinline__ void acquire_maps(const unsigned char* published) {
  for (int m = 0; m < N; ++m)
    asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;"
                 :: "l"(published + 128 * m) : "memory");
}
