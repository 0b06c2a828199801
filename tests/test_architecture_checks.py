"""What the runner refuses, and the facts its architectures rely on.

A model whose attention the runner cannot reproduce is refused at start-up with a ValueError
naming the field or feature: from the config alone where the config shows it (before the model
is built, so before any weight is read), else from the built model, whose weights the loader
reads only after the check. The accepted RoPE classes take an array of per-row positions and
give exactly what one scalar offset per row gives.
"""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import gemma2, mixtral
from mlx_lm.models.rope_utils import (
    DynamicNTKScalingRoPE,
    Llama3RoPE,
    ProportionalRoPE,
    SuScaledRoPE,
    YarnRoPE,
)

from paged_prefix.architectures import ARRAY_OFFSET_ROPES, architecture, check_model
from paged_prefix.kv_cache import PagedKVCache
from paged_prefix.model_loader import load_model, read_config
from paged_prefix.models import (
    BUILTIN_CONFIGS,
    build_model,
    hf_config,
    resolve_config,
    write_folder,
)
from paged_prefix.runner import PagedModelRunner

ROPES = {
    nn.RoPE: nn.RoPE(32, base=10000.0, scale=0.5),
    Llama3RoPE: Llama3RoPE(32, 1024, base=500000.0, scaling_config=dict(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64)),
    YarnRoPE: YarnRoPE(32, max_position_embeddings=4096, base=150000.0, scaling_factor=32.0,
                       original_max_position_embeddings=64),
    SuScaledRoPE: SuScaledRoPE(32, max_position_embeddings=1024,
                               original_max_position_embeddings=64, short_factor=[1.0] * 16,
                               long_factor=np.linspace(1, 4, 16).tolist()),
    ProportionalRoPE: ProportionalRoPE(32, 16, base=10000.0, factor=2.0),
}


def test_every_accepted_rope_takes_per_row_positions():
    assert set(ROPES) == set(ARRAY_OFFSET_ROPES)
    x = mx.random.normal((5, 4, 1, 32), key=mx.random.key(0))  # [T, heads, 1, D]
    positions = [0, 3, 17, 100, 2000]
    for cls, rope in ROPES.items():
        got = rope(x, offset=mx.array(positions))
        want = mx.concatenate([rope(x[i:i + 1], offset=p) for i, p in enumerate(positions)])
        np.testing.assert_array_equal(np.array(got), np.array(want), err_msg=cls.__name__)
    dynamic = DynamicNTKScalingRoPE(32, 64, False, 10000.0, 2.0)  # sizes its base from offset
    with pytest.raises(ValueError):
        dynamic(x, offset=mx.array(positions))


ABSENT = object()  # an override that removes the field
# (built-in config, overrides, the error's pattern): refused from the config alone
CONFIG_REFUSALS = {
    "model-type": ("llama-test", dict(model_type="cohere2"), "model_type: 'cohere2'"),
    "qwen-sliding": ("qwen3-test", dict(use_sliding_window=True), "use_sliding_window"),
    "moe-sliding": ("qwen3-moe-test", dict(use_sliding_window=True), "use_sliding_window"),
    "gemma3-attn-cap": ("gemma3-test", dict(attn_logit_softcapping=50.0),
                        "attn_logit_softcapping"),
    "gemma3-final-cap": ("gemma3-test", dict(final_logit_softcapping=30.0),
                         "final_logit_softcapping"),
    "gemma3-layer-types": ("gemma3-test", dict(layer_types=["full_attention"] * 2), "layer_types"),
    # a transformers 5 config: rope_parameters only
    "rope-parameters": ("llama-test", dict(rope_theta=ABSENT, rope_parameters=dict(
        rope_type="default", rope_theta=10000.0)), "rope_parameters"),
    # where mlx-lm's class requires rope_theta too, the missing field named is still this one
    "rope-parameters-only": ("qwen3-moe-test", dict(rope_theta=ABSENT, rope_parameters=dict(
        rope_type="default", rope_theta=10000.0)), "rope_parameters: mlx-lm's qwen3_moe"),
    "required-field": ("qwen3-test", dict(tie_word_embeddings=ABSENT),
                       "tie_word_embeddings: missing; mlx-lm's qwen3 class requires"),
    # mlx-lm's gemma2 divides by the caps; Hugging Face reads null as no cap
    "gemma2-null-attn-cap": ("gemma2-test", dict(attn_logit_softcapping=None),
                             "attn_logit_softcapping: null"),
    "gemma2-null-final-cap": ("gemma2-test", dict(final_logit_softcapping=None),
                              "final_logit_softcapping: null"),
    # mlx-lm's constructors look up a layer of each kind they need
    "llama-no-full-layer": ("llama-test", dict(layer_types=["sliding_attention"] * 2,
                                               sliding_window=20), "layer_types: .* no full"),
    "gpt-oss-no-sliding-layer": ("gpt-oss-test", dict(layer_types=["full_attention"] * 2),
                                 "layer_types: .* lacks"),
}
# fields Hugging Face and mlx-lm read differently when missing (architectures.MustState)
for _name, _field in (("llama-test", "tie_word_embeddings"), ("qwen2-test", "tie_word_embeddings"),
                      ("mistral-test", "tie_word_embeddings"), ("mistral-test", "sliding_window"),
                      ("gemma2-test", "query_pre_attn_scalar"), ("gemma3-test", "sliding_window"),
                      ("qwen3-next-test", "norm_topk_prob")):
    CONFIG_REFUSALS[f"{_name}-{_field}-unstated"] = (
        _name, {_field: ABSENT}, f"{_field}: a .* config must state it: Hugging Face reads")
