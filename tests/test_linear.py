"""The packed forward's linear layers: nn.Linear's numbers from a transpose kept (PackedLinear)
and from layers stacked into one matmul (StackedLinear); what the runner replaces."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from paged_prefix import cpu_blas
from paged_prefix.dispatch import Dispatcher
from paged_prefix.kv_cache import PagedKVCache
from paged_prefix.linear import PackedLinear, StackedLinear, pack_linears
from paged_prefix.metadata import ScheduledRequest, build_batch_metadata
from paged_prefix.mlp import PackedMLP
from paged_prefix.models import build_model, resolve_config
from paged_prefix.runner import PagedModelRunner


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_packed_linear_is_bit_identical_to_nn_linear(bias, dtype):
    linear = nn.Linear(48, 40, bias=bias)
    linear.set_dtype(dtype)
    x = mx.random.normal((7, 48), key=mx.random.key(1)).astype(dtype)
    packed = PackedLinear(linear)
    want = np.array(linear(x).astype(mx.float32))
    for _ in range(2):  # the second call reads the kept transpose
        np.testing.assert_array_equal(np.array(packed(x).astype(mx.float32)), want)


def test_a_replaced_weight_is_used_at_once():
    linear = nn.Linear(16, 8, bias=False)
    packed = PackedLinear(linear)
    x = mx.ones((3, 16))
    mx.eval(packed(x))
    packed.update({"weight": 2 * linear.weight})
    np.testing.assert_array_equal(np.array(packed(x)), np.array(2 * linear(x)))


def test_pack_linears_replaces_plain_linears_only_and_keeps_the_parameter_tree():
    model = build_model(resolve_config("llama-tiny"), mx.float32)
    before = dict(tree_flatten(model.parameters()))
    nn.quantize(model.layers[1], group_size=32, bits=8)
    quantized = sum(isinstance(m, nn.QuantizedLinear) for m in model.layers[1].modules())
    replaced = sum(pack_linears(layer) for layer in model.layers)
    assert replaced == 7 * (len(model.layers) - 1)
    assert not [m for m in model.model.modules() if type(m) is nn.Linear]
    assert sum(isinstance(m, nn.QuantizedLinear) for m in model.layers[1].modules()) == quantized
    after = dict(tree_flatten(model.layers[0].parameters()))
    prefix = "model.layers.0."
    assert after.keys() == {k.removeprefix(prefix) for k in before if k.startswith(prefix)}
    assert all(after[k] is before[prefix + k] for k in after)


def _layers(bias: bool, dtype=mx.float32) -> list[nn.Linear]:
    layers = [nn.Linear(64, n, bias=bias) for n in (96, 32, 32)]
    for layer in layers:
        layer.set_dtype(dtype)
    mx.eval([layer.parameters() for layer in layers])
    return layers


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_stacked_linear_is_bit_identical_to_each_layer(bias, dtype):
    """Bit for bit, except float32 on OpenBLAS: its AVX-512 kernels (chosen on such CPUs)
    block a [160, 64] weight unlike a [96, 64] one, which moves results by an ulp or two; there
    within 4 ulps of each output row's scale."""
    layers = _layers(bias, dtype)
    x = mx.random.normal((9, 64), key=mx.random.key(2)).astype(dtype)
    want = [np.array(layer(x).astype(mx.float32)) for layer in layers]
    stacked = StackedLinear()
    blas = dtype == mx.float32 and mx.default_device() == mx.cpu and cpu_blas.status().active
    for _ in range(2):
        got = stacked(x, *layers)
        for g, w in zip(got, want):
            g = np.array(g.astype(mx.float32))
            if blas:
                scale = np.abs(w).max(axis=1, keepdims=True)
                np.testing.assert_array_less(np.abs(g - w),
                                             np.broadcast_to(4 * np.finfo(np.float32).eps * scale,
                                                             w.shape))
            else:
                np.testing.assert_array_equal(g, w)


def test_stacked_weights_are_held_once():
    layers = _layers(bias=True)
    x = mx.ones((4, 64))
    mx.eval(x)
    before = mx.get_active_memory()
    weight_bytes = sum(layer.weight.nbytes for layer in layers)
    out = StackedLinear()(x, *layers)
    mx.eval(out)
    # MLX lets go of an evaluated op's inputs once the device is done with them (on a GPU, a
    # worker thread does, after eval returns): wait for it before counting
    mx.synchronize()
    # the layers' weights are now views of the stack: the old arrays were released
    assert mx.get_active_memory() - before < weight_bytes / 2


def test_a_replaced_weight_is_stacked_again():
    layers = _layers(bias=False)
    stacked = StackedLinear()
    x = mx.ones((3, 64))
    mx.eval(stacked(x, *layers))
    layers[1].update({"weight": 3 * layers[1].weight})
    got = stacked(x, *layers)
    for g, layer in zip(got, layers):
        np.testing.assert_array_equal(np.array(g), np.array(layer(x)))
    for layer in layers:  # a bias given to every layer later: stacked with it
        layer.bias = mx.full((layer.weight.shape[0],), 0.5)
    got = stacked(x, *layers)
    for g, layer in zip(got, layers):
        np.testing.assert_array_equal(np.array(g), np.array(layer(x)))


def test_quantized_layers_are_called_one_by_one():
    layers = _layers(bias=False)
    quantized = nn.QuantizedLinear.from_linear(layers[0], group_size=32, bits=8)
    x = mx.random.normal((5, 64), key=mx.random.key(3))
    got = StackedLinear()(x, quantized, layers[1], layers[2])
    for g, layer in zip(got, (quantized, layers[1], layers[2])):
        np.testing.assert_array_equal(np.array(g), np.array(layer(x)))


def test_layers_of_different_dtypes_are_called_one_by_one():
    layers = _layers(bias=False)
    layers[2].set_dtype(mx.float16)
    weights = [layer.weight for layer in layers]
    x = mx.random.normal((5, 64), key=mx.random.key(4))
    got = StackedLinear()(x, *layers)
    assert all(layer.weight is w for layer, w in zip(layers, weights))  # nothing stacked
    for g, layer in zip(got, layers):
        np.testing.assert_array_equal(np.array(g), np.array(layer(x)))


def test_the_runner_stacks_qkv_and_gate_up():
    """Engagement: after a forward, every layer's q/k/v and gate/up weights are views of one
    stack each, and the stack is what the forward multiplied by."""
    cfg = resolve_config("llama-tiny")
    kv = PagedKVCache(cfg["num_hidden_layers"], 8, 16, cfg["num_key_value_heads"],
                      cfg["head_dim"], mx.float32)
    runner = PagedModelRunner(build_model(cfg, mx.float32), kv, Dispatcher("reference"))
    meta = build_batch_metadata([ScheduledRequest("r", list(range(3, 40)), 37, 0, 37, [1, 2, 3])],
                                16, 8)
    mx.eval(runner.forward(meta))
    for layer in runner.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        assert isinstance(mlp, PackedMLP) and isinstance(attn.o_proj, PackedLinear)
        for stacked, layers in ((attn._qkv, (attn.q_proj, attn.k_proj, attn.v_proj)),
                                (mlp._gate_up, (mlp.gate_proj, mlp.up_proj))):
            held = [a for layer in layers for a in (layer.weight, layer.get("bias"))]
            assert len(stacked._views) == len(held)
            assert all(view is a for view, a in zip(stacked._views, held))
