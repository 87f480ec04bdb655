"""The session manager's paged KV with GPU layers: their K/V live in VRAM blocks of the same
pool (edgeinfer.kv.device_storage.DeviceBlockStorage), written by kv_store and read by the paged
attention kernel through each sequence's block table.

No GPU needed: the kernels run on the CUDA emulator (the `cuda_emulator` fixture), launchers,
VRAM blocks and all. Oracles: the CPU-only session manager and cache-free runs (a contiguous
KVCache on the reference backend). tests/test_cuda_kernels.py runs the kernels on a real GPU
where one is.
"""

from __future__ import annotations

import threading

import cuda_device
import numpy as np
import pytest
from oracles import (DEVICE_ATOL, branching_prompts, cold_greedy, compare_managers, greedy, random_ids,
                     run_operations)

import edgeinfer
from edgeinfer.backends.base import ReferenceBackend
from edgeinfer.engine import Engine, EngineOptions
from edgeinfer.generate import collect
from edgeinfer.kv.contiguous import KVCache
from edgeinfer.loader import open_model
from edgeinfer.backends.offload import GiB, DeviceInfo, OffloadPlan
from edgeinfer.results import FinishReason
from edgeinfer.session_manager import SessionManager

N_CTX = 64
BS = 4
SIM = DeviceInfo("sim", 8 * GiB, 8 * GiB, (8, 6))


@pytest.fixture
def device(cuda_emulator):
    """The emulated GPU for one test; returns the launchers' call counts."""
    return cuda_emulator


def _cpu(path, n_ctx: int = N_CTX) -> edgeinfer.Model:
    return edgeinfer.load(str(path), backend="reference", n_ctx=n_ctx, prefill_chunk=5)


def _gpu_engine(path, k: int, head: bool = False, n_ctx: int = N_CTX, vram_kv: int = 0) -> Engine:
    """An engine whose layers 0..k-1 (and the head) run on the simulated GPU."""
    from edgeinfer.backends.hybrid import HybridBackend

    mf = open_model(path)
    engine = Engine(mf, EngineOptions(n_ctx=n_ctx, backend="reference", prefill_chunk=5))
    plan = OffloadPlan(list(range(k)), head, 0, vram_kv, 0, "test", mf.config.n_layer, SIM)
    engine.backend = HybridBackend(mf.gguf, plan, ReferenceBackend(mf.gguf))
    engine.model = mf.family(mf.config, mf.gguf, engine.backend)
    return engine


def _manager(engine, tokenizer, **kw) -> SessionManager:
    kw.setdefault("block_size", BS)
    kw.setdefault("n_ctx", N_CTX)
    return SessionManager(engine, tokenizer, model_id="tiny", **kw)


def _cold_logits(engine, ids: list[int]) -> np.ndarray:
    """Logits after `ids` from a fresh contiguous cache (no prefix reuse, no blocks). Prefilled
    in other chunks than a warm run, so equal to ~2e-5 (BLAS rounding), as on the CPU path."""
    return engine.prefill(ids, KVCache(engine.config, engine.n_ctx))


