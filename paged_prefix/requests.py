"""Request state at the vLLM boundary: plain data and pure functions, no model.

vLLM's scheduler resends only what changed in each step; what it does not resend (token ids,
block ids, sampling state) is kept here, one frozen `RequestState` per live request.
`plan_step` applies one SchedulerOutput to the live states and returns the states as the step
will leave them, the scheduled requests in the scheduler's order and the forward's metadata;
it changes none of its inputs. It is where the scheduler's input is checked, once: unknown
ids, empty or out-of-vocabulary prompts, non-integer ids, sampling options naming ids outside
the vocabulary, a running request's computed count other than what this runner computed, a
write into a block another live request holds, a block list per KV-cache group, vLLM's null
block (id 0) never written nor read. Each is a ValueError naming the field.

vLLM does not tell the runner when it frees a running request's blocks outside a sliding
window (it puts its null block in its own copy of the list): the runner's lists keep the old
ids, and a request holds, in a windowed group, only the blocks from its next query's first
visible key on (`reference.key_start` of the tokens it has computed).
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

from reference import key_start

from .hybrid_groups import HybridLimits, rows_of, step_states
from .metadata import BatchMetadata, ScheduledRequest, build_batch_metadata
from .validate import as_ints
from .vllm_sampling import make_generator, token_id_options, unsupported_reason

# What the host reads for a sampled token whose value is still on the device: the forward reads
# the token itself there (`BatchMetadata.input_ids`), this only keeps the host's lists in step.
PENDING_TOKEN = 0


class TokenIds(Sequence):
    """A request's known tokens read in place: the prompt, the outputs, then PENDING_TOKEN for
    each pending one. A step slices out only what it schedules (one token a decode step), so
    no step copies a request's whole context."""

    __slots__ = ("_prompt", "_output", "_pending")

    def __init__(self, prompt: tuple[int, ...], output: tuple[int, ...], pending: int):
        self._prompt, self._output, self._pending = prompt, output, pending

    def __len__(self) -> int:
        return len(self._prompt) + len(self._output) + self._pending

    def __iter__(self):
        return itertools.chain(self._prompt, self._output, (PENDING_TOKEN,) * self._pending)

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, stride = index.indices(len(self))
            if stride != 1:
                return list(self)[index]
            p = len(self._prompt)
            pending = max(0, stop - max(start, p + len(self._output)))
            return [*self._prompt[start:stop], *self._output[max(start - p, 0):max(stop - p, 0)],
                    *(PENDING_TOKEN,) * pending]
        i = operator.index(index)
        if not -len(self) <= i < len(self):
            raise IndexError(f"token index {i} out of range for {len(self)} tokens")
        i %= len(self)
        for part in (self._prompt, self._output):
            if i < len(part):
                return part[i]
            i -= len(part)
        return PENDING_TOKEN

    def __eq__(self, other) -> bool:
        if isinstance(other, (TokenIds, list, tuple)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __repr__(self) -> str:
        return f"TokenIds({list(self)!r})"


@dataclass(frozen=True)
class RequestState:
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]  # one more per sampled token, once its value is known
    block_ids: tuple[tuple[int, ...], ...]  # per KV-cache group
    params: SamplingParams
    generator: torch.Generator | None  # seeded requests only; survives preemption
    num_computed: int  # tokens whose K/V are in the cache (this runner's, or the scheduler's hit)
    # a hybrid model's state rows, per state group in vLLM's block ids (block_ids then holds
    # its attention row in kernel block ids: `hybrid_groups.rows_of`)
    state_rows: tuple[tuple[int, ...], ...] = ()
    # tokens sampled on the device whose values the host has not read yet (0 or 1): they follow
    # output_token_ids, as PENDING_TOKEN in token_ids
    pending: int = 0

    @property
    def token_ids(self) -> TokenIds:
        return TokenIds(self.prompt_token_ids, self.output_token_ids, self.pending)

    def replaced(self, **changes) -> RequestState:
        """`dataclasses.replace` without running __init__ over every field again (it checks
        nothing): a step replaces each of its requests' states two or three times, and
        `replace` costs three times as much."""
        unknown = changes.keys() - self.__dataclass_fields__.keys()
        if unknown:
            raise TypeError(f"RequestState has no field {sorted(unknown)}")
        state = object.__new__(RequestState)
        state.__dict__.update(self.__dict__, **changes)
        return state


@dataclass(frozen=True)
class Limits:
    """What the scheduler's ids are checked against."""

    vocab_size: int
    block_size: int
    num_blocks: int
    max_sampling_rows: int  # the sampler's rows: max_num_seqs
    windows: tuple[int | None, ...] = (None,)  # per KV-cache group (`PagedKVCache.windows`)
    hybrid: HybridLimits | None = None  # a hybrid model's groups (`hybrid_groups.py`)


