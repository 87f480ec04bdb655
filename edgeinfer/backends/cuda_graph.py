"""CUDA graphs for GPU steps: one graph a decode step at a full offload, one a run of GPU
layers at a partial one.

A step of a few tokens (a decoded token, a verified draft) is launch-bound: a few hundred
small kernels from Python. So, as ggml-cuda does, once two consecutive steps have the same
shape, the second is recorded while it runs eagerly (kernels_cuda.graph) and captured; later
steps of that shape replay it.
- **Full offload** (every layer and the head in VRAM): the whole step is one graph, and a token
  is three driver calls: its inputs up (the embedded rows, positions, K/V slots, key count,
  block table), the graph, the logits down. The host part of a replayed step is the K/V
  bookkeeping (`kv.append`) and the embedding rows.
- **Partial offload**: each run of consecutive GPU layers (a span) is a graph: the hidden rows
  it starts from and the K/V fields go up, the graph runs, and the layers after it read its
  output where the graph wrote it.

A graph is kept per shape: where it sits (the step, or a span's layers), the token count, the
K/V storage it reads (its pools' addresses) and the block table's room. A shape the recording
finds a replay could not redo (a layer on the CPU inside the step, experts routed on the host,
a recurrent layer) stays eager, and `notes` says why, once. `EDGEINFER_CUDA_GRAPHS=0` turns
graphs off.
"""

from __future__ import annotations

import os
import weakref
from collections import OrderedDict
from typing import Any, Callable

import numpy as np

from edgeinfer.errors import EdgeInferError
from edgeinfer.kernels_cuda import graph
from edgeinfer.kernels_cuda.graph import HIDDEN, POSITIONS
from edgeinfer.kv.device_storage import CudaKVCache, paged_device, prepare_graph_step

MAX_ROWS = 16  # steps of up to this many tokens become graphs (decode, speculative verification)
MAX_GRAPHS = 8  # graphs kept, least recently used dropped first
STEP = "step"  # where a whole-step graph sits (a span's is its (first, end) layers)


def enabled() -> bool:
    value = os.environ.get("EDGEINFER_CUDA_GRAPHS", "1").strip()
    if value not in ("0", "1"):
        raise EdgeInferError(f"EDGEINFER_CUDA_GRAPHS={value!r}: expected 0 (off) or 1 (on)")
    return value == "1"


def kv_owner(kv: Any) -> tuple[Any, int] | None:
    """The object whose VRAM a step's K/V kernels read, and the block table's room; None when
    the K/V are not in VRAM."""
    if isinstance(kv, CudaKVCache):
        return kv, 1
    device = paged_device(kv)
    return None if device is None else (device, device.table_capacity(kv))


class _Entry:
    def __init__(self, owner: Any, g: graph.Graph) -> None:
        self.owner = weakref.ref(owner)
        self.graph = g


