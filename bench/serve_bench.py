"""`vllm serve` + vLLM's own `vllm bench serve --dataset-name prefix_repetition`: caching off vs on.

For each setting the same server command runs on 127.0.0.1, differing only in
--enable-prefix-caching / --no-enable-prefix-caching; vLLM's benchmark client sends the same
seeded prompts (`--temperature 0 --ignore-eos --save-detailed`, --max-concurrency at a time);
the server's /metrics give the prefix-cache queries and hits and the prompt tokens it computed
versus read from the cache; the server stops. While the client runs, a line every few seconds
says how many requests are done, the server's queue and where the logs are
(bench/serve_progress.py). Printed side by side: TTFT p50/p90/mean, TPOT, throughput, hit
rate, prefill tokens; checked: every request's generated text is the same in both runs.
Written under --out: summary.json, the client's detailed results per setting, the server and
client logs and ttft.png (each request's TTFT, off and on). `--against mlx-lm` compares with
mlx-lm's own server instead (bench/serve_against.py).

Each server serves exactly the benchmark's requests (the client's ready check, which would
send one more, is off by default), so its counters are theirs. The default workload (4 shared
384-token prefixes, 24 requests of 448 prompt and 32 output tokens, 8 in flight) is sized for
about 3 minutes on 2 CPU cores with SmolLM2-135M in float32 on OpenBLAS (docs/cpu.md).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

from bench import multi_turn, serve_plot, ttft_breakdown
from bench.serve_progress import run_client, server_log_status
from bench.vllm_server import VLLM_CLI, VllmServer, metric_total
from paged_prefix.convert_smollm2 import models_root, smollm2_folder
from paged_prefix.models import write_folder

SETTINGS = {"off": "--no-enable-prefix-caching", "on": "--enable-prefix-caching"}
CPU_SIZED = ("qwen3-next-small",)
DEFAULT_CONCURRENCY = 8


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None,
                   help="mlx-lm folder (default: SmolLM2-135M, convert_smollm2's default variant)")
    p.add_argument("--random-weights", default=None,
                   choices=("llama-1b", "llama-8b", "gemma3-1b", "gpt-oss-20b",
                            "qwen3-next-small", "qwen3-next-2b"),
                   help="instead of --model: this built-in GPU-sized config with seeded random "
                        "weights (--dtype) and SmolLM2's tokenizer (greedy outputs are arbitrary "
                        "but still compared off vs on); gemma3-1b and gpt-oss-20b have sliding "
                        "windows, gpt-oss-20b sinks and experts (~40 GB of weights); "
                        "qwen3-next-small is a CPU-sized hybrid model (recurrent state in "
                        "vLLM's blocks: docs/hybrid.md), qwen3-next-2b a GPU-sized one")
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="tokenizer folder for --random-weights (default: SmolLM2's)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                   help="--random-weights' weight dtype (default: bfloat16 for the GPU-sized "
                        "configs, float32 for the CPU-sized one). Greedy tokens of random "
                        "weights sit close together, so bfloat16's rounding differences between "
                        "a prompt computed whole and from cached blocks can pick another token; "
                        "float32 compares off vs on token for token. The servers get it as "
                        "vLLM's --dtype: under --dtype auto a GPU platform downcasts a float32 "
                        "folder to bfloat16")
    p.add_argument("--num-prefixes", type=int, default=4)
    p.add_argument("--prompts-per-prefix", type=int, default=6)
    p.add_argument("--prefix-len", type=int, default=384)
    p.add_argument("--suffix-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-concurrency", type=int, default=None,
                   help=f"requests in flight at once (default {DEFAULT_CONCURRENCY}; 0: all at "
                        "once); 1 makes TTFT one request's prefill rather than the whole "
                        "batch's queue. Not with --against, which runs both")
    p.add_argument("--request-rate", type=float, default=None,
                   help="requests a second, arriving as a seeded Poisson process (vLLM's "
                        "client); default: all at once. Over time, a request finds the prefixes "
                        "of those before it already cached, where a burst's later requests wait "
                        "behind the first prefills of theirs. Not with --against")
    p.add_argument("--client-timeout", type=float, default=1800.0,
                   help="seconds one benchmark client may run before it is stopped")
    p.add_argument("--against", choices=("mlx-lm",), default=None,
                   help="instead of caching off vs on: paged_prefix (caching on) vs mlx-lm's "
                        "own server on the same folder, all at once, one at a time and "
                        "multi-turn (bench/serve_against.py)")
    default_turns = multi_turn.Workload()
    p.add_argument("--conversations", type=int, default=default_turns.conversations,
                   help="multi-turn (--multi-turn, --against): conversations at once")
    p.add_argument("--turns", type=int, default=default_turns.turns,
                   help="multi-turn: turns per conversation")
    p.add_argument("--system-words", type=int, default=default_turns.system_words,
                   help="multi-turn: words of the conversations' shared opening (a hybrid "
                        "model's ~1000-token block needs a context past one block to hit)")
    p.add_argument("--multi-turn", action="store_true",
                   help="after the prefix-repetition client, also bench/multi_turn.py's "
                        "conversations against each server (TTFT per turn; hits and prefill "
                        "tokens counted over them alone)")
    p.add_argument("--breakdown", action="store_true",
                   help="serve with the runner's step log (VLLM_LOGGING_LEVEL=DEBUG) and split "
                        "each setting's TTFT into its parts (bench/ttft_breakdown.py)")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=512 << 20)
    p.add_argument("--out", type=Path, default=Path("results/serve_bench"))
    args = p.parse_args(argv)
    for name in ("num_prefixes", "prompts_per_prefix", "prefix_len", "suffix_len", "output_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}: expected >= 1, got {getattr(args, name)}")
    if args.dtype and not args.random_weights:
        raise ValueError("--dtype: only with --random-weights (a --model folder keeps its own)")
    if args.dtype == "bfloat16" and args.random_weights in CPU_SIZED:
        raise ValueError(f"--dtype: {args.random_weights} runs experts on MLX's CPU backend, "
                         "which takes float32 only")
    if args.request_rate is not None and not args.request_rate > 0:
        raise ValueError(f"--request-rate: expected > 0 requests a second, got {args.request_rate}")
    if args.against and args.request_rate is not None:
        raise ValueError("--request-rate: --against runs its own workloads")
    if args.against and args.max_concurrency is not None:
        raise ValueError("--max-concurrency: --against runs all at once and one at a time")
    if not args.against and args.max_concurrency is None:
        args.max_concurrency = DEFAULT_CONCURRENCY
    if args.max_concurrency is not None and args.max_concurrency < 0:
        raise ValueError(f"--max-concurrency: expected >= 0, got {args.max_concurrency}")
    try:  # before any server starts
        multi_turn_workload(args)
    except ValueError as e:
        raise ValueError(f"--{str(e).replace('_', '-')}") from None
    return args


def multi_turn_workload(args: argparse.Namespace) -> multi_turn.Workload:
    """The conversations of --multi-turn and --against (ValueError naming a bad size)."""
    return multi_turn.Workload(conversations=args.conversations, turns=args.turns,
                               system_words=args.system_words, output_len=args.output_len,
                               seed=args.seed)


def client_command(url: str, served_name: str, tokenizer: str, args: argparse.Namespace,
                   seed: int, max_concurrency: int | None, result_file: str) -> list[str]:
    """`vllm bench serve` on the prefix_repetition workload of `args`, results under --out."""
    command = [*VLLM_CLI, "bench", "serve", "--backend", "vllm", "--base-url", url,
               "--model", served_name, "--tokenizer", tokenizer,
               "--dataset-name", "prefix_repetition", "--num-prompts", str(num_requests(args)),
               "--prefix-repetition-num-prefixes", str(args.num_prefixes),
               "--prefix-repetition-prefix-len", str(args.prefix_len),
               "--prefix-repetition-suffix-len", str(args.suffix_len),
               "--prefix-repetition-output-len", str(args.output_len),
               "--temperature", "0", "--ignore-eos", "--seed", str(seed),
               "--percentile-metrics", "ttft,tpot,e2el", "--metric-percentiles", "50,90",
               "--save-result", "--save-detailed", "--result-dir", str(args.out),
               "--result-filename", result_file]
    if args.request_rate:
        command += ["--request-rate", str(args.request_rate)]
    return command + (["--max-concurrency", str(max_concurrency)] if max_concurrency else [])


def num_requests(args: argparse.Namespace) -> int:
    return args.num_prefixes * args.prompts_per_prefix


def client_metrics(detail: dict) -> dict:
    """What the tables and plots read from the client's detailed result."""
    return {"ttft_p50_ms": detail["p50_ttft_ms"], "ttft_p90_ms": detail["p90_ttft_ms"],
            "ttft_mean_ms": detail["mean_ttft_ms"], "tpot_p50_ms": detail["p50_tpot_ms"],
            "tpot_mean_ms": detail["mean_tpot_ms"],
            "request_throughput": detail["request_throughput"],
            "output_throughput": detail["output_throughput"],
            "total_token_throughput": detail["total_token_throughput"],
            "duration_s": detail["duration"], "completed": detail["completed"],
            "failed": detail["failed"], "ttfts_s": detail["ttfts"],
            "generated_texts": detail["generated_texts"]}


