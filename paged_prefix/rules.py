"""Measured rules: which sequences of a batch SDPA on contiguous K/V runs faster than the
backend's paged kernel, and which of those the Hopper prefill kernel takes instead.

Both paths compute the same function; a rule only picks the faster one, per sequence. The
measurements behind every threshold are in docs/kernels.md ("Routing"), with their raw files.
A rule's state (the cuDNN graphs MLX has built) belongs to one dispatcher and is bounded.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass

from jit_kernels.geometry import Geometry, Lengths

# From 256 new tokens SDPA (over the new rows, or the gathered pages) beats the paged kernel on
# the H200; at 128 and below the kernel's single launch and split KV win everywhere.
CUDA_SDPA_MIN_Q = 256
# The Hopper prefill kernel beats gather + SDPA where the cached prefix holds at least 4x the
# new tokens, up to 2048 of them; cuDNN keeps longer suffixes.
CUDA_PREFILL_MIN_CTX_PER_Q = 4
CUDA_PREFILL_MAX_Q = 2048
WINDOW_MASK_REASON = ("where the window cuts a prefill's keys, SDPA's mask takes MLX's unfused "
                      "fallback (8.8x the paged kernel on the H200 at W=4096, C=16384, Lq=4096): "
                      "those stay on the kernels")
# MLX's own cache of cuDNN SDPA graphs (mlx/backend/cuda/scaled_dot_product_attention.cpp).
SDPA_CACHE_ENV, DEFAULT_SDPA_CACHE_SIZE = "MLX_CUDA_SDPA_CACHE_SIZE", 256
# Unmeasured on Apple hardware: only fresh long prompts (mlx-lm's own path) leave the kernel.
METAL_SDPA_MIN_Q = 512


@dataclass(frozen=True)
class SdpaPick:
    """The sequences of a batch (increasing batch indices) that leave the paged kernel, and why;
    `prefill` of them the backend's prefill kernel runs, the others SDPA."""

    seqs: tuple[int, ...]
    reason: str
    prefill: tuple[int, ...] = ()


def cuda_prefers_sdpa(lengths: Lengths) -> SdpaPick | None:
    seqs = tuple(int(s) for s, n in enumerate(lengths.q_lens) if n >= CUDA_SDPA_MIN_Q)
    if not seqs:
        return None
    return SdpaPick(seqs, f"prefills of >= {CUDA_SDPA_MIN_Q} tokens: SDPA over their new K/V "
                          "or their gathered pages measured faster on the H200")


def sdpa_cache_size() -> int:
    """MLX's cuDNN graph-cache capacity, read from the environment as MLX reads it (>= 1)."""
    value = os.environ.get(SDPA_CACHE_ENV, "").strip()
    if not value:
        return DEFAULT_SDPA_CACHE_SIZE
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{SDPA_CACHE_ENV}: expected a number of shapes >= 1, got {value!r}")
    return int(value)


