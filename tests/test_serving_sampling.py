"""`BatchSampler`: vLLM's Sampler fed from MLX logits, each option mapped onto its metadata.

The maths is vLLM's; what is tested here is the bridge: each SamplingParams field reaches
the right row of vLLM's SamplingMetadata, and the results are checked against numpy
computations of the same definitions.
"""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from vllm.config import ModelConfig, VllmConfig
from vllm.sampling_params import SamplingParams

from paged_prefix.models import hf_config, resolve_config
from paged_prefix.vllm_sampling import (
    BatchSampler,
    SamplingRow,
    device_argmax,
    make_generator,
    needs_sampler,
    unsupported_reason,
)

VOCAB = 64


@pytest.fixture(scope="module")
def sampler() -> BatchSampler:
    return BatchSampler(VOCAB, VllmConfig())


def logits(rows: int, seed: int = 0, scale: float = 3.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((rows, VOCAB)) * scale).astype(np.float32)


def row(params: SamplingParams, prompt=(1, 2, 3), outputs=None) -> SamplingRow:
    return SamplingRow(params, list(prompt), list(outputs or []), make_generator(params))


def sample(sampler, values: np.ndarray, rows) -> tuple[list[int], object]:
    out = sampler.sample(mx.array(values), rows)
    return out.sampled_token_ids[:, 0].tolist(), out.logprobs_tensors


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x - x.max(-1, keepdims=True) - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True))


def test_greedy_rows_take_the_argmax_beside_random_rows(sampler):
    values = logits(4)
    rows = [row(SamplingParams(temperature=0.0)), row(SamplingParams(temperature=1.0, seed=1)),
            row(SamplingParams(temperature=0.0)), row(SamplingParams(temperature=0.7))]
    tokens, _ = sample(sampler, values, rows)
    assert tokens[0] == int(np.argmax(values[0])) and tokens[2] == int(np.argmax(values[2]))


def test_logprobs_are_log_softmax_of_the_raw_logits(sampler):
    values = logits(3, seed=1)
    rows = [row(SamplingParams(temperature=0.0, logprobs=5)),
            row(SamplingParams(temperature=1.5, top_p=0.5, seed=3, logprobs=2)),
            row(SamplingParams(temperature=0.0))]
    tokens, lp = sample(sampler, values, rows)
    lists = lp.tolists()
    expected = log_softmax(values)
    for i in range(3):
        ids = lists.logprob_token_ids[i]
        assert ids[0] == tokens[i]  # the sampled token first, then the top ones
        np.testing.assert_allclose(lists.logprobs[i], expected[i, ids], atol=1e-5, rtol=0)
        np.testing.assert_array_equal(ids[1:6], np.argsort(-values[i])[:5])
        assert lists.sampled_token_ranks[i] == 1 + int((values[i] > values[i, tokens[i]]).sum())


@pytest.mark.parametrize("option", ["top_k", "top_p", "min_p"])
def test_samples_stay_inside_the_allowed_set(sampler, option):
    values = logits(1, seed=2, scale=2.0)
    probs = np.exp(log_softmax(values)[0])
    order = np.argsort(-probs)
    if option == "top_k":
        params, allowed = dict(top_k=5), set(order[:5].tolist())
    elif option == "top_p":
        keep = int(np.searchsorted(np.cumsum(probs[order]), 0.6)) + 1
        params, allowed = dict(top_p=0.6), set(order[:keep].tolist())
    else:
        params, allowed = dict(min_p=0.2), set(np.nonzero(probs >= 0.2 * probs.max())[0].tolist())
    assert 1 < len(allowed) < VOCAB // 2
    seen = set()
    for seed in range(150):
        tokens, _ = sample(sampler, values, [row(SamplingParams(temperature=1.0, seed=seed, **params))])
        seen.add(tokens[0])
    assert seen <= allowed and len(seen) > 1, (sorted(seen), sorted(allowed))