def blas_line(server_log: Path) -> str:
    """Which BLAS the server's MLX matmuls run on, as it logged it (vLLM's worker, or mlx-lm's
    launcher in bench/mlx_lm_server.py); neither logs one where MLX runs on a GPU."""
    lines = [line for line in server_log.read_text(errors="replace").splitlines()
             if "MLX's CPU matmuls run on" in line]
    return lines[0].split("paged_prefix worker: ")[-1] if lines else "(not logged: not the CPU)"


def block_size(server_log: Path) -> int | None:
    """The KV block size the platform chose, as its start-up line logged it."""
    match = re.search(r"paged_prefix platform: worker \S+, block size (\d+)",
                      server_log.read_text(errors="replace"))
    return int(match.group(1)) if match else None


def no_hit_reason(hit_rate: float, block: int | None, prefix_len: int) -> str | None:
    """Why caching on found nothing, where the workload is the cause: vLLM hashes whole
    blocks only, so a shared prefix shorter than one block never hits (a hybrid model's block
    holds a state page and runs to ~1000 tokens)."""
    if hit_rate > 0 or block is None or prefix_len >= block:
        return None
    return (f"no prefix hits: vLLM caches whole blocks, and this server's block is {block} "
            f"tokens, more than the {prefix_len}-token shared prefix (--prefix-len {block} or "
            f"more hits)")


