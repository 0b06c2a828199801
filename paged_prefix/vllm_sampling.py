"""Sampling through vLLM's own `Sampler`, fed from MLX logits: vLLM's semantics by construction.

A forward returns float32 logits for the rows that sample (`BatchMetadata.sample_req_ids`
order). They cross to the host once (numpy, then a torch CPU view) and go through
`vllm.v1.sample.sampler.Sampler` with a `SamplingMetadata` built for exactly those rows:
greedy, temperature, top-k, top-p, min-p, per-request seeds, repetition / presence /
frequency penalties, logit bias, min_tokens, allowed and bad words, and logprobs are
vLLM's code, not a re-implementation; so are prompt logprobs (vLLM's log_softmax and top-k
over the prompt rows of a request that asks for them; `prompt_logprobs.py` keeps their
chunks). Structured output arrives as vLLM's grammar bitmask (rows computed by the engine's
xgrammar backend), applied with xgrammar before sampling as vLLM's own runners do. The
vocabulary-sized copy is the price (a few hundred KB per row), paid once per step.

Rows differ from step to step (requests finish, chunks end mid-prompt), so the built-in
logits processors get every row re-added each step; vLLM's BatchUpdate contract allows
an added row to replace whatever held its index before.

What is refused, and why, is `unsupported_reason`: both the platform (HTTP 400 at
admission) and the runner (ValueError) ask it, so the two never disagree. The sampler's rows
are the step's sampling requests in order: `grammar_rows` and `in_output_order` map vLLM's
grammar bitmask onto them and their logprobs back onto the scheduler's order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
import torch
import xgrammar
from vllm.config import VllmConfig
from vllm.sampling_params import SamplingParams, SamplingType
from vllm.v1.core.sched.output import GrammarOutput
from vllm.v1.outputs import LogprobsLists, LogprobsTensors, SamplerOutput
from vllm.v1.sample.logits_processor import BatchUpdate, build_logitsprocs
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.sampler import Sampler

# SamplingParams fields whose work happens in vLLM's GPU model runner (not in the
# Sampler or the frontend), with the reason this runner refuses them.
_UNSUPPORTED = {
    "prompt_logprob_token_ids": "scoring fixed token ids at each prompt position is not "
                                "implemented (prompt_logprobs is)",
    "thinking_token_budget": "thinking budgets are not wired into this runner",
    "trace_decode_token_ids": "trace replay is not supported",
}


def unsupported_reason(params: SamplingParams) -> tuple[str, str] | None:
    """(parameter, reason) for the first sampling option this runner cannot honour."""
    for name, reason in _UNSUPPORTED.items():
        if getattr(params, name, None) is not None:
            return name, reason
    if params.prompt_logprobs is not None and params.skip_reading_prefix_cache is False:
        # vLLM sets it for such requests unless told otherwise; a hit would leave the cached
        # prompt tokens unscored (vLLM's GPU runner returns those rows unfilled)
        return ("skip_reading_prefix_cache", "a request asking for prompt_logprobs scores "
                "every prompt token, so it cannot start from the prefix cache: leave "
                "skip_reading_prefix_cache unset or True")
    return None


def needs_sampler(params: SamplingParams) -> str | None:
    """Why vLLM's Sampler must sample this request's row, or None where its token is the argmax
    of its raw logits: greedy, no processor that changes them (penalties, logit bias,
    min_tokens, allowed or bad words; min_p, top-k and top-p leave an argmax as it is), no
    logprobs. Steps whose every row is None here are sampled on the device
    (`vllm_runner.SampledOnDevice`); a grammar bitmask is the caller's to check."""
    changed = {
        f"temperature {params.temperature}": params.sampling_type != SamplingType.GREEDY,
        "logprobs": params.logprobs is not None or params.logprob_token_ids is not None,
        "penalties": (params.presence_penalty, params.frequency_penalty,
                      params.repetition_penalty) != (0, 0, 1),
        "logit_bias": bool(params.logit_bias),
        "allowed_token_ids": bool(params.allowed_token_ids),
        "bad_words": bool(params.bad_words_token_ids),
        "min_tokens": params.min_tokens > 0,
    }
    return next((name for name, used in changed.items() if used), None)


def device_argmax(logits: mx.array) -> mx.array:
    """Each row's argmax, lazily, on the device: the first of tied maxima, as torch's argmax in
    vLLM's Sampler takes it (tests/test_serving_sampling.py checks both on ties)."""
    if logits.shape[0] == 0:
        return mx.zeros((0,), dtype=mx.uint32)
    return mx.argmax(logits, axis=-1)


