"""LFM2: short conv layers and full attention on the layers `layer_types` marks (mlx-lm's
`full_attn_idxs`), tied embeddings, and a final `embedding_norm`.

Its attention (mlx-lm's `lfm2.Attention`) norms q and k per head (`q_layernorm`,
`k_layernorm`) and projects out through `out_proj`; head_dim is hidden_size / heads. The short
conv layers keep a conv state per sequence over their `hidden_size` channels, which vLLM sizes by
the config's `conv_dim`: the two must agree.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import lfm2

from ..recurrent import lfm2 as short_conv_states
from ..recurrent_layers import PagedShortConv
from .base import Architecture, LayerAttention, RecurrentLayer


def _attention(model: nn.Module) -> list[LayerAttention | None]:
    out = []
    for layer in model.layers:
        attn = layer.get("self_attn")
        out.append(LayerAttention(attn.n_heads, attn.n_kv_heads, attn.head_dim,
                                  float(attn.scale)) if layer.is_attention_layer else None)
    return out


def _recurrent(model: nn.Module) -> list[RecurrentLayer | None]:
    return [None if layer.is_attention_layer else RecurrentLayer(
        "conv", PagedShortConv, short_conv_states.state_shapes(layer.conv),
        (layer.conv.conv.weight.dtype,), "SHORT_CONV") for layer in model.layers]


def _embedding_norm(model: nn.Module, hidden: mx.array) -> mx.array:
    return model.model.embedding_norm(hidden)


def _check_config(config: dict) -> None:
    conv_dim = config.get("conv_dim", config["hidden_size"])
    if conv_dim != config["hidden_size"]:
        raise ValueError(f"conv_dim: {conv_dim}, but mlx-lm's short conv runs over hidden_size "
                         f"{config['hidden_size']} channels (and vLLM sizes its state by "
                         "conv_dim)")
    if not config.get("layer_types") and not config.get("full_attn_idxs"):
        raise ValueError("layer_types: an lfm2 config must place its attention layers "
                         "(layer_types or full_attn_idxs)")


ARCHITECTURES = (Architecture("lfm2", "Lfm2ForCausalLM", lfm2, _attention,
                              check_config=_check_config, recurrent=_recurrent,
                              norm=_embedding_norm),)
