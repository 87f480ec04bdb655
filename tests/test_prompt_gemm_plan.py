"""The cold start's plan of prompt GEMMs comes from matmul_path itself: whichever path a
long prompt takes on this host (the AVX2 GEMMs, or the VNNI tiles on AVX-512 VNNI CPUs)
has its kernels registered and warmed at load, none compiled at the first long prompt."""
import importlib

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from quant_blocks import random_blocks

from edgeinfer import kernels_cpu as K
from edgeinfer.kernels_cpu import compile_progress, tile_gemm

MATVEC = importlib.import_module("edgeinfer.kernels_cpu.matvec")
PLAN = importlib.import_module("edgeinfer.kernels_cpu.prompt_plan")


def test_the_tiles_path_registers_its_kernels(monkeypatch):
    # what a VNNI host's dispatch answers for these types, whatever this host is
    monkeypatch.setattr(MATVEC, "matmul_path", lambda qt, n_rows, n_tok: "tiles")
    monkeypatch.setattr(PLAN, "_PROMPT_GEMMS", [])
    monkeypatch.setattr(compile_progress, "_elsewhere", {})
    kernels = PLAN.use_prompt_gemms([T.Q4_K, T.Q6_K, T.Q8_0])
    assert kernels == [tile_gemm._matmul_rows, tile_gemm._quantize_packed]
    assert PLAN._PROMPT_GEMMS == [("tiles", (int(T.Q8_0), int(T.Q4_K), int(T.Q6_K)), False)]
    jobs = {id(k): job for k, job, _ in compile_progress._elsewhere.values()}
    assert "compile_prompt_gemm('tiles'" in jobs[id(tile_gemm._matmul_rows)]


@pytest.mark.parametrize("qt", [T.Q4_K, T.Q6_K, T.Q8_0, T.Q4_0, T.Q5_0, T.IQ4_XS, T.MXFP4])
def test_every_type_registers_the_path_its_long_prompt_takes(qt, monkeypatch):
    monkeypatch.setattr(PLAN, "_PROMPT_GEMMS", [])
    monkeypatch.setattr(compile_progress, "_elsewhere", {})
    path = MATVEC.matmul_path(qt, 8, MATVEC._INT8_MATMUL_MAX_TOKENS + 1)
    kernels = PLAN.use_prompt_gemms([qt])
    # a GEMM's driver, the tiles, or BLAS on float tiles that the type's kernel set dequantizes
    # (on a VNNI host a 32-element type registers the GEMM its short batches take too)
    assert path in [p for p, _, _ in PLAN._PROMPT_GEMMS] and kernels, path


@pytest.mark.parametrize("qt", [T.Q5_0, T.Q4_K])
def test_warm_up_compiles_the_gemm_a_prompt_calls(qt, monkeypatch):
    """Whatever a long prompt of the type takes here (the VNNI tiles, gemm_q32 or gemm_kquant,
    32 rows a step on 512-bit VNNI hosts), its kernels are compiled by the warm-up."""
    monkeypatch.setattr(PLAN, "_PROMPT_GEMMS", [])
    kernels = PLAN.use_prompt_gemms([qt])
    PLAN.warm_prompt_gemms()
    compiled = [k for k in kernels if hasattr(k, "signatures")]
    before = [len(k.signatures) for k in compiled]
    assert compiled and min(before) >= 1, (MATVEC.matmul_path(qt, 64, 200), kernels)
    rng = np.random.default_rng(3)
    w = random_blocks(qt, 64, 512, rng)
    w.flags.writeable = False
    K.matmul(w, qt, rng.standard_normal((200, 512)).astype(np.float32))
    assert [len(k.signatures) for k in compiled] == before
