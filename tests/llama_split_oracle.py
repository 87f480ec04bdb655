"""llama.cpp's own pre-tokenizer split, called in its shared library (a test oracle).

    echo '{"regex": "...", "texts": ["<hex>", ...]}' | python tests/llama_split_oracle.py
    -> [["<hex word>", ...], ...]

libllama exports the C++ function `unicode_regex_split(const std::string &,
const std::vector<std::string> &, bool)`; this calls it through ctypes with the libstdc++
(cxx11 ABI) layouts of std::string and std::vector, so a test sees the exact words llama.cpp
feeds to BPE, not only the tokens they merge into. Run it as a subprocess: a layout mismatch,
a C++ exception (code points above U+10FFFF) or std::regex's stack overflow on long runs
kills that process, not pytest.
"""

from __future__ import annotations

import ctypes
import json
import sys
from pathlib import Path

_SYMBOL = ("_Z19unicode_regex_splitRKNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE"
           "RKSt6vectorIS4_SaIS4_EEb")


class _StdString(ctypes.Structure):  # pointer, length, small-string buffer / capacity
    _fields_ = [("ptr", ctypes.c_void_p), ("len", ctypes.c_size_t), ("local", ctypes.c_char * 16)]


class _StdVector(ctypes.Structure):  # begin, end, end of storage
    _fields_ = [("begin", ctypes.c_void_p), ("end", ctypes.c_void_p), ("cap", ctypes.c_void_p)]


def _function():
    import llama_cpp
    lib = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libllama.so"))
    fn = getattr(lib, _SYMBOL)
    # a std::vector is returned through a hidden first pointer argument (and in rax)
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_bool]
    fn.restype = ctypes.c_void_p
    return fn


def _string(data: bytes, keep: list) -> _StdString:
    buf = ctypes.create_string_buffer(data, len(data) + 1)
    keep.append(buf)  # read only by the callee; never freed by it
    return _StdString(ctypes.addressof(buf), len(data))


def split(fn, data: bytes, regex: str) -> list[bytes]:
    keep: list = []
    text = _string(data, keep)
    exprs = (_StdString * 1)(_string(regex.encode(), keep))
    end = ctypes.addressof(exprs) + ctypes.sizeof(exprs)
    vec = _StdVector(ctypes.addressof(exprs), end, end)
    out = _StdVector()
    fn(ctypes.addressof(out), ctypes.addressof(text), ctypes.addressof(vec), False)
    if not out.begin:
        return []
    n = (out.end - out.begin) // ctypes.sizeof(_StdString)
    words = (_StdString * n).from_address(out.begin)
    return [ctypes.string_at(w.ptr, w.len) for w in words]  # the result is leaked: a short-lived process


def main() -> None:
    req = json.load(sys.stdin)
    fn = _function()
    json.dump([[w.hex() for w in split(fn, bytes.fromhex(t), req["regex"])] for t in req["texts"]],
              sys.stdout)


if __name__ == "__main__":
    main()
