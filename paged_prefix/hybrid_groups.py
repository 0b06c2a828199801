"""vLLM's KV-cache groups of a hybrid model at the runner's boundary: which are attention and
which recurrent state, and a step's block lists as kernel blocks and state rows (docs/hybrid.md).

    CacheGroups.of(config)     vLLM's KV-cache groups split by kind, checked
    kernel_block_size(B)       the attention kernels' block: B is B // b kernel blocks
    kernel_block_ids(ids, r)   a vLLM block id as r kernel blocks of one contiguous view
    rows_of(lists, ...)        a request's block lists: attention row (kernel ids), state rows
    step_states(...)           a step's state rows (`state_metadata.py`)
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, MambaSpec

from jit_kernels.geometry import BLOCK_SIZES

from .architectures.base import RecurrentLayer
from .state_cache import StateSpec
from .state_metadata import (
    StateMetadata,
    StateRequest,
    build_state_metadata,
    current_state_blocks,
)
from .validate import as_ints

_LAYER_INDEX = re.compile(r"model\.layers\.(\d+)\.")
# The kernels' block inside vLLM's: the largest tested one up to the default 16 (the block size
# the dispatch rules were measured at) that divides it.
KERNEL_BLOCK_MAX = 16



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
