"""A request's images, from what a client sends to checked bytes the model takes.

Read here: data URIs, raw base64, Anthropic sources, remote URLs (serve --allow-image-urls only).

Each dialect hands every image it reads to one `RequestImages` (a 400 names the field of a bad
one) and gets back the OpenAI image part Model.chat reads; `resolve` then fetches the remote
ones (off the event loop) and gives the bytes in order, for Model.generate's `images`. What
reaches the model is always bytes checked here (for Model.chat, as a data URI), never a path:
request text never names a file.
Checked before anything is decoded: the model has a projector (--mmproj), the number of
images, the base64 text's length (so the decoded size is bounded before decoding), then the
bytes' size, their format (PNG, JPEG, WebP or GIF: what edgeinfer.vision.image_io decodes) and
the pixel count their header claims.
"""
from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass
from typing import Any

from edgeinfer.server.errors import APIError
from edgeinfer.server.image_fetch import FetchError, fetch, is_remote

# llama.cpp's default media marker, where an image goes in a prompt's text: edgeinfer.vision's
# prompt_images.MARKER, written out so the server does not import the vision package at start-up
# (a test checks the two are equal)
MARKER = "<__media__>"
MAX_IMAGES = 16   # per request: each costs an encoder pass, so a request cannot ask for hundreds
NO_IMAGES = "this model has no image input: start the server with --mmproj (the model's vision projector file)"
_FORMATS = "PNG, JPEG, WebP or GIF"


def has_image_input(model) -> bool:
    """Whether the model takes images: it was loaded with an mmproj (Model.images is set)."""
    return getattr(model, "images", None) is not None


def has_images(messages: list[dict]) -> bool:
    """Whether chat messages (as the dialects make them) hold image parts."""
    return any(isinstance(m.get("content"), list) and any(p.get("type") == "image_url" for p in m["content"])
               for m in messages)


def with_markers(messages: list[dict]) -> list[dict]:
    """The messages with each image part's place taken by the media marker in the message's text:
    the prompt as `verbose` shows it (the images themselves are not tokens)."""
    if not has_images(messages):
        return messages
    return [{**m, "content": "".join(MARKER if p.get("type") == "image_url" else p.get("text", "")
                                     for p in m["content"])} if isinstance(m.get("content"), list) else m
            for m in messages]


def _bad(field: str, why: str) -> APIError:
    return APIError(400, f"invalid field {field!r}: {why}", param=field)


