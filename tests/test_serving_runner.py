"""`VllmModelRunner` at the vLLM boundary: a step is all or nothing, bad scheduler input is a
ValueError naming the field, and no step writes outside the rows it was scheduled to write.

The SchedulerOutputs are vLLM's own dataclasses, built by hand for the malformed cases and by
vLLM's real Scheduler (through the offline engine) for the write-isolation property.
"""

from __future__ import annotations

import copy
import dataclasses
import logging

import mlx.core as mx
import numpy as np
import pytest
import torch
from vllm.config import SchedulerConfig, VllmConfig
from vllm.v1.core.sched.output import NewRequestData

from bench import ttft_breakdown
from paged_prefix import launch, vllm_runner
from paged_prefix.engine import Engine, EngineConfig
from paged_prefix.kv_groups import kv_cache_config, layer_specs
from paged_prefix.models import build_model, resolve_config
from paged_prefix.requests import PENDING_TOKEN
from paged_prefix.vllm_runner import SampledOnDevice, VllmModelRunner
from tests.scheduler_outputs import cached, new, step

BS, NUM_BLOCKS = 16, 32
CONFIG = resolve_config("llama-test")
VOCAB = CONFIG["vocab_size"]


@pytest.fixture(autouse=True, params=["0", "1"], ids=["launched here", "launch thread"])
def launch_setting(request, monkeypatch) -> str:
    """Every test of the step twice: steps sent by the engine's thread (the default), and
    steps sampled on the device sent from the launch thread (PAGED_PREFIX_LAUNCH_THREAD=1)."""
    monkeypatch.setenv(launch.ENV_VAR, request.param)
    return request.param


def make_runner(vllm_config: VllmConfig | None = None, config: dict = CONFIG) -> VllmModelRunner:
    runner = VllmModelRunner(build_model(config, mx.float32, seed=0), vllm_config=vllm_config)
    specs = layer_specs(runner.layer_windows(), BS, config["num_key_value_heads"],
                        config["head_dim"], torch.float32)
    runner.initialize_kv_cache(kv_cache_config(vllm_config or VllmConfig(), specs, NUM_BLOCKS))
    return runner


def state(runner: VllmModelRunner):
    """Everything a step may change: every request's token and block lists (a deep copy of
    the runner's per-request state, less the sampling objects) and every cache row."""
    requests = {r: {k: copy.deepcopy(v) for k, v in vars(s).items()
                    if k not in ("params", "generator")} for r, s in runner.requests.items()}
    runner.launcher.wait()  # a step sent from the launch thread is read once it has been sent
    return requests, [np.array(a) for a in runner.runner.kv_cache.arrays()]


def assert_same_state(before, after):
    assert after[0] == before[0]
    for a, b in zip(after[1], before[1]):
        np.testing.assert_array_equal(a, b)


@pytest.fixture
def running() -> VllmModelRunner:
    """A runner with request 'a' (20 prompt tokens, blocks 1-2) that has sampled one token."""
    runner = make_runner()
    out = runner.execute_model(step({"a": 20}, [new("a", list(range(3, 23)), ([1, 2],))]))
    assert len(out.sampled_token_ids[0]) == 1
    return runner


