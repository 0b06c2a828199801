"""Qwen3-Next: gated delta net layers, gated full attention on every `full_attention_interval`-th
layer, and mlx-lm's MoE (SwitchGLU experts beside a gated shared expert).

Its attention (mlx-lm's `Qwen3NextAttention`) projects each head's queries and an output gate
with one `q_proj` (the gate multiplies the attention's output by its sigmoid before `o_proj`),
norms q and k per head and rotates only the first `partial_rotary_factor` of each head's dims
(its own `rope`). The gated delta net layers keep (conv, recurrent) state per sequence.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen3_next

from ..recurrent import qwen3_next as gated_delta_states
from ..recurrent_layers import PagedGatedDeltaNet
from .base import Architecture, LayerAttention, MustState, RecurrentLayer


def _attention(model: nn.Module) -> list[LayerAttention | None]:
    out = []
    for layer in model.layers:
        attn = layer.get("self_attn")
        out.append(None if layer.is_linear else LayerAttention(
            attn.num_attention_heads, attn.num_key_value_heads, attn.head_dim, float(attn.scale),
            output_gate=True))
    return out


def _recurrent(model: nn.Module) -> list[RecurrentLayer | None]:
    out = []
    for layer in model.layers:
        if not layer.is_linear:
            out.append(None)
            continue
        net = layer.linear_attn
        # the conv state in the layer's dtype, the recurrent state in float32, as mlx-lm keeps
        out.append(RecurrentLayer("linear_attn", PagedGatedDeltaNet,
                                  gated_delta_states.state_shapes(net),
                                  (net.conv1d.weight.dtype, mx.float32), "GDN_ATTN"))
    return out


def _check_config(config: dict) -> None:
    """mlx-lm's class places full attention by `full_attention_interval` alone."""
    interval = config.get("full_attention_interval", 4)
    if "layer_types" in config:
        placed = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                  for i in range(config["num_hidden_layers"])]
        if config["layer_types"] != placed:
            raise ValueError(f"layer_types: {config['layer_types']} differ from what "
                             f"full_attention_interval {interval} gives mlx-lm's class "
                             f"({placed})")


ARCHITECTURES = (Architecture("qwen3_next", "Qwen3NextForCausalLM", qwen3_next, _attention,
                              check_config=_check_config, recurrent=_recurrent,
                              must_state=(MustState("norm_topk_prob", hugging_face=True,
                                                    mlx_lm=False),)),)
