"""Measured rules: which sequences of a batch gather + cuDNN/MLX SDPA runs faster than a
backend's paged kernel.

Both paths compute the same function; a rule only picks the faster one, per sequence. A
sequence with no cached prefix costs the SDPA path no gather at all (it attends over its own
new rows). A rule returns an `SdpaPick` (the sequences, and why) or None when it picks none;
the dispatcher runs the batch on SDPA when every sequence is picked, on the kernel when none
is, and otherwise both: the kernel over the rest in one launch, SDPA per picked sequence.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from .support import Geometry, page_runs

# CUDA (H200, bf16, H=32, Hkv=8, D=128, block 16, one sequence, pages shuffled;
# bench/crossover.py, docs/h200/crossover.txt): us per call on the GPU alone, the paged kernel
# (on Hopper at D=128 the wgmma one) / SDPA (over the new rows at C=0, else over the pages the
# gather copied):
#              Lq=128         256            512
#   C=0        6.3 / 8.0      9.6 / 10.9     16.5 / 14.2
#   C=1024     20.2 / 23.5    31.0 / 26.1    41.0 / 30.4
#   C=4096     45.3 / 64.9    93.8 / 68.7    114.8 / 72.9
#   C=16384    143.3 / 232.2  209.9 / 234.5  405.7 / 247.8
# cuDNN's SDPA reaches ~1.6-1.8x the kernel's TFLOP/s at long suffixes, so once a suffix is long
# enough the gather costs less than the FLOPs it saves: at 128 new tokens and below the
# kernel's single launch and split KV win everywhere; at 256 it is a draw (the kernel 0.88x and
# 0.89x at C=0 and 16384, 1.19x and 1.36x at 1024 and 4096); from 512 SDPA wins everywhere.
# The mma.sync kernel (docs/h200/crossover_previous_round.txt, before the wgmma kernel) crossed
# between 128 and 256 too. At 4096 new tokens SDPA takes ~0.55-0.6x the kernel's time
# (docs/gpu.md). End to end (bench/test_bench_prefill.py, docs/h200/prefill.json) a 416-token
# suffix over 3680 cached tokens also ran no slower on SDPA (8B shape: 17.4 vs 20.7 ms). SDPA
# runs sequence by sequence: decode rows and short suffixes stay on the kernel, which takes
# them all in one launch (32 decode rows with no context: SDPA 672 us, kernel 23 us, an early
# sweep).
CUDA_SDPA_MIN_Q = 256
# MLX's own cache of cuDNN SDPA graphs (mlx/backend/cuda/scaled_dot_product_attention.cpp).
SDPA_CACHE_ENV, DEFAULT_SDPA_CACHE_SIZE = "MLX_CUDA_SDPA_CACHE_SIZE", 256
# Unmeasured on Apple hardware: only fresh long prompts (mlx-lm's own path) leave the kernel.
METAL_SDPA_MIN_Q = 512


@dataclass(frozen=True)
class SdpaPick:
    """The sequences of a batch (increasing batch indices) that SDPA runs, and why."""

    seqs: tuple[int, ...]
    reason: str


def cuda_prefers_sdpa(cu_seqlens_q: np.ndarray, seq_lens: np.ndarray, geometry: Geometry,
                      block_tables: np.ndarray | None = None) -> SdpaPick | None:
    seqs = np.flatnonzero(np.diff(cu_seqlens_q) >= CUDA_SDPA_MIN_Q)
    if not len(seqs):
        return None
    return SdpaPick(tuple(seqs.tolist()),
                    f"prefills of >= {CUDA_SDPA_MIN_Q} tokens: SDPA over their new K/V or "
                    "their gathered pages measured faster on the H200")


def sdpa_cache_size() -> int:
    """MLX's cuDNN graph-cache capacity, read from the environment as MLX reads it (>= 1)."""
    value = os.environ.get(SDPA_CACHE_ENV, "").strip()
    if not value:
        return DEFAULT_SDPA_CACHE_SIZE
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{SDPA_CACHE_ENV}: expected a number of shapes >= 1, got {value!r}")
    return int(value)


