"""Model management through the API, with the official clients: pull, delete, copy, create, ps,
list, OpenAI's models.retrieve, and several local models served by one server (LRU slots)."""

from __future__ import annotations

import hashlib
import json
import time

import httpx
import pytest

from edgeinfer.store import model_names, registry
from gguf_factory import spm_vocab, write_tiny_model
from hub_standin import HubStandin, use_standin
from test_server import MODEL, fim_model_path, start_server  # noqa: F401 - a fixture

REPO = "acme/Tiny-GGUF"
FILE = "tiny-Q4_K_M.gguf"
OPTIONS = {"backend": "reference", "n_ctx": 128}


@pytest.fixture(scope="module")
def other_model(tmp_path_factory):
    """A second tiny model file (another context length), served from the store by name."""
    return write_tiny_model(tmp_path_factory.mktemp("other") / "other.gguf", "llama", "F32", vocab=spm_vocab())


@pytest.fixture
def store(tmp_path, monkeypatch, other_model):
    """A temporary EDGEINFER_HOME and Hugging Face cache, and a hub stand-in holding one model."""
    hub = HubStandin().start()
    hub.add_file(REPO, FILE, other_model.read_bytes())
    monkeypatch.setenv("EDGEINFER_HOME", str(tmp_path / "home"))
    use_standin(monkeypatch, hub, tmp_path)
    yield hub
    hub.stop()


@pytest.fixture
def live(store, fim_model_path):
    from test_server import load_tiny

    srv = start_server(load_tiny(fim_model_path), model_options=OPTIONS)
    yield srv
    srv.stop()


@pytest.fixture
def client(live):
    import ollama

    return ollama.Client(host=live.url)


def test_pull_streams_ollama_progress_and_lists_the_model(live, client, store, other_model):
    events = list(client.pull(f"hf.co/{REPO}", stream=True))
    statuses = [e.status for e in events]
    assert statuses[0] == "pulling manifest" and statuses[-1] == "success"
    assert "verifying sha256 digest" in statuses
    pulling = [e for e in events if e.status.startswith("pulling ") and e.digest]
    sha = hashlib.sha256(other_model.read_bytes()).hexdigest()
    assert pulling and pulling[-1].digest == f"sha256:{sha}"
    assert pulling[-1].total == pulling[-1].completed == other_model.stat().st_size
    names = [m.model for m in client.list().models]
    assert names[0] == MODEL and f"hf.co/{REPO}:Q4_K_M" in names
    # not streamed: one final object; pulled again, nothing is downloaded twice
    gets = len(store.gets(FILE))
    assert client.pull(f"hf.co/{REPO}").status == "success"
    assert len(store.gets(FILE)) == gets


def test_pull_errors_are_one_line_4xx(live, client, store):
    import ollama

    with pytest.raises(ollama.ResponseError) as e:
        client.pull("hf.co/acme/Nothing-GGUF")
    assert e.value.status_code == 404 and "\n" not in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.pull("no-such-model")
    assert e.value.status_code == 404
    store.corrupt = True
    lines = [json.loads(x) for x in httpx.post(live.url + "/api/pull", json={"model": f"hf.co/{REPO}"},
                                               timeout=30).text.splitlines()]
    assert "corrupt" in lines[-1]["error"]
    assert registry.resolve_stored(f"hf.co/{REPO}") is None


