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


def positive_float(high: float | None = None, what: str = "a number",
                   unit: str = "") -> Callable[[str], float]:
    """An argparse `type=` accepting numbers above 0 (and at most `high`, in `unit`, if given)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not (value > 0 and (high is None or value <= high)):  # NaN fails both
            bound = "more than 0" + (f" and at most {high:g}{unit}" if high is not None else "")
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")
        return value

    return parse


positive_int = int_in_range(1)
non_negative_int = int_in_range(0)
port_number = int_in_range(0, 65535, "a port number")
