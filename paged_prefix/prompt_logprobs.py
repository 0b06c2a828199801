"""Prompt logprobs (`SamplingParams.prompt_logprobs`), with vLLM's semantics: which rows a
step scores, and each request's rows until its prompt is done.

A prompt of P tokens has P - 1 rows: row i holds the log_softmax (float32) of the logits at
prompt position i, for the prompt's token i + 1 first, then its top N, and that token's rank
(`LogprobsTensors`, as vLLM's GPU runner returns them). The scheduler may split a prompt over
steps; each step scores the positions it computes (its last prompt row predicts the first
output token, so it is not a row), and the rows go out whole in the step that computes the
prompt's last token: vLLM's scheduler accepts no output from a chunk that ends mid-prompt,
and its output processor turns those rows into the request's `prompt_logprobs`. Only the rows
of requests that ask for them pass the vocabulary projection (`PagedModelRunner.forward`'s
`prompt_rows`).

As in vLLM, a request's rows are tracked from its admission to the step that completes them,
and never again: a request preempted afterwards recomputes its K/V, not its prompt logprobs.
One preempted before comes back from an earlier position and scores its rows again. vLLM's
SamplingParams skip the prefix cache for these requests (`skip_reading_prefix_cache`), so
every row is computed by this runner; a step that starts a request past the rows it holds is
refused (a ValueError naming the field, before the forward).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from vllm.v1.core.sched.output import NewRequestData
from vllm.v1.outputs import LogprobsTensors

from .metadata import BatchMetadata
from .validate import as_int

# (logits [rows, vocab] float32, target ids [rows], top N) -> the rows' LogprobsTensors
Scorer = Callable[[np.ndarray, np.ndarray, int], LogprobsTensors]


@dataclass(frozen=True)
class PromptLogprobs:
    """One request's rows so far: rows 0 .. `filled` - 1, in `chunks` (a step's rows each)."""

    num_logprobs: int  # top N per row; vLLM's -1 (all) as the vocabulary size
    chunks: tuple[LogprobsTensors, ...] = ()

    @property
    def filled(self) -> int:
        return sum(len(c.selected_token_ranks) for c in self.chunks)

    def with_rows(self, start: int, rows: LogprobsTensors) -> PromptLogprobs:
        """These rows from row `start` on, replacing any held there (a request preempted
        mid-prompt scores its rows again)."""
        kept, seen = [], 0
        for chunk in self.chunks:
            n = len(chunk.selected_token_ranks)
            if seen < start:
                kept.append(chunk if seen + n <= start else _head(chunk, start - seen))
            seen += n
        return PromptLogprobs(self.num_logprobs, (*kept, rows))

    def rows(self) -> LogprobsTensors:
        """Every row held, as one LogprobsTensors (none for a one-token prompt)."""
        if not self.chunks:
            return LogprobsTensors.empty_cpu(0, self.num_logprobs + 1)
        return LogprobsTensors.cat(self.chunks)


def _head(rows: LogprobsTensors, n: int) -> LogprobsTensors:
    return LogprobsTensors(rows.logprob_token_ids[:n], rows.logprobs[:n],
                           rows.selected_token_ranks[:n])


def admit(new: NewRequestData, vocab_size: int) -> PromptLogprobs | None:
    """The rows of a new request that asks for prompt logprobs (None: it does not). vLLM's
    frontend bounds N by its max_logprobs and the vocabulary; a direct caller is checked
    here."""
    n = new.sampling_params.prompt_logprobs
    if n is None:
        return None
    n = as_int(n, f"prompt_logprobs ({new.req_id!r})", low=-1, high=vocab_size)
    return PromptLogprobs(vocab_size if n == -1 else n)


def live(states: Mapping[str, PromptLogprobs], req_ids: Collection[str],
         new_reqs: Sequence[NewRequestData], vocab_size: int) -> dict[str, PromptLogprobs]:
    """The states of the requests still live (`req_ids`), with this step's new requests'."""
    out = {r: s for r, s in states.items() if r in req_ids}
    for new in new_reqs:
        if (state := admit(new, vocab_size)) is not None:
            out[new.req_id] = state
    return out


@dataclass(frozen=True)
class PromptChunk:
    """One request's rows in one step."""

    req_id: str
    start: int  # its first row (= the step's first position of the request)
    rows: slice  # its rows among the forward's prompt rows
    targets: np.ndarray  # [rows] the prompt tokens they predict: start + 1 onwards
    complete: bool  # the step computes the prompt's last token: the rows go out


@dataclass(frozen=True)
class PromptLogprobsStep:
    """A step's prompt-logprob work, planned before its forward."""

    chunks: tuple[PromptChunk, ...]
    rows: np.ndarray  # [E] int32: the forward's packed rows to score, chunk after chunk


def plan(states: Mapping[str, PromptLogprobs], meta: BatchMetadata,
         prompts: Mapping[str, Sequence[int]]) -> PromptLogprobsStep:
    """The rows this forward scores for the requests in `states` (their prompts in
    `prompts`); raises ValueError before the forward for a request that starts past them."""
    attn = meta.groups[0].attn  # its lengths: every KV-cache group has the same
    chunks, rows, offset = [], [], 0
    for s, req_id in enumerate(meta.req_ids):
        if req_id not in states:
            continue
        start, n = int(attn.context_lens_host[s]), int(attn.q_lens_host[s])
        filled, prompt = states[req_id].filled, prompts[req_id]
        if start > filled:
            raise ValueError(f"num_computed_tokens: {req_id!r} asks for prompt logprobs but "
                             f"starts at token {start} with {filled} rows scored (vLLM's "
                             "scheduler reads no prefix cache for such requests)")
        count = max(0, min(n, len(prompt) - 1 - start))
        first = int(attn.cu_seqlens_q_host[s])
        rows.append(np.arange(first, first + count, dtype=np.int32))
        chunks.append(PromptChunk(req_id, start, slice(offset, offset + count),
                                  np.asarray(prompt[start + 1:start + 1 + count], np.int64),
                                  start + n >= len(prompt)))
        offset += count
    return PromptLogprobsStep(tuple(chunks), np.concatenate(rows or [np.zeros(0, np.int32)]))


def scored(step: PromptLogprobsStep, logits: np.ndarray, states: Mapping[str, PromptLogprobs],
           score: Scorer) -> tuple[dict[str, PromptLogprobs], dict[str, LogprobsTensors]]:
    """The states once the step's rows are scored from `logits` [E, vocab] (the forward's
    prompt rows), and the rows of the requests it completes (their states dropped)."""
    if len(logits) != len(step.rows):
        raise ValueError(f"logits: {len(logits)} prompt rows, the step scores {len(step.rows)}")
    out, done = dict(states), {}
    for chunk in step.chunks:
        state = out[chunk.req_id]
        if chunk.rows.stop > chunk.rows.start:
            rows = score(logits[chunk.rows], chunk.targets, state.num_logprobs)
            state = state.with_rows(chunk.start, rows)
        if chunk.complete:
            done[chunk.req_id] = state.rows()
            del out[chunk.req_id]
        else:
            out[chunk.req_id] = state
    return out, done
