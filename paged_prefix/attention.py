"""Paged attention as a drop-in for the attention modules of mlx-lm's decoder layers.

`PagedAttention` takes over the original module's projections, optional per-head norms
(Qwen3's and Gemma 3's q_norm/k_norm, the module's own), attention sinks (GPT-OSS) and RoPE
under the same attribute names, so the parameter tree and weight loading are unchanged. What the
module computes beyond that (heads, scale, sliding window, logit cap, sinks) comes from its
architecture (`architectures.LayerAttention`) and becomes the layer's `Geometry`. Per forward
it receives a `ForwardContext` in place of mlx-lm's KV cache and the forward's packed rows
x [T, hidden], and:
  0. projects q, k and v with one matmul (`linear.StackedLinear`);
  1. applies RoPE at each new token's absolute position (offset = num_computed_tokens);
  2. writes the new K/V into the paged cache by slot;
  3. attends over cached prefix + new tokens through its geometry's planned attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from jit_kernels.geometry import Geometry

from .architectures import LayerAttention
from .dispatch import ForwardAttention
from .kv_cache import PagedKVCache, Slots
from .linear import StackedLinear
from .metadata import BatchMetadata


@dataclass(frozen=True, eq=False)
class ForwardContext:
    """Stands in for mlx-lm's per-layer cache object for one forward."""

    meta: BatchMetadata
    kv_cache: PagedKVCache
    slots: Slots
    attentions: tuple[ForwardAttention, ...]  # per layer; layers of one geometry share one
    checked: frozenset[int]  # the layers that run their attention's entry check

    def make_mask(self, *args, **kwargs) -> None:
        # mlx-lm asks the cache for a mask; causality and windows come from the metadata.
        return None


class PagedAttention(nn.Module):
    def __init__(self, attn: nn.Module, layer: int, spec: LayerAttention):
        super().__init__()
        self.q_proj, self.k_proj = attn.q_proj, attn.k_proj
        self.v_proj, self.o_proj = attn.v_proj, attn.o_proj
        self._qkv = StackedLinear()  # q, k, v as one matmul
        if "q_norm" in attn:
            self.q_norm, self.k_norm = attn.q_norm, attn.k_norm
        if spec.sinks:
            self.sinks = attn.sinks
        self.rope = attn.rope
        self.n_heads, self.n_kv_heads = spec.num_heads, spec.num_kv_heads
        self.spec = spec
        self.window = spec.window  # read by the worker for the layer's vLLM cache spec
        self.layer = layer

    def geometry(self, block_size: int, dtype: mx.Dtype) -> Geometry:
        s = self.spec
        return Geometry(s.num_heads, s.num_kv_heads, s.head_dim, block_size, dtype, s.scale,
                        window=s.window, softcap=s.softcap, sinks=s.sinks)

    def __call__(self, x: mx.array, mask=None, cache: ForwardContext | None = None) -> mx.array:
        if not isinstance(cache, ForwardContext):
            raise ValueError("cache: PagedAttention runs only inside PagedModelRunner.forward")
        num_tokens, _ = x.shape  # x: [T, hidden], all sequences packed
        # [T, heads, 1, D]: each token its own RoPE batch row, so it carries its own offset
        q, k, v = self._qkv(x, self.q_proj, self.k_proj, self.v_proj)
        q = q.reshape(num_tokens, self.n_heads, 1, -1)
        k = k.reshape(num_tokens, self.n_kv_heads, 1, -1)
        v = v.reshape(num_tokens, self.n_kv_heads, -1)
        if "q_norm" in self:
            q, k = self.q_norm(q), self.k_norm(k)
        positions = cache.meta.positions
        q = self.rope(q, offset=positions).reshape(num_tokens, self.n_heads, -1)
        k = self.rope(k, offset=positions).reshape(num_tokens, self.n_kv_heads, -1)
        cache.kv_cache.write(self.layer, k, v, cache.slots)
        if q.dtype != cache.kv_cache.dtype:
            q = q.astype(cache.kv_cache.dtype)
        sinks = None
        if "sinks" in self:  # float32 [H], whatever the weights' dtype
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
        return self.o_proj(out.reshape(num_tokens, -1))


def patch_attention(model: nn.Module, specs: list[LayerAttention]) -> int:
    """Replace every layer's `self_attn` with PagedAttention; returns the layer count."""
    layers = model.layers
    for i, (layer, spec) in enumerate(zip(layers, specs, strict=True)):
        if not isinstance(layer.self_attn, PagedAttention):
            layer.self_attn = PagedAttention(layer.self_attn, i, spec)
    return len(layers)
