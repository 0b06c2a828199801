"""The Hopper (wgmma) paged kernel against the mma.sync one, side by side (CUDA, sm_90).

    python -m bench.probes.wgmma_vs_mma [--out wgmma_vs_mma.json]

The sweep's geometry (H=32, Hkv=8, D=128, bf16, block 16, pages shuffled), one sequence of Lq
new tokens over C cached ones. Per path (ceiling = cuDNN on contiguous K/V, mma =
`CudaPagedAttention`, wgmma = `HopperPagedAttention`), all on the GPU alone: `together`, 20
independent calls of one plan evaluated at once (the sweep's measure, a throughput), and
`chained`, each call waiting for the one before through copies past the L2 (a layer's latency);
then `wall`, microseconds per call by the wall clock with 200 calls per evaluation (host cost
included: MLX copies and hashes a precompiled kernel's bytes on every call).

Last, the block table of one short sequence (4 or 8 bytes: MLX's CUDA allocator serves such
arrays from a managed pool) against the same table as a view of a longer buffer
(`support.device_array`), each kernel on the GPU alone, together.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mlx.core as mx
import numpy as np

from bench.attention_sweep import GEOMETRY, Point, ceiling_fn, make_case, point_cost, time_per_call
from bench.chained_attention import ceiling_gpu_us, copies_past_l2
from bench.gpu_time import gpu_us, gpu_us_together
from jit_kernels import cuda_paged_attention, hopper_paged_attention

POINTS = [(c, lq) for lq in (16, 64) for c in (0, 1024, 4096, 16384)] + \
    [(4096, 128), (16384, 128), (0, 512), (4096, 512), (16384, 512)]
CALLS = 20


def wall_us(fn) -> float:
    """The sweep's wall-clock timing, held at 200 calls per evaluation (no point's call takes
    the 5 ms that would make it fewer) and 7 samples."""
    return time_per_call(fn, budget_s=1.0, samples=7) * 1e6


def kernel_timings(kernel, plan, case, copies) -> dict:
    def call():
        return kernel.launch(case.q, case.k_cache, case.v_cache, case.meta.block_tables, plan)
    chain = [lambda x, c=c: kernel.launch(x, c.k_cache, c.v_cache, c.meta.block_tables, plan)
             for c in copies]
    return {"block_m": plan.block_m, "items": plan.tiles.num_items,
            "together": gpu_us_together([call] * CALLS), "chained": gpu_us(chain, case.q),
            "wall": wall_us(call)}


def run_point(point: Point, kernels: dict) -> dict:
    case = make_case(point)
    m = case.meta
    copies = copies_past_l2(point, case)
    ceiling = ceiling_fn(case, GEOMETRY.scale)
    row = {"point": point.name, "flops": point_cost(point)[0],
           "ceiling": {"together": gpu_us_together([ceiling] * CALLS),
                       "chained": ceiling_gpu_us(copies), "wall": wall_us(ceiling)}}
    for name, kernel in kernels.items():
        plan = kernel.plan(m.cu_seqlens_q_host, m.seq_lens_host, GEOMETRY)
        row[name] = kernel_timings(kernel, plan, case, copies)
    return row


def table_us(kernel, plan, case, table) -> float:
    return gpu_us_together([lambda: kernel.launch(case.q, case.k_cache, case.v_cache, table,
                                                  plan)] * CALLS)


def table_row(point: Point, kernels: dict) -> dict:
    case = make_case(point)
    m = case.meta
    tiny = mx.array(np.array(m.block_tables_host))  # MLX's small pool when <= 8 bytes
    row = {"point": point.name, "table_bytes": int(m.block_tables_host.nbytes)}
    for name, kernel in kernels.items():
        plan = kernel.plan(m.cu_seqlens_q_host, m.seq_lens_host, GEOMETRY)
        row[f"{name}_pool"] = table_us(kernel, plan, case, tiny)
        row[f"{name}_view"] = table_us(kernel, plan, case, m.block_tables)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    why_not = hopper_paged_attention.unavailable_reason()
    if why_not:
        raise SystemExit(f"needs a Hopper GPU with NVRTC: {why_not}")
    kernels = {"mma": cuda_paged_attention.CudaPagedAttention(),
               "wgmma": hopper_paged_attention.HopperPagedAttention()}
    points = [Point(f"C{c}_Lq{lq}", [lq], [c]) for c, lq in POINTS]
    print(f"{'point':<14}{'':2}{'together: ceil':>14}{'mma':>8}{'wgmma':>8}{'w/ceil':>8}"
          f"{'chained: ceil':>15}{'mma':>8}{'wgmma':>8}{'w/ceil':>8}"
          f"{'wall: ceil':>12}{'mma':>8}{'wgmma':>8}", flush=True)
    rows = []
    for point in points:
        r = run_point(point, kernels)
        rows.append(r)
        c, a, w = r["ceiling"], r["mma"], r["wgmma"]
        print(f"{r['point']:<14}{'':2}{c['together']:14.1f}{a['together']:8.1f}"
              f"{w['together']:8.1f}{w['together'] / c['together']:8.2f}"
              f"{c['chained']:15.1f}{a['chained']:8.1f}{w['chained']:8.1f}"
              f"{w['chained'] / c['chained']:8.2f}{c['wall']:12.1f}{a['wall']:8.1f}"
              f"{w['wall']:8.1f}", flush=True)
        mx.clear_cache()
    print(f"\n{'point':<14}{'table bytes':>12}{'mma pool':>10}{'mma view':>10}"
          f"{'wgmma pool':>12}{'wgmma view':>12}   (us a call, GPU alone, together)", flush=True)
    tables = []
    for point in (Point("C0_Lq16", [16], [0]), Point("C16_Lq16", [16], [16]),
                  Point("C8_decode1", [1], [8])):
        r = table_row(point, kernels)
        tables.append(r)
        print(f"{r['point']:<14}{r['table_bytes']:12d}{r['mma_pool']:10.2f}{r['mma_view']:10.2f}"
              f"{r['wgmma_pool']:12.2f}{r['wgmma_view']:12.2f}", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"points": rows, "tables": tables}, indent=1))


if __name__ == "__main__":
    main()
