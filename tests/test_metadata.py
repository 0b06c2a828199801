"""Batch metadata: the values it derives, and a ValueError naming the field for bad input."""

import mlx.core as mx
import numpy as np
import pytest

from jit_kernels.arrays import device_array
from paged_prefix.metadata import ScheduledRequest, build_attention_metadata, build_batch_metadata
from paged_prefix.validate import index_dtype

BS = 16


def req(req_id="r", n=40, prompt=None, computed=0, scheduled=None, blocks=(3, 1, 7), tokens=None):
    return ScheduledRequest(req_id, tokens if tokens is not None else list(range(100, 100 + n)),
                            prompt or n, computed,
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


def test_resumed_request_samples_only_after_its_last_known_token():
    """Defect 1: a preempted request re-prefills prompt + outputs; a chunk that ends past the
    prompt but before the last known token must not sample (vLLM discards such samples)."""
    resumed = ScheduledRequest("a", list(range(100, 130)), 20, 0, 24, [0, 1])
    assert build_batch_metadata([resumed], BS, 4).sample_req_ids == ()
    last = ScheduledRequest("a", list(range(100, 130)), 20, 24, 6, [0, 1])
    assert build_batch_metadata([last], BS, 4).sample_req_ids == ("a",)


def test_metadata_is_frozen_and_host_mirrors_read_only():
    meta = build_batch_metadata([req()], BS, 8)
    with pytest.raises(AttributeError):
        meta.input_ids = None
    for host in (meta.attn.seq_lens_host, meta.slot_mapping_host, meta.input_ids_host):
        with pytest.raises(ValueError):
            host[0] = 1


@pytest.mark.parametrize("bad, field", [
    (dict(computed=-1), "num_computed_tokens"),
    (dict(computed=41, scheduled=1), "num_computed_tokens"),
    (dict(computed=30, scheduled=11), "num_scheduled_tokens"),
    (dict(scheduled=0), "num_scheduled_tokens"),
    (dict(prompt=50), "num_prompt_tokens"),
    (dict(blocks=(3, 1)), "block_tables"),
    (dict(blocks=(3, 1, 8)), "block_tables"),
    (dict(blocks=(3, -2, 7)), "block_tables"),
    (dict(blocks=()), "block_tables"),
    (dict(blocks=(3, 11.7, 7)), "block_tables"),  # not truncated to 11
    (dict(blocks=(3, 3, 7)), "block_tables"),  # the same block twice in one table
    (dict(blocks=(3, 1, 2**70)), "block_tables"),
    (dict(scheduled=2.5, computed=0), "num_scheduled_tokens"),
    (dict(computed=True), "num_computed_tokens"),
    (dict(tokens=[1.5] * 40), "token_ids"),
    (dict(tokens=[-1] * 40), "token_ids"),
    (dict(tokens=[2**30] * 40), "token_ids"),  # past the vocabulary of 1000
    (dict(tokens=[2**70] * 40), "token_ids"),
    (dict(n=0, tokens=[], scheduled=1), "num_scheduled_tokens"),  # an empty prompt
    (dict(blocks=(3, True, 7)), "block_tables"),  # numpy would read [3, True, 7] as [3, 1, 7]
    (dict(blocks=(3, np.True_, 7)), "block_tables"),
    (dict(tokens=[5] * 39 + [True]), "token_ids"),
    (dict(tokens=iter(range(40))), "token_ids"),
    (dict(tokens="a string of forty characters, not ids.."), "token_ids"),
])
def test_bad_request_names_field(bad, field):
    with pytest.raises(ValueError, match=field):
        build_batch_metadata([req(**bad)], BS, 8, vocab_size=1000)


@pytest.mark.parametrize("token", [2**31, 2**31 + 3, 2**32 + 5])
def test_token_ids_fit_int32_without_a_vocabulary(token):
    """With no vocabulary to bound them, token ids are bounded by their int32 transport (a
    wrapped id would be another token, or a negative row of the embedding)."""
    with pytest.raises(ValueError, match="token_ids"):
        build_batch_metadata([req(tokens=[5] * 39 + [token])], BS, 8)
    meta = build_batch_metadata([req(tokens=[5] * 39 + [2**31 - 1])], BS, 8)
    assert meta.input_ids_host[-1] == 2**31 - 1


def test_bad_request_id_and_batches():
    with pytest.raises(ValueError, match="req_id"):
        build_batch_metadata([req("a"), req("a", blocks=(2, 4, 5))], BS, 8)
    with pytest.raises(ValueError, match="req_id"):
        build_batch_metadata([req(None)], BS, 8)
    with pytest.raises(ValueError, match="requests"):
        build_batch_metadata([], BS, 8)
    with pytest.raises(ValueError, match="token_ids"):
        build_batch_metadata([ScheduledRequest("a", None, 1, 0, 1, [3])], BS, 8)


def test_overlapping_writes_are_refused():
    """Defect 4: two sequences writing one block, or writing a block another reads as its
    prefix with other tokens (or at another position), is a collision, not a hit."""
    with pytest.raises(ValueError, match="both write block 1"):
        build_batch_metadata([req("a", blocks=(3, 1, 7)), req("b", blocks=(2, 1, 5))], BS, 8)
    other = list(range(500, 540))
    with pytest.raises(ValueError, match="writes other tokens"):
        build_batch_metadata([req("a", blocks=(3, 1, 7)),
                              req("b", computed=32, blocks=(3, 1, 5), tokens=other)], BS, 8)
    with pytest.raises(ValueError, match="another position"):
        build_batch_metadata([req("a", blocks=(3, 1, 7)),
                              req("b", computed=32, blocks=(1, 3, 5))], BS, 8)
    # a reads block 1 as cached up to token 32, but b writes it only up to token 20 (a chunk)
    with pytest.raises(ValueError, match="fills it only up to token 20"):
        build_batch_metadata([req("b", scheduled=20, blocks=(3, 1, 7)),
                              req("a", computed=32, blocks=(3, 1, 5))], BS, 8)


def test_shared_prefix_blocks_stay_legal():
    # read-only sharing, and a block written this forward by the request whose tokens it holds
    shared = build_batch_metadata([req("a", computed=32, blocks=(3, 1, 7)),
                                   req("b", computed=32, blocks=(3, 1, 5))], BS, 8)
    assert shared.attn.num_seqs == 2
    same_forward = build_batch_metadata([req("a", blocks=(3, 1, 7)),
                                         req("b", computed=32, blocks=(3, 1, 5))], BS, 8)
    assert same_forward.sample_req_ids == ("a", "b")


@pytest.mark.parametrize("kwargs, field", [
    (dict(q_lens=[]), "q_lens"),
    (dict(q_lens=[0]), "q_lens"),
    (dict(q_lens=[2.5]), "q_lens"),
    (dict(context_lens=[-3]), "context_lens"),
    (dict(context_lens=[1, 2]), "context_lens"),
    (dict(block_tables=[[1]]), "block_tables"),
    (dict(block_size=0), "block_size"),
    (dict(num_blocks=0), "num_blocks"),
    (dict(num_blocks=2**40), "num_blocks"),
    (dict(context_lens=[2**31]), "context_lens"),
    (dict(context_lens=[2**31 - 3]), "seq_lens"),
])
def test_bad_attention_geometry_names_field(kwargs, field):
    args = dict(q_lens=[5], context_lens=[20], block_tables=[[1, 2]], block_size=BS,
                num_blocks=4)
    args.update(kwargs)
    with pytest.raises(ValueError, match=field):
        build_attention_metadata(**args)


def test_padding_entries_are_zero_and_tables_int32():
    meta = build_attention_metadata([5, 1], [20, 0], [[1, 2], [3]], BS, 4)
    assert meta.block_tables_host.dtype == np.int32
    assert meta.block_tables_host.tolist() == [[1, 2], [3, 0]]


def test_slot_ids_are_int32_while_every_cache_row_fits():
    assert index_dtype(2**31) is np.int32  # the last row is 2**31 - 1
    assert index_dtype(2**31 + 1) is np.int64


@pytest.mark.parametrize("host", [np.array([5], np.int32), np.array([5, 6], np.int32),
                                  np.array([[4]], np.int32), np.array([[4, 9]], np.int32),
                                  np.array([7], np.int64), np.zeros(0, np.int32),
                                  np.arange(12, dtype=np.int32).reshape(3, 4)])
def test_device_arrays_keep_values_shape_and_dtype(host):
    # arrays of <= 8 bytes come back as views of a longer buffer (MLX's small pool is slow to
    # read on CUDA); what a kernel or op sees must not change
    out = device_array(host)
    assert out.shape == host.shape and out.dtype == mx.array(host).dtype
    assert out.tolist() == host.tolist()

