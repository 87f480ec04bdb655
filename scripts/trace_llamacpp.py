"""Dump llama.cpp's named intermediate tensors (CPU) for one decode step, to find where a
forward pass first parts from llama.cpp (needs llama-cpp-python==0.3.36).

    python scripts/trace_llamacpp.py MODEL.gguf "prompt text" STEP out.npz

Feeds the prompt one token at a time (llama.cpp's decode path, as the goldens do) and
saves every F32/F16 tensor computed while evaluating token STEP, under ggml's node names
("attn_norm-0", "Qcur-0", "kq-0", "kqv_out-0", "ffn_out-0", "result_output", ...; a name
seen again gets "#1", "#2"). Compare them with edgeinfer's backend op outputs, op by op.
"""

from __future__ import annotations

import ctypes
import sys

import numpy as np


class _Tensor(ctypes.Structure):  # ggml.h's struct ggml_tensor (GGML_MAX_DIMS 4, MAX_SRC 10, MAX_NAME 64)
    _fields_ = [("type", ctypes.c_int32), ("buffer", ctypes.c_void_p),
                ("ne", ctypes.c_int64 * 4), ("nb", ctypes.c_size_t * 4), ("op", ctypes.c_int32),
                ("op_params", ctypes.c_int32 * 16), ("flags", ctypes.c_int32),
                ("src", ctypes.c_void_p * 10), ("view_src", ctypes.c_void_p), ("view_offs", ctypes.c_size_t),
                ("data", ctypes.c_void_p), ("name", ctypes.c_char * 64), ("extra", ctypes.c_void_p),
                ("padding", ctypes.c_char * 8)]


def trace(model: str, prompt: str, step: int) -> dict[str, np.ndarray]:
    import llama_cpp
    import llama_cpp.llama_cpp as low

    captured: dict[str, np.ndarray] = {}
    on = [False]

    @low.ggml_backend_sched_eval_callback
    def callback(tensor_ptr, ask, _user):
        if ask or not on[0]:
            return True  # ask: yes, compute every node separately so each can be read
        t = _Tensor.from_address(tensor_ptr)
        if t.type not in (0, 1):  # F32, F16
            return True
        ne, nb = list(t.ne), list(t.nb)
        size = sum((ne[i] - 1) * nb[i] for i in range(4)) + nb[0]
        buf = (ctypes.c_char * size).from_address(t.data)
        arr = np.ndarray(ne[::-1], np.float32 if t.type == 0 else np.float16, buf, strides=nb[::-1]).copy()
        name, k = t.name.decode(), 1
        key = name
        while key in captured:
            key, k = f"{name}#{k}", k + 1
        captured[key] = arr
        return True

    default_params = low.llama_context_default_params

    def with_callback():
        p = default_params()
        p.cb_eval = callback
        return p

    low.llama_context_default_params = with_callback
    try:
        llm = llama_cpp.Llama(model, n_ctx=512, n_threads=2, n_batch=1, n_ubatch=1, flash_attn=False,
                              logits_all=True, verbose=False)
    finally:
        low.llama_context_default_params = default_params
    ids = llm.tokenize(prompt.encode(), add_bos=True, special=False)
    for i, token in enumerate(ids[:step + 1]):
        on[0] = i == step
        llm.eval([token])
    return captured


if __name__ == "__main__":
    model, prompt, step, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    tensors = trace(model, prompt, step)
    np.savez(out, **tensors)
    print(f"{len(tensors)} tensors -> {out}")
