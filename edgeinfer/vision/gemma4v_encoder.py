"""Gemma 4's vision tower as libmtmd's gemma4v graph builds it: patches, x/y position tables, RMS-normed blocks with 2-D RoPE.

Per models/gemma4v.cpp and clip.cpp's build_vit (NORM_TYPE_RMS):
- pixels, already normalized with image_mean/std, are mapped to 2x - 1, cut into patches and
  multiplied by the patch kernel (no bias), both rounded to F16 as ggml's im2col does;
- v.position_embd.weight holds two learned tables (n_embd, n_pos, 2): the patch's column
  picks a row of the first, its row a row of the second, both added;
- each block: RMS norm; Q, K, V (each matrix through Gemma4ClippableLinear: optional
  input/output clamps); Q and K RMS-normed per head, then NeoX RoPE (base 100) on the first
  half of each head by column and on the second half by row; V RMS-normed per head without
  a weight; non-causal attention with scale 1; output; post-attention norm; residual; RMS
  norm, GELU-gated MLP, post-FFN norm, residual; times the layer's out_scale.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as T

from edgeinfer.kernels_cpu.f16 import round_f16
from edgeinfer.vision.mmproj import MmprojFile
from edgeinfer.vision.patch_conv import PatchKernel
from edgeinfer.vision.position_ops import neox_2d_angles, rotate_2d_neox
from edgeinfer.vision.vit import Linear, rms_norm

ROPE_BASE = 100.0    # libmtmd sets rope_theta = 100 for gemma4v; the file has no key for it
QUERY_ROWS = 1024    # attention's queries per slice: 1120 tokens x 9 patches would be 400 MB a head at once
_ONE = np.float32(1.0)


class ClampedLinear:
    """Gemma4ClippableLinear: x clamped to [input_min, input_max], x W^T (+ b), clamped to
    [output_min, output_max]; each bound an optional one-element tensor beside the weight."""

    def __init__(self, mm: MmprojFile, name: str, n_in: int, n_out: int, bias: bool = True) -> None:
        self.linear = Linear(mm, name, n_in, n_out, name + ".bias" if bias else None)
        self.ops = mm.ops
        bound = {}
        for k in ("input_min", "input_max", "output_min", "output_max"):
            present = mm.tensor(f"{name}.{k}", (1,), (T.F32,), required=False)   # libmtmd reads F32 only
            bound[k] = mm.vector(f"{name}.{k}", 1) if present else None
        self.bounds = {k: (None if v is None else np.float32(v[0])) for k, v in bound.items()}
        for side in ("input", "output"):
            lo, hi = self.bounds[side + "_min"], self.bounds[side + "_max"]
            if lo is not None and hi is not None and lo > hi:
                raise mm.fail(f"{name}.{side}_min {lo} is above {name}.{side}_max {hi}")

    def _clamp(self, x, lo, hi):
        """x bounded (on the host), or x as it is, wherever it is, without bounds."""
        if lo is None and hi is None:
            return x
        return np.clip(self.ops.host(x), lo, hi).astype(np.float32)

    def __call__(self, x):
        """By the encoder's ops: the result where they compute (edgeinfer.vision.encoder_ops)."""
        b = self.bounds
        y = self.ops.linear(self.linear, self._clamp(x, b["input_min"], b["input_max"]))
        return self._clamp(y, b["output_min"], b["output_max"])


class Norm:
    """build_norm with NORM_TYPE_RMS: ggml_rms_norm, times the weight, plus an optional bias."""

    def __init__(self, mm: MmprojFile, prefix: str, n: int, eps: float, required: bool = True) -> None:
        self.weight = mm.vector(prefix + ".weight", n, required)
        self.bias = mm.vector(prefix + ".bias", n, required=False) if self.weight is not None else None
        self.eps = eps

    def __bool__(self) -> bool:
        return self.weight is not None

    def __call__(self, x: np.ndarray) -> np.ndarray:
        y = rms_norm(x, self.weight, self.eps)
        return y + self.bias if self.bias is not None else y


