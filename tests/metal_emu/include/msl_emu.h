// Emulation of the Metal Shading Language subset MLX kernels use, for compiling the exact
// source `mx.fast.metal_kernel` generates as C++ and running it on the CPU (tests/metal_emu).
#pragma once

#include "msl_emu/atomic.h"
#include "msl_emu/sync.h"

// Metal function qualifier (metal_stdlib).
#define METAL_FUNC inline __attribute__((always_inline))

// Address spaces carry no meaning on the CPU: every pointer is a plain pointer, so a
// `constant` pointer passed where a `device` one is expected compiles here but not on Metal.
// Threadgroup *variables* are rewritten to shared per-threadgroup storage (emulate.py); what
// remains of `threadgroup` qualifies pointers. Defined last: the standard headers above use
// `thread` as an identifier.
#define device
#define constant
#define thread
#define threadgroup
