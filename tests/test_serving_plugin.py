"""The plugin's switches and refusals, the model loader, and the converted SmolLM2 folders."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import pytest

from paged_prefix import vllm_plugin
from paged_prefix.model_loader import load_model, read_config

from .serving_support import random_folders, smollm2


@pytest.mark.parametrize("setting, platform, metal_installed, expected", [
    (None, "linux", False, vllm_plugin.PLATFORM),
    ("0", "linux", False, None),
    ("1", "linux", False, vllm_plugin.PLATFORM),
    (None, "darwin", False, vllm_plugin.PLATFORM),
    (None, "darwin", True, None),  # vllm-metal's plugin is the default there
    ("1", "darwin", True, vllm_plugin.PLATFORM),
])
def test_register_follows_the_switch_and_yields_to_vllm_metal(monkeypatch, setting, platform,
                                                               metal_installed, expected):
    if setting is None:
        monkeypatch.delenv(vllm_plugin.ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(vllm_plugin.ENV_VAR, setting)
    monkeypatch.setattr(sys, "platform", platform)
    real_find_spec = vllm_plugin.importlib.util.find_spec
    monkeypatch.setattr(vllm_plugin.importlib.util, "find_spec",
                        lambda name: (object() if metal_installed else None)
                        if name == "vllm_metal" else real_find_spec(name))
    assert vllm_plugin.register() == expected


def test_register_refuses_an_unknown_setting(monkeypatch):
    monkeypatch.setenv(vllm_plugin.ENV_VAR, "yes")
    with pytest.raises(ValueError, match=vllm_plugin.ENV_VAR):
        vllm_plugin.register()


def test_platform_refuses_what_the_runner_cannot_do():
    from vllm.config import VllmConfig

    from paged_prefix.vllm_plugin.platform import WORKER_CLS, MLXPlatform

    config = VllmConfig()
    config.parallel_config.worker_cls = "auto"
    MLXPlatform.check_and_update_config(config)
    assert config.parallel_config.worker_cls == WORKER_CLS
    config.cache_config.cache_dtype = "fp8"
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        MLXPlatform.check_and_update_config(config)
    config.cache_config.cache_dtype = "auto"
    config.parallel_config.world_size = 2  # as tensor_parallel_size=2 makes it
    with pytest.raises(ValueError, match="one worker"):
        MLXPlatform.check_and_update_config(config)


@pytest.mark.parametrize("setting,flag", [
    (lambda c: setattr(c, "speculative_config", object()), "--speculative-config"),
    (lambda c: setattr(c, "lora_config", object()), "--enable-lora"),
    (lambda c: setattr(c.cache_config, "kv_offloading_size", 1.0), "--kv-offloading-size"),
    (lambda c: setattr(c, "kv_transfer_config", object()), "--kv-transfer-config"),
    (lambda c: setattr(c, "ec_transfer_config", object()), "--ec-transfer-config"),
    (lambda c: setattr(c.offload_config.uva, "cpu_offload_gb", 2), "--cpu-offload-gb"),
    (lambda c: setattr(c.offload_config.prefetch, "offload_group_size", 4),
     "--offload-group-size"),
    (lambda c: setattr(c.cache_config, "kv_sharing_fast_prefill", True),
     "--kv-sharing-fast-prefill"),
    (lambda c: setattr(c, "watermark_config", object()), "--watermark-config"),
    (lambda c: setattr(c.aux_output_config, "enable_return_routed_experts", True),
     "--enable-return-routed-experts"),
    (lambda c: setattr(c, "diffusion_config", object()), "--diffusion-config"),
    (lambda c: setattr(c, "model_config", SimpleNamespace(
        enable_sleep_mode=False, hf_overrides={"num_hidden_layers": 2})), "--hf-overrides"),
    (lambda c: setattr(c.load_config, "load_format", "dummy"), "--load-format"),
    (lambda c: setattr(c.attention_config, "backend", "FLASH_ATTN"), "--attention-backend"),
])
def test_platform_refuses_flags_the_worker_does_not_implement(setting, flag):
    """At config time, naming the flag: not deep in engine start-up (a KV connector asks the
    worker for `get_kv_connector_handshake_metadata`) or at first use."""
    from vllm.config import VllmConfig

    from paged_prefix.vllm_plugin.platform import MLXPlatform

    config = VllmConfig()
    setting(config)
    with pytest.raises(ValueError, match=f"paged_prefix: .*\\({flag}\\) is not supported"):
        MLXPlatform.check_and_update_config(config)


def test_loader_names_unsupported_architectures_and_missing_folders(tmp_path):
    with pytest.raises(ValueError, match="not a local model folder"):
        read_config(tmp_path / "missing")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "cohere2"}))
    with pytest.raises(ValueError, match="'cohere2'.*llama"):
        load_model(tmp_path)


@pytest.mark.parametrize("variant", ["q4", "float32"])
def test_smollm2_folders_load_and_answer(variant):
    """The converted folders are plain mlx-lm folders: quantized weights stay quantized, and
    through the paged runner both answer the classic question."""
    from paged_prefix.kv_cache import PagedKVCache
    from paged_prefix.metadata import ScheduledRequest, build_batch_metadata
    from paged_prefix.runner import PagedModelRunner

    folder = smollm2(variant)
    config = read_config(folder)
    assert ("quantization" in config) == (variant == "q4")
    for name in ("tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        assert (folder / name).is_file()
    assert "chat_template" in json.loads((folder / "tokenizer_config.json").read_text())
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tokenizer = load_tokenizer(folder)
    ids = tokenizer.encode("The capital of France is")
    model = load_model(folder)
    cache = PagedKVCache(config["num_hidden_layers"], 4, 16, config["num_key_value_heads"],
                         config["head_dim"], getattr(mx, config["torch_dtype"]))
    runner = PagedModelRunner(model, cache)
    for _ in range(2):
        request = ScheduledRequest("a", ids, len(ids), 0, len(ids), [0, 1])
        ids = ids + runner.greedy(build_batch_metadata([request], 16, 4))
    assert "Paris" in tokenizer.decode(ids[-2:])


def test_dense_folder_is_a_hugging_face_llama_checkpoint():
    """The conversion undoes llama.cpp's q/k row permutation: transformers' own
    LlamaForCausalLM (standard RoPE, no mlx-lm option) reads the float32 folder and gives
    mlx-lm's logits."""
    import numpy as np
    import torch
    from mlx_lm import load
    from transformers import AutoModelForCausalLM

    folder = smollm2("float32")
    model, tokenizer = load(str(folder))
    ids = tokenizer.encode("The capital of France is")
    expected = np.array(model(mx.array([ids]))[0])
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(logits, expected, atol=2e-3, rtol=0)
    assert "Paris" in tokenizer.decode([int(logits[-1].argmax())])


