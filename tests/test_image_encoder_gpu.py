"""The vision encoder in VRAM (edgeinfer.vision.gpu_encoder) on the CUDA emulator, or the GPU.

Each projector's embeddings with the encoder on the GPU are the CPU encoder's within the GPU's
float noise, max |gpu - cpu| / max |cpu|: the GEMM rounds its operands to F16 (F32 and F16
matrices) or quantizes the activations as q8_1 where the CPU takes q8_0 (Q8_0 matrices), K and V
are stored in F16, and GELU is computed rather than looked up. Gemma 4's 48-wide ffn_down takes
the padded path (zero columns up to 64, launch.pad_cols). Measured on these tiny files and
images (emulator; the "alternate" and "reverse" orders give the same):

              F32      F16      Q8_0
    gemma3    1.5e-4   1.8e-4   1.6e-3
    gemma4v   4.3e-4   2.8e-4   6.0e-3
    qwen3vl   5.3e-4   4.6e-4   1.1e-2
    + deep    4.5e-4   4.0e-4   6.5e-3   (a deepstack merger after layer 1)

Q8_0's is the size of the CPU's own rounding of its activations to q8_0 (against exact products
of the same weights: 2.2e-3, 5.4e-3, 9.7e-3). The bounds are 2e-3 (float) and 2.5e-2 (Q8_0);
the same encoder with a causal mask moves gemma3's by 2.1e-1 (test_a_causal_mask_would_show).
The greedy tokens after an image prompt are the CPU's, the GPU encoder's rows going into the
CPU text model (the GPU text layers' own noise is test_image_gpu's), and `mmproj_offload=False`
(or no GPU layer) leaves the encoder on the CPU: no launch while an image is encoded, the CPU's bits.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io

import cuda_device
import numpy as np
import pytest
from gguf_factory import TinyShape, bpe_vocab, gemma4_file, gemma4_vocab, write_tiny_model
from image_fixtures import write_gemma3

import mmproj_factory

cuda_device.require()

BOUND = {"F32": 2e-3, "F16": 2e-3, "Q8_0": 2.5e-2}
WRITERS = {  # projector -> (mmproj writer, text width, image (h, w))
    "gemma3": (mmproj_factory.write_gemma3_mmproj, 64, (48, 40)),
    "gemma4v": (mmproj_factory.write_gemma4v_mmproj, 64, (56, 40)),
    "qwen3vl": (mmproj_factory.write_qwen3vl_mmproj, 64, (24, 40)),
}
# Qwen3-VL's deepstack mergers after layer 1 too (embeddings only: the text models here take none)
DEEPSTACK = (lambda path, n, qtype: mmproj_factory.write_qwen3vl_mmproj(path, n, qtype, deepstack=(1,)), 64, (24, 40))
TOKENS = 6


def _pixels(h: int, w: int, seed: int = 1) -> np.ndarray:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([x * 6, y * 5, (x * y) % 256], -1)
    return np.clip(base + rng.integers(-60, 60, base.shape), 0, 255).astype(np.uint8)


def _png(h: int, w: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(_pixels(h, w)).save(buf, format="PNG")
    return buf.getvalue()


def _relative(got: np.ndarray, want: np.ndarray) -> float:
    assert got.shape == want.shape and np.all(np.isfinite(got))
    return float(np.abs(got - want).max() / np.abs(want).max())


def _both(tmp_path, projector: str, qtype: str):
    """(CPU embeddings, GPU embeddings, the GPU ops) of one image."""
    from edgeinfer.vision.gpu_encoder import GpuOps
    from edgeinfer.vision.mmproj import load_mmproj

    writer, n_text, (h, w) = DEEPSTACK if projector == "qwen3vl-deepstack" else WRITERS[projector]
    path = writer(tmp_path / "mmproj.gguf", n_text, qtype)
    pixels = _pixels(h, w)
    want = load_mmproj(path).encode(pixels).embeddings
    ops = GpuOps()
    got = load_mmproj(path, ops=ops).encode(pixels).embeddings
    return want, got, ops


@pytest.mark.parametrize("qtype", list(BOUND))
@pytest.mark.parametrize("projector", [*WRITERS, "qwen3vl-deepstack"])
def test_the_gpu_encoder_gives_the_cpus_embeddings(tmp_path, cuda_emulator, projector, qtype):
    want, got, ops = _both(tmp_path, projector, qtype)
    assert ops.n_matrices >= 8 and ops.n_on_cpu == 0, ops.describe()   # every matrix in VRAM
    assert cuda_emulator.get("linear", 0) >= ops.n_matrices and cuda_emulator.get("attention", 0) >= 2
    assert _relative(got, want) < BOUND[qtype], (projector, qtype, _relative(got, want))


def test_a_causal_mask_would_show(tmp_path, cuda_emulator, monkeypatch):
    """The bound is tight enough to see the attention mask: each patch limited to those before it."""
    from edgeinfer.vision.gpu_encoder import GpuOps

    tables = GpuOps._tables

    def causal(self, n):
        table, slots, pos, _last = tables(self, n)
        return table, slots, pos, pos

    monkeypatch.setattr(GpuOps, "_tables", causal)
    want, got, _ = _both(tmp_path, "gemma3", "F32")
    assert _relative(got, want) > 10 * BOUND["F32"]


def _text_model(root, projector: str):
    """(text GGUF, prompt) of a tiny text model that takes the projector's rows."""
    if projector == "gemma3":
        return write_gemma3(root / "text.gguf", n_embd=64, n_layer=2), "the of and <__media__> to in is"
    if projector == "gemma4v":
        v = gemma4_vocab()
        v["tokens"] = list(v["tokens"]) + ["<|image>", "<image|>"]
        v["types"] = list(v["types"]) + [3, 3]
        return gemma4_file(root, "F32", vocab=v), "the and <__media__> hello world"
    vocab = bpe_vocab("qwen35")
    vocab["tokens"] = list(vocab["tokens"]) + ["<|vision_start|>", "<|vision_end|>"]
    vocab["types"] = list(vocab["types"]) + [3, 3]
    shape = TinyShape(n_embd=64, n_layer=2, n_head=2, n_head_kv=1, head_dim=32, n_ff=96, n_ctx=256,
                      ssm_state=16, rope_dims=16, n_ff_exp=32, n_ff_shexp=32)
    return write_tiny_model(root / "text.gguf", "qwen35", "F32", shape=shape, vocab=vocab), \
        "the and <__media__> hello world"


