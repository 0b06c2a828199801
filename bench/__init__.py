"""Benchmarks, run from the repository root as `python -m bench.<name>` (see docs/results.md);
`bench/probes/` holds the one-question measurements behind the dispatch rules."""
