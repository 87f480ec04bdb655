"""The i-quants (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S) in VRAM: quant.cu's
kernels against kernels_cpu.iquant_ref (ggml's dequantize_row_*, which tests/test_iquants.py
holds to ggml itself), on the GPU or the CUDA emulator (each launch in both orders).

- the CUDA tables are kernels_cpu/iq_tables.py's numbers (generated from them, read back here);
- dequant_<type>: the reference's bits, every grid entry reached, zero / infinite / NaN scales;
- matvec (decode) and the 8-bit prompt GEMM: near the float64 product of the reference
  dequantization, to test_cuda_kernels' tolerances; the fused launches give the matvec's bits;
- expert tensors through matvec_id / gemm_id, and a MoE model whose experts are i-quants
  through the hybrid backend's GPU expert path;
- a tiny llama whose matrices are all i-quants, GPU layers against the CPU reference.
The generic per-type tests of test_cuda_kernels.py and test_cuda_compile.py (the registry's
CUDA types) take these types too.
"""

from __future__ import annotations

import re

import cuda_device
import numpy as np
import pytest
from cuda_device import gpuarray
from gguf import GGMLQuantizationType as Q
from gguf_factory import TinyShape, bpe_vocab, write_tiny_model
from q8_reference import Q8PromptReference
from quant_blocks import random_blocks
from test_cuda_kernels import _compare, _gemm_tol, _groups, _logits, _rel

from edgeinfer.backends.base import ReferenceBackend
from edgeinfer.backends.hybrid import HybridBackend
from edgeinfer.backends.offload import OffloadPlan
from edgeinfer.kernels_cpu import iq_tables, iquant_ref
from edgeinfer.kernels_cuda import launch, runtime
from edgeinfer.kernels_cuda.generated import iq_tables_cuh, source_text
from edgeinfer.kv.contiguous import KVCache
from edgeinfer.loader import open_model

cuda_device.require()

pytestmark = pytest.mark.usefixtures("gpu_both_orders")

IQ_TYPES = (Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.IQ1_S, Q.IQ1_M)
GRID_SIZE = {Q.IQ2_XXS: 256, Q.IQ2_XS: 512, Q.IQ2_S: 1024, Q.IQ3_XXS: 256, Q.IQ3_S: 512, Q.IQ1_S: 2048,
             Q.IQ1_M: 2048}
_ids = {"ids": lambda t: t.name}


def _weights(qtype: Q, n_rows: int, n_cols: int, seed: int):
    """Random valid blocks (scales of both signs) and the reference's float32 dequantization."""
    raw = random_blocks(qtype, n_rows, n_cols, np.random.default_rng(seed))
    return raw, iquant_ref.dequantize(int(qtype), raw)


def _set_scale(qtype: Q, raw: np.ndarray, block: int, value: float) -> None:
    """Block `block` (in row-major order) of raw gets the fp16 scale `value`."""
    bpb = iquant_ref.BLOCK_BYTES[int(qtype)]
    b = raw.reshape(-1, bpb)[block]
    bits = int(np.array([value], np.float16).view("<u2")[0])
    if qtype == Q.IQ1_M:  # the scale's 4 nibbles are the top nibbles of the 4 scale words
        words = b[48:56].view("<u2")
        for k in range(4):
            words[k] = (words[k] & 0x0FFF) | (((bits >> (4 * k)) & 15) << 12)
    else:
        b[0:2] = np.array([bits], "<u2").view(np.uint8)


def test_the_registry_gives_every_iquant_its_kernels():
    for qtype in IQ_TYPES:
        s = launch.QTYPE_SUFFIX[qtype]
        assert s == qtype.name.lower() and launch.supports(qtype, 256)
        assert {f"{op}_{s}" for op in ("matvec", "gemm", "dequant", "matvec_id", "gemm_id")} \
            <= set(launch.KERNEL_NAMES["quant.cu"])


def test_the_cuda_tables_are_the_python_tables():
    """Every number of the generated tables read back equals kernels_cpu/iq_tables.py's, and the
    compiled quant.cu holds them (no other copy in the source)."""
    text = iq_tables_cuh()
    found = dict(re.findall(r"EI_IQ_TABLE\(\w+, (\w+), \d+\) = \{([^}]*)\}", text))
    want = {"iq2xxs_grid": iq_tables.IQ2XXS_GRID, "iq2xs_grid": iq_tables.IQ2XS_GRID, "iq2s_grid": iq_tables.IQ2S_GRID,
            "iq1s_grid": iq_tables.IQ1S_GRID, "iq3xxs_grid": iq_tables.IQ3XXS_GRID, "iq3s_grid": iq_tables.IQ3S_GRID,
            "ksigns_iq2xs": iq_tables.KSIGNS_IQ2XS}
    assert set(found) == set(want)
    for name, values in want.items():
        got = [int(v.strip().rstrip("ulUL"), 16) for v in found[name].split(",") if v.strip()]
        assert got == [int(v) for v in values], name
    compiled = source_text("quant.cu")
    assert text in compiled and '#include "iq_tables.cuh"' not in compiled
    assert "0x0808080808080808" not in (runtime.KERNEL_DIR / "quant.cu").read_text()


