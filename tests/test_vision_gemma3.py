"""Gemma 3's vision projector against libmtmd (llama.cpp's tools/mtmd, through llama_cpp's ctypes).

Both sides get the same RGB pixels (decoded once with Pillow) and the same tiny random files (a
gemma3 text model for libmtmd's context, and its mmproj); the projected embeddings must agree
within 1e-3 of the largest |value| (max |ours - libmtmd| / max |libmtmd|). Measured (worst of
the three images; Q8_0 over 12 pictures): F32 weights 1.7e-6, Q8_0 3.5e-7, F16 1.8e-4. What is left comes from F16
roundings (GELU's table, an F16 matrix's input): a last-bit difference in summation order flips
one of them now and then. F32 files are held to 1e-4. libmtmd runs with flash attention off: its CPU
flash attention rounds Q, K and V to F16, which ours (full float32 attention) does not.
"""
from __future__ import annotations

import io

import numpy as np
import pytest

from gguf_factory import TinyShape, write_tiny_model
from mmproj_factory import VisionShape, write_gemma3_mmproj
import mtmd_oracle

from edgeinfer.vision import image_ops
from edgeinfer.vision.image_io import decode_image, from_pixels
from edgeinfer.vision.mmproj import load_mmproj

TEXT_SHAPE = TinyShape(n_embd=128, n_head=2, n_head_kv=1, head_dim=64, n_ff=256)  # != the ViT's 64
TOLERANCE = 1e-3
F32_TOLERANCE = 1e-4   # no F16 rounding in the way: a tighter bound catches small slips


