"""A hybrid model under vLLM's configuration (docs/hybrid.md): the block sizes, each layer's
spec, the budget, and the forwards that profile and warm up before any request.

    align_cache(vllm_config, config)   the platform: vLLM's block sizes for a hybrid model
    hybrid_block_size(...)             vLLM's formula for them
    layer_specs(...)                   the worker: each layer's spec (attention, MambaSpec)
    budget_scale(vllm_config, specs)   the worker: what vLLM may size its pool from
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator
from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheSpec, MambaSpec

from .architectures.base import RecurrentLayer
from .hybrid_groups import kernel_block_size
from .state_cache import RecurrentStateCache, StateSpec
from .state_metadata import StateMetadata, StateRequest, build_state_metadata

ATTENTION_LAYER = "model.layers.{}.self_attn.attn"


def state_layer_name(layer: int, rec: RecurrentLayer) -> str:
    return f"model.layers.{layer}.{rec.attribute}"


def hybrid_block_size(state_page_bytes: int, attention_bytes_per_token: int,
                      align: int) -> int:
    """vLLM's formula (`Platform._align_hybrid_block_size`): the smallest multiple of `align`
    tokens whose attention page holds a state page."""
    return align * math.ceil(state_page_bytes / (align * attention_bytes_per_token))


def layer_specs(attention: Sequence[object | None], recurrent: Sequence[RecurrentLayer | None],
                attention_spec: FullAttentionSpec, state_dtypes: Sequence[torch.dtype],
                mamba_block_size: int, page_size_padded: int | None,
                mamba_cache_mode: str) -> dict[str, KVCacheSpec]:
    """Each layer's spec by name: attention layers `attention_spec`, recurrent ones a MambaSpec
    of their state (stored in `state_dtypes`)."""
    specs: dict[str, KVCacheSpec] = {}
    for i, (attn, rec) in enumerate(zip(attention, recurrent, strict=True)):
        if attn is not None:
            specs[ATTENTION_LAYER.format(i)] = attention_spec
            continue
        specs[state_layer_name(i, rec)] = MambaSpec(
            block_size=mamba_block_size, shapes=rec.shapes, dtypes=tuple(state_dtypes),
            page_size_padded=page_size_padded,
            mamba_type=MambaAttentionBackendEnum[rec.mamba_type],
            mamba_cache_mode=mamba_cache_mode)
    return specs


def recurrent_of_config(config: dict) -> list[RecurrentLayer | None]:
    """Each layer's recurrent module (None on attention layers) of a config, before any weight
    exists: mlx-lm's model class built with lazy weights that are never evaluated."""
    from .architectures import check_config
    from .architectures.base import no_recurrent_layers

    arch = check_config(config)
    if arch.recurrent is no_recurrent_layers:
        return [None] * config["num_hidden_layers"]
    return arch.recurrent(arch.module.Model(arch.model_args.from_dict(config)))


def state_dtypes(rec: RecurrentLayer, model_dtype: torch.dtype,
                 cache_config) -> tuple[torch.dtype, ...]:
    """The dtypes a layer's states are stored in, by vLLM's rules for its mamba_type."""
    if rec.mamba_type == "GDN_ATTN":
        return MambaStateDtypeCalculator.gated_delta_net_state_dtype(
            model_dtype, cache_config.mamba_cache_dtype, cache_config.mamba_ssm_cache_dtype)
    return MambaStateDtypeCalculator.short_conv_state_dtype(model_dtype,
                                                            cache_config.mamba_cache_dtype)


def state_page_bytes(rec: RecurrentLayer, dtypes: Sequence[torch.dtype]) -> int:
    return sum(math.prod(s) * d.itemsize for s, d in zip(rec.shapes, dtypes, strict=True))


def refused_setting(cache_config) -> str | None:
    """A vLLM setting for hybrid models that this runner does not implement, named."""
    settings = {
        "a prefix match unit below the block size (--prefix-match-unit: copy-on-write state "
        "blocks, kv_cache_block_copies)": cache_config.prefix_match_unit is not None
        and cache_config.prefix_match_unit < cache_config.block_size,
        "shared-prefix state checkpoints (enable_mamba_shared_prefix_checkpoint)":
            cache_config.enable_mamba_shared_prefix_checkpoint,
        "the ReplaySSM decode kernel (use_replayssm)": cache_config.use_replayssm,
    }
    return next((name for name, on in settings.items() if on), None)


