"""The model runner core: one packed forward over scheduled requests, no vLLM types.

`PagedModelRunner.forward(meta)` runs an mlx-lm model (Llama, Qwen3) whose attention is
patched to read and write the paged KV cache, computing only the scheduled tokens, and
returns the logits of the rows that sample.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from .attention import ForwardContext, patch_attention
from .dispatch import Dispatcher
from .kv_cache import PagedKVCache
from .metadata import BatchMetadata

SUPPORTED_MODEL_TYPES = ("llama", "qwen3")


@dataclass
class RunnerStats:
    forwards: int = 0
    tokens_computed: int = 0  # rows that went through the model: the suffix-only count


def _lm_head(model: nn.Module, hidden: mx.array) -> mx.array:
    if model.args.tie_word_embeddings:
        return model.model.embed_tokens.as_linear(hidden)
    return model.lm_head(hidden)


class PagedModelRunner:
    def __init__(self, model: nn.Module, kv_cache: PagedKVCache, dispatcher: Dispatcher | None = None):
        model_type = getattr(model.args, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type: {model_type!r} is not one of {SUPPORTED_MODEL_TYPES}")
        num_layers = patch_attention(model)
        if kv_cache.num_layers != num_layers:
            raise ValueError(f"kv_cache: {kv_cache.num_layers} layers for a {num_layers}-layer model")
        attn = model.layers[0].self_attn
        head_dim = attn.q_proj.weight.shape[0] // attn.n_heads
        if (kv_cache.num_kv_heads, kv_cache.head_dim) != (attn.n_kv_heads, head_dim):
            raise ValueError(
                f"kv_cache: {kv_cache.num_kv_heads} kv heads of {kv_cache.head_dim} but the "
                f"model has {attn.n_kv_heads} of {head_dim}"
            )
        self.model = model
        self.kv_cache = kv_cache
        self.dispatcher = dispatcher or Dispatcher()
        self.stats = RunnerStats()

    def forward(self, meta: BatchMetadata) -> mx.array:
        """Logits [len(meta.sample_req_ids), vocab] (float32), lazily; the caller evaluates."""
        ctx = ForwardContext(meta, self.kv_cache, self.dispatcher)
        hidden = self.model.model(meta.input_ids[None], cache=[ctx] * len(self.model.layers))
        self.stats.forwards += 1
        self.stats.tokens_computed += meta.num_tokens
        # Only rows that sample pay for the vocabulary projection.
        return _lm_head(self.model, hidden[0][meta.logits_indices]).astype(mx.float32)

    def greedy(self, meta: BatchMetadata) -> list[int]:
        """Greedy next token per sampling row; the one host sync of a step."""
        logits = self.forward(meta)
        if not meta.sample_req_ids:  # a mid-prompt chunk: only its K/V writes matter
            mx.eval(self.kv_cache.arrays())
            return []
        tokens = mx.argmax(logits, axis=-1)
        mx.eval(tokens, self.kv_cache.arrays())
        return tokens.tolist()
