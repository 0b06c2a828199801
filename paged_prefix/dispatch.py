"""Per-call choice between the gather reference and the JIT paged-attention kernels.

`choose()` is the one function that decides; it returns the path and the reason, which
are logged once per distinct case and counted, so tests can check which path really ran
(engagement) and users can see when a slow path was taken.

Override with `Dispatcher(path=...)` or the environment variable PAGED_PREFIX_ATTENTION
(`auto`, `reference`, `cuda`, `metal`). A forced kernel that cannot run the call raises
ValueError instead of falling back silently.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx

import reference
from jit_kernels import KernelBackend, available_backends

from .metadata import AttentionMetadata

ENV_VAR = "PAGED_PREFIX_ATTENTION"
PATHS = ("auto", "reference", "cuda", "metal")

log = logging.getLogger(__name__)

AttentionFn = Callable[[mx.array, mx.array, mx.array, AttentionMetadata, float], mx.array]


@dataclass(frozen=True)
class Choice:
    path: str
    reason: str


def _case_key(q: mx.array, k_cache: mx.array, meta: AttentionMetadata) -> tuple:
    """What makes two calls 'the same case' for logging: dtype and geometry class."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    return (
        str(q.dtype),
        head_dim,
        q.shape[1] // num_kv_heads,
        block_size,
        "decode" if meta.max_q_len == 1 else "prefill",
    )


class Dispatcher:
    """Callable with the contract of `paged_prefix.contract`; picks the path per call."""

    def __init__(self, path: str | None = None):
        path = path or os.environ.get(ENV_VAR, "auto")
        if path not in PATHS:
            raise ValueError(f"{ENV_VAR}/path: expected one of {PATHS}, got {path!r}")
        self.path = path
        self.counts: Counter[str] = Counter()
        self.last: Choice | None = None
        self._logged: set[tuple] = set()

    def choose(self, q: mx.array, k_cache: mx.array, meta: AttentionMetadata) -> Choice:
        backends = available_backends()
        if self.path == "reference":
            return Choice("reference", "forced")
        if self.path != "auto":
            backend = backends.get(self.path)
            if backend is None:
                raise ValueError(f"{ENV_VAR}/path: the {self.path} kernel needs the "
                                 f"{self.path} backend, which this machine lacks")
            why_not = backend.unsupported_reason(q, k_cache, meta)
            if why_not:
                raise ValueError(f"{ENV_VAR}/path: the {self.path} kernel cannot run this "
                                 f"call: {why_not}")
            return Choice(self.path, "forced")
        return _auto_choice(backends, q, k_cache, meta)

    def __call__(
        self, q: mx.array, k_cache: mx.array, v_cache: mx.array, meta: AttentionMetadata,
        scale: float,
    ) -> mx.array:
        # Every layer of a forward asks with the same geometry: decide (and log) once per
        # forward, so the per-layer cost is a dict lookup.
        geometry = (self.path, str(q.dtype), tuple(q.shape[1:]), tuple(k_cache.shape))
        choice, fn = meta.plan(("dispatch", geometry), lambda m: self._decide(q, k_cache, m))
        self.counts[choice.path] += 1
        self.last = choice
        return fn(q, k_cache, v_cache, meta, scale)

    def _decide(
        self, q: mx.array, k_cache: mx.array, meta: AttentionMetadata
    ) -> tuple[Choice, AttentionFn]:
        choice = self.choose(q, k_cache, meta)
        key = (choice, _case_key(q, k_cache, meta))
        if key not in self._logged:
            self._logged.add(key)
            log.info("paged attention: %s (%s) for dtype=%s head_dim=%d group=%d "
                     "block=%d %s", choice.path, choice.reason, *key[1])
        fn: AttentionFn = (reference.paged_attention if choice.path == "reference"
                           else available_backends()[choice.path].paged_attention)
        return choice, fn


def _auto_choice(
    backends: dict[str, KernelBackend], q: mx.array, k_cache: mx.array, meta: AttentionMetadata
) -> Choice:
    if not backends:
        return Choice("reference", "no GPU kernel backend on this machine")
    reasons = []
    for name, backend in backends.items():
        why_not = backend.unsupported_reason(q, k_cache, meta)
        if why_not:
            reasons.append(f"{name}: {why_not}")
            continue
        faster = backend.reference_is_faster(q, k_cache, meta)
        if faster:
            reasons.append(f"{name}: {faster}")
            continue
        return Choice(name, "kernel supports the call")
    return Choice("reference", "; ".join(reasons))
