"""The paged KV cache: per layer K and V blocks, written in place by slot.

Layout per layer (vllm-metal's): `[num_blocks, block_size, num_kv_heads, head_dim]`. Layers of
different KV-cache groups may share one array pair (`kv_layout.py`: their block ids never meet,
and vLLM budgets the memory so); a forward then waits before the layers of `wait_before`. The
arrays are stored flat as `[num_blocks * block_size, num_kv_heads, head_dim]` because MLX
updates a scatter target in place only when the target is the sole owner of its buffer: a flat
array that this object alone holds is donated to the scatter, while scattering through a
reshaped view copies the whole cache first. `stored()` hands out the arrays as they are (what a
forward passes to attention: the gather kernel reads them as bytes, with no view op per layer),
`blocks()` the 4D view of the cache dtype.

On MLX's CPU backend (`heads_major`, what the worker picks there) each array keeps a kv head's
rows together instead, `[num_kv_heads, num_blocks * block_size, head_dim]`, as mlx-lm keeps its
own cache: that SDPA is plain matmuls, which read a head's rows in place only when they lie
together, and copying them out of the token-major rows cost a decode step 30-45% of mlx-lm's
attention time (docs/cpu.md). No kernel reads it (`Geometry.heads_major`).

Rows are stored as 4-byte words (a bf16 row of 128 values is 64 uint32): MLX's scatter moves
one element per thread, so wider elements write the same bytes with fewer threads, and its GPU
scatter takes nothing wider than 4 bytes. Readers get the cache dtype back through a zero-copy
`view`.

Writes take `Slots`, validated once per forward against this cache on the host (no padding
slots: every row written is a real token), so the per-layer write needs no host sync and an
out-of-range slot can never reach MLX's scatter, which does not bound-check. Slots that form a
few contiguous runs (a prefill into consecutive blocks, as a fresh vLLM block pool hands them
out) are written as slice updates, a plain copy; others by scatter, which on an H200 takes
about twice as long for the same rows (4096 rows of 8 x 128 bf16: 74 µs for K and V against
2 x 17 µs).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from jit_kernels.arrays import device_array
from jit_kernels.geometry import CALL_DTYPES

from .kv_layout import KVLayout
from .validate import as_int, as_ints, index_dtype

# More runs than this are scattered: each run is two slice-update ops to build per layer.
MAX_SLICE_RUNS = 4


def heads_major_here() -> bool:
    """The layout a server picks on this device: heads-major on MLX's CPU backend (its SDPA
    reads a kv head's rows in place), vLLM's token-major pages where the kernels run."""
    return mx.default_device() == mx.cpu


@dataclass(frozen=True, eq=False)
class Slots:
    """Cache rows of one forward's new tokens, checked against one cache (`PagedKVCache.slots`)."""

    cache_id: int
    count: int
    runs: tuple[tuple[int, int, int], ...]  # (first slot, first row, length); () to scatter
    device: mx.array | None  # int32 [T] slot per row, for the scatter; None with runs


