"""Gemma 4 on the GPU path, on the GPU pycuda finds or else the CUDA emulator.

What the path has to get right for this family (models/gemma4.py):
- the per-layer input gate and `layer_output_scale` multiply device activations by host
  values (`DeviceTensor * array`, `* scalar`), and the block no longer downloads its output;
- two head sizes: each layer's VRAM blocks have its own, and the global layers' 512 run on
  the wide decode kernel (paged_decode_attention_wide) for any number of queries;
- shared K/V: a layer reads its source's K/V wherever they are (VRAM, read on the GPU even
  for a host-side layer; or the host), and keeps none itself;
- V normed without a weight (a unit weight the device uploads as any other vector), GELU,
  the MoE router's per-feature scale and the experts' per-expert down scale;
- per-layer K/V head counts (26B-A4B, 31B kinds: gemma4_sized_file): each layer's VRAM rows
  have its own heads, and the kernels group Q heads by them.

Oracles: the reference backend with a contiguous KVCache (logits at every split of the
layers), and the CPU-only session manager (prefix cache, saved K/V, context shift).
"""

from __future__ import annotations

import cuda_device
import numpy as np
import pytest
from gguf_factory import gemma4_file, gemma4_sized_file
from oracles import DEVICE_ATOL, branching_prompts, compare_managers, random_ids

import edgeinfer
from edgeinfer.backends.base import ReferenceBackend
from edgeinfer.backends.offload import GiB, DeviceInfo, OffloadPlan
from edgeinfer.generate import collect
from edgeinfer.kv.contiguous import KVCache
from edgeinfer.loader import open_model
from edgeinfer.session_manager import SessionManager

cuda_device.require()

# F16 weights: a prompt's GEMM keeps fp16 activations (quantized weights round them to 8 bits as
# llama.cpp's MMQ, which test_cuda_kernels covers); what these tests hold is Gemma 4's layout
WEIGHTS = "F16"

N_CTX = 64
BS = 4
SIM = DeviceInfo("sim", 8 * GiB, 8 * GiB, (8, 6))
WIDE = dict(head_dim=512)  # the global layers' head size of E2B/E4B/31B (beyond the flash kernel's 256)


def _hybrid(mf, k: int, head: bool):
    from edgeinfer.backends.hybrid import HybridBackend

    plan = OffloadPlan(list(range(k)), head, 0, 0, 0, "test", mf.config.n_layer, SIM,
                       gpu_expert_layers=tuple(range(k)) if mf.config.n_expert else ())
    return HybridBackend(mf.gguf, plan, ReferenceBackend(mf.gguf))


def _logits(mf, backend, kv, tokens, n_decode=3) -> np.ndarray:
    model = mf.family(mf.config, mf.gguf, backend)
    rows = [model.forward(tokens, np.arange(len(tokens)), kv)[0]]
    for step in range(n_decode):
        rows.append(model.forward(np.array([int(np.argmax(rows[-1]))]), np.array([len(tokens) + step]), kv)[0])
    return np.stack(rows)


@pytest.mark.parametrize("variant", ["dense", "moe", "wide"])
def test_logits_match_the_reference_at_every_split(tmp_path, cuda_emulator, variant):
    """k = 3: layer 2's K/V in VRAM, read by the host-side shared layers 4-6; k = 5: shared
    layer 4 on the GPU over layer 2's VRAM K/V; k = 8: everything and the head."""
    path = gemma4_file(tmp_path, WEIGHTS, moe=variant == "moe", **(WIDE if variant == "wide" else {}))
    mf = open_model(path)
    cfg = mf.config
    tokens = np.random.default_rng(0).integers(3, cfg.n_vocab, 12)
    want = _logits(mf, ReferenceBackend(mf.gguf), KVCache(cfg, N_CTX), tokens)
    for k in (0, 3, 5, 8):
        hb = _hybrid(mf, k, head=k == cfg.n_layer)
        kv = hb.new_cache(cfg, N_CTX)
        assert kv.gpu_layers == {i for i in range(k) if cfg.owns_kv(i)}  # shared layers keep none
        for i in kv.gpu_layers:
            assert kv.k_dev[i].shape[-1] == cfg.head_dim_of(i) and kv.v_dev[i].shape[-1] == cfg.head_dim_v_of(i)
        cuda_emulator.clear()
        got = _logits(mf, hb, kv, tokens)
        scale = np.abs(want).max()
        assert np.abs(got - want).max() < 2e-2 * scale, (k, np.abs(got - want).max(), scale)
        assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.75, k
        if k:  # the block ran on the device: attention, the per-layer gate, the output scale
            for launcher in ("attention", "kv_store", "gelu", "mul", "scale"):
                assert cuda_emulator[launcher] > 0, (k, launcher)
            if variant == "moe":  # the router's per-feature scale, the experts' down scale
                assert cuda_emulator["mul_rows"] > 0 and cuda_emulator["scale_rows"] > 0
    if variant == "wide":
        assert cfg.head_dim_of(3) == 512 and 3 in kv.gpu_layers  # its K/V in VRAM, read by the wide kernel


