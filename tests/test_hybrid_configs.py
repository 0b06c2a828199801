"""The built-in hybrid configs build in mlx-lm's own model classes and run there: the cached
path (a prompt, then decode steps through mlx-lm's caches) gives the logits of one forward over
all the tokens; and their recurrent states are shaped as vLLM sizes them."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import lfm2, qwen3_next
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator

from paged_prefix.models import BUILTIN_CONFIGS
from paged_prefix.recurrent import lfm2 as lfm2_states
from paged_prefix.recurrent import qwen3_next as qwen3_next_states
from tests.conftest import assert_close

MODULES = {"qwen3-next-test": qwen3_next, "lfm2-test": lfm2}


def build(name: str):
    mx.random.seed(0)
    module = MODULES[name]
    model = module.Model(module.ModelArgs.from_dict(BUILTIN_CONFIGS[name]))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


def test_layer_kinds_follow_each_models_pattern():
    layers = build("qwen3-next-test").layers
    assert [layer.is_linear for layer in layers] == [True, True, True, False]
    moe = [isinstance(layer.mlp, qwen3_next.Qwen3NextSparseMoeBlock) for layer in layers]
    assert moe == [True, False, True, True]
    assert [layer.is_attention_layer for layer in build("lfm2-test").layers] == \
        [False, False, True, False]


@pytest.mark.parametrize("name", MODULES)
def test_cached_prompt_then_decode_equals_one_forward(name):
    model = build(name)
    tokens = mx.array(np.random.default_rng(0).integers(3, 512, (1, 16)))
    full = model(tokens)  # no cache: every layer starts from zero state
    cache = model.make_cache()
    steps = [model(tokens[:, :13], cache=cache)]
    steps += [model(tokens[:, i:i + 1], cache=cache) for i in range(13, 16)]
    assert np.isfinite(np.array(full)).all()
    assert_close(mx.concatenate(steps, axis=1), np.array(full), mx.float32, name)


def test_state_shapes_are_vllms():
    """vLLM's MambaSpec shapes for these layers, tensor parallel size 1, no speculation."""
    cfg = BUILTIN_CONFIGS["qwen3-next-test"]
    layer = build("qwen3-next-test").layers[0].linear_attn
    assert qwen3_next_states.state_shapes(layer) == MambaStateShapeCalculator \
        .gated_delta_net_state_shape(1, cfg["linear_num_key_heads"], cfg["linear_num_value_heads"],
                                     cfg["linear_key_head_dim"], cfg["linear_value_head_dim"],
                                     cfg["linear_conv_kernel_dim"])
    cfg = BUILTIN_CONFIGS["lfm2-test"]
    layer = build("lfm2-test").layers[0].conv
    assert lfm2_states.state_shapes(layer) == MambaStateShapeCalculator.short_conv_state_shape(
        1, cfg["conv_dim"], cfg["conv_L_cache"])
