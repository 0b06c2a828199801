"""The longest context a fixed KV-cache budget holds: KV-cache groups against all layers as full
attention, by vLLM's own sizing, and one served run showing it.

    python -m bench.kv_budget --out docs/kv_budget.json [--budget-gib 4] [--serve]

Gemma 3's shapes (5 sliding : 1 full layers, bfloat16, blocks of 16): each layer's spec as the
worker reports it (`kv_groups.layer_specs`), grouped by vLLM with its hybrid KV-cache manager on
(the default here) or off (`--disable-hybrid-kv-cache-manager`: one group, every block kept);
then vLLM's `get_kv_cache_configs` fits max_model_len to the budget (max_model_len=-1) and
reports how many blocks the pool holds. The fitted length is bounded by the configs' context
ceiling (`--ceiling`, above every model's own so that memory is what limits it).

--serve: `vllm.LLM` through the plugin on a small random-weight model of that layout (6 layers,
window 128, float32), a 4 MiB budget, max_model_len=-1, with the hybrid manager on and off: the
length each fits, then, grouped, one greedy request of the length it fits (past the all-full
fit), its tokens against mlx-lm's own generation.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
from pathlib import Path

import torch
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.v1.core.kv_cache_utils import get_kv_cache_configs

from paged_prefix.kv_groups import LAYOUT, layer_specs
from paged_prefix.models import hf_config

BLOCK_SIZE, GiB = 16, 1 << 30
# Gemma 3 (its configs' layers, kv heads, head dim and window); every 6th layer is global
GEMMA3 = {
    "gemma-3-1b": dict(layers=26, kv_heads=1, head_dim=256, window=512),
    "gemma-3-4b": dict(layers=34, kv_heads=4, head_dim=256, window=1024),
    "gemma-3-12b": dict(layers=48, kv_heads=8, head_dim=256, window=1024),
    "gemma-3-27b": dict(layers=62, kv_heads=16, head_dim=128, window=1024),
}


def windows(shape: dict) -> list[int | None]:
    return [None if (i + 1) % 6 == 0 else shape["window"] for i in range(shape["layers"])]


def fit(shape: dict, budget: int, hybrid: bool, ceiling: int, batched: int) -> dict:
    """vLLM's fit of one shape to `budget` bytes: the groups, the pool, the longest context."""
    w = windows(shape)
    config = dict(model_type="llama", hidden_size=256, intermediate_size=512, vocab_size=512,
                  num_hidden_layers=shape["layers"], num_attention_heads=8,
                  num_key_value_heads=shape["kv_heads"], head_dim=shape["head_dim"],
                  rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=ceiling,
                  sliding_window=shape["window"], tie_word_embeddings=False,
                  layer_types=["full_attention" if x is None else "sliding_attention" for x in w])
    with tempfile.TemporaryDirectory() as folder:
        vllm_config = VllmConfig(
            model_config=ModelConfig(model=str(hf_config(config, Path(folder), "bfloat16")),
                                     skip_tokenizer_init=True, dtype="bfloat16", max_model_len=-1),
            cache_config=CacheConfig(block_size=BLOCK_SIZE),
            scheduler_config=SchedulerConfig(max_model_len=ceiling, is_encoder_decoder=False,
                                             max_num_batched_tokens=batched,
                                             disable_hybrid_kv_cache_manager=not hybrid))
    vllm_config.cache_config.kv_cache_layout = LAYOUT  # as vLLM's engine core resolves it
    specs = layer_specs(w, BLOCK_SIZE, shape["kv_heads"], shape["head_dim"], torch.bfloat16)
    kv = get_kv_cache_configs(vllm_config, [specs], [budget])[0]
    return dict(groups=len(kv.kv_cache_groups), num_blocks=kv.num_blocks,
                max_model_len=vllm_config.model_config.max_model_len,
                page_bytes=next(iter(specs.values())).page_size_bytes)


SERVED = dict(layers=6, kv_heads=1, head_dim=64, window=128)
SERVED_BUDGET, SERVED_TOKENS = 4 << 20, 8


def served_config(ceiling: int) -> dict:
    w = windows(SERVED)
    return dict(model_type="llama", hidden_size=128, intermediate_size=256, vocab_size=512,
                num_hidden_layers=SERVED["layers"], num_attention_heads=4,
                num_key_value_heads=SERVED["kv_heads"], head_dim=SERVED["head_dim"],
                rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=ceiling,
                sliding_window=SERVED["window"], tie_word_embeddings=False,
                layer_types=["full_attention" if x is None else "sliding_attention" for x in w])


