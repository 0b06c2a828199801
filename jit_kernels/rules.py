"""Measured rules: when gather + cuDNN/MLX SDPA beats a backend's paged kernel for a batch.

Both paths compute the same function; the rule only picks the faster one. A sequence with no
cached prefix costs the SDPA path no gather at all (it attends over its own new rows).
"""

from __future__ import annotations

import numpy as np

from .support import Geometry

# CUDA (H200, bf16, H=32, Hkv=8, D=128, block 16, one sequence; bench/attention_sweep.py, see
# docs/gpu.md). us per call, gather + cuDNN SDPA (sdpa) vs the paged mma.sync kernel:
#              Lq=64          512            4096
#   C=1024     133 / 63       161 / 102      601 / 974
#   C=4096     125 / 80       189 / 213      921 / 1896
#   C=16384    183 / 131      367 / 683      2218 / 5585
# cuDNN's SDPA (wgmma) runs ~2.5x this kernel's TFLOP/s, so once a sequence's causal attention
# work Lq * (C + (Lq + 1) / 2) (FLOPs / 4HD) outweighs its gather copy, SDPA on gathered K/V
# wins: the crossover lies between 1.05e6 (C=16384, Lq=64: kernel) and 2.2e6 (C=4096, Lq=512:
# sdpa). Short suffixes stay on the kernel however long the prefix: their gather would cost more
# than their attention (Lq=16 over 131k keys: a 0.5 GB copy). SDPA runs sequence by sequence,
# so a batch goes to it only when every sequence is such a prefill: decode rows and short
# suffixes would cost it a launch each (the sweep's 8-sequence mixed batch: kernel 1.15x).
CUDA_SDPA_MIN_Q = 128
CUDA_SDPA_MIN_WORK = 1.5e6


def _uncached(cu_seqlens_q: np.ndarray, seq_lens: np.ndarray) -> bool:
    return bool((np.asarray(seq_lens) == np.diff(cu_seqlens_q)).all())


def cuda_prefers_sdpa(cu_seqlens_q: np.ndarray, seq_lens: np.ndarray,
                      geometry: Geometry) -> str | None:
    if _uncached(cu_seqlens_q, seq_lens):
        return "no sequence has a cached prefix: SDPA over the new K/V, nothing read back"
    q_lens = np.diff(cu_seqlens_q).astype(np.float64)
    work = q_lens * (np.asarray(seq_lens) - q_lens + (q_lens + 1) / 2)
    if ((q_lens >= CUDA_SDPA_MIN_Q) & (work >= CUDA_SDPA_MIN_WORK)).all():
        return (f"every sequence is a long prefill (Lq >= {CUDA_SDPA_MIN_Q}, "
                f"Lq * (C + (Lq + 1) / 2) >= {CUDA_SDPA_MIN_WORK:.0e}): gather + cuDNN SDPA "
                "measured faster on the H200")
    return None


def metal_prefers_sdpa(cu_seqlens_q: np.ndarray, seq_lens: np.ndarray,
                       geometry: Geometry) -> str | None:
    # Unmeasured on Apple hardware: only the case that reads nothing back (mlx-lm's own path)
    # leaves the kernel. Replace with a measured rule once timed on an M-series GPU.
    if _uncached(cu_seqlens_q, seq_lens):
        return "no sequence has a cached prefix: SDPA over the new K/V, nothing read back"
    return None
