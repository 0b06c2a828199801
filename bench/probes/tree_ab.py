"""This tree's paged prefill against another revision's, in one process: mlx-lm, the other
revision's runner and this tree's, step by step over the same weights and tokens.

    python -m bench.probes.tree_ab --rev 9fc46d4 [--shape llama-1b:4096] [--rounds 40]
                                   [--hits 0,2048,3584,3680] [--out tree_ab.json]

Run from a git checkout. The other revision's `paged_prefix`, `jit_kernels` and `reference`
(`git archive`) are imported under other names (`ab_paged_prefix`, ...), so both trees run
side by side. Two processes of one tree differ by more than two trees do: on the H200 mlx-lm's
own step moved 6.0-8.3 ms between processes at one shape, so a comparison of trees in separate
processes reads that noise as a gap; here every round runs mlx-lm, the other tree and this one
in turn (alternating the order), and times each runner's host build of the forward (the lazy
graph, nothing evaluated) apart. Per point: medians, the paired median of this tree's step over
the other's, and the path each took. The other revision needs the runner API of 9fc46d4 or later
(`PagedModelRunner(model, kv_cache, dispatcher)`, `build_batch_metadata`).
"""

from __future__ import annotations

import argparse
import importlib
import io
import json
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from bench.prefill_setup import BLOCK_SIZE, DTYPE, HIT_FRACTIONS, MlxLmStep, PagedStep, hit_tokens

PACKAGES = ("paged_prefix", "jit_kernels", "reference")
PREFIX = "ab_"


def import_revision(rev: str, into: Path) -> str:
    """`rev`'s product packages, renamed with PREFIX under `into` (put on sys.path); returns
    the revision's short hash."""
    sha = subprocess.run(["git", "rev-parse", "--short", rev], capture_output=True, text=True,
                         check=True).stdout.strip()
    archive = subprocess.run(["git", "archive", sha, *PACKAGES], capture_output=True,
                             check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    names = "|".join(PACKAGES)
    for path in into.rglob("*.py"):
        text = path.read_text()
        text = re.sub(rf"^(\s*)import ({names})\s*$", rf"\1import {PREFIX}\2 as \2", text,
                      flags=re.M)
        path.write_text(re.sub(rf"^(\s*)from ({names})\b", rf"\1from {PREFIX}\2", text,
                               flags=re.M))
    for name in PACKAGES:
        (into / name).rename(into / f"{PREFIX}{name}")
    sys.path.insert(0, str(into))
    return sha


class Tree:
    """One tree's runner over the shared weights, its cache filled with the whole prompt."""

    def __init__(self, prefix: str, cfg: dict, dense, prompt: list[int]):
        def module(name):
            return importlib.import_module(f"{prefix}paged_prefix.{name}")
        self.models, self.metadata = module("models"), module("metadata")
        self.runner_mod, self.dispatch = module("runner"), module("dispatch")
        self.prompt = prompt
        self.blocks = list(range(1, -(-len(prompt) // BLOCK_SIZE) + 1))
        paged = self.models.build_model(cfg, DTYPE, evaluate=False)
        paged.update(dense.parameters())  # the same arrays, not a copy
        kv = module("kv_cache").PagedKVCache(cfg["num_hidden_layers"], len(self.blocks) + 1,
                                             BLOCK_SIZE, cfg["num_key_value_heads"],
                                             cfg["head_dim"], DTYPE)
        self.base = self.runner_mod.PagedModelRunner(paged, kv)
        self.base.greedy(self.meta(0))

    def meta(self, hit: int):
        n = len(self.prompt)
        return self.metadata.build_batch_metadata([self.metadata.ScheduledRequest(
            "r", self.prompt, n, hit, n - hit, self.blocks)], BLOCK_SIZE, len(self.blocks) + 1)

    def step(self, hit: int) -> BuiltStep:
        runner = self.runner_mod.PagedModelRunner(self.base.model, self.base.kv_cache,
                                                  self.dispatch.Dispatcher("auto"))
        return BuiltStep(runner, self.meta(hit))


class BuiltStep(PagedStep):
    def build(self) -> float:
        """Seconds to build the forward's graph; then evaluated, as a step."""
        t0 = time.perf_counter()
        out = self.runner.forward(self.meta)
        t1 = time.perf_counter()
        mx.eval(out, self.runner.kv_cache.arrays())
        return t1 - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rev", required=True, help="the other revision (git)")
    parser.add_argument("--shape", default="llama-1b:4096" if DTYPE == mx.bfloat16 else
                        "llama-tiny:512", help="model:prompt_len")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--hits", default=None, help="cached tokens per point, comma-separated "
                        "(default: 0%%, 50%%, 87.5%% and 90%% of the prompt, whole blocks)")
    parser.add_argument("--out", type=Path, default=Path("results/tree_ab.json"))
    args = parser.parse_args()
    name, prompt_len = args.shape.split(":")
    prompt_len = int(prompt_len)
    hits = [int(h) for h in args.hits.split(",")] if args.hits else \
        [hit_tokens(prompt_len, f) for f in HIT_FRACTIONS]
    with tempfile.TemporaryDirectory() as tmp:
        sha = import_revision(args.rev, Path(tmp))
        trees = {"other": PREFIX, "this": ""}
        models = importlib.import_module("paged_prefix.models")
        cfg = models.resolve_config(name)
        dense = models.build_model(cfg, DTYPE)
        prompt = np.random.default_rng(0).integers(3, cfg["vocab_size"], prompt_len).tolist()
        built = {k: Tree(prefix, cfg, dense, prompt) for k, prefix in trees.items()}
        cache = make_prompt_cache(dense)
        rows = []
        for hit in hits:
            steps = {"mlx-lm": MlxLmStep(dense, cache, prompt, hit),
                     **{k: t.step(hit) for k, t in built.items()}}
            for _ in range(3):  # compile, cuDNN graphs, the rule's second ask
                for step in steps.values():
                    step()
            times = {k: [] for k in steps}
            builds = {k: [] for k in trees}
            for i in range(args.rounds):
                order = list(steps) if i % 2 == 0 else list(steps)[::-1]
                for k in order:
                    t0 = time.perf_counter()
                    steps[k]()
                    times[k].append((time.perf_counter() - t0) * 1e3)
                for k in order:
                    if k in builds:
                        builds[k].append(steps[k].build() * 1e3)
            row = {"model": name, "prompt_len": prompt_len, "hit": hit, "rounds": args.rounds,
                   **{f"{k}_ms": statistics.median(v) for k, v in times.items()},
                   **{f"{k}_build_ms": statistics.median(v) for k, v in builds.items()},
                   **{f"{k}_path": steps[k].runner.dispatcher.last.path for k in trees},
                   **{f"{k}_over_mlx_lm": statistics.median(times[k]) /
                      statistics.median(times["mlx-lm"]) for k in trees},
                   "this_over_other_paired": statistics.median(
                       b / a for a, b in zip(times["other"], times["this"]))}
            rows.append(row)
            print(json.dumps({k: round(v, 4) if isinstance(v, float) else v
                              for k, v in row.items()}), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"other": sha, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
