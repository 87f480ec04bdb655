"""Safe-by-default checks that run before any endpoint: Host, Origin, API key, body size.

- Host allow-list against DNS rebinding (Ollama CVE-2024-28224): a page on evil.example
  that re-points its name at 127.0.0.1 still sends `Host: evil.example`, so it gets 403.
  The header is parsed strictly (name or [IPv6], optional port 1-65535, nothing else):
  a lenient split would let `localhost:80@evil.example` pass as "localhost".
- Origin: browsers send it on cross-site requests; a page from an origin the policy (cors.py)
  does not allow may not even make "simple" POSTs (no preflight): 403. Its preflight is answered
  200 without CORS headers, as llama-server answers it, which the browser takes as a refusal.
- Optional Bearer API key; `/health` stays open so supervisors can probe it.
- Body size: a declared Content-Length over the limit is refused before it is read
  (the endpoints also count the bytes of chunked bodies).
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import re
from typing import Iterable

from starlette.requests import ClientDisconnect

from edgeinfer.server.cors import origin_policy
from edgeinfer.server.errors import error_body

log = logging.getLogger("edgeinfer.server")

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
OPEN_PATHS = ("/health",)


_NAME = re.compile(r"[a-z0-9_-]+(\.[a-z0-9_-]+)*\.?")
_PORT = re.compile(r"[0-9]{1,5}")


class BadHost(ValueError):
    """A Host header that is not `name[:port]` or `[IPv6][:port]`."""


def parse_host(header: str) -> tuple[str, int | None]:
    """`Host` header -> (lower-case name without brackets or trailing dot, port or None).

    Raises BadHost for anything else: userinfo, paths, spaces, text after `]`, empty,
    non-numeric or out-of-range ports.
    """
    h = header.lower()
    if h.startswith("["):
        end = h.find("]")
        if end < 0:
            raise BadHost("unclosed '[' in Host header")
        name, rest = h[1:end], h[end + 1:]
        try:
            ipaddress.IPv6Address(name)
        except ValueError:
            raise BadHost(f"{name!r} in brackets is not an IPv6 address") from None
        if rest and not rest.startswith(":"):
            raise BadHost(f"unexpected {rest!r} after the IPv6 address")
    else:
        name, colon, port_text = h.partition(":")
        rest = colon + port_text
        if not _NAME.fullmatch(name):
            raise BadHost(f"{header!r} is not a host name")
        name = name.rstrip(".")
    port = None
    if rest:
        port_text = rest[1:]
        if not _PORT.fullmatch(port_text) or not 1 <= int(port_text) <= 65535:
            raise BadHost(f"bad port {port_text!r} in Host header")
        port = int(port_text)
    return name, port


def host_name(host_header: str) -> str:
    """`Host` header -> bare lower-case name; BadHost when malformed."""
    return parse_host(host_header.strip())[0]


def allowed_name(value: str) -> str:
    """An --allowed-host value (a name, an address, an IPv6 address with or without
    brackets, '*') as the name parse_host gives."""
    v = value.strip().lower()
    if v == "*":
        return v
    try:
        return str(ipaddress.ip_address(v.strip("[]")))
    except ValueError:
        return host_name(v)


class SecurityMiddleware:
    """Pure ASGI middleware (streams pass through untouched)."""

    def __init__(self, app, *, allowed_hosts: Iterable[str] = (), api_key: str | None = None,
                 cors_origins: Iterable[str] = (), max_body_bytes: int = 2 << 20,
                 on_response=None) -> None:
        self.app = app
        extra = {allowed_name(h) for h in allowed_hosts}
        self.any_host = "*" in extra
        self.allowed_hosts = set(LOOPBACK_HOSTS) | extra
        self.api_key = api_key.encode() if api_key else None
        self.origins = origin_policy(cors_origins)
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
                if message is None:   # a refused preflight: an empty 200
                    await send_and_count({"type": "http.response.start", "status": status,
                                          "headers": [(b"content-length", b"0")]})
                    await send_and_count({"type": "http.response.body", "body": b""})
                else:
                    await _send_json(send_and_count, status, error_body(path, status, message), extra_headers)
            else:
                await self.app(scope, receive, send_and_count)
        except ClientDisconnect:
            # the client left while sending its body: one line, not a traceback
            log.info("%s %s: the client disconnected while sending the request body",
                     scope.get("method", "?"), path)
        finally:
            if self.on_response is not None:
                self.on_response(path, status_seen[0] if status_seen else 499)

    def check(self, method: str, path: str, headers: dict[str, str]):
        """(status, message, headers) for a request to refuse, else None."""
        host = headers.get("host")
        if host is None:
            return 403, "missing Host header", {}
        try:
            name, _port = parse_host(host)
        except BadHost as exc:
            return 400, f"malformed Host header: {exc}", {}
        if not self.any_host and name not in self.allowed_hosts:
            return 403, (f"host {name!r} is not allowed; start the server with "
                         f"--allowed-host {name} to allow it"), {}
        origin = headers.get("origin")
        preflight = method == "OPTIONS" and "access-control-request-method" in headers
        if origin is not None and not self.origin_allowed(origin):
            log.info("refused the origin %r (serve --cors-origin allows it)", origin[:200])
            if preflight:   # no CORS headers: the browser refuses the request it asked about
                return 200, None, {}
            return 403, f"origin {origin!r} is not allowed; start the server with --cors-origin to allow it", {}
        if self.api_key is not None and path not in OPEN_PATHS and not preflight:
            auth = headers.get("authorization", "")
            scheme, _, token = auth.partition(" ")
            if "authorization" not in headers and "x-api-key" in headers:   # llama-server takes it too
                scheme, token = "bearer", headers["x-api-key"]
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key):
                return 401, "missing or wrong API key (send Authorization: Bearer KEY or X-Api-Key: KEY)", \
                    {"www-authenticate": "Bearer"}
        length = headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                return 400, "bad Content-Length header", {}
            if int(length) > self.max_body_bytes:
                return 413, (f"request body is larger than {self.max_body_bytes} bytes "
                             "(serve --max-body raises the limit)"), {}
        return None

    def origin_allowed(self, origin: str) -> bool:
        return self.origins.allows(origin)


async def _send_json(send, status: int, body: dict, headers: dict[str, str]) -> None:
    data = json.dumps(body).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    raw += [(k.encode(), v.encode()) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": data})
