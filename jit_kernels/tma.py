"""Loading paged K/V with Hopper's tensor memory accelerator (TMA) from an MLX kernel.

A TMA load reads a box of a tensor through a tensor map: 128 bytes the driver encodes on the
host (`cuTensorMapEncodeTiled`), holding the tensor's device address. MLX hands a kernel its
arrays' addresses on the device only, so the host encodes templates with a placeholder address
and each threadblock patches the cache's address into its own copies (`tensormap.replace`,
sm_90a), publishes them to global memory with the proxy fence the TMA unit needs and loads
through them (`publish_maps`, `acquire_maps`).

Two maps of a 16-bit cache [rows, Hkv, D] (D = 128), both in the 128-byte swizzle that wgmma
reads (16-byte chunk c of a 128-byte row r at c ^ r % 8):
- K: box (64 elements of D, one kv head, one page): a page's half of D, [BS][64];
- V: box (64, one page, both halves, one kv head): a whole page as [2][BS][64], one load where
  K's layout takes two (on the H200 the loads bound the kernel by their count: one V box a page
  took 0.94x the time of two at C16384_Lq512, docs/gpu.md).
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np

HALF = 64  # elements of D per box row: one 128-byte swizzle row of 16-bit elements
# cuda.h enums (CUDA 12/13). The loads copy bytes: 16-bit unsigned serves bf16 and fp16 alike.
UINT16, SWIZZLE_128B, L2_PROMOTION_128B = 1, 3, 2

# mbarriers, 3-d (K) and 4-d (V) box loads completing on one, and the block's own copies of
# tensor maps.
DEVICE = r"""
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
"""


@functools.cache
def _driver() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def _encode(dims: tuple[int, ...], strides: tuple[int, ...], box: tuple[int, ...]) -> np.ndarray:
    """One 16-bit tiled map, 128-byte swizzle; `strides` in bytes for dims 1 and up."""
    buf = ctypes.create_string_buffer(128 + 64)
    at = (ctypes.addressof(buf) + 63) // 64 * 64  # a CUtensorMap is 64-byte aligned
    u64, u32, rank = ctypes.c_uint64, ctypes.c_uint32, len(dims)
    status = _driver().cuTensorMapEncodeTiled(
        ctypes.c_void_p(at), ctypes.c_int(UINT16), u32(rank), ctypes.c_void_p(1 << 20),
        (u64 * rank)(*dims), (u64 * (rank - 1))(*strides), (u32 * rank)(*box),
        (u32 * rank)(*[1] * rank), ctypes.c_int(0), ctypes.c_int(SWIZZLE_128B),
        ctypes.c_int(L2_PROMOTION_128B), ctypes.c_int(0))
    if status:
        raise RuntimeError(f"cuTensorMapEncodeTiled: CUresult {status} for dims {dims}, "
                           f"box {box}")
    return np.frombuffer(ctypes.string_at(at, 128), dtype=np.uint8).copy()


def k_map(rows: int, block_size: int, kv_heads: int, head_dim: int = 128) -> np.ndarray:
    """The K map of a cache [rows, kv_heads, head_dim]: coordinates (d0, kv head, row)."""
    return _encode((head_dim, kv_heads, rows), (head_dim * 2, kv_heads * head_dim * 2),
                   (HALF, 1, block_size))


def v_map(rows: int, block_size: int, kv_heads: int, head_dim: int = 128) -> np.ndarray:
    """The V map: coordinates (0, row, half, kv head); a box lands as [2][block_size][64]."""
    return _encode((HALF, rows, head_dim // HALF, kv_heads),
                   (kv_heads * head_dim * 2, HALF * 2, head_dim * 2), (HALF, block_size, 2, 1))