def _head_norm(mm: MmprojFile, name: str, d_head: int, width: int, eps: float) -> tuple[Norm | None, bool]:
    """An optional Q or K norm: per head (d_head wide) or over the whole row (width wide)."""
    info = mm.gguf.tensors.get(name + ".weight")
    if info is None:
        return None, False
    per_head = tuple(info.shape[:1]) == (d_head,)
    return Norm(mm, name, d_head if per_head else width, eps), per_head


def _scale_vector(mm: MmprojFile, name: str, n: int) -> np.ndarray | None:
    """An optional multiplier of one element (broadcast, as ggml_mul does) or n."""
    info = mm.gguf.tensors.get(name)
    if info is None:
        return None
    return mm.vector(name, 1 if int(np.prod(info.shape)) == 1 else n)


@dataclass
class Block:
    ln1: Norm
    q: ClampedLinear
    k: ClampedLinear
    v: ClampedLinear
    o: ClampedLinear
    q_norm: tuple[Norm | None, bool]
    k_norm: tuple[Norm | None, bool]
    attn_post_norm: Norm
    ln2: Norm
    up: ClampedLinear
    gate: ClampedLinear | None
    down: ClampedLinear
    ffn_post_norm: Norm
    out_scale: np.ndarray | None


def _block(mm: MmprojFile, i: int) -> Block:
    vp, b = mm.vision, f"v.blk.{i}."
    e, width, eps = vp.n_embd, vp.n_head * vp.head_dim, vp.eps
    has_gate = mm.tensor(b + "ffn_gate.weight", (e, vp.n_ff), required=False) is not None
    return Block(
        Norm(mm, b + "ln1", e, eps),
        ClampedLinear(mm, b + "attn_q", e, width), ClampedLinear(mm, b + "attn_k", e, width),
        ClampedLinear(mm, b + "attn_v", e, width), ClampedLinear(mm, b + "attn_out", width, e),
        _head_norm(mm, b + "attn_q_norm", vp.head_dim, width, eps),
        _head_norm(mm, b + "attn_k_norm", vp.head_dim, width, eps),
        Norm(mm, b + "attn_post_norm", e, eps, required=False),
        Norm(mm, b + "ln2", e, eps),
        ClampedLinear(mm, b + "ffn_up", e, vp.n_ff),
        ClampedLinear(mm, b + "ffn_gate", e, vp.n_ff) if has_gate else None,
        ClampedLinear(mm, b + "ffn_down", vp.n_ff, e),
        Norm(mm, b + "ffn_post_norm", e, eps, required=False),
        _scale_vector(mm, b + "out_scale.weight", e))


