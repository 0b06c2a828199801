"""The model runner core: one packed forward over scheduled requests, no vLLM types.

`PagedModelRunner.forward(meta)` runs an mlx-lm model whose attention is patched to read and
write the paged KV cache, computing only the scheduled tokens, and returns the logits of the
rows that sample. Every check runs before the first cache write, and a forward that raises
while its graph is built leaves the cache as it was.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from jit_kernels.support import Geometry

from .attention import ForwardContext, PagedAttention, patch_attention
from .dispatch import Dispatcher
from .kv_cache import PagedKVCache
from .metadata import BatchMetadata

# mlx-lm model types whose attention PagedAttention takes over (mistral runs mlx-lm's llama).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass
class RunnerStats:
    forwards: int = 0
    tokens_computed: int = 0  # rows that went through the model: the suffix-only count


def check_model(model: nn.Module) -> None:
    """Raise ValueError unless every layer is full attention of a supported type."""
    args = model.args
    model_type = getattr(args, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type: {model_type!r} is not one of {SUPPORTED_MODEL_TYPES}")
    layer_types = set(getattr(args, "layer_types", None) or ["full_attention"])
    if layer_types != {"full_attention"}:
        raise ValueError(f"layer_types: only full attention is supported, got {sorted(layer_types)}")


def _lm_head(model: nn.Module, hidden: mx.array) -> mx.array:
    if model.args.tie_word_embeddings:
        return model.model.embed_tokens.as_linear(hidden)
    return model.lm_head(hidden)


class PagedModelRunner:
    def __init__(self, model: nn.Module, kv_cache: PagedKVCache,
                 dispatcher: Dispatcher | None = None):
        check_model(model)
        num_layers = patch_attention(model)
        if kv_cache.num_layers != num_layers:
            raise ValueError(f"kv_cache: {kv_cache.num_layers} layers for a {num_layers}-layer model")
        attn: PagedAttention = model.layers[0].self_attn
        head_dim = attn.q_proj.weight.shape[0] // attn.n_heads
        if (kv_cache.num_kv_heads, kv_cache.head_dim) != (attn.n_kv_heads, head_dim):
            raise ValueError(
                f"kv_cache: {kv_cache.num_kv_heads} kv heads of {kv_cache.head_dim} but the "
                f"model has {attn.n_kv_heads} of {head_dim}")
        self.model = model
        self.kv_cache = kv_cache
        self.dispatcher = dispatcher or Dispatcher()
        self.geometry = Geometry(attn.n_heads, attn.n_kv_heads, head_dim, kv_cache.block_size,
                                 kv_cache.dtype, float(attn.scale))
        self.vocab_size = model.args.vocab_size
        self.stats = RunnerStats()

    def _check(self, meta: BatchMetadata) -> None:
        attn = meta.attn
        if attn.block_size != self.kv_cache.block_size:
            raise ValueError(f"block_size: metadata built for {attn.block_size}, the cache has "
                             f"{self.kv_cache.block_size}")
        if attn.num_blocks > self.kv_cache.num_blocks:
            raise ValueError(f"num_blocks: metadata allows block ids < {attn.num_blocks}, the "
                             f"cache has {self.kv_cache.num_blocks} blocks")
        if int(meta.input_ids_host.max()) >= self.vocab_size:
            raise ValueError(f"token_ids: {int(meta.input_ids_host.max())} is outside the "
                             f"model's vocabulary of {self.vocab_size}")

    def forward(self, meta: BatchMetadata) -> mx.array:
        """Logits [len(meta.sample_req_ids), vocab] (float32), lazily; the caller evaluates
        them together with `kv_cache.arrays()`."""
        self._check(meta)
        slots = self.kv_cache.slots(meta.slot_mapping_host)
        attention = self.dispatcher.plan(meta.attn, self.geometry)
        ctx = ForwardContext(meta, self.kv_cache, slots, attention)
        snapshot = self.kv_cache.snapshot()
        try:
            hidden = self.model.model(meta.input_ids[None], cache=[ctx] * len(self.model.layers))
        except BaseException:
            self.kv_cache.restore(snapshot)
            raise
        del snapshot  # shared arrays would make the in-place writes copy
        self.stats.forwards += 1
        self.stats.tokens_computed += meta.num_tokens
        if not meta.sample_req_ids:  # a mid-prompt chunk: only its K/V writes matter
            return mx.zeros((0, self.vocab_size), dtype=mx.float32)
        # Only rows that sample pay for the vocabulary projection.
        return _lm_head(self.model, hidden[0][meta.logits_indices]).astype(mx.float32)

    def greedy(self, meta: BatchMetadata) -> list[int]:
        """Greedy next token per sampling row; the one host sync of a step."""
        logits = self.forward(meta)
        if not meta.sample_req_ids:
            mx.eval(self.kv_cache.arrays())
            return []
        tokens = mx.argmax(logits, axis=-1)
        mx.eval(tokens, self.kv_cache.arrays())
        return tokens.tolist()
