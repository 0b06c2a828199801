"""One attention-sweep point's paged kernel, launched inside a profiler range for Nsight Compute.

    ncu --profile-from-start off --metrics gpu__time_duration.sum,dram__bytes_read.sum \\
        --csv python bench/kernel_ncu.py --point C4096_Lq16 > kernel_ncu.csv

The kernel is compiled and warmed up before the range; each launch inside it is its own
evaluation, so Nsight Compute sees the kernel alone (GPU time and DRAM bytes, no host cost).
Nsight serializes and replays the launches: with clocks unlocked (`--clock-control none`) an
otherwise idle GPU may run them below its boost clock.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from attention_sweep import GEOMETRY, make_case, sweep_points  # noqa: E402

from jit_kernels import available_backends  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--point", default="C4096_Lq16", help="a bench/attention_sweep.py point")
    parser.add_argument("--launches", type=int, default=3)
    args = parser.parse_args()
    if "cuda" not in available_backends():
        raise SystemExit("kernel_ncu: needs MLX's CUDA backend")
    points = {p.name: p for p in sweep_points(quick=False)}
    if args.point not in points:
        raise SystemExit(f"--point: expected one of {sorted(points)}, got {args.point!r}")
    case = make_case(points[args.point])
    m, kernel = case.meta, available_backends()["cuda"].attention
    plan = kernel.plan(m.cu_seqlens_q_host, m.seq_lens_host, GEOMETRY)

    def launch():
        mx.eval(kernel(case.q, case.k_cache, case.v_cache, m.block_tables, plan))
    for _ in range(5):
        launch()
    mx.synchronize()
    cuda = ctypes.CDLL("libcuda.so.1")
    cuda.cuProfilerStart()
    for _ in range(args.launches):
        launch()
    mx.synchronize()
    cuda.cuProfilerStop()


if __name__ == "__main__":
    main()
