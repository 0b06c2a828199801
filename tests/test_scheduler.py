"""End to end with vLLM's real v1 Scheduler: its prefix hits reach the runner, which computes
only the uncached suffix, and every request's tokens equal the same request run alone with
prefix caching off — under chunking, preemption (tight block pools) and aborts too."""

import numpy as np
import pytest

from paged_prefix import attention_metadata, route
from paged_prefix.engine import Engine, EngineConfig

BS = 16
BASE = dict(model="llama-test", num_blocks=256, max_model_len=1024, max_num_batched_tokens=512)


def run(prompts, caching, max_tokens=6, arrive_after_first=True, **overrides):
    """Generate greedily; the first prompt runs alone first so the rest can hit its blocks."""
    engine = Engine(EngineConfig(**{**BASE, "enable_prefix_caching": caching, **overrides}))
    items = list(prompts.items())
    if arrive_after_first:
        engine.add_request(*items[0], max_tokens)
        engine.run_to_completion()
        items = items[1:]
    for req_id, prompt in items:
        engine.add_request(req_id, prompt, max_tokens)
    engine.run_to_completion()
    return engine


def run_alone(prompts, max_tokens):
    """Each request by itself, caching off: the reference every batched run must equal."""
    engine = Engine(EngineConfig(**{**BASE, "enable_prefix_caching": False}))
    for req_id, prompt in prompts.items():
        engine.add_request(req_id, prompt, max_tokens)
        engine.run_to_completion()
    return {r: v.output_ids for r, v in engine.results.items()}


def shared_prompts(n, prefix_len=100, suffix_len=7, seed=0, tag="r"):
    rng = np.random.default_rng(seed)
    prefix = rng.integers(3, 512, prefix_len).tolist()
    return {f"{tag}{i}": prefix + rng.integers(3, 512, suffix_len).tolist() for i in range(n)}


def outputs(engine):
    return {r: v.output_ids for r, v in engine.results.items()}


def test_second_request_hits_and_runner_computes_only_the_suffix():
    prompts = shared_prompts(2)
    off, on = run(prompts, caching=False), run(prompts, caching=True)
    assert off.results["r1"].cached_tokens == 0
    # 107 tokens share 100: the scheduler hands over 6 full blocks, 96 tokens.
    assert on.results["r1"].cached_tokens == 96
    decode_rows = 2 * 5  # 6 tokens each: the first comes from prefill
    assert off.tokens_computed == 2 * 107 + decode_rows
    assert on.tokens_computed == 107 + (107 - 96) + decode_rows
    assert outputs(on) == outputs(off)


def test_a_conversation_reads_its_history_in_place(monkeypatch):
    """With vLLM's allocator a lone conversation's blocks stay one run, turn after turn: the
    second turn's prefill reads its cached history in place as one run, while a request that
    shares only the first turn's prefix finds its pages in several; tokens as with caching off."""
    planned = []  # per forward: (sequences with a cached prefix, their runs of blocks)
    page_runs = route.page_runs

    def spy(table, lengths, seqs, block_size, starts=None, any_order=()):
        planned.append((list(seqs), page_runs(table, lengths, seqs, block_size, starts,
                                              any_order)))
        return planned[-1][1]
    monkeypatch.setattr(route, "page_runs", spy)
    rng = np.random.default_rng(3)
    first = rng.integers(3, 512, 200).tolist()
    engines = {c: Engine(EngineConfig(**{**BASE, "enable_prefix_caching": c})) for c in (0, 1)}
    for engine in engines.values():
        engine.add_request("turn1", first, 20)
        engine.run_to_completion()
    second = first + engines[1].results["turn1"].output_ids + rng.integers(3, 512, 40).tolist()
    other = first[:160] + rng.integers(3, 512, 60).tolist()
    for req_id, prompt in (("turn2", second), ("other", other)):
        for caching, engine in engines.items():
            if caching:
                planned.clear()
            engine.add_request(req_id, prompt, 5)
            engine.run_to_completion()
        prefill = planned[0]  # the request's first forward: its prefill
        assert engines[1].results[req_id].cached_tokens > 0 and prefill[0] == [0]
        assert (len(prefill[1][0]) == 1) == (req_id == "turn2"), (req_id, prefill)
    assert outputs(engines[1]) == outputs(engines[0])


