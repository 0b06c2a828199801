"""Hybrid models (Qwen3-Next, LFM2) through the paged runner against mlx-lm's own model run with
its own caches (KV caches and ArraysCache), float32 on the CPU, random weights.

The runner's recurrent layers read their starting state from a state block and write their end
state into another (vLLM's align mode: a block per state group holds the state after the
tokens up to its end); its attention layers read the cached prefix from pages. Fresh prompts,
prefix hits of one and two state blocks, chunks ending on block boundaries, decode rows beside a
prefill in one forward: last-token logits within LOGIT_TOL of mlx-lm's and the same argmax,
greedy tokens identical, and the state written at a block boundary equal to mlx-lm's cache
after the same tokens (STATE_TOL; bit for bit where the packed forward computes what mlx-lm
does, the layers before the first attention layer).
"""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import ArraysCache

from paged_prefix.architectures import architecture
from paged_prefix.dispatch import Dispatcher
from paged_prefix.kv_cache import PagedKVCache
from paged_prefix.metadata import ScheduledRequest, build_batch_metadata
from paged_prefix.models import build_model, resolve_config
from paged_prefix.runner import PagedModelRunner
from paged_prefix.state_cache import RecurrentStateCache, StateSpec
from paged_prefix.state_metadata import StateRequest, build_state_metadata, commit
from tests.conftest import ON_GPU

B, KB, NUM_BLOCKS = 32, 16, 40  # vLLM's block (state and attention), the kernels' block
R = B // KB
MODELS = ["qwen3-next-test", "lfm2-test"]
# float32 logits: OpenBLAS rounds the packed rows' fused projections in another order than
# mlx-lm's per-sequence ones (~1e-6 measured)
LOGIT_TOL = (1e-2, 1e-2) if ON_GPU else (2e-5, 2e-5)
STATE_TOL = 1e-5


def prompt_of(seed, n, vocab=512):
    return np.random.default_rng(seed).integers(3, vocab, n).tolist()