class StepGraphs:
    """The hybrid backend's step and span graphs (see the module docstring)."""

    def __init__(self, backend: Any) -> None:
        # the hybrid backend (its plan, to_device and wrap), which owns this: weakly, so that no
        # cycle keeps a dropped backend's VRAM (its graphs' activations) until a garbage collection
        self.backend = weakref.proxy(backend)
        self._graphs: OrderedDict[tuple, _Entry] = OrderedDict()
        self._eager: dict[tuple, tuple[str, Any]] = {}  # shapes found unreplayable: (why, their storage weakly)
        self._last: dict[Any, tuple] = {}  # where -> (the key of its previous step, its storage, weakly)
        self.notes: list[str] = []  # why steps ran eagerly, each said once
        self.notes_shown = 0  # how many of them --verbose has printed
        self._stream = None

    def full_offload(self) -> bool:
        plan = self.backend.plan
        return plan.output_on_gpu and all(plan.layer_on_gpu(i) for i in range(plan.n_layer))

    def _note(self, reason: str) -> None:
        text = f"CUDA graphs: a step runs eagerly: {reason}"
        if text not in self.notes:
            self.notes.append(text)

    # -- a whole step (full offload) ----------------------------------------------------------
    def _why_not(self, model: Any, n: int, rows: np.ndarray | None) -> str | None:
        from edgeinfer.models.base import Transformer

        if rows is not None and not np.array_equal(rows, np.arange(n)) and not (n == 1 and list(rows) == [0]):
            return "logits of some rows only"
        cls = type(model)
        if cls.forward is not Transformer.forward or cls.hidden is not Transformer.hidden:
            return f"the {cls.__name__} family's forward has inputs of its own"
        if model.hidden_sink is not None:
            return "a drafter reads the hidden states"
        return None

    def forward(self, model: Any, tokens: np.ndarray, positions: np.ndarray, kv: Any,
                logits_for: np.ndarray | None, run: Callable[[], np.ndarray]) -> np.ndarray:
        """The step's logits: `run()` (the eager step), or at a full offload its graph, recorded
        on the second consecutive step of a shape and replayed from the third."""
        n = len(tokens)
        if not enabled() or not self.full_offload() or not 1 <= n <= MAX_ROWS:
            return run()  # (a partial offload's spans are run_layers')
        reason = self._why_not(model, n, logits_for)
        owner = kv_owner(kv)
        if reason is None and owner is None:
            reason = "K/V outside VRAM"
        if reason is not None:
            self._note(reason)
            self._last.pop(STEP, None)
            return run()
        key = (STEP, n) + self._where(owner)
        g = self._graph(key, owner[0])
        if g is not None:
            before = kv.n_used
            logits = self._replay(g, positions, lambda: kv.append(positions), self._embedded(model, tokens),
                                  undo=lambda: kv.truncate(before))
            if logits is not None:
                return logits
            self._drop(key, owner[0])
        if not self._should_record(STEP, key, owner[0]):
            return run()
        return self._record(key, owner, positions, self._embedded(model, tokens), run)

    @staticmethod
    def _embedded(model: Any, tokens: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(model.embed(tokens), np.float32).reshape(-1)

    # -- a span of GPU layers (partial offload) -------------------------------------------------
    def span(self, first: int, end: int, x: Any, positions: np.ndarray, kv: Any, run: Callable[[], Any]) -> Any:
        """Layers first..end-1 (all on the GPU) on x: `run()`, or their graph. x must be host rows
        (what the layers before, on the CPU, or the embedding gave)."""
        n = x.shape[0] if isinstance(x, np.ndarray) and x.ndim == 2 else 0
        if not enabled() or self.full_offload() or graph.current_inputs() is not None or not 1 <= n <= MAX_ROWS:
            return run()
        owner = kv_owner(kv)
        if owner is None:
            return run()
        key = ((first, end), n) + self._where(owner)
        rows = np.ascontiguousarray(x, np.float32).reshape(-1)
        g = self._graph(key, owner[0])
        if g is not None:
            if self._replay(g, positions, lambda: prepare_graph_step(kv), rows, download=False):
                return self.backend.wrap(g.output)
            self._drop(key, owner[0])
        if not self._should_record((first, end), key, owner[0]):
            return run()
        return self._record(key, owner, positions, rows, run, span=True)

    # -- shared ---------------------------------------------------------------------------------
    @staticmethod
    def _where(owner: tuple[Any, int]) -> tuple:
        storage, room = owner
        return id(storage), room

    def _graph(self, key: tuple, storage: Any) -> graph.Graph | None:
        entry = self._graphs.get(key)
        if entry is None or entry.owner() is not storage:
            return None
        self._graphs.move_to_end(key)
        return entry.graph

    def _drop(self, key: tuple, storage: Any) -> None:
        self._graphs.pop(key).graph.close()  # its inputs no longer match the step: eager from now on
        self._mark_eager(key, storage, "a replay's inputs differed from its recording's")

    def _mark_eager(self, key: tuple, storage: Any, reason: str) -> None:
        self._eager[key] = (reason, weakref.ref(storage))
        self._note(reason)
        self._prune()

    def _should_record(self, where: Any, key: tuple, storage: Any) -> bool:
        """Record on the second consecutive step of a shape (not a shape known to stay eager)."""
        eager = self._eager.get(key)
        if eager is not None and eager[1]() is storage:  # (a freed storage's id may come back)
            self._note(eager[0])
            return False
        last = self._last.get(where)  # (key, the storage it read): an id of a freed cache may come back
        repeat = last is not None and last[0] == key and last[1]() is storage
        self._last[where] = (key, weakref.ref(storage))
        return repeat

    def stream(self) -> Any:
        if self._stream is None:
            import pycuda.driver as drv

            self._stream = drv.Stream()
        return self._stream

    def _record(self, key: tuple, owner: tuple[Any, int], positions: np.ndarray, rows: np.ndarray,
                run: Callable[[], Any], span: bool = False) -> Any:
        """`run()` recorded, its input `rows` (n, n_embd) flattened; its graph kept when a replay
        could redo it. What run() returned."""
        storage, room = owner
        n = len(positions)
        inputs = graph.StepInputs(4 * rows.size + 4 * (6 * n + 4 + room) + 8 * graph.ALIGN)
        rec = graph.Recorder(inputs)
        rec.values[HIDDEN], rec.values[POSITIONS] = (n, rows.size // n), positions
        with graph.recording(rec):
            result = run()
            if span:  # its last layer's rows are the graph's result
                rec.output = self.backend.to_device(result).array
        reason = rec.reason
        if reason is None and (rec.output is None or not inputs.has(HIDDEN)):
            reason = "the step's input rows or result were not where a graph reads them"
        if reason is None and not np.array_equal(rows, inputs.host_field(HIDDEN)[:rows.size]):
            reason = "the step's first upload was not its input rows"
        if reason is None:
            try:
                g = graph.capture(rec, self.stream())
            except Exception as exc:  # noqa: BLE001 - any driver refusal: this shape stays eager, said once
                reason = f"capture failed: {exc}"
            else:
                self._graphs[key] = _Entry(storage, g)
                self._prune()
                return result
        self._mark_eager(key, storage, reason)
        return result

    def _replay(self, g: graph.Graph, positions: np.ndarray, kv_fields: Callable[[], Any], rows: np.ndarray,
                download: bool = True, undo: Callable[[], Any] = lambda: None) -> Any:
        """Prepare the inputs (kv_fields writes the K/V's), then the graph: its logits (download),
        True (a span: its output stays in VRAM), or None where the inputs do not fit (after undo())."""
        inputs = g.inputs
        inputs.written.clear()
        try:
            with graph.preparing(inputs):
                kv_fields()
            inputs.write(POSITIONS, np.asarray(positions, np.int32))
            inputs.write(HIDDEN, rows)
            complete = inputs.written == inputs.names
        except graph.GraphUnsupported:
            complete = False
        if not complete:
            undo()
            return None
        if download:
            return g.replay(self.stream())
        g.launch(self.stream())
        return True

    def _prune(self) -> None:
        for key in [k for k, e in self._graphs.items() if e.owner() is None]:
            self._graphs.pop(key).graph.close()
        for key in [k for k, (_, owner) in self._eager.items() if owner() is None]:
            del self._eager[key]
        while len(self._graphs) > MAX_GRAPHS:
            self._graphs.popitem(last=False)[1].graph.close()
