"""The recurrent plan: segments, rounds and state rows, and every refusal before a layer runs."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import lfm2

from paged_prefix.models import BUILTIN_CONFIGS
from paged_prefix.recurrent import build_plan, causal_conv, gated_delta


def test_segments_run_in_rounds_of_one_length_and_states_come_back_by_sequence():
    # Lengths 7, 1, 12, 1: sequence 0 cut after 3 tokens, sequence 2 after 4 and 8.
    plan = build_plan([0, 7, 8, 20, 21], [[3], [], [4, 8], []], conv_kernel=4)
    assert plan.state_rows == ((0, 3), (0, 7), (1, 1), (2, 4), (2, 8), (2, 12), (3, 1))
    rounds = [[(b.length, b.seqs, np.array(b.rows).tolist()) for b in r] for r in plan.rounds]
    assert rounds == [
        [(1, (1, 3), [7, 20]), (3, (0,), [0, 1, 2]), (4, (2,), [8, 9, 10, 11])],
        [(4, (0, 2), [3, 4, 5, 6, 12, 13, 14, 15])],
        [(4, (2,), [16, 17, 18, 19])],
    ]
    produced = [r for batches in rounds for _, _, rows in batches for r in rows]
    assert np.array(plan.y_order)[produced].tolist() == list(range(21))


def test_conv_windows_start_with_each_sequences_state_rows():
    plan = build_plan([0, 2, 3], [[1], []], conv_kernel=3)
    # Extended rows: seq 0's 2 state rows (0, 1), its tokens (rows 4, 5 of concat(states, x)),
    # then seq 1's state rows (2, 3) and token (6).
    assert np.array(plan.conv_ext).tolist() == [0, 1, 4, 5, 2, 3, 6]
    assert np.array(plan.conv_out).tolist() == [0, 1, 4]
    # After 1 token of seq 0: its last state row and its first token; then the chunk ends.
    assert np.array(plan.conv_states).tolist() == [[1, 2], [2, 3], [5, 6]]


@pytest.mark.parametrize("cu, boundaries, kernel, field", [
    ([1, 3], [[]], 4, "cu_seqlens"),
    ([0], [], 4, "cu_seqlens"),
    ([0, 3, 3], [[], []], 4, "cu_seqlens"),
    ([0, 2.5], [[]], 4, "cu_seqlens"),
    ([0, 3], [[], []], 4, "boundaries"),
    ([0, 3], [[0]], 4, r"boundaries\[0\]"),
    ([0, 3], [[3]], 4, r"boundaries\[0\]"),
    ([0, 5], [[3, 2]], 4, r"boundaries\[0\]"),
    ([0, 5], [[2, 2]], 4, r"boundaries\[0\]"),
    ([0, 5], [[True]], 4, r"boundaries\[0\]"),
    ([0, 5], [[]], 1, "conv_kernel"),
])
def test_bad_plans_are_refused_naming_the_field(cu, boundaries, kernel, field):
    with pytest.raises(ValueError, match=field):
        build_plan(cu, boundaries, kernel)


def test_inputs_that_do_not_fit_the_plan_are_refused():
    mx.random.seed(0)
    layer = lfm2.Model(lfm2.ModelArgs.from_dict(BUILTIN_CONFIGS["lfm2-test"])).layers[0].conv
    plan = build_plan([0, 2, 5], [[], []], conv_kernel=3)
    x, state = mx.zeros((5, 256)), mx.zeros((2, 2, 256))
    with pytest.raises(ValueError, match="x: 4 rows"):
        causal_conv(layer.conv, x[:4], plan, state)
    with pytest.raises(ValueError, match="state: expected"):
        causal_conv(layer.conv, x, plan, state[:1])
    with pytest.raises(ValueError, match="state: dtype"):
        causal_conv(layer.conv, x, plan, state.astype(mx.float16))
    with pytest.raises(ValueError, match="kernel width 3 differs"):
        causal_conv(layer.conv, x, build_plan([0, 2, 5], [[], []], conv_kernel=4),
                    mx.zeros((2, 3, 256)))
    q, v, a = mx.zeros((5, 2, 32)), mx.zeros((5, 4, 32)), mx.zeros((5, 4))
    with pytest.raises(ValueError, match="state: expected shape"):
        gated_delta(q, q, v, a, a, mx.zeros(4), mx.zeros(4), plan, mx.zeros((2, 4, 32, 16)))
    with pytest.raises(ValueError, match="b: expected shape"):
        gated_delta(q, q, v, a, a[:, :2], mx.zeros(4), mx.zeros(4), plan,
                    mx.zeros((2, 4, 32, 32)))
