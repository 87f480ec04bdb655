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

import ctypes
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


class LlamaWithImages:
    """llama.cpp's context + libmtmd: a prompt with one image, then greedy tokens."""

    def __init__(self, text_path, mmproj_path) -> None:
        import llama_cpp as L
        import llama_cpp.mtmd_cpp as M

        self.L, self.M = L, M
        L.llama_backend_init()
        self.model = L.llama_model_load_from_file(str(text_path).encode(), L.llama_model_default_params())
        assert self.model
        cp = L.llama_context_default_params()
        cp.n_ctx = cp.n_batch = cp.n_ubatch = 512
        cp.n_threads = cp.n_threads_batch = 2
        cp.flash_attn_type = 0   # off: F16 K/V and the plain softmax, as edgeinfer's CPU default
        self.lctx = L.llama_init_from_model(self.model, cp)
        assert self.lctx
        mp = M.mtmd_context_params_default()
        mp.use_gpu, mp.n_threads, mp.warmup, mp.print_timings, mp.flash_attn_type = False, 2, False, False, 0
        self.ctx = M.mtmd_init_from_file(str(mmproj_path).encode(), self.model, mp)
        assert self.ctx
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))

    def greedy(self, prompt: str, png: bytes, steps: int) -> tuple[list[int], np.ndarray]:
        L, M = self.L, self.M
        L.llama_memory_clear(L.llama_get_memory(self.lctx), True)
        data = (ctypes.c_ubyte * len(png)).from_buffer_copy(png)
        bitmap = M.mtmd_helper_bitmap_init_from_buf(self.ctx, data, len(png), False)
        chunks = M.mtmd_input_chunks_init()
        try:
            text = prompt.replace("<__media__>", M.mtmd_default_marker().decode()).encode()
            inp = M.mtmd_input_text(text, len(text), True, True)
            assert M.mtmd_tokenize(self.ctx, chunks, ctypes.byref(inp), (M.mtmd_bitmap_p_ctypes * 1)(bitmap), 1) == 0
            n_past = L.llama_pos(0)
            assert M.mtmd_helper_eval_chunks(self.ctx, self.lctx, chunks, 0, 0, 512, True, ctypes.byref(n_past)) == 0
        finally:
            M.mtmd_input_chunks_free(chunks)
            M.mtmd_bitmap_free(bitmap)
        first = logits = self._logits()
        tokens = []
        for _ in range(steps):
            tokens.append(int(np.argmax(logits)))
            assert L.llama_decode(self.lctx, L.llama_batch_get_one((L.llama_token * 1)(tokens[-1]), 1)) == 0
            logits = self._logits()
        return tokens, first

    def _logits(self) -> np.ndarray:
        ptr = self.L.llama_get_logits_ith(self.lctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()

    def close(self) -> None:
        self.M.mtmd_free(self.ctx)
        self.L.llama_free(self.lctx)
        self.L.llama_model_free(self.model)


def test_greedy_tokens_after_an_image_match_llama_cpp(files):
    if not mtmd_oracle.available():
        pytest.skip(mtmd_oracle.REASON)
    import edgeinfer
    from edgeinfer.vision.media_ids import MediaRows

    text, mmproj = files
    ref = LlamaWithImages(text, mmproj)
    model = edgeinfer.load(str(text), mmproj=str(mmproj), n_ctx=512, backend="cpu")
    try:
        answers, firsts = [], []
        for seed in (1, 2):
            png = _png(seed)
            want, want_first = ref.greedy(PROMPT, png, STEPS)
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
