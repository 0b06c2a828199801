"""Paged KV cache: slot writes land where the slot mapping says, in place, and only valid ones."""

import mlx.core as mx
import numpy as np
import pytest

from paged_prefix.kv_cache import MAX_SLICE_RUNS, PagedKVCache
from paged_prefix.kv_layout import KVGroup, KVLayout
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
    for bad in (mx.zeros((2, 2, 64), mx.int32), np.zeros((2, 2, 64), np.float16)):
        with pytest.raises(ValueError, match="keys: expected a floating mx.array"):
            cache.write(0, bad, kv, slots)


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


def gemma_like(num_layers: int, per_group: int) -> list[KVGroup]:
    """vLLM's groups of a 5 sliding : 1 full model (`_get_kv_cache_groups_uniform_page_size`):
    the full layers in groups of `per_group`, the sliding ones spread over groups as large."""
    full = [i for i in range(num_layers) if i % 6 == 5]
    sliding = [i for i in range(num_layers) if i % 6 != 5]
    n = -(-len(sliding) // per_group)
    return ([KVGroup(tuple(full[i::len(full) // per_group]), None)
             for i in range(len(full) // per_group)]
            + [KVGroup(tuple(sliding[i::n]), 512) for i in range(n)])


@pytest.mark.parametrize("num_layers, per_group", [(6, 1), (12, 2), (26, 4), (62, 10)])
def test_layers_of_one_group_never_share_an_array_and_a_forward_waits_once_per_round(
        num_layers, per_group):
    groups = gemma_like(num_layers, per_group)
    layout = KVLayout.of(groups, num_layers)
    assert layout.num_arrays == max(len(g.layers) for g in groups)
    for g in groups:  # one block table: its layers' rows must be apart
        assert len({layout.array_of[i] for i in g.layers}) == len(g.layers)
    # a layer waits exactly when its array was written since the last wait
    written = set()
    for i in range(num_layers):
        if layout.array_of[i] in written:
            assert i in layout.wait_before
        if i in layout.wait_before:
            written = set()
        written.add(layout.array_of[i])
    # the arrays fill round by round: about one wait per num_arrays layers, not one a layer
    assert len(layout.wait_before) <= -(-num_layers // layout.num_arrays)


def test_one_group_keeps_an_array_pair_per_layer_and_never_waits():
    layout = KVLayout.single(5)
    assert layout.array_of == (0, 1, 2, 3, 4) and not layout.wait_before
    assert layout.windows == (None,) and layout.group_of == (0,) * 5


@pytest.mark.parametrize("groups, field", [
    ([], "groups"),
    ([KVGroup((0, 1)), KVGroup((1, 2))], "layer 1 is in groups 0 and 1"),
    ([KVGroup((0, 1))], r"layers \[2\] are in no group"),
    ([KVGroup((0, 1, 2), 0)], "window"),
    ([KVGroup((0, 1, 3))], "layers"),
    ([KVGroup(())], "groups"),
])
def test_bad_groups_name_the_field(groups, field):
    with pytest.raises(ValueError, match=field):
        KVLayout.of(groups, 3)


def test_layers_sharing_an_array_write_their_own_blocks():
    """Layers 0 (group 0) and 1 (group 1) share one array pair: each group's blocks hold its
    own layer's rows, and a layer's view is the shared array."""
    layout = KVLayout.of([KVGroup((0,)), KVGroup((1,), 32)], 2)
    cache = PagedKVCache(2, 6, 16, 2, 64, mx.float32, layout)
    assert layout.array_of == (0, 0) and layout.wait_before == frozenset({1})
    assert cache.nbytes == 2 * 6 * 16 * 2 * 64 * 4  # one K and one V array
    rows0, rows1 = np.arange(16, 40), np.arange(64, 70)  # group 0 in blocks 1-2, group 1 in 4
    k0, k1 = mx.ones((24, 2, 64)), 2 * mx.ones((6, 2, 64))
    cache.write(0, k0, -k0, cache.slots(rows0))
    cache.write(1, k1, -k1, cache.slots(rows1))
    k, v = (np.array(a).reshape(-1, 2, 64) for a in cache.blocks(0))
    assert (k[rows0] == 1).all() and (k[rows1] == 2).all() and (v[rows1] == -2).all()
    assert not np.delete(k, np.concatenate([rows0, rows1]), axis=0).any()
    assert all(a is b for a, b in zip(cache.stored(0), cache.stored(1)))
    assert cache.windows == (None, 32) and len(cache.arrays(range(2))) == 2
