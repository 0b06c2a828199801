"""What a new attention shape costs on the SDPA path, and what that means for serving.

    python -m bench.probes.sdpa_new_shapes [--out new_shapes.json]

1. `mx.fast.scaled_dot_product_attention` (cuDNN on CUDA) at shapes this process has not run
   yet: the first call against the same call again (bf16, H=32, Hkv=8, D=64).
2. A serving-like pass: 32 prompts of 2304 tokens prefilled by a 1.1B model in 2048-token steps
   (vLLM's chunked prefill packs whatever fits, so most steps hold new (query, key) lengths):
   auto three times over the same steps, each pass with a fresh dispatcher
   (paged_prefix.rules.CudaSdpaRule: a shape goes to SDPA once its graph is built or the paged
   kernel's estimated extra time on it has paid for one), then the paged kernel alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from jit_kernels import available_backends
from paged_prefix.dispatch import Dispatcher
from paged_prefix.kv_cache import PagedKVCache
from paged_prefix.metadata import ScheduledRequest, build_batch_metadata
from paged_prefix.models import build_model, resolve_config
from paged_prefix.runner import PagedModelRunner

# none of them occurs in the serving pass, whose graphs must start unbuilt
SHAPES = [(2000, 2000), (2001, 2001), (1000, 1000), (250, 2250), (500, 4000), (300, 2350)]
PROMPTS, PROMPT_LEN, STEP_TOKENS, BS = 32, 2304, 2048, 16


def first_and_again(lq: int, lk: int) -> tuple[float, float]:
    q = mx.random.normal((1, 32, lq, 64)).astype(mx.bfloat16)
    k = mx.random.normal((1, 8, lk, 64)).astype(mx.bfloat16)
    mx.eval(q, k)
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        mx.eval(mx.fast.scaled_dot_product_attention(q, k, k, scale=0.125, mask="causal"))
        times.append((time.perf_counter() - t0) * 1e3)
    return times[0], times[1]


def chunked_steps() -> list[list[tuple[int, int, int]]]:
    """Each step's (prompt, computed, scheduled), first come first served."""
    done, steps = [0] * PROMPTS, []
    while min(done) < PROMPT_LEN:
        step, left = [], STEP_TOKENS
        for i in range(PROMPTS):
            if done[i] < PROMPT_LEN and left:
                n = min(PROMPT_LEN - done[i], left)
                step.append((i, done[i], n))
                left -= n
        for i, start, n in step:
            done[i] = start + n
        steps.append(step)
    return steps


def serving_pass(runner: PagedModelRunner, prompts, tables, steps) -> list[float]:
    times = []
    for step in steps:
        meta = build_batch_metadata(
            [ScheduledRequest(f"r{i}", prompts[i], PROMPT_LEN, start, n, tables[i])
             for i, start, n in step], BS, runner.kv_cache.num_blocks)
        t0 = time.perf_counter()
        runner.greedy(meta)
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="new_shapes.json")
    args = parser.parse_args()
    rows = {"sdpa_first_call": {}, "serving": {}}
    for lq, lk in SHAPES:
        first, again = first_and_again(lq, lk)
        rows["sdpa_first_call"][f"Lq{lq}_Lk{lk}"] = {"first_ms": first, "again_ms": again}
        print(f"SDPA Lq={lq} Lk={lk}: first call {first:.1f} ms, again {again:.2f} ms", flush=True)
    backend = next(iter(available_backends()), None)
    if backend is None:
        print("no GPU kernel backend: the serving pass needs one")
    else:
        cfg = resolve_config("llama-1b")
        model = build_model(cfg, mx.bfloat16)
        blocks_per_prompt = -(-PROMPT_LEN // BS)
        kv = PagedKVCache(cfg["num_hidden_layers"], 1 + PROMPTS * blocks_per_prompt, BS,
                          cfg["num_key_value_heads"], cfg["head_dim"], mx.bfloat16)
        rng = np.random.default_rng(0)
        prompts = [rng.integers(3, cfg["vocab_size"], PROMPT_LEN).tolist() for _ in range(PROMPTS)]
        tables = [list(range(1 + i * blocks_per_prompt, 1 + (i + 1) * blocks_per_prompt))
                  for i in range(PROMPTS)]
        steps = chunked_steps()
        # first use of each path in the process (kernel compiles, first-use checks) is not
        # what the passes measure: pay it on a small forward that shares none of their shapes
        for path in (backend, "sdpa"):
            PagedModelRunner(model, kv, Dispatcher(path)).greedy(build_batch_metadata(
                [ScheduledRequest("warm", prompts[0][:40], 40, 0, 40, tables[0]),
                 ScheduledRequest("warm-hit", prompts[0][:80], 80, 32, 48, tables[1])],
                BS, kv.num_blocks))
        for label, path in [("auto pass 1", "auto"), ("auto pass 2", "auto"),
                            ("auto pass 3", "auto"), ("kernel", backend)]:
            runner = PagedModelRunner(model, kv, Dispatcher(path))
            times = serving_pass(runner, prompts, tables, steps)
            rows["serving"][label] = {"steps": len(times), "total_ms": sum(times),
                                      "median_ms": statistics.median(times),
                                      "max_ms": max(times), "paths": dict(runner.dispatcher.counts)}
            print(f"serving-like {label:<12}{len(times)} steps, total {sum(times):7.0f} ms, "
                  f"median {statistics.median(times):6.1f} ms, max {max(times):6.1f} ms, "
                  f"layer calls by path {dict(runner.dispatcher.counts)}", flush=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
