"""JIT paged-attention and page-gather kernels against the float64 oracle, per element.

Backends: "cuda" and "metal" where MLX has that device (gpu-marked; on a Hopper GPU "cuda" runs
the wgmma kernel at head dim 128, and "cuda-mma" the mma.sync kernel every other CUDA GPU runs),
and "metal-emulated":
the exact Metal sources MLX would compile, run on the CPU by `tests/metal_emu` (marked
`emulated`: its own nox session). Every case uses `PagedCase`: pages shuffled across a cache
whose unowned pages and block-table padding are NaN, outputs never pre-zeroed, so a kernel
that reads a wrong page, reads through padding or skips a row fails.

Tolerance: per element, |out - oracle| <= atol + rtol |oracle| with the dtype's pair from
conftest (the kernels round P to the operand type before P @ V, and the output).
The CPU-only tests check the shared planner (plan.py) by emulating its work list in numpy.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math

import mlx.core as mx
import numpy as np
import pytest

from jit_kernels import KernelBackend, available_backends, cuda_backend, metal_backend, nvrtc
from jit_kernels import cuda_paged_attention as cuda_attention
from jit_kernels import hopper_paged_attention as hopper_attention
from jit_kernels import metal_paged_attention as metal_attention
from jit_kernels import plan as tile_plan
from jit_kernels.geometry import Geometry, Lengths
from paged_prefix import rules
from paged_prefix.route import one_run, page_runs
from tests.conftest import (
    HAS_CUDA,
    HAS_METAL,
    HAS_WGMMA,
    CubinStandIns,
    PagedCase,
    assert_close,
    oracle64,
    plan_of,
    zeros,
)

try:
    from tests.metal_emu import metal_kernel as emulated_metal_kernel
except ImportError:  # the emulation needs g++
    emulated_metal_kernel = None

BACKENDS = [
    pytest.param("cuda", marks=[pytest.mark.gpu,
                                pytest.mark.skipif(not HAS_CUDA, reason="no CUDA backend")]),
    pytest.param("cuda-mma", marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not HAS_WGMMA, reason="no Hopper GPU: 'cuda' is the mma.sync kernel")]),
    pytest.param("metal", marks=[pytest.mark.gpu,
                                 pytest.mark.skipif(not HAS_METAL, reason="no Metal backend")]),
    pytest.param("metal-emulated", marks=[
        pytest.mark.emulated,
        pytest.mark.skipif(emulated_metal_kernel is None, reason="no Metal emulation")]),
]
# Emulated Metal threads cost ~1.7 us per thread per sync point on the CPU: the long and
# many-variant cases run on real GPUs only (tests/test_metal_emulated.py sweeps every Metal
# variant and the split, decode and padding cases on small shapes).
GPU_BACKENDS = [p for p in BACKENDS if p.values[0] != "metal-emulated"]
HEAD_DIMS = {"cuda": (64, 128), "cuda-mma": (64, 128), "metal": (64, 96, 128, 256),
             "metal-emulated": (64, 96, 128, 256)}


@functools.cache
def mma_sync_backend() -> KernelBackend:
    return cuda_backend(wgmma=False)


def get_backend(name):
    if name == "metal-emulated":
        return metal_backend(emulated_metal_kernel)
    if name == "cuda-mma":
        return mma_sync_backend()
    return available_backends()[name]


@pytest.fixture(params=[64, 128], ids=["m64", "m128"])
def block_m(request):
    """The CUDA kernel's 64- or 128-row tile variant, forced (its own rule picks by size)."""
    return request.param


def check(backend_name, q_lens, ctx_lens, num_heads=16, num_kv_heads=4, head_dim=128,
          block_size=16, dtype=mx.bfloat16, block_m=None, scale=None, **kw):
    if head_dim not in HEAD_DIMS[backend_name]:
        pytest.skip(f"{backend_name} has no head_dim {head_dim} variant")
    g = Geometry(num_heads, num_kv_heads, head_dim, block_size, dtype, scale or head_dim ** -0.5)
    backend = get_backend(backend_name)
    if not backend_name.startswith("cuda"):  # the fixture's heights are CUDA variants
        if block_m == 128:
            pytest.skip("128-row tiles are a CUDA variant")
        block_m = None
    elif block_m is not None and block_m not in backend.attention.tile_rows(g):
        pytest.skip(f"{backend_name} plans no {block_m}-row tiles at head_dim {head_dim}")
    c = PagedCase(q_lens, ctx_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, **kw)
    assert backend.attention.unsupported_reason(g) is None
    out, plan = c.attend(backend.attention, g, block_m=block_m)
    assert out.shape == c.q.shape and out.dtype == dtype
    assert_close(out, c.oracle(g.scale), dtype, f"{backend_name} q={q_lens} ctx={ctx_lens}")
    return plan


def as_stored(cache: mx.array) -> mx.array:
    """A [num_blocks, BS, Hkv, D] cache as PagedKVCache stores it: flat rows of 4-byte words."""
    words = cache.view(mx.uint32)
    return words.reshape(-1, *words.shape[2:])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16], ids=["fp16", "bf16"])
def test_kernel_reads_the_caches_as_stored(backend, dtype):
    """The runner launches the kernel on PagedKVCache's own arrays (4-byte words, flat rows):
    the same bytes give the same output, bit for bit, split KV included."""
    c = PagedCase([5, 1, 37], [13, 998, 0], 8, 2, 64, 16, dtype, seed=7)
    g = Geometry(8, 2, 64, 16, dtype, 0.125)
    attention = get_backend(backend).attention
    typed, plan = c.attend(attention, g)
    stored = attention.run(c.q, c.k_new, c.v_new, as_stored(c.k_cache), as_stored(c.v_cache),
                           plan)
    np.testing.assert_array_equal(np.array(stored.view(mx.uint16)),
                                  np.array(typed.view(mx.uint16)))
    assert_close(typed, c.oracle(0.125), dtype)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("q_len,ctx", [(5, 13), (129, 334), (1, 998), (64, 0), (16, 4080),
                                       (512, 3584), (17, 15), (37, 16), (127, 17)])
def test_single_sequence(backend, q_len, ctx, block_m):
    check(backend, [q_len], [ctx], block_m=block_m)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("q_lens,ctx_lens", [
    ([5, 1, 37, 1, 129], [13, 998, 0, 31, 334]),       # prefill and decode rows in one launch
    ([1] * 32, list(range(0, 3200, 100))),             # a decode batch (split KV)
    ([64, 1, 16, 300, 2, 1, 8, 700], [0, 2000, 4080, 16, 47, 1, 1023, 300]),  # mixed hits
])
def test_batches(backend, q_lens, ctx_lens, block_m):
    check(backend, q_lens, ctx_lens, block_m=block_m)


