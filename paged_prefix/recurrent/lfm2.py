"""LFM2's short conv layer on the packed rows of a batch.

The same steps as `mlx_lm.models.lfm2.ShortConv.__call__` on one sequence, with the layer's
own projections and conv; the conv runs varlen over the plan. Its state is the last K-1 gated
inputs B * x, [K-1, hidden] in the layer's dtype: vLLM's short conv state, (state_len, dim).
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.lfm2 import ShortConv

from .conv import causal_conv
from .plan import RecurrentPlan


def state_shapes(layer: ShortConv) -> tuple[tuple[int, int]]:
    """(conv,) state shape of one sequence."""
    return ((layer.L_cache - 1, layer.args.hidden_size),)


def short_conv(layer: ShortConv, x: mx.array, plan: RecurrentPlan,
               conv_state: mx.array) -> tuple[mx.array, mx.array]:
    """Shapes: x [T, hidden]; conv_state [S, K-1, hidden].

    Returns (out [T, hidden], conv_states [N, K-1, hidden]) with the states at the plan's
    state rows."""
    B, C, h = mx.split(layer.in_proj(x), 3, axis=-1)  # each [T, hidden]
    conv_out, conv_states = causal_conv(layer.conv, B * h, plan, conv_state)
    return layer.out_proj(C * conv_out), conv_states
