"""The oracle's own compiled ggml (the libraries llama-cpp-python ships), called through ctypes:
a type's to_float, Q8_0 activation quantization and vec_dot, so a kernel can be held to the
code llama.cpp runs, compiler's choices included (the numpy references re-derive the order
from the source and cannot see, say, whether a multiply-add was contracted to an fma).

Structs as ggml.h / ggml-cpu.h of the pinned llama.cpp declare them."""
from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest
from llama_oracle import importorskip_oracle

_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)   # to_float, from_float
_VEC_DOT = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                            ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


class _Traits(ctypes.Structure):      # struct ggml_type_traits
    _fields_ = [("type_name", ctypes.c_char_p), ("blck_size", ctypes.c_int64), ("blck_size_interleave", ctypes.c_int64),
                ("type_size", ctypes.c_size_t), ("is_quantized", ctypes.c_bool), ("to_float", _FN),
                ("from_float_ref", _FN)]


class _CpuTraits(ctypes.Structure):   # struct ggml_type_traits_cpu
    _fields_ = [("from_float", _FN), ("vec_dot", _VEC_DOT), ("vec_dot_type", ctypes.c_int), ("nrows", ctypes.c_int64)]


class Ggml:
    def __init__(self, lib_dir: str) -> None:
        self.base = ctypes.CDLL(os.path.join(lib_dir, "libggml-base.so"))
        self.cpu = ctypes.CDLL(os.path.join(lib_dir, "libggml-cpu.so"))
        self.base.ggml_get_type_traits.restype = ctypes.POINTER(_Traits)
        self.cpu.ggml_get_type_traits_cpu.restype = ctypes.POINTER(_CpuTraits)
        self.cpu.ggml_cpu_init()   # its fp16 tables

    def has_avx2(self) -> bool:
        return bool(self.cpu.ggml_cpu_has_avx2())

    def to_float(self, qtype: int, w_raw: np.ndarray, n_cols: int) -> np.ndarray:
        """(n_rows, row_bytes) blocks -> float32 (n_rows, n_cols), as ggml dequantizes."""
        w = np.ascontiguousarray(w_raw, np.uint8)
        out = np.empty((w.shape[0], n_cols), np.float32)
        self.base.ggml_get_type_traits(qtype).contents.to_float(w.ctypes.data, out.ctypes.data, out.size)
        return out

    def vec_dot_rows(self, qtype: int, w_raw: np.ndarray, x: np.ndarray) -> np.ndarray:
        """Each row . x as ggml's CPU matmul computes it per row: x quantized to the type's
        vec_dot_type, then vec_dot (one row at a time)."""
        traits = self.cpu.ggml_get_type_traits_cpu(qtype).contents
        x = np.ascontiguousarray(x, np.float32)
        act = self.base.ggml_get_type_traits(traits.vec_dot_type).contents
        xq = np.empty(x.size // act.blck_size * act.type_size, np.uint8)
        self.cpu.ggml_get_type_traits_cpu(traits.vec_dot_type).contents.from_float(x.ctypes.data, xq.ctypes.data,
                                                                                    x.size)
        out = np.empty(w_raw.shape[0], np.float32)
        s = ctypes.c_float()
        for r in range(w_raw.shape[0]):
            row = np.ascontiguousarray(w_raw[r], np.uint8)
            traits.vec_dot(x.size, ctypes.addressof(s), 0, row.ctypes.data, 0, xq.ctypes.data, 0, 1)
            out[r] = s.value
        return out


def oracle_ggml() -> Ggml:
    """The oracle's ggml, or skip where llama_cpp (or its bundled libraries) is missing."""
    llama_cpp = importorskip_oracle()
    lib_dir = os.path.join(os.path.dirname(llama_cpp.__file__), "lib")
    if not os.path.exists(os.path.join(lib_dir, "libggml-cpu.so")):
        pytest.skip(f"no libggml-cpu.so in {lib_dir}")
    return Ggml(lib_dir)


def our_mul_mat(kernels, w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """ggml_mul_mat(w, x)'s counterpart (n, rows) in a kernels_cpu module with matvec(w, x,
    out) and matmul(w, X, out) in ggml's orders (f32_ggml, bf16_ggml): matvec for one token,
    as ggml's vec_dot path, matmul for more."""
    out = np.empty((x.shape[0], w.shape[0]), np.float32)
    if x.shape[0] == 1:
        kernels.matvec(w, x[0], out[0])
    else:
        kernels.matmul(w, x, out)
    return out
