"""TTFT demo: a prefix-repetition workload through vLLM's scheduler, caching off vs on.

The workload has the shape of `vllm bench serve --dataset-name prefix_repetition`:
num_prefixes shared prefixes of prefix_len tokens, prompts_per_prefix prompts each with
its own suffix_len-token suffix, output_len tokens generated greedily, prompts shuffled,
all arriving at once by default (request rate inf). Each run uses a fresh engine and the
same model weights; the tokens of the two runs must be identical.

    python -m bench.ttft_demo [--model llama-tiny] [--out results/ttft]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import numpy as np

from paged_prefix.engine import Engine, EngineConfig
from paged_prefix.models import BUILTIN_CONFIGS, resolve_config


def prefix_repetition(num_prefixes, prompts_per_prefix, prefix_len, suffix_len, vocab, seed):
    rng = np.random.default_rng(seed)
    prompts = []
    for _ in range(num_prefixes):
        prefix = rng.integers(3, vocab, prefix_len).tolist()
        prompts += [prefix + rng.integers(3, vocab, suffix_len).tolist()
                    for _ in range(prompts_per_prefix)]
    order = rng.permutation(len(prompts))
    return {f"req{i}": prompts[j] for i, j in enumerate(order)}


def run(args, prompts: dict[str, list[int]], caching: bool) -> dict:
    engine = Engine(EngineConfig(
        model=args.model, dtype=args.dtype, block_size=args.block_size,
        num_blocks=args.num_blocks,
        max_model_len=args.prefix_len + args.suffix_len + args.output_len + 16,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=caching, attention=args.attention))
    # Warm-up on unrelated tokens so one-time setup stays out of the timings.
    engine.add_request("warmup", [1] * (args.suffix_len + 1), 2)
    engine.run_to_completion()
    warm_tokens = engine.tokens_computed
    interval = 0.0 if args.request_rate == float("inf") else 1.0 / args.request_rate
    pending = list(prompts.items())
    start, done = time.perf_counter(), 0
    while pending or engine.has_unfinished():
        now = time.perf_counter()
        while pending and now - start >= interval * (len(prompts) - len(pending)):
            engine.add_request(*pending.pop(0), args.output_len)
        if not engine.has_unfinished():
            time.sleep(max(0.0, start + interval * (len(prompts) - len(pending)) - now))
            continue
        done += len(engine.step())
        if sys.stderr.isatty():
            print(f"\r  prefix caching {'on' if caching else 'off'}: {done}/{len(prompts)} "
                  "requests done", end="", file=sys.stderr, flush=True)
    if sys.stderr.isatty():
        print(file=sys.stderr)
    wall = time.perf_counter() - start
    results = [engine.results[r] for r in prompts]
    ttft = np.array([r.ttft for r in results]) * 1e3
    prompt_tokens = sum(r.prompt_len for r in results)
    cached = sum(r.cached_tokens for r in results)
    return {
        "prefix_caching": caching,
        "ttft_ms_p50": float(np.percentile(ttft, 50)),
        "ttft_ms_p90": float(np.percentile(ttft, 90)),
        "ttft_ms": ttft.tolist(),
        "prompt_tokens": prompt_tokens,
        "prefill_tokens_computed": prompt_tokens - cached,
        "tokens_computed": engine.tokens_computed - warm_tokens,
        "hit_rate": cached / prompt_tokens,
        "wall_s": wall,
        "attention_paths": dict(engine.runner.runner.dispatcher.counts),
        "outputs": {r.req_id: r.output_ids for r in results},
    }


def plot(off: dict, on: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for run_, label in ((off, "prefix caching off"), (on, "prefix caching on")):
        ttft = np.sort(run_["ttft_ms"])
        ax.step(ttft, np.arange(1, len(ttft) + 1) / len(ttft), where="post", label=label)
    ax.set_xlabel("time to first token (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"TTFT CDF, p50 speedup {off['ttft_ms_p50'] / on['ttft_ms_p50']:.1f}x")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-tiny", choices=sorted(BUILTIN_CONFIGS))
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--num-prefixes", type=int, default=4)
    ap.add_argument("--prompts-per-prefix", type=int, default=8)
    ap.add_argument("--prefix-len", type=int, default=460)
    ap.add_argument("--suffix-len", type=int, default=52)
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--attention", default=None, help="dispatcher override (default: auto)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("results/ttft"))
    args = ap.parse_args(argv)
    # vLLM's notices about its own (CUDA/CPU) model runners concern nothing this demo runs
    logging.getLogger("vllm").setLevel(logging.ERROR)

    vocab = resolve_config(args.model)["vocab_size"]
    prompts = prefix_repetition(args.num_prefixes, args.prompts_per_prefix, args.prefix_len,
                                args.suffix_len, vocab, args.seed)
    shared = args.prefix_len / (args.prefix_len + args.suffix_len)
    print(f"model {args.model} ({args.dtype}), {len(prompts)} prompts = {args.num_prefixes} "
          f"prefixes x {args.prompts_per_prefix}, prefix {args.prefix_len} + suffix "
          f"{args.suffix_len} tokens ({shared:.0%} shared), {args.output_len} output tokens")
    off, on = run(args, prompts, caching=False), run(args, prompts, caching=True)

    print(f"\n{'prefix caching':<15}{'TTFT p50 ms':>12}{'TTFT p90 ms':>12}"
          f"{'prefill tok':>12}{'hit rate':>10}{'wall s':>8}")
    for r in (off, on):
        print(f"{'on' if r['prefix_caching'] else 'off':<15}{r['ttft_ms_p50']:>12.1f}"
              f"{r['ttft_ms_p90']:>12.1f}{r['prefill_tokens_computed']:>12d}"
              f"{r['hit_rate']:>10.1%}{r['wall_s']:>8.2f}")
    speedup = {"ttft_p50": off["ttft_ms_p50"] / on["ttft_ms_p50"],
               "ttft_p90": off["ttft_ms_p90"] / on["ttft_ms_p90"],
               "wall": off["wall_s"] / on["wall_s"]}
    print(f"speedup: TTFT p50 {speedup['ttft_p50']:.2f}x, p90 {speedup['ttft_p90']:.2f}x, "
          f"wall {speedup['wall']:.2f}x")
    print(f"attention paths: {on['attention_paths']}")
    identical = off["outputs"] == on["outputs"]
    print(f"outputs identical (caching off vs on, {len(prompts)} requests x "
          f"{args.output_len} tokens): {'yes' if identical else 'NO'}")

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ttft.json").write_text(json.dumps(
        {"args": {k: str(v) for k, v in vars(args).items()}, "off": off, "on": on,
         "speedup": speedup, "outputs_identical": identical}, indent=1))
    try:
        plot(off, on, args.out / "ttft.png")
        print(f"wrote {args.out / 'ttft.json'} and {args.out / 'ttft.png'}")
    except ImportError:
        print(f"wrote {args.out / 'ttft.json'} (install matplotlib for the plot)")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
