"""llama-server's /slots endpoints for edgeinfer's one slot (issue 37): GET /slots, and
POST /slots/0?action=save|restore|erase with `--slot-save-path`, hostile file names refused."""

from __future__ import annotations

import os
import types

import pytest
from starlette.testclient import TestClient

from test_server import fim_model_path, load_tiny  # noqa: F401 - a fixture

from edgeinfer.server import ServerConfig, create_app
from edgeinfer.server.slot_status import slot_json
from edgeinfer.sessions.session_file import SavedSession, save_session

GREEDY = {"temperature": 0.0, "max_tokens": 4}


@pytest.fixture(scope="module")
def model(fim_model_path):
    return load_tiny(fim_model_path)


@pytest.fixture()
def folder(tmp_path):
    d = tmp_path / "slots"
    d.mkdir()
    return d


@pytest.fixture()
def client(model, folder):
    model.reset()
    app = create_app(ServerConfig(model_name="tiny", sampling=GREEDY, slot_save_path=str(folder)), model)
    with TestClient(app, base_url="http://127.0.0.1") as c:
        yield c


def complete(client, prompt) -> dict:
    r = client.post("/completion", json={"prompt": prompt, "cache_prompt": True})
    assert r.status_code == 200, r.text
    return r.json()


def action(client, name: str, **body):
    return client.post(f"/slots/0?action={name}", json=body or None)


def error(r) -> str:
    return r.json()["error"]["message"]


def test_get_slots_shape(client):
    r = client.get("/slots")
    assert r.status_code == 200
    [slot] = r.json()
    assert slot == {"id": 0, "n_ctx": 256, "speculative": False, "is_processing": False}  # nothing ran yet
    r = client.post("/completion", json={"prompt": "hello", "n_predict": 3, "top_k": 5, "stop": ["x"], "seed": 7})
    assert r.status_code == 200, r.text
    [slot] = client.get("/slots").json()
    assert slot["is_processing"] is False and slot["id_task"] >= 1
    assert slot["params"]["n_predict"] == 3 and slot["params"]["top_k"] == 5 and slot["params"]["seed"] == 7
    assert slot["params"]["stop"] == ["x"] and slot["params"]["temperature"] == 0.0
    assert slot["next_token"] == [{"has_next_token": False, "n_remain": 0, "n_decoded": 3}]
    assert slot["n_prompt_tokens"] > 0 and slot["n_prompt_tokens_processed"] > 0
    assert client.get("/slots?fail_on_no_slot=1").status_code == 200  # idle: a slot is free
    bad = client.get("/slots?bogus=1")
    assert bad.status_code == 400 and "bogus" in error(bad)


def test_a_running_generation_shows_as_processing(model):
    job = types.SimpleNamespace(id=9, params={"max_tokens": 10, "temperature": 0.5}, n_decoded=4)
    slot = slot_json(model, job, None)
    assert slot["is_processing"] is True and slot["id_task"] == 9
    assert slot["next_token"] == [{"has_next_token": True, "n_remain": 6, "n_decoded": 4}]
    assert slot["params"]["temperature"] == 0.5 and slot["params"]["n_predict"] == 10


def test_save_erase_restore_reuses_the_prefix(client, folder):
    first = complete(client, "once upon a time there was")
    full = first["timings"]["prompt_n"]
    saved = action(client, "save", filename="s.bin").json()
    assert saved["id_slot"] == 0 and saved["filename"] == "s.bin" and saved["n_saved"] > full - 1
    assert saved["n_written"] == (folder / "s.bin").stat().st_size and "save_ms" in saved["timings"]
    n = saved["n_saved"]

    erased = action(client, "erase").json()
    assert erased == {"id_slot": 0, "n_erased": n}
    assert client.get("/slots").json()[0]["n_prompt_tokens"] == 0
    assert complete(client, "once upon a time there was")["timings"]["prompt_n"] == full  # nothing reused
    action(client, "erase")

    restored = action(client, "restore", filename="s.bin").json()
    assert restored["n_restored"] == n and restored["n_read"] == saved["n_written"]
    assert "restore_ms" in restored["timings"]
    assert client.get("/slots").json()[0]["n_prompt_tokens"] == n
    ids = [int(t) for t in client.post("/tokenize", json={"content": "once upon a time there was",
                                                          "add_special": True}).json()["tokens"]]
    again = complete(client, ids + [5, 6])
    assert len(ids) == full and again["timings"]["cache_n"] == full
    assert again["timings"]["prompt_n"] == 2  # only the new part