def align_cache(vllm_config, config: dict) -> str:
    """For a hybrid model, what vLLM's `Platform._align_hybrid_block_size` would set, which
    returns before aligning anything on this platform (it finds the attention backends through
    vLLM's torch layers, and this worker builds none): `block_size` the smallest multiple of the
    configured one whose attention page holds a state page, `mamba_block_size` the same in
    align mode, `mamba_page_size_padded` the attention page; the recurrent state in float32
    where vLLM's default ("auto") would store it in the conv state's dtype (mlx-lm computes it in
    float32: a float32 store rounds nothing). Returns the log line."""
    recurrent = [r for r in recurrent_of_config(config) if r is not None]
    if not recurrent:
        raise ValueError(f"model_type: vLLM reads {config.get('model_type')!r} as a hybrid "
                         "model, but its architecture here has no recurrent layers")
    cache, model = vllm_config.cache_config, vllm_config.model_config
    if (refused := refused_setting(cache)) is not None:
        raise ValueError(f"paged_prefix: {refused} is not supported for hybrid models")
    if cache.mamba_ssm_cache_dtype == "auto":
        cache.mamba_ssm_cache_dtype = "float32"
    kv_dtype = kv_cache_dtype_str_to_dtype(cache.cache_dtype, model)
    per_token = FullAttentionSpec(
        block_size=1, num_kv_heads=model.get_num_kv_heads(vllm_config.parallel_config),
        head_size=model.get_head_size(), dtype=kv_dtype).page_size_bytes
    page = max(state_page_bytes(r, state_dtypes(r, model.dtype, cache)) for r in recurrent)
    kernel_block_size(cache.block_size)  # the configured size must hold kernel blocks
    block = hybrid_block_size(page, per_token, cache.block_size)
    cache.block_size = max(cache.block_size, block)
    if cache.mamba_cache_mode == "align":
        cache.mamba_block_size = cache.block_size
    padded = cache.block_size * per_token
    cache.mamba_page_size_padded = padded if padded != page else None
    return (f"hybrid model: block size {cache.block_size} (an attention page of "
            f"{padded} bytes holds a state page of {page}), mamba_cache_mode "
            f"{cache.mamba_cache_mode}, state blocks of {cache.mamba_block_size} tokens, "
            f"recurrent state stored in {cache.mamba_ssm_cache_dtype}")


def budget_scale(vllm_config, specs: Mapping[str, KVCacheSpec]) -> tuple[float, str]:
    """How much of a KV budget vLLM's block count may be sized from: vLLM sizes its pool for
    pages that alias across groups (a block id holds one group's pages at a time), this runner
    holds each block's attention pages and every recurrent layer's state apart (docs/hybrid.md),
    so the bytes it reports shrink by the ratio of the two. Returns it with a line for the log."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_groups

    groups = get_kv_cache_groups(vllm_config, dict(specs))
    aliased = max(len(g.layer_names) * g.kv_cache_spec.page_size_bytes for g in groups)
    own = sum(s.real_page_size_bytes if isinstance(s, MambaSpec) else s.page_size_bytes
              for s in specs.values())
    return aliased / own, (f"a block holds {own} bytes here ({len(specs)} layers' pages and "
                           f"states apart) where vLLM's aliased layout holds {aliased}")


def fresh_states(num_groups: int, conv_kernel: int, num_tokens: int) -> StateMetadata:
    """One fresh sequence of `num_tokens` writing state block 1 of every group: a profile or
    warm-up forward's state rows (blocks no request can hold yet, nothing committed)."""
    return build_state_metadata([StateRequest("profile", 0, num_tokens, [[1]] * num_groups,
                                              (0,) * num_tokens, ())],
                                num_groups, num_tokens, 2, conv_kernel, {}, {})


def profile_state_cache(model) -> tuple[RecurrentStateCache | None, int, int]:
    """A two-block state cache for a model's recurrent layers (each its own group, states in
    the dtypes mlx-lm computes them in), its conv width and its attention layer count; None
    and 0 for other models."""
    from .architectures import architecture

    recurrent = architecture(model.args.model_type).recurrent(model)
    layers = [r for r in recurrent if r is not None]
    if not layers:
        return None, 0, len(recurrent)
    specs = [StateSpec(r.shapes, r.compute_dtypes, r.compute_dtypes, g)
             for g, r in enumerate(layers)]
    return RecurrentStateCache(specs, 2), layers[0].shapes[0][0] + 1, recurrent.count(None)
