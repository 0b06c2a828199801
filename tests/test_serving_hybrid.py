"""`vllm.LLM` through the plugin on the hybrid models' random-weight test folders (Qwen3-Next,
LFM2): recurrent state in vLLM's state blocks (align mode with prefix caching, one block per
request without).

Greedy tokens are identical with prefix caching off and on, on a second pass that hits the
first pass's state blocks (one and several), with a token budget below the state block (vLLM
then ends chunks inside a block), with a pool too small for the batch (vLLM preempts and
resumes requests), with decode rows beside a long prompt's prefill chunks; and identical to
mlx-lm's own greedy generation (its model with its own KV and state caches, and `generate_step`
itself). The driver (`serving_hybrid_driver.py`) records each setting's step shapes, so a
setting that never preempted, never chunked inside a block or never mixed decode rows with a
prefill fails here rather than passing untested.

Its own nox session (`nox -s serving-hybrid`): ~2 min on 2 CPU cores.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from paged_prefix.model_loader import load_model, read_config

from .mlx_lm_oracle import MlxLmOracle
from .serving_hybrid_driver import GREEDY_TOKENS, SETTINGS, TIGHT_TOKENS
from .serving_support import driver_fixtures

DRIVER = Path(__file__).with_name("serving_hybrid_driver.py")
MODELS = ("qwen3-next-test", "lfm2-test")


# runs: {model: {setting: {"passes": [...], "steps": {...}, "cache": {...}}}}, by model name
folders, runs = driver_fixtures("hybrid", MODELS, DRIVER)


@pytest.fixture(scope="module")
def mlx_lm(folders):
    """mlx-lm's greedy continuation of a prompt with its own caches, memoized per model."""
    oracles, memo = {}, {}

    def greedy(name: str, prompt: list[int], steps: int) -> list[int]:
        key = (name, tuple(prompt), steps)
        if key not in memo:
            if name not in oracles:
                oracles[name] = MlxLmOracle(load_model(folders[name]),
                                            read_config(folders[name]))
            memo[key] = oracles[name].greedy(prompt, steps)[1]
        return memo[key]
    return greedy


def requests(run: dict) -> list[dict]:
    return [r for batch in run["passes"] for r in batch]


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("name", MODELS)
def test_greedy_tokens_are_mlx_lms_in_every_setting(name, setting, runs, mlx_lm):
    steps = TIGHT_TOKENS if setting == "tight-pool" else GREEDY_TOKENS
    for request in requests(runs[name][setting]):
        assert request["token_ids"] == mlx_lm(name, request["prompt_token_ids"], steps)


@pytest.mark.parametrize("name", MODELS)
def test_caching_off_and_on_agree(name, runs):
    off, on = requests(runs[name]["off"]), requests(runs[name]["on"])
    assert [r["token_ids"] for r in off] == [r["token_ids"] for r in on]


@pytest.mark.parametrize("name", MODELS)
def test_mlx_lm_generate_step_agrees(name, runs, folders):
    """mlx-lm's own generation loop (greedy: its default sampler is the argmax)."""
    model = load_model(folders[name])
    for request in runs[name]["on"]["passes"][0]:
        steps = generate_step(mx.array(request["prompt_token_ids"]), model,
                              max_tokens=GREEDY_TOKENS)
        assert [int(token) for token, _ in steps] == request["token_ids"]


@pytest.mark.parametrize("name", MODELS)
def test_second_pass_hits_whole_state_blocks(name, runs):
    """Hits land on state blocks: the 81-token prompts sharing 70 tokens hit all their whole
    blocks, the one sharing 40 (in the first pass, under the small budget that schedules it
    after the others) hits the blocks of those 40."""
    on = runs[name]["on"]
    block = on["cache"]["mamba_block_size"]
    assert all(r["num_cached_tokens"] == 0 for r in requests(runs[name]["off"]))
    assert runs[name]["off"]["cache"]["mamba_block_size"] == 512  # max_model_len: one a request
    second = [r["num_cached_tokens"] for r in on["passes"][1]]
    assert second[:2] == [81 // block * block] * 2 and second[2] == 70 // block * block
    assert all(n % block == 0 for r in requests(on) for n in [r["num_cached_tokens"]])
    if name == "qwen3-next-test":  # block 32: a hit of one state block and of two
        assert block == 32 and 64 in second
        assert runs[name]["small-budget"]["passes"][0][2]["num_cached_tokens"] == 32


@pytest.mark.parametrize("name", MODELS)
def test_each_setting_ran_what_it_is_for(name, runs):
    steps = {s: runs[name][s]["steps"] for s in SETTINGS}
    assert steps["tight-pool"]["preempted"] > 0 and steps["tight-pool"]["resumed"] > 0
    assert all(s["mixed_steps"] > 0 for s in steps.values())  # decode rows beside prefills
    block = runs[name]["on"]["cache"]["mamba_block_size"]
    # a state block wider than the token budget: vLLM advances chunks inside it
    assert (steps["small-budget"]["mid_block_chunks"] > 0) == (block > 24)
    assert steps["on"]["mid_block_chunks"] == 0  # otherwise every chunk ends on a boundary