def test_refused_without_slot_save_path(model):
    app = create_app(ServerConfig(model_name="tiny", sampling=GREEDY), model)
    with TestClient(app, base_url="http://127.0.0.1") as c:
        r = c.post("/slots/0?action=save", json={"filename": "x.bin"})
        assert r.status_code == 501
        assert r.json()["error"] == {"code": 501, "type": "not_supported_error", "message":
                                     "This server does not support slots action. Start it with `--slot-save-path`"}
        assert c.get("/slots").status_code == 200  # the description needs no folder


@pytest.mark.parametrize("path,body,needle", [
    ("/slots/1?action=save", {"filename": "x.bin"}, "one slot, id 0"),
    ("/slots/abc?action=erase", None, "one slot, id 0"),
    ("/slots/0?action=delete", {"filename": "x.bin"}, "save, restore or erase"),
    ("/slots/0", {"filename": "x.bin"}, "save, restore or erase"),
    ("/slots/0?action=save&action=restore", {"filename": "x.bin"}, "twice"),
    ("/slots/0?action=save&x=1", {"filename": "x.bin"}, "'x'"),
    ("/slots/0?action=save", {"filename": "x.bin", "extra": 1}, "'extra'"),
    ("/slots/0?action=save", None, "empty"),
    ("/slots/0?action=save", {"filename": 5}, "'filename'"),
    ("/slots/0?action=erase", {"filename": "x.bin"}, "'filename'"),
])
def test_bad_requests_are_400(client, folder, path, body, needle):
    r = client.post(path, json=body)
    assert r.status_code == 400 and needle in error(r)
    assert list(folder.iterdir()) == []


@pytest.mark.parametrize("name", ["../x.bin", "a/b", ".", "..", "/etc/passwd", ".hidden", "a\\b", "x:y", " x",
                                  "x" * 256, "\u2215x"])
def test_hostile_file_names_are_refused(client, folder, name):
    complete(client, "hello")
    for act in ("save", "restore"):
        r = action(client, act, filename=name)
        assert r.status_code == 400 and "filename" in error(r), (act, r.text)
    assert list(folder.iterdir()) == [] and not (folder.parent / "x.bin").exists()


def test_links_and_fifos_are_refused(client, folder, tmp_path):
    complete(client, "hello")
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"keep me")
    (folder / "link.bin").symlink_to(outside)
    os.mkfifo(folder / "fifo.bin")
    for name in ("link.bin", "fifo.bin"):
        for act in ("save", "restore"):
            r = action(client, act, filename=name)
            assert r.status_code == 400, (name, act, r.text)
            assert name in error(r)
    assert outside.read_bytes() == b"keep me"
    assert (folder / "link.bin").is_symlink() and sorted(p.name for p in folder.iterdir()) == ["fifo.bin", "link.bin"]


def test_restore_of_a_bad_file_keeps_the_slot(client, folder):
    complete(client, "once upon a time")
    n = client.get("/slots").json()[0]["n_prompt_tokens"]
    save_session(folder / "other.bin", SavedSession(tokens=[1, 2, 3]), {"name": "other", "size": 1, "digest": "0" * 64})
    (folder / "junk.bin").write_bytes(b"not a zip file")
    for name, needle in (("other.bin", "another model"), ("junk.bin", "corrupt"), ("missing.bin", "does not exist")):
        r = action(client, "restore", filename=name)
        assert r.status_code == 400 and needle in error(r) and "invalid slot save file" in error(r)
        assert client.get("/slots").json()[0]["n_prompt_tokens"] == n  # untouched
    assert complete(client, "once upon a time")["timings"]["cache_n"] > 0  # and still reused


def test_saving_an_empty_slot_and_restoring_it(client, folder):
    assert action(client, "save", filename="empty.bin").json()["n_saved"] == 0
    complete(client, "hello there")
    assert action(client, "restore", filename="empty.bin").json()["n_restored"] == 0
    assert client.get("/slots").json()[0]["n_prompt_tokens"] == 0


def test_serve_checks_the_folder(tmp_path):
    from edgeinfer.commands.serve import _slot_folder
    from edgeinfer.errors import EdgeInferError

    assert _slot_folder(str(tmp_path)) == str(tmp_path)
    assert _slot_folder(None) is None
    with pytest.raises(EdgeInferError, match="slot-save-path"):
        _slot_folder(str(tmp_path / "nope"))



def test_no_slots_turns_the_monitoring_endpoint_off(model):
    from edgeinfer.cli import build_parser

    app = create_app(ServerConfig(model_name="tiny", sampling=GREEDY, slots_endpoint=False), model)
    with TestClient(app, base_url="http://127.0.0.1") as c:
        r = c.get("/slots")
        assert r.status_code == 501 and r.json()["error"]["type"] == "not_supported_error"
    assert build_parser().parse_args(["serve", "x", "--no-slots"]).slots_endpoint is False
    assert build_parser().parse_args(["serve", "x"]).slots_endpoint is True
