"""Plain-MLX references: the attention contract and the oracles every kernel is checked against.

Imports nothing of the runner package or of `jit_kernels`: plain arrays in, arrays out.
"""

from .contract import check_arrays, check_lengths, check_paged_inputs
from .dense import dense_attention
from .paged_attention import gather_kv, heads_first, paged_attention, sdpa, tokens_first

__all__ = ["check_arrays", "check_lengths", "check_paged_inputs", "dense_attention", "gather_kv",
           "heads_first", "paged_attention", "sdpa", "tokens_first"]
