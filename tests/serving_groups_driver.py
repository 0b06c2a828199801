"""Runs `vllm.LLM` through the plugin on a model with sliding-window and full layers, its KV-cache
groups on a tight pool; prints JSON results.

    python tests/serving_groups_driver.py MODEL_DIR {on|off} KV_CACHE_BYTES

A process of its own (vLLM fixes its platform once per process), the engine in it
(VLLM_ENABLE_V1_MULTIPROCESSING=0), asynchronous scheduling with caching on and synchronous
with it off. Three greedy passes: one long prompt alone (vLLM frees its
blocks behind the window as it goes), prompts that share a prefix longer than the window, and
the same prompts again all at once (hits; on the tight pool, preemption). What vLLM's scheduler
did is recorded beside the tokens: its groups, the null blocks it sent new requests, the
requests whose windows it freed, its preemptions.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter

import numpy as np

PREFIX_LEN, SUFFIX_LEN, LONG_LEN, GREEDY_TOKENS, NUM_SHARED = 90, 25, 400, 48, 4
NULL_BLOCK = 0


def prompts(vocab_size: int) -> tuple[list[int], list[list[int]]]:
    rng = np.random.default_rng(0)
    long = rng.integers(3, vocab_size, LONG_LEN).tolist()
    prefix = rng.integers(3, vocab_size, PREFIX_LEN).tolist()
    return long, [prefix + rng.integers(3, vocab_size, SUFFIX_LEN).tolist()
                  for _ in range(NUM_SHARED)]


def record(scheduler, seen: Counter) -> None:
    """Count, after each of vLLM's schedule() calls, what its KV-cache manager did."""
    schedule = scheduler.schedule
    manager = scheduler.kv_cache_manager

    def recorded(*args, **kwargs):
        so = schedule(*args, **kwargs)
        seen["preempted"] += len(so.preempted_req_ids or ())
        seen["null_in_new"] += sum(NULL_BLOCK in ids for new in so.scheduled_new_reqs
                                   for ids in new.block_ids)
        seen["freed_windows"] += sum(NULL_BLOCK in ids for r in scheduler.running
                                     for ids in manager.get_block_ids(r.request_id))
        return so
    scheduler.schedule = recorded


def main(model: str, caching: str, kv_bytes: str) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, skip_tokenizer_init=True, enable_prefix_caching=caching == "on",
              max_model_len=512, max_num_seqs=NUM_SHARED, max_num_batched_tokens=64,
              kv_cache_memory_bytes=int(kv_bytes), async_scheduling=caching == "on", seed=0)
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    seen = Counter()
    record(scheduler, seen)
    long, shared = prompts(llm.llm_engine.model_config.get_vocab_size())
    greedy = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True,
                            detokenize=False)
    passes = []
    for batch in ([long], shared[:1], shared):
        outputs = llm.generate([{"prompt_token_ids": p} for p in batch], greedy, use_tqdm=False)
        passes.append([{"prompt_token_ids": list(o.prompt_token_ids),
                        "token_ids": list(o.outputs[0].token_ids),
                        "num_cached_tokens": o.num_cached_tokens} for o in outputs])
    groups = [type(g.kv_cache_spec).__name__ for g in scheduler.kv_cache_config.kv_cache_groups]
    num_blocks = scheduler.kv_cache_config.num_blocks
    llm.llm_engine.engine_core.shutdown()
    print("RESULT " + json.dumps({"passes": passes, "groups": groups, "num_blocks": num_blocks,
                                 "seen": seen}))


if __name__ == "__main__":
    main(*sys.argv[1:])
