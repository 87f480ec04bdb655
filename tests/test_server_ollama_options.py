"""Ollama's options as Ollama treats them (null is unset; load-time options reload the model),
Ollama's durations, and the OpenAPI contract checked by schemathesis."""

from __future__ import annotations

import logging
import time

import httpx
import pytest

import edgeinfer
from edgeinfer.server import ServerConfig, create_app
from test_server import MODEL, fim_model_path, load_tiny, serve, start_server  # noqa: F401 - a fixture

# what langchain-ollama's OllamaEmbeddings and ChatOllama send with their defaults
LANGCHAIN_OPTIONS = {"mirostat": None, "mirostat_eta": None, "mirostat_tau": None, "num_ctx": None,
                     "num_gpu": None, "num_thread": None, "num_predict": None, "repeat_last_n": None,
                     "repeat_penalty": None, "temperature": None, "stop": None, "tfs_z": None, "top_k": None,
                     "top_p": None, "seed": None}


def reloadable_server(path, **config):
    """A server whose model has a loader, as `edgeinfer serve` has: it can be reloaded."""
    import uvicorn

    loads = []

    def loader(**overrides):
        loads.append(overrides)
        return edgeinfer.load(str(path), **{"backend": "reference", "n_ctx": 128, **overrides})

    config.setdefault("model_name", MODEL)
    config.setdefault("sampling", {"temperature": 0.0, "max_tokens": 2})
    app = create_app(ServerConfig(**config), loader=loader)
    app.state.server.set_model(loader())
    srv = serve(app, uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    return srv, loads


@pytest.fixture(scope="module")
def live(fim_model_path):
    srv, loads = reloadable_server(fim_model_path)
    srv.loads = loads
    yield srv
    srv.stop()


def test_null_options_are_unset(live):
    """langchain-ollama sends every option, most null: was `400 unsupported field 'options.mirostat_eta'`."""
    for path, body in (("/api/generate", {"prompt": "hi", "stream": False}),
                       ("/api/chat", {"messages": [{"role": "user", "content": "hi"}], "stream": False}),
                       ("/api/embed", {"input": "hi"})):
        r = httpx.post(live.url + path, json={"model": MODEL, **body, "options": LANGCHAIN_OPTIONS}, timeout=60)
        assert r.status_code == 200, (path, r.text)


def test_options_without_effect_are_accepted_and_logged_once(live, caplog):
    caplog.set_level(logging.INFO, logger="edgeinfer.server")
    r = httpx.post(live.url + "/api/generate", timeout=60, json={
        "model": MODEL, "prompt": "hi", "stream": False,
        "options": {"use_mmap": False, "use_mlock": True, "numa": True, "mirostat_eta": 0.1}})
    assert r.status_code == 200, r.text
    lines = [rec.getMessage() for rec in caplog.records if "change nothing" in rec.getMessage()]
    assert len(lines) == 1 and "use_mmap=false" in lines[0] and "use_mlock=true" in lines[0]


def test_load_time_options_reload_the_model(live):
    """num_ctx above the loaded context was a 400; num_batch, num_thread, num_gpu were refused."""
    url = live.url
    assert httpx.get(url + "/api/ps").json()["models"][0]["context_length"] == 128
    body = {"model": MODEL, "prompt": "hi", "stream": False, "options": {"num_ctx": 256, "num_batch": 8}}
    r = httpx.post(url + "/api/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert live.loads[-1] == {"n_ctx": 256, "prefill_chunk": 8}
    assert httpx.get(url + "/api/ps").json()["models"][0]["context_length"] == 256
    n = len(live.loads)
    assert httpx.post(url + "/api/generate", json=body, timeout=60).status_code == 200
    assert len(live.loads) == n  # the same settings again: no reload
    r = httpx.post(url + "/api/chat", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": False,
        "options": {"num_thread": 1, "num_gpu": 0}})
    assert r.status_code == 200, r.text
    assert live.loads[-1] == {"n_ctx": 256, "prefill_chunk": 8, "threads": 1, "gpu_layers": 0}
    # past what the model was trained for: a 400 naming the field and the trained context
    trained = httpx.post(url + "/api/show", json={"model": MODEL}).json()["model_info"]["llama.context_length"]
    r = httpx.post(url + "/api/generate", timeout=60, json={**body, "options": {"num_ctx": trained + 1}})
    assert r.status_code == 400 and "trained context" in r.json()["error"]


def test_total_duration_is_what_ollama_reports(fim_model_path, monkeypatch):
    """total_duration counted the time waiting behind other requests (186 s for one token)."""
    srv = start_server(load_tiny(fim_model_path))
    try:
        model = srv.state.model
        real = model.generate

        def slow(*args, **kwargs):  # a request ahead holds the worker for 1.5 s
            if args and args[0] == "slow":
                time.sleep(1.5)
            return real(*args, **kwargs)

        monkeypatch.setattr(model, "generate", slow)
        import threading

        t = threading.Thread(target=httpx.post, args=(srv.url + "/completion",),
                             kwargs={"json": {"prompt": "slow", "n_predict": 1}, "timeout": 30})
        t.start()
        time.sleep(0.2)
        r = httpx.post(srv.url + "/api/generate", json={"model": MODEL, "prompt": "hi", "raw": True, "stream": False,
                                                        "options": {"num_predict": 1}}, timeout=30).json()
        t.join()
        parts = r["load_duration"] + r["prompt_eval_duration"] + r["eval_duration"]
        assert r["total_duration"] == pytest.approx(parts, abs=1e6)
        assert r["total_duration"] < 1.0e9  # the 1.3 s it waited is not in it
    finally:
        srv.stop()


def test_openapi_contract_with_schemathesis(live, monkeypatch):
    """/openapi.json for the three dialects (was 404), and schemathesis against it: no 5xx, and
    responses as documented. Bounded: one derandomized example an operation and no shrinking
    (a failure is reported as found, not minimized over hundreds of requests), the store and
    the network left out (/api/tags lists only the served model: not every GGUF of this
    machine's cache, whose metadata it would read), a short timeout a request."""
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings

    from edgeinfer.store import registry

    monkeypatch.setattr(registry, "list_local", lambda: [])
    from schemathesis.checks import not_a_server_error
    from schemathesis.openapi.checks import JsonSchemaError  # noqa: F401 - the schema check's failure type

    doc = httpx.get(live.url + "/openapi.json", timeout=30).json()
    for path in ("/v1/chat/completions", "/api/chat", "/completion", "/api/generate", "/infill"):
        assert "requestBody" in doc["paths"][path]["post"], path
    schema = schemathesis.openapi.from_dict(doc)
    from schemathesis.specs.openapi.checks import response_schema_conformance

    checked = 0
    for result in schema.get_all_operations():
        op = result.ok()
        if op.path in ("/api/pull", "/api/delete", "/api/create", "/api/copy"):
            continue  # the store and the network: covered by test_server_models
        if op.path == "/slots/{id_slot}":
            continue  # 501 without --slot-save-path, as llama-server answers: covered by test_server_slots
        if op.path in ("/v1/rerank", "/rerank", "/v1/reranking", "/reranking"):
            continue  # 501 without --rerank, as llama-server answers: covered by test_rerank

        @given(case=op.as_strategy())
        @settings(max_examples=1, deadline=None, database=None, derandomize=True, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        def run(case):
            if isinstance(case.body, dict):
                case.body["stream"] = False  # a whole answer to validate
                for key in ("max_tokens", "n_predict", "max_completion_tokens"):
                    case.body.pop(key, None)
                if isinstance(case.body.get("options"), dict):
                    case.body["options"] = {}  # load-time options would reload the model each time
            response = case.call(base_url=live.url, timeout=20)
            case.validate_response(response, checks=[not_a_server_error, response_schema_conformance])

        run()
        checked += 1
    assert checked >= 20
