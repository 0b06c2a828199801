"""The architectures the paged runner serves, by mlx-lm model type (one module per family).

    check_config(config)   # a config.json's dict, before any weight is read
    model_classes(config)  # (Model, ModelArgs) for mlx-lm's loader and models.build_model
    architecture, layers = check_model(model)   # a built model: each layer's attention
                                                # (None on a hybrid model's recurrent layers)
    check_built(config, model)   # the loader's: check_model, and that the model applies the
                                 # config's RoPE scaling (before any weight is read)

Each refusal is a ValueError naming the config field or feature the runner cannot reproduce.
"""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, fields

import mlx.nn as nn
from mlx_lm.models.rope_utils import (
    DynamicNTKScalingRoPE,
    Llama3RoPE,
    ProportionalRoPE,
    SuScaledRoPE,
    YarnRoPE,
)

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
    required = [f.name for f in fields(arch.model_args) if f.init and f.name not in config
                and f.default is MISSING and f.default_factory is MISSING]
    if required:
        raise ValueError(f"{required[0]}: missing; mlx-lm's {arch.model_type} class requires "
                         f"{', '.join(required)}")
    for stated in arch.must_state:
        if stated.field not in config:
            raise ValueError(f"{stated.field}: a {arch.model_type} config must state it: Hugging "
                             f"Face reads a missing one as {json.dumps(stated.hugging_face)}, "
                             f"mlx-lm's class as {json.dumps(stated.mlx_lm)}")
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


# The RoPE class mlx-lm's `initialize_rope` builds for each scaling type ("mrope": multimodal
# sections, text positions rotate as by default)
_SCALED_ROPES = {"linear": nn.RoPE, "dynamic": DynamicNTKScalingRoPE, "llama3": Llama3RoPE,
                 "yarn": YarnRoPE, "deepseek_yarn": YarnRoPE, "telechat3-yarn": YarnRoPE,
                 "longrope": SuScaledRoPE, "proportional": ProportionalRoPE}
_UNSCALED_ROPES = ("default", "mrope")


def check_built(config: dict, model: nn.Module) -> tuple[Architecture, list[LayerAttention | None]]:
    """`check_model`, and that the model built from `config` applies the RoPE scaling the config
    asks for: some classes build plain RoPE whatever `rope_scaling` says, and `rope_parameters`
    is dropped by the classes that read only `rope_theta` (Hugging Face and vLLM would scale)."""
    arch, layers = check_model(model)
    ropes = [layer.self_attn.rope for layer, spec in zip(model.layers, layers) if spec is not None]
    for field, scaling in _rope_scalings(config):
        kind = scaling.get("type") or scaling.get("rope_type", "default")
        if kind in _UNSCALED_ROPES:
            continue
        if kind not in _SCALED_ROPES:
            raise ValueError(f"{field}: RoPE scaling {kind!r} is not one mlx-lm implements")
        want = _SCALED_ROPES[kind]
        factor = scaling.get("factor")
        if want is nn.RoPE and (isinstance(factor, bool) or not isinstance(factor, (int, float))
                                or factor <= 0):
            raise ValueError(f"{field}: linear RoPE scaling needs a positive factor, got "
                             f"{factor!r}")
        # Gemma 3 scales its global layers only: one layer that applies it is enough
        if not any(type(r) is want and (want is not nn.RoPE or math.isclose(r.scale, 1 / factor))
                   for r in ropes):
            built = sorted({f"{type(r).__name__}" + (f"(scale={r.scale})" if type(r) is nn.RoPE
                                                     else "") for r in ropes})
            raise ValueError(f"{field}: {kind} RoPE scaling in the config, but mlx-lm's "
                             f"{arch.model_type} class builds {', '.join(built)} (it drops the "
                             "scaling)")
    return arch, layers


def _rope_scalings(config: dict) -> list[tuple[str, dict]]:
    """(field, scaling) of each RoPE scaling the config gives: `rope_scaling`, and
    `rope_parameters`, flat or per layer type (Hugging Face's Gemma 3)."""
    out = []
    if isinstance(config.get("rope_scaling"), dict):
        out.append(("rope_scaling", config["rope_scaling"]))
    params = config.get("rope_parameters")
    if isinstance(params, dict):
        nested = [v for v in params.values() if isinstance(v, dict)]
        out.extend(("rope_parameters", p) for p in nested or [params])
    return out
