"""Would the page gather's old first-use check pass on this GPU? Defect 1 of docs/results.md.

    python -m bench.probes.gather_canary

Per variant (head dims 32, 64 and 128; group 1 and 4; block sizes 16 and 8), the canary's case
(`paged_prefix.canary`) through the backend's gather kernel + SDPA and through MLX's take + SDPA:
the check before f39db38 demanded the two outputs equal bit for bit, which SDPA over another
layout need not give; the check now (`canary.check`) compares the copies. Prints both verdicts.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from jit_kernels import GatheredSdpa, available_backends
from jit_kernels.geometry import Geometry, Lengths
from paged_prefix import canary

VARIANTS = [(32, mx.float16), (32, mx.float32), (64, mx.bfloat16), (128, mx.float16)]


def main() -> None:
    backends = available_backends()
    if not backends:
        raise SystemExit("no GPU kernel backend here: the probe compares a gather kernel")
    backend = next(iter(backends.values()))
    for head_dim, dtype in VARIANTS:
        for group, block_size in ((1, 16), (4, 16), (4, 8)):
            g = Geometry(2 * group, 2, head_dim, block_size, dtype, head_dim ** -0.5)
            small, q, k_cache, v_cache, table, cu, seq_lens, _ = canary._case(g)
            lengths = Lengths.of(cu, seq_lens)
            new = mx.zeros((q.shape[0], 2, head_dim), dtype=dtype)
            outs = [np.array(ex.run(q, new, new, k_cache, v_cache, ex.plan(lengths, small, table))
                             .astype(mx.float32)) for ex in (backend.gathered, GatheredSdpa())]
            differ = int((outs[0] != outs[1]).sum())
            now = canary.check(backend.gathered, g)
            print(f"D={head_dim} {dtype} group={group} block={block_size}: old bit-equality check "
                  f"{'FAILS' if differ else 'passes'} ({differ} of {outs[0].size} outputs "
                  f"differ, max |diff| {np.abs(outs[0] - outs[1]).max():.3g}); current copy "
                  f"check: {'passes' if now is None else 'FAILS ' + now}")


if __name__ == "__main__":
    main()
