"""Host vs device time of one prefill forward, paged runner vs mlx-lm's contiguous cache.

    python bench/forward_split.py [--model llama-1b] [--prompt-len 4096] [--out split.json]

For each hit length and implementation (as in bench/test_bench_prefill.py): `build` is the
time to construct the forward's lazy graph in Python (no device work), `total` the time of the
whole step (build + evaluate). Their difference bounds the device side; a path that builds
more ops pays for them on every forward, because the step's host sync leaves nothing to hide
the build behind.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_bench_prefill import HIT_FRACTIONS, Setup, hit_tokens  # noqa: E402

from jit_kernels import available_backends  # noqa: E402
from paged_prefix.dispatch import Dispatcher  # noqa: E402


def median_ms(fn, reps: int = 7) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-1b")
    parser.add_argument("--prompt-len", type=int, default=4096)
    parser.add_argument("--out", default="forward_split.json")
    args = parser.parse_args()
    s = Setup(args.model, args.prompt_len)
    paths = ["auto", "sdpa", *available_backends()]
    rows = []
    for fraction in HIT_FRACTIONS:
        hit = hit_tokens(args.prompt_len, fraction)
        suffix = mx.array([s.prompt[hit:]])
        step = s.mlx_lm_prefill(hit)

        def build_mlx_lm(suffix=suffix, hit=hit):
            s.dense.lm_head(s.dense.model(suffix, cache=s.cache)[:, -1])
            for c in s.cache:
                c.trim(args.prompt_len - hit)
        row = {"hit": hit, "mlx-lm": {"build_ms": median_ms(build_mlx_lm),
                                      "total_ms": median_ms(step)}}
        meta = s.meta(hit)
        for path in paths:
            s.runner.dispatcher = Dispatcher(path)
            snapshot = s.runner.kv_cache.snapshot()

            def build_paged(meta=meta, snapshot=snapshot):
                s.runner.forward(meta)
                s.runner.kv_cache.restore(snapshot)  # drop the unevaluated writes
            row[path] = {"build_ms": median_ms(build_paged),
                         "total_ms": median_ms(s.paged_prefill(hit, path)),
                         "path": s.runner.dispatcher.last.path}
        rows.append(row)
        print(json.dumps(row), flush=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
