"""CUDA graphs for a forward step: its launches recorded once, then replayed as one graph.

A step records while it runs eagerly (`recording`): every kernel launch and device copy the
launchers issue is appended to the `Recorder` as well as run, and the activations it allocates
stay the recorder's (a replay writes them again, so nothing else may ever get those addresses).
`capture` re-issues the recorded operations onto a stream under the driver's stream capture:
nothing but launches and device copies happens while the stream captures, as the driver
requires, because the Python that decided them ran in the eager pass.

What changes from one step to the next lives in `StepInputs`: one device buffer with a pinned
host mirror, cut into named fields (the hidden rows, the positions, the K/V slots and block
table, the key count). The kernels read those fields, never a per-step kernel argument; a
replay writes the mirror and sends it in one copy.

Anything else that would make a replay differ from the step it recorded (a host upload that
is not a field, a download before the logits, a host decision on device values) is reported
with `forbid`: the recording then stays an eager step and is never captured.

The driver's graph calls come from `driver_graphs.LIBCUDA` (ctypes, PyCUDA has none) on a
GPU, and from the emulator's stand-in (`pycuda.driver.graphs`) where it runs: one interface.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np

HIDDEN, POSITIONS = "hidden", "positions"  # the step's input rows and positions (the backend's fields)
ALIGN = 256  # bytes: every field starts at a multiple (the kernels read fields as int4/float4 too)
# What this process issued to the driver for forward steps: kernel launches (eager), graph
# launches, and the step inputs' and logits' copies. bench reports them per decoded token.
COUNTS: Counter = Counter()


@dataclass
class KernelOp:
    function: Any  # a prepared pycuda Function
    grid: tuple
    block: tuple
    args: tuple  # plain values, as prepared_call takes them

    def issue(self, stream: Any) -> None:
        self.function.prepared_async_call(self.grid, self.block, stream, *self.args)


@dataclass
class CopyOp:
    dst: int
    src: int
    nbytes: int

    def issue(self, stream: Any) -> None:
        import pycuda.driver as drv

        drv.memcpy_dtod_async(self.dst, self.src, self.nbytes, stream)


class StepInputs:
    """Named fields of one device buffer with a pinned host mirror; laid out by the first step
    that asks for them (the recording), then rewritten in place by every replay."""

    def __init__(self, nbytes: int) -> None:
        import pycuda.driver as drv
        from pycuda import gpuarray

        self.nbytes = nbytes
        self.host = drv.pagelocked_empty(nbytes, np.uint8)
        self.device = gpuarray.empty(nbytes, np.uint8)
        self._fields: dict[str, tuple[int, int, np.dtype]] = {}  # name -> (offset, capacity, dtype)
        self._end = 0
        self.written: set[str] = set()

    @property
    def names(self) -> frozenset[str]:
        return frozenset(self._fields)

    def has(self, name: str) -> bool:
        return name in self._fields

    def field(self, name: str, values: np.ndarray, capacity: int | None = None) -> Any:
        """The device view of field `name` holding `values` (laid out on first use, with room
        for `capacity` elements); the mirror is written, and while recording uploaded at once
        so the eager pass reads it too."""
        values = np.ascontiguousarray(values)
        if name not in self._fields:
            size = max(capacity or 0, values.size)
            offset = -(-self._end // ALIGN) * ALIGN
            if offset + size * values.itemsize > self.nbytes:
                raise GraphUnsupported(f"step input {name!r} does not fit the {self.nbytes}-byte input buffer")
            self._fields[name] = (offset, size, values.dtype)
            self._end = offset + size * values.itemsize
        offset = self.write(name, values)
        rec = current_recorder()
        if rec is not None:
            with rec.allowed():
                import pycuda.driver as drv

                drv.memcpy_htod(int(self.device.gpudata) + offset, self.host[offset:offset + values.nbytes])
        return self.view(name, values.size)

    def write(self, name: str, values: np.ndarray) -> int:
        """Field `name`'s mirror := values (no copy to the device); its byte offset."""
        offset, capacity, dtype = self._fields[name]
        values = np.ascontiguousarray(values, dtype)
        if values.size > capacity:
            raise GraphUnsupported(f"step input {name!r}: {values.size} values, room for {capacity}")
        self.host[offset:offset + values.nbytes] = values.view(np.uint8).reshape(-1)
        self.written.add(name)
        return offset

    def host_field(self, name: str) -> np.ndarray:
        """Field `name` as the mirror holds it (its whole room)."""
        offset, capacity, dtype = self._fields[name]
        return self.host[offset:offset + capacity * dtype.itemsize].view(dtype)

    def view(self, name: str, size: int) -> Any:
        from pycuda import gpuarray

        offset, _, dtype = self._fields[name]
        return gpuarray.GPUArray((size,), dtype, base=self.device, gpudata=int(self.device.gpudata) + offset)

    def upload(self, stream: Any) -> None:
        """The whole laid-out part of the mirror to the device: one copy."""
        import pycuda.driver as drv

        drv.memcpy_htod_async(int(self.device.gpudata), self.host[:max(self._end, 1)], stream)
        COUNTS["copies"] += 1


