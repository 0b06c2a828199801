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
import urllib.request
from pathlib import Path

VLLM_CLI = (sys.executable, "-m", "vllm.entrypoints.cli.main")


def child_env() -> dict[str, str]:
    """This process's environment for a vLLM child process, less VLLM_TARGET_DEVICE."""
    return {k: v for k, v in os.environ.items() if k != "VLLM_TARGET_DEVICE"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VllmServer:
    def __init__(self, model: str | Path, args: list[str], log_path: Path,
                 served_name: str = "smollm2", start_timeout: float = 600.0):
        self.model, self.args, self.log_path = str(model), list(args), Path(log_path)
        self.served_name = served_name
        self.start_timeout = start_timeout
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> VllmServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("w")
        self.process = subprocess.Popen(
            [*VLLM_CLI, "serve", self.model, "--host", "127.0.0.1", "--port", str(self.port),
             "--served-model-name", self.served_name,
             # a grace period lets the engine process exit by itself on SIGINT; with vLLM's
             # default of 0 it is killed at once and the API server logs EngineDeadError
             "--shutdown-timeout", "10", *self.args],
            stdout=log, stderr=subprocess.STDOUT, env=child_env())
        log.close()  # the child holds its own descriptor
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.process.returncode} before "
                                   f"answering; log: {self.log_path}\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/v1/models", timeout=2):
                    return
            except OSError:
                time.sleep(1.0)
        raise TimeoutError(f"vllm serve did not answer within {self.start_timeout:.0f} s; "
                           f"log: {self.log_path}")

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as response:
            return response.read().decode()

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout: float = 60.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


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
