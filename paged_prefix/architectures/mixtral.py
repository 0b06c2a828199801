"""Mixtral: mlx-lm's SwitchGLU experts behind Mistral's attention. A config's `sliding_window`
windows every layer, as Hugging Face's Mixtral does (Mixtral 8x7B's is null); mlx-lm's
ModelArgs drop it, so models are built with `MixtralArgs`, which keeps it."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.nn as nn
from mlx_lm.models import mixtral

from .base import Architecture, LayerAttention, module_attention


@dataclass
class MixtralArgs(mixtral.ModelArgs):
    sliding_window: int | None = None  # MixtralConfig's default


def _attention(model: nn.Module) -> list[LayerAttention]:
    if not isinstance(model.args, MixtralArgs):
        raise ValueError("sliding_window: mlx-lm's mixtral ModelArgs drop the config's window; "
                         "build the model with paged_prefix (models.build_model, model_loader)")
    window = model.args.sliding_window or None  # 0: no window, as vLLM reads it
    return module_attention(model, [window] * len(model.layers),
                          ("num_heads", "num_key_value_heads"))


ARCHITECTURES = (Architecture("mixtral", "MixtralForCausalLM", mixtral, _attention,
                              args=MixtralArgs),)
