"""The VRAM the vision encoder takes beside GPU text layers is left out of the text model's
offload plan (edgeinfer.vision.vram_estimate): the plan is made before the mmproj loads, and
without the reserve a card that just fits the text layers would have no room for the encoder."""
from __future__ import annotations

import pytest
from test_offload_plan import CONFIGS, card

import mmproj_factory
from edgeinfer.backends.offload import GiB, OffloadError, estimate_model_sizes, plan_offload, vram_budget
from edgeinfer.gguf_file import GGUFFile
from edgeinfer.vision import gemma4v, qwen3vl
from edgeinfer.vision.vram_estimate import LIVE_EMBD_ROWS, LIVE_FF_ROWS, PAD_MARGIN, encoder_vram_bytes


@pytest.mark.parametrize("gb,reserve_gib,layers,head", [
    (6, 0.85, 28, False),   # a Gemma-3-4B-sized encoder (0.8 GiB of F16 weights + activations): 4 layers go
    (8, 2.0, 32, False),    # the head goes first
    (12, 2.0, 32, True),    # room for all
])
def test_the_reserve_takes_layers_not_the_budget(gb, reserve_gib, layers, head):
    sizes = estimate_model_sizes(CONFIGS["8B"])
    reserve = int(reserve_gib * GiB)
    free = plan_offload(sizes, card(gb), 4096)
    kept = plan_offload(sizes, card(gb), 4096, reserve_bytes=reserve)
    assert (len(free.gpu_layers), free.output_on_gpu) == (32, gb > 6)
    assert (len(kept.gpu_layers), kept.output_on_gpu) == (layers, head)
    assert kept.vram_total + reserve <= vram_budget(card(gb))
    assert kept.vram_reserved == reserve and "kept for the vision encoder" in kept.describe()
    assert free.vram_reserved == 0 and "vision encoder" not in free.describe()


def test_an_explicit_layer_count_that_leaves_no_room_names_the_way_out():
    sizes = estimate_model_sizes(CONFIGS["8B"])
    fit = len(plan_offload(sizes, card(6), 4096).gpu_layers)
    with pytest.raises(OffloadError, match="kept for the vision encoder.*--no-mmproj-offload"):
        plan_offload(sizes, card(6), 4096, gpu_layers=fit, reserve_bytes=2 * GiB)
    with pytest.raises(OffloadError, match="must not be negative"):
        plan_offload(sizes, card(8), 4096, reserve_bytes=-1)


def test_a_reserve_larger_than_the_card_keeps_every_layer_on_the_cpu():
    plan = plan_offload(estimate_model_sizes(CONFIGS["1B"]), card(4), 4096, reserve_bytes=8 * GiB)
    assert not plan.on_gpu and "kept for the vision encoder" in plan.reason


def _by_hand(path, patches: int) -> int:
    gf = GGUFFile.open(path)
    md = gf.metadata
    n_embd, n_ff = md["clip.vision.embedding_length"], md["clip.vision.feed_forward_length"]
    weights = sum(info.n_bytes for info in gf.tensors.values())
    rows = patches * (LIVE_FF_ROWS * n_ff + LIVE_EMBD_ROWS * n_embd) * 4 + 2 * patches * n_embd * 2
    return int(weights * (1 + PAD_MARGIN)) + rows


