"""The causal depthwise conv of the recurrent layers, over the packed rows of a batch.

mlx-lm runs one sequence as `conv(concat(conv_state, x))` with a valid (unpadded) conv and
keeps the last K-1 inputs as the next state. Here every sequence's K-1 state rows are put in
front of its tokens in one extended array and the layer's own `nn.Conv1d` runs over all of
it once: an output whose window crosses into the next sequence's state rows is never taken.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .plan import RecurrentPlan


def check_conv(conv: nn.Conv1d, channels: int, plan: RecurrentPlan) -> None:
    """A depthwise, unpadded, stride-1 conv over `channels` of the plan's width, or raise."""
    out_ch, width, per_group = conv.weight.shape
    if (out_ch, per_group) != (channels, 1) or conv.groups != channels:
        raise ValueError(f"conv: expected a depthwise conv over {channels} channels, got weight "
                         f"{conv.weight.shape} in {conv.groups} groups")
    if (conv.padding, conv.stride, conv.dilation) != (0, 1, 1):
        raise ValueError(f"conv: expected padding 0, stride 1, dilation 1, got "
                         f"{(conv.padding, conv.stride, conv.dilation)}")
    if width != plan.conv_kernel:
        raise ValueError(f"conv: kernel width {width} differs from the plan's {plan.conv_kernel}")


def causal_conv(conv: nn.Conv1d, x: mx.array, plan: RecurrentPlan,
                state: mx.array) -> tuple[mx.array, mx.array]:
    """Shapes: x [T, C]; state [S, K-1, C], each sequence's last K-1 inputs before its chunk.

    Returns (y [T, C], states [N, K-1, C]): the conv of every row and the K-1 inputs that
    precede each of the plan's state rows (mlx-lm's conv state there)."""
    num_rows, channels = x.shape
    keep = plan.conv_kernel - 1
    if num_rows != plan.num_rows:
        raise ValueError(f"x: {num_rows} rows, the plan packs {plan.num_rows}")
    if state.shape != (plan.num_seqs, keep, channels):
        raise ValueError(f"state: expected {(plan.num_seqs, keep, channels)}, got {state.shape}")
    if state.dtype != x.dtype:
        raise ValueError(f"state: dtype {state.dtype} differs from the rows' {x.dtype} (mlx-lm "
                         "keeps the conv state in the layer's dtype)")
    check_conv(conv, channels, plan)
    rows = mx.concatenate([state.reshape(-1, channels), x])
    ext = rows[plan.conv_ext]  # [T + S (K-1), C]: per sequence, its state rows then its tokens
    y = conv(ext[None])[0]  # [T + (S - 1)(K-1), C]
    return y[plan.conv_out], ext[plan.conv_states]
