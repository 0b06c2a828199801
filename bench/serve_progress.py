"""A benchmark client run in the background, with a progress line every few seconds.

`vllm bench serve` writes its progress bar (tqdm: "12/32 [00:41<...]") to its log, and vLLM's
server its throughput lines to its own log: read from those, the user sees requests done of
the total, what the server received and (vLLM) its last throughput line with the running and
waiting requests, the elapsed time and where the logs are, instead of minutes of silence.
"""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

PROGRESS = re.compile(r"(\d+)/(\d+) \[")
ENGINE_STATS = re.compile(r"Avg prompt throughput: .*?Waiting: \d+ reqs")
PRINT_EVERY_S = 10.0


def requests_done(log: Path) -> tuple[int, int] | None:
    """The last done/total the client's progress bar wrote, if any yet."""
    hits = PROGRESS.findall(log.read_text(errors="replace")) if log.exists() else []
    return (int(hits[-1][0]), int(hits[-1][1])) if hits else None


def server_log_status(log: Path) -> Callable[[], str]:
    """What the server logged since now: the requests it has begun to answer (both servers'
    access logs write a line per POST as the response starts) and vLLM's last throughput
    line (prompt and generation tokens/s, running and waiting requests)."""
    start = len(log.read_text(errors="replace"))

    def status() -> str:
        text = log.read_text(errors="replace")[start:]
        stats = ENGINE_STATS.findall(text)
        return (f"server has begun {text.count('POST /v1/completions')}"
                + (f"; {stats[-1]}" if stats else ""))
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
                parts = [f"{done[0]}/{done[1]} requests done" if done else
                         "client starting (tokenizer, prompts)", f"{now - start:.0f} s"]
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
