"""An offline engine loop: vLLM's real v1 Scheduler driving `VllmModelRunner`.

schedule() -> execute_model() -> update_from_output(), with prefix caching and chunked
prefill on (caching can be switched off for A/B runs). Greedy sampling. Timestamps per
request give time-to-first-token. vLLM needs no weights here: its ModelConfig reads a
folder holding only config.json.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # the scheduler only; the model is MLX

import torch  # noqa: E402
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from .dispatch import Dispatcher  # noqa: E402
from .models import build_model, hf_config, resolve_config  # noqa: E402
from .vllm_runner import TORCH_TO_MLX, VllmModelRunner  # noqa: E402

# vLLM's CPU-platform notices (Triton, CPU block sizes) concern its own model runner.
logging.getLogger("vllm").setLevel(logging.ERROR)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


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


@dataclass
class RequestResult:
    req_id: str
    prompt_len: int
    output_ids: list[int] = field(default_factory=list)
    arrival: float = 0.0
    first_token_time: float | None = None
    cached_tokens: int = 0  # num_computed_tokens when first scheduled: the scheduler's hit

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
        self.model = build_model(model_cfg, TORCH_TO_MLX[torch_dtype], config.seed)
        folder = hf_config(model_cfg, Path(tempfile.mkdtemp(prefix="paged_prefix_")), config.dtype)
        vllm_config = VllmConfig(
            model_config=ModelConfig(model=str(folder), skip_tokenizer_init=True,
                                     dtype=config.dtype, max_model_len=config.max_model_len),
            cache_config=CacheConfig(block_size=config.block_size,
                                     enable_prefix_caching=config.enable_prefix_caching),
            scheduler_config=SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=config.max_model_len, is_encoder_decoder=False,
                enable_chunked_prefill=True),
        )
        layer_names = [f"model.layers.{i}.self_attn.attn"
                       for i in range(model_cfg["num_hidden_layers"])]
        kv_cache_config = KVCacheConfig(
            num_blocks=config.num_blocks, kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(layer_names, FullAttentionSpec(
                block_size=config.block_size, num_kv_heads=model_cfg["num_key_value_heads"],
                head_size=model_cfg["head_dim"], dtype=torch_dtype))])
        vllm_config.cache_config.num_gpu_blocks = config.num_blocks
        self.scheduler = Scheduler(
            vllm_config=vllm_config, kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(vllm_config),
            block_size=config.block_size, log_stats=True)
        self.runner = VllmModelRunner(self.model, Dispatcher(config.attention))
        self.runner.initialize_kv_cache(kv_cache_config)
        init_none_hash(sha256)
        self._hasher = get_request_block_hasher(config.block_size, sha256)
        self.results: dict[str, RequestResult] = {}
        self.num_resumed = 0  # preempted requests brought back: they re-run part of a prompt

    def add_request(self, req_id: str, prompt_ids: list[int], max_tokens: int) -> None:
        if req_id in self.results:
            raise ValueError(f"req_id: {req_id!r} was already added")
        self.results[req_id] = RequestResult(req_id, len(prompt_ids), arrival=time.perf_counter())
        self.scheduler.add_request(Request(
            request_id=req_id, prompt_token_ids=list(prompt_ids),
            sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0),
            pooling_params=None, block_hasher=self._hasher))

    def step(self) -> list[str]:
        """One schedule + forward; returns the ids of requests that finished."""
        so = self.scheduler.schedule()
        for new in so.scheduled_new_reqs:
            self.results[new.req_id].cached_tokens = new.num_computed_tokens
        self.num_resumed += len(so.scheduled_cached_reqs.resumed_req_ids)
        out = self.runner.execute_model(so)
        now = time.perf_counter()
        finished = []
        for core_outputs in self.scheduler.update_from_output(so, out).values():
            for o in core_outputs.outputs:
                result = self.results[o.request_id]
                if o.new_token_ids and result.first_token_time is None:
                    result.first_token_time = now
                result.output_ids.extend(o.new_token_ids)
                if o.finish_reason is not None:
                    finished.append(o.request_id)
        return finished

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def run_to_completion(self, max_steps: int = 100_000) -> None:
        for _ in range(max_steps):
            if not self.has_unfinished():
                return
            self.step()
        raise RuntimeError(f"requests still unfinished after {max_steps} steps")

    @property
    def tokens_computed(self) -> int:
        return self.runner.runner.stats.tokens_computed

