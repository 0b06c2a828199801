"""Where a decode layer's host build goes, piece by piece, against mlx-lm's own layer: what
the decode host probe's `build` is made of (docs/results.md, "H200: against mlx-lm's server").

    python -m bench.probes.layer_build [--shape llama-1b:2048] [--layers 4] [--steps 60]
                                       [--calls 300] [--out results/layer_build.json]

One request decodes from vLLM's SchedulerOutputs through this tree's runner and through
mlx-lm's model over its KVCache (the decode host probe's two decoders, steps alternating,
each waited for untimed). Each piece of a layer is timed while it builds its part of the lazy
graph, nothing evaluated: the per-step sum over layers, median over steps, per layer, in us.
Pieces nest (`attention` holds the qkv linear, `kv write` and `attention call`); each timer
adds about 0.2 us. Then the attention call of the last step's last layer alone, `--calls`
times on the same inputs: the planned attention (the CUDA kernel on a GPU, the CPU route
here), MLX's SDPA over the same keys contiguous, and on a GPU the same kernel launch built
from an empty source, which tells what the kernel's ~30 KB of source text costs each call (MLX
assembles a custom kernel's whole source at every call) from what its arguments cost.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models import llama

from bench.prefill_setup import DTYPE
from bench.probes.decode_host import Decoder, MlxLm
from jit_kernels.cuda_paged_attention import CudaPagedAttention
from paged_prefix import attention, dispatch, kv_cache, linear, mlp, models

# (class, method, piece): each wrapped while the probe runs
PIECES = ((attention.PagedAttention, "__call__", "attention"),
          (linear.StackedLinear, "__call__", "stacked linears (qkv, gate+up)"),
          (kv_cache.PagedKVCache, "write", "kv write"),
          (dispatch.ForwardAttention, "__call__", "attention call"),
          (mlp.PackedMLP, "__call__", "mlp"),
          (llama.Attention, "__call__", "mlx-lm attention"),
          (llama.MLP, "__call__", "mlx-lm mlp"))


class Timers:
    """Wraps each piece's method with a timer; `last` keeps the last attention call's args."""

    def __init__(self):
        self.step: collections.Counter[str] = collections.Counter()
        self.last = None
        self._saved = []

    def __enter__(self):
        for cls, name, piece in PIECES:
            method = getattr(cls, name)
            self._saved.append((cls, name, method))
            setattr(cls, name, self._timed(method, piece))
        return self

    def __exit__(self, *exc):
        for cls, name, method in self._saved:
            setattr(cls, name, method)

    def _timed(self, method, piece):
        def timed(obj, *args, **kwargs):
            start = time.perf_counter()
            out = method(obj, *args, **kwargs)
            self.step[piece] += time.perf_counter() - start
            if piece == "attention call":
                self.last = (obj, args, kwargs)
            return out
        return timed


def built_per_call(call, calls: int) -> float:
    """Microseconds to build one call's graph (nothing evaluated), best of three rounds."""
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - start) / calls)
    return 1e6 * best


def attention_calls(last, context: int, calls: int) -> dict[str, float]:
    """The last attention call alone, against SDPA over `context` keys and an empty kernel."""
    attn, (q, k, v, k_cache, v_cache), kwargs = last
    out = {"attention call": built_per_call(lambda: attn(q, k, v, k_cache, v_cache, **kwargs),
                                            calls)}
    g_heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[2]
    keys = mx.zeros((1, kv_heads, context, dim), dtype=q.dtype)
    queries = q.reshape(1, -1, g_heads, dim).transpose(0, 2, 1, 3)
    mx.eval(keys, queries)
    out["mlx sdpa"] = built_per_call(lambda: mx.fast.scaled_dot_product_attention(
        queries, keys, keys, scale=dim ** -0.5), calls)
    cuda = next(((kernel, plan) for kernel, plan in attn.parts
                 if isinstance(kernel, CudaPagedAttention)), None)
    if cuda is not None:
        empty = CudaPagedAttention(lambda **kw: mx.fast.cuda_kernel(
            **{**kw, "name": kw["name"] + "_empty_probe", "source": "", "header": ""}))
        sinks = kwargs.get("sinks")
        for name, kernel in (("the kernel, its source", cuda[0]),
                             ("the kernel, empty source", empty)):
            out[name] = built_per_call(
                lambda k_=kernel: k_.run(q, k, v, k_cache, v_cache, cuda[1], None, sinks), calls)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-1b:2048", help="model:prompt_len")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--out", type=Path, default=Path("results/layer_build.json"))
    args = parser.parse_args()
    name, prompt_len = args.shape.split(":")
    cfg = models.resolve_config(name, num_hidden_layers=args.layers)
    dense = models.build_model(cfg, DTYPE)
    prompt = np.random.default_rng(0).integers(3, cfg["vocab_size"], int(prompt_len)).tolist()
    warm = 5
    decoders = {"this tree": Decoder("", cfg, dense, [prompt], warm + args.steps),
                "mlx-lm": MlxLm(dense, prompt)}
    gc.collect()
    gc.freeze()  # as vLLM's engine after start-up (decode_host does the same)
    steps = []
    with Timers() as timers:
        for i in range(warm + args.steps):
            timers.step.clear()
            for decoder in decoders.values() if i % 2 == 0 else list(decoders.values())[::-1]:
                result = decoder.decode_step()
                mx.synchronize()
                decoder.finish(result)
            if i >= warm:
                steps.append(dict(timers.step))
        calls = attention_calls(timers.last, len(prompt) + warm + args.steps, args.calls)
    per_layer = {piece: 1e6 * statistics.median(s.get(piece, 0.0) for s in steps) / args.layers
                 for _, _, piece in PIECES}
    result = {"shape": args.shape, "layers": args.layers, "steps": args.steps,
              "device": str(mx.default_device()), "per_layer_us": per_layer,
              "attention_call_alone_us": calls}
    for piece, us in per_layer.items():
        print(f"{piece:<32} {us:7.1f} us a layer")
    for piece, us in calls.items():
        print(f"alone: {piece:<25} {us:7.1f} us a call")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
