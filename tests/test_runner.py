"""Cached-prefix prefill through the paged runner against mlx-lm's own contiguous cache.

Two oracles over the same weights, both the mlx-lm model the runner was built from (the runner
runs its own copy of the module tree and leaves this one as it was):
  * exact: mlx-lm's contiguous prompt cache fed the same split (prefix, then suffix; the same
    chunks) with the same attention precision as the reference (fp32 scores). On the CPU paths
    (reference, sdpa) paging adds no arithmetic, so logits must be bit-identical: a wrong RoPE
    offset, slot or softmax scale cannot hide in a tolerance. (On a GPU these paths are held
    to the tolerance: SDPA may choose another algorithm for another memory layout; on OpenBLAS
    to a tolerance of an ulp or two and the same argmax: SPLIT_TOL_OPENBLAS says why.)
  * full prefill: one forward over the whole prompt (different rounding order), compared with a
    tolerance, and greedy continuations that must be identical.
Kernel paths (GPU) compute attention in their own order: they are held to the tolerance only.
"""

from dataclasses import replace

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import llama, qwen2, qwen3

import reference
from paged_prefix import cpu_blas
from paged_prefix.dispatch import Dispatcher
from paged_prefix.kv_cache import PagedKVCache
from paged_prefix.metadata import ScheduledRequest, build_batch_metadata
from paged_prefix.models import build_model, resolve_config
from paged_prefix.route import SDPA_SOURCES
from paged_prefix.runner import PagedModelRunner
from tests.conftest import ATTENTION_PATHS, DTYPES, KERNEL_PATHS, ON_GPU
from tests.mlx_lm_oracle import MlxLmOracle

BS, NUM_BLOCKS, PROMPT_LEN, DECODE_STEPS = 16, 64, 70, 6
# Logits vs a full prefill, (atol, rtol) by model dtype: the two compute attention over
# different splits, and half types round every layer's activations.
LOGIT_TOL = {mx.float32: (1e-4, 1e-4),  # fp32 on the GPU too (paged_prefix.precision)
             mx.float16: (5e-2, 2e-2), mx.bfloat16: (2e-1, 5e-2)}
EXACT_PATHS = ("reference", "sdpa")
# OpenBLAS sums a float32 product in an order that depends on its shape (small-matrix kernels
# below a size; on AVX-512 CPUs, blockings by the output's width), and the runner's fused q/k/v
# and gate/up matmuls have other shapes than mlx-lm's: there the exact oracle holds each dtype
# to this (atol, rtol) and the same argmax. float32: 9.5e-7 apart at most as measured; float16
# reaches BLAS through the float32 scores of the attention (the reference upcasts half inputs
# on the CPU), where a last-bit difference moves a logit by one of its ulps (9.8e-4 measured on
# an AMD EPYC). bfloat16 measured bit-exact there and stays so.
SPLIT_TOL_OPENBLAS = {mx.float32: (1e-5, 1e-5), mx.float16: (2e-3, 2e-3)}
PATH_DTYPES = [pytest.param(p, d, id=f"{p}-{n}") for p in EXACT_PATHS for n, d in DTYPES.items()]
PATH_DTYPES += [pytest.param(p.values[0], mx.float16, marks=p.marks, id=f"{p.values[0]}-fp16")
                for p in KERNEL_PATHS]


@pytest.fixture(autouse=True)
def fp32_scores_in_mlx_lm(monkeypatch):
    """mlx-lm's SDPA with the reference's precision (fp32 scores on the CPU), so that the
    exact oracle differs from the paged runner by paging alone."""
    def sdpa(queries, keys, values, cache, scale, mask, sinks=None):
        assert mask in ("causal", None) and sinks is None
        return reference.sdpa(queries, keys, values, scale)
    for module in (llama, qwen2, qwen3):
        monkeypatch.setattr(module, "scaled_dot_product_attention", sdpa)


