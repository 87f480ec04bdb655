"""Split GGUF files (llama.cpp's gguf-split format): opened by their first part, checked as a set."""

from __future__ import annotations

import numpy as np
import pytest
from llama_oracle import importorskip_oracle

import edgeinfer
from edgeinfer import gguf_split
from edgeinfer.errors import GGUFError
from edgeinfer.gguf_file import GGUFFile
from gguf_factory import write_tiny_model
from gguf_split_factory import split_gguf

PREFIX = "tiny-Q8_0"


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("whole") / f"{PREFIX}.gguf", "llama", "Q8_0")


@pytest.fixture(scope="module")
def parts(whole, tmp_path_factory):
    return split_gguf(whole, tmp_path_factory.mktemp("split"), PREFIX, 3)


def _names(whole) -> list[str]:
    return list(GGUFFile.open(whole).tensors)


def _error(path) -> str:
    with pytest.raises(GGUFError) as info:
        GGUFFile.open(path)
    message = str(info.value)
    assert "\n" not in message
    return message


# --- names ---------------------------------------------------------------------------------


def test_part_names_follow_llama_split_path():
    assert gguf_split.part_name("m-Q4_K_M", 0, 3) == "m-Q4_K_M-00001-of-00003.gguf"
    assert gguf_split.parse_part_name("m-Q4_K_M-00002-of-00003.gguf") == ("m-Q4_K_M", 1, 3)
    assert gguf_split.parse_part_name("m-Q4_K_M.gguf") is None
    assert gguf_split.parse_part_name("m-00004-of-00003.gguf") is None
    assert gguf_split.part_names("Q4/m-00002-of-00002.gguf") == ["Q4/m-00001-of-00002.gguf", "Q4/m-00002-of-00002.gguf"]
    assert gguf_split.part_names("m.gguf") == ["m.gguf"]


# --- a good split set ----------------------------------------------------------------------


def test_first_part_opens_every_part(whole, parts):
    one, split = GGUFFile.open(whole), GGUFFile.open(parts[0])
    assert split.path == parts[0] and split.part_paths == parts
    assert list(split.tensors) == list(one.tensors)
    assert {info.part for info in split.tensors.values()} == {0, 1, 2}
    assert split.file_size == sum(p.stat().st_size for p in parts)
    for name, info in one.tensors.items():
        assert np.array_equal(split.raw(name), one.raw(name))
        assert split.tensors[name].shape == info.shape and split.tensors[name].qtype == info.qtype
    norm = "blk.1.attn_norm.weight"
    assert np.array_equal(split.array(norm), one.array(norm))
    assert split.metadata["split.count"] == 3 and split.architecture == "llama"
    for name in split.tensors:  # each part's mapping takes its own pages back
        split.drop_pages(name)
    assert np.array_equal(split.raw(norm), one.raw(norm))


def test_split_model_generates_exactly_what_the_whole_file_does(whole, parts):
    results = []
    for path in (whole, parts[0]):
        model = edgeinfer.load(str(path), gpu_layers=0, n_ctx=64)
        results.append(model.generate("hello world", max_tokens=8, temperature=0, logprobs=2))
    assert results[1].tokens == results[0].tokens and len(results[0].tokens) == 8
    assert results[1].logprobs == results[0].logprobs


def test_llama_cpp_loads_the_test_split_files_alike(whole, parts):
    llama_cpp = importorskip_oracle()
    logits = []
    for path in (whole, parts[0]):
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, logits_all=True, verbose=False)
        tokens = llm.tokenize(b"hello world")
        llm.eval(tokens)
        logits.append(np.array(llm.scores[: len(tokens)]))
        llm.close()
    assert np.array_equal(logits[0], logits[1])


def test_metadata_only_first_part_is_fine(whole, tmp_path):
    names = _names(whole)
    paths = split_gguf(whole, tmp_path, PREFIX, 2, chunks=[[], names])
    assert list(GGUFFile.open(paths[0]).tensors) == names


# --- hostile sets --------------------------------------------------------------------------


def test_missing_part_is_named(whole, tmp_path):
    paths = split_gguf(whole, tmp_path, PREFIX, 3)
    paths[2].unlink()
    message = _error(paths[0])
    assert message.startswith(f"{paths[0]}: ") and f"part 3 of 3 is missing: {paths[2]}" in message


