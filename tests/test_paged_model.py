"""The runner's own module tree: the caller's mlx-lm model is left as it was and still runs as
mlx-lm's, and the runner's tree holds the caller's weight arrays (building it copies none)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import llama, qwen2, qwen3

from paged_prefix.dispatch import Dispatcher
from paged_prefix.kv_cache import PagedKVCache
from paged_prefix.metadata import ScheduledRequest, build_batch_metadata
from paged_prefix.models import build_model, resolve_config
from paged_prefix.runner import PagedModelRunner

MLX_LM = {"llama": llama, "qwen2": qwen2, "qwen3": qwen3}
BS, NUM_BLOCKS = 16, 8
PROMPT = list(range(3, 40))


def model_of(name: str, quantized: bool) -> nn.Module:
    model = build_model(resolve_config(name), mx.float16 if quantized else mx.float32, seed=1)
    if quantized:
        nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    return model


def cache_for(name: str, model: nn.Module) -> PagedKVCache:
    cfg = resolve_config(name)
    cache = PagedKVCache(cfg["num_hidden_layers"], NUM_BLOCKS, BS, cfg["num_key_value_heads"],
                         cfg["head_dim"], model.model.norm.weight.dtype)
    mx.eval(cache.arrays())
    return cache


def forward(runner: PagedModelRunner) -> mx.array:
    meta = build_batch_metadata([ScheduledRequest("r", PROMPT, len(PROMPT), 0, len(PROMPT),
                                                  [1, 2, 3])], BS, NUM_BLOCKS)
    logits = runner.forward(meta)
    mx.eval(logits, runner.kv_cache.arrays())
    return logits


def modules(model: nn.Module) -> list[tuple[str, type, int]]:
    return [(path, type(m), id(m)) for path, m in model.named_modules()]


def parameters(model: nn.Module) -> dict[str, mx.array]:
    return dict(tree_flatten(model.parameters()))


def assert_same_arrays(got: dict[str, mx.array], want: dict[str, mx.array]) -> None:
    assert got.keys() == want.keys()
    assert [k for k in got if got[k] is not want[k]] == []


@pytest.mark.parametrize("quantized", [False, True], ids=["dense", "quantized"])
@pytest.mark.parametrize("name", ["llama-test", "qwen3-test", "qwen2-test"])
def test_the_callers_model_is_left_as_it_was_and_its_weights_are_shared(name, quantized):
    model = model_of(name, quantized)
    tokens = mx.array([PROMPT])
    want = model(tokens)
    mx.eval(want)
    weights = parameters(model)
    tree = modules(model)
    cache, dispatcher = cache_for(name, model), Dispatcher("reference")
    mx.synchronize()
    before = mx.get_active_memory()
    runner = PagedModelRunner(model, cache, dispatcher)
    assert mx.get_active_memory() == before  # no array was copied, none allocated
    assert_same_arrays(parameters(runner.model), weights)
    forward(runner)  # the runner now multiplies by its own stacks of q/k/v and gate/up
    assert modules(model) == tree  # the same module objects, none replaced
    mlx_lm = MLX_LM[model.args.model_type]
    assert all(type(layer.self_attn) is mlx_lm.Attention and type(layer.mlp) is mlx_lm.MLP
               for layer in model.layers)
    assert_same_arrays(parameters(model), weights)
    np.testing.assert_array_equal(np.array(model(tokens)), np.array(want))


def test_a_runner_refused_at_construction_leaves_the_model_as_it_was():
    model = model_of("llama-test", quantized=False)
    tree = modules(model)
    with pytest.raises(ValueError, match="kv_cache"):
        PagedModelRunner(model, PagedKVCache(2, NUM_BLOCKS, BS, 3, 64))
    assert modules(model) == tree


def test_a_runner_over_another_runners_model_shares_its_stacked_weights():
    """A second runner over a runner's tree (a benchmark's second cache) holds the first one's
    arrays, the stacked views included, and stacks nothing again."""
    model = model_of("llama-test", quantized=False)
    first = PagedModelRunner(model, cache_for("llama-test", model), Dispatcher("reference"))
    want = forward(first)
    second = PagedModelRunner(first.model, cache_for("llama-test", model), Dispatcher("reference"))
    np.testing.assert_array_equal(np.array(forward(second)), np.array(want))
    assert_same_arrays(parameters(second.model), parameters(first.model))
