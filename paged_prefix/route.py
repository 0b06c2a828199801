"""Where each sequence's attention comes from: decided once per forward, in `route`.

Sources, per sequence:
  PAGED      the backend's paged kernel (one launch for all such sequences);
  PREFILL    the backend's prefill kernel (Hopper: long suffixes read their pages in place);
  NEW_ROWS   SDPA over its own new K/V (nothing cached: the cache is never read back);
  IN_PLACE   SDPA over its pages read in place (one run of consecutive blocks);
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
    GATHERED = "gathered"
    REFERENCE = "reference"


SDPA_SOURCES = (Source.NEW_ROWS, Source.IN_PLACE, Source.GATHERED)


@dataclass(frozen=True)
class Route:
    """One forward's decision: `path` names it (reference, sdpa, a backend, or mixed: a
    backend's paged kernel beside SDPA), `backend` whose kernels run, `sources` per sequence,
    `first_blocks` the first block of each IN_PLACE sequence."""

    path: str
    reason: str
    backend: str | None
    sources: tuple[Source, ...]
    first_blocks: tuple[tuple[int, int], ...] = ()

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
              starts: np.ndarray | None = None) -> dict[int, int]:
    """Of the sequences `seqs`, those whose visible pages (from the one holding key
    `starts[s]`, 0 when None) are one run of consecutive blocks (b, b + 1, ...: their K/V are contiguous
    rows of the cache, readable in place), each with the run's first block. `block_tables`:
    the host copy of the table the calls pass, [S, max_blocks]."""
    runs = {}
    for s in seqs:
        n = -(-int(lengths.seq_lens[s]) // block_size)
        first = 0 if starts is None else int(starts[s]) // block_size
        row = block_tables[s, first:n].astype(np.int64)
        if (np.diff(row) == 1).all():
            runs[int(s)] = int(row[0])
    return runs


def _sdpa_sources(sees_cache: np.ndarray, seqs, runs: dict[int, int]) -> dict[int, Source]:
    return {s: Source.GATHERED if sees_cache[s] and s not in runs else
            Source.IN_PLACE if sees_cache[s] else Source.NEW_ROWS for s in seqs}


def route(lengths: Lengths, block_tables: np.ndarray, geometry: Geometry, path: str,
          backends: dict[str, KernelBackend], rules: dict) -> Route:
    """The forward's route. `path`: "auto", "reference", "sdpa" or a backend's name (forced: a
    kernel that cannot run the call raises ValueError, never a silent fallback); `rules`: the
    dispatcher's rule per backend name (`rules.rule_for`)."""
    n, g = lengths.num_seqs, geometry
    if path == "reference":
        return Route("reference", "forced", None, (Source.REFERENCE,) * n)
    starts = lengths.key_starts(g.window)
    sees_cache = starts < lengths.seq_lens - lengths.q_lens
    runs = page_runs(block_tables, lengths, np.flatnonzero(sees_cache), g.block_size,
                     starts)  # once per forward

    def with_sdpa(reason: str, backend: str | None, picked=range(n), prefill=(),
                  rest=Source.PAGED) -> Route:
        sources = dict.fromkeys(range(n), rest)
        sources.update(_sdpa_sources(sees_cache, [s for s in picked if s not in prefill], runs))
        sources.update(dict.fromkeys(prefill, Source.PREFILL))
        first_blocks = tuple((s, runs[s]) for s in range(n) if sources[s] is Source.IN_PLACE)
        mixed = Source.PAGED in sources.values()
        return Route("mixed" if mixed else "sdpa", reason, backend,
                     tuple(sources[s] for s in range(n)), first_blocks)

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
        return with_sdpa("no GPU kernel backend: SDPA, cached prefixes gathered by MLX", None)
    name, backend = next(iter(backends.items()))
    why_not = backend.attention.unsupported_reason(g)
    if why_not:
        return with_sdpa(f"{name} kernel: {why_not}", gatherer)
    pick = rules[name](lengths, g, runs)
    if pick is None:
        return Route(name, "kernel supports the call and the measured rule picks it", name,
                     (Source.PAGED,) * n)
    reason = pick.reason if len(pick.seqs) == n else f"{pick.reason}; the {name} kernel runs " \
                                                     "the others"
    return with_sdpa(reason, name, pick.seqs, pick.prefill)
