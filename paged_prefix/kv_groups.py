"""vLLM's KV-cache groups, both ways: each layer's spec for vLLM, and the cache layout vLLM's
`KVCacheConfig` sends back, checked.

    specs = layer_specs(windows, block_size, num_kv_heads, head_size, dtype)  # get_kv_cache_spec
    layout, spec = cache_layout(kv_cache_config, windows)                  # initialize_kv_cache
    kv_cache_config(vllm_config, specs, num_blocks)   # vLLM's own grouping, without its engine

A full-attention layer reports `FullAttentionSpec`, a sliding-window one
`SlidingWindowSpec(sliding_window=W)`. With the hybrid KV-cache manager on (the platform
supports it) vLLM groups the layers by spec (`kv_cache_utils.get_kv_cache_groups`), frees a
windowed group's blocks once no query can see them (its null block, id 0, takes their place in
vLLM's lists), follows the window's rules for prefix hits, and sizes one block pool for all
groups whose `kv_cache_tensors` alias. With it off (`--disable-hybrid-kv-cache-manager`) every
layer is one full-attention group and windowed layers mask within blocks that are all kept.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch
from vllm.config import VllmConfig
from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    KVQuantMode,
    SlidingWindowSpec,
)

from .kv_layout import KVGroup, KVLayout

LAYER_NAME = "model.layers.{}.self_attn.attn"
_LAYER = re.compile(r"model\.layers\.(\d+)\.self_attn\.attn")
# Per layer [num_blocks, block_size, num_kv_heads, head_dim] (vllm-metal's): layer-outermost.
LAYOUT = "LBNHC"


def layer_specs(windows: Sequence[int | None], block_size: int, num_kv_heads: int,
                head_size: int, dtype: torch.dtype) -> dict[str, KVCacheSpec]:
    """Each layer's vLLM spec by name: full attention, or its sliding window."""
    common = dict(block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size,
                  dtype=dtype)
    return {LAYER_NAME.format(i): FullAttentionSpec(**common) if w is None
            else SlidingWindowSpec(sliding_window=w, **common) for i, w in enumerate(windows)}


def kv_cache_config(vllm_config: VllmConfig, specs: dict[str, KVCacheSpec],
                    num_blocks: int) -> KVCacheConfig:
    """vLLM's groups of `specs` over a pool of `num_blocks` blocks, as its engine core builds
    them from a worker's specs and budget (for the offline engine and tests). Resolves the
    config's KV layout to this cache's, as the engine core does."""
    vllm_config.cache_config.kv_cache_layout = LAYOUT
    groups = get_kv_cache_groups(vllm_config, dict(specs))
    per_block = max(len(g.layer_names) for g in groups) * groups[0].kv_cache_spec.page_size_bytes
    config = get_kv_cache_config_from_groups(vllm_config, groups, num_blocks * per_block)
    config.kv_cache_layout = LAYOUT
    return config