def test_a_seed_repeats_its_draws_and_another_seed_differs(sampler):
    values = logits(1, seed=3, scale=0.5)

    def draws(seed):
        r = row(SamplingParams(temperature=1.0, seed=seed))  # one generator across the steps
        return [sample(sampler, values, [r])[0][0] for _ in range(12)]

    assert draws(11) == draws(11)
    assert draws(11) != draws(12)


def test_penalties_bias_and_processors_change_the_greedy_choice(sampler):
    values = np.zeros((1, VOCAB), dtype=np.float32)
    values[0, 7], values[0, 9] = 2.0, 1.5
    greedy = dict(temperature=0.0)
    assert sample(sampler, values, [row(SamplingParams(**greedy))])[0] == [7]
    # repetition penalty on a prompt token (positive logits are divided by it)
    assert sample(sampler, values, [row(SamplingParams(repetition_penalty=2.0, **greedy),
                                        prompt=[7])])[0] == [9]
    # frequency penalty counts generated tokens
    assert sample(sampler, values, [row(SamplingParams(frequency_penalty=0.3, **greedy),
                                        outputs=[7, 7])])[0] == [9]
    assert sample(sampler, values, [row(SamplingParams(logit_bias={3: 5.0}, **greedy))])[0] == [3]
    assert sample(sampler, values, [row(SamplingParams(allowed_token_ids=[1, 9], **greedy))])[0] == [9]
    # min_tokens masks the stop tokens until enough tokens were generated
    stop = SamplingParams(min_tokens=2, stop_token_ids=[7], **greedy)
    assert sample(sampler, values, [row(stop, outputs=[1])])[0] == [9]
    assert sample(sampler, values, [row(stop, outputs=[1, 2])])[0] == [7]


