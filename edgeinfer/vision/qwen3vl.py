"""The qwen3vl projector (Qwen3-VL, Qwen3.5/3.6 vision): smart resize, ViT with 2-D rotary positions, deepstack, 2x2 patch merger.

As libmtmd's PROJECTOR_TYPE_QWEN3VL (tools/mtmd/models/qwen3vl.cpp, clip.cpp):
- the image is resized (bicubic, Pillow's arithmetic) to a multiple of patch x 2 a side, its
  pixel count held within 8 .. 4096 merged tokens' worth (libmtmd's own limits for Qwen-VL:
  it does not read clip.vision.image_min/max_pixels; `set_token_limits` replaces them as
  mtmd's image_min_tokens / image_max_tokens do), then normalized with image_mean/std;
- patch embedding: the converter splits the Conv3D's two temporal frames into two Conv2D
  kernels; on a still image both see the same pixels, and the graph sums them, plus the bias;
- the patches are taken in 2x2 blocks (block row, block column, the four inside), so four
  consecutive rows make one merged token; the learned position embeddings are resized
  (bilinear, align corners) to the patch grid and ordered the same way;
- blocks: LayerNorm, fused QKV with bias, 2-D rotary positions per head (the first half of a
  head turns with the patch row, the second with its column), non-causal attention, output
  projection, residual; LayerNorm, MLP (clip.use_gelu: GELU, tanh form), residual;
- a layer with deepstack tensors also sends its output, 4 rows a token, through LayerNorm,
  fc1, GELU, fc2;
- post LayerNorm, then the merger on 4 rows a token: fc1, GELU, fc2 (mm.0, mm.2).
Output: (rows x cols merged tokens, (1 + n_deepstack) x the merger's width), the deepstack
outputs appended along the width in layer order (Qwen3.5: none, so the text model's width;
Qwen3-VL: the text model adds the appended parts into its first layers).
"""
from __future__ import annotations

import math

import numpy as np
from gguf import GGMLQuantizationType as T

from edgeinfer.kernels_cpu.f16 import round_f16
from edgeinfer.metadata import MAX_FF, meta_int
from edgeinfer.vision import image_ops
from edgeinfer.vision.chunk import ImageChunk
from edgeinfer.vision.image_io import MAX_PIXELS, Image, ImageError, from_pixels
from edgeinfer.vision.mmproj import MmprojFile
from edgeinfer.vision.patch_conv import PatchKernel
from edgeinfer.vision.position_ops import mrope_vision_angles, resize_align_corners, rotate_mrope_vision
from edgeinfer.vision.qwen_resize import smart_size
from edgeinfer.vision.vit import LayerNorm, Linear

MERGE = 2                          # the graph merges 2x2 patches, whatever spatial_merge_size says
MIN_TOKENS, MAX_TOKENS = 8, 4096   # libmtmd's set_limit_image_tokens(8, 4096) for Qwen-VL
ROPE_BASE = 10000.0                # ggml_rope_multi's freq_base in the graph
MAX_SIDE = 65536                   # libmtmd's largest resize target
QUERY_ROWS = 1024                  # attention's queries per slice


class PatchEmbedding:
    """The two temporal Conv2D kernels on one still image, summed, plus the bias.
    ggml_conv_2d builds its im2col in F16 for an F32 or F16 kernel, and the product then
    converts the kernel to F16 too: pixels and kernels are rounded to F16, dots in float32."""

    def __init__(self, mm: MmprojFile, patch: int, n_embd: int) -> None:
        self.kernels = []
        for name in ("v.patch_embd.weight", "v.patch_embd.weight.1"):
            info = mm.tensor(name, (patch, patch, 3, n_embd), (T.F32, T.F16))
            k = np.asarray(mm.gguf.array(info.name)).reshape(n_embd, 3 * patch * patch)  # rows: (c, ky, kx)
            if not np.all(np.isfinite(k)):
                raise mm.fail(f"tensor {name!r} holds values that are not finite")
            with np.errstate(over="ignore"):
                k16 = np.ascontiguousarray(k, np.float16)
            if not np.all(np.isfinite(k16)):
                raise mm.fail(f"tensor {name!r} holds values beyond F16's range")
            self.kernels.append(PatchKernel(k16))
        self.bias = mm.vector("v.patch_embd.bias", n_embd)
        self.patch = patch

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """(H, W, 3) -> (H/p, W/p, n_embd)."""
        p = self.patch
        ph, pw = x.shape[0] // p, x.shape[1] // p
        rows = x.reshape(ph, p, pw, p, 3).transpose(0, 2, 4, 1, 3).reshape(ph * pw, 3 * p * p)
        rows = np.ascontiguousarray(round_f16(rows))
        out = sum(k(rows) for k in self.kernels) + self.bias
        return out.reshape(ph, pw, -1).astype(np.float32)


