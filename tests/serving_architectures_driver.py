"""Runs `vllm.LLM` through the paged_prefix plugin on token-id prompts; prints JSON results.

    python tests/serving_architectures_driver.py MODEL_DIR [MODEL_DIR ...]

The pattern of `serving_llm_driver.py` for folders with no tokenizer (`models.write_folder`),
in a process of its own (vLLM fixes its platform once per process); the engine runs in this
process with a small KV budget, one engine after another: each folder with prefix caching off,
then on. Two greedy passes over prompts that share a PREFIX_LEN-token prefix, longer than the
test models' windows (the second pass hits what the first cached), then one long prompt that
the token budget chunks. A model with a window runs again in blocks of WINDOW_HIT_BLOCK tokens,
which divide its window (20): three primers, each one block longer than a hit of WINDOW_HITS
(vLLM's sliding-window manager gave primers of exactly 16, 20 and 48 tokens hits of 12, 16
and 44), then three prompts that share those first 16, 20 and 48 tokens, so that their hits
end before, at and past the window.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

PREFIX_LEN, SUFFIX_LEN, LONG_LEN, GREEDY_TOKENS = 53, 11, 300, 6
WINDOW_HIT_BLOCK, WINDOW_HITS, WINDOW_PROMPT_LEN = 4, (16, 20, 48), 64


def prompts(vocab_size: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    prefix = rng.integers(3, vocab_size, PREFIX_LEN).tolist()
    return [prefix + rng.integers(3, vocab_size, SUFFIX_LEN).tolist() for _ in range(3)]


def long_prompt(vocab_size: int) -> list[int]:
    return np.random.default_rng(1).integers(3, vocab_size, LONG_LEN).tolist()


def window_hit_prompts(vocab_size: int) -> list[tuple[list[list[int]], int]]:
    """The primers (one token each: no decode step moves their windows), then the prompts
    that hit them."""
    rng = np.random.default_rng(2)
    primers = [rng.integers(3, vocab_size, hit + WINDOW_HIT_BLOCK).tolist() for hit in WINDOW_HITS]
    hitting = [p[:hit] + rng.integers(3, vocab_size, WINDOW_PROMPT_LEN - hit).tolist()
               for p, hit in zip(primers, WINDOW_HITS)]
    return [(primers, 1), (hitting, GREEDY_TOKENS)]


def serve(model: str, caching: str, block_size: int = 16, batches=None) -> dict:
    """`batches(vocab_size)`: the batches of prompts, each with the tokens to generate
    (default: two passes over `prompts`, then the long prompt)."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, skip_tokenizer_init=True, enable_prefix_caching=caching == "on",
              max_model_len=512, max_num_seqs=4, max_num_batched_tokens=128,
              kv_cache_memory_bytes=16 << 20, block_size=block_size, seed=0)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    runs = []
    batches = batches or (lambda v: [(prompts(v), GREEDY_TOKENS), (prompts(v), GREEDY_TOKENS),
                                     ([long_prompt(v)], GREEDY_TOKENS)])
    for batch, max_tokens in batches(vocab):
        # ignore_eos: every position is compared; no tokenizer, so nothing is detokenized
        greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                detokenize=False)
        outputs = llm.generate([{"prompt_token_ids": p} for p in batch], greedy, use_tqdm=False)
        runs.append([{"prompt_token_ids": list(o.prompt_token_ids),
                      "token_ids": list(o.outputs[0].token_ids),
                      "num_cached_tokens": o.num_cached_tokens} for o in outputs])
    llm.llm_engine.engine_core.shutdown()
    return {"passes": runs}


def main(*models: str) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    results = {}
    for model in models:
        results[model] = {caching: serve(model, caching) for caching in ("off", "on")}
        with open(os.path.join(model, "config.json")) as f:
            windowed = json.load(f).get("sliding_window") is not None
        if windowed:
            results[model]["window hits"] = {
                caching: serve(model, caching, WINDOW_HIT_BLOCK, window_hit_prompts)
                for caching in ("off", "on")}
    print("RESULT " + json.dumps(results))


if __name__ == "__main__":
    main(*sys.argv[1:])
