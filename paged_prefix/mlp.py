"""mlx-lm's gated MLPs (SwiGLU: Llama, Mistral, Qwen2/3, Qwen3-MoE's dense layers; GeGLU:
Gemma 2/3) with gate and up as one matmul.

`PackedMLP` takes over the original module's projections under the same attribute names (the
parameter tree and weight loading are unchanged) and computes what it computes, with one
matmul fewer per layer for the host to encode (`linear.StackedLinear`). Expert layers (SwitchGLU)
are mlx-lm's own and stay as they are: they take the packed [T, hidden] rows unchanged.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gemma2, gemma3_text, llama, qwen2, qwen3, qwen3_moe
from mlx_lm.models.activations import swiglu

from .linear import StackedLinear


def _gelu_gated(gate: mx.array, up: mx.array) -> mx.array:
    return nn.gelu_approx(gate) * up


# MLP classes whose __call__ is down_proj(activation(gate_proj(x), up_proj(x)))
_GATED_MLPS: dict[type, Callable[[mx.array, mx.array], mx.array]] = {
    llama.MLP: swiglu, qwen2.MLP: swiglu, qwen3.MLP: swiglu, qwen3_moe.MLP: swiglu,
    gemma2.MLP: _gelu_gated, gemma3_text.MLP: _gelu_gated,
}


class PackedMLP(nn.Module):
    def __init__(self, mlp: nn.Module):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        self._activation = _GATED_MLPS[type(mlp)]
        self._gate_up = StackedLinear()

    def __call__(self, x: mx.array) -> mx.array:
        gate, up = self._gate_up(x, self.gate_proj, self.up_proj)
        return self.down_proj(self._activation(gate, up))


def patch_mlp(model: nn.Module) -> int:
    """Replace every layer's gated `mlp` with PackedMLP; returns how many were replaced."""
    replaced = 0
    for layer in model.layers:
        if type(layer.get("mlp")) in _GATED_MLPS:
            layer.mlp = PackedMLP(layer.mlp)
            replaced += 1
    return replaced
