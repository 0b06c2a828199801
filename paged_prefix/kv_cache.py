"""The paged KV cache: per layer K and V blocks, written in place by slot.

Layout per layer (vllm-metal's): `[num_blocks, block_size, num_kv_heads, head_dim]`.
The arrays are stored flat as `[(num_blocks + 1) * block_size, num_kv_heads, head_dim]`
because MLX updates a scatter target in place only when the target is the sole
owner of its buffer: a flat array that this object alone holds is donated to the
scatter, while scattering through a reshaped view copies the whole cache first.
`blocks()` hands out the 4D view (a free reshape) for readers.

The extra trailing block is scratch: padding slots (-1) are redirected there, so a
write needs neither a host sync nor a compaction of the new rows. No block table may
name it (metadata validates block ids < num_blocks).
"""

from __future__ import annotations

import mlx.core as mx

SUPPORTED_DTYPES = (mx.float16, mx.bfloat16, mx.float32)


class PagedKVCache:
    """K/V blocks for every layer of one model."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: mx.Dtype = mx.float16,
    ):
        for name, value in (
            ("num_layers", num_layers),
            ("num_blocks", num_blocks),
            ("block_size", block_size),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {dtype}")
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        rows = (num_blocks + 1) * block_size
        self._scratch_slot = num_blocks * block_size
        self._k = [mx.zeros((rows, num_kv_heads, head_dim), dtype) for _ in range(num_layers)]
        self._v = [mx.zeros((rows, num_kv_heads, head_dim), dtype) for _ in range(num_layers)]
        mx.eval(self._k, self._v)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self._k + self._v)

    def write(self, layer: int, keys: mx.array, values: mx.array, slot_mapping: mx.array) -> None:
        """Scatter new rows into their slots; lazily, so the write joins the layer's graph.

        keys, values: [T, num_kv_heads, head_dim]; slot_mapping: [T] int, -1 = padding.
        """
        slots = mx.where(slot_mapping < 0, self._scratch_slot, slot_mapping)
        self._k[layer][slots] = keys.astype(self.dtype)
        self._v[layer][slots] = values.astype(self.dtype)

    def arrays(self) -> list[mx.array]:
        """Every layer's current K and V arrays, e.g. to evaluate pending writes."""
        return self._k + self._v

    def blocks(self, layer: int) -> tuple[mx.array, mx.array]:
        """The layer's K and V as `[num_blocks, block_size, num_kv_heads, head_dim]` views."""
        shape = (self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        used = self.num_blocks * self.block_size
        return self._k[layer][:used].reshape(shape), self._v[layer][:used].reshape(shape)
