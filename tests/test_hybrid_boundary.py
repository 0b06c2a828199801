"""A hybrid model at the vLLM boundary, without an engine: the block sizes the platform sets,
each layer's spec against vLLM's own state formulas, vLLM's groups split by kind, a step's
block lists turned into attention rows (kernel blocks) and state rows, and every refusal before
anything is written: a block list per group, a state row that does not reach the chunk's end,
a request resumed without its state, what align mode would need that is not built."""

from __future__ import annotations

import mlx.core as mx
import pytest
import torch
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator
from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

from paged_prefix import hybrid_config, hybrid_groups
from paged_prefix.architectures import architecture
from paged_prefix.models import BUILTIN_CONFIGS, build_model, hf_config
from paged_prefix.requests import Limits, plan_step
from paged_prefix.state_metadata import commit
from paged_prefix.vllm_plugin.model_info import Qwen3NextForCausalLM, register
from paged_prefix.vllm_runner import TORCH_TO_MLX
from tests.scheduler_outputs import cached, new, step

MODELS = ("qwen3-next-test", "lfm2-test")
# (block size, padded state page) in float32 at a 16-token configured block: Qwen3-Next's
# state (3 x 256 conv + 4 x 32 x 32 recurrent, 19456 bytes) needs two 16-token pages of 1024
# bytes a token; LFM2's (2 x 256 conv, 2048 bytes) fits one
EXPECTED = {"qwen3-next-test": (32, 32 * 1024), "lfm2-test": (16, 16 * 1024)}


def vllm_config(tmp_path, name, caching=True, **cache):
    register()  # what the platform does before vLLM inspects an architecture
    hf_config(BUILTIN_CONFIGS[name], tmp_path / name)
    config = VllmConfig(
        model_config=ModelConfig(model=str(tmp_path / name), skip_tokenizer_init=True,
                                 dtype="float32", max_model_len=512),
        cache_config=CacheConfig(block_size=16, enable_prefix_caching=caching, **cache),
        scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=128,
                                         max_model_len=512, is_encoder_decoder=False,
                                         enable_chunked_prefill=True))
    config.cache_config.kv_cache_layout = "LBNHC"  # the engine core resolves it to the worker's
    return config


@pytest.mark.parametrize("name", MODELS)
def test_the_platform_sets_the_hybrid_block_size(tmp_path, name):
    config = vllm_config(tmp_path, name)
    cache = config.cache_config
    block, padded = EXPECTED[name]
    assert (cache.block_size, cache.mamba_block_size, cache.mamba_page_size_padded) == \
        (block, block, padded)
    assert cache.mamba_cache_mode == "align" and cache.mamba_ssm_cache_dtype == "float32"
    off = vllm_config(tmp_path, name, caching=False).cache_config
    assert off.mamba_cache_mode == "none" and off.mamba_block_size == 512  # one a request


def test_align_mode_settings_not_built_are_refused_naming_them(tmp_path):
    with pytest.raises(ValueError, match="prefix-match-unit"):
        vllm_config(tmp_path, "lfm2-test", prefix_match_unit=8)


