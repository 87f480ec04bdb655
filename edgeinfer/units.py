"""How sizes and counts are written for people: one formatter for every command and screen."""

from __future__ import annotations


def human_bytes(n: int) -> str:
    """Decimal units, as `ollama list` writes them: 4.9 GB, 815 MB, 12 B."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            value = n / scale
            return f"{value:.1f} {unit}" if value < 10 else f"{value:.0f} {unit}"
    return f"{n} B"


def human_count(n: int) -> str:
    """Parameter counts as model cards write them: 268.10M, 8.03B."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)
