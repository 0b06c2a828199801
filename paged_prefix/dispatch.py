"""Per-forward choice of the attention path, planned once and then run by every layer.

    attention = dispatcher.plan(meta.attn, geometry)   # once per forward: choose, check, plan
    out = attention(q, k, v, k_cache, v_cache)         # every layer: launches only, no host sync

Paths:
  reference  MLX gather + SDPA per sequence (`reference.paged_attention`), the oracle;
  sdpa       SDPA per sequence over the new K/V when nothing is cached, else over its pages:
             read in place when they are one run of consecutive blocks, else copied by the
             backend's page-gather kernel (MLX's take where there is none);
  cuda/metal the backend's paged kernel: one launch for the whole batch;
  mixed      (auto only) both, when the backend's rule picks SDPA for some sequences of a
             batch only (long prefills next to decode rows): one kernel launch for the rest,
             whose rows of the output the SDPA sequences' rows then overwrite.
On Hopper the rule may hand some picked sequences to the backend's prefill kernel instead
(`Choice.prefill_seqs`): the sdpa and mixed paths then launch it once for them, reading their
pages in place of a gather.

A batch planned again (the same `AttentionMetadata` object, e.g. a benchmark repeating one
step) reuses the plan of the path chosen: its device arrays are written by the host once. On a
CUDA GPU a host-written array lives in managed memory, and the first kernel that reads near it
pays a page migration: on the H200 the embedding lookup of a 1.1B model's forward took 247 us
instead of 10.5 us when the forward had written a fresh plan (docs/gpu.md, "Host-written
arrays").

`choose()` is the one function that decides; it returns the path and the reason, logged once
per distinct case and counted per layer call, so tests can check which path really ran and
users can see when a slow path was taken. The first use of a backend for a kernel variant in a
process runs the canary (`canary.py`) on each of its kernels that the variant supports (the
paged kernel at every tile height, the page gather), whichever path chose it; a kernel that
fails is logged once and any path that runs it is replaced by the reference from then on,
unless PAGED_PREFIX_STRICT_KERNELS=1 (tests, benchmarks), which raises instead.

Override with `Dispatcher(path=...)` or PAGED_PREFIX_ATTENTION (auto, reference, sdpa, cuda,
metal). A forced kernel that cannot run the call raises ValueError: no silent fallback.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace

import mlx.core as mx

import reference
from jit_kernels import KernelBackend, available_backends
from jit_kernels.contiguous_sdpa import attend, attend_into, check_sdpa_call, plan_sdpa, sdpa_attention
from jit_kernels.support import Geometry, as_pages

from . import canary
from .metadata import AttentionMetadata

ENV_VAR = "PAGED_PREFIX_ATTENTION"
STRICT_ENV_VAR = "PAGED_PREFIX_STRICT_KERNELS"
PATHS = ("auto", "reference", "sdpa", "cuda", "metal")

log = logging.getLogger(__name__)

# Canary verdicts for this process: (backend, component, variant) -> None (passed) or why not.
_VERDICTS: dict[tuple, str | None] = {}


@dataclass(frozen=True)
class Choice:
    path: str
    reason: str
    backend: str | None = None  # whose kernel runs: the paged kernel's, or the sdpa path's gather
    sdpa_seqs: tuple[int, ...] = ()  # mixed: the sequences SDPA runs (the kernel the others)
    prefill_seqs: tuple[int, ...] = ()  # sdpa, mixed: those the backend's prefill kernel runs

    def components(self) -> tuple[str, ...]:
        """The backend's kernels this choice runs, each checked on first use."""
        if self.backend is None:
            return ()
        used = {"sdpa": ("gather",), "mixed": ("attention", "gather")}.get(self.path,
                                                                         ("attention",))
        return used + ("prefill",) if self.prefill_seqs else used


class ForwardAttention:
    """One forward's attention: the choice and its plan, called by every layer.

    The first call goes through the path's entry check (shapes against the plan); the layers
    after it have the same shapes, so they take the unchecked launch: one op fewer to build
    per layer is time a synchronous step never gets back.
    """

    def __init__(self, choice: Choice, checked: Callable[..., mx.array],
                 unchecked: Callable[..., mx.array], counts: Counter):
        self.choice, self.counts = choice, counts
        self._run, self._unchecked = checked, unchecked

    def __call__(self, q: mx.array, k: mx.array, v: mx.array, k_cache: mx.array,
                 v_cache: mx.array) -> mx.array:
        """q [T, H, D] and the new rows k, v [T, Hkv, D] (already in the caches); the layer's
        caches as `PagedKVCache` stores them, or as [num_blocks, BS, Hkv, D] of its dtype."""
        self.counts[self.choice.path] += 1
        out = self._run(q, k, v, k_cache, v_cache)
        self._run = self._unchecked
        return out


