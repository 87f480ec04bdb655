"""Attention in which an image's rows see the whole image, on any backend's causal attention.

libmtmd runs a gemma3 image in one batch with causal attention off: a query at position p sees
every key of its sequence up to its image's last position L, and a sliding-window layer still
hides keys with p - kpos >= window (a later key never). A backend's attention masks by one
position per query (kpos <= p, p - kpos < window), so an image's rows attend to a view of the
cache in which the image's own keys sit at its first position F: each row sees them all, and
every other key exactly as before. That is exact while the image fits the window (L - F <
window: no row's window hides a key of its own image); a longer image's rows run one by one,
at L with the window widened by L - p. The text rows of the pass attend as usual.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np


class _ImageKeysAtFirst:
    """A KVView as one image's rows see it: keys at positions first..last moved to first."""

    def __init__(self, kv: Any, first: int, last: int) -> None:
        self._kv, self._first, self._last = kv, first, last

    def layer_view(self, layer: int):
        k, v, kpos = self._kv.layer_view(layer)
        kpos = np.asarray(kpos)
        inside = (kpos >= self._first) & (kpos <= self._last)
        return k, v, np.where(inside, np.asarray(self._first, kpos.dtype), kpos)

    def __getattr__(self, name: str):  # cache_types, n_used, ...: the cache's own
        return getattr(self._kv, name)


def attention_to_limits(attend: Callable, q: np.ndarray, kv, layer: int, positions: np.ndarray,
                        firsts: np.ndarray, limits: np.ndarray, scale: float, window: int, **kw) -> np.ndarray:
    """`attend(q, kv, layer, positions, scale, window, **kw)` (a Backend.attention) with query r
    an image row of the image at positions firsts[r]..limits[r] (firsts[r] = limits[r] =
    positions[r]: a causal row): it sees its whole image, and the rest as a causal row does."""
    positions = np.asarray(positions, dtype=np.int64)
    firsts = np.asarray(firsts, dtype=np.int64)
    limits = np.asarray(limits, dtype=np.int64)
    out: np.ndarray | None = None

    def put(rows: np.ndarray, got: np.ndarray) -> None:
        nonlocal out
        if out is None:
            out = np.empty((q.shape[0],) + got.shape[1:], got.dtype)
        out[rows] = got

    causal = np.flatnonzero(limits == firsts)
    if causal.size:
        put(causal, attend(q[causal], kv, layer, positions[causal], scale, window, **kw))
    for first, last in sorted({(int(a), int(b)) for a, b in zip(firsts, limits) if a != b}):
        rows = np.flatnonzero((firsts == first) & (limits == last))
        if not window or last - first < window:
            put(rows, attend(q[rows], _ImageKeysAtFirst(kv, first, last), layer, positions[rows], scale, window,
                             **kw))
            continue
        for r in rows.tolist():  # an image longer than the window: a row at a time
            wider = window + int(last - positions[r])
            put(np.array([r]), attend(q[r:r + 1], kv, layer, limits[r:r + 1], scale, wider, **kw))
    return out
