"""Batch metadata: the values it derives, and a ValueError naming the field for bad input."""

import mlx.core as mx
import numpy as np
import pytest

from jit_kernels.arrays import device_array
from paged_prefix.attention_metadata import build_attention_metadata
from paged_prefix.metadata import ScheduledRequest, build_batch_metadata
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


def test_a_bad_id_in_a_batch_is_named_by_its_row_or_request():
    """A batch's ids are checked together, and a bad one still names its table row or its
    request; a row that is no list of ids is refused the same way."""
    good = req("a", blocks=(3, 1, 7))
    with pytest.raises(ValueError, match=r"block_tables\[1\]: expected integers in \[0, 7\], "
                                         r"got \[9\]"):
        build_batch_metadata([good, req("b", blocks=(2, 9, 5))], BS, 8)
    with pytest.raises(ValueError, match="sequence 1 names a block twice"):
        build_batch_metadata([good, req("b", blocks=(2, 5, 5))], BS, 8)
    with pytest.raises(ValueError, match=r"token_ids \('b'\)"):
        build_batch_metadata([good, req("b", blocks=(2, 4, 5), tokens=[5] * 39 + [5000])],
                             BS, 8, vocab_size=1000)
    for row in (3, "12", [[1, 2]], (b for b in (1, 2))):
        with pytest.raises(ValueError, match=r"block_tables\[1\]: expected"):
            build_attention_metadata([5, 5], [20, 20], [[1, 2], row], BS, 8)


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
    # at the edge: b must fill block 1 up to a's 32nd token, no row short of it
    with pytest.raises(ValueError, match="fills it only up to token 31"):
        build_batch_metadata([req("b", scheduled=31, blocks=(3, 1, 7)),
                              req("a", computed=32, blocks=(3, 1, 5))], BS, 8)
    build_batch_metadata([req("b", scheduled=32, blocks=(3, 1, 7)),
                          req("a", computed=32, blocks=(3, 1, 5))], BS, 8)


def test_requests_must_be_a_sequence():
    with pytest.raises(ValueError, match="requests: expected a sequence"):
        build_batch_metadata((r for r in [req("a")]), BS, 8)


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
    (dict(block_tables=5), "block_tables: expected one sequence of block ids"),
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



# A windowed KV-cache group (vLLM's hybrid manager): W = 20 over blocks of 16. A sequence with 40
# tokens cached and 8 new sees keys from 40 - 20 + 1 = 21 on: block 0 is never read.
WINDOWS = (None, 20)


def windowed(req_id="r", full=(3, 1, 7), sliding=(0, 2, 4)):
    """A 48-token prompt, 40 of them cached, in both groups."""
    return ScheduledRequest(req_id, list(range(100, 148)), 48, 40, 8, (list(full), list(sliding)))


def test_a_windowed_group_reads_from_its_first_visible_key():
    meta = build_batch_metadata([windowed()], BS, 8, windows=WINDOWS)
    full, sliding = meta.groups
    assert (full.attn.window, sliding.attn.window) == WINDOWS
    assert full.attn.live_from_host.tolist() == [0] and sliding.attn.live_from_host.tolist() == [1]
    assert sliding.attn.live_blocks().tolist() == [[0, 2], [0, 4]]  # not block 0
    # each group's new rows go to its own blocks: positions 40..47 in the third block
    assert full.slot_mapping.tolist() == [7 * BS + 8 + i for i in range(8)]
    assert sliding.slot_mapping.tolist() == [4 * BS + 8 + i for i in range(8)]
    assert meta.positions.tolist() == list(range(40, 48))
    with pytest.raises(ValueError, match="attn: this forward has 2 KV-cache groups"):
        _ = meta.attn


@pytest.mark.parametrize("window, first", [(1, 2), (8, 2), (9, 2), (24, 1), (25, 1), (41, 0),
                                           (10**6, 0)])