@pytest.mark.parametrize("backend", BACKENDS[:1])  # Metal plans for 16 cores: <= 32 splits
def test_more_than_32_splits(backend):
    """C=20000, Lq=16 over 2 kv heads: each tile's key range split 35 ways (40 by the mma.sync
    kernel's chunking), all merged."""
    plan = check(backend, [16], [20000], num_heads=8, num_kv_heads=2, block_m=64)
    assert int(plan.tiles.work_host[:, tile_plan.NUM_SPLITS].max()) > 32


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("group", [3, 6])
def test_group_not_dividing_tile(backend, group, block_m):
    # 64 // 6 = 10 tokens per tile: the last 4 rows of every tile are padding
    check(backend, [45, 1, 7], [20, 99, 300], num_heads=2 * group, num_kv_heads=2,
          head_dim=64, block_m=block_m)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_variants(backend, dtype, head_dim, group, block_size):
    check(backend, [5, 1, 70, 1], [block_size - 1, block_size, block_size + 1, 300],
          num_heads=2 * group, num_kv_heads=2, head_dim=head_dim, block_size=block_size,
          dtype=dtype, seed=group + block_size)


@pytest.mark.parametrize("backend", BACKENDS)
def test_large_scores(backend):
    """|scale q.k| up to ~150: the kernels keep scores and softmax in fp32."""
    check(backend, [9, 1, 30], [40, 70, 0], num_heads=8, num_kv_heads=2, head_dim=64,
          dtype=mx.float16, q_scale=40.0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("head_dim", [64, 256])
def test_causal_frontiers_next_to_kv_tile_boundaries(backend, head_dim):
    """Query tiles of several rows whose first row sits two keys before a boundary of every
    kernel's kv tiles (16, 32 and 64 keys: positions 30, 62 and 126): the tile holding a row's
    frontier must be masked, a mask that starts one key late leaks one future key."""
    check(backend, [10, 3, 2, 1], [30, 62, 126, 63], num_heads=4, num_kv_heads=2,
          head_dim=head_dim, dtype=mx.float16, seed=11)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_keys_and_values_past_the_fp16_range(backend):
    """bf16 keys and values 2^17 times unit scale (past fp16's 65504) and queries 2^-17 times,
    so the scores are as usual: a kernel that staged bf16 tiles through fp16 would give inf.
    Compared with the output scaled back by the same power of two (exact)."""
    if 64 not in HEAD_DIMS[backend]:
        pytest.skip(f"{backend} has no head_dim 64 variant")
    c = PagedCase([9, 1, 1], [40, 300, 0], 8, 2, 64, 16, mx.bfloat16, seed=12,
                  q_scale=2.0 ** -17, kv_scale=2.0 ** 17)
    g = Geometry(8, 2, 64, 16, mx.bfloat16, 0.125)
    out, _ = c.attend(get_backend(backend).attention, g)
    assert float(mx.abs(c.v_seqs[1]).max()) > 65504  # past fp16's range
    assert_close(out * 2.0 ** -17, c.oracle(g.scale) * 2.0 ** -17, mx.bfloat16, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_split_parts_that_disagree_by_far(backend):
    """Keys split many ways, the late parts' scores far above the first's (|scale q.k| from
    ~15 to ~150): the merge must rescale every part by the largest, not the first."""
    plan = check(backend, [1, 2], [2500, 900], num_heads=4, num_kv_heads=2, head_dim=64,
                 dtype=mx.float16, q_scale=5.0, k_ramp=9.0)
    splits = plan.tiles.work_host[:, tile_plan.NUM_SPLITS]
    assert plan.tiles.num_slots and int(splits.max()) >= 4


@pytest.mark.parametrize("backend", BACKENDS)
def test_each_scale_its_own_kernel(backend):
    """The CUDA kernel compiles the scale in: two scales in one process, each its own."""
    for scale in (0.125, 0.03):
        check(backend, [9, 1], [40, 300], num_heads=8, num_kv_heads=2, head_dim=64,
              scale=scale)


@pytest.mark.parametrize("backend", BACKENDS)
def test_calls_of_one_plan_evaluated_together(backend):
    """Calls that share a split plan and nothing else, evaluated at once (MLX may run them
    side by side): each matches its own oracle, its splits merged with no other call's. On
    CUDA more calls than the plan's sets of counters, so that two sets serve two calls each."""
    q_lens, ctx_lens = [16, 1], [1500, 700]
    g = Geometry(8, 2, 64, 16, mx.bfloat16, 0.125)
    cases = [PagedCase(q_lens, ctx_lens, 8, 2, 64, 16, mx.bfloat16, seed=s) for s in range(4)]
    num_calls = cuda_attention.COUNTER_SETS + 2 if backend.startswith("cuda") else len(cases)
    calls = [cases[i % len(cases)] for i in range(num_calls)]
    attention = get_backend(backend).attention
    plan = attention.plan(cases[0].lengths, g, cases[0].block_tables)
    assert plan.tiles.num_slots
    # one plan (work list, counters, launch order), each case's own block table
    outs = [attention.run(c.q, c.k_new, c.v_new, c.k_cache, c.v_cache,
                          dataclasses.replace(plan, block_tables=c.block_tables)) for c in calls]
    mx.eval(outs)
    oracles = [c.oracle(g.scale) for c in cases]
    for i, out in enumerate(outs):
        assert_close(out, oracles[i % len(cases)], mx.bfloat16, f"call {i}")


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_big_cache_64bit_offsets(backend):
    # 66k blocks x 32 x 8 x 128 = 2.16e9 elements per cache: page offsets pass 2**31
    check(backend, [40, 1], [300, 77], num_heads=32, num_kv_heads=8, block_size=32,
          num_blocks=66_000, high_blocks=True)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32], ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("window", [None, 40], ids=["full", "window"])
def test_page_gather_is_an_exact_copy(backend, dtype, block_size, window):
    """The gather kernel's copy equals MLX's take bit for bit, and SDPA over it the oracle;
    with a window, from the page of each sequence's first visible key on (the pages before it
    hold NaN and are never read)."""
    c = PagedCase([5, 1, 70, 9], [block_size - 1, 300, 0, 2 * block_size], 8, 2, 64, block_size,
                  dtype, seed=block_size, window=window)
    g = Geometry(8, 2, 64, block_size, dtype, 0.125, window=window)
    firsts = c.lengths.key_starts(window) // block_size * block_size
    gathered = get_backend(backend).gathered
    cached = (0, 1, 3)  # the sequence with no cached prefix is not copied
    plan = gathered.plan(c.lengths, g, c.block_tables, cached)
    stored = [as_stored(x) for x in (c.k_cache, c.v_cache)]
    for k_cache, v_cache in ((c.k_cache, c.v_cache), stored):
        gathered.check(c.q, c.k_new, c.v_new, k_cache, v_cache, plan)
        for s, (k, v) in zip(cached, gathered.gathered(k_cache, v_cache, plan)):
            f = int(firsts[s])
            assert k.shape == v.shape == (1, 2, int(c.seq_lens[s]) - f, 64)
            assert k.dtype == v.dtype == dtype
            for got, want in ((k, c.k_seqs[s]), (v, c.v_seqs[s])):
                np.testing.assert_array_equal(np.array(got[0].view(mx.uint8)),
                                              np.array(want[f:].transpose(1, 0, 2).view(mx.uint8)))
        out = gathered.run(c.q, c.k_new, c.v_new, k_cache, v_cache, plan)
        rows = np.concatenate([np.arange(c.cu_seqlens_q[s], c.cu_seqlens_q[s + 1])
                               for s in cached])
        assert_close(out[mx.array(rows)], c.oracle(0.125, window)[rows], dtype)
    with pytest.raises(ValueError, match="whole pages"):
        gathered.check(c.q, c.k_new, c.v_new, c.k_cache[:, :1], c.v_cache[:, :1], plan)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("change, match", [
    (dict(dtype=mx.float32), "dtype"),
    (dict(head_dim=80), "head_dim"),
    (dict(num_heads=32, num_kv_heads=2), "group"),
    (dict(block_size=64), "block size"),
])
def test_unsupported_geometry_raises(backend, change, match):
    args = dict(num_heads=8, num_kv_heads=2, head_dim=64, block_size=16, dtype=mx.float16,
                scale=0.125) | change
    g = Geometry(**args)
    kernel = get_backend(backend).attention
    assert match in kernel.unsupported_reason(g)
    with pytest.raises(ValueError, match=match):
        plan_of(kernel, np.array([0, 3]), np.array([8]), g)


@pytest.mark.parametrize("backend", BACKENDS)
def test_contract_violations_raise(backend):
    c = PagedCase([3, 1], [5, 9], 8, 2, 64, 16, mx.float16)
    g = Geometry(8, 2, 64, 16, mx.float16, 0.125)
    kernel = get_backend(backend).attention
    plan = kernel.plan(c.lengths, g, c.block_tables)
    new = (c.k_new, c.v_new)
    with pytest.raises(ValueError, match="q:"):
        kernel.check(c.q[:-1], *new, c.k_cache, c.v_cache, plan)
    with pytest.raises(ValueError, match="v_cache"):
        kernel.check(c.q, *new, c.k_cache, c.v_cache[:, :8], plan)
    with pytest.raises(ValueError, match="dtype"):
        kernel.check(c.q, *new, c.k_cache, c.v_cache.astype(mx.bfloat16), plan)
    with pytest.raises(ValueError, match="plan"):
        kernel.check(c.q, *new, c.k_cache[:, :, :1], c.v_cache[:, :, :1], plan)
    with pytest.raises(ValueError, match="k, v"):
        kernel.check(c.q, c.k_new[:1], c.v_new, c.k_cache, c.v_cache, plan)


def merge_oracle(o_part, lse_part, tiles, out, group, sinks=None):
    """Log-sum-exp merge of split partials in numpy (the merge's oracle): o_part [slots, rows,
    D] normalised per split, lse_part [slots, rows] in log2 units (-inf: the split saw no key);
    `sinks` [H] (natural units) join each merged row's sum once."""
    for tok0, ntok, kvh, first, nsplit in tiles.merge_host:
        if first < 0:
            continue
        rows = np.arange(ntok * group)
        lse = lse_part[first:first + nsplit][:, rows]  # [splits, rows]
        top = lse.max(axis=0)
        w = np.exp2(lse - np.where(np.isinf(top), 0, top))
        o = (w[..., None] * o_part[first:first + nsplit][:, rows]).sum(axis=0)
        total = w.sum(axis=0)
        if sinks is not None:
            total = total + np.exp2(sinks[kvh * group + rows % group] / np.log(2) - top)
        out[tok0 + rows // group, kvh * group + rows % group] = o / total[:, None]
    return out


def emulate_plan(c: PagedCase, scale, group, tiles, block_m, window=None, softcap=None,
                 sinks=None):
    """The kernels' algorithm in numpy over a plan's work list: per-item partials, then merge;
    with a variant's window, cap (before the mask) and sinks (float64 [H]: joined once per row,
    unsplit rows at their store, split rows in the merge)."""
    qn = np.array(c.q.astype(mx.float32)).astype(np.float64)
    o_part = np.zeros((max(tiles.num_slots, 1), block_m, qn.shape[2]))
    lse_part = np.full((max(tiles.num_slots, 1), block_m), -np.inf)
    out = np.full(qn.shape, np.nan)
    for seq, tok0, ntok, pos0, kvh, start, end, slot, *_ in tiles.work_host:
        rows = np.arange(ntok * group)
        tok, head = tok0 + rows // group, kvh * group + rows % group
        k = np.array(c.k_seqs[seq][start:end, kvh].astype(mx.float32)).astype(np.float64)
        v = np.array(c.v_seqs[seq][start:end, kvh].astype(mx.float32)).astype(np.float64)
        s = qn[tok, head] @ k.T * scale
        if softcap is not None:
            s = softcap * np.tanh(s / softcap)
        keys, pos = np.arange(start, end)[None, :], (pos0 + rows // group)[:, None]
        s[keys > pos] = -np.inf
        if window is not None:
            s[keys <= pos - window] = -np.inf
        top = s.max(axis=1, keepdims=True)
        p = np.exp(s - np.where(np.isinf(top), 0, top))
        total = p.sum(axis=1, keepdims=True)
        if slot < 0 and sinks is not None:
            total = total + np.exp(sinks[head][:, None] - top)
        o = np.where(total > 0, p @ v / np.maximum(total, 1e-300), 0)
        if slot < 0:
            out[tok, head] = o
        else:
            o_part[slot, rows] = o
            lse_part[slot, rows] = np.where(total[:, 0] > 0,
                                            (top[:, 0] + np.log(total[:, 0])) / np.log(2), -np.inf)
    return out if tiles.merge is None else merge_oracle(o_part, lse_part, tiles, out, group,
                                                        sinks)


@pytest.mark.parametrize("q_lens,ctx_lens,group,num_sms", [
    ([16], [300], 4, 132),                 # short suffix, long prefix: split
    ([1, 1, 1], [90, 0, 400], 8, 132),     # decode rows: split, one with no context
    ([5, 1, 37], [13, 60, 0], 1, 132),     # mixed; splits where kv is long enough
    ([9, 1], [40, 3], 3, 132),             # 16 // 3 = 5 tokens a tile: one padding row
    ([200, 3], [64, 7], 4, 1),             # enough tiles for 1 SM: no split
    ([2, 40], [600, 0], 2, 16),            # long tiles split, the others not
])
def test_plan_covers_every_row_and_key_once(q_lens, ctx_lens, group, num_sms):
    """The shared planner (CPU-only): emulating its work list reproduces the oracle."""
    block_m, block_n = 16, 16
    c = PagedCase(q_lens, ctx_lens, 2 * group, 2, 8, 8, mx.float32)
    tiles = tile_plan.build_tile_plan(c.cu_seqlens_q, c.seq_lens, group, 2, block_m, block_n,
                                      num_sms=num_sms)
    assert (tiles.num_slots > 0) == (num_sms > 1)
    work = tiles.work_host
    assert (work[:, tile_plan.KV_START] % block_n == 0).all()
    assert (work[:, tile_plan.KV_START] < work[:, tile_plan.KV_END]).all()
    split = work[:, tile_plan.NUM_SPLITS] > 1
    assert ((work[:, tile_plan.SLOT] >= 0) == split).all()
    assert sorted(work[split, tile_plan.SLOT]) == list(range(tiles.num_slots))
    got = emulate_plan(c, 0.3, group, tiles, block_m)
    np.testing.assert_allclose(got, oracle64(c.q, c.k_seqs, c.v_seqs, c.cu_seqlens_q, 0.3),
                               rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("seqs", [[0], [1, 2], [0, 2]])
def test_plan_of_some_sequences_covers_theirs_only(seqs):
    """A plan of some sequences (the mixed path's kernel half): the emulated work list gives
    the oracle on their rows and never writes the others'."""
    group, block_m, block_n = 2, 16, 16
    c = PagedCase([5, 1, 37], [13, 60, 0], 2 * group, 2, 8, 8, mx.float32)
    tiles = tile_plan.build_tile_plan(c.cu_seqlens_q, c.seq_lens, group, 2, block_m, block_n,
                                      num_sms=132, seqs=np.array(seqs))
    assert sorted(set(tiles.work_host[:, tile_plan.SEQ].tolist())) == seqs
    got = emulate_plan(c, 0.3, group, tiles, block_m)
    mine = np.zeros(c.q.shape[0], dtype=bool)
    for s in seqs:
        mine[c.cu_seqlens_q[s]:c.cu_seqlens_q[s + 1]] = True
    want = oracle64(c.q, c.k_seqs, c.v_seqs, c.cu_seqlens_q, 0.3)
    np.testing.assert_allclose(got[mine], want[mine], rtol=1e-9, atol=1e-12)
    assert np.isnan(got[~mine]).all()  # emulate_plan's output starts NaN: never written


@pytest.mark.parametrize("bad", [[], [2, 1], [0, 0], [3], [-1], [0.5], [[0]]])
def test_plan_refuses_bad_sequence_lists(bad):
    c = PagedCase([5, 1, 37], [13, 60, 0], 4, 2, 64, 16, mx.bfloat16)
    g = Geometry(4, 2, 64, 16, mx.bfloat16, 0.125)
    for attention in (cuda_attention.CudaPagedAttention(lambda **_: None),
                      metal_backend(lambda **_: None).attention):
        with pytest.raises(ValueError, match="seqs"):
            attention.plan(c.lengths, g, c.block_tables, seqs=bad)


@pytest.mark.parametrize("backend", BACKENDS)
def test_kernel_plan_of_some_sequences(backend):
    """The kernel half of a mixed batch: the planned sequences' rows match the oracle (split
    KV included); the others' rows are left for the caller."""
    c = PagedCase([9, 1, 37, 1], [40, 998, 0, 16], 8, 2, 64, 16, mx.bfloat16, seed=5)
    g = Geometry(8, 2, 64, 16, mx.bfloat16, 0.125)
    attention = get_backend(backend).attention
    seqs = [1, 3]
    out, _ = c.attend(attention, g, seqs=seqs)
    out = np.array(out.astype(mx.float32))
    want = c.oracle(g.scale)
    for s in seqs:
        rows = slice(int(c.cu_seqlens_q[s]), int(c.cu_seqlens_q[s + 1]))
        assert_close(mx.array(out[rows]), want[rows], mx.bfloat16, f"{backend} seq {s}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_dispatcher_mixes_sdpa_and_the_kernel(backend, monkeypatch):
    """A long prompt and a long suffix beside decode rows: the rule picks SDPA for those two
    only (one over its new rows, one over the gather kernel's pages), the kernel runs the
    decode rows (split KV), and the batch matches the oracle, first call and later layers'."""
    from paged_prefix import dispatch
    from paged_prefix.attention_metadata import build_attention_metadata
    from paged_prefix.route import Source

    monkeypatch.setattr(rules, "CUDA_SDPA_MIN_Q", 32)  # CUDA's length rule at a test's size
    real = get_backend(backend)
    fresh = KernelBackend(real.name, real.attention, real.gathered)  # its own first-use checks
    d = dispatch.Dispatcher("auto", backends={real.name: fresh}, strict=True,
                            rule_of=lambda b: lambda lengths, g, runs, layers: rules.cuda_prefers_sdpa(
                                lengths))
    q_lens, ctx = [1, 40, 1, 33], [300, 0, 90, 21]
    case = PagedCase(q_lens, ctx, 8, 2, 64, 16, mx.float16, seed=6)
    meta = build_attention_metadata(q_lens, ctx, case.pages, 16, case.num_blocks)
    attention = d.plan(meta, Geometry(8, 2, 64, 16, mx.float16, 0.125))
    assert attention.route.path == "mixed"
    assert attention.route.sources == (Source.PAGED, Source.NEW_ROWS, Source.PAGED,
                                       Source.GATHERED)
    attention.check(case.q, case.k_new, case.v_new, case.k_cache, case.v_cache)
    for _ in range(2):
        out = attention(case.q, case.k_new, case.v_new, case.k_cache, case.v_cache)
        assert_close(out, case.oracle(0.125), mx.float16)
    assert d.counts == {"mixed": 2}


def ask(rule, cu, lens, g, table=None, layers=1):
    """A rule's pick for host lengths, with the page runs the route would find in `table`
    (none without one: every cached prefix gathered), for a forward of `layers` layers."""
    lengths = Lengths.of(cu, lens)
    cached = [s for s in range(lengths.num_seqs) if lengths.seq_lens[s] > lengths.q_lens[s]]
    runs = {} if table is None else one_run(page_runs(np.asarray(table), lengths, cached,
                                                      g.block_size))
    return rule(lengths, g, runs, layers)


@pytest.mark.parametrize("q_lens,ctx_lens,sdpa", [
    ([4096], [0], (0,)), ([64, 9], [0, 0], ()), ([1] * 32, [0] * 32, ()),
    ([1024], [4096], (0,)), ([2048, 4096], [16384, 0], (0, 1)), ([512], [16384], (0,)),
    ([512], [1024], (0,)), ([64], [16384], ()), ([16], [131072], ()),
    ([1024, 1], [8192, 50], (0,)), ([16], [4096], ()), ([1, 300, 7, 2048], [9, 0, 40, 16], (1, 3)),
])
def test_cuda_measured_rule(q_lens, ctx_lens, sdpa):
    """The CUDA backend's measured rule (host-only: runs anywhere)."""
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    lens = np.array(q_lens) + np.array(ctx_lens)
    g = Geometry(32, 8, 128, 16, mx.bfloat16, 128 ** -0.5)
    want = tuple(s for s, q in enumerate(q_lens) if q >= rules.CUDA_SDPA_MIN_Q)
    assert want == sdpa
    pick = rules.cuda_prefers_sdpa(Lengths.of(cu, lens))
    assert (pick.seqs if pick else ()) == want
    rule = rules.CudaSdpaRule(graph_build_ms=0)  # every graph worth building: its second ask
    everyone = len(want) == len(q_lens)
    assert ask(rule, cu, lens, g) is None
    pick = ask(rule, cu, lens, g)
    # a mixed batch builds no graph: its long sequences stay on the kernel until batches of
    # long prefills only have run their shapes on SDPA
    assert (pick.seqs if pick else ()) == (want if everyone else ())
    other = Geometry(32, 8, 64, 16, mx.bfloat16, 64 ** -0.5)
    assert ask(rule, cu, lens, other) is None  # another geometry is another cuDNN graph
    if not want or everyone:
        return
    for s in want:  # each long shape alone: the mixed batches' kernel time paid for its graph
        alone_cu, alone_lens = np.array([0, q_lens[s]]), lens[s:s + 1]
        assert ask(rule, alone_cu, alone_lens, g).seqs == (0,)
    assert ask(rule, cu, lens, g).seqs == want


def test_cuda_rule_counts_a_shape_new_to_the_batch_once():
    """Two sequences of one new shape in a batch: neither has its cuDNN graph yet."""
    g = Geometry(32, 8, 128, 16, mx.bfloat16, 128 ** -0.5)
    rule = rules.CudaSdpaRule(graph_build_ms=0)
    cu, lens = np.array([0, 300, 600]), np.array([400, 400])
    assert ask(rule, cu, lens, g) is None
    assert ask(rule, cu, lens, g).seqs == (0, 1)


def test_cuda_rule_mixes_only_shapes_whose_graphs_are_built():
    """A long prefill beside decode rows goes to SDPA once a batch of long prefills ran its
    shape there, never before (a mixed batch builds no graph, however often it comes, though
    its kernel time counts toward one); a shape MLX has evicted (the rule's LRU of built
    shapes) goes back to the kernel."""
    g = Geometry(32, 8, 128, 16, mx.bfloat16, 128 ** -0.5)
    rule = rules.CudaSdpaRule(capacity=2, graph_build_ms=0)
    mixed_cu, mixed_lens = np.array([0, 1, 301, 302]), np.array([90, 1300, 40])
    for _ in range(3):
        assert ask(rule, mixed_cu, mixed_lens, g) is None
    alone = (np.array([0, 300]), np.array([1300]))
    assert ask(rule, *alone, g).seqs == (0,)  # the mixed batches paid for it: SDPA builds it
    assert ask(rule, mixed_cu, mixed_lens, g).seqs == (1,)
    for q in (400, 500):  # two other shapes built: 300's graph is the least recently used
        for _ in range(2):
            ask(rule, np.array([0, q]), np.array([q + 1000]), g)
    assert ask(rule, mixed_cu, mixed_lens, g) is None


@pytest.mark.parametrize("heads,head_dim,q_len,cached,layers,forwards", [
    (32, 64, 256, 2048, 16, 3_834),   # the 1.1B config: a suffix over a cached prefix
    (32, 128, 16384, 0, 32, 4),       # Llama-3-8B's shape: a fresh long prompt
])
def test_cuda_rule_builds_a_graph_once_the_kernel_has_paid_for_it(heads, head_dim, q_len, cached,
                                                                   layers, forwards):
    """Ski rental: a shape stays on the paged kernel until the kernel's estimated extra time
    over its earlier forwards reaches a graph build (CUDA_GRAPH_BUILD_MS), then SDPA builds its
    graph and keeps it. The counts are those rules.CudaSdpaRule's docstring gives."""
    g = Geometry(heads, 8, head_dim, 16, mx.bfloat16, head_dim ** -0.5)
    extra = rules.kernel_extra_ms(q_len, q_len + cached, g, layers)
    assert forwards == math.ceil(rules.CUDA_GRAPH_BUILD_MS / extra)
    rule = rules.CudaSdpaRule()
    cu, lens = np.array([0, q_len]), np.array([q_len + cached])
    assert all(ask(rule, cu, lens, g, layers=layers) is None for _ in range(forwards))
    assert "worth building" in ask(rule, cu, lens, g, layers=layers).reason
    assert "graphs are built" in ask(rule, cu, lens, g, layers=layers).reason
    assert ask(rule, cu, lens, g, layers=1) is not None  # built: whatever the forward


def test_cuda_rule_counts_mixed_batches_kernel_time_but_builds_in_none():
    """A long prefill riding with a decode row never builds its graph (the decode row would
    wait for it), however much its kernel time adds up; the first batch of long prefills alone
    after that builds it."""
    g = Geometry(32, 8, 128, 16, mx.bfloat16, 128 ** -0.5)
    rule = rules.CudaSdpaRule()
    mixed = (np.array([0, 1, 16385]), np.array([500, 16384]))
    assert all(ask(rule, *mixed, g, layers=32) is None for _ in range(10))
    assert ask(rule, np.array([0, 16384]), np.array([16384]), g, layers=32).seqs == (0,)
    assert ask(rule, *mixed, g, layers=32).seqs == (1,)  # built: mixed batches take it too


def test_cuda_rule_counts_what_ran_on_the_kernel_and_nothing_else():
    """The sum is what the kernels ran: a build at exactly the cost (however the sum rounds),
    each sequence of a shape in a batch, nothing for a sequence SDPA ran, nothing left for a
    shape once built; a built shape reused moves up in the LRU; sequences a window keeps off
    SDPA do not make a batch of long prefills a mixed one."""
    g = Geometry(32, 8, 128, 16, mx.bfloat16, 128 ** -0.5)

    def seqs(rule, q_lens, ctx, geometry=g):
        cu = np.concatenate([[0], np.cumsum(q_lens)])
        pick = ask(rule, cu, np.array(q_lens) + np.array(ctx), geometry)
        return pick.seqs if pick else ()
    e = rules.kernel_extra_ms(512, 512, g, 1)
    at_cost = rules.CudaSdpaRule(graph_build_ms=7 * e)  # 7 e rounds above the sum of 7 e's
    assert [seqs(at_cost, [512], [0]) for _ in range(8)] == [()] * 7 + [(0,)]
    twice = rules.CudaSdpaRule(graph_build_ms=1.5 * e)
    assert seqs(twice, [512, 512], [0, 0]) == ()
    assert seqs(twice, [512], [0]) == (0,)  # both sequences counted
    small = rules.CudaSdpaRule(capacity=2, graph_build_ms=0)
    for q in (300, 400, 400, 400, 500):  # 400 built, then run on SDPA: no sum kept for it
        seqs(small, [q], [0])
    assert seqs(small, [300], [0]) == (0,)  # so 300's sum was not evicted
    lru = rules.CudaSdpaRule(capacity=2, graph_build_ms=0)
    for q in (300, 300, 400, 400, 300, 500, 500):  # 300 reused after 400: 400 is evicted
        seqs(lru, [q], [0])
    assert seqs(lru, [300, 1], [0, 50]) == (0,)
    windowed = Geometry(32, 8, 128, 16, mx.bfloat16, 128 ** -0.5, window=1024)
    rule = rules.CudaSdpaRule(graph_build_ms=0)
    assert seqs(rule, [512, 512], [4096, 0], windowed) == ()
    assert seqs(rule, [512, 512], [4096, 0], windowed) == (1,)  # builds: the batch is all long


@pytest.mark.parametrize("bad", [-1.0, float("nan"), "1000", True, None])
def test_cuda_rule_refuses_a_bad_graph_cost(bad):
    with pytest.raises(ValueError, match="graph_build_ms"):
        rules.CudaSdpaRule(graph_build_ms=bad)


def test_cuda_rule_keeps_a_shape_per_layout():
    """K/V read as rows (pages in one run of blocks, read in place) and gathered K/V are two
    cuDNN graphs: a shape whose graph one layout built is new to the other. Without a table
    the SDPA plan gathers, and so does the rule count."""
    g = Geometry(32, 8, 128, 16, mx.bfloat16, 128 ** -0.5)
    rule = rules.CudaSdpaRule(graph_build_ms=0)
    cu, lens = np.array([0, 512]), np.array([4096])
    run = np.arange(3, 3 + 256, dtype=np.int32)[None]
    scattered = run[:, ::-1].copy()
    assert ask(rule, cu, lens, g, run) is None
    assert ask(rule, cu, lens, g, run).seqs == (0,)
    assert ask(rule, cu, lens, g, scattered) is None
    assert ask(rule, cu, lens, g) is not None  # the same gathered layout
    assert ask(rule, np.array([0, 512, 513]), np.array([4096, 40]), g, np.vstack([run, run])).seqs \
        == (0,)  # a mixed batch: its run's graph is built


@pytest.mark.parametrize("kind,q_len,ctx,splits", [
    ("mma", 16, 1024, 3), ("mma", 16, 4096, 9), ("mma", 16, 16384, 17), ("mma", 64, 1024, 3),
    ("mma", 64, 4096, 5), ("mma", 64, 16384, 5), ("wgmma", 16, 1024, 2), ("wgmma", 16, 4096, 8),
    ("wgmma", 64, 1024, 2), ("wgmma", 64, 4096, 5), ("wgmma", 64, 16384, 5),
])
def test_cuda_split_chunking(kind, q_len, ctx, splits):
    """The CUDA plans' measured chunking (host-only): about one item per SM, and no part of a
    split tile under half of the kernel's fewest kv tiles a part (a tile's parts are balanced)."""
    g = Geometry(32, 8, 128, 16, mx.bfloat16, 128 ** -0.5)
    attention = (cuda_attention.CudaPagedAttention() if kind == "mma" else
                 hopper_attention.HopperPagedAttention())
    tiles = plan_of(attention, np.array([0, q_len]), np.array([q_len + ctx]), g).tiles
    work = tiles.work_host
    assert int(work[:, tile_plan.NUM_SPLITS].max()) == splits
    per_sm, min_tiles = cuda_attention.SPLIT_ITEMS_PER_SM, attention.split_min_kv_tiles_for(g)
    assert min_tiles == (cuda_attention if kind == "mma" else hopper_attention).SPLIT_MIN_KV_TILES
    assert tiles.num_items <= cuda_attention.NUM_SMS * per_sm + tiles.num_tiles
    keys = work[:, tile_plan.KV_END] - work[:, tile_plan.KV_START]
    assert (-(-keys // cuda_attention.BLOCK_N)).min() >= min_tiles // 2


def test_hopper_split_chunking_is_the_wgmma_kernels_own():
    """Host-only: the Hopper backend's mma.sync variants (head dims without wgmma) keep the
    mma.sync kernel's measured chunking; only the wgmma kernel's plans take its own."""
    hopper = hopper_attention.HopperPagedAttention()
    for head_dim, expected in ((64, cuda_attention.SPLIT_MIN_KV_TILES),
                               (128, hopper_attention.SPLIT_MIN_KV_TILES)):
        g = Geometry(32, 8, head_dim, 16, mx.bfloat16, head_dim ** -0.5)
        assert hopper.split_min_kv_tiles_for(g) == expected
        plan = plan_of(hopper, np.array([0, 16]), np.array([16 + 1024]), g, block_m=64)
        mma = plan_of(cuda_attention.CudaPagedAttention(), np.array([0, 16]), np.array([16 + 1024]),
                                                       g, block_m=64)
        assert (plan.tiles.num_items == mma.tiles.num_items) == (head_dim == 64)


@pytest.mark.parametrize("head_dim,warp_m", [(64, 16), (128, 32)])
def test_cuda_128_row_tiles_take_32_row_warps_where_measured(head_dim, warp_m):
    """Host-only: 128-row plans run four warps of 32 rows at D=128 (measured faster there),
    eight of 16 elsewhere; 64-row plans always four of 16."""
    g = Geometry(32, 8, head_dim, 16, mx.bfloat16, head_dim ** -0.5)
    attention = cuda_attention.CudaPagedAttention(lambda **_: None)
    big = plan_of(attention, np.array([0, 4096]), np.array([4096]), g)
    assert (big.block_m, big.warp_m, big.launch["threadgroup"][0]) == (128, warp_m,
                                                                       32 * 128 // warp_m)
    small = plan_of(attention, np.array([0, 16]), np.array([4096]), g)
    assert (small.block_m, small.warp_m, small.launch["threadgroup"][0]) == (64, 16, 128)


def test_cuda_launches_of_a_split_plan_run_in_order():
    """Host-only: a split plan's launches take its sets of arrival counters in turn, and each
    takes an output of the last launch on its set as an input (MLX then runs those two in
    order; launches on other sets stay independent); an unsplit plan has one set and its
    launches stay independent. The counters are longer than MLX's pool of <= 8-byte arrays
    (see `qk_scale_bits`), and the scale is a template constant: a scale that is not positive
    and finite is a geometry the kernel does not support."""
    calls = []

    def factory(**_):
        def kernel(inputs, output_shapes, output_dtypes, **__):
            outs = [mx.zeros(s, dtype=d) for s, d in zip(output_shapes, output_dtypes)]
            calls.append((inputs, outs))
            return outs
        return kernel
    g = Geometry(8, 2, 64, 16, mx.bfloat16, 0.125)
    attention = cuda_attention.CudaPagedAttention(factory)
    cache, table = mx.zeros((300, 16, 2, 64), mx.bfloat16), mx.zeros((1, 256), mx.int32)
    lengths = (Lengths.of(np.array([0, 1]), np.array([4096])),
               Lengths.of(np.array([0, 64]), np.array([64])))
    split, whole = (attention.plan(n, g, table) for n in lengths)
    assert split.tiles.num_slots and not whole.tiles.num_slots
    sets = cuda_attention.COUNTER_SETS
    assert sets > 1 and len(split.order.counters) == sets and len(whole.order.counters) == 1
    launches = 2 * sets + 1
    for plan in [split] * launches + [whole] * 2:
        q = mx.zeros((int(plan.lengths.num_tokens), 8, 64), mx.bfloat16)
        attention.launch(q, cache, cache, plan)
    for i, (inputs, _) in enumerate(calls[:launches]):
        counters, after = inputs[-2:]
        assert counters is split.order.counters[i % sets]
        assert after is (counters if i < sets else calls[i - sets][1][2])  # its set's last lse
    assert all(inputs[-2] is inputs[-1] is whole.order.counters[0] for inputs, _ in calls[launches:])
    for plan in (split, whole):
        assert all(c.nbytes > 8 and c.size >= 2 * plan.tiles.num_tiles
                   for c in plan.order.counters)
    assert dict(split.launch["template"])["QK_SCALE_BITS"] == \
        np.float32(0.125 * cuda_attention.LOG2E).view(np.int32)
    for bad in (0.0, -0.125):  # attention still, which the kernel does not compile in
        odd = Geometry(8, 2, 64, 16, mx.bfloat16, bad)
        assert "scale" in attention.unsupported_reason(odd)  # auto takes another path
        with pytest.raises(ValueError, match="scale"):
            plan_of(attention, np.array([0, 1]), np.array([40]), odd)
    for bad in (0.0, -0.125, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="scale"):
            cuda_attention.qk_scale_bits(bad)


def test_cuda_forced_tile_height_is_planned_or_refused():
    """Host-only: `block_m` forces a tile height the kernel has (128 rows never split KV, as
    when its rule picks them) and refuses one it lacks before planning anything."""
    g = Geometry(8, 2, 64, 16, mx.bfloat16, 0.125)
    attention = cuda_attention.CudaPagedAttention(lambda **_: None)
    decode = (np.array([0, 1, 2]), np.array([4096, 300]))
    assert plan_of(attention, *decode, g).block_m == 64  # chosen: too few rows for 128
    forced = plan_of(attention, *decode, g, block_m=np.int64(128))
    assert forced.block_m == 128 and type(forced.block_m) is int
    assert forced.tiles.num_slots == 0
    for bad in (32, 0, "128", 64.0, True):
        with pytest.raises(ValueError, match="block_m"):
            plan_of(attention, *decode, g, block_m=bad)


@pytest.mark.parametrize("window", [None, 77])
@pytest.mark.parametrize("kernel", [cuda_attention.CudaPagedAttention,
                                    hopper_attention.HopperPagedAttention,
                                    metal_attention.MetalPagedAttention],
                         ids=["mma", "hopper", "metal"])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_canary_splits_kv(kernel, group, head_dim, window):
    """Host-only: one of the canary's plannings splits its case's keys at every group, so the
    first-use check runs the merge (sinks included). A large group fills Metal's GPU_CORES query
    tiles with the case's rows: its last planning splits every tile whatever their number."""
    from paged_prefix import canary

    attention = kernel(lambda **_: None)
    g = Geometry(2 * group, 2, head_dim, 16, mx.bfloat16, head_dim ** -0.5, window=window,
                 sinks=True)
    small, _, _, _, table, cu, seq_lens, _ = canary._case(g)
    plannings = attention.canary_plannings(small)
    slots = [attention.plan(Lengths.of(cu, seq_lens), small, table, **p).tiles.num_slots
             for p in plannings]
    assert any(slots), (plannings, slots)
    if kernel is not metal_attention.MetalPagedAttention:  # 128-row tiles never split
        assert slots[0] == 0
    for bad in (0, -1, 1.0, True, "1"):
        with pytest.raises(ValueError, match="split_kv_tiles"):
            attention.plan(Lengths.of(cu, seq_lens), small, table, split_kv_tiles=bad)


@pytest.mark.skipif(emulated_metal_kernel is None, reason="no Metal emulation")
def test_metal_has_one_tile_height_and_refuses_others():
    g = Geometry(8, 2, 64, 16, mx.float16, 0.125)
    attention = metal_backend(emulated_metal_kernel).attention
    assert attention.tile_rows(g) == (32,)
    assert plan_of(attention, np.array([0, 3]), np.array([40]), g, block_m=32).tiles.num_tiles
    with pytest.raises(ValueError, match="block_m"):
        plan_of(attention, np.array([0, 3]), np.array([40]), g, block_m=64)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_first_use_check_builds_every_tile_height(backend):
    """The canary runs each height a plan may choose, so a server's warm-up builds them all:
    a batch of decode rows (64-row tiles) after a warm-up of long prefills (128) must not wait
    for a compile."""
    from paged_prefix import canary

    kernels = get_backend(backend)
    g = Geometry(32, 8, 64, 16, mx.bfloat16, 0.125)
    kernels.attention._kernels.clear()
    assert canary.check(kernels.attention, g) is None
    if backend.startswith("cuda"):  # keyed (dtype, head_dim, group, block, block_m, warp_m)
        assert {key[4] for key in kernels.attention._kernels} == {64, 128}
    else:  # one height; keyed (kind, ...)
        assert ("attention", g.dtype, 64, 4, 16) in kernels.attention._kernels


def test_cuda_rule_forgets_shapes_as_mlx_evicts_their_graphs(monkeypatch):
    """The rule's memories of shapes are LRUs of MLX's cuDNN graph-cache size: the least
    recently asked shape is forgotten (its kernel time starts again from nothing; a built
    graph may be gone), a shape asked again is kept."""
    g = Geometry(32, 8, 128, 16, mx.bfloat16, 128 ** -0.5)

    def ask(rule, q):
        return rule(Lengths.of(np.array([0, q]), np.array([q + 100])), g, {}) is not None
    monkeypatch.setenv("MLX_CUDA_SDPA_CACHE_SIZE", "3")
    rule = rules.CudaSdpaRule(graph_build_ms=0)
    assert rule.capacity == 3
    for q in (300, 400, 500, 600):  # 300's kernel time is forgotten
        assert not ask(rule, q)
    assert not ask(rule, 300)  # asked anew (and 400 forgotten)
    assert ask(rule, 600) and ask(rule, 500) and ask(rule, 300) and not ask(rule, 400)
    assert len(rule._kernel_ms) <= 3 and len(rule._built) == 3
    for q in (700, 800):  # two more graphs built: 600's, the least recently used, is gone
        ask(rule, q)
        assert ask(rule, q)
    assert not ask(rule, 600)
    with pytest.raises(ValueError, match="capacity"):
        rules.CudaSdpaRule(0)
    for bad in ("0", "many", "-3"):
        monkeypatch.setenv("MLX_CUDA_SDPA_CACHE_SIZE", bad)
        with pytest.raises(ValueError, match="MLX_CUDA_SDPA_CACHE_SIZE"):
            rules.CudaSdpaRule()


@pytest.mark.parametrize("q_lens,ctx_lens,sdpa", [
    ([4096], [0], (0,)), ([4096], [16], ()), ([64], [0], ()), ([1] * 32, [0] * 32, ()),
    ([1, 600, 700], [30, 0, 5], (1,)),
])
def test_metal_rule_leaves_the_kernel_only_for_long_fresh_prompts(q_lens, ctx_lens, sdpa):
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    lens = np.array(q_lens) + np.array(ctx_lens)
    g = Geometry(32, 8, 128, 16, mx.bfloat16, 128 ** -0.5)
    pick = rules.metal_prefers_sdpa(Lengths.of(cu, lens), g, {})
    assert (pick.seqs if pick else ()) == sdpa


def test_backends_build_without_a_device():
    """Backends are plain objects over a kernel factory: building one compiles nothing."""
    calls = []
    backend = cuda_backend(lambda **kw: calls.append(kw) or (lambda **_: None))
    assert backend.attention.unsupported_reason(Geometry(8, 2, 64, 16, mx.float16, 0.1)) is None
    assert calls == [] and metal_backend(lambda **kw: None).name == "metal"


def test_hopper_kernel_source_is_one_self_contained_unit():
    """NVRTC gets no include path: the source declares what it uses, for either 16-bit type."""
    for dtype, ab in ((mx.bfloat16, "bf16"), (mx.float16, "f16")):
        g = Geometry(32, 8, 128, 16, dtype, 128 ** -0.5)
        src = hopper_attention.kernel_source("paged_prefill_test", g)
        assert "#include" not in src
        assert 'extern "C" __global__' in src and "#define KERNEL_NAME paged_prefill_test\n" in src
        assert f'#define AB "{ab}"' in src
        assert f"QK_SCALE_BITS = {cuda_attention.qk_scale_bits(g.scale)}" in src


def test_hopper_kernel_launch_contract():
    """The wgmma path's host side, with stand-ins: compiled once per variant for sm_90a and
    launched as a cubin with the mma.sync kernel's inputs and outputs, then the query heads and
    the table's width; 64-row tiles only; head dim 64 stays on the mma.sync kernel."""
    stand_ins, built = CubinStandIns(), []
    compiled, launched = stand_ins.compiled, stand_ins.launched

    def cuda_kernel(**kw):
        built.append(kw["name"])
        return lambda inputs, output_shapes, output_dtypes, **_: zeros(output_shapes, output_dtypes)

    attention = hopper_attention.HopperPagedAttention(cuda_kernel, compile=stand_ins.compile,
                                                      precompiled_kernel=stand_ins.precompiled)
    c = PagedCase([16, 1], [1500, 700], 32, 8, 128, 16, mx.bfloat16)
    g = Geometry(32, 8, 128, 16, mx.bfloat16, 128 ** -0.5)
    _, plan = c.attend(attention, g)
    assert plan.block_m == 64 and attention.tile_rows(g) == (64,) and plan.tiles.num_slots
    attention.run(c.q, c.k_new, c.v_new, c.k_cache, c.v_cache, plan)
    assert [arch for _, arch in compiled] == ["sm_90a"] and built == []
    kw = launched[0]
    assert kw["name"] == compiled[0][0] and kw["compiled_source"] == b"cubin"
    assert kw["scalars"] == [32, c.block_tables.shape[1]]
    assert kw["grid"] == (plan.tiles.num_items * 128, 1, 1) and kw["threadgroup"] == (128, 1, 1)
    assert kw["ensure_row_contiguous"] and kw["shared_memory"] >= 2 * 2 * 64 * 128 * 2 + 1024
    assert len(kw["inputs"]) == 7 and kw["inputs"][5] is not launched[1]["inputs"][5]  # sets
    with pytest.raises(ValueError, match="block_m"):
        attention.plan(c.lengths, g, c.block_tables, block_m=128)
    c64 = PagedCase([5], [40], 8, 2, 64, 16, mx.bfloat16)
    g64 = Geometry(8, 2, 64, 16, mx.bfloat16, 0.125)
    c64.attend(attention, g64, block_m=128)
    assert len(built) == 1 and "_m128_" in built[0] and len(launched) == 2


def test_cuda_backend_logs_which_kernel_it_runs(caplog):
    with caplog.at_level(logging.INFO, logger="jit_kernels"):
        backend = cuda_backend(lambda **_: None)
    kind = "wgmma" if HAS_WGMMA else "mma.sync"
    assert isinstance(backend.attention, hopper_attention.HopperPagedAttention) == HAS_WGMMA
    assert f"CUDA paged attention: the {kind} kernel" in caplog.text
    if not HAS_CUDA:
        assert "no CUDA device" in caplog.text


def test_wgmma_can_be_turned_off_and_a_bad_setting_is_refused(monkeypatch, caplog):
    monkeypatch.setenv("PAGED_PREFIX_CUDA_WGMMA", "0")
    with caplog.at_level(logging.INFO, logger="jit_kernels"):
        backend = cuda_backend(lambda **_: None)
    assert type(backend.attention) is cuda_attention.CudaPagedAttention
    assert "the mma.sync kernel (PAGED_PREFIX_CUDA_WGMMA=0)" in caplog.text
    monkeypatch.setenv("PAGED_PREFIX_CUDA_WGMMA", "yes")
    with pytest.raises(ValueError, match="PAGED_PREFIX_CUDA_WGMMA"):
        cuda_backend(lambda **_: None)


def test_missing_nvrtc_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(nvrtc, "_candidates", lambda: ["/nonexistent/libnvrtc.so.13"])
    nvrtc.library.cache_clear()
    try:
        with pytest.raises(nvrtc.NvrtcError, match="libnvrtc.so.13 not found"):
            nvrtc.compile_cubin("", "x", "sm_90a")
        with pytest.raises(nvrtc.NvrtcError, match="libnvrtc.so.13 not found"):
            nvrtc.library()
    finally:
        nvrtc.library.cache_clear()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_WGMMA, reason="no Hopper GPU")
def test_hopper_gpu_runs_the_wgmma_kernel_at_head_dim_128():
    attention = available_backends()["cuda"].attention
    assert isinstance(attention, hopper_attention.HopperPagedAttention)
    attention._kernels.clear()
    check("cuda", [16, 3], [300, 0])
    assert attention._kernels and all(key[0] == "wgmma" for key in attention._kernels)
