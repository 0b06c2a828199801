"""Per-forward metadata of the recurrent state groups: which block each sequence's state is read
from and which it is written to, checked once; and the runner's count of what each block holds.

vLLM's align mode (docs/hybrid.md) gives every request one block row per state group, indexed
by position: block i holds the state after (i + 1) * B tokens. A sequence with c tokens
computed and n scheduled in this forward, row R:

    src = R[(c - 1) // B]   the state after exactly c tokens (read); none when c = 0 (zeros)
    dst = R[(c + n - 1) // B]   written with the state after c + n tokens

With prefix caching off vLLM sends one block per request and B = max_model_len: src and dst
are that block, and the same rule holds.

Every check runs here, before anything is written, as a ValueError naming the field: rows long
enough, no null block read or written, no two sequences writing one block, no block read by one
sequence while another writes it, no block written that holds a live request's current state,
and each src holding, by the runner's own count (`StateLedger`), the state after exactly c of
this request's tokens: a hit at an unaligned length, or a block holding another prefix's state,
is refused, never computed over.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from jit_kernels.arrays import device_array

from .recurrent import RecurrentPlan, build_plan
from .validate import as_int, as_ints, frozen

NULL_BLOCK = 0  # vLLM's null block: skipped row entries, never a state


@dataclass(frozen=True)
class StateEntry:
    """What a state block holds by this runner's count: the state after the first `tokens` of
    the token history (prompt, then outputs) of the request that wrote it."""

    req_id: str
    tokens: int
    prompt: tuple[int, ...]
    outputs: tuple[int, ...]

    def holds(self, tokens: int, prompt: tuple[int, ...], outputs: tuple[int, ...]) -> bool:
        """Whether this is the state after the first `tokens` of the history (prompt, outputs)."""
        if tokens != self.tokens:
            return False
        if prompt is self.prompt:  # the writer itself: its history only grows
            return True
        return _first(prompt, outputs, tokens) == _first(self.prompt, self.outputs, tokens)


def _first(prompt: tuple[int, ...], outputs: tuple[int, ...], n: int) -> tuple[int, ...]:
    return prompt[:n] if n <= len(prompt) else prompt + outputs[:n - len(prompt)]


# (state group, block id) -> what the block holds; written only by `commit` after a forward
StateLedger = dict[tuple[int, int], StateEntry]


@dataclass(frozen=True)
class StateRequest:
    """One scheduled sequence's share of the state groups.

    rows: per state group, the request's block ids (vLLM's row, position-indexed).
    prompt, outputs: its token history as known in this step (outputs: sampled so far).
    """

    req_id: str
    num_computed_tokens: int
    num_scheduled_tokens: int
    rows: Sequence[Sequence[int]]
    prompt: tuple[int, ...]
    outputs: tuple[int, ...]


@dataclass(frozen=True, eq=False)
class StateRows:
    """One state group's blocks in one forward, per sequence s (device int32, host mirrors).

    src   [S]: the block read as s's starting state; the null block where s is fresh.
    fresh [S] bool: s starts from zeros (nothing computed yet).
    dst   [S]: the block written with s's state after this forward.
    """

    src: mx.array
    fresh: mx.array
    dst: mx.array
    src_host: np.ndarray
    fresh_host: np.ndarray
    dst_host: np.ndarray


@dataclass(frozen=True, eq=False)
class StateMetadata:
    """The recurrent layers' share of one forward: each state group's rows, the packed rows'
    recurrent plan (one state per sequence: its chunk's end), and the ledger entries the
    forward makes true once it has run (`commit`)."""

    block_size: int
    groups: tuple[StateRows, ...]
    plan: RecurrentPlan
    writes: tuple[tuple[tuple[int, int], StateEntry], ...]

    @property
    def num_seqs(self) -> int:
        return self.plan.num_seqs


def state_index(tokens: int, block_size: int) -> int:
    """The row index of the block holding the state after `tokens` (>= 1) tokens."""
    return (tokens - 1) // block_size


def current_state_blocks(num_computed: int, rows: Sequence[Sequence[int]],
                         block_size: int) -> list[tuple[int, int]]:
    """(group, block) of each state group's block holding a request's state after its
    `num_computed` tokens (none before its first token)."""
    if num_computed == 0:
        return []
    i = state_index(num_computed, block_size)
    return [(g, int(row[i])) for g, row in enumerate(rows) if len(row) > i]


def build_state_metadata(requests: Sequence[StateRequest], num_groups: int, block_size: int,
                         num_blocks: int, conv_kernel: int, ledger: Mapping,
                         held: Mapping[tuple[int, int], str]) -> StateMetadata:
    """The forward's state rows, checked (ValueError naming the field).

    requests: the scheduled sequences in packed order; num_groups: the model's state groups;
    block_size: vLLM's state block size B; ledger: `StateLedger`; held: (group, block) ->
    req_id of the blocks holding a live request's current state, for the live requests outside
    this forward (`current_state_blocks`)."""
    num_groups = as_int(num_groups, "num_groups", low=1)
    block_size = as_int(block_size, "block_size", low=1)
    num_blocks = as_int(num_blocks, "num_blocks", low=1)
    if not requests:
        raise ValueError("requests: a forward needs at least one scheduled request")
    lens = []
    src = np.zeros((num_groups, len(requests)), dtype=np.int32)
    dst = np.zeros_like(src)
    writes = []
    for s, r in enumerate(requests):
        c = as_int(r.num_computed_tokens, f"num_computed_tokens ({r.req_id!r})", low=0)
        n = as_int(r.num_scheduled_tokens, f"num_scheduled_tokens ({r.req_id!r})", low=1)
        if len(r.rows) != num_groups:
            raise ValueError(f"state_block_ids ({r.req_id!r}): {len(r.rows)} rows for "
                             f"{num_groups} state groups")
        lens.append(n)
        for g, row in enumerate(r.rows):
            field = f"state_block_ids[group {g}] ({r.req_id!r})"
            row = as_ints(row, field, low=0, high=num_blocks - 1)
            last = state_index(c + n, block_size)
            if len(row) <= last:
                raise ValueError(f"{field}: {c + n} tokens need the block at index {last}, but "
                                 f"the row has {len(row)}")
            dst[g, s] = row[last]
            if dst[g, s] == NULL_BLOCK:
                raise ValueError(f"{field}: the state after {c + n} tokens would be written "
                                 f"into vLLM's null block (index {last})")
            writes.append(((g, int(dst[g, s])), StateEntry(r.req_id, c + n, r.prompt,
                                                            r.outputs)))
            if c == 0:
                continue
            src[g, s] = row[state_index(c, block_size)]
            entry = ledger.get((g, int(src[g, s])))
            if src[g, s] == NULL_BLOCK or entry is None or \
                    not entry.holds(c, r.prompt, r.outputs):
                what = "vLLM's null block" if src[g, s] == NULL_BLOCK else \
                    "no state this runner wrote" if entry is None else \
                    f"the state after {entry.tokens} tokens of {entry.req_id!r}"
                raise ValueError(f"num_computed_tokens ({r.req_id!r}): {c} tokens computed, but "
                                 f"state block {int(src[g, s])} (group {g}, index "
                                 f"{state_index(c, block_size)}) holds {what}")
    _check_apart(requests, src, dst, held)
    fresh = np.array([r.num_computed_tokens == 0 for r in requests])
    cu = np.concatenate([[0], np.cumsum(lens)])
    groups = tuple(
        StateRows(device_array(src[g]), device_array(fresh), device_array(dst[g]),
                  frozen(src[g]), frozen(fresh), frozen(dst[g]))
        for g in range(num_groups))
    plan = build_plan(cu, [[] for _ in requests], conv_kernel)
    return StateMetadata(block_size, groups, plan, tuple(writes))


def _check_apart(requests: Sequence[StateRequest], src: np.ndarray, dst: np.ndarray,
                 held: Mapping[tuple[int, int], str]) -> None:
    """Each block written by one sequence, read by no other of the forward, and holding no live
    request's current state (vLLM hands out free blocks only)."""
    for g in range(dst.shape[0]):
        writer: dict[int, int] = {}
        for s, block in enumerate(dst[g].tolist()):
            if block in writer:
                raise ValueError(f"state_block_ids[group {g}]: {requests[writer[block]].req_id!r} "
                                 f"and {requests[s].req_id!r} both write state block {block}")
            writer[block] = s
            if (g, block) in held:
                raise ValueError(f"state_block_ids[group {g}] ({requests[s].req_id!r}): writes "
                                 f"state block {block}, which holds running request "
                                 f"{held[(g, block)]!r}'s state")
        for s, block in enumerate(src[g].tolist()):
            w = writer.get(block)
            if requests[s].num_computed_tokens and w is not None and w != s:
                raise ValueError(f"state_block_ids[group {g}] ({requests[s].req_id!r}): reads "
                                 f"state block {block}, which {requests[w].req_id!r} writes in "
                                 "this forward")


def commit(ledger: StateLedger, meta: StateMetadata,
           outputs: Mapping[str, tuple[int, ...]] | None = None) -> None:
    """Record what the forward of `meta` wrote; call only once it has run. `outputs`: each
    writer's outputs as known now, where the forward was planned before the value of a token
    sampled on the device was read (`requests.RequestState.pending`)."""
    ledger.update((key, entry if outputs is None else
                   dataclasses.replace(entry, outputs=outputs[entry.req_id]))
                  for key, entry in meta.writes)
