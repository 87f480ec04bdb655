"""The numpy reference of llama.cpp's CPU flash attention (`ggml_compute_forward_flash_attn_ext_f16_one_chunk`)
over a quantized or F16 K/V cache: the spec that kernels_cpu/flash_attention.py compiles.

This is the path llama.cpp takes whenever K or V is quantized (the tiled and split-KV paths
need F16 K and V of one type). Per query row and head, in ggml's order:

1. Q is converted to K's vec_dot_type: F16 for F16 K (round to nearest even); for q8_0,
   q4_0, q5_0 K the AVX2 q8_0 quantizer, for q4_1 / q5_1 K the AVX2 q8_1 one (kv_quant.py).
2. Keys in cache order; a masked key is skipped (ggml: mask -inf -> `continue`).
   s = vec_dot(K row, Q) — quantized: per 32-block 8 int32 lane sums of 4 products each,
   acc = fma(dK*dQ, lanes, acc) (an <8 x float> accumulator), then hsum_float_8; q4_1/q5_1
   add summs = sum of mK*sQ (float32, fused by the compiler) after the horizontal sum.
   iq4_nl K (ggml_vec_dot_iq4_nl_q8_0): even blocks in one accumulator, odd ones in a
   second, hsum_float_8 of their sum, then an odd last block's d * (its integer dot) added
   unfused.
   F16 K: ggml_vec_dot_f16 (32 float32 slots, the fixed reduction into double).
   s = s*scale; with a softcap, scale was divided by it and s = softcap*tanhf(s).
3. Online softmax with libm expf (not ggml_v_expf): a new maximum scales the accumulator
   by ms = expf(Mold - M) and adds V with weight 1; otherwise weight vs = expf(s - M).
   V F16: an F16 accumulator, y = f16(fma(v, vs, y)) and the rescale f16(y*ms);
   V quantized: V dequantized to float32 (ggml-base to_float), y = fma(v, vs, y) in float32.
   S = fma(S, ms, vs) (the compiler fuses it; ggml_flash_attn_ext's own op, run through
   ctypes in tests/ggml_flash_oracle.py, confirms each of these choices).
4. Sinks (gpt-oss) join after the last key, S = S*ms + vs unfused there; out = VKQ * (1/S)
   (0 when S == 0).
"""
from __future__ import annotations

import numpy as np

from . import kv_quant
from .ggml_math_ref import SLOTS, hsum8, reduce_slots
from .libm import expf, tanhf



def _fma(a, b, c):
    """float32 fma, as ggml_math.fma_f32: the float32 product is exact in float64."""
    return (np.asarray(a, np.float32).astype(np.float64) * np.asarray(b, np.float32) + np.asarray(c, np.float32)
            ).astype(np.float32)


def quantize_q(type_k: str, q: np.ndarray) -> np.ndarray:
    """Q rows (..., hd) in K's vec_dot_type: F16 values (as float16) or raw q8_0 / q8_1 blocks."""
    vt = kv_quant.VEC_DOT_TYPE[type_k]
    if vt == "f16":
        return np.asarray(q, np.float32).astype(np.float16)
    return kv_quant.quantize(vt, q)


def kq_dots(type_k: str, k: np.ndarray, qq: np.ndarray) -> np.ndarray:
    """s[t, h, j] = vec_dot(K row j of head h's K/V head, Q_q[t, h]) -> float32 (n, n_head, S).

    k: (S, n_kv, row) raw blocks, or float16 (S, n_kv, hd); qq from quantize_q (n, n_head, ...)."""
    n, n_head = qq.shape[:2]
    n_keys, n_kv = k.shape[:2]
    g = n_head // n_kv
    if type_k == "f16":
        hd = k.shape[2]
        q16 = qq.astype(np.float32).reshape(n, n_kv, g, hd)
        k32 = np.asarray(k, np.float16).astype(np.float32)
        n_vec = hd - hd % SLOTS   # ggml_vec_dot_f16: 32 slots, 64 on AVX-512
        slots = np.zeros((n, n_kv, g, n_keys, SLOTS), np.float32)
        for c in range(0, n_vec, SLOTS):
            slots += q16[:, :, :, None, c:c + SLOTS] * k32[:, :, c:c + SLOTS].transpose(1, 0, 2)[None, :, None]
        dots = reduce_slots(slots).astype(np.float64)
        if n_vec < hd:
            dots += np.einsum("tkgd,skd->tkgs", q16[..., n_vec:].astype(np.float64), k32[:, :, n_vec:].astype(np.float64))
        return dots.astype(np.float32).reshape(n, n_head, n_keys)
    kv, kd, km = kv_quant.fields(type_k, k)                       # (S, n_kv, nb, 32), (S, n_kv, nb)
    qv, qd, qs = kv_quant.fields(kv_quant.VEC_DOT_TYPE[type_k], qq)  # (n, n_head, nb, 32)
    nb = kv.shape[2]
    kv4 = kv.reshape(n_keys, n_kv, nb, 8, 4).astype(np.int64)
    qv4 = qv.reshape(n, n_kv, g, nb, 8, 4).astype(np.int64)
    lanes = np.einsum("skble,tkgble->tkgsbl", kv4, qv4).astype(np.float32)   # exact integers
    d = (kd.transpose(1, 0, 2)[None, :, None] * qd.reshape(n, n_kv, g, 1, nb)).astype(np.float32)
    acc = np.zeros((n, n_kv, g, n_keys, 8), np.float32)
    if type_k == "iq4_nl":
        acc2 = acc.copy()
        paired = nb - nb % 2
        for b in range(0, paired, 2):
            acc = _fma(d[..., b, None], lanes[..., b, :], acc)
            acc2 = _fma(d[..., b + 1, None], lanes[..., b + 1, :], acc2)
        out = hsum8((acc + acc2).astype(np.float32))
        if paired < nb:    # the scalar tail: sumf += d * sumi, not fused
            tail = lanes[..., nb - 1, :].sum(axis=-1, dtype=np.float64).astype(np.float32)
            out = (out + (d[..., nb - 1] * tail).astype(np.float32)).astype(np.float32)
        return out.reshape(n, n_head, n_keys)
    summs = np.zeros((n, n_kv, g, n_keys), np.float32)
    for b in range(nb):
        acc = _fma(d[..., b, None], lanes[..., b, :], acc)
        if km is not None:
            summs = _fma(km[:, :, b].T[None, :, None], qs.reshape(n, n_kv, g, 1, nb)[..., b], summs)
    out = hsum8(acc)
    if km is not None:
        out = (out + summs).astype(np.float32)
    return out.reshape(n, n_head, n_keys)


