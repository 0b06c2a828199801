"""The recurrent state cache and its per-forward rows: a layer run over several forwards through
vLLM-style block rows equals mlx-lm's module run sequence by sequence through its ArraysCache
(outputs and the state in every written block); writes land in place; fresh sequences never
read their block; every bad row is refused, naming the field, before anything is written."""

import math
import re

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import lfm2, qwen3_next
from mlx_lm.models.cache import ArraysCache

from paged_prefix.attention import ForwardContext
from paged_prefix.models import BUILTIN_CONFIGS
from paged_prefix.recurrent import lfm2 as lfm2_states
from paged_prefix.recurrent import qwen3_next as qwen3_next_states
from paged_prefix.recurrent_layers import ForwardStates, PagedGatedDeltaNet, PagedShortConv
from paged_prefix.state_cache import RecurrentStateCache, StateSpec
from paged_prefix.state_metadata import (
    StateRequest,
    build_state_metadata,
    commit,
    current_state_blocks,
)
from tests.conftest import assert_close

B = 4  # tokens per state block


def layer_of(kind: str):
    mx.random.seed(0)
    if kind == "gdn":
        model = qwen3_next.Model(qwen3_next.ModelArgs.from_dict(BUILTIN_CONFIGS["qwen3-next-test"]))
        layer = model.layers[0].linear_attn
        shapes = qwen3_next_states.state_shapes(layer)
        return layer, PagedGatedDeltaNet(layer, 0), shapes, (mx.float32, mx.float32)
    model = lfm2.Model(lfm2.ModelArgs.from_dict(BUILTIN_CONFIGS["lfm2-test"]))
    layer = model.layers[0].conv
    return layer, PagedShortConv(layer, 0), lfm2_states.state_shapes(layer), (mx.float32,)


def context(states: ForwardStates) -> ForwardContext:
    return ForwardContext(None, None, None, (), frozenset(), states=states)


class Harness:
    """One layer, a 12-block state cache, and the runner's ledger; `forward` runs a step."""

    def __init__(self, kind: str, num_blocks: int = 12):
        self.ref_layer, self.layer, shapes, dtypes = layer_of(kind)
        self.spec = StateSpec(shapes, dtypes, dtypes, group=0)
        self.cache = RecurrentStateCache([self.spec], num_blocks)
        self.ledger = {}
        self.hidden = self.ref_layer.out_proj.weight.shape[0]

    def meta(self, steps, held=None):
        reqs = [StateRequest(r, c, n, [row], prompt, ()) for r, c, n, row, prompt in steps]
        return build_state_metadata(reqs, 1, B, self.cache.num_blocks,
                                    self.spec.shapes[0][0] + 1, self.ledger, held or {})

    def forward(self, steps, x):
        meta = self.meta(steps)
        out = self.layer(x, None, context(ForwardStates.read(self.cache, meta)))
        mx.eval(out, self.cache.arrays())
        commit(self.ledger, meta)
        return out, meta


def reference(layer, x_of_seq, cuts):
    """mlx-lm's module on one sequence, chunk by chunk through one ArraysCache: each chunk's
    outputs and the state after it."""
    size = 2 if isinstance(layer, qwen3_next.Qwen3NextGatedDeltaNet) else 1
    cache = ArraysCache(size=size)
    outs, states = [], []
    for a, b in zip(cuts, cuts[1:]):
        outs.append(layer(x_of_seq[None, a:b], None, cache)[0])
        states.append([cache[i][0] for i in range(size)])
    return outs, states


