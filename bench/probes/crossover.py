"""Where SDPA overtakes the paged kernel: the evidence for `rules.CUDA_SDPA_MIN_Q` (CUDA).

    python -m bench.probes.crossover [--out crossover.json]

One sequence of Lq new tokens over C cached ones, pages shuffled (the sweep's geometry), Lq
between the sweep's 64 and 512. Both paths as layers run them: `kernel` = the paged kernel as
planned; `sdpa` = SDPA over the new rows (C = 0) or over the pages copied by the page-gather
kernel (the layout a long-running server's cache is in). Each timed chained (host cost
included, bench/chained_attention.py) and on the GPU alone (bench/gpu_time.py, cycling through
copies of the case past the L2).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mlx.core as mx

from bench.attention_sweep import GEOMETRY, Point, make_case
from bench.chained_attention import chained_us, copies_past_l2
from bench.gpu_time import gpu_us
from jit_kernels import available_backends
from jit_kernels.contiguous_sdpa import attend, plan_sdpa

CONTEXTS = (0, 1024, 4096, 16384)
Q_LENS = (128, 256, 512)


def run_point(point: Point, backend) -> dict:
    case = make_case(point)
    m, g = case.meta, GEOMETRY
    kernel = backend.attention
    kernel_plan = kernel.plan(m.cu_seqlens_q_host, m.seq_lens_host, g)
    sdpa_plan = plan_sdpa(m.cu_seqlens_q_host, m.seq_lens_host, g)  # no host table: gathered

    def paths(c):
        return {"kernel": lambda x: kernel.launch(x, c.k_cache, c.v_cache, c.meta.block_tables,
                                                  kernel_plan),
                "sdpa": lambda x: attend(x, c.k_new, c.v_new, c.k_cache, c.v_cache,
                                         c.meta.block_tables, sdpa_plan, backend.gather)}
    copies = copies_past_l2(point, case)
    row = {"point": point.name, "block_m": kernel_plan.block_m}
    for name, step in paths(case).items():
        row[name] = chained_us(step, case.q)
        row[f"{name}_gpu"] = gpu_us([paths(c)[name] for c in copies], case.q)
    row["kernel_over_sdpa"] = row["kernel"] / row["sdpa"]
    row["kernel_over_sdpa_gpu"] = row["kernel_gpu"] / row["sdpa_gpu"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    backend = available_backends().get("cuda")
    if backend is None:
        raise SystemExit("needs MLX's CUDA backend")
    print(f"{'point':<14}{'kernel us':>10}{'sdpa us':>9}{'ratio':>7}   GPU alone:"
          f"{'kernel us':>10}{'sdpa us':>9}{'ratio':>7}", flush=True)
    rows = []
    for c in CONTEXTS:
        for lq in Q_LENS:
            r = run_point(Point(f"C{c}_Lq{lq}", [lq], [c]), backend)
            rows.append(r)
            print(f"{r['point']:<14}{r['kernel']:10.1f}{r['sdpa']:9.1f}"
                  f"{r['kernel_over_sdpa']:7.2f}{'':13}{r['kernel_gpu']:10.1f}"
                  f"{r['sdpa_gpu']:9.1f}{r['kernel_over_sdpa_gpu']:7.2f}", flush=True)
            mx.clear_cache()
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
