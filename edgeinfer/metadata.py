"""Typed, range-checked reads of GGUF metadata: every reader of a model file's keys goes through here.

A model file is someone else's input, so no value is used before its type and range are
checked: `meta_int(md, "llama.block_count", 1, MAX_LAYERS)` returns an int in range or
raises a `MetadataError` whose one line names the file and the key. `md` is the file's
`Metadata` (it knows its file), or any mapping (then the line says "model metadata").
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from edgeinfer.errors import MetadataError

REQUIRED: Any = object()  # `default` for keys the file must have

# Upper bounds well above any real model: a larger claim is a corrupt or hostile file.
MAX_LAYERS = 1 << 16
MAX_EMBD = 1 << 20
MAX_HEADS = 1 << 16
MAX_HEAD_DIM = 1 << 16
MAX_FF = 1 << 24
MAX_CTX = 1 << 26
MAX_VOCAB = 1 << 24
MAX_ROPE_BASE = 1e12
MAX_EXPERTS = 1024  # llama.cpp's LLAMA_MAX_EXPERTS


class Metadata(dict):
    """GGUF metadata (key -> value) that remembers which file it came from, for error lines."""

    def __init__(self, source: str = "", *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.source = str(source)


def _where(md: Mapping[str, Any]) -> str:
    return getattr(md, "source", "") or "model metadata"


def _got(value: Any) -> str:
    """A short description of a bad value (never the whole of a long string or array)."""
    if isinstance(value, str):
        return f"the string {value[:40] + '...' if len(value) > 40 else value!r}"
    if isinstance(value, (list, tuple, np.ndarray)):
        return f"an array of {len(value)} values"
    if isinstance(value, (bool, np.bool_)):
        return f"the boolean {bool(value)}"
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    if isinstance(value, (float, np.floating)):
        return repr(float(value))
    return f"a value of type {type(value).__name__}"


def _fail(md: Mapping[str, Any], key: str, want: str, value: Any) -> MetadataError:
    return MetadataError(f"{_where(md)}: metadata key {key!r} must be {want}, got {_got(value)}")


def _lookup(md: Mapping[str, Any], key: str, default: Any) -> tuple[bool, Any]:
    value = md.get(key)
    if value is not None:  # GGUF has no null: None only comes from a mapping built by hand
        return True, value
    if default is REQUIRED:
        raise MetadataError(f"{_where(md)}: missing metadata key {key!r}")
    return False, default


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _is_number(value: Any) -> bool:
    return _is_int(value) or isinstance(value, (float, np.floating))


def meta_int(md: Mapping[str, Any], key: str, lo: int, hi: int, default: Any = REQUIRED) -> Any:
    """An integer in [lo, hi]; `default` (returned unchecked) when the key is absent."""
    found, value = _lookup(md, key, default)
    if not found:
        return value
    if not _is_int(value) or not lo <= int(value) <= hi:
        raise _fail(md, key, f"an integer from {lo} to {hi}", value)
    return int(value)


def meta_float(md: Mapping[str, Any], key: str, lo: float, hi: float, default: Any = REQUIRED,
               *, lo_exclusive: bool = False) -> Any:
    """A finite number in [lo, hi] (or (lo, hi] with `lo_exclusive`); ints are accepted."""
    found, value = _lookup(md, key, default)
    if not found:
        return value
    ok = _is_number(value) and math.isfinite(float(value))
    if ok:
        v = float(value)
        ok = (v > lo if lo_exclusive else v >= lo) and v <= hi
    if not ok:
        low = f"> {lo:g}" if lo_exclusive else f">= {lo:g}"
        raise _fail(md, key, f"a finite number {low} and <= {hi:g}", value)
    return float(value)


def meta_bool(md: Mapping[str, Any], key: str, default: Any = REQUIRED) -> Any:
    """A boolean (an integer 0 or 1 is accepted, as some converters write it)."""
    found, value = _lookup(md, key, default)
    if not found:
        return value
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if _is_int(value) and int(value) in (0, 1):
        return bool(value)
    raise _fail(md, key, "a boolean", value)


def meta_str(md: Mapping[str, Any], key: str, default: Any = REQUIRED) -> Any:
    """A string (the header parser has already made it valid text)."""
    found, value = _lookup(md, key, default)
    if not found:
        return value
    if not isinstance(value, str):
        raise _fail(md, key, "a string", value)
    return value


def meta_str_array(md: Mapping[str, Any], key: str, default: Any = REQUIRED) -> Any:
    """An array of strings, as a list."""
    found, value = _lookup(md, key, default)
    if not found:
        return value
    # the distinct item types, in C: a 262k-token vocabulary is read several times at start
    if not isinstance(value, (list, tuple)) or not all(issubclass(t, str) for t in set(map(type, value))):
        raise _fail(md, key, "an array of strings", value)
    return list(value)


def meta_int_array(md: Mapping[str, Any], key: str, lo: int, hi: int, default: Any = REQUIRED) -> Any:
    """An array of integers, each in [lo, hi], as an int64 numpy array."""
    found, value = _lookup(md, key, default)
    if not found:
        return value
    arr = _numeric_array(md, key, value, "an array of integers", integer=True)
    if arr.size and (int(arr.min()) < lo or int(arr.max()) > hi):
        raise _fail(md, key, f"an array of integers from {lo} to {hi}", value)
    return arr.astype(np.int64)


def meta_float_array(md: Mapping[str, Any], key: str, default: Any = REQUIRED) -> Any:
    """An array of numbers (token scores), as a float64 numpy array."""
    found, value = _lookup(md, key, default)
    if not found:
        return value
    return _numeric_array(md, key, value, "an array of numbers", integer=False).astype(np.float64)


def meta_int_per_layer(md: Mapping[str, Any], key: str, lo: int, hi: int, n_layer: int,
                       default: Any = REQUIRED) -> Any:
    """An integer in [lo, hi], or one per layer (an array of exactly `n_layer` of them)."""
    found, value = _lookup(md, key, default)
    if not found:
        return value
    if isinstance(value, (list, tuple, np.ndarray)):
        arr = meta_int_array(md, key, lo, hi)
        if len(arr) != n_layer:
            raise MetadataError(f"{_where(md)}: metadata key {key!r} has {len(arr)} values for "
                                f"{n_layer} layers")
        return arr
    return meta_int(md, key, lo, hi)


def _numeric_array(md: Mapping[str, Any], key: str, value: Any, want: str, integer: bool) -> np.ndarray:
    if isinstance(value, np.ndarray) and value.ndim == 1:
        if value.dtype.kind in ("i", "u") or (not integer and value.dtype.kind == "f"):
            return value
    elif isinstance(value, (list, tuple)):  # a mapping built by hand (tests, tools)
        check = _is_int if integer else _is_number
        if all(check(v) for v in value):
            return np.asarray(value, dtype=np.int64 if integer else np.float64).reshape(-1)
    raise _fail(md, key, want, value)


# Keys outside `{arch}.*` that readers all over the code base use (tokenizer, chat
# template, show, server): checked once when the file is opened, so no reader meets a
# string where an id belongs.
_TOKEN_ID_KEYS = ("bos", "eos", "eot", "eom", "unknown", "seperator", "padding", "mask",
                  "fim_pre", "fim_suf", "fim_mid", "fim_pad", "fim_rep", "fim_sep",
                  "prefix", "suffix", "middle", "cls")


def check_common_keys(md: Mapping[str, Any]) -> None:
    """Type-check the general.* and tokenizer.* keys that edgeinfer reads."""
    for key in ("general.architecture", "general.name", "general.license", "tokenizer.ggml.model",
                "tokenizer.ggml.pre", "tokenizer.chat_template"):
        meta_str(md, key, None)
    meta_int(md, "general.file_type", 0, (1 << 32) - 1, None)
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
        meta_str_array(md, key, None)
    meta_int_array(md, "tokenizer.ggml.token_type", -(1 << 31), (1 << 32) - 1, None)
    meta_float_array(md, "tokenizer.ggml.scores", None)
    for name in _TOKEN_ID_KEYS:
        meta_int(md, f"tokenizer.ggml.{name}_token_id", -(1 << 63), 1 << 64, None)
    for name in ("add_bos_token", "add_eos_token", "add_sep_token", "add_space_prefix"):
        meta_bool(md, f"tokenizer.ggml.{name}", None)


__all__ = ["Metadata", "REQUIRED", "check_common_keys", "meta_bool", "meta_float", "meta_float_array",
           "meta_int", "meta_int_array", "meta_int_per_layer", "meta_str", "meta_str_array"]
