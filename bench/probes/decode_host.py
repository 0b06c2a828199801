"""A decode step's host time, this tree against another revision's, in one process: what a
step costs the host when the device keeps up (docs/results.md, "Decode host time").

    python -m bench.probes.decode_host --rev a6455da [--shape llama-1b:2048] [--layers N]
                                       [--requests 1] [--rounds 60] [--out results/decode_host.json]

Run from a git checkout; the other revision is imported beside this tree as `tree_ab` does.
Each tree decodes `--requests` requests together over its own cache, step by step, from
vLLM's SchedulerOutputs (tests/scheduler_outputs.py builds them as vLLM's scheduler does, a
block at a time): per step `plan` is `requests.plan_step` (the request states and the
forward's metadata), `build` the runner's forward (the dispatcher's plan and the lazy graph),
`launch` MLX's `async_eval` of the argmax and the cache writes; then the step is waited for,
untimed, so the three are host time alone. The heap built before the rounds is frozen, as
vLLM's engine freezes its own after start-up. With one request, mlx-lm's own step over its
KVCache (`build`: the model call, `launch`) runs in the same rounds; the order alternates.
Per tree: medians over the rounds, and the paired median of this tree's host time over the
other's.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from bench.prefill_setup import BLOCK_SIZE, DTYPE
from bench.probes.tree_ab import PREFIX, import_revision
from tests.scheduler_outputs import cached, new, step


class Decoder:
    """One tree's runner decoding requests together, their states kept as the vLLM runner keeps
    them; blocks come from one pool in the order vLLM's scheduler asks for them."""

    def __init__(self, prefix: str, cfg: dict, dense, prompts: list[list[int]], steps: int):
        def module(name):
            return importlib.import_module(f"{prefix}paged_prefix.{name}")
        self.requests = module("requests")
        blocks = sum(-(-(len(p) + steps + 1) // BLOCK_SIZE) for p in prompts) + 1
        paged = module("models").build_model(cfg, DTYPE, evaluate=False)
        paged.update(dense.parameters())  # the same arrays, not a copy
        cache = module("kv_cache")
        kv = cache.PagedKVCache(cfg["num_hidden_layers"], blocks, BLOCK_SIZE,
                                cfg["num_key_value_heads"], cfg["head_dim"], DTYPE,
                                heads_major=cache.heads_major_here())  # as the worker lays it out
        self.runner = module("runner").PagedModelRunner(paged, kv, module("dispatch").Dispatcher())
        self.limits = self.requests.Limits(cfg["vocab_size"], BLOCK_SIZE, blocks, len(prompts))
        self.free, self.held, self.live, admitted = 1, {}, {}, []
        for i, prompt in enumerate(prompts):
            n = self.held[f"r{i}"] = -(-len(prompt) // BLOCK_SIZE)
            admitted.append(new(f"r{i}", prompt, (list(range(self.free, self.free + n)),)))
            self.free += n
        self.finish(self.step(step({r.req_id: len(r.prompt_token_ids) for r in admitted},
                                   admitted)))

    def decode_step(self):
        ids = list(self.live)
        computed = [self.live[r].num_computed for r in ids]
        blocks = []
        for r, c in zip(ids, computed):
            grows = c + 1 > self.held[r] * BLOCK_SIZE
            blocks.append(([self.free],) if grows else None)
            self.free += grows
            self.held[r] += grows
        return self.step(step(dict.fromkeys(ids, 1), cached_reqs=cached(ids, blocks, computed)))

    def step(self, so) -> tuple[dict, object]:
        t0 = time.perf_counter()
        plan = self.requests.plan_step(self.live, so, self.limits)
        t1 = time.perf_counter()
        tokens = mx.argmax(self.runner.forward(plan.meta), axis=-1)
        t2 = time.perf_counter()
        mx.async_eval(tokens, self.runner.cache_arrays())
        t3 = time.perf_counter()
        return {"plan": t1 - t0, "build": t2 - t1, "launch": t3 - t2}, (plan, tokens)

    def finish(self, result) -> None:
        plan, tokens = result[1]
        self.live = self.requests.with_sampled(plan.requests, dict(zip(plan.meta.sample_req_ids,
                                                                       tokens.tolist())))


class MlxLm:
    """mlx-lm's own decode step over its prompt cache."""

    def __init__(self, dense, prompt: list[int]):
        self.model, self.cache = dense, make_prompt_cache(dense)
        logits = dense(mx.array([prompt]), cache=self.cache)
        self.token = mx.argmax(logits[:, -1], axis=-1)
        mx.eval(self.token, [c.state for c in self.cache])

    def decode_step(self):
        t0 = time.perf_counter()
        tokens = mx.argmax(self.model(self.token[None], cache=self.cache)[:, -1], axis=-1)
        t1 = time.perf_counter()
        mx.async_eval(tokens)
        t2 = time.perf_counter()
        return {"build": t1 - t0, "launch": t2 - t1}, tokens

    def finish(self, result) -> None:
        self.token = result[1]
        mx.eval(self.token)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rev", required=True, help="the other revision (git)")
    parser.add_argument("--shape", default="llama-1b:2048", help="model:prompt_len")
    parser.add_argument("--layers", type=int, default=None,
                        help="the config's layer count instead of its own (host time per layer "
                             "at a size the CPU decodes quickly)")
    parser.add_argument("--requests", type=int, default=1,
                        help="requests decoding together (mlx-lm's own step only with one)")
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--out", type=Path, default=Path("results/decode_host.json"))
    args = parser.parse_args()
    name, prompt_len = args.shape.split(":")
    with tempfile.TemporaryDirectory() as tmp:
        sha = import_revision(args.rev, Path(tmp))
        models = importlib.import_module("paged_prefix.models")
        cfg = models.resolve_config(name, **({} if args.layers is None else
                                             {"num_hidden_layers": args.layers}))
        dense = models.build_model(cfg, DTYPE)
        rng = np.random.default_rng(0)
        prompts = [rng.integers(3, cfg["vocab_size"], int(prompt_len)).tolist()
                   for _ in range(args.requests)]
        warm = 5
        decoders = {**({"mlx-lm": MlxLm(dense, prompts[0])} if args.requests == 1 else {}),
                    **{k: Decoder(prefix, cfg, dense, prompts, warm + args.rounds)
                       for k, prefix in (("other", PREFIX), ("this", ""))}}
        # what vLLM's engine does once it has started (`freeze_gc_heap`): the collector then
        # walks only what a step allocates (unfrozen, the probe's setup made a 16-layer step's
        # collections cost more than its build: docs/results.md, "Decode host time (CPU)")
        gc.collect()
        gc.freeze()
        times = {k: [] for k in decoders}
        for i in range(warm + args.rounds):
            for k in list(decoders) if i % 2 == 0 else list(decoders)[::-1]:
                result = decoders[k].decode_step()
                mx.synchronize()
                decoders[k].finish(result)
                if i >= warm:
                    times[k].append(result[0])
    ms = {k: {part: 1e3 * statistics.median(t[part] for t in rows) for part in rows[0]}
          for k, rows in times.items()}
    host = {k: [sum(t.values()) for t in rows] for k, rows in times.items()}
    out = {"other": sha, "shape": args.shape, "layers": cfg["num_hidden_layers"],
           "requests": args.requests,
           "dtype": str(DTYPE), "rounds": args.rounds,
           "device": str(mx.default_device()), "median_ms": ms,
           "host_ms": {k: 1e3 * statistics.median(v) for k, v in host.items()},
           "this_over_other_paired": statistics.median(
               b / a for a, b in zip(host["other"], host["this"]))}
    for k, parts in ms.items():
        print(f"{k:<7} host {out['host_ms'][k]:7.3f} ms: " +
              ", ".join(f"{p} {v:.3f}" for p, v in parts.items()))
    print(f"this / other (paired): {out['this_over_other_paired']:.3f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