def _png(pixels: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def _picture(width: int, height: int, seed: int) -> np.ndarray:
    """Smooth gradients plus noise, through a PNG and back (what a user's file gives)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 // max(width - 1, 1), y * 255 // max(height - 1, 1), (x + y) % 256], -1)
    pixels = np.clip(base + rng.integers(-40, 40, base.shape), 0, 255).astype(np.uint8)
    return decode_image(_png(pixels)).pixels


@pytest.fixture(scope="module")
def text_model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("vision") / "text.gguf", "gemma3", "F32", shape=TEXT_SHAPE)


def _relative_error(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(got - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("qtype,patch_qtype", [("F32", "F32"), ("F16", "F16"), ("Q8_0", "F16")])
def test_projected_embeddings_match_libmtmd(tmp_path, text_model, qtype, patch_qtype):
    mmproj = write_gemma3_mmproj(tmp_path / "mmproj.gguf", TEXT_SHAPE.n_embd, qtype, patch_qtype=patch_qtype)
    if not mtmd_oracle.available():
        pytest.skip(mtmd_oracle.REASON)
    oracle = mtmd_oracle.Mtmd(text_model, mmproj)
    try:
        projector = load_mmproj(mmproj)
        # the image size itself (no resize), a wide one (downscale + pad), a tall small one (upscale + pad)
        for w, h, seed in ((64, 64, 1), (100, 60, 2), (23, 41, 3)):
            pixels = _picture(w, h, seed)
            ref = oracle.encode(pixels)
            chunk = projector.encode(from_pixels(pixels))
            assert chunk.embeddings.shape == ref.shape == (4, TEXT_SHAPE.n_embd)
            err = _relative_error(chunk.embeddings, ref)
            assert err < (F32_TOLERANCE if qtype == "F32" else TOLERANCE), (qtype, w, h, err)
    finally:
        oracle.close()


def test_two_images_give_different_embeddings_and_digests(tmp_path):
    mmproj = write_gemma3_mmproj(tmp_path / "mmproj.gguf", TEXT_SHAPE.n_embd, "Q8_0")
    projector = load_mmproj(mmproj)
    a = projector.encode(decode_image(_png(_picture(64, 64, 5))))
    b = projector.encode(decode_image(_png(_picture(64, 64, 6))))
    assert a.digest != b.digest
    assert np.abs(a.embeddings - b.embeddings).max() > 1e-2
    again = projector.encode(_picture(64, 64, 5))
    assert again.digest == a.digest and np.array_equal(again.embeddings, a.embeddings)


def test_swapped_ffn_names_of_old_conversions_are_read_as_libmtmd_reads_them(tmp_path):
    pixels = _picture(40, 64, 9)
    plain = load_mmproj(write_gemma3_mmproj(tmp_path / "a.gguf", 64, "F32")).encode(pixels)
    swapped = load_mmproj(write_gemma3_mmproj(tmp_path / "b.gguf", 64, "F32", swap_ffn=True)).encode(pixels)
    assert np.array_equal(plain.embeddings, swapped.embeddings)


def test_chunk_carries_what_the_text_side_needs(tmp_path):
    shape = VisionShape(image_size=64, patch_size=8, merge=4)  # 8 x 8 patches -> 2 x 2 tokens
    projector = load_mmproj(write_gemma3_mmproj(tmp_path / "m.gguf", 96, "F32", shape=shape))
    assert (projector.projector_type, projector.n_embd) == ("gemma3", 96)
    chunk = projector.encode(_picture(30, 50, 7))
    assert chunk.n_tokens == 4 and chunk.embeddings.shape == (4, 96)
    assert chunk.embeddings.dtype == np.float32 and np.all(np.isfinite(chunk.embeddings))
    assert chunk.non_causal and chunk.grid is None


def test_merge_defaults_to_gemma3s_four(tmp_path):
    shape = VisionShape(image_size=64, patch_size=8)
    path = write_gemma3_mmproj(tmp_path / "m.gguf", 64, "F32", shape=shape,
                               extra_metadata={"clip.vision.projector.scale_factor": None})
    assert load_mmproj(path).encode(_picture(64, 64, 8)).n_tokens == 4


def test_fit_and_pad_centres_the_scaled_image_on_black():
    pixels = np.full((20, 40, 3), 200, np.uint8)   # 2:1 -> 64 x 32 band in the middle
    out = image_ops.fit_and_pad(pixels, 64, 64)
    assert out.shape == (64, 64, 3)
    assert np.all(out[:16] == 0) and np.all(out[48:] == 0) and np.all(out[16:48] == 200)
    odd = image_ops.fit_and_pad(np.full((3, 7, 3), 9, np.uint8), 64, 64)
    rows = np.flatnonzero(odd[:, 0, 0])   # 7 -> 64 wide, 3 * 64/7 = 27.4 -> 28 rows, offset 18
    assert (rows[0], len(rows)) == (18, 28)


@pytest.mark.parametrize("kind", ["bilinear", "bicubic"])
@pytest.mark.parametrize("src,dst", [((100, 60), (64, 38)), ((37, 90), (27, 64)), ((10, 10), (64, 64)),
                                     ((640, 480), (96, 72)), ((5, 300), (1, 64)),
                                     ((4000, 300), (64, 5)), ((3, 20000), (90, 600))])  # resampled in slices
def test_resize_is_pillows_resampler_horizontal_pass_first(kind, src, dst):
    """libmtmd's resampler is Pillow's, always horizontal then vertical (Pillow itself may
    take the vertical pass first): each pass alone must equal Pillow's bit for bit."""
    from PIL import Image

    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (src[1], src[0], 3), dtype=np.uint8)
    flt = {"bilinear": Image.BILINEAR, "bicubic": Image.BICUBIC}[kind]
    wide = Image.fromarray(pixels).resize((dst[0], src[1]), flt)
    want = np.asarray(wide.resize(dst, flt))
    assert np.array_equal(image_ops.resize(pixels, dst[0], dst[1], kind), want)


def test_normalize_is_float32_like_libmtmd():
    px = np.array([[[0, 128, 255]]], np.uint8)
    out = image_ops.normalize(px, np.array([0.5, 0.5, 0.5]), np.array([0.5, 0.5, 0.5]))
    want = (np.float32([0, 128, 255]) / np.float32(255) - np.float32(0.5)) / np.float32(0.5)
    assert out.dtype == np.float32 and np.array_equal(out[0, 0], want)
