"""One-time cost of the first-use check (canary) per kernel variant, on this machine's backend.

    python -m bench.probes.canary_cost [--out canary.json]

For each variant: the first `Dispatcher.plan` of a process, which checks every kernel of the
backend (the paged kernel at each tile height, then the page gather: compiles + the canary
cases + the reference they are compared with), against a second plan of the same variant and
the first plan of the sdpa path after it (the verdicts are cached). Needs a GPU kernel backend
(CUDA or Metal).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import mlx.core as mx

from jit_kernels import available_backends
from jit_kernels.support import Geometry
from paged_prefix.dispatch import Dispatcher
from paged_prefix.metadata import build_attention_metadata

VARIANTS = [(mx.bfloat16, 128, 4, 16), (mx.float16, 128, 4, 16), (mx.bfloat16, 64, 4, 16),
            (mx.bfloat16, 128, 8, 32), (mx.float16, 64, 1, 8)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="canary.json")
    args = parser.parse_args()
    backend = next(iter(available_backends()), None)
    if backend is None:
        sys.exit("no GPU kernel backend on this machine")
    rows = []
    for dtype, head_dim, group, block_size in VARIANTS:
        g = Geometry(8 * group, 8, head_dim, block_size, dtype, head_dim ** -0.5)
        meta = build_attention_metadata([16], [4096], [list(range(1, 4112 // block_size + 2))],
                                        block_size, 4200 // block_size + 4)
        row = {"variant": f"{dtype} d{head_dim} g{group} b{block_size}"}
        for label, path in (("first_ms", backend), ("again_ms", backend), ("sdpa_ms", "sdpa")):
            t0 = time.perf_counter()
            Dispatcher(path, strict=True).plan(meta, g)
            row[label] = (time.perf_counter() - t0) * 1e3
        rows.append(row)
        print(row, flush=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
