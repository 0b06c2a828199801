"""Qwen2, Qwen3 (q/k norms) and Qwen3-MoE (mlx-lm's SwitchGLU experts): full attention."""

from __future__ import annotations

from mlx_lm.models import qwen2, qwen3, qwen3_moe

from .base import TIED_EMBEDDINGS, Architecture, module_attention, refuse_sliding_window_flag

ARCHITECTURES = tuple(
    Architecture(model_type, hf, module, module_attention,
                 check_config=refuse_sliding_window_flag, must_state=stated)
    for model_type, hf, module, stated in (
        ("qwen2", "Qwen2ForCausalLM", qwen2, (TIED_EMBEDDINGS,)),
        ("qwen3", "Qwen3ForCausalLM", qwen3, ()),
        ("qwen3_moe", "Qwen3MoeForCausalLM", qwen3_moe, ())))