# refused from the built model
MODEL_REFUSALS = {
    "chunked-layers": ("llama-test", dict(layer_types=["chunked_attention", "full_attention"]),
                       "layer_types: .*chunked_attention"),
    "window-missing": ("llama-test", dict(layer_types=["sliding_attention", "full_attention"]),
                       "sliding_window: llama has sliding layers"),
    "dynamic-rope": ("llama-test", dict(rope_scaling=dict(type="dynamic", factor=2.0)),
                     "rope: layer 0's DynamicNTKScalingRoPE"),
    "mistral-mixed": ("mistral-test", dict(layer_types=["sliding_attention", "full_attention"]),
                      "layer_types: .* mistral"),
    "gemma2-layer-types": ("gemma2-test", dict(layer_types=["sliding_attention"]), "layer_types"),
    # mlx-lm's gpt_oss runs every layer that is not "full_attention" windowed
    "gpt-oss-layer-types": ("gpt-oss-test", dict(num_hidden_layers=3, layer_types=[
        "sliding_attention", "full_attention", "chunked_attention"]), "layer_types: gpt_oss has"),
}


def refused_config(name: str, overrides: dict) -> dict:
    config = {**BUILTIN_CONFIGS[name], **overrides}
    return {k: v for k, v in config.items() if v is not ABSENT}


@pytest.mark.parametrize("case", CONFIG_REFUSALS)
def test_a_config_the_runner_cannot_reproduce_is_refused_before_any_weight(case, tmp_path):
    name, overrides, pattern = CONFIG_REFUSALS[case]
    config = refused_config(name, overrides)
    with pytest.raises(ValueError, match=pattern):
        resolve_config(config)
    (tmp_path / "config.json").write_text(json.dumps(config))  # no weights at all
    with pytest.raises(ValueError, match=pattern):
        read_config(tmp_path)
    with pytest.raises(ValueError, match=pattern):
        load_model(tmp_path)


@pytest.mark.parametrize("case", MODEL_REFUSALS)
def test_a_model_the_runner_cannot_reproduce_is_refused_before_its_weights_load(case, tmp_path,
                                                                               monkeypatch):
    name, overrides, pattern = MODEL_REFUSALS[case]
    config = refused_config(name, overrides)
    model = build_model(config)
    with pytest.raises(ValueError, match=pattern):
        PagedModelRunner(model, PagedKVCache(2, 8, 16, config["num_key_value_heads"], 64))
    hf_config(config, tmp_path)
    mx.save_safetensors(str(tmp_path / "model.safetensors"), dict(tree_flatten(model.parameters())))

    def read(*arrays):
        raise AssertionError("a weight was read before the model was checked")
    monkeypatch.setattr(mx, "eval", read)  # the folder's weights stay lazy until evaluated
    with pytest.raises(ValueError, match=pattern):
        load_model(tmp_path)


YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32)
# RoPE scaling the model's class drops (plain RoPE built), refused by the loader from the built
# model before any weight is read
ROPE_REFUSALS = {
    "llama-rope-parameters": ("llama-test", dict(rope_parameters=dict(
        rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
        high_freq_factor=4.0, original_max_position_embeddings=32)),
        "rope_parameters: llama3 RoPE scaling .* llama class builds RoPE"),
    "gemma3-rope-parameters": ("gemma3-test", dict(rope_scaling=ABSENT, rope_parameters=dict(
        full_attention=dict(rope_type="linear", factor=8.0, rope_theta=1e6),
        sliding_attention=dict(rope_type="default", rope_theta=1e4))),
        "rope_parameters: linear RoPE scaling"),
    "qwen3-moe-yarn": ("qwen3-moe-test", dict(rope_scaling=YARN), "rope_scaling: yarn"),
    "mixtral-yarn": ("mixtral-test", dict(rope_scaling=YARN), "rope_scaling: yarn"),
    "gemma2-linear": ("gemma2-test", dict(rope_scaling=dict(rope_type="linear", factor=4.0)),
                      "rope_scaling: linear"),
    "lfm2-linear": ("lfm2-test", dict(rope_scaling=dict(type="linear", factor=4.0)),
                    "rope_scaling: linear"),
}


