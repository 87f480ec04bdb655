"""The `pycuda` stand-in: the subset of PyCUDA that edgeinfer calls, on the CUDA emulator.

`edgeinfer.kernels_cuda.emulator.install()` registers this package and its modules as
`pycuda`, `pycuda.driver`, `pycuda.gpuarray`, `pycuda.compiler` and `pycuda.tools`, so the
launchers, the CUDA backend and the VRAM K/V code run unmodified.
"""

from edgeinfer.kernels_cuda.emulator.standin import compiler, driver, gpuarray, tools

VERSION = (2026, 1)
VERSION_TEXT = "2026.1-edgeinfer-emulator"

__all__ = ["VERSION", "VERSION_TEXT", "compiler", "driver", "gpuarray", "tools"]
