"""The architectures the paged runner serves, by mlx-lm model type (one module per family).

    check_config(config)   # a config.json's dict, before any weight is read
    model_classes(config)  # (Model, ModelArgs) for mlx-lm's loader and models.build_model
    architecture, layers = check_model(model)   # a built model: each layer's attention
                                                # (None on a hybrid model's recurrent layers)

Each refusal is a ValueError naming the config field or feature the runner cannot reproduce.
"""

from __future__ import annotations

from dataclasses import fields

import mlx.nn as nn

from . import gemma, gpt_oss, lfm2, llama, mixtral, qwen, qwen3_next
from .base import ARRAY_OFFSET_ROPES, Architecture, LayerAttention

ARCHITECTURES: dict[str, Architecture] = {
    a.model_type: a for family in (llama, qwen, gemma, gpt_oss, mixtral, qwen3_next, lfm2)
    for a in family.ARCHITECTURES}
MODEL_TYPES = tuple(ARCHITECTURES)


def architecture(model_type: str | None) -> Architecture:
    if model_type not in ARCHITECTURES:
        raise ValueError(f"model_type: {model_type!r} is not one of {MODEL_TYPES}")
    return ARCHITECTURES[model_type]


def check_config(config: dict) -> Architecture:
    """The config's architecture; refuses what its model class would drop or get wrong."""
    arch = architecture(config.get("model_type"))
    args = {f.name for f in fields(arch.model_args)}
    if "rope_parameters" in config and "rope_theta" not in config and \
            "rope_parameters" not in args:
        raise ValueError(f"rope_parameters: mlx-lm's {arch.model_type} class reads rope_theta "
                         "and rope_scaling, which this config does not give")
    arch.check_config(config)
    return arch


def model_classes(config: dict) -> tuple[type, type]:
    """mlx-lm's `get_model_classes`: its Model class with the args class that keeps what the
    attention depends on."""
    arch = check_config(config)
    return arch.module.Model, arch.model_args


def check_model(model: nn.Module) -> tuple[Architecture, list[LayerAttention | None]]:
    """The model's architecture and each layer's attention (None where a hybrid model's layer is
    recurrent: `Architecture.recurrent`); ValueError naming what the runner cannot reproduce (a
    RoPE class that cannot take per-row positions among them)."""
    arch = architecture(getattr(model.args, "model_type", None))
    if not isinstance(model, arch.module.Model):
        raise ValueError(f"model: a {type(model).__module__}.{type(model).__name__} for "
                         f"model_type {arch.model_type!r} (expected {arch.module.__name__}.Model)")
    layers = arch.attention(model)
    recurrent = arch.recurrent(model)
    for i, (layer, spec, rec) in enumerate(zip(model.layers, layers, recurrent, strict=True)):
        if (spec is None) == (rec is None):
            raise ValueError(f"model: layer {i} must be either attention or recurrent")
        if spec is None:
            continue
        rope = layer.self_attn.rope
        if type(rope) not in ARRAY_OFFSET_ROPES:
            raise ValueError(f"rope: layer {i}'s {type(rope).__name__} cannot take per-token "
                             "positions")
    return arch, layers
