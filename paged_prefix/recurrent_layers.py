"""The recurrent layers of hybrid models as drop-ins for mlx-lm's modules, their states in the
state cache: Qwen3-Next's gated delta net and LFM2's short conv.

Each takes over mlx-lm's module as it is (its parameters under their names, its sizes and its
own methods: the class is mlx-lm's, only `__call__` differs) and, per forward, receives the
forward's `ForwardContext` in place of mlx-lm's cache and the packed rows x [T, hidden]:
  1. its starting states (`ForwardStates.starts`, read from each sequence's source block before
     the forward, zeros for a fresh sequence);
  2. the layer over all sequences' rows at once (`paged_prefix.recurrent`);
  3. its end states written into each sequence's destination block.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.lfm2 import ShortConv
from mlx_lm.models.qwen3_next import Qwen3NextGatedDeltaNet

from .architectures.base import RecurrentLayer
from .recurrent import gated_delta_net, short_conv
from .state_cache import RecurrentStateCache
from .state_metadata import StateMetadata


@dataclass(frozen=True, eq=False)
class ForwardStates:
    """The recurrent layers' share of one forward: the cache, the forward's state rows and every
    layer's starting states (`RecurrentStateCache.read`, evaluated)."""

    cache: RecurrentStateCache
    meta: StateMetadata
    starts: tuple[tuple[mx.array, ...], ...]

    @classmethod
    def read(cls, cache: RecurrentStateCache, meta: StateMetadata) -> ForwardStates:
        return cls(cache, meta, cache.read(meta))


def _states(cache, layer: str) -> ForwardStates:
    states = getattr(cache, "states", None)
    if not isinstance(states, ForwardStates):
        raise ValueError(f"cache: {layer} runs only inside PagedModelRunner.forward of a "
                         "model with recurrent state (its ForwardContext carries no states)")
    return states


def _take_over(own: nn.Module, layer: nn.Module, index: int) -> None:
    """`own` becomes `layer` (the same children and arrays under the same names, the same
    sizes) with its state at `index` of the state cache. mlx-lm's __init__ is not run: it would
    draw new weights only to replace them."""
    nn.Module.__init__(own)
    own.__dict__.update({k: v for k, v in layer.__dict__.items() if k not in own.__dict__})
    for name, child in layer.items():
        own[name] = child
    own.state_layer = index


class PagedGatedDeltaNet(Qwen3NextGatedDeltaNet):
    """Qwen3-Next's gated delta net: state (conv [K-1, conv_dim], recurrent [Hv, Dv, Dk])."""

    def __init__(self, layer: Qwen3NextGatedDeltaNet, index: int):
        _take_over(self, layer, index)

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        states = _states(cache, "PagedGatedDeltaNet")
        conv, ssm = states.starts[self.state_layer]
        out, conv, ssm = gated_delta_net(self, x, states.meta.plan, conv, ssm)
        states.cache.write(self.state_layer, states.meta, (conv, ssm))
        return out


class PagedShortConv(ShortConv):
    """LFM2's short conv: state (conv [K-1, hidden],)."""

    def __init__(self, layer: ShortConv, index: int):
        _take_over(self, layer, index)

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        states = _states(cache, "PagedShortConv")
        (conv,) = states.starts[self.state_layer]
        out, conv = short_conv(self, x, states.meta.plan, conv)
        states.cache.write(self.state_layer, states.meta, (conv,))
        return out


def patch_recurrent(model: nn.Module, layers: list[RecurrentLayer | None]) -> int:
    """Replace every recurrent layer's module with its drop-in, numbered in layer order as the
    state cache holds them; returns how many."""
    index = 0
    for layer, rec in zip(model.layers, layers, strict=True):
        if rec is None:
            continue
        module = layer[rec.attribute]
        if not isinstance(module, rec.paged):
            layer[rec.attribute] = rec.paged(module, index)
        index += 1
    return index
