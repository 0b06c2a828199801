"""Where one launch of the CUDA paged kernel spends its time: a timer stamp per phase, per block.

    python bench/kernel_timeline.py [--only C4096_Lq16,C0_decode32] [--out timeline.json]

The committed kernel source with one thread of every threadblock writing the GPU's global timer
(ns) at the end of each phase into an extra output. Per launch, each phase's median over the
blocks that ran it; then the median over launches that cycle through copies of the case past
the L2 (as bench/chained_attention.py does). Phases, each from the end of the one before:

    work       the block's work item read (from the block's start)
    first kv   Q and the first K/V tile landed in shared memory
    loop       the key loop; `per kv tile` = loop / the block's kv tiles
    stores     output (or split partial) stored
    arrival    split blocks: stores fenced (tickets are taken before the stores)
    merge      the last split of a tile: the wait for the others' stores, then the merge

`launch` = the last block's end minus the first block's start. A stamp waits for the values it
names (an asm input), not for memory traffic still in flight.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from jit_kernels import cuda_paged_attention as cuda_attention  # noqa: E402

STAMPS = 8  # per block: start, phase ends 1..6, then (kv tiles << 32) | (merged << 16)
TIMER = r"""
__device__ __forceinline__ unsigned long long timer_after(unsigned dep) {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t) : "r"(dep) : "memory");
  return t;
}
#define STAMP(k, dep) if (threadIdx.x == 0) stamps[blockIdx.x * 8 + (k)] = timer_after(dep);
#define NOTE(bits) if (threadIdx.x == 0) stamps[blockIdx.x * 8 + 7] |= (bits);
"""
# (anchor, what replaces it): every anchor must occur once in the kernel source
EDITS = (
    ("  const float scale_log2 = __int_as_float(QK_SCALE_BITS);\n",
     "  const float scale_log2 = __int_as_float(QK_SCALE_BITS);\n"
     "  STAMP(1, seq + tok0 + ntok + pos0 + kvh + kv_start + kv_end + slot)\n"),
    ("  cp_async_wait<STAGES - 1>();  // Q has landed\n  __syncthreads();\n",
     "  cp_async_wait<STAGES - 1>();  // Q has landed\n  __syncthreads();\n  STAMP(2, 0)\n"
     "  NOTE(static_cast<unsigned long long>(num_tiles) << 32)\n"),
    ("  if (warp_active) {\n    for (int mt = 0; mt < MT; ++mt)",
     "  STAMP(3, __float_as_uint(o[0][0][0]))\n"
     "  if (warp_active) {\n    for (int mt = 0; mt < MT; ++mt)"),
    ("  if (slot < 0) return;\n", "  STAMP(4, 0)\n  if (slot < 0) return;\n"),
    ("  if (!is_last) {\n", "  STAMP(5, is_last)\n  if (!is_last) {\n"),
    ("  if (tid == 0)\n    while (load_acquire(",
     "  NOTE(1ull << 16)\n  if (tid == 0)\n    while (load_acquire("),
    ("  if (tid == 0) counter[0] = counter[1] = 0;",
     "  __syncthreads();\n  STAMP(6, 0)\n  if (tid == 0) counter[0] = counter[1] = 0;"),
)


def instrument(source: str) -> str:
    """`source` with the stamps put in; ValueError when an anchor is missing or repeated (the
    kernel changed under this tool)."""
    for anchor, replacement in EDITS:
        if source.count(anchor) != 1:
            raise ValueError(f"kernel_timeline: anchor found {source.count(anchor)} times, "
                             f"not once: {anchor.strip().splitlines()[0]!r}")
        source = source.replace(anchor, replacement)
    return "  STAMP(0, 0)\n" + source


class Timeline:
    """A `cuda_kernel` factory for `CudaPagedAttention`: builds the instrumented kernel, hands
    the product's three outputs back and keeps each launch's stamps in `stamps`."""

    def __init__(self, factory=None):
        self._factory = factory or mx.fast.cuda_kernel
        self.stamps: list[mx.array] = []

    def __call__(self, **spec):
        spec = dict(spec, name=f"timeline_{spec['name']}", header=spec["header"] + TIMER,
                    source=instrument(spec["source"]),
                    output_names=[*spec["output_names"], "stamps"])
        kernel = self._factory(**spec)

        def launch(output_shapes, output_dtypes, grid, threadgroup, **call):
            blocks = grid[0] // threadgroup[0]
            outs = kernel(output_shapes=[*output_shapes, (blocks * STAMPS,)],
                          output_dtypes=[*output_dtypes, mx.uint64], grid=grid,
                          threadgroup=threadgroup, init_value=0, **call)
            self.stamps.append(outs[-1])
            return outs[:-1]
        return launch


def phases(stamps: np.ndarray) -> dict[str, float]:
    """One launch's [blocks * STAMPS] stamps -> microseconds per phase (medians over blocks)."""
    s = stamps.reshape(-1, STAMPS)
    t = s[:, :7].astype(np.int64)
    tiles, merged = (s[:, 7] >> 32).astype(np.int64), ((s[:, 7] >> 16) & 1).astype(bool)
    ran = t > 0
    out = {}
    for k, name in enumerate(("work", "first kv", "loop", "stores"), start=1):
        out[name] = float(np.median(t[:, k] - t[:, k - 1]))
    out["per kv tile"] = float(np.median((t[:, 3] - t[:, 2]) / np.maximum(tiles, 1)))
    if ran[:, 5].any():
        out["arrival"] = float(np.median((t[:, 5] - t[:, 4])[ran[:, 5]]))
    if merged.any():
        out["merge"] = float(np.median((t[:, 6] - t[:, 5])[merged]))
    # a block ends at its merge, its arrival (a split that did not merge) or its stores
    ends = np.where(ran[:, 6], t[:, 6], np.where(ran[:, 5], t[:, 5], t[:, 4]))
    out["launch"] = float(ends.max() - t[:, 0].min())
    return {k: v / 1e3 for k, v in out.items()}


