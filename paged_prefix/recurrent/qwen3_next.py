"""Qwen3-Next's gated delta net layer on the packed rows of a batch.

The same steps as `mlx_lm.models.qwen3_next.Qwen3NextGatedDeltaNet.__call__` on one
sequence, with the layer's own projections, conv, norm and weights; the conv and the
recurrence run varlen over the plan. Its state is (conv [K-1, conv_dim] in the layer's dtype,
recurrent [Hv, Dv, Dk] in float32), in the order and layout of vLLM's gated delta net state.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.gated_delta import normalize_qk
from mlx_lm.models.qwen3_next import Qwen3NextGatedDeltaNet

from .conv import causal_conv
from .gated_delta import gated_delta
from .plan import RecurrentPlan


def state_shapes(layer: Qwen3NextGatedDeltaNet) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """(conv, recurrent) state shapes of one sequence: vLLM's (state_len, dim) conv layout."""
    return ((layer.conv_kernel_size - 1, layer.conv_dim),
            (layer.num_v_heads, layer.head_v_dim, layer.head_k_dim))


def gated_delta_net(layer: Qwen3NextGatedDeltaNet, x: mx.array, plan: RecurrentPlan,
                    conv_state: mx.array, ssm_state: mx.array
                    ) -> tuple[mx.array, mx.array, mx.array]:
    """Shapes: x [T, hidden]; conv_state [S, K-1, conv_dim]; ssm_state [S, Hv, Dv, Dk].

    Returns (out [T, hidden], conv_states [N, K-1, conv_dim], ssm_states [N, Hv, Dv, Dk]) with
    the states at the plan's state rows."""
    num_rows = x.shape[0]
    q, k, v, z, b, a = layer.fix_query_key_value_ordering(
        layer.in_proj_qkvz(x[None]), layer.in_proj_ba(x[None]))  # each [1, T, heads, ...]
    mixed = mx.concatenate([q.reshape(num_rows, -1), k.reshape(num_rows, -1),
                            v.reshape(num_rows, -1)], axis=-1)  # [T, conv_dim]
    conv_out, conv_states = causal_conv(layer.conv1d, mixed, plan, conv_state)
    conv_out = nn.silu(conv_out)
    q, k, v = [t.reshape(num_rows, h, d) for t, h, d in zip(
        mx.split(conv_out, [layer.key_dim, 2 * layer.key_dim], -1),
        [layer.num_k_heads, layer.num_k_heads, layer.num_v_heads],
        [layer.head_k_dim, layer.head_k_dim, layer.head_v_dim])]
    q, k = normalize_qk(q, k, inv_scale=layer.head_k_dim**-0.5, eps=1e-6)
    out, ssm_states = gated_delta(q, k, v, a[0], b[0], layer.A_log, layer.dt_bias, plan,
                                  ssm_state, use_kernel=not layer.training)
    out = layer.norm(out, z[0])  # [T, Hv, Dv]
    return layer.out_proj(out.reshape(num_rows, -1)), conv_states, ssm_states
