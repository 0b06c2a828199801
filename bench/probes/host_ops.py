"""Host time per MLX op on a GPU: what a short prefill's step pays for each op it builds.

    python -m bench.probes.host_ops

Each line times a chain of 200 dependent tiny ops (the device work is negligible): `build` is
the time to construct one op's lazy graph node in Python, `eval` the time MLX then spends per op
to schedule and encode it. With many ops per step and little device work per op, a step takes
about the sum of these.
"""

from __future__ import annotations

import statistics
import time

import mlx.core as mx

CHAIN = 200


def measure(name: str, op, x0: mx.array) -> None:
    build, evaluate = [], []
    for _ in range(7):
        t0 = time.perf_counter()
        x = x0
        for _ in range(CHAIN):
            x = op(x)
        t1 = time.perf_counter()
        mx.eval(x)
        t2 = time.perf_counter()
        build.append((t1 - t0) / CHAIN * 1e6)
        evaluate.append((t2 - t1) / CHAIN * 1e6)
    print(f"{name:<30} build {statistics.median(build):6.2f} us/op   "
          f"eval {statistics.median(evaluate):6.2f} us/op", flush=True)


def main() -> None:
    a = mx.ones((16, 16))
    w = mx.ones((64, 64), dtype=mx.bfloat16)
    xb = mx.ones((64, 64), dtype=mx.bfloat16)
    buf = mx.zeros((64, 16))
    q = mx.ones((1, 4, 16, 64), dtype=mx.bfloat16)
    rows = mx.ones((16, 4, 1, 64), dtype=mx.bfloat16)
    positions = mx.arange(16)
    flat = mx.ones((256,))
    mx.eval(a, w, xb, buf, q, rows, positions, flat)

    def slice_update(x):
        x[0:16] = a
        return x
    measure("transpose (a view)", lambda x: x.T, a)
    measure("reshape (a view)", lambda x: x.reshape(16, 16), a)
    measure("add a scalar", lambda x: x + 1, a)
    measure("slice update", slice_update, buf)
    measure("matmul 64x64 bf16", lambda x: x @ w, xb)
    measure("sdpa, 16 x 16 causal", lambda x: mx.fast.scaled_dot_product_attention(
        x, q, q, scale=0.1, mask="causal"), q)
    measure("rope, per-row offsets", lambda x: mx.fast.rope(
        x, 64, traditional=False, base=10000.0, scale=1.0, offset=positions), rows)
    measure("rms_norm", lambda x: mx.fast.rms_norm(x, None, 1e-5), a)
    if mx.cuda.is_available():
        source = "  int i = threadIdx.x; if (i < 256) out[i] = inp[i];"
        launch = dict(grid=(256, 1, 1), threadgroup=(256, 1, 1), output_shapes=[(256,)],
                      output_dtypes=[mx.float32])
        small = mx.fast.cuda_kernel(name="copy_small", input_names=["inp"],
                                    output_names=["out"], source=source)
        large = mx.fast.cuda_kernel(name="copy_large", input_names=["inp"],
                                    output_names=["out"], source=source,
                                    header="// " + "x" * 14000 + "\n")
        measure("custom kernel", lambda x: small(inputs=[x], **launch)[0], flat)
        measure("custom kernel, 5 template args", lambda x: small(
            inputs=[x], template=[("T", mx.float32), ("A", 1), ("B", 2), ("C", 3), ("E", 4)],
            **launch)[0], flat)
        measure("custom kernel, 14 KB source", lambda x: large(inputs=[x], **launch)[0], flat)
    waits = []
    for _ in range(50):
        t0 = time.perf_counter()
        mx.synchronize()
        waits.append((time.perf_counter() - t0) * 1e6)
    print(f"mx.synchronize() on an idle device: {statistics.median(waits):.1f} us")


if __name__ == "__main__":
    main()
