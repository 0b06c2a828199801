"""The kernel source exactly as `mx.fast.metal_kernel` assembles it (MLX 0.32.4).

A port of `write_signature`, `write_template`, `make_template_hash` and the kernel naming in
mlx/backend/common/metal_kernel.cpp; MLX compiles `metal::utils() + source` (its preamble,
emulated by include/msl_preamble.h). `test_metal_emulated.py` checks the port against the
source MLX itself prints (`verbose=True` while exporting a function, which works without Metal).
"""

from __future__ import annotations

import os
import sys
import tempfile
from dataclasses import dataclass

import mlx.core as mx

# Inputs with fewer elements are passed in the constant address space.
MAX_CONSTANT_ARRAY_SIZE = 8

# MLX's list, in its order: an attribute is a kernel parameter when the source names it.
METAL_ATTRIBUTES = (
    ("dispatch_quadgroups_per_threadgroup", "uint"),
    ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"),
    ("grid_origin", "uint3"),
    ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"),
    ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"),
    ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"),
    ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"),
    ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"),
    ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"),
    ("threads_per_simdgroup", "uint"),
    ("threads_per_threadgroup", "uint3"),
)

TYPE_STRINGS = {
    mx.float32: "float", mx.float16: "float16_t", mx.bfloat16: "bfloat16_t",
    mx.float64: "double", mx.complex64: "complex64_t", mx.bool_: "bool",
    mx.int8: "int8_t", mx.int16: "int16_t", mx.int32: "int32_t", mx.int64: "int64_t",
    mx.uint8: "uint8_t", mx.uint16: "uint16_t", mx.uint32: "uint32_t", mx.uint64: "uint64_t",
}


@dataclass(frozen=True)
class InputInfo:
    """What of an input array the generated source depends on."""

    dtype: mx.Dtype
    ndim: int
    size: int

    @property
    def location(self) -> str:
        return "constant" if self.size < MAX_CONSTANT_ARRAY_SIZE else "device"


@dataclass(frozen=True)
class Param:
    """One kernel parameter: a buffer (input, its shape/strides/ndim, output) or an attribute."""

    name: str
    c_type: str  # the C++ type the launch stub casts its buffer pointer to
    by_ref: bool = False  # `T&` parameters (0-d inputs, ndim): the stub dereferences
    attribute: bool = False


@dataclass(frozen=True)
class Assembled:
    kernel_name: str
    source: str
    template_def: str  # "<float16_t, 64, ...>", empty without template arguments
    params: tuple[Param, ...]


def shape_infos(source: str, input_names) -> list[tuple[bool, bool, bool]]:
    return [(f"{n}_shape" in source, f"{n}_strides" in source, f"{n}_ndim" in source)
            for n in input_names]


def attributes(source: str) -> list[tuple[str, str]]:
    return [(name, dtype) for name, dtype in METAL_ATTRIBUTES if name in source]


def _template_value(arg) -> str:
    if isinstance(arg, bool):  # before int: bool is an int in Python; C++ streams it as 1 / 0
        return str(int(arg))
    if isinstance(arg, int):
        return str(arg)
    return TYPE_STRINGS[arg]


def _template_param(arg) -> str:
    if isinstance(arg, bool):
        return "bool"
    return "int" if isinstance(arg, int) else "typename"


def write_template(template) -> str:
    return "<" + ", ".join(_template_value(arg) for _, arg in template) + ">"


def make_template_hash(template_def: str) -> str:
    return template_def.replace(", ", "_").replace("<", "_").replace(">", "_")[:-1]


def kernel_name(name: str, template, inputs: list[InputInfo], output_dtypes) -> str:
    kname = f"custom_kernel_{name}"
    if template:
        kname += "_" + make_template_hash(write_template(template))
    for info in inputs:
        kname += "_" + TYPE_STRINGS[info.dtype]
        if info.ndim == 0:
            kname += "s"
        elif info.size < MAX_CONSTANT_ARRAY_SIZE:
            kname += "c"
    for dtype in output_dtypes:
        kname += "_" + TYPE_STRINGS[dtype]
    return kname


def assemble(name, input_names, output_names, source, header, atomic_outputs,
             inputs: list[InputInfo], output_dtypes, template) -> Assembled:
    """MLX's `write_signature` plus the `template [[host_name(...)]]` instantiation."""
    kname = kernel_name(name, template, inputs, output_dtypes)
    text = header
    if template:
        text += "template <" + ", ".join(f"{_template_param(arg)} {n}" for n, arg in template) + ">\n"
    # Statement for statement as MLX writes it, its separator rule included (outputs compare the
    # buffer index against inputs + outputs - 1, not counting shape buffers).
    params = []
    text += f"[[kernel]] void {kname}(\n"
    index = 0
    for n, info, (has_shape, has_strides, has_ndim) in zip(
            input_names, inputs, shape_infos(source, input_names)):
        ref = "&" if info.ndim == 0 else "*"
        text += f"  const {info.location} {TYPE_STRINGS[info.dtype]}{ref} {n} [[buffer({index})]],\n"
        params.append(Param(n, f"const {TYPE_STRINGS[info.dtype]}", by_ref=info.ndim == 0))
        index += 1
        if info.ndim > 0:
            for present, suffix, c_type, by_ref in ((has_shape, "shape", "int", False),
                                                    (has_strides, "strides", "int64_t", False),
                                                    (has_ndim, "ndim", "int", True)):
                if present:
                    text += (f"  const constant {c_type}{'&' if by_ref else '*'} {n}_{suffix}"
                             f" [[buffer({index})]],\n")
                    params.append(Param(f"{n}_{suffix}", f"const {c_type}", by_ref=by_ref))
                    index += 1
    attrs = attributes(source)
    for n, dtype in zip(output_names, output_dtypes):
        type_string = TYPE_STRINGS[dtype]
        if atomic_outputs:
            type_string = f"atomic<{type_string}>"
        text += f"  device {type_string}* {n} [[buffer({index})]]"
        last = not (index < len(inputs) + len(output_names) - 1 or attrs)
        text += ") {\n" if last else ",\n"
        params.append(Param(n, type_string))
        index += 1
    for i, (attr, dtype) in enumerate(attrs):
        text += f"  {dtype} {attr} [[{attr}]]" + (") {\n" if i == len(attrs) - 1 else ",\n")
        params.append(Param(attr, dtype, attribute=True))
    text += source + "\n}\n"
    template_def = write_template(template) if template else ""
    if template:
        inst = kname + template_def
        text += (f'\ntemplate [[host_name("{kname}")]] [[kernel]] decltype({inst}) {inst};\n')
    return Assembled(kname, text, template_def, tuple(params))


def mlx_printed_source(factory_kw: dict, call_kw: dict) -> str:
    """The source MLX itself generates for a kernel and launch: it prints it (verbose=True)
    while `mx.export_function` traces the launch, which works without Metal."""
    kernel = mx.fast.metal_kernel(**factory_kw)
    kw = {k: v for k, v in call_kw.items() if k not in ("inputs", "verbose")}

    def launch(*inputs):
        return kernel(inputs=list(inputs), verbose=True, **kw)

    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryFile() as printed:
        sys.stdout.flush()
        saved = os.dup(1)
        os.dup2(printed.fileno(), 1)  # MLX prints through std::cout
        try:
            mx.export_function(os.path.join(tmp, "kernel.mlxfn"), launch, *call_kw["inputs"])
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        printed.seek(0)
        text = printed.read().decode()
    return text.split("```\n", 1)[1].rsplit("\n```", 1)[0]
