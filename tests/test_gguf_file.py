"""GGUF loading: zero-copy tensors, parsed metadata, and one clear error per broken file."""

from __future__ import annotations

import struct
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import quants

from edgeinfer.cli import main
from edgeinfer.errors import GGUFError, UnsupportedModelError
from edgeinfer.gguf_file import GGUFFile
from edgeinfer.loader import open_model
from gguf_factory import write_tiny_model


def test_metadata_and_zero_copy_tensors(tmp_path):
    path = write_tiny_model(tmp_path / "m.gguf", "llama", "Q8_0")
    gf = GGUFFile.open(path)
    assert gf.version == 3
    assert gf.architecture == "llama"
    assert gf.metadata["llama.block_count"] == 2
    assert isinstance(gf.metadata["tokenizer.ggml.tokens"], list)
    raw = gf.raw("blk.0.attn_q.weight")
    assert raw.dtype == np.uint8 and not raw.flags.writeable
    assert raw.base is not None  # a view into the mapping, not a copy
    info = gf.tensors["blk.0.attn_q.weight"]
    assert raw.shape == (info.n_rows, info.row_bytes) == (256, 256 // 32 * 34)


def test_k_quant_blocks_are_valid(tmp_path):
    path = write_tiny_model(tmp_path / "m.gguf", "llama", "Q4_K", seed=3)
    gf = GGUFFile.open(path)
    values = quants.dequantize(gf.raw("blk.1.ffn_down.weight"), T.Q4_K)
    assert values.shape == (256, 512) and np.isfinite(values).all()
    assert 0.02 < values.std() < 0.2  # the factory targets std 0.08


def test_open_real_gemma_is_fast_and_complete(gemma_path):
    import time

    GGUFFile.open(gemma_path)  # warm the OS cache
    t0 = time.perf_counter()
    mf = open_model(gemma_path)
    elapsed = time.perf_counter() - t0
    assert mf.config.arch == "gemma3" and mf.config.n_layer == 18
    assert mf.config.sliding_window == 512 and mf.config.swa_layers[5] is False
    assert len(mf.gguf.metadata["tokenizer.ggml.tokens"]) == 262144
    # Generous bound for a loaded CI machine; the benchmark figure is ~0.2 s.
    assert elapsed < 3.0


def _expect(exc_type, path, *fragments):
    with pytest.raises(exc_type) as info:
        open_model(path)
    message = str(info.value)
    assert "\n" not in message and str(path) in message
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_random_bytes(tmp_path):
    path = tmp_path / "random.gguf"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    _expect(GGUFError, path, "not a GGUF file")


def test_wrong_magic(tmp_path):
    good = write_tiny_model(tmp_path / "m.gguf")
    data = bytearray(good.read_bytes())
    data[:4] = b"GGML"
    path = tmp_path / "magic.gguf"
    path.write_bytes(bytes(data))
    _expect(GGUFError, path, "magic")


def test_empty_and_tiny_files(tmp_path):
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    _expect(GGUFError, path, "not a GGUF file")
    path.write_bytes(b"GGUF")
    _expect(GGUFError, path, "truncated")


def test_unsupported_version(tmp_path):
    good = write_tiny_model(tmp_path / "m.gguf")
    data = bytearray(good.read_bytes())
    data[4:8] = struct.pack("<I", 1)
    path = tmp_path / "v1.gguf"
    path.write_bytes(bytes(data))
    _expect(GGUFError, path, "version 1")


@pytest.mark.parametrize("keep", [0.05, 0.5, 0.999])
def test_truncated(tmp_path, keep):
    good = write_tiny_model(tmp_path / "m.gguf")
    data = good.read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[: int(len(data) * keep)])
    _expect(GGUFError, path, "truncated")


def test_unknown_architecture(tmp_path):
    path = write_tiny_model(tmp_path / "m.gguf")
    data = path.read_bytes().replace(b"general.architecture\x08\x00\x00\x00\x05\x00\x00\x00\x00\x00\x00\x00llama",
                                     b"general.architecture\x08\x00\x00\x00\x05\x00\x00\x00\x00\x00\x00\x00mamba")
    assert b"mamba" in data
    bad = tmp_path / "mamba.gguf"
    bad.write_bytes(data)
    _expect(UnsupportedModelError, bad, "architecture 'mamba' is not supported")


def test_unsupported_quant_type(tmp_path):
    path = write_tiny_model(tmp_path / "m.gguf", "llama", "Q8_0")
    gf = GGUFFile.open(path)
    info = gf.tensors["blk.0.ffn_up.weight"]
    data = bytearray(path.read_bytes())
    # Rewrite the tensor's type id in the header: Q8_0 (8) -> TQ2_0 (35), same name length.
    needle = b"blk.0.ffn_up.weight" + struct.pack("<I", 2) + struct.pack("<QQ", *info.shape)
    at = data.index(needle) + len(needle)
    assert struct.unpack_from("<I", data, at)[0] == int(T.Q8_0)
    struct.pack_into("<I", data, at, int(T.TQ2_0))
    bad = tmp_path / "tq2.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises((UnsupportedModelError, GGUFError)) as err:
        open_model(bad)
    assert "TQ2_0" in str(err.value) or "truncated" in str(err.value) or "row length" in str(err.value)


def test_unknown_type_id(tmp_path):
    path = write_tiny_model(tmp_path / "m.gguf", "llama", "Q8_0")
    info = GGUFFile.open(path).tensors["blk.0.ffn_up.weight"]
    data = bytearray(path.read_bytes())
    needle = b"blk.0.ffn_up.weight" + struct.pack("<I", 2) + struct.pack("<QQ", *info.shape)
    at = data.index(needle) + len(needle)
    struct.pack_into("<I", data, at, 999)
    bad = tmp_path / "t999.gguf"
    bad.write_bytes(bytes(data))
    _expect(GGUFError, bad, "unknown type id 999")


def test_missing_required_tensor(tmp_path):
    path = write_tiny_model(tmp_path / "m.gguf", "qwen3", omit_tensors=("blk.1.attn_k_norm.weight",))
    _expect(GGUFError, path, "blk.1.attn_k_norm.weight", "missing")


def test_shape_inconsistent_with_metadata(tmp_path):
    path = write_tiny_model(tmp_path / "m.gguf", "llama", extra_metadata={})
    data = path.read_bytes().replace(b"llama.feed_forward_length\x04\x00\x00\x00\x00\x02\x00\x00",
                                     b"llama.feed_forward_length\x04\x00\x00\x00\x00\x04\x00\x00")
    bad = tmp_path / "shape.gguf"
    bad.write_bytes(data)
    _expect(GGUFError, bad, "shape")


def test_all_families_load(tiny_models):
    for arch, path in tiny_models.items():
        mf = open_model(path)
        assert mf.config.arch == arch
    assert open_model(tiny_models["gemma3"]).config.sliding_window == 16


def test_cli_reports_one_line_and_exit_code(tmp_path, capsys):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"\x00" * 100)
    assert main(["show", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("edgeinfer: error:") and "Traceback" not in err


def test_cli_subprocess_has_no_traceback(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"GGUF\x03\x00\x00\x00")
    proc = subprocess.run([sys.executable, "-m", "edgeinfer.cli", "show", str(path)],
                          capture_output=True, text=True)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr and "truncated" in proc.stderr


def test_show_prints_model_facts(tiny_models, capsys):
    assert main(["show", str(tiny_models["qwen2"])]) == 0
    out = capsys.readouterr().out
    for fragment in ("architecture", "qwen2", "context length", "512", "embedding length", "256",
                     "F32", "chat template"):
        assert fragment in out
