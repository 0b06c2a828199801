"""A hybrid model's caches under vLLM: the block sizes, each layer's vLLM spec, and which of
vLLM's KV-cache groups are attention and which recurrent state (docs/hybrid.md).

    align_cache(vllm_config, config)   the platform: vLLM's block sizes for a hybrid model
    hybrid_block_size(...)     vLLM's formula for them
    kernel_block_size(B)       the attention kernels' block: B is B // b kernel blocks
    kernel_block_ids(ids, r)   a vLLM block id as r kernel blocks of one contiguous view
    layer_specs(...)           each layer's spec for vLLM (attention, MambaSpec)
    CacheGroups.of(config)     vLLM's KV-cache groups split by kind, checked
    rows_of(lists, ...)        a request's block lists: attention row (kernel ids), state rows
    step_states(...)           a step's state rows (`state_metadata.py`)
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
import torch
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator
from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
)

from jit_kernels.geometry import BLOCK_SIZES

from .architectures.base import RecurrentLayer
from .state_cache import RecurrentStateCache, StateSpec
from .state_metadata import (
    StateMetadata,
    StateRequest,
    build_state_metadata,
    current_state_blocks,
)
from .validate import as_ints

ATTENTION_LAYER = "model.layers.{}.self_attn.attn"
_LAYER_INDEX = re.compile(r"model\.layers\.(\d+)\.")
# The kernels' block inside vLLM's: the largest tested one up to the default 16 (the block size
# the dispatch rules were measured at) that divides it.
KERNEL_BLOCK_MAX = 16


def state_layer_name(layer: int, rec: RecurrentLayer) -> str:
    return f"model.layers.{layer}.{rec.attribute}"


def hybrid_block_size(state_page_bytes: int, attention_bytes_per_token: int,
                      align: int) -> int:
    """vLLM's formula (`Platform._align_hybrid_block_size`): the smallest multiple of `align`
    tokens whose attention page holds a state page."""
    return align * math.ceil(state_page_bytes / (align * attention_bytes_per_token))


def kernel_block_size(block_size: int) -> int:
    """The attention kernels' block inside vLLM's `block_size`."""
    fits = [b for b in BLOCK_SIZES if b <= KERNEL_BLOCK_MAX and block_size % b == 0]
    if not fits:
        raise ValueError(f"block_size: {block_size} is not a multiple of a kernel block size "
                         f"{BLOCK_SIZES}")
    return max(fits)


def kernel_block_ids(block_ids: Sequence[int], ratio: int) -> list[int]:
    """vLLM block `id` as kernel blocks id * ratio .. id * ratio + ratio - 1: the KV arrays are
    one contiguous run of rows, so a vLLM block of B tokens is `ratio` kernel blocks of B / ratio
    with no copy (vllm-metal's `build_block_tables` does the same)."""
    ids = np.asarray(block_ids, dtype=np.int64)
    return (ids[:, None] * ratio + np.arange(ratio)).reshape(-1).tolist()


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


@dataclass(frozen=True)
class CacheGroups:
    """vLLM's KV-cache groups of a model, by kind: the one attention group's index and its
    spec, and per state group (in vLLM's order) its index; per recurrent layer its state
    group and stored dtypes."""

    attention: int
    attention_spec: FullAttentionSpec
    states: tuple[int, ...]
    state_specs: tuple[StateSpec, ...]  # per recurrent layer, in layer order
    state_block_size: int

    @property
    def num_groups(self) -> int:
        return 1 + len(self.states)

    @classmethod
    def of(cls, config: KVCacheConfig, recurrent: Sequence[RecurrentLayer | None],
           dtypes: Mapping[torch.dtype, mx.Dtype]) -> CacheGroups:
        """The groups of `config` for a model whose recurrent layers are `recurrent` (None on
        attention layers), states stored in `dtypes`' MLX types; ValueError naming the field
        for anything this runner cannot hold."""
        attention, states, state_of, block_sizes = [], [], {}, set()
        for g, group in enumerate(config.kv_cache_groups):
            spec = group.kv_cache_spec
            layers = []
            for name in group.layer_names:
                match = _LAYER_INDEX.match(name)
                if match is None or int(match[1]) >= len(recurrent):
                    raise ValueError(f"kv_cache_config: layer {name!r} is not one of the "
                                     f"model's {len(recurrent)}")
                layers.append(int(match[1]))
            if type(spec) is FullAttentionSpec:
                if any(recurrent[i] is not None for i in layers):
                    raise ValueError(f"kv_cache_config: group {g} is attention over recurrent "
                                     "layers")
                attention.append((g, spec))
            elif type(spec) is MambaSpec:
                _check_state_spec(spec, g, [recurrent[i] for i in layers], dtypes)
                states.append(g)
                block_sizes.add(spec.block_size)
                state_of.update({i: (len(states) - 1, spec) for i in layers})
            else:
                raise ValueError(f"kv_cache_config: group {g} is {type(spec).__name__}; a "
                                 "hybrid model's cache holds full attention and state groups")
        if len(attention) != 1:
            raise ValueError(f"kv_cache_config: {len(attention)} attention groups; this runner "
                             "holds a hybrid model's attention layers in one")
        missing = [i for i, r in enumerate(recurrent) if r is not None and i not in state_of]
        if missing or len(block_sizes) != 1:
            raise ValueError(f"kv_cache_config: recurrent layers {missing} in no state group, "
                             f"or state block sizes {sorted(block_sizes)} differ")
        specs = []
        for i in sorted(state_of):
            group, spec = state_of[i]
            specs.append(StateSpec(recurrent[i].shapes,
                                   tuple(dtypes[d] for d in spec.dtypes),
                                   recurrent[i].compute_dtypes, group))
        return cls(attention[0][0], attention[0][1], tuple(states), tuple(specs),
                   block_sizes.pop())

    def split(self, rows: Sequence[Sequence[int]]) -> tuple[Sequence[int], tuple]:
        """A request's block ids, one row per vLLM group: (attention row, state rows)."""
        return rows[self.attention], tuple(rows[g] for g in self.states)


def _check_state_spec(spec: MambaSpec, g: int, layers: list[RecurrentLayer | None],
                      dtypes: Mapping[torch.dtype, mx.Dtype]) -> None:
    if any(r is None for r in layers):
        raise ValueError(f"kv_cache_config: state group {g} holds attention layers")
    shapes = {r.shapes for r in layers}
    if shapes != {tuple(map(tuple, spec.shapes))}:
        raise ValueError(f"kv_cache_config: state group {g}'s shapes {spec.shapes} are not its "
                         f"layers' {sorted(shapes)}")
    if spec.mamba_cache_mode not in ("none", "align"):
        raise ValueError(f"kv_cache_config: state group {g} in mamba_cache_mode "
                         f"{spec.mamba_cache_mode!r}; this runner keeps 'none' and 'align'")
    if spec.num_speculative_blocks or spec.num_prefill_checkpoint_blocks:
        raise ValueError(f"kv_cache_config: state group {g} has speculative or prefill "
                         "checkpoint blocks, which this runner does not write")
    if any(d not in dtypes for d in spec.dtypes):
        raise ValueError(f"kv_cache_config: state group {g}'s dtypes {spec.dtypes} are not "
                         f"among {list(dtypes)}")


@dataclass(frozen=True)
class HybridLimits:
    """What a hybrid model's block lists are checked against: vLLM's groups, its pool, and how
    many kernel blocks make one of its attention blocks."""

    groups: CacheGroups
    num_blocks: int  # vLLM's pool (state ids index it; attention ids, times `ratio`, the cache)
    ratio: int
    conv_kernel: int  # the recurrent layers' conv width (the state plan's)


def rows_of(lists: Sequence[Sequence[int]], req_id: str,
            hybrid: HybridLimits) -> tuple[list[int], tuple[tuple[int, ...], ...]]:
    """A request's block lists, one per vLLM group, as (its attention row in kernel block ids,
    its state rows in vLLM's ids); each id a block of vLLM's pool."""
    if not isinstance(lists, (tuple, list)) or len(lists) != hybrid.groups.num_groups:
        raise ValueError(f"block_ids: request {req_id!r} must carry one block list per "
                         f"KV-cache group ({hybrid.groups.num_groups}), got {lists!r}")
    checked = [as_ints(ids, f"block_ids ({req_id!r}, group {g})", low=0,
                       high=hybrid.num_blocks - 1).tolist() for g, ids in enumerate(lists)]
    attention, states = hybrid.groups.split(checked)
    return kernel_block_ids(attention, hybrid.ratio), tuple(map(tuple, states))


def step_states(requests: Mapping, req_ids: Sequence[str], computed: Mapping[str, int],
                scheduled: Mapping[str, int], hybrid: HybridLimits,
                ledger: Mapping) -> StateMetadata:
    """The step's state rows (`state_metadata.build_state_metadata`) from the live request
    states (`requests.RequestState`: `state_rows`, token history, `num_computed`)."""
    in_step = set(req_ids)
    block = hybrid.groups.state_block_size
    held = {key: r for r, s in requests.items() if r not in in_step
            for key in current_state_blocks(s.num_computed, s.state_rows, block)}
    states = [StateRequest(r, computed[r], scheduled[r], requests[r].state_rows,
                           requests[r].prompt_token_ids, requests[r].output_token_ids)
              for r in req_ids]
    return build_state_metadata(states, len(hybrid.groups.states), block, hybrid.num_blocks,
                                hybrid.conv_kernel, ledger, held)


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
