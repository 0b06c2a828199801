"""Engine calls the worker cannot honour, through `vllm.LLM` and the plugin; prints what happened.

    python tests/engine_calls_driver.py MODEL_DIR window|sleep

A process of its own, as `serving_llm_driver.py` (vLLM fixes its platform once per process).
`window`: start with `disable_sliding_window` and a max_model_len past the model's window
(the caller sets VLLM_ALLOW_LONG_MAX_MODEL_LEN=1): startup must fail. `sleep`: greedy tokens,
then the encoder-cache reset vLLM asks for when it clears its caches, then `sleep(level=1)`
(printed as REFUSED with its message), `wake_up()`, and the same prompt again (SAME or
DIFFERENT).
"""

from __future__ import annotations

import os
import sys


def main(model: str, case: str) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    args = dict(model=model, skip_tokenizer_init=True, kv_cache_memory_bytes=16 << 20, seed=0)
    if case == "window":
        LLM(**args, disable_sliding_window=True, max_model_len=64)
        sys.exit("started")
    llm = LLM(**args, max_model_len=64)
    prompt = [{"prompt_token_ids": list(range(3, 40))}]
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    before = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
    llm.llm_engine.reset_encoder_cache()
    try:
        llm.sleep(level=1)
        sys.exit("slept")
    except ValueError as error:
        print("REFUSED", error)
    llm.wake_up()
    after = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
    print("SAME" if list(before) == list(after) else f"DIFFERENT {before} {after}")


if __name__ == "__main__":
    main(*sys.argv[1:])
