"""What an architecture tells the runner: how its mlx-lm model is built from a config, what each
layer's attention computes (or, in a hybrid model, which recurrent layer it holds), and what
runs around the decoder layers (embedding, final norm, logits).

The decoder layers themselves are mlx-lm's, run as they are (norms, residuals, MLP or experts);
only each layer's attention module (`paged_prefix/attention.py`) or recurrent module
(`paged_prefix/recurrent_layers.py`) is replaced.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.rope_utils import Llama3RoPE, ProportionalRoPE, SuScaledRoPE, YarnRoPE

# RoPE classes that pass `offset` straight to mx.fast.rope, so an array of per-row positions
# works (tests/test_architecture_checks.py checks each against scalar offsets). Others compute with
# the offset in Python (DynamicNTKScalingRoPE sizes its base from it) and are refused.
ARRAY_OFFSET_ROPES = (nn.RoPE, Llama3RoPE, YarnRoPE, SuScaledRoPE, ProportionalRoPE)
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class LayerAttention:
    """One layer's attention: its heads, softmax scale and variant (window, logit cap, sinks)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    window: int | None = None  # a query at position p sees keys max(0, p - window + 1) .. p
    softcap: float | None = None  # each logit s becomes softcap * tanh(s / softcap)
    sinks: bool = False  # the module's `sinks` [H]: one logit per head in the denominator
    # q_proj gives each head's queries, then as many gate logits; the output is multiplied by
    # their sigmoid before the out projection (Qwen3-Next)
    output_gate: bool = False

    def __post_init__(self):
        if self.window is not None and (isinstance(self.window, bool) or
                                        not isinstance(self.window, int) or self.window < 1):
            raise ValueError(f"sliding_window: expected a positive int, got {self.window!r}")


@dataclass(frozen=True)
class RecurrentLayer:
    """One recurrent layer of a hybrid model (docs/hybrid.md): the decoder layer's attribute
    holding it, the drop-in that takes it over, and the state it keeps per sequence."""

    attribute: str  # "linear_attn" (Qwen3-Next), "conv" (LFM2)
    paged: type  # its drop-in (recurrent_layers.PagedGatedDeltaNet, PagedShortConv)
    shapes: tuple[tuple[int, ...], ...]  # vLLM's MambaSpec shapes, mlx-lm's layout
    compute_dtypes: tuple[mx.Dtype, ...]  # what mlx-lm computes each state in
    mamba_type: str  # vLLM's MambaAttentionBackendEnum member, for the layer's MambaSpec


def no_recurrent_layers(model: nn.Module) -> list[RecurrentLayer | None]:
    return [None] * len(model.layers)


def plain_embedding(model: nn.Module, ids: mx.array) -> mx.array:
    return model.model.embed_tokens(ids)


def final_norm(model: nn.Module, hidden: mx.array) -> mx.array:
    return model.model.norm(hidden)


def vocabulary_head(model: nn.Module, hidden: mx.array) -> mx.array:
    """The model's lm_head, or the tied embedding where it has none."""
    if "lm_head" in model:
        return model.lm_head(hidden)
    return model.model.embed_tokens.as_linear(hidden)


def accept_config(config: dict) -> None:
    """Nothing in the config that the model's class drops needs refusing."""


@dataclass(frozen=True)
class MustState:
    """A config field that Hugging Face's class (what vLLM and the checkpoint's authors run)
    and mlx-lm's read differently when it is missing: a config must state it."""

    field: str
    hugging_face: object  # what each reads a missing field as
    mlx_lm: object


# Llama's, Mistral's and Qwen2's: mlx-lm's classes tie a missing one
TIED_EMBEDDINGS = MustState("tie_word_embeddings", hugging_face=False, mlx_lm=True)


@dataclass(frozen=True)
class Architecture:
    """One model type: mlx-lm's model file, the args class its models are built with (mlx-lm's,
    or a subclass keeping config fields mlx-lm drops but the attention depends on), and the
    pieces the runner runs around mlx-lm's own decoder layers."""

    model_type: str
    hf_architecture: str  # config.json's "architectures" entry, for vLLM's ModelConfig
    module: ModuleType
    # each layer's, from the model; None on a hybrid model's recurrent layers
    attention: Callable[[nn.Module], list[LayerAttention | None]]
    args: type | None = None  # None: the module's own ModelArgs
    check_config: Callable[[dict], None] = accept_config  # raises ValueError naming the field
    embed: Callable[[nn.Module, mx.array], mx.array] = plain_embedding  # ids [T] -> [T, hidden]
    logits: Callable[[nn.Module, mx.array], mx.array] = vocabulary_head  # normed rows -> logits
    # each layer's recurrent module (hybrid models), None on its attention layers
    recurrent: Callable[[nn.Module], list[RecurrentLayer | None]] = no_recurrent_layers
    norm: Callable[[nn.Module, mx.array], mx.array] = final_norm  # last hidden rows -> normed
    must_state: tuple[MustState, ...] = ()

    @property
    def model_args(self) -> type:
        return self.args or self.module.ModelArgs


def layer_type_windows(layer_types: list[str], window: int | None, where: str) -> list[int | None]:
    """Each layer's window from a config's `layer_types`; refuses entries it cannot run."""
    unknown = sorted(set(layer_types) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"layer_types: {where} has {unknown}; the runner reproduces "
                         f"{list(LAYER_TYPES)}")
    if "sliding_attention" in layer_types and not window:
        raise ValueError(f"sliding_window: {where} has sliding layers but sliding_window is "
                         f"{window!r}")
    return [window if t == "sliding_attention" else None for t in layer_types]


def refuse_sliding_window_flag(config: dict) -> None:
    """Qwen configs window layers only with `use_sliding_window`, which mlx-lm's classes drop."""
    if config.get("use_sliding_window"):
        raise ValueError(f"use_sliding_window: {config.get('model_type')!r} with a sliding "
                         "window is not reproduced (mlx-lm's class runs full attention)")


def module_attention(model: nn.Module, windows: list[int | None] | None = None,
                   heads: tuple[str, str] = ("n_heads", "n_kv_heads"),
                   scale: str = "scale") -> list[LayerAttention]:
    """Each layer's attention read from mlx-lm's module (`heads`, `scale`: its attribute
    names), windowed by `windows` (None: full attention everywhere)."""
    out = []
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        num_heads, num_kv_heads = getattr(attn, heads[0]), getattr(attn, heads[1])
        out.append(LayerAttention(num_heads, num_kv_heads,
                                  attn.q_proj.weight.shape[0] // num_heads,
                                  float(getattr(attn, scale)),
                                  window=None if windows is None else windows[i]))
    return out