def _launches(calls: dict) -> int:
    return calls.get("linear", 0) + calls.get("attention", 0)


@pytest.mark.parametrize("projector", list(WRITERS))
def test_the_encoder_follows_the_text_models_gpu_layers(tmp_path, cuda_emulator, projector):
    import edgeinfer

    writer, _, (h, w) = WRITERS[projector]
    text, prompt = _text_model(tmp_path, projector)
    n_text = 256 if projector == "gemma4v" else 64   # the tiny Gemma 4 text model is 256 wide
    mmproj = writer(tmp_path / "mmproj.gguf", n_text, "F16")
    png = _png(h, w)

    def load(**kw):
        return edgeinfer.load(str(text), mmproj=str(mmproj), n_ctx=256, backend="cpu", **kw)

    gpu = load(gpu_layers=1)
    assert gpu.images.projector.ops.where == "GPU" and "vision encoder on the GPU" in gpu.placement
    cuda_emulator.clear()
    on_gpu = gpu.images.encode(png)
    assert cuda_emulator.get("attention", 0) > 0 and cuda_emulator.get("linear", 0) > 0, dict(cuda_emulator)

    kept = load(gpu_layers=1, mmproj_offload=False)
    assert kept.engine.backend.name == "hybrid"   # the text layer is on the GPU, the encoder is not
    assert kept.images.projector.ops.where == "CPU" and "--no-mmproj-offload" in kept.placement
    cuda_emulator.clear()
    on_cpu = kept.images.encode(png)
    assert _launches(cuda_emulator) == 0, dict(cuda_emulator)

    cpu = load(gpu_layers=0)
    assert cpu.images.projector.ops.where == "CPU" and "vision encoder on the CPU" in cpu.placement
    want = cpu.images.encode(png)
    assert np.array_equal(on_cpu.embeddings, want.embeddings)
    assert _relative(on_gpu.embeddings, want.embeddings) < BOUND["F16"]

    # the GPU encoder's rows in the CPU text model: the CPU's greedy answer (another digest, so
    # that no cached prefix of the first answer is reused for the second)
    other = hashlib.sha256(("gpu" + on_gpu.digest).encode()).hexdigest()
    on_gpu = dataclasses.replace(on_gpu, digest=other)
    tokens = cpu.generate(prompt, images=[want], max_tokens=TOKENS, temperature=0).tokens
    cpu.reset()
    assert cpu.generate(prompt, images=[on_gpu], max_tokens=TOKENS, temperature=0).tokens == tokens


