"""The CUDA driver's stream capture and graph calls through ctypes: PyCUDA (2026.1) has none.

They run on PyCUDA's stream handle in PyCUDA's current context (the calls use the thread's
current context, which runtime.context() made current). The emulator's stand-in offers the
same four methods (`pycuda.driver.graphs`), so kernels_cuda.graph captures one way on both.
"""

from __future__ import annotations

import ctypes
import functools

CAPTURE_MODE_RELAXED = 2  # CU_STREAM_CAPTURE_MODE_RELAXED: only launches and async copies are issued anyway


class DriverGraphError(RuntimeError):
    pass


class LibcudaGraphs:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        p, vp = ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)
        self._begin = self._fn("cuStreamBeginCapture_v2", [p, ctypes.c_int])
        self._end = self._fn("cuStreamEndCapture", [p, vp])
        self._instantiate = self._fn("cuGraphInstantiateWithFlags", [vp, p, ctypes.c_ulonglong])
        self._launch = self._fn("cuGraphLaunch", [p, p])
        self._exec_destroy = self._fn("cuGraphExecDestroy", [p])
        self._graph_destroy = self._fn("cuGraphDestroy", [p])
        self._error_string = self._fn("cuGetErrorString", [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)])

    def _fn(self, name: str, argtypes: list) -> ctypes._CFuncPtr:
        f = getattr(self._lib, name)
        f.argtypes, f.restype = argtypes, ctypes.c_int
        return f

    def _check(self, rc: int, what: str) -> None:
        if rc:
            text = ctypes.c_char_p()
            self._error_string(rc, ctypes.byref(text))
            raise DriverGraphError(f"{what} failed: {(text.value or b'').decode()} (CUresult {rc})")

    def begin_capture(self, stream) -> None:
        self._check(self._begin(stream.handle, CAPTURE_MODE_RELAXED), "cuStreamBeginCapture")

    def end_capture(self, stream) -> int:
        """Ends the capture; the graph instantiated (the template graph is freed). Its exec handle."""
        graph = ctypes.c_void_p()
        self._check(self._end(stream.handle, ctypes.byref(graph)), "cuStreamEndCapture")
        try:
            exec_handle = ctypes.c_void_p()
            self._check(self._instantiate(ctypes.byref(exec_handle), graph, 0), "cuGraphInstantiate")
        finally:
            self._graph_destroy(graph)
        return exec_handle.value

    def abandon_capture(self, stream) -> None:
        graph = ctypes.c_void_p()
        if self._end(stream.handle, ctypes.byref(graph)) == 0 and graph.value:
            self._graph_destroy(graph)

    def launch(self, exec_handle: int, stream) -> None:
        self._check(self._launch(exec_handle, stream.handle), "cuGraphLaunch")

    def destroy(self, exec_handle: int) -> None:
        self._exec_destroy(exec_handle)


@functools.lru_cache(maxsize=1)
def libcuda() -> LibcudaGraphs:
    try:
        return LibcudaGraphs(ctypes.CDLL("libcuda.so.1"))
    except (OSError, AttributeError) as exc:
        raise DriverGraphError(f"the CUDA driver's graph calls are unavailable: {exc}") from None