def run_point(point, launches: int = 3) -> dict:
    from attention_sweep import GEOMETRY, make_case
    from chained_attention import copies_past_l2

    case = make_case(point)
    copies = copies_past_l2(point, case)
    timeline = Timeline()
    kernel = cuda_attention.CudaPagedAttention(timeline)
    m = case.meta
    plan = kernel.plan(m.cu_seqlens_q_host, m.seq_lens_host, GEOMETRY)
    for c in copies:  # warm-up: compile, and one pass through the copies
        mx.eval(kernel.launch(case.q, c.k_cache, c.v_cache, c.meta.block_tables, plan))
    timeline.stamps.clear()
    for _ in range(launches):
        for c in copies:
            mx.eval(kernel.launch(case.q, c.k_cache, c.v_cache, c.meta.block_tables, plan))
    per_launch = [phases(np.array(s)) for s in timeline.stamps]
    row = {"point": point.name, "items": plan.tiles.num_items, "copies": len(copies)}
    for name in per_launch[0]:
        row[name] = statistics.median(p[name] for p in per_launch if name in p)
    return row


def main() -> None:
    from attention_sweep import sweep_points

    from jit_kernels import available_backends

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated bench/attention_sweep.py point names")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if "cuda" not in available_backends():
        raise SystemExit("kernel_timeline: needs MLX's CUDA backend")
    points = [p for p in sweep_points(quick=False)
              if p.name != "mixed8" and (not args.only or p.name in args.only.split(","))]
    rows = []
    for point in points:
        row = run_point(point)
        rows.append(row)
        print(f"{row['point']:<16} items {row['items']:>4}  " + "  ".join(
            f"{k} {row[k]:.2f}" for k in ("work", "first kv", "loop", "per kv tile", "stores",
                                          "arrival", "merge", "launch") if k in row) + "  (us)",
              flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
