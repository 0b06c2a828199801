"""JIT attention executors: inline CUDA and Metal sources built through MLX, SDPA on contiguous
K/V, and the reference, all behind one interface (`interface.AttentionKernel`).

A one-way library: plain arrays in, arrays out; nothing here imports the runner package, and
nothing here decides which executor runs a sequence (the runner's route does). Each backend
pairs a paged kernel with a page gather (and, on Hopper, a prefill kernel); only backends whose
device exists on this machine are listed by `available_backends()`.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass, field

import mlx.core as mx

from . import hopper_paged_attention
from .cuda_paged_attention import CudaPagedAttention
from .geometry import Geometry, Lengths
from .hopper_paged_attention import HopperPagedAttention
from .hopper_prefill_attention import HopperPrefillAttention
from .interface import AttentionKernel, Plan
from .metal_paged_attention import MetalPagedAttention
from .page_gather import PageGather
from .sdpa import ContiguousSdpa, GatheredSdpa, ReferenceAttention

log = logging.getLogger(__name__)
# "0": the mma.sync kernel even where the wgmma one can run (it costs ~10 us more host time a
# call: in host-bound steps the mma.sync kernel's forward is 0-4% faster, docs/kernels.md).
WGMMA_ENV_VAR = "PAGED_PREFIX_CUDA_WGMMA"


@dataclass(frozen=True, eq=False)
class KernelBackend:
    """One device's executors with kernels of their own; `verdicts` is filled by the first-use
    check, per (executor name, variant): None passed, else why not."""

    name: str
    attention: CudaPagedAttention | MetalPagedAttention
    gathered: GatheredSdpa  # SDPA over pages copied by the backend's gather kernel
    prefill: HopperPrefillAttention | None = None  # long prefills over cached prefixes (Hopper)
    verdicts: dict = field(default_factory=dict)

    def executors(self) -> tuple[AttentionKernel, ...]:
        return tuple(k for k in (self.attention, self.gathered, self.prefill) if k is not None)


def cuda_backend(cuda_kernel=None, wgmma: bool | None = None) -> KernelBackend:
    """`wgmma`: whether head dim 128 runs the Hopper kernels (`hopper_paged_attention`, and
    `hopper_prefill_attention` for the long prefills the route hands it); None: wherever this
    machine can (an sm_90 GPU and NVRTC) unless PAGED_PREFIX_CUDA_WGMMA=0, logged either way."""
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
    return KernelBackend("cuda", attention, GatheredSdpa(PageGather("cuda", factory)), prefill)


def metal_backend(metal_kernel=None) -> KernelBackend:
    factory = metal_kernel or mx.fast.metal_kernel
    return KernelBackend("metal", MetalPagedAttention(factory),
                         GatheredSdpa(PageGather("metal", factory)))


@functools.cache
def available_backends() -> dict[str, KernelBackend]:
    """The compiled kernels of this machine's devices, built once per process (MLX caches the
    compiled code by name anyway); routing state lives in each dispatcher, not here."""
    backends = {}
    if mx.cuda.is_available():
        backends["cuda"] = cuda_backend()
    if mx.metal.is_available():
        backends["metal"] = metal_backend()
    return backends


__all__ = ["AttentionKernel", "ContiguousSdpa", "GatheredSdpa", "Geometry", "KernelBackend",
           "Lengths", "Plan", "ReferenceAttention", "available_backends", "cuda_backend",
           "metal_backend"]
