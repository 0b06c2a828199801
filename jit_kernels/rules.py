"""Measured rules: which sequences of a batch gather + cuDNN/MLX SDPA runs faster than a
backend's paged kernel.

Both paths compute the same function; a rule only picks the faster one, per sequence. A
sequence with no cached prefix costs the SDPA path no gather at all (it attends over its own
new rows). A rule returns an `SdpaPick` (the sequences, and why) or None when it picks none;
the dispatcher runs the batch on SDPA when every sequence is picked, on the kernel when none
is, and otherwise both: the kernel over the rest in one launch, SDPA per picked sequence. On
Hopper a pick may hand some of its sequences with a cached prefix to the backend's prefill
kernel instead (`SdpaPick.prefill`): one launch for all of them, no gather, no cuDNN graph.
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
# The Hopper prefill kernel (hopper_prefill_attention) / gather + SDPA, us per call on the GPU
# alone, 20 calls evaluated together, same shapes (docs/h200/prefill_kernel.json):
#              Lq=256         512            1024           2048           4096
#   C=512      8.9 / 8.5
#   C=1024     12.0 / 12.1    23.7 / 22.6    51.9 / 46.9
#   C=2048     18.1 / 19.5    35.6 / 36.3    75.1 / 73.3
#   C=4096     32.5 / 35.8*   59.3 / 65.6    121.8 / 127.4  266.9 / 270.3  633.9 / 630.7
#   C=8192                                                  473.1 / 478.2  1052.4 / 1040.3
#   C=16384    106.1 / 150.4  210.7 / 247.6                 900.8 / 901.1  1945.0 / 1924.6
# (* before the kernel's one V box a page, which took 0.93-0.94x the time elsewhere.) It wins
# where the gather costs most against the FLOPs: a cached prefix of at least four times the new
# tokens, up to 2048 of them; cuDNN keeps the longer suffixes.
CUDA_PREFILL_MIN_CTX_PER_Q = 4
CUDA_PREFILL_MAX_Q = 2048
# MLX's own cache of cuDNN SDPA graphs (mlx/backend/cuda/scaled_dot_product_attention.cpp).
SDPA_CACHE_ENV, DEFAULT_SDPA_CACHE_SIZE = "MLX_CUDA_SDPA_CACHE_SIZE", 256
# Unmeasured on Apple hardware: only fresh long prompts (mlx-lm's own path) leave the kernel.
METAL_SDPA_MIN_Q = 512


@dataclass(frozen=True)
class SdpaPick:
    """The sequences of a batch (increasing batch indices) that SDPA runs, and why."""

    seqs: tuple[int, ...]
    reason: str
    prefill: tuple[int, ...] = ()  # of seqs, those the backend's prefill kernel runs


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

    Given the backend's prefill kernel (Hopper), which needs no graph: a picked sequence whose
    pages would be gathered and whose cached prefix holds at least CUDA_PREFILL_MIN_CTX_PER_Q
    times its new tokens (at most CUDA_PREFILL_MAX_Q of them) goes to it whatever shapes came
    before, in mixed batches too; so does any other picked sequence with a cached prefix that
    SDPA does not take yet (its graph not built), which the paged kernel would otherwise run:
    at 256 new tokens and more the prefill kernel took 0.62-0.85x the paged kernel's time at
    every point measured (docs/h200/prefill_kernel_experiments.json, run 6).

    (With every graph built, SDPA and the kernel took about the same time over a chunked
    prefill of 32 prompts: 467 vs 448 ms.) MLX keeps the graphs in a least-recently-used cache
    of MLX_CUDA_SDPA_CACHE_SIZE shapes (default 256); the rule remembers as many shapes asked
    for and as many built, dropping the least recently used, so a shape MLX has evicted goes
    back to the kernel and a long-running server's memory of shapes stays bounded.
    """

    def __init__(self, capacity: int | None = None, prefill=None):
        """`prefill`: the backend's prefill kernel (its `unsupported_reason(geometry)` says
        where it runs), or None."""
        self.prefill = prefill
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
        prefill_runs = self.prefill is not None and self.prefill.unsupported_reason(g) is None
        # gathered otherwise, over a prefix of 4x: the prefill kernel whatever graphs are built
        first = [s for s in pick.seqs if prefill_runs and s not in runs and
                 q_lens[s] <= CUDA_PREFILL_MAX_Q and
                 seq_lens[s] - q_lens[s] >= CUDA_PREFILL_MIN_CTX_PER_Q * q_lens[s]]
        rest = [s for s in pick.seqs if s not in first]
        shapes = {s: (g.num_heads, g.num_kv_heads, g.head_dim, g.dtype, int(q_lens[s]),
                      int(seq_lens[s]), bool(q_lens[s] == seq_lens[s]) or s in runs)
                  for s in rest}
        if len(pick.seqs) < len(seq_lens):  # mixed: only graphs built already
            sdpa = [s for s in rest if shapes[s] in self._built]
            self._touch(self._built, (shapes[s] for s in sdpa))
            why_sdpa = ", at shapes whose cuDNN graphs are built"
        else:  # asked before this batch: two new sequences of one shape both build no graph yet
            seen = all(shape in self._asked for shape in shapes.values())
            self._touch(self._asked, shapes.values())
            sdpa = rest if seen else []
            self._touch(self._built, (shapes[s] for s in sdpa))
            why_sdpa = ", at shapes asked for before (cuDNN graphs built)"
        # a cached prefix whose graph is not built: the prefill kernel rather than the paged one
        waiting = [s for s in rest if prefill_runs and s not in sdpa and seq_lens[s] > q_lens[s]]
        prefill = tuple(sorted(first + waiting))
        seqs = tuple(sorted(set(sdpa) | set(prefill)))
        if not seqs:
            return None
        reason = pick.reason + (why_sdpa if sdpa else "")
        if prefill:
            reason += (f"; the prefill kernel for {len(prefill)} of them (cached prefixes read "
                       f"from their pages: >= {CUDA_PREFILL_MIN_CTX_PER_Q}x the new tokens, or "
                       "no cuDNN graph yet; measured faster than gather + SDPA there, and than "
                       "the paged kernel)")
        return SdpaPick(seqs, reason, prefill)


def metal_prefers_sdpa(cu_seqlens_q: np.ndarray, seq_lens: np.ndarray, geometry: Geometry,
                       block_tables: np.ndarray | None = None) -> SdpaPick | None:
    q_lens = np.diff(cu_seqlens_q)
    seqs = np.flatnonzero((np.asarray(seq_lens) == q_lens) & (q_lens >= METAL_SDPA_MIN_Q))
    if not len(seqs):
        return None
    return SdpaPick(tuple(seqs.tolist()),
                    f"no cached prefix and >= {METAL_SDPA_MIN_Q} new tokens: SDPA over the new "
                    "K/V, nothing read back (rule unmeasured on Apple GPUs)")
