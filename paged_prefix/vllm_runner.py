"""The vLLM boundary: vLLM's model-runner contract on top of `PagedModelRunner`.

    layer_windows() -> per layer W or None       each layer's sliding window (its vLLM spec)
    initialize_kv_cache(KVCacheConfig)           allocate the paged cache vLLM sized and grouped
    run_forward(SchedulerOutput) -> None         the forward; output follows in sample_tokens
                                   | ModelRunnerOutput   (nothing scheduled: no sampling step)
    sample_tokens(grammar_output) -> ModelRunnerOutput
    execute_model(SchedulerOutput) -> ModelRunnerOutput   both, for the offline engine

`run_forward` + `sample_tokens` is the split vLLM's workers use (vllm-metal's runner too): it
serves both synchronous and asynchronous scheduling. Sampling is vLLM's own Sampler
(`vllm_sampling.py`), except for a step whose every sampling row vLLM would answer with the
argmax of its logits (`vllm_sampling.needs_sampler`: greedy, nothing that changes the logits,
no logprobs, no grammar): its argmax is taken on the device, launched with the forward (one
evaluation a step), and `sample_tokens` returns at once, with vLLM's AsyncModelRunnerOutput
(`SampledOnDevice`), whose tokens the host reads only when the engine asks for them. The next
step's forward then reads those tokens on the device (a request's `pending` token) and is built
while the device still runs this one: under vLLM's asynchronous scheduling (its default) the
engine schedules the next step before it takes this one's output, so the host's work
(scheduling, the metadata, the graph) overlaps the device's. A step is launched only once the
one before has finished: MLX holds a running step's arrays, and a cache write into an array it
holds would copy the whole array (`runner._release_last_step`). The step launcher
(`launch.py`) sends it, by the engine's thread or, on CUDA (PAGED_PREFIX_LAUNCH_THREAD), a
step sampled on the device from a thread of its own. A request that asks for prompt logprobs
has its prompt rows scored right after each forward of its prompt
(`prompt_logprobs.py`); they go out whole with the step that computes its last prompt token.

The scheduler owns prefix caching: it hashes blocks, finds hits and hands each request
`num_computed_tokens` with the hit blocks first in `block_ids`. This runner keeps only what
the scheduler does not resend each step (`requests.py`) and computes exactly the tokens it was
told to, starting at `num_computed_tokens`.

A step is all or nothing: `plan_step` applies the SchedulerOutput to copies of the request
states and checks it (a ValueError naming the field), and only after the forward has been built
and launched are the copies committed; the sampled tokens are committed after sampling
succeeded. A step that raises leaves the request states as they were; the forward itself writes
no cache row before its own checks pass.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import torch
from vllm.config import VllmConfig
from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.outputs import (
    EMPTY_MODEL_RUNNER_OUTPUT,
    AsyncModelRunnerOutput,
    LogprobsTensors,
    ModelRunnerOutput,
)

from . import prompt_logprobs, warmup
from .architectures import architecture
from .dispatch import Dispatcher
from .hybrid_groups import CacheGroups, HybridLimits, kernel_block_size
from .kv_cache import PagedKVCache, heads_major_here
from .kv_groups import cache_layout
from .kv_layout import KVLayout
from .launch import Launch, StepLauncher
from .metadata import BatchMetadata
from .requests import Limits, RequestState, StepPlan, plan_step, with_pending, with_read, with_sampled
from .runner import PagedModelRunner, attention_of
from .state_cache import RecurrentStateCache
from .state_metadata import StateLedger, commit
from .vllm_sampling import (
    BatchSampler,
    SamplingRow,
    device_argmax,
    grammar_rows,
    in_output_order,
    needs_sampler,
)

logger = logging.getLogger(__name__)

TORCH_TO_MLX = {torch.float16: mx.float16, torch.bfloat16: mx.bfloat16, torch.float32: mx.float32}


class VllmModelRunner:
    def __init__(self, model: nn.Module, dispatcher: Dispatcher | None = None,
                 vllm_config: VllmConfig | None = None):
        self.model = model
        self.dispatcher = dispatcher
        self.launcher = StepLauncher.from_env()  # who sends steps to the device (launch.py)
        self.vocab_size = model.args.vocab_size
        self.sampler = BatchSampler(self.vocab_size, vllm_config or VllmConfig())
        self.runner: PagedModelRunner | None = None
        self.requests: dict[str, RequestState] = {}
        self._limits: Limits | None = None
        self.state_ledger: StateLedger = {}  # a hybrid model's state blocks, by its own count
        self.prompt_logprobs: dict[str, prompt_logprobs.PromptLogprobs] = {}
        # a forward's plan, its sampling rows' logits and the prompt logprobs it completed
        self._pending: tuple[StepPlan, mx.array, dict[str, LogprobsTensors]] | None = None
        # the last step, when it was launched without the host waiting for it (its rows sampled
        # on the device): the next forward waits for it, and reads its tokens into the states
        self._running: SampledOnDevice | None = None
        self.steps_sampled_on_device = 0  # steps whose rows need no Sampler (needs_sampler)
        # forwards built before the engine took the output of the step they follow (vLLM's
        # asynchronous scheduling): the host's work that overlapped the device's
        self.forwards_built_while_running = 0
        self._last_step_end: float | None = None  # for the debug log's time between steps
        self._logged_sampling: set[str] = set()  # sampling ways logged (their first use)

    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window as the runner attends with it (None: full attention),
        from its architecture (`runner.attention_of`)."""
        return tuple(layer.window for layer in attention_of(self.model)[1] if layer is not None)

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        """The cache vLLM's config describes (`kv_groups.cache_layout` checks it): its groups,
        their windows, and no more memory than its tensors hold; a hybrid model's
        (`_initialize_hybrid`) its attention group and its state groups."""
        recurrent = architecture(self.model.args.model_type).recurrent(self.model)
        if any(recurrent):
            self._initialize_hybrid(kv_cache_config, recurrent)
            return
        layout, spec = cache_layout(kv_cache_config, self.layer_windows())
        cache = self._kv_cache(spec, layout.num_layers, kv_cache_config.num_blocks,
                               spec.block_size, layout)
        self._start(cache, None, Limits(self.vocab_size, cache.block_size, cache.num_blocks,
                                        self.sampler.max_rows, cache.windows))
        if len(layout.groups) > 1:
            logger.info("paged_prefix: %d KV-cache groups (windows %s) over %d array pairs for "
                        "%d layers", len(layout.groups), list(cache.windows), layout.num_arrays,
                        layout.num_layers)

    def _initialize_hybrid(self, config: KVCacheConfig, recurrent: list) -> None:
        """A hybrid model (docs/hybrid.md): the attention layers' K/V in kernel blocks, r to a
        vLLM block of the same contiguous arrays; the recurrent layers' states in a store of
        their own, indexed by vLLM's block ids."""
        groups = CacheGroups.of(config, recurrent, TORCH_TO_MLX)
        spec = groups.attention_spec
        block = kernel_block_size(spec.block_size)
        ratio = spec.block_size // block
        cache = self._kv_cache(spec, recurrent.count(None), config.num_blocks * ratio, block)
        states = RecurrentStateCache(groups.state_specs, config.num_blocks)
        conv = {s.shapes[0][0] + 1 for s in groups.state_specs}
        hybrid = HybridLimits(groups, config.num_blocks, ratio, conv.pop())
        self._start(cache, states, Limits(self.vocab_size, block, cache.num_blocks,
                                          self.sampler.max_rows, hybrid=hybrid))
        logger.info("paged_prefix: hybrid model, %d attention layers in %d kernel blocks of %d "
                    "(%d to a vLLM block of %d), %d recurrent layers' states in %d state groups "
                    "of blocks of %d tokens (%.0f MiB of states, stored %s)", cache.num_layers,
                    cache.num_blocks, block, ratio, spec.block_size, states.num_layers,
                    len(groups.states), groups.state_block_size, states.nbytes / 2**20,
                    sorted({str(d) for s in groups.state_specs for d in s.dtypes}))

    def _kv_cache(self, spec, num_layers: int, num_blocks: int, block_size: int,
                  layout: KVLayout | None = None) -> PagedKVCache:
        if spec.dtype not in TORCH_TO_MLX:
            raise ValueError(f"kv_cache_config: dtype {spec.dtype} is not one of {list(TORCH_TO_MLX)}")
        heads_major = heads_major_here()
        logger.info("paged_prefix: KV cache laid out %s", "heads-major, [kv heads, rows, head "
                    "dim] per layer (MLX's CPU SDPA reads it in place)" if heads_major else
                    "as vLLM's pages, [blocks, block size, kv heads, head dim] per layer")
        return PagedKVCache(num_layers=num_layers, num_blocks=num_blocks, block_size=block_size,
                            num_kv_heads=spec.num_kv_heads, head_dim=spec.head_size,
                            dtype=TORCH_TO_MLX[spec.dtype], layout=layout,
                            heads_major=heads_major)

    def _start(self, cache: PagedKVCache, states: RecurrentStateCache | None,
               limits: Limits) -> None:
        self.runner = PagedModelRunner(self.model, cache, self.dispatcher, state_cache=states)
        # the runner's tree from here on: the caller's would keep the q/k/v and gate/up arrays
        # alive beside the runner's stacks of them
        self.model = self.runner.model
        # every array of it, not only the parameters (mlx-lm's Llama3RoPE and YarnRoPE keep
        # their frequencies lazily): one left lazy belongs to this thread's stream, which the
        # launch thread may not evaluate (launch.py)
        mx.eval(self.model)
        self._limits = limits

    def warm_up_limit(self) -> int:
        """The longest prefill `warm_up` can run in this cache."""
        return warmup.warm_up_limit(self._core("warm_up_limit").kv_cache)

    def warm_up(self, num_tokens: int) -> None:
        """Real forwards and sampling before the first request (`warmup.py`), then the read
        of a pending token a mixed step makes; no request state is kept."""
        runner = self._core("warm_up")
        self.launcher.wait()
        warmup.warm_up(runner, self.sampler, num_tokens)
        # a step of prompts beside a decode row reads the row's pending token with a gather,
        # whose kernels MLX's CUDA backend compiles on first use for argmax's token dtype: a
        # served burst's first such step took 3.9 s on an H100 without this (docs/results.md,
        # "H100: a burst's first step")
        tokens = device_argmax(mx.zeros((2, 2), dtype=mx.float32))
        mx.eval(read_pending(tokens, np.array([-1, 1, 0], dtype=np.int32),
                             mx.zeros((3,), dtype=mx.int32)))

    def _core(self, caller: str) -> PagedModelRunner:
        if self.runner is None:
            raise ValueError(f"initialize_kv_cache must run before {caller}")
        return self.runner

    # -- the step -----------------------------------------------------------------------
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Forward and sampling in one call (the offline engine's loop)."""
        out = self.run_forward(scheduler_output)
        if out is None:
            out = self.sample_tokens(None)
        return out.get_output() if isinstance(out, AsyncModelRunnerOutput) else out

    def run_forward(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """Build and launch the step's forward (once the step before has finished) and commit
        its request changes; `sample_tokens` follows unless this returns an output (no token
        was scheduled: only state changes)."""
        runner = self._core("execute_model")
        if self._pending is not None:
            raise ValueError("sample_tokens: the previous forward's tokens were never sampled")
        # every array of the step on the launcher's stream (launch.py), its metadata's too
        with self.launcher.building():
            return self._forward(runner, scheduler_output)

    def _forward(self, runner: PagedModelRunner,
                 scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        states = self.requests
        if self._running is not None and self._running.taken:
            # tokens the engine has taken (synchronous scheduling takes every step's output
            # before it schedules the next) are known to the scheduler, which may hand out a
            # block they end as a cached prefix in this very step: the check of such a hit
            # (metadata._check_shared_reads) compares them, not their placeholders
            states = self._read(states)  # committed with the step, as every change
        plan = plan_step(states, scheduler_output, self._limits, self.state_ledger)
        scoring = prompt_logprobs.live(self.prompt_logprobs, plan.requests,
                                       scheduler_output.scheduled_new_reqs, self.vocab_size)
        if plan.meta is None:
            self.requests, self.prompt_logprobs = self._read(plan.requests), scoring
            self._running = None
            return EMPTY_MODEL_RUNNER_OUTPUT
        step = prompt_logprobs.plan(scoring, plan.meta, {r: plan.requests[r].prompt_token_ids
                                                         for r in scoring})
        start = time.perf_counter()
        self.launcher.wait()  # the step before is encoded (launch.py)
        logits = runner.forward(self._reading_running(plan), step.rows)
        sampling = len(plan.meta.sample_req_ids)
        sampled = logits[:sampling]
        # the argmax `sample_tokens` will take, launched with the forward (one evaluation a
        # step): where no row needs vLLM's Sampler and the step has no grammar to apply
        argmax = None
        if sampling and not scheduler_output.has_structured_output_requests and \
                _sampler_reason(plan.requests, plan.meta.sample_req_ids) is None:
            argmax = device_argmax(sampled)
        built = time.perf_counter()
        if self._running is not None:
            self.forwards_built_while_running += not self._running.taken
            # the step before lets go of the cache arrays (module docstring)
            self.launcher.synchronize()
        waited = time.perf_counter()
        # the step before's tokens, read before this step's launch: that launch reads them in
        # as inputs, and only one thread may touch an array's completion event at a time
        requests = self._read(plan.requests)
        # from the launcher's thread when the host reads nothing of the step before the engine
        # asks for its tokens: no prompt rows to score now, no Sampler
        launch = self.launcher.launch([logits, argmax, *runner.cache_arrays()],
                                      in_thread=argmax is not None and not step.chunks)
        if plan.meta.states is not None:
            commit(self.state_ledger, plan.meta.states,
                   {r: requests[r].output_token_ids for r in plan.req_ids})
        if logger.isEnabledFor(logging.DEBUG):
            self._log_forward(plan.meta, start, built, waited)
        scoring, done = self._score_prompts(step, logits[sampling:], scoring)
        self.requests, self.prompt_logprobs = requests, scoring
        self._running, self._pending = None, (plan, sampled, argmax, done, launch)
        return None

    def _reading_running(self, plan: StepPlan) -> BatchMetadata:
        """The step's metadata, its input ids reading each pending token from the tokens of the
        step that sampled it, on the device, rather than the host's placeholder."""
        meta, running = plan.meta, self._running
        if running is None:
            return meta
        row_of = {r: i for i, r in enumerate(running.sample_ids)}
        attn = meta.groups[0].attn
        source = np.full(meta.num_tokens, -1, dtype=np.int32)  # row of `running.tokens`, or -1
        for s, r in enumerate(meta.req_ids):
            state = plan.requests[r]
            # the pending token's position, when there is one
            position = len(state.prompt_token_ids) + len(state.output_token_ids)
            first, end = attn.cu_seqlens_q_host[s:s + 2]  # the sequence's rows
            if state.pending and 0 <= position - attn.context_lens_host[s] < end - first:
                source[first + position - attn.context_lens_host[s]] = row_of[r]
        if (source < 0).all():
            return meta
        return dataclasses.replace(meta, input_ids=read_pending(running.tokens, source,
                                                                meta.input_ids))

    def _read(self, requests: dict[str, RequestState]) -> dict[str, RequestState]:
        """`requests` with the running step's sampled tokens read (waiting for it)."""
        if self._running is None:
            return requests
        running = self._running
        return with_read(requests, dict(zip(running.sample_ids, running.token_list())))

    def _score_prompts(self, step: prompt_logprobs.PromptLogprobsStep, logits: mx.array,
                       scoring: dict[str, prompt_logprobs.PromptLogprobs],
                       ) -> tuple[dict[str, prompt_logprobs.PromptLogprobs],
                                  dict[str, LogprobsTensors]]:
        """The step's prompt rows scored by vLLM's code (`BatchSampler.prompt_logprobs`), and
        the rows of the requests whose prompts it completes."""
        if not step.chunks:
            return scoring, {}
        start = time.perf_counter()
        scoring, done = prompt_logprobs.scored(step, np.array(logits), scoring,
                                               self.sampler.prompt_logprobs)
        logger.debug("step: prompt logprobs of %d rows for %d requests (%d complete) in "
                     "%.1f ms", len(step.rows), len(step.chunks), len(done),
                     1e3 * (time.perf_counter() - start))
        return scoring, done

    def sample_tokens(self, grammar_output: GrammarOutput | None,
                      ) -> ModelRunnerOutput | SampledOnDevice:
        """Sample the pending forward's rows: on the device when no row `needs_sampler` (and
        none has a grammar), else with vLLM's Sampler, constrained by the structured-output
        requests' grammar bitmask when there is one; append the tokens. Each way is logged
        the first time it runs, with the reason."""
        if self._pending is None:
            raise ValueError("sample_tokens: no forward is pending (run_forward first)")
        (plan, logits, argmax, prompt_done, launch), self._pending = self._pending, None
        sample_ids = plan.meta.sample_req_ids
        grammar = grammar_rows(grammar_output, sample_ids)
        start = time.perf_counter()
        if grammar:
            why = "a grammar bitmask"
        elif argmax is not None:  # run_forward found no row that needs the Sampler
            why = None
        else:
            why = _sampler_reason(self.requests, sample_ids)
        if why is None:
            self._log_once("argmax on the device", ", returned before the step has run (every "
                           "row greedy, nothing changing its logits, no logprobs)")
            return self._sample_on_device(plan, logits, argmax, launch, prompt_done, start)
        self._log_once("vLLM's Sampler", f" (first for a row's {why})")
        self.launcher.wait()
        mx.eval(logits, self.runner.cache_arrays())  # the step's one host sync
        sampled: dict[str, int] = {}
        logprobs = None
        if sample_ids:
            rows = [_sampling_row(self.requests[r]) for r in sample_ids]
            out = self.sampler.sample(logits, rows, grammar)
            sampled = dict(zip(sample_ids, out.sampled_token_ids[:, 0].tolist()))
            if out.logprobs_tensors is not None:
                logprobs = in_output_order(out.logprobs_tensors.tolists(), sample_ids,
                                           plan.req_ids)
        self.requests = with_sampled(self.requests, sampled)
        self._last_step_end = time.perf_counter()
        logger.debug("step: sampled %d rows in %.1f ms, ending at t=%.4f s (vLLM's Sampler)",
                     len(sample_ids), 1e3 * (self._last_step_end - start), self._last_step_end)
        return _output(plan.req_ids, sampled, logprobs, prompt_done)

    def _sample_on_device(self, plan: StepPlan, logits: mx.array, argmax: mx.array | None,
                          launch: Launch | None, prompt_done: dict[str, LogprobsTensors],
                          start: float) -> SampledOnDevice:
        """Every row (if any) samples its argmax (`needs_sampler`): taken on the device,
        launched with the forward (`argmax`, by `launch` when the launcher's thread sent it)
        or else now; the tokens stay there for the next forward, and reach the host when the
        engine (or the next forward, once its graph is built) reads them."""
        sample_ids = plan.meta.sample_req_ids
        tokens = argmax
        if tokens is None:  # no row samples, or the step may have had a grammar to apply
            with self.launcher.building():
                tokens = device_argmax(logits)
                self.launcher.launch([tokens], in_thread=False)
        self.requests = with_pending(self.requests, sample_ids)
        self._running = SampledOnDevice(plan.req_ids, sample_ids, tokens, prompt_done, launch)
        self.steps_sampled_on_device += 1
        self._last_step_end = time.perf_counter()
        logger.debug("step: sampled %d rows in %.1f ms, ending at t=%.4f s (argmax on the "
                     "device, read by the host later)", len(sample_ids),
                     1e3 * (self._last_step_end - start), self._last_step_end)
        return self._running

    def _log_once(self, way: str, why: str) -> None:
        """The sampling `way` (`why` follows it in the line), the first time it runs."""
        if way not in self._logged_sampling:
            self._logged_sampling.add(way)
            logger.info("paged_prefix sampling: %s%s", way, why)

    def _log_forward(self, meta: BatchMetadata, start: float, built: float,
                     waited: float) -> None:
        """Where a step's time goes, for TTFT questions: its shape, the attention path (and
        for SDPA where its K/V came from), the forward's time and the idle time before it, and
        MLX's memory (held by arrays, and freed but cached) when the forward was launched; `t`
        is `time.perf_counter()`, the clock vLLM's benchmark client stamps requests with
        (bench/ttft_breakdown.py lines the two up)."""
        q = meta.groups[0].attn.q_lens_host
        d = self.runner.dispatcher
        sources = d.last.summary()
        attention = f"{d.last.path} attention" + (f" (sequences: {sources})" if sources else "")
        idle = "" if self._last_step_end is None else \
            f", {1e3 * (start - self._last_step_end):.1f} ms after the last step"
        logger.debug("step: %d sequences (%d of one token), %d tokens after %d already in the "
                     "cache, %s; forward %.1f ms (%.1f ms of it building the graph, %.1f ms "
                     "waiting for the step before) from t=%.4f s%s; MLX memory %.0f MiB active, "
                     "%.0f MiB cached", len(q), int((q == 1).sum()), int(q.sum()),
                     int(meta.groups[0].attn.context_lens_host.sum()), attention,
                     1e3 * (time.perf_counter() - start), 1e3 * (built - start),
                     1e3 * (waited - built), start, idle, mx.get_active_memory() / 2**20,
                     mx.get_cache_memory() / 2**20)


def read_pending(tokens: mx.array, source: np.ndarray, input_ids: mx.array) -> mx.array:
    """`input_ids` with row i read from `tokens[source[i]]` where `source[i] >= 0`: a step's
    pending tokens, read on the device from the tokens of the step that sampled them."""
    if np.array_equal(source, np.arange(len(tokens))):
        # every row the token sampled for it, in the same order (a decode step of the same
        # requests): the tokens themselves, with no host-written index or mask
        read = tokens
    else:
        read = mx.take(tokens, mx.array(np.maximum(source, 0)))
    read = read.astype(input_ids.dtype)
    if (source >= 0).all():
        return read
    return mx.where(mx.array(source >= 0), read, input_ids)


class SampledOnDevice(AsyncModelRunnerOutput):
    """A step's output whose tokens (argmax per sampling row) are still on the device: vLLM's
    engine asks for it with `get_output` (its executor may do so from another thread), the
    runner reads the same tokens into its request states; both read them once."""

    def __init__(self, req_ids: list[str], sample_ids: tuple[str, ...], tokens: mx.array,
                 prompt_done: dict[str, LogprobsTensors], launch: Launch | None = None):
        """`launch`: the launcher thread's sending of the step, when it sent it."""
        self.req_ids, self.sample_ids, self.tokens = req_ids, sample_ids, tokens
        self._prompt_done = prompt_done
        self._launch = launch
        self._lock = threading.Lock()
        self._values: list[int] | None = None

    @property
    def taken(self) -> bool:
        """Whether the tokens have reached the host."""
        return self._values is not None

    def token_list(self) -> list[int]:
        """The sampled tokens, in `sample_ids` order (waits for the step)."""
        with self._lock:
            if self._values is None:
                if self._launch is not None:  # encoded, so that reading it uses no encoder
                    self._launch.wait()
                self._values = self.tokens.tolist()
            return self._values

    def get_output(self) -> ModelRunnerOutput:
        return _output(self.req_ids, dict(zip(self.sample_ids, self.token_list())), None,
                       self._prompt_done)


def _output(req_ids: list[str], sampled: dict[str, int], logprobs,
            prompt_done: dict[str, LogprobsTensors]) -> ModelRunnerOutput:
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=[[sampled[r]] if r in sampled else [] for r in req_ids],
        logprobs=logprobs,
        prompt_logprobs_dict=prompt_done,
    )


def _sampler_reason(requests: dict[str, RequestState], sample_ids: tuple[str, ...]) -> str | None:
    """Why one of the sampling rows needs vLLM's Sampler (`needs_sampler`), or None."""
    return next((w for r in sample_ids if (w := needs_sampler(requests[r].params))), None)


def _sampling_row(state: RequestState) -> SamplingRow:
    # a list of its own: vLLM's logits processors are handed the outputs as a list
    return SamplingRow(state.params, state.prompt_token_ids, list(state.output_token_ids),
                       state.generator)
