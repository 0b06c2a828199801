"""The step launcher (`paged_prefix/launch.py`): its setting, the launch thread's results and
errors. The runner's tokens with it are checked in test_serving_runner.py and, through vLLM's
engine, in test_serving_llm.py."""

from __future__ import annotations

import gc
import logging
import threading

import mlx.core as mx
import numpy as np
import pytest

from paged_prefix import launch
from paged_prefix.launch import StepLauncher

ON_CUDA = mx.cuda.is_available() and mx.default_device() == mx.gpu


@pytest.mark.parametrize(("setting", "threaded"),
                         [(None, ON_CUDA), ("0", False), ("1", True)])
def test_the_setting_picks_the_launch_thread_and_says_so(monkeypatch, caplog, setting, threaded):
    """Unset, the thread is on where MLX runs on CUDA (where it was measured) and off elsewhere;
    the log says which and why."""
    if setting is None:
        monkeypatch.delenv(launch.ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(launch.ENV_VAR, setting)
    with caplog.at_level(logging.INFO, logger="paged_prefix.launch"):
        launcher = StepLauncher.from_env()
    assert launcher.threaded is threaded
    assert ("sent to it from a thread of their own" if threaded else
            "sent to the device by the thread that builds them") in caplog.text
    assert (f"{launch.ENV_VAR}={setting}" if setting else
            f"the default {'on' if threaded else 'off'} CUDA") in caplog.text


@pytest.mark.parametrize("setting", ["yes", "2", " 1"])
def test_a_bad_setting_is_refused_naming_it(monkeypatch, setting):
    monkeypatch.setenv(launch.ENV_VAR, setting)
    with pytest.raises(ValueError, match=launch.ENV_VAR):
        StepLauncher.from_env()
    with pytest.raises(ValueError, match="threaded"):
        StepLauncher(1)


def test_a_step_built_on_the_stream_runs_from_the_thread_and_writes_in_place():
    """A graph built on the launcher's stream is evaluated from its thread; the caller's next
    write into the array it sent (through the same Python object) reaches the next step only,
    and the launch's copy of the array it read in holds the step's own result."""
    launcher = StepLauncher(True)
    cache = mx.zeros((4, 3))
    mx.eval(cache)
    sent = []
    for step in range(4):
        with launcher.building():
            cache[step] = mx.full((3,), step + 1.0)
            total = cache.sum()
        job = launcher.launch([total, cache, None], in_thread=True)
        assert job is not None
        sent.append(total)
    launcher.synchronize()
    assert [t.item() for t in sent] == [3.0, 9.0, 18.0, 30.0]
    np.testing.assert_array_equal(np.array(cache), np.repeat([[1.0], [2.0], [3.0], [4.0]], 3, 1))
    assert launcher.launched_in_thread == 4


def test_a_failed_launch_raises_in_the_waiting_thread(monkeypatch):
    launcher = StepLauncher(True)

    def fails(*arrays):
        raise RuntimeError("planted launch failure")
    monkeypatch.setattr(mx, "async_eval", fails)
    with launcher.building():
        x = mx.ones((2,)) + 1
    job = launcher.launch([x], in_thread=True)
    with pytest.raises(RuntimeError, match="planted launch failure"):
        launcher.wait()
    with pytest.raises(RuntimeError, match="planted launch failure"):
        job.wait()  # the step's reader (a SampledOnDevice) is told too
    monkeypatch.undo()
    launcher.wait()  # reported once to the launcher: the next step goes on
    assert launcher.launch([x], in_thread=False) is None
    np.testing.assert_array_equal(np.array(x), [2.0, 2.0])


def test_the_launch_thread_ends_with_its_launcher():
    def launch_threads() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name == "paged_prefix-launch"}
    before = launch_threads()
    launcher = StepLauncher(True)
    with launcher.building():
        x = mx.ones((2,)) * 3
    launcher.launch([x], in_thread=True)
    (thread,) = launch_threads() - before
    del launcher
    gc.collect()
    thread.join(timeout=10)
    assert not thread.is_alive()
    np.testing.assert_array_equal(np.array(x), [3.0, 3.0])  # its last launch ran


@pytest.mark.parametrize("model", ["llama3-test", "gpt-oss-test"])
def test_a_model_holding_lazy_arrays_beside_its_weights_launches_from_the_thread(
        monkeypatch, model):
    """mlx-lm's Llama3RoPE and YarnRoPE keep their frequencies as arrays that are not
    parameters, built lazily on the thread that made the model: the runner evaluates its whole
    tree before any launch (the launch thread may not evaluate another thread's stream: a first
    step failed so). Tokens as launched by the engine's thread."""
    from paged_prefix.engine import Engine, EngineConfig

    tokens = {}
    for setting in ("0", "1"):
        monkeypatch.setenv(launch.ENV_VAR, setting)
        engine = Engine(EngineConfig(model=model, num_blocks=64, max_model_len=256))
        engine.add_request("a", list(range(3, 30)), 5)
        engine.run_to_completion()
        tokens[setting] = engine.results["a"].output_ids
        forwards = engine.runner.runner.stats.forwards  # each samples greedily, on the device
        assert engine.runner.launcher.launched_in_thread == (forwards if setting == "1" else 0)
    assert tokens["1"] == tokens["0"] and len(tokens["0"]) == 5
