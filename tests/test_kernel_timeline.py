"""bench/kernel_timeline.py stays attached to the kernel it instruments (host-only): its anchors
are found once each in the committed source, its factory hands the product its own outputs, and
its phase arithmetic reads stamps as documented."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from jit_kernels.support import Geometry

from bench.kernel_timeline import STAMPS, Timeline, instrument, phases
from jit_kernels import cuda_paged_attention as cuda_attention


def test_every_anchor_is_in_the_kernel_once():
    source = instrument(cuda_attention.ATTENTION_SOURCE)
    assert source.count("STAMP(") == 7 and source.count("NOTE(") == 2
    with pytest.raises(ValueError, match="anchor"):
        instrument(cuda_attention.ATTENTION_SOURCE.replace("  if (slot < 0) return;\n", ""))


def test_the_product_gets_its_outputs_and_the_stamps_are_kept():
    specs, calls = [], []

    def factory(**spec):
        specs.append(spec)

        def kernel(output_shapes, output_dtypes, **call):
            calls.append(call)
            return [mx.zeros(s, dtype=d) for s, d in zip(output_shapes, output_dtypes)]
        return kernel
    timeline = Timeline(factory)
    attention = cuda_attention.CudaPagedAttention(timeline)
    g = Geometry(8, 2, 64, 16, mx.bfloat16, 0.125)
    plan = attention.plan(np.array([0, 1]), np.array([4096]), g)
    cache = mx.zeros((300, 16, 2, 64), mx.bfloat16)
    out = attention.launch(mx.zeros((1, 8, 64), mx.bfloat16), cache, cache,
                           mx.zeros((1, 256), mx.int32), plan)
    assert out.shape == (1, 8, 64)
    (spec,), (call,) = specs, calls
    assert spec["output_names"] == ["out", "o_part", "lse_part", "stamps"]
    assert spec["name"].startswith("timeline_paged_prefill_") and "STAMP(6, 0)" in spec["source"]
    assert call["init_value"] == 0
    assert timeline.stamps[0].shape == (plan.tiles.num_items * STAMPS,)


def test_phases_of_two_blocks():
    us = 1000  # stamps are ns
    split_last = [0, 1, 3, 11, 12, 13, 20, 0]
    whole = [2, 3, 4, 6, 7, 0, 0, 0]
    stamps = np.array([split_last, whole], dtype=np.uint64) * us
    stamps[0, 7] = (8 << 32) | (1 << 16)  # 8 kv tiles, merged
    stamps[1, 7] = 1 << 32  # 1 kv tile
    p = phases(stamps.reshape(-1))
    assert p["work"] == 1 and p["first kv"] == 1.5 and p["loop"] == 5 and p["stores"] == 1
    assert p["per kv tile"] == 1.5  # median of 8 us / 8 tiles and 2 us / 1 tile
    assert p["arrival"] == 1 and p["merge"] == 7 and p["launch"] == 20
