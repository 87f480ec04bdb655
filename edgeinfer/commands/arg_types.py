"""argparse value types shared by the subcommands: one-line errors for bad numbers."""

from __future__ import annotations

import argparse
from typing import Callable


def int_in_range(low: int, high: int | None = None, what: str = "a whole number") -> Callable[[str], int]:
    """An argparse `type=` accepting integers in [low, high] (no upper bound when high is None)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < low or (high is not None and value > high):
            bound = f"{low}-{high}" if high is not None else f"at least {low}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value

    return parse


positive_int = int_in_range(1)
non_negative_int = int_in_range(0)
port_number = int_in_range(0, 65535, "a port number")
