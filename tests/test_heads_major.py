"""The heads-major KV cache (`PagedKVCache(heads_major=True)`, what a server uses on MLX's CPU
backend): the same rows as vLLM's token-major pages, read in place by the SDPA executor, and
bit for bit the same forwards; no kernel takes it."""

import mlx.core as mx
import numpy as np
import pytest

from jit_kernels import GatheredSdpa
from jit_kernels.arrays import as_pages, as_rows
from jit_kernels.geometry import HEADS_MAJOR_REASON, Geometry, unsupported_reason
from jit_kernels.page_gather import PageGather
from paged_prefix import route
from paged_prefix.dispatch import Dispatcher
from paged_prefix.kv_cache import PagedKVCache, heads_major_here
from paged_prefix.metadata import ScheduledRequest, build_batch_metadata
from paged_prefix.models import build_model, resolve_config
from paged_prefix.route import Source, page_runs
from paged_prefix.runner import PagedModelRunner
from tests.conftest import DTYPES, ON_GPU, PagedCase, assert_close


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES)
@pytest.mark.parametrize("head_dim", [64, 7])
def test_writes_land_where_token_major_writes_do(dtype, head_dim):
    """Runs (slice updates) and scattered slots: the same pages, through blocks() and the
    executors' as_pages/as_rows views of the stored arrays."""
    rng = np.random.default_rng(0)
    caches = [PagedKVCache(2, 12, 8, 3, head_dim, dtype, heads_major=hm) for hm in (False, True)]
    g = [Geometry(6, 3, head_dim, 8, dtype, 0.1, heads_major=hm) for hm in (False, True)]
    for slots in (np.arange(20, 45), rng.permutation(96)[:30]):
        k = mx.array(rng.standard_normal((len(slots), 3, head_dim)), dtype=mx.float32).astype(dtype)
        for cache in caches:
            cache.write(1, k, -k, cache.slots(slots))
    want = [np.array(x.astype(mx.float32)) for x in caches[0].blocks(1)]
    assert np.abs(want[0]).sum() > 0
    for got in (caches[1].blocks(1), [as_pages(x, g[1]) for x in caches[1].stored(1)]):
        for w, x in zip(want, got):
            np.testing.assert_array_equal(np.array(x.astype(mx.float32)), w)
    rows = [np.array(as_rows(x, g[1]).astype(mx.float32)) for x in caches[1].stored(1)]
    for w, r in zip(want, rows):
        np.testing.assert_array_equal(r, w.reshape(-1, 3, head_dim))
    assert caches[1].stored(1)[0].shape[0] == 3  # [kv heads, rows, words]


@pytest.mark.skipif(ON_GPU, reason="a CPU-backend layout (heads_major_here): on a GPU the token-major "
                    "forward runs the kernels, whose fp16/bf16 rounding is not SDPA's")
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES)
def test_forwards_equal_token_major_bit_for_bit(dtype, monkeypatch):
    """A prefill, a cached-prefix chunk beside a fresh request, a decode row, over pages in
    one run (read in place) and shuffled (gathered: pages in a few runs are read in place by
    the next test's path, which is not SDPA's arithmetic): the same logits and the same
    cache."""
    monkeypatch.setattr(route, "MAX_JOINED_RUNS", 1)
    cfg = resolve_config("llama-tiny")
    rng = np.random.default_rng(1)
    prompt = rng.integers(3, cfg["vocab_size"], 300).tolist()
    layouts = [list(range(30, 50)), rng.permutation(np.arange(1, 25)).tolist()]
    results = []
    for heads_major in (False, True):
        kv = PagedKVCache(cfg["num_hidden_layers"], 64, 16, cfg["num_key_value_heads"],
                          cfg["head_dim"], dtype, heads_major=heads_major)
        runner = PagedModelRunner(build_model(cfg, dtype), kv)
        assert runner.geometries[0].heads_major == heads_major
        out = []
        for blocks in layouts:
            for requests in (
                    [ScheduledRequest("a", prompt[:200], 200, 0, 200, blocks)],
                    [ScheduledRequest("a", prompt[:260], 200, 200, 60, blocks),
                     ScheduledRequest("b", prompt[:40], 40, 0, 40, [60, 61, 62])],
                    [ScheduledRequest("a", prompt[:261], 200, 260, 1, blocks)]):
                logits = runner.forward(build_batch_metadata(requests, 16, 64))
                mx.eval(logits, runner.cache_arrays())
                out.append(np.array(logits))
        out += [np.array(x.astype(mx.float32)) for x in kv.blocks(0)]
        results.append(out)
    assert runner.dispatcher.counts["sdpa"] > 0
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES)
def test_pages_in_a_few_runs_are_read_where_they_lie(dtype, gathered):
    """On MLX's CPU route a heads-major sequence whose pages lie in a few runs of blocks, at
    least MIN_KEYS_PER_JOINED_RUN keys a run, attends over each run in place, one softmax over
    them all, and nothing is gathered; shorter runs are gathered. Against the float64 oracle,
    over suffixes (keys in order: a decode row's pages may be read in any order, next test)."""
    c = PagedCase([5, 2, 2, 40, 3, 2], [155, 249, 299, 0, 45, 60], 8, 2, 64, 16, dtype, seed=7,
                  runs=[3, 4, False, False, 1, 2])
    runs = {s: len(r) for s, r in page_runs(c.tables, c.lengths, range(6), 16).items()}
    assert (runs[0], runs[1], runs[4], runs[5]) == (3, 4, 1, 2) and runs[2] > 2
    assert 2 * route.MIN_KEYS_PER_JOINED_RUN > c.seq_lens[5]  # 62 keys in 2 runs
    g = Geometry(8, 2, 64, 16, dtype, 0.125, heads_major=True)
    d = Dispatcher("auto", backends={})
    caches = [x.reshape(-1, 2, 64).transpose(1, 0, 2) for x in (c.k_cache, c.v_cache)]
    out = c.forward(d, g, *caches)
    assert_close(out, c.oracle(0.125), dtype)
    assert d.last.sources == (Source.RUNS, Source.RUNS, Source.GATHERED, Source.NEW_ROWS,
                              Source.IN_PLACE, Source.GATHERED)
    assert gathered == [int(c.seq_lens[2]), int(c.seq_lens[5])]


