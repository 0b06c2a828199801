"""The vLLM boundary: vLLM's model-runner contract on top of `PagedModelRunner`.

    initialize_kv_cache(KVCacheConfig)            allocate the paged cache vLLM sized
    execute_model(SchedulerOutput) -> ModelRunnerOutput

the same contract vllm-metal's model runner implements, so this module can be dropped
into its worker. Every vLLM import of the project lives here and in `engine.py`.

The scheduler owns prefix caching: it hashes blocks, finds hits and hands each request
`num_computed_tokens` with the hit blocks first in `block_ids`. This runner keeps only
what the scheduler does not resend each step (token ids, block ids) and computes exactly
the tokens it was told to, starting at `num_computed_tokens`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
import torch
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig
from vllm.v1.outputs import ModelRunnerOutput

from .dispatch import Dispatcher
from .kv_cache import PagedKVCache
from .metadata import ScheduledRequest, build_batch_metadata
from .runner import PagedModelRunner

TORCH_TO_MLX = {torch.float16: mx.float16, torch.bfloat16: mx.bfloat16, torch.float32: mx.float32}


@dataclass
class _RequestState:
    token_ids: list[int]  # prompt, then every token sampled so far
    num_prompt_tokens: int
    block_ids: list[int] = field(default_factory=list)


class VllmModelRunner:
    def __init__(self, model: nn.Module, dispatcher: Dispatcher | None = None):
        self.model = model
        self.dispatcher = dispatcher
        self.runner: PagedModelRunner | None = None
        self.requests: dict[str, _RequestState] = {}

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

    def _update_states(self, so: SchedulerOutput) -> dict[str, int]:
        """Apply this step's request changes; returns num_computed_tokens per scheduled id."""
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
        computed = {}
        for new in so.scheduled_new_reqs:
            if new.prompt_token_ids is None:
                raise ValueError(f"prompt_token_ids: {new.req_id!r} has none (embeddings "
                                 "input is not supported)")
            # The scheduler's list is the request's own: copy, never mutate it.
            self.requests[new.req_id] = _RequestState(
                list(new.prompt_token_ids), len(new.prompt_token_ids), list(new.block_ids[0]))
            computed[new.req_id] = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests[req_id]
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                # A preempted request comes back with a fresh block list (maybe a new hit).
                state.block_ids = list(new_blocks[0]) if new_blocks else []
                if req_id in cached.all_token_ids:
                    state.token_ids = list(cached.all_token_ids[req_id])
            elif new_blocks:
                state.block_ids.extend(new_blocks[0])
            computed[req_id] = cached.num_computed_tokens[i]
        return computed

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if self.runner is None:
            raise ValueError("initialize_kv_cache must run before execute_model")
        if scheduler_output.scheduled_spec_decode_tokens:
            raise ValueError("scheduled_spec_decode_tokens: speculative decoding is not supported")
        computed = self._update_states(scheduler_output)
        req_ids = list(scheduler_output.num_scheduled_tokens)
        if not req_ids:
            return ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[])
        scheduled = [
            ScheduledRequest(
                req_id=r,
                token_ids=self.requests[r].token_ids,
                num_prompt_tokens=self.requests[r].num_prompt_tokens,
                num_computed_tokens=computed[r],
                num_scheduled_tokens=scheduler_output.num_scheduled_tokens[r],
                block_ids=self.requests[r].block_ids,
            )
            for r in req_ids
        ]
        cache = self.runner.kv_cache
        meta = build_batch_metadata(scheduled, cache.block_size, cache.num_blocks)
        sampled = dict(zip(meta.sample_req_ids, self.runner.greedy(meta)))
        for req_id, token in sampled.items():
            self.requests[req_id].token_ids.append(token)
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[[sampled[r]] if r in sampled else [] for r in req_ids],
        )