@pytest.fixture
def small_chunks(monkeypatch):
    """http_get writes 4 KiB pieces, so a tiny file downloads in many steps, as a big one does."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 4096)


def test_pull_resumes_a_dropped_link(live, store, other_model, small_chunks):
    store.cut_after, store.cuts = other_model.stat().st_size // 3, 1
    r = httpx.post(live.url + "/api/pull", json={"model": f"hf.co/{REPO}", "stream": False}, timeout=60)
    assert r.json() == {"status": "success"}
    assert [g.header("range") is not None for g in store.gets(FILE)] == [False, True]
    assert registry.resolve_stored(f"hf.co/{REPO}").read_bytes() == other_model.read_bytes()


def test_a_client_leaving_stops_the_pull_and_the_next_one_resumes(live, store, other_model, small_chunks,
                                                                  monkeypatch):
    from edgeinfer.store import download

    real = download.http_get

    class Slow:
        def __init__(self, f):
            self.f = f

        def write(self, data):
            time.sleep(0.05)
            return self.f.write(data)

        def __getattr__(self, name):
            return getattr(self.f, name)

    monkeypatch.setattr(download, "http_get", lambda url, f, **kw: real(url, Slow(f), **kw))
    with httpx.stream("POST", live.url + "/api/pull", json={"model": f"hf.co/{REPO}"}, timeout=30) as r:
        lines = r.iter_lines()
        assert json.loads(next(lines)) == {"status": "pulling manifest"}
        while json.loads(next(lines))["completed"] < 3 * 4096:  # leave once some bytes are in
            pass
    partial = next((download.repo_folder(REPO) / "blobs").glob("*.incomplete"))
    deadline = time.monotonic() + 5
    size = -1
    while size != partial.stat().st_size:  # it stops growing once the pull has stopped
        assert time.monotonic() < deadline
        size = partial.stat().st_size
        time.sleep(0.3)
    assert 0 < size < other_model.stat().st_size
    monkeypatch.setattr(download, "http_get", real)
    r = httpx.post(live.url + "/api/pull", json={"model": f"hf.co/{REPO}", "stream": False}, timeout=60)
    assert r.json() == {"status": "success"}
    assert store.gets(FILE)[-1].header("range") == f"bytes={size}-"
    assert registry.resolve_stored(f"hf.co/{REPO}").read_bytes() == other_model.read_bytes()


def test_copy_delete_and_a_request_loads_another_model(live, client, store):
    import ollama

    client.pull(f"hf.co/{REPO}")
    client.copy(f"hf.co/{REPO}:Q4_K_M", "other")
    assert "other" in [m.model for m in client.list().models]
    # the named model is loaded for the request and replaces the served one (max_models 1)
    answer = client.generate(model="other", prompt="hi", options={"num_predict": 2, "temperature": 0})
    assert answer.done and answer.model == "other"  # the answering model's name, not the served one's
    running = client.ps().models
    assert [m.model for m in running] == ["other"] and running[0].context_length == 128
    assert client.generate(model=MODEL, prompt="hi", options={"num_predict": 1}).model == MODEL
    assert [m.model for m in client.ps().models] == [MODEL]
    # OpenAI: retrieve knows served and stored names, 404 with OpenAI's shape otherwise
    import openai

    oa = openai.OpenAI(base_url=live.url + "/v1", api_key="x")
    assert oa.models.retrieve("other").id == "other"
    assert oa.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as e:
        oa.models.retrieve("gpt-4o")
    assert e.value.body["code"] == "model_not_found"
    # delete forgets the name only; the pulled file stays
    client.delete("other")
    assert "other" not in [m.model for m in client.list().models]
    assert registry.resolve_stored(f"hf.co/{REPO}") is not None
    with pytest.raises(ollama.ResponseError) as e:
        client.delete("other")
    assert e.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model="other", prompt="hi")
    assert e.value.status_code == 404


def test_max_models_keeps_two_resident(store, fim_model_path, other_model):
    from test_server import load_tiny

    model_names.save(model_names.NamedModel("other", str(other_model)))
    srv = start_server(load_tiny(fim_model_path), model_options=OPTIONS, max_models=2, keep_alive_s=300)
    try:
        import ollama

        client = ollama.Client(host=srv.url)
        client.chat(model="other", messages=[{"role": "user", "content": "hi"}], options={"num_predict": 1})
        running = {m.model: m for m in client.ps().models}
        assert set(running) == {MODEL, "other"}
        assert running["other"].expires_at.year < 9999  # keep_alive 300 s: a real expiry
    finally:
        srv.stop()


def test_create_from_a_gguf_path_with_modelfile_settings(live, client, other_model, tmp_path):
    import ollama

    client.create("mine", from_=str(other_model), system="Be brief.", parameters={"temperature": 0.0})
    row = model_names.lookup("mine")
    assert row.path == str(other_model.resolve()) and row.system == "Be brief."
    r = httpx.post(live.url + "/api/create", json={"model": "mf", "stream": False, "modelfile":
                   f'FROM {other_model}\nPARAMETER temperature 0\nPARAMETER stop "<end>"\n'
                   'SYSTEM """You are\nterse."""\nLICENSE MIT\n'}, timeout=30)
    assert r.json() == {"status": "success"}
    row = model_names.lookup("mf")
    assert row.system == "You are\nterse." and row.parameters == {"temperature": 0, "stop": ["<end>"]}
    show = client.show("mf")
    assert show.license == "MIT" and "temperature 0" in show.parameters
    # a copy of a created model keeps its settings
    client.copy("mf", "mf2")
    assert model_names.lookup("mf2").system == "You are\nterse."
    # the file must exist, be a regular .gguf and really a GGUF
    not_gguf = tmp_path / "x.gguf"
    not_gguf.write_bytes(b"not a gguf file")
    for bad in ("relative/x.gguf", str(tmp_path / "missing.gguf"), str(tmp_path), str(not_gguf), "/etc/passwd"):
        with pytest.raises(ollama.ResponseError) as e:
            client.create("bad", from_=bad)
        assert e.value.status_code in (400, 404) and "\n" not in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.create("bad", from_=str(other_model), template="{{ .System }} {{ .Prompt }}")
    assert e.value.status_code == 400 and "Go templates" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.create("bad", from_=str(other_model), parameters={"mirostat": 2})
    assert e.value.status_code == 400
    assert model_names.lookup("bad") is None


BAD_NAMES = ["../evil", "/etc/passwd", "a/../../b", "a\x00b", "..", ".hidden", "a" * 300, "C:\\x", "x/y",
             "name:", "~root", "a b"]


@pytest.mark.parametrize("bad", BAD_NAMES)
def test_names_never_become_paths(live, bad, other_model, tmp_path):
    home_before = sorted(p.name for p in (tmp_path / "home").rglob("*")) if (tmp_path / "home").exists() else []
    with httpx.Client(base_url=live.url, timeout=30) as c:
        assert c.post("/api/copy", json={"source": MODEL, "destination": bad}).status_code == 400
        assert c.post("/api/create", json={"model": bad, "from": str(other_model)}).status_code == 400
        assert c.request("DELETE", "/api/delete", json={"model": bad}).status_code in (400, 404)
        assert c.post("/api/pull", json={"model": bad}).status_code in (400, 404)
        assert c.post("/api/copy", json={"source": bad, "destination": "ok"}).status_code in (400, 404)
        r = c.post("/api/generate", json={"model": bad, "prompt": "hi"})
        assert r.status_code == 404 and "\n" not in r.json()["error"]
    home_after = sorted(p.name for p in (tmp_path / "home").rglob("*")) if (tmp_path / "home").exists() else []
    assert home_after == home_before


def test_store_changes_need_loopback_or_an_api_key(store, fim_model_path, other_model):
    from test_server import load_tiny

    model = load_tiny(fim_model_path)
    srv = start_server(model, bind_host="0.0.0.0", model_options=OPTIONS)
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            for method, path, body in [("POST", "/api/pull", {"model": f"hf.co/{REPO}"}),
                                       ("DELETE", "/api/delete", {"model": "x"}),
                                       ("POST", "/api/copy", {"source": MODEL, "destination": "x"}),
                                       ("POST", "/api/create", {"model": "x", "from": str(other_model)})]:
                r = c.request(method, path, json=body)
                assert r.status_code == 403 and "--api-key" in r.json()["error"]
            assert c.get("/api/tags").status_code == 200
    finally:
        srv.stop()
    srv = start_server(model, bind_host="0.0.0.0", api_key="k", model_options=OPTIONS)
    try:
        r = httpx.post(srv.url + "/api/copy", json={"source": MODEL, "destination": "x"},
                       headers={"Authorization": "Bearer k"}, timeout=30)
        assert r.status_code == 200
    finally:
        srv.stop()


def test_modelfile_parser():
    from edgeinfer.store.modelfile import ModelfileError, parse

    mf = parse('# comment\nfrom ./m.gguf\nTEMPLATE "{{ x }}"\nparameter top_k 20\nPARAMETER stop a\n'
               'PARAMETER stop "b c"\nSYSTEM plain words\n')
    assert (mf.from_, mf.template, mf.system) == ("./m.gguf", "{{ x }}", "plain words")
    assert mf.parameters == {"top_k": 20, "stop": ["a", "b c"]}
    for bad in ('SYSTEM """never closed', "ADAPTER x.bin", "WHAT x", "PARAMETER top_k"):
        with pytest.raises(ModelfileError):
            parse(bad)