class PagedKVCache:
    """K/V blocks for every layer of one model; `layout` (default: one full-attention group,
    an array pair per layer) says which layers share a block table and which an array pair."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: mx.Dtype = mx.float16,
        layout: KVLayout | None = None,
        heads_major: bool = False,
    ):
        for name, value in (("num_layers", num_layers), ("num_blocks", num_blocks),
                            ("block_size", block_size), ("num_kv_heads", num_kv_heads),
                            ("head_dim", head_dim)):
            as_int(value, name, low=1)
        if dtype not in CALL_DTYPES:  # what the attention's calls take
            raise ValueError(f"dtype must be one of {CALL_DTYPES}, got {dtype}")
        if not isinstance(heads_major, bool):
            raise ValueError(f"heads_major: expected a bool, got {heads_major!r}")
        layout = layout or KVLayout.single(num_layers)
        if not isinstance(layout, KVLayout) or layout.num_layers != num_layers:
            raise ValueError(f"layout: expected a KVLayout of {num_layers} layers, got {layout!r}")
        self.layout = layout
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.heads_major = heads_major
        rows = num_blocks * block_size
        # 4-byte words when a head's row divides into them (any even head_dim)
        wide = head_dim * dtype.size % 4 == 0
        self._storage = mx.uint32 if wide else dtype
        width = head_dim * dtype.size // 4 if wide else head_dim
        shape = (num_kv_heads, rows, width) if heads_major else (rows, num_kv_heads, width)
        self._k = [mx.zeros(shape, self._storage) for _ in range(layout.num_arrays)]
        self._v = [mx.zeros(shape, self._storage) for _ in range(layout.num_arrays)]
        mx.eval(self._k, self._v)

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Each KV-cache group's sliding window (None: full attention), in group order."""
        return self.layout.windows

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self._k + self._v)

    def slots(self, slot_mapping: np.ndarray, device: mx.array | None = None) -> Slots:
        """Validate host slot ids ([T] ints in [0, num_blocks * block_size), no repeats).

        device: the same ids already on the device (`BatchMetadata.slot_mapping`, built from
        the same host array), used by a scattered write in place of a fresh copy: a
        host-written array costs the first kernel that reads near it a page migration on a CUDA
        GPU. Only its shape and dtype are checked (its values would need a host sync): pass
        nothing but the copy made from `slot_mapping`."""
        rows = as_ints(slot_mapping, "slot_mapping", low=0,
                       high=self.num_blocks * self.block_size - 1)
        if device is not None and (device.shape != rows.shape
                                   or not mx.issubdtype(device.dtype, mx.integer)):
            raise ValueError(f"slot_mapping: the device copy must be {rows.shape} integers, "
                             f"got {device.shape} {device.dtype}")
        cuts = np.flatnonzero(np.diff(rows) != 1) + 1
        if len(rows) and len(cuts) < MAX_SLICE_RUNS:
            ends = np.concatenate([[0], cuts, [len(rows)]])
            runs = sorted((int(rows[a]), int(a), int(b - a)) for a, b in zip(ends, ends[1:]))
            # each run is distinct slots; runs sorted by first slot must not overlap
            if any(s + n > t for (s, _, n), (t, _, _) in zip(runs, runs[1:])):
                raise ValueError("slot_mapping: a slot is written twice in one forward")
            return Slots(id(self), len(rows), tuple(runs), None)
        ordered = np.sort(rows)
        if np.any(ordered[1:] == ordered[:-1]):
            raise ValueError("slot_mapping: a slot is written twice in one forward")
        if device is None:
            device = device_array(rows.astype(index_dtype(self.num_blocks * self.block_size)))
        return Slots(id(self), len(rows), (), device)

    def write(self, layer: int, keys: mx.array, values: mx.array, slots: Slots) -> None:
        """Copy new rows into their slots; lazily, so the write joins the layer's graph.

        keys, values: [T, num_kv_heads, head_dim] (cast to the cache dtype).
        """
        if not isinstance(slots, Slots) or slots.cache_id != id(self):
            raise ValueError("slots: expected this cache's PagedKVCache.slots(...)")
        if type(layer) is not int or not 0 <= layer < self.num_layers:  # every layer: cheap
            as_int(layer, "layer", low=0, high=self.num_layers - 1)
        want = (slots.count, self.num_kv_heads, self.head_dim)
        for name, rows in (("keys", keys), ("values", values)):
            if not isinstance(rows, mx.array) or not mx.issubdtype(rows.dtype, mx.floating):
                raise ValueError(f"{name}: expected a floating mx.array, got "
                                 f"{getattr(rows, 'dtype', type(rows).__name__)}")
        if keys.shape != want or values.shape != want:
            raise ValueError(f"keys, values: expected {want}, got {keys.shape} and {values.shape}")
        keys, values = self._stored(keys), self._stored(values)
        a = self.layout.array_of[layer]
        lead = ()  # the index of the row axis: 0, or 1 heads-major ([Hkv, T, W])
        if self.heads_major:
            keys, values, lead = keys.transpose(1, 0, 2), values.transpose(1, 0, 2), (slice(None),)
        for target, rows in ((self._k[a], keys), (self._v[a], values)):
            if not slots.runs:
                target[(*lead, slots.device)] = rows
            for slot, row, n in slots.runs:
                whole = n == slots.count  # no slice op on the rows
                target[(*lead, slice(slot, slot + n))] = \
                    rows if whole else rows[(*lead, slice(row, row + n))]

    def _stored(self, rows: mx.array) -> mx.array:
        if rows.dtype != self.dtype:
            rows = rows.astype(self.dtype)
        return rows if self._storage == self.dtype else rows.view(self._storage)

    def arrays(self, layers: range | None = None) -> list[mx.array]:
        """The current K and V arrays of `layers` (default: every layer), each once, e.g. to
        evaluate pending writes. Evaluating an array keeps it referenced until the device has
        run everything sent with it, and a write into a referenced array copies it: evaluate
        only the layers whose writes are pending."""
        if layers is None:
            return self._k + self._v
        held = list(dict.fromkeys(self.layout.array_of[i] for i in layers))
        return [self._k[a] for a in held] + [self._v[a] for a in held]

    def snapshot(self) -> list[mx.array]:
        """Views of every array as it is now, for `restore` after a failed forward.

        Writes are lazy and in place only when evaluated: restoring these drops the pending
        writes of a forward that raised before evaluation. Drop the snapshot before evaluating
        a forward that succeeded: while it lives the arrays are shared, and the write copies.
        """
        return [a.reshape(a.shape) for a in self._k + self._v]

    def restore(self, snapshot: list[mx.array]) -> None:
        n = self.layout.num_arrays
        if len(snapshot) != 2 * n:
            raise ValueError(f"snapshot: expected {2 * n} arrays, got {len(snapshot)}")
        self._k, self._v = list(snapshot[:n]), list(snapshot[n:])

    def stored(self, layer: int) -> tuple[mx.array, mx.array]:
        """The layer's K and V arrays as stored: [num_blocks * block_size, num_kv_heads, W]
        (heads-major: [num_kv_heads, num_blocks * block_size, W]) of 4-byte words (W =
        head_dim * dtype size / 4) or, for odd head dims, of the dtype."""
        a = self.layout.array_of[layer]
        return self._k[a], self._v[a]

    def blocks(self, layer: int) -> tuple[mx.array, mx.array]:
        """The layer's K and V as `[num_blocks, block_size, num_kv_heads, head_dim]` views."""
        shape = (self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        k, v = (x.view(self.dtype) for x in self.stored(layer))
        if self.heads_major:
            heads = (self.num_kv_heads, self.num_blocks, self.block_size, self.head_dim)
            return tuple(x.reshape(heads).transpose(1, 2, 0, 3) for x in (k, v))
        return k.reshape(shape), v.reshape(shape)