def test_mmproj_offload_is_checked():
    import edgeinfer
    from edgeinfer.errors import EdgeInferError

    with pytest.raises(EdgeInferError, match="mmproj_offload must be True or False"):
        edgeinfer.load("no-such-model.gguf", mmproj_offload="no")


@pytest.mark.parametrize("n_cols, affine", [(72, True), (1152, True), (40, False)])
def test_layer_norm_kernel_is_ggml_norm(cuda_emulator, n_cols, affine):
    """launch.layer_norm against kernels_cpu's ggml_norm: rows wider than a block's threads, a
    width that is no multiple of 32, with and without weight and bias; rows far from zero mean."""
    from edgeinfer.kernels_cpu import ops
    from edgeinfer.kernels_cuda import launch
    from edgeinfer.vision.gpu_encoder import GpuOps

    gpu = GpuOps()
    rng = np.random.default_rng(n_cols)
    x = (rng.standard_normal((5, n_cols)) * 3 + 20).astype(np.float32)
    w = (rng.standard_normal(n_cols) * 0.1 + 1).astype(np.float32) if affine else None
    b = (rng.standard_normal(n_cols) * 0.1).astype(np.float32) if affine else None

    got = launch.layer_norm(gpu.device(x), gpu._vector(w), gpu._vector(b), 1e-6).get()
    want = ops.layer_norm(x, w if affine else np.ones(n_cols, np.float32), b, np.float32(1e-6))
    assert np.abs(got - want).max() < 1e-5, np.abs(got - want).max()


@pytest.mark.parametrize("argv, offload", [([], True), (["--no-mmproj-offload"], False)])
def test_run_passes_no_mmproj_offload_to_load(monkeypatch, tmp_path, argv, offload):
    """`edgeinfer run`'s flag becomes load's mmproj_offload (chat and serve read it the same way)."""
    import edgeinfer
    from edgeinfer.cli import build_parser
    from edgeinfer.commands.run_model import load_with_spinner

    mmproj = tmp_path / "mmproj.gguf"
    mmproj.write_bytes(b"")
    seen = {}

    class Loaded:
        placement = "cpu backend"

    monkeypatch.setattr(edgeinfer, "load", lambda name, **kw: seen.update(kw) or Loaded())
    args = build_parser().parse_args(["run", "model.gguf", "--mmproj", str(mmproj), *argv])
    load_with_spinner(args)
    assert seen["mmproj_offload"] is offload and seen["mmproj"] == str(mmproj)
    for command in (["chat", "m"], ["serve", "m"]):
        assert build_parser().parse_args([*command, *argv]).no_mmproj_offload is not offload
