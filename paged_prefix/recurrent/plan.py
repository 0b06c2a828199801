"""The per-forward plan of the recurrent layers: which rows run together, which states come out.

Rows are packed as everywhere else: sequence s owns rows `cu_seqlens[s] : cu_seqlens[s + 1]`
and enters the forward with one state (its stored state, zeros when it is fresh). The caller
names, per sequence, the token counts inside the chunk after which it wants the state (the
ends of full state blocks); the state after the chunk's last token is always returned. Those
boundaries cut each sequence into segments, and every segment end is a returned state.

The recurrence runs in rounds: round r takes the r-th segment of every sequence, and the
segments of a round that have one length run as one batch (decode rows: one batch of length
1). A batch is exactly what mlx-lm runs for one sequence, so no row is padded or masked.

Built once per forward from host ints (every check here, a ValueError naming the field), then
only read by every recurrent layer: the index arrays live on the device already.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from jit_kernels.arrays import device_array

from ..validate import as_int, as_ints


@dataclass(frozen=True, eq=False)
class Batch:
    """Segments of one length, one per sequence, run as one [n, length] batch."""

    length: int
    seqs: tuple[int, ...]
    rows: mx.array  # [n * length] int32: packed rows, segment by segment
    seq_index: mx.array  # [n] int32: each segment's sequence


@dataclass(frozen=True, eq=False)
class RecurrentPlan:
    """Shapes: T packed rows, S sequences, N returned states (segments), K the conv kernel.

    state_rows[j] = (s, tokens): returned state j is sequence s's after `tokens` tokens of this
    chunk; ordered by sequence, then tokens. Device index arrays (int32):
      conv_ext    [T + S (K-1)]: rows of concat(initial conv states, x) in per-sequence order
                  (its K-1 state rows, then its tokens)
      conv_out    [T]: the extended conv output row of each packed row
      conv_states [N, K-1]: the extended rows that make up each returned conv state
      y_order     [T]: for each packed row, its row in the rounds' concatenated outputs
      state_order [N]: for each returned state, its row in the rounds' concatenated states
    """

    cu_seqlens: tuple[int, ...]
    state_rows: tuple[tuple[int, int], ...]
    conv_kernel: int
    rounds: tuple[tuple[Batch, ...], ...]
    conv_ext: mx.array
    conv_out: mx.array
    conv_states: mx.array
    y_order: mx.array
    state_order: mx.array

    @property
    def num_seqs(self) -> int:
        return len(self.cu_seqlens) - 1

    @property
    def num_rows(self) -> int:
        return self.cu_seqlens[-1]


def _segments(cu: np.ndarray, boundaries: Sequence[Sequence[int]]) -> list[list[int]]:
    """Per sequence, the token counts that end its segments (the chunk end last)."""
    if len(boundaries) != len(cu) - 1:
        raise ValueError(f"boundaries: expected one list per sequence ({len(cu) - 1}), got "
                         f"{len(boundaries)}")
    ends = []
    for s, inner in enumerate(boundaries):
        length = int(cu[s + 1] - cu[s])
        inner = as_ints(inner, f"boundaries[{s}]", low=1, high=length - 1).tolist()
        if any(b >= c for b, c in zip(inner, inner[1:])):
            raise ValueError(f"boundaries[{s}]: expected strictly increasing token counts, got "
                             f"{inner}")
        ends.append(inner + [length])
    return ends


def _rounds(cu: np.ndarray, ends: list[list[int]]) -> tuple[list[list[tuple]], np.ndarray,
                                                            np.ndarray]:
    """Group segments into rounds of batches; the row and state orders that undo it."""
    rounds, y_rows, state_rows = [], [], []
    for r in range(max(len(e) for e in ends)):
        by_length: dict[int, list[tuple[int, int]]] = {}
        for s, e in enumerate(ends):
            if r < len(e):
                start = e[r - 1] if r else 0
                by_length.setdefault(e[r] - start, []).append((s, int(cu[s]) + start))
        batches = []
        for length, segs in sorted(by_length.items()):
            rows = np.concatenate([np.arange(first, first + length) for _, first in segs])
            batches.append((length, tuple(s for s, _ in segs), rows))
            y_rows.append(rows)
            state_rows.extend((s, r) for s, _ in segs)
        rounds.append(batches)
    y_rows = np.concatenate(y_rows)
    y_order = np.empty_like(y_rows)
    y_order[y_rows] = np.arange(len(y_rows))
    # Returned states go by sequence, then segment: (s, r) sorts that way.
    state_order = np.array(sorted(range(len(state_rows)), key=state_rows.__getitem__))
    return rounds, y_order, state_order


def _conv_indices(cu: np.ndarray, ends: list[list[int]], k: int) -> tuple[np.ndarray, ...]:
    num_seqs, keep = len(cu) - 1, k - 1
    ext, out, states = [], [], []
    offset = 0  # where sequence s starts in the extended rows
    for s in range(num_seqs):
        length = int(cu[s + 1] - cu[s])
        ext.append(np.arange(s * keep, (s + 1) * keep))  # its state rows
        ext.append(num_seqs * keep + np.arange(cu[s], cu[s + 1]))  # then its tokens
        # A valid conv output j reads extended rows j .. j+K-1: token i's window ends at it.
        out.append(offset + np.arange(length))
        states.extend(offset + b + np.arange(keep) for b in ends[s])
        offset += keep + length
    return np.concatenate(ext), np.concatenate(out), np.stack(states)


def build_plan(cu_seqlens: Sequence[int], boundaries: Sequence[Sequence[int]],
               conv_kernel: int) -> RecurrentPlan:
    """The plan of one forward. cu_seqlens [S + 1]: prefix sums of the new rows, each
    sequence at least one row; boundaries[s]: strictly increasing token counts in (0, len_s)
    after which sequence s's state is also returned; conv_kernel: the layers' conv width."""
    cu = as_ints(cu_seqlens, "cu_seqlens", low=0)
    if len(cu) < 2 or cu[0] != 0:
        raise ValueError(f"cu_seqlens: expected [0, ...] over at least one sequence, got "
                         f"{cu.tolist()}")
    if (np.diff(cu) < 1).any():
        raise ValueError(f"cu_seqlens: every sequence needs at least one row, got {cu.tolist()}")
    conv_kernel = as_int(conv_kernel, "conv_kernel", low=2)
    ends = _segments(cu, boundaries)
    rounds, y_order, state_order = _rounds(cu, ends)
    conv_ext, conv_out, conv_states = _conv_indices(cu, ends, conv_kernel)

    def dev(a: np.ndarray) -> mx.array:
        return device_array(np.asarray(a, dtype=np.int32))

    return RecurrentPlan(
        cu_seqlens=tuple(cu.tolist()),
        state_rows=tuple((s, b) for s, e in enumerate(ends) for b in e),
        conv_kernel=conv_kernel,
        rounds=tuple(tuple(Batch(length, seqs, dev(rows), dev(seqs))
                           for length, seqs, rows in batches) for batches in rounds),
        conv_ext=dev(conv_ext), conv_out=dev(conv_out), conv_states=dev(conv_states),
        y_order=dev(y_order), state_order=dev(state_order))
