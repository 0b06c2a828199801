"""The host's share of one paged prefill: building a forward's lazy graph, nothing evaluated.

    python -m bench.probes.forward_build [--model llama-1b] [--prompt-len 4096] [--hit 3584]

The step of bench/prefill_setup.py (the runner over one prompt in one run of blocks, `hit`
tokens cached), warmed, then built 300 times: each build's graph is dropped and the cache's
arrays put back, so every build starts from the same state. A short suffix's step on a GPU is
this build followed by the device's work (the runner evaluates such a graph in one piece), so
two trees with the same build time and the same ops differ only on the device. Prints the
median build time and the graph's op count.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import mlx.core as mx
import numpy as np

from paged_prefix.kv_cache import PagedKVCache
from paged_prefix.metadata import ScheduledRequest, build_batch_metadata
from paged_prefix.models import build_model, resolve_config
from paged_prefix.runner import PagedModelRunner

BLOCK_SIZE, BUILDS = 16, 300


def graph_ops(outputs: list[mx.array]) -> int:
    """Distinct ops the arrays depend on: the op nodes of MLX's exported graph."""
    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, *outputs)
        return f.read().count("shape=rectangle")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-1b")
    parser.add_argument("--prompt-len", type=int, default=4096)
    parser.add_argument("--hit", type=int, default=3584, help="cached tokens (whole blocks)")
    args = parser.parse_args()
    if args.hit % BLOCK_SIZE or not 0 <= args.hit < args.prompt_len:
        raise ValueError(f"--hit: whole blocks of {BLOCK_SIZE} below --prompt-len, got "
                         f"{args.hit}")
    cfg = resolve_config(args.model)
    model = build_model(cfg, mx.bfloat16)
    blocks = -(-args.prompt_len // BLOCK_SIZE)
    kv = PagedKVCache(cfg["num_hidden_layers"], blocks + 1, BLOCK_SIZE,
                      cfg["num_key_value_heads"], cfg["head_dim"], mx.bfloat16)
    runner = PagedModelRunner(model, kv)
    prompt = np.random.default_rng(0).integers(3, cfg["vocab_size"], args.prompt_len).tolist()
    meta = build_batch_metadata([ScheduledRequest(
        "r", prompt, args.prompt_len, args.hit, args.prompt_len - args.hit,
        list(range(1, blocks + 1)))], BLOCK_SIZE, blocks + 1)
    for _ in range(3):  # compile, build cuDNN graphs, settle the route
        mx.eval(runner.forward(meta), kv.arrays())
    ops = graph_ops([runner.forward(meta), *kv.arrays()])
    kv_state = kv.snapshot()
    times = []
    for _ in range(BUILDS):
        kv.restore(kv_state)
        t0 = time.perf_counter()
        runner.forward(meta)
        times.append(time.perf_counter() - t0)
    kv.restore(kv_state)
    times.sort()
    print(f"{args.model} {args.prompt_len} tokens, {args.hit} cached, path "
          f"{runner.dispatcher.last.path}: graph build median {statistics.median(times) * 1e3:.3f}"
          f" ms (p10 {times[BUILDS // 10] * 1e3:.3f}, p90 {times[BUILDS * 9 // 10] * 1e3:.3f}),"
          f" {ops} ops")


if __name__ == "__main__":
    main()
