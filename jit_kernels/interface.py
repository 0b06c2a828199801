"""The one interface every attention executor implements, and the paged kernels' common base.

    plan = kernel.plan(lengths, geometry, block_tables, seqs)        # once per forward
    kernel.check(q, k, v, k_cache, v_cache, plan, sinks)             # the first layer's check
    out = kernel.run(q, k, v, k_cache, v_cache, plan, out, sinks)    # every layer: launches

`run` returns [T, H, D] with the rows of the plan's sequences computed; the rows of other
sequences come from `out` when given (written into it where MLX can do so in place) and are
unspecified otherwise. A forward whose sequences take several executors runs them in turn,
each on the output of the one before. q [T, H, D] and the new rows k, v [T, Hkv, D] (already
written into the caches) follow `reference.contract`; the caches
come as `PagedKVCache` stores them or as [num_blocks, BS, Hkv, D] of the plan's dtype. `sinks`
([H] float32, the layer's own) is passed exactly when the plan's geometry has sinks; the window
and cap are the geometry's. An executor that does not implement a variant says so in
`unsupported_reason`, and the route sends those calls elsewhere.

Executors: the CUDA paged kernel (mma.sync; wgmma on Hopper), the Metal paged kernel, the
Hopper prefill kernel, SDPA over new rows or pages read in place, SDPA over gathered pages
(a backend's gather kernel, or MLX's take), and the reference.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

import mlx.core as mx

from .arrays import check_call
from .geometry import Geometry, Lengths, unsupported_reason


@dataclass(frozen=True)
class Plan:
    """What every plan holds; executors add their launch arguments."""

    geometry: Geometry
    lengths: Lengths
    block_tables: mx.array  # int32 [S, max_blocks], the forward's device table
    seqs: tuple[int, ...]  # the planned sequences, increasing batch indices

    @cached_property  # read by every layer's launches
    def whole(self) -> bool:
        """Whether the plan covers every sequence of the batch."""
        return len(self.seqs) == self.lengths.num_seqs


class AttentionKernel(Protocol):
    name: str

    def unsupported_reason(self, geometry: Geometry) -> str | None:
        """Why this executor cannot run calls of this geometry, or None when it can."""

    def canary_plannings(self, geometry: Geometry) -> tuple[dict, ...]:
        """The plan options whose kernels a first-use check must run (one per compiled
        variant the plans may choose); () for an executor with no kernel of its own."""

    def plan(self, lengths: Lengths, geometry: Geometry, block_tables: mx.array,
             seqs: tuple[int, ...] | None = None, **options) -> Plan:
        """One forward's plan from checked host lengths; `seqs` None plans all sequences."""

    def check(self, q: mx.array, k: mx.array, v: mx.array, k_cache: mx.array,
              v_cache: mx.array, plan: Plan, sinks: mx.array | None = None) -> None:
        """Raise ValueError naming the first array that does not fit the plan."""

    def run(self, q: mx.array, k: mx.array, v: mx.array, k_cache: mx.array, v_cache: mx.array,
            plan: Plan, out: mx.array | None = None,
            sinks: mx.array | None = None) -> mx.array:
        """The plan's rows of the attention output; no host sync."""


def refuse_unsupported(kernel: AttentionKernel, geometry: Geometry) -> None:
    why_not = kernel.unsupported_reason(geometry)
    if why_not:
        raise ValueError(f"{kernel.name} attention cannot run this geometry: {why_not}")


def write_rows(out: mx.array | None, rows: mx.array, plan: Plan) -> mx.array:
    """`rows` [T, H, D] (an executor's whole output) as the plan's sequences' rows of `out`."""
    if out is None:
        return rows
    cu = plan.lengths.cu_seqlens_q
    for s in plan.seqs:
        out[int(cu[s]):int(cu[s + 1])] = rows[int(cu[s]):int(cu[s + 1])]
    return out


class PagedAttentionKernel:
    """What the CUDA and Metal paged kernels share: support rules, tile heights, the entry
    check, the output hand-off. Subclasses set `name`, `head_dims` and the variant `features` they implement,
    and implement `plan`,
    `tile_rows` and `launch`; kernels are built through `kernel_factory` (MLX's, or a test's
    stand-in) once per variant."""

    name: str
    head_dims: tuple[int, ...]
    features: tuple[str, ...] = ()

    def __init__(self, kernel_factory):
        self._factory = kernel_factory
        self._kernels: dict[tuple, object] = {}

    def unsupported_reason(self, geometry: Geometry) -> str | None:
        return unsupported_reason(geometry, self.head_dims, self.features)

    def tile_rows(self, geometry: Geometry) -> tuple[int, ...]:
        """The query-tile heights a plan may choose for this geometry, each its own kernel."""
        raise NotImplementedError

    def canary_plannings(self, geometry: Geometry) -> tuple[dict, ...]:
        return tuple({"block_m": rows} for rows in self.tile_rows(geometry))

    def _block_m(self, block_m: int | None, geometry: Geometry) -> int | None:
        """A caller's forced tile height, checked: None lets the plan choose."""
        if block_m is None:
            return None
        if isinstance(block_m, bool) or not isinstance(block_m, numbers.Integral) or \
                block_m not in self.tile_rows(geometry):
            raise ValueError(f"block_m: {self.name} plans query tiles of "
                             f"{self.tile_rows(geometry)} rows, not {block_m!r}")
        return int(block_m)

    @staticmethod
    def _split_kv_tiles(split_kv_tiles: int | None) -> int | None:
        """A caller's fewest kv tiles of a split part, checked: None takes the kernel's rule."""
        if split_kv_tiles is None:
            return None
        if isinstance(split_kv_tiles, bool) or not isinstance(split_kv_tiles, numbers.Integral) \
                or split_kv_tiles < 1:
            raise ValueError(f"split_kv_tiles: a positive int, not {split_kv_tiles!r}")
        return int(split_kv_tiles)

    def check(self, q, k, v, k_cache, v_cache, plan: Plan, sinks=None) -> None:
        check_call(self.name, plan.geometry, plan.lengths, q, k, v, k_cache, v_cache,
                   plan.block_tables, sinks)

    def run(self, q, k, v, k_cache, v_cache, plan: Plan, out=None, sinks=None) -> mx.array:
        return write_rows(out, self.launch(q, k_cache, v_cache, plan, sinks), plan)

    def launch(self, q: mx.array, k_cache: mx.array, v_cache: mx.array, plan: Plan,
               sinks: mx.array | None) -> mx.array:
        raise NotImplementedError
