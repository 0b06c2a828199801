"""The runner's own model: a copy of the caller's mlx-lm module tree over the same weights,
with the packed, paged modules in place (`attention.py`, `mlp.py`, `linear.py`).

Every module of the tree is copied (a new object with its own children), while the arrays are
the caller's: MLX never changes an array in place, so sharing them copies no weight memory, and
replacing a module or an array in one tree leaves the other as it was. The caller's model still
runs as mlx-lm's. From the first forward on the runner multiplies by its own stacks of the
q/k/v and gate/up weights (`linear.StackedLinear`): those are held once only if the caller lets
go of its model.
"""

from __future__ import annotations

import copy

import mlx.nn as nn
from mlx.utils import tree_map

from .architectures.base import LayerAttention, RecurrentLayer
from .attention import patch_attention
from .linear import pack_linears
from .mlp import patch_mlp
from .recurrent_layers import patch_recurrent


def paged_model(model: nn.Module, specs: list[LayerAttention | None],
                recurrent: list[RecurrentLayer | None] | None = None) -> nn.Module:
    """The caller's model, copied and converted for `PagedModelRunner.forward`; `specs`: each
    layer's attention (`architectures.check_model`), `recurrent`: a hybrid model's recurrent
    layers (`Architecture.recurrent`)."""
    own = copy_modules(model)
    patch_attention(own, specs)
    if recurrent is not None:
        patch_recurrent(own, recurrent)
    patch_mlp(own)
    for layer in own.layers:  # the runner feeds packed [T, hidden] rows
        pack_linears(layer)
    return own


def copy_modules(module: nn.Module) -> nn.Module:
    """A copy of every module below and including `module`, holding the same arrays."""
    own = copy.copy(module)  # same class and attributes; dict items are set below
    own._no_grad = set(module._no_grad)  # freezing one tree leaves the other trainable
    for key, value in module.items():
        own[key] = tree_map(_copy_if_module, value, is_leaf=_is_module)
    return own


def _is_module(value) -> bool:
    return isinstance(value, nn.Module)


def _copy_if_module(value):
    return copy_modules(value) if isinstance(value, nn.Module) else value
