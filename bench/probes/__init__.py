"""One-question measurements behind the dispatch rules and kernel choices, each run as
`python -m bench.probes.<name>` from the repository root; their H200 results are in docs/h200/
(docs/results.md)."""
