"""What a plan is built for: the call geometry (with its attention variant), the batch's checked
host lengths, and the rules every kernel shares (tensor-core dtypes, whole GQA groups per query
tile, tested block sizes, the variants it implements).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import mlx.core as mx
import numpy as np

from reference import check_lengths, check_scale, check_variant, host_ints, key_start

DTYPES = (mx.float16, mx.bfloat16)
CALL_DTYPES = (mx.float16, mx.bfloat16, mx.float32)  # what a forward's q and caches may be
BLOCK_SIZES = (8, 16, 32)
MAX_GROUP = 8


def dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).split(".")[-1]


# A variant's features, as kernels name what they implement: each is compiled in or out.
FEATURES = ("window", "softcap", "sinks")


@dataclass(frozen=True)
class Geometry:
    """The shape of one forward's attention calls, and their variant (`reference.contract`):
    `window` W (None: full causal), `softcap` (None: none), `sinks` (the calls pass one logit
    per query head). `heads_major`: the cache keeps each kv head's rows together, [Hkv,
    num_blocks * BS, D] (`arrays.as_rows`), which MLX's CPU SDPA reads in place; no kernel
    reads it."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: mx.Dtype
    scale: float
    window: int | None = None
    softcap: float | None = None
    sinks: bool = False
    heads_major: bool = False

    def __post_init__(self):
        for name in ("num_heads", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads: {self.num_heads} is not a multiple of "
                             f"{self.num_kv_heads} kv heads")
        if not isinstance(self.dtype, mx.Dtype) or self.dtype not in CALL_DTYPES:
            raise ValueError(f"dtype: expected one of {CALL_DTYPES}, got {self.dtype!r}")
        check_scale(self.scale)
        check_variant(self.window, self.softcap, None, self.num_heads)
        for name in ("sinks", "heads_major"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: expected a bool, got {getattr(self, name)!r}")

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @cached_property  # features and variant are read by every forward's route and checks
    def features(self) -> str:
        """The variant's features joined by "+" ("" for plain causal attention)."""
        on = (self.window is not None, self.softcap is not None, self.sinks)
        return "+".join(name for name, used in zip(FEATURES, on) if used)

    def variant(self) -> tuple:
        """What selects a compiled kernel: (dtype, head_dim, group, block_size, features); a
        window's size and a cap's value are per-call values."""
        return self._variant

    @cached_property
    def _variant(self) -> tuple:
        return (dtype_name(self.dtype), self.head_dim, self.group, self.block_size,
                self.features)

    def describe(self) -> str:
        """The variant for a log line."""
        dtype, head_dim, group, block, features = self.variant()
        return (f"dtype={dtype} head_dim={head_dim} group={group} block={block}"
                + (f" {features}" if features else ""))


HEADS_MAJOR_REASON = "a heads-major cache (the kernels read vLLM's token-major pages)"


def unsupported_reason(geometry: Geometry, head_dims: tuple[int, ...],
                       features: tuple[str, ...] = ()) -> str | None:
    """Why a tensor-core kernel built for these head dims and implementing `features` cannot
    run this geometry, or None."""
    if geometry.heads_major:
        return HEADS_MAJOR_REASON
    missing = [f for f in geometry.features.split("+") if f and f not in features]
    if missing:
        return f"{' and '.join(missing)} (not built into this kernel)"
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
    """A batch's host lengths, checked once (`of`), then handed to every plan of the forward."""

    cu_seqlens_q: np.ndarray  # int64 [S + 1]
    seq_lens: np.ndarray  # int64 [S]
    num_tokens: int
    max_seq_len: int

    @classmethod
    def of(cls, cu_seqlens_q, seq_lens) -> Lengths:
        cu, lens = check_lengths(cu_seqlens_q, seq_lens)
        for arr in (cu, lens):
            arr.flags.writeable = False
        return cls(cu, lens, int(cu[-1]), int(lens.max()))

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @cached_property  # the route and every plan read it, some per sequence: computed once
    def q_lens(self) -> np.ndarray:
        q_lens = np.diff(self.cu_seqlens_q)
        q_lens.flags.writeable = False
        return q_lens

    def seqs(self, seqs=None) -> tuple[int, ...]:
        """`seqs` (a plan's sequences; None: all of them) as increasing batch indices."""
        if seqs is None:
            return tuple(range(self.num_seqs))
        picked = host_ints(seqs, "seqs")
        n = self.num_seqs
        if not len(picked) or (np.diff(picked) <= 0).any() or picked[0] < 0 or picked[-1] >= n:
            raise ValueError(f"seqs: expected increasing batch indices in [0, {n - 1}], "
                             f"got {seqs!r}")
        return tuple(picked.tolist())

    def tokens_of(self, seqs: tuple[int, ...]) -> int:
        return int(self.q_lens[list(seqs)].sum())

    def key_starts(self, window: int | None) -> np.ndarray:
        """Per sequence the first key its new queries see (`reference.key_start`)."""
        return key_start(self.seq_lens - self.q_lens, window)
