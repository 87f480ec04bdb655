"""The vision encoder in VRAM: edgeinfer.vision.encoder_ops's interface on the CUDA launchers,
what a model with GPU layers uses unless --no-mmproj-offload (llama.cpp's default).

- Matrices of a type the kernels take (kernels_cuda.launch.supports: F32, F16, Q8_0 and the
  other GGUF types, rows of whole 32-value blocks) are uploaded once, at load, as the file's
  raw rows, like the text model's; their products are the text model's matvec / GEMM
  (launch.linear), the bias added in place. A float matrix whose rows are no multiple of 32
  (SigLIP's ffn_down: 4304) is uploaded with zero columns up to one, and its input padded with
  zeros (launch.pad_cols): the same sums. Another matrix the kernels cannot take runs on the CPU.
- LayerNorm (launch.layer_norm), GELU (launch.gelu, gelu_mul), SiLU-gating and the residual
  adds stay in VRAM; SiLU and quick GELU alone have no kernel here: the host computes them.
- The patch attention is the text model's flash attention: K and V stored (F16, as the text
  model's cache) in one block of n slots, and each query's last visible position (qlim) the
  last patch, so every patch sees every patch.
Activations are pycuda GPUArrays; `host` brings one back where a projector computes itself.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as T

from edgeinfer.kernels_cuda import launch, runtime
from edgeinfer.vision.activation import activation
from edgeinfer.vision.patch_attention import attend

_GLU = {"gelu": "gelu_mul", "silu": "silu_mul"}   # gated activations with a fused kernel
_FLOAT = {T.F32: np.float32, T.F16: np.float16}    # matrix types whose rows can be padded
CHUNK = 32   # the matmul kernels take rows of whole 32-value chunks


def _on_device(x: Any) -> bool:
    return hasattr(x, "gpudata")


class GpuOps:
    """The encoder's matrices, norm vectors and attention in VRAM (the current CUDA context's)."""

    where = "GPU"

    def __init__(self) -> None:
        runtime.context()
        self._mats: dict[int, tuple[Any, Any, Any, int]] = {}   # id(Linear) -> (it, raw rows, bias, row width)
        self._vecs: dict[int, tuple[np.ndarray, Any]] = {}  # id(host vector) -> (it, its VRAM copy)
        self._index: dict[int, tuple[Any, ...]] = {}       # patches -> attention's int32 tables
        self.n_matrices = 0      # matrices uploaded
        self.n_on_cpu = 0        # matrices of a shape or type the kernels lack, left on the CPU
        self.nbytes = 0          # bytes of weights uploaded

    # -- load -----------------------------------------------------------------------------------

    def use_float_order(self, order) -> None:
        """The CPU's rule for ggml's float order (encoder_ops.CpuOps); the GPU's kernels keep their own."""
    def load_linear(self, lin: Any) -> None:
        from pycuda import gpuarray

        width = -(-lin.n_in // CHUNK) * CHUNK
        if lin.qtype in _FLOAT and width != lin.n_in:   # zero columns up to whole chunks
            rows = np.asarray(lin.w_raw).view(_FLOAT[lin.qtype]).reshape(lin.n_out, lin.n_in)
            padded = np.zeros((lin.n_out, width), rows.dtype)
            padded[:, :lin.n_in] = rows
            raw = padded.view(np.uint8)
        elif launch.supports(lin.qtype, lin.n_in):
            raw, width = np.ascontiguousarray(lin.w_raw).view(np.uint8).reshape(lin.n_out, -1), lin.n_in
        else:
            self.n_on_cpu += 1
            return
        w = gpuarray.to_gpu(raw)
        self._mats[id(lin)] = (lin, w, self._vector(lin.bias), width)
        self.n_matrices += 1
        self.nbytes += raw.nbytes

    def load_vector(self, values: np.ndarray | None) -> None:
        self._vector(values)

    def _vector(self, values: np.ndarray | None) -> Any:
        """A host float32 vector's VRAM copy, made once (by identity; the entry keeps it alive)."""
        if values is None:
            return None
        hit = self._vecs.get(id(values))
        if hit is None or hit[0] is not values:
            from pycuda import gpuarray

            dev = gpuarray.to_gpu(np.ascontiguousarray(values, np.float32))
            hit = self._vecs[id(values)] = (values, dev)
            self.nbytes += dev.nbytes
        return hit[1]

    # -- moving activations -----------------------------------------------------------------------
    def host(self, x: Any) -> np.ndarray:
        return x.get() if _on_device(x) else x

    def device(self, x: Any) -> Any:
        if _on_device(x):
            return x
        from pycuda import gpuarray

        return gpuarray.to_gpu(np.ascontiguousarray(x, np.float32))

    # -- ops --------------------------------------------------------------------------------------
    def linears(self, lins: tuple, x: Any) -> list:
        return [self.linear(lin, x) for lin in lins]

    def linear(self, lin: Any, x: Any) -> Any:
        hit = self._mats.get(id(lin))
        if hit is None or hit[0] is not lin:   # a matrix the kernels lack: the CPU's product
            return self.device(lin(self.host(x)))
        _, w, bias, width = hit
        xd = self.device(x).reshape(-1, lin.n_in)
        if width != lin.n_in:
            xd = launch.pad_cols(xd, width)
        y = launch.linear(w, lin.qtype, lin.n_out, width, xd)
        if bias is not None:
            launch.add_rows(y, bias)
        return y

    def layer_norm(self, ln: Any, x: Any) -> Any:
        return launch.layer_norm(self.device(x), self._vector(ln.weight), self._vector(ln.bias), float(ln.eps))

    def activation(self, x: Any, op: str) -> Any:
        if op == "gelu":
            return launch.gelu(self.device(x))
        return self.device(activation(self.host(x), op))

    def glu(self, gate: Any, up: Any, op: str) -> Any:
        if op in _GLU:
            return getattr(launch, _GLU[op])(self.device(gate), self.device(up))
        return self.device(activation(self.host(gate), op) * self.host(up))

    def add(self, a: Any, b: Any) -> Any:
        if tuple(a.shape) != tuple(b.shape):
            raise ValueError(f"encoder add of shapes {tuple(a.shape)} and {tuple(b.shape)}")
        return launch.add(self.device(a), self.device(b))

    def attention(self, q: Any, k: Any, v: Any, scale: float, query_rows: int | None = None) -> Any:
        """q k v (n, heads, d) -> (n, heads * d) in VRAM; query_rows is the CPU's slicing, not needed here."""
        from pycuda import gpuarray

        n, nh, d = q.shape
        if not launch.attention_supports(d, d):   # a head the flash kernels cannot hold: the CPU's
            return self.device(attend(self.host(q), self.host(k), self.host(v), scale, query_rows))
        q, k, v = (self.device(t).reshape(n, nh, d) for t in (q, k, v))
        table, slots, pos, last = self._tables(n)
        kc, vc = gpuarray.empty((n, nh, d), np.float16), gpuarray.empty((n, nh, d), np.float16)
        launch.kv_store(k, v, kc, vc, table, slots, n)   # one block of n slots: physical = logical
        out = launch.attention(q, kc, vc, table, pos, pos, n, n, nh, d, scale, 0, None, qlim=last)
        return out.reshape(n, nh * d)

    def _tables(self, n: int) -> tuple[Any, ...]:
        """(block table [0], slots 0..n-1, positions 0..n-1, every query's limit n-1) in VRAM."""
        hit = self._index.get(n)
        if hit is None:
            from pycuda import gpuarray

            ramp = gpuarray.to_gpu(np.arange(n, dtype=np.int32))
            hit = (gpuarray.to_gpu(np.zeros(1, np.int32)), ramp, ramp,
                   gpuarray.to_gpu(np.full(n, n - 1, np.int32)))
            self._index = {n: hit}   # one image size at a time is enough to reuse them
        return hit

    def describe(self) -> str:
        cpu = f", {self.n_on_cpu} on the CPU (a shape or type the kernels lack)" if self.n_on_cpu else ""
        return (f"vision encoder on the GPU ({self.n_matrices} matrices, "
                f"{self.nbytes / (1 << 20):.1f} MiB in VRAM{cpu})")
