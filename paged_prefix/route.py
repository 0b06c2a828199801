"""Where each sequence's attention comes from: decided once per forward, in `route`.

Sources, per sequence:
  PAGED      the backend's paged kernel (one launch for all such sequences);
  PREFILL    the backend's prefill kernel (Hopper: long suffixes read their pages in place);
  NEW_ROWS   SDPA over its own new K/V (nothing cached: the cache is never read back);
  IN_PLACE   SDPA over its pages read in place (one run of consecutive blocks);
  RUNS       one softmax over its pages' few runs of blocks, each read in place (MLX's CPU
             backend, where the only gather is MLX's take: `MAX_JOINED_RUNS`,
             `MIN_KEYS_PER_JOINED_RUN`);
  GATHERED   SDPA over its pages copied out (the backend's gather kernel, or MLX's take);
  REFERENCE  the gather-based reference (forced, or a kernel failed its first-use check).

The measured rules (`rules.py`) only say which sequences leave the paged kernel; everything
else (which SDPA source, whether a kernel can run the call, forced paths) is decided here, and
the page runs are computed here once for the whole forward. A windowed sequence's pages are
those from its first visible key (`key_start`) on: one that sees no cached key at all (W = 1)
attends over its new rows.
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass

import numpy as np

from jit_kernels import KernelBackend
from jit_kernels.geometry import Geometry, Lengths


class Source(enum.Enum):
    PAGED = "paged kernel"
    PREFILL = "prefill kernel"
    NEW_ROWS = "uncached"
    IN_PLACE = "read in place"
    RUNS = "runs read in place"
    GATHERED = "gathered"
    REFERENCE = "reference"


SDPA_SOURCES = (Source.NEW_ROWS, Source.IN_PLACE, Source.RUNS, Source.GATHERED)
# On MLX's CPU backend a decode row's attention over a heads-major cache's pages in R runs costs
# about one read in place plus R ops a layer; MLX's take, about 2.5 ns a key's element: joined
# runs measured faster up to 16 runs of 64 keys, slower at 16 of 28 and 32 of 32 (448 and 1024
# keys; bench/probes/cpu_decode.py, "runs joined" / "runs taken": docs/cpu/cpu_decode.txt).
MAX_JOINED_RUNS = 16
MIN_KEYS_PER_JOINED_RUN = 48
Run = tuple[int, int]  # a run of consecutive blocks: its first block, its number of blocks


@dataclass(frozen=True)
class Route:
    """One forward's decision: `path` names it (reference, sdpa, a backend, or mixed: a
    backend's paged kernel beside SDPA), `backend` whose kernels run, `sources` per sequence,
    `page_runs` the runs of blocks of each IN_PLACE (one run) or RUNS sequence."""

    path: str
    reason: str
    backend: str | None
    sources: tuple[Source, ...]
    page_runs: tuple[tuple[int, tuple[Run, ...]], ...] = ()

    def seqs(self, *sources: Source) -> tuple[int, ...]:
        return tuple(s for s, source in enumerate(self.sources) if source in sources)

    def kind(self) -> tuple:
        """What the log says once: the route without its per-sequence detail."""
        return self.path, self.reason, self.backend

    def summary(self) -> str:
        """Where the SDPA sequences' K/V come from, for the step log ("" off SDPA)."""
        kinds = Counter(s.value for s in self.sources if s in SDPA_SOURCES + (Source.PREFILL,))
        return ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items()))