NULL_BLOCK = 0  # vLLM's block pool hands out block 0 to no request: its placeholder


@dataclass(frozen=True)
class StepPlan:
    """One step, planned and checked; nothing of it is committed yet."""

    requests: dict[str, RequestState]  # every live request once this step has run
    req_ids: list[str]  # scheduled, in the scheduler's order (ModelRunnerOutput's order)
    meta: BatchMetadata | None  # None: no token is scheduled


def block_ids(groups, req_id: str, limits: Limits) -> tuple[tuple[tuple[int, ...], ...], tuple]:
    """(one block list per KV-cache group, state rows), each id a block of the pool; a hybrid
    model's lists split into its attention group's (kernel block ids) and its state groups'
    (`hybrid_groups.rows_of`)."""
    if limits.hybrid is not None:
        attention, states = rows_of(groups, req_id, limits.hybrid)
        return (tuple(attention),), states
    n = len(limits.windows)
    if not isinstance(groups, (tuple, list)) or len(groups) != n:
        raise ValueError(f"block_ids: request {req_id!r} must carry one block list per "
                         f"KV-cache group ({n}), got {groups!r}")
    return tuple(tuple(as_ints(ids, f"block_ids ({req_id!r}, group {g})", low=0,
                               high=limits.num_blocks - 1).tolist())
                 for g, ids in enumerate(groups)), ()


def admit(new: NewRequestData, limits: Limits) -> RequestState:
    """A new request's state, from the scheduler's copy of it (whose lists stay its own)."""
    rid, vocab = new.req_id, limits.vocab_size
    for name, used in (("prompt_embeds", new.prompt_embeds is not None),
                       ("mm_features", bool(new.mm_features)),
                       ("lora_request", new.lora_request is not None),
                       ("pooling_params", new.pooling_params is not None)):
        if used:
            raise ValueError(f"{name}: request {rid!r} uses a feature this runner does not "
                             "support")
    if new.prompt_token_ids is None:
        raise ValueError(f"prompt_token_ids: request {rid!r} has none (embeddings input "
                         "is not supported)")
    if len(new.prompt_token_ids) == 0:
        raise ValueError(f"prompt_token_ids: request {rid!r} has an empty prompt")
    prompt = as_ints(new.prompt_token_ids, f"prompt_token_ids ({rid!r})", low=0, high=vocab - 1)
    if not isinstance(new.sampling_params, SamplingParams):
        raise ValueError(f"sampling_params: request {rid!r} has none (only generation is "
                         "supported)")
    if (refused := unsupported_reason(new.sampling_params)) is not None:
        raise ValueError(f"{refused[0]}: request {rid!r}: {refused[1]}")
    for name, ids in token_id_options(new.sampling_params).items():
        as_ints(ids, f"{name} ({rid!r})", low=0, high=vocab - 1)
    logprobs = new.sampling_params.logprobs
    if logprobs is not None and logprobs > vocab:
        raise ValueError(f"logprobs ({rid!r}): {logprobs} exceeds the vocabulary of {vocab}")
    attention, states = block_ids(new.block_ids, rid, limits)
    return RequestState(tuple(prompt.tolist()), (), attention, new.sampling_params,
                        make_generator(new.sampling_params), new.num_computed_tokens, states)


def update(state: RequestState, req_id: str, cached: CachedRequestData, i: int,
           limits: Limits) -> RequestState:
    """A running request's state after entry `i` of the step's cached requests."""
    new_blocks = cached.new_block_ids[i]
    if req_id in cached.resumed_req_ids:
        # A preempted request comes back with a fresh block list (maybe a new hit) and,
        # from the scheduler, every token it knows.
        attention, states = block_ids(new_blocks, req_id, limits)
        state = state.replaced(block_ids=attention, state_rows=states)
        if req_id in cached.all_token_ids:
            known = as_ints(cached.all_token_ids[req_id], f"all_token_ids ({req_id!r})",
                            low=0, high=limits.vocab_size - 1).tolist()
            prompt_len = len(state.prompt_token_ids)
            if tuple(known[:prompt_len]) != state.prompt_token_ids:
                raise ValueError(f"all_token_ids: {req_id!r} resumes with another prompt")
            state = state.replaced(output_token_ids=tuple(known[prompt_len:]), pending=0)
        return state
    if new_blocks is not None:  # None: no new block this step
        added, states = block_ids(new_blocks, req_id, limits)
        state = state.replaced(block_ids=tuple(
            held + more for held, more in zip(state.block_ids, added)), state_rows=tuple(
            row + more for row, more in zip(state.state_rows, states, strict=True)))
    return state


