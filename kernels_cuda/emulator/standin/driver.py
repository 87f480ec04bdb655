"""pycuda.driver on the emulator: the device, contexts, allocations, copies, kernel functions."""

from __future__ import annotations

import ctypes

import numpy as np

from edgeinfer.kernels_cuda.emulator import kernel
from edgeinfer.kernels_cuda.emulator.memory import MEMORY, Allocation, OutOfMemory, vram_bytes

DEVICE_NAME = "edgeinfer CUDA emulator (CPU)"
COMPUTE_CAPABILITY = (8, 6)  # what the emulated kernels compile for: WMMA, sm_86 limits


class Error(Exception):
    """Base of the stand-in's errors, as pycuda.driver.Error."""


class LogicError(Error):
    pass


class MemoryError(Error):  # noqa: A001 - pycuda's name
    pass


LaunchError = kernel.LaunchError
Function = kernel.Function


def init(flags: int = 0) -> None:
    """Nothing to start: the emulated device is always there."""


class Context:
    def push(self) -> None:
        pass

    def pop(self) -> None:
        pass

    def detach(self) -> None:
        pass

    @staticmethod
    def synchronize() -> None:
        """Launches finish before they return: nothing is pending."""


class Device:
    def __init__(self, ordinal: int) -> None:
        if ordinal != 0:
            raise LogicError(f"cuDeviceGet failed: invalid device ordinal {ordinal} (the emulator has one device)")
        self.ordinal = ordinal

    @staticmethod
    def count() -> int:
        return 1

    def name(self) -> str:
        return DEVICE_NAME

    def compute_capability(self) -> tuple[int, int]:
        return COMPUTE_CAPABILITY

    def total_memory(self) -> int:
        return vram_bytes()

    def retain_primary_context(self) -> Context:
        return Context()

    def make_context(self, flags: int = 0) -> Context:
        return Context()


def mem_get_info() -> tuple[int, int]:
    """(free, total) bytes of the emulated VRAM."""
    total = vram_bytes()
    return max(0, total - MEMORY.in_use), total


class DeviceAllocation:
    """Device memory owned by Python: freed with free() or when collected."""

    def __init__(self, allocation: Allocation) -> None:
        self._allocation: Allocation | None = allocation

    def __int__(self) -> int:
        if self._allocation is None:
            raise LogicError("this allocation was freed")
        return self._allocation.address

    __index__ = __int__

    @property
    def size(self) -> int:
        return self._allocation.size if self._allocation else 0

    def free(self) -> None:
        if self._allocation is not None:
            MEMORY.free(self._allocation)
            self._allocation = None

    def __del__(self) -> None:
        try:
            self.free()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def mem_alloc(nbytes: int) -> DeviceAllocation:
    try:
        return DeviceAllocation(MEMORY.alloc(int(nbytes)))
    except OutOfMemory as exc:
        raise MemoryError(str(exc)) from None


def _host(buf: np.ndarray, what: str) -> np.ndarray:
    if not isinstance(buf, np.ndarray) or not buf.flags.c_contiguous:
        raise LogicError(f"{what}: the host buffer must be a C-contiguous numpy array")
    return buf


def memcpy_htod(dest, src: np.ndarray) -> None:
    src = _host(src, "memcpy_htod")
    MEMORY.check_range(int(dest), src.nbytes, "memcpy_htod")
    ctypes.memmove(int(dest), src.ctypes.data, src.nbytes)


def memcpy_dtoh(dest: np.ndarray, src) -> None:
    dest = _host(dest, "memcpy_dtoh")
    MEMORY.check_range(int(src), dest.nbytes, "memcpy_dtoh")
    ctypes.memmove(dest.ctypes.data, int(src), dest.nbytes)


def memcpy_dtod(dest, src, size: int) -> None:
    MEMORY.check_range(int(src), int(size), "memcpy_dtod source")
    MEMORY.check_range(int(dest), int(size), "memcpy_dtod destination")
    ctypes.memmove(int(dest), int(src), int(size))


def memset_d8(dest, value: int, count: int) -> None:
    MEMORY.check_range(int(dest), int(count), "memset_d8")
    ctypes.memset(int(dest), int(value), int(count))


def pagelocked_empty(shape, dtype, order: str = "C", mem_flags: int = 0) -> np.ndarray:
    """Host memory is host memory here: a plain numpy array."""
    return np.empty(shape, dtype, order=order)
