"""Write tiny random mmproj GGUFs (the vision half of a multimodal model) for tests.

Key and tensor names are libmtmd's (clip-impl.h); the layout is what llama.cpp's converter
writes for Gemma 3's SigLIP tower: a patch convolution, learned position embeddings, pre-norm
encoder blocks with biases, a post-LayerNorm, then avg-pool + soft-embedding norm + input
projection to the text model's width.

    path = write_gemma3_mmproj(tmp_path / "mmproj.gguf", n_embd_text=64, qtype="Q8_0")
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter

from gguf_factory import _add_metadata, random_blocks

T = GGMLQuantizationType


@dataclass(frozen=True)
class VisionShape:
    image_size: int = 64
    patch_size: int = 16
    n_embd: int = 64        # the ViT's width
    n_head: int = 4
    n_ff: int = 96          # not n_embd: libmtmd takes ffn_down.ne[0] == n_embd as swapped up/down
    n_layer: int = 2
    merge: int = 2          # avg-pool kernel: (image_size / patch_size / merge)^2 image tokens
    eps: float = 1e-6


def _write(path: str | Path, title: str, meta: dict, extra_metadata: dict | None,
           tensors: dict[str, tuple[int, ...]], omit_tensors: tuple[str, ...], tensor_type, tensor_data) -> Path:
    """Write an mmproj: `meta` with `extra_metadata`'s replacements (None drops a key), then
    each tensor not omitted, typed by tensor_type(name, shape) and filled with
    tensor_data(name, qtype, shape, n_rows, n_cols), in order (one random stream)."""
    w = GGUFWriter(str(path), "clip")
    w.add_name(title)
    for key, value in (extra_metadata or {}).items():
        meta.pop(key, None)
        if value is not None:
            meta[key] = value
    for key, value in meta.items():
        _add_metadata(w, key, value)
    plan = []
    for name, gshape in tensors.items():
        if name in omit_tensors:
            continue
        tq = tensor_type(name, gshape)
        n_cols, n_rows = gshape[0], int(np.prod(gshape[1:]))
        block, size = GGML_QUANT_SIZES[tq]
        n_bytes = n_rows * n_cols // block * size
        if tq == T.F32:
            w.add_tensor_info(name, tuple(reversed(gshape)), np.dtype(np.float32), n_bytes)
        else:
            w.add_tensor_info(name, (*reversed(gshape[1:]), n_cols // block * size), np.dtype(np.uint8),
                              n_bytes, raw_dtype=tq)
        plan.append((name, tq, gshape, n_rows, n_cols))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, tq, gshape, n_rows, n_cols in plan:
        w.write_tensor_data(tensor_data(name, tq, gshape, n_rows, n_cols))
    w.close()
    return Path(path)


def _matrix_type(qtype: str, gshape: tuple[int, ...]) -> T:
    """`qtype`, or F16 where a row does not fit its blocks."""
    return T[qtype] if gshape[0] % GGML_QUANT_SIZES[T[qtype]][0] == 0 else T.F16


def _vector(rng, gshape, around_one: bool) -> np.ndarray:
    """A random F32 vector near 0, or near 1 (a norm's weight, a scale)."""
    data = rng.standard_normal(gshape).astype(np.float32) * 0.1
    return data + 1.0 if around_one else data


def gemma3_tensors(s: VisionShape, n_embd_text: int) -> dict[str, tuple[int, ...]]:
    """Every tensor of a gemma3 mmproj, in GGML order (ne[0] first)."""
    e, n_patch = s.n_embd, (s.image_size // s.patch_size) ** 2
    t: dict[str, tuple[int, ...]] = {
        "v.patch_embd.weight": (s.patch_size, s.patch_size, 3, e),
        "v.patch_embd.bias": (e,),
        "v.position_embd.weight": (e, n_patch),
    }
    for i in range(s.n_layer):
        p = f"v.blk.{i}."
        for m in ("attn_q", "attn_k", "attn_v", "attn_out"):
            t[p + m + ".weight"], t[p + m + ".bias"] = (e, e), (e,)
        for m in ("ln1", "ln2"):
            t[p + m + ".weight"], t[p + m + ".bias"] = (e,), (e,)
        t[p + "ffn_up.weight"], t[p + "ffn_up.bias"] = (e, s.n_ff), (s.n_ff,)
        t[p + "ffn_down.weight"], t[p + "ffn_down.bias"] = (s.n_ff, e), (e,)
    t["v.post_ln.weight"], t["v.post_ln.bias"] = (e,), (e,)
    t["mm.soft_emb_norm.weight"] = (e,)
    t["mm.input_projection.weight"] = (n_embd_text, e)
    return t


def write_gemma3_mmproj(path: str | Path, n_embd_text: int, qtype: str = "F32", *,
                        shape: VisionShape | None = None, seed: int = 0,
                        patch_qtype: str = "F16", extra_metadata: dict | None = None,
                        omit_tensors: tuple[str, ...] = (),
                        shape_overrides: dict[str, tuple[int, ...]] | None = None,
                        swap_ffn: bool = False) -> Path:
    """A random-weight gemma3 mmproj: encoder matrices in `qtype`, the patch kernel in
    `patch_qtype` (F16 or F32: a convolution kernel's rows are too short to quantize), the
    input projection in F16 or F32, vectors and position embeddings in F32.
    `extra_metadata` replaces keys (None drops one); `swap_ffn` writes the same weights with
    ffn_up and ffn_down's names exchanged, as old gemma3 conversions did; the other arguments
    make hostile files."""
    s = shape or VisionShape()
    rng = np.random.default_rng(seed)
    meta: dict = {
        "clip.has_vision_encoder": True,
        "clip.projector_type": "gemma3",
        "clip.use_gelu": True,
        "clip.vision.image_size": s.image_size,
        "clip.vision.patch_size": s.patch_size,
        "clip.vision.embedding_length": s.n_embd,
        "clip.vision.feed_forward_length": s.n_ff,
        "clip.vision.block_count": s.n_layer,
        "clip.vision.projection_dim": n_embd_text,
        "clip.vision.attention.head_count": s.n_head,
        "clip.vision.attention.layer_norm_epsilon": s.eps,
        "clip.vision.image_mean": [0.5, 0.5, 0.5],
        "clip.vision.image_std": [0.5, 0.5, 0.5],
        "clip.vision.projector.scale_factor": s.merge,
    }
    tensors = gemma3_tensors(s, n_embd_text)
    if swap_ffn:  # same order (same random stream), names exchanged
        swap = {"ffn_up": "ffn_down", "ffn_down": "ffn_up"}
        tensors = {".".join(swap.get(part, part) for part in k.split(".")): v for k, v in tensors.items()}
    tensors.update(shape_overrides or {})

    def tensor_type(name, gshape):
        if len(gshape) == 1 or name == "v.position_embd.weight":
            return T.F32  # ggml's CPU add takes no F16 operand: converters keep these F32
        if name == "v.patch_embd.weight":
            return T[patch_qtype]
        if name == "mm.input_projection.weight":
            return T.F16 if qtype == "F16" else T.F32  # libmtmd transposes it: float types only
        return _matrix_type(qtype, gshape)

    def tensor_data(name, tq, gshape, n_rows, n_cols):
        if len(gshape) == 1:
            return _vector(rng, gshape, name.endswith(("ln1.weight", "ln2.weight", "post_ln.weight",
                                                       "soft_emb_norm.weight")))
        std = 0.5 if name == "v.position_embd.weight" else 0.08
        return random_blocks(tq, n_rows, n_cols, rng, std=std)

    return _write(path, "tiny-gemma3-mmproj", meta, extra_metadata, tensors, omit_tensors, tensor_type, tensor_data)


# -- qwen3vl (Qwen3-VL, Qwen3.5 vision) ---------------------------------------------------

@dataclass(frozen=True)
class QwenVisionShape:
    patch_size: int = 4      # 8 pixels a merged token: a 40 x 24 image is 5 x 3 tokens
    pos_side: int = 8        # learned position table of pos_side^2 (image_size = pos_side * patch)
    n_embd: int = 32
    n_head: int = 2          # head_dim 16: rotary sections of 4 pairs
    n_ff: int = 64
    n_layer: int = 3
    eps: float = 1e-6


def qwen3vl_tensors(s: QwenVisionShape, n_out: int, deepstack: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """Every tensor of a qwen3vl mmproj as llama.cpp's converter names them, GGML order."""
    e, p, m4 = s.n_embd, s.patch_size, 4 * s.n_embd
    t: dict[str, tuple[int, ...]] = {
        "v.patch_embd.weight": (p, p, 3, e),      # the Conv3D's first temporal frame
        "v.patch_embd.weight.1": (p, p, 3, e),    # and its second
        "v.patch_embd.bias": (e,),
        "v.position_embd.weight": (e, s.pos_side * s.pos_side),
    }
    for i in range(s.n_layer):
        b = f"v.blk.{i}."
        t[b + "ln1.weight"], t[b + "ln1.bias"] = (e,), (e,)
        t[b + "attn_qkv.weight"], t[b + "attn_qkv.bias"] = (e, 3 * e), (3 * e,)
        t[b + "attn_out.weight"], t[b + "attn_out.bias"] = (e, e), (e,)
        t[b + "ln2.weight"], t[b + "ln2.bias"] = (e,), (e,)
        t[b + "ffn_up.weight"], t[b + "ffn_up.bias"] = (e, s.n_ff), (s.n_ff,)
        t[b + "ffn_down.weight"], t[b + "ffn_down.bias"] = (s.n_ff, e), (e,)
        if i in deepstack:
            d = f"v.deepstack.{i}."
            t[d + "norm.weight"], t[d + "norm.bias"] = (m4,), (m4,)
            t[d + "fc1.weight"], t[d + "fc1.bias"] = (m4, m4), (m4,)
            t[d + "fc2.weight"], t[d + "fc2.bias"] = (m4, n_out), (n_out,)
    t["v.post_ln.weight"], t["v.post_ln.bias"] = (e,), (e,)
    t["mm.0.weight"], t["mm.0.bias"] = (m4, m4), (m4,)
    t["mm.2.weight"], t["mm.2.bias"] = (m4, n_out), (n_out,)
    return t


def write_qwen3vl_mmproj(path: str | Path, n_out: int, qtype: str = "F32", *,
                         shape: QwenVisionShape | None = None, deepstack: tuple[int, ...] = (),
                         seed: int = 0, patch_qtype: str = "F32", extra_metadata: dict | None = None,
                         omit_tensors: tuple[str, ...] = (),
                         shape_overrides: dict[str, tuple[int, ...]] | None = None) -> Path:
    """A random-weight qwen3vl mmproj whose merger emits `n_out` wide rows, plus one part of
    `n_out` for each layer in `deepstack` (the text model takes n_out x (1 + len(deepstack))).
    Matrices in `qtype` (F16 where a row does not fit its blocks), the patch kernels in
    `patch_qtype`, vectors in F32; the keyword arguments after `seed` make hostile files."""
    s = shape or QwenVisionShape()
    rng = np.random.default_rng(seed)
    meta: dict = {
        "clip.has_vision_encoder": True,
        "clip.projector_type": "qwen3vl_merger",
        "clip.use_gelu": True,
        "clip.vision.image_size": s.pos_side * s.patch_size,
        "clip.vision.patch_size": s.patch_size,
        "clip.vision.embedding_length": s.n_embd,
        "clip.vision.feed_forward_length": s.n_ff,
        "clip.vision.block_count": s.n_layer,
        "clip.vision.projection_dim": n_out,
        "clip.vision.attention.head_count": s.n_head,
        "clip.vision.attention.layer_norm_epsilon": s.eps,
        "clip.vision.image_mean": [0.48145466, 0.4578275, 0.40821073],
        "clip.vision.image_std": [0.26862954, 0.26130258, 0.27577711],
        "clip.vision.spatial_merge_size": 2,
        "clip.vision.is_deepstack_layers": [i in deepstack for i in range(s.n_layer)],
    }
    tensors = qwen3vl_tensors(s, n_out, deepstack)
    tensors.update(shape_overrides or {})

    def tensor_type(name, gshape):
        if len(gshape) == 1 or name == "v.position_embd.weight":   # ggml_interpolate takes F32 only
            return T.F32
        if name.startswith("v.patch_embd.weight"):
            return T[patch_qtype]
        return _matrix_type(qtype, gshape)

    def tensor_data(name, tq, gshape, n_rows, n_cols):
        if len(gshape) == 1:
            return _vector(rng, gshape, name.endswith(("ln1.weight", "ln2.weight", "post_ln.weight", "norm.weight")))
        # about unit-variance activations through the blocks: weights ~ 1 / sqrt(fan-in)
        std = 0.5 if name == "v.position_embd.weight" else float(1.0 / np.sqrt(n_cols))
        return random_blocks(tq, n_rows, n_cols, rng, std=std)

    return _write(path, "tiny-qwen3vl-mmproj", meta, extra_metadata, tensors, omit_tensors, tensor_type, tensor_data)


# -- gemma4v (Gemma 4 vision) ----------------------------------------------------------------

@dataclass(frozen=True)
class Gemma4VisionShape:
    patch_size: int = 4      # x merge 2 = 8 pixels a token; libmtmd holds an image to 70..1120 tokens
    n_pos: int = 64          # learned positions a side (x table, y table)
    n_embd: int = 32
    n_head: int = 2          # head_dim 16: two rotary halves of 4 pairs
    n_ff: int = 48
    n_layer: int = 2
    merge: int = 2           # clip.vision.projector.scale_factor (Gemma 4's own is 3)
    eps: float = 1e-6


# Gemma4ClippableLinear bounds the tiny file carries (the rest unbounded), tight enough to clip
GEMMA4V_CLAMPS = {"v.blk.0.attn_q": {"input_min": -1.0, "input_max": 1.0},
                  "v.blk.1.ffn_down": {"output_min": -0.5, "output_max": 0.5},
                  "mm.input_projection": {"input_min": -2.0, "input_max": 2.0}}


def gemma4v_tensors(s: Gemma4VisionShape, n_embd_text: int) -> dict[str, tuple[int, ...]]:
    """Every tensor of a gemma4v mmproj as llama.cpp's converter names them, GGML order."""
    e, d = s.n_embd, s.n_embd // s.n_head
    t: dict[str, tuple[int, ...]] = {
        "v.patch_embd.weight": (s.patch_size, s.patch_size, 3, e),   # no bias
        "v.position_embd.weight": (e, s.n_pos, 2),                   # x table, then y table
    }
    for i in range(s.n_layer):
        b = f"v.blk.{i}."
        for m in ("ln1", "attn_post_norm", "ln2", "ffn_post_norm"):
            t[b + m + ".weight"] = (e,)
        for m in ("attn_q", "attn_k", "attn_v", "attn_out"):
            t[b + m + ".weight"] = (e, e)
        t[b + "attn_q_norm.weight"], t[b + "attn_k_norm.weight"] = (d,), (d,)
        t[b + "ffn_gate.weight"], t[b + "ffn_up.weight"] = (e, s.n_ff), (e, s.n_ff)
        t[b + "ffn_down.weight"] = (s.n_ff, e)
        t[b + "out_scale.weight"] = (1,)
    t["v.std_bias"], t["v.std_scale"] = (e,), (e,)
    t["mm.input_projection.weight"] = (e, n_embd_text)
    for name, bounds in GEMMA4V_CLAMPS.items():
        for k in bounds:
            t[f"{name}.{k}"] = (1,)
    return t


def write_gemma4v_mmproj(path: str | Path, n_embd_text: int, qtype: str = "F32", *,
                         shape: Gemma4VisionShape | None = None, seed: int = 0, patch_qtype: str = "F16",
                         extra_metadata: dict | None = None, omit_tensors: tuple[str, ...] = (),
                         shape_overrides: dict[str, tuple[int, ...]] | None = None) -> Path:
    """A random-weight gemma4v mmproj projecting to `n_embd_text`: matrices in `qtype` (F16
    where a row does not fit its blocks), the patch kernel in `patch_qtype`, norms, scales,
    clamp bounds and the position tables in F32; the arguments after `seed` make hostile files."""
    s = shape or Gemma4VisionShape()
    rng = np.random.default_rng(seed)
    meta: dict = {
        "clip.has_vision_encoder": True,
        "clip.projector_type": "gemma4v",
        "clip.use_gelu": True,
        "clip.vision.image_size": 224,    # unused by gemma4v; the converter writes 224
        "clip.vision.patch_size": s.patch_size,
        "clip.vision.embedding_length": s.n_embd,
        "clip.vision.feed_forward_length": s.n_ff,
        "clip.vision.block_count": s.n_layer,
        "clip.vision.projection_dim": n_embd_text,
        "clip.vision.attention.head_count": s.n_head,
        "clip.vision.attention.layer_norm_epsilon": s.eps,
        "clip.vision.image_mean": [0.48, 0.45, 0.40],
        "clip.vision.image_std": [0.27, 0.26, 0.28],
        "clip.vision.projector.scale_factor": s.merge,
    }
    tensors = gemma4v_tensors(s, n_embd_text)
    tensors.update(shape_overrides or {})

    def tensor_type(name, gshape):
        if len(gshape) == 1 or name == "v.position_embd.weight":
            return T.F32
        if name == "v.patch_embd.weight":
            return T[patch_qtype]
        return _matrix_type(qtype, gshape)

    def tensor_data(name, tq, gshape, n_rows, n_cols):
        base, _, kind = name.rpartition(".")
        if base in GEMMA4V_CLAMPS and kind in GEMMA4V_CLAMPS[base]:
            return np.full(gshape, GEMMA4V_CLAMPS[base][kind], np.float32)
        if len(gshape) == 1:
            return _vector(rng, gshape, name.endswith(("norm.weight", "ln1.weight", "ln2.weight", "out_scale.weight",
                                                       "std_scale")))
        std = 0.5 if name == "v.position_embd.weight" else float(1.0 / np.sqrt(n_cols))
        return random_blocks(tq, n_rows, n_cols, rng, std=std)

    return _write(path, "tiny-gemma4v-mmproj", meta, extra_metadata, tensors, omit_tensors, tensor_type, tensor_data)
