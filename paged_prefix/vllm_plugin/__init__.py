"""vLLM platform plugin: `vllm serve MODEL_DIR` runs paged_prefix's runner on MLX.

vLLM calls `register()` (entry point group `vllm.platform_plugins`, name `paged_prefix`)
in each of its processes when it first resolves its platform. Returning the platform's
class path activates it; an activated out-of-tree platform wins over vLLM's built-in
CPU detection. Nothing is imported here beyond the standard library: this runs in every
vLLM process, including ones that will never load a model.

PAGED_PREFIX_PLUGIN (read here only):
  unset  on, except on macOS when vllm-metal is installed (its plugin is the default
         there; two active platform plugins make vLLM refuse to start)
  0      off: vLLM picks its platform as if this package were not installed
  1      on, even beside vllm-metal (then select one with VLLM_PLUGINS=paged_prefix)
Under vllm-metal's own platform, this worker can still be chosen with
`--worker-cls paged_prefix.vllm_plugin.worker.MLXWorker`.

VLLM_TARGET_DEVICE=cpu makes vLLM choose its CPU platform before asking any plugin,
so this plugin cannot take effect while it is set.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys

ENV_VAR = "PAGED_PREFIX_PLUGIN"
PLATFORM = "paged_prefix.vllm_plugin.platform.MLXPlatform"

logger = logging.getLogger(__name__)


def register() -> str | None:
    setting = os.environ.get(ENV_VAR, "").strip()
    if setting not in ("", "0", "1"):
        raise ValueError(f"{ENV_VAR}: expected unset, 0 or 1, got {setting!r}")
    if setting == "0":
        return None
    if importlib.util.find_spec("mlx") is None:
        logger.warning("paged_prefix plugin: MLX is not installed; not activating")
        return None
    if setting == "" and sys.platform == "darwin" and importlib.util.find_spec("vllm_metal"):
        logger.info("paged_prefix plugin: vllm-metal is installed, leaving the platform to it "
                    "(%s=1 activates this one; --worker-cls uses its worker under vllm-metal)",
                    ENV_VAR)
        return None
    return PLATFORM


def mirror_vllm_logging() -> None:
    """Send the project's log records (the worker's budget, the dispatcher's chosen
    attention path and its reason) through vLLM's handlers, at vLLM's level. Records still
    propagate: whoever listens at the root (pytest, an embedding application) hears them."""
    vllm_logger, ours = logging.getLogger("vllm"), logging.getLogger("paged_prefix")
    if ours.handlers or not vllm_logger.handlers:
        return
    ours.setLevel(vllm_logger.level)
    for handler in vllm_logger.handlers:
        ours.addHandler(handler)
