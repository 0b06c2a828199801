"""The Hopper prefill kernel against gather + SDPA, the wgmma kernel and contiguous cuDNN.

    python -m bench.probes.prefill_kernel [--out prefill_kernel.json] [--points C4096_Lq512,...]
                                   [--chained]                 # sm_90 (H100, H200)

Single sequences, H=32, Hkv=8, D=128, bf16, block 16, pages shuffled (attention_sweep's
cases). Per point, us per call on the GPU alone, 20 calls evaluated together (the sweep's
measure): ceiling = cuDNN SDPA on contiguous K/V; sdpa = the page gather + SDPA; kernel = the
wgmma paged kernel; prefill = the prefill kernel; auto = the dispatcher's steady choice. With
--chained, the ceiling, sdpa and prefill also as layer-like chains through copies of the K/V
past the L2 (bench/chained_attention.py). The grid covers the rule's crossover
(rules.CUDA_PREFILL_MIN_CTX_PER_Q, CUDA_PREFILL_MAX_Q). Exits non-zero if repeated calls of the
prefill kernel differ.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mlx.core as mx

from bench.attention_sweep import GEOMETRY, GPU_CALLS, Point, make_case, path_fns, point_cost, point_named
from bench.chained_attention import ceiling_gpu_us, copies_past_l2
from bench.gpu_time import gpu_us, gpu_us_together
from jit_kernels import available_backends, hopper_paged_attention
from jit_kernels.contiguous_sdpa import attend, plan_sdpa

POINTS = [f"C{c}_Lq{q}" for c, q in (
    (512, 256), (1024, 256), (2048, 256), (4096, 256), (16384, 256), (1024, 512), (2048, 512),
    (4096, 512), (16384, 512), (1024, 1024), (2048, 1024), (4096, 1024), (4096, 2048),
    (8192, 2048), (16384, 2048), (14736, 1648), (4096, 4096), (16384, 4096))]


def time_point(point: Point, chained: bool) -> dict:
    backend = available_backends()["cuda"]
    one, g = make_case(point), GEOMETRY
    m = one.meta
    cu, lens = m.cu_seqlens_q_host, m.seq_lens_host
    fns, auto_path = path_fns(one, "cuda")
    prefill = backend.prefill
    plan = prefill.plan(cu, lens, g)
    gather_plan = plan_sdpa(cu, lens, g)

    def run_prefill(x, c=one):
        return prefill.launch(x, c.k_cache, c.v_cache, c.meta.block_tables, plan)

    def run_sdpa(x, c=one):
        return attend(x, c.k_new, c.v_new, c.k_cache, c.v_cache, c.meta.block_tables,
                      gather_plan, backend.gather)
    repeats = [run_prefill(one.q) for _ in range(4)]
    flops = point_cost(point)[0]
    row = {"point": point.name, "auto_path": auto_path,
           "repeats_bitwise_equal": all(mx.array_equal(repeats[0], r).item() for r in repeats),
           "ceiling": gpu_us_together([fns["ceiling"]] * GPU_CALLS),
           "sdpa": gpu_us_together([lambda: run_sdpa(one.q)] * GPU_CALLS),
           "kernel": gpu_us_together([fns["kernel"]] * GPU_CALLS),
           "prefill": gpu_us_together([lambda: run_prefill(one.q)] * GPU_CALLS),
           "auto": gpu_us_together([fns["auto"]] * GPU_CALLS)}
    row["prefill_tflops"] = flops / row["prefill"] / 1e6
    if chained:
        copies = copies_past_l2(point, one)
        row["chained"] = {
            "ceiling": ceiling_gpu_us(copies),
            "sdpa": gpu_us([lambda x, c=c: run_sdpa(x, c) for c in copies], one.q),
            "prefill": gpu_us([lambda x, c=c: run_prefill(x, c) for c in copies], one.q)}
    mx.clear_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--points", default=",".join(POINTS), help="C<context>_Lq<new tokens>")
    parser.add_argument("--chained", action="store_true")
    args = parser.parse_args()
    why = hopper_paged_attention.unavailable_reason()
    if why:
        raise SystemExit(f"needs a Hopper GPU: {why}")
    rows = []
    print(f"{'point':<15}{'ceiling':>9}{'sdpa':>9}{'kernel':>9}{'prefill':>9}{'auto':>9}  "
          f"{'auto path':<10}{'prefill/ceil':>13}{'prefill/sdpa':>13}  chained ceil/sdpa/prefill")
    for name in (n for n in args.points.split(",") if n):
        r = time_point(point_named(name), args.chained)
        rows.append(r)
        chain = r.get("chained")
        print(f"{r['point']:<15}{r['ceiling']:9.1f}{r['sdpa']:9.1f}{r['kernel']:9.1f}"
              f"{r['prefill']:9.1f}{r['auto']:9.1f}  {r['auto_path']:<10}"
              f"{r['prefill'] / r['ceiling']:13.3f}{r['prefill'] / r['sdpa']:13.3f}  "
              + (f"{chain['ceiling']:.1f} / {chain['sdpa']:.1f} / {chain['prefill']:.1f}"
                 if chain else "-"), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"device": mx.device_info(), "rows": rows}, indent=1))
    if not all(r["repeats_bitwise_equal"] for r in rows):
        raise SystemExit("the prefill kernel's repeated calls differ")


if __name__ == "__main__":
    main()
