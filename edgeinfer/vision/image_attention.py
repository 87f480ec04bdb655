"""Attention in which an image's rows see the whole image, on any backend's causal attention.

libmtmd runs a gemma3 image in one batch with causal attention off: a query at position p
sees every key of its sequence up to its image's last position L, and a sliding-window layer
still hides keys with p - kpos >= window. A backend's attention masks by one position per
query (kpos <= p, p - kpos < window), so it is called with L in place of p: exact without a
window. With one, L's window starts later than p's; the rows where a cached key falls in
between run alone with the window widened by L - p, which masks exactly p's window again.
"""

from __future__ import annotations

from typing import Callable

import numpy as np


def attention_to_limits(attend: Callable, q: np.ndarray, kv, layer: int, positions: np.ndarray,
                        limits: np.ndarray, scale: float, window: int, **kw) -> np.ndarray:
    """`attend(q, kv, layer, positions, scale, window, **kw)` (a Backend.attention) with query r
    seeing keys at positions <= limits[r] >= positions[r]; the window stays positions[r]'s."""
    positions = np.asarray(positions, dtype=np.int64)
    limits = np.asarray(limits, dtype=np.int64)
    if not window:
        return attend(q, kv, layer, limits, scale, window, **kw)
    kpos = np.sort(np.asarray(kv.layer_view(layer)[2], dtype=np.int64))
    # keys inside p's window but outside L's: kpos in (p - window, L - window]
    between = (np.searchsorted(kpos, limits - window, side="right")
               - np.searchsorted(kpos, positions - window, side="right"))
    alone = np.flatnonzero(between > 0)
    if not alone.size:
        return attend(q, kv, layer, limits, scale, window, **kw)
    together = np.flatnonzero(between == 0)
    out = None
    if together.size:
        part = attend(q[together], kv, layer, limits[together], scale, window, **kw)
        out = np.empty((q.shape[0],) + part.shape[1:], part.dtype)
        out[together] = part
    for r in alone.tolist():
        wider = window + int(limits[r] - positions[r])
        row = attend(q[r:r + 1], kv, layer, limits[r:r + 1], scale, wider, **kw)
        if out is None:
            out = np.empty((q.shape[0],) + row.shape[1:], row.dtype)
        out[r] = row[0]
    return out
