"""Kernel names carry the hash of their sources."""

from __future__ import annotations

import hashlib


def source_hash(*sources: str) -> str:
    """Short hash of kernel sources, for kernel names: MLX caches compiled kernels by name
    (on disk too) and would silently reuse a stale one after a source change."""
    return hashlib.sha1("".join(sources).encode()).hexdigest()[:10]
