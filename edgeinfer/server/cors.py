"""Which browser origins may call the server, and the CORS headers that tell the browser so.

By default, as Ollama's OLLAMA_ORIGINS default and llama-server's `--cors-origins localhost`:
pages served from the same machine (http and https, any port: localhost, 127.0.0.1, [::1],
0.0.0.0) and local apps and editor webviews (app://, file://, tauri://, vscode-webview://,
vscode-file://). Every other origin is refused. `--cors-origin` and OLLAMA_ORIGINS add origins:
exact ones, patterns with one `*` (gin-contrib/cors wildcards, as Ollama matches them), `*` for
any, and the keyword `localhost` (the loopback origins, already in). `--cors-origin none`
refuses every cross-origin request.

The policy decides only which *origins* get the headers; the Host check against DNS rebinding
(security.py) runs before it and is never loosened by it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from starlette.middleware.cors import CORSMiddleware

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]", "0.0.0.0")  # 0.0.0.0: in Ollama's default list too
LOCAL_APP_SCHEMES = ("app", "file", "tauri", "vscode-webview", "vscode-file")
METHODS = ("GET", "POST", "DELETE", "OPTIONS")   # llama-server's --cors-methods default
# scheme://host[:port] and nothing else: a browser's Origin never has a path, userinfo or query
_WEB_ORIGIN = re.compile(r"(https?)://(\[[0-9a-f:.]+\]|[a-z0-9.-]+)(?::([0-9]{1,5}))?")


class BadOrigin(ValueError):
    """A --cors-origin or OLLAMA_ORIGINS value that is not an origin, a pattern or a keyword."""


@dataclass(frozen=True)
class OriginPolicy:
    defaults: bool = True                          # loopback pages and local apps
    any: bool = False                              # '*'
    exact: frozenset[str] = frozenset()
    wildcards: tuple[tuple[str, str], ...] = ()    # (prefix, suffix) around a pattern's '*'

    def allows(self, origin: str) -> bool:
        o = origin.strip().rstrip("/").lower()
        if self.any or o in self.exact:
            return True
        if any(len(o) >= len(p) + len(s) and o.startswith(p) and o.endswith(s) for p, s in self.wildcards):
            return True
        return self.defaults and is_local_origin(origin)


def is_local_origin(origin: str) -> bool:
    """A page on this machine (loopback http/https, any port) or a local app's scheme."""
    o = origin.strip().lower()
    scheme, sep, _ = o.partition("://")
    if sep and scheme in LOCAL_APP_SCHEMES:   # file:// included, which a trailing '/' cut would spoil
        return True
    m = _WEB_ORIGIN.fullmatch(o.rstrip("/"))
    return m is not None and m.group(2) in LOOPBACK_NAMES and (m.group(3) is None or 1 <= int(m.group(3)) <= 65535)


def ollama_origins(value: str | None) -> list[str]:
    """OLLAMA_ORIGINS as Ollama reads it: spaces and quotes around it trimmed, split on commas."""
    if value is None:
        return []
    text = value.strip().strip("\"'")
    return [v for v in (part.strip() for part in text.split(",")) if v] if text else []


def configured_origins(flags: Iterable[str], env: str | None) -> list[str]:
    """serve's origins: the --cors-origin values, then OLLAMA_ORIGINS's entries unless the
    flags say `none` (which refuses every origin, those included)."""
    flags = list(flags)
    if any(v.strip().lower() == "none" for value in flags for v in value.split(",")):
        return flags
    return flags + ollama_origins(env)


def origin_policy(values: Iterable[str] = ()) -> OriginPolicy:
    """The policy for these origins (each value may hold several, comma-separated, as
    llama-server's --cors-origins and OLLAMA_ORIGINS do); BadOrigin names a bad one."""
    values = [v.strip() for value in values for v in value.split(",") if v.strip()]
    if any(v.lower() == "none" for v in values):
        if len(values) > 1:
            raise BadOrigin("'none' refuses every origin: it cannot go with other origins")
        return OriginPolicy(defaults=False)
    exact, wildcards, any_origin = set(), [], False
    for v in values:
        v = v.strip().rstrip("/").lower()
        if v == "*":
            any_origin = True
        elif v == "localhost":   # llama-server's keyword: every loopback origin (the default's)
            continue
        elif "*" in v:
            if v.count("*") > 1:
                raise BadOrigin(f"origin pattern {v!r} has more than one '*'")
            i = v.index("*")
            wildcards.append((v[:i], v[i + 1:]))
        elif "://" not in v or v.endswith("://"):
            raise BadOrigin(f"{v!r} is not an origin: give scheme://host[:port] (a '*' may stand for a part), "
                            "'localhost', '*' or 'none'")
        else:
            exact.add(v)
    return OriginPolicy(any=any_origin, exact=frozenset(exact), wildcards=tuple(wildcards))


class CORS(CORSMiddleware):
    """Starlette's CORS headers for the origins the policy allows (the security middleware
    has already refused the others' requests)."""

    def __init__(self, app, policy: OriginPolicy) -> None:
        # allow_private_network: an origin the policy allows may reach the loopback address
        # (Chrome's Private Network Access asks it of pages not already on the machine)
        super().__init__(app, allow_origins=["*"] if policy.any else [], allow_methods=METHODS,
                         allow_headers=["*"], allow_private_network=True)
        self.policy = policy

    def is_allowed_origin(self, origin: str) -> bool:
        return self.policy.allows(origin)

    async def __call__(self, scope, receive, send) -> None:
        async def spelled(message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [(_SPELLING.get(k, k), v) for k, v in message.get("headers", [])]
            await send(message)

        await super().__call__(scope, receive, spelled if scope["type"] == "http" else send)


# The CORS names as llama-server (and Ollama) write them: header names are case-insensitive, but
# clients that copy headers into a plain dict, as llama.cpp's server tests do, look them up so.
# (h11 writes a name as given; only these names change, after every check that reads them.)
_SPELLING = {name.lower().encode(): name.encode() for name in (
    "Access-Control-Allow-Origin", "Access-Control-Allow-Methods", "Access-Control-Allow-Headers",
    "Access-Control-Allow-Credentials", "Access-Control-Allow-Private-Network", "Access-Control-Max-Age",
    "Access-Control-Expose-Headers")}
