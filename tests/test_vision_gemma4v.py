"""Gemma 4's vision projector (gemma4v) against libmtmd (llama.cpp's tools/mtmd, through llama_cpp's ctypes).

Both sides get the same RGB pixels and the same tiny random files: a Gemma 4 text model (what
mtmd_init_from_file checks the projector's width against) and a gemma4v mmproj with every
tensor kind the converter writes (per-head Q/K norms, post norms, gated MLP, out scales,
x/y position tables, std bias/scale, clamp bounds that do clip). The images take the dynamic
resize's branches: a square one scaled up to the 70-token minimum, a wide one rounded to the
8-pixel grid (bicubic + pad). Error = max |ours - libmtmd| / max |libmtmd|, measured (x86-64
AVX2, 2 threads, three seeds, these images and a 96x40 one): F32 matrices 1.7e-6 .. 5.0e-5,
F16 1.6e-4 .. 2.8e-4 (F16 roundings of a matrix's input or GELU's table falling the other way
after sums in another order). Q8_0: 0, bit for bit, on these images and on 12 random 150x90
pictures (AVX-512 Xeon). Both sides quantize the activations to 8 bits, so every float op
before such a rounding must give ggml's bits, or one activation moves a whole quantum
(1.9e-3 .. 4.4e-3 on half of those pictures before): the rotary and the patch embedding
(vision.position_ops, vision.patch_conv), the RMS norms (kernels_cpu.ops.rms_norm), the Q8_0
matrices in vec_dot's order, and, because the file has 8-bit matrices, its F16 matrices by
tinyBLAS or vec_dot_f16 and the attention by kernels_cpu.attention_f32_ggml.
libmtmd runs with flash attention off (its CPU flash attention rounds Q, K and V to F16).
"""
from __future__ import annotations

import mtmd_oracle
import numpy as np
import pytest
from gguf_factory import gemma4_file
from mmproj_factory import Gemma4VisionShape, write_gemma4v_mmproj

from edgeinfer.vision.mmproj import MmprojError, load_mmproj

N_TEXT = 256    # gemma4_file's width
IMAGES = ((64, 64, 1), (150, 90, 2))   # -> 72x72 (9x9 tokens), 152x88 (19x11 tokens)
TOLERANCE = {"F32": 1e-4, "F16": 1e-3, "Q8_0": 1e-3}
SEEDS_Q8_0 = (2, 4, 6, 7, 8)   # 150x90 pictures whose Q8_0 embeddings were 2.4e-3 .. 4.4e-3 off in BLAS's order


@pytest.fixture(scope="module")
def text_model(tmp_path_factory):
    return gemma4_file(tmp_path_factory.mktemp("gemma4v"), "F32")


