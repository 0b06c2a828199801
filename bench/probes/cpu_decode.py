"""A decode step on MLX's CPU backend against mlx-lm's, and the K/V layout behind the gap.

    python -m bench.probes.cpu_decode [--contexts 448 1024] [--rounds 12]

Two measurements, each interleaved round by round:
  step       SmolLM2-135M float32 (convert_smollm2's folder), one row over C cached tokens:
             mlx-lm's model over its own cache against the paged runner (forward + argmax)
             over a token-major cache and over a heads-major one (`PagedKVCache.heads_major`,
             what a server uses on the CPU), its pages in one run of blocks (read in place)
             and, heads-major, in three runs (each read in place, one softmax over them:
             `reference.joined_sdpa`) and in shuffled blocks (runs too many and short: gathered);
  attention  one layer's attention of that model (9 heads, 3 kv heads, D 64) for a decode row,
             30 layers' worth per evaluation: SDPA over mlx-lm's head-major cache as it reads
             it (a slice of [1, Hkv, T, D]); over token-major rows the runner's path
             (`reference.masked_sdpa` copies them head-major first), that copy alone, and SDPA
             straight over them; over a heads-major cache's rows read in place; and over
             its pages in R runs of blocks, read in place (joined) or gathered by MLX's take:
             the measurement behind `paged_prefix.route.MAX_JOINED_RUNS`.
MLX's CPU matmul takes a matrix only with unit stride in one dimension and the other equal to
its width, so in vLLM's token-major layout [blocks, block_size, Hkv, D] each kv head's rows
(stride Hkv * D) are copied, or strided through, every layer and step.
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
import numpy as np
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

import reference
from jit_kernels.arrays import as_pages
from jit_kernels.geometry import Geometry
from paged_prefix.convert_smollm2 import smollm2_folder
from paged_prefix.kv_cache import PagedKVCache
from paged_prefix.metadata import ScheduledRequest, build_batch_metadata
from paged_prefix.runner import PagedModelRunner

BLOCK_SIZE, LAYERS = 16, 30
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def median_ms(times: list[float]) -> float:
    return 1e3 * statistics.median(times)


def step_times(context: int, rounds: int) -> dict[str, float]:
    folder = str(smollm2_folder("float32"))
    dense, _ = load(folder)
    args = dense.args
    needed = (context + rounds) // BLOCK_SIZE + 1
    num_blocks = needed + 10
    tokens = np.random.default_rng(0).integers(3, args.vocab_size, context + rounds).tolist()
    blocks = list(range(1, needed + 1))
    # three runs: a lone served request's cached prefix and its later blocks
    tables = {"token-major": blocks, "heads-major": blocks,
              "heads-major 3 runs": in_runs(needed, 3, first=1)[0].tolist(),
              "heads-major scattered":
              np.random.default_rng(1).permutation(num_blocks - 1)[:needed] + 1}
    runners = {}
    for name, heads_major in (("token-major", False), ("heads-major", True),
                              ("heads-major 3 runs", True), ("heads-major scattered", True)):
        paged, _ = load(folder)
        kv = PagedKVCache(args.num_hidden_layers, num_blocks, BLOCK_SIZE,
                          args.num_key_value_heads, args.hidden_size // args.num_attention_heads,
                          mx.float32, heads_major=heads_major)
        runners[name] = PagedModelRunner(paged, kv)
        runners[name].greedy(build_batch_metadata(
            [ScheduledRequest("r", tokens[:context], context, 0, context, tables[name])],
            BLOCK_SIZE, num_blocks))
    cache = make_prompt_cache(dense)
    mx.eval(dense(mx.array([tokens[:context]]), cache=cache))
    times: dict[str, list[float]] = {"mlx-lm": [], **{name: [] for name in runners}}
    for i in range(rounds):
        n = context + i
        for name, runner in runners.items():
            meta = build_batch_metadata([ScheduledRequest(
                "r", tokens[:n + 1], context, n, 1, tables[name])], BLOCK_SIZE, num_blocks)
            start = time.perf_counter()
            runner.greedy(meta)
            times[name].append(time.perf_counter() - start)
        start = time.perf_counter()
        logits = dense(mx.array([[tokens[n]]]), cache=cache)
        mx.eval(mx.argmax(logits[:, -1], axis=-1), [c.state for c in cache])
        times["mlx-lm"].append(time.perf_counter() - start)
    return {k: median_ms(v[2:]) for k, v in times.items()}


RUN_COUNTS = (2, 4, 16, 32)


def in_runs(blocks: int, n: int, first: int = 0) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """A block table of `blocks` blocks from `first` on in n runs, 3 blocks apart (fewer where
    there are fewer blocks), and its runs (first block, blocks)."""
    parts = np.array_split(np.arange(first, first + blocks), n)
    table = np.concatenate([part + 3 * r for r, part in enumerate(parts)]).astype(np.int32)
    return table, [(int(part[0]) + 3 * r, len(part)) for r, part in enumerate(parts) if len(part)]


def pieces(k: mx.array, v: mx.array, runs: list[tuple[int, int]]) -> tuple[list, list]:
    """A heads-major cache's [Hkv, rows, D] rows of each run, each as a view."""
    rows = [slice(b * BLOCK_SIZE, (b + n) * BLOCK_SIZE) for b, n in runs]
    return [k[None, :, r] for r in rows], [v[None, :, r] for r in rows]


