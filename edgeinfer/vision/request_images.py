"""A request's images to ImageChunks: paths, bytes and chat image parts read, decoded, encoded once per digest.

Chat messages carry images as OpenAI image parts ({"type": "image_url", "image_url": {"url":
"data:image/png;base64,..."}}); a message holding some becomes one string with the media
marker where each image was, its text parts joined as llama-server joins them, and the
images join the list in marker order. Only data URLs are read: a URL is never fetched on a
client's behalf.
"""

from __future__ import annotations

import base64
import binascii
import os
import threading
from collections import OrderedDict
from typing import Any, Sequence

from edgeinfer.errors import EdgeInferError
from edgeinfer.vision.chunk import ImageChunk

MAX_IMAGE_BYTES = 64 << 20  # an encoded image larger than this is refused before decoding
KEEP_ENCODED = 8            # encoded images kept by digest: a conversation re-sends its images


class ImageEncoder:
    """The model's projector, checked against the text model, with its latest chunks by digest."""

    def __init__(self, projector: Any, n_embd: int) -> None:
        width = getattr(projector, "n_embd", None)
        if not isinstance(width, int) or width != n_embd:
            raise EdgeInferError(f"the mmproj gives {width}-wide image embeddings but the text model is "
                                 f"{n_embd} wide: it belongs to another model")
        self.projector = projector
        self.projector_type = str(getattr(projector, "projector_type", ""))
        self._kept: OrderedDict[str, ImageChunk] = OrderedDict()
        self._lock = threading.Lock()

    def encode(self, source: Any) -> ImageChunk:
        """An ImageChunk of a path, bytes, a decoded image_io.Image, or an ImageChunk as is."""
        if isinstance(source, ImageChunk):
            return source
        from edgeinfer.vision.image_io import Image, decode_image

        if isinstance(source, Image):
            image = source
        elif isinstance(source, (bytes, bytearray, memoryview)):
            if len(source) > MAX_IMAGE_BYTES:
                raise EdgeInferError(f"an image of {len(source)} bytes is larger than the "
                                     f"{MAX_IMAGE_BYTES >> 20} MiB limit")
            image = decode_image(bytes(source))
        elif isinstance(source, (str, os.PathLike)):
            image = decode_image(source)
        else:
            raise EdgeInferError(f"an image must be a path, bytes or a data URL, got {type(source).__name__}")
        with self._lock:
            chunk = self._kept.get(image.digest)
            if chunk is not None:
                self._kept.move_to_end(image.digest)
                return chunk
        chunk = self.projector.encode(image)
        if not isinstance(chunk, ImageChunk):
            raise EdgeInferError("the projector did not return an ImageChunk")
        with self._lock:
            self._kept[image.digest] = chunk
            while len(self._kept) > KEEP_ENCODED:
                self._kept.popitem(last=False)
        return chunk


def data_url_bytes(url: Any) -> bytes:
    """The bytes of a base64 data URL (data:image/...;base64,...); anything else is refused."""
    if not isinstance(url, str) or not url.startswith("data:"):
        raise EdgeInferError("image_url must be a data URL (data:image/png;base64,...): "
                             "images are not fetched from the network")
    head, sep, payload = url.partition(",")
    if not sep or not head.endswith(";base64") or not head[5:].startswith("image/"):
        raise EdgeInferError("image_url must be a base64 data URL of an image (data:image/...;base64,...)")
    if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise EdgeInferError(f"an image larger than {MAX_IMAGE_BYTES >> 20} MiB is refused")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise EdgeInferError("image_url holds invalid base64") from None


def chat_images(messages: Sequence[Any], marker: str) -> tuple[list[Any], list[bytes]]:
    """(messages with every image part turned into `marker` in the message's text, the images'
    bytes in order). Messages without image parts are passed through as they are."""
    if not isinstance(messages, (list, tuple)):
        return messages, []  # the template's check names the problem
    out: list[Any] = []
    images: list[bytes] = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list) or not any(_is_image(p) for p in content):
            out.append(message)
            continue
        text, after_marker = "", False
        for part in content:
            if _is_image(part):
                ref = part.get("image_url")
                url = ref.get("url") if isinstance(ref, dict) else ref
                images.append(data_url_bytes(url))
                text, after_marker = text + marker, True
            elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                # llama.cpp's join for a message with media: text parts on their own lines,
                # no newline before or after a marker
                text += ("\n" if text and not after_marker else "") + part["text"]
                after_marker = False
            else:
                raise EdgeInferError(f"a content part must be {{'type': 'text', 'text': ...}} or an image_url part, "
                                     f"got {str(part)[:60]!r}")
        # one string, as llama-server hands the template a message with media (a template
        # that reads content as a string would otherwise print the parts' list)
        out.append({**message, "content": text})
    return out, images


def _is_image(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "image_url"
