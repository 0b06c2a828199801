"""Packed recurrent layers against mlx-lm's own per-sequence path (the layer module and its
ArraysCache), float32: outputs and the states at every boundary within float32's tolerance.
Not bit for bit: a projection over all packed rows is a matmul of another height than one
sequence's, and OpenBLAS (as cuBLAS) rounds its rows differently then (~1e-7 relative); the
recurrent ops themselves are exact (tests/test_recurrent_ops.py)."""

from dataclasses import dataclass

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import lfm2, qwen3_next
from mlx_lm.models.cache import ArraysCache

from paged_prefix.models import BUILTIN_CONFIGS
from paged_prefix.recurrent import build_plan, gated_delta_net, short_conv
from paged_prefix.recurrent import lfm2 as lfm2_states
from paged_prefix.recurrent import qwen3_next as qwen3_next_states
from tests.conftest import assert_close


@dataclass(frozen=True)
class Kind:
    name: str
    module: object
    config: str

    def layer(self):
        mx.random.seed(0)
        model = self.module.Model(self.module.ModelArgs.from_dict(BUILTIN_CONFIGS[self.config]))
        mx.eval(model.parameters())
        if self.name == "gdn":
            return model.layers[0].linear_attn
        return model.layers[0].conv

    def shapes(self, layer):
        return (qwen3_next_states if self.name == "gdn" else lfm2_states).state_shapes(layer)

    def packed(self, layer, x, plan, states):
        if self.name == "gdn":
            out, conv, ssm = gated_delta_net(layer, x, plan, *states)
            return out, (conv, ssm)
        out, conv = short_conv(layer, x, plan, *states)
        return out, (conv,)


KINDS = [Kind("gdn", qwen3_next, "qwen3-next-test"), Kind("short_conv", lfm2, "lfm2-test")]


def reference(layer, x, lens, boundaries, states, fresh):
    """mlx-lm, one sequence at a time: a chunk per segment through one ArraysCache."""
    cu = np.cumsum([0, *lens])
    outs, kept = [], []
    for s, n in enumerate(lens):
        cache = ArraysCache(size=len(states))
        if not fresh[s]:  # a fresh sequence leaves mlx-lm to make its own zero state
            for i, state in enumerate(states):
                cache[i] = state[s:s + 1]
        start = 0
        for end in [*boundaries[s], n]:
            outs.append(layer(x[None, cu[s] + start:cu[s] + end], None, cache)[0])
            kept.append([cache[i][0] for i in range(len(states))])
            start = end
    return mx.concatenate(outs), [mx.stack(k) for k in zip(*kept)]


CASES = {
    "fresh prompts of odd lengths": ([5, 17, 2, 9], [[], [], [], []], "fresh"),
    "from stored states": ([5, 17, 2, 9], [[], [], [], []], "stored"),
    "boundaries mid-chunk": ([37, 6, 20], [[8, 16, 24, 32], [1, 5], [3]], "stored"),
    "decode rows": ([1, 1, 1, 1, 1], [[]] * 5, "stored"),
    "prefills, decode rows and fresh ones mixed": (
        [1, 12, 1, 30, 3], [[], [2, 10], [], [16], []], "mixed"),
}


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_packed_layer_is_mlx_lm_sequence_by_sequence(kind, case):
    lens, boundaries, start = CASES[case]
    layer = kind.layer()
    hidden = layer.out_proj.weight.shape[0]
    fresh = [start == "fresh" or (start == "mixed" and s % 2 == 0) for s in range(len(lens))]
    mx.random.seed(1)
    x = mx.random.normal((sum(lens), hidden))
    states = []
    for shape in kind.shapes(layer):
        stored = mx.random.normal((len(lens), *shape)) * 0.5
        is_fresh = mx.array(fresh).reshape(len(lens), *[1] * len(shape))
        states.append(mx.where(is_fresh, mx.zeros_like(stored), stored))
    plan = build_plan(np.cumsum([0, *lens]), boundaries, kind.shapes(layer)[0][0] + 1)
    out, got = kind.packed(layer, x, plan, states)
    ref_out, ref_states = reference(layer, x, lens, boundaries, states, fresh)
    assert_close(out, ref_out, mx.float32, "outputs")
    assert len(got) == len(ref_states)
    for i, (g, r) in enumerate(zip(got, ref_states)):
        assert g.dtype == r.dtype, f"state {i}: dtype {g.dtype} != {r.dtype}"
        assert_close(g, np.array(r), mx.float32, f"state {i}")


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_states_carry_the_history(kind):
    """A stored state changes what follows (the comparison above would not notice a layer that
    ignored both its state and mlx-lm's): zeros and a stored state give different rows."""
    layer = kind.layer()
    x = mx.random.normal((4, layer.out_proj.weight.shape[0]))
    plan = build_plan([0, 4], [[]], kind.shapes(layer)[0][0] + 1)
    zero = [mx.zeros((1, *s)) for s in kind.shapes(layer)]
    stored = [mx.random.normal((1, *s)) for s in kind.shapes(layer)]
    out_zero, _ = kind.packed(layer, x, plan, zero)
    out_stored, _ = kind.packed(layer, x, plan, stored)
    # The conv reaches K-1 rows back: only the first rows see a stored conv state.
    assert not mx.allclose(out_zero[0], out_stored[0])
