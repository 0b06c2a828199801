"""Table and plot of the end-to-end prefill benchmark: bench/test_bench_prefill.py's
pytest-benchmark JSON, or bench/prefill_interleaved.py's.

    python -m bench.plot_prefill results/cuda/prefill.json [--out prefill.png]

Prints, per model, prompt and hit, the median of mlx-lm's contiguous cache and of each paged
path with its ratio to mlx-lm, and plots the ratios.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def load(path: Path) -> dict:
    """{(model, prompt_len, hit): {impl: median ms}} from either benchmark's JSON."""
    data = json.loads(path.read_text())
    if isinstance(data, list):  # prefill_interleaved.py: one row per step, "<impl>_ms" medians
        return {(r["model"], r["prompt_len"], r["hit"]): {k[:-3]: v for k, v in r.items()
                                                          if k.endswith("_ms")} for r in data}
    rows: dict = defaultdict(dict)
    for b in data["benchmarks"]:
        info = b["extra_info"]
        rows[(info["model"], info["prompt_len"], info["hit"])][info["impl"]] = \
            b["stats"]["median"] * 1e3
    return dict(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", type=Path)
    parser.add_argument("--out", type=Path, default=None, help="PNG path (needs matplotlib)")
    args = parser.parse_args()
    rows = load(args.json)
    impls = [i for i in ("auto", "auto-scattered", "sdpa", "kernel")
             if any(i in r for r in rows.values())]
    width = {i: max(11, len(i) + 6) for i in impls}
    print(f"{'model':<10}{'prompt':>7}{'hit':>7}{'mlx-lm ms':>11}"
          + "".join(f"{i + ' ms':>{width[i]}}{i + '/mlx':>{width[i]}}" for i in impls))
    for (model, prompt_len, hit), r in sorted(rows.items()):
        line = f"{model:<10}{prompt_len:>7}{hit:>7}{r['mlx-lm']:>11.2f}"
        for i in impls:
            w = width[i]
            line += (f"{r[i]:>{w}.2f}{r[i] / r['mlx-lm']:>{w}.3f}" if i in r else f"{'-':>{2 * w}}")
        print(line)
    if args.out:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        keys = sorted(rows)
        fig, ax = plt.subplots(figsize=(10, 4))
        width = 0.8 / len(impls)
        for n, i in enumerate(impls):
            ax.bar([k + n * width for k in range(len(keys))],
                   [rows[key].get(i, float("nan")) / rows[key]["mlx-lm"] for key in keys],
                   width, label=i)
        ax.axhline(1.0, color="black", lw=0.8)
        ax.axhline(1.03, color="gray", lw=0.8, ls="--", label="1.03")
        ax.set_xticks([k + 0.4 - width / 2 for k in range(len(keys))])
        ax.set_xticklabels([f"{m}\n{p} hit {h}" for m, p, h in keys], fontsize=6)
        ax.set_ylabel("prefill time / mlx-lm contiguous")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(args.out, dpi=130)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
