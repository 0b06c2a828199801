"""`vllm serve` + vLLM's own `vllm bench serve --dataset-name prefix_repetition`: caching off vs on.

For each setting the same server command runs on 127.0.0.1, differing only in
--enable-prefix-caching / --no-enable-prefix-caching; vLLM's benchmark client sends the same
seeded prompts (`--temperature 0 --ignore-eos --save-detailed`, all at once); the server's
/metrics give the prefix-cache queries and hits and the prompt tokens it computed versus
read from the cache; the server stops. Printed side by side: TTFT p50/p90/mean, throughput,
hit rate, prefill tokens; checked: every request's generated text is the same in both runs.
Written under --out: summary.json, the client's detailed results per setting, the server
logs and ttft.png.

Each server serves exactly the benchmark's requests (the client's ready check, which would
send one more, is off by default), so its counters are theirs. Defaults are sized for about
10 minutes on 2 CPU cores with SmolLM2-135M (float16: MLX's CPU backend runs it faster than
float32 or Q4).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from bench.vllm_server import VLLM_CLI, VllmServer, metric_total
from paged_prefix.convert_smollm2 import models_root, smollm2_folder
from paged_prefix.models import write_folder

SETTINGS = {"off": "--no-enable-prefix-caching", "on": "--enable-prefix-caching"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="mlx-lm folder (default: SmolLM2-135M float16)")
    p.add_argument("--random-weights", default=None, choices=("llama-1b", "llama-8b"),
                   help="instead of --model: this built-in GPU-sized config with seeded random "
                        "bf16 weights and SmolLM2's tokenizer (greedy outputs are arbitrary but "
                        "still compared off vs on)")
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="tokenizer folder for --random-weights (default: SmolLM2's)")
    p.add_argument("--num-prefixes", type=int, default=2)
    p.add_argument("--prompts-per-prefix", type=int, default=6)
    p.add_argument("--prefix-len", type=int, default=192)
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="requests in flight at once (default: all at once); 1 makes TTFT one "
                        "request's prefill rather than the whole batch's queue")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=512 << 20)
    p.add_argument("--out", type=Path, default=Path("results/serve_bench"))
    return p.parse_args(argv)


def run_setting(setting: str, model: str, args: argparse.Namespace) -> dict:
    server_args = [SETTINGS[setting], "--max-model-len", str(args.max_model_len),
                   "--kv-cache-memory-bytes", str(args.kv_cache_memory_bytes),
                   "--seed", str(args.seed)]
    result_file = f"caching-{setting}.json"
    with VllmServer(model, server_args, args.out / f"server-{setting}.log") as server:
        print(f"[caching {setting}] server up at {server.url}", flush=True)
        num_prompts = args.num_prefixes * args.prompts_per_prefix
        client = [*VLLM_CLI, "bench", "serve", "--backend", "vllm",
                  "--base-url", server.url, "--model", server.served_name, "--tokenizer", model,
                  "--dataset-name", "prefix_repetition", "--num-prompts", str(num_prompts),
                  "--prefix-repetition-num-prefixes", str(args.num_prefixes),
                  "--prefix-repetition-prefix-len", str(args.prefix_len),
                  "--prefix-repetition-suffix-len", str(args.suffix_len),
                  "--prefix-repetition-output-len", str(args.output_len),
                  "--temperature", "0", "--ignore-eos", "--seed", str(args.seed),
                  "--percentile-metrics", "ttft,tpot,e2el", "--metric-percentiles", "50,90",
                  "--save-result", "--save-detailed", "--result-dir", str(args.out),
                  "--result-filename", result_file]
        if args.max_concurrency:
            client += ["--max-concurrency", str(args.max_concurrency)]
        with (args.out / f"client-{setting}.log").open("w") as log:
            subprocess.run(client, check=True, stdout=log, stderr=subprocess.STDOUT)
        metrics = server.metrics()
    detail = json.loads((args.out / result_file).read_text())
    queries = metric_total(metrics, "vllm:prefix_cache_queries_total")
    hits = metric_total(metrics, "vllm:prefix_cache_hits_total")
    return {
        "ttft_p50_ms": detail["p50_ttft_ms"], "ttft_p90_ms": detail["p90_ttft_ms"],
        "ttft_mean_ms": detail["mean_ttft_ms"],
        "request_throughput": detail["request_throughput"],
        "output_throughput": detail["output_throughput"],
        "total_token_throughput": detail["total_token_throughput"],
        "duration_s": detail["duration"], "completed": detail["completed"],
        "failed": detail["failed"],
        "prefix_cache_hit_rate": hits / queries if queries else 0.0,
        "prefill_tokens_computed": metric_total(metrics, "vllm:prompt_tokens_by_source_total",
                                                source="local_compute"),
        "prefill_tokens_from_cache": metric_total(metrics, "vllm:prompt_tokens_by_source_total",
                                                  source="local_cache_hit"),
        "generated_texts": detail["generated_texts"],
    }


def table(results: dict) -> str:
    rows = [("TTFT p50 (ms)", "ttft_p50_ms", "{:.0f}"), ("TTFT p90 (ms)", "ttft_p90_ms", "{:.0f}"),
            ("TTFT mean (ms)", "ttft_mean_ms", "{:.0f}"),
            ("requests/s", "request_throughput", "{:.3f}"),
            ("output tokens/s", "output_throughput", "{:.2f}"),
            ("total tokens/s", "total_token_throughput", "{:.1f}"),
            ("prefix-cache hit rate", "prefix_cache_hit_rate", "{:.1%}"),
            ("prefill tokens computed", "prefill_tokens_computed", "{:.0f}"),
            ("prefill tokens from cache", "prefill_tokens_from_cache", "{:.0f}")]
    lines = [f"{'prefix caching':<26}{'off':>12}{'on':>12}"]
    for label, key, fmt in rows:
        lines.append(f"{label:<26}{fmt.format(results['off'][key]):>12}"
                     f"{fmt.format(results['on'][key]):>12}")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ttft, tokens) = plt.subplots(1, 2, figsize=(10, 4))
    keys = ["ttft_p50_ms", "ttft_p90_ms", "ttft_mean_ms"]
    width = 0.38
    for i, setting in enumerate(("off", "on")):
        ttft.bar([k + (i - 0.5) * width for k in range(3)], [results[setting][k] / 1000 for k in keys],
                 width, label=f"caching {setting}")
    ttft.set_xticks(range(3), ["p50", "p90", "mean"])
    ttft.set_ylabel("time to first token (s)")
    ttft.legend()
    tokens.bar(["off", "on"], [results[s]["prefill_tokens_computed"] for s in ("off", "on")])
    tokens.set_ylabel("prefill tokens computed")
    fig.suptitle("vllm bench serve, prefix_repetition, paged_prefix on MLX")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.random_weights:
        tokenizer = args.tokenizer or smollm2_folder("float16")
        model = str(write_folder(args.random_weights, models_root() / (
            f"{args.random_weights}-random-bf16-{tokenizer.name}-tokenizer"), tokenizer))
    else:
        model = args.model or str(smollm2_folder("float16"))
    results = {setting: run_setting(setting, model, args) for setting in SETTINGS}
    texts = {s: results[s].pop("generated_texts") for s in SETTINGS}
    identical = texts["off"] == texts["on"]
    same = sum(a == b for a, b in zip(texts["off"], texts["on"]))
    workload = {k: getattr(args, k) for k in ("num_prefixes", "prompts_per_prefix", "prefix_len",
                                               "suffix_len", "output_len", "seed",
                                               "max_concurrency")}
    summary = {"model": model, "workload": workload, "results": results,
               "outputs_identical": identical, "requests_identical": same,
               "num_requests": len(texts["off"])}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    plot(results, args.out / "ttft.png")
    print(f"model {model}\nworkload {workload}\n{table(results)}")
    off, on = results["off"], results["on"]
    print(f"speedup: TTFT p50 {off['ttft_p50_ms'] / on['ttft_p50_ms']:.2f}x, "
          f"mean {off['ttft_mean_ms'] / on['ttft_mean_ms']:.2f}x")
    print(f"outputs identical (caching off vs on): {same} of {len(texts['off'])} requests")
    if args.random_weights and not identical:
        # the first token of each request is its TTFT's; later ones may flip on near ties
        firsts = sum(a.split()[:1] == b.split()[:1] for a, b in zip(texts["off"], texts["on"]))
        print(f"  random weights have near-tied logits, so a different rounding (a prefix read "
              f"from the cache vs recomputed, on a GPU) can flip a greedy token; first words "
              f"identical in {firsts} of {len(texts['off'])}")
    print(f"wrote {args.out}/summary.json, ttft.png")
    # random weights: the run is for timing; real weights must give identical outputs
    agree = identical or bool(args.random_weights)
    return 0 if agree and not off["failed"] and not on["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
