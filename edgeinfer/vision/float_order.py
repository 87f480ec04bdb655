"""When an encode's float work follows ggml's order (kernels_cpu.f32_ggml, attention_f32_ggml)
rather than the BLAS paths.

An mmproj with 8-bit (block-quantized) matrices rounds every activation they read to 8 bits,
so a last-bit difference upstream can move one activation a whole quantum (1/127 of its
block's scale: 2-4e-3 of the embeddings, measured on Gemma 4's tower). ggml's order removes
that, at a price: its attention scores are one vec_dot a (query, key) pair (~3 ns a pair on
two cores with 16 keys in the vector lanes; its whole attention 3.7x BLAS's at 4096
patches), and a Gemma-3-4B-shaped Q8_0 encode of 4096 patches takes 87 s in ggml's order
against llama.cpp's 47 s (AVX-512 Xeon). So ggml's order holds while an encode's attention
is small, as the text side keeps llama.cpp's exact attention up to 64 queries
(kv_attention.EXACT_MAX_QUERIES): patches^2 x width up to EXACT_ORDER_MACS, ~1000 patches
of a full-size tower. Past it, and for F16/F32 files (where no 8-bit rounding amplifies a
last bit: within 3e-4), the BLAS paths.
"""
from __future__ import annotations

from dataclasses import dataclass

EXACT_ORDER_MACS = 1 << 30   # an attention layer's patches^2 x width (a 4B-shaped tower: 965 patches)


@dataclass(frozen=True)
class FloatOrder:
    quantized: bool   # the file has 8-bit matrices
    width: int        # the tower's embedding width

    def ggml_for(self, n_patches: int) -> bool:
        """Whether an encode of this many patches (rows of a product) takes ggml's order."""
        return self.quantized and n_patches * n_patches * self.width <= EXACT_ORDER_MACS