def plan_step(live: Mapping[str, RequestState], so: SchedulerOutput, limits: Limits,
              ledger: Mapping | None = None) -> StepPlan:
    """The step `so` over the `live` request states, checked; `live` is left as it was.
    ledger: a hybrid model's count of what each state block holds (`state_metadata.py`)."""
    refused = ["scheduled_spec_decode_tokens", "scheduled_encoder_inputs",
               "kv_cache_block_copies"]
    # vLLM zeroes new attention blocks of a hybrid model because its pages alias the state
    # blocks'; here states live apart (docs/hybrid.md), so K/V arrays only ever hold K/V
    if limits.hybrid is None:
        refused.append("new_block_ids_to_zero")
    for field_name in refused:
        if getattr(so, field_name, None):
            raise ValueError(f"{field_name}: not supported by this runner (speculative "
                             "decoding, multimodal inputs and KV block copies are refused "
                             "at startup)")
    requests = {r: s for r, s in live.items() if r not in so.finished_req_ids}
    for req_id in so.preempted_req_ids or ():  # vLLM freed their blocks
        if req_id in requests:
            requests[req_id] = requests[req_id].replaced(block_ids=((),) * len(limits.windows),
                                                         state_rows=())
    computed: dict[str, int] = {}  # the scheduler's count, per request of this step
    for new in so.scheduled_new_reqs:
        if new.req_id in requests:
            raise ValueError(f"scheduled_new_reqs: {new.req_id!r} is already running")
        requests[new.req_id] = admit(new, limits)
        computed[new.req_id] = new.num_computed_tokens
    cached = so.scheduled_cached_reqs
    n = len(cached.req_ids)
    if len(cached.new_block_ids) != n or len(cached.num_computed_tokens) != n:
        raise ValueError(f"scheduled_cached_reqs: {n} req_ids but "
                         f"{len(cached.new_block_ids)} new_block_ids and "
                         f"{len(cached.num_computed_tokens)} num_computed_tokens")
    strays = sorted(set(cached.resumed_req_ids) - set(cached.req_ids))
    if strays:
        raise ValueError(f"resumed_req_ids: {strays} are not among scheduled_cached_reqs.req_ids")
    for i, req_id in enumerate(cached.req_ids):
        if req_id not in requests:
            raise ValueError(f"scheduled_cached_reqs: unknown request id {req_id!r}")
        if req_id in computed:
            raise ValueError(f"scheduled_cached_reqs: {req_id!r} is listed twice in one step")
        state = update(requests[req_id], req_id, cached, i, limits)
        count = cached.num_computed_tokens[i]
        # a running request continues where this runner stopped; a resumed one restarts
        # from the scheduler's (new) hit
        if req_id not in cached.resumed_req_ids and count != state.num_computed:
            raise ValueError(f"num_computed_tokens: {req_id!r} has {count!r} by the "
                             f"scheduler's count, but this runner computed {state.num_computed}")
        requests[req_id], computed[req_id] = state, count
    req_ids = list(so.num_scheduled_tokens)
    unknown = [r for r in req_ids if r not in requests]
    if unknown:
        raise ValueError(f"num_scheduled_tokens: unknown request ids {unknown}")
    missing = [r for r in req_ids if r not in computed]
    if missing:
        raise ValueError(f"num_scheduled_tokens: {missing} are neither new nor cached "
                         "requests of this step")
    unscheduled = [r for r in computed if r not in so.num_scheduled_tokens]
    if unscheduled:
        raise ValueError(f"num_scheduled_tokens: {unscheduled} are requests of this step "
                         "with no tokens scheduled")
    if not req_ids:
        return StepPlan(requests, req_ids, None)
    meta = _metadata(requests, req_ids, computed, so, limits)
    if limits.hybrid is not None:
        meta = dataclasses.replace(meta, states=step_states(
            requests, req_ids, computed, so.num_scheduled_tokens, limits.hybrid, ledger or {}))
    _check_null_block(meta)
    _check_block_owners(requests, meta, limits)
    if len(meta.sample_req_ids) > limits.max_sampling_rows:
        raise ValueError(f"num_scheduled_tokens: {len(meta.sample_req_ids)} requests sample "
                         f"in this step, more than max_num_seqs={limits.max_sampling_rows}")
    seq_lens = meta.groups[0].attn.seq_lens_host
    for s, r in enumerate(req_ids):  # after this forward, its K/V reach seq_lens[s]
        requests[r] = requests[r].replaced(num_computed=int(seq_lens[s]))
    return StepPlan(requests, req_ids, meta)


def with_sampled(requests: Mapping[str, RequestState],
                 sampled: Mapping[str, int]) -> dict[str, RequestState]:
    """The states with each sampled token appended to its request's output."""
    return {r: s.replaced(output_token_ids=(*s.output_token_ids, sampled[r]))
            if r in sampled else s for r, s in requests.items()}


