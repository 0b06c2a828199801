"""The gated delta rule over the packed rows of a batch, by mlx-lm's own recurrence.

Each batch of the plan goes to `mlx_lm.models.gated_delta.gated_delta_update` as the
[n, length] batch mlx-lm would run for one sequence: its Metal kernel where MLX runs one (on
the GPU, head dims a multiple of 32), its ops otherwise. It decides that per call exactly as
it does inside mlx-lm, so a sequence's rows and states are mlx-lm's.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.gated_delta import gated_delta_update

from .plan import RecurrentPlan


def _check(q: mx.array, k: mx.array, v: mx.array, a: mx.array, b: mx.array, plan: RecurrentPlan,
           state: mx.array) -> None:
    num_rows, hk, dk = q.shape
    hv, dv = v.shape[1:]
    expected = {"q": (q.shape, (plan.num_rows, hk, dk)), "k": (k.shape, (num_rows, hk, dk)),
                "v": (v.shape, (num_rows, hv, dv)), "a": (a.shape, (num_rows, hv)),
                "b": (b.shape, (num_rows, hv)),
                "state": (state.shape, (plan.num_seqs, hv, dv, dk))}
    for field, (got, want) in expected.items():
        if got != want:
            raise ValueError(f"{field}: expected shape {want}, got {got}")
    if hv % hk:
        raise ValueError(f"v: {hv} value heads are not a multiple of {hk} key heads")


def gated_delta(q: mx.array, k: mx.array, v: mx.array, a: mx.array, b: mx.array,
                A_log: mx.array, dt_bias: mx.array, plan: RecurrentPlan, state: mx.array,
                use_kernel: bool = True) -> tuple[mx.array, mx.array]:
    """Shapes: q, k [T, Hk, Dk] (normalized as mlx-lm's `normalize_qk` leaves them);
    v [T, Hv, Dv]; a, b [T, Hv] (the gate and beta logits); state [S, Hv, Dv, Dk], each
    sequence's state before its chunk (float32 zeros for a fresh one).

    Returns (y [T, Hv, Dv], states [N, Hv, Dv, Dk]): the outputs of every row and the state at
    each of the plan's state rows, in the state's dtype."""
    _check(q, k, v, a, b, plan, state)
    ys, outs = [], []
    # Item assignment rebinds the array in place: never on the caller's `state`.
    current = mx.array(state) if len(plan.rounds) > 1 else state
    for r, batches in enumerate(plan.rounds):
        updates = []
        for batch in batches:
            n, length = len(batch.seqs), batch.length

            def rows(x: mx.array, batch=batch, n=n, length=length) -> mx.array:
                return x[batch.rows].reshape(n, length, *x.shape[1:])  # [n, length, ...]

            y, s = gated_delta_update(rows(q), rows(k), rows(v), rows(a), rows(b), A_log,
                                      dt_bias, current[batch.seq_index], use_kernel=use_kernel)
            ys.append(y.reshape(n * length, *y.shape[2:]))
            outs.append(s)
            updates.append((batch.seq_index, s))
        if r + 1 < len(plan.rounds):  # the next round starts where this one ended
            for seq_index, s in updates:
                current[seq_index] = s
    y = mx.concatenate(ys)[plan.y_order]
    return y, mx.concatenate(outs)[plan.state_order]
