"""Runs `vllm.LLM` through the paged_prefix plugin with prompt logprobs; prints JSON results.

    python tests/prompt_logprobs_driver.py MODEL_DIR

A process of its own, as `serving_llm_driver.py` (vLLM fixes its platform once per process).
Prefix caching on, asynchronous scheduling (vLLM's default), a 64-token step budget: a long
prompt is computed over several steps. In order: the long prompt without prompt logprobs (its
blocks are cached), with them (vLLM reads no cache for it), without again (a hit); then the
long prompt with them beside two short requests that decode while it is prefilled (after a
request that asks for them and to read the cache, refused). The
runner's debug lines say which steps held decode rows and scored prompt rows together.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys

LONG = ("The lighthouse keeper on the northern island kept a journal of every ship that passed, "
        "the weather of each morning, the colour of the sea at dusk and the birds that rested "
        "on the gallery rail. Over forty years the journal filled eleven notebooks, and when the "
        "light was automated the notebooks went to the museum in the harbour town, where a "
        "historian read them all and found, hidden between the tide tables, the story of a "
        "winter storm that no official record mentions: three fishing boats, a broken radio, "
        "and a keeper who rowed out alone at midnight with a lantern tied to his mast. ") * 2
SHORT = ("The capital of France is", "A good name for a cat is")
PROMPT_LOGPROBS = 5
MAX_TOKENS = 4
BUDGET = 64  # max_num_batched_tokens


class StepLog(logging.Handler):
    """The runner's debug lines: a forward's shape, then (when it scored any) its prompt rows."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def mixed_steps(lines: list[str]) -> int:
    """Forwards with at least one one-token (decode) row whose prompt rows were scored."""
    count = 0
    for line, following in zip(lines, lines[1:]):
        decode = re.match(r"step: \d+ sequences \((\d+) of one token\)", line)
        scored = re.match(r"step: prompt logprobs of (\d+) rows", following)
        count += bool(decode and scored and int(decode[1]) > 0 and int(scored[1]) > 0)
    return count


def prompt_logprobs(output) -> list[dict] | None:
    """Per prompt position after the first: the actual token, its rank and every logprob."""
    if output.prompt_logprobs is None:
        return None
    assert output.prompt_logprobs[0] is None
    return [{"token": token, "rank": position[token].rank,
             "logprobs": {str(t): lp.logprob for t, lp in position.items()}}
            for token, position in zip(output.prompt_token_ids[1:], output.prompt_logprobs[1:])]


def result(output) -> dict:
    return {"prompt_token_ids": list(output.prompt_token_ids),
            "token_ids": list(output.outputs[0].token_ids),
            "num_cached_tokens": output.num_cached_tokens,
            "prompt_logprobs": prompt_logprobs(output)}


def main(model: str) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.exceptions import VLLMValidationError

    llm = LLM(model=model, enable_prefix_caching=True, max_model_len=512, max_num_seqs=4,
              max_num_batched_tokens=BUDGET, kv_cache_memory_bytes=64 << 20, seed=0)
    log = StepLog()
    runner_log = logging.getLogger("paged_prefix.vllm_runner")
    runner_log.setLevel(logging.DEBUG)
    runner_log.addHandler(log)
    runner_log.propagate = False
    plain = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    scored = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            prompt_logprobs=PROMPT_LOGPROBS)
    cached = [result(llm.generate([LONG], params, use_tqdm=False)[0])
              for params in (plain, scored, plain)]
    try:  # told to read the cache, it would hit LONG's blocks: refused before it is queued
        llm.generate([LONG], SamplingParams(max_tokens=1, prompt_logprobs=PROMPT_LOGPROBS,
                                            skip_reading_prefix_cache=False), use_tqdm=False)
        refused = None
    except VLLMValidationError as error:  # the platform's, as vLLM's frontend raises its own
        refused = str(error)
    alone = len(log.lines)
    mixed = [result(o) for o in llm.generate([*SHORT, LONG], [plain, plain, scored],
                                             use_tqdm=False)]
    llm.llm_engine.engine_core.shutdown()
    print("RESULT " + json.dumps({"cached": cached, "refused": refused, "mixed": mixed,
                                 "mixed_steps": mixed_steps(log.lines[alone:])}))


if __name__ == "__main__":
    main(*sys.argv[1:])
