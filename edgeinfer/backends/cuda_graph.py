"""One CUDA graph a decode step, when every layer and the head run on the GPU.

A step of a few tokens (a decoded token, a verified draft) is launch-bound: a few hundred
small kernels from Python. So, as ggml-cuda does, once two consecutive steps have the same
shape, the second is recorded while it runs eagerly (kernels_cuda.graph) and captured; every
later step of that shape is three driver calls: its inputs up (the embedded rows, positions,
K/V slots, key count, block table), the graph, the logits down. The host part of a replayed
step is only the K/V bookkeeping (`kv.append`) and the embedding rows.

A graph is kept per shape: the token count, the K/V storage it reads (its pools' addresses)
and the block table's room. A step the recording finds a replay could not redo (a layer on
the CPU, experts routed on the host, a recurrent layer) stays eager, and `notes` says why,
once. `EDGEINFER_CUDA_GRAPHS=0` turns graphs off.
"""

from __future__ import annotations

import os
import weakref
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from edgeinfer.backends.hybrid import CUDA
from edgeinfer.errors import EdgeInferError
from edgeinfer.kernels_cuda import graph
from edgeinfer.kernels_cuda.driver_graphs import DriverGraphError
from edgeinfer.kernels_cuda.graph import HIDDEN, POSITIONS
from edgeinfer.kv.device_storage import CudaKVCache, DeviceBlockStorage

if TYPE_CHECKING:
    from edgeinfer.backends.hybrid import HybridBackend

MAX_ROWS = 16  # steps of up to this many tokens become graphs (decode, speculative verification)
MAX_GRAPHS = 8  # graphs kept, least recently used dropped first


def enabled() -> bool:
    value = os.environ.get("EDGEINFER_CUDA_GRAPHS", "1").strip()
    if value not in ("0", "1"):
        raise EdgeInferError(f"EDGEINFER_CUDA_GRAPHS={value!r}: expected 0 (off) or 1 (on)")
    return value == "1"


def kv_owner(kv: Any) -> tuple[Any, int] | None:
    """The object whose VRAM a step's K/V kernels read, and the block table's room; None when
    the K/V are not all in VRAM."""
    if isinstance(kv, CudaKVCache):
        return kv, 1
    device = getattr(getattr(kv, "cache", None), "device", None)
    if isinstance(device, DeviceBlockStorage):
        return device, device.table_capacity(kv)
    return None


class _Entry:
    def __init__(self, owner: Any, g: graph.Graph) -> None:
        self.owner = weakref.ref(owner)
        self.graph = g


