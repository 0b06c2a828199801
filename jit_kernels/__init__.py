"""JIT paged-attention kernels: inline CUDA and Metal sources built through MLX.

A one-way library: plain arrays in, arrays out; nothing here imports the runner package. Each
backend pairs a paged-attention kernel (plan once per forward, call once per layer) with a
page-gather kernel feeding `contiguous_sdpa`, and the measured rule for choosing between them.
Only backends whose device exists on this machine are listed by `available_backends()`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from . import rules
from .cuda_paged_attention import CudaPagedAttention
from .metal_paged_attention import MetalPagedAttention
from .page_gather import PageGather
from .support import Geometry

SdpaRule = Callable[[np.ndarray, np.ndarray, Geometry, np.ndarray | None],
                    "rules.SdpaPick | None"]


@dataclass(frozen=True, eq=False)
class KernelBackend:
    """One device's kernels. `prefers_sdpa(cu_seqlens_q, seq_lens, geometry, block_tables)`
    returns the sequences for which SDPA (over gathered pages, or K/V read in place where the
    host block table allows) beats the paged kernel and why (`rules.SdpaPick`, a measured
    rule), or None."""

    name: str
    attention: CudaPagedAttention | MetalPagedAttention
    gather: PageGather
    prefers_sdpa: SdpaRule


def cuda_backend(cuda_kernel=None) -> KernelBackend:
    factory = cuda_kernel or mx.fast.cuda_kernel
    return KernelBackend("cuda", CudaPagedAttention(factory), PageGather("cuda", factory),
                         rules.CudaSdpaRule())


def metal_backend(metal_kernel=None) -> KernelBackend:
    factory = metal_kernel or mx.fast.metal_kernel
    return KernelBackend("metal", MetalPagedAttention(factory), PageGather("metal", factory),
                         rules.metal_prefers_sdpa)


@functools.cache
def available_backends() -> dict[str, KernelBackend]:
    backends = {}
    if mx.cuda.is_available():
        backends["cuda"] = cuda_backend()
    if mx.metal.is_available():
        backends["metal"] = metal_backend()
    return backends


__all__ = ["Geometry", "KernelBackend", "available_backends", "cuda_backend", "metal_backend"]