GOOD = new("b", list(range(30, 40)), ([3],))
BAD_STEPS = {
    # each: (scheduler output, the field the error must name)
    "unknown cached id": (lambda: step({"z": 1}, cached_reqs=cached(["z"], [None], [5])),
                          "scheduled_cached_reqs"),
    "unknown scheduled id": (lambda: step({"b": 10, "y": 1}, [GOOD]), "num_scheduled_tokens"),
    "empty block_ids": (lambda: step({"b": 10, "c": 4}, [GOOD, new("c", [5, 6, 7, 8], ())]),
                        "block_ids"),
    "empty prompt": (lambda: step({"b": 10, "c": 1}, [GOOD, new("c", [], ([4],))]),
                     "prompt_token_ids"),
    "float token id": (lambda: step({"b": 10, "c": 2}, [GOOD, new("c", [5, 1.5], ([4],))]),
                       "prompt_token_ids"),
    "float block id": (lambda: step({"b": 10, "c": 2}, [GOOD, new("c", [5, 6], ([11.7],))]),
                       "block_ids"),
    "float computed tokens": (lambda: step({"b": 10, "c": 2}, [GOOD, new("c", [5, 6], ([4],),
                                                                         computed=0.5)]),
                              "num_computed_tokens"),
    "token id past the vocabulary": (lambda: step({"b": 10, "c": 2},
                                                  [GOOD, new("c", [5, VOCAB], ([4],))]),
                                     "prompt_token_ids"),
    "negative token id": (lambda: step({"b": 10, "c": 2}, [GOOD, new("c", [-1, 5], ([4],))]),
                          "prompt_token_ids"),
    "new block appended past the pool": (
        lambda: step({"b": 10, "a": 1}, [GOOD], cached(["a"], [([NUM_BLOCKS],)], [20])),
        "block_ids"),
    # 'a' has 21 known tokens, 20 computed by this runner
    "computed count other than the runner's": (
        lambda: step({"b": 10, "a": 2}, [GOOD], cached(["a"], [None], [19])),
        "num_computed_tokens"),
    "a write into a block another request holds": (
        lambda: step({"b": 10, "c": 4}, [GOOD, new("c", [5, 6, 7, 8], ([1],))]), "block_ids"),
    # 'a' (21 tokens in blocks 1-2) gets block 3 for its later tokens while 'b' writes it
    "a block appended to 'a' that another request writes": (
        lambda: step({"b": 10, "a": 1}, [GOOD], cached(["a"], [([3],)], [20])),
        "writes block 3, which 'a' holds for its later tokens"),
    "a block appended that the request already holds": (
        lambda: step({"b": 10, "a": 1}, [GOOD], cached(["a"], [([2],)], [20])),
        "'a' holds block 2 twice"),
    "a new request holding a block twice": (
        lambda: step({"b": 10, "c": 2}, [GOOD, new("c", [5, 6], ([4, 4],))]),
        "'c' holds block 4 twice"),
    "cached request twice": (
        lambda: step({"b": 10, "a": 1}, [GOOD], cached(["a", "a"], [None, None], [20, 20])),
        "scheduled_cached_reqs"),
    "cached lists of other lengths": (
        lambda: step({"b": 10, "a": 1}, [GOOD], cached(["a"], [], [20])), "scheduled_cached_reqs"),
    "new block list not a group list": (
        lambda: step({"b": 10, "a": 1}, [GOOD], cached(["a"], [0], [20])), "block_ids"),
    "resumed id not among the cached": (
        lambda: step({"b": 10, "a": 1}, [GOOD], cached(["a"], [None], [20], resumed=["zz"])),
        "resumed_req_ids"),
    "new request with nothing scheduled": (
        lambda: step({"b": 10}, [GOOD, new("c", [5, 6], ([4],))]), "num_scheduled_tokens"),
    "total other than the sum": (
        lambda: dataclasses.replace(step({"b": 10}, [GOOD]), total_num_scheduled_tokens=99),
        "total_num_scheduled_tokens"),
    "allowed token past the vocabulary": (
        lambda: step({"b": 10, "c": 2}, [GOOD, new("c", [5, 6], ([4],), allowed_token_ids=[VOCAB])]),
        "allowed_token_ids"),
    "logit bias past the vocabulary": (
        lambda: step({"b": 10, "c": 2}, [GOOD, new("c", [5, 6], ([4],), logit_bias={VOCAB: 1.0})]),
        "logit_bias"),
    "more logprobs than the vocabulary": (
        lambda: step({"b": 10, "c": 2}, [GOOD, new("c", [5, 6], ([4],), logprobs=VOCAB + 1)]),
        "logprobs"),
    "bad word past the vocabulary": (
        lambda: step({"b": 10, "c": 2}, [GOOD, _with_bad_word(new("c", [5, 6], ([4],)), VOCAB)]),
        "bad_words_token_ids"),
}


