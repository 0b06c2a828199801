"""`vllm.LLM` through the plugin on the real SmolLM2-135M-Instruct, against mlx-lm itself.

Greedy tokens are identical with prefix caching off and on, on a second pass that hits the
first pass's blocks, and to mlx-lm's own generation with its contiguous prompt cache;
logprobs equal log_softmax of mlx-lm's logits; seeded sampling repeats for a seed and
differs across seeds. vLLM runs in child processes (`serving_llm_driver.py`): caching off
with synchronous scheduling, caching on with asynchronous scheduling (vLLM's default), and
that again with every greedy step sent to the device from the runner's launch thread
(PAGED_PREFIX_LAUNCH_THREAD=1).
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

from .serving_llm_driver import GREEDY_TOKENS, SEEDS
from .serving_support import smollm2

DRIVER = Path(__file__).with_name("serving_llm_driver.py")
LOGPROB_ATOL = 1e-3


SETTINGS = {"off": "sync", "on": "async"}  # prefix caching -> scheduling


def run_driver(model: Path, caching: str, **env: str) -> dict:
    proc = subprocess.run([sys.executable, str(DRIVER), str(model), caching, SETTINGS[caching]],
                          env={**child_env(), **env}, capture_output=True, text=True,
                          timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"driver failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    assert "Traceback" not in proc.stderr, f"driver logged an error:\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return smollm2()


@pytest.fixture(scope="module")
def runs(model_dir) -> dict:
    runs = {caching: run_driver(model_dir, caching) for caching in SETTINGS}
    assert [runs[c]["async_scheduling"] for c in SETTINGS] == [False, True]
    return runs


@pytest.fixture(scope="module")
def mlx_lm_greedy(model_dir, runs) -> list[dict]:
    """mlx-lm's model with its own prompt cache: greedy tokens and float32 log_softmax."""
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    model, _ = load(str(model_dir))
    out = []
    for request in runs["off"]["passes"][0]:
        cache = make_prompt_cache(model)
        logits = model(mx.array([request["prompt_token_ids"]]), cache=cache)[0, -1]
        tokens, logprobs = [], []
        for _ in range(GREEDY_TOKENS):
            logits = logits.astype(mx.float32)
            logprobs.append(np.array(logits - mx.logsumexp(logits)))
            tokens.append(int(mx.argmax(logits).item()))
            logits = model(mx.array([[tokens[-1]]]), cache=cache)[0, -1]
        out.append({"token_ids": tokens, "logprobs": logprobs})
    return out


@pytest.fixture(scope="module")
def threaded(model_dir) -> dict:
    return run_driver(model_dir, "on", PAGED_PREFIX_LAUNCH_THREAD="1")


def test_steps_sent_from_the_launch_thread_give_the_same_tokens(runs, threaded):
    """Every step sampled on the device goes out from the launch thread (launch.py), the
    others from the engine's; every pass gives the tokens of the run without it, which the
    tests below hold to mlx-lm's."""
    assert threaded["launched_in_thread"] == threaded["steps_sampled_on_device"] >= GREEDY_TOKENS
    assert runs["on"]["launched_in_thread"] == runs["off"]["launched_in_thread"] == 0
    assert [tokens(threaded, i) for i in (0, 1)] == [tokens(runs["on"], i) for i in (0, 1)]
    assert threaded["on_device"] == runs["on"]["on_device"]
    assert threaded["seeded"] == runs["on"]["seeded"]


def test_greedy_rows_sampled_on_the_device_give_the_samplers_tokens(runs):
    """Greedy requests without logprobs take their argmax on the device (the engine takes
    their tokens later; under asynchronous scheduling it schedules the next step first): the
    same tokens as the greedy passes through vLLM's Sampler (with logprobs), in both settings."""
    for run in runs.values():
        assert run["on_device"] == tokens(run, 0)
        assert run["steps_sampled_on_device"] >= GREEDY_TOKENS


