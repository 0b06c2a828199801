"""paged_prefix: suffix-only paged prefill for vLLM on MLX (see README.md, docs/design.md)."""

from . import cpu_blas

cpu_blas.load()  # before any module here imports mlx.core: cpu_blas.py says why