@pytest.mark.parametrize("args, message", [
    # the measured budget: 1% of the host's RAM cannot even hold the weights
    (["--gpu-memory-utilization", "0.01"], "no memory is left for the KV cache"),
    # vLLM's own check on the budget: one sequence of max_model_len tokens must fit
    (["--kv-cache-memory-bytes", "1000000"], "To serve at least one request"),
])
def test_server_refuses_to_start_without_room_for_one_sequence(tmp_path, args, message):
    from bench.vllm_server import VllmServer

    with pytest.raises(RuntimeError, match="exited") as error:
        with VllmServer(smollm2(), ["--max-model-len", "2048", *args], tmp_path / "server.log"):
            pass
    assert message in (tmp_path / "server.log").read_text(), str(error.value)


def test_the_worker_waits_for_a_step_being_sent_before_it_syncs_or_stops():
    """With the launch thread (launch.py) a step may still be going out when vLLM asks the
    worker to synchronize or to shut down: it waits for the runner's launcher first."""
    from paged_prefix.vllm_plugin.worker import MLXWorker

    calls = []
    launcher = SimpleNamespace(synchronize=lambda: calls.append("synchronize"),
                               wait=lambda: calls.append("wait"))
    worker = object.__new__(MLXWorker)  # no device, no model: only the runner's launcher
    worker.runner = SimpleNamespace(launcher=launcher)
    worker.synchronize_device()
    worker.shutdown()
    assert calls == ["synchronize", "wait"] and worker.runner is None


ENGINE_CALLS = Path(__file__).with_name("engine_calls_driver.py")


@pytest.mark.parametrize("case", ["window", "sleep"])
def test_engine_calls_the_worker_cannot_honour_are_refused_naming_them(tmp_path, case):
    """Past vLLM's cap (VLLM_ALLOW_LONG_MAX_MODEL_LEN=1) `disable_sliding_window` would need
    full attention where the runner attends within the model's window: refused at startup.
    `llm.sleep(level=1)` (weights and KV cache offloaded) is refused after vLLM has paused the
    scheduler and cleared its caches, which asks the worker to reset an encoder cache it does
    not have (that raised, and left the engine paused for good); `wake_up()` resumes it, with
    the same greedy tokens."""
    import subprocess

    from bench.vllm_server import child_env

    folder = random_folders(tmp_path, ["mistral-test"])["mistral-test"]  # window 20
    proc = subprocess.run([sys.executable, str(ENGINE_CALLS), str(folder), case],
                          env=child_env(VLLM_ALLOW_LONG_MAX_MODEL_LEN="1"), capture_output=True,
                          text=True, timeout=600)
    if case == "window":
        assert proc.returncode != 0 and "started" not in proc.stderr
        assert "disable_sliding_window: the runner attends within" in proc.stderr, \
            proc.stderr[-3000:]
    else:
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "REFUSED sleep: level 1" in proc.stdout and "SAME" in proc.stdout, proc.stdout


def test_vllm_quantization_is_refused_naming_the_flag():
    """`--quantization` picks vLLM's torch kernels, which this worker never runs: refused when
    vLLM checks the model's config (before, vLLM failed importing one of them here, or would
    have served the dense weights); an MLX-quantized folder carries no vLLM method."""
    from vllm.config import ModelConfig

    with pytest.raises(ValueError, match="quantization: vLLM's 'fp8' quantization is not"):
        ModelConfig(model=str(smollm2()), quantization="fp8")
    assert ModelConfig(model=str(smollm2("q4"))).quantization is None