def test_non_first_part_says_which_file_to_open(parts):
    message = _error(parts[1])
    assert message.startswith(f"{parts[1]}: is part 2 of 3 of a split GGUF")
    assert message.endswith(f"open its first part, {PREFIX}-00001-of-00003.gguf")


def test_part_whose_keys_disagree_with_its_position(whole, tmp_path):
    paths = split_gguf(whole, tmp_path, PREFIX, 3, keys={2: {"split.no": 1}})
    message = _error(paths[0])
    assert message.startswith(f"{paths[2]}: expected split GGUF part 3 of 3") and "found split.no 1, split.count 3" in message


def test_part_with_another_count(whole, tmp_path):
    paths = split_gguf(whole, tmp_path, PREFIX, 3, keys={1: {"split.count": 4}})
    assert "found split.no 1, split.count 4" in _error(paths[0])


def test_part_without_split_keys(whole, tmp_path):
    paths = split_gguf(whole, tmp_path, PREFIX, 2, keys={1: {"split.no": None, "split.count": None}})
    assert _error(paths[0]).startswith(f"{paths[1]}: expected split GGUF part 2 of 2") and "no split keys" in _error(paths[0])


def test_first_part_whose_name_disagrees_with_its_count(whole, tmp_path):
    paths = split_gguf(whole, tmp_path, PREFIX, 3)
    renamed = paths[0].rename(tmp_path / "model.gguf")
    assert "its name does not end in -00001-of-00003.gguf" in _error(renamed)


def test_tensor_total_must_match_split_tensors_count(whole, tmp_path):
    n = len(_names(whole))
    paths = split_gguf(whole, tmp_path, PREFIX, 3, keys={0: {"split.tensors.count": n + 1}})
    message = _error(paths[0])
    assert message.startswith(f"{paths[0]}: ") and f"holds {n} tensors over 3 parts, but split.tensors.count says {n + 1}" in message


def test_tensor_in_two_parts(whole, tmp_path):
    names = _names(whole)
    paths = split_gguf(whole, tmp_path, PREFIX, 2, chunks=[names[:5], names[4:]],
                       keys={0: {"split.tensors.count": len(names)}})
    message = _error(paths[0])
    assert message.startswith(f"{paths[1]}: tensor {names[4]!r} is also in {paths[0].name}")


@pytest.mark.parametrize("count, expected", [
    (0, "'split.count' must be an integer from 1 to 9999, got 0"),
    (10_000, "'split.count' must be an integer from 1 to 9999, got 10000"),
    (9999, "corrupt split header: 9999 parts for"),  # more parts than its tensors could fill
])
def test_absurd_split_count_is_refused_before_looking_for_parts(whole, tmp_path, count, expected, monkeypatch):
    paths = split_gguf(whole, tmp_path, PREFIX, 2, keys={0: {"split.count": count}})
    looked = []
    monkeypatch.setattr(gguf_split.Path, "is_file", lambda self: looked.append(self) or True)
    assert expected in _error(paths[0])
    assert looked == []


def test_part_that_is_not_a_gguf(whole, tmp_path):
    paths = split_gguf(whole, tmp_path, PREFIX, 3)
    paths[1].write_bytes(b"<html>not found</html>")
    assert _error(paths[0]).startswith(f"{paths[1]}: not a GGUF file")


def test_a_count_of_one_is_an_ordinary_file(whole, tmp_path):
    paths = split_gguf(whole, tmp_path, PREFIX, 1)
    gf = GGUFFile.open(paths[0])
    assert gf.part_paths == paths and len(gf.tensors) == len(_names(whole))


def test_a_split_model_is_named_without_its_part_suffix(tmp_path):
    from edgeinfer.loader import open_model
    from edgeinfer.model_info import describe

    unnamed = write_tiny_model(tmp_path / "nameless.gguf", "llama", "Q8_0", extra_metadata={"general.name": None})
    first = split_gguf(unnamed, tmp_path / "parts", "nameless-Q8_0", 2)[0]
    assert first.name == "nameless-Q8_0-00001-of-00002.gguf"
    assert describe(open_model(first)).name == "nameless-Q8_0"
