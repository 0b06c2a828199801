"""Measured rules: which sequences of a batch SDPA on contiguous K/V runs faster than the
backend's paged kernel, and which of those the Hopper prefill kernel takes instead.

Both paths compute the same function; a rule only picks the faster one, per sequence. The
measurements behind every threshold are in docs/kernels.md ("How routing picks a path"), with their raw files.
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
# What building a new shape's cuDNN graph costs inside a served step: 1.0-2.1 s on the H100 and
# the H200 (docs/results.md, "H100: the launch thread" and "H200: requests arriving over
# time"; 69-107 ms in a process doing nothing else: "A new SDPA shape").
CUDA_GRAPH_BUILD_MS = 1000.0
# What SDPA saves a call, estimated from its FLOPs: cuDNN ran 282 TFLOP/s at C16384_Lq512 on the
# H200 (GPU alone), where the paged kernel took 0.95-2.53x its time at 256-512 new tokens
# (docs/h200/crossover_mma_sync.txt): taken as twice, which overstates the saving elsewhere. The
# Hopper prefill kernel took up to 1.11x gather + SDPA's time where SDPA may take its sequences
# (docs/kernels.md, "How routing picks a path").
CUDA_SDPA_TFLOPS = 280.0
CUDA_KERNEL_OVER_SDPA = 2.0
CUDA_PREFILL_OVER_SDPA = 1.11
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


def kernel_extra_ms(q_len: int, seq_len: int, g: Geometry, layers: int,
                    over_sdpa: float = CUDA_KERNEL_OVER_SDPA) -> float:
    """A kernel's estimated extra time over SDPA for one sequence's attention in one forward of
    `layers` layers, where it takes `over_sdpa` times SDPA's: FLOPs = 4 H D q_len (mean keys a
    new row sees)."""
    flops = 4 * g.num_heads * g.head_dim * q_len * (seq_len - q_len + (q_len + 1) / 2)
    return layers * (over_sdpa - 1) * flops / (CUDA_SDPA_TFLOPS * 1e9)


class CudaSdpaRule:
    """`cuda_prefers_sdpa` for shapes whose cuDNN graphs are built or worth building.

    cuDNN builds a graph the first time it meets an SDPA shape (about a second inside a served
    step, where the cached call takes under a ms), and serving meets new lengths at almost every
    step. So a shape goes to SDPA once its graph is built, and a batch of long prefills builds
    one only when the paged kernel's estimated extra time on that shape (`kernel_extra_ms`,
    summed over the earlier forwards that ran it on the kernel) has reached the build's cost
    (`graph_build_ms`): ski rental, which by these estimates never pays more than twice what
    knowing the future would. A 256-token suffix over 2048 cached tokens at the 1.1B config (16
    layers, head dim 64) saves an estimated 0.26 ms a forward, so its graph waits for about
    3,800 of them; a fresh 16384-token prompt at Llama-3-8B's shape, for 4. A batch that mixes
    long prefills with decode rows builds no graph (a build would stall the decode rows riding
    with it) but its kernel time counts. A shape is kept per K/V layout (rows read as they lie,
    or gathered), as MLX keys graphs by strides too.

    With a prefill kernel (Hopper), which needs no graph, a picked sequence whose pages would be
    gathered over a prefix of >= CUDA_PREFILL_MIN_CTX_PER_Q x its new tokens (at most
    CUDA_PREFILL_MAX_Q) goes to it, and so does any other picked sequence with a cached prefix
    whose graph is not built: the latter count toward a graph at the prefill kernel's smaller
    extra time (CUDA_PREFILL_OVER_SDPA). Both memories hold MLX_CUDA_SDPA_CACHE_SIZE shapes,
    least recently used first out, as MLX's own graph cache does. A windowed sequence whose
    window cuts its keys never goes to SDPA (WINDOW_MASK_REASON): the prefill kernel where it
    can take it, else the paged kernel keeps it.
    """

    def __init__(self, capacity: int | None = None, prefill=None,
                 graph_build_ms: float = CUDA_GRAPH_BUILD_MS):
        """`prefill`: the backend's prefill kernel (its `unsupported_reason(geometry)` says
        where it runs), or None. `graph_build_ms`: what a graph is worth waiting for (0: a
        shape asked for before builds, the rule's long-run choice, which benchmarks time)."""
        self.prefill = prefill
        capacity = sdpa_cache_size() if capacity is None else capacity
        if capacity < 1:
            raise ValueError(f"capacity: expected at least 1 shape, got {capacity}")
        if isinstance(graph_build_ms, bool) or not isinstance(graph_build_ms, (int, float)) \
                or not graph_build_ms >= 0:
            raise ValueError(f"graph_build_ms: expected a cost >= 0, got {graph_build_ms!r}")
        self.capacity, self.graph_build_ms = capacity, float(graph_build_ms)
        self._kernel_ms: OrderedDict[tuple, float] = OrderedDict()  # shape -> kernel's extra
        self._built: OrderedDict[tuple, None] = OrderedDict()

    def _touch(self, memory: OrderedDict, items) -> None:
        for key, value in items:
            memory[key] = value
            memory.move_to_end(key)
        while len(memory) > self.capacity:
            memory.popitem(last=False)

    def __call__(self, lengths: Lengths, geometry: Geometry, runs: dict[int, int],
                 layers: int = 1) -> SdpaPick | None:
        """`runs`: the sequences whose pages are one run of blocks (read in place); `layers`:
        how many layers run this forward's plan (the kernel's extra time adds up per layer,
        a graph serves them all)."""
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
        mixed = len(pick.seqs) < lengths.num_seqs
        built = {shape for shape in shapes.values() if shape in self._built}
        # a sum of per-forward estimates may land a rounding short of a cost it equals
        paid = self.graph_build_ms * (1 - 1e-9)
        due = set() if mixed else {shape for shape in shapes.values() if shape not in built and
                                   self._kernel_ms.get(shape, -1.0) >= paid}
        sdpa = [s for s in rest if shapes[s] in built | due]
        self._touch(self._built, ((shapes[s], None) for s in sdpa))
        for shape in due:
            self._kernel_ms.pop(shape)
        waiting = [s for s in rest if prefill_runs and s not in sdpa and seq_lens[s] > q_lens[s]]
        # each sequence a kernel runs adds its estimate: a shape's sequences in one batch add up
        self._touch(self._kernel_ms, (
            (shapes[s], self._kernel_ms.get(shapes[s], 0.0) + kernel_extra_ms(
                int(q_lens[s]), int(seq_lens[s]), g, layers,
                CUDA_PREFILL_OVER_SDPA if s in waiting else CUDA_KERNEL_OVER_SDPA))
            for s in rest if s not in sdpa))
        prefill = tuple(sorted(first + waiting))
        seqs = tuple(sorted(set(sdpa) | set(prefill)))
        if not seqs:
            return None
        reason = pick.reason
        if sdpa:
            reason += (", at shapes whose cuDNN graphs are built" if not due else
                       ", at shapes whose cuDNN graphs are built or, run on the kernels "
                       "before, worth building")
        if masked:
            reason += "; " + WINDOW_MASK_REASON
        if prefill:
            reason += (f"; the prefill kernel for {len(prefill)} of them (cached prefixes read "
                       f"from their pages: >= {CUDA_PREFILL_MIN_CTX_PER_Q}x the new tokens, or "
                       "no cuDNN graph yet; measured faster than gather + SDPA there, and than "
                       "the paged kernel)")
        return SdpaPick(seqs, reason, prefill)


def metal_prefers_sdpa(lengths: Lengths, geometry: Geometry, runs: dict[int, int],
                       layers: int = 1) -> SdpaPick | None:
    q_lens = lengths.q_lens
    seqs = tuple(int(s) for s in range(lengths.num_seqs)
                 if lengths.seq_lens[s] == q_lens[s] and q_lens[s] >= METAL_SDPA_MIN_Q)
    if not seqs:
        return None
    return SdpaPick(seqs, f"no cached prefix and >= {METAL_SDPA_MIN_Q} new tokens: SDPA over "
                          "the new K/V, nothing read back (rule unmeasured on Apple GPUs)")


def rule_for(backend, graph_build_ms: float = CUDA_GRAPH_BUILD_MS):
    """A fresh rule (with its own bounded state) for a `jit_kernels.KernelBackend`;
    `graph_build_ms` for the CUDA rule (`CudaSdpaRule`)."""
    if backend.name == "cuda":
        return CudaSdpaRule(prefill=backend.prefill, graph_build_ms=graph_build_ms)
    if backend.name == "metal":
        return metal_prefers_sdpa
    raise ValueError(f"backend: no measured rule for {backend.name!r}")