def test_a_request_for_a_model_still_loading_gets_503_with_retry_after(store, fim_model_path, other_model,
                                                                        monkeypatch):
    import edgeinfer
    from test_server import load_tiny

    real = edgeinfer.load

    def slow_load(*args, **kwargs):
        time.sleep(1.0)
        return real(*args, **kwargs)

    model_names.save(model_names.NamedModel("other", str(other_model)))
    srv = start_server(load_tiny(fim_model_path), model_options=OPTIONS, load_wait_s=0.2)
    monkeypatch.setattr(edgeinfer, "load", slow_load)
    try:
        body = {"model": "other", "prompt": "hi", "stream": False, "options": {"num_predict": 1}}
        r = httpx.post(srv.url + "/api/generate", json=body, timeout=30)
        assert r.status_code == 503 and r.headers["retry-after"] and "loading" in r.json()["error"]
        time.sleep(1.5)  # the load went on without the request
        assert httpx.post(srv.url + "/api/generate", json=body, timeout=30).status_code == 200
    finally:
        srv.stop()


def test_pull_of_a_split_model_fetches_every_part_as_its_layers(live, store, other_model, tmp_path):
    from gguf_split_factory import split_gguf

    parts = split_gguf(other_model, tmp_path / "parts", "big-Q8_0", 3)
    for part in parts:
        store.add_file("acme/Big-GGUF", part.name, part.read_bytes())
    lines = [json.loads(x) for x in httpx.post(live.url + "/api/pull", json={"model": "hf.co/acme/Big-GGUF"},
                                               timeout=60).text.splitlines()]
    assert lines[-1] == {"status": "success"}
    digests = {x["digest"] for x in lines if "digest" in x}
    assert len(digests) == 3  # one layer a part, each reported to its end
    for d in digests:
        assert any(x.get("digest") == d and x["completed"] == x["total"] for x in lines)
    path = registry.resolve_stored("hf.co/acme/Big-GGUF")
    assert path is not None and path.name == parts[0].name
    from edgeinfer.gguf_file import GGUFFile

    assert GGUFFile.open(path).file_size == sum(p.stat().st_size for p in parts)
