"""mlx-lm's own models, run with their own caches: the oracle the paged runner is compared with.

Most mlx-lm classes implement their architecture's attention fully, windows included:
`make_prompt_cache` gives windowed layers rotating caches, whose masks the model asks for. Two
layouts window layers that mlx-lm's class runs in full, and the oracle windows them through
mlx-lm's own pieces, with the windows read from the config here (not from the code under test):
  * Mistral and Mixtral configs with a `sliding_window` (every layer windowed, as Hugging Face
    runs them): every layer gets a RotatingKVCache of the window's size; the model builds its
    mask from the cache (make_mask windows by the cache's size) and, decoding, the cache holds
    exactly the window's keys;
  * Gemma 2 (windows on the layers `layer_types` marks, by default the even ones): mlx-lm's own
    decoder layers over plain KV caches, each fed through its `mask` argument the mask mlx-lm's
    `create_causal_mask` builds for its window; around them the loop of GemmaModel and Model.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache


def gemma2_windows(config: dict) -> list[int | None]:
    n = config["num_hidden_layers"]
    layer_types = config.get("layer_types") or ["full_attention" if i % 2 else "sliding_attention"
                                                for i in range(n)]
    return [config["sliding_window"] if t == "sliding_attention" else None for t in layer_types]


class MlxLmOracle:
    """`logits(tokens, caches)`: mlx-lm's last-row logits for `tokens` after what `caches`
    (from `caches()`) already hold."""

    def __init__(self, model: nn.Module, config: dict):
        self.model, self.config = model, config
        self.every_layer_window = (config["model_type"] in ("mistral", "mixtral")
                                   and config.get("sliding_window"))

    def caches(self) -> list:
        n = len(self.model.layers)
        if self.every_layer_window:
            return [RotatingKVCache(max_size=self.config["sliding_window"]) for _ in range(n)]
        if self.config["model_type"] == "gemma2":
            return [KVCache() for _ in range(n)]
        return make_prompt_cache(self.model)

    def logits(self, tokens: list[int], caches: list) -> mx.array:
        x = mx.array([tokens])
        if self.config["model_type"] == "gemma2":
            return self._gemma2(x, caches)[0, -1]
        return self.model(x, cache=caches)[0, -1]

    def _gemma2(self, x: mx.array, caches: list) -> mx.array:
        """mlx-lm's gemma2 GemmaModel.__call__ and Model.__call__, each layer given its mask."""
        inner, length = self.model.model, x.shape[1]
        h = inner.embed_tokens(x) * (self.model.args.hidden_size**0.5)
        for layer, c, window in zip(inner.layers, caches, gemma2_windows(self.config)):
            h = layer(h, create_causal_mask(length, c.offset, window_size=window), c)
        out = inner.embed_tokens.as_linear(inner.norm(h))
        cap = self.model.final_logit_softcapping
        return mx.tanh(out / cap) * cap

    def split_logits(self, tokens: list[int], splits: list[tuple[int, int]]) -> list[mx.array]:
        """The cache fed tokens[a:b] for each (a, b): the last row's logits of each."""
        caches = self.caches()
        return [self.logits(tokens[a:b], caches) for a, b in splits]

    def greedy(self, prompt: list[int], steps: int) -> tuple[mx.array, list[int]]:
        """Full-prefill last-token logits and the greedy continuation."""
        caches = self.caches()
        logits = self.logits(prompt, caches)
        first, out = logits, []
        for _ in range(steps):
            out.append(int(mx.argmax(logits)))
            logits = self.logits([out[-1]], caches)
        return first, out
