"""Per-forward batch metadata: built once from the scheduled requests, then only read.

Data flows one way: scheduled requests -> `BatchMetadata` (host work and validation, once per
forward) -> every layer reads it with no host sync: read-only numpy copies travel beside the
device arrays. Each KV-cache group (vLLM's hybrid manager: full-attention layers,
sliding-window layers) has its own block tables and slots (`GroupMetadata`, over
`attention_metadata.AttentionMetadata`) and shares the tokens and lengths.

Every inconsistency is a ValueError naming the field, raised before anything is written.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from jit_kernels.arrays import device_array

from .attention_metadata import AttentionMetadata, attention_metadata_and_shared_reads, repeat_order
from .state_metadata import StateMetadata
from .validate import MAX_INT32, as_int, as_ints, frozen, index_dtype


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a forward, as the scheduler decided it.

    token_ids: every token known for the request (prompt, then sampled outputs).
    num_prompt_tokens: how many of them are the prompt.
    num_computed_tokens: tokens whose K/V are already in `block_ids` (prefix hit or
        earlier steps); the forward computes tokens
        `num_computed_tokens : num_computed_tokens + num_scheduled_tokens`.
    block_ids: the request's KV blocks in order, cached prefix blocks first: one sequence per
        KV-cache group, as vLLM sends them (a model with one group may give its flat sequence).

    A request samples only when its forward reaches its last known token: a chunk that
    ends earlier (mid-prompt, or mid-way through re-prefilling a preempted request's
    outputs) produces no token, as in vLLM's own runners.
    """

    req_id: str
    token_ids: Sequence[int]
    num_prompt_tokens: int
    num_computed_tokens: int
    num_scheduled_tokens: int
    block_ids: Sequence[Sequence[int]] | Sequence[int]


@dataclass(frozen=True, eq=False)
class GroupMetadata:
    """One KV-cache group's share of a forward: its block tables (`attn`) and the cache rows
    its layers write the new tokens to.

    slot_mapping [T] int32 (int64 past 2**31 cache rows): cache row
                 `block_id * block_size + offset` per new token (host mirror
                 `slot_mapping_host`, int64).
    """

    attn: AttentionMetadata
    slot_mapping: mx.array
    slot_mapping_host: np.ndarray


@dataclass(frozen=True, eq=False)
class BatchMetadata:
    """Everything one forward reads, built once by `build_batch_metadata`.

    input_ids      [T] int32: the scheduled (uncached) tokens, packed (host mirror
                   `input_ids_host`).
    positions      [T] int32: absolute positions, starting at each num_computed_tokens.
    logits_indices [R] int32: row of the last new token of every request that samples in
                   this forward, in `sample_req_ids` order.
    groups         per KV-cache group its tables and slots; the lengths are the same in all.
    """

    req_ids: tuple[str, ...]
    input_ids: mx.array
    input_ids_host: np.ndarray
    positions: mx.array
    logits_indices: mx.array
    sample_req_ids: tuple[str, ...]
    groups: tuple[GroupMetadata, ...]
    # a hybrid model's recurrent state rows (`state_metadata.py`); None for other models
    states: StateMetadata | None = None

    @property
    def num_tokens(self) -> int:
        return self.groups[0].attn.num_tokens

    @property
    def attn(self) -> AttentionMetadata:
        """The attention metadata of a forward with one KV-cache group."""
        return self.only_group("attn").attn

    @property
    def slot_mapping(self) -> mx.array:
        return self.only_group("slot_mapping").slot_mapping

    @property
    def slot_mapping_host(self) -> np.ndarray:
        return self.only_group("slot_mapping_host").slot_mapping_host

    def only_group(self, name: str) -> GroupMetadata:
        """The one KV-cache group's metadata; ValueError naming `name` with several groups."""
        if len(self.groups) != 1:
            raise ValueError(f"{name}: this forward has {len(self.groups)} KV-cache groups, "
                             "each with its own (groups[g])")
        return self.groups[0]


