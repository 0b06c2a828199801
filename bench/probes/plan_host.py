"""The paged kernels' per-forward planning on the host, this tree against another revision's,
in one process: what every forward of a GPU's decode pays before its first layer.

    python -m bench.probes.plan_host --rev 4bfe334 [--rounds 15] [--out results/plan_host.json]

No GPU needed: the plans are host work (`plan.build_tile_plan`, then the CUDA kernel's arrays
and launch arguments), so the CUDA paged kernel is planned here with a kernel factory that is
never called. Per case (a decode step of 1 or 16 sequences, and one 512-token suffix, each over
2,048 cached keys; the 1.1B config's heads, head dims 64 and 128): the tile plan alone and the
whole CUDA plan, each timed as the best of `--rounds` rounds of 500 calls, the two trees in
turn (alternating the order); medians over rounds would read the machine's other work.
"""

from __future__ import annotations

import argparse
import importlib
import json
import tempfile
import timeit
from pathlib import Path

import mlx.core as mx
import numpy as np

from bench.probes.tree_ab import PREFIX, import_revision

CALLS = 500
# (name, new tokens per sequence, sequences)
CASES = (("decode, 1 sequence", 1, 1), ("decode, 16 sequences", 1, 16),
         ("512-token suffix", 512, 1))
CONTEXT = 2048
HEADS, KV_HEADS = 32, 8


def planners(prefix: str, head_dim: int, q_len: int, num_seqs: int) -> dict:
    """This case's two calls, made with the tree under `prefix`."""
    def module(name):
        return importlib.import_module(f"{prefix}jit_kernels.{name}")
    geometry = module("geometry")
    tiles = module("plan")
    g = geometry.Geometry(HEADS, KV_HEADS, head_dim, 16, mx.bfloat16, head_dim ** -0.5)
    cu = np.arange(num_seqs + 1) * q_len
    seq = np.full(num_seqs, CONTEXT + q_len)
    lengths = geometry.Lengths.of(cu, seq)
    table = mx.zeros((num_seqs, -(-(CONTEXT + q_len) // 16)), dtype=mx.int32)
    kernel = module("cuda_paged_attention").CudaPagedAttention(lambda **kwargs: None)
    seqs = np.arange(num_seqs)
    return {"tile plan": lambda: tiles.build_tile_plan(cu, seq, g.group, KV_HEADS, 64, 64, 132,
                                                      seqs=seqs),
            "cuda plan": lambda: kernel.plan(lengths, g, table)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rev", required=True, help="the other revision (git)")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", type=Path, default=Path("results/plan_host.json"))
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        sha = import_revision(args.rev, Path(tmp))
        for head_dim in (64, 128):
            for name, q_len, num_seqs in CASES:
                trees = {k: planners(p, head_dim, q_len, num_seqs)
                         for k, p in (("other", PREFIX), ("this", ""))}
                best = {k: {part: float("inf") for part in calls} for k, calls in trees.items()}
                for i in range(args.rounds):
                    for k in list(trees) if i % 2 == 0 else list(trees)[::-1]:
                        for part, call in trees[k].items():
                            seconds = timeit.timeit(call, number=CALLS) / CALLS
                            best[k][part] = min(best[k][part], seconds)
                row = {"case": name, "head_dim": head_dim,
                       **{f"{k} {part} us": round(1e6 * s, 1)
                          for k, parts in best.items() for part, s in parts.items()}}
                rows.append(row)
                print(f"D={head_dim} {name:<22} " + ", ".join(
                    f"{part}: {row[f'other {part} us']:.0f} -> {row[f'this {part} us']:.0f} us"
                    for part in best["this"]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"other": sha, "calls": CALLS, "rounds": args.rounds,
                                    "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
