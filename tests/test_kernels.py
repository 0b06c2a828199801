"""JIT paged-attention kernels (CUDA, Metal) against the float32 dense oracle.

Tolerance: relative Frobenius error ||out - oracle|| / ||oracle|| against
`reference.dense_attention` computed in float32 from contiguous K/V (never from the cache).
The kernels round P to the operand dtype before P @ V, so bf16 (8-bit mantissa) lands at
~3e-3 and fp16 (11-bit) at ~5e-4; the bounds below leave ~4x headroom.

Poison: cache blocks no sequence owns and the slots past each sequence's end hold NaN, and
outputs are never pre-zeroed, so a kernel that reads past a sequence or skips a row fails.
The CPU tests check the shared planner (schedule.py) by emulating its work list in numpy.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import reference
from jit_kernels import available_backends, schedule
from paged_prefix.dispatch import Dispatcher
from paged_prefix.metadata import build_attention_metadata
from tests.conftest import KERNEL_PATHS as BACKENDS  # "cuda", "metal": gpu-marked, skipped if absent

TOL = {mx.float16: 2e-3, mx.bfloat16: 1.5e-2}


def make_case(q_lens, ctx_lens, num_heads, num_kv_heads, head_dim, block_size, dtype,
              seed=0, num_blocks=None, high_blocks=False):
    """Random q and paged K/V on shuffled pages, plus each sequence's contiguous K/V.

    Returns q [T,H,D], k_cache, v_cache [num_blocks, block_size, Hkv, D], meta, ks, vs
    (ks[s], vs[s]: [seq_len_s, Hkv, D]). high_blocks puts the pages at the top of the cache.
    """
    rng = np.random.default_rng(seed)
    seq_lens = [c + q for q, c in zip(q_lens, ctx_lens)]
    needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = num_blocks or 2 * sum(needed) + 3
    pool = np.arange(num_blocks - sum(needed), num_blocks) if high_blocks else np.arange(num_blocks)
    ids = rng.permutation(pool)[: sum(needed)]
    tables = np.split(ids, np.cumsum(needed)[:-1])
    shape = (num_blocks * block_size, num_kv_heads, head_dim)
    k_flat = mx.full(shape, float("nan"), dtype=dtype)  # poison: unowned slots
    v_flat = mx.full(shape, float("nan"), dtype=dtype)
    ks, vs = [], []
    for s, n in enumerate(seq_lens):
        k = mx.array(rng.standard_normal((n, num_kv_heads, head_dim)), dtype=dtype)
        v = mx.array(rng.standard_normal((n, num_kv_heads, head_dim)), dtype=dtype)
        pos = np.arange(n)
        slots = mx.array(tables[s][pos // block_size].astype(np.int64) * block_size
                         + pos % block_size)
        k_flat[slots] = k
        v_flat[slots] = v
        ks.append(k)
        vs.append(v)
    q = mx.array(rng.standard_normal((sum(q_lens), num_heads, head_dim)) * 1.5, dtype=dtype)
    meta = build_attention_metadata(q_lens, ctx_lens, [t.tolist() for t in tables],
                                    block_size, num_blocks)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return q, k_flat.reshape(cache_shape), v_flat.reshape(cache_shape), meta, ks, vs


def oracle(q, meta, ks, vs, scale):
    cu = meta.cu_seqlens_q_host
    outs = [reference.dense_attention(q[cu[s]:cu[s + 1]].astype(mx.float32),
                                      ks[s].astype(mx.float32), vs[s].astype(mx.float32),
                                      scale, int(meta.context_lens_host[s]))
            for s in range(meta.num_seqs)]
    return mx.concatenate(outs, axis=0)


def rel_err(out, ref) -> float:
    diff = (out.astype(mx.float32) - ref).square().sum()
    return float(mx.sqrt(diff / ref.square().sum()).item())


@pytest.fixture(params=[64, 128], ids=["m64", "m128"])
def block_m(request, monkeypatch):
    """Forces the CUDA kernel's 64- or 128-row tile variant (its own rule picks by size)."""
    if mx.cuda.is_available():
        from jit_kernels import cuda_paged_attention

        threshold = 0 if request.param == 128 else 10**9
        monkeypatch.setattr(cuda_paged_attention, "MIN_TILES_FOR_BLOCK_M_128", threshold)
    return request.param


