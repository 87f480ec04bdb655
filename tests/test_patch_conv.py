"""edgeinfer.vision.patch_conv against ggml's own F16 x F16 product, run through the oracle's
library (tests/ggml_lib.py): libmtmd's patch embedding is ggml_conv_2d, an F16 im2col times
the kernel in F16. Where a patch's length is a multiple of the vector (768: 16-pixel
patches) and the patch count a multiple of 4, ggml takes tinyBLAS, else ggml_vec_dot_f16
(588: SigLIP's 14-pixel patches; 37 or 81 patches; a length with leftovers past the last
full step). Equal bit for bit: a BLAS order here moved
a Q8_0 mmproj's embeddings by 5.9e-3 against libmtmd (one 8-bit rounding downstream)."""
from __future__ import annotations

import ctypes

import ggml_flash_oracle as gfo
import numpy as np
import pytest
from ggml_lib import oracle_ggml

from edgeinfer.vision.patch_conv import PatchKernel

_P = ctypes.c_void_p
_F16 = 1   # GGML_TYPE_F16


def _ggml_f16_product(rows: np.ndarray, kernel: np.ndarray) -> np.ndarray:
    """ggml_mul_mat(im2col rows (n, k) F16, kernel (e, k) F16) -> (n, e), as ggml_conv_2d."""
    return gfo.mul_mat(oracle_ggml(), rows.astype(np.float16), kernel.astype(np.float16), _F16).T


@pytest.mark.parametrize("k", [768, 588, 36, 100])
@pytest.mark.parametrize("n", [36, 37, 81, 2])   # tinyBLAS takes 36 x 768 and 36 x 36 only
def test_patch_products_are_ggml_s(k, n):
    rng = np.random.default_rng(k + n)
    rows = rng.uniform(-2, 2, (n, k)).astype(np.float16).astype(np.float32)   # im2col: F16 values
    kernel = (rng.standard_normal((24, k)) * 0.05).astype(np.float32)           # rounded to F16 by both
    want = _ggml_f16_product(rows, kernel)
    got = PatchKernel(kernel)(rows)
    np.testing.assert_array_equal(got, want)
