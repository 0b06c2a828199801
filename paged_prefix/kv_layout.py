"""Which layers share a block table, and which share their K/V arrays.

vLLM's hybrid KV-cache manager splits a model's layers into KV-cache groups: the layers of one
group read and write through one block table (full attention, or one sliding window). Every
group draws its block ids from one pool, and vLLM sizes that pool so that each block holds one
page for each of the largest group's layers: the layers of different groups share memory (their
`kv_cache_tensors` alias), which is sound because a block belongs to one group at a time. A
5 sliding : 1 full model keeps one array pair where it would keep six.

Which layers of different groups share an array is ours to choose (no connector reads these
bytes; the platform refuses them), and it matters: MLX updates an array in place only while
nothing else holds its buffer, and a layer's attention holds it until the device has run it. So
a layer that writes into an array an earlier layer of the same forward wrote must wait for the
device first (`wait_before`), or MLX copies the whole array. Layers are given arrays in layer
order, an array that the current round of layers has not written yet where one is left, so a
forward waits about once per `num_arrays` layers rather than at every layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .validate import as_int


@dataclass(frozen=True)
class KVGroup:
    """The layers of one KV-cache group and its sliding window: None keeps
    every block of a sequence; with W, blocks wholly before a sequence's first visible key
    (`reference.key_start`) are never read and may be vLLM's null block or another request's."""

    layers: tuple[int, ...]
    window: int | None = None


@dataclass(frozen=True)
class KVLayout:
    """The groups of a model's layers and the array pair each layer's K/V live in."""

    groups: tuple[KVGroup, ...]
    group_of: tuple[int, ...]  # per layer: its group's index
    array_of: tuple[int, ...]  # per layer: its K/V array pair's index
    wait_before: frozenset[int]  # layers whose array an earlier layer of a forward wrote

    @property
    def num_layers(self) -> int:
        return len(self.group_of)

    @property
    def num_arrays(self) -> int:
        return max(self.array_of) + 1

    @property
    def windows(self) -> tuple[int | None, ...]:
        return tuple(g.window for g in self.groups)

    @classmethod
    def single(cls, num_layers: int) -> KVLayout:
        """One full-attention group: every layer its own arrays (models without groups)."""
        return cls.of([KVGroup(tuple(range(num_layers)))], num_layers)

    @classmethod
    def of(cls, groups: Sequence[KVGroup], num_layers: int) -> KVLayout:
        """Check that `groups` split layers 0 .. num_layers - 1 and give each layer an array;
        ValueError naming the field otherwise."""
        num_layers = as_int(num_layers, "num_layers", low=1)
        if not groups:
            raise ValueError("groups: a KV layout needs at least one group")
        group_of: dict[int, int] = {}
        for g, group in enumerate(groups):
            if not isinstance(group, KVGroup) or not group.layers:
                raise ValueError(f"groups[{g}]: expected a KVGroup with at least one layer, got "
                                 f"{group!r}")
            if group.window is not None:
                as_int(group.window, f"groups[{g}].window", low=1)
            for layer in group.layers:
                as_int(layer, f"groups[{g}].layers", low=0, high=num_layers - 1)
                if layer in group_of:
                    raise ValueError(f"groups: layer {layer} is in groups {group_of[layer]} "
                                     f"and {g}")
                group_of[layer] = g
        missing = sorted(set(range(num_layers)) - set(group_of))
        if missing:
            raise ValueError(f"groups: layers {missing} are in no group")
        owner = tuple(group_of[i] for i in range(num_layers))
        array_of, wait_before = _assign_arrays(owner, max(len(g.layers) for g in groups))
        return cls(tuple(groups), owner, array_of, wait_before)


def _assign_arrays(group_of: tuple[int, ...], num_arrays: int) -> tuple[tuple[int, ...],
                                                                       frozenset[int]]:
    """Per layer an array no other layer of its group has (so `num_arrays`, the largest
    group's size, suffice), preferring one the current round has not written; a layer that
    finds none starts a new round, and waits."""
    used: dict[int, set[int]] = {}  # per group, its layers' arrays
    written: set[int] = set()  # this round's
    array_of, waits = [], set()
    for layer, group in enumerate(group_of):
        free = [a for a in range(num_arrays) if a not in used.setdefault(group, set())]
        fresh = [a for a in free if a not in written]
        if not fresh:
            waits.add(layer)
            written, fresh = set(), free
        array_of.append(fresh[0])
        used[group].add(fresh[0])
        written.add(fresh[0])
    return tuple(array_of), frozenset(waits)