@pytest.mark.parametrize("qtype", IQ_TYPES, **_ids)
def test_dequant_is_the_reference_bit_for_bit(qtype):
    """Enough random rows that every grid index is drawn (checked), and scales of every kind:
    both signs, +-0, +-infinity, NaN (the reference's NaNs where it has them)."""
    n_rows, n_cols = 32 * GRID_SIZE[qtype] // 256, 2048
    raw, _ = _weights(qtype, n_rows, n_cols, int(qtype))
    assert np.unique(iquant_ref.grid_indices(int(qtype), raw)).size == GRID_SIZE[qtype]
    for block, value in enumerate((0.0, -0.0, np.inf, -np.inf, np.nan, 6e-8, -65504.0)):
        _set_scale(qtype, raw, 3 * block + 1, value)
    want = iquant_ref.dequantize(int(qtype), raw)
    got = launch.dequantize(gpuarray.to_gpu(raw), qtype, n_rows, n_cols).get()
    nan = np.isnan(want)
    assert nan.any() and np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


@pytest.mark.parametrize("n", [1, 3, 70], ids=lambda n: f"n{n}")  # matvec, matvec x3, 8-bit GEMM
@pytest.mark.parametrize("qtype", IQ_TYPES, **_ids)
def test_matvec_and_gemm_are_near_the_float64_product(qtype, n):
    n_rows, n_cols = 72, 512  # 72: a partial 64-row GEMM tile
    raw, dense = _weights(qtype, n_rows, n_cols, 100 + int(qtype))
    rng = np.random.default_rng(n)
    x = rng.standard_normal((n, n_cols)).astype(np.float32)
    res = rng.standard_normal((n, n_rows)).astype(np.float32)
    want = x.astype(np.float64) @ dense.T.astype(np.float64)
    w = gpuarray.to_gpu(raw)
    got = launch.linear(w, qtype, n_rows, n_cols, gpuarray.to_gpu(x)).get()
    assert _rel(got, want.astype(np.float32)) < _gemm_tol(qtype, n)
    got_r = launch.linear(w, qtype, n_rows, n_cols, gpuarray.to_gpu(x), gpuarray.to_gpu(res)).get()
    assert _rel(got_r, (want + res).astype(np.float32)) < _gemm_tol(qtype, n)


@pytest.mark.parametrize("types", [(Q.IQ2_XXS, Q.IQ3_S, Q.Q4_K), (Q.IQ1_M, Q.IQ2_XS, Q.IQ3_XXS),
                                   (Q.IQ2_S, Q.IQ1_S)], ids=lambda ts: "-".join(t.name for t in ts))
def test_fused_launches_give_the_matvecs_bits(types):
    """matvec_many (Q/K/V) and matvec_glu (gate/up) pick a matrix's type at run time."""
    n, n_cols = 2, 256
    rng = np.random.default_rng(0)
    mats = [(gpuarray.to_gpu(random_blocks(t, r, n_cols, rng)), t, r) for t, r in zip(types, [96, 32, 64])]
    x = gpuarray.to_gpu(rng.standard_normal((n, n_cols)).astype(np.float32))
    for (w, t, r), y in zip(mats, launch.linear_many(mats, n_cols, x)):
        assert np.array_equal(y.get(), launch.linear(w, t, r, n_cols, x).get()), t.name
    (wg, tg, _), (wu, tu) = mats[0], (gpuarray.to_gpu(random_blocks(types[1], 96, n_cols, rng)), types[1])
    got = launch.linear_glu((wg, tg), (wu, tu), 96, n_cols, x, "silu").get()
    want = launch.silu_mul(launch.linear(wg, tg, 96, n_cols, x), launch.linear(wu, tu, 96, n_cols, x)).get()
    assert np.array_equal(got, want)


