"""Runs `vllm.LLM` through the paged_prefix plugin on token-id prompts; prints JSON results.

    python tests/serving_architectures_driver.py MODEL_DIR [MODEL_DIR ...]

The pattern of `serving_llm_driver.py` for folders with no tokenizer (`models.write_folder`),
in a process of its own (vLLM fixes its platform once per process); the engine runs in this
process with a small KV budget, one engine after another: each folder with prefix caching off,
then on. Two greedy passes over prompts that share a PREFIX_LEN-token prefix, longer than the
test models' windows (the second pass hits what the first cached), then one long prompt that
the token budget chunks.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

PREFIX_LEN, SUFFIX_LEN, LONG_LEN, GREEDY_TOKENS = 53, 11, 300, 6


def prompts(vocab_size: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    prefix = rng.integers(3, vocab_size, PREFIX_LEN).tolist()
    return [prefix + rng.integers(3, vocab_size, SUFFIX_LEN).tolist() for _ in range(3)]


def long_prompt(vocab_size: int) -> list[int]:
    return np.random.default_rng(1).integers(3, vocab_size, LONG_LEN).tolist()


def serve(model: str, caching: str) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, skip_tokenizer_init=True, enable_prefix_caching=caching == "on",
              max_model_len=512, max_num_seqs=4, max_num_batched_tokens=128,
              kv_cache_memory_bytes=16 << 20, seed=0)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    # ignore_eos: every position is compared; no tokenizer, so nothing is detokenized
    greedy = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True,
                            detokenize=False)
    runs = []
    for batch in (prompts(vocab), prompts(vocab), [long_prompt(vocab)]):
        outputs = llm.generate([{"prompt_token_ids": p} for p in batch], greedy, use_tqdm=False)
        runs.append([{"prompt_token_ids": list(o.prompt_token_ids),
                      "token_ids": list(o.outputs[0].token_ids),
                      "num_cached_tokens": o.num_cached_tokens} for o in outputs])
    llm.llm_engine.engine_core.shutdown()
    return {"passes": runs}


def main(*models: str) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    results = {model: {caching: serve(model, caching) for caching in ("off", "on")}
               for model in models}
    print("RESULT " + json.dumps(results))


if __name__ == "__main__":
    main(*sys.argv[1:])
