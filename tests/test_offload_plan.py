"""The offload planner against simulated GPUs (no CUDA needed)."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest

from edgeinfer.models.config import ModelConfig
from edgeinfer.rope import ROPE_NORM
from edgeinfer.backends.offload import (GiB, MiB, DeviceInfo, OffloadError, estimate_model_sizes,
                               model_sizes_from_gguf, plan_offload, vram_budget)

CARDS_GB = (4, 6, 8, 12, 24)


def _llama(n_embd, n_layer, n_head, n_head_kv, head_dim, n_ff, n_vocab=128256) -> ModelConfig:
    return ModelConfig(arch="llama", n_vocab=n_vocab, n_ctx_train=131072, n_embd=n_embd,
                       n_layer=n_layer, n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim,
                       head_dim_v=head_dim, n_ff=n_ff, norm_eps=1e-5, rope_mode=ROPE_NORM,
                       rope_dims=head_dim, rope_base=500000.0)


CONFIGS = {
    "1B": _llama(2048, 16, 32, 8, 64, 8192),
    "3B": _llama(3072, 28, 24, 8, 128, 8192),
    "8B": _llama(4096, 32, 32, 8, 128, 14336),
}


def card(gb: int) -> DeviceInfo:
    """A desktop card as cuMemGetInfo sees it: ~600 MiB taken by the context and the display."""
    return DeviceInfo(f"sim {gb}GB", gb * GiB, gb * GiB - 600 * MiB, (8, 6))


def _plan(model: str, gb: int, n_ctx: int = 4096, **kw):
    return plan_offload(estimate_model_sizes(CONFIGS[model]), card(gb), n_ctx, **kw)


def test_estimate_matches_known_file_sizes():
    # Llama 3.1 8B Q4_K_M is a 4.9 GB file, of which ~0.3 GB is token_embd (stays on the CPU).
    s = estimate_model_sizes(CONFIGS["8B"])
    on_gpu = sum(s.layer_weights) + s.output_weights
    assert 4.2e9 < on_gpu < 4.9e9


@pytest.mark.parametrize("model", CONFIGS)
def test_monotone_in_vram_and_never_over_budget(model):
    prev = (-1, False)
    for gb in CARDS_GB:
        p = _plan(model, gb)
        assert p.vram_total <= vram_budget(card(gb)), (model, gb)
        assert p.gpu_layers == list(range(len(p.gpu_layers)))  # always a prefix of the blocks
        now = (len(p.gpu_layers), p.output_on_gpu)
        assert now >= prev, (model, gb, now, prev)
        prev = now


@pytest.mark.parametrize("model", CONFIGS)
@pytest.mark.parametrize("gb", CARDS_GB)
def test_auto_is_maximal(model, gb):
    """One more block than the plan chose would not fit."""
    sizes = estimate_model_sizes(CONFIGS[model])
    p = _plan(model, gb)
    k = len(p.gpu_layers)
    if k < sizes.n_layer:
        extra = sizes.layer_weights[k] + sizes.kv_values_per_token[k] * 2 * 4096
        layers_only = p.vram_total - (sizes.output_weights + 512 * sizes.n_vocab * 4 if p.output_on_gpu else 0)
        scratch = 0 if k else 512 * sizes.scratch_values_per_row * 4
        assert layers_only + extra + scratch > vram_budget(card(gb))


def test_1b_fits_whole_on_4gb():
    p = _plan("1B", 4)
    assert p.gpu_layers == list(range(16)) and p.output_on_gpu


def test_8b_needs_more_than_6gb_but_fits_12gb():
    small, big = _plan("8B", 6), _plan("8B", 12)
    assert not (len(small.gpu_layers) == 32 and small.output_on_gpu)
    assert len(small.gpu_layers) > 0
    assert big.gpu_layers == list(range(32)) and big.output_on_gpu


def test_longer_context_offloads_fewer_layers():
    short, long = _plan("8B", 4, n_ctx=2048), _plan("8B", 4, n_ctx=32768)
    assert len(long.gpu_layers) < len(short.gpu_layers)
    assert long.vram_kv / len(long.gpu_layers) == pytest.approx(16 * short.vram_kv / len(short.gpu_layers))


def test_gpu_layers_zero_is_cpu_only():
    p = _plan("1B", 24, gpu_layers=0)
    assert p.gpu_layers == [] and not p.output_on_gpu and p.vram_total == 0
    assert "CPU" in p.describe() and "--gpu-layers 0" in p.describe()


def test_gpu_layers_n_exact_and_clamped():
    p = _plan("3B", 24, gpu_layers=10)
    assert p.gpu_layers == list(range(10)) and not p.output_on_gpu
    p = _plan("3B", 24, gpu_layers=999)
    assert p.gpu_layers == list(range(28)) and p.output_on_gpu
    p = _plan("3B", 24, gpu_layers="28")
    assert len(p.gpu_layers) == 28


def test_gpu_layers_that_do_not_fit_raise_one_line():
    with pytest.raises(OffloadError) as e:
        _plan("8B", 4, gpu_layers=32)
    msg = str(e.value)
    assert "\n" not in msg and "--gpu-layers 32" in msg and "layers fit" in msg


@pytest.mark.parametrize("bad", ["-1", "lots", -3])
def test_gpu_layers_bad_value(bad):
    with pytest.raises(OffloadError):
        _plan("1B", 8, gpu_layers=bad)


def test_no_device_is_cpu_plan_with_reason():
    reason = "CUDA unavailable: pycuda is not installed (pip install 'edgeinfer[cuda]'); running on the CPU"
    p = plan_offload(estimate_model_sizes(CONFIGS["1B"]), None, 4096, no_device_reason=reason)
    assert p.gpu_layers == [] and not p.output_on_gpu and p.reason == reason
    assert reason in p.describe()


def test_tiny_card_gets_nothing():
    p = plan_offload(estimate_model_sizes(CONFIGS["8B"]), DeviceInfo("tiny", GiB, 400 * MiB, (7, 5)), 4096)
    assert not p.on_gpu and "not enough" in p.reason


def test_describe_line():
    p = _plan("3B", 6)
    line = p.describe()
    assert line.startswith(f"offloading {len(p.gpu_layers)}/28 layers to GPU (sim 6GB, ")
    assert "weights" in line and "KV" in line and "\n" not in line


def test_kv_dtype_changes_kv_bytes():
    f16, f32 = _plan("1B", 24, kv_dtype="f16"), _plan("1B", 24, kv_dtype="f32")
    assert f32.vram_kv == 2 * f16.vram_kv == 2 * 16 * 4096 * 8 * 128 * 2
    with pytest.raises(OffloadError):
        _plan("1B", 24, kv_dtype="q3")


def test_sizes_from_gguf_sum_to_file_tensors(tiny_models):
    from edgeinfer.gguf_file import GGUFFile
    from edgeinfer.models.llama import Llama

    gf = GGUFFile.open(tiny_models["llama"])
    cfg = Llama.read_config(gf)
    s = model_sizes_from_gguf(gf, cfg)
    total = sum(t.n_bytes for t in gf.tensors.values())
    rest = total - sum(s.layer_weights) - s.output_weights
    # what is not in a layer or the head: token_embd (tied: counted as the head) and rope factors
    others = sum(t.n_bytes for n, t in gf.tensors.items()
                 if not n.startswith("blk.") and n not in ("output.weight", "output_norm.weight"))
    if cfg.tied_embeddings:
        others -= gf.tensors["token_embd.weight"].n_bytes
    assert rest == others
    assert len(set(s.layer_weights)) == 1 and s.layer_weights[0] > 0


# -- the probe and the hybrid backend, with a simulated device ----------------------------

def _fresh_probe(monkeypatch, modules: dict):
    from edgeinfer.kernels_cuda import runtime

    for name, mod in modules.items():
        monkeypatch.setitem(sys.modules, name, mod)
    runtime.cuda_available.cache_clear()
    try:
        return runtime.cuda_available()
    finally:
        runtime.cuda_available.cache_clear()


def test_probe_without_pycuda(monkeypatch):
    ok, reason = _fresh_probe(monkeypatch, {"pycuda": None, "pycuda.driver": None})
    assert not ok
    assert reason == ("CUDA unavailable: pycuda is not installed (pip install 'edgeinfer[cuda]'); "
                      "running on the CPU")


def test_probe_driver_failure_and_no_device(monkeypatch):
    def broken_init():
        raise RuntimeError("cuInit failed: no CUDA-capable device is detected\nmore")

    drv = types.SimpleNamespace(init=broken_init, Device=types.SimpleNamespace(count=lambda: 0))
    pkg = types.SimpleNamespace(driver=drv)
    ok, reason = _fresh_probe(monkeypatch, {"pycuda": pkg, "pycuda.driver": drv})
    assert not ok and "\n" not in reason
    assert "driver failed to start (cuInit failed: no CUDA-capable device is detected)" in reason
    drv.init = lambda: None
    ok, reason = _fresh_probe(monkeypatch, {"pycuda": pkg, "pycuda.driver": drv})
    assert not ok and "no CUDA device found" in reason


def test_plan_for_model_without_cuda_is_cpu(tiny_models, monkeypatch):
    from edgeinfer.gguf_file import GGUFFile
    from edgeinfer.kernels_cuda import runtime
    from edgeinfer.models.llama import Llama
    from edgeinfer.backends.offload import plan_for_model

    gf = GGUFFile.open(tiny_models["llama"])
    cfg = Llama.read_config(gf)
    monkeypatch.setattr(runtime, "cuda_available", lambda: (False, "CUDA unavailable: test"))
    p = plan_for_model(gf, cfg, 256)
    assert not p.on_gpu and p.describe() == "running on the CPU: CUDA unavailable: test"
    assert plan_for_model(gf, cfg, 256, gpu_layers=0).reason == "--gpu-layers 0"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_hybrid_backend_on_the_emulated_device(tiny_models, cuda_emulator, arch):
    """The layer split, boundary transfers and GPU-side KV of HybridBackend, with the CUDA kernels
    running on the emulator: logits match the reference backend's for every --gpu-layers value."""
    from edgeinfer.backends.base import ReferenceBackend
    from edgeinfer.backends.device_tensor import DeviceTensor
    from edgeinfer.backends.hybrid import HybridBackend
    from edgeinfer.kv.device_storage import CudaKVCache
    from edgeinfer.kv.contiguous import KVCache
    from edgeinfer.loader import open_model
    from edgeinfer.backends.offload import OffloadPlan

    calls = cuda_emulator

    mf = open_model(tiny_models[arch])
    cfg = mf.config
    tokens = np.random.default_rng(0).integers(0, cfg.n_vocab, 9)

    def run(backend, kv):
        model = mf.family(cfg, mf.gguf, backend)
        first = model.forward(tokens, np.arange(len(tokens)), kv, logits_for=np.array([3, 8]))
        step = model.forward(np.array([int(first[-1].argmax())]), np.array([len(tokens)]), kv)
        assert isinstance(first, np.ndarray) and isinstance(step, np.ndarray)
        return np.concatenate([first, step])

    want = run(ReferenceBackend(mf.gguf), KVCache(cfg, 32))
    dev = DeviceInfo("sim", 8 * GiB, 8 * GiB, (8, 6))
    for k in range(cfg.n_layer + 1):
        for head in (False, True):
            calls.clear()
            plan = OffloadPlan(list(range(k)), head, 0, 0, 0, "test", cfg.n_layer, dev)
            hb = HybridBackend(mf.gguf, plan, ReferenceBackend(mf.gguf))
            kv = hb.new_cache(cfg, 32)
            assert isinstance(kv, CudaKVCache)
            got = run(hb, kv)
            # the GEMM rounds its tiles to fp16, attention keeps Q in f32 where ggml rounds it to f16
            assert np.abs(got - want).max() < 2e-2 * np.abs(want).max(), (arch, k, head)
            assert (got.argmax(-1) == want.argmax(-1)).mean() >= 2 / 3, (arch, k, head)
            # every GPU layer ran its 7 matrices there, twice: the prompt one launch each; the decoded
            # token Q/K/V in one, gate/up in one, then the output and down projections; plus the head
            assert calls.get("linear", 0) == 7 * k + 2 * k + 2 * head, (k, head, calls)
            assert calls.get("linear_many", 0) == k and calls.get("linear_glu", 0) == k, (k, head, calls)
            assert calls.get("attention", 0) == 2 * k
            # the GPU layers' K/V are in "VRAM" and read back the same as the reference cache
            if k:
                kd, _, pos = kv.layer_view(0)
                assert kd.shape[0] == len(tokens) + 1 and list(pos) == list(range(len(tokens) + 1))
            assert not isinstance(got, DeviceTensor)
