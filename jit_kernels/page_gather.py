"""Page gather: copy the pages of a batch into contiguous, head-major K/V in one launch.

    [(k, v), ...] = gather.launch(k_cache, v_cache, block_tables, plan)   # plan_gather(...) once
    k, v: [1, Hkv, L_i, D] contiguous, for sequence plan.seqs[i]

The caches may come in any dtype that holds the pages' bytes (the 4-byte words a
`PagedKVCache` stores, or [num_blocks, BS, Hkv, D] of the plan's dtype): the kernel copies
bytes, so a forward hands over its cache arrays as stored, with no view op per layer.

The output layout is what `mx.fast.scaled_dot_product_attention` takes ([Hkv, L, D] per
sequence, as mlx-lm's own KV cache holds it), so attention after the gather runs exactly as on
a contiguous cache. MLX's `cache[block_table]` gather moves 0.2-0.4 TB/s on an H200; this is a
plain copy, one threadblock per page, 16-byte accesses, UNROLL loads in flight per thread.

The CUDA and Metal sources below are twins: same inputs, same page list, same layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .arrays import device_array
from .geometry import Geometry, dtype_name
from .plan import column_constants
from .sources import source_hash

THREADS = 256
UNROLL = 4  # 16-byte chunks each thread loads before it stores any
PAGE_COLS = ("SEQ", "PAGE", "SEQ_LEN", "OUT_ROW")  # OUT_ROW: first [D] row of the sequence's output

_COPY = r"""
  // One 16-byte chunk is 16 / sizeof(T) elements; a page is BS rows of [Hkv, D], contiguous.
  // The caches are read as 16-byte chunks whatever their declared dtype.
  constexpr int VEC = 16 / sizeof(T);
  auto row = pages + PAGE_INDEX * PAGE_NCOLS;  // MLX passes a one-page list as `constant`
  const int seq = row[P_SEQ], page = row[P_PAGE], seq_len = row[P_SEQ_LEN];
  constexpr int hkv = HKV, d = D;  // compile-time: the index arithmetic below is shifts
  const long block = block_tables[long(seq) * block_tables_shape[1] + page];
  const int rows = min(BS, seq_len - page * BS);
  constexpr long page_chunks = long(BS) * hkv * d / VEC;
  const int chunks = rows * hkv * d / VEC;             // the page's valid rows come first
  const long out_base = long(row[P_OUT_ROW]) * d;
  auto k_page = (const DEVICE VEC_T*)k_cache + block * page_chunks;
  auto v_page = (const DEVICE VEC_T*)v_cache + block * page_chunks;
  for (int c0 = THREAD_INDEX; c0 < chunks; c0 += NTHREADS * UNROLL) {
    VEC_T kv[UNROLL], vv[UNROLL];
    for (int u = 0; u < UNROLL; ++u) {
      const int c = c0 + u * NTHREADS;
      if (c < chunks) {
        kv[u] = k_page[c];
        vv[u] = v_page[c];
      }
    }
    for (int u = 0; u < UNROLL; ++u) {
      const int c = c0 + u * NTHREADS;
      if (c >= chunks) break;
      const int e = c * VEC, r = e / (hkv * d), h = (e / d) % hkv, x = e % d;
      const long dst = out_base + (long(h) * seq_len + page * BS + r) * d + x;
      *((DEVICE VEC_T*)(k_out + dst)) = kv[u];
      *((DEVICE VEC_T*)(v_out + dst)) = vv[u];
    }
  }
