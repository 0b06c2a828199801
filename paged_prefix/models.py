"""Built-in models: real mlx-lm model classes with seeded random weights.

The built-in models are small configs of the real classes of every architecture the runner
serves (`architectures`: tests and the offline demo need no download), plus GPU-sized shapes for
the prefill and serving benchmarks. `hf_config()` writes the matching Hugging Face style
config.json that vLLM's ModelConfig reads; `write_folder()` a whole servable mlx-lm folder: a
built-in config's random weights plus a real tokenizer (or none, for token-id prompts), for
serving a model where no real one is on disk.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map_with_path

from .architectures import architecture, check_config

_COMMON = dict(
    rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=4096,
    # Untied: with random weights a tied head mostly echoes the input token back.
    tie_word_embeddings=False,
)
_GEMMA3 = dict(model_type="gemma3_text", num_attention_heads=4, num_key_value_heads=1,
               rms_norm_eps=1e-6, rope_theta=1000000.0, rope_local_base_freq=10000.0)
# Qwen3-Next's fixed choices: a gated attention layer every 4th, 2 kv heads, a quarter of each
# head rotated, experts in every layer not listed in mlp_only_layers
_QWEN3_NEXT = dict(model_type="qwen3_next", num_key_value_heads=2, partial_rotary_factor=0.25,
                   linear_conv_kernel_dim=4, full_attention_interval=4, decoder_sparse_step=1,
                   norm_topk_prob=True, rms_norm_eps=1e-6, tie_word_embeddings=False)
_QWEN3_NEXT_SMALL = dict(rope_theta=10000.0, max_position_embeddings=4096, vocab_size=512)
_GPT_OSS = dict(model_type="gpt_oss", head_dim=64, rope_theta=150000.0)


def _qwen3_next(hidden: int, layers: int, heads: int, head_dim: int, linear_heads: int,
                linear_head_dim: int, experts: int, top_k: int, expert_width: int,
                **rest) -> dict:
    """A Qwen3-Next shape from its free sizes; its linear layers have half as many key heads
    as value heads, keys and values of one width, as the released model groups them."""
    return dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                head_dim=head_dim, linear_num_value_heads=linear_heads,
                linear_num_key_heads=linear_heads // 2, linear_key_head_dim=linear_head_dim,
                linear_value_head_dim=linear_head_dim, num_experts=experts,
                num_experts_per_tok=top_k, moe_intermediate_size=expert_width,
                **_QWEN3_NEXT, **rest)


def _gpt_oss_yarn(original_max_position_embeddings: int) -> dict:
    return dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0,
                original_max_position_embeddings=original_max_position_embeddings)


BUILTIN_CONFIGS: dict[str, dict] = {
    # Sized so the TTFT demo's ~16k prompt tokens prefill in tens of seconds on 2 CPU cores.
    "llama-tiny": dict(model_type="llama", hidden_size=256, num_hidden_layers=4,
                       intermediate_size=512, num_attention_heads=4, num_key_value_heads=1,
                       head_dim=64, vocab_size=2048, **_COMMON),
    "qwen3-tiny": dict(model_type="qwen3", hidden_size=256, num_hidden_layers=4,
                       intermediate_size=512, num_attention_heads=8, num_key_value_heads=2,
                       head_dim=64, vocab_size=2048, **_COMMON),
    # GPU-sized (1.10B parameters): prefill timings on a GPU, where a tiny model would
    # measure only launch overhead.
    "llama-1b": dict(model_type="llama", hidden_size=2048, num_hidden_layers=16,
                     intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=64, vocab_size=32000, **_COMMON),
    # Llama-3-8B's shape (8.0B parameters), for the end-to-end prefill benchmark.
    "llama-8b": dict(model_type="llama", hidden_size=4096, num_hidden_layers=32,
                     intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, vocab_size=128256,
                     **{**_COMMON, "rope_theta": 500000.0, "max_position_embeddings": 16384}),
    # Test-sized: fast enough for many forwards in unit tests.
    "llama-test": dict(model_type="llama", hidden_size=128, num_hidden_layers=2,
                       intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=64, vocab_size=512, **_COMMON),
    "qwen3-test": dict(model_type="qwen3", hidden_size=128, num_hidden_layers=2,
                       intermediate_size=256, num_attention_heads=8, num_key_value_heads=1,
                       head_dim=64, vocab_size=512, **_COMMON),
    # Qwen2's attention has q/k/v biases and derives head_dim from hidden_size / heads.
    "qwen2-test": dict(model_type="qwen2", hidden_size=256, num_hidden_layers=2,
                       intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=64, vocab_size=512, **_COMMON),
    # One per architecture beyond those: windows of 20 keys (not a whole number of 16-token
    # blocks), scales and caps other than the defaults, so a dropped feature shows.
    "llama3-test": dict(model_type="llama", hidden_size=128, num_hidden_layers=2,
                        intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=64, vocab_size=512,
                        layer_types=["sliding_attention", "full_attention"], sliding_window=20,
                        **{**_COMMON, "rope_theta": 500000.0, "rope_scaling": dict(
                            rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                            high_freq_factor=4.0, original_max_position_embeddings=64)}),
    # Mistral 7B v0.1's layout: every layer windowed by sliding_window
    "mistral-test": dict(model_type="mistral", hidden_size=128, num_hidden_layers=2,
                         intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=64, vocab_size=512, sliding_window=20, **_COMMON),
    "gemma2-test": dict(model_type="gemma2", hidden_size=128, num_hidden_layers=2,
                        intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=64, vocab_size=512, rms_norm_eps=1e-6, rope_theta=10000.0,
                        query_pre_attn_scalar=48, attn_logit_softcapping=2.0,
                        final_logit_softcapping=3.0, sliding_window=20),
    "gemma3-test": dict(hidden_size=128, num_hidden_layers=2, intermediate_size=256,
                        head_dim=64, vocab_size=512, query_pre_attn_scalar=48, sliding_window=20,
                        sliding_window_pattern=2, max_position_embeddings=4096,
                        rope_scaling=dict(rope_type="linear", factor=8.0), **_GEMMA3),
    "gpt-oss-test": dict(hidden_size=128, num_hidden_layers=2, intermediate_size=128,
                         num_local_experts=4, num_experts_per_tok=2, num_attention_heads=4,
                         num_key_value_heads=1, vocab_size=512, sliding_window=20,
                         rope_scaling=_gpt_oss_yarn(64),
                         layer_types=["sliding_attention", "full_attention"], **_GPT_OSS),
    # layer 1 dense (mlp_only_layers): Qwen3-MoE's MLP beside its experts
    "qwen3-moe-test": dict(model_type="qwen3_moe", hidden_size=128, num_hidden_layers=2,
                           intermediate_size=256, moe_intermediate_size=64, num_experts=4,
                           num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[1],
                           norm_topk_prob=True, num_attention_heads=8, num_key_value_heads=2,
                           head_dim=64, vocab_size=512, **_COMMON),
    # Mixtral computes head_dim as hidden_size / heads; Mixtral 8x7B's window is null
    "mixtral-test": dict(model_type="mixtral", hidden_size=128, num_hidden_layers=2,
                         intermediate_size=128, num_local_experts=4, num_experts_per_tok=2,
                         num_attention_heads=2, num_key_value_heads=1, vocab_size=512,
                         sliding_window=None, **_COMMON),
    # GPU-sized shapes of Gemma 3 1B and GPT-OSS 20B, for serving benchmarks
    "gemma3-1b": dict(hidden_size=1152, num_hidden_layers=26, intermediate_size=6912,
                      head_dim=256, vocab_size=262144, query_pre_attn_scalar=256,
                      sliding_window=512, sliding_window_pattern=6, max_position_embeddings=32768,
                      **_GEMMA3),
    "gpt-oss-20b": dict(hidden_size=2880, num_hidden_layers=24, intermediate_size=2880,
                        num_local_experts=32, num_experts_per_tok=4, num_attention_heads=64,
                        num_key_value_heads=8, vocab_size=201088, sliding_window=128,
                        rope_scaling=_gpt_oss_yarn(4096), max_position_embeddings=131072,
                        **_GPT_OSS),
    # Hybrid models (recurrent state in vLLM's blocks: docs/hybrid.md), test-sized.
    # Layers 0-2 gated delta net, layer 3 gated attention (every 4th); MoE in every layer
    # but layer 1, whose plain MLP keeps both feed-forward kinds in the model. 4 value heads
    # over 2 key heads, as the real model groups them.
    "qwen3-next-test": _qwen3_next(128, layers=4, heads=4, head_dim=64, linear_heads=4,
                                   linear_head_dim=32, experts=4, top_k=2, expert_width=64,
                                   intermediate_size=256, shared_expert_intermediate_size=128,
                                   mlp_only_layers=[1], **_QWEN3_NEXT_SMALL),
    # CPU-sized for serving benchmarks (~90M parameters with a 49k vocabulary): 6 gated delta
    # net layers, 2 gated attention, 8 experts
    "qwen3-next-small": _qwen3_next(512, layers=8, heads=8, head_dim=64, linear_heads=8,
                                    linear_head_dim=64, experts=8, top_k=2, expert_width=256,
                                    intermediate_size=1024, shared_expert_intermediate_size=512,
                                    mlp_only_layers=[], **_QWEN3_NEXT_SMALL),
    # GPU-sized Qwen3-Next shapes (its heads, head dims and expert widths; 16 layers, 32
    # experts: 2.4B parameters with a 49k vocabulary), for serving benchmarks of a hybrid model
    "qwen3-next-2b": _qwen3_next(2048, layers=16, heads=16, head_dim=256, linear_heads=32,
                                 linear_head_dim=128, experts=32, top_k=8, expert_width=512,
                                 intermediate_size=5120, shared_expert_intermediate_size=512,
                                 mlp_only_layers=[], rope_theta=10000000.0,
                                 max_position_embeddings=32768, vocab_size=151936),
    # Short conv at layers 0, 1 and 3, attention at 2 (LFM2's conv-conv-attention rhythm);
    # embeddings tied as in every LFM2. conv_dim is what vLLM sizes the conv state by.
    "lfm2-test": dict(
        model_type="lfm2", hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, conv_L_cache=3, conv_bias=False, conv_dim=256,
        layer_types=["conv", "conv", "full_attention", "conv"], block_dim=256,
        block_ff_dim=512, block_multiple_of=64, block_ffn_dim_multiplier=1.0,
        block_auto_adjust_ff_dim=True, norm_eps=1e-5, rope_theta=1000000.0,
        max_position_embeddings=4096, vocab_size=512),
}


def resolve_config(model: str | dict, **overrides) -> dict:
    if isinstance(model, str):
        if model not in BUILTIN_CONFIGS:
            raise ValueError(f"model: {model!r} is not one of {sorted(BUILTIN_CONFIGS)}")
        model = BUILTIN_CONFIGS[model]
    config = {**model, **overrides}
    check_config(config)
    return config


def build_model(config: dict, dtype: mx.Dtype = mx.float32, seed: int = 0,
                evaluate: bool = True) -> nn.Module:
    """An mlx-lm model of `config` with weights drawn from `seed`, cast to `dtype`.

    evaluate=False leaves the weights lazy, for a caller about to replace them (sharing
    another model's arrays costs no memory then)."""
    arch = check_config(config)
    mx.random.seed(seed)
    model = arch.module.Model(arch.model_args.from_dict(config))
    # GPT-OSS starts its sinks at zero: drawn like the other weights, so that a forward which
    # drops or misplaces one differs
    model.update(tree_map_with_path(
        lambda path, p: mx.random.normal(p.shape) if path.endswith("sinks") else p,
        model.parameters()))
    model.set_dtype(dtype)
    if evaluate:
        mx.eval(model.parameters())
    return model


def hf_config(config: dict, folder: Path, dtype: str = "float32") -> Path:
    """Write `folder/config.json` for vLLM's ModelConfig (no weights, no tokenizer)."""
    folder.mkdir(parents=True, exist_ok=True)
    body = {**config, "architectures": [architecture(config["model_type"]).hf_architecture],
            "torch_dtype": dtype, "bos_token_id": 1, "eos_token_id": 2}
    (folder / "config.json").write_text(json.dumps(body, indent=1))
    return folder


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def write_folder(name: str | dict, folder: Path, tokenizer: Path | None,
                 dtype: mx.Dtype = mx.bfloat16, seed: int = 0) -> Path:
    """An mlx-lm folder of built-in config `name` (or a config, as `resolve_config` takes it)
    with seeded random weights and the tokenizer files of folder `tokenizer`, whose vocabulary
    sets vocab_size; with `tokenizer` None, no tokenizer and the config's own vocabulary (for
    token-id prompts: vLLM's skip_tokenizer_init). Written atomically and reused when it
    exists, so a crash never leaves half a model."""
    if (folder / "config.json").exists():
        return folder
    overrides = {}
    if tokenizer is not None:
        from tokenizers import Tokenizer

        missing = [f for f in TOKENIZER_FILES if not (tokenizer / f).is_file()]
        if missing:
            raise ValueError(f"tokenizer: {str(tokenizer)!r} lacks {', '.join(missing)}")
        tokens = Tokenizer.from_file(str(tokenizer / "tokenizer.json"))
        overrides["vocab_size"] = tokens.get_vocab_size(True)
    config = resolve_config(name, **overrides)
    model = build_model(config, dtype, seed)

    def fill(tmp: Path) -> None:
        hf_config(config, tmp, str(dtype).rsplit(".", 1)[-1])
        mx.save_safetensors(str(tmp / "model.safetensors"),
                            dict(tree_flatten(model.parameters())), metadata={"format": "mlx"})
        for f in TOKENIZER_FILES if tokenizer is not None else ():
            shutil.copy(tokenizer / f, tmp / f)
    return write_atomically(folder, fill)


def write_atomically(folder: Path, fill: Callable[[Path], None]) -> Path:
    """`fill` a temporary sibling of `folder`, then rename it into place: a crash never leaves
    half a folder, and when another process finished first, its copy is kept."""
    tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    fill(tmp)
    if folder.exists():
        shutil.rmtree(tmp)
    else:
        tmp.rename(folder)
    return folder
