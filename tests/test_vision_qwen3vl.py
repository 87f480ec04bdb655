"""The qwen3vl projector (Qwen3-VL, Qwen3.5 vision) against libmtmd's own encoder.

The same RGB pixels go to libmtmd (mtmd_bitmap_init, mtmd_tokenize around the default marker,
mtmd_encode_chunk, mtmd_get_output_embd) and to edgeinfer's Qwen3VLProjector; tiny random
mmproj files (tests/mmproj_factory.py) paired with a tiny qwen35 text model of the width the
projector emits, which is all mtmd_init_from_file checks. Image sizes cover the smart resize's
branches: sides rounded half away from zero, a square grid that resizes the position table,
a large image scaled down into max pixels, a small one scaled up to min pixels.

Measured (x86-64 AVX2, 2 threads, three seeds): max |edgeinfer - libmtmd| / max |libmtmd| =
1.1e-4 with F32 matrices and deepstack, 4.0e-4 with F16 matrices: both sides round the patch
convolution's pixels and kernels, F16 matrices' inputs and GELU to F16 alike (ggml's im2col is
F16, its GELU a table), so what is left are single F16 roundings that fall the other way after
float32 sums in another order. Q8_0: 0 on every image, where every float op before an 8-bit
rounding gives ggml's bits: the patch embedding (vision.patch_conv), the rotary and the
position-table resize (vision.position_ops); before them, 2.3e-3 and 5.9e-3 (an 8-bit
activation rounding that falls the other way moves a sum by a 127th of its block's scale).
Against libmtmd's default flash attention (K and V in F16) instead of
its float32 attention: up to 7.2e-4.
"""
from __future__ import annotations

import ctypes

import mtmd_oracle
import numpy as np
import pytest
from gguf_factory import TinyShape, write_tiny_model
from mmproj_factory import write_qwen3vl_mmproj

from edgeinfer.vision import qwen3vl
from edgeinfer.vision.image_io import ImageError
from edgeinfer.vision.mmproj import MmprojError, load_mmproj
from edgeinfer.vision.qwen_resize import smart_size

# (height, width, min tokens, max tokens): 0 keeps libmtmd's 8 / 4096
IMAGES = {
    "half-rounded": (20, 36, 0, 0),     # 36/8 = 4.5 -> 40 wide (C's round), 20 -> 24: 3 x 5 tokens
    "square-resized-positions": (48, 48, 0, 0),   # 12 x 12 patches from an 8 x 8 table
    "scaled-down": (200, 120, 0, 20),   # 15 tokens <= 20: floor after sqrt
    "scaled-up": (10, 14, 0, 0),        # under 8 tokens: ceil after sqrt
}
# (matrix type, deepstack layers, the merger's width: the text model takes it x (1 + deepstack))
VARIANTS = {
    "qwen3vl-f32-deepstack": ("F32", (1,), 128),
    "qwen35-f16": ("F16", (), 256),
    "q8_0-deepstack": ("Q8_0", (0, 2), 128),
}
# the bound on max |ours - libmtmd| / max |libmtmd| per matrix type (measured: see the top)
TOLERANCE = {"F32": 1e-3, "F16": 1e-3, "Q8_0": 1e-3}


