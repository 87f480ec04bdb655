"""K/V rows as ggml blocks: the quantizers llama.cpp's CPU K/V store uses, the dequantizers
its flash attention uses for V, and the Q-side quantizers of its K . Q dot products (numpy).

A quantized K/V cache stores each head's row as raw ggml blocks (32 values a block). Which
quantizer runs matters to the last bit: llama.cpp writes K/V with ggml_set_rows, which calls
the CPU type traits' `from_float`. For q8_0 (and q8_1, the Q side of q4_1/q5_1 K) that is the
AVX2 quantizer: id = 127/amax, rounding to nearest-even (`_mm256_round_ps`). The other types
use ggml-quants.c's reference quantizers (`quantize_row_q4_0_ref`, ...: truncation of
x*id + 8.5 etc.). `quantize_q8_0_ref` (id = 1/d, roundf) is the file-writing reference that
gguf.quants also implements; it is here to test against gguf, not used by the cache.
V rows are read back with ggml-base's `to_float` (plain C, no fma: q*d + m rounds twice).
iq4_nl's store is `quantize_row_iq4_nl_ref` (a non-uniform 16-value table; ggml-cpu's from_float
calls it): d from the value of largest magnitude, then the weighted least-squares scale.
"""
from __future__ import annotations

import numpy as np

QK = 32
# bytes of one 32-value block (q8_1 is only the Q side of q4_1 / q5_1 K dots)
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20, "q5_0": 22, "q5_1": 24, "q8_1": 36, "iq4_nl": 18}
GGML_TYPE_ID = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "q8_1": 9, "iq4_nl": 20}
# the type K . Q runs in (ggml's vec_dot_type): Q is quantized to it before the dot
VEC_DOT_TYPE = {"q8_0": "q8_0", "q4_0": "q8_0", "q5_0": "q8_0", "q4_1": "q8_1", "q5_1": "q8_1", "f16": "f16",
                "iq4_nl": "q8_0"}
# iq4_nl's 16 values (kvalues_iq4nl)
IQ4_NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)
_IQ4_NL_F32 = IQ4_NL_VALUES.astype(np.float32)
_GROUP_MAX_EPS = np.float32(1e-15)


def row_bytes(type_name: str, n: int) -> int:
    """Bytes of one row of n values stored as `type_name` (f16: 2 a value)."""
    if type_name == "f16":
        return 2 * n
    if n % QK:
        raise ValueError(f"a {type_name} row needs a multiple of {QK} values, got {n}")
    return n // QK * BLOCK_BYTES[type_name]


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    """float32 (..., nb) -> (..., nb, 2) little-endian fp16 bytes (round to nearest even)."""
    return np.ascontiguousarray(x.astype(np.float32).astype("<f2")).view(np.uint8).reshape(x.shape + (2,))


def _f16_of(b: np.ndarray) -> np.ndarray:
    """(..., 2) bytes -> float32."""
    return np.ascontiguousarray(b).view("<f2")[..., 0].astype(np.float32)


