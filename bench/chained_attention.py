"""Attention timed as layers run it: each call's output is the next call's q.

    python -m bench.chained_attention --out chained.json [--only C4096_Lq16,...]

`bench/attention_sweep.py` evaluates many independent calls at once, and MLX's CUDA backend
may run independent launches side by side: a launch that fills a fraction of the GPU (cuDNN's
or ours, at short suffixes) then looks faster than it runs inside a forward, where each layer
waits for the one before. Here every call depends on the previous one, so the figures are
per-layer latencies (host cost per call included, as in a forward). Same points and geometry
as the sweep but mixed8 (the output of one call must be the next's q: single sequences, and
decode batches, whose ceiling is one batched SDPA call).

Paths: ceiling = SDPA on contiguous K/V; kernel = the paged kernel as planned; auto = the
dispatcher's route for a shape asked for before (its long-run route: bench/steady_route.py).

On CUDA the same chains are timed on the GPU alone too (bench/gpu_time.py: no host cost),
cycling through copies of the case whose K/V together exceed twice the L2, as a forward's
layers each read their own; `kern GB/s` = K/V + q + out bytes per call / the kernel's GPU time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx

from bench.attention_sweep import GEOMETRY, make_case, point_cost, sweep_points
from bench.gpu_time import gpu_us
from bench.steady_route import steady_dispatcher
from jit_kernels import available_backends

L2_BYTES = 50 * 2**20  # H100 / H200
MAX_COPIES = 32


def chained_us(step, x0: mx.array, calls: int = 50, samples: int = 5) -> float:
    """Median microseconds per call of `calls` dependent calls x <- step(x)."""
    mx.eval(step(x0))
    times = []
    for _ in range(samples):
        x = x0
        t0 = time.perf_counter()
        for _ in range(calls):
            x = step(x)
        mx.eval(x)
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times) * 1e6


def is_decode(point) -> bool:
    return len(point.q_lens) > 1 and set(point.q_lens) == {1} and len(set(point.ctx_lens)) == 1


def ceiling_chain(case) -> tuple:
    """(step, x0): SDPA on contiguous K/V, one sequence (causal) or a decode batch at once."""
    single = len(case.q_seqs) == 1  # its arrays as they are: no copy of K/V
    q, k, v = (x[0] if single else mx.concatenate(x)
               for x in (case.q_seqs, case.k_seqs, case.v_seqs))
    mask = "causal" if single else None
    return (lambda x: mx.fast.scaled_dot_product_attention(x, k, v, scale=GEOMETRY.scale,
                                                           mask=mask)), q


def run_point(point, backend) -> dict:
    case, g = make_case(point), GEOMETRY
    m = case.meta
    row = {"point": point.name, "ceiling": chained_us(*ceiling_chain(case))}
    kernel = backend.attention
    plan = kernel.plan(m.lengths, g, m.block_tables)
    row["kernel"] = chained_us(lambda x: kernel.launch(x, case.k_cache, case.v_cache, plan),
                               case.q)
    row["block_m"], row["items"] = plan.block_m, plan.tiles.num_items
    dispatcher = steady_dispatcher()
    dispatcher.plan(m, g)
    auto = dispatcher.plan(m, g)
    row["auto"] = chained_us(lambda x: auto(x, case.k_new, case.v_new, case.k_cache,
                                            case.v_cache), case.q)
    row["auto_path"] = auto.route.path
    row["auto_over_ceiling"] = row["auto"] / row["ceiling"]
    if backend.name == "cuda":
        row["gpu"] = gpu_row(point, case, kernel, dispatcher)
    return row


def copies_past_l2(point, case) -> list:
    """`case` and as many more of the point's cases as make their K/V exceed twice the L2."""
    kv_bytes = case.k_cache.nbytes + case.v_cache.nbytes
    return [case] + [make_case(point, seed=i) for i in
                     range(1, min(MAX_COPIES, -(-2 * L2_BYTES // kv_bytes)))]


def ceiling_gpu_us(copies: list) -> float:
    chains = [ceiling_chain(c) for c in copies]
    return gpu_us([step for step, _ in chains], chains[0][1])


def gpu_row(point, case, kernel, dispatcher) -> dict:
    """GPU microseconds per call of each path, cycling through copies of the case."""
    copies = copies_past_l2(point, case)
    autos = [dispatcher.plan(c.meta, GEOMETRY) for c in copies]
    plans = [kernel.plan(c.meta.lengths, GEOMETRY, c.meta.block_tables) for c in copies]
    row = {
        "copies": len(copies),
        "ceiling": ceiling_gpu_us(copies),
        "kernel": gpu_us([lambda x, c=c, p=p: kernel.launch(x, c.k_cache, c.v_cache, p)
                          for c, p in zip(copies, plans)], case.q),
        "auto": gpu_us([lambda x, c=c, a=a: a(x, c.k_new, c.v_new, c.k_cache, c.v_cache)
                        for c, a in zip(copies, autos)], case.q),
    }
    row["kernel_gbps"] = point_cost(point)[1] / row["kernel"] / 1e3
    row["auto_over_ceiling"] = row["auto"] / row["ceiling"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--only", help="comma-separated point names")
    args = parser.parse_args()
    backend = next(iter(available_backends().values()), None)
    if backend is None:
        raise SystemExit("no GPU kernel backend on this machine")
    only = set(args.only.split(",")) if args.only else None
    points = [p for p in sweep_points(False) if p.window is None
              and (len(p.q_lens) == 1 or is_decode(p)) and (only is None or p.name in only)]
    rows = []
    gpu = backend.attention.name == "cuda"
    print(f"{'point':<14}{'ceiling us':>11}{'kernel us':>11}{'auto us':>10}"
          f"{'auto/ceil':>10}  {'auto path':<10}"
          + (f"{'GPU alone: ceil us':>19}{'kern us':>9}{'auto us':>9}{'auto/ceil':>10}"
             f"{'kern GB/s':>10}" if gpu else ""), flush=True)
    for point in points:
        r = run_point(point, backend)
        rows.append(r)
        line = (f"{r['point']:<14}{r['ceiling']:11.1f}{r['kernel']:11.1f}{r['auto']:10.1f}"
                f"{r['auto_over_ceiling']:10.2f}  {r['auto_path']:<10}")
        if gpu:
            q = r["gpu"]
            line += (f"{q['ceiling']:19.1f}{q['kernel']:9.1f}{q['auto']:9.1f}"
                     f"{q['auto_over_ceiling']:10.2f}{q['kernel_gbps']:10.0f}")
        print(line, flush=True)
        mx.clear_cache()
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