def blocks_held(spec: KVCacheSpec, num_tokens: int, in_flight: int) -> int:
    """The most blocks vLLM holds at once (and admits a request on) for `num_tokens` tokens in
    a group of `spec`: a window recycles its blocks, past the tokens in flight
    (`VllmConfig.max_in_flight_tokens`)."""
    blocks = -(-num_tokens // spec.block_size)
    if not isinstance(spec, SlidingWindowSpec):
        return blocks
    return min(blocks, spec.max_admission_blocks_per_request(in_flight, num_tokens))


def cache_layout(config: KVCacheConfig,
                 windows: Sequence[int | None]) -> tuple[KVLayout, AttentionSpec]:
    """The layout of `config` for a model whose layers attend with `windows`, and the page spec
    all its groups share; ValueError naming the field for anything this cache cannot hold."""
    if config.kv_cache_layout not in (None, LAYOUT):
        raise ValueError(f"kv_cache_config: layout {config.kv_cache_layout!r}, this cache "
                         f"stores {LAYOUT}")
    groups, spec = [], None
    for g, group in enumerate(config.kv_cache_groups):
        page = _page_spec(group.kv_cache_spec, g)
        if spec is not None and page != spec:
            raise ValueError(f"kv_cache_config: group {g}'s pages ({_describe(page)}) differ "
                             f"from group 0's ({_describe(spec)}); this cache holds one shape")
        spec = page
        layers = sorted(_layer_index(name, len(windows)) for name in group.layer_names)
        window = _window(group.kv_cache_spec, g, layers, windows)
        groups.append(KVGroup(tuple(layers), window))
    if spec is None:
        raise ValueError("kv_cache_config: no KV-cache group")
    layout = KVLayout.of(groups, len(windows))
    _check_tensors(config, layout, spec)
    return layout, spec


def _page_spec(spec: KVCacheSpec, g: int) -> AttentionSpec:
    """What a group's page holds, the same for full and windowed groups."""
    if type(spec) not in (FullAttentionSpec, SlidingWindowSpec):
        raise ValueError(f"kv_cache_config: group {g} is {type(spec).__name__}; this cache "
                         "holds full-attention and sliding-window groups")
    if spec.kv_quant_mode != KVQuantMode.NONE or spec.page_size_padded is not None or \
            spec.head_size_v != spec.head_size:
        raise ValueError(f"kv_cache_config: group {g}'s pages are quantized, padded or of "
                         "unequal K and V heads, which this cache does not store")
    if isinstance(spec, FullAttentionSpec) and (spec.attention_chunk_size is not None
                                                or spec.non_causal):
        raise ValueError(f"kv_cache_config: group {g} is chunked-local or non-causal "
                         "attention, which this runner does not run")
    return FullAttentionSpec(block_size=spec.block_size, num_kv_heads=spec.num_kv_heads,
                             head_size=spec.head_size, dtype=spec.dtype)


def _describe(page: AttentionSpec) -> str:
    return (f"{page.block_size} tokens of {page.num_kv_heads} kv heads of {page.head_size}, "
            f"{page.dtype}")


def _layer_index(name: str, num_layers: int) -> int:
    match = _LAYER.fullmatch(name)
    if match is None or int(match[1]) >= num_layers:
        raise ValueError(f"kv_cache_config: layer {name!r} is not one of the model's "
                         f"{num_layers} ({LAYER_NAME.format('i')})")
    return int(match[1])


def _window(spec: KVCacheSpec, g: int, layers: list[int],
            windows: Sequence[int | None]) -> int | None:
    """The group's window: a windowed group's layers attend with its window; a full group keeps
    every block, so its layers may attend with any (vLLM's unified spec when the hybrid
    manager is off)."""
    if not isinstance(spec, SlidingWindowSpec):
        return None
    wrong = [i for i in layers if windows[i] != spec.sliding_window]
    if wrong:
        raise ValueError(f"kv_cache_config: group {g} frees blocks outside a window of "
                         f"{spec.sliding_window}, but layers {wrong} attend with "
                         f"{[windows[i] for i in wrong]}")
    return spec.sliding_window


def _check_tensors(config: KVCacheConfig, layout: KVLayout, spec: AttentionSpec) -> None:
    """vLLM's tensors give each layer a region of num_blocks pages, the layers of one group
    apart, groups overlaid from byte 0. The largest group's tensor thus holds one region per
    layer: this cache's array pairs, as many as that group's layers, take no more."""
    page, n = spec.page_size_bytes, config.num_blocks
    seen: dict[int, int] = {}
    for t, tensor in enumerate(config.kv_cache_tensors):
        layers = [_layer_index(name, layout.num_layers) for name in tensor.layers]
        strides = (tensor.layer_stride, tensor.block_stride)
        if len({layout.group_of[i] for i in layers}) > 1 or strides != (n * page, page) \
                or tensor.offset + len(layers) * n * page > tensor.size:
            raise ValueError(f"kv_cache_config: kv_cache_tensors[{t}] is not {len(layers)} "
                             f"regions of {n} pages of {page} bytes within one group")
        for i in layers:
            if i in seen:
                raise ValueError(f"kv_cache_config: layer {i} is in kv_cache_tensors[{seen[i]}] "
                                 f"and [{t}]")
            seen[i] = t
    missing = sorted(set(range(layout.num_layers)) - set(seen))
    if missing:
        raise ValueError(f"kv_cache_config: layers {missing} are in no kv_cache_tensors entry")
