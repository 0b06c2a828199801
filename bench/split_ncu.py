"""Split-KV chunking side by side under Nsight Compute: the paged kernel's GPU time per
(chunk: the fewest kv tiles a split part aims for, items per SM), next to the contiguous-SDPA
ceiling.

    ncu --profile-from-start off --metrics gpu__time_duration.sum --csv --print-units base \\
        python bench/split_ncu.py --labels labels.txt > split.csv
    python bench/split_ncu.py --table split.csv --labels labels.txt

Points are bench/attention_sweep.py's. Every launch is its own evaluation followed by a
marker kernel (`mx.arange`), which is how the table groups the profile's kernels by launch;
the table keeps each label's fastest launch.
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import sys
from collections import defaultdict
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from attention_sweep import GEOMETRY, ceiling_fn, make_case, sweep_points  # noqa: E402

from jit_kernels.cuda_paged_attention import CudaPagedAttention  # noqa: E402

POINTS = "C1024_Lq16,C4096_Lq16,C16384_Lq16,C1024_Lq64,C4096_Lq64,C16384_Lq64"
CHUNKINGS = ((2, 2), (4, 1), (8, 1), (16, 1))  # (min kv tiles a chunk, items per SM)
MARKER = "arange"


def launches(point_names: list[str]) -> list[tuple[str, object]]:
    points = {p.name: p for p in sweep_points(quick=False)}
    runs = []
    for name in point_names:
        case = make_case(points[name])
        m = case.meta
        runs.append((f"{name} ceiling", ceiling_fn(case, GEOMETRY.scale)))
        for min_tiles, per_sm in CHUNKINGS:
            kernel = CudaPagedAttention()
            kernel.split_min_kv_tiles, kernel.split_items_per_sm = min_tiles, per_sm
            plan = kernel.plan(m.cu_seqlens_q_host, m.seq_lens_host, GEOMETRY)
            runs.append((f"{name} chunk>={min_tiles} {per_sm}/SM items={plan.tiles.num_items}",
                         lambda k=kernel, p=plan, c=case: k(c.q, c.k_cache, c.v_cache,
                                                            c.meta.block_tables, p)))
    return runs


def profile(point_names: list[str], labels: Path, repeats: int) -> None:
    runs = launches(point_names)
    for _, fn in runs:  # compile and warm every variant outside the profiled range
        for _ in range(3):
            mx.eval(fn())
    mx.synchronize()
    cuda = ctypes.CDLL("libcuda.so.1")
    with labels.open("w") as f:
        cuda.cuProfilerStart()
        for label, fn in runs:
            for _ in range(repeats):
                f.write(label + "\n")
                mx.eval(fn())
                mx.eval(mx.arange(7))
        mx.synchronize()
        cuda.cuProfilerStop()


def table(csv_path: Path, labels: Path) -> None:
    rows = list(csv.reader(line for line in csv_path.open() if line.startswith('"')))
    col = {name: i for i, name in enumerate(rows[0])}
    kernels: dict = {}
    for r in rows[1:]:
        k = kernels.setdefault(int(r[col["ID"]]), {"name": r[col["Kernel Name"]]})
        k[r[col["Metric Name"]]] = float(r[col["Metric Value"]].replace(",", ""))
    groups, current = [], []
    for k in kernels.values():
        if MARKER in k["name"].lower():
            groups.append(current)
            current = []
        else:
            current.append(k)
    names = labels.read_text().splitlines()
    if len(groups) != len(names):
        raise SystemExit(f"{len(names)} launches labelled but {len(groups)} in the profile")
    best: dict = defaultdict(lambda: float("inf"))
    for name, group in zip(names, groups):
        best[name] = min(best[name], sum(k["gpu__time_duration.sum"] for k in group) / 1e3)
    ceiling = {}
    for name, us in best.items():
        point = name.split()[0]
        ceiling.setdefault(point, us)  # each point's ceiling is labelled first
        print(f"{name:<44}{us:9.1f} us{us / ceiling[point]:7.2f}x ceiling")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", default=POINTS, help="comma-separated sweep points")
    parser.add_argument("--labels", type=Path, required=True, help="one line per launch")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--table", type=Path, help="table an Nsight Compute CSV of a run")
    args = parser.parse_args()
    if args.table:
        table(args.table, args.labels)
    else:
        profile(args.points.split(","), args.labels, args.repeats)


if __name__ == "__main__":
    main()
