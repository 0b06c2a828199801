"""The vLLM worker: loads an mlx-lm model and drives `VllmModelRunner` (MLX) for vLLM's engine.

Engine-core call order (vLLM 0.32, uni-process executor, one worker in the engine process):
  init_device -> load_model -> get_kv_cache_spec -> get_supported_kv_cache_layouts
  -> determine_available_memory -> initialize_from_config -> compile_or_warm_up_model
  -> [execute_model (None) -> sample_tokens]* -> shutdown
`execute_model` builds and launches the forward and returns None, `sample_tokens` samples and
returns the step's output (an AsyncModelRunnerOutput when the rows sample on the device, whose
tokens the engine takes later: `vllm_runner.py`): the contract vLLM's engine uses with
synchronous and asynchronous scheduling alike. The same class serves under vllm-metal's
platform through `--worker-cls`.
"""

from __future__ import annotations

import functools
import logging
import time

import mlx.core as mx
import torch
from vllm.config import VllmConfig
from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype, set_random_seed
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheSpec
from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput
from vllm.v1.worker.worker_base import CompilationTimes, WorkerBase

from .. import cpu_blas, hybrid_config, precision
from ..architectures import architecture
from ..dispatch import Dispatcher
from ..hybrid_groups import kernel_block_size
from ..kv_groups import LAYOUT, layer_specs
from ..model_loader import load_model
from ..vllm_runner import TORCH_TO_MLX, VllmModelRunner
from . import mirror_vllm_logging
from .memory import MiB, activation_peak, bound_buffer_cache, measure_budget, profile_tokens

logger = logging.getLogger(__name__)

# The warm-up prefill's length on the CPU. On a GPU it is the step's token budget instead: MLX
# and the paged kernels compile variants on first use, and a long prefill takes some that a
# short one does not (on the H200, after a 16-token warm-up, the first requests of a served
# 1.1B model waited ~2.5 s; the larger warm-up is meant to take that, and was not re-measured).
WARMUP_TOKENS = 16


def _honour_torch_accelerator_noop() -> None:
    """Make torch.accelerator's cache calls the no-ops torch documents where no
    accelerator exists: CPU builds of torch 2.13 raise from them instead, and vLLM calls
    them while shutting its engine down on every platform it does not know as CPU."""
    if not torch.accelerator.is_available():
        torch.accelerator.empty_cache = lambda: None
        torch.accelerator.empty_host_cache = lambda: None


