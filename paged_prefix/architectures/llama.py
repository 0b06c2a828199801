"""Llama and Mistral: mlx-lm's `llama` model file.

Llama windows the layers its config's `layer_types` marks "sliding_attention". A Mistral config
windows every layer by `sliding_window` when it is set (Mistral 7B v0.1: 4096), as Hugging
Face's Mistral does; mlx-lm's llama class, which Mistral loads as, would ignore it.
"""

from __future__ import annotations

import mlx.nn as nn
from mlx_lm.models import llama

from .base import (
    TIED_EMBEDDINGS,
    Architecture,
    LayerAttention,
    MustState,
    layer_type_windows,
    module_attention,
)


def _llama_attention(model: nn.Module) -> list[LayerAttention]:
    args = model.args
    return module_attention(model, layer_type_windows(args.layer_types, args.sliding_window,
                                                    args.model_type))


def _mistral_attention(model: nn.Module) -> list[LayerAttention]:
    args = model.args
    if set(args.layer_types) != {"full_attention"}:
        raise ValueError(f"layer_types: {sorted(set(args.layer_types))} in a mistral config; "
                         "Mistral windows every layer by sliding_window")
    # 0 means no window in some checkpoints (vLLM reads it so)
    return module_attention(model, [args.sliding_window or None] * len(model.layers))


def _check_llama(config: dict) -> None:
    layer_types = config.get("layer_types")
    if isinstance(layer_types, list) and "full_attention" not in layer_types:
        raise ValueError(f"layer_types: {layer_types} has no full_attention layer; mlx-lm's llama "
                         "class needs one")


ARCHITECTURES = (
    Architecture("llama", "LlamaForCausalLM", llama, _llama_attention, check_config=_check_llama,
                 must_state=(TIED_EMBEDDINGS,)),
    # a Mistral config states its window, null for full attention
    Architecture("mistral", "MistralForCausalLM", llama, _mistral_attention,
                 check_config=_check_llama,
                 must_state=(TIED_EMBEDDINGS,
                             MustState("sliding_window", hugging_face=4096, mlx_lm=None))),
)
