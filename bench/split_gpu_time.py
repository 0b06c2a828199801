"""Split-KV chunking and pipeline depth side by side, by GPU time alone (CUDA).

    python bench/split_gpu_time.py [--points C4096_Lq16,...] [--out split_gpu_time.json]

Each variant of the paged kernel (K/V stages in flight, the fewest kv tiles a split part aims
for, items per SM) is timed as a chain of layer-like calls on the GPU alone
(bench/gpu_time.py), cycling through copies of the point's K/V that together exceed twice the
L2, next to the contiguous-SDPA ceiling timed the same way. Points are bench/attention_sweep.py's.
The stage count is the kernel module's constant, set before each variant is planned and built.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from attention_sweep import GEOMETRY, make_case, point_cost, sweep_points  # noqa: E402
from chained_attention import ceiling_gpu_us, copies_past_l2  # noqa: E402
from gpu_time import gpu_us  # noqa: E402

import jit_kernels.cuda_paged_attention as cuda_attention  # noqa: E402

POINTS = "C1024_Lq16,C4096_Lq16,C16384_Lq16,C4096_Lq64,C16384_Lq64"
STAGES = (2, 3, 4)
CHUNKINGS = ((2, 2), (4, 1), (8, 1), (16, 1))  # (min kv tiles a chunk, items per SM)


def run_point(point) -> list[dict]:
    case = make_case(point)
    copies = copies_past_l2(point, case)
    nbytes, m = point_cost(point)[1], case.meta
    ceiling = ceiling_gpu_us(copies)
    print(f"{point.name} ceiling{ceiling:36.1f} us{nbytes / ceiling / 1e3:7.0f} GB/s", flush=True)
    rows = [{"point": point.name, "variant": "ceiling", "us": ceiling}]
    default = cuda_attention.STAGES
    try:
        for stages in STAGES:
            cuda_attention.STAGES = stages
            for min_tiles, per_sm in CHUNKINGS:
                kernel = cuda_attention.CudaPagedAttention()
                kernel.split_min_kv_tiles, kernel.split_items_per_sm = min_tiles, per_sm
                plan = kernel.plan(m.cu_seqlens_q_host, m.seq_lens_host, GEOMETRY)
                us = gpu_us([lambda x, c=c, k=kernel, p=plan: k.launch(
                    x, c.k_cache, c.v_cache, c.meta.block_tables, p) for c in copies], case.q)
                variant = (f"stages={stages} chunk>={min_tiles} {per_sm}/SM "
                           f"items={plan.tiles.num_items}")
                print(f"{point.name} {variant:<38}{us:8.1f} us{nbytes / us / 1e3:7.0f} GB/s"
                      f"{us / ceiling:7.2f}x ceiling", flush=True)
                rows.append({"point": point.name, "variant": variant, "us": us,
                             "over_ceiling": us / ceiling})
    finally:
        cuda_attention.STAGES = default
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", default=POINTS, help="comma-separated sweep points")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    points = {p.name: p for p in sweep_points(quick=False)}
    rows = []
    for name in args.points.split(","):
        rows += run_point(points[name])
        mx.clear_cache()
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
