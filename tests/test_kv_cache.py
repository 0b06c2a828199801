"""Paged KV cache: slot writes land where the slot mapping says, in place."""

import mlx.core as mx
import numpy as np
import pytest

from paged_prefix.kv_cache import PagedKVCache
from tests.conftest import DTYPES


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_write_lands_in_slots_and_skips_padding(dtype, block_size):
    cache = PagedKVCache(2, 6, block_size, 2, 64, dtype)
    rng = np.random.default_rng(block_size)
    slots = rng.choice(6 * block_size, size=9, replace=False)
    slots[4] = -1  # padding row: must not be written anywhere
    k = mx.array(rng.standard_normal((9, 2, 64), dtype=np.float32)).astype(dtype)
    cache.write(1, k, -k, mx.array(slots))
    kb, vb = cache.blocks(1)
    mx.eval(kb, vb)
    assert kb.shape == (6, block_size, 2, 64)
    flat_k = np.array(kb.reshape(-1, 2, 64).astype(mx.float32))
    flat_v = np.array(vb.reshape(-1, 2, 64).astype(mx.float32))
    expect = np.array(k.astype(mx.float32))
    written = slots >= 0
    np.testing.assert_array_equal(flat_k[slots[written]], expect[written])
    np.testing.assert_array_equal(flat_v[slots[written]], -expect[written])
    untouched = np.setdiff1d(np.arange(6 * block_size), slots[written])
    assert not flat_k[untouched].any() and not flat_v[untouched].any()
    assert not np.array(cache.blocks(0)[0].astype(mx.float32)).any()


def test_write_is_in_place_not_a_cache_copy():
    """Peak memory of one write step grows by about the new K/V, never by the cache."""
    cache = PagedKVCache(1, 4096, 16, 8, 64, mx.float16)  # 64 MiB per K and per V
    rng = np.random.default_rng(0)
    k = mx.array(rng.standard_normal((64, 8, 64), dtype=np.float32)).astype(mx.float16)
    slots = mx.array(rng.choice(4096 * 16, size=64, replace=False))
    mx.eval(k, slots)
    growth = []
    for _ in range(3):
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        cache.write(0, k, k, slots)
        kb, vb = cache.blocks(0)
        mx.eval(kb, vb)
        growth.append(mx.get_peak_memory() - base)
        del kb, vb
    new_kv = 2 * k.nbytes
    assert max(growth) < 4 * new_kv + 64 * 1024, (
        f"write grew peak memory by {max(growth)} bytes; new K/V are {new_kv}, "
        f"one cache array is {cache.nbytes // 2}")


@pytest.mark.parametrize("field, value", [("num_blocks", 0), ("block_size", -1),
                                          ("head_dim", 0), ("num_kv_heads", 0)])
def test_bad_geometry_names_field(field, value):
    args = dict(num_layers=1, num_blocks=4, block_size=16, num_kv_heads=2, head_dim=64)
    args[field] = value
    with pytest.raises(ValueError, match=field):
        PagedKVCache(**args)


def test_bad_dtype():
    with pytest.raises(ValueError, match="dtype"):
        PagedKVCache(1, 4, 16, 2, 64, mx.int32)