def _mtmd():
    """llama-cpp-python's libmtmd bindings, or a one-line skip. (mtmd_oracle.Mtmd has no image
    token limits nor the token grid, which these tests set and compare: hence a driver here.)"""
    if not mtmd_oracle.available():
        pytest.skip(mtmd_oracle.REASON)
    import llama_cpp
    from llama_cpp import mtmd_cpp
    return llama_cpp, mtmd_cpp


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Per variant: (mmproj path, text model path)."""
    d = tmp_path_factory.mktemp("qwen3vl")
    out = {}
    texts = {}
    for name, (qtype, deep, width) in VARIANTS.items():
        n_text = width * (1 + len(deep))
        if n_text not in texts:
            texts[n_text] = write_tiny_model(d / f"text{n_text}.gguf", "qwen35", shape=TinyShape(n_embd=n_text))
        mm = write_qwen3vl_mmproj(d / f"{name}.gguf", width, qtype, deepstack=deep, seed=len(out),
                                  patch_qtype="F16" if qtype == "F16" else "F32")   # both kinds converters write
        out[name] = (mm, texts[n_text])
    return out


def libmtmd_encode(mmproj, text_model, rgb: np.ndarray, min_tokens: int = 0, max_tokens: int = 0):
    """libmtmd's embeddings for the image, (n_tokens, n_embd), and its token grid (rows, cols)."""
    llama_cpp, mt = _mtmd()
    llama_cpp.llama_backend_init()
    model = llama_cpp.llama_model_load_from_file(str(text_model).encode(), llama_cpp.llama_model_default_params())
    assert model, "llama.cpp did not load the tiny text model"
    params = mt.mtmd_context_params_default()
    params.use_gpu, params.n_threads, params.print_timings, params.warmup = False, 2, False, False
    params.flash_attn_type = 0   # ggml's float32 attention, as ours
    params.image_min_tokens, params.image_max_tokens = min_tokens, max_tokens
    ctx = mt.mtmd_init_from_file(str(mmproj).encode(), model, params)
    bitmap = chunks = None
    try:
        assert ctx, "libmtmd refused the mmproj / text model pair"
        h, w, _ = rgb.shape
        pixels = np.ascontiguousarray(rgb, np.uint8)
        bitmap = mt.mtmd_bitmap_init(w, h, pixels.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)))
        chunks = mt.mtmd_input_chunks_init()
        marker = mt.mtmd_default_marker()
        text = mt.mtmd_input_text(text=marker, text_len=len(marker), add_special=False, parse_special=True)
        assert mt.mtmd_tokenize(ctx, chunks, ctypes.byref(text), (mt.mtmd_bitmap_p_ctypes * 1)(bitmap), 1) == 0
        images = [mt.mtmd_input_chunks_get(chunks, i) for i in range(mt.mtmd_input_chunks_size(chunks))]
        images = [c for c in images if mt.mtmd_input_chunk_get_type(c) == mt.MTMD_INPUT_CHUNK_TYPE_IMAGE]
        assert len(images) == 1
        chunk = images[0]
        n = mt.mtmd_input_chunk_get_n_tokens(chunk)
        tokens = mt.mtmd_input_chunk_get_tokens_image(chunk)
        grid = (mt.mtmd_image_tokens_get_ny(tokens), mt.mtmd_image_tokens_get_nx(tokens))
        assert mt.mtmd_encode_chunk(ctx, chunk) == 0
        n_embd = llama_cpp.llama_model_n_embd_inp(model)
        out = np.ctypeslib.as_array(mt.mtmd_get_output_embd(ctx), shape=(n * n_embd,))
        return out.reshape(n, n_embd).copy(), grid
    finally:
        if chunks:
            mt.mtmd_input_chunks_free(chunks)
        if bitmap:
            mt.mtmd_bitmap_free(bitmap)
        if ctx:
            mt.mtmd_free(ctx)
        llama_cpp.llama_model_free(model)


