"""The serving benchmark's plots: per-request TTFT side by side, with the values on the bars.

`per_request` draws each request's TTFT for every run (caching off / on) with its p50 and
p90 beside it; `against` paged_prefix and mlx-lm's server on every workload, metric by
metric, and the multi-turn workload's TTFT by turn.
The title carries the model, the workload and the hit rate, so a saved PNG stands alone.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

COLORS = ["#9e9e9e", "#1f77b4"]  # a baseline (caching off) grey, the run it is compared with blue
AGAINST_COLORS = ["#1f77b4", "#ff7f0e"]  # paged_prefix, mlx-lm


def require() -> None:
    """Raises at once where matplotlib is missing: before a run of many minutes, not after."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit("matplotlib: the serving benchmark's plots need it (pip install "
                         "'paged-prefix[bench]'; nox -s serve-bench installs it)") from None


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _bars(ax, groups: list[str], series: dict[str, list[float]], fmt: str = "{:.1f}",
          colors: list[str] = COLORS) -> None:
    """Grouped bars, one group per x label, each bar labelled with its value."""
    width = 0.8 / len(series)
    many = len(groups) * len(series) > 24
    for i, (label, values) in enumerate(series.items()):
        xs = np.arange(len(groups)) + (i - (len(series) - 1) / 2) * width
        bars = ax.bar(xs, values, width, label=label, color=colors[i])
        ax.bar_label(bars, [fmt.format(v) for v in values], fontsize=6 if many else 8,
                     rotation=90 if many else 0, padding=2)
    ax.set_xticks(range(len(groups)), groups, fontsize=7 if len(groups) > 16 else 9)
    # headroom above the tallest bar's label for the legend, which would otherwise hide a value
    # (bars stick to 0, so the margin goes on top only)
    ax.margins(y=0.35)
    ax.legend(fontsize=8, loc="upper right")


def per_request(runs: dict[str, list[float]], title: str, path: Path) -> None:
    """runs: label -> TTFT in seconds per request, in the client's request order."""
    plt = _pyplot()
    n = max(len(v) for v in runs.values())
    fig, (each, summary) = plt.subplots(1, 2, figsize=(max(10, 4 + n * 0.35), 4.8),
                                        gridspec_kw={"width_ratios": [max(3, n / 6), 1]})
    _bars(each, [str(i) for i in range(n)], runs)
    each.set_xlabel("request (client's order)")
    each.set_ylabel("time to first token (s)")
    _bars(summary, ["p50", "p90"],
          {label: [float(np.percentile(v, q)) for q in (50, 90)] for label, v in runs.items()})
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def against(results: dict[str, dict[str, dict]], turns: dict[str, list[float]], title: str,
            path: Path) -> None:
    """results: workload -> server -> metrics (ttft_p50_ms, ttft_p90_ms, tpot_p50_ms,
    output_throughput); turns: server -> multi-turn TTFT p50 per turn (ms). One figure: a
    panel per metric (a group per workload, a bar per server), then TTFT by turn."""
    plt = _pyplot()
    workloads = list(results)
    servers = list(next(iter(results.values())))
    fig = plt.figure(figsize=(15, 8))
    grid = fig.add_gridspec(2, 4)
    for i, (key, label, fmt) in enumerate([
            ("ttft_p50_ms", "TTFT p50 (ms)", "{:.0f}"), ("ttft_p90_ms", "TTFT p90 (ms)", "{:.0f}"),
            ("tpot_p50_ms", "TPOT p50 (ms)", "{:.1f}"),
            ("output_throughput", "output tokens/s", "{:.1f}")]):
        ax = fig.add_subplot(grid[0, i])
        _bars(ax, workloads, {s: [results[w][s][key] for w in workloads] for s in servers}, fmt,
              AGAINST_COLORS)
        ax.set_title(label, fontsize=10)
        ax.tick_params(axis="x", labelsize=8)
    ax = fig.add_subplot(grid[1, :])
    _bars(ax, [f"turn {t + 1}" for t in range(max(map(len, turns.values())))], turns, "{:.0f}",
          AGAINST_COLORS)
    ax.set_ylabel("multi-turn TTFT p50 (ms)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
