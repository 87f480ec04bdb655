"""An offloaded DeltaNet layer's recurrence on the GPU, its state in VRAM.

`CudaRecurrence.run_layer` is kernels_cpu/delta_net.run_layer on device arrays: the gates,
the short conv over the state's window, q/k split off and L2-normed, the delta rule on the
state, each a kernel of kernels_cuda/recurrent.cu. The layer's conv window and delta-rule
state move to VRAM the first time the layer runs there (the sequence's RecurrentState then
holds GPUArrays for it; its copies, snapshots and saves work on either kind, edgeinfer.kv.
recurrent), so a decode step moves no state over the bus.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from edgeinfer.backends.device_tensor import DeviceTensor
from edgeinfer.kernels_cuda import graph, launch


def to_vram(a: Any) -> Any:
    """A host array's VRAM copy (a device array is returned as it is)."""
    if isinstance(a, np.ndarray):
        from pycuda import gpuarray

        return gpuarray.to_gpu(np.ascontiguousarray(a, np.float32))
    return a


class CudaRecurrence:
    """The recurrence of the hybrid backend's offloaded DeltaNet layers."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend  # the hybrid backend: to_device, cuda.upload_vector_array (no import: a cycle)
        self._weights: dict[int, Any] = {}  # id of the host conv weight -> its VRAM copy

    def run_layer(self, state, i: int, qkv, b, a, dt_bias, ssm_a, w_t, eps: float, shape) -> DeviceTensor:
        graph.forbid("a recurrent layer (its state is swapped and snapshotted on the host's schedule)")
        be = self.backend
        state.conv[i], state.ssm[i] = to_vram(state.conv[i]), to_vram(state.ssm[i])
        qkv, b, a = (be.to_device(x).array for x in (qkv, b, a))
        n = qkv.shape[0]
        beta, g = launch.delta_gates(b, a, be.cuda.upload_vector_array(dt_bias), be.cuda.upload_vector_array(ssm_a))
        snap_at = state.snap_at()
        window = state.conv[i]
        W, C = window.shape
        inp = launch.zeros((W + n, C))
        launch.copy_rows_between(inp, 0, window, 0, W)
        launch.copy_rows_between(inp, W, qkv.reshape(n, C), 0, n)
        xc = launch.conv_silu(inp, self._weight(w_t))
        conv_snaps = launch.zeros((max(len(snap_at), 1), W, C))
        for j, m in enumerate(snap_at):  # the window after m tokens: rows m .. m + W - 1 of inp
            launch.copy_rows_between(conv_snaps[j], 0, inp, int(m), W)
        launch.copy_rows_between(window, 0, inp, n, W)
        q, k, v = launch.qkv_split_norm(xc, shape.n_k_heads, shape.n_v_heads, shape.head_k_dim, eps)
        snaps_dev = None
        if len(snap_at):
            from pycuda import gpuarray

            snaps_dev = gpuarray.to_gpu(np.asarray(snap_at, np.int32))
        out, ssm_snaps = launch.delta_rule(q, k, v, g, beta, state.ssm[i], snaps_dev, len(snap_at))
        state.put_snapshots(i, conv_snaps[:len(snap_at)], ssm_snaps[:len(snap_at)])
        return DeviceTensor(out, be)

    def _weight(self, w_t: np.ndarray) -> Any:
        hit = self._weights.get(id(w_t))
        if hit is None or hit[0] is not w_t:
            hit = self._weights[id(w_t)] = (w_t, to_vram(w_t))
        return hit[1]