@pytest.mark.parametrize("size,shape", [("26B-A4B", {}), ("31B", WIDE)])
def test_per_layer_kv_heads_match_the_reference_at_every_split(tmp_path, cuda_emulator, size, shape):
    """k = 2: a sliding layer pair in VRAM, the global layer on the host; k = 3: a global layer's
    fewer heads in VRAM too; k = 6: everything and the head."""
    mf = open_model(gemma4_sized_file(tmp_path, size, WEIGHTS, **shape))
    cfg = mf.config
    tokens = np.random.default_rng(0).integers(3, cfg.n_vocab, 12)
    want = _logits(mf, ReferenceBackend(mf.gguf), KVCache(cfg, N_CTX), tokens)
    for k in (2, 3, 6):
        hb = _hybrid(mf, k, head=k == cfg.n_layer)
        kv = hb.new_cache(cfg, N_CTX)
        assert kv.gpu_layers == set(range(k))
        for i in kv.gpu_layers:
            assert kv.k_dev[i].shape[1:] == (cfg.n_head_kv_of(i), cfg.head_dim_of(i)) == kv.v_dev[i].shape[1:]
        cuda_emulator.clear()
        got = _logits(mf, hb, kv, tokens)
        scale = np.abs(want).max()
        assert np.abs(got - want).max() < 2e-2 * scale, (k, np.abs(got - want).max(), scale)
        assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.75, k
        assert cuda_emulator["attention"] > 0 and cuda_device.kv_stores(cuda_emulator) > 0


@pytest.mark.parametrize("size", ["e2b", "26B-A4B"])
def test_the_engine_offloads_it(tmp_path, cuda_emulator, size):
    """`-ngl 99` no longer stays on the CPU: the plan takes every layer, the logits follow the CPU's."""
    from edgeinfer.engine import Engine, EngineOptions

    path = gemma4_file(tmp_path, WEIGHTS) if size == "e2b" else gemma4_sized_file(tmp_path, size, WEIGHTS)
    mf = open_model(path)
    engine = Engine(mf, EngineOptions(n_ctx=N_CTX, backend="cpu", gpu_layers=99))
    assert engine.backend.name == "hybrid" and engine.offload.gpu_layers == list(range(mf.config.n_layer))
    cpu = Engine(open_model(path), EngineOptions(n_ctx=N_CTX, backend="cpu", gpu_layers=0))
    ids = random_ids(np.random.default_rng(1), 10, mf.config.n_vocab)
    got = engine.prefill(ids, engine.backend.new_cache(mf.config, N_CTX))
    want = cpu.prefill(ids, KVCache(mf.config, N_CTX))
    assert np.abs(got - want).max() < 2e-2 * np.abs(want).max()


def _managers(path, k, head, **kw):
    cpu = edgeinfer.load(str(path), backend="reference", n_ctx=N_CTX, prefill_chunk=5)
    gpu = edgeinfer.load(str(path), backend="reference", n_ctx=N_CTX, prefill_chunk=5)
    mf = gpu.engine.model_file
    gpu.engine.backend = _hybrid(mf, k, head)
    gpu.engine.model = mf.family(mf.config, mf.gguf, gpu.engine.backend)
    mgrs = [SessionManager(m.engine, m.tokenizer, n_ctx=N_CTX, block_size=BS, model_id="g4", **kw)
            for m in (cpu, gpu)]
    return cpu, gpu, mgrs


