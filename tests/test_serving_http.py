"""`vllm serve` with the plugin on the real SmolLM2-135M-Instruct, through real HTTP clients.

One server for the module (prefix caching on, a small KV pool, prompt-token details on).
It answers sensibly (Paris), refuses bad input with a 4xx that names the problem and keeps
serving, a request's cached blocks are not touched by requests running beside it, and prompt
logprobs match mlx-lm's.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from bench.vllm_server import VllmServer

from .serving_support import smollm2
from .test_serving_prompt_logprobs import PROMPT_LOGPROBS, assert_prompt_logprobs, mlx_lm_logprobs

MAX_MODEL_LEN = 512


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    args = ["--enable-prefix-caching", "--max-model-len", str(MAX_MODEL_LEN),
            "--kv-cache-memory-bytes", str(64 << 20), "--max-num-batched-tokens", "256",
            "--enable-prompt-tokens-details", "--seed", "0"]
    with VllmServer(smollm2(), args, tmp_path_factory.mktemp("serve") / "server.log") as running:
        yield running
    # No error in the log, from serving to the engine process's exit, except one of vLLM's:
    # once shutdown has begun, vLLM 0.32's API server may log EngineDeadError from its
    # output handler (the task is cancelled after the engine exits), whatever the platform.
    serving, _, stopping = running.log_path.read_text().partition("shutdown triggered")
    stopping = [line for line in stopping.splitlines()
                if not line.startswith("(APIServer") or "[async_llm.py:" not in line]
    for line in serving.splitlines() + stopping:
        assert "Traceback" not in line and " ERROR " not in line, line


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def complete(client, prompt, **kw):
    kw = {"max_tokens": 6, "temperature": 0.0, **kw}
    return client.completions.create(model="smollm2", prompt=prompt, **kw)


def test_completion_and_streamed_chat_answer_paris(client):
    text = complete(client, "The capital of France is", max_tokens=8).choices[0].text
    assert "Paris" in text, text
    stream = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=16, temperature=0.0, stream=True)
    chunks = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert len(chunks) > 2 and "Paris" in "".join(chunks), chunks


BAD_REQUESTS = {
    # each: (prompt, extra request fields, words the error message must contain)
    "prompt longer than max_model_len": ("hello " * (MAX_MODEL_LEN + 20), {},
                                         ["maximum context length"]),
    "token ids outside the vocabulary": ([1, 2, 49152], {}, ["49152", "vocabulary"]),
    "negative token id": ([1, -5], {}, ["-5"]),
    "prompt logprobs past the vocabulary": ("Hello", {"extra_body": {"prompt_logprobs": 49153}},
                                            ["prompt_logprobs"]),
    "negative prompt logprobs": ("Hello", {"extra_body": {"prompt_logprobs": -2}},
                                 ["prompt_logprobs"]),
    "thinking budget": ("Hello", {"extra_body": {"thinking_token_budget": 4}},
                        ["thinking_token_budget"]),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_input_gets_4xx_naming_the_problem_and_the_server_keeps_serving(client, case):
    import openai

    prompt, fields, words = BAD_REQUESTS[case]
    with pytest.raises(openai.APIStatusError) as error:
        complete(client, prompt, **fields)
    assert 400 <= error.value.status_code < 500, error.value
    message = str(error.value)
    assert all(w in message for w in words), message
    assert "Paris" in complete(client, "The capital of France is", max_tokens=8).choices[0].text


def test_structured_output_follows_the_grammar(client):
    """vLLM's xgrammar backend builds the bitmask; the runner applies it before sampling."""
    choice = complete(client, "Is Paris in France? Answer:", max_tokens=4,
                      extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}})
    assert choice.choices[0].text in ("yes", "no", "maybe"), choice.choices[0].text
    digits = complete(client, "The year the Eiffel Tower opened:", max_tokens=8,
                      extra_body={"structured_outputs": {"regex": "[0-9]{4}"}})
    text = digits.choices[0].text
    assert len(text) == 4 and text.isdigit(), text


def test_requests_beside_it_do_not_write_into_a_requests_cached_blocks(client):
    """A runs alone and caches its prompt's blocks; then requests sharing A's prefix (they read
    those blocks and write their own suffixes), unrelated requests and refused ones run
    together; A's second run reads its prefix from the cache and must give exactly what its
    first run computed from scratch."""
    import openai

    prefix = ("In the quiet town of Riverbend, the annual lantern festival drew visitors from "
              "every valley, and the old bridge keeper told stories of the river spirits. ")
    a_prompt = prefix + "That evening the bridge keeper said"
    first = complete(client, a_prompt, max_tokens=8, logprobs=1)
    assert first.usage.prompt_tokens_details.cached_tokens in (None, 0)

    def neighbour(i: int):
        if i % 4 == 3:  # refused beside the others
            with pytest.raises(openai.APIStatusError):
                complete(client, [5, 6, 49152 + i])
            return None
        prompt = (prefix + f"Visitor number {i} asked about the lanterns and" if i % 4 < 2
                  else f"A recipe for bread number {i}: mix flour, water and")
        return complete(client, prompt, max_tokens=4 + i % 3)

    with ThreadPoolExecutor(8) as pool:
        neighbours = list(pool.map(neighbour, range(8)))
    assert sum(r is not None for r in neighbours) == 6
    second = complete(client, a_prompt, max_tokens=8, logprobs=1)
    assert second.usage.prompt_tokens_details.cached_tokens >= 32
    assert second.choices[0].text == first.choices[0].text
    np.testing.assert_allclose(second.choices[0].logprobs.token_logprobs,
                               first.choices[0].logprobs.token_logprobs, atol=1e-5)


def test_completions_prompt_logprobs_match_mlx_lm_and_skip_the_cache(client):
    """A 300-token prompt (two steps of the server's 256-token budget) run once to cache its
    blocks, then with prompt_logprobs: every position is there (no cached token read), each
    within LOGPROB_ATOL of log_softmax of mlx-lm's logits."""
    from mlx_lm import load

    model, tokenizer = load(str(smollm2()))
    text = " ".join(f"Lantern {i} of the festival was painted with a river spirit."
                    for i in range(40))
    prompt = tokenizer.encode(text)[:300]
    assert len(prompt) == 300
    complete(client, prompt, max_tokens=2)
    scored = complete(client, prompt, max_tokens=2, extra_body={"prompt_logprobs": PROMPT_LOGPROBS})
    assert scored.usage.prompt_tokens_details.cached_tokens in (None, 0)
    positions = scored.choices[0].prompt_logprobs
    assert positions[0] is None and len(positions) == len(prompt)
    rows = [{"token": token, "rank": position[str(token)]["rank"],
             "logprobs": {t: lp["logprob"] for t, lp in position.items()}}
            for token, position in zip(prompt[1:], positions[1:])]
    assert_prompt_logprobs(rows, mlx_lm_logprobs(model, prompt))
    again = complete(client, prompt, max_tokens=2)
    assert again.usage.prompt_tokens_details.cached_tokens >= 288  # the cache was on
