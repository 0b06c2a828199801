"""Warm-up: real forwards and sampling before the first request.

One-time costs (kernel builds, MLX's compiled scatter, the sampler's compiled helpers) are
paid here rather than in the first request's latency. The warm-up writes only into blocks that
no request can own yet (never block 0, vLLM's null block) and keeps no request state; with
several KV-cache groups each group has blocks of its own, as vLLM's pool hands them out.
"""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
from vllm.sampling_params import SamplingParams

from .kv_cache import PagedKVCache
from .metadata import ScheduledRequest, build_batch_metadata
from .runner import PagedModelRunner
from .state_cache import RecurrentStateCache
from .state_metadata import StateLedger, StateMetadata, StateRequest, build_state_metadata, commit
from .vllm_sampling import BatchSampler, SamplingRow, make_generator


def warm_up_limit(cache: PagedKVCache) -> int:
    """The longest prefill `warm_up` can run in this cache: its two requests (the prefill,
    and a decode row one token longer) each need their own blocks in each group."""
    return (cache.num_blocks - 1) // (2 * len(cache.windows)) * cache.block_size - 1


def warm_up(runner: PagedModelRunner, sampler: BatchSampler, num_tokens: int) -> None:
    """A `num_tokens` prefill and a decode row, two decode rows alone, then the prefill again
    with its first half cached; and their sampling, greedy and at random with penalties and
    logprobs."""
    cache, vocab, groups = runner.kv_cache, runner.vocab_size, len(runner.kv_cache.windows)
    per_request = -(-(num_tokens + 1) // cache.block_size)
    if 2 * per_request * groups + 1 > cache.num_blocks:
        raise ValueError(f"num_tokens: a warm-up of {num_tokens} tokens needs "
                         f"{2 * per_request * groups + 1} blocks, the cache has "
                         f"{cache.num_blocks}")
    tokens = [i % vocab for i in range(num_tokens + 1)]

    ledger: StateLedger = {}  # a hybrid model's state blocks: this warm-up's own

    def forward(*requests: ScheduledRequest) -> mx.array:
        meta = build_batch_metadata(list(requests), cache.block_size, cache.num_blocks,
                                    vocab_size=vocab, windows=cache.windows)
        if runner.state_cache is not None:
            meta = replace(meta, states=_states(runner.state_cache, requests, ledger))
        logits = runner.forward(meta)
        mx.eval(logits, runner.cache_arrays())
        if meta.states is not None:
            commit(ledger, meta.states)
        return logits

    # Every other block: a long prefill's rows then land in many runs of slots, so its
    # cache writes take the scatter (MLX's CUDA backend compiles its scatter kernels with
    # NVRTC on first use), while the decode rows' two runs take the slice updates.
    starts = [1 + 2 * per_request * g for g in range(groups)]
    first = tuple(list(range(a, a + 2 * per_request, 2)) for a in starts)
    second = tuple(list(range(a + 1, a + 2 * per_request, 2)) for a in starts)
    if runner.state_cache is not None:
        # a hybrid model's recurrent states follow each request: a prefill alone, then its
        # decode row beside a second prefill, then both decode rows (n + 2 tokens at most)
        n = num_tokens - 1
        logits = forward(ScheduledRequest("a", tokens[:n], n, 0, n, first))
        logits = forward(ScheduledRequest("a", tokens[:n + 1], n, n, 1, first),
                         ScheduledRequest("b", tokens[:n], n, 0, n, second))
        forward(ScheduledRequest("a", tokens[:n + 2], n, n + 1, 1, first),
                ScheduledRequest("b", tokens[:n + 1], n, n, 1, second))
        _sample(sampler, logits, tokens, n)
        return
    logits = forward(
        ScheduledRequest("warmup-prefill", tokens[:num_tokens], num_tokens, 0, num_tokens, first),
        ScheduledRequest("warmup-decode", tokens, num_tokens, num_tokens, 1, second))
    # decode rows alone, as most serving steps are (their own tile plans and MLX kernels)
    forward(*(ScheduledRequest(f"warmup-decode-{i}", tokens, num_tokens, num_tokens, 1, part)
              for i, part in enumerate((first, second))))
    hit = num_tokens // 2 // cache.block_size * cache.block_size
    if hit:  # the cached-prefix path too: the prompt again, its first half read back
        forward(ScheduledRequest("warmup-hit", tokens[:num_tokens], num_tokens, hit,
                                 num_tokens - hit, first))
    _sample(sampler, logits, tokens, num_tokens)


def _sample(sampler: BatchSampler, logits: mx.array, tokens: list[int], num_tokens: int) -> None:
    """Two rows' sampling: greedy, and at random with penalties and logprobs."""
    varied = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, min_p=0.05, seed=0,
                            repetition_penalty=1.1, logprobs=2)
    rows = [SamplingRow(SamplingParams(temperature=0.0), tokens[:num_tokens], [], None),
            SamplingRow(varied, tokens[:num_tokens], [tokens[-1]], make_generator(varied))]
    for start in range(0, len(rows), sampler.max_rows):  # max_num_seqs may be 1
        part = slice(start, start + sampler.max_rows)
        sampler.sample(logits[part], rows[part])


def _states(cache: RecurrentStateCache, requests: tuple[ScheduledRequest, ...],
            ledger: StateLedger) -> StateMetadata:
    """Warm-up requests' state rows: request "a" in state block 1 of every group, "b" in 2, a
    block as long as the whole warm-up."""
    block = max(len(r.token_ids) for r in requests) + 1
    states = [StateRequest(r.req_id, r.num_computed_tokens, r.num_scheduled_tokens,
                           [[1 + "ab".index(r.req_id)]] * cache.num_groups,
                           tuple(r.token_ids[:r.num_prompt_tokens]),
                           tuple(r.token_ids[r.num_prompt_tokens:])) for r in requests]
    conv = cache.specs[0].shapes[0][0] + 1
    return build_state_metadata(states, cache.num_groups, block, cache.num_blocks, conv,
                                ledger, {})