def _with_bad_word(request: NewRequestData, token: int) -> NewRequestData:
    """bad_words_token_ids is what vLLM's frontend fills in from the tokenizer (a read-only
    property over this private field)."""
    request.sampling_params._bad_words_token_ids = [[token]]
    return request


@pytest.mark.parametrize("case", list(BAD_STEPS))
def test_bad_step_raises_naming_the_field_and_changes_nothing(running, case):
    make, field = BAD_STEPS[case]
    before = state(running)
    with pytest.raises(ValueError, match=field):
        running.execute_model(make())
    assert_same_state(before, state(running))
    assert "b" not in running.requests  # the valid request of the same step was not admitted
    # and the runner goes on: the same good request alone runs
    out = running.execute_model(step({"b": 10}, [GOOD]))
    assert out.sampled_token_ids == [[out.sampled_token_ids[0][0]]]


@pytest.fixture
def running_grouped() -> VllmModelRunner:
    """A two-group runner (window 20, full) with request 'a' (40 prompt tokens, blocks 1-3 in
    the sliding group, 4-6 in the full one) that has sampled one token."""
    runner = make_runner(config=GROUPED)
    runner.execute_model(step({"a": 40}, [new("a", list(range(3, 43)), ([1, 2, 3], [4, 5, 6]))]))
    return runner


# hits of 48 tokens: the sliding group's first visible key is 48 - 20 + 1 = 29, in its block 1
GROUPED_BAD_STEPS = {
    "one block list for two groups": (
        step({"b": 10}, [new("b", list(range(60, 70)), ([7],))]), "one block list per KV-cache"),
    "new blocks for one of two groups": (
        step({"a": 1}, cached_reqs=cached(["a"], [([7],)], [40])), "one block list per KV-cache"),
    "the null block read inside the window": (
        step({"b": 2}, [new("b", list(range(60, 110)), ([0, 0, 8, 9], [10, 11, 12, 13]),
                            computed=48)]), "null block 0 inside its window"),
    "the null block in the full group": (
        step({"b": 2}, [new("b", list(range(60, 110)), ([0, 7, 8, 9], [0, 11, 12, 13]),
                            computed=48)]), "null block 0 in its table"),
    "a block in both groups": (
        step({"b": 10}, [new("b", list(range(60, 70)), ([7], [7]))]),
        "block 7 is read or written by KV-cache groups 0 and 1"),
    "a block still inside 'a''s window": (
        step({"b": 10}, [new("b", list(range(60, 70)), ([3], [8]))]),
        "writes block 3, which running request 'a' holds"),
}


@pytest.mark.parametrize("case", list(GROUPED_BAD_STEPS))
def test_bad_group_input_raises_naming_the_field_and_changes_nothing(running_grouped, case):
    so, field = GROUPED_BAD_STEPS[case]
    before = state(running_grouped)
    with pytest.raises(ValueError, match=field):
        running_grouped.execute_model(so)
    assert_same_state(before, state(running_grouped))
    # 'a''s first sliding block is behind its window (it computed 40: keys from 21 on): another
    # request may take it, and the null block may stand for it in a hit's list
    fine = step({"b": 10, "c": 2}, [new("b", list(range(60, 70)), ([1], [8])),
                                    new("c", list(range(3, 53)), ([0, 2, 9, 10],
                                                                   [4, 5, 6, 11]), computed=48)])
    assert len(running_grouped.execute_model(fine).sampled_token_ids) == 2


def test_more_sampling_rows_than_max_num_seqs_are_refused_before_the_forward():
    runner = make_runner(VllmConfig(scheduler_config=SchedulerConfig(
        max_num_seqs=2, max_num_batched_tokens=2048, max_model_len=2048,
        is_encoder_decoder=False)))
    before = state(runner)
    with pytest.raises(ValueError, match="max_num_seqs"):
        runner.execute_model(step({r: 2 for r in "abc"},
                                  [new(r, [5, 6], ([i + 1],)) for i, r in enumerate("abc")]))
    assert_same_state(before, state(runner))


