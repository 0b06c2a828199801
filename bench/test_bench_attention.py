"""pytest-benchmark view of the attention sweep: one benchmark group per sweep point.

Each round evaluates CALLS independent calls in one mx.eval (a single call is dominated by
the 50-100 us eval round trip); `extra_info["us_per_call"]` divides that out. Before timing,
every path's output is checked once against the reference's (gather + SDPA) per element
with the bf16 tolerance; so is the ceiling's (SDPA on contiguous K/V), except at a windowed
prefill, where its first queries see keys past their window (`attention_sweep.ceiling_fn`).
Without a GPU kernel backend the sizes are the sweep's --quick ones.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from bench.attention_sweep import DTYPE, make_case, path_fns, point_cost, sweep_points
from jit_kernels import available_backends
from tests.conftest import assert_close

BACKEND = next(iter(available_backends()), None)
POINTS = sweep_points(quick=BACKEND is None)
PATHS = ["ceiling", "reference", "sdpa", "auto"] + (["kernel", "gather"] if BACKEND else [])
CALLS = 20 if BACKEND else 2  # the CPU reference is slow enough alone


def as_rows(out) -> mx.array:
    """A path's output as [T, H, D]."""
    if isinstance(out, list):  # the ceiling: one [1, H, Lq, D] per sequence
        return mx.concatenate([o[0].transpose(1, 0, 2) for o in out])
    if out.ndim == 4:  # the ceiling's equal-length decode rows, batched: [S, H, 1, D]
        return out[:, :, 0]
    return out


@pytest.fixture(scope="module", params=POINTS, ids=lambda p: p.name)
def case(request):
    point = request.param
    fns, _ = path_fns(make_case(point), point.geometry, BACKEND)
    yield point, fns, fns["reference"]().astype(mx.float32)
    mx.clear_cache()


@pytest.mark.benchmark
@pytest.mark.parametrize("path", PATHS)
def test_attention(benchmark, case, path):
    point, fns, want = case
    if path not in fns:
        pytest.skip(f"no {path} call at {point.name}")
    fn = fns[path]
    out = fn()  # compile and warm outside the timing, and check the numbers once
    windowed_prefill = point.window is not None and max(point.q_lens) > 1
    if path != "gather" and not (path == "ceiling" and windowed_prefill):
        assert_close(as_rows(out), want, DTYPE, f"{path} at {point.name}")
    benchmark.group = point.name
    benchmark.pedantic(lambda: mx.eval([fn() for _ in range(CALLS)]), rounds=5, iterations=1)
    if benchmark.stats is None:  # --benchmark-disable: checked, not timed
        return
    flops, nbytes, gathered = point_cost(point)
    per_call = benchmark.stats.stats.median / CALLS
    benchmark.extra_info.update(us_per_call=per_call * 1e6, tflops=flops / per_call / 1e12,
                                gbps=(gathered if path == "gather" else nbytes) / per_call / 1e9)
