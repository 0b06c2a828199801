"""MLX's CPU backend on its bundled reference BLAS vs OpenBLAS, side by side in one run.

    python -m bench.cpu_blas [--repeats 2] [--prompt-tokens 224] [--out docs/cpu/blas.json]

Per dtype (float32, float16, bfloat16): a 1024x1024 matmul's GFLOP/s and the prefill tokens/s
of one SmolLM2-135M prompt through the paged runner (nothing cached; the float32 folder cast
to the dtype), on MLX's bundled BLAS and on OpenBLAS (one thread, cpu_blas's default), and in
float32 on OpenBLAS with 2 threads. A process binds its BLAS once, when mlx.core is first
imported (paged_prefix/cpu_blas.py), so each setting runs in a child process, the settings
taking turns --repeats times; each number is the best over the turns (on a shared machine
the best is the least disturbed).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

DTYPES = ("float32", "float16", "bfloat16")
# setting -> (its environment, the dtypes it runs): a second OpenBLAS thread matters only
# where BLAS runs, float32 (MLX's half-precision matmuls are its own)
SETTINGS = {"bundled": ({"PAGED_PREFIX_CPU_BLAS": "bundled"}, DTYPES),
            "OpenBLAS": ({"PAGED_PREFIX_CPU_BLAS": "openblas"}, DTYPES),
            "OpenBLAS 2 threads": ({"PAGED_PREFIX_CPU_BLAS": "openblas",
                                    "OPENBLAS_NUM_THREADS": "2"}, ("float32",))}
MATMUL_N = 1024
MATMUL_ROUNDS = 5
BLOCK_SIZE = 16


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=2, help="turns of each setting")
    p.add_argument("--prompt-tokens", type=int, default=224)
    p.add_argument("--out", type=Path, default=Path("results/cpu_blas.json"))
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES),
                   help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.repeats < 1:
        raise ValueError(f"--repeats: expected >= 1, got {args.repeats}")
    if args.prompt_tokens < 1:
        raise ValueError(f"--prompt-tokens: expected >= 1, got {args.prompt_tokens}")
    return args


def _prefill_step(model, dtype, prompt):
    """A fresh runner's one-step prefill of `prompt` (greedy), returned as a callable."""
    from paged_prefix.kv_cache import PagedKVCache
    from paged_prefix.metadata import ScheduledRequest, build_batch_metadata
    from paged_prefix.runner import PagedModelRunner

    args = model.args
    blocks = list(range(1, -(-len(prompt) // BLOCK_SIZE) + 1))
    kv = PagedKVCache(args.num_hidden_layers, len(blocks) + 1, BLOCK_SIZE,
                      args.num_key_value_heads, args.head_dim, dtype)
    runner = PagedModelRunner(model, kv)
    meta = build_batch_metadata([ScheduledRequest("r", prompt, len(prompt), 0, len(prompt),
                                                  blocks)], BLOCK_SIZE, len(blocks) + 1)
    return lambda: runner.greedy(meta)


def measure(prompt_tokens: int, dtypes: list[str]) -> dict:
    """This process's numbers, under whatever BLAS PAGED_PREFIX_CPU_BLAS gave it."""
    from paged_prefix import cpu_blas  # first: it must load OpenBLAS before mlx.core

    blas = cpu_blas.require()
    import mlx.core as mx
    import numpy as np

    from paged_prefix.convert_smollm2 import smollm2_folder
    from paged_prefix.model_loader import load_model

    folder = smollm2_folder("float32")
    rng = np.random.default_rng(0)
    out = {"blas": cpu_blas.status_line(), "openblas": blas.active, "dtypes": {}}
    for name in dtypes:
        dtype = getattr(mx, name)
        a, b = (mx.array(rng.standard_normal((MATMUL_N, MATMUL_N)), dtype=dtype) for _ in "ab")
        mx.eval(a @ b)
        times = []
        for _ in range(MATMUL_ROUNDS):
            t0 = time.perf_counter()
            mx.eval(a @ b)
            times.append(time.perf_counter() - t0)
        model = load_model(folder, dtype)
        prompt = rng.integers(3, model.args.vocab_size, prompt_tokens).tolist()
        _prefill_step(model, dtype, prompt[:BLOCK_SIZE])()  # first-call costs off the clock
        step = _prefill_step(model, dtype, prompt)
        t0 = time.perf_counter()
        step()
        prefill_s = time.perf_counter() - t0
        out["dtypes"][name] = {"matmul_gflops": 2 * MATMUL_N ** 3 / min(times) / 1e9,
                               "prefill_tok_s": prompt_tokens / prefill_s}
        del model, step
        mx.clear_cache()
    return out


def run_child(setting: str, prompt_tokens: int) -> dict:
    env, dtypes = SETTINGS[setting]
    base = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    done = subprocess.run([sys.executable, "-m", "bench.cpu_blas", "--child",
                           "--prompt-tokens", str(prompt_tokens), "--dtypes", *dtypes],
                          env={**base, **env}, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.splitlines()[-1])


def best(turns: list[dict]) -> dict:
    return {"blas": turns[0]["blas"], "openblas": turns[0]["openblas"],
            "dtypes": {d: {k: max(t["dtypes"][d][k] for t in turns)
                           for k in ("matmul_gflops", "prefill_tok_s")}
                       for d in turns[0]["dtypes"]}}


def table(results: dict, prompt_tokens: int) -> str:
    names = list(SETTINGS)
    lines = [f"{'':<34}{names[0]:>10}{names[1]:>10}{'ratio':>8}{names[2]:>20}"]
    for key, label in (("matmul_gflops", f"matmul {MATMUL_N}x{MATMUL_N} GFLOP/s"),
                       ("prefill_tok_s", f"prefill {prompt_tokens} tokens, tok/s")):
        for d in DTYPES:
            old, new = (results[s]["dtypes"][d][key] for s in names[:2])
            more = results[names[2]]["dtypes"].get(d)
            lines.append(f"{label + ' ' + d:<34}{old:>10.1f}{new:>10.1f}{new / old:>7.1f}x"
                         + (f"{more[key]:>20.1f}" if more else f"{'-':>20}"))
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.prompt_tokens, args.dtypes)))
        return 0
    turns = {s: [] for s in SETTINGS}
    for turn in range(args.repeats):
        for setting in SETTINGS:
            print(f"[turn {turn + 1}/{args.repeats}] {setting} ...",
                  flush=True)
            turns[setting].append(run_child(setting, args.prompt_tokens))
    results = {s: best(turns[s]) for s in SETTINGS}
    missed = [s for s in SETTINGS if s != "bundled" and not results[s]["openblas"]]
    if missed:
        raise RuntimeError(f"{missed[0]} ran without OpenBLAS: {results[missed[0]]['blas']}")
    summary = {"model": "SmolLM2-135M-Instruct (float32 folder cast per dtype), paged runner",
               "prompt_tokens": args.prompt_tokens, "matmul_n": MATMUL_N,
               "repeats": args.repeats, "cpu_count": os.cpu_count(), "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1) + "\n")
    for s in SETTINGS:
        print(f"{s}: {results[s]['blas']}")
    print(table(results, args.prompt_tokens))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