class MLXWorker(WorkerBase):
    def __init__(self, vllm_config: VllmConfig, local_rank: int, rank: int,
                 distributed_init_method: str, is_driver_worker: bool = False, **kwargs):
        super().__init__(vllm_config=vllm_config, local_rank=local_rank, rank=rank,
                         distributed_init_method=distributed_init_method,
                         is_driver_worker=is_driver_worker)
        self.runner: VllmModelRunner | None = None
        self._weights_bytes = 0
        mirror_vllm_logging()

    # -- device and model -----------------------------------------------------------------
    def init_device(self) -> None:
        self.device = torch.device("cpu")  # vLLM's host tensors; the model is MLX's
        _honour_torch_accelerator_noop()
        # vLLM's control plane expects a (one-rank, gloo) process group.
        init_distributed_environment(self.parallel_config.world_size, self.rank,
                                     self.distributed_init_method, self.local_rank,
                                     backend="gloo")
        ensure_model_parallel_initialized(1, 1)
        set_random_seed(self.model_config.seed)
        logger.info("paged_prefix worker: MLX device %s, %s", mx.default_device(),
                    precision.status_line())
        if mx.default_device() == mx.cpu:
            as_asked = cpu_blas.require().active or cpu_blas.setting() == "bundled"
            logger.log(logging.INFO if as_asked else logging.WARNING, "paged_prefix worker: %s",
                       cpu_blas.status_line())

    def load_model(self, *, load_dummy_weights: bool = False) -> None:
        if load_dummy_weights:
            raise ValueError("load_dummy_weights: this worker loads mlx-lm folders only")
        model = load_model(self.model_config.model, TORCH_TO_MLX[self.model_config.dtype])
        self._weights_bytes = mx.get_active_memory()
        self.runner = VllmModelRunner(model, Dispatcher(), self.vllm_config)
        windows = [w for w in self.runner.layer_windows() if w is not None]
        if self.model_config.disable_sliding_window and windows and \
                self.model_config.max_model_len > min(windows):
            # vLLM caps max_model_len at the window for it, where windowed attention is full
            raise ValueError(f"disable_sliding_window: the runner attends within the model's "
                             f"sliding windows ({min(windows)} tokens), shorter than max_model_len "
                             f"{self.model_config.max_model_len}")
        logger.info("paged_prefix worker: weights hold %.0f MiB", self._weights_bytes / MiB)

    def get_model(self):
        return self.runner.model if self.runner else None

    def update_max_model_len(self, max_model_len: int) -> None:
        self.model_config.max_model_len = max_model_len

    # -- KV cache ---------------------------------------------------------------------------
    def _spec(self) -> FullAttentionSpec:
        return FullAttentionSpec(
            block_size=self.cache_config.block_size,
            num_kv_heads=self.model_config.get_num_kv_heads(self.parallel_config),
            head_size=self.model_config.get_head_size(),
            dtype=kv_cache_dtype_str_to_dtype(self.cache_config.cache_dtype, self.model_config))

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        """Each layer's spec: full attention, or its sliding window (`kv_groups.py`); a hybrid
        model's attention and state layers (`_hybrid_specs`)."""
        hybrid_specs = self._hybrid_specs()
        if hybrid_specs is not None:
            return hybrid_specs
        page = self._spec()
        return layer_specs(self.runner.layer_windows(), page.block_size, page.num_kv_heads,
                           page.head_size, page.dtype)

    def _hybrid_specs(self) -> dict[str, KVCacheSpec] | None:
        """A hybrid model's layers: attention pages, and a MambaSpec per recurrent layer in the
        block sizes the platform set (`hybrid_config.align_cache`); None for other models."""
        model = self.runner.model
        arch = architecture(model.args.model_type)
        recurrent = arch.recurrent(model)
        if not any(recurrent):
            return None
        first = next(r for r in recurrent if r is not None)
        cache = self.cache_config
        return hybrid_config.layer_specs(
            arch.attention(model), recurrent, self._spec(),
            hybrid_config.state_dtypes(first, self.model_config.dtype, cache), cache.mamba_block_size,
            cache.mamba_page_size_padded, cache.mamba_cache_mode)

    def get_supported_kv_cache_layouts(self) -> list[str]:
        return [LAYOUT]

    def get_cache_block_size_bytes(self) -> int:
        return self._spec().page_size_bytes * len(self.runner.model.layers)

    def determine_available_memory(self) -> int:
        """Bytes for the KV cache: --kv-cache-memory-bytes, else a measured budget; for a
        hybrid model scaled to the bytes its block count may be sized from
        (`hybrid_config.budget_scale`)."""
        budget = self._budget()
        specs = self._hybrid_specs()
        if specs is None:
            return budget
        scale, why = hybrid_config.budget_scale(self.vllm_config, specs)
        logger.info("paged_prefix worker: hybrid model, %s: vLLM sizes its pool from %.0f of "
                    "the %.0f MiB", why, budget * scale / MiB, budget / MiB)
        return int(budget * scale)

    def _budget(self) -> int:
        activations = self._activation_bytes
        if self.cache_config.kv_cache_memory_bytes:
            logger.info("paged_prefix worker: KV cache budget %.0f MiB (--kv-cache-memory-bytes)",
                        self.cache_config.kv_cache_memory_bytes / MiB)
            return int(self.cache_config.kv_cache_memory_bytes)
        budget = measure_budget(self.cache_config.gpu_memory_utilization, self._weights_bytes,
                                activations)
        logger.info("paged_prefix worker: KV cache budget %s", budget.describe())
        return budget.kv_cache_bytes

    @functools.cached_property
    def _activation_bytes(self) -> int:
        """MLX's peak over one forward of `max_num_batched_tokens` (`memory.activation_peak`),
        measured once: it sizes the KV budget and bounds MLX's buffer cache."""
        spec = self._spec()
        full = self.scheduler_config.max_num_batched_tokens
        tokens = profile_tokens(full)
        # a hybrid model's attention runs in kernel blocks inside vLLM's (hybrid_groups.py)
        block = spec.block_size if self._hybrid_specs() is None else \
            kernel_block_size(spec.block_size)
        peak = activation_peak(self.runner.model, self.runner.dispatcher or Dispatcher(), tokens,
                               block, spec.num_kv_heads, spec.head_size, TORCH_TO_MLX[spec.dtype])
        if tokens != full:
            logger.info("paged_prefix worker: activation peak measured over %d tokens (%.1f MiB), "
                        "scaled to max_num_batched_tokens=%d", tokens, peak / MiB, full)
        return peak * full // tokens

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self.cache_config.num_gpu_blocks = num_gpu_blocks
        self.cache_config.num_cpu_blocks = num_cpu_blocks

    def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None:
        self.runner.initialize_kv_cache(kv_cache_config)
        cache = self.runner.runner.kv_cache
        logger.info("paged_prefix worker: KV cache %d blocks x %d tokens (%s), %.0f MiB",
                    cache.num_blocks, cache.block_size, cache.dtype, cache.nbytes / MiB)
        limit = bound_buffer_cache(self._activation_bytes)
        logger.info("paged_prefix worker: MLX keeps at most %.0f MiB of freed buffers for reuse "
                    "(one forward's activation peak)", limit / MiB)

    def compile_or_warm_up_model(self) -> CompilationTimes:
        start = time.perf_counter()
        num_tokens = WARMUP_TOKENS
        if mx.default_device() == mx.gpu:
            budget = self.vllm_config.scheduler_config.max_num_batched_tokens
            num_tokens = max(WARMUP_TOKENS, min(budget, self.model_config.max_model_len - 1,
                                                self.runner.warm_up_limit()))
        self.runner.warm_up(num_tokens)
        elapsed = time.perf_counter() - start
        logger.info("paged_prefix worker: warm-up forward and sampling in %.1f s", elapsed)
        set_random_seed(self.model_config.seed)  # as vLLM's workers: warm-up draws nothing seen
        return CompilationTimes(language_model=elapsed, encoder=0.0)

    # -- steps ------------------------------------------------------------------------------
    def execute_model(self, scheduler_output) -> ModelRunnerOutput | None:
        return self.runner.run_forward(scheduler_output)

    def sample_tokens(self, grammar_output) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        return self.runner.sample_tokens(grammar_output)

    def take_draft_token_ids(self):
        return None

    def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    def synchronize_device(self) -> None:
        if self.runner is not None:  # its steps' stream too, once a step in flight is sent
            self.runner.launcher.synchronize()
        mx.synchronize()

    def reset_encoder_cache(self) -> None:
        """Nothing to drop: no encoder runs here (multimodal models are refused). vLLM asks
        whenever it clears its caches: `sleep`, a pause that clears them, weight updates."""

    def sleep(self, level: int = 1) -> None:
        """vLLM has paused scheduling (and, from level 1, dropped its prefix cache) before it
        asks: `wake_up()` resumes it."""
        raise ValueError(f"sleep: level {level} (offloading or discarding the weights and the "
                         "KV cache) is not supported by paged_prefix; level 0 (pausing the "
                         "scheduler) is. Call wake_up() to resume scheduling")

    # -- refused features (the platform refuses them at startup already) ---------------------
    def add_lora(self, lora_request) -> bool:
        raise ValueError("lora: not supported by paged_prefix")

    def remove_lora(self, lora_id: int) -> bool:
        return False

    def pin_lora(self, lora_id: int) -> bool:
        return False

    def list_loras(self) -> set[int]:
        return set()

    def shutdown(self) -> None:
        if self.runner is not None:
            self.runner.launcher.wait()  # nothing is freed under a step being sent
        self.runner = None
        mx.clear_cache()
