"""A prompt with images as token ids: text split at its media markers, each image in its projector's wrap (libmtmd).

Each text piece between markers is tokenized on its own, without BOS (libmtmd's
mtmd_tokenize); the prompt's BOS goes first. An image becomes its begin text (special tokens
parsed), its rows' ids (edgeinfer.vision.media_ids) and its end text. A prompt without a
marker gets one per image before its text, as llama.cpp's mtmd-cli does.
"""

from __future__ import annotations

from typing import Callable, Sequence

from edgeinfer.errors import EdgeInferError
from edgeinfer.vision.chunk import ImageChunk
from edgeinfer.vision.media_ids import chunk_ids

MARKER = "<__media__>"  # llama.cpp's mtmd_default_marker()

# The text libmtmd writes around an image, by projector type (tools/mtmd/mtmd.cpp); none: bare rows
WRAPS: dict[str, tuple[str, str]] = {
    "gemma3": ("<start_of_image>", "<end_of_image>"),
    "gemma3nv": ("<start_of_image>", "<end_of_image>"),
    "gemma4v": ("<|image>", "<image|>"),
    "qwen3vl_merger": ("<|vision_start|>", "<|vision_end|>"),  # Qwen3-VL, Qwen3.5
}


def wrap_for(projector_type: str) -> tuple[str, str]:
    """(begin, end) text around an image of this projector type."""
    return WRAPS.get(str(projector_type).lower(), ("", ""))


def with_markers(text: str, n_images: int, marker: str = MARKER) -> str:
    """`text` with a marker per image before it when it has none."""
    return text if marker in text or not n_images else marker * n_images + text


def image_prompt_ids(text: str, chunks: Sequence[ImageChunk], tokenizer, wrap: tuple[str, str],
                     tokenize_text: Callable[[str], list[int]], add_special: bool = True,
                     marker: str = MARKER) -> list[int]:
    """Token ids of `text` whose markers stand for `chunks`, in order; `tokenize_text(piece)`
    tokenizes a piece between markers (no BOS). The counts must match, as libmtmd checks."""
    pieces = text.split(marker)
    if len(pieces) - 1 != len(chunks):
        raise EdgeInferError(f"the prompt has {len(pieces) - 1} image marker(s) {marker} for {len(chunks)} "
                             f"image(s): give one image per marker")
    begin, end = (_special_ids(tokenizer, t) for t in wrap)
    out: list[int] = []
    if add_special and tokenizer.add_bos:
        out.append(tokenizer.bos_id)
    for i, piece in enumerate(pieces):
        if piece:
            out += tokenize_text(piece)
        if i < len(chunks):
            out += begin + chunk_ids(chunks[i]) + end
    return out


def _special_ids(tokenizer, text: str) -> list[int]:
    """The wrap text's ids, special tokens parsed; it must be one control token each, or the
    model was not made for this projector."""
    if not text:
        return []
    ids = tokenizer.tokenize(text, add_special=False, parse_special=True)
    if len(ids) != 1:
        raise EdgeInferError(f"the model's vocabulary has no {text} token: the mmproj does not belong to it")
    return ids
