"""The gather reference and the sdpa path against the float64 oracle on shuffled pages."""

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import reference
from jit_kernels import ContiguousSdpa
from jit_kernels.geometry import Geometry, Lengths
from paged_prefix.dispatch import Dispatcher
from paged_prefix.route import Source
from tests.conftest import DTYPES, PagedCase, assert_close

NUM_KV_HEADS = 2
lengths = st.lists(st.tuples(st.integers(1, 40), st.integers(0, 100)), min_size=1, max_size=3)


def run_reference(c: PagedCase, scale):
    return reference.paged_attention(c.q, c.k_cache, c.v_cache, c.block_tables, c.cu_seqlens_q,
                                     c.seq_lens, scale)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@settings(max_examples=6, derandomize=True, deadline=None)
@given(seqs=lengths, seed=st.integers(0, 2**31 - 1))
def test_reference_matches_oracle(block_size, head_dim, group, dtype, seqs, seed):
    c = PagedCase([q for q, _ in seqs], [k for _, k in seqs], NUM_KV_HEADS * group, NUM_KV_HEADS,
                  head_dim, block_size, dtype, seed=seed)
    scale = head_dim ** -0.5
    assert_close(run_reference(c, scale), c.oracle(scale), dtype, f"{seqs}")


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_reference_keeps_fp32_scores_for_large_scores(dtype):
    """|scale q.k| up to ~150: half-precision scores (MLX's CPU fallback) miss the tolerance."""
    c = PagedCase([9, 1, 30], [40, 70, 0], 8, 2, 64, 16, dtype, seed=5, q_scale=40.0)
    scale = 64 ** -0.5
    assert_close(run_reference(c, scale), c.oracle(scale), dtype, q_scale=c.q_scale)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_sdpa_path_equals_reference(dtype):
    """New rows for uncached sequences, MLX-gathered pages for the others: the same numbers."""
    c = PagedCase([9, 1, 30, 4], [40, 70, 0, 0], 8, 2, 64, 16, dtype, seed=6)
    g = Geometry(8, 2, 64, 16, dtype, 0.125)
    out = c.forward(Dispatcher("sdpa", backends={}), g)
    np.testing.assert_array_equal(np.array(out.astype(mx.float32)),
                                  np.array(run_reference(c, 0.125).astype(mx.float32)))


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_sdpa_path_reads_runs_of_pages_in_place(dtype, gathered):
    """A cached sequence whose pages are one run of consecutive blocks is read in place (a
    view of the cache, NaN blocks either side), the others gathered: the oracle's numbers from
    the stored form too, and on the CPU the reference's bit for bit (a GPU's SDPA may pick
    another kernel for another K/V layout)."""
    c = PagedCase([9, 1, 30, 4, 16], [40, 70, 0, 0, 33], 8, 2, 64, 16, dtype, seed=6,
                  runs=[True, False, True, True, True])
    g = Geometry(8, 2, 64, 16, dtype, 0.125)
    d = Dispatcher("sdpa", backends={})
    want = np.array(run_reference(c, 0.125).astype(mx.float32))
    gathered.clear()
    stored = [x.reshape(-1, 2, 64).view(mx.uint32) for x in (c.k_cache, c.v_cache)]
    for k_cache, v_cache in ((c.k_cache, c.v_cache), stored):
        out = c.forward(d, g, k_cache, v_cache)
        assert_close(out, c.oracle(0.125), dtype)
        if mx.default_device() == mx.cpu:
            np.testing.assert_array_equal(np.array(out.astype(mx.float32)), want)
    # 2 and 3 have nothing cached, 0 and 4 are runs: only 1 is gathered, once per call
    assert d.last.sources == (Source.IN_PLACE, Source.GATHERED, Source.NEW_ROWS,
                              Source.NEW_ROWS, Source.IN_PLACE)
    assert gathered == [int(c.seq_lens[1])] * 2
    with pytest.raises(ValueError, match="block_tables: the plan reads cache rows"):
        c.forward(d, g, c.k_cache[:-2], c.v_cache[:-2])


