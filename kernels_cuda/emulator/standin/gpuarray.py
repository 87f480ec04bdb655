"""pycuda.gpuarray on the emulator: C-contiguous device arrays and the views edgeinfer takes of them."""

from __future__ import annotations

import ctypes
from typing import Any, Callable

import numpy as np

from edgeinfer.kernels_cuda.emulator.memory import MEMORY
from edgeinfer.kernels_cuda.emulator.standin import driver


class GPUArray:
    """`shape` elements of `dtype` at `ptr`. An owning array's `gpudata` is its allocation; a
    view's (a slice or a reshape) is a bare address, as in PyCUDA, and `base` keeps the owner alive."""

    def __init__(self, shape, dtype, allocator: Callable[[int], Any] | None = None, base: "GPUArray | None" = None,
                 gpudata: Any = None) -> None:
        self.shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list)) else (shape,)))
        if any(s < 0 for s in self.shape):
            raise ValueError(f"negative dimension in shape {self.shape}")
        self.dtype = np.dtype(dtype)
        self.size = int(np.prod(self.shape, dtype=np.int64))
        self.nbytes = self.size * self.dtype.itemsize
        self.base = base
        if gpudata is None:
            gpudata = (allocator or driver.mem_alloc)(max(self.nbytes, 1))
        self.gpudata = gpudata
        self.ptr = int(gpudata)

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d GPUArray")
        return self.shape[0]

    def get(self, ary: np.ndarray | None = None, pagelocked: bool = False, **_async) -> np.ndarray:
        if ary is None:
            ary = np.empty(self.shape, self.dtype)
        elif ary.shape != self.shape or ary.dtype != self.dtype or not ary.flags.c_contiguous:
            raise ValueError(f"get(ary=...): expected a C-contiguous {self.dtype} array of shape {self.shape}, "
                             f"got {ary.dtype} {ary.shape}")
        if self.nbytes:
            driver.sync_call("dtoh")
            MEMORY.check_range(self.ptr, self.nbytes, "GPUArray.get")
            ctypes.memmove(ary.ctypes.data, self.ptr, self.nbytes)
        return ary

    def set(self, ary, **_async) -> None:
        ary = np.ascontiguousarray(ary)
        if ary.size != self.size:
            raise ValueError(f"set: {ary.size} elements into a GPUArray of {self.size}")
        if ary.dtype != self.dtype:
            raise ValueError(f"set: a {ary.dtype} array into a {self.dtype} GPUArray")
        if self.nbytes:
            driver.sync_call("htod")
            MEMORY.check_range(self.ptr, self.nbytes, "GPUArray.set")
            ctypes.memmove(self.ptr, ary.ctypes.data, self.nbytes)

    def fill(self, value) -> "GPUArray":
        _elementwise_type(self.dtype)
        self.set(np.full(self.shape, value, self.dtype))
        return self

    def copy(self) -> "GPUArray":
        out = GPUArray(self.shape, self.dtype)
        driver.memcpy_dtod(out.ptr, self.ptr, self.nbytes)
        return out

    def _owner(self) -> "GPUArray":
        return self.base if self.base is not None else self

    def reshape(self, *shape, order: str = "C") -> "GPUArray":
        if order != "C":
            raise NotImplementedError("the emulator's GPUArrays are C-ordered")
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        shape = tuple(int(s) for s in shape)
        if shape.count(-1) > 1:
            raise ValueError("can only specify one unknown dimension")
        if -1 in shape:
            known = int(np.prod([s for s in shape if s != -1]))
            shape = tuple(self.size // known if s == -1 else s for s in shape)
        if int(np.prod(shape, dtype=np.int64)) != self.size:
            raise ValueError(f"cannot reshape a GPUArray of size {self.size} into shape {shape}")
        return GPUArray(shape, self.dtype, base=self._owner(), gpudata=self.ptr)

    def ravel(self) -> "GPUArray":
        return self.reshape(self.size)

    def __getitem__(self, index) -> "GPUArray":
        """Slices of the first axis with step 1 and single rows: contiguous views, as edgeinfer takes them."""
        if isinstance(index, tuple):
            if len(index) != 1:
                raise NotImplementedError("the emulator's GPUArrays take one index (a slice or a row of the first axis)")
            index = index[0]
        if not self.shape:
            raise IndexError("a 0-d GPUArray has no rows")
        row = self.nbytes // self.shape[0] if self.shape[0] else 0
        if isinstance(index, (int, np.integer)):
            i = int(index) + (self.shape[0] if index < 0 else 0)
            if not 0 <= i < self.shape[0]:
                raise IndexError(f"index {int(index)} is out of bounds for axis 0 with size {self.shape[0]}")
            return GPUArray(self.shape[1:], self.dtype, base=self._owner(), gpudata=self.ptr + i * row)
        if isinstance(index, slice):
            start, stop, step = index.indices(self.shape[0])
            if step != 1:
                raise NotImplementedError("the emulator's GPUArrays take slices with step 1 only")
            n = max(0, stop - start)
            return GPUArray((n,) + self.shape[1:], self.dtype, base=self._owner(), gpudata=self.ptr + start * row)
        raise NotImplementedError(f"the emulator's GPUArrays cannot be indexed by {type(index).__name__}")

    def __repr__(self) -> str:
        return f"GPUArray(shape={self.shape}, dtype={self.dtype}, ptr={self.ptr:#x})"


def empty(shape, dtype=np.float32, allocator: Callable[[int], Any] | None = None, order: str = "C") -> GPUArray:
    if order != "C":
        raise NotImplementedError("the emulator's GPUArrays are C-ordered")
    return GPUArray(shape, dtype, allocator=allocator)


# The dtypes pycuda's elementwise kernels (fill, hence zeros) can name in C. float16 is not
# one: real pycuda raises there, so the emulator does too, and code that zeroes f16 arrays
# uses a driver memset (launch.zeros) on either.
_C_TYPES = {np.dtype(t) for t in (np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64,
                                  np.uint64, np.float32, np.float64, np.complex64, np.complex128, np.bool_)}


def _elementwise_type(dtype) -> None:
    if np.dtype(dtype) not in _C_TYPES:
        raise ValueError(f"unable to map dtype '{np.dtype(dtype)}'")


def zeros(shape, dtype=np.float32, allocator: Callable[[int], Any] | None = None, order: str = "C") -> GPUArray:
    _elementwise_type(dtype)
    out = empty(shape, dtype, allocator, order)
    if out.nbytes:
        driver.sync_call("memset")
        ctypes.memset(out.ptr, 0, out.nbytes)
    return out


def to_gpu(ary, allocator: Callable[[int], Any] | None = None) -> GPUArray:
    ary = np.asarray(ary)
    out = GPUArray(ary.shape, ary.dtype, allocator=allocator)
    out.set(ary)
    return out


def empty_like(other: GPUArray) -> GPUArray:
    return GPUArray(other.shape, other.dtype)


def zeros_like(other: GPUArray) -> GPUArray:
    return zeros(other.shape, other.dtype)
