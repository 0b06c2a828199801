"""Shared test helpers: tolerances, random paged layouts, backend availability."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from paged_prefix.metadata import AttentionMetadata, build_attention_metadata

# Attention output vs a float32 oracle fed the same (rounded) inputs: (atol, rtol).
# fp32 is exact up to reassociation; half types are bounded by the rounding of the
# softmax weights and the output (fp16 ~1e-3 ulp, bf16 ~8e-3 ulp at |x| ~ 1).
TOLERANCES = {
    mx.float32: (2e-5, 2e-5),
    mx.float16: (4e-3, 4e-3),
    mx.bfloat16: (3e-2, 3e-2),
}
DTYPES = {"fp32": mx.float32, "fp16": mx.float16, "bf16": mx.bfloat16}

HAS_CUDA = mx.cuda.is_available()
HAS_METAL = mx.metal.is_available()
KERNEL_PATHS = [
    pytest.param("cuda", marks=[pytest.mark.gpu,
                                pytest.mark.skipif(not HAS_CUDA, reason="no CUDA backend")]),
    pytest.param("metal", marks=[pytest.mark.gpu,
                                 pytest.mark.skipif(not HAS_METAL, reason="no Metal backend")]),
]
ATTENTION_PATHS = ["reference", *KERNEL_PATHS]


def assert_close(out: mx.array, ref: mx.array, dtype: mx.Dtype, what: str = "") -> None:
    atol, rtol = TOLERANCES[dtype]
    a = np.array(out.astype(mx.float32))
    b = np.array(ref.astype(mx.float32))
    assert a.shape == b.shape, f"{what}: shape {a.shape} != {b.shape}"
    assert np.isfinite(a).all(), f"{what}: non-finite output"
    err = np.abs(a - b) - (atol + rtol * np.abs(b))
    worst = np.unravel_index(np.argmax(err), err.shape)
    assert err.max() <= 0, (
        f"{what}: |out - ref| exceeds atol={atol} rtol={rtol} at {worst}: "
        f"{a[worst]} vs {b[worst]}"
    )


def random_layout(
    rng: np.random.Generator, q_lens, context_lens, block_size: int, spare_blocks: int = 3
) -> tuple[AttentionMetadata, list[list[int]]]:
    """Metadata whose block tables are a shuffled, non-contiguous draw from the pool."""
    needed = [-(-(q + c) // block_size) for q, c in zip(q_lens, context_lens)]
    num_blocks = sum(needed) + spare_blocks
    pool = rng.permutation(num_blocks).tolist()
    tables, i = [], 0
    for n in needed:
        tables.append(pool[i:i + n])
        i += n
    meta = build_attention_metadata(q_lens, context_lens, tables, block_size, num_blocks)
    return meta, tables


def random_cache(rng: np.random.Generator, num_blocks, block_size, num_kv_heads, head_dim, dtype):
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k = mx.array(rng.standard_normal(shape, dtype=np.float32)).astype(dtype)
    v = mx.array(rng.standard_normal(shape, dtype=np.float32)).astype(dtype)
    return k, v
