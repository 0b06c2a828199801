"""One prompt's prefill, paged runner vs mlx-lm's contiguous prompt cache: the shared setup of
bench/test_bench_prefill.py (pytest-benchmark), bench/prefill_interleaved.py and
bench/probes/pool_copies.py.

Same weights and tokens on both sides. For each model and prompt length, the prompt with 0%,
50%, 87.5% and 90% of it already cached (hits rounded down to whole blocks, as vLLM's
scheduler hands them out), prefilled by

  mlx-lm    mlx-lm's own model and prompt cache (`make_prompt_cache`: rotating caches for
            windowed layers): the prefix prefilled once, then the suffix forwarded (hidden
            states, the vocabulary projection of the last row only) and trimmed again; a
            rotating cache that cannot be trimmed back gets fresh copies of the prefix's arrays
            before each step instead (`MlxLmStep.prepare`, untimed);
  auto      the paged runner, attention path chosen by the dispatcher, the prompt's pages one
            run of consecutive blocks (as vLLM's allocator hands them to a lone request: SDPA
            reads a cached prefix in place);
  auto-scattered  the same over pages in shuffled blocks (what a busy server's tables look
            like: a cached prefix is gathered);
  sdpa / kernel   the paged runner with the path forced (GPU only), to re-measure the rule.

Both evaluate the logits and every cache write. With a GPU kernel backend the shapes are a
1.1B Llama config at 4096 tokens and Llama-3-8B's shape at 4096 and 16384 (bf16), and (not by
default: `--shape gemma3-1b:4096`) Gemma 3 1B's shape, sliding-window layers included; on the
CPU, the demo model at 512 tokens (fp32), where only the ratios mean anything.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from bench.steady_route import steady_dispatcher
from jit_kernels import available_backends
from paged_prefix.kv_cache import PagedKVCache
from paged_prefix.metadata import BatchMetadata, ScheduledRequest, build_batch_metadata
from paged_prefix.models import build_model, resolve_config
from paged_prefix.runner import PagedModelRunner

GPU = bool(available_backends())
BLOCK_SIZE = 16
SHAPES = [("llama-1b", 4096), ("llama-8b", 4096), ("llama-8b", 16384)] if GPU else \
    [("llama-tiny", 512)]
DTYPE = mx.bfloat16 if GPU else mx.float32
HIT_FRACTIONS = (0.0, 0.5, 0.875, 0.9)


def hit_tokens(prompt_len: int, fraction: float) -> int:
    return int(prompt_len * fraction) // BLOCK_SIZE * BLOCK_SIZE


class MlxLmStep:
    """One timed step of mlx-lm's model over its prompt cache; `prepare` (untimed) resets the
    cache to the prefix where trimming cannot."""

    def __init__(self, model, cache: list, prompt: list[int], hit: int):
        self.model, self.cache, self.hit, self.prompt_len = model, cache, hit, len(prompt)
        for c in cache:
            c.trim(c.offset)
        if hit:
            model.model(mx.array([prompt[:hit]]), cache=cache)
            mx.eval([c.state for c in cache])
        # a full rotating cache cannot be trimmed back to the prefix: keep the prefix's arrays
        self.snapshot = None if all(c.is_trimmable() for c in cache) else [
            (c.keys, c.values, c.offset, getattr(c, "_idx", None)) for c in cache]
        self.suffix = mx.array([prompt[hit:]])

    def prepare(self) -> None:
        if self.snapshot is None:
            return
        for c, (keys, values, offset, idx) in zip(self.cache, self.snapshot):
            # own buffers (not the snapshot's), so the step's writes go in place as in a server
            c.keys, c.values = (None, None) if keys is None else (keys + 0, values + 0)
            c.offset = offset
            if idx is not None:
                c._idx = idx
        mx.eval([c.keys for c in self.cache if c.keys is not None])

    def __call__(self) -> None:
        hidden = self.model.model(self.suffix, cache=self.cache)[:, -1]
        head = getattr(self.model, "lm_head", None) or self.model.model.embed_tokens.as_linear
        mx.eval(head(hidden), [c.state for c in self.cache])
        if self.snapshot is None:
            for c in self.cache:
                c.trim(self.prompt_len - self.hit)


@dataclass
class PagedStep:
    """One timed step of a paged runner: the forward of a prepared batch, evaluated."""
    runner: PagedModelRunner
    meta: BatchMetadata

    def __call__(self) -> None:
        mx.eval(self.runner.forward(self.meta), self.runner.kv_cache.arrays())


class Setup:
    """One model's weights shared by an unpatched mlx-lm model and the paged runners, one
    patched model and cache per page layout (`runners`: their default runners)."""

    def __init__(self, name: str, prompt_len: int):
        cfg = resolve_config(name)
        self.name, self.prompt_len = name, prompt_len
        self.dense = build_model(cfg, DTYPE)
        rng = np.random.default_rng(0)
        self.prompt = rng.integers(3, cfg["vocab_size"], prompt_len).tolist()
        n = -(-prompt_len // BLOCK_SIZE)
        self.blocks = {"run": list(range(1, n + 1)),
                       "scattered": rng.permutation(np.arange(1, n + 1)).tolist()}
        self.runners = {}
        for layout in self.blocks:
            paged = build_model(cfg, DTYPE, evaluate=False)
            paged.update(self.dense.parameters())  # the same arrays, not a copy
            kv = PagedKVCache(cfg["num_hidden_layers"], n + 1, BLOCK_SIZE,
                              cfg["num_key_value_heads"], cfg["head_dim"], DTYPE)
            self.runners[layout] = PagedModelRunner(paged, kv)
            # Fill the paged cache once so a hit reads real prefix K/V; timed rounds rewrite
            # the same suffix slots with the same values.
            self.runners[layout].greedy(self.meta(0, layout))
        self.runner = self.runners["run"]
        self.cache = make_prompt_cache(self.dense)

    def meta(self, hit: int, layout: str = "run"):
        blocks = self.blocks[layout]
        return build_batch_metadata([ScheduledRequest(
            "r", self.prompt, self.prompt_len, hit, self.prompt_len - hit, blocks)],
            BLOCK_SIZE, len(blocks) + 1)

    def mlx_lm_prefill(self, hit: int) -> MlxLmStep:
        """Prefill the prefix into mlx-lm's cache (untimed); returns the timed suffix step."""
        if not all(c.is_trimmable() for c in self.cache):  # a full rotating cache: start anew
            self.cache = make_prompt_cache(self.dense)
        return MlxLmStep(self.dense, self.cache, self.prompt, hit)

    def paged_prefill(self, hit: int, path: str, layout: str = "run") -> PagedStep:
        """The timed step of a runner with its own dispatcher for `path` over the layout's
        model and cache (already patched and filled: the runner only wraps them)."""
        base = self.runners[layout]
        runner = PagedModelRunner(base.model, base.kv_cache, steady_dispatcher(path))
        return PagedStep(runner, self.meta(hit, layout))


_SETUPS: dict[tuple, Setup] = {}


def setup_for(name: str, prompt_len: int) -> Setup:
    if (name, prompt_len) not in _SETUPS:
        _SETUPS.clear()
        mx.clear_cache()
        _SETUPS[(name, prompt_len)] = Setup(name, prompt_len)
    return _SETUPS[(name, prompt_len)]
