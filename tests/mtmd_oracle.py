"""libmtmd (llama.cpp's tools/mtmd, through llama_cpp's ctypes): the image encoder oracle for
tests and benchmarks."""
from __future__ import annotations

import ctypes

import numpy as np

REASON = "llama-cpp-python with libmtmd (the image oracle) is not installed"


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
