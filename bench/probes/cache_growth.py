"""MLX's buffer cache over a served workload of long prompts: steps, memory, and failures with
MLX's default cache limit against the worker's bound (`memory.bound_buffer_cache`).

    python -m bench.probes.cache_growth [--model llama-8b] [--requests 32] [--out x.json]

vLLM's scheduler and the runner in this process (`paged_prefix.engine.Engine`, synchronous
scheduling, so a step's time is its own), random bf16 weights, a KV pool of --blocks blocks of
16. Requests share --prefixes prefixes of --prefix-len tokens, each with its own suffix of
--suffix-len, --output-len tokens out; one arrives every --every steps (a server whose requests
come over time: prefills beside running decodes). Each case runs in a process of its own, one
after the other:

  default  MLX's own cache limit (on CUDA, 95% of the device);
  bounded  the limit the worker sets: one forward's activation peak at the step budget.
Both measure that peak first (one forward of --step-tokens), as the worker does.

Per step: its time, tokens, decode rows, MLX's active and cached memory after it, and the
device's free memory (CUDA, through torch). A case that fails records its error and the steps
before it; one that leaves the device less than --floor GiB free stops there (a program that runs
a GPU out of memory can hang it).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

from bench.probes import child

CASES = ("default", "bounded")
GiB = 1 << 30


def device_free() -> float | None:
    try:
        import torch
        if torch.cuda.is_available():
            return torch.cuda.mem_get_info()[0] / GiB
    except Exception:  # noqa: BLE001 - a reading only
        return None
    return None


def prompts(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(0)
    prefixes = [rng.integers(10, vocab - 10, args.prefix_len).tolist()
                for _ in range(args.prefixes)]
    return [prefixes[i % args.prefixes] + rng.integers(10, vocab - 10, args.suffix_len).tolist()
            for i in range(args.requests)]


def run_case(case: str, args: argparse.Namespace) -> dict:
    import mlx.core as mx

    from paged_prefix.engine import Engine, EngineConfig
    from paged_prefix.vllm_plugin.memory import activation_peak, bound_buffer_cache

    engine = Engine(EngineConfig(model=args.model, dtype=args.dtype, num_blocks=args.blocks,
                                 max_model_len=args.prefix_len + args.suffix_len +
                                 args.output_len + 16, max_num_seqs=64,
                                 max_num_batched_tokens=args.step_tokens))
    runner = engine.runner.runner
    kv = runner.kv_cache
    # both cases measure the peak, as the worker does: the same warm-up before the first step
    peak = activation_peak(runner.model, runner.dispatcher, args.step_tokens, kv.block_size,
                           kv.num_kv_heads, kv.head_dim, kv.dtype)
    limit = bound_buffer_cache(peak) if case == "bounded" else None
    todo = prompts(args, engine.vocab_size)
    steps, error, n, start = [], None, 0, time.perf_counter()
    try:
        while todo or engine.has_unfinished():
            if todo and n % args.every == 0:
                engine.add_request(f"r{len(steps)}-{len(todo)}", todo.pop(0), args.output_len)
            meta_tokens = engine.tokens_computed
            t0 = time.perf_counter()
            engine.step()
            mx.synchronize()
            steps.append({"ms": 1e3 * (time.perf_counter() - t0),
                          "tokens": engine.tokens_computed - meta_tokens,
                          "path": runner.dispatcher.last.path if runner.dispatcher.last else None,
                          "active_GiB": mx.get_active_memory() / GiB,
                          "cached_GiB": mx.get_cache_memory() / GiB,
                          "device_free_GiB": device_free()})
            n += 1
            free = steps[-1]["device_free_GiB"]
            if free is not None and free < args.floor:
                error = f"stopped: {free:.1f} GiB of device memory free, under --floor"
                break
    except Exception as e:  # noqa: BLE001 - the failure is the measurement
        error = "".join(traceback.format_exception_only(e)).strip()[-2000:]
    return {"case": case, "cache_limit_GiB": None if limit is None else limit / GiB,
            "seconds": time.perf_counter() - start, "error": error, "steps": steps,
            "peak_GiB": mx.get_peak_memory() / GiB}


def summary(result: dict) -> dict:
    steps = result["steps"]
    ms = sorted(s["ms"] for s in steps) or [0.0]
    return {"case": result["case"], "cache_limit_GiB": result["cache_limit_GiB"],
            "steps": len(steps), "seconds": round(result["seconds"], 1),
            "error": result["error"] and result["error"].splitlines()[-1][:300],
            "step_ms_p50": round(ms[len(ms) // 2], 1), "step_ms_max": round(ms[-1], 1),
            "steps_over_1s": sum(s["ms"] > 1000 for s in steps),
            "max_cached_GiB": round(max((s["cached_GiB"] for s in steps), default=0), 2),
            "max_active_GiB": round(max((s["active_GiB"] for s in steps), default=0), 2),
            "min_device_free_GiB": min((s["device_free_GiB"] for s in steps
                                        if s["device_free_GiB"] is not None), default=None),
            "peak_GiB": round(result["peak_GiB"], 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-8b")
    parser.add_argument("--blocks", type=int, default=8192)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prefixes", type=int, default=8)
    parser.add_argument("--prefix-len", type=int, default=12288)
    parser.add_argument("--suffix-len", type=int, default=1536)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--step-tokens", type=int, default=8192)
    parser.add_argument("--every", type=int, default=8)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--floor", type=float, default=12.0)
    parser.add_argument("--case", choices=CASES, help="run one case in this process")
    parser.add_argument("--out", default="cache_growth.json")
    args = parser.parse_args()
    if args.case:
        child.report(run_case(args.case, args))
        return
    results = []
    for case in CASES:
        result, proc = child.run("bench.probes.cache_growth", ["--case", case, *sys.argv[1:]])
        if result is None:
            result = {"case": case, "cache_limit_GiB": None, "seconds": 0.0, "steps": [],
                      "peak_GiB": 0.0, "error": f"exit {proc.returncode}: {proc.stderr[-2000:]}"}
        results.append(result)
        print(json.dumps(summary(result)), flush=True)
    Path(args.out).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
