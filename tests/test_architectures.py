"""Every architecture the runner serves, on random weights, against mlx-lm's own model.

The paged runner's last-token logits against mlx-lm's model run with its own caches
(`mlx_lm_oracle.py`: rotating caches for windowed layers, and how the oracle windows the layers
mlx-lm's class does not), float32 on the CPU, on 70-token prompts over 20-key windows, with
prefix hits that end before (16), at (20) and past (48, 69) a window's reach, chunked prefill
across it, a mixed batch, and greedy decoding. Against the same split the full-attention
models are bit-identical on the CPU paths (as test_runner's); windowed layers and other splits
are held to LOGIT_TOL (measured up to 5.7e-6 on logits up to ~3.6: SDPA sums a window's keys in
another order than mlx-lm's masked or rotating ones) and the same argmax; greedy tokens are
identical. Planted bugs (a dropped window, cap, sink, embedding scale or RoPE base) must fail
the same comparison.
"""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import gemma3_text
from mlx_lm.models.switch_layers import SwitchGLU

from paged_prefix.architectures.base import vocabulary_head
from paged_prefix.metadata import ScheduledRequest, build_batch_metadata
from paged_prefix.models import resolve_config
from tests.conftest import ON_GPU
from tests.test_runner import BS, NUM_BLOCKS, Harness, mixed_batch, prefix_hit, prompt_of

WINDOW, PROMPT_LEN, DECODE_STEPS = 20, 70, 4
# (atol, rtol) on float32 logits; on a GPU (float32 there too: paged_prefix.precision) MLX's
# kernels may sum in other orders, as test_runner's LOGIT_TOL allows (unmeasured here)
LOGIT_TOL = (1e-4, 1e-4) if ON_GPU else (1e-5, 1e-5)
# test id -> built-in config (or a config)
CONFIGS = {name: name for name in ("llama3-test", "mistral-test", "gemma2-test", "gemma3-test",
                                   "gpt-oss-test", "qwen3-moe-test", "mixtral-test")}
CONFIGS["mixtral-windowed"] = resolve_config("mixtral-test", sliding_window=WINDOW)
ARCHITECTURES = list(CONFIGS)
PATHS = ["reference", "sdpa"]


def assert_matches(got: mx.array, want: mx.array) -> None:
    """Within LOGIT_TOL, the same argmax."""
    got, want = np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32))
    np.testing.assert_allclose(got, want, atol=LOGIT_TOL[0], rtol=LOGIT_TOL[1])
    assert got.argmax() == want.argmax()


def assert_split_matches(h: Harness, got: mx.array, want: mx.array) -> None:
    """Against the oracle fed the same split: bit for bit where that is exact (the CPU paths
    on full attention, as test_runner's models), else within LOGIT_TOL. A window is not:
    the paged paths read the keys from the window's first on, mlx-lm masks them or keeps them
    rotated, and SDPA sums the two in other orders (~1e-6 apart, measured)."""
    if h.exact and not any(g.window for g in h.runner.geometries):
        h.assert_same(got, want)
    else:
        assert_matches(got, want)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("hit", [0, 16, WINDOW, 48, PROMPT_LEN - 1],
                         ids=["none", "before-window", "at-window", "past-window", "all-but-last"])
def test_cached_prefix_and_decode_equal_mlx_lm(arch, path, hit):
    h = Harness(CONFIGS[arch], path)
    logits, split, full, tokens, want_tokens = prefix_hit(h, prompt_of(hit), hit, DECODE_STEPS)
    assert_split_matches(h, logits, split)
    assert_matches(logits, full)
    assert tokens == want_tokens


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_chunked_prefill_equals_mlx_lm(arch, path):
    """Chunks of 17 end before, inside and past the first window's reach."""
    h, chunk = Harness(CONFIGS[arch], path), 17
    prompt, blocks = prompt_of(chunk, PROMPT_LEN), h.blocks(PROMPT_LEN)
    for start in range(0, PROMPT_LEN, chunk):
        sampled = h.step(ScheduledRequest("c", prompt, PROMPT_LEN, start,
                                          min(chunk, PROMPT_LEN - start), blocks))
    splits = [(a, min(a + chunk, PROMPT_LEN)) for a in range(0, PROMPT_LEN, chunk)]
    assert_split_matches(h, sampled["c"], h.split_logits(prompt, splits)[-1])


@pytest.mark.parametrize("arch", ["gemma3-test", "gpt-oss-test", "mistral-test"])
def test_mixed_batch_of_hits_fresh_prompts_and_decode_rows(arch):
    """One forward: a decode row at position 57 (past its window), a 48-token hit, a fresh
    prompt."""
    h = Harness(arch, "sdpa")
    out, want = mixed_batch(h)
    assert sorted(out) == ["dec", "hit", "new"]
    for row in out:
        assert_matches(out[row], want[row])


def test_pages_left_of_every_window_are_never_read():
    """Mistral windows every layer: past the window, a sequence's first block may be vLLM's null
    block or one another request now owns. Here it is block 0, holding NaN in every layer."""
    h = Harness("mistral-test", "sdpa")
    prompt, blocks = prompt_of(5), h.blocks(PROMPT_LEN + 1)
    h.step(ScheduledRequest("warm", prompt[:48], 48, 0, 48, blocks))
    cache = h.runner.kv_cache
    nan = mx.full((BS, cache.num_kv_heads, cache.head_dim), float("nan"))
    for layer in range(cache.num_layers):
        cache.write(layer, nan, nan, cache.slots(np.arange(BS), mx.arange(BS)))
    mx.eval(cache.arrays())
    # the first new query (position 48) sees keys 29..48: block 0 (keys 0..15) is out of reach
    table = [0] + blocks[1:]
    logits = h.step(ScheduledRequest("b", prompt, PROMPT_LEN, 48, PROMPT_LEN - 48, table))["b"]
    assert_split_matches(h, logits, h.split_logits(prompt, [(0, 48), (48, PROMPT_LEN)])[-1])
    tokens = prompt + [int(mx.argmax(logits))]
    h.decode("b", tokens, table, PROMPT_LEN, 1)
    assert np.isfinite(np.array(h.step(ScheduledRequest(
        "b", tokens, PROMPT_LEN, len(tokens) - 1, 1, table))["b"])).all()


