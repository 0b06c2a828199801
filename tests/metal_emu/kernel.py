"""`metal_kernel`: a drop-in for `mx.fast.metal_kernel` that runs the kernel on the CPU.

Same arguments, same generated source, same launch semantics (grid in threads, threadgroups
clamped to the grid, outputs uninitialised unless `init_value`, inputs copied to row-contiguous
unless `ensure_row_contiguous=False`). Uninitialised outputs are filled with all bits set (NaN
for floats, -1 for integers) so that an element the kernel never writes shows.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from . import build, emulate, run
from .source import InputInfo, assemble

# numpy storage of each dtype's bits (16-bit floats travel as uint16: numpy has no bfloat16)
_STORAGE = {
    mx.float32: np.float32, mx.float16: np.uint16, mx.bfloat16: np.uint16, mx.bool_: np.bool_,
    mx.int8: np.int8, mx.int16: np.int16, mx.int32: np.int32, mx.int64: np.int64,
    mx.uint8: np.uint8, mx.uint16: np.uint16, mx.uint32: np.uint32, mx.uint64: np.uint64,
}


@dataclass
class EmulationOptions:
    """How launches run. Defaults from the environment: MSL_EMU_SEED, MSL_EMU_JITTER (0 = off),
    MSL_EMU_CONCURRENCY (threadgroups in flight), MSL_EMU_TIMEOUT (seconds per launch)."""

    seed: int = int(os.environ.get("MSL_EMU_SEED", "0"))
    jitter: int = int(os.environ.get("MSL_EMU_JITTER", "1"))
    concurrency: int = int(os.environ.get("MSL_EMU_CONCURRENCY", "2"))
    timeout: float = float(os.environ.get("MSL_EMU_TIMEOUT", "300"))


OPTIONS = EmulationOptions()
_launches = 0  # varies the seed from launch to launch


def _as_array(a) -> mx.array:
    return a if isinstance(a, mx.array) else mx.array(a)


def _to_numpy(a: mx.array, row_contiguous: bool) -> np.ndarray:
    """The array's bits as the kernel gets them. Row-contiguous data is copied to a 64-byte
    aligned buffer with exact bounds (`run.shared_array`), as Metal buffers are aligned: MLX's
    CPU allocations are only 8-byte aligned, where a kernel's 16-byte vector loads would fault.
    A strided view (row_contiguous False) stays a view of MLX's memory, with its strides."""
    bits = np.asarray(a.view(mx.uint16) if a.dtype in (mx.float16, mx.bfloat16) else a)
    if not row_contiguous and not bits.flags.c_contiguous:
        return bits
    out = run.shared_array(bits.shape, bits.dtype)  # exact bounds, as outputs get
    out[...] = bits
    return out


def _from_numpy(arr: np.ndarray, dtype: mx.Dtype, shape) -> mx.array:
    out = mx.array(arr)
    if dtype in (mx.float16, mx.bfloat16):
        out = out.view(dtype)
    return out.reshape(shape)


def _output(shape, dtype: mx.Dtype, init_value) -> np.ndarray:
    out = run.shared_array(tuple(shape), _STORAGE[dtype])
    if init_value is None:
        out.view(np.uint8)[...] = 0xFF
    else:
        out[...] = _to_numpy(mx.full(tuple(shape), init_value, dtype=dtype), True)
    return out


class EmulatedKernel:
    def __init__(self, name, input_names, output_names, source, header, ensure_row_contiguous,
                 atomic_outputs):
        self.name, self.input_names, self.output_names = name, list(input_names), list(output_names)
        self.source, self.header = source, header
        self.ensure_row_contiguous, self.atomic_outputs = ensure_row_contiguous, atomic_outputs
        # input name -> [(start, stop)] byte ranges no launch may read (whole memory pages of
        # the input's buffer); set by a test, not by MLX's API
        self.unreadable: dict[str, list[tuple[int, int]]] = {}

    def assemble(self, inputs, output_dtypes, template):
        """MLX's source for these inputs (arrays or scalars), output dtypes and template."""
        infos = [InputInfo(a.dtype, a.ndim, a.size) for a in map(_as_array, inputs)]
        return assemble(self.name, self.input_names, self.output_names, self.source, self.header,
                        self.atomic_outputs, infos, list(output_dtypes), list(template or []))

    def translation_unit(self, inputs, output_dtypes, template) -> str:
        """The C++ a launch with these arguments compiles (compile checks build it alone)."""
        return emulate.translation_unit(self.assemble(inputs, output_dtypes, template))

    def __call__(self, *, inputs, output_shapes, output_dtypes, grid, threadgroup, template=None,
                 init_value=None, verbose=False, stream=None):
        global _launches
        for what, got in (("inputs", inputs), ("output_shapes", output_shapes),
                          ("output_dtypes", output_dtypes)):
            want = self.input_names if what == "inputs" else self.output_names
            if len(got) != len(want):
                raise ValueError(f"[metal_kernel] Expected `{what}` to have size {len(want)} "
                                 f"but got size {len(got)}.")
        arrays = [_as_array(a) for a in inputs]
        assembled = self.assemble(arrays, output_dtypes, template)
        if verbose:
            print(f"Generated source code for `{self.name}`:\n```\n{assembled.source}\n```")
        library = build.build(emulate.translation_unit(assembled))
        data = {n: _to_numpy(a, self.ensure_row_contiguous) for n, a in zip(self.input_names, arrays)}
        outputs = {n: _output(s, d, init_value)
                   for n, s, d in zip(self.output_names, output_shapes, output_dtypes)}
        buffers = [_buffer(p.name, data, outputs) for p in assembled.params if not p.attribute]
        unreadable = [run.page_span(data[n], start, stop)
                      for n, spans in self.unreadable.items() for start, stop in spans]
        _launches += 1
        run.launch(library, buffers, tuple(grid), tuple(threadgroup),
                   seed=OPTIONS.seed * 1_000_003 + _launches, concurrency=OPTIONS.concurrency,
                   jitter=OPTIONS.jitter, timeout=OPTIONS.timeout, unreadable=unreadable)
        return [_from_numpy(outputs[n], d, s)
                for n, d, s in zip(self.output_names, output_dtypes, output_shapes)]


def _buffer(name: str, inputs: dict, outputs: dict) -> np.ndarray:
    """The buffer behind kernel parameter `name`: an input, an output, or an input's
    `_shape` (int32), `_strides` (int64, in elements) or `_ndim` (int32)."""
    if name in inputs:
        return inputs[name]
    if name in outputs:
        return outputs[name]
    base, info = name.rsplit("_", 1)
    x = inputs[base]
    return {"shape": lambda: np.array(x.shape, np.int32),
            "strides": lambda: np.array(x.strides, np.int64) // x.itemsize,
            "ndim": lambda: np.array(x.ndim, np.int32)}[info]()


def metal_kernel(name, input_names, output_names, source, header="", ensure_row_contiguous=True,
                 atomic_outputs=False, compile_options=None):
    """`mx.fast.metal_kernel`, emulated on the CPU (see the package README)."""
    if not output_names:
        raise ValueError("[metal_kernel] Must specify at least one output.")
    math_mode = (compile_options or {}).get("math_mode", "safe")
    if math_mode != "safe":
        raise NotImplementedError(f"math_mode {math_mode!r}: the emulation runs safe math only")
    return EmulatedKernel(name, input_names, output_names, source, header, ensure_row_contiguous,
                          atomic_outputs)
