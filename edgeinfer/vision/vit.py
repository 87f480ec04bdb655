"""The ViT encoder the projectors share (SigLIP-style pre-norm blocks); its blocks run through the
file's encoder ops (edgeinfer.vision.encoder_ops: the CPU kernels, or gpu_encoder's VRAM).

It follows libmtmd's build_inp + build_vit graph for learned position embeddings and LayerNorm
(NORM_TYPE_NORMAL): patch convolution as one matmul, + position embeddings, optional pre-norm,
n_layer blocks of [LayerNorm, non-causal multi-head attention, residual, LayerNorm, MLP,
residual], optional post-norm. Numerics follow ggml's CPU ops where they round: matrices kept
in F16 see their input rounded to F16 (ggml's vec_dot type for F16), GELU is ggml's F16 table.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as T

from edgeinfer import kernels_cpu
from edgeinfer.kernels_cpu import f32_ggml, gemm_float, ops
from edgeinfer.kernels_cpu.f16 import round_f16  # x.astype(float16).astype(float32), 4x faster
from edgeinfer.vision.activation import activation  # noqa: F401 (the projectors import it from here)
from edgeinfer.vision.mmproj import MmprojFile, VisionParams
from edgeinfer.vision.patch_conv import PatchKernel
from edgeinfer.vision.patch_attention import attend

_FLOAT_KERNEL_TYPES = (T.F32, T.F16)
_BLAS_MIN_ROWS = 64   # patches from which float matrices take gemm_float (fewer: the text path's)


# Quantized types whose every patch libmtmd multiplies in ggml_vec_dot's order: it keeps
# the mmproj in plain CPU buffers (no repack), and for these tinyBLAS's Q0 kernel (8 float
# lanes a row and token over the blocks, then hsum_float_8) sums as vec_dot does.
_VEC_DOT_TYPES = (T.Q8_0,)


def _ggml_float_product(w_raw: np.ndarray, qtype, x: np.ndarray) -> np.ndarray:
    """x W^T of an F32 or F16 matrix (x already through Linear.prepare) in ggml_mul_mat's
    order: tinyBLAS where it takes the shape, else vec_dot per output (kernels_cpu.f32_ggml)."""
    out = np.empty((x.shape[0], w_raw.shape[0]), np.float32)
    if qtype == T.F16:
        return f32_ggml.matmul_f16(w_raw.view(np.float16), x, out)
    return f32_ggml.matmul(w_raw.view(np.float32), x, out)


class Linear:
    """y = x W^T + b over a batch of rows, W as the file's raw blocks."""

    def __init__(self, mm: MmprojFile, name: str, n_in: int, n_out: int, bias: str | None) -> None:
        info = mm.tensor(name + ".weight", (n_in, n_out))
        self.qtype = info.qtype
        self.w_raw = mm.gguf.raw(info.name)
        self.bias = mm.vector(bias, n_out, required=False) if bias else None
        self.n_in, self.n_out = n_in, n_out
        self.float_order = mm.float_order   # when products follow ggml's order (vision.float_order)
        mm.ops.load_linear(self)   # in VRAM from the start where the encoder runs there

    def prepare(self, x: np.ndarray) -> np.ndarray:
        """x as this matrix's product reads it: float32, rounded to F16 for an F16 matrix
        (ggml's F16 dot takes its input in F16 too). Matrices of one type share it."""
        x = np.ascontiguousarray(x, np.float32)
        return round_f16(x) if self.qtype == T.F16 else x

    def apply(self, x: np.ndarray) -> np.ndarray:
        """x W^T + b of an input already through prepare()."""
        ggml_order = self.float_order.ggml_for(x.shape[0])
        if self.qtype in _FLOAT_KERNEL_TYPES and ggml_order:
            y = _ggml_float_product(self.w_raw, self.qtype, x)
        elif self.qtype in _FLOAT_KERNEL_TYPES and x.shape[0] >= _BLAS_MIN_ROWS:
            return gemm_float.gemm(self.w_raw.view(np.float16 if self.qtype == T.F16 else np.float32), x,
                                   bias=self.bias)
        elif self.qtype in _VEC_DOT_TYPES and ggml_order:
            with kernels_cpu.decode_order():   # every patch with decode's (vec_dot's) bits
                y = kernels_cpu.matmul(self.w_raw, self.qtype, x)
        else:
            y = kernels_cpu.matmul(self.w_raw, self.qtype, x)
        if self.bias is not None:
            y += self.bias
        return y

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return self.apply(self.prepare(x))


class LayerNorm:
    """ggml_norm then weight and bias, in ggml's order (kernels_cpu.ops.layer_norm)."""

    def __init__(self, mm: MmprojFile, prefix: str, n: int, eps: float, required: bool = True) -> None:
        self.weight = mm.vector(prefix + ".weight", n, required)
        self.bias = mm.vector(prefix + ".bias", n, required=False) if self.weight is not None else None
        self.eps = np.float32(eps)
        mm.ops.load_vector(self.weight)
        mm.ops.load_vector(self.bias)

    def __bool__(self) -> bool:
        return self.weight is not None

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return ops.layer_norm(x, self.weight, self.bias, self.eps)


