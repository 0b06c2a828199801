"""The gather reference against the dense oracle on shuffled, non-contiguous pages."""

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import reference
from paged_prefix.metadata import build_attention_metadata
from tests.conftest import DTYPES, assert_close, random_cache, random_layout

NUM_KV_HEADS = 2


def dense_oracle(q, k_cache, v_cache, meta, scale):
    """Per sequence: read its keys page by page in plain numpy order, then dense attention."""
    outs = []
    cu = meta.cu_seqlens_q_host
    for s in range(meta.num_seqs):
        seq_len = int(meta.seq_lens_host[s])
        rows = [int(meta.block_tables_host[s, t // meta.block_size]) * meta.block_size
                + t % meta.block_size for t in range(seq_len)]
        idx = mx.array(rows)
        flat = lambda c: c.reshape(-1, *c.shape[2:])  # noqa: E731
        outs.append(reference.dense_attention(
            q[int(cu[s]):int(cu[s + 1])], flat(k_cache)[idx], flat(v_cache)[idx], scale,
            int(meta.context_lens_host[s])))
    return mx.concatenate(outs)


lengths = st.lists(st.tuples(st.integers(1, 40), st.integers(0, 100)), min_size=1, max_size=3)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@settings(max_examples=8, derandomize=True, deadline=None)
@given(seqs=lengths, seed=st.integers(0, 2**31 - 1))
def test_reference_matches_dense_oracle(block_size, head_dim, group, dtype, seqs, seed):
    rng = np.random.default_rng(seed)
    q_lens, ctx = [q for q, _ in seqs], [c for _, c in seqs]
    meta, _ = random_layout(rng, q_lens, ctx, block_size)
    k_cache, v_cache = random_cache(rng, meta.num_blocks, block_size, NUM_KV_HEADS, head_dim, dtype)
    q = mx.array(rng.standard_normal((meta.num_tokens, NUM_KV_HEADS * group, head_dim),
                                     dtype=np.float32)).astype(dtype)
    scale = head_dim ** -0.5
    out = reference.paged_attention(q, k_cache, v_cache, meta, scale)
    assert_close(out, dense_oracle(q, k_cache, v_cache, meta, scale), dtype,
                 f"q_lens={q_lens} ctx={ctx}")


def test_oracle_catches_a_wrong_page():
    """A test that cannot fail proves nothing: read one wrong page and the check must trip.

    (Swapping two fully visible pages would not do: attention is order-invariant over
    the keys it sees.)"""
    rng = np.random.default_rng(1)
    meta, tables = random_layout(rng, [7], [40], 16)
    k_cache, v_cache = random_cache(rng, meta.num_blocks, 16, 2, 64, mx.float32)
    q = mx.array(rng.standard_normal((7, 4, 64), dtype=np.float32))
    out = reference.paged_attention(q, k_cache, v_cache, meta, 0.125)
    spare = sorted(set(range(meta.num_blocks)) - set(tables[0]))[0]
    wrong = build_attention_metadata([7], [40], [[spare, *tables[0][1:]]], 16, meta.num_blocks)
    with pytest.raises(AssertionError):
        assert_close(out, dense_oracle(q, k_cache, v_cache, wrong, 0.125), mx.float32)


@pytest.mark.parametrize("change, field", [
    (lambda q, k, v: (q[:-1], k, v), "q"),
    (lambda q, k, v: (q.reshape(-1), k, v), "q"),
    (lambda q, k, v: (q[:, :3], k, v), "q"),
    (lambda q, k, v: (q.astype(mx.float16), k, v), "q"),
    (lambda q, k, v: (q, k[:, :8], v[:, :8]), "k_cache"),
    (lambda q, k, v: (q, k[:2], v[:2]), "k_cache"),
    (lambda q, k, v: (q, k, v[..., :32]), "v_cache"),
])
def test_contract_violations_name_the_input(change, field):
    rng = np.random.default_rng(2)
    meta, _ = random_layout(rng, [5], [20], 16)
    k, v = random_cache(rng, meta.num_blocks, 16, 2, 64, mx.float32)
    q = mx.array(rng.standard_normal((5, 4, 64), dtype=np.float32))
    with pytest.raises(ValueError, match=field):
        reference.paged_attention(*change(q, k, v), meta, 0.125)
