"""Images with layers on the GPU (the CUDA emulator where no GPU is): an image's rows attend
non-causally in VRAM (launch.attention's per-query limit, qlim), M-RoPE grids and Gemma 4's
image rows go through the GPU layers, and the answer is the CPU's: the first token's logits
within the GPU's float noise (a text prompt alone differs ~1.2e-3 on these tiny files: F16
K/V and another summation order) and the same greedy tokens, all layers on the GPU and one.
The image rows taken causally move the logits by 2e-2 and more, so the mask is what is seen."""

from __future__ import annotations

import io

import numpy as np
import pytest
from gguf_factory import TinyShape, bpe_vocab, gemma4_file, gemma4_vocab, write_tiny_model
from image_fixtures import write_gemma3

TOKENS = 8
NOISE = 4e-3   # max |gpu - cpu| / max |cpu|, first token's logits
CAUSAL = 2e-2  # what the same rows attended causally move them by, at least


def _png(seed: int, h: int, w: int) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([x * 6, y * 5, (x * y) % 256], -1)
    pixels = np.clip(base + rng.integers(-60, 60, base.shape), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def _gemma3(root, window, n_layer):
    import mmproj_factory

    text = write_gemma3(root / "text.gguf", n_embd=64, sliding_window=window, n_layer=n_layer)
    return text, mmproj_factory.write_gemma3_mmproj(root / "mmproj.gguf", n_embd_text=64, qtype="F32"), 64, \
        "the of and <__media__> to in is", (48, 40)


def _gemma4(root):
    import mmproj_factory

    v = gemma4_vocab()
    v["tokens"] = list(v["tokens"]) + ["<|image>", "<image|>"]
    v["types"] = list(v["types"]) + [3, 3]
    return gemma4_file(root, "F32", vocab=v), mmproj_factory.write_gemma4v_mmproj(root / "mmproj.gguf", 256, "F32"), \
        256, "the and <__media__> hello world", (56, 40)


def _qwen35(root, arch):
    import mmproj_factory

    vocab = bpe_vocab("qwen35")
    vision = ("<|vision_start|>", "<|vision_end|>")
    vocab["tokens"] = list(vocab["tokens"]) + list(vision)
    vocab["types"] = list(vocab["types"]) + [3] * len(vision)
    shape = TinyShape(n_embd=64, n_layer=2, n_head=2, n_head_kv=1, head_dim=32, n_ff=96, n_ctx=256,
                      ssm_state=16, rope_dims=16, n_ff_exp=32, n_ff_shexp=32)
    text = write_tiny_model(root / "text.gguf", arch, "F32", shape=shape, vocab=vocab)
    return text, mmproj_factory.write_qwen3vl_mmproj(root / "mmproj.gguf", 64, "F32"), 64, \
        "the and <__media__> hello world", (24, 40)


CASES = {
    "gemma3-window-512": lambda root: _gemma3(root, 512, 2),
    "gemma3-window-6": lambda root: _gemma3(root, 6, 4),   # image rows whose window reaches before the image
    "gemma4": _gemma4,                                      # per-layer inputs, shared K/V, unscaled rows
    "qwen35": lambda root: _qwen35(root, "qwen35"),         # M-RoPE grid positions, DeltaNet layers
}


def _first_logits(model, prompt: str, png: bytes, n_embd: int, causal: bool = False) -> np.ndarray:
    from edgeinfer.vision.chunk import ImageChunk
    from edgeinfer.vision.media_ids import MediaRows

    seen = []
    model.generate(prompt, images=[png], max_tokens=1, temperature=0, on_prompt=seen.append)
    model.reset()
    chunk = model.images.encode(png)
    if causal:
        chunk = ImageChunk(chunk.embeddings, chunk.digest, non_causal=False)
    media = MediaRows([chunk], n_embd, mrope=chunk.grid is not None)
    return model.engine.prefill(seen[0], model.engine.new_cache(), media=media)


@pytest.mark.parametrize("case", list(CASES))
def test_an_image_on_the_gpu_gives_the_cpus_answer(tmp_path, cuda_emulator, case):
    import edgeinfer

    text, mmproj, n_embd, prompt, (h, w) = CASES[case](tmp_path)
    png = _png(1, h, w)
    cpu = edgeinfer.load(str(text), mmproj=str(mmproj), n_ctx=256, backend="cpu", gpu_layers=0)
    want = _first_logits(cpu, prompt, png, n_embd)
    want_tokens = cpu.generate(prompt, images=[png], max_tokens=TOKENS, temperature=0).tokens
    scale = np.abs(want).max()
    n_layer = cpu.engine.config.n_layer
    for ngl in sorted({n_layer, 1}, reverse=True):
        gpu = edgeinfer.load(str(text), mmproj=str(mmproj), n_ctx=256, backend="cpu", gpu_layers=ngl)
        assert gpu.engine.backend.name == "hybrid"
        cuda_emulator.clear()
        got = _first_logits(gpu, prompt, png, n_embd)
        # qwen35's first layer is DeltaNet: with one GPU layer, its attention runs on the CPU
        assert cuda_emulator.get("attention", 0) > 0 or (case == "qwen35" and ngl == 1), dict(cuda_emulator)
        assert cuda_emulator.get("linear", 0) > 0
        assert np.abs(got - want).max() < NOISE * scale, (ngl, np.abs(got - want).max() / scale)
        assert gpu.generate(prompt, images=[png], max_tokens=TOKENS, temperature=0).tokens == want_tokens, ngl
        if ngl == n_layer and case != "qwen35":   # qwen35's images are causal in libmtmd
            gpu.reset()
            causal = _first_logits(gpu, prompt, png, n_embd, causal=True)
            assert np.abs(causal - want).max() > CAUSAL * scale
