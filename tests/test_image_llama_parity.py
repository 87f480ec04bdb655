"""A prompt with an image, end to end, against llama.cpp's: the same tiny Gemma 3 text model and
mmproj, libmtmd's tokenize + eval (mtmd_helper_eval_chunks: the image in one non-causal batch)
then greedy decoding, against edgeinfer.load(..., mmproj=...).generate(prompt, images=[png])."""

from __future__ import annotations

import io

import mtmd_oracle
import numpy as np
import pytest

from image_fixtures import write_gemma3

N_EMBD = 64
STEPS = 8
PROMPT = "the of and <__media__> to in is"


def _png(seed: int) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:48, 0:40]
    base = np.stack([x * 6, y * 5, (x * y) % 256], -1)
    pixels = np.clip(base + rng.integers(-60, 60, base.shape), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module", params=[512, 6], ids=["window-512", "window-6"])
def files(tmp_path_factory, request):
    """Window 6: the sliding-window layers' windows cut into the text before the image, so
    image rows whose window starts before the image's end take the one-row path; 4 layers, so
    that what those rows compute in the first layers reaches the last token's window."""
    pytest.importorskip("edgeinfer.vision.gemma3", reason="the gemma3 projector has not landed")
    mmproj_factory = pytest.importorskip("mmproj_factory")
    root = tmp_path_factory.mktemp("imgparity")
    text = write_gemma3(root / "text.gguf", n_embd=N_EMBD, sliding_window=request.param,
                        n_layer=2 if request.param > 20 else 4)
    mmproj = mmproj_factory.write_gemma3_mmproj(root / "mmproj.gguf", n_embd_text=N_EMBD, qtype="F32")
    return text, mmproj, request.param


def test_greedy_tokens_after_an_image_match_llama_cpp(files):
    import edgeinfer

    text, mmproj, _ = files
    if not mtmd_oracle.available():
        pytest.skip(mtmd_oracle.REASON)
    ref = mtmd_oracle.LlamaMtmd(text, mmproj)
    model = edgeinfer.load(str(text), mmproj=str(mmproj), n_ctx=512, backend="cpu")
    try:
        results = {}
        for seed in (1, 2):
            png = _png(seed)
            want, want_logits, _ = ref.greedy(PROMPT, png, STEPS)
            seen = []
            got = model.generate(PROMPT, images=[png], max_tokens=STEPS, temperature=0, on_prompt=seen.append)
            model.reset()
            # the first token's logits, prefilled with the image, agree to llama.cpp's float noise
            ours = model.engine.prefill(seen[0], model.engine.new_cache(), media=_media(model, png))
            err = np.abs(ours - want_logits).max() / np.abs(want_logits).max()
            assert err < 1e-3, (seed, err)  # measured 5e-6 (window 512); a causal image: 0.07-0.09
            print(f"window {files[2]} image {seed}: max |ours - llama.cpp| / max |llama.cpp| = {err:.1e}")
            assert got.tokens == want[:len(got.tokens)] and len(got.tokens) >= 1, (seed, got.tokens, want)
            results[seed] = (got.tokens, ours)
        # two different images: different answers
        assert np.abs(results[1][1] - results[2][1]).max() > 1e-3
        if files[2] > 20:  # a 2-layer tiny Gemma has sliding-window layers only: a window of 6 keeps the
            assert results[1][0] != results[2][0]  # image out of later tokens' view
    finally:
        ref.close()


def _media(model, png: bytes):
    from edgeinfer.vision.media_ids import MediaRows

    return MediaRows([model.images.encode(png)], N_EMBD)