@pytest.mark.parametrize("name", MODELS)
def test_layer_specs_are_vllms_state_shapes(tmp_path, name):
    config = vllm_config(tmp_path, name)
    model = build_model(BUILTIN_CONFIGS[name], mx.float32)
    arch = architecture(BUILTIN_CONFIGS[name]["model_type"])
    recurrent = arch.recurrent(model)
    cache = config.cache_config
    attention = FullAttentionSpec(block_size=cache.block_size, num_kv_heads=2, head_size=64,
                                  dtype=torch.float32)
    dtypes = hybrid_config.state_dtypes(next(r for r in recurrent if r), torch.float32, cache)
    specs = hybrid_config.layer_specs(arch.attention(model), recurrent, attention, dtypes,
                               cache.mamba_block_size, cache.mamba_page_size_padded, "align")
    states = [s for s in specs.values() if isinstance(s, MambaSpec)]
    cfg = BUILTIN_CONFIGS[name]
    if name == "qwen3-next-test":  # the plugin's declaration, and vLLM's calculator
        want = Qwen3NextForCausalLM.get_mamba_state_shape_from_config(config)
        assert want == MambaStateShapeCalculator.gated_delta_net_state_shape(
            1, cfg["linear_num_key_heads"], cfg["linear_num_value_heads"],
            cfg["linear_key_head_dim"], cfg["linear_value_head_dim"],
            cfg["linear_conv_kernel_dim"])
        assert Qwen3NextForCausalLM.get_mamba_state_dtype_from_config(config) == dtypes
    else:  # vLLM's own LFM2 class imports here
        from vllm.model_executor.models.lfm2 import Lfm2ForCausalLM
        want = Lfm2ForCausalLM.get_mamba_state_shape_from_config(config)
    assert all(s.shapes == want and s.page_size_bytes == EXPECTED[name][1] for s in states)
    assert len(states) == 3 and len(specs) == 4
    # vLLM groups them: one attention group, a state group per recurrent layer (groups of one)
    groups = get_kv_cache_groups(config, specs)
    assert sorted(type(g.kv_cache_spec).__name__ for g in groups) == \
        ["FullAttentionSpec"] + ["MambaSpec"] * 3
    scale, _ = hybrid_config.budget_scale(config, specs)
    own = attention.page_size_bytes + sum(s.real_page_size_bytes for s in states)
    assert scale == pytest.approx(EXPECTED[name][1] / own)


def test_kernel_blocks_are_a_view_of_vllms():
    assert hybrid_groups.kernel_block_size(32) == 16 and hybrid_groups.kernel_block_size(544) == 16
    assert hybrid_groups.kernel_block_size(24) == 8
    assert hybrid_groups.kernel_block_ids([3, 0, 5], 2) == [6, 7, 0, 1, 10, 11]
    with pytest.raises(ValueError, match="^block_size"):
        hybrid_groups.kernel_block_size(12)


class Step:
    """qwen3-next-test's groups as vLLM configures them (block 32: 2 kernel blocks of 16)."""

    def __init__(self, tmp_path):
        config = vllm_config(tmp_path, "qwen3-next-test")
        model = build_model(BUILTIN_CONFIGS["qwen3-next-test"], mx.float32)
        arch = architecture("qwen3_next")
        self.recurrent = arch.recurrent(model)
        cache = config.cache_config
        attention = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64,
                                      dtype=torch.float32)
        specs = hybrid_config.layer_specs(arch.attention(model), self.recurrent, attention,
                                   (torch.float32, torch.float32), 32,
                                   cache.mamba_page_size_padded, "align")
        groups = get_kv_cache_groups(config, specs)
        self.kv_config = get_kv_cache_config_from_groups(config, groups, 40 * 32 * 1024)
        self.groups = hybrid_groups.CacheGroups.of(self.kv_config, self.recurrent, TORCH_TO_MLX)
        self.limits = Limits(512, 16, 2 * self.kv_config.num_blocks, 4,
                             hybrid=hybrid_groups.HybridLimits(
                                 self.groups, self.kv_config.num_blocks, 2, 4))
        self.ledger = {}

    def lists(self, attention, state):
        """One block list per vLLM group, in vLLM's group order."""
        out = [None] * self.groups.num_groups
        out[self.groups.attention] = list(attention)
        for i, g in enumerate(self.groups.states):
            out[g] = [b + 10 * i if b else 0 for b in state]
        return tuple(out)

    def plan(self, live, so):
        plan = plan_step(live, so, self.limits, self.ledger)
        commit(self.ledger, plan.meta.states)
        return plan


def test_a_step_splits_vllms_lists_into_kernel_blocks_and_state_rows(tmp_path):
    s = Step(tmp_path)
    assert len(s.groups.states) == 3 and len(s.groups.state_specs) == 3
    prompt = list(range(3, 73))  # 70 tokens: state blocks at 32, 64, 70
    plan = s.plan({}, step({"a": 64}, [new("a", prompt, s.lists([4, 5], [0, 7]))]))
    a = plan.requests["a"]
    assert a.block_ids == ((8, 9, 10, 11),)  # vLLM block b = kernel blocks 2b, 2b + 1
    assert a.state_rows == ((0, 7), (0, 17), (0, 27))
    rows = plan.meta.states.groups
    assert [r.dst_host.tolist() for r in rows] == [[7], [17], [27]]
    assert rows[0].fresh_host.tolist() == [True]
    # the next chunk reads the state after 64 tokens from row index 1, writes index 2
    plan = s.plan(plan.requests, step({"a": 6}, cached_reqs=cached(
        ["a"], [s.lists([6], [8])], [64])))
    assert plan.requests["a"].block_ids[0][-2:] == (12, 13)
    assert [r.src_host.tolist() + r.dst_host.tolist() for r in plan.meta.states.groups] == \
        [[7, 8], [17, 18], [27, 28]]