@pytest.mark.parametrize("kind", ["gdn", "short_conv"])
def test_forwards_through_block_rows_are_mlx_lm_per_sequence(kind):
    """Request a: 10 prompt tokens in chunks of 4, 4, 2 (its state rows as vLLM builds them:
    a real block only at each chunk's end), then a decode row; request b, admitted in the second
    forward, hits a's state after 4 tokens (block 1 of a's row) and shares a's first 4 tokens,
    then prefills 3 more with a decode row of a in the same forward."""
    h = Harness(kind)
    mx.random.seed(1)
    xa = mx.random.normal((11, h.hidden))
    xb = mx.concatenate([xa[:4], mx.random.normal((3, h.hidden))])
    pa, pb = tuple(range(10)), tuple(range(4)) + (50, 51, 52)
    row_a = [1, 2, 3, 4]  # 11 tokens: blocks at indices 0 .. 2 (+ index 2 again for decode)
    row_b = [1, 5]  # the hit block first
    got_a, got_b = [], []
    out, _ = h.forward([("a", 0, 4, row_a, pa)], xa[:4])
    got_a.append(out)
    out, meta = h.forward([("a", 4, 4, row_a, pa), ("b", 4, 3, row_b, pb)],
                          mx.concatenate([xa[4:8], xb[4:7]]))
    assert meta.groups[0].src_host.tolist() == [1, 1] and meta.groups[0].dst_host.tolist() == \
        [2, 5]
    got_a.append(out[:4])
    got_b.append(out[4:])
    out, _ = h.forward([("a", 8, 2, row_a, pa)], xa[8:10])
    got_a.append(out)
    out, meta = h.forward([("a", 10, 1, row_a, pa)], xa[10:11])
    assert meta.groups[0].src_host.tolist() == meta.groups[0].dst_host.tolist() == [3]  # in place
    got_a.append(out)
    ref_a, states_a = reference(h.ref_layer, xa, [0, 4, 8, 10, 11])
    ref_b, states_b = reference(h.ref_layer, xb, [0, 4, 7])
    for got, ref in zip(got_a + got_b, ref_a + ref_b[1:]):
        assert_close(got, ref, mx.float32, "outputs")
    # what the blocks hold: a's state after 4 (block 1), 8 (block 2) and 11 tokens (block 3,
    # the decode step's in-place write over its 10), b's after 7 (block 5)
    for block, ref in ((1, states_a[0]), (2, states_a[1]), (3, states_a[3]), (5, states_b[1])):
        for stored, want in zip(h.cache.blocks(0), ref):
            assert_close(stored[block], np.array(want), mx.float32, f"block {block}")
    assert h.ledger[(0, 3)].tokens == 11 and h.ledger[(0, 5)].req_id == "b"


@pytest.mark.parametrize("kind", ["gdn", "short_conv"])
def test_a_fresh_sequence_never_reads_its_blocks_bytes(kind):
    h = Harness(kind)
    h.cache.restore([[mx.full(a.shape, mx.nan, a.dtype) for a in h.cache.blocks(0)]])
    x = mx.random.normal((5, h.hidden))
    out, _ = h.forward([("a", 0, 5, [0, 7], tuple(range(5)))], x)
    ref, _ = reference(h.ref_layer, x, [0, 5])
    assert_close(out, ref[0], mx.float32, "outputs")


def test_write_is_in_place_not_a_cache_copy():
    """One decode step's peak memory grows by about its states, never by the state arrays."""
    h = Harness("gdn", num_blocks=2048)  # 2048 x 19 KiB = 38 MiB of state
    per_array = [a.nbytes for a in h.cache.blocks(0)]
    x = mx.random.normal((1, h.hidden))
    h.forward([("a", 0, 1, [1], (0,))], x)
    growth = []
    for step in range(1, 4):
        mx.synchronize()
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        h.forward([("a", step, 1, [1], tuple(range(step + 1)))], x)
        growth.append(mx.get_peak_memory() - base)
    assert max(growth) < min(per_array) // 4, (
        f"a decode step grew peak memory by {max(growth)} bytes; the arrays are {per_array}")


def test_restore_drops_pending_writes():
    h = Harness("short_conv")
    snapshot = h.cache.snapshot()
    meta = h.meta([("a", 0, 3, [2], (0, 1, 2))])
    h.cache.write(0, meta, (mx.ones((1, *h.spec.shapes[0])),))
    h.cache.restore(snapshot)
    assert not np.array(h.cache.blocks(0)[0]).any()


