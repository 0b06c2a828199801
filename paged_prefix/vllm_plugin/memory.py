"""The KV-cache budget, measured: vLLM's `--gpu-memory-utilization` semantics on MLX memory.

    budget = utilization x device memory - (weights + activation peak + rest of the process)

- device memory: MLX's device info (CUDA `total_memory`, Metal `memory_size`, the unified
  RAM). MLX's CPU backend reports none: host RAM then, as vLLM's own CPU backend uses.
- weights: MLX's active memory once the model is loaded.
- activation peak: MLX's peak memory during one profile forward into a temporary cache,
  less what the forward leaves held (the weights, the runner's stacks of some, that cache).
  On the CPU backend a forward of `max_num_batched_tokens` tokens would take minutes, so it
  runs `PROFILE_TOKENS_CPU` tokens and scales the measured peak linearly (activations grow
  with the tokens of a forward); the log says so.
- rest of the process: where the device memory is host RAM (CPU, Metal), what the process
  holds besides MLX (Python, torch, vLLM), from its resident set size.

`--kv-cache-memory-bytes` replaces all of this, as in vLLM. The scheduler's own check then
refuses a budget that cannot hold one sequence of `max_model_len` tokens.

The activation peak also bounds MLX's buffer cache (`bound_buffer_cache`), whichever way the
KV cache was sized.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import mlx.core as mx
import mlx.nn as nn
import psutil

from ..dispatch import Dispatcher
from ..hybrid_config import fresh_states, profile_state_cache
from ..kv_cache import PagedKVCache, heads_major_here
from ..metadata import ScheduledRequest, build_batch_metadata
from ..runner import PagedModelRunner

PROFILE_TOKENS_CPU = 64
MiB = 1 << 20


@dataclass(frozen=True)
class DeviceMemory:
    total: int
    unified: bool  # the device memory is the host's RAM (CPU backend, Apple silicon)
    source: str


def device_memory() -> DeviceMemory:
    info = mx.device_info()
    if "total_memory" in info:
        return DeviceMemory(int(info["total_memory"]), False, "MLX CUDA device memory")
    if "memory_size" in info:
        return DeviceMemory(int(info["memory_size"]), True, "MLX Metal unified memory")
    return DeviceMemory(psutil.virtual_memory().total, True, "host RAM (MLX CPU backend)")


def profile_tokens(max_num_batched_tokens: int) -> int:
    on_gpu = mx.default_device() == mx.gpu
    return max_num_batched_tokens if on_gpu else min(max_num_batched_tokens, PROFILE_TOKENS_CPU)


def activation_peak(model: nn.Module, dispatcher: Dispatcher, num_tokens: int, block_size: int,
                    num_kv_heads: int, head_dim: int, dtype: mx.Dtype) -> int:
    """MLX's peak bytes during one forward of `num_tokens` above what it leaves held."""
    num_blocks = -(-num_tokens // block_size)
    # a hybrid model's recurrent layers: their states in a cache of their own
    states, conv_kernel, num_attention = profile_state_cache(model)
    cache = PagedKVCache(num_attention, num_blocks, block_size, num_kv_heads, head_dim, dtype,
                         heads_major=heads_major_here())
    runner = PagedModelRunner(model, cache, dispatcher, state_cache=states)
    vocab = runner.vocab_size
    request = ScheduledRequest("profile", [i % vocab for i in range(num_tokens)], num_tokens, 0,
                               num_tokens, list(range(num_blocks)))
    meta = build_batch_metadata([request], block_size, num_blocks, vocab_size=vocab)
    if states is not None:
        meta = replace(meta, states=fresh_states(states.num_groups, conv_kernel, num_tokens))
    mx.reset_peak_memory()
    mx.eval(runner.forward(meta), runner.cache_arrays())
    mx.synchronize()  # MLX frees the forward's buffers once the device is done with them
    # above what the forward leaves held: with it the runner's own stacks of the q/k/v and
    # gate/up weights, made in this first forward (the caller's model holds the originals)
    peak = mx.get_peak_memory() - mx.get_active_memory()
    del runner, cache, states
    mx.clear_cache()
    return max(peak, 0)


def bound_buffer_cache(activations: int) -> int:
    """Let MLX keep at most `activations` bytes of freed buffers for reuse; returns the limit.

    MLX hands a cached buffer only to a request of nearly its size (within two pages), and on
    CUDA it lets the cache grow to 95% of the device. A server's steps differ in tokens almost
    every time, so most freed activations are never reused: over long prompts on the H200 the
    cache grew until steps slowed to seconds and cudaMallocAsync failed (docs/results.md, "H200:
    long prompts"). One forward's activations are what a step of the same size reuses."""
    limit = max(int(activations), 0)
    mx.set_cache_limit(limit)
    return limit


@dataclass(frozen=True)
class Budget:
    device: DeviceMemory
    utilization: float
    weights: int
    activations: int
    rest_of_process: int

    @property
    def kv_cache_bytes(self) -> int:
        used = self.weights + self.activations + self.rest_of_process
        return int(self.device.total * self.utilization) - used

    def describe(self) -> str:
        return (f"{self.utilization:g} x {self.device.total / MiB:.0f} MiB ({self.device.source}) "
                f"- weights {self.weights / MiB:.0f} MiB - activations "
                f"{self.activations / MiB:.0f} MiB - rest of process "
                f"{self.rest_of_process / MiB:.0f} MiB = {self.kv_cache_bytes / MiB:.0f} MiB")


def measure_budget(utilization: float, weights: int, activations: int) -> Budget:
    device = device_memory()
    rest = 0
    if device.unified:
        mlx_held = mx.get_active_memory() + mx.get_cache_memory()
        rest = max(psutil.Process().memory_info().rss - mlx_held, 0)
    budget = Budget(device, utilization, weights, activations, rest)
    if budget.kv_cache_bytes <= 0:
        raise ValueError(f"gpu_memory_utilization: no memory is left for the KV cache: "
                         f"{budget.describe()}. Raise --gpu-memory-utilization or set "
                         "--kv-cache-memory-bytes.")
    return budget