def test_conversations_sharing_a_prefix_share_device_blocks(tiny_models, device):
    from edgeinfer.kv.device_storage import DeviceBlockStorage

    path = tiny_models["llama"]
    cpu = _cpu(path)
    engine = _gpu_engine(path, k=cpu.config.n_layer, head=True)
    mgr = _manager(engine, cpu.tokenizer)
    cache, n_layer = mgr.cache, cpu.config.n_layer
    dev = cache.device
    assert isinstance(dev, DeviceBlockStorage) and dev.layers == set(range(n_layer))
    assert all(cache.k[i].shape[0] == 0 for i in range(n_layer))  # no host copy of VRAM layers
    assert dev.k[0].shape == (cache.num_blocks, BS, cpu.config.n_head_kv, cpu.config.head_dim)

    rng = np.random.default_rng(1)
    a = random_ids(rng, 18, cpu.config.n_vocab)
    b = a[:16] + random_ids(rng, 5, cpu.config.n_vocab)
    seq_a = cache.new_sequence(N_CTX)
    engine.prefill(a, seq_a)
    seq_a.record_tokens(a)
    assert cache.commit_full_blocks(seq_a) == 4

    seq_b = cache.new_sequence(N_CTX)
    assert cache.reuse_prefix(seq_b, b[:-1]) == 16
    device.clear()
    logits_b = engine.prefill(b[16:], seq_b)
    # only the 5 new tokens went through kv_store (in every GPU layer); no block was copied
    assert device["kv_store_tokens"] == 5 * n_layer and "copy_rows" not in device
    shared = seq_a.block_table[:4]
    assert seq_b.block_table[:4] == shared and seq_b.block_table[4] not in seq_a.block_table
    assert all(cache.pool.ref_count(blk) == 2 for blk in shared)
    cache.check_invariants()
    # one copy in VRAM: both sequences read the same device rows for the shared prefix
    for layer in range(n_layer):
        ka, va, pa = seq_a.layer_view(layer)
        kb, vb, pb = seq_b.layer_view(layer)
        np.testing.assert_array_equal(kb[:16], ka[:16])
        np.testing.assert_array_equal(vb[:16], va[:16])
        assert list(pb) == list(range(len(b)))
    np.testing.assert_allclose(logits_b, _cold_logits(cpu.engine, b), rtol=0, atol=DEVICE_ATOL)
    cache.release(seq_a)
    cache.release(seq_b)
    assert all(cache.pool.ref_count(blk) == 0 for blk in shared)
    cache.check_invariants()


def test_second_conversation_prefills_only_its_new_tokens(tiny_models, device):
    path = tiny_models["llama"]
    cpu = _cpu(path)
    engine = _gpu_engine(path, k=cpu.config.n_layer)
    mgr = _manager(engine, cpu.tokenizer)
    rng = np.random.default_rng(2)
    vocab = cpu.config.n_vocab
    a = random_ids(rng, 17, vocab)
    collect(mgr.generate(a, greedy(2)))
    collect(mgr.generate(random_ids(rng, 9, vocab), greedy(2)))  # a is no longer resident
    b = a[:16] + random_ids(rng, 3, vocab)
    positions: list[int] = []
    forward = engine.forward
    engine.forward = lambda tokens, pos, kv, logits_for=None, **kw: (positions.extend(int(p) for p in pos),
                                                                   forward(tokens, pos, kv, logits_for, **kw))[1]
    device.clear()
    result = collect(mgr.generate(b, greedy(3)))
    assert result.usage.cached_tokens == 16  # a's four full blocks, from the prefix cache (in VRAM)
    assert positions[0] == 16  # prefill started after the cached blocks
    assert device["kv_store_tokens"] == len(positions) * cpu.config.n_layer
    assert result.tokens == cold_greedy(cpu.engine, cpu.tokenizer, b, 3)
    mgr.check_invariants()


# -- (2) logits through the session manager equal the CPU-only manager's ---------------------------

@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("k,head", [(1, False), (2, True)])
def test_session_logits_equal_cpu_only(tiny_models, device, arch, k, head):
    path = tiny_models[arch]
    cpu = _cpu(path)
    engine = _gpu_engine(path, k=k, head=head)
    mgrs = [_manager(cpu.engine, cpu.tokenizer), _manager(engine, cpu.tokenizer)]
    assert mgrs[0].cache.device is None and mgrs[1].cache.device.layers == set(range(k))
    prompts = branching_prompts(np.random.default_rng(3), cpu.config.n_vocab, 14, branch_at=9, edit_at=13)
    compare_managers(mgrs, [cpu.engine, engine], prompts, atol=DEVICE_ATOL)
    assert device["attention"] > 0 and cuda_device.kv_stores(device) > 0  # the GPU layers read VRAM blocks


# -- (3) fork / regenerate: copy-on-write copies device blocks -----------------------------------

