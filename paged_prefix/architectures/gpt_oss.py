"""GPT-OSS: attention sinks (the module's `sinks`, one logit per head), biased projections,
YaRN RoPE, alternating sliding/full layers, and mlx-lm's SwitchGLU experts."""

from __future__ import annotations

from dataclasses import replace

import mlx.nn as nn
from mlx_lm.models import gpt_oss

from .base import Architecture, LayerAttention, layer_type_windows, module_attention


def _attention(model: nn.Module) -> list[LayerAttention]:
    layer_types = model.model.layer_types
    if len(layer_types) != len(model.layers):
        raise ValueError(f"layer_types: {len(layer_types)} entries for {len(model.layers)} "
                         "layers")
    windows = layer_type_windows(layer_types, model.args.sliding_window, "gpt_oss")
    layers = module_attention(model, windows, ("num_attention_heads", "num_key_value_heads"),
                            "sm_scale")
    return [replace(a, sinks=True) for a in layers]


def _check_config(config: dict) -> None:
    layer_types = config.get("layer_types")
    if isinstance(layer_types, list) and \
            not {"sliding_attention", "full_attention"} <= set(layer_types):
        raise ValueError(f"layer_types: {layer_types} lacks a sliding_attention or a "
                         "full_attention layer; mlx-lm's gpt_oss class needs both")


ARCHITECTURES = (Architecture("gpt_oss", "GptOssForCausalLM", gpt_oss, _attention,
                              check_config=_check_config),)
