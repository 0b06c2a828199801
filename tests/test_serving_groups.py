"""`vllm.LLM` through the plugin on a model with sliding-window and full layers (mlx-lm's llama,
`layer_types` 5 sliding : 1 full, a window of 24 keys), its layers in vLLM's KV-cache groups.

Greedy tokens are identical with prefix caching off and on and to mlx-lm's own generation with
its caches (rotating ones for the windowed layers), for a prompt far past the window, prompts
sharing a prefix longer than it, and those again all at once on a pool too small for them: vLLM
frees blocks behind the windows, hands hits whose first blocks are its null block, and
preempts. vLLM runs in child processes (`serving_groups_driver.py`): caching off with
synchronous scheduling, caching on with asynchronous scheduling (vLLM's default).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from bench.vllm_server import child_env
from paged_prefix.model_loader import load_model, read_config
from paged_prefix.models import resolve_config, write_folder

from .mlx_lm_oracle import MlxLmOracle
from .serving_groups_driver import GREEDY_TOKENS, PREFIX_LEN
from .serving_support import require_serving

DRIVER = Path(__file__).with_name("serving_groups_driver.py")
ROOT = Path(__file__).resolve().parents[1]
WINDOW = 24
CONFIG = resolve_config("llama-test", num_hidden_layers=6, sliding_window=WINDOW,
                        layer_types=["sliding_attention"] * 5 + ["full_attention"])
# 88 blocks of 16 tokens (one page of one layer per block: vLLM's groups have a layer each), what
# vLLM asks to admit a 512-token request under asynchronous scheduling: the long prompt fits
# alone, the shared ones do not all fit at once
KV_CACHE_BYTES = 88 * 16 * 2 * 64 * 2 * 4


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    require_serving()
    return write_folder(CONFIG, tmp_path_factory.mktemp("groups") / "llama-5to1", None,
                        mx.float32, seed=0)


@pytest.fixture(scope="module")
def runs(folder) -> dict:
    env = {**child_env(), "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    out = {}
    for caching in ("off", "on"):
        proc = subprocess.run([sys.executable, str(DRIVER), str(folder), caching,
                               str(KV_CACHE_BYTES)], env=env, capture_output=True, text=True,
                              timeout=1800)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        assert proc.returncode == 0 and lines, \
            f"driver failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
        assert "Traceback" not in proc.stderr, f"driver logged an error:\n{proc.stderr[-4000:]}"
        out[caching] = json.loads(lines[-1][len("RESULT "):])
    return out


def requests(run: dict) -> list[dict]:
    return [r for batch in run["passes"] for r in batch]


def test_vllm_groups_the_layers_by_window(runs):
    for run in runs.values():
        assert run["groups"] == ["SlidingWindowSpec"] * 5 + ["FullAttentionSpec"]
        assert run["num_blocks"] == 88


def test_greedy_tokens_identical_caching_off_on_and_mlx_lm(runs, folder):
    oracle = MlxLmOracle(load_model(folder), read_config(folder))
    assert len(requests(runs["off"])) == len(requests(runs["on"])) == 6
    for off, on in zip(requests(runs["off"]), requests(runs["on"])):
        assert off["prompt_token_ids"] == on["prompt_token_ids"]
        want = oracle.greedy(off["prompt_token_ids"], GREEDY_TOKENS)[1]
        assert off["token_ids"] == on["token_ids"] == want


def test_hits_past_the_window_and_a_tight_pool(runs):
    """The shared prefix (90 tokens) is longer than the window: its hits start with the null
    block in the sliding groups; windows are freed as requests grow; the pool preempts."""
    assert all(r["num_cached_tokens"] == 0 for r in requests(runs["off"]))
    _, alone, together = runs["on"]["passes"]
    hits = [r["num_cached_tokens"] for r in together]
    assert hits[0] > PREFIX_LEN  # the same prompt as `alone`'s
    # the others share its first 90 tokens; on the tight pool vLLM may have evicted blocks a
    # hit needs (a window's last blocks) before one of them is admitted
    assert all(h % 16 == 0 for h in hits) and sum(h >= PREFIX_LEN // 16 * 16 for h in hits) >= 2
    seen = runs["on"]["seen"]
    assert seen["null_in_new"] > 0 and seen["freed_windows"] > 0, seen
    assert runs["off"]["seen"]["preempted"] + seen["preempted"] > 0, (runs["off"]["seen"], seen)
    assert alone[0]["token_ids"] == together[0]["token_ids"]
