"""Open an mmproj GGUF: check its `clip.*` keys and tensors, pick the projector module by type."""
from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from gguf import GGMLQuantizationType as T

from edgeinfer.errors import EdgeInferError
from edgeinfer.gguf_file import GGUFFile, TensorInfo
from edgeinfer.loader import SUPPORTED_TYPES
from edgeinfer.metadata import (MAX_EMBD, MAX_FF, MAX_HEAD_DIM, MAX_HEADS, MAX_LAYERS, meta_bool,
                                meta_float, meta_float_array, meta_int, meta_str)
from edgeinfer.vision.chunk import ImageChunk
from edgeinfer.vision.encoder_ops import CpuOps
from edgeinfer.vision.float_order import FloatOrder

# Projector type (clip.projector_type) -> the module under edgeinfer.vision that runs it. Each
# module has `from_file(mmproj: MmprojFile) -> Projector` and `max_patches(mmproj) -> int` (its largest
# image's patch rows, for vram_estimate); imported only when a file needs it.
# Adding a projector: one line here and one module.
PROJECTORS: dict[str, str] = {
    "gemma3": "gemma3",
    "gemma4v": "gemma4v",
    "qwen3vl_merger": "qwen3vl",   # Qwen3-VL, Qwen3.5 (the converter writes this name)
}

MAX_IMAGE_SIDE = 1 << 14  # a ViT's input side; real ones are 224..1536


class MmprojError(EdgeInferError):
    """An mmproj file edgeinfer cannot run: its one line names the file and the problem."""


class Projector(Protocol):
    """A loaded vision encoder + projector: pixels in, the text model's embeddings out."""
    projector_type: str
    n_embd: int   # output width: the text model's n_embd

    def encode(self, image) -> ImageChunk:
        """Encode an image_io.Image (or an RGB uint8 (h, w, 3) array)."""
        ...


@dataclass(frozen=True)
class VisionParams:
    """The `clip.vision.*` hyperparameters every ViT shares, each checked."""
    image_size: int
    patch_size: int
    n_embd: int
    n_head: int
    head_dim: int
    n_ff: int
    n_layer: int
    projection_dim: int
    eps: float
    image_mean: np.ndarray   # float32 (3,)
    image_std: np.ndarray    # float32 (3,)
    ffn_op: str              # "gelu" (tanh approximation), "silu" or "gelu_quick", as libmtmd picks it


class MmprojFile:
    """An opened mmproj GGUF with checked accessors: every tensor read through `tensor`."""

    def __init__(self, gf: GGUFFile, projector_type: str, ops=None) -> None:
        self.gguf = gf
        self.path = gf.path
        self.projector_type = projector_type
        # where the encoder computes (edgeinfer.vision.encoder_ops): the projectors' matrices
        # and norms are offered to it as they are read, the CPU's by default
        self.ops = ops if ops is not None else CpuOps()
        self.vision = read_vision_params(self)
        # with 8-bit matrices, small encodes' float work in ggml's order (vision.float_order)
        quantized = any(len(info.shape) >= 2 and info.qtype not in (T.F32, T.F16, T.BF16)
                        for info in gf.tensors.values())
        self.float_order = FloatOrder(quantized, self.vision.n_embd)
        self.ops.use_float_order(self.float_order)

    def fail(self, problem: str) -> MmprojError:
        return MmprojError(f"{self.path}: {problem}")

    def tensor(self, name: str, shape: tuple[int, ...], types=None, required: bool = True) -> TensorInfo | None:
        """The tensor `name`, checked: present (or None when not `required`), of GGML shape
        `shape` (ne[0] first, trailing 1s ignored), of a type in `types` (default: any the
        CPU kernels compute on)."""
        info = self.gguf.tensors.get(name)
        if info is None:
            if required:
                raise self.fail(f"missing tensor {name!r} ({self.projector_type} projector)")
            return None
        got = tuple(info.shape)
        while len(got) > len(shape) and got[-1] == 1:
            got = got[:-1]
        if got != tuple(shape):
            raise self.fail(f"tensor {name!r} has shape {list(info.shape)}, expected {list(shape)}")
        allowed = SUPPORTED_TYPES if types is None else types
        if info.qtype not in allowed:
            raise self.fail(f"tensor {name!r} has type {info.qtype.name}, which the "
                            f"{self.projector_type} projector cannot use here")
        return info

    def pooling_merge(self, default: int) -> int:
        """clip.vision.projector.scale_factor: the pooling's side (merge x merge patches a
        token); `default`, the projector's own, where the file has none."""
        return meta_int(self.gguf.metadata, "clip.vision.projector.scale_factor", 1, 1 << 10, default)

    def vector(self, name: str, n: int, required: bool = True) -> np.ndarray | None:
        """A 1-D F32 tensor (norm weight, bias) as a float32 array."""
        info = self.tensor(name, (n,), (T.F32, T.F16), required)
        if info is None:
            return None
        values = np.asarray(self.gguf.array(name), np.float32).reshape(n)
        if not np.all(np.isfinite(values)):
            raise self.fail(f"tensor {name!r} holds values that are not finite")
        return values



