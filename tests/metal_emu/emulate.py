"""From MLX's assembled kernel source to a C++ translation unit for the CPU runtime.

The source is compiled as MLX generates it, with one rewrite: a threadgroup *variable*
declaration (`threadgroup T name[N];` at statement level) becomes a reference to storage that
the threadgroup's threads share (`msl::threadgroup_var<T[N]>(site)`), since in C++ a local array
would be private to each thread. Nothing else is touched: the preamble (include/msl_preamble.h)
stands in for MLX's, and a `#line` keeps compiler messages on the kernel's own line numbers.
After the kernel comes a stub that calls it for one thread with the launch's buffers.
"""

from __future__ import annotations

import re

from .source import Assembled

_TG_DECL = re.compile(
    r"(?:^|(?<=[;{}]))(?P<ws>[ \t]*)threadgroup\s+"
    r"(?P<type>(?:[A-Za-z_][\w:]*(?:\s*<[^;{}]*?>)?\s+)+?)"
    r"(?P<name>[A-Za-z_]\w*)\s*(?P<dims>(?:\[[^\]]*\]\s*)*);",
    re.M,
)
# What may remain of `threadgroup` after the rewrite: a pointer or reference qualifier.
_TG_LEFT = re.compile(r"\bthreadgroup\b(?P<rest>[^;=(){},]*)")
_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)


def rewrite_threadgroup_variables(source: str) -> str:
    site = iter(range(10**6))

    def shared(m: re.Match) -> str:
        alias = f"msl_tg_{m['name']}_t"
        return (f"{m['ws']}using {alias} = {m['type'].strip()}{m['dims'].strip()}; "
                f"{alias}& {m['name']} = ::msl::threadgroup_var<{alias}>({next(site)});")

    out = _TG_DECL.sub(shared, source)
    code = _COMMENT.sub(lambda c: re.sub(r"[^\n]", " ", c.group(0)), out)
    for m in _TG_LEFT.finditer(code):
        if "*" not in m["rest"] and "&" not in m["rest"]:
            line = code.count("\n", 0, m.start()) + 1
            raise NotImplementedError(
                f"line {line}: threadgroup declaration the emulation cannot share between "
                f"threads (one declarator per statement, no initialiser): {m.group(0).strip()!r}")
    return out


def _argument(param, buffer: int) -> str:
    if param.attribute:
        if param.c_type == "uint3":
            return f"uint3(a->{param.name}[0], a->{param.name}[1], a->{param.name}[2])"
        return f"a->{param.name}"
    pointer = f"({param.c_type}*)buffers[{buffer}]"
    return f"*{pointer}" if param.by_ref else pointer


def launch_stub(assembled: Assembled) -> str:
    args, buffer = [], 0
    for param in assembled.params:
        args.append(_argument(param, buffer))
        buffer += not param.attribute
    call = f"{assembled.kernel_name}{assembled.template_def}"
    return ('extern "C" void msl_emu_thread(void* const* buffers, const msl::rt::ThreadAttrs* a) {\n'
            f"  {call}(\n    " + ",\n    ".join(args) + ");\n}\n")


def translation_unit(assembled: Assembled) -> str:
    body = rewrite_threadgroup_variables(assembled.source)
    return (f'#include "msl_preamble.h"\n#line 1 "{assembled.kernel_name}.metal"\n{body}\n'
            f'#line 1 "msl_emu_stub.cpp"\n{launch_stub(assembled)}')
