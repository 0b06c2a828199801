"""The dispatcher: one decision per call, a reason for it, and no silent fallback."""

import logging

import mlx.core as mx
import numpy as np
import pytest

import reference
from paged_prefix.dispatch import ENV_VAR, Dispatcher
from tests.conftest import HAS_CUDA, HAS_METAL, random_cache, random_layout


def call(dispatcher):
    rng = np.random.default_rng(0)
    meta, _ = random_layout(rng, [5, 1], [13, 30], 16)
    k, v = random_cache(rng, meta.num_blocks, 16, 2, 64, mx.float16)
    q = mx.array(rng.standard_normal((6, 8, 64), dtype=np.float32)).astype(mx.float16)
    return dispatcher(q, k, v, meta, 0.125), reference.paged_attention(q, k, v, meta, 0.125)


def test_forced_reference_runs_and_is_counted():
    d = Dispatcher("reference")
    out, ref = call(d)
    assert d.last.path == "reference" and d.counts == {"reference": 1}
    np.testing.assert_array_equal(np.array(out), np.array(ref))


@pytest.mark.skipif(HAS_CUDA or HAS_METAL, reason="a GPU backend is present")
def test_auto_on_cpu_takes_reference_and_says_why(caplog):
    d = Dispatcher("auto")
    with caplog.at_level(logging.INFO, logger="paged_prefix.dispatch"):
        call(d)
        call(d)
    assert d.last.path == "reference"
    assert "no GPU kernel backend" in d.last.reason
    logged = [r for r in caplog.records if "paged attention: reference" in r.getMessage()]
    assert len(logged) == 1  # once per distinct case, not per call


@pytest.mark.parametrize("path", ["cuda", "metal"])
def test_forcing_a_missing_backend_raises(path):
    if (path == "cuda" and HAS_CUDA) or (path == "metal" and HAS_METAL):
        pytest.skip(f"{path} is present here")
    with pytest.raises(ValueError, match=ENV_VAR):
        call(Dispatcher(path))


def test_env_var_override_and_bad_value(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "reference")
    assert Dispatcher().path == "reference"
    monkeypatch.setenv(ENV_VAR, "flash")
    with pytest.raises(ValueError, match=ENV_VAR):
        Dispatcher()