def run_setting(setting: str, model: str, args: argparse.Namespace) -> dict:
    server_args = [SETTINGS[setting], *server_options(args)]
    result_file = f"caching-{setting}.json"
    label = f"caching {setting}"
    server_log = args.out / f"server-{setting}.log"
    print(f"[{label}] starting vllm serve; log {server_log}", flush=True)
    env = {"VLLM_LOGGING_LEVEL": "DEBUG"} if args.breakdown else None
    with VllmServer(model, server_args, server_log, env=env) as server:
        print(f"[{label}] server up at {server.url}; {blas_line(server_log)}", flush=True)
        client = client_command(server.url, server.served_name, model, args, args.seed,
                                args.max_concurrency, result_file)
        run_client(client, args.out / f"client-{setting}.log", label, num_requests(args),
                   args.client_timeout, server_log_status(server_log))
        metrics = server.metrics()
        turns = None
        if args.multi_turn:
            print(f"[{label}] multi-turn conversations", flush=True)
            turns = multi_turn.run(server.url, server.served_name, multi_turn_workload(args))
            turns.update(cache_counts(server.metrics(), metrics))
    detail = json.loads((args.out / result_file).read_text())
    result = client_metrics(detail)
    if args.breakdown:
        result["ttft_breakdown"] = ttft_breakdown.breakdown(
            server_log.read_text(errors="replace"), detail)
    return {**result, **cache_counts(metrics), **({"multi_turn": turns} if turns else {})}