def flash_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, kpos: np.ndarray, qpos: np.ndarray,
                    type_k: str, type_v: str, kq_scale: float, window: int = 0,
                    sinks: np.ndarray | None = None, softcap: float = 0.0) -> np.ndarray:
    """Causal GQA flash attention -> (n, n_head, hd_v) float32, in llama.cpp's CPU order.

    q (n, n_head, hd) float32; k / v: the cache's layer view, float16 (S, n_kv, hd) for f16
    or raw blocks (S, n_kv, row_bytes) uint8; kpos (S,), qpos (n,): positions (a query at p
    sees keys at <= p, and with window > 0 those with p - kpos < window)."""
    q = np.asarray(q, np.float32)
    n, n_head, _ = q.shape
    n_keys, n_kv = k.shape[:2]
    g = n_head // n_kv
    scale = np.float32(kq_scale)
    if softcap:
        scale = np.float32(scale / np.float32(softcap))
    s_all = (kq_dots(type_k, k, quantize_q(type_k, q)) * scale).astype(np.float32)
    if softcap:
        s_all = (np.float32(softcap) * tanhf(s_all)).astype(np.float32)
    kpos = np.asarray(kpos)
    qp = np.asarray(qpos)[:, None]
    allowed = kpos[None, :] <= qp
    if window:
        allowed &= (qp - kpos[None, :]) < window
    vals = np.asarray(v, np.float16).astype(np.float32) if type_v == "f16" else kv_quant.dequantize(type_v, v)
    vals = np.repeat(vals, g, axis=1)   # (S, n_head, hd_v): head h reads K/V head h // g
    hdv = vals.shape[2]
    M = np.full((n, n_head), -np.inf, np.float32)
    S = np.zeros((n, n_head), np.float32)
    acc = np.zeros((n, n_head, hdv), np.float32)   # F16 values when V is F16
    for j in range(n_keys):
        live = allowed[:, j][:, None] & np.ones((1, n_head), bool)
        s = s_all[:, :, j]
        new = live & (s > M)
        old = live & ~new
        with np.errstate(invalid="ignore"):
            ms = np.where(new, expf(M - np.where(new, s, 0)), np.float32(1.0)).astype(np.float32)
            vs = np.where(old, expf(np.where(old, s - M, 0)), np.float32(1.0)).astype(np.float32)
        M = np.where(new, s, M)
        if type_v == "f16":
            scaled = (acc * ms[..., None]).astype(np.float16).astype(np.float32)
            acc = np.where(new[..., None], scaled, acc)
            upd = _fma(vals[j][None], vs[..., None], acc).astype(np.float16).astype(np.float32)
        else:
            acc = np.where(new[..., None], (acc * ms[..., None]).astype(np.float32), acc)
            upd = _fma(vals[j][None], vs[..., None], acc)
        acc = np.where(live[..., None], upd, acc)
        S = np.where(live, _fma(S, ms, vs), S)
    if sinks is not None:
        sk = np.broadcast_to(np.asarray(sinks, np.float32)[None, :], (n, n_head))
        new = sk > M
        with np.errstate(invalid="ignore"):
            ms = np.where(new, expf(M - sk), np.float32(1.0)).astype(np.float32)
            vs = np.where(new, np.float32(1.0), expf(np.where(new, 0, sk - M))).astype(np.float32)
        acc = np.where(new[..., None], (acc * ms[..., None]).astype(np.float32), acc)
        S = ((S * ms).astype(np.float32) + vs).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(S == 0, np.float32(0.0), np.float32(1.0) / np.where(S == 0, 1, S)).astype(np.float32)
    return (acc * inv[..., None]).astype(np.float32)
