"""One forward's attention: routed once (`route.route`), checked, planned, then run by every
layer.

    attention = dispatcher.plan(meta.attn, geometry)   # per forward and variant: route, plan
    attention.check(q, k, v, k_cache, v_cache, sinks)  # the first layer: shapes against the plan
    out = attention(q, k, v, k_cache, v_cache, sinks)  # every layer: launches only, no host sync

The route's sequences go to their executors (`jit_kernels.interface`): the paged kernel first
(its output holds every row), then the prefill kernel, then SDPA over new rows or pages read in
place (one run of blocks, or a few), then SDPA over gathered pages, each writing its sequences'
rows into the output of the one before.

The geometry carries the layer's attention variant (window, softcap, sinks: `reference.contract`),
so a model whose layers differ plans once per kind of layer. A batch planned again (the same
`AttentionMetadata` object and geometry, e.g. a benchmark repeating one step) reuses its plan:
its device arrays are written by the host once (on a CUDA GPU a host-written array lives in
managed memory, and the first kernel that reads near it pays a page migration: docs/kernels.md,
"Host-written arrays").

The route is logged once per kind and counted per layer call, so tests can check which path
really ran and users can see when a slow path was taken. The first use of a backend for a
kernel variant runs the canary (`canary.py`) on each of its executors that the variant
supports, whichever the route picked, so that a server's warm-up builds and checks them all; a
failed executor is logged once and any route that would run it runs the reference instead,
unless PAGED_PREFIX_STRICT_KERNELS=1 (tests, benchmarks) or the path is forced, which raise.

Override with `Dispatcher(path=...)` or PAGED_PREFIX_ATTENTION (auto, reference, sdpa, cuda,
metal). A forced kernel that cannot run the call raises ValueError: no silent fallback.
"""

from __future__ import annotations

import logging
import os
from collections import Counter

import mlx.core as mx

from jit_kernels import (
    AttentionKernel,
    ContiguousSdpa,
    GatheredSdpa,
    KernelBackend,
    ReferenceAttention,
    available_backends,
)
from jit_kernels.geometry import Geometry

from . import canary, rules
from .attention_metadata import AttentionMetadata
from .route import Route, Source, route
from .validate import as_int

ENV_VAR = "PAGED_PREFIX_ATTENTION"
STRICT_ENV_VAR = "PAGED_PREFIX_STRICT_KERNELS"
PATHS = ("auto", "reference", "sdpa", "cuda", "metal")
# Metadata objects whose plans are kept: every KV-cache group of a forward has its own.
MAX_PLANNED_METADATA = 16

log = logging.getLogger(__name__)

_CONTIGUOUS, _REFERENCE, _MLX_GATHER = ContiguousSdpa(), ReferenceAttention(), GatheredSdpa()


class ForwardAttention:
    """One forward's route and its executors' plans, called by every layer."""

    def __init__(self, route: Route, parts: tuple[tuple[AttentionKernel, object], ...],
                 counts: Counter):
        self.route, self.parts, self.counts = route, parts, counts

    def check(self, q: mx.array, k: mx.array, v: mx.array, k_cache: mx.array,
              v_cache: mx.array, sinks: mx.array | None = None) -> None:
        """The entry check of every executor: the layers after the first of this geometry have
        the same shapes, so they skip it (one op fewer to build per layer)."""
        for kernel, plan in self.parts:
            kernel.check(q, k, v, k_cache, v_cache, plan, sinks)

    def __call__(self, q: mx.array, k: mx.array, v: mx.array, k_cache: mx.array,
                 v_cache: mx.array, sinks: mx.array | None = None) -> mx.array:
        """q [T, H, D] and the new rows k, v [T, Hkv, D] (already in the caches); the layer's
        caches as `PagedKVCache` stores them, or as [num_blocks, BS, Hkv, D] of its dtype;
        `sinks` [H] float32, the layer's, exactly when the geometry has sinks."""
        self.counts[self.route.path] += 1
        out = None
        for kernel, plan in self.parts:
            out = kernel.run(q, k, v, k_cache, v_cache, plan, out, sinks)
        return out