def check_backend(backend, q_lens, ctx_lens, num_heads=16, num_kv_heads=4, head_dim=128,
                  block_size=16, dtype=mx.bfloat16, block_m=None, **kw):
    if block_m == 128 and backend != "cuda":
        pytest.skip("128-row tiles are a CUDA variant")
    q, k_cache, v_cache, meta, ks, vs = make_case(q_lens, ctx_lens, num_heads, num_kv_heads,
                                                  head_dim, block_size, dtype, **kw)
    scale = head_dim ** -0.5
    kernel = available_backends()[backend]
    assert kernel.unsupported_reason(q, k_cache, meta) is None
    out = kernel.paged_attention(q, k_cache, v_cache, meta, scale)
    want = oracle(q, meta, ks, vs, scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert not mx.isnan(out).any().item(), "NaN in the output: poisoned slot read?"
    err = rel_err(out, want)
    assert err < TOL[dtype], f"kernel vs float32 oracle: {err:.2e}"
    if "high_blocks" not in kw:  # the gather reference copies whole caches; skip the big one
        ref_err = rel_err(out, reference.paged_attention(q, k_cache, v_cache, meta,
                                                         scale).astype(mx.float32))
        assert ref_err < TOL[dtype], f"kernel vs reference.paged_attention: {ref_err:.2e}"
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("q_len,ctx", [(5, 13), (129, 334), (1, 998), (64, 0), (16, 4080),
                                       (512, 3584), (17, 15), (37, 16), (127, 17)])
def test_single_sequence(backend, q_len, ctx, block_m):
    check_backend(backend, [q_len], [ctx], block_m=block_m)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("q_lens,ctx_lens", [
    ([5, 1, 37, 1, 129], [13, 998, 0, 31, 334]),       # prefill and decode rows in one launch
    ([1] * 32, list(range(0, 3200, 100))),             # a decode batch (split KV)
    ([64, 1, 16, 300, 2, 1, 8, 700], [0, 2000, 4080, 16, 47, 1, 1023, 300]),  # mixed hits
])
def test_batches(backend, q_lens, ctx_lens, block_m):
    check_backend(backend, q_lens, ctx_lens, block_m=block_m)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("group", [3, 6])
def test_group_not_dividing_tile(backend, group, block_m):
    # 64 // 6 = 10 tokens per tile: the last 4 rows of every tile are padding
    check_backend(backend, [45, 1, 7], [20, 99, 300], num_heads=2 * group, num_kv_heads=2,
                  head_dim=64, block_m=block_m)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_variants(backend, dtype, head_dim, group, block_size, block_m):
    check_backend(backend, [5, 1, 70, 1], [block_size - 1, block_size, block_size + 1, 300],
                  num_heads=2 * group, num_kv_heads=2, head_dim=head_dim,
                  block_size=block_size, dtype=dtype, seed=group + block_size, block_m=block_m)


@pytest.mark.parametrize("backend", BACKENDS)
def test_big_cache_64bit_offsets(backend):
    # 66k blocks x 32 x 8 x 128 = 2.16e9 elements per cache: page offsets pass 2**31
    check_backend(backend, [40, 1], [300, 77], num_heads=32, num_kv_heads=8, block_size=32,
                  num_blocks=66_000, high_blocks=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dispatcher_engages_kernel(backend):
    q, k_cache, v_cache, meta, ks, vs = make_case([33, 1], [100, 50], 8, 2, 64, 16, mx.float16)
    dispatch = Dispatcher(path=backend)
    out = dispatch(q, k_cache, v_cache, meta, 0.125)
    assert dispatch.last.path == backend and dispatch.counts == {backend: 1}
    assert rel_err(out, oracle(q, meta, ks, vs, 0.125)) < TOL[mx.float16]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kw,match", [
    (dict(dtype=mx.float32), "dtype"),
    (dict(head_dim=80), "head_dim"),
    (dict(num_heads=32, num_kv_heads=2), "group"),
    (dict(block_size=64), "block size"),
])
def test_unsupported_input_raises(backend, kw, match):
    args = dict(num_heads=8, num_kv_heads=2, head_dim=64, block_size=16, dtype=mx.float16) | kw
    q, k_cache, v_cache, meta, _, _ = make_case([3], [5], **args)
    kernel = available_backends()[backend]
    assert match in kernel.unsupported_reason(q, k_cache, meta)
    with pytest.raises(ValueError, match=match):
        kernel.paged_attention(q, k_cache, v_cache, meta, 0.125)
    with pytest.raises(ValueError, match=match):
        Dispatcher(path=backend)(q, k_cache, v_cache, meta, 0.125)