def test_state_bytes_and_compute_dtypes():
    spec = StateSpec(((3, 256), (4, 32, 32)), (mx.bfloat16, mx.float32),
                     (mx.float32, mx.float32), group=0)
    assert spec.nbytes == 3 * 256 * 2 + math.prod((4, 32, 32)) * 4
    cache = RecurrentStateCache([spec], 3)
    meta = build_state_metadata([StateRequest("a", 0, 1, [[1]], (0,), ())], 1, 1, 3, 4, {}, {})
    starts = cache.read(meta)[0]
    assert [s.dtype for s in starts] == [mx.float32, mx.float32]
    cache.write(0, meta, [mx.ones((1, 3, 256)), mx.ones((1, 4, 32, 32))])
    assert [a.dtype for a in cache.blocks(0)] == [mx.bfloat16, mx.float32]


def ledger_after(h, steps):
    h.ledger.clear()
    commit(h.ledger, h.meta(steps))
    return h


REFUSED = {
    # (steps, held, field, words): each a ValueError before anything is written
    "row too short": ([("a", 0, 9, [1, 2], (0,) * 9)], {}, "state_block_ids[group 0] ('a')",
                      "index 2"),
    "null destination": ([("a", 0, 8, [1, 0], (0,) * 8)], {}, "state_block_ids", "null block"),
    "resumed without its state": ([("a", 4, 1, [6, 2], (0,) * 5)], {}, "num_computed_tokens",
                                  "no state this runner wrote"),
    "null source": ([("a", 4, 4, [0, 2], (0,) * 8)], {}, "num_computed_tokens", "null block"),
    "two writers": ([("a", 0, 4, [3], (0,) * 4), ("b", 0, 2, [3], (1,) * 2)], {},
                    "state_block_ids[group 0]", "both write state block 3"),
    "a live request's state": ([("a", 0, 4, [3], (0,) * 4)], {(0, 3): "z"}, "state_block_ids",
                               "running request 'z'"),
}


@pytest.mark.parametrize("case", REFUSED, ids=list(REFUSED))
def test_bad_rows_are_refused_naming_the_field(case):
    steps, held, field, words = REFUSED[case]
    h = Harness("short_conv")
    with pytest.raises(ValueError, match=r"^" + re.escape(field)) as e:
        h.meta(steps, held)
    assert words in str(e.value)


def test_a_source_must_hold_this_prefix_after_exactly_c_tokens():
    h = ledger_after(Harness("short_conv"), [("w", 0, 4, [1], (0, 1, 2, 3))])
    assert h.meta([("r", 4, 2, [1, 2], (0, 1, 2, 3, 9, 9))])  # the same 4 tokens: a hit
    for steps, words in (
            ([("r", 4, 2, [1, 2], (0, 1, 2, 7, 9, 9))], "the state after 4 tokens of 'w'"),
            ([("r", 3, 2, [1, 2], (0, 1, 2, 3, 9))], "the state after 4 tokens of 'w'"),
            # read by one sequence while another writes it
            ([("w", 4, 1, [1, 2], (0, 1, 2, 3, 5)), ("x", 0, 4, [1], (5, 6, 7, 8))],
             "reads state block 1, which 'x' writes in this forward")):
        with pytest.raises(ValueError, match=re.escape(words)):
            h.meta(steps)


def test_current_state_blocks_follow_the_row():
    rows = [[0, 4, 0, 9], [0, 5, 0, 8]]
    assert current_state_blocks(0, rows, B) == []
    assert current_state_blocks(8, rows, B) == [(0, 4), (1, 5)]
    assert current_state_blocks(13, rows, B) == [(0, 9), (1, 8)]


def test_the_layers_run_only_with_states():
    _, layer, _, _ = layer_of("gdn")
    with pytest.raises(ValueError, match="^cache: PagedGatedDeltaNet"):
        layer(mx.zeros((1, 128)), None, None)
