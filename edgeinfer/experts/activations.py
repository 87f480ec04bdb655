"""Expert activations other than SwiGLU's SiLU(gate) * up."""

from __future__ import annotations

import numpy as np

# gpt-oss: llama.cpp hard-codes them (llm_graph_context::build_moe_ffn), the file does not say
OAI_ALPHA = np.float32(1.702)
OAI_LIMIT = np.float32(7.0)


def swiglu_oai(gate: np.ndarray, up: np.ndarray, alpha: np.float32 = OAI_ALPHA,
               limit: np.float32 = OAI_LIMIT) -> np.ndarray:
    """gpt-oss's clamped SwiGLU as ggml_swiglu_oai computes it, op for op in float32:
    x = min(gate, limit), y = clamp(up, -limit, limit), x / (1 + expf(alpha * -x)) * (y + 1).
    The numpy statement of the compiled kernel (kernels_cpu.ops.swiglu_oai); expf is libm's,
    as ggml's."""
    x = np.minimum(np.asarray(gate, np.float32), limit)
    y = np.clip(np.asarray(up, np.float32), -limit, limit)
    from edgeinfer.kernels_cpu import libm  # Numba: not at import

    e = libm.expf(alpha * -x)
    glu = (x / (np.float32(1.0) + e)).astype(np.float32)
    return (glu * (y + np.float32(1.0))).astype(np.float32)
