"""Paged attention as a drop-in for mlx-lm's Llama/Mistral/Qwen2/Qwen3 `Attention` modules.

`PagedAttention` takes over the original module's projections, optional per-head norms
(Qwen3's q_norm/k_norm) and RoPE under the same attribute names, so the parameter tree
and weight loading are unchanged. Per forward it receives a `ForwardContext` in place
of mlx-lm's KV cache and the forward's packed rows x [T, hidden], and:
  0. projects q, k and v with one matmul (`linear.StackedLinear`);
  1. applies RoPE at each new token's absolute position (offset = num_computed_tokens);
  2. writes the new K/V into the paged cache by slot;
  3. attends over cached prefix + new tokens through the forward's planned attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.rope_utils import Llama3RoPE

from .dispatch import ForwardAttention
from .kv_cache import PagedKVCache, Slots
from .linear import StackedLinear
from .metadata import BatchMetadata

# RoPE variants whose `offset` may be an array of per-row positions (they pass it
# straight to mx.fast.rope); others compute with the offset in Python and would break.
_ARRAY_OFFSET_ROPES = (nn.RoPE, Llama3RoPE)


@dataclass(frozen=True, eq=False)
class ForwardContext:
    """Stands in for mlx-lm's per-layer cache object for one forward."""

    meta: BatchMetadata
    kv_cache: PagedKVCache
    slots: Slots
    attention: ForwardAttention

    def make_mask(self, *args, **kwargs) -> None:
        # mlx-lm asks the cache for a mask; causality comes from the metadata instead.
        return None


class PagedAttention(nn.Module):
    def __init__(self, attn: nn.Module, layer: int):
        super().__init__()
        if not isinstance(attn.rope, _ARRAY_OFFSET_ROPES):
            raise ValueError(f"rope: {type(attn.rope).__name__} cannot take per-token positions")
        self.q_proj, self.k_proj = attn.q_proj, attn.k_proj
        self.v_proj, self.o_proj = attn.v_proj, attn.o_proj
        self._qkv = StackedLinear()  # q, k, v as one matmul
        if "q_norm" in attn:
            self.q_norm, self.k_norm = attn.q_norm, attn.k_norm
        self.rope = attn.rope
        self.n_heads, self.n_kv_heads = attn.n_heads, attn.n_kv_heads
        self.scale = attn.scale
        self.layer = layer

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
        caches = cache.kv_cache.stored(self.layer)
        if self.layer == 0:  # the forward's entry check; later layers have the same shapes
            cache.attention.check(q, k, v, *caches)
        out = cache.attention(q, k, v, *caches)
        if out.dtype != x.dtype:
            out = out.astype(x.dtype)
        return self.o_proj(out.reshape(num_tokens, -1))


def patch_attention(model: nn.Module) -> int:
    """Replace every layer's `self_attn` with PagedAttention; returns the layer count."""
    layers = model.layers
    for i, layer in enumerate(layers):
        if not isinstance(layer.self_attn, PagedAttention):
            layer.self_attn = PagedAttention(layer.self_attn, i)
    return len(layers)
