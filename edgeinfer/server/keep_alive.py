"""Ollama's `keep_alive`: how long the model stays loaded after a request, parsed and checked.

Values, as Ollama takes them: a Go duration string ("5m", "1h30m", "10s", "250ms"), a
number of seconds, 0 = unload right after the request, negative = keep for ever.
"""

from __future__ import annotations

import math
import re

FOREVER = -1.0
# Go's time.Duration tops out at 2**63 - 1 ns (about 292 years); longer is an error there too.
MAX_SECONDS = (2 ** 63 - 1) / 1e9

_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_PART = re.compile(r"(\d+\.?\d*|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)")


def parse_duration(value: str | int | float) -> float:
    """Seconds (FOREVER for a negative value); ValueError naming the problem otherwise."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(f"expected a duration like \"5m\" or a number of seconds, got {value!r}")
    if isinstance(value, str):
        seconds = _parse_text(value)
    else:
        seconds = float(value)
    if not math.isfinite(seconds):
        raise ValueError(f"{value!r} is not a finite duration")
    if seconds < 0:
        return FOREVER
    if seconds > MAX_SECONDS:
        raise ValueError(f"{value!r} is too long (at most {MAX_SECONDS:.0f} seconds)")
    return seconds


def _parse_text(text: str) -> float:
    t = text.strip()
    if _NUMBER.fullmatch(t):  # a bare number is seconds, as OLLAMA_KEEP_ALIVE takes it
        return float(t)
    sign = -1.0 if t.startswith("-") else 1.0
    body = t[1:] if t[:1] in "+-" else t
    total, pos = 0.0, 0
    while pos < len(body):
        m = _PART.match(body, pos)
        if m is None:
            break
        total += float(m.group(1)) * _UNITS[m.group(2)]
        pos = m.end()
    if not body or pos != len(body):
        raise ValueError(f"{text!r} is not a duration (use a number of seconds or e.g. \"5m\", \"1h30m\")")
    return sign * total