def cache_counts(metrics: str, before: str | None = None) -> dict:
    """The server's prefix-cache hit rate and prompt tokens computed and read from the cache,
    since `before` (another /metrics reading) when given."""
    def total(name: str, **labels) -> float:
        since = metric_total(before, name, **labels) if before is not None else 0.0
        return metric_total(metrics, name, **labels) - since

    queries, hits = total("vllm:prefix_cache_queries_total"), total("vllm:prefix_cache_hits_total")
    return {"prefix_cache_hit_rate": hits / queries if queries else 0.0,
            "prefill_tokens_computed": total("vllm:prompt_tokens_by_source_total",
                                             source="local_compute"),
            "prefill_tokens_from_cache": total("vllm:prompt_tokens_by_source_total",
                                               source="local_cache_hit")}


def table(results: dict, columns: tuple[str, ...] = ("off", "on"),
          header: str = "prefix caching") -> str:
    rows = [("TTFT p50 (ms)", "ttft_p50_ms", "{:.0f}"), ("TTFT p90 (ms)", "ttft_p90_ms", "{:.0f}"),
            ("TTFT mean (ms)", "ttft_mean_ms", "{:.0f}"), ("TPOT p50 (ms)", "tpot_p50_ms", "{:.1f}"),
            ("requests/s", "request_throughput", "{:.3f}"),
            ("output tokens/s", "output_throughput", "{:.2f}"),
            ("total tokens/s", "total_token_throughput", "{:.1f}"),
            ("prefix-cache hit rate", "prefix_cache_hit_rate", "{:.1%}"),
            ("prefill tokens computed", "prefill_tokens_computed", "{:.0f}"),
            ("prefill tokens from cache", "prefill_tokens_from_cache", "{:.0f}"),
            ("benchmark duration (s)", "duration_s", "{:.1f}")]
    width = max(12, *(len(c) + 2 for c in columns))
    lines = [f"{header:<26}" + "".join(f"{c:>{width}}" for c in columns)]
    for label, key, fmt in rows:
        if all(key in results[c] for c in columns):
            lines.append(f"{label:<26}" + "".join(f"{fmt.format(results[c][key]):>{width}}"
                                                  for c in columns))
    return "\n".join(lines)


def multi_turn_table(off: dict, on: dict) -> str:
    """TTFT per turn (median of the conversations), hit rate and prefill tokens, off vs on."""
    lines = [f"{'multi-turn':<26}{'off':>12}{'on':>12}"]
    for t, (a, b) in enumerate(zip(off["ttft_p50_ms_per_turn"], on["ttft_p50_ms_per_turn"])):
        lines.append(f"{f'TTFT turn {t + 1} p50 (ms)':<26}{a:>12.0f}{b:>12.0f}")
    for label, key, fmt in (("prefix-cache hit rate", "prefix_cache_hit_rate", "{:.1%}"),
                            ("prefill tokens computed", "prefill_tokens_computed", "{:.0f}"),
                            ("prefill tokens from cache", "prefill_tokens_from_cache", "{:.0f}")):
        lines.append(f"{label:<26}{fmt.format(off[key]):>12}{fmt.format(on[key]):>12}")
    return "\n".join(lines)


def workload_text(args: argparse.Namespace) -> str:
    text = (f"{args.num_prefixes} prefixes x {args.prompts_per_prefix} prompts, "
            f"{args.prefix_len}+{args.suffix_len} prompt tokens, {args.output_len} out")
    if args.max_concurrency is None:  # --against: its workloads say
        return text
    if args.request_rate:
        text += f", {args.request_rate:g} requests/s (Poisson)"
    return text + f", max concurrency {args.max_concurrency or 'all'}"


def weight_dtype(args: argparse.Namespace) -> str | None:
    """--random-weights' dtype name; None for a --model folder (its own)."""
    if not args.random_weights:
        return None
    # the CPU-sized model in float32: MLX's CPU backend runs experts (gather_mm) in float32 only
    return args.dtype or ("float32" if args.random_weights in CPU_SIZED else "bfloat16")