class Gemma4VisionTower:
    """Normalized pixels (H, W, 3) on the patch grid -> (n_patches, n_embd), patches row-major."""

    def __init__(self, mm: MmprojFile) -> None:
        vp = self.params = mm.vision
        self.ops = mm.ops   # the matrices and the attention (edgeinfer.vision.encoder_ops)
        e, p = vp.n_embd, vp.patch_size
        if vp.head_dim % 4:
            raise mm.fail(f"clip.vision head size {vp.head_dim} is not a multiple of 4 (two rotary halves of pairs)")
        patch = mm.tensor("v.patch_embd.weight", (p, p, 3, e), (T.F32, T.F16))
        kernel = np.asarray(mm.gguf.array(patch.name), np.float32).reshape(e, 3 * p * p)  # rows: (c, y, x)
        if not np.all(np.isfinite(kernel)):
            raise mm.fail("tensor 'v.patch_embd.weight' holds values that are not finite")
        # ggml_conv_2d's im2col is F16 and the product takes the kernel in F16 too
        self.patch_kernel = PatchKernel(kernel)
        pos = mm.gguf.tensors.get("v.position_embd.weight")
        n_pos = int(pos.shape[1]) if pos is not None and len(pos.shape) >= 2 else 0
        if not 1 <= n_pos <= 1 << 20:
            raise mm.fail("tensor 'v.position_embd.weight' must be (n_embd, n_positions, 2): "
                          f"got {None if pos is None else list(pos.shape)}")
        mm.tensor(pos.name, (e, n_pos, 2), (T.F32, T.F16))   # ggml_get_rows of a view: exact either way
        table = np.asarray(mm.gguf.array(pos.name), np.float32).reshape(2, n_pos, e)
        if not np.all(np.isfinite(table)):
            raise mm.fail("tensor 'v.position_embd.weight' holds values that are not finite")
        self.pos_x, self.pos_y = table[0], table[1]
        self.n_pos = n_pos
        self.pre_ln = Norm(mm, "v.pre_ln", e, vp.eps, required=False)
        self.post_ln = Norm(mm, "v.post_ln", e, vp.eps, required=False)
        self.blocks = [_block(mm, i) for i in range(vp.n_layer)]

    def patches(self, x: np.ndarray) -> tuple[np.ndarray, int, int]:
        """(H, W, 3) -> F16-rounded (n_patches, 3 p p) rows laid out (c, y, x), and the grid's (rows, cols)."""
        p = self.params.patch_size
        ph, pw = x.shape[0] // p, x.shape[1] // p
        x = x * np.float32(2.0) - np.float32(1.0)   # gemma4v's ggml_scale_bias(2, -1)
        rows = x[:ph * p, :pw * p].reshape(ph, p, pw, p, 3).transpose(0, 2, 4, 1, 3).reshape(ph * pw, 3 * p * p)
        return round_f16(np.ascontiguousarray(rows, np.float32)), ph, pw

    def __call__(self, x: np.ndarray) -> tuple[np.ndarray, int, int]:
        """-> (hidden (ph * pw, n_embd), ph, pw)."""
        vp = self.params
        rows, ph, pw = self.patches(x)
        if ph > self.n_pos or pw > self.n_pos:
            raise ValueError(f"a {pw}x{ph} patch grid is beyond the {self.n_pos} learned positions a side")
        cols_i = np.tile(np.arange(pw), ph)
        rows_i = np.repeat(np.arange(ph), pw)
        h = self.patch_kernel(rows)
        h = (h + self.pos_x[cols_i]) + self.pos_y[rows_i]
        if self.pre_ln:
            h = self.pre_ln(h)
        angles = neox_2d_angles(cols_i, rows_i, vp.head_dim, ROPE_BASE)
        for blk in self.blocks:
            h = self._block(blk, h, angles)
        if self.post_ln:
            h = self.post_ln(h)
        return np.ascontiguousarray(h, np.float32), ph, pw

    def _block(self, blk: Block, h: np.ndarray, angles: tuple) -> np.ndarray:
        """h on the host in and out: the norms, RoPE and clamps are the host's, the matrices
        and the attention the ops'."""
        vp, ops = self.params, self.ops
        n, nh, d = h.shape[0], vp.n_head, vp.head_dim
        a = ops.device(blk.ln1(h))
        q, k, v = ops.host(blk.q(a)), ops.host(blk.k(a)), ops.host(blk.v(a))
        q = _norm_heads(q, blk.q_norm, n, nh, d)
        k = _norm_heads(k, blk.k_norm, n, nh, d)
        q, k = rotate_2d_neox(q, angles), rotate_2d_neox(k, angles)
        v = rms_norm(v.reshape(n, nh, d), _ONE, vp.eps)   # gemma4v: V RMS-normed per head, no weight
        a = ops.host(blk.o(ops.attention(q, k, v, 1.0, QUERY_ROWS)))   # gemma4v's kq_scale is 1
        if blk.attn_post_norm:
            a = blk.attn_post_norm(a)
        h = a + h
        x = ops.device(blk.ln2(h))
        if blk.gate is not None:   # ggml_geglu_split: gelu(gate) * up
            f = ops.glu(blk.gate(x), blk.up(x), vp.ffn_op)
        else:
            f = ops.activation(blk.up(x), vp.ffn_op)
        f = ops.host(blk.down(f))
        if blk.ffn_post_norm:
            f = blk.ffn_post_norm(f)
        h = h + f
        if blk.out_scale is not None:
            h = h * blk.out_scale
        return h.astype(np.float32)


def _norm_heads(x: np.ndarray, norm: tuple[Norm | None, bool], n: int, nh: int, d: int) -> np.ndarray:
    """(n, nh * d) -> (n, nh, d), RMS-normed per head or over the row first, as the weight's width says."""
    fn, per_head = norm
    if fn is not None and not per_head:
        x = fn(x)
    x = x.reshape(n, nh, d)
    if fn is not None and per_head:
        x = fn(x)
    return x
