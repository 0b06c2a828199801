"""Metal kernels without a Mac: `metal_kernel` is `mx.fast.metal_kernel` emulated on the CPU.

The exact source MLX generates is compiled as C++ (g++) against an emulation header of the MSL
subset kernels use and run with one OS thread per GPU thread; see README.md.
"""

from .build import CompileError
from .kernel import OPTIONS, EmulatedKernel, EmulationOptions, metal_kernel
from .run import KernelError
from .source import InputInfo

__all__ = ["OPTIONS", "CompileError", "EmulatedKernel", "EmulationOptions", "InputInfo",
           "KernelError", "metal_kernel"]
