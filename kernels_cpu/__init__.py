"""Numba CPU kernels that compute on GGUF quantized blocks directly (like ggml-quants).

Weights are the raw GGUF bytes: C-contiguous uint8 (n_rows, row_bytes), may be a read-only mmap view;
or a Q4_K matrix interleaved in eights (repack.py, type id Q4_K_X8), the CPU backend's copy on AVX-512.
    matvec(w_raw, qtype, x, out=None)          x (n_cols,) f32 -> (n_rows,) f32          decode
    matvec_many([w...], [qtype...], x)         the same for 2-3 matrices at once (QKV, gate+up)
    matmul(w_raw, qtype, X, out=None)          X (n_tok, n_cols) f32 -> (n_tok, n_rows) f32  prefill
    matmul_many([w...], [qtype...], X)         the same for matrices on one input (one quantization)
    expert_matvec([w...], [qtype...], experts, starts, rows_of, n_per, X)  a MoE layer's experts, one call
    get_rows(w_raw, qtype, n_cols, ids)        -> (len(ids), n_cols) f32                 embeddings
    dequantize_rows(w_raw, qtype, n_cols, start, stop, out=None) -> (stop-start, n_cols) f32
    set_threads(n) / get_threads(), supported_types(), quant_info(qtype), row_bytes(qtype, n_cols)
    use_model_types(tensors)                   one kernel set for a model's types (only their code compiles)
Float ops: rms_norm, rope_inplace, gelu_mul (ops.py); attention (kv_attention.py).

Files: quant_types (the type registry); matvec (entry points) -> dispatch (type dispatch,
kernel sets, claims) -> dot_q32 / dot_mxfp4 / dot_kquant / dot_q4k_x8 (IR row dots and dequantization,
built with ir_helpers); quant_kernels (plain Numba kernels); tile_gemm (8-bit prefill
tiles, VNNI); gemm_kquant (8-bit K-quant / IQ4_XS prefill, AVX2); repack (Q4_K_X8); kv_attention (+ kv_attention_ir, ggml_math); ops, f16,
f32_ggml (F32 matrices in ggml's order), gemm_float (BLAS) and softmax_rows (the vision encoders' float GEMM and softmax),
fused_layer (one decode MLP a call); threads, cache_dir, cache_load, compile_progress and
prompt_plan (the prompt kernels a model reaches, registered and warmed at load).
"""
from . import cache_dir as _cache_dir
from . import cache_load as _cache_load

_cache_dir.configure()   # before any kernel is defined: Numba's cache keyed to these sources
_cache_load.install()    # cached kernels load without Numba's full registry refresh

from .matvec import (  # noqa: E402
                     decode_order, dequantize_rows, expert_matvec, get_rows, matmul, matmul_many, matmul_uses_int8, matvec,
                     matvec_many,
                     quantize_activation_rows, quantize_activations)
from .prompt_plan import use_model_types  # noqa: E402
from .kv_attention import attention
from .ops import gelu_mul, rms_norm, rope_inplace
from .quant_types import QUANT_INFO, QuantInfo, quant_info, row_bytes, supported_types
from .reference import reference_dequantize, reference_matmul, reference_matvec
from .threads import get_threads, set_threads, single_threaded_blas

__all__ = [
    "decode_order", "matvec", "matvec_many", "expert_matvec", "matmul", "matmul_many", "get_rows", "dequantize_rows", "quantize_activations", "quantize_activation_rows",
    "matmul_uses_int8", "use_model_types", "supported_types", "quant_info", "row_bytes", "QuantInfo", "QUANT_INFO",
    "set_threads", "get_threads", "single_threaded_blas", "rms_norm", "rope_inplace", "gelu_mul", "attention",
    "reference_dequantize", "reference_matvec", "reference_matmul",
]
