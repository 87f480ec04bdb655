"""Quantized K/V on the GPU (kernels_cuda/kv_quant.cu, attention.cu's *_q kernels), on the GPU
pycuda finds or else the CUDA emulator (each launch run in forward and reversed order).

- the store writes the bytes the CPU cache writes (CacheTypes.encode: rotation, then ggml's
  quantizer), for every type, head size and rotation;
- hadamard_rows is kernels_cpu/kv_quant.fwht bit for bit;
- attention over quantized blocks is attention over their dequantized values (float64), with
  Q rotated as K was and the output rotated back as V was;
- a whole model with -ctk/-ctv on the hybrid backend follows the CPU's logits, and the session
  manager's VRAM blocks hold the same types (prefix cache, saved K/V).
"""

from __future__ import annotations

import cuda_device
import numpy as np
import pytest
from cuda_device import gpuarray
from test_cuda_kernels import _attention_exact

from edgeinfer.backends.base import ReferenceBackend
from edgeinfer.backends.hybrid import HybridBackend
from edgeinfer.backends.offload import OffloadPlan
from edgeinfer.kernels_cpu import kv_quant, kv_quant_jit
from edgeinfer.kernels_cuda import launch, runtime
from edgeinfer.kv.cache_types import ALLOWED, CacheTypes, of_config
from edgeinfer.kv.contiguous import KVCache
from edgeinfer.kv.device_storage import CudaKVCache
from edgeinfer.loader import open_model

cuda_device.require()

QUANT = [t for t in ALLOWED if t != "f16"]


pytestmark = pytest.mark.usefixtures("gpu_both_orders")


def _stored(types: CacheTypes, which: str, x: np.ndarray) -> np.ndarray:
    """What the CPU cache stores for float rows x, as bytes (n, n_kv, row bytes)."""
    rows = types.encode(which, x)
    return np.ascontiguousarray(rows, np.float16).view(np.uint8) if types.of(which) == "f16" else rows


@pytest.mark.parametrize("kv_type", list(ALLOWED))
@pytest.mark.parametrize("hd,rot", [(64, 64), (128, 0), (512, 128)])
def test_the_store_writes_the_cpu_caches_bytes(kv_type, hd, rot):
    rng = np.random.default_rng(hd + rot)
    n, n_kv, bs = 5, 2, 4
    x = (rng.standard_normal((n, n_kv, hd)) * 3).astype(np.float32)
    x[0, 0, :32] = 0.0  # an all-zero block (d = 0)
    x[1, 1, 5] = 40.0  # an outlier the rotation spreads
    types = CacheTypes(kv_type, kv_type, rot if kv_type != "f16" else 0, 0)
    want = _stored(types, "k", x)
    cache = launch.zeros((3, bs, n_kv, want.shape[-1]), np.uint8)
    table = gpuarray.to_gpu(np.array([2, 0], np.int32))  # logical blocks 0, 1 in physical 2, 0
    launch.kv_store_quant(gpuarray.to_gpu(x), cache, table, gpuarray.to_gpu(np.arange(n, dtype=np.int32)), bs,
                          kv_type, types.rot_k)
    got = cache.get()[[2, 0]].reshape(-1, n_kv, want.shape[-1])[:n]
    np.testing.assert_array_equal(got, want)


def test_hadamard_rows_is_the_cpu_rotation():
    x = np.random.default_rng(1).standard_normal((3, 4, 128)).astype(np.float32)
    for rot in (32, 64, 128):
        np.testing.assert_array_equal(launch.hadamard_rows(gpuarray.to_gpu(x), rot).get(), kv_quant_jit.fwht(x, rot))


@pytest.mark.parametrize("k_type,v_type", [("q8_0", "q8_0"), ("q4_0", "q4_1"), ("q5_0", "q5_1"), ("q4_0", "iq4_nl"),
                                           ("iq4_nl", "f16"), ("f16", "q8_0")])