class Dispatcher:
    """Routes, checks and plans forwards; owns its rules' state (bounded)."""

    def __init__(self, path: str | None = None,
                 backends: dict[str, KernelBackend] | None = None, strict: bool | None = None,
                 rule_of=None):
        """`rule_of(backend)`: the measured rule for a backend (default `rules.rule_for`)."""
        path = path or os.environ.get(ENV_VAR, "auto")
        self.backends = available_backends() if backends is None else backends
        if path not in PATHS and path not in self.backends:
            raise ValueError(f"{ENV_VAR}/path: expected one of {PATHS}, got {path!r}")
        self.path = path
        self.strict = os.environ.get(STRICT_ENV_VAR) == "1" if strict is None else strict
        self.rules = {name: (rule_of or rules.rule_for)(b) for name, b in self.backends.items()}
        self.counts: Counter[str] = Counter()
        self.last: Route | None = None
        self._logged: set[tuple] = set()
        # the plans of the last forward's metadata (one per KV-cache group), per (geometry,
        # route): a forward plans one per kind of layer, and a step run again reuses them
        self._planned: dict[int, tuple] = {}  # id(metadata) -> (metadata, {key: attention})

    def plan(self, meta: AttentionMetadata, g: Geometry, layers: int = 1) -> ForwardAttention:
        """Route, validate (canary on first use) and plan one forward of `layers` layers of
        this geometry (the rules weigh a cuDNN graph, built once, against time per layer);
        nothing is written."""
        count = as_int(layers, "layers", low=1)
        if g.block_size != meta.block_size:
            raise ValueError(f"geometry: block size {g.block_size} but the metadata was built "
                             f"for {meta.block_size}")
        try:
            chosen = route(meta.lengths, meta.block_tables_host, g, self.path, self.backends,
                           self.rules, count)
        except ValueError as e:
            raise ValueError(f"{ENV_VAR}/{e}") from None
        chosen = self._validated(chosen, g)
        key = (chosen.kind(), g.variant(), "decode" if meta.max_q_len == 1 else "prefill")
        if key not in self._logged:
            self._logged.add(key)
            log.info("paged attention: %s (%s) for %s %s", chosen.path, chosen.reason,
                     g.describe(), key[2])
        self.last = chosen
        if id(meta) not in self._planned:  # frozen: by identity (held, so the id stays its own)
            if len(self._planned) >= MAX_PLANNED_METADATA:
                self._planned.clear()
            self._planned[id(meta)] = meta, {}
        plans = self._planned[id(meta)][1]
        if (g, chosen) not in plans:
            plans[g, chosen] = ForwardAttention(chosen, self._parts(chosen, meta, g), self.counts)
        return plans[g, chosen]

    def _parts(self, r: Route, meta: AttentionMetadata, g: Geometry) -> tuple:
        backend = self.backends.get(r.backend)
        lengths, table = meta.lengths, meta.block_tables
        parts = []

        def add(kernel, seqs, **options):
            if seqs:
                parts.append((kernel, kernel.plan(lengths, g, table, seqs, **options)))
        add(_REFERENCE, r.seqs(Source.REFERENCE))
        if backend is not None:
            add(backend.attention, r.seqs(Source.PAGED))
            add(backend.prefill, r.seqs(Source.PREFILL))
        add(_CONTIGUOUS, r.seqs(Source.NEW_ROWS, Source.IN_PLACE, Source.RUNS),
            runs=dict(r.page_runs))
        add(self._gatherer(backend, g), r.seqs(Source.GATHERED))
        return tuple(parts)

    @staticmethod
    def _gatherer(backend: KernelBackend | None, g: Geometry) -> GatheredSdpa:
        """The backend's gather kernel where it runs this variant, else MLX's take."""
        if backend is None or backend.gathered.unsupported_reason(g) is not None:
            return _MLX_GATHER
        return backend.gathered

    def _validated(self, r: Route, g: Geometry) -> Route:
        backend = self.backends.get(r.backend)
        if backend is None:
            return r
        needed = {Source.PAGED: backend.attention, Source.PREFILL: backend.prefill,
                  Source.GATHERED: self._gatherer(backend, g)}
        used = {needed[s] for s in r.sources if s in needed}
        self._check_all(backend, g, used)
        for kernel in used:
            why = backend.verdicts.get((kernel.name, g.variant()))  # none for MLX's take
            if why is None:
                continue
            if self.strict or self.path != "auto":
                raise RuntimeError(f"{kernel.name} for {g.variant()} failed its first-use "
                                   f"check: {why}")
            return Route("reference", f"{kernel.name} failed its first-use check: {why}", None,
                         (Source.REFERENCE,) * len(r.sources))
        return r

    @staticmethod
    def _check_all(backend: KernelBackend, g: Geometry, used: set) -> None:
        """The canary for the executors a route runs and, with them, for every other executor
        of the backend this variant supports: a server's warm-up then builds and checks them
        all, and no request waits for a check when a later step first takes another path."""
        for kernel in backend.executors():
            key = (kernel.name, g.variant())
            # every forward comes here: once checked, a kernel costs a lookup
            if key in backend.verdicts or (kernel not in used and
                                           kernel.unsupported_reason(g) is not None):
                continue
            backend.verdicts[key] = why = canary.check(kernel, g)
            if why:
                log.warning("paged attention: %s for %s failed its first-use check (%s); "
                            "using the reference", kernel.name, g.describe(), why)
