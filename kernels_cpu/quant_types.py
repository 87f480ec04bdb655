"""The quant-type registry: each tensor type's geometry, reference dequantization and kernels.

One row per type: block size and type size (gguf's GGML_QUANT_SIZES), the 8-bit
activation block the CPU decode dots with, whether the IR kernels (dispatch.py) and the
8-bit prefill tiles (tile_gemm.py) take it, and its CUDA kernels' suffix in
kernels_cuda/quant.cu. Every GGML type listed runs on the CPU: decode through the IR
kernels where `fast`, else the plain Numba or float kernels; prefill through dequantize +
BLAS, or the tiles where `tile`. The CPU kernels and the CUDA launcher read this
registry; the loader keeps a copy of `supported_types()` (importing this package loads
Numba), which tests/test_quant_types.py holds equal.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from edgeinfer.errors import UnsupportedModelError

from .quant_kernels import Q4_K_X8 as _Q4_K_X8_ID


@dataclass(frozen=True)
class QuantInfo:
    qtype: "T | RepackedType"
    block_size: int   # elements per block
    type_size: int    # bytes per block
    act_block: int    # block of the 8-bit activation it dots with: 32 (Q8_0) or 256 (Q8_K); 0 = float path
    fast: bool = False   # IR row dots and dequantization (dispatch.py)
    tile: bool = False   # 8-bit prefill tiles on VNNI CPUs (tile_gemm.py)
    cuda: str = ""       # kernel suffix in kernels_cuda/quant.cu (matvec_<s>, gemm_<s>, dequant_<s>); "" = none


class RepackedType(IntEnum):
    """Layouts the CPU backend copies weights into at load (not GGML types; repack.py)."""
    Q4_K_X8 = _Q4_K_X8_ID   # Q4_K, rows interleaved in eights


#         type      act  fast   tile   cuda
_TABLE = (
    (T.F32,       0, False, False, "f32"),
    (T.F16,       0, False, False, "f16"),
    (T.BF16,      0, False, False, ""),
    (T.Q4_0,     32, True,  True,  "q4_0"),
    (T.Q4_1,     32, True,  False, "q4_1"),
    (T.Q5_0,     32, True,  True,  "q5_0"),
    (T.Q5_1,     32, True,  False, "q5_1"),
    (T.Q8_0,     32, True,  True,  "q8_0"),
    (T.IQ4_NL,   32, True,  False, ""),
    (T.MXFP4,    32, True,  False, "mxfp4"),
    (T.Q2_K,    256, True,  False, ""),
    (T.Q3_K,    256, True,  False, ""),
    (T.Q4_K,    256, True,  True,  "q4_k"),
    (T.Q5_K,    256, True,  False, "q5_k"),
    (T.Q6_K,    256, True,  True,  "q6_k"),
    (T.IQ4_XS,  256, True,  False, ""),
    (T.IQ2_XXS, 256, True,  False, "iq2_xxs"),
    (T.IQ2_XS,  256, True,  False, "iq2_xs"),
    (T.IQ2_S,   256, True,  False, "iq2_s"),
    (T.IQ3_XXS, 256, True,  False, "iq3_xxs"),
    (T.IQ3_S,   256, True,  False, "iq3_s"),
    (T.IQ1_S,   256, True,  False, "iq1_s"),
    (T.IQ1_M,   256, True,  False, "iq1_m"),
)

QUANT_INFO: dict = {
    t: QuantInfo(t, GGML_QUANT_SIZES[t][0], GGML_QUANT_SIZES[t][1], act, fast, tile, cuda)
    for t, act, fast, tile, cuda in _TABLE
}
# same blocks as Q4_K, only placed differently
QUANT_INFO[RepackedType.Q4_K_X8] = QuantInfo(RepackedType.Q4_K_X8, 256, 144, 256, fast=True, tile=True)

# the registry's answers as sets of plain ints, for checks on every call
FAST_IDS = frozenset(int(t) for t, i in QUANT_INFO.items() if i.fast)
TILE_IDS = frozenset(int(t) for t, i in QUANT_INFO.items() if i.tile)


def supported_types() -> tuple[T, ...]:
    """The GGML types the loader accepts and the CPU kernels run (matvec / matmul / get_rows)."""
    return tuple(t for t in QUANT_INFO if isinstance(t, T))


def is_supported(qtype) -> bool:
    """Whether a model may hold tensors of this GGML type."""
    return isinstance(qtype, T) and qtype in QUANT_INFO


def fast_types() -> tuple[T, ...]:
    """The GGML types the IR kernels (dispatch.py) compute on."""
    return tuple(t for t in supported_types() if QUANT_INFO[t].fast)


def tile_types() -> tuple[T, ...]:
    """The GGML types the 8-bit prefill tiles (tile_gemm.py) compute on."""
    return tuple(t for t in supported_types() if QUANT_INFO[t].tile)


def cuda_types() -> dict:
    """GGML type -> its CUDA kernels' suffix, for the types kernels_cuda computes on."""
    return {t: QUANT_INFO[t].cuda for t in supported_types() if QUANT_INFO[t].cuda}


def quant_info(qtype: T | int) -> QuantInfo:
    try:
        info = QUANT_INFO.get(qtype)  # IntEnum keys match plain ints: no enum call per matvec
        return info if info is not None else QUANT_INFO[T(int(qtype))]
    except (KeyError, ValueError, TypeError):
        name = getattr(qtype, "name", str(qtype))
        raise UnsupportedModelError(f"tensor type {name} is not supported by the CPU kernels") from None


def row_bytes(qtype: T | int, n_cols: int) -> int:
    """Bytes of one row of `n_cols` elements."""
    info = quant_info(qtype)
    if n_cols % info.block_size:
        raise UnsupportedModelError(
            f"row of {n_cols} elements is not a multiple of the {info.qtype.name} block size {info.block_size}")
    return n_cols // info.block_size * info.type_size


def reference_dequantize(w_raw: np.ndarray, qtype: T) -> np.ndarray:
    """(n_rows, row_bytes) raw -> (n_rows, n_cols) float32 through gguf.quants (tests and
    debugging: slow)."""
    from gguf.quants import dequantize

    info = quant_info(qtype)
    if not isinstance(info.qtype, T):
        raise ValueError(f"{info.qtype.name} is a repacked layout: no reference dequantization")
    if info.qtype == T.F32:
        return w_raw.view(np.float32).copy()
    if info.qtype == T.F16:
        return w_raw.view(np.float16).astype(np.float32)
    return np.asarray(dequantize(w_raw, info.qtype), dtype=np.float32).reshape(w_raw.shape[0], -1)


def check_weight(w_raw: np.ndarray, qtype: T | int) -> QuantInfo:
    """Validate a raw weight array; return its QuantInfo."""
    info = quant_info(qtype)
    if w_raw.dtype != np.uint8 or w_raw.ndim != 2 or not w_raw.flags.c_contiguous:
        raise ValueError(f"raw weights must be a C-contiguous uint8 (n_rows, row_bytes) array, got "
                         f"{w_raw.dtype} {w_raw.shape}")
    if info.qtype == RepackedType.Q4_K_X8 and w_raw.shape[0] % 8:
        raise ValueError(f"a Q4_K_X8 matrix has rows in groups of 8, got {w_raw.shape[0]} rows")
    if w_raw.shape[1] % info.type_size:
        raise UnsupportedModelError(
            f"{w_raw.shape[1]} bytes per row is not a multiple of the {info.qtype.name} block ({info.type_size} bytes)")
    return info
