"""A float32 activation in VRAM with just the numpy surface the model files use.

Arithmetic and host conversions go through the tensor's owner, the hybrid CPU/GPU backend
(edgeinfer.backends.hybrid); `TensorOwner` says what that owner provides, so this module
(which the VRAM K/V storage also needs) imports neither.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from edgeinfer.kernels_cuda import launch


class TensorOwner(Protocol):
    """What a DeviceTensor asks of the backend that made it."""

    cuda: Any  # the CudaBackend: `upload_vector_array` for bias rows

    def add(self, a: Any, b: Any) -> Any:
        """`a + b` on the side of the block being run."""

    def mul(self, a: Any, b: Any) -> Any:
        """`a * b` (b a scalar, a row or a tensor of a's shape) on the side of the block being run."""

    def to_host(self, x: Any) -> np.ndarray:
        """The tensor downloaded to host memory."""


class DeviceTensor:
    """A float32 tensor in VRAM with just the numpy surface the model files use."""

    __array_ufunc__ = None  # makes `ndarray + DeviceTensor` call our __radd__

    def __init__(self, array: Any, owner: TensorOwner) -> None:
        self.array = array  # pycuda GPUArray
        self.owner = owner

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.array.shape)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.float32)

    def reshape(self, *shape: int) -> "DeviceTensor":
        if len(shape) == 1 and isinstance(shape[0], tuple):
            shape = shape[0]
        if -1 in shape:
            known = int(np.prod([s for s in shape if s != -1]))
            shape = tuple(self.array.size // known if s == -1 else s for s in shape)
        return DeviceTensor(self.array.reshape(shape), self.owner)

    def __add__(self, other: Any) -> Any:
        return self.owner.add(self, other)

    __radd__ = __add__

    def __mul__(self, other: Any) -> Any:
        return self.owner.mul(self, other)

    __rmul__ = __mul__

    @property
    def ndim(self) -> int:
        return len(self.array.shape)

    def __iadd__(self, other: Any) -> Any:
        if isinstance(other, np.ndarray) and other.ndim == 1:  # a bias row (qwen2 q/k/v)
            launch.add_rows(self.array, self.owner.cuda.upload_vector_array(other))
            return self
        return self.owner.add(self, other)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        """Host code that needs numpy (a plain KVCache.store) gets a download."""
        host = self.owner.to_host(self)
        return host if dtype is None else host.astype(dtype)

    def __getitem__(self, index: Any) -> Any:
        """Row selection (`x[logits_for]`): every row in order stays where it is (a decoded token,
        a verified draft: no round trip through the host); other rows are taken on the host."""
        rows = np.asarray(index) if not isinstance(index, (slice, tuple)) else None
        if rows is not None and rows.ndim == 1 and self.ndim > 1 and np.array_equal(rows, np.arange(self.shape[0])):
            return self
        return self.owner.to_host(self)[index]
