"""Images and mmproj files are someone else's input: each bad one is refused in one clear line."""
from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest

from gguf_factory import write_tiny_model
from mmproj_factory import VisionShape, write_gemma3_mmproj

from edgeinfer.errors import EdgeInferError
from edgeinfer.vision import image_io
from edgeinfer.vision.image_io import MAX_PIXELS, decode_image, from_pixels
from edgeinfer.vision.mmproj import load_mmproj


def _encode(pixels: np.ndarray, fmt: str, **kw) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt, **kw)
    return buf.getvalue()


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _png_claiming(width: int, height: int) -> bytes:
    """A valid PNG header and IHDR for width x height RGB, a few bytes of pixels and an end:
    a decompression bomb's shape, without its payload."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", zlib.compress(b"\0" * 64))
            + _chunk(b"IEND", b""))


def _refused(call, *words: str) -> str:
    with pytest.raises(EdgeInferError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message and message, message
    for word in words:
        assert word in message, (word, message)
    return message


PIXELS = np.random.default_rng(0).integers(0, 256, (12, 17, 3), dtype=np.uint8)


@pytest.mark.parametrize("fmt,kw", [("PNG", {}), ("WEBP", {"lossless": True})])
def test_lossless_formats_decode_to_the_same_pixels(fmt, kw):
    img = decode_image(_encode(PIXELS, fmt, **kw))
    assert img.pixels.dtype == np.uint8 and img.pixels.shape == (12, 17, 3)
    assert np.array_equal(img.pixels, PIXELS)
    assert img.digest == from_pixels(PIXELS).digest


def test_jpeg_decodes_close_and_a_path_works(tmp_path):
    path = tmp_path / "p.jpg"
    flat = np.full((16, 16, 3), (200, 30, 90), np.uint8)
    path.write_bytes(_encode(flat, "JPEG", quality=95))
    img = decode_image(path)
    assert img.pixels.shape == (16, 16, 3) and np.abs(img.pixels.astype(int) - flat).max() < 8


def test_gif_gives_its_first_frame_and_grey_or_alpha_become_rgb():
    from PIL import Image

    frames = [Image.new("RGB", (8, 8), c) for c in ((255, 0, 0), (0, 0, 255))]
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:])
    assert tuple(decode_image(buf.getvalue()).pixels[0, 0]) == (255, 0, 0)
    rgba = np.zeros((4, 4, 4), np.uint8)
    rgba[..., 1] = 99
    assert decode_image(_encode(rgba, "PNG")).pixels.shape == (4, 4, 3)
    grey = decode_image(_encode(np.full((4, 4), 77, np.uint8), "PNG")).pixels
    assert grey.shape == (4, 4, 3) and np.all(grey == 77)


def test_digest_names_the_pixels_and_their_size():
    other = PIXELS.copy()
    other[0, 0, 0] ^= 1
    assert from_pixels(other).digest != from_pixels(PIXELS).digest
    flat = np.zeros((2, 6, 3), np.uint8)   # the same bytes in another shape
    assert from_pixels(flat).digest != from_pixels(flat.reshape(6, 2, 3)).digest


def test_not_an_image():
    _refused(lambda: decode_image(b"hello, this is text", name="upload"), "upload", "not an image")
    _refused(lambda: decode_image(b""), "empty")


def test_truncated_and_corrupt_images():
    png = _encode(np.random.default_rng(1).integers(0, 256, (64, 64, 3), dtype=np.uint8), "PNG")
    _refused(lambda: decode_image(png[: len(png) // 2]), "corrupt or truncated")
    jpeg = _encode(np.full((64, 64, 3), 128, np.uint8), "JPEG")
    _refused(lambda: decode_image(jpeg[:40]), "image")
    broken = bytearray(png)
    broken[60:200] = b"\xff" * 140   # inside the compressed pixels: the CRC and zlib both fail
    _refused(lambda: decode_image(bytes(broken)), "corrupt or truncated")


@pytest.mark.parametrize("width,height", [(8000, 7000), (100_000, 100_000)])
def test_decompression_bomb_refused_from_the_header(width, height):
    """56 MP (over our limit, under Pillow's own) and 10 GP (over Pillow's too): refused from
    the header alone (the file holds no such pixels, so a decode would fail differently)."""
    _refused(lambda: decode_image(_png_claiming(width, height)), "megapixel limit")
    assert width * height > MAX_PIXELS


def test_pixels_in_memory_are_checked():
    _refused(lambda: from_pixels(np.zeros((4, 4), np.uint8)), "uint8 (height, width, 3)")
    _refused(lambda: from_pixels(np.zeros((4, 4, 3), np.float32)), "uint8")
    _refused(lambda: decode_image("/nonexistent/picture.png"), "cannot read")


def test_image_error_is_an_edgeinfer_error():
    assert issubclass(image_io.ImageError, EdgeInferError)


# -- mmproj files ----------------------------------------------------------------------

def _mmproj(tmp_path, **kw):
    return write_gemma3_mmproj(tmp_path / "mmproj.gguf", 64, "F32", **kw)


def test_unknown_projector_type_is_named(tmp_path):
    path = _mmproj(tmp_path, extra_metadata={"clip.projector_type": "llava-next-9000"})
    _refused(lambda: load_mmproj(path), "'llava-next-9000'", "not supported", "gemma3")


def test_missing_tensor_is_named(tmp_path):
    _refused(lambda: load_mmproj(_mmproj(tmp_path, omit_tensors=("v.blk.1.attn_k.weight",))),
             "missing tensor 'v.blk.1.attn_k.weight'")
    _refused(lambda: load_mmproj(_mmproj(tmp_path, omit_tensors=("mm.soft_emb_norm.weight",))),
             "'mm.soft_emb_norm.weight'")


@pytest.mark.parametrize("name,shape", [("v.blk.0.attn_q.weight", (64, 32)),
                                        ("v.position_embd.weight", (64, 9)),
                                        ("v.patch_embd.weight", (8, 8, 3, 64)),
                                        ("v.blk.1.ln2.bias", (32,)),
                                        ("mm.input_projection.weight", (64, 32))])
def test_tensor_of_the_wrong_shape_is_named(tmp_path, name, shape):
    _refused(lambda: load_mmproj(_mmproj(tmp_path, shape_overrides={name: shape})), repr(name), "shape")


@pytest.mark.parametrize("key,value,words", [
    ("clip.vision.image_std", [0.5, 0.0, 0.5], ("image_std", "positive")),
    ("clip.vision.image_mean", [0.5, 0.5], ("image_mean",)),
    ("clip.vision.patch_size", 0, ("patch_size",)),
    ("clip.vision.attention.head_count", 5, ("head",)),
    ("clip.vision.attention.layer_norm_epsilon", -1.0, ("layer_norm_epsilon",)),
    ("clip.vision.block_count", "two", ("block_count",)),
    ("clip.vision.projector.scale_factor", 3, ("scale_factor",)),
    ("clip.vision.image_size", None, ("image_size",)),
    ("clip.projector_type", None, ("projector_type",)),
    ("clip.has_vision_encoder", None, ("vision encoder",)),
])
def test_bad_metadata_is_named(tmp_path, key, value, words):
    _refused(lambda: load_mmproj(_mmproj(tmp_path, extra_metadata={key: value})), *words)


def test_image_size_must_divide_into_patches(tmp_path):
    path = _mmproj(tmp_path, shape=VisionShape(image_size=60, patch_size=16, merge=1),
                   shape_overrides={"v.position_embd.weight": (64, 9)})
    _refused(lambda: load_mmproj(path), "not a multiple")


def test_a_text_model_is_not_an_mmproj(tmp_path):
    text = write_tiny_model(tmp_path / "text.gguf", "gemma3", "F32")
    _refused(lambda: load_mmproj(text), "not an mmproj")
    _refused(lambda: load_mmproj(tmp_path / "absent.gguf"), "no such file")
