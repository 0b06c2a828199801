"""The varlen conv and gated delta rule against mlx-lm's per-sequence formulation on the same
inputs, segment by segment with the state carried: bit for bit on the CPU (float32), since
each sequence runs the same ops in the same order whether it shares its batch or not. On a GPU
backend a kernel may reduce in another order for another batch shape (not measured there), so
there they are held to float32's tolerance instead."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import lfm2
from mlx_lm.models.gated_delta import gated_delta_update, normalize_qk

from paged_prefix.models import BUILTIN_CONFIGS
from paged_prefix.recurrent import build_plan, causal_conv, gated_delta
from tests.conftest import ON_GPU, assert_close

LAYOUTS = {
    "fresh and stored, odd lengths": ([5, 17, 2, 9], [[], [], [], []]),
    "boundaries mid-chunk, one before K-1 tokens": ([37, 6, 20], [[8, 16, 24, 32], [1, 5], [3]]),
    "decode rows": ([1] * 6, [[]] * 6),
    "mixed": ([1, 12, 1, 30, 3], [[], [2, 10], [], [16], []]),
}


def assert_same(got: mx.array, ref: mx.array, what: str) -> None:
    if ON_GPU:
        assert_close(got, np.array(ref), mx.float32, what)
    else:
        assert got.dtype == ref.dtype and mx.array_equal(got, ref), \
            f"{what}: differs by up to {mx.abs(got - ref).max().item()}"


def segments(lens, boundaries):
    """(sequence, first packed row, first token, end token) of every segment, in order."""
    first = np.cumsum([0, *lens])
    for s, n in enumerate(lens):
        start = 0
        for end in [*boundaries[s], n]:
            yield s, int(first[s]), start, end
            start = end


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
def test_causal_conv_is_mlx_lms_concat_then_conv(layout):
    lens, boundaries = LAYOUTS[layout]
    mx.random.seed(0)
    conv = lfm2.Model(lfm2.ModelArgs.from_dict(BUILTIN_CONFIGS["lfm2-test"])).layers[0].conv.conv
    k, channels = conv.weight.shape[1], conv.weight.shape[0]
    x = mx.random.normal((sum(lens), channels))
    state = mx.random.normal((len(lens), k - 1, channels))
    y, states = causal_conv(conv, x, build_plan(np.cumsum([0, *lens]), boundaries, k), state)
    ref_y, ref_states, carried = [], [], {}
    for s, first, start, end in segments(lens, boundaries):
        conv_input = mx.concatenate([carried.get(s, state[s:s + 1]),
                                     x[None, first + start:first + end]], axis=1)
        ref_y.append(conv(conv_input)[0])
        carried[s] = conv_input[:, -(k - 1):]  # what mlx-lm keeps as the next conv state
        ref_states.append(carried[s][0])
    assert_same(y, mx.concatenate(ref_y), "y")
    assert_same(states, mx.stack(ref_states), "states")


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
def test_gated_delta_is_mlx_lms_update_per_sequence(layout):
    lens, boundaries = LAYOUTS[layout]
    num_rows, hk, hv, dk, dv = sum(lens), 2, 4, 32, 16
    mx.random.seed(1)
    q, k = normalize_qk(mx.random.normal((num_rows, hk, dk)), mx.random.normal((num_rows, hk, dk)),
                        inv_scale=dk**-0.5, eps=1e-6)
    v = mx.random.normal((num_rows, hv, dv))
    a, b = mx.random.normal((num_rows, hv)), mx.random.normal((num_rows, hv))
    A_log, dt_bias = mx.log(mx.random.uniform(1, 16, (hv,))), mx.random.normal((hv,))
    # Every other sequence fresh (zeros), the rest from a stored state.
    stored = mx.random.normal((len(lens), hv, dv, dk)) * 0.3
    state = stored * (mx.arange(len(lens)) % 2).reshape(-1, 1, 1, 1).astype(mx.float32)
    y, states = gated_delta(q, k, v, a, b, A_log, dt_bias,
                            build_plan(np.cumsum([0, *lens]), boundaries, 4), state)
    ref_y, ref_states, carried = [], [], {}
    for s, first, start, end in segments(lens, boundaries):
        rows = slice(first + start, first + end)
        out, carried[s] = gated_delta_update(q[None, rows], k[None, rows], v[None, rows],
                                             a[None, rows], b[None, rows], A_log, dt_bias,
                                             carried.get(s, state[s:s + 1]))
        ref_y.append(out[0])
        ref_states.append(carried[s][0])
    assert_same(y, mx.concatenate(ref_y), "y")
    assert states.dtype == mx.float32
    assert_same(states, mx.stack(ref_states), "states")


def test_a_later_round_leaves_the_callers_state_alone():
    """Rounds after the first update the running states by item assignment: on a copy."""
    hv = 4
    state = mx.ones((1, hv, 8, 32))
    before = np.array(state)
    q = mx.random.normal((6, 2, 32))
    gated_delta(q, q, mx.random.normal((6, hv, 8)), mx.zeros((6, hv)), mx.zeros((6, hv)),
                mx.zeros(hv), mx.zeros(hv), build_plan([0, 6], [[3]], 4), state)
    assert np.array_equal(np.array(state), before)