def attention_times(context: int, rounds: int) -> dict[str, float]:
    scale = HEAD_DIM ** -0.5
    normal = mx.random.normal
    q = [normal((1, HEADS, 1, HEAD_DIM)) for _ in range(LAYERS)]
    # mlx-lm's cache: [1, Hkv, allocated, D], read as a slice; the paged cache's token rows
    heads_major = [(normal((1, KV_HEADS, context + 256, HEAD_DIM)),) * 2 for _ in range(LAYERS)]
    rows = [(normal((4 * context, KV_HEADS, HEAD_DIM)),) * 2 for _ in range(LAYERS)]
    cache_heads = [(normal((KV_HEADS, 4 * context + 2048, HEAD_DIM)),) * 2 for _ in range(LAYERS)]
    mx.eval(q, heads_major, rows, cache_heads)
    visible = slice(context, 2 * context)

    def sdpa(i, k, v):
        return mx.fast.scaled_dot_product_attention(q[i], k, v, scale=scale)

    cases = {
        "mlx-lm's cache": lambda: [sdpa(i, k[:, :, :context], v[:, :, :context])
                                   for i, (k, v) in enumerate(heads_major)],
        "runner (copy + SDPA)": lambda: [reference.masked_sdpa(
            q[i], reference.heads_first(k[visible]), reference.heads_first(v[visible]), scale,
            None) for i, (k, v) in enumerate(rows)],
        "the copy alone": lambda: [mx.contiguous(reference.heads_first(x[visible]))
                                   for pair in rows for x in pair],
        "SDPA, no copy": lambda: [sdpa(i, reference.heads_first(k[visible]),
                                       reference.heads_first(v[visible]))
                                  for i, (k, v) in enumerate(rows)],
        "heads-major cache": lambda: [reference.masked_sdpa(
            q[i], k[None, :, visible], v[None, :, visible], scale, None, kv_laid_head_major=True)
            for i, (k, v) in enumerate(cache_heads)],
    }
    g = Geometry(HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, mx.float32, scale, heads_major=True)
    pages = [(as_pages(k, g), as_pages(v, g)) for k, v in cache_heads]  # as MLX's take reads them
    for n in RUN_COUNTS:
        table, runs = in_runs(-(-context // BLOCK_SIZE), n)
        cases[f"{n} runs joined"] = lambda runs=runs: [reference.joined_sdpa(
            q[i], *pieces(k, v, runs), scale, None) for i, (k, v) in enumerate(cache_heads)]
        cases[f"{n} runs taken"] = lambda table=table: [reference.masked_sdpa(
            q[i], *reference.gather_kv(kp, vp, mx.array(table), context), scale, None)
            for i, (kp, vp) in enumerate(pages)]
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, build in cases.items():
            start = time.perf_counter()
            mx.eval(build())
            times[name].append(time.perf_counter() - start)
    return {k: median_ms(v[2:]) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[448, 1024])
    parser.add_argument("--rounds", type=int, default=12)
    a = parser.parse_args()
    for context in a.contexts:
        step = step_times(context, a.rounds)
        print(f"C={context} decode step (ms): " + ", ".join(
            f"{k} {v:.1f}" for k, v in step.items()) + "; runner / mlx-lm: " + ", ".join(
            f"{k} {v / step['mlx-lm']:.3f}" for k, v in step.items() if k != "mlx-lm"))
        attn = attention_times(context, a.rounds)
        print(f"C={context} attention, {LAYERS} layers (ms): " + ", ".join(
            f"{k} {v:.2f}" for k, v in attn.items()))


if __name__ == "__main__":
    main()
