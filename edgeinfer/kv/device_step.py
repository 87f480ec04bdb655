"""What one forward step tells the VRAM K/V kernels, as device arrays: the key count, the new
tokens' logical slots and positions (one int32 array: [n_keys, slot x n, position x n]), and
the sequence's block table.

Eagerly they are uploaded once a step. While a step is recorded for a CUDA graph, or prepared
for its replay (edgeinfer.kernels_cuda.graph), they are fields of the graph's step inputs
instead, at addresses the graph keeps, and the new tokens' positions reach the slot-position
pool by a kernel inside the step (`kv_positions`), not by a host copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from edgeinfer.kernels_cuda import graph, launch

STEP_FIELD, TABLE_FIELD = "kv.step", "kv.table"


def step_ints(n_keys: int, logical_slots: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """[n_keys, logical slot x n, position x n] as int32."""
    return np.concatenate([[n_keys], np.asarray(logical_slots), np.asarray(positions)]).astype(np.int32)


@dataclass(frozen=True)
class DeviceStep:
    """One step's ints in VRAM (see step_ints) and how many new tokens they describe."""

    ints: Any  # GPUArray int32 (1 + 2n,)
    n: int

    @property
    def n_keys(self) -> Any:
        return self.ints[0:1]

    @property
    def slots(self) -> Any:
        return self.ints[1:1 + self.n]


def graph_mode() -> bool:
    """Whether this step is recorded for a graph or prepared for its replay."""
    return graph.current_inputs() is not None


def upload_step(ints: np.ndarray) -> DeviceStep:
    """The step's ints in VRAM: a field of the graph's step inputs, or one upload."""
    n = (len(ints) - 1) // 2
    inputs = graph.current_inputs()
    if inputs is not None:
        return DeviceStep(inputs.field(STEP_FIELD, ints), n)
    from pycuda import gpuarray

    return DeviceStep(gpuarray.to_gpu(ints), n)


def graph_table(kept: np.ndarray, capacity: int) -> Any:
    """The block table as a field of the graph's step inputs (room for `capacity` blocks)."""
    return graph.current_inputs().field(TABLE_FIELD, np.asarray(kept, np.int32), capacity)


def write_positions(kpos: Any, table: Any, step: DeviceStep, block_size: int) -> None:
    """While recording, the new tokens' positions into the slot-position pool by a kernel of the
    step (a replay's preparation launches nothing: the graph does it)."""
    if graph.current_recorder() is not None and step.n:
        launch.kv_positions(kpos, table, step.ints, step.n, block_size)
