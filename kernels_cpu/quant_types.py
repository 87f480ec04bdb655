"""GGML tensor types the CPU kernels read directly: block geometry and validation."""
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


_ACT = {
    T.F32: 0, T.F16: 0, T.BF16: 0,
    T.Q4_0: 32, T.Q4_1: 32, T.Q5_0: 32, T.Q5_1: 32, T.Q8_0: 32, T.IQ4_NL: 32,
    T.Q2_K: 256, T.Q3_K: 256, T.Q4_K: 256, T.Q5_K: 256, T.Q6_K: 256, T.IQ4_XS: 256,
}

QUANT_INFO: dict[T, QuantInfo] = {
    t: QuantInfo(t, GGML_QUANT_SIZES[t][0], GGML_QUANT_SIZES[t][1], a) for t, a in _ACT.items()
}


class RepackedType(IntEnum):
    """Layouts the CPU backend copies weights into at load (not GGML types; repack.py)."""
    Q4_K_X8 = _Q4_K_X8_ID   # Q4_K, rows interleaved in eights


# same blocks as Q4_K, only placed differently
QUANT_INFO[RepackedType.Q4_K_X8] = QuantInfo(RepackedType.Q4_K_X8, 256, 144, 256)


def supported_types() -> tuple[T, ...]:
    """The GGML types matvec / matmul / get_rows accept (and repacked layouts, not listed)."""
    return tuple(t for t in QUANT_INFO if isinstance(t, T))


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


def n_cols_of(qtype: T | int, w_raw: np.ndarray) -> int:
    """Elements per row of a raw weight array of shape (n_rows, row_bytes)."""
    info = quant_info(qtype)
    return w_raw.shape[1] // info.type_size * info.block_size


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