def test_the_first_live_block_is_that_of_the_first_visible_key(window, first):
    """key_start = max(0, 40 - W + 1): W = 1 sees only the new tokens (block 2 holds 32..47)."""
    meta = build_batch_metadata([windowed()], BS, 8, windows=(None, window))
    assert meta.groups[1].attn.live_from_host.tolist() == [first]


@pytest.mark.parametrize("dead", [(0, 2, 4), (5, 2, 4), (1, 2, 4), (2, 2, 4)],
                         ids=["null block", "a free block", "another group's", "a repeat"])
def test_entries_left_of_the_window_need_only_be_pool_ids(dead):
    """vLLM frees a windowed group's blocks outside the window: what its list holds there is
    its null block, or a block it has since handed out; no check applies but the pool's."""
    meta = build_batch_metadata([windowed(sliding=dead)], BS, 8, windows=WINDOWS)
    assert meta.groups[1].attn.block_tables_host.tolist() == [list(dead)]
    with pytest.raises(ValueError, match=r"block_tables\[group 1\]\[0\]"):
        build_batch_metadata([windowed(sliding=(8, 2, 4))], BS, 8, windows=WINDOWS)


def test_a_stale_entry_may_be_a_block_another_sequence_writes():
    """'b' was handed 'a''s freed block 6 and fills it in this forward; 'a' no longer sees it."""
    a = windowed("a", full=(3, 1, 7), sliding=(6, 2, 4))
    b = ScheduledRequest("b", list(range(300, 320)), 20, 0, 20, ([9, 10], [6, 5]))
    meta = build_batch_metadata([a, b], BS, 12, windows=WINDOWS)
    assert meta.groups[1].slot_mapping_host[8:].tolist() == [6 * BS + i for i in range(16)] + \
        [5 * BS + i for i in range(4)]


@pytest.mark.parametrize("a_sliding, b_sliding, match", [
    ((0, 2, 2), (6, 5), "names a block twice among the blocks 1 .. 2"),
    ((0, 2, 4), (4, 5), "both write block 4"),
    ((0, 5, 4), (6, 5), "reads block 5 as cached prefix while .b. writes other tokens"),
    ((0, 2, 4), (2, 5), "reads block 2 as its cached prefix while sequence 1 writes it"),
])
def test_live_blocks_keep_every_check(a_sliding, b_sliding, match):
    a = windowed("a", full=(3, 1, 7), sliding=a_sliding)
    b = ScheduledRequest("b", list(range(300, 320)), 20, 0, 20, ([9, 10], list(b_sliding)))
    with pytest.raises(ValueError, match=match):
        build_batch_metadata([a, b], BS, 12, windows=WINDOWS)


def test_a_block_belongs_to_one_group_in_a_forward():
    with pytest.raises(ValueError, match="block 2 is read or written by KV-cache groups 0 and 1"):
        build_batch_metadata([windowed(full=(3, 2, 7), sliding=(0, 2, 4))], BS, 8,
                             windows=WINDOWS)
    # a stale entry of the windowed group may name a block the full group uses
    build_batch_metadata([windowed(full=(3, 1, 7), sliding=(3, 2, 4))], BS, 8, windows=WINDOWS)


@pytest.mark.parametrize("blocks", [[3, 1, 7], ([3, 1, 7],), ([3, 1, 7], [0, 2], [4, 5, 6])],
                         ids=["flat", "one list", "three lists"])
def test_one_block_list_per_group(blocks):
    request = ScheduledRequest("r", list(range(100, 140)), 40, 32, 8, blocks)
    with pytest.raises(ValueError, match=r"block_ids \('r'\): \d block lists for 2 KV-cache"):
        build_batch_metadata([request], BS, 8, windows=WINDOWS)
    meta = build_batch_metadata([request], BS, 8) if len(blocks) != 3 else None
    assert meta is None or meta.attn.block_tables_host.tolist() == [[3, 1, 7]]