def with_pending(requests: Mapping[str, RequestState],
                 req_ids: Sequence[str]) -> dict[str, RequestState]:
    """The states with a token sampled on the device, value not yet read, for each of
    `req_ids`; ValueError for a request whose previous one is still unread."""
    unread = [r for r in req_ids if requests[r].pending]
    if unread:
        raise ValueError(f"sampled tokens: {unread} have a sampled token not yet read")
    picked = set(req_ids)
    return {r: s.replaced(pending=1) if r in picked else s for r, s in requests.items()}


def with_read(requests: Mapping[str, RequestState],
              sampled: Mapping[str, int]) -> dict[str, RequestState]:
    """The states with the pending tokens' values, now read, in place of PENDING_TOKEN; a
    request that has none (finished, or resumed with the scheduler's tokens) is left as it is."""
    return {r: s.replaced(output_token_ids=(*s.output_token_ids, sampled[r]), pending=0)
            if r in sampled and s.pending else s for r, s in requests.items()}


def _metadata(requests: Mapping[str, RequestState], req_ids: list[str],
              computed: Mapping[str, int], so: SchedulerOutput, limits: Limits) -> BatchMetadata:
    scheduled = [
        ScheduledRequest(
            req_id=r,
            token_ids=requests[r].token_ids,
            num_prompt_tokens=len(requests[r].prompt_token_ids),
            num_computed_tokens=computed[r],
            num_scheduled_tokens=so.num_scheduled_tokens[r],
            block_ids=requests[r].block_ids,
        )
        for r in req_ids
    ]
    meta = build_batch_metadata(scheduled, limits.block_size, limits.num_blocks,
                                vocab_size=limits.vocab_size, windows=limits.windows)
    if so.total_num_scheduled_tokens != meta.num_tokens:
        raise ValueError(f"total_num_scheduled_tokens: {so.total_num_scheduled_tokens!r}, "
                         f"but num_scheduled_tokens sums to {meta.num_tokens}")
    return meta


def _check_null_block(meta: BatchMetadata) -> None:
    """vLLM's null block stands for blocks a windowed group freed: a forward never writes it,
    nor reads it where a query sees its keys."""
    for g, group in enumerate(meta.groups):
        live = group.attn.live_blocks()
        at = np.flatnonzero(live[:, 1] == NULL_BLOCK)
        if at.size:
            where = "inside its window" if group.attn.window else "in its table"
            raise ValueError(f"block_ids: {meta.req_ids[live[at[0], 0]]!r} reads or writes "
                             f"vLLM's null block {NULL_BLOCK} {where} (KV-cache group {g})")


def _check_block_owners(requests: Mapping[str, RequestState], meta: BatchMetadata,
                        limits: Limits) -> None:
    """A block this forward writes belongs to its writer: no live request outside the forward
    may hold it, nor a request of the forward past its tokens, for its later ones (vLLM hands
    out only free blocks to write; within its tokens, the metadata checked every shared read).
    In a windowed group a request holds its blocks from its next query's first visible key on:
    vLLM frees those before it."""
    written = np.unique(np.concatenate([g.slot_mapping_host // g.attn.block_size
                                        for g in meta.groups]))
    in_forward = set(meta.req_ids)
    seq_lens = meta.groups[0].attn.seq_lens_host
    for s, req_id in enumerate(meta.req_ids):
        end = -(-int(seq_lens[s]) // limits.block_size)
        for g, (ids, group) in enumerate(zip(requests[req_id].block_ids, meta.groups)):
            if len(ids) > end:  # blocks past its tokens (the metadata checked those up to them)
                _check_later_blocks(req_id, g, ids[int(group.attn.live_from_host[s]):end],
                                    ids[end:], written)
    for req_id, state in requests.items():
        if req_id in in_forward:
            continue
        for ids, window in zip(state.block_ids, limits.windows):
            first = int(key_start(state.num_computed, window)) // limits.block_size
            held = np.intersect1d(written, ids[first:])
            if held.size:
                raise ValueError(f"block_ids: this step writes block {int(held[0])}, which "
                                 f"running request {req_id!r} holds")


def _check_later_blocks(req_id: str, group: int, live: Sequence[int], later: Sequence[int],
                        written: np.ndarray) -> None:
    """The blocks a request of the forward holds past its tokens are its own, once each: none
    among those it reads or writes (`live`), nor written by this step. A windowed group's blocks
    before `live` are not checked: vLLM freed them, and may hand one back to the same request."""
    seen = set(live)
    for block in later:
        if block in seen:
            raise ValueError(f"block_ids: request {req_id!r} holds block {block} twice "
                             f"(KV-cache group {group})")
        seen.add(block)
        if block in written:
            raise ValueError(f"block_ids: this step writes block {block}, which {req_id!r} "
                             "holds for its later tokens")
