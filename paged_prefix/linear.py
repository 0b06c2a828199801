"""Linear layers for the packed forward: fewer ops per layer for the host to build and encode.

A short prefill's step is bound by host time (docs/results.md, "Host time per op"): on a CUDA GPU
MLX spends ~17 us of host time encoding a matmul (cuBLASLt set-up), ~4 us a small kernel, and
0.3-3 us building any op, views included. mlx-lm's `nn.Linear` computes `x @ weight.T`,
so every projection of every forward adds a transpose, and a [1, T, in] input a flatten and
an unflatten around the matmul. Here:
  - `PackedLinear` keeps its weight's transposed view (no copy) and takes packed [T, in] rows;
  - `StackedLinear` computes layers that read the same rows (q, k and v; gate and up) as one
    matmul over their weights stacked, the layers' own weights becoming views of the stack.
Same parameters under the same names, so loading weights is unchanged.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np


class _Transposed:
    """A weight's transposed view, rebuilt when the weight array is replaced (a module
    update or load_weights); kept outside the module tree so it is never a parameter."""

    __slots__ = ("source", "value")

    def __init__(self) -> None:
        self.source: mx.array | None = None
        self.value: mx.array | None = None

    def of(self, weight: mx.array) -> mx.array:
        if self.source is not weight:
            # lazy: the first forward evaluates it (a view), later forwards read it as a leaf
            self.source, self.value = weight, weight.T
        return self.value


class PackedLinear(nn.Module):
    """Computes what `nn.Linear` does, from the same `weight` (and `bias`) parameters."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight = linear.weight
        if "bias" in linear:
            self.bias = linear.bias
        self._transposed = _Transposed()

    def __call__(self, x: mx.array) -> mx.array:
        w_t = self._transposed.of(self["weight"])
        if "bias" in self:
            return mx.addmm(self["bias"], x, w_t)
        return x @ w_t


class StackedLinear:
    """Linear layers over the same rows as one matmul; `__call__(x, *layers)` returns each
    layer's output (column views of the one product).

    The layers' `weight`s (and `bias`es) become views of one stacked array, so the layers hold
    their weights once (their old arrays are freed unless something else holds them); a layer
    whose weight is replaced later (update, load_weights) is stacked again at the next call.
    Quantized layers, or layers that differ in having a bias or in their weights' dtype, are
    called one by one. Kept outside the module tree: it holds no parameters of its own.
    """

    def __init__(self) -> None:
        self._views: tuple[mx.array | None, ...] = ()  # what the layers held when last stacked
        self._w_t: mx.array | None = None
        self._bias: mx.array | None = None
        self._cuts: list[int] = []

    def __call__(self, x: mx.array, *layers: nn.Module) -> list[mx.array]:
        if not self._stacked(layers):  # every forward after the first: the check alone
            biased = ["bias" in layer for layer in layers]
            if any(type(layer) not in (nn.Linear, PackedLinear) for layer in layers) or \
                    len(set(biased)) > 1 or len({layer["weight"].dtype for layer in layers}) > 1:
                return [layer(x) for layer in layers]
            self._stack(layers, biased[0])
        y = x @ self._w_t if self._bias is None else mx.addmm(self._bias, x, self._w_t)
        return mx.split(y, self._cuts, axis=-1)

    def _stacked(self, layers: tuple[nn.Module, ...]) -> bool:
        """Whether the layers hold what they held when last stacked (nothing replaced, no
        bias added or dropped). Every layer of every forward asks: a plain loop, no tuple."""
        views = self._views
        if len(views) != 2 * len(layers):
            return False
        for i, layer in enumerate(layers):
            if layer.get("weight") is not views[2 * i] or layer.get("bias") is not views[2 * i + 1]:
                return False
        return True

    def _stack(self, layers: tuple[nn.Module, ...], biased: bool) -> None:
        names = ("weight", "bias") if biased else ("weight",)
        self._cuts = np.cumsum([layer["weight"].shape[0] for layer in layers[:-1]]).tolist()
        stacks = {name: mx.concatenate([layer[name] for layer in layers]) for name in names}
        for name in names:
            for layer, part in zip(layers, mx.split(stacks[name], self._cuts)):
                setattr(layer, name, part)
        self._views = _held(layers)
        # evaluated now, so the layers' old arrays can go and the weights are held once
        mx.eval(list(stacks.values()), [v for v in self._views if v is not None])
        self._w_t, self._bias = stacks["weight"].T, stacks.get("bias")


def _held(layers: tuple[nn.Module, ...]) -> tuple[mx.array | None, ...]:
    """Each layer's weight and bias (None without one), as `StackedLinear` compares them."""
    return tuple(layer.get(name) for layer in layers for name in ("weight", "bias"))


def pack_linears(module: nn.Module) -> int:
    """Replace every plain `nn.Linear` below `module` (not quantized ones) with a
    `PackedLinear` over the same arrays; returns how many were replaced."""
    replaced = 0
    for name, child in module.children().items():
        items = enumerate(child) if isinstance(child, list) else [(None, child)]
        for i, c in items:
            if type(c) is nn.Linear:
                if i is None:
                    setattr(module, name, PackedLinear(c))
                else:
                    child[i] = PackedLinear(c)
                replaced += 1
            elif isinstance(c, nn.Module):
                replaced += pack_linears(c)
    return replaced
