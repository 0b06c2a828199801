"""An offline engine loop: vLLM's real v1 Scheduler driving `VllmModelRunner`.

schedule() -> execute_model() -> update_from_output(), with prefix caching and chunked
prefill on (caching can be switched off for A/B runs). Greedy sampling. Timestamps per
request give time-to-first-token. With `async_scheduling`, vLLM's AsyncScheduler and the
order of its engine core's batch queue: the next step is scheduled and run before the
previous step's output is taken. vLLM needs no weights here: its ModelConfig reads a
folder holding only config.json (a temporary folder this engine owns).

Requests that can never run (empty, out-of-vocabulary, longer than max_model_len or than the
block pool) are refused by `add_request` with a ValueError, and a loop in which the scheduler
can no longer schedule anything raises instead of spinning.
"""

from __future__ import annotations

import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.outputs import AsyncModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from .dispatch import Dispatcher
from .kv_groups import blocks_held, kv_cache_config, layer_specs
from .models import build_model, hf_config, resolve_config
from .runner import attention_of
from .validate import as_int, as_ints
from .vllm_runner import TORCH_TO_MLX, VllmModelRunner

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
STUCK_STEPS = 3  # consecutive steps that schedule nothing while requests wait: no progress


@dataclass(frozen=True)
class EngineConfig:
    model: str | dict = "llama-tiny"
    dtype: str = "float32"
    seed: int = 0
    block_size: int = 16
    num_blocks: int = 2048
    max_model_len: int = 4096
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    attention: str | None = None  # dispatcher override; None = env var or auto
    async_scheduling: bool = False  # vLLM's AsyncScheduler, two steps in flight


@dataclass
class RequestResult:
    req_id: str
    prompt_len: int
    output_ids: list[int] = field(default_factory=list)
    arrival: float = 0.0
    first_token_time: float | None = None
    cached_tokens: int = 0  # num_computed_tokens when first scheduled: the scheduler's hit
    finish_reason: str | None = None

    @property
    def ttft(self) -> float:
        return self.first_token_time - self.arrival


