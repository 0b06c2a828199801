"""paged_prefix: suffix-only paged prefill for vLLM on MLX (see README.md, docs/design.md)."""
