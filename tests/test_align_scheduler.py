"""What vLLM's real v1 Scheduler hands a runner for a hybrid model in mamba_cache_mode "align"
(docs/hybrid.md), pinned: the runner's state handling rests on each of these.

One attention group (0) and one recurrent-state group (1) share one block pool, block size 32,
100 tokens per step. No forward runs: each step samples a token for the requests that reached
their last known token, as a runner would.
"""

import json

import pytest
import torch
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from paged_prefix.models import BUILTIN_CONFIGS

BS, NULL = 32, 0
PROMPT = list(range(3, 153))  # 150 tokens


class Harness:
    def __init__(self, tmp_path, num_blocks=64):
        config = {**BUILTIN_CONFIGS["lfm2-test"], "architectures": ["Lfm2ForCausalLM"],
                  "torch_dtype": "float32"}
        (tmp_path / "config.json").write_text(json.dumps(config))
        self.vllm_config = VllmConfig(
            model_config=ModelConfig(model=str(tmp_path), skip_tokenizer_init=True,
                                     dtype="float32", max_model_len=1024),
            cache_config=CacheConfig(block_size=BS, enable_prefix_caching=True),
            scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=100,
                                             max_model_len=1024, is_encoder_decoder=False,
                                             enable_chunked_prefill=True))
        attention = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=64,
                                      dtype=torch.float32)
        state = MambaSpec(block_size=BS, shapes=((2, 256),), dtypes=(torch.float32,),
                          mamba_cache_mode="align", page_size_padded=attention.page_size_bytes)
        kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                        kv_cache_groups=[KVCacheGroupSpec(["l2"], attention),
                                                         KVCacheGroupSpec(["l0"], state)])
        self.vllm_config.cache_config.num_gpu_blocks = num_blocks
        self.scheduler = Scheduler(
            vllm_config=self.vllm_config, kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(self.vllm_config),
            block_size=BS, log_stats=False)
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(BS, sha256)
        self.rows: dict[str, tuple[list[int], list[int]]] = {}  # the runner's block tables

    def add(self, req_id, prompt, max_tokens=4):
        self.scheduler.add_request(Request(
            request_id=req_id, prompt_token_ids=prompt, pooling_params=None,
            sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            block_hasher=self.hasher))

    def step(self):
        """One schedule and its output; returns {req_id: (computed, scheduled, new ids)}."""
        so = self.scheduler.schedule()
        seen = {}
        for new in so.scheduled_new_reqs:
            self.rows[new.req_id] = tuple(list(ids) for ids in new.block_ids)
            seen[new.req_id] = (new.num_computed_tokens, new.block_ids)
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i] or ([], [])
            for row, ids in zip(self.rows[req_id], new_ids):
                row.extend(ids)
            seen[req_id] = (cached.num_computed_tokens[i], new_ids)
        req_ids = list(so.num_scheduled_tokens)
        reqs = self.scheduler.requests
        sampled = [[7] if reqs[r].num_computed_tokens >= reqs[r].num_tokens else []
                   for r in req_ids]
        self.scheduler.update_from_output(so, ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled))
        return so, {r: (c, so.num_scheduled_tokens[r], ids) for r, (c, ids) in seen.items()}

    def run(self):
        steps = []
        while self.scheduler.has_unfinished_requests():
            steps.append(self.step())
        return steps


@pytest.fixture
def harness(tmp_path):
    return Harness(tmp_path)


def test_prefix_caching_puts_a_hybrid_model_in_align_mode(harness):
    cache = harness.vllm_config.cache_config
    assert (cache.mamba_cache_mode, cache.mamba_block_size) == ("align", BS)


def test_chunks_end_on_block_boundaries_and_only_a_chunks_end_block_holds_state(harness):
    harness.add("a", PROMPT)
    chunks = [(c, c + n) for _, seen in harness.run() for c, n, _ in [seen["a"]] if n > 1]
    # 100 tokens a step, cut to 96; then stopped at the last boundary before the prompt's end
    # (a hit needs the state there); the prompt's last chunk ends where the prompt does.
    assert chunks == [(0, 96), (96, 128), (128, 150)]
    attention, state = harness.rows["a"]
    assert NULL not in attention
    # Block i would hold the state after (i + 1) * 32 tokens: only chunk ends get one.
    assert [i for i, b in enumerate(state) if b != NULL] == [(end - 1) // BS for _, end in chunks]


def test_a_hit_hands_over_the_state_block_of_its_last_hit_block(harness):
    harness.add("a", PROMPT)
    harness.run()
    a_attention, a_state = harness.rows["a"]
    harness.add("b", PROMPT[:140] + list(range(200, 210)))
    (_, seen), *_ = harness.run()
    computed, ids = seen["b"][0], seen["b"][2]
    assert computed == 128  # 140 shared tokens: the last full block whose state is stored
    attention, state = ids
    assert attention[:4] == a_attention[:4]
    assert state[:4] == [NULL, NULL, NULL, a_state[3]] and state[4] not in (NULL, a_state[3])


def test_a_hit_never_reads_a_state_written_in_the_same_forward(harness):
    """Unlike attention blocks (docs/design.md, same-forward hits), vLLM holds back a request
    whose hit ends on a state block another request writes in this step."""
    harness.add("a", PROMPT)
    harness.add("b", PROMPT[:140] + list(range(200, 210)))
    steps = [seen for _, seen in harness.run()]
    wrote_128 = next(i for i, s in enumerate(steps) if "a" in s and sum(s["a"][:2]) == 128)
    first_b = next(i for i, s in enumerate(steps) if "b" in s)
    assert first_b > wrote_128 and steps[first_b]["b"][0] == 128


def test_decode_moves_to_a_new_state_block_when_it_crosses_a_boundary(harness):
    harness.add("d", PROMPT[:30], max_tokens=40)
    steps = [seen["d"] for _, seen in harness.run()]
    grown = [computed for computed, _, (attention, state) in steps[1:] if attention or state]
    # The step that computes token 33 (computed == 32) needs block 1 in both groups.
    assert grown == [32, 64]
    assert all(len(attention) == len(state) == 1
               for _, _, (attention, state) in steps[1:] if attention or state)


def test_only_attention_blocks_are_zeroed(harness):
    """new_block_ids_to_zero lists each step's new attention blocks, never a state block: a
    fresh state slot holds whatever its block held before."""
    harness.add("a", PROMPT)  # no hits: every listed block is new this step
    harness.add("d", PROMPT[:30], max_tokens=40)
    for so, seen in harness.run():
        new = [ids for _, _, ids in seen.values()]
        attention = {b for ids in new for b in ids[0]}
        state = {b for ids in new for b in ids[1]} - {NULL}
        zeroed = set(so.new_block_ids_to_zero or ())
        assert zeroed == attention and not zeroed & state