class Merger:
    """4 patch rows into one token: [LayerNorm over the 4 rows,] fc1, GELU, fc2."""

    def __init__(self, mm: MmprojFile, fc1: str, fc2: str, n_in: int, n_out: int,
                 norm: str | None, eps: float) -> None:
        self.norm = LayerNorm(mm, norm, n_in, eps) if norm else None
        hidden = _rows_of(mm, fc1 + ".weight")
        self.fc1 = Linear(mm, fc1, n_in, hidden, fc1 + ".bias")
        self.fc2 = Linear(mm, fc2, hidden, n_out, fc2 + ".bias")
        self.ops = mm.ops

    def __call__(self, x):
        """By the encoder's ops (edgeinfer.vision.encoder_ops): the result where they compute."""
        ops = self.ops
        if self.norm is not None:
            x = ops.layer_norm(self.norm, x)
        return ops.linear(self.fc2, ops.activation(ops.linear(self.fc1, x), "gelu"))


def _rows_of(mm: MmprojFile, name: str) -> int:
    """A matrix's output width as the file gives it (its shape is checked where it is read)."""
    info = mm.gguf.tensors.get(name)
    if info is None:
        raise mm.fail(f"missing tensor {name!r} (qwen3vl projector)")
    if len(info.shape) < 2 or not 1 <= info.shape[1] <= MAX_FF:
        raise mm.fail(f"tensor {name!r} has shape {list(info.shape)}, expected 2-D")
    return int(info.shape[1])


class Block:
    """One pre-norm ViT block with fused QKV and the vision rotary."""

    def __init__(self, mm: MmprojFile, i: int) -> None:
        vp, b = mm.vision, f"v.blk.{i}."
        e = vp.n_embd
        self.ln1 = LayerNorm(mm, b + "ln1", e, vp.eps)
        self.qkv = Linear(mm, b + "attn_qkv", e, 3 * e, None)
        self.qkv_b = mm.vector(b + "attn_qkv.bias", 3 * e)   # the graph adds it unconditionally
        self.out = Linear(mm, b + "attn_out", e, e, b + "attn_out.bias")
        self.ln2 = LayerNorm(mm, b + "ln2", e, vp.eps)
        self.up = Linear(mm, b + "ffn_up", e, vp.n_ff, b + "ffn_up.bias")
        gate = mm.tensor(b + "ffn_gate.weight", (e, vp.n_ff), required=False)
        self.gate = Linear(mm, b + "ffn_gate", e, vp.n_ff, b + "ffn_gate.bias") if gate else None
        self.down = Linear(mm, b + "ffn_down", vp.n_ff, e, b + "ffn_down.bias")
        self.ops = mm.ops

    def __call__(self, h, angles: tuple, vp):
        """h where the encoder's ops compute, in and out; the rotary on the host."""
        ops = self.ops
        n, e, nh = h.shape[0], vp.n_embd, vp.n_head
        qkv = ops.host(ops.linear(self.qkv, ops.layer_norm(self.ln1, h))) + self.qkv_b
        q, k, v = qkv[:, :e], qkv[:, e:2 * e], qkv[:, 2 * e:]
        q, k = rotate_mrope_vision(q.reshape(n, nh, -1), angles), rotate_mrope_vision(k.reshape(n, nh, -1), angles)
        scale = np.float32(1.0) / np.sqrt(np.float32(vp.head_dim))
        h = ops.add(h, ops.linear(self.out, ops.attention(q, k, v.reshape(n, nh, -1), scale, QUERY_ROWS)))
        x = ops.layer_norm(self.ln2, h)
        if self.gate is not None:   # ggml's *glu_split: act(gate) * up
            y = ops.glu(*ops.linears((self.gate, self.up), x), vp.ffn_op)
        else:
            y = ops.activation(ops.linear(self.up, x), vp.ffn_op)
        return ops.add(h, ops.linear(self.down, y))


