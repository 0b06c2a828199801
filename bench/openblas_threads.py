"""Serving-shaped steps of the paged runner on OpenBLAS with 1 vs 2 threads, side by side.

    python -m bench.openblas_threads [--repeats 2]

SmolLM2-135M float32: two 576-token prefills one after the other, then decode steps of 8
rows and of 1 row over those contexts. Each thread count runs in its own child process
(OPENBLAS_NUM_THREADS is read when OpenBLAS loads), the two taking turns. Run it while the
machine has other work, as a server's cores do (its API process, the client): a waiting
OpenBLAS thread spins, and that is where a second one costs (docs/cpu.md).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

BLOCK_SIZE, PROMPT, ROWS, DECODE_ROUNDS = 16, 576, 8, 5


def measure() -> None:
    from paged_prefix import cpu_blas  # first: OpenBLAS before mlx.core

    cpu_blas.require()
    import mlx.core as mx
    import numpy as np

    from paged_prefix.convert_smollm2 import smollm2_folder
    from paged_prefix.kv_cache import PagedKVCache
    from paged_prefix.metadata import ScheduledRequest, build_batch_metadata
    from paged_prefix.model_loader import load_model
    from paged_prefix.runner import PagedModelRunner

    model = load_model(smollm2_folder(), mx.float32)
    a = model.args
    per_seq = PROMPT // BLOCK_SIZE + 2
    num_blocks = ROWS * per_seq + 1
    runner = PagedModelRunner(model, PagedKVCache(a.num_hidden_layers, num_blocks, BLOCK_SIZE,
                                                  a.num_key_value_heads, a.head_dim, mx.float32))
    rng = np.random.default_rng(0)
    seqs = [(f"r{i}", rng.integers(3, a.vocab_size, PROMPT).tolist(),
             list(range(1 + i * per_seq, 1 + (i + 1) * per_seq))) for i in range(ROWS)]

    def prefill(rid, prompt, blocks):
        runner.greedy(build_batch_metadata([ScheduledRequest(rid, prompt, PROMPT, 0, PROMPT,
                                                             blocks)], BLOCK_SIZE, num_blocks))
    t0 = time.perf_counter()
    for seq in seqs[:2]:
        prefill(*seq)
    print(f"prefill 2x{PROMPT} one by one: {time.perf_counter() - t0:.2f} s")
    for seq in seqs[2:]:
        prefill(*seq)
    for rows in (ROWS, 1):
        meta = build_batch_metadata([ScheduledRequest(rid, p + [5], PROMPT, PROMPT, 1, b)
                                     for rid, p, b in seqs[:rows]], BLOCK_SIZE, num_blocks)
        runner.greedy(meta)
        t0 = time.perf_counter()
        for _ in range(DECODE_ROUNDS):
            runner.greedy(meta)
        print(f"decode {rows} row{'s' * (rows > 1)}: "
              f"{(time.perf_counter() - t0) / DECODE_ROUNDS * 1000:.1f} ms/step")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        measure()
        return 0
    for _ in range(args.repeats):
        for threads in ("1", "2"):
            env = {**os.environ, "PAGED_PREFIX_CPU_BLAS": "openblas",
                   "OPENBLAS_NUM_THREADS": threads}
            done = subprocess.run([sys.executable, "-m", "bench.openblas_threads", "--child"],
                                  env=env, check=True, capture_output=True, text=True)
            print(f"threads {threads}\n{done.stdout.strip()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
