"""What every JIT backend shares: the call geometry, support rules, entry checks, kernel names.

The tensor cores take fp16/bf16 operands only, a query tile packs whole GQA groups (group <= 8),
and the kernels are tested at block sizes 8, 16 and 32 (any other size goes elsewhere).
"""

from __future__ import annotations

import hashlib
import numbers
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from reference import check_arrays, check_lengths, host_ints

DTYPES = (mx.float16, mx.bfloat16)
BLOCK_SIZES = (8, 16, 32)
MAX_GROUP = 8
# MLX's CUDA allocator serves arrays of at most this many bytes from a managed-memory pool
# the host writes into; on the H200 a threadblock's first read of one cost 2-15 us (see
# cuda_paged_attention.qk_scale_bits). A one-block table or a one-token step's ids are that small.
SMALL_POOL_BYTES = 8


@dataclass(frozen=True)
class Geometry:
    """The shape of one forward's attention calls: what a plan is built for."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: mx.Dtype
    scale: float

    def __post_init__(self):
        for name in ("num_heads", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads: {self.num_heads} is not a multiple of "
                             f"{self.num_kv_heads} kv heads")

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads

    def variant(self) -> tuple:
        """What selects a compiled kernel: (dtype, head_dim, group, block_size)."""
        return (dtype_name(self.dtype), self.head_dim, self.group, self.block_size)


def unsupported_reason(geometry: Geometry, head_dims: tuple[int, ...]) -> str | None:
    """Why a kernel built for these head dims cannot run this geometry, or None when it can."""
    if geometry.dtype not in DTYPES:
        return f"dtype {geometry.dtype} (kernels take float16/bfloat16)"
    if geometry.head_dim not in head_dims:
        return f"head_dim {geometry.head_dim} (kernel built for {head_dims})"
    if not 1 <= geometry.group <= MAX_GROUP:
        return f"GQA group {geometry.group} (kernel packs groups of 1..{MAX_GROUP})"
    if geometry.block_size not in BLOCK_SIZES:
        return f"block size {geometry.block_size} (kernel tested for {BLOCK_SIZES})"
    return None


@dataclass(frozen=True)
class Lengths:
    """A batch's host lengths, validated once per forward by a planner."""

    cu_seqlens_q: np.ndarray
    seq_lens: np.ndarray
    num_tokens: int
    max_seq_len: int

    @classmethod
    def of(cls, cu_seqlens_q: np.ndarray, seq_lens: np.ndarray) -> Lengths:
        cu, lens = check_lengths(cu_seqlens_q, seq_lens)
        return cls(cu, lens, int(cu[-1]), int(lens.max()))

    def subset(self, seqs) -> np.ndarray | None:
        """`seqs` (a plan's sequences; None: all of them) as sorted int64 batch indices."""
        if seqs is None:
            return None
        picked = host_ints(seqs, "seqs")
        n = len(self.seq_lens)
        if not len(picked) or (np.diff(picked) <= 0).any() or picked[0] < 0 or picked[-1] >= n:
            raise ValueError(f"seqs: expected increasing batch indices in [0, {n - 1}], "
                             f"got {seqs!r}")
        return picked

    def tokens_of(self, seqs: np.ndarray | None) -> int:
        if seqs is None:
            return self.num_tokens
        return int(np.diff(self.cu_seqlens_q)[seqs].sum())


def as_pages(cache: mx.array, geometry: Geometry) -> mx.array:
    """A cache array as [num_blocks, BS, Hkv, D] of the geometry's dtype, as a view of its
    bytes: a `PagedKVCache` stores its rows as 4-byte words, [num_blocks * BS, Hkv, words]."""
    g = geometry
    if cache.dtype != g.dtype:
        cache = cache.view(g.dtype)
    if cache.ndim == 4 and cache.shape[1:] == (g.block_size, g.num_kv_heads, g.head_dim):
        return cache
    return cache.reshape(-1, g.block_size, g.num_kv_heads, g.head_dim)


def as_rows(cache: mx.array, geometry: Geometry) -> mx.array:
    """A cache array as [num_blocks * BS, Hkv, D] of the geometry's dtype: its token rows, as a
    view of its bytes (the stored form, or pages)."""
    g = geometry
    if cache.dtype != g.dtype:
        cache = cache.view(g.dtype)
    if cache.ndim == 3 and cache.shape[1:] == (g.num_kv_heads, g.head_dim):
        return cache
    return cache.reshape(-1, g.num_kv_heads, g.head_dim)