@pytest.mark.parametrize("budget", [48, 512], ids=["chunked", "whole"])
def test_simultaneous_arrivals_and_chunked_prefill_match_cache_off(budget, monkeypatch):
    """All requests arrive together; with a small token budget prompts are chunked. The
    scheduler registers a block's hash when it allocates it, so later requests hit blocks an
    earlier one fills in the very same forward: the metadata must accept that."""
    prompts = {**shared_prompts(3, 80, 20, seed=1, tag="a"),
               **shared_prompts(2, 40, 50, seed=2, tag="b")}
    assert len(prompts) == 5
    same_forward_hits = []
    shared_reads = attention_metadata._shared_reads
    monkeypatch.setattr(attention_metadata, "_shared_reads",
                        lambda *a: same_forward_hits.append(shared_reads(*a)) or
                        same_forward_hits[-1])
    kw = dict(arrive_after_first=False, max_num_batched_tokens=budget)
    off, on = run(prompts, False, **kw), run(prompts, True, **kw)
    if budget == 512:
        assert sum(len(r) for r in same_forward_hits) > 0
    hits = sum(r.cached_tokens for r in on.results.values())
    assert hits > 0
    assert on.tokens_computed == off.tokens_computed - hits
    assert outputs(on) == outputs(off) == run_alone(prompts, 6)


SCHEDULING = pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])


def check_overlap(engine):
    """Every step here samples greedily, on the device; under asynchronous scheduling the
    runner built forwards before the engine took the output of the step before."""
    runner = engine.runner
    assert runner.steps_sampled_on_device == runner.runner.stats.forwards
    overlapped = runner.forwards_built_while_running
    assert overlapped > 0 if engine.config.async_scheduling else overlapped == 0


@SCHEDULING
def test_preempted_requests_resume_in_chunks_without_sampling_early(async_scheduling):
    """Defect 1: a resumed request re-prefills prompt + outputs in 8-token chunks; a chunk
    ending past the prompt but before the last known token must not sample."""
    rng = np.random.default_rng(4)
    prompts = {f"p{i}": rng.integers(3, 512, int(n)).tolist()
               for i, n in enumerate(rng.integers(20, 61, 8))}
    tight = run(prompts, True, max_tokens=60, arrive_after_first=False, num_blocks=16,
                max_num_batched_tokens=8, max_num_seqs=8, async_scheduling=async_scheduling)
    assert tight.num_preempted > 0 and tight.num_partial_prefills > 0
    assert outputs(tight) == run_alone(prompts, 60)
    check_overlap(tight)


@SCHEDULING
def test_a_hit_on_the_block_a_decode_step_fills_with_a_token_sampled_on_the_device(
        async_scheduling):
    """A's decode fills its second block with the token it sampled (on the device) the step
    before. Synchronous scheduling has taken that token, so vLLM hands the block to R, whose
    prompt is A's tokens so far plus more, as a cached prefix in that same step: the runner
    checks the hit against the token, not its placeholder (it refused the step once). Under
    asynchronous scheduling the token is not known yet, and R hits the first block only."""
    rng = np.random.default_rng(5)
    a = rng.integers(3, 512, 20).tolist()
    alone = run_alone({"a": a}, 24)["a"]
    r = a + alone[:12] + rng.integers(3, 512, 10).tolist()  # A's tokens at positions 0 .. 31
    engine = Engine(EngineConfig(**{**BASE, "async_scheduling": async_scheduling}))
    engine.add_request("a", a, 24)
    for _ in range(12):  # the 13th step writes position 31, the last of A's second block
        engine.step()
    engine.add_request("r", r, 8)
    engine.run_to_completion()
    assert engine.results["r"].cached_tokens == (16 if async_scheduling else 32)
    assert outputs(engine) == {"a": alone, "r": run_alone({"r": r}, 8)["r"]}
    check_overlap(engine)


