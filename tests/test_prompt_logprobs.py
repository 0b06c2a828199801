"""Prompt logprobs through `VllmModelRunner`, against log_softmax of mlx-lm's own logits.

The oracle is mlx-lm's model (the weights the runner was built from) over the whole prompt in
one call, float32, its log_softmax taken in float64. The runner computes the prompt in chunks
through the paged cache, and its packed, fused matmuls reach the BLAS in other shapes than
mlx-lm's: ATOL bounds the difference (9.2e-7 measured at most, float32, OpenBLAS or MLX's own
BLAS). Row i of a request's rows scores prompt position i for prompt token i + 1, then the
top N, as vLLM's GPU runner returns them; they arrive whole in the step that computes the
prompt's last token.
"""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.request import Request

from paged_prefix import architectures
from paged_prefix.engine import Engine, EngineConfig
from paged_prefix.models import build_model
from tests.scheduler_outputs import cached, new, step
from tests.test_serving_runner import CONFIG, VOCAB, assert_same_state, make_runner, state

ATOL = 1e-5
PROMPT = np.random.default_rng(0).integers(3, VOCAB, 50).tolist()
BLOCKS = ([1, 2, 3, 4],)  # 64 slots: the prompt and a few outputs


@pytest.fixture(scope="module")
def oracle():
    """prompt -> [P, vocab] float64 log_softmax of mlx-lm's float32 logits."""
    model = build_model(CONFIG, mx.float32, seed=0)  # make_runner's weights

    def log_softmax(prompt):
        logits = np.array(model(mx.array([prompt]))[0].astype(mx.float32)).astype(np.float64)
        top = logits.max(-1, keepdims=True)
        return logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    return log_softmax


def assert_rows(rows, prompt, n, lp):
    """`rows` (LogprobsTensors) are vLLM's prompt logprobs of `prompt`, top `n`, against the
    oracle's log_softmax `lp`: every value to ATOL, the target first, the top n by value, and
    the target's rank (1 + the tokens above it) within what ATOL leaves open."""
    ids, values = rows.logprob_token_ids.numpy(), rows.logprobs.numpy().astype(np.float64)
    ranks = rows.selected_token_ranks.numpy()
    count = len(prompt) - 1
    assert ids.shape == values.shape == (count, n + 1) and ranks.shape == (count,)
    np.testing.assert_array_equal(ids[:, 0], prompt[1:])
    np.testing.assert_allclose(values, np.take_along_axis(lp[:count], ids.astype(np.int64), 1),
                               atol=ATOL, rtol=0)
    np.testing.assert_allclose(values[:, 1:], -np.sort(-lp[:count], axis=1)[:, :n], atol=ATOL,
                               rtol=0)
    target = values[:, :1]
    assert (ranks >= 1 + (lp[:count] > target + 2 * ATOL).sum(1)).all()
    assert (ranks <= (lp[:count] >= target - 2 * ATOL).sum(1)).all()


def run_chunks(runner, req_id, prompt, chunks, n, blocks=BLOCKS):
    """The prompt in `chunks` (token counts) over consecutive steps; the outputs."""
    outs, done = [], 0
    for i, count in enumerate(chunks):
        if i == 0:
            so = step({req_id: count}, [new(req_id, prompt, blocks, prompt_logprobs=n)])
        else:
            so = step({req_id: count}, cached_reqs=cached([req_id], [None], [done]))
        outs.append(runner.execute_model(so))
        done += count
    return outs


CHUNKINGS = {
    "one step": ([50], 5),
    "three chunks": ([20, 20, 10], 5),
    # every row is scored in the first step, which ends one token short of the prompt: the
    # rows wait for the step that computes the last token (and samples)
    "rows done a step early": ([49, 1], 3),
    "target only": ([17, 33], 0),
    "the whole vocabulary": ([30, 20], -1),
}