def _check_request(r: ScheduledRequest) -> Sequence:
    """Validate one request's counts; returns its scheduled token ids, unchecked (the batch's
    are checked together: `_token_ids`)."""
    if not isinstance(r.req_id, str) or not r.req_id:
        raise ValueError(f"req_id: expected a non-empty str, got {r.req_id!r}")
    if not isinstance(r.token_ids, (Sequence, np.ndarray)) or isinstance(r.token_ids, str):
        raise ValueError(f"token_ids ({r.req_id!r}): expected a sequence of ints, got "
                         f"{type(r.token_ids).__name__}")
    known = len(r.token_ids)
    computed = as_int(r.num_computed_tokens, f"num_computed_tokens ({r.req_id!r})", low=0)
    if computed > known:
        raise ValueError(f"num_computed_tokens: {r.req_id!r} claims {computed} computed tokens "
                         f"but only {known} are known")
    scheduled = as_int(r.num_scheduled_tokens, f"num_scheduled_tokens ({r.req_id!r})", low=1)
    if computed + scheduled > known:
        raise ValueError(f"num_scheduled_tokens: {r.req_id!r} schedules tokens up to "
                         f"{computed + scheduled} but only {known} are known")
    as_int(r.num_prompt_tokens, f"num_prompt_tokens ({r.req_id!r})", low=1, high=known)
    return r.token_ids[computed:computed + scheduled]


def _token_ids(requests: Sequence[ScheduledRequest], scheduled: list[Sequence],
               vocab_size: int | None) -> np.ndarray:
    """Every request's scheduled token ids, packed as int64 and checked in one pass; a bad
    one is then named by its request."""
    high = MAX_INT32 if vocab_size is None else vocab_size - 1  # without one: int32 transport
    try:
        return as_ints(list(itertools.chain.from_iterable(scheduled)), "token_ids", low=0,
                       high=high)
    except ValueError:
        for r, ids in zip(requests, scheduled):
            as_ints(list(ids), f"token_ids ({r.req_id!r})", low=0, high=high)
        raise


def _group_block_ids(r: ScheduledRequest, num_groups: int) -> tuple:
    """The request's block ids, one sequence per KV-cache group."""
    ids = r.block_ids
    if isinstance(ids, (str, bytes)) or not isinstance(ids, (Sequence, np.ndarray)):
        raise ValueError(f"block_ids ({r.req_id!r}): expected one sequence of block ids per "
                         f"KV-cache group, got {type(ids).__name__}")
    nested = any(isinstance(b, (Sequence, np.ndarray)) for b in ids)
    groups = tuple(ids) if nested else (ids,)
    if len(groups) != num_groups:
        raise ValueError(f"block_ids ({r.req_id!r}): {len(groups)} block lists for "
                         f"{num_groups} KV-cache groups")
    return groups