class Harness:
    """A paged runner over a hybrid model with vLLM-style rows: one id space of blocks of B
    tokens; an attention block id b is kernel blocks b * R .. b * R + R - 1; every recurrent
    layer its own state group, as vLLM groups a small hybrid model."""

    def __init__(self, name, path="sdpa"):
        self.cfg = resolve_config(name)
        self.model = build_model(self.cfg, mx.float32, seed=5)
        recurrent = [r for r in architecture(self.cfg["model_type"]).recurrent(self.model)
                     if r is not None]
        self.num_groups = len(recurrent)
        specs = [StateSpec(r.shapes, r.compute_dtypes, r.compute_dtypes, group=g)
                 for g, r in enumerate(recurrent)]
        num_attention = self.cfg["num_hidden_layers"] - len(recurrent)
        head_dim = self.cfg.get("head_dim") or self.cfg["hidden_size"] // \
            self.cfg["num_attention_heads"]
        kv = PagedKVCache(num_attention, NUM_BLOCKS * R, KB, self.cfg["num_key_value_heads"],
                          head_dim, mx.float32)
        self.states = RecurrentStateCache(specs, NUM_BLOCKS)
        self.runner = PagedModelRunner(self.model, kv, Dispatcher(path, strict=True),
                                       state_cache=self.states)
        self.ledger = {}
        self.free = list(np.random.default_rng(3).permutation(np.arange(1, NUM_BLOCKS)))
        self.rows = {}  # req_id -> (attention row, state rows)

    def admit(self, req_id, n_tokens, hit_from=None, hit=0):
        """vLLM-style rows for a request of n_tokens: attention blocks (a hit's first), state
        rows position-indexed with the hit's state block at index hit // B - 1."""
        n_blocks = -(-n_tokens // B)
        attn, states = [], [[0] * n_blocks for _ in range(self.num_groups)]
        if hit_from is not None:
            attn = self.rows[hit_from][0][:hit // B]
            for g in range(self.num_groups):
                states[g][hit // B - 1] = self.rows[hit_from][1][g][hit // B - 1]
        attn += [int(self.free.pop()) for _ in range(n_blocks - len(attn))]
        self.rows[req_id] = (attn, states)

    def step(self, *reqs):
        """(req_id, tokens, prompt_len, computed, scheduled): one forward; logits by req_id."""
        scheduled, state_reqs = [], []
        for req_id, tokens, prompt_len, c, n in reqs:
            attn, states = self.rows[req_id]
            last = (c + n - 1) // B
            for row in states:  # vLLM's one real state block per step: the last token's
                if row[last] == 0:
                    row[last] = int(self.free.pop())
            kernel_ids = [b * R + i for b in attn for i in range(R)]
            scheduled.append(ScheduledRequest(req_id, tokens, prompt_len, c, n, kernel_ids))
            state_reqs.append(StateRequest(req_id, c, n, states, tuple(tokens[:prompt_len]),
                                           tuple(tokens[prompt_len:])))
        meta = build_batch_metadata(scheduled, KB, NUM_BLOCKS * R, self.cfg["vocab_size"])
        states = build_state_metadata(state_reqs, self.num_groups, B, NUM_BLOCKS,
                                      self.conv_kernel, self.ledger, {})
        meta = replace(meta, states=states)
        logits = self.runner.forward(meta)
        mx.eval(logits, self.runner.cache_arrays())
        commit(self.ledger, states)
        return dict(zip(meta.sample_req_ids, logits))

    @property
    def conv_kernel(self):
        return self.cfg.get("linear_conv_kernel_dim") or self.cfg["conv_L_cache"]

    # -- mlx-lm's own path --------------------------------------------------------------
    def mlx_lm(self, tokens, cuts):
        """mlx-lm's model fed tokens[a:b] for consecutive cuts through its own caches: the
        last row's logits of each chunk, and the caches."""
        caches = self.model.make_cache()
        out = [self.model(mx.array([tokens[a:b]]), cache=caches)[0, -1]
               for a, b in zip(cuts, cuts[1:])]
        return out, caches

    def greedy(self, prompt, steps):
        """mlx-lm's greedy continuation through its caches, and each decode step's logits."""
        caches = self.model.make_cache()
        logits = self.model(mx.array([prompt]), cache=caches)[0, -1]
        tokens, decoded = [], []
        for _ in range(steps):
            tokens.append(int(mx.argmax(logits)))
            logits = self.model(mx.array([[tokens[-1]]]), cache=caches)[0, -1]
            decoded.append(logits)
        return tokens, decoded


def assert_logits(got, want) -> float:
    got, want = np.array(got), np.array(want)
    np.testing.assert_allclose(got, want, atol=LOGIT_TOL[0], rtol=LOGIT_TOL[1])
    assert got.argmax() == want.argmax()
    return float(np.abs(got - want).max())


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("chunks", [[70], [32, 64, 70], [64, 70]],
                         ids=["one-forward", "chunks-of-one-block", "chunk-of-two-blocks"])
def test_prefill_then_decode_equals_mlx_lm(name, chunks):
    h = Harness(name)
    prompt = prompt_of(1, 70)
    h.admit("a", 70 + 4)
    start, got = 0, None
    for end in chunks:
        got = h.step(("a", prompt, 70, start, end - start)).get("a")
        start = end
    want, _ = h.mlx_lm(prompt, [0, 70])
    assert_logits(got, want[-1])
    expect, decoded = h.greedy(prompt, 4)
    tokens = prompt + [int(mx.argmax(got))]
    for want in decoded[:3]:
        logits = h.step(("a", tokens, 70, len(tokens) - 1, 1))["a"]
        assert_logits(logits, want)
        tokens.append(int(mx.argmax(logits)))
    assert tokens[70:] == expect


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("hit", [B, 2 * B], ids=["one-state-block", "two-state-blocks"])
def test_prefix_hit_reads_the_state_block_and_a_decode_row_runs_beside_it(name, hit):
    """Request a prefills 70 tokens in chunks ending on block boundaries; b shares its first
    `hit` tokens and is admitted with them computed (the scheduler's hit), its state read from
    a's state block, in the same forward as a decode row of a."""
    h = Harness(name)
    shared = prompt_of(7, hit)
    pa, pb = shared + prompt_of(8, 70 - hit), shared + prompt_of(9, 75 - hit)
    h.admit("a", 80)
    cuts = list(range(B, 70, B)) + [70]
    start = 0
    for end in cuts:
        out = h.step(("a", pa, 70, start, end - start))
        start = end
    tokens_a = pa + [int(mx.argmax(out["a"]))]
    h.admit("b", 80, hit_from="a", hit=hit)
    before = h.runner.stats.tokens_computed
    out = h.step(("a", tokens_a, 70, 70, 1), ("b", pb, 75, hit, 75 - hit))
    assert h.runner.stats.tokens_computed - before == 1 + 75 - hit  # b's suffix only
    want_a, _ = h.mlx_lm(tokens_a, [0, 70, 71])
    want_b, _ = h.mlx_lm(pb, [0, hit, 75])
    assert_logits(out["a"], want_a[-1])
    assert_logits(out["b"], want_b[-1])


@pytest.mark.parametrize("name", MODELS)
def test_state_at_a_block_boundary_is_mlx_lm_after_the_same_tokens(name):
    h = Harness(name)
    prompt = prompt_of(2, 2 * B)
    h.admit("a", 2 * B)
    h.step(("a", prompt, 2 * B, 0, B))
    h.step(("a", prompt, 2 * B, B, B))
    _, caches = h.mlx_lm(prompt, [0, B, 2 * B])
    recurrent = [i for i, c in enumerate(caches) if isinstance(c, ArraysCache)]
    first_attention = next(i for i, c in enumerate(caches) if not isinstance(c, ArraysCache))
    worst = []
    for g, layer in enumerate(recurrent):
        cache = caches[layer]
        block = h.rows["a"][1][g][1]  # the state after 2 B tokens
        for stored, want in zip(h.states.blocks(g), cache.cache, strict=True):
            got, ref = np.array(stored[block]), np.array(want[0])
            diff = float(np.abs(got - ref).max())
            worst.append(diff)
            if layer < first_attention and not ON_GPU:
                assert diff == 0, f"layer {layer} (before any attention): {diff}"
            assert diff <= STATE_TOL * max(1.0, float(np.abs(ref).max())), (g, diff)
    print(f"{name}: max |state - mlx-lm's| per layer and array {worst}")
