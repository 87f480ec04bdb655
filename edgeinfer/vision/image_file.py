"""An image file a person names (the REPL, the chat TUI): read, its header checked, labelled by name and size."""

from __future__ import annotations

import base64
import io
import warnings
from dataclasses import dataclass
from pathlib import Path

from edgeinfer.vision.image_io import FORMATS, MAX_PIXELS, ImageError
from edgeinfer.vision.request_images import MAX_IMAGE_BYTES

_MIME = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp", "GIF": "image/gif"}


@dataclass(frozen=True)
class ImageFile:
    """A checked image file: its bytes as read, its pixel size from the header."""

    path: str
    data: bytes
    width: int
    height: int
    mime: str

    @property
    def name(self) -> str:
        return Path(self.path).name

    @property
    def label(self) -> str:
        """"cat.png 1024×768": how a transcript names it."""
        return f"{self.name} {self.width}×{self.height}"

    def part(self) -> dict:
        """The OpenAI image part Model.chat reads (a data URL of the bytes read)."""
        url = f"data:{self.mime};base64," + base64.b64encode(self.data).decode("ascii")
        return {"type": "image_url", "image_url": {"url": url}}


def open_image_file(path: str) -> ImageFile:
    """Read `path` and check its header only (format, the 50-megapixel budget): a bad file is an
    ImageError of one line naming it, before any model work."""
    from PIL import Image as PILImage  # Pillow loads only when an image is named

    file = Path(path).expanduser()
    label = file.name or path
    try:
        with open(file, "rb") as f:
            data = f.read(MAX_IMAGE_BYTES + 1)
    except OSError as exc:
        raise ImageError(f"cannot read image {path!r}: {exc.strerror or exc}") from None
    if len(data) > MAX_IMAGE_BYTES:
        raise ImageError(f"{label}: larger than {MAX_IMAGE_BYTES >> 20} MiB")
    if not data:
        raise ImageError(f"{label}: empty file, not an image")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", PILImage.DecompressionBombWarning)  # our budget refuses first
            img = PILImage.open(io.BytesIO(data), formats=FORMATS)  # the header, not the pixels
            (width, height), fmt = img.size, img.format
    except PILImage.DecompressionBombError:
        raise ImageError(f"{label}: larger than the {MAX_PIXELS // 1_000_000} megapixel limit") from None
    except (OSError, ValueError, SyntaxError, EOFError):  # UnidentifiedImageError is an OSError
        raise ImageError(f"{label}: not an image in a supported format ({', '.join(FORMATS)})") from None
    if width * height > MAX_PIXELS:
        raise ImageError(f"{label}: {width}×{height} pixels is larger than the "
                         f"{MAX_PIXELS // 1_000_000} megapixel limit")
    return ImageFile(str(file), data, width, height, _MIME.get(fmt, "image/png"))