def test_no_kernel_takes_a_heads_major_cache():
    g = Geometry(8, 2, 128, 16, mx.float16, 0.1, heads_major=True)
    assert unsupported_reason(g, (128,)) == HEADS_MAJOR_REASON
    assert PageGather("cuda", None).unsupported_reason(g) == HEADS_MAJOR_REASON
    assert GatheredSdpa(PageGather("cuda", None)).unsupported_reason(g) == HEADS_MAJOR_REASON
    assert GatheredSdpa().unsupported_reason(g) is None  # MLX's take reads any layout


def test_a_token_major_array_is_not_read_as_heads_major():
    g = Geometry(8, 2, 64, 16, mx.float32, 0.1, heads_major=True)
    with pytest.raises(ValueError, match="heads-major cache is \\[2 kv heads"):
        as_rows(mx.zeros((64, 2, 64)), g)
    with pytest.raises(ValueError, match="heads_major: expected a bool"):
        PagedKVCache(1, 4, 16, 2, 64, mx.float32, heads_major=1)


def test_a_server_picks_heads_major_on_the_cpu_only():
    assert heads_major_here() == (mx.default_device() == mx.cpu)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES)
def test_a_decode_row_reads_its_pages_in_any_order(dtype):
    """A decode row sees every key unmasked, so its whole pages are read in block order, the
    last (partial) page last: blocks handed out last first (vLLM's allocator reuses a freed
    request's blocks so) are one run read in place, or a few runs; a prefill's keys keep their
    order. Against the float64 oracle."""
    backwards = [8, 7, 6, 5, 4, 3, 0]  # 6 whole pages, one run backwards; the last page apart
    c = PagedCase([1, 1, 1, 4], [100, 100, 60, 86], 8, 2, 64, 16, dtype, seed=9,
                  pages=[backwards, [25, 24, 23, 22, 21, 20, 30], [44, 43, 42, 45],
                         [35, 34, 33, 32, 31, 50]])
    g = Geometry(8, 2, 64, 16, dtype, 0.125, heads_major=True)
    d = Dispatcher("auto", backends={})
    caches = [x.reshape(-1, 2, 64).transpose(1, 0, 2) for x in (c.k_cache, c.v_cache)]
    out = c.forward(d, g, *caches)
    assert_close(out, c.oracle(0.125), dtype)
    assert d.last.sources == (Source.RUNS, Source.RUNS, Source.IN_PLACE, Source.GATHERED)
    runs = dict(d.last.page_runs)
    first = int(c.tables[0, 6]) - backwards[-1]  # the offset the case adds
    assert runs[0] == ((first + 3, 6), (first, 1)) and len(runs[1]) == 2

