"""K/V cache types (llama.cpp's --cache-type-k / --cache-type-v): which are allowed, how a
row of each is stored and read back, its bytes per token, and the one-line errors.

F16 (the default) is stored as float16 values, exactly as before; a quantized type stores
each head's row as raw ggml blocks (uint8, kernels_cpu/kv_quant.py writes them the way
llama.cpp's CPU K/V store does). Attention over a cache with any quantized side runs
llama.cpp's flash-attention order (kernels_cpu/flash_attention.py); F16/F16 keeps the
non-flash path.

As llama.cpp does with a quantized cache, rows are rotated before they are quantized: K (and
Q with it) by a Hadamard transform of `rot_k` values, V by one of `rot_v` (the attention
output is rotated back); `of_config` sets the sizes from the model's head sizes.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from gguf import GGMLQuantizationType

from edgeinfer.errors import EdgeInferError


class _Lazy:
    """A kernels_cpu module, imported at first use: importing the kernels_cpu package loads
    Numba, which a process that only parses flags or refuses a file should not pay for."""

    def __init__(self, module: str):
        self._module = module

    def __getattr__(self, name: str):
        import importlib

        value = getattr(importlib.import_module(f"edgeinfer.kernels_cpu.{self._module}"), name)
        setattr(self, name, value)   # found here from now on (decode asks a few times a layer)
        return value


kv_quant = _Lazy("kv_quant")
kv_quant_jit = _Lazy("kv_quant_jit")   # the compiled fwht and q8_0/q4_0/q5_0/iq4_nl stores (same bits)
# the types whose store kv_quant_jit compiles (the others: kv_quant's numpy)
_COMPILED_STORE = {"q8_0": "quantize_q8_0", "q4_0": "quantize_q4_0", "q5_0": "quantize_q5_0",
                   "iq4_nl": "quantize_iq4_nl"}

# what llama.cpp allows that edgeinfer stores too
ALLOWED = ("f16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl")
NOT_YET = {"f32": "f32 is not supported", "bf16": "bf16 is not supported"}
GGML_TYPE_ID = {name: int(GGMLQuantizationType[name.upper()]) for name in ALLOWED}


class CacheTypeError(EdgeInferError):
    """An unknown or unusable K/V cache type; the message is the one line a user sees."""


FLASH_ATTN = ("on", "off", "auto")


def flash_types(k: str, v: str, flash_attn: str) -> "CacheTypes":
    """The types of -ctk / -ctv under llama.cpp's -fa on|off|auto: auto runs the flash order
    where the cache is quantized, on everywhere; off with a quantized cache is one line
    naming the flag (llama.cpp's quantized caches need flash attention)."""
    mode = str(flash_attn).strip().lower()
    if mode not in FLASH_ATTN:
        raise CacheTypeError(f"--flash-attn: expected on, off or auto, got {flash_attn!r}")
    types = CacheTypes(k, v, flash=mode == "on")
    if mode == "off" and types.quantized:
        raise CacheTypeError(f"--flash-attn off: a quantized K/V cache ({types}) runs flash attention only; "
                             f"use --flash-attn on or auto, or f16 cache types")
    return types


def parse(value: str, flag: str) -> str:
    """A type name from a flag's value (case-insensitive), or CacheTypeError naming the flag."""
    name = str(value).strip().lower()
    if name in ALLOWED:
        return name
    why = NOT_YET.get(name, f"unknown cache type {value!r}")
    raise CacheTypeError(f"{flag}: {why} (allowed: {', '.join(ALLOWED)})")


def from_key(key: str) -> tuple[str, str]:
    """(k, v) type names of a CacheTypes.key ("k=q8_0,v=f16"); CacheTypeError if it is not one."""
    parts = dict(p.split("=", 1) for p in str(key).split(",") if "=" in p)
    k, v = parts.get("k"), parts.get("v")
    if set(parts) != {"k", "v"} or k not in ALLOWED or v not in ALLOWED:
        raise CacheTypeError(f"unknown K/V cache types {key!r}")
    return k, v


@dataclass(frozen=True)
class CacheTypes:
    """The K and V types of one cache."""
    k: str = "f16"
    v: str = "f16"
    rot_k: int = 0   # Hadamard size of K and Q rotations (0: none)
    rot_v: int = 0   # of V and the attention output
    flash: bool = False  # -fa on: an f16 cache runs llama.cpp's flash-attention order too

    @property
    def quantized(self) -> bool:
        return self.k != "f16" or self.v != "f16"

    @property
    def flash_order(self) -> bool:
        """Whether CPU attention runs llama.cpp's flash-attention order (a quantized cache
        always does; f16 with -fa on), else its non-flash order."""
        return self.flash or self.quantized

    @property
    def key(self) -> str:
        """What the prefix cache's block hashes include: blocks of other types never match."""
        return f"k={self.k},v={self.v}"

    def of(self, which: str) -> str:
        return self.k if which == "k" else self.v

    def dtype(self, which: str) -> np.dtype:
        return np.dtype(np.float16) if self.of(which) == "f16" else np.dtype(np.uint8)

    def width(self, which: str, head_dim: int) -> int:
        """The stored row's last dimension: values (f16) or bytes (a quantized type)."""
        t = self.of(which)
        return head_dim if t == "f16" else kv_quant.row_bytes(t, head_dim)

    def rotation(self, which: str) -> int:
        return self.rot_k if which == "k" else self.rot_v

    def rotate(self, which: str, x: np.ndarray) -> np.ndarray:
        """x rotated as llama.cpp rotates `which` (Q goes as "k", the output as "v"); x unchanged
        without a rotation."""
        n = self.rotation(which)
        return kv_quant_jit.fwht(x, n) if n else x

    def encode(self, which: str, x: np.ndarray) -> np.ndarray:
        """float rows (..., head_dim) -> what the cache stores (f16 casts on assignment):
        rotated, then quantized."""
        t = self.of(which)
        if t == "f16":
            return x
        compiled = _COMPILED_STORE.get(t)
        if compiled is not None:   # rotated and quantized in one compiled call
            return getattr(kv_quant_jit, compiled)(x, self.rotation(which))
        return kv_quant.quantize(t, self.rotate(which, np.asarray(x, np.float32)))

    def decode(self, which: str, raw: np.ndarray) -> np.ndarray:
        """Stored rows -> float32 (..., head_dim), as ggml's to_float, rotated back."""
        return self.rotate(which, kv_quant.dequantize(self.of(which), raw))

    def blank_rows(self, which: str, shape: tuple[int, ...]) -> np.ndarray:
        """Stored rows (`shape`, last axis the width) that mark a row as not held (what a
        sliding window dropped, in saved K/V): NaN values for f16; for a quantized type,
        blocks whose scale d is an f16 NaN, which no block of finite values has."""
        if self.of(which) == "f16":
            return np.full(shape, np.nan, np.float16)
        out = np.zeros(shape, np.uint8)
        if shape[-1]:
            blocks = out.reshape(-1, kv_quant.BLOCK_BYTES[self.of(which)])
            blocks[:, :2] = np.frombuffer(np.float16(np.nan).tobytes(), np.uint8)
        return out

    def blank_mask(self, which: str, rows: np.ndarray) -> np.ndarray:
        """(n,) bool: which of the stored rows `rows` (n, ...) carry blank_rows' marker (any
        NaN value, or any block scale that is NaN)."""
        n = len(rows)
        if self.of(which) == "f16":
            return np.isnan(np.asarray(rows, np.float16).reshape(n, -1)).any(axis=1)
        return np.isnan(self.block_scales(which, rows)).any(axis=1)

    def block_scales(self, which: str, rows: np.ndarray) -> np.ndarray:
        """(n, blocks) float16: the scale d of every block of quantized rows (n, ...)."""
        n, bs = len(rows), kv_quant.BLOCK_BYTES[self.of(which)]
        raw = np.ascontiguousarray(rows, np.uint8).reshape(n, -1)
        if raw.shape[1] % bs:
            raise ValueError(f"rows of {raw.shape[1]} bytes are not whole {self.of(which)} blocks")
        return raw.reshape(n, -1, bs)[:, :, :2].copy().view(np.float16).reshape(n, -1)

    def bytes_per_value(self, which: str) -> float:
        t = self.of(which)
        return 2.0 if t == "f16" else kv_quant.BLOCK_BYTES[t] / kv_quant.QK

    def token_bytes(self, k_values: int, v_values: int) -> float:
        """Bytes one token's K/V takes with k_values K and v_values V values (all layers)."""
        return k_values * self.bytes_per_value("k") + v_values * self.bytes_per_value("v")

    def check_head_dims(self, head_dims_k, head_dims_v) -> None:
        """Quantized rows are whole 32-value blocks: refuse a head size that is not."""
        for which, flag, dims in (("k", "--cache-type-k", head_dims_k), ("v", "--cache-type-v", head_dims_v)):
            t = self.of(which)
            bad = sorted({int(d) for d in dims if t != "f16" and int(d) % kv_quant.QK})
            if bad:
                raise CacheTypeError(f"{flag}: {t} needs head sizes that are multiples of {kv_quant.QK}, "
                                     f"this model has {bad[0]} (allowed here: f16)")

    def __str__(self) -> str:
        return f"K {self.k}, V {self.v}"


F16 = CacheTypes()


def of_config(config, types: CacheTypes | None) -> CacheTypes:
    """`types` (F16 for None) after checking it fits the model's head sizes."""
    types = types or F16
    if types.quantized:
        owns = [i for i in range(config.n_layer) if config.owns_kv(i)]
        dk, dv = {config.head_dim_of(i) for i in owns}, {config.head_dim_v_of(i) for i in owns}
        types.check_head_dims(dk, dv)
        # llama.cpp rotates only where every layer has one head size (n_embd_head_k_all > 0)
        rot_k = kv_quant.rotation_size(dk.pop(), True) if types.k != "f16" and len(dk) == 1 else 0
        rot_v = kv_quant.rotation_size(dv.pop(), False) if types.v != "f16" and len(dv) == 1 else 0
        types = replace(types, rot_k=rot_k, rot_v=rot_v)
    return types
