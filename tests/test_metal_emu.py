"""The Metal emulation itself (tests/metal_emu): source assembly against MLX's own, MSL
semantics (conversions, fragment layout, SIMD collectives, atomics), real concurrency (a
missing barrier is a race that shows), and failures reported as errors, not hangs or crashes.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from tests.metal_emu import OPTIONS, KernelError, metal_kernel
from tests.metal_emu.emulate import rewrite_threadgroup_variables
from tests.metal_emu.source import mlx_printed_source

pytestmark = pytest.mark.emulated


def run(source, inputs, output_shapes, output_dtypes, grid, threadgroup, template=None, **kw):
    names = [f"in{i}" for i in range(len(inputs))]
    factory_kw = {k: kw.pop(k) for k in ("header", "ensure_row_contiguous", "atomic_outputs")
                  if k in kw}
    kernel = metal_kernel(name="t", input_names=names,
                          output_names=[f"out{i}" for i in range(len(output_shapes))],
                          source=source, **factory_kw)
    return kernel(inputs=inputs, output_shapes=output_shapes, output_dtypes=output_dtypes,
                  grid=grid, threadgroup=threadgroup, template=template, **kw)


# --- source assembly -----------------------------------------------------------------------

SIGNATURE_CASES = {
    # shape/strides/ndim buffers, a 0-d input (constant &), a small (constant) array, attributes
    "buffers": dict(
        source="uint i = thread_position_in_grid.x; out0[i] = in0[i] * in0_shape[0] + in2 "
               "+ in1[0] + in0_strides[0] + in0_ndim; uint s = simdgroup_index_in_threadgroup;",
        inputs=[mx.zeros((16, 3)), mx.ones((4,), mx.int32), mx.array(2.0)],
        output_dtypes=[mx.float32], template=[("T", mx.bfloat16), ("N", 3), ("B", True)]),
    # no template, no attribute, two outputs, one input with a shape buffer: MLX's separator
    # rule closes the parameter list after the first output (its source does not compile)
    "separator_quirk": dict(
        source="out0[0] = in0_shape[0]; out1[0] = 1;", inputs=[mx.zeros((9,), mx.float16)],
        output_dtypes=[mx.float16, mx.int32], template=None),
    "atomic": dict(
        source="atomic_fetch_add_explicit(&out0[0], 1, memory_order_relaxed);"
               " uint t = thread_index_in_threadgroup;",
        inputs=[mx.zeros((8,))], output_dtypes=[mx.int32], template=[("T", mx.float16)],
        atomic_outputs=True),
}


@pytest.mark.parametrize("case", SIGNATURE_CASES)
def test_source_is_mlx_source(case):
    c = dict(SIGNATURE_CASES[case])
    factory_kw = dict(name="k", input_names=[f"in{i}" for i in range(len(c["inputs"]))],
                      output_names=[f"out{i}" for i in range(len(c["output_dtypes"]))],
                      source=c["source"], header="// header\n",
                      atomic_outputs=c.get("atomic_outputs", False))
    call_kw = dict(inputs=c["inputs"], output_shapes=[(4,)] * len(c["output_dtypes"]),
                   output_dtypes=c["output_dtypes"], grid=(4, 1, 1), threadgroup=(4, 1, 1),
                   template=c["template"])
    ours = metal_kernel(**factory_kw).assemble(c["inputs"], c["output_dtypes"], c["template"])
    assert ours.source == mlx_printed_source(factory_kw, call_kw)


def test_threadgroup_rewrite():
    src = ("  threadgroup T k_s[BN * LD];\n"
           "  threadgroup long row_off[2][BN]; threadgroup atomic_int n;\n"
           "  const threadgroup T* p = k_s;  // threadgroup pointers stay\n")
    out = rewrite_threadgroup_variables(src)
    assert ("using msl_tg_k_s_t = T[BN * LD]; "
            "msl_tg_k_s_t& k_s = ::msl::threadgroup_var<msl_tg_k_s_t>(0);") in out
    assert "using msl_tg_row_off_t = long[2][BN];" in out and "threadgroup_var<msl_tg_n_t>(2)" in out
    assert out.count("\n") == src.count("\n") and "const threadgroup T* p = k_s;" in out
    with pytest.raises(NotImplementedError, match="one declarator"):
        rewrite_threadgroup_variables("threadgroup float a[4], b[4];")


# --- MSL semantics -------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16], ids=["fp16", "bf16"])
def test_conversions_round_to_nearest_even(dtype):
    rng = np.random.default_rng(0)
    special = [0.0, -0.0, np.inf, -np.inf, 65504.0, 65519.0, 65520.0, 1e6, 2.0**-24, 2.0**-25,
               3 * 2.0**-25, 2.0**-14 - 2.0**-25, 1 + 2.0**-11, 1 + 3 * 2.0**-11, 1 + 2.0**-8,
               1 + 3 * 2.0**-8, 3.4e38, 1e-40, -1.5, np.nan]
    x = np.concatenate([special, rng.standard_normal(4000) * 10.0 ** rng.integers(-9, 6, 4000)])
    x = mx.array(x.astype(np.float32))
    n = x.size
    narrow, wide = run("uint i = thread_position_in_grid.x; out0[i] = T(in0[i]);"
                       " out1[i] = float(T(in0[i]) * T(2.0f));",
                       [x], [(n,), (n,)], [dtype, mx.float32], (n, 1, 1), (256, 1, 1),
                       template=[("T", dtype)])
    want = x.astype(dtype)
    bits, want_bits = np.array(narrow.view(mx.uint16)), np.array(want.view(mx.uint16))
    nan = np.isnan(np.array(want.astype(mx.float32)))
    np.testing.assert_array_equal(bits[~nan], want_bits[~nan])
    assert np.isnan(np.array(narrow.astype(mx.float32))[nan]).all()
    np.testing.assert_array_equal(np.array(wide), np.array((want * 2).astype(mx.float32)))


def steel_coord(lane):
    """MLX steel's fragment layout (mma.h, BaseMMAFrag::get_coord): (row, first column)."""
    qid = lane // 4
    return (qid & 4) + (lane // 2) % 4, (qid & 2) * 2 + (lane % 2) * 2


def test_simdgroup_matrix_layout_and_mma():
    rng = np.random.default_rng(1)
    a, b, c = (rng.standard_normal((8, 8)).astype(np.float32) for _ in range(3))
    src = """
      const uint lane = thread_index_in_simdgroup;
      simdgroup_float8x8 A, B, C, D;
      simdgroup_load(A, in0); simdgroup_load(B, in1); simdgroup_load(C, in2);
      simdgroup_multiply_accumulate(D, A, B, C);
      simdgroup_store(D, out0);
      out1[2 * lane] = A.thread_elements()[0];
      out1[2 * lane + 1] = A.thread_elements()[1];
    """
    d, held = run(src, [mx.array(a), mx.array(b), mx.array(c)], [(8, 8), (64,)],
                  [mx.float32, mx.float32], (32, 1, 1), (32, 1, 1))
    np.testing.assert_allclose(np.array(d), a @ b + c, rtol=1e-5, atol=1e-5)
    held = np.array(held)
    for lane in range(32):
        row, col = steel_coord(lane)
        assert held[2 * lane] == a[row, col] and held[2 * lane + 1] == a[row, col + 1]


def test_simd_collectives():
    n = 80  # a partial third simdgroup of 16 lanes
    x = mx.array(np.random.default_rng(2).permutation(n).astype(np.float32))
    src = """
      const uint i = thread_position_in_grid.x;
      const float v = in0[i];
      out0[i * 7 + 0] = simd_shuffle_xor(v, ushort(5));
      out0[i * 7 + 1] = simd_shuffle_down(v, ushort(3));
      out0[i * 7 + 2] = simd_shuffle_up(v, ushort(3));
      out0[i * 7 + 3] = simd_sum(v);
      out0[i * 7 + 4] = simd_max(v);
      out0[i * 7 + 5] = simd_prefix_exclusive_sum(v);
      out0[i * 7 + 6] = simd_broadcast(v, ushort(7));
    """
    got = np.array(run(src, [x], [(n, 7)], [mx.float32], (n, 1, 1), (n, 1, 1))[0])
    v = np.array(x)
    for i in range(n):
        base, lanes = i - i % 32, min(32, n - (i - i % 32))
        lane, group = i % 32, v[i - i % 32: i - i % 32 + lanes]
        want = [group[lane ^ 5] if lane ^ 5 < lanes else v[i],
                group[lane + 3] if lane + 3 < lanes else v[i],
                group[lane - 3] if lane >= 3 else v[i],
                group.sum(), group.max(), group[:lane].sum(), group[7] if lanes > 7 else v[i]]
        np.testing.assert_allclose(got[i], want, err_msg=f"thread {i} (simdgroup at {base})")


def test_attributes_of_partial_threadgroups():
    """dispatchThreads: a grid of 100 in threadgroups of 64 leaves a last threadgroup of 36."""
    src = """
      const uint i = thread_position_in_grid.x;
      ((device uint4*)out0)[i] = uint4(threads_per_threadgroup.x, threadgroup_position_in_grid.x,
                                       thread_index_in_threadgroup, simdgroup_index_in_threadgroup);
    """
    got = np.array(run(src, [mx.zeros((1,))], [(100, 4)], [mx.uint32], (100, 1, 1), (64, 1, 1))[0])
    i = np.arange(100)
    np.testing.assert_array_equal(got, np.stack([np.where(i < 64, 64, 36), i // 64, i % 64,
                                                 i % 64 // 32], axis=1))


def test_atomics_across_threadgroups():
    """Device atomics from 8 concurrent threadgroups; the last one to finish sees every count."""
    src = """
      atomic_fetch_add_explicit(&out0[thread_index_in_threadgroup % 4], 1, memory_order_relaxed);
      threadgroup_barrier(mem_flags::mem_device);
      if (thread_index_in_threadgroup == 0) {
        const int done = atomic_fetch_add_explicit(&out0[4], 1, memory_order_relaxed);
        if (done == int(threadgroups_per_grid.x) - 1)
          atomic_store_explicit(&out0[5], atomic_load_explicit(&out0[0], memory_order_relaxed),
                                memory_order_relaxed);
      }
    """
    got = np.array(run(src, [mx.zeros((1,))], [(6,)], [mx.int32], (8 * 64, 1, 1), (64, 1, 1),
                       atomic_outputs=True, init_value=0)[0])
    np.testing.assert_array_equal(got, [128, 128, 128, 128, 8, 128])


def test_strides_and_uninitialised_outputs():
    x = mx.arange(12, dtype=mx.float32).reshape(3, 4).T  # a transposed view: strides (1, 4)
    src = """
      const uint i = thread_position_in_grid.x;
      const int64_t at = (i / in0_shape[1]) * in0_strides[0] + (i % in0_shape[1]) * in0_strides[1];
      if (i % 2 == 0) out0[i] = in0[at];
    """
    for contiguous in (True, False):
        got = np.array(run(src, [x], [(12,)], [mx.float32], (12, 1, 1), (12, 1, 1),
                           ensure_row_contiguous=contiguous)[0])
        np.testing.assert_array_equal(got[::2], np.array(x).ravel()[::2])
        assert np.isnan(got[1::2]).all()  # never written: MLX leaves it uninitialised
    got = run(src, [x], [(12,)], [mx.float32], (12, 1, 1), (12, 1, 1), init_value=0.0)[0]
    assert (np.array(got)[1::2] == 0).all()


# --- concurrency and failures --------------------------------------------------------------

RACE = """
  threadgroup float buf[256];
  const uint t = thread_index_in_threadgroup;
  buf[t] = in0[thread_position_in_grid.x];
  %s
  out0[thread_position_in_grid.x] = buf[(t + 97) %% 256];  // another simdgroup's element
"""


def test_a_missing_barrier_is_a_race():
    x = mx.arange(4 * 256, dtype=mx.float32)
    want = np.array(x).reshape(4, 256)[:, (np.arange(256) + 97) % 256].ravel()
    for barrier, should_match in (("threadgroup_barrier(mem_flags::mem_threadgroup);", True),
                                  ("", False)):
        got = np.array(run(RACE % barrier, [x], [(1024,)], [mx.float32], (1024, 1, 1),
                           (256, 1, 1))[0])
        assert np.array_equal(got, want) == should_match, barrier or "no barrier"


@pytest.mark.parametrize("source, match", [
    ("if (thread_index_in_threadgroup == 0) return; threadgroup_barrier(mem_flags::mem_none);",
     "threadgroup_barrier ran after threads"),
    ("if (thread_index_in_simdgroup == 3) return; out0[0] = simd_sum(1.0f);",
     "SIMD collective ran after lanes"),
    ("threadgroup float big[9000]; big[0] = 1; out0[0] = big[0];", "threadgroup memory"),
    ("out0[0] = in0[1L << 40];", "crashed"),
    # writes just past either end, inside the buffer's own memory page: exact bounds
    ("if (thread_position_in_grid.x == 0) out0[4] = 1;", "out of bounds of buffer 1, at byte "
                                                        "offset 16 \\(its size is 16 bytes\\)"),
    ("if (thread_position_in_grid.x == 0) out0[-1] = 1;", "out of bounds of buffer 1, at byte "
                                                         "offset -4 \\(before its start\\)"),
    ("device atomic_int* flag = (device atomic_int*)out0;"
     " while (atomic_load_explicit(flag, memory_order_relaxed) == 0) {}", "timed out"),
])
def test_failures_are_errors(source, match, monkeypatch):
    monkeypatch.setattr(OPTIONS, "timeout", 3.0)
    with pytest.raises(KernelError, match=match):
        run(source, [mx.zeros((4,))], [(4,)], [mx.float32], (64, 1, 1), (64, 1, 1),
            init_value=0.0)


def test_unreadable_pages_fault_only_when_read():
    """Pages an input marks unreadable crash the launch that reads them and no other; the
    caller's copy stays readable."""
    page = 4096 // 4  # floats per memory page
    x = mx.arange(3 * page, dtype=mx.float32)
    src = "out0[thread_position_in_grid.x] = in0[in1[0] + thread_position_in_grid.x];"
    kernel = metal_kernel(name="t", input_names=["in0", "in1"], output_names=["out0"], source=src)
    kernel.unreadable = {"in0": [(4 * page, 8 * page)]}  # the middle page

    def read(first):
        return kernel(inputs=[x, mx.array([first], dtype=mx.int32)], output_shapes=[(64,)],
                      output_dtypes=[mx.float32], grid=(64, 1, 1), threadgroup=(64, 1, 1))[0]

    for first in (page - 64, 2 * page):  # the pages either side
        np.testing.assert_array_equal(np.array(read(first)), np.arange(first, first + 64))
    with pytest.raises(KernelError, match="a page it must not read"):
        read(page - 32)  # straddles into the middle page
    kernel.unreadable = {"in0": [(4 * page, 4 * page + 64)]}
    with pytest.raises(ValueError, match="not whole pages"):
        read(0)
