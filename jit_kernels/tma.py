"""Loading paged K/V with Hopper's tensor memory accelerator (TMA) from an MLX kernel.

A TMA load reads a box of a tensor through a tensor map: 128 bytes the driver encodes on the
host (`cuTensorMapEncodeTiled`), holding the tensor's device address. MLX hands a kernel its
arrays' addresses on the device only, so the host encodes templates with a placeholder address
and each threadblock patches the cache's address into its own copies (`tensormap.replace`,
sm_90a), publishes them to global memory with the proxy fence the TMA unit needs and loads
through them (`publish_maps`, `acquire_maps` in kernels/tma.cuh).

Two maps of a 16-bit cache [rows, Hkv, D] (D = 128), both in the 128-byte swizzle that wgmma
reads (16-byte chunk c of a 128-byte row r at c ^ r % 8):
- K: box (64 elements of D, one kv head, one page): a page's half of D, [BS][64];
- V: box (64, one page, both halves, one kv head): a whole page as [2][BS][64], one load where
  K's layout takes two (the loads bound the kernel by their count: one V box a page measured
  faster than two, docs/kernels.md).
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np

HALF = 64  # elements of D per box row: one 128-byte swizzle row of 16-bit elements
# cuda.h enums (CUDA 12/13). The loads copy bytes: 16-bit unsigned serves bf16 and fp16 alike.
UINT16, SWIZZLE_128B, L2_PROMOTION_128B = 1, 3, 2


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