def page_runs(block_tables, seq_lens: np.ndarray, seqs, block_size: int) -> dict[int, int]:
    """Of the sequences `seqs`, those whose pages are one run of consecutive blocks (b, b + 1,
    ...: their K/V are contiguous rows of the cache, readable in place), each with its first
    block. `block_tables`: the host copy of the table the calls pass, [S, max_blocks]."""
    table = np.asarray(block_tables)
    if table.ndim != 2 or table.dtype.kind not in "iu" or len(table) != len(seq_lens):
        raise ValueError(f"block_tables: expected a host [{len(seq_lens)}, max_blocks] integer "
                         f"table, got {table.dtype} of shape {table.shape}")
    runs = {}
    for s in seqs:
        n = -(-int(seq_lens[s]) // block_size)
        if n > table.shape[1]:
            raise ValueError(f"block_tables: sequence {s} holds {int(seq_lens[s])} tokens and "
                             f"needs {n} blocks, the table has {table.shape[1]} columns")
        row = table[s, :n].astype(np.int64)
        if row[0] >= 0 and (np.diff(row) == 1).all():
            runs[int(s)] = int(row[0])
    return runs


def check_call(backend: str, geometry: Geometry, q: mx.array, k_cache: mx.array,
               v_cache: mx.array, block_tables: mx.array, lengths: Lengths) -> None:
    """A kernel's per-call entry check (shapes only): the contract, then the plan's geometry."""
    check_arrays(q, k_cache, v_cache, block_tables, lengths.num_tokens,
                 len(lengths.seq_lens), lengths.max_seq_len)
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    got = (q.shape[1], num_kv_heads, head_dim, block_size, q.dtype)
    want = (geometry.num_heads, geometry.num_kv_heads, geometry.head_dim, geometry.block_size,
            geometry.dtype)
    if got != want:
        raise ValueError(f"{backend}: q/k_cache (heads, kv heads, head_dim, block size, dtype) "
                         f"{got} differ from the plan's {want}")


class PagedAttentionKernel:
    """What the CUDA and Metal paged kernels share: support rules, the plan's entry check, the
    checked call. Subclasses set `name` and `head_dims` and implement `plan` and `launch`;
    kernels are built through `kernel_factory` (MLX's, or a test's stand-in) once per variant.
    """

    name: str
    head_dims: tuple[int, ...]

    def __init__(self, kernel_factory):
        self._factory = kernel_factory
        self._kernels: dict[tuple, object] = {}

    def unsupported_reason(self, geometry: Geometry) -> str | None:
        return unsupported_reason(geometry, self.head_dims)

    def tile_rows(self, geometry: Geometry) -> tuple[int, ...]:
        """The query-tile heights a plan may choose for this geometry, each its own kernel
        variant: the first-use check runs every one (`plan(..., block_m=)`)."""
        raise NotImplementedError

    def _block_m(self, block_m: int | None, geometry: Geometry) -> int | None:
        """A caller's forced tile height, checked: None lets the plan choose."""
        if block_m is None:
            return None
        if isinstance(block_m, bool) or not isinstance(block_m, numbers.Integral) or \
                block_m not in self.tile_rows(geometry):
            raise ValueError(f"block_m: {self.name} plans query tiles of "
                             f"{self.tile_rows(geometry)} rows, not {block_m!r}")
        return int(block_m)

    def _lengths(self, cu_seqlens_q: np.ndarray, seq_lens: np.ndarray,
                 geometry: Geometry) -> Lengths:
        """A plan's first step: refuse an unsupported geometry, validate the host lengths."""
        why_not = self.unsupported_reason(geometry)
        if why_not:
            raise ValueError(f"{self.name} paged attention cannot run this geometry: {why_not}")
        return Lengths.of(cu_seqlens_q, seq_lens)

    def __call__(self, q: mx.array, k_cache: mx.array, v_cache: mx.array,
                 block_tables: mx.array, plan) -> mx.array:
        """The contract of `reference.contract`; no host sync."""
        check_call(self.name, plan.geometry, q, k_cache, v_cache, block_tables, plan.lengths)
        return self.launch(q, k_cache, v_cache, block_tables, plan)


def device_array(host: np.ndarray) -> mx.array:
    """`host` on the device, never in MLX's small-array pool: an array of SMALL_POOL_BYTES or
    fewer becomes a view of the start of a longer buffer (a contiguous slice, not a copy)."""
    host = np.ascontiguousarray(host)
    if host.nbytes > SMALL_POOL_BYTES:
        return mx.array(host)
    padded = np.zeros(SMALL_POOL_BYTES // host.itemsize + 1, dtype=host.dtype)
    padded[:host.size] = host.ravel()
    return mx.array(padded)[:host.size].reshape(host.shape)


def source_hash(*sources: str) -> str:
    """Short hash of kernel sources, for kernel names: MLX caches compiled kernels by name
    (on disk too) and would silently reuse a stale one after a source change."""
    return hashlib.sha1("".join(sources).encode()).hexdigest()[:10]


def dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).split(".")[-1]
