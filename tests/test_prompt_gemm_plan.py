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


@pytest.mark.skipif(not tile_gemm.has_vnni(), reason="the VNNI tiles serve prompts only on CPUs with AVX-512 VNNI")
def test_warm_up_compiles_the_tiles_a_prompt_calls(monkeypatch):
    monkeypatch.setattr(PLAN, "_PROMPT_GEMMS", [])
    PLAN.use_prompt_gemms([T.Q5_0])
    PLAN.warm_prompt_gemms()
    before = (len(tile_gemm._matmul_rows.signatures), len(tile_gemm._quantize_packed.signatures))
    assert min(before) >= 1
    rng = np.random.default_rng(3)
    w = random_blocks(T.Q5_0, 64, 512, rng)
    w.flags.writeable = False
    K.matmul(w, T.Q5_0, rng.standard_normal((200, 512)).astype(np.float32))   # tiles: Q5_0's long prompts
    assert (len(tile_gemm._matmul_rows.signatures), len(tile_gemm._quantize_packed.signatures)) == before
