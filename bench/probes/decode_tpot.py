"""One request's decode through vLLM's engine with the plugin against mlx-lm's own loop, and
where a step's time goes.

    python -m bench.probes.decode_tpot [--random-weights llama-1b] [--requests 4]
        [--prompt-len 2048] [--output-len 128] [--out results/decode_tpot.json]

Over one folder (SmolLM2-135M by default; --random-weights as serve_bench writes them), one
greedy request at a time, each a new seeded prompt of token ids, every run in a process of its
own (vLLM fixes its platform once a process), one after the other:
  vllm async   vllm.LLM in this process (no API server), prefix caching on, asynchronous
               scheduling (vLLM's default): each step is scheduled and built before the
               engine takes the step before's tokens; steps sent to the device by the engine's
               thread (PAGED_PREFIX_LAUNCH_THREAD=0);
  vllm async, launch thread
               the same with PAGED_PREFIX_LAUNCH_THREAD=1 (the default on CUDA): each step
               sent to the device from the runner's launch thread (paged_prefix/launch.py);
  vllm sync    asynchronous scheduling off;
  mlx-lm       mlx_lm's generate_step over its own cache (it builds token n + 1's graph while
               token n runs).
TPOT: (last token's time - first token's) / (tokens - 1), the median over requests. Each run's
greedy tokens are compared with the first's (the vLLM runs' must be equal; mlx-lm's may part
where a float sum rounds differently). For the vLLM runs the runner's step log (DEBUG) gives
the median decode step: its forward (graph build, then the wait for the step before), its
sampling, and the time from one step's end to the next's start (the engine: outputs,
scheduling); and Python's garbage collections while the requests ran (`gc`: count and time per
generation).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path

from bench.probes import child
from bench.ttft_breakdown import steps_of

RUNS = ("vllm async", "vllm async, launch thread", "vllm sync", "mlx-lm")


def prompts(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(args.seed)
    return [rng.integers(10, vocab - 10, args.prompt_len).tolist() for _ in range(args.requests)]


def tpot(times: list[float]) -> float:
    return 1e3 * (times[-1] - times[0]) / (len(times) - 1)


def run_vllm(model: str, args: argparse.Namespace, run: str) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    from paged_prefix import launch

    os.environ[launch.ENV_VAR] = "1" if run.endswith("launch thread") else "0"

    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    log = logging.getLogger("paged_prefix.vllm_runner")
    llm = LLM(model=model, enable_prefix_caching=True, max_model_len=args.prompt_len + args.output_len + 16,
              kv_cache_memory_bytes=args.kv_cache_memory_bytes, seed=0, max_num_seqs=4,
              async_scheduling=run.startswith("vllm async"))
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    log.addHandler(Keep())
    log.setLevel(logging.DEBUG)
    collections = GcTime()
    gc.callbacks.append(collections)
    results, tokens = [], []
    for i, ids in enumerate(prompts(args, engine.model_config.get_vocab_size())):
        engine.add_request(str(i), {"prompt_token_ids": ids}, params)
        times, seen = [], 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                n = len(out.outputs[0].token_ids)
                times += [time.perf_counter()] * (n - seen)
                seen = n
                if out.finished:
                    tokens.append(list(out.outputs[0].token_ids))
        results.append(tpot(times))
    gc.callbacks.remove(collections)
    log.setLevel(logging.INFO)
    runner = engine.engine_core.engine_core.model_executor.driver_worker.worker.runner
    steps, collected = decode_steps("\n".join(lines)), collections.summary()
    engine.engine_core.shutdown()  # unfreezes the heap
    return {"tpot_ms": results, "tokens": tokens, "steps": steps, "gc": collected,
            "steps_sampled_on_device": runner.steps_sampled_on_device,
            "forwards_built_while_running": runner.forwards_built_while_running,
            "steps_launched_in_thread": runner.launcher.launched_in_thread}


class GcTime:
    """Python's garbage collections while the requests ran (a `gc.callbacks` entry): how many
    of each generation and how long they took. vLLM's engine freezes the heap it starts with,
    so they walk only what the steps allocate."""

    def __init__(self):
        self.counts, self.seconds, self._start = [0, 0, 0], [0.0, 0.0, 0.0], 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.counts[info["generation"]] += 1
            self.seconds[info["generation"]] += time.perf_counter() - self._start

    def summary(self) -> dict:
        return {"collections": self.counts, "ms": [round(1e3 * s, 3) for s in self.seconds],
                "frozen_objects": gc.get_freeze_count()}


def decode_steps(log: str) -> dict:
    """Medians over the one-row decode steps of the runner's log (ms; `between`: from the
    step before's end)."""
    steps = steps_of(log)
    rows = [(before, s) for before, s in zip(steps, steps[1:])
            if s.tokens == 1 and s.decode_rows == 1]
    if not rows:
        return {}
    median = statistics.median
    return {"forward": median(s.forward_ms for _, s in rows),
            "build": median(s.build_ms for _, s in rows),
            "wait": median(s.wait_ms for _, s in rows),
            "sampling": median(s.sample_ms for _, s in rows),
            "between": median(1e3 * (s.start - b.end) for b, s in rows),
            "decode_steps": len(rows)}


def run_mlx_lm(model: str, args: argparse.Namespace) -> dict:
    from paged_prefix import cpu_blas  # before mlx.core: the BLAS vLLM's worker runs on

    cpu_blas.require()
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    model_, tokenizer = load(model)
    results, tokens = [], []
    for ids in prompts(args, model_.args.vocab_size):
        times, out = [], []
        for _, (token, _) in zip(range(args.output_len), generate_step(mx.array(ids), model_)):
            times.append(time.perf_counter())
            out.append(int(token))
        results.append(tpot(times))
        tokens.append(out)
    return {"tpot_ms": results, "tokens": tokens}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--random-weights", default=None)
    p.add_argument("--tokenizer", type=Path, default=None)
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=1 << 30)
    p.add_argument("--out", type=Path, default=Path("results/decode_tpot.json"))
    p.add_argument("--one", choices=RUNS, help=argparse.SUPPRESS)  # a child process's run
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        result = run_mlx_lm(args.model_dir, args) if args.one == "mlx-lm" else \
            run_vllm(args.model_dir, args, args.one)
        child.report(result)
        return 0
    from bench.serve_bench import resolve_model

    model = resolve_model(argparse.Namespace(random_weights=args.random_weights, model=None,
                                             tokenizer=args.tokenizer, dtype=None))
    results = {}
    for run in RUNS:
        result, proc = child.run("bench.probes.decode_tpot", ["--one", run, "--model-dir", model,
                                                              *(argv or sys.argv[1:])])
        if proc.returncode or result is None:
            print(proc.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"{run}: the run failed (exit {proc.returncode})")
        results[run] = result
        median = statistics.median(results[run]["tpot_ms"])
        print(f"{run:<11} TPOT p50 {median:6.2f} ms  {results[run].get('steps', '')}"
              f"{'  gc ' + str(results[run]['gc']) if 'gc' in results[run] else ''}", flush=True)
    base = statistics.median(results["mlx-lm"]["tpot_ms"])
    for run in RUNS[:-1]:
        print(f"{run} / mlx-lm: {statistics.median(results[run]['tpot_ms']) / base:.3f}x")
    first = results[RUNS[0]]["tokens"]
    for run in RUNS[1:]:
        same = sum(a == b for a, b in zip(first, results[run]["tokens"]))
        print(f"{run}: greedy tokens of {same} of {len(first)} requests equal {RUNS[0]}'s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": model, "prompt_len": args.prompt_len,
                                    "output_len": args.output_len, "requests": args.requests,
                                    "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
