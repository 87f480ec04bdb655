"""The saved-conversation store: format, atomic writes, corrupt files, ids never from user text."""

from __future__ import annotations

import json
import os

import pytest

from edgeinfer.conversations import (FORMAT_VERSION, Conversation, ConversationError, ConversationStore,
                                     default_dir, default_title)


def test_round_trip_keeps_every_field(tmp_path):
    store = ConversationStore(tmp_path)
    conv = Conversation(model="tiny", system="be brief", settings={"temperature": 0.3, "n_ctx": 512},
                        messages=[{"role": "user", "content": "hi ü"},
                                  {"role": "assistant", "content": "hello", "finish_reason": "stop"}])
    path = store.save(conv)
    raw = json.loads(path.read_text(encoding="utf-8"))
    assert raw["version"] == FORMAT_VERSION
    assert set(raw) == {"version", "id", "title", "model", "system", "settings", "messages", "created", "updated"}
    back = store.load(conv.id)
    assert back == conv
    assert path.name == f"{conv.id}.json"


def test_list_is_newest_first_and_skips_corrupt_files(tmp_path):
    store = ConversationStore(tmp_path)
    old, new = Conversation(), Conversation()
    store.save(old)
    store.save(new)
    os.utime(tmp_path / f"{old.id}.json")  # mtime does not matter, `updated` does
    new.updated, old.updated = 200.0, 100.0
    store.save(new, touch=False)
    store.save(old, touch=False)
    (tmp_path / "broken.json").write_text("{not json")
    (tmp_path / ("a" * 32 + ".json")).write_text(json.dumps({"version": 99}))
    convs, problems = store.list()
    assert [c.id for c in convs] == [new.id, old.id]
    assert len(problems) == 2 and all(p.startswith("skipped ") for p in problems)


def test_ids_are_uuid_hex_and_other_ids_are_refused(tmp_path):
    store = ConversationStore(tmp_path)
    conv = Conversation(title="../../etc/passwd", messages=[{"role": "user", "content": "../x"}])
    path = store.save(conv)
    assert path.parent == tmp_path and len(conv.id) == 32
    for bad in ("../evil", "x" * 32, "", conv.id + "/"):
        with pytest.raises(ConversationError):
            store.path_of(bad)


def test_failed_write_leaves_the_old_file_and_no_temp_file(tmp_path, monkeypatch):
    store = ConversationStore(tmp_path)
    conv = Conversation(messages=[{"role": "user", "content": "first"}])
    path = store.save(conv)
    before = path.read_bytes()
    conv.messages.append({"role": "assistant", "content": "second"})

    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError):
        store.save(conv)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]


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


def test_bad_shapes_are_rejected():
    good = Conversation().to_json()
    for patch in ({"messages": [{"role": "system", "content": "x"}]}, {"messages": "x"},
                  {"settings": []}, {"id": "../x"}, {"created": "yesterday"}):
        with pytest.raises(ConversationError):
            Conversation.from_json({**good, **patch})
    with pytest.raises(ConversationError):
        Conversation.from_json([1, 2])


def test_data_dir_follows_edgeinfer_home(monkeypatch, tmp_path):
    monkeypatch.setenv("EDGEINFER_HOME", str(tmp_path))
    assert default_dir() == tmp_path / "conversations"
    monkeypatch.delenv("EDGEINFER_HOME")
    assert str(default_dir()).endswith(os.path.join(".local", "share", "edgeinfer", "conversations"))
