"""The kernel sources' loader (jit_kernels/sources.py): every file under kernels/ reaches a kernel,
each once, includes resolved; MLX bodies keep their fragments in the header."""

from __future__ import annotations

from importlib import resources

import mlx.core as mx
import pytest

from jit_kernels import (
    cuda_paged_attention,
    hopper_paged_attention,
    hopper_prefill_attention,
    metal_paged_attention,
    page_gather,
    sources,
)
from jit_kernels.geometry import Geometry

G = Geometry(32, 8, 128, 16, mx.bfloat16, 128 ** -0.5)
MLX_SOURCES = [cuda_paged_attention.source(""), metal_paged_attention.ATTENTION,
               metal_paged_attention.MERGE, *page_gather.SOURCES.values()]
UNITS = [hopper_paged_attention.kernel_source("k", G),
         hopper_prefill_attention.kernel_source("k", G)]
TEXTS = [s.header + s.source for s in MLX_SOURCES] + UNITS


def test_every_kernel_file_reaches_a_kernel_once():
    files = list(resources.files("jit_kernels").joinpath("kernels").iterdir())
    assert files
    for f in files:
        first = f.read_text().splitlines()[0]  # every file opens with its own comment
        assert first.startswith("//"), f.name
        assert any(first in text for text in TEXTS), f"{f.name} reaches no kernel"
        assert all(text.count(first) <= 1 for text in TEXTS), f"{f.name} twice in one source"
    assert not any('#include "' in text for text in TEXTS)


def test_a_body_keeps_its_fragments_in_the_header():
    mma = cuda_paged_attention.source("")
    assert "__device__" not in mma.source and "q_shape[1]" in mma.source
    assert "online_softmax" in mma.header and "BLOCK_N = 64;" in mma.header
    assert "is_last" in mma.source  # split_merge.inc: body text where the kernel includes it
    gather = page_gather.SOURCES["metal"]  # an .inc is body text, read where it is included
    assert "#define PAGE_INDEX threadgroup_position_in_grid.x" in gather.source
    assert "block_tables_shape[1]" in gather.source


def test_hashes_follow_the_text():
    assert len({s.hash for s in MLX_SOURCES}) == len(MLX_SOURCES)
    assert sources.mlx_kernel("page_gather.cu", "").hash != page_gather.SOURCES["cuda"].hash
    unit = sources.translation_unit("paged_attention_wgmma.cu", "", "sm_90a")
    assert unit.hash != sources.translation_unit("paged_attention_wgmma.cu", "", "sm_100a").hash


def test_feature_flags_compile_each_variant_in_or_out():
    """A variant's features are `#define`d 1, the others 0; each feature set is its own source
    (and hash); a feature no kernel knows is refused."""
    assert sources.feature_flags("") == "#define WINDOW 0\n#define SOFTCAP 0\n#define SINKS 0\n"
    assert sources.feature_flags("window+sinks") == \
        "#define WINDOW 1\n#define SOFTCAP 0\n#define SINKS 1\n"
    sets = ["", "window", "softcap", "sinks", "window+softcap+sinks"]
    for make in (cuda_paged_attention.source, lambda f: hopper_paged_attention.unit(f),
                 lambda f: hopper_prefill_attention.unit(f)):
        assert len({make(f).hash for f in sets}) == len(sets)
    assert "W_WINDOW" in cuda_paged_attention.source("window").header
    assert "W_WINDOW" not in cuda_paged_attention.source("sinks").header
    with pytest.raises(ValueError, match="features"):
        sources.feature_flags("window+alibi")