class CudaSdpaRule:
    """`cuda_prefers_sdpa` for shapes whose cuDNN graphs are built or likely to be used again;
    the kernel otherwise.

    cuDNN builds an execution graph the first time it meets an SDPA shape (MLX caches it by
    shape): on the H200 that first call took 69-107 ms in one run and 37-634 ms in another,
    where the cached call takes 0.2-0.6 ms (bf16, H=32, Hkv=8, D=64; docs/h200/new_shapes.txt).
    Serving meets new (query, key) lengths at almost every step, and a 1.1B model's whole
    2048-token step takes ~12 ms, so under the length rule alone a server stalled for a graph
    build on most steps. So:

    - a batch of long prefills only goes to SDPA when every one of its shapes was asked for
      before (a shape that comes again is likely to keep coming, and pays for its graph once);
      its first request of a shape runs the paged kernel, which compiles once per variant;
    - in a batch that mixes long prefills with decode rows or short suffixes, SDPA takes only
      the sequences whose graphs such batches have built: a mixed batch never builds a graph,
      so mixing adds no build stall to those that batches of long prefills pay anyway. (Served
      on the H200, 16 requests sharing 4 prefixes, prefix caching on: TTFT p50 4998 ms with
      mixed batches free to build graphs, 4372 ms under this rule, where no step mixed; both
      runs also carried a seconds-long first decode-only step inside requests, since moved
      into the server's warm-up: docs/gpu.md, "Serving on the H200".)

    MLX keys a graph by shape and strides too, and K/V read as rows (new rows, or pages read
    in place) are laid out otherwise than gathered ones: the rule keeps a shape per layout.

    (With every graph built, SDPA and the kernel took about the same time over a chunked
    prefill of 32 prompts: 467 vs 448 ms.) MLX keeps the graphs in a least-recently-used cache
    of MLX_CUDA_SDPA_CACHE_SIZE shapes (default 256); the rule remembers as many shapes asked
    for and as many built, dropping the least recently used, so a shape MLX has evicted goes
    back to the kernel and a long-running server's memory of shapes stays bounded.
    """

    def __init__(self, capacity: int | None = None):
        if capacity is None:
            capacity = sdpa_cache_size()
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

    def __call__(self, cu_seqlens_q: np.ndarray, seq_lens: np.ndarray, geometry: Geometry,
                 block_tables: np.ndarray | None = None) -> SdpaPick | None:
        pick = cuda_prefers_sdpa(cu_seqlens_q, seq_lens, geometry)
        if pick is None:
            return None
        g, q_lens = geometry, np.diff(cu_seqlens_q)
        # K/V read as rows (new, or pages read in place) or gathered: a graph for each layout
        runs = {} if block_tables is None else page_runs(block_tables, seq_lens, pick.seqs,
                                                         g.block_size)
        shapes = {s: (g.num_heads, g.num_kv_heads, g.head_dim, g.dtype, int(q_lens[s]),
                      int(seq_lens[s]), bool(q_lens[s] == seq_lens[s]) or s in runs)
                  for s in pick.seqs}
        if len(pick.seqs) < len(seq_lens):  # mixed: only graphs built already
            built = tuple(s for s in pick.seqs if shapes[s] in self._built)
            self._touch(self._built, (shapes[s] for s in built))
            if not built:
                return None
            return SdpaPick(built, f"{pick.reason}, at shapes whose cuDNN graphs are built")
        # asked before this batch: two new sequences of one shape both build no graph yet
        seen = all(shape in self._asked for shape in shapes.values())
        self._touch(self._asked, shapes.values())
        if not seen:
            return None
        self._touch(self._built, shapes.values())
        return SdpaPick(pick.seqs, f"{pick.reason}, at shapes asked for before (cuDNN graphs "
                                   "built)")


def metal_prefers_sdpa(cu_seqlens_q: np.ndarray, seq_lens: np.ndarray, geometry: Geometry,
                       block_tables: np.ndarray | None = None) -> SdpaPick | None:
    q_lens = np.diff(cu_seqlens_q)
    seqs = np.flatnonzero((np.asarray(seq_lens) == q_lens) & (q_lens >= METAL_SDPA_MIN_Q))
    if not len(seqs):
        return None
    return SdpaPick(tuple(seqs.tolist()),
                    f"no cached prefix and >= {METAL_SDPA_MIN_Q} new tokens: SDPA over the new "
                    "K/V, nothing read back (rule unmeasured on Apple GPUs)")
