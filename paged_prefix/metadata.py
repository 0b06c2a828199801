"""Per-forward batch metadata: built once from the scheduled requests, then only read.

Data flows one way: scheduled requests -> `BatchMetadata` (host work and validation, once per
forward) -> every layer reads it with no host sync: read-only numpy copies travel beside the
device arrays.

Token layout: the new tokens of all sequences are packed back to back, sequence s owning rows
`cu_seqlens_q[s] : cu_seqlens_q[s + 1]`. Sequence s already has `context_lens[s]` tokens in its
paged KV blocks (a prefix-cache hit or earlier chunks); its new token i sits at absolute
position `context_lens[s] + i` and may attend to keys `0 .. context_lens[s] + i`
(bottom-right-aligned causal), with a sliding window W the latest W of them.

KV-cache groups (vLLM's hybrid manager: full-attention layers, sliding-window layers) have
their own block tables and slots (`GroupMetadata`) and share the tokens and lengths. A windowed
group never reads the table entries wholly before a sequence's first visible key
(`reference.key_start`): vLLM's null block, or a block since handed to another request. The
checks (a block named once, shared only as the same prefix, written by one sequence) apply to
the entries a forward reads or writes; the others need only be pool ids.

Every inconsistency is a ValueError naming the field, raised before anything is written.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from jit_kernels.arrays import device_array
from jit_kernels.geometry import Lengths
from reference import key_start

from .state_metadata import StateMetadata
from .validate import MAX_INT32, as_int, as_ints, frozen, index_dtype


@dataclass(frozen=True, eq=False)
class AttentionMetadata:
    """What paged attention needs for one forward (the contract of `reference.contract`).

    Device arrays (int32):
      block_tables [S, max_blocks]: row s lists the KV blocks of sequence s in order;
                                    entries past ceil(seq_lens[s] / block_size) are 0.
      seq_lens     [S]: cached + new tokens per sequence.
      context_lens [S]: tokens already in the cache when this forward starts.
      cu_seqlens_q [S + 1]: prefix sums of the new-token counts.
    Host mirrors (`*_host`, read-only numpy) carry the same values; `live_from_host` [S] is the
    first table entry a forward reads (the block of `key_start` under `window`, else 0).
    """

    block_size: int
    num_blocks: int
    window: int | None  # the sliding window the tables were checked for (None: full)
    block_tables: mx.array
    seq_lens: mx.array
    context_lens: mx.array
    cu_seqlens_q: mx.array
    block_tables_host: np.ndarray
    seq_lens_host: np.ndarray
    context_lens_host: np.ndarray
    cu_seqlens_q_host: np.ndarray
    live_from_host: np.ndarray
    lengths: Lengths  # the host lengths, checked once, for every plan of the forward

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def num_tokens(self) -> int:
        return int(self.cu_seqlens_q_host[-1])

    @property
    def q_lens_host(self) -> np.ndarray:
        return np.diff(self.cu_seqlens_q_host)

    @property
    def max_q_len(self) -> int:
        return int(self.q_lens_host.max())

    def live_blocks(self) -> np.ndarray:
        """(sequence, block id) rows of every table entry this forward reads or writes."""
        table = self.block_tables_host
        seqs, idx = _live(self.live_from_host, self.seq_lens_host, self.block_size, table.shape[1])
        return np.stack([seqs, table[seqs, idx]], axis=1)


def _repeat(values: np.ndarray) -> tuple[np.ndarray, tuple[int, int] | None]:
    """`values`' stable sort order, and the positions of two equal values (None: all differ)."""
    order = np.argsort(values, kind="stable")
    dup = np.nonzero(np.diff(values[order]) == 0)[0]
    return order, (int(order[dup[0]]), int(order[dup[0] + 1])) if len(dup) else None


