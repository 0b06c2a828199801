"""mlx-lm's own server (`mlx_lm.server`) on 127.0.0.1, behind the adapter `vllm bench serve` needs.

    with MlxLmServer(model_dir, log_path) as server:
        ... server.url ...   # the adapter (bench/sse_adapter.py); server.upstream is mlx-lm

The server runs as `mlx_lm.server --model DIR` does, in a child process that imports
paged_prefix first, so its matmuls run on the same OpenBLAS as `vllm serve`'s (on MLX's CPU
backend it prints which BLAS, and fails where nox requires OpenBLAS and it is missing). Both
children stop with SIGINT, then SIGKILL if they linger.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.vllm_server import ServerProcess, child_env, free_port, stop_process, wait_until_answering

ROOT = Path(__file__).resolve().parent.parent
LAUNCH = """import sys
from paged_prefix import cpu_blas  # before mlx.core: OpenBLAS, as vllm serve has it
import mlx.core as mx
if mx.default_device() == mx.cpu:  # as the vLLM worker: a GPU's matmuls use no CPU BLAS
    print(cpu_blas.status_line(), flush=True)
    cpu_blas.require()
from mlx_lm.server import main
sys.argv = ["mlx_lm.server", *sys.argv[1:]]
main()
"""


def eos_ids(model: Path) -> list[int]:
    eos = json.loads((Path(model) / "config.json").read_text())["eos_token_id"]
    return eos if isinstance(eos, list) else [eos]


class MlxLmServer(ServerProcess):
    def __init__(self, model: str | Path, log_path: Path, start_timeout: float = 300.0):
        self.model, self.log_path = Path(model), Path(log_path)
        self.start_timeout = start_timeout
        self.upstream = f"http://127.0.0.1:{free_port()}"
        self.url = f"http://127.0.0.1:{free_port()}"
        self.processes: list[subprocess.Popen] = []

    def _start(self, command: list[str], log: Path) -> subprocess.Popen:
        with log.open("w") as out:
            process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                       env=child_env(), cwd=ROOT)
        self.processes.append(process)
        return process

    def start(self) -> None:
        server = self._start([sys.executable, "-c", LAUNCH, "--model", str(self.model),
                              "--host", "127.0.0.1", "--port", self.upstream.rsplit(":")[-1]],
                             self.log_path)
        wait_until_answering(self.upstream + "/v1/models", server, self.log_path,
                             self.start_timeout, "mlx_lm server")
        adapter_log = self.log_path.with_name(self.log_path.stem + "-adapter.log")
        adapter = self._start([sys.executable, "-m", "bench.sse_adapter",
                               "--upstream", self.upstream, "--port", self.url.rsplit(":")[-1],
                               "--eos", *map(str, eos_ids(self.model))], adapter_log)
        # the adapter routes POST only: its 405 to a GET says it is up
        wait_until_answering(self.url + "/v1/completions", adapter, adapter_log, 60.0,
                             "the SSE adapter")

    def stop(self) -> None:
        for process in reversed(self.processes):
            stop_process(process, 30.0)