def _picture(width: int, height: int, seed: int) -> np.ndarray:
    """RGB gradients plus noise: enough structure that images differ everywhere."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 // max(width - 1, 1), y * 255 // max(height - 1, 1), (3 * x + y) % 256], -1)
    return np.clip(base + rng.integers(-40, 40, base.shape), 0, 255).astype(np.uint8)


def _relative_error(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(got - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("qtype,patch_qtype", [("F32", "F32"), ("F16", "F16"), ("Q8_0", "F16")])
def test_projected_embeddings_match_libmtmd(tmp_path, text_model, qtype, patch_qtype):
    if not mtmd_oracle.available():
        pytest.skip(mtmd_oracle.REASON)
    mmproj = write_gemma4v_mmproj(tmp_path / "mmproj.gguf", N_TEXT, qtype, patch_qtype=patch_qtype)
    oracle = mtmd_oracle.Mtmd(text_model, mmproj)
    try:
        projector = load_mmproj(mmproj)
        for (w, h, seed), tokens in zip(IMAGES, (81, 209)):
            pixels = _picture(w, h, seed)
            ref = oracle.encode(pixels)
            chunk = projector.encode(pixels)
            assert chunk.embeddings.shape == ref.shape == (tokens, N_TEXT)
            err = _relative_error(chunk.embeddings, ref)
            assert err < TOLERANCE[qtype], (qtype, w, h, err)
    finally:
        oracle.close()


def test_q8_0_embeddings_are_libmtmd_s_bits_where_blas_order_flipped_a_quantum(tmp_path, text_model):
    if not mtmd_oracle.available():
        pytest.skip(mtmd_oracle.REASON)
    mmproj = write_gemma4v_mmproj(tmp_path / "mmproj.gguf", N_TEXT, "Q8_0", patch_qtype="F16")
    oracle = mtmd_oracle.Mtmd(text_model, mmproj)
    try:
        projector = load_mmproj(mmproj)
        assert projector.tower.ops.float_order.ggml_for(1881)   # 8-bit matrices: ggml's order
        f16 = load_mmproj(write_gemma4v_mmproj(tmp_path / "f16.gguf", N_TEXT, "F16", patch_qtype="F16"))
        assert not f16.tower.ops.float_order.ggml_for(1881)    # no 8-bit rounding to amplify a last bit
        for seed in SEEDS_Q8_0:
            pixels = _picture(150, 90, seed)
            got, ref = projector.encode(pixels).embeddings, oracle.encode(pixels)
            assert _relative_error(got, ref) < 1e-6, seed   # measured 0 (bit for bit) on each
    finally:
        oracle.close()


def test_a_large_image_scaled_down_into_1120_tokens_matches_libmtmd(tmp_path, text_model):
    """calc_size_preserved_ratio's other branch: over max pixels, sides floored after the sqrt."""
    if not mtmd_oracle.available():
        pytest.skip(mtmd_oracle.REASON)
    mmproj = write_gemma4v_mmproj(tmp_path / "m.gguf", N_TEXT, "F32", shape=Gemma4VisionShape(n_pos=96))
    oracle = mtmd_oracle.Mtmd(text_model, mmproj)
    try:
        projector = load_mmproj(mmproj)
        pixels = _picture(300, 260, 3)
        assert projector.target_size(300, 260) == (280, 248)   # 296 x 256 would be 1184 tokens
        ref, got = oracle.encode(pixels), projector.encode(pixels).embeddings
        assert got.shape == ref.shape == (35 * 31, N_TEXT)
        assert _relative_error(got, ref) < TOLERANCE["F32"]   # measured 1.8e-5
    finally:
        oracle.close()


def test_two_images_differ_and_one_image_repeats(tmp_path):
    projector = load_mmproj(write_gemma4v_mmproj(tmp_path / "m.gguf", N_TEXT, "F32"))
    a, b = projector.encode(_picture(64, 64, 5)), projector.encode(_picture(64, 64, 6))
    assert a.digest != b.digest and np.abs(a.embeddings - b.embeddings).max() > 1e-2
    again = projector.encode(_picture(64, 64, 5))
    assert again.digest == a.digest and np.array_equal(again.embeddings, a.embeddings)


def test_sizes_tokens_and_attention_kind(tmp_path):
    projector = load_mmproj(write_gemma4v_mmproj(tmp_path / "m.gguf", N_TEXT, "F32"))
    assert (projector.projector_type, projector.n_embd, projector.merge) == ("gemma4v", N_TEXT, 2)
    assert projector.target_size(64, 64) == (72, 72)        # 64 tokens < 70: scaled up
    assert projector.target_size(150, 90) == (152, 88)      # sides rounded to 8
    assert projector.target_size(1000, 1000) == (264, 264)  # 1120 tokens at most: 33 x 33
    chunk = projector.encode(_picture(96, 40, 3))           # -> 104 x 48: 13 x 6 tokens
    assert chunk.n_tokens == 78 and chunk.non_causal and chunk.grid is None
    # E2B and E4B (text widths 1536, 2560) keep image tokens causal, as mtmd_decode_use_non_causal
    e2b = load_mmproj(write_gemma4v_mmproj(tmp_path / "e2b.gguf", 1536, "F32"))
    assert not e2b.non_causal and not e2b.encode(_picture(64, 64, 4)).non_causal


