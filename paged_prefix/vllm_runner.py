"""The vLLM boundary: vLLM's model-runner contract on top of `PagedModelRunner`.

    initialize_kv_cache(KVCacheConfig)           allocate the paged cache vLLM sized
    run_forward(SchedulerOutput) -> None         the forward; output follows in sample_tokens
                                   | ModelRunnerOutput   (nothing scheduled: no sampling step)
    sample_tokens(grammar_output) -> ModelRunnerOutput
    execute_model(SchedulerOutput) -> ModelRunnerOutput   both, for the offline engine

`run_forward` + `sample_tokens` is the split vLLM's workers use (vllm-metal's runner too):
it serves both synchronous and asynchronous scheduling. Sampling is vLLM's own Sampler
(`vllm_sampling.py`), so temperature 0 gives exactly the argmax of the logits.

The scheduler owns prefix caching: it hashes blocks, finds hits and hands each request
`num_computed_tokens` with the hit blocks first in `block_ids`. This runner keeps only what
the scheduler does not resend each step (token ids, block ids, sampling state) and computes
exactly the tokens it was told to, starting at `num_computed_tokens`.

A step is all or nothing: every change the SchedulerOutput makes to the request states is
applied to copies and checked (unknown ids, empty or out-of-vocabulary prompts, non-integer
ids, sampling options naming ids outside the vocabulary, a running request's computed count
other than what this runner computed, a write into a block another live request holds: a
ValueError naming the field), the batch metadata is built, and only after the forward has
succeeded are the copies committed. A step that raises leaves the request states as they
were; the forward itself writes no cache row before its own checks pass.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import torch
from vllm.config import VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import GrammarOutput, NewRequestData, SchedulerOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, LogprobsLists, ModelRunnerOutput

from .dispatch import Dispatcher
from .kv_cache import PagedKVCache
from .metadata import BatchMetadata, ScheduledRequest, build_batch_metadata
from .runner import PagedModelRunner
from .validate import as_ints
from .vllm_sampling import (
    BatchSampler,
    SamplingRow,
    make_generator,
    token_id_options,
    unsupported_reason,
)

logger = logging.getLogger(__name__)

TORCH_TO_MLX = {torch.float16: mx.float16, torch.bfloat16: mx.bfloat16, torch.float32: mx.float32}


@dataclass(frozen=True)
class _Request:
    prompt_token_ids: tuple[int, ...]
    output_token_ids: list[int]  # grows by one per sampled token, after a step succeeded
    block_ids: tuple[int, ...]
    params: SamplingParams
    generator: torch.Generator | None  # seeded requests only; survives preemption
    num_computed: int  # tokens whose K/V this runner has written (or the scheduler's hit)

    @property
    def token_ids(self) -> list[int]:
        return [*self.prompt_token_ids, *self.output_token_ids]


@dataclass(frozen=True)
class _Step:
    """One step, planned and checked; nothing of it is committed yet."""

    requests: dict[str, _Request]  # every live request's state once this step is applied
    req_ids: list[str]  # scheduled, in the scheduler's order (ModelRunnerOutput's order)
    meta: BatchMetadata


class VllmModelRunner:
    def __init__(self, model: nn.Module, dispatcher: Dispatcher | None = None,
                 vllm_config: VllmConfig | None = None):
        self.model = model
        self.dispatcher = dispatcher
        self.vocab_size = model.args.vocab_size
        self.sampler = BatchSampler(self.vocab_size, vllm_config or VllmConfig())
        self.runner: PagedModelRunner | None = None
        self.requests: dict[str, _Request] = {}
        self._pending: tuple[_Step, mx.array] | None = None
        self._last_step_end: float | None = None  # for the debug log's time between steps

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1 or not isinstance(groups[0].kv_cache_spec, FullAttentionSpec):
            raise ValueError("kv_cache_config: exactly one full-attention KV-cache group is supported")
        spec = groups[0].kv_cache_spec
        if spec.dtype not in TORCH_TO_MLX:
            raise ValueError(f"kv_cache_config: dtype {spec.dtype} is not one of {list(TORCH_TO_MLX)}")
        if len(groups[0].layer_names) != len(self.model.layers):
            raise ValueError(f"kv_cache_config: {len(groups[0].layer_names)} layers for a "
                             f"{len(self.model.layers)}-layer model")
        cache = PagedKVCache(
            num_layers=len(self.model.layers),
            num_blocks=kv_cache_config.num_blocks,
            block_size=spec.block_size,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_size,
            dtype=TORCH_TO_MLX[spec.dtype],
        )
        self.runner = PagedModelRunner(self.model, cache, self.dispatcher)

    def warm_up_limit(self) -> int:
        """The longest prefill `warm_up` can run in this cache: its two requests (the prefill,
        and a decode row one token longer) each need their own blocks."""
        if self.runner is None:
            raise ValueError("initialize_kv_cache must run before warm_up_limit")
        cache = self.runner.kv_cache
        return cache.num_blocks // 2 * cache.block_size - 1

    def warm_up(self, num_tokens: int) -> None:
        """Real forwards (a `num_tokens` prefill and a decode row, two decode rows alone, then
        the prefill again with its first half cached) and their sampling, greedy and at random
        with penalties and logprobs, before the first request: one-time costs (kernel builds,
        the sampler's compiled helpers) stay out of its latency. It writes only into blocks
        that no request can own yet and leaves no request state."""
        if self.runner is None:
            raise ValueError("initialize_kv_cache must run before warm_up")
        cache = self.runner.kv_cache
        per_request = -(-(num_tokens + 1) // cache.block_size)
        if 2 * per_request > cache.num_blocks:
            raise ValueError(f"num_tokens: a warm-up of {num_tokens} tokens needs "
                             f"{2 * per_request} blocks, the cache has {cache.num_blocks}")
        tokens = [i % self.vocab_size for i in range(num_tokens + 1)]
        # Every other block: a long prefill's rows then land in many runs of slots, so its
        # cache writes take the scatter (MLX's CUDA backend compiles its scatter kernels with
        # NVRTC on first use), while the decode rows' two runs take the slice updates.
        first, second = list(range(0, 2 * per_request, 2)), list(range(1, 2 * per_request, 2))
        meta = build_batch_metadata([
            ScheduledRequest("warmup-prefill", tokens[:num_tokens], num_tokens, 0, num_tokens,
                             first),
            ScheduledRequest("warmup-decode", tokens, num_tokens, num_tokens, 1, second),
        ], cache.block_size, cache.num_blocks, vocab_size=self.vocab_size)
        logits = self.runner.forward(meta)
        mx.eval(logits, cache.arrays())
        # decode rows alone, as most serving steps are (their own tile plans and MLX kernels)
        decode = build_batch_metadata([
            ScheduledRequest(f"warmup-decode-{i}", tokens, num_tokens, num_tokens, 1, part)
            for i, part in enumerate((first, second))
        ], cache.block_size, cache.num_blocks, vocab_size=self.vocab_size)
        mx.eval(self.runner.forward(decode), cache.arrays())
        hit = num_tokens // 2 // cache.block_size * cache.block_size
        if hit:  # the cached-prefix path too: the prompt again, its first half read back
            again = build_batch_metadata([ScheduledRequest(
                "warmup-hit", tokens[:num_tokens], num_tokens, hit, num_tokens - hit, first)],
                cache.block_size, cache.num_blocks, vocab_size=self.vocab_size)
            mx.eval(self.runner.forward(again), cache.arrays())
        varied = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, min_p=0.05, seed=0,
                                repetition_penalty=1.1, logprobs=2)
        rows = [SamplingRow(SamplingParams(temperature=0.0), tokens[:num_tokens], [], None),
                SamplingRow(varied, tokens[:num_tokens], [tokens[-1]], make_generator(varied))]
        self.sampler.sample(logits, rows)

    # -- the step -----------------------------------------------------------------------
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Forward and sampling in one call (the offline engine's loop)."""
        out = self.run_forward(scheduler_output)
        return out if out is not None else self.sample_tokens(None)

    def run_forward(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """Run the step's forward and commit its request changes; `sample_tokens` follows
        unless this returns an output (no token was scheduled: only state changes)."""
        if self.runner is None:
            raise ValueError("initialize_kv_cache must run before execute_model")
        if self._pending is not None:
            raise ValueError("sample_tokens: the previous forward's tokens were never sampled")
        requests, req_ids, computed = self._plan(scheduler_output)
        if not req_ids:
            self.requests = requests
            return EMPTY_MODEL_RUNNER_OUTPUT
        meta = self._metadata(requests, req_ids, computed, scheduler_output)
        self._check_block_owners(requests, meta)
        if len(meta.sample_req_ids) > self.sampler.max_rows:
            raise ValueError(f"num_scheduled_tokens: {len(meta.sample_req_ids)} requests sample "
                             f"in this step, more than max_num_seqs={self.sampler.max_rows}")
        for s, r in enumerate(req_ids):  # after this forward, its K/V reach seq_lens[s]
            requests[r] = dataclasses.replace(requests[r],
                                              num_computed=int(meta.attn.seq_lens_host[s]))
        start = time.perf_counter()
        logits = self.runner.forward(meta)
        built = time.perf_counter()
        mx.eval(logits, self.runner.kv_cache.arrays())  # the forward's one host sync
        if logger.isEnabledFor(logging.DEBUG):  # where a step's time goes, for TTFT questions
            q = meta.attn.q_lens_host
            idle = "" if self._last_step_end is None else \
                f", {1e3 * (start - self._last_step_end):.1f} ms after the last step"
            logger.debug("step: %d sequences (%d of one token), %d tokens after %d already in the "
                         "cache, %s; forward %.1f ms (%.1f ms of it building the "
                         "graph)%s", len(q), int((q == 1).sum()), int(q.sum()),
                         int(meta.attn.context_lens_host.sum()),
                         self._attention(), 1e3 * (time.perf_counter() - start),
                         1e3 * (built - start), idle)
        self.requests = requests
        self._pending = (_Step(requests, req_ids, meta), logits)
        return None

    def _attention(self) -> str:
        """The last forward's attention path, and for SDPA where its K/V came from."""
        d = self.runner.dispatcher
        sources = d.last.summary()
        return f"{d.last.path} attention" + (f" (sequences: {sources})" if sources else "")

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        """Sample the pending forward's rows with vLLM's Sampler, constrained by the
        structured-output requests' grammar bitmask when there is one; append the tokens."""
        if self._pending is None:
            raise ValueError("sample_tokens: no forward is pending (run_forward first)")
        (step, logits), self._pending = self._pending, None
        sample_ids = step.meta.sample_req_ids
        sampled: dict[str, int] = {}
        logprobs = None
        start = time.perf_counter()
        if sample_ids:
            rows = [self._row(step.requests[r]) for r in sample_ids]
            out = self.sampler.sample(logits, rows, _grammar_rows(grammar_output, sample_ids))
            sampled = dict(zip(sample_ids, out.sampled_token_ids[:, 0].tolist()))
            if out.logprobs_tensors is not None:
                logprobs = _in_output_order(out.logprobs_tensors.tolists(), sample_ids, step.req_ids)
        for req_id, token in sampled.items():
            step.requests[req_id].output_token_ids.append(token)
        self._last_step_end = time.perf_counter()
        logger.debug("step: sampled %d rows in %.1f ms", len(sample_ids),
                     1e3 * (self._last_step_end - start))
        return ModelRunnerOutput(
            req_ids=step.req_ids,
            req_id_to_index={r: i for i, r in enumerate(step.req_ids)},
            sampled_token_ids=[[sampled[r]] if r in sampled else [] for r in step.req_ids],
            logprobs=logprobs,
        )

    # -- planning (no side effects) -----------------------------------------------------
    def _plan(self, so: SchedulerOutput
              ) -> tuple[dict[str, _Request], list[str], dict[str, int]]:
        """The request states after this step's changes, as new objects, the scheduled ids
        and each one's computed tokens (the scheduler's count); self is untouched."""
        for field_name in ("scheduled_spec_decode_tokens", "scheduled_encoder_inputs",
                           "kv_cache_block_copies", "new_block_ids_to_zero"):
            if getattr(so, field_name, None):
                raise ValueError(f"{field_name}: not supported by this runner (speculative "
                                 "decoding, multimodal inputs and KV block copies are refused "
                                 "at startup)")
        requests = {r: s for r, s in self.requests.items() if r not in so.finished_req_ids}
        for req_id in so.preempted_req_ids or ():  # vLLM freed their blocks
            if req_id in requests:
                requests[req_id] = dataclasses.replace(requests[req_id], block_ids=())
        computed: dict[str, int] = {}
        for new in so.scheduled_new_reqs:
            if new.req_id in requests:
                raise ValueError(f"scheduled_new_reqs: {new.req_id!r} is already running")
            requests[new.req_id] = self._admit(new)
            computed[new.req_id] = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        n = len(cached.req_ids)
        if len(cached.new_block_ids) != n or len(cached.num_computed_tokens) != n:
            raise ValueError(f"scheduled_cached_reqs: {n} req_ids but "
                             f"{len(cached.new_block_ids)} new_block_ids and "
                             f"{len(cached.num_computed_tokens)} num_computed_tokens")
        strays = sorted(set(cached.resumed_req_ids) - set(cached.req_ids))
        if strays:
            raise ValueError(f"resumed_req_ids: {strays} are not among "
                             "scheduled_cached_reqs.req_ids")
        for i, req_id in enumerate(cached.req_ids):
            if req_id not in requests:
                raise ValueError(f"scheduled_cached_reqs: unknown request id {req_id!r}")
            if req_id in computed:
                raise ValueError(f"scheduled_cached_reqs: {req_id!r} is listed twice in one step")
            state = self._update(requests[req_id], req_id, cached, i)
            count = cached.num_computed_tokens[i]
            # a running request continues where this runner stopped; a resumed one restarts
            # from the scheduler's (new) hit
            if req_id not in cached.resumed_req_ids and count != state.num_computed:
                raise ValueError(f"num_computed_tokens: {req_id!r} has {count!r} by the "
                                 f"scheduler's count, but this runner computed "
                                 f"{state.num_computed}")
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
        return requests, req_ids, computed

    def _admit(self, new: NewRequestData) -> _Request:
        rid = new.req_id
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
        prompt = as_ints(new.prompt_token_ids, f"prompt_token_ids ({rid!r})", low=0,
                         high=self.vocab_size - 1)
        if not isinstance(new.sampling_params, SamplingParams):
            raise ValueError(f"sampling_params: request {rid!r} has none (only generation is "
                             "supported)")
        if (refused := unsupported_reason(new.sampling_params)) is not None:
            raise ValueError(f"{refused[0]}: request {rid!r}: {refused[1]}")
        for name, ids in token_id_options(new.sampling_params).items():
            as_ints(ids, f"{name} ({rid!r})", low=0, high=self.vocab_size - 1)
        logprobs = new.sampling_params.logprobs
        if logprobs is not None and logprobs > self.vocab_size:
            raise ValueError(f"logprobs ({rid!r}): {logprobs} exceeds the vocabulary of "
                             f"{self.vocab_size}")
        return _Request(tuple(prompt.tolist()), [], self._blocks(new.block_ids, rid),
                        new.sampling_params, make_generator(new.sampling_params),
                        new.num_computed_tokens)

    def _update(self, state: _Request, req_id: str, cached, i: int) -> _Request:
        new_blocks = cached.new_block_ids[i]
        if req_id in cached.resumed_req_ids:
            # A preempted request comes back with a fresh block list (maybe a new hit)
            # and, from the scheduler, every token it knows.
            state = dataclasses.replace(state, block_ids=self._blocks(new_blocks, req_id))
            if req_id in cached.all_token_ids:
                known = as_ints(cached.all_token_ids[req_id], f"all_token_ids ({req_id!r})",
                                low=0, high=self.vocab_size - 1).tolist()
                if tuple(known[:len(state.prompt_token_ids)]) != state.prompt_token_ids:
                    raise ValueError(f"all_token_ids: {req_id!r} resumes with another prompt")
                state = dataclasses.replace(state,
                                            output_token_ids=known[len(state.prompt_token_ids):])
            return state
        if new_blocks is not None:  # None: no new block this step
            added = self._blocks(new_blocks, req_id)
            state = dataclasses.replace(state, block_ids=state.block_ids + added)
        return state

    def _blocks(self, groups, req_id: str) -> tuple[int, ...]:
        """One KV-cache group's block ids, each a block of this runner's pool."""
        if not isinstance(groups, (tuple, list)) or len(groups) != 1:
            raise ValueError(f"block_ids: request {req_id!r} must carry exactly one KV-cache "
                             f"group's block list, got {groups!r}")
        return tuple(as_ints(groups[0], f"block_ids ({req_id!r})", low=0,
                             high=self.runner.kv_cache.num_blocks - 1).tolist())

    def _metadata(self, requests: dict[str, _Request], req_ids: list[str],
                  computed: dict[str, int], so: SchedulerOutput) -> BatchMetadata:
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
        cache = self.runner.kv_cache
        meta = build_batch_metadata(scheduled, cache.block_size, cache.num_blocks,
                                    vocab_size=self.vocab_size)
        if so.total_num_scheduled_tokens != meta.num_tokens:
            raise ValueError(f"total_num_scheduled_tokens: {so.total_num_scheduled_tokens!r}, "
                             f"but num_scheduled_tokens sums to {meta.num_tokens}")
        return meta

    def _check_block_owners(self, requests: dict[str, _Request], meta: BatchMetadata) -> None:
        """A block this forward writes belongs to its writer: no live request outside the
        forward may hold it (vLLM hands out only free blocks to write; within the forward,
        the metadata checked every shared read)."""
        written = np.unique(meta.slot_mapping_host // meta.attn.block_size)
        in_forward = set(meta.req_ids)
        for req_id, state in requests.items():
            if req_id in in_forward or not state.block_ids:
                continue
            held = np.intersect1d(written, state.block_ids)
            if held.size:
                raise ValueError(f"block_ids: this step writes block {int(held[0])}, which "
                                 f"running request {req_id!r} holds")

    @staticmethod
    def _row(state: _Request) -> SamplingRow:
        return SamplingRow(state.params, state.prompt_token_ids, state.output_token_ids,
                           state.generator)


def _grammar_rows(grammar: GrammarOutput | None, sample_ids) -> dict[int, np.ndarray] | None:
    """The bitmask rows of the structured-output requests that sample in this step, keyed by
    their sampling row (a request still mid-prompt has a bitmask row but samples nothing)."""
    if grammar is None:
        return None
    row_of = {r: i for i, r in enumerate(sample_ids)}
    return {row_of[r]: grammar.grammar_bitmask[k]
            for k, r in enumerate(grammar.structured_output_request_ids) if r in row_of}


def _in_output_order(lists: LogprobsLists, sample_ids, req_ids: list[str]) -> LogprobsLists:
    """Sampler rows follow `sample_ids`; the scheduler reads row `req_id_to_index[req]`."""
    row_of = {r: i for i, r in enumerate(sample_ids)}
    order = [row_of.get(r, 0) for r in req_ids]  # rows of non-sampling requests are never read
    return LogprobsLists(lists.logprob_token_ids[order], lists.logprobs[order],
                         lists.sampled_token_ranks[order])
