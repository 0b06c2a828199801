"""A benchmark client run in the background, with a progress line every few seconds.

`vllm bench serve` writes its progress bar (tqdm: "12/32 [00:41<...]") to its log, and vLLM's
server its throughput lines to its own log: read from those, the user sees requests done of
the total, the server's queue when it has /metrics, the elapsed time and where the logs are,
instead of minutes of silence.
"""

from __future__ import annotations

import re
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from bench.vllm_server import metric_total

PROGRESS = re.compile(r"(\d+)/(\d+) \[")
PRINT_EVERY_S = 10.0


def requests_done(log: Path) -> tuple[int, int] | None:
    """The last done/total the client's progress bar wrote, if any yet."""
    hits = PROGRESS.findall(log.read_text(errors="replace")) if log.exists() else []
    return (int(hits[-1][0]), int(hits[-1][1])) if hits else None


def vllm_queue(url: str) -> Callable[[], str]:
    """The server's running and waiting requests, from its /metrics."""
    def status() -> str:
        try:
            with urllib.request.urlopen(url + "/metrics", timeout=2) as response:
                text = response.read().decode()
        except OSError:
            return "server busy"
        return (f"server: {metric_total(text, 'vllm:num_requests_running'):.0f} running, "
                f"{metric_total(text, 'vllm:num_requests_waiting'):.0f} waiting")
    return status


def run_client(command: list[str], log: Path, label: str, total: int, timeout_s: float,
               server_status: Callable[[], str] | None = None) -> None:
    """Run `command` with its output in `log`, printing progress until it exits; raises
    when it fails or runs past `timeout_s`, naming the log."""
    print(f"[{label}] client started, {total} requests; log {log}", flush=True)
    start = last = time.monotonic()
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        while process.poll() is None:
            time.sleep(0.5)
            now = time.monotonic()
            if now - start > timeout_s:
                raise TimeoutError(f"[{label}] client still running after {timeout_s:.0f} s; "
                                   f"log {log}")
            if now - last >= PRINT_EVERY_S:
                last = now
                done = requests_done(log)
                parts = [f"{done[0]}/{done[1]} requests done" if done else "0 requests done",
                         f"{now - start:.0f} s"]
                if server_status:
                    parts.append(server_status())
                print(f"[{label}] " + ", ".join(parts), flush=True)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    if process.returncode:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
        raise RuntimeError(f"[{label}] client exited with {process.returncode}; log {log}\n{tail}")
    print(f"[{label}] {total} requests done in {time.monotonic() - start:.0f} s", flush=True)