# Each layer's (window, softcap, sinks, scale), written from the configs: models.py's test sizes
EXPECTED = {
    "llama3-test": [(WINDOW, None, False, 64**-0.5), (None, None, False, 64**-0.5)],
    "mistral-test": [(WINDOW, None, False, 64**-0.5)] * 2,
    "gemma2-test": [(WINDOW, 2.0, False, 48**-0.5), (None, 2.0, False, 48**-0.5)],
    "gemma3-test": [(WINDOW, None, False, 48**-0.5), (None, None, False, 48**-0.5)],
    "gpt-oss-test": [(WINDOW, None, True, 64**-0.5), (None, None, True, 64**-0.5)],
    "qwen3-moe-test": [(None, None, False, 64**-0.5)] * 2,
    "mixtral-test": [(None, None, False, 64**-0.5)] * 2,
    "mixtral-windowed": [(WINDOW, None, False, 64**-0.5)] * 2,
}


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_each_layer_plans_the_attention_its_config_asks_for(arch):
    h = Harness(CONFIGS[arch], "reference")
    got = [(g.window, g.softcap, g.sinks, round(g.scale, 12)) for g in h.runner.geometries]
    assert got == [(*e[:3], round(e[3], 12)) for e in EXPECTED[arch]]
    layers = [layer.self_attn for layer in h.runner.model.layers]
    assert [(a.layer, a.window) for a in layers] == [(i, w[0]) for i, w in enumerate(got)]
    # one plan per distinct geometry, each checked on its first layer
    requests = [ScheduledRequest("a", prompt_of(0, 30), 30, 0, 30, h.blocks(30))]
    attentions, checked = h.runner._plan(build_batch_metadata(requests, BS, NUM_BLOCKS))
    distinct = list(dict.fromkeys(h.runner.geometries))
    assert len({id(a) for a in attentions}) == len(distinct)
    assert checked == {h.runner.geometries.index(g) for g in distinct}


def _no_window(h):
    h.runner.geometries = tuple(replace(g, window=None) for g in h.runner.geometries)


def _no_cap(h):
    h.runner.geometries = tuple(replace(g, softcap=None) for g in h.runner.geometries)


def _zero_sinks(h):
    for layer in h.runner.model.layers:
        layer.self_attn.sinks = mx.zeros_like(layer.self_attn.sinks)


def _no_final_cap(h):
    h.runner.architecture = replace(h.runner.architecture, logits=vocabulary_head)


def _no_embedding_scale(h):
    h.runner.architecture = replace(h.runner.architecture,
                                    embed=lambda model, ids: model.model.embed_tokens(ids))


def _global_rope_everywhere(h):
    global_rope = h.runner.model.layers[1].self_attn.rope
    h.runner.model.layers[0].self_attn.rope = global_rope


PLANTED = {
    "window": ("mistral-test", _no_window), "gemma2-window": ("gemma2-test", _no_window),
    "attn-cap": ("gemma2-test", _no_cap), "final-cap": ("gemma2-test", _no_final_cap),
    "sinks": ("gpt-oss-test", _zero_sinks), "gpt-oss-window": ("gpt-oss-test", _no_window),
    "embedding-scale": ("gemma3-test", _no_embedding_scale),
    "local-rope-base": ("gemma3-test", _global_rope_everywhere),
}


@pytest.mark.parametrize("bug", PLANTED)
def test_a_planted_bug_fails_the_comparison(bug):
    arch, plant = PLANTED[bug]
    h = Harness(arch, "reference")
    assert isinstance(h.runner.model.layers[0].self_attn.rope, type(
        h.dense.layers[0].self_attn.rope))
    plant(h)
    prompt = prompt_of(0)
    logits = h.step(ScheduledRequest("b", prompt, PROMPT_LEN, 0, PROMPT_LEN,
                                     h.blocks(PROMPT_LEN)))["b"]
    with pytest.raises(AssertionError):
        assert_matches(logits, h.split_logits(prompt, [(0, PROMPT_LEN)])[-1])


def test_gemma3_layers_keep_their_own_rope_bases():
    h = Harness("gemma3-test", "reference")
    local, global_ = (layer.self_attn.rope for layer in h.runner.model.layers)
    assert (local.base, global_.base, global_.scale) == (10000.0, 1000000.0, 1 / 8)
    assert isinstance(h.dense.layers[0].self_attn, gemma3_text.Attention)


def experts(model) -> list[SwitchGLU]:
    return [m for _, m in model.named_modules() if type(m) is SwitchGLU]


@pytest.mark.parametrize("arch, count", [("gpt-oss-test", 2), ("qwen3-moe-test", 1),
                                         ("mixtral-test", 2)])
def test_expert_layers_are_mlx_lms_own(arch, count):
    """The runner's tree runs mlx-lm's SwitchGLU experts (copies of the modules, over the
    caller's arrays) on the packed rows; Qwen3-MoE's dense layer is its packed MLP."""
    h = Harness(arch, "reference")
    ours, theirs = experts(h.runner.model), experts(h.dense)
    assert len(ours) == len(theirs) == count
    assert all(a is not b and a.gate_proj["weight"] is b.gate_proj["weight"]
               for a, b in zip(ours, theirs))
