"""Saved sessions: round trip (with and without K/V), model mismatch refused, corrupt files
reported, atomic writes, safe names, and `edgeinfer run NAME --session S`."""

from __future__ import annotations

import os
import re
import shutil

import numpy as np
import pytest

import edgeinfer
from edgeinfer.sessions import session_file
from edgeinfer.cli import main
from edgeinfer.errors import EdgeInferError
from edgeinfer.sessions.session_file import (SavedSession, SessionFileError, check_name, load_session,
                                     model_identity, save_session, session_path)


@pytest.fixture(scope="module")
def model(tiny_models):
    return edgeinfer.load(str(tiny_models["llama"]), backend="reference", n_ctx=64)


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGEINFER_HOME", str(tmp_path))
    return tmp_path


def _session(model) -> SavedSession:
    return SavedSession(messages=[{"role": "system", "content": "be brief"},
                                  {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
                        tokens=[3, 4, 5], sampling={"temperature": 0.0, "stop": ["\n"]})


def test_round_trip_with_kv_restores_the_cache(model, home):
    ids = list(range(3, 30))
    model.reset()
    first = model.generate(ids, max_tokens=4, temperature=0)
    tokens, k, v, pos, *_ = model.sessions.export_kv()
    assert tokens == (ids + first.tokens)[:len(tokens)] and len(pos) == len(tokens)
    saved = SavedSession(messages=[{"role": "user", "content": "x"}], tokens=tokens,
                         sampling={"temperature": 0.0}, k=k, v=v, pos=pos)
    path = save_session(session_path("round-trip"), saved, model.identity)
    assert path.parent == home / "sessions" and path.exists()

    loaded = load_session(path, model.identity, model.config.n_layer)
    assert loaded.messages == saved.messages and loaded.tokens == tokens and loaded.sampling == saved.sampling
    for a, b in zip(loaded.k + loaded.v, k + v):
        np.testing.assert_array_equal(a, b)

    # Restored into a fresh cache: the next turn prefills only its new tokens and answers as a cold run.
    model.reset()
    assert model.sessions.import_kv(loaded.tokens, loaded.k, loaded.v, loaded.pos) == len(tokens)
    longer = tokens + [7, 8, 9]
    warm = model.generate(longer, max_tokens=4, temperature=0)
    assert warm.usage.cached_tokens == len(tokens)
    model.reset()
    cold = model.generate(longer, max_tokens=4, temperature=0)
    assert cold.usage.cached_tokens == 0 and cold.tokens == warm.tokens
    model.sessions.check_invariants()


def test_round_trip_without_kv(model, home):
    path = save_session(session_path("plain"), _session(model), model.identity)
    loaded = load_session(path, model.identity)
    assert loaded.n_kv == 0 and loaded.tokens == [3, 4, 5] and loaded.sampling["stop"] == ["\n"]


def test_mismatched_model_is_refused(model, tiny_models, home):
    path = save_session(session_path("other"), _session(model), model.identity)
    other = model_identity(tiny_models["qwen3"], "tiny-qwen3")
    with pytest.raises(SessionFileError) as err:
        load_session(path, other)
    msg = str(err.value)
    assert "another model" in msg and "\n" not in msg


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty", "bad_header", "version"])
def test_corrupt_file_is_reported_not_loaded(model, home, damage):
    path = save_session(session_path("broken"), _session(model), model.identity)
    data = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        path.write_bytes(os.urandom(len(data)))
    elif damage == "empty":
        path.write_bytes(b"")
    else:
        arrays = dict(np.load(path))
        header = b'{"format": "nope"' if damage == "bad_header" else \
            arrays["header"].tobytes().replace(b'"version": 3', b'"version": 99')
        arrays["header"] = np.frombuffer(header, dtype=np.uint8)
        with open(path, "wb") as f:
            np.savez(f, **arrays)
    with pytest.raises(SessionFileError) as err:
        load_session(path, model.identity)
    assert "\n" not in str(err.value) and "broken" in str(err.value)


def test_crash_mid_save_leaves_the_old_file_intact(model, home, monkeypatch):
    path = save_session(session_path("keep"), _session(model), model.identity)
    before = path.read_bytes()

    def crash(*a, **kw):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(session_file.os, "replace", crash)  # dies after writing the temp file
    newer = _session(model)
    newer.tokens = list(range(100))
    with pytest.raises(SessionFileError):
        save_session(path, newer, model.identity)
    assert path.read_bytes() == before
    assert [p.name for p in path.parent.iterdir()] == ["keep.npz"]  # no temp file left behind
    assert load_session(path, model.identity).tokens == [3, 4, 5]


@pytest.mark.parametrize("name", ["../etc/passwd", "a/b", "", ".hidden", "..", "x" * 200, "a b", "-x"])
def test_session_names_never_become_paths(name):
    with pytest.raises(EdgeInferError):
        check_name(name)


def test_good_names_pass():
    assert check_name("chat-1.v2_A") == "chat-1.v2_A"


def test_run_session_resumes_a_conversation(tiny_models, home, capsys):
    common = [str(tiny_models["llama"]), "-n", "4", "--temp", "0", "--backend", "reference", "-c", "256"]
    assert main(["run", *common, "hello world", "--session", "work", "--session-kv"]) == 0
    path = home / "sessions" / "work.npz"
    model = edgeinfer.load(str(tiny_models["llama"]), backend="reference", n_ctx=256)
    first = load_session(path, model.identity, model.config.n_layer)
    assert [m["role"] for m in first.messages] == ["user", "assistant"]
    assert first.n_kv > 0 and first.sampling["temperature"] == 0
    capsys.readouterr()
    assert main(["run", *common, "and then?", "--session", "work", "--verbose"]) == 0
    err = capsys.readouterr().err
    assert "Resumed session 'work'" in err
    # The restored K/V served the first turn's prompt (the answer's text may re-tokenize
    # differently from the sampled ids, so not necessarily all of it).
    cached = int(re.search(r"prompt eval count:\s+\d+ token\(s\) \((\d+) cached\)", err).group(1))
    assert cached >= len(first.tokens) - 4
    second = load_session(path, model.identity)
    assert [m["content"] for m in second.messages][::2] == ["hello world", "and then?"]
    assert second.n_kv == 0  # saved without --session-kv this time


def test_run_session_with_another_model_is_one_line_error(tiny_models, home, capsys):
    common = ["-n", "2", "--temp", "0", "--backend", "reference", "-c", "256"]
    assert main(["run", str(tiny_models["llama"]), "hi", *common, "--session", "mine"]) == 0
    capsys.readouterr()
    assert main(["run", str(tiny_models["qwen3"]), "hi", *common, "--session", "mine"]) == 1
    errors = _error_lines(capsys.readouterr().err)
    assert len(errors) == 1 and "another model" in errors[0]


def test_run_session_bad_name_fails_before_loading(tiny_models, home, capsys):
    assert main(["run", str(tiny_models["llama"]), "hi", "--session", "../../x"]) == 1
    assert "invalid session name" in capsys.readouterr().err
    assert not (home / "sessions").exists() or not any((home / "sessions").iterdir())
    shutil.rmtree(home / "sessions", ignore_errors=True)


def test_run_session_with_invalid_saved_settings_is_refused(tiny_models, home, capsys):
    model = edgeinfer.load(str(tiny_models["llama"]), backend="reference", n_ctx=256)
    bad = SavedSession(messages=[], tokens=[], sampling={"temperature": "hot"})
    save_session(session_path("bad"), bad, model.identity)
    assert main(["run", str(tiny_models["llama"]), "hi", "-n", "2", "--backend", "reference", "-c", "256",
                 "--session", "bad"]) == 1
    errors = _error_lines(capsys.readouterr().err)
    assert len(errors) == 1 and "invalid sampling settings" in errors[0]


def _error_lines(err: str) -> list[str]:
    """The error lines of stderr (a model without a chat template adds a notice line of its own)."""
    assert "Traceback" not in err
    return [line for line in err.splitlines() if "error" in line]


def test_meta_round_trips_and_a_save_without_meta_keeps_it(model, home):
    path = session_path("with-meta")
    first = _session(model)
    first.meta = {"title": "My chat", "settings": {"n_ctx": 512}}
    save_session(path, first, model.identity)
    assert load_session(path, model.identity).meta == first.meta
    again = _session(model)  # as `edgeinfer run` writes it: meta None = keep the file's
    again.messages.append({"role": "user", "content": "more"})
    save_session(path, again, model.identity)
    loaded = load_session(path, model.identity)
    assert loaded.meta == first.meta and loaded.messages[-1]["content"] == "more"
    plain = save_session(session_path("no-meta"), _session(model), model.identity)
    assert load_session(plain, model.identity).meta is None


def test_read_session_info_reads_the_header_of_any_models_session(model, tiny_models, home):
    ids = list(range(3, 20))
    model.reset()
    model.generate(ids, max_tokens=2, temperature=0)
    tokens, k, v, pos, *_ = model.sessions.export_kv()
    saved = _session(model)
    saved.tokens, saved.k, saved.v, saved.pos = tokens, k, v, pos
    saved.meta = {"title": "t"}
    path = save_session(session_path("info"), saved, model.identity)
    info = session_file.read_session_info(path)
    assert info.name == "info" and info.model == model.identity and info.n_kv == len(tokens)
    assert info.messages == saved.messages and info.sampling == saved.sampling and info.meta == {"title": "t"}
    assert info.mtime == path.stat().st_mtime
    # No model check here (a listing shows every session); load_session still refuses another model's.
    with pytest.raises(SessionFileError):
        load_session(path, model_identity(tiny_models["qwen3"]))
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(SessionFileError) as err:
        session_file.read_session_info(path)
    assert "corrupt" in str(err.value) and "\n" not in str(err.value)