def rms_norm(x: np.ndarray, weight, eps: float) -> np.ndarray:
    """ggml_rms_norm times weight (an (n,) vector, or a scalar 1: none) in ggml's order
    (kernels_cpu.ops.rms_norm): float32 squares summed in double one after another. numpy's
    double squares and pairwise mean moved the scale's last bit on some rows, and an 8-bit
    activation quantum of the next Q8_0 matrix with it."""
    n = x.shape[-1]
    w = np.broadcast_to(np.asarray(weight, np.float32), (n,))
    return ops.rms_norm(x, np.ascontiguousarray(w), eps)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, n_head: int, scale: float, ops=None) -> np.ndarray:
    """Non-causal attention over all patches: q, k, v (n, n_head * d) -> (n, n_head * d), by `ops`
    (edgeinfer.vision.encoder_ops; the CPU's patch_attention without)."""
    n, width = q.shape
    heads = [t.reshape(n, n_head, width // n_head) for t in (q, k, v)]
    return ops.attention(*heads, scale) if ops is not None else attend(*heads, scale)


@dataclass
class Block:
    ln1: LayerNorm
    q: Linear
    k: Linear
    v: Linear
    o: Linear
    ln2: LayerNorm
    up: Linear
    down: Linear


def _ffn_names(mm: MmprojFile, prefix: str, n_embd: int) -> tuple[str, str]:
    """(up, down) tensor prefixes. Old conversions of some projectors (gemma3 among them) wrote
    the two swapped: libmtmd swaps them back when ffn_down's rows are n_embd long, and so do we."""
    up, down = prefix + "ffn_up", prefix + "ffn_down"
    info = mm.gguf.tensors.get(down + ".weight")
    if info is not None and up + ".weight" in mm.gguf.tensors and info.shape[0] == n_embd:
        return down, up
    return up, down


class ViT:
    """Patch embedding + encoder blocks: normalized pixels (h, w, 3) -> (n_patches, n_embd)."""

    def __init__(self, mm: MmprojFile) -> None:
        vp: VisionParams = mm.vision
        self.params = vp
        self.ops = mm.ops   # where the blocks run (edgeinfer.vision.encoder_ops)
        e, p = vp.n_embd, vp.patch_size
        width = vp.n_head * vp.head_dim
        patch = mm.tensor("v.patch_embd.weight", (p, p, 3, e), _FLOAT_KERNEL_TYPES)
        # ggml's conv_2d unfolds the image into F16 patches (im2col) and multiplies them by the
        # kernel as F16 (the F16 dot's operand type): an F32 kernel is rounded to F16 too
        kernel = np.asarray(mm.gguf.array(patch.name)).reshape(e, -1)  # rows: one channel's (c, y, x)
        self.patch_kernel = PatchKernel(kernel)
        self.patch_b = mm.vector("v.patch_embd.bias", e, required=False)
        n_side = vp.image_size // p
        pos = mm.tensor("v.position_embd.weight", (e, n_side * n_side), _FLOAT_KERNEL_TYPES)
        self.pos = np.asarray(mm.gguf.array(pos.name), np.float32)
        self.pre_ln = LayerNorm(mm, "v.pre_ln", e, vp.eps, required=False)
        self.post_ln = LayerNorm(mm, "v.post_ln", e, vp.eps, required=False)
        self.blocks = []
        for i in range(vp.n_layer):
            b = f"v.blk.{i}."
            up, down = _ffn_names(mm, b, e)
            self.blocks.append(Block(
                LayerNorm(mm, b + "ln1", e, vp.eps), Linear(mm, b + "attn_q", e, width, b + "attn_q.bias"),
                Linear(mm, b + "attn_k", e, width, b + "attn_k.bias"),
                Linear(mm, b + "attn_v", e, width, b + "attn_v.bias"),
                Linear(mm, b + "attn_out", width, e, b + "attn_out.bias"),
                LayerNorm(mm, b + "ln2", e, vp.eps),
                Linear(mm, up, e, vp.n_ff, up + ".bias"), Linear(mm, down, vp.n_ff, e, down + ".bias")))

    def patches(self, x: np.ndarray) -> np.ndarray:
        """(h, w, 3) -> (n_patches, 3 p p): patches in row-major order, each laid out (c, y, x)
        like the kernel, rounded to F16 (ggml's im2col)."""
        p = self.params.patch_size
        h, w = x.shape[0] // p, x.shape[1] // p
        rows = x[:h * p, :w * p].reshape(h, p, w, p, 3).transpose(0, 2, 4, 1, 3).reshape(h * w, 3 * p * p)
        return round_f16(np.ascontiguousarray(rows, np.float32))

    def __call__(self, x: np.ndarray) -> np.ndarray:
        vp = self.params
        h = self.patch_kernel(self.patches(x))
        if self.patch_b is not None:
            h = h + self.patch_b
        if h.shape[0] != self.pos.shape[0]:
            raise ValueError(f"{h.shape[0]} patches, but {self.pos.shape[0]} position embeddings")
        h = h + self.pos
        ops = self.ops
        if self.pre_ln:
            h = ops.layer_norm(self.pre_ln, h)
        scale = np.float32(1.0) / np.sqrt(np.float32(vp.head_dim))
        for blk in self.blocks:
            a = ops.layer_norm(blk.ln1, h)
            a = attention(*ops.linears((blk.q, blk.k, blk.v), a), vp.n_head, scale, ops)
            h = ops.add(ops.linear(blk.o, a), h)
            f = ops.linear(blk.down, ops.activation(ops.linear(blk.up, ops.layer_norm(blk.ln2, h)), vp.ffn_op))
            h = ops.add(h, f)
        if self.post_ln:
            h = ops.layer_norm(self.post_ln, h)
        return ops.host(h).astype(np.float32)
