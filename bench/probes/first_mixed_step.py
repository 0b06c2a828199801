"""What a served burst's first mixed step compiles after the warm-up: the step of prompts beside
a decode row whose token is still pending on the device (docs/results.md, "H100: a burst's
first step").

    python -m bench.probes.first_mixed_step --warm-up runner|forwards [--model llama-1b]
                                            [--warm-up-tokens 4095]

MLX's CUDA backend compiles some kernels with NVRTC on first use and keeps them on disk
(MLX_PTX_CACHE_DIR); this probe gives MLX a fresh, empty cache directory of its own, so each run
starts as a new machine's first server does. The vLLM runner warms up (`runner`: its own
`warm_up`; `forwards`: only `warmup.warm_up`'s forwards and sampling, the warm-up before it read
a pending token), then runs as vLLM's engine does under asynchronous scheduling: one prompt's
prefill, its token left pending on the device, then that request's decode row beside four
prompts (8,192 tokens, the scheduler's budget). Per step: its time until its tokens are on the
host, and the kernel files MLX compiled during it. GPU only in effect: MLX's CPU backend
compiles nothing this way.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

BLOCK_SIZE = 16
PROMPT = 2304  # the prompts: a 2,048-token prefix and 256 more
STEP_TOKENS = 8192  # vLLM's default max_num_batched_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warm-up", choices=("runner", "forwards"), required=True)
    parser.add_argument("--model", default="llama-1b", help="a config of paged_prefix.models")
    parser.add_argument("--warm-up-tokens", type=int, default=4095,
                        help="the warm-up's prefill (a server's max_model_len - 1 on a GPU)")
    args = parser.parse_args()
    cache_dir = Path(tempfile.mkdtemp(prefix="mlx-ptx-"))
    os.environ["MLX_PTX_CACHE_DIR"] = str(cache_dir)  # read at MLX's first compile

    import mlx.core as mx
    import numpy as np
    import torch
    from vllm.config import VllmConfig

    from paged_prefix import models, warmup
    from paged_prefix.kv_groups import kv_cache_config, layer_specs
    from paged_prefix.vllm_runner import VllmModelRunner
    from tests.scheduler_outputs import cached, new, step

    def compiled() -> set[str]:
        return {str(p.relative_to(cache_dir)) for p in cache_dir.rglob("*") if p.is_file()}

    cfg = models.resolve_config(args.model)
    blocks = 4 * STEP_TOKENS // BLOCK_SIZE + 64
    runner = VllmModelRunner(models.build_model(cfg, mx.bfloat16, seed=0),
                             vllm_config=VllmConfig())
    specs = layer_specs(runner.layer_windows(), BLOCK_SIZE, cfg["num_key_value_heads"],
                        cfg["head_dim"], torch.bfloat16)
    runner.initialize_kv_cache(kv_cache_config(VllmConfig(), specs, blocks))
    tokens = min(args.warm_up_tokens, runner.warm_up_limit())
    start = time.perf_counter()
    if args.warm_up == "runner":
        runner.warm_up(tokens)
    else:
        warmup.warm_up(runner.runner, runner.sampler, tokens)
    seen = compiled()
    print(f"warm-up ({args.warm_up}, {tokens} tokens): {time.perf_counter() - start:.1f} s, "
          f"{len(seen)} kernel files compiled", flush=True)

    rng = np.random.default_rng(0)
    vocab, per_request = cfg["vocab_size"], -(-PROMPT // BLOCK_SIZE) + 1
    free = iter(range(1, blocks))

    def request(req_id: str):
        return new(req_id, rng.integers(10, vocab - 10, PROMPT).tolist(),
                   ([next(free) for _ in range(per_request)],))

    def run(label: str, so, read: bool = True):
        nonlocal seen
        start = time.perf_counter()
        assert runner.run_forward(so) is None
        out = runner.sample_tokens(None)
        if read:
            out.token_list()
        now = compiled()
        print(f"{label}: {1e3 * (time.perf_counter() - start):.1f} ms, kernel files compiled: "
              f"{sorted(now - seen) or 'none'}", flush=True)
        seen = now

    run("a prompt's prefill (its token left pending)", step({"d": PROMPT}, [request("d")]),
        read=False)
    prompts = [request(f"p{i}") for i in range(4)]
    sizes = [PROMPT] * 3 + [STEP_TOKENS - 1 - 3 * PROMPT]
    run("its decode row beside 4 prompts", step(
        {"d": 1, **{p.req_id: n for p, n in zip(prompts, sizes)}}, prompts,
        cached_reqs=cached(["d"], [None], [PROMPT])))
    print(f"forwards built while the step before ran: {runner.forwards_built_while_running}")


if __name__ == "__main__":
    main()