def test_the_worker_bounds_mlxs_buffer_cache_by_one_forwards_activations(runs):
    """The served engine keeps at most the measured activation peak of freed buffers (MLX's
    own limit, 95% of a CUDA device, let the cache grow until long prompts ran out of memory),
    also with --kv-cache-memory-bytes, and its cache was within it when the passes ended."""
    for run in runs.values():
        assert run["mlx_cache_limit"] == run["activation_bytes"] > 0
        assert run["cached_at_end"] <= run["mlx_cache_limit"]


def tokens(run: dict, pass_index: int) -> list[list[int]]:
    return [r["token_ids"] for r in run["passes"][pass_index]]


def test_greedy_tokens_identical_caching_off_on_and_mlx_lm(runs, mlx_lm_greedy):
    reference = [r["token_ids"] for r in mlx_lm_greedy]
    assert tokens(runs["off"], 0) == reference
    assert tokens(runs["off"], 1) == reference
    assert tokens(runs["on"], 0) == reference
    assert tokens(runs["on"], 1) == reference


def test_mlx_lm_generate_agrees(model_dir, runs):
    """mlx-lm's own generation (its default greedy sampler) on the first prompt; it stops at
    the end-of-sequence token, the plugin's run went on (ignore_eos)."""
    from mlx_lm import load, stream_generate

    model, tokenizer = load(str(model_dir))
    first = runs["off"]["passes"][0][0]
    generated = [r.token for r in stream_generate(model, tokenizer, prompt=first["prompt_token_ids"],
                                                   max_tokens=GREEDY_TOKENS)]
    assert generated == first["token_ids"][:len(generated)]
    assert "Paris" in tokenizer.decode(generated)


def test_second_pass_reports_cached_tokens(runs):
    assert all(r["num_cached_tokens"] == 0 for p in runs["off"]["passes"] for r in p)
    second = runs["on"]["passes"][1]
    assert all(r["num_cached_tokens"] > 0 for r in second), [r["num_cached_tokens"] for r in second]
    # whole blocks of the shared prompt, at most all but the last token
    assert all(r["num_cached_tokens"] % 16 == 0 and r["num_cached_tokens"] < len(r["prompt_token_ids"])
               for r in second)


def test_logprobs_match_log_softmax_of_the_logits(runs, mlx_lm_greedy):
    """Against mlx-lm's float32 logits, both on OpenBLAS: the runner's packed rows and fused
    q/k/v and gate/up matmuls reach OpenBLAS in other shapes than mlx-lm's, whose blocking
    sums in another order, and the paged attention rounds its own way: up to 2.6e-4 apart in
    log-probability (measured), hence the tolerance; the tokens are identical (above) and the
    sampler's log_softmax itself is checked exactly in test_serving_sampling.py. A temperature
    of 2 would change these values by half."""
    for run in runs.values():
        for request, reference in zip(run["passes"][0], mlx_lm_greedy):
            assert len(request["logprobs"]) == GREEDY_TOKENS
            for step, expected in zip(request["logprobs"], reference["logprobs"]):
                ids = [int(t) for t in step]
                assert len(ids) >= 3  # top 3, plus the sampled token when it is not among them
                np.testing.assert_allclose([step[str(t)] for t in ids], expected[ids],
                                           atol=LOGPROB_ATOL, rtol=0)
                assert int(np.argmax(expected)) in ids
        hot = run["hot_logprobs"]  # temperature 2, top-p 0.5: still the raw log_softmax
        expected = mlx_lm_greedy[0]["logprobs"][0]
        ids = [int(t) for t in hot]
        np.testing.assert_allclose([hot[str(t)] for t in ids], expected[ids],
                                   atol=LOGPROB_ATOL, rtol=0)


def test_seeded_sampling_reproducible_per_seed_and_differs_across_seeds(runs):
    assert SEEDS[0] == SEEDS[1] != SEEDS[2]
    for run in runs.values():
        same, same_again, other = run["seeded"]
        assert same == same_again
        assert same != other
    assert runs["off"]["seeded"] == runs["on"]["seeded"]
