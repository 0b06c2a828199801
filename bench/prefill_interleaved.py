"""Paged prefill vs mlx-lm's contiguous prompt cache, steps interleaved round by round.

    python -m bench.prefill_interleaved [--shape llama-1b:4096] [--budget-s 3] [--out x.json]

The same steps as bench/test_bench_prefill.py (bench/prefill_setup.py's mlx-lm, auto and
auto-scattered), but each round runs one step of every implementation in turn, so drift of the
machine (clocks, other load) falls on all of them alike.
Short steps (a few ms, mostly host work) move 10-30% between pytest-benchmark rows measured a
minute apart on a GPU host; interleaved medians move far less.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from bench.prefill_setup import HIT_FRACTIONS, SHAPES, hit_tokens, setup_for


def timed(step) -> float:
    """Seconds of one step, after its untimed `prepare` where it has one."""
    getattr(step, "prepare", lambda: None)()
    t0 = time.perf_counter()
    step()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", action="append", default=[],
                        help="model:prompt_len (repeatable); default: the benchmark's shapes")
    parser.add_argument("--budget-s", type=float, default=3.0,
                        help="seconds per row: rounds = budget / (one round), 10 to 40")
    parser.add_argument("--out", default="results/prefill_interleaved.json")
    args = parser.parse_args()
    shapes = [(n, int(p)) for n, p in (s.split(":") for s in args.shape)] or SHAPES
    rows = []
    for name, prompt_len in shapes:
        s = setup_for(name, prompt_len)
        for fraction in HIT_FRACTIONS:
            hit = hit_tokens(prompt_len, fraction)
            steps = {"mlx-lm": s.mlx_lm_prefill(hit), "auto": s.paged_prefill(hit, "auto"),
                     "auto-scattered": s.paged_prefill(hit, "auto", "scattered")}
            for step in steps.values():  # warm: compile, cuDNN graphs, the rule's second ask
                for _ in range(3):
                    timed(step)
            rounds = max(10, min(40, int(args.budget_s / sum(timed(s) for s in steps.values()))))
            times = {impl: [] for impl in steps}
            for _ in range(rounds):
                for impl, step in steps.items():
                    times[impl].append(timed(step) * 1e3)
            row = {"model": name, "prompt_len": prompt_len, "hit": hit, "rounds": rounds,
                   "path": steps["auto"].runner.dispatcher.last.path,
                   **{f"{impl}_ms": statistics.median(t) for impl, t in times.items()}}
            row["auto_over_mlx_lm"] = row["auto_ms"] / row["mlx-lm_ms"]
            row["scattered_path"] = steps["auto-scattered"].runner.dispatcher.last.path
            row["scattered_over_mlx_lm"] = row["auto-scattered_ms"] / row["mlx-lm_ms"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