@pytest.mark.parametrize("n", [2, 40], ids=lambda n: f"n{n}")  # matvec_id (groups <= 4 rows), gemm_id
@pytest.mark.parametrize("qtype", IQ_TYPES, **_ids)
def test_expert_linear(qtype, n):
    n_expert, k, n_rows, n_cols = 5, 2, 72, 256
    raw, dense = _weights(qtype, n_expert * n_rows, n_cols, 300 + int(qtype))
    rng = np.random.default_rng(n)
    chosen = np.stack([rng.permutation(n_expert)[:k] for _ in range(n)])
    active, starts, xrow = _groups(chosen)
    x = rng.standard_normal((n, n_cols)).astype(np.float32)
    want = np.concatenate([x[xrow[starts[i]:starts[i + 1]]].astype(np.float64)
                           @ dense[e * n_rows:(e + 1) * n_rows].T.astype(np.float64) for i, e in enumerate(active)])
    route = launch.ExpertRoute(active, starts, xrow)
    assert (route.max_group <= launch.MATVEC_MAX_TOKENS) == (n < 40)
    got = launch.expert_linear(gpuarray.to_gpu(raw), qtype, n_rows, n_cols, gpuarray.to_gpu(x), route).get()
    assert _rel(got, want.astype(np.float32)) < _gemm_tol(qtype, 1 if n < 40 else n)


# -- whole models ---------------------------------------------------------------------------

@pytest.mark.parametrize("qtype", IQ_TYPES, **_ids)
def test_tiny_llama_of_iquants_matches_cpu(tmp_path, qtype):
    """Every matrix an i-quant (the GGUF's 256-column ones: all of them here), in VRAM: one GPU
    layer beside the CPU's, then every layer and the output head."""
    path = write_tiny_model(tmp_path / "m.gguf", "llama", qtype.name, shape=TinyShape(n_layer=2))
    mf = open_model(path)
    assert {info.qtype for name, info in mf.gguf.tensors.items() if len(info.shape) > 1} == {qtype}
    _compare(path, ks=[1, 2] if qtype in (Q.IQ1_M, Q.IQ2_XXS) else [2])


@pytest.mark.parametrize("qtype", [Q.IQ2_XS, Q.IQ1_M, Q.IQ3_XXS], **_ids)
def test_moe_experts_of_an_iquant_type_run_on_the_gpu(tmp_path, monkeypatch, qtype):
    """qwen3moe with i-quant expert tensors (n_ff_exp 256: gate, up and down), all layers and
    their experts in VRAM: the hybrid backend's expert path launches the i-quant matvec_id
    (decode) and gemm_id (the prompt), and the logits are the CPU reference's (with the GPU
    prompt's 8-bit activations), as test_cuda_kernels' parity tests hold them."""
    path = write_tiny_model(tmp_path / "moe.gguf", "qwen3moe", qtype.name, vocab=bpe_vocab("qwen2"),
                            shape=TinyShape(n_layer=2, n_expert=4, n_expert_used=2, n_ff_exp=256))
    mf = open_model(path)
    cfg = mf.config
    experts = {name: info.qtype for name, info in mf.gguf.tensors.items() if len(info.shape) == 3}
    assert len(experts) == 3 * cfg.n_layer and set(experts.values()) == {qtype}
    seen = []
    real = launch.expert_linear

    def expert_linear(w, qt, n_rows, n_cols, x, route):
        seen.append((qt, route.max_group > launch.MATVEC_MAX_TOKENS))
        return real(w, qt, n_rows, n_cols, x, route)

    monkeypatch.setattr(launch, "expert_linear", expert_linear)
    tokens = np.random.default_rng(1).integers(0, cfg.n_vocab, 24)
    plain = _logits(mf, ReferenceBackend(mf.gguf), KVCache(cfg, 64), tokens)
    ref = _logits(mf, Q8PromptReference(mf.gguf, cfg.n_layer, True), KVCache(cfg, 64), tokens)
    layers = list(range(cfg.n_layer))
    plan = OffloadPlan(layers, True, 0, 0, 0, "test", cfg.n_layer, runtime.device_info(),
                       gpu_expert_layers=tuple(layers))
    hb = HybridBackend(mf.gguf, plan, ReferenceBackend(mf.gguf))
    got = _logits(mf, hb, hb.new_cache(cfg, 64), tokens)
    assert {qt for qt, _ in seen} == {qtype}
    assert {grouped for _, grouped in seen} == {False, True}  # matvec_id and gemm_id both ran
    rounding, scale = np.abs(ref - plain).max(), np.abs(ref).max()
    assert np.abs(got - ref).max() < 2e-2 * scale + 2 * rounding, (np.abs(got - ref).max(), scale, rounding)
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.75
