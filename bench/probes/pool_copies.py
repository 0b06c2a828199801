"""Steps over a large KV pool: step time, and steps whose writes copied a whole layer array.

    python -m bench.probes.pool_copies [--model llama-1b] [--blocks 65536] [--steps 50] [--out x.json]

MLX updates a cache array in place only when nothing else holds it; a write into an array that
MLX still holds for work it sent earlier copies the whole array (1 GiB per K or V array of a
1.1B model at 65536 blocks of 16). A step counts as copying when its peak memory grew by at
least 0.9 of one array. Each case runs two ways, interleaved round by round:

  runner   the runner as it is (it waits for MLX to let go of the last step's buffers only
           before a pipelined forward's first write, or after a graph built in under 0.5 ms);
  wait     `mx.synchronize()` before every forward as well: what always waiting costs.

Cases: 32 decode rows over 1024 cached tokens each, a 4096-token prompt's 512-token suffix
(built in one piece), and the whole prompt (pipelined on a GPU). The whole prompt's own
activations outgrow one array (mlx-lm's step over the same prompt grew 3.5 GiB), so its count
says nothing; its step time does (a copy of a 1 GiB array costs ~0.7 ms).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from bench.prefill_setup import BLOCK_SIZE, DTYPE, Setup
from paged_prefix.dispatch import Dispatcher
from paged_prefix.kv_cache import PagedKVCache
from paged_prefix.metadata import ScheduledRequest, build_batch_metadata
from paged_prefix.runner import PagedModelRunner


def decode_batch(rows: int, context: int, first_block: int, num_blocks: int):
    rng = np.random.default_rng(1)
    per = -(-(context + 1) // BLOCK_SIZE)
    reqs = [ScheduledRequest(f"d{j}", rng.integers(3, 1000, context + 1).tolist(), context + 1,
                             context, 1, list(range(first_block + j * per,
                                                    first_block + (j + 1) * per)))
            for j in range(rows)]
    return build_batch_metadata(reqs, BLOCK_SIZE, num_blocks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-1b")
    parser.add_argument("--blocks", type=int, default=65536)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--out", default="pool_copies.json")
    args = parser.parse_args()
    s = Setup(args.model, 4096)
    small = s.runner.kv_cache
    kv = PagedKVCache(small.num_layers, args.blocks, BLOCK_SIZE, small.num_kv_heads,
                      small.head_dim, DTYPE)
    runner = PagedModelRunner(s.runner.model, kv, Dispatcher("auto"))
    array_bytes = kv.arrays()[0].nbytes

    blocks = s.blocks["run"]  # the prompt's blocks in one run

    def prefill(hit: int):
        return build_batch_metadata([ScheduledRequest(
            "r", s.prompt, s.prompt_len, hit, s.prompt_len - hit, blocks)], BLOCK_SIZE,
            args.blocks)
    cases = {"decode32": decode_batch(32, 1024, len(blocks) + 1, args.blocks),
             "suffix512": prefill(s.prompt_len - 512), "prompt4096": prefill(0)}
    rows = []
    for name, meta in cases.items():
        def runner_step(meta=meta):
            mx.eval(runner.forward(meta), kv.arrays())

        def wait_step(meta=meta):
            mx.synchronize()
            runner_step(meta)
        ways = {"runner": runner_step, "wait": wait_step}
        for step in ways.values():
            for _ in range(3):
                step()
        ms = {w: [] for w in ways}
        copying = {w: 0 for w in ways}
        for _ in range(args.steps):
            for way, step in ways.items():
                base = mx.get_active_memory()
                mx.reset_peak_memory()
                t0 = time.perf_counter()
                step()
                ms[way].append((time.perf_counter() - t0) * 1e3)
                copying[way] += mx.get_peak_memory() - base >= 0.9 * array_bytes
        row = {"case": name, "path": runner.dispatcher.last.path, "steps": args.steps,
               "array_GiB": array_bytes / 2**30,
               **{f"{w}_ms": statistics.median(t) for w, t in ms.items()},
               **{f"{w}_steps_copying": n for w, n in copying.items()}}
        rows.append(row)
        print(json.dumps(row), flush=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
