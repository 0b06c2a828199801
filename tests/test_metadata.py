"""Batch metadata: the values it derives, and a ValueError naming the field for bad input."""

import numpy as np
import pytest

from paged_prefix.metadata import ScheduledRequest, build_attention_metadata, build_batch_metadata

BS = 16


def req(req_id="r", n=40, prompt=None, computed=0, scheduled=None, blocks=(3, 1, 7)):
    return ScheduledRequest(req_id, list(range(100, 100 + n)), prompt or n, computed,
                            scheduled if scheduled is not None else n - computed, list(blocks))


def test_suffix_only_tokens_positions_and_slots():
    meta = build_batch_metadata([req(computed=32, blocks=(3, 1, 7))], BS, 8)
    assert meta.input_ids.tolist() == list(range(132, 140))
    assert meta.positions.tolist() == list(range(32, 40))
    # positions 32..39 live in the third block (id 7) at offsets 0..7
    assert meta.slot_mapping.tolist() == [7 * BS + i for i in range(8)]
    assert meta.attn.context_lens_host.tolist() == [32]
    assert meta.attn.seq_lens_host.tolist() == [40]
    assert meta.attn.cu_seqlens_q_host.tolist() == [0, 8]


def test_packed_batch_and_sampling_rows():
    meta = build_batch_metadata([
        req("prefill", n=40, computed=16, blocks=(3, 1, 7)),
        req("chunk", n=40, scheduled=20, blocks=(2, 4, 5)),  # mid-prompt: no sample
        req("decode", n=21, prompt=20, computed=20, blocks=(6, 0)),
    ], BS, 8)
    assert meta.attn.cu_seqlens_q_host.tolist() == [0, 24, 44, 45]
    assert meta.sample_req_ids == ("prefill", "decode")
    assert meta.logits_indices.tolist() == [23, 44]
    assert meta.attn.block_tables_host.tolist() == [[3, 1, 7], [2, 4, 0], [6, 0, 0]]
    assert meta.slot_mapping.tolist()[-1] == 0 * BS + 4  # position 20: block 0, offset 4


def test_metadata_is_frozen_and_host_mirrors_read_only():
    meta = build_batch_metadata([req()], BS, 8)
    with pytest.raises(AttributeError):
        meta.input_ids = None
    with pytest.raises(ValueError):
        meta.attn.seq_lens_host[0] = 1


@pytest.mark.parametrize("bad, field", [
    (dict(computed=-1), "num_computed_tokens"),
    (dict(computed=41, scheduled=1), "num_computed_tokens"),
    (dict(computed=30, scheduled=11), "num_scheduled_tokens"),
    (dict(scheduled=0), "num_scheduled_tokens"),
    (dict(prompt=50), "num_prompt_tokens"),
    (dict(blocks=(3, 1)), "block_tables"),
    (dict(blocks=(3, 1, 8)), "block_tables"),
    (dict(blocks=(3, -2, 7)), "block_tables"),
])
def test_bad_request_names_field(bad, field):
    with pytest.raises(ValueError, match=field):
        build_batch_metadata([req(**bad)], BS, 8)


def test_duplicate_and_empty_batches():
    with pytest.raises(ValueError, match="req_id"):
        build_batch_metadata([req("a"), req("a")], BS, 8)
    with pytest.raises(ValueError, match="requests"):
        build_batch_metadata([], BS, 8)


@pytest.mark.parametrize("kwargs, field", [
    (dict(q_lens=[]), "q_lens"),
    (dict(q_lens=[0]), "q_lens"),
    (dict(context_lens=[-3]), "context_lens"),
    (dict(context_lens=[1, 2]), "context_lens"),
    (dict(block_tables=[[1]]), "block_tables"),
    (dict(block_size=0), "block_size"),
    (dict(num_blocks=0), "num_blocks"),
    (dict(context_lens=[2**31]), "seq_lens"),
])
def test_bad_attention_geometry_names_field(kwargs, field):
    args = dict(q_lens=[5], context_lens=[20], block_tables=[[1, 2]], block_size=BS,
                num_blocks=4)
    args.update(kwargs)
    with pytest.raises(ValueError, match=field):
        build_attention_metadata(**args)


def test_plan_is_built_once_per_forward():
    meta = build_attention_metadata([5], [20], [[1, 2]], BS, 4)
    calls = []
    for _ in range(3):
        meta.plan("k", lambda m: calls.append(1) or np.arange(3))
    assert calls == [1]
