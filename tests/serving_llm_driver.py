"""Runs `vllm.LLM` through the paged_prefix plugin in its own process; prints JSON results.

    python tests/serving_llm_driver.py MODEL_DIR {on|off} {sync|async}

A process of its own: vLLM fixes its platform once per process, and the test process may
already hold another (the offline engine's tests run vLLM's scheduler there). The engine
runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) with synchronous or asynchronous
scheduling (vLLM's default), a small KV budget. Two greedy passes over prompts that share a prefix (the second
hits what the first cached), the same greedy without logprobs (sampled on the device), then
seeded sampling.
"""

from __future__ import annotations

import json
import os
import sys

PREFIX = ("You are a geography tutor. Answer every question with the name of one city and "
          "nothing else, in a single short sentence. ")
QUESTIONS = ("The capital of France is", "The capital of Italy is", "The capital of Japan is")
GREEDY_TOKENS = 8
LOGPROBS = 3
SEEDS = (7, 7, 8)  # the same seed twice, then another


def main(model: str, caching: str, scheduling: str) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, enable_prefix_caching=caching == "on", max_model_len=512,
              max_num_seqs=4, max_num_batched_tokens=256, kv_cache_memory_bytes=64 << 20, seed=0,
              async_scheduling=scheduling == "async")
    prompts = [PREFIX + q for q in QUESTIONS]
    # ignore_eos: every position is compared, also past an end-of-sequence token
    greedy = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, logprobs=LOGPROBS,
                            ignore_eos=True)
    passes = []
    for _ in range(2):
        passes.append([{
            "prompt_token_ids": list(o.prompt_token_ids),
            "token_ids": list(o.outputs[0].token_ids),
            "text": o.outputs[0].text,
            "num_cached_tokens": o.num_cached_tokens,
            "logprobs": [{str(t): lp.logprob for t, lp in step.items()}
                         for step in o.outputs[0].logprobs],
        } for o in llm.generate(prompts, greedy, use_tqdm=False)])
    # the same prompts without logprobs: every row then samples its argmax on the device
    plain = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
    on_device = [list(o.outputs[0].token_ids)
                 for o in llm.generate(prompts, plain, use_tqdm=False)]
    worker = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker
    runner = worker.runner
    seeded = [list(llm.generate([prompts[0]], SamplingParams(
        temperature=0.8, top_p=0.9, max_tokens=GREEDY_TOKENS, seed=seed),
        use_tqdm=False)[0].outputs[0].token_ids) for seed in SEEDS]
    # vLLM returns raw logprobs: log_softmax of the logits before temperature and top-p
    hot = llm.generate([prompts[0]], SamplingParams(temperature=2.0, top_p=0.5, max_tokens=1,
                                                    seed=0, logprobs=LOGPROBS), use_tqdm=False)
    hot_logprobs = {str(t): lp.logprob for t, lp in hot[0].outputs[0].logprobs[0].items()}
    scheduling = llm.llm_engine.vllm_config.scheduler_config.async_scheduling
    import mlx.core as mx

    cached_at_end = mx.get_cache_memory()
    cache_limit = mx.set_cache_limit(0)  # MLX reads its limit back only as the one replaced
    mx.set_cache_limit(cache_limit)
    llm.llm_engine.engine_core.shutdown()
    print("RESULT " + json.dumps({"passes": passes, "seeded": seeded,
                                 "hot_logprobs": hot_logprobs, "async_scheduling": scheduling,
                                 "on_device": on_device,
                                 "steps_sampled_on_device": runner.steps_sampled_on_device,
                                 "launched_in_thread": runner.launcher.launched_in_thread,
                                 "mlx_cache_limit": cache_limit,
                                 "activation_bytes": worker._activation_bytes,
                                 "cached_at_end": cached_at_end}))


if __name__ == "__main__":
    main(*sys.argv[1:])
