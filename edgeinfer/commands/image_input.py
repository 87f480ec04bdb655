"""`run`'s images: the --mmproj / --no-mmproj / --image flags, and image files as chat image parts;
--no-mmproj-offload for run, chat and serve."""

from __future__ import annotations

import base64
import mimetypes
from pathlib import Path

from edgeinfer.errors import EdgeInferError


def add_image_options(p) -> None:
    p.add_argument("--mmproj", default=None, metavar="FILE",
                   help="the vision encoder's GGUF (default: an mmproj-*.gguf beside a model named from the store)")
    p.add_argument("--no-mmproj", action="store_true", help="load no mmproj, even one found beside the model")
    p.add_argument("--image", action="append", default=[], metavar="PATH",
                   help="an image for the prompt (repeatable; at each <__media__> in it, else before it)")
    add_offload_option(p)


def add_offload_option(p) -> None:
    """--no-mmproj-offload (run, chat, serve); mmproj_offload_of reads it for edgeinfer.load."""
    p.add_argument("--no-mmproj-offload", action="store_true",
                   help="keep the vision encoder on the CPU when the model has GPU layers "
                        "(llama.cpp's --no-mmproj-offload; by default it runs in VRAM beside them)")


def mmproj_offload_of(args) -> bool:
    """edgeinfer.load's mmproj_offload: False with --no-mmproj-offload."""
    return not getattr(args, "no_mmproj_offload", False)


def mmproj_of(args) -> str | None:
    """edgeinfer.load's mmproj: the flag's file (checked to exist), "auto", or None."""
    if args.no_mmproj:
        if args.mmproj or args.image:
            raise EdgeInferError("--no-mmproj loads no vision encoder: it cannot go with --mmproj or --image")
        return None
    if args.mmproj is not None:
        if not Path(args.mmproj).expanduser().is_file():
            raise EdgeInferError(f"--mmproj: no such file: {args.mmproj}")
        return str(Path(args.mmproj).expanduser())
    return "auto"


def read_image_file(path: str) -> bytes:
    """An image file's bytes (bounded: edgeinfer.vision.request_images.MAX_IMAGE_BYTES)."""
    from edgeinfer.vision.request_images import MAX_IMAGE_BYTES

    try:
        with open(Path(path).expanduser(), "rb") as f:
            data = f.read(MAX_IMAGE_BYTES + 1)
    except OSError as exc:
        raise EdgeInferError(f"cannot read image {path!r}: {exc.strerror or exc}") from None
    if len(data) > MAX_IMAGE_BYTES:
        raise EdgeInferError(f"image {path!r} is larger than {MAX_IMAGE_BYTES >> 20} MiB")
    return data


def image_part(path: str) -> dict:
    """An OpenAI image part holding the file as a data URL (what Model.chat reads)."""
    mime = mimetypes.guess_type(path)[0] or "image/png"
    if not mime.startswith("image/"):
        mime = "image/png"  # the decoder reads the format from the bytes, not the name
    url = f"data:{mime};base64," + base64.b64encode(read_image_file(path)).decode("ascii")
    return {"type": "image_url", "image_url": {"url": url}}


def user_content(text: str, paths: list[str]) -> str | list[dict]:
    """A user message's content: the text, with each image at a <__media__> in it (one each),
    or all of them before it when it has none (as llama.cpp's mtmd-cli)."""
    if not paths:
        return text
    from edgeinfer.vision.prompt_images import MARKER

    pieces = text.split(MARKER)
    if len(pieces) == 1:
        pieces = [""] * len(paths) + [text]
    if len(pieces) - 1 != len(paths):
        raise EdgeInferError(f"the prompt has {len(pieces) - 1} {MARKER} marker(s) for {len(paths)} image(s)")
    parts: list[dict] = []
    for i, piece in enumerate(pieces):
        if piece:
            parts.append({"type": "text", "text": piece})
        if i < len(paths):
            parts.append(image_part(paths[i]))
    return parts