class Qwen3VLProjector:
    """A checked qwen3vl mmproj: images in, (rows x cols, n_embd) embeddings and their grid out."""
    projector_type = "qwen3vl_merger"

    def __init__(self, mm: MmprojFile) -> None:
        vp = self.params = mm.vision
        self.path = mm.path
        self.ops = mm.ops   # where the blocks and mergers run (edgeinfer.vision.encoder_ops)
        e = vp.n_embd
        merge = meta_int(mm.gguf.metadata, "clip.vision.spatial_merge_size", 1, 65535, MERGE)
        if merge != MERGE:
            raise mm.fail(f"clip.vision.spatial_merge_size is {merge}; the qwen3vl graph merges 2x2 patches")
        if vp.head_dim * vp.n_head != e or vp.head_dim % 4:
            raise mm.fail(f"{vp.n_head} heads of {vp.head_dim} must fill the width {e}, each a multiple "
                          f"of 4 wide (the rotary's row and column sections)")
        if "v.class_embd" in mm.gguf.tensors:
            raise mm.fail("a qwen3vl mmproj has no class embedding (v.class_embd)")
        self.patch_embd = PatchEmbedding(mm, vp.patch_size, e)
        pos = mm.gguf.tensors.get("v.position_embd.weight")
        n_pos = pos.shape[1] if pos is not None and len(pos.shape) == 2 else 0
        side = math.isqrt(n_pos)
        if side < 1 or side * side != n_pos:
            raise mm.fail(f"v.position_embd.weight must hold a square grid of {e}-wide embeddings, "
                          f"got shape {list(pos.shape) if pos is not None else None}")
        mm.tensor(pos.name, (e, n_pos), (T.F32,))   # libmtmd resizes it with ggml_interpolate: F32 only
        self.pos_embd = np.asarray(mm.gguf.array(pos.name), np.float32).reshape(side, side, e)
        if not np.all(np.isfinite(self.pos_embd)):
            raise mm.fail("tensor 'v.position_embd.weight' holds values that are not finite")
        self.pre_ln = LayerNorm(mm, "v.pre_ln", e, vp.eps, required=False)
        self.post_ln = LayerNorm(mm, "v.post_ln", e, vp.eps, required=False)
        n_out = _rows_of(mm, "mm.2.weight")
        if vp.projection_dim and vp.projection_dim != n_out:
            raise mm.fail(f"mm.2.weight projects to {n_out}, but clip.vision.projection_dim is {vp.projection_dim}")
        self.merger = Merger(mm, "mm.0", "mm.2", 4 * e, n_out, None, vp.eps)
        self.blocks = [Block(mm, i) for i in range(vp.n_layer)]
        self.deepstack: dict[int, Merger] = {}
        for i in range(vp.n_layer):
            d = f"v.deepstack.{i}."
            names = [d + s for s in ("norm.weight", "norm.bias", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")]
            present = [n in mm.gguf.tensors for n in names]
            if all(present):
                self.deepstack[i] = Merger(mm, d + "fc1", d + "fc2", 4 * e, n_out, d + "norm", vp.eps)
            elif any(present):   # libmtmd runs a layer's deepstack only with all six
                missing = ", ".join(n for n, ok in zip(names, present) if not ok)
                raise mm.fail(f"deepstack layer {i} lacks {missing}")
        self.n_embd = n_out * (1 + len(self.deepstack))   # what the text model must take in
        self.set_token_limits()

    def set_token_limits(self, min_tokens: int = 0, max_tokens: int = 0) -> None:
        """Merged tokens an image is resized to at least / at most; 0 keeps libmtmd's 8 / 4096."""
        if min_tokens < 0 or max_tokens < 0:
            raise ValueError("image token limits must not be negative")
        area = (self.params.patch_size * MERGE) ** 2
        lo, hi = (min_tokens or MIN_TOKENS) * area, (max_tokens or MAX_TOKENS) * area
        if hi < lo:
            raise ValueError(f"at most {hi} pixels is less than at least {lo}")
        self.min_pixels, self.max_pixels = lo, hi

    # -- preprocessing ----------------------------------------------------------------------

    def target_size(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) after the smart resize: multiples of patch x 2 within the pixel limits."""
        w, h = smart_size(width, height, self.params.patch_size * MERGE, self.min_pixels, self.max_pixels)
        # a file's huge patch size makes even 8 tokens' pixels a bomb: the decoder's budget holds here too
        if not (0 < w <= MAX_SIDE and 0 < h <= MAX_SIDE) or w * h > MAX_PIXELS:
            raise ImageError(f"a {width}x{height} image would be resized to {w}x{h} for this mmproj, beyond "
                             f"{MAX_SIDE} a side or {MAX_PIXELS // 1_000_000} megapixels")
        return w, h

    def preprocess(self, pixels: np.ndarray) -> np.ndarray:
        """RGB uint8 (h, w, 3) -> normalized float32 on the grid: bicubic, aspect kept, centred
        on black where rounding the sides leaves a margin (libmtmd's PAD_CEIL)."""
        tw, th = self.target_size(pixels.shape[1], pixels.shape[0])
        resized = image_ops.fit_and_pad(pixels, tw, th, "bicubic", (0, 0, 0))
        return image_ops.normalize(resized, self.params.image_mean, self.params.image_std)

    # -- the encoder -------------------------------------------------------------------------

    def encode(self, image) -> ImageChunk:
        """An image_io.Image (or RGB uint8 (h, w, 3) array) -> its chunk, grid = merged (rows, cols)."""
        img = image if isinstance(image, Image) else from_pixels(image)
        emb, grid = self.encode_pixels(self.preprocess(img.pixels))
        if not np.all(np.isfinite(emb)):
            raise ValueError(f"{self.path}: the qwen3vl encoder's output is not finite")
        return ImageChunk(emb, img.digest, grid=grid)

    def encode_pixels(self, x: np.ndarray) -> tuple[np.ndarray, tuple[int, int]]:
        """Normalized (H, W, 3) float32 on the patch x 2 grid -> (embeddings, (rows, cols))."""
        vp, step = self.params, self.params.patch_size * MERGE
        if x.ndim != 3 or x.shape[2] != 3 or not x.shape[0] or not x.shape[1] or x.shape[0] % step or x.shape[1] % step:
            raise ValueError(f"pixels of shape {x.shape} are not on the {step}-pixel grid")
        ph, pw = x.shape[0] // vp.patch_size, x.shape[1] // vp.patch_size
        ops = self.ops
        h = _blocks_of_four(self.patch_embd(x)) + _blocks_of_four(self._positions(ph, pw))
        angles = _angles(ph, pw, vp.head_dim)
        if self.pre_ln:
            h = ops.layer_norm(self.pre_ln, h)
        deep = []
        for i, blk in enumerate(self.blocks):
            h = blk(h, angles, vp)
            if i in self.deepstack:
                deep.append(ops.host(self.deepstack[i](h.reshape(-1, 4 * vp.n_embd))))
        if self.post_ln:
            h = ops.layer_norm(self.post_ln, h)
        out = ops.host(self.merger(h.reshape(-1, 4 * vp.n_embd)))
        out = np.concatenate([out, *deep], axis=1) if deep else out
        return np.ascontiguousarray(out, np.float32), (ph // MERGE, pw // MERGE)

    def _positions(self, ph: int, pw: int) -> np.ndarray:
        """The learned (side, side) table at (ph, pw): ggml_interpolate, bilinear, align corners."""
        t = self.pos_embd
        return t if (ph, pw) == t.shape[:2] else resize_align_corners(t, ph, pw)


def max_patches(mm: MmprojFile) -> int:
    """Patch rows of the largest image it takes: MAX_TOKENS merged tokens of MERGE x MERGE patches."""
    return MAX_TOKENS * MERGE * MERGE


def from_file(mm: MmprojFile) -> Qwen3VLProjector:
    return Qwen3VLProjector(mm)


def _blocks_of_four(grid: np.ndarray) -> np.ndarray:
    """(rows, cols, c) -> (rows * cols, c) in 2x2 blocks: block row, block column, then the
    block's top-left, top-right, bottom-left, bottom-right (four rows = one merged token)."""
    r, c, n = grid.shape
    return grid.reshape(r // 2, 2, c // 2, 2, n).transpose(0, 2, 1, 3, 4).reshape(r * c, n)


def _angles(ph: int, pw: int, d_head: int) -> tuple[np.ndarray, np.ndarray]:
    """The rotary's (cos, sin) of every patch, in the merged 2x2 order: its row, its column."""
    rows = np.broadcast_to(np.arange(ph, dtype=np.int64)[:, None, None], (ph, pw, 1))
    cols = np.broadcast_to(np.arange(pw, dtype=np.int64)[None, :, None], (ph, pw, 1))
    return mrope_vision_angles(_blocks_of_four(np.ascontiguousarray(rows))[:, 0],
                               _blocks_of_four(np.ascontiguousarray(cols))[:, 0], d_head, ROPE_BASE)