@pytest.mark.parametrize("runs, match", [
    ({2: ((0, 1),)}, "sequences \\[2\\] are not planned"),
    ({}, "sequences \\[0, 1, 4\\] .* no runs of blocks"),
    ({0: ((0, 4),), 1: ((5, 2), (9, 4)), 4: ((20, 4),)}, "sequence 1's runs .* do not hold its 5"),
    ({0: ((0, 3),), 1: ((5, 2), (9, 3)), 4: ((20, 4),)}, "sequence 0's runs .* do not hold its 4"),
])
def test_sdpa_in_place_plan_refuses_what_it_cannot_read(runs, match):
    """Only planned sequences read in place, and every planned one with a cached prefix must."""
    c = PagedCase([9, 1, 30, 4, 16], [40, 70, 0, 0, 33], 8, 2, 64, 16, mx.float32, seed=6)
    with pytest.raises(ValueError, match=match):
        ContiguousSdpa().plan(c.lengths, Geometry(8, 2, 64, 16, mx.float32, 0.125),
                              c.block_tables, (0, 1, 3, 4), runs=runs)


def test_oracle_catches_a_wrong_page():
    """A test that cannot fail proves nothing: read one wrong page and the check must trip.

    (Swapping two fully visible pages would not do: attention is order-invariant over
    the keys it sees.)"""
    c = PagedCase([7], [40], 4, 2, 64, 16, mx.float32, seed=1)
    spare = int(c.tables[0, -1])  # a poisoned page: swap in a finite wrong one instead
    wrong = c.tables.copy()
    owned = set(c.tables[0, :3].tolist())
    wrong[0, 0] = next(b for b in range(c.num_blocks) if b not in owned and b != spare)
    k = mx.where(mx.isnan(c.k_cache), 0.5, c.k_cache)
    v = mx.where(mx.isnan(c.v_cache), 0.5, c.v_cache)
    out = reference.paged_attention(c.q, k, v, mx.array(wrong), c.cu_seqlens_q, c.seq_lens, 0.125)
    with pytest.raises(AssertionError):
        assert_close(out, c.oracle(0.125), mx.float32)


@pytest.mark.parametrize("change, field", [
    (lambda q, k, v: (q[:-1], k, v), "q"),
    (lambda q, k, v: (q.reshape(-1), k, v), "q"),
    (lambda q, k, v: (q[:, :3], k, v), "q"),
    (lambda q, k, v: (q.astype(mx.float16), k, v), "q"),
    (lambda q, k, v: (q, k[:, :4], v[:, :4]), "block_tables"),
    (lambda q, k, v: (q, k, v[..., :32]), "v_cache"),
])
def test_contract_violations_name_the_input(change, field):
    c = PagedCase([5], [20], 4, 2, 64, 16, mx.float32, seed=2)
    q, k, v = change(c.q, c.k_cache, c.v_cache)
    with pytest.raises(ValueError, match=field):
        reference.paged_attention(q, k, v, c.block_tables, c.cu_seqlens_q, c.seq_lens, 0.125)


@pytest.mark.parametrize("scale", [float("nan"), float("-inf"), "0.125", False])
def test_a_bad_scale_is_named(scale):
    c = PagedCase([5], [20], 4, 2, 64, 16, mx.float32, seed=3)
    with pytest.raises(ValueError, match="scale"):
        reference.paged_attention(c.q, c.k_cache, c.v_cache, c.block_tables, c.cu_seqlens_q,
                                  c.seq_lens, scale)


@pytest.mark.parametrize("cu, lens, field", [
    ([0, 5, 5], [25, 3], "cu_seqlens_q"),
    ([1, 5], [25], "cu_seqlens_q"),
    ([0, 5], [4], "seq_lens"),
    ([0, 5], [25, 7], "cu_seqlens_q"),
    ([0, 5], [25.9], "seq_lens"),  # not truncated to 25
    ([0, 5.0], [25], "cu_seqlens_q"),
    ([0, 5], [True], "seq_lens"),
    ([[0, 5]], [25], "cu_seqlens_q"),
    ([0, 5], [2**64 - 1], "seq_lens"),
    ([0], [], "seq_lens: a batch needs at least one sequence"),
])
def test_bad_lengths_name_the_field(cu, lens, field):
    c = PagedCase([5], [20], 4, 2, 64, 16, mx.float32, seed=3)
    with pytest.raises(ValueError, match=field):
        reference.paged_attention(c.q, c.k_cache, c.v_cache, c.block_tables, np.array(cu),
                                  np.array(lens), 0.125)
    with pytest.raises(ValueError, match=field):  # every backend's plan checks them alike
        Lengths.of(np.array(cu), np.array(lens))
