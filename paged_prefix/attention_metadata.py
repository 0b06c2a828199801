"""One forward's attention geometry: lengths and block tables, validated once, then only read.

Token layout: the new tokens of all sequences are packed back to back, sequence s owning rows
`cu_seqlens_q[s] : cu_seqlens_q[s + 1]`. Sequence s already has `context_lens[s]` tokens in its
paged KV blocks (a prefix-cache hit or earlier chunks); its new token i sits at absolute
position `context_lens[s] + i` and may attend to keys `0 .. context_lens[s] + i`
(bottom-right-aligned causal), with a sliding window W the latest W of them.

A windowed KV-cache group never reads the table entries wholly before a sequence's first
visible key (`reference.key_start`): vLLM's null block, or a block since handed to another
request. The checks (a block named once, shared only as the same prefix, written by one
sequence) apply to the entries a forward reads or writes; the others need only be pool ids.

Every inconsistency is a ValueError naming the field, raised before anything is written.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import mlx.core as mx
import numpy as np

from jit_kernels.arrays import device_array
from jit_kernels.geometry import Lengths
from reference import key_start

from .validate import MAX_INT32, as_int, as_ints, frozen


@dataclass(frozen=True, eq=False)
class AttentionMetadata:
    """What paged attention needs for one forward (the contract of `reference.contract`).

    block_tables [S, max_blocks] int32, on the device: row s lists the KV blocks of sequence
    s in order; entries past ceil(seq_lens[s] / block_size) are 0 (host mirror
    `block_tables_host`). Host arrays (read-only numpy):
      seq_lens_host     [S]: cached + new tokens per sequence.
      context_lens_host [S]: tokens already in the cache when this forward starts.
      cu_seqlens_q_host [S + 1]: prefix sums of the new-token counts.
      live_from_host    [S]: the first table entry a forward reads (the block of `key_start`
                        under `window`, else 0).
    The lengths reach the kernels as their plans' work lists, planned on the host: only the
    table is copied to the device (each host-written array costs a step's host time, and on a
    CUDA GPU a page migration when first read).
    """

    block_size: int
    num_blocks: int
    window: int | None  # the sliding window the tables were checked for (None: full)
    block_tables: mx.array
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

    @cached_property  # read per forward and per plan: computed once
    def q_lens_host(self) -> np.ndarray:
        return frozen(np.diff(self.cu_seqlens_q_host))

    @cached_property
    def max_q_len(self) -> int:
        return int(self.q_lens_host.max())

    def live_blocks(self) -> np.ndarray:
        """(sequence, block id) rows of every table entry this forward reads or writes."""
        table = self.block_tables_host
        seqs, idx = _live(self.live_from_host, self.seq_lens_host, self.block_size, table.shape[1])
        return np.stack([seqs, table[seqs, idx]], axis=1)


def repeat_order(values: np.ndarray) -> tuple[np.ndarray, tuple[int, int] | None]:
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
    return attention_metadata_and_shared_reads(q_lens, context_lens, block_tables, block_size,
                                               num_blocks, window)[0]


def attention_metadata_and_shared_reads(q_lens, context_lens, block_tables, block_size,
                                        num_blocks, window, field="block_tables"):
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
    if isinstance(block_tables, (str, bytes)) or \
            not isinstance(block_tables, (Sequence, np.ndarray)):
        raise ValueError(f"{field}: expected one sequence of block ids per sequence, got "
                         f"{type(block_tables).__name__}")
    if len(ctx) != len(q) or len(block_tables) != len(q):
        raise ValueError(
            f"context_lens/block_tables: expected {len(q)} entries (one per sequence), "
            f"got {len(ctx)} and {len(block_tables)}")
    seq = ctx + q
    if seq.max() > MAX_INT32:
        raise ValueError("seq_lens: a sequence longer than 2**31 - 1 tokens does not fit int32")
    first = key_start(ctx, window) // block_size
    table = _block_table(block_tables, seq, first, block_size, num_blocks, field)
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
        lengths=Lengths.of(cu, seq),
        **host,
    )
    return meta, shared


def _block_table(block_tables, seq: np.ndarray, first: np.ndarray, block_size: int,
                 num_blocks: int, field: str) -> np.ndarray:
    """The sequences' tables as one int32 [S, max_blocks] array, entries past a sequence's
    blocks 0: every id a block of the pool, enough of them for its tokens, none named twice
    among those it reads or writes (from `first` on). The batch's ids are bounded in one
    pass (a decode step's batch would be as many short checks, each costing more than its
    ids), then a bad one is named by its row; repeats are found per row with a set."""
    high = num_blocks - 1
    try:
        if not all(isinstance(row, (Sequence, np.ndarray)) for row in block_tables):
            raise TypeError("a row that is no list of ids")  # named below, as as_ints names it
        lens = np.array([len(row) for row in block_tables], dtype=np.int64)
        flat = as_ints(list(itertools.chain.from_iterable(block_tables)), field, low=0,
                       high=high)
    except (TypeError, ValueError):
        for s, row in enumerate(block_tables):
            as_ints(row, f"{field}[{s}]", low=0, high=high)
        raise
    needed = -(-seq // block_size)
    start = np.cumsum(lens) - lens  # row s is flat[start[s]:start[s] + lens[s]]
    for s, (b, length, a, n) in enumerate(zip(start.tolist(), lens.tolist(), first.tolist(),
                                              needed.tolist())):
        if length < n:
            raise ValueError(f"{field}: sequence {s} holds {seq[s]} tokens and needs {n} "
                             f"blocks of {block_size}, but its table has {length}")
        live = flat[b + a:b + n].tolist()
        if len(set(live)) != len(live):
            raise ValueError(f"{field}: sequence {s} names a block twice among the blocks "
                             f"{a} .. {n - 1} it reads: {live}")
    entries = np.arange(max(int(lens.max()), 1))
    table = np.zeros((len(seq), len(entries)), dtype=np.int32)
    table[entries < lens[:, None]] = flat  # row by row, as flat holds them
    table[entries >= needed[:, None]] = 0
    return table


def _shared_reads(table: np.ndarray, first: np.ndarray, ctx: np.ndarray, seq: np.ndarray,
                  block_size: int, field: str) -> np.ndarray:
    """Blocks one sequence writes and another reads as its cached prefix, as rows
    (writer, reader, table index). The scheduler may hand out as a hit a block that another
    request fills in this very forward (it registers a block's hash when it allocates it):
    that is legal when both tables hold it at the same index (and, checked by the caller, the
    same tokens), since every layer writes its K/V before it reads. Two sequences writing one
    block, or a block read at another position than it is written, is refused. Only entries
    from `first` on are read."""
    if len(seq) == 1:  # between sequences only (a block twice in one table is refused apart)
        return np.zeros((0, 3), dtype=np.int64)
    w_seq, w_idx = _live(ctx // block_size, seq, block_size, table.shape[1])
    written = table[w_seq, w_idx]
    order, twice = repeat_order(written)
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
