"""pytest-benchmark view of the attention sweep: one benchmark group per sweep point.

Each round evaluates CALLS independent calls in one mx.eval (a single call is dominated by
the 50-100 us eval round trip); `extra_info["us_per_call"]` divides that out. Without a GPU
kernel backend the sizes are the sweep's --quick ones and only the reference and the
contiguous ceiling run.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from attention_sweep import HEAD_DIM, ceiling_fn, make_case, point_cost, sweep_points

import reference
from jit_kernels import available_backends

KERNEL = next(iter(available_backends()), None)
POINTS = sweep_points(quick=KERNEL is None)
PATHS = ["reference", "ceiling"] + (["kernel"] if KERNEL else [])
CALLS = 20 if KERNEL else 2  # the CPU reference is slow enough alone


@pytest.fixture(scope="module", params=POINTS, ids=lambda p: p.name)
def case(request):
    yield request.param, make_case(request.param)
    mx.clear_cache()


@pytest.mark.benchmark
@pytest.mark.parametrize("path", PATHS)
def test_attention(benchmark, case, path):
    point, c = case
    scale = HEAD_DIM ** -0.5
    args = (c.q, c.k_cache, c.v_cache, c.meta, scale)
    fn = {"reference": lambda: reference.paged_attention(*args),
          "ceiling": ceiling_fn(c, scale),
          "kernel": lambda: available_backends()[KERNEL].paged_attention(*args)}[path]
    benchmark.group = point.name
    mx.eval(fn())  # compile and warm outside the timing
    benchmark.pedantic(lambda: mx.eval([fn() for _ in range(CALLS)]), rounds=5, iterations=1)
    flops, nbytes = point_cost(point)
    per_call = benchmark.stats.stats.median / CALLS
    benchmark.extra_info.update(us_per_call=per_call * 1e6, tflops=flops / per_call / 1e12,
                                gbps=nbytes / per_call / 1e9)
