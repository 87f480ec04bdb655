"""Decode an image (PNG, JPEG, WebP, GIF's first frame) to RGB pixels under a pixel budget."""
from __future__ import annotations

import hashlib
import io
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgeinfer.errors import EdgeInferError

# Far above any photo a vision encoder is shown (they resize to < 1 MP), far below what
# a decompression bomb claims: refused from the header, before a pixel is decoded.
MAX_PIXELS = 50_000_000
FORMATS = ("PNG", "JPEG", "WEBP", "GIF")


class ImageError(EdgeInferError):
    """An image that cannot be decoded, or one larger than the pixel budget."""


@dataclass(frozen=True)
class Image:
    """Decoded RGB pixels and the digest a prefix cache can key them by."""
    pixels: np.ndarray   # (height, width, 3) uint8
    digest: str          # sha256 hex of the size and the pixels

    @property
    def width(self) -> int:
        return int(self.pixels.shape[1])

    @property
    def height(self) -> int:
        return int(self.pixels.shape[0])


def pixel_digest(pixels: np.ndarray) -> str:
    """sha256 of 'WxH' and the RGB bytes: equal pixels give equal digests, whatever the file."""
    h, w = pixels.shape[:2]
    sha = hashlib.sha256(f"{w}x{h}:".encode())
    sha.update(np.ascontiguousarray(pixels, np.uint8).tobytes())
    return sha.hexdigest()


def from_pixels(pixels: np.ndarray) -> Image:
    """An Image from an RGB uint8 (h, w, 3) array already in memory (tests, other decoders)."""
    arr = np.asarray(pixels)
    if arr.dtype != np.uint8 or arr.ndim != 3 or arr.shape[2] != 3 or 0 in arr.shape:
        raise ImageError(f"pixels must be a non-empty uint8 (height, width, 3) array, got "
                         f"{arr.dtype} {arr.shape}")
    if arr.shape[0] * arr.shape[1] > MAX_PIXELS:
        raise ImageError(f"image of {arr.shape[1]}x{arr.shape[0]} pixels is larger than the "
                         f"{MAX_PIXELS // 1_000_000} megapixel limit")
    arr = np.ascontiguousarray(arr)
    return Image(arr, pixel_digest(arr))


def decode_image(source: bytes | str | os.PathLike[str], name: str | None = None) -> Image:
    """Decode image bytes, or the file at a path; `name` labels the error lines."""
    from PIL import Image as PILImage  # Pillow loads only when an image arrives

    if isinstance(source, (bytes, bytearray, memoryview)):
        data, label = bytes(source), name or "image"
    else:
        label = name or str(source)
        try:
            data = Path(source).read_bytes()
        except OSError as exc:
            raise ImageError(f"{label}: cannot read the image: {exc.strerror or exc}") from None
    if not data:
        raise ImageError(f"{label}: empty image data")
    try:
        with warnings.catch_warnings():
            # Pillow's own bomb check only warns below twice its limit: ours refuses first
            warnings.simplefilter("ignore", PILImage.DecompressionBombWarning)
            img = PILImage.open(io.BytesIO(data), formats=FORMATS)  # reads the header only
            w, h = img.size
            if w * h > MAX_PIXELS:
                raise ImageError(f"{label}: image of {w}x{h} pixels is larger than the "
                                 f"{MAX_PIXELS // 1_000_000} megapixel limit")
            img.seek(0)  # GIF: the first frame
            rgb = img.convert("RGB")  # decodes; palette, grey, alpha and CMYK all end as RGB
    except ImageError:
        raise
    except PILImage.DecompressionBombError:  # Pillow's own guard, past twice its limit
        raise ImageError(f"{label}: image is larger than the {MAX_PIXELS // 1_000_000} megapixel limit") from None
    except PILImage.UnidentifiedImageError:
        raise ImageError(f"{label}: not an image in a supported format "
                         f"({', '.join(FORMATS)})") from None
    except (OSError, ValueError, SyntaxError, EOFError) as exc:
        # truncated or corrupt data: Pillow's message names what it met
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ImageError(f"{label}: corrupt or truncated image: {why}") from None
    pixels = np.asarray(rgb, dtype=np.uint8)
    return from_pixels(pixels)