def test_fork_copies_the_shared_partial_device_block_on_write(tiny_models, device):
    path = tiny_models["qwen2"]
    cpu = _cpu(path)
    engine = _gpu_engine(path, k=2)
    mgr = _manager(engine, cpu.tokenizer)
    cache, dev = mgr.cache, mgr.cache.device
    rng = np.random.default_rng(4)
    a = random_ids(rng, 10, cpu.config.n_vocab)  # 2 full blocks + 2 rows of a third
    seq_a = cache.new_sequence(N_CTX)
    engine.prefill(a, seq_a)
    seq_b = cache.fork(seq_a)
    partial = seq_a.block_table[2]
    assert seq_b.block_table == seq_a.block_table and cache.pool.ref_count(partial) == 2
    device.clear()
    la = engine.decode(7, seq_a)  # the shared partial block: copied, then written
    copied = seq_a.block_table[2]
    assert copied != partial and seq_b.block_table[2] == partial
    assert device["copy_rows"] == 2 * len(dev.layers) + 1  # K and V of every VRAM layer + positions
    for layer in dev.layers:
        np.testing.assert_array_equal(dev.k[layer].get()[copied, :2], dev.k[layer].get()[partial, :2])
        np.testing.assert_array_equal(dev.v[layer].get()[copied, :2], dev.v[layer].get()[partial, :2])
    np.testing.assert_array_equal(dev.pos.get()[copied * BS:copied * BS + 3], [8, 9, 10])
    device.clear()
    lb = engine.decode(9, seq_b)  # b now holds the original alone: written in place
    assert "copy_rows" not in device and seq_b.block_table[2] == partial
    np.testing.assert_allclose(la, _cold_logits(cpu.engine, a + [7]), rtol=0, atol=DEVICE_ATOL)
    np.testing.assert_allclose(lb, _cold_logits(cpu.engine, a + [9]), rtol=0, atol=DEVICE_ATOL)
    # a's copy kept b's token 7 out, b's original kept a's token 9 out
    assert seq_a.layer_view(0)[0].shape[0] == seq_b.layer_view(0)[0].shape[0] == 11
    cache.release(seq_a)
    cache.release(seq_b)
    cache.check_invariants()


def test_regenerate_and_edit_copy_device_blocks_and_match_cold_runs(tiny_models, device):
    path = tiny_models["gemma3"]
    cpu = _cpu(path)
    engine = _gpu_engine(path, k=2, head=True)
    mgr = _manager(engine, cpu.tokenizer)
    rng = np.random.default_rng(5)
    vocab = cpu.config.n_vocab
    prompt = random_ids(rng, 14, vocab)
    first = collect(mgr.generate(prompt, greedy(4)))
    assert first.tokens == cold_greedy(cpu.engine, cpu.tokenizer, prompt, 4)
    device.clear()
    again = collect(mgr.generate(prompt, greedy(4)))  # regenerate: resume at token 13, mid-block
    assert again.tokens == first.tokens and again.usage.cached_tokens == 13
    assert device.get("copy_rows", 0) > 0  # the cached block holding token 13 was copied, not overwritten
    edited = prompt[:6] + random_ids(rng, 5, vocab)  # edit inside the second block
    result = collect(mgr.generate(edited, greedy(4)))
    assert result.usage.cached_tokens == 6
    assert result.tokens == cold_greedy(cpu.engine, cpu.tokenizer, edited, 4)
    # the original conversation's cached blocks survived both copies intact
    back = collect(mgr.generate(prompt, greedy(4)))
    assert back.tokens == first.tokens and back.usage.cached_tokens == 12
    mgr.check_invariants()