def build_batch_metadata(
    requests: Sequence[ScheduledRequest], block_size: int, num_blocks: int,
    vocab_size: int | None = None, windows: Sequence[int | None] = (None,),
) -> BatchMetadata:
    """Turn the scheduler's decisions into one forward's metadata; raises ValueError naming
    the field. `vocab_size`, when given, bounds the scheduled token ids; `windows` has one
    entry per KV-cache group, its sliding window or None (`PagedKVCache.windows`)."""
    if not isinstance(requests, Sequence):
        raise ValueError(f"requests: expected a sequence of ScheduledRequest, got "
                         f"{type(requests).__name__}")
    if not requests:
        raise ValueError("requests: a forward needs at least one scheduled request")
    if vocab_size is not None:
        vocab_size = as_int(vocab_size, "vocab_size", low=1, high=MAX_INT32 + 1)
    if len({r.req_id for r in requests}) != len(requests):
        raise ValueError("req_id: a request is scheduled twice in one forward")
    windows = tuple(windows)
    if not windows:
        raise ValueError("windows: a model has at least one KV-cache group")
    scheduled = [_check_request(r) for r in requests]
    block_ids = [_group_block_ids(r, len(windows)) for r in requests]
    q_lens = [r.num_scheduled_tokens for r in requests]
    context_lens = [r.num_computed_tokens for r in requests]
    groups = []
    for g, window in enumerate(windows):
        field = "block_tables" if len(windows) == 1 else f"block_tables[group {g}]"
        attn, shared = attention_metadata_and_shared_reads(
            q_lens, context_lens, [b[g] for b in block_ids], block_size, num_blocks, window, field)
        _check_shared_reads(requests, attn, shared)
        groups.append(attn)
    _check_groups_apart(groups)
    attn = groups[0]
    cu, ctx = attn.cu_seqlens_q_host, attn.context_lens_host
    pos = np.concatenate([np.arange(c, c + q) for c, q in zip(ctx, attn.q_lens_host)])
    ids = frozen(_token_ids(requests, scheduled, vocab_size).astype(np.int32))
    samples = [(int(cu[s + 1]) - 1, r.req_id) for s, r in enumerate(requests)
               if int(attn.seq_lens_host[s]) == len(r.token_ids)]
    return BatchMetadata(
        req_ids=tuple(r.req_id for r in requests),
        input_ids=device_array(ids),
        input_ids_host=ids,
        positions=device_array(pos.astype(np.int32)),
        logits_indices=device_array(np.array([row for row, _ in samples], dtype=np.int32)),
        sample_req_ids=tuple(req_id for _, req_id in samples),
        groups=tuple(_with_slots(a, pos) for a in groups),
    )


def _check_shared_reads(requests: Sequence[ScheduledRequest], attn: AttentionMetadata,
                        shared: np.ndarray) -> None:
    for writer, reader, i in shared:
        # the reader's cached tokens up to the end of the block must be the writer's, and
        # the writer must fill the block at least that far in this forward
        end = min(int(attn.context_lens_host[reader]), (int(i) + 1) * attn.block_size)
        w, r, block = requests[writer], requests[reader], attn.block_tables_host[reader, i]
        if list(w.token_ids[:end]) != list(r.token_ids[:end]):
            raise ValueError(f"block_ids: {r.req_id!r} reads block {block} as cached prefix "
                             f"while {w.req_id!r} writes other tokens into it")
        if int(attn.seq_lens_host[writer]) < end:
            raise ValueError(f"block_ids: {r.req_id!r} reads block {block} as cached prefix up "
                             f"to token {end}, but {w.req_id!r} fills it only up to token "
                             f"{int(attn.seq_lens_host[writer])} in this forward")


def _check_groups_apart(groups: Sequence[AttentionMetadata]) -> None:
    """A block belongs to one KV-cache group at a time (vLLM's groups draw from one pool, and
    their layers may share arrays): no block is read or written by two groups in a forward."""
    if len(groups) == 1:
        return
    live = [np.unique(a.live_blocks()[:, 1]) for a in groups]
    blocks = np.concatenate(live)
    owner = np.repeat(np.arange(len(live)), [len(b) for b in live])
    twice = repeat_order(blocks)[1]
    if twice:
        a, b = twice
        raise ValueError(f"block_ids: block {blocks[a]} is read or written by KV-cache groups "
                         f"{owner[a]} and {owner[b]} in one forward")


def _with_slots(attn: AttentionMetadata, pos: np.ndarray) -> GroupMetadata:
    """The group's cache row for each new token (at positions `pos`)."""
    seq_of_token = np.repeat(np.arange(attn.num_seqs), attn.q_lens_host)
    blocks = attn.block_tables_host[seq_of_token, pos // attn.block_size].astype(np.int64)
    slots = frozen(blocks * attn.block_size + pos % attn.block_size)
    rows = attn.num_blocks * attn.block_size
    return GroupMetadata(attn, device_array(slots.astype(index_dtype(rows))), slots)