@pytest.mark.parametrize("variant", ["dense", "wide", "31B"])
def test_the_session_manager_with_vram_blocks_matches_the_cpu(tmp_path, cuda_emulator, variant):
    """Prefix hits, branches, edits and regenerations: the same tokens, cached counts and
    logits (to the kernels' tolerance) as the CPU-only manager; a saved session's K/V equal
    the CPU's, each shared K/V once (31B's kind: layers 0-4 in VRAM, each with its K/V heads)."""
    if variant == "31B":
        path = gemma4_sized_file(tmp_path, "31B", WEIGHTS)
    else:
        path = gemma4_file(tmp_path, WEIGHTS, **(WIDE if variant == "wide" else {}))
    cpu, gpu, mgrs = _managers(path, k=5, head=True)
    cfg = cpu.config
    dev = mgrs[1].cache.device
    # e2b's kind: layer 4 (on the GPU) shares layer 2's
    assert dev is not None and dev.layers == ({0, 1, 2, 3, 4} if variant == "31B" else {0, 1, 2, 3})
    for i in dev.layers:
        assert dev.k[i].shape[2:] == (cfg.n_head_kv_of(i), cfg.head_dim_of(i)) == dev.v[i].shape[2:]
    prompts = branching_prompts(np.random.default_rng(3), cfg.n_vocab, 22, branch_at=13, edit_at=18)
    compare_managers(mgrs, [cpu.engine, gpu.engine], prompts, atol=DEVICE_ATOL)
    assert cuda_emulator["attention"] > 0 and cuda_device.kv_stores(cuda_emulator) > 0
    saved = [m.export_kv() for m in mgrs]
    assert saved[0].tokens == saved[1].tokens
    assert [x.shape[1:] for x in saved[1].k] == [(cfg.n_head_kv_of(i), cfg.head_dim_of(i) if cfg.owns_kv(i) else 0)
                                                 for i in range(cfg.n_layer)]
    for want, got in zip(saved[0].k + saved[0].v, saved[1].k + saved[1].v):
        np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=0, atol=2e-2)
    for m in mgrs:
        m.check_invariants()


@pytest.mark.parametrize("size", ["e2b", "26B-A4B"])
def test_a_saved_session_resumes_on_the_gpu(tmp_path, cuda_emulator, size):
    """K/V saved by the CPU manager load into VRAM blocks and answer as the CPU resumes."""
    from oracles import greedy

    path = gemma4_file(tmp_path, WEIGHTS) if size == "e2b" else gemma4_sized_file(tmp_path, size, WEIGHTS)
    cpu, gpu, mgrs = _managers(path, k=open_model(path).config.n_layer, head=True)
    a = random_ids(np.random.default_rng(5), 18, cpu.config.n_vocab)
    collect(mgrs[0].generate(a, greedy(3)))
    tokens, k, v, pos, *_ = mgrs[0].export_kv()
    fresh = [SessionManager(m.engine, m.tokenizer, n_ctx=N_CTX, block_size=BS, model_id="g4") for m in (cpu, gpu)]
    assert [f.import_kv(tokens, k, v, pos) for f in fresh] == [len(pos)] * 2
    more = tokens + random_ids(np.random.default_rng(6), 4, cpu.config.n_vocab)
    compare_managers(fresh, [cpu.engine, gpu.engine], [more], atol=DEVICE_ATOL)
    fresh[1].check_invariants()


@pytest.mark.parametrize("size", ["e2b", "31B"])
def test_the_context_shift_with_device_layers_matches_the_cpu(tmp_path, cuda_emulator, size):
    """A full context shifts: VRAM keys are downloaded, re-roped with each layer's own rotation
    (the sliding layers' dims and base, the global layers' proportional factors) and stored back,
    each layer's own K/V heads (31B's kind) kept."""
    from oracles import greedy

    path = gemma4_file(tmp_path, WEIGHTS) if size == "e2b" else gemma4_sized_file(tmp_path, size, WEIGHTS)
    cpu, gpu, mgrs = _managers(path, k=5, head=False, context_shift=True, n_keep=4)
    prompt = random_ids(np.random.default_rng(7), 50, cpu.config.n_vocab)
    results = [collect(m.generate(prompt, greedy(30))) for m in mgrs]
    shifts = [m.stats()["context_shifts"] for m in mgrs]
    assert shifts[0] == shifts[1] >= 1
    assert results[1].tokens == results[0].tokens
    for m in mgrs:
        m.check_invariants()
