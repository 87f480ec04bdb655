"""Safe-by-default checks that run before any endpoint: Host, Origin, API key, body size.

- Host allow-list against DNS rebinding (Ollama CVE-2024-28224): a page on evil.example
  that re-points its name at 127.0.0.1 still sends `Host: evil.example`, so it gets 403.
- Origin: browsers send it on cross-site requests; a page from a foreign origin may not
  even make "simple" POSTs (no preflight) unless `--cors-origin` allows that origin.
- Optional Bearer API key; `/health` stays open so supervisors can probe it.
- Body size: a declared Content-Length over the limit is refused before it is read
  (the endpoints also count the bytes of chunked bodies).
"""

from __future__ import annotations

import hmac
import json
from typing import Iterable
from urllib.parse import urlsplit

from edgeinfer.server.errors import error_body

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
# Origins of local apps and editor webviews, which Ollama also lets in.
LOCAL_ORIGIN_SCHEMES = ("app", "file", "tauri", "vscode-webview", "vscode-file")
OPEN_PATHS = ("/health",)


def host_name(host_header: str) -> str:
    """`Host` header -> bare lower-case name: port and IPv6 brackets removed."""
    h = host_header.strip().lower()
    if h.startswith("["):
        end = h.find("]")
        return h[1:end] if end > 0 else h
    if h.count(":") == 1:
        h = h.split(":", 1)[0]
    return h.rstrip(".")


class SecurityMiddleware:
    """Pure ASGI middleware (streams pass through untouched)."""

    def __init__(self, app, *, allowed_hosts: Iterable[str] = (), api_key: str | None = None,
                 cors_origins: Iterable[str] = (), max_body_bytes: int = 2 << 20,
                 on_response=None) -> None:
        self.app = app
        extra = {host_name(h) for h in allowed_hosts}
        self.any_host = "*" in extra
        self.allowed_hosts = set(LOOPBACK_HOSTS) | extra
        self.api_key = api_key.encode() if api_key else None
        self.cors_origins = {o.rstrip("/") for o in cors_origins}
        self.max_body_bytes = max_body_bytes
        self.on_response = on_response  # (path, status) -> None, for the request metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        refusal = self.check(scope.get("method", "GET"), path, headers)

        status_seen = []

        async def send_and_count(message) -> None:
            if message["type"] == "http.response.start":
                status_seen.append(message["status"])
            await send(message)

        try:
            if refusal is not None:
                status, message, extra_headers = refusal
                await _send_json(send_and_count, status, error_body(path, status, message), extra_headers)
            else:
                await self.app(scope, receive, send_and_count)
        finally:
            if self.on_response is not None:
                self.on_response(path, status_seen[0] if status_seen else 499)

    def check(self, method: str, path: str, headers: dict[str, str]):
        """(status, message, headers) for a request to refuse, else None."""
        host = headers.get("host")
        if host is None:
            return 403, "missing Host header", {}
        if not self.any_host and host_name(host) not in self.allowed_hosts:
            return 403, (f"host {host_name(host)!r} is not allowed; start the server with "
                         f"--allowed-host {host_name(host)} to allow it"), {}
        origin = headers.get("origin")
        if origin is not None and not self.origin_allowed(origin):
            return 403, f"origin {origin!r} is not allowed; start the server with --cors-origin to allow it", {}
        preflight = method == "OPTIONS" and "access-control-request-method" in headers
        if self.api_key is not None and path not in OPEN_PATHS and not preflight:
            auth = headers.get("authorization", "")
            scheme, _, token = auth.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key):
                return 401, "missing or wrong API key (send Authorization: Bearer KEY)", \
                    {"www-authenticate": "Bearer"}
        length = headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                return 400, "bad Content-Length header", {}
            if int(length) > self.max_body_bytes:
                return 413, f"request body is larger than {self.max_body_bytes} bytes", {}
        return None

    def origin_allowed(self, origin: str) -> bool:
        o = origin.rstrip("/")
        if "*" in self.cors_origins or o in self.cors_origins:
            return True
        parts = urlsplit(o)
        if parts.scheme in LOCAL_ORIGIN_SCHEMES:
            return True
        return parts.scheme in ("http", "https") and (parts.hostname or "") in LOOPBACK_HOSTS


async def _send_json(send, status: int, body: dict, headers: dict[str, str]) -> None:
    data = json.dumps(body).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    raw += [(k.encode(), v.encode()) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": data})
