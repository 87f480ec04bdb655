"""CUDA kernels (.cu sources beside this file) and their PyCUDA launchers.

Importing this package never needs pycuda: `runtime.cuda_available()` says whether a GPU
can be used, and `launch` imports pycuda only when a kernel is called.
"""

from edgeinfer.kernels_cuda.runtime import SOURCES, cuda_available

__all__ = ["SOURCES", "cuda_available"]
