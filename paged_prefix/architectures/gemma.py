"""Gemma 2 and Gemma 3 (text): scaled embeddings, 1 + w RMSNorms and pre/post norms (the
decoder layers' own), query_pre_attn_scalar as the softmax scale.

Gemma 2 caps attention logits (`attn_logit_softcapping`) and final logits
(`final_logit_softcapping`) and, as Hugging Face's Gemma 2 runs it, windows alternate layers
(`layer_types`, by default sliding on even layers, `sliding_window` keys). mlx-lm's gemma2 class
has no window and its ModelArgs drop the config's: models are built with `Gemma2Args`, which
keeps them. Gemma 3 windows the layers its module marks `is_sliding` (all but every
`sliding_window_pattern`-th) and gives them their own RoPE base (the module's own `rope`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gemma2, gemma3_text

from .base import (
    Architecture,
    LayerAttention,
    MustState,
    layer_type_windows,
    module_attention,
)


@dataclass
class Gemma2Args(gemma2.ModelArgs):
    """mlx-lm's gemma2 args plus the window fields of Hugging Face's Gemma2Config."""

    sliding_window: int = 4096  # Gemma2Config's default
    layer_types: list[str] | None = None

    def __post_init__(self):
        if self.layer_types is None:  # Gemma2Config's default: sliding on even layers
            self.layer_types = ["full_attention" if i % 2 else "sliding_attention"
                                for i in range(self.num_hidden_layers)]


def _gemma2_attention(model: nn.Module) -> list[LayerAttention]:
    args = model.args
    if not isinstance(args, Gemma2Args):
        raise ValueError("sliding_window: mlx-lm's gemma2 ModelArgs drop the config's window; "
                         "build the model with paged_prefix (models.build_model, model_loader)")
    if len(args.layer_types) != len(model.layers):
        raise ValueError(f"layer_types: {len(args.layer_types)} entries for "
                         f"{len(model.layers)} layers")
    windows = layer_type_windows(args.layer_types, args.sliding_window, "gemma2")
    layers = module_attention(model, windows)
    caps = [layer.self_attn.attn_logit_softcapping for layer in model.layers]
    return [replace(a, softcap=cap) for a, cap in zip(layers, caps)]


def _gemma2_embedding(model: nn.Module, ids: mx.array) -> mx.array:
    return model.model.embed_tokens(ids) * (model.args.hidden_size**0.5)


def _gemma2_logits(model: nn.Module, hidden: mx.array) -> mx.array:
    cap = model.final_logit_softcapping
    return mx.tanh(model.model.embed_tokens.as_linear(hidden) / cap) * cap


def _gemma3_attention(model: nn.Module) -> list[LayerAttention]:
    window = model.args.sliding_window
    return module_attention(model, [window if layer.self_attn.is_sliding else None
                                  for layer in model.layers])


def _gemma3_embedding(model: nn.Module, ids: mx.array) -> mx.array:
    h = model.model.embed_tokens(ids)
    # the scale rounded to bfloat16 first, as mlx-lm's Gemma3Model multiplies
    return h * mx.array(model.args.hidden_size**0.5, mx.bfloat16).astype(h.dtype)


def _check_gemma2(config: dict) -> None:
    for field in ("attn_logit_softcapping", "final_logit_softcapping"):
        if field in config and config[field] is None:
            raise ValueError(f"{field}: null in a gemma2 config; mlx-lm's gemma2 class caps by "
                             "a number (Gemma 2 checkpoints: 50.0 and 30.0)")


def _check_gemma3(config: dict) -> None:
    for field in ("attn_logit_softcapping", "final_logit_softcapping"):
        if config.get(field) is not None:
            raise ValueError(f"{field}: {config[field]} in a gemma3_text config; mlx-lm's class "
                             "applies no cap")
    pattern = config.get("sliding_window_pattern", 6)  # mlx-lm's default, and HF's
    if "layer_types" in config:
        marked = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                  for i in range(config["num_hidden_layers"])]
        if config["layer_types"] != marked:
            raise ValueError(f"layer_types: {config['layer_types']} differ from what "
                             f"sliding_window_pattern {pattern} gives mlx-lm's class ({marked})")


ARCHITECTURES = (
    Architecture("gemma2", "Gemma2ForCausalLM", gemma2, _gemma2_attention, args=Gemma2Args,
                 check_config=_check_gemma2, embed=_gemma2_embedding, logits=_gemma2_logits,
                 must_state=(MustState("query_pre_attn_scalar", hugging_face=256,
                                       mlx_lm=144.0),)),
    Architecture("gemma3_text", "Gemma3ForCausalLM", gemma3_text, _gemma3_attention,
                 check_config=_check_gemma3, embed=_gemma3_embedding,
                 must_state=(MustState("sliding_window", hugging_face=4096, mlx_lm=512),)),
)
