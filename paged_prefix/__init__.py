"""paged_prefix: suffix-only paged prefill for vLLM on MLX (see README.md, docs/design.md)."""

from . import cpu_blas, precision

precision.keep_float32()  # before any module here imports mlx.core: precision.py says why
cpu_blas.load()  # the same: cpu_blas.py says why
