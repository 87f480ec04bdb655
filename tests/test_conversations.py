"""The conversation store: conversations are saved sessions (same files as `edgeinfer run
--session`), written atomically, ids never from user text, the first JSON store migrated."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from edgeinfer.sessions import session_file
from edgeinfer.sessions.conversations import (Conversation, ConversationError, ConversationStore, default_dir,
                                     default_title, legacy_dir, same_model)
from edgeinfer.errors import EdgeInferError
from edgeinfer.sessions.session_file import (SavedSession, load_session, model_identity, read_session_info,
                                     save_session)

IDENTITY = {"name": "tiny", "size": 1234, "digest": "ab" * 32}


def _conv(**kw) -> Conversation:
    base = dict(model="tiny.gguf", system="be brief", identity=dict(IDENTITY),
                settings={"temperature": 0.3, "top_k": 5, "n_ctx": 512, "save_kv": False},
                messages=[{"role": "user", "content": "hi ü"},
                          {"role": "assistant", "content": "hello", "finish_reason": "stop"}])
    return Conversation(**{**base, **kw})


def test_round_trip_keeps_every_field_in_a_saved_session(tmp_path):
    store = ConversationStore(tmp_path)
    conv = _conv(title="Mine", model_path="/models/tiny.gguf")
    path = store.save(conv, sampling={"temperature": 0.3, "top_k": 5, "max_tokens": 8})
    assert path == tmp_path / f"{conv.id}.npz"
    back = store.load(conv.id)
    for name in ("id", "title", "model", "system", "messages", "identity", "model_path", "created"):
        assert getattr(back, name) == getattr(conv, name), name
    assert back.settings == {"temperature": 0.3, "top_k": 5, "n_ctx": 512, "save_kv": False, "max_tokens": 8}
    assert back.n_kv == 0 and back.updated == pytest.approx(path.stat().st_mtime)

    # The very file `edgeinfer run --session` reads: system prompt first, sampling for run.
    saved = load_session(path, IDENTITY)
    assert saved.messages[0] == {"role": "system", "content": "be brief"}
    assert saved.messages[1:] == conv.messages
    assert saved.sampling == {"temperature": 0.3, "top_k": 5, "max_tokens": 8}
    assert saved.meta["title"] == "Mine" and saved.meta["settings"]["n_ctx"] == 512


def test_sampling_written_by_run_wins_over_the_tui_settings(tmp_path):
    store = ConversationStore(tmp_path)
    conv = _conv(title="Kept")
    path = store.save(conv)
    # `edgeinfer run` continues it: writes messages and sampling, no meta (so the old meta is kept).
    save_session(path, SavedSession(messages=conv.chat_messages() + [{"role": "user", "content": "more"}],
                                    sampling={"temperature": 0.9, "seed": 7}), IDENTITY)
    back = store.load(conv.id)
    assert back.title == "Kept" and back.settings["temperature"] == 0.9 and back.settings["seed"] == 7
    assert back.settings["n_ctx"] == 512 and back.messages[-1]["content"] == "more"


def test_a_session_made_by_run_is_a_conversation(tmp_path):
    save_session(tmp_path / "work.npz", SavedSession(
        messages=[{"role": "user", "content": "from run"}, {"role": "assistant", "content": "ok"}],
        sampling={"temperature": 0.0}), IDENTITY)
    conv = ConversationStore(tmp_path).load("work")
    assert conv.id == "work" and conv.display_title == "from run" and conv.system == ""
    assert conv.identity == IDENTITY and conv.model == "" and conv.model_label == "tiny"


def test_list_is_most_recently_written_first_and_skips_corrupt_files(tmp_path):
    store = ConversationStore(tmp_path)
    old, new = _conv(), _conv()
    store.save(new)
    store.save(old)
    os.utime(store.path_of(new.id), (200.0, 200.0))
    os.utime(store.path_of(old.id), (100.0, 100.0))
    (tmp_path / "broken.npz").write_bytes(b"not a zip")
    arrays = dict(np.load(store.path_of(old.id)))
    arrays["header"] = np.frombuffer(b'{"format": "something else"}', dtype=np.uint8)
    with open(tmp_path / "alien.npz", "wb") as f:
        np.savez(f, **arrays)
    convs, problems = store.list()
    assert [c.id for c in convs] == [new.id, old.id]
    assert sorted(p.split(":")[0] for p in problems) == ["skipped alien.npz", "skipped broken.npz"]
    assert all("\n" not in p for p in problems)


def test_ids_are_session_names_and_other_ids_are_refused(tmp_path):
    store = ConversationStore(tmp_path)
    conv = _conv(title="../../etc/passwd", messages=[{"role": "user", "content": "../x"}])
    path = store.save(conv)
    assert path.parent == tmp_path and conv.id.startswith("chat-")
    assert store.new_id() != conv.id
    for bad in ("../evil", "", conv.id + "/", ".hidden", "a b"):
        with pytest.raises(ConversationError):
            store.path_of(bad)


def test_failed_write_leaves_the_old_file_and_no_temp_file(tmp_path, monkeypatch):
    store = ConversationStore(tmp_path)
    conv = _conv()
    path = store.save(conv)
    before = path.read_bytes()
    conv.messages.append({"role": "user", "content": "second"})

    def boom(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(EdgeInferError) as err:
        store.save(conv)
    assert "No space left" in str(err.value) and "\n" not in str(err.value)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]


KILLED_WRITER = """
import sys
from edgeinfer.sessions.conversations import Conversation, ConversationStore
store = ConversationStore(sys.argv[1])
conv = Conversation(id="victim", identity={"name": "t", "size": 1, "digest": "d"})
n = 0
while True:
    n += 1
    conv.messages = [{"role": "user", "content": "x" * 2000}] * n
    store.save(conv)
    print(n, flush=True)
