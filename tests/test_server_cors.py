"""Cross-origin requests (#58): pages on this machine and local apps get CORS headers by
default, every other origin none; --cors-origin and OLLAMA_ORIGINS add origins ('localhost',
'*', patterns, 'none'); the Host check against DNS rebinding runs first, whatever CORS allows."""

from __future__ import annotations

import httpx
import pytest

from edgeinfer.server.cors import BadOrigin, configured_origins, ollama_origins, origin_policy
from test_server import fim_model_path, load_tiny, start_server  # noqa: F401 - a fixture

LOCAL = ["http://localhost:3000", "http://127.0.0.1:5173", "http://[::1]:8080", "vscode-webview://abc",
         "https://localhost", "http://localhost", "http://[::1]", "http://0.0.0.0:8080", "app://obsidian.md",
         "file://", "tauri://localhost", "vscode-file://vscode-app", "HTTP://LOCALHOST:3000"]
FOREIGN = ["http://evil.com", "http://localhost.evil.com", "http://notlocalhost", "https://127.0.0.1.nip.io",
           "null", "localhost", "http://localhost:80@evil.com", "http://localhost:99999", "http://localhost:",
           "ftp://localhost", "http://127.0.0.2:3000", "http://[::2]:80", "chrome-extension://abc", ""]


@pytest.mark.parametrize("origin", LOCAL)
def test_local_origins_are_allowed_by_default(origin):
    assert origin_policy().allows(origin)


@pytest.mark.parametrize("origin", FOREIGN)
def test_other_origins_are_refused_by_default(origin):
    assert not origin_policy().allows(origin)


def test_cors_origin_adds_origins_and_patterns():
    p = origin_policy(["https://chat.example/", "https://*.corp.example,localhost", "chrome-extension://*"])
    assert p.allows("https://chat.example") and p.allows("https://chat.example/")
    assert p.allows("https://a.corp.example") and p.allows("chrome-extension://abcdef")
    assert p.allows("http://localhost:3000")          # the defaults stay
    assert not p.allows("http://chat.example") and not p.allows("https://corp.example.evil")
    assert not origin_policy(["http://a*a"]).allows("http://a")   # prefix and suffix may not overlap
    anyone = origin_policy(["*"])
    assert anyone.any and anyone.allows("http://evil.com") and anyone.allows("null")


def test_cors_origin_none_refuses_everything():
    p = origin_policy(["none"])
    assert not any(p.allows(o) for o in LOCAL)
    assert not origin_policy(["NONE"]).allows("http://localhost:3000")
    with pytest.raises(BadOrigin, match="none"):
        origin_policy(["none", "http://a.example"])


@pytest.mark.parametrize("value,needle", [("chat.example", "not an origin"), ("http://", "not an origin"),
                                          ("http://*.a.*", "more than one"), ("none,localhost", "none")])
def test_bad_origins_are_named(value, needle):
    with pytest.raises(BadOrigin, match=needle) as e:
        origin_policy([value])
    assert "\n" not in str(e.value)


def test_ollama_origins_read_as_ollama_reads_them():
    assert ollama_origins(None) == [] and ollama_origins("") == [] and ollama_origins("  ") == []
    assert ollama_origins(' "http://a.example, https://*.b.example ,," ') == ["http://a.example",
                                                                           "https://*.b.example"]
    assert ollama_origins("'*'") == ["*"]
    # the defaults are always in, as in Ollama; the env adds to --cors-origin, unless that says none
    assert configured_origins(["http://c.example"], "http://a.example") == ["http://c.example", "http://a.example"]
    assert configured_origins(["none"], "http://a.example") == ["none"]
    p = origin_policy(configured_origins([], "http://a.example,moz-extension://*"))
    assert p.allows("http://a.example") and p.allows("moz-extension://x") and p.allows("tauri://localhost")


def test_serve_reads_ollama_origins_and_names_a_bad_one(monkeypatch):
    from edgeinfer.commands import serve
    from edgeinfer.errors import EdgeInferError

    monkeypatch.setenv("OLLAMA_ORIGINS", "https://chat.example")
    assert serve._origins(["http://x.example"]) == ["http://x.example", "https://chat.example"]
    monkeypatch.setenv("OLLAMA_ORIGINS", "chat.example")
    with pytest.raises(EdgeInferError, match=r"^\$OLLAMA_ORIGINS: 'chat.example' is not an origin"):
        serve._origins([])
    monkeypatch.delenv("OLLAMA_ORIGINS")
    with pytest.raises(EdgeInferError, match=r"^--cors-origin: 'none' refuses every origin"):
        serve._origins(["none", "localhost"])


