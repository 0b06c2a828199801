#!/usr/bin/env bash
# One device call on the lent H200: GPU tests (kernels + runner equivalence on the CUDA
# path) and the attention sweep; logs and JSON land in $OUT. See docs/gpu.md.
set -uo pipefail
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device(), mx.cuda.is_available())" | tee -a "$OUT/gpu.txt"
python3 -m pytest -q -p no:cacheprovider -m gpu -k "not metal" \
    tests/test_kernels.py tests/test_runner.py 2>&1 | tee "$OUT/pytest_gpu.txt"
python3 -m pytest -q -p no:cacheprovider tests/test_dispatch.py 2>&1 | tail -2 | tee -a "$OUT/pytest_gpu.txt"
python3 bench/attention_sweep.py --out "$OUT/sweep.json" 2>&1 | tee "$OUT/sweep.txt"
python3 -m pytest -q -p no:cacheprovider bench/test_bench_prefill.py --benchmark-only \
    --benchmark-columns=min,median,mean,rounds --benchmark-json="$OUT/prefill.json" 2>&1 \
    | tee "$OUT/prefill.txt"