def test_merge_defaults_to_three_and_limits_follow_it(tmp_path):
    path = write_gemma4v_mmproj(tmp_path / "m.gguf", N_TEXT, "F32", shape=Gemma4VisionShape(patch_size=2),
                                extra_metadata={"clip.vision.projector.scale_factor": None})
    projector = load_mmproj(path)
    assert projector.merge == 3 and projector.target_size(60, 60) == (60, 60)   # 10 x 10 tokens of 6 px
    assert projector.encode(_picture(60, 60, 1)).n_tokens == 100


def test_clamp_bounds_change_the_output(tmp_path):
    pixels = _picture(64, 64, 7)
    clamped = load_mmproj(write_gemma4v_mmproj(tmp_path / "a.gguf", N_TEXT, "F32")).encode(pixels)
    omit = ("v.blk.0.attn_q.input_min", "v.blk.0.attn_q.input_max", "mm.input_projection.input_min",
            "mm.input_projection.input_max", "v.blk.1.ffn_down.output_min", "v.blk.1.ffn_down.output_max")
    free = load_mmproj(write_gemma4v_mmproj(tmp_path / "b.gguf", N_TEXT, "F32", omit_tensors=omit)).encode(pixels)
    assert np.abs(clamped.embeddings - free.embeddings).max() > 1e-3


@pytest.mark.parametrize("kwargs,problem", [
    ({"shape_overrides": {"v.position_embd.weight": (32, 64)}}, "v.position_embd.weight"),
    ({"shape_overrides": {"v.blk.0.attn_q_norm.weight": (8,)}}, "attn_q_norm"),
    ({"omit_tensors": ("mm.input_projection.weight",)}, "mm.input_projection.weight"),
    ({"extra_metadata": {"clip.vision.projection_dim": 128}}, "projection_dim"),
    ({"shape_overrides": {"v.blk.0.attn_q.input_max": (2,)}}, "input_max"),
    ({"shape_overrides": {"v.blk.1.out_scale.weight": (3,)}}, "out_scale"),
])
def test_hostile_files_fail_in_one_line(tmp_path, kwargs, problem):
    path = write_gemma4v_mmproj(tmp_path / "bad.gguf", N_TEXT, "F32", **kwargs)
    with pytest.raises(MmprojError, match=problem) as info:
        load_mmproj(path)
    assert "\n" not in str(info.value)


def test_a_grid_beyond_the_position_tables_is_refused(tmp_path):
    projector = load_mmproj(write_gemma4v_mmproj(tmp_path / "m.gguf", N_TEXT, "F32",
                                                 shape=Gemma4VisionShape(n_pos=16)))
    with pytest.raises(ValueError, match="16 learned positions"):
        projector.encode(_picture(64, 64, 1))   # resized to 72 x 72: 18 patches a side


def test_attention_in_query_slices_is_the_same(tmp_path, monkeypatch):
    from edgeinfer.vision import gemma4v_encoder

    projector = load_mmproj(write_gemma4v_mmproj(tmp_path / "m.gguf", N_TEXT, "F32"))
    pixels = _picture(150, 90, 8)                  # 836 patches: one slice by default
    whole = projector.encode(pixels).embeddings
    monkeypatch.setattr(gemma4v_encoder, "QUERY_ROWS", 100)
    sliced = projector.encode(pixels).embeddings
    # BLAS picks its kernel by the slice's height, so a score may differ in its last bits
    # (~2e-5 seen through 8 layers); a slice that lost or repeated rows is off by O(1)
    assert np.abs(sliced - whole).max() <= 1e-4 * np.abs(whole).max()
