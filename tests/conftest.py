"""Shared test helpers: tolerances, a float64 oracle, random paged layouts, backends."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np
import pytest

import reference
from jit_kernels import hopper_paged_attention
from jit_kernels.geometry import Lengths

# A kernel variant that fails its first-use check raises in tests instead of falling back.
os.environ.setdefault("PAGED_PREFIX_STRICT_KERNELS", "1")

# Attention output vs the float64 oracle fed the same (rounded) inputs, per element:
# |out - ref| <= atol + rtol |ref|. fp32 is exact up to reassociation; half types are bounded by
# the rounding of the output (fp16 2^-11, bf16 2^-8 relative) and, in the kernels, of P.
# fp32 is fp32 on the GPU too: `import paged_prefix` (the root conftest) turns MLX's TF32 off.
ON_GPU = mx.default_device() == mx.gpu
TOLERANCES = {
    mx.float32: (2e-5, 2e-5),
    mx.float16: (5e-3, 5e-3),
    mx.bfloat16: (4e-2, 4e-2),
}
DTYPES = {"fp32": mx.float32, "fp16": mx.float16, "bf16": mx.bfloat16}

HAS_CUDA = mx.cuda.is_available()
HAS_METAL = mx.metal.is_available()
HAS_WGMMA = HAS_CUDA and hopper_paged_attention.unavailable_reason() is None
KERNEL_PATHS = [
    pytest.param("cuda", marks=[pytest.mark.gpu,
                                pytest.mark.skipif(not HAS_CUDA, reason="no CUDA backend")]),
    pytest.param("metal", marks=[pytest.mark.gpu,
                                 pytest.mark.skipif(not HAS_METAL, reason="no Metal backend")]),
]
ATTENTION_PATHS = ["reference", "sdpa", *KERNEL_PATHS]


@pytest.fixture
def gathered(monkeypatch) -> list[int]:
    """The key count of every `reference.gather_kv` call (MLX's take of a sequence's pages)
    made while the test runs."""
    calls, gather_kv = [], reference.gather_kv

    def spy(*args):
        calls.append(args[3])
        return gather_kv(*args)
    monkeypatch.setattr(reference, "gather_kv", spy)
    return calls


def assert_close(out: mx.array, ref, dtype: mx.Dtype, what: str = "",
                 q_scale: float = 1.0) -> None:
    """Per-element check with the dtype's (atol, rtol); NaN or Inf never passes.

    fp32 rounds the scores themselves by ~|score| 2^-24: with queries `q_scale` times larger
    than unit normal the scores grow with it, so fp32's bound does too (half types are bounded
    by their output rounding, far above that)."""
    atol, rtol = TOLERANCES[dtype]
    if dtype == mx.float32:
        atol, rtol = atol * max(1.0, q_scale / 8), rtol * max(1.0, q_scale / 8)
    a = np.array(out.astype(mx.float32)).astype(np.float64)
    b = np.asarray(ref, dtype=np.float64)
    assert a.shape == b.shape, f"{what}: shape {a.shape} != {b.shape}"
    assert np.isfinite(a).all(), f"{what}: non-finite output"
    err = np.abs(a - b) - (atol + rtol * np.abs(b))
    worst = np.unravel_index(np.argmax(err), err.shape)
    assert err.max() <= 0, (
        f"{what}: |out - ref| exceeds atol={atol} rtol={rtol} at {worst}: {a[worst]} vs {b[worst]}")


def oracle64(q, k_seqs, v_seqs, cu_seqlens_q, scale, window=None, softcap=None,
             sinks=None) -> np.ndarray:
    """Float64 numpy attention, sequence by sequence from contiguous K/V (never the cache).

    q [T, H, D]; k_seqs[s], v_seqs[s] [seq_len_s, Hkv, D]; bottom-right causal, with the
    variants of `reference.contract` (written here from their definitions, not the reference's
    code): the query at position p sees keys p - W + 1 .. p; logits cap * tanh(s / cap); a sink
    logit per head in the denominator."""
    qn = np.array(q.astype(mx.float32)).astype(np.float64)
    sink = None if sinks is None else np.array(sinks.astype(mx.float32)).astype(np.float64)
    out = np.empty_like(qn)
    for s, (k, v) in enumerate(zip(k_seqs, v_seqs)):
        start, end = int(cu_seqlens_q[s]), int(cu_seqlens_q[s + 1])
        kn = np.array(k.astype(mx.float32)).astype(np.float64)
        vn = np.array(v.astype(mx.float32)).astype(np.float64)
        group = qn.shape[1] // kn.shape[1]
        kh, vh = np.repeat(kn, group, axis=1), np.repeat(vn, group, axis=1)  # [L, H, D]
        scores = np.einsum("qhd,khd->hqk", qn[start:end], kh) * scale
        if softcap is not None:
            scores = softcap * np.tanh(scores / softcap)
        lq, lk = end - start, kn.shape[0]
        pos = (lk - lq + np.arange(lq))[:, None]
        visible = np.arange(lk)[None, :] <= pos
        if window is not None:
            visible &= np.arange(lk)[None, :] > pos - window
        scores = np.where(visible[None], scores, -np.inf)
        top = scores.max(axis=-1, keepdims=True)
        if sink is not None:
            top = np.maximum(top, sink[:, None, None])
        p = np.exp(scores - top)
        denom = p.sum(axis=-1, keepdims=True)
        if sink is not None:
            denom = denom + np.exp(sink[:, None, None] - top)
        out[start:end] = np.einsum("hqk,khd->qhd", p / denom, vh)
    return out


def window_edge_case(window: int) -> tuple[list[int], list[int]]:
    """(q_lens, ctx_lens): decode rows whose first visible key is the second of a kv tile of
    16, 32 or 64 keys (contexts = W mod 64), and a chunk beside them: the key just left of the
    window shares the edge tile and must be masked (for W = 32 or 64)."""
    return [1, 1, 5], [window + 128, window + 64, window + 60]


class PagedCase:
    """Random q and K/V written onto shuffled pages of a NaN-poisoned cache.

    Pages no sequence owns hold NaN, and every block-table entry past a sequence's pages points
    at one of them, so a kernel that reads a wrong page or through padding produces NaN.
    `runs[s]` true gives sequence s one run of consecutive blocks instead, past the shuffled
    ones, with an unowned (NaN) block before and after it; an int n > 1, n such runs.
    `pages[s]`, where not None, lists sequence s's blocks (as offsets past all others). `k_ramp`
    scales key p of a sequence of n by 1 + k_ramp p / n: late keys' scores far above early
    ones' (split parts that disagree); `kv_scale` scales every key and value.
    With a `window`, the pages wholly left of each sequence's first visible key hold NaN too
    (what vLLM's hybrid manager leaves there is the null block or another request's).
    """

    def __init__(self, q_lens, ctx_lens, num_heads, num_kv_heads, head_dim, block_size, dtype,
                 seed=0, num_blocks=None, high_blocks=False, q_scale=1.0, runs=None, k_ramp=0.0,
                 window=None, pages=None, kv_scale=1.0):
        rng = np.random.default_rng(seed)
        self.seq_lens = np.array([c + q for q, c in zip(q_lens, ctx_lens)], dtype=np.int64)
        self.cu_seqlens_q = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int64)
        needed = -(-self.seq_lens // block_size)
        num_blocks = num_blocks or 2 * int(needed.sum()) + 3
        pool = (np.arange(num_blocks - int(needed.sum()) - 1, num_blocks) if high_blocks
                else np.arange(num_blocks))
        ids = rng.permutation(pool)
        poison = int(ids[-1])  # owned by nobody
        table = np.full((len(q_lens), int(needed.max()) + 2), poison, dtype=np.int32)
        starts = np.cumsum(needed) - needed
        for s, (a, n) in enumerate(zip(starts, needed)):
            table[s, :n] = ids[a:a + n]
        if runs is not None:  # past the shuffled pages, with an unowned block around each run
            for s in np.flatnonzero(runs):
                blocks = []
                for part in np.array_split(np.arange(needed[s]), int(runs[s])):
                    blocks += range(num_blocks + 1, num_blocks + 1 + len(part))
                    num_blocks += len(part) + 1
                table[s, :needed[s]] = blocks
            num_blocks += 1
        if pages is not None:  # these blocks (offsets past the others), where not None
            for s in range(len(pages)):
                if pages[s] is not None:
                    table[s, :needed[s]] = num_blocks + np.asarray(pages[s])
            num_blocks += 1 + max(max(p) for p in pages if p is not None)
        self.tables = table
        self.pages = [table[s, :n].tolist() for s, n in enumerate(needed)]  # without padding
        shape = (num_blocks * block_size, num_kv_heads, head_dim)
        k_flat = mx.full(shape, float("nan"), dtype=dtype)
        v_flat = mx.full(shape, float("nan"), dtype=dtype)
        self.k_seqs, self.v_seqs = [], []
        for s, n in enumerate(self.seq_lens):
            ramp = 1 + k_ramp * np.arange(n)[:, None, None] / n
            k = mx.array(rng.standard_normal((n, num_kv_heads, head_dim)) * ramp * kv_scale,
                         dtype=dtype)
            v = mx.array(rng.standard_normal((n, num_kv_heads, head_dim)) * kv_scale, dtype=dtype)
            pos = np.arange(n)
            slots = mx.array(table[s][pos // block_size].astype(np.int64) * block_size
                             + pos % block_size)
            k_flat[slots] = k
            v_flat[slots] = v
            self.k_seqs.append(k)
            self.v_seqs.append(v)
            left = int(reference.key_start(ctx_lens[s], window)) // block_size * block_size
            if left:  # pages no query sees
                k_flat[slots[:left]] = float("nan")
                v_flat[slots[:left]] = float("nan")
        self.q = mx.array(rng.standard_normal((sum(q_lens), num_heads, head_dim)) * q_scale,
                          dtype=dtype)
        cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_cache, self.v_cache = k_flat.reshape(cache_shape), v_flat.reshape(cache_shape)
        self.block_tables = mx.array(table)
        self.num_blocks, self.block_size, self.dtype = num_blocks, block_size, dtype
        self.q_scale = q_scale
        # the new rows of every sequence, packed like q (what the sdpa path reads when C = 0)
        self.k_new = mx.concatenate([k[c:] for k, c in zip(self.k_seqs, ctx_lens)])
        self.v_new = mx.concatenate([v[c:] for v, c in zip(self.v_seqs, ctx_lens)])
        mx.eval(self.q, self.k_cache, self.v_cache, self.k_new, self.v_new)

    @property
    def lengths(self) -> Lengths:
        return Lengths.of(self.cu_seqlens_q, self.seq_lens)

    def attend(self, kernel, geometry, sinks=None, **options) -> tuple[mx.array, object]:
        """(out, plan): `kernel` planned over this case, its entry check, then its run."""
        plan = kernel.plan(self.lengths, geometry, self.block_tables, **options)
        args = (self.q, self.k_new, self.v_new, self.k_cache, self.v_cache)
        kernel.check(*args, plan, sinks)
        return kernel.run(*args, plan, sinks=sinks), plan

    def forward(self, dispatcher, geometry, k_cache=None, v_cache=None, sinks=None) -> mx.array:
        """This case as one forward through `dispatcher` (route, entry check, run), on its
        caches or the given ones."""
        from paged_prefix.attention_metadata import build_attention_metadata

        q_lens = np.diff(self.cu_seqlens_q)
        meta = build_attention_metadata(q_lens.tolist(), (self.seq_lens - q_lens).tolist(),
                                        self.pages, self.block_size, self.num_blocks)
        attention = dispatcher.plan(meta, geometry)
        args = (self.q, self.k_new, self.v_new,
                self.k_cache if k_cache is None else k_cache,
                self.v_cache if v_cache is None else v_cache)
        attention.check(*args, sinks)
        return attention(*args, sinks)

    def oracle(self, scale: float, window=None, softcap=None, sinks=None) -> np.ndarray:
        return oracle64(self.q, self.k_seqs, self.v_seqs, self.cu_seqlens_q, scale, window,
                        softcap, sinks)


def plan_of(kernel, cu_seqlens_q, seq_lens, geometry, **options):
    """A plan from host lengths alone, over a stand-in one-column block table (for tests that
    read the plan, not run it)."""
    lengths = Lengths.of(cu_seqlens_q, seq_lens)
    return kernel.plan(lengths, geometry, mx.zeros((lengths.num_seqs, 1), dtype=mx.int32),
                       **options)


def zeros(output_shapes, output_dtypes) -> list[mx.array]:
    return [mx.zeros(s, dtype=d) for s, d in zip(output_shapes, output_dtypes)]


@dataclass
class CubinStandIns:
    """NVRTC and MLX's precompiled-kernel launch, stood in for on any machine: what was compiled
    ((name, arch) each) and every launch's arguments; a launch returns zeros of its outputs."""

    compiled: list = field(default_factory=list)
    launched: list = field(default_factory=list)

    def compile(self, source: str, name: str, arch: str) -> bytes:
        self.compiled.append((name, arch))
        return b"cubin"

    def precompiled(self, **kw) -> list[mx.array]:
        self.launched.append(kw)
        return zeros(kw["output_shapes"], kw["output_dtypes"])
