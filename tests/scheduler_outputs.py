"""vLLM's SchedulerOutput dataclasses built by hand: one step's new and cached requests."""

from __future__ import annotations

from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput


def new(req_id, prompt, blocks, computed=0, **params) -> NewRequestData:
    return NewRequestData(req_id=req_id, prompt_token_ids=prompt, mm_features=[],
                          sampling_params=SamplingParams(temperature=0.0, max_tokens=8, **params),
                          pooling_params=None, block_ids=blocks, num_computed_tokens=computed,
                          lora_request=None)


def cached(req_ids, new_blocks, computed, resumed=(), all_token_ids=None) -> CachedRequestData:
    return CachedRequestData(req_ids=list(req_ids), resumed_req_ids=set(resumed), new_token_ids=[],
                             all_token_ids=dict(all_token_ids or {}),
                             new_block_ids=list(new_blocks), num_computed_tokens=list(computed),
                             num_output_tokens=[0] * len(req_ids))


def step(scheduled: dict, new_reqs=(), cached_reqs=None, finished=(),
         preempted=None) -> SchedulerOutput:
    return SchedulerOutput(
        scheduled_new_reqs=list(new_reqs),
        scheduled_cached_reqs=cached_reqs or CachedRequestData.make_empty(),
        num_scheduled_tokens=dict(scheduled), total_num_scheduled_tokens=sum(scheduled.values()),
        scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
        finished_req_ids=set(finished), free_encoder_mm_hashes=[],
        preempted_req_ids=None if preempted is None else set(preempted))