class StepGraphs:
    """The hybrid backend's step graphs (see the module docstring)."""

    def __init__(self, backend: "HybridBackend") -> None:
        self.backend = backend
        self._graphs: OrderedDict[tuple, _Entry] = OrderedDict()
        self._eager: dict[tuple, str] = {}  # shapes a recording found unreplayable, and why
        self._last_key: tuple | None = None
        self.notes: list[str] = []  # why steps ran eagerly, each said once
        self.notes_shown = 0  # how many of them --verbose has printed
        self._stream = None

    # -- policy -----------------------------------------------------------------------------
    def _why_not(self, model: Any, n: int, rows: np.ndarray | None) -> str | None:
        from edgeinfer.models.base import Transformer

        be = self.backend
        if any(side != CUDA for side in be.placement) or be.head_placement != CUDA:
            return "some layers or the output head run on the CPU (graphs cover a full offload)"
        if not 1 <= n <= MAX_ROWS:
            return None if n > MAX_ROWS else "an empty step"
        if rows is not None and not np.array_equal(rows, np.arange(n)) and not (n == 1 and list(rows) == [0]):
            return "logits of some rows only"
        cls = type(model)
        if cls.forward is not Transformer.forward or cls.hidden is not Transformer.hidden:
            return f"the {cls.__name__} family's forward has inputs of its own"
        if model.hidden_sink is not None:
            return "a drafter reads the hidden states"
        return None

    def _note(self, reason: str) -> None:
        text = f"CUDA graphs: a step runs eagerly: {reason}"
        if text not in self.notes:
            self.notes.append(text)

    def forward(self, model: Any, tokens: np.ndarray, positions: np.ndarray, kv: Any,
                logits_for: np.ndarray | None, run: Callable[[], np.ndarray]) -> np.ndarray:
        """`run()` (the eager step), or its graph: recorded on the second consecutive step of a
        shape, replayed from the third."""
        if not enabled():
            return run()
        n = len(tokens)
        reason = self._why_not(model, n, logits_for)
        owner = kv_owner(kv)
        if reason is None and owner is None:
            reason = "K/V outside VRAM"
        if reason is not None or n > MAX_ROWS:
            if reason is not None:
                self._note(reason)
            self._last_key = None
            return run()
        storage, room = owner
        key = (n, id(storage), room)
        entry = self._graphs.get(key)
        if entry is not None and entry.owner() is storage:
            self._graphs.move_to_end(key)
            logits = self._replay(entry.graph, model, tokens, positions, kv)
            if logits is not None:
                return logits
            self._graphs.pop(key).graph.close()  # its inputs no longer match the step: eager from now on
            self._eager[key] = "a replay's inputs differed from its recording's"
        if key in self._eager:
            self._note(self._eager[key])
            return run()
        repeat, self._last_key = self._last_key == key, key
        if not repeat:
            return run()
        return self._record(key, storage, model, tokens, positions, room, run)

    # -- recording and replay ---------------------------------------------------------------
    def stream(self) -> Any:
        if self._stream is None:
            import pycuda.driver as drv

            self._stream = drv.Stream()
        return self._stream

    def _record(self, key: tuple, storage: Any, model: Any, tokens: np.ndarray, positions: np.ndarray,
                room: int, run: Callable[[], np.ndarray]) -> np.ndarray:
        n, n_embd = len(tokens), model.config.n_embd
        inputs = graph.StepInputs(4 * n * n_embd + 4 * (6 * n + 4 + room) + 8 * graph.ALIGN)
        rec = graph.Recorder(inputs)
        rec.values[HIDDEN], rec.values[POSITIONS] = (n, n_embd), positions
        with graph.recording(rec):
            logits = run()
        reason = rec.reason
        if reason is None and (rec.output is None or not inputs.has(HIDDEN)):
            reason = "the step's input rows or logits were not where a graph reads them"
        if reason is None and not np.array_equal(self._embedded(model, tokens), inputs.host_field(HIDDEN)[:n * n_embd]):
            reason = "the step's first upload was not its embedded tokens"
        if reason is None:
            try:
                g = graph.capture(rec, self.stream())
            except DriverGraphError as exc:
                reason = f"capture failed: {exc}"
            else:
                self._graphs[key] = _Entry(storage, g)
                self._prune()
                return logits
        self._eager[key] = reason
        self._note(reason)
        return logits

    @staticmethod
    def _embedded(model: Any, tokens: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(model.embed(tokens), np.float32).reshape(-1)

    def _replay(self, g: graph.Graph, model: Any, tokens: np.ndarray, positions: np.ndarray, kv: Any
                ) -> np.ndarray | None:
        """The graph's logits for this step, or None (nothing changed) where its inputs do not fit."""
        inputs = g.inputs
        inputs.written.clear()
        before = kv.n_used
        try:
            with graph.preparing(inputs):
                kv.append(positions)  # the K/V bookkeeping; the storage writes its fields
            inputs.write(POSITIONS, np.asarray(positions, np.int32))
            inputs.write(HIDDEN, self._embedded(model, tokens))
        except graph.GraphUnsupported:
            kv.truncate(before)
            return None
        if inputs.written != inputs.names:
            kv.truncate(before)
            return None
        return g.replay(self.stream())

    def _prune(self) -> None:
        for key in [k for k, e in self._graphs.items() if e.owner() is None]:
            self._graphs.pop(key).graph.close()
        while len(self._graphs) > MAX_GRAPHS:
            self._graphs.popitem(last=False)[1].graph.close()

    def close(self) -> None:
        for entry in self._graphs.values():
            entry.graph.close()
        self._graphs.clear()
