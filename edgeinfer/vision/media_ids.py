"""Image positions in a token sequence: ids derived from each chunk's digest, and the rows and attention they stand for.

A prompt with images stays a list of ints, so the session manager, the prefix cache and the
resident sequence work on it unchanged: image row r of a chunk with digest d takes the id
-(1 + (key(d, r) << ROW_BITS) + r), negative so it can never be a vocabulary id, key(d, r)
KEY_BITS of sha256(d, r). The same image sent again gets the same ids, so its K/V are found in
the prefix cache like any text; two different images differ in their ids, and a cached block
of image rows matches only if every row's key does (one key is too few bits to trust alone).
`MediaRows` (one prompt's chunks) turns the ids of a forward pass into a `MediaStep`: the
embedding rows that replace token embeddings there, for non-causal chunks (gemma3) each
query row's image span, and for a text model with M-RoPE (Qwen-VL's images on their grid)
each row's (t, h, w) (edgeinfer.vision.grid_positions). An image's grid is part of its rows'
keys: its position advance is in what the prefix cache matches.
"""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from edgeinfer.errors import EdgeInferError
from edgeinfer.vision.chunk import ImageChunk
from edgeinfer.vision.grid_positions import GridPositions

ROW_BITS = 20  # rows per image: libmtmd's largest grids stay far below 2^20 tokens
KEY_BITS = 40  # bits of key(d, r) in an id: ids stay inside int64 (1 + 40 + 20 < 63)
MAX_ROWS = 1 << ROW_BITS
MIN_DIGEST = 32  # hex characters: an image chunk's digest is sha256 hex (64)


