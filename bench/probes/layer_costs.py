"""Where one attention layer of the paged runner spends its time, next to mlx-lm's.

    python -m bench.probes.layer_costs [--head-dim 128|64] [--out layer_costs.json]

Times (us per call, many independent calls per mx.eval) the pieces that differ between the
paged path and mlx-lm's contiguous cache, at H=32, Hkv=8, bf16 and D=128 (Llama-3-8B) or 64
(the 1.1B config):
  sdpa/<q>/<kv>   mx.fast.scaled_dot_product_attention with q and K/V laid out as
                  bhsd (contiguous [1, H, L, D]), bshd (a transposed view of [L, H, D]) or
                  slice (mlx-lm's cache: the first L rows of a longer [1, Hkv, cap, D] buffer);
                  lazy: the bshd views built inside each call, as a forward builds them;
  sdpa_path       jit_kernels.contiguous_sdpa on the same new rows (C = 0);
  rope/...        RoPE with one offset per token (the packed batch) vs one scalar offset;
  write/...       the paged cache's write of K and V to contiguous slots (slice updates) and
                  to shuffled ones (scatter) vs mlx-lm's slice update of its K buffer;
  gather          the page-gather kernel over 16384 keys in shuffled pages (GB/s read + write).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from bench.attention_sweep import time_per_call
from jit_kernels import available_backends
from jit_kernels.contiguous_sdpa import plan_sdpa, sdpa_attention
from jit_kernels.page_gather import plan_gather
from jit_kernels.support import Geometry
from paged_prefix.kv_cache import PagedKVCache

H, HKV, D, BS, DTYPE = 32, 8, 128, 16, mx.bfloat16
SHAPES = [(4096, 0), (512, 16384), (2048, 14336)]  # (Lq, cached tokens)


def rand(*shape):
    return mx.random.normal(shape).astype(DTYPE)


def layouts(lq: int, lk: int):
    q_bshd = rand(lq, H, D)
    k_bshd, v_bshd = rand(lk, HKV, D), rand(lk, HKV, D)
    cap = -(-lk // 256) * 256 + 256
    k_buf, v_buf = rand(1, HKV, cap, D), rand(1, HKV, cap, D)
    qs = {"bhsd": mx.contiguous(q_bshd.transpose(1, 0, 2)[None]),
          "bshd": q_bshd.transpose(1, 0, 2)[None]}
    kvs = {"bhsd": (mx.contiguous(k_bshd.transpose(1, 0, 2)[None]),
                    mx.contiguous(v_bshd.transpose(1, 0, 2)[None])),
           "bshd": (k_bshd.transpose(1, 0, 2)[None], v_bshd.transpose(1, 0, 2)[None]),
           "slice": (k_buf[:, :, :lk], v_buf[:, :, :lk])}
    mx.eval(q_bshd, k_bshd, v_bshd, k_buf, v_buf, list(qs.values()), list(kvs.values()))
    return qs, kvs


def main() -> None:
    global D
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="layer_costs.json")
    parser.add_argument("--head-dim", type=int, default=D, choices=(64, 128))
    args = parser.parse_args()
    D = args.head_dim
    rows = {}

    def record(name, fn, nbytes=None):
        us = time_per_call(fn) * 1e6
        rows[name] = {"us": us} | ({"gbps": nbytes / us / 1e3} if nbytes else {})
        print(f"{name:<40}{us:>10.1f} us" + (f"{nbytes / us / 1e3:>10.0f} GB/s" if nbytes else ""),
              flush=True)

    for lq, c in SHAPES:
        qs, kvs = layouts(lq, lq + c)
        for qn, q in qs.items():
            for kn, (k, v) in kvs.items():
                record(f"sdpa/Lq{lq}_C{c}/q_{qn}/kv_{kn}", lambda q=q, k=k, v=v:
                       mx.fast.scaled_dot_product_attention(q, k, v, scale=D ** -0.5,
                                                            mask="causal"))
        if c == 0:
            q3, k3 = rand(lq, H, D), rand(lq, HKV, D)
            mx.eval(q3, k3)
            record(f"sdpa/Lq{lq}_C0/lazy", lambda q3=q3, k3=k3:
                   mx.fast.scaled_dot_product_attention(
                       q3.transpose(1, 0, 2)[None], k3.transpose(1, 0, 2)[None],
                       k3.transpose(1, 0, 2)[None], scale=D ** -0.5, mask="causal"))
            g = Geometry(H, HKV, D, BS, DTYPE, D ** -0.5)
            plan = plan_sdpa(np.array([0, lq]), np.array([lq]), g)
            kc = mx.zeros((lq // BS + 1, BS, HKV, D), DTYPE)
            tables = mx.zeros((1, lq // BS + 1), mx.int32)
            mx.eval(kc, tables)
            record(f"sdpa_path/Lq{lq}_C0", lambda q3=q3, k3=k3, kc=kc, tables=tables, plan=plan:
                   sdpa_attention(q3, k3, k3, kc, kc, tables, plan))
    rope = nn.RoPE(D, base=500000.0)
    for t in (4096, 2048):
        x = rand(t, H, D)
        positions = mx.arange(14336, 14336 + t, dtype=mx.int32)
        xt = x.transpose(1, 0, 2)[None]
        mx.eval(x, positions, xt)
        record(f"rope/T{t}/per_token", lambda x=x, p=positions: rope(x[:, :, None, :], offset=p))
        record(f"rope/T{t}/scalar", lambda xt=xt: rope(xt, offset=14336))
    for t in (4096, 2048):
        cache = PagedKVCache(1, 16384 // BS + 1, BS, HKV, D, DTYPE)
        runs = cache.slots(np.arange(16384 - t, 16384))
        shuffled = cache.slots(np.random.default_rng(0).permutation(16384)[:t])
        k = rand(t, HKV, D)
        buf = [mx.zeros((1, HKV, 16384, D), DTYPE)]
        mx.eval(k, buf)

        def paged_write(cache=cache, k=k, slots=runs):
            cache.write(0, k, k, slots)
            return cache.arrays()

        def slice_write(buf=buf, k=k, t=t):
            buf[0][..., 16384 - t:, :] = k.transpose(1, 0, 2)[None]
            return buf
        record(f"write/T{t}/paged_runs_kv", paged_write)
        record(f"write/T{t}/paged_scatter_kv", lambda w=paged_write, s=shuffled: w(slots=s))
        record(f"write/T{t}/mlx_lm_slice_update_k", slice_write)
    backend = available_backends().get("cuda") or available_backends().get("metal")
    if backend:
        n = 16384
        num_blocks = n // BS + 1
        kc, vc = rand(num_blocks, BS, HKV, D), rand(num_blocks, BS, HKV, D)
        table = mx.array(np.random.default_rng(0).permutation(num_blocks)[None, : n // BS]
                         .astype(np.int32))
        mx.eval(kc, vc, table)
        plan = plan_gather(np.array([n]), [0], BS, HKV, D, DTYPE)
        record(f"gather/C{n}", lambda g=backend.gather, p=plan: g(kc, vc, table, p),
               nbytes=2 * 2 * n * HKV * D * 2)
    Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
