"""The Hopper paged kernel's split-KV chunking, timed both ways the benchmarks time (CUDA, sm_90).

    python bench/split_chunk.py [--points C1024_Lq64,C512_Lq64] [--chunks 8,9] [--out x.json]

For each point (bench/attention_sweep.py's geometry: `C<cached>_Lq<new>` or `C<cached>_decode<n>`)
and each fewest kv tiles a split part takes (`wgmma_split_min_kv_tiles`), the wgmma kernel's GPU time
a call: 20 independent calls evaluated together (the sweep's measure) and a chain of dependent
calls through copies past the L2 (bench/chained_attention.py's), each over cuDNN SDPA on
contiguous K/V timed the same way.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from attention_sweep import GEOMETRY, GPU_CALLS, Point, ceiling_fn, make_case, point_named  # noqa: E402
from chained_attention import ceiling_gpu_us, copies_past_l2  # noqa: E402
from gpu_time import gpu_us, gpu_us_together  # noqa: E402

from jit_kernels.hopper_paged_attention import HopperPagedAttention, unavailable_reason  # noqa: E402


def run_point(p: Point, chunks: list[int]) -> dict:
    case = make_case(p)
    copies = copies_past_l2(p, case)
    m = case.meta
    together = gpu_us_together([ceiling_fn(case, GEOMETRY.scale)] * GPU_CALLS)
    chained = ceiling_gpu_us(copies)
    print(f"{p.name:14s} ceiling{'':13s}{together:8.1f}{chained:8.1f}", flush=True)
    row = {"point": p.name, "ceiling": {"together": together, "chained": chained}}
    for chunk in chunks:
        kernel = HopperPagedAttention()
        kernel.wgmma_split_min_kv_tiles = chunk
        plan = kernel.plan(m.cu_seqlens_q_host, m.seq_lens_host, GEOMETRY)
        t = gpu_us_together([lambda k=kernel, pl=plan: k(case.q, case.k_cache, case.v_cache,
                                                         m.block_tables, pl)] * GPU_CALLS)
        c = gpu_us([lambda x, c=c, k=kernel, pl=plan: k.launch(x, c.k_cache, c.v_cache,
                                                               c.meta.block_tables, pl)
                    for c in copies], case.q)
        print(f"{p.name:14s} parts>={chunk:<3d} items={plan.tiles.num_items:<4d}{t:8.1f}{c:8.1f}"
              f"{t / together:7.2f}x{c / chained:6.2f}x", flush=True)
        row[f"parts>={chunk}"] = {"items": plan.tiles.num_items, "together": t, "chained": c}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", default="C512_Lq64,C1024_Lq16,C1024_Lq64,C2048_Lq64,"
                        "C4096_Lq16,C4096_Lq64,C16384_Lq16,C16384_Lq64")
    parser.add_argument("--chunks", default="8,9", help="fewest kv tiles a part, comma-separated")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if (why := unavailable_reason()) is not None:
        raise SystemExit(f"split_chunk: the wgmma kernel cannot run here: {why}")
    print(f"{'point':14s} {'':20s}together chained (us a call, GPU alone)")
    rows = []
    for name in args.points.split(","):
        rows.append(run_point(point_named(name), [int(c) for c in args.chunks.split(",")]))
        mx.clear_cache()
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
