"""Page gather: copy the pages of a batch into contiguous, head-major K/V in one launch.

    [(k, v), ...] = gather.launch(k_cache, v_cache, block_tables, plan)   # plan_gather(...) once
    k, v: [1, Hkv, L_i, D] contiguous, for sequence plan.seqs[i]: its keys from its first
          copied page on (page 0, or the page of a window's first visible key)

The caches may come in any dtype that holds the pages' bytes (the 4-byte words a
`PagedKVCache` stores, or [num_blocks, BS, Hkv, D] of the plan's dtype): the kernel copies
bytes, so a forward hands over its cache arrays as stored, with no view op per layer.

The output layout is what `mx.fast.scaled_dot_product_attention` takes ([Hkv, L, D] per
sequence, as mlx-lm's own KV cache holds it), so attention after the gather runs exactly as on
a contiguous cache. MLX's `cache[block_table]` gather moves 0.2-0.4 TB/s on an H200; this is a
plain copy, one threadblock per page, 16-byte accesses, UNROLL loads in flight per thread.

CUDA and Metal run one body (kernels/page_gather.inc): same inputs, same page list, same layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from . import sources
from .arrays import device_array
from .geometry import HEADS_MAJOR_REASON, Geometry, dtype_name

THREADS = 256
UNROLL = 4  # 16-byte chunks each thread loads before it stores any
# FIRST_PAGE: the sequence's first page copied; OUT_ROW: the first [D] row of its output
PAGE_COLS = ("SEQ", "PAGE", "SEQ_LEN", "FIRST_PAGE", "OUT_ROW")

# Each backend's kernel: kernels/page_gather.cu or .metal, which name the launch's indices and
# take the body of kernels/page_gather.inc.
SOURCES = {backend: sources.mlx_kernel(
    f"page_gather.{ext}",
    sources.constants(declare, NTHREADS=THREADS) +
    sources.columns(declare, "P_", PAGE_COLS, "PAGE_NCOLS"))
    for backend, ext, declare in (("cuda", "cu", sources.CUDA), ("metal", "metal", sources.METAL))}


@dataclass(frozen=True)
class GatherPlan:
    """Which sequences to gather, where each lands, and the launch; built once per forward."""

    seqs: tuple[int, ...]  # batch indices of the gathered sequences
    seq_lens: tuple[int, ...]
    first_pages: tuple[int, ...]  # per sequence its first page copied
    offsets: tuple[int, ...]  # element offsets into k_out / v_out, len(seqs) + 1
    pages: mx.array  # int32 [num_pages, 4]
    dtype: mx.Dtype
    block_size: int
    num_kv_heads: int
    head_dim: int
    launch: dict  # the kernel call's arguments other than its inputs


def plan_gather(seq_lens: np.ndarray, seqs: list[int], block_size: int, num_kv_heads: int,
                head_dim: int, dtype: mx.Dtype, key_starts: np.ndarray | None = None) -> GatherPlan:
    """`key_starts`: per batch sequence its first key needed (a window's); its page is the
    first copied. None copies every page."""
    picked = np.asarray(seqs, dtype=np.int64)
    lens = np.asarray(seq_lens, dtype=np.int64)[picked]
    firsts = np.zeros_like(lens) if key_starts is None else \
        np.asarray(key_starts, dtype=np.int64)[picked] // block_size
    if ((firsts < 0) | (firsts * block_size >= lens)).any():
        raise ValueError("key_starts: each must lie inside its sequence")
    out_lens = lens - firsts * block_size
    rows = np.concatenate([[0], np.cumsum(num_kv_heads * out_lens)])
    if rows[-1] >= 2**31:
        raise ValueError("seq_lens: the gathered K/V exceed 2**31 rows of head_dim")
    pages_per_seq = -(-lens // block_size) - firsts
    before = np.repeat(np.cumsum(pages_per_seq) - pages_per_seq, pages_per_seq)
    table = np.stack([np.repeat(picked, pages_per_seq),
                      np.arange(int(pages_per_seq.sum())) - before +
                      np.repeat(firsts, pages_per_seq),
                      np.repeat(lens, pages_per_seq),
                      np.repeat(firsts, pages_per_seq),
                      np.repeat(rows[:-1], pages_per_seq)], axis=1)
    total = int(rows[-1]) * head_dim
    # one sequence gets its [1, Hkv, L, D] shape straight from the kernel: no reshape op
    out_shape = (1, num_kv_heads, int(out_lens[0]), head_dim) if len(seqs) == 1 else (total,)
    launch = dict(
        template=[("T", dtype), ("BS", block_size), ("HKV", num_kv_heads), ("D", head_dim),
                  ("UNROLL", UNROLL)],
        grid=(len(table) * THREADS, 1, 1), threadgroup=(THREADS, 1, 1),
        output_shapes=[out_shape, out_shape], output_dtypes=[dtype, dtype])
    return GatherPlan(seqs=tuple(int(s) for s in seqs), seq_lens=tuple(int(n) for n in lens),
                      first_pages=tuple(int(f) for f in firsts),
                      offsets=tuple(int(r) * head_dim for r in rows),
                      pages=device_array(table.astype(np.int32)), dtype=dtype,
                      block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
                      launch=launch)


class PageGather:
    """The gather kernel of one backend ("cuda" or "metal"), built once per (dtype, block size)."""

    features: tuple[str, ...] = ("window",)  # it copies from a window's first page on

    def __init__(self, backend: str, kernel_factory):
        self.backend = backend
        self._factory = kernel_factory
        self._kernels: dict[tuple, object] = {}

    def unsupported_reason(self, geometry: Geometry) -> str | None:
        if geometry.heads_major:
            return HEADS_MAJOR_REASON
        if geometry.head_dim * geometry.dtype.size % 16:
            return f"rows of {geometry.head_dim} x {geometry.dtype} are not a multiple of 16 bytes"
        return None

    def _kernel(self, plan: GatherPlan):
        key = (plan.dtype, plan.block_size, plan.num_kv_heads, plan.head_dim)
        if key not in self._kernels:
            source = SOURCES[self.backend]
            self._kernels[key] = self._factory(
                name=f"page_gather_{source.hash}_"
                     f"{dtype_name(plan.dtype)}_b{plan.block_size}_h{plan.num_kv_heads}"
                     f"_d{plan.head_dim}_u{UNROLL}",
                input_names=["k_cache", "v_cache", "block_tables", "pages"],
                output_names=["k_out", "v_out"], source=source.source, header=source.header)
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
