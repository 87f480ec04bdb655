"""Gemma 3's vision projector: fit-and-pad preprocessing, SigLIP, avg pool, soft-embedding norm, projection.

As libmtmd's PROJECTOR_TYPE_GEMMA3: the image is scaled (bilinear, aspect kept, sides rounded
up) into an image_size square padded with black, normalized with clip.vision.image_mean/std,
encoded by the ViT, average-pooled over merge x merge patches (clip.vision.projector.scale_factor,
4 when absent), RMS-normed with mm.soft_emb_norm and multiplied by mm.input_projection. The text
side wraps the tokens in <start_of_image> ... <end_of_image> and lets them attend both ways.
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T

from edgeinfer.vision import image_ops
from edgeinfer.vision.chunk import ImageChunk
from edgeinfer.vision.image_io import Image, from_pixels
from edgeinfer.vision.mmproj import MmprojFile
from edgeinfer.vision.vit import ViT, rms_norm

DEFAULT_MERGE = 4  # Gemma 3's pooling: 64 x 64 patches -> 16 x 16 tokens


class Gemma3Projector:
    projector_type = "gemma3"

    def __init__(self, mm: MmprojFile) -> None:
        vp = mm.vision
        if vp.image_size % vp.patch_size:
            raise mm.fail(f"clip.vision.image_size {vp.image_size} is not a multiple of "
                          f"clip.vision.patch_size {vp.patch_size}")
        side = vp.image_size // vp.patch_size
        self.merge = merge = mm.pooling_merge(DEFAULT_MERGE)
        if side % merge:
            raise mm.fail(f"{side} patches a side do not pool evenly by "
                          f"clip.vision.projector.scale_factor {merge}")
        self.params = vp
        self.vit = ViT(mm)
        self.ops = mm.ops   # where the ViT runs (edgeinfer.vision.encoder_ops)
        self.soft_emb_norm = mm.vector("mm.soft_emb_norm.weight", vp.n_embd)
        # stored (n_embd_text, n_embd_vision) in GGML order; libmtmd multiplies by its transpose,
        # which ggml can only form from float tensors
        proj = mm.gguf.tensors.get("mm.input_projection.weight")
        if proj is None:
            raise mm.fail("missing tensor 'mm.input_projection.weight' (gemma3 projector)")
        n_embd_text = proj.shape[0]
        mm.tensor(proj.name, (n_embd_text, vp.n_embd), (T.F32, T.F16))
        if vp.projection_dim and vp.projection_dim != n_embd_text:
            raise mm.fail(f"mm.input_projection.weight projects to {n_embd_text}, but "
                          f"clip.vision.projection_dim is {vp.projection_dim}")
        self.proj_qtype = proj.qtype
        self.proj = np.asarray(mm.gguf.array(proj.name), np.float32)  # (n_embd_vision, n_embd_text)
        self.n_embd = int(n_embd_text)
        self.n_tokens = (side // merge) ** 2

    def preprocess(self, pixels: np.ndarray) -> np.ndarray:
        """RGB uint8 (h, w, 3) -> the normalized float32 (image_size, image_size, 3) the ViT sees."""
        size = self.params.image_size
        square = image_ops.fit_and_pad(pixels, size, size, "bilinear")
        return image_ops.normalize(square, self.params.image_mean, self.params.image_std)

    def pool(self, h: np.ndarray) -> np.ndarray:
        """(side*side, e) -> ((side/k)^2, e): the mean of each k x k block, summed in float32 in
        ggml's order (row by row) and divided by k*k."""
        k, e = self.merge, h.shape[1]
        side = int(round(np.sqrt(h.shape[0])))
        g = h.reshape(side // k, k, side // k, k, e)
        acc = np.zeros((side // k, side // k, e), np.float32)
        for ky in range(k):
            for kx in range(k):
                acc += g[:, ky, :, kx, :]
        return (acc / np.float32(k * k)).reshape(-1, e)

    def encode(self, image: Image | np.ndarray) -> ImageChunk:
        img = image if isinstance(image, Image) else from_pixels(image)
        h = self.vit(self.preprocess(img.pixels))
        x = rms_norm(self.pool(h), self.soft_emb_norm, self.params.eps)
        if self.proj_qtype == T.F16:
            x = x.astype(np.float16).astype(np.float32)  # ggml's F16 matmul takes F16 inputs
        out = (x @ self.proj).astype(np.float32)
        return ImageChunk(embeddings=out, digest=img.digest, non_causal=True)


def max_patches(mm: MmprojFile) -> int:
    """Patch rows of every image: the ViT's fixed square."""
    vp = mm.vision
    return (vp.image_size // vp.patch_size) ** 2


def from_file(mm: MmprojFile) -> Gemma3Projector:
    return Gemma3Projector(mm)
