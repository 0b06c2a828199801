"""`vllm serve` as a child process on 127.0.0.1, for the serving benchmark and tests.

    with VllmServer(model_dir, ["--max-model-len", "1024"], log_path) as server:
        requests.post(server.url + "/v1/completions", ...)

Starts the real CLI (`vllm`'s own entry module, run by this interpreter, so it works where
the console script is not on PATH) from the current environment (the project's platform plugin
must be installed there), waits until `/v1/models` answers, and stops it with SIGINT (vLLM's
own shutdown path), then SIGKILL if it lingers. VLLM_TARGET_DEVICE is removed from the child's
environment (`child_env`): set to cpu it makes vLLM take its own CPU platform before any plugin.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from abc import ABC, abstractmethod
from pathlib import Path

VLLM_CLI = (sys.executable, "-m", "vllm.entrypoints.cli.main")


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment for a vLLM child process, less VLLM_TARGET_DEVICE, plus
    `extra`."""
    return {**{k: v for k, v in os.environ.items() if k != "VLLM_TARGET_DEVICE"}, **extra}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess(ABC):
    """A `with` block around servers in child processes: `start()` on entering, `stop()` on
    leaving, and on a failed start too, so that no child outlives the block."""

    log_path: Path

    @abstractmethod
    def start(self) -> None: ...

    @abstractmethod
    def stop(self) -> None: ...

    def __enter__(self):
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class VllmServer(ServerProcess):
    def __init__(self, model: str | Path, args: list[str], log_path: Path,
                 served_name: str = "smollm2", start_timeout: float = 600.0,
                 env: dict[str, str] | None = None):
        """`env`: variables set for the server on top of this process's environment."""
        self.model, self.args, self.log_path = str(model), list(args), Path(log_path)
        self.env = dict(env or {})
        self.served_name = served_name
        self.start_timeout = start_timeout
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        log = self.log_path.open("w")
        self.process = subprocess.Popen(
            [*VLLM_CLI, "serve", self.model, "--host", "127.0.0.1", "--port", str(self.port),
             "--served-model-name", self.served_name,
             # a grace period lets the engine process exit by itself on SIGINT; with vLLM's
             # default of 0 it is killed at once and the API server logs EngineDeadError
             "--shutdown-timeout", "10", *self.args],
            stdout=log, stderr=subprocess.STDOUT, env=child_env(**self.env))
        log.close()  # the child holds its own descriptor
        wait_until_answering(self.url + "/v1/models", self.process, self.log_path,
                             self.start_timeout, "vllm serve")

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as response:
            return response.read().decode()

    def log_tail(self, lines: int = 40) -> str:
        return log_tail(self.log_path, lines)

    def stop(self, timeout: float = 60.0) -> None:
        stop_process(self.process, timeout)


def log_tail(log: Path, lines: int = 40) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def wait_until_answering(url: str, process: subprocess.Popen, log: Path, timeout_s: float,
                         what: str) -> None:
    """Until `url` answers at all (an HTTP error status is an answer), or `process` exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode} before answering; "
                               f"log: {log}\n{log_tail(log)}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except urllib.error.HTTPError:
            return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"{what} did not answer within {timeout_s:.0f} s; log: {log}")


def stop_process(process: subprocess.Popen | None, timeout_s: float) -> None:
    """SIGINT (a server's clean shutdown), then SIGKILL after `timeout_s`."""
    if process is None or process.poll() is not None:
        return
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def metric_total(metrics_text: str, name: str, **labels: str) -> float:
    """Sum of a Prometheus counter's samples whose labels include `labels`."""
    total = 0.0
    for line in metrics_text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        head, value = line.rsplit(" ", 1)
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total
