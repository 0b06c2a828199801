"""Sliding-window attention cost follows the window, not the context.

    python -m bench.window_cost --out results/window_cost.json [--quick]

At a fixed window W = 4096: prefills of Lq = 512 new tokens and batches of 32 decode rows over
contexts C = 4096 and 32768 (H=32, Hkv=8, D=128, bf16, block 16). Paths: ceiling = cuDNN's
SDPA on the keys from the first one a new query sees, already contiguous (no paging, no key
left of the window; `bench.attention_sweep.ceiling_fn`);
kernel = the backend's paged kernel where it implements windows; sdpa = SDPA over pages
gathered from the window's first page on (pages shuffled); in place = SDPA over the window's
pages read in place (one run of blocks); auto = the dispatcher's route. Each path's cost at
C = 32768 over its cost at C = 4096 should stay near 1 (the target: at most 1.2x for Lq = 512).
Timing as `bench.attention_sweep` (host-timed K calls per evaluation; on CUDA also GPU alone).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mlx.core as mx

from bench.attention_sweep import Point, ceiling_fn, checked, make_case, time_per_call
from bench.gpu_time import gpu_us_together
from bench.steady_route import steady_dispatcher
from jit_kernels import ContiguousSdpa, GatheredSdpa, available_backends
from jit_kernels.geometry import Geometry
from paged_prefix.attention_metadata import build_attention_metadata

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, DTYPE = 32, 8, 128, 16, mx.bfloat16
GPU_CALLS = 10


def points(quick: bool) -> tuple[int, list[Point]]:
    window, contexts, lq, rows = (64, (64, 512), 16, 4) if quick else (4096, (4096, 32768), 512,
                                                                     32)
    pts = []
    for c in contexts:
        pts.append(Point(f"W{window}_C{c}_Lq{lq}", [lq], [c]))
        pts.append(Point(f"W{window}_C{c}_decode{rows}", [1] * rows, [c] * rows))
    return window, pts


def path_fns(point: Point, g: Geometry, backend_name: str | None) -> dict:
    case = make_case(point)
    m = case.meta
    lengths, tables = m.lengths, m.block_tables
    args = (case.q, case.k_new, case.v_new, case.k_cache, case.v_cache)
    starts = lengths.key_starts(g.window)
    fns = {"ceiling": ceiling_fn(case, g)}
    fns["sdpa"] = checked([(GatheredSdpa(), GatheredSdpa().plan(lengths, g, tables))], args)
    # the same tokens on one run of blocks, read in place
    ctx = [int(c) for c in m.context_lens_host]
    needed = [-(-int(n) // BLOCK_SIZE) for n in m.seq_lens_host]
    firsts = [sum(needed[:s]) for s in range(len(needed))]
    run_meta = build_attention_metadata(point.q_lens, ctx, [list(range(f, f + n)) for f, n in
                                                            zip(firsts, needed)],
                                        BLOCK_SIZE, case.k_cache.shape[0])
    skip = [int(starts[s]) // BLOCK_SIZE for s in range(len(ctx))]  # pages left of the window
    runs = {s: ((firsts[s] + skip[s], needed[s] - skip[s]),) for s in range(len(ctx))}
    in_place = ContiguousSdpa().plan(run_meta.lengths, g, run_meta.block_tables, runs=runs)
    fns["in place"] = checked([(ContiguousSdpa(), in_place)], args)
    backend = available_backends().get(backend_name)
    if backend and backend.attention.unsupported_reason(g) is None:
        fns["kernel"] = checked([(backend.attention, backend.attention.plan(lengths, g, tables))],
                                args)
    auto = steady_dispatcher()
    auto.plan(m, g)
    attention = auto.plan(m, g)
    fns["auto"] = lambda: attention(*args)
    return fns, f"{attention.route.path} ({attention.route.reason})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/window_cost.json", help="JSON results path")
    parser.add_argument("--quick", action="store_true", help="small sizes (CPU smoke run)")
    args = parser.parse_args()
    backend_name = next(iter(available_backends()), None)
    window, pts = points(args.quick or backend_name is None)
    g = Geometry(HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, DTYPE, HEAD_DIM ** -0.5, window=window)
    rows = []
    for p in pts:
        fns, route = path_fns(p, g, backend_name)
        row = {"point": p.name, "route": route}
        for name, fn in fns.items():
            row[name] = {"us": time_per_call(fn) * 1e6}
            if backend_name == "cuda":
                row[name]["gpu_us"] = gpu_us_together([fn] * GPU_CALLS)
        rows.append(row)
        print(p.name, {k: round(v["us"], 1) for k, v in row.items() if isinstance(v, dict)},
              route, flush=True)
        mx.clear_cache()
    ratios = {}
    key = "gpu_us" if backend_name == "cuda" else "us"
    for kind in ("Lq", "decode"):
        short, long = [r for r in rows if f"_{kind}" in r["point"]]
        ratios[kind] = {name: long[name][key] / short[name][key] for name in short
                        if isinstance(short[name], dict)}
        print(f"{kind}: cost at the long context over the short one ({key}):",
              {k: round(v, 2) for k, v in ratios[kind].items()})
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    info = {"device": mx.device_info(), "backend": backend_name, "window": window,
            "dtype": str(DTYPE), "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
            "block_size": BLOCK_SIZE, "timing": key}
    Path(args.out).write_text(json.dumps({"info": info, "rows": rows, "ratios": ratios},
                                         indent=1, default=str))


if __name__ == "__main__":
    main()
