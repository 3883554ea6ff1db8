"""Argument types the command lines share: a number checked as it is parsed, so a bad one
is argparse's one-line usage error naming the option, before any work starts."""

from __future__ import annotations

import argparse
from collections.abc import Callable

__all__ = ["whole_number"]


def whole_number(minimum: int, unit: str = "") -> Callable[[str], int]:
    """An argparse ``type`` for a whole number of at least ``minimum`` (``unit``: what it
    counts, for the message)."""
    counted = f" {unit}" if unit else ""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value}: give {minimum} or more{counted}")
        return value

    return parse
