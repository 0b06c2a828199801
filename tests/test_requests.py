"""The request-state functions alone, without a model: what one SchedulerOutput makes of the
live requests (admission, chunks, preemption and resumption, finishing, blocks appended), and
that a plan changes none of its inputs."""

from __future__ import annotations

import numpy as np
import pytest

from paged_prefix.requests import Limits, admit, plan_step, with_sampled
from tests.scheduler_outputs import cached, new, step

LIMITS = Limits(vocab_size=512, block_size=16, num_blocks=32, max_sampling_rows=4)
PROMPT = tuple(range(3, 43))  # 40 tokens: three blocks


def run(live, so):
    """The plan, after checking it left `live` as it was (its states are frozen: the same
    objects are the same states)."""
    before = dict(live)
    plan = plan_step(live, so, LIMITS)
    assert live.keys() == before.keys() and all(live[r] is before[r] for r in live)
    return plan


def prefilled(req_id="a", blocks=(1, 2, 3), sampled=7):
    """Live states after `req_id`'s whole prompt ran and sampled one token."""
    plan = run({}, step({req_id: 40}, [new(req_id, PROMPT, (list(blocks),))]))
    return with_sampled(plan.requests, {req_id: sampled})


def test_admit_keeps_the_prompt_blocks_and_the_schedulers_hit():
    request = new("a", list(PROMPT), ([4, 5, 6],), computed=32)
    state = admit(request, LIMITS)
    assert state.prompt_token_ids == PROMPT and state.output_token_ids == ()
    assert state.block_ids == (4, 5, 6) and state.num_computed == 32
    assert state.generator is None  # unseeded
    request.prompt_token_ids.append(9)  # the scheduler's lists stay its own
    assert len(state.prompt_token_ids) == 40


def test_a_chunked_prefill_continues_where_the_last_chunk_stopped():
    first = run({}, step({"a": 16}, [new("a", PROMPT, ([1, 2, 3],))]))
    assert first.req_ids == ["a"] and first.meta.sample_req_ids == ()  # mid-prompt: no row
    assert first.requests["a"].num_computed == 16
    with pytest.raises(ValueError, match="num_computed_tokens"):  # not where this runner stopped
        run(first.requests, step({"a": 24}, cached_reqs=cached(["a"], [None], [8])))
    second = run(first.requests, step({"a": 24}, cached_reqs=cached(["a"], [None], [16])))
    assert second.requests["a"].num_computed == 40 and second.meta.sample_req_ids == ("a",)
    assert np.array(second.meta.positions).tolist() == list(range(16, 40))


def test_block_ids_are_appended_across_steps():
    live = prefilled(blocks=(1, 2, 3))
    tokens = 41
    for new_blocks, want in ((None, (1, 2, 3)), (([4],), (1, 2, 3, 4)), (([9, 8],), (1, 2, 3, 4, 9, 8))):
        plan = run(live, step({"a": 1}, cached_reqs=cached(["a"], [new_blocks], [tokens - 1])))
        assert plan.requests["a"].block_ids == want
        live, tokens = with_sampled(plan.requests, {"a": 5}), tokens + 1
    assert live["a"].output_token_ids == (7, 5, 5, 5)


def test_a_preempted_request_resumes_with_new_blocks_a_new_hit_and_the_schedulers_tokens():
    live = prefilled(blocks=(1, 2, 3), sampled=7)
    preempting = run(live, step({}, preempted=["a"]))
    assert preempting.meta is None and preempting.requests["a"].block_ids == ()
    known = [*PROMPT, 7]
    resumed = cached(["a"], [([10, 11, 12],)], [16], resumed=["a"], all_token_ids={"a": known})
    plan = run(preempting.requests, step({"a": 25}, cached_reqs=resumed))
    state = plan.requests["a"]
    assert state.block_ids == (10, 11, 12) and state.output_token_ids == (7,)
    assert state.num_computed == 41  # the scheduler's hit of 16, then the 25 tokens it recomputes
    assert np.array(plan.meta.positions).tolist() == list(range(16, 41))
    other_prompt = cached(["a"], [([10, 11, 12],)], [16], resumed=["a"],
                          all_token_ids={"a": [4, *known[1:]]})
    with pytest.raises(ValueError, match="all_token_ids"):
        run(preempting.requests, step({"a": 25}, cached_reqs=other_prompt))


def test_a_request_finishing_in_a_step_gives_its_blocks_to_the_requests_of_that_step():
    live = prefilled("a", blocks=(1, 2, 3))
    takes_a_block = new("b", list(range(50, 60)), ([3],))
    with pytest.raises(ValueError, match="block_ids"):  # 'a' still holds block 3
        run(live, step({"b": 10}, [takes_a_block]))
    plan = run(live, step({"b": 10}, [takes_a_block], finished=["a"]))
    assert set(plan.requests) == {"b"} and plan.req_ids == ["b"]
    assert set(run(live, step({}, finished=["a"])).requests) == set()  # nothing scheduled


def test_with_sampled_appends_to_the_sampled_requests_only():
    live = {**prefilled("a", blocks=(1, 2, 3)), **prefilled("b", blocks=(4, 5, 6))}
    after = with_sampled(live, {"b": 11})
    assert after["a"] is live["a"] and after["b"].output_token_ids == (7, 11)
    assert live["b"].output_token_ids == (7,)


def test_more_sampling_rows_than_the_limit_are_refused():
    requests = [new(r, [5, 6], ([i + 1],)) for i, r in enumerate("abcde")]
    with pytest.raises(ValueError, match="max_num_seqs=4"):
        run({}, step({r: 2 for r in "abcde"}, requests))
