"""pytest-benchmark: one prompt's prefill, paged runner vs mlx-lm's contiguous prompt cache.

The cases and implementations are bench/prefill_setup.py's (mlx-lm, auto, auto-scattered, and on
a GPU sdpa and kernel with the path forced); one benchmark group per model, prompt and hit.

    pytest bench/test_bench_prefill.py --benchmark-only --benchmark-json=prefill.json
"""

from __future__ import annotations

import time

import pytest

from bench.prefill_setup import GPU, HIT_FRACTIONS, SHAPES, hit_tokens, setup_for
from jit_kernels import available_backends

IMPLS = ("mlx-lm", "auto", "auto-scattered", "sdpa", "kernel") if GPU else (
    "mlx-lm", "auto", "auto-scattered")
# Short steps (a few ms, mostly host work) move 10-30% from run to run on a GPU: each row gets
# as many rounds as fit in ~ROUND_BUDGET_S, within [MIN_ROUNDS, MAX_ROUNDS].
MIN_ROUNDS, MAX_ROUNDS, ROUND_BUDGET_S = 5, 40, 1.5


def rounds_for(step) -> int:
    """Time a third step (the first two warm up: an auto row's second step is the one that may
    build a cuDNN graph, see bench/steady_route.py); rounds that fit the budget."""
    for _ in range(2):
        getattr(step, "prepare", lambda: None)()
        step()
    getattr(step, "prepare", lambda: None)()
    t0 = time.perf_counter()
    step()
    return max(MIN_ROUNDS, min(MAX_ROUNDS, int(ROUND_BUDGET_S / (time.perf_counter() - t0))))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fraction", HIT_FRACTIONS, ids=lambda f: f"hit{f:g}")
@pytest.mark.parametrize("name, prompt_len", SHAPES, ids=[f"{n}-{p}" for n, p in SHAPES])
def test_prefill(benchmark, name, prompt_len, fraction, impl):
    s = setup_for(name, prompt_len)
    hit = hit_tokens(prompt_len, fraction)
    if impl == "kernel" and fraction == 0.0:
        pytest.skip("nothing cached: the kernel path is never chosen")
    layout = "scattered" if impl == "auto-scattered" else "run"
    step = s.mlx_lm_prefill(hit) if impl == "mlx-lm" else s.paged_prefill(
        hit, {"kernel": next(iter(available_backends()), "auto"),
              "auto-scattered": "auto"}.get(impl, impl), layout)
    benchmark.group = f"{name} {prompt_len} tokens, hit {hit}"
    runner = None if impl == "mlx-lm" else step.runner
    before = runner.stats.tokens_computed if runner else 0
    rounds = rounds_for(step)
    benchmark.pedantic(step, setup=getattr(step, "prepare", None), rounds=rounds,
                       warmup_rounds=1)
    if runner:
        assert runner.stats.tokens_computed - before == (rounds + 4) * (prompt_len - hit)
        benchmark.extra_info["path"] = runner.dispatcher.last.path
    benchmark.extra_info.update(model=name, prompt_len=prompt_len, hit=hit, impl=impl,
                                rounds=rounds)
