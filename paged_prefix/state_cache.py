"""The recurrent layers' states in vLLM's state blocks: per layer, every block's state arrays.

A recurrent layer (Qwen3-Next's gated delta net, LFM2's short conv) keeps one fixed-size state
per sequence: (conv, recurrent) or (conv,). Each layer here holds one array per state kind,
`[num_blocks, *shape]`, indexed by the vLLM block ids of its state group (docs/hybrid.md: a
store of its own beside the K/V pages, and why).

Per forward (`StateMetadata`, built once and checked):

    starts = cache.read(meta)                  every layer's starting states, evaluated
    layer l: cache.write(l, meta, states)      its end states into their blocks, in place

All reads come first and are evaluated before the first write: MLX updates an array in place
only while nothing else holds its buffer, and a gather from it still pending would hold it (the
write would then copy the whole array; `tests/test_state_cache.py` measures that it does not).
A fresh sequence reads zeros and never its block's bytes (a previous owner's).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx

from .state_metadata import StateMetadata
from .validate import as_int


@dataclass(frozen=True)
class StateSpec:
    """One recurrent layer's state per sequence: each array's shape, the dtype it is stored in
    (vLLM's MambaSpec dtypes) and the dtype the layer computes it in (mlx-lm's: the conv state
    in the layer's dtype, the recurrent state in float32); `group`: its state group."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[mx.Dtype, ...]
    compute_dtypes: tuple[mx.Dtype, ...]
    group: int

    def __post_init__(self):
        if not self.shapes or not len(self.shapes) == len(self.dtypes) == \
                len(self.compute_dtypes):
            raise ValueError(f"shapes: expected one dtype and one compute dtype per state "
                             f"array, got {self.shapes}, {self.dtypes}, {self.compute_dtypes}")

    @property
    def nbytes(self) -> int:
        """Bytes of one block's state (unpadded)."""
        return sum(math.prod(s) * d.size for s, d in zip(self.shapes, self.dtypes))


class RecurrentStateCache:
    """Per recurrent layer (in model order), its states of every block."""

    def __init__(self, specs: Sequence[StateSpec], num_blocks: int):
        self.num_blocks = as_int(num_blocks, "num_blocks", low=1)
        if not specs:
            raise ValueError("specs: a state cache needs at least one recurrent layer")
        self.specs = tuple(specs)
        self.num_groups = max(s.group for s in self.specs) + 1
        self._arrays = [[mx.zeros((self.num_blocks, *shape), dtype)
                         for shape, dtype in zip(s.shapes, s.dtypes)] for s in self.specs]
        mx.eval(self._arrays)

    @property
    def num_layers(self) -> int:
        return len(self.specs)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for arrays in self._arrays for a in arrays)

    def _check(self, meta: StateMetadata) -> None:
        if not isinstance(meta, StateMetadata):
            raise ValueError(f"meta: expected build_state_metadata's StateMetadata, got "
                             f"{type(meta).__name__}")
        if len(meta.groups) != self.num_groups:
            raise ValueError(f"meta: {len(meta.groups)} state groups, the cache has "
                             f"{self.num_groups}")
        for rows in meta.groups:
            if max(rows.src_host.max(), rows.dst_host.max()) >= self.num_blocks:
                raise ValueError(f"meta: a state block id past the cache's {self.num_blocks} "
                                 "blocks")

    def read(self, meta: StateMetadata) -> tuple[tuple[mx.array, ...], ...]:
        """Every layer's starting states, [S, *shape] each in its compute dtype (zeros for a
        fresh sequence), evaluated: no read is pending when the first write is built."""
        self._check(meta)
        starts = []
        for spec, arrays in zip(self.specs, self._arrays):
            rows = meta.groups[spec.group]
            starts.append(tuple(
                mx.where(rows.fresh.reshape(-1, *[1] * (a.ndim - 1)), mx.zeros((), dtype),
                         a[rows.src].astype(dtype))
                for a, dtype in zip(arrays, spec.compute_dtypes)))
        mx.eval(starts)
        return tuple(starts)

    def write(self, layer: int, meta: StateMetadata, states: Sequence[mx.array]) -> None:
        """Store layer `layer`'s end states ([S, *shape] each) in their destination blocks;
        lazily, so the write joins the layer's graph."""
        layer = as_int(layer, "layer", low=0, high=self.num_layers - 1)
        spec, arrays = self.specs[layer], self._arrays[layer]
        want = [(meta.num_seqs, *shape) for shape in spec.shapes]
        if [tuple(s.shape) for s in states] != want:
            raise ValueError(f"states: expected shapes {want}, got "
                             f"{[tuple(s.shape) for s in states]}")
        dst = meta.groups[spec.group].dst
        for i, (state, dtype) in enumerate(zip(states, spec.dtypes)):
            arrays[i][dst] = state if state.dtype == dtype else state.astype(dtype)

    def arrays(self) -> list[mx.array]:
        """Every layer's state arrays as they are now, e.g. to evaluate pending writes."""
        return [a for arrays in self._arrays for a in arrays]

    def blocks(self, layer: int) -> tuple[mx.array, ...]:
        """Layer `layer`'s state arrays, [num_blocks, *shape] each."""
        return tuple(self._arrays[layer])

    def snapshot(self) -> list[list[mx.array]]:
        """The arrays as they are now, for `restore` after a forward that raised before it was
        evaluated (its writes are lazy: restoring drops them). Drop the snapshot before
        evaluating a forward that succeeded: while it lives, a write copies the array."""
        return [[a.reshape(a.shape) for a in arrays] for arrays in self._arrays]

    def restore(self, snapshot: list[list[mx.array]]) -> None:
        if [len(a) for a in snapshot] != [len(a) for a in self._arrays]:
            raise ValueError("snapshot: not this cache's")
        self._arrays = [list(arrays) for arrays in snapshot]