def server_options(args: argparse.Namespace) -> list[str]:
    """`vllm serve` options both settings (and --against's server) share; random weights are
    served in the dtype they were written in."""
    dtype = weight_dtype(args)
    return ["--max-model-len", str(args.max_model_len),
            "--kv-cache-memory-bytes", str(args.kv_cache_memory_bytes), "--seed", str(args.seed),
            *(["--dtype", dtype] if dtype else [])]


def resolve_model(args: argparse.Namespace) -> str:
    if not args.random_weights:
        return args.model or str(smollm2_folder())
    import mlx.core as mx  # after paged_prefix (cpu_blas binds MLX's BLAS at its import)

    tokenizer = args.tokenizer or smollm2_folder()
    dtype = weight_dtype(args)
    short = dtype.replace("bfloat", "bf").replace("float", "f")
    return str(write_folder(args.random_weights, models_root() / (
        f"{args.random_weights}-random-{short}-{tokenizer.name}-tokenizer"), tokenizer,
        getattr(mx, dtype)))


def main(argv=None) -> int:
    args = parse_args(argv)
    serve_plot.require()
    args.out.mkdir(parents=True, exist_ok=True)
    model = resolve_model(args)
    start = time.monotonic()
    if args.against:
        from bench.serve_against import compare

        return compare(model, args)
    results = {setting: run_setting(setting, model, args) for setting in SETTINGS}
    texts = {s: results[s].pop("generated_texts") for s in SETTINGS}
    if args.multi_turn:  # conversations' answers too: every turn of every one
        for s in SETTINGS:
            texts[s] = texts[s] + [t for c in results[s]["multi_turn"].pop("texts") for t in c]
    identical = texts["off"] == texts["on"]
    same = sum(a == b for a, b in zip(texts["off"], texts["on"]))
    workload = {k: getattr(args, k) for k in ("num_prefixes", "prompts_per_prefix", "prefix_len",
                                               "suffix_len", "output_len", "seed",
                                               "max_concurrency", "request_rate")}
    summary = {"model": model, "workload": workload, "results": results,
               "outputs_identical": identical, "requests_identical": same,
               "num_requests": len(texts["off"])}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    title = (f"{Path(model).name}: vllm bench serve prefix_repetition, {workload_text(args)}\n"
             f"TTFT per request; prefix-cache hit rate with caching on "
             f"{results['on']['prefix_cache_hit_rate']:.1%}")
    serve_plot.per_request({f"caching {s}": results[s]["ttfts_s"] for s in SETTINGS}, title,
                           args.out / "ttft.png")
    print(f"model {model}\nworkload {workload_text(args)}, seed {args.seed}\n{table(results)}")
    off, on = results["off"], results["on"]
    print(f"speedup: TTFT p50 {off['ttft_p50_ms'] / on['ttft_p50_ms']:.2f}x, "
          f"mean {off['ttft_mean_ms'] / on['ttft_mean_ms']:.2f}x")
    if args.multi_turn:
        print(multi_turn_table(off["multi_turn"], on["multi_turn"]))
    if args.breakdown:
        print(ttft_breakdown.table({f"caching {s}": results[s]["ttft_breakdown"]
                                    for s in SETTINGS}))
    reason = no_hit_reason(on["prefix_cache_hit_rate"], block_size(args.out / "server-on.log"),
                           args.prefix_len)
    if reason:
        print(reason)
    print(f"outputs identical (caching off vs on): {same} of {len(texts['off'])} requests")
    if args.random_weights and not identical:
        # the first token of each request is its TTFT's; later ones may flip on near ties
        firsts = sum(a.split()[:1] == b.split()[:1] for a, b in zip(texts["off"], texts["on"]))
        print(f"  random weights have near-tied logits (and experts), so a different rounding "
              f"(a prefix read from the cache vs recomputed, rows batched otherwise, on a GPU) "
              f"can flip a greedy token; first words identical in {firsts} of "
              f"{len(texts['off'])}")
    print(f"wrote {args.out}/summary.json, ttft.png; total {time.monotonic() - start:.0f} s")
    # random weights: the run is for timing; real weights must give identical outputs
    agree = identical or bool(args.random_weights)
    return 0 if agree and not off["failed"] and not on["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