"""


def test_a_kill_mid_save_leaves_a_whole_file(tmp_path):
    """SIGKILL a process that saves as fast as it can: the file on disk is always a whole version."""
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(tmp_path)], stdout=subprocess.PIPE,
                            text=True)
    try:
        for _ in range(20):  # let it save a few times, then kill it wherever it is
            proc.stdout.readline()
        time.sleep(0.05)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    conv = ConversationStore(tmp_path).load("victim")
    assert conv.messages and all(m["content"] == "x" * 2000 for m in conv.messages)
    convs, problems = ConversationStore(tmp_path).list()  # a leftover temp file is not a conversation
    assert [c.id for c in convs] == ["victim"] and problems == []


def test_kv_is_saved_and_kept_only_for_the_same_model(tmp_path):
    store = ConversationStore(tmp_path)
    conv = _conv()
    k = [np.ones((3, 1, 4), np.float16)] * 2
    kv = ([5, 6, 7], k, k, np.arange(3))
    store.save(conv, kv=kv)
    assert conv.n_kv == 3 and read_session_info(store.path_of(conv.id)).n_kv == 3
    assert store.load_kv(conv, IDENTITY, 2).tokens == [5, 6, 7]
    conv.title = "renamed"
    store.save(conv, keep_kv=True)  # a rename keeps the K/V the file holds
    assert read_session_info(store.path_of(conv.id)).n_kv == 3
    store.save(conv)  # the setting off: no K/V
    assert read_session_info(store.path_of(conv.id)).n_kv == 0
    store.save(conv, kv=kv)
    conv.identity = {"name": "other", "size": 1, "digest": "cd" * 32}
    store.save(conv, keep_kv=True)  # now another model's conversation: the old K/V are useless
    assert read_session_info(store.path_of(conv.id)).n_kv == 0


def _legacy(folder, cid, **kw) -> dict:
    data = {"version": 1, "id": cid, "title": "Old", "model": "", "system": "sys",
            "settings": {"temperature": 0.1, "n_ctx": 300}, "created": 10.0, "updated": 20.0,
            "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], **kw}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{cid}.json").write_text(json.dumps(data), encoding="utf-8")
    return data


def test_first_store_is_migrated_once_and_kept(tmp_path, tiny_models):
    legacy = tmp_path / "conversations"
    a, b = "a" * 32, "b" * 32
    _legacy(legacy, a, model=str(tiny_models["llama"]))
    _legacy(legacy, b, model="/nowhere/gone.gguf", updated=30.0)
    (legacy / ("c" * 32 + ".json")).write_text("{broken")
    store = ConversationStore(tmp_path / "sessions", legacy=legacy)
    convs, problems = store.list()
    assert [c.id for c in convs] == [b, a]  # the old `updated` order is kept
    assert len(problems) == 1 and problems[0].startswith("skipped " + "c" * 32)
    conv = store.load(a)
    assert (conv.title, conv.system, conv.settings["n_ctx"], conv.messages[1]["content"]) == ("Old", "sys", 300, "a")
    assert same_model(conv.identity, model_identity(tiny_models["llama"]))  # found, so `run` accepts it
    assert store.load(b).identity == {}  # its model is not here: still readable
    assert sorted(p.name for p in (legacy / "migrated").iterdir()) == [f"{a}.json", f"{b}.json"]
    assert (legacy / ("c" * 32 + ".json")).exists()  # unreadable: left where it was
    store.delete(a)
    assert [c.id for c in store.list()[0]] == [b]  # a deleted conversation does not come back


@pytest.mark.parametrize("patch", [{"messages": [{"role": "system", "content": "x"}]}, {"messages": "x"},
                                   {"settings": []}, {"version": 9}, {"created": "yesterday"}])
def test_bad_first_store_files_are_reported_not_migrated(tmp_path, patch):
    cid = "d" * 32
    _legacy(tmp_path, cid, **patch)
    store = ConversationStore(tmp_path)
    convs, problems = store.list()
    assert convs == [] and len(problems) == 1 and (tmp_path / f"{cid}.json").exists()


def test_default_title_is_the_first_user_message_on_one_line():
    assert default_title([]) == "New chat"
    msgs = [{"role": "assistant", "content": "x"}, {"role": "user", "content": "  What is\n\nGGUF?  "}]
    assert default_title(msgs) == "What is GGUF?"
    long = default_title([{"role": "user", "content": "word " * 40}])
    assert len(long) <= 48 and long.endswith("…")
    assert Conversation(title="Mine", messages=msgs).display_title == "Mine"


def test_chat_messages_put_the_system_prompt_first_and_drop_extra_keys():
    conv = Conversation(system="sys", messages=[{"role": "user", "content": "q"},
                                                {"role": "assistant", "content": "a", "finish_reason": "stop"}])
    assert conv.chat_messages() == [{"role": "system", "content": "sys"}, {"role": "user", "content": "q"},
                                    {"role": "assistant", "content": "a"}]
    assert Conversation(system="  ").chat_messages() == []


def test_data_dir_follows_edgeinfer_home(monkeypatch, tmp_path):
    monkeypatch.setenv("EDGEINFER_HOME", str(tmp_path))
    assert default_dir() == tmp_path / "sessions" == session_file.sessions_dir()
    assert legacy_dir() == tmp_path / "conversations"
    store = ConversationStore()
    assert (store.root, store.legacy) == (tmp_path / "sessions", tmp_path / "conversations")
    monkeypatch.delenv("EDGEINFER_HOME")
    assert str(default_dir()).endswith(os.path.join(".local", "share", "edgeinfer", "sessions"))
