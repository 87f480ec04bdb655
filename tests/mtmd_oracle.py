"""libmtmd (llama.cpp's tools/mtmd, through llama_cpp's ctypes): the image encoder oracle for
tests and benchmarks."""
from __future__ import annotations

import ctypes

import numpy as np

REASON = "llama-cpp-python with libmtmd (the image oracle) is not installed; .ci/run installs it from ../shared/wheels"


def available() -> bool:
    try:
        import llama_cpp.mtmd_cpp  # noqa: F401
    except (ImportError, OSError):
        return False
    return True


class Mtmd:
    """libmtmd with one text model and one mmproj: encode(pixels) -> (n_tokens, n_embd).
    flash_attn False: F32 attention, as ours (libmtmd's CPU flash attention rounds Q, K and V
    to F16); None: libmtmd's default, what its users get."""

    def __init__(self, text_path, mmproj_path, n_threads: int = 2, flash_attn: bool | None = False) -> None:
        import llama_cpp
        import llama_cpp.mtmd_cpp as M

        self.llama, self.M = llama_cpp, M
        llama_cpp.llama_backend_init()
        self.model = llama_cpp.llama_model_load_from_file(str(text_path).encode(), llama_cpp.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {text_path}")
        params = M.mtmd_context_params_default()
        params.use_gpu, params.n_threads, params.warmup, params.print_timings = False, n_threads, False, False
        if flash_attn is not None:
            params.flash_attn_type = 1 if flash_attn else 0   # LLAMA_FLASH_ATTN_TYPE_ENABLED / _DISABLED
        self.ctx = M.mtmd_init_from_file(str(mmproj_path).encode(), self.model, params)
        if not self.ctx:
            llama_cpp.llama_model_free(self.model)
            raise RuntimeError(f"libmtmd could not load {mmproj_path}")
        self.n_embd = llama_cpp.llama_model_n_embd(self.model)

    def encode(self, pixels: np.ndarray) -> np.ndarray:
        M = self.M
        h, w = pixels.shape[:2]
        data = (ctypes.c_uint8 * pixels.size).from_buffer_copy(np.ascontiguousarray(pixels).tobytes())
        bitmap = M.mtmd_bitmap_init(w, h, data)
        chunks = M.mtmd_input_chunks_init()
        try:
            text = b"look: " + M.mtmd_default_marker() + b" done"
            inp = M.mtmd_input_text(text, len(text), True, True)
            bitmaps = (M.mtmd_bitmap_p_ctypes * 1)(bitmap)
            if M.mtmd_tokenize(self.ctx, chunks, ctypes.byref(inp), bitmaps, 1) != 0:
                raise RuntimeError("mtmd_tokenize failed")
            images = [M.mtmd_input_chunks_get(chunks, i) for i in range(M.mtmd_input_chunks_size(chunks))]
            images = [c for c in images if M.mtmd_input_chunk_get_type(c) == M.MTMD_INPUT_CHUNK_TYPE_IMAGE]
            if len(images) != 1:
                raise RuntimeError(f"{len(images)} image chunks for one image")
            n = M.mtmd_input_chunk_get_n_tokens(images[0])
            if M.mtmd_encode_chunk(self.ctx, images[0]) != 0:
                raise RuntimeError("mtmd_encode_chunk failed")
            out = M.mtmd_get_output_embd(self.ctx)
            return np.ctypeslib.as_array(out, shape=(n * self.n_embd,)).reshape(n, self.n_embd).copy()
        finally:
            M.mtmd_input_chunks_free(chunks)
            M.mtmd_bitmap_free(bitmap)

    def close(self) -> None:
        self.M.mtmd_free(self.ctx)
        self.llama.llama_model_free(self.model)


class LlamaMtmd:
    """llama.cpp's context + libmtmd on one text model and mmproj: a prompt with one image
    (libmtmd's helper evaluates its chunks), then greedy tokens. Flash attention off: F16 K/V
    and the plain softmax, as edgeinfer's CPU default."""

    def __init__(self, text_path, mmproj_path, n_ctx: int = 512) -> None:
        import llama_cpp as L
        import llama_cpp.mtmd_cpp as M

        self.L, self.M, self.n_ctx = L, M, n_ctx
        L.llama_backend_init()
        self.model = L.llama_model_load_from_file(str(text_path).encode(), L.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {text_path}")
        cp = L.llama_context_default_params()
        cp.n_ctx = cp.n_batch = cp.n_ubatch = n_ctx
        cp.n_threads = cp.n_threads_batch = 2
        cp.flash_attn_type = 0
        self.lctx = L.llama_init_from_model(self.model, cp)
        mp = M.mtmd_context_params_default()
        mp.use_gpu, mp.n_threads, mp.warmup, mp.print_timings, mp.flash_attn_type = False, 2, False, False, 0
        self.ctx = M.mtmd_init_from_file(str(mmproj_path).encode(), self.model, mp)
        if not self.lctx or not self.ctx:
            raise RuntimeError(f"llama.cpp or libmtmd could not start on {text_path} + {mmproj_path}")
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))

    def greedy(self, prompt: str, png: bytes, steps: int) -> tuple[list[int], np.ndarray, dict]:
        """Greedy tokens after `prompt` (its `<__media__>` the image), the first token's logits,
        and the image's placement by libmtmd (placement())."""
        L, M = self.L, self.M
        L.llama_memory_clear(L.llama_get_memory(self.lctx), True)
        data = (ctypes.c_ubyte * len(png)).from_buffer_copy(png)
        bitmap = M.mtmd_helper_bitmap_init_from_buf(self.ctx, data, len(png), False)
        if not bitmap:
            raise RuntimeError("libmtmd could not decode the image")
        chunks = M.mtmd_input_chunks_init()
        try:
            text = prompt.replace("<__media__>", M.mtmd_default_marker().decode()).encode()
            inp = M.mtmd_input_text(text, len(text), True, True)
            if M.mtmd_tokenize(self.ctx, chunks, ctypes.byref(inp), (M.mtmd_bitmap_p_ctypes * 1)(bitmap), 1) != 0:
                raise RuntimeError("mtmd_tokenize failed")
            place = self.placement(chunks)
            n_past = L.llama_pos(0)
            if M.mtmd_helper_eval_chunks(self.ctx, self.lctx, chunks, 0, 0, self.n_ctx, True,
                                         ctypes.byref(n_past)) != 0:
                raise RuntimeError("mtmd_helper_eval_chunks failed")
            place["n_past"] = n_past.value
        finally:
            M.mtmd_input_chunks_free(chunks)
            M.mtmd_bitmap_free(bitmap)
        first = logits = self._logits()
        tokens: list[int] = []
        for _ in range(steps):
            tokens.append(int(np.argmax(logits)))
            if L.llama_decode(self.lctx, L.llama_batch_get_one((L.llama_token * 1)(tokens[-1]), 1)) != 0:
                raise RuntimeError("llama_decode failed")
            logits = self._logits()
        return tokens, first, place

    def placement(self, chunks) -> dict:
        """The (last) image chunk's start, grid (rows, cols), n_pos and each row's (t, h, w)."""
        M = self.M
        pos, out = 0, {}
        for i in range(M.mtmd_input_chunks_size(chunks)):
            chunk = M.mtmd_input_chunks_get(chunks, i)
            if M.mtmd_input_chunk_get_type(chunk) == M.MTMD_INPUT_CHUNK_TYPE_IMAGE:
                img = M.mtmd_input_chunk_get_tokens_image(chunk)
                n = M.mtmd_image_tokens_get_n_tokens(img)
                rows = [M.mtmd_image_tokens_get_decoder_pos(img, pos, r) for r in range(n)]
                # llama's batch takes t, y (row), x (column): the M-RoPE sections' order
                out = {"start": pos, "grid": (M.mtmd_image_tokens_get_ny(img), M.mtmd_image_tokens_get_nx(img)),
                       "n_pos": M.mtmd_input_chunk_get_n_pos(chunk), "thw": [(p.t, p.y, p.x) for p in rows]}
            pos += M.mtmd_input_chunk_get_n_pos(chunk)
        return out

    def _logits(self) -> np.ndarray:
        ptr = self.L.llama_get_logits_ith(self.lctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()

    def close(self) -> None:
        self.M.mtmd_free(self.ctx)
        self.L.llama_free(self.lctx)
        self.L.llama_model_free(self.model)
