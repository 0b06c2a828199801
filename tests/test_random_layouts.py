"""Random paged layouts against the float64 oracle: 1,200 drawn cases per attention path.

Each case draws 1-4 sequences (decode rows, short and long suffixes, hits of 0 .. 150 tokens),
the block size, GQA group, kv heads, head dim, dtype and a score regime (|scale q.k| up to
~150), on shuffled pages of a cache whose unowned pages and table padding are NaN; about half
the sequences get one run of consecutive blocks instead, which the sdpa path reads in place.
About half the cases are a variant (`reference.contract`): a sliding window (W = 1, W at least
the context, or in between; the pages left of it NaN), a logit cap, sinks, or several at once.
Every output element must be within the dtype's (atol, rtol) of the float64 oracle.
"""

import mlx.core as mx
import numpy as np
import pytest

import reference
from jit_kernels.geometry import Geometry
from paged_prefix.dispatch import Dispatcher
from tests.conftest import PagedCase, assert_close

CHUNKS, PER_CHUNK = 12, 100
DTYPE_CHOICES = (mx.float32, mx.float16, mx.bfloat16)


def draw(rng: np.random.Generator) -> dict:
    num_seqs = int(rng.integers(1, 5))
    q_lens = [1 if rng.random() < 0.3 else int(rng.integers(1, 41)) for _ in range(num_seqs)]
    ctx = [0 if rng.random() < 0.25 else int(rng.integers(1, 151)) for _ in range(num_seqs)]
    num_kv_heads = int(rng.choice([1, 2]))
    longest = max(q + c for q, c in zip(q_lens, ctx))
    window = None if rng.random() < 0.5 else int(rng.choice(
        [1, longest + int(rng.integers(0, 3)), int(rng.integers(1, longest + 1))], p=[.2, .2, .6]))
    return dict(q_lens=q_lens, ctx_lens=ctx, window=window,
                num_heads=num_kv_heads * int(rng.choice([1, 2, 3, 4, 8])),
                num_kv_heads=num_kv_heads, head_dim=int(rng.choice([64, 128])),
                block_size=int(rng.choice([8, 16, 32])),
                dtype=DTYPE_CHOICES[int(rng.integers(3))],
                seed=int(rng.integers(2**31)), q_scale=float(rng.choice([1.0, 8.0, 40.0])),
                runs=[bool(rng.random() < 0.5) for _ in range(num_seqs)])


def draw_variant(rng: np.random.Generator, num_heads: int) -> dict:
    softcap = float(rng.choice([5.0, 30.0])) if rng.random() < 0.3 else None
    sinks = mx.array(rng.standard_normal(num_heads) * 3, dtype=mx.float32) \
        if rng.random() < 0.3 else None
    return dict(softcap=softcap, sinks=sinks)


@pytest.mark.parametrize("path", ["reference", "sdpa"])
@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_random_layouts_match_float64_oracle(path, chunk):
    rng = np.random.default_rng(1000 + chunk)
    for _ in range(PER_CHUNK):
        case = draw(rng)
        variant = draw_variant(rng, case["num_heads"])
        c = PagedCase(**case)
        scale = case["head_dim"] ** -0.5
        window, softcap, sinks = case["window"], variant["softcap"], variant["sinks"]
        if path == "reference":
            out = reference.paged_attention(c.q, c.k_cache, c.v_cache, c.block_tables,
                                            c.cu_seqlens_q, c.seq_lens, scale, window=window,
                                            softcap=softcap, sinks=sinks)
        else:
            g = Geometry(case["num_heads"], case["num_kv_heads"], case["head_dim"],
                         case["block_size"], case["dtype"], scale, window=window,
                         softcap=softcap, sinks=sinks is not None)
            out = c.forward(Dispatcher("sdpa", backends={}), g, sinks=sinks)
        assert_close(out, c.oracle(scale, window, softcap, sinks), case["dtype"],
                     f"{path} {case} softcap={softcap} sinks={sinks is not None}",
                     case["q_scale"])
