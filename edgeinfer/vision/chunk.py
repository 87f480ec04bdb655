"""ImageChunk: an encoded image as the text model takes it in."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ImageChunk:
    """One image, encoded and projected: the rows the text model takes in place of token
    embeddings, and what the sequence needs to place and cache them."""
    embeddings: np.ndarray          # (n_tokens, n_embd) float32, the text model's width
    digest: str                     # sha256 hex of the decoded RGB pixels and their size
    grid: tuple[int, int] | None = None   # (rows, cols) of image tokens: M-RoPE positions (qwen3vl)
    non_causal: bool = False        # the image's tokens attend to each other both ways (gemma3)

    @property
    def n_tokens(self) -> int:
        return int(self.embeddings.shape[0])
