"""vLLM's KV-cache groups: the specs the worker reports, the layout vLLM's own grouping gives
back (checked, and never more memory than its tensors hold), and the runner over groups whose
layers share arrays: the same logits as one group, written in place."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest
import torch
from vllm.config import SchedulerConfig, VllmConfig
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheGroupSpec,
)

from paged_prefix import runner as runner_module
from paged_prefix.dispatch import Dispatcher
from paged_prefix.kv_cache import PagedKVCache
from paged_prefix.kv_groups import cache_layout, kv_cache_config, layer_specs
from paged_prefix.kv_layout import KVGroup, KVLayout
from paged_prefix.metadata import ScheduledRequest, build_batch_metadata
from paged_prefix.models import build_model, resolve_config
from paged_prefix.runner import PagedModelRunner

BS, HEADS, HEAD_DIM = 16, 2, 64
GEMMA_LIKE = tuple(None if i % 6 == 5 else 32 for i in range(12))  # 5 sliding : 1 full


def config_for(windows, num_blocks=64, hybrid=True):
    vllm_config = VllmConfig(scheduler_config=SchedulerConfig(
        max_model_len=1024, is_encoder_decoder=False,
        disable_hybrid_kv_cache_manager=not hybrid))
    specs = layer_specs(windows, BS, HEADS, HEAD_DIM, torch.float32)
    return kv_cache_config(vllm_config, specs, num_blocks)


def test_each_layer_reports_full_attention_or_its_window():
    specs = layer_specs((None, 32, 4096), BS, HEADS, HEAD_DIM, torch.bfloat16)
    assert list(specs) == [f"model.layers.{i}.self_attn.attn" for i in range(3)]
    assert type(specs["model.layers.0.self_attn.attn"]) is FullAttentionSpec
    assert [s.sliding_window for s in list(specs.values())[1:]] == [32, 4096]
    assert all(s.page_size_bytes == 2 * BS * HEADS * HEAD_DIM * 2 for s in specs.values())


@pytest.mark.parametrize("windows, groups, arrays", [
    (GEMMA_LIKE[:6], 6, 1),   # one layer a group: all six share one array pair
    (GEMMA_LIKE, 6, 2),       # groups of two layers
    ((None, None, 32, 32), 2, 2),
    ((None,) * 3, 1, 3),      # one group: an array pair per layer
])
def test_vllms_groups_become_the_layout_in_the_memory_vllm_budgeted(windows, groups, arrays):
    config = config_for(windows)
    layout, spec = cache_layout(config, windows)
    assert len(layout.groups) == len(config.kv_cache_groups) == groups
    assert layout.num_arrays == arrays
    for group, vllm_group in zip(layout.groups, config.kv_cache_groups):
        assert group.window == getattr(vllm_group.kv_cache_spec, "sliding_window", None)
        assert [windows[i] for i in group.layers] == [group.window] * len(group.layers)
    cache = PagedKVCache(len(windows), config.num_blocks, BS, HEADS, HEAD_DIM, mx.float32,
                         layout)
    assert cache.nbytes == max(t.size for t in config.kv_cache_tensors)


def test_without_the_hybrid_manager_one_group_keeps_every_block():
    """--disable-hybrid-kv-cache-manager: vLLM merges the layers into one full-attention group
    (its spec records the window); every block is kept, windowed layers mask inside them."""
    config = config_for(GEMMA_LIKE, hybrid=False)
    assert config.kv_cache_groups[0].kv_cache_spec.sliding_window == 32
    layout, _ = cache_layout(config, GEMMA_LIKE)
    assert layout.windows == (None,) and layout.num_arrays == 12


def replace_group(config, g, spec):
    groups = list(config.kv_cache_groups)
    groups[g] = KVCacheGroupSpec(groups[g].layer_names, spec)
    return dataclasses.replace(config, kv_cache_groups=groups)


def malformed(kind):
    config = config_for(GEMMA_LIKE[:6])
    sliding = config.kv_cache_groups[0].kv_cache_spec
    if kind == "window":
        return replace_group(config, 0, dataclasses.replace(sliding, sliding_window=16))
    if kind == "chunked":
        return replace_group(config, 0, ChunkedLocalAttentionSpec(
            block_size=BS, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=torch.float32,
            attention_chunk_size=32))
    if kind == "pages":
        return replace_group(config, 0, dataclasses.replace(sliding, num_kv_heads=4))
    if kind == "missing layer":
        return dataclasses.replace(config, kv_cache_groups=config.kv_cache_groups[1:])
    if kind == "unknown layer":
        group = KVCacheGroupSpec(["model.layers.9.self_attn.attn"], sliding)
        return dataclasses.replace(config, kv_cache_groups=[group, *config.kv_cache_groups[1:]])
    if kind == "no tensors":
        return dataclasses.replace(config, kv_cache_tensors=[])
    if kind == "small tensors":
        tensors = [dataclasses.replace(t, size=t.size // 2) for t in config.kv_cache_tensors]
        return dataclasses.replace(config, kv_cache_tensors=tensors)
    if kind == "strides":
        tensors = [dataclasses.replace(t, block_stride=2 * t.block_stride)
                   for t in config.kv_cache_tensors]
        return dataclasses.replace(config, kv_cache_tensors=tensors)
    return dataclasses.replace(config, kv_cache_layout="BLNHC")


@pytest.mark.parametrize("kind, match", [
    ("window", r"group 0 frees blocks outside a window of 16, but layers \[0\] attend with"),
    ("chunked", "group 0 is ChunkedLocalAttentionSpec"),
    ("pages", "group 1's pages .16 tokens of 2 kv heads of 64, torch.float32. differ"),
    ("missing layer", r"layers \[0\] are in no group"),
    ("unknown layer", "layer 'model.layers.9.self_attn.attn' is not one of the model's 6"),
    ("no tensors", "in no kv_cache_tensors entry"),
    ("small tensors", "regions of 64 pages"),
    ("strides", "regions of 64 pages"),
    ("layout", "layout 'BLNHC'"),
])
def test_a_config_this_cache_cannot_hold_is_refused_naming_it(kind, match):
    with pytest.raises(ValueError, match=match):
        cache_layout(malformed(kind), GEMMA_LIKE[:6])


# The runner over two full-attention groups of one layer each (vLLM groups by spec, so only a
# test builds this): both layers share one array pair, each reads its own blocks.
MODEL = resolve_config("llama-test")  # two layers


def run(layout, tables, num_blocks=40, path="reference", pipeline=None):
    """Prefill 'a' (35 tokens), then a decode row of 'a' beside 'b' hitting 'a''s first two
    blocks: the logits of both steps."""
    model = build_model(MODEL, mx.float32, seed=3)
    cache = PagedKVCache(2, num_blocks, BS, MODEL["num_key_value_heads"], MODEL["head_dim"],
                         mx.float32, layout)
    runner = PagedModelRunner(model, cache, Dispatcher(path), pipeline)
    windows = cache.windows
    a = list(range(5, 40))
    b = a[:32] + list(range(200, 210))
    first = runner.forward(build_batch_metadata(
        [ScheduledRequest("a", a, 35, 0, 35, tables["a"])], BS, num_blocks, windows=windows))
    mx.eval(first, cache.arrays())
    token = int(mx.argmax(first[0]))
    second = runner.forward(build_batch_metadata(
        [ScheduledRequest("a", a + [token], 35, 35, 1, tables["a"]),
         ScheduledRequest("b", b, 42, 32, 10, tables["b"])], BS, num_blocks, windows=windows))
    mx.eval(second, cache.arrays())
    return np.array(first), np.array(second), runner


ONE_GROUP = {"a": [3, 4, 5], "b": [3, 4, 9]}
TWO_GROUPS = {"a": ([3, 4, 5], [10, 11, 12]), "b": ([3, 4, 9], [10, 11, 20])}


@pytest.mark.parametrize("path", ["reference", "sdpa"])
def test_groups_sharing_an_array_give_one_groups_logits(path):
    shared = KVLayout.of([KVGroup((0,)), KVGroup((1,))], 2)
    assert shared.array_of == (0, 0) and shared.wait_before == {1}
    want = run(None, ONE_GROUP, path=path)
    got = run(shared, TWO_GROUPS, path=path)
    for w, g in zip(want[:2], got[:2]):
        np.testing.assert_array_equal(g, w)  # the same ops on the same rows: exact
    k, _ = (np.array(x).reshape(40, BS, -1) for x in got[2].kv_cache.blocks(0))
    assert k[[3, 4, 5, 9, 10, 11, 12, 20]].any(axis=(1, 2)).all()  # both groups' rows are there
    assert not np.delete(k, [3, 4, 5, 9, 10, 11, 12, 20], axis=0).any()


def test_pipelined_forwards_over_a_shared_array_change_no_bit():
    """Sent to the device layer by layer (the GPU default for long forwards) and waiting before
    the shared array's second write: the same logits and cache rows as one evaluation."""
    shared = KVLayout.of([KVGroup((0,)), KVGroup((1,))], 2)
    at_once, sent = run(shared, TWO_GROUPS, pipeline=False), run(shared, TWO_GROUPS, pipeline=True)
    for a, b in zip(at_once[:2], sent[:2]):
        np.testing.assert_array_equal(b, a)
    for a, b in zip(at_once[2].kv_cache.arrays(), sent[2].kv_cache.arrays()):
        np.testing.assert_array_equal(np.array(b), np.array(a))


