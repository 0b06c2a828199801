"""paged_prefix's `vllm serve` against mlx-lm's own server: same folder, client and workloads.

    nox -s serve-bench -- --against mlx-lm

The servers run on 127.0.0.1 one after the other: `vllm serve` with the plugin and prefix
caching on, then `mlx_lm.server` (its prompt cache on, as by default) behind the adapter
`vllm bench serve` needs (bench/sse_adapter.py); both with MLX's matmuls on OpenBLAS. Against
each, three workloads:
  all at once     serve-bench's prefix_repetition workload with every request sent at once;
  one at a time   the same with --max-concurrency 1 and the next seed (other prefixes, so
                  the first workload's cache cannot serve them), where mlx-lm's prompt cache
                  hits;
  multi-turn      bench/multi_turn.py: conversations whose every turn extends the last.
Printed: TTFT p50/p90, TPOT p50 and output tokens/s per workload and server with the ratio
paged_prefix / mlx-lm and the issue's targets, and the multi-turn TTFT per turn. Written under
--out/against: summary.json, every client's and server's log and against.png.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench import multi_turn, serve_plot
from bench.mlx_lm_server import MlxLmServer
from bench.serve_bench import (
    blas_line,
    client_command,
    client_metrics,
    multi_turn_workload,
    num_requests,
    server_options,
    workload_text,
)
from bench.serve_progress import run_client, server_log_status
from bench.vllm_server import VllmServer

SERVERS = ("paged_prefix", "mlx-lm")
# workload -> (seed offset, max concurrency: 0 is all at once)
PHASES = {"all at once": (0, 0), "one at a time": (1, 1)}
KEYS = [("TTFT p50 (ms)", "ttft_p50_ms", "{:.0f}"), ("TTFT p90 (ms)", "ttft_p90_ms", "{:.0f}"),
        ("TPOT p50 (ms)", "tpot_p50_ms", "{:.1f}"), ("output tokens/s", "output_throughput",
                                                      "{:.1f}")]
# (workload, metric, at most (<=) or at least (>=), times mlx-lm's)
TARGETS = [("all at once", "ttft_p50_ms", "<=", 0.3), ("all at once", "output_throughput", ">=", 1.5),
           ("one at a time", "ttft_p50_ms", "<=", 1.0), ("one at a time", "tpot_p50_ms", "<=", 1.0)]


def _server(kind: str, model: str, args: argparse.Namespace, out: Path):
    if kind == "mlx-lm":
        return MlxLmServer(model, out / "server-mlx-lm.log")
    return VllmServer(model, ["--enable-prefix-caching", *server_options(args)],
                      out / "server-paged_prefix.log")


def run_server(kind: str, model: str, args: argparse.Namespace) -> dict:
    out = args.out
    print(f"[{kind}] starting; log {out / f'server-{kind}.log'}", flush=True)
    with _server(kind, model, args, out) as server:
        vllm = isinstance(server, VllmServer)
        blas = blas_line(server.log_path)
        print(f"[{kind}] up at {server.url}; {blas}", flush=True)
        results = {"blas": blas}
        # mlx-lm answers to its folder's path (another name it would try to download)
        name = server.served_name if vllm else model
        for phase, (seed_offset, concurrency) in PHASES.items():
            slug = phase.replace(" ", "-")
            result_file = f"{kind}-{slug}.json"
            client = client_command(server.url, name, model, args, args.seed + seed_offset,
                                    concurrency, result_file)
            run_client(client, out / f"client-{kind}-{slug}.log", f"{kind}, {phase}",
                       num_requests(args), args.client_timeout,
                       server_log_status(server.log_path))
            results[phase] = client_metrics(json.loads((out / result_file).read_text()))
        workload = multi_turn_workload(args)
        print(f"[{kind}, multi-turn] {workload.conversations} conversations x "
              f"{workload.turns} turns at once", flush=True)
        results["multi-turn"] = multi_turn.run(server.url, name, workload)
        print(f"[{kind}, multi-turn] done in {results['multi-turn']['duration_s']:.0f} s",
              flush=True)
    return results


def tables(results: dict) -> str:
    lines = []
    for workload in (*PHASES, "multi-turn"):
        lines.append(f"{workload:<22}{SERVERS[0]:>14}{SERVERS[1]:>10}{'ratio':>8}")
        for label, key, fmt in KEYS:
            a, b = (results[s][workload][key] for s in SERVERS)
            lines.append(f"  {label:<20}{fmt.format(a):>14}{fmt.format(b):>10}{a / b:>7.2f}x")
    turns = len(results[SERVERS[0]]["multi-turn"]["ttft_p50_ms_per_turn"])
    lines.append("multi-turn TTFT p50 (ms) by turn")
    lines.append(f"  {'':<12}" + "".join(f"{t + 1:>8}" for t in range(turns)))
    for s in SERVERS:
        per_turn = results[s]["multi-turn"]["ttft_p50_ms_per_turn"]
        lines.append(f"  {s:<12}" + "".join(f"{v:>8.0f}" for v in per_turn))
    for workload, key, op, bound in TARGETS:
        ratio = results[SERVERS[0]][workload][key] / results[SERVERS[1]][workload][key]
        met = ratio <= bound if op == "<=" else ratio >= bound
        lines.append(f"target {workload}, {key} {op} {bound}x mlx-lm's: {ratio:.2f}x "
                     f"{'met' if met else 'MISSED'}")
    return "\n".join(lines)


def compare(model: str, args: argparse.Namespace) -> int:
    args = argparse.Namespace(**{**vars(args), "out": args.out / "against"})
    args.out.mkdir(parents=True, exist_ok=True)
    results = {kind: run_server(kind, model, args) for kind in SERVERS}
    turns = multi_turn_workload(args)
    summary = {"model": model, "workload": workload_text(args), "seed": args.seed,
               "multi_turn": vars(turns), "results": results}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    import mlx.core as mx  # after paged_prefix (cpu_blas binds MLX's BLAS at its import)

    on_openblas = all("OpenBLAS" in results[s]["blas"] for s in SERVERS)
    where = "both on OpenBLAS" if on_openblas else f"both on MLX's {mx.default_device()}"
    title = (f"{Path(model).name}: paged_prefix (vllm serve, prefix caching on) vs mlx_lm.server, "
             f"{where}\nprefix_repetition {workload_text(args)}; "
             f"multi-turn {turns.conversations} conversations x {turns.turns} turns, "
             f"{turns.output_len} out")
    print(f"model {model}\nworkload {workload_text(args)}, seed {args.seed}")
    print(tables(results), flush=True)
    serve_plot.against({w: {s: results[s][w] for s in SERVERS} for w in (*PHASES, "multi-turn")},
                       {s: results[s]["multi-turn"]["ttft_p50_ms_per_turn"] for s in SERVERS},
                       title, args.out / "against.png")
    print(f"wrote {args.out}/summary.json, against.png")
    failed = sum(results[s][p]["failed"] for s in SERVERS for p in PHASES)
    return 1 if failed else 0
