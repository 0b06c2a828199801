"""`vllm.LLM` through the plugin on every architecture's random-weight test model.

Greedy tokens are identical with prefix caching off and on, on a second pass that hits the
first pass's blocks (a shared prefix longer than the models' 20-key windows), on a long prompt
that vLLM chunks, and to mlx-lm's own greedy generation: its model with its own caches
(`mlx_lm_oracle.py`, which windows the layers mlx-lm's class does not), and `generate_step`
itself where mlx-lm's class runs the whole architecture. vLLM runs in a child process
(`serving_architectures_driver.py`). vLLM is told each layer's window: the windowed layers
form their own KV-cache groups, whose blocks it frees behind the window.

Its own nox session (`nox -s serving-architectures`): a fresh machine's vLLM inspects each new
architecture's class once (~45 s each here), ~1 min after that.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from paged_prefix.model_loader import load_model, read_config

from .mlx_lm_oracle import MlxLmOracle
from .serving_architectures_driver import GREEDY_TOKENS, WINDOW_HITS
from .serving_support import driver_fixtures

DRIVER = Path(__file__).with_name("serving_architectures_driver.py")
MODELS = ("llama3-test", "mistral-test", "gemma2-test", "gemma3-test", "gpt-oss-test",
          "qwen3-moe-test", "mixtral-test")
# the configs with sliding-window layers (window 20)
WINDOWED = ("llama3-test", "mistral-test", "gemma2-test", "gemma3-test", "gpt-oss-test")
# mlx-lm's class runs these configs' attention in full, windows included
WHOLE_IN_MLX_LM = ("llama3-test", "gemma3-test", "gpt-oss-test", "qwen3-moe-test", "mixtral-test")


# runs: {model: {caching: {"passes": [pass 1, pass 2, long prompt]}}}, by model name
folders, runs = driver_fixtures("architectures", MODELS, DRIVER)


def mlx_lm_greedy(folder: Path, prompt: list[int], tokens: int = GREEDY_TOKENS) -> list[int]:
    model = load_model(folder)
    return MlxLmOracle(model, read_config(folder)).greedy(prompt, tokens)[1]


def requests(run: dict) -> list[dict]:
    return [r for batch in run["passes"] for r in batch]


@pytest.mark.parametrize("name", MODELS)
def test_greedy_tokens_identical_caching_off_on_and_mlx_lm(name, runs, folders):
    off, on = runs[name]["off"], runs[name]["on"]
    for got_off, got_on in zip(requests(off), requests(on)):
        want = mlx_lm_greedy(folders[name], got_off["prompt_token_ids"])
        assert got_off["prompt_token_ids"] == got_on["prompt_token_ids"]
        assert got_off["token_ids"] == got_on["token_ids"] == want


@pytest.mark.parametrize("name", WHOLE_IN_MLX_LM)
def test_mlx_lm_generate_step_agrees(name, runs, folders):
    """mlx-lm's own generation loop (greedy: its default sampler is the argmax)."""
    model = load_model(folders[name])
    for request in requests(runs[name]["on"]):
        prompt = mx.array(request["prompt_token_ids"])
        steps = generate_step(prompt, model, max_tokens=GREEDY_TOKENS)
        assert [int(token) for token, _ in steps] == request["token_ids"]


@pytest.mark.parametrize("name", MODELS)
def test_the_second_pass_hits_the_shared_prefix(name, runs):
    first, second, long = runs[name]["on"]["passes"]
    assert all(r["num_cached_tokens"] == 0 for r in requests(runs[name]["off"]))
    # the three prompts share 53 tokens: after the first, whole blocks of them are cached
    assert [r["num_cached_tokens"] for r in first][1:] == [48, 48]
    # the second pass finds each whole prompt's blocks: 64 tokens, all but the last block
    assert [r["num_cached_tokens"] for r in second] == [48, 48, 48]
    assert long[0]["num_cached_tokens"] == 0 and len(long[0]["prompt_token_ids"]) == 300


@pytest.mark.parametrize("name", WINDOWED)
def test_hits_ending_before_at_and_past_the_window(name, runs, folders):
    """In 4-token blocks, prompts sharing the first 16, 20 and 48 tokens of primers cached
    before them hit exactly those: their first new query's window (20 keys) reaches the
    prompt's start, starts at key 1, and lies in the cached prefix, whose blocks left of it
    vLLM no longer holds; greedy tokens as with caching off and as mlx-lm's."""
    off, on = runs[name]["window hits"]["off"], runs[name]["window hits"]["on"]
    assert [r["num_cached_tokens"] for r in on["passes"][1]] == list(WINDOW_HITS)
    for got_off, got_on in zip(requests(off), requests(on)):
        want = mlx_lm_greedy(folders[name], got_off["prompt_token_ids"],
                             len(got_off["token_ids"]))
        assert got_off["prompt_token_ids"] == got_on["prompt_token_ids"]
        assert got_off["token_ids"] == got_on["token_ids"] == want