def test_a_bad_cors_origin_stops_serve_with_one_line(capsys, tmp_path):
    from edgeinfer.cli import main

    assert main(["serve", str(tmp_path / "m.gguf"), "--cors-origin", "chat.example"]) == 1
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [("edgeinfer: error: --cors-origin: 'chat.example' is not an origin: "
                                         "give scheme://host[:port] (a '*' may stand for a part), 'localhost', "
                                         "'*' or 'none'")]


# -- on the wire -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def live(fim_model_path):  # noqa: F811
    srv = start_server(load_tiny(fim_model_path))   # no --cors-origin: the defaults
    yield srv
    srv.stop()


def preflight(c: httpx.Client, origin: str, path: str = "/v1/chat/completions", **headers) -> httpx.Response:
    return c.options(path, headers={"origin": origin, "access-control-request-method": "POST",
                                    "access-control-request-headers": "authorization,content-type", **headers})


@pytest.mark.parametrize("origin", ["http://localhost:3000", "http://127.0.0.1:5173", "http://[::1]:8080",
                                    "vscode-webview://abc"])
def test_local_origins_get_the_cors_headers_by_default(live, origin):
    with httpx.Client(base_url=live.url, timeout=30) as c:
        pre = preflight(c, origin)
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == origin
        assert pre.headers["access-control-allow-methods"] == "GET, POST, DELETE, OPTIONS"
        assert pre.headers["access-control-allow-headers"] == "authorization,content-type"
        # spelled as llama-server writes them, for clients that read headers into a plain dict
        assert (b"Access-Control-Allow-Origin", origin.encode()) in pre.headers.raw
        r = c.post("/v1/chat/completions", headers={"origin": origin},
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
        assert "origin" in r.headers["vary"].lower()
        assert (b"Access-Control-Allow-Origin", origin.encode()) in r.headers.raw


@pytest.mark.parametrize("origin", ["http://evil.com", "http://localhost.evil.com"])
def test_other_origins_get_no_cors_headers(live, origin):
    with httpx.Client(base_url=live.url, timeout=30) as c:
        pre = preflight(c, origin)   # answered, as llama-server does, but with nothing that lets it in
        assert pre.status_code == 200 and not any(h.startswith("access-control-") for h in pre.headers)
        r = c.post("/v1/chat/completions", headers={"origin": origin},
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
        assert origin in r.json()["error"]["message"] and "--cors-origin" in r.json()["error"]["message"]


@pytest.mark.parametrize("cors", [[], ["*"]])
def test_dns_rebinding_host_is_still_refused(fim_model_path, cors):  # noqa: F811
    srv = start_server(load_tiny(fim_model_path), cors_origins=cors)
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            for origin in ("http://localhost:3000", "http://evil.example"):
                headers = {"host": "evil.example", "origin": origin}
                r = c.get("/v1/models", headers=headers)
                assert r.status_code == 403 and "host 'evil.example' is not allowed" in r.json()["error"]["message"]
                pre = preflight(c, origin, host="evil.example")
                assert pre.status_code == 403 and "access-control-allow-origin" not in pre.headers
    finally:
        srv.stop()


def test_cors_origin_none_and_added_origins_on_the_wire(fim_model_path):  # noqa: F811
    model = load_tiny(fim_model_path)
    srv = start_server(model, cors_origins=["none"])
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            assert "access-control-allow-origin" not in preflight(c, "http://localhost:3000").headers
            assert c.get("/v1/models", headers={"origin": "http://localhost:3000"}).status_code == 403
            assert c.get("/v1/models").status_code == 200   # no Origin: not a browser's cross-origin call
    finally:
        srv.stop()
    srv = start_server(model, cors_origins=["https://*.corp.example"])
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            r = c.get("/v1/models", headers={"origin": "https://chat.corp.example"})
            assert r.headers["access-control-allow-origin"] == "https://chat.corp.example"
            assert c.get("/v1/models", headers={"origin": "http://127.0.0.1:3000"}).status_code == 200
    finally:
        srv.stop()
