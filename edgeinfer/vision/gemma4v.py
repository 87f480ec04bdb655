"""Gemma 4's vision projector (gemma4v): dynamic-size preprocessing, the tower, k x k average pooling, RMS norm, projection.

As libmtmd's PROJECTOR_TYPE_GEMMA4V (models/gemma4v.cpp; clip.cpp; mtmd-image.cpp's dyn_size):
- the image keeps its aspect ratio: its sides are rounded to multiples of patch x merge and
  its area held within 70 .. 1120 tokens' worth (libmtmd's calc_size_preserved_ratio, in
  float32), then resized there (bicubic, Pillow's arithmetic, centred on black where rounding
  leaves a margin) and normalized with image_mean/std;
- the tower (gemma4v_encoder.py) gives one row a patch;
- the patch grid is average-pooled over merge x merge blocks (clip.vision.projector.scale_factor,
  3 when absent), times sqrt(n_embd); minus v.std_bias, times v.std_scale when both are present;
- RMS norm without a weight, then mm.input_projection.weight (Gemma4ClippableLinear) to the
  text model's width.
On the text side libmtmd wraps the tokens in <|image> ... <image|>; they attend to each other
both ways except on E2B and E4B (text widths 1536 and 2560), which stay causal.
"""
from __future__ import annotations

import numpy as np

from edgeinfer.metadata import MAX_EMBD
from edgeinfer.vision import image_ops
from edgeinfer.vision.chunk import ImageChunk
from edgeinfer.vision.gemma4v_encoder import ClampedLinear, Gemma4VisionTower
from edgeinfer.vision.image_io import Image, from_pixels
from edgeinfer.vision.mmproj import MmprojFile
from edgeinfer.vision.qwen_resize import smart_size
from edgeinfer.vision.vit import rms_norm

DEFAULT_MERGE = 3                  # Gemma 4's pooling_kernel_size
MIN_TOKENS, MAX_TOKENS = 70, 1120  # libmtmd's set_limit_image_tokens(70, 1120) for gemma4v
CAUSAL_TEXT_WIDTHS = (1536, 2560)  # E2B, E4B: mtmd_decode_use_non_causal says causal
MAX_SIDE = 65536                   # libmtmd's largest resize target
_ONE = np.float32(1.0)


def max_patches(mm: MmprojFile) -> int:
    """Patch rows of the largest image it takes: MAX_TOKENS tokens of merge x merge patches."""
    merge = mm.pooling_merge(DEFAULT_MERGE)
    return MAX_TOKENS * merge * merge


class Gemma4VProjector:
    """A checked gemma4v mmproj: images in, (tokens, text width) embeddings out."""
    projector_type = "gemma4v"

    def __init__(self, mm: MmprojFile) -> None:
        vp = self.params = mm.vision
        self.path = mm.path
        e = vp.n_embd
        self.merge = mm.pooling_merge(DEFAULT_MERGE)
        self.tower = Gemma4VisionTower(mm)
        self.ops = mm.ops   # where the tower's matrices and attention run (edgeinfer.vision.encoder_ops)
        bias = mm.vector("v.std_bias", e, required=False)
        scale = mm.vector("v.std_scale", e, required=False)
        self.std = (bias, scale) if bias is not None and scale is not None else None  # libmtmd: both or neither
        proj = mm.gguf.tensors.get("mm.input_projection.weight")
        n_out = int(proj.shape[1]) if proj is not None and len(proj.shape) >= 2 else 0
        if not 1 <= n_out <= MAX_EMBD:
            raise mm.fail("tensor 'mm.input_projection.weight' must be (vision width, text width): "
                          f"got {None if proj is None else list(proj.shape)}")
        if vp.projection_dim and vp.projection_dim != n_out:
            raise mm.fail(f"mm.input_projection.weight projects to {n_out}, but clip.vision.projection_dim "
                          f"is {vp.projection_dim}")
        self.proj = ClampedLinear(mm, "mm.input_projection", e, n_out, bias=False)
        self.n_embd = n_out
        self.non_causal = n_out not in CAUSAL_TEXT_WIDTHS
        self.set_token_limits()

    def set_token_limits(self, min_tokens: int = 0, max_tokens: int = 0) -> None:
        """Tokens an image is resized to at least / at most; 0 keeps libmtmd's 70 / 1120
        (mtmd's image_min_tokens / image_max_tokens replace them the same way)."""
        if min_tokens < 0 or max_tokens < 0:
            raise ValueError("image token limits must not be negative")
        area = (self.params.patch_size * self.merge) ** 2
        lo, hi = (min_tokens or MIN_TOKENS) * area, (max_tokens or MAX_TOKENS) * area
        if hi < lo:
            raise ValueError(f"at most {hi} pixels is less than at least {lo}")
        self.min_pixels, self.max_pixels = lo, hi

    def target_size(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) the image is resized to: multiples of patch x merge within the limits."""
        w, h = smart_size(width, height, self.params.patch_size * self.merge, self.min_pixels, self.max_pixels)
        if not (0 < w <= MAX_SIDE and 0 < h <= MAX_SIDE):
            raise ValueError(f"a {width}x{height} image would be resized to {w}x{h}, beyond {MAX_SIDE} a side")
        return w, h

    def preprocess(self, pixels: np.ndarray) -> np.ndarray:
        """RGB uint8 (h, w, 3) -> normalized float32 (H, W, 3) on the patch x merge grid."""
        tw, th = self.target_size(pixels.shape[1], pixels.shape[0])
        resized = image_ops.fit_and_pad(pixels, tw, th, "bicubic", (0, 0, 0))
        return image_ops.normalize(resized, self.params.image_mean, self.params.image_std)

    def pool(self, h: np.ndarray, ph: int, pw: int) -> np.ndarray:
        """(ph * pw, e) -> ((ph/k) * (pw/k), e): each k x k block's mean, summed in float32 in
        ggml_pool_2d's order (the block's rows, then its columns) and divided by k * k."""
        k, e = self.merge, h.shape[1]
        g = h.reshape(ph // k, k, pw // k, k, e)
        acc = np.zeros((ph // k, pw // k, e), np.float32)
        for ky in range(k):
            for kx in range(k):
                acc += g[:, ky, :, kx, :]
        return (acc / np.float32(k * k)).reshape(-1, e)

    def encode_pixels(self, x: np.ndarray) -> np.ndarray:
        """Normalized (H, W, 3) float32 on the patch x merge grid -> (tokens, n_embd)."""
        step = self.params.patch_size * self.merge
        if x.ndim != 3 or x.shape[2] != 3 or not x.shape[0] or not x.shape[1] or x.shape[0] % step or x.shape[1] % step:
            raise ValueError(f"pixels of shape {x.shape} are not on the {step}-pixel grid")
        h, ph, pw = self.tower(x)
        t = self.pool(h, ph, pw) * np.sqrt(np.float32(self.params.n_embd))
        if self.std is not None:
            t = (t - self.std[0]) * self.std[1]
        t = rms_norm(t, _ONE, self.params.eps)
        return np.ascontiguousarray(self.ops.host(self.proj(t)), np.float32)

    def encode(self, image: Image | np.ndarray) -> ImageChunk:
        img = image if isinstance(image, Image) else from_pixels(image)
        emb = self.encode_pixels(self.preprocess(img.pixels))
        if not np.all(np.isfinite(emb)):
            raise ValueError(f"{self.path}: the gemma4v encoder's output is not finite")
        return ImageChunk(embeddings=emb, digest=img.digest, non_causal=self.non_causal)


def from_file(mm: MmprojFile) -> Gemma4VProjector:
    return Gemma4VProjector(mm)