@pytest.mark.parametrize("n_q", [1, 3, 20], ids=lambda n: f"q{n}")  # decode kernel x2, flash prefill
@pytest.mark.parametrize("hd", [64, 512])  # 512: the wide decode kernel for every n_q
def test_attention_reads_quantized_blocks(k_type, v_type, n_q, hd):
    rng = np.random.default_rng(n_q * hd)
    n_keys, n_kv, n_head, bs, window = 45, 2, 4, 16, 0
    rot = 64
    types = CacheTypes(k_type, v_type, rot if k_type != "f16" else 0, rot if v_type != "f16" else 0)
    k = rng.standard_normal((n_keys, n_kv, hd)).astype(np.float32)
    v = rng.standard_normal((n_keys, n_kv, hd)).astype(np.float32)
    q = rng.standard_normal((n_q, n_head, hd)).astype(np.float32)
    qpos = np.arange(n_keys - n_q, n_keys)
    scale = 1.0 / np.sqrt(hd)
    # the CPU's view: stored rows decoded (rotated back), so the exact answer is over these values
    kd, vd = (types.decode(w, np.asarray(types.encode(w, x), types.dtype(w))) for w, x in (("k", k), ("v", v)))
    want = _attention_exact(q, kd, vd, np.arange(n_keys), qpos, scale, window)

    table = np.array([2, 0, 1], np.int32)
    caches = []
    for which, x in (("k", k), ("v", v)):
        width = _stored(types, which, x[:1]).shape[-1]
        cache = launch.zeros((3, bs, n_kv, width), np.uint8)
        launch.kv_store_quant(gpuarray.to_gpu(x), cache, gpuarray.to_gpu(table),
                              gpuarray.to_gpu(np.arange(n_keys, dtype=np.int32)), bs, types.of(which),
                              types.rotation(which))
        caches.append(cache.reshape(3 * bs, n_kv, width))
    kpos = np.full(3 * bs, 10**6, np.int32)
    kpos[table[np.arange(n_keys) // bs] * bs + np.arange(n_keys) % bs] = np.arange(n_keys)
    qd = gpuarray.to_gpu(q)
    if types.rot_k:
        qd = launch.hadamard_rows(qd, types.rot_k)
    out = launch.attention(qd, caches[0], caches[1], gpuarray.to_gpu(table), gpuarray.to_gpu(kpos),
                           gpuarray.to_gpu(qpos.astype(np.int32)), n_keys, bs, n_kv, hd, scale, window,
                           k_type=k_type, v_type=v_type)
    if types.rot_v:
        out = launch.hadamard_rows(out, types.rot_v)
    tol = 2e-3 if n_q >= 8 and hd <= 256 else 2e-5  # the flash kernel stages values as f16
    np.testing.assert_allclose(out.get(), want, rtol=tol, atol=tol)


# -- whole models ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from gguf_factory import TinyShape, write_tiny_model

    # F16 weights: the prompt GEMM keeps fp16 activations (quantized weights would round them to
    # 8 bits, test_cuda_kernels' concern): what differs here is the K/V types
    return str(write_tiny_model(tmp_path_factory.mktemp("cq") / "m.gguf", "llama", "F16",
                                shape=TinyShape(n_layer=3, head_dim=64)))


def _hybrid(mf, k: int, head: bool):
    plan = OffloadPlan(list(range(k)), head, 0, 0, 0, "test", mf.config.n_layer, runtime.device_info())
    return HybridBackend(mf.gguf, plan, ReferenceBackend(mf.gguf))


def _logits(mf, backend, kv, tokens) -> np.ndarray:
    """A prompt, then three decode steps of fixed tokens (both sides see the same sequence)."""
    model = mf.family(mf.config, mf.gguf, backend)
    rows = [model.forward(tokens, np.arange(len(tokens)), kv)[0]]
    for step in range(3):
        rows.append(model.forward(np.array([7 + 3 * step]), np.array([len(tokens) + step]), kv)[0])
    return np.stack(rows)


@pytest.mark.parametrize("k_type,v_type", [("q8_0", "q8_0"), ("q4_0", "iq4_nl"), ("f16", "q5_1")])
@pytest.mark.parametrize("k", [2, 3])
def test_model_logits_follow_the_cpu(tiny, k_type, v_type, k):
    """GPU layers keep their K/V in VRAM as the types' blocks; the logits follow the CPU path's
    (which quantizes Q to q8_0 for the K dot, as llama.cpp: 4-bit K leaves a few percent)."""
    mf = open_model(tiny)
    cfg = mf.config
    types = of_config(cfg, CacheTypes(k_type, v_type))
    tokens = np.random.default_rng(0).integers(3, cfg.n_vocab, 12)
    want = _logits(mf, ReferenceBackend(mf.gguf), KVCache(cfg, 64, cache_types=types), tokens)
    hb = _hybrid(mf, k, head=k == cfg.n_layer)
    kv = hb.new_cache(cfg, 64, types)
    assert isinstance(kv, CudaKVCache) and kv.gpu_layers == set(range(k))
    assert kv.k_dev[0].dtype == types.dtype("k") and kv.k_dev[0].shape[-1] == types.width("k", cfg.head_dim)
    got = _logits(mf, hb, kv, tokens)
    tol = (5e-2 if "4" in k_type + v_type else 2e-2) * np.abs(want).max()
    assert np.abs(got - want).max() < tol
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.75


def _managers(path, types, k, **kw):
    import edgeinfer
    from edgeinfer.session_manager import SessionManager

    models = [edgeinfer.load(str(path), backend="reference", n_ctx=64, prefill_chunk=5,
                             cache_type_k=types[0], cache_type_v=types[1]) for _ in range(2)]
    gpu = models[1].engine
    mf = gpu.model_file
    gpu.backend = _hybrid(mf, k, head=True)
    gpu.model = mf.family(mf.config, mf.gguf, gpu.backend)
    return models, [SessionManager(m.engine, m.tokenizer, n_ctx=64, block_size=4, model_id="t", **kw) for m in models]


def test_the_session_managers_vram_blocks_hold_the_types(tiny):
    """Prefix hits, branches and edits with q8_0 K/V in VRAM blocks: the CPU manager's tokens
    and cached counts; a save of the VRAM blocks resumes on the GPU and on the CPU."""
    from oracles import branching_prompts, compare_managers, greedy

    from edgeinfer.generate import collect

    models, mgrs = _managers(tiny, ("q8_0", "q8_0"), k=3)
    dev = mgrs[1].cache.device
    assert dev is not None and dev.types.key == "k=q8_0,v=q8_0" and dev.k[0].dtype == np.uint8
    prompts = branching_prompts(np.random.default_rng(3), models[0].config.n_vocab, 14, branch_at=9, edit_at=13)
    compare_managers(mgrs, [m.engine for m in models], prompts, atol=0.15)
    saved = mgrs[1].export_kv()
    assert saved.kv_types == "k=q8_0,v=q8_0" and saved.k[0].dtype == np.uint8
    cpu_saved = mgrs[0].export_kv()
    assert cpu_saved.tokens == saved.tokens
    types = models[0].engine.cache_types
    for which, ours, theirs in (("k", saved.k, cpu_saved.k), ("v", saved.v, cpu_saved.v)):
        for a, b in zip(ours, theirs):  # the same values to the inputs' float differences and a code
            x, y = types.decode(which, a), types.decode(which, b)
            assert np.abs(x - y).max() <= 0.05 * np.abs(y).max()
    _, fresh = _managers(tiny, ("q8_0", "q8_0"), k=3)
    more = saved.tokens + [9, 10]
    for mgr in fresh:
        assert mgr.import_kv(*saved) == len(saved.pos)
    got = [collect(m.generate(more, greedy(3))) for m in fresh]
    assert got[0].usage.cached_tokens == got[1].usage.cached_tokens >= len(saved.pos) - 1
    for m in fresh:
        m.check_invariants()


def test_the_engine_offloads_and_plans_the_real_bytes(tiny):
    """-ngl with -ctk/-ctv no longer stays on the CPU; the plan reserves the types' bytes."""
    from edgeinfer.engine import Engine, EngineOptions

    plans = {}
    for kt in ("f16", "q8_0", "q4_0"):
        engine = Engine(open_model(tiny), EngineOptions(n_ctx=256, backend="cpu", gpu_layers=99,
                                                        cache_type_k=kt, cache_type_v=kt))
        assert engine.backend.name == "hybrid"
        plans[kt] = engine.offload.vram_kv
        kv = engine.new_cache()
        engine.prefill([1, 5, 6, 7], kv)
        assert kv.k_dev[0].dtype == (np.float16 if kt == "f16" else np.uint8)
    assert plans["q8_0"] == plans["f16"] * 34 // 64 and plans["q4_0"] == plans["f16"] * 18 // 64
