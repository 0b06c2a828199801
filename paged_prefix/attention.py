"""Paged attention as a drop-in for the attention modules of mlx-lm's decoder layers.

`PagedAttention` takes over the original module's projections, optional per-head norms
(Qwen3's and Gemma 3's q_norm/k_norm, LFM2's q_layernorm/k_layernorm), attention sinks
(GPT-OSS) and RoPE under the same attribute names, so the parameter tree and weight loading are
unchanged. What the module computes beyond that (heads, scale, sliding window, logit cap, sinks,
Qwen3-Next's output gate) comes from its architecture (`architectures.LayerAttention`) and
becomes the layer's `Geometry`. Per forward it receives a `ForwardContext` in place of mlx-lm's
KV cache and the forward's packed rows x [T, hidden], and:
  0. projects q, k and v with one matmul (`linear.StackedLinear`);
  1. applies RoPE at each new token's absolute position (offset = num_computed_tokens);
  2. writes the new K/V into the paged cache by slot;
  3. attends over cached prefix + new tokens through its geometry's planned attention.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx
import mlx.nn as nn

from jit_kernels.geometry import Geometry

from .architectures import LayerAttention
from .dispatch import ForwardAttention
from .kv_cache import PagedKVCache, Slots
from .linear import StackedLinear
from .metadata import BatchMetadata

if TYPE_CHECKING:
    from .recurrent_layers import ForwardStates

# mlx-lm's names of the per-head q/k norms: Qwen3's and Gemma 3's, LFM2's
_QK_NORMS = (("q_norm", "k_norm"), ("q_layernorm", "k_layernorm"))


@dataclass(frozen=True, eq=False)
class ForwardContext:
    """Stands in for mlx-lm's per-layer cache object for one forward."""

    meta: BatchMetadata
    kv_cache: PagedKVCache
    slots: Slots
    attentions: tuple[ForwardAttention, ...]  # per layer; layers of one geometry share one
    checked: frozenset[int]  # the layers that run their attention's entry check
    states: ForwardStates | None = None  # a hybrid model's recurrent layers (recurrent_layers.py)

    def make_mask(self, *args, **kwargs) -> None:
        # mlx-lm asks the cache for a mask; causality and windows come from the metadata.
        return None


class PagedAttention(nn.Module):
    def __init__(self, attn: nn.Module, layer: int, spec: LayerAttention):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = attn.q_proj, attn.k_proj, attn.v_proj
        self._qkv = StackedLinear()  # q, k, v as one matmul
        # under the module's own names: mlx-lm's o_proj, q_norm/k_norm; LFM2's out_proj and
        # q_layernorm/k_layernorm
        self._out = "o_proj" if "o_proj" in attn else "out_proj"
        self[self._out] = attn[self._out]
        norms = next((n for n in _QK_NORMS if n[0] in attn), None)
        # names as plain attributes (a tuple would live in the module's tree, read through its
        # __getattr__ in every layer call)
        self._q_norm, self._k_norm = norms or (None, None)
        for name in norms or ():
            self[name] = attn[name]
        if spec.sinks:
            self.sinks = attn.sinks
        self.rope = attn.rope
        self.n_heads, self.n_kv_heads = spec.num_heads, spec.num_kv_heads
        self.spec = spec
        self.window = spec.window  # read by the worker for the layer's vLLM cache spec
        self.layer = layer

    def geometry(self, block_size: int, dtype: mx.Dtype, heads_major: bool = False) -> Geometry:
        s = self.spec
        return Geometry(s.num_heads, s.num_kv_heads, s.head_dim, block_size, dtype, s.scale,
                        window=s.window, softcap=s.softcap, sinks=s.sinks,
                        heads_major=heads_major)

    def __call__(self, x: mx.array, mask=None, cache: ForwardContext | None = None) -> mx.array:
        if not isinstance(cache, ForwardContext):
            raise ValueError("cache: PagedAttention runs only inside PagedModelRunner.forward")
        num_tokens, _ = x.shape  # x: [T, hidden], all sequences packed
        # [T, heads, 1, D]: each token its own RoPE batch row, so it carries its own offset
        q, k, v = self._qkv(x, self.q_proj, self.k_proj, self.v_proj)
        gate = None
        if self.spec.output_gate:  # each head's queries, then its gate (Qwen3-Next)
            q, gate = mx.split(q.reshape(num_tokens, self.n_heads, -1), 2, axis=-1)
        q = q.reshape(num_tokens, self.n_heads, 1, -1)
        k = k.reshape(num_tokens, self.n_kv_heads, 1, -1)
        v = v.reshape(num_tokens, self.n_kv_heads, -1)
        if self._q_norm is not None:
            q, k = self[self._q_norm](q), self[self._k_norm](k)
        positions = cache.meta.positions
        q = self.rope(q, offset=positions).reshape(num_tokens, self.n_heads, -1)
        k = self.rope(k, offset=positions).reshape(num_tokens, self.n_kv_heads, -1)
        cache.kv_cache.write(self.layer, k, v, cache.slots)
        if q.dtype != cache.kv_cache.dtype:
            q = q.astype(cache.kv_cache.dtype)
        sinks = None
        if self.spec.sinks:  # float32 [H], whatever the weights' dtype
            sinks = self["sinks"]
            if sinks.dtype != mx.float32:
                sinks = sinks.astype(mx.float32)
        caches = cache.kv_cache.stored(self.layer)
        attention = cache.attentions[self.layer]
        if self.layer in cache.checked:  # later layers of the geometry have the same shapes
            attention.check(q, k, v, *caches, sinks=sinks)
        out = attention(q, k, v, *caches, sinks=sinks)
        if out.dtype != x.dtype:
            out = out.astype(x.dtype)
        out = out.reshape(num_tokens, -1)
        if gate is not None:
            out = out * mx.sigmoid(gate.reshape(num_tokens, -1))
        return self[self._out](out)


def patch_attention(model: nn.Module, specs: list[LayerAttention | None]) -> int:
    """Replace every attention layer's `self_attn` with PagedAttention (a hybrid model's
    recurrent layers have spec None), numbered in layer order as the KV cache holds them;
    returns how many."""
    attention_layers = [(layer, spec) for layer, spec in zip(model.layers, specs, strict=True)
                        if spec is not None]
    for i, (layer, spec) in enumerate(attention_layers):
        if not isinstance(layer.self_attn, PagedAttention):
            layer.self_attn = PagedAttention(layer.self_attn, i, spec)
    return len(attention_layers)