class Dispatcher:
    def __init__(self, path: str | None = None,
                 backends: dict[str, KernelBackend] | None = None, strict: bool | None = None):
        path = path or os.environ.get(ENV_VAR, "auto")
        self.backends = available_backends() if backends is None else backends
        if path not in PATHS and path not in self.backends:
            raise ValueError(f"{ENV_VAR}/path: expected one of {PATHS}, got {path!r}")
        self.path = path
        self.strict = os.environ.get(STRICT_ENV_VAR) == "1" if strict is None else strict
        self.counts: Counter[str] = Counter()
        self.last: Choice | None = None
        self.last_sources = ""  # the SDPA plan's K/V sources in the last forward ("" off SDPA)
        self._logged: set[tuple] = set()
        self._planned: tuple | None = None  # ((metadata, geometry, choice), calls) of the last plan

    def choose(self, meta: AttentionMetadata, g: Geometry) -> Choice:
        if self.path == "reference":
            return Choice("reference", "forced")
        if self.path == "sdpa":
            return Choice("sdpa", "forced", self._gather_backend(g))
        if self.path != "auto":
            backend = self.backends.get(self.path)
            if backend is None:
                raise ValueError(f"{ENV_VAR}/path: the {self.path} kernel needs the "
                                 f"{self.path} backend, which this machine lacks")
            why_not = backend.attention.unsupported_reason(g)
            if why_not:
                raise ValueError(f"{ENV_VAR}/path: the {self.path} kernel cannot run this "
                                 f"call: {why_not}")
            return Choice(self.path, "forced", self.path)
        if not self.backends:
            return Choice("sdpa", "no GPU kernel backend: SDPA, cached prefixes gathered by MLX")
        name, backend = next(iter(self.backends.items()))
        why_not = backend.attention.unsupported_reason(g)
        if why_not:
            return Choice("sdpa", f"{name} kernel: {why_not}", self._gather_backend(g))
        pick = backend.prefers_sdpa(meta.cu_seqlens_q_host, meta.seq_lens_host, g,
                                    meta.block_tables_host)
        if pick is None:
            return Choice(name, "kernel supports the call and the measured rule picks it", name)
        if len(pick.seqs) == len(meta.seq_lens_host):
            return Choice("sdpa", pick.reason, name if pick.prefill else self._gather_backend(g),
                          prefill_seqs=pick.prefill)
        # with the kernel's own gather, which copies any row the kernel reads (16-byte rows)
        return Choice("mixed", f"{pick.reason}; the {name} kernel runs the others", name,
                      pick.seqs, pick.prefill)

    def _gather_backend(self, g: Geometry) -> str | None:
        for name, backend in self.backends.items():
            if backend.gather.unsupported_reason(g.dtype, g.head_dim) is None:
                return name
        return None

    def plan(self, meta: AttentionMetadata, g: Geometry) -> ForwardAttention:
        """Choose, validate (canary on first use) and plan one forward; nothing is written."""
        if g.block_size != meta.block_size:
            raise ValueError(f"geometry: block size {g.block_size} but the metadata was built "
                             f"for {meta.block_size}")
        choice = self._validated(self.choose(meta, g), g)
        # logged once per kind of choice: a mixed batch's sequences change from step to step
        key = (replace(choice, sdpa_seqs=(), prefill_seqs=()), g.variant(),
               "decode" if meta.max_q_len == 1 else "prefill")
        if key not in self._logged:
            self._logged.add(key)
            log.info("paged attention: %s (%s) for dtype=%s head_dim=%d group=%d block=%d %s",
                     choice.path, choice.reason, *key[1], key[2])
        self.last = choice
        key = (meta, g, choice)  # the metadata by identity: it is frozen
        if self._planned is None or self._planned[0] != key:
            self._planned = key, self._runner(choice, meta, g)
        checked, unchecked, self.last_sources = self._planned[1]
        return ForwardAttention(choice, checked, unchecked, self.counts)

    def _validated(self, choice: Choice, g: Geometry) -> Choice:
        backend = self.backends.get(choice.backend)
        if backend is not None:
            self._check_all(choice.backend, backend, g, choice.components())
        for component in choice.components():
            why = _VERDICTS[(backend, component, g.variant())]
            if why is None:
                continue
            if self.strict or self.path != "auto":
                raise RuntimeError(f"{choice.backend} {component} kernel for {g.variant()} "
                                   f"failed its first-use check: {why}")
            return Choice("reference", f"{choice.backend} {component} kernel failed its "
                                       f"first-use check: {why}")
        return choice

    @staticmethod
    def _check_all(name: str, backend: KernelBackend, g: Geometry, needed: tuple[str, ...]):
        """The canary for the kernels a choice runs and, with them, for every other kernel of
        the backend this variant supports: a server's warm-up then builds and checks them all,
        and no request waits for a check (the page gather's took 1.5-2.4 s on the H200) when
        a later step is the first to take another path."""
        checks = {"attention": (lambda: backend.attention.unsupported_reason(g),
                                canary.check_attention),
                  "gather": (lambda: backend.gather.unsupported_reason(g.dtype, g.head_dim),
                             canary.check_gather),
                  "prefill": (lambda: "no prefill kernel" if backend.prefill is None else
                              backend.prefill.unsupported_reason(g), canary.check_prefill)}
        for component, (unsupported, check) in checks.items():
            key = (backend, component, g.variant())
            # every forward comes here: once checked, a kernel costs a lookup
            if key in _VERDICTS or (component not in needed and unsupported() is not None):
                continue
            _VERDICTS[key] = check(backend, g)
            if _VERDICTS[key]:
                log.warning("paged attention: %s %s kernel for dtype=%s head_dim=%d group=%d "
                            "block=%d failed its first-use check (%s); using the reference",
                            name, component, *g.variant(), _VERDICTS[key])

    def _runner(self, choice: Choice, meta: AttentionMetadata, g: Geometry) -> tuple:
        """(checked, unchecked) calls of the chosen path, planned for this forward, and where
        its SDPA sequences' K/V come from."""
        cu, lens, tables = meta.cu_seqlens_q_host, meta.seq_lens_host, meta.block_tables
        if choice.path == "reference":
            def ref(q, k, v, kc, vc):
                return reference.paged_attention(q, as_pages(kc, g), as_pages(vc, g), tables, cu,
                                                 lens, g.scale)
            return ref, ref, ""
        prefill = {}
        if choice.prefill_seqs:
            prefill = dict(prefill_seqs=choice.prefill_seqs,
                           prefill_kernel=self.backends[choice.backend].prefill)
        if choice.path == "sdpa":
            plan = plan_sdpa(cu, lens, g, block_tables=meta.block_tables_host, **prefill)
            gather = self.backends[choice.backend].gather if choice.backend else None
            return (lambda q, k, v, kc, vc: sdpa_attention(q, k, v, kc, vc, tables, plan, gather),
                    lambda q, k, v, kc, vc: attend(q, k, v, kc, vc, tables, plan, gather),
                    plan.sources())
        kernel = self.backends[choice.backend].attention
        if choice.path == "mixed":
            picked = set(choice.sdpa_seqs)
            plan = kernel.plan(cu, lens, g, seqs=[s for s in range(len(lens)) if s not in picked])
            sdpa = plan_sdpa(cu, lens, g, seqs=choice.sdpa_seqs,
                             block_tables=meta.block_tables_host, **prefill)
            gather = self.backends[choice.backend].gather

            def checked(q, k, v, kc, vc):
                check_sdpa_call(q, k, v, kc, vc, tables, sdpa, gather)
                out = kernel(q, as_pages(kc, g), as_pages(vc, g), tables, plan)
                return attend_into(out, q, k, v, kc, vc, tables, sdpa, gather)

            def unchecked(q, k, v, kc, vc):
                out = kernel.launch(q, kc, vc, tables, plan)
                return attend_into(out, q, k, v, kc, vc, tables, sdpa, gather)
            return checked, unchecked, sdpa.sources()
        plan = kernel.plan(cu, lens, g)
        # the checked call sees the caches as pages; the launches after it take them as stored
        return (lambda q, k, v, kc, vc: kernel(q, as_pages(kc, g), as_pages(vc, g), tables, plan),
                lambda q, k, v, kc, vc: kernel.launch(q, kc, vc, tables, plan), "")
