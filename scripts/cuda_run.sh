#!/usr/bin/env bash
# The CUDA tests and benchmarks in one go, on a Linux machine with an NVIDIA GPU and MLX's
# CUDA backend (`pip install mlx-cuda-13==0.32.4 mlx-lm==0.32.2 -e '.[test]'`, or `nox -s cuda`).
# Logs and JSON land in the folder given (default results/cuda).
set -uo pipefail
out=${1:-results/cuda}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PAGED_PREFIX_STRICT_KERNELS=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$out/gpu.txt"
python3 -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device(), mx.cuda.is_available())" \
    | tee -a "$out/gpu.txt"
tests=(tests/test_kernels.py tests/test_prefill_kernel.py tests/test_runner.py tests/test_dispatch.py
       tests/test_reference.py tests/test_kv_cache.py tests/test_linear.py tests/test_gpu_time.py)
# Quantized models in a process of their own: MLX 0.32.4's CUDA quantized matmul reads past the
# end of a small weight (docs/gpu.md), and where that faults every later test of the process fails.
python3 -m pytest -q -p no:cacheprovider -m "not emulated" -k "not quantized" "${tests[@]}" 2>&1 \
    | tee "$out/pytest.txt"
python3 -m pytest -q -p no:cacheprovider -m "not emulated" -k quantized "${tests[@]}" 2>&1 \
    | tee -a "$out/pytest.txt"
python3 bench/host_ops.py 2>&1 | tee "$out/host_ops.txt"
python3 bench/canary_cost.py --out "$out/canary.json" 2>&1 | tee -a "$out/gpu.txt"
python3 bench/sdpa_new_shapes.py --out "$out/new_shapes.json" 2>&1 | tee "$out/new_shapes.txt"
python3 bench/attention_sweep.py --out "$out/sweep.json" 2>&1 | tee "$out/sweep.txt"
python3 bench/chained_attention.py --out "$out/chained.json" 2>&1 | tee "$out/chained.txt"
python3 bench/crossover.py --out "$out/crossover.json" 2>&1 | tee "$out/crossover.txt"
python3 bench/wgmma_vs_mma.py --out "$out/wgmma_vs_mma.json" 2>&1 | tee "$out/wgmma_vs_mma.txt"
# Hopper only (they say so and stop elsewhere): TMA page loads, the wgmma kernel's split-KV
# chunking, and the prefill kernel's grid
python3 bench/tma_probe.py --out "$out/tma_probe.json" 2>&1 | tee "$out/tma_probe.txt"
python3 bench/split_chunk.py --out "$out/split_chunk.json" 2>&1 | tee "$out/split_chunk.txt"
python3 bench/prefill_kernel.py --chained --out "$out/prefill_kernel.json" 2>&1 \
    | tee "$out/prefill_kernel.txt"
python3 -m pytest -q -p no:cacheprovider bench/test_bench_prefill.py --benchmark-only \
    --benchmark-columns=min,median,mean,rounds --benchmark-sort=name \
    --benchmark-json="$out/prefill.json" 2>&1 | tee "$out/prefill.txt"
python3 bench/prefill_interleaved.py --out "$out/prefill_interleaved.json" 2>&1 \
    | tee "$out/prefill_interleaved.txt"
python3 bench/pool_copies.py --out "$out/pool_copies.json" 2>&1 | tee "$out/pool_copies.txt"