def _live(first: np.ndarray, seq: np.ndarray, block_size: int,
          columns: int) -> tuple[np.ndarray, np.ndarray]:
    """(sequence, table index) of the entries first[s] .. ceil(seq[s] / block_size) - 1."""
    idx = np.arange(columns)[None, :]
    return np.nonzero((idx >= first[:, None]) & (idx < (-(-seq // block_size))[:, None]))


def build_attention_metadata(
    q_lens: Sequence[int],
    context_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    num_blocks: int,
    window: int | None = None,
) -> AttentionMetadata:
    """Validate one forward's attention geometry and pack it; raises ValueError naming the field.
    With a `window`, a table's entries before each sequence's first visible key are not read."""
    return _attention_metadata(q_lens, context_lens, block_tables, block_size, num_blocks,
                               window)[0]


def _attention_metadata(q_lens, context_lens, block_tables, block_size, num_blocks, window,
                        field="block_tables"):
    """(metadata, shared reads [(writer, reader, table index)]); see `_shared_reads`. `field`
    names the tables in errors."""
    block_size = as_int(block_size, "block_size", low=1, high=MAX_INT32)
    num_blocks = as_int(num_blocks, "num_blocks", low=1, high=MAX_INT32)
    if window is not None:
        window = as_int(window, "window", low=1)
    q = as_ints(q_lens, "q_lens", low=1, high=MAX_INT32)
    if len(q) == 0:
        raise ValueError("q_lens: a forward needs at least one sequence")
    ctx = as_ints(context_lens, "context_lens", low=0, high=MAX_INT32)
    if len(ctx) != len(q) or len(block_tables) != len(q):
        raise ValueError(
            f"context_lens/block_tables: expected {len(q)} entries (one per sequence), "
            f"got {len(ctx)} and {len(block_tables)}")
    seq = ctx + q
    if seq.max() > MAX_INT32:
        raise ValueError("seq_lens: a sequence longer than 2**31 - 1 tokens does not fit int32")
    rows = [as_ints(row, f"{field}[{s}]", low=0, high=num_blocks - 1)
            for s, row in enumerate(block_tables)]
    first = key_start(ctx, window) // block_size
    table = np.zeros((len(q), max(max(len(r) for r in rows), 1)), dtype=np.int32)
    for s, row in enumerate(rows):
        needed = -(-int(seq[s]) // block_size)
        if len(row) < needed:
            raise ValueError(
                f"{field}: sequence {s} holds {seq[s]} tokens and needs {needed} blocks "
                f"of {block_size}, but its table has {len(row)}")
        live = row[first[s]:needed]
        if len(np.unique(live)) != len(live):
            raise ValueError(f"{field}: sequence {s} names a block twice among the blocks "
                             f"{first[s]} .. {needed - 1} it reads: {live.tolist()}")
        table[s, :needed] = row[:needed]
    cu = np.concatenate([[0], np.cumsum(q)])
    if cu[-1] > MAX_INT32:
        raise ValueError("cu_seqlens_q: more than 2**31 - 1 new tokens in one forward")
    shared = _shared_reads(table, first, ctx, seq, block_size, field)
    host = {
        "block_tables_host": frozen(table),
        "seq_lens_host": frozen(seq.astype(np.int32)),
        "context_lens_host": frozen(ctx.astype(np.int32)),
        "cu_seqlens_q_host": frozen(cu.astype(np.int32)),
    }
    meta = AttentionMetadata(
        block_size=block_size,
        num_blocks=num_blocks,
        window=window,
        live_from_host=frozen(first.astype(np.int32)),
        block_tables=device_array(host["block_tables_host"]),
        seq_lens=device_array(host["seq_lens_host"]),
        context_lens=device_array(host["context_lens_host"]),
        cu_seqlens_q=device_array(host["cu_seqlens_q_host"]),
        lengths=Lengths.of(cu, seq),
        **host,
    )
    return meta, shared


def _shared_reads(table: np.ndarray, first: np.ndarray, ctx: np.ndarray, seq: np.ndarray,
                  block_size: int, field: str) -> np.ndarray:
    """Blocks one sequence writes and another reads as its cached prefix, as rows
    (writer, reader, table index). The scheduler may hand out as a hit a block that another
    request fills in this very forward (it registers a block's hash when it allocates it):
    that is legal when both tables hold it at the same index (and, checked by the caller, the
    same tokens), since every layer writes its K/V before it reads. Two sequences writing one
    block, or a block read at another position than it is written, is refused. Only entries
    from `first` on are read."""
    w_seq, w_idx = _live(ctx // block_size, seq, block_size, table.shape[1])
    written = table[w_seq, w_idx]
    order, twice = _repeat(written)
    if twice:
        a, b = twice
        raise ValueError(f"{field}: sequences {w_seq[a]} and {w_seq[b]} both write block "
                         f"{written[a]} in one forward")
    r_seq, r_idx = _live(first, ctx, block_size, table.shape[1])
    read = table[r_seq, r_idx]
    hit = np.nonzero(np.isin(read, written))[0]
    pos = order[np.searchsorted(written[order], read[hit])]
    writer, reader, at = w_seq[pos], r_seq[hit], r_idx[hit]
    other = writer != reader
    if (w_idx[pos][other] != at[other]).any():
        k = np.nonzero(other & (w_idx[pos] != at))[0][0]
        raise ValueError(f"{field}: sequence {reader[k]} reads block {read[hit][k]} as its "
                         f"cached prefix while sequence {writer[k]} writes it at another position")
    return np.stack([writer[other], reader[other], at[other]], axis=1)


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


def _check_request(r: ScheduledRequest, vocab_size: int | None) -> np.ndarray:
    """Validate one request; returns its scheduled token ids (int64)."""
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
    # the ids travel as int32: without a vocabulary, that is their bound
    high = MAX_INT32 if vocab_size is None else vocab_size - 1
    return as_ints(list(r.token_ids[computed:computed + scheduled]),
                   f"token_ids ({r.req_id!r})", low=0, high=high)


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
    if not requests:
        raise ValueError("requests: a forward needs at least one scheduled request")
    if vocab_size is not None:
        vocab_size = as_int(vocab_size, "vocab_size", low=1, high=MAX_INT32 + 1)
    if len({r.req_id for r in requests}) != len(requests):
        raise ValueError("req_id: a request is scheduled twice in one forward")
    windows = tuple(windows)
    if not windows:
        raise ValueError("windows: a model has at least one KV-cache group")
    input_ids = [_check_request(r, vocab_size) for r in requests]
    block_ids = [_group_block_ids(r, len(windows)) for r in requests]
    q_lens = [r.num_scheduled_tokens for r in requests]
    context_lens = [r.num_computed_tokens for r in requests]
    groups = []
    for g, window in enumerate(windows):
        field = "block_tables" if len(windows) == 1 else f"block_tables[group {g}]"
        attn, shared = _attention_metadata(q_lens, context_lens, [b[g] for b in block_ids],
                                           block_size, num_blocks, window, field)
        _check_shared_reads(requests, attn, shared)
        groups.append(attn)
    _check_groups_apart(groups)
    attn = groups[0]
    cu, ctx = attn.cu_seqlens_q_host, attn.context_lens_host
    pos = np.concatenate([np.arange(c, c + q) for c, q in zip(ctx, attn.q_lens_host)])
    ids = frozen(np.concatenate(input_ids).astype(np.int32))
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
    twice = _repeat(blocks)[1]
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