@SCHEDULING
@pytest.mark.parametrize("seed", range(8))
def test_stress_tight_pools_small_budgets_preemption_and_aborts(seed, async_scheduling):
    """Random workloads with shared prefixes on a pool too small for them all, token budgets
    that split every prompt, and some requests aborted mid-way: every completed request equals
    itself run alone with caching off, every aborted one a prefix of that; under vLLM's
    asynchronous scheduling too (the runner builds each forward before the engine takes the
    step before's tokens)."""
    rng = np.random.default_rng(100 + seed)
    prompts = {}
    for g in range(3):
        prompts.update(shared_prompts(int(rng.integers(2, 4)), int(rng.integers(16, 50)),
                                      int(rng.integers(1, 30)), seed=seed * 10 + g, tag=f"g{g}_"))
    max_tokens = int(rng.integers(20, 40))
    engine = Engine(EngineConfig(**{**BASE, "num_blocks": int(rng.integers(14, 20)),
                                    "max_num_batched_tokens": int(rng.choice([8, 13, 32])),
                                    "max_num_seqs": 6,
                                    "async_scheduling": async_scheduling}))
    order = rng.permutation(list(prompts))
    aborted = set(order[:2].tolist())
    for req_id in order:
        engine.add_request(req_id, prompts[req_id], max_tokens)
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        if steps in (5, 40):
            victim = sorted(aborted)[steps // 40]
            if engine.results[victim].finish_reason is None:
                engine.abort(victim)
    alone = run_alone(prompts, max_tokens)
    for req_id, result in engine.results.items():
        if result.finish_reason == "abort":
            assert result.output_ids == alone[req_id][:len(result.output_ids)], req_id
        else:
            assert result.output_ids == alone[req_id], req_id
    assert engine.num_preempted > 0 and engine.num_partial_prefills > 0
    check_overlap(engine)
    print(f"seed {seed}: {len(prompts)} requests, {engine.num_preempted} preemptions, "
          f"{engine.num_partial_prefills} chunk splits, "
          f"{sum(r.finish_reason == 'abort' for r in engine.results.values())} aborted")


@pytest.mark.parametrize("prompt, max_tokens, match", [
    ([], 4, "prompt_ids"),
    ([1, 2, 512], 4, "prompt_ids"),
    ([1.5, 2], 4, "prompt_ids"),
    ([1] * 1020, 8, "max_model_len"),
    ([1] * 200, 8, "num_blocks"),
    ([1, 2], 0, "max_tokens"),
])
def test_requests_that_can_never_run_fail_at_once(prompt, max_tokens, match):
    engine = Engine(EngineConfig(**{**BASE, "num_blocks": 8}))
    with pytest.raises(ValueError, match=match):
        engine.add_request("x", prompt, max_tokens)
    assert not engine.has_unfinished()


def test_the_engine_takes_heads_from_the_model_and_refuses_hybrid_models():
    """Mixtral's config gives no head_dim (its class derives it): the loop reads heads and
    head dim from the model's attention. A hybrid model's states need vLLM's mamba groups,
    which this loop does not build: refused, naming the model."""
    engine = Engine(EngineConfig(**{**BASE, "model": "mixtral-test"}))
    prompts = shared_prompts(2, 40, 7, seed=6)
    for req_id, prompt in prompts.items():
        engine.add_request(req_id, prompt, 4)
    engine.run_to_completion()
    assert all(len(r.output_ids) == 4 for r in engine.results.values())
    with pytest.raises(ValueError, match="model: 'lfm2' is a hybrid model"):
        Engine(EngineConfig(**{**BASE, "model": "lfm2-test"}))