@pytest.mark.parametrize("vocab", [VOCAB, 49152])
def test_the_device_argmax_is_the_samplers_greedy_choice_ties_included(vocab):
    """The runner samples a step where no row `needs_sampler` with `device_argmax` (on the
    GPU where there is one): the same token as vLLM's Sampler, the first of tied maxima."""
    rng = np.random.default_rng(5)
    values = rng.standard_normal((6, vocab)).astype(np.float32)
    values[0, [3, vocab - 1]] = 9.0  # tied, far apart
    values[1, :] = 0.0  # all tied
    values[2, [vocab // 2, vocab // 2 + 1]] = 9.0  # tied neighbours
    values[3, :vocab - 1] = -np.inf  # only the last is finite
    values[4, [1, vocab // 3, 2 * vocab // 3]] = 7.5  # three tied
    greedy = SamplingParams(temperature=0.0)
    expected, _ = sample(BatchSampler(vocab, VllmConfig()), values, [row(greedy)] * len(values))
    assert device_argmax(mx.array(values)).tolist() == expected == np.argmax(values, -1).tolist()
    assert device_argmax(mx.zeros((0, vocab))).tolist() == []


def test_only_rows_whose_token_is_their_argmax_skip_the_sampler():
    """Options that leave a greedy row's choice alone (top-k, top-p, min-p, stop ids) need no
    Sampler; each that changes the logits or asks for logprobs is named as the reason the step
    goes through vLLM's Sampler (the greedy choices they change are checked above)."""
    greedy = dict(temperature=0.0)
    assert needs_sampler(SamplingParams(**greedy, top_k=5, top_p=0.5, min_p=0.2,
                                        stop_token_ids=[7], ignore_eos=True, max_tokens=3)) is None
    for changed, why in ((dict(temperature=0.7), "temperature 0.7"), (dict(logprobs=0), "logprobs"),
                         (dict(logprob_token_ids=[1]), "logprobs"),
                         (dict(repetition_penalty=2.0), "penalties"),
                         (dict(frequency_penalty=0.3), "penalties"),
                         (dict(presence_penalty=0.1), "penalties"),
                         (dict(logit_bias={3: 5.0}), "logit_bias"),
                         (dict(allowed_token_ids=[1, 9]), "allowed_token_ids"),
                         (dict(bad_words=["x"]), "bad_words"), (dict(min_tokens=2), "min_tokens")):
        params = SamplingParams(**{**greedy, **changed})
        if "bad_words" in changed:  # vLLM's frontend tokenizes bad words into these ids
            params._bad_words_token_ids = [[5]]
        assert needs_sampler(params) == why, changed


def test_unsupported_options_are_named():
    assert unsupported_reason(SamplingParams()) is None
    assert unsupported_reason(SamplingParams(prompt_logprobs=1)) is None
    refused = SamplingParams(prompt_logprobs=1, prompt_logprob_token_ids=[[1, 2]])
    assert unsupported_reason(refused)[0] == "prompt_logprob_token_ids"
    # vLLM makes a prompt-logprobs request skip the prefix cache unless told not to
    assert SamplingParams(prompt_logprobs=1).skip_reading_prefix_cache is True
    assert unsupported_reason(SamplingParams(prompt_logprobs=1,
                                             skip_reading_prefix_cache=True)) is None
    assert unsupported_reason(SamplingParams(skip_reading_prefix_cache=False)) is None
    refused = SamplingParams(prompt_logprobs=0, skip_reading_prefix_cache=False)
    assert unsupported_reason(refused)[0] == "skip_reading_prefix_cache"


@pytest.mark.parametrize("n", [0, 3, VOCAB])
def test_prompt_logprobs_are_log_softmax_with_the_target_first_then_the_top_n(sampler, n):
    values = logits(5, seed=4)
    targets = np.array([3, 9, 0, VOCAB - 1, 9])
    rows = sampler.prompt_logprobs(values, targets, n)
    expected = log_softmax(values)
    ids = rows.logprob_token_ids.numpy()
    assert ids.shape == (5, n + 1)
    np.testing.assert_array_equal(ids[:, 0], targets)
    np.testing.assert_array_equal(ids[:, 1:], np.argsort(-values, axis=1, kind="stable")[:, :n])
    np.testing.assert_allclose(rows.logprobs.numpy(), np.take_along_axis(expected, ids, 1),
                               atol=1e-6, rtol=0)
    np.testing.assert_array_equal(rows.selected_token_ranks.numpy(),
                                  (values >= values[np.arange(5), targets][:, None]).sum(1))


def test_prompt_logprobs_follow_the_logprobs_mode(tmp_path):
    """--logprobs-mode raw_logits: the logits themselves, as vLLM's runner returns them."""
    folder = hf_config({**resolve_config("llama-test"), "vocab_size": VOCAB}, tmp_path)
    model = ModelConfig(model=str(folder), skip_tokenizer_init=True, logprobs_mode="raw_logits")
    raw = BatchSampler(VOCAB, VllmConfig(model_config=model))
    values = logits(2, seed=5)
    rows = raw.prompt_logprobs(values, np.array([1, 2]), 2)
    np.testing.assert_array_equal(rows.logprobs.numpy(),
                                  np.take_along_axis(values, rows.logprob_token_ids.numpy(), 1))


def test_prompt_rows_of_the_wrong_shape_or_count_are_refused(sampler):
    with pytest.raises(ValueError, match="logits"):
        sampler.prompt_logprobs(logits(2), np.array([1]), 1)
    with pytest.raises(ValueError, match="num_logprobs"):
        sampler.prompt_logprobs(logits(1), np.array([1]), VOCAB + 1)


def test_logits_of_the_wrong_shape_are_refused(sampler):
    with pytest.raises(ValueError, match="logits"):
        sampler.sample(mx.zeros((2, VOCAB)), [row(SamplingParams())])


def test_the_sampler_takes_the_models_gumbel_precision():
    """`--use-fp64-gumbel` reaches vLLM's Sampler, as vLLM's own runner passes it."""
    config = VllmConfig()
    assert BatchSampler(VOCAB, config).sampler.use_fp64_gumbel is False
    config.model_config = SimpleNamespace(logprobs_mode="raw_logprobs", use_fp64_gumbel=True)
    assert BatchSampler(VOCAB, config).sampler.use_fp64_gumbel is True