class GraphUnsupported(RuntimeError):
    """This step cannot be a graph (said once in --verbose; the step runs eagerly)."""


class Recorder:
    """The operations and allocations of one eager step, and whether a replay could redo it."""

    def __init__(self, inputs: StepInputs) -> None:
        self.inputs = inputs
        self.ops: list[KernelOp | CopyOp] = []
        self.arena: list[Any] = []  # the step's activations: kept as long as its graph lives
        self.output: Any = None  # the device array the step's result is read from
        self.reason: str | None = None  # why this step cannot be replayed (the first one found)
        self._allowed = 0
        self.values: dict[str, Any] = {}  # host objects the step's fields stand for (positions)

    def forbid(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason

    @contextlib.contextmanager
    def allowed(self) -> Iterator[None]:
        """A synchronous driver call that belongs to the recording, not to the step (a field's
        first upload, a weight cached on first use, the result's download)."""
        self._allowed += 1
        try:
            yield
        finally:
            self._allowed -= 1

    def driver_call(self, what: str) -> None:
        """The emulator reports each synchronous copy here: outside `allowed`, the step did
        something a replay would not redo."""
        if not self._allowed:
            self.forbid(f"a synchronous {what} inside the step")


class _Current(threading.local):
    def __init__(self) -> None:
        self.steps: list[Recorder | StepInputs] = []  # the step being recorded, or the inputs being prepared


_current = _Current()  # per thread: a step is one thread's (another thread's launches are not its)


def _top() -> Recorder | StepInputs | None:
    steps = _current.steps
    return steps[-1] if steps else None


def current_recorder() -> Recorder | None:
    top = _top()
    return top if isinstance(top, Recorder) else None


def current_inputs() -> StepInputs | None:
    """The step inputs of the step being recorded or prepared for a replay (None: eager)."""
    top = _top()
    return top.inputs if isinstance(top, Recorder) else top


@contextlib.contextmanager
def _current_step(step: Recorder | StepInputs) -> Iterator[Any]:
    _current.steps.append(step)
    try:
        yield step
    finally:
        _current.steps.pop()


def recording(rec: Recorder) -> contextlib.AbstractContextManager:
    """The eager step that runs inside is recorded into `rec`."""
    return _current_step(rec)


def preparing(inputs: StepInputs) -> contextlib.AbstractContextManager:
    """Host work before a replay (the K/V bookkeeping): fields are written, nothing launches."""
    return _current_step(inputs)


def outside_step() -> contextlib.AbstractContextManager:
    """For an upload that outlives the step (a weight cached on first use): allowed while recording."""
    rec = current_recorder()
    return rec.allowed() if rec is not None else contextlib.nullcontext()


def forbid(reason: str) -> None:
    """Called by host code that a replay would skip; harmless outside a recording."""
    rec = current_recorder()
    if rec is not None:
        rec.forbid(reason)


def graph_api() -> Any:
    """The driver's graph calls: the emulator's stand-in, or libcuda through ctypes."""
    import pycuda.driver as drv

    api = getattr(drv, "graphs", None)
    if api is not None:
        return api
    from edgeinfer.kernels_cuda.driver_graphs import libcuda

    return libcuda()


@dataclass
class Graph:
    """A captured step: its executable graph, its inputs, the array its result is read from,
    and the activations it writes (kept alive with it)."""

    exec_handle: Any
    inputs: StepInputs
    output: Any
    arena: list[Any]
    host_out: np.ndarray = field(default=None)  # type: ignore[assignment]

    def launch(self, stream: Any) -> None:
        """Inputs up, then the graph: two driver calls; the result stays in `output`."""
        self.inputs.upload(stream)
        graph_api().launch(self.exec_handle, stream)
        COUNTS["graphs"] += 1

    def replay(self, stream: Any) -> np.ndarray:
        """`launch`, then the result down: three driver calls. The result's host copy."""
        import pycuda.driver as drv

        self.launch(stream)
        if self.host_out is None:
            self.host_out = drv.pagelocked_empty(self.output.shape, self.output.dtype)
        drv.memcpy_dtoh_async(self.host_out, self.output.gpudata, stream)
        COUNTS["copies"] += 1
        stream.synchronize()
        return self.host_out.copy()

    def close(self) -> None:
        if self.exec_handle is not None:
            graph_api().destroy(self.exec_handle)
            self.exec_handle = None


def capture(rec: Recorder, stream: Any) -> Graph:
    """The recorded operations re-issued onto `stream` under capture: an executable graph."""
    api = graph_api()
    api.begin_capture(stream)
    try:
        for op in rec.ops:
            op.issue(stream)
    except BaseException:
        api.abandon_capture(stream)
        raise
    handle = api.end_capture(stream)
    return Graph(handle, rec.inputs, rec.output, rec.arena)
