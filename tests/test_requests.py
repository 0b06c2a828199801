"""The request-state functions alone, without a model: what one SchedulerOutput makes of the
live requests (admission, chunks, preemption and resumption, finishing, blocks appended), and
that a plan changes none of its inputs."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from paged_prefix.requests import (
    PENDING_TOKEN,
    Limits,
    TokenIds,
    admit,
    plan_step,
    with_pending,
    with_read,
    with_sampled,
)
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
    assert state.block_ids == ((4, 5, 6),) and state.num_computed == 32
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
    for new_blocks, want in ((None, ((1, 2, 3),)), (([4],), ((1, 2, 3, 4),)),
                             (([9, 8],), ((1, 2, 3, 4, 9, 8),))):
        plan = run(live, step({"a": 1}, cached_reqs=cached(["a"], [new_blocks], [tokens - 1])))
        assert plan.requests["a"].block_ids == want
        live, tokens = with_sampled(plan.requests, {"a": 5}), tokens + 1
    assert live["a"].output_token_ids == (7, 5, 5, 5)


def test_a_preempted_request_resumes_with_new_blocks_a_new_hit_and_the_schedulers_tokens():
    live = prefilled(blocks=(1, 2, 3), sampled=7)
    preempting = run(live, step({}, preempted=["a"]))
    assert preempting.meta is None and preempting.requests["a"].block_ids == ((),)
    known = [*PROMPT, 7]
    resumed = cached(["a"], [([10, 11, 12],)], [16], resumed=["a"], all_token_ids={"a": known})
    plan = run(preempting.requests, step({"a": 25}, cached_reqs=resumed))
    state = plan.requests["a"]
    assert state.block_ids == ((10, 11, 12),) and state.output_token_ids == (7,)
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


def test_a_token_sampled_on_the_device_is_planned_as_pending_then_read():
    """A token whose value is still on the device takes its position as PENDING_TOKEN on the
    host (the forward reads it on the device); reading it puts the value in its place. A second
    pending token before the first is read is refused; a resumed request takes the scheduler's
    tokens, pending none."""
    plan = run({}, step({"a": 40}, [new("a", PROMPT, ([1, 2, 3],))]))
    live = with_pending(plan.requests, ["a"])
    assert live["a"].pending == 1 and live["a"].output_token_ids == ()
    assert live["a"].token_ids == [*PROMPT, PENDING_TOKEN]
    with pytest.raises(ValueError, match="not yet read"):
        with_pending(live, ["a"])
    decode = run(live, step({"a": 1}, cached_reqs=cached(["a"], [None], [40])))
    assert np.array(decode.meta.input_ids).tolist() == [PENDING_TOKEN]
    read = with_read(decode.requests, {"a": 9, "gone": 4})
    assert read["a"].pending == 0 and read["a"].token_ids == [*PROMPT, 9]
    assert with_read(read, {"a": 5})["a"] is read["a"]  # nothing pending: left as it is
    preempting = run(live, step({}, preempted=["a"]))
    resumed = cached(["a"], [([10, 11, 12],)], [16], resumed=["a"],
                     all_token_ids={"a": [*PROMPT, 9]})
    state = run(preempting.requests, step({"a": 25}, cached_reqs=resumed)).requests["a"]
    assert state.pending == 0 and state.output_token_ids == (9,)


@pytest.mark.parametrize("prompt,output,pending", [((3, 4, 5), (6, 7), 1), ((3, 4), (), 0),
                                                   ((3,), (6,), 0), ((3, 4), (), 1)])
def test_token_ids_read_in_place_as_the_list_they_stand_for(prompt, output, pending):
    """A request's token ids are read where they are kept (a step slices out what it
    schedules): every index and slice gives what the whole list gives."""
    ids, want = TokenIds(prompt, output, pending), [*prompt, *output, *(PENDING_TOKEN,) * pending]
    assert len(ids) == len(want) and list(ids) == want and ids == want and ids == tuple(want)
    n = len(want)
    for i in range(-n - 2, n + 2):
        if -n <= i < n:
            assert ids[i] == want[i]
        else:
            with pytest.raises(IndexError):
                ids[i]
        for j in range(-n - 2, n + 2):
            for stride in (None, 2, -1):
                assert ids[i:j:stride] == want[i:j:stride], (i, j, stride)
    assert ids != [*want, 1] and ids != want[:-1]


def test_a_state_replaced_is_what_dataclasses_replace_gives():
    state = prefilled()["a"]
    for changes in (dict(num_computed=41), dict(output_token_ids=(7, 9), pending=0),
                    dict(block_ids=((1, 2, 3, 4),))):
        assert state.replaced(**changes) == dataclasses.replace(state, **changes)
    assert state.replaced(pending=1) is not state and state.pending == 0
    with pytest.raises(TypeError, match="no field"):
        state.replaced(tokens=())


def test_more_sampling_rows_than_the_limit_are_refused():
    requests = [new(r, [5, 6], ([i + 1],)) for i, r in enumerate("abcde")]
    with pytest.raises(ValueError, match="max_num_seqs=4"):
        run({}, step({r: 2 for r in "abcde"}, requests))


# Two KV-cache groups: full attention, and a sliding window of 20 (blocks of 16).
HYBRID = Limits(vocab_size=512, block_size=16, num_blocks=32, max_sampling_rows=4,
                windows=(None, 20))


def hybrid(live, so):
    return plan_step(live, so, HYBRID)


def test_each_group_has_its_block_list_and_new_blocks_append_per_group():
    with pytest.raises(ValueError, match=r"one block list per KV-cache group \(2\)"):
        hybrid({}, step({"a": 40}, [new("a", PROMPT, ([1, 2, 3],))]))
    plan = hybrid({}, step({"a": 40}, [new("a", PROMPT, ([1, 2, 3], [4, 5, 6]))]))
    assert plan.requests["a"].block_ids == ((1, 2, 3), (4, 5, 6))
    assert [g.attn.window for g in plan.meta.groups] == [None, 20]
    live = with_sampled(plan.requests, {"a": 7})
    for tokens in range(40, 48):  # the next block comes at token 48
        live = with_sampled(hybrid(live, step({"a": 1}, cached_reqs=cached(["a"], [None],
                                                                           [tokens]))).requests,
                            {"a": 7})
    plan = hybrid(live, step({"a": 1}, cached_reqs=cached(["a"], [([8], [9])], [48])))
    assert plan.requests["a"].block_ids == ((1, 2, 3, 8), (4, 5, 6, 9))
    assert plan.meta.groups[1].slot_mapping_host.tolist() == [9 * 16]
    preempted = hybrid(plan.requests, step({}, preempted=["a"])).requests
    assert preempted["a"].block_ids == ((), ())


@pytest.mark.parametrize("hit, sliding, ok", [
    (0, [0, 5, 6, 7, 8], False),    # a fresh prompt would write the null block
    (32, [0, 5, 6, 7, 8], False),   # 32 cached: keys from 13 on, block 0 is read
    (64, [0, 0, 6, 7, 8], True),    # 64 cached: keys from 45 on, blocks 0-1 never read
    (64, [0, 5, 0, 7, 8], False),   # ... but block 2 is
])
def test_the_null_block_is_never_written_nor_read_inside_the_window(hit, sliding, ok):
    prompt = list(range(3, 73))  # 70 tokens: five blocks
    so = step({"a": 70 - hit}, [new("a", prompt, ([1, 2, 3, 4, 9], sliding), computed=hit)])
    if ok:
        assert hybrid({}, so).meta.groups[1].attn.live_from_host.tolist() == [2]
    else:
        with pytest.raises(ValueError, match="null block 0 inside its window"):
            hybrid({}, so)
    with pytest.raises(ValueError, match="null block 0 in its table"):
        hybrid({}, step({"a": 70}, [new("a", prompt, ([1, 0, 3, 4, 9], [5, 6, 7, 8, 10]))]))


def test_a_windowed_group_holds_its_blocks_from_the_window_on():
    """vLLM frees 'a''s sliding blocks behind its window without telling the runner and may
    hand them to 'b' at once; one still inside the window stays 'a''s."""
    plan = hybrid({}, step({"a": 40}, [new("a", PROMPT, ([1, 2, 3], [4, 5, 6]))]))
    live = with_sampled(plan.requests, {"a": 7})  # 'a' computed 40: its next query sees 21..40
    took_freed = new("b", list(range(60, 80)), ([10, 11], [4, 12]))
    assert hybrid(live, step({"b": 20}, [took_freed])).requests["a"].block_ids[1] == (4, 5, 6)
    took_live = new("b", list(range(60, 80)), ([10, 11], [5, 12]))
    with pytest.raises(ValueError, match="writes block 5, which running request 'a' holds"):
        hybrid(live, step({"b": 20}, [took_live]))
    took_full = new("b", list(range(60, 80)), ([1, 11], [13, 12]))  # full blocks stay held
    with pytest.raises(ValueError, match="writes block 1, which running request 'a' holds"):
        hybrid(live, step({"b": 20}, [took_full]))