@pytest.mark.parametrize("case", list(CHUNKINGS))
def test_chunked_prompt_rows_equal_log_softmax_of_mlx_lms_logits(oracle, case):
    chunks, n = CHUNKINGS[case]
    runner = make_runner()
    outs = run_chunks(runner, "a", PROMPT, chunks, n)
    # nothing out of the steps that end mid-prompt, neither rows nor a token
    assert [(o.prompt_logprobs_dict, o.sampled_token_ids) for o in outs[:-1]] == \
        [({}, [[]])] * (len(outs) - 1)
    assert len(outs[-1].sampled_token_ids[0]) == 1
    assert_rows(outs[-1].prompt_logprobs_dict["a"], PROMPT, VOCAB if n == -1 else n, oracle(PROMPT))
    assert not runner.prompt_logprobs  # its rows went out: none kept
    decode = runner.execute_model(step({"a": 1}, cached_reqs=cached(["a"], [None], [50])))
    assert decode.prompt_logprobs_dict == {}


def test_a_one_token_prompt_has_no_rows():
    out = make_runner().execute_model(step({"a": 1}, [new("a", [7], BLOCKS, prompt_logprobs=2)]))
    rows = out.prompt_logprobs_dict["a"]
    assert rows.logprobs.shape == (0, 3) and len(out.sampled_token_ids[0]) == 1


def mixed_steps(prompt_logprobs):
    """'d' decodes (with logprobs) while 'a' (prompt logprobs or not) prefills in two chunks
    beside a new request 'b' (with logprobs)."""
    d_prompt = list(range(5, 25))
    return [
        step({"d": 20}, [new("d", d_prompt, ([5, 6],), logprobs=2)]),
        step({"a": 30, "b": 12, "d": 1},
             [new("a", PROMPT, BLOCKS, prompt_logprobs=prompt_logprobs),
              new("b", list(range(40, 52)), ([7],), logprobs=2)],
             cached(["d"], [None], [20])),
        step({"a": 20, "b": 1, "d": 1}, cached_reqs=cached(["a", "b", "d"], [None] * 3,
                                                           [30, 12, 21])),
    ]


def test_mixed_batch_scores_one_requests_prompt_and_changes_nothing_beside_it(oracle, monkeypatch):
    """Decode rows and a request without prompt logprobs in the same steps as one with: its rows
    match the oracle, and every sampled token and sampled logprob is the same bits as in the
    same batch where nobody asks for prompt logprobs. Only the prompt rows asked for reach the
    vocabulary projection, in a projection of their own."""
    projected = []
    llama = architectures.ARCHITECTURES["llama"]  # CONFIG's: the runners built below take it

    def counting(model, hidden):
        projected[-1].append(hidden.shape[0])
        return llama.logits(model, hidden)
    monkeypatch.setitem(architectures.ARCHITECTURES, "llama", replace(llama, logits=counting))

    def run(prompt_logprobs):
        runner, outs = make_runner(), []
        for so in mixed_steps(prompt_logprobs):
            projected.append([])
            outs.append(runner.execute_model(so))
        return outs

    plain, scored = run(None), run(4)
    assert projected == [[1], [2], [3], [1], [2, 30], [3, 19]]
    for a, b in zip(plain, scored):
        assert a.req_ids == b.req_ids and a.sampled_token_ids == b.sampled_token_ids
        for field in ("logprob_token_ids", "logprobs", "sampled_token_ranks"):
            np.testing.assert_array_equal(getattr(a.logprobs, field), getattr(b.logprobs, field))
    assert [o.prompt_logprobs_dict for o in plain] == [{}, {}, {}]
    assert [list(o.prompt_logprobs_dict) for o in scored] == [[], [], ["a"]]
    assert_rows(scored[-1].prompt_logprobs_dict["a"], PROMPT, 4, oracle(PROMPT))


def resume(req_id, tokens, blocks):
    """A preempted request back from token 0 (vLLM reads no prefix cache for it)."""
    return step({req_id: len(tokens)}, cached_reqs=cached(
        [req_id], [blocks], [0], resumed=[req_id], all_token_ids={req_id: tokens}))