def _float3(mm: MmprojFile, key: str, positive: bool) -> np.ndarray:
    values = meta_float_array(mm.gguf.metadata, key)
    if len(values) < 3 or not np.all(np.isfinite(values[:3])) or (positive and np.any(values[:3] <= 0)):
        want = "three positive numbers" if positive else "three finite numbers"
        raise mm.fail(f"metadata key {key!r} must hold {want}, got {[float(v) for v in values[:4]]}")
    return values[:3].astype(np.float32)


def read_vision_params(mm: MmprojFile) -> VisionParams:
    """The ViT's sizes from `clip.vision.*`, each checked against the others."""
    md = mm.gguf.metadata
    image_size = meta_int(md, "clip.vision.image_size", 1, MAX_IMAGE_SIDE)
    patch_size = meta_int(md, "clip.vision.patch_size", 1, image_size)
    n_embd = meta_int(md, "clip.vision.embedding_length", 1, MAX_EMBD)
    n_head = meta_int(md, "clip.vision.attention.head_count", 1, MAX_HEADS)
    head_dim = meta_int(md, "clip.vision.attention.head_dim", 1, MAX_HEAD_DIM, 0)
    if head_dim == 0:
        if n_embd % n_head:
            raise mm.fail(f"clip.vision.embedding_length {n_embd} is not a multiple of the "
                          f"{n_head} attention heads")
        head_dim = n_embd // n_head
    if meta_int(md, "clip.vision.attention.head_count_kv", 1, MAX_HEADS, n_head) != n_head:
        raise mm.fail("clip.vision.attention.head_count_kv differs from head_count (grouped "
                      "vision attention is not supported)")
    n_ff = meta_int(md, "clip.vision.feed_forward_length", 1, MAX_FF)
    n_layer = meta_int(md, "clip.vision.block_count", 1, MAX_LAYERS)
    projection_dim = meta_int(md, "clip.vision.projection_dim", 0, MAX_EMBD, 0)
    eps = meta_float(md, "clip.vision.attention.layer_norm_epsilon", 0.0, 1.0, lo_exclusive=True)
    use_gelu = meta_bool(md, "clip.use_gelu", False)
    use_silu = meta_bool(md, "clip.use_silu", False)
    if use_gelu and use_silu:
        raise mm.fail("clip.use_gelu and clip.use_silu are both set")
    ffn_op = "gelu" if use_gelu else "silu" if use_silu else "gelu_quick"  # libmtmd's default
    return VisionParams(image_size, patch_size, n_embd, n_head, head_dim, n_ff, n_layer,
                        projection_dim, eps, _float3(mm, "clip.vision.image_mean", False),
                        _float3(mm, "clip.vision.image_std", True), ffn_op)


def projector_type_of(gf: GGUFFile) -> str:
    """clip.projector_type, or clip.vision.projector_type in files with audio too."""
    md = gf.metadata
    ptype = meta_str(md, "clip.projector_type", "") or meta_str(md, "clip.vision.projector_type", "")
    if not ptype:
        raise MmprojError(f"{gf.path}: no clip.projector_type key; is this an mmproj file?")
    return ptype


def load_mmproj(path: str | os.PathLike[str], ops=None) -> Projector:
    """Open, check and load an mmproj file; its projector type picks the module. `ops`: where
    the encoder runs (edgeinfer.vision.encoder_ops.CpuOps by default, gpu_encoder.GpuOps)."""
    gf = GGUFFile.open(path)
    if gf.architecture != "clip":
        raise MmprojError(f"{gf.path}: general.architecture is {gf.architecture!r}, not 'clip': "
                          "not an mmproj file")
    if not meta_bool(gf.metadata, "clip.has_vision_encoder", False):
        raise MmprojError(f"{gf.path}: has no vision encoder (clip.has_vision_encoder is not set)")
    ptype = projector_type_of(gf)
    module_name = PROJECTORS.get(ptype)
    if module_name is None:
        known = ", ".join(sorted(PROJECTORS))
        raise MmprojError(f"{gf.path}: projector type {ptype!r} is not supported (supported: {known})")
    try:
        module = importlib.import_module(f"edgeinfer.vision.{module_name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"edgeinfer.vision.{module_name}":
            raise
        raise MmprojError(f"{gf.path}: projector type {ptype!r} is not implemented yet") from None
    return module.from_file(MmprojFile(gf, ptype, ops))
