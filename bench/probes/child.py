"""A probe's runs, each in a process of its own (vLLM fixes its platform once a process, and a
run's memory readings must not see another's): the child prints its result as one line,
`RESULT <json>`, which the parent reads back."""

from __future__ import annotations

import json
import subprocess
import sys

PREFIX = "RESULT "


def report(result: dict) -> None:
    """The child's side: its result, as the line the parent reads."""
    print(PREFIX + json.dumps(result), flush=True)


def run(module: str, args: list[str]) -> tuple[dict | None, subprocess.CompletedProcess]:
    """`python -m module *args` in a child process: its last result line (None when it printed
    none), and the finished process (its exit code and stderr, for the caller's error)."""
    proc = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(PREFIX)]
    return (json.loads(lines[-1][len(PREFIX):]) if lines else None), proc