@pytest.mark.parametrize("case", ROPE_REFUSALS)
def test_rope_scaling_the_models_class_drops_is_refused_before_its_weights_load(
        case, tmp_path, monkeypatch):
    name, overrides, pattern = ROPE_REFUSALS[case]
    config = refused_config(name, overrides)
    arch = resolve_config(config) and architecture(config["model_type"])
    model = arch.module.Model(arch.model_args.from_dict(config))  # what mlx-lm builds
    hf_config(config, tmp_path)
    mx.save_safetensors(str(tmp_path / "model.safetensors"), dict(tree_flatten(model.parameters())))

    def read(*arrays):
        raise AssertionError("a weight was read before the model was checked")
    monkeypatch.setattr(mx, "eval", read)
    with pytest.raises(ValueError, match=pattern):
        load_model(tmp_path)


@pytest.mark.parametrize("name, scaling", [
    ("qwen3-test", YARN), ("llama-test", dict(type="linear", factor=2.0)),
    ("gemma3-test", dict(rope_type="linear", factor=8.0)),  # its global layers only
    ("llama-test", dict(rope_type="mrope", mrope_section=[8, 12, 12]))])
def test_rope_scaling_the_models_class_applies_loads(name, scaling, tmp_path):
    folder = write_folder({**BUILTIN_CONFIGS[name], "rope_scaling": scaling}, tmp_path / "m",
                          None, mx.float32)
    model = load_model(folder)
    assert any(type(layer.self_attn.rope) is not nn.RoPE or layer.self_attn.rope.scale != 1.0
               for layer in model.layers) == (scaling.get("rope_type") != "mrope")


def test_dense_experts_outside_float32_are_refused_on_the_cpu(tmp_path):
    """MLX's CPU gather_mm runs float32 only: refused at load, naming the dtype, not at the
    first forward."""
    folder = write_folder("mixtral-test", tmp_path / "m", None, mx.bfloat16)
    with pytest.raises(ValueError, match=r"dtype: mlx.core.bfloat16 experts .* float32"):
        load_model(folder)
    assert load_model(folder, mx.float32).layers[0].block_sparse_moe.switch_mlp is not None


@pytest.mark.parametrize("module, args", [(gemma2, "Gemma2Args"), (mixtral, "MixtralArgs")])
def test_models_built_with_mlx_lms_own_args_are_refused(module, args):
    """mlx-lm's gemma2 and mixtral ModelArgs drop the config's window: such a model cannot say
    which layers are windowed, so the runner refuses it rather than guess."""
    name = {"mlx_lm.models.gemma2": "gemma2-test", "mlx_lm.models.mixtral": "mixtral-test"}
    config = resolve_config(name[module.__name__])
    model = module.Model(module.ModelArgs.from_dict(config))
    with pytest.raises(ValueError, match="sliding_window: mlx-lm's .* ModelArgs drop"):
        check_model(model)
    assert check_model(build_model(config))[0].args.__name__ == args


@pytest.mark.parametrize("name", ["llama3-test", "mistral-test", "gemma2-test", "gemma3-test",
                                  "gpt-oss-test", "qwen3-moe-test", "mixtral-test"])
def test_a_written_folder_loads_as_the_model_it_was_built_from(name, tmp_path):
    """`write_folder` with no tokenizer (token-id prompts): config.json as vLLM reads it, and
    weights that load back into the same model through the loader."""
    folder = write_folder(name, tmp_path / name, None, mx.float32, seed=3)
    config = read_config(folder)
    assert config["vocab_size"] == BUILTIN_CONFIGS[name]["vocab_size"]
    assert config["architectures"] and not (folder / "tokenizer.json").exists()
    loaded, built = load_model(folder), build_model(resolve_config(name), mx.float32, seed=3)
    assert type(loaded.args) is type(built.args) and loaded.args == built.args
    tokens = mx.array([list(range(3, 40))])
    np.testing.assert_array_equal(np.array(loaded(tokens)), np.array(built(tokens)))
