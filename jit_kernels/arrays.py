"""Device arrays and cache views every executor shares, and the per-call shape check."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from reference import check_arrays, check_variant

from .geometry import Geometry, Lengths

# MLX's CUDA allocator serves arrays of at most this many bytes from a managed-memory pool the
# host writes into; on the H200 a threadblock's first read of one cost 2-15 us (docs/kernels.md,
# "Host-written arrays"). A one-block table or a one-token step's ids are that small.
SMALL_POOL_BYTES = 8


def device_array(host: np.ndarray) -> mx.array:
    """`host` on the device, never in MLX's small-array pool: an array of SMALL_POOL_BYTES or
    fewer becomes a view of the start of a longer buffer (a contiguous slice, not a copy)."""
    host = np.ascontiguousarray(host)
    if host.nbytes > SMALL_POOL_BYTES:
        return mx.array(host)
    padded = np.zeros(SMALL_POOL_BYTES // host.itemsize + 1, dtype=host.dtype)
    padded[:host.size] = host.ravel()
    return mx.array(padded)[:host.size].reshape(host.shape)


def as_pages(cache: mx.array, geometry: Geometry) -> mx.array:
    """A cache array as [num_blocks, BS, Hkv, D] of the geometry's dtype, as a view of its
    bytes: a `PagedKVCache` stores its rows as 4-byte words, [num_blocks * BS, Hkv, words], or
    with a heads-major geometry [Hkv, num_blocks * BS, words] (then a strided view)."""
    g = geometry
    if cache.ndim == 4 and cache.shape[1:] == (g.block_size, g.num_kv_heads, g.head_dim) \
            and cache.dtype == g.dtype:
        return cache
    if g.heads_major:
        return _heads(cache, g).reshape(g.num_kv_heads, -1, g.block_size, g.head_dim) \
            .transpose(1, 2, 0, 3)
    if cache.dtype != g.dtype:
        cache = cache.view(g.dtype)
    return cache.reshape(-1, g.block_size, g.num_kv_heads, g.head_dim)


def as_rows(cache: mx.array, geometry: Geometry) -> mx.array:
    """A cache array as [num_blocks * BS, Hkv, D] of the geometry's dtype: its token rows, as a
    view of its bytes (the stored form, or pages; heads-major: a strided view)."""
    g = geometry
    if g.heads_major:
        return _heads(cache, g).transpose(1, 0, 2)
    if cache.dtype != g.dtype:
        cache = cache.view(g.dtype)
    if cache.ndim == 3 and cache.shape[1:] == (g.num_kv_heads, g.head_dim):
        return cache
    return cache.reshape(-1, g.num_kv_heads, g.head_dim)


def _heads(cache: mx.array, g: Geometry) -> mx.array:
    """A heads-major cache as stored, [Hkv, rows, D] of the geometry's dtype."""
    if cache.ndim != 3 or cache.shape[0] != g.num_kv_heads:
        raise ValueError(f"k_cache/v_cache: a heads-major cache is [{g.num_kv_heads} kv heads, "
                         f"rows, words], got {cache.shape}")
    return cache if cache.dtype == g.dtype else cache.view(g.dtype)


def _pages(cache: mx.array, geometry: Geometry, name: str) -> mx.array:
    """A cache as pages for the shape check: as given when it comes as pages (its shape and
    dtype are then checked as they are), else (the stored rows of words) viewed, once it is
    known to hold whole pages."""
    g = geometry
    if cache.ndim == 4:
        return cache
    page = g.block_size * g.num_kv_heads * g.head_dim * g.dtype.size
    if not cache.nbytes or cache.nbytes % page:
        raise ValueError(f"{name}: {cache.nbytes} bytes are not whole pages of {page} bytes "
                         f"({g.block_size} x {g.num_kv_heads} x {g.head_dim} {g.dtype})")
    return as_pages(cache, g)


def check_call(name: str, geometry: Geometry, lengths: Lengths, q: mx.array, k: mx.array,
               v: mx.array, k_cache: mx.array, v_cache: mx.array, block_tables: mx.array,
               sinks: mx.array | None = None) -> None:
    """An executor's entry check (shapes only, no host sync): the contract, the plan's
    geometry, the new rows, then the sinks (given exactly when the geometry has them)."""
    pages = _pages(k_cache, geometry, "k_cache")
    check_arrays(q, pages, _pages(v_cache, geometry, "v_cache"), block_tables,
                 lengths.num_tokens, lengths.num_seqs, lengths.max_seq_len)
    _, block_size, num_kv_heads, head_dim = pages.shape
    got = (q.shape[1], num_kv_heads, head_dim, block_size, q.dtype)
    planned = (geometry.num_heads, geometry.num_kv_heads, geometry.head_dim, geometry.block_size,
               geometry.dtype)
    if got != planned:
        raise ValueError(f"{name}: q/k_cache (heads, kv heads, head_dim, block size, dtype) "
                         f"{got} differ from the plan's {planned}")
    want = (q.shape[0], pages.shape[2], pages.shape[3])
    if k.shape != want or v.shape != want:
        raise ValueError(f"k, v: new rows must be {want}, got {k.shape} and {v.shape}")
    if geometry.sinks != (sinks is not None):
        raise ValueError(f"sinks: the plan's geometry {'has' if geometry.sinks else 'has no'} "
                         f"sinks, the call passes {'none' if sinks is None else 'some'}")
    check_variant(None, None, sinks, geometry.num_heads)
