"""vLLM's real scheduler with its hybrid KV-cache manager (a full-attention group and sliding-
window groups) driving the runner's request state (`requests.plan_step`), with no model: every
step it schedules passes the runner's checks, and what the checks assume of vLLM holds. A
windowed group's list has vLLM's null block only before the window, freed blocks go to other
requests while their first owner still runs, prefix hits keep the window's blocks, and
preemption and chunking happen on the tight pool.

A stand-in model picks each next token from the request's tokens, so the same request always
generates the same tokens; then a real model through the offline engine on the same kind of
workload, against mlx-lm (vllm.LLM's own run: tests/test_serving_groups.py).
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from paged_prefix.engine import Engine, EngineConfig
from paged_prefix.kv_groups import blocks_held, kv_cache_config, layer_specs
from paged_prefix.models import build_model, hf_config, resolve_config
from paged_prefix.requests import NULL_BLOCK, Limits, plan_step, with_sampled
from reference import key_start

from .mlx_lm_oracle import MlxLmOracle

BS, WINDOW, VOCAB = 16, 40, 512
LAYER_TYPES = ["sliding_attention"] * 5 + ["full_attention"]  # one group a layer: six groups


def next_token(tokens) -> int:
    return (sum(tokens[-3:]) * 31 + len(tokens)) % (VOCAB - 3) + 3


class Driver:
    """vLLM's scheduler and the runner's request state, stepped together."""

    def __init__(self, longest: int, spare_blocks: int, budget: int, max_seqs: int = 6):
        """A pool with room for a request of `longest` tokens alone and `spare_blocks` more:
        the others wait, are preempted, or take freed blocks."""
        config = resolve_config("llama-test", num_hidden_layers=6, layer_types=LAYER_TYPES,
                                sliding_window=WINDOW)
        self._folder = tempfile.TemporaryDirectory(prefix="paged_prefix_")
        vllm_config = VllmConfig(
            model_config=ModelConfig(model=str(hf_config(config, Path(self._folder.name))),
                                     skip_tokenizer_init=True, dtype="float32",
                                     max_model_len=1024),
            cache_config=CacheConfig(block_size=BS, enable_prefix_caching=True),
            scheduler_config=SchedulerConfig(max_num_seqs=max_seqs,
                                             max_num_batched_tokens=budget, max_model_len=1024,
                                             is_encoder_decoder=False,
                                             enable_chunked_prefill=True))
        windows = [WINDOW if t == "sliding_attention" else None for t in LAYER_TYPES]
        specs = layer_specs(windows, BS, 2, 64, torch.float32)
        num_blocks = 1 + spare_blocks + sum(  # the null block, and what vLLM admits on
            blocks_held(spec, longest, vllm_config.max_in_flight_tokens)
            for spec in specs.values())
        kv_config = kv_cache_config(vllm_config, specs, num_blocks)
        vllm_config.cache_config.num_gpu_blocks = num_blocks
        self.scheduler = Scheduler(vllm_config=vllm_config, kv_cache_config=kv_config,
                                   structured_output_manager=StructuredOutputManager(vllm_config),
                                   block_size=BS, log_stats=True)
        self.windows = tuple(getattr(g.kv_cache_spec, "sliding_window", None)
                             for g in kv_config.kv_cache_groups)
        self.limits = Limits(VOCAB, BS, num_blocks, max_seqs, self.windows)
        init_none_hash(sha256)
        self._hasher = get_request_block_hasher(BS, sha256)
        self.live, self.outputs = {}, {}
        self.seen = dict(hits=0, null_in_new=0, reused=0, preempted=0, steps=0)
        self._freed: dict[int, str] = {}  # block -> the running request vLLM freed it from

    def add(self, req_id: str, prompt: list[int], max_tokens: int) -> None:
        self.outputs[req_id] = []
        self.scheduler.add_request(Request(
            request_id=req_id, prompt_token_ids=prompt, pooling_params=None,
            sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                           temperature=0.0), block_hasher=self._hasher))

    def step(self) -> None:
        so = self.scheduler.schedule()
        for new in so.scheduled_new_reqs:
            self.seen["hits"] += new.num_computed_tokens > 0
            self.seen["null_in_new"] += any(NULL_BLOCK in ids for ids in new.block_ids)
        self.seen["preempted"] += len(so.preempted_req_ids or ())
        plan = plan_step(self.live, so, self.limits)  # raises on anything it refuses
        if plan.meta is not None:
            self._note_reuse(plan)
        sampled = {r: next_token(plan.requests[r].token_ids)
                   for r in (plan.meta.sample_req_ids if plan.meta else ())}
        self.live = with_sampled(plan.requests, sampled)
        out = ModelRunnerOutput(req_ids=plan.req_ids,
                                req_id_to_index={r: i for i, r in enumerate(plan.req_ids)},
                                sampled_token_ids=[[sampled[r]] if r in sampled else []
                                                   for r in plan.req_ids])
        for core_outputs in self.scheduler.update_from_output(so, out).values():
            for o in core_outputs.outputs:
                self.outputs[o.request_id].extend(o.new_token_ids)
        self._check_nulls_only_behind_the_window()
        self.seen["steps"] += 1

    def _note_reuse(self, plan) -> None:
        """Count writes by one request into a block vLLM freed from another that still runs
        (in this forward or not)."""
        cu = plan.meta.groups[0].attn.cu_seqlens_q_host
        for g in plan.meta.groups:
            for s, req_id in enumerate(plan.meta.req_ids):
                for block in np.unique(g.slot_mapping_host[cu[s]:cu[s + 1]] // BS).tolist():
                    owner = self._freed.get(block)
                    if owner not in (None, req_id) and owner in plan.requests and \
                            any(plan.requests[owner].block_ids):  # running, not preempted
                        self.seen["reused"] += 1

    def _check_nulls_only_behind_the_window(self) -> None:
        """vLLM's own lists: a windowed group's null entries lie wholly before the first key the
        request's next query sees; a full group has none."""
        manager = self.scheduler.kv_cache_manager
        for req_id, state in self.live.items():
            if not any(state.block_ids) or req_id not in self.scheduler.requests:
                continue
            vllm_ids = manager.get_block_ids(req_id)
            for ids, ours, window in zip(vllm_ids, state.block_ids, self.windows):
                nulls = [i for i, b in enumerate(ids) if b == NULL_BLOCK]
                first = int(key_start(state.num_computed, window)) // BS
                assert all(i < first for i in nulls), (req_id, window, ids, state.num_computed)
                for i in nulls:
                    if ours[i] != NULL_BLOCK:
                        self._freed[ours[i]] = req_id

    def run(self) -> None:
        while self.scheduler.has_unfinished_requests():
            self.step()
            assert self.seen["steps"] < 5000


