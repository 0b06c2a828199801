"""bench/gpu_time.py measures what it claims: a chain of calls of known GPU length reads that
length, and calls evaluated together are all waited for and run side by side (CUDA only; the
benchmarks' GPU-alone figures rest on it)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from bench.gpu_time import MAX_CALLS, gpu_us, gpu_us_together
from tests.conftest import HAS_CUDA

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="no CUDA backend")]

WAIT_NS = 50_000
# wait: one thread passes x through after WAIT_NS of the GPU's global timer.
WAIT_SOURCE = f"""
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {{
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  }} while (t - t0 < {WAIT_NS}ull);
  out[0] = x[0];
"""


_wait = mx.fast.cuda_kernel(name="test_gpu_time_wait", input_names=["x"], output_names=["out"],
                            source=WAIT_SOURCE) if HAS_CUDA else None


def step(x: mx.array) -> mx.array:
    return _wait(inputs=[x], grid=(1, 1, 1), threadgroup=(1, 1, 1), output_shapes=[(1,)],
                 output_dtypes=[mx.float32])[0]


def test_a_chain_of_known_length_reads_its_length():
    # the floor of a launch in a chain is 2-5 us on an H200; a chain that ran before the hold
    # let go, or a stamp that ran before the chain, would read far less than WAIT_NS
    for calls in (3, 30):
        us = gpu_us([step], mx.zeros((1,), dtype=mx.float32), calls=calls)
        assert WAIT_NS / 1e3 <= us <= WAIT_NS / 1e3 + 10, (calls, us)


def test_calls_together_overlap_and_are_all_waited_for():
    """Independent one-thread waits evaluated together run side by side: all of them take one
    wait and a launch gap each (they start one launch apart; on the H200 30 of them took 77 us
    in all), where calls run one after another would take `calls` waits and a stamp that ran
    before the slowest less than one."""
    x = mx.zeros((1,), dtype=mx.float32)
    for calls in (2, MAX_CALLS):
        total = gpu_us_together([lambda: step(x)] * calls) * calls
        assert WAIT_NS / 1e3 <= total <= WAIT_NS / 1e3 + 3 * calls + 10, (calls, total)
    with pytest.raises(ValueError, match="calls"):
        gpu_us_together([lambda: step(x)] * (MAX_CALLS + 1))
