"""The patch embedding's product as ggml computes it: libmtmd's ggml_conv_2d unfolds the image
into F16 patches (im2col) and multiplies them by the kernel rounded to F16 (src0 the patches,
src1 the kernel). ggml hands that F16 x F16 product to tinyBLAS where a patch's length is a
multiple of its vector (8 floats, 16 with AVX-512) and the patch count a multiple of 4 (its
tiles), else to ggml_vec_dot_f16 per output (SigLIP's 14-pixel patches: 588 values; a 9 x 9
patch grid). The F16 values widen exactly, so tinyBLAS's chain is f32_ggml's, and
vec_dot_f16's is f32_ggml.vec_dot_f16_tokens. Held to those
bits, a Q8_0 mmproj's embeddings equal libmtmd's on the test images; a BLAS order here had
moved one 8-bit activation of a later product a whole quantum (5.9e-3)."""
from __future__ import annotations

import numpy as np

from edgeinfer.kernels_cpu import f32_ggml

class PatchKernel:
    """A conv kernel (n_embd, values a patch), kept as its F16 values in float32."""

    def __init__(self, kernel: np.ndarray) -> None:
        with np.errstate(over="ignore"):
            self.w = np.ascontiguousarray(np.asarray(kernel).astype(np.float16).astype(np.float32))

    @property
    def n_out(self) -> int:
        return self.w.shape[0]

    def __call__(self, patches: np.ndarray) -> np.ndarray:
        """patches (n, values a patch), already rounded to F16 (ggml's im2col) -> (n, n_embd)."""
        patches = np.ascontiguousarray(patches, np.float32)
        n, k = patches.shape
        out = np.empty((n, self.w.shape[0]), np.float32)
        if f32_ggml.tinyblas_takes(n, self.w.shape[0], k):   # src0 is the patches
            return f32_ggml.sgemm(self.w, patches, out)
        f32_ggml.vec_dot_f16_tokens(self.w, patches, out, f32_ggml.host_lanes())
        return out
