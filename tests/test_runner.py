"""Cached-prefix prefill through the paged runner equals a full dense prefill.

The oracle is the unpatched mlx-lm model (same class, same seeded weights) running its
own contiguous KV cache: it never touches the paged cache.
"""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from paged_prefix.dispatch import Dispatcher
from paged_prefix.kv_cache import PagedKVCache
from paged_prefix.metadata import ScheduledRequest, build_batch_metadata
from paged_prefix.models import build_model, resolve_config
from paged_prefix.runner import PagedModelRunner
from tests.conftest import ATTENTION_PATHS, DTYPES, KERNEL_PATHS

BS, NUM_BLOCKS, PROMPT_LEN, DECODE_STEPS = 16, 64, 70, 6
# Logits of the whole model vs the dense oracle, (atol, rtol) by model dtype: the two
# compute attention in different orders, and half types round every layer's activations.
LOGIT_TOL = {mx.float32: (1e-4, 1e-4), mx.float16: (5e-2, 2e-2), mx.bfloat16: (2e-1, 5e-2)}
# The reference in every cache dtype; the kernels (half types only) in fp16.
PATH_DTYPES = [pytest.param("reference", d, id=f"reference-{n}") for n, d in DTYPES.items()] + [
    pytest.param(p.values[0], mx.float16, marks=p.marks, id=f"{p.values[0]}-fp16")
    for p in KERNEL_PATHS
]


def model_dtype(path):
    return mx.float32 if path == "reference" else mx.float16  # kernels run half types


class Harness:
    """A paged runner and its dense oracle over the same weights, plus a block allocator."""

    def __init__(self, name, path, dtype=None):
        self.cfg = resolve_config(name)
        self.dtype = dtype or model_dtype(path)
        self.dense = build_model(self.cfg, self.dtype, seed=7)
        kv = PagedKVCache(self.cfg["num_hidden_layers"], NUM_BLOCKS, BS,
                          self.cfg["num_key_value_heads"], self.cfg["head_dim"], self.dtype)
        self.runner = PagedModelRunner(build_model(self.cfg, self.dtype, seed=7), kv,
                                       Dispatcher(path))
        self.free = list(np.random.default_rng(3).permutation(np.arange(1, NUM_BLOCKS)))

    def blocks(self, n_tokens):
        return [int(self.free.pop()) for _ in range(-(-n_tokens // BS))]

    def step(self, *reqs):
        meta = build_batch_metadata(list(reqs), BS, NUM_BLOCKS)
        logits = self.runner.forward(meta)
        mx.eval(logits, self.runner.kv_cache.arrays())
        return dict(zip(meta.sample_req_ids, logits))

    def dense_greedy(self, prompt, steps):
        """Full-prefill last-token logits and the greedy continuation of the oracle."""
        cache = make_prompt_cache(self.dense)
        logits = self.dense(mx.array([prompt]), cache=cache)[0, -1]
        first, out = logits, []
        for _ in range(steps):
            out.append(int(mx.argmax(logits)))
            logits = self.dense(mx.array([[out[-1]]]), cache=cache)[0, -1]
        return first, out

    def assert_logits(self, got, want):
        atol, rtol = LOGIT_TOL[self.dtype]
        np.testing.assert_allclose(np.array(got.astype(mx.float32)),
                                   np.array(want.astype(mx.float32)), atol=atol, rtol=rtol)

    def decode(self, req_id, tokens, blocks, prompt_len, steps):
        """Greedy decode rows through the paged runner; tokens grows in place."""
        for _ in range(steps):
            logits = self.step(ScheduledRequest(req_id, tokens, prompt_len, len(tokens) - 1, 1,
                                                blocks))[req_id]
            tokens.append(int(mx.argmax(logits)))


def prompt_of(seed, n=PROMPT_LEN, vocab=512):
    return np.random.default_rng(seed).integers(3, vocab, n).tolist()


@pytest.mark.parametrize("path, dtype", PATH_DTYPES)
@pytest.mark.parametrize("model", ["llama-test", "qwen3-test"])
@pytest.mark.parametrize("hit", [0, BS, 4 * BS, PROMPT_LEN - 1],
                         ids=["none", "1-block", "4-blocks", "all-but-last"])
def test_cached_prefix_equals_full_prefill(model, path, dtype, hit):
    h = Harness(model, path, dtype)
    prompt = prompt_of(hit)
    blocks = h.blocks(PROMPT_LEN + DECODE_STEPS)
    if hit:  # an earlier request (or chunk) left the prefix's K/V in these blocks
        h.step(ScheduledRequest("warm", prompt, PROMPT_LEN, 0, hit, blocks))
    before = h.runner.stats.tokens_computed
    logits = h.step(ScheduledRequest("b", prompt, PROMPT_LEN, hit, PROMPT_LEN - hit, blocks))["b"]
    assert h.runner.stats.tokens_computed - before == PROMPT_LEN - hit  # suffix only
    want_logits, want_tokens = h.dense_greedy(prompt, DECODE_STEPS)
    h.assert_logits(logits, want_logits)
    tokens = prompt + [int(mx.argmax(logits))]
    h.decode("b", tokens, blocks, PROMPT_LEN, DECODE_STEPS - 1)
    assert tokens[PROMPT_LEN:] == want_tokens
    layers = h.cfg["num_hidden_layers"]
    assert h.runner.dispatcher.counts == {path: layers * h.runner.stats.forwards}


@pytest.mark.parametrize("path", ATTENTION_PATHS)
@pytest.mark.parametrize("model", ["llama-test", "qwen3-test"])
def test_mixed_batch_hits_fresh_and_decode_in_one_forward(model, path):
    h = Harness(model, path)
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
    assert h.runner.stats.tokens_computed == 57 + 1 + 30 + 41
    dec_want = h.dense(mx.array([tokens]))[0, -1]
    h.assert_logits(out["dec"], dec_want)
    h.assert_logits(out["hit"], h.dense_greedy(p_hit, 0)[0])
    h.assert_logits(out["new"], h.dense_greedy(p_new, 0)[0])


@pytest.mark.parametrize("path", ATTENTION_PATHS)
@pytest.mark.parametrize("model", ["llama-test", "qwen3-test"])
@pytest.mark.parametrize("chunk", [17, 32])
def test_chunked_prefill_equals_full_prefill(model, path, chunk):
    h = Harness(model, path)
    prompt = prompt_of(chunk, 100)
    blocks = h.blocks(100 + DECODE_STEPS)
    sampled = {}
    for start in range(0, 100, chunk):
        n = min(chunk, 100 - start)
        sampled = h.step(ScheduledRequest("c", prompt, 100, start, n, blocks))
        assert ("c" in sampled) == (start + n == 100)  # mid-prompt chunks sample nothing
    want_logits, want_tokens = h.dense_greedy(prompt, DECODE_STEPS)
    h.assert_logits(sampled["c"], want_logits)
    tokens = prompt + [int(mx.argmax(sampled["c"]))]
    h.decode("c", tokens, blocks, 100, DECODE_STEPS - 1)
    assert tokens[100:] == want_tokens


def test_runner_rejects_mismatched_cache():
    cfg = resolve_config("llama-test")
    with pytest.raises(ValueError, match="kv_cache"):
        PagedModelRunner(build_model(cfg), PagedKVCache(cfg["num_hidden_layers"], 8, BS, 3, 64))
    with pytest.raises(ValueError, match="kv_cache"):
        PagedModelRunner(build_model(cfg), PagedKVCache(1, 8, BS, 2, 64))