class Engine:
    def __init__(self, config: EngineConfig = EngineConfig()):
        if config.dtype not in DTYPES:
            raise ValueError(f"dtype: expected one of {sorted(DTYPES)}, got {config.dtype!r}")
        self.config = config
        model_cfg = resolve_config(config.model)
        torch_dtype = DTYPES[config.dtype]
        model = build_model(model_cfg, TORCH_TO_MLX[torch_dtype], config.seed)
        layers = [a for a in attention_of(model)[1] if a is not None]
        if len(layers) != len(model.layers):
            raise ValueError(f"model: {model_cfg['model_type']!r} is a hybrid model, whose "
                             "recurrent layers keep their states in vLLM's mamba groups: serve "
                             "it with vLLM's own engine (vllm.LLM, vllm serve)")
        self.vocab_size = model_cfg["vocab_size"]
        self._folder = tempfile.TemporaryDirectory(prefix="paged_prefix_")  # removed with self
        folder = hf_config(model_cfg, Path(self._folder.name), config.dtype)
        vllm_config = VllmConfig(
            model_config=ModelConfig(model=str(folder), skip_tokenizer_init=True,
                                     dtype=config.dtype, max_model_len=config.max_model_len),
            cache_config=CacheConfig(block_size=config.block_size,
                                     enable_prefix_caching=config.enable_prefix_caching),
            scheduler_config=SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=config.max_model_len, is_encoder_decoder=False,
                enable_chunked_prefill=True, async_scheduling=config.async_scheduling),
        )
        self.runner = VllmModelRunner(model, Dispatcher(config.attention), vllm_config)
        # the layers' specs grouped and sized as vLLM's engine core does (the worker's path)
        specs = layer_specs(self.runner.layer_windows(), config.block_size,
                            layers[0].num_kv_heads, layers[0].head_dim, torch_dtype)
        kv_config = kv_cache_config(vllm_config, specs, config.num_blocks)
        vllm_config.cache_config.num_gpu_blocks = config.num_blocks
        self.scheduler = vllm_config.scheduler_config.get_scheduler_cls()(
            vllm_config=vllm_config, kv_cache_config=kv_config,
            structured_output_manager=StructuredOutputManager(vllm_config),
            block_size=config.block_size, log_stats=True)
        self.runner.initialize_kv_cache(kv_config)
        self._group_specs = [g.kv_cache_spec for g in kv_config.kv_cache_groups]
        self._in_flight = vllm_config.max_in_flight_tokens
        init_none_hash(sha256)
        self._hasher = get_request_block_hasher(config.block_size, sha256)
        self.results: dict[str, RequestResult] = {}
        self.num_resumed = 0  # preempted requests brought back: they re-run part of a prompt
        self.num_preempted = 0
        self.num_partial_prefills = 0  # scheduled chunks that ended before the known tokens
        # steps run whose output the scheduler has not taken: at most one more than this
        self._queue: deque = deque()
        self._depth = 2 if config.async_scheduling else 1

    def add_request(self, req_id: str, prompt_ids: list[int], max_tokens: int) -> None:
        """Queue a greedy request; raises ValueError for one that could never complete."""
        if req_id in self.results:
            raise ValueError(f"req_id: {req_id!r} was already added")
        ids = as_ints(prompt_ids, "prompt_ids", low=0, high=self.vocab_size - 1)
        if len(ids) == 0:
            raise ValueError("prompt_ids: a request needs at least one prompt token")
        max_tokens = as_int(max_tokens, "max_tokens", low=1)
        total, c = len(ids) + max_tokens, self.config
        if total > c.max_model_len:
            raise ValueError(f"max_model_len: {len(ids)} prompt + {max_tokens} output tokens "
                             f"exceed {c.max_model_len}")
        usable = c.num_blocks - 1  # vLLM keeps block 0 as its null block
        needed = self.blocks_held(total)
        if needed > usable:
            raise ValueError(f"num_blocks: {total} tokens need {needed} blocks of {c.block_size}"
                             f" over {len(self._group_specs)} KV-cache groups, the pool has "
                             f"{usable}")
        self.results[req_id] = RequestResult(req_id, len(ids), arrival=time.perf_counter())
        self.scheduler.add_request(Request(
            request_id=req_id, prompt_token_ids=ids.tolist(),
            sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0),
            pooling_params=None, block_hasher=self._hasher))

    def blocks_held(self, num_tokens: int) -> int:
        """The most blocks of the pool a request of `num_tokens` tokens holds at once, all its
        KV-cache groups together (vLLM admits a request only where they are free)."""
        return sum(blocks_held(spec, num_tokens, self._in_flight)
                   for spec in self._group_specs)

    def abort(self, req_id: str) -> None:
        """Stop a queued or running request; its blocks go back to the pool."""
        if req_id not in self.results:
            raise ValueError(f"req_id: {req_id!r} is unknown")
        self.scheduler.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)
        self.results[req_id].finish_reason = self.results[req_id].finish_reason or "abort"

    def step(self) -> list[str]:
        """One schedule + forward, and the scheduler's update from the oldest step run whose
        output it has not taken (with async scheduling, the step before, unless nothing more
        could be scheduled); returns the ids of requests that finished."""
        if self.scheduler.has_requests():
            so = self.scheduler.schedule()
            for new in so.scheduled_new_reqs:
                self.results[new.req_id].cached_tokens = new.num_computed_tokens
            cached = so.scheduled_cached_reqs
            self.num_resumed += len(cached.resumed_req_ids)
            self.num_preempted += len(so.preempted_req_ids or ())
            out = self.runner.run_forward(so)
            self._queue.appendleft((so, self.runner.sample_tokens(None) if out is None else out))
            if len(self._queue) < self._depth and so.total_num_scheduled_tokens:
                return []
        if not self._queue:
            return []
        so, out = self._queue.pop()
        if isinstance(out, AsyncModelRunnerOutput):
            out = out.get_output()
        self.num_partial_prefills += sum(not tokens for tokens in out.sampled_token_ids)
        now = time.perf_counter()
        finished = []
        for core_outputs in self.scheduler.update_from_output(so, out).values():
            for o in core_outputs.outputs:
                result = self.results[o.request_id]
                if o.new_token_ids and result.first_token_time is None:
                    result.first_token_time = now
                result.output_ids.extend(o.new_token_ids)
                if o.finish_reason is not None:
                    result.finish_reason = str(o.finish_reason)
                    finished.append(o.request_id)
        return finished

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._queue)

    def run_to_completion(self) -> None:
        idle = 0
        while self.has_unfinished():
            before = self.runner.runner.stats.forwards
            self.step()
            waiting = self.scheduler.has_unfinished_requests()
            idle = idle + 1 if waiting and self.runner.runner.stats.forwards == before else 0
            if idle >= STUCK_STEPS:
                raise RuntimeError(f"the scheduler scheduled nothing for {idle} steps with "
                                   f"{self.scheduler.get_num_unfinished_requests()} requests "
                                   "unfinished")

    @property
    def tokens_computed(self) -> int:
        return self.runner.runner.stats.tokens_computed