def media_type(data: bytes) -> str | None:
    """The image format by its first bytes, as a media type; None for anything else."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image/png"
    if data.startswith(b"\xff\xd8\xff"):
        return "image/jpeg"
    if data.startswith((b"GIF87a", b"GIF89a")):
        return "image/gif"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return None


def decode_base64(text: Any, field: str, limit: int) -> bytes:
    """Base64 text's bytes, the length checked before decoding (at most `limit` bytes come out)."""
    if not isinstance(text, str):
        raise _bad(field, f"an image is base64 text, got {type(text).__name__}")
    longest = -(-limit // 3) * 4  # base64 of `limit` bytes
    if len(text) > 2 * longest:  # (room for line breaks some encoders put in, taken out below)
        raise _bad(field, f"the image is larger than the {limit}-byte limit")
    text = "".join(text.split()) if any(c in text for c in " \t\r\n") else text
    if len(text) > longest:
        raise _bad(field, f"the image is larger than the {limit}-byte limit")
    if not text:
        raise _bad(field, "the image is empty")
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise _bad(field, "the image is not valid base64") from None
    return data


def checked(data: bytes, field: str, limit: int) -> tuple[bytes, str]:
    """(data, its media type): not empty, within `limit`, and an image format the model decodes."""
    if not data:
        raise _bad(field, "the image is empty")
    if len(data) > limit:
        raise _bad(field, f"the image is larger than the {limit}-byte limit")
    kind = media_type(data)
    if kind is None:
        raise _bad(field, f"the data is not an image this server reads ({_FORMATS})")
    _check_header(data, field)
    return data, kind


def _check_header(data: bytes, field: str) -> None:
    """The image's header read (not its pixels): a header Pillow cannot read, or a size past the
    pixel budget (a decompression bomb), is refused here, where the field can be named."""
    import warnings

    from PIL import Image as PILImage

    from edgeinfer.vision.image_io import FORMATS, MAX_PIXELS

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", PILImage.DecompressionBombWarning)
            with PILImage.open(io.BytesIO(data), formats=FORMATS) as img:
                width, height = img.size
    except PILImage.DecompressionBombError:
        raise _bad(field, f"the image is larger than the {MAX_PIXELS // 1_000_000} megapixel limit") from None
    except (PILImage.UnidentifiedImageError, OSError, ValueError, SyntaxError, EOFError):
        raise _bad(field, f"the image's header cannot be read ({_FORMATS})") from None
    if width * height > MAX_PIXELS:
        raise _bad(field, f"the image of {width}x{height} pixels is larger than the "
                          f"{MAX_PIXELS // 1_000_000} megapixel limit")


def _data_uri(url: str, field: str, limit: int) -> bytes:
    """data:image/...;base64,... -> bytes (the media type checked loosely: image/*)."""
    head, sep, payload = url.partition(",")
    params = head[len("data:"):].split(";")
    kind = params[0].strip().lower()
    if not sep or params[-1].strip().lower() != "base64":
        raise _bad(field, "a data URI must be base64 (data:image/png;base64,...)")
    if not kind.startswith("image/"):
        raise _bad(field, f"a data URI's media type must be an image (image/png, image/jpeg...), got {kind!r}")
    return decode_base64(payload, field, limit)


@dataclass
class ImageRef:
    """One image of the request: where it came from, its bytes (a remote one's once fetched),
    and the image part Model.chat reads (its data URI written once the bytes are known)."""

    field: str
    part: dict
    data: bytes | None = None
    url: str | None = None   # a remote URL still to fetch


class RequestImages:
    """The images of one request, in the order the dialect read them."""

    def __init__(self, state, model) -> None:
        self.model = model
        self.allow_urls = bool(state.config.allow_image_urls)
        self.limit = int(state.config.max_image_bytes)
        self.refs: list[ImageRef] = []

    def __len__(self) -> int:
        return len(self.refs)

    def _admit(self, field: str) -> None:
        if not has_image_input(self.model):
            problem = getattr(self.model, "mmproj_problem", "")  # an mmproj found beside it that did not load
            raise _bad(field, f"this model has no image input: its mmproj did not load: {problem}" if problem
                       else NO_IMAGES)
        if len(self.refs) >= MAX_IMAGES:
            raise _bad(field, f"a request may hold at most {MAX_IMAGES} images")

    def _add(self, field: str, data: bytes | None, url: str | None = None) -> dict:
        part: dict = {"type": "image_url", "image_url": {"url": ""}}
        ref = ImageRef(field, part, url=url)
        if data is not None:
            self._set(ref, data)
        self.refs.append(ref)
        return part

    def _set(self, ref: ImageRef, data: bytes) -> None:
        ref.data, kind = checked(data, ref.field, self.limit)
        ref.part["image_url"]["url"] = f"data:{kind};base64,{base64.b64encode(ref.data).decode('ascii')}"

    def url(self, value: Any, field: str) -> dict:
        """An image URL as OpenAI's image_url.url and the Responses API's image_url send it: a
        data URI, raw base64 (llama-server takes it there), or an http(s) URL (fetched only
        with --allow-image-urls). A file path or file:// URL is never read."""
        self._admit(field)
        if not isinstance(value, str) or not value.strip():
            raise _bad(field, "an image needs a data URI (data:image/png;base64,...)")
        value = value.strip()
        scheme = value.partition(":")[0].lower() if ":" in value else ""
        if scheme == "data":
            return self._add(field, _data_uri(value, field, self.limit))
        if is_remote(value):
            if not self.allow_urls:
                raise _bad(field, "remote image URLs are not fetched by this server: send the image as a data "
                                  "URI (data:image/png;base64,...), or start the server with --allow-image-urls")
            return self._add(field, None, url=value)
        if not scheme:
            return self._add(field, decode_base64(value, field, self.limit))
        raise _bad(field, f"{scheme!r} URLs are not read: send the image as a data URI (data:image/png;base64,...)")

    def base64(self, value: Any, field: str) -> dict:
        """Raw base64 (Ollama's `images`, llama-server's `multimodal_data`)."""
        self._admit(field)
        return self._add(field, decode_base64(value, field, self.limit))

    def anthropic(self, source: Any, field: str) -> dict:
        """An Anthropic image block's source: {"type": "base64", "media_type", "data"} or
        {"type": "url", "url"}; its `file` form needs Anthropic's Files API, which is not here."""
        self._admit(field)
        if not isinstance(source, dict):
            raise _bad(field, "an image source is an object")
        kind = source.get("type")
        fields = {"base64": {"type", "media_type", "data"}, "url": {"type", "url"}}.get(kind)
        if fields is None:
            raise _bad(field + ".type", f"image source type {kind!r} is not supported (base64, url)")
        extra = sorted(set(source) - fields)
        if extra:
            at = f"{field}.{extra[0]}"
            raise APIError(400, f"unsupported field {at!r}: this server does not know it, so it cannot honour it",
                           param=at)
        if kind == "url":
            return self.url(source.get("url"), field + ".url")
        media = source.get("media_type")
        if not isinstance(media, str) or not media.lower().startswith("image/"):
            raise _bad(field + ".media_type", f"an image's media type (image/png, image/jpeg...), got {media!r}")
        if "data" not in source:
            raise _bad(field + ".data", "the image's base64 data is missing")
        return self._add(field + ".data", decode_base64(source["data"], field + ".data", self.limit))

    async def resolve(self) -> list[bytes]:
        """Every image's bytes, in order; remote ones fetched one after another, off the event
        loop, each within the byte limit and the fetch timeout (a failure is a 400 naming it)."""
        import anyio

        for ref in self.refs:
            if ref.data is None and ref.url is not None:
                try:
                    data = await anyio.to_thread.run_sync(fetch, ref.url, self.limit)
                except FetchError as exc:
                    raise _bad(ref.field, f"cannot fetch the image at {ref.url[:200]!r}: {exc}") from None
                self._set(ref, data)
        return [ref.data for ref in self.refs]
