"""`vllm serve` of gemma3_text and gpt_oss random-weight folders (SmolLM2's tokenizer) with
prefix caching, through the OpenAI completions API: a second pass over prompts that share a
192-token prefix reports those tokens cached and generates the same greedy text, and prompt
logprobs equal `log_softmax` of mlx-lm's own model's logits at every prompt position.
In the serving-architectures session (each server takes a minute or two to start here)."""

import json
import urllib.request

import mlx.core as mx
import numpy as np
import pytest

from tests.serving_support import require_serving, smollm2

PREFIX = " ".join(f"line {i}: the quick brown fox jumps over the lazy dog." for i in range(14))
PROMPTS = [PREFIX + f" Question {q}: what comes next?" for q in range(4)]
# float32 on the CPU; the server's logits and mlx-lm's differ by op order only (measured
# 1.1e-5 and 8.6e-6 at most over 207 positions)
LOGPROB_TOL = 1e-4


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())


@pytest.mark.parametrize("name", ["gemma3-test", "gpt-oss-test"])
def test_served_prefix_caching_and_prompt_logprobs(name, tmp_path_factory):
    require_serving()
    from bench.vllm_server import VllmServer
    from paged_prefix.model_loader import load_model
    from paged_prefix.models import write_folder

    root = tmp_path_factory.mktemp("http")
    folder = write_folder(name, root / name, smollm2(), mx.float32, seed=0)
    args = ["--enable-prefix-caching", "--enable-prompt-tokens-details", "--max-model-len",
            "1024", "--kv-cache-memory-bytes", str(256 << 20), "--dtype", "float32"]
    with VllmServer(folder, args, root / "server.log", served_name=name) as server:
        passes = [[post(server.url, {"model": name, "prompt": p, "max_tokens": 8,
                                     "temperature": 0}) for p in PROMPTS] for _ in range(2)]
        scored = post(server.url, {"model": name, "prompt": PROMPTS[0], "max_tokens": 1,
                                   "temperature": 0, "prompt_logprobs": 1,
                                   "return_token_ids": True})
    cached = [[o["usage"]["prompt_tokens_details"]["cached_tokens"] for o in p] for p in passes]
    assert cached[0][0] == 0 and min(cached[0][1:] + cached[1]) >= 192, cached
    assert [o["choices"][0]["text"] for o in passes[0]] == \
        [o["choices"][0]["text"] for o in passes[1]]
    ids = scored["choices"][0]["prompt_token_ids"]
    logprobs = scored["choices"][0]["prompt_logprobs"]
    assert logprobs[0] is None and len(logprobs) == len(ids)
    logits = load_model(folder, mx.float32)(mx.array([ids]))[0]
    want = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    got = np.array([logprobs[i][str(ids[i])]["logprob"] for i in range(1, len(ids))])
    assert np.abs(got - want[np.arange(len(ids) - 1), ids[1:]]).max() <= LOGPROB_TOL