def test_random_operations_on_vram_blocks_match_cache_free_runs(tiny_models, device):
    """new / extend / fork / regenerate / edit / cancel / fail / reset on a pool of one context
    (+1 block), so cached blocks are evicted and reused: accounting stays exact and every
    answer equals a cache-free run."""
    path = tiny_models["llama"]
    cpu = _cpu(path)
    engine = _gpu_engine(path, k=1, head=True)
    mgr = _manager(engine, cpu.tokenizer, pool_tokens=N_CTX)
    ops = ["new", "extend", "fork", "regenerate", "cancel", "edit", "extend", "fail", "new", "fork",
           "reset", "new", "extend", "regenerate"]
    steps = [(op, int(np.random.default_rng(100 + i).integers(1, 12)), 100 + i) for i, op in enumerate(ops)]
    outcomes = run_operations(mgr, steps, cpu.engine, cpu.tokenizer, n_ctx=N_CTX)
    assert outcomes[ops.index("cancel")] == FinishReason.CANCELLED
    assert mgr.cache.device is not None


# -- the rest of the manager on VRAM blocks ------------------------------------------------------

def test_context_shift_and_saved_kv_with_vram_layers(tmp_path, device):
    from gguf_factory import TinyShape, write_tiny_model

    path = write_tiny_model(tmp_path / "one.gguf", "llama", "F32", shape=TinyShape(n_layer=1))
    cpu = _cpu(path, n_ctx=40)
    engine = _gpu_engine(path, k=1, n_ctx=40)
    mgrs = [SessionManager(e, cpu.tokenizer, n_ctx=40, block_size=8, context_shift=True, n_keep=4)
            for e in (cpu.engine, engine)]
    prompt = random_ids(np.random.default_rng(6), 30, cpu.config.n_vocab)
    results = [collect(m.generate(prompt, greedy(20))) for m in mgrs]
    assert results[1].tokens == results[0].tokens  # the shift re-ropes keys downloaded from VRAM
    assert mgrs[1].stats()["context_shifts"] == mgrs[0].stats()["context_shifts"]
    # save / restore: K/V come down from VRAM and go back up; the next turn reuses all of it
    short = prompt[:13]
    for m in mgrs:
        collect(m.generate(short, greedy(3)))
    saved = [m.export_kv() for m in mgrs]
    assert saved[1][0] == saved[0][0]
    for got, want in zip(saved[1][1] + saved[1][2], saved[0][1] + saved[0][2]):
        np.testing.assert_allclose(got, want, rtol=DEVICE_ATOL, atol=DEVICE_ATOL)
    mgrs[1].reset()
    assert mgrs[1].import_kv(*saved[1]) == len(saved[1][0])
    follow = saved[1][0] + [5, 6]
    again = collect(mgrs[1].generate(follow, greedy(3)))
    assert again.usage.cached_tokens == len(saved[1][0])
    assert again.tokens == cold_greedy(cpu.engine, cpu.tokenizer, follow, 3)
    mgrs[1].check_invariants()


def test_pool_is_capped_to_the_plans_vram_kv(tiny_models, device):
    path = tiny_models["llama"]
    cpu = _cpu(path)
    cfg = cpu.config
    per_token = cfg.n_layer * cfg.n_head_kv * (cfg.head_dim + cfg.head_dim_v) * 2  # f16 K + V
    engine = _gpu_engine(path, k=cfg.n_layer, vram_kv=per_token * N_CTX)  # what the planner reserves
    mgr = _manager(engine, cpu.tokenizer)
    assert mgr.cache.num_blocks == N_CTX // BS + 1  # one context + a copy-on-write block, not 2 x n_ctx
    assert mgr.cache.device.k[0].shape[0] == mgr.cache.num_blocks
    assert _manager(cpu.engine, cpu.tokenizer).cache.num_blocks == 2 * N_CTX // BS  # CPU: unchanged


def test_head_dims_the_kernels_lack_keep_kv_on_the_host(tiny_models, device, monkeypatch):
    from edgeinfer.kernels_cuda import launch

    monkeypatch.setattr(launch, "attention_supports", lambda hd, hd_v: False)
    path = tiny_models["llama"]
    cpu = _cpu(path)
    engine = _gpu_engine(path, k=2)
    mgr = _manager(engine, cpu.tokenizer)
    assert mgr.cache.device is None
    prompt = random_ids(np.random.default_rng(7), 11, cpu.config.n_vocab)
    result = collect(mgr.generate(prompt, greedy(3)))
    assert result.tokens == cold_greedy(cpu.engine, cpu.tokenizer, prompt, 3)
    assert "attention" not in device and "kv_store" not in device


