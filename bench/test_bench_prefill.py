"""pytest-benchmark: one prompt's prefill through the paged runner, by cached-prefix length.

Side by side in one run: the same prompt with no hit, half of it cached and 7/8 of it
cached (a 90%-shared prefix rounded down to whole blocks), so the ratios are the prefill
compute the prefix cache saves per request. On CPU: the demo model, 512 tokens, fp32,
reference attention. With a GPU kernel backend: a ~1.2B Llama config, 4096 tokens, bf16,
each hit timed with the attention path forced to the reference and in auto (the dispatcher's
choice), since only GPU timings are meaningful in absolute terms.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from jit_kernels import available_backends
from paged_prefix.dispatch import Dispatcher
from paged_prefix.kv_cache import PagedKVCache
from paged_prefix.metadata import ScheduledRequest, build_batch_metadata
from paged_prefix.models import build_model, resolve_config
from paged_prefix.runner import PagedModelRunner

GPU = bool(available_backends())
MODEL, PROMPT_LEN, DTYPE = ("llama-1b", 4096, mx.bfloat16) if GPU else ("llama-tiny", 512, mx.float32)
BLOCK_SIZE = 16
HITS = [0, PROMPT_LEN // 2, PROMPT_LEN * 7 // 8]
PATHS = ["reference", "auto"] if GPU else ["reference"]


@pytest.fixture(scope="module")
def setup():
    cfg = resolve_config(MODEL)
    kv = PagedKVCache(cfg["num_hidden_layers"], PROMPT_LEN // BLOCK_SIZE + 1, BLOCK_SIZE,
                      cfg["num_key_value_heads"], cfg["head_dim"], DTYPE)
    runner = PagedModelRunner(build_model(cfg, DTYPE), kv)
    prompt = np.random.default_rng(0).integers(3, cfg["vocab_size"], PROMPT_LEN).tolist()
    blocks = list(range(1, PROMPT_LEN // BLOCK_SIZE + 1))
    # Fill the cache once so a hit reads real prefix K/V; timed rounds rewrite the same
    # suffix slots with the same values.
    runner.greedy(build_batch_metadata(
        [ScheduledRequest("warm", prompt, PROMPT_LEN, 0, PROMPT_LEN, blocks)], BLOCK_SIZE,
        kv.num_blocks))
    return runner, prompt, blocks


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("hit", HITS)
def test_prefill(benchmark, setup, hit, path):
    runner, prompt, blocks = setup
    runner.dispatcher = Dispatcher(path)
    meta = build_batch_metadata(
        [ScheduledRequest("r", prompt, PROMPT_LEN, hit, PROMPT_LEN - hit, blocks)], BLOCK_SIZE,
        runner.kv_cache.num_blocks)
    benchmark.group = f"prefill {PROMPT_LEN} tokens ({MODEL}, {DTYPE})"
    before = runner.stats.tokens_computed
    benchmark.pedantic(runner.greedy, args=(meta,), rounds=5, warmup_rounds=1)
    assert runner.stats.tokens_computed - before == 6 * (PROMPT_LEN - hit)  # suffix only
    benchmark.extra_info.update(hit=hit, path=runner.dispatcher.last.path,
                                tokens_computed=PROMPT_LEN - hit)
