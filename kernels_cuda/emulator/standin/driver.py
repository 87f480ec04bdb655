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
CALLS = kernel.CALLS


def sync_call(kind: str) -> None:
    """Count a synchronous driver call; a step being recorded for a graph hears of it (a replay
    would not redo it)."""
    from edgeinfer.kernels_cuda.graph import current_recorder

    CALLS[kind] += 1
    rec = current_recorder()
    if rec is not None:
        rec.driver_call(kind)


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
    CALLS["alloc"] += 1
    try:
        return DeviceAllocation(MEMORY.alloc(int(nbytes)))
    except OutOfMemory as exc:
        raise MemoryError(str(exc)) from None


def _host(buf: np.ndarray, what: str) -> np.ndarray:
    if not isinstance(buf, np.ndarray) or not buf.flags.c_contiguous:
        raise LogicError(f"{what}: the host buffer must be a C-contiguous numpy array")
    return buf


def memcpy_htod(dest, src: np.ndarray) -> None:
    sync_call("htod")
    _htod(dest, src, "memcpy_htod")


def memcpy_dtoh(dest: np.ndarray, src) -> None:
    sync_call("dtoh")
    _dtoh(dest, src, "memcpy_dtoh")


def _htod(dest, src: np.ndarray, what: str) -> None:
    src = _host(src, what)
    MEMORY.check_range(int(dest), src.nbytes, what)
    ctypes.memmove(int(dest), src.ctypes.data, src.nbytes)


def _dtoh(dest: np.ndarray, src, what: str) -> None:
    dest = _host(dest, what)
    MEMORY.check_range(int(src), dest.nbytes, what)
    ctypes.memmove(dest.ctypes.data, int(src), dest.nbytes)


def memcpy_dtod(dest, src, size: int) -> None:
    sync_call("dtod")
    _dtod(dest, src, size)


def _dtod(dest, src, size: int) -> None:
    MEMORY.check_range(int(src), int(size), "memcpy_dtod source")
    MEMORY.check_range(int(dest), int(size), "memcpy_dtod destination")
    ctypes.memmove(int(dest), int(src), int(size))


def memset_d8(dest, value: int, count: int) -> None:
    sync_call("memset")
    MEMORY.check_range(int(dest), int(count), "memset_d8")
    ctypes.memset(int(dest), int(value), int(count))


def pagelocked_empty(shape, dtype, order: str = "C", mem_flags: int = 0) -> np.ndarray:
    """Host memory is host memory here: a plain numpy array."""
    return np.empty(shape, dtype, order=order)


class Stream:
    """A stream: work issued to it runs at once, in order, unless the stream is capturing, when
    it is kept for the graph instead (`graphs`)."""

    _handles = 0

    def __init__(self, flags: int = 0) -> None:
        Stream._handles += 1
        self.handle = Stream._handles
        self.captured: list | None = None  # the operations of the graph being captured

    def synchronize(self) -> None:
        """Nothing is pending: work ran when it was issued."""

    def issue(self, kind: str, run) -> None:
        if self.captured is not None:
            self.captured.append(run)
            return
        CALLS[kind] += 1
        run()


def _stream(stream) -> Stream:
    if not isinstance(stream, Stream):
        raise LogicError(f"an async call needs a Stream, got {type(stream).__name__}")
    return stream


def _no_capture(stream, what: str) -> None:
    if stream is not None and _stream(stream).captured is not None:
        raise LogicError(f"{what}: a host copy on a capturing stream (the graph would read the host at replay)")


def memcpy_htod_async(dest, src: np.ndarray, stream=None) -> None:
    _no_capture(stream, "memcpy_htod_async")
    CALLS["htod"] += 1
    _htod(dest, src, "memcpy_htod_async")


def memcpy_dtoh_async(dest: np.ndarray, src, stream=None) -> None:
    _no_capture(stream, "memcpy_dtoh_async")
    CALLS["dtoh"] += 1
    _dtoh(dest, src, "memcpy_dtoh_async")


def memcpy_dtod_async(dest, src, size: int, stream=None) -> None:
    dest, src, size = int(dest), int(src), int(size)
    if stream is None:
        CALLS["dtod"] += 1
        _dtod(dest, src, size)
        return
    _stream(stream).issue("dtod", lambda: _dtod(dest, src, size))


class _GraphExec:
    def __init__(self, ops: list) -> None:
        self.ops = ops


class Graphs:
    """The driver's stream capture and graph calls (kernels_cuda/driver_graphs.py on a GPU):
    capture keeps what the stream was given; a launch runs it all again, in order."""

    def begin_capture(self, stream) -> None:
        s = _stream(stream)
        if s.captured is not None:
            raise LogicError("cuStreamBeginCapture: the stream is capturing already")
        s.captured = []

    def end_capture(self, stream) -> _GraphExec:
        s = _stream(stream)
        if s.captured is None:
            raise LogicError("cuStreamEndCapture: the stream is not capturing")
        ops, s.captured = s.captured, None
        return _GraphExec(ops)

    def abandon_capture(self, stream) -> None:
        _stream(stream).captured = None

    def launch(self, exec_handle: _GraphExec, stream) -> None:
        _no_capture(stream, "cuGraphLaunch")
        if exec_handle.ops is None:
            raise LogicError("cuGraphLaunch: the graph was destroyed")
        CALLS["graph_launch"] += 1
        for run in exec_handle.ops:
            run()

    def destroy(self, exec_handle: _GraphExec) -> None:
        exec_handle.ops = None


graphs = Graphs()
