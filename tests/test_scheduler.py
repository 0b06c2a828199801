"""End to end with vLLM's real v1 Scheduler: its prefix hits reach the runner, which
computes only the uncached suffix, and the tokens equal a prefix-caching-off run."""

import numpy as np
import pytest

from paged_prefix.engine import Engine, EngineConfig

BS = 16


def run(prompts, caching, max_tokens=6, arrive_after_first=True, **overrides):
    """Generate greedily; the first prompt runs alone first so the rest can hit its blocks."""
    config = dict(model="llama-test", num_blocks=256, max_model_len=1024,
                  enable_prefix_caching=caching, max_num_batched_tokens=512)
    engine = Engine(EngineConfig(**{**config, **overrides}))
    items = list(prompts.items())
    if arrive_after_first:
        engine.add_request(*items[0], max_tokens)
        engine.run_to_completion()
        items = items[1:]
    for req_id, prompt in items:
        engine.add_request(req_id, prompt, max_tokens)
    engine.run_to_completion()
    return engine


def shared_prompts(n, prefix_len=100, suffix_len=7, seed=0):
    rng = np.random.default_rng(seed)
    prefix = rng.integers(3, 512, prefix_len).tolist()
    return {f"r{i}": prefix + rng.integers(3, 512, suffix_len).tolist() for i in range(n)}


def test_second_request_hits_and_runner_computes_only_the_suffix():
    prompts = shared_prompts(2)
    off, on = run(prompts, caching=False), run(prompts, caching=True)
    assert off.results["r1"].cached_tokens == 0
    # 107 tokens share 100: the scheduler hands over 6 full blocks, 96 tokens.
    assert on.results["r1"].cached_tokens == 96
    decode_rows = 2 * 5  # 6 tokens each: the first comes from prefill
    assert off.tokens_computed == 2 * 107 + decode_rows
    assert on.tokens_computed == 107 + (107 - 96) + decode_rows
    assert {r: v.output_ids for r, v in on.results.items()} == \
        {r: v.output_ids for r, v in off.results.items()}


@pytest.mark.parametrize("budget", [48, 512], ids=["chunked", "whole"])
def test_simultaneous_arrivals_and_chunked_prefill_match_cache_off(budget):
    """All requests arrive together; with a small token budget prompts are chunked and
    later requests can hit blocks an earlier one fills in the very same forward."""
    prompts = {**shared_prompts(3, 80, 20, seed=1), **shared_prompts(2, 40, 50, seed=2)}
    prompts = {f"{i}": p for i, p in enumerate(prompts.values())}
    kw = dict(arrive_after_first=False, max_num_batched_tokens=budget)
    off, on = run(prompts, False, **kw), run(prompts, True, **kw)
    hits = sum(r.cached_tokens for r in on.results.values())
    assert hits > 0
    assert on.tokens_computed == off.tokens_computed - hits
    assert {r: v.output_ids for r, v in on.results.items()} == \
        {r: v.output_ids for r, v in off.results.items()}


def test_preempted_requests_resume_correctly():
    """Too few blocks force preemption; resumed requests get fresh block lists."""
    prompts = shared_prompts(4, prefix_len=60, suffix_len=40, seed=3)
    roomy = run(prompts, True, max_tokens=40, arrive_after_first=False)
    tight = run(prompts, True, max_tokens=40, arrive_after_first=False, num_blocks=22)
    assert roomy.num_resumed == 0 and tight.num_resumed > 0
    assert {r: v.output_ids for r, v in tight.results.items()} == \
        {r: v.output_ids for r, v in roomy.results.items()}