def _blocks(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float32)
    if x.shape[-1] % QK:
        raise ValueError(f"K/V rows need a multiple of {QK} values, got {x.shape[-1]}")
    return x.reshape(x.shape[:-1] + (x.shape[-1] // QK, QK))


def _pack(parts: list[np.ndarray], lead: tuple) -> np.ndarray:
    """Concatenate per-block byte fields (..., nb, k_i) into rows (..., nb * sum k_i)."""
    out = np.concatenate([p.astype(np.uint8) for p in parts], axis=-1)
    return out.reshape(lead + (-1,))


def _nibbles(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    return (lo.astype(np.uint8) & 15) | ((hi.astype(np.uint8) & 15) << 4)


def _qh_bytes(codes: np.ndarray) -> np.ndarray:
    """5-bit codes (..., 32): bit 4 of value j -> bit j of a little-endian u32 (4 bytes)."""
    bits = ((codes.astype(np.uint32) >> 4) & 1) << np.arange(QK, dtype=np.uint32)
    qh = np.bitwise_or.reduce(bits, axis=-1).astype("<u4")
    return np.ascontiguousarray(qh).view(np.uint8).reshape(qh.shape + (4,))


def _amax_signed(b: np.ndarray) -> np.ndarray:
    """The value of largest magnitude per block (the first such), as ggml's `amax < fabsf(v)`."""
    idx = np.abs(b).argmax(axis=-1)
    return np.take_along_axis(b, idx[..., None], axis=-1)[..., 0]


def _inv(d: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.where(d != 0, np.float32(1.0) / np.where(d != 0, d, 1), 0).astype(np.float32)


# ----------------------------------------------------------------------------- quantizers

def _q8_avx2(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(d, int8 codes) of 32-value blocks as ggml-cpu's AVX2 q8 quantizers make them:
    id = 127 / amax, round half to even."""
    amax = np.abs(b).max(axis=-1)
    d = (amax / np.float32(127.0)).astype(np.float32)
    with np.errstate(divide="ignore"):
        idv = np.where(amax != 0, np.float32(127.0) / np.where(amax != 0, amax, 1), 0).astype(np.float32)
    return d, np.rint((b * idv[..., None]).astype(np.float32)).astype(np.int8)


def quantize_q8_0(x: np.ndarray) -> np.ndarray:
    """ggml-cpu's AVX2 quantize_row_q8_0 (K/V store, and Q for q8_0/q4_0/q5_0 K)."""
    b = _blocks(x)
    d, q = _q8_avx2(b)
    return _pack([_f16_bytes(d), q.view(np.uint8)], b.shape[:-2])


def quantize_q8_0_ref(x: np.ndarray) -> np.ndarray:
    """ggml-quants.c's quantize_row_q8_0_ref (gguf.quants writes the same): id = 1/d, roundf."""
    b = _blocks(x)
    amax = np.abs(b).max(axis=-1)
    d = (amax / np.float32(127.0)).astype(np.float32)
    t = (b * _inv(d)[..., None]).astype(np.float32).astype(np.float64)
    q = np.trunc(t + np.copysign(0.5, t)).astype(np.int8)   # roundf: halves away from zero
    return _pack([_f16_bytes(d), q.view(np.uint8)], b.shape[:-2])


def quantize_q8_1(x: np.ndarray) -> np.ndarray:
    """ggml-cpu's AVX2 quantize_row_q8_1 (Q for q4_1/q5_1 K): as q8_0, plus s = fp16(d * sum q)."""
    b = _blocks(x)
    d, q = _q8_avx2(b)
    s = (d * q.astype(np.int32).sum(axis=-1).astype(np.float32)).astype(np.float32)
    return _pack([_f16_bytes(d), _f16_bytes(s), q.view(np.uint8)], b.shape[:-2])


def quantize_q4_0(x: np.ndarray) -> np.ndarray:
    """quantize_row_q4_0_ref: d = max / -8, code = min(15, trunc(x*id + 8.5))."""
    b = _blocks(x)
    d = (_amax_signed(b) / np.float32(-8.0)).astype(np.float32)
    t = ((b * _inv(d)[..., None]).astype(np.float32) + np.float32(8.5)).astype(np.float32)
    c = np.minimum(15, np.trunc(t).astype(np.int32))
    return _pack([_f16_bytes(d), _nibbles(c[..., :16], c[..., 16:])], b.shape[:-2])


def quantize_q5_0(x: np.ndarray) -> np.ndarray:
    """quantize_row_q5_0_ref: d = max / -16, code = min(31, trunc(x*id + 16.5))."""
    b = _blocks(x)
    d = (_amax_signed(b) / np.float32(-16.0)).astype(np.float32)
    t = ((b * _inv(d)[..., None]).astype(np.float32) + np.float32(16.5)).astype(np.float32)
    c = np.minimum(31, np.trunc(t).astype(np.int32))
    return _pack([_f16_bytes(d), _qh_bytes(c), _nibbles(c[..., :16], c[..., 16:])], b.shape[:-2])


def _min_max_codes(b: np.ndarray, levels: int, clamp: bool):
    mn, mx = b.min(axis=-1), b.max(axis=-1)
    d = ((mx - mn) / np.float32(levels)).astype(np.float32)
    t = (((b - mn[..., None]).astype(np.float32) * _inv(d)[..., None]).astype(np.float32)
         + np.float32(0.5)).astype(np.float32)
    c = np.trunc(t).astype(np.int32)
    return d, mn, (np.minimum(levels, c) if clamp else c)


def quantize_q4_1(x: np.ndarray) -> np.ndarray:
    """quantize_row_q4_1_ref: d = (max - min) / 15, m = min, code = min(15, trunc((x - m)*id + 0.5))."""
    b = _blocks(x)
    d, mn, c = _min_max_codes(b, 15, True)
    return _pack([_f16_bytes(d), _f16_bytes(mn), _nibbles(c[..., :16], c[..., 16:])], b.shape[:-2])


def quantize_q5_1(x: np.ndarray) -> np.ndarray:
    """quantize_row_q5_1_ref: d = (max - min) / 31, m = min, code = trunc((x - m)*id + 0.5)."""
    b = _blocks(x)
    d, mn, c = _min_max_codes(b, 31, False)
    return _pack([_f16_bytes(d), _f16_bytes(mn), _qh_bytes(c), _nibbles(c[..., :16], c[..., 16:])], b.shape[:-2])


def _best_index_iq4_nl(al: np.ndarray) -> np.ndarray:
    """ggml's best_index_int8 over the iq4_nl values: the nearest value's index, the upper
    one on a tie (float32 differences, as the C compares them)."""
    v = _IQ4_NL_F32
    mu = np.clip(np.searchsorted(v, al, side="right"), 1, 15)     # v[mu - 1] <= al < v[mu]
    lower = (al - v[mu - 1]).astype(np.float32) < (v[mu] - al).astype(np.float32)
    idx = np.where(lower, mu - 1, mu)
    return np.where(al <= v[0], 0, np.where(al >= v[15], 15, idx))


def quantize_iq4_nl(x: np.ndarray) -> np.ndarray:
    """ggml's quantize_row_iq4_nl_ref (quantize_row_iq4_nl_impl with ntry -1: no scale search):
    d0 = max / -127 for the value of largest magnitude, indices of al = x / d0, then
    d = sum(w q x) / sum(w q q) with w = x^2, accumulated in element order in float32. An
    all-zero block (amax < 1e-15) gets d = 0; its nibbles (left over from earlier blocks
    in ggml) are 0 here: with d = 0 they add nothing."""
    b = _blocks(x)
    vmax = _amax_signed(b)
    live = np.abs(vmax) >= _GROUP_MAX_EPS
    inv = _inv(np.where(live, vmax / np.float32(-127.0), 0).astype(np.float32))
    idx = _best_index_iq4_nl((inv[..., None] * b).astype(np.float32))
    q = _IQ4_NL_F32[idx]
    w = (b * b).astype(np.float32)
    sumqx = np.zeros(b.shape[:-1], np.float32)
    sumq2 = np.zeros(b.shape[:-1], np.float32)
    for j in range(QK):
        wq = (w[..., j] * q[..., j]).astype(np.float32)
        sumqx = (sumqx + (wq * b[..., j]).astype(np.float32)).astype(np.float32)
        sumq2 = (sumq2 + (wq * q[..., j]).astype(np.float32)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        d = np.where(live & (sumq2 > 0), sumqx / np.where(sumq2 > 0, sumq2, 1), 0).astype(np.float32)
    idx = np.where(live[..., None], idx, 0)
    return _pack([_f16_bytes(d), _nibbles(idx[..., :16], idx[..., 16:])], b.shape[:-2])


QUANTIZE = {"q8_0": quantize_q8_0, "q4_0": quantize_q4_0, "q4_1": quantize_q4_1, "q5_0": quantize_q5_0,
            "q5_1": quantize_q5_1, "q8_1": quantize_q8_1, "iq4_nl": quantize_iq4_nl}


def quantize(type_name: str, x: np.ndarray) -> np.ndarray:
    """float32 rows (..., n) -> raw blocks (..., row_bytes) as llama.cpp's CPU K/V store writes them."""
    return QUANTIZE[type_name](x)


# ----------------------------------------------------------------------------- block fields

def fields(type_name: str, raw: np.ndarray):
    """Raw rows (..., row_bytes) -> (values int32 (..., nb, 32), d f32 (..., nb), second f32
    (..., nb): m for q4_1/q5_1, s for q8_1, else None). Values are the signed q8 values, or
    code - offset for q4_0/q5_0, the unsigned codes of q4_1/q5_1, or iq4_nl's table values."""
    bs = BLOCK_BYTES[type_name]
    raw = np.asarray(raw, np.uint8)
    blk = raw.reshape(raw.shape[:-1] + (raw.shape[-1] // bs, bs))
    d = _f16_of(blk[..., 0:2])
    second = None
    if type_name in ("q8_0", "q8_1"):
        o = 2
        if type_name == "q8_1":
            second, o = _f16_of(blk[..., 2:4]), 4
        return blk[..., o:o + QK].view(np.int8).astype(np.int32), d, second
    o = 2
    if type_name in ("q4_1", "q5_1"):
        second, o = _f16_of(blk[..., 2:4]), 4
    qh = None
    if type_name in ("q5_0", "q5_1"):
        qh = np.ascontiguousarray(blk[..., o:o + 4]).view("<u4")[..., 0].astype(np.uint32)
        o += 4
    qs = blk[..., o:o + 16].astype(np.int32)
    codes = np.concatenate([qs & 15, qs >> 4], axis=-1)
    if qh is not None:
        codes = codes | (((qh[..., None] >> np.arange(QK, dtype=np.uint32)) & 1).astype(np.int32) << 4)
    if type_name == "iq4_nl":
        return IQ4_NL_VALUES[codes].astype(np.int32), d, second
    offset = {"q4_0": 8, "q5_0": 16}.get(type_name, 0)
    return codes - offset, d, second


def dequantize(type_name: str, raw: np.ndarray) -> np.ndarray:
    """Raw rows -> float32 (..., n) as ggml-base's to_float: q*d, or q*d + m (two roundings)."""
    if type_name == "f16":
        return np.asarray(raw).astype(np.float32)
    vals, d, m = fields(type_name, raw)
    y = (vals.astype(np.float32) * d[..., None]).astype(np.float32)
    if type_name in ("q4_1", "q5_1"):
        y = (y + m[..., None]).astype(np.float32)
    return y.reshape(y.shape[:-2] + (-1,))


# ----------------------------------------------------------------------------- rotation

def fwht(x: np.ndarray, n: int) -> np.ndarray:
    """Walsh-Hadamard transform of every n-value chunk of the last axis, scaled by 1/sqrt(n):
    ggml's CPU `fwht` (the mul_mat that llama.cpp hints as Hadamard): x * (1/sqrtf(n)) first,
    then butterflies u + v, u - v (each one float32 rounding), len = 1, 2, 4, ... Its own
    inverse up to rounding. llama.cpp rotates Q/K by it when K is quantized, V (and the
    attention output back) when V is, so outliers spread over the block before quantizing."""
    x = np.asarray(x, np.float32)
    y = (x.reshape(-1, n) * (np.float32(1.0) / np.sqrt(np.float32(n)))).astype(np.float32)
    length = 1
    while length < n:
        y = y.reshape(-1, n // (2 * length), 2, length)
        u, v = y[:, :, 0, :], y[:, :, 1, :]
        y = np.stack([u + v, u - v], axis=2).astype(np.float32)
        length *= 2
    return y.reshape(x.shape)


def rotation_size(head_dim: int, largest: bool) -> int:
    """llama.cpp's Hadamard size for a head: 0 (none) unless head_dim is a multiple of 64;
    for K the largest power of two (>= 64) dividing it, for V 64."""
    if head_dim <= 0 or head_dim % 64:
        return 0
    if not largest:
        return 64
    n = 64
    while head_dim % (2 * n) == 0:
        n *= 2
    return n