def token_id_options(params: SamplingParams) -> dict[str, list]:
    """The sampling options that name token ids, by parameter. vLLM's frontend bounds each by
    the vocabulary (SamplingParams.verify and its input checks); the sampler would fail on an
    id past it only after the forward, so a runner called directly checks them first."""
    return {
        "allowed_token_ids": list(params.allowed_token_ids or ()),
        "logit_bias": list(params.logit_bias or ()),
        "stop_token_ids": list(params.stop_token_ids or ()),
        "bad_words_token_ids": [t for word in params.bad_words_token_ids or () for t in word],
        "logprob_token_ids": list(params.logprob_token_ids or ()),
    }


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """The request's own RNG when it has a seed, as vLLM's runners create it."""
    if params.sampling_type != SamplingType.RANDOM_SEED:
        return None
    generator = torch.Generator(device="cpu")
    generator.manual_seed(params.seed)
    return generator


@dataclass(frozen=True)
class SamplingRow:
    """One sampling row: the request's parameters and what its processors read."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: list[int]  # tokens generated so far (penalties, min_tokens)
    generator: torch.Generator | None


class BatchSampler:
    def __init__(self, vocab_size: int, vllm_config: VllmConfig):
        if vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        self.vocab_size = vocab_size
        self.max_rows = vllm_config.scheduler_config.max_num_seqs
        model = vllm_config.model_config
        self.logprobs_mode = model.logprobs_mode if model else "raw_logprobs"
        self.sampler = Sampler(logprobs_mode=self.logprobs_mode,
                               use_fp64_gumbel=model.use_fp64_gumbel if model else False)
        # vLLM's built-in processors only (min_tokens, logit_bias, min_p); the platform
        # refuses custom ones, whose per-request state a per-step refresh would reset.
        self.logitsprocs = build_logitsprocs(vllm_config, torch.device("cpu"), is_pin_memory=False,
                                             is_pooling_model=False)
        self._batch_size = 0

    def sample(self, logits: mx.array, rows: Sequence[SamplingRow],
               grammar: dict[int, np.ndarray] | None = None) -> SamplerOutput:
        """Sample one token per row of `logits` [len(rows), vocab] (float32); `grammar` maps
        a row to its packed token bitmask (int32 words, bit set = allowed)."""
        if logits.shape != (len(rows), self.vocab_size):
            raise ValueError(f"logits: expected shape ({len(rows)}, {self.vocab_size}), "
                             f"got {tuple(logits.shape)}")
        if len(rows) > self.max_rows:
            raise ValueError(f"rows: {len(rows)} sampling rows exceed max_num_seqs={self.max_rows}")
        self._refresh_logitsprocs(rows)
        host = torch.from_numpy(np.array(logits, dtype=np.float32))
        if grammar:
            indices = sorted(grammar)
            masks = torch.from_numpy(np.stack([grammar[i] for i in indices]).astype(np.int32))
            full = torch.full((len(rows), masks.shape[1]), -1, dtype=torch.int32)  # -1: all allowed
            full[indices] = masks
            xgrammar.apply_token_bitmask_inplace(host, full, vocab_size=self.vocab_size)
        return self.sampler(host, self._metadata(rows))

    def prompt_logprobs(self, logits: np.ndarray, targets: np.ndarray,
                        num_logprobs: int) -> LogprobsTensors:
        """One request's prompt rows as vLLM's GPU runner scores them: `logits` [rows, vocab]
        (float32), `targets` [rows] the prompt token each row predicts; column 0 holds the
        target's score, then the top `num_logprobs`, beside the target's rank. Prompt tokens
        skip the logits processors, so raw and processed modes give the same scores."""
        if logits.shape != (len(targets), self.vocab_size):
            raise ValueError(f"logits: expected shape ({len(targets)}, {self.vocab_size}), "
                             f"got {tuple(logits.shape)}")
        if not 0 <= num_logprobs <= self.vocab_size:
            raise ValueError(f"num_logprobs: {num_logprobs} is outside [0, {self.vocab_size}]")
        scores = torch.from_numpy(np.asarray(logits, dtype=np.float32))
        if self.logprobs_mode not in ("raw_logits", "processed_logits"):
            scores = self.sampler.compute_logprobs(scores)
        return self.sampler.gather_logprobs(scores, num_logprobs,
                                            torch.from_numpy(targets.astype(np.int64)))

    def _refresh_logitsprocs(self, rows: Sequence[SamplingRow]) -> None:
        update = BatchUpdate(
            batch_size=len(rows),
            removed=list(range(len(rows), self._batch_size)),
            added=[(i, r.params, list(r.prompt_token_ids), r.output_token_ids)
                   for i, r in enumerate(rows)],
            moved=[])
        for proc in self.logitsprocs.all:
            proc.update_state(update)
        self._batch_size = len(rows)

    def _metadata(self, rows: Sequence[SamplingRow]) -> SamplingMetadata:
        params = [r.params for r in rows]
        greedy = [p.sampling_type == SamplingType.GREEDY for p in params]
        # Greedy rows carry temperature 0 (vLLM's Sampler then takes their argmax).
        temperature = torch.tensor([0.0 if g else p.temperature for g, p in zip(greedy, params)],
                                   dtype=torch.float32)
        top_k = [p.top_k if 0 < p.top_k < self.vocab_size else self.vocab_size for p in params]
        penalties = {
            "frequency_penalties": [p.frequency_penalty for p in params],
            "presence_penalties": [p.presence_penalty for p in params],
            "repetition_penalties": [p.repetition_penalty for p in params],
        }
        no_penalties = all(p.frequency_penalty == 0 and p.presence_penalty == 0
                           and p.repetition_penalty == 1 for p in params)
        logprobs = [self.vocab_size if p.logprobs == -1 else p.logprobs
                    for p in params if p.logprobs is not None]
        bad_words = {i: p.bad_words_token_ids for i, p in enumerate(params) if p.bad_words_token_ids}
        return SamplingMetadata(
            temperature=None if all(greedy) else temperature,
            all_greedy=all(greedy),
            all_random=not any(greedy),
            top_p=None if all(p.top_p >= 1 for p in params)
            else torch.tensor([p.top_p for p in params], dtype=torch.float32),
            top_k=None if all(k == self.vocab_size for k in top_k)
            else torch.tensor(top_k, dtype=torch.int32),
            generators={i: r.generator for i, r in enumerate(rows) if r.generator is not None},
            max_num_logprobs=max(logprobs) if logprobs else None,
            logprob_token_ids={i: p.logprob_token_ids for i, p in enumerate(params)
                               if p.logprob_token_ids is not None} or None,
            no_penalties=no_penalties,
            prompt_token_ids=None if no_penalties else self._padded_prompts(rows),
            **{k: torch.tensor(v, dtype=torch.float32) for k, v in penalties.items()},
            output_token_ids=[r.output_token_ids for r in rows],
            allowed_token_ids_mask=self._allowed_mask(params),
            bad_words_token_ids=bad_words,
            logitsprocs=self.logitsprocs,
        )

    def _padded_prompts(self, rows: Sequence[SamplingRow]) -> torch.Tensor:
        # vLLM pads with vocab_size: an id no token has, dropped by the penalty scatter.
        width = max(len(r.prompt_token_ids) for r in rows)
        out = torch.full((len(rows), width), self.vocab_size, dtype=torch.int64)
        for i, r in enumerate(rows):
            out[i, :len(r.prompt_token_ids)] = torch.as_tensor(r.prompt_token_ids, dtype=torch.int64)
        return out

    def _allowed_mask(self, params: Sequence[SamplingParams]) -> torch.Tensor | None:
        if not any(p.allowed_token_ids for p in params):
            return None
        mask = torch.zeros((len(params), self.vocab_size), dtype=torch.bool)  # True = masked out
        for i, p in enumerate(params):
            if p.allowed_token_ids:
                mask[i] = True
                mask[i, p.allowed_token_ids] = False
        return mask


def grammar_rows(grammar: GrammarOutput | None,
                 sample_ids: Sequence[str]) -> dict[int, np.ndarray] | None:
    """The bitmask rows of the structured-output requests that sample in this step, keyed by
    their sampling row (a request still mid-prompt has a bitmask row but samples nothing)."""
    if grammar is None:
        return None
    row_of = {r: i for i, r in enumerate(sample_ids)}
    return {row_of[r]: grammar.grammar_bitmask[k]
            for k, r in enumerate(grammar.structured_output_request_ids) if r in row_of}


def in_output_order(lists: LogprobsLists, sample_ids: Sequence[str],
                    req_ids: Sequence[str]) -> LogprobsLists:
    """Sampler rows follow `sample_ids`; the scheduler reads row `req_id_to_index[req]`."""
    row_of = {r: i for i, r in enumerate(sample_ids)}
    order = [row_of.get(r, 0) for r in req_ids]  # rows of non-sampling requests are never read
    return LogprobsLists(lists.logprob_token_ids[order], lists.logprobs[order],
                         lists.sampled_token_ranks[order])
