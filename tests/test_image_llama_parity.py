"""A prompt with an image, end to end, against llama.cpp's: the same tiny Gemma 3 text model and
mmproj, libmtmd's tokenize + eval (mtmd_helper_eval_chunks: the image in one non-causal batch)
then greedy decoding, against edgeinfer.load(..., mmproj=...).generate(prompt, images=[png])."""

from __future__ import annotations

import ctypes
import io

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


class LlamaMtmd:
    """llama.cpp + libmtmd on one text model and mmproj: prompt logits, then greedy tokens."""

    def __init__(self, text_path, mmproj_path) -> None:
        self.L = pytest.importorskip("llama_cpp")
        self.M = pytest.importorskip("llama_cpp.mtmd_cpp", reason="this llama-cpp-python has no libmtmd bindings")
        L, M = self.L, self.M
        L.llama_backend_init()
        self.model = L.llama_model_load_from_file(str(text_path).encode(), L.llama_model_default_params())
        assert self.model
        cparams = L.llama_context_default_params()
        cparams.n_ctx, cparams.n_batch, cparams.n_ubatch = 512, 512, 512
        cparams.n_threads = cparams.n_threads_batch = 2
        cparams.flash_attn_type = 0  # off: F16 K/V and the plain softmax, as edgeinfer's default
        self.lctx = L.llama_init_from_model(self.model, cparams)
        assert self.lctx
        params = M.mtmd_context_params_default()
        params.use_gpu, params.n_threads, params.warmup, params.print_timings = False, 2, False, False
        params.flash_attn_type = 0
        self.ctx = M.mtmd_init_from_file(str(mmproj_path).encode(), self.model, params)
        assert self.ctx
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))

    def greedy(self, prompt: str, png: bytes, steps: int) -> tuple[list[int], np.ndarray]:
        L, M = self.L, self.M
        L.llama_memory_clear(L.llama_get_memory(self.lctx), True)
        data = (ctypes.c_ubyte * len(png)).from_buffer_copy(png)
        bitmap = M.mtmd_helper_bitmap_init_from_buf(self.ctx, data, len(png), False)
        assert bitmap
        chunks = M.mtmd_input_chunks_init()
        try:
            text = prompt.replace("<__media__>", M.mtmd_default_marker().decode()).encode()
            inp = M.mtmd_input_text(text, len(text), True, True)
            bitmaps = (M.mtmd_bitmap_p_ctypes * 1)(bitmap)
            assert M.mtmd_tokenize(self.ctx, chunks, ctypes.byref(inp), bitmaps, 1) == 0
            n_past = L.llama_pos(0)
            assert M.mtmd_helper_eval_chunks(self.ctx, self.lctx, chunks, 0, 0, 512, True, ctypes.byref(n_past)) == 0
        finally:
            M.mtmd_input_chunks_free(chunks)
            M.mtmd_bitmap_free(bitmap)
        first = self._logits()
        logits, tokens = first, []
        for _ in range(steps):
            tokens.append(int(np.argmax(logits)))
            arr = (L.llama_token * 1)(tokens[-1])
            assert L.llama_decode(self.lctx, L.llama_batch_get_one(arr, 1)) == 0
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
    import edgeinfer

    text, mmproj, _ = files
    ref = LlamaMtmd(text, mmproj)
    model = edgeinfer.load(str(text), mmproj=str(mmproj), n_ctx=512, backend="cpu")
    try:
        results = {}
        for seed in (1, 2):
            png = _png(seed)
            want, want_logits = ref.greedy(PROMPT, png, STEPS)
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
