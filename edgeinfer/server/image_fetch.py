"""Fetching a remote image a client names (serve --allow-image-urls): http(s), a timeout, a byte limit."""
from __future__ import annotations

import http.client
import time
import urllib.error
import urllib.request
from urllib.parse import urlsplit

FETCH_TIMEOUT_S = 10.0   # each network wait
FETCH_TOTAL_S = 30.0     # the whole fetch: a server dripping bytes cannot hold a request for ever
_READ = 1 << 16


class FetchError(Exception):
    """A URL that could not be fetched as an image: the message says why (one line)."""


class _HttpOnlyRedirects(urllib.request.HTTPRedirectHandler):
    # urllib follows redirects to ftp:// too: a redirect may lead to another http(s) URL only
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        if urlsplit(newurl).scheme not in ("http", "https"):
            raise FetchError(f"redirected to a {urlsplit(newurl).scheme or 'relative'} URL, which is not fetched")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def is_remote(url: str) -> bool:
    return urlsplit(url).scheme.lower() in ("http", "https")


def fetch(url: str, limit: int, timeout_s: float = FETCH_TIMEOUT_S, total_s: float = FETCH_TOTAL_S) -> bytes:
    """The body at `url` (http or https), at most `limit` bytes, within `timeout_s` per network
    wait and `total_s` in all; a larger body, an error status or a network failure is a FetchError."""
    if not is_remote(url):
        raise FetchError("only http and https URLs are fetched")
    deadline = time.monotonic() + total_s
    opener = urllib.request.build_opener(_HttpOnlyRedirects)
    request = urllib.request.Request(url, headers={"User-Agent": "edgeinfer", "Accept": "image/*"})
    try:
        with opener.open(request, timeout=timeout_s) as response:
            length = response.headers.get("Content-Length")
            if length is not None and length.strip().isdigit() and int(length) > limit:
                raise FetchError(f"the image is {int(length)} bytes, larger than the {limit}-byte limit")
            data = bytearray()
            while True:  # read in pieces: a server may send more than it announced, or nothing at all
                piece = response.read1(_READ)  # what one receive brings: the deadline is checked between them
                if not piece:
                    break
                data += piece
                if len(data) > limit:
                    raise FetchError(f"the image is larger than the {limit}-byte limit")
                if time.monotonic() > deadline:
                    raise FetchError(f"it took longer than {total_s:g}s")
            return bytes(data)
    except FetchError:
        raise
    except urllib.error.HTTPError as exc:
        raise FetchError(f"the server answered HTTP {exc.code}") from None
    except urllib.error.URLError as exc:
        raise FetchError(f"cannot fetch it: {exc.reason}") from None
    except (OSError, ValueError, http.client.HTTPException) as exc:  # timeouts, resets, a malformed URL or answer
        raise FetchError(f"cannot fetch it: {type(exc).__name__}: {exc}") from None