"""
# Inputs:  k_cache, v_cache: num_blocks pages of BS x Hkv x D T each, row-major, in any dtype
#          (read as 16-byte chunks); block_tables [S, max_blocks] int32;
#          pages [num_pages, 4] int32 (PAGE_COLS), one row per page to copy.
# Outputs: k_out, v_out [sum of Hkv * L * D over gathered sequences] T.
# Grid: one threadblock (threadgroup) of THREADS threads per page. Template: T, BS, HKV, D,
# UNROLL.
CUDA_SOURCE = (
    "#define PAGE_INDEX blockIdx.x\n#define THREAD_INDEX int(threadIdx.x)\n"
    "#define DEVICE\n#define VEC_T uint4\n"
    + _COPY
)
METAL_SOURCE = (
    "#define PAGE_INDEX threadgroup_position_in_grid.x\n"
    "#define THREAD_INDEX int(thread_index_in_threadgroup)\n"
    "#define DEVICE device\n#define VEC_T uint4\n" + _COPY
)
HEADER = (f"constexpr int NTHREADS = {THREADS}, "
          f"PAGE_NCOLS = {len(PAGE_COLS)};\n{column_constants('P_', PAGE_COLS, 'constexpr int')}\n")
METAL_HEADER = HEADER.replace("constexpr", "constant constexpr")


@dataclass(frozen=True)
class GatherPlan:
    """Which sequences to gather, where each lands, and the launch; built once per forward."""

    seqs: tuple[int, ...]  # batch indices of the gathered sequences
    seq_lens: tuple[int, ...]
    offsets: tuple[int, ...]  # element offsets into k_out / v_out, len(seqs) + 1
    pages: mx.array  # int32 [num_pages, 4]
    dtype: mx.Dtype
    block_size: int
    num_kv_heads: int
    head_dim: int
    launch: dict  # the kernel call's arguments other than its inputs


def plan_gather(seq_lens: np.ndarray, seqs: list[int], block_size: int, num_kv_heads: int,
                head_dim: int, dtype: mx.Dtype) -> GatherPlan:
    lens = np.asarray(seq_lens, dtype=np.int64)[np.asarray(seqs, dtype=np.int64)]
    rows = np.concatenate([[0], np.cumsum(num_kv_heads * lens)])
    if rows[-1] >= 2**31:
        raise ValueError("seq_lens: the gathered K/V exceed 2**31 rows of head_dim")
    pages_per_seq = -(-lens // block_size)
    first = np.repeat(np.cumsum(pages_per_seq) - pages_per_seq, pages_per_seq)
    table = np.stack([np.repeat(np.asarray(seqs, dtype=np.int64), pages_per_seq),
                      np.arange(int(pages_per_seq.sum())) - first,
                      np.repeat(lens, pages_per_seq),
                      np.repeat(rows[:-1], pages_per_seq)], axis=1)
    total = int(rows[-1]) * head_dim
    # one sequence gets its [1, Hkv, L, D] shape straight from the kernel: no reshape op
    out_shape = (1, num_kv_heads, int(lens[0]), head_dim) if len(seqs) == 1 else (total,)
    launch = dict(
        template=[("T", dtype), ("BS", block_size), ("HKV", num_kv_heads), ("D", head_dim),
                  ("UNROLL", UNROLL)],
        grid=(len(table) * THREADS, 1, 1), threadgroup=(THREADS, 1, 1),
        output_shapes=[out_shape, out_shape], output_dtypes=[dtype, dtype])
    return GatherPlan(seqs=tuple(int(s) for s in seqs), seq_lens=tuple(int(n) for n in lens),
                      offsets=tuple(int(r) * head_dim for r in rows),
                      pages=device_array(table.astype(np.int32)), dtype=dtype,
                      block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
                      launch=launch)


class PageGather:
    """The gather kernel of one backend ("cuda" or "metal"), built once per (dtype, block size)."""

    def __init__(self, backend: str, kernel_factory):
        self.backend = backend
        self._factory = kernel_factory
        self._kernels: dict[tuple, object] = {}

    def unsupported_reason(self, geometry: Geometry) -> str | None:
        if geometry.head_dim * geometry.dtype.size % 16:
            return f"rows of {geometry.head_dim} x {geometry.dtype} are not a multiple of 16 bytes"
        return None

    def _kernel(self, plan: GatherPlan):
        key = (plan.dtype, plan.block_size, plan.num_kv_heads, plan.head_dim)
        if key not in self._kernels:
            metal = self.backend == "metal"
            source, header = (METAL_SOURCE, METAL_HEADER) if metal else (CUDA_SOURCE, HEADER)
            self._kernels[key] = self._factory(
                name=f"page_gather_{source_hash(header, source)}_"
                     f"{dtype_name(plan.dtype)}_b{plan.block_size}_h{plan.num_kv_heads}"
                     f"_d{plan.head_dim}_u{UNROLL}",
                input_names=["k_cache", "v_cache", "block_tables", "pages"],
                output_names=["k_out", "v_out"], source=source, header=header)
        return self._kernels[key]

    def check(self, k_cache: mx.array, v_cache: mx.array, plan: GatherPlan) -> None:
        """k_cache, v_cache: whole pages of the plan's geometry, in any dtype (see the module)."""
        page_bytes = plan.block_size * plan.num_kv_heads * plan.head_dim * plan.dtype.size
        if k_cache.nbytes != v_cache.nbytes or not k_cache.nbytes or k_cache.nbytes % page_bytes:
            raise ValueError(f"k_cache, v_cache: expected the same whole pages of {page_bytes} "
                             f"bytes, got {k_cache.nbytes} and {v_cache.nbytes} bytes")

    def launch(self, k_cache: mx.array, v_cache: mx.array, block_tables: mx.array,
               plan: GatherPlan) -> list[tuple[mx.array, mx.array]]:
        """[(k, v)] per gathered sequence, each [1, Hkv, L, D] contiguous; no host sync."""
        k_out, v_out = self._kernel(plan)(inputs=[k_cache, v_cache, block_tables, plan.pages],
                                          **plan.launch)
        if len(plan.seqs) == 1:
            return [(k_out, v_out)]
        shape = (1, plan.num_kv_heads, -1, plan.head_dim)
        return [(k_out[a:b].reshape(shape), v_out[a:b].reshape(shape))
                for a, b in zip(plan.offsets, plan.offsets[1:])]
