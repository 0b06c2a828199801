"""Prompt logprobs through `vllm.LLM` and the plugin on the real SmolLM2-135M-Instruct, against
log_softmax of mlx-lm's own logits over the same prompt, position by position.

vLLM runs in a child process (`prompt_logprobs_driver.py`): prefix caching on, asynchronous
scheduling, a 64-token step budget, so the 237-token prompt is computed in four chunks.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from bench.vllm_server import child_env

from .prompt_logprobs_driver import BUDGET, MAX_TOKENS, PROMPT_LOGPROBS
from .serving_support import smollm2

DRIVER = Path(__file__).with_name("prompt_logprobs_driver.py")
# The runner's packed, fused float32 matmuls reach OpenBLAS in other shapes than mlx-lm's, and
# its attention is computed chunk by chunk over the paged cache: measured up to 2.6e-4 apart in
# log-probability (test_serving_llm.py's 1e-3 for sampled logprobs holds these too).
LOGPROB_ATOL = 1e-3


def assert_prompt_logprobs(rows: list[dict], expected: np.ndarray) -> None:
    """Each position's logprobs (the prompt token's, then the top N) against the oracle's
    log_softmax `expected` [P, vocab] (row i scores prompt token i + 1): every value, the top
    N by value (whatever ties reorder) and the token's rank, all within LOGPROB_ATOL."""
    assert len(rows) == len(expected) - 1
    for i, row in enumerate(rows):
        ids = [int(t) for t in row["logprobs"]]
        assert row["token"] in ids and len(ids) in (PROMPT_LOGPROBS, PROMPT_LOGPROBS + 1)
        np.testing.assert_allclose([row["logprobs"][str(t)] for t in ids], expected[i, ids],
                                   atol=LOGPROB_ATOL, rtol=0)
        top = [t for t in ids if t != row["token"]] if len(ids) > PROMPT_LOGPROBS else ids
        np.testing.assert_allclose(sorted((row["logprobs"][str(t)] for t in top), reverse=True),
                                   np.sort(expected[i])[::-1][:PROMPT_LOGPROBS],
                                   atol=LOGPROB_ATOL, rtol=0)
        target = expected[i, row["token"]]
        assert 1 + (expected[i] > target + 2 * LOGPROB_ATOL).sum() <= row["rank"]
        assert row["rank"] <= (expected[i] >= target - 2 * LOGPROB_ATOL).sum()


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return smollm2()


@pytest.fixture(scope="module")
def run(model_dir) -> dict:
    proc = subprocess.run([sys.executable, str(DRIVER), str(model_dir)], env=child_env(),
                          capture_output=True, text=True, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, \
        f"driver failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    assert "Traceback" not in proc.stderr, f"driver logged an error:\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def mlx_lm_logprobs(model, prompt: list[int]) -> np.ndarray:
    """mlx-lm's model over the whole prompt in one call: float32 logits, log_softmax."""
    logits = model(mx.array([prompt]))[0].astype(mx.float32)
    return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))


@pytest.fixture(scope="module")
def expected(model_dir, run) -> np.ndarray:
    from mlx_lm import load

    return mlx_lm_logprobs(load(str(model_dir))[0], run["cached"][0]["prompt_token_ids"])


def test_a_chunked_prompts_logprobs_match_mlx_lm_at_every_position(run, expected):
    first, scored, last = run["cached"]
    assert len(first["prompt_token_ids"]) > 3 * BUDGET  # computed over four steps or more
    assert first["prompt_logprobs"] is None and last["prompt_logprobs"] is None
    assert_prompt_logprobs(scored["prompt_logprobs"], expected)
    assert scored["token_ids"] == first["token_ids"] and len(first["token_ids"]) == MAX_TOKENS


def test_prefix_cache_is_skipped_for_prompt_logprobs_and_only_for_them(run):
    """The first run cached the prompt's blocks: the scored run reads none of them (every
    position computed), the plain one after it does."""
    first, scored, last = run["cached"]
    assert first["num_cached_tokens"] == 0 and scored["num_cached_tokens"] == 0
    assert last["num_cached_tokens"] >= len(last["prompt_token_ids"]) - 16


def test_a_request_for_prompt_logprobs_that_would_read_the_cache_is_refused_at_admission(run):
    """`skip_reading_prefix_cache=False` would let it start past cached tokens it must score:
    refused naming the field before it is queued (the runner refusing it mid-step killed the
    engine); the requests after it run (the test below)."""
    assert run["refused"] is not None and "skip_reading_prefix_cache" in run["refused"]


def test_prompt_logprobs_beside_decoding_requests(run, expected):
    """Two short requests decode in the same steps as the long one's prompt rows are scored:
    its rows still match, its tokens are those it generated alone, the short ones' are all
    there."""
    assert run["mixed_steps"] >= 1
    *short, long = run["mixed"]
    assert_prompt_logprobs(long["prompt_logprobs"], expected)
    assert all(r["prompt_logprobs"] is None and len(r["token_ids"]) == MAX_TOKENS for r in short)
    assert long["token_ids"] == run["cached"][0]["token_ids"]
