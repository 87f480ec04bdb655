"""The quant-type registry (kernels_cpu/quant_types.py) and the kernels, loader and CUDA launcher agree."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

import edgeinfer.kernels_cpu as K
from edgeinfer.kernels_cpu import dispatch, quant_types, tile_gemm
from edgeinfer.kernels_cpu.quant_types import QUANT_INFO, RepackedType
from edgeinfer.kernels_cuda import launch
from edgeinfer.loader import SUPPORTED_TYPES
from quant_blocks import random_blocks

ROOT = Path(__file__).resolve().parent.parent
LOADABLE = [t for t in T if quant_types.is_supported(t)]


def test_the_loader_accepts_exactly_the_registry_s_ggml_types():
    assert set(LOADABLE) == set(quant_types.supported_types()) == set(K.supported_types()) == SUPPORTED_TYPES
    assert not quant_types.is_supported(T.TQ2_0)
    assert not quant_types.is_supported(RepackedType.Q4_K_X8)     # a layout the backend makes, not a file type
    assert not quant_types.is_supported(int(T.Q4_K))               # an id is not a type


@pytest.mark.parametrize("qtype", LOADABLE, ids=lambda t: t.name)
def test_every_loadable_type_has_a_reference_dequant_and_a_cpu_decode_and_prefill_path(qtype):
    info = QUANT_INFO[qtype]
    assert (info.block_size, info.type_size) == GGML_QUANT_SIZES[qtype]
    assert info.act_block == (0 if info.block_size == 1 else info.block_size)
    n_cols = 256
    w = random_blocks(qtype, 5, n_cols, np.random.default_rng(0))
    W = quant_types.reference_dequantize(w, qtype)                # gguf.quants (or a plain view)
    assert W.shape == (5, n_cols) and W.dtype == np.float32 and np.isfinite(W).all()
    x = np.random.default_rng(1).standard_normal(n_cols).astype(np.float32)
    y = K.matvec(w, qtype, x)                                      # decode
    assert np.allclose(y, W.astype(np.float64) @ x, rtol=0.05, atol=0.05 * np.abs(W).sum(axis=1).max())
    np.testing.assert_allclose(K.dequantize_rows(w, qtype, n_cols, 0, 5), W, rtol=1e-6, atol=1e-6 * np.abs(W).max())
    assert dispatch.has_fast_path(int(qtype)) == info.fast


def test_the_fast_kernels_dispatch_exactly_the_registry_s_fast_types():
    assert set(dispatch._TYPE_NAMES) == quant_types.FAST_IDS
    for qt, name in dispatch._TYPE_NAMES.items():
        assert QUANT_INFO[qt].qtype.name == name
    assert RepackedType.Q4_K_X8 in quant_types.FAST_IDS
    assert {int(t) for t in quant_types.fast_types()} == quant_types.FAST_IDS - {int(RepackedType.Q4_K_X8)}


def test_the_prefill_tiles_take_the_registry_s_tile_types():
    assert set(tile_gemm.TILE_TYPES) == {int(t) for t in quant_types.tile_types()}
    assert set(tile_gemm.TILE_LAYOUTS) == quant_types.TILE_IDS
    assert quant_types.TILE_IDS <= quant_types.FAST_IDS


def test_the_cuda_kernels_exist_for_the_registry_s_cuda_types():
    assert launch.QTYPE_SUFFIX == quant_types.cuda_types()
    source = (ROOT / "kernels_cuda" / "quant.cu").read_text()
    entries = set(re.findall(r"^EI_ENTRY\((\w+),", source, re.M))
    deqs = set(re.findall(r"^EI_DEQ\((\w+),", source, re.M))
    for qtype, suffix in launch.QTYPE_SUFFIX.items():
        assert quant_types.is_supported(qtype)
        assert suffix in entries and suffix in deqs, suffix
        assert launch.supports(qtype, 256)
    assert not launch.supports(T.IQ4_XS, 256)