def test_failed_step_does_not_keep_a_finished_request_away(running):
    """A step that finishes 'a' and then fails leaves 'a' as it was."""
    before = state(running)
    with pytest.raises(ValueError, match="block_ids"):
        running.execute_model(step({"c": 4}, [new("c", [5, 6, 7, 8], ())], finished={"a"}))
    assert_same_state(before, state(running))


def test_writes_stay_inside_the_scheduled_rows_under_the_real_scheduler():
    """Tight pool, small token budget (chunks, preemption, prefix hits in the same forward):
    before every step the whole cache is copied; afterwards every row outside the slots of the
    scheduled tokens (num_computed .. num_computed + num_scheduled of each request, through
    its block table) must be bit-identical."""
    engine = Engine(EngineConfig(model="llama-test", num_blocks=16, max_model_len=512,
                                 max_num_batched_tokens=40, max_num_seqs=6))
    runner, checked = engine.runner, {"steps": 0, "rows": 0}
    forward = runner.run_forward

    def rows():  # each array with its rows first (a heads-major cache has them on axis 1)
        runner.launcher.wait()  # with the launch thread: once the step has been sent
        cache = runner.runner.kv_cache
        return [np.moveaxis(np.array(a), 1, 0) if cache.heads_major else np.array(a)
                for a in cache.arrays()]

    def checked_forward(so):
        before = rows()
        out = forward(so)
        computed = dict(zip(so.scheduled_cached_reqs.req_ids,
                            so.scheduled_cached_reqs.num_computed_tokens))
        computed.update((n.req_id, n.num_computed_tokens) for n in so.scheduled_new_reqs)
        allowed = np.zeros(len(before[0]), dtype=bool)
        for req_id, count in so.num_scheduled_tokens.items():
            blocks = np.array(runner.requests[req_id].block_ids[0])
            pos = np.arange(computed[req_id], computed[req_id] + count)
            allowed[blocks[pos // BS] * BS + pos % BS] = True
        for layer_before, layer_after in zip(before, rows()):
            np.testing.assert_array_equal(layer_after[~allowed], layer_before[~allowed])
        checked["steps"] += 1
        checked["rows"] += int(allowed.sum())
        return out

    runner.run_forward = checked_forward
    rng = np.random.default_rng(5)
    prefix = rng.integers(3, VOCAB, 40).tolist()
    for i in range(8):
        engine.add_request(f"r{i}", prefix[:20 + 5 * i] + rng.integers(3, VOCAB, 15).tolist(), 30)
    engine.run_to_completion()
    assert checked["steps"] > 10 and engine.num_preempted > 0
    assert sum(r.cached_tokens for r in engine.results.values()) > 0


def test_request_state_is_copied_not_shared(running):
    """The scheduler's lists are the request's own: the runner never mutates them."""
    prompt, blocks = list(range(40, 60)), [4, 5]
    request = new("d", prompt, (blocks,))
    snapshot = copy.deepcopy((prompt, blocks))
    running.execute_model(step({"d": 20}, [request]))
    running.execute_model(step({"d": 1}, cached_reqs=cached(["d"], [([6],)], [20])))
    assert (prompt, blocks) == snapshot


def test_warm_up_runs_the_prefill_decode_and_cached_prefix_paths_and_keeps_no_state():
    runner = make_runner()
    limit = runner.warm_up_limit()
    runner.warm_up(limit)  # the longest it allows fits
    with pytest.raises(ValueError, match="num_tokens"):
        runner.warm_up(limit + 1)
    runner = make_runner()
    runner.warm_up(40)
    core = runner.runner
    hit = 40 // 2 // core.kv_cache.block_size * core.kv_cache.block_size
    assert hit > 0 and core.stats.forwards == 3  # prefill + a decode row, two decode rows, the hit
    assert core.stats.tokens_computed == 40 + 1 + 2 + (40 - hit)
    assert not runner.requests
    out = runner.execute_model(step({"a": 20}, [new("a", list(range(3, 23)), ([1, 2],))]))
    assert len(out.sampled_token_ids[0]) == 1


# two layers: a sliding window of 20 keys, then full attention (two KV-cache groups)
GROUPED = resolve_config("llama-test", layer_types=["sliding_attention", "full_attention"],
                         sliding_window=20)


@pytest.mark.parametrize("config, max_num_seqs", [(CONFIG, 1), (GROUPED, 4)],
                         ids=["one sampling row", "two groups"])
def test_warm_up_fits_the_runner_it_warms(config, max_num_seqs, monkeypatch):
    """With max_num_seqs 1 its two sampling rows go one at a time; with KV-cache groups each
    group writes its own blocks (none twice, never block 0)."""
    runner = make_runner(VllmConfig(scheduler_config=SchedulerConfig(
        max_num_seqs=max_num_seqs, max_model_len=512, is_encoder_decoder=False)), config)
    sampled, written = [], []
    sample = runner.sampler.sample
    monkeypatch.setattr(runner.sampler, "sample",
                        lambda logits, rows, *a: sampled.append(len(rows)) or sample(logits, rows,
                                                                                     *a))
    slots = runner.runner.kv_cache.slots
    monkeypatch.setattr(runner.runner.kv_cache, "slots",
                        lambda host, *a: written.append(np.unique(host // BS)) or slots(host, *a))
    runner.warm_up(runner.warm_up_limit())
    assert sum(sampled) == 2 and max(sampled) <= max_num_seqs
    groups = len(runner.runner.kv_cache.windows)
    assert groups == len(config.get("layer_types") or [0])
    for forward in range(0, len(written), groups):  # a forward's groups write apart
        blocks = np.concatenate(written[forward:forward + groups])
        assert 0 not in blocks and len(np.unique(blocks)) == len(blocks)


def test_warm_up_reads_a_pending_token_as_a_mixed_step_does(monkeypatch):
    """A step beside a decode row reads the row's pending token with a gather (MLX's CUDA
    backend compiles it on first use): the warm-up runs the same read, from argmax's tokens
    into int32 ids, gathered and masked."""
    runner = make_runner()
    calls = []
    real = vllm_runner.read_pending
    monkeypatch.setattr(vllm_runner, "read_pending",
                        lambda tokens, source, ids: calls.append((tokens.dtype, source.copy(),
                                                                  ids.dtype)) or
                        real(tokens, source, ids))
    runner.warm_up(40)
    (tokens, source, ids), = calls
    assert tokens == vllm_runner.device_argmax(mx.zeros((1, 2))).dtype and ids == mx.int32
    assert (source < 0).any() and not np.array_equal(source, np.arange(len(source)))
    # and the runner's own mixed step takes that read: b's and a's tokens pending beside c's
    # prompt (a's first token was read by the engine's loop)
    runner.execute_model(step({"a": 20}, [new("a", list(range(3, 23)), ([1, 2],))]))
    assert runner.run_forward(step({"a": 1, "b": 20},
                                   [new("b", list(range(5, 25)), ([3, 4],))],
                                   cached_reqs=cached(["a"], [None], [20]))) is None
    runner.sample_tokens(None)
    assert len(calls) == 1
    assert runner.run_forward(step({"a": 1, "b": 1, "c": 20},
                                   [new("c", list(range(7, 27)), ([5, 6],))],
                                   cached_reqs=cached(["a", "b"], [None, None], [21, 20]))) is None
    assert len(calls) == 2 and calls[1][0] == tokens and (calls[1][1] < 0).any()
    runner.sample_tokens(None).token_list()


def test_warm_up_writes_the_cache_both_ways(monkeypatch):
    """A serving step whose rows land in many runs of slots writes by scatter, which MLX's
    CUDA backend compiles on first use; the warm-up must run it (and the slice updates) so
    that no request waits for that compile."""
    runner = make_runner()
    cache = runner.runner.kv_cache
    kinds = []
    real = cache.slots

    def recording(*args, **kwargs):
        slots = real(*args, **kwargs)
        kinds.append("slices" if slots.runs else "scatter")
        return slots
    monkeypatch.setattr(cache, "slots", recording)
    runner.warm_up(100)  # 7 blocks a request: a prefill's rows fall in 7 runs
    assert {"scatter", "slices"} <= set(kinds)


def test_debug_log_says_where_each_steps_time_goes(caplog):
    """At DEBUG (vLLM's VLLM_LOGGING_LEVEL=DEBUG), one line per forward with the step's
    shape and times, and one per sampling: how a slow TTFT is read off a server's log."""
    runner = make_runner()
    with caplog.at_level(logging.DEBUG, logger="paged_prefix.vllm_runner"):
        runner.execute_model(step({"a": 20}, [new("a", list(range(3, 23)), ([1, 2],))]))
        runner.execute_model(step({"a": 1}, cached_reqs=cached(["a"], [None], [20])))
    records = [r for r in caplog.records if r.name == "paged_prefix.vllm_runner"]
    lines = [r.getMessage() for r in records if r.levelno == logging.DEBUG]
    assert len(lines) == 4
    # the way each step sampled is logged at INFO the first time it runs
    assert [r.getMessage() for r in records if r.levelno == logging.INFO] == [
        "paged_prefix sampling: argmax on the device, returned before the step has run (every "
        "row greedy, nothing changing its logits, no logprobs)"]
    path = runner.runner.dispatcher.last.path
    assert lines[0].startswith("step: 1 sequences (0 of one token), 20 tokens after 0 already "
                               f"in the cache, {path} attention")
    assert "of it building the graph" in lines[0] and "after the last step" not in lines[0]
    assert lines[1].startswith("step: sampled 1 rows in ")
    assert lines[2].startswith("step: 1 sequences (1 of one token), 1 tokens after 20 ")
    if path == "sdpa":  # where its K/V came from: its new rows, then its blocks 1-2 in place
        assert "sdpa attention (sequences: 1 uncached); forward " in lines[0]
        assert "sdpa attention (sequences: 1 read in place); forward " in lines[2]
    assert "ms after the last step; MLX memory " in lines[2]
    assert lines[2].endswith(" MiB cached")
    # what bench/ttft_breakdown.py reads off a server's log: two timed steps, in order
    steps = ttft_breakdown.steps_of("\n".join(lines))
    assert [(s.tokens, s.decode_rows) for s in steps] == [(20, 0), (1, 1)]
    assert steps[0].wait_ms == 0.0  # nothing ran before the first step
    assert steps[0].start < steps[0].end <= steps[1].start < steps[1].end


def test_pending_tokens_are_read_on_the_device_in_any_row_order(launch_setting):
    """The next forward reads each pending token from the device, whether the step lists its
    requests in the order they were sampled (the tokens as they are), in another order (taken
    by row), or beside a new request's prompt rows (the host's ids kept there): the tokens are
    those of a runner whose every step goes through vLLM's Sampler, on the host. With the
    launch thread, every one of those steps is sent from it."""
    prompts = {"a": list(range(3, 23)), "b": list(range(40, 52)), "c": list(range(60, 70))}
    steps = [
        step({"a": 20, "b": 12}, [new("a", prompts["a"], ([1, 2],)),
                                  new("b", prompts["b"], ([3],))]),
        step({"b": 1, "a": 1, "c": 10}, [new("c", prompts["c"], ([4],))],
             cached(["b", "a"], [None, None], [12, 20])),
        step({"a": 1, "b": 1, "c": 1}, cached_reqs=cached(["a", "b", "c"], [None] * 3,
                                                          [21, 13, 10])),
        step({"a": 1, "b": 1, "c": 1}, cached_reqs=cached(["a", "b", "c"], [None] * 3,
                                                          [22, 14, 11])),
    ]
    on_device, on_host = make_runner(), make_runner()
    on_host_steps = [step({"a": 20, "b": 12}, [new("a", prompts["a"], ([1, 2],)),
                                               new("b", prompts["b"], ([3],), logprobs=1)]),
                     *steps[1:]]
    for so, host_so in zip(steps, on_host_steps):
        on_device.run_forward(so)
        assert isinstance(on_device.sample_tokens(None), SampledOnDevice)
        on_host.execute_model(host_so)
    assert on_device.steps_sampled_on_device == 4 and on_host.steps_sampled_on_device == 0
    assert on_device.launcher.launched_in_thread == (4 if launch_setting == "1" else 0)
    assert on_host.launcher.launched_in_thread == 0
    read = on_device._read(on_device.requests)  # with the last step's tokens
    assert {r: s.output_token_ids for r, s in read.items()} == \
        {r: s.output_token_ids for r, s in on_host.requests.items()}


def test_a_greedy_steps_argmax_is_launched_with_its_forward(monkeypatch):
    """A step sampled on the device is one evaluation (its argmax launched with the forward);
    one that may take a grammar bitmask launches the argmax once sampling finds no bitmask row
    among its rows, and one that needs vLLM's Sampler evaluates there. Every way gives the
    same greedy tokens."""
    launches = []
    async_eval = mx.async_eval
    monkeypatch.setattr(mx, "async_eval", lambda *a: (launches.append(a), async_eval(*a)))
    prompts = {"a": list(range(3, 23)), "b": list(range(40, 52))}

    def first_step(runner, structured=False, logprobs=None):
        so = step({"a": 20, "b": 12}, [new("a", prompts["a"], ([1, 2],)),
                                       new("b", prompts["b"], ([3],), logprobs=logprobs)])
        so.has_structured_output_requests = structured
        launches.clear()
        runner.run_forward(so)
        out = runner.sample_tokens(None)
        out = out.get_output() if isinstance(out, SampledOnDevice) else out
        return len(launches), [t for (t,) in out.sampled_token_ids]

    greedy, tokens = first_step(make_runner())
    assert greedy == 1
    assert first_step(make_runner(), structured=True) == (2, tokens)
    assert first_step(make_runner(), logprobs=1) == (1, tokens)


def test_greedy_steps_sample_on_the_device_others_through_vllms_sampler(caplog):
    """A step where no row `needs_sampler` returns vLLM's AsyncModelRunnerOutput at once,
    its tokens left on the device, where the next forward reads them (the host's list holds a
    placeholder until then); a step with one row that needs vLLM's Sampler (here one asking for
    logprobs) is sampled there. Both give the same greedy tokens."""
    runner = make_runner()
    prompts = {"a": list(range(3, 23)), "b": list(range(40, 52))}
    runner.run_forward(step({"a": 20, "b": 12}, [new("a", prompts["a"], ([1, 2],)),
                                                 new("b", prompts["b"], ([3],))]))
    first = runner.sample_tokens(None)
    assert isinstance(first, SampledOnDevice) and not first.taken
    assert [runner.requests[r].pending for r in "ab"] == [1, 1]
    assert runner.requests["a"].token_ids[-1] == PENDING_TOKEN
    # the next step is planned and built before the engine takes the first one's output
    runner.run_forward(step({"a": 1, "b": 1}, cached_reqs=cached(["a", "b"], [None, None],
                                                                 [20, 12])))
    assert runner.forwards_built_while_running == 1
    tokens = [t for (t,) in first.get_output().sampled_token_ids]
    assert [runner.requests[r].output_token_ids for r in "ab"] == [(t,) for t in tokens]
    second = runner.sample_tokens(None).get_output().sampled_token_ids
    assert runner.steps_sampled_on_device == 2
    # the same requests run one step at a time, every token through vLLM's Sampler
    alone = make_runner()
    logprobs = new("b", prompts["b"], ([3],), logprobs=2)
    alone.run_forward(step({"a": 20, "b": 12}, [new("a", prompts["a"], ([1, 2],)), logprobs]))
    with caplog.at_level(logging.INFO, logger="paged_prefix.vllm_runner"):
        out = alone.sample_tokens(None)
    assert "paged_prefix sampling: vLLM's Sampler (first for a row's logprobs)" in caplog.messages
    assert not isinstance(out, SampledOnDevice) and alone.steps_sampled_on_device == 0
    assert [t for (t,) in out.sampled_token_ids] == tokens and out.logprobs is not None
    alone.execute_model(step({"a": 1, "b": 1}, cached_reqs=cached(["a", "b"], [None, None],
                                                                  [20, 12])))
    assert [alone.requests[r].output_token_ids for r in "ab"] == [
        (t, s) for t, (s,) in zip(tokens, second)]
