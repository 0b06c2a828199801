"""mlx-lm's SwiGLU MLP (Llama, Mistral, Qwen2, Qwen3) with gate and up as one matmul.

`PackedMLP` takes over the original module's projections under the same attribute names (the
parameter tree and weight loading are unchanged) and computes what it computes, with one
matmul fewer per layer for the host to encode (`linear.StackedLinear`).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama, qwen2, qwen3
from mlx_lm.models.activations import swiglu

from .linear import StackedLinear

# MLP classes whose __call__ is down_proj(swiglu(gate_proj(x), up_proj(x)))
_SWIGLU_MLPS = (llama.MLP, qwen2.MLP, qwen3.MLP)


class PackedMLP(nn.Module):
    def __init__(self, mlp: nn.Module):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        self._gate_up = StackedLinear()

    def __call__(self, x: mx.array) -> mx.array:
        gate, up = self._gate_up(x, self.gate_proj, self.up_proj)
        return self.down_proj(swiglu(gate, up))


def patch_mlp(model: nn.Module) -> int:
    """Replace every layer's SwiGLU `mlp` with PackedMLP; returns how many were replaced."""
    replaced = 0
    for layer in model.layers:
        if type(layer.mlp) in _SWIGLU_MLPS:
            layer.mlp = PackedMLP(layer.mlp)
            replaced += 1
    return replaced