class CudaSdpaRule:
    """`cuda_prefers_sdpa` for shapes whose cuDNN graphs are built or likely to be used again.

    cuDNN builds a graph the first time it meets an SDPA shape (tens to hundreds of ms on the
    H200, where the cached call takes under a ms), and serving meets new lengths at almost every
    step. So a batch of long prefills goes to SDPA only when every one of its shapes was asked
    for before; in a batch that mixes long prefills with decode rows, SDPA takes only shapes
    whose graphs are built (a mixed batch never builds one). A shape is kept per K/V layout (rows
    read as they lie, or gathered), as MLX keys graphs by strides too. With a prefill kernel
    (Hopper), which needs no graph, a picked sequence whose pages would be gathered over a prefix
    of >= CUDA_PREFILL_MIN_CTX_PER_Q x its new tokens (at most CUDA_PREFILL_MAX_Q) goes to it
    whatever came before, and so does any other picked sequence with a cached prefix whose graph
    is not built. Both memories hold MLX_CUDA_SDPA_CACHE_SIZE shapes, least recently used first
    out, as MLX's own graph cache does. A windowed sequence whose window cuts its keys never
    goes to SDPA (WINDOW_MASK_REASON): the prefill kernel where it can take it, else the paged
    kernel keeps it.
    """

    def __init__(self, capacity: int | None = None, prefill=None):
        """`prefill`: the backend's prefill kernel (its `unsupported_reason(geometry)` says
        where it runs), or None."""
        self.prefill = prefill
        capacity = sdpa_cache_size() if capacity is None else capacity
        if capacity < 1:
            raise ValueError(f"capacity: expected at least 1 shape, got {capacity}")
        self.capacity = capacity
        self._asked: OrderedDict[tuple, None] = OrderedDict()
        self._built: OrderedDict[tuple, None] = OrderedDict()

    def _touch(self, memory: OrderedDict, shapes) -> None:
        for shape in shapes:
            memory[shape] = None
            memory.move_to_end(shape)
        while len(memory) > self.capacity:
            memory.popitem(last=False)

    def __call__(self, lengths: Lengths, geometry: Geometry,
                 runs: dict[int, int]) -> SdpaPick | None:
        """`runs`: the sequences whose pages are one run of blocks (read in place)."""
        pick = cuda_prefers_sdpa(lengths)
        if pick is None:
            return None
        g, q_lens, seq_lens = geometry, lengths.q_lens, lengths.seq_lens
        prefill_runs = self.prefill is not None and self.prefill.unsupported_reason(g) is None
        starts = lengths.key_starts(g.window)
        masked = [s for s in pick.seqs if g.window is not None and
                  seq_lens[s] - starts[s] > g.window]

        def prefill_first(s: int) -> bool:
            if not prefill_runs or q_lens[s] > CUDA_PREFILL_MAX_Q or seq_lens[s] == q_lens[s]:
                return False
            return s in masked or (s not in runs and seq_lens[s] - q_lens[s] >=
                                   CUDA_PREFILL_MIN_CTX_PER_Q * q_lens[s])
        first = [s for s in pick.seqs if prefill_first(s)]
        rest = [s for s in pick.seqs if s not in first and s not in masked]
        shapes = {s: (g.num_heads, g.num_kv_heads, g.head_dim, g.dtype, int(q_lens[s]),
                      int(seq_lens[s]), bool(q_lens[s] == seq_lens[s]) or s in runs)
                  for s in rest}
        if len(pick.seqs) < lengths.num_seqs:  # mixed: only graphs built already
            sdpa = [s for s in rest if shapes[s] in self._built]
            self._touch(self._built, (shapes[s] for s in sdpa))
            why_sdpa = ", at shapes whose cuDNN graphs are built"
        else:  # asked before this batch: two new sequences of one shape both build no graph yet
            seen = all(shape in self._asked for shape in shapes.values())
            self._touch(self._asked, shapes.values())
            sdpa = rest if seen else []
            self._touch(self._built, (shapes[s] for s in sdpa))
            why_sdpa = ", at shapes asked for before (cuDNN graphs built)"
        waiting = [s for s in rest if prefill_runs and s not in sdpa and seq_lens[s] > q_lens[s]]
        prefill = tuple(sorted(first + waiting))
        seqs = tuple(sorted(set(sdpa) | set(prefill)))
        if not seqs:
            return None
        reason = pick.reason + (why_sdpa if sdpa else "")
        if masked:
            reason += "; " + WINDOW_MASK_REASON
        if prefill:
            reason += (f"; the prefill kernel for {len(prefill)} of them (cached prefixes read "
                       f"from their pages: >= {CUDA_PREFILL_MIN_CTX_PER_Q}x the new tokens, or "
                       "no cuDNN graph yet; measured faster than gather + SDPA there, and than "
                       "the paged kernel)")
        return SdpaPick(seqs, reason, prefill)


def metal_prefers_sdpa(lengths: Lengths, geometry: Geometry,
                       runs: dict[int, int]) -> SdpaPick | None:
    q_lens = lengths.q_lens
    seqs = tuple(int(s) for s in range(lengths.num_seqs)
                 if lengths.seq_lens[s] == q_lens[s] and q_lens[s] >= METAL_SDPA_MIN_Q)
    if not seqs:
        return None
    return SdpaPick(seqs, f"no cached prefix and >= {METAL_SDPA_MIN_Q} new tokens: SDPA over "
                          "the new K/V, nothing read back (rule unmeasured on Apple GPUs)")


def rule_for(backend):
    """A fresh rule (with its own bounded state) for a `jit_kernels.KernelBackend`."""
    if backend.name == "cuda":
        return CudaSdpaRule(prefill=backend.prefill)
    if backend.name == "metal":
        return metal_prefers_sdpa
    raise ValueError(f"backend: no measured rule for {backend.name!r}")