def serve(ceiling: int) -> dict:
    """Each mode's fitted max_model_len, and, grouped, a prompt past the all-full fit."""
    import os
    import time

    import mlx.core as mx
    import numpy as np

    from paged_prefix.model_loader import load_model
    from paged_prefix.models import write_folder

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    config = served_config(ceiling)
    out: dict = dict(model=SERVED, budget_bytes=SERVED_BUDGET, dtype="float32")
    with tempfile.TemporaryDirectory() as root:
        folder = write_folder(config, Path(root) / "gemma-like", None, mx.float32, seed=0)
        for hybrid in (False, True):
            llm = LLM(model=str(folder), skip_tokenizer_init=True, max_model_len=-1,
                      kv_cache_memory_bytes=SERVED_BUDGET, max_num_batched_tokens=256,
                      max_num_seqs=1, async_scheduling=False, seed=0,
                      disable_hybrid_kv_cache_manager=not hybrid)
            fitted = llm.llm_engine.vllm_config.model_config.max_model_len
            out["grouped" if hybrid else "all_full"] = dict(max_model_len=fitted)
            if hybrid:
                length = fitted - SERVED_TOKENS  # the longest it fits
                prompt = np.random.default_rng(0).integers(3, 512, length).tolist()
                start = time.perf_counter()
                result = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(
                    temperature=0.0, max_tokens=SERVED_TOKENS, ignore_eos=True,
                    detokenize=False), use_tqdm=False)[0].outputs[0].token_ids
                out["grouped"].update(prompt_tokens=length, seconds=time.perf_counter() - start,
                                      token_ids=list(result))
            llm.llm_engine.engine_core.shutdown()
            del llm
        out["grouped"]["mlx_lm_token_ids"] = mlx_lm_greedy(load_model(folder), config, prompt)
    return out


def mlx_lm_greedy(model, config: dict, prompt: list[int]) -> list[int]:
    """mlx-lm's own greedy generation: its model with its caches (rotating for the windows)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache, tokens = make_prompt_cache(model), []
    logits = model(mx.array([prompt]), cache=cache)[0, -1]
    for _ in range(SERVED_TOKENS):
        tokens.append(int(mx.argmax(logits)))
        logits = model(mx.array([[tokens[-1]]]), cache=cache)[0, -1]
    return tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-gib", type=float, default=4.0)
    parser.add_argument("--ceiling", type=int, default=1 << 20, help="context ceiling, tokens")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--out", type=Path, default=Path("results/kv_budget.json"))
    parser.add_argument("--serve", action="store_true", help="also the served run (minutes)")
    a = parser.parse_args()
    logging.getLogger("vllm").setLevel(logging.WARNING)
    budget = int(a.budget_gib * GiB)
    rows = []
    for name, shape in GEMMA3.items():
        grouped = fit(shape, budget, True, a.ceiling, a.max_num_batched_tokens)
        full = fit(shape, budget, False, a.ceiling, a.max_num_batched_tokens)
        rows.append(dict(model=name, **shape, grouped=grouped, all_full=full,
                         ratio=grouped["max_model_len"] / full["max_model_len"]))
        print(f"{name:12s} window {shape['window']:5d}: longest context {full['max_model_len']:8d} "
              f"tokens with all layers full, {grouped['max_model_len']:8d} grouped "
              f"({grouped['groups']} groups), {rows[-1]['ratio']:.2f}x")
    result = dict(budget_bytes=budget, block_size=BLOCK_SIZE, dtype="bfloat16",
                  ceiling=a.ceiling, max_num_batched_tokens=a.max_num_batched_tokens, models=rows)
    if a.serve:
        result["served"] = served = serve(a.ceiling)
        grouped = served["grouped"]
        print(f"served: all layers full fit {served['all_full']['max_model_len']} tokens, grouped "
              f"{grouped['max_model_len']}; a {grouped['prompt_tokens']}-token prompt served "
              f"grouped in {grouped['seconds']:.1f} s, tokens "
              f"{'equal to' if grouped['token_ids'] == grouped['mlx_lm_token_ids'] else 'NOT'} "
              "mlx-lm's")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
