"""Kernel sources: the files under `kernels/` (package data), behind the constants Python injects.

A kernel file is either the body of an MLX kernel (`mx.fast.cuda_kernel`, `mx.fast.metal_kernel`
write its signature and template constants around it: `mlx_kernel`) or a whole translation unit
for NVRTC (`translation_unit`). Its `#include "name"` lines name other files under `kernels/`
and are resolved here, each file once per source; `#include <...>` is left to the compiler. In a
body, an included fragment (`.cuh`, `.h`: device functions and types) goes to the kernel's
header, and an included `.inc` file is more body, read where it stands; in a translation unit
every include is expanded where it stands (NVRTC gets no include path).

In front of it all: a prelude of constants from Python (`constants`, `columns`: tile sizes,
`plan.py`'s work-list columns; `feature_flags`: the attention variant's features compiled in),
so that the sources and the planner cannot drift apart. Kernel
names carry `hash`: MLX caches compiled kernels by name (on disk too) and would silently reuse a
stale one after a source change.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from importlib import resources

import mlx.core as mx

from . import plan
from .geometry import FEATURES

CUDA, METAL = "constexpr int", "constant constexpr int"  # how a prelude declares its constants
_INCLUDE = re.compile(r'#include "([^"]+)"\n')


def source_hash(*texts: str) -> str:
    """Short hash of kernel sources, for kernel names."""
    return hashlib.sha1("".join(texts).encode()).hexdigest()[:10]


def read(name: str) -> str:
    """The text of kernels/`name`."""
    return resources.files(__package__).joinpath("kernels", name).read_text()


def constants(declare: str, **values: int) -> str:
    """Prelude lines `{declare} NAME = value;`, one per keyword."""
    return "".join(f"{declare} {name} = {value};\n" for name, value in values.items())


def feature_flags(features: str) -> str:
    """Prelude lines defining each of `geometry.FEATURES` as 1 where `features` (a geometry's,
    e.g. "window+sinks") names it, else 0: a kernel compiles each in or out with `#if`, so a
    variant without a feature is the plain kernel's text."""
    named = set(features.split("+")) - {""}
    unknown = named - set(FEATURES)
    if unknown:
        raise ValueError(f"features: {sorted(unknown)} are none of {FEATURES}")
    return "".join(f"#define {name.upper()} {int(name in named)}\n" for name in FEATURES)


def columns(declare: str, prefix: str, names: tuple[str, ...], count: str) -> str:
    """Prelude lines naming a list's columns, e.g. `constexpr int W_SEQ = 0;`, and their count."""
    return constants(declare, **{count: len(names)}) + \
        plan.column_constants(prefix, names, declare) + "\n"


def attention_prelude(declare: str, features: str, **values: int) -> str:
    """An attention kernel's prelude for a variant's features: their flags, the constants
    `values`, and the work list's columns (a windowed plan's items carry W)."""
    windowed = "window" in features.split("+")
    return feature_flags(features) + constants(declare, **values) + \
        columns(declare, "W_", plan.work_columns(windowed), "WORK_COLS")


def half_type(dtype: mx.Dtype) -> str:
    """An NVRTC kernel's T (16-bit storage: the kernels move bits) and AB, the operand type its
    tensor-core instructions name."""
    return f'typedef unsigned short T;\n#define AB "{"bf16" if dtype == mx.bfloat16 else "f16"}"\n'


def _lines(name: str, seen: set[str]):
    """kernels/`name` as its lines, and the name of each include not in `seen` yet (added)."""
    for line in read(name).splitlines(keepends=True):
        match = _INCLUDE.fullmatch(line)
        if match is None:
            yield line, None
        elif match[1] not in seen:
            seen.add(match[1])
            yield None, match[1]


def _expand(name: str, seen: set[str]) -> str:
    """kernels/`name` with its includes expanded where they stand, each file once (`seen`)."""
    return "".join(line if line is not None else _expand(included, seen)
                   for line, included in _lines(name, seen))


@dataclass(frozen=True)
class MlxSource:
    """An MLX kernel's `header` and `source` (its body), and their hash for its name."""

    header: str
    source: str
    hash: str


def mlx_kernel(name: str, prelude: str) -> MlxSource:
    """The body in kernels/`name`: the prelude and the fragments it includes as the header."""
    header, body, seen = [prelude], [], {name}

    def walk(part: str) -> None:
        for line, included in _lines(part, seen):
            if line is not None:
                body.append(line)
            elif included.endswith(".inc"):
                walk(included)
            else:
                header.append(_expand(included, seen))

    walk(name)
    text = "".join(header), "".join(body)
    return MlxSource(*text, source_hash(*text))


@dataclass(frozen=True)
class TranslationUnit:
    """An NVRTC kernel: the prelude and kernels/`name` with its fragments, and their hash (with
    the architecture's) for its name; `source` gives one variant's whole translation unit."""

    text: str
    hash: str

    def source(self, name: str, variant: str) -> str:
        """The variant's constants (`variant`), then the kernel, named `name` (KERNEL_NAME)."""
        return f"#define KERNEL_NAME {name}\n" + variant + self.text


def translation_unit(name: str, prelude: str, arch: str) -> TranslationUnit:
    text = prelude + _expand(name, {name})
    return TranslationUnit(text, source_hash(text, arch))
