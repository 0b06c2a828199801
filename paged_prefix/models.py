"""Built-in models: real mlx-lm model classes with seeded random weights.

The built-in models are small configs of the real Llama, Qwen2 and Qwen3 classes (tests and
the offline demo need no download), plus GPU-sized shapes for the prefill benchmarks.
`hf_config()` writes the matching Hugging Face style config.json that vLLM's ModelConfig reads;
`write_folder()` a whole servable mlx-lm folder: a built-in config's random weights plus a real
tokenizer, for serving benchmarks of a GPU-sized model where no real one is on disk.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models import llama, qwen2, qwen3

_COMMON = dict(
    rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=4096,
    # Untied: with random weights a tied head mostly echoes the input token back.
    tie_word_embeddings=False,
)
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
}
_MODULES = {"llama": llama, "mistral": llama, "qwen2": qwen2, "qwen3": qwen3}
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                  "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def resolve_config(model: str | dict, **overrides) -> dict:
    if isinstance(model, str):
        if model not in BUILTIN_CONFIGS:
            raise ValueError(f"model: {model!r} is not one of {sorted(BUILTIN_CONFIGS)}")
        model = BUILTIN_CONFIGS[model]
    config = {**model, **overrides}
    if config.get("model_type") not in _MODULES:
        raise ValueError(f"model_type: expected one of {sorted(_MODULES)}, got "
                         f"{config.get('model_type')!r}")
    return config


def build_model(config: dict, dtype: mx.Dtype = mx.float32, seed: int = 0,
                evaluate: bool = True) -> nn.Module:
    """An mlx-lm model of `config` with weights drawn from `seed`, cast to `dtype`.

    evaluate=False leaves the weights lazy, for a caller about to replace them (sharing
    another model's arrays costs no memory then)."""
    module = _MODULES[config["model_type"]]
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    model.set_dtype(dtype)
    if evaluate:
        mx.eval(model.parameters())
    return model


def hf_config(config: dict, folder: Path, dtype: str = "float32") -> Path:
    """Write `folder/config.json` for vLLM's ModelConfig (no weights, no tokenizer)."""
    folder.mkdir(parents=True, exist_ok=True)
    body = {**config, "architectures": [_ARCHITECTURES[config["model_type"]]],
            "torch_dtype": dtype, "bos_token_id": 1, "eos_token_id": 2}
    (folder / "config.json").write_text(json.dumps(body, indent=1))
    return folder


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def write_folder(name: str, folder: Path, tokenizer: Path, dtype: mx.Dtype = mx.bfloat16,
                 seed: int = 0) -> Path:
    """An mlx-lm folder of built-in config `name` with seeded random weights and the tokenizer
    files of folder `tokenizer`, whose vocabulary sets vocab_size. Written atomically and
    reused when it exists, so a crash never leaves half a model."""
    if (folder / "config.json").exists():
        return folder
    from tokenizers import Tokenizer

    missing = [f for f in TOKENIZER_FILES if not (tokenizer / f).is_file()]
    if missing:
        raise ValueError(f"tokenizer: {str(tokenizer)!r} lacks {', '.join(missing)}")
    vocab = Tokenizer.from_file(str(tokenizer / "tokenizer.json")).get_vocab_size(True)
    config = resolve_config(name, vocab_size=vocab)
    model = build_model(config, dtype, seed)

    def fill(tmp: Path) -> None:
        hf_config(config, tmp, str(dtype).rsplit(".", 1)[-1])
        mx.save_safetensors(str(tmp / "model.safetensors"),
                            dict(tree_flatten(model.parameters())), metadata={"format": "mlx"})
        for f in TOKENIZER_FILES:
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