def test_cancelled_request_on_vram_blocks_returns_them(tiny_models, device):
    path = tiny_models["llama"]
    cpu = _cpu(path)
    mgr = _manager(_gpu_engine(path, k=2), cpu.tokenizer)
    cancel = threading.Event()
    chunks = mgr.generate(random_ids(np.random.default_rng(8), 10, cpu.config.n_vocab), greedy(30), cancel)
    next(chunks)
    assert mgr.stats()["used"] > 0
    cancel.set()
    assert list(chunks)[-1].finish_reason == FinishReason.CANCELLED
    assert mgr.stats()["used"] == 0
    mgr.check_invariants()


def test_speculative_verification_on_vram_layers(tiny_models, device):
    """Drafts verified in one batch through VRAM layers (the GEMM for the batch, the matvec for
    plain decode) give the plain greedy tokens up to the plain run's first near tie, and
    rejected drafts roll their rows back out of the VRAM blocks. The drafter proposes the plain
    run's tokens with every third one wrong, so both acceptance and rollback run."""
    from test_speculative import OracleDrafter

    from edgeinfer.sampling import SamplingParams
    from edgeinfer.speculative import Speculation, SpeculativeParams

    path = tiny_models["llama"]
    cpu = _cpu(path)
    mgr = _manager(_gpu_engine(path, k=2, head=True), cpu.tokenizer)
    ids = random_ids(np.random.default_rng(9), 12, cpu.config.n_vocab)
    plain = [c for c in mgr.generate(ids, SamplingParams(temperature=0, max_tokens=24, logprobs=2))
             if c.token is not None]
    truth = [c.token for c in plain]
    mgr.reset()
    spec = Speculation(OracleDrafter(truth, len(ids), 3, cpu.config.n_vocab), SpeculativeParams(n_max=6))
    spec.length.next_k = lambda limit: min(6, limit)  # always draft: the test wants verification batches
    got = [c.token for c in mgr.generate(ids, greedy(24), speculation=spec) if c.token is not None]
    gaps = [c.logprobs.top[0][1] - c.logprobs.top[1][1] for c in plain]
    tie = next((i for i, g in enumerate(gaps) if g < 2 * DEVICE_ATOL), len(gaps))
    assert tie >= 4 and got[:tie + 1] == truth[:tie + 1]
    assert spec.accepted > 0 and spec.drafted > spec.accepted  # accepts and rollbacks
    assert device["attention"] > 0
    mgr.check_invariants()


def test_an_auto_plan_under_a_small_vram_offloads_part_and_matches_cpu(tiny_models, device, monkeypatch):
    """`gpu_layers="auto"` on an emulated device with room for only some layers: the plan puts
    those on it, and the model's logits match the CPU's."""
    from edgeinfer.backends.offload import plan_for_model

    path = tiny_models["llama"]
    mf = open_model(path)
    partial = None
    for mb in range(300, 420):  # the smallest device that holds some but not all of the layers
        monkeypatch.setenv("EDGEINFER_CUDA_EMULATE_VRAM_MB", str(mb))
        plan = plan_for_model(mf.gguf, mf.config, N_CTX)
        if 0 < len(plan.gpu_layers) < mf.config.n_layer:
            partial = plan
            break
    assert partial is not None, "no VRAM size gives a partial plan"
    gpu = edgeinfer.load(str(path), n_ctx=N_CTX, gpu_layers="auto")
    assert gpu.engine.offload.gpu_layers == partial.gpu_layers and "emulator" in gpu.engine.offload.describe()
    cpu = _cpu(path)
    ids = random_ids(np.random.default_rng(10), 9, cpu.config.n_vocab)
    want = _cold_logits(cpu.engine, ids)
    np.testing.assert_allclose(_cold_logits(gpu.engine, ids), want, rtol=0, atol=DEVICE_ATOL)