def test_a_state_row_short_of_the_chunk_is_refused(tmp_path):
    s = Step(tmp_path)
    with pytest.raises(ValueError, match=r"^state_block_ids\[group 0\] \('a'\): 64 tokens"):
        plan_step({}, step({"a": 64}, [new("a", list(range(3, 73)), s.lists([4, 5, 6], [0]))]),
                  s.limits, s.ledger)


def test_a_list_per_group_or_refused(tmp_path):
    s = Step(tmp_path)
    with pytest.raises(ValueError, match="one block list per KV-cache group"):
        plan_step({}, step({"a": 4}, [new("a", [3, 4, 5, 6], ([4],))]), s.limits, s.ledger)


def test_a_request_resumed_without_its_state_is_refused_before_anything_runs(tmp_path):
    """Preempted after 64 tokens, resumed with 64 computed (the scheduler's hit) in a row whose
    state block at index 1 holds nothing this runner wrote: refused, naming the count."""
    s = Step(tmp_path)
    prompt = list(range(3, 73))
    plan = s.plan({}, step({"a": 64}, [new("a", prompt, s.lists([4, 5, 6], [0, 7, 0]))]))
    live = plan_step(plan.requests, step({}, preempted=["a"]), s.limits, s.ledger).requests
    assert live["a"].block_ids == ((),) and live["a"].state_rows == ()
    resumed = step({"a": 6}, cached_reqs=cached(["a"], [s.lists([4, 5, 6], [0, 9, 3])], [64],
                                                resumed=["a"]))
    with pytest.raises(ValueError, match=r"^num_computed_tokens \('a'\): 64 tokens computed, "
                                         r"but state block 9 .* holds no state this runner"):
        plan_step(live, resumed, s.limits, s.ledger)
    # resumed on its own cached block (what vLLM's hit gives): accepted
    ok = step({"a": 6}, cached_reqs=cached(["a"], [s.lists([4, 5, 6], [0, 7, 3])], [64],
                                           resumed=["a"]))
    assert plan_step(live, ok, s.limits, s.ledger).meta.states.groups[0].src_host.tolist() == [7]


def test_block_copies_stay_refused_for_hybrid_models(tmp_path):
    s = Step(tmp_path)
    so = step({"a": 4}, [new("a", [3, 4, 5, 6], s.lists([4], [7]))])
    so.kv_cache_block_copies = [(1, 2)]
    with pytest.raises(ValueError, match="^kv_cache_block_copies"):
        plan_step({}, so, s.limits, s.ledger)


def test_zeroing_is_accepted_for_hybrid_models_only(tmp_path):
    s = Step(tmp_path)
    so = step({"a": 4}, [new("a", [3, 4, 5, 6], s.lists([4], [7]))])
    so.new_block_ids_to_zero = [4]
    assert plan_step({}, so, s.limits, s.ledger).meta.states is not None
    plain = Limits(512, 16, 32, 4)
    so = step({"a": 4}, [new("a", [3, 4, 5, 6], ([4],))])
    so.new_block_ids_to_zero = [4]
    with pytest.raises(ValueError, match="^new_block_ids_to_zero"):
        plan_step({}, so, plain)


def test_the_state_groups_of_a_config_must_be_the_models(tmp_path):
    s = Step(tmp_path)
    config = s.kv_config
    g = s.groups.states[0]
    bad = MambaSpec(block_size=32, shapes=((2, 256),), dtypes=(torch.float32,),
                    mamba_cache_mode="align")
    config.kv_cache_groups[g].kv_cache_spec = bad
    with pytest.raises(ValueError, match=f"^kv_cache_config: state group {g}'s shapes"):
        hybrid_groups.CacheGroups.of(config, s.recurrent, TORCH_TO_MLX)