def test_the_estimate_counts_the_files_tensors_and_the_largest_images_rows(tmp_path):
    g3 = mmproj_factory.write_gemma3_mmproj(tmp_path / "g3.gguf", 64, "F16")
    md = GGUFFile.open(g3).metadata
    side = md["clip.vision.image_size"] // md["clip.vision.patch_size"]
    assert encoder_vram_bytes(g3) == _by_hand(g3, side * side)
    # the dynamic projectors: their token ceiling times the merge area
    qw = mmproj_factory.write_qwen3vl_mmproj(tmp_path / "qw.gguf", 64, "F16")
    assert encoder_vram_bytes(qw) == _by_hand(qw, qwen3vl.MAX_TOKENS * qwen3vl.MERGE ** 2)
    g4 = mmproj_factory.write_gemma4v_mmproj(tmp_path / "g4.gguf", 64, "F16")
    merge = GGUFFile.open(g4).metadata.get("clip.vision.projector.scale_factor", gemma4v.DEFAULT_MERGE)
    assert encoder_vram_bytes(g4) == _by_hand(g4, gemma4v.MAX_TOKENS * merge ** 2)
    # more weights, more reserve: Q8_0 matrices take about half of F16's
    assert encoder_vram_bytes(mmproj_factory.write_gemma3_mmproj(tmp_path / "q8.gguf", 64, "Q8_0")) \
        < encoder_vram_bytes(g3)


def test_a_file_that_is_no_mmproj_reserves_nothing(tmp_path):
    from gguf_factory import write_tiny_model

    bad = tmp_path / "junk.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 20)
    assert encoder_vram_bytes(bad) == 0
    assert encoder_vram_bytes(write_tiny_model(tmp_path / "text.gguf", "llama", "F32")) == 0
    assert encoder_vram_bytes(tmp_path / "missing.gguf") == 0


def test_load_keeps_the_encoders_vram_out_of_the_plan(tmp_path, cuda_emulator):
    import cuda_device
    from image_fixtures import write_gemma3

    import edgeinfer

    cuda_device.require()
    text = write_gemma3(tmp_path / "text.gguf", n_embd=64, n_layer=2)
    mmproj = mmproj_factory.write_gemma3_mmproj(tmp_path / "mmproj.gguf", 64, "F16")

    def plan(**kw):
        return edgeinfer.load(str(text), mmproj=str(mmproj), n_ctx=256, backend="cpu", **kw).engine.offload
    assert plan(gpu_layers=1).vram_reserved == encoder_vram_bytes(mmproj) > 0
    assert plan(gpu_layers=1, mmproj_offload=False).vram_reserved == 0   # the encoder stays on the CPU
    assert plan(gpu_layers=0).vram_reserved == 0


def test_an_upload_that_runs_out_of_vram_leaves_the_encoder_on_the_cpu(tmp_path, cuda_emulator, monkeypatch):
    """The reserve is an estimate and other programs take VRAM too: the load goes on with the
    encoder on the CPU, said in placement, and encodes as the CPU encoder does."""
    import cuda_device
    from image_fixtures import write_gemma3
    from edgeinfer.kernels_cuda.emulator.standin import driver   # the emulated device's pycuda

    import edgeinfer
    from edgeinfer.vision import gpu_encoder

    cuda_device.require()
    text = write_gemma3(tmp_path / "text.gguf", n_embd=64, n_layer=2)
    mmproj = mmproj_factory.write_gemma3_mmproj(tmp_path / "mmproj.gguf", 64, "F16")
    upload = gpu_encoder.GpuOps.load_linear
    calls = []

    def fails_on_the_third(self, lin):
        calls.append(lin)
        if len(calls) == 3:
            raise driver.MemoryError("cuMemAlloc failed: out of memory")
        upload(self, lin)
    monkeypatch.setattr(gpu_encoder.GpuOps, "load_linear", fails_on_the_third)
    model = edgeinfer.load(str(text), mmproj=str(mmproj), n_ctx=256, backend="cpu", gpu_layers=1)
    assert model.engine.backend.name == "hybrid" and len(calls) == 3
    assert model.images.projector.ops.where == "CPU"
    assert "vision encoder on the CPU (its upload ran out of VRAM)" in model.placement
    # another failure than VRAM's is not hidden
    calls.clear()
    monkeypatch.setattr(gpu_encoder.GpuOps, "load_linear", lambda self, lin: (_ for _ in ()).throw(RuntimeError("x")))
    with pytest.raises(RuntimeError):
        edgeinfer.load(str(text), mmproj=str(mmproj), n_ctx=256, backend="cpu", gpu_layers=1)