def page_runs(block_tables: np.ndarray, lengths: Lengths, seqs, block_size: int,
              starts: np.ndarray | None = None, any_order=()) -> dict[int, tuple[Run, ...]]:
    """Of the sequences `seqs`, the runs of consecutive blocks (b, b + 1, ...: their K/V are
    contiguous rows of the cache, readable in place) that their visible pages (from the one
    holding key `starts[s]`, 0 when None) form, in key order. The sequences `any_order` (decode
    rows that see all their keys unmasked, whose softmax does not depend on the keys' order)
    take their whole pages in block order, the last (partial) page last: vLLM's allocator hands
    a request blocks freed by others, last block first, which are runs read backwards.
    `block_tables`: the host copy of the table the calls pass, [S, max_blocks]."""
    runs = {}
    for s in seqs:
        n = -(-int(lengths.seq_lens[s]) // block_size)
        first = 0 if starts is None else int(starts[s]) // block_size
        row = block_tables[s, first:n].astype(np.int64)
        if s in any_order:
            row[:-1].sort()
        bounds = [0, *(np.flatnonzero(np.diff(row) != 1) + 1).tolist(), len(row)]
        runs[int(s)] = tuple((int(row[a]), b - a) for a, b in zip(bounds[:-1], bounds[1:]))
    return runs


def one_run(runs: dict[int, tuple[Run, ...]]) -> dict[int, int]:
    """Of `page_runs`' answer, the sequences whose pages are one run, with its first block."""
    return {s: r[0][0] for s, r in runs.items() if len(r) == 1}


def _sdpa_sources(sees_cache: np.ndarray, seqs, runs: dict[int, tuple[Run, ...]],
                  keys: np.ndarray | None) -> dict[int, Source]:
    """`keys`: each sequence's visible keys where runs may be joined (else None)."""
    def source(s: int) -> Source:
        if not sees_cache[s]:
            return Source.NEW_ROWS
        n = len(runs[s])
        if n == 1:
            return Source.IN_PLACE
        joined = keys is not None and n <= MAX_JOINED_RUNS and \
            keys[s] >= MIN_KEYS_PER_JOINED_RUN * n
        return Source.RUNS if joined else Source.GATHERED
    return {s: source(s) for s in seqs}


def route(lengths: Lengths, block_tables: np.ndarray, geometry: Geometry, path: str,
          backends: dict[str, KernelBackend], rules: dict, layers: int = 1) -> Route:
    """The forward's route. `path`: "auto", "reference", "sdpa" or a backend's name (forced: a
    kernel that cannot run the call raises ValueError, never a silent fallback); `rules`: the
    dispatcher's rule per backend name (`rules.rule_for`); `layers`: how many layers run it."""
    n, g = lengths.num_seqs, geometry
    if path == "reference":
        return Route("reference", "forced", None, (Source.REFERENCE,) * n)
    starts = lengths.key_starts(g.window)
    sees_cache = starts < lengths.seq_lens - lengths.q_lens
    # runs joined in one softmax where MLX's take is the only gather: the CPU, measured there
    cpu = not backends and g.heads_major
    keys = lengths.seq_lens - starts if cpu else None
    any_order = set(np.flatnonzero(lengths.q_lens == 1).tolist()) \
        if cpu and g.window is None else ()
    runs = page_runs(block_tables, lengths, np.flatnonzero(sees_cache), g.block_size, starts,
                     any_order)  # once per forward

    def with_sdpa(reason: str, backend: str | None, picked=range(n), prefill=(),
                  rest=Source.PAGED) -> Route:
        sources = dict.fromkeys(range(n), rest)
        sources.update(_sdpa_sources(sees_cache, [s for s in picked if s not in prefill], runs,
                                     keys))
        sources.update(dict.fromkeys(prefill, Source.PREFILL))
        read = tuple((s, runs[s]) for s in range(n)
                     if sources[s] in (Source.IN_PLACE, Source.RUNS))
        mixed = Source.PAGED in sources.values()
        return Route("mixed" if mixed else "sdpa", reason, backend,
                     tuple(sources[s] for s in range(n)), read)

    gatherer = next((name for name, b in backends.items()
                     if b.gathered.unsupported_reason(g) is None), None)
    if path == "sdpa":
        return with_sdpa("forced", gatherer)
    if path != "auto":
        backend = backends.get(path)
        if backend is None:
            raise ValueError(f"path: the {path} kernel needs the {path} backend, which this "
                             "machine lacks")
        why_not = backend.attention.unsupported_reason(g)
        if why_not:
            raise ValueError(f"path: the {path} kernel cannot run this call: {why_not}")
        return Route(path, "forced", path, (Source.PAGED,) * n)
    if not backends:
        return with_sdpa("no GPU kernel backend: SDPA, cached pages read in place (one run of "
                         "blocks, or a few joined) or gathered by MLX", None)
    name, backend = next(iter(backends.items()))
    why_not = backend.attention.unsupported_reason(g)
    if why_not:
        return with_sdpa(f"{name} kernel: {why_not}", gatherer)
    pick = rules[name](lengths, g, one_run(runs), layers)
    if pick is None:
        return Route(name, "kernel supports the call and the measured rule picks it", name,
                     (Source.PAGED,) * n)
    reason = pick.reason if len(pick.seqs) == n else f"{pick.reason}; the {name} kernel runs " \
                                                     "the others"
    return with_sdpa(reason, name, pick.seqs, pick.prefill)
