"""pytest-benchmark: one prompt's prefill through the paged runner, cache hit vs none.

Side by side in one run: a 512-token prompt of the demo model with 0, 256 and 448 cached
tokens (448 = the block-aligned hit of a 90% shared prefix). The ratio of medians is the
compute the prefix cache saves per request; absolute CPU times mean little.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from paged_prefix.kv_cache import PagedKVCache
from paged_prefix.metadata import ScheduledRequest, build_batch_metadata
from paged_prefix.models import build_model, resolve_config
from paged_prefix.runner import PagedModelRunner

PROMPT_LEN, BLOCK_SIZE = 512, 16


@pytest.fixture(scope="module")
def runner_and_prompt():
    cfg = resolve_config("llama-tiny")
    kv = PagedKVCache(cfg["num_hidden_layers"], PROMPT_LEN // BLOCK_SIZE + 1, BLOCK_SIZE,
                      cfg["num_key_value_heads"], cfg["head_dim"], mx.float32)
    runner = PagedModelRunner(build_model(cfg), kv)
    prompt = np.random.default_rng(0).integers(3, cfg["vocab_size"], PROMPT_LEN).tolist()
    return runner, prompt


@pytest.mark.benchmark(group="prefill 512 tokens (llama-tiny, fp32)")
@pytest.mark.parametrize("hit", [0, 256, 448])
def test_prefill(benchmark, runner_and_prompt, hit):
    runner, prompt = runner_and_prompt
    blocks = list(range(1, PROMPT_LEN // BLOCK_SIZE + 1))
    # Fill the cache once so a hit reads real prefix K/V; later rounds rewrite the same
    # suffix slots with the same values.
    runner.greedy(build_batch_metadata(
        [ScheduledRequest("warm", prompt, PROMPT_LEN, 0, PROMPT_LEN, blocks)], BLOCK_SIZE,
        runner.kv_cache.num_blocks))
    meta = build_batch_metadata(
        [ScheduledRequest("r", prompt, PROMPT_LEN, hit, PROMPT_LEN - hit, blocks)], BLOCK_SIZE,
        runner.kv_cache.num_blocks)
    before = runner.stats.tokens_computed
    benchmark.pedantic(runner.greedy, args=(meta,), rounds=5, warmup_rounds=1)
    assert runner.stats.tokens_computed - before == 6 * (PROMPT_LEN - hit)  # suffix only
    benchmark.extra_info["tokens_computed_per_round"] = PROMPT_LEN - hit
