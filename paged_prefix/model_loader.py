"""Load a local mlx-lm model folder for the paged runner.

A folder holds config.json, *.safetensors and the tokenizer files (what mlx-lm's
`convert` writes, and what `python -m paged_prefix.convert_smollm2` builds). Quantized
folders (a `quantization` entry in config.json) load as mlx-lm quantizes them and keep
their weights; dense ones are cast to the requested dtype. Models are mlx-lm's own classes,
built with the args that keep what their attention depends on (`architectures`). Only
architectures whose attention the runner reproduces load; the others fail before any weight is
read, naming the model type or the config field. No hub download: the folder must exist.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import SwitchLinear
from mlx_lm.utils import load_model as mlx_lm_load_model

from . import architectures

logger = logging.getLogger(__name__)


def read_config(folder: str | Path) -> dict:
    path = Path(folder)
    if not (path / "config.json").is_file():
        raise ValueError(f"model: {str(folder)!r} is not a local model folder with a config.json "
                         "(hub downloads are not supported; convert or download it first)")
    config = json.loads((path / "config.json").read_text())
    try:
        architectures.check_config(config)
    except ValueError as e:
        raise ValueError(f"{e} (in {path / 'config.json'})") from None
    return config


def is_quantized(config: dict) -> bool:
    return "quantization" in config or "quantization_config" in config


def check_experts_dtype(model: nn.Module) -> None:
    """MLX's CPU backend multiplies dense experts (`gather_mm`) in float32 only: a model with
    others would fail at its first forward (mlx-lm's too); quantized experts run in any."""
    if mx.default_device() != mx.cpu:
        return
    for name, module in model.named_modules():
        if isinstance(module, SwitchLinear) and module.weight.dtype != mx.float32:
            raise ValueError(f"dtype: {module.weight.dtype} experts ({name}) on MLX's CPU "
                             "backend, whose gather_mm runs float32 only; serve this model in "
                             "float32 (--dtype float32) or quantized")


def load_model(folder: str | Path, dtype: mx.Dtype | None = None) -> nn.Module:
    """The mlx-lm model in `folder`, evaluated; dense weights cast to `dtype` when given."""
    config = read_config(folder)
    start = time.perf_counter()
    # lazy: the model's attention is checked before any weight is read
    model, _ = mlx_lm_load_model(Path(folder), lazy=True,
                                 get_model_classes=architectures.model_classes)
    architectures.check_built(config, model)
    if dtype is not None and not is_quantized(config):
        model.set_dtype(dtype)
    check_experts_dtype(model)
    mx.eval(model.parameters())
    logger.info("loaded %s (%s, %d layers, %s) in %.1f s", folder, config["model_type"],
                len(model.layers), "quantized" if is_quantized(config) else dtype or "as stored",
                time.perf_counter() - start)
    return model
