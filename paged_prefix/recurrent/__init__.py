"""Recurrent layers of hybrid models on the packed rows of a batch, with per-sequence state.

`build_plan` once per forward (which rows run together, which states come out), then per
layer: `gated_delta_net` (Qwen3-Next) or `short_conv` (LFM2), each taking every sequence's
state before its chunk and returning its outputs and the states at the plan's boundaries.
How those states map to vLLM's blocks is in docs/hybrid.md.
"""

from .conv import causal_conv
from .gated_delta import gated_delta
from .lfm2 import short_conv
from .plan import Batch, RecurrentPlan, build_plan
from .qwen3_next import gated_delta_net

__all__ = ["Batch", "RecurrentPlan", "build_plan", "causal_conv",
           "gated_delta", "gated_delta_net", "short_conv"]
