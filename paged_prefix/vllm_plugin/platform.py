"""The vLLM Platform for paged_prefix on MLX (CPU backend; CUDA or Metal where MLX has them).

No torch model is ever built: torch sees a "cpu" device for vLLM's own host tensors, while
the model, the paged KV cache and attention are MLX arrays owned by the worker
(`worker.py`). What this class decides, all at startup or admission, never silently:

- the worker class (when vLLM's is "auto"), one uni-process worker, no torch.compile or
  CUDA graphs;
- what is refused: tensor/pipeline/data parallelism, speculative decoding, LoRA,
  multimodal and pooling models, custom logits processors, quantized KV caches, and settings
  the worker would ignore (config overrides, load formats, vLLM's attention backends and
  quantization methods) at startup,
  and per request the sampling options the runner cannot honour (`vllm_sampling`) and
  prompt embeddings or multimodal inputs (HTTP 400 through `validate_request`);
- dtypes: float32 first on MLX's CPU backend (no fast half precision there), so a float32
  checkpoint stays float32 under `--dtype auto`; bfloat16 first on GPU backends.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import psutil
import torch
from vllm.platforms.interface import Platform, PlatformEnum

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)

WORKER_CLS = "paged_prefix.vllm_plugin.worker.MLXWorker"
KV_CACHE_DTYPES = ("auto", "float16", "bfloat16")
# the start-up line that names the block size chosen (bench/serve_bench.py reads it)
CONFIG_LINE = ("paged_prefix platform: worker %s, block size %s, prefix caching %s, "
               "async scheduling %s")


def _mlx_gpu() -> bool:
    import mlx.core as mx

    return mx.default_device() == mx.gpu


def _refused_feature(vllm_config: VllmConfig) -> str | None:
    """A flag-enabled feature the worker does not implement, named as the user set it: the
    engine would otherwise fail later, deep in its start-up (a KV connector asks the worker for
    methods it lacks) or on first use."""
    cache, offload = vllm_config.cache_config, vllm_config.offload_config
    model = vllm_config.model_config
    features = {
        "speculative decoding (--speculative-config)":
            vllm_config.speculative_config is not None,
        "LoRA (--enable-lora)": vllm_config.lora_config is not None,
        "KV offloading (--kv-offloading-size)": cache.kv_offloading_size is not None,
        "a KV connector (--kv-transfer-config)": vllm_config.kv_transfer_config is not None,
        "an encoder-cache connector (--ec-transfer-config)":
            vllm_config.ec_transfer_config is not None,
        "weight transfer (--weight-transfer-config)":
            vllm_config.weight_transfer_config is not None,
        "weight offloading (--cpu-offload-gb)": offload.uva.cpu_offload_gb > 0,
        "layer offloading (--offload-group-size)": offload.prefetch.offload_group_size > 0,
        "sleep mode (--enable-sleep-mode)": model is not None and model.enable_sleep_mode,
        "KV sharing fast prefill (--kv-sharing-fast-prefill)": cache.kv_sharing_fast_prefill,
        # vLLM runs these in its own (V2) model runner only: here requests would be served
        # without the watermark, or without the experts they asked for
        "text watermarking (--watermark-config)": vllm_config.watermark_config is not None,
        "routed-experts outputs (--enable-return-routed-experts)":
            vllm_config.aux_output_config.enable_return_routed_experts,
        "diffusion decoding (--diffusion-config)": vllm_config.diffusion_config is not None,
        # the worker builds the model from the folder's config.json and weights with mlx-lm,
        # and attends through its own route (PAGED_PREFIX_ATTENTION): these would be ignored
        "config overrides (--hf-overrides)": model is not None and bool(model.hf_overrides),
        f"load format {vllm_config.load_config.load_format!r} (--load-format)":
            vllm_config.load_config.load_format not in ("auto", "safetensors"),
        "a vLLM attention backend (--attention-backend)":
            vllm_config.attention_config.backend is not None,
    }
    return next((name for name, on in features.items() if on), None)


class MLXPlatform(Platform):
    _enum = PlatformEnum.OOT
    device_name: str = "cpu"  # what torch sees; MLX keeps its own device
    device_type: str = "cpu"
    dispatch_key: str = "CPU"
    dist_backend: str = "gloo"  # vLLM's one-rank control plane
    device_control_env_var: str = "PAGED_PREFIX_VISIBLE_DEVICES"
    # vLLM torch.compiles a few sampler helpers; Inductor would need a C++ toolchain and
    # minutes of compile time for what runs on a few rows.
    simple_compile_backend: str = "eager"

    @classmethod
    def import_kernels(cls) -> None:
        """vLLM's compiled CPU kernels (`vllm._C`) are never called by this worker, and loading
        them kills the process on an x86 CPU without AVX-512 (an illegal instruction, not an
        ImportError vLLM could catch): import none."""

    @property
    def supported_dtypes(self) -> list[torch.dtype]:
        if _mlx_gpu():
            return [torch.bfloat16, torch.float16, torch.float32]
        return [torch.float32, torch.bfloat16, torch.float16]

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        import mlx.core as mx

        return f"MLX {mx.default_device()}"

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        from .memory import device_memory

        return device_memory().total

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        return False

    @classmethod
    def get_device_count(cls) -> int:
        return 1

    @classmethod
    def set_device(cls, device) -> None:
        return None

    @classmethod
    def current_device(cls) -> int:
        return 0

    @classmethod
    def manual_seed_all(cls, seed: int) -> None:
        import mlx.core as mx

        mx.random.seed(seed)

    @classmethod
    def get_current_memory_usage(cls, device=None) -> float:
        return float(psutil.Process().memory_info().rss)

    @classmethod
    def inference_mode(cls):
        return torch.no_grad()

    @classmethod
    def support_hybrid_kv_cache(cls) -> bool:
        """vLLM's hybrid KV-cache manager: per-group block tables, sliding-window groups whose
        blocks it frees outside the window (the runner reads none of them), and a hybrid
        model's state groups (without it vLLM cannot group MambaSpecs beside attention)."""
        return True

    @classmethod
    def pre_register_and_update(cls, parser=None) -> None:
        """Before vLLM inspects a model's architecture (`model_info.py`)."""
        from .model_info import register

        register()

    @classmethod
    def check_and_update_config(cls, vllm_config: VllmConfig) -> None:
        from vllm.config import CompilationMode, CUDAGraphMode

        from .. import hybrid_config
        from ..model_loader import read_config
        from . import mirror_vllm_logging

        mirror_vllm_logging()
        parallel = vllm_config.parallel_config
        if parallel.world_size > 1 or parallel.data_parallel_size > 1:
            raise ValueError("paged_prefix: one worker only (tensor, pipeline and data "
                             "parallel sizes must be 1)")
        refused = _refused_feature(vllm_config)
        if refused:
            raise ValueError(f"paged_prefix: {refused} is not supported by this worker")
        if parallel.worker_cls == "auto":
            parallel.worker_cls = WORKER_CLS
        if parallel.distributed_executor_backend in ("auto", None):
            parallel.distributed_executor_backend = "uni"
        parallel.disable_custom_all_reduce = True
        cache = vllm_config.cache_config
        if cache.cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype: {cache.cache_dtype!r} is not supported; "
                             f"choose one of {KV_CACHE_DTYPES}")
        model = vllm_config.model_config
        if model is not None:
            if model.runner_type != "generate":
                raise ValueError(f"paged_prefix: only generation is supported (runner "
                                 f"{model.runner_type!r})")
            if model.is_multimodal_model:
                raise ValueError("paged_prefix: multimodal models are not supported")
            if model.logits_processors:
                raise ValueError("paged_prefix: custom logits processors are not supported "
                                 "(vLLM's built-in min_p, logit_bias and min_tokens are)")
            model.disable_cascade_attn = True
            if model.is_hybrid:
                logger.info("paged_prefix platform: %s",
                            hybrid_config.align_cache(vllm_config, read_config(model.model)))
        comp = vllm_config.compilation_config
        comp.mode = CompilationMode.NONE
        comp.cudagraph_mode = CUDAGraphMode.NONE
        comp.cudagraph_capture_sizes = []
        logger.info(CONFIG_LINE, parallel.worker_cls, cache.block_size,
                    cache.enable_prefix_caching, vllm_config.scheduler_config.async_scheduling)

    @classmethod
    def verify_quantization(cls, quant: str) -> None:
        """vLLM's quantization methods are torch kernels this worker never runs (it loads
        mlx-lm folders, quantized ones as mlx-lm quantizes them): refused, naming the flag."""
        raise ValueError(f"quantization: vLLM's {quant!r} quantization is not supported by "
                         "paged_prefix (an MLX-quantized folder, mlx_lm.convert -q, loads "
                         "without --quantization)")

    @classmethod
    def validate_request(cls, processed_inputs, params) -> None:
        from vllm.exceptions import VLLMValidationError
        from vllm.sampling_params import SamplingParams

        from ..vllm_sampling import unsupported_reason

        kind = processed_inputs.get("type") if isinstance(processed_inputs, dict) else None
        if kind != "token":  # embeds, multimodal, encoder-decoder
            raise VLLMValidationError(f"paged_prefix: {kind} inputs are not supported; send "
                                      "text or token ids", parameter="prompt")
        if isinstance(params, SamplingParams) and (refused := unsupported_reason(params)):
            name, reason = refused
            raise VLLMValidationError(f"paged_prefix: {name} is not supported: {reason}",
                                      parameter=name, value=getattr(params, name))
