"""Runs `vllm.LLM` through the paged_prefix plugin on hybrid models' token-id prompts; prints
JSON results.

    python tests/serving_hybrid_driver.py MODEL_DIR [MODEL_DIR ...]

The pattern of `serving_architectures_driver.py`: a process of its own, the engine in it, one
engine after another per folder. Each folder runs in four settings (`SETTINGS`): prefix caching
off; on; on with a token budget below the state block (vLLM then advances chunks inside a
block); on with a pool too small for the batch (vLLM preempts and resumes). Each setting runs
three batches: prompts sharing a prefix of PREFIX_LEN tokens and one sharing ONE_BLOCK_LEN; the
same again (the second pass hits what the first cached); and a long prompt beside short ones,
whose decode rows run in the long one's prefill steps. Every step's shape is recorded from the
scheduler output the runner receives (resumed requests, decode rows beside prefills).
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

PREFIX_LEN, ONE_BLOCK_LEN, SUFFIX_LEN, LONG_LEN, GREEDY_TOKENS = 70, 40, 11, 300, 6
# name -> LLM arguments beyond the common ones
SETTINGS = {
    "off": dict(enable_prefix_caching=False),
    "on": dict(enable_prefix_caching=True),
    "small-budget": dict(enable_prefix_caching=True, max_num_batched_tokens=24),
    # a pool of TIGHT_SPARE blocks beyond one longest request's (`tight_pool`)
    "tight-pool": dict(enable_prefix_caching=True, max_model_len=352),
}
TIGHT_SPARE = 2
TIGHT_TOKENS = 40  # the tight pool's requests generate longer, so they outgrow it


def prompts(vocab_size: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    prefix = rng.integers(3, vocab_size, PREFIX_LEN).tolist()
    shared = [prefix + rng.integers(3, vocab_size, SUFFIX_LEN).tolist() for _ in range(2)]
    return shared + [prefix[:ONE_BLOCK_LEN] + rng.integers(3, vocab_size, 30).tolist()]


def long_batch(vocab_size: int) -> list[list[int]]:
    rng = np.random.default_rng(1)
    return [rng.integers(3, vocab_size, LONG_LEN).tolist(),
            *(rng.integers(3, vocab_size, 20).tolist() for _ in range(2))]


def tight_pool(block_size: int, max_model_len: int, num_state_groups: int) -> int:
    """Blocks for one request of max_model_len (its attention blocks, and at most two state
    blocks per state group held at once in align mode) and TIGHT_SPARE more."""
    return -(-max_model_len // block_size) + 2 * num_state_groups + TIGHT_SPARE


class StepLog:
    """What each step's scheduler output held: resumed and preempted requests, steps with
    decode rows beside a prefill, prefill chunks ending inside a state block; recorded where
    the runner plans the step."""

    def __init__(self):
        self.resumed, self.mixed_steps, self.preempted, self.mid_block_chunks = 0, 0, 0, 0

    def install(self):
        from paged_prefix import vllm_runner

        plan_step = vllm_runner.plan_step

        def recording(live, so, limits, ledger=None):
            counts = list(so.num_scheduled_tokens.values())
            self.resumed += len(so.scheduled_cached_reqs.resumed_req_ids)
            self.preempted += len(so.preempted_req_ids or ())
            self.mixed_steps += int(1 in counts and max(counts) > 1)
            block = limits.hybrid.groups.state_block_size
            cached = so.scheduled_cached_reqs
            ends = {r.req_id: (r.num_computed_tokens, len(r.prompt_token_ids))
                    for r in so.scheduled_new_reqs}
            ends.update({r: (cached.num_computed_tokens[i], len(live[r].prompt_token_ids))
                         for i, r in enumerate(cached.req_ids) if r in live})
            for r, (computed, prompt) in ends.items():
                end = computed + so.num_scheduled_tokens[r]
                self.mid_block_chunks += int(end < prompt and end % block != 0)
            return plan_step(live, so, limits, ledger)
        vllm_runner.plan_step = recording
        return self


def serve(model: str, setting: str, log: StepLog) -> dict:
    from vllm import LLM, SamplingParams

    args = {**dict(max_model_len=512, max_num_seqs=4, max_num_batched_tokens=128,
                   kv_cache_memory_bytes=16 << 20), **SETTINGS[setting]}
    if setting == "tight-pool":
        block_size, num_state_groups = log.geometry
        args["num_gpu_blocks_override"] = tight_pool(block_size, args["max_model_len"],
                                                     num_state_groups)
    llm = LLM(model=model, skip_tokenizer_init=True, seed=0, **args)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    tokens = TIGHT_TOKENS if setting == "tight-pool" else GREEDY_TOKENS
    greedy = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True,
                            detokenize=False)
    before = vars(log).copy()
    runs = []
    for batch in (prompts(vocab), prompts(vocab), long_batch(vocab)):
        outputs = llm.generate([{"prompt_token_ids": p} for p in batch], greedy, use_tqdm=False)
        runs.append([{"prompt_token_ids": list(o.prompt_token_ids),
                      "token_ids": list(o.outputs[0].token_ids),
                      "num_cached_tokens": o.num_cached_tokens} for o in outputs])
    config = llm.llm_engine.vllm_config.cache_config
    blocks = {"block_size": config.block_size, "mamba_block_size": config.mamba_block_size,
              "num_gpu_blocks": config.num_gpu_blocks}
    groups = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config.kv_cache_groups
    log.geometry = (config.block_size, len(groups) - 1)  # one attention group, the rest state
    llm.llm_engine.engine_core.shutdown()
    steps = {k: v - before[k] for k, v in vars(log).items() if k != "geometry"}
    return {"passes": runs, "steps": steps, "cache": blocks}


def main(*models: str) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    log = StepLog().install()
    results = {model: {s: serve(model, s, log) for s in SETTINGS} for model in models}
    print("RESULT " + json.dumps(results))


if __name__ == "__main__":
    main(*sys.argv[1:])
