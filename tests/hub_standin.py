"""A local stand-in for the Hugging Face Hub: enough of its HTTP protocol for huggingface_hub.

Serves, for the repos it is given:
  HEAD/GET /{owner}/{repo}/resolve/{revision}/{path}   file bytes, honouring `Range`, with the
      headers huggingface_hub reads (X-Repo-Commit, ETag, X-Linked-Etag, X-Linked-Size,
      Content-Length, Accept-Ranges).
  GET /api/models/{owner}/{repo}/tree/{revision}        file listing with sizes and LFS sha256.
  GET /api/models/{owner}/{repo}[/revision/{rev}]       model info with `siblings`.
Unknown repos and files answer 404 with the `X-Error-Code` the Hub uses.

Faults, for tests: `cut_after` (close the connection once the file offset reaches N bytes, for the
next `cuts` GETs) and `corrupt` (flip bytes in the body, headers keep the true sha256 and size).
Every request is recorded in `requests` as (method, path, headers).
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]  # names lower-cased

    def header(self, name: str) -> str | None:
        return self.headers.get(name.lower())


@dataclass
class HubStandin:
    repos: dict[str, dict[str, bytes]] = field(default_factory=dict)
    cut_after: int | None = None
    cuts: int = 0
    corrupt: bool = False
    requests: list[Request] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle --
    def start(self) -> "HubStandin":
        handler = type("Handler", (_Handler,), {"hub": self})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    # -- data --
    def add_file(self, repo_id: str, path: str, data: bytes) -> None:
        self.repos.setdefault(repo_id, {})[path] = data

    def commit(self, repo_id: str) -> str:
        return hashlib.sha1(repo_id.encode() + repr(sorted(self.repos[repo_id])).encode()).hexdigest()

    def gets(self, path_suffix: str = "") -> list[Request]:
        return [r for r in self.requests if r.method == "GET" and r.path.endswith(path_suffix)]


def use_standin(monkeypatch, hub: "HubStandin", tmp_path) -> None:
    """Point edgeinfer and huggingface_hub at `hub`, online, with a fresh cache and home under
    `tmp_path` (so a user's assembled demo model stays out of listings)."""
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    for var in ("HF_HUB_CACHE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()


class _Handler(BaseHTTPRequestHandler):
    hub: HubStandin
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # keep pytest output clean
        pass

    def do_HEAD(self) -> None:
        self._route(head=True)

    def do_GET(self) -> None:
        self._route(head=False)

    # -- routing --
    def _route(self, head: bool) -> None:
        path = unquote(urlsplit(self.path).path)
        self.hub.requests.append(Request(self.command, path, {k.lower(): v for k, v in self.headers.items()}))
        if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)(?:/.*)?", path):
            return self._tree(m.group(1), m.group(2))
        if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?", path):
            return self._info(m.group(1))
        if m := re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path):
            return self._resolve(m.group(1), m.group(3), head)
        self._error(404, "EntryNotFound", "no such route")

    def _tree(self, repo_id: str, revision: str) -> None:
        files = self.hub.repos.get(repo_id)
        if files is None:
            return self._error(404, "RepoNotFound", "Repository not found")
        listing = [{"type": "file", "oid": git_blob_sha1(data), "size": len(data), "path": name,
                    "lfs": {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}}
                   for name, data in sorted(files.items())]
        self._json(listing, repo_id)

    def _info(self, repo_id: str) -> None:
        files = self.hub.repos.get(repo_id)
        if files is None:
            return self._error(404, "RepoNotFound", "Repository not found")
        self._json({"id": repo_id, "modelId": repo_id, "sha": self.hub.commit(repo_id), "private": False,
                    "siblings": [{"rfilename": n} for n in sorted(files)]}, repo_id)

    def _resolve(self, repo_id: str, filename: str, head: bool) -> None:
        files = self.hub.repos.get(repo_id)
        if files is None:
            return self._error(404, "RepoNotFound", "Repository not found")
        if filename not in files:
            return self._error(404, "EntryNotFound", "Entry not found", repo_id)
        data = files[filename]
        sha = hashlib.sha256(data).hexdigest()
        start = 0
        if (rng := self.headers.get("Range")) and (m := re.fullmatch(r"bytes=(\d+)-", rng.strip())):
            start = int(m.group(1))
        body = data[start:]
        self.send_response(206 if start else 200)
        self.send_header("X-Repo-Commit", self.hub.commit(repo_id))
        self.send_header("ETag", f'"{sha}"')
        self.send_header("X-Linked-Etag", f'"{sha}"')
        self.send_header("X-Linked-Size", str(len(data)))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(body)))
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.end_headers()
        if head:
            return
        if self.hub.corrupt:
            body = bytes(b ^ 0xFF for b in body[:64]) + body[64:]
        if self.hub.cut_after is not None and self.hub.cuts > 0 and start + len(body) > self.hub.cut_after:
            self.hub.cuts -= 1
            self.wfile.write(body[: max(0, self.hub.cut_after - start)])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)  # the client sees a short body
            return
        self.wfile.write(body)

    # -- helpers --
    def _json(self, payload, repo_id: str) -> None:
        body = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("X-Repo-Commit", self.hub.commit(repo_id))
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _error(self, status: int, code: str, message: str, repo_id: str | None = None) -> None:
        body = json.dumps({"error": message}).encode()
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        if repo_id is not None:
            self.send_header("X-Repo-Commit", self.hub.commit(repo_id))
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