@pytest.mark.parametrize("backend", BACKENDS)
def test_contract_violations_raise(backend):
    q, k_cache, v_cache, meta, _, _ = make_case([3, 1], [5, 9], 8, 2, 64, 16, mx.float16)
    kernel = available_backends()[backend]
    with pytest.raises(ValueError, match="q:"):
        kernel.paged_attention(q[:-1], k_cache, v_cache, meta, 0.125)
    with pytest.raises(ValueError, match="v_cache"):
        kernel.paged_attention(q, k_cache, v_cache[:, :8], meta, 0.125)
    with pytest.raises(ValueError, match="dtype"):
        kernel.paged_attention(q, k_cache, v_cache.astype(mx.bfloat16), meta, 0.125)


def emulate_plan(q, meta, ks, vs, scale, group, plan, block_m):
    """The kernel's algorithm in numpy over a plan's work list: per-item partials, then merge."""
    head_dim = q.shape[2]
    qn = np.array(q.astype(mx.float32))
    slots = max(plan.num_slots, 1)
    o_part = np.zeros((slots, block_m, head_dim), np.float32)
    lse_part = np.full((slots, block_m), -np.inf, np.float32)
    out = np.full(qn.shape, np.nan, np.float32)
    for seq, tok0, ntok, pos0, kvh, start, end, slot in plan.work_host:
        rows = np.arange(ntok * group)
        tok, head = tok0 + rows // group, kvh * group + rows % group
        k = np.array(ks[seq][start:end, kvh].astype(mx.float32))
        v = np.array(vs[seq][start:end, kvh].astype(mx.float32))
        s = qn[tok, head] @ k.T * scale
        s[np.arange(start, end)[None, :] > (pos0 + rows // group)[:, None]] = -np.inf
        top = s.max(axis=1, keepdims=True)
        p = np.exp(s - np.where(np.isinf(top), 0, top))
        total = p.sum(axis=1, keepdims=True)
        o = np.where(total > 0, p @ v / np.maximum(total, 1e-30), 0)
        if slot < 0:
            out[tok, head] = o
        else:
            o_part[slot, rows] = o
            lse_part[slot, rows] = np.where(total[:, 0] > 0,
                                            (top[:, 0] + np.log(total[:, 0])) / np.log(2), -np.inf)
    if plan.merge is None:
        return mx.array(out)
    return schedule.merge_partials(mx.array(o_part), mx.array(lse_part), plan, q.shape,
                                   mx.float32, group)


@pytest.mark.parametrize("q_lens,ctx_lens,group,num_sms", [
    ([16], [300], 4, 132),                 # short suffix, long prefix: split
    ([1, 1, 1], [90, 0, 400], 8, 132),     # decode rows: split, one with no context
    ([5, 1, 37], [13, 60, 0], 1, 132),     # mixed; splits where kv is long enough
    ([9, 1], [40, 3], 3, 132),             # 16 // 3 = 5 tokens a tile: one padding row
    ([200, 3], [64, 7], 4, 1),             # enough tiles for 1 SM: no split
])
def test_schedule_emulated(q_lens, ctx_lens, group, num_sms):
    """The shared planner covers every row once and every visible key once (CPU-only)."""
    block_m, block_n = 16, 16
    with mx.stream(mx.cpu):  # exact float32 (CUDA matmuls may use TF32)
        q, _, _, meta, ks, vs = make_case(q_lens, ctx_lens, 2 * group, 2, 8, 8, mx.float32)
        plan = schedule.build_tile_plan(meta, group, 2, block_m, block_n, num_sms=num_sms)
        assert (plan.num_slots > 0) == (num_sms > 1)
        work = plan.work_host
        assert (work[:, schedule.KV_START] % block_n == 0).all()
        assert (work[:, schedule.KV_START] < work[:, schedule.KV_END]).all()
        got = emulate_plan(q, meta, ks, vs, 0.3, group, plan, block_m)
        assert rel_err(got, oracle(q, meta, ks, vs, 0.3)) < 1e-5


@pytest.mark.parametrize("q_lens,ctx_lens,reference_wins", [
    ([4096], [0], True), ([1024], [4096], True), ([2048, 4096], [16384, 0], True),
    ([512], [16384], True), ([512], [4096], False), ([2048], [0], False),
    ([64], [65536], False), ([1024, 1], [8192, 50], False),
])
def test_cuda_measured_rule(q_lens, ctx_lens, reference_wins):
    """The CUDA backend's measured dispatch rule (host-only: runs anywhere)."""
    from jit_kernels import cuda_paged_attention

    q, k_cache, _, meta, _, _ = make_case(q_lens, ctx_lens, 1, 1, 8, 16, mx.float16)
    reason = cuda_paged_attention.reference_is_faster(q, k_cache, meta)
    assert (reason is not None) == reference_wins
