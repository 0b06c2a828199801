"""Where a serve bench's TTFT goes: the client's requests lined up with the server's steps.

    python -m bench.ttft_breakdown results/serve_bench      # after serve_bench --breakdown

vLLM's benchmark client stamps each request's send time with `time.perf_counter()` and
measures its TTFT; the runner's step log (`VLLM_LOGGING_LEVEL=DEBUG`) stamps each step's
forward start and sampling end with the same clock (one machine: CLOCK_MONOTONIC). A request's
TTFT then splits into:
  before    send -> the first step that starts after it (HTTP, tokenization, the scheduler,
            waiting for the step that was running when it arrived);
  forward   the forwards of the steps from then until its first token (its own prefill and
            the other requests' it queued behind), graph building included; a step whose
            rows sample on the device is not waited for, so the next forward's wait for it
            (and the device time it hides) counts here;
  sampling  those steps' sampling (vLLM's sampler, the MLX -> torch copy; or the launch of
            the argmax on the device);
  between   the rest of those steps' span: the engine between forward and sampling and
            between steps (scheduling, output processing, IPC);
  after     the last of those steps' end -> the client's first token (detokenization, the
            API server, the stream).
The means add up to the mean TTFT exactly; the steps' prefill tokens are the work they did.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

_FORWARD = re.compile(r"step: (\d+) sequences \((\d+) of one token\), (\d+) tokens after \d+ "
                      r"already in the cache, .*; forward ([\d.]+) ms \(([\d.]+) ms of it "
                      r"building the graph(?:, ([\d.]+) ms waiting for the step before)?\) "
                      r"from t=([\d.]+) s")
_SAMPLED = re.compile(r"step: sampled \d+ rows in ([\d.]+) ms, ending at t=([\d.]+) s")
PARTS = ("before", "forward", "sampling", "between", "after")


@dataclass(frozen=True)
class Step:
    start: float  # s, perf_counter
    forward_ms: float
    build_ms: float
    wait_ms: float  # of forward_ms: waiting for the step before (0 where the log has none)
    tokens: int  # tokens computed (prefill rows + decode rows)
    decode_rows: int
    sample_ms: float
    end: float  # s: sampling done


def steps_of(server_log: str) -> list[Step]:
    """The runner's steps in log order: each forward line with the sampling line after it."""
    steps, pending = [], None
    for line in server_log.splitlines():
        if m := _FORWARD.search(line):
            pending = m
        elif (m := _SAMPLED.search(line)) and pending is not None:
            _, ones, tokens, fwd, build, wait, start = pending.groups()
            steps.append(Step(float(start), float(fwd), float(build), float(wait or 0),
                              int(tokens), int(ones), float(m.group(1)), float(m.group(2))))
            pending = None
    return steps


def request_parts(send: float, ttft: float, steps: list[Step]) -> dict[str, float]:
    """One request's TTFT in ms, split as the module says."""
    first_token = send + ttft
    inside = [s for s in steps if s.start >= send and s.end <= first_token]
    if not inside:
        return {"before": 1e3 * ttft, "forward": 0.0, "sampling": 0.0, "between": 0.0,
                "after": 0.0, "steps": 0, "prefill_tokens": 0}
    forward = sum(s.forward_ms for s in inside)
    sampling = sum(s.sample_ms for s in inside)
    span = 1e3 * (inside[-1].end - inside[0].start)
    return {"before": 1e3 * (inside[0].start - send), "forward": forward, "sampling": sampling,
            "between": span - forward - sampling, "after": 1e3 * (first_token - inside[-1].end),
            "steps": len(inside),
            "prefill_tokens": sum(s.tokens - s.decode_rows for s in inside)}


def breakdown(server_log: str, detail: dict) -> dict:
    """Means of every part over the run's requests (they add up to the mean TTFT), the request
    at the median TTFT's parts, and the server's steps over the run."""
    steps = steps_of(server_log)
    sends, ttfts = detail["start_times"], detail["ttfts"]
    if not steps:
        raise ValueError("server_log: no timed step lines (serve with VLLM_LOGGING_LEVEL=DEBUG)")
    if len(sends) != len(ttfts) or not ttfts:
        raise ValueError("detail: start_times and ttfts must list the same requests")
    parts = [request_parts(a, t, steps) for a, t in zip(sends, ttfts)]
    median = sorted(range(len(ttfts)), key=lambda i: ttfts[i])[len(ttfts) // 2]
    run = [s for s in steps if s.start >= min(sends)]
    return {
        "ttft_mean_ms": 1e3 * statistics.fmean(ttfts),
        "mean_ms": {p: statistics.fmean(r[p] for r in parts) for p in PARTS},
        "median_request": {"ttft_ms": 1e3 * ttfts[median], **parts[median]},
        "run_steps": len(run),
        "run_forward_ms": sum(s.forward_ms for s in run),
        "run_build_ms": sum(s.build_ms for s in run),
        "run_prefill_tokens": sum(s.tokens - s.decode_rows for s in run),
    }


def table(breakdowns: dict[str, dict]) -> str:
    columns = list(breakdowns)
    lines = [f"{'TTFT, mean per request (ms)':<30}" + "".join(f"{c:>12}" for c in columns)]
    for part in PARTS:
        lines.append(f"{part:<30}" + "".join(f"{breakdowns[c]['mean_ms'][part]:>12.1f}"
                                             for c in columns))
    lines.append(f"{'= TTFT mean':<30}" + "".join(f"{breakdowns[c]['ttft_mean_ms']:>12.1f}"
                                                  for c in columns))
    for label, key, fmt in (("median request: TTFT", "ttft_ms", "{:.1f}"),
                            ("median request: forward", "forward", "{:.1f}"),
                            ("median request: steps", "steps", "{:d}")):
        lines.append(f"{label:<30}" + "".join(
            f"{fmt.format(breakdowns[c]['median_request'][key]):>12}" for c in columns))
    for label, key in (("run: steps", "run_steps"), ("run: forward ms", "run_forward_ms"),
                       ("run: prefill tokens", "run_prefill_tokens")):
        lines.append(f"{label:<30}" + "".join(f"{breakdowns[c][key]:>12.0f}" for c in columns))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="a serve_bench --out folder")
    args = parser.parse_args(argv)
    found = {}
    for setting in ("off", "on"):
        log, detail = args.out / f"server-{setting}.log", args.out / f"caching-{setting}.json"
        if log.exists() and detail.exists():
            found[f"caching {setting}"] = breakdown(log.read_text(errors="replace"),
                                                    json.loads(detail.read_text()))
    if not found:
        raise ValueError(f"out: no server-*.log with caching-*.json in {args.out}")
    print(table(found))
    return 0


if __name__ == "__main__":
    sys.exit(main())