def chunk_ids(chunk: ImageChunk) -> list[int]:
    """The ids standing for the chunk's rows, in order."""
    digest = chunk.digest
    if not isinstance(digest, str) or len(digest) < MIN_DIGEST or not all(c in _HEX for c in digest):
        raise EdgeInferError(f"an image chunk's digest must be at least {MIN_DIGEST} hex characters")
    if not 1 <= chunk.n_tokens < MAX_ROWS:
        raise EdgeInferError(f"an image chunk must have 1 to {MAX_ROWS - 1} rows, got {chunk.n_tokens}")
    if chunk.grid is not None:  # the grid sets the positions the image and the text after it take
        digest = f"{digest}:{chunk.grid[0]}x{chunk.grid[1]}"
    ids = []
    for r in range(chunk.n_tokens):
        key = int.from_bytes(hashlib.sha256(f"{digest}:{r}".encode()).digest()[:KEY_BITS // 8], "little")
        ids.append(-(1 + (key << ROW_BITS) + r))
    return ids


_HEX = frozenset("0123456789abcdefABCDEF")


def text_only(ids: Sequence[int]) -> list[int]:
    """The ids without image rows: what samplers' penalties and n-gram drafts read (libmtmd
    feeds the sampler no image positions)."""
    return [t for t in ids if t >= 0]


def _rows(ids: np.ndarray) -> np.ndarray:
    """The row index each image id carries."""
    return (-np.asarray(ids, dtype=np.int64) - 1) & (MAX_ROWS - 1)


def image_runs(ids: Sequence[int]) -> list[tuple[int, int]]:
    """[start, end) index ranges of consecutive rows of one image (row 0 starts a run)."""
    arr = np.asarray(ids, dtype=np.int64)
    runs: list[tuple[int, int]] = []
    idx = np.flatnonzero(arr < 0)
    if not idx.size:
        return runs
    rows = _rows(arr[idx])
    start = int(idx[0])
    for j in range(1, idx.size):
        same = idx[j] == idx[j - 1] + 1 and rows[j] == rows[j - 1] + 1
        if not same:
            runs.append((start, int(idx[j - 1]) + 1))
            start = int(idx[j])
    runs.append((start, int(idx[-1]) + 1))
    return runs


@dataclass(frozen=True)
class MediaStep:
    """What one forward pass needs of its image rows."""

    where: np.ndarray        # (n,) bool: rows that are image rows
    rows: np.ndarray         # (n_image_rows, n_embd) float32, in the order of `where`'s True rows
    limits: np.ndarray | None  # (n,) the last key position each query row sees; None: all causal
    firsts: np.ndarray | None = None  # (n,) its non-causal image's first position (its own: a causal row)
    grid: np.ndarray | None = None  # (n, 3) M-RoPE (t, h, w) of each row; None: one position a row

    def token_ids(self, tokens: np.ndarray) -> np.ndarray:
        """tokens with image rows read as id 0 (their embedding is replaced by `place`)."""
        return np.where(self.where, 0, tokens)

    def place(self, x: np.ndarray) -> np.ndarray:
        """x (n, n_embd) with the image rows put in: not scaled by Gemma's sqrt(n_embd), as libmtmd."""
        x = np.array(x, dtype=np.float32, copy=True)
        x[self.where] = self.rows
        return x


class MediaRows:
    """The images of one request, by their rows' ids: what `step` reads image ids against."""

    def __init__(self, chunks: Sequence[ImageChunk], n_embd: int, mrope: bool = False) -> None:
        """mrope: the text model rotates by M-RoPE sections, so images with a grid take their
        grid positions (libmtmd: when the text model's rope type is M-RoPE)."""
        self._rows: dict[int, tuple[ImageChunk, int]] = {}  # id -> (its chunk, its row)
        self._last: dict[str, int] = {}  # digest -> the id of the image's last row
        self._n_embd, self._mrope = n_embd, mrope
        self._grid: GridPositions | None = None  # set by `placed`
        for chunk in chunks:
            if not isinstance(chunk, ImageChunk):
                raise EdgeInferError(f"an image must be encoded to an ImageChunk, got {type(chunk).__name__}")
            emb = chunk.embeddings
            if not isinstance(emb, np.ndarray) or emb.dtype != np.float32 or emb.ndim != 2:
                raise EdgeInferError("an image chunk's embeddings must be a 2-D float32 array")
            if emb.shape[1] != n_embd:
                raise EdgeInferError(f"image embeddings are {emb.shape[1]} wide but the text model takes "
                                     f"{n_embd}: the mmproj does not belong to this model")
            if not np.isfinite(emb).all():
                raise EdgeInferError("an image chunk's embeddings are not all finite")
            if (chunk.grid is not None) != mrope:  # libmtmd places an image by the text model's rope type
                raise EdgeInferError("images with M-RoPE grid positions (Qwen-VL) go with a text model with M-RoPE "
                                     "(qwen35) and only there: the mmproj does not belong to this model")
            if chunk.grid is not None and chunk.grid[0] * chunk.grid[1] != chunk.n_tokens:
                raise EdgeInferError(f"an image chunk's grid {chunk.grid} does not hold its {chunk.n_tokens} rows")
            ids = chunk_ids(chunk)
            if self._last.get(chunk.digest, ids[-1]) != ids[-1]:
                raise EdgeInferError("two images share a digest but not their token count")
            self._last[chunk.digest] = ids[-1]
            self._rows.update((t, (chunk, r)) for r, t in enumerate(ids))

    def __len__(self) -> int:
        return len(self._last)

    def placed(self, ids: Sequence[int]) -> MediaRows:
        """These images where the prompt `ids` (a whole sequence's beginning) holds them: with
        M-RoPE, what gives every position of the sequence its grid positions."""
        if not self._mrope or self._grid is not None:
            return self
        images = []
        for a, b in image_runs(ids):
            got = self._rows.get(int(ids[a]))
            if got is None:
                raise EdgeInferError("the prompt holds image positions of an image that was not given")
            chunk, row = got
            if row or b - a != chunk.n_tokens:  # a cut image has no place on its grid
                raise EdgeInferError("the prompt holds part of an image")
            images.append((a, *chunk.grid))
        out = copy.copy(self)
        out._grid = GridPositions(images)
        return out

    def step(self, tokens: np.ndarray, positions: np.ndarray) -> MediaStep | None:
        """The image rows of a forward pass of `tokens` at `positions` (None: there are none).
        A non-causal image's rows must run with all its later rows in the same pass: each
        query row sees the image's last position (and the sliding window of its own)."""
        tokens = np.asarray(tokens, dtype=np.int64)
        where = tokens < 0
        positions = np.asarray(positions, dtype=np.int64)
        if self._mrope and self._grid is None:
            raise EdgeInferError("images with M-RoPE positions must be placed in their prompt first (MediaRows.placed)")
        grid = self._grid.at(positions) if self._grid is not None else None
        if not where.any():  # text after the images: its M-RoPE positions still lag behind
            return None if grid is None else MediaStep(where, np.zeros((0, self._n_embd), np.float32), None,
                                                       grid=grid)
        out, limits, firsts = [], None, None
        idx = np.flatnonzero(where)
        for j, t in enumerate(tokens[where].tolist()):
            got = self._rows.get(t)
            if got is None:
                raise EdgeInferError("the prompt holds image positions of an image that was not given")
            chunk, row = got
            out.append(chunk.embeddings[row])
            if chunk.non_causal:
                last = idx[j] + chunk.n_tokens - 1 - row  # index of the image's last row in this pass
                if last >= len(tokens) or tokens[last] != self._last[chunk.digest]:
                    raise EdgeInferError("a non-causal image must run in one forward pass")
                if limits is None:
                    limits, firsts = positions.copy(), positions.copy()
                limits[idx[j]] = positions[last]
                firsts[idx[j]] = positions[idx[j]] - row
        return MediaStep(where, np.stack(out).astype(np.float32, copy=False), limits, firsts, grid)

    def _non_causal(self, token: int) -> bool:
        got = self._rows.get(int(token))
        return got is None or got[0].non_causal  # an image not given: kept whole, step names it

    def keep_whole(self, tokens: Sequence[int], cuts: list[int], max_rows: int) -> list[int]:
        """Prefill cut points (engine.chunk_bounds') moved off the inside of every non-causal
        image: a cut inside one goes to its start, or past its end where the piece would be
        empty. A non-causal image longer than `max_rows` (one prefill pass) is an error. A causal
        image (qwen3vl) may be cut anywhere, as libmtmd splits it into n_batch batches."""
        runs = [(a, b) for a, b in image_runs(tokens) if self._non_causal(tokens[a])]
        if not runs:
            return cuts
        for a, b in runs:
            n = b - a  # a cached prefix may have taken the image's first rows: what is left runs here
            if n > max_rows:
                raise EdgeInferError(f"an image of {n} tokens does not fit one prefill pass of {max_rows} "
                                     f"tokens; raise --prefill-chunk (-ub) to at least {n}")
        out = [cuts[0]]
        for c in cuts[1:]:
            for a, b in runs:
                if a < c < b:
                    c = a if a > out[-1] else b
                    break
            if c > out[-1]:
                out.append(c)
        if out[-1] != cuts[-1]:
            out.append(cuts[-1])
        return out
