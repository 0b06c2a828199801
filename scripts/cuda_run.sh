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
tests=(tests/test_cuda_variants.py tests/test_kernels.py tests/test_prefill_kernel.py tests/test_precision.py
       tests/test_random_layouts.py tests/test_variants.py tests/test_runner.py tests/test_dispatch.py
       tests/test_reference.py tests/test_kv_cache.py tests/test_linear.py tests/test_gpu_time.py)
# Quantized models in a process of their own: MLX 0.32.4's CUDA quantized matmul reads past the
# end of a small weight (docs/results.md), and where that faults every later test of the process
# fails.
python3 -m pytest -q -p no:cacheprovider -m "not emulated" -k "not quantized" "${tests[@]}" 2>&1 \
    | tee "$out/pytest.txt"
python3 -m pytest -q -p no:cacheprovider -m "not emulated" -k quantized "${tests[@]}" 2>&1 \
    | tee -a "$out/pytest.txt"
python3 -m bench.gpu_time 2>&1 | tee "$out/gpu_time.txt"
# The benchmarks (docs/results.md)
python3 -m bench.attention_sweep --out "$out/sweep.json" 2>&1 | tee "$out/sweep.txt"
python3 -m bench.chained_attention --out "$out/chained.json" 2>&1 | tee "$out/chained.txt"
python3 -m pytest -q -p no:cacheprovider bench/test_bench_prefill.py --benchmark-only \
    --benchmark-columns=min,median,mean,rounds --benchmark-sort=name \
    --benchmark-json="$out/prefill.json" 2>&1 | tee "$out/prefill.txt"
python3 -m bench.prefill_interleaved --out "$out/prefill_interleaved.json" 2>&1 \
    | tee "$out/prefill_interleaved.txt"
python3 -m bench.prefill_interleaved --shape gemma3-1b:4096 --shape gemma3-1b:16384 \
    --out "$out/prefill_interleaved_gemma3.json" 2>&1 | tee "$out/prefill_interleaved_gemma3.txt"
python3 -m bench.window_cost --out "$out/window_cost.json" 2>&1 | tee "$out/window_cost.txt"
# The probes behind the dispatch rules still in the tree (docs/results.md, "Probes").
python3 -m bench.probes.host_ops 2>&1 | tee "$out/host_ops.txt"
python3 -m bench.probes.sdpa_new_shapes --out "$out/new_shapes.json" 2>&1 | tee "$out/new_shapes.txt"
python3 -m bench.probes.pool_copies --out "$out/pool_copies.json" 2>&1 | tee "$out/pool_copies.txt"
python3 -m bench.probes.gather_canary 2>&1 | tee "$out/gather_canary.txt"
