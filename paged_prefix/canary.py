"""First-use validation of a kernel variant against the reference (the canary).

A kernel that fails to compile or computes wrong numbers must not take down a server or give
wrong tokens: the first time a variant runs in a process, it runs a small case that exercises
its paths (two sequences with cached prefixes over several pages, a decode row, enough keys
to split KV, NaN-poisoned unused pages and table padding) at each query-tile height its plans
may choose, and is compared with the reference. A variant's case has its features: a window
that cuts every cached prefix (the pages wholly left of it poisoned too), a cap that bends the
logits, sinks of either sign.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

import reference
from jit_kernels import AttentionKernel, GatheredSdpa
from jit_kernels.geometry import Geometry, Lengths

# (q_len, context) per sequence: prefill over a multi-page prefix, a decode row, a chunk.
CASE = ((20, 300), (1, 140), (9, 83))
NUM_KV_HEADS = 2
# A canary's window: shorter than every context of CASE, not a multiple of any block size.
WINDOW = 77
SOFTCAP = 2.0
# Kernel vs the fp32 reference on the same rounded inputs, (atol, rtol): the kernels round P to
# the operand type before P @ V (bf16 ~3e-3 relative, fp16 ~5e-4), plus the output rounding.
TOLERANCES = {mx.float16: (4e-3, 4e-3), mx.bfloat16: (3e-2, 3e-2)}


def _case(variant: Geometry, seed: int = 0):
    """The case for `variant`'s kernel on NUM_KV_HEADS kv heads: (geometry, q, k_cache, v_cache,
    block_tables, cu_seqlens_q, seq_lens, sinks)."""
    g = Geometry(NUM_KV_HEADS * variant.group, NUM_KV_HEADS, variant.head_dim,
                 variant.block_size, variant.dtype, variant.head_dim ** -0.5,
                 window=None if variant.window is None else WINDOW,
                 softcap=None if variant.softcap is None else SOFTCAP, sinks=variant.sinks)
    rng = np.random.default_rng(seed)
    q_lens = [q for q, _ in CASE]
    seq_lens = np.array([q + c for q, c in CASE])
    needed = -(-seq_lens // g.block_size)
    num_blocks = int(needed.sum()) + 2
    pool = rng.permutation(num_blocks)
    poison = int(pool[-1])  # never a page of any sequence: padding entries point here
    table = np.full((len(CASE), int(needed.max()) + 1), poison, dtype=np.int32)
    starts = np.cumsum(needed) - needed
    for s, (start, n) in enumerate(zip(starts, needed)):
        table[s, :n] = pool[start:start + n]
    shape = (num_blocks, g.block_size, NUM_KV_HEADS, g.head_dim)
    owned = np.zeros(num_blocks, dtype=bool)
    owned[pool[:int(needed.sum())]] = True
    first = reference.key_start(seq_lens - np.array(q_lens), g.window) // g.block_size
    for s, n in enumerate(first):  # never read: left of the window
        owned[table[s, :n]] = False
    def kv():  # noqa: E306
        x = rng.standard_normal(shape).astype(np.float32)
        x[~owned] = np.nan
        return mx.array(x).astype(g.dtype)
    k_cache, v_cache = kv(), kv()
    q = mx.array(rng.standard_normal((sum(q_lens), NUM_KV_HEADS * g.group, g.head_dim))
                 .astype(np.float32)).astype(g.dtype)
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    # from -4 to 8, shuffled over the heads: some negligible, some outweighing the hundreds of
    # keys they join (e^8 ~ 3,000 unit-scale keys), so a sink joined on the wrong head shows
    sinks = mx.array(rng.permutation(np.linspace(-4.0, 8.0, g.num_heads)).astype(np.float32)) \
        if g.sinks else None
    return g, q, k_cache, v_cache, mx.array(table), cu, seq_lens, sinks


def _mismatch(out: mx.array, want: mx.array, tol: tuple[float, float]) -> str | None:
    a, b = np.array(out.astype(mx.float32)), np.array(want.astype(mx.float32))
    if a.shape != b.shape:
        return f"output shape {a.shape}, expected {b.shape}"
    err = np.abs(a - b) - (tol[0] + tol[1] * np.abs(b))
    if not np.isfinite(a).all() or err.max() > 0:
        worst = np.unravel_index(np.nanargmax(np.where(np.isfinite(err), err, np.inf)), err.shape)
        return f"differs from the reference at {worst}: {a[worst]} vs {b[worst]}"
    return None


def check(kernel: AttentionKernel, g: Geometry) -> str | None:
    """None when `kernel` matches the reference on this variant's case at every planning its
    compiled variants need (`canary_plannings`), else why. Every such kernel is built here, so
    a server's warm-up builds them all and no request waits for a compile. An executor over
    copied pages is checked on its copy, which must equal MLX's gather exactly: its attention
    is MLX's SDPA, which may round otherwise on another layout."""
    small, q, k_cache, v_cache, table, cu, seq_lens, sinks = _case(g)
    lengths = Lengths.of(cu, seq_lens)
    new = mx.zeros((q.shape[0], NUM_KV_HEADS, g.head_dim), dtype=g.dtype)  # unused: all cached
    want = None
    for options in kernel.canary_plannings(small):
        label = "".join(f"{key}={value}: " for key, value in options.items())
        try:
            plan = kernel.plan(lengths, small, table, **options)
            kernel.check(q, new, new, k_cache, v_cache, plan, sinks)
            if isinstance(kernel, GatheredSdpa):
                got = kernel.gathered(k_cache, v_cache, plan)
                mx.eval(got)
            else:
                out = kernel.run(q, new, new, k_cache, v_cache, plan, sinks=sinks)
                mx.eval(out)
        except Exception as e:  # a compile or launch error is exactly what the canary is for
            return f"{label}{type(e).__name__}: {e}"
        if isinstance(kernel, GatheredSdpa):
            why = _copy_mismatch(got, k_cache, v_cache, table, seq_lens, plan.starts)
        else:
            if want is None:
                want = reference.paged_attention(
                    *(x.astype(mx.float32) for x in (q, k_cache, v_cache)), table, cu, seq_lens,
                    small.scale, window=small.window, softcap=small.softcap, sinks=sinks)
            why = _mismatch(out, want, TOLERANCES[g.dtype])
        if why:
            return f"{label}{why}"
    return None


def _copy_mismatch(got, k_cache: mx.array, v_cache: mx.array, table: mx.array,
                   seq_lens: np.ndarray, starts: tuple[int, ...]) -> str | None:
    for s, (k, v) in enumerate(got):
        want_k, want_v = reference.gather_kv(k_cache, v_cache, table[s], int(seq_lens[s]),
                                             starts[s])
        for name, a, b in (("k", k, want_k), ("v", v, want_v)):
            why = _mismatch(a, b, (0.0, 0.0))
            if why:
                return f"sequence {s}'s gathered {name} {why}"
    return None
