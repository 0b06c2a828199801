"""Paged KV cache: slot writes land where the slot mapping says, in place, and only valid ones."""

import mlx.core as mx
import numpy as np
import pytest

from paged_prefix.kv_cache import MAX_SLICE_RUNS, PagedKVCache
from tests.conftest import DTYPES


def slot_layout(layout: str, block_size: int, rng) -> np.ndarray:
    """Slots over 6 blocks: scattered, or contiguous runs (a run per block, blocks in order
    given: 'runs-2-0-4' is blocks 2, 0, 4), the last run partly filled."""
    if layout == "scattered":
        return rng.choice(6 * block_size, size=9, replace=False)
    blocks = [int(b) for b in layout.split("-")[1:]]
    slots = np.concatenate([b * block_size + np.arange(block_size) for b in blocks])
    return slots[:len(slots) - block_size // 2]


# one run, runs out of order, the most runs still sliced, one more (scattered), adjacent blocks
# that merge into one run
LAYOUTS = ["scattered", "runs-3", "runs-2-0-4", "runs-5-1-3-0", "runs-5-1-3-0-2", "runs-1-2-3"]


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("device", [False, True], ids=["host", "device-copy"])
def test_write_lands_in_slots(dtype, block_size, layout, device):
    cache = PagedKVCache(2, 6, block_size, 2, 64, dtype)
    rng = np.random.default_rng(block_size)
    slots = slot_layout(layout, block_size, rng)
    on_device = mx.array(slots.astype(np.int32)) if device else None
    checked = cache.slots(slots, on_device)
    sliced = layout.startswith("runs") and len(layout.split("-")) <= 1 + MAX_SLICE_RUNS
    assert bool(checked.runs) == sliced  # the path under test is the one that ran
    if device and not sliced:
        assert checked.device is on_device  # the caller's copy, no fresh host-written array
    if layout == "runs-1-2-3":
        assert len(checked.runs) == 1
    k = mx.array(rng.standard_normal((len(slots), 2, 64), dtype=np.float32)).astype(dtype)
    cache.write(1, k, -k, checked)
    kb, vb = cache.blocks(1)
    mx.eval(kb, vb)
    assert kb.shape == (6, block_size, 2, 64)
    flat_k = np.array(kb.reshape(-1, 2, 64).astype(mx.float32))
    flat_v = np.array(vb.reshape(-1, 2, 64).astype(mx.float32))
    expect = np.array(k.astype(mx.float32))
    np.testing.assert_array_equal(flat_k[slots], expect)
    np.testing.assert_array_equal(flat_v[slots], -expect)
    untouched = np.setdiff1d(np.arange(6 * block_size), slots)
    assert not flat_k[untouched].any() and not flat_v[untouched].any()
    assert not np.array(cache.blocks(0)[0].astype(mx.float32)).any()


@pytest.mark.parametrize("layout", ["scattered", "runs"])
def test_write_is_in_place_not_a_cache_copy(layout):
    """Peak memory of one write step grows by about the new K/V, never by the cache."""
    cache = PagedKVCache(1, 4096, 16, 8, 64, mx.float16)  # 64 MiB per K and per V
    rng = np.random.default_rng(0)
    k = mx.array(rng.standard_normal((64, 8, 64), dtype=np.float32)).astype(mx.float16)
    rows = (rng.choice(4096 * 16, size=64, replace=False) if layout == "scattered" else
            np.concatenate([np.arange(100 * 16, 102 * 16), np.arange(7 * 16, 9 * 16)]))
    slots = cache.slots(rows)
    assert bool(slots.runs) == (layout == "runs")
    mx.eval(k)
    growth = []
    for _ in range(3):
        mx.eval(cache.arrays())
        mx.synchronize()  # the write follows the evaluation at once (see runner.py)
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        cache.write(0, k, k, slots)
        kb, vb = cache.blocks(0)
        mx.eval(kb, vb)
        growth.append(mx.get_peak_memory() - base)
        del kb, vb
    new_kv = 2 * k.nbytes
    assert max(growth) < 4 * new_kv + 64 * 1024, (
        f"write grew peak memory by {max(growth)} bytes; new K/V are {new_kv}, "
        f"one cache array is {cache.nbytes // 2}")


def test_restore_drops_pending_writes():
    cache = PagedKVCache(1, 4, 16, 2, 64, mx.float32)
    snapshot = cache.snapshot()
    cache.write(0, mx.ones((3, 2, 64)), mx.ones((3, 2, 64)), cache.slots(np.array([0, 5, 9])))
    cache.restore(snapshot)
    assert not np.array(cache.blocks(0)[0]).any()


@pytest.mark.parametrize("slots, match", [
    ([10**6], "slot_mapping"),       # past the cache: used to kill the process
    ([-5], "slot_mapping"),          # negative: used to be taken as padding
    ([-1], "slot_mapping"),          # no padding convention any more
    ([3, 3], "twice"),
    ([3, 4, 5, 4, 5], "twice"),       # two runs that overlap
    ([9, 1, 2, 5, 7, 1], "twice"),    # too many runs to slice: the scatter's check
    ([1.5], "slot_mapping"),
])
def test_bad_slots_are_refused(slots, match):
    cache = PagedKVCache(1, 4, 16, 2, 64)
    with pytest.raises(ValueError, match=match):
        cache.slots(np.array(slots))


@pytest.mark.parametrize("device", [mx.array([1, 5]), mx.array([1.0, 5.0, 7.0])])
def test_a_bad_device_copy_of_the_slots_is_refused(device):
    cache = PagedKVCache(1, 4, 16, 2, 64)
    with pytest.raises(ValueError, match="slot_mapping: the device copy"):
        cache.slots(np.array([1, 5, 7]), device)


def test_write_checks_its_arguments():
    cache = PagedKVCache(2, 4, 16, 2, 64)
    other = PagedKVCache(2, 4, 16, 2, 64)
    slots = cache.slots(np.array([1, 2]))
    kv = mx.zeros((2, 2, 64), mx.float16)
    with pytest.raises(ValueError, match="slots"):
        cache.write(0, kv, kv, other.slots(np.array([1, 2])))
    with pytest.raises(ValueError, match="slots"):
        cache.write(0, kv, kv, mx.array([1, 2]))
    with pytest.raises(ValueError, match="keys, values"):
        cache.write(0, kv[:1], kv[:1], slots)
    with pytest.raises(ValueError, match="layer"):
        cache.write(2, kv, kv, slots)


@pytest.mark.parametrize("field, value", [("num_blocks", 0), ("block_size", -1),
                                          ("head_dim", 0), ("num_kv_heads", 0),
                                          ("num_blocks", 2.5)])
def test_bad_geometry_names_field(field, value):
    args = dict(num_layers=1, num_blocks=4, block_size=16, num_kv_heads=2, head_dim=64)
    args[field] = value
    with pytest.raises(ValueError, match=field):
        PagedKVCache(**args)


def test_bad_dtype():
    with pytest.raises(ValueError, match="dtype"):
        PagedKVCache(1, 4, 16, 2, 64, mx.int32)