class Harness:
    """A paged runner and its mlx-lm oracle over the same weights, plus a block allocator."""

    def __init__(self, name, path, dtype=mx.float32):
        self.cfg = resolve_config(name)
        # GPU SDPA may pick another algorithm for a gathered layout than for mlx-lm's cache
        self.dtype = dtype
        self.exact = path in EXACT_PATHS and not ON_GPU
        self.blas_rounded = (self.exact and dtype in SPLIT_TOL_OPENBLAS
                             and cpu_blas.status().active)
        self.dense = build_model(self.cfg, dtype, seed=7)
        head_dim = self.cfg.get("head_dim") or self.cfg["hidden_size"] // \
            self.cfg["num_attention_heads"]  # Mixtral's class derives it
        kv = PagedKVCache(self.cfg["num_hidden_layers"], NUM_BLOCKS, BS,
                          self.cfg["num_key_value_heads"], head_dim, dtype)
        self.runner = PagedModelRunner(self.dense, kv, Dispatcher(path, strict=True))
        self.free = list(np.random.default_rng(3).permutation(np.arange(1, NUM_BLOCKS)))

    def blocks(self, n_tokens):
        return [int(self.free.pop()) for _ in range(-(-n_tokens // BS))]

    def step(self, *reqs):
        meta = build_batch_metadata(list(reqs), BS, NUM_BLOCKS, self.cfg["vocab_size"])
        logits = self.runner.forward(meta)
        mx.eval(logits, self.runner.kv_cache.arrays())
        return dict(zip(meta.sample_req_ids, logits))

    def split_logits(self, tokens, splits):
        """mlx-lm's own cache fed tokens[a:b] for each (a, b): last-row logits of each."""
        return MlxLmOracle(self.dense, self.cfg).split_logits(tokens, splits)

    def dense_greedy(self, prompt, steps):
        """Full-prefill last-token logits and the greedy continuation of the oracle."""
        return MlxLmOracle(self.dense, self.cfg).greedy(prompt, steps)

    def assert_same(self, got, want):
        """Bit-identical on the exact paths (on OpenBLAS: SPLIT_TOL_OPENBLAS and the same
        argmax), else within the full-prefill tolerance."""
        got, want = np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32))
        if self.blas_rounded:
            atol, rtol = SPLIT_TOL_OPENBLAS[self.dtype]
            np.testing.assert_allclose(got, want, atol=atol, rtol=rtol)
            assert got.argmax() == want.argmax()
        elif self.exact:
            np.testing.assert_array_equal(got, want)
        else:
            self.assert_near(got, want)

    def assert_near(self, got, want):
        atol, rtol = LOGIT_TOL[self.dtype]
        np.testing.assert_allclose(np.array(mx.array(got).astype(mx.float32)),
                                   np.array(mx.array(want).astype(mx.float32)), atol=atol,
                                   rtol=rtol)

    def decode(self, req_id, tokens, blocks, prompt_len, steps):
        """Greedy decode rows through the paged runner; tokens grows in place."""
        for _ in range(steps):
            logits = self.step(ScheduledRequest(req_id, tokens, prompt_len, len(tokens) - 1, 1,
                                                blocks))[req_id]
            tokens.append(int(mx.argmax(logits)))


def prompt_of(seed, n=PROMPT_LEN, vocab=512):
    return np.random.default_rng(seed).integers(3, vocab, n).tolist()


def prefix_hit(h, prompt, hit, steps=DECODE_STEPS):
    """`prompt`'s first `hit` tokens cached by an earlier request (or chunk), the rest computed,
    then greedy decoding. Returns the suffix's last logits, the oracle's for the same split and
    for a full prefill, the `steps` tokens decoded and the oracle's."""
    n = len(prompt)
    blocks = h.blocks(n + steps)
    if hit:  # an earlier request left the prefix's K/V in these blocks
        h.step(ScheduledRequest("warm", prompt[:hit], hit, 0, hit, blocks))
    before = h.runner.stats.tokens_computed
    logits = h.step(ScheduledRequest("b", prompt, n, hit, n - hit, blocks))["b"]
    assert h.runner.stats.tokens_computed - before == n - hit  # suffix only
    tokens = prompt + [int(mx.argmax(logits))]
    h.decode("b", tokens, blocks, n, steps - 1)
    split = h.split_logits(prompt, [(0, hit), (hit, n)] if hit else [(0, n)])[-1]
    full, want_tokens = h.dense_greedy(prompt, steps)
    return logits, split, full, tokens[n:], want_tokens


@pytest.mark.parametrize("path, dtype", PATH_DTYPES)
@pytest.mark.parametrize("model", ["llama-test", "qwen3-test", "qwen2-test"])
@pytest.mark.parametrize("hit", [0, BS, 4 * BS, PROMPT_LEN - 1],
                         ids=["none", "1-block", "4-blocks", "all-but-last"])
def test_cached_prefix_equals_mlx_lm(model, path, dtype, hit):
    h = Harness(model, path, dtype)
    logits, split, full, tokens, want_tokens = prefix_hit(h, prompt_of(hit), hit)
    h.assert_same(logits, split)
    h.assert_near(logits, full)
    assert tokens == want_tokens
    layers = h.cfg["num_hidden_layers"]
    assert h.runner.dispatcher.counts == {path: layers * h.runner.stats.forwards}


@pytest.mark.parametrize("path", ATTENTION_PATHS)
@pytest.mark.parametrize("model", ["llama-test", "qwen3-test"])
def test_mixed_batch_hits_fresh_and_decode_in_one_forward(model, path):
    dtype = mx.float32 if path in EXACT_PATHS else mx.float16
    h = Harness(model, path, dtype)
    out, want = mixed_batch(h)
    assert h.runner.stats.tokens_computed == 57 + 1 + 30 + 41
    # packed rows go through the projections together: tolerance, not bit equality
    for row in out:
        h.assert_near(out[row], want[row])


def mixed_batch(h):
    """A 57-token prompt's prefill, then one forward of its decode row, a 78-token prompt that
    hits its 3 full blocks, and a fresh 41-token prompt. Returns each row's logits and the
    oracle's, by request id."""
    shared = prompt_of(100, 48)
    p_dec, p_hit, p_new = shared + prompt_of(1, 9), shared + prompt_of(2, 30), prompt_of(3, 41)
    b_dec, b_new = h.blocks(80), h.blocks(41)
    b_hit = b_dec[:3] + h.blocks(80 - 48)  # shares the 3 full prefix blocks of p_dec
    first = h.step(ScheduledRequest("dec", p_dec, 57, 0, 57, b_dec))["dec"]
    tokens = p_dec + [int(mx.argmax(first))]
    out = h.step(
        ScheduledRequest("dec", tokens, 57, 57, 1, b_dec),
        ScheduledRequest("hit", p_hit, 78, 48, 30, b_hit),
        ScheduledRequest("new", p_new, 41, 0, 41, b_new),
    )
    return out, {"dec": h.split_logits(tokens, [(0, 57), (57, 58)])[-1],
                 "hit": h.split_logits(p_hit, [(0, 48), (48, 78)])[-1],
                 "new": h.dense_greedy(p_new, 0)[0]}


def mixed_backend(name, monkeypatch):
    """`name`'s kernels with CUDA's length rule picking SDPA for every prefill of >= 30 tokens
    (a size a test model reaches), so a batch beside decode rows mixes paths."""
    from jit_kernels import KernelBackend, available_backends, metal_backend

    if name == "metal-emulated":
        from tests.metal_emu import metal_kernel
        real = metal_backend(metal_kernel)
    else:
        real = available_backends()[name]
    return KernelBackend(real.name, real.attention, real.gathered)  # its own first-use checks


def test_a_forward_plans_each_kind_of_layer_once_for_all_its_layers(monkeypatch):
    """Every layer of one kind runs its kind's plan, so the dispatcher is told how many do
    (its rules weigh a cuDNN graph, built once, against time per layer); two kinds split them."""
    h = Harness("llama-test", "reference")
    calls = []
    plan = h.runner.dispatcher.plan
    monkeypatch.setattr(h.runner.dispatcher, "plan",
                        lambda meta, g, layers=1: calls.append((g, layers)) or plan(meta, g,
                                                                                    layers))
    h.step(ScheduledRequest("a", prompt_of(1, 20), 20, 0, 20, h.blocks(20)))
    g = h.runner.geometries[0]
    assert calls == [(g, h.cfg["num_hidden_layers"])]
    h.runner.geometries = (g, replace(g, softcap=30.0))
    assert h.runner._layers_of_kind == (1, 1)


@pytest.mark.parametrize("backend", [
    pytest.param("metal-emulated", marks=pytest.mark.emulated), *KERNEL_PATHS])
@pytest.mark.parametrize("model", ["llama-test", "qwen3-test"])
def test_mixed_path_runs_prefills_on_sdpa_and_decode_rows_on_the_kernel(model, backend,
                                                                         monkeypatch):
    """The batch of the test above through `auto` with a kernel backend: the hit and the fresh
    prompt go to SDPA, the decode row to the kernel, in one forward; logits match mlx-lm."""
    from paged_prefix import rules

    monkeypatch.setattr(rules, "CUDA_SDPA_MIN_Q", 30)
    h = Harness(model, "reference", mx.float16)
    h.runner.dispatcher = Dispatcher(
        "auto", backends={backend: mixed_backend(backend, monkeypatch)}, strict=True,
        rule_of=lambda b: lambda lengths, g, runs, layers: rules.cuda_prefers_sdpa(lengths))
    shared = prompt_of(100, 48)
    p_dec, p_hit, p_new = shared + prompt_of(1, 9), shared + prompt_of(2, 30), prompt_of(3, 41)
    b_dec, b_new = h.blocks(80), h.blocks(41)
    b_hit = b_dec[:3] + h.blocks(80 - 48)
    first = h.step(ScheduledRequest("dec", p_dec, 57, 0, 57, b_dec))["dec"]
    assert h.runner.dispatcher.last.path == "sdpa"  # one long prefill alone
    tokens = p_dec + [int(mx.argmax(first))]
    out = h.step(ScheduledRequest("dec", tokens, 57, 57, 1, b_dec),
                 ScheduledRequest("hit", p_hit, 78, 48, 30, b_hit),
                 ScheduledRequest("new", p_new, 41, 0, 41, b_new))
    chosen = h.runner.dispatcher.last
    assert (chosen.path, chosen.seqs(*SDPA_SOURCES)) == ("mixed", (1, 2))
    layers = h.cfg["num_hidden_layers"]
    assert h.runner.dispatcher.counts == {"sdpa": layers, "mixed": layers}
    h.assert_near(out["dec"], h.split_logits(tokens, [(0, 57), (57, 58)])[-1])
    h.assert_near(out["hit"], h.split_logits(p_hit, [(0, 48), (48, 78)])[-1])
    h.assert_near(out["new"], h.dense_greedy(p_new, 0)[0])


@pytest.mark.parametrize("path", ATTENTION_PATHS)
@pytest.mark.parametrize("model", ["llama-test", "qwen3-test"])
@pytest.mark.parametrize("chunk", [17, 32])
def test_chunked_prefill_equals_mlx_lm(model, path, chunk):
    h = Harness(model, path, mx.float32 if path in EXACT_PATHS else mx.float16)
    prompt = prompt_of(chunk, 100)
    blocks = h.blocks(100 + DECODE_STEPS)
    sampled = {}
    for start in range(0, 100, chunk):
        n = min(chunk, 100 - start)
        sampled = h.step(ScheduledRequest("c", prompt, 100, start, n, blocks))
        assert ("c" in sampled) == (start + n == 100)  # mid-prompt chunks sample nothing
    splits = [(a, min(a + chunk, 100)) for a in range(0, 100, chunk)]
    h.assert_same(sampled["c"], h.split_logits(prompt, splits)[-1])
    want_logits, want_tokens = h.dense_greedy(prompt, DECODE_STEPS)
    h.assert_near(sampled["c"], want_logits)
    tokens = prompt + [int(mx.argmax(sampled["c"]))]
    h.decode("c", tokens, blocks, 100, DECODE_STEPS - 1)
    assert tokens[100:] == want_tokens


@pytest.mark.parametrize("path", ATTENTION_PATHS)
def test_pipelined_forward_changes_no_bit(path):
    """Sending each layer to the device as soon as it is built (the GPU default) runs the
    same ops: logits and every cache row are bit-identical to one evaluation at the end."""
    results = []
    for pipeline in (False, True):
        h = Harness("llama-test", path, mx.float16)
        h.runner.pipeline = pipeline
        shared = prompt_of(100, 48)
        p_dec, p_hit = shared + prompt_of(1, 9), shared + prompt_of(2, 30)
        b_dec = h.blocks(80)
        b_hit = b_dec[:3] + h.blocks(80 - 48)
        first = h.step(ScheduledRequest("dec", p_dec, 57, 0, 57, b_dec))["dec"]
        out = h.step(ScheduledRequest("dec", p_dec + [int(mx.argmax(first))], 57, 57, 1, b_dec),
                     ScheduledRequest("hit", p_hit, 78, 48, 30, b_hit))
        results.append(([np.array(x.astype(mx.float32)) for x in (first, out["dec"], out["hit"])],
                        cache_state(h.runner)))
    for want, got in zip(*[logits + cache for logits, cache in results]):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("path", ["reference", "sdpa", *KERNEL_PATHS])
def test_a_batch_run_again_reuses_its_checks_and_changes_no_bit(path):
    """A benchmark repeats one step: the same metadata forwarded again reuses its checked slots
    (scattered here: the device copy of the metadata, no fresh array) and its plan, and
    rewrites the same rows with the same values."""
    h = Harness("llama-test", path, mx.float16)
    shared = prompt_of(5, BS)
    first = h.blocks(36)
    h.step(ScheduledRequest("a", shared + prompt_of(6, 20), 36, 0, 36, first))
    prompt = shared + prompt_of(7, 74)  # 5 new blocks, shuffled: more runs than are sliced
    meta = build_batch_metadata([ScheduledRequest("b", prompt, 90, BS, 74,
                                                  first[:1] + h.blocks(90 - BS))], BS, NUM_BLOCKS)
    runs = []
    for _ in range(3):
        logits = h.runner.forward(meta)
        mx.eval(logits, h.runner.kv_cache.arrays())
        runs.append((np.array(logits.astype(mx.float32)), cache_state(h.runner)))
    slots, = h.runner._slots(meta)  # the one KV-cache group's
    assert not slots.runs and slots.device is meta.slot_mapping
    for logits, cache in runs[1:]:
        np.testing.assert_array_equal(logits, runs[0][0])
        for got, want in zip(cache, runs[0][1]):
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("pipeline", [False, True])
def test_steps_over_a_large_pool_copy_no_layer(pipeline):
    """A write into a layer array that MLX still holds copies the whole array. Over a 64 MiB
    per-array pool, no step grows peak memory by an array (a pipelined forward once sent every
    layer's arrays along with its first layer's and copied all the others). The CUDA
    allocator's peak moves by up to half an array between steps that copy nothing."""
    cfg = resolve_config("llama-tiny")
    num_blocks = 16384
    kv = PagedKVCache(cfg["num_hidden_layers"], num_blocks, BS, cfg["num_key_value_heads"],
                      cfg["head_dim"], mx.float32)
    runner = PagedModelRunner(build_model(cfg, mx.float32), kv,
                              Dispatcher("sdpa", strict=True), pipeline=pipeline)
    prompt = prompt_of(4, 256)
    meta = build_batch_metadata([ScheduledRequest("r", prompt, 256, 0, 256,
                                                  list(range(1, 17)))], BS, num_blocks)
    growth = []
    for _ in range(4):
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        mx.eval(runner.forward(meta), kv.arrays())
        growth.append(mx.get_peak_memory() - base)
    array_bytes = kv.arrays()[0].nbytes
    assert max(growth) < 0.9 * array_bytes, (growth, array_bytes)


class Broken(nn.Module):
    def __call__(self, *args, **kwargs):
        raise RuntimeError("layer 1 broke")


@pytest.mark.parametrize("pipeline", [False, True])
def test_a_forward_failing_past_layer_0_writes_only_its_own_slots(pipeline):
    """Built in one piece, the failed forward writes nothing; pipelined, layer 0 may have
    written, but only into the slots of the forward's own new tokens."""
    h = Harness("llama-test", "reference")
    h.runner.pipeline = pipeline
    prompt = prompt_of(0)
    h.step(ScheduledRequest("a", prompt, PROMPT_LEN, 0, PROMPT_LEN, h.blocks(PROMPT_LEN)))
    before = cache_state(h.runner)
    h.runner.model.layers[1].self_attn = Broken()
    meta = build_batch_metadata([ScheduledRequest("c", prompt, 70, 0, 70, h.blocks(70))], BS,
                                NUM_BLOCKS)
    with pytest.raises(RuntimeError, match="layer 1"):
        h.runner.forward(meta)
    mx.eval(h.runner.kv_cache.arrays())
    own = np.zeros(len(before[0]), dtype=bool)
    own[meta.slot_mapping_host] = True
    after = cache_state(h.runner)
    for a, b in zip(before, after):
        np.testing.assert_array_equal(b[~own], a[~own])
    assert (not pipeline) == all(np.array_equal(a, b) for a, b in zip(before, after))


@pytest.mark.skipif(ON_GPU, reason="the exact comparison is the CPU paths' (GPU: tolerance)")
@pytest.mark.parametrize("dtype, error", [(mx.bfloat16, 1.01), (mx.float16, 1.03)],
                         ids=["bf16", "fp16"])
def test_a_softmax_scale_error_is_caught(dtype, error):
    """The exact comparison can fail: a 1% wrong scale in one layer changes the logits; where
    OpenBLAS holds float16 to SPLIT_TOL_OPENBLAS, 3% does (1% moves one logit past it, 3%
    dozens: measured on an AMD EPYC)."""
    h = Harness("llama-test", "reference", dtype)
    first, second = h.runner.geometries
    h.runner.geometries = (first, replace(second, scale=second.scale * error))
    prompt = prompt_of(0)
    logits = h.step(ScheduledRequest("b", prompt, PROMPT_LEN, 0, PROMPT_LEN, h.blocks(70)))["b"]
    with pytest.raises(AssertionError):
        h.assert_same(logits, h.split_logits(prompt, [(0, PROMPT_LEN)])[-1])


def cache_state(runner):
    return [np.array(a.astype(mx.float32)) for a in runner.kv_cache.arrays()]


def test_failed_forward_leaves_the_cache_untouched(monkeypatch):
    """Defect 3: every check runs before the first write, and a forward that raises while its
    graph is built drops its pending writes."""
    h = Harness("llama-test", "reference")
    prompt = prompt_of(0)
    h.step(ScheduledRequest("a", prompt, PROMPT_LEN, 0, PROMPT_LEN, h.blocks(PROMPT_LEN)))
    before = cache_state(h.runner)
    bad = [build_batch_metadata([ScheduledRequest("b", prompt, 70, 0, 70, list(range(1, 10)))],
                                8, NUM_BLOCKS),  # built for block size 8 on a size-16 cache
           build_batch_metadata([ScheduledRequest("b", prompt, 70, 0, 70, [60, 61, 62, 63, 64])],
                                BS, NUM_BLOCKS + 1)]  # a block id past the cache
    for meta in bad:
        with pytest.raises(ValueError, match="block_size|num_blocks"):
            h.runner.forward(meta)
    layer1 = h.runner.model.layers[1].self_attn
    monkeypatch.setattr(type(layer1), "__call__", lambda *a, **k: (_ for _ in ()).throw(
        RuntimeError("layer 1 broke")))
    with pytest.raises(RuntimeError, match="layer 1"):
        h.runner.forward(build_batch_metadata(
            [ScheduledRequest("c", prompt, 70, 0, 70, h.blocks(70))], BS, NUM_BLOCKS))
    mx.eval(h.runner.kv_cache.arrays())
    for a, b in zip(before, cache_state(h.runner)):
        np.testing.assert_array_equal(a, b)


def test_tokens_outside_the_vocabulary_are_refused():
    h = Harness("llama-test", "reference")
    meta = build_batch_metadata([ScheduledRequest("a", [1, 2, 512], 3, 0, 3, [1])], BS, NUM_BLOCKS)
    with pytest.raises(ValueError, match="vocabulary"):
        h.runner.forward(meta)


def test_forward_takes_only_batch_metadata():
    h = Harness("llama-test", "reference")
    with pytest.raises(ValueError, match="meta: expected"):
        h.runner.forward(None)


def test_quantized_model_mid_prompt_chunk_returns_no_rows():
    """Defect 6: nothing to sample -> an empty result, the vocabulary projection never runs
    (on 0 rows a quantized one killed the process with SIGFPE)."""
    cfg = resolve_config("llama-test", tie_word_embeddings=True)
    model = build_model(cfg, mx.float16)
    nn.quantize(model, group_size=32, bits=4)
    runner = PagedModelRunner(model, PagedKVCache(2, 8, BS, 2, 64, mx.float16),
                              Dispatcher("reference"))
    meta = build_batch_metadata([ScheduledRequest("a", prompt_of(0, 40), 40, 0, 24, [1, 2, 3])],
                                BS, 8)
    logits = runner.forward(meta)
    mx.eval(logits, runner.kv_cache.arrays())
    assert logits.shape == (0, 512) and runner.greedy(build_batch_metadata(
        [ScheduledRequest("a", prompt_of(0, 40), 40, 24, 8, [1, 2, 3])], BS, 8)) == []


def test_runner_rejects_mismatched_cache_and_models():
    cfg = resolve_config("llama-test")
    with pytest.raises(ValueError, match="kv_cache"):
        PagedModelRunner(build_model(cfg), PagedKVCache(cfg["num_hidden_layers"], 8, BS, 3, 64))
    with pytest.raises(ValueError, match="kv_cache"):
        PagedModelRunner(build_model(cfg), PagedKVCache(1, 8, BS, 2, 64))
    chunked = resolve_config("llama-test", layer_types=["chunked_attention", "full_attention"],
                             sliding_window=16)
    with pytest.raises(ValueError, match="layer_types.*chunked_attention"):
        PagedModelRunner(build_model(chunked), PagedKVCache(2, 8, BS, 2, 64))