def expected(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]


@pytest.mark.parametrize("seed", range(4))
def test_the_hybrid_managers_steps_pass_the_runners_checks(seed):
    """Shared prefixes longer than the window, prompts past it, a pool too small for them all
    and a token budget that chunks every prompt."""
    rng = np.random.default_rng(seed)
    prompts = {}
    for g in range(3):
        prefix = rng.integers(3, VOCAB, int(rng.integers(50, 120))).tolist()
        for i in range(int(rng.integers(2, 4))):
            prompts[f"g{g}_{i}"] = prefix + rng.integers(3, VOCAB, int(rng.integers(1, 40))).tolist()
    max_tokens, budget = int(rng.integers(20, 60)), int(rng.choice([24, 40, 64]))
    longest = max(map(len, prompts.values())) + max_tokens
    driver = Driver(longest, int(rng.integers(2, 16)), budget)
    first, *rest = prompts
    driver.add(first, prompts[first], max_tokens)
    driver.run()  # alone first: the others hit its blocks
    for req_id in rest:
        driver.add(req_id, prompts[req_id], max_tokens)
    driver.run()
    assert all(driver.outputs[r] == expected(p, max_tokens) for r, p in prompts.items())
    seen = driver.seen
    assert seen["hits"] > 0 and seen["null_in_new"] > 0, seen
    assert seen["preempted"] + seen["reused"] > 0, seen
    print(f"seed {seed}: {seen}")


def test_freed_blocks_go_to_other_requests_while_their_owner_runs():
    """A long request decodes past its window; vLLM frees its window's old blocks and hands them
    to requests that arrive later, while it still runs."""
    driver = Driver(220, spare_blocks=0, budget=64)
    rng = np.random.default_rng(7)
    long = rng.integers(3, VOCAB, 100).tolist()
    driver.add("long", long, 120)
    for _ in range(12):
        driver.step()
    others = {f"o{i}": rng.integers(3, VOCAB, 20).tolist() for i in range(3)}
    for req_id, prompt in others.items():
        driver.add(req_id, prompt, 6)
    driver.run()
    assert driver.seen["reused"] > 0 and driver.seen["preempted"] == 0, driver.seen
    assert driver.outputs["long"] == expected(long, 120)
    assert all(driver.outputs[r] == expected(p, 6) for r, p in others.items())


GROUPED = resolve_config("llama-test", num_hidden_layers=6, layer_types=LAYER_TYPES,
                         sliding_window=WINDOW)


@pytest.mark.parametrize("seed", range(3))
def test_the_runners_tokens_equal_mlx_lm_on_tight_pools(seed):
    """The same workloads through the offline engine (vLLM's asynchronous scheduling) and the
    paged runner on a real model of those six groups (all six layers in one array pair): every
    request's greedy tokens equal mlx-lm's own generation with its caches (rotating ones for
    the sliding layers). The pool is one request's blocks (null block included) and a few."""
    rng = np.random.default_rng(50 + seed)
    prompts = {}
    for g in range(2):
        prefix = rng.integers(3, VOCAB, int(rng.integers(50, 90))).tolist()
        for i in range(3):
            prompts[f"g{g}_{i}"] = prefix + rng.integers(3, VOCAB, int(rng.integers(1, 30))).tolist()
    max_tokens, budget = 24, int(rng.choice([16, 32]))
    config = EngineConfig(model=GROUPED, num_blocks=1024, max_model_len=512,
                          max_num_batched_tokens=budget, max_num_seqs=4, async_scheduling=True)
    need = 1 + Engine(config).blocks_held(max(map(len, prompts.values())) + max_tokens)
    engine = Engine(dataclasses.replace(config, num_blocks=need + int(rng.integers(2, 12))))
    assert engine.runner.runner.kv_cache.layout.num_arrays == 1
    first, *rest = prompts
    engine.add_request(first, prompts[first], max_tokens)
    engine.run_to_completion()
    for req_id in rest:
        engine.add_request(req_id, prompts[req_id], max_tokens)
    engine.run_to_completion()
    oracle = MlxLmOracle(build_model(GROUPED, mx.float32, engine.config.seed), GROUPED)
    for req_id, prompt in prompts.items():
        assert engine.results[req_id].output_ids == oracle.greedy(prompt, max_tokens)[1], req_id
    assert sum(r.cached_tokens for r in engine.results.values()) > 0
    assert engine.num_partial_prefills > 0 and engine.num_preempted > 0
    print(f"seed {seed}: {engine.config.num_blocks} blocks, {engine.num_preempted} preemptions, "
          f"{sum(r.cached_tokens for r in engine.results.values())} tokens hit")
