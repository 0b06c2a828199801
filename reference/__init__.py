"""Plain-MLX reference: the attention contract and the oracle every kernel is checked against.

Imports nothing of the runner package or of `jit_kernels`: plain arrays in, arrays out.
"""

from .contract import (
    check_arrays,
    check_lengths,
    check_paged_inputs,
    check_scale,
    check_variant,
    host_ints,
)
from .paged_attention import (
    gather_kv,
    heads_first,
    joined_sdpa,
    key_start,
    masked_sdpa,
    paged_attention,
    sdpa,
    tokens_first,
    window_mask,
)

__all__ = ["check_arrays", "check_lengths", "check_paged_inputs", "check_scale", "check_variant",
           "gather_kv", "heads_first", "host_ints", "joined_sdpa", "key_start", "masked_sdpa",
           "paged_attention", "sdpa", "tokens_first", "window_mask"]
