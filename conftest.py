"""pytest loads this before tests/ and bench/ import MLX: `import paged_prefix` puts MLX's CPU
matmuls on OpenBLAS, which works only before mlx.core's first import (paged_prefix/cpu_blas.py)."""

import paged_prefix  # noqa: F401
