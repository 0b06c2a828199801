"""The model runner core: one packed forward over scheduled requests, no vLLM types.

`PagedModelRunner.forward(meta)` runs its own copy of an mlx-lm model (`paged_model.py`: the
same weight arrays, the caller's model left as it was) whose attention reads and writes the
paged KV cache, computing only the scheduled tokens, and returns the logits of the rows that
sample (and of the prompt rows a request wants prompt logprobs for). Its architecture
(`architectures`) gives the embedding and the logits around mlx-lm's own decoder layers, and
each layer's attention geometry (window, softcap, sinks): a forward plans one attention per
distinct geometry. Every check runs before the first cache write, and a forward that raises
while its graph is built leaves the cache as it was, unless it raises after pipelined
evaluation began (an error inside the model's own code past layer 0): then the layers already
evaluated have written their rows, into this forward's own slots and no others.

Pipelining (by default on a GPU, for forwards of at least PIPELINE_MIN_TOKENS new tokens): the
graph is sent to the device (`mx.async_eval`) after layers 0, 1, 3, 7, ..., so the host builds
later layers while the device runs earlier ones. Built in one piece, a 512-token suffix's
graph costs the host ~1 ms on a 1B model (H200), all of it ahead of the first kernel, because a
step's host sync leaves nothing to hide it behind. The model runs on packed [T, hidden] rows
with fewer ops per layer than mlx-lm builds (`linear.py`, `mlp.py`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from jit_kernels.arrays import device_array
from jit_kernels.geometry import Geometry

from .architectures import Architecture, LayerAttention, architecture, check_model
from .architectures.base import RecurrentLayer
from .attention import ForwardContext, PagedAttention
from .dispatch import Dispatcher, ForwardAttention
from .kv_cache import PagedKVCache, Slots
from .metadata import BatchMetadata
from .paged_model import paged_model
from .recurrent_layers import ForwardStates
from .state_cache import RecurrentStateCache
from .validate import as_ints


@dataclass
class RunnerStats:
    forwards: int = 0
    tokens_computed: int = 0  # rows that went through the model: the suffix-only count


def attention_of(model: nn.Module) -> tuple[Architecture, list[LayerAttention | None]]:
    """The model's architecture and each layer's attention (`architectures.check_model`; None on
    a hybrid model's recurrent layers); a runner's own tree, taken over again, keeps the
    attention its layers already run."""
    attns = [layer.get("self_attn") for layer in model.layers]
    if any(isinstance(a, PagedAttention) for a in attns):
        return architecture(model.args.model_type), [
            a.spec if isinstance(a, PagedAttention) else None for a in attns]
    return check_model(model)


def check_state_cache(state_cache: RecurrentStateCache | None,
                      recurrent: list[RecurrentLayer | None]) -> None:
    """A state cache exactly when the model has recurrent layers, holding their states."""
    layers = [r for r in recurrent if r is not None]
    if not layers:
        if state_cache is not None:
            raise ValueError("state_cache: the model has no recurrent layers")
        return
    if state_cache is None:
        raise ValueError(f"state_cache: the model's {len(layers)} recurrent layers keep their "
                         "state in a RecurrentStateCache")
    if state_cache.num_layers != len(layers):
        raise ValueError(f"state_cache: {state_cache.num_layers} layers for a model with "
                         f"{len(layers)} recurrent layers")
    for i, (layer, spec) in enumerate(zip(layers, state_cache.specs)):
        if (spec.shapes, spec.compute_dtypes) != (layer.shapes, layer.compute_dtypes):
            raise ValueError(f"state_cache: recurrent layer {i} keeps states {layer.shapes} "
                             f"in {layer.compute_dtypes}, the cache holds {spec.shapes} "
                             f"computed in {spec.compute_dtypes}")


# Side by side on the H200, 1.1B config (docs/gpu.md at commit 9fc46d4, "Pipelining"): prefills of 4096 and
# 2048 tokens took 5-15% less time pipelined; a 512-token suffix over 3584 cached tokens, whose
# layers are too short on the device to hide the host's work behind, took 6-8% more.
PIPELINE_MIN_TOKENS = 1024


def _sends_after(layer: int) -> bool:
    """Pipelined forwards send the graph to the device after layers 0, 1, 3, 7, 15, ...: the
    device's backlog doubles each time, so it stays busy while the host builds the rest, and a
    forward pays for a handful of evaluations rather than one per layer (per layer, short
    suffixes measured slower than one evaluation at the end)."""
    return (layer + 1) & layer == 0


# A forward built in one piece whose graph took at least this long skips the wait below.
MIN_BUILD_S_WITHOUT_WAIT = 0.5e-3


def _release_last_step() -> None:
    """Wait until MLX has let go of the previous step's buffers. MLX holds what a step sent to
    the device until a worker thread learns the device is done, which can come after the
    step's evaluation returned, and a write into a cache array still held copies the whole
    array instead of updating it in place. A pipelined forward sends layer 0's writes one
    layer's build after the previous step, so it waits first; so does a forward whose whole
    graph took less than MIN_BUILD_S_WITHOUT_WAIT to build. Others send their first write a
    whole build later: on the H200 no step copied without the wait (bench/probes/pool_copies.py, a
    1 GiB-per-layer cache, 50 decode and 50 prefill steps of a 1.1B model; the prefill's
    build took ~1 ms), where the wait cost 0.2-0.5 ms a step."""
    mx.synchronize()


def _wait_for_device(hidden: mx.array, written: list[mx.array]) -> None:
    """Run everything built so far and wait until MLX lets go of it: a layer whose arrays an
    earlier layer of the forward wrote (KV-cache groups sharing memory, `kv_layout.py`) would
    otherwise write while that layer's attention may still hold them, and MLX copies an array
    a pending op holds (six layers writing one 128 MiB array and reading it back, on the CPU:
    522 MiB more peak memory without the wait, 4 MiB with it)."""
    mx.async_eval(hidden, written)
    mx.synchronize()


def _check_group_windows(kv_cache: PagedKVCache, windows: list[int | None]) -> None:
    """A windowed KV-cache group keeps only the blocks its window sees: its layers must attend
    with that window (a full group keeps every block, for any layer)."""
    for i, window in enumerate(windows):
        kept = kv_cache.windows[kv_cache.layout.group_of[i]]
        if kept is not None and window != kept:
            raise ValueError(f"kv_cache: layer {i} attends with window {window}, but its "
                             f"KV-cache group keeps the blocks of a window of {kept}")


def _checked_rows(rows: np.ndarray | None, num_tokens: int) -> np.ndarray:
    """Prompt-logprob rows as int32 packed-row indices, each one of the forward's rows."""
    if rows is None:
        return np.zeros(0, dtype=np.int32)
    return as_ints(rows, "prompt_rows", low=0, high=num_tokens - 1).astype(np.int32)


class PagedModelRunner:
    def __init__(self, model: nn.Module, kv_cache: PagedKVCache,
                 dispatcher: Dispatcher | None = None, pipeline: bool | None = None,
                 state_cache: RecurrentStateCache | None = None):
        """state_cache: the states of a hybrid model's recurrent layers (`state_cache.py`);
        the KV cache then holds its attention layers only, in layer order."""
        arch, specs = attention_of(model)
        recurrent = arch.recurrent(model)
        attention_layers = [i for i, spec in enumerate(specs) if spec is not None]
        num_layers = len(attention_layers)
        if kv_cache.num_layers != num_layers:
            raise ValueError(f"kv_cache: {kv_cache.num_layers} layers for a model with "
                             f"{num_layers} attention layers")
        check_state_cache(state_cache, recurrent)
        for i, spec in ((i, specs[i]) for i in attention_layers):
            if (kv_cache.num_kv_heads, kv_cache.head_dim) != (spec.num_kv_heads, spec.head_dim):
                raise ValueError(
                    f"kv_cache: {kv_cache.num_kv_heads} kv heads of {kv_cache.head_dim} but the "
                    f"model's layer {i} has {spec.num_kv_heads} of {spec.head_dim}")
        # the runner's own tree: the caller's model is left as it was
        self.model = paged_model(model, specs, recurrent)
        self.architecture = arch
        self.kv_cache = kv_cache
        self.state_cache = state_cache
        # per model layer, what it writes: ("kv", its KV-cache layer) or ("state", its state
        # cache layer), for pipelined forwards
        recurrent_layers = [i for i, r in enumerate(recurrent) if r is not None]
        self._writes = {**{i: ("kv", n) for n, i in enumerate(attention_layers)},
                        **{i: ("state", n) for n, i in enumerate(recurrent_layers)}}
        # per model layer: the context it reads (its KV-cache group's; a recurrent layer reads
        # only the states, in any group's context) and whether it waits for the device first
        # (its arrays hold an earlier layer's writes: `_wait_for_device`)
        layout = kv_cache.layout
        self._layer_steps = tuple(
            (layout.group_of[n], n in layout.wait_before) if kind == "kv" else (0, False)
            for kind, n in (self._writes[i] for i in range(len(self._writes))))
        self.dispatcher = dispatcher or Dispatcher()
        # one per attention layer (in KV-cache order); a forward plans each distinct one once
        # per KV-cache group
        self.geometries = tuple(
            self.model.layers[i].self_attn.geometry(kv_cache.block_size, kv_cache.dtype,
                                                    kv_cache.heads_major)
            for i in attention_layers)
        _check_group_windows(kv_cache, [g.window for g in self.geometries])
        self.vocab_size = model.args.vocab_size
        self.pipeline = pipeline  # None: on a GPU, for forwards of PIPELINE_MIN_TOKENS or more
        self.stats = RunnerStats()
        self._last_slots: tuple | None = None  # ((metadata, cache), its checked slots)

    @property
    def geometries(self) -> tuple[Geometry, ...]:
        return self._geometries

    @geometries.setter
    def geometries(self, geometries: tuple[Geometry, ...]) -> None:
        """Also the distinct (KV-cache group, geometry) pairs a forward plans once each, each
        layer's pair among them, how many layers have each, and the first layer of each (it
        runs the plan's entry check): worked out here, not per forward."""
        self._geometries = tuple(geometries)
        kinds = list(zip(self.kv_cache.layout.group_of, self._geometries, strict=True))
        self._kinds = tuple(dict.fromkeys(kinds))
        self._kind_of = tuple(self._kinds.index(k) for k in kinds)
        self._layers_of_kind = tuple(self._kind_of.count(k) for k in range(len(self._kinds)))
        self._first_of_kind = frozenset(kinds.index(k) for k in self._kinds)

    def _check(self, meta: BatchMetadata) -> None:
        if not isinstance(meta, BatchMetadata):
            raise ValueError(f"meta: expected build_batch_metadata's BatchMetadata, got "
                             f"{type(meta).__name__}")
        windows = tuple(g.attn.window for g in meta.groups)
        if windows != self.kv_cache.windows:
            raise ValueError(f"windows: metadata built for KV-cache groups of windows "
                             f"{windows}, the cache's are {self.kv_cache.windows}")
        attn = meta.groups[0].attn  # the groups share their block size and pool
        if attn.block_size != self.kv_cache.block_size:
            raise ValueError(f"block_size: metadata built for {attn.block_size}, the cache has "
                             f"{self.kv_cache.block_size}")
        if attn.num_blocks > self.kv_cache.num_blocks:
            raise ValueError(f"num_blocks: metadata allows block ids < {attn.num_blocks}, the "
                             f"cache has {self.kv_cache.num_blocks} blocks")
        if (meta.states is None) != (self.state_cache is None):
            raise ValueError("states: a hybrid model's forward needs its state rows "
                             "(state_metadata.build_state_metadata), any other model none")
        if meta.states is not None and \
                meta.states.plan.cu_seqlens != tuple(attn.cu_seqlens_q_host.tolist()):
            raise ValueError(f"states: built for rows {meta.states.plan.cu_seqlens}, the batch "
                             f"packs {attn.cu_seqlens_q_host.tolist()}")
        low, high = int(meta.input_ids_host.min()), int(meta.input_ids_host.max())
        if low < 0 or high >= self.vocab_size:
            raise ValueError(f"token_ids: {low if low < 0 else high} is outside the model's "
                             f"vocabulary of {self.vocab_size}")

    def _slots(self, meta: BatchMetadata) -> tuple[Slots, ...]:
        """Each KV-cache group's slots checked against the cache; a batch run again (the same
        frozen metadata, as a benchmark repeats one step) reuses them, as the dispatcher its
        plan."""
        key = (meta, self.kv_cache)
        if self._last_slots is None or self._last_slots[0] != key:
            self._last_slots = key, tuple(self.kv_cache.slots(g.slot_mapping_host, g.slot_mapping)
                                          for g in meta.groups)
        return self._last_slots[1]

    def _plan(self, meta: BatchMetadata) -> tuple[tuple[ForwardAttention, ...], frozenset[int]]:
        """Each layer's planned attention, one plan per KV-cache group (its tables) and distinct
        geometry, and the layers that run each plan's entry check (the first of its kind)."""
        planned = [self.dispatcher.plan(meta.groups[group].attn, g, layers)
                   for (group, g), layers in zip(self._kinds, self._layers_of_kind)]
        return tuple(planned[i] for i in self._kind_of), self._first_of_kind

    def forward(self, meta: BatchMetadata, prompt_rows: np.ndarray | None = None) -> mx.array:
        """Logits (float32), lazily: one row per request that samples (`meta.sample_req_ids`
        order), then one per packed row listed in `prompt_rows` (rows whose prompt logprobs
        a request asked for); the caller evaluates them together with `cache_arrays()`."""
        self._check(meta)
        prompt_rows = _checked_rows(prompt_rows, meta.num_tokens)
        plans = self._plan(meta)  # each attention layer's, for its group
        # a hybrid model's starting states, read (and evaluated) before any write
        states = None if meta.states is None else ForwardStates.read(self.state_cache,
                                                                      meta.states)
        contexts = [ForwardContext(meta, self.kv_cache, slots, *plans, states=states)
                    for slots in self._slots(meta)]  # per group: its slots
        # mlx-lm's model loop, with no mask (causality and windows come from the metadata)
        inner = self.model.model
        pipeline = self.pipeline
        if pipeline is None:
            pipeline = mx.default_device() == mx.gpu and meta.num_tokens >= PIPELINE_MIN_TOKENS
        start = time.perf_counter()
        snapshot = self._snapshot()
        unsent = 0  # the first layer whose writes have not been sent to the device
        try:
            hidden = self.architecture.embed(self.model, meta.input_ids)  # [T, hidden]: packed
            for i, (layer, (group, waits)) in enumerate(zip(inner.layers, self._layer_steps, strict=True)):
                if waits:
                    snapshot = None
                    if unsent == 0:
                        _release_last_step()
                    _wait_for_device(hidden, self._written(range(unsent, i)))
                    unsent = i
                hidden = layer(hidden, None, contexts[group])
                if pipeline and _sends_after(i):
                    # while the snapshot shares the arrays, an evaluated write would copy them
                    snapshot = None
                    if i == 0:
                        _release_last_step()
                    # the writes too (a layer whose attention does not read the cache back
                    # would keep its new K/V alive until the step's end), and only those: MLX
                    # holds what it is sent until the device catches up, so sending a layer
                    # not yet written would make its write copy the whole layer array
                    # (every write of a 4096-token forward over a 1 GiB-per-layer cache did)
                    mx.async_eval(hidden, self._written(range(unsent, i + 1)))
                    unsent = i + 1
        except BaseException:
            if snapshot is not None:
                self._restore(snapshot)
            raise
        del snapshot
        if not pipeline and time.perf_counter() - start < MIN_BUILD_S_WITHOUT_WAIT:
            _release_last_step()
        self.stats.forwards += 1
        self.stats.tokens_computed += meta.num_tokens
        if not meta.sample_req_ids and not len(prompt_rows):
            # a mid-prompt chunk: only its K/V writes matter
            return mx.zeros((0, self.vocab_size), dtype=mx.float32)
        # Only rows that sample, or that a request's prompt logprobs need, pay for the final
        # norm (row-wise) and the vocabulary projection; each set in a projection of its own,
        # so the sampling rows' logits are the same bits whether or not prompt rows ride
        # along (a matmul's rounding may follow its row count: gemv for one row).
        picked = [meta.logits_indices] if meta.sample_req_ids else []
        if len(prompt_rows):
            picked.append(device_array(prompt_rows))
        logits = [self.architecture.logits(
            self.model, self.architecture.norm(self.model, mx.take(hidden, rows, axis=0)))
            for rows in picked]
        return (logits[0] if len(logits) == 1 else mx.concatenate(logits)).astype(mx.float32)

    def cache_arrays(self) -> list[mx.array]:
        """Every array a forward writes (K/V, and a hybrid model's states): what the caller
        evaluates with the logits."""
        states = [] if self.state_cache is None else self.state_cache.arrays()
        return self.kv_cache.arrays() + states

    def _written(self, layers: range) -> list[mx.array]:
        """The arrays model layers `layers` write: K/V of attention layers, states of
        recurrent ones."""
        kv = [n for kind, n in map(self._writes.__getitem__, layers) if kind == "kv"]
        states = [a for kind, n in map(self._writes.__getitem__, layers) if kind == "state"
                  for a in self.state_cache.blocks(n)]
        return (self.kv_cache.arrays(range(kv[0], kv[-1] + 1)) if kv else []) + states

    def _snapshot(self) -> tuple:
        return (self.kv_cache.snapshot(),
                None if self.state_cache is None else self.state_cache.snapshot())

    def _restore(self, snapshot: tuple) -> None:
        self.kv_cache.restore(snapshot[0])
        if snapshot[1] is not None:
            self.state_cache.restore(snapshot[1])

    def greedy(self, meta: BatchMetadata) -> list[int]:
        """Greedy next token per sampling row; the one host sync of a step."""
        logits = self.forward(meta)
        if not meta.sample_req_ids:
            mx.eval(self.cache_arrays())
            return []
        tokens = mx.argmax(logits, axis=-1)
        mx.eval(tokens, self.cache_arrays())
        return tokens.tolist()