def _image(h: int, w: int, seed: int) -> np.ndarray:
    """Smooth gradients plus noise: resampling has structure to keep, not only noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([x * 255 / max(w - 1, 1), y * 255 / max(h - 1, 1), (x + y) * 127 / max(h + w - 2, 1)], -1)
    return np.clip(base + rng.normal(0, 30, (h, w, 3)), 0, 255).astype(np.uint8)


def _projector(path, min_tokens=0, max_tokens=0):
    proj = load_mmproj(path)
    assert isinstance(proj, qwen3vl.Qwen3VLProjector)
    proj.set_token_limits(min_tokens, max_tokens)
    return proj


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("image", IMAGES)
def test_embeddings_match_libmtmd(files, variant, image):
    _mtmd()
    mmproj, text = files[variant]
    h, w, lo, hi = IMAGES[image]
    rgb = _image(h, w, seed=h * w)
    want, want_grid = libmtmd_encode(mmproj, text, rgb, lo, hi)
    chunk = _projector(mmproj, lo, hi).encode(rgb)
    assert chunk.grid == want_grid
    assert chunk.n_tokens == want.shape[0] == want_grid[0] * want_grid[1]
    assert chunk.embeddings.shape == want.shape
    err = np.abs(chunk.embeddings - want).max() / np.abs(want).max()
    assert err < TOLERANCE[VARIANTS[variant][0]], f"max relative error {err:.2e}"


def test_width_is_merger_times_deepstack(files):
    """Deepstack outputs are appended along the width: 128 x (1 + 2) for two deepstack layers."""
    proj = _projector(files["q8_0-deepstack"][0])
    assert proj.n_embd == 384 and sorted(proj.deepstack) == [0, 2]
    assert _projector(files["qwen35-f16"][0]).n_embd == 256


def test_different_images_differ(files):
    proj = _projector(files["qwen3vl-f32-deepstack"][0])
    a, b = _image(24, 40, 1), _image(24, 40, 2)
    ea, eb, ea2 = proj.encode(a), proj.encode(b), proj.encode(a)
    assert ea.grid == eb.grid == (3, 5)
    assert ea.digest != eb.digest
    np.testing.assert_array_equal(ea.embeddings, ea2.embeddings)
    assert np.abs(ea.embeddings - eb.embeddings).max() > 0.1 * np.abs(ea.embeddings).max()


def test_changing_one_tokens_pixels_changes_that_token_most(files):
    """Changing one merged token's pixels changes that token most: the merger reads its own
    2x2 patches (the token order is the 2x2 block order, not row-major patches)."""
    proj = _projector(files["qwen35-f16"][0])
    rgb = _image(24, 40, 3)
    other = rgb.copy()
    other[8:16, 16:24] = 255 - other[8:16, 16:24]   # merged token (1, 2) of 3 x 5
    d = np.abs(proj.encode(rgb).embeddings - proj.encode(other).embeddings).max(axis=1)
    assert int(np.argmax(d)) == 1 * 5 + 2


@pytest.mark.parametrize("size,want", [
    ((36, 20, 8, 512, 4096 * 64), (40, 24)),     # 4.5 rounds up (C's round), 2.5 -> 3
    ((44, 20, 8, 512, 4096 * 64), (48, 24)),     # 5.5 -> 6: not numpy's round half to even
    ((200, 120, 8, 512, 20 * 64), (40, 24)),     # beta = sqrt(24000 / 1280): floor(200 / beta)
    ((14, 10, 8, 512, 4096 * 64), (32, 24)),     # ceil(14 * sqrt(512 / 140)) = 27 -> 32
    ((3, 1, 8, 0, 0), (8, 8)),                   # never below one grid cell
])
def test_smart_size(size, want):
    assert smart_size(*size) == want


@pytest.mark.parametrize("edit,problem", [
    ({"omit_tensors": ("v.deepstack.1.fc2.bias",)}, "deepstack layer 1 lacks"),
    ({"omit_tensors": ("v.patch_embd.weight.1",)}, "v.patch_embd.weight.1"),
    ({"omit_tensors": ("v.blk.0.attn_qkv.bias",)}, "attn_qkv.bias"),
    ({"extra_metadata": {"clip.vision.spatial_merge_size": 3}}, "merges 2x2"),
    ({"extra_metadata": {"clip.vision.projection_dim": 64}}, "projection_dim"),
    ({"shape_overrides": {"v.position_embd.weight": (32, 60)}}, "square grid"),
    ({"shape_overrides": {"mm.0.weight": (96, 128)}}, "mm.0.weight"),
])
def test_hostile_files_fail_in_one_line(tmp_path, edit, problem):
    path = write_qwen3vl_mmproj(tmp_path / "bad.gguf", 128, "F32", deepstack=(1,), **edit)
    with pytest.raises(MmprojError) as err:
        load_mmproj(path)
    assert problem in str(err.value) and "\n" not in str(err.value)


def test_pixels_off_the_grid_are_refused(files):
    proj = _projector(files["qwen35-f16"][0])
    with pytest.raises(ValueError, match="grid"):
        proj.encode_pixels(np.zeros((12, 16, 3), np.float32))


def test_attention_in_query_slices_is_the_same(files, monkeypatch):
    """Each query row's softmax is its own: slices change only BLAS's summation order."""
    proj = _projector(files["qwen3vl-f32-deepstack"][0])
    rgb = _image(48, 48, 4)
    whole = proj.encode(rgb).embeddings
    monkeypatch.setattr(qwen3vl, "QUERY_ROWS", 7)   # 144 patches in 21 slices, the last short
    np.testing.assert_allclose(proj.encode(rgb).embeddings, whole, rtol=1e-4, atol=1e-4 * np.abs(whole).max())


def test_a_resize_beyond_the_pixel_budget_is_refused(files):
    proj = _projector(files["qwen35-f16"][0], min_tokens=1_000_000, max_tokens=2_000_000)
    with pytest.raises(ImageError, match="megapixels"):
        proj.encode(_image(24, 40, 5))
