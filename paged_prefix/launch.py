"""Who sends a step's graph to the device: the thread that built it, or a thread of its own.

On a CUDA GPU, MLX's `async_eval` of a decode step is host work in C++ (each op encoded into
the stream's CUDA graph: 1.3-1.6 ms for the 1.1B config's 16 layers on the H200,
docs/results.md, "H200: against mlx-lm's server"), during which the calling thread waits with
Python's GIL released. `StepLauncher(threaded=True)` runs it on a thread of its own, so that
the encoding overlaps what the calling thread does next: vLLM's engine taking the step
before's output and scheduling the next, and the next step's plan. Served one request at a
time on H100s, TPOT was 0.78-1.32x mlx-lm's server's in seven runs with it (0.88-0.94x in the
last three, on one machine) and 1.08-1.40x in two without (docs/results.md, "H100: the launch
thread" and "H100 at 0fd67d3"). So it is the default on CUDA;
PAGED_PREFIX_LAUNCH_THREAD=0 or 1 sets it anywhere.

MLX gives every thread its own default stream and command encoder, and a thread can evaluate
only its own streams' ops or those of a stream made by `mx.new_thread_unsafe_stream`, whose one
encoder any thread may use but not two at once. So a threaded launcher owns such a `stream`,
the runner builds its steps on it (`building()`), and every other use of that encoder waits
for the launch in flight: `wait()` before the next step's graph is built, before any
evaluation or synchronization, and before the host reads a launched step's tokens. What the
calling thread may do meanwhile is host work and making new arrays from host data (the
allocator takes a lock), and it must not read or wait for an array the launch reads in: the
launch may drop that array's completion event once it has fired, as a read would (the runner
reads the step before's tokens before it launches the next). Code outside the runner that
reads a step's arrays (a test reading the cache after `run_forward`) calls `wait()` first: a
read racing the launch thread evaluates the same graph twice at once, which crashed MLX's CPU
backend (a segfault in its matmul) when a test did it.

On MLX's CPU backend the launch is the step's computation (the cores run its matmuls), so a
thread of its own buys nothing there; on Metal it has not been measured. There the default is
`StepLauncher(threaded=False)`: it launches on the calling thread, and `building()` and
`wait()` do nothing.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import weakref

import mlx.core as mx

logger = logging.getLogger(__name__)
ENV_VAR = "PAGED_PREFIX_LAUNCH_THREAD"


class Launch:
    """One step sent to the device from the launcher's thread; `wait` returns once MLX has
    encoded it (the device may still be running it), raising what the launch raised."""

    def __init__(self, arrays: list[mx.array]):
        self.arrays: list[mx.array] | None = arrays
        self.started = threading.Event()
        self.done = threading.Event()
        self.error: BaseException | None = None

    def wait(self) -> None:
        self.done.wait()
        if self.error is not None:
            raise self.error


class StepLauncher:
    """Sends steps to the device (`launch`), from a thread of its own when `threaded`."""

    def __init__(self, threaded: bool):
        if not isinstance(threaded, bool):
            raise ValueError(f"threaded: expected a bool, got {threaded!r}")
        self.threaded = threaded
        self.launched_in_thread = 0  # steps sent from the launcher's thread
        self._last: Launch | None = None
        self.stream = None
        if threaded:
            self.stream = mx.new_thread_unsafe_stream(mx.default_device())
            self._jobs: queue.SimpleQueue[Launch | None] = queue.SimpleQueue()
            threading.Thread(target=_serve, args=(self._jobs,), name="paged_prefix-launch",
                             daemon=True).start()
            weakref.finalize(self, self._jobs.put, None)  # the thread ends with its launcher

    @classmethod
    def from_env(cls) -> StepLauncher:
        """Threaded where PAGED_PREFIX_LAUNCH_THREAD=1, or where it is unset and MLX runs on
        CUDA (where it was measured); logged either way, with why."""
        setting = os.environ.get(ENV_VAR, "")
        if setting not in ("", "0", "1"):
            raise ValueError(f"{ENV_VAR}: expected 0 or 1 (or unset), got {setting!r}")
        if setting:
            threaded, why = setting == "1", f"{ENV_VAR}={setting}"
        else:
            threaded = mx.cuda.is_available() and mx.default_device() == mx.gpu
            why = (f"the default on CUDA ({ENV_VAR}=0 turns it off)" if threaded else
                   f"the default off CUDA ({ENV_VAR}=1 turns it on)")
        if threaded:
            logger.info("paged_prefix: steps sampled on the device are sent to it from a thread "
                        "of their own, so that MLX's encoding of a step overlaps the engine's "
                        "work (%s); other steps by the thread that builds them", why)
        else:
            logger.info("paged_prefix: steps are sent to the device by the thread that builds "
                        "them (%s)", why)
        return cls(threaded)

    def building(self):
        """The context a step's graph is built in: on the launcher's stream when threaded."""
        return mx.stream(self.stream) if self.threaded else contextlib.nullcontext()

    def launch(self, arrays: list[mx.array], in_thread: bool) -> Launch | None:
        """Send `arrays` to the device; from the launcher's thread when it is threaded and
        `in_thread` (the caller will read nothing of this step before `wait`), returning the
        launch; else at once, on the calling thread (None)."""
        self.wait()
        arrays = [a for a in arrays if a is not None]
        if not (self.threaded and in_thread):
            mx.async_eval(arrays)
            return None
        # copies: the caller's next step replaces what the cache arrays it holds hold (a slice
        # update writes through the same Python object)
        job = Launch([a.__copy__() for a in arrays])
        self._jobs.put(job)
        job.started.wait()  # the thread has taken the GIL: it reads the arrays in at once
        self._last = job
        self.launched_in_thread += 1
        return job

    def wait(self) -> None:
        """Until the launch in flight (if any) has been encoded; raises what it raised."""
        job, self._last = self._last, None
        if job is not None:
            job.wait()

    def synchronize(self) -> None:
        """Until the device has run everything sent on the steps' stream."""
        self.wait()
        mx.synchronize(self.stream)  # None: the calling thread's default stream


def _serve(jobs: queue.SimpleQueue[Launch | None]) -> None:
    """The launch thread: each job's `async_eval`, until the launcher is gone (None)."""
    while (job := jobs.get()) is not None:
        job.started.set()
        try:
            mx.async_eval(job.arrays)
        except BaseException as error:  # handed to the thread that waits for it
            job.error = error
        finally:
            job.arrays = None
            job.done.set()