# on a GPU MLX holds an array until the device has run what reads it: the wait matters most
@pytest.mark.parametrize("path", ["reference", "sdpa", pytest.param("auto", marks=pytest.mark.gpu)])
def test_a_forward_over_a_shared_array_writes_in_place(path, monkeypatch):
    """Layer 1 writes the array layer 0 wrote and read (its cached prefix) in the same forward:
    the runner waits for the device first, so the write updates it in place (without the wait
    MLX copies the whole array: the peak then grows by one array)."""
    waits = []
    real = runner_module._wait_for_device
    monkeypatch.setattr(runner_module, "_wait_for_device",
                        lambda *a: waits.append(1) or real(*a))
    layout = KVLayout.of([KVGroup((0,)), KVGroup((1,))], 2)
    num_blocks = 4096  # 32 MiB per K and per V
    model = build_model(MODEL, mx.float32, seed=3)
    cache = PagedKVCache(2, num_blocks, BS, MODEL["num_key_value_heads"], MODEL["head_dim"],
                         mx.float32, layout)
    runner = PagedModelRunner(model, cache, Dispatcher(path))
    tokens, blocks = list(range(5, 69)), ([1, 2, 3, 4], [5, 6, 7, 8])
    prefill = build_batch_metadata([ScheduledRequest("a", tokens, 64, 0, 64, blocks)], BS,
                                   num_blocks, windows=cache.windows)
    mx.eval(runner.forward(prefill), cache.arrays())  # also builds the runner's stacks
    mx.synchronize()
    # half of it again over its cached first half: each layer reads the array it writes
    meta = build_batch_metadata([ScheduledRequest("a", tokens, 64, 32, 32, blocks)], BS,
                                num_blocks, windows=cache.windows)
    growth = []
    for _ in range(2):
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        mx.eval(runner.forward(meta), cache.arrays())
        mx.synchronize()
        growth.append(mx.get_peak_memory() - base)
    array = cache.nbytes // 2
    assert len(waits) == 3 and max(growth) < array // 4, (growth, array)