def test_a_request_preempted_mid_prompt_scores_its_rows_again(oracle):
    runner = make_runner()
    run_chunks(runner, "a", PROMPT, [30], 3)
    assert runner.prompt_logprobs["a"].filled == 30
    runner.execute_model(step({}, preempted={"a"}))
    out = runner.execute_model(resume("a", PROMPT, ([9, 10, 11, 12],)))
    assert_rows(out.prompt_logprobs_dict["a"], PROMPT, 3, oracle(PROMPT))


def test_a_request_preempted_after_its_prompt_does_not_score_it_again():
    """As vLLM's runners: the rows went out once; the resumed request recomputes its K/V."""
    runner = make_runner()
    first = run_chunks(runner, "a", PROMPT, [50], 3)[-1]
    token = first.sampled_token_ids[0][0]
    runner.execute_model(step({}, preempted={"a"}))
    out = runner.execute_model(resume("a", PROMPT + [token], ([9, 10, 11, 12],)))
    assert out.prompt_logprobs_dict == {} and len(out.sampled_token_ids[0]) == 1


def _prompt_logprobs_of(n):
    request = new("c", PROMPT, ([9, 10, 11, 12],), prompt_logprobs=1)
    request.sampling_params.prompt_logprobs = n  # past SamplingParams' own checks
    return request


REFUSED = {
    # each: (the new request, its scheduled tokens, the field the error must name)
    "more than the vocabulary": (lambda: _prompt_logprobs_of(VOCAB + 1), 50, "prompt_logprobs"),
    "negative, not -1": (lambda: _prompt_logprobs_of(-2), 50, "prompt_logprobs"),
    # a prefix hit would leave its first rows unscored: vLLM's scheduler never gives one
    "a cached prefix": (lambda: new("c", PROMPT, ([9, 10, 11, 12],), computed=16,
                                    prompt_logprobs=2), 34, "num_computed_tokens"),
    "fixed token ids": (lambda: new("c", PROMPT, ([9, 10, 11, 12],),
                                    prompt_logprob_token_ids=[[1]] * 49), 50,
                        "prompt_logprob_token_ids"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_bad_prompt_logprobs_request_is_refused_naming_the_field(case):
    make, count, field = REFUSED[case]
    runner = make_runner()
    run_chunks(runner, "a", PROMPT, [20], 2)
    before, kept = state(runner), dict(runner.prompt_logprobs)
    with pytest.raises(ValueError, match=field):
        runner.execute_model(step({"c": count, "a": 10}, [make()],
                                  cached(["a"], [None], [20])))
    assert_same_state(before, state(runner))
    assert runner.prompt_logprobs == kept


def test_vllms_scheduler_skips_the_prefix_cache_for_prompt_logprobs(oracle):
    """Under vLLM's Scheduler, chunked (a 16-token budget) and with prefix caching on: a request
    with prompt logprobs after one with the same prompt reads no cached block and gets every
    row; a request without, after both, hits the cache (it was on)."""
    engine = Engine(EngineConfig(model="llama-test", num_blocks=64, max_model_len=256,
                                 max_num_batched_tokens=16, max_num_seqs=4))
    hasher = get_request_block_hasher(16, sha256)
    prompt_logprobs, hits = {}, {}

    def run(req_id, n):
        engine.scheduler.add_request(Request(
            request_id=req_id, prompt_token_ids=PROMPT, pooling_params=None, block_hasher=hasher,
            sampling_params=SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=n)))
        while engine.has_unfinished():
            so = engine.scheduler.schedule()
            hits.update((r.req_id, r.num_computed_tokens) for r in so.scheduled_new_reqs)
            out = engine.runner.execute_model(so)
            for outputs in engine.scheduler.update_from_output(so, out).values():
                for o in outputs.outputs:
                    if o.new_prompt_logprobs_tensors is not None:
                        assert o.request_id not in prompt_logprobs  # whole, once
                        prompt_logprobs[o.request_id] = o.new_prompt_logprobs_tensors

    run("first", None)
    run("scored", 2)
    run("last", None)
    assert hits == {"first": 0, "scored": 0, "last": 48}
    assert list(prompt_logprobs) == ["scored"]
    assert_rows(prompt_logprobs["scored"], PROMPT, 2, oracle(PROMPT))
