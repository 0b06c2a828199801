"""GPU time per layer-like call, without the host's cost of building and launching it (CUDA).

A call of a few microseconds of GPU work costs MLX 10-30 us of host work, so wall-clock timing
measures the host. Here a one-thread kernel first holds the stream, spinning on the GPU's global
timer for HOLD_NS; a chain of n calls (each call's output is the next call's input, so they run
one after another, as layers do) is launched behind it while it spins, and a last kernel that
takes the chain's end as input stamps the timer again. GPU time per call = (stamp - release) / n,
the median of a few evaluations.

The calls cycle through `steps` (one per copy of the inputs), so a cache that fits the GPU's L2
is not read from L2 by the next call, as a forward's next layer would not.

`gpu_us_together` times independent calls instead, evaluated together as
bench/attention_sweep.py evaluates them: launched behind the hold in one evaluation, where MLX
may run them side by side, and stamped once all of them are done. GPU time per call = (stamp -
release) / calls: a throughput, not a latency.

MLX keeps at most ~10 command buffers of 20 launches in flight before the host waits, so n is
capped at MAX_CALLS: the host must have launched the whole chain before the hold lets go.

    python -m bench.gpu_time   # checks the method: chains of x * 2 of known size, the SM clock
"""

from __future__ import annotations

import itertools
import statistics

import mlx.core as mx

HOLD_NS = 20_000_000  # 20 ms: longer than launching MAX_CALLS calls of any path here
MAX_CALLS = 30  # up to ~6 launches a call stays within MLX's ~200 launches in flight

# hold: one thread spins until hold_ns[0] ns have passed, then writes the timer (release[0])
# and the SM clock it ran at, in MHz (release[1]).
SPIN_SOURCE = r"""
  unsigned long long t0, t;
  const long long c0 = clock64();
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < static_cast<unsigned long long>(hold_ns[0]));
  release[0] = static_cast<long long>(t);
  release[1] = (clock64() - c0) * 1000 / static_cast<long long>(t - t0);
"""
# stamp: one thread writes the timer (stamp[0]). It takes what it times as inputs, unread:
# MLX orders the launches of one CUDA graph by the buffers they share, not by launch order.
STAMP_SOURCE = r"""
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  stamp[0] = static_cast<long long>(t);
"""
# touch: one thread copies one element, the least a launch can do (the floor of a chain's call).
TOUCH_SOURCE = "out[0] = x[0];"

_kernels: dict = {}


def _timer(name: str, inputs: dict[str, mx.array], output: str, source: str,
           size: int) -> mx.array:
    """A one-thread kernel over `inputs` writing `size` int64s to `output`."""
    name = f"{name}_{len(inputs)}"
    if name not in _kernels:
        _kernels[name] = mx.fast.cuda_kernel(name=name, input_names=list(inputs),
                                             output_names=[output], source=source,
                                             ensure_row_contiguous=False)
    return _kernels[name](inputs=list(inputs.values()), grid=(1, 1, 1), threadgroup=(1, 1, 1),
                          output_shapes=[(size,)], output_dtypes=[mx.int64])[0]


def _held(timed: list[mx.array]) -> tuple[float, int]:
    """(GPU seconds from the hold's release to when every array of `timed` is done, the SM
    clock in MHz while the hold spun). `timed` is built, not yet evaluated."""
    release = _timer("gpu_time_hold", {"hold_ns": mx.array([HOLD_NS], dtype=mx.int64)},
                     "release", SPIN_SOURCE, 2)
    mx.async_eval(release)  # launched, and the stream held, before anything timed
    end = _timer("gpu_time_stamp", {f"after{i}": a for i, a in enumerate(timed)}, "stamp",
                 STAMP_SOURCE, 1)
    mx.eval(timed, end)
    return (end.item() - release[0].item()) * 1e-9, release[1].item()


def _chain(steps: list, x0: mx.array, calls: int) -> tuple[float, int]:
    """(GPU seconds of `calls` chained calls, the SM clock in MHz while the hold spun)."""
    x = x0
    for step in itertools.islice(itertools.cycle(steps), calls):  # graphs built before launch
        x = step(x)
    return _held([x])


def gpu_us(steps: list, x0: mx.array, calls: int = MAX_CALLS, samples: int = 5) -> float:
    """Median GPU microseconds per call of a chain x <- step(x) through `steps`, cycled."""
    calls = min(calls, MAX_CALLS)
    _chain(steps, x0, len(steps))  # build, compile and warm every step
    return statistics.median(_chain(steps, x0, calls)[0] / calls
                             for _ in range(samples)) * 1e6


def gpu_us_together(calls: list, samples: int = 5) -> float:
    """Median GPU microseconds per call of `calls` (each returns an array or a list of them),
    evaluated together; at most MAX_CALLS calls of a launch or few each."""
    if not 0 < len(calls) <= MAX_CALLS:
        raise ValueError(f"calls: expected 1 to {MAX_CALLS}, got {len(calls)}")

    def outputs() -> list[mx.array]:
        outs = [call() for call in calls]
        return [a for out in outs for a in (out if isinstance(out, list) else [out])]
    mx.eval(outputs())  # build, compile and warm every call
    return statistics.median(_held(outputs())[0] / len(calls) for _ in range(samples)) * 1e6


def main() -> None:
    """The method against copies of known size and a launch that does nothing, and the clock
    the chains ran at."""
    touch = mx.fast.cuda_kernel(name="gpu_time_touch", input_names=["x"], output_names=["out"],
                                source=TOUCH_SOURCE)
    x = mx.zeros((1,), dtype=mx.float32)
    for calls in (3, 10, 30):
        us = gpu_us([lambda a: touch(inputs=[a], grid=(1, 1, 1), threadgroup=(1, 1, 1),
                                     output_shapes=[(1,)], output_dtypes=[mx.float32])[0]],
                    x, calls=calls)
        print(f"a one-element custom kernel, chains of {calls:2d}: {us:8.1f} us a call", flush=True)
    for mib in (512, 2):
        x = mx.random.normal((mib * 2**19,)).astype(mx.bfloat16)  # mib MiB of bf16
        mx.eval(x)
        for calls in (3, 10, 30):
            us = gpu_us([lambda a: a * 2], x, calls=calls)
            mhz = _chain([lambda a: a * 2], x, calls)[1]
            print(f"x * 2 over {mib} MiB, chains of {calls:2d}: {us:8.1f} us a call, "
                  f"{2 * x.nbytes / us / 1e3:6.0f} GB/s read + written; SM clock {mhz} MHz",
                  flush=True)


if __name__ == "__main__":
    main()
