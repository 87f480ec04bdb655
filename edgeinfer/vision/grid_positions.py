"""M-RoPE positions of a sequence holding images on a 2-D grid (Qwen-VL), as libmtmd places them.

A row's sequence position p (its index: what the K/V cache stores and the causal mask reads)
stays as it is; only the rotation takes libmtmd's positions (mtmd_image_tokens_get_decoder_pos,
mtmd_helper_decode_image_chunk). An image of rows x cols tokens whose first row sits where
text would take position P puts row r at (t, h, w) = (P, P + r // cols, P + r % cols), and
advances the sequence by max(rows, cols) positions (mtmd_input_chunk_get_n_pos), not by its
rows x cols tokens: the text after it continues there, each text row at (q, q, q) with q = p
minus the lag of the images before it. The 2-D causal mask llama.cpp applies among an image's
rows (all at t = P) keeps a row from the rows after it in raster order: what the causal mask
by sequence position already does.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


class GridPositions:
    """Where a prompt's images sit, and the (t, h, w) of any position of a sequence that
    begins with that prompt (positions past it: generated text, after the last image)."""

    def __init__(self, images: Iterable[tuple[int, int, int]]) -> None:
        """`images`: (first position, rows, cols) of each image in the prompt, in order; its
        rows x cols tokens take the positions from the first on."""
        starts, ends, firsts, cols, lags = [], [], [], [], []
        lag = 0
        for start, rows, width in images:
            starts.append(start)
            ends.append(start + rows * width)
            firsts.append(start - lag)
            cols.append(width)
            lag += rows * width - max(rows, width)
            lags.append(lag)
        self._starts, self._ends = np.array(starts, np.int64), np.array(ends, np.int64)
        self._firsts, self._cols = np.array(firsts, np.int64), np.array(cols, np.int64)
        self._lags = np.array(lags, np.int64)  # after each image

    @property
    def lag(self) -> int:
        """How far the prompt's images leave the text positions behind the sequence's."""
        return int(self._lags[-1]) if self._lags.size else 0

    def at(self, positions: np.ndarray) -> np.ndarray:
        """(n, 3) int64 (t, h, w) of the rows at these sequence positions."""
        p = np.asarray(positions, dtype=np.int64)
        if not self._starts.size:
            return np.repeat(p[:, None], 3, axis=1)
        k = np.searchsorted(self._starts, p, side="right") - 1  # the last image starting at or before p
        kk = np.maximum(k, 0)
        text = p - np.where(k >= 0, self._lags[kk], 0)
        out = np.repeat(text[:, None], 3, axis=1)
        inside = (k >= 0) & (p < self._ends[kk])
        if inside.any():
            j = kk[inside]
            r, first, c = p[inside] - self._starts[j], self._firsts[j], self._cols[j]
            out[inside] = np.stack([first, first + r // c, first + r % c], axis=1)
        return out
