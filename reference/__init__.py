"""Plain-MLX references: the oracles every kernel is checked against."""

from .dense import dense_attention
from .paged_attention import gather_kv, paged_attention

__all__ = ["dense_attention", "gather_kv", "paged_attention"]
