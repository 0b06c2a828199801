"""JIT paged-attention kernels: inline CUDA and Metal sources built through MLX.

A one-way library: plain arrays in, arrays out; nothing here imports the runner package. Each
backend pairs a paged-attention kernel (plan once per forward, call once per layer) with a
page-gather kernel feeding `contiguous_sdpa`, and the measured rule for choosing between them.
Only backends whose device exists on this machine are listed by `available_backends()`.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from . import hopper_paged_attention, rules
from .cuda_paged_attention import CudaPagedAttention
from .hopper_paged_attention import HopperPagedAttention
from .hopper_prefill_attention import HopperPrefillAttention
from .metal_paged_attention import MetalPagedAttention
from .page_gather import PageGather
from .support import Geometry

log = logging.getLogger(__name__)
# "0": the mma.sync kernel even where the wgmma one can run (it costs ~10 us more host time a
# call: in host-bound steps the mma.sync kernel's forward is 0-4% faster, docs/gpu.md).
WGMMA_ENV_VAR = "PAGED_PREFIX_CUDA_WGMMA"

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
    # long prefills over cached prefixes, read from their pages (Hopper only; the rule's
    # `SdpaPick.prefill` sequences)
    prefill: HopperPrefillAttention | None = None


def cuda_backend(cuda_kernel=None, wgmma: bool | None = None) -> KernelBackend:
    """`wgmma`: whether head dim 128 runs the Hopper kernels (`hopper_paged_attention`, and
    `hopper_prefill_attention` for the long prefills the rule hands it); None:
    wherever this machine can (an sm_90 GPU and NVRTC) unless PAGED_PREFIX_CUDA_WGMMA=0,
    logged either way."""
    factory = cuda_kernel or mx.fast.cuda_kernel
    if wgmma is None:
        setting = os.environ.get(WGMMA_ENV_VAR, "")
        if setting not in ("", "0", "1"):
            raise ValueError(f"{WGMMA_ENV_VAR}: expected 0 or 1 (or unset), got {setting!r}")
        why_not = (f"{WGMMA_ENV_VAR}=0" if setting == "0"
                   else hopper_paged_attention.unavailable_reason())
        wgmma = why_not is None
        log.info("CUDA paged attention: %s", "the wgmma kernel (sm_90a) for head dim 128 "
                 "and the TMA prefill kernel for its long suffixes, mma.sync for the others" if wgmma
                 else f"the mma.sync kernel ({why_not})")
    attention = HopperPagedAttention(factory) if wgmma else CudaPagedAttention(factory)
    prefill = HopperPrefillAttention() if wgmma else None
    return KernelBackend("cuda", attention, PageGather("cuda", factory),
                         rules.CudaSdpaRule(prefill=prefill), prefill)


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
