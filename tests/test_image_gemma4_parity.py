"""Gemma 4 with an image, end to end, against llama.cpp + libmtmd: greedy tokens after the image agree.

The same tiny Gemma 4 (E2B's kinds of layers: per-layer embeddings, shared K/V, sliding and
global layers) and tiny gemma4v mmproj on both sides. libmtmd tokenizes the prompt around the
marker, wraps the image in <|image> ... <image|>, and mtmd_helper_eval_chunks decodes the image
rows in one batch, non-causal (the text width is not E2B's or E4B's), unscaled, their per-layer
inputs from token 0's row; then greedy decoding. Measured: the first token's logits within
4.8e-4 of llama.cpp's (max difference / max |logit|), what this tiny Gemma 4 gives on a text
prompt alone too (5.0e-4); the tokens equal. The image rows taken causally give 0.42, scaled
by Gemma's sqrt(n_embd) 1.0, their per-layer inputs from another token's row 0.41.
"""
from __future__ import annotations

import io

import mtmd_oracle
import numpy as np
import pytest
from gguf_factory import gemma4_file, gemma4_vocab
from mmproj_factory import write_gemma4v_mmproj

N_TEXT = 256
STEPS = 6
PROMPT = "the and <__media__> hello world"


def _png(seed: int, width: int = 40, height: int = 56) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 6, y * 4, (x * y) % 256], -1)
    pixels = np.clip(base + rng.integers(-60, 60, base.shape), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def _vocab() -> dict:
    """The tiny Gemma 4 vocabulary plus its image tokens (control tokens, as in Gemma 4's)."""
    v = gemma4_vocab()
    v["tokens"] = list(v["tokens"]) + ["<|image>", "<image|>"]
    v["types"] = list(v["types"]) + [3, 3]
    return v


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma4img")
    text = gemma4_file(root, "F32", vocab=_vocab())
    return text, write_gemma4v_mmproj(root / "mmproj.gguf", N_TEXT, "F32")


def test_greedy_tokens_after_an_image_match_llama_cpp(files):
    if not mtmd_oracle.available():
        pytest.skip(mtmd_oracle.REASON)
    import edgeinfer
    from edgeinfer.vision.media_ids import MediaRows

    text, mmproj = files
    ref = mtmd_oracle.LlamaMtmd(text, mmproj)
    model = edgeinfer.load(str(text), mmproj=str(mmproj), n_ctx=512, backend="cpu")
    try:
        answers, firsts = [], []
        for seed in (1, 2):
            png = _png(seed)
            want, want_first, _ = ref.greedy(PROMPT, png, STEPS)
            prompts = []
            got = model.generate(PROMPT, images=[png], max_tokens=STEPS, temperature=0, on_prompt=prompts.append)
            model.reset()
            media = MediaRows([model.images.encode(png)], N_TEXT)
            first = model.engine.prefill(prompts[0], model.engine.new_cache(), media=media)
            err = np.abs(first - want_first).max() / np.abs(want_first).max()
            print(f"image {seed}: first logits max |ours - llama.cpp| / max |llama.cpp| = {err:.1e}, tokens {got.tokens}")
            assert err < 1e-3, (seed, err)
            assert len(got.tokens) >= 1 and got.tokens == want[:len(got.tokens)], (seed, got.tokens, want)
            answers.append(got.tokens)
            firsts.append(first)
        assert np.abs(firsts[0] - firsts[1]).max() > 1e-3   # the image is seen
    finally:
        ref.close()
