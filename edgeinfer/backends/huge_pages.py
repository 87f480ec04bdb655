"""Weights in 2 MiB pages: anonymous memory the CPU kernels read their matrices from.

Why: a GGUF's tensors are mapped from the file in 4 KiB pages. Decode streams every
matrix once a token, and each 4 KiB page costs a TLB miss and a restart of the hardware
prefetcher, which stops at page boundaries. Measured on Gemma 3 270M's 262144 x 640 Q8_0
output (AVX2 build, Xeon, 2 threads): 6.4 ms a token from the file's pages, 5.7 ms from
a copy in huge pages; two tokens at once (a speculative verification) 11.2 against 7.1
ms. A whole decoded token went 19.4-20.1 -> 15.9-16.8 ms.

Linux backs private anonymous memory with transparent huge pages (THP) where
/sys/kernel/mm/transparent_hugepage/enabled says `always`, or `madvise` and the range
asks (MADV_HUGEPAGE, as here). Elsewhere (THP `never`, other systems) a copy would buy
nothing, so `available()` is False and the backend keeps reading the file's pages.

The arena hands out 64-byte aligned pieces of 2 MiB aligned chunks, in the order the
matrices are first used. The backend drops the file's pages of each tensor it copied
(GGUFFile.drop_pages), so a process holds about the file's size, as before.
"""
from __future__ import annotations

import mmap
import os
import threading

import numpy as np

PAGE = 2 << 20           # the x86-64 PMD page: what THP maps
_CHUNK = 64 << 20        # arena chunks (a bigger matrix gets a chunk of its own size)
_ALIGN = 64              # each matrix starts on a cache line
_THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


def available() -> bool:
    """Whether copies in this arena get huge pages here (and EDGEINFER_NO_HUGE_PAGES is unset:
    A/B benchmarks, debugging)."""
    if os.environ.get("EDGEINFER_NO_HUGE_PAGES") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        with open(_THP_SETTING) as f:
            setting = f.read()
    except OSError:
        return False
    return "[always]" in setting or "[madvise]" in setting


class HugePageArena:
    """Read-only matrices in private anonymous memory asked to be backed by huge pages.
    Thread-safe: the backend copies matrices on worker threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._chunk: np.ndarray | None = None   # the current chunk, from its first aligned byte
        self._map: mmap.mmap | None = None      # its mapping, and the chunk's offset in it
        self._start = 0
        self._used = 0
        self.n_bytes = 0                        # bytes handed out

    def empty(self, shape: tuple, dtype=np.uint8) -> np.ndarray:
        """A writable, uninitialised C-contiguous array in the arena."""
        dtype = np.dtype(dtype)
        n = int(np.prod(shape)) * dtype.itemsize
        with self._lock:
            if self._chunk is None or self._used + n > self._chunk.nbytes:
                (self._chunk, self._map, self._start), self._used = _new_chunk(max(_CHUNK, -(-n // PAGE) * PAGE)), 0
            piece = self._chunk[self._used:self._used + n]
            _populate(self._map, self._start + self._used, n)
            self._used += -(-n // _ALIGN) * _ALIGN
            self.n_bytes += n
        return piece.view(dtype).reshape(shape)

    def copy(self, src: np.ndarray) -> np.ndarray:
        """A read-only copy of src in the arena."""
        out = self.empty(src.shape, src.dtype)
        out[...] = src
        out.flags.writeable = False
        return out


def _new_chunk(n_bytes: int) -> tuple[np.ndarray, mmap.mmap, int]:
    """(n_bytes of private anonymous memory starting on a PAGE boundary, with MADV_HUGEPAGE;
    its mapping; its offset in the mapping). Python's anonymous mmap is MAP_SHARED unless
    told, and shared memory gets no THP. Pages are faulted in only as pieces are handed out."""
    m = mmap.mmap(-1, n_bytes + PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        m.madvise(mmap.MADV_HUGEPAGE)
    except OSError:   # a kernel without THP: plain pages, still the same bytes
        pass
    raw = np.frombuffer(m, np.uint8)   # keeps the mapping alive as long as an array uses it
    start = -raw.ctypes.data % PAGE
    return raw[start:start + n_bytes], m, start


_POPULATE_WRITE = 23   # Linux's MADV_POPULATE_WRITE (5.14+; Python 3.11's mmap lacks the name)


def _populate(m: mmap.mmap, offset: int, n_bytes: int) -> None:
    """Fault in the pages of m[offset:offset + n_bytes] in one call, before the copy writes
    them: 1 GiB copied in 0.21 s against 0.30 s faulting page by page (Xeon VM). Older
    kernels refuse the advice: the copy's writes fault the pages in instead."""
    first = offset // mmap.PAGESIZE * mmap.PAGESIZE
    try:
        m.madvise(_POPULATE_WRITE, first, offset + n_bytes - first)
    except (OSError, ValueError):
        pass
