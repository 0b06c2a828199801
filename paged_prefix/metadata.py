"""Per-forward batch metadata: built once from the scheduled requests, then only read.

Data flows one way: scheduled requests -> `BatchMetadata` (host work and validation,
once per forward) -> every layer's attention reads `BatchMetadata.attn` without any
host sync. Host copies (numpy, read-only) travel beside the device arrays so that no
per-layer code needs `.item()` / `.tolist()`.

Token layout: the new tokens of all sequences are packed back to back, sequence s
owning rows `cu_seqlens_q[s] : cu_seqlens_q[s + 1]`. Sequence s already has
`context_lens[s]` tokens in its paged KV blocks (a prefix-cache hit or earlier chunks);
its new token i sits at absolute position `context_lens[s] + i` and may attend to keys
`0 .. context_lens[s] + i` (bottom-right-aligned causal).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np


def _frozen_host(values: Sequence[int] | np.ndarray, dtype=np.int32) -> np.ndarray:
    arr = np.array(values, dtype=dtype)
    arr.flags.writeable = False
    return arr


@dataclass(frozen=True, eq=False)
class AttentionMetadata:
    """What paged attention needs for one forward; the contract every implementation reads.

    Device arrays (int32):
      block_tables [S, max_blocks]: row s lists the KV blocks of sequence s in order;
                                    entries past ceil(seq_lens[s] / block_size) are 0.
      seq_lens     [S]: cached + new tokens per sequence.
      context_lens [S]: tokens already in the cache when this forward starts.
      cu_seqlens_q [S + 1]: prefix sums of the new-token counts.
    Host mirrors (`*_host`, read-only numpy) carry the same values.
    """

    block_size: int
    num_blocks: int
    block_tables: mx.array
    seq_lens: mx.array
    context_lens: mx.array
    cu_seqlens_q: mx.array
    block_tables_host: np.ndarray
    seq_lens_host: np.ndarray
    context_lens_host: np.ndarray
    cu_seqlens_q_host: np.ndarray
    # Derived per-forward plans (e.g. a kernel's tile work list) keyed by their
    # builder, so each is computed once per forward however many layers run.
    _plans: dict = field(default_factory=dict, repr=False, compare=False)

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

    def plan(self, key: Hashable, build: Callable[[AttentionMetadata], Any]) -> Any:
        """Return `build(self)`, computed on the first call for `key` in this forward."""
        if key not in self._plans:
            self._plans[key] = build(self)
        return self._plans[key]


def build_attention_metadata(
    q_lens: Sequence[int],
    context_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    num_blocks: int,
) -> AttentionMetadata:
    """Validate one forward's attention geometry and pack it; raises ValueError naming the field."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if num_blocks <= 0:
        raise ValueError(f"num_blocks must be positive, got {num_blocks}")
    num_seqs = len(q_lens)
    if num_seqs == 0:
        raise ValueError("q_lens: a forward needs at least one sequence")
    if len(context_lens) != num_seqs or len(block_tables) != num_seqs:
        raise ValueError(
            f"context_lens/block_tables: expected {num_seqs} entries (one per sequence), "
            f"got {len(context_lens)} and {len(block_tables)}"
        )
    q = np.asarray(q_lens, dtype=np.int64)
    ctx = np.asarray(context_lens, dtype=np.int64)
    if (q < 1).any():
        raise ValueError(f"q_lens: every sequence needs at least one new token, got {q.tolist()}")
    if (ctx < 0).any():
        raise ValueError(f"context_lens: must be non-negative, got {ctx.tolist()}")
    seq = ctx + q
    if seq.max() >= 2**31:
        raise ValueError("seq_lens: a sequence longer than 2**31 - 1 tokens does not fit int32")
    max_blocks = max(len(row) for row in block_tables)
    table = np.zeros((num_seqs, max(max_blocks, 1)), dtype=np.int32)
    for s, row in enumerate(block_tables):
        needed = -(-int(seq[s]) // block_size)
        if len(row) < needed:
            raise ValueError(
                f"block_tables: sequence {s} holds {seq[s]} tokens and needs {needed} blocks "
                f"of {block_size}, but its table has {len(row)}"
            )
        ids = np.asarray(row[:needed], dtype=np.int64)
        if ((ids < 0) | (ids >= num_blocks)).any():
            raise ValueError(
                f"block_tables: sequence {s} names block ids outside [0, {num_blocks}): "
                f"{ids[(ids < 0) | (ids >= num_blocks)].tolist()}"
            )
        table[s, :needed] = ids
    cu = np.concatenate([[0], np.cumsum(q)])
    if cu[-1] >= 2**31:
        raise ValueError("cu_seqlens_q: more than 2**31 - 1 new tokens in one forward")
    host = {
        "block_tables_host": _frozen_host(table),
        "seq_lens_host": _frozen_host(seq),
        "context_lens_host": _frozen_host(ctx),
        "cu_seqlens_q_host": _frozen_host(cu),
    }
    return AttentionMetadata(
        block_size=block_size,
        num_blocks=num_blocks,
        block_tables=mx.array(host["block_tables_host"]),
        seq_lens=mx.array(host["seq_lens_host"]),
        context_lens=mx.array(host["context_lens_host"]),
        cu_seqlens_q=mx.array(host["cu_seqlens_q_host"]),
        **host,
    )


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a forward, as the scheduler decided it.

    token_ids: every token known for the request (prompt, then sampled outputs).
    num_computed_tokens: tokens whose K/V are already in `block_ids` (prefix hit or
        earlier steps); the forward computes tokens
        `num_computed_tokens : num_computed_tokens + num_scheduled_tokens`.
    block_ids: the request's KV blocks in order, cached prefix blocks first.
    """

    req_id: str
    token_ids: Sequence[int]
    num_prompt_tokens: int
    num_computed_tokens: int
    num_scheduled_tokens: int
    block_ids: Sequence[int]


@dataclass(frozen=True, eq=False)
class BatchMetadata:
    """Everything one forward reads, built once by `build_batch_metadata`.

    input_ids     [T] int32: the scheduled (uncached) tokens, packed.
    positions     [T] int32: absolute positions, starting at each num_computed_tokens.
    slot_mapping  [T] int64: cache row `block_id * block_size + offset` per new token.
    logits_indices [R] int32: row of the last new token of every request that
        finishes its prompt (or decodes) in this forward, in `sample_req_ids` order.
    """

    req_ids: tuple[str, ...]
    input_ids: mx.array
    positions: mx.array
    slot_mapping: mx.array
    logits_indices: mx.array
    sample_req_ids: tuple[str, ...]
    attn: AttentionMetadata

    @property
    def num_tokens(self) -> int:
        return self.attn.num_tokens


def build_batch_metadata(
    requests: Sequence[ScheduledRequest], block_size: int, num_blocks: int
) -> BatchMetadata:
    """Turn the scheduler's decisions into one forward's metadata; raises ValueError naming the field."""
    if not requests:
        raise ValueError("requests: a forward needs at least one scheduled request")
    seen: set[str] = set()
    for r in requests:
        if r.req_id in seen:
            raise ValueError(f"req_id: {r.req_id!r} is scheduled twice in one forward")
        seen.add(r.req_id)
        if r.num_computed_tokens < 0:
            raise ValueError(f"num_computed_tokens: {r.req_id!r} has {r.num_computed_tokens} < 0")
        if r.num_computed_tokens > len(r.token_ids):
            raise ValueError(
                f"num_computed_tokens: {r.req_id!r} claims {r.num_computed_tokens} computed "
                f"tokens but only {len(r.token_ids)} are known"
            )
        if r.num_scheduled_tokens < 1:
            raise ValueError(
                f"num_scheduled_tokens: {r.req_id!r} is scheduled with {r.num_scheduled_tokens}"
            )
        if r.num_computed_tokens + r.num_scheduled_tokens > len(r.token_ids):
            raise ValueError(
                f"num_scheduled_tokens: {r.req_id!r} schedules tokens up to "
                f"{r.num_computed_tokens + r.num_scheduled_tokens} but only "
                f"{len(r.token_ids)} are known"
            )
        if not 0 < r.num_prompt_tokens <= len(r.token_ids):
            raise ValueError(
                f"num_prompt_tokens: {r.req_id!r} has {r.num_prompt_tokens} prompt tokens "
                f"of {len(r.token_ids)} known"
            )

    attn = build_attention_metadata(
        q_lens=[r.num_scheduled_tokens for r in requests],
        context_lens=[r.num_computed_tokens for r in requests],
        block_tables=[r.block_ids for r in requests],
        block_size=block_size,
        num_blocks=num_blocks,
    )
    input_ids, positions, sample_rows, sample_ids = [], [], [], []
    for s, r in enumerate(requests):
        start, end = r.num_computed_tokens, r.num_computed_tokens + r.num_scheduled_tokens
        input_ids.extend(r.token_ids[start:end])
        positions.append(np.arange(start, end))
        # A chunk that stops short of the prompt's end produces no token.
        if end >= r.num_prompt_tokens:
            sample_rows.append(int(attn.cu_seqlens_q_host[s + 1]) - 1)
            sample_ids.append(r.req_id)
    pos = np.concatenate(positions)
    seq_of_token = np.repeat(np.arange(attn.num_seqs), attn.q_lens_host)
    blocks = attn.block_tables_host[seq_of_token, pos // block_size].astype(np.int64)
    slots = blocks * block_size + pos % block_size
    return BatchMetadata(
        req_ids=tuple(r.req_id for r in requests),
        input_ids=mx.array(np.asarray(input_ids, dtype=np.int32)),
        positions=mx.array(pos.astype(np.int32)),
        slot_mapping=mx.array(slots),
        logits_indices=mx.array(np.asarray(sample_rows, dtype=np.int32)),
        sample_req_ids=tuple(sample_ids),
        attn=attn,
    )
