"""JIT paged-prefill attention kernels: inline CUDA and Metal sources built through MLX.

Each backend module implements the contract of `paged_prefix.contract` and exposes:
  paged_attention(q, k_cache, v_cache, meta, scale) -> out
  unsupported_reason(q, k_cache, meta) -> str | None     shape/dtype support
  reference_is_faster(q, k_cache, meta) -> str | None    the measured rule
Only backends whose device exists on this machine are listed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx


@dataclass(frozen=True)
class KernelBackend:
    name: str
    paged_attention: Callable
    unsupported_reason: Callable
    reference_is_faster: Callable


def _backend(name: str, module) -> KernelBackend:
    return KernelBackend(name, module.paged_attention, module.unsupported_reason,
                         module.reference_is_faster)


@functools.cache
def available_backends() -> dict[str, KernelBackend]:
    backends = {}
    if mx.cuda.is_available():
        from . import cuda_paged_attention

        backends["cuda"] = _backend("cuda", cuda_paged_attention)
    if mx.metal.is_available():
        from . import metal_paged_attention

        backends["metal"] = _backend("metal", metal_paged_attention)
    return backends
